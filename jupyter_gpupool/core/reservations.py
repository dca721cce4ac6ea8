"""Reservations: windows in which memory is held back for their members, the room a window
still needs, and freeing it (burst first, then idle slices, then preemption by policy)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.capacity import free_by_device, taken_by_device
from jupyter_gpupool.core.elastic import Elastic
from jupyter_gpupool.core.index import excess_per_device
from jupyter_gpupool.core.models import Decision, DecisionKind, Device, Lease, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy, Reservation
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.state import HELD_STATES, PoolState, decision
from jupyter_gpupool.core.transitions import Transitions
from jupyter_gpupool.errors import RequestRefused
from jupyter_gpupool.units import format_duration, format_size

#: Reclaim reasons of leases freed for a reservation (idle reclaims, then preemptions).
RESERVATION_RECLAIM = "reclaimed for the reservation "
RESERVATION_PREEMPT = "preempted for the reservation "


def active_reservations(state: PoolState, now: float) -> list[Reservation]:
    return [reservation for reservation in state.reservations if reservation.active(now)]


class Reservations:
    """Holds memory back for reservations and frees what their windows need."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, transitions: Transitions, elastic: Elastic) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.transitions = transitions
        self.elastic = elastic

    def reservation_needs(self, state: PoolState, now: float) -> list[tuple[Reservation, int]]:
        """Active reservations whose members hold less than reserved, with the bytes still unused."""
        needs = []
        for reservation in active_reservations(state, now):
            members_hold = sum(
                lease.memory * lease.num_gpus
                for lease in state.leases.values()
                if lease.state in HELD_STATES and reservation.applies_to(lease.owner, lease.groups)
            )
            if reservation.memory > members_hold:
                needs.append((reservation, reservation.memory - members_hold))
        return needs

    def reserved_for_others(self, state: PoolState, head: Lease, now: float) -> Callable[[Lease], bool]:
        """Whether a lease belongs to an active reservation ``head`` is not part of: reclaiming it
        would free memory that the reservation holds back from ``head`` anyway."""
        others = [r for r in active_reservations(state, now) if not r.applies_to(head.owner, head.groups)]
        return lambda lease: any(r.applies_to(lease.owner, lease.groups) for r in others)

    def plan_reclaims(self, state: PoolState, now: float) -> list[Decision]:
        """While a reservation's window is open, make its unused memory free by the pool's own means:
        burst of non-members first (taken back), then their idle leases (warning, then reclaim), then
        preemption of non-members by policy (not before ``min_runtime``, after ``grace_period``,
        never a lease within a guarantee)."""
        needs = self.reservation_needs(state, now)
        if not needs:
            return []
        shortfall = self._shortfall(state, needs)
        if shortfall <= 0:
            return []
        reservation = needs[0][0]
        active = active_reservations(state, now)
        candidates = [
            lease
            for lease in state.leases.values()
            if lease.state in HELD_STATES
            and lease.reclaim_at is None
            and lease.transition is Transition.NONE
            and not any(r.applies_to(lease.owner, lease.groups) for r in active)
        ]
        # Burst yields to a reservation too: taken back first, before anyone is reclaimed or preempted.
        decisions, shortfall = self._take_burst_back(state, candidates, reservation, shortfall, now)
        if shortfall <= 0:
            return decisions
        if self.policy.idle_policy != "never":
            warned, shortfall = self._warn_idle(state, candidates, reservation, shortfall, now)
            decisions += warned
        if shortfall > 0 and self.policy.preemption:
            decisions += self._warn_preemption(state, candidates, reservation, shortfall, now)
        return decisions

    @staticmethod
    def _shortfall(state: PoolState, needs: list[tuple[Reservation, int]]) -> int:
        """Bytes the reservations still need beyond what is free and what is already on its way
        (pending reclaims, burst being given back)."""
        taken = taken_by_device(state)
        free = sum(max(0, d.leasable - taken.get(d.uuid, 0)) for d in state.devices if d.healthy)
        coming = sum(
            lease.memory * len(lease.devices)
            for lease in state.leases.values()
            if lease.state in HELD_STATES and lease.reclaim_at is not None
        )
        giving_back = sum(  # burst being given back: on its way, like a pending reclaim
            excess_per_device(lease) * len(lease.devices)
            for lease in state.leases.values()
            if lease.state is LeaseState.GRANTED and lease.burst_taken_at is not None
        )
        return sum(unused for _, unused in needs) - free - coming - giving_back

    def _take_burst_back(self, state: PoolState, candidates: list[Lease], reservation: Reservation, shortfall: int,
                         now: float) -> tuple[list[Decision], int]:
        """Take back the burst of ``candidates`` (most first) toward ``shortfall``: decisions, shortfall left."""
        decisions = []
        for lease in sorted(candidates, key=lambda lease: (-(lease.memory - lease.guarantee_size), lease.id)):
            above = lease.memory - lease.guarantee_size
            if shortfall <= 0 or above <= 0:
                continue
            gpus = max(1, len(lease.devices))
            give = min(above, -(-shortfall // gpus))
            decisions.append(self.elastic.take_burst_back(state, lease, lease.memory - give, f"the reservation {reservation.describe()}", now))
            shortfall -= give * gpus
        return decisions, shortfall

    def _warn_idle(self, state: PoolState, candidates: list[Lease], reservation: Reservation, shortfall: int,
                   now: float) -> tuple[list[Decision], int]:
        """Warn idle ``candidates`` past their timeout (longest idle first) toward ``shortfall``."""
        idle = [
            lease
            for lease in candidates
            if self.accounting.still_idle(lease, now) and lease.idle_seconds(now) >= self.transitions.idle_timeout(state, lease)
        ]
        idle.sort(key=lambda lease: -lease.idle_seconds(now))
        decisions = []
        for lease in idle:
            if shortfall <= 0:
                break
            idle_for = format_duration(lease.idle_seconds(now))
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.warning_period
            lease.reclaim_reason = f"{RESERVATION_RECLAIM}{reservation.describe()}: idle for {idle_for}"
            state.touch(lease)
            shortfall -= lease.memory * len(lease.devices)
            decisions.append(
                decision(
                    DecisionKind.WARN_IDLE,
                    lease,
                    f"idle for {idle_for}; its slice goes back for the reservation {reservation.describe()} unless kept",
                    now,
                    lease.reclaim_at,
                )
            )
        return decisions, shortfall

    def _warn_preemption(self, state: PoolState, candidates: list[Lease], reservation: Reservation, shortfall: int,
                         now: float) -> list[Decision]:
        """Warn ``candidates`` over every guarantee (idle before busy, youngest first) of preemption toward ``shortfall``."""
        victims = [
            lease
            for lease in candidates
            if lease.reclaim_at is None
            and not (lease.granted_at is not None and now - lease.granted_at < self.policy.min_runtime)
            and self.quotas.over_guarantee(state, lease)
        ]
        victims.sort(key=lambda v: (v.busy, -(v.granted_at or 0.0)))  # idle before busy, youngest first
        decisions = []
        for lease in victims:
            if shortfall <= 0:
                break
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.grace_period
            lease.reclaim_reason = f"{RESERVATION_PREEMPT}{reservation.describe()}"
            state.touch(lease)
            shortfall -= lease.memory * len(lease.devices)
            decisions.append(decision(DecisionKind.PREEMPT_WARN, lease, lease.reclaim_reason, now, lease.reclaim_at))
        return decisions

    def wait_reason(self, state: PoolState, lease: Lease, now: float) -> str:
        """Why a reservation keeps this queued lease waiting, or ``""``."""
        active = active_reservations(state, now)
        if not active:
            return ""
        for reservation in active:
            if reservation.applies_to(lease.owner, lease.groups) and any(
                other.state in HELD_STATES and reservation.describe() in other.reclaim_reason for other in state.leases.values()
            ):
                return f"waits while memory is freed for the reservation {reservation.describe()}"
        if self.placer.place(state, lease) is None and self.placer.place(state, lease, free_by_device(state, lease, reservations=False)) is not None:
            for reservation, _ in self.reservation_needs(state, now):
                if not reservation.applies_to(lease.owner, lease.groups):
                    return f"waits for the reservation {reservation.describe()}"
        return ""

    def check_reservation(
        self, devices: list[Device], reservation: Reservation, now: float, others: Iterable[Reservation] = ()
    ) -> None:
        """Refuse a reservation the pool can never honour: more memory than the pool has (alone, or with
        the ``others`` whose windows overlap it), or a window that has already ended."""
        total = sum(d.leasable for d in devices if d.healthy)
        if reservation.memory > total:
            raise RequestRefused(
                f"reservation {reservation.name!r} holds {format_size(reservation.memory)} but the whole pool has "
                f"{format_size(total)}; ask for at most {format_size(total)}"
            )
        if reservation.end is not None and not reservation.weekly and reservation.end <= now:
            raise RequestRefused(
                f"reservation {reservation.name!r} ends at {reservation.window_text()}, which is in the past; give a window that ends later"
            )
        others = [other for other in others if other.name != reservation.name]
        if not others:
            return
        # Reserved memory peaks at the start of some window: check every start while this one is open.
        horizon = now + 7 * 86400
        for item in (reservation, *others):
            if not item.weekly and item.end is not None:
                horizon = max(horizon, item.end)
        horizon = min(horizon, now + 400 * 86400)
        for instant in sorted({now, *(t for item in (reservation, *others) for t in window_starts(item, now, horizon))}):
            if not reservation.active(instant):
                continue
            overlapping = [other for other in others if other.active(instant)]
            held = sum(other.memory for other in overlapping)
            if held + reservation.memory > total:
                names = ", ".join(other.describe() for other in overlapping)
                raise RequestRefused(
                    f"reservation {reservation.name!r} overlaps {names}: together they hold "
                    f"{format_size(held + reservation.memory)} but the whole pool has {format_size(total)}; "
                    f"ask for at most {format_size(max(0, total - held))} or choose another window"
                )


def window_starts(reservation: Reservation, start: float, end: float) -> list[float]:
    """The moments in ``[start, end)`` at which ``reservation``'s window opens (local time for weekly ones)."""
    if not reservation.weekly:
        return [reservation.start] if reservation.start is not None and start <= reservation.start < end else []
    opens = dt.datetime.strptime(reservation.daily_start, "%H:%M").time()
    day = dt.datetime.fromtimestamp(start).date()
    last = dt.datetime.fromtimestamp(end).date()
    moments = []
    while day <= last:
        if day.weekday() in reservation.weekdays:
            moment = dt.datetime.combine(day, opens).timestamp()
            if start <= moment < end:
                moments.append(moment)
        day += dt.timedelta(days=1)
    return moments
