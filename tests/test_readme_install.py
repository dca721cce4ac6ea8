"""The README's install command works as a new user runs it: in a fresh virtual environment, from a
clean clone of this repository's last commit.

``python3 -m venv .venv``, then the README's ``pip install -e ".[test]"`` in it (which also builds
the lab extension with npm: minutes), then the tests that build environments of their own
(``tests/test_autolease.py`` and ``tests/test_doc_examples.py``) with that environment's
``python -m pytest`` (and envs.py's own tests): they must pass there as with a plain interpreter.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: The tests run inside the fresh environment: those that build environments of their own, and
#: envs.py's own (which tell a nested environment that sees the base interpreter's packages, not
#: the venv's, even where the base interpreter has them all and the others would pass anyway).
INSIDE = ("tests/test_envs.py", "tests/test_autolease.py", "tests/test_doc_examples.py")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                       reason="needs git and a git checkout (it clones the last commit)"),
    pytest.mark.skipif(shutil.which("npm") is None, reason="the README's install builds the lab extension: needs Node.js and npm"),
]


def readme_commands() -> tuple[str, str]:
    """The README Set-up's line for the tests: its install command and its test command."""
    for line in (REPO / "README.md").read_text().splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith("pip install") and "pytest" in command:
            install, test = (part.strip() for part in command.split("&&"))
            return install, test
    raise AssertionError("the README's Set-up has no `pip install ... && python -m pytest` line")


def clean_environment(venv: Path) -> dict[str, str]:
    """This run's environment as a user's shell with ``venv`` activated would have it: none of the
    variables this suite's fixtures set for themselves (a private HOME and TMPDIR stay, and where
    the inner run makes its own: beside this run's, so its socket paths stay short)."""
    dropped = ("GPUPOOL_", "JUPYTER_", "PYTEST_", "SUITE_GUARD_", "IPYTHONDIR", "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(dropped) or k == "SUITE_GUARD_TMP_ROOT"}
    env["VIRTUAL_ENV"] = str(venv)
    env["PATH"] = os.pathsep.join([str(venv / "bin"), env.get("PATH", "")])
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(command: str, cwd: Path, env: dict[str, str], timeout: float, log: Path) -> subprocess.CompletedProcess[str]:
    """``command`` in bash, its output kept in ``log`` too (the last of it is in a failure's message)."""
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    log.write_text(done.stdout + done.stderr)
    return done


def test_the_readme_install_in_a_fresh_venv_from_a_clean_clone_passes_the_environment_tests(tmp_path: Path) -> None:
    install, test = readme_commands()
    assert install == 'pip install -e ".[test]"' and test == "python -m pytest", (install, test)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=300,
                   capture_output=True, text=True)
    assert not (clone / "jupyter_gpupool" / "labextension").exists(), "a clean clone has no built lab extension"
    subprocess.run([sys.executable, "-m", "venv", str(clone / ".venv")], check=True, timeout=300)
    env = clean_environment(clone / ".venv")

    done = run(install, clone, env, 2400, tmp_path / "install.log")
    assert done.returncode == 0, f"`{install}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-6000:]}"
    assert (clone / "jupyter_gpupool" / "labextension" / "static" / "style.js").exists(), "the install did not build the lab extension"

    command = f"{test} {' '.join(INSIDE)} -p no:cacheprovider -q"
    done = run(command, clone, env, 3000, tmp_path / "pytest.log")
    output = done.stdout + done.stderr
    last = output.strip().splitlines()[-1] if output.strip() else ""
    print(f"{command}: {last}")
    assert done.returncode == 0, f"`{command}` in the fresh venv exited {done.returncode}:\n{output[-8000:]}"
    assert re.search(r"\b\d+ passed\b", last) and not re.search(r"\b(failed|error|errors)\b", last), last
    # What ran was the clone, in the venv: not this checkout or this interpreter.
    where = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c", "import jupyter_gpupool; print(jupyter_gpupool.__file__)"],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True).stdout.strip()
    assert Path(where).is_relative_to(clone), shlex.quote(where)
