"""Hostile values in every body field and query argument of both REST APIs: 400-digit integers,
``1e400``, negative and past-the-OS pids, lists where a name belongs, deeply nested and oversized
bodies. Each one is a 400 (413 for a body too large) whose message names the accepted form,
changes nothing, and leaves the pool working (the scheduler still runs for everyone).

The table is the regression test for what was seen on main (500s, a ``holder_pid`` of 2**31 that
stopped every ``tick``, preferences saved as any JSON); ``test_fuzz_api.py`` searches for more.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.units import GIB

try:
    from broker_harness import BrokerHarness
    from pool_helpers import make_pool
except ImportError:  # tests as a package
    from tests.broker_harness import BrokerHarness
    from tests.pool_helpers import make_pool

HUGE = int("9" * 400)
NESTED = "[" * 5000 + "]" * 5000
#: (what, value) pairs no numeric field may accept.
BAD_NUMBERS: list[Any] = [HUGE, -HUGE, "1e400", "9" * 400, -1, 2**31, [1], {"a": 1}, True, "two"]


def lease_state(pool: Any) -> Any:
    leases = sorted(
        (
            lease.id,
            lease.state.value,
            lease.memory,
            lease.num_gpus,
            lease.priority.value,
            lease.keep_until,
            lease.holder_pid,
            lease.guarantee,
            lease.burst_limit,
            lease.pinned_backup,
        )
        for lease in pool.leases(include_released=True)
    )
    return leases, [pool.preference(n) for n in ("alice", "prof")], sorted(r.name for r in pool.reservations())


def raw_request(port: int, method: str, path: str, body: bytes, token: str) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(
        method, path, body=body, headers={"Authorization": f"token {token}", "Content-Type": "application/json"}
    )
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw.decode(errors="replace")


# --- the broker -----------------------------------------------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerHarness]:
    harness = BrokerHarness(tmp_path, simulate="1x16GiB").start()
    harness.add_user("tok-alice", "alice", groups=("cs101",))
    harness.add_user("tok-prof", "prof", admin=True)
    try:
        yield harness
    finally:
        harness.stop()


def broker_cases(lease_id: str) -> list[tuple[str, str, Any]]:
    """(method, path, body) for every field of every broker route, with each hostile value."""
    cases: list[tuple[str, str, Any]] = []
    for bad in BAD_NUMBERS:
        sizes = () if bad == 2**31 else ("memory",)  # 2**31 bytes is a fine 2 GiB
        for field in (*sizes, "num_gpus", "compute_share", "duration", "holder_pid"):
            cases.append(("POST", "api/gpupool/leases", {"memory": "1GiB", field: bad}))
        for field in (*sizes, "duration"):
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/resize", {field: bad}))
            cases.append(("POST", "api/gpupool/kernels/k-alice/reserve", {field: bad}))
        if sizes:  # an elastic slice's limit and a grow's need are sizes too
            cases.append(("POST", "api/gpupool/leases", {"memory": "1GiB", "limit": bad}))
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/resize", {"limit": bad}))
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/resize", {"memory": "4GiB", "limit": bad}))
            cases.append(("POST", "api/gpupool/kernels/k-alice/reserve", {"limit": bad}))
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/grow", {"needed": bad}))
        cases.append(("POST", f"api/gpupool/leases/{lease_id}/keepalive", {"duration": bad}))
        if bad != 2**31:  # 2 GiB of backup is a fine figure (refused as more than the slice, with 409)
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/pinned-backup", {"bytes": bad}))
        cases.append(("POST", "api/gpupool/kernels/k-alice/keepalive", {"duration": bad}))
        for field in ("connections",) if bad == 2**31 else ("last_activity", "connections"):  # 2**31 s: in 2038
            cases.append(("POST", f"api/gpupool/leases/{lease_id}/activity", {field: bad}))
            cases.append(("POST", "api/gpupool/activity", {"activities": {lease_id: {field: bad}}}))
        cases.append(("POST", "api/gpupool/reconcile", {"holder_host": "h", "holder_pid": bad, "live_kernel_ids": []}))
        cases.append(("PATCH", "api/gpupool/preferences", {"num_gpus": bad}))
        if sizes:
            cases.append(("PATCH", "api/gpupool/preferences", {"memory": bad}))
    for bad in ([1], {"a": 1}, 5, "x" * 300):  # where a name or id belongs
        for field in ("kernel_id", "holder_host", "model", "priority"):
            cases.append(("POST", "api/gpupool/leases", {"memory": "1GiB", field: bad}))
        cases.append(("POST", "api/gpupool/heartbeat", {"lease_ids": [bad]}))
        cases.append(("POST", "api/gpupool/reconcile", {"holder_host": bad, "holder_pid": 1}))
    for query in ("since=1e400", "since=" + "9" * 400, "until=nan", "by=team"):
        cases.append(("GET", f"api/gpupool/report?{query}", None))
    for query in ("timeout=nan", "timeout=-1", "timeout=1e400", "position=" + "9" * 400, "position=-2"):
        cases.append(("GET", f"api/gpupool/leases/{lease_id}/wait?{query}", None))
    for query in ("since=-1", "since=" + "9" * 400, "since=1e400", "since=1.5", "since=nan", "timeout=nan", "timeout=-1",
                  "timeout=1e400", "timeout=inf"):
        cases.append(("GET", f"api/gpupool/changes?{query}", None))
    for bad in (1.5, "1.5", "nan", "1e9", None, ""):  # not a whole number of bytes, or none at all
        cases.append(("POST", f"api/gpupool/leases/{lease_id}/pinned-backup", {"bytes": bad}))
    cases += [
        ("GET", "api/gpupool/events?after=" + "9" * 400, None),
        ("GET", "api/gpupool/events?after=-1", None),
        ("GET", "api/gpupool/leases?released=maybe", None),
        ("GET", "api/gpupool/leases?kernel_id=" + "k" * 300, None),
        ("GET", "api/gpupool/leases/" + "l" * 300, None),
        ("POST", f"api/gpupool/leases/{lease_id}/priority", {"priority": 5}),
        ("POST", f"api/gpupool/leases/{lease_id}/priority", {"priority": "urgent"}),
        ("POST", f"api/gpupool/leases/{lease_id}/release", {"reason": ["x"]}),
        ("POST", "api/gpupool/leases", {"memory": "-5GiB"}),
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "duration": "-1h"}),
        ("POST", "api/gpupool/reservations", {"name": "x", "memory": HUGE, "groups": ["g"], "duration": "1h"}),
        ("POST", "api/gpupool/reservations", {"name": "x", "memory": "1GiB", "groups": ["g"], "duration": "1e400"}),
        ("POST", "api/gpupool/reservations", {"name": ["x"], "memory": "1GiB", "groups": ["g"], "duration": "1h"}),
        ("POST", "api/gpupool/reservations", {"name": "x", "memory": "1GiB", "groups": [["g"]], "start": 1e300}),
        ("PATCH", "api/gpupool/preferences", {"num_gpus": "two"}),
        ("PATCH", "api/gpupool/preferences", {"priority": 5}),
        ("PATCH", "api/gpupool/preferences", {"model": ["A100"]}),
        ("PATCH", "api/gpupool/preferences", {"compute_share": 101}),
        ("PATCH", "api/gpupool/preferences", {"colour": "blue"}),
        ("POST", f"api/gpupool/leases/{lease_id}/grow", {}),
        ("POST", f"api/gpupool/leases/{lease_id}/grow", {"needed": None}),
        ("POST", f"api/gpupool/leases/{lease_id}/grow", {"needed": "1e400GiB"}),
        ("POST", f"api/gpupool/leases/{lease_id}/resize", {"limit": "-1GiB"}),
    ]
    return cases


def test_broker_refuses_every_hostile_value_with_400_and_changes_nothing(broker: BrokerHarness) -> None:
    alice = broker.remote("tok-alice")
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-alice"))
    before = broker.on_broker(lease_state, broker.pool)
    cases = broker_cases(lease.id)
    for method, path, body in cases:
        token = "tok-prof" if any(w in path for w in ("reservations", "priority", "report")) else "tok-alice"
        status, payload = broker.http(method, path, token, body)
        assert status == 400, (method, path, str(body)[:120], status, payload)
        message = payload["message"]
        assert "\n" not in message and len(message) < 400, message
        assert "expected" in message or "accepted" in message or "use " in message, message
    assert broker.on_broker(lease_state, broker.pool) == before
    # The scheduler still runs for everyone (a pid of 2**31 used to stop every tick).
    status, _ = broker.http("POST", "api/gpupool/tick", "tok-alice", {})
    assert status == 200
    assert len(cases) > 200


#: A lone UTF-16 surrogate: ``json.dumps`` writes it as ``"\\ud800"``, which JSON allows and no
#: UTF-8 text (SQLite's) can hold.
LONE = "\ud800"


def surrogate_cases(lease_id: str) -> list[tuple[str, str, Any]]:
    """(method, path, body) with a lone surrogate in each kind of string of every body."""
    return [
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": LONE}),
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": "k-new", "label": f"my {LONE} kernel"}),
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": "k-new", "holder_host": LONE}),
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": "k-new", f"extra{LONE}": 1}),
        ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": "k-new", "extra": [{"deep": LONE}]}),
        ("POST", f"api/gpupool/leases/{lease_id}/release", {"reason": LONE}),
        ("POST", f"api/gpupool/leases/{lease_id}/suspend", {"reason": LONE}),
        ("POST", f"api/gpupool/leases/{lease_id}/resize", {"memory": f"2GiB{LONE}"}),
        ("POST", f"api/gpupool/leases/{lease_id}/transition", {"outcome": "failed", "error": LONE}),
        ("POST", "api/gpupool/heartbeat", {"lease_ids": [lease_id, LONE]}),
        ("POST", "api/gpupool/activity", {"activities": {LONE: {"busy": True}}}),
        ("POST", "api/gpupool/reconcile", {"holder_host": LONE, "holder_pid": 1, "live_kernel_ids": []}),
        ("POST", "api/gpupool/reconcile", {"holder_host": "h", "holder_pid": 1, "live_kernel_ids": [LONE]}),
        ("POST", "api/gpupool/kernels/k-alice/reserve", {"memory": "1GiB", "note": LONE}),
        ("POST", "api/gpupool/reservations", {"name": LONE, "memory": "1GiB", "groups": ["g"], "duration": "1h"}),
        ("POST", "api/gpupool/reservations", {"name": "x", "memory": "1GiB", "groups": [LONE], "duration": "1h"}),
        ("PATCH", "api/gpupool/preferences", {"model": LONE}),
    ]


def test_a_lone_surrogate_in_any_body_is_a_400_that_changes_nothing(broker: BrokerHarness) -> None:
    alice = broker.remote("tok-alice")
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-alice"))
    before = broker.on_broker(lease_state, broker.pool)
    for method, path, body in surrogate_cases(lease.id):
        token = "tok-prof" if "reservations" in path else "tok-alice"
        status, payload = broker.http(method, path, token, body)
        assert status == 400, (method, path, body, status, payload)
        assert "surrogate" in payload["message"] and "\n" not in payload["message"], payload
    # The same bytes as raw UTF-8 (json.loads decodes them too), and in query strings and paths.
    prefix = "/services/gpupool/api/gpupool"
    raw = '{"memory": "1GiB", "kernel_id": "\ud800"}'.encode("utf-8", "surrogatepass")
    status, payload = raw_request(broker.port, "POST", f"{prefix}/leases", raw, "tok-alice")
    assert status == 400 and "surrogate" in payload["message"], payload
    for method, path in (
        ("GET", "leases?kernel_id=%ED%A0%80"),
        ("DELETE", f"leases/{lease.id}?reason=%ED%A0%80"),
        ("GET", "leases/%ED%A0%80"),
    ):
        status, payload = broker.http(method, path, "tok-alice")
        assert 400 <= status < 500, (method, path, status, payload)
    assert broker.on_broker(lease_state, broker.pool) == before
    assert alice.get(lease.id).state is LeaseState.GRANTED


def test_the_store_refuses_a_lone_surrogate_it_is_given_as_bad_input(tmp_path: Path) -> None:
    """Defence in depth under the adapters: a request that reaches the engine with one is a 400
    (InvalidInput), never a UnicodeEncodeError half-way through a transaction, and nothing is written."""
    from jupyter_gpupool.errors import InvalidInput

    pool = make_pool(tmp_path)
    with pytest.raises(InvalidInput, match="surrogate"):
        pool.request(LeaseRequest(owner="alice", memory=GIB, kernel_id=LONE))
    assert pool.leases(include_released=True) == []
    assert pool.request(LeaseRequest(owner="alice", memory=GIB, kernel_id="k")).state is LeaseState.GRANTED


def test_a_boolean_body_field_takes_only_true_or_false(broker: BrokerHarness) -> None:
    """Bodies are JSON, which has booleans: ``"yes"``, ``1`` or ``"false"`` is refused, naming the field
    (query strings keep their ``?all=1`` / ``?released=true`` forms)."""
    alice = broker.remote("tok-alice")
    lease = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-alice"))
    before = broker.on_broker(lease_state, broker.pool)
    for bad in ("yes", "true", "false", 1, 0, "1", [True], {"v": True}):
        for method, path, body, field in (
            ("POST", "api/gpupool/leases", {"memory": "1GiB", "kernel_id": "k-new", "suspendable": bad}, "suspendable"),
            ("POST", f"api/gpupool/leases/{lease.id}/transition",
             {"outcome": "failed", "error": "x", "still_running": bad}, "still_running"),
            ("POST", f"api/gpupool/leases/{lease.id}/activity", {"busy": bad}, "busy"),
            ("POST", "api/gpupool/activity", {"activities": {lease.id: {"busy": bad}}}, "busy"),
        ):
            status, payload = broker.http(method, path, "tok-alice", body)
            assert status == 400, (path, body, status, payload)
            assert f"invalid {field}" in payload["message"] and "true or false" in payload["message"], payload
    assert broker.on_broker(lease_state, broker.pool) == before
    status, payload = broker.http("GET", "api/gpupool/leases?released=1", "tok-alice")
    assert status == 200, payload
    status, payload = broker.http("POST", f"api/gpupool/leases/{lease.id}/activity", "tok-alice", {"busy": True})
    assert status == 204, payload


def test_preference_messages_name_the_accepted_form(broker: BrokerHarness) -> None:
    for body, expected in [
        ({"num_gpus": "two"}, "a whole number of GPUs from 1 to 8"),
        ({"priority": 5}, "batch, normal or high"),
        ({"model": ["A100"]}, 'a GPU model name such as "A100"'),
        ({"memory": "lots"}, "8GiB"),
    ]:
        status, payload = broker.http("PATCH", "api/gpupool/preferences", "tok-alice", body)
        assert status == 400 and expected in payload["message"], payload
    status, saved = broker.http("PATCH", "api/gpupool/preferences", "tok-alice", {"memory": "2 GiB", "num_gpus": 1})
    assert status == 200 and saved == {"memory": "2 GiB", "num_gpus": 1}


def test_broker_refuses_nested_and_oversized_bodies(broker: BrokerHarness) -> None:
    before = broker.on_broker(lease_state, broker.pool)
    prefix = "/services/gpupool/api/gpupool"
    status, payload = raw_request(broker.port, "POST", f"{prefix}/leases", NESTED.encode(), "tok-alice")
    assert status == 400 and "nested" in payload["message"], payload
    deep = json.dumps({"memory": "1GiB", "label": "x"}).replace('"x"', "[" * 20 + "]" * 20)
    status, payload = raw_request(broker.port, "POST", f"{prefix}/leases", deep.encode(), "tok-alice")
    assert status == 400 and "nested" in payload["message"], payload
    big = json.dumps({"memory": "1GiB", "label": "x" * 400_000}).encode()
    status, payload = raw_request(broker.port, "POST", f"{prefix}/leases", big, "tok-alice")
    assert status == 413 and "at most" in payload["message"], payload
    for constant in (b'{"memory": NaN}', b'{"memory": Infinity}', b'{"duration": -Infinity}'):
        status, payload = raw_request(broker.port, "POST", f"{prefix}/leases", constant, "tok-alice")
        assert status == 400 and "finite number" in payload["message"], payload
    assert broker.on_broker(lease_state, broker.pool) == before


def test_a_pid_in_range_still_works(broker: BrokerHarness) -> None:
    """The bound is the OS's range, not tighter: real pids, numbers in strings and floats like 7.0 pass."""
    for pid in (1, 4194304, "1234", 7.0):
        status, body = broker.http("POST", "api/gpupool/leases", "tok-alice", {"memory": "1GiB", "holder_pid": pid})
        assert status == 201 and body["holder_pid"] == int(pid), body


