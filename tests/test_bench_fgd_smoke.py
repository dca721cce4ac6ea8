"""Smoke run of the FGD-paper replay (bench/fgd_replay.py): 2 seeds on a 10 % node sample."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
SCRIPT = ROOT / "bench" / "fgd_replay.py"
DEFAULT_PODS = TRACES / "alibaba-gpu-v2023" / "openb_pod_list_default.csv"

pytestmark = pytest.mark.skipif(
    not DEFAULT_PODS.is_file(), reason=f"trace data not found at {TRACES} (the ../shared/traces checkout)"
)


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, check=False)


def test_replay_prints_one_json_object_with_the_metrics() -> None:
    proc = run("--pods", str(DEFAULT_PODS), "--policy", "fgd", "--seeds", "42-43", "--sample", "0.1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"] == "fgd" and out["seeds"] == [42, 43]
    assert [s["seed"] for s in out["per_seed"]] == [42, 43]
    for key in ("alloc_100", "alloc_130"):
        assert 60 < out[key] <= 100
    assert out["alloc_130"] >= out["alloc_100"] - 1  # pods never leave: allocation does not fall
    assert out["per_seed"][0]["alloc_100"] != out["per_seed"][1]["alloc_100"]  # seeds differ
    speed = out["speed"]
    assert speed["decisions_per_s"] > 0 and 0 < speed["p50_ms"] <= speed["p99_ms"]
    assert speed["nodes"] == 121  # 10 % of the 1,213 GPU nodes


def test_all_variants_table_has_published_numbers_beside_ours(tmp_path: Path) -> None:
    md = tmp_path / "table.md"
    proc = run(
        "--all-variants",
        "--variants",
        "default,multigpu50",
        "--policy",
        "best-fit,fgd-bestfit",
        "--seeds",
        "42-43",
        "--sample",
        "0.05",
        "--jobs",
        "2",
        "--json",
        "--markdown",
        str(md),
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rows = {r["variant"]: r for r in out["variants"]}
    assert set(rows) == {"default", "multigpu50"}
    # the paper's 10-seed means, as in ../shared/traces/README.md
    assert rows["default"]["published"]["best-fit"]["alloc_100"] == pytest.approx(92.86, abs=0.01)
    assert rows["default"]["published"]["fgd"]["alloc_130"] == pytest.approx(95.39, abs=0.01)
    assert set(rows["multigpu50"]["ours"]) == {"best-fit", "fgd-bestfit"}
    text = md.read_text()
    assert "| default |" in text and "paper FGD" in text


def test_workload_is_trimmed_or_filled_to_130_percent() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    import random

    import fgd_replay as replay

    capacity = 6212 * 1000
    for variant in ("default", "multigpu50"):
        pods = replay.load_pods(str(TRACES / "alibaba-gpu-v2023" / f"openb_pod_list_{variant}.csv"))
        work = replay.workload(pods, capacity, random.Random(42))
        total = sum(replay.gpu_demand(d) for d in work)
        assert 1.29 * capacity < total <= 1.3 * capacity


def test_bad_arguments_give_one_line_errors() -> None:
    proc = run("--pods", str(DEFAULT_PODS), "--policy", "worst-fit", "--seeds", "42")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "use one of: best-fit, fgd, fgd-bestfit" in proc.stderr
    proc = run("--pods", str(DEFAULT_PODS), "--seeds", "forty")
    assert proc.returncode == 2 and "42-51" in proc.stderr
