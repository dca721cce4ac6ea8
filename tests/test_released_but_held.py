"""A lease released while its kernel's process still holds GPU memory (a kernel that gave its
lease back on a shutdown request and is slow to exit, an idle kernel culled before its server
stopped it) leaves that memory taken: the pool grants it to nobody until the driver shows it
freed, whoever released the lease. Real SQLite, real processes; the simulated driver lists them."""

from __future__ import annotations

from pool_helpers import T0, kernel_process, make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Activity, LeaseState
from jupyter_gpupool.units import GIB


def unpooled_of(pool: Pool) -> list[tuple[int, int, str]]:
    return [(row["pid"], row["bytes"], row["why"]) for row in pool.unpooled(now=T0 + 50)]


def test_memory_a_released_kernel_still_holds_goes_to_nobody_until_its_process_lets_go(tmp_path) -> None:
    pool = make_pool(tmp_path)
    alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
    bob = pool.request(req("bob", 12, kernel_id="kb"), now=T0 + 1)
    assert bob.state is LeaseState.QUEUED
    with kernel_process({"GPUPOOL_LEASE_ID": alice.id}) as kernel:
        pool.backend.set_usage(kernel.pid, alice.devices[0], 10 * GIB)
        pool.release(alice.id, reason="kernel shut down", now=T0 + 10)
        # Bob's 12 GiB do not fit beside the 10 GiB alice's process still holds.
        assert pool.get(bob.id).state is LeaseState.QUEUED
        assert unpooled_of(pool) == [(kernel.pid, 10 * GIB, Pool.RELEASED_BUT_HELD)]
        view = pool.snapshot(viewer="alice", now=T0 + 11)
        assert view.devices[0]["memory_unpooled"] == 10 * GIB
        pool.tick(now=T0 + 12)
        assert pool.get(bob.id).state is LeaseState.QUEUED  # nor at the next round, while it lives
    pool.tick(now=T0 + 13)  # the process exited: its memory is free
    assert pool.get(bob.id).state is LeaseState.GRANTED
    assert unpooled_of(pool) == []


def test_a_release_that_finds_nothing_held_frees_the_slice_at_once(tmp_path) -> None:
    pool = make_pool(tmp_path)
    alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
    bob = pool.request(req("bob", 12, kernel_id="kb"), now=T0 + 1)
    with kernel_process({"GPUPOOL_LEASE_ID": alice.id}) as kernel:
        pool.backend.set_usage(kernel.pid, alice.devices[0], 0)  # alive, but holds nothing on the GPU
        pool.release(alice.id, now=T0 + 10)
        assert pool.get(bob.id).state is LeaseState.GRANTED
        assert unpooled_of(pool) == []


def test_an_idle_kernel_culled_for_a_waiting_request_keeps_its_memory_taken_until_it_is_stopped(tmp_path) -> None:
    """The engine's own release (an idle cull in a scheduling round) is held to the same rule: the
    request it was culled for is granted once the culled kernel's process has let go."""
    pool = make_pool(tmp_path, idle_timeout=600, warning_period=60, preemption=False, reclaim_action="cull")
    alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
    with kernel_process({"GPUPOOL_LEASE_ID": alice.id}) as kernel:
        pool.backend.set_usage(kernel.pid, alice.devices[0], 9 * GIB)
        bob = pool.request(req("bob", 12, kernel_id="kb"), now=T0 + 700)
        pool.tick(now=T0 + 701)  # alice warned: idle while bob waits
        pool.report_activity(alice.id, Activity(busy=False, last_activity=T0), now=T0 + 770)
        pool.tick(now=T0 + 770)  # due: culled
        assert pool.get(alice.id).state is LeaseState.RELEASED
        assert pool.get(bob.id).state is LeaseState.QUEUED
        assert [(pid, size) for pid, size, _ in unpooled_of(pool)] == [(kernel.pid, 9 * GIB)]
    pool.tick(now=T0 + 775)  # its server stopped it
    assert pool.get(bob.id).state is LeaseState.GRANTED
