"""The reliability suite at CI size (``tests/reliability.py`` runs it longer and prints the figures
that RELIABILITY.md records): SIGKILL storms on one pool file, a burst against a full pool, device
faults on the fake ``pynvml``, a killed server, and a soak with flat memory and file descriptors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import reliability

pytestmark = pytest.mark.slow


def test_sigkill_storm_loses_and_doubles_nothing(tmp_path: Path) -> None:
    figures = reliability.kill_storm(tmp_path, seconds=6, workers=3)
    assert figures["kills"] >= 5 and figures["requests_committed"] > 20
    assert figures["leases_lost"] == 0 and figures["live"] == 0


def test_burst_grants_exactly_the_room_and_hands_over_in_policy_order(tmp_path: Path) -> None:
    figures = reliability.burst(tmp_path, requests=200, room=20, processes=4)
    assert figures["granted_at_once"] == 20 and figures["queued"] == 180
    assert figures["handovers_checked"] == 60 and figures["handovers_out_of_policy_order"] == 0


def test_device_faults_are_flagged_and_the_rest_keeps_serving(tmp_path: Path) -> None:
    figures = reliability.device_faults(tmp_path)
    assert "flagged" in figures["gpu_lost"] and "no longer present" in figures["mig_destroyed"]
    assert "GPUPOOL_SIMULATE" in figures["nvml_missing"]


def test_a_killed_server_leaks_no_lease(tmp_path: Path) -> None:
    figures = reliability.server_kill(tmp_path)
    assert figures["orphaned_kernels_ended_s"] < 30


def test_soak_keeps_memory_and_descriptors_flat(tmp_path: Path) -> None:
    figures = reliability.soak(tmp_path, seconds=8)
    assert figures["operations"] > 500
    assert figures["fds_end"] <= figures["fds_start"] + 2
    assert figures["rss_mib_end"] - figures["rss_mib_start"] < 24, figures


def test_the_suite_runs_from_the_command_line(tmp_path: Path) -> None:
    """`python tests/reliability.py --json` is how RELIABILITY.md's figures are made."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "reliability.py"), "--minutes", "0.15", "--json",
         *[arg for name in ("kill_storm", "burst", "device_faults", "server_kill", "soak", "unpooled_nvml") for arg in ("--only", name)]],
        check=False, capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = json.loads(result.stdout)
    assert set(figures) == {"kill_storm", "burst", "device_faults", "server_kill", "soak", "unpooled_nvml"}
    bad = subprocess.run([sys.executable, str(Path(__file__).parent / "reliability.py"), "--only", "nope"],
                         check=False, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "unknown scenario nope: choose from kill_storm" in bad.stderr, bad.stderr
