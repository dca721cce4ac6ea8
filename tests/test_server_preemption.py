"""A preempted kernel is really shut down by its Jupyter server: its process ends, it leaves
``/api/kernels``, and the request that preempted it is granted. Twice: for a higher class, and for
a reservation whose window is open."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from server_kernels import KERNEL_START_TIMEOUT, listening_kernel_pid

from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.provisioner.kernel_provisioner import holder_identity
from jupyter_gpupool.units import GIB

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
    pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="16GiB", GPUPOOL_RECLAIM_ACTION="cull"),  # the cull path (suspends: below)
    pytest.mark.gpupool_config({"PoolPolicy": {"min_runtime": 0, "grace_period": 1, "group_priorities": {"staff": "high"}}}),
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie no longer runs
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def _holding_kernel(jp_serverapp: Any, gpupool_fetch: Any, gpupool_wait: Any, pool: Any) -> tuple[str, int]:
    response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
    assert response.code == 201, response.body
    kernel_id = json.loads(response.body)["id"]
    await gpupool_wait(
        lambda: (lease := pool.lease_for_kernel(kernel_id)) and lease.state is LeaseState.GRANTED, what="the kernel's grant"
    )
    # The pid of the process that bound the kernel's ports: one whose port was taken dies and is restarted.
    pid = await gpupool_wait(lambda: listening_kernel_pid(jp_serverapp, kernel_id), timeout=KERNEL_START_TIMEOUT, what="the kernel to listen")
    lease = pool.lease_for_kernel(kernel_id)
    assert lease.state is LeaseState.GRANTED, lease
    return kernel_id, pid


async def _shut_down(jp_serverapp: Any, gpupool_fetch: Any, gpupool_wait: Any, kernel_id: str, pid: int) -> None:
    await gpupool_wait(lambda: kernel_id not in jp_serverapp.kernel_manager, timeout=30, what="the server to shut the kernel down")
    response = await gpupool_fetch("api", "kernels")
    assert kernel_id not in [k["id"] for k in json.loads(response.body)]
    await gpupool_wait(lambda: not _alive(pid), timeout=15, what="the kernel process to end")


def test_a_kernel_preempted_for_a_higher_class_is_shut_down(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel_id, pid = await _holding_kernel(jp_serverapp, gpupool_fetch, gpupool_wait, pool)
        host, me = holder_identity()
        prof = pool.request(LeaseRequest(owner="prof", groups=("staff",), memory=8 * GIB, holder_pid=me, holder_host=host))
        assert prof.state is LeaseState.QUEUED
        await _shut_down(jp_serverapp, gpupool_fetch, gpupool_wait, kernel_id, pid)
        victim = pool.last_lease_for_kernel(kernel_id)
        assert victim.release_reason.startswith("preempted for a higher-priority request"), victim.release_reason
        await gpupool_wait(lambda: pool.get(prof.id).state is LeaseState.GRANTED, what="prof's grant")

    arun(scenario())


def test_a_kernel_preempted_for_an_open_reservation_is_shut_down(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel_id, pid = await _holding_kernel(jp_serverapp, gpupool_fetch, gpupool_wait, pool)
        pool.book_reservation({"name": "exam", "users": ["prof"], "memory": "8GiB", "start": time.time() - 1, "duration": "1h"})
        await _shut_down(jp_serverapp, gpupool_fetch, gpupool_wait, kernel_id, pid)
        victim = pool.last_lease_for_kernel(kernel_id)
        assert victim.release_reason.startswith("preempted for the reservation 'exam' (prof, "), victim.release_reason
        host, me = holder_identity()
        prof = pool.request(LeaseRequest(owner="prof", memory=8 * GIB, holder_pid=me, holder_host=host))
        assert prof.state is LeaseState.GRANTED

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="16GiB")
def test_by_default_a_preempted_kernel_is_suspended_not_shut_down(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    """Where the host can park GPU memory, preemption suspends: the process lives on, the slice is freed."""
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel_id, pid = await _holding_kernel(jp_serverapp, gpupool_fetch, gpupool_wait, pool)
        host, me = holder_identity()
        prof = pool.request(LeaseRequest(owner="prof", groups=("staff",), memory=8 * GIB, holder_pid=me, holder_host=host))
        await gpupool_wait(lambda: pool.get(prof.id).state is LeaseState.GRANTED, timeout=30, what="prof's grant")
        victim = pool.lease_for_kernel(kernel_id)
        assert victim.state is LeaseState.SUSPENDED, victim
        assert victim.suspend_reason.startswith("preempted for a higher-priority request"), victim.suspend_reason
        assert _alive(pid) and kernel_id in jp_serverapp.kernel_manager

    arun(scenario())


@pytest.mark.parametrize("restart_learned_the_end", [True, False], ids=["restart-found-the-end", "restart-got-no-answer"])
def test_a_kernel_whose_restart_failed_is_shut_down_once_its_slice_ended(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, restart_learned_the_end
):
    """Slurm ends a kernel's job; its step dies first, and the restarter restarts the kernel before
    the pool has heard of the job's end. The restart then finds the slice ended and fails (or, with
    slurmctld too busy to answer, gives up waiting for it: ``SlurmProvisioner.acquire``), which
    left the kernel listed, dead, for ever. Here the provisioner is left as that failed restart
    leaves it: the server shuts the kernel down with the reason once the pool has it."""
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel_id, pid = await _holding_kernel(jp_serverapp, gpupool_fetch, gpupool_wait, pool)
        prov = jp_serverapp.kernel_manager.get_kernel(kernel_id).provisioner
        ended = "ended by Slurm: job 7 failed (Slurm: JobLaunchFailure)"
        prov.phase, prov.slice_ended = "failed", ended if restart_learned_the_end else ""
        prov.failure = f"no GPU slice: kernel {kernel_id} is gone: its GPU slice {ended}"
        pool.release(prov.lease_id, reason=ended)
        await _shut_down(jp_serverapp, gpupool_fetch, gpupool_wait, kernel_id, pid)
        assert gpupool_ext._culled[kernel_id] == ended

    arun(scenario())
