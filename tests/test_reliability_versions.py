"""Two versions of jupyter-gpupool on one pool file: a process never decides on a schema it does not
know, and a file is never taken forward while a process of an earlier version has it open. Real
SQLite files, real processes holding them."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from pool_helpers import T0, make_pool, req
from test_store_migration_faults import (
    BEFORE_ELASTIC,
    file_of_the_schema_before_elastic_slices,
    open_pool,
    schema_and_rows,
)

from jupyter_gpupool.backends.local.store import SCHEMA_VERSION
from jupyter_gpupool.errors import PoolUnavailable


def test_a_file_a_newer_version_took_forward_stops_this_process_deciding(tmp_path: Path) -> None:
    """A newer jupyter-gpupool (here: a process that stamps the schema it wrote) takes the file
    forward while this pool has it open: this pool's next write is refused with one line naming
    both schemas, and nothing is granted by it from then on."""
    pool = make_pool(tmp_path)
    try:
        alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
        newer = SCHEMA_VERSION + 1
        subprocess.run([sys.executable, "-c", (f"import sqlite3; c = sqlite3.connect({pool.store.path!r}); "
                        f"c.execute('PRAGMA user_version={newer}'); c.close()")], check=True)
        line = f"has schema {newer}, but this jupyter-gpupool knows schema {SCHEMA_VERSION}"
        with pytest.raises(PoolUnavailable, match=line):
            pool.request(req("bob", 4, kernel_id="kb"), now=T0 + 1)
        with pytest.raises(PoolUnavailable, match=line):
            pool.tick(now=T0 + 2)
    finally:
        pool.close()
    conn = sqlite3.connect(f"file:{tmp_path / 'pool.sqlite'}?mode=ro", uri=True)
    try:
        assert [row[0] for row in conn.execute("SELECT id FROM leases")] == [alice.id], "the refused process wrote"
    finally:
        conn.close()


def test_a_file_held_by_a_process_of_the_earlier_schema_is_not_taken_forward(tmp_path: Path) -> None:
    """A server of the earlier version has the file open: the new version refuses to migrate it,
    naming that process, and leaves the file as it was; once it exited, the file is taken forward
    with its leases."""
    db, kept = file_of_the_schema_before_elastic_slices(tmp_path)
    older = subprocess.Popen(
        [sys.executable, "-c", (f"import sqlite3, time; c = sqlite3.connect({db!r}); c.execute('SELECT * FROM leases').fetchall(); "
         "print('ready', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE,
    )
    try:
        assert older.stdout is not None and older.stdout.readline().strip() == b"ready"
        with pytest.raises(PoolUnavailable) as refused:
            open_pool(db)
        message = str(refused.value)
        assert f"has schema {BEFORE_ELASTIC} and this jupyter-gpupool needs schema {SCHEMA_VERSION}" in message
        assert f"pid {older.pid}: {sys.executable} -c import sqlite3" in message
        assert schema_and_rows(db)[:2] == (BEFORE_ELASTIC, kept), "the file changed"
    finally:
        older.kill()
        older.wait()
    pool = open_pool(db)
    try:
        assert {lease.id for lease in pool.leases()} == kept
    finally:
        pool.close()
    assert schema_and_rows(db)[0] == SCHEMA_VERSION