# --- the server extension -----------------------------------------------------------------------------


pytestmark_server = pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")


@pytestmark_server
def test_server_refuses_every_hostile_value_with_400_and_changes_nothing(
    arun: Any, gpupool_ext: Any, gpupool_fetch: Any
) -> None:
    pool = gpupool_ext.pool
    pool.request(LeaseRequest(owner="alice", memory=4 * GIB, kernel_id="k-alice"))
    before = lease_state(pool)

    async def scenario() -> None:
        for bad in [*BAD_NUMBERS, "-5GiB", "-1h", None]:
            for route, field in (("reserve", "memory"), ("reserve", "duration"), ("keepalive", "duration")):
                body = {field: bad}
                if (bad is None and route == "keepalive") or (bad == 2**31 and field == "memory"):
                    continue  # no duration: the default hold; 2**31 bytes: a fine 2 GiB
                response = await gpupool_fetch("api", "gpupool", "kernels", "k-alice", route, method="POST", body=body)
                assert response.code == 400, (route, body, response.body)
                message = json.loads(response.body)["message"]
                assert "\n" not in message and "expected" in message or "give" in message, message
        for raw in (
            NESTED,
            json.dumps({"memory": "1GiB", "x": "y"}).replace('"y"', "[" * 20 + "]" * 20),
            '{"memory": NaN}',
        ):
            response = await gpupool_fetch("api", "gpupool", "kernels", "k-alice", "reserve", method="POST", body=raw)
            assert response.code == 400, response.body
        response = await gpupool_fetch(
            "api", "gpupool", "kernels", "k-alice", "reserve", method="POST", body=json.dumps({"label": "x" * 400_000})
        )
        assert response.code == 413, response.body
        response = await gpupool_fetch("api", "gpupool", "kernels", "k" * 300)
        assert response.code == 400 and "at most 255" in json.loads(response.body)["message"]
        for body in ({"memory": "1GiB", "note": LONE}, {"duration": f"1h{LONE}"}, {LONE: 1}):
            for route in ("reserve", "keepalive"):
                response = await gpupool_fetch(
                    "api", "gpupool", "kernels", "k-alice", route, method="POST", body=json.dumps(body)
                )
                assert response.code == 400, (route, body, response.body)
                assert "surrogate" in json.loads(response.body)["message"], response.body

    arun(scenario())
    assert lease_state(pool) == before
    assert pool.lease_for_kernel("k-alice").state is LeaseState.GRANTED


