"""Two users' real Jupyter servers share one broker's pool (multi-user mode, GPUPOOL_URL).

Each server is a real `jupyter server` process with its user's token; kernels are real ipykernel
kernels started through the REST API. The broker is the real one (tests/broker_harness.py)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerHarness
from server_process import Server as BaseServer
from server_process import wait_for

from jupyter_gpupool.core.models import LeaseState

pytestmark = pytest.mark.slow


def Server(tmp: Path, user: str, broker_url: str, token: str) -> BaseServer:
    """`jupyter server` for one user, pointed at the broker with that user's token."""
    return BaseServer(tmp, user, {"GPUPOOL_URL": broker_url, "GPUPOOL_TOKEN": token, "GPUPOOL_DB": None, "GPUPOOL_SIMULATE": None})


def test_two_users_servers_and_kernels_share_the_broker_pool(tmp_path):
    harness = BrokerHarness(tmp_path).start()
    servers: list[BaseServer] = []
    try:
        harness.add_user("alice-hub-token", "alice", groups=("cs101",))
        harness.add_user("bob-hub-token", "bob", groups=("cs101",))
        alice = Server(tmp_path, "alice", harness.url, "alice-hub-token")
        bob = Server(tmp_path, "bob", harness.url, "bob-hub-token")
        servers += [alice, bob]
        k1 = alice.call("POST", "api/kernels", {"name": "python3"})["id"]
        k2 = bob.call("POST", "api/kernels", {"name": "python3"})["id"]

        def lease_of(kernel_id: str) -> Any:
            return harness.on_broker(harness.pool.lease_for_kernel, kernel_id)

        wait_for(lambda: all((l := lease_of(k)) and l.state is LeaseState.GRANTED for k in (k1, k2)), what="two grants")
        assert {lease_of(k1).owner, lease_of(k2).owner} == {"alice", "bob"}  # identity from each user's token
        k3 = alice.call("POST", "api/kernels", {"name": "python3"})["id"]  # the third across both users queues
        queued = wait_for(lambda: lease_of(k3), what="the third request")
        assert queued.state is LeaseState.QUEUED
        status = alice.call("GET", f"api/gpupool/kernels/{k3}")
        assert status["state"] == "queued" and status["queue_position"] == 1
        bob.call("DELETE", f"api/kernels/{k2}")
        wait_for(lambda: lease_of(k3).state is LeaseState.GRANTED, what="the hand-over to alice's third kernel")
        assert wait_for(lambda: alice.call("GET", f"api/gpupool/kernels/{k3}")["state"] == "granted", what="alice's view")
        assert k3 in {k["id"] for k in alice.call("GET", "api/kernels")}
        # Alice's server cannot act on Bob's kernel through the broker either.
        k4 = bob.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_for(lambda: lease_of(k4), what="bob's new request")
        with pytest.raises(urllib.error.HTTPError) as denied:
            alice.call("POST", f"api/gpupool/kernels/{k4}/release")
        assert denied.value.code in (403, 404)
    finally:
        for server in servers:
            server.stop()
        harness.stop()


def Server_with(tmp: Path, user: str, broker_url: str, token: str, **extra: str) -> BaseServer:
    env: dict[str, str | None] = {"GPUPOOL_URL": broker_url, "GPUPOOL_TOKEN": token, "GPUPOOL_DB": None, "GPUPOOL_SIMULATE": None}
    env.update(extra)
    return BaseServer(tmp, user, env)


