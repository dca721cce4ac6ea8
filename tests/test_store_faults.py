"""A pool file that is empty, truncated, corrupt, foreign, deleted or replaced is refused with a clear
error, never started afresh; a failed COMMIT leaves nothing behind; a bogus holder pid cannot stop
the scheduler. Real SQLite files, real processes, real write failures (``RLIMIT_FSIZE``)."""

from __future__ import annotations

import glob
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from pool_helpers import make_pool, req

from jupyter_gpupool.backends.local import store as store_module
from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.backends.local.store import Store
from jupyter_gpupool.core.engine import held_by_device
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput, PoolUnavailable
from jupyter_gpupool.units import GIB


def open_pool(db: str | Path) -> Pool:
    # No per-user queue cap: pool_with_leases queues thousands of one user's requests on purpose.
    return Pool(SimulatedBackend.from_spec("1x16GiB"), str(db), PoolPolicy(heartbeat_ttl=10**9, max_queued_per_user=0))


def pool_with_leases(db: Path, count: int = 1) -> list[str]:
    pool = open_pool(db)
    ids = [pool.request(req("alice", 1, label="x" * 300)).id for _ in range(count)]
    pool.close()  # the last connection checkpoints: everything is in the main file
    assert not os.path.exists(str(db) + "-wal")
    return ids


def granted_bytes(db: str | Path) -> int:
    """What a fresh reader of the file sees granted on the one 16 GiB device."""
    pool = open_pool(db)
    try:
        return sum(held_by_device(pool.store.leases(include_released=True)).values())
    finally:
        pool.close()


# --- files that are not (or no longer) a pool ------------------------------------------------------------------
def test_a_zero_byte_file_is_refused_and_left_alone(tmp_path):
    db = tmp_path / "pool.sqlite"
    pool_with_leases(db)
    db.write_bytes(b"")
    with pytest.raises(PoolUnavailable, match=r"empty \(0 bytes\).*restore the file from a backup, or move it away"):
        open_pool(db)
    assert db.stat().st_size == 0 and not os.path.exists(str(db) + "-wal")  # not made into a fresh, empty pool


def test_a_file_truncated_mid_way_is_refused_as_corrupt(tmp_path):
    db = tmp_path / "pool.sqlite"
    pool_with_leases(db, count=200)
    size = db.stat().st_size
    assert size > 16 * 4096
    os.truncate(db, size // 2)
    with pytest.raises(PoolUnavailable, match=r"(corrupt|malformed).*restore the file from a backup"):
        open_pool(db)
    assert db.stat().st_size == size // 2


@pytest.mark.parametrize("header", [b"", b"SQLite format 3\x00"], ids=["random", "sqlite-header-then-random"])
def test_random_bytes_are_refused(tmp_path, header):
    db = tmp_path / "pool.sqlite"
    content = header + os.urandom(16 * 4096 - len(header))
    db.write_bytes(content)
    with pytest.raises(PoolUnavailable, match=r"(not an SQLite database|corrupt).*move it away"):
        open_pool(db)
    assert db.read_bytes() == content


def test_another_applications_sqlite_file_is_refused_and_never_changed(tmp_path):
    db = tmp_path / "notes.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript("CREATE TABLE notes (id INTEGER PRIMARY KEY, text TEXT); INSERT INTO notes(text) VALUES ('keep me');")
    conn.close()
    before = db.read_bytes()
    with pytest.raises(PoolUnavailable, match=r"another application's SQLite database \(tables: notes\), not a GPU pool"):
        open_pool(db)
    assert db.read_bytes() == before  # no tables added, journal mode unchanged
    assert not os.path.exists(str(db) + "-wal")


def test_an_empty_sqlite_file_is_refused(tmp_path):
    db = tmp_path / "pool.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA page_size=4096")
    conn.execute("VACUUM")  # a valid SQLite file with no tables
    conn.close()
    assert db.stat().st_size > 0
    with pytest.raises(PoolUnavailable, match="empty SQLite file, not a GPU pool"):
        open_pool(db)


