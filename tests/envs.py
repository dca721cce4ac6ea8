"""Throwaway Python environments for tests that need a ``sys.prefix`` of their own.

``environment_over_this_one(root)`` makes a virtual environment at ``root`` that sees exactly the
packages the running interpreter sees, whether that interpreter is a plain one (a pyenv or system
Python, as on CI) or itself a virtual environment (a developer's ``.venv``)::

    from envs import environment_over_this_one

    env = environment_over_this_one(tmp_path / "env", packages=["jupyter_kernel_gateway"])
    subprocess.run([str(env.python), "-m", "jupyter", "kernelgateway", ...], env=env.variables())

Why not ``venv --system-site-packages``: a virtual environment made from inside another one gets
the *base* interpreter as its home, so it sees the base interpreter's site-packages and not the
outer environment's, where ``pip install -e ".[test]"`` put everything. Here the new environment
has no system site-packages; a ``.pth`` file in its own site-packages adds the running
interpreter's site folders after it (and so their ``.pth`` files: editable installs included).
What ``packages`` names is pip-installed into the new environment itself (its site-packages comes
first), by the running interpreter's pip; what is already visible is not installed again.

The new environment's ``bin`` also gets the ``jupyter*`` commands (or what ``commands`` names),
rewritten to run its own ``python``, so ``jupyter ... --sys-prefix`` writes into it and never into
the shared interpreter.

``environment_of_its_own(root, packages)`` is the opposite: a virtual environment that sees none of
this interpreter's packages, for a program whose requirements conflict with this environment's
(Jupyter Enterprise Gateway 3 needs ``jupyter_client<7``)::

    eg = environment_of_its_own(tmp_path / "eg", ["jupyter_enterprise_gateway==3.3.0"])
    subprocess.Popen([str(eg.bin / "jupyter"), "enterprisegateway", ...], env=eg.variables())
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Environment", "environment_of_its_own", "environment_over_this_one", "site_folders_of_this_interpreter"]

#: The name of the ``.pth`` file that shows the new environment this interpreter's packages.
PTH_NAME = "_outer_environment.pth"


@dataclass(frozen=True)
class Environment:
    """A virtual environment made by :func:`environment_over_this_one`."""

    root: Path

    @property
    def bin(self) -> Path:
        """Its scripts folder (``python``, ``jupyter*``, and the scripts of packages installed in it)."""
        return self.root / "bin"

    @property
    def python(self) -> Path:
        """Its interpreter: ``sys.prefix`` is :attr:`root` there."""
        return self.bin / "python"

    @property
    def site_packages(self) -> Path:
        """Its own site-packages folder, first on its ``sys.path``."""
        return next((self.root / "lib").glob("python*/site-packages"))

    def variables(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with :attr:`bin` first on ``PATH``."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join([str(self.bin), *[p for p in env.get("PATH", "").split(os.pathsep) if p]])
        env.pop("PYTHONHOME", None)
        return env


def site_folders_of_this_interpreter() -> list[str]:
    """The running interpreter's site folders, in its ``sys.path`` order: its purelib and platlib,
    and every ``site-packages``/``dist-packages`` folder on ``sys.path`` (a venv made with
    ``--system-site-packages`` shows its base's too; a user site when enabled)."""
    folders = [p for p in sys.path if p and os.path.basename(os.path.normpath(p)) in ("site-packages", "dist-packages")]
    for name in ("purelib", "platlib"):
        path = sysconfig.get_path(name)
        if path not in folders:
            folders.append(path)
    return [folder for folder in dict.fromkeys(folders) if os.path.isdir(folder)]


def environment_over_this_one(
    root: Path,
    packages: Sequence[str] = (),
    commands: Iterable[str] = ("jupyter*",),
    pip_timeout: float = 900,
) -> Environment:
    """A virtual environment at ``root`` that sees every package the running interpreter sees.

    ``packages``: pip requirements installed into the new environment (e.g.
    ``["jupyter_kernel_gateway"]``); a failed install raises ``RuntimeError`` with pip's output.
    ``commands``: glob patterns of this interpreter's scripts to copy into the new ``bin``, each
    rewritten to run the new ``python``.
    """
    root = Path(root)
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True, clear=True).create(root)
    env = Environment(root)
    folders = site_folders_of_this_interpreter()
    # One line, run by ``site`` with its own scopes: no comprehension sees the names it imports.
    (env.site_packages / PTH_NAME).write_text(
        "import site, sys; list(map(site.addsitedir, filter(lambda d, seen=set(sys.path): d not in seen, "
        + repr(folders) + ")))\n"
    )
    scripts = Path(sysconfig.get_path("scripts"))
    for pattern in commands:
        for script in sorted(scripts.glob(pattern)):
            target = env.bin / script.name
            if target.exists() or not script.is_file():
                continue
            lines = script.read_text(errors="replace").splitlines(keepends=True)
            if lines and lines[0].startswith("#!") and "python" in lines[0]:
                target.write_text(f"#!{env.python}\n" + "".join(lines[1:]))
                target.chmod(0o755)
    if packages:
        install = [str(env.python), "-m", "pip", "install", "--disable-pip-version-check", "--no-input", *packages]
        done = subprocess.run(install, capture_output=True, text=True, timeout=pip_timeout, env=env.variables(), check=False)
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install {' '.join(packages)} into {root}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return env


def environment_of_its_own(root: Path, packages: Sequence[str], pip_timeout: float = 900) -> Environment:
    """A virtual environment at ``root`` that sees none of the running interpreter's packages: only
    what ``packages`` names (and what it needs), pip-installed into it from the package index by
    the running interpreter's pip (``pip --python``: the new environment gets no pip of its own).

    A failed install raises ``RuntimeError`` with pip's output (an index that cannot be reached
    included)."""
    root = Path(root)
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True, clear=True).create(root)
    env = Environment(root)
    install = [sys.executable, "-m", "pip", "--python", str(env.python), "install", "--disable-pip-version-check",
               "--no-input", "--no-compile", *packages]
    done = subprocess.run(install, capture_output=True, text=True, timeout=pip_timeout, env=env.variables(), check=False)
    if done.returncode != 0:
        raise RuntimeError(f"pip could not install {' '.join(packages)} into {root}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return env
