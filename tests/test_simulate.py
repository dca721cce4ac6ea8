"""``jupyter gpupool simulate``: the notebook-lab what-if, run on the real Pool in virtual time."""

from __future__ import annotations

import io
import itertools
import json
import random
import subprocess
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from simulate_cli import run_app

from jupyter_gpupool.apps import workload as workload_module
from jupyter_gpupool.apps.simulate import (
    MODES,
    LabRun,
    RequestSizes,
    Settings,
    fewest_gpus,
    jain_index,
    make_plans,
    parse_requests,
    parse_shape,
    percentile,
    simulate,
)
from jupyter_gpupool.apps.workload import (
    ActivityProfile,
    Fixed,
    LogUniform,
    MemoryNeed,
    Workload,
    load_workload,
    parse_memory_need,
    parse_session_length,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB


def synthetic(share: float, busy: float, idle: float, length: float) -> Workload:
    """Every session needs ``share`` of the GPU and alternates ``busy``/``idle`` seconds."""
    profile = ActivityProfile(memory_held=share * workload_module.TRACE_GPU_MEMORY, busy_runs=(busy,), idle_runs=(idle,), busy_fraction=busy / (busy + idle))
    return Workload(session_length=Fixed(length), profiles=(profile,), sources={"test": "synthetic"})


# --- behaviour of the modes ---------------------------------------------------------------------
def test_pooled_serves_more_sessions_than_exclusive_on_the_same_gpus() -> None:
    settings = Settings(gpus="1x24GiB", users=10, rate=6, shape=parse_shape("flat"), days=0.25, patience=1800)
    results = simulate(settings, ("exclusive", "pooled"), synthetic(0.25, 600, 600, 3600))
    exclusive, pooled = results["exclusive"], results["pooled"]
    assert pooled.served > exclusive.served
    assert pooled.wait_p95 < exclusive.wait_p95
    # Exclusive leases the whole GPU but its kernels use a quarter of what they hold.
    assert exclusive.leased_pct > 2 * exclusive.used_pct
    assert pooled.used_pct > exclusive.used_pct
    for result in results.values():
        assert result.expired == 0  # heartbeats every tick: the pool never expired a lease
        assert result.used_pct <= result.leased_pct + 1e-9
        assert result.busy_pct <= result.used_pct + 1e-9
        assert result.served + result.abandoned + result.refused <= result.sessions


def test_idle_reclaim_lowers_p95_wait_under_pressure() -> None:
    # Work 10 minutes, then sit idle for hours holding half the GPU: the reclaim case.
    settings = Settings(gpus="1x24GiB", users=12, rate=4, shape=parse_shape("flat"), days=0.25, idle_timeout=600, patience=None)
    results = simulate(settings, ("pooled", "reclaim"), synthetic(0.5, 600, 3 * 3600, 4 * 3600))
    pooled, reclaim = results["pooled"], results["reclaim"]
    assert pooled.reclaims == 0
    assert reclaim.reclaims > 0 and reclaim.idle_warnings >= reclaim.reclaims
    assert reclaim.wait_p95 < pooled.wait_p95
    assert reclaim.busy_pct > pooled.busy_pct  # the memory goes to kernels that compute


def test_reclaim_does_nothing_without_pressure() -> None:
    settings = Settings(gpus="2xA100-80GB", users=3, rate=1, shape=parse_shape("flat"), days=0.2, idle_timeout=600)
    results = simulate(settings, ("pooled", "reclaim"), synthetic(0.1, 300, 3 * 3600, 4 * 3600))
    assert results["reclaim"].reclaims == 0
    assert results["reclaim"].wait_max == 0
    assert results["pooled"].served == results["reclaim"].served


def test_same_seed_same_result_and_store_kind_does_not_matter() -> None:
    work = synthetic(0.3, 300, 900, 5400)
    settings = Settings(gpus="1x24GiB", users=8, rate=5, shape=parse_shape("flat"), days=0.15, idle_timeout=600)
    first = simulate(settings, ("reclaim",), work)["reclaim"].to_json()
    second = simulate(replace(settings, store="file"), ("reclaim",), work)["reclaim"].to_json()
    for data in (first, second):
        data.pop("elapsed")
    assert first == second
    other = simulate(replace(settings, seed=7), ("reclaim",), work)["reclaim"]
    assert other.sessions != first["sessions"] or other.wait_mean != first["wait_mean"]


def test_fairness_is_between_zero_and_one() -> None:
    settings = Settings(gpus="1x24GiB", users=5, rate=6, shape=parse_shape("flat"), days=0.2)
    for result in simulate(settings, MODES, synthetic(0.4, 300, 600, 3600)).values():
        assert 0 < result.jain <= 1


def test_jain_index_and_percentile() -> None:
    assert jain_index([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0, 0]) == pytest.approx(0.25)
    assert 0.25 < jain_index([1, 0.5, 0.2, 0.9]) < 1
    assert jain_index([]) == 1.0
    assert percentile([], 95) == 0.0
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile(list(range(1, 101)), 95) == 95


def test_quota_limits_leases_per_user() -> None:
    settings = Settings(gpus="2xA100-80GB", users=1, rate=6, shape=parse_shape("flat"), days=0.1, max_leases=1, patience=None)
    capped = simulate(settings, ("pooled",), synthetic(0.1, 600, 600, 3600))["pooled"]
    free = simulate(replace(settings, max_leases=None), ("pooled",), synthetic(0.1, 600, 600, 3600))["pooled"]
    assert free.wait_max == 0  # plenty of room: nobody waits
    assert capped.wait_max > 0  # one user, one lease at a time: the rest queue on the quota


def test_search_is_monotone_in_the_target_and_pooled_needs_no_more_gpus() -> None:
    settings = Settings(gpus="1x24GiB", users=8, rate=6, shape=parse_shape("flat"), days=0.1, patience=None)
    work = synthetic(0.3, 300, 300, 1800)
    plans = make_plans(settings, work)
    needed = {}
    for mode in ("exclusive", "pooled"):
        found = [fewest_gpus(settings, mode, target, 16, work, plans=plans).gpus for target in (60, 600, 3600)]
        assert all(n is not None for n in found)
        assert found == sorted(found, reverse=True), found  # a looser target never needs more GPUs
        needed[mode] = found
    assert all(p <= e for p, e in zip(needed["pooled"], needed["exclusive"]))
    assert needed["pooled"][0] < needed["exclusive"][0]


def test_search_reports_when_the_target_is_out_of_reach() -> None:
    settings = Settings(gpus="1x24GiB", users=10, rate=20, shape=parse_shape("flat"), days=0.1, patience=None)
    search = fewest_gpus(settings, "exclusive", 1.0, 2, synthetic(0.3, 600, 600, 7200))
    assert search.gpus is None and sorted(search.tried) == [1, 2]


def test_exclusive_requests_a_whole_gpu_and_pooled_its_need() -> None:
    settings = Settings(gpus="2x24GiB", users=2, rate=2, shape=parse_shape("flat"), days=0.05)
    work = synthetic(0.2, 300, 300, 600)
    plans = make_plans(settings, work)
    assert plans
    exclusive = LabRun(settings, plans, "exclusive", SimulatedBackend.from_spec("2x24GiB"))
    pooled = LabRun(settings, plans, "pooled", SimulatedBackend.from_spec("2x24GiB"))
    assert {s.request for s in exclusive.sessions} == {24 * GIB}
    assert {s.request for s in pooled.sessions} == {5 * GIB}  # 20% of 24 GiB = 4.8 GiB, rounded up
    assert {s.used for s in pooled.sessions} == {int(0.2 * 24 * GIB)}
    exclusive.pool.close()
    pooled.pool.close()


# --- what sessions ask for (--requests) ----------------------------------------------------------------
def test_requests_exact_is_the_default_and_matches_the_need_rounded_up() -> None:
    assert Settings().requests == RequestSizes("exact") == parse_requests("exact")
    settings = Settings(gpus="2x24GiB", users=4, rate=4, shape=parse_shape("flat"), days=0.05)
    plans = make_plans(settings, synthetic(0.2, 300, 300, 600))
    pooled = LabRun(settings, plans, "pooled", SimulatedBackend.from_spec("2x24GiB"))
    assert {s.request for s in pooled.sessions} == {s.asked for s in pooled.sessions} == {5 * GIB}
    assert pooled.raised == 0
    pooled.pool.close()


def test_requests_default_asks_for_the_pools_default_slice_and_a_bigger_need_is_raised() -> None:
    settings = Settings(gpus="2x24GiB", users=4, rate=4, shape=parse_shape("flat"), days=0.05, requests=parse_requests("default"))
    small = make_plans(settings, synthetic(0.1, 300, 300, 600))  # needs 2.4 GiB of 24 GiB: below the 6 GiB default (25%)
    run = LabRun(settings, small, "pooled", SimulatedBackend.from_spec("2x24GiB"))
    assert {s.request for s in run.sessions} == {6 * GIB} and run.raised == 0  # they hold what they asked for, not their need
    run.pool.close()
    big = make_plans(settings, synthetic(0.5, 300, 300, 600))  # needs 12 GiB: more than the 6 GiB asked
    run = LabRun(settings, big, "pooled", SimulatedBackend.from_spec("2x24GiB"))
    assert {s.asked for s in run.sessions} == {6 * GIB}
    assert {s.request for s in run.sessions} == {12 * GIB}  # max(request, need): taken to have asked for enough
    assert run.raised == len(run.sessions) > 0
    run.pool.close()
    # The pool's own default_memory decides the default slice.
    from traitlets.config import Config

    config = Config()
    config.PoolPolicy.default_memory = "3GiB"
    run = LabRun(settings, small, "pooled", SimulatedBackend.from_spec("2x24GiB"), config)
    assert {s.request for s in run.sessions} == {3 * GIB}
    run.pool.close()


def test_a_mix_of_requests_is_drawn_with_its_weights_the_same_for_every_mode_and_keeps_the_arrivals() -> None:
    mix = parse_requests("4GiB:0.5, 8GiB:0.3 ,50%:0.2")
    assert mix == RequestSizes("mix", ("4GiB", "8GiB", "50%"), (0.5, 0.3, 0.2))
    assert parse_requests("4GiB:1,8GiB:3").weights == (0.25, 0.75)  # relative weights, normalised
    settings = Settings(gpus="2x24GiB", users=20, rate=60, shape=parse_shape("flat"), days=0.5, requests=mix)
    work = synthetic(0.05, 300, 300, 600)  # 1.2 GiB: below every size asked for
    plans = make_plans(settings, work)
    exact = make_plans(replace(settings, requests=RequestSizes()), work)
    assert [(p.arrival, p.user, p.phases) for p in plans] == [(p.arrival, p.user, p.phases) for p in exact]  # same sessions
    assert {p.asks for p in exact} == {0}
    shares = [sum(1 for p in plans if p.asks == i) / len(plans) for i in range(3)]
    assert len(plans) > 300 and all(abs(share - w) < 0.08 for share, w in zip(shares, mix.weights, strict=True))
    pooled = LabRun(settings, plans, "pooled", SimulatedBackend.from_spec("2x24GiB"))
    suspend = LabRun(settings, plans, "suspend", SimulatedBackend.from_spec("2x24GiB"))
    sizes = {4 * GIB, 8 * GIB, 12 * GIB}  # 50% of the 24 GiB GPU
    assert {s.request for s in pooled.sessions} == sizes
    assert [s.request for s in pooled.sessions] == [s.request for s in suspend.sessions]
    exclusive = LabRun(settings, plans, "exclusive", SimulatedBackend.from_spec("2x24GiB"))
    assert {s.request for s in exclusive.sessions} == {24 * GIB}  # whole GPUs whatever was asked
    for run in (pooled, suspend, exclusive):
        run.pool.close()


def test_asking_for_more_than_the_need_leases_more_and_waits_longer() -> None:
    settings = Settings(gpus="1x24GiB", users=10, rate=6, shape=parse_shape("flat"), days=0.25, patience=1800)
    work = synthetic(0.2, 600, 600, 3600)
    exact = simulate(settings, ("pooled",), work)["pooled"]
    generous = simulate(replace(settings, requests=parse_requests("12GiB:1")), ("pooled",), work)["pooled"]
    assert generous.leased_pct > 1.5 * generous.used_pct and exact.leased_pct < 1.1 * exact.used_pct
    assert generous.wait_p50 > exact.wait_p50 and generous.served < exact.served


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "invalid --requests '': expected 'exact'"),
        ("lots", "'lots' needs a size and a weight, like 20GiB:0.3"),
        ("8GiB", "'8GiB' needs a size and a weight"),
        (":0.5", "':0.5' needs a size and a weight"),
        ("8GiB:0.5,", "'' needs a size and a weight"),
        ("8GiB:0", "the weight of '8GiB' must be a number above 0, got '0'"),
        ("8GiB:-1,4GiB:2", "the weight of '8GiB' must be a number above 0, got '-1'"),
        ("8GiB:nan", "must be a number above 0, got 'nan'"),
        ("8GiB:inf", "must be a number above 0, got 'inf'"),
        ("8GiB:half", "got 'half'"),
        ("8 parsecs:1", "unknown unit 'parsecs'"),
        ("0GiB:1", "a size must be at least 1 byte"),
        ("120%:1", "a percentage must be above 0% and at most 100%"),
        ("8GiB:1,8GiB:2", "'8GiB' is given twice"),
    ],
)
def test_bad_requests_are_refused_in_one_line(text: str, message: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        parse_requests(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_requests_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "1x24GiB", "--users", "6", "--rate", "4", "--shape", "flat", "--days", "0.1", "--memory-need", "30%",
            "--session-length", "30m", "--modes", "exclusive,pooled"]
    code, out, err = run_app([*argv, "--requests", "4GiB:0.5,16GiB:0.5"], capsys)
    assert code == 0, err
    assert "Requests a mix: 50% ask for 4GiB, 50% ask for 16GiB; exclusive GPUs ask for a whole GPU." in out
    assert "taken to have asked for its need rounded up to a GiB (" in out
    code, out, err = run_app([*argv, "--requests", "default", "--json"], capsys)
    data = json.loads(out)
    assert data["settings"]["requests"] == "default"
    assert data["results"]["pooled"]["raised"] == data["results"]["pooled"]["sessions"]  # 7.2 GiB needed, 6 GiB asked
    code, out, err = run_app(argv, capsys)
    assert "Requests exact: each session asks for its need rounded up to a GiB" in out and "taken to have" not in out


# --- elastic: guaranteed what was asked, grown on demand by the real engine ---------------------------------
def test_elastic_slices_grow_to_the_need_and_only_elastic_grows() -> None:
    # Each asks for 2 GiB of a 24 GiB GPU and needs 4.8 GiB: nobody waits, so every slice grows.
    settings = Settings(gpus="1x24GiB", users=3, rate=2, shape=parse_shape("flat"), days=0.1, requests=parse_requests("2GiB:1"))
    work = synthetic(0.2, 300, 300, 1800)
    results = simulate(settings, ("pooled", "elastic"), work)
    pooled, elastic = results["pooled"], results["elastic"]
    assert elastic.grows > 0 and elastic.shrinks == 0 and elastic.raised == 0
    assert elastic.guaranteed_pct < elastic.leased_pct  # leased = current sizes, above the 2 GiB guarantees
    assert elastic.used_pct <= elastic.leased_pct + 1e-9
    assert elastic.served == pooled.served > 0 and elastic.wait_p95 == pooled.wait_p95 == 0
    # Fixed-slice modes stay fixed whatever the pool's burst: taken to have asked for their need.
    assert pooled.grows == 0 and pooled.raised == pooled.sessions and pooled.guaranteed_pct == pytest.approx(pooled.leased_pct)


def test_elastic_takes_burst_back_for_a_waiting_request_and_parks_idle_kernels() -> None:
    settings = replace(SUSPEND_SETTINGS, requests=parse_requests("4GiB:1"), suspend_idle_timeout=120)
    result = simulate(settings, ("elastic",), synthetic(*LONG_IDLE))["elastic"]  # 12 GiB needed, 4 GiB guaranteed
    assert result.grows > 0 and result.shrinks > 0  # grown while the GPU had room, taken back when someone waited
    assert result.suspends > 0 and result.reclaims == 0 and result.work_lost == 0  # parked, never culled
    assert result.expired == 0 and result.grow_waits > 0


def test_a_kernel_whose_slice_cannot_grow_waits_and_computes_nothing() -> None:
    # A 4 GiB quota caps every slice at its 4 GiB guarantee: kernels needing 12 GiB never get to run a cell.
    settings = replace(SUSPEND_SETTINGS, requests=parse_requests("4GiB:1"), quota_max=4 * GIB, days=0.1)
    result = simulate(settings, ("elastic",), synthetic(*LONG_IDLE))["elastic"]
    assert result.grows == 0 and result.served == 0 and result.grow_waits > 0
    assert result.used_pct > 0 and result.busy_pct == 0  # what they hold counts as used, never as computing
    assert result.grow_wait_p95 == pytest.approx(0.1 * 86400, abs=3600)  # still waiting when the run ends
    # A first cell that waits to grow right after its grant is one wait, from the request: each
    # session's cell counts once (not a zero for its grant and then the grow wait).
    assert result.requests == result.sessions


def test_users_who_give_up_waiting_to_grow_and_gpus_stalled_on_grows_are_counted() -> None:
    # Slices capped at their 4 GiB guarantee by quota, kernels needing 12 GiB: every kernel on the GPU
    # waits to grow from its grant, and each user gives up after the hour's patience.
    settings = replace(SUSPEND_SETTINGS, requests=parse_requests("4GiB:1"), quota_max=4 * GIB, days=0.2, patience=3600.0)
    stuck = simulate(settings, ("pooled", "elastic"), synthetic(*LONG_IDLE))
    assert stuck["elastic"].abandoned > 0 and stuck["elastic"].gave_up_growing == stuck["elastic"].abandoned
    assert stuck["elastic"].grow_stalled_pct > 50  # the GPU held slices most of the time, and none computed
    assert stuck["pooled"].gave_up_growing == 0 and stuck["pooled"].grow_stalled_pct == 0  # fixed slices never grow
    # Without the cap slices grow, and kernels compute: far less GPU time is stalled on grows.
    grown = simulate(replace(settings, quota_max=None), ("elastic",), synthetic(*LONG_IDLE))["elastic"]
    assert grown.grows > 0 and grown.gave_up_growing < stuck["elastic"].gave_up_growing
    assert grown.grow_stalled_pct < stuck["elastic"].grow_stalled_pct / 2


def test_elastic_limit_below_the_need_is_taken_as_a_limit_of_the_need() -> None:
    from traitlets.config import Config

    config = Config()
    config.PoolPolicy.burst = "1.5x"  # 4 GiB may grow to 6 GiB, but the kernels need 12 GiB
    settings = replace(SUSPEND_SETTINGS, requests=parse_requests("4GiB:1"), days=0.05)
    run = LabRun(settings, make_plans(settings, synthetic(*LONG_IDLE)), "elastic", SimulatedBackend.from_spec("1x24GiB"), config)
    assert {s.request for s in run.sessions} == {4 * GIB} and {s.limit for s in run.sessions} == {12 * GIB}
    assert run.raised == len(run.sessions)
    assert run.run().grows > 0  # grown past the pool's 1.5x to the need
    config.PoolPolicy.burst = "0"
    with pytest.raises(InvalidInput, match="mode elastic needs slices that may grow, but PoolPolicy.burst is 0"):
        LabRun(settings, [], "elastic", SimulatedBackend.from_spec("1x24GiB"), config)


def test_elastic_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "1x24GiB", "--users", "6", "--rate", "4", "--shape", "flat", "--days", "0.1", "--memory-need", "30%",
            "--session-length", "30m", "--modes", "pooled,elastic", "--requests", "default"]
    code, out, err = run_app(argv, capsys)
    assert code == 0, err
    for label in ("elastic", "guaranteed", "grows / taken back", "grow wait p95", "leased counts current sizes"):
        assert label in out
    code, out, err = run_app([*argv, "--json"], capsys)
    data = json.loads(out)["results"]["elastic"]
    assert data["grows"] > 0 and data["guaranteed_pct"] < data["leased_pct"]
    assert 0 <= data["gave_up_growing"] <= data["abandoned"] and 0 <= data["grow_stalled_pct"] <= 100


