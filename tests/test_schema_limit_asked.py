"""A pool file written before leases recorded the limit their user set (``limit_asked``): each
lease keeps the limit it had through later resizes, a lease from before elastic slices stays a
fixed slice, and rows that already say ``limit_asked`` are left as they are."""

from __future__ import annotations

import json
import sqlite3

from pool_helpers import T0, make_pool

from jupyter_gpupool.backends.local.schema import APPLICATION_ID, MIGRATIONS, SCHEMA_VERSION
from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB


def test_leases_written_before_limit_asked_keep_their_limit_through_a_resize(tmp_path):
    path = tmp_path / "old.sqlite"
    uuid = SimulatedBackend.from_spec("1x16GiB").devices()[0].uuid
    before = len(MIGRATIONS) - 1  # the file as the version before wrote it
    conn = sqlite3.connect(path)
    conn.executescript(";".join(MIGRATIONS[:before]) + f"; PRAGMA user_version={before}; PRAGMA application_id={APPLICATION_ID};")

    def row(lease_id: str, owner: str, drop: tuple[str, ...], **fields: object) -> None:
        data = Lease(id=lease_id, owner=owner, memory=2 * GIB, state=LeaseState.GRANTED, created_at=T0, granted_at=T0,
                     devices=(uuid,), heartbeat_at=T0, **fields).to_json()  # type: ignore[arg-type]
        for name in drop:
            del data[name]
        conn.execute("INSERT INTO leases VALUES (?,?,?,?,?,?)", (lease_id, "granted", owner, None, T0, json.dumps(data)))

    row("l-spec", "alice", ("limit_asked",), guarantee=2 * GIB, burst_limit=6 * GIB)  # a kernelspec's --limit 6GiB
    row("l-fixed", "bob", ("limit_asked", "guarantee", "burst_limit"))  # from before elastic slices
    row("l-new", "carol", (), guarantee=2 * GIB, burst_limit=8 * GIB, limit_asked=None)  # the pool's burst, as written today
    conn.commit()
    conn.close()

    pool = make_pool(tmp_path, name="old.sqlite", burst="4x")
    assert pool.store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert (pool.get("l-spec").limit_asked, pool.get("l-fixed").limit_asked, pool.get("l-new").limit_asked) == (6 * GIB, 0, None)
    # A resize keeps the limit each was given; only the lease that never set one gets the pool's 4x.
    assert pool.resize("l-spec", 3 * GIB, now=T0 + 1).limit_size == 6 * GIB  # not 4 x 3 GiB
    fixed = pool.resize("l-fixed", 3 * GIB, now=T0 + 2)
    assert fixed.limit_size == 3 * GIB and not fixed.elastic
    assert pool.resize("l-new", 3 * GIB, now=T0 + 3).limit_size == 12 * GIB
