"""Run the kernel, session and client tests of jupyter_server, nbclient, papermill and
jupyter_client — at the versions installed here, from their sdists on the package index — twice:
*bare* (every hook of ours off) and *active* (the project on a roomy simulated pool), and fail on
any test whose outcome differs.

    python -m tests.upstream                 # the CI subset (tests/test_upstream_suites.py runs it)
    python -m tests.upstream --all           # every default test path of the four packages
    python -m tests.upstream --package nbclient --test nbclient=tests/test_client.py -k parallel

Exit status: 0 no difference, 1 some test's outcome differs (table printed), 2 the runs could not
be made (download failed, a run ended without results, bad option).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from jupyter_gpupool.apps.workload import cache_folder

HERE = Path(__file__).resolve().parent

#: What switches off the hooks that do not come from a provisioner, a server extension or a
#: ``GPUPOOL_*`` pool setting (all three are absent from a bare run anyway): the IPython kernel
#: config file the package installs, which makes an ipykernel kernel lease by itself, honours this
#: opt-out. The one place to name any further such switch.
BARE_OPT_OUTS: dict[str, str] = {"GPUPOOL_AUTOLEASE": "off"}

#: Differences that come from how a test is built, not from the project, each with its reason:
#: reported as expected, never failing the comparison (``--strict`` counts them too).
INHERENT_DIFFERENCES: dict[tuple[str, str], str] = {
    ("jupyter_client", "tests/test_provisioning.py::TestDiscovery::test_find_all_specs"):
        "the test replaces the installed provisioners with its own list, so the default that "
        "$JUPYTER_DEFAULT_PROVISIONER_NAME names is missing there (as any provisioner not in its list would be)",
}

#: The roomy simulated pool of an active run.
ACTIVE_POOL = "2xA100-80GB"

#: Variables a run inherits from the caller; everything else (GPUPOOL_*, JUPYTER_*, IPYTHONDIR,
#: PYTEST_ADDOPTS, ...) is dropped so the caller's set-up cannot reach either run.
INHERITED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
             "VIRTUAL_ENV", "CONDA_PREFIX", "SSL_CERT_FILE", "SSL_CERT_DIR")


@dataclass(frozen=True)
class Suite:
    """One upstream package's tests: where they lie in its sdist and how they must be run."""

    name: str  #: distribution name, as installed
    paths: tuple[str, ...]  #: the kernel, session and client tests (``--all``)
    ci_paths: tuple[str, ...]  #: the subset CI runs: the kernel start, stop, restart and failure tests, in ≤ 6 minutes on 2 cores
    installed_package: str | None  #: the sdist's copy of the package, removed so the installed one is tested
    pytest_args: tuple[str, ...] = ()
    server_extension: bool = False  #: active = the server extension loaded (else: the provisioner default)


SUITES: dict[str, Suite] = {
    suite.name: suite
    for suite in (
        Suite("jupyter_server",
              paths=("tests/services/kernels", "tests/services/sessions", "tests/services/api", "tests/test_serverapp.py"),
              ci_paths=("tests/services/kernels/test_api.py", "tests/services/kernels/test_restart_error.py",
                        "tests/services/kernels/test_transport_encryption.py",
                        *(f"tests/services/sessions/test_api.py::{name}" for name in (
                            "test_create", "test_create_bad", "test_create_bad_pending", "test_delete", "test_restart_kernel"))),
              installed_package="jupyter_server", pytest_args=("-p", "no:asyncio"), server_extension=True),
        Suite("nbclient",
              paths=("tests",),
              ci_paths=tuple(f"tests/test_client.py::{name}" for name in (
                  "test_parallel_notebooks", "test_many_parallel_notebooks", "test_async_parallel_notebooks",
                  "test_many_async_parallel_notebooks", "test_synchronous_setup_kernel",
                  "test_startnewkernel_with_kernelmanager", "test_start_new_kernel_client_cleans_up_kernel_on_failure",
                  "TestExecute::test_kernel_death_after_timeout", "TestExecute::test_kernel_death_during_execution",
                  "TestExecute::test_sync_kernel_manager", "TestExecute::test_custom_kernel_manager",
                  "TestExecute::test_empty_kernel_name")),
              installed_package="nbclient", pytest_args=("-o", "asyncio_default_fixture_loop_scope=function")),
        # papermill's tests live inside its package (relative imports): its sdist copy, the same
        # release as the installed one, is the one imported.
        Suite("papermill",
              paths=("papermill/tests/test_execute.py", "papermill/tests/test_engines.py",
                     "papermill/tests/test_autosave.py", "papermill/tests/test_clientwrap.py"),
              ci_paths=("papermill/tests/test_execute.py",),
              installed_package=None),
        Suite("jupyter_client",
              paths=("tests/test_kernelmanager.py", "tests/test_multikernelmanager.py", "tests/test_client.py",
                     "tests/test_provisioning.py", "tests/test_restarter.py"),
              ci_paths=("tests/test_kernelmanager.py", "tests/test_provisioning.py"),
              installed_package="jupyter_client", pytest_args=("-p", "no:asyncio")),
    )
}

