"""Smoke run of bench/resume_latency.py: a real server at default settings answers a suspended
kernel's cell far sooner than its 5 s tick (the protocol waited for that tick before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "resume_latency.py"


@pytest.mark.slow
def test_resume_latency_bench_runs_and_no_step_waits_for_the_tick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--via", "direct", "--tries", "2", "--json"], check=False, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads(proc.stdout)["runs"][0]
    assert run["via"] == "direct" and len(run["cell_to_output_s"]["all"]) == 2
    # The default tick is 5 s: a step that waited for it would take seconds, not a fraction of one.
    assert run["suspend_s"]["max"] < 2.5 and run["cell_to_output_s"]["max"] < 2.5, run


def test_resume_latency_bench_rejects_bad_tries() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--tries", "0"], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--tries 0: give 1 to 100" in proc.stderr and "Traceback" not in proc.stderr
