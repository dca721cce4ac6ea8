"""Status views never wait for the pool's write lock.

A process that holds the write lock for long (a ``jupyter gpupool`` command stopped with Ctrl-Z
in the middle of a decision, a kernel frozen by a checkpoint) makes every decision wait: that is
how nothing is ever granted twice. But views only read, and in WAL mode a read never has to
wait: the sidebar, ``%gpupool status`` and a queued kernel's place keep answering, from the last
committed state, through a second connection. Here the lock is held by a real other process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.errors import PoolUnavailable

HOLD_LOCK = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("held", flush=True)
time.sleep(120)
"""


#: Longest a view may take here. A view that waited for the write lock would take its connection's
#: busy timeout (30 s) or the holder's whole hold; one that reads past it answers in milliseconds,
#: seconds on a host loaded ten times over.
VIEW_BOUND = 5.0


class WriteLockHolder:
    """Another process holding the pool file's write lock until :meth:`stop`."""

    def __init__(self, path: Path) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path)], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and self.process.stdout.readline().strip() == "held"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


@pytest.fixture
def pool_with_a_queue(tmp_path):
    pool = make_pool(tmp_path, spec="1x16GiB", idle_policy="never")
    running = pool.request(req("alice", gib=12), now=T0)
    waiting = pool.request(req("bob", gib=8), now=T0 + 1)
    assert (running.state, waiting.state) == (LeaseState.GRANTED, LeaseState.QUEUED)
    yield pool, running, waiting
    pool.close()


def timed(call, *args, **kwargs):
    started = time.monotonic()
    result = call(*args, **kwargs)
    return result, time.monotonic() - started


def test_views_answer_while_another_process_holds_the_write_lock(tmp_path, pool_with_a_queue):
    pool, running, waiting = pool_with_a_queue
    pool.store.conn.execute("PRAGMA busy_timeout=1000")  # decisions give up after 1 s here, not 30
    holder = WriteLockHolder(tmp_path / "pool.sqlite")
    try:
        snapshot, took = timed(pool.snapshot, viewer="bob", now=T0 + 2)
        assert took < VIEW_BOUND, f"the status view waited {took:.1f} s for the write lock"
        mine = [lease for lease in snapshot.leases if lease["mine"]]
        assert [(lease["state"], lease["queue_position"]) for lease in mine] == [("queued", 1)]
        assert [lease["owner"] for lease in snapshot.leases if not lease["mine"]] == [None]  # alice's stays anonymous
        assert snapshot.devices[0]["memory_leased"] == 12 * 1024**3
        info, took = timed(pool.queue_info, waiting.id, now=T0 + 2)
        assert took < VIEW_BOUND and (info.position, info.length) == (1, 1)
        assert [lease.id for lease in pool.queue(now=T0 + 2)] == [waiting.id]
        # Decisions still wait for the lock, and say so: nothing is decided beside the holder.
        with pytest.raises(PoolUnavailable, match="try again"):
            pool.release(running.id, now=T0 + 3)
    finally:
        holder.stop()
    pool.release(running.id, now=T0 + 4)
    assert pool.queue_info(waiting.id, now=T0 + 4) is None  # granted by that release
    assert pool.snapshot(viewer="bob", now=T0 + 4).leases[0]["state"] == "granted"


def test_views_answer_while_a_thread_of_this_process_waits_for_the_write_lock(tmp_path, pool_with_a_queue):
    """The server's periodic round, stuck behind another process's write lock, holds this
    process's connection meanwhile: views read through their own and still answer."""
    pool, _, _ = pool_with_a_queue
    holder = WriteLockHolder(tmp_path / "pool.sqlite")
    ticked = threading.Event()
    round_ = threading.Thread(target=lambda: (pool.tick(now=T0 + 5), ticked.set()), daemon=True)
    try:
        round_.start()
        time.sleep(0.3)
        assert not ticked.is_set()  # the round waits for the lock
        snapshot, took = timed(pool.snapshot, viewer="alice", now=T0 + 5)
        assert took < VIEW_BOUND, f"the status view waited {took:.1f} s behind this process's own decision"
        assert [lease["state"] for lease in snapshot.leases if lease["mine"]] == ["granted"]
    finally:
        holder.stop()
    assert ticked.wait(10), "the round goes on once the lock is free"


def test_a_view_sees_each_decision_at_once(tmp_path, pool_with_a_queue):
    """The views' connection reads the last commit, of this process's decisions as of others'."""
    pool, running, waiting = pool_with_a_queue
    assert pool.queue_info(waiting.id, now=T0 + 2).position == 1
    other = make_pool(tmp_path, spec="1x16GiB", idle_policy="never")
    late = other.request(req("carol", gib=8), now=T0 + 3)
    assert [lease.id for lease in pool.queue(now=T0 + 4)] == [waiting.id, late.id]
    pool.release(running.id, now=T0 + 5)
    assert [lease.id for lease in pool.queue(now=T0 + 5)] == []
    held = {lease["owner"]: lease["state"] for lease in pool.snapshot(admin=True, now=T0 + 5).leases}
    assert held == {"bob": "granted", "carol": "granted"}
    other.close()


@pytest.mark.slow
def test_the_rest_views_answer_while_the_write_lock_is_held(arun, gpupool_fetch, gpupool_ext):
    """The sidebar's polls, ``GET /api/gpupool/pool`` and ``GET /api/gpupool/kernels/{id}`` (a
    granted kernel, and a queued one with its place), answer while another process holds the lock."""
    assert gpupool_ext.pool.request(req("alice", gib=12, kernel_id="k-1")).state is LeaseState.GRANTED
    assert gpupool_ext.pool.request(req("alice", gib=8, kernel_id="k-2")).state is LeaseState.QUEUED
    holder = WriteLockHolder(Path(gpupool_ext.pool.store.path))
    try:

        async def scenario():
            answers = {}
            for path in (("pool",), ("kernels", "k-1"), ("kernels", "k-2")):
                started = time.monotonic()
                response = await gpupool_fetch("api", "gpupool", *path)
                answers[path[-1]] = (response, time.monotonic() - started)
            return answers

        answers = arun(scenario())
    finally:
        holder.stop()
    for name, (response, took) in answers.items():
        assert response.code == 200, (name, response.body)
        assert took < 2 * VIEW_BOUND, f"GET {name} waited {took:.1f} s for the write lock"
    pool = json.loads(answers["pool"][0].body)
    assert sorted(lease["state"] for lease in pool["leases"] if lease["mine"]) == ["granted", "queued"]
    queued = json.loads(answers["k-2"][0].body)
    assert (queued["state"], queued["queue_position"], queued["queue_length"]) == ("queued", 1, 1)
    assert json.loads(answers["k-1"][0].body)["state"] == "granted"