def test_broker_down_means_a_cpu_only_kernel_or_none_never_an_unpooled_gpu(tmp_path):
    """The broker is down when kernels start: by default they run CPU-only (every GPU hidden) and
    the server says why; with GPUPOOL_WHEN_UNAVAILABLE=refuse no kernel process runs at all."""
    harness = BrokerHarness(tmp_path).start()
    harness.add_user("alice-hub-token", "alice")
    harness.add_user("bob-hub-token", "bob")
    url = harness.url
    alice = Server(tmp_path, "alice", url, "alice-hub-token")
    bob = Server_with(tmp_path, "bob", url, "bob-hub-token", GPUPOOL_WHEN_UNAVAILABLE="refuse")
    try:
        harness.stop()
        kernel_id = alice.call("POST", "api/kernels", {"name": "python3"})["id"]
        status = wait_for(
            lambda: (s := alice.call("GET", f"api/gpupool/kernels/{kernel_id}"))["state"] == "unavailable" and s,
            timeout=30,
            what="alice's kernel to start CPU-only",
        )
        assert "is not reachable" in status["reason"] and "CPU-only" in status["enforcement"]["description"]
        log = (tmp_path / "alice" / "server.log").read_text()
        assert f"kernel {kernel_id} starts CPU-only (CUDA_VISIBLE_DEVICES='')" in log

        with pytest.raises(urllib.error.HTTPError) as refused:  # refused at once: the call's own error
            bob.call("POST", "api/kernels", {"name": "python3"})
        assert refused.value.code == 503, refused.value
        message = json.loads(refused.value.read())["message"]
        assert "unavailable" in message and "is not reachable" in message, message
        assert bob.call("GET", "api/kernels") == []  # never launched, nothing left behind
        bob_log = (tmp_path / "bob" / "server.log").read_text()
        assert "IPKernelApp" not in bob_log  # no kernel process was launched
    finally:
        alice.stop()
        bob.stop()


def Hub_user_server(tmp: Path, user: str, broker_url: str, token: str, scopes: tuple[str, ...] = ()) -> BaseServer:
    """A user's server as a hub runs it: its token is that user's, with the scopes the hub granted."""
    tests_dir = str(Path(__file__).parent)
    env: dict[str, str | None] = {"GPUPOOL_URL": broker_url, "GPUPOOL_TOKEN": token, "GPUPOOL_DB": None, "GPUPOOL_SIMULATE": None}
    env["PYTHONPATH"] = os.pathsep.join([os.environ.get("PYTHONPATH", ""), tests_dir])
    args = (
        "--ServerApp.identity_provider_class=named_user_identity.NamedUserIdentityProvider",
        f"--NamedUserIdentityProvider.username={user}",
        *(f"--NamedUserIdentityProvider.scopes={scope}" for scope in scopes),
    )
    return BaseServer(tmp, user, env, args)


def test_an_admins_own_server_sees_and_releases_another_users_kernel(tmp_path):
    """The docs: admins may act on any kernel. Through their own server, by kernel id, the broker
    deciding who is an admin; a non-admin's server still gets 403/404 for someone else's kernel."""
    harness = BrokerHarness(tmp_path).start()
    servers: list[BaseServer] = []
    try:
        harness.add_user("teacher-hub-token", "teacher", admin=True)
        harness.add_user("bob-hub-token", "bob")
        teacher = Hub_user_server(tmp_path, "teacher", harness.url, "teacher-hub-token", scopes=("custom:gpupool:admin",))
        bob = Hub_user_server(tmp_path, "bob", harness.url, "bob-hub-token")
        servers += [teacher, bob]
        assert teacher.call("GET", "api/gpupool/pool")["viewer"] == {"name": "teacher", "admin": True}
        bobs = bob.call("POST", "api/kernels", {"name": "python3"})["id"]
        teachers = teacher.call("POST", "api/kernels", {"name": "python3"})["id"]

        def lease_of(kernel_id: str) -> Any:
            return harness.on_broker(harness.pool.lease_for_kernel, kernel_id)

        wait_for(lambda: all((l := lease_of(k)) and l.state is LeaseState.GRANTED for k in (bobs, teachers)), what="grants")
        status = teacher.call("GET", f"api/gpupool/kernels/{bobs}")  # 404 before: the broker was asked for teacher's only
        assert status["state"] == "granted" and status["lease_id"] == lease_of(bobs).id
        # Bob, no admin, learns nothing of the teacher's kernel through his server.
        for method, path in (("GET", f"api/gpupool/kernels/{teachers}"), ("POST", f"api/gpupool/kernels/{teachers}/release")):
            with pytest.raises(urllib.error.HTTPError) as denied:
                bob.call(method, path)
            assert denied.value.code in (403, 404)
        assert lease_of(teachers).state is LeaseState.GRANTED
        released = teacher.call("POST", f"api/gpupool/kernels/{bobs}/release")
        assert released["state"] == "released"
        assert harness.on_broker(harness.pool.last_lease_for_kernel, bobs).state is LeaseState.RELEASED
    finally:
        for server in servers:
            server.stop()
        harness.stop()
