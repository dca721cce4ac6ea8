"""binder/: the files Binder runs exist, are executable, and set up the simulated pool."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_binder_files():
    env = yaml.safe_load((ROOT / "binder" / "environment.yml").read_text())
    assert any(str(dep).startswith("python") for dep in env["dependencies"])
    post_build = ROOT / "binder" / "postBuild"
    start = ROOT / "binder" / "start"
    assert post_build.stat().st_mode & 0o111 and start.stat().st_mode & 0o111
    assert "jupyter gpupool demo --dry-run" in post_build.read_text()
    assert "GPUPOOL_SIMULATE" in start.read_text() and 'exec "$@"' in start.read_text()
