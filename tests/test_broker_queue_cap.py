"""Over the broker, one user cannot flood the shared queue (issue 10): past
``PoolPolicy.max_queued_per_user`` a request gets 409 with the limit named, others are unaffected,
and a booked reservation larger than the pool is refused the same way."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import BrokerHarness

ALICE, BOB, PROF = "tok-alice", "tok-bob", "tok-prof"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[BrokerHarness]:
    h = BrokerHarness(tmp_path, policy={"max_queued_per_user": 3, "default_memory": "16GiB"}).start()
    h.add_user(ALICE, "alice")
    h.add_user(BOB, "bob")
    h.add_user(PROF, "prof", admin=True)
    try:
        yield h
    finally:
        h.stop()


def test_a_user_past_the_queue_cap_gets_409_and_others_still_queue(harness: BrokerHarness) -> None:
    statuses = [harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "16GiB"})[0] for _ in range(4)]
    assert statuses == [201] * 4  # one granted, three queued
    status, body = harness.http("POST", "api/gpupool/leases", ALICE, {"memory": "16GiB"})
    assert status == 409 and "3 requests waiting in the queue" in body["message"] and "max_queued_per_user" in body["message"]
    status, body = harness.http("POST", "api/gpupool/leases", BOB, {"memory": "16GiB"})
    assert status == 201 and body["state"] == "queued"


def test_a_reservation_larger_than_the_pool_gets_409(harness: BrokerHarness) -> None:
    spec = {"name": "big", "users": ["alice"], "memory": "64GiB", "duration": "1h"}
    status, body = harness.http("POST", "api/gpupool/reservations", PROF, spec)
    assert status == 409 and "the whole pool has 16 GiB" in body["message"]
    status, body = harness.http("GET", "api/gpupool/reservations", PROF)
    assert status == 200 and body == []
