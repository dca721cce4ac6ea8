"""The authorization matrix: every route of the broker and of the server extension, called by every
kind of caller, with thousands of leases in the store.

Callers: anonymous, user A (owns the lease or kernel the route names), user B, an admin, a forged
token, an expired token (the hub knew it once), another service's token, and a request carrying
only a cookie (no token, no XSRF header). Only the allowed cells succeed (2xx); every other cell is
401/403 with a message, and changes nothing.

The routes are read from the apps' own handler lists: a new route without a row here fails
:func:`test_every_broker_route_has_a_row` / :func:`test_every_server_route_has_a_row`.

Before the matrix runs, 3,000 other users' live leases, all newer than A's, are written to the
store (through ``Store.save_leases``, the call the pool itself makes: 3,000 ``Pool.request`` calls
take minutes here), so a check that relied on a listing of the newest leases would miss A's lease.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
from tornado import web

from jupyter_gpupool.broker.handlers import NotFoundHandler
from jupyter_gpupool.broker.routes import routes
from jupyter_gpupool.core.models import LeaseRequest
from jupyter_gpupool.serverextension.handlers import default_handlers
from jupyter_gpupool.units import MIB, MIN_SLICE

try:
    from broker_harness import BrokerHarness
except ImportError:  # tests as a package
    from tests.broker_harness import BrokerHarness

pytestmark = pytest.mark.slow

OTHER_LEASES = 3000
CALLERS = ("anonymous", "user_a", "user_b", "admin", "forged", "expired", "other_service", "cookie_only")
#: Who may succeed: "all" users, "owner" (A) and the admin, or the "admin" alone.
ALL, OWNER, ADMIN = frozenset({"user_a", "user_b", "admin"}), frozenset({"user_a", "admin"}), frozenset({"admin"})
METHODS = ("get", "post", "put", "patch", "delete")


def add_other_leases(pool: Any, count: int = OTHER_LEASES) -> None:
    """``count`` live 1 MiB leases of other users, all created after every lease so far."""
    template = pool.request(LeaseRequest(owner="filler", memory=MIB, kernel_id="k-filler"))
    now = time.time()
    clones = [
        template.copy(
            id=f"l-zz-other-{i:05d}",
            owner=f"user{i % 97}",
            kernel_id=f"k-other-{i}",
            created_at=now + 1 + i / 1000,
            heartbeat_at=None,
        )
        for i in range(count)
    ]
    with pool.store.transaction():
        pool.store.save_leases(clones)
    assert len(stored(pool)[0]) > count


def stored(pool: Any) -> tuple[list[Any], ...]:
    """Every lease, preference and reservation row, read from the file itself (no listing limit)."""
    conn = sqlite3.connect(f"file:{pool.db_path}?mode=ro", uri=True, timeout=30)
    try:
        return tuple(
            conn.execute(f"SELECT * FROM {table} ORDER BY 1").fetchall()
            for table in ("leases", "preferences", "reservations")
        )
    finally:
        conn.close()


def implemented(handler: type) -> set[str]:
    """The HTTP methods a handler class answers itself."""
    return {m.upper() for m in METHODS if getattr(handler, m) is not getattr(web.RequestHandler, m)}


# --- the broker -----------------------------------------------------------------------------------------

#: (handler, method) → (path under the API, body, who may succeed). {lease} and {kernel} are user A's.
BROKER_ROWS: dict[tuple[str, str], tuple[str, Any, frozenset[str]]] = {
    ("WhoAmIHandler", "GET"): ("whoami", None, ALL),
    ("InfoHandler", "GET"): ("info", None, ALL),
    ("PoolHandler", "GET"): ("pool", None, ALL),
    ("DevicesHandler", "GET"): ("devices", None, ALL),
    ("QueueHandler", "GET"): ("queue", None, ALL),
    ("LeasesHandler", "GET"): ("leases?owner=alice&kernel_id={kernel}", None, OWNER),
    ("LeasesHandler", "POST"): ("leases", {"memory": "64MiB"}, ALL),
    ("LeaseHandler", "GET"): ("leases/{lease}", None, OWNER),
    ("LeaseHandler", "DELETE"): ("leases/{lease}", None, OWNER),
    ("LeaseReleaseHandler", "POST"): ("leases/{lease}/release", {}, OWNER),
    ("LeaseResizeHandler", "POST"): ("leases/{lease}/resize", {"memory": "128MiB", "limit": "512MiB"}, OWNER),
    ("LeaseGrowHandler", "POST"): ("leases/{lease}/grow", {"needed": "192MiB"}, OWNER),
    ("LeasePinnedBackupHandler", "POST"): ("leases/{lease}/pinned-backup", {"bytes": 0}, OWNER),
    ("LeaseKeepHandler", "POST"): ("leases/{lease}/keepalive", {"duration": "1h"}, OWNER),
    ("LeasePriorityHandler", "POST"): ("leases/{lease}/priority", {"priority": "batch"}, ADMIN),
    ("LeaseActivityHandler", "POST"): ("leases/{lease}/activity", {"busy": True}, OWNER),
    ("LeaseWaitHandler", "GET"): ("leases/{lease}/wait?timeout=0", None, OWNER),
    ("LeaseSuspendHandler", "POST"): ("leases/{lease}/suspend", {"reason": "r"}, OWNER),
    ("LeaseResumeHandler", "POST"): ("leases/{lease}/resume", {}, OWNER),
    ("LeaseTransitionHandler", "POST"): (
        "leases/{lease}/transition",
        {"outcome": "done", "transition": "suspending", "parked_bytes": 0},
        OWNER,
    ),
    ("ChangesHandler", "GET"): ("changes?timeout=0", None, ALL),
    ("ActivityHandler", "POST"): ("activity", {"activities": {"{lease}": {"busy": True}}}, OWNER),
    ("HeartbeatHandler", "POST"): ("heartbeat", {"lease_ids": ["{lease}"]}, OWNER),
    ("ReconcileHandler", "POST"): ("reconcile", {"holder_host": "h", "holder_pid": 1, "live_kernel_ids": []}, ALL),
    ("TickHandler", "POST"): ("tick", {}, ALL),
    ("KernelStatusHandler", "GET"): ("kernels/{kernel}", None, OWNER),
    ("KernelReserveHandler", "POST"): ("kernels/{kernel}/reserve", {"memory": "128MiB", "limit": 0}, OWNER),
    ("KernelReleaseHandler", "POST"): ("kernels/{kernel}/release", {}, OWNER),
    ("KernelKeepaliveHandler", "POST"): ("kernels/{kernel}/keepalive", {}, OWNER),
    ("KernelSuspendHandler", "POST"): ("kernels/{kernel}/suspend", {}, OWNER),
    ("KernelResumeHandler", "POST"): ("kernels/{kernel}/resume", {}, OWNER),
    ("ReportHandler", "GET"): ("report?by=group", None, ADMIN),
    ("ReservationsHandler", "GET"): ("reservations", None, ALL),
    ("ReservationsHandler", "POST"): (
        "reservations",
        {"name": "r-{kernel}", "memory": "64MiB", "groups": ["g"], "duration": "1h"},
        ADMIN,
    ),
    ("ReservationHandler", "DELETE"): ("reservations/r-held", None, ADMIN),
    ("PreferencesHandler", "GET"): ("preferences", None, ALL),
    ("PreferencesHandler", "PATCH"): ("preferences", {"memory": "64MiB"}, ALL),
    ("EventsHandler", "GET"): ("events", None, ALL),
    ("ClaimHandler", "DELETE"): ("claims/k-no-lease-named-it", None, ADMIN),
    ("MetricsHandler", "GET"): ("/metrics", None, ADMIN),
    ("NotFoundHandler", "GET"): ("no-such-route", None, frozenset()),  # 404 for the known, 401/403 first
}


#: Rows whose cells each need a fresh lease of A in a given state: "suspendable" (granted, its server
#: can checkpoint), "suspending" (a suspend under way: confirming it frees GPU memory), "suspended".
BROKER_ROW_TARGETS: dict[tuple[str, str], str] = {
    ("LeaseSuspendHandler", "POST"): "suspendable",
    ("LeaseTransitionHandler", "POST"): "suspending",
    ("LeaseResumeHandler", "POST"): "suspended",
    ("KernelSuspendHandler", "POST"): "suspendable",
    ("KernelResumeHandler", "POST"): "suspended",
}


def fresh_target(harness: BrokerHarness, kind: str) -> Any:
    """A new smallest-slice (64 MiB) lease of A's in the state ``kind`` names (see :data:`BROKER_ROW_TARGETS`)."""
    fresh_target.made += 1  # type: ignore[attr-defined]
    kernel_id = f"k-a-suspendable-{fresh_target.made}"  # type: ignore[attr-defined]
    lease = harness.remote("tok-alice").request(
        LeaseRequest(owner="", memory=MIN_SLICE, kernel_id=kernel_id, suspendable=True)
    )
    if kind in ("suspending", "suspended"):
        harness.on_broker(harness.pool.suspend, lease.id)
    if kind == "suspended":
        harness.on_broker(harness.pool.confirm_transition, lease.id)
    return harness.on_broker(harness.pool.get, lease.id)


