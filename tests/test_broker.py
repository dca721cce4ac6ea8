"""The broker: identity from hub tokens or socket peers, per-user authorization, the shared pool,
group quotas, long-poll waits, the watchdog over the host's processes, and /metrics protection."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import ACCESS, BrokerHarness, unix_http, unix_http_json

from jupyter_gpupool.core.models import Activity, LeaseRequest, LeaseState
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound, NotAuthorized, RequestRefused
from jupyter_gpupool.units import GIB

ALICE, BOB, ADMIN, CAROL = "tok-alice", "tok-bob", "tok-admin", "tok-carol"


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_harness(tmp_path: Path, **kwargs: Any) -> BrokerHarness:
    h = BrokerHarness(tmp_path, **kwargs).start()
    h.add_user(ALICE, "alice", groups=("cs101",))
    h.add_user(BOB, "bob", groups=("cs101",))
    h.add_user(CAROL, "carol", groups=("staff",))
    h.add_user(ADMIN, "prof", groups=("staff",), admin=True)
    return h


@pytest.fixture
def make_harness(tmp_path: Path) -> Iterator[Callable[..., BrokerHarness]]:
    """``make_harness(policy=..., watchdog=...)``: a started broker with alice, bob (cs101), carol and prof (admin)."""
    started: list[BrokerHarness] = []

    def make(**kwargs: Any) -> BrokerHarness:
        h = start_harness(tmp_path, **kwargs)
        started.append(h)
        return h

    yield make
    for h in started:
        h.stop()


@pytest.fixture
def harness(make_harness: Callable[..., BrokerHarness]) -> BrokerHarness:
    return make_harness()


def request_body(memory: str = "8GiB", **extra: Any) -> dict[str, Any]:
    return {"memory": memory, **extra}


def state(h: BrokerHarness) -> tuple[list[dict[str, Any]], dict[str, int], list[dict[str, Any]]]:
    """Everything a request could change: every lease, event counts, reservations, preferences."""
    pool = h.pool

    def read() -> Any:
        leases = sorted((lease.to_json() for lease in pool.leases(include_released=True)), key=lambda d: d["id"])
        prefs = [pool.preference(name) for name in ("alice", "bob", "prof")]
        return leases, pool.store.event_counts(), [r.to_json() for r in pool.reservations()] + prefs

    return h.on_broker(read)


# --- one pool for several users -----------------------------------------------------------------------
def test_users_share_one_pool_and_the_third_lease_queues(harness: BrokerHarness) -> None:
    alice, bob = harness.remote(ALICE), harness.remote(BOB)
    a = alice.request(LeaseRequest(owner="ignored", memory=alice.default_memory(), kernel_id="k-a1"))
    b = bob.request(LeaseRequest(owner="ignored", memory=bob.default_memory(), kernel_id="k-b1"))
    c = alice.request(LeaseRequest(owner="ignored", memory=8 * GIB, kernel_id="k-a2"))
    assert (a.owner, b.owner, c.owner) == ("alice", "bob", "alice")
    assert a.groups == ("cs101",)
    assert [a.state, b.state, c.state] == [LeaseState.GRANTED, LeaseState.GRANTED, LeaseState.QUEUED]
    info = alice.queue_info(c.id)
    assert info is not None and info.position == 1 and info.length == 1
    # Bob sees the whole pool leased, and Alice's leases without her name.
    snap = bob.snapshot()
    assert snap.devices[0]["memory_leased"] == 16 * GIB
    others = [item for item in snap.leases if not item["mine"]]
    assert others and all(item["owner"] is None and item["id"] is None for item in others)
    # Bob gives his back: Alice's queued lease is granted (long poll returns).
    updates: list[Any] = []
    bob.release(b.id)
    granted = alice.wait_for_grant(c.id, timeout=20, on_update=lambda lease, qi: updates.append(qi))
    assert granted.state is LeaseState.GRANTED


def test_owner_and_groups_come_from_the_token_never_the_body(harness: BrokerHarness) -> None:
    status, body = harness.http(
        "POST", "api/gpupool/leases", ALICE, {"memory": "4GiB", "owner": "bob", "groups": ["staff"]}
    )
    assert status == 201, body
    assert body["owner"] == "alice" and body["groups"] == ["cs101"]
    status, who = harness.http("GET", "api/gpupool/whoami", ALICE)
    assert who == {"name": "alice", "groups": ["cs101"], "admin": False, "kind": "user"}


def test_another_users_lease_is_403_and_an_admin_may(harness: BrokerHarness) -> None:
    status, lease = harness.http("POST", "api/gpupool/leases", BOB, request_body(kernel_id="kernel-of-bob"))
    assert status == 201
    lid = lease["id"]
    before = state(harness)
    attempts = [
        ("GET", f"api/gpupool/leases/{lid}", None),
        ("DELETE", f"api/gpupool/leases/{lid}", None),
        ("POST", f"api/gpupool/leases/{lid}/release", {}),
        ("POST", f"api/gpupool/leases/{lid}/resize", {"memory": "4GiB"}),
        ("POST", f"api/gpupool/leases/{lid}/keepalive", {"duration": "1h"}),
        ("POST", f"api/gpupool/leases/{lid}/activity", {"busy": True}),
        ("GET", f"api/gpupool/leases/{lid}/wait?timeout=0", None),
        ("POST", "api/gpupool/activity", {"activities": {lid: {"busy": True}}}),
        ("POST", "api/gpupool/heartbeat", {"lease_ids": [lid]}),
        ("GET", "api/gpupool/kernels/kernel-of-bob", None),
        ("POST", "api/gpupool/kernels/kernel-of-bob/reserve", {"memory": "2GiB"}),
        ("POST", "api/gpupool/kernels/kernel-of-bob/release", {}),
        ("POST", "api/gpupool/kernels/kernel-of-bob/keepalive", {}),
        ("GET", "api/gpupool/leases?owner=bob", None),
        ("POST", f"api/gpupool/leases/{lid}/priority", {"priority": "high"}),
    ]
    for method, path, body in attempts:
        status, payload = harness.http(method, path, ALICE, body)
        assert status == 403, (method, path, status, payload)
        assert payload["error"] == "NotAuthorized" and payload["message"]
    # Reconcile with Bob's holder and no live kernels touches only Alice's own leases: none.
    status, released = harness.http(
        "POST",
        "api/gpupool/reconcile",
        ALICE,
        {"holder_host": lease["holder_host"] or "", "holder_pid": lease["holder_pid"] or 1, "live_kernel_ids": []},
    )
    assert status == 200 and released == []
    # A kernel id already leased by Bob cannot be claimed by Alice.
    status, payload = harness.http("POST", "api/gpupool/leases", ALICE, request_body(kernel_id="kernel-of-bob"))
    assert status == 409
    assert state(harness) == before

    admin = harness.remote(ADMIN)
    assert admin.get(lid).owner == "bob"
    assert admin.resize(lid, memory=4 * GIB).memory == 4 * GIB
    assert admin.set_priority(lid, "batch").priority.value == "batch"  # admins re-prioritise
    everyone = admin.leases()
    assert {lease.owner for lease in everyone} == {"bob"}
    assert admin.snapshot().leases[0]["owner"] == "bob"
    released_lease = admin.release(lid, reason="make room")
    assert released_lease.state is LeaseState.RELEASED and "by admin prof" in released_lease.release_reason


def test_remote_pool_raises_domain_errors(harness: BrokerHarness) -> None:
    alice, bob = harness.remote(ALICE), harness.remote(BOB)
    lease = bob.request(LeaseRequest(owner="", memory=4 * GIB))
    with pytest.raises(NotAuthorized, match="another user"):
        alice.get(lease.id)
    with pytest.raises(LeaseNotFound):
        alice.get("l-doesnotexist")
    with pytest.raises(RequestRefused):
        alice.request(LeaseRequest(owner="", memory=64 * GIB))
    status, body = harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "lots"})
    assert status == 400 and "8GiB" in body["message"]


# --- authentication on every route ------------------------------------------------------------------
ROUTES: list[tuple[str, str, Any]] = [
    ("GET", "api/gpupool/whoami", None),
    ("GET", "api/gpupool/info", None),
    ("GET", "api/gpupool/pool", None),
    ("GET", "api/gpupool/devices", None),
    ("GET", "api/gpupool/queue", None),
    ("GET", "api/gpupool/leases", None),
    ("POST", "api/gpupool/leases", {"memory": "4GiB"}),
    ("GET", "api/gpupool/leases/{lid}", None),
    ("DELETE", "api/gpupool/leases/{lid}", None),
    ("POST", "api/gpupool/leases/{lid}/release", {}),
    ("POST", "api/gpupool/leases/{lid}/resize", {"memory": "2GiB"}),
    ("POST", "api/gpupool/leases/{lid}/keepalive", {"duration": "1h"}),
    ("POST", "api/gpupool/leases/{lid}/activity", {"busy": True}),
    ("GET", "api/gpupool/leases/{lid}/wait?timeout=0", None),
    ("POST", "api/gpupool/activity", {"activities": {"{lid}": {"busy": True}}}),
    ("POST", "api/gpupool/heartbeat", {"lease_ids": ["{lid}"]}),
    ("POST", "api/gpupool/reconcile", {"holder_host": "h", "holder_pid": 1, "live_kernel_ids": []}),
    ("POST", "api/gpupool/tick", {}),
    ("GET", "api/gpupool/kernels/k-1", None),
    ("POST", "api/gpupool/kernels/k-1/reserve", {"memory": "2GiB"}),
    ("POST", "api/gpupool/kernels/k-1/release", {}),
    ("POST", "api/gpupool/kernels/k-1/keepalive", {}),
    ("GET", "api/gpupool/report", None),
    ("GET", "api/gpupool/reservations", None),
    ("POST", "api/gpupool/reservations", {"name": "x", "memory": "8GiB", "groups": ["cs101"], "duration": "1h"}),
    ("DELETE", "api/gpupool/reservations/x", None),
    ("GET", "api/gpupool/preferences", None),
    ("PATCH", "api/gpupool/preferences", {"memory": "2GiB"}),
    ("GET", "api/gpupool/events", None),
    ("GET", "metrics", None),
    ("GET", "api/gpupool/no-such-route", None),
    ("PUT", "api/gpupool/pool", {}),
]


def test_every_route_refuses_missing_forged_expired_and_foreign_tokens(harness: BrokerHarness) -> None:
    owner = harness.remote(BOB)
    lease = owner.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-1"))
    # Another hub service's token (no access to this service) and a user token without the scope.
    harness.tokens["tok-other-service"] = {
        "kind": "service",
        "name": "other",
        "scopes": ["access:services!service=other"],
    }
    harness.tokens["tok-no-scope"] = {
        "kind": "user",
        "name": "mallory",
        "groups": ["cs101"],
        "scopes": ["read:users:name!user=mallory"],
    }
    # An expired token: it worked once, then the hub stopped knowing it.
    harness.add_user("tok-expired", "alice")
    assert harness.http("GET", "api/gpupool/whoami", "tok-expired")[0] == 200
    del harness.tokens["tok-expired"]
    before = state(harness)
    credentials: list[tuple[str, dict[str, str] | None, str | None, int]] = [
        ("none", None, None, 401),
        ("forged", None, "not-a-real-token", 401),
        ("expired", None, "tok-expired", 401),
        ("bad scheme", {"Authorization": f"Basic {BOB}"}, None, 401),
        ("other service", None, "tok-other-service", 403),
        ("no access scope", None, "tok-no-scope", 403),
    ]
    for label, headers, token, expected in credentials:
        for method, path, body in ROUTES:
            path = path.replace("{lid}", lease.id)
            if isinstance(body, dict):
                body = json.loads(json.dumps(body).replace("{lid}", lease.id))
            status, payload = harness.http(method, path, token, body, headers=headers)
            assert status == expected, (label, method, path, status, payload)
            assert isinstance(payload, dict) and payload.get("message"), (label, path, payload)
    assert state(harness) == before
    assert owner.get(lease.id).state is LeaseState.GRANTED


def test_a_user_named_like_a_service_never_gets_the_services_identity(harness: BrokerHarness) -> None:
    """Users and hub services are separate namespaces: a hub user called ``service:grader`` is not the
    ``grader`` service (its leases, quota and views stay the service's)."""
    harness.tokens["tok-grader-service"] = {"kind": "service", "name": "grader", "scopes": [ACCESS], "groups": []}
    harness.add_user("tok-impostor", "service:grader")
    service = harness.remote("tok-grader-service")
    lease = service.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-graded"))
    assert lease.owner == "service:grader"
    status, who = harness.http("GET", "api/gpupool/whoami", "tok-impostor")
    assert status == 200 and who["kind"] == "user" and who["name"] != lease.owner
    assert who["name"] == "user:service:grader"
    before = state(harness)
    impostor = harness.remote("tok-impostor")
    assert impostor.leases() == []
    for attempt in (
        lambda: impostor.release(lease.id),
        lambda: impostor.get(lease.id),
        lambda: impostor.keep(lease.id, 60),
        lambda: impostor.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-graded")),
    ):
        with pytest.raises((NotAuthorized, RequestRefused)):
            attempt()
    status, _ = harness.http("GET", "api/gpupool/kernels/k-graded", "tok-impostor")
    assert status == 403
    assert state(harness) == before
    assert service.get(lease.id).state is LeaseState.GRANTED


def test_hub_down_is_a_503_clients_retry_not_a_500(harness: BrokerHarness) -> None:
    harness.broker.hub.hub_auth.api_url = "http://127.0.0.1:9/hub/api/"  # type: ignore[union-attr]  # nobody listens
    status, body = harness.http("GET", "api/gpupool/whoami", ALICE)
    assert status == 503, body
    assert body["error"] == "PoolUnavailable" and "cannot check tokens with JupyterHub" in body["message"]


def test_tcp_without_a_hub_refuses_everyone(tmp_path: Path) -> None:
    harness = BrokerHarness(tmp_path).start()
    try:
        assert harness.broker is not None
        harness.broker.hub = None
        status, body = harness.http("GET", "api/gpupool/pool", "anything")
        assert status == 401 and "Unix socket" in body["message"]
    finally:
        harness.stop()


# --- quotas and priorities from hub groups --------------------------------------------------------------
def test_group_quota_limits_the_group_and_priority_comes_from_the_group(
    make_harness: Callable[..., BrokerHarness],
) -> None:
    harness = make_harness(
        policy={"group_quotas": {"cs101": {"maximum": "8GiB"}}, "group_priorities": {"staff": "high"}}
    )
    alice, bob, carol = harness.remote(ALICE), harness.remote(BOB), harness.remote(CAROL)
    a = alice.request(LeaseRequest(owner="", memory=8 * GIB))
    b = bob.request(LeaseRequest(owner="", memory=4 * GIB))
    assert a.state is LeaseState.GRANTED
    assert b.state is LeaseState.QUEUED, "cs101 together may hold at most 8 GiB"
    info = bob.queue_info(b.id)
    assert info is not None and "cs101" in info.reason
    c = carol.request(LeaseRequest(owner="", memory=4 * GIB))
    assert c.state is LeaseState.GRANTED and c.priority.value == "high"
    # A user cannot raise their own class: Alice asking for "high" stays normal.
    _, body = harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "1GiB", "priority": "high"})
    assert body["priority"] == "normal"
    alice.release(a.id)
    assert bob.wait_for_grant(b.id, timeout=20).state is LeaseState.GRANTED


