"""Suspend, don't kill — with a real jupyter_server and real kernels on a simulated 1x16GiB pool.

Kernel A goes idle holding 8 GiB; B and C start; C queues; A is *suspended* (its process lives on,
its variables too) and C is granted; running ``print(x)`` in A then waits until a slice frees and
prints ``42``. The REST state of A goes granted → suspended → queued (resuming, with a position)
→ granted. Also: a suspend that fails falls back to culling, a restore that fails stops the kernel,
and the Suspend / Resume endpoints.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
from typing import Any

import pytest
from server_kernels import KERNEL_START_TIMEOUT, kernel_pid, release_flag, start_kernel, start_running_kernel

from jupyter_gpupool.core.models import LeaseState, Transition

#: Seconds a step of real servers and kernels may take on a loaded 2-core machine (a start, a
#: suspend, a kernel going away): each wait ends as soon as its condition holds.
DEADLINE = KERNEL_START_TIMEOUT

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_TIMEOUT="2", GPUPOOL_WARNING_PERIOD="1"),
    pytest.mark.gpupool_config({"PoolPolicy": {"preemption": False}}),
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(")")[-1].split()[0] != "Z"


async def _status(gpupool_fetch: Any, kernel_id: str, user: str = "alice") -> dict[str, Any]:
    response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id, user=user)
    assert response.code == 200, response.body
    return json.loads(response.body)


def test_an_idle_kernel_is_suspended_for_a_waiting_one_and_its_next_cell_waits_then_prints_42(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec, tmp_path
):
    pool = gpupool_ext.pool
    free_b, free_c = tmp_path / "b may finish", tmp_path / "c may finish"

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        assert (await kernel_exec(a, "x = 42\nprint('set')")).strip() == "set"
        assert (await _status(gpupool_fetch, a))["suspendable"] is True
        pid_a = kernel_pid(jp_serverapp, a)
        seen: list[str] = []

        async def watch() -> None:  # A's REST state as the sidebar sees it
            while True:
                body = await _status(gpupool_fetch, a)
                label = body["state"] + (" resuming" if body["resuming"] else "")
                if body["queue_position"]:
                    label += f" #{body['queue_position']}"
                if not seen or seen[-1] != label:
                    seen.append(label)
                await asyncio.sleep(0.1)

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.sleep(2.5)  # A idles past the idle timeout
            b = await start_kernel(gpupool_fetch)
            await gpupool_wait(
                lambda: (lease := pool.lease_for_kernel(b)) and lease.state is LeaseState.GRANTED,
                timeout=DEADLINE, what="B's grant",
            )
            c = await start_kernel(gpupool_fetch)
            await gpupool_wait(lambda: pool.lease_for_kernel(c) is not None, timeout=DEADLINE, what="C's request")
            await gpupool_wait(
                lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, timeout=DEADLINE, what="A to be suspended"
            )
            suspended = await _status(gpupool_fetch, a)
            assert suspended["suspend_reason"].startswith("reclaimed: idle for"), suspended
            assert suspended["parked_memory"] is not None and suspended["home_devices"]
            assert _alive(pid_a) and a in jp_serverapp.kernel_manager  # suspended, not shut down
            await gpupool_wait(lambda: pool.lease_for_kernel(c).state is LeaseState.GRANTED, timeout=DEADLINE, what="C's grant")

            # Keep B and C busy until told, so the only way back for A is a slice that frees.
            busy_b = asyncio.ensure_future(kernel_exec(b, release_flag(free_b), timeout=600))
            busy_c = asyncio.ensure_future(kernel_exec(c, release_flag(free_c), timeout=600))
            await gpupool_wait(
                lambda: pool.lease_for_kernel(b).busy and pool.lease_for_kernel(c).busy,
                timeout=DEADLINE, what="the pool to see B and C busy",
            )
            cell = asyncio.ensure_future(kernel_exec(a, "print(x)", timeout=600))
            await gpupool_wait(
                lambda: pool.lease_for_kernel(a).state is LeaseState.QUEUED, timeout=DEADLINE, what="A to queue to resume"
            )
            queued = await _status(gpupool_fetch, a)
            assert queued["resuming"] is True and queued["queue_position"] == 1, queued
            await asyncio.sleep(2)
            assert not cell.done(), "A's cell ran while its GPU memory was parked and no slice was free"
            free_b.touch()
            assert (await busy_b).strip() == "released"
            # B finished its cell and idles: it is suspended in turn, and A comes back.
            out = await asyncio.wait_for(cell, DEADLINE)
            assert out.strip().splitlines()[-1] == "42", out
            free_c.touch()
            await busy_c
            await gpupool_wait(lambda: pool.lease_for_kernel(a).transition is Transition.NONE, timeout=60, what="A's restore")
            back = pool.lease_for_kernel(a)
            assert back.state is LeaseState.GRANTED and back.suspensions == 1 and back.parked_memory == 0
            # The restore is counted on this server's own /metrics (there is no broker here).
            metrics = (await gpupool_fetch("metrics")).body.decode()
            count = next(line for line in metrics.splitlines() if line.startswith("gpupool_restore_seconds_count"))
            assert float(count.split()[-1]) >= 1.0, count
        finally:
            watcher.cancel()
            free_b.touch()  # a failed step must not leave the kernels' cells running
            free_c.touch()
        assert seen[0].startswith("granted"), seen
        path = [label.split(" #")[0] for label in seen]
        for step in ("suspended", "queued resuming", "granted"):
            assert step in path, seen
        assert path.index("suspended") < path.index("queued resuming") < len(path) - 1 - path[::-1].index("granted"), seen
        assert any(label.startswith("queued resuming #") for label in seen), seen

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="16GiB", GPUPOOL_IDLE_TIMEOUT="1", GPUPOOL_WARNING_PERIOD="0.5")
def test_a_failed_suspend_falls_back_to_culling_with_the_reason(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer

    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        SimulatedCheckpointer.fail_next(pool.backend.usage_dir, "suspend", reason="UVM memory cannot be checkpointed")
        await asyncio.sleep(1.5)
        await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: a not in jp_serverapp.kernel_manager, timeout=DEADLINE, what="A to be shut down")
        lease = pool.last_lease_for_kernel(a)
        assert lease.state is LeaseState.RELEASED
        assert re.search(r"\(suspending failed: .*UVM memory cannot be checkpointed; so the kernel was shut down\)$", lease.release_reason), (
            lease.release_reason
        )

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")
def test_suspend_and_resume_endpoints_and_a_failed_restore_stops_the_kernel(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer

    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        await kernel_exec(a, "y = 7")
        response = await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST", user="bob")
        assert response.code in (403, 404), response.body  # not bob's kernel
        response = await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        assert response.code == 200, response.body
        assert json.loads(response.body)["transition"] == "suspending"
        await gpupool_wait(lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, what="A to be suspended")
        again = await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        assert again.code == 409 and "not running on a GPU" in json.loads(again.body)["message"], again.body
        response = await gpupool_fetch("api", "gpupool", "kernels", a, "resume", method="POST")
        assert response.code == 200, response.body
        await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED and l.transition is Transition.NONE, what="A back")
        assert (await kernel_exec(a, "print(y)")).strip() == "7"

        # A restore that fails with the memory still parked goes back to suspended, and the next try works.
        await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        await gpupool_wait(lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, what="A suspended again")
        SimulatedCheckpointer.fail_next(pool.backend.usage_dir, "resume", reason="device busy")
        await gpupool_fetch("api", "gpupool", "kernels", a, "resume", method="POST")
        await gpupool_wait(lambda: pool.lease_for_kernel(a).restore_failures == 1, what="the failed restore")
        body = await _status(gpupool_fetch, a)
        assert body["state"] == "suspended" and "restoring failed" in body["suspend_reason"], body
        await gpupool_fetch("api", "gpupool", "kernels", a, "resume", method="POST")
        await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED and l.transition is Transition.NONE, what="A back")
        assert (await kernel_exec(a, "print(y)")).strip() == "7"

        # A restore that leaves the kernel broken stops it, with the reason.
        await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        await gpupool_wait(lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, what="A suspended a third time")
        SimulatedCheckpointer.fail_next(pool.backend.usage_dir, "resume", reason="device lost", state="failed")
        await gpupool_fetch("api", "gpupool", "kernels", a, "resume", method="POST")
        await gpupool_wait(lambda: a not in jp_serverapp.kernel_manager, timeout=DEADLINE, what="A to be stopped")
        lease = pool.last_lease_for_kernel(a)
        assert lease.release_reason.startswith("stopped: restoring its GPU memory failed ("), lease.release_reason
        assert "device lost" in lease.release_reason

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_SIMULATE="2x16GiB", GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")
@pytest.mark.gpupool_config({"PoolPolicy": {"preemption": False, "defragment_min_idle": 1}})
def test_live_defragmentation_moves_an_idle_kernel_so_a_large_request_fits(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec, tmp_path
):
    """8 GiB free on each of two 16 GiB GPUs, a 12 GiB request: the server moves the idle kernel
    to the other GPU (suspend, restore there) and the request is granted — nobody lost a GPU."""
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.provisioner.kernel_provisioner import holder_identity
    from jupyter_gpupool.units import GIB

    pool = gpupool_ext.pool
    free_b = tmp_path / "b may finish"

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        await kernel_exec(a, "z = [1, 2, 3]")
        host, me = holder_identity()
        filler = pool.request(LeaseRequest(owner="dave", memory=8 * GIB, holder_pid=me, holder_host=host))
        home = pool.lease_for_kernel(a).devices
        assert filler.devices == home  # packed beside A
        b = await start_kernel(gpupool_fetch)
        await gpupool_wait(
            lambda: (l := pool.lease_for_kernel(b)) and l.state is LeaseState.GRANTED, timeout=DEADLINE, what="B's grant"
        )
        assert pool.lease_for_kernel(b).devices != home
        busy_b = asyncio.ensure_future(kernel_exec(b, release_flag(free_b), timeout=600))  # B busy: only A may move
        await gpupool_wait(lambda: pool.lease_for_kernel(b).busy, timeout=DEADLINE, what="the pool to see B busy")
        pool.release(filler.id)  # 8 GiB free on each GPU now
        await asyncio.sleep(1.5)  # A idles past defragment_min_idle
        big = pool.request(LeaseRequest(owner="erin", memory=12 * GIB, holder_pid=me, holder_host=host))
        assert big.state is LeaseState.QUEUED
        granted = await gpupool_wait(
            lambda: (l := pool.get(big.id)).state is LeaseState.GRANTED and l, timeout=DEADLINE, what="the 12 GiB grant"
        )
        moved = pool.lease_for_kernel(a)
        assert moved.state is LeaseState.GRANTED and moved.transition is Transition.NONE
        assert moved.devices != home and granted.devices == home
        assert moved.suspensions == 0 and a in jp_serverapp.kernel_manager
        kinds = [e["kind"] for e in pool.events() if e["lease_id"] == moved.id]
        assert "migrate" in kinds and "warn_idle" not in kinds
        assert (await kernel_exec(a, "print(sum(z))")).strip() == "6"
        # The kernel's environment names the GPU it runs on now, for itself and for what it starts.
        seen = await kernel_exec(
            a,
            "import os, subprocess, sys\n"
            "print(os.environ['CUDA_VISIBLE_DEVICES'])\n"
            "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"CUDA_VISIBLE_DEVICES\"])'],"
            " capture_output=True, text=True).stdout.strip())",
        )
        assert seen.split() == [",".join(moved.devices)] * 2, (seen, moved.devices, home)
        # ...and the memory it takes now is counted on that GPU, not mapped a second time.
        await kernel_exec(a, "from jupyter_gpupool.devices.simulated import pretend_to_use\npretend_to_use('1GiB')")
        pid_a = kernel_pid(jp_serverapp, a)
        used = {u.device_uuid: u.used_memory for u in pool.backend.process_usage() if u.pid == pid_a}
        assert used == {moved.devices[0]: GIB}, (used, moved.devices, home)
        free_b.touch()
        assert (await busy_b).strip() == "released"

    try:
        arun(scenario())
    finally:
        free_b.touch()  # a failed step must not leave B's cell running


def test_a_suspended_kernel_of_a_killed_server_is_reconciled_not_leaked(tmp_path):
    """SIGKILL the server of a suspended kernel: the next server on the pool file releases the lease,
    and its parked memory no longer counts against the budget."""
    import signal
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from server_process import Server, wait_for

    from jupyter_gpupool.backends.local.pool import Pool

    env = {
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DEFAULT_MEMORY": "8GiB",
        "GPUPOOL_USER": "alice",
        "GPUPOOL_HEARTBEAT_TTL": "5",
        "GPUPOOL_URL": None,
    }
    first = Server(
        tmp_path, "first", env, args=("--GpuPoolExtension.tick_interval=0.25", "--GpuPoolExtension.reconcile_interval=0.5"),
        start_timeout=DEADLINE,
    )
    try:
        kernel_id = first.call("POST", "api/kernels", {"name": "python3"}, timeout=DEADLINE)["id"]
        wait_for(lambda: first.call("GET", f"api/gpupool/kernels/{kernel_id}")["state"] == "granted", timeout=DEADLINE,
                 what="the grant")
        first.call("POST", f"api/gpupool/kernels/{kernel_id}/suspend", timeout=DEADLINE)
        wait_for(lambda: first.call("GET", f"api/gpupool/kernels/{kernel_id}")["state"] == "suspended", timeout=DEADLINE,
                 what="the suspend")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(DEADLINE)
    finally:
        first.stop()
    pool = Pool.from_env(environ={k: v for k, v in env.items() if v is not None})
    lease = pool.last_lease_for_kernel(kernel_id)
    assert lease is not None and lease.state is LeaseState.SUSPENDED and lease.parked_memory is not None
    second = Server(tmp_path, "second", env, args=("--GpuPoolExtension.tick_interval=0.25",), start_timeout=DEADLINE)
    try:
        wait_for(lambda: pool.last_lease_for_kernel(kernel_id).state is LeaseState.RELEASED, timeout=DEADLINE,
                 what="the release")
        with pool.store.transaction():
            assert pool._load(time.time()).derived().parked == 0
    finally:
        second.stop()
        pool.close()


@pytest.mark.gpupool_env(GPUPOOL_IDLE_POLICY="never")
def test_restarting_a_suspended_kernel_keeps_its_one_lease_and_drops_the_parked_memory(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    """POST /api/kernels/{id}/restart of a suspended kernel: the parked state is worthless to the new
    process, so the same lease asks for a GPU again (no restore); never a second live lease."""
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        lease_id = pool.lease_for_kernel(a).id
        await kernel_exec(a, "y = 7")
        await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        await gpupool_wait(lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, what="A to be suspended")
        response = await gpupool_fetch("api", "kernels", a, "restart", method="POST")
        assert response.code == 200, response.body
        await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED, what="A granted again")
        live = [lease for lease in pool.leases() if lease.kernel_id == a]
        assert [lease.id for lease in live] == [lease_id]
        assert live[0].parked_memory == 0 and live[0].transition is Transition.NONE and not live[0].resuming
        assert (await kernel_exec(a, "print('y' in dir())")).strip() == "False"  # a fresh process: nothing restored
        with pool.store.transaction():
            assert pool._load(time.time()).derived().parked == 0

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_IDLE_POLICY="never")
def test_a_slice_the_kernel_asked_for_again_is_suspended_by_its_server(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    """``%gpupool release`` then ``%gpupool reserve``: the server follows the kernel's new lease, so
    the Suspend button works on it as on the first one."""
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait, what="kernel A")
        first = pool.lease_for_kernel(a).id
        await kernel_exec(a, "get_ipython().run_line_magic('gpupool', 'release')")
        await kernel_exec(a, "get_ipython().run_line_magic('gpupool', 'reserve 4GiB')")
        await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.id != first and l.state is LeaseState.GRANTED,
                           what="the kernel's new lease")
        response = await gpupool_fetch("api", "gpupool", "kernels", a, "suspend", method="POST")
        assert response.code == 200, response.body
        await gpupool_wait(lambda: pool.lease_for_kernel(a).state is LeaseState.SUSPENDED, what="the new lease suspended")

    arun(scenario())