fresh_target.made = 0  # type: ignore[attr-defined]


def test_every_broker_route_has_a_row() -> None:
    handlers = {handler for _, handler in routes("/")} | {NotFoundHandler}
    missing = [
        (handler.__name__, method)
        for handler in handlers
        for method in implemented(handler) | ({"GET"} if handler is NotFoundHandler else set())
        if (handler.__name__, method) not in BROKER_ROWS
    ]
    assert not missing, f"routes without a row in the authorization matrix: {missing}"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    harness = BrokerHarness(
        tmp_path_factory.mktemp("auth-broker"), simulate="1x80GiB", policy={"heartbeat_ttl": 3600.0}
    ).start()
    harness.add_user("tok-alice", "alice", groups=("cs101",))
    harness.add_user("tok-bob", "bob", groups=("cs101",))
    harness.add_user("tok-admin", "prof", admin=True)
    harness.add_user("tok-expired", "alice")
    assert harness.http("GET", "api/gpupool/whoami", "tok-expired")[0] == 200
    del harness.tokens["tok-expired"]  # it worked once; the hub has forgotten it
    harness.tokens["tok-other-service"] = {
        "kind": "service",
        "name": "other",
        "scopes": ["access:services!service=other"],
    }
    alice = harness.remote("tok-alice")
    # A's leases first (the oldest), then thousands of newer ones of other users.
    targets = [alice.request(LeaseRequest(owner="", memory=MIN_SLICE, kernel_id=f"k-a-{i}")) for i in range(48)]
    harness.on_broker(add_other_leases, harness.pool)
    try:
        yield {"harness": harness, "targets": targets}
    finally:
        harness.stop()


