"""How many long polls each caller holds open on the broker, bounded per caller.

A grant wait (``GET .../leases/{id}/wait``) and a change poll (``GET /api/gpupool/changes``) each
keep a connection and a waiter open for up to a minute. A Jupyter server needs one change poll and
one wait per queued kernel; a client that opens thousands (a valid token is enough) would use up
the broker's file descriptors and stop every other user's server from reaching it. Beyond the
bound a poll is answered at once with 429, which clients ride out with backoff.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from jupyter_gpupool.errors import TooManyWaits


class OpenWaits:
    """Counts each caller's open long polls; ``limit()`` (0: no bound) is read at each entry."""

    def __init__(self, limit: Callable[[], int]) -> None:
        self._limit = limit
        self._open: dict[str, int] = {}

    def count(self, caller: str) -> int:
        """Long polls ``caller`` holds open now."""
        return self._open.get(caller, 0)

    @contextmanager
    def held(self, caller: str) -> Iterator[None]:
        """One open long poll of ``caller`` for the ``with`` block; :class:`TooManyWaits` when it
        already holds as many as one caller may."""
        limit, now = self._limit(), self.count(caller)
        if limit > 0 and now >= limit:
            raise TooManyWaits(
                f"user {caller} already holds {now} open waits on the GPU pool broker (grant waits and change "
                f"polls), the most one user may (c.Broker.max_waits_per_user = {limit}); it looks again once one answers"
            )
        self._open[caller] = now + 1
        try:
            yield
        finally:
            left = self._open[caller] - 1
            if left:
                self._open[caller] = left
            else:
                del self._open[caller]


__all__ = ["OpenWaits"]
