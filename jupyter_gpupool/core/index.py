"""Derived state of the live leases, kept up to date lease by lease.

Every decision needs the memory held per device, what each owner and group holds, which
requests wait, which leases have a reclaim pending and when the next heartbeat or booked slice
runs out. Recomputing those from every live lease made a decision cost what *exists*; the
:class:`LeaseIndex` is updated by :meth:`~jupyter_gpupool.core.engine.PoolState.touch` as each
lease changes, so a decision costs what *changed*. The pool keeps one index as long as its lease
cache lives (see ``Pool._load``); :meth:`LeaseIndex.recompute` rebuilds it from scratch, and the
state-machine tests check the two are equal after every step.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from typing import Any

from jupyter_gpupool.core.models import Lease, LeaseState, Transition

#: What one lease adds to the index: (state, owner, groups, memory, num_gpus, devices held,
#: reclaim pending, flagged, heartbeat deadline key, booked-slice end, transition under way,
#: bytes parked in host RAM, bytes per device used above the slice, bytes per device guaranteed,
#: bytes of the pinned parking pool set aside for its backup, and of those the bytes beyond its park).
_Entry = tuple[
    LeaseState, str, tuple[str, ...], int, int, tuple[str, ...], bool, bool, "float | None", "float | None", Transition, int,
    int, int, int, int,
]


def excess_per_device(lease: Lease) -> int:
    """Bytes per GPU a granted lease's kernel uses above its slice, as the watchdog last measured
    (0 when within it or unmeasured): memory that is taken, though no grant covers it. A slice
    whose burst was taken back counts what it held before, until a measurement after that showed
    its kernel within its new size (see :attr:`Lease.burst_from`)."""
    if lease.state is not LeaseState.GRANTED or not lease.devices:
        return 0
    measured = max(0, (lease.used_memory or 0) // len(lease.devices) - lease.memory)
    unconfirmed = lease.burst_from - lease.memory if lease.burst_taken_at is not None else 0
    return max(measured, unconfirmed)


def park_size(lease: Lease) -> int:
    """Bytes of host RAM a granted lease's GPU memory takes when it is parked or passes through
    host RAM on a move: its slice (all GPUs), or what the watchdog last measured its kernel
    holding when that is more (soft enforcement, an elastic slice using its burst)."""
    return max(lease.memory * max(1, lease.num_gpus), lease.used_memory or 0)


def pinned_ceiling(lease: Lease) -> int:
    """The most a lease's pinned backup may be: what its kernel's GPU memory takes parked now
    (:func:`park_size`: its slice's current size, or its measured use), or what it has parked. Never
    what it once held: a slice that shrank backs up no more than it may hold now."""
    return max(park_size(lease), lease.parked_memory)


def pinned_beside_park(lease: Lease) -> int:
    """Bytes of host RAM a lease's pinned backup takes beyond its parked memory: all of it while
    its kernel runs, what the backup holds above its park while parked (the backup is pinned
    whole, whatever was reported parked)."""
    return max(0, lease.pinned_backup - lease.parked_memory)


#: Seconds of slack when the heaps say nothing is due: float rounding of ``now - heartbeat`` vs
#: ``heartbeat + ttl`` never matters, the exact test runs whenever something is near due.
SLACK = 1e-3


def _entry(lease: Lease) -> _Entry | None:
    if lease.state is LeaseState.RELEASED:
        return None
    held = lease.state is LeaseState.GRANTED
    beat = end = None
    if lease.heartbeat_at is not None:
        if lease.holder_pid is None and lease.duration is not None:
            end = lease.expected_end  # a booked slice lasts its duration (None until granted)
        else:
            beat = lease.heartbeat_at
    return (
        lease.state,
        lease.owner,
        tuple(dict.fromkeys(lease.groups)),  # a group named twice counts once, as Engine.holdings
        lease.memory,
        lease.num_gpus,
        (tuple(lease.devices) + tuple(lease.migrate_from)) if held else (),  # a move holds both ends until done
        held and lease.reclaim_at is not None,
        held and bool(lease.flagged),
        beat,
        end,
        lease.transition,
        lease.parked_memory,
        excess_per_device(lease) if held else 0,
        lease.guarantee_size if held else 0,
        lease.pinned_backup,
        pinned_beside_park(lease),
    )


class LeaseIndex:
    """Memory held per device, holdings per owner and group, the queued and reclaiming leases,
    flagged leases and heartbeat / booked-slice deadlines of a set of live leases."""

    def __init__(self, leases: Iterable[Lease] = ()) -> None:
        self.entries: dict[str, _Entry] = {}
        #: device uuid → bytes taken by granted leases: each its slice, or what it uses when that is more (no zeros)
        self.held: dict[str, int] = {}
        #: device uuid → bytes granted leases there are guaranteed (their current size may be more: burst)
        self.guaranteed: dict[str, int] = {}
        self.owners: dict[str, list[int]] = {}  # owner → [bytes held, live non-queued leases]
        self.groups: dict[str, list[int]] = {}  # group → [bytes held by members, their live non-queued leases]
        self.queued: dict[str, None] = {}  # ids of queued leases
        self.reclaiming: dict[str, None] = {}  # ids of held leases with a reclaim (idle or preemption) pending
        self.flagged = 0  # held leases flagged (GPU lost)
        self.transitions: dict[str, Transition] = {}  # ids of leases being suspended, restored or moved
        self.parked = 0  # bytes of host RAM parked (or set aside for) suspended slices
        self.pinned = 0  # bytes of the host's pinned parking pool set aside for live leases' backups
        #: of ``pinned``, the bytes beyond what ``parked`` counts (:func:`pinned_beside_park`): host RAM beside it
        self.pinned_kept = 0
        self.kernels: dict[str, str] = {}  # kernel id → its live lease's id (a kernel has at most one)
        self._beats: list[tuple[float, str]] = []  # (heartbeat_at, id), stale entries dropped lazily
        self._ends: list[tuple[float, str]] = []  # (expected end, id) of booked slices
        for lease in leases:
            self.update(lease)

    @classmethod
    def recompute(cls, leases: Iterable[Lease]) -> LeaseIndex:
        return cls(leases)

    # --- upkeep -----------------------------------------------------------------------------------
    def update(self, lease: Lease) -> None:
        """Take ``lease`` as it is now (new, changed or released)."""
        new = _entry(lease)
        old = self.entries.get(lease.id)
        if lease.kernel_id:
            if new is not None:
                self.kernels[lease.kernel_id] = lease.id
            elif self.kernels.get(lease.kernel_id) == lease.id:
                del self.kernels[lease.kernel_id]
        if old is not None and new is not None and old[:8] == new[:8] and old[10:] == new[10:]:
            # Only its deadlines moved (a heartbeat, an activity report): the common case.
            self.entries[lease.id] = new
            if new[8] is not None and new[8] != old[8]:
                self._push(self._beats, (new[8], lease.id))
            if new[9] is not None and new[9] != old[9]:
                self._push(self._ends, (new[9], lease.id))
            return
        if old is not None:
            del self.entries[lease.id]
            self._apply(lease.id, old, -1)
        if new is not None:
            self.entries[lease.id] = new
            self._apply(lease.id, new, +1)

    def update_liveness(self, lease: Lease) -> None:
        """As :meth:`update`, for a lease whose liveness fields alone changed (an activity report,
        a heartbeat): at most its heartbeat deadline moved."""
        old = self.entries.get(lease.id)
        beat = lease.heartbeat_at
        if old is None or old[8] is None or beat is None:
            self.update(lease)  # a first heartbeat, or a booked slice's: the long way
        elif beat != old[8]:
            self.entries[lease.id] = (*old[:8], beat, *old[9:])
            self._push(self._beats, (beat, lease.id))

    def _apply(self, lease_id: str, entry: _Entry, sign: int) -> None:
        (state, owner, groups, memory, num_gpus, devices, reclaiming, flagged, beat, end, transition, parked, excess, guarantee,
         pinned, beside) = entry
        held_bytes = memory * num_gpus if state is LeaseState.GRANTED else 0
        if state is LeaseState.QUEUED:
            if sign > 0:
                self.queued[lease_id] = None
            else:
                del self.queued[lease_id]
        else:
            for table, key in [(self.owners, owner), *((self.groups, group) for group in groups)]:
                row = table.setdefault(key, [0, 0])
                row[0] += sign * held_bytes
                row[1] += sign
                if row == [0, 0]:
                    del table[key]
        for uuid in devices:
            total = self.held.get(uuid, 0) + sign * (memory + excess)
            if total:
                self.held[uuid] = total
            else:
                self.held.pop(uuid, None)
            promised = self.guaranteed.get(uuid, 0) + sign * guarantee
            if promised:
                self.guaranteed[uuid] = promised
            else:
                self.guaranteed.pop(uuid, None)
        if reclaiming:
            if sign > 0:
                self.reclaiming[lease_id] = None
            else:
                del self.reclaiming[lease_id]
        self.flagged += sign * flagged
        self.parked += sign * parked
        self.pinned += sign * pinned
        self.pinned_kept += sign * beside
        if transition is not Transition.NONE:
            if sign > 0:
                self.transitions[lease_id] = transition
            else:
                del self.transitions[lease_id]
        if sign > 0:
            if beat is not None:
                self._push(self._beats, (beat, lease_id))
            if end is not None:
                self._push(self._ends, (end, lease_id))

    def _push(self, heap: list[tuple[float, str]], item: tuple[float, str]) -> None:
        heapq.heappush(heap, item)
        if len(heap) > 2 * len(self.entries) + 64:  # mostly stale entries: rebuild
            position = 8 if heap is self._beats else 9
            rebuilt: list[tuple[float, str]] = []
            for lease_id, entry in self.entries.items():
                key = entry[position]
                if isinstance(key, float | int) and not isinstance(key, bool):
                    rebuilt.append((float(key), lease_id))
            heap[:] = rebuilt
            heapq.heapify(heap)

    def _earliest(self, heap: list[tuple[float, str]], position: int) -> float | None:
        while heap:
            key, lease_id = heap[0]
            entry = self.entries.get(lease_id)
            if entry is not None and entry[position] == key:
                return key
            heapq.heappop(heap)  # released or changed since
        return None

    # --- questions --------------------------------------------------------------------------------
    def nothing_expires(self, now: float, heartbeat_ttl: float) -> bool:
        """True when surely no heartbeat is older than ``heartbeat_ttl`` and no booked slice is over
        at ``now`` (False means: look, something may be)."""
        beat = self._earliest(self._beats, 8)
        if beat is not None and now - beat > heartbeat_ttl - SLACK:
            return False
        end = self._earliest(self._ends, 9)
        return end is None or end > now + SLACK

    def holdings(self, owner: str | None = None, group: str | None = None) -> tuple[int, int]:
        """As :meth:`Engine.holdings`: (bytes held, live non-queued leases) of an owner or a group."""
        row = self.owners.get(owner or "") if owner is not None else self.groups.get(group or "") if group is not None else None
        return (row[0], row[1]) if row else (0, 0)

    def snapshot(self) -> dict[str, Any]:
        """Everything the index answers, comparable with ``==`` (for the tests)."""
        return {
            "held": dict(self.held),
            "guaranteed": dict(self.guaranteed),
            "owners": {k: tuple(v) for k, v in self.owners.items()},
            "groups": {k: tuple(v) for k, v in self.groups.items()},
            "queued": set(self.queued),
            "reclaiming": set(self.reclaiming),
            "flagged": self.flagged,
            "transitions": dict(self.transitions),
            "parked": self.parked,
            "pinned": (self.pinned, self.pinned_kept),
            "kernels": dict(self.kernels),
            "beats": {lease_id: e[8] for lease_id, e in self.entries.items() if e[8] is not None},
            "ends": {lease_id: e[9] for lease_id, e in self.entries.items() if e[9] is not None},
            "earliest": (self._earliest(self._beats, 8), self._earliest(self._ends, 9)),
        }
