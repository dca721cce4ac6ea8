"""Real OS processes sharing one SQLite file: no memory is granted twice, and SIGKILL mid-decision
leaves a consistent state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.local.store import SCHEMA_VERSION, Store
from jupyter_gpupool.core.engine import held_by_device
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.devices.simulated import SimulatedBackend

pytestmark = pytest.mark.slow  # processes hammering one file, killed with SIGKILL

SPEC = "2x16GiB"

WORKER = textwrap.dedent(
    """
    import random, sys
    from jupyter_gpupool.core.models import LeaseRequest, LeaseState
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.units import GIB

    db, name, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # No cap on queued requests: this hammers the store with one owner's long queue on purpose.
    pool = Pool(SimulatedBackend.from_spec("%s"), db, PoolPolicy(heartbeat_ttl=10**9, max_queued_per_user=0))
    rng = random.Random(name)
    mine = []
    requested = 0
    for i in range(rounds):
        if mine and rng.random() < 0.4:
            pool.release(mine.pop(rng.randrange(len(mine))))
        else:
            lease = pool.request(LeaseRequest(owner=name, memory=rng.choice([2, 4, 6, 8]) * GIB))
            mine.append(lease.id)
            requested += 1
        pool.tick()
    print("done", requested, flush=True)
    """
    % SPEC
)


def check_invariants(db: str) -> None:
    pool = Pool(SimulatedBackend.from_spec(SPEC), db)
    leases = pool.store.leases(include_released=True, limit=100_000)
    held = held_by_device(leases)
    for device in pool.devices():
        assert held.get(device.uuid, 0) <= device.memory_total, "a device was granted more than it has"
    granted = [l for l in leases if l.state is LeaseState.GRANTED]
    assert all(len(l.devices) == 1 for l in granted)
    # Every released lease that was granted is in the ledger exactly once.
    ledger_ids = [row["lease_id"] for row in pool.store.ledger()]
    assert len(ledger_ids) == len(set(ledger_ids))
    released_granted = {l.id for l in leases if l.state is LeaseState.RELEASED and l.granted_at is not None}
    assert released_granted == set(ledger_ids)
    pool.close()


def test_two_processes_hammer_one_file(tmp_path):
    db = str(tmp_path / "pool.sqlite")
    Store(db).close()
    procs = [
        subprocess.Popen([sys.executable, "-c", WORKER, db, name, "150"], stdout=subprocess.PIPE, text=True)
        for name in ("alice", "bob")
    ]
    requested = 0
    for proc in procs:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0 and out.startswith("done")
        requested += int(out.split()[1])
    check_invariants(db)
    pool = Pool(SimulatedBackend.from_spec(SPEC), db)
    assert len(pool.store.leases(include_released=True, limit=100_000)) == requested  # nothing lost
    pool.close()


def test_sigkill_mid_decision_leaves_a_consistent_state(tmp_path):
    db = str(tmp_path / "pool.sqlite")
    Store(db).close()
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", WORKER, db, f"victim{attempt}", "100000"], stdout=subprocess.PIPE)
        time.sleep(1.0 + 0.37 * attempt)  # let it get deep into its loop, then kill at an arbitrary point
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        check_invariants(db)
    # The next process opens the file, reclaims the dead holder's nothing-to-do, and works on.
    pool = Pool(SimulatedBackend.from_spec(SPEC), db)
    with pool.store.transaction():
        assert pool.store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert pool.store.conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    for lease in pool.leases():
        pool.release(lease.id)
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.units import GIB

    assert pool.request(LeaseRequest(owner="next", memory=16 * GIB)).state is LeaseState.GRANTED
    pool.close()


def test_schema_migrates_from_version_1(tmp_path):
    import sqlite3

    from jupyter_gpupool.backends.local.store import MIGRATIONS

    db = tmp_path / "old.sqlite"
    conn = sqlite3.connect(db)
    conn.executescript(MIGRATIONS[0] + "; PRAGMA user_version=1;")
    conn.close()
    store = Store(str(db))
    assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    store.set_preference("alice", {"memory": 1})
    assert store.preference("alice") == {"memory": 1}


def test_newer_schema_is_refused_with_a_clear_message(tmp_path):
    import sqlite3

    import pytest

    from jupyter_gpupool.backends.local.store import APPLICATION_ID
    from jupyter_gpupool.errors import PoolUnavailable

    db = tmp_path / "future.sqlite"
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")  # a pool file of a future version
    conn.execute("PRAGMA user_version=99")
    conn.close()
    with pytest.raises(PoolUnavailable, match="upgrade jupyter-gpupool"):
        Store(str(db))
