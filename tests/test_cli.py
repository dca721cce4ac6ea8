"""`jupyter gpupool` as a user runs it: real subprocesses, real exit codes, no tracebacks."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest


def run(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite"), **env}
    return subprocess.run(["jupyter", "gpupool", *args], capture_output=True, text=True, env=environ, timeout=60)


def test_status_json_shows_one_16gib_device(tmp_path):
    result = run(["status", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["memory_total"] for d in data["devices"]] == [16 * 1024**3]
    assert data["backend"] == "simulated 1x16GiB"


def test_request_queue_release_report_round_trip(tmp_path):
    ids = []
    for _ in range(3):
        result = run(["request", "8GiB", "--for", "1h", "--json"], tmp_path)
        assert result.returncode == 0, result.stderr
        ids.append(json.loads(result.stdout))
    assert [x["state"] for x in ids] == ["granted", "granted", "queued"]
    queue = run(["queue"], tmp_path)
    assert ids[2]["id"] in queue.stdout and " min " in queue.stdout  # position and estimated wait (about 1 h)
    table = run(["status"], tmp_path).stdout
    assert "16 GiB" in table and "queued" in table
    assert run(["release", ids[0]["id"]], tmp_path).returncode == 0
    leases = json.loads(run(["leases", "--json"], tmp_path).stdout)
    assert {l["id"]: l["state"] for l in leases}[ids[2]["id"]] == "granted"
    report = run(["report", "--since", "2000-01-01", "--by", "user", "--format", "csv"], tmp_path)
    rows = list(csv.DictReader(io.StringIO(report.stdout)))
    assert rows and rows[0]["leases"] == "3" and float(rows[0]["gib_hours_held"]) >= 0
    assert json.loads(run(["report", "--format", "json"], tmp_path).stdout)[0]["leases"] == 3


@pytest.mark.parametrize("size", ["-1", "abc", "1e30", "0", "8XB"])
def test_bad_sizes_are_one_line_errors(tmp_path, size):
    result = run(["request", f"--", size], tmp_path) if size.startswith("-") else run(["request", size], tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "8GiB" in lines[0]


def test_bad_duration_and_unknown_lease(tmp_path):
    result = run(["request", "1GiB", "--for=-5m"], tmp_path)
    assert result.returncode == 2 and "duration like 90s" in result.stderr and "Traceback" not in result.stderr
    result = run(["release", "l-doesnotexist"], tmp_path)
    assert result.returncode == 4 and "no lease 'l-doesnotexist'" in result.stderr
    result = run(["report", "--since", "yesterday-ish"], tmp_path)
    assert result.returncode == 2 and "2026-11-01" in result.stderr


def test_refusals_and_bad_config_exit_non_zero(tmp_path):
    result = run(["request", "20GiB"], tmp_path)
    assert result.returncode == 3 and "ask for at most 16 GiB" in result.stderr
    result = run(["status"], tmp_path, GPUPOOL_SIMULATE="2xFOO")
    assert result.returncode == 2 and "unknown GPU 'FOO'" in result.stderr and "Traceback" not in result.stderr
    result = run(["status"], tmp_path, GPUPOOL_IDLE_TIMEOUT="soon")
    assert result.returncode == 2 and "GPUPOOL_IDLE_TIMEOUT" in result.stderr


def test_unknown_command_and_help(tmp_path):
    result = run(["frobnicate"], tmp_path)
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr
    result = run([], tmp_path)
    assert result.returncode == 0 and "status" in result.stdout and "report" in result.stdout


def test_reservations_from_the_cli(tmp_path):
    result = run(["reserve", "lab", "--memory", "8GiB", "--groups", "cs101", "--weekdays", "tue", "--start", "09:00", "--end", "11:00"], tmp_path)
    assert result.returncode == 0, result.stderr
    listed = json.loads(run(["reserve", "--list", "--json"], tmp_path).stdout)
    assert listed[0]["weekdays"] == ["tue"] and listed[0]["groups"] == ["cs101"]
    bad = run(["reserve", "x", "--memory", "8GiB", "--groups", "g", "--weekdays", "someday", "--start", "09:00", "--end", "10:00"], tmp_path)
    assert bad.returncode == 2 and "unknown weekday" in bad.stderr
    assert run(["reserve", "lab", "--cancel"], tmp_path).returncode == 0
    assert run(["reserve", "lab", "--cancel"], tmp_path).returncode == 4


def test_python_module_entry_point(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jupyter_gpupool.cli", "status", "--json"], capture_output=True, text=True,
                            env={**os.environ, "GPUPOOL_SIMULATE": "2xA100-80GB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")})
    assert result.returncode == 0 and len(json.loads(result.stdout)["devices"]) == 2
