"""JupyterLab's server behind a real Jupyter Kernel Gateway, the wheel installed on both sides.

The server (``jupyter server --gateway-url``, the extension loaded, a pool file of its own)
starts, runs, interrupts, restarts and shuts down kernels exactly as without the extension,
whatever its pending-kernel settings say; the kernels are pooled by the gateway host's pool
(its own pool file, admitted into kernels by ``KG_ENV_PROCESS_WHITELIST``, set up as
docs/gateways.md says: its set-up blocks are read and run here), never by the server's
and never by what a client sends; a kernel started from the server leases as ``normal``; on a
full pool it waits in its first cell, showing its place, and a DELETE withdraws its request.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import socket
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import KernelGateway, run_cell
from server_process import Server, wait_for

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState, PriorityClass
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow

SPEC = "1x16GiB"
DOC = Path(__file__).resolve().parent.parent / "docs" / "gateways.md"
#: What the gateway's clients may set, as an admin who allows too much would configure it: the
#: kernels must still be pooled by the gateway's own settings.
CLIENT_NAMES = "GPUPOOL_DB,GPUPOOL_AUTOLEASE,GPUPOOL_SIMULATE"

MODES = {
    "pending kernels (default)": (),
    "pending kernels off": ("--GpuPoolExtension.pending_kernels=False",),
    "use_pending_kernels": ("--MappingKernelManager.use_pending_kernels=True",),
}


def documented_blocks() -> list[str]:
    """The shell blocks of docs/gateways.md that this file runs (marked as run here)."""
    lines = DOC.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if "tests/test_gateway.py runs" in line and lines[i + 1].startswith("```"):
            end = lines.index("```", i + 2)
            blocks.append("\n".join(lines[i + 2 : end]))
    return blocks


def documented_gateway(root: Path) -> tuple[dict[str, str | None], tuple[str, ...]]:
    """The gateway's environment and options as docs/gateways.md sets them up (its pool file under
    ``root``; the harness picks the port)."""
    env: dict[str, str | None] = {}
    args: tuple[str, ...] = ()
    for line in documented_blocks()[0].splitlines():
        words = shlex.split(line)
        if words[:1] == ["export"]:
            for word in words[1:]:
                name, _, value = word.partition("=")
                env[name] = str(root / "gateway-pool.sqlite") if name == "GPUPOOL_DB" else value
        elif words[:2] == ["jupyter", "kernelgateway"]:
            args = tuple(w for w in words[2:] if not w.startswith(("--KernelGatewayApp.port=", "--KernelGatewayApp.ip=")))
    assert env and args, "docs/gateways.md lost its gateway set-up"
    return env, args


def documented_lab_args(gw: KernelGateway) -> tuple[str, ...]:
    """JupyterLab's options as docs/gateways.md gives them, pointed at this gateway."""
    words = shlex.split(documented_blocks()[1])
    assert words[:2] == ["jupyter", "lab"], "docs/gateways.md lost its JupyterLab line"
    return tuple(f"--gateway-url={gw.url}" if w.startswith("--gateway-url=") else w for w in words[2:])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KernelGateway]:
    root = tmp_path_factory.mktemp("gateway")
    env, args = documented_gateway(root)
    assert env["GPUPOOL_SIMULATE"] == SPEC
    # Names an admin who allows too much lets clients set: they must not count.
    env.update({"KG_ENV_WHITELIST": CLIENT_NAMES, "GPUPOOL_USER": None, "JUPYTERHUB_USER": None})
    gw = KernelGateway(root, env, args)
    gw.pool_path = root / "gateway-pool.sqlite"  # type: ignore[attr-defined]
    yield gw
    gw.stop()


def gateway_pool(gw: KernelGateway) -> Pool:
    return Pool(SimulatedBackend.from_spec(SPEC), str(gw.pool_path), PoolPolicy())  # type: ignore[attr-defined]


def lab_server(tmp: Path, gw: KernelGateway, name: str, args: tuple[str, ...] = (), extension: bool = True) -> Server:
    """Lab's server on the gateway, with a pool of its own that a client-allowed name sends along."""
    env: dict[str, str | None] = {"GPUPOOL_SIMULATE": SPEC, "GPUPOOL_DB": str(tmp / f"{name}-pool.sqlite"), "GPUPOOL_AUTOLEASE": "off"}
    if not extension:  # as `jupyter server extension disable jupyter_gpupool --user` leaves it
        config = tmp / name / "config"
        config.mkdir(parents=True, exist_ok=True)
        (config / "jupyter_server_config.json").write_text(json.dumps({"ServerApp": {"jpserver_extensions": {"jupyter_gpupool": False}}}))
    return Server(tmp, name, env, (*documented_lab_args(gw), f"--GatewayClient.allowed_envs={CLIENT_NAMES}", *args))


