"""A burst taken back frees the kernel's framework caches at once, whatever the server last sent.

A kernel grows its own slice (a framework's out-of-memory grow: here the kernel-side
``pretend_to_use`` of the simulated pool) from its 4 GiB guarantee to 13 GiB, and another request
needs that burst back before the server's next tick (30 s here). The server must not take the
take-back to 8 GiB for growth from the 4 GiB it last sent: the kernel is told at once, frees its
caches (a freer the test registers, as PyTorch's ``empty_cache`` would free its cached blocks),
and is measured back within its guarantee long before ``burst_settle`` (15 s), never suspended.
Real jupyter_server and ipykernel kernels on a simulated ``1x16GiB`` pool.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from jupyter_client import BlockingKernelClient
from server_kernels import start_running_kernel

from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState
from jupyter_gpupool.serverextension.transitions import CapsMove, caps_move
from jupyter_gpupool.units import GIB


def run_blocking(serverapp: Any, kernel_id: str, code: str) -> None:
    """Run ``code`` in a server-managed kernel from the server's own thread, blocking it (the
    server's loops wait) until the kernel replies."""
    client = BlockingKernelClient()
    client.load_connection_info(serverapp.kernel_manager.get_kernel(kernel_id).get_connection_info())
    client.start_channels()
    try:
        reply = client.execute_interactive(code, timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        client.stop_channels()


#: The pool's default burst_settle and the test server's watchdog interval (tests/conftest.py).
BURST_SETTLE, WATCHDOG_INTERVAL = 15.0, 0.5


@pytest.mark.slow
@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="4GiB", GPUPOOL_BURST="13GiB", GPUPOOL_IDLE_POLICY="never")
@pytest.mark.gpupool_config({"GpuPoolExtension": {"tick_interval": 30.0}})
def test_a_burst_the_kernel_grew_itself_and_lost_before_the_tick_is_freed_without_a_suspend(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        lease = await gpupool_wait(lambda: (l := pool.lease_for_kernel(kernel)) and l.state is LeaseState.GRANTED and l,
                                   what="the kernel's 4 GiB slice")
        assert (lease.memory, lease.guarantee, lease.burst_limit) == (4 * GIB, 4 * GIB, 13 * GIB)
        await kernel_exec(
            kernel,
            "from jupyter_gpupool.devices.simulated import pretend_to_use\n"
            "from jupyter_gpupool.enforcement import caps\n"
            f"caps.register_cache_freer('framework', lambda: {{'freed': {10 * GIB}, 'held': pretend_to_use('3GiB')}})",
        )
        # Before the server's next tick, and before its event loop runs again (so it follows no
        # change in between): the kernel grows its own slice past its 4 GiB caps, then another
        # request needs that burst back.
        run_blocking(jp_serverapp, kernel, "_ = pretend_to_use('13GiB')")
        assert pool.get(lease.id).memory == 13 * GIB
        asked = time.monotonic()
        other = pool.request(LeaseRequest(owner="bob", memory=8 * GIB, holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert other.state is LeaseState.QUEUED
        taken = pool.get(lease.id)
        assert (taken.memory, taken.burst_from) == (8 * GIB, 13 * GIB) and taken.burst_taken_at is not None
        assert gpupool_ext._caps_sent.get(lease.id) == 4 * GIB  # what the server last sent: 4 -> 8 looks like growth

        def back_within_guarantee() -> Lease | None:
            now = pool.get(lease.id)
            return now if now.burst_taken_at is None and (now.used_memory or 0) <= now.guarantee else None

        back = await gpupool_wait(back_within_guarantee, timeout=BURST_SETTLE + WATCHDOG_INTERVAL,
                                  what="the kernel's use back within its guarantee")
        took = time.monotonic() - asked
        assert back.state is LeaseState.GRANTED and back.suspensions == 0 and back.used_memory == 3 * GIB
        assert back.burst_note.startswith("gave its burst back"), back.burst_note
        out = await kernel_exec(kernel, "import jupyter_gpupool.kernel as k\nprint(caps.requests_served, k.get_caps().limit)")
        assert out.split() == ["1", str(8 * GIB)], out  # freed once, asked by the server; caps down to the slice
        pool.tick()  # the next scheduling round, by anyone: the room is the request's
        assert pool.get(other.id).state is LeaseState.GRANTED
        assert pool.get(lease.id).suspensions == 0
        print(f"burst back in {took:.1f} s (burst_settle {BURST_SETTLE:.0f} s)")

    arun(scenario())


def _granted(memory: int, **fields: object) -> Lease:
    return Lease(id="l", owner="alice", memory=memory, state=LeaseState.GRANTED, created_at=0.0, guarantee=4 * GIB,
                 burst_limit=13 * GIB, devices=("GPU-0",), **fields)  # type: ignore[arg-type]


def test_caps_follow_a_take_back_from_what_the_kernel_held_not_from_what_the_server_sent() -> None:
    # The kernel grew itself to 13 GiB unseen (the server sent 4 GiB); the pool took it back to 8.
    taken = _granted(8 * GIB, burst_taken_at=100.0, burst_from=13 * GIB)
    assert caps_move(taken, 4 * GIB, None) == CapsMove(8 * GIB, free_cache=True)
    assert caps_move(taken, 8 * GIB, None) == CapsMove(8 * GIB, free_cache=True)  # a take-back to the size it had
    assert caps_move(taken, 8 * GIB, 100.0) is None  # told of that take-back already
    assert caps_move(_granted(6 * GIB, burst_taken_at=130.0, burst_from=8 * GIB), 8 * GIB, 100.0) == CapsMove(6 * GIB, True)
    # Growth, and a shrink with no take-back (it gave its burst back), as before.
    assert caps_move(_granted(8 * GIB), 4 * GIB, None) == CapsMove(8 * GIB, free_cache=False)
    assert caps_move(_granted(6 * GIB), 8 * GIB, 100.0) == CapsMove(6 * GIB, free_cache=True)
    assert caps_move(_granted(8 * GIB), 8 * GIB, None) is None
