"""RemotePool: URL forms, error mapping, no silent fallback, and the kernel client over a broker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import BrokerHarness
from server_process import free_port

from jupyter_gpupool.backends.factory import pool_from_env
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool, _Endpoint
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.errors import InvalidInput, NotAuthorized, PoolUnavailable
from jupyter_gpupool.units import GIB


@pytest.mark.parametrize(
    ("url", "unix", "prefix", "host", "port"),
    [
        ("http://127.0.0.1:10101/services/gpupool", "", "/services/gpupool/", "127.0.0.1", 10101),
        ("https://hub.example.org/services/gpupool/", "", "/services/gpupool/", "hub.example.org", None),
        ("http://localhost:8000", "", "/", "localhost", 8000),
        ("unix:///run/jupyter-gpupool/broker.sock", "/run/jupyter-gpupool/broker.sock", "/", "", None),
        ("unix:/run/gpupool.sock", "/run/gpupool.sock", "/", "", None),
        ("http+unix://%2Frun%2Fgpupool.sock/prefix", "/run/gpupool.sock", "/prefix/", "", None),
    ],
)
def test_url_forms(url: str, unix: str, prefix: str, host: str, port: int | None) -> None:
    endpoint = _Endpoint(url)
    assert (endpoint.socket_path, endpoint.prefix, endpoint.host, endpoint.port) == (unix, prefix, host, port)


@pytest.mark.parametrize("url", ["ftp://x", "127.0.0.1:10101", "http://", "unix://", "http://h:notaport/"])
def test_bad_urls_name_the_accepted_forms(url: str) -> None:
    with pytest.raises(InvalidInput, match="unix:///PATH"):
        _Endpoint(url)


def test_pool_from_env_picks_the_broker_and_never_falls_back(tmp_path: Path) -> None:
    env = {
        "GPUPOOL_URL": f"unix://{tmp_path}/nobody-listens.sock",
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DB": str(tmp_path / "p.sqlite"),
    }
    pool = pool_from_env(environ=env)
    assert isinstance(pool, RemotePool)
    with pytest.raises(PoolUnavailable, match="not reachable .*no socket.*unset GPUPOOL_URL"):
        pool.request(LeaseRequest(owner="x", memory=GIB))
    with pytest.raises(PoolUnavailable):
        pool_from_env(environ=env, check=True)
    assert not (tmp_path / "p.sqlite").exists(), "no local pool was opened behind the user's back"
    local = pool_from_env(environ={k: v for k, v in env.items() if k != "GPUPOOL_URL"})
    assert isinstance(local, Pool)
    local.close()


def test_refused_tcp_port_is_pool_unavailable() -> None:
    port = free_port()  # outside the ephemeral range: no other process's connection answers on it
    pool = RemotePool(f"http://127.0.0.1:{port}/services/gpupool", token="t", timeout=5)
    with pytest.raises(PoolUnavailable, match="connection refused"):
        pool.devices()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerHarness]:
    h = BrokerHarness(tmp_path).start()
    h.add_user("tok-alice", "alice", groups=("cs101",))
    yield h
    h.stop()


def test_missing_token_says_which_variable_to_set(broker: BrokerHarness) -> None:
    with pytest.raises(NotAuthorized, match="GPUPOOL_TOKEN or JUPYTERHUB_API_TOKEN"):
        RemotePool(broker.url).devices()
    with pytest.raises(NotAuthorized, match="forged, expired or revoked"):
        RemotePool(broker.url, token="nope").devices()


def test_remote_pool_is_a_drop_in_for_the_provisioner(broker: BrokerHarness) -> None:
    """What GpuPoolProvisioner calls: preference, parse_memory, default_memory, request, await_grant, devices."""
    import asyncio

    pool = RemotePool.from_env({"GPUPOOL_URL": broker.url, "JUPYTERHUB_API_TOKEN": "tok-alice"})
    assert pool.preference("alice") == {}
    assert pool.parse_memory("4GiB") == 4 * GIB and pool.default_memory() == 8 * GIB
    assert pool.policy.heartbeat_ttl > 0 and pool.backend.name == "remote"
    first = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, kernel_id="k1"))
    pool.request(LeaseRequest(owner="alice", memory=8 * GIB, kernel_id="k2"))
    third = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, kernel_id="k3"))
    assert third.state is LeaseState.QUEUED
    seen = []

    async def wait() -> LeaseState:
        task = asyncio.ensure_future(
            pool.await_grant(third.id, timeout=20, on_update=lambda lease, info: seen.append(info.position))
        )
        await asyncio.sleep(0.3)
        await asyncio.to_thread(pool.release, first.id, "kernel shut down")
        return (await task).state

    assert asyncio.run(wait()) is LeaseState.GRANTED
    assert seen and seen[0] == 1
    assert pool.lease_for_kernel("k3").id == third.id
    assert pool.lease_for_kernel("k1") is None and pool.last_lease_for_kernel("k1").id == first.id
    assert {d.uuid for d in pool.devices()} == set(pool.get(third.id).devices)
    assert pool.client_env() == {"GPUPOOL_URL": broker.url}
    with pytest.raises(TimeoutError):
        blocked = pool.request(LeaseRequest(owner="alice", memory=8 * GIB))
        pool.wait_for_grant(blocked.id, timeout=0.5)


def test_kernel_client_magics_work_through_the_broker(broker: BrokerHarness) -> None:
    """``%gpupool`` in a kernel uses kernel.client.connect(), which picks the broker client."""
    from jupyter_gpupool.kernel.client import connect

    pool = broker.remote("tok-alice")
    lease = pool.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="kern-1"))
    env = {
        "GPUPOOL_URL": broker.url,
        "JUPYTERHUB_API_TOKEN": "tok-alice",
        "GPUPOOL_LEASE_ID": lease.id,
        "GPUPOOL_KERNEL_ID": "kern-1",
    }
    client = connect(env)
    status = client.status()
    assert status.lease is not None and status.lease.id == lease.id
    resized = client.reserve("4GiB", "1h")
    assert resized.memory == 4 * GIB and resized.keep_until is not None
    assert env["GPUPOOL_MEMORY_LIMIT"] == str(4 * GIB)
    released = client.release()
    assert released.state is LeaseState.RELEASED
    renewed = client.reserve("2GiB")
    assert renewed.owner == "alice" and renewed.kernel_id == "kern-1" and renewed.state is LeaseState.GRANTED


@pytest.mark.parametrize("method", ["suspend", "resume", "confirm_transition", "fail_transition"])
def test_remote_suspend_methods_take_the_local_pools_arguments(method: str) -> None:
    """The server calls these on whichever pool it has: the same parameters, defaults included."""
    import inspect

    assert inspect.signature(getattr(RemotePool, method)) == inspect.signature(getattr(Pool, method))


def test_remote_suspend_errors_are_the_local_pools(broker: BrokerHarness) -> None:
    from jupyter_gpupool.core.models import Transition
    from jupyter_gpupool.errors import LeaseNotFound, RequestRefused

    pool = broker.remote("tok-alice")
    plain = pool.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-plain"))
    able = pool.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-able", suspendable=True))
    assert able.suspendable and not plain.suspendable, "the request carries suspendable to the broker"
    with pytest.raises(RequestRefused, match="cannot suspend this kernel: its server cannot park GPU memory"):
        pool.suspend(plain.id)
    for call in (pool.suspend, pool.resume, pool.confirm_transition):
        with pytest.raises(LeaseNotFound):
            call("l-no-such-lease")
    with pytest.raises(InvalidInput, match="not being suspended, restored or moved"):
        pool.fail_transition(able.id, "boom", still_running=True)
    assert pool.suspend(able.id, reason="lunch").transition is Transition.SUSPENDING
    with pytest.raises(RequestRefused, match="it is suspending"):
        pool.suspend(able.id)
    assert pool.fail_transition(able.id, "x" * 800 + "\nmore", still_running=True).state is LeaseState.GRANTED


class _ScriptedChanges(RemotePool):
    """A RemotePool whose long polls follow a script, to hit one exact interleaving that a real
    broker's timing cannot be made to show on demand (the change follower is the code under test)."""

    def __init__(self, script: list[object]) -> None:
        super().__init__("http://127.0.0.1:9", token="t")
        self.script = script
        self.retry_initial = 0.01
        self.asked = threading.Event()

    def wait_for_change(self, since: int | None, timeout: float) -> int:
        if not self.script:
            self.asked.set()
            time.sleep(0.05)
            return since or 0
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        assert isinstance(step, int)
        return step


