"""SQLite store: leases, the metering ledger, fair-share usage and an event log.

WAL mode, one ``BEGIN IMMEDIATE`` transaction per decision, so several processes of one user
(JupyterLab, ``nbconvert --execute``, the CLI) can share a file without granting the same
memory twice. The schema is versioned; :data:`MIGRATIONS` brings an old file up to date.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import json
import os
import sqlite3
import stat
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jupyter_gpupool.backends.local.file_guard import (
    RECOVER,
    PathGuard,
    held_while_migrating,
    hint,
    other_holders,
    schema_changed,
)
from jupyter_gpupool.core.metering import memory_segments
from jupyter_gpupool.core.models import Decision, Lease, LeaseState, PriorityClass, Transition, split_json_text
from jupyter_gpupool.errors import InvalidInput, PoolUnavailable

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
    # Unpooled use: GPU memory NVML shows held by processes that belong to no granted lease, as
    # the watcher that owns the host's GPUs (a server's watchdog, the broker's) last saw it. Rows
    # expire, so a dead watcher's figures stop counting; every process deciding on the file plans
    # around the live ones. ``reporter`` is the watcher ("host:pid"), which replaces its rows whole.
    """
    CREATE TABLE unpooled_use (
        reporter TEXT NOT NULL,
        host TEXT NOT NULL,
        device TEXT NOT NULL,
        pid INTEGER NOT NULL,
        bytes INTEGER NOT NULL,
        user TEXT,
        command TEXT NOT NULL,
        lease_id TEXT,
        why TEXT NOT NULL,
        since REAL NOT NULL,
        expires_at REAL NOT NULL,
        stoppable INTEGER NOT NULL,
        PRIMARY KEY (reporter, host, device, pid)
    );
    CREATE INDEX unpooled_expiry ON unpooled_use(expires_at)
    """,
    # Elastic slices: what a closed interval was guaranteed (bytes, all GPUs), so the report bills
    # the burst held above it apart (NULL in older rows: everything held was guaranteed).
    """
    ALTER TABLE ledger ADD COLUMN guarantee INTEGER
    """,
    # What the file is a pool of, by name: ``simulated_inventory`` is the spec of the simulated
    # inventory it was opened with (e.g. ``2xA100-80GB``), so a command given only the file
    # (``--db``) opens the same simulated pool instead of looking for an NVIDIA driver.
    """
    CREATE TABLE pool_facts (
        name TEXT PRIMARY KEY,
        value TEXT NOT NULL
    )
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
#: The ``pool_facts`` name of a simulated pool's inventory spec.
SIMULATED_INVENTORY = "simulated_inventory"

#: ``PRAGMA application_id`` of a pool file ("JGPP"): what tells our file from another SQLite file.
APPLICATION_ID = 0x4A475050
#: The tables every pool file has (a file with none of them and no application id is not ours).
POOL_TABLES = frozenset({"leases", "ledger", "usage", "events"})



def _deleted_while_in_use(path: str, rescued: str | None) -> str:
    saved = f"its last state was saved as {rescued}; " if rescued else ""
    return (
        f"the pool database {path} was deleted or moved while in use, so this process stopped granting "
        f"GPU memory; {saved}stop every Jupyter server and broker using it, put the file back and start them again"
    )


def _replaced_while_in_use(path: str) -> str:
    return (
        f"the pool database {path} was replaced by another file while in use, so this process stopped "
        "granting GPU memory; stop every Jupyter server and broker using it and start them again"
    )


def _locked(method: Any) -> Any:
    """Run a Store method under the store's lock, after checking the file is still ours; SQLite
    errors become :class:`PoolUnavailable` with a one-line message."""

    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.check_file()
            try:
                return method(self, *args, **kwargs)
            except sqlite3.Error as err:
                raise self.unavailable(err) from None

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def lease_from_json(data: dict[str, Any]) -> Lease:
    data = dict(data)
    data["state"] = LeaseState(data["state"])
    data["priority"] = PriorityClass(data["priority"])
    data["groups"] = tuple(data.get("groups", ()))
    data["devices"] = tuple(data.get("devices", ()))
    data["home_devices"] = tuple(data.get("home_devices", ()))
    data["migrate_from"] = tuple(data.get("migrate_from", ()))
    data["transition"] = Transition(data.get("transition") or "")
    data["memory_history"] = tuple((float(at), int(memory)) for at, memory in data.get("memory_history", ()))
    known = Lease.__dataclass_fields__
    return Lease(**{k: v for k, v in data.items() if k in known})


