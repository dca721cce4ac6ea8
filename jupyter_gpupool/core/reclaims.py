"""Reclaims of granted memory: idle slices under the idle policy (for a waiting request or a
kernel waiting to grow), preemption for higher priority or a guarantee, and carrying out
reclaims whose warning ran out (suspend where it can, else release)."""

from __future__ import annotations

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.capacity import free_by_device, free_with_room_on_its_way
from jupyter_gpupool.core.elastic import grow_wanters
from jupyter_gpupool.core.index import excess_per_device
from jupyter_gpupool.core.models import Decision, DecisionKind, Lease, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.reservations import RESERVATION_RECLAIM, Reservations
from jupyter_gpupool.core.state import HELD_STATES, PoolState, decision
from jupyter_gpupool.core.transitions import Transitions
from jupyter_gpupool.units import format_duration, format_size
from jupyter_gpupool.wording import count as counted


class Reclaims:
    """Plans and carries out reclaims: idle slices and preemption."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, transitions: Transitions,
                 reservations: Reservations) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.transitions = transitions
        self.reservations = reservations

    def warn_after(self, state: PoolState, lease: Lease, *, pressure: bool) -> float:
        """Idle time before ``lease`` is warned: while someone waits (``pressure``) and the reclaim
        would suspend it, the warning runs within its suspend idle timeout (the policy's
        ``warn_within_idle_timeout``), else after its idle timeout."""
        suspends = not self.transitions.suspend_refusal(state, lease)
        return self.policy.warn_after(suspends, pressure)

    def idle_when_due(self, state: PoolState, lease: Lease, now: float, *, pressure: bool) -> float:
        """The idle time a warning's reclaim reason names: when warned within its idle timeout, the
        time it will have been idle once its warning runs out (the reclaim happens only if it stays
        idle); else the time it has been idle now, as before."""
        if self.warn_after(state, lease, pressure=pressure) < self.transitions.idle_timeout(state, lease):
            return lease.idle_seconds(now + self.policy.warning_period)
        return lease.idle_seconds(now)

    def carry_out_due(self, state: PoolState, now: float) -> list[Decision]:
        if not state.derived().reclaiming:
            return []
        decisions = []
        someone_waits = any(
            (lease.state is LeaseState.QUEUED and not lease.resume_ahead) or lease.grow_since is not None  # a kernel waiting to grow too
            for lease in state.leases.values()
        )
        for lease in list(state.leases.values()):
            if lease.state not in HELD_STATES or lease.reclaim_at is None:
                continue
            preempting = lease.reclaim_reason.startswith("preempt")
            if not preempting:
                if lease.reclaim_reason.startswith(RESERVATION_RECLAIM):
                    pressure_gone = not self.reservations.reservation_needs(state, now)  # window closed, or members hold it
                else:
                    pressure_gone = self.policy.idle_policy == "pressure" and not someone_waits
                if not self.accounting.still_idle(lease, now) or pressure_gone or self.policy.idle_policy == "never":
                    lease.warned_at = lease.reclaim_at = None
                    lease.reclaim_reason = ""
                    state.touch(lease)
                    continue
            if lease.reclaim_at > now:
                continue
            kind = DecisionKind.PREEMPT if preempting else DecisionKind.RECLAIM_IDLE
            reason = lease.reclaim_reason
            why_not = self.transitions.suspend_refusal(state, lease)
            if not why_not:
                decisions.append(self.transitions.begin_suspend(state, lease, reason, now))
                continue
            if self.policy.reclaim_action == "suspend" and lease.suspendable:
                reason += f" (not suspended: {why_not})"
            self.accounting.release(state, lease.id, reason, now)
            decisions.append(decision(kind, lease, reason, now))
        return decisions

    def plan_idle(self, state: PoolState, now: float, blocked: Lease | None) -> list[Decision]:
        policy = self.policy.idle_policy
        if policy == "never":
            return []
        protected = self.reservations.reserved_for_others(state, blocked, now) if blocked is not None else (lambda lease: False)
        idle = [
            lease
            for lease in state.leases.values()
            if lease.state in HELD_STATES
            and lease.reclaim_at is None
            and lease.transition is Transition.NONE
            and self.accounting.still_idle(lease, now)
            and lease.idle_seconds(now) >= self.warn_after(state, lease, pressure=policy == "pressure")
            and (policy == "always" or not protected(lease))
        ]
        idle.sort(key=lambda lease: -lease.idle_seconds(now))
        chosen: list[Lease] = []
        if policy == "always":
            chosen = idle
        elif blocked is not None:
            # Longest idle first, only as many as make room for the request that cannot fit.
            free = free_with_room_on_its_way(state, blocked, now, self.policy.burst_settle)
            for lease in idle:
                if self.placer.place(state, blocked, free) is not None:
                    break
                chosen.append(lease)
                for uuid in lease.devices:
                    free[uuid] = free.get(uuid, 0) + lease.memory
            if chosen and self.placer.place(state, blocked, free) is None:
                chosen = []  # reclaiming every idle slice would still not make room: leave them alone
        decisions = []
        waiting = sum(1 for lease in state.leases.values() if lease.state is LeaseState.QUEUED)
        for lease in chosen:
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.warning_period
            idle_for = format_duration(self.idle_when_due(state, lease, now, pressure=policy == "pressure"))
            lease.reclaim_reason = (
                f"reclaimed: idle for {idle_for} while {counted(waiting, 'request')} waited for a GPU"
                if policy == "pressure"
                else f"reclaimed: idle for {idle_for}, over the {format_duration(self.transitions.idle_timeout(state, lease))} idle timeout"
            )
            state.touch(lease)
            decisions.append(
                decision(DecisionKind.WARN_IDLE, lease, f"idle for {format_duration(lease.idle_seconds(now))}; its slice goes back unless kept", now, lease.reclaim_at)
            )
        return decisions

    def plan_idle_for_growth(self, state: PoolState, now: float) -> list[Decision]:
        """Under pressure a kernel waiting to grow is pressure too: reclaim kernels idle past their
        timeout (longest idle first, as for a request) where that makes its room, on its own GPU or
        on one of its model it can move to. One kernel at a time; none while a reclaim is under way."""
        index = state.derived()
        if index.reclaiming or any(step is Transition.SUSPENDING for step in index.transitions.values()):
            return []  # room is on its way
        wanters = [lease for lease in grow_wanters(state) if lease.state is LeaseState.GRANTED
                   and lease.transition is Transition.NONE and lease.num_gpus == 1 and lease.grow_wanted > lease.memory]
        if not wanters:
            return []
        idle = [
            lease
            for lease in state.leases.values()
            if lease.state is LeaseState.GRANTED
            and lease.reclaim_at is None
            and lease.transition is Transition.NONE
            and lease.grow_since is None
            and self.accounting.still_idle(lease, now)
            and lease.idle_seconds(now) >= self.warn_after(state, lease, pressure=True)
        ]
        if not idle:
            return []
        idle.sort(key=lambda lease: -lease.idle_seconds(now))
        known = {d.uuid: d for d in state.devices if d.healthy}
        wanter = wanters[0]
        free = free_by_device(state, wanter)
        home = wanter.devices[0]
        model = known[home].model if home in known else None
        movable = self.policy.defragment and not self.transitions.suspend_refusal(state, wanter)
        options = [(home, wanter.grow_wanted - wanter.memory - excess_per_device(wanter))]
        if movable:
            options += [(uuid, wanter.grow_wanted) for uuid, device in known.items() if uuid != home and device.model == model]
        for uuid, needed in options:
            missing = needed - free.get(uuid, 0)
            chosen: list[Lease] = []
            for lease in idle:
                if missing <= 0:
                    break
                if lease.devices == (uuid,) and lease.id != wanter.id:
                    chosen.append(lease)
                    missing -= lease.memory + excess_per_device(lease)
            if missing > 0 or not chosen:
                continue
            decisions = []
            for lease in chosen:
                lease.warned_at = now
                lease.reclaim_at = now + self.policy.warning_period
                idle_for = format_duration(self.idle_when_due(state, lease, now, pressure=True))
                lease.reclaim_reason = f"reclaimed: idle for {idle_for} while a kernel beside it waited for its slice to grow"
                state.touch(lease)
                decisions.append(
                    decision(DecisionKind.WARN_IDLE, lease, f"idle for {format_duration(lease.idle_seconds(now))}; its slice goes back unless kept", now, lease.reclaim_at)
                )
            return decisions
        return []

    def _idle_warning_past_grace(self, lease: Lease, now: float) -> bool:
        """``lease`` is warned of an idle reclaim (not a preemption, not a reservation's) that runs
        out after the grace period a preemption would give it: a preemption may cut it short, since
        unwarned it would have been preempted with that grace."""
        return (
            lease.state in HELD_STATES
            and lease.reclaim_at is not None
            and lease.reclaim_at > now + self.policy.grace_period
            and not lease.reclaim_reason.startswith(("preempt", RESERVATION_RECLAIM))
        )

    def plan_preemption(self, state: PoolState, head: Lease, now: float) -> list[Decision]:
        """Warn the fewest lower-class (or over-guarantee) holders that make room for ``head``,
        each reclaimed after ``grace_period``; a holder already warned of an idle reclaim that runs
        out later has its warning cut short to that grace."""
        if not self.policy.preemption:
            return []
        entitled = self.quotas.guarantee_for(state, head, extra=head.memory * head.num_gpus)
        protected = self.reservations.reserved_for_others(state, head, now)
        victims = []
        for lease in state.leases.values():
            if lease.state not in HELD_STATES or lease.owner == head.owner:
                continue
            if lease.reclaim_at is not None and not self._idle_warning_past_grace(lease, now):
                continue
            if lease.transition is not Transition.NONE:
                continue
            if lease.granted_at is not None and now - lease.granted_at < self.policy.min_runtime:
                continue
            if protected(lease):
                continue
            lower_class = lease.priority.rank < head.priority.rank
            if lower_class or (entitled and self.quotas.over_guarantee(state, lease)):
                victims.append(lease)
        if not victims:
            return []
        # Least cost first: already warned idle, then idle before busy, over-quota before within,
        # youngest before oldest.
        victims.sort(key=lambda v: (v.reclaim_at is None, v.busy, not self.quotas.over_guarantee(state, v), -(v.granted_at or 0.0)))
        free = free_with_room_on_its_way(state, head, now, self.policy.burst_settle)
        for lease in victims:  # a victim warned idle frees its room too late for this request, unless chosen
            if lease.reclaim_at is None:
                continue
            for uuid in lease.devices:
                free[uuid] = free.get(uuid, 0) - lease.memory
        if self.placer.place(state, head, free) is not None:
            return []  # room is already on its way (warned, suspending or moving leases)
        chosen = []
        for lease in victims:
            chosen.append(lease)
            for uuid in lease.devices:
                free[uuid] = free.get(uuid, 0) + lease.memory
            if self.placer.place(state, head, free) is not None:
                break
        else:
            return []  # even evicting every candidate would not make room
        decisions = []
        if any(v.priority.rank < head.priority.rank for v in chosen):
            why = "a higher-priority request"
        else:
            why = "a request within its guaranteed quota" if entitled == "your" else f"a request within {entitled} guaranteed quota"
        for lease in chosen:  # an idle warning under way is cut short to the grace period
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.grace_period
            lease.reclaim_reason = f"preempted for {why} ({format_size(head.memory)} for {head.owner})"
            state.touch(lease)
            decisions.append(decision(DecisionKind.PREEMPT_WARN, lease, lease.reclaim_reason, now, lease.reclaim_at))
        return decisions