def test_groups_are_read_from_the_hub_at_request_time(harness: BrokerHarness) -> None:
    _, body = harness.http("POST", "api/gpupool/leases", CAROL, {"memory": "1GiB"})
    assert body["groups"] == ["staff"]
    harness.tokens[CAROL]["groups"] = ["cs101", "staff"]  # the hub admin adds carol to cs101
    _, body = harness.http("POST", "api/gpupool/leases", CAROL, {"memory": "1GiB"})
    assert body["groups"] == ["cs101", "staff"]


# --- kernels and lease routes ------------------------------------------------------------------------
def test_kernel_routes_match_the_single_user_api(harness: BrokerHarness) -> None:
    harness.http("POST", "api/gpupool/leases", ALICE, request_body(kernel_id="k-alice"))
    harness.http("POST", "api/gpupool/leases", BOB, request_body(kernel_id="k-bob"))
    status, _ = harness.http("POST", "api/gpupool/leases", ALICE, request_body(kernel_id="k-alice-2"))
    assert status == 201
    status, body = harness.http("GET", "api/gpupool/kernels/k-alice-2", ALICE)
    assert status == 200
    assert body["state"] == "queued" and body["queue_position"] == 1 and body["queue_length"] == 1
    status, body = harness.http("GET", "api/gpupool/kernels/k-alice", ALICE)
    assert body["state"] == "granted" and body["memory"] == 8 * GIB and body["devices"][0]["index"] == 0
    assert body["enforcement"]["level"] and body["idle_seconds"] >= 0
    status, body = harness.http(
        "POST", "api/gpupool/kernels/k-alice/reserve", ALICE, {"memory": "6GiB", "duration": "2h"}
    )
    assert status == 200 and body["memory"] == 6 * GIB and body["keep_until"]
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/reserve", ALICE, {"memory": "12 parsecs"})
    assert status == 400 and "8GiB" in body["message"]
    status, body = harness.http("GET", "api/gpupool/kernels/k-unknown", ALICE)
    assert status == 404
    status, body = harness.http("POST", "api/gpupool/kernels/k-alice/release", ALICE)
    assert body["state"] == "released"
    status, body = harness.http("GET", "api/gpupool/kernels/k-alice-2", ALICE)
    assert body["state"] == "granted", "releasing one slice grants the queued one"