MODES = ("bare", "active")

#: How many times one run resumes after a test that hung.
MAX_RESUMES = 5


class RunnerError(Exception):
    """The runs could not be made; the message says why and what to do."""


@dataclass
class RunResult:
    """The per-test outcomes of one pytest run of one suite in one mode."""

    suite: str
    mode: str
    outcomes: dict[str, str] = field(default_factory=dict)  #: node id → passed/failed/error/skipped/xfailed/hung
    messages: dict[str, str] = field(default_factory=dict)  #: node id → first line of its failure
    leases: int | None = None  #: leases the active pool recorded (None when bare)
    stopped: bool = False  #: killed at --run-timeout: the tests it did not reach are absent
    seconds: float = 0.0
    log: Path | None = None

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())


def sdist_cache() -> Path:
    """Where downloaded sdists are kept: ``$GPUPOOL_CACHE_DIR/upstream`` (else ``~/.cache/jupyter-gpupool/upstream``)."""
    return cache_folder() / "upstream"


def installed_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        raise RunnerError(f"{name} is not installed here; install it (pip install -e '.[test]') or leave it out with --package") from None


#: The index the sdists come from where pip's own setting names none.
DEFAULT_INDEX = "https://pypi.org/simple"


def fetch_sdist(name: str, ver: str, cache: Path, timeout: float = 300) -> Path:
    """The sdist of ``name==ver`` from the package index, downloaded once into ``cache``: the file
    itself from the index's JSON listing (seconds), else through ``pip download`` (which builds the
    package's build tools from source to read its metadata: minutes on a busy machine)."""
    def cached() -> Path | None:
        wanted = _sdist_stem(name, ver)
        for candidate in sorted(cache.glob("*.tar.gz")):
            if _normalized(candidate.name[: -len(".tar.gz")]) == wanted:
                return candidate
        return None

    found = cached()
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    if download_from_index(name, ver, cache, timeout=min(timeout, 120)):
        found = cached()
        if found is not None:
            return found
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"{name}=={ver}", "--dest", str(cache)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RunnerError(f"downloading the {name} {ver} sdist took over {timeout:.0f} s; check the package index is reachable") from None
    found = cached()
    if done.returncode != 0 or found is None:
        last = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
        raise RunnerError(f"could not download the {name} {ver} sdist ({last[-1] if last else 'no sdist'}); "
                          "check the package index is reachable")
    return found


def _normalized(stem: str) -> str:
    return stem.replace("-", "_").replace(".", "_").lower()


def _sdist_stem(name: str, ver: str) -> str:
    return _normalized(name) + "_" + _normalized(ver)


