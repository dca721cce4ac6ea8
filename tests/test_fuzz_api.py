"""schemathesis over both REST APIs: the server extension's (``openapi.yaml``, a real jupyter_server)
and the broker's (``openapi-broker.yaml``, the real broker app behind a stand-in hub).

Each operation gets schema-valid and schema-violating requests (positive and negative generation),
sent with a valid token, against a pool holding real leases, so bodies reach the pool and not only
the 404 of an unknown id. For every request: never a 5xx, never a traceback in the reply, a JSON
``message`` on every error, and nothing changed in the pool when the request was rejected.

CI runs at most :data:`EXAMPLES` examples per operation and mode (a few hundred requests, well
under a minute); ``GPUPOOL_FUZZ_EXAMPLES=500`` runs a longer search locally. The totals are
printed at the end of the session (``requests fuzzed``, ``5xx``) and written to
``$GPUPOOL_FUZZ_REPORT`` when that is set.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from jupyter_gpupool.core.models import LeaseRequest
from jupyter_gpupool.units import GIB

try:
    from broker_harness import BrokerHarness
except ImportError:  # tests as a package
    from tests.broker_harness import BrokerHarness

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_EXAMPLES", "8"))
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
#: Requests sent and their outcome, per target: reported at the end of the session.
TOTALS: dict[str, dict[str, int]] = {}


def load_schema(name: str) -> Any:
    spec = yaml.safe_load((REPO / name).read_text())
    return schemathesis.openapi.from_dict(spec)


def operations(name: str) -> list[Any]:
    return [result.ok() for result in load_schema(name).get_all_operations()]


def _record(target: str, status: int) -> None:
    totals = TOTALS.setdefault(target, {"requests": 0, "5xx": 0, "2xx": 0, "4xx": 0})
    totals["requests"] += 1
    bucket = "5xx" if status >= 500 else "4xx" if status >= 400 else "2xx"
    totals[bucket] += 1


def served_by_us(path: str) -> bool:
    """Whether one of the server extension's routes answers ``path`` (a generated kernel id with a
    ``/`` or a percent-escaped byte falls through to jupyter_server's own HTML 404 page; tornado
    matches routes against the path as sent, escapes and all)."""
    from jupyter_gpupool.serverextension.handlers import default_handlers

    return any(re.fullmatch(pattern, path) for pattern, _ in default_handlers)


def check_response(target: str, case: Any, response: Any, before: Any, after: Callable[[], Any]) -> None:
    """The properties every fuzzed request must keep. (A request that breaks the spec is not always
    refused: unknown query arguments and body fields are ignored, as most APIs do; the hostile values
    of each known field are refused, see test_fuzz_bounds.py.)"""
    status = response.status_code
    _record(target, status)
    label = f"{case.method} {case.formatted_path} {case.query or ''} body={str(case.body)[:200]!r}"
    text = response.text
    assert status < 500, f"{label}: {status} {text[:500]}"
    assert "Traceback" not in text and 'File "' not in text, f"{label}: a traceback in the reply: {text[:500]}"
    if status == 404 and target == "server" and not served_by_us(case.formatted_path):
        return  # not our route: jupyter_server's page for unknown URLs
    if status >= 400:
        try:
            payload = json.loads(text)
        except ValueError:
            raise AssertionError(f"{label}: {status} without a JSON body: {text[:200]!r}") from None
        assert isinstance(payload, dict) and payload.get("message"), f"{label}: {status} without a message: {payload}"
        assert "\n" not in payload["message"], f"{label}: a message of several lines: {payload['message']!r}"
        assert after() == before, f"{label}: rejected with {status}, yet the pool changed"


#: A lone UTF-16 surrogate: valid in a JSON string (``"\\ud800"``), not text in UTF-8 (SQLite, logs).
#: schemathesis never generates one (hypothesis leaves category Cs out of its text), so it is
#: added to generated bodies here.
LONE_SURROGATE = "\ud800"


def with_lone_surrogate(body: Any, where: int) -> Any:
    """The case's JSON body with a lone surrogate in its ``where``-th string (in a key when it has no
    string value); None when ``where`` is negative or the body is not an object."""
    if not isinstance(body, dict) or where < 0:
        return None
    strings = [key for key, value in body.items() if isinstance(value, str)]
    if strings:
        key = strings[where % len(strings)]
        return {**body, key: body[key] + LONE_SURROGATE}
    return {**body, f"k{LONE_SURROGATE}": "x"}


def send(case: Any, session: Any, base_url: str, token: str, body: Any = None) -> Any:
    """The case as schemathesis sends it, or with ``body`` instead of its own (schemathesis checks a
    body it is given against the schema, which cannot hold a lone surrogate: sent here as JSON text)."""
    headers = {"Authorization": f"token {token}"}
    if body is None:
        return case.call(base_url=base_url, session=session, headers=headers, timeout=40)
    kwargs = case.as_transport_kwargs(base_url=base_url, headers=headers)
    kwargs.pop("json", None)
    kwargs["data"] = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as "\\ud800"
    kwargs["headers"] = {**(kwargs.get("headers") or {}), "Content-Type": "application/json"}
    return session.request(**kwargs, timeout=40)


def fuzz_operation(
    target: str,
    operation: Any,
    call: Callable[[Any, Any], Any],
    snapshot: Callable[[], Any],
    path_parameters: dict[str, Any] | None,
) -> None:
    """Send ``EXAMPLES`` generated requests per mode to one operation."""
    for mode in MODES:
        strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_parameters)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: the first failure is reported as is
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy, surrogate_at=st.integers(-2, 3))
        def run(case: Any, surrogate_at: int) -> None:
            poisoned = with_lone_surrogate(case.body, surrogate_at)  # about half the object bodies
            before = snapshot()
            response = call(case, poisoned)
            check_response(target, case, response, before, snapshot)

        run()


def lease_state(pool: Any) -> Any:
    """What a request could change: every lease's decisive fields, preferences, reservations."""
    leases = sorted(
        (
            lease.id,
            lease.state.value,
            lease.memory,
            lease.num_gpus,
            lease.priority.value,
            lease.keep_until,
            lease.devices,
            lease.guarantee,
            lease.burst_limit,
        )
        for lease in pool.leases(include_released=True)
    )
    prefs = [pool.preference(name) for name in ("alice", "bob", "prof")]
    reservations = sorted(r.name for r in pool.reservations())
    return leases, prefs, reservations