def test_reconcile_releases_only_the_callers_gone_kernels(harness: BrokerHarness) -> None:
    alice, bob = harness.remote(ALICE), harness.remote(BOB)
    mine = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k1", holder_host="h", holder_pid=7))
    kept = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k2", holder_host="h", holder_pid=7))
    theirs = bob.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k3", holder_host="h", holder_pid=7))
    gone = alice.reconcile_kernels("h", 7, {"k2"})
    assert [lease.id for lease in gone] == [mine.id]
    assert alice.get(kept.id).state is LeaseState.GRANTED
    assert bob.get(theirs.id).state is LeaseState.GRANTED


def test_activity_keepalive_and_heartbeat_reach_the_engine(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB))
    alice.report_activity(lease.id, Activity(busy=True, connections=2))
    got = alice.get(lease.id)
    assert got.busy and got.connections == 2
    alice.report_activities({lease.id: Activity(busy=False, last_activity=time.time() - 5, connections=1)})
    assert alice.get(lease.id).connections == 1
    before = alice.get(lease.id).heartbeat_at
    alice.heartbeat([lease.id])
    assert alice.get(lease.id).heartbeat_at >= before
    assert alice.keep(lease.id, 600).keep_until is not None
    with pytest.raises(Exception, match="."):
        alice.keep(lease.id, 10 * 24 * 3600)  # beyond max_keep


