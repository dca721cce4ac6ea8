"""Restarts and outages of the broker lose nothing and grant nothing twice.

The broker here is a real ``python -m jupyter_gpupool.broker`` process (hub identity through a
stand-in ``/hub/api/user``, and a Unix socket), killed with SIGKILL and started again on the same
pool file and port; servers are real ``jupyter server`` processes with real ipykernel kernels.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerProcess, JupyterServer, StandInHub, read_http_message, wait_until

from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow  # real brokers killed and restarted

ALICE = "alice-hub-token"


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    stand_in = StandInHub().start()
    stand_in.add_user(ALICE, "alice", groups=("cs101",))
    yield stand_in
    stand_in.stop()


@pytest.fixture
def brokers() -> Iterator[list[BrokerProcess]]:
    started: list[BrokerProcess] = []
    yield started
    for broker in started:
        broker.stop()


def queue_order(broker: BrokerProcess) -> list[str | None]:
    """Kernel ids of the queued leases, in the order the broker serves them."""
    pool = RemotePool(broker.url, token=ALICE, timeout=15)
    return [lease.kernel_id for lease in pool.queue()]


# --- 1. a queued kernel survives a SIGKILL of the broker ----------------------------------------------
@pytest.mark.slow
def test_queued_kernels_survive_a_broker_sigkill_and_are_granted_in_turn(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    ttl = 3.0
    broker = BrokerProcess(
        tmp_path, hub, config=f'c.PoolPolicy.default_memory = "10GiB"\nc.PoolPolicy.heartbeat_ttl = {ttl}\n'
    ).start()
    brokers.append(broker)
    server = JupyterServer(
        tmp_path,
        "alice",
        broker.url,
        ALICE,
        config={"GpuPoolExtension": {"tick_interval": 0.5, "reconcile_interval": 1}},
    )
    try:
        k1 = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_until(lambda: (l := broker.kernel_lease(k1)) and l.state is LeaseState.GRANTED, what="k1's grant")
        k2 = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_until(lambda: broker.kernel_lease(k2), what="k2's request")
        k3 = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_until(lambda: broker.kernel_lease(k3), what="k3's request")
        assert queue_order(broker) == [k2, k3]
        before = {lease.id: lease.kernel_id for lease in broker.leases()}

        broker.kill()
        time.sleep(ttl + 2)  # longer than the heartbeat TTL: every holder was cut off past it
        # Meanwhile the server keeps both kernels waiting (no kernel gave up, none ran without a slice).
        assert {k["id"] for k in server.call("GET", "api/kernels")} >= {k1, k2, k3}
        assert "gets no GPU slice" not in server.log_text()

        broker.start()
        time.sleep(ttl + 1)  # past the TTL again: the server's and the long polls' heartbeats are back
        leases = broker.leases()
        assert {lease.id: lease.kernel_id for lease in leases} == before, "no lease lost, none added"
        assert [lease.state for lease in leases] == [LeaseState.GRANTED, LeaseState.QUEUED, LeaseState.QUEUED], [
            (lease.kernel_id, lease.state, lease.release_reason) for lease in leases
        ]
        assert queue_order(broker) == [k2, k3], "the queue kept its order"

        server.call("DELETE", f"api/kernels/{k1}")
        granted = wait_until(
            lambda: (l := broker.kernel_lease(k2)) and l.state is LeaseState.GRANTED and l, what="k2's grant"
        )
        connection_file = server.root / "runtime" / f"kernel-{k2}.json"
        wait_until(connection_file.exists, what="k2 to launch")
        out = server.run_code(
            k2, "import os; print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['GPUPOOL_LEASE_ID'])"
        )
        assert out.split() == [granted.devices[0], granted.id]
        assert broker.kernel_lease(k3).state is LeaseState.QUEUED  # type: ignore[union-attr]
        live = [lease for lease in broker.leases() if lease.live]
        assert sorted(lease.kernel_id or "" for lease in live) == sorted([k2, k3])
        assert len({lease.kernel_id for lease in broker.leases()}) == len(broker.leases()), "one lease per kernel"
    finally:
        server.stop()


# --- leases of live holders get a heartbeat grace when the broker starts ----------------------------------
def test_broker_start_gives_live_leases_a_fresh_heartbeat_grace(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    ttl = 2.0
    broker = BrokerProcess(tmp_path, hub, config=f"c.PoolPolicy.heartbeat_ttl = {ttl}\n").start()
    brokers.append(broker)
    pool = RemotePool(broker.url, token=ALICE, timeout=15)
    held = pool.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-held", holder_pid=os.getpid()))
    queued = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-queued", holder_pid=os.getpid()))
    assert (held.state, queued.state) == (LeaseState.GRANTED, LeaseState.QUEUED)
    broker.kill()
    time.sleep(ttl + 1.5)
    broker.start()
    time.sleep(ttl / 2)  # several scheduler runs, all within the grace
    assert [lease.state for lease in broker.leases()] == [LeaseState.GRANTED, LeaseState.QUEUED]
    pool.heartbeat([held.id, queued.id])  # the holder is back in time
    time.sleep(ttl / 2 + 0.5)
    assert [lease.state for lease in broker.leases()] == [LeaseState.GRANTED, LeaseState.QUEUED]
    # A holder that never comes back still loses its slice, one TTL after the start.
    wait_until(lambda: all(not lease.live for lease in broker.leases()), timeout=ttl * 4, what="the expiry")
    assert all("no heartbeat" in lease.release_reason for lease in broker.leases())


# --- a RemotePool wait rides out the outage and says so -----------------------------------------------------
def test_wait_for_grant_retries_with_backoff_and_reports_the_outage(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    pool = RemotePool(broker.url, token=ALICE, timeout=5)
    pool.wait_chunk = 1.0
    first = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k1"))
    second = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k2"))
    assert second.state is LeaseState.QUEUED
    updates: list[str] = []
    result: dict[str, Any] = {}

    def wait() -> None:
        try:
            result["lease"] = pool.wait_for_grant(
                second.id, on_update=lambda lease, info: updates.append(info.reason if info else "")
            )
        except Exception as err:  # noqa: BLE001 - reported below
            result["error"] = err

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(1.5)
    broker.kill()
    wait_until(lambda: pool.availability()["state"] == "unavailable", timeout=10, what="the outage to show")
    # The long poll in flight drops first ("did not answer"), then the retries find nobody listening.
    wait_until(lambda: "not reachable" in pool.availability().get("reason", ""), timeout=10, what="a refused retry")
    down = pool.availability()
    assert down["retrying"] is True
    assert down["message"].startswith("pool unavailable, retrying in")
    wait_until(lambda: pool.availability()["attempts"] >= 3, timeout=15, what="a few retries")
    assert any(reason.startswith("pool unavailable, retrying") for reason in updates)
    assert waiter.is_alive() and not result, "the wait neither gave up nor returned"
    broker.start()
    RemotePool(broker.url, token=ALICE).release(first.id)
    waiter.join(30)
    assert result.get("lease") is not None and result["lease"].id == second.id, result
    assert result["lease"].state is LeaseState.GRANTED
    assert pool.availability() == {"state": "available"}


def test_wait_gives_up_after_the_outage_limit_with_a_clear_error(tmp_path: Path) -> None:
    pool = RemotePool(f"unix://{tmp_path}/nobody.sock", timeout=2)
    pool.outage_limit = 1.0
    started = time.monotonic()
    with pytest.raises(PoolUnavailable, match=r"not reachable.*still unreachable after retrying for"):
        pool.wait_for_grant("L-1")
    assert 0.9 <= time.monotonic() - started < 5
    assert pool.availability()["state"] == "unavailable" and pool.availability()["retrying"] is False


def test_retry_for_comes_from_the_environment() -> None:
    pool = RemotePool.from_env({"GPUPOOL_URL": "unix:///x.sock", "GPUPOOL_RETRY_FOR": "2m"})
    assert pool.outage_limit == 120
    from jupyter_gpupool.errors import InvalidInput

    with pytest.raises(InvalidInput, match="GPUPOOL_RETRY_FOR"):
        RemotePool.from_env({"GPUPOOL_URL": "unix:///x.sock", "GPUPOOL_RETRY_FOR": "soon"})


# --- a request retried after the broker committed it never makes a second lease --------------------------
class DropFirstAnswer:
    """A TCP proxy to the broker that forwards the first request but drops the connection instead of
    passing the answer back: what a client sees when the broker commits and then dies, or a network
    fault cuts the reply. Later connections are forwarded both ways."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._relay, args=(client, self.connections == 1), daemon=True).start()

    def _relay(self, client: socket.socket, drop_answer: bool) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.target))
        client.settimeout(10)
        upstream.settimeout(10)
        try:
            request = read_http_message(client)
            upstream.sendall(request)
            answer = read_http_message(upstream)
            if not drop_answer:
                client.sendall(answer)
        finally:
            upstream.close()
            client.close()

    def close(self) -> None:
        self.listener.close()


