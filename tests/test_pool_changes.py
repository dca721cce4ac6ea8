"""PoolChanges: hearing that the pool file changed, from this process and from others, at once.

Real SQLite files (WAL) and a real second process; no busy loop: the watcher stops when nobody
listens, and a commit made while it slept still counts when it starts again.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

from pool_helpers import make_pool, req

from jupyter_gpupool.backends.changes import PoolChanges
from jupyter_gpupool.backends.local.pool import Pool


def _file(tmp_path: Path) -> tuple[str, sqlite3.Connection]:
    path = str(tmp_path / "changes.sqlite")
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (a)")
    return path, conn


def test_a_commit_by_another_process_wakes_a_waiter_within_a_fraction_of_a_second(tmp_path: Path) -> None:
    path, _ = _file(tmp_path)
    changes = PoolChanges(path)
    try:
        version = changes.wait(None, 0)
        started = time.monotonic()
        assert changes.wait(version, 0.3) == version  # nothing changed: it waited the timeout
        assert time.monotonic() - started >= 0.25
        code = f"import sqlite3, time; time.sleep(0.5); sqlite3.connect({path!r}, isolation_level=None).execute('INSERT INTO t VALUES (1)')"
        other = subprocess.Popen([sys.executable, "-c", code])
        started = time.monotonic()
        assert changes.wait(version, 20) != version
        woke_after = time.monotonic() - started
        other.wait(30)
        assert woke_after < 3, woke_after  # the commit came after 0.5 s (+ the interpreter's start)
    finally:
        changes.close()


def test_the_watcher_sleeps_when_nobody_listens_and_a_commit_made_meanwhile_still_counts(tmp_path: Path) -> None:
    path, conn = _file(tmp_path)
    changes = PoolChanges(path)
    changes.linger = 0.2
    try:
        version = changes.wait(None, 0)
        deadline = time.monotonic() + 5
        while changes._thread is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert changes._thread is None, "the watcher kept polling with nobody listening"
        conn.execute("INSERT INTO t VALUES (2)")  # while it sleeps
        started = time.monotonic()
        assert changes.wait(version, 5) != version
        assert time.monotonic() - started < 0.5
    finally:
        changes.close()


def test_a_pools_own_decision_wakes_its_listeners_at_once(tmp_path: Path) -> None:
    pool: Pool = make_pool(tmp_path)
    heard = threading.Event()
    unsubscribe = pool.subscribe_changes(heard.set)
    try:
        heard.clear()
        pool.request(req("alice", gib=1))
        assert heard.wait(0.01) or heard.wait(1), "the listener was not called"
        version = pool.wait_for_change(None, 0)
        pool.request(req("bob", gib=1))
        assert pool.wait_for_change(version, 0) != version  # told in the same thread, before it returned
    finally:
        unsubscribe()
        pool.close()