def test_sizes_below_the_smallest_slice_and_backwards_report_ranges_are_refused(harness: BrokerHarness) -> None:
    """A bare ``8`` counts bytes: the broker's API refuses it as a slice's guarantee, limit, resize or
    reservation (it once queued an 8-byte request), and a report whose since is after its until is a 400
    (it once answered no rows). Nothing changes."""
    alice, admin = harness.remote(ALICE), harness.remote(ADMIN)
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB))
    before = state(harness)
    floor = "below the smallest GPU slice of 64 MiB"
    with pytest.raises(InvalidInput, match=f'memory 8 is 8 bytes.*{floor}; did you mean "8GiB"'):
        alice.request(LeaseRequest(owner="", memory=8))
    with pytest.raises(InvalidInput, match=f"limit 8 is 8 bytes.*{floor}"):
        alice.request(LeaseRequest(owner="", memory=4 * GIB, burst_limit=8))
    with pytest.raises(InvalidInput, match=f"memory 8 is 8 bytes.*{floor}"):
        alice.resize(lease.id, memory=8)
    with pytest.raises(InvalidInput, match=f"memory 1MiB is 1 MiB, {floor}"):
        admin.book_reservation({"name": "lab", "memory": "1MiB", "groups": ["cs101"], "duration": "1h"})
    with pytest.raises(InvalidInput, match="the date range is backwards"):
        admin.report(since=2_000_000_000.0, until=1_900_000_000.0)
    assert state(harness) == before
    assert admin.report(since=1_900_000_000.0, until=2_000_000_000.0) == []