@pytestmark_server
def test_a_bad_saved_preference_never_stops_a_kernel_start(
    arun: Any, gpupool_ext: Any, gpupool_fetch: Any, gpupool_wait: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Preferences written by an older version (or straight into the store) that are not in the
    accepted form are skipped with a warning; the good ones still apply."""
    pool = gpupool_ext.pool
    with pool.store.transaction():
        pool.store.set_preference("alice", {"num_gpus": "two", "priority": 5, "model": ["A100"], "memory": "2GiB"})

    async def scenario() -> None:
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        assert response.code == 201, response.body
        kernel_id = json.loads(response.body)["id"]

        async def granted() -> Any:
            reply = await gpupool_fetch("api", "gpupool", "kernels", kernel_id)
            body = json.loads(reply.body)
            return body if body["state"] == "granted" else None

        status = await gpupool_wait(granted, timeout=60, what="the kernel's slice")
        assert status["memory"] == 2 * GIB and status["num_gpus"] == 1 and status["priority"] == "normal"
        await gpupool_fetch("api", "kernels", kernel_id, method="DELETE")

    arun(scenario())
    warnings = [r.getMessage() for r in caplog.records if "ignoring alice's saved preference" in r.getMessage()]
    assert {w.split("preference ")[1].split(":")[0] for w in warnings} == {"num_gpus", "priority", "model"}, warnings
