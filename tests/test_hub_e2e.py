"""End to end with a real JupyterHub (pip ``jupyterhub``, npm ``configurable-http-proxy``).

The broker runs as a hub-managed service on a simulated ``1x16GiB`` pool with an 8 GiB default.
Users and groups live in the hub; the test mints each user's token through the hub's REST API
(as a single-user server's ``JUPYTERHUB_API_TOKEN`` would be) and drives the broker through the
hub's proxy with :class:`~jupyter_gpupool.backends.remote.RemotePool`, the client servers and kernels use.
What is under test is the broker's authentication and authorization against the real hub, the one
shared pool, group quotas from hub groups, and a SIGKILLed broker coming back (restarted by the
hub) with every lease intact.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import free_port

from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.errors import NotAuthorized
from jupyter_gpupool.units import GIB

pytestmark = [pytest.mark.hub, pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parent.parent
SERVICE_TOKEN = "e2e-test-admin-service-token-0123456789"
OTHER_SERVICE_TOKEN = "e2e-other-service-token-0123456789"


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, http.client.HTTPException, ValueError) as err:
            last = err
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}" + (f" (last error: {last})" if last else ""))


class Hub:
    """A JupyterHub process with the broker as a managed service."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.broker_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "hub.log"

    def write_config(self) -> Path:
        broker_config = self.workdir / "broker_config.py"
        broker_config.write_text(
            textwrap.dedent(
                """
                c.PoolPolicy.group_quotas = {"cs102": {"maximum": "4GiB"}}
                c.PoolPolicy.heartbeat_ttl = 600
                c.Broker.tick_interval = 0.5
                c.HubIdentity.cache_seconds = 0
                """
            )
        )
        command = [
            sys.executable,
            "-m",
            "jupyter_gpupool.broker",
            "--simulate=1x16GiB",
            f"--db={self.workdir / 'pool.sqlite'}",
            f"--config={broker_config}",
        ]
        config = self.workdir / "jupyterhub_config.py"
        config.write_text(
            textwrap.dedent(
                f"""
                c.JupyterHub.ip = "127.0.0.1"
                c.JupyterHub.port = {self.port}
                c.JupyterHub.hub_ip = "127.0.0.1"
                c.JupyterHub.hub_port = {self.hub_port}
                c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.proxy_api_port}"
                c.ConfigurableHTTPProxy.should_start = True
                c.JupyterHub.authenticator_class = "dummy"
                c.Authenticator.allowed_users = {{"alice", "bob", "carol", "dave", "prof"}}
                c.JupyterHub.db_url = "sqlite:///{self.workdir / "jupyterhub.sqlite"}"
                c.JupyterHub.cookie_secret_file = "{self.workdir / "cookie_secret"}"
                c.JupyterHub.custom_scopes = {{
                    "custom:gpupool:admin": {{"description": "See every GPU lease with its user; release or resize any."}},
                }}
                c.JupyterHub.load_groups = {{
                    "cs101": {{"users": ["alice", "bob"]}},
                    "cs102": {{"users": ["carol", "dave"]}},
                }}
                c.JupyterHub.services = [
                    {{
                        "name": "gpupool",
                        "url": "http://127.0.0.1:{self.broker_port}",
                        "command": {command!r},
                        "environment": {{"GPUPOOL_DEFAULT_MEMORY": "8GiB", "PYTHONPATH": {str(REPO)!r},
                                         "GPUPOOL_BROKER_FILE": {os.environ.get("GPUPOOL_BROKER_FILE", "none")!r}}},
                    }},
                    {{"name": "e2e-admin", "api_token": "{SERVICE_TOKEN}"}},
                    {{"name": "other", "api_token": "{OTHER_SERVICE_TOKEN}"}},
                ]
                c.JupyterHub.load_roles = [
                    {{"name": "user", "scopes": ["self", "access:services!service=gpupool"]}},
                    {{"name": "gpupool-admin", "scopes": ["custom:gpupool:admin", "access:services!service=gpupool"], "users": ["prof"]}},
                    {{"name": "e2e-admin", "scopes": ["admin:users", "admin:groups", "tokens"], "services": ["e2e-admin"]}},
                ]
                """
            )
        )
        return config

    def start(self) -> None:
        config = self.write_config()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "JUPYTERHUB_"))}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(config)],
                cwd=self.workdir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(lambda: self.api("GET", "/hub/api/")[0] == 200, 90, "the hub's API")
        wait_for(lambda: self.broker_status() == 401, 60, "the broker service")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    # --- HTTP through the hub's proxy --------------------------------------------------------------
    def api(self, method: str, path: str, token: str = SERVICE_TOKEN, body: Any = None) -> tuple[int, Any]:
        return http_call(self.port, method, path, token, body)

    def broker_status(self) -> int:
        return http_call(self.port, "GET", "/services/gpupool/api/gpupool/whoami", None)[0]

    @property
    def broker_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/services/gpupool"

    def token(self, user: str, scopes: list[str], expires_in: int | None = None) -> str:
        body: dict[str, Any] = {"scopes": scopes, "note": "e2e"}
        if expires_in:
            body["expires_in"] = expires_in
        status, data = self.api("POST", f"/hub/api/users/{user}/tokens", body=body)
        assert status in (200, 201), (status, data)
        return str(data["token"])

    def broker_pid(self) -> int:
        import psutil

        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "jupyter_gpupool.broker" in " ".join(child.cmdline()):
                    return int(child.pid)
            except psutil.Error:
                continue
        raise AssertionError("no broker process under the hub")


