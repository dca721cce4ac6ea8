"""Fail closed, visibly: a pool that cannot be used never hands a kernel an unpooled GPU, the
server says why (REST, kernel model), recovers when the cause is fixed, and a failed start ends
with the reason. Real jupyter_server, real kernels; the pool breaks for real causes
(an invalid GPUPOOL_* value, a corrupt pool file, a request larger than any GPU).

Every test here failed on the code before it: the extension did not load at all (REST 404,
kernels with every GPU), and a refused start stayed ``starting`` for ever.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from server_kernels import start_kernel

from jupyter_gpupool.core.policy import PoolPolicy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

REPO = Path(__file__).resolve().parent.parent
ENV_CODE = "import os, json; print(json.dumps(dict(os.environ)))"


async def get_json(fetch: Any, *parts: str, user: str = "alice") -> tuple[int, dict[str, Any]]:
    response = await fetch(*parts, user=user)
    return response.code, json.loads(response.body or b"{}")


@pytest.fixture
def corrupt_pool_file(gpupool_env: dict[str, str]) -> Path:
    """The test's pool file, overwritten with bytes that are not SQLite (before the server starts)."""
    path = Path(gpupool_env["GPUPOOL_DB"])
    path.write_bytes(b"this is not a pool file\n" * 64)
    return path


@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="soon")
@pytest.mark.gpupool_config({"GpuPoolExtension": {"retry_interval": 0.3}})
def test_unavailable_pool_loads_degraded_runs_kernels_cpu_only_and_recovers(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec, monkeypatch
):
    """An invalid GPUPOOL_* value: the extension loads anyway, REST says ``unavailable`` with the
    reason, a kernel starts with every GPU hidden, and once the value is fixed the pool opens and
    a restart gets the kernel a slice."""

    async def scenario() -> None:
        code, pool = await get_json(gpupool_fetch, "api", "gpupool", "pool")
        assert code == 200, pool
        assert pool["state"] == "unavailable" and "GPUPOOL_IDLE_TIMEOUT" in pool["reason"], pool
        assert pool["when_unavailable"] == "cpu-only" and pool["no_gpu"] is False
        assert pool["devices"] == [] and pool["leases"] == [] and pool["viewer"]["name"] == "alice"

        kernel_id = await start_kernel(gpupool_fetch)
        env = json.loads(await kernel_exec(kernel_id, ENV_CODE))
        assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
        assert "GPUPOOL_LEASE_ID" not in env and "GPUPOOL_IDLE_TIMEOUT" in env["GPUPOOL_UNAVAILABLE"]

        code, status = await get_json(gpupool_fetch, "api", "gpupool", "kernels", kernel_id)
        assert code == 200 and status["state"] == "unavailable", status
        assert "GPUPOOL_IDLE_TIMEOUT" in status["reason"] and "CPU-only" in status["enforcement"]["description"]
        # Another user still may not look; acting on the slice is 503 with the reason.
        assert (await gpupool_fetch("api", "gpupool", "kernels", kernel_id, user="bob")).code == 403
        response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id, "reserve", method="POST", body={"memory": "1GiB"})
        assert response.code == 503 and "unavailable" in json.loads(response.body)["message"]

        # The admin fixes the cause: the pool opens on the next retry, and a restart gets a slice.
        monkeypatch.delenv("GPUPOOL_IDLE_TIMEOUT")

        async def available() -> dict[str, Any] | None:
            body = (await get_json(gpupool_fetch, "api", "gpupool", "pool"))[1]
            return body if body["state"] == "available" else None

        pool = await gpupool_wait(available, timeout=20, what="the pool to open once fixed")
        assert pool["reason"] is None and len(pool["devices"]) == 1
        response = await gpupool_fetch("api", "kernels", kernel_id, "restart", method="POST")
        assert response.code == 200, response.body
        env = json.loads(await kernel_exec(kernel_id, ENV_CODE))
        status = (await get_json(gpupool_fetch, "api", "gpupool", "kernels", kernel_id))[1]
        assert status["state"] == "granted" and env["GPUPOOL_LEASE_ID"] == status["lease_id"]
        assert env["CUDA_VISIBLE_DEVICES"] == status["devices"][0]["uuid"] and "GPUPOOL_UNAVAILABLE" not in env

    arun(scenario())


@pytest.mark.gpupool_config({"GpuPoolExtension": {"when_unavailable": "refuse"}})
def test_refuse_mode_a_corrupt_pool_file_fails_starts_with_the_reason(
    corrupt_pool_file, arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext
):
    """With ``refuse``, a start while the pool file is corrupt fails at once, as a failed start
    fails without the extension: ``POST /api/kernels`` answers 503 with the reason (not 500, not a
    kernel ``starting`` for ever), and no kernel is left behind."""
    assert corrupt_pool_file.read_bytes().startswith(b"this is not")

    async def scenario() -> None:
        pool = (await get_json(gpupool_fetch, "api", "gpupool", "pool"))[1]
        assert pool["state"] == "unavailable" and pool["when_unavailable"] == "refuse" and pool["reason"]
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        assert response.code == 503, response.body
        message = json.loads(response.body)["message"]
        assert "GPU pool is unavailable" in message and "Traceback" not in response.body.decode(), message
        assert jp_serverapp.kernel_manager.list_kernel_ids() == []
        # The corrupt file was left as it was: never silently replaced by a fresh pool.
        assert corrupt_pool_file.read_bytes().startswith(b"this is not")

    arun(scenario())