def test_a_pool_of_an_earlier_version_is_adopted_with_its_leases(tmp_path):
    """Files made before application ids keep working (and get ours)."""
    db = tmp_path / "pool.sqlite"
    ids = pool_with_leases(db, count=2)
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA application_id=0")
    conn.close()
    pool = open_pool(db)
    assert {lease.id for lease in pool.leases()} == set(ids)
    pool.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA application_id").fetchone()[0] == store_module.APPLICATION_ID
    conn.close()


def test_a_new_path_gets_a_new_pool_with_our_identity(tmp_path):
    db = tmp_path / "sub" / "pool.sqlite"
    pool = open_pool(db)
    assert pool.request(req("alice", 4)).state is LeaseState.GRANTED
    assert pool.store.conn.execute("PRAGMA application_id").fetchone()[0] == store_module.APPLICATION_ID
    pool.close()
    assert sorted(p.name for p in db.parent.iterdir()) == ["pool.sqlite"]  # no temporary left behind


# --- deleted or replaced while in use --------------------------------------------------------------------------
HOLDER = textwrap.dedent(
    """
    import json, sys
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.errors import GpuPoolError
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.units import GIB

    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), sys.argv[1], PoolPolicy(heartbeat_ttl=10**9))
    for line in sys.stdin:
        try:
            lease = pool.request(LeaseRequest(owner=line.strip(), memory=int(line.split()[1]) * GIB if len(line.split()) > 1 else 16 * GIB))
            print(json.dumps({"state": lease.state.value, "id": lease.id}), flush=True)
        except GpuPoolError as err:
            print(json.dumps({"error": type(err).__name__, "message": str(err)}), flush=True)
    """
)


def ask(proc: subprocess.Popen, line: str) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def test_a_deleted_pool_file_is_never_forked_into_a_second_pool(tmp_path):
    """The file (and its WAL) deleted under a running holder: the holder stops granting and saves
    what it had; nobody else may start a second pool on the path while the holder has it open."""
    db = tmp_path / "pool.sqlite"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = ask(holder, "alice 16")
        assert first["state"] == "granted"
        for path in glob.glob(str(db) + "*"):
            os.unlink(path)
        # Another process on the same path: refused, not a fresh pool granting the same 16 GiB.
        with pytest.raises(PoolUnavailable, match="missing but still open in another process"):
            open_pool(db)
        assert not db.exists()
        # The holder notices before its next decision and refuses; its last state is saved.
        again = ask(holder, "bob 16")
        assert again["error"] == "PoolUnavailable" and "deleted or moved while in use" in again["message"]
        assert ask(holder, "carol 1")["error"] == "PoolUnavailable"  # and stays stopped
        rescued = glob.glob(str(db) + ".rescued-*")
        assert len(rescued) == 1 and f"saved as {rescued[0]}" in again["message"]
        conn = sqlite3.connect(rescued[0])
        assert conn.execute("SELECT id, state FROM leases").fetchall() == [(first["id"], "granted")]
        conn.close()
        assert os.stat(rescued[0]).st_mode & 0o077 == 0  # other users cannot read it
    finally:
        holder.kill()
        holder.wait(30)
    # With the holder gone (even by SIGKILL) the admin's move back restores the pool, leases and all.
    os.replace(rescued[0], db)
    pool = open_pool(db)
    assert [lease.id for lease in pool.leases()] == [first["id"]]
    assert pool.request(req("bob", 1)).state is LeaseState.QUEUED  # the 16 GiB are still granted once
    pool.close()


def test_a_missing_file_with_its_wal_left_is_not_started_afresh(tmp_path):
    db = tmp_path / "pool.sqlite"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert ask(holder, "alice 16")["state"] == "granted"
        os.kill(holder.pid, signal.SIGKILL)  # dies with its WAL on disk
        holder.wait(30)
    finally:
        holder.kill()
    assert os.path.getsize(str(db) + "-wal") > 0
    os.unlink(db)  # the main file deleted, its journal left
    with pytest.raises(PoolUnavailable, match=r"missing but its journal .*-wal is not"):
        open_pool(db)
    assert not db.exists()