def http_call(port: int, method: str, path: str, token: str | None, body: Any = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"token {token}"} if token else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        payload = json.loads(raw) if raw else None
    except ValueError:
        payload = raw.decode(errors="replace")
    return response.status, payload


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    if shutil.which("configurable-http-proxy") is None:
        pytest.skip("configurable-http-proxy is not installed (npm install -g configurable-http-proxy@5)")
    pytest.importorskip("jupyterhub")
    hub = Hub(tmp_path_factory.mktemp("hub"))
    try:
        hub.start()
    except BaseException:
        print(hub.log())
        hub.stop()
        raise
    yield hub
    hub.stop()


ACCESS = ["access:services!service=gpupool"]


def test_two_hub_users_share_the_broker_pool(hub: Hub) -> None:
    alice = RemotePool(hub.broker_url, token=hub.token("alice", ACCESS))
    bob = RemotePool(hub.broker_url, token=hub.token("bob", ACCESS))
    admin = RemotePool(hub.broker_url, token=hub.token("prof", [*ACCESS, "custom:gpupool:admin"]))
    assert alice.whoami() == {"name": "alice", "groups": ["cs101"], "admin": False, "kind": "user"}
    assert admin.whoami()["admin"] is True

    # Each user's kernels get leases from the one pool; the third across both users queues.
    a1 = alice.request(LeaseRequest(owner="", memory=alice.default_memory(), kernel_id="alice-k1"))
    b1 = bob.request(LeaseRequest(owner="", memory=bob.default_memory(), kernel_id="bob-k1"))
    a2 = alice.request(LeaseRequest(owner="", memory=alice.default_memory(), kernel_id="alice-k2"))
    assert (a1.owner, b1.owner, a2.owner) == ("alice", "bob", "alice")
    assert [a1.state, b1.state, a2.state] == [LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED]
    info = alice.queue_info(a2.id)
    assert info is not None and info.position == 1

    # Alice's token can neither read, resize nor release Bob's lease; the admin's can.
    for attempt in (
        lambda: alice.get(b1.id),
        lambda: alice.resize(b1.id, memory=4 * GIB),
        lambda: alice.release(b1.id),
    ):
        with pytest.raises(NotAuthorized):
            attempt()
    for method, path in (
        ("GET", f"leases/{b1.id}"),
        ("POST", "kernels/bob-k1/reserve"),
        ("POST", "kernels/bob-k1/release"),
    ):
        status, _ = http_call(
            hub.port, method, f"/services/gpupool/api/gpupool/{path}", alice.token, {"memory": "4GiB"}
        )
        assert status == 403, (method, path, status)
    assert bob.get(b1.id).state is LeaseState.GRANTED and bob.get(b1.id).memory == 8 * GIB
    assert admin.get(b1.id).owner == "bob"
    assert admin.resize(b1.id, memory=6 * GIB).memory == 6 * GIB

    # Every route refuses no / forged / expired / other-service tokens and changes nothing.
    expired = hub.token("alice", ACCESS, expires_in=1)
    wait_for(lambda: hub.api("GET", "/hub/api/user", token=expired)[0] == 403, 30, "the short token to expire")
    no_scope = hub.token("alice", ["read:users:name!user=alice"])
    before = (
        sorted((l.to_json() for l in admin.leases(owner=None, include_released=True)), key=lambda d: d["id"]),
        admin.events(),
    )
    routes = [
        ("GET", "whoami"),
        ("GET", "info"),
        ("GET", "pool"),
        ("GET", "devices"),
        ("GET", "queue"),
        ("GET", "leases"),
        ("POST", "leases"),
        ("GET", f"leases/{b1.id}"),
        ("DELETE", f"leases/{b1.id}"),
        ("POST", f"leases/{b1.id}/resize"),
        ("POST", f"leases/{b1.id}/keepalive"),
        ("POST", f"leases/{b1.id}/activity"),
        ("GET", f"leases/{a2.id}/wait?timeout=0"),
        ("POST", "activity"),
        ("POST", "heartbeat"),
        ("POST", "reconcile"),
        ("POST", "tick"),
        ("GET", "kernels/bob-k1"),
        ("POST", "kernels/bob-k1/reserve"),
        ("POST", "kernels/bob-k1/release"),
        ("POST", "kernels/bob-k1/keepalive"),
        ("GET", "report"),
        ("GET", "reservations"),
        ("POST", "reservations"),
        ("GET", "preferences"),
        ("PATCH", "preferences"),
        ("GET", "events"),
        ("GET", "../../metrics"),
        ("GET", "nothing-here"),
    ]
    bodies = {"POST": {"memory": "4GiB", "holder_host": "h", "holder_pid": 1}, "PATCH": {"memory": "4GiB"}}
    for label, token, expected in (
        ("none", None, 401),
        ("forged", "forged-token-abcdef", 401),
        ("expired", expired, 401),
        ("other service", OTHER_SERVICE_TOKEN, 403),
        ("no access scope", no_scope, 403),
    ):
        for method, route in routes:
            path = (
                os.path.normpath(f"/services/gpupool/api/gpupool/{route}")
                if route.startswith("..")
                else f"/services/gpupool/api/gpupool/{route}"
            )
            status, payload = http_call(hub.port, method, path, token, bodies.get(method))
            assert status == expected, (label, method, route, status, payload)
    after = (
        sorted((l.to_json() for l in admin.leases(owner=None, include_released=True)), key=lambda d: d["id"]),
        admin.events(),
    )
    assert after == before

    # Bob gives his lease back: Alice's queued kernel gets it.
    bob.release(b1.id)
    assert alice.wait_for_grant(a2.id, timeout=30).state is LeaseState.GRANTED
    for lease in admin.leases():
        admin.release(lease.id, reason="end of the sharing test")