class Store:
    """One SQLite file. Not thread-safe: use one Store per thread (connections are cheap).

    The file must be ours: a path with no file gets a new pool (created whole under a temporary
    name, then linked into place, so nobody ever sees it half made); an existing file must carry
    :data:`APPLICATION_ID` (files of earlier versions, with our tables and no id, get it) and
    pass SQLite's ``quick_check``. An empty, truncated, corrupt or foreign file is refused with
    :class:`PoolUnavailable`, never started afresh. Before every use the path is checked to still
    name the file that was opened: a file deleted, moved or replaced while in use stops this
    store for good (a deleted file's last state is saved next to it first).
    """

    conn: sqlite3.Connection

    def __init__(self, path: str, timeout: float = 30.0, reader_of: Store | None = None) -> None:
        self.path = path
        self.timeout = timeout
        #: A reader is a second connection to the very file ``reader_of`` (a Store of this process)
        #: opened, checked and migrated: it only reads, in :meth:`read_transaction`.
        self.reader_of = reader_of
        self._cache_version: int | None = None
        #: ``unpooled_use`` rows as last read, and the data_version they were read at.
        self._unpooled_rows: tuple[int, list[tuple[Any, ...]]] | None = None
        self._cache: dict[str, Lease] | None = None
        #: Lease writes of the open transaction, put in the cache only once COMMIT succeeded.
        self._pending: dict[str, Lease | None] | None = None
        #: Ids of the cached leases as last committed (what tells a new lease from a changed one).
        self._committed_ids: set[str] | None = None
        #: For cached leases, their stored JSON text before and after the liveness fields, with the
        #: object they are the text of (see :meth:`save_leases`); and those of the open transaction.
        self._texts: dict[str, tuple[Lease, str, str]] = {}
        self._texts_pending: dict[str, tuple[Lease, str, str]] = {}
        #: Changes whenever :meth:`live_leases` hands out other objects than last time (the cache was
        #: re-read or dropped): whoever keeps state derived from them must rebuild it.
        self.cache_generation = 0
        #: ``PRAGMA data_version`` as the last :meth:`live_leases` read it.
        self._seen_version: int | None = None
        #: History statistics (see :meth:`history`), kept up to date with our own commits.
        self._history: _History | None = None
        #: Changes to ``_history`` by the open transaction, applied only once COMMIT succeeded.
        self._history_pending: list[Callable[[_History], None]] = []
        self._identity: tuple[int, int] | None = None
        self._failure: PoolUnavailable | None = None
        self._guard: PathGuard | None = None
        #: Called after each successful COMMIT of this store (the pool's in-process wake-up, see backends/changes.py).
        self.on_commit: Callable[[], None] | None = None
        # One connection per Store; the lock serialises threads (the server's executor, to_thread).
        self.lock = threading.RLock()
        if path == ":memory:":
            self.conn = self._connect(path)
            self._adopt(created=True)
            return
        self.path = path = os.path.abspath(path)
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as err:
            raise PoolUnavailable(f"cannot create the pool's folder {directory}: {err.strerror}") from None
        self._guard = PathGuard(path)
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # --- opening ----------------------------------------------------------------------------------
    def _connect(self, path: str) -> sqlite3.Connection:
        conn = sqlite3.connect(path, timeout=self.timeout, isolation_level=None, check_same_thread=False)
        conn.execute(f"PRAGMA busy_timeout={int(self.timeout * 1000)}")
        return conn

    def _open(self) -> None:
        assert self._guard is not None
        path = self.path
        if not os.path.lexists(path):
            if self.reader_of is not None:
                raise self.reader_of._failure or PoolUnavailable(_deleted_while_in_use(path, None))
            self._create(path)
        try:
            before = os.stat(path)
        except OSError as err:
            raise PoolUnavailable(f"cannot open the pool database {path}: {err.strerror}") from None
        if not stat.S_ISREG(before.st_mode):
            raise PoolUnavailable(f"the pool database {path} is not a regular file; set GPUPOOL_DB to a file path")
        if before.st_size == 0:
            raise PoolUnavailable(f"the pool database {path} is empty (0 bytes): it was truncated; {RECOVER}")
        self._guard.hold()
        try:
            self.conn = self._connect(path)
            if self.reader_of is not None:
                self._check_reader(before)
            else:
                self._adopt(created=False)
        except sqlite3.Error as err:
            raise PoolUnavailable(f"cannot open the pool database {path}: {err}; {self._hint(err)}") from None
        try:
            after = os.stat(path)
        except OSError:
            after = None
        if after is None or (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise PoolUnavailable(f"the pool database {path} was moved or replaced while it was being opened; try again")
        self._identity = (after.st_dev, after.st_ino)

    def _create(self, path: str) -> None:
        """A new pool at a path with no file, unless the path's file was deleted while in use."""
        assert self._guard is not None
        held = self._guard.held_by_others()
        journals = []
        for sidecar in (path + "-wal", path + "-journal"):
            with contextlib.suppress(OSError):
                if os.path.getsize(sidecar) > 0:
                    journals.append(sidecar)
        if os.path.lexists(path):
            return  # another process made it meanwhile (it holds the guard and has a journal): open it
        if held:
            raise PoolUnavailable(
                f"the pool database {path} is missing but still open in another process: it was deleted or moved "
                f"while in use. Stop every Jupyter server and broker using it (each saves what it had as "
                f"{path}.rescued-* when it next uses the pool), then put the file back or start afresh"
            )
        if journals:
            raise PoolUnavailable(
                f"the pool database {path} is missing but its journal {journals[0]} is not: the file was deleted "
                f"or moved. Put it back, or move {journals[0]} away to start an empty pool"
            )
        temporary = f"{path}.new-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            try:
                conn = sqlite3.connect(temporary, isolation_level=None)
                try:
                    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
                    conn.execute("PRAGMA journal_mode=WAL")
                    conn.execute("BEGIN IMMEDIATE")
                    self._migrate(conn, 0)
                    conn.execute("COMMIT")
                finally:
                    conn.close()
            except sqlite3.Error as err:
                raise PoolUnavailable(f"cannot create the pool database {path}: {err}; {self._hint(err)}") from None
            try:
                os.link(temporary, path)  # atomic, and never over a file another process just made
            except FileExistsError:
                pass  # another process made it first: open theirs
            except OSError as err:
                if not os.path.lexists(path):
                    try:
                        os.rename(temporary, path)  # a file system without hard links
                    except OSError:
                        raise PoolUnavailable(
                            f"cannot create the pool database {path}: {err.strerror}; set GPUPOOL_DB to a writable path"
                        ) from None
        except OSError as err:
            raise PoolUnavailable(
                f"cannot create the pool database {path}: {err.strerror}; set GPUPOOL_DB to a writable path"
            ) from None
        finally:
            for leftover in (temporary, temporary + "-wal", temporary + "-shm"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)

    def _adopt(self, created: bool) -> None:
        """Check the open file is a pool of ours (and intact), and bring its schema up to date.
        A file that is not ours is refused before anything is written to it."""
        conn = self.conn
        assert conn is not None
        path = self.path
        try:
            application_id, version, tables = self._identify(conn)
        except sqlite3.Error as err:
            if self._hint(err) != RECOVER:  # read-only, locked, ...: nothing wrong with the file itself
                raise PoolUnavailable(f"cannot open the pool database {path}: {err}; {self._hint(err)}") from None
            raise PoolUnavailable(
                f"the pool database {path} is not an SQLite database ({err}): it is corrupt or another file; {RECOVER}"
            ) from None
        if application_id != APPLICATION_ID and not created:
            legacy = application_id == 0 and 1 <= version <= SCHEMA_VERSION and POOL_TABLES <= tables
            if not legacy and not tables and application_id == 0 and version == 0:
                raise PoolUnavailable(
                    f"the pool database {path} is an empty SQLite file, not a GPU pool; move it away "
                    "(a new pool is made at a path with no file) or set GPUPOOL_DB to another path"
                )
            if not legacy:
                shown = ", ".join(sorted(tables)[:5]) or "none"
                raise PoolUnavailable(
                    f"{path} is another application's SQLite database (tables: {shown}), not a GPU pool; "
                    "set GPUPOOL_DB to another path (this file is left untouched)"
                )
        if version > SCHEMA_VERSION:
            raise PoolUnavailable(
                f"the pool database {path} has schema {version}, newer than this jupyter-gpupool knows "
                f"({SCHEMA_VERSION}); upgrade jupyter-gpupool"
            )
        if version > 0 and not POOL_TABLES <= tables:
            missing = ", ".join(sorted(POOL_TABLES - tables))
            raise PoolUnavailable(f"the pool database {path} lacks its tables ({missing}); {RECOVER}")
        if not created:
            problems = [row[0] for row in conn.execute("PRAGMA quick_check(3)")]
            if problems != ["ok"]:
                raise PoolUnavailable(f"the pool database {path} is corrupt ({'; '.join(problems)[:200]}); {RECOVER}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]  # another process may have migrated it
            holders = other_holders(path) if 0 < version < SCHEMA_VERSION and path != ":memory:" else []
            if holders:  # processes of an earlier version, which would go on deciding on the new schema
                raise PoolUnavailable(held_while_migrating(path, version, SCHEMA_VERSION, holders))
            if conn.execute("PRAGMA application_id").fetchone()[0] != APPLICATION_ID:
                conn.execute(f"PRAGMA application_id={APPLICATION_ID}")  # new, or a pool file of an earlier version
            self._migrate(conn, version)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    def _check_reader(self, opened: os.stat_result) -> None:
        """A reader opens a file its process's writing Store already checked and migrated: it
        only makes sure the path still names that very file (it writes nothing, so it never
        waits for the write lock, not even to open)."""
        writer = self.reader_of
        assert writer is not None
        if writer._failure is not None:
            raise writer._failure
        if writer._identity is not None and (opened.st_dev, opened.st_ino) != writer._identity:
            raise PoolUnavailable(_replaced_while_in_use(self.path))
        application_id, version, _ = self._identify(self.conn)
        if application_id != APPLICATION_ID or version != SCHEMA_VERSION:
            raise PoolUnavailable(f"the pool database {self.path} changed under this process (schema {version}); restart it")

    @staticmethod
    def _identify(conn: sqlite3.Connection) -> tuple[int, int, set[str]]:
        """The file's application id, schema version and table names (read only)."""
        application_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return application_id, version, tables - {"sqlite_sequence"}

    @staticmethod
    def _migrate(conn: sqlite3.Connection, version: int) -> None:
        for step in range(version, SCHEMA_VERSION):
            for statement in MIGRATIONS[step].split(";"):
                if statement.strip():
                    conn.execute(statement)
        if version != SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    # --- staying safe -----------------------------------------------------------------------------
    def check_file(self) -> None:
        """Raise :class:`PoolUnavailable` if the path no longer names the file this store opened
        (deleted, moved, replaced, truncated to nothing): from then on this store only refuses."""
        if self._failure is not None:
            raise self._failure
        if self.reader_of is not None and self.reader_of._failure is not None:
            raise self.reader_of._failure  # the writer found the file gone or replaced
        if self._identity is None:
            return
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            rescued = self._rescue() if self.reader_of is None else None  # the writer saves it
            self._fail(_deleted_while_in_use(self.path, rescued))
        except OSError as err:
            raise PoolUnavailable(f"cannot check the pool database {self.path}: {err.strerror}") from None
        else:
            if (now.st_dev, now.st_ino) != self._identity:
                # The WAL is found by path: left as it is, the next process to open the new file
                # would replay this file's pages into it. Move them into our (old) file first.
                if not self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._fail(_replaced_while_in_use(self.path))
            if now.st_size == 0:
                self._fail(f"the pool database {self.path} was truncated to 0 bytes while in use; {RECOVER}")

    def _fail(self, message: str) -> None:
        self._failure = PoolUnavailable(message)
        self._cache = self._committed_ids = None
        self._texts = {}
        raise self._failure

    def _rescue(self) -> str | None:
        """Save what this connection still sees of a deleted file next to its old path."""
        target = f"{self.path}.rescued-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            copy = sqlite3.connect(target)
            try:
                self.conn.backup(copy)
            finally:
                copy.close()
        except (OSError, sqlite3.Error):
            with contextlib.suppress(OSError):
                os.unlink(target)
            return None
        return target

    _hint = staticmethod(hint)

    def unavailable(self, err: sqlite3.Error) -> PoolUnavailable:
        """A one-line :class:`PoolUnavailable` for an SQLite error; corruption stops this store."""
        failure = PoolUnavailable(f"the pool database {self.path} failed: {err}; {self._hint(err)}")
        text = str(err).lower()
        if "malformed" in text or "not a database" in text:
            self._failure = failure
        return failure

    def _begin(self, statement: str) -> None:
        """Start a transaction on the file this store opened (checked first)."""
        self.check_file()
        try:
            self.conn.execute(statement)
        except sqlite3.Error as err:
            raise self.unavailable(err) from None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE``: the writer lock is taken up front, so decisions never interleave.
        The lease cache learns this transaction's writes only once its ``COMMIT`` succeeded."""
        with self.lock:
            self._begin("BEGIN IMMEDIATE")
            _check_schema(self)
            self._pending = {}
            self._texts_pending = {}
            self._history_pending = []
            try:
                yield self.conn
                self.conn.execute("COMMIT")
            except BaseException as exc:
                self._cache = self._committed_ids = None  # it may have read writes that are now rolled back
                self._pending = None
                self._texts, self._texts_pending = {}, {}
                self._history = None
                self._history_pending = []
                if self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise self.unavailable(exc) from None
                if isinstance(exc, UnicodeEncodeError):  # SQLite keeps UTF-8: a lone surrogate cannot be written
                    raise InvalidInput(
                        f"text with a lone UTF-16 surrogate ({exc.object[exc.start:exc.end]!r}) cannot be stored; "
                        "send valid Unicode"
                    ) from None
                raise
            pending, self._pending = self._pending, None
            texts, self._texts_pending = self._texts_pending, {}
            history_pending, self._history_pending = self._history_pending, []
            if self._history is not None:
                for change in history_pending:
                    change(self._history)
            if self._cache is not None and self._committed_ids is not None:
                for lease_id, lease in pending.items():
                    if lease is None:
                        self._cache.pop(lease_id, None)
                        self._committed_ids.discard(lease_id)
                        self._texts.pop(lease_id, None)
                    else:
                        self._cache[lease_id] = lease
                        self._committed_ids.add(lease_id)
                self._texts.update(texts)
                # Our own commits do not change data_version for this connection: the cache stays valid.
            if self.on_commit is not None:
                with contextlib.suppress(Exception):  # a wake-up that failed must not fail the decision
                    self.on_commit()

    @contextlib.contextmanager
    def read_transaction(self) -> Iterator[sqlite3.Connection]:
        """A deferred ``BEGIN``: what :meth:`live_leases` and :meth:`history` read is one commit's
        state, and in WAL mode reading never waits for a writer (another process's decision, or a
        thread of this one waiting for the write lock on another connection). Nothing may be
        written in it."""
        with self.lock:
            self._begin("BEGIN")
            try:
                yield self.conn
            except sqlite3.Error as err:
                raise self.unavailable(err) from None
            finally:
                if self.conn.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self.conn.execute("ROLLBACK")

    # --- leases -----------------------------------------------------------------------------------
    def live_leases(self) -> dict[str, Lease]:
        """Every lease not yet released (inside a transaction). Re-read only when another
        connection committed since (``PRAGMA data_version``).

        Copy-on-write: this is the cache itself, its leases the cache's own objects (copying
        them was most of a decision's time at a thousand leases, copying the dict most of it at
        ten thousand). Whoever adds or changes a lease must save it with :meth:`save_leases` in
        the same transaction (the engine does: every change goes through ``PoolState.touch``);
        a transaction that fails drops the whole cache, so it never holds uncommitted state past
        its transaction (see :meth:`transaction`). Use it only under :attr:`lock` (inside the
        transaction): decisions of other threads change it once the lock is released.
        """
        version = self._seen_version = self.conn.execute("PRAGMA data_version").fetchone()[0]
        if self._cache is not None and version == self._cache_version and not self._pending:
            return self._cache
        rows = self.conn.execute("SELECT data FROM leases WHERE state != 'released'").fetchall()
        leases = {lease.id: lease for lease in (self._lease(row[0]) for row in rows)}
        self.cache_generation += 1
        if not self._pending:  # nothing of ours uncommitted in what was just read
            self._cache, self._cache_version, self._committed_ids = leases, version, set(leases)
            self._texts = {}
        return leases

    def _lease(self, data: str) -> Lease:
        """A stored lease; a row that cannot be read (edited by hand, written by a newer version)
        is a one-line :class:`PoolUnavailable` naming it, not a traceback in every decision."""
        try:
            return lease_from_json(json.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            try:
                name = repr(json.loads(data).get("id"))
            except (ValueError, AttributeError):
                name = "a lease"
            raise PoolUnavailable(
                f"the pool database {self.path} holds a lease it cannot read ({name}: {type(err).__name__}: {err}"[:300]
                + "); upgrade jupyter-gpupool if a newer version wrote it, else restore the file from a backup"
            ) from None

    def save_leases(self, leases: list[Lease], beats: Iterable[Lease] = ()) -> None:
        """Write ``leases``, and ``beats``: cached leases whose liveness fields alone changed since
        this store last wrote them (``PoolState.touch_liveness``). A beat's text is its stored text
        with the new liveness fields put in, not encoded again: most writes are such reports."""
        cached = self._cache if self._cache is not None else {}
        kept = self._cache is not None and self._pending is not None
        rows = []
        for lease in leases:
            text = lease.to_json_text()
            rows.append((lease.id, lease.state.value, lease.owner, lease.kernel_id, lease.created_at, text))
            self._texts.pop(lease.id, None)  # its text around the liveness fields may have changed
            if kept and cached.get(lease.id) is lease and lease.state is not LeaseState.RELEASED:
                self._keep_text(lease, text)
        beat_rows = []
        for lease in beats:
            known = self._texts_pending.get(lease.id) or self._texts.get(lease.id)
            if known is not None and known[0] is lease:
                text = known[1] + lease.liveness_json_text() + known[2]
            else:
                text = lease.to_json_text()
                if kept and cached.get(lease.id) is lease:
                    self._keep_text(lease, text)
            beat_rows.append((lease, text))
        if beat_rows:
            # A beat's row exists and keeps its state and kernel: a plain UPDATE, which leaves the
            # indexes alone, costs a third of the upsert. A row that is missing all the same
            # (which no cached lease's should be) is written whole below instead.
            before = self.conn.total_changes
            self.conn.executemany("UPDATE leases SET data=? WHERE id=?", [(text, lease.id) for lease, text in beat_rows])
            if self.conn.total_changes - before != len(beat_rows):
                rows += [(l.id, l.state.value, l.owner, l.kernel_id, l.created_at, text) for l, text in beat_rows]
            leases = [*leases, *(lease for lease, _ in beat_rows)]
        if rows:
            self.conn.executemany(
                "INSERT INTO leases(id, state, owner, kernel_id, created_at, data) VALUES (?,?,?,?,?,?) "
                "ON CONFLICT(id) DO UPDATE SET state=excluded.state, kernel_id=excluded.kernel_id, data=excluded.data",
                rows,
            )
        if not leases:
            return
        if self._pending is None:  # outside a transaction (autocommit): simply forget the cache
            self._cache = self._committed_ids = None
            self._texts = {}
            return
        if self._history is not None:
            committed = self._committed_ids
            if committed is None:
                self._history_pending.append(_History.forget_recent)  # cannot tell new leases from old
            else:
                sizes = [(l.id, l.created_at, l.memory, l.id not in committed) for l in leases]
                self._history_pending.append(lambda history: history.saw_sizes(sizes))
        for lease in leases:
            if lease.state is LeaseState.RELEASED:
                self._pending[lease.id] = None
            else:  # the cache's own object (changed in place) stays; one from elsewhere is copied
                self._pending[lease.id] = lease if cached.get(lease.id) is lease else lease.copy()

    def _keep_text(self, lease: Lease, text: str) -> None:
        """Remember the cached ``lease``'s text around its liveness fields, for its next beat."""
        parts = split_json_text(text)
        # Only if the cut is exactly where this lease's liveness text is (it always is for text
        # Lease.to_json_text wrote; the check keeps a beat's text right whatever wrote it).
        if parts is not None and text[len(parts[0]) : len(text) - len(parts[1])] == lease.liveness_json_text():
            self._texts_pending[lease.id] = (lease, parts[0], parts[1])

    @_locked
    def lease(self, lease_id: str) -> Lease | None:
        row = self.conn.execute("SELECT data FROM leases WHERE id = ?", (lease_id,)).fetchone()
        return self._lease(row[0]) if row else None

    @_locked
    def lease_owners(self, lease_ids: Iterable[str]) -> dict[str, str]:
        """``{lease id: owner}`` for those of ``lease_ids`` that exist (released or not): what an
        authorization check needs, looked up by id, never from a listing."""
        ids = list(dict.fromkeys(str(i) for i in lease_ids))
        owners: dict[str, str] = {}
        for start in range(0, len(ids), 500):
            chunk = ids[start : start + 500]
            marks = ",".join("?" * len(chunk))
            owners.update(self.conn.execute(f"SELECT id, owner FROM leases WHERE id IN ({marks})", chunk).fetchall())
        return owners

    @_locked
    def leases(
        self,
        owner: str | None = None,
        include_released: bool = False,
        kernel_id: str | None = None,
        limit: int | None = None,
        before: tuple[float, str] | None = None,
        granted_since: float | None = None,
    ) -> list[Lease]:
        """Leases, newest first, filtered in SQL (``granted_since``: granted at or after that time).
        Every match unless ``limit`` is given; to page, pass the last row's ``(created_at, id)`` as
        ``before`` for the next page."""
        sql = "SELECT data FROM leases WHERE 1=1"
        args: list[Any] = []
        if owner is not None:
            sql += " AND owner = ?"
            args.append(owner)
        if kernel_id is not None:
            sql += " AND kernel_id = ?"
            args.append(kernel_id)
        if not include_released:
            sql += " AND state != 'released'"
        if granted_since is not None:
            sql += " AND CAST(json_extract(data, '$.granted_at') AS REAL) >= ?"
            args.append(granted_since)
        if before is not None:
            sql += " AND (created_at < ? OR (created_at = ? AND id < ?))"
            args += [before[0], before[0], before[1]]
        sql += " ORDER BY created_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(max(0, int(limit)))
        return [self._lease(row[0]) for row in self.conn.execute(sql, args)]

    @_locked
    def latest_for_kernel(self, kernel_id: str) -> Lease | None:
        row = self.conn.execute(
            "SELECT data FROM leases WHERE kernel_id = ? ORDER BY created_at DESC LIMIT 1", (kernel_id,)
        ).fetchone()
        return self._lease(row[0]) if row else None

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
            history = self._history = _History(self._seen_version, mono)
        if history.usage_rows is None:
            history.usage_rows = {owner: (value, at) for owner, value, at in self.conn.execute("SELECT owner, gib_hours, updated_at FROM usage")}
        if history.typical_hold is _UNKNOWN:
            rows = self.conn.execute("SELECT end, end - start FROM ledger ORDER BY end DESC LIMIT ?", (_History.SAMPLE,)).fetchall()
            history.holds = collections.deque(reversed(rows), maxlen=_History.SAMPLE)
            history.held_sorted = sorted(held for _, held in history.holds)
            history.typical_hold = _median_hold(history.held_sorted)
        if history.recent is None:
            rows = self.conn.execute(
                "SELECT id, created_at, json_extract(data, '$.memory') FROM leases ORDER BY created_at DESC LIMIT ?", (_History.SAMPLE,)
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

    @_locked
    def usage(self, now: float, half_life: float) -> dict[str, float]:
        return {owner: decay(value, now - at, half_life) for owner, value, at in self.conn.execute("SELECT owner, gib_hours, updated_at FROM usage")}

    @_locked
    def typical_hold(self, sample: int = 200) -> float | None:
        """Median seconds the last ``sample`` leases were held; None without history."""
        return self._typical_hold(sample)

    def _typical_hold(self, sample: int = 200) -> float | None:
        rows = self.conn.execute("SELECT end - start FROM ledger ORDER BY end DESC LIMIT ?", (sample,)).fetchall()
        return statistics.median(r[0] for r in rows) if len(rows) >= 3 else None

    @_locked
    def recent_request_sizes(self, sample: int = 200) -> list[int]:
        rows = self.conn.execute("SELECT json_extract(data, '$.memory') FROM leases ORDER BY created_at DESC LIMIT ?", (sample,))
        return [int(r[0]) for r in rows if r[0]][::-1]

    @_locked
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

    @_locked
    def record_event(self, at: float, kind: str, lease_id: str, kernel_id: str | None, owner: str, reason: str) -> None:
        """One event of an adapter's own (a signal the watchdog sent), in a transaction of its own."""
        with self.transaction():
            self.conn.execute(
                "INSERT INTO events(at, kind, lease_id, kernel_id, owner, reason, deadline) VALUES (?,?,?,?,?,?,NULL)",
                (at, kind, lease_id, kernel_id, owner, reason),
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

    @_locked
    def reservations(self) -> list[dict[str, Any]]:
        return [json.loads(row[0]) for row in self.conn.execute("SELECT data FROM reservations ORDER BY name")]

    def put_reservation(self, name: str, data: dict[str, Any]) -> None:
        self.conn.execute(
            "INSERT INTO reservations VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET data=excluded.data", (name, json.dumps(data))
        )
        self._history_pending.append(_History.forget_reservations)

    def delete_reservation(self, name: str) -> bool:
        self._history_pending.append(_History.forget_reservations)
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
        if removed["leases"]:
            self._history_pending.append(_History.forget_recent)
        if removed["ledger"]:
            self._history_pending.append(_History.forget_typical_hold)
        return removed

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None:
            conn.close()
        if self._guard is not None:
            self._guard.release()


def _check_schema(store: Store) -> None:
    """Refuse to decide on a file whose schema is not this process's (a newer jupyter-gpupool
    migrated it meanwhile): inside the write lock, before anything is read or written."""
    version = store.conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA_VERSION:
        with contextlib.suppress(sqlite3.Error):
            store.conn.execute("ROLLBACK")
        store._fail(schema_changed(store.path, version, SCHEMA_VERSION))


_UNKNOWN: Any = object()


def _median_hold(held_sorted: list[float]) -> float | None:
    """As :meth:`Store.typical_hold`: the median of the newest holds (sorted), None with fewer than three."""
    count = len(held_sorted)
    if count < 3:
        return None
    middle = count // 2
    return held_sorted[middle] if count % 2 else (held_sorted[middle - 1] + held_sorted[middle]) / 2


class DecayedUsage(Mapping[str, float]):
    """Owners' usage rows decayed to ``now``, each when first asked for (a decision that orders
    no queue asks for none). It reads the store's rows as they are, without copying them: valid
    for the decision (the transaction) it was made for."""

    def __init__(self, rows: dict[str, tuple[float, float]], now: float, half_life: float) -> None:
        self._rows, self._now, self._half_life = rows, now, half_life
        self._decayed: dict[str, float] = {}

    def __getitem__(self, owner: str) -> float:
        value = self._decayed.get(owner)
        if value is None:
            stored, at = self._rows[owner]
            value = self._decayed[owner] = decay(stored, self._now - at, self._half_life)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class _History:
    """The history statistics a decision needs, as last read (see :meth:`Store.history`); a part
    set to None (``_UNKNOWN`` for the typical hold) is read again from SQLite when next needed."""

    SAMPLE = 200  # leases in the recent request sizes, as Store.recent_request_sizes

    def __init__(self, version: int | None, read_at: float) -> None:
        self.version, self.read_at = version, read_at
        self.usage_rows: dict[str, tuple[float, float]] | None = None
        self.typical_hold: Any = _UNKNOWN
        self.holds: collections.deque[tuple[float, float]] | None = None  # (end, seconds held) of the newest intervals, oldest first
        self.held_sorted: list[float] = []  # the same seconds held, sorted (the median without a sort)
        self.recent: dict[str, tuple[float, int]] | None = None  # lease id → (created at, memory), oldest first
        self._recent_changes = 0
        self._sizes: tuple[Any, int, list[int]] | None = None
        self.reservations: list[dict[str, Any]] | None = None

    def saw_interval(self, owner: str, row: tuple[float, float], end: float, held: float) -> None:
        """A granted interval closed: the owner's usage row is ``row`` and the ledger grew by one
        interval that ended at ``end`` after ``held`` seconds (the typical hold follows without a
        query, unless the interval is older than the newest known: then it is read again)."""
        if self.usage_rows is not None:
            self.usage_rows[owner] = row
        holds = self.holds
        if self.typical_hold is _UNKNOWN or holds is None or (holds and end < holds[-1][0]):
            self.forget_typical_hold()
            return
        if len(holds) == holds.maxlen:  # the oldest leaves the sample
            del self.held_sorted[bisect.bisect_left(self.held_sorted, holds[0][1])]
        holds.append((end, held))
        bisect.insort(self.held_sorted, held)
        self.typical_hold = _median_hold(self.held_sorted)

    def recent_sizes(self) -> list[int]:
        """The recent request sizes, oldest first (made again only after they changed)."""
        recent = self.recent
        if recent is None:
            return []
        if self._sizes is None or self._sizes[0] is not recent or self._sizes[1] != self._recent_changes:
            self._sizes = (recent, self._recent_changes, [memory for _, memory in recent.values() if memory])
        return self._sizes[2]

    def saw_sizes(self, leases: list[tuple[str, float, int, bool]]) -> None:
        """Leases saved: ``(id, created at, memory, new)``; a resize changes a recent size too."""
        recent = self.recent
        if recent is None:
            return
        for lease_id, created_at, memory, new in leases:
            if lease_id in recent:
                if recent[lease_id] != (created_at, memory):
                    recent[lease_id] = (created_at, memory)
                    self._recent_changes += 1
            elif new:
                newest = next(reversed(recent.values()))[0] if recent else float("-inf")
                if created_at < newest:
                    self.recent = None  # an older lease (explicit `now` in the past): read them again
                    return
                recent[lease_id] = (created_at, memory)
                self._recent_changes += 1
                if len(recent) > self.SAMPLE:
                    del recent[next(iter(recent))]

    def forget_recent(self) -> None:
        self.recent = None

    def forget_typical_hold(self) -> None:
        self.typical_hold = _UNKNOWN
        self.holds = None

    def forget_reservations(self) -> None:
        self.reservations = None


def decay(value: float, elapsed: float, half_life: float) -> float:
    """``value`` after ``elapsed`` seconds of exponential decay with ``half_life``."""
    if half_life <= 0:
        return value
    return value * 0.5 ** (max(0.0, elapsed) / half_life)