def broker_call(harness: BrokerHarness, caller: str, method: str, path: str, body: Any) -> tuple[int, Any]:
    tokens = {
        "user_a": "tok-alice",
        "user_b": "tok-bob",
        "admin": "tok-admin",
        "forged": "tok-forged-123",
        "expired": "tok-expired",
        "other_service": "tok-other-service",
    }
    headers = {"Cookie": "jupyterhub-session-id=abc; gpupool=tok-alice"} if caller == "cookie_only" else None
    if path.startswith("/"):  # outside the API prefix (/metrics)
        return harness.http(method, path, tokens.get(caller), body, headers=headers)
    return harness.http(method, "api/gpupool/" + path, tokens.get(caller), body, headers=headers)


@pytest.mark.parametrize("row", sorted(BROKER_ROWS), ids=lambda row: f"{row[1]} {row[0]}")
def test_broker_matrix(broker: dict[str, Any], row: tuple[str, str]) -> None:
    harness: BrokerHarness = broker["harness"]
    targets: list[Any] = broker["targets"]
    template, body_template, allowed = BROKER_ROWS[row]
    method = row[1]
    target = targets[0]
    for caller in CALLERS:
        kind = BROKER_ROW_TARGETS.get(row)
        if kind is not None:
            target = fresh_target(harness, kind)
        if "reservations/r-held" in template:
            harness.http(
                "POST",
                "api/gpupool/reservations",
                "tok-admin",
                {"name": "r-held", "memory": "64MiB", "groups": ["g"], "duration": "1h"},
            )
        path = template.replace("{lease}", target.id).replace("{kernel}", target.kernel_id)
        body = (
            json.loads(json.dumps(body_template).replace("{lease}", target.id).replace("{kernel}", target.kernel_id))
            if body_template is not None
            else None
        )
        before = stored(harness.pool)
        status, payload = broker_call(harness, caller, method, path, body)
        cell = f"{caller} {method} {path}: {status} {str(payload)[:200]}"
        if caller in allowed:
            assert 200 <= status < 300, cell
            if method != "GET" and kind is None:  # it may have changed A's lease: the next caller gets a fresh one
                targets.pop(0)
                target = targets[0]
            continue
        expected = {"anonymous": 401, "forged": 401, "expired": 401, "cookie_only": 401, "other_service": 403}
        if row[0] == "NotFoundHandler" and caller in ("user_a", "user_b", "admin"):
            assert status == 404, cell
        else:
            assert status == expected.get(caller, 403), cell
        assert isinstance(payload, dict) and payload.get("message"), cell
        assert stored(harness.pool) == before, f"{cell}: refused, yet the pool changed"
        if caller == "user_b" and isinstance(payload, dict):
            assert "alice" not in json.dumps(payload), f"{cell}: the refusal names the owner"


# --- the server extension -----------------------------------------------------------------------------

