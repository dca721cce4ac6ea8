"""Before a checkpoint the kernel frees its frameworks' cached GPU memory, asked on the quiet channel.

Real jupyter_server and ipykernel kernels on a simulated pool. The framework is played by a
freer the test registers in the kernel (``register_cache_freer``), as PyTorch's ``empty_cache``
would report on a GPU. The request is not a cell and not activity (the pool's idle clock does not
move), goes on the kernel's control channel, and cannot deadlock with a cell sent while the
suspend is under way (that cell waits for the resume, and the request is answered meanwhile).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from server_kernels import start_running_kernel

from jupyter_gpupool.core.models import LeaseState, Transition
from jupyter_gpupool.enforcement import caps
from jupyter_gpupool.enforcement.caps import free_framework_caches, register_cache_freer
from jupyter_gpupool.units import GIB

pytestmark = [pytest.mark.slow, pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")]


def test_a_suspend_frees_the_kernels_caches_first_quietly_and_the_sidebar_sees_it(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        await kernel_exec(
            kernel,
            "x = 42\nfrom jupyter_gpupool.enforcement import caps as caches\n"
            f"caches.register_cache_freer('framework', lambda: {{'freed': {GIB}, 'held': {3 * GIB}}})",
        )
        clock = await gpupool_wait(lambda: gpupool_ext._activity_clocks.clock(kernel), what="the pool's idle clock")
        await asyncio.sleep(0.5)  # the clock has seen the cell's last message
        idle_since, quiet_before = clock.last_activity, clock.quiet_messages

        response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
        assert response.code == 200, response.body
        await gpupool_wait(lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, what="the suspend")
        status = json.loads((await gpupool_fetch("api", "gpupool", "kernels", kernel)).body)
        assert status["parking"]["cache_freed"] == GIB and status["parking"]["held"] == 3 * GIB, status
        await asyncio.sleep(0.5)
        assert clock.quiet_messages > quiet_before, "the request's busy/idle went unseen"
        assert clock.last_activity == idle_since, "asking the kernel to free its caches counted as activity"

        out = await kernel_exec(kernel, "print(x, caches.requests_served)")
        assert out.split() == ["42", "1"], out
        resumed = json.loads((await gpupool_fetch("api", "gpupool", "kernels", kernel)).body)
        assert resumed["state"] == "granted" and resumed["parking"] is None

    arun(scenario())


def test_a_cell_sent_while_the_kernel_frees_its_caches_for_a_suspend_does_not_deadlock(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        await kernel_exec(
            kernel,
            "x = 42\nimport time\nfrom jupyter_gpupool.enforcement import caps as caches\n"
            "caches.register_cache_freer('slow', lambda: (time.sleep(2), {'freed': 0})[1])",
        )
        response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
        assert response.code == 200, response.body
        started = time.monotonic()
        # Sent while the kernel frees its caches: the cell waits for the suspend and then the resume,
        # the request is answered on the control channel meanwhile.
        out = await asyncio.wait_for(kernel_exec(kernel, "print(x, caches.requests_served)"), 30)
        assert out.split() == ["42", "1"], out
        assert time.monotonic() - started < 30
        lease = pool.lease_for_kernel(kernel)
        assert lease.state is LeaseState.GRANTED and lease.transition is Transition.NONE and lease.suspensions == 1

    arun(scenario())


@pytest.mark.gpupool_config({"GpuPoolExtension": {"free_caches_timeout": 0.0}})
def test_free_caches_timeout_zero_never_asks(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        await kernel_exec(kernel, "from jupyter_gpupool.enforcement import caps as caches")
        await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
        await gpupool_wait(lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, what="the suspend")
        assert (await kernel_exec(kernel, "print(caches.requests_served)")).strip() == "0"

    arun(scenario())


def test_free_framework_caches_reports_each_framework_and_survives_one_that_fails() -> None:
    register_cache_freer("fine", lambda: {"freed": 5, "held": 7})

    def broken() -> dict[str, int]:
        raise RuntimeError("driver said no\nsecond line")

    register_cache_freer("broken", broken)
    try:
        report = free_framework_caches()
    finally:
        caps._extra_freers.pop("fine", None)
        caps._extra_freers.pop("broken", None)
    assert report["freed"] >= 5 and report["held"] >= 7
    assert report["frameworks"]["fine"] == {"freed": 5, "held": 7}
    assert report["frameworks"]["broken"] == {"error": "RuntimeError: driver said no"}


def test_lowering_caps_and_parking_free_the_caches_through_the_same_freer() -> None:
    calls: list[str] = []
    register_cache_freer("counted", lambda: (calls.append("freed"), {"freed": 3})[1])
    try:
        served = caps.requests_served
        report = caps.FrameworkCaps(None, env={}).move_live({"limit": GIB, "free_cache": True})
        assert calls == ["freed"] and caps.requests_served == served + 1, report
        assert caps.FrameworkCaps(None, env={}).free_cache()["frameworks"]["counted"] == {"freed": 3}
    finally:
        caps._extra_freers.pop("counted", None)
