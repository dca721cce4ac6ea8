"""Suspend over the broker (issue 12): a user's server suspends, confirms, resumes and confirms the
restore of its kernel's lease through ``RemotePool``; another user's valid token can do none of it;
a confirmation repeated after a lost answer is harmless; /metrics counts it all.

Real broker (handlers, hub-token identity, its pool on SQLite) behind a stand-in hub, as in
``tests/test_broker.py``; the lost answer is a real TCP proxy that drops the connection after the
broker committed the request.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerHarness, BrokerProcess, StandInHub, read_http_message
from pool_helpers import start_kernel_process
from prometheus_client.parser import text_string_to_metric_families

from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState, Transition
from jupyter_gpupool.errors import InvalidInput, NotAuthorized, PoolUnavailable, RequestRefused
from jupyter_gpupool.units import GIB

ALICE, BOB, ADMIN = "tok-alice", "tok-bob", "tok-admin"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[BrokerHarness]:
    h = BrokerHarness(tmp_path, simulate="1x16GiB").start()
    h.add_user(ALICE, "alice", groups=("cs101",))
    h.add_user(BOB, "bob", groups=("cs101",))
    h.add_user(ADMIN, "prof", admin=True)
    try:
        yield h
    finally:
        h.stop()


def suspendable_lease(remote: RemotePool, kernel_id: str, memory: int = 8 * GIB) -> Any:
    """A lease as a server whose kernels can be checkpointed asks for it."""
    return remote.request(LeaseRequest(owner="", memory=memory, kernel_id=kernel_id, suspendable=True))


def stored(h: BrokerHarness) -> list[dict[str, Any]]:
    """Every lease as the broker's pool holds it, and its event counts: what a refusal must not change."""

    def read() -> Any:
        leases = sorted((lease.to_json() for lease in h.pool.leases(include_released=True)), key=lambda d: d["id"])
        return leases, h.pool.store.event_counts()

    return h.on_broker(read)


def metrics(h: BrokerHarness) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = h.http("GET", "metrics", ADMIN)
    assert status == 200, text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --- the whole round trip ------------------------------------------------------------------------------
def test_alices_server_suspends_confirms_resumes_and_confirms_the_restore(harness: BrokerHarness) -> None:
    alice, bob = harness.remote(ALICE), harness.remote(BOB)
    lease = suspendable_lease(alice, "k-alice")
    assert lease.state is LeaseState.GRANTED and lease.suspendable
    waiting = bob.request(LeaseRequest(owner="", memory=16 * GIB, kernel_id="k-bob"))
    assert waiting.state is LeaseState.QUEUED

    suspending = alice.suspend(lease.id, reason="suspended by its user")
    assert suspending.transition is Transition.SUSPENDING and suspending.state is LeaseState.GRANTED
    assert bob.get(waiting.id).state is LeaseState.QUEUED, "the memory stays counted until the server confirms"
    values = metrics(harness)
    assert values[("gpupool_suspends_total", ())] == 1
    assert values[("gpupool_transitions", (("transition", "suspending"),))] == 1

    parked = alice.confirm_transition(lease.id, parked_bytes=6 * GIB)
    assert parked.state is LeaseState.SUSPENDED and parked.devices == () and parked.parked_memory == 6 * GIB
    assert bob.wait_for_grant(waiting.id, timeout=20).state is LeaseState.GRANTED, "the parked slice freed its GPU"
    values = metrics(harness)
    assert values[("gpupool_leases", (("state", "suspended"),))] == 1
    assert values[("gpupool_parked_memory_bytes", ())] == 6 * GIB
    assert values[("gpupool_transitions", (("transition", "suspending"),))] == 0

    queued = alice.resume(lease.id)
    assert queued.state is LeaseState.QUEUED and queued.resuming
    assert alice.resume(lease.id).resuming, "resuming twice is harmless"
    bob.release(waiting.id)
    restoring = alice.wait_for_grant(lease.id, timeout=20)
    assert restoring.transition is Transition.RESTORING and restoring.devices
    running = alice.confirm_transition(lease.id)
    assert running.state is LeaseState.GRANTED and running.transition is Transition.NONE
    assert running.parked_memory == 0 and running.suspensions == 1 and running.parked_seconds > 0

    values = metrics(harness)
    assert values[("gpupool_resumes_total", ())] == 1
    assert values[("gpupool_resume_wait_seconds_count", ())] == 1
    assert values[("gpupool_restore_seconds_count", ())] == 1
    assert values[("gpupool_leases", (("state", "suspended"),))] == 0
    assert values[("gpupool_parked_memory_bytes", ())] == 0
    assert values[("gpupool_parked_seconds_total", ())] == pytest.approx(running.parked_seconds, abs=1e-6)
    assert values[("gpupool_wait_seconds_count", ())] == 2, "a resume is not counted as a first wait"


