"""The Slurm backend's lease file: each lease with its job, in a small SQLite file that outlives the server."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
from typing import Any

from jupyter_gpupool.backends.local.store import lease_from_json
from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.errors import LeaseNotFound, PoolUnavailable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS slurm_leases (
    lease_id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    kernel_id TEXT,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    lease TEXT NOT NULL,
    job TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS slurm_leases_kernel ON slurm_leases (kernel_id, created_at);
CREATE INDEX IF NOT EXISTS slurm_leases_job ON slurm_leases (job_id);
"""


class SlurmLeaseFile:
    """The lease ↔ job mapping (``c.SlurmPool.state_path``): read and written under one lock."""

    def __init__(self, path: str) -> None:
        self._lock = threading.RLock()
        self._db = self.open(path)

    @staticmethod
    def open(path: str) -> sqlite3.Connection:
        directory = os.path.dirname(os.path.abspath(path))
        try:
            os.makedirs(directory, exist_ok=True)
            db = sqlite3.connect(path, timeout=30.0, check_same_thread=False, isolation_level=None)
            db.executescript(_SCHEMA)
        except (OSError, sqlite3.Error) as err:
            raise PoolUnavailable(f"cannot open the Slurm lease file {path}: {err}") from None
        return db

    def rows(self, where: str = "", args: tuple[Any, ...] = ()) -> list[tuple[Lease, dict[str, Any]]]:
        with self._lock:
            rows = self._db.execute(f"SELECT lease, job FROM slurm_leases {where} ORDER BY created_at", args).fetchall()
        return [(lease_from_json(json.loads(lease)), json.loads(job)) for lease, job in rows]

    def put(self, lease: Lease, job: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO slurm_leases (lease_id, job_id, kernel_id, owner, created_at, lease, job) VALUES (?,?,?,?,?,?,?)",
                (
                    lease.id,
                    str(job["job_id"]),
                    lease.kernel_id,
                    lease.owner,
                    lease.created_at,
                    json.dumps(lease.to_json()),
                    json.dumps(job),
                ),
            )

    def put_unless_released(self, lease: Lease, job: dict[str, Any]) -> bool:
        """Write what was seen of a lease's job, unless the lease was released meanwhile (by a
        shutdown in another thread or process, whose reason stands): False then."""
        with self._lock:
            cursor = self._db.execute(
                "UPDATE slurm_leases SET lease = ?, job = ? WHERE lease_id = ? AND json_extract(lease, '$.state') != 'released'",
                (json.dumps(lease.to_json()), json.dumps(job), lease.id),
            )
        return cursor.rowcount == 1

    def row(self, lease_id: str) -> tuple[Lease, dict[str, Any]]:
        rows = self.rows("WHERE lease_id = ?", (lease_id,))
        if not rows:
            raise LeaseNotFound(f"no lease {lease_id!r}; list them with `jupyter gpupool leases`")
        return rows[0]

    def close(self) -> None:
        with self._lock, contextlib.suppress(sqlite3.Error):
            self._db.close()
