"""Scripted usage on a simulated pool: a kernel pretends to hold GPU memory and the watchdog,
REST and the sidebar's data see it (for demos, Binder and browser tests)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import pytest
from test_server_extension import kernel_state, start_kernel

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer
from jupyter_gpupool.devices.simulated import SimulatedBackend, pretend_to_use
from jupyter_gpupool.errors import InvalidInput

pytestmark = [pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")]


def test_a_process_scripts_its_usage_and_it_goes_with_the_process(tmp_path):
    db = str(tmp_path / "pool.sqlite")
    pool = Pool.from_env(environ={"GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": db})
    uuid = pool.devices()[0].uuid
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": db, "CUDA_VISIBLE_DEVICES": uuid}
    child = subprocess.Popen(
        [sys.executable, "-c", "from jupyter_gpupool.devices.simulated import pretend_to_use; import sys, time; "
         "pretend_to_use('3GiB'); print('ok', flush=True); sys.stdin.read()"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert child.stdout.readline().strip() == "ok"
    usage = pool.backend.process_usage()
    assert [(u.pid, u.device_uuid, u.used_memory) for u in usage] == [(child.pid, uuid, 3 * 1024**3)]
    assert pool.backend.devices()[0].memory_free == 13 * 1024**3
    child.stdin.close()
    child.wait(10)
    assert pool.backend.process_usage() == []  # a dead process holds nothing


def test_pretend_to_use_outside_a_simulated_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("GPUPOOL_SIMULATE", raising=False)
    with pytest.raises(InvalidInput, match="only in a kernel on a simulated pool"):
        pretend_to_use("1GiB")
    monkeypatch.setenv("GPUPOOL_SIMULATE", "1x16GiB")
    monkeypatch.setenv("GPUPOOL_DB", "/tmp/x.sqlite")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(InvalidInput, match="holds no GPU slice"):
        pretend_to_use("1GiB")
    assert isinstance(SimulatedBackend.from_spec("1x16GiB").usage_dir, type(None))


def test_kernel_usage_reaches_rest_through_the_watchdog(arun, jp_serverapp, gpupool_fetch, gpupool_wait, kernel_exec):
    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: _granted(gpupool_fetch, kernel_id), what="a grant")
        out = await kernel_exec(kernel_id, "from jupyter_gpupool.devices.simulated import pretend_to_use\nprint(pretend_to_use('3GiB'))")
        assert out.strip() == str(3 * 1024**3)

        async def seen() -> dict | None:
            state = await kernel_state(gpupool_fetch, kernel_id)
            return state if state["used_memory"] == 3 * 1024**3 else None

        state = await gpupool_wait(seen, what="the watchdog to see the kernel's usage")
        assert state["peak_memory"] == 3 * 1024**3
        pool = json.loads((await gpupool_fetch("api", "gpupool", "pool")).body)
        assert pool["devices"][0]["memory_used"] >= 3 * 1024**3

    async def _granted(fetch, kernel_id):
        return (await kernel_state(fetch, kernel_id))["state"] == "granted"

    arun(scenario())


def test_a_suspended_kernel_blocks_in_its_cell_until_resumed(arun, jp_serverapp, gpupool_fetch, gpupool_wait, kernel_exec):
    """The simulated checkpointer with a real server kernel: suspending parks its usage (the pool
    sees the GPU freed), a cell that touches the GPU waits, and it finishes once resumed."""

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: _granted(gpupool_fetch, kernel_id), what="a grant")
        info = json.loads(
            await kernel_exec(
                kernel_id,
                "import json, os\nfrom jupyter_gpupool.devices.simulated import pretend_to_use, usage_dir_for\n"
                "pretend_to_use('2GiB')\nprint(json.dumps({'pid': os.getpid(), 'dir': usage_dir_for(os.environ['GPUPOOL_DB'])}))",
            )
        )
        checkpointer = SimulatedCheckpointer(info["dir"])
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, checkpointer.suspend, info["pid"]) == 2 * 1024**3

        async def device_used(expected: int) -> bool:
            pool = json.loads((await gpupool_fetch("api", "gpupool", "pool")).body)
            return pool["devices"][0]["memory_used"] == expected

        await gpupool_wait(lambda: device_used(0), what="the pool to see the parked memory freed")
        cell = asyncio.ensure_future(
            kernel_exec(
                kernel_id, "import time\npretend_to_use('3GiB')\nprint(time.time())"
            )
        )
        await asyncio.sleep(1.5)
        assert not cell.done(), "the cell ran on while its kernel was suspended"
        resumed_at = time.time()
        await loop.run_in_executor(None, checkpointer.resume, info["pid"])
        went_on_at = float((await asyncio.wait_for(cell, 30)).strip())
        assert went_on_at >= resumed_at - 0.05  # the cell went on only once resumed
        await gpupool_wait(lambda: device_used(3 * 1024**3), what="the pool to see the kernel's usage again")

    async def _granted(fetch, kernel_id):
        return (await kernel_state(fetch, kernel_id))["state"] == "granted"

    arun(scenario())