# --- the broker ---------------------------------------------------------------------------------------

BROKER_OPERATIONS = operations("openapi-broker.yaml")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A broker with alice's leases (one per kernel id the fuzzer may name) and bob's."""
    # No scheduler loop in the background: a fuzzed lease booked "for 0.3 s" would expire during a
    # later, rejected request and look like a change it made (POST /tick still runs it on demand).
    harness = BrokerHarness(
        tmp_path_factory.mktemp("fuzz-broker"), simulate="2x80GiB", broker={"tick_interval": 3600.0, "wait_poll": 0.05}
    ).start()
    harness.add_user("tok-alice", "alice", groups=("cs101",))
    harness.add_user("tok-bob", "bob")
    alice = harness.remote("tok-alice")
    mine = alice.request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-alice"))
    harness.remote("tok-bob").request(LeaseRequest(owner="", memory=4 * GIB, kernel_id="k-bob"))
    try:
        yield {"harness": harness, "lease_id": mine.id}
    finally:
        harness.stop()


@pytest.mark.parametrize("operation", BROKER_OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_broker_operation_never_fails_on_any_input(broker: dict[str, Any], operation: Any) -> None:
    harness: BrokerHarness = broker["harness"]
    import requests

    session = requests.Session()
    base_url = harness.url

    def call(case: Any, body: Any) -> Any:
        return send(case, session, base_url, "tok-alice", body)

    def snapshot() -> Any:
        return harness.on_broker(lease_state, harness.pool)

    params: dict[str, Any] = {}
    if "{lease_id}" in operation.path:
        params["lease_id"] = broker["lease_id"]
    if "{kernel_id}" in operation.path:
        params["kernel_id"] = "k-alice"
    # Once with ids that exist (bodies reach the pool), once with generated ids (lookups, 404s).
    fuzz_operation("broker", operation, call, snapshot, params or None)
    if params:
        fuzz_operation("broker", operation, call, snapshot, None)


# --- the server extension ------------------------------------------------------------------------------

SERVER_OPERATIONS = operations("openapi.yaml")


@pytest.mark.parametrize("operation", SERVER_OPERATIONS, ids=lambda op: f"{op.method.upper()} {op.path}")
def test_server_operation_never_fails_on_any_input(
    arun: Any,
    jp_serverapp: Any,
    http_server_client: Any,  # makes the test server listen on jp_http_port
    jp_http_port: int,
    jp_base_url: str,
    gpupool_ext: Any,
    operation: Any,
) -> None:
    import requests

    pool = gpupool_ext.pool
    pool.request(LeaseRequest(owner="alice", memory=4 * GIB, kernel_id="k-alice"))
    pool.request(LeaseRequest(owner="bob", memory=4 * GIB, kernel_id="k-bob"))
    session = requests.Session()
    base_url = f"http://127.0.0.1:{jp_http_port}{jp_base_url.rstrip('/')}"

    def call(case: Any, body: Any) -> Any:
        return send(case, session, base_url, "alice-token", body)

    def snapshot() -> Any:
        return lease_state(pool)

    def fuzz() -> None:
        params = {"kernel_id": "k-alice"} if "{kernel_id}" in operation.path else None
        fuzz_operation("server", operation, call, snapshot, params)
        if params:
            fuzz_operation("server", operation, call, snapshot, None)

    # The server runs on this thread's event loop: fuzz from a worker thread while it serves.
    arun(asyncio.to_thread(fuzz))


def test_report_fuzz_totals() -> None:
    """Runs last in this file: the totals for RELIABILITY.md (and ``$GPUPOOL_FUZZ_REPORT``)."""
    if not TOTALS:
        pytest.skip("no fuzz test ran in this session")
    for target, totals in sorted(TOTALS.items()):
        print(
            f"\nschemathesis {target}: {totals['requests']} requests fuzzed, {totals['5xx']} x 5xx "
            f"({totals['2xx']} 2xx, {totals['4xx']} 4xx), {EXAMPLES} examples per operation and mode"
        )
        assert totals["5xx"] == 0
    report = os.environ.get("GPUPOOL_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"examples": EXAMPLES, "targets": TOTALS}, indent=2))
