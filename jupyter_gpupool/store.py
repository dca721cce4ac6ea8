"""SQLite store: leases, the metering ledger, fair-share usage and an event log.

WAL mode, one ``BEGIN IMMEDIATE`` transaction per decision, so several processes of one user
(JupyterLab, ``nbconvert --execute``, the CLI) can share a file without granting the same
memory twice. The schema is versioned; :data:`MIGRATIONS` brings an old file up to date.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import statistics
import threading
from collections.abc import Iterator
from typing import Any

from .core.metering import memory_segments
from .core.models import Decision, Lease, LeaseState, PriorityClass
from .errors import PoolUnavailable

#: Each entry upgrades the schema from version ``i`` to ``i + 1``.
MIGRATIONS: list[str] = [
    """
    CREATE TABLE leases (
        id TEXT PRIMARY KEY,
        state TEXT NOT NULL,
        owner TEXT NOT NULL,
        kernel_id TEXT,
        created_at REAL NOT NULL,
        data TEXT NOT NULL
    );
    CREATE INDEX leases_live ON leases(state) WHERE state != 'released';
    CREATE INDEX leases_kernel ON leases(kernel_id);
    CREATE TABLE ledger (
        lease_id TEXT NOT NULL,
        owner TEXT NOT NULL,
        groups TEXT NOT NULL,
        kernel_id TEXT,
        devices TEXT NOT NULL,
        memory INTEGER NOT NULL,
        start REAL NOT NULL,
        end REAL NOT NULL,
        active_seconds REAL NOT NULL
    );
    CREATE INDEX ledger_end ON ledger(end);
    CREATE TABLE usage (
        owner TEXT PRIMARY KEY,
        gib_hours REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE events (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at REAL NOT NULL,
        kind TEXT NOT NULL,
        lease_id TEXT NOT NULL,
        kernel_id TEXT,
        owner TEXT NOT NULL,
        reason TEXT NOT NULL,
        deadline REAL
    );
    """,
    """
    CREATE TABLE reservations (
        name TEXT PRIMARY KEY,
        data TEXT NOT NULL
    );
    CREATE TABLE preferences (
        owner TEXT PRIMARY KEY,
        data TEXT NOT NULL
    );
    """,
    # Metering: what each GPU of a closed interval was (model, memory, MIG), for GPU-hours and
    # prices that stay right after the GPU leaves the inventory (NULL in older rows: see
    # Pool.report), and the memory held before each resize ([[when, bytes of all GPUs], ...]).
    """
    ALTER TABLE ledger ADD COLUMN device_info TEXT;
    ALTER TABLE ledger ADD COLUMN memory_history TEXT
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)


def _locked(method: Any) -> Any:
    """Run a Store method under the store's lock (reads outside a transaction too)."""

    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def lease_from_json(data: dict[str, Any]) -> Lease:
    data = dict(data)
    data["state"] = LeaseState(data["state"])
    data["priority"] = PriorityClass(data["priority"])
    data["groups"] = tuple(data.get("groups", ()))
    data["devices"] = tuple(data.get("devices", ()))
    data["memory_history"] = tuple((float(at), int(memory)) for at, memory in data.get("memory_history", ()))
    known = Lease.__dataclass_fields__
    return Lease(**{k: v for k, v in data.items() if k in known})