def answer(server: Server, method: str, path: str, body: Any = None, timeout: float = 90) -> tuple[int, Any]:
    """(status, JSON body) of a request, errors included."""
    try:
        return 200, server.call(method, path, body, timeout=timeout)
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")


def cell(server: Server, kernel_id: str, code: str, timeout: float = 120) -> tuple[str, list[str]]:
    return asyncio.run(run_cell(server.port, server.token, kernel_id, code, timeout))


def printed(shown: list[str]) -> str:
    """What a cell printed, whatever messages its stream was split into, less the pool's own lines."""
    return "".join(s for s in shown if not s.startswith("gpupool:")).strip()


def lifecycle(server: Server) -> tuple[list[tuple[str, int, Any]], str]:
    """start → cell → interrupt → restart → cell → DELETE, as Lab does; each step's (what, status,
    shape of the answer), and the kernel id."""
    steps: list[tuple[str, int, Any]] = []
    status, model = answer(server, "POST", "api/kernels", {"name": "python3"})
    steps.append(("start", status, sorted(model) if isinstance(model, dict) else model))
    assert status == 200 and isinstance(model, dict), f"the start answered {status} {model!r}"
    kernel_id = model["id"]
    reply, shown = cell(server, kernel_id, "x = 21 * 2\nprint(x)")
    steps.append(("cell", 0, (reply, printed(shown))))
    status, body = answer(server, "POST", f"api/kernels/{kernel_id}/interrupt")
    steps.append(("interrupt", status, body))
    status, body = answer(server, "POST", f"api/kernels/{kernel_id}/restart")
    steps.append(("restart", status, sorted(body) if isinstance(body, dict) else body))
    reply, shown = cell(server, kernel_id, "print('after restart', 'x' in dir())")
    steps.append(("cell after restart", 0, (reply, printed(shown))))
    return steps, kernel_id


def live_leases(pool: Pool, kernel_id: str) -> list[Any]:
    return [lease for lease in pool.leases(kernel_id=kernel_id) if lease.live]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, gateway: KernelGateway) -> list[tuple[str, int, Any]]:
    """The same steps through a server without the extension: what every mode must answer."""
    tmp = tmp_path_factory.mktemp("baseline")
    server = lab_server(tmp, gateway, "plain", extension=False)
    try:
        steps, kernel_id = lifecycle(server)
        status, _ = answer(server, "DELETE", f"api/kernels/{kernel_id}")
        steps.append(("delete", status, None))
        return steps
    finally:
        server.stop()