def test_preferences_reports_events_and_reservations_are_per_user(harness: BrokerHarness) -> None:
    alice, bob, admin = harness.remote(ALICE), harness.remote(BOB), harness.remote(ADMIN)
    alice.set_preference(memory="4GiB")
    assert alice.preference() == {"memory": "4GiB"} and bob.preference() == {}
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB))
    alice.release(lease.id)
    b = bob.request(LeaseRequest(owner="", memory=2 * GIB))
    bob.release(b.id)
    assert {row["user"] for row in alice.report()} == {"alice"}
    assert {row["user"] for row in admin.report()} == {"alice", "bob"}
    with pytest.raises(NotAuthorized):
        alice.report(by="group")
    assert {e["owner"] for e in alice.events()} == {"alice"}
    with pytest.raises(NotAuthorized):
        alice.book_reservation({"name": "lab", "memory": "8GiB", "groups": ["cs101"], "duration": "1h"})
    admin.book_reservation({"name": "lab", "memory": "8GiB", "groups": ["cs101"], "duration": "1h"})
    assert [r.name for r in alice.reservations()] == ["lab"]
    admin.cancel_reservation("lab")
    assert alice.reservations() == []


# --- the Unix socket -------------------------------------------------------------------------------------
def test_socket_peer_is_identified_by_uid(harness: BrokerHarness) -> None:
    from jupyter_gpupool.backends.remote import RemotePool

    me = RemotePool(harness.socket_url).whoami()
    import pwd

    assert me["name"] == pwd.getpwuid(os.getuid()).pw_name and me["kind"] == "unix"
    assert me["admin"] == (os.getuid() == 0)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another Unix user")