def test_a_kernel_request_retried_after_a_lost_answer_gets_the_same_lease(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    proxy = DropFirstAnswer(broker.port)
    try:
        pool = RemotePool(f"http://127.0.0.1:{proxy.port}/services/gpupool", token=ALICE, timeout=10)
        lease = pool.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-once", holder_pid=os.getpid()))
        assert proxy.connections == 2, "the first answer was lost and the request tried again"
        leases = broker.leases()
        assert [(l.id, l.kernel_id) for l in leases] == [(lease.id, "k-once")], "one lease, not two"
        assert lease.state is LeaseState.GRANTED
    finally:
        proxy.close()


def test_a_request_without_a_kernel_is_not_repeated_once_sent_and_says_where_to_look(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    proxy = DropFirstAnswer(broker.port)
    try:
        pool = RemotePool(f"http://127.0.0.1:{proxy.port}/services/gpupool", token=ALICE, timeout=10)
        with pytest.raises(PoolUnavailable, match="may have been queued.*jupyter gpupool leases"):
            pool.request(LeaseRequest(owner="", memory=8 * GIB, label="cli"))
        assert proxy.connections == 1, "not repeated: the broker may have committed it"
        assert len(broker.leases()) == 1
    finally:
        proxy.close()


def test_the_broker_answers_a_kernels_live_lease_instead_of_a_second_one(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    pool = RemotePool(broker.url, token=ALICE)
    first = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-same"))
    again = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-same"))
    assert again.id == first.id and len(broker.leases()) == 1
    pool.release(first.id)
    fresh = pool.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-same"))
    assert fresh.id != first.id, "a released lease is not reused: the kernel queues anew"


# --- 3. the pool file and its WAL are the broker's alone ------------------------------------------------------
def test_pool_file_wal_shm_and_folder_are_owner_only(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    folder = tmp_path / "state" / "gpupool"
    broker = BrokerProcess(tmp_path, hub, db=str(folder / "pool.sqlite")).start()
    brokers.append(broker)
    pool = RemotePool(broker.url, token=ALICE)
    for i in range(3):
        pool.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id=f"k{i}"))
    for path in (broker.db, f"{broker.db}-wal", f"{broker.db}-shm"):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path} has mode {mode:o}"
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    # The socket stays reachable for every user (they are told apart by uid).
    assert stat.S_IMODE(os.stat(broker.socket_path).st_mode) == 0o666


def test_looser_pool_files_left_by_an_older_broker_are_tightened(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    RemotePool(broker.url, token=ALICE).request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k"))
    broker.kill()  # leaves -wal and -shm behind
    for path in (broker.db, f"{broker.db}-wal", f"{broker.db}-shm"):
        os.chmod(path, 0o644)
    broker.start()
    for path in (broker.db, f"{broker.db}-wal", f"{broker.db}-shm"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert "was readable by other users" in broker.log()
    assert [lease.kernel_id for lease in broker.leases()] == ["k"]


def test_calls_retry_a_refused_connection_briefly_and_the_outage_clears_on_the_next_answer(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    broker = BrokerProcess(tmp_path, hub)
    pool = RemotePool(broker.url, token=ALICE, timeout=5)
    started = time.monotonic()
    with pytest.raises(PoolUnavailable, match="not reachable"):
        pool.request(LeaseRequest(owner="", memory=GIB, label="cli"))  # never sent: safe to try again
    assert pool.availability()["attempts"] == 1 + pool.call_retries
    assert time.monotonic() - started >= 0.5, "it waited between tries"
    assert pool.availability()["retrying"] is False
    brokers.append(broker.start())
    with pytest.raises(Exception, match="no lease"):
        pool.get("l-unknown")  # a refusal is an answer: the broker is reachable again
    assert pool.availability() == {"state": "available"}


# --- a second broker never takes over a running one's socket or port ------------------------------------
def test_a_second_broker_refuses_a_socket_or_port_still_served(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    first = BrokerProcess(tmp_path, hub).start()
    brokers.append(first)
    lease = RemotePool(first.socket_url).request(LeaseRequest(owner="", memory=GIB, kernel_id="k"))
    other = tmp_path / "other"
    other.mkdir()
    same_socket = BrokerProcess(other, hub, socket_path=first.socket_path)
    brokers.append(same_socket)
    assert same_socket.run_until_exit() == 2
    assert "another broker is serving on" in same_socket.log() and "Traceback" not in same_socket.log()
    same_port = BrokerProcess(other, hub, socket_path=str(other / "b.sock"))
    same_port.port = first.port
    brokers.append(same_port)
    assert same_port.run_until_exit() == 2
    assert "cannot listen on" in same_port.log() and "Traceback" not in same_port.log()
    # The first broker still serves both, with its lease.
    assert RemotePool(first.socket_url).get(lease.id).state is LeaseState.GRANTED
    assert RemotePool(first.url, token=ALICE).whoami()["name"] == "alice"
    # After a SIGKILL its dead socket file is replaced by the next broker.
    first.kill()
    assert os.path.exists(first.socket_path)
    first.start()
    assert RemotePool(first.socket_url).get(lease.id).state is LeaseState.GRANTED


# --- a queued kernel's user sees the outage, not silence ------------------------------------------------
@pytest.mark.slow
def test_a_queued_kernel_says_pool_unavailable_retrying_over_rest_while_the_broker_is_down(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    """The provisioner passes the broker client's retry notice on (it re-notified only on a new place in
    the queue): the kernel's REST status stays queued, with "pool unavailable, retrying in N s: ..."."""
    broker = BrokerProcess(tmp_path, hub, config='c.PoolPolicy.default_memory = "10GiB"\n').start()
    brokers.append(broker)
    server = JupyterServer(
        tmp_path, "alice", broker.url, ALICE, config={"GpuPoolExtension": {"tick_interval": 0.5}}
    )
    try:
        k1 = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_until(lambda: (l := broker.kernel_lease(k1)) and l.state is LeaseState.GRANTED, what="k1's grant")
        k2 = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_until(
            lambda: server.call("GET", f"api/gpupool/kernels/{k2}").get("state") == "queued", what="k2 to queue"
        )
        broker.kill()

        def retrying() -> dict[str, Any] | None:
            body = server.call("GET", f"api/gpupool/kernels/{k2}")
            return body if str(body.get("queue_reason") or "").startswith("pool unavailable, retrying") else None

        body = wait_until(retrying, timeout=60, what="the retry notice in k2's status")
        assert body["state"] == "queued" and body["queue_position"] == 1, body
        assert body["reason"] == body["queue_reason"]
        broker.start()
        wait_until(lambda: not retrying(), timeout=60, what="the notice to clear once the broker is back")
        assert server.call("GET", f"api/gpupool/kernels/{k2}")["state"] == "queued"  # still in its turn
    finally:
        server.stop()


# --- a kernel start during a broker outage never stalls the server's event loop -----------------------
@pytest.mark.slow
def test_a_kernel_start_while_the_broker_hangs_leaves_the_server_responsive(
    tmp_path: Path, hub: StandInHub, brokers: list[BrokerProcess]
) -> None:
    import signal

    broker = BrokerProcess(tmp_path, hub).start()
    brokers.append(broker)
    server = JupyterServer(
        tmp_path, "alice", broker.url, ALICE, config={"GpuPoolExtension": {"tick_interval": 0.5, "reconcile_interval": 1}}
    )
    assert broker.proc is not None
    try:
        server.call("GET", "api/status")
        broker.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing: the worst outage
        started_kernel: dict[str, Any] = {}
        # The start waits for the pool's answer (a start returns started, or pending once queued):
        # made from a thread, as a browser's request is made beside its others.
        post = threading.Thread(target=lambda: started_kernel.update(server.call("POST", "api/kernels", {"name": "python3"})))
        try:
            post.start()
            slowest = 0.0
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                started = time.monotonic()
                server.call("GET", "api/status")  # jupyter_server's own endpoint: no pool call in it
                slowest = max(slowest, time.monotonic() - started)
                time.sleep(0.1)
            assert slowest < 1.0, f"the server's event loop stalled {slowest:.1f} s while a kernel waited on the broker"
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        post.join(90)
        kernel_id = started_kernel["id"]
        wait_until(lambda: (l := broker.kernel_lease(kernel_id)) and l.state is LeaseState.GRANTED, what="the grant")
    finally:
        server.stop()


# --- a SIGTERM as soon as the broker's port answers stops it cleanly -----------------------------------
def test_a_sigterm_right_after_the_port_answers_stops_the_broker_cleanly(tmp_path: Path) -> None:
    """The signal handlers used to be installed after the port listened: a supervisor (or a test) that
    stopped the broker the moment it answered killed it mid-start (exit -15), leaving its socket."""
    import signal
    import subprocess
    import sys

    from server_process import free_port

    for attempt in range(3):
        port = free_port()
        env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / f"p{attempt}.sqlite")}
        env.pop("JUPYTERHUB_API_TOKEN", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_gpupool.broker", f"--port={port}", "--ip=127.0.0.1", "--hub=off"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert proc.poll() is None, "the broker exited while starting"
            time.sleep(0.002)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
