"""Memory goes back to the pool only as the driver shows it free, whatever path lowered what a
lease holds: a shrink, asking again (a kernel restart) while granted, suspending or restoring, a
burst taken back, a release. Whose a process is decides whose the memory is, never whether it is
taken. Burst yields to a guarantee asked in a running kernel. Real SQLite and real processes; the
simulated driver lists the memory they hold."""

from __future__ import annotations

import subprocess
from contextlib import AbstractContextManager, contextmanager

import pytest
from pool_helpers import T0, kernel_process, make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import DecisionKind, LeaseState, Transition
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB


def holder(env: dict[str, str] | None = None) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """A live process that memory can be scripted against (a kernel, when ``env`` names its lease)."""
    return kernel_process(env or {})


def kernel_of(lease_id: str) -> dict[str, str]:
    return {"GPUPOOL_LEASE_ID": lease_id}


def state_of(pool: Pool, lease_id: str) -> LeaseState:
    return pool.get(lease_id).state


def test_a_shrink_leaves_what_the_kernel_still_holds_taken_until_it_lets_go(tmp_path) -> None:
    """A's kernel holds all 12 GiB of its fixed slice and A resizes to 2 GiB: B's 10 GiB waits
    until the driver shows A's process within 2 GiB."""
    pool = make_pool(tmp_path)
    alice = pool.request(req("alice", 12, kernel_id="ka", burst_limit=0), now=T0)
    with holder(kernel_of(alice.id)) as kernel:
        pool.backend.set_usage(kernel.pid, alice.devices[0], 12 * GIB)
        shrunk = pool.resize(alice.id, 2 * GIB, now=T0 + 1)
        assert shrunk.memory == 2 * GIB
        bob = pool.request(req("bob", 10, kernel_id="kb"), now=T0 + 2)
        assert bob.state is LeaseState.QUEUED  # 12 GiB held + 10 GiB would be 22 GiB on 16 GiB
        pool.tick(now=T0 + 3)
        assert state_of(pool, bob.id) is LeaseState.QUEUED
        pool.backend.set_usage(kernel.pid, alice.devices[0], 2 * GIB)  # its framework let go
        pool.tick(now=T0 + 4)
        assert state_of(pool, bob.id) is LeaseState.GRANTED


@pytest.mark.parametrize("step", ["granted", "suspending", "restoring"])
def test_asking_again_frees_nothing_the_old_process_still_holds(tmp_path, step: str) -> None:
    """The same kernel asks again (a restart) while its lease is granted, being suspended or being
    restored: the lease queues, and the 12 GiB its process still holds go to nobody meanwhile."""
    pool = make_pool(tmp_path, idle_timeout=600, warning_period=60, preemption=False)
    alice = pool.request(req("alice", 12, kernel_id="ka", suspendable=True), now=T0)
    gpu = alice.devices[0]
    with holder(kernel_of(alice.id)) as kernel:
        pool.backend.set_usage(kernel.pid, gpu, 12 * GIB)
        bob = pool.request(req("bob", 8, kernel_id="kb"), now=T0 + 1)
        assert bob.state is LeaseState.QUEUED
        if step != "granted":
            assert pool.suspend(alice.id, now=T0 + 2).transition is Transition.SUSPENDING
        if step == "restoring":
            pool.backend.set_usage(kernel.pid, gpu, 0)  # parked
            pool.confirm_transition(alice.id, parked_bytes=12 * GIB, now=T0 + 3)
            assert state_of(pool, bob.id) is LeaseState.GRANTED
            pool.release(bob.id, now=T0 + 4)
            assert pool.resume(alice.id, now=T0 + 4).transition is Transition.RESTORING
            pool.backend.set_usage(kernel.pid, gpu, 12 * GIB)  # the restore mapped it back
            bob = pool.request(req("bob", 8, kernel_id="kb2"), now=T0 + 5)
            assert state_of(pool, bob.id) is LeaseState.QUEUED
        again = pool.request(req("alice", 12, kernel_id="ka", suspendable=True), now=T0 + 6)
        assert again.id == alice.id and again.devices == () and again.transition is Transition.NONE
        assert state_of(pool, bob.id) is LeaseState.QUEUED  # the old process still holds 12 GiB
        pool.tick(now=T0 + 7)
        assert state_of(pool, bob.id) is LeaseState.QUEUED
    pool.tick(now=T0 + 8)  # the old process exited: its memory is free, and bob is first in line
    assert state_of(pool, bob.id) is LeaseState.GRANTED