class Store:
    """One SQLite file. Not thread-safe: use one Store per thread (connections are cheap)."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = path
        if path != ":memory:":
            directory = os.path.dirname(os.path.abspath(path))
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as err:
                raise PoolUnavailable(f"cannot create the pool's folder {directory}: {err.strerror}") from None
        self._cache_version: int | None = None
        self._cache: dict[str, Lease] | None = None
        # One connection per Store; the lock serialises threads (the server's executor, to_thread).
        self.lock = threading.RLock()
        try:
            self.conn = sqlite3.connect(path, timeout=timeout, isolation_level=None, check_same_thread=False)
            self.conn.execute("PRAGMA journal_mode=WAL")
            self.conn.execute("PRAGMA synchronous=NORMAL")
            self.conn.execute(f"PRAGMA busy_timeout={int(timeout * 1000)}")
            self._migrate()
        except sqlite3.Error as err:
            raise PoolUnavailable(f"cannot open the pool database {path}: {err}; set GPUPOOL_DB to a writable path") from None

    def _migrate(self) -> None:
        with self.transaction():
            version = self.conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise PoolUnavailable(
                    f"the pool database {self.path} has schema {version}, newer than this jupyter-gpupool knows "
                    f"({SCHEMA_VERSION}); upgrade jupyter-gpupool"
                )
            for step in range(version, SCHEMA_VERSION):
                for statement in MIGRATIONS[step].split(";"):
                    if statement.strip():
                        self.conn.execute(statement)
            if version != SCHEMA_VERSION:
                self.conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``: the writer lock is taken up front, so decisions never interleave."""
        with self.lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self._cache = None  # it may hold writes that are being rolled back
                self.conn.execute("ROLLBACK")
                raise
            else:
                self.conn.execute("COMMIT")

    # --- leases -----------------------------------------------------------------------------------
    def live_leases(self) -> dict[str, Lease]:
        """Every lease not yet released (inside a transaction). Re-read only when another
        connection committed since (``PRAGMA data_version``) or we wrote ourselves."""
        version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        if self._cache is not None and version == self._cache_version:
            return {k: v.copy() for k, v in self._cache.items()}
        rows = self.conn.execute("SELECT data FROM leases WHERE state != 'released'").fetchall()
        leases = {lease.id: lease for lease in (lease_from_json(json.loads(row[0])) for row in rows)}
        self._cache, self._cache_version = leases, version
        return {k: v.copy() for k, v in leases.items()}

    def save_leases(self, leases: list[Lease]) -> None:
        self.conn.executemany(
            "INSERT INTO leases(id, state, owner, kernel_id, created_at, data) VALUES (?,?,?,?,?,?) "
            "ON CONFLICT(id) DO UPDATE SET state=excluded.state, kernel_id=excluded.kernel_id, data=excluded.data",
            [(l.id, l.state.value, l.owner, l.kernel_id, l.created_at, json.dumps(l.to_json())) for l in leases],
        )
        if self._cache is not None:
            for lease in leases:
                if lease.state is LeaseState.RELEASED:
                    self._cache.pop(lease.id, None)
                else:
                    self._cache[lease.id] = lease.copy()
            # Our own writes do not change data_version for this connection, so the cache stays valid.

    @_locked
    def lease(self, lease_id: str) -> Lease | None:
        row = self.conn.execute("SELECT data FROM leases WHERE id = ?", (lease_id,)).fetchone()
        return lease_from_json(json.loads(row[0])) if row else None

    @_locked
    def leases(self, owner: str | None = None, include_released: bool = False, limit: int = 1000) -> list[Lease]:
        sql = "SELECT data FROM leases WHERE 1=1"
        args: list[Any] = []
        if owner is not None:
            sql += " AND owner = ?"
            args.append(owner)
        if not include_released:
            sql += " AND state != 'released'"
        sql += " ORDER BY created_at DESC LIMIT ?"
        args.append(limit)
        return [lease_from_json(json.loads(row[0])) for row in self.conn.execute(sql, args)]

    @_locked
    def latest_for_kernel(self, kernel_id: str) -> Lease | None:
        row = self.conn.execute(
            "SELECT data FROM leases WHERE kernel_id = ? ORDER BY created_at DESC LIMIT 1", (kernel_id,)
        ).fetchone()
        return lease_from_json(json.loads(row[0])) if row else None

    # --- metering and fair share ------------------------------------------------------------------
    def record_interval(self, lease: Lease, half_life: float, device_info: list[dict[str, Any]] | None = None) -> None:
        """Close a granted interval into the ledger and the owner's decayed usage; ``device_info``
        describes the lease's GPUs (see :class:`~jupyter_gpupool.core.metering.DeviceInfo`)."""
        if lease.granted_at is None or lease.released_at is None:
            return
        start, end = lease.granted_at, lease.released_at
        history = [(at, memory * lease.num_gpus) for at, memory in lease.memory_history]
        self.conn.execute(
            "INSERT INTO ledger(lease_id, owner, groups, kernel_id, devices, memory, start, end, active_seconds, device_info, "
            "memory_history) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (
                lease.id,
                lease.owner,
                json.dumps(list(lease.groups)),
                lease.kernel_id,
                json.dumps(list(lease.devices)),
                lease.memory * lease.num_gpus,
                start,
                end,
                lease.active_seconds,
                json.dumps(device_info) if device_info is not None else None,
                json.dumps(history) if history else None,
            ),
        )
        segments = memory_segments(start, end, lease.memory * lease.num_gpus, history)
        gib_hours = sum(memory / 1024**3 * (b - a) / 3600 for a, b, memory in segments)
        row = self.conn.execute("SELECT gib_hours, updated_at FROM usage WHERE owner = ?", (lease.owner,)).fetchone()
        previous = decay(row[0], end - row[1], half_life) if row else 0.0
        self.conn.execute(
            "INSERT INTO usage VALUES (?,?,?) ON CONFLICT(owner) DO UPDATE SET gib_hours=excluded.gib_hours, updated_at=excluded.updated_at",
            (lease.owner, previous + gib_hours, end),
        )

    @_locked
    def usage(self, now: float, half_life: float) -> dict[str, float]:
        return {owner: decay(value, now - at, half_life) for owner, value, at in self.conn.execute("SELECT owner, gib_hours, updated_at FROM usage")}

    @_locked
    def typical_hold(self, sample: int = 200) -> float | None:
        """Median seconds the last ``sample`` leases were held; None without history."""
        rows = self.conn.execute("SELECT end - start FROM ledger ORDER BY end DESC LIMIT ?", (sample,)).fetchall()
        return statistics.median(r[0] for r in rows) if len(rows) >= 3 else None

    @_locked
    def recent_request_sizes(self, sample: int = 200) -> list[int]:
        rows = self.conn.execute("SELECT json_extract(data, '$.memory') FROM leases ORDER BY created_at DESC LIMIT ?", (sample,))
        return [int(r[0]) for r in rows if r[0]][::-1]

    @_locked
    def ledger(self, since: float | None = None, until: float | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT lease_id, owner, groups, kernel_id, devices, memory, start, end, active_seconds, device_info, memory_history "
            "FROM ledger WHERE 1=1"
        )
        args: list[Any] = []
        if since is not None:
            sql += " AND end > ?"
            args.append(since)
        if until is not None:
            sql += " AND start < ?"
            args.append(until)
        keys = (
            "lease_id", "owner", "groups", "kernel_id", "devices", "memory", "start", "end", "active_seconds", "device_info", "memory_history",
        )
        rows = []
        for row in self.conn.execute(sql, args):
            item = dict(zip(keys, row))
            item["groups"] = json.loads(item["groups"])
            item["devices"] = json.loads(item["devices"])
            item["device_info"] = json.loads(item["device_info"]) if item["device_info"] else None
            item["memory_history"] = [(float(at), int(memory)) for at, memory in json.loads(item["memory_history"] or "[]")]
            rows.append(item)
        return rows

    # --- events, reservations, preferences --------------------------------------------------------
    def record_decisions(self, decisions: list[Decision]) -> None:
        self.conn.executemany(
            "INSERT INTO events(at, kind, lease_id, kernel_id, owner, reason, deadline) VALUES (?,?,?,?,?,?,?)",
            [(d.at, d.kind.value, d.lease_id, d.kernel_id, d.owner, d.reason, d.deadline) for d in decisions],
        )

    @_locked
    def events(self, after_seq: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        keys = ("seq", "at", "kind", "lease_id", "kernel_id", "owner", "reason", "deadline")
        rows = self.conn.execute("SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return [dict(zip(keys, row)) for row in rows]

    @_locked
    def event_counts(self) -> dict[str, int]:
        return dict(self.conn.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind").fetchall())

    @_locked
    def reservations(self) -> list[dict[str, Any]]:
        return [json.loads(row[0]) for row in self.conn.execute("SELECT data FROM reservations ORDER BY name")]

    def put_reservation(self, name: str, data: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO reservations VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET data=excluded.data", (name, json.dumps(data))
        )

    def delete_reservation(self, name: str) -> bool:
        return self.conn.execute("DELETE FROM reservations WHERE name = ?", (name,)).rowcount > 0

    @_locked
    def preference(self, owner: str) -> dict[str, Any]:
        row = self.conn.execute("SELECT data FROM preferences WHERE owner = ?", (owner,)).fetchone()
        return json.loads(row[0]) if row else {}

    def set_preference(self, owner: str, data: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO preferences VALUES (?, ?) ON CONFLICT(owner) DO UPDATE SET data=excluded.data", (owner, json.dumps(data))
        )

    def prune(self, leases_before: float | None, ledger_before: float | None) -> dict[str, int]:
        """Delete released leases and events older than ``leases_before`` and ledger rows older
        than ``ledger_before`` (``None``: keep). Call inside a transaction."""
        removed = {"leases": 0, "events": 0, "ledger": 0}
        if leases_before is not None:
            removed["leases"] = self.conn.execute(
                "DELETE FROM leases WHERE state = 'released' AND CAST(json_extract(data, '$.released_at') AS REAL) < ?",
                (leases_before,),
            ).rowcount
            removed["events"] = self.conn.execute("DELETE FROM events WHERE at < ?", (leases_before,)).rowcount
        if ledger_before is not None:
            removed["ledger"] = self.conn.execute("DELETE FROM ledger WHERE end < ?", (ledger_before,)).rowcount
        return removed

    def close(self) -> None:
        self.conn.close()


def decay(value: float, elapsed: float, half_life: float) -> float:
    """``value`` after ``elapsed`` seconds of exponential decay with ``half_life``."""
    if half_life <= 0:
        return value
    return value * 0.5 ** (max(0.0, elapsed) / half_life)
