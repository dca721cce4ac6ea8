"""A pytest plugin the runner loads into each upstream run (``-p outcomes_plugin
--outcomes-file=PATH``): one JSON line when a test starts and one per phase report, written and
flushed as they happen, so a run killed in a hung test still tells which tests ended how and which
one hung (a junit file is only written when a run ends)."""

from __future__ import annotations

import json
from typing import IO, Any

import pytest

_out: IO[str] | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcomes-file", default=None, help="append each test's start and phase outcomes to this file, as JSON lines")


def pytest_configure(config: pytest.Config) -> None:
    global _out
    path = config.getoption("--outcomes-file")
    if path:
        _out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the whole session


def _write(record: dict[str, Any]) -> None:
    if _out is not None:
        _out.write(json.dumps(record) + "\n")
        _out.flush()


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    message = ""
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
    _write({"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
            "xfail": hasattr(report, "wasxfail"), "duration": report.duration, "message": message.strip().split("\n", 1)[0]})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"event": "report", "nodeid": report.nodeid, "when": "collect", "outcome": "failed", "xfail": False,
                "message": str(report.longrepr).strip().splitlines()[-1] if report.longrepr else ""})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write({"event": "finish", "exitstatus": int(exitstatus)})


def pytest_unconfigure(config: pytest.Config) -> None:
    global _out
    if _out is not None:
        _out.close()
        _out = None