def test_a_grow_nobody_uses_gives_its_burst_back_at_once(tmp_path) -> None:
    """A grows to 16 GiB through the API with no process using anything; B's 8 GiB fits at
    guarantees: A's burst is taken back and, the driver showing nothing held, B is granted in the
    same decision (not after A's idle reclaim)."""
    pool = make_pool(tmp_path, burst="16GiB")
    alice = pool.request(req("alice", 2), now=T0)
    assert pool.grow(alice.id, 16 * GIB, now=T0 + 1).memory == 16 * GIB
    bob = pool.request(req("bob", 8), now=T0 + 2)
    assert bob.state is LeaseState.GRANTED
    back = pool.get(alice.id)
    assert back.memory == 8 * GIB and back.burst_taken_at is not None


def test_a_grow_a_process_fills_is_given_back_as_the_driver_shows_it_freed(tmp_path) -> None:
    """The same with A's process holding 14 GiB: B waits until the driver shows it below 8 GiB."""
    pool = make_pool(tmp_path, burst="16GiB")
    alice = pool.request(req("alice", 2), now=T0)
    pool.grow(alice.id, 16 * GIB, now=T0 + 1)
    with holder(kernel_of(alice.id)) as kernel:
        pool.backend.set_usage(kernel.pid, alice.devices[0], 14 * GIB)
        bob = pool.request(req("bob", 8), now=T0 + 2)
        assert bob.state is LeaseState.QUEUED
        pool.backend.set_usage(kernel.pid, alice.devices[0], 6 * GIB)  # caps lowered, caches freed
        pool.tick(now=T0 + 5)
        assert state_of(pool, bob.id) is LeaseState.GRANTED


def test_memory_a_released_kernel_holds_stays_taken_even_when_its_process_is_not_traced(tmp_path) -> None:
    """Attribution decides whose memory is, never whether it is taken: a released kernel's process
    the pool cannot trace to the lease (no lease in its environment) keeps its 10 GiB from bob."""
    pool = make_pool(tmp_path)
    alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
    bob = pool.request(req("bob", 12, kernel_id="kb"), now=T0 + 1)
    with holder() as stranger:
        pool.backend.set_usage(stranger.pid, alice.devices[0], 10 * GIB)
        pool.release(alice.id, now=T0 + 10)
        assert state_of(pool, bob.id) is LeaseState.QUEUED
        pool.tick(now=T0 + 11)
        assert state_of(pool, bob.id) is LeaseState.QUEUED
    pool.tick(now=T0 + 12)
    assert state_of(pool, bob.id) is LeaseState.GRANTED


def test_a_reserve_in_a_running_kernel_takes_burst_back_and_waits_in_line(tmp_path) -> None:
    """2 GiB default, burst 16 GiB: A grew to 6 GiB and now uses 1 GiB. B's reserve of 12 GiB fits
    at guarantees: it is not refused; A's burst is taken back for it, and once A is measured within
    its guarantee B holds 12 GiB."""
    pool = make_pool(tmp_path, burst="16GiB")
    alice = pool.request(req("alice", 2), now=T0)
    pool.grow(alice.id, 6 * GIB, now=T0 + 1)
    pool.report_usage({alice.id: 1 * GIB}, now=T0 + 2)
    bob = pool.request(req("bob", 2), now=T0 + 3)
    waiting = pool.resize(bob.id, 12 * GIB, now=T0 + 4)
    assert waiting.reserve_wanted == 12 * GIB and waiting.memory == 2 * GIB
    assert pool.get(alice.id).memory == 4 * GIB  # as much of its burst as the reserve needs is taken back
    assert "reserve of 12 GiB queued" in waiting.burst_note
    pool.report_usage({alice.id: 1 * GIB}, now=T0 + 6)  # measured within: the room is the reserve's
    pool.tick(now=T0 + 7)
    served = pool.get(bob.id)
    assert served.memory == served.guarantee == 12 * GIB and served.reserve_wanted == 0
    assert any(e["kind"] == DecisionKind.GROW.value and e["lease_id"] == bob.id for e in pool.events())
    with pytest.raises(Exception, match="burst is taken back|not grown"):
        pool.grow(alice.id, 8 * GIB, now=T0 + 8)  # the room is bob's guarantee now


def test_a_reserve_that_does_not_fit_even_at_guarantees_is_refused_as_before(tmp_path) -> None:
    pool = make_pool(tmp_path, burst="16GiB")
    pool.request(req("alice", 8), now=T0)
    bob = pool.request(req("bob", 2), now=T0 + 1)
    with pytest.raises(Exception, match="cannot grow to 12 GiB"):
        pool.resize(bob.id, 12 * GIB, now=T0 + 2)
    assert pool.get(bob.id).reserve_wanted == 0