def test_a_pool_file_replaced_while_in_use_stops_granting(tmp_path):
    db = tmp_path / "pool.sqlite"
    pool = open_pool(db)
    assert pool.request(req("alice", 16)).state is LeaseState.GRANTED
    other = tmp_path / "other.sqlite"
    pool_with_leases(other, count=0)
    os.replace(other, db)  # e.g. an admin restoring an old backup over the live file
    with pytest.raises(PoolUnavailable, match="replaced by another file while in use"):
        pool.request(req("bob", 16))
    with pytest.raises(PoolUnavailable, match="replaced by another file"):
        pool.snapshot()
    pool.close()
    assert granted_bytes(db) == 0  # nothing was granted into the file that replaced it


def test_a_pool_file_truncated_to_zero_while_in_use_stops_granting(tmp_path):
    db = tmp_path / "pool.sqlite"
    pool = open_pool(db)
    assert pool.request(req("alice", 16)).state is LeaseState.GRANTED
    os.truncate(db, 0)
    with pytest.raises(PoolUnavailable, match="truncated to 0 bytes while in use"):
        pool.request(req("bob", 16))
    pool.close()


# --- a COMMIT that fails ----------------------------------------------------------------------------------
FAILING_COMMIT = textwrap.dedent(
    """
    import json, os, resource, signal, sys
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.units import GIB

    db = sys.argv[1]
    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), db, PoolPolicy(heartbeat_ttl=10**9))
    first = pool.request(LeaseRequest(owner="alice", memory=10 * GIB))
    pool.store.conn.execute("PRAGMA wal_autocheckpoint=0")  # the WAL only grows: the limit below stops the next write
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(db + "-wal"), resource.RLIM_INFINITY))
    try:
        pool.release(first.id)
        release = "committed"
    except Exception as err:
        release = type(err).__name__ + ": " + str(err)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    second = pool.request(LeaseRequest(owner="bob", memory=9 * GIB))
    print(json.dumps({"first": first.state.value, "release": release, "second": second.state.value}))
    """
)


