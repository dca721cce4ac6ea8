"""Voilà on a full pool, as a server extension and standalone: every viewer is served, in queue order.

Voilà 0.5.13 is pip-installed into an environment of its own over this one (its server extension
loads only there). Each mode runs one server for the module on a simulated ``1x16GiB`` pool with
8 GiB slices, and headless Chromium (Playwright from the lab extension's ``node_modules``, the
system's Chromium) opens the pages: 5 viewers on 2 slices. The 2 first are served; the 3 others
wait and their pages say where they stand; the last one is closed while it waits, and its
request is withdrawn; then each served page closed (Voilà shuts its kernel down) serves the next
viewer in the pool's queue order. Every lease is ``normal``: a person watches a dashboard.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nbformat
import pytest
from envs import Environment, environment_over_this_one
from server_process import free_port, stop_process

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Lease, LeaseState, PriorityClass
from jupyter_gpupool.kernel.autolease import AutoLease

REPO = Path(__file__).resolve().parent.parent
VOILA = "voila==0.5.13"
CHROMIUM = Path(os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium"))
NODE_MODULES = REPO / "labextension" / "node_modules"
MANAGER = "jupyter_gpupool.serverextension.voila.PooledVoilaKernelManager"
SERVED = "dash value 42"
#: Seconds a kernel with no page connected may be idle before the culler shuts it down: longer than the
#: test, so a slice freed here was freed by the page itself, as it unloaded.
CULL_IDLE = 120

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian chromium (.ci/run installs it)"),
    pytest.mark.skipif(
        shutil.which("node") is None or not (NODE_MODULES / "playwright-core").is_dir(),
        reason="needs node and `npm ci` in labextension/ (Playwright drives Chromium)",
    ),
]

#: Drives headless Chromium: one JSON command a line on stdin, one JSON answer a line on stdout.
#: Each viewer is a browser context of its own (its own connections, as another person's browser).
DRIVER = r"""
const { chromium } = require('playwright-core');
const readline = require('readline');
(async () => {
  const browser = await chromium.launch({ executablePath: process.env.CHROMIUM_PATH, args: ['--no-sandbox'] });
  const viewers = {};
  const answer = (o) => process.stdout.write(JSON.stringify(o) + '\n');
  for await (const line of readline.createInterface({ input: process.stdin })) {
    const c = JSON.parse(line);
    try {
      if (c.op === 'open') {
        const context = await browser.newContext();
        const page = await context.newPage();
        viewers[c.name] = { context, page };
        page.goto(c.url, { waitUntil: 'commit', timeout: 0 }).catch(() => {});
        answer({ ok: true });
      } else if (c.op === 'text') {
        const v = viewers[c.name];
        const text = await v.page.evaluate(() => (document.body ? document.body.innerText : '')).catch(() => '');
        answer({ text });
      } else if (c.op === 'close') {
        const v = viewers[c.name];
        delete viewers[c.name];
        if (c.unload) { await v.page.close({ runBeforeUnload: true }); }
        await v.context.close();
        answer({ ok: true });
      } else if (c.op === 'quit') {
        await browser.close();
        answer({ ok: true });
        process.exit(0);
      }
    } catch (e) { answer({ error: String(e) }); }
  }
})();
"""


class Browser:
    """Headless Chromium with named viewers (see :data:`DRIVER`)."""

    def __init__(self, folder: Path) -> None:
        script = folder / "driver.js"
        script.write_text(DRIVER)
        env = {**os.environ, "NODE_PATH": str(NODE_MODULES), "CHROMIUM_PATH": str(CHROMIUM)}
        self.proc = subprocess.Popen(["node", str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def ask(self, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline() or '{"error": "the browser driver exited"}')
        assert "error" not in answer, answer
        return answer

    def text(self, name: str) -> str:
        return str(self.ask(op="text", name=name)["text"])

    def wait_for_text(self, name: str, words: str, timeout: float) -> float:
        """Wait until viewer ``name``'s page shows ``words``; return when (monotonic)."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.text(name)
            if words in text:
                return time.monotonic()
            time.sleep(0.2)
        raise AssertionError(f"viewer {name}'s page never showed {words!r} in {timeout:.0f} s; it shows: {text[-400:]!r}")

    def stop(self) -> None:
        try:
            self.ask(op="quit")
            self.proc.wait(10)
        except Exception as err:  # noqa: BLE001 - a driver that already died: killed below
            print(f"the browser driver did not quit: {err}")
        stop_process(self.proc)