# --- pooled+suspend ----------------------------------------------------------------------------------
#: Work 10 minutes, then sit idle for hours holding half a 24 GiB GPU: where taking slices back matters.
LONG_IDLE = (0.5, 600, 3 * 3600, 4 * 3600)
SUSPEND_SETTINGS = Settings(gpus="1x24GiB", users=12, rate=4, shape=parse_shape("flat"), days=0.25, idle_timeout=600, patience=None)


def test_suspend_parks_idle_slices_and_culls_nobody_when_host_ram_is_ample() -> None:
    results = simulate(SUSPEND_SETTINGS, ("reclaim", "suspend"), synthetic(*LONG_IDLE))
    reclaim, suspend = results["reclaim"], results["suspend"]
    assert suspend.suspends > 0 and suspend.reclaims == 0  # every reclaim parked the slice: nobody culled
    assert suspend.work_lost == 0 and reclaim.work_lost > 0  # a cull throws the kernel's work away
    assert suspend.resumes > 0 and suspend.resume_waits >= suspend.resumes
    assert suspend.expired == 0  # every suspend and restore was confirmed in time: none failed
    # Resume waits are in the wait statistics too.
    assert suspend.requests >= suspend.resume_waits and suspend.resume_wait_max <= suspend.wait_max
    # Host RAM: the parked slices were counted, within the budget, and all returned at the end.
    assert 0 < suspend.parked_p95 <= suspend.parked_peak <= suspend.parked_limit == 512 * GIB
    assert suspend.parked_peak % int(0.5 * 24 * GIB) == 0  # whole sessions' used memory, parked
    assert reclaim.suspends == 0 and reclaim.parked_peak == 0
    assert suspend.wait_p95 < reclaim.wait_p95  # the short idle timeout is safe, and it frees memory sooner


