"""The quiet channel against a real jupyter_server and real kernels: the ``PoolStatus`` widget shown
in a front end keeps refreshing, yet its kernel goes idle and idle reclaim takes it; a request the
server marks quiet makes the kernel busy for jupyter_server, not for the pool's idle clock."""

from __future__ import annotations

import asyncio
import datetime
import json
import time
from typing import Any

import pytest
from jupyter_client.session import Session
from server_kernels import start_kernel
from tornado.httpclient import HTTPRequest
from tornado.websocket import WebSocketClientConnection, websocket_connect

from jupyter_gpupool.quiet import QUIET_KEY, ActivityClocks, is_quiet, mark_quiet

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

SHOW_WIDGET = "from jupyter_gpupool.widget import PoolStatus\nw = PoolStatus(interval=0.25)\ndisplay(w)\n"


class FrontEnd:
    """What a browser tab does with a kernel: one websocket on ``/api/kernels/ID/channels``
    (jupyter_server's JSON protocol), execute requests out, every message in."""

    def __init__(self, ws: WebSocketClientConnection) -> None:
        self.ws = ws
        self.session = Session()
        self.messages: list[dict[str, Any]] = []
        self.closed = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, port: int, base_url: str, kernel_id: str, token: str) -> FrontEnd:
        url = f"ws://127.0.0.1:{port}{base_url}api/kernels/{kernel_id}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}, connect_timeout=60))
        return cls(ws)

    async def _read(self) -> None:
        while (text := await self.ws.read_message()) is not None:
            if isinstance(text, str):
                self.messages.append(json.loads(text))
        if not self.closed.done():
            self.closed.set_result(True)

    async def execute(self, code: str, timeout: float = 60) -> list[dict[str, Any]]:
        """Run a cell as a notebook does; the messages it caused, once the kernel is idle again."""
        msg = self.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
        msg["channel"] = "shell"
        msg_id = msg["header"]["msg_id"]
        await self.ws.write_message(json.dumps(msg, default=str))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mine = [m for m in self.messages if m.get("parent_header", {}).get("msg_id") == msg_id]
            if any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle" for m in mine):
                errors = [m for m in mine if m["msg_type"] == "error"]
                assert not errors, errors
                return mine
            await asyncio.sleep(0.05)
        raise AssertionError(f"the cell {code!r} did not finish in {timeout} s")

    def widget_updates(self, since: int = 0) -> list[dict[str, Any]]:
        return [m for m in self.messages[since:] if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"]

    def close(self) -> None:
        self.ws.close()
        self._reader.cancel()


async def kernel_state(fetch: Any, kernel_id: str) -> dict[str, Any]:
    response = await fetch("api", "gpupool", "kernels", kernel_id)
    assert response.code == 200, response.body
    return dict(json.loads(response.body))


@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="2", GPUPOOL_WARNING_PERIOD="1", GPUPOOL_IDLE_POLICY="always",
                         GPUPOOL_RECLAIM_ACTION="cull")
def test_a_kernel_showing_the_widget_goes_idle_and_is_reclaimed(
    arun: Any, jp_serverapp: Any, jp_http_port: int, jp_base_url: str, gpupool_fetch: Any, gpupool_wait: Any,
    gpupool_ext: Any, gpupool_tokens: dict[str, str],
) -> None:
    async def scenario() -> None:
        kernel_id = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: kernel_id in jp_serverapp.kernel_manager
                           and jp_serverapp.kernel_manager.get_kernel(kernel_id).ready.done(), what="the kernel to start")
        front_end = await FrontEnd.connect(jp_http_port, jp_base_url, kernel_id, gpupool_tokens["alice"])
        try:
            shown = await front_end.execute(SHOW_WIDGET)
            views = [m for m in shown if m["msg_type"] == "display_data"
                     and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
            assert views, [m["msg_type"] for m in shown]
            after_cell = len(front_end.messages)
            lease_id = (await kernel_state(gpupool_fetch, kernel_id))["lease_id"]

            # No cells from here on; the tab stays open and the widget keeps refreshing it.
            def idle_for() -> float:
                return float(gpupool_ext.pool.get(lease_id).idle_seconds(time.time()))

            await gpupool_wait(lambda: idle_for() > 2.5 or gpupool_ext.pool.get(lease_id).state.value == "released",
                               timeout=20, what="the pool to see the kernel idle past its timeout")
            updates = front_end.widget_updates(since=after_cell)
            assert len(updates) >= 2, "the widget stopped refreshing: this test would prove nothing"
            assert all(u["metadata"].get(QUIET_KEY) for u in updates), updates[:2]

            await gpupool_wait(lambda: gpupool_ext.pool.get(lease_id).state.value == "released", timeout=20,
                               what="idle reclaim to take the kernel showing the widget")
            lease = gpupool_ext.pool.get(lease_id)
            assert lease.release_reason.startswith("reclaimed: idle"), lease.release_reason
            await gpupool_wait(lambda: kernel_id not in jp_serverapp.kernel_manager, what="the reclaimed kernel to be culled")
            assert len(front_end.widget_updates(since=after_cell)) > len(updates) or front_end.closed.done()
        finally:
            front_end.close()

    arun(scenario())


def test_a_quiet_request_is_no_activity_for_the_pool(arun: Any, jp_serverapp: Any, gpupool_fetch: Any, gpupool_wait: Any) -> None:
    """The server → kernel half: the kernel goes busy and idle for a marked request, jupyter_server's
    last_activity moves, the pool's clock does not; the same request unmarked moves it."""
    km = jp_serverapp.kernel_manager

    async def send_and_settle(client: Any, clocks: ActivityClocks, kernel_id: str, quiet: bool) -> tuple[bool, bool]:
        kernel = km.get_kernel(kernel_id)
        clock = clocks.clock(kernel_id)
        assert clock is not None
        before_server, before_pool = kernel.last_activity, clock.last_activity
        await asyncio.sleep(0.05)
        # What freeing caches before a checkpoint will send: silent code, no history, no output.
        msg = client.session.msg("execute_request", {"code": "import gc; gc.collect()", "silent": True, "store_history": False,
                                                     "user_expressions": {}, "allow_stdin": False, "stop_on_error": False})
        if quiet:
            mark_quiet(msg)
        client.shell_channel.send(msg)
        while True:  # the kernel's own iopub: its busy/idle for this request
            reply = await client.get_iopub_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"] and reply["msg_type"] == "status" \
                    and reply["content"]["execution_state"] == "idle":
                assert is_quiet(reply) is quiet
                break
        await asyncio.sleep(0.5)  # both subscriptions have read the same messages by now
        return kernel.last_activity > before_server, clock.last_activity > before_pool

    async def scenario() -> None:
        kernel_id = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: kernel_id in km and km.get_kernel(kernel_id).ready.done(), what="the kernel to start")
        clocks = ActivityClocks(km)
        client = km.get_kernel(kernel_id).client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
            assert clocks.clock(kernel_id) is not None
            await client.execute_interactive("pass", timeout=60)
            await asyncio.sleep(1)  # what the kernel says as it starts up has been said
            assert await send_and_settle(client, clocks, kernel_id, quiet=True) == (True, False)
            assert await send_and_settle(client, clocks, kernel_id, quiet=False) == (True, True)
            clock = clocks.clock(kernel_id)
            assert clock is not None and clock.execution_state == "idle" and clock.quiet_messages >= 2
            assert isinstance(clock.last_activity, datetime.datetime)
        finally:
            client.stop_channels()
            clocks.close()

    arun(scenario())