def test_socket_peer_as_another_unix_user_is_not_admin_and_cannot_touch_roots_leases(
    make_harness: Callable[..., BrokerHarness], tmp_path: Path
) -> None:
    import shutil
    import tempfile

    from jupyter_gpupool.backends.remote import RemotePool

    public = tempfile.mkdtemp(prefix="gpupool-sock-")  # pytest's tmp tree is private to root
    os.chmod(public, 0o755)
    try:
        _as_nobody(make_harness(socket_path=os.path.join(public, "broker.sock")), RemotePool)
    finally:
        shutil.rmtree(public, ignore_errors=True)


def _as_nobody(harness: BrokerHarness, remote_pool: Any) -> None:
    root = remote_pool(harness.socket_url)
    lease = root.request(LeaseRequest(owner="", memory=4 * GIB))
    assert lease.owner == "root"
    script = (
        "import socket,sys\n"
        "def call(m, r):\n"
        " s=socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
        " s.sendall(f'{m} {r} HTTP/1.0\\r\\nHost: x\\r\\nContent-Length: 0\\r\\n\\r\\n'.encode()); d=b''\n"
        " while True:\n"
        "  c=s.recv(65536)\n"
        "  if not c: break\n"
        "  d+=c\n"
        " h,_,b=d.partition(b'\\r\\n\\r\\n'); print(h.split()[1].decode(), b.decode())\n"
        "call('GET','/services/gpupool/api/gpupool/whoami')\n"
        f"call('DELETE','/services/gpupool/api/gpupool/leases/{lease.id}')\n"
        "call('GET','/services/gpupool/metrics')\n"
    )
    out = subprocess.run(
        ["/usr/bin/python3", "-c", script, harness.socket_path],
        user="nobody",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stderr
    status, body = lines[0].split(" ", 1)
    assert status == "200" and json.loads(body)["name"] == "nobody" and json.loads(body)["admin"] is False
    assert lines[1].startswith("403 ")
    assert lines[2].startswith("403 ")
    assert root.get(lease.id).state is LeaseState.GRANTED


def test_a_cli_booking_over_the_socket_lasts_its_duration_not_the_heartbeat_ttl(
    make_harness: Callable[..., BrokerHarness],
) -> None:
    """``jupyter gpupool request 1GiB --for 4s`` over the Unix socket: the CLI exits at once; its booking
    is held for its duration (no holder pid, no heartbeat needed), then released."""
    harness = make_harness(policy={"heartbeat_ttl": 1.0})
    env = {**os.environ, "GPUPOOL_URL": harness.socket_url}
    env.pop("GPUPOOL_DB", None)
    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.apps.cli", "request", "1GiB", "--for", "4s", "--json"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    booked = json.loads(out.stdout)
    assert booked["state"] == "granted" and booked["holder_pid"] is None and booked["duration"] == 4
    time.sleep(2.5)  # more than twice the heartbeat TTL
    lease = harness.on_broker(harness.pool.get, booked["id"])
    assert lease.state is LeaseState.GRANTED, lease.release_reason
    released = wait_for(
        lambda: (l := harness.on_broker(harness.pool.get, booked["id"])).state is LeaseState.RELEASED and l,
        timeout=10,
        what="the end of the booking",
    )
    assert "its time" in released.release_reason
    assert released.released_at - released.granted_at >= 4


def test_a_socket_request_without_a_duration_is_held_by_the_connecting_process(harness: BrokerHarness) -> None:
    status, body = unix_http_json(harness.socket_path, "POST", "/api/gpupool/leases", {"memory": "1GiB"})
    assert status == 201 and body["holder_pid"] == os.getpid()


# --- watchdog in the broker ----------------------------------------------------------------------------
def test_broker_watchdog_finds_the_kernel_by_its_lease_variable_and_interrupts_it(
    make_harness: Callable[..., BrokerHarness],
) -> None:
    harness = make_harness(
        watchdog={"interval": 0.1, "grace": 0.0, "action": "interrupt", "tolerance_bytes": 0, "tolerance": 0.0},
        policy={"burst": "0"},  # fixed slices: use over the slice is over its limit (an elastic one would grow)
    )
    alice = harness.remote(ALICE)
    # Alice's server (here: this process) asks for it; a hub user without a Unix account claims
    # only processes of her own server's (see tests/test_ownership.py).
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB, holder_pid=os.getpid(), holder_host=socket.gethostname()))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["GPUPOOL_LEASE_ID"] = lease.id
    # A "kernel" whose child dropped every variable (env -i) and uses the GPU.
    kernel = subprocess.Popen(["/bin/sh", "-c", "env -i /bin/sleep 60 & wait"], env=env, start_new_session=True)
    try:
        import psutil

        child = wait_for(lambda: psutil.Process(kernel.pid).children(), what="the kernel's child")[0]
        device = harness.on_broker(lambda: harness.pool.devices()[0].uuid)
        harness.pool.backend.set_usage(child.pid, device, 6 * GIB)  # type: ignore[attr-defined]
        wait_for(lambda: alice.get(lease.id).used_memory == 6 * GIB, what="usage charged to the lease")
        # SIGINT goes to the kernel (the shell), which dies of it.
        wait_for(lambda: kernel.poll() is not None, what="the kernel interrupted")
        assert kernel.returncode in (-signal.SIGINT, 130)
        assert alice.get(lease.id).over_limit_since is not None
    finally:
        import psutil

        for proc in psutil.Process(kernel.pid).children(recursive=True) if kernel.poll() is None else []:
            proc.kill()
        if kernel.poll() is None:
            kernel.kill()
        kernel.wait()


