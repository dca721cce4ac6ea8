"""Elastic slices with a real jupyter_server and real kernels on a simulated 1x16GiB pool.

Kernel A asks for the 2 GiB default and uses 6 GiB: its slice grows within seconds and the
watchdog leaves it alone. Its use drops to 1 GiB; kernel B asks for 12 GiB: B is granted within
seconds, A's slice is back near its guarantee, and A's caps followed it both ways.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import pytest
from server_kernels import start_kernel

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.units import GIB

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="2GiB", GPUPOOL_BURST="16GiB"),
]

USE = "from jupyter_gpupool.devices.simulated import pretend_to_use\nimport jupyter_gpupool.kernel as gpupool_kernel\n"


async def _status(gpupool_fetch: Any, kernel_id: str) -> dict[str, Any]:
    response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id)
    assert response.code == 200, response.body
    return json.loads(response.body)


def test_a_kernel_grows_past_its_default_and_gives_the_burst_back_for_a_request(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_kernel(gpupool_fetch)
        lease_a = await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED and l,
                                     what="kernel A's slice")
        assert (lease_a.memory, lease_a.guarantee, lease_a.burst_limit) == (2 * GIB, 2 * GIB, 16 * GIB)
        started = time.monotonic()
        out = await kernel_exec(a, USE + "pretend_to_use('6GiB')\nprint(gpupool_kernel.get_caps().limit)")
        grown = pool.lease_for_kernel(a)
        assert grown.memory >= 6 * GIB and time.monotonic() - started < 10
        assert int(out) >= 6 * GIB  # the kernel's caps followed
        # Past its limit it fails as a framework cap does, saying why, and holds what it held.
        refused = await kernel_exec(a, USE + "try:\n    pretend_to_use('17GiB')\nexcept MemoryError as e:\n    print(e)")
        assert "its limit is 16 GiB" in refused
        # The watchdog sees 6 GiB in a slice of at least 6 GiB: no warning, no interrupt.
        await gpupool_wait(lambda: (pool.get(grown.id).used_memory or 0) >= 6 * GIB, what="the watchdog's measurement")
        await asyncio.sleep(2.0)  # four watchdog steps
        body = await _status(gpupool_fetch, a)
        assert body["state"] == "granted" and body["guarantee"] == 2 * GIB and body["memory"] >= 6 * GIB
        assert body["limit"] == 16 * GIB
        assert (await kernel_exec(a, "print('alive')")).strip() == "alive"
        events = [e["kind"] for e in pool.events()]
        assert "over_limit" not in events

        await kernel_exec(a, USE + "pretend_to_use('1GiB')")
        await gpupool_wait(lambda: (pool.get(grown.id).used_memory or GIB * 99) <= GIB, what="A's use down to 1 GiB")
        await asyncio.sleep(1.0)  # the tick has reported that cell's activity
        idle_since = pool.get(grown.id).last_activity
        pool.set_preference("alice", memory="12GiB")
        asked = time.monotonic()
        b = await start_kernel(gpupool_fetch)
        lease_b = await gpupool_wait(lambda: (l := pool.lease_for_kernel(b)) and l.state is LeaseState.GRANTED and l,
                                     timeout=45, what="kernel B's 12 GiB")
        waited = time.monotonic() - asked
        assert lease_b.memory == 12 * GIB and waited < 30  # the one-rule issue's bound: within 30 s
        back = pool.get(grown.id)
        assert back.state is LeaseState.GRANTED and back.guarantee == 2 * GIB and back.memory <= 4 * GIB
        # Taken back for B, or given back by A itself once its use had dropped (whichever came first).
        assert back.burst_note.startswith(("burst taken back", "gave its burst back")), back.burst_note
        # A's caps were moved down by the server through the quiet channel: no activity for A.
        await gpupool_wait(lambda: gpupool_ext._caps_sent.get(grown.id) == back.memory, what="A's caps request sent")
        await asyncio.sleep(1.5)
        assert pool.get(grown.id).last_activity == idle_since
        async def caps_of_a_followed() -> bool:
            out = await kernel_exec(a, "import jupyter_gpupool.kernel as k\nprint(k.get_caps().limit)")
            return int(out) == pool.get(grown.id).memory

        await gpupool_wait(caps_of_a_followed, timeout=10, what="A's caps lowered to its slice")

    arun(scenario())


def test_a_caps_move_the_kernel_refuses_is_one_warning_with_its_reason(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    """A kernel that answers the server's caps move with an error (a framework that cannot change its
    cap, a kernel of another version) keeps its slice: the server logs one warning per move, saying why."""
    pool = gpupool_ext.pool
    refuse = (
        "from jupyter_gpupool.quiet import install_quiet_requests\n"
        "def refuse(content):\n    raise RuntimeError('this framework cannot move its cap')\n"
        "install_quiet_requests(get_ipython().kernel, {'set_caps': refuse})\n"
    )
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "could not move the caps" in record.getMessage():
                lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    gpupool_ext.log.addHandler(handler)

    async def scenario() -> None:
        a = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED, what="kernel A's slice")
        await kernel_exec(a, refuse)
        await kernel_exec(a, USE + "pretend_to_use('6GiB')")
        grown = pool.lease_for_kernel(a)
        assert grown.memory >= 6 * GIB and grown.state is LeaseState.GRANTED
        await gpupool_wait(lambda: lines, timeout=30, what="the server's warning")
        await asyncio.sleep(1.0)  # a second copy of a line would be logged by now
        assert len(lines) == len(set(lines)), lines  # one line per move (each to its own size)
        for line in lines:
            assert line.startswith(f"gpupool: could not move the caps of kernel {a} to ")
            assert line.endswith(" GiB: RuntimeError: this framework cannot move its cap"), line
        assert pool.get(grown.id).state is LeaseState.GRANTED

    try:
        arun(scenario())
    finally:
        gpupool_ext.log.removeHandler(handler)