def test_a_start_the_pool_refuses_ends_failed_with_the_reason(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    """A slice larger than any GPU: ``POST /api/kernels`` answers 409 with the reason (the error of
    the call, as jupyter_server answers a start that fails), leaving no kernel and no lease."""
    gpupool_ext.pool.set_preference("alice", memory="64GiB")

    async def scenario() -> None:
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        assert response.code == 409, response.body
        message = json.loads(response.body)["message"]
        assert "16 GiB" in message or "largest" in message, message
        assert "without a GPU slice" not in message
        assert jp_serverapp.kernel_manager.list_kernel_ids() == []
        assert gpupool_ext.pool.leases() == []

    arun(scenario())


def test_readme_default_quota_example_is_valid() -> None:
    """The documented ``default_quota`` example (trait help and the README generated from it) validates."""
    help_text = PoolPolicy.class_traits()["default_quota"].help
    example = ast.literal_eval(re.search(r"\{.*\}", help_text).group(0))
    policy = PoolPolicy(default_quota=example)
    policy.validate_all()
    assert policy.quota_for_user("anyone").maximum is not None
    readme = (REPO / "README.md").read_text()
    assert help_text in readme, "README.md is stale: python -m jupyter_gpupool.configref --write README.md"
    for quota in re.findall(r"\{'guaranteed'[^}]*\}", readme):
        PoolPolicy(default_quota=ast.literal_eval(quota)).validate_all()


def test_when_unavailable_env_and_trait(monkeypatch) -> None:
    """GPUPOOL_WHEN_UNAVAILABLE sets the default; anything else than the two choices means cpu-only."""
    from jupyter_gpupool.provisioner.kernel_provisioner import when_unavailable_from_env

    assert when_unavailable_from_env({}) == "cpu-only"
    assert when_unavailable_from_env({"GPUPOOL_WHEN_UNAVAILABLE": "Refuse"}) == "refuse"
    assert when_unavailable_from_env({"GPUPOOL_WHEN_UNAVAILABLE": "open"}) == "cpu-only"
    assert os.environ.get("GPUPOOL_WHEN_UNAVAILABLE") is None


def test_pool_file_deleted_while_serving_new_starts_cpu_only_and_restart_does_not_fail(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec, gpupool_env
):
    """The pool becomes unavailable later (its file deleted under the server): the pool view says
    so with the reason, a new kernel starts CPU-only, and restarting a kernel that had a slice
    answers 200 and brings it back CPU-only (never 500, never with its old GPU unpooled)."""

    async def scenario() -> None:
        granted_id = await start_kernel(gpupool_fetch)

        async def granted() -> bool:
            return (await get_json(gpupool_fetch, "api", "gpupool", "kernels", granted_id))[1]["state"] == "granted"

        await gpupool_wait(granted, timeout=30, what="a grant")
        assert json.loads(await kernel_exec(granted_id, ENV_CODE))["CUDA_VISIBLE_DEVICES"]
        Path(gpupool_env["GPUPOOL_DB"]).unlink()

        async def unavailable() -> dict[str, Any] | None:
            body = (await get_json(gpupool_fetch, "api", "gpupool", "pool"))[1]
            return body if body["state"] == "unavailable" else None

        pool = await gpupool_wait(unavailable, timeout=20, what="the pool view to say unavailable")
        assert gpupool_env["GPUPOOL_DB"] in pool["reason"], pool

        response = await gpupool_fetch("api", "kernels", granted_id, "restart", method="POST")
        assert response.code == 200, response.body
        env = json.loads(await kernel_exec(granted_id, ENV_CODE))
        assert env["CUDA_VISIBLE_DEVICES"] == "" and "GPUPOOL_LEASE_ID" not in env
        status = (await get_json(gpupool_fetch, "api", "gpupool", "kernels", granted_id))[1]
        assert status["state"] == "unavailable" and gpupool_env["GPUPOOL_DB"] in status["reason"], status

        new_id = await start_kernel(gpupool_fetch)
        assert json.loads(await kernel_exec(new_id, ENV_CODE))["CUDA_VISIBLE_DEVICES"] == ""
        assert (await gpupool_fetch("api", "kernels", new_id, method="DELETE")).code == 204
        assert (await gpupool_fetch("api", "kernels", granted_id, method="DELETE")).code == 204

    arun(scenario())
