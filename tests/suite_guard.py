"""A pytest plugin (loaded by conftest.py) that keeps the suite honest about the machine it runs on.

- **A home of its own**: the run gets a private ``HOME`` and ``TMPDIR`` (one fresh folder per run,
  ``gpupool-*`` in the machine's temporary folder, set when pytest configures, before any test,
  fixture or subprocess reads them; ``tmp_path`` lies in it too), so the real home
  is never the tests' to touch and two runs side by side share nothing. The tool settings a
  subprocess needs from the real home (pip's and npm's configuration, git's identity) are copied
  in. Removed at the end of a run that passed; kept, and named, after one that failed (for three
  days: a later run removes it).
- **Sandbox**: no test may write outside its temporary folders. The system-wide Jupyter folders
  (``/etc/jupyter`` and the rest of jupyter_core's system paths) and the real home's Jupyter,
  IPython and gpupool folders are watched by an audit hook in pytest's process and in every Python
  process the tests start (``guard_site/sitecustomize.py``): each write there fails the run, named
  with the test that made it, and what other programs on the machine write (a JupyterLab a person
  runs beside the tests, a broker someone starts) is never taken for the tests'. The system
  folders are also listed (names, sizes, modification times) when the run starts and again when
  it ends: a change no hooked process made is shown, not counted (it may be a program of the
  tests' that is not Python, which a listing cannot tell from another's).
- **Packages the test extra leaves out**: the browser, Slurm, Prometheus and JupyterHub tests need
  programs pip does not install, and one kernel test needs PyTorch (left out of ``[test]``: PyPI's
  build brings gigabytes of CUDA libraries). The header says which are missing; a test skipped for
  want of one is counted in the run's last line, with the command that installs them just above it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import json
import os
import pwd
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

#: The Debian/Ubuntu packages the suite's browser, Slurm and alert-rule tests need (.ci/run installs them).
APT_PACKAGES = ("chromium", "prometheus", "slurm-wlm", "munge")
APT_LINE = "apt-get install -y --no-install-recommends " + " ".join(APT_PACKAGES)
#: The last line's label for tests skipped for want of one of them (or of PyTorch).
SUMMARY_KEY = "for want of packages (see above)"
#: PyTorch's CPU build (a few hundred MB, where PyPI's default brings the CUDA libraries).
TORCH_LINE = "pip install torch --index-url https://download.pytorch.org/whl/cpu"


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
        if self.name == "torch":
            return importlib.util.find_spec("torch") is not None
        return shutil.which(self.name) is not None


NEEDS = (
    SystemNeed("chromium", f"as root: {APT_LINE}", ("chromium",)),
    SystemNeed("slurm-wlm", f"as root: {APT_LINE}", ("slurm is not installed",)),
    SystemNeed("promtool", f"as root: {APT_LINE}", ("promtool",)),
    SystemNeed("configurable-http-proxy", "npm install -g configurable-http-proxy@5", ("configurable-http-proxy",)),
    SystemNeed("torch", TORCH_LINE, ("torch not installed",)),
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


# --- a home of its own ----------------------------------------------------------------------------

#: Names the real home instead of the password database's and $HOME's (this plugin's own test uses it).
REAL_HOME_ENV = "SUITE_GUARD_REAL_HOME"
#: Tool settings copied from the real home into the private one (a subprocess's pip, npm, git).
HOME_SETTINGS = (".gitconfig", ".config/git/config", ".npmrc", ".config/pip/pip.conf", ".pip/pip.conf",
                 ".pydistutils.cfg", ".netrc")
#: Variables that may name folders in the real home: pointed into the private one instead.
HOME_VARIABLES = {"XDG_CONFIG_HOME": ".config", "XDG_DATA_HOME": ".local/share", "XDG_CACHE_HOME": ".cache",
                  "XDG_STATE_HOME": ".local/state", "JUPYTER_CONFIG_DIR": ".jupyter",
                  "JUPYTER_DATA_DIR": ".local/share/jupyter", "JUPYTER_RUNTIME_DIR": ".local/share/jupyter/runtime",
                  "IPYTHONDIR": ".ipython", "GPUPOOL_CACHE_DIR": ".cache/jupyter-gpupool"}
GUARD_SITE = Path(__file__).resolve().parent / "guard_site"


def real_homes() -> list[Path]:
    """This user's home as the password database and $HOME (when the run starts) name it, or
    $SUITE_GUARD_REAL_HOME's (folders separated by os.pathsep) alone where it is set: a run sets it
    for the processes it starts, so pytest-xdist's workers know the real home from their private one."""
    if os.environ.get(REAL_HOME_ENV):
        return list(dict.fromkeys(Path(p).resolve() for p in os.environ[REAL_HOME_ENV].split(os.pathsep) if p))
    homes = [Path(pwd.getpwuid(os.geteuid()).pw_dir), Path(os.path.expanduser("~"))]
    return list(dict.fromkeys(home.resolve() for home in homes))


