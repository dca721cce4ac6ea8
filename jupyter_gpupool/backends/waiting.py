"""Waiting for a grant: one loop for every pool (local, broker, Slurm), sync and async callers.

The loop is written once, as a generator that says what to do next (:class:`Step`: ask the
pool; :class:`Pause`: sleep) and is driven either by :func:`run_blocking` (``time.sleep``, the
call in this thread) or by :func:`run_async` (``asyncio.sleep``, the call in a worker thread so the
event loop never waits on SQLite, HTTP or ``squeue``). A pool mixes in :class:`GrantWaiting` and
says only what differs: how one look at the lease is taken, how long to pause between looks,
and what an outage of the pool means (give up at once, or back off and ride it out).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo
from jupyter_gpupool.errors import PoolUnavailable

UpdateCallback = Callable[[Lease, "QueueInfo | None"], None]


@dataclass(frozen=True)
class Step:
    """Call ``function(*args)`` (the only blocking work) and send back its result."""

    function: Callable[..., tuple[Lease, QueueInfo | None]]
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Pause:
    """Sleep this many seconds."""

    seconds: float


WaitLoop = Generator["Step | Pause", Any, Lease]


def _advance(loop: WaitLoop, reply: Any, error: BaseException | None) -> tuple[Step | Pause | None, Lease | None]:
    """Hand the last answer (or the pool's error) to the loop: its next order, or (None, the lease) when done."""
    try:
        return (loop.throw(error) if error is not None else loop.send(reply)), None
    except StopIteration as done:
        return None, done.value


def run_blocking(loop: WaitLoop) -> Lease:
    """Drive a wait loop in this thread."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        order, lease = _advance(loop, reply, error)
        reply, error = None, None
        if order is None:
            return lease  # type: ignore[return-value]
        if isinstance(order, Pause):
            time.sleep(order.seconds)
            continue
        try:
            reply = order.function(*order.args)
        except PoolUnavailable as err:
            error = err


async def run_async(loop: WaitLoop) -> Lease:
    """Drive a wait loop on the event loop: each look in a worker thread, pauses as ``asyncio.sleep``."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        order, lease = _advance(loop, reply, error)
        reply, error = None, None
        if order is None:
            return lease  # type: ignore[return-value]
        if isinstance(order, Pause):
            await asyncio.sleep(order.seconds)
            continue
        try:
            reply = await asyncio.to_thread(order.function, *order.args)
        except PoolUnavailable as err:
            error = err


class GrantWaiting:
    """``wait_for_grant`` / ``await_grant`` for a pool that implements :meth:`_look_at_request`
    (and, where they differ from the defaults, :meth:`_pause_between_looks` and :meth:`_on_outage`)."""

    #: How a waiting request is called in a timeout's message ("queued", or "pending" for a Slurm job).
    waiting_word = "queued"

    #: ``(lease_id, last QueueInfo or None, deadline) -> (lease, QueueInfo or None)``: the lease and its
    #: place in the queue now, raising RequestRefused if it was released. Every pool defines it
    #: (checked when the class is made, so a pool without it never imports).
    _look_at_request: Callable[[str, QueueInfo | None, float | None], tuple[Lease, QueueInfo | None]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not callable(getattr(cls, "_look_at_request", None)):
            raise TypeError(f"{cls.__name__} waits for grants (GrantWaiting) but defines no _look_at_request")

    def _pause_between_looks(self, poll: float) -> float:
        """Seconds between two looks (0 where a look itself waits, as a broker's long poll does)."""
        return poll

    def _outage_state(self, lease_id: str, deadline: float | None, poll: float) -> Any:
        """Per-wait state for :meth:`_on_outage` (a backoff), made once per wait."""
        return None

    def _on_outage(
        self,
        err: PoolUnavailable,
        outage: Any,
        last: tuple[Lease, QueueInfo | None] | None,
        on_update: UpdateCallback | None,
        deadline: float | None,
    ) -> float:
        """The pool did not answer: seconds to wait before the next look, or raise. Default: raise."""
        raise err

    def _grant_loop(self, lease_id: str, timeout: float | None, poll: float, on_update: UpdateCallback | None) -> WaitLoop:
        deadline = None if timeout is None else time.monotonic() + timeout
        outage = self._outage_state(lease_id, deadline, poll)
        last: tuple[Lease, QueueInfo | None] | None = None
        while True:
            try:
                lease, info = yield Step(self._look_at_request, (lease_id, last[1] if last else None, deadline))
            except PoolUnavailable as err:
                delay = self._on_outage(err, outage, last, on_update, deadline)
                if deadline is not None and time.monotonic() + delay >= deadline:
                    raise TimeoutError(f"still {self.waiting_word} after {timeout:.0f} s (the pool was unavailable: {err})") from None
                yield Pause(delay)
                continue
            if outage is not None and hasattr(outage, "reset"):
                outage.reset()
            last = (lease, info)
            if lease.state is LeaseState.GRANTED:
                return lease
            if on_update is not None:
                on_update(lease, info)
            if deadline is not None and time.monotonic() >= deadline:
                position = info.position if info else None
                raise TimeoutError(f"still {self.waiting_word} after {timeout:.0f} s (position {position or '?'})")
            pause = self._pause_between_looks(poll)
            if pause > 0:
                yield Pause(pause)

    def wait_for_grant(
        self, lease_id: str, timeout: float | None = None, poll: float = 0.5, on_update: UpdateCallback | None = None
    ) -> Lease:
        """Block until the lease is granted (its holder keeps it alive while it waits). Raises
        TimeoutError after ``timeout`` seconds, or RequestRefused if it is released meanwhile."""
        return run_blocking(self._grant_loop(lease_id, timeout, poll, on_update))

    async def await_grant(
        self, lease_id: str, timeout: float | None = None, poll: float = 0.5, on_update: UpdateCallback | None = None
    ) -> Lease:
        """Async twin of :meth:`wait_for_grant`: the event loop never waits on the pool."""
        return await run_async(self._grant_loop(lease_id, timeout, poll, on_update))


__all__ = ["GrantWaiting", "Pause", "Step", "run_async", "run_blocking"]