def download_from_index(name: str, ver: str, cache: Path, timeout: float = 120) -> bool:
    """Fetch the sdist of ``name==ver`` named in the index's JSON listing (PEP 691; the index is
    ``$PIP_INDEX_URL`` or PyPI's), checked against the listing's sha256, into ``cache``. False
    where the index gives no such listing or file, so the caller can ask pip instead."""
    import hashlib
    import urllib.error
    import urllib.parse
    import urllib.request

    index = (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")
    project = name.replace("_", "-").replace(".", "-").lower()
    listing = urllib.request.Request(f"{index}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(listing, timeout=timeout) as answer:
            files = json.load(answer).get("files", [])
        wanted = _sdist_stem(name, ver)
        entry = next((f for f in files if f.get("filename", "").endswith(".tar.gz")
                      and _normalized(f["filename"][: -len(".tar.gz")]) == wanted), None)
        if entry is None or not entry.get("hashes", {}).get("sha256"):
            return False
        with urllib.request.urlopen(urllib.parse.urljoin(f"{index}/{project}/", entry["url"]), timeout=timeout) as answer:
            body = answer.read()
    except (OSError, ValueError, urllib.error.URLError):
        return False
    if hashlib.sha256(body).hexdigest() != entry["hashes"]["sha256"]:
        return False
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / (entry["filename"] + ".part")
    partial.write_bytes(body)
    partial.replace(cache / entry["filename"])
    return True


def extract(sdist: Path, into: Path, suite: Suite) -> Path:
    """A fresh copy of the sdist's tree under ``into``, with the package itself removed where its
    tests can import the installed one."""
    with tarfile.open(sdist) as archive:
        tops = {member.name.split("/", 1)[0] for member in archive.getmembers()}
        if len(tops) != 1:
            raise RunnerError(f"{sdist.name} does not hold one top folder; delete it from {sdist.parent} and run again")
        archive.extractall(into, filter="data")
    tree = into / tops.pop()
    if suite.installed_package:
        shutil.rmtree(tree / suite.installed_package)
    return tree


def run_environment(mode: str, suite: Suite, scratch: Path) -> dict[str, str]:
    """A clean environment for one run: none of the caller's Jupyter or pool settings, no config
    file of this machine, and our hooks off (bare) or the project on a fresh simulated pool (active)."""
    env = {key: value for key, value in os.environ.items() if key in INHERITED or key.startswith("LC_")}
    env.update({
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "JUPYTER_PLATFORM_DIRS": "1",
        "JUPYTER_NO_CONFIG": "1",  # no installed jupyter config file in either run
        "IPYTHONDIR": str(scratch / "ipython"),  # nor the user's IPython profile
    })
    if mode == "bare":
        env.update(BARE_OPT_OUTS)
    else:
        env.update({"GPUPOOL_SIMULATE": ACTIVE_POOL, "GPUPOOL_DB": str(scratch / "pool.sqlite"),
                    "GPUPOOL_BROKER_FILE": str(scratch / "gpupool-broker.json")})
        if not suite.server_extension:
            env["JUPYTER_DEFAULT_PROVISIONER_NAME"] = "gpupool-provisioner"
    return env


#: The worse of two reports for one test wins (a pass whose teardown errs is an error).
_SEVERITY = {"passed": 0, "skipped": 1, "xfailed": 1, "failed": 2, "error": 3, "hung": 4}

#: Seconds past its own per-test timeout that a test may still run before its whole run is killed
#: (pytest-timeout could not stop it) and resumed after it.
HANG_GRACE = 60.0


def _phase_outcome(record: dict[str, Any]) -> str:
    when, outcome = record["when"], record["outcome"]
    if outcome == "failed":
        return "failed" if when == "call" else "error"
    if outcome == "skipped":
        return "xfailed" if record.get("xfail") else "skipped"
    return "passed"


def parse_outcomes(path: Path, result: RunResult) -> str | None:
    """Fill ``result`` from the plugin's JSON lines; return the node id of the test that started
    and did not end (None when every started test ended)."""
    current: str | None = None
    if not path.exists():
        return None
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if record["event"] == "start":
            current = record["nodeid"]
        elif record["event"] == "report":
            nodeid, outcome = record["nodeid"], _phase_outcome(record)
            if _SEVERITY[outcome] >= _SEVERITY[result.outcomes.get(nodeid, "passed")]:
                result.outcomes[nodeid] = outcome
                if record.get("message"):
                    result.messages[nodeid] = record["message"]
            if record["when"] in ("teardown", "collect") and nodeid == current:
                current = None
    return current


def count_leases(db: Path) -> int:
    """How many leases a run's pool file recorded (0 when it has none)."""
    if not db.exists():
        return 0
    connection = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(connection.execute("SELECT COUNT(*) FROM leases").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        connection.close()


def _pytest_once(command: list[str], tree: Path, env: dict[str, str], log: Path, outcomes: Path, *,
                 per_test_timeout: float, deadline: float) -> str:
    """Run pytest once in its own process group; ``"finished"``, ``"hung"`` (one test outlived its
    timeout by :data:`HANG_GRACE`, or the process died inside a test) or ``"deadline"``. The whole
    group is killed at the end, with any kernel or forked worker a test left behind."""
    with log.open("a") as out:
        out.write("\n$ " + " ".join(command) + "\n")
        out.flush()
        process = subprocess.Popen(command, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    current, since = None, time.monotonic()
    status = "finished"
    try:
        while process.poll() is None:
            time.sleep(1.0)
            now = time.monotonic()
            running = parse_outcomes(outcomes, RunResult("", ""))
            if running != current:
                current, since = running, now
            if now > deadline:
                status = "deadline"
                break
            if current is not None and now - since > per_test_timeout + HANG_GRACE:
                status = "hung"
                break
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    if status == "finished" and parse_outcomes(outcomes, RunResult("", "")) is not None:
        status = "hung"  # died inside a test (pytest-timeout's thread method, a crash)
    return status


def run_suite(suite: Suite, mode: str, sdist: Path, paths: tuple[str, ...], workdir: Path, *,
              per_test_timeout: float, run_timeout: float, extra: tuple[str, ...] = ()) -> RunResult:
    """One suite in one mode: pytest in a fresh copy of the sdist with a clean environment; a test
    that hangs is recorded as ``hung`` and the run resumes after it (at most :data:`MAX_RESUMES` times)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{suite.name}-{mode}-", dir=workdir))
    tree = extract(sdist, scratch / "src", suite)
    if mode == "active" and suite.server_extension:
        shutil.copyfile(HERE / "server_conftest.py", tree / "conftest.py")
    plugins = scratch / "plugins"
    plugins.mkdir()
    shutil.copyfile(HERE / "outcomes_plugin.py", plugins / "outcomes_plugin.py")
    env = run_environment(mode, suite, scratch)
    env["PYTHONPATH"] = os.pathsep.join(part for part in (str(plugins), env.get("PYTHONPATH", "")) if part)
    log, outcomes = scratch / "pytest.log", scratch / "outcomes.jsonl"
    command = [sys.executable, "-m", "pytest", *paths, *suite.pytest_args, *extra,
               "-p", "outcomes_plugin", f"--outcomes-file={outcomes}", "-p", "no:cacheprovider", "--color=no", "-q",
               f"--basetemp={scratch / 'tmp'}", f"--timeout={per_test_timeout:g}", "-o", "timeout_method=signal"]
    result = RunResult(suite.name, mode, log=log)
    started = time.monotonic()
    deadline = started + run_timeout
    hung: list[str] = []
    for _attempt in range(MAX_RESUMES + 1):
        seen = RunResult("", "")  # what earlier attempts ran is not run again
        parse_outcomes(outcomes, seen)
        skip = [f"--deselect={nodeid}" for nodeid in dict.fromkeys([*seen.outcomes, *hung])]
        status = _pytest_once([*command, *skip], tree, env, log, outcomes, per_test_timeout=per_test_timeout, deadline=deadline)
        if status == "finished":
            break
        stuck = parse_outcomes(outcomes, RunResult("", ""))
        if stuck is None or status == "deadline":
            if stuck is not None:
                hung.append(stuck)
            break
        hung.append(stuck)
        with log.open("a") as out:
            out.write(f"\n[runner] {stuck} hung; resuming after it\n")
    result.seconds = time.monotonic() - started
    parse_outcomes(outcomes, result)
    for nodeid in hung:
        result.outcomes[nodeid] = "hung"
        result.messages[nodeid] = f"still running {per_test_timeout + HANG_GRACE:g} s after it started (or died inside it)"
    if not result.outcomes:
        raise RunnerError(f"the {mode} run of {suite.name} recorded no test after {result.seconds:.0f} s; its output: {log}")
    result.stopped = time.monotonic() > deadline
    if mode == "active":
        result.leases = count_leases(scratch / "pool.sqlite")
    return result


def differences(bare: RunResult, active: RunResult) -> list[tuple[str, str, str]]:
    """(test id, bare outcome, active outcome) for every test whose outcome differs."""
    ids = sorted(set(bare.outcomes) | set(active.outcomes))
    return [(test_id, bare.outcomes.get(test_id, "absent"), active.outcomes.get(test_id, "absent"))
            for test_id in ids if bare.outcomes.get(test_id, "absent") != active.outcomes.get(test_id, "absent")]


def _summary(result: RunResult) -> str:
    counts = result.counts()
    text = " ".join(f"{counts[key]} {key}" for key in ("passed", "failed", "error", "hung", "skipped", "xfailed") if counts[key])
    leases = "" if result.leases is None else f", {result.leases} leases"
    return f"{text or 'no tests'} ({result.seconds:.0f} s{leases})"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.upstream", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--package", action="append", choices=sorted(SUITES), help="a package whose tests to run (repeatable; default: all four)")
    parser.add_argument("--all", action="store_true", help="every default test path, not only the CI subset")
    parser.add_argument("--test", action="append", default=[], metavar="PACKAGE=PATH",
                        help="run this test path of that package's sdist instead of its defaults (repeatable)")
    parser.add_argument("--mode", choices=("bare", "active", "both"), default="both", help="which runs to make (default: both, and compare)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where the sdists are kept (default: $GPUPOOL_CACHE_DIR/upstream or ~/.cache/jupyter-gpupool/upstream)")
    parser.add_argument("--workdir", type=Path, default=None, help="where the runs' trees, logs and pools go (default: a temporary folder, removed when nothing differs)")
    parser.add_argument("--timeout", type=float, default=120, help="seconds one test may take (default: 120)")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds one pytest run may take before it is killed (default: 1800)")
    parser.add_argument("--no-confirm", action="store_true", help=f"report differences without running the differing tests again in both modes (up to {CONFIRM_RUNS} times)")
    parser.add_argument("--jobs", type=int, default=1, choices=(1, 2), help="run the bare and the active run side by side (2) or one after the other (1, the default)")
    parser.add_argument("--strict", action="store_true", help="count the inherent differences (INHERENT_DIFFERENCES) too")
    parser.add_argument("-k", dest="keyword", default=None, help="pytest's -k, for every run")
    args = parser.parse_args(argv)
    args.paths = {}
    for item in args.test:
        package, _, path = item.partition("=")
        if package not in SUITES or not path:
            parser.error(f"--test {item!r}: write PACKAGE=PATH with PACKAGE one of {', '.join(sorted(SUITES))}")
        args.paths.setdefault(package, []).append(path)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    suites = [SUITES[name] for name in (args.package or SUITES)]
    cache = args.cache_dir or sdist_cache()
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="gpupool-upstream-")) if own_workdir else args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    modes = MODES if args.mode == "both" else (args.mode,)
    extra = ("-k", args.keyword) if args.keyword else ()
    found: list[tuple[str, str, str, str, str]] = []  # package, test id, bare, active, message
    expected: list[tuple[str, str, str]] = []  # package, test id, reason
    try:
        for suite in suites:
            ver = installed_version(suite.name)
            sdist = fetch_sdist(suite.name, ver, cache)
            paths = tuple(args.paths.get(suite.name) or (suite.paths if args.all else suite.ci_paths))
            runs = run_modes(suite, modes, sdist, paths, workdir, args, extra)
            for mode, result in runs.items():
                print(f"{suite.name} {ver} {mode:6}: {_summary(result)}  [{result.log}]", flush=True)
            for mode, result in runs.items():
                if result.stopped:
                    found.append((suite.name, "(whole run)", "-", "stopped", f"the {mode} run was killed at --run-timeout {args.run_timeout:g} s"))
            narrowed = bool(args.paths or args.keyword)  # a chosen few tests may start no kernel
            if "active" in runs and runs["active"].leases == 0 and runs["active"].outcomes and not narrowed:
                found.append((suite.name, "(whole run)", "-", "no lease", "the active run took no lease from its pool: the project was not active"))
            if len(runs) < 2:
                continue
            diff = []
            for test_id, bare_outcome, active_outcome in differences(runs["bare"], runs["active"]):
                reason = INHERENT_DIFFERENCES.get((suite.name, test_id))
                if reason and not args.strict:
                    expected.append((suite.name, test_id, reason))
                else:
                    diff.append((test_id, bare_outcome, active_outcome))
            if diff and not args.no_confirm:
                diff = confirm(suite, sdist, diff, runs, workdir, args)
            for test_id, bare_outcome, active_outcome in diff:
                found.append((suite.name, test_id, bare_outcome, active_outcome, runs["active"].messages.get(test_id, "")))
    except RunnerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for package, test_id, reason in expected:
        print(f"expected difference: {package} {test_id}: {reason}")
    if found:
        print(f"\n{len(found)} difference(s) between the bare and the active runs (logs under {workdir}):")
        width = max(len(test_id) for _, test_id, *_ in found)
        print(f"  {'package':15} {'test':{width}}  {'bare':8} {'active':8} active's failure")
        for package, test_id, bare_outcome, active_outcome, message in found:
            print(f"  {package:15} {test_id:{width}}  {bare_outcome:8} {active_outcome:8} {message[:160]}")
        return 1
    if args.mode == "both":
        print("no difference between the bare and the active runs")
    if own_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


def run_modes(suite: Suite, modes: tuple[str, ...], sdist: Path, paths: tuple[str, ...], workdir: Path,
              args: argparse.Namespace, extra: tuple[str, ...]) -> dict[str, RunResult]:
    """The runs of one suite in each mode, side by side with ``--jobs 2``."""
    def one(mode: str) -> RunResult:
        return run_suite(suite, mode, sdist, paths, workdir, per_test_timeout=args.timeout,
                         run_timeout=args.run_timeout, extra=extra)

    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, len(modes)))) as pool:
        return dict(zip(modes, pool.map(one, modes)))


#: How many times :func:`confirm` runs the differing tests again before it calls a difference real.
CONFIRM_RUNS = 3


def confirm(suite: Suite, sdist: Path, diff: list[tuple[str, str, str]], runs: dict[str, RunResult], workdir: Path,
            args: argparse.Namespace, attempts: int = CONFIRM_RUNS) -> list[tuple[str, str, str]]:
    """Run the differing tests again in both modes, up to ``attempts`` times; a difference is dropped
    as soon as one run shows the same outcome in both modes (a test flaky upstream on a loaded machine,
    whose timing the active run's extra work may tip, is not ours), and kept if it holds every time."""
    held = list(diff)
    for attempt in range(1, attempts + 1):
        node_ids = sorted({test_id for test_id, *_ in held if "::" in test_id})
        if not node_ids:
            break
        again = run_modes(suite, MODES, sdist, tuple(node_ids), workdir, args, ())
        for mode, result in again.items():
            print(f"{suite.name} {mode:6} (the {len(node_ids)} differing tests again, {attempt}/{attempts}): "
                  f"{_summary(result)}  [{result.log}]", flush=True)
        still = []
        for test_id, bare_outcome, active_outcome in held:
            bare_again, active_again = again["bare"].outcomes.get(test_id), again["active"].outcomes.get(test_id)
            if "::" in test_id and bare_again is not None and bare_again == active_again:
                continue  # the same outcome in both modes this time
            still.append((test_id, bare_outcome, active_outcome))
            if test_id in again["active"].messages and test_id not in runs["active"].messages:
                runs["active"].messages[test_id] = again["active"].messages[test_id]
        held = still
    return held


if __name__ == "__main__":
    sys.exit(main())