def test_suspend_culls_when_the_host_ram_budget_is_tiny() -> None:
    work = synthetic(*LONG_IDLE)
    tiny = simulate(replace(SUSPEND_SETTINGS, parked_limit=GIB), ("suspend",), work)["suspend"]
    assert tiny.suspends == 0 and tiny.reclaims > 0  # no 12 GiB slice fits in 1 GiB of host RAM: culled
    assert tiny.parked_peak == 0 and tiny.work_lost > 0
    none = simulate(replace(SUSPEND_SETTINGS, parked_limit=0), ("suspend",), work)["suspend"]
    assert none.suspends == 0 and none.reclaims == tiny.reclaims


def test_suspend_mode_is_deterministic_and_store_kind_does_not_matter() -> None:
    work = synthetic(*LONG_IDLE)
    runs = [
        simulate(SUSPEND_SETTINGS, ("suspend",), work)["suspend"].to_json(),
        simulate(SUSPEND_SETTINGS, ("suspend",), work)["suspend"].to_json(),
        simulate(replace(SUSPEND_SETTINGS, store="file"), ("suspend",), work)["suspend"].to_json(),
    ]
    for data in runs:
        data.pop("elapsed")
    assert runs[0] == runs[1] == runs[2]
    assert runs[0]["suspends"] > 0
    other = simulate(replace(SUSPEND_SETTINGS, seed=7), ("suspend",), work)["suspend"].to_json()
    other.pop("elapsed")
    assert other != runs[0]


