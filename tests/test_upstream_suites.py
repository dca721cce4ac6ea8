"""Upstream's own tests keep their outcomes with the project active: the CI subset of
``python -m tests.upstream`` (jupyter_server's kernel and session API, nbclient's client,
papermill's execution, jupyter_client's kernel manager and provisioning tests, each run bare and
active) must show no difference, and the runner must see a difference where there is one."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.upstream.run import BARE_OPT_OUTS, SUITES, RunResult, differences, parse_outcomes, run_environment

REPO = Path(__file__).resolve().parent.parent


def _runner(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # $GPUPOOL_CACHE_DIR (a temporary folder, see conftest.py) keeps the sdists inside the sandbox.
    return subprocess.run([sys.executable, "-m", "tests.upstream", *args], cwd=REPO, env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("package", sorted(SUITES))
def test_ci_subset_has_the_same_outcomes_bare_and_active(tmp_path: Path, package: str) -> None:
    """One package's CI subset per test, so a parallel run spreads the four packages over its workers."""
    done = _runner("--package", package, "--workdir", str(tmp_path / "runs"), "--jobs", "2", "--run-timeout", "500",
                   timeout=1150)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report[-8000:]
    # the package ran in both modes, and the active run leased from the pool
    assert f"{package} " in report and " bare  : " in report, report
    assert "no difference between the bare and the active runs" in report
    assert " 0 leases" not in report, report


@pytest.mark.slow
def test_runner_reports_a_test_that_differs(tmp_path: Path) -> None:
    # jupyter_client's test_find_all_specs replaces the installed provisioners, so it fails when a
    # default provisioner is named: a real difference, listed as inherent (and counted by --strict).
    args = ("--package", "jupyter_client", "--test", "jupyter_client=tests/test_provisioning.py",
            "-k", "test_find_all_specs", "--no-confirm")
    strict = _runner(*args, "--strict", "--workdir", str(tmp_path / "strict"), timeout=280)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "tests/test_provisioning.py::TestDiscovery::test_find_all_specs  passed   failed" in strict.stdout, strict.stdout
    lenient = _runner(*args, "--workdir", str(tmp_path / "lenient"), timeout=280)
    assert lenient.returncode == 0, lenient.stdout + lenient.stderr
    assert "expected difference: jupyter_client tests/test_provisioning.py::TestDiscovery::test_find_all_specs" in lenient.stdout


def test_bare_runs_see_none_of_our_hooks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"GPUPOOL_DB": "/elsewhere.sqlite", "GPUPOOL_SIMULATE": "1x16GiB", "IPYTHONDIR": "/x",
                       "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner", "JUPYTER_CONFIG_DIR": "/y",
                       "PYTEST_ADDOPTS": "-x"}.items():
        monkeypatch.setenv(key, value)
    bare = run_environment("bare", SUITES["nbclient"], tmp_path)
    assert {k: v for k, v in bare.items() if k.startswith("GPUPOOL_")} == BARE_OPT_OUTS
    assert "JUPYTER_DEFAULT_PROVISIONER_NAME" not in bare and "PYTEST_ADDOPTS" not in bare
    assert bare["JUPYTER_NO_CONFIG"] == "1" and bare["IPYTHONDIR"] == str(tmp_path / "ipython")

    active = run_environment("active", SUITES["nbclient"], tmp_path)
    assert active["JUPYTER_DEFAULT_PROVISIONER_NAME"] == "gpupool-provisioner"
    assert active["GPUPOOL_DB"] == str(tmp_path / "pool.sqlite") and active["GPUPOOL_SIMULATE"] == "2xA100-80GB"
    assert not BARE_OPT_OUTS.keys() & active.keys()
    # jupyter_server's active run loads the server extension instead (its own conftest.py).
    assert "JUPYTER_DEFAULT_PROVISIONER_NAME" not in run_environment("active", SUITES["jupyter_server"], tmp_path)


