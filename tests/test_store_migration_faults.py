"""Taking a pool file forward across the elastic-slice and pool-facts migrations when the disk is
full or the process is killed half-way: the file stays at its old schema with every lease and
ledger row, and the next open takes it forward. Real SQLite files, real write failures
(``RLIMIT_FSIZE``), a real process killed with SIGKILL inside the migration's transaction."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.local.store import MIGRATIONS, SCHEMA_VERSION
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB

#: The schema before ``ledger.guarantee`` (elastic slices) and ``pool_facts``.
BEFORE_ELASTIC = next(step for step, sql in enumerate(MIGRATIONS) if "ADD COLUMN guarantee" in sql)
assert "guarantee" in MIGRATIONS[BEFORE_ELASTIC] and "pool_facts" in MIGRATIONS[BEFORE_ELASTIC + 1]


def open_pool(db: str) -> Pool:
    return Pool(SimulatedBackend.from_spec("1x16GiB"), db, PoolPolicy(heartbeat_ttl=10**9))


def file_of_the_schema_before_elastic_slices(tmp_path: Path) -> tuple[str, set[str]]:
    """A pool file as the version before elastic slices left it: two granted leases and a ledger
    row of a released one (made with today's code, then those two migrations undone)."""
    db = str(tmp_path / "pool.sqlite")
    pool = open_pool(db)
    kept = {pool.request(LeaseRequest(owner=owner, memory=4 * GIB)).id for owner in ("alice", "bob")}
    gone = pool.request(LeaseRequest(owner="carol", memory=2 * GIB))
    pool.release(gone.id)
    pool.close()
    conn = sqlite3.connect(db)
    conn.executescript(f"ALTER TABLE ledger DROP COLUMN guarantee; DROP TABLE pool_facts; PRAGMA user_version={BEFORE_ELASTIC};")
    conn.close()
    return db, kept


def schema_and_rows(db: str) -> tuple[int, set[str], int]:
    """(schema version, ids of granted leases, ledger rows), read without our code."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        granted = {row[0] for row in conn.execute("SELECT id FROM leases WHERE state = 'granted'")}
        ledger = conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0]
        return version, granted, ledger
    finally:
        conn.close()


OPEN_WITH_A_FULL_DISK = textwrap.dedent(
    """
    import os, resource, signal, sys
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    db = sys.argv[1]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # nothing new may be written
    try:
        Pool(SimulatedBackend.from_spec("1x16GiB"), db, PoolPolicy(heartbeat_ttl=10**9))
    except Exception as err:
        print(type(err).__name__ + ": " + str(err))
    else:
        print("opened")
    """
)

KILLED_INSIDE_THE_MIGRATION = textwrap.dedent(
    """
    import os, signal, sys
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.backends.local.store import Store
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    migrate = Store._migrate

    def migrate_then_die(conn, version):
        migrate(conn, version)  # every statement ran, the COMMIT has not
        os.kill(os.getpid(), signal.SIGKILL)

    Store._migrate = staticmethod(migrate_then_die)
    Pool(SimulatedBackend.from_spec("1x16GiB"), sys.argv[1], PoolPolicy(heartbeat_ttl=10**9))
    """
)


def taken_forward_with_everything(db: str, kept: set[str]) -> None:
    pool = open_pool(db)
    try:
        assert {lease.id for lease in pool.leases() if lease.state is LeaseState.GRANTED} == kept
        (row,) = pool.store.ledger()
        assert row["owner"] == "carol" and row["guarantee"] is None  # held before elastic slices: all guaranteed
        carol = [line for line in pool.report() if line.get("user") == "carol"]
        assert carol and carol[0]["gib_hours_burst"] == 0, carol  # the old row bills no burst
    finally:
        pool.close()
    assert schema_and_rows(db)[0] == SCHEMA_VERSION


def test_a_full_disk_while_taking_a_file_forward_changes_nothing_and_says_so(tmp_path):
    db, kept = file_of_the_schema_before_elastic_slices(tmp_path)
    before = schema_and_rows(db)
    result = subprocess.run([sys.executable, "-c", OPEN_WITH_A_FULL_DISK, db], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    said = result.stdout.strip()
    assert said.startswith("PoolUnavailable: ") and "\n" not in said and "Traceback" not in result.stderr, said + result.stderr
    assert schema_and_rows(db) == before == (BEFORE_ELASTIC, kept, 1)
    taken_forward_with_everything(db, kept)


def test_a_process_killed_inside_the_migration_leaves_the_old_file_whole(tmp_path):
    db, kept = file_of_the_schema_before_elastic_slices(tmp_path)
    before = schema_and_rows(db)
    result = subprocess.run([sys.executable, "-c", KILLED_INSIDE_THE_MIGRATION, db], capture_output=True, text=True, timeout=120)
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr)
    assert schema_and_rows(db) == before
    taken_forward_with_everything(db, kept)