def test_a_resume_waits_at_least_the_restore_time() -> None:
    work = synthetic(*LONG_IDLE)
    used = int(0.5 * 24 * GIB)
    restore = 200.0  # within the engine's transition_timeout (300 s): slow, but not given up on
    slow = simulate(replace(SUSPEND_SETTINGS, checkpoint_rate=used / restore), ("suspend",), work)["suspend"]
    fast = simulate(SUSPEND_SETTINGS, ("suspend",), work)["suspend"]
    assert slow.resumes > 0 and slow.expired == 0
    assert slow.resume_wait_p50 >= restore  # every resume waits for its memory to be copied back
    assert fast.resume_wait_p50 < slow.resume_wait_p50


def test_a_restore_rate_of_its_own_sets_the_resume_wait() -> None:
    """Measured checkpoints park slower than they restore (H200: ~2 GB/s out, ~6 GB/s back)."""
    work = synthetic(*LONG_IDLE)
    used = int(0.5 * 24 * GIB)
    slow_back = simulate(replace(SUSPEND_SETTINGS, restore_rate=used / 200.0), ("suspend",), work)["suspend"]
    assert slow_back.resumes > 0 and slow_back.resume_wait_p50 >= 200.0  # the restore's copy is what a resume waits for
    settings = replace(SUSPEND_SETTINGS, checkpoint_rate=2e9, restore_rate=6e9)
    run = LabRun(settings, make_plans(settings, work), "suspend", SimulatedBackend.from_spec(settings.gpus))
    session = run.sessions[0]
    assert run._restore_seconds(session) == pytest.approx(session.used / 6e9)
    same = LabRun(replace(settings, restore_rate=None), run.plans, "suspend", SimulatedBackend.from_spec(settings.gpus))
    assert same._restore_seconds(same.sessions[0]) == pytest.approx(session.used / 2e9)  # none given: the checkpoint rate
    run.pool.close()
    same.pool.close()


