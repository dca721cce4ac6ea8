"""What a waiting request is told: its place in line, why it waits, and when it may expect its GPU."""

from __future__ import annotations

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.admission import Admission
from jupyter_gpupool.core.capacity import free_by_device
from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.reservations import Reservations
from jupyter_gpupool.core.state import HELD_STATES, PoolState
from jupyter_gpupool.units import format_size
from jupyter_gpupool.wording import count as counted
from jupyter_gpupool.wording import with_article


class Estimates:
    """Tells a waiting request its place, its reason and its expected wait."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, admission: Admission,
                 reservations: Reservations) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.admission = admission
        self.reservations = reservations

    def queue_info(self, state: PoolState, lease_id: str, now: float) -> QueueInfo | None:
        lease = self.accounting.get(state, lease_id)
        if lease.state is not LeaseState.QUEUED:
            return None
        order = self.admission.queue_order(state, now)
        position = next(i for i, item in enumerate(order) if item.id == lease_id) + 1
        reason = (
            self.quotas.block_reason(state, lease)
            or self.reservations.wait_reason(state, lease, now)
            or (
                (
                    f"resuming: waits for {with_article(lease.home_model)} GPU with {format_size(lease.memory)} free"
                    if lease.resuming and lease.home_model
                    else f"waits for a GPU of model {lease.model} with enough free memory"
                    if lease.model
                    else "waits for a GPU with enough free memory"
                )
                if position == 1
                else f"{counted(position - 1, 'request')} ahead"
            )
        )
        return QueueInfo(position=position, length=len(order), estimated_wait=self.estimate_wait(state, lease, order, now), reason=reason)

    def estimate_wait(self, state: PoolState, lease: Lease, order: list[Lease], now: float) -> float | None:
        """Replay expected lease ends until ``lease`` fits; None when nothing known frees enough.

        A held lease ends at its pending reclaim, else at the earliest of its duration's end (or,
        without one, the typical hold from the ledger) and the moment the idle policy would take it
        back. A lease with no known end is taken to hold its memory for good.
        """
        ends: list[tuple[float, tuple[str, ...], int]] = []
        for other in state.leases.values():
            if other.state not in HELD_STATES:
                continue
            end = self._expected_release(state, other, now)
            if end is not None:
                ends.append((max(end, now), other.devices, other.memory))
        ends.sort(key=lambda item: item[0])
        free = free_by_device(state, lease)
        pending = order[: order.index(lease) + 1]
        current = now
        while True:
            # Grant, in queue order, whatever fits at `current`; stop when `lease` is granted.
            while pending:
                head = pending[0]
                devices = self.placer.place(state, head, free)
                if devices is None:
                    break
                for uuid in devices:
                    free[uuid] -= head.memory
                pending.pop(0)
                if head.id == lease.id:
                    return max(0.0, current - now)
                hold = head.duration or state.typical_hold
                if hold is not None:  # else it holds its memory for good, as far as we know
                    ends.append((current + hold, devices, head.memory))
                    ends.sort(key=lambda item: item[0])
            if not ends:
                return None
            current, devices, memory = ends.pop(0)
            for uuid in devices:
                free[uuid] = free.get(uuid, 0) + memory

    def _expected_release(self, state: PoolState, lease: Lease, now: float) -> float | None:
        """When held ``lease`` is expected to free its memory while someone waits; None if unknown."""
        if lease.reclaim_at is not None:
            return lease.reclaim_at
        ends = []
        if lease.expected_end is not None:
            ends.append(lease.expected_end)
        elif state.typical_hold is not None and lease.granted_at is not None:
            ends.append(lease.granted_at + state.typical_hold)
        idle_reclaim = self._idle_reclaim_time(lease, now)
        if idle_reclaim is not None:
            ends.append(idle_reclaim)
        return min(ends) if ends else None

    def _idle_reclaim_time(self, lease: Lease, now: float) -> float | None:
        """When the idle policy would reclaim ``lease`` if it stays idle and someone waits; None if it won't."""
        if self.policy.idle_policy == "never" or lease.busy or lease.state is not LeaseState.GRANTED:
            return None
        idle_since = lease.last_activity or lease.granted_at or lease.created_at
        suspends = lease.suspendable and self.policy.reclaim_action == "suspend"
        pressure = self.policy.idle_policy == "pressure"  # someone waits: the estimate is for a waiting request
        eligible = max(idle_since + self.policy.warn_after(suspends, pressure), lease.keep_until or 0.0, now)
        return eligible + self.policy.warning_period
