"""Hearing that the pool changed, at once: the wake-up behind event-driven suspends, resumes and moves.

A pool decision (suspend this kernel, restore that one, move a third) is written to the pool file
by whichever process took it: the server holding the kernel, a kernel asking to resume for its
cell, the CLI, nbconvert waiting for a grant. The server that must carry it out hears of it here,
not on its next periodic round:

- **in this process**, :meth:`PoolChanges.notify` is called after each commit of this process's
  store (see :attr:`~jupyter_gpupool.backends.local.store.Store.on_commit`): listeners run at once;
- **from other processes**, one daemon thread watches SQLite's ``PRAGMA data_version`` on a
  connection of its own, which moves whenever any other connection commits to the file (a
  shared-memory read in WAL mode: no lock, no disk I/O). It looks every :attr:`interval` seconds
  (50 ms by default) and sleeps in between: no busy CPU;
- **behind a broker**, ``GET /api/gpupool/changes`` long-polls the broker's own :class:`PoolChanges`
  (see :meth:`jupyter_gpupool.backends.remote.RemotePool.wait_for_change`).

:attr:`PoolChanges.version` is a counter of this process (it says "something changed", never
what): a waiter passes the version it last saw and is woken when it moved.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable

Listener = Callable[[], None]

#: Seconds between two looks at the pool file for other processes' commits.
DEFAULT_INTERVAL = 0.05


class PoolChanges:
    """A version that moves whenever the pool file at ``path`` changed, and ways to wait for it.

    ``path`` None (an in-memory pool) hears only this process's own commits. The watching thread
    starts on first use (:meth:`wait`, :meth:`subscribe`) and stops with :meth:`close`.
    """

    def __init__(self, path: str | None, interval: float = DEFAULT_INTERVAL) -> None:
        self.path = path
        self.interval = interval
        self.version = 0
        self._cond = threading.Condition()
        self._listeners: list[Listener] = []
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._waiters = 0
        #: The watcher's connection and the data_version it last read: kept while the watcher sleeps
        #: (it stops after :attr:`linger` seconds with nobody waiting or subscribed), so a commit
        #: made meanwhile is still seen when it starts again.
        self._conn: sqlite3.Connection | None = None
        self._seen: int | None = None

    #: Seconds the watching thread lives on with nobody waiting or subscribed (a kernel waits only
    #: while its restore is under way; a server subscribes for good).
    linger = 2.0

    # --- telling ----------------------------------------------------------------------------------
    def notify(self) -> None:
        """Something changed (a commit of this process, or one the watcher saw): wake every waiter."""
        with self._cond:
            self.version += 1
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001, S110 -- one broken listener must not keep the others asleep
                pass

    # --- hearing ----------------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener()`` (from any thread, so keep it short) after every change; returns the
        function that unsubscribes it."""
        with self._cond:
            self._listeners.append(listener)
            self._ensure_watching()

        def unsubscribe() -> None:
            with self._cond, contextlib.suppress(ValueError):
                self._listeners.remove(listener)

        return unsubscribe

    def wait(self, since: int | None, timeout: float) -> int:
        """Block until :attr:`version` differs from ``since`` or ``timeout`` seconds passed; the
        version now. ``since`` None answers at once (a first call learns where to start)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._waiters += 1
            try:
                self._ensure_watching()
                while since is not None and self.version == since and not self._closed.is_set():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                return self.version
            finally:
                self._waiters -= 1

    async def wait_async(self, since: int | None, timeout: float) -> int:
        """:meth:`wait` on the event loop, holding no thread while it waits."""
        loop = asyncio.get_running_loop()
        moved = asyncio.Event()
        def wake() -> None:
            loop.call_soon_threadsafe(moved.set)

        unsubscribe = self.subscribe(wake)
        try:
            if since is None or self.version != since:
                return self.version
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(moved.wait(), max(0.0, timeout))
            return self.version
        finally:
            unsubscribe()

    # --- watching other processes -----------------------------------------------------------------
    def _ensure_watching(self) -> None:
        """Start the watcher if it is not running (call with ``_cond`` held). Its first reading is
        taken here, before anyone is told a version, so no commit falls in between; one made while
        it slept counts as a change."""
        if self.path is None or self._thread is not None or self._closed.is_set():
            return
        if self._read():
            self.notify()
        self._thread = threading.Thread(target=self._watch, name="gpupool-changes", daemon=True)
        self._thread.start()

    def _read(self) -> bool:
        """Read ``PRAGMA data_version`` on the watcher's own connection; whether it moved since the
        last reading (also when the file could not be read: a waiter then looks for itself)."""
        assert self.path is not None
        try:
            if self._conn is None:
                self._conn = sqlite3.connect(self.path, timeout=1.0, isolation_level=None, check_same_thread=False)
                self._seen = None
            version = int(self._conn.execute("PRAGMA data_version").fetchone()[0])
        except sqlite3.Error:
            # The file is being replaced or is briefly busy: open it afresh next time.
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
            self._conn, self._seen = None, None
            return True
        moved = self._seen is not None and version != self._seen
        self._seen = version
        return moved

    def _watch(self) -> None:
        """Poll ``PRAGMA data_version`` on a connection that never writes: it moves on every commit
        of every other connection to the file, this process's own included. Stops after
        :attr:`linger` seconds with nobody waiting or subscribed (the connection is kept)."""
        unwatched_since: float | None = None
        while not self._closed.wait(self.interval if self._conn is not None else max(self.interval, 1.0)):
            with self._cond:
                if self._read():
                    self.notify()
                if self._listeners or self._waiters:
                    unwatched_since = None
                    continue
                now = time.monotonic()
                unwatched_since = unwatched_since or now
                if now - unwatched_since >= self.linger:
                    self._thread = None
                    return

    def close(self) -> None:
        """Stop watching; every waiter returns."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)
        with self._cond:
            if self._conn is not None:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.close()
            self._conn = None


def wait_for_change(pool: object, since: int | None, timeout: float) -> int | None:
    """``pool.wait_for_change`` where the pool has one (a local pool, a broker's); else sleep
    ``timeout`` and answer None (a Slurm pool: the caller looks again after the pause)."""
    waiter = getattr(pool, "wait_for_change", None)
    if callable(waiter):
        result = waiter(since, timeout)
        return int(result) if result is not None else None
    time.sleep(max(0.0, timeout))
    return None


__all__ = ["DEFAULT_INTERVAL", "PoolChanges", "wait_for_change"]