def test_broker_watchdog_stops_a_process_that_uses_a_gpu_outside_the_pool_after_the_grace(
    make_harness: Callable[..., BrokerHarness],
) -> None:
    """On a multi-user host the broker's default for unpooled use is 'stop': a process without a
    lease holding GPU memory is seen (pid, bytes, why, for an admin; anonymous for others), never
    granted to anyone, and terminated once the grace is over."""
    harness = make_harness(simulate="1x16GiB", watchdog={"interval": 0.1, "grace": 1.0})
    rogue = subprocess.Popen(["/bin/sleep", "60"], env={"PATH": "/usr/bin:/bin"})
    try:
        device = harness.on_broker(lambda: harness.pool.devices()[0].uuid)
        harness.pool.backend.set_usage(rogue.pid, device, 10 * GIB)  # type: ignore[attr-defined]
        status, body = wait_for(lambda: (r := harness.http("GET", "api/gpupool/pool", ADMIN))[1].get("unpooled") and r,
                                what="the unpooled use in the admin's pool view")
        assert [(u["pid"], u["bytes"], u["why"]) for u in body["unpooled"]] == [(rogue.pid, 10 * GIB, "no lease")]
        _, seen_by_alice = harness.http("GET", "api/gpupool/pool", ALICE)
        assert [(u["pid"], u["user"], u["bytes"]) for u in seen_by_alice["unpooled"]] == [(None, None, 10 * GIB)]
        waiting = harness.remote(ALICE).request(LeaseRequest(owner="", memory=8 * GIB))
        assert waiting.state is LeaseState.QUEUED  # 10 of 16 GiB are taken outside the pool
        wait_for(lambda: rogue.poll() is not None, timeout=30, what="the process stopped")  # (the in-process broker reaps it)
    finally:
        if rogue.poll() is None:
            rogue.kill()
        rogue.wait()


def test_watchdog_ignores_a_process_that_copies_another_users_lease_variable(harness: BrokerHarness) -> None:
    from jupyter_gpupool.broker.app import find_kernel_roots
    from jupyter_gpupool.core.models import Lease

    if os.getuid() != 0:
        pytest.skip("needs root to run a process as another user")
    lease = Lease(id="l-x", owner="root", memory=GIB, state=LeaseState.GRANTED, created_at=0.0)
    env = {"GPUPOOL_LEASE_ID": "l-x", "PATH": "/usr/bin:/bin"}
    proc = subprocess.Popen(["/bin/sleep", "30"], env=env, user="nobody")
    try:
        wait_for(lambda: _environ_visible(proc.pid), what="the process started")
        assert find_kernel_roots([proc.pid], {"l-x": lease}) == {}
        mine = subprocess.Popen(["/bin/sleep", "30"], env=env)
        try:
            wait_for(lambda: _environ_visible(mine.pid), what="the process started")
            assert find_kernel_roots([mine.pid], {"l-x": lease}) == {"l-x": mine.pid}
        finally:
            mine.kill()
            mine.wait()
    finally:
        proc.kill()
        proc.wait()


def _environ_visible(pid: int) -> bool:
    import psutil

    try:
        return "GPUPOOL_LEASE_ID" in psutil.Process(pid).environ()
    except psutil.Error:
        return False


