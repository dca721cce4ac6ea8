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
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from jupyter_gpupool.backends.local.file_guard import (
    RECOVER,
    PathGuard,
    held_while_migrating,
    hint,
    other_holders,
    schema_changed,
)
from jupyter_gpupool.backends.local.records import MeteringTables, PoolTables, locked
from jupyter_gpupool.backends.local.schema import APPLICATION_ID, MIGRATIONS, POOL_TABLES, SCHEMA_VERSION
from jupyter_gpupool.backends.local.usage_history import UsageHistory
from jupyter_gpupool.core.models import Lease, LeaseState, PriorityClass, Transition, split_json_text
from jupyter_gpupool.errors import InvalidInput, PoolUnavailable


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


class Store(MeteringTables, PoolTables):
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
        self._history: UsageHistory | None = None
        #: Changes to ``_history`` by the open transaction, applied only once COMMIT succeeded.
        self._history_pending: list[Callable[[UsageHistory], None]] = []
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
        stamp = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        target = f"{self.path}.rescued-{stamp}"
        # Written under another name and linked into place whole: a process killed mid-copy leaves
        # no half-written ``.rescued-*`` for the next broker to find empty.
        partial = f"{self.path}.rescuing-{stamp}"
        try:
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            copy = sqlite3.connect(partial)
            try:
                self.conn.backup(copy)
            finally:
                copy.close()
            os.link(partial, target)  # fails rather than replace a copy of the same name
        except (OSError, sqlite3.Error):
            return None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(partial)
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
                self._history_pending.append(UsageHistory.forget_recent)  # cannot tell new leases from old
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

    @locked
    def lease(self, lease_id: str) -> Lease | None:
        row = self.conn.execute("SELECT data FROM leases WHERE id = ?", (lease_id,)).fetchone()
        return self._lease(row[0]) if row else None

    @locked
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

    @locked
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

    @locked
    def latest_for_kernel(self, kernel_id: str) -> Lease | None:
        row = self.conn.execute(
            "SELECT data FROM leases WHERE kernel_id = ? ORDER BY created_at DESC LIMIT 1", (kernel_id,)
        ).fetchone()
        return self._lease(row[0]) if row else None


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
