"""The suite's own guard (tests/suite_guard.py): a write outside the sandbox fails the run, naming the
path; a skip for want of a system package is counted in the last line, with the command that fixes it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import suite_guard
from suite_guard import APT_LINE, APT_PACKAGES, SUMMARY_KEY, changes, need_of, snapshot, watched_roots

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_a_snapshot_sees_files_created_modified_and_removed_and_skips_what_it_is_told(tmp_path: Path) -> None:
    root = tmp_path / "etc-jupyter"
    (root / "runtime").mkdir(parents=True)
    (root / "kept.json").write_text("{}")
    (root / "gone.json").write_text("{}")
    before = snapshot([root, tmp_path / "absent"], skip={str(root / "runtime")})
    assert snapshot([root], skip={str(root / "runtime")}) == before  # reading changes nothing
    (root / "runtime" / "kernel-1.json").write_text("{}")  # not watched
    assert changes(before, snapshot([root], skip={str(root / "runtime")})) == []
    (root / "gpupool-broker.json").write_text("{}")
    (root / "kept.json").write_text('{"changed": true}')
    (root / "gone.json").unlink()
    found = changes(before, snapshot([root], skip={str(root / "runtime")}))
    assert f"created  {root / 'gpupool-broker.json'}" in found
    assert f"removed  {root / 'gone.json'}" in found
    assert f"modified {root / 'kept.json'}" in found


def test_the_system_folders_and_the_real_home_are_watched() -> None:
    roots = {str(p) for p in watched_roots()}
    assert "/etc/jupyter" in roots
    home = Path(os.path.expanduser("~")).resolve()
    for inside in (".jupyter", ".local/share/jupyter", ".cache/jupyter-gpupool"):
        assert str(home / inside) in roots


def test_every_skip_for_a_missing_package_in_the_suite_is_recognised() -> None:
    from slurm_cluster import MISSING
    from test_labextension import needs_chromium
    from test_metrics import needs_promtool

    assert need_of(needs_chromium.kwargs["reason"]).name == "chromium"
    assert need_of(needs_promtool.kwargs["reason"]).name == "promtool"
    assert need_of(MISSING.format(names="slurmctld, sbatch")).name == "slurm-wlm"
    assert need_of("configurable-http-proxy is not installed (npm install -g configurable-http-proxy@5)") is not None
    assert need_of("needs root to connect as another Unix user") is None


def test_ci_and_the_readme_install_what_the_guard_names() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    installed = re.search(r"apt-get install (.*?)(?:>|$)", ci, re.MULTILINE)
    assert installed, ".ci/run installs no apt packages"
    assert set(APT_PACKAGES) <= set(shlex.split(installed.group(1))), installed.group(1)
    assert APT_LINE in (REPO / "README.md").read_text(), "the README's Set-up must give the line the guard prints"


def run_guarded(tmp_path: Path, test_source: str, watched: Path) -> subprocess.CompletedProcess[str]:
    """A small suite with only this plugin, in a subprocess watching ``watched`` too."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text('pytest_plugins = ["suite_guard"]\n')
    (project / "test_sample.py").write_text(textwrap.dedent(test_source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           suite_guard.EXTRA_ROOTS_ENV: str(watched)}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", str(project)],
                          capture_output=True, text=True, env=env, cwd=project, timeout=120, check=False)


def test_a_write_outside_the_sandbox_fails_the_run_naming_the_path(tmp_path: Path) -> None:
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    result = run_guarded(tmp_path, f"""
        def test_writes_a_system_file():
            open({str(watched / 'gpupool-broker.json')!r}, "w").write("{{}}")
        """, watched)
    assert result.returncode == 1, result.stdout
    assert "tests wrote outside their sandbox" in result.stdout
    assert f"created  {watched / 'gpupool-broker.json'}" in result.stdout
    assert "1 passed, 1 wrote outside the sandbox" in result.stdout.splitlines()[-1]


def test_a_clean_run_passes_and_a_skip_for_want_of_a_package_is_in_the_last_line(tmp_path: Path) -> None:
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    result = run_guarded(tmp_path, """
        import pytest

        @pytest.mark.skipif(True, reason="needs Debian chromium (.ci/run installs it)")
        def test_in_a_browser():
            pass

        def test_other():
            pytest.skip("needs root to run a process as another user")
        """, watched)
    assert result.returncode == 0, result.stdout
    last = result.stdout.splitlines()[-1]
    assert f"2 skipped, 1 {SUMMARY_KEY}" in last, last
    assert "1 tests skipped because this machine lacks them (chromium: 1)" in result.stdout
    assert f"Install them (as root) and run again: {APT_LINE}" in result.stdout


@pytest.mark.parametrize("present", [True, False])
def test_the_header_names_what_is_missing(present: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite_guard.SystemNeed, "present", lambda self: present or self.name != "promtool")
    header = suite_guard.pytest_report_header(None)  # type: ignore[arg-type]
    if present:
        assert header == []
    else:
        assert header == [f"gpupool: not on this machine: promtool (their tests will skip; as root: {APT_LINE})"]


def test_what_the_users_own_sessions_write_meanwhile_is_left_out(tmp_path: Path) -> None:
    profile = tmp_path / ".ipython" / "profile_default"
    profile.mkdir(parents=True)
    before = snapshot([tmp_path / ".ipython"])
    (profile / "history.sqlite").write_text("their own IPython's history")
    (profile / "history.sqlite-journal").write_text("")
    assert changes(before, snapshot([tmp_path / ".ipython"])) == []
    (profile / "startup").mkdir()
    assert changes(before, snapshot([tmp_path / ".ipython"])) == [f"created  {profile / 'startup'}"]