# --- metrics -------------------------------------------------------------------------------------------
def test_metrics_need_a_metrics_or_admin_scope(harness: BrokerHarness) -> None:
    harness.add_user("tok-prometheus", "prometheus-service", extra=("read:metrics",))
    harness.http("POST", "api/gpupool/leases", ALICE, request_body())
    assert harness.http("GET", "metrics")[0] == 401
    assert harness.http("GET", "metrics", ALICE)[0] == 403
    for token in ("tok-prometheus", ADMIN):
        status, text = harness.http("GET", "metrics", token)
        assert status == 200
        assert "gpupool_memory_leased_bytes 8.589934592e+09" in text
        assert "gpupool_grants_total 1.0" in text
    status, _ = unix_http(harness.socket_path, "GET", "/services/gpupool/metrics")
    assert status == (200 if os.getuid() == 0 else 403)


def test_info_carries_the_policy_a_remote_client_needs(harness: BrokerHarness) -> None:
    alice = harness.remote(ALICE)
    assert alice.default_memory() == 8 * GIB
    assert alice.policy.default_memory == "8GiB"
    assert alice.policy.idle_policy == "pressure"
    assert "simulated 1x16GiB" in alice.backend.describe()
    assert alice.parse_memory("50%") == 8 * GIB
    assert sys.modules["jupyter_gpupool.broker"].BrokerApp.name == "jupyter-gpupool-broker"
    assert ACCESS in harness.tokens[ALICE]["scopes"]


# --- TLJH plugin ------------------------------------------------------------------------------------------
def test_tljh_plugin_configures_service_scopes_roles_and_server_env() -> None:
    from importlib.metadata import entry_points

    from traitlets.config import Config

    from jupyter_gpupool.apps import tljh

    c = Config()
    c.Authenticator.admin_users = {"teacher"}
    c.JupyterHub.load_roles = [{"name": "user", "scopes": ["self"]}]
    tljh.configure_hub(c, {"default_memory": "8GiB", "port": 10202}, python="/opt/tljh/hub/bin/python3")
    tljh.configure_hub(c, {"default_memory": "8GiB", "port": 10202}, python="/opt/tljh/hub/bin/python3")  # idempotent
    (service,) = [s for s in c.JupyterHub.services if s["name"] == "gpupool"]
    assert service["url"] == "http://127.0.0.1:10202"
    assert service["command"] == ["/opt/tljh/hub/bin/python3", "-m", "jupyter_gpupool.broker"]
    assert service["environment"]["GPUPOOL_DEFAULT_MEMORY"] == "8GiB"
    assert "custom:gpupool:admin" in c.JupyterHub.custom_scopes
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert roles["user"]["scopes"] == ["self", ACCESS]
    assert roles["gpupool-admin"]["users"] == ["teacher"] and "custom:gpupool:admin" in roles["gpupool-admin"]["scopes"]
    assert c.Spawner.server_token_scopes == [
        "users:activity!user",
        "access:servers!server",
        ACCESS,
        "custom:gpupool:admin",
    ]
    assert c.Spawner.environment["GPUPOOL_URL"] == "http://127.0.0.1:10202/services/gpupool"
    with pytest.raises(ValueError, match="unknown gpupool setting"):
        tljh.configure_hub(Config(), {"defualt_memory": "8GiB"})
    # The hook is a pluggy implementation for the "tljh" project.
    assert getattr(tljh.tljh_custom_jupyterhub_config, "tljh_impl", None) is not None
    declared = [ep.value for ep in entry_points(group="tljh")]
    if declared:  # installed package: pyproject declares the plugin
        assert "jupyter_gpupool.apps.tljh" in declared
    # And the generated config is valid for JupyterHub's traits.
    from jupyterhub.app import JupyterHub

    hub = JupyterHub(config=c)
    assert hub.services[-1]["name"] == "gpupool"


def test_handlers_never_import_the_broker_app() -> None:
    """One direction only: ``broker/app.py`` imports the handlers; the handlers reach the broker
    through ``broker/interface.py`` (not even a TYPE_CHECKING import of ``app``)."""
    import ast

    import jupyter_gpupool.broker.handlers as handlers
    import jupyter_gpupool.broker.interface as interface

    for module in (handlers, interface):
        tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[arg-type]
        imported = {(node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)} | {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        assert not any(name in ("app", ".app") or name.endswith("broker.app") for name in imported), (
            module.__name__,
            imported,
        )
