"""A pytest plugin (loaded by conftest.py) that keeps the suite honest about the machine it runs on.

- **Sandbox**: no test may write outside its temporary folders. The system-wide Jupyter folders
  (``/etc/jupyter`` and the rest of jupyter_core's system paths) and the real home's Jupyter,
  IPython and cache folders are listed (names, sizes, modification times) when the run starts and
  again when it ends; any difference fails the run, naming each path. Left out: the connection
  files and IPython history the user's own sessions write meanwhile.
- **System packages**: the browser, Slurm, Prometheus and JupyterHub tests need programs pip does
  not install. The header says which are missing; a test skipped for want of one is counted in
  the run's last line, with the command that installs them just above it.
"""

from __future__ import annotations

import fnmatch
import os
import pwd
import shutil
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The Debian/Ubuntu packages the suite's browser, Slurm and alert-rule tests need (.ci/run installs them).
APT_PACKAGES = ("chromium", "prometheus", "slurm-wlm", "munge")
APT_LINE = "apt-get install -y --no-install-recommends " + " ".join(APT_PACKAGES)
#: The last line's label for tests skipped for want of one of them.
SUMMARY_KEY = "for want of system packages (see above)"


@dataclass(frozen=True)
class SystemNeed:
    """A program some tests need, how to get it, and how their skip reasons name it."""

    name: str
    install: str
    words: tuple[str, ...]  # lower-case; a skip reason naming one of these is a skip for want of this

    def present(self) -> bool:
        if self.name == "chromium":
            return Path("/usr/bin/chromium").exists()
        if self.name == "slurm-wlm":
            return all(shutil.which(tool) or Path("/usr/sbin", tool).exists() for tool in ("slurmctld", "slurmd", "munged", "sbatch"))
        return shutil.which(self.name) is not None


NEEDS = (
    SystemNeed("chromium", APT_LINE, ("chromium",)),
    SystemNeed("slurm-wlm", APT_LINE, ("slurm is not installed",)),
    SystemNeed("promtool", APT_LINE, ("promtool",)),
    SystemNeed("configurable-http-proxy", "npm install -g configurable-http-proxy@5", ("configurable-http-proxy",)),
)


def need_of(reason: str) -> SystemNeed | None:
    """The system package a skip reason says is missing, if any."""
    text = reason.lower()
    return next((need for need in NEEDS if any(word in text for word in need.words)), None)


def skip_reason(report: Any) -> str:
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr or "")


# --- the sandbox -------------------------------------------------------------------------------------


def real_homes() -> list[Path]:
    """This user's home as the password database and $HOME (when the run starts) name it."""
    homes = [Path(pwd.getpwuid(os.geteuid()).pw_dir), Path(os.path.expanduser("~"))]
    return list(dict.fromkeys(home.resolve() for home in homes))


#: More folders to watch, separated by os.pathsep (this plugin's own test uses it).
EXTRA_ROOTS_ENV = "SUITE_GUARD_WATCH"


def watched_roots() -> list[Path]:
    """Folders no test may write in: Jupyter's system-wide ones, the real home's, and $SUITE_GUARD_WATCH's."""
    from jupyter_core.paths import SYSTEM_CONFIG_PATH, SYSTEM_JUPYTER_PATH

    roots = [Path(p) for p in [*SYSTEM_CONFIG_PATH, *SYSTEM_JUPYTER_PATH, "/etc/jupyter"]]
    for home in real_homes():
        roots += [home / ".jupyter", home / ".local" / "share" / "jupyter", home / ".ipython",
                  home / ".cache" / "jupyter-gpupool", home / ".config" / "jupyter-gpupool"]
    roots += [Path(p) for p in os.environ.get(EXTRA_ROOTS_ENV, "").split(os.pathsep) if p]
    return list(dict.fromkeys(roots))


def not_watched() -> set[str]:
    """Folders left out: where the user's own Jupyter servers, running while the tests do, write
    their connection files; a change there cannot be pinned on the tests."""
    return {str(home / ".local" / "share" / "jupyter" / "runtime") for home in real_homes()}