def test_suspend_moves_idle_kernels_to_make_room_and_confirms_the_moves() -> None:
    # Mixed slice sizes on two GPUs fragment them: the engine plans live moves (MIGRATE).
    settings = Settings(gpus="2x24GiB", users=10, rate=6, shape=parse_shape("flat"), days=0.2, seed=1,
                        memory_need=MemoryNeed("range", 4 * GIB, 14 * GIB), patience=None)
    result = simulate(settings, ("suspend",), synthetic(0.3, 300, 2400, 3 * 3600))["suspend"]
    assert result.moves > 0 and result.suspends > 0
    assert result.expired == 0 and result.reclaims == 0  # every move and suspend finished: nobody stopped


def test_suspend_mode_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "1x24GiB", "--users", "12", "--rate", "4", "--shape", "flat", "--days", "0.25", "--memory-need", "50%",
            "--session-length", "4h", "--modes", "reclaim,pooled+suspend", "--suspend-idle-timeout", "2m",
            "--parked-memory-limit", "64GiB", "--checkpoint-rate", "10"]
    code, out, err = run_app(argv, capsys)
    assert code == 0, err
    assert "pooled+suspend: idle timeout 2 min, host RAM for parked slices 64 GiB, suspend/restore at 10 GB/s" in out
    for label in ("pooled+reclaim", "pooled+suspend", "suspends", "resume wait p95", "parked peak / p95", "work lost"):
        assert label in out
    code, out, err = run_app([*argv, "--json"], capsys)
    data = json.loads(out)["results"]["suspend"]
    assert data["parked_limit"] == 64 * GIB and data["parked_peak"] <= 64 * GIB
    assert json.loads(out)["settings"]["suspend_idle_timeout"] == 120
    code, out, err = run_app([*argv, "--restore-rate", "6"], capsys)
    assert code == 0, err
    assert "suspend at 10 GB/s, restore at 6 GB/s" in out


