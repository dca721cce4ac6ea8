"""A kernel start is pending only while it waits for the pool: one the pool grants at once is
jupyter_server's own (a started kernel, errors from the call), one that queues is answered at
once, and acting on it before it has started is a 409 with the reason. Real jupyter_server,
real ipykernel kernels, simulated pool (1 × 16 GiB, 8 GiB per kernel)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.provisioner.kernel_provisioner import LeaseWaitAborted

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]


async def post_kernel(fetch: Any, name: str = "python3") -> tuple[Any, float]:
    started = time.monotonic()
    response = await fetch("api", "kernels", method="POST", body={"name": name})
    return response, time.monotonic() - started


def test_a_kernel_the_pool_grants_at_once_is_started_when_the_call_returns(arun, jp_serverapp, gpupool_fetch, gpupool_ext):
    """POST /api/kernels then an interrupt at once: 204 (it was 500, "Kernel is in a pending
    state"); start_kernel() returns with the ports and keys in place, as without the extension."""
    km = jp_serverapp.kernel_manager

    async def scenario() -> None:
        response, _ = await post_kernel(gpupool_fetch)
        assert response.code == 201, response.body
        kernel_id = json.loads(response.body)["id"]
        interrupted = await gpupool_fetch("api", "kernels", kernel_id, "interrupt", method="POST")
        assert interrupted.code == 204, interrupted.body
        assert gpupool_ext.pool.lease_for_kernel(kernel_id).state is LeaseState.GRANTED

        kernel_id = await km.start_kernel(kernel_name="python3")
        kernel = km.get_kernel(kernel_id)
        assert kernel.ready.done() and kernel.ready.exception() is None
        assert all(port > 0 for port in kernel.ports) and kernel.session.key
        assert km._kernel_ports[kernel_id] == kernel.ports  # _finish_kernel_start ran before the return
        assert km.use_pending_kernels is False

    arun(scenario())


def test_a_kernel_that_must_queue_is_pending_and_acting_on_it_is_a_409(
    arun, jp_serverapp, jp_fetch, gpupool_fetch, gpupool_wait, gpupool_ext, caplog
):
    """Two kernels fill the GPU; the third's POST answers at once, ``starting``; interrupt and
    restart answer 409 with the reason (never 500); shutting it down withdraws its request, and
    the cancelled start is said in one line, without a traceback."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        for _ in range(2):
            response, _ = await post_kernel(gpupool_fetch)
            assert response.code == 201, response.body
        response, took = await post_kernel(gpupool_fetch)
        # Answered before any grant (none comes: the GPU is full), not after: a start that waited
        # for its grant would never answer here.
        assert response.code == 201 and took < 30.0, (response.body, took)
        model = json.loads(response.body)
        queued_id = model["id"]
        assert model["execution_state"] == "starting"
        assert gpupool_ext.pool.lease_for_kernel(queued_id).state is LeaseState.QUEUED
        listed = json.loads((await gpupool_fetch("api", "kernels")).body)
        assert queued_id in {k["id"] for k in listed}

        for action in ("interrupt", "restart"):
            answer = await gpupool_fetch("api", "kernels", queued_id, action, method="POST")
            assert answer.code == 409, (action, answer.code, answer.body)
            message = json.loads(answer.body)["message"]
            assert "waiting for a GPU: position 1 of 1" in message and "once it has started" in message, message
        # Authenticated and authorized as jupyter_server's own route.
        stranger = await jp_fetch(
            "api", "kernels", queued_id, "interrupt", method="POST", body="{}", headers={"Authorization": "token wrong"}, raise_error=False
        )
        assert stranger.code in (401, 403), stranger.code

        caplog.clear()
        deleted = await gpupool_fetch("api", "kernels", queued_id, method="DELETE")
        assert deleted.code == 204, deleted.body
        assert queued_id not in jp_serverapp.kernel_manager
        assert gpupool_ext.pool.lease_for_kernel(queued_id) is None
        withdrawn = gpupool_ext.pool.last_lease_for_kernel(queued_id)
        assert withdrawn.state is LeaseState.RELEASED and "shut down while queued" in withdrawn.release_reason

    arun(scenario())
    tracebacks = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], LeaseWaitAborted)]
    raw = [r for r in caplog.records if isinstance(r.msg, LeaseWaitAborted)]
    assert not tracebacks and not raw, [r.getMessage() for r in tracebacks + raw]
    said = [r for r in caplog.records if "cancelled while waiting for a GPU" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, [r.getMessage() for r in said]


def test_a_queued_kernel_that_is_granted_later_starts_and_runs_code(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec):
    """The pending kernel's start goes on: once a slice frees it is granted, started, and runs code."""

    async def scenario() -> None:
        first = json.loads((await post_kernel(gpupool_fetch))[0].body)["id"]
        await post_kernel(gpupool_fetch)
        queued_id = json.loads((await post_kernel(gpupool_fetch))[0].body)["id"]
        assert gpupool_ext.pool.lease_for_kernel(queued_id).state is LeaseState.QUEUED
        assert (await gpupool_fetch("api", "kernels", first, method="DELETE")).code == 204
        out = await kernel_exec(queued_id, "import os; print(os.environ['GPUPOOL_LEASE_ID'])")
        assert out.strip() == gpupool_ext.pool.lease_for_kernel(queued_id).id
        interrupted = await gpupool_fetch("api", "kernels", queued_id, "interrupt", method="POST")
        assert interrupted.code == 204, interrupted.body

    arun(scenario())


@pytest.fixture
def missing_program_kernelspec(jp_data_dir: Path, tmp_path: Path) -> str:
    """A kernelspec whose program does not exist."""
    spec = jp_data_dir / "kernels" / "missing"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps({"argv": [str(tmp_path / "no-such-program"), "{connection_file}"], "display_name": "missing", "language": "python"})
    )
    return "missing"


@pytest.mark.gpupool_config({"GpuPoolExtension": {"reconcile_interval": 600}})
def test_a_failed_launch_in_a_server_leaves_no_live_lease(arun, missing_program_kernelspec, jp_serverapp, gpupool_fetch, gpupool_ext):
    """The start's error comes back from the call, and the lease is given back at once (not
    at the next reconcile)."""

    async def scenario() -> None:
        response, _ = await post_kernel(gpupool_fetch, missing_program_kernelspec)
        assert response.code == 500, response.body  # jupyter_server's own answer to a launch that fails
        assert gpupool_ext.pool.leases() == []
        assert jp_serverapp.kernel_manager.list_kernel_ids() == []

    arun(scenario())


@pytest.mark.filterwarnings("ignore:The synchronous MappingKernelManager class is deprecated:DeprecationWarning")
@pytest.mark.gpupool_config({"ServerApp": {"kernel_manager_class": "jupyter_server.services.kernels.kernelmanager.MappingKernelManager"}})
def test_the_synchronous_manager_is_left_as_jupyter_server_made_it(jp_serverapp, gpupool_ext):
    """No ``use_pending_kernels`` is set on a manager that has no such setting."""
    km = jp_serverapp.kernel_manager
    assert type(km).__name__ == "MappingKernelManager"
    assert "use_pending_kernels" not in km.__dict__ and not km._using_pending_kernels()
    assert not gpupool_ext.kernel_hooks._may_answer_pending(km)