@pytest.mark.parametrize("mode", list(MODES))
def test_lab_behind_a_gateway_runs_kernels_as_without_the_extension_pooled_by_the_gateway(
    mode: str, tmp_path: Path, gateway: KernelGateway, baseline: list[tuple[str, int, Any]]
) -> None:
    server = lab_server(tmp_path, gateway, "lab", MODES[mode])
    try:
        steps, kernel_id = lifecycle(server)
        pool = gateway_pool(gateway)
        try:
            leases = live_leases(pool, kernel_id)
            assert len(leases) == 1, f"one live lease after the restart, not {leases}"
            lease = leases[0]
            assert lease.state is LeaseState.GRANTED and lease.priority is PriorityClass.NORMAL
            # Pooled by the gateway's pool: the lease's GPU is the one the kernel sees.
            reply, shown = cell(server, kernel_id, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
            devices = {d.uuid: d for d in pool.devices()}
            assert reply == "ok" and printed(shown) in {str(devices[u].index) for u in lease.devices} | set(lease.devices)
            # The server's own pool never heard of the kernel, and says where it runs.
            lab_pool = Pool(SimulatedBackend.from_spec(SPEC), str(tmp_path / "lab-pool.sqlite"), PoolPolicy())
            assert lab_pool.leases(kernel_id=kernel_id, include_released=True) == []
            lab_pool.close()
            status = server.call("GET", f"api/gpupool/kernels/{kernel_id}")
            assert status["gateway"] == gateway.url and status["state"] == "granted" and status["lease_id"] == lease.id

            started = time.monotonic()
            status_code, _ = answer(server, "DELETE", f"api/kernels/{kernel_id}")
            steps.append(("delete", status_code, None))
            wait_for(lambda: not live_leases(pool, kernel_id), 15, "the lease released within 15 s of the DELETE")
            assert time.monotonic() - started < 15 + 5
            assert kernel_id not in gateway.kernel_ids()
        finally:
            pool.close()
        assert steps == baseline, f"{mode}: answers differ from a server without the extension"
    finally:
        server.stop()


def test_a_client_cannot_choose_the_pool_or_opt_out(gateway: KernelGateway, tmp_path: Path) -> None:
    """A start whose env names another pool file and ``GPUPOOL_AUTOLEASE=off`` (names the admin let
    clients set) is still pooled by the gateway's pool, and says what it ignored."""
    other = tmp_path / "client-pool.sqlite"
    model = gateway.call("POST", "api/kernels", {"name": "python3", "env": {
        "GPUPOOL_DB": str(other), "GPUPOOL_AUTOLEASE": "off", "GPUPOOL_SIMULATE": "8x80GiB"}})
    kernel_id = model["id"]
    pool = gateway_pool(gateway)
    try:
        lease = wait_for(lambda: (live_leases(pool, kernel_id) or [None])[0], 60, "the kernel's lease in the gateway's pool")
        assert lease.priority is PriorityClass.BATCH  # no hint from a server: a scripted start
        assert not other.exists()
        reply, shown = asyncio.run(run_cell(gateway.port, "", kernel_id, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"))
        assert reply == "ok" and printed(shown) != "", shown  # a GPU of the gateway's pool, not none, not all
        gateway.call("DELETE", f"api/kernels/{kernel_id}")
        wait_for(lambda: not live_leases(pool, kernel_id), 15, "the lease released")
    finally:
        pool.close()
    assert "ignored GPUPOOL_AUTOLEASE, GPUPOOL_DB, GPUPOOL_SIMULATE" in gateway.log_path.read_text()


def test_on_a_full_pool_a_gateway_kernel_waits_in_its_first_cell_and_a_delete_withdraws_it(
    gateway: KernelGateway, tmp_path: Path
) -> None:
    pool = gateway_pool(gateway)
    host = socket.gethostname()
    holders = [
        pool.request(LeaseRequest(owner="someone", memory=8 * GIB, holder_pid=os.getpid(), holder_host=host, burst_limit=0))
        for _ in range(2)
    ]
    assert all(h.state is LeaseState.GRANTED for h in holders)
    server = lab_server(tmp_path, gateway, "lab")
    try:
        waiting = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        shown: list[str] = []

        async def first_cell_then_free_a_slice() -> tuple[str, list[str]]:
            run = asyncio.ensure_future(run_cell(server.port, server.token, waiting, "print('ran on', __import__('os').environ['CUDA_VISIBLE_DEVICES'])", 180, shown))
            deadline = time.monotonic() + 60
            while not any("position 1 of 1" in s for s in shown):
                assert time.monotonic() < deadline and not run.done(), f"no queue position shown: {shown}"
                await asyncio.sleep(0.2)
            status = await asyncio.to_thread(server.call, "GET", f"api/gpupool/kernels/{waiting}")
            assert status["state"] == "queued" and status["queue_position"] == 1 and status["gateway"] == gateway.url
            await asyncio.to_thread(pool.release, holders[0].id)
            return await run

        reply, _ = asyncio.run(first_cell_then_free_a_slice())
        assert reply == "ok" and any(s.startswith("ran on") for s in shown), shown
        assert any("waiting for a GPU slice (normal), position 1 of 1" in s for s in shown), shown

        # A second kernel queues behind the full pool; a DELETE while its first cell waits withdraws it.
        queued = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        waiting_lines: list[str] = []

        async def delete_while_its_cell_waits() -> float:
            run = asyncio.ensure_future(run_cell(server.port, server.token, queued, "print('never')", 120, waiting_lines))
            deadline = time.monotonic() + 60
            while not any("position 1 of 1" in s for s in waiting_lines):
                assert time.monotonic() < deadline and not run.done(), f"no queue position shown: {waiting_lines}"
                await asyncio.sleep(0.2)
            started = time.monotonic()
            assert (await asyncio.to_thread(answer, server, "DELETE", f"api/kernels/{queued}"))[0] == 200
            run.cancel()
            return started

        started = asyncio.run(delete_while_its_cell_waits())
        assert [lease.state for lease in pool.leases(kernel_id=queued, include_released=True)] != []
        wait_for(lambda: not live_leases(pool, queued), 15, "the queued request withdrawn within 15 s of the DELETE")
        assert time.monotonic() - started < 20
        assert not any("never" in s for s in waiting_lines)
        assert answer(server, "DELETE", f"api/kernels/{waiting}")[0] == 200
    finally:
        server.stop()
        for holder in holders:
            if pool.get(holder.id).live:
                pool.release(holder.id)
        pool.close()
