"""Elastic slices in the engine: a lease is guaranteed what it asked for, grows on demand while its
GPU has memory nobody is guaranteed, and gives the burst back before anyone's guarantee."""

from __future__ import annotations

import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.core.models import Activity, DecisionKind, LeaseState, Transition
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB


def test_burst_is_on_by_default_as_four_times_the_guarantee_bounded_by_the_gpu(tmp_path):
    pool = make_pool(tmp_path)
    small = pool.request(req(gib=2), now=T0)
    assert (small.memory, small.guarantee, small.burst_limit) == (2 * GIB, 2 * GIB, 8 * GIB)
    big = pool.request(req("bob", gib=6), now=T0)
    assert big.burst_limit == 16 * GIB  # 4x is 24 GiB: the GPU has 16


@pytest.mark.parametrize(("burst", "limit"), [("40GiB", 16), ("3x", 6), ("0", 0)])
def test_burst_policy_forms(tmp_path, burst, limit):
    pool = make_pool(tmp_path, burst=burst)
    assert pool.request(req(gib=2), now=T0).burst_limit == limit * GIB


def test_burst_env_and_bad_values_are_refused_in_one_line():
    assert PoolPolicy.from_env({"GPUPOOL_BURST": "16GiB"}).burst == "16GiB"
    assert PoolPolicy.from_env({"GPUPOOL_BURST": "off"}).burst == "0"
    for bad in ("lots", "0.5x", "-3GiB"):
        with pytest.raises(InvalidInput, match="GPUPOOL_BURST") as info:
            PoolPolicy.from_env({"GPUPOOL_BURST": bad})
        assert "\n" not in str(info.value)


def test_the_limit_is_bounded_by_the_users_and_groups_maximum(tmp_path):
    pool = make_pool(tmp_path, user_quotas={"alice": {"maximum": "10GiB"}}, group_quotas={"lab": {"maximum": "6GiB"}})
    assert pool.request(req(gib=2), now=T0).burst_limit == 8 * GIB
    assert pool.request(req(gib=2, groups=("lab",)), now=T0).burst_limit == 6 * GIB


def test_an_asked_limit_replaces_the_pools_and_zero_asks_for_a_fixed_slice(tmp_path):
    pool = make_pool(tmp_path)
    assert pool.request(req(gib=2, burst_limit=12 * GIB), now=T0).burst_limit == 12 * GIB
    assert pool.request(req(gib=2, burst_limit=0), now=T0).burst_limit == 0
    with pytest.raises(InvalidInput, match="below the slice's size"):
        pool.request(req(gib=4, burst_limit=2 * GIB), now=T0)
    fixed = make_pool(tmp_path, name="fixed.sqlite", burst="0")
    with pytest.raises(RequestRefused, match="fixed"):
        fixed.request(req(gib=2, burst_limit=8 * GIB), now=T0)