def _inside(path: str, roots: list[Path]) -> bool:
    return any(Path(path).resolve().is_relative_to(root) for root in roots)


#: Where each run's private folder is made: the machine's temporary folder, passed on to the runs a
#: test starts (their folders are siblings of this run's, not nested in it: a Unix socket's path
#: must stay under 108 bytes).
TMP_ROOT_ENV = "SUITE_GUARD_TMP_ROOT"


#: The file that marks a folder as a run's private one.
MARK = "suite-guard-run"
#: A failed run's folder is kept this long (seconds) for a look, then removed by a later run.
KEEP_FAILED = 3 * 24 * 3600


def forget_old_runs(root: Path) -> None:
    """Remove the private folders of runs older than :data:`KEEP_FAILED` (a failed or killed run's)."""
    for folder in root.glob("gpupool-*"):
        with contextlib.suppress(OSError):
            if (folder / MARK).is_file() and time.time() - (folder / MARK).stat().st_mtime > KEEP_FAILED:
                shutil.rmtree(folder, ignore_errors=True)


def make_private_home(homes: list[Path]) -> Path:
    """A fresh folder with ``home`` and ``tmp`` in it, made ``$HOME`` and ``$TMPDIR`` of this
    process (and so of every subprocess); the variables that named folders in a real home now name
    their defaults under the private one. Returns the folder."""
    root = os.environ.get(TMP_ROOT_ENV) or tempfile.gettempdir()
    os.environ[TMP_ROOT_ENV] = root
    forget_old_runs(Path(root))
    base = Path(tempfile.mkdtemp(prefix="gpupool-", dir=root)).resolve()
    (base / MARK).write_text("a test run's private HOME and TMPDIR (tests/suite_guard.py)\n")
    home, tmp = base / "home", base / "tmp"
    home.mkdir()
    tmp.mkdir()
    # As the system's own: tests run processes as other users (a broker's peers), which must reach TMPDIR.
    base.chmod(0o755)
    tmp.chmod(0o1777)
    for name in HOME_SETTINGS:
        for real in homes:
            if (real / name).is_file():
                (home / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(real / name, home / name)
                shutil.copymode(real / name, home / name)  # a 0600 .npmrc or .netrc stays 0600
                break
    # A worker of pytest-xdist starts with its controller's private home as $HOME: that one is left too.
    repointed = [*homes, Path(os.environ.get("HOME") or homes[0]).resolve()]
    for variable, under in HOME_VARIABLES.items():
        if variable in os.environ and _inside(os.environ[variable], repointed):
            os.environ[variable] = str(home / under)
    os.environ["HOME"] = str(home)
    os.environ["TMPDIR"] = str(tmp)
    tempfile.tempdir = None  # forget the folder tempfile chose before
    return base


# --- the sandbox -------------------------------------------------------------------------------------


#: More folders to list before and after the run, separated by os.pathsep (this plugin's own test uses it).
EXTRA_ROOTS_ENV = "SUITE_GUARD_WATCH"


def watched_roots() -> list[Path]:
    """Folders listed before and after the run: Jupyter's system-wide ones and $SUITE_GUARD_WATCH's."""
    from jupyter_core.paths import SYSTEM_CONFIG_PATH, SYSTEM_JUPYTER_PATH

    roots = [Path(p) for p in [*SYSTEM_CONFIG_PATH, *SYSTEM_JUPYTER_PATH, "/etc/jupyter"]]
    roots += [Path(p) for p in os.environ.get(EXTRA_ROOTS_ENV, "").split(os.pathsep) if p]
    return list(dict.fromkeys(roots))


def watched_home_folders(homes: list[Path]) -> list[Path]:
    """The real home's folders no test may write in (whoever's process it is: the hook tells)."""
    return [home / inside for home in homes for inside in (".jupyter", ".local/share/jupyter", ".ipython",
                                                              ".cache/jupyter-gpupool", ".config/jupyter-gpupool")]


def not_watched() -> set[str]:
    """Folders left out of the listings (none by default)."""
    return set()


#: Files left out of the listings.
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
_OTHERS = pytest.StashKey[list[str]]()
_PRIVATE = pytest.StashKey[Path]()
_PASSED = pytest.StashKey[bool]()


def watch_writes(folders: list[Path], skipped: list[Path], log: Path) -> None:
    """Record writes under ``folders`` (less ``skipped``) in ``log``, here and in every Python
    process started from now on (``guard_site`` first on ``PYTHONPATH``)."""
    os.environ["SUITE_GUARD_WRITES_LOG"] = str(log)
    os.environ["SUITE_GUARD_WRITES_WATCHED"] = os.pathsep.join(map(str, folders))
    os.environ["SUITE_GUARD_WRITES_SKIPPED"] = os.pathsep.join(map(str, skipped))
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(GUARD_SITE)]
    os.environ["PYTHONPATH"] = os.pathsep.join([str(GUARD_SITE), *parts])
    spec = importlib.util.spec_from_file_location("_suite_guard_write_watch", GUARD_SITE / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install_write_watch()


def writes_recorded(log: Path) -> list[dict[str, Any]]:
    """The writes the hooks recorded: path, event, pid, argv and the test that made each."""
    if not log.exists():
        return []
    writes = []
    for raw in log.read_text(errors="replace").splitlines():
        try:
            writes.append(json.loads(raw))
        except ValueError:
            continue
    return writes


def leak_lines(writes: list[dict[str, Any]]) -> list[str]:
    """One line per recorded write, naming the test that made it."""
    lines = [f"wrote    {w['path']} ({w['event']}, in {w.get('test') or 'no test'}, pid {w['pid']}: {' '.join(w['argv'])})"
             for w in writes]
    return list(dict.fromkeys(lines))


def others_changes(listed: list[str], writes: list[dict[str, Any]]) -> list[str]:
    """The listings' differences that no hooked process wrote: made meanwhile by a program the tests
    did not start (or by one of theirs that is not Python, which the listing cannot tell apart)."""
    written = {w["path"] for w in writes}
    return [line for line in listed if line.split(maxsplit=1)[1] not in written]


def is_xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is one of pytest-xdist's workers (its controller lists and reports)."""
    return hasattr(config, "workerinput")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    homes = real_homes()
    os.environ[REAL_HOME_ENV] = os.pathsep.join(map(str, homes))
    private = make_private_home(homes)
    config.stash[_PRIVATE] = private
    if getattr(config.option, "basetemp", "") is None:  # tmp_path in the private TMPDIR, its paths no longer than pytest's own
        config.option.basetemp = str(private / "tmp" / "pytest")
    roots = watched_roots()
    if is_xdist_worker(config):
        # Writes go to the controller's log, which it reads at the end of the run; each worker's
        # own private folder is left out of the watch as the controller's is.
        log = Path(os.environ["SUITE_GUARD_WRITES_LOG"])
        skipped = [Path(p) for p in os.environ.get("SUITE_GUARD_WRITES_SKIPPED", "").split(os.pathsep) if p]
        watch_writes([*watched_home_folders(homes), *roots], [*skipped, private], log)
        return
    watch_writes([*watched_home_folders(homes), *roots], [private], private / "writes.jsonl")
    config.stash[_ROOTS] = roots
    config.stash[_BEFORE] = snapshot(roots)


def pytest_unconfigure(config: pytest.Config) -> None:
    private = config.stash.get(_PRIVATE, None)
    if private is not None and config.stash.get(_PASSED, False):
        shutil.rmtree(private, ignore_errors=True)


def pytest_report_header(config: pytest.Config) -> list[str]:
    missing = [need for need in NEEDS if not need.present()]
    if not missing:
        return []
    commands = " && ".join(dict.fromkeys(need.install for need in missing))
    return [f"gpupool: not on this machine: {', '.join(n.name for n in missing)} (their tests will skip; to install: {commands})"]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if is_xdist_worker(config):  # its private folder is kept after a failure, as a run's is
        config.stash[_PASSED] = session.exitstatus == pytest.ExitCode.OK
        return
    if _BEFORE not in config.stash:
        return
    roots: list[Path] = config.stash[_ROOTS]
    writes = writes_recorded(config.stash[_PRIVATE] / "writes.jsonl") if _PRIVATE in config.stash else []
    leaks = leak_lines(writes)
    config.stash[_LEAKS] = leaks
    config.stash[_OTHERS] = others_changes(changes(config.stash[_BEFORE], snapshot(roots)), writes)
    if leaks:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    config.stash[_PASSED] = session.exitstatus == pytest.ExitCode.OK


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
    others = config.stash.get(_OTHERS, [])
    if others:
        terminalreporter.write_sep("=", "changed meanwhile by programs the tests did not start (not counted)", yellow=True)
        for line in others[:20]:
            terminalreporter.write_line(line)
        if len(others) > 20:
            terminalreporter.write_line(f"... and {len(others) - 20} more")
    private = config.stash.get(_PRIVATE, None)
    if private is not None and exitstatus != pytest.ExitCode.OK:
        terminalreporter.write_line(f"gpupool: the run's private HOME and TMPDIR are kept in {private}")
    skipped = [(report, need) for report in terminalreporter.stats.get("skipped", [])
               if (need := need_of(skip_reason(report))) is not None]
    if skipped:
        counts = Counter(need.name for _, need in skipped)
        commands = " && ".join(dict.fromkeys(need.install for _, need in skipped))
        what = ", ".join(f"{name}: {count}" for name, count in counts.items())
        terminalreporter.write_sep("=", "skipped for want of packages the test extra leaves out", yellow=True)
        terminalreporter.write_line(f"{len(skipped)} tests skipped because this machine lacks them ({what}).")
        terminalreporter.write_line(f"Install them and run again: {commands}")
        terminalreporter.stats[SUMMARY_KEY] = [report for report, _ in skipped]


class _Counted:
    """One entry of a custom count in pytest's last line."""

    count_towards_summary = True
