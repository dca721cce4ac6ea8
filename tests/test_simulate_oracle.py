"""The simulator's ``oracle`` mode: the physical limit for the same sessions, a lower bound on every mode."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from simulate_cli import SMALL_LAB, run_app

from jupyter_gpupool.apps.oracle import OracleRun, gpus_needed, no_wait_gpus
from jupyter_gpupool.apps.simulate import (
    MODES,
    SessionPlan,
    Settings,
    fewest_gpus,
    parse_requests,
    parse_shape,
    run_mode,
    uniform_backend,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB

GPU = 24 * GIB
BENCH = Path(__file__).resolve().parents[1] / "bench"


def plan(index: int, arrival: float, share: float, *phases: tuple[bool, float]) -> SessionPlan:
    """A hand-made session: ``share`` of a GPU, its phases as given, a user of its own."""
    return SessionPlan(index, arrival, f"user{index:03d}", "share", share, list(phases))


def settings(**changes: object) -> Settings:
    base: dict[str, object] = {"gpus": "1x24GiB", "users": 10, "rate": 1, "shape": parse_shape("flat"), "days": 0.25, "patience": 3600.0}
    base.update(changes)
    return Settings(**base)  # type: ignore[arg-type]


# --- the packing bound ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ((), 0),
        ((0.25,) * 4, 1),  # they fill one GPU exactly
        ((0.25,) * 5, 2),  # the sum
        ((0.6, 0.6, 0.6), 3),  # three over half a GPU: one GPU each, though 1.8 GPUs of memory
        ((0.5, 0.5), 1),  # exactly half: two share a GPU
        ((0.6, 0.3, 0.3, 0.3), 2),  # the sum (1.5) and one over half: 2 (0.6+0.3 and 0.3+0.3 do pack)
        ((0.9, 0.9, 0.1, 0.1), 2),  # 0.9+0.1 twice
    ],
)
def test_gpus_needed_is_the_larger_of_the_sum_and_the_uses_over_half_a_gpu(shares: tuple[float, ...], expected: int) -> None:
    assert gpus_needed([round(s * GPU) for s in shares], GPU) == expected


def test_gpus_needed_refuses_a_use_above_a_gpu() -> None:
    with pytest.raises(InvalidInput, match="does not fit on one GPU"):
        gpus_needed([GPU + 1], GPU)


# --- a lower bound on hand-made sessions whose answer is known ---------------------------------------------
def three_over_half() -> list[SessionPlan]:
    """Three sessions using 60% of a GPU each, computing together for an hour: they need 3 GPUs."""
    return [plan(i, float(i), 0.6, (True, 3600.0)) for i in range(3)]


def test_the_oracle_needs_exactly_the_gpus_the_uses_force() -> None:
    s = settings(gpus="4x24GiB", patience=600.0)
    plans = three_over_half()
    on = {n: run_mode(s, plans, "oracle", uniform_backend("24GiB", GPU, n)) for n in (1, 2, 3)}
    assert on[3].wait_max == 0 and on[3].served == 3 and on[3].abandoned == 0
    # On 2 GPUs the third session cannot start while the others compute (1.8 GPUs of memory would fit
    # as a fluid sum): it waits its whole patience and gives up.
    assert on[2].abandoned == 1 and on[2].wait_max == 600.0 and on[2].served == 2
    assert on[1].abandoned == 2
    assert fewest_gpus(s, "oracle", 60.0, 4, plans=plans).gpus == 3


@pytest.mark.parametrize("mode", MODES)
def test_no_mode_of_the_pool_beats_the_oracle(mode: str) -> None:
    """The same forced sessions on the real pool: no mode needs fewer GPUs, or waits less on as many."""
    s = settings(gpus="4x24GiB", patience=600.0)
    plans = three_over_half()
    oracle = fewest_gpus(s, "oracle", 60.0, 4, plans=plans)
    pool = fewest_gpus(s, mode, 60.0, 4, plans=plans)
    assert oracle.gpus is not None and pool.gpus is not None and oracle.gpus <= pool.gpus
    for count, p95 in pool.tried.items():
        assert oracle.tried[count] <= p95


def test_idle_memory_is_free_in_the_oracle_and_held_by_the_pool() -> None:
    """Two sessions using 60% of a GPU whose cells take turns: one GPU with no wait for the oracle,
    while every mode of the pool (each kernel holds its slice between its cells) makes one wait."""
    plans = [
        plan(0, 0.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
        plan(1, 600.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
    ]
    s = settings(patience=None)
    oracle = run_mode(s, plans, "oracle", uniform_backend("24GiB", GPU, 1))
    assert oracle.wait_max == 0 and oracle.served == 2 and oracle.requests == 4  # every cell asks once
    assert oracle.busy_pct == oracle.leased_pct > 0  # it holds memory only while a cell computes
    pooled = run_mode(s, plans, "pooled", uniform_backend("24GiB", GPU, 1))
    assert pooled.wait_max >= 600.0  # session 1 waits until session 0 has gone


def test_the_oracle_packs_gpus_of_one_size_only() -> None:
    with pytest.raises(InvalidInput, match="mode oracle packs GPUs of one size"):
        OracleRun(settings(gpus="1xA100-80GB,1xT4"), three_over_half(), SimulatedBackend.from_spec("1xA100-80GB,1xT4"))


# --- on the command line --------------------------------------------------------------------------------
def test_oracle_is_accepted_on_the_command_line_and_left_out_of_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    argv = SMALL_LAB
    code, out, err = run_app([*argv, "--modes", "pooled,oracle", "--target-p95-wait", "10m", "--max-gpus", "4"], capsys)
    assert code == 0, err
    assert "oracle: the physical limit for these sessions" in out
    assert any(line.startswith("oracle ") for line in out.splitlines())  # its row, and its search row
    code, out, err = run_app([*argv, "--modes", "pooled,oracle", "--target-p95-wait", "10m", "--max-gpus", "4", "--json"], capsys)
    data = json.loads(out)
    assert set(data["results"]) == set(data["search"]) == {"pooled", "oracle"}
    assert data["search"]["oracle"]["gpus"] <= data["search"]["pooled"]["gpus"]
    code, out, err = run_app([*argv, "--json"], capsys)
    assert set(json.loads(out)["results"]) == set(MODES) and "oracle" not in MODES


def test_no_wait_gpus_is_the_most_the_cells_as_planned_force() -> None:
    forced = three_over_half()
    assert no_wait_gpus(forced, GPU, GPU) == 3
    assert no_wait_gpus(forced, GPU, GPU, horizon=1.5) == 2  # the third starts at 2 s
    taking_turns = [
        plan(0, 0.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
        plan(1, 600.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
    ]
    assert no_wait_gpus(taking_turns, GPU, GPU) == 1  # one cell ends as the other starts
    overlapping = [plan(0, 0.0, 0.6, (True, 600.0)), plan(1, 599.0, 0.6, (True, 600.0))]
    assert no_wait_gpus(overlapping, GPU, GPU) == 2
    # The oracle on that many GPUs never makes a cell wait.
    s = settings(gpus="4x24GiB", patience=600.0)
    assert run_mode(s, forced, "oracle", uniform_backend("24GiB", GPU, 3)).wait_max == 0


def test_the_bench_table_of_the_gap_reads_runs_of_the_simulator(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bench/oracle_gap.py on a short run: the oracle never needs more GPUs than make every wait 0."""
    argv = ["--gpus", "1x24GiB", "--users", "6", "--rate", "6", "--shape", "flat", "--days", "0.1", "--memory-need", "8GiB-20GiB",
            "--session-length", "30m", "--modes", "pooled,oracle", "--target-p95-wait", "1m", "--max-gpus", "8", "--json"]
    code, out, err = run_app(argv, capsys)
    assert code == 0, err
    run = tmp_path / "run.json"
    run.write_text(out)
    proc = subprocess.run([sys.executable, str(BENCH / "oracle_gap.py"), "--json", str(run)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(proc.stdout)
    assert row["fewest"]["oracle"] <= row["no_wait"] and row["oracle_long_spells"] <= row["no_wait"]
    assert row["fewest"]["oracle"] <= row["fewest"]["pooled"]
    proc = subprocess.run([sys.executable, str(BENCH / "oracle_gap.py"), str(run)], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0 and "| oracle, no cell ever waits |" in proc.stdout
    # A run whose oracle kept promises says so in its row; the two counts recomputed from the sessions keep none.
    code, out, err = run_app([*argv, "--oracle-keeps", "idle"], capsys)
    kept = tmp_path / "kept.json"
    kept.write_text(out)
    proc = subprocess.run([sys.executable, str(BENCH / "oracle_gap.py"), "--json", str(run), str(kept)],
                          capture_output=True, text=True, timeout=300, check=False)
    plain_row, kept_row = json.loads(proc.stdout)
    assert (plain_row["oracle_keeps"], kept_row["oracle_keeps"]) == ("", "idle")
    assert kept_row["no_wait"] == plain_row["no_wait"] and kept_row["fewest"]["oracle"] >= plain_row["fewest"]["oracle"]
    proc = subprocess.run([sys.executable, str(BENCH / "oracle_gap.py"), str(kept)], capture_output=True, text=True, timeout=300, check=False)
    assert "(oracle keeping idle) |" in proc.stdout


# --- the same population of waits in every mode ------------------------------------------------------------
def test_every_mode_counts_each_cell_once_over_cells(capsys: pytest.CaptureFixture[str]) -> None:
    """``--p95-over cells``: each mode's p95 is over every cell its users ran, the oracle's own population
    (every cell asks for its memory there); a cell that ran at once on its kernel's slice waited 0."""
    taking_turns = [
        plan(0, 0.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
        plan(1, 600.0, 0.6, (True, 600.0), (False, 600.0), (True, 600.0)),
    ]
    s = settings(patience=None)
    oracle = run_mode(s, taking_turns, "oracle", uniform_backend("24GiB", GPU, 1))
    assert (oracle.cells, oracle.requests, oracle.cell_wait_p95) == (4, 4, oracle.wait_p95)
    roomy = run_mode(s, taking_turns, "pooled", uniform_backend("24GiB", GPU, 2))
    # Two requests (each session's first cell) and four cells: the second cells ran at once.
    assert (roomy.requests, roomy.cells, roomy.cell_wait_p95) == (2, 4, 0.0)
    crowded = run_mode(s, taking_turns, "pooled", uniform_backend("24GiB", GPU, 1))
    assert crowded.cells == 4 and crowded.wait_max >= 600.0  # session 1's first cell waits for session 0 to go
    assert crowded.p95_wait("cells") == crowded.cell_wait_p95 and crowded.p95_wait("requests") == crowded.wait_p95
    with pytest.raises(InvalidInput, match="p95 wait is over one of requests, cells"):
        crowded.p95_wait("sessions")

    lab = ["--users", "6", "--rate", "6", "--shape", "flat", "--days", "0.1", "--memory-need", "8GiB-20GiB", "--session-length", "30m",
           "--modes", "elastic,oracle", "--json"]
    argv = ["--gpus", "1x24GiB", *lab, "--target-p95-wait", "1m", "--max-gpus", "8"]
    code, out, err = run_app([*argv, "--p95-over", "cells"], capsys)
    assert code == 0, err
    over_cells = json.loads(out)
    code, out, err = run_app(argv, capsys)
    over_requests = json.loads(out)
    for mode in ("elastic", "oracle"):
        assert over_cells["search"][mode]["p95_over"] == "cells" and over_requests["search"][mode]["p95_over"] == "requests"
        result = over_cells["results"][mode]
        assert result["cells"] >= result["requests"] and result["cell_wait_p95"] <= result["wait_p95"]
    assert over_cells["search"]["elastic"]["gpus"] <= over_requests["search"]["elastic"]["gpus"]
    assert over_cells["search"]["oracle"]["gpus"] == over_requests["search"]["oracle"]["gpus"]  # the same population
    # The same sessions on GPUs enough for all: the elastic pool runs each cell the oracle runs, each counted once.
    code, out, err = run_app(["--gpus", "8x24GiB", *lab], capsys)
    roomy_runs = json.loads(out)["results"]
    assert roomy_runs["elastic"]["abandoned"] == roomy_runs["elastic"]["still_waiting"] == 0
    assert roomy_runs["elastic"]["cells"] == roomy_runs["oracle"]["cells"] > roomy_runs["elastic"]["requests"]
    with pytest.raises(InvalidInput, match=r"--p95-over expected any of \['requests', 'cells'\]"):
        run_app([*argv, "--p95-over", "sessions"], capsys)


# --- the oracle keeping the pool's promises (--oracle-keeps) -------------------------------------------------
def a_short_pause_and_a_newcomer(pause: float) -> list[SessionPlan]:
    """Session 0 computes 10 min, pauses ``pause`` s, computes 10 min; session 1 (its own 10 min) arrives in the pause.
    Both use 60% of a GPU, so on one GPU they take turns."""
    return [
        plan(0, 0.0, 0.6, (True, 600.0), (False, pause), (True, 600.0)),
        plan(1, 610.0, 0.6, (True, 600.0)),
    ]


def test_the_oracle_keeping_idle_holds_an_idle_kernels_memory_as_long_as_the_pool_does() -> None:
    """``idle``: a session keeps its memory through the first suspend idle timeout of an idle spell (its
    next cell runs at once), and only ``burst_settle`` when it uses more than it asked for."""
    one_gpu = uniform_backend("24GiB", GPU, 1)
    short = a_short_pause_and_a_newcomer(60.0)
    free = run_mode(settings(patience=None), short, "oracle", one_gpu)
    # The physical limit: session 0 lets go at 600 s, session 1 starts on arrival, session 0's second cell waits.
    assert (free.requests, free.cells, free.wait_max) == (3, 3, 550.0)
    kept = run_mode(settings(patience=None, oracle_keeps=("idle",), suspend_idle_timeout=120.0), short, "oracle", one_gpu)
    # Kept through its 60 s pause: its second cell runs at once (a cell, not a request); the newcomer waits it out.
    assert (kept.requests, kept.cells, kept.wait_max) == (2, 3, 650.0)
    assert free.leased_pct == free.used_pct == free.busy_pct > 0  # only computing cells hold memory
    assert kept.leased_pct == kept.used_pct > kept.busy_pct  # memory held through the pause, needed by no computing cell
    long_pause = run_mode(settings(patience=None, oracle_keeps=("idle",), suspend_idle_timeout=120.0), a_short_pause_and_a_newcomer(300.0), "oracle", one_gpu)
    # Parked 120 s into its 300 s pause: the newcomer (10 s in) waits 110 s, then session 0's second cell waits for it.
    assert long_pause.requests == 3 and long_pause.wait_mean == (0.0 + 110.0 + (1320.0 - 900.0)) / 3
    # Asking for the default slice (6 GiB) and using 60% of 24 GiB: the rest is burst, taken back after burst_settle (15 s).
    bursting = run_mode(
        settings(patience=None, oracle_keeps=("idle",), suspend_idle_timeout=120.0, requests=parse_requests("default")), short, "oracle", one_gpu
    )
    assert bursting.requests == 3 and bursting.wait_max == 1215.0 - 660.0  # the newcomer waited 5 s; session 0 waits for it


def test_the_oracle_keeping_asked_holds_a_guarantee_whole() -> None:
    """``asked``: three sessions using 30% of a GPU each fit one GPU, but each asked for a whole GPU, so held whole they need three."""
    together = [plan(i, float(i), 0.3, (True, 3600.0)) for i in range(3)]
    whole = settings(gpus="4x24GiB", patience=None, requests=parse_requests("24GiB:1"))
    assert fewest_gpus(whole, "oracle", 0.0, 4, plans=together).gpus == 1
    assert fewest_gpus(replace(whole, oracle_keeps=("asked",)), "oracle", 0.0, 4, plans=together).gpus == 3
    held_whole = run_mode(replace(whole, oracle_keeps=("asked",)), together, "oracle", uniform_backend("24GiB", GPU, 3))
    assert held_whole.leased_pct > held_whole.used_pct == held_whole.busy_pct  # a whole GPU held each, 30% of it needed


@pytest.mark.parametrize("requests", ["exact", "default", "12GiB:1"])
def test_the_oracle_keeping_the_pools_promises_is_still_no_more_than_elastic(requests: str) -> None:
    """Keeping the promises elastic keeps, the oracle needs no more GPUs than elastic, and waits no longer on as many."""
    s = settings(gpus="4x24GiB", patience=600.0, oracle_keeps=("idle", "asked"), suspend_idle_timeout=120.0, requests=parse_requests(requests))
    sessions = [*a_short_pause_and_a_newcomer(60.0), plan(2, 900.0, 0.3, (True, 300.0), (False, 600.0), (True, 300.0))]
    oracle = fewest_gpus(s, "oracle", 60.0, 4, plans=sessions, over="cells")
    elastic = fewest_gpus(s, "elastic", 60.0, 4, plans=sessions, over="cells")
    assert oracle.gpus is not None and elastic.gpus is not None and oracle.gpus <= elastic.gpus
    for count in range(1, 4):
        on = uniform_backend("24GiB", GPU, count), uniform_backend("24GiB", GPU, count)
        assert run_mode(s, sessions, "oracle", on[0]).cell_wait_p95 <= run_mode(s, sessions, "elastic", on[1]).cell_wait_p95


def test_oracle_keeps_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [*SMALL_LAB, "--modes", "oracle"]
    code, out, err = run_app([*argv, "--oracle-keeps", "asked,idle"], capsys)
    assert code == 0, err
    assert "oracle keeping idle,asked: the physical limit for a scheduler that keeps these promises" in out
    code, out, err = run_app([*argv, "--oracle-keeps", "idle", "--json"], capsys)
    assert json.loads(out)["settings"]["oracle_keeps"] == ["idle"]
    code, out, err = run_app([*argv, "--oracle-keeps", "none", "--json"], capsys)
    assert json.loads(out)["settings"]["oracle_keeps"] == []
    code, out, err = run_app([*argv, "--oracle-keeps", "idle,forever"], capsys)
    assert code != 0 and "invalid --oracle-keeps 'idle,forever': 'forever' is no promise; give none, or some of idle: " in err
    assert "Traceback" not in err and not out