#: handler → (path under /api/gpupool/, body, who may succeed); {kernel} is user A's (alice's) kernel.
SERVER_ROWS: dict[tuple[str, str], tuple[str, Any, frozenset[str]]] = {
    ("PoolHandler", "GET"): ("pool", None, ALL),
    ("KernelStatusHandler", "GET"): ("kernels/{kernel}", None, OWNER),
    ("ReserveHandler", "POST"): ("kernels/{kernel}/reserve", {"memory": "128MiB"}, OWNER),
    ("ReleaseHandler", "POST"): ("kernels/{kernel}/release", {}, OWNER),
    ("KeepaliveHandler", "POST"): ("kernels/{kernel}/keepalive", {}, OWNER),
    ("SuspendHandler", "POST"): ("kernels/{kernel}/suspend", {}, OWNER),
    ("ResumeHandler", "POST"): ("kernels/{kernel}/resume", {}, OWNER),
}


def test_every_server_route_has_a_row() -> None:
    missing = [
        (handler.__name__, method)
        for _, handler in default_handlers
        for method in implemented(handler)
        if (handler.__name__, method) not in SERVER_ROWS
    ]
    assert not missing, f"routes without a row in the authorization matrix: {missing}"


@pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")
def test_server_matrix(
    arun: Any, jp_serverapp: Any, gpupool_ext: Any, gpupool_fetch: Any, jp_fetch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = gpupool_ext.pool
    pool.policy.heartbeat_ttl = 3600.0
    targets = [  # suspendable: the suspend row's allowed cells succeed (a server that can checkpoint)
        pool.request(LeaseRequest(owner="alice", memory=MIB, kernel_id=f"k-a-{i}", suspendable=True))
        for i in range(16)
    ]
    add_other_leases(pool)
    provider = jp_serverapp.identity_provider
    provider.users["expired-token"] = "alice"
    users = dict(provider.users)

    async def login_cookie() -> str:
        # A browser's login: a token in the URL once, then the cookie jupyter_server sets for it.
        response = await jp_fetch(
            "api", "gpupool", "pool", params={"token": "alice-token"}, headers={"Authorization": ""}
        )
        cookies = response.headers.get_list("Set-Cookie")
        return "; ".join(c.split(";", 1)[0] for c in cookies)

    async def call(caller: str, method: str, path: str, body: Any, cookie: str) -> tuple[int, Any]:
        tokens = {
            "user_a": "alice-token",
            "user_b": "bob-token",
            "admin": "carol-token",
            "forged": "forged-token",
            "expired": "expired-token",
            "other_service": "tok-other-service",
        }
        headers = {"Authorization": f"token {tokens[caller]}"} if caller in tokens else {"Authorization": ""}
        if caller == "cookie_only":
            headers["Cookie"] = cookie
        kwargs: dict[str, Any] = {"method": method, "headers": headers, "raise_error": False}
        if method != "GET":
            kwargs["body"] = json.dumps(body if body is not None else {})
        response = await jp_fetch("api", "gpupool", *path.split("/"), **kwargs)
        try:
            return response.code, json.loads(response.body)
        except ValueError:
            return response.code, response.body.decode(errors="replace")

    async def scenario() -> None:
        cookie = await login_cookie()
        # The expired token worked once; then the identity provider forgets it.
        assert (await call("expired", "GET", "pool", None, cookie))[0] == 200
        provider.users = {k: v for k, v in users.items() if k != "expired-token"}
        assert cookie, "jupyter_server set no login cookie for a token in the URL"
        assert (await call("cookie_only", "GET", "pool", None, cookie))[0] == 200, "a cookie reads (GET)"
        target = targets.pop(0)
        for (handler, method), (template, body, allowed) in sorted(SERVER_ROWS.items()):
            for caller in CALLERS:
                path = template.replace("{kernel}", target.kernel_id)
                before = stored(pool)
                status, payload = await call(caller, method, path, body, cookie)
                cell = f"{caller} {method} {path}: {status} {str(payload)[:200]}"
                may = caller in allowed or (caller == "cookie_only" and method == "GET" and "user_a" in allowed)
                if may:
                    assert 200 <= status < 300, cell
                    if method != "GET":
                        target = targets.pop(0)
                    continue
                assert status in (401, 403), cell
                assert stored(pool) == before, f"{cell}: refused, yet the pool changed"

    arun(scenario())


def test_matrix_size() -> None:
    """For RELIABILITY.md: routes × callers."""
    print(
        f"\nauthorization matrix: broker {len(BROKER_ROWS)} routes x {len(CALLERS)} callers = "
        f"{len(BROKER_ROWS) * len(CALLERS)} cells; server {len(SERVER_ROWS)} x {len(CALLERS)} = "
        f"{len(SERVER_ROWS) * len(CALLERS)} cells; {OTHER_LEASES} other leases in the store"
    )
