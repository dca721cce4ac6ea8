"""Fair-share usage and the history statistics a decision needs, as a Store last read them: kept
up to date with the store's own commits instead of being read again each decision."""

from __future__ import annotations

import bisect
import collections
from collections.abc import Iterator, Mapping
from typing import Any

#: A typical hold not read yet.
UNKNOWN: Any = object()


def median_hold(held_sorted: list[float]) -> float | None:
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


class UsageHistory:
    """The history statistics a decision needs, as last read (see :meth:`Store.history`); a part
    set to None (``UNKNOWN`` for the typical hold) is read again from SQLite when next needed."""

    SAMPLE = 200  # leases in the recent request sizes, as Store.recent_request_sizes

    def __init__(self, version: int | None, read_at: float) -> None:
        self.version, self.read_at = version, read_at
        self.usage_rows: dict[str, tuple[float, float]] | None = None
        self.typical_hold: Any = UNKNOWN
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
        if self.typical_hold is UNKNOWN or holds is None or (holds and end < holds[-1][0]):
            self.forget_typical_hold()
            return
        if len(holds) == holds.maxlen:  # the oldest leaves the sample
            del self.held_sorted[bisect.bisect_left(self.held_sorted, holds[0][1])]
        holds.append((end, held))
        bisect.insort(self.held_sorted, held)
        self.typical_hold = median_hold(self.held_sorted)

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
        self.typical_hold = UNKNOWN
        self.holds = None

    def forget_reservations(self) -> None:
        self.reservations = None


def decay(value: float, elapsed: float, half_life: float) -> float:
    """``value`` after ``elapsed`` seconds of exponential decay with ``half_life``."""
    if half_life <= 0:
        return value
    return value * 0.5 ** (max(0.0, elapsed) / half_life)
