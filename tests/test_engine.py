"""The engine's behaviour through the Pool facade on a real SQLite file, with explicit time."""

from __future__ import annotations

import datetime as dt
import os

import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.core.models import Activity, DecisionKind, LeaseState
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound, RequestRefused
from jupyter_gpupool.units import GIB


def decided(pool, kind: DecisionKind) -> list[str]:
    """Lease ids of every recorded decision of ``kind`` (decisions can come from any call)."""
    return [e["lease_id"] for e in pool.events() if e["kind"] == kind.value]


def test_grant_then_queue_then_grant_on_release(tmp_path):
    pool = make_pool(tmp_path, idle_policy="never")
    a = pool.request(req("alice"), now=T0)
    b = pool.request(req("bob"), now=T0 + 1)
    c = pool.request(req("carol"), now=T0 + 2)
    assert (a.state, b.state, c.state) == (LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED)
    info = pool.queue_info(c.id, now=T0 + 3)
    assert (info.position, info.length) == (1, 1)
    assert info.estimated_wait is None  # no durations, no history: we say "unknown"
    pool.release(a.id, now=T0 + 10)
    assert pool.get(c.id).state is LeaseState.GRANTED
    assert pool.get(a.id).release_reason == "released by user"


def test_estimated_wait_comes_from_expected_ends(tmp_path):
    pool = make_pool(tmp_path)
    pool.request(req("alice", duration=3600), now=T0)
    pool.request(req("bob", duration=600), now=T0)
    waiting = pool.request(req("carol"), now=T0 + 60)
    info = pool.queue_info(waiting.id, now=T0 + 60)
    assert info.estimated_wait == pytest.approx(540)


def test_estimated_wait_counts_idle_holders_the_policy_would_reclaim(tmp_path):
    pool = make_pool(tmp_path, idle_timeout=600, warning_period=60, preemption=False)  # idle_policy "pressure"
    holder = pool.request(req("alice", gib=16), now=T0)
    pool.report_activity(holder.id, Activity(busy=True), now=T0 + 50)
    waiting = pool.request(req("bob"), now=T0 + 60)
    assert pool.queue_info(waiting.id, now=T0 + 60).estimated_wait is None  # a busy holder, no history: unknown
    pool.report_activity(holder.id, Activity(busy=False, last_activity=T0 + 100), now=T0 + 100)
    info = pool.queue_info(waiting.id, now=T0 + 300)
    assert info.estimated_wait == pytest.approx(100 + 600 + 60 - 300)  # idle since 100, timeout, then the warning
    pool.keep(holder.id, 3600, now=T0 + 400)  # kept through idle: reclaimable only when the keep runs out
    assert pool.queue_info(waiting.id, now=T0 + 400).estimated_wait == pytest.approx(3600 + 60)


def test_estimated_wait_uses_the_leases_whose_end_is_known(tmp_path):
    pool = make_pool(tmp_path, idle_policy="never")
    pool.request(req("alice", duration=600), now=T0)
    pool.request(req("bob"), now=T0)  # no duration, no history, never reclaimed: holds on for good
    waiting = pool.request(req("carol"), now=T0 + 60)
    assert pool.queue_info(waiting.id, now=T0 + 60).estimated_wait == pytest.approx(540)
    too_big = pool.request(req("dave", gib=16), now=T0 + 60)
    assert pool.queue_info(too_big.id, now=T0 + 60).estimated_wait is None  # only bob's end would make room


def test_requests_that_can_never_fit_are_refused_with_what_fits(tmp_path):
    pool = make_pool(tmp_path, spec="2xA100-80GB,1xT4-16GB")
    with pytest.raises(RequestRefused, match=r"at most 160 GiB fits on this pool's GPUs \(2 × 80 GiB\); ask for at most 160 GiB"):
        pool.request(req(gib=170), now=T0)
    with pytest.raises(RequestRefused, match="ask for at most 80 GiB each"):
        pool.request(req(gib=90, num_gpus=2), now=T0)
    with pytest.raises(RequestRefused, match="no GPU of model 'H100'.*A100-80GB"):
        pool.request(req(gib=8, model="H100"), now=T0)
    with pytest.raises(RequestRefused, match="ask for at most 16 GiB"):
        pool.request(req(gib=20, model="T4"), now=T0)
    with pytest.raises(RequestRefused, match="ask for at most 3"):
        pool.request(req(gib=1, num_gpus=4), now=T0)
    assert pool.leases() == []  # nothing changed


