"""Scheduling promises the docs make (issue 11): group guarantees, GPU models, requests larger than
one GPU, reservations that free their memory, fair-share decay, NVLink, and the per-user queue cap.

Each test drives the engine through the Pool facade on a real SQLite file with explicit time.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import subprocess

import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.engine import Engine, PoolState
from jupyter_gpupool.core.models import Activity, DecisionKind, Device, LeaseRequest, LeaseState, model_matches
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB


def decided(pool, kind: DecisionKind) -> list[str]:
    return [e["lease_id"] for e in pool.events() if e["kind"] == kind.value]


# --- 1. group guarantees count as user guarantees do -----------------------------------------------


@pytest.mark.parametrize(
    "quotas",
    [
        {"user_quotas": {"prof": {"guaranteed": "8GiB"}}},
        {"group_quotas": {"staff": {"guaranteed": "8GiB"}}},
    ],
    ids=["user-guarantee", "group-guarantee"],
)
def test_a_guarantee_preempts_a_busy_holder_over_its_own(tmp_path, quotas):
    pool = make_pool(tmp_path, spec="1x16GiB", min_runtime=0, grace_period=30, **quotas)
    hog = pool.request(req("hog", gib=16), now=T0)
    pool.report_activity(hog.id, Activity(busy=True), now=T0 + 1)
    prof = pool.request(req("prof", gib=8, groups=("staff",)), now=T0 + 2)
    assert prof.state is LeaseState.QUEUED
    pool.tick(now=T0 + 3)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == [hog.id]
    assert "guaranteed quota" in pool.get(hog.id).reclaim_reason
    pool.tick(now=T0 + 40)
    assert pool.get(hog.id).state is LeaseState.RELEASED
    assert pool.get(prof.id).state is LeaseState.GRANTED


def test_a_group_guarantee_is_shared_by_its_members_and_protects_them(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", min_runtime=0, grace_period=0, group_quotas={"staff": {"guaranteed": "8GiB"}})
    ta = pool.request(req("ta", gib=6, groups=("staff",)), now=T0)
    student = pool.request(req("student", gib=10), now=T0)
    # Past the group's guarantee together (6 + 4 > 8): no preemption for the second member.
    prof = pool.request(req("prof", gib=4, groups=("staff",)), now=T0 + 1)
    pool.tick(now=T0 + 2)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == []
    pool.release(prof.id, now=T0 + 3)
    # Within it together (6 + 2 <= 8): the student, covered by no guarantee, makes room.
    prof = pool.request(req("prof", gib=2, groups=("staff",)), now=T0 + 4)
    pool.tick(now=T0 + 5)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == [student.id]
    assert "group staff's guaranteed quota" in pool.get(student.id).reclaim_reason
    pool.tick(now=T0 + 6)
    assert pool.get(prof.id).state is LeaseState.GRANTED
    assert pool.get(ta.id).state is LeaseState.GRANTED  # the member within the group's guarantee is never a victim


# --- 2. a GPU model request lands on that model --------------------------------------------------

MIXED = "1xA100-80GB,1xA100-40GB,1xA10-24GB,1xL4,1xL40S-48GB,1xRTX-A4000-16GB,1xA40-48GB"


@pytest.mark.parametrize(
    ("wanted", "lands_on"),
    [
        ("A10", {"A10-24GB"}),
        ("L4", {"L4"}),
        ("A40", {"A40-48GB"}),
        ("A100", {"A100-80GB", "A100-40GB"}),
        ("A100-80GB", {"A100-80GB"}),
        ("a100 40gb", {"A100-40GB"}),
        ("NVIDIA L40S", {"L40S-48GB"}),
        ("RTX A4000", {"RTX-A4000-16GB"}),
        ("A4000", {"RTX-A4000-16GB"}),
    ],
)
def test_a_model_request_lands_only_on_that_model(tmp_path, wanted, lands_on):
    pool = make_pool(tmp_path, spec=MIXED, preemption=False, idle_policy="never")
    models = {d.uuid: d.name for d in pool.devices()}
    # Ask until every GPU of the model is full: each grant is on the model, the rest wait.
    leases = [pool.request(req(f"u{i}", gib=16, model=wanted), now=T0 + i) for i in range(12)]
    granted = [lease for lease in leases if lease.state is LeaseState.GRANTED]
    assert granted, f"{wanted} was never granted"
    assert {models[u] for lease in granted for u in lease.devices} <= lands_on
    waiting = [lease for lease in leases if lease.state is LeaseState.QUEUED]
    assert waiting  # and never spill onto another model
    assert pool.queue_info(waiting[0].id, now=T0 + 20).reason == f"waits for a GPU of model {wanted} with enough free memory"


@pytest.mark.parametrize(
    ("wanted", "name", "gib", "matches"),
    [
        ("A10", "NVIDIA A100-SXM4-80GB", 80, False),
        ("L4", "NVIDIA L40S", 45, False),
        ("A40", "NVIDIA RTX A4000", 16, False),
        ("A100", "NVIDIA A100-SXM4-80GB", 80, True),
        ("A100", "NVIDIA A100-PCIE-40GB", 40, True),
        ("A100-80GB", "NVIDIA A100 80GB PCIe", 80, True),
        ("A100-80GB", "NVIDIA A100-SXM4-40GB", 40, False),
        ("H100-80GB", "NVIDIA H100 PCIe", 79.6, True),  # no size in the name: the memory decides
        ("T4", "Tesla T4", 15.4, True),
        ("RTX3090", "NVIDIA GeForce RTX 3090", 24, True),
        ("3090", "NVIDIA GeForce RTX 3090", 24, False),
        ("A10", "NVIDIA A10G", 24, False),
        ("nvidia a100-sxm4-80gb", "NVIDIA A100-SXM4-80GB", 80, True),
    ],
)
def test_model_matching_on_real_nvml_names(wanted, name, gib, matches):
    device = Device(index=0, uuid="GPU-x", name=name, memory_total=int(gib * GIB))
    assert model_matches(wanted, device) is matches


def test_an_unknown_model_is_refused_with_the_models_the_pool_has(tmp_path):
    pool = make_pool(tmp_path, spec="2xA100-80GB,1xT4-16GB")
    with pytest.raises(RequestRefused, match=r"no GPU of model 'A10' in this pool; models here: A100-80GB, T4"):
        pool.request(req(gib=8, model="A10"), now=T0)
    with pytest.raises(InvalidInput, match="GPU model"):
        pool.request(req(gib=8, model=" - "), now=T0)
    assert pool.leases() == []


# --- 3. a request larger than one GPU spans the fewest GPUs ----------------------------------------


def test_a_request_larger_than_any_gpu_spans_the_fewest_gpus(tmp_path):
    pool = make_pool(tmp_path, spec="3xA100-80GB")
    lease = pool.request(req(gib=140), now=T0)
    assert lease.state is LeaseState.GRANTED
    assert (lease.num_gpus, lease.memory, len(set(lease.devices))) == (2, 70 * GIB, 2)
    assert pool.request(req(gib=100), now=T0).state is LeaseState.QUEUED  # 2 × 50 GiB: only 10 GiB on two GPUs
    third = pool.request(req(gib=230), now=T0)
    assert (third.num_gpus, third.memory) == (3, 78_507 * 1024**2)  # 230 GiB / 3 = 78,506.7 MiB, rounded up to whole MiB


def test_spanning_prefers_nvlink_peers(tmp_path):
    pool = pool_with_links(tmp_path, sizes=[80, 80, 80, 80], links=[(1, 3)])
    lease = pool.request(req(gib=140), now=T0)
    uuids = [d.uuid for d in pool.devices()]
    assert set(lease.devices) == {uuids[1], uuids[3]}


def test_with_spanning_off_the_refusal_names_what_would_fit(tmp_path):
    pool = make_pool(tmp_path, spec="2xA100-80GB", span_large_requests=False)
    with pytest.raises(RequestRefused, match=r"requested 140 GiB but the largest GPU has 80 GiB; ask for --gpus 2 with 70 GiB each, or at most 80 GiB on one GPU"):
        pool.request(req(gib=140), now=T0)
    assert pool.leases() == []


def test_a_queued_lease_resized_past_one_gpu_spans_too(tmp_path):
    pool = make_pool(tmp_path, spec="2xA100-80GB")
    pool.request(req("a", gib=80), now=T0)
    queued = pool.request(req("b", gib=80), now=T0)
    filler = pool.request(req("c", gib=80), now=T0)
    assert (queued.state, filler.state) == (LeaseState.GRANTED, LeaseState.QUEUED)
    resized = pool.resize(filler.id, memory=150 * GIB, now=T0 + 1)
    assert (resized.num_gpus, resized.memory) == (2, 75 * GIB)


# --- 4. reservations free their memory when the window opens ---------------------------------------


def tuesday_at(hour: int, minute: int = 0) -> float:
    start = dt.datetime.fromtimestamp(T0).replace(hour=hour, minute=minute, second=0, microsecond=0)
    return (start + dt.timedelta(days=(1 - start.weekday()) % 7)).timestamp()


LAB = {"name": "lab", "groups": ["cs101"], "memory": "40GiB", "weekdays": ["tue"], "start": "09:00", "end": "11:00"}


def test_a_reservation_window_frees_its_memory_idle_first_then_by_preemption(tmp_path):
    pool = make_pool(
        tmp_path, spec="1x48GiB", reservations=[LAB], idle_timeout=600, warning_period=120, min_runtime=300, grace_period=60
    )
    early = tuesday_at(7)
    busy = pool.request(req("researcher", gib=24), now=early)
    idle = pool.request(req("idler", gib=24), now=early + 1)
    pool.report_activity(busy.id, Activity(busy=True), now=early + 2)
    opens = tuesday_at(9)
    student = pool.request(req("s1", gib=16, groups=("cs101",)), now=opens + 1)
    assert student.state is LeaseState.QUEUED
    assert "waits while memory is freed for the reservation 'lab' (cs101, Tue 09:00–11:00)" == pool.queue_info(student.id, now=opens + 1).reason
    warned = pool.get(idle.id)
    assert warned.reclaim_reason.startswith("reclaimed for the reservation 'lab'")
    assert warned.reclaim_at == opens + 1 + 120  # the usual idle warning first
    preempted = pool.get(busy.id)
    assert preempted.reclaim_reason == "preempted for the reservation 'lab' (cs101, Tue 09:00–11:00)"
    assert preempted.reclaim_at == opens + 1 + 60  # then preemption, after the grace period
    pool.tick(now=opens + 200)
    assert pool.get(busy.id).state is LeaseState.RELEASED and pool.get(idle.id).state is LeaseState.RELEASED
    assert pool.get(student.id).state is LeaseState.GRANTED  # during the class, not after it


def test_reservation_reclaims_respect_guarantees_and_the_preemption_switch(tmp_path):
    pool = make_pool(tmp_path, spec="1x48GiB", reservations=[LAB], min_runtime=0, grace_period=0, preemption=False)
    early = tuesday_at(7)
    busy = pool.request(req("researcher", gib=48), now=early)
    pool.report_activity(busy.id, Activity(busy=True), now=early + 1)
    pool.tick(now=tuesday_at(9, 5))
    assert pool.get(busy.id).reclaim_at is None  # preemption off: only idle leases go
    guarded = make_pool(
        tmp_path, name="guarded.sqlite", spec="1x48GiB", reservations=[LAB], min_runtime=0, grace_period=0,
        user_quotas={"researcher": {"guaranteed": "48GiB"}},
    )
    busy = guarded.request(req("researcher", gib=48), now=early)
    guarded.report_activity(busy.id, Activity(busy=True), now=early + 1)
    guarded.tick(now=tuesday_at(9, 5))
    assert guarded.get(busy.id).reclaim_at is None  # within its guarantee


def test_a_request_held_back_by_a_reservation_says_so(tmp_path):
    pool = make_pool(tmp_path, spec="1x48GiB", preemption=False, reservations=[LAB])
    outsider = pool.request(req("outsider", gib=16), now=tuesday_at(9, 30))
    assert outsider.state is LeaseState.QUEUED
    assert pool.queue_info(outsider.id, now=tuesday_at(9, 30)).reason == "waits for the reservation 'lab' (cs101, Tue 09:00–11:00)"


def test_reservations_that_can_never_be_honoured_are_refused(tmp_path):
    pool = make_pool(tmp_path, spec="1x48GiB")
    with pytest.raises(RequestRefused, match=r"holds 64 GiB but the whole pool has 48 GiB; ask for at most 48 GiB"):
        pool.book_reservation({"name": "big", "users": ["prof"], "memory": "64GiB", "start": T0, "duration": "1h"}, now=T0)
    with pytest.raises(RequestRefused, match="in the past"):
        pool.book_reservation({"name": "old", "users": ["prof"], "memory": "8GiB", "start": T0 - 7200, "end": T0 - 3600}, now=T0)
    assert pool.reservations() == []


def test_the_cli_refuses_an_impossible_reservation_with_exit_code_3(tmp_path):
    import os

    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite")}
    result = subprocess.run(
        ["jupyter", "gpupool", "reserve", "big", "--memory", "64GiB", "--users", "prof", "--for", "1h"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert result.returncode == 3, result.stderr
    assert "the whole pool has 16 GiB" in result.stderr and "Traceback" not in result.stderr


# --- 6. fair-share decay and NVLink, with tests that can fail ---------------------------------------


def test_fair_share_history_decays_with_its_half_life(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", aging_interval=0, preemption=False, fair_share_half_life=3600)
    pool.history_cache_seconds = 0
    old = pool.request(req("heavy", gib=8), now=T0)
    pool.release(old.id, now=T0 + 2 * 3600)  # 16 GiB·h, long ago
    recent = pool.request(req("light", gib=8), now=T0 + 12 * 3600)
    pool.release(recent.id, now=T0 + 12 * 3600 + 450)  # 1 GiB·h, just now
    now = T0 + 12 * 3600 + 450
    with pool.store.transaction():
        usage = pool.engine.fair_share_usage(pool._load(now), now)
    assert usage["heavy"] == pytest.approx(16 * 0.5 ** ((now - (T0 + 7200)) / 3600), rel=1e-6)  # ten half-lives on
    assert usage["light"] == pytest.approx(1.0, rel=1e-6)
    pool.request(req("filler", gib=8), now=now)
    light = pool.request(req("light", gib=4), now=now + 1)
    heavy = pool.request(req("heavy", gib=4), now=now + 2)
    assert [lease.id for lease in pool.queue(now=now + 3)] == [heavy.id, light.id]  # decayed history counts less


def pool_with_links(tmp_path, sizes: list[int], links: list[tuple[int, int]], **policy) -> Pool:
    """A simulated pool of equal-model GPUs with NVLink only between the given index pairs."""
    backend = SimulatedBackend([("A100-80GB", s * GIB) for s in sizes], spec=f"links-{sizes}-{links}", nvlink=False)
    peers: dict[int, set[str]] = {i: set() for i in range(len(sizes))}
    uuids = [d.uuid for d in backend._devices]
    for a, b in links:
        peers[a].add(uuids[b])
        peers[b].add(uuids[a])
    backend._devices = [dataclasses.replace(d, nvlink_peers=frozenset(peers[i])) for i, d in enumerate(backend._devices)]
    policy.setdefault("heartbeat_ttl", 10**9)
    return Pool(backend, str(tmp_path / "links.sqlite"), PoolPolicy(**policy), clock=lambda: T0)


@pytest.mark.parametrize("placement", ["fgd-cpufit", "best-fit"])
def test_multi_gpu_leases_take_nvlink_peers_among_equally_free_gpus(tmp_path, placement):
    pool = pool_with_links(tmp_path, sizes=[80, 80, 80, 80], links=[(2, 3)], placement=placement)
    uuids = [d.uuid for d in pool.devices()]
    lease = pool.request(req(gib=20, num_gpus=2), now=T0)
    assert set(lease.devices) == {uuids[2], uuids[3]}  # not the first two GPUs, which have no link


def test_nvlink_choice_in_the_pure_engine():
    devices = [
        Device(index=i, uuid=f"g{i}", name="A100-80GB", memory_total=80 * GIB, nvlink_peers=frozenset(peers))
        for i, peers in enumerate([(), ("g2",), ("g1",), ()])
    ]
    engine = Engine(PoolPolicy(placement="best-fit"))
    state = PoolState(devices=devices, leases={}, now=T0)
    engine.admit(state, "x", LeaseRequest(owner="a", memory=8 * GIB, num_gpus=2), T0)
    engine.schedule(state, T0)
    assert set(state.leases["x"].devices) == {"g1", "g2"}


# --- 7. one user cannot flood the queue -----------------------------------------------------------


def test_a_user_may_queue_only_so_many_requests(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", max_queued_per_user=3)
    pool.request(req("flood", gib=8), now=T0)
    for i in range(3):
        assert pool.request(req("flood", gib=8), now=T0 + i).state is LeaseState.QUEUED
    with pytest.raises(RequestRefused, match=r"you already have 3 requests waiting in the queue.*max_queued_per_user = 3"):
        pool.request(req("flood", gib=8), now=T0 + 5)
    assert pool.request(req("other", gib=8), now=T0 + 6).state is LeaseState.QUEUED  # others are not affected
    assert len(pool.leases(owner="flood")) == 4


def test_a_group_may_queue_only_so_many_requests(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", max_queued_per_group=2)
    pool.request(req("x", gib=8), now=T0)
    pool.request(req("s1", gib=8, groups=("cs101",)), now=T0)
    pool.request(req("s2", gib=8, groups=("cs101",)), now=T0)
    with pytest.raises(RequestRefused, match=r"group cs101 already has 2 requests waiting"):
        pool.request(req("s3", gib=8, groups=("cs101",)), now=T0)


def test_the_default_queue_cap_is_twenty():
    assert PoolPolicy().max_queued_per_user == 20
    with pytest.raises(InvalidInput, match="max_queued_per_user must be 0 or more"):
        PoolPolicy(max_queued_per_user=-1)


def test_growing_a_running_slice_past_one_gpu_says_how_to_span(tmp_path):
    pool = make_pool(tmp_path, spec="2xA100-80GB")
    lease = pool.request(req(gib=8), now=T0)
    with pytest.raises(RequestRefused, match=r"cannot grow to 140 GiB in place: that spans 2 GPUs \(70 GiB each\)"):
        pool.resize(lease.id, memory=140 * GIB, now=T0 + 1)
    with pytest.raises(RequestRefused, match=r"the largest GPU has 80 GiB; ask for at most 80 GiB"):
        pool.resize(pool.request(req(gib=8, num_gpus=2), now=T0).id, memory=100 * GIB, now=T0 + 1)
    assert pool.get(lease.id).memory == 8 * GIB


def test_a_reservation_that_overlaps_others_past_the_pool_is_refused(tmp_path):
    pool = make_pool(tmp_path, spec="1x48GiB", reservations=[LAB])
    monday = tuesday_at(12) - 86400
    # One-off on Tuesday 10:00-12:00 overlaps the weekly lab (40 GiB): at most 8 GiB more.
    with pytest.raises(RequestRefused, match=r"overlaps 'lab' \(cs101, Tue 09:00–11:00\).*ask for at most 8 GiB"):
        pool.book_reservation({"name": "exam", "users": ["prof"], "memory": "16GiB", "start": tuesday_at(10), "duration": "2h"}, now=monday)
    assert pool.book_reservation({"name": "exam", "users": ["prof"], "memory": "8GiB", "start": tuesday_at(10), "duration": "2h"}, now=monday)
    # Not overlapping in time: the whole pool is fine; re-booking a name replaces it.
    pool.book_reservation({"name": "late", "users": ["prof"], "memory": "48GiB", "start": tuesday_at(12), "duration": "1h"}, now=monday)
    pool.book_reservation({"name": "late", "users": ["prof"], "memory": "40GiB", "start": tuesday_at(12), "duration": "1h"}, now=monday)
    with pytest.raises(RequestRefused, match=r"overlaps 'lab'"):
        pool.book_reservation(
            {"name": "lab2", "groups": ["cs102"], "memory": "16GiB", "weekdays": ["tue"], "start": "10:30", "end": "12:00"}, now=monday
        )
    assert sorted(r.name for r in pool.reservations()) == ["exam", "lab", "late"]
