"""Smoke run of bench/system_bench.py with tiny sizes: it still runs and its numbers make sense."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "system_bench.py"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], check=False, capture_output=True, text=True, timeout=240)


def test_system_bench_smoke() -> None:
    proc = run_bench("--sizes", "5,50", "--decisions", "10", "--ticks-per-size", "5", "--kernels", "20", "--ticks", "40", "--samples", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [row["live_leases"] for row in data["throughput"]] == [5, 50]
    for row in data["throughput"]:
        assert row["decisions"] == 20
        assert row["grants_releases_per_s"] > 0
        for call in ("request_grant", "release", "tick"):
            assert 0 < row[call]["p50_ms"] <= row[call]["p99_ms"]
    long_run = data["long_running"]
    assert long_run["kernels"] == 20 and long_run["ticks"] == 40
    assert long_run["ledger_rows"] == 40  # one kernel ended per tick, each closed into the ledger
    assert long_run["rss_end_mib"] > 0 and len(long_run["trace"]) == 2
    assert data["machine"]["cpus"] >= 1


def test_system_bench_rejects_bad_sizes() -> None:
    proc = run_bench("--sizes", "ten")
    assert proc.returncode == 2
    assert "--sizes 'ten'" in proc.stderr and "Traceback" not in proc.stderr


def test_profile_decision_smoke() -> None:
    """bench/README.md's `python bench/profile_decision.py --live 1000 --cycles 300`, smaller."""
    script = BENCH.parent / "profile_decision.py"
    proc = subprocess.run([sys.executable, str(script), "--live", "50", "--cycles", "20"], check=False, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].endswith("grants+releases/s at 50 live leases (unprofiled, 20 cycles)"), lines[0]
    shares = [float(line.split("%")[0]) for line in lines[1:]]
    assert shares and all(0 <= share <= 100 for share in shares) and sum(shares) <= 100.5
    assert any("core/" in line for line in lines[1:])  # the engine's decision modules


def test_stand_aside_bench_smoke(tmp_path: Path) -> None:
    """bench/stand_aside.py still times the stand-aside against ipykernel's own import."""
    out = tmp_path / "stand_aside.json"
    bench = BENCH.with_name("stand_aside.py")
    proc = subprocess.run([sys.executable, str(bench), "--runs", "2", "--json", str(out)], check=False, capture_output=True, text=True, timeout=240)
    if proc.returncode == 2 and "NVIDIA driver" in proc.stderr:
        return  # a GPU host: the pool leases there, there is nothing to time
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["runs"] == 2 and data["stand_aside_ms"] > 0 and data["ipykernel_import_ms"] > 0
    assert "standing aside:" in proc.stdout
