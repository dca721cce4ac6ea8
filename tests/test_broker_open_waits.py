"""Over the broker, one user cannot hold an unbounded number of long polls open: past
``Broker.max_waits_per_user`` a grant wait or a change poll is answered 429 at once, naming the
bound, while other users' polls are served; a client rides the 429 out like an outage."""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import BrokerHarness

from jupyter_gpupool.errors import PoolUnavailable, TooManyWaits

ALICE, BOB = "tok-alice", "tok-bob"
LIMIT = 3


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[BrokerHarness]:
    h = BrokerHarness(
        tmp_path, policy={"default_memory": "16GiB"}, broker={"tick_interval": 0.2, "wait_poll": 0.05, "max_waits_per_user": LIMIT}
    ).start()
    h.add_user(ALICE, "alice")
    h.add_user(BOB, "bob")
    try:
        yield h
    finally:
        h.stop()


def open_poll(h: BrokerHarness, token: str, path: str) -> http.client.HTTPConnection:
    """A long poll sent and left waiting (its answer is read, or it is hung up, by the caller)."""
    conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=30)
    conn.request("GET", "/services/gpupool/" + path, headers={"Authorization": f"token {token}"})
    return conn


def until_open(h: BrokerHarness, caller: str, count: int) -> None:
    assert h.broker is not None
    deadline = time.monotonic() + 20
    while h.broker.open_waits.count(caller) != count:
        assert time.monotonic() < deadline, f"{caller} holds {h.broker.open_waits.count(caller)} open polls, not {count}"
        time.sleep(0.02)


def test_a_user_past_the_bound_gets_429_at_once_and_others_are_served(harness: BrokerHarness) -> None:
    assert harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "16GiB"})[1]["state"] == "granted"
    status, queued = harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "16GiB"})
    assert status == 201 and queued["state"] == "queued"
    since = harness.http("GET", "api/gpupool/changes", ALICE)[1]["version"]
    polls = [open_poll(harness, ALICE, f"api/gpupool/changes?since={since}&timeout=25") for _ in range(LIMIT - 1)]
    polls.append(open_poll(harness, ALICE, f"api/gpupool/leases/{queued['id']}/wait?timeout=25&position=1"))
    try:
        until_open(harness, "alice", LIMIT)
        started = time.monotonic()
        for path in (f"api/gpupool/changes?since={since}&timeout=25", f"api/gpupool/leases/{queued['id']}/wait?timeout=25&position=1"):
            status, body = harness.http("GET", path, ALICE)
            assert status == 429 and body["error"] == "TooManyWaits", body
            assert f"user alice already holds {LIMIT} open waits" in body["message"] and "max_waits_per_user" in body["message"]
        assert time.monotonic() - started < 5  # answered at once, not after the poll's timeout
        status, body = harness.http("GET", "api/gpupool/changes?timeout=0", BOB)
        assert status == 200  # bob's server is served as before
        with pytest.raises(TooManyWaits, match="already holds 3 open waits") as refused:
            harness.remote(ALICE).wait_for_change(since, 5)
        assert isinstance(refused.value, PoolUnavailable)  # so a server backs off and looks again
    finally:
        for conn in polls:
            conn.close()  # alice's server hangs up: her polls end at once
    until_open(harness, "alice", 0)
    status, body = harness.http("GET", f"api/gpupool/changes?since={since}&timeout=0.1", ALICE)
    assert status == 200 and "version" in body  # and once they ended, she may poll again