def test_the_first_answer_after_a_broker_outage_is_looked_at_even_if_nothing_changes_after_it() -> None:
    """Down, then back with version 7, which holds a decision taken after the follower's last look:
    the follower must look again after that first answer, or the decision waits for a tick."""
    looks: list[float] = []
    remote = _ScriptedChanges([PoolUnavailable("connection refused"), 7])
    stop = remote.subscribe_changes(lambda: looks.append(time.monotonic()))
    try:
        assert remote.asked.wait(10), "the follower never polled again"
    finally:
        stop()
    assert len(looks) == 2, looks  # once after the outage's backoff, once after the first answer


def test_elastic_slices_work_through_the_broker(broker: BrokerHarness) -> None:
    """A limit on a request and on a resize, and a grow, decided by the broker as the local pool decides
    them; each refusal says why and changes nothing."""
    from jupyter_gpupool.errors import RequestRefused

    pool = broker.remote("tok-alice")
    lease = pool.request(LeaseRequest(owner="", memory=2 * GIB, kernel_id="k-elastic", burst_limit=6 * GIB))
    assert (lease.guarantee_size, lease.limit_size, lease.memory) == (2 * GIB, 6 * GIB, 2 * GIB)
    grown = pool.grow(lease.id, 5 * GIB)
    assert grown.memory >= 5 * GIB and grown.guarantee_size == 2 * GIB and "grown to" in grown.burst_note
    assert pool.grow(lease.id, GIB).memory == grown.memory, "a slice that large already stays as it is"
    with pytest.raises(RequestRefused, match="its limit is 6 GiB"):
        pool.grow(lease.id, 7 * GIB)
    relimited = pool.resize(lease.id, memory=3 * GIB, limit=12 * GIB)
    assert (relimited.guarantee_size, relimited.burst_limit) == (3 * GIB, 12 * GIB)
    fixed = pool.resize(lease.id, limit=0)
    assert not fixed.elastic and fixed.guarantee_size == 3 * GIB
    with pytest.raises(RequestRefused, match="it is fixed at 3 GiB"):
        pool.grow(lease.id, 4 * GIB)
    with pytest.raises(InvalidInput, match="limit 1 GiB is below the slice's size 3 GiB"):
        pool.resize(lease.id, limit=GIB)
    assert pool.get(lease.id).burst_limit == 0, "a refused limit changed the slice"
    fixed_request = pool.request(LeaseRequest(owner="", memory=GIB, kernel_id="k-fixed", burst_limit=0))
    assert not fixed_request.elastic


