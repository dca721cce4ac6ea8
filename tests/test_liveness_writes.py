"""Activity reports and heartbeats rewrite only a lease's liveness fields (``LIVENESS_FIELDS``):
the store puts their new text between the unchanged text before and after them. These tests
check that what lands in the file is always exactly the lease's full encoding, across full
changes, other processes' changes and rows gone from under the cache."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core import models
from jupyter_gpupool.core.models import LIVENESS_FIELDS, Activity, Lease, LeaseState, split_json_text
from jupyter_gpupool.units import GIB

# Text a user controls (labels, names) that looks like the markers the split looks for.
TRICKY = st.sampled_from(['", "heartbeat_at": 1, "keep_until": "', ', "heartbeat_at": ', "é\\\"", "", "nb.ipynb"])
NUMBERS = st.one_of(
    st.none(),
    st.integers(min_value=-(10**20), max_value=10**20),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=300, deadline=None)
@given(
    label=st.one_of(TRICKY, st.text(max_size=40)),
    owner=st.one_of(TRICKY, st.text(min_size=1, max_size=10)),
    heartbeat=NUMBERS,
    last=NUMBERS,
    active=st.one_of(st.floats(allow_nan=False), st.integers(min_value=0, max_value=10**9)),
    busy=st.booleans(),
    connections=st.integers(min_value=0, max_value=10**6),
)
def test_text_around_the_liveness_fields_plus_their_new_text_is_the_full_encoding(label, owner, heartbeat, last, active, busy, connections):
    lease = Lease(id="l-1", owner=owner, memory=GIB, state=LeaseState.GRANTED, created_at=T0, label=label, groups=(label,))
    before, after = split_json_text(lease.to_json_text())
    lease.heartbeat_at, lease.last_activity, lease.active_seconds = heartbeat, last, active
    lease.busy, lease.connections = busy, connections
    spliced = before + lease.liveness_json_text() + after
    assert spliced == lease.to_json_text()
    read = json.loads(spliced)
    assert read["label"] == label and read["owner"] == owner
    for name in LIVENESS_FIELDS:
        value = getattr(lease, name)
        assert read[name] == value or (isinstance(value, float) and math.isnan(value) and math.isnan(read[name]))


def stored_text(pool: Pool, lease_id: str) -> str:
    return pool.store.conn.execute("SELECT data FROM leases WHERE id = ?", (lease_id,)).fetchone()[0]


def assert_file_is_exactly_the_cache(pool: Pool) -> None:
    """Every live lease's stored text is the full encoding of the lease the pool decides on."""
    with pool.store.transaction():
        cached = dict(pool.store.live_leases())
    assert cached
    for lease_id, lease in cached.items():
        assert stored_text(pool, lease_id) == lease.to_json_text()


@pytest.fixture
def counted_encodings(monkeypatch):
    """How often a lease is encoded whole (the work a beat saves)."""
    calls: list[str] = []
    encode = models.Lease.to_json_text

    def counting(self: Lease) -> str:
        calls.append(self.id)
        return encode(self)

    monkeypatch.setattr(models.Lease, "to_json_text", counting)
    return calls


def test_reports_and_heartbeats_rewrite_only_the_liveness_text(tmp_path, counted_encodings):
    pool = make_pool(tmp_path, heartbeat_ttl=120, idle_policy="never")
    running = pool.request(req("ann", gib=8, holder_pid=os.getpid()), now=T0)
    waiting = pool.request(req("ben", gib=12, holder_pid=os.getpid()), now=T0)
    assert (running.state, waiting.state) == (LeaseState.GRANTED, LeaseState.QUEUED)
    assert_file_is_exactly_the_cache(pool)
    now = T0
    for step in range(1, 13):
        now = T0 + 31 * step  # every report finds the heartbeat on file older than a quarter of the TTL
        counted_encodings.clear()
        pool.tick(now=now, activities={running.id: Activity(busy=step % 3 == 0, connections=step % 2), waiting.id: Activity(busy=False)})
        pool.heartbeat([waiting.id], now=now + 0.5)  # fresh again: writes nothing
        assert counted_encodings == []  # two leases written, neither encoded whole
        assert_file_is_exactly_the_cache(pool)
    assert pool.get(running.id).heartbeat_at == now
    assert pool.get(running.id).connections == 0 and pool.get(running.id).busy is True
    assert pool.get(running.id).active_seconds > 0


