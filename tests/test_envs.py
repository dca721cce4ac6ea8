"""tests/envs.py: an environment built over the running interpreter sees exactly its packages,
whether that interpreter is a virtual environment or a plain one, and takes extra packages of its own."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from envs import environment_over_this_one, site_folders_of_this_interpreter

PROBE = (
    "import json, sys, pytest, jupyter_client\n"
    "print(json.dumps({'prefix': sys.prefix, 'pytest': pytest.__file__, 'jupyter_client': jupyter_client.__file__,"
    " 'path': sys.path}))"
)


def probe(python: Path, code: str = PROBE) -> dict:
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    return json.loads(done.stdout)


def test_the_environment_sees_this_interpreters_packages_with_a_prefix_of_its_own(tmp_path: Path) -> None:
    import jupyter_client

    env = environment_over_this_one(tmp_path / "env")
    seen = probe(env.python)
    assert Path(seen["prefix"]) == env.root != Path(sys.prefix)
    # The same files as here: a venv's packages from inside a venv, not its base interpreter's.
    assert seen["pytest"] == pytest.__file__ and seen["jupyter_client"] == jupyter_client.__file__
    path = seen["path"]
    assert path.index(str(env.site_packages)) < min(path.index(folder) for folder in site_folders_of_this_interpreter())
    assert (env.bin / "jupyter").read_text().startswith(f"#!{env.python}\n")


def test_an_environment_made_from_inside_another_one_sees_the_outer_ones_packages(tmp_path: Path) -> None:
    """The case a developer's ``.venv`` is: build one, then build a second from its interpreter."""
    outer = environment_over_this_one(tmp_path / "outer", commands=())
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from envs import environment_over_this_one; print(environment_over_this_one(Path(sys.argv[2]), commands=()).python)"
    )
    made = subprocess.run([str(outer.python), "-c", code, str(Path(__file__).parent), str(tmp_path / "inner")],
                          capture_output=True, text=True, timeout=120, check=True)
    inner = Path(made.stdout.strip())
    assert probe(inner)["pytest"] == pytest.__file__
    assert Path(probe(inner)["prefix"]) == tmp_path / "inner"


def tiny_wheel(folder: Path, name: str = "gpupool_probe_pkg", version: str = "1.0") -> Path:
    """A pure-Python wheel with one module (``name``), made by hand: pip installs it offline."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": b"ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


def test_packages_are_installed_into_the_new_environment_only(tmp_path: Path) -> None:
    wheel = tiny_wheel(tmp_path)
    env = environment_over_this_one(tmp_path / "env", packages=[str(wheel)], commands=())
    seen = probe(env.python, "import json, gpupool_probe_pkg; print(json.dumps({'at': gpupool_probe_pkg.__file__}))")
    assert Path(seen["at"]).parent == env.site_packages
    here = subprocess.run([sys.executable, "-c", "import gpupool_probe_pkg"], capture_output=True, timeout=60, check=False)
    assert here.returncode != 0, "installed into the running interpreter too"


def test_a_package_pip_cannot_install_says_so(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="pip could not install"):
        environment_over_this_one(tmp_path / "env", packages=[str(tmp_path / "no-such.whl")], commands=())