def test_a_grow_that_waits_says_its_place_in_line_through_the_broker(broker: BrokerHarness) -> None:
    """The broker keeps a grow refused for room in line, and says where it stands there."""
    from jupyter_gpupool.errors import RequestRefused

    pool = broker.remote("tok-alice")
    first = pool.request(LeaseRequest(owner="", memory=10 * GIB, kernel_id="k-wants"))
    beside = pool.request(LeaseRequest(owner="", memory=5 * GIB, kernel_id="k-beside"))
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(first.id, 14 * GIB)
    waiting = pool.get(first.id)
    assert waiting.grow_wanted == 14 * GIB and waiting.grow_since is not None
    assert (pool.grow_place(first.id), pool.grow_place(beside.id)) == (1, None)


def test_the_kernel_asks_for_a_limit_and_grows_through_the_broker(broker: BrokerHarness) -> None:
    """``%gpupool reserve 4GiB --limit 12GiB`` and a framework cap's grow, in a kernel behind a broker."""
    from jupyter_gpupool.kernel.client import connect

    lease = broker.remote("tok-alice").request(LeaseRequest(owner="", memory=2 * GIB, kernel_id="kern-e"))
    env = {"GPUPOOL_URL": broker.url, "JUPYTERHUB_API_TOKEN": "tok-alice", "GPUPOOL_LEASE_ID": lease.id,
           "GPUPOOL_KERNEL_ID": "kern-e"}
    client = connect(env)
    reserved = client.reserve("4GiB", limit="12GiB")
    assert (reserved.guarantee_size, reserved.burst_limit) == (4 * GIB, 12 * GIB)
    grown = client.grow(9 * GIB)
    assert grown.memory >= 9 * GIB and env["GPUPOOL_MEMORY_LIMIT"] == str(grown.memory)
