"""One scheduler pass: the decision modules composed in the one order they run in.

The order of a pass, written here and nowhere else:

1. expire leases whose holder went silent or whose time is over (:mod:`.accounting`);
2. flag leases whose GPU is lost (:mod:`.accounting`);
3. give up on suspends, restores and moves that took too long (:mod:`.transitions`);
4. carry out reclaims whose warning ran out (:mod:`.reclaims`);
5. serve reserves waiting for burst, then kernels waiting to grow (:mod:`.resizing`, :mod:`.elastic`);
6. grant queued requests in queue order (:mod:`.admission`, :mod:`.quotas`, :mod:`.placer`),
   backfilling behind a blocked head while the policy allows;
7. follow up burst taken back; take burst back for the blocked head (:mod:`.elastic`);
8. free what active reservations still need (:mod:`.reservations`);
9. for a head still blocked, move idle kernels off a GPU where that alone makes its room (:mod:`.transitions`);
10. warn idle slices past their timeout: as many as make room for a head still blocked while requests
    wait (all of them under the ``always`` idle policy); with nobody blocked under ``pressure``, those
    a kernel waiting to grow needs (:mod:`.reclaims`);
11. for a head still blocked, warn lower-priority or over-guarantee leases of preemption by policy
    (:mod:`.reclaims`).
"""

from __future__ import annotations

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.admission import Admission
from jupyter_gpupool.core.capacity import free_by_device, free_less
from jupyter_gpupool.core.elastic import Elastic, grow_wanters, reserve_wanters
from jupyter_gpupool.core.models import Decision, DecisionKind, Lease, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.reclaims import Reclaims
from jupyter_gpupool.core.reservations import Reservations
from jupyter_gpupool.core.resizing import Resizing
from jupyter_gpupool.core.state import PoolState, decision
from jupyter_gpupool.core.transitions import Transitions
from jupyter_gpupool.units import format_size


class Scheduler:
    """One scheduler pass over the decision modules, in the order written in this module's docstring."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, admission: Admission,
                 transitions: Transitions, elastic: Elastic, resizing: Resizing, reservations: Reservations,
                 reclaims: Reclaims) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.admission = admission
        self.transitions = transitions
        self.elastic = elastic
        self.resizing = resizing
        self.reservations = reservations
        self.reclaims = reclaims

    def schedule(self, state: PoolState, now: float) -> list[Decision]:
        """One pass: expire, flag lost GPUs, carry out due reclaims, grant, then plan reclaims."""
        decisions: list[Decision] = []
        decisions += self.accounting.expire_heartbeats(state, now)
        self.accounting.flag_unhealthy(state)
        decisions += self.transitions.expire_transitions(state, now)
        decisions += self.reclaims.carry_out_due(state, now)

        queue = self.admission.queue_order(state, now)
        held_back: dict[str, int] = {}  # room the kernels waiting to grow, and not grown, wait for
        for wanter in reserve_wanters(state):  # a guarantee asked in a running kernel: burst yields to it
            decisions += self.resizing.serve_reserve(state, wanter, held_back, now)
        for wanter in grow_wanters(state):  # ahead of the queued requests: they hold a GPU and cannot run their cell
            decisions += self.elastic.serve_growth(state, wanter, held_back, now)
        blocked: Lease | None = None
        for lease in queue:
            if self.quotas.block_reason(state, lease):
                continue
            if blocked is not None and not self.admission.may_backfill(blocked, now):
                break
            free = free_by_device(state, lease)
            devices = self.placer.place(state, lease, free_less(free, held_back) if held_back else free)
            if devices is None:
                if blocked is None and not lease.resume_ahead:  # a resume ahead of a cell makes no room for itself
                    blocked = lease
                continue
            self.placer.grant(state, lease, devices, now)
            restoring = lease.transition is Transition.RESTORING
            moved = restoring and tuple(lease.devices) != tuple(lease.home_devices)
            what = ("resumed: restoring " + ("onto another GPU of the same model" if moved else "on its GPU")) if restoring else "granted"
            decisions.append(decision(DecisionKind.GRANT, lease, f"{what} {format_size(lease.memory)}", now))
        grown_now = {d.lease_id for d in decisions if d.kind is DecisionKind.GROW}  # like a backfill: not taken back at once

        decisions += self.elastic.follow_burst_reclaims(state, now)
        if blocked is not None:
            given_back, coming = self.elastic.plan_burst_reclaims(state, blocked, now, spare=grown_now, held_back=held_back)
            decisions += given_back
            if coming:
                if blocked.state is LeaseState.GRANTED:  # what it was short of was burst alone, and is free now
                    decisions.append(decision(DecisionKind.GRANT, blocked, f"granted {format_size(blocked.memory)}", now))
                blocked = None  # room is on its way from others' burst: nobody's guarantee is touched
        waiting = bool(state.derived().queued)
        decisions += self.reservations.plan_reclaims(state, now)
        moves = self.transitions.plan_defragmentation(state, blocked, now) if blocked is not None else []
        decisions += moves
        if moves:
            blocked = None  # moving idle kernels makes room: nobody loses their GPU for it
        decisions += self.reclaims.plan_idle(state, now, blocked if waiting else None)
        if blocked is None and self.policy.idle_policy == "pressure":
            decisions += self.reclaims.plan_idle_for_growth(state, now)
        if blocked is not None:
            decisions += self.reclaims.plan_preemption(state, blocked, now)
        return decisions