def test_hard_quota_refuses_at_once_and_soft_limits_queue(tmp_path):
    pool = make_pool(tmp_path, spec="1x80GiB", user_quotas={"alice": {"maximum": "16GiB", "max_leases": 1}})
    with pytest.raises(RequestRefused, match="maximum quota is 16 GiB"):
        pool.request(req("alice", gib=20), now=T0)
    first = pool.request(req("alice", gib=8), now=T0)
    second = pool.request(req("alice", gib=8), now=T0)
    assert first.state is LeaseState.GRANTED
    assert second.state is LeaseState.QUEUED  # the lease-count limit holds it although memory is free
    assert "lease limit" in pool.queue_info(second.id, now=T0).reason
    pool.release(first.id, now=T0 + 5)
    assert pool.get(second.id).state is LeaseState.GRANTED


def test_group_quota_limits_the_group_together(tmp_path):
    pool = make_pool(tmp_path, spec="1x80GiB", group_quotas={"cs101": {"maximum": "16GiB"}})
    a = pool.request(req("s1", gib=8, groups=("cs101",)), now=T0)
    b = pool.request(req("s2", gib=8, groups=("cs101",)), now=T0)
    c = pool.request(req("s3", gib=8, groups=("cs101",)), now=T0)
    other = pool.request(req("prof", gib=8), now=T0)
    assert [x.state for x in (a, b, c, other)] == [LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED, LeaseState.GRANTED]
    assert "group cs101's quota" in pool.queue_info(c.id, now=T0).reason


