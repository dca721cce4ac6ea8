"""Each caller's view version for the broker's ``GET /api/gpupool/changes`` long poll.

Every Jupyter server behind a broker keeps one ``/changes`` poll open, and every commit to the
pool (a decision, but also each heartbeat and activity report) is a pool change. If each poll
looked at its caller's leases itself, N waiting servers would cost N lease reads per change, one
after another on the broker's one worker thread, ahead of every other request.

Here one listener hears the pool change and works out, in one job on the worker thread, the view
version of each caller that waits: on a local pool one pass over its lease cache for all of them,
else one lease read per distinct caller; changes heard while it runs fold into its next round. A
version is kept with the pool's change counter it was read at
(:attr:`~jupyter_gpupool.backends.changes.PoolChanges.version`), so it is served again only while
the pool has not changed since; and only the polls whose caller's view moved are woken. Polls that
look at a caller's version while it is being read (many ending at once, as they time out together
after a change) share that read rather than each starting one of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_gpupool.rest.views import view_version

#: Seconds between two looks at a pool that cannot tell when it changed (no change counter).
UNTOLD_POLL = 1.0


class CallerViewVersions:
    """The view version of each caller (a lease owner), read once per pool change for all its polls.

    ``pool`` is the broker's pool; ``run`` runs a blocking call on the broker's worker thread.
    Use it from the broker's event loop only.
    """

    def __init__(self, pool: Any, run: Callable[..., Awaitable[Any]]) -> None:
        self.pool = pool
        self._run = run
        #: The pool's change counter (None: a pool that cannot tell; then every look reads).
        self._changes: Any = getattr(pool, "changes", None)
        #: owner -> (the pool's change counter when that owner's leases were read, their view version).
        self._known: dict[str, tuple[int, int]] = {}
        #: owner -> resolved when that owner's view version moved; and how many polls wait for it.
        self._moved: dict[str, asyncio.Future[None]] = {}
        self._waiting: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._round: asyncio.Task[None] | None = None
        #: owner -> (the pool's change counter when a read of that owner began, the read in flight).
        self._reading: dict[str, tuple[int, asyncio.Future[tuple[int, dict[str, int]]]]] = {}
        #: How many callers' views were read so far (what pool changes cost; tests read it).
        self.reads = 0

    # --- what a poll calls ------------------------------------------------------------------------
    async def version(self, owner: str) -> int:
        """``owner``'s view version now: the one kept if the pool did not change since it was read."""
        changes = self._changes
        known = self._known.get(owner)
        if changes is not None and known is not None and known[0] == changes.version:
            return known[1]
        if changes is None:  # a pool that cannot tell: every look reads
            return (await self._run(self._read, [owner]))[1][owner]
        reading = self._reading.get(owner)
        if reading is None or reading[0] < changes.version:  # none in flight that began after the last change
            reading = self._start_read([owner])[owner]
        at, versions = await asyncio.shield(reading[1])
        self._keep(at, versions)
        return self._known[owner][1]

    async def wait(self, owner: str, since: int | None, timeout: float) -> int:
        """Wait until ``owner``'s view version is not ``since`` or ``timeout`` seconds passed; the
        version now. ``since`` None answers at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._changes is None:  # a pool that cannot tell: look again now and then
            while True:
                mine = await self.version(owner)
                left = deadline - loop.time()
                if since is None or mine != since or left <= 0:
                    return mine
                await asyncio.sleep(min(left, UNTOLD_POLL))
        self._follow(loop)
        self._waiting[owner] += 1  # before the first look: a round from now on reads this owner too
        try:
            while True:
                mine = await self.version(owner)
                left = deadline - loop.time()
                if since is None or mine != since or left <= 0:
                    return mine
                moved = self._moved.get(owner)
                if moved is None or moved.done():
                    moved = self._moved[owner] = loop.create_future()
                known = self._known.get(owner)
                if known is None or known[1] != since:
                    continue  # a round moved it while this poll looked: look again
                self._start_round()  # a change heard before this poll waited is read now
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(moved), left)
        finally:
            self._waiting[owner] -= 1
            if self._waiting[owner] <= 0:
                del self._waiting[owner]
                moved = self._moved.pop(owner, None)
                if moved is not None and not moved.done():
                    moved.cancel()

    def polls_waiting(self) -> int:
        """How many polls wait now, every caller's together."""
        return sum(self._waiting.values())

    def close(self) -> None:
        """Stop hearing the pool's changes (the broker stops)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._round is not None:
            self._round.cancel()

    # --- rounds -----------------------------------------------------------------------------------
    def _follow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hear every pool change from now on (subscribed once, for the broker's life)."""
        if self._unsubscribe is not None:
            return
        self._loop = loop

        def heard() -> None:  # any thread: the committing one, or the pool file's watcher
            with contextlib.suppress(RuntimeError):  # the loop closed: the broker stopped
                loop.call_soon_threadsafe(self._start_round)

        self._unsubscribe = self._changes.subscribe(heard)

    def _start_round(self) -> None:
        """Read the waiting callers whose version is older than the pool's change (unless a round runs)."""
        if self._round is None or self._round.done():
            self._round = asyncio.ensure_future(self._rounds())

    async def _rounds(self) -> None:
        while True:
            now = self._changes.version
            stale = [
                owner for owner in self._waiting
                if self._known.get(owner, (None,))[0] != now and self._reading.get(owner, (-1,))[0] < now
            ]  # fmt: skip
            if not stale:
                return  # read, or being read since the last change (that read keeps and wakes)
            try:
                at, versions = await asyncio.shield(self._start_read(stale)[stale[0]][1])
            except Exception:  # noqa: BLE001 -- the pool could not be read: each poll looks for itself and answers its error
                for owner in stale:
                    self._wake(owner)
                return
            self._keep(at, versions)
            self._forget_unwatched(at)

    def _start_read(self, owners: list[str]) -> dict[str, tuple[int, asyncio.Future[tuple[int, dict[str, int]]]]]:
        """One read of ``owners`` on the worker thread, which any look at their versions joins
        until it ends; what it read is kept (and wakes the polls whose caller's view moved) even
        if whoever started it stopped waiting."""
        began = self._changes.version
        read: asyncio.Future[tuple[int, dict[str, int]]] = asyncio.ensure_future(self._run(self._read, owners))

        def ended(done: asyncio.Future[tuple[int, dict[str, int]]]) -> None:
            for owner in owners:
                if self._reading.get(owner, (0, None))[1] is done:
                    del self._reading[owner]
            if not done.cancelled() and done.exception() is None:
                self._keep(*done.result())

        read.add_done_callback(ended)
        for owner in owners:
            self._reading[owner] = (began, read)
        return {owner: (began, read) for owner in owners}

    def _read(self, owners: list[str]) -> tuple[int, dict[str, int]]:
        """Worker thread: the pool's change counter, then each owner's view version. The counter is
        read first, so what is kept under it is at least as new as it."""
        at = self._changes.version if self._changes is not None else 0
        self.reads += len(owners)
        many = getattr(self.pool, "live_leases_of", None)
        if callable(many):  # a local pool: one pass over its lease cache for every owner
            return at, {owner: view_version(leases) for owner, leases in many(owners).items()}
        return at, {owner: view_version(self.pool.leases(owner=owner)) for owner in owners}

    def _keep(self, at: int, versions: dict[str, int]) -> None:
        """Keep versions read at change ``at``, and wake the polls of each owner whose version moved."""
        for owner, version in versions.items():
            known = self._known.get(owner)
            if known is not None and known[0] > at:
                continue  # a newer reading is kept already
            self._known[owner] = (at, version)
            if known is not None and known[1] != version:
                self._wake(owner)

    def _wake(self, owner: str) -> None:
        moved = self._moved.pop(owner, None)
        if moved is not None and not moved.done():
            moved.set_result(None)

    def _forget_unwatched(self, at: int) -> None:
        """Drop the versions of callers no poll waits for that are older than change ``at``: read
        again on their next poll anyway, and a broker's life sees many callers come and go."""
        for owner in [o for o, (read_at, _) in self._known.items() if read_at < at and o not in self._waiting]:
            del self._known[owner]


__all__ = ["CallerViewVersions"]