def test_group_quota_from_hub_groups(hub: Hub) -> None:
    carol = RemotePool(hub.broker_url, token=hub.token("carol", ACCESS))
    dave = RemotePool(hub.broker_url, token=hub.token("dave", ACCESS))
    c = carol.request(LeaseRequest(owner="", memory=4 * GIB))
    d = dave.request(LeaseRequest(owner="", memory=4 * GIB))
    assert c.state is LeaseState.GRANTED and c.groups == ("cs102",)
    assert d.state is LeaseState.QUEUED, "cs102 together may hold at most 4 GiB although the GPU has room"
    info = dave.queue_info(d.id)
    assert info is not None and "cs102" in info.reason
    carol.release(c.id)
    assert dave.wait_for_grant(d.id, timeout=30).state is LeaseState.GRANTED
    dave.release(d.id)


def test_broker_killed_comes_back_with_every_lease(hub: Hub) -> None:
    alice = RemotePool(hub.broker_url, token=hub.token("alice", ACCESS))
    bob = RemotePool(hub.broker_url, token=hub.token("bob", ACCESS))
    admin = RemotePool(hub.broker_url, token=hub.token("prof", [*ACCESS, "custom:gpupool:admin"]))
    alice.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="alice-r1"))
    bob.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="bob-r1"))
    queued = bob.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="bob-r2"))
    assert queued.state is LeaseState.QUEUED
    keys = ("id", "owner", "state", "memory", "devices", "kernel_id", "groups", "granted_at")
    before = sorted(({k: lease.to_json()[k] for k in keys} for lease in admin.leases()), key=lambda d: d["id"])
    assert len(before) == 3

    old_pid = hub.broker_pid()
    os.kill(old_pid, 9)
    # The broker is down: clients fail clearly, never silently.
    from jupyter_gpupool.errors import PoolUnavailable

    wait_for(lambda: hub.broker_status() in (502, 503), 10, "the proxy to notice the broker is gone")
    with pytest.raises((PoolUnavailable, NotAuthorized)) as failure:
        alice.leases()
    assert isinstance(failure.value, PoolUnavailable) or "broker" in str(failure.value)
    # The hub restarts its managed service (it polls every ~30 s); the store brings every lease back.
    wait_for(lambda: hub.broker_status() == 401, 90, "the hub to restart the broker")
    assert hub.broker_pid() != old_pid
    after = sorted(({k: lease.to_json()[k] for k in keys} for lease in admin.leases()), key=lambda d: d["id"])
    assert after == before
    assert bob.queue_info(queued.id) is not None
    for lease in admin.leases():
        admin.release(lease.id, reason="end of the restart test")