def test_a_beat_after_a_full_change_carries_that_change(tmp_path):
    """A resize, a keep or a grant rewrite the lease whole; the next report's text is cut from
    that new text, never from an older one."""
    pool = make_pool(tmp_path, spec="1x24GiB", heartbeat_ttl=120, idle_policy="never")
    lease = pool.request(req("ann", gib=8, holder_pid=os.getpid()), now=T0)
    other = pool.request(req("ben", gib=20, holder_pid=os.getpid()), now=T0)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 40)
    pool.resize(lease.id, 4 * GIB, now=T0 + 41)
    pool.report_activity(lease.id, Activity(busy=False, last_activity=T0 + 80), now=T0 + 80)
    pool.keep(lease.id, 3600, now=T0 + 81)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 120)
    pool.release(lease.id, now=T0 + 121)  # ben's 20 GiB now fits: granted, a full change
    pool.report_activity(other.id, Activity(busy=True), now=T0 + 160)
    assert_file_is_exactly_the_cache(pool)
    got = json.loads(stored_text(pool, other.id))
    assert (got["state"], got["busy"], got["heartbeat_at"]) == ("granted", True, T0 + 160)
    released = json.loads(stored_text(pool, lease.id))
    assert (released["state"], released["memory"], released["keep_until"]) == ("released", 4 * GIB, T0 + 81 + 3600)


def test_another_process_change_is_kept_by_the_next_beat(tmp_path):
    """Process B resizes a lease that process A reports on: A's next report must not write its
    older text back (A re-reads the leases when the file changed, and cuts from the new text)."""
    a = make_pool(tmp_path, spec="1x24GiB", heartbeat_ttl=120, idle_policy="never")
    b = make_pool(tmp_path, spec="1x24GiB", heartbeat_ttl=120, idle_policy="never")
    lease = a.request(req("ann", gib=8, holder_pid=os.getpid()), now=T0)
    a.report_activity(lease.id, Activity(busy=True), now=T0 + 40)  # A now keeps its text
    b.resize(lease.id, 2 * GIB, now=T0 + 50)
    a.report_activity(lease.id, Activity(busy=False, last_activity=T0 + 90), now=T0 + 90)
    got = json.loads(stored_text(a, lease.id))
    assert (got["memory"], got["busy"], got["heartbeat_at"]) == (2 * GIB, False, T0 + 90)
    assert_file_is_exactly_the_cache(a)
    assert_file_is_exactly_the_cache(b)


def test_a_beat_whose_row_is_gone_is_written_whole(tmp_path):
    """A beat is a plain UPDATE; should its row be missing all the same (deleted by hand under a
    running pool), the lease is written whole again instead of silently lost."""
    pool = make_pool(tmp_path, heartbeat_ttl=120, idle_policy="never")
    lease = pool.request(req("ann", gib=8, holder_pid=os.getpid()), now=T0)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 40)
    pool.store.conn.execute("DELETE FROM leases WHERE id = ?", (lease.id,))  # same connection: the cache does not notice
    pool.report_activity(lease.id, Activity(busy=False, last_activity=T0 + 80), now=T0 + 80)
    got = json.loads(stored_text(pool, lease.id))
    assert (got["state"], got["busy"], got["heartbeat_at"]) == ("granted", False, T0 + 80)
    assert_file_is_exactly_the_cache(pool)


def test_a_failed_commit_forgets_the_kept_text(tmp_path):
    """A transaction that fails rolls back, and with it the text kept for the next beat."""
    pool = make_pool(tmp_path, spec="1x24GiB", heartbeat_ttl=120, idle_policy="never")
    lease = pool.request(req("ann", gib=8, holder_pid=os.getpid()), now=T0)
    pool.report_activity(lease.id, Activity(busy=True), now=T0 + 40)
    with pytest.raises(RuntimeError), pool._decide(T0 + 41) as state:
        pool.engine.resize(state, lease.id, 4 * GIB, T0 + 41)
        pool._save(state)
        raise RuntimeError("the process failed before COMMIT")
    pool.report_activity(lease.id, Activity(busy=False, last_activity=T0 + 80), now=T0 + 80)
    got = json.loads(stored_text(pool, lease.id))
    assert (got["memory"], got["busy"]) == (8 * GIB, False)
    assert_file_is_exactly_the_cache(pool)
