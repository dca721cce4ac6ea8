"""The Store's tables besides the leases, each a small class the Store is made of: the metering
ledger and fair-share usage (:class:`MeteringTables`), and unpooled use, events, pool facts,
reservations and preferences (:class:`PoolTables`)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sqlite3
import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.local.schema import APPLICATION_ID
from jupyter_gpupool.backends.local.usage_history import UNKNOWN, DecayedUsage, UsageHistory, decay, median_hold
from jupyter_gpupool.core.metering import memory_segments
from jupyter_gpupool.core.models import Decision, Lease
from jupyter_gpupool.errors import PoolUnavailable


def locked(method: Any) -> Any:
    """Run a Store method under the store's lock, after checking the file is still ours; SQLite
    errors become :class:`PoolUnavailable` with a one-line message."""

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.check_file()
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as err:
                raise self.unavailable(err) from None

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


class _StorePart:
    """What the table classes use of the :class:`~jupyter_gpupool.backends.local.store.Store` they are part of."""

    conn: sqlite3.Connection
    lock: Any
    _seen_version: int | None
    _history: UsageHistory | None
    _history_pending: list[Callable[[UsageHistory], None]]
    _unpooled_rows: tuple[int, list[tuple[Any, ...]]] | None

    if TYPE_CHECKING:

        def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]: ...

        def check_file(self) -> None: ...

        def unavailable(self, err: sqlite3.Error) -> PoolUnavailable: ...


class MeteringTables(_StorePart):
    """The metering ledger and the owners' decayed usage."""

    # --- metering and fair share ------------------------------------------------------------------
    def history(self, now: float, half_life: float, max_age: float) -> dict[str, Any]:
        """What a decision needs of the history (inside a transaction, after :meth:`live_leases`):
        ``usage`` (decayed GiB·hours per owner, as :meth:`usage`), ``typical_hold`` (as
        :meth:`typical_hold`), ``recent`` (as :meth:`recent_request_sizes`) and the stored
        ``reservations``. Kept up to date with this store's own commits, at O(what changed) a
        decision; another process's commits are read again at most every ``max_age`` seconds."""
        history = self._history
        mono = time.monotonic()
        if history is not None and history.version != self._seen_version and mono - history.read_at > max_age:
            history = None
        if history is None:
            history = self._history = UsageHistory(self._seen_version, mono)
        if history.usage_rows is None:
            history.usage_rows = {owner: (value, at) for owner, value, at in self.conn.execute("SELECT owner, gib_hours, updated_at FROM usage")}
        if history.typical_hold is UNKNOWN:
            rows = self.conn.execute("SELECT end, end - start FROM ledger ORDER BY end DESC LIMIT ?", (UsageHistory.SAMPLE,)).fetchall()
            history.holds = collections.deque(reversed(rows), maxlen=UsageHistory.SAMPLE)
            history.held_sorted = sorted(held for _, held in history.holds)
            history.typical_hold = median_hold(history.held_sorted)
        if history.recent is None:
            rows = self.conn.execute(
                "SELECT id, created_at, json_extract(data, '$.memory') FROM leases ORDER BY created_at DESC LIMIT ?", (UsageHistory.SAMPLE,)
            ).fetchall()
            history.recent = {lease_id: (created_at, int(memory or 0)) for lease_id, created_at, memory in reversed(rows)}
        if history.reservations is None:
            history.reservations = [json.loads(row[0]) for row in self.conn.execute("SELECT data FROM reservations ORDER BY name")]
        return {
            "usage": DecayedUsage(history.usage_rows, now, half_life),
            "typical_hold": history.typical_hold,
            "recent": history.recent_sizes(),
            "reservations": history.reservations,
        }

    def record_interval(self, lease: Lease, half_life: float, device_info: list[dict[str, Any]] | None = None) -> None:
        """Close a granted interval into the ledger and the owner's decayed usage; ``device_info``
        describes the lease's GPUs (see :class:`~jupyter_gpupool.core.metering.DeviceInfo`)."""
        if lease.granted_at is None or lease.released_at is None:
            return
        start, end = lease.granted_at, lease.released_at
        history = [(at, memory * lease.num_gpus) for at, memory in lease.memory_history]
        self.conn.execute(
            "INSERT INTO ledger(lease_id, owner, groups, kernel_id, devices, memory, start, end, active_seconds, device_info, "
            "memory_history, guarantee) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
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
                lease.guarantee_size * lease.num_gpus,
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
        owner, row_now = lease.owner, (previous + gib_hours, end)
        self._history_pending.append(lambda history: history.saw_interval(owner, row_now, end, end - start))

    @locked
    def usage(self, now: float, half_life: float) -> dict[str, float]:
        return {owner: decay(value, now - at, half_life) for owner, value, at in self.conn.execute("SELECT owner, gib_hours, updated_at FROM usage")}

    @locked
    def typical_hold(self, sample: int = 200) -> float | None:
        """Median seconds the last ``sample`` leases were held; None without history."""
        return self._typical_hold(sample)

    def _typical_hold(self, sample: int = 200) -> float | None:
        rows = self.conn.execute("SELECT end - start FROM ledger ORDER BY end DESC LIMIT ?", (sample,)).fetchall()
        return statistics.median(r[0] for r in rows) if len(rows) >= 3 else None

    @locked
    def recent_request_sizes(self, sample: int = 200) -> list[int]:
        rows = self.conn.execute("SELECT json_extract(data, '$.memory') FROM leases ORDER BY created_at DESC LIMIT ?", (sample,))
        return [int(r[0]) for r in rows if r[0]][::-1]

    @locked
    def ledger(self, since: float | None = None, until: float | None = None) -> list[dict[str, Any]]:
        sql = (
            "SELECT lease_id, owner, groups, kernel_id, devices, memory, start, end, active_seconds, device_info, memory_history, "
            "guarantee FROM ledger WHERE 1=1"
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
            "guarantee",
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


class PoolTables(_StorePart):
    """Unpooled use, the event log, the pool's facts, reservations and preferences."""

    # --- unpooled use ---------------------------------------------------------------------------------
    #: Columns of an ``unpooled_use`` row, in table order.
    UNPOOLED_COLUMNS = ("reporter", "host", "device", "pid", "bytes", "user", "command", "lease_id", "why", "since",
                        "expires_at", "stoppable")

    def replace_unpooled(self, reporter: str, rows: Iterable[Mapping[str, Any]], now: float) -> None:
        """Put ``reporter``'s latest sighting of unpooled use in place of its earlier one (and drop
        everyone's expired rows). Call inside a transaction."""
        self._unpooled_rows = None  # our own write: data_version does not move for it
        self.conn.execute("DELETE FROM unpooled_use WHERE reporter = ? OR expires_at <= ?", (reporter, now))
        self.conn.executemany(
            f"INSERT OR REPLACE INTO unpooled_use VALUES ({','.join('?' * len(self.UNPOOLED_COLUMNS))})",
            [tuple(bool(row[key]) if key == "stoppable" else row[key] if key != "reporter" else reporter
                   for key in self.UNPOOLED_COLUMNS) for row in rows],
        )

    def unpooled_keys(self, reporter: str, now: float) -> set[tuple[str, str, int]]:
        """(host, device, pid) of ``reporter``'s own unexpired sighting."""
        rows = self.conn.execute(
            "SELECT host, device, pid FROM unpooled_use WHERE reporter = ? AND expires_at > ?", (reporter, now)
        )
        return {(host, device, int(pid)) for host, device, pid in rows}

    def unpooled_reporters(self) -> set[str]:
        """Watchers with a sighting on file (expired or not: their next write clears it)."""
        rows = self.conn.execute("SELECT DISTINCT reporter FROM unpooled_use")
        return {reporter for (reporter,) in rows}

    def unpooled(self, now: float) -> list[dict[str, Any]]:
        """Unexpired unpooled use, one row per (host, device, pid): the largest figure when two
        watchers saw the same process (a server's and the broker's)."""
        # Read whenever another connection committed (PRAGMA data_version): every decision asks.
        version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        if self._unpooled_rows is None or self._unpooled_rows[0] != version:
            rows = self.conn.execute("SELECT * FROM unpooled_use ORDER BY host, device, pid, bytes DESC").fetchall()
            self._unpooled_rows = (version, rows)
        expires_at = self.UNPOOLED_COLUMNS.index("expires_at")
        seen: dict[tuple[str, str, int], dict[str, Any]] = {}
        for row in self._unpooled_rows[1]:
            if row[expires_at] <= now:
                continue
            item = dict(zip(self.UNPOOLED_COLUMNS, row))
            item["stoppable"] = bool(item["stoppable"])
            seen.setdefault((item["host"], item["device"], item["pid"]), item)
        return list(seen.values())

    # --- events, reservations, preferences --------------------------------------------------------
    def record_decisions(self, decisions: list[Decision]) -> None:
        self.conn.executemany(
            "INSERT INTO events(at, kind, lease_id, kernel_id, owner, reason, deadline) VALUES (?,?,?,?,?,?,?)",
            [(d.at, d.kind.value, d.lease_id, d.kernel_id, d.owner, d.reason, d.deadline) for d in decisions],
        )

    @locked
    def record_event(self, at: float, kind: str, lease_id: str, kernel_id: str | None, owner: str, reason: str) -> None:
        """One event of an adapter's own (a signal the watchdog sent), in a transaction of its own."""
        with self.transaction():
            self.conn.execute(
                "INSERT INTO events(at, kind, lease_id, kernel_id, owner, reason, deadline) VALUES (?,?,?,?,?,?,NULL)",
                (at, kind, lease_id, kernel_id, owner, reason),
            )

    @locked
    def events(self, after_seq: int = 0, limit: int = 500) -> list[dict[str, Any]]:
        keys = ("seq", "at", "kind", "lease_id", "kernel_id", "owner", "reason", "deadline")
        rows = self.conn.execute("SELECT * FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return [dict(zip(keys, row)) for row in rows]

    @locked
    def event_counts(self) -> dict[str, int]:
        return dict(self.conn.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind").fetchall())

    @locked
    def fact(self, name: str) -> str | None:
        """A fact the file keeps about its pool (see ``pool_facts``), or None."""
        row = self.conn.execute("SELECT value FROM pool_facts WHERE name = ?", (name,)).fetchone()
        return str(row[0]) if row else None

    def remember(self, name: str, value: str) -> None:
        """Keep a fact about the pool (inside :meth:`transaction`)."""
        self.conn.execute(
            "INSERT INTO pool_facts VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value=excluded.value", (name, value)
        )

    @staticmethod
    def recorded_fact(path: str, name: str) -> str | None:
        """A fact a pool file keeps, read without opening it for writing (no lock, no migration):
        None when there is no such file, it is not a pool file, or it predates the fact."""
        if not path or not os.path.isfile(path):
            return None
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        except sqlite3.Error:
            return None
        try:
            if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                return None
            row = conn.execute("SELECT value FROM pool_facts WHERE name = ?", (name,)).fetchone()
            return str(row[0]) if row else None
        except sqlite3.Error:
            return None  # an older file (no pool_facts yet), or one being replaced: nothing recorded
        finally:
            conn.close()

    @locked
    def reservations(self) -> list[dict[str, Any]]:
        return [json.loads(row[0]) for row in self.conn.execute("SELECT data FROM reservations ORDER BY name")]

    def put_reservation(self, name: str, data: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO reservations VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET data=excluded.data", (name, json.dumps(data))
        )
        self._history_pending.append(UsageHistory.forget_reservations)

    def delete_reservation(self, name: str) -> bool:
        self._history_pending.append(UsageHistory.forget_reservations)
        return self.conn.execute("DELETE FROM reservations WHERE name = ?", (name,)).rowcount > 0

    @locked
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
        if removed["leases"]:
            self._history_pending.append(UsageHistory.forget_recent)
        if removed["ledger"]:
            self._history_pending.append(UsageHistory.forget_typical_hold)
        return removed