def test_a_slice_grows_when_its_use_nears_its_size_and_is_not_over_its_limit(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB")
    lease = pool.request(req(gib=2), now=T0)
    decisions = pool.report_usage({lease.id: 6 * GIB}, now=T0 + 5)
    assert [d.kind for d in decisions] == [DecisionKind.GROW]
    grown = pool.get(lease.id)
    assert grown.memory >= 6 * GIB and grown.guarantee == 2 * GIB
    assert grown.over_limit_since is None and "grown to" in grown.burst_note
    assert grown.memory_history == ((T0 + 5, 2 * GIB),)  # metering bills each size for its own time


def test_a_grow_asked_by_an_allocation_failure_reaches_what_was_needed_or_says_why_not(tmp_path):
    pool = make_pool(tmp_path, burst="8GiB")
    lease = pool.request(req(gib=2), now=T0)
    assert pool.grow(lease.id, 5 * GIB, now=T0 + 1).memory >= 5 * GIB
    with pytest.raises(RequestRefused, match="limit is 8 GiB"):
        pool.grow(lease.id, 9 * GIB, now=T0 + 2)
    pool.request(req("bob", gib=10), now=T0 + 3)  # guaranteed 10 GiB: 1 GiB left
    with pytest.raises(RequestRefused, match=r"GPU is full \(1 other slice\(s\) there are guaranteed 10 GiB\)"):
        pool.grow(lease.id, 8 * GIB, now=T0 + 4)


def test_burst_never_takes_the_room_of_a_request_that_asked_before_and_fits_at_guarantees(tmp_path):
    """Cat's 10 GiB fits only once the others are at their guarantees: while cat waits for that,
    bob's 2 GiB slice (granted beside, it fits now) may not grow into the room. A request that does
    not fit even at guarantees waits for a guarantee to end, and blocks no burst (it is taken back
    for that request when the time comes)."""
    pool = make_pool(tmp_path, burst="16GiB")
    ann = pool.request(req("ann", gib=2), now=T0)
    pool.report_usage({ann.id: 11 * GIB}, now=T0 + 1)  # ann's slice grows to ~12 GiB
    big = pool.request(req("cat", gib=10), now=T0 + 2)  # 2 + 10 <= 16 at guarantees: ann's burst is taken back for it
    first = pool.request(req("bob", gib=2), now=T0 + 3)  # fits in what is free now
    assert big.state is LeaseState.QUEUED and first.state is LeaseState.GRANTED
    with pytest.raises(RequestRefused, match=r"burst is taken back on this GPU for 1 waiting request\(s\)"):
        pool.grow(first.id, 3 * GIB, now=T0 + 4)
    pool.release(big.id, now=T0 + 5)
    huge = pool.request(req("dan", gib=15), now=T0 + 6)  # 2 + 2 + 15 > 16: waits for a guarantee to end
    assert huge.state is LeaseState.QUEUED
    assert pool.grow(first.id, 3 * GIB, now=T0 + 7).memory >= 3 * GIB


def test_a_kernel_waiting_to_grow_goes_before_requests_that_came_after_it(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB")
    pool.request(req("ann", gib=8), now=T0)
    first = pool.request(req("bob", gib=4), now=T0 + 1)
    late = pool.request(req("dan", gib=10), now=T0 + 2)  # 8 + 4 + 10 > 16: waits for a guarantee to end
    assert late.state is LeaseState.QUEUED
    grown = pool.grow(first.id, 7 * GIB, now=T0 + 3)  # its burst does not take room dan could have
    assert grown.memory >= 7 * GIB
    assert pool.get(late.id).state is LeaseState.QUEUED


def test_burst_taken_back_for_a_request_is_not_grown_back_while_it_waits(tmp_path):
    """A 12 GiB request fits at guarantees (2 + 12 of 16): the first slice's burst is taken back
    for it, and that slice cannot grow back into it while the request waits."""
    pool = make_pool(tmp_path, burst="16GiB")
    first = pool.request(req(gib=2), now=T0)
    pool.report_usage({first.id: 6 * GIB}, now=T0 + 1)
    second = pool.request(req("bob", gib=12), now=T0 + 4)
    assert second.state is LeaseState.QUEUED and pool.get(first.id).burst_taken_at is not None
    with pytest.raises(RequestRefused, match=r"burst is taken back on this GPU for 1 waiting request\(s\)"):
        pool.grow(first.id, 8 * GIB, now=T0 + 6)
    assert pool.get(first.id).memory <= 4 * GIB
    # Its grow waits in line, but behind the request: measured within its slice, the room is the request's.
    pool.report_usage({first.id: 4 * GIB}, now=T0 + 7)
    pool.tick(now=T0 + 8)
    assert pool.get(second.id).state is LeaseState.GRANTED and pool.get(first.id).memory <= 4 * GIB


def test_a_kernel_waiting_to_grow_gets_the_room_a_guarantee_frees_before_queued_requests(tmp_path):
    """Four 4 GiB slices fill the 16 GiB GPU at their guarantees; ann's kernel needs 8 GiB. Eve asked
    before ann's grow, fay after it; both would fit at guarantees once a slice ends. The 4 GiB bob
    frees go to ann's grow: a kernel admitted beside ann at its guarantee would be one more that
    waits, while ann's cell runs. Eve and fay come in once the room is there."""
    pool = make_pool(tmp_path, burst="16GiB")
    ann, bob, cat, dan = (pool.request(req(who, gib=4), now=T0 + i) for i, who in enumerate(("ann", "bob", "cat", "dan")))
    eve = pool.request(req("eve", gib=4), now=T0 + 4)  # the GPU is all guarantees: waits
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(ann.id, 8 * GIB, now=T0 + 5)
    fay = pool.request(req("fay", gib=4), now=T0 + 6)
    assert pool.grow_place(ann.id, now=T0 + 6) == 1  # nobody goes before it
    pool.release(bob.id, now=T0 + 7)
    grown = pool.get(ann.id)
    assert grown.memory >= 8 * GIB and grown.grow_since is None and grown.guarantee == 4 * GIB
    assert pool.get(eve.id).state is LeaseState.QUEUED and pool.get(fay.id).state is LeaseState.QUEUED
    pool.release(cat.id, now=T0 + 8)  # a guarantee ends, and no kernel waits to grow: the queue's turn
    assert pool.get(eve.id).state is LeaseState.GRANTED
    # Fay fits once ann is at its guarantee: the burst its kernel grew into and holds nothing of
    # (the driver shows it) is taken back for her and free at once.
    assert pool.get(fay.id).state is LeaseState.GRANTED and pool.get(ann.id).memory == 4 * GIB
    assert pool.get(dan.id).memory == 4 * GIB


def test_room_given_back_for_a_request_stays_its_own_until_it_is_granted(tmp_path):
    """Ann's burst is taken back for cat's 10 GiB. Bob's kernel, waiting to grow, goes before the
    queued requests, but not before cat: not while ann gives the burst back, nor once the watchdog
    measured her within her slice and the room is free, until cat has it."""
    pool = make_pool(tmp_path, burst="16GiB")
    ann = pool.request(req("ann", gib=2), now=T0)
    pool.report_usage({ann.id: 11 * GIB}, now=T0 + 1)  # ann's slice grows to ~12 GiB
    cat = pool.request(req("cat", gib=10), now=T0 + 2)  # fits at guarantees: ann's burst is taken back for it
    bob = pool.request(req("bob", gib=2), now=T0 + 3)
    assert cat.state is LeaseState.QUEUED and pool.get(cat.id).room_coming_at == T0 + 2
    with pytest.raises(RequestRefused, match=r"burst is taken back on this GPU for 1 waiting request\(s\) \(10 GiB\)"):
        pool.grow(bob.id, 6 * GIB, now=T0 + 4)
    assert pool.grow_place(bob.id, now=T0 + 4) == 2  # cat first
    pool.report_usage({ann.id: 2 * GIB}, now=T0 + 5)  # measured within: 12 GiB free, cat's until granted
    with pytest.raises(RequestRefused, match="burst is taken back on this GPU"):
        pool.grow(bob.id, 6 * GIB, now=T0 + 6)
    pool.tick(now=T0 + 7)
    granted = pool.get(cat.id)
    assert granted.state is LeaseState.GRANTED and granted.room_coming_at is None
    assert pool.get(bob.id).memory == 2 * GIB  # 2 + 10 + 2 of 16: no room for 6 GiB yet


def test_a_grow_that_waits_says_to_what_since_when_and_its_place_in_line_everywhere(tmp_path):
    from jupyter_gpupool.enforcement.plan import EnforcementConfig
    from jupyter_gpupool.kernel.status import KernelStatus, _clock
    from jupyter_gpupool.rest.views import kernel_status

    pool = make_pool(tmp_path, burst="16GiB")
    ann = pool.request(req("ann", gib=8), now=T0)
    big = pool.request(req("cat", gib=10), now=T0 + 1)  # 8 + 10 > 16: waits
    bob = pool.request(req("bob", gib=4), now=T0 + 2)  # fits beside: granted ahead of it
    assert big.state is LeaseState.QUEUED and bob.state is LeaseState.GRANTED
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(ann.id, 14 * GIB, now=T0 + 3)
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(bob.id, 10 * GIB, now=T0 + 4)
    eve = pool.request(req("eve", gib=2), now=T0 + 5)  # asked after both grows: behind them
    assert eve.state is LeaseState.QUEUED
    # Ann's grow was asked first; bob's after it. Cat's request does not fit even at guarantees
    # (8 + 4 + 10 > 16): it waits for a guarantee to end, and is in nobody's way.
    assert [pool.grow_place(ann.id), pool.grow_place(bob.id), pool.grow_place(big.id)] == [1, 2, None]
    body = kernel_status(pool, "k2", pool.get(bob.id), EnforcementConfig(), "bob", T0 + 6)
    assert (body["grow_wanted"], body["grow_since"], body["grow_place"]) == (10 * GIB, T0 + 4, 2)
    idle = kernel_status(pool, "k3", pool.get(big.id), EnforcementConfig(), "cat", T0 + 6)
    assert (idle["grow_wanted"], idle["grow_since"], idle["grow_place"]) == (None, None, None)
    rows = dict(KernelStatus(lease=pool.get(bob.id), grow_place=3, now=T0 + 6).rows())
    assert rows["waiting"] == f"waiting to grow to 10 GiB since {_clock(T0 + 4)} (3rd in line)"  # the wording of a 3rd place
    rows = dict(KernelStatus(lease=pool.get(ann.id), grow_place=1, now=T0 + 6).rows())
    assert rows["waiting"] == f"waiting to grow to 14 GiB since {_clock(T0 + 3)} (next in line)"


def test_burst_is_given_back_before_anyones_guarantee_and_goes_on_once_measured_within(tmp_path):
    """The room a shrunk slice gives up goes to the request at the first measurement after the
    shrink that shows the kernel within its new size: one from before (its caps still allowed
    14 GiB then, and it may have filled them since) hands nothing on."""
    pool = make_pool(tmp_path, burst="16GiB")
    first = pool.request(req(gib=2), now=T0)
    pool.report_usage({first.id: 6 * GIB}, now=T0 + 1)
    pool.report_usage({first.id: 14 * GIB}, now=T0 + 2)
    assert pool.get(first.id).memory >= 14 * GIB
    pool.report_usage({first.id: 1 * GIB}, now=T0 + 3)  # its use drops: the burst stays until someone needs it
    second = pool.request(req("bob", gib=12), now=T0 + 4)
    assert second.state is LeaseState.QUEUED
    after = pool.get(first.id)
    assert after.memory <= 4 * GIB and after.memory >= after.guarantee == 2 * GIB
    assert after.burst_note.startswith("burst taken back") and after.burst_from >= 14 * GIB
    pool.report_usage({first.id: 1 * GIB}, now=T0 + 3.5)  # measured before the shrink: says nothing of since
    pool.tick(now=T0 + 4.5)
    assert pool.get(second.id).state is LeaseState.QUEUED
    pool.report_usage({first.id: 1 * GIB}, now=T0 + 5)
    pool.tick(now=T0 + 5)
    assert pool.get(second.id).state is LeaseState.GRANTED
    assert pool.get(first.id).burst_from == 0
    kinds = [e["kind"] for e in pool.events()]
    assert "shrink" in kinds


def test_use_above_the_guarantee_after_the_burst_is_taken_back_suspends_an_idle_kernel(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB", burst_settle=15, idle_policy="never")
    first = pool.request(req(gib=2, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_usage({first.id: 10 * GIB}, now=T0 + 1)
    second = pool.request(req("bob", gib=12), now=T0 + 2)
    assert second.state is LeaseState.QUEUED  # the kernel still uses 10 GiB: room comes when it frees
    shrunk = pool.get(first.id)
    assert shrunk.memory < 10 * GIB and shrunk.burst_taken_at == T0 + 2
    assert shrunk.watch_limit() == shrunk.memory  # the watchdog now holds it to its size
    pool.report_activity(first.id, Activity(busy=False, last_activity=T0), now=T0 + 3)
    pool.tick(now=T0 + 10)
    assert pool.get(first.id).transition is Transition.NONE  # it has burst_settle to free caches
    pool.tick(now=T0 + 20)
    suspending = pool.get(first.id)
    assert suspending.transition is Transition.SUSPENDING and "burst was taken back" in suspending.suspend_reason
    pool.confirm_transition(first.id, parked_bytes=10 * GIB, now=T0 + 21)
    assert pool.get(second.id).state is LeaseState.GRANTED


@pytest.mark.parametrize("budget", ["12GiB", "9GiB"])
def test_a_kernel_suspended_for_its_burst_is_booked_what_it_holds_against_the_parked_memory_budget(tmp_path, budget):
    """Its slice was lowered, but its kernel still holds 10 GiB: parking takes 10 GiB of host RAM,
    and where the budget has less it is not suspended (the watchdog holds it to its size)."""
    pool = make_pool(tmp_path, burst="16GiB", burst_settle=15, idle_policy="never", parked_memory_limit=budget)
    first = pool.request(req(gib=2, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_usage({first.id: 10 * GIB}, now=T0 + 1)
    pool.request(req("bob", gib=12), now=T0 + 2)
    pool.report_activity(first.id, Activity(busy=False, last_activity=T0), now=T0 + 3)
    pool.tick(now=T0 + 20)
    lease = pool.get(first.id)
    assert lease.memory < 9 * GIB  # its slice was lowered below either budget
    if budget == "12GiB":
        assert lease.transition is Transition.SUSPENDING and lease.parked_memory == 10 * GIB
    else:
        assert lease.transition is Transition.NONE and lease.parked_memory == 0


def test_a_kernel_suspended_for_its_burst_resumes_as_a_slice_at_its_size_and_is_not_suspended_again(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB", burst_settle=15, idle_policy="never")
    first = pool.request(req(gib=2, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_usage({first.id: 10 * GIB}, now=T0 + 1)
    second = pool.request(req("bob", gib=12), now=T0 + 2)
    pool.report_activity(first.id, Activity(busy=False, last_activity=T0), now=T0 + 3)
    pool.tick(now=T0 + 20)
    pool.confirm_transition(first.id, parked_bytes=10 * GIB, now=T0 + 21)
    assert pool.get(second.id).state is LeaseState.GRANTED
    third = pool.request(req("carol", gib=8), now=T0 + 22)
    assert third.state is LeaseState.QUEUED  # someone still waits: pressure stands
    pool.resume(first.id, now=T0 + 30)
    pool.tick(now=T0 + 31)
    assert pool.get(first.id).transition is Transition.RESTORING
    pool.confirm_transition(first.id, now=T0 + 32)
    restored = pool.get(first.id)
    assert (restored.burst_taken_at, restored.burst_from) == (None, 0)  # its suspend gave the burst back
    pool.tick(now=T0 + 60)
    assert pool.get(first.id).transition is Transition.NONE  # not suspended again the moment it is back


def test_a_kernel_that_frees_its_cache_in_time_is_left_running_and_the_request_granted(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB")
    first = pool.request(req(gib=2), now=T0)
    pool.report_usage({first.id: 10 * GIB}, now=T0 + 1)
    second = pool.request(req("bob", gib=12), now=T0 + 2)
    assert second.state is LeaseState.QUEUED
    pool.report_usage({first.id: 2 * GIB}, now=T0 + 4)  # caches freed, caps lowered
    pool.tick(now=T0 + 5)
    assert pool.get(second.id).state is LeaseState.GRANTED
    assert pool.get(first.id).burst_taken_at is None


def test_a_user_resize_sets_the_guarantee_and_may_set_the_limit(tmp_path):
    pool = make_pool(tmp_path, burst="4x")
    lease = pool.request(req(gib=2), now=T0)
    resized = pool.resize(lease.id, 3 * GIB, limit=10 * GIB, now=T0 + 1)
    assert (resized.memory, resized.guarantee, resized.burst_limit) == (3 * GIB, 3 * GIB, 10 * GIB)
    fixed = pool.resize(lease.id, 3 * GIB, limit=0, now=T0 + 2)
    assert fixed.burst_limit == 0 and not fixed.elastic


def test_fixed_slices_never_grow(tmp_path):
    pool = make_pool(tmp_path, burst="0")
    lease = pool.request(req(gib=2), now=T0)
    decisions = pool.report_usage({lease.id: 6 * GIB}, now=T0 + 1)
    assert [d.kind for d in decisions] == [DecisionKind.OVER_LIMIT]
    assert pool.get(lease.id).memory == 2 * GIB


def test_report_bills_burst_apart_from_the_guarantee(tmp_path):
    pool = make_pool(tmp_path, burst="16GiB")
    lease = pool.request(req(gib=2), now=T0)
    pool.grow(lease.id, 6 * GIB, now=T0 + 3600)  # 2 GiB for an hour, then 6 GiB for an hour
    pool.release(lease.id, now=T0 + 7200)
    (row,) = pool.report(now=T0 + 7200)
    assert row["gib_hours_held"] == pytest.approx(8.0)
    assert row["gib_hours_burst"] == pytest.approx(4.0)  # 4 GiB above the guarantee for an hour
    assert row["gpu_hours_burst"] == pytest.approx(4 / 16)


def test_a_pool_file_of_the_previous_version_is_taken_forward(tmp_path):
    """A file written before elastic slices: its granted lease is guaranteed its size and does not
    burst (it asked for a fixed slice then), and its ledger rows bill nothing as burst."""
    import json
    import sqlite3

    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.backends.local.store import MIGRATIONS, SCHEMA_VERSION
    from jupyter_gpupool.core.models import Lease
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    path = tmp_path / "old.sqlite"
    uuid = SimulatedBackend.from_spec("1x16GiB").devices()[0].uuid
    before = len(MIGRATIONS) - 1
    conn = sqlite3.connect(path)
    conn.executescript(";".join(MIGRATIONS[:before]) + f"; PRAGMA user_version={before}; PRAGMA application_id={0x4A475050};")
    old = Lease(id="l-old", owner="alice", memory=4 * GIB, state=LeaseState.GRANTED, created_at=T0, granted_at=T0,
                devices=(uuid,), heartbeat_at=T0).to_json()
    for field in ("guarantee", "burst_limit", "burst_taken_at", "burst_note"):
        del old[field]
    conn.execute("INSERT INTO leases VALUES (?,?,?,?,?,?)", ("l-old", "granted", "alice", None, T0, json.dumps(old)))
    conn.execute("INSERT INTO ledger(lease_id, owner, groups, kernel_id, devices, memory, start, end, active_seconds) VALUES (?,?,?,?,?,?,?,?,?)",
                 ("l-0", "bob", "[]", None, json.dumps([uuid]), 8 * GIB, T0 - 3600, T0, 0.0))
    conn.commit()
    conn.close()
    pool = make_pool(tmp_path, name="old.sqlite")
    assert isinstance(pool, Pool)
    assert pool.store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    lease = pool.get("l-old")
    assert (lease.guarantee_size, lease.limit_size, lease.elastic) == (4 * GIB, 4 * GIB, False)
    rows = {r["user"]: r for r in pool.report(now=T0 + 3600)}
    assert rows["bob"]["gib_hours_held"] == pytest.approx(8.0) and rows["bob"]["gib_hours_burst"] == 0.0
    assert rows["alice"]["gib_hours_burst"] == 0.0


def test_the_status_line_and_the_leases_table_show_guarantee_now_and_limit(tmp_path):
    from jupyter_gpupool.apps.cli import memory_text
    from jupyter_gpupool.kernel.status import KernelStatus
    from jupyter_gpupool.rest.views import elastic_line

    pool = make_pool(tmp_path, burst="40GiB", spec="1x80GiB")
    lease = pool.request(req(gib=4), now=T0)
    grown = pool.grow(lease.id, int(9.2 * GIB), now=T0 + 1)
    assert elastic_line(grown) == "4 GiB guaranteed · 9.2 GiB now, up to 40 GiB"
    assert memory_text(grown.to_json()) == "4 GiB (9.2 GiB now, up to 40 GiB)"
    rows = dict(KernelStatus(lease=grown, now=T0 + 1).rows())
    assert rows["elastic"] == "4 GiB guaranteed · 9.2 GiB now, up to 40 GiB" and rows["last step"].startswith("grown to")
    fixed = pool.request(req("bob", gib=4, burst_limit=0), now=T0)
    assert elastic_line(fixed) == "" and memory_text(fixed.to_json()) == "4 GiB"


def test_the_kernel_body_says_when_enforcement_fixed_the_size_at_start(tmp_path):
    from jupyter_gpupool.enforcement.plan import EnforcementConfig, plan_enforcement
    from jupyter_gpupool.rest.views import burst_fixed, kernel_status

    pool = make_pool(tmp_path, burst="16GiB")
    lease = pool.request(req(gib=2), now=T0)
    plain = kernel_status(pool, "k1", lease, EnforcementConfig(), "alice", T0)
    assert plain["burst_fixed"] is None and plain["limit"] == 16 * GIB
    mps = kernel_status(pool, "k1", lease, EnforcementConfig(mps_pipe_directory="/tmp/mps"), "alice", T0)
    assert mps["burst_fixed"] == "CUDA MPS set this kernel's memory limit when it started"
    hami = kernel_status(pool, "k1", lease, EnforcementConfig(hami_library="/opt/libvgpu.so"), "alice", T0)
    assert hami["burst_fixed"] == "HAMi-core set this kernel's memory limit when it started"
    # Under MPS the provisioner asks for a fixed slice; on a pool whose slices burst it says why.
    fixed = pool.request(req("bob", gib=2, burst_limit=0), now=T0)
    assert kernel_status(pool, "k2", fixed, EnforcementConfig(mps_pipe_directory="/tmp/mps"), "bob", T0)["burst_fixed"] == (
        "CUDA MPS set this kernel's memory limit when it started"
    )
    partitioned = EnforcementConfig(mps_pipe_directory="/tmp/mps", mps_memory_partitioning=True)
    assert kernel_status(pool, "k1", lease, partitioned, "alice", T0)["burst_fixed"] is None  # soft/hard bounds: it bursts
    assert kernel_status(pool, "k2", fixed, EnforcementConfig(), "bob", T0)["burst_fixed"] is None  # a fixed slice by choice
    still = make_pool(tmp_path / "fixed-pool", burst="0")
    carol = still.request(req("carol", gib=2), now=T0)
    assert kernel_status(still, "k3", carol, EnforcementConfig(mps_pipe_directory="/tmp/mps"), "carol", T0)["burst_fixed"] is None
    plain_plan = plan_enforcement(fixed, pool.devices())
    assert burst_fixed(fixed, plain_plan, "slurm") == "Slurm set this job's GPU shards when it was submitted"


def test_the_right_size_hint_of_an_elastic_slice_looks_at_its_guarantee_not_its_burst(tmp_path):
    """A 2 GiB guarantee grown to 16 GiB for a 6 GiB peak has nothing to shrink; a 12 GiB
    guarantee that peaked at 2 GiB is offered 3 GiB (the widget and %gpupool status)."""
    import dataclasses

    from jupyter_gpupool.kernel.status import KernelStatus

    pool = make_pool(tmp_path, burst="16GiB")
    grown = dataclasses.replace(pool.request(req(gib=2), now=T0), memory=16 * GIB, peak_memory=6 * GIB)
    assert KernelStatus(lease=grown).hint() is None
    roomy = dataclasses.replace(pool.request(req("bob", gib=12), now=T0), peak_memory=2 * GIB)
    hint = KernelStatus(lease=roomy).hint()
    assert hint is not None and hint.button == "Shrink to 3 GiB"


def test_a_grow_refused_in_place_moves_the_kernel_to_a_gpu_with_room_and_it_grows_there(tmp_path):
    pool = make_pool(tmp_path, spec="2x40GiB", burst="40GiB", placement="best-fit")
    first = pool.request(req("ann", gib=10, suspendable=True, kernel_id="k1"), now=T0)
    pool.request(req("bob", gib=25), now=T0)  # beside it (best fit): 5 GiB left there
    home = pool.get(first.id).devices
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(first.id, 30 * GIB, now=T0 + 1)
    waiting = pool.get(first.id)
    assert waiting.grow_wanted == 30 * GIB and waiting.grow_since == T0 + 1
    pool.tick(now=T0 + 2)
    moving = pool.get(first.id)
    assert moving.transition is Transition.MIGRATING and moving.migrate_from == home and moving.devices != home
    assert "room for its slice to grow" in moving.suspend_reason
    late = pool.request(req("cat", gib=12), now=T0 + 3)  # the room it moves to is held for it
    assert late.state is LeaseState.QUEUED
    pool.confirm_transition(first.id, now=T0 + 4)
    grown = pool.grow(first.id, 30 * GIB, now=T0 + 5)
    assert grown.memory >= 30 * GIB and grown.grow_since is None and grown.guarantee == 10 * GIB
    pool.tick(now=T0 + 6)
    assert pool.get(late.id).state is LeaseState.GRANTED  # room on the GPU it left


def test_a_kernel_waiting_to_grow_takes_back_an_idle_neighbours_burst_never_its_guarantee(tmp_path):
    pool = make_pool(tmp_path, spec="1x40GiB", burst="40GiB", burst_settle=15, idle_policy="never")
    idle = pool.request(req("ann", gib=8, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_usage({idle.id: 24 * GIB}, now=T0 + 1)  # grew to about 25 GiB
    assert pool.get(idle.id).memory >= 24 * GIB
    pool.report_activity(idle.id, Activity(busy=False, last_activity=T0 + 1), now=T0 + 2)
    busy = pool.request(req("bob", gib=10, kernel_id="k2"), now=T0 + 3)
    assert busy.state is LeaseState.GRANTED
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(busy.id, 20 * GIB, now=T0 + 4)
    pool.tick(now=T0 + 5)
    shrunk = pool.get(idle.id)
    assert shrunk.guarantee == 8 * GIB <= shrunk.memory <= 40 * GIB - 20 * GIB
    assert shrunk.burst_note.startswith("burst taken back for a neighbour's slice")
    pool.tick(now=T0 + 25)  # still above its slice after burst_settle, and idle: suspended
    suspending = pool.get(idle.id)
    assert suspending.transition is Transition.SUSPENDING
    pool.confirm_transition(idle.id, parked_bytes=24 * GIB, now=T0 + 26)
    grown = pool.get(busy.id)
    assert grown.memory >= 20 * GIB and grown.grow_since is None
    assert [e["kind"] for e in pool.events() if e["lease_id"] == busy.id][-1] == "grow"


def test_a_busy_neighbours_burst_goes_to_the_waiting_grow_only_once_the_watchdog_measures_it_given_back(tmp_path):
    """A busy kernel gives back only what it held and did not use; until the watchdog measures it
    within its new size, a reading from before the shrink does not hand that room on."""
    pool = make_pool(tmp_path, spec="1x40GiB", burst="40GiB", idle_policy="never")
    busy = pool.request(req("ann", gib=8, kernel_id="k1"), now=T0)
    pool.report_usage({busy.id: 24 * GIB}, now=T0 + 1)  # grew to about 25 GiB
    held = pool.get(busy.id).memory
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 2)
    pool.report_usage({busy.id: 12 * GIB}, now=T0 + 2)  # it uses less than it holds
    wants = pool.request(req("bob", gib=10, kernel_id="k2"), now=T0 + 3)
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(wants.id, 20 * GIB, now=T0 + 4)
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 5)
    pool.tick(now=T0 + 5)
    shrunk = pool.get(busy.id)
    assert 12 * GIB <= shrunk.memory < held and shrunk.burst_from == held
    assert shrunk.burst_note.startswith("burst taken back for a neighbour's slice")
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 6)
    pool.tick(now=T0 + 6)
    assert pool.get(wants.id).memory < 20 * GIB  # not on the word of a reading older than the shrink
    pool.report_usage({busy.id: 12 * GIB}, now=T0 + 7)  # measured within its new size
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 8)
    pool.tick(now=T0 + 8)
    assert pool.get(wants.id).memory >= 20 * GIB


def test_under_pressure_a_kernel_waiting_to_grow_gets_an_idle_kernels_room(tmp_path):
    pool = make_pool(tmp_path, spec="1x40GiB", burst="40GiB", idle_policy="pressure", idle_timeout=300, suspend_idle_timeout=300,
                     warning_period=60, reclaim_action="suspend")
    idle = pool.request(req("ann", gib=24, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_activity(idle.id, Activity(busy=False, last_activity=T0), now=T0)
    wants = pool.request(req("bob", gib=10, suspendable=True, kernel_id="k2"), now=T0)
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(wants.id, 20 * GIB, now=T0 + 1)
    pool.tick(now=T0 + 200)
    assert pool.get(idle.id).reclaim_at is None  # not idle long enough yet
    pool.tick(now=T0 + 301)
    warned = pool.get(idle.id)
    assert warned.reclaim_at == T0 + 361 and "waited for its slice to grow" in warned.reclaim_reason
    pool.tick(now=T0 + 362)
    assert pool.get(idle.id).transition is Transition.SUSPENDING
    pool.confirm_transition(idle.id, parked_bytes=24 * GIB, now=T0 + 363)
    assert pool.get(wants.id).memory >= 20 * GIB


def test_a_resumed_elastic_slice_is_placed_where_it_can_grow_back_to_its_last_peak(tmp_path):
    pool = make_pool(tmp_path, spec="3x40GiB", burst="40GiB", burst_settle=15, idle_policy="never")
    kernel = pool.request(req("ann", gib=8, suspendable=True, kernel_id="k1"), now=T0)
    pool.report_usage({kernel.id: 30 * GIB}, now=T0 + 1)
    pool.report_activity(kernel.id, Activity(busy=False, last_activity=T0 + 1), now=T0 + 1)
    home = pool.get(kernel.id).devices
    bob = pool.request(req("bob", gib=40), now=T0 + 2)
    pool.request(req("cat", gib=40), now=T0 + 2)
    dan = pool.request(req("dan", gib=20), now=T0 + 3)  # its burst is taken back; idle above it, it is suspended
    pool.tick(now=T0 + 20)
    pool.confirm_transition(kernel.id, parked_bytes=30 * GIB, now=T0 + 21)
    assert pool.get(dan.id).devices == home and pool.get(kernel.id).memory <= 20 * GIB
    pool.release(bob.id, now=T0 + 22)  # an empty GPU, while its own has room for its slice but not its 30 GiB
    pool.resume(kernel.id, now=T0 + 23)
    back = pool.get(kernel.id)
    assert back.transition is Transition.RESTORING and back.devices == pool.get(bob.id).devices


def test_the_kernel_body_says_what_a_queued_reserve_waits_for(tmp_path):
    """A ``%gpupool reserve`` waiting in line shows in the kernel's REST body (bytes per GPU and
    since when); none waiting: both null."""
    from jupyter_gpupool.enforcement.plan import EnforcementConfig
    from jupyter_gpupool.rest.views import kernel_status

    pool = make_pool(tmp_path, burst="16GiB")
    lease = pool.request(req(gib=2), now=T0)
    idle = kernel_status(pool, "k1", lease, EnforcementConfig(), "alice", T0)
    assert (idle["reserve_wanted"], idle["reserve_since"]) == (None, None)
    waiting = lease.copy(reserve_wanted=10 * GIB, reserve_since=T0 + 3)
    body = kernel_status(pool, "k1", waiting, EnforcementConfig(), "alice", T0 + 5)
    assert (body["reserve_wanted"], body["reserve_since"]) == (10 * GIB, T0 + 3)