def test_queue_order_priority_then_fair_share_then_arrival(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", aging_interval=0, preemption=False, user_priorities={"prof": "high"})
    heavy_past = pool.request(req("heavy", gib=8), now=T0)
    pool.release(heavy_past.id, now=T0 + 7200)  # heavy held 8 GiB for 2 h: 16 GiB·h of history
    pool.request(req("x", gib=8), now=T0 + 7200)  # fills the GPU
    batch = pool.request(req("grader", gib=4, priority="batch"), now=T0 + 7200)
    heavy = pool.request(req("heavy", gib=4), now=T0 + 7201)
    light = pool.request(req("light", gib=4), now=T0 + 7202)
    light2 = pool.request(req("light2", gib=4), now=T0 + 7203)
    prof = pool.request(req("prof", gib=4), now=T0 + 7204)
    order = [lease.id for lease in pool.queue(now=T0 + 7205)]
    # high class first; then fair share (no history before heavy); then arrival; batch last
    assert order == [prof.id, light.id, light2.id, heavy.id, batch.id]


def test_users_cannot_raise_their_own_class(tmp_path):
    pool = make_pool(tmp_path, group_priorities={"staff": "high", "graders": "batch"})
    assert pool.request(req("student", gib=1, priority="high"), now=T0).priority.value == "normal"
    assert pool.request(req("ta", gib=1, groups=("staff",), priority="high"), now=T0).priority.value == "high"
    assert pool.request(req("nbgrader", gib=1, groups=("graders",)), now=T0).priority.value == "batch"


def test_aging_lifts_a_batch_request_so_it_does_not_starve(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", aging_interval=600, preemption=False)
    pool.request(req("x", gib=8), now=T0)
    batch = pool.request(req("grader", gib=8, priority="batch"), now=T0)
    late = pool.request(req("alice", gib=8), now=T0 + 500)
    assert [l.id for l in pool.queue(now=T0 + 550)] == [late.id, batch.id]
    assert [l.id for l in pool.queue(now=T0 + 1300)] == [batch.id, late.id]  # waited 2 intervals: rank 0+2 > 1+1


def test_backfill_lets_small_requests_pass_until_the_head_waited_too_long(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", backfill_max_head_wait=600, preemption=False)
    pool.request(req("a", gib=10), now=T0)
    head = pool.request(req("b", gib=12), now=T0 + 1)
    small = pool.request(req("c", gib=4), now=T0 + 2)
    assert head.state is LeaseState.QUEUED and small.state is LeaseState.GRANTED
    late_small = pool.request(req("d", gib=1), now=T0 + 700)
    assert late_small.state is LeaseState.QUEUED  # the head has waited past the limit: no more backfill


def test_preemption_of_a_lower_class_after_grace(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", min_runtime=60, grace_period=30, group_priorities={"staff": "high"})
    batch = pool.request(req("grader", gib=12, priority="batch"), now=T0)
    young = pool.request(req("alice", gib=4), now=T0 + 50)
    prof = pool.request(req("prof", gib=8, groups=("staff",)), now=T0 + 100)
    assert prof.state is LeaseState.QUEUED
    pool.tick(now=T0 + 101)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == [batch.id]  # lower class; alice is same class
    assert pool.get(batch.id).reclaim_at == T0 + 100 + 30
    assert pool.get(young.id).reclaim_at is None
    pool.tick(now=T0 + 120)
    assert pool.get(batch.id).state is LeaseState.GRANTED  # grace period still running
    pool.tick(now=T0 + 140)
    assert decided(pool, DecisionKind.PREEMPT) == [batch.id]
    assert pool.get(batch.id).release_reason.startswith("preempted for a higher-priority request")
    assert pool.get(prof.id).state is LeaseState.GRANTED


def test_preemption_respects_minimum_runtime(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", min_runtime=300, group_priorities={"staff": "high"})
    batch = pool.request(req("grader", gib=16, priority="batch"), now=T0)
    pool.request(req("prof", gib=8, groups=("staff",)), now=T0 + 10)
    pool.tick(now=T0 + 20)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == []
    pool.tick(now=T0 + 301)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == [batch.id]


def test_guaranteed_quota_reclaims_from_users_over_their_guarantee(tmp_path):
    pool = make_pool(
        tmp_path,
        spec="1x16GiB",
        min_runtime=0,
        grace_period=0,
        default_quota={"guaranteed": "4GiB"},
    )
    busy_big = pool.request(req("hog", gib=8), now=T0)
    idle_big = pool.request(req("hog", gib=8), now=T0 + 1)
    pool.report_activity(busy_big.id, Activity(busy=True), now=T0 + 2)
    small = pool.request(req("alice", gib=4), now=T0 + 3)
    assert small.state is LeaseState.QUEUED
    pool.tick(now=T0 + 4)
    assert decided(pool, DecisionKind.PREEMPT_WARN) == [idle_big.id]  # idle first
    pool.tick(now=T0 + 5)
    assert pool.get(small.id).state is LeaseState.GRANTED
    assert pool.get(busy_big.id).state is LeaseState.GRANTED


def test_idle_reclaim_under_pressure_warns_then_reclaims_longest_idle(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", idle_timeout=600, warning_period=60, preemption=False)
    a = pool.request(req("a"), now=T0)
    b = pool.request(req("b"), now=T0 + 100)
    assert not pool.tick(now=T0 + 2000)  # idle but nobody waits: nothing happens
    c = pool.request(req("c"), now=T0 + 2000)
    pool.tick(now=T0 + 2001)
    assert decided(pool, DecisionKind.WARN_IDLE) == [a.id]  # only as many as needed, longest idle first
    assert pool.get(a.id).reclaim_at == T0 + 2000 + 60
    pool.tick(now=T0 + 2100)
    assert decided(pool, DecisionKind.RECLAIM_IDLE) == [a.id]
    assert "idle for" in pool.get(a.id).release_reason and "waited" in pool.get(a.id).release_reason
    assert pool.get(c.id).state is LeaseState.GRANTED
    assert pool.get(b.id).state is LeaseState.GRANTED


def test_activity_or_keep_cancels_an_idle_warning(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", idle_timeout=600, warning_period=60, preemption=False)
    a = pool.request(req("a", gib=16), now=T0)
    pool.request(req("b", gib=8), now=T0 + 1000)
    pool.tick(now=T0 + 1001)
    assert pool.get(a.id).reclaim_at is not None
    pool.report_activity(a.id, Activity(busy=True), now=T0 + 1010)
    pool.tick(now=T0 + 1011)
    assert pool.get(a.id).reclaim_at is None
    pool.report_activity(a.id, Activity(busy=False, last_activity=T0 + 1011), now=T0 + 1012)
    pool.tick(now=T0 + 1700)
    assert pool.get(a.id).reclaim_at is not None
    pool.keep(a.id, 3600, now=T0 + 1710)
    pool.tick(now=T0 + 1800)
    assert pool.get(a.id).state is LeaseState.GRANTED and pool.get(a.id).reclaim_at is None
    with pytest.raises(InvalidInput, match="at most 8 h"):
        pool.keep(a.id, 9 * 3600, now=T0 + 1800)


def test_a_tick_with_activities_decides_as_a_report_then_a_tick_in_one_transaction(tmp_path):
    """The server's (and the simulator's) round: activity taken and the scheduler run in one
    transaction, with the same outcome as the two calls one after the other."""
    transactions: list[str] = []

    def round_trip(pool, one_call: bool) -> tuple[list, int]:
        a = pool.request(req("a", gib=16), now=T0)
        pool.request(req("b", gib=8), now=T0 + 1000)  # a, idle since its grant, is warned
        assert pool.get(a.id).reclaim_at is not None
        pool.prune(T0 + 1000)  # not due again in the round below
        activities = {a.id: Activity(busy=True, connections=1)}
        begin, before = pool.store.transaction, len(transactions)
        pool.store.transaction = lambda: transactions.append("begin") or begin()
        if one_call:
            decisions = pool.tick(now=T0 + 1001, activities=activities)
        else:
            pool.report_activities(activities, now=T0 + 1001)
            decisions = pool.tick(now=T0 + 1001)
        pool.store.transaction = begin
        assert pool.get(a.id).reclaim_at is None  # its reported work cancelled the warning in this round
        leases = sorted(pool.store.live_leases().values(), key=lambda lease: lease.owner)
        state = [lease.to_json_text().replace(lease.id, lease.owner) for lease in leases]  # ids differ between pools
        return [(d.kind, d.owner, d.message) for d in decisions] + state, len(transactions) - before

    policy = {"spec": "1x16GiB", "idle_timeout": 600, "warning_period": 60, "preemption": False}
    outcome, one_call = round_trip(make_pool(tmp_path, name="one.sqlite", **policy), one_call=True)
    expected, two_calls = round_trip(make_pool(tmp_path, name="two.sqlite", **policy), one_call=False)
    assert (one_call, two_calls) == (1, 2)
    assert outcome == expected


def test_fair_share_usage_of_some_owners_is_theirs_in_the_full_usage(tmp_path):
    """Ordering a queue reads only its owners' fair-share usage: the same numbers as everyone's."""
    pool = make_pool(tmp_path, spec="2x16GiB", fair_share_half_life=3600)
    for i, owner in enumerate(["a", "b", "c", "a"]):  # history: closed intervals
        lease = pool.request(req(owner, gib=4), now=T0 + i)
        pool.release(lease.id, now=T0 + 600 + 100 * i)
    for owner in ["a", "b", "d"]:  # and slices held now
        pool.request(req(owner, gib=4), now=T0 + 1000)
    with pool._locked():
        state = pool._load(T0 + 4000)
        everyone = pool.engine.fair_share_usage(state, T0 + 4000)
        some = pool.engine.fair_share_usage(state, T0 + 4000, owners={"a", "d", "nobody"})
    assert set(everyone) == {"a", "b", "c", "d"} and everyone["a"] > everyone["b"] > 0
    assert some == {owner: everyone[owner] for owner in ("a", "d")}


def test_busy_time_not_yet_written_is_metered_when_the_slice_is_released(tmp_path):
    """Reports that only say "still busy" are not written while the heartbeat is fresh; the busy
    time since must still reach the ledger when the interval closes (it was lost before)."""
    pool = make_pool(tmp_path, heartbeat_ttl=180)
    lease = pool.request(req("a", gib=4, holder_pid=os.getpid()), now=T0)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 10)  # written: busy from here
    for t in (20, 30, 40):  # fresh heartbeat: not written
        pool.report_activity(lease.id, Activity(busy=True), now=T0 + t)
    pool.release(lease.id, now=T0 + 40)
    (row,) = [r for r in pool.store.ledger() if r["lease_id"] == lease.id]
    assert row["active_seconds"] == pytest.approx(30.0)


def test_a_silent_busy_holder_is_metered_only_until_its_next_report_was_due(tmp_path):
    pool = make_pool(tmp_path, heartbeat_ttl=180)
    lease = pool.request(req("a", gib=4, holder_pid=os.getpid()), now=T0)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 10)
    pool.tick(now=T0 + 10 + 200)  # no report since: released for the missing heartbeat
    (row,) = [r for r in pool.store.ledger() if r["lease_id"] == lease.id]
    assert row["active_seconds"] == pytest.approx(45.0)  # a quarter of the TTL, not the 200 s of silence


def test_idle_policy_always_and_never(tmp_path):
    always = make_pool(tmp_path, name="always.sqlite", idle_policy="always", idle_timeout=60, warning_period=10)
    lease = always.request(req(), now=T0)
    always.tick(now=T0 + 61)
    always.tick(now=T0 + 72)
    assert always.get(lease.id).state is LeaseState.RELEASED
    never = make_pool(tmp_path, name="never.sqlite", spec="1x8GiB", idle_policy="never", idle_timeout=60, preemption=False)
    lease = never.request(req(), now=T0)
    never.request(req("b"), now=T0)
    for t in (100, 200, 10_000):
        never.tick(now=T0 + t)
    assert never.get(lease.id).state is LeaseState.GRANTED


def test_reservations_hold_capacity_for_their_group_only_in_the_window(tmp_path):
    start = dt.datetime.fromtimestamp(T0).replace(hour=9, minute=0)
    tuesday = start + dt.timedelta(days=(1 - start.weekday()) % 7)
    pool = make_pool(
        tmp_path,
        spec="1x48GiB",
        preemption=False,
        reservations=[{"name": "lab", "groups": ["cs101"], "memory": "40GiB", "weekdays": ["tue"], "start": "09:00", "end": "11:00"}],
    )
    in_window = tuesday.timestamp() + 600
    outsider = pool.request(req("outsider", gib=16), now=in_window)
    assert outsider.state is LeaseState.QUEUED  # only 8 GiB are not reserved
    student = pool.request(req("s1", gib=16, groups=("cs101",)), now=in_window)
    assert student.state is LeaseState.GRANTED
    pool.tick(now=tuesday.timestamp() + 2 * 3600 + 1)  # 11:00: the window closed
    assert pool.get(outsider.id).state is LeaseState.GRANTED


def test_booked_one_off_reservation(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", preemption=False)
    pool.book_reservation({"name": "exam", "users": ["prof"], "memory": "12GiB", "start": T0, "duration": "1h"}, now=T0)
    assert pool.request(req("bob", gib=8), now=T0 + 1).state is LeaseState.QUEUED
    assert pool.request(req("prof", gib=8), now=T0 + 2).state is LeaseState.GRANTED
    pool.cancel_reservation("exam")
    with pytest.raises(LeaseNotFound):
        pool.cancel_reservation("exam")
    with pytest.raises(InvalidInput, match="needs 'end' or 'duration'"):
        pool.book_reservation({"name": "x", "users": ["a"], "memory": "1GiB"}, now=T0)


def test_overcommit_factor(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", overcommit=1.5)
    leases = [pool.request(req(f"u{i}"), now=T0) for i in range(4)]
    assert [l.state for l in leases] == [LeaseState.GRANTED] * 3 + [LeaseState.QUEUED]


def test_unhealthy_gpu_gets_no_grants_and_flags_leases(tmp_path):
    pool = make_pool(tmp_path, spec="2x16GiB", preemption=False)
    first = pool.request(req("a", gib=12), now=T0)
    lost = first.devices[0]
    pool.backend.set_health(lost, False, "GPU is lost (NVML_ERROR_GPU_IS_LOST)")
    pool._devices = None
    pool.tick(now=T0 + 1)
    assert pool.get(first.id).flagged == "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    second = pool.request(req("b", gib=12), now=T0 + 2)
    assert second.state is LeaseState.GRANTED and second.devices[0] != lost
    third = pool.request(req("c", gib=12), now=T0 + 3)
    assert third.state is LeaseState.QUEUED


def test_resize_shrinks_and_grows_within_room(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB")
    a = pool.request(req("a", gib=8), now=T0)
    pool.request(req("b", gib=4), now=T0)
    assert pool.resize(a.id, memory=10 * GIB, now=T0 + 1).memory == 10 * GIB
    with pytest.raises(RequestRefused, match="ask for at most 12 GiB"):
        pool.resize(a.id, memory=13 * GIB, now=T0 + 2)
    assert pool.resize(a.id, memory=2 * GIB, now=T0 + 3).memory == 2 * GIB


def test_resize_on_a_full_gpu_says_it_would_queue_not_what_is_already_held(tmp_path):
    pool = make_pool(tmp_path, spec="2x80GiB")
    a = pool.request(req("a", gib=40), now=T0)
    b = pool.request(req("b", gib=40), now=T0)  # shares a's GPU: 0 B free there
    pool.request(req("c", gib=50), now=T0)
    with pytest.raises(RequestRefused) as refused:
        pool.resize(a.id, memory=60 * GIB, now=T0 + 1)
    assert str(refused.value) == (
        "cannot grow to 60 GiB now: its GPU has no free memory, so the slice stays 40 GiB; "
        "release and request 60 GiB again to queue for it (a GPU here holds at most 80 GiB)"
    )
    with pytest.raises(RequestRefused, match=r"ask for at most 80 GiB \(a new slice may span up to 160 GiB on 2 GPUs\)$"):
        pool.resize(a.id, memory=999 * 1024 * GIB, now=T0 + 1)
    pool.release(b.id, now=T0 + 2)
    assert pool.request(req("b", gib=35), now=T0 + 3).devices == a.devices  # the other GPU has 30 GiB free
    with pytest.raises(RequestRefused, match=r"its GPU has 5 GiB free; ask for at most 45 GiB now"):
        pool.resize(a.id, memory=60 * GIB, now=T0 + 4)
    assert pool.get(a.id).memory == 40 * GIB


def test_heartbeat_ttl_and_dead_holder_release(tmp_path):
    import subprocess
    import sys

    pool = make_pool(tmp_path, heartbeat_ttl=60)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    from jupyter_gpupool.backends.local.pool import HOSTNAME

    held = pool.request(req("a", holder_pid=proc.pid, holder_host=HOSTNAME), now=T0)
    silent = pool.request(req("b"), now=T0)
    pool.heartbeat([held.id], now=T0 + 50)
    pool.tick(now=T0 + 70)
    assert pool.get(silent.id).state is LeaseState.RELEASED
    assert "no heartbeat" in pool.get(silent.id).release_reason
    assert pool.get(held.id).state is LeaseState.GRANTED
    proc.kill()
    proc.wait()
    pool.tick(now=T0 + 80)
    assert pool.get(held.id).state is LeaseState.RELEASED
    assert f"holder process {proc.pid} exited" in pool.get(held.id).release_reason


def test_booked_lease_without_holder_lasts_its_duration(tmp_path):
    pool = make_pool(tmp_path, heartbeat_ttl=60)
    lease = pool.request(req(duration=3600), now=T0)
    pool.tick(now=T0 + 3000)
    assert pool.get(lease.id).state is LeaseState.GRANTED
    pool.tick(now=T0 + 3601)
    assert "its time (1 h) is over" in pool.get(lease.id).release_reason


def test_metering_by_user_group_kernel(tmp_path):
    pool = make_pool(tmp_path, spec="1x80GiB")
    a = pool.request(req("alice", gib=8, groups=("cs101",), kernel_id="k1"), now=T0)
    b = pool.request(req("bob", gib=4, kernel_id="k2"), now=T0)
    pool.report_activity(a.id, Activity(busy=True), now=T0)
    pool.report_activity(a.id, Activity(busy=False), now=T0 + 1800)  # busy for half an hour
    pool.release(a.id, now=T0 + 3600)
    by_user = {r["user"]: r for r in pool.report(by="user", now=T0 + 7200)}
    assert by_user["alice"]["gib_hours_held"] == pytest.approx(8.0)
    assert by_user["alice"]["gib_hours_active"] == pytest.approx(4.0)
    assert by_user["bob"]["gib_hours_held"] == pytest.approx(8.0)  # still open: 4 GiB for 2 h
    by_group = {r["group"]: r for r in pool.report(by="group", now=T0 + 7200)}
    assert set(by_group) == {"cs101", "(no group)"}
    since = {r["user"]: r for r in pool.report(since=T0 + 1800, by="user", now=T0 + 7200)}
    assert since["alice"]["gib_hours_held"] == pytest.approx(4.0)
    assert {r["kernel"] for r in pool.report(by="kernel", now=T0 + 7200)} == {"k1", "k2"}
    assert b.state is LeaseState.GRANTED
    with pytest.raises(InvalidInput):
        pool.report(by="colour")


def test_snapshot_hides_other_users_unless_admin(tmp_path):
    pool = make_pool(tmp_path)
    pool.request(req("alice", kernel_id="k-alice"), now=T0)
    pool.request(req("bob", kernel_id="k-bob"), now=T0)
    view = pool.snapshot(viewer="alice", now=T0)
    mine = [l for l in view.leases if l["mine"]]
    others = [l for l in view.leases if not l["mine"]]
    assert mine[0]["kernel_id"] == "k-alice"
    assert others[0]["owner"] is None and others[0]["kernel_id"] is None and others[0]["id"] is None
    admin = pool.snapshot(viewer="alice", admin=True, now=T0)
    assert {l["owner"] for l in admin.leases} == {"alice", "bob"}
    assert view.devices[0]["memory_leased"] == 16 * GIB


def test_watchdog_usage_is_recorded_with_peak_and_over_limit(tmp_path):
    pool = make_pool(tmp_path, burst="0")  # fixed slices: use over the slice is over the limit
    lease = pool.request(req(gib=4), now=T0)
    assert pool.report_usage({lease.id: 3 * GIB}, now=T0 + 1) == []
    decisions = pool.report_usage({lease.id: 5 * GIB}, now=T0 + 2)
    assert [d.kind for d in decisions] == [DecisionKind.OVER_LIMIT]
    pool.report_usage({lease.id: 1 * GIB}, now=T0 + 3)
    stored = pool.get(lease.id)
    assert (stored.used_memory, stored.peak_memory, stored.over_limit_since) == (1 * GIB, 5 * GIB, None)


def test_policy_env_variables(monkeypatch, tmp_path):
    from jupyter_gpupool.core.policy import PoolPolicy

    policy = PoolPolicy.from_env({"GPUPOOL_DEFAULT_MEMORY": "8GiB", "GPUPOOL_IDLE_TIMEOUT": "10m", "GPUPOOL_IDLE_POLICY": "always"})
    assert (policy.default_memory, policy.idle_timeout, policy.idle_policy) == ("8GiB", 600, "always")
    with pytest.raises(InvalidInput, match="GPUPOOL_IDLE_TIMEOUT='-5m'"):
        PoolPolicy.from_env({"GPUPOOL_IDLE_TIMEOUT": "-5m"})
    with pytest.raises(InvalidInput, match="GPUPOOL_DEFAULT_MEMORY"):
        PoolPolicy.from_env({"GPUPOOL_DEFAULT_MEMORY": "8XB"})
    with pytest.raises(InvalidInput, match="unknown placement policy"):
        PoolPolicy.from_env({"GPUPOOL_PLACEMENT": "random-ish"})
    with pytest.raises(InvalidInput, match="guaranteed .* is above maximum"):
        PoolPolicy(user_quotas={"a": {"guaranteed": "8GiB", "maximum": "4GiB"}}).validate_all()


def test_set_priority_reorders_the_queue(tmp_path):
    pool = make_pool(tmp_path, spec="1x8GiB", aging_interval=0, preemption=False)
    pool.request(req("x", gib=8), now=T0)
    first = pool.request(req("a", gib=8), now=T0 + 1)
    second = pool.request(req("b", gib=8), now=T0 + 2)
    assert [l.id for l in pool.queue(now=T0 + 3)] == [first.id, second.id]
    pool.set_priority(second.id, "high", now=T0 + 4)
    assert [l.id for l in pool.queue(now=T0 + 5)] == [second.id, first.id]
    with pytest.raises(InvalidInput, match="batch, normal or high"):
        pool.set_priority(first.id, "urgent")


def test_old_released_leases_and_events_are_pruned_but_the_ledger_is_kept(tmp_path):
    pool = make_pool(tmp_path, retention_days=30)
    old = pool.request(req("a"), now=T0)
    pool.release(old.id, now=T0 + 3600)
    live = pool.request(req("b"), now=T0 + 3600)
    recent = pool.request(req("c"), now=T0 + 40 * 86400)
    pool.release(recent.id, now=T0 + 40 * 86400 + 60)
    removed = pool.prune(now=T0 + 40 * 86400 + 120)
    assert removed["leases"] == 1 and removed["events"] >= 2 and removed["ledger"] == 0
    with pytest.raises(LeaseNotFound):
        pool.get(old.id)
    assert pool.get(live.id).state is LeaseState.GRANTED  # live leases are never pruned, however old
    assert pool.get(recent.id).state is LeaseState.RELEASED
    assert {r["user"] for r in pool.report(by="user", now=T0 + 40 * 86400 + 120)} == {"a", "b", "c"}  # metering kept
    keep_all = make_pool(tmp_path, name="keep.sqlite", retention_days=0)
    gone = keep_all.request(req(), now=T0)
    keep_all.release(gone.id, now=T0 + 1)
    assert keep_all.prune(now=T0 + 10**8) == {"leases": 0, "events": 0, "ledger": 0}


def test_the_kept_typical_hold_is_what_the_ledger_says_past_its_sample(tmp_path):
    """The typical hold follows each release in place (no ledger query): past the 200-interval
    sample the oldest leave it, and the kept median stays the one SQLite gives."""
    import random

    pool = make_pool(tmp_path, spec="1x80GiB", idle_policy="never")
    rng = random.Random(7)
    now = T0
    for _ in range(260):
        lease = pool.request(req("alice", gib=1), now=now)
        now += rng.choice([1, 5, 60, 600, 3600])
        pool.release(lease.id, now=now)
        with pool.store.transaction():
            pool.store.live_leases()
            kept = pool.store.history(now, 86400, max_age=10**9)["typical_hold"]
        assert kept == pool.store.typical_hold()


def test_a_report_that_says_nothing_new_writes_nothing_while_the_heartbeat_is_fresh(tmp_path):
    """Most kernels are idle: rewriting their leases every report was most of a report's cost. An
    unchanged report changes nothing until the stored heartbeat is a quarter of the TTL old; busy
    time between heartbeats is still counted in full."""
    pool = make_pool(tmp_path, heartbeat_ttl=120, idle_policy="never")
    lease = pool.request(req("alice"), now=T0)
    idle = Activity(busy=False, last_activity=T0, connections=1)
    pool.report_activity(lease.id, idle, now=T0 + 1)
    assert pool.get(lease.id).heartbeat_at == T0 + 1
    version = pool.store.conn.total_changes
    pool.report_activity(lease.id, idle, now=T0 + 20)  # nothing new, heartbeat 19 s old < 30 s
    assert pool.store.conn.total_changes == version
    assert pool.get(lease.id).heartbeat_at == T0 + 1
    pool.report_activity(lease.id, idle, now=T0 + 40)  # 39 s old: written again
    assert pool.get(lease.id).heartbeat_at == T0 + 40
    pool.report_activity(lease.id, Activity(busy=False, last_activity=T0 + 41, connections=1), now=T0 + 42)
    assert pool.get(lease.id).last_activity == T0 + 41  # news is never skipped
    busy = Activity(busy=True, connections=1)
    pool.report_activity(lease.id, busy, now=T0 + 50)
    pool.report_activity(lease.id, busy, now=T0 + 60)  # skipped
    pool.report_activity(lease.id, busy, now=T0 + 90)  # written: counts 50 → 90
    assert pool.get(lease.id).active_seconds == pytest.approx(40)


def test_a_waiting_request_rewrites_its_lease_only_when_its_heartbeat_gets_old(tmp_path):
    """A kernel waiting for a GPU looks twice a second; each look used to rewrite its lease, which
    made every other process on the pool file read all live leases again. Now a look writes only
    once the heartbeat on file is older than a quarter of the TTL, as an activity report does."""
    pool = make_pool(tmp_path, heartbeat_ttl=180)
    clock = [T0]
    pool.clock = lambda: clock[0]
    pool.request(req("a", gib=16, holder_pid=os.getpid()), now=T0)
    waiting = pool.request(req("b", gib=16, holder_pid=os.getpid()), now=T0)

    def stored() -> str:
        return pool.store.conn.execute("SELECT data FROM leases WHERE id = ?", (waiting.id,)).fetchone()[0]

    before = stored()
    for look in range(1, 60):  # 30 s of looks, every 0.5 s
        clock[0] = T0 + look / 2
        lease, info = pool._look_at_request(waiting.id, None, None)
        assert lease.state is LeaseState.QUEUED and info is not None and info.position == 1
    assert stored() == before  # fresh heartbeat: not one write
    clock[0] = T0 + 46  # past a quarter of the TTL
    pool._look_at_request(waiting.id, None, None)
    assert pool.get(waiting.id).heartbeat_at == T0 + 46
