"""Smoke run of bench/long_poll.py: with servers waiting in a broker's ``/changes`` long poll, a
pool change that moves nobody's view costs one pool read, not one per waiting server, and
answers no poll."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "long_poll.py"


def test_long_poll_bench_runs_and_a_change_costs_one_read_for_all_waiting_callers() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--callers", "6", "--changes", "3", "--repeats", "1", "--json"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["command"].endswith("--callers 6 --changes 3 --repeats 1 --json")
    assert result["summary"]["before"]["reads_per_change"] == 6  # the baseline: every poll read its caller
    assert result["summary"]["after"]["reads_per_change"] == 1
    assert result["summary"]["after"]["burst_reads"] <= 2


def test_long_poll_bench_rejects_bad_counts() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--callers", "0"], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--callers 0: give 1 to 1000" in proc.stderr and "Traceback" not in proc.stderr