def test_a_lease_whose_server_cannot_checkpoint_is_refused_with_the_reason(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    lease = alice.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-plain"))  # suspendable=False
    before = stored(harness)
    with pytest.raises(RequestRefused, match="cannot suspend this kernel: its server cannot park GPU memory"):
        alice.suspend(lease.id)
    with pytest.raises(InvalidInput, match="not being suspended, restored or moved"):
        alice.confirm_transition(lease.id)
    status, body = harness.http("POST", f"api/gpupool/leases/{lease.id}/transition", ALICE, {"outcome": "done"})
    assert status == 400 and "not being suspended" in body["message"]
    assert stored(harness) == before


def test_the_kernel_routes_suspend_and_resume_as_the_single_user_api(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    lease = suspendable_lease(alice, "k-alice")
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/suspend", BOB, {})
    assert status == 403 and alice.get(lease.id).transition is Transition.NONE
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/suspend", ALICE, {"reason": "lunch"})
    assert status == 200 and body["state"] == "granted" and body["transition"] == "suspending", body
    assert body["suspend_reason"] == "lunch"
    alice.confirm_transition(lease.id, parked_bytes=GIB)
    status, body = harness.http("GET", "api/gpupool/kernels/k-alice", ALICE)
    assert body["state"] == "suspended" and body["parked_memory"] == GIB
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/resume", BOB, {})
    assert status == 403 and alice.get(lease.id).state is LeaseState.SUSPENDED
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/resume", ALICE, {})
    assert status == 200 and body["transition"] == "restoring", body  # room: granted at once to restore
    status, body = harness.http("POST", "api/gpupool/kernels/k-nobody/suspend", ALICE, {})
    assert status == 404


# --- who may --------------------------------------------------------------------------------------------
def test_bob_cannot_suspend_resume_confirm_or_fail_alices_lease(harness: BrokerHarness) -> None:
    alice, bob, admin = harness.remote(ALICE), harness.remote(BOB), harness.remote(ADMIN)
    lease = suspendable_lease(alice, "k-alice")
    alice.suspend(lease.id)
    before = stored(harness)
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("suspend", {"reason": "mine now"}),
        ("resume", {}),
        ("transition", {"outcome": "done", "transition": "suspending", "parked_bytes": 0}),
        ("transition", {"outcome": "done"}),
        ("transition", {"outcome": "failed", "error": "boom", "still_running": False}),
    ]
    for route, body in attempts:
        status, payload = harness.http("POST", f"api/gpupool/leases/{lease.id}/{route}", BOB, body)
        assert status == 403, (route, body, status, payload)
        assert "alice" not in str(payload), "a refusal never names the owner"
    for call in (
        lambda: bob.confirm_transition(lease.id, parked_bytes=0),
        lambda: bob.fail_transition(lease.id, "boom", still_running=False),
        lambda: bob.suspend(lease.id),
        lambda: bob.resume(lease.id),
    ):
        with pytest.raises(NotAuthorized):
            call()
    assert stored(harness) == before, "bob changed alice's lease"
    # The suspend is still alice's server's to confirm; an admin may act on it too.
    assert alice.confirm_transition(lease.id, parked_bytes=GIB).state is LeaseState.SUSPENDED
    resumed = admin.resume(lease.id)
    assert resumed.owner == "alice" and resumed.transition is Transition.RESTORING, "room: granted to restore"


def test_an_admin_suspend_says_who_asked(harness: BrokerHarness) -> None:
    lease = suspendable_lease(harness.remote(ALICE), "k-alice")
    suspending = harness.remote(ADMIN).suspend(lease.id, reason="maintenance at noon")
    assert suspending.suspend_reason == "maintenance at noon (by admin prof)"


# --- failures -------------------------------------------------------------------------------------------
def test_a_failed_suspend_is_called_off_and_a_failed_restore_stops_the_kernel(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    lease = suspendable_lease(alice, "k-alice")
    alice.suspend(lease.id)
    running = alice.fail_transition(lease.id, "unsupported memory: CUDA IPC", still_running=True)
    assert running.state is LeaseState.GRANTED and running.transition is Transition.NONE
    alice.suspend(lease.id)
    alice.confirm_transition(lease.id, parked_bytes=GIB)
    alice.resume(lease.id)
    assert alice.wait_for_grant(lease.id, timeout=20).transition is Transition.RESTORING
    alice.fail_transition(lease.id, "restore failed:\nCUDA_ERROR_ILLEGAL_STATE", still_running=False)
    stopped = alice.get(lease.id)
    assert stopped.state is LeaseState.RELEASED
    assert "restoring its GPU memory failed (restore failed: CUDA_ERROR_ILLEGAL_STATE)" in stopped.release_reason


# --- retries --------------------------------------------------------------------------------------------
def test_a_repeated_report_naming_its_step_is_answered_not_refused(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    lease = suspendable_lease(alice, "k-alice")
    alice.suspend(lease.id)
    path = f"api/gpupool/leases/{lease.id}/transition"
    done = {"outcome": "done", "transition": "suspending", "parked_bytes": 2 * GIB}
    status, first = harness.http("POST", path, ALICE, done)
    assert status == 200 and first["state"] == "suspended" and first["parked_memory"] == 2 * GIB
    after_first = stored(harness)
    status, again = harness.http("POST", path, ALICE, {**done, "parked_bytes": 5 * GIB})
    assert status == 200 and again == first, "the repeat answers the lease as the first report left it"
    assert stored(harness) == after_first
    # A report about another step than the lease's is refused, and changes nothing.
    status, body = harness.http("POST", path, ALICE, {"outcome": "done", "transition": "restoring"})
    assert status == 409 and "is not restoring (it is suspended)" in body["message"]
    # Queued to resume (bob holds the GPU), a late repeat of the suspend's report changes nothing...
    bob = harness.remote(BOB)
    hog = bob.request(LeaseRequest(owner="", memory=16 * GIB, kernel_id="k-bob"))
    assert alice.resume(lease.id).resuming
    status, again = harness.http("POST", path, ALICE, done)
    assert status == 200 and again["state"] == "queued" and again["resuming"] and again["suspensions"] == 1
    # ...and once granted to restore, it is refused: it is not the step under way.
    bob.release(hog.id)
    assert alice.wait_for_grant(lease.id, timeout=20).transition is Transition.RESTORING
    status, body = harness.http("POST", path, ALICE, done)
    assert status == 409 and "is not suspending (it is restoring)" in body["message"]
    assert alice.get(lease.id).transition is Transition.RESTORING


class DropFirstAnswers:
    """A TCP proxy to the broker that forwards each request whole and then, for the first ``drop``
    requests whose path contains ``match``, closes the client's connection instead of answering:
    the broker did the work, the client never hears of it."""

    def __init__(self, port: int, match: str, drop: int) -> None:
        self.target = port
        self.match = match.encode()
        self.drop = drop
        self.dropped = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        with client, socket.create_connection(("127.0.0.1", self.target)) as upstream:
            request = read_http_message(client)
            upstream.sendall(request)
            answer = read_http_message(upstream)
            if self.match in request.split(b"\r\n", 1)[0] and self.dropped < self.drop:
                self.dropped += 1
                client.shutdown(socket.SHUT_RDWR)  # the answer is lost
                return
            client.sendall(answer)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def lossy(harness: BrokerHarness) -> Iterator[Callable[[int], RemotePool]]:
    proxies: list[DropFirstAnswers] = []

    def make(drop: int) -> RemotePool:
        proxy = DropFirstAnswers(harness.port, "/transition", drop)
        proxies.append(proxy)
        remote = RemotePool(f"http://127.0.0.1:{proxy.port}/services/gpupool", token=ALICE, timeout=15)
        remote.retry_initial = 0.01
        return remote

    yield make
    for proxy in proxies:
        proxy.close()


def test_a_confirmation_whose_answer_was_lost_is_retried_harmlessly(
    harness: BrokerHarness, lossy: Callable[[int], RemotePool]
) -> None:
    alice = lossy(1)
    lease = suspendable_lease(harness.remote(ALICE), "k-alice")
    alice.suspend(lease.id)
    # The first POST is committed but its answer lost; RemotePool's retry is answered with the lease.
    parked = alice.confirm_transition(lease.id, parked_bytes=3 * GIB)
    assert parked.state is LeaseState.SUSPENDED and parked.parked_memory == 3 * GIB
    assert harness.on_broker(lambda: harness.pool.get(lease.id).suspensions) == 1, "confirmed once"


def test_a_server_that_asks_again_after_an_outage_gets_the_lease_not_an_error(
    harness: BrokerHarness, lossy: Callable[[int], RemotePool]
) -> None:
    alice = lossy(3)  # more than RemotePool's own retries: the call fails, the server asks later
    lease = suspendable_lease(harness.remote(ALICE), "k-alice")
    alice.suspend(lease.id)
    with pytest.raises(PoolUnavailable):
        alice.confirm_transition(lease.id, parked_bytes=3 * GIB)
    assert harness.remote(ALICE).get(lease.id).state is LeaseState.SUSPENDED, "the broker did confirm it"
    parked = alice.confirm_transition(lease.id, parked_bytes=3 * GIB)
    assert parked.state is LeaseState.SUSPENDED and parked.suspensions == 1
    # Answered at last, nothing is remembered: a third report with nothing under way is the local
    # pool's error (Pool.confirm_transition raises the same).
    with pytest.raises(InvalidInput, match="not being suspended"):
        alice.confirm_transition(lease.id)


def test_a_late_report_never_finishes_a_later_step(
    harness: BrokerHarness, lossy: Callable[[int], RemotePool]
) -> None:
    """A restore report lost in an outage, tried again when the kernel is being suspended anew, must
    not confirm that suspend: it would free GPU memory the kernel still uses."""
    owner = harness.remote(ALICE)
    alice = lossy(3)
    lease = suspendable_lease(owner, "k-alice")
    owner.suspend(lease.id)
    owner.confirm_transition(lease.id, parked_bytes=GIB)
    owner.resume(lease.id)
    assert owner.wait_for_grant(lease.id, timeout=20).transition is Transition.RESTORING
    with pytest.raises(PoolUnavailable):
        alice.confirm_transition(lease.id)  # the restore is confirmed; the server never hears so
    owner.suspend(lease.id)  # the user suspends it again at once
    with pytest.raises(RequestRefused, match="is not restoring \\(it is suspending\\)"):
        alice.confirm_transition(lease.id)
    assert owner.get(lease.id).transition is Transition.SUSPENDING, "the new suspend is still the server's to do"
    assert alice.confirm_transition(lease.id, parked_bytes=GIB).state is LeaseState.SUSPENDED


# --- bad input --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "say how it went"),
        ({"outcome": "maybe"}, "invalid outcome 'maybe'"),
        ({"outcome": "done", "transition": "sleeping"}, "invalid transition 'sleeping'"),
        ({"outcome": "done", "parked_bytes": -1}, "invalid parked_bytes -1"),
        ({"outcome": "done", "parked_bytes": "lots"}, "invalid parked_bytes 'lots'"),
        ({"outcome": "done", "error": "x"}, '"error" and "still_running" go with "outcome": "failed" only'),
        ({"outcome": "failed"}, 'a failed transition needs "error"'),
        ({"outcome": "failed", "error": "two\nlines"}, "control characters are not accepted"),
        ({"outcome": "failed", "error": "x" * 501}, "501 characters; at most 500"),
        ({"outcome": "failed", "error": "x", "still_running": "perhaps"}, "invalid still_running"),
        ({"outcome": "failed", "error": "x", "parked_bytes": 1}, '"parked_bytes" goes with "outcome": "done" only'),
    ],
)
def test_a_bad_report_is_a_one_line_400_that_changes_nothing(
    harness: BrokerHarness, body: dict[str, Any], message: str
) -> None:
    lease = suspendable_lease(harness.remote(ALICE), "k-alice")
    harness.remote(ALICE).suspend(lease.id)
    before = stored(harness)
    status, payload = harness.http("POST", f"api/gpupool/leases/{lease.id}/transition", ALICE, body)
    assert status == 400 and message in payload["message"], payload
    assert "\n" not in payload["message"] and "Traceback" not in payload["message"]
    assert stored(harness) == before


def test_a_bad_suspend_reason_is_refused(harness: BrokerHarness) -> None:
    lease = suspendable_lease(harness.remote(ALICE), "k-alice")
    before = stored(harness)
    for reason in ("a\nb", "x" * 1001, 42):
        status, payload = harness.http("POST", f"api/gpupool/leases/{lease.id}/suspend", ALICE, {"reason": reason})
        assert status == 400 and "reason" in payload["message"], payload
    status, payload = harness.http("POST", "api/gpupool/leases/no-such-lease/suspend", ALICE, {})
    assert status == 404, payload
    assert stored(harness) == before


# --- a real broker process ------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_suspended_lease_survives_a_broker_sigkill_and_resumes(tmp_path: Path) -> None:
    """``python -m jupyter_gpupool.broker`` as a process, killed with SIGKILL while alice's kernel is
    suspended: started again on the same pool file, the lease is still suspended with its parked
    memory, bob still cannot touch it, and alice's server resumes it and confirms the restore."""
    hub = StandInHub().start()
    hub.add_user(ALICE, "alice")
    hub.add_user(BOB, "bob")
    broker = BrokerProcess(tmp_path, hub, config="c.PoolPolicy.heartbeat_ttl = 3600\n")
    try:
        broker.start()
        alice, bob = RemotePool(broker.url, token=ALICE, timeout=15), RemotePool(broker.url, token=BOB, timeout=15)
        lease = suspendable_lease(alice, "k-alice")
        alice.suspend(lease.id)
        alice.confirm_transition(lease.id, parked_bytes=5 * GIB)
        broker.kill()
        broker.start()
        kept = alice.get(lease.id)
        assert kept.state is LeaseState.SUSPENDED and kept.parked_memory == 5 * GIB and kept.suspendable
        for call in (lambda: bob.resume(lease.id), lambda: bob.suspend(lease.id)):
            with pytest.raises(NotAuthorized):
                call()
        alice.resume(lease.id)
        assert alice.wait_for_grant(lease.id, timeout=20).transition is Transition.RESTORING
        running = alice.confirm_transition(lease.id)
        assert running.state is LeaseState.GRANTED and running.transition is Transition.NONE
        assert [x.state for x in broker.leases()] == [LeaseState.GRANTED], "one lease, nothing leaked"
    finally:
        broker.stop()
        hub.stop()


@pytest.mark.slow
def test_a_suspend_under_way_when_the_broker_dies_gets_its_full_timeout_after_the_restart(tmp_path: Path) -> None:
    """The server could not report while the broker was down: a restarted broker must not give up on
    the suspend at once (calling it off while the memory is parked) because its timeout passed."""
    hub = StandInHub().start()
    hub.add_user(ALICE, "alice")
    broker = BrokerProcess(tmp_path, hub, config="c.PoolPolicy.transition_timeout = 4.0\n")
    try:
        broker.start()
        alice = RemotePool(broker.url, token=ALICE, timeout=15)
        lease = suspendable_lease(alice, "k-alice")
        alice.suspend(lease.id)
        broker.kill()
        time.sleep(5)  # longer than transition_timeout, all of it while the broker was down
        broker.start()
        time.sleep(1)  # a few scheduler ticks
        assert alice.get(lease.id).transition is Transition.SUSPENDING, "the suspend is still the server's to report"
        assert alice.confirm_transition(lease.id, parked_bytes=GIB).state is LeaseState.SUSPENDED
    finally:
        broker.stop()
        hub.stop()


# --- the GPU is the truth ---------------------------------------------------------------------------
def test_a_forged_suspend_done_is_taken_at_once_and_frees_nothing_the_kernel_still_holds(harness: BrokerHarness) -> None:
    """Alice, with a valid token, suspends her lease and reports the suspend done herself while her
    process still holds 12 GiB: the report is taken at once (no wait on the driver), but the broker
    sees that memory through the driver and keeps it taken, so Bob's 16 GiB request waits until
    her process lets go; a parked figure no GPU could hold is a 400."""

    alice, bob = harness.remote(ALICE), harness.remote(BOB)
    lease = suspendable_lease(alice, "k-alice", memory=12 * GIB)
    kernel = start_kernel_process({"GPUPOOL_LEASE_ID": lease.id})
    try:
        harness.pool.backend.set_usage(kernel.pid, lease.devices[0], 12 * GIB)
        alice.suspend(lease.id, reason="suspended by its user")
        route = f"api/gpupool/leases/{lease.id}/transition"
        status, body = harness.http("POST", route, ALICE, {"outcome": "done", "transition": "suspending", "parked_bytes": 2**50})
        assert status == 400 and "parked_bytes" in body["message"], body
        started = time.monotonic()
        status, body = harness.http("POST", route, ALICE, {"outcome": "done", "transition": "suspending", "parked_bytes": 0})
        assert status == 200 and body["state"] == "suspended", body
        assert time.monotonic() - started < 1.5, "a report is judged from one reading of the driver"
        waiting = bob.request(LeaseRequest(owner="", memory=16 * GIB, kernel_id="k-bob"))
        assert waiting.state is LeaseState.QUEUED
        time.sleep(0.5)  # a few scheduler ticks: the memory her process holds is granted to nobody
        assert bob.get(waiting.id).state is LeaseState.QUEUED
        harness.pool.backend.set_usage(kernel.pid, lease.devices[0], 0)  # it let go
        assert bob.wait_for_grant(waiting.id, timeout=10).state is LeaseState.GRANTED
    finally:
        kernel.kill()
        kernel.wait()


def test_a_suspend_is_booked_at_what_the_gpu_shows_when_it_begins_not_at_an_older_reading(tmp_path: Path) -> None:
    """Alice's kernel allocates 12 GiB right after the watchdog's last look and she suspends at once,
    then reports 1 GiB parked: the broker reads the driver as the suspend begins, so the host RAM
    it books for her park is the 12 GiB her kernel held, not the watchdog's older reading of none."""

    h = BrokerHarness(tmp_path, simulate="1x16GiB", watchdog={"interval": 3600.0}).start()  # no look during the test
    h.add_user(ALICE, "alice")
    alice = h.remote(ALICE)
    lease = suspendable_lease(alice, "k-alice", memory=12 * GIB)
    kernel = start_kernel_process({"GPUPOOL_LEASE_ID": lease.id})
    try:
        assert alice.get(lease.id).used_memory is None, "the watchdog looked before the kernel allocated"
        h.pool.backend.set_usage(kernel.pid, lease.devices[0], 12 * GIB)
        assert alice.suspend(lease.id).used_at_suspend == 12 * GIB
        h.pool.backend.set_usage(kernel.pid, lease.devices[0], 0)  # parked
        route = f"api/gpupool/leases/{lease.id}/transition"
        status, body = h.http("POST", route, ALICE, {"outcome": "done", "transition": "suspending", "parked_bytes": GIB})
        assert status == 200 and body["state"] == "suspended" and body["parked_memory"] == 12 * GIB, body
    finally:
        kernel.kill()
        kernel.wait()
        h.stop()


def test_a_restore_reported_failed_with_its_memory_parked_keeps_what_the_gpu_shows_taken(tmp_path: Path) -> None:
    """Alice's kernel is restored onto the GPU, and her server reports the restore failed with the
    memory still parked (which gives the GPU back): the report is taken at once, but the broker sees
    her process holding the memory there and keeps it taken, so it is not granted to Bob as well
    until the driver shows it gone."""

    h = BrokerHarness(tmp_path, simulate="1x16GiB", watchdog={"interval": 3600.0}).start()  # the driver reading alone decides
    h.add_user(ALICE, "alice")
    h.add_user(BOB, "bob")
    alice, bob = h.remote(ALICE), h.remote(BOB)
    lease = suspendable_lease(alice, "k-alice", memory=8 * GIB)
    kernel = start_kernel_process({"GPUPOOL_LEASE_ID": lease.id})
    try:
        route = f"api/gpupool/leases/{lease.id}/transition"
        h.pool.backend.set_usage(kernel.pid, lease.devices[0], 8 * GIB)
        alice.suspend(lease.id)  # a suspend that failed and was undone keeps its GPU
        undone = {"outcome": "failed", "transition": "suspending", "error": "checkpoint failed", "still_running": True}
        status, body = h.http("POST", route, ALICE, undone)
        assert status == 200 and body["state"] == "granted" and body["transition"] == "", body
        h.pool.backend.set_usage(kernel.pid, lease.devices[0], 0)
        alice.suspend(lease.id)
        assert alice.confirm_transition(lease.id, parked_bytes=8 * GIB).state is LeaseState.SUSPENDED
        alice.resume(lease.id)
        restoring = alice.wait_for_grant(lease.id, timeout=20)
        assert restoring.transition is Transition.RESTORING
        h.pool.backend.set_usage(kernel.pid, restoring.devices[0], 8 * GIB)  # the restore mapped it back
        report = {"outcome": "failed", "transition": "restoring", "error": "it broke", "still_running": True}
        status, body = h.http("POST", route, ALICE, report)
        assert status == 200 and body["state"] == "suspended", body
        waiting = bob.request(LeaseRequest(owner="", memory=16 * GIB, kernel_id="k-bob"))
        assert waiting.state is LeaseState.QUEUED
        h.pool.backend.set_usage(kernel.pid, restoring.devices[0], 0)
        assert bob.wait_for_grant(waiting.id, timeout=10).state is LeaseState.GRANTED
    finally:
        kernel.kill()
        kernel.wait()
        h.stop()


# --- the host's pinned parking pool: the broker's books ------------------------------------------------
@contextmanager
def parking_broker(tmp_path: Path, parking_pool_size: str) -> Iterator[tuple[BrokerHarness, RemotePool, RemotePool]]:
    """A broker on one 16 GiB GPU with an 8 GiB parking budget and a pinned pool of the given size;
    alice's and bob's clients."""
    h = BrokerHarness(tmp_path, simulate="1x16GiB", policy={"parked_memory_limit": "8GiB", "parking_pool_size": parking_pool_size}).start()
    try:
        h.add_user(ALICE, "alice")
        h.add_user(BOB, "bob")
        yield h, h.remote(ALICE), h.remote(BOB)
    finally:
        h.stop()


def test_the_broker_keeps_the_pinned_parking_pool_and_no_user_can_book_anothers_or_take_it_all(tmp_path: Path) -> None:
    with parking_broker(tmp_path, "4GiB") as (h, alice, bob):
        lease_a = suspendable_lease(alice, "k-alice", memory=4 * GIB)
        lease_b = suspendable_lease(bob, "k-bob", memory=4 * GIB)
        assert alice.reserve_pinned_backup(lease_a.id, 3 * GIB).pinned_backup == 3 * GIB
        before = stored(h)
        with pytest.raises(NotAuthorized, match="belongs to another user"):
            bob.reserve_pinned_backup(lease_a.id, 0)  # bob may not give alice's backup away...
        with pytest.raises(RequestRefused, match="more than this kernel may hold on its GPUs"):
            bob.reserve_pinned_backup(lease_b.id, 1 << 40)  # ...nor take the pool with a made-up figure
        with pytest.raises(RequestRefused, match=r"pinned parking pool has 1 GiB free of 4 GiB"):
            bob.reserve_pinned_backup(lease_b.id, 2 * GIB)
        status, payload = h.http("POST", f"api/gpupool/leases/{lease_b.id}/pinned-backup", BOB, {"bytes": "lots"})
        assert status == 400 and "invalid bytes 'lots'" in payload["message"], payload
        assert stored(h) == before, "a refused reservation changed the broker's books"
        # Alice's kept backup counts in the broker's own suspend decisions: bob's 4 GiB slice parked
        # beside it would take 7 GiB of the 8 GiB budget (fits); a third kernel's would not.
        assert bob.suspend(lease_b.id).parked_memory == 4 * GIB
        lease_c = suspendable_lease(alice, "k-alice-2", memory=2 * GIB)
        with pytest.raises(RequestRefused, match="beside 3 GiB of pinned backups running kernels keep"):
            alice.suspend(lease_c.id)


def test_a_pinned_backup_follows_its_slice_down(tmp_path: Path) -> None:
    """A reservation is bounded by what the kernel may hold *now*: a slice that shrinks (its user,
    or its burst taken back) takes its backup's booking down with it, so one user cannot keep the
    host's pinned pool beyond their slices."""
    with parking_broker(tmp_path, "8GiB") as (h, alice, bob):
        lease = suspendable_lease(alice, "k-alice", memory=8 * GIB)
        assert alice.reserve_pinned_backup(lease.id, 8 * GIB).pinned_backup == 8 * GIB
        status, body = h.http("POST", f"api/gpupool/leases/{lease.id}/resize", ALICE, {"memory": "2GiB"})
        assert status == 200 and body["memory"] == 2 * GIB and body["pinned_backup"] == 2 * GIB, body
        with pytest.raises(RequestRefused, match="more than this kernel may hold on its GPUs"):
            alice.reserve_pinned_backup(lease.id, 8 * GIB)
        plain = bob.request(LeaseRequest(owner="", memory=2 * GIB, kernel_id="k-bob-plain"))  # its server cannot park it
        with pytest.raises(RequestRefused, match="cannot set a pinned backup aside: its server cannot park GPU memory"):
            bob.reserve_pinned_backup(plain.id, 2 * GIB)
        lease_b = suspendable_lease(bob, "k-bob", memory=6 * GIB)  # the room alice's slice gave back
        assert bob.reserve_pinned_backup(lease_b.id, 6 * GIB).pinned_backup == 6 * GIB

        alice.suspend(lease.id)
        route = f"api/gpupool/leases/{lease.id}/transition"
        status, body = h.http("POST", route, ALICE, {"outcome": "done", "transition": "suspending", "parked_bytes": 2 * GIB})
        assert status == 200 and body["state"] == "suspended" and body["pinned_backup"] == 2 * GIB, body
        alice.release(lease.id)  # and a lease that ends takes its booking with it
        assert bob.reserve_pinned_backup(lease_b.id, 6 * GIB).pinned_backup == 6 * GIB


def test_a_pinned_backup_bigger_than_its_park_counts_in_full_against_the_budget(tmp_path: Path) -> None:
    """A kernel parked at less than the backup it keeps pinned (a report below it, a measurement
    taken before it allocated) still holds the whole backup in host RAM: the budget counts it all,
    before the restore as after."""
    with parking_broker(tmp_path, "8GiB") as (h, alice, bob):
        lease = suspendable_lease(alice, "k-alice", memory=8 * GIB)
        alice.suspend(lease.id)
        assert alice.reserve_pinned_backup(lease.id, 8 * GIB).pinned_backup == 8 * GIB  # as the fast path asks mid-park
        route = f"api/gpupool/leases/{lease.id}/transition"
        status, body = h.http("POST", route, ALICE, {"outcome": "done", "transition": "suspending", "parked_bytes": GIB})
        assert status == 200 and body["parked_memory"] == GIB and body["pinned_backup"] == 8 * GIB, body
        lease_b = suspendable_lease(bob, "k-bob", memory=4 * GIB)
        with pytest.raises(RequestRefused, match="beside 7 GiB of pinned backups"):
            bob.suspend(lease_b.id)  # 1 GiB parked + alice's 7 GiB more pinned + bob's 4 GiB: over 8 GiB
        assert bob.get(lease_b.id).transition is Transition.NONE


def test_a_suspended_kernel_restarted_behind_the_broker_asks_again_and_parks_nothing(tmp_path: Path) -> None:
    """A server restarts a suspended kernel: what was parked went with the old process, so the
    request for the new one asks again on the same lease (granted, nothing parked, no backup), as
    on a local pool; a retried request of a lease that was never suspended still answers it as is."""
    with parking_broker(tmp_path, "8GiB") as (_h, alice, _bob):
        lease = suspendable_lease(alice, "k-alice", memory=4 * GIB)
        assert suspendable_lease(alice, "k-alice", memory=4 * GIB).to_json() == alice.get(lease.id).to_json()  # a retry
        alice.suspend(lease.id)
        alice.reserve_pinned_backup(lease.id, 4 * GIB)
        assert alice.confirm_transition(lease.id, parked_bytes=4 * GIB).state is LeaseState.SUSPENDED
        again = suspendable_lease(alice, "k-alice", memory=4 * GIB)  # the restarted kernel's request
        assert again.id == lease.id and again.state is LeaseState.GRANTED and again.transition is Transition.NONE
        assert again.parked_memory == 0 and again.pinned_backup == 0 and not again.resuming
        lease_b = suspendable_lease(alice, "k-alice-2", memory=4 * GIB)
        alice.suspend(lease_b.id)
        alice.confirm_transition(lease_b.id, parked_bytes=4 * GIB)
        alice.resume(lease_b.id)  # queued to come back behind nobody: granted, restoring
        assert alice.get(lease_b.id).transition is Transition.RESTORING
        restarted = suspendable_lease(alice, "k-alice-2", memory=4 * GIB)
        assert restarted.state is LeaseState.GRANTED and restarted.transition is Transition.NONE and restarted.parked_memory == 0