def test_outcomes_are_compared_per_test(tmp_path: Path) -> None:
    def run(name: str, records: list[dict[str, object]]) -> tuple[RunResult, str | None]:
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(record) + "\n" for record in records) + '{"event": "rep')  # cut by a kill
        result = RunResult("nbclient", name)
        return result, parse_outcomes(path, result)

    def test(nodeid: str, call: str = "passed", teardown: str = "passed", **extra: object) -> list[dict[str, object]]:
        return [{"event": "start", "nodeid": nodeid},
                {"event": "report", "nodeid": nodeid, "when": "setup", "outcome": "passed"},
                {"event": "report", "nodeid": nodeid, "when": "call", "outcome": call, **extra},
                {"event": "report", "nodeid": nodeid, "when": "teardown", "outcome": teardown}]

    a, b, c = "tests/test_client.py::TestRun::test_a[x]", "tests/test_client.py::test_b", "tests/test_client.py::test_c"
    bare, running = run("bare", [*test(a), *test(b, call="skipped", xfail=True), *test(c)])
    assert running is None and bare.outcomes == {a: "passed", b: "xfailed", c: "passed"}
    active, running = run("active", [*test(a, call="failed", message="boom"), *test(b, call="skipped", xfail=True),
                                     {"event": "start", "nodeid": c}])
    assert running == c  # started, never ended: the one the runner reports as hung
    assert differences(bare, active) == [(a, "passed", "failed"), (c, "passed", "absent")]
    assert active.messages[a] == "boom"
    teardown_error, _ = run("teardown", test(a, teardown="failed", message="leaked"))
    assert teardown_error.outcomes == {a: "error"} and teardown_error.messages[a] == "leaked"


def test_an_sdist_comes_from_the_index_listing_checked_against_its_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner takes the sdist file the index's JSON listing names (seconds) instead of asking
    pip, whose ``--no-binary`` download builds build tools from source (minutes on a busy machine,
    past the runner's limit); a file whose sha256 differs from the listing's is refused."""
    import functools
    import hashlib
    import http.server
    import threading

    from tests.upstream.run import download_from_index, fetch_sdist

    served = tmp_path / "index"
    (served / "demo-pkg").mkdir(parents=True)
    body = b"an sdist's bytes"
    (served / "demo_pkg-1.2.0.tar.gz").write_bytes(body)

    def listing(sha256: str) -> None:
        files = [{"filename": "demo_pkg-1.2.0.tar.gz", "url": "../demo_pkg-1.2.0.tar.gz", "hashes": {"sha256": sha256}},
                 {"filename": "demo_pkg-1.2.0-py3-none-any.whl", "url": "../x.whl", "hashes": {"sha256": "0"}}]
        (served / "demo-pkg" / "index.html").write_text(json.dumps({"meta": {"api-version": "1.0"}, "files": files}))

    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.server_address[1]}/")
        listing("0" * 64)
        (tmp_path / "refused").mkdir()
        assert download_from_index("demo_pkg", "1.2.0", tmp_path / "refused") is False
        assert list((tmp_path / "refused").iterdir()) == []
        listing(hashlib.sha256(body).hexdigest())
        assert download_from_index("demo-pkg", "1.3.0", tmp_path / "cache") is False  # no such version
        found = fetch_sdist("demo-pkg", "1.2.0", tmp_path / "cache")
        assert found == tmp_path / "cache" / "demo_pkg-1.2.0.tar.gz"
        assert found.read_bytes() == body
    finally:
        server.shutdown()


def test_a_difference_is_dropped_once_both_modes_agree_and_kept_if_it_holds_every_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``confirm`` runs the differing tests again (each time both modes) up to CONFIRM_RUNS times: a
    test flaky upstream under load is dropped the first time both modes agree; a real difference,
    which holds every time, is kept with the active run's message; a whole-run finding is never rerun."""
    from tests.upstream import run as upstream

    flaky, ours = "tests/a.py::test_flaky", "tests/b.py::test_ours"
    rounds: list[tuple[str, ...]] = []
    active_flaky = iter(["failed", "passed"])  # fails the first rerun too, passes the second

    def fake_run_modes(suite: Any, modes: Any, sdist: Any, paths: tuple[str, ...], workdir: Any, args: Any, extra: Any) -> dict[str, RunResult]:
        rounds.append(paths)
        bare, active = RunResult(suite.name, "bare"), RunResult(suite.name, "active", leases=1)
        for test_id in paths:
            bare.outcomes[test_id] = "passed"
            active.outcomes[test_id] = next(active_flaky) if test_id == flaky else "failed"
            if active.outcomes[test_id] == "failed":
                active.messages[test_id] = f"AssertionError in {test_id}"
        return {"bare": bare, "active": active}

    monkeypatch.setattr(upstream, "run_modes", fake_run_modes)
    runs = {"bare": RunResult("nbclient", "bare"), "active": RunResult("nbclient", "active")}
    diff = [(flaky, "passed", "failed"), (ours, "passed", "failed"), ("(whole run)", "-", "no lease")]
    held = upstream.confirm(SUITES["nbclient"], tmp_path / "sdist", diff, runs, tmp_path, argparse.Namespace())
    assert held == [(ours, "passed", "failed"), ("(whole run)", "-", "no lease")]
    assert rounds == [(flaky, ours), (flaky, ours), (ours,)]  # the flaky one stops at its agreeing run
    assert runs["active"].messages[ours] == f"AssertionError in {ours}"
    assert "(the 1 differing tests again, 3/3)" in capsys.readouterr().out