# --- workload from the traces -------------------------------------------------------------------------
def test_workload_comes_from_the_traces_when_present() -> None:
    if workload_module.find_traces() is None:
        pytest.skip("../shared/traces is not here")
    work = load_workload()
    assert "philly_runtime.csv" in work.sources["session_length"]
    assert "alibaba-genai-v2026" in work.sources["activity"]
    assert len(work.profiles) > 100
    lengths = work.session_length
    assert 300 <= lengths.quantile(0.0) and lengths.quantile(1.0) <= 8 * 3600
    # The trace's point: memory stays held while compute is mostly idle.
    assert 0.1 < work.busy_fraction() < 0.5
    assert any(not p.busy_runs for p in work.profiles)


def write_tiny_traces(folder: Path) -> Path:
    """Traces of the real layout and columns, small: 6 run times and 3 pods (one below MIN_HELD)."""
    (folder / "runtimes").mkdir(parents=True)
    (folder / "runtimes" / "philly_runtime.csv").write_text("jobid,runtime\n" + "".join(f"j{i},{v}\n" for i, v in enumerate([10, 400, 900, 3600, 20000, 40000])))
    genai = folder / "alibaba-genai-v2026"
    genai.mkdir()
    memory = {"10.0.0.1": [0, 8 * GIB, 8 * GIB, 9 * GIB], "10.0.0.2": [2 * GIB] * 4, "10.0.0.3": [1024] * 4}
    duty = {"10.0.0.1": [50, 0, 0, 30], "10.0.0.2": [0, 0, 0, 0], "10.0.0.3": [90] * 4}
    for name, series in (("pod_gpu_memory_used_bytes_anon", memory), ("pod_gpu_duty_cycle_anon", duty)):
        rows = "container_ip,timestamp_anon,value\n" + "".join(f"{ip},{57 * i},{v}\n" for ip, values in series.items() for i, v in enumerate(values))
        data = rows.encode()
        with tarfile.open(genai / f"{name}.tar.gz", "w:gz") as tar:
            member = tarfile.TarInfo(f"{name}.csv")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return folder


def test_what_the_traces_give_is_kept_between_runs_and_read_again_when_they_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traces = write_tiny_traces(tmp_path / "traces")
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "cache"))
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()
    first = load_workload(str(traces))
    assert first.session_length.values == (400.0, 900.0, 3600.0, 20000.0)
    assert [p.memory_held for p in first.profiles] == [8 * GIB, 2 * GIB]
    assert first.profiles[0].busy_runs == (57.0, 57.0) and first.profiles[1].busy_runs == ()
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2

    # A second run (a new process: no in-memory copy) reads the kept copy, not the traces.
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()
    monkeypatch.setattr(workload_module, "_read_tar_csv", lambda path: pytest.fail("read the traces again"))
    again = load_workload(str(traces))
    assert again.profiles == first.profiles and again.session_length == first.session_length
    monkeypatch.undo()
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "cache"))

    # A damaged copy is built again; so is one for a trace file that changed.
    for kept in (tmp_path / "cache").glob("genai-profiles-*.json"):
        kept.write_text('[[1, "not a list"')
    workload_module.genai_profiles.cache_clear()
    assert load_workload(str(traces)).profiles == first.profiles
    runtimes = traces / "runtimes" / "philly_runtime.csv"
    runtimes.write_text(runtimes.read_text() + "j9,7200\n")
    workload_module.philly_session_lengths.cache_clear()
    assert load_workload(str(traces)).session_length.values == (400.0, 900.0, 3600.0, 20000.0, 7200.0)
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()


def test_an_unwritable_cache_only_means_reading_the_traces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traces = write_tiny_traces(tmp_path / "traces")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(blocker / "cache"))  # under a file: can never be made
    workload_module.philly_session_lengths.cache_clear()
    assert load_workload(str(traces)).session_length.values == (400.0, 900.0, 3600.0, 20000.0)
    workload_module.philly_session_lengths.cache_clear()
    workload_module.genai_profiles.cache_clear()


def _damage(path: Path, kind: str) -> None:
    """Replace a kept copy with one kind of damage."""
    import os

    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)  # reading it would wait for a writer forever
    elif kind == "nested":
        path.write_text("[" * 100_000)  # json.loads: RecursionError
    elif kind == "huge":
        with open(path, "wb") as handle:  # sparse: no disk used, yet more than a copy may have
            handle.truncate(workload_module.MAX_CACHE_BYTES + 1)
    elif kind == "symlink":
        path.symlink_to("/dev/zero")  # endless
    elif kind == "directory":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(b"\xff\xfe\x00garbage")
    else:  # valid JSON of the wrong shape
        path.write_text(kind)


