"""Store faults and large stores as the REST surfaces show them: 503 with a message (never a
bare 500, never a silently fresh pool), exact authorization with thousands of leases, and a
holder pid that cannot stop the broker's scheduler. Real broker (tests/broker_harness.py) and
a real jupyter_server with the extension."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerHarness
from test_store_faults import crowd

from jupyter_gpupool.backends.local.pool import HOSTNAME

ALICE, BOB, ADMIN = "tok-alice", "tok-bob", "tok-admin"


@pytest.fixture
def harness(tmp_path: Path) -> Any:
    h = BrokerHarness(tmp_path).start()
    h.add_user(ALICE, "alice")
    h.add_user(BOB, "bob")
    h.add_user(ADMIN, "prof", admin=True)
    yield h
    h.stop()


def test_heartbeat_and_activity_are_authorized_by_id_among_thousands_of_leases(harness):
    """1,500 newer live leases: bob still may not heartbeat or report alice's lease idle, and
    alice's server still finds her kernel's slice."""
    alice = harness.remote(ALICE)
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.units import GIB

    lease = alice.request(LeaseRequest(owner="alice", memory=4 * GIB, kernel_id="k-alice"))
    crowd(harness.db, 1500, lease.created_at)
    idle = {"busy": False, "last_activity": 0, "connections": 0}
    status, body = harness.http("POST", "api/gpupool/heartbeat", BOB, {"lease_ids": [lease.id]})
    assert status == 403 and "belongs to another user" in body["message"]
    status, body = harness.http("POST", "api/gpupool/activity", BOB, {"activities": {lease.id: idle}})
    assert status == 403 and "belongs to another user" in body["message"]
    status, _ = harness.http("POST", f"api/gpupool/leases/{lease.id}/activity", BOB, idle)
    assert status == 403
    assert not harness.pool.get(lease.id).reclaim_at and harness.pool.get(lease.id).heartbeat_at == lease.heartbeat_at
    # The owner and admins still may; the owner's server finds the kernel's lease.
    assert harness.http("POST", "api/gpupool/heartbeat", ALICE, {"lease_ids": [lease.id]})[0] == 204
    assert harness.http("POST", "api/gpupool/activity", ADMIN, {"activities": {lease.id: {**idle, "busy": True}}})[0] == 204
    found = alice.lease_for_kernel("k-alice")
    assert found is not None and found.id == lease.id
    status, listed = harness.http("GET", "api/gpupool/leases?all=1", ADMIN)
    assert status == 200 and len(listed) == 1501


def test_a_holder_pid_past_the_os_range_is_400_and_the_scheduler_keeps_running(harness):
    body = {"memory": "1GiB", "holder_pid": 2**31, "holder_host": HOSTNAME}
    status, reply = harness.http("POST", "api/gpupool/leases", BOB, body)
    assert status == 400 and "holder_pid" in reply["message"]
    assert harness.pool.leases() == []
    status, _ = harness.http("POST", "api/gpupool/tick", ADMIN)
    assert status == 200


def test_a_deleted_broker_pool_file_answers_503_with_the_reason(harness):
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.units import GIB

    harness.remote(ALICE).request(LeaseRequest(owner="alice", memory=16 * GIB))
    for path in glob.glob(harness.db + "*"):
        os.unlink(path)
    status, body = harness.http("POST", "api/gpupool/leases", BOB, {"memory": "16GiB"})
    assert status == 503 and "deleted or moved while in use" in body["message"]
    status, body = harness.http("GET", "api/gpupool/pool", BOB)
    assert status == 503 and "stopped granting" in body["message"]
    assert glob.glob(harness.db + ".rescued-*")


def test_a_server_whose_pool_file_is_replaced_says_unavailable(arun, jp_serverapp, gpupool_fetch, gpupool_env, tmp_path):
    from jupyter_gpupool.backends.local.store import Store

    other = tmp_path / "other.sqlite"
    Store(str(other)).close()

    async def scenario() -> None:
        response = await gpupool_fetch("api", "gpupool", "pool")
        assert response.code == 200, response.body
        os.replace(other, gpupool_env["GPUPOOL_DB"])
        # The pool view answers with the pool's state (the sidebar shows why), not an error.
        response = await gpupool_fetch("api", "gpupool", "pool")
        assert response.code == 200, response.body
        view = json.loads(response.body)
        assert view["state"] == "unavailable", view
        assert "replaced by another file while in use" in view["reason"]

    arun(scenario())