def test_a_failed_commit_leaves_nothing_in_the_lease_cache(tmp_path):
    """The release's COMMIT fails on a real write error: the next decision must not grant from
    the uncommitted release (10 GiB + 9 GiB on a 16 GiB GPU)."""
    db = str(tmp_path / "pool.sqlite")
    result = subprocess.run([sys.executable, "-c", FAILING_COMMIT, db], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["first"] == "granted"
    assert granted_bytes(db) == 10 * GIB and out["second"] == "queued"  # never 19 GiB granted
    assert out["release"].startswith("PoolUnavailable: the pool database") and "failed: disk I/O error" in out["release"]


def test_sqlite_errors_inside_a_transaction_become_pool_unavailable(tmp_path):
    pool = make_pool(tmp_path)
    lease = pool.request(req("alice", 4))
    pool.store.conn.execute(f"PRAGMA max_page_count={pool.store.conn.execute('PRAGMA page_count').fetchone()[0]}")
    with pytest.raises(PoolUnavailable, match="database or disk is full; free some disk space"):
        for _ in range(50):  # fills the last free pages, then SQLITE_FULL at an INSERT
            pool.request(req("bob", 1, label="y" * 3000))
    pool.store.conn.execute("PRAGMA max_page_count=1073741823")
    assert pool.get(lease.id).state is LeaseState.GRANTED
    assert sum(held_by_device(pool.store.leases()).values()) <= 16 * GIB
    pool.close()


# --- holder pids ----------------------------------------------------------------------------------------
def test_a_holder_pid_no_process_can_have_is_refused_at_request_time(tmp_path):
    pool = make_pool(tmp_path)
    for pid in (2**31, 2**63, 0, -1, 10**400):
        with pytest.raises(InvalidInput, match="invalid holder_pid .*whole number from 1 to 4194304"):
            pool.request(req("mallory", 1, holder_pid=pid, holder_host=HOSTNAME))
    assert pool.leases() == []
    pool.close()


def test_a_stored_out_of_range_holder_pid_never_stops_the_scheduler(tmp_path):
    """A lease written with holder_pid 2**31 (an earlier version, or a hand-edited file): tick
    neither raises nor stops reclaiming the leases of holders that really died."""
    pool = make_pool(tmp_path)
    bogus = pool.request(req("mallory", 4))
    bogus.holder_pid, bogus.holder_host = 2**31, HOSTNAME
    dead = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    victim = pool.request(req("alice", 4, holder_pid=dead.pid, holder_host=HOSTNAME))
    with pool.store.transaction():
        pool.store.save_leases([bogus])
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    decisions = pool.tick()
    released = {d.lease_id for d in decisions if d.kind.value == "release"}
    assert released == {bogus.id, victim.id}
    assert pool.get(victim.id).release_reason == f"released: its holder process {dead.pid} exited"
    pool.close()


# --- listings that are never cut short ------------------------------------------------------------------------
def crowd(db: str, count: int, after: float) -> None:
    """``count`` live leases of mallory, all newer than ``after``, written in one transaction."""
    from jupyter_gpupool.core.models import Lease, LeaseState

    store = Store(db)
    with store.transaction():
        store.save_leases(
            [
                Lease(id=f"l-crowd{i:06d}", owner="mallory", memory=GIB, state=LeaseState.QUEUED, created_at=after + 1 + i)
                for i in range(count)
            ]
        )
    store.close()


def test_lookups_are_exact_with_thousands_of_newer_leases(tmp_path):
    pool = make_pool(tmp_path)
    mine = pool.request(req("alice", 4, kernel_id="k-alice"))
    crowd(pool.db_path, 1500, mine.created_at)
    assert len(pool.leases()) == 1501
    assert [lease.id for lease in pool.leases(kernel_id="k-alice")] == [mine.id]
    assert [lease.id for lease in pool.leases(owner="alice")] == [mine.id]
    assert pool.lease_owners([mine.id, "l-crowd000000", "l-nope"]) == {mine.id: "alice", "l-crowd000000": "mallory"}
    # Paging walks every row once, newest first.
    seen, before = [], None
    while True:
        page = pool.store.leases(limit=400, before=before)
        if not page:
            break
        seen += [lease.id for lease in page]
        before = (page[-1].created_at, page[-1].id)
    assert len(seen) == len(set(seen)) == 1501 and seen[-1] == mine.id
    pool.close()


RACER = textwrap.dedent(
    """
    import json, sys, time
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.units import GIB

    start = float(sys.argv[2])
    time.sleep(max(0.0, start - time.time()))  # all at once, on a path with no file yet
    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), sys.argv[1], PoolPolicy(heartbeat_ttl=10**9))
    lease = pool.request(LeaseRequest(owner=sys.argv[3], memory=4 * GIB))
    print(json.dumps({"state": lease.state.value, "id": lease.id}))
    """
)


def test_processes_creating_one_pool_at_once_share_it(tmp_path):
    """Six processes open a path with no file at the same instant: one pool, 4 grants of 4 GiB."""
    db = str(tmp_path / "new" / "pool.sqlite")
    start = time.time() + 3.0
    procs = [
        subprocess.Popen([sys.executable, "-c", RACER, db, str(start), f"user{i}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(6)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        results.append(json.loads(out))
    assert sorted(r["state"] for r in results) == ["granted"] * 4 + ["queued"] * 2
    pool = open_pool(db)
    assert {lease.id for lease in pool.leases()} == {r["id"] for r in results}
    pool.close()
    assert granted_bytes(db) == 16 * GIB
    assert sorted(os.listdir(tmp_path / "new")) == ["pool.sqlite"]


def test_an_unreadable_lease_row_is_a_one_line_error_not_a_traceback(tmp_path):
    """A row written by a newer version (an unknown priority class) or edited by hand."""
    db = tmp_path / "pool.sqlite"
    pool_with_leases(db)
    conn = sqlite3.connect(db)
    conn.execute(
        "INSERT INTO leases(id, state, owner, kernel_id, created_at, data) VALUES ('l-odd', 'queued', 'eve', NULL, 1, ?)",
        (json.dumps({"id": "l-odd", "owner": "eve", "memory": 1, "state": "queued", "created_at": 1, "priority": "urgent"}),),
    )
    conn.commit()
    conn.close()
    pool = open_pool(db)
    with pytest.raises(PoolUnavailable, match=r"holds a lease it cannot read \('l-odd': ValueError.*upgrade jupyter-gpupool"):
        pool.request(req("bob", 1))
    with pytest.raises(PoolUnavailable, match="cannot read"):
        pool.leases()
    pool.close()


def test_the_wait_histogram_counts_every_grant_however_many(tmp_path):
    """1,200 grants: the /metrics histogram counts each once (it used to see the newest 1,000)."""
    from prometheus_client.parser import text_string_to_metric_families

    from jupyter_gpupool.core.models import Lease
    from jupyter_gpupool.rest.metrics import make_registry, render

    pool = make_pool(tmp_path)
    leases = [
        Lease(id=f"l-old{i:06d}", owner="u", memory=GIB, state=LeaseState.RELEASED, created_at=1000.0 + i,
              granted_at=1001.0 + i, released_at=1002.0 + i)
        for i in range(1200)
    ]
    with pool.store.transaction():
        pool.store.save_leases(leases)
    registry = make_registry(pool)

    def grants_counted() -> float:
        families = text_string_to_metric_families(render(registry)[0].decode())
        histogram = next(f for f in families if f.name == "gpupool_wait_seconds")
        return next(s.value for s in histogram.samples if s.name == "gpupool_wait_seconds_count")

    assert grants_counted() == 1200
    pool.request(req("alice", 4))
    assert grants_counted() == 1201  # the next scrape adds only the new grant
    pool.close()


def test_a_lease_is_stored_as_the_same_json_however_it_is_encoded():
    """The store writes Lease.to_json_text() (the fast path); it must be json.dumps(to_json())."""
    from jupyter_gpupool.backends.local.store import lease_from_json
    from jupyter_gpupool.core.models import Lease, PriorityClass

    lease = Lease(
        id="l-1", owner="ann", memory=GIB, state=LeaseState.GRANTED, created_at=1.5, groups=("staff", "ml"),
        priority=PriorityClass.HIGH, devices=("GPU-a", "GPU-b"), granted_at=2.0, memory_history=((3.0, 2 * GIB),),
        label="nb.ipynb", busy=True,
    )
    assert lease.to_json_text() == json.dumps(lease.to_json())
    assert lease_from_json(json.loads(lease.to_json_text())) == lease
    lease.extra = "not a field"  # type: ignore[attr-defined]
    assert json.loads(lease.to_json_text()) == lease.to_json()  # never written to the row


class _WatchedBackup:
    """The store's connection, seen through: what ``.rescued-*`` files exist while it copies."""

    def __init__(self, conn: sqlite3.Connection, pattern: str) -> None:
        self._conn, self._pattern = conn, pattern
        self.seen_while_copying: list[str] = []

    def backup(self, target: sqlite3.Connection) -> None:
        self.seen_while_copying = glob.glob(self._pattern)
        self._conn.backup(target)

    def __getattr__(self, name: str):
        return getattr(self._conn, name)


def test_a_rescued_copy_appears_only_once_it_is_whole(tmp_path):
    """A broker killed while it saves a lost file must leave no empty ``.rescued-*`` behind: the
    next broker would read it, find no leases, and stop the kernels that still run."""
    db = tmp_path / "pool.sqlite"
    pool = open_pool(db)
    lease = pool.request(req("alice", 4))
    watched = _WatchedBackup(pool.store.conn, str(db) + ".rescued-*")
    pool.store.conn = watched  # type: ignore[assignment]
    for path in glob.glob(str(db) + "*"):
        os.unlink(path)
    with pytest.raises(PoolUnavailable, match="deleted or moved while in use"):
        pool.store.check_file()
    assert watched.seen_while_copying == [], "a half-written rescued copy was visible while it was copied"
    [rescued] = glob.glob(str(db) + ".rescued-*")
    assert not glob.glob(str(db) + ".rescuing-*")  # the partial name is gone once linked into place
    conn = sqlite3.connect(rescued)
    assert conn.execute("SELECT id, state FROM leases").fetchall() == [(lease.id, "granted")]
    conn.close()
