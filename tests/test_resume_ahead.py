"""``POST /api/gpupool/kernels/{id}/resume {"ahead": true}``: the front end's resume ahead of a cell.

Real jupyter_server and kernels on a simulated pool: the owner's resume ahead restores a suspended
kernel on a free GPU before any cell runs; an admin may not ask it for someone else (403); a bad
value is a 400 that changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from server_kernels import start_running_kernel

from jupyter_gpupool.core.models import Activity, LeaseState, Transition
from jupyter_gpupool.serverextension.transitions import got_work

pytestmark = [pytest.mark.slow, pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")]


async def _suspended_kernel(gpupool_fetch: Any, gpupool_wait: Any, jp_serverapp: Any, pool: Any) -> str:
    kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
    response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
    assert response.code == 200, response.body
    await gpupool_wait(lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, what="the suspend")
    return kernel


def test_the_owners_resume_ahead_restores_before_any_cell_and_others_may_not_ask(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await _suspended_kernel(gpupool_fetch, gpupool_wait, jp_serverapp, pool)
        before = pool.lease_for_kernel(kernel)

        bad = await gpupool_fetch("api", "gpupool", "kernels", kernel, "resume", method="POST", body={"ahead": "yes"})
        assert bad.code == 400 and "expected true or false" in json.loads(bad.body)["message"]
        admin = await gpupool_fetch("api", "gpupool", "kernels", kernel, "resume", method="POST", body={"ahead": True}, user="carol")
        assert admin.code == 403 and "only its owner" in json.loads(admin.body)["message"]
        stranger = await gpupool_fetch("api", "gpupool", "kernels", kernel, "resume", method="POST", body={"ahead": True}, user="bob")
        assert stranger.code == 403
        after = pool.lease_for_kernel(kernel)
        # The kernel's heartbeat and activity clock tick on their own; everything else must stand still.
        liveness = {"heartbeat_at": before.heartbeat_at, "last_activity": before.last_activity}
        assert after.copy(**liveness) == before, "a refused resume changed the lease"

        ok = await gpupool_fetch("api", "gpupool", "kernels", kernel, "resume", method="POST", body={"ahead": True})
        assert ok.code == 200, ok.body
        await gpupool_wait(
            lambda: (lease := pool.lease_for_kernel(kernel)).state is LeaseState.GRANTED and lease.transition is Transition.NONE,
            what="the restore",
        )
        status = json.loads((await gpupool_fetch("api", "gpupool", "kernels", kernel)).body)
        assert status["state"] == "granted"
        assert [e for e in pool.events() if e["lease_id"] == before.id and e["kind"] == "grant"], "no grant recorded"

    arun(scenario())


#: A comm target in the kernel whose open, and then each message, stays busy until a file exists:
#: the kernel is busy with that request for as long as the test needs.
SLOW_COMMS = """
import os, time, comm
def _until(path):
    while not os.path.exists(path):
        time.sleep(0.05)
def _opened(c, msg):
    _until({opened!r})
    c.on_msg(lambda msg: _until({answered!r}))
comm.get_comm_manager().register_target("gpupool-test-slow", _opened)
"""


def test_a_front_end_connecting_to_a_suspended_kernel_only_looks_and_a_widget_message_resumes_it(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, tmp_path
):
    """A page that connects to a suspended kernel opens its widget manager's comm (``comm_open``):
    the kernel is busy with it, and the server's tick, which resumes a suspended kernel that got
    work, used to count any busy as work and resumed it (on a loaded host JupyterLab's connection
    came as the suspend finished: the kernel was back within 3 s, with nobody working). A widget's
    message (``comm_msg``: its callback runs the user's code) is work and resumes it."""
    pool = gpupool_ext.pool
    km = jp_serverapp.kernel_manager
    opened, answered = tmp_path / "opened", tmp_path / "answered"

    async def busy_with(client: Any, kernel: str, msg_type: str, content: dict[str, Any]) -> None:
        client.shell_channel.send(client.session.msg(msg_type, content))
        await gpupool_wait(
            lambda: (clock := gpupool_ext._activity_clocks.clock(kernel)) is not None and clock.busy_with == msg_type,
            what=f"the kernel to be busy with {msg_type}",
        )
        await gpupool_ext.watch_loops.tick_once()  # the tick that sees it busy

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        client = km.get_kernel(kernel).client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
            reply = await client.execute_interactive(SLOW_COMMS.format(opened=str(opened), answered=str(answered)), timeout=60)
            assert reply["content"]["status"] == "ok", reply["content"]
            await gpupool_ext.watch_loops.tick_once()  # the tick's activity clock follows this kernel from here
            response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
            assert response.code == 200, response.body
            await gpupool_wait(lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, what="the suspend")

            comm_id = uuid.uuid4().hex
            await busy_with(client, kernel, "comm_open", {"comm_id": comm_id, "target_name": "gpupool-test-slow", "data": {}})
            await asyncio.sleep(0.2)
            assert pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, "a front end connecting resumed the kernel"
            Path(opened).touch()

            await busy_with(client, kernel, "comm_msg", {"comm_id": comm_id, "data": {"method": "custom"}})
            await gpupool_wait(
                lambda: (lease := pool.lease_for_kernel(kernel)).state is LeaseState.GRANTED and lease.transition is Transition.NONE,
                what="a widget's message to resume the kernel",
            )
            Path(answered).touch()
        finally:
            opened.touch()
            answered.touch()
            client.stop_channels()

    arun(scenario())


@pytest.mark.parametrize(
    "busy_with, kernel_extension, work",
    [
        ("execute_request", False, True),  # a cell, and nothing in the kernel to wait for the resume
        ("execute_request", True, False),  # the kernel extension decides: %gpupool lines only look
        ("comm_msg", True, True),
        ("comm_msg", False, True),
        ("comm_open", False, False),  # a widget manager connecting
        ("complete_request", False, False),
        ("", False, True),  # not known: any work may need the GPU
        ("", True, False),
    ],
)
def test_what_a_suspended_kernel_is_busy_with_decides_whether_it_got_work(busy_with, kernel_extension, work):
    assert got_work(Activity(busy=True, busy_with=busy_with), kernel_extension) is work
    assert got_work(Activity(busy=False, busy_with=busy_with), kernel_extension) is False
    assert got_work(None, kernel_extension) is False
