"""``POST /api/gpupool/kernels/{id}/resume {"ahead": true}``: the front end's resume ahead of a cell.

Real jupyter_server and kernels on a simulated pool: the owner's resume ahead restores a suspended
kernel on a free GPU before any cell runs; an admin may not ask it for someone else (403); a bad
value is a 400 that changes nothing.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_kernels import start_running_kernel

from jupyter_gpupool.core.models import LeaseState, Transition

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