def test_a_slices_limit_is_the_policys_burst_of_its_guarantee_whatever_its_history(tmp_path) -> None:
    """2xA100-80GB, burst 4x: a 20 GiB kernel reserving 6 GiB (with a keep, or without) gets up to
    24 GiB, as a new 6 GiB request does; never the 80 GiB its 20 GiB once had."""
    pool = make_pool(tmp_path, spec="2xA100-80GB")
    kept = pool.request(req("alice", 20, kernel_id="ka"), now=T0)
    assert kept.burst_limit == 80 * GIB
    assert pool.resize(kept.id, 6 * GIB, duration=3600, now=T0 + 1).burst_limit == 24 * GIB
    plain = pool.request(req("bob", 20, kernel_id="kb"), now=T0 + 2)
    assert pool.resize(plain.id, 6 * GIB, now=T0 + 3).burst_limit == 24 * GIB
    assert pool.resize(plain.id, 10 * GIB, now=T0 + 4).burst_limit == 40 * GIB  # recomputed on every size change
    fresh = pool.request(req("cat", 6, kernel_id="kc"), now=T0 + 5)
    assert fresh.burst_limit == 24 * GIB


def test_a_limit_its_user_set_is_kept_through_size_changes(tmp_path) -> None:
    pool = make_pool(tmp_path, spec="2xA100-80GB")
    lease = pool.request(req("alice", 8, kernel_id="ka", burst_limit=30 * GIB), now=T0)
    assert lease.burst_limit == 30 * GIB
    assert pool.resize(lease.id, 4 * GIB, now=T0 + 1).burst_limit == 30 * GIB
    assert pool.resize(lease.id, 12 * GIB, now=T0 + 2).burst_limit == 30 * GIB
    fixed = pool.resize(lease.id, 12 * GIB, now=T0 + 3, limit=0)
    assert fixed.burst_limit == 0
    assert pool.resize(lease.id, 6 * GIB, now=T0 + 4).burst_limit == 0  # fixed stays fixed
    assert pool.resize(lease.id, 40 * GIB, now=T0 + 5).burst_limit == 0
    with pytest.raises(InvalidInput, match="below the slice's size"):
        pool.resize(lease.id, 40 * GIB, now=T0 + 6, limit=20 * GIB)


def test_burst_yields_to_a_reservation_before_anyone_is_reclaimed(tmp_path) -> None:
    """Ben's reservation of 8 GiB opens while ann's 2 GiB slice has grown to 14 GiB that nothing
    uses: ann's burst is taken back for it (not her guarantee, and she is not reclaimed), and ben's
    8 GiB is granted."""
    window = [{"name": "lab", "users": ["ben"], "memory": "8GiB", "start": T0 + 600, "end": T0 + 4800}]
    pool = make_pool(tmp_path, burst="16GiB", reservations=window, idle_timeout=300, warning_period=60)
    ann = pool.request(req("ann", 2), now=T0)
    assert pool.grow(ann.id, 14 * GIB, now=T0 + 1).memory == 14 * GIB
    pool.tick(now=T0 + 600)
    back = pool.get(ann.id)
    assert back.state is LeaseState.GRANTED and back.memory <= 8 * GIB and back.reclaim_at is None
    assert back.burst_note.startswith("burst taken back for the reservation")
    ben = pool.request(req("ben", 8), now=T0 + 601)
    assert ben.state is LeaseState.GRANTED


def test_a_kernels_own_pool_reads_the_driver_before_the_write_lock(tmp_path, monkeypatch) -> None:
    """NVML in a kernel's process waits while a CUDA checkpoint holds that process: read under the
    pool's write lock, it would stall the server that must restore it. The kernel's own pool reads
    the driver first, as it reads the inventory; a server's reads it in the decision, when needed."""
    monkeypatch.setenv("GPUPOOL_LEASE_ID", "l-this-kernel")
    pool = make_pool(tmp_path)
    assert pool.read_driver_first
    locked = [False]
    reads: list[bool] = []
    read, transaction = pool.backend.process_usage, pool.store.transaction

    def counted():
        reads.append(locked[0])
        return read()

    @contextmanager
    def watched():
        with transaction():
            locked[0] = True
            try:
                yield
            finally:
                locked[0] = False

    monkeypatch.setattr(pool.backend, "process_usage", counted)
    monkeypatch.setattr(pool.store, "transaction", watched)
    pool.request(req("alice", 12), now=T0)
    bob = pool.request(req("bob", 8), now=T0 + 1)
    assert bob.state is LeaseState.QUEUED
    pool.tick(now=T0 + 2)
    assert reads and not any(reads)
    monkeypatch.delenv("GPUPOOL_LEASE_ID")
    assert not make_pool(tmp_path, name="server.sqlite").read_driver_first
