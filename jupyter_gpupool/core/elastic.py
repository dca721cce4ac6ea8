"""Elastic slices: growth on demand into memory nobody is guaranteed, the line of kernels
waiting to grow, and burst taken back when a request, a reserve or a neighbour needs the room."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.capacity import free_by_device, free_less, hold_back, lowered, room_at_guarantees
from jupyter_gpupool.core.index import excess_per_device
from jupyter_gpupool.core.models import Decision, DecisionKind, Lease, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.state import HELD_STATES, PoolState, decision
from jupyter_gpupool.core.transitions import Transitions
from jupyter_gpupool.errors import RequestRefused
from jupyter_gpupool.units import MIB, format_size

#: How a lease's ``burst_note`` begins once the pool took its burst back.
BURST_TAKEN = "burst taken back"
#: Share of its current size a kernel's measured use must reach before its elastic slice grows.
GROW_WHEN_USED = 0.9


def size_generation(lease: Lease) -> tuple[float, int, float, int]:
    """Orders reads of one lease by the changes of its size: of two reads, the one with the smaller
    generation was read before the other's change (a stale read), whatever size it says. A size
    changes only in :meth:`Elastic.set_size`, which counts each change of a grant in
    ``memory_history``; a new request of its kernel (``created_at``), a suspend (``suspensions``)
    and each grant (``granted_at``) start that count again, later than all before."""
    return (lease.created_at, lease.suspensions, lease.granted_at or 0.0, len(lease.memory_history))


def grow_wanters(state: PoolState) -> list[Lease]:
    """Granted kernels waiting for their slice to grow, in line order."""
    wanters = [lease for lease in state.leases.values() if lease.grow_since is not None]
    return sorted(wanters, key=lambda lease: (lease.line_time, lease.id))


def reserve_wanters(state: PoolState) -> list[Lease]:
    """Granted kernels whose reserve waits for burst beside them to be taken back, in line order."""
    wanters = [lease for lease in state.leases.values() if lease.reserve_wanted]
    return sorted(wanters, key=lambda lease: (lease.reserve_since if lease.reserve_since is not None else 0.0, lease.id))


class Elastic:
    """Grows elastic slices and takes burst back."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, transitions: Transitions) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.transitions = transitions

    def set_size(self, state: PoolState, lease: Lease, memory: int, now: float) -> None:
        """Change a lease's current size, keeping what metering needs: each size's time."""
        if memory == lease.memory:
            return
        if lease.state is LeaseState.GRANTED:
            lease.memory_history = (*lease.memory_history, (now, lease.memory))
        lease.memory = memory
        state.touch(lease)

    def _waiting_for(self, state: PoolState, lease: Lease, in_line: bool = False) -> list[Lease]:
        """Queued requests that would fit on one of ``lease``'s GPUs if every slice there were at
        its guarantee (``in_line``: only those the pool is taking burst back for, which a kernel
        waiting to grow yields to): burst never takes their room. A request that does not fit even
        then waits for a guarantee to end, not for burst."""
        mine = set(lease.devices)
        waiting = [other for other in reserve_wanters(state) if other.id != lease.id and mine & set(other.devices)]
        room: dict[str, int] | None = None
        for lease_id in state.derived().queued:
            other = state.leases[lease_id]
            if other.id == lease.id or (in_line and other.room_coming_at is None):
                continue
            if room is None:
                room = room_at_guarantees(state)
            if any(d.uuid in mine and room.get(d.uuid, 0) >= other.memory for d in self.placer.lease_candidates(state, other)):
                waiting.append(other)
        return waiting

    def _others_on(self, state: PoolState, lease: Lease) -> tuple[int, int]:
        """(other granted slices, bytes they are guaranteed) on ``lease``'s GPUs, for the user."""
        mine = set(lease.devices)
        others = [o for o in state.leases.values() if o.id != lease.id and o.state in HELD_STATES and mine & set(o.devices)]
        return len(others), sum(o.guarantee_size * len(mine & set(o.devices)) for o in others)

    def grow(self, state: PoolState, lease_id: str, needed: int, now: float, queue: bool = True) -> Decision | None:
        """Grow an elastic slice so its kernel can hold ``needed`` bytes (all its GPUs together), by
        at least ``PoolPolicy.burst_step``, up to its limit, into memory nobody is guaranteed.
        None when it is that large already; raises :class:`RequestRefused` saying why it cannot.

        A kernel that asks to grow holds its GPU and cannot run its cell: it goes before the queued
        requests, but for those the pool is taking burst back for (:attr:`Lease.room_coming_at`).
        ``queue``: a grow refused for room waits in line (``grow_wanted``), in the order it was
        asked, and the scheduler serves it in place, by a move or from neighbours' idle burst; a
        grow the watchdog asks ahead of need (``queue=False``) yields to every waiting request."""
        lease = self.accounting.get(state, lease_id)
        gpus = max(1, lease.num_gpus)
        wanted = -(-max(0, needed) // gpus)
        if wanted <= lease.memory:
            return None
        size = format_size(lease.memory)
        if lease.state is not LeaseState.GRANTED or lease.transition is not Transition.NONE:
            raise RequestRefused(f"the slice was not grown: the kernel is not running on a GPU right now ({lease.state.value})")
        if not lease.elastic:
            why = "the pool's slices are fixed (PoolPolicy.burst = 0)" if self.policy.burst == "0" else "it was asked for as a fixed slice"
            raise RequestRefused(f"the slice was not grown: it is fixed at {size} ({why}); ask for more with %gpupool reserve")
        limit = lease.limit_size
        if wanted > limit:
            raise RequestRefused(
                f"the slice was not grown: it needs {format_size(wanted * gpus)} but its limit is {format_size(limit * gpus)}; "
                "free memory, or ask for a larger limit (%gpupool reserve SIZE --limit LIMIT)"
            )
        waiting = self._waiting_for(state, lease, in_line=queue)
        if waiting:
            asked = sum(w.memory * w.num_gpus for w in waiting)
            self._want_growth(state, lease, wanted, now, queue)
            why = (
                f"burst is taken back on this GPU for {len(waiting)} waiting request(s) ({format_size(asked)}), and a grow never takes that room"
                if queue
                else f"{len(waiting)} request(s) wait for this GPU ({format_size(asked)}), and burst never takes their room"
            )
            raise RequestRefused(f"the slice was not grown: {why}; it stays {size}")
        result = self._grow_into(state, lease, wanted, free_by_device(state, lease), now)
        if isinstance(result, str):
            if result.startswith("the slice was not grown: the GPU is full"):
                self._want_growth(state, lease, wanted, now, queue)
            raise RequestRefused(result)
        return result

    def _want_growth(self, state: PoolState, lease: Lease, wanted: int, now: float, queue: bool) -> None:
        """Record a grow refused for room: it waits in line (see :meth:`serve_growth`)."""
        if not queue:
            return
        lease.grow_wanted = max(wanted, lease.grow_wanted if lease.grow_since is not None else 0)
        if lease.grow_since is None:
            lease.grow_since = now
        state.touch(lease)

    @staticmethod
    def _grow_wanted_done(state: PoolState, lease: Lease) -> None:
        if lease.grow_wanted or lease.grow_since is not None:
            lease.grow_wanted, lease.grow_since = 0, None
            state.touch(lease)

    def _grow_into(self, state: PoolState, lease: Lease, wanted: int, free: Mapping[str, int], now: float) -> Decision | str:
        """Grow ``lease`` to at least ``wanted`` bytes per GPU out of ``free``: the GROW decision, or why not."""
        gpus = max(1, lease.num_gpus)
        size = format_size(lease.memory)
        limit = lease.limit_size
        largest = max((d.leasable for d in state.devices if d.uuid in lease.devices), default=limit)
        step = self.policy.burst_step_bytes(largest)
        target = min(limit, max(wanted, lease.memory + step))
        target = min(limit, -(-target // MIB) * MIB)
        room = min((free.get(uuid, 0) for uuid in lease.devices), default=0) + excess_per_device(lease)
        if lease.memory + room < wanted:
            count, guaranteed = self._others_on(state, lease)
            return (
                f"the slice was not grown: the GPU is full ({count} other slice(s) there are guaranteed "
                f"{format_size(guaranteed)}); it stays {size}"
            )
        target = min(target, lease.memory + max(0, room))
        for who, quota in self.quotas.limits(lease.owner, lease.groups):
            held, _ = self.quotas.holdings(state, owner=lease.owner) if who == "your" else self.quotas.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + (target - lease.memory) * gpus > quota.maximum:
                most = lease.memory + max(0, quota.maximum - held) // gpus
                if most < wanted:
                    return f"the slice was not grown: {who} maximum quota is {format_size(quota.maximum)}; it stays {size}"
                target = most
        self.set_size(state, lease, target, now)
        lease.burst_taken_at, lease.burst_from = None, 0
        lease.over_limit_since = None
        if target >= lease.grow_wanted:
            lease.grow_wanted, lease.grow_since = 0, None
        lease.burst_note = (
            f"grown to {format_size(target * gpus)} on demand ({format_size(lease.guarantee_size * gpus)} guaranteed, "
            f"up to {format_size(limit * gpus)})"
        )
        state.touch(lease)
        return decision(DecisionKind.GROW, lease, lease.burst_note, now)

    def grow_place(self, state: PoolState, lease_id: str, now: float) -> int | None:
        """1-based place in line of a kernel waiting to grow, counting only who the scheduler
        serves before it and who could take room on its GPUs: queued requests ahead of its turn
        (not held back by quota) and kernels that wait to grow and joined the line before it.
        None when it does not wait to grow."""
        lease = self.accounting.get(state, lease_id)
        if lease.grow_since is None:
            return None
        mine = set(lease.devices)
        # Requests the pool takes burst back for, that would fit at guarantees on its GPUs, come first.
        ahead = sum(1 for other in self._waiting_for(state, lease, in_line=True) if not self.quotas.block_reason(state, other))
        for other in grow_wanters(state):
            if other.id == lease.id:
                break
            ahead += bool(mine & set(other.devices))
        return ahead + 1

    def serve_growth(self, state: PoolState, lease: Lease, held_back: dict[str, int], now: float) -> list[Decision]:
        """Serve a kernel waiting for its slice to grow, in its turn: in place when its GPU has the
        room nobody is guaranteed; else moved (live, through host RAM) to a GPU of the same model
        with room for what it needs; else from its neighbours' burst where they are idle or hold
        more than they use (never anyone's guarantee). Room it still waits for is held back from
        requests behind it (``held_back``)."""
        if lease.state is not LeaseState.GRANTED or not lease.elastic or lease.transition in (Transition.SUSPENDING, Transition.RESTORING):
            self._grow_wanted_done(state, lease)
            return []
        wanted = min(lease.grow_wanted, lease.limit_size)
        if wanted <= lease.memory:
            self._grow_wanted_done(state, lease)
            return []
        if lease.transition is Transition.MIGRATING:  # on its way to a GPU with room: keep that room
            hold_back(held_back, lease, wanted)
            return []
        if self._waiting_for(state, lease, in_line=True):
            return []  # a request that burst is taken back for, and that fits at guarantees, goes first
        free = free_less(free_by_device(state, lease), held_back)
        grown = self._grow_into(state, lease, wanted, free, now)
        if not isinstance(grown, str):
            return [grown]
        if not grown.startswith("the slice was not grown: the GPU is full"):
            lease.burst_note = grown
            self._grow_wanted_done(state, lease)  # its limit or quota: waiting does not help
            return []
        moved = self.transitions.move_to_grow(state, lease, wanted, free, now)
        if moved is not None:
            hold_back(held_back, lease, wanted)
            return [moved]
        decisions = self._take_neighbours_burst(state, lease, wanted, free, now)
        hold_back(held_back, lease, wanted)
        return decisions

    def _take_neighbours_burst(self, state: PoolState, lease: Lease, wanted: int, free: Mapping[str, int], now: float) -> list[Decision]:
        """Take back burst from slices beside ``lease`` that are idle (down to their guarantee: an idle
        kernel still above it is suspended) or hold more than they use (down to their use), when that
        makes the room ``lease`` waits for. Never below anyone's guarantee."""
        if lease.num_gpus != 1:
            return []
        home = lease.devices[0]
        missing = wanted - lease.memory - max(0, free.get(home, 0)) - excess_per_device(lease)
        if missing <= 0:
            return []
        givers: list[tuple[Lease, int]] = []
        for other in state.leases.values():
            if (other.id == lease.id or other.state is not LeaseState.GRANTED or other.devices != (home,)
                    or other.transition is not Transition.NONE or other.reclaim_at is not None
                    or other.burst_taken_at is not None or other.grow_since is not None):
                continue
            taken = other.memory + excess_per_device(other)
            floor = other.guarantee_size
            if not (self.accounting.still_idle(other, now) and not self.transitions.suspend_refusal(state, other)):
                floor = max(floor, other.used_memory or taken)  # busy: only what it holds and does not use
            if taken > floor:
                givers.append((other, taken - floor))
        if sum(give for _, give in givers) < missing:
            return []
        decisions = []
        for other, give in sorted(givers, key=lambda item: -item[1]):
            if missing <= 0:
                break
            taken = other.memory + excess_per_device(other)
            new_size = min(other.memory, max(other.guarantee_size, taken - min(give, missing)))
            missing -= min(give, missing)
            decisions.append(self.take_burst_back(state, other, new_size, f"a neighbour's slice that needs {format_size(wanted)}", now))
        return decisions

    def take_burst_back(self, state: PoolState, lease: Lease, new_size: int, taken_for: str, now: float) -> Decision:
        """Lower ``lease`` to ``new_size`` bytes per GPU for ``taken_for`` (its kernel frees caches and
        lowers its caps to it): a SHRINK decision. What its kernel still holds above the new size
        stays taken (see :func:`~jupyter_gpupool.core.capacity.lowered`)."""
        gpus = max(1, lease.num_gpus)
        before = max(lease.memory, lease.burst_from if lease.burst_taken_at is not None else 0)
        self.set_size(state, lease, new_size, now)
        lowered(state, lease, before)
        lease.burst_taken_at = now
        lease.burst_note = (
            f"{BURST_TAKEN} for {taken_for}: the slice is {format_size(new_size * gpus)} now "
            f"({format_size(lease.guarantee_size * gpus)} guaranteed)"
        )
        state.touch(lease)
        return decision(DecisionKind.SHRINK, lease, lease.burst_note, now)

    def plan_burst_reclaims(self, state: PoolState, head: Lease, now: float, spare: Collection[str] = (),
                             held_back: Mapping[str, int] | None = None) -> tuple[list[Decision], bool]:
        """Make room for ``head`` from other slices' burst, before anyone's guarantee: lower their
        size toward their guarantee (their kernels free framework caches and lower caps to it).
        Spared: ``spare`` (grown in this pass) and kernels whose grow was asked before ``head``; a
        busy kernel gives its burst back too (warned by the watchdog if it does not, never killed).
        ``held_back``: room kernels waiting to grow wait for, which ``head`` may not take (burst taken
        back for ``head`` is its own: they yield it, :attr:`Lease.room_coming_at`). Returns the
        decisions and whether room for ``head`` is on its way (it may be granted already)."""
        free = free_less(free_by_device(state, head), held_back or {})
        coming = dict(free)
        burst_on: dict[str, list[Lease]] = {}
        for lease in state.leases.values():
            if lease.state is not LeaseState.GRANTED or lease.transition is not Transition.NONE or lease.reclaim_at is not None:
                continue
            if lease.id in spare or lease.line_time < head.queued_since:
                continue  # a grow asked before ``head`` keeps its turn: burst goes to who asked first
            taken = lease.memory + excess_per_device(lease)
            above = taken - lease.guarantee_size
            if above <= 0:
                continue
            for uuid in lease.devices:
                coming[uuid] = coming.get(uuid, 0) + above
                burst_on.setdefault(uuid, []).append(lease)
        if not burst_on:
            return [], False
        devices = self.placer.place(state, head, coming)
        if devices is None:
            return [], False  # even every slice at its guarantee leaves no room: the pool's other means
        decisions = []
        for uuid in devices:
            missing = head.memory - free.get(uuid, 0)
            for lease in sorted(burst_on.get(uuid, ()), key=lambda lease: -(lease.memory - lease.guarantee_size)):
                if missing <= 0:
                    break
                taken = lease.memory + excess_per_device(lease)
                new_size = min(lease.memory, max(lease.guarantee_size, taken - missing))
                missing -= taken - new_size
                if new_size < lease.memory or lease.burst_taken_at is None:
                    decisions.append(self.take_burst_back(state, lease, new_size, f"a request of {format_size(head.memory * head.num_gpus)}", now))
        placed = self.placer.place(state, head, free_less(free_by_device(state, head), held_back or {}))
        if placed is not None and not self.quotas.block_reason(state, head):
            self.placer.grant(state, head, placed, now)
        elif head.room_coming_at is None:
            self._room_comes_for(state, head, now)
        return decisions, True

    @staticmethod
    def _room_comes_for(state: PoolState, head: Lease, now: float) -> None:
        """Mark ``head`` as the request burst is taken back for (kernels waiting to grow yield that
        room to it): one at a time, so a request the pool moved on from does not hold them back."""
        for lease_id in state.derived().queued:
            other = state.leases[lease_id]
            if other.room_coming_at is not None and other.id != head.id:
                other.room_coming_at = None
                state.touch(other)
        head.room_coming_at = now
        state.touch(head)

    def follow_burst_reclaims(self, state: PoolState, now: float) -> list[Decision]:
        """Slices whose burst was taken back but whose kernel still uses more than its size once
        ``burst_settle`` passed: suspended if idle (the kernel keeps its variables). A busy one is
        the watchdog's: its limit is its size now, so it is warned and, after its grace, interrupted
        (then, idle, suspended here). Never an out-of-memory kill."""
        decisions = []
        someone_waits = bool(state.derived().queued) or any(
            lease.grow_since is not None or lease.reserve_wanted for lease in state.leases.values()
        )
        for lease in list(state.leases.values()):
            if lease.burst_taken_at is None or lease.state is not LeaseState.GRANTED:
                continue
            if not someone_waits:
                lease.burst_taken_at, lease.burst_from = None, 0  # who it was taken back for is gone: it may grow again
                state.touch(lease)
                continue
            if excess_per_device(lease) <= 0 or now - lease.burst_taken_at < self.policy.burst_settle:
                continue
            if lease.transition is not Transition.NONE or lease.reclaim_at is not None or not self.accounting.still_idle(lease, now):
                continue
            if self.transitions.suspend_refusal(state, lease):
                continue
            used = format_size(lease.used_memory or 0)
            reason = (
                f"suspended: its burst was taken back for a waiting request and it still used {used} of its "
                f"{format_size(lease.memory * max(1, lease.num_gpus))} slice; it resumes on its next cell"
            )
            decisions.append(self.transitions.begin_suspend(state, lease, reason, now))
        return decisions

    def report_usage(self, state: PoolState, usage: dict[str, int], now: float) -> list[Decision]:
        """Take measured use (bytes, all GPUs, per lease id). An elastic slice whose use nears its
        size grows (a GROW decision: its kernel's caps follow); one whose burst was taken back and
        whose use came down to its size may grow again later. Use above what the watchdog allows
        (:meth:`Lease.watch_limit`) is an OVER_LIMIT decision."""
        decisions = []
        for lease_id, used in usage.items():
            lease = state.leases.get(lease_id)
            if lease is None or lease.state not in HELD_STATES:
                continue
            lease.used_memory = used
            lease.peak_memory = max(lease.peak_memory or 0, used)
            state.touch(lease)  # what it uses above its slice is taken: a grow must see that
            gpus = max(1, lease.num_gpus)
            size = lease.memory * gpus
            if lease.burst_taken_at is not None and used <= size and now >= lease.burst_taken_at:
                # Measured after the burst was taken back (an older figure says nothing of the kernel
                # since its caps came down): the room it gave back may go to the waiting request.
                lease.burst_taken_at, lease.burst_from = None, 0
                lease.burst_note = f"gave its burst back: {format_size(used)} used of its {format_size(size)} slice"
            elif lease.elastic and lease.burst_taken_at is None and used >= size * GROW_WHEN_USED and lease.memory < lease.limit_size:
                largest = max((d.leasable for d in state.devices if d.uuid in lease.devices), default=lease.limit_size)
                try:
                    grown = self.grow(state, lease_id, used + self.policy.burst_step_bytes(largest) * gpus, now, queue=False)
                except RequestRefused as refusal:
                    note = str(refusal)
                    if note != lease.burst_note:
                        lease.burst_note = note
                else:
                    if grown is not None:
                        decisions.append(grown)
            limit = lease.watch_limit()
            if used > limit:
                if lease.over_limit_since is None:
                    lease.over_limit_since = now
                what = "its slice" if lease.burst_taken_at is not None or not lease.elastic else "its slice's limit"
                decisions.append(
                    decision(DecisionKind.OVER_LIMIT, lease, f"uses {format_size(used)}, over {what} of {format_size(limit)}", now)
                )
            else:
                lease.over_limit_since = None
            state.touch(lease)
        return decisions