@pytest.mark.parametrize(
    "kind", ["fifo", "nested", "huge", "symlink", "directory", "binary", '{"a": 1}', "5", '[["x"]]', '[null]', '[["a", [], [], 1]]']
)
def test_a_damaged_kept_copy_only_means_reading_the_traces_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """A FIFO, a deeply nested or huge file or one of the wrong types in the cache once hung a run
    or ended it with a traceback; now each is read past with one warning, and replaced."""
    import threading

    traces = write_tiny_traces(tmp_path / "traces")
    monkeypatch.setenv("GPUPOOL_CACHE_DIR", str(tmp_path / "cache"))
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()
    first = load_workload(str(traces))
    for kept in (tmp_path / "cache").glob("*.json"):
        _damage(kept, kind)
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()
    result: list[object] = []

    def load() -> None:
        try:
            result.append(load_workload(str(traces)))
        except BaseException as err:  # noqa: BLE001 -- reported below
            result.append(err)

    runner = threading.Thread(target=load, daemon=True)  # a run that hangs must fail the test, not stall it
    with caplog.at_level("WARNING", logger="jupyter_gpupool.apps.workload"):
        runner.start()
        runner.join(timeout=30)
    assert not runner.is_alive(), f"a {kind} kept copy made the run hang"
    again = result[0]
    assert not isinstance(again, BaseException), repr(again)
    assert again.profiles == first.profiles and again.session_length == first.session_length
    warnings = [r.getMessage() for r in caplog.records if "reading the traces again" in r.getMessage()]
    assert len(warnings) == 2 and all("is damaged" in w and "\n" not in w for w in warnings), warnings
    if kind != "directory":  # a copy can be written again in its place (a directory stays; harmless)
        workload_module.genai_profiles.cache_clear()
        workload_module.philly_session_lengths.cache_clear()
        caplog.clear()
        monkeypatch.setattr(workload_module, "_read_tar_csv", lambda path: pytest.fail("read the traces again"))
        assert load_workload(str(traces)).profiles == first.profiles
    workload_module.genai_profiles.cache_clear()
    workload_module.philly_session_lengths.cache_clear()


def test_fallback_is_used_and_labelled_only_without_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workload_module, "find_traces", lambda explicit=None: None)
    work = workload_module.load_workload()
    assert all(text.startswith("FALLBACK") for text in work.sources.values())
    assert 300 <= work.session_length.quantile(0.5) <= 8 * 3600
    assert 0.1 < work.busy_fraction() < 0.5
    settings = Settings(gpus="1x24GiB", users=4, rate=2, shape=parse_shape("flat"), days=0.1)
    assert simulate(settings, ("pooled",), work)["pooled"].sessions > 0


def test_phases_add_up_and_start_busy() -> None:
    profile = ActivityProfile(GIB, (60.0, 120.0), (300.0,), 0.3)
    phases = profile.phases(3600, random.Random(1))
    assert phases[0][0] is True
    assert sum(length for _, length in phases) == pytest.approx(3600)
    assert all(a[0] != b[0] for a, b in itertools.pairwise(phases))
    assert ActivityProfile(GIB, (), (57.0,), 0.0).phases(100, random.Random(1)) == [(False, 100)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trace", MemoryNeed("trace")),
        ("8GiB", MemoryNeed("fixed", 8 * GIB)),
        ("25%", MemoryNeed("share", 0.25)),
        ("2GiB-8GiB", MemoryNeed("range", 2 * GIB, 8 * GIB)),
    ],
)
def test_memory_need_forms(text: str, expected: MemoryNeed) -> None:
    assert parse_memory_need(text) == expected


@pytest.mark.parametrize("text", ["lots", "", "8GiB-2GiB", "0%", "-3GiB"])
def test_bad_memory_need(text: str) -> None:
    with pytest.raises(InvalidInput, match="memory need"):
        parse_memory_need(text)


def test_session_length_and_shape_forms() -> None:
    work = synthetic(0.1, 60, 60, 600)
    assert parse_session_length("45m", work) == Fixed(2700)
    assert parse_session_length("30m-2h", work) == LogUniform(1800, 7200)
    assert parse_session_length("trace", work) is work.session_length
    with pytest.raises(InvalidInput, match="session length"):
        parse_session_length("2h-30m", work)
    shape = parse_shape("9-11:2,13-17:1")
    assert shape.weight(9.5 * 3600) == 1 and shape.weight(14 * 3600) == 0.5 and shape.weight(3 * 3600) == 0
    assert shape.weight((24 + 10) * 3600) == 1  # repeats every day
    for bad in ("25-3:1", "9-11:-1", "nine-eleven", "0-24:0"):
        with pytest.raises(InvalidInput, match="day shape"):
            parse_shape(bad)