@pytest.fixture(scope="module")
def voila_env(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """Voilà in an environment of its own over this one, made once for the module."""
    try:
        return environment_over_this_one(tmp_path_factory.mktemp("voila") / "venv", packages=[VOILA])
    except RuntimeError as err:
        # CI and every developer machine reach the package index: a failed install is a failure, never a quiet skip.
        pytest.fail(f"{VOILA} could not be installed from the package index: {str(err)[:300]}")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    chromium = Browser(tmp_path_factory.mktemp("browser"))
    yield chromium
    chromium.stop()


class VoilaServer:
    """Voilà serving ``dash.ipynb`` on a fresh simulated pool: ``mode`` ``extension`` (a Jupyter
    server with the pool's extension and Voilà's) or ``standalone`` (``voila dash.ipynb`` with the
    pool's kernel manager)."""

    def __init__(self, env: Environment, folder: Path, mode: str, cull_idle: int = CULL_IDLE, simulate: str = "1x16GiB") -> None:
        self.mode = mode
        self.port = free_port()
        nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
        nb.cells = [nbformat.v4.new_code_cell("value = 6 * 7"), nbformat.v4.new_code_cell("print(f'dash value {value}')")]
        nbformat.write(nb, folder / "dash.ipynb")
        self.pool_env = {"GPUPOOL_DB": str(folder / "pool.sqlite"), "GPUPOOL_SIMULATE": simulate,
                         "GPUPOOL_DEFAULT_MEMORY": "8GiB", "GPUPOOL_USER": "alice"}  # fmt: skip
        environ = env.variables()
        for name in [name for name in environ if name.startswith(("GPUPOOL_", "VOILA_"))]:
            del environ[name]
        environ.update(
            self.pool_env,
            JUPYTER_CONFIG_DIR=str(folder / "config"),
            JUPYTER_RUNTIME_DIR=str(folder / "runtime"),
            # Voilà's templates first, then this interpreter's (nbconvert's, which Voilà's extend).
            JUPYTER_PATH=os.pathsep.join([str(env.root / "share" / "jupyter"), str(Path(sys.prefix) / "share" / "jupyter")]),
        )
        environ.pop("JUPYTER_DEFAULT_PROVISIONER_NAME", None)
        # docs/voila.md's culling settings: the fallback for a browser that vanishes without unloading its page.
        culling = [f"--MappingKernelManager.cull_idle_timeout={cull_idle}", "--MappingKernelManager.cull_interval=1"]
        if mode == "extension":
            self.token = "voila-test-token"
            self.url = f"http://127.0.0.1:{self.port}/voila/render/dash.ipynb?token={self.token}"
            command = [str(env.python), "-m", "jupyter_server", f"--port={self.port}", "--no-browser", "--allow-root",
                       f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={folder}",
                       "--ServerApp.jpserver_extensions={'jupyter_gpupool': True, 'voila': True, 'jupyter_server_terminals': False}",
                       *culling]  # fmt: skip
        else:
            self.url = f"http://127.0.0.1:{self.port}/"
            command = [str(env.python), "-m", "voila", str(folder / "dash.ipynb"), f"--port={self.port}", "--no-browser",
                       "--Voila.ip=127.0.0.1", f"--VoilaConfiguration.multi_kernel_manager_class={MANAGER}", *culling]  # fmt: skip
        self.log_path = folder / "server.log"
        self.log = open(self.log_path, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(command, env=environ, cwd=folder, stdout=self.log, stderr=subprocess.STDOUT)
        self.pool = Pool.from_env(environ=self.pool_env)
        deadline = time.monotonic() + 90
        while not self.listening():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log_path.read_text()[-3000:]
            time.sleep(0.3)

    def listening(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def leases(self) -> list[Lease]:
        return self.pool.leases(include_released=True)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


@pytest.fixture(scope="module", params=["extension", "standalone"])
def voila_server(request: pytest.FixtureRequest, voila_env: Environment, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VoilaServer]:
    server = VoilaServer(voila_env, tmp_path_factory.mktemp(f"voila-{request.param}"), request.param)
    yield server
    server.stop()
    log = without_closed_socket_writes(server.log_path.read_text(errors="replace"))
    assert "Traceback" not in log, f"a page's wait, withdrawal or the server's stop logged a traceback:\n{log[-4000:]}"


#: jupyter_server's kernel websocket does not await its writes: one that meets a page already gone
#: is logged by asyncio as a task exception nobody retrieved (tornado's WebSocketClosedError).
CLOSED_SOCKET_WRITE = re.compile(
    r"Task exception was never retrieved\nfuture: <Task finished name='[^']*' coro=<WebSocketProtocol13\.write_message"
    r".*?\ntornado\.websocket\.WebSocketClosedError\n",
    re.DOTALL,
)


#: The same write made at once, from the kernel's message callback: logged by pyzmq's stream (and
#: tornado's callback runner) with the WebSocketClosedError that tornado's write_message raised.
CLOSED_SOCKET_CALLBACK_WRITE = re.compile(
    r"[^\n]*(?:exception in zmqstream callback|exception in callback functools\.partial\(<function ZMQStream\.)[^\n]*\n"
    r"Traceback \(most recent call last\):\n(?:[ \t][^\n]*\n)*?[ \t]+raise WebSocketClosedError\(\)\n"
    r"tornado\.websocket\.WebSocketClosedError\n",
    re.IGNORECASE,
)


def without_closed_socket_writes(log: str) -> str:
    """The server's log less the upstream lines above: a viewer that leaves mid-write is no fault of the pool's."""
    return CLOSED_SOCKET_CALLBACK_WRITE.sub("", CLOSED_SOCKET_WRITE.sub("", log))


def lease_of_new_request(server: VoilaServer, known: set[str], timeout: float = 60) -> Lease:
    """The lease a viewer just asked for (one not in ``known``), once the pool has it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        new = [lease for lease in server.leases() if lease.id not in known]
        if new:
            known.add(new[0].id)
            return new[0]
        time.sleep(0.2)
    raise AssertionError(f"no new lease in {timeout:.0f} s:\n{server.log_path.read_text()[-3000:]}")


def wait_until_page_connected(server: VoilaServer, lease: Lease, timeout: float = 30) -> None:
    """Wait until the served page's own kernel websocket is open (the server logs "Connecting to
    kernel"). A page closed while its websocket still waits for the kernel's first reply makes
    jupyter_server log a traceback of its own (jupyter-server/jupyter_server#1265), whoever runs
    the kernel; a viewer reading the page is long past that moment, so the test waits for it too."""
    kernel_id = server.pool.get(lease.id).kernel_id
    assert kernel_id, f"lease {lease.id} names no kernel"
    deadline = time.monotonic() + timeout
    while f"Connecting to kernel {kernel_id}." not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"the page of kernel {kernel_id} opened no websocket in {timeout:.0f} s"
        time.sleep(0.1)


def test_five_viewers_on_two_slices_wait_in_view_of_their_place_and_are_served_in_queue_order(
    voila_server: VoilaServer, browser: Browser
) -> None:
    """v1, v2 served; v3, v4, v5 wait, each page showing its position; v5 closed: withdrawn within
    15 s; v1's page closed: v3 served, then v2's: v4 served (the pool's queue order)."""
    server, mode = voila_server, voila_server.mode
    known: set[str] = set()
    viewers = [f"{mode}-v{i}" for i in range(1, 6)]
    opened: dict[str, float] = {}
    leases: dict[str, Lease] = {}
    try:
        for name in viewers[:2]:
            opened[name] = time.monotonic()
            browser.ask(op="open", name=name, url=server.url)
            leases[name] = lease_of_new_request(server, known)
        served = {name: browser.wait_for_text(name, SERVED, 60) for name in viewers[:2]}
        for place, name in enumerate(viewers[2:], start=1):
            opened[name] = time.monotonic()
            browser.ask(op="open", name=name, url=server.url)
            leases[name] = lease_of_new_request(server, known)
            assert leases[name].state is LeaseState.QUEUED
            browser.wait_for_text(name, f"Waiting for a GPU: position {place} of {place}", 30)
        shown = {name: browser.wait_for_text(name, f"position {place} of 3", 10) for place, name in enumerate(viewers[2:], start=1)}
        assert all(when for when in shown.values())
        assert all(lease.priority is PriorityClass.NORMAL for lease in leases.values()), [(lease.id, lease.priority) for lease in leases.values()]

        left = viewers[4]
        closed_at = time.monotonic()
        browser.ask(op="close", name=left)
        while server.pool.get(leases[left].id).state is not LeaseState.RELEASED:
            assert time.monotonic() - closed_at < 15, f"{left}'s request was not withdrawn within 15 s of its page closing"
            time.sleep(0.1)
        withdrawn_after = time.monotonic() - closed_at
        assert "Voilà page was closed" in server.pool.get(leases[left].id).release_reason
        browser.wait_for_text(viewers[3], "position 2 of 2", 10)

        freed_at: dict[str, float] = {}
        for served_one, waiting in ((viewers[0], viewers[2]), (viewers[1], viewers[3])):
            wait_until_page_connected(server, leases[served_one])
            freed_at[waiting] = time.monotonic()
            browser.ask(op="close", name=served_one, unload=True)  # Voilà's page asks for its kernel's shutdown
            served[waiting] = browser.wait_for_text(waiting, SERVED, 60)
            assert "Waiting for a GPU" not in browser.text(waiting)
        assert served[viewers[2]] < served[viewers[3]]
        assert "Culling '" not in server.log_path.read_text(errors="replace"), "each slice was freed by its page, not the culler"
        queued = [leases[name] for name in viewers[2:4]]
        assert queued[0].created_at < queued[1].created_at
        granted = [server.pool.get(lease.id).granted_at or 0.0 for lease in queued]
        assert 0 < granted[0] <= granted[1]
        print(f"\n{mode}: served after opening: "
              + ", ".join(f"{name[-2:]} {served[name] - opened[name]:.1f} s" for name in viewers[:4])
              + "; after its slice freed: " + ", ".join(f"{name[-2:]} {served[name] - freed_at[name]:.1f} s" for name in freed_at)
              + f"; waiting page closed → withdrawn in {withdrawn_after:.2f} s")  # fmt: skip
        for name in viewers[2:4]:
            wait_until_page_connected(server, leases[name])
    finally:
        for name in viewers:
            try:
                browser.ask(op="close", name=name, unload=True)
            except AssertionError:
                pass  # already closed


def test_a_voila_kernel_leases_as_a_person_watching_when_it_leases_for_itself() -> None:
    """Standalone Voilà without the pool's kernel manager: its kernels lease through the kernel hook,
    as ``normal`` (Voilà puts ``VOILA_BASE_URL`` in their environment); other batch kernels stay ``batch``."""
    assert AutoLease(environ={"VOILA_BASE_URL": "/", "VOILA_PREHEAT": "False"}).priority == "normal"
    assert AutoLease(environ={}).priority == "batch"


async def test_a_page_kernel_waiting_for_its_gpu_is_listed_starting_so_the_culler_passes_it_quietly(tmp_path: Path) -> None:
    """While a page's kernel waits in its start it is already listed; jupyter_server's culler, which
    may pass at that moment, must find it starting with a last activity (it logged a TraitError
    traceback for a kernel without one), and must not cull it."""
    from jupyter_gpupool.serverextension.voila import PooledVoilaKernelManager

    manager = PooledVoilaKernelManager(cull_idle_timeout=1, cull_busy=False)
    kernel_id = "0e8a1a8e-5c9e-4b7b-9d3c-0e8a1a8e5c9e"
    manager._page_starts[kernel_id] = None
    kernel, _, listed_id = manager.pre_start_kernel("python3", {"kernel_id": kernel_id})
    manager._kernels[listed_id] = kernel  # as jupyter_client lists a pending kernel while it starts
    assert manager._page_starts[kernel_id] is kernel
    assert kernel.execution_state == "starting" and kernel.last_activity is not None
    await manager.cull_kernel_if_idle(listed_id)  # raised TraitError before (last_activity unset)
    assert listed_id in manager._kernels


async def test_the_culler_passes_by_a_page_kernel_whose_start_is_under_way_however_long_it_waited() -> None:
    """A page's kernel listed while its start is still under way (jupyter_client lists it once
    granted, before the start returns; or at once, as a pending kernel), its start begun 5 minutes
    ago, well past ``cull_idle_timeout``: the culler's pass neither culls it nor waits on its start,
    and its idle time starts over (it counts from the moment the start ends). Once the start ended,
    the usual rule culls it: the test above, with a real server and pages."""
    from jupyter_gpupool.serverextension.voila import PooledVoilaKernelManager

    manager = PooledVoilaKernelManager(cull_idle_timeout=1, cull_busy=False)
    kernel_id = "5d1c3e0a-7f4b-4c6e-9a2d-5d1c3e0a7f4b"
    manager._page_starts[kernel_id] = None
    kernel, _, listed_id = manager.pre_start_kernel("python3", {"kernel_id": kernel_id})
    manager._kernels[listed_id] = kernel
    manager._kernel_connections[listed_id] = 0
    start: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the page's start, not ended
    manager._pending_kernels[listed_id] = start
    began = kernel.last_activity - timedelta(minutes=5)
    kernel.last_activity = began
    try:
        await asyncio.wait_for(manager.cull_kernels(), 60)  # a pass that waited on the start would never end
        assert listed_id in manager._kernels and not start.done(), "the culler culled a page's kernel still starting"
        assert kernel.last_activity > began, "its idle time still counts from before its wait"
    finally:
        if not start.done():
            start.cancel()
