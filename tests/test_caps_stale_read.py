"""A read of the leases from before a burst take-back never sets a kernel's caps back up.

The server follows its kernels' sizes from several reads: the change follower's (at once), the
tick's and the watchdog's (each read, then acted on a moment later). A kernel grows its slice to
13 GiB; the tick reads the leases; another request takes the burst back to 8 GiB and the change
follower lowers the kernel's caps to 8 GiB; only then does the tick act on its older read. The
caps stay at 8 GiB: that read is older than the size already followed, whatever it says. The
stale order is played out by calling the steps in that order, not by timing. A real
jupyter_server and ipykernel kernel on a simulated ``1x16GiB`` pool.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from pool_helpers import T0, make_pool, req
from server_kernels import start_running_kernel

from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.core.elastic import size_generation
from jupyter_gpupool.core.models import Activity, Lease, LeaseRequest, LeaseState
from jupyter_gpupool.units import GIB

CAPS = "import jupyter_gpupool.kernel as k\nprint(k.get_caps().limit)"


@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="4GiB", GPUPOOL_BURST="13GiB", GPUPOOL_IDLE_POLICY="never")
@pytest.mark.gpupool_config({"GpuPoolExtension": {"tick_interval": 3600.0}})
def test_a_tick_that_read_the_leases_before_a_take_back_leaves_the_caps_at_the_taken_back_size(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool
    driver = gpupool_ext.transition_driver

    async def settled() -> None:  # every caps request sent so far has its answer
        while gpupool_ext._transition_tasks:
            await asyncio.gather(*list(gpupool_ext._transition_tasks), return_exceptions=True)

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        lease = await gpupool_wait(lambda: (l := pool.lease_for_kernel(kernel)) and l.state is LeaseState.GRANTED and l,
                                   what="the kernel's 4 GiB slice")
        await kernel_exec(kernel, "from jupyter_gpupool.devices.simulated import pretend_to_use\n_ = pretend_to_use('13GiB')")
        await gpupool_wait(lambda: gpupool_ext._caps_sent.get(lease.id) == 13 * GIB, what="its caps following its growth")
        await settled()
        assert int(await kernel_exec(kernel, CAPS)) == 13 * GIB

        stale = gpupool_ext.kernel_hooks.kernel_leases()  # the tick reads the leases...
        assert stale[kernel][1].memory == 13 * GIB and stale[kernel][1].burst_taken_at is None
        other = pool.request(LeaseRequest(owner="bob", memory=8 * GIB, holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert other.state is LeaseState.QUEUED
        taken: Lease = pool.get(lease.id)
        assert taken.memory == 8 * GIB and taken.burst_taken_at is not None
        assert size_generation(stale[kernel][1]) < size_generation(taken)
        # ...the change follower lowers the caps to the taken-back size...
        await gpupool_wait(lambda: gpupool_ext._caps_sent.get(lease.id) == 8 * GIB, what="the follower lowering its caps")
        await settled()
        assert int(await kernel_exec(kernel, CAPS)) == 8 * GIB
        # ...and the tick acts on what it read before the take-back.
        driver.follow_sizes(stale)
        await settled()
        assert gpupool_ext._caps_sent.get(lease.id) == 8 * GIB
        assert int(await kernel_exec(kernel, CAPS)) == 8 * GIB
        assert pool.get(lease.id).memory == 8 * GIB
        # A fresh read after the stale one is followed as before: nothing to move, the caps stay.
        driver.follow_sizes(gpupool_ext.kernel_hooks.kernel_leases())
        await settled()
        assert int(await kernel_exec(kernel, CAPS)) == 8 * GIB

    arun(scenario())


def test_every_change_of_a_leases_size_or_grant_reads_as_a_later_generation(tmp_path):
    """What the server's stale-read rule stands on: each grow, take-back, suspend, restore and new
    request of a kernel gives the lease a later :func:`size_generation` than any read before it."""
    pool = make_pool(tmp_path, burst="16GiB", burst_settle=15, idle_policy="never")
    first = pool.request(req(gib=2, suspendable=True, kernel_id="k1"), now=T0)
    reads = [first]
    pool.report_usage({first.id: 10 * GIB}, now=T0 + 1)
    reads.append(pool.get(first.id))  # grown
    second = pool.request(req("bob", gib=12), now=T0 + 2)
    reads.append(pool.get(first.id))  # its burst taken back
    pool.report_activity(first.id, Activity(busy=False, last_activity=T0), now=T0 + 3)
    pool.tick(now=T0 + 20)
    pool.confirm_transition(first.id, parked_bytes=10 * GIB, now=T0 + 21)
    reads.append(pool.get(first.id))  # suspended
    pool.release(second.id, now=T0 + 25)
    pool.resume(first.id, now=T0 + 30)
    pool.tick(now=T0 + 31)
    pool.confirm_transition(first.id, now=T0 + 32)
    reads.append(pool.get(first.id))  # restored
    pool.request(req(gib=2, kernel_id="k1"), now=T0 + 40)
    reads.append(pool.get(first.id))  # its kernel restarted: the same lease asks again
    states = [(read.state, read.memory) for read in reads]
    assert states[0][1] < states[1][1] > states[2][1] and states[3][0] is LeaseState.SUSPENDED, states
    assert states[4][0] is LeaseState.GRANTED, states
    generations = [size_generation(read) for read in reads]
    assert generations == sorted(generations) and len(set(generations)) == len(generations), generations