def test_arrivals_follow_the_day_shape() -> None:
    settings = Settings(users=50, rate=30, shape=parse_shape("class"), days=2, seed=3)
    plans = make_plans(settings, synthetic(0.1, 60, 60, 600))
    hours = [int(p.arrival // 3600) % 24 for p in plans]
    in_class = sum(1 for h in hours if h in (9, 10))
    assert in_class > 0.6 * len(hours)
    assert not any(h < 8 or h > 20 for h in hours)
    assert len({p.user for p in plans}) > 20


# --- the command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "3xFOO"], "unknown GPU 'FOO'"),
        (["--users", "0"], "invalid --users 0"),
        (["--rate", "fast"], "invalid --rate 'fast'"),
        (["--days", "0"], "invalid --days 0"),
        (["--shape", "25-3:1"], "invalid day shape"),
        (["--memory-need", "lots"], "invalid memory need"),
        (["--session-length", "forever"], "invalid session length"),
        (["--modes", "exclusive,bogus"], "invalid mode 'bogus'"),
        (["--idle-timeout", "5x"], "invalid duration '5x'"),
        (["--tick", "10m"], "too long for the heartbeat TTL"),
        (["--gpus", "1xA100-80GB,1xT4", "--target-p95-wait", "5m"], "needs one GPU model"),
        (["--traces", "/nonexistent/traces"], "no traces under"),
        (["--store", "disk"], "invalid --store 'disk'"),
        (["--jobs", "0"], "invalid --jobs 0"),
        (["--quota", "much"], "invalid size 'much'"),
        (["--parked-memory-limit", "40%"], "invalid --parked-memory-limit '40%'"),
        (["--parked-memory-limit", "lots"], "invalid --parked-memory-limit 'lots': expected a size of host RAM"),
        (["--checkpoint-rate", "0"], "invalid --checkpoint-rate 0"),
        (["--restore-rate", "-1"], "invalid --restore-rate -1: expected GB/s from 0.01 to 10000"),
        (["--suspend-idle-timeout", "soon"], "invalid duration 'soon'"),
        (["--modes", "suspended"], "invalid mode 'suspended': choose from exclusive, pooled, reclaim, suspend, elastic"),
        (["--requests", "20GiB:0.5,40GiB"], "invalid --requests '20GiB:0.5,40GiB': '40GiB' needs a size and a weight"),
        (["--requests", "20GiB:0"], "the weight of '20GiB' must be a number above 0"),
    ],
)
def test_cli_rejects_bad_input_in_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_app(argv, capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert out == ""


def test_cli_json_with_search(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "1x24GiB", "--users", "6", "--rate", "4", "--shape", "flat", "--days", "0.1",
            "--memory-need", "30%", "--session-length", "30m", "--target-p95-wait", "10m", "--max-gpus", "4", "--json"]
    code, out, err = run_app(argv, capsys)
    assert code == 0, err
    data = json.loads(out)
    assert set(data["results"]) == set(MODES)
    for result in data["results"].values():
        for key in ("leased_pct", "used_pct", "wait_p50", "wait_p95", "wait_max", "served_per_day", "reclaims", "jain"):
            assert key in result
    assert set(data["search"]) == set(MODES)
    assert data["search"]["pooled"]["gpus"] <= data["search"]["exclusive"]["gpus"]


def test_jupyter_gpupool_simulate_prints_a_table() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.apps.cli", "simulate", "--gpus", "1x24GiB", "--users", "5", "--rate", "3",
         "--days", "0.05", "--shape", "flat", "--memory-need", "4GiB", "--session-length", "20m"],
        check=False, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for label in ("exclusive GPUs", "pooled", "pooled+reclaim", "pooled+suspend", "wait p95", "Jain", "suspends"):
        assert label in proc.stdout


def test_jobs_give_the_same_tables_as_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    """`--jobs N` runs the modes and the GPU-count search in processes: same seed, same tables."""
    argv = ["--gpus", "1x24GiB", "--users", "6", "--rate", "4", "--shape", "flat", "--days", "0.1",
            "--memory-need", "30%", "--session-length", "30m", "--target-p95-wait", "2m", "--max-gpus", "4", "--json"]
    tables = []
    for jobs in ("1", "2", "3"):
        code, out, err = run_app([*argv, "--jobs", jobs], capsys)
        assert code == 0, err
        data = json.loads(out)
        for result in [*data["results"].values(), *(s["result"] for s in data["search"].values() if s["result"])]:
            result.pop("elapsed")
        tables.append((data["results"], data["search"]))
    assert tables[0] == tables[1] == tables[2]  # 3 processes for 4 modes: counts tried ahead, some dropped
    assert any(len(s["p95_wait_by_gpus"]) > 1 for s in tables[0][1].values())  # the search tried several counts


def test_lab_sim_prints_pooled_suspend_beside_the_other_modes() -> None:
    """bench/lab_sim.py (the Markdown of bench/RESULTS.md): one row per mode, pooled+suspend's columns."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "bench" / "lab_sim.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--scenario", "class", "--days", "0.42", "--target", "", "--jobs", "2"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if line.startswith("| mode |"))
    assert "| Jain | suspends | resume wait p95 | parked peak / p95 | work lost |" in header
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| pooled", "| exclusive", "| elastic"))]
    assert [row.split(" | ")[0] for row in rows] == ["| exclusive GPUs", "| pooled", "| pooled+reclaim", "| pooled+suspend",
                                                     "| elastic"]
    assert all(len(row.split(" | ")) == len(header.split(" | ")) for row in rows)
    assert "--jobs 2" in proc.stdout and "pooled+suspend: idle timeout 2 min" in proc.stdout
    assert "Requests exact: each session asks for its need rounded up to a GiB" in proc.stdout


def test_lab_sim_sweeps_the_suspend_idle_timeout() -> None:
    script = Path(__file__).resolve().parent.parent / "bench" / "lab_sim.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--scenario", "class", "--days", "0.42", "--target", "", "--sweep-suspend-idle", "1m,5m",
         "--checkpoint-rate", "2", "--restore-rate", "6"],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--suspend-idle-timeout 1m" in proc.stdout and "--suspend-idle-timeout 5m" in proc.stdout
    assert "suspend at 2 GB/s, restore at 6 GB/s" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("| 1 min |", "| 5 min |"))]
    assert len(rows) == 2 and all(row.count("|") == 12 for row in rows)