#: Files left out for the same reason: the history of the user's own IPython sessions.
NOT_WATCHED_FILES = ("*/.ipython/profile_*/history.sqlite*",)


MAX_ENTRIES = 50_000


def snapshot(roots: Iterable[Path], skip: set[str] | None = None) -> dict[str, tuple[int, int]]:
    """Path → (modification time in ns, size) of each file under the roots, and (0, -1) for each folder
    (its presence: its own time moves with whatever comes and goes in it), less the folders in ``skip``."""
    skip = not_watched() if skip is None else skip
    found: dict[str, tuple[int, int]] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if os.path.join(folder, d) not in skip]
            kept = [os.path.join(folder, f) for f in files]
            kept = [f for f in kept if not any(fnmatch.fnmatch(f, pattern) for pattern in NOT_WATCHED_FILES)]
            for path, is_dir in [(folder, True), *((f, False) for f in kept)]:
                try:
                    stat = os.lstat(path)
                except OSError:
                    continue
                found[path] = (0, -1) if is_dir else (stat.st_mtime_ns, stat.st_size)
            if len(found) >= MAX_ENTRIES:
                return found
    return found


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Each path created, removed or modified between two snapshots, with what happened to it."""
    lines = [f"created  {path}" for path in sorted(after.keys() - before.keys())]
    lines += [f"removed  {path}" for path in sorted(before.keys() - after.keys())]
    lines += [f"modified {path}" for path in sorted(before.keys() & after.keys()) if before[path] != after[path]]
    return lines


# --- the hooks ---------------------------------------------------------------------------------------

_BEFORE = pytest.StashKey[dict[str, tuple[int, int]]]()
_ROOTS = pytest.StashKey[list[Path]]()
_LEAKS = pytest.StashKey[list[str]]()


def pytest_configure(config: pytest.Config) -> None:
    roots = watched_roots()
    config.stash[_ROOTS] = roots
    config.stash[_BEFORE] = snapshot(roots)


def pytest_report_header(config: pytest.Config) -> list[str]:
    missing = [need for need in NEEDS if not need.present()]
    if not missing:
        return []
    commands = " && ".join(dict.fromkeys(need.install for need in missing))
    return [f"gpupool: not on this machine: {', '.join(n.name for n in missing)} (their tests will skip; as root: {commands})"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if _BEFORE not in config.stash:
        return
    roots: list[Path] = config.stash[_ROOTS]
    leaks = changes(config.stash[_BEFORE], snapshot(roots))
    config.stash[_LEAKS] = leaks
    if leaks:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    leaks = config.stash.get(_LEAKS, [])
    if leaks:
        terminalreporter.write_sep("=", "tests wrote outside their sandbox", red=True, bold=True)
        for line in leaks[:50]:
            terminalreporter.write_line(line)
        if len(leaks) > 50:
            terminalreporter.write_line(f"... and {len(leaks) - 50} more")
        terminalreporter.write_line("A test must keep every file in its temporary folders (see tests/suite_guard.py).")
        terminalreporter.stats.setdefault("wrote outside the sandbox", []).append(_Counted())
    skipped = [(report, need) for report in terminalreporter.stats.get("skipped", [])
               if (need := need_of(skip_reason(report))) is not None]
    if skipped:
        counts = Counter(need.name for _, need in skipped)
        commands = " && ".join(dict.fromkeys(need.install for _, need in skipped))
        what = ", ".join(f"{name}: {count}" for name, count in counts.items())
        terminalreporter.write_sep("=", "skipped for want of system packages", yellow=True)
        terminalreporter.write_line(f"{len(skipped)} tests skipped because this machine lacks them ({what}).")
        terminalreporter.write_line(f"Install them (as root) and run again: {commands}")
        terminalreporter.stats[SUMMARY_KEY] = [report for report, _ in skipped]


class _Counted:
    """One entry of a custom count in pytest's last line."""

    count_towards_summary = True
