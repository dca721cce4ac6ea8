"""The pool engine: the facade the backends call, over the decision modules.

Pure: it works on a :class:`PoolState` held in memory and an explicit ``now``; the store loads
and saves that state around each call (one SQLite transaction per decision). Nothing here
touches Jupyter, HTTP, NVML or the clock.

Each kind of decision is a module of its own over that one state (see ``docs/architecture.md``,
"The engine's decisions"): :mod:`.admission` (admission and queue order), :mod:`.quotas`,
:mod:`.placer`, :mod:`.capacity` (what is free: only what the driver shows free),
:mod:`.accounting` (heartbeats, activity, release), :mod:`.transitions` (suspend, resume, move),
:mod:`.elastic` (growth and burst taken back), :mod:`.resizing`, :mod:`.reservations`,
:mod:`.reclaims` (idle and preemption), :mod:`.estimates` (a waiting request's place and wait),
composed in one order by :mod:`.scheduler`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.admission import Admission
from jupyter_gpupool.core.capacity import free_by_device, taken_by_device
from jupyter_gpupool.core.elastic import Elastic, grow_wanters, reserve_wanters
from jupyter_gpupool.core.estimates import Estimates
from jupyter_gpupool.core.models import Activity, Decision, Device, Lease, LeaseRequest, PriorityClass, QueueInfo
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy, Reservation
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.reclaims import Reclaims
from jupyter_gpupool.core.reservations import Reservations, active_reservations
from jupyter_gpupool.core.resizing import Resizing
from jupyter_gpupool.core.scheduler import Scheduler
from jupyter_gpupool.core.state import DriverPort, PoolState, held_by_device
from jupyter_gpupool.core.transitions import Transitions


class Engine:
    """Decides; never does. One instance per policy; state comes in per call. Each method hands the
    call to the decision module that owns it."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self.quotas = Quotas(policy)
        self.placer = Placer(policy)
        self.accounting = Accounting(policy)
        self.admission = Admission(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting)
        self.transitions = Transitions(policy, placer=self.placer, accounting=self.accounting)
        self.elastic = Elastic(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                               transitions=self.transitions)
        self.resizing = Resizing(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                                 admission=self.admission, elastic=self.elastic)
        self.reservations = Reservations(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                                         transitions=self.transitions, elastic=self.elastic)
        self.reclaims = Reclaims(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                                 transitions=self.transitions, reservations=self.reservations)
        self.estimates = Estimates(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                                   admission=self.admission, reservations=self.reservations)
        self.scheduler = Scheduler(policy, quotas=self.quotas, placer=self.placer, accounting=self.accounting,
                                   admission=self.admission, transitions=self.transitions, elastic=self.elastic,
                                   resizing=self.resizing, reservations=self.reservations, reclaims=self.reclaims)

    def admit(self, state: PoolState, lease_id: str, request: LeaseRequest, now: float) -> Lease:
        """Validate a request and queue it: :meth:`~jupyter_gpupool.core.admission.Admission.admit`."""
        return self.admission.admit(state, lease_id, request, now)

    def _shape(self, request: LeaseRequest, candidates: list[Device]) -> tuple[int, int]:
        """See :meth:`~jupyter_gpupool.core.admission.Admission.shape`."""
        return self.admission.shape(request, candidates)

    def burst_limit_for(self, asked: int | None, guarantee: int, num_gpus: int, candidates: list[Device], owner: str,
                        groups: Iterable[str]) -> int:
        """See :meth:`~jupyter_gpupool.core.admission.Admission.burst_limit_for`."""
        return self.admission.burst_limit_for(asked, guarantee, num_gpus, candidates, owner, groups)

    def fewest_gpus(self, memory: int, sizes: list[int]) -> tuple[int, int] | None:
        """See :meth:`~jupyter_gpupool.core.admission.Admission.fewest_gpus`."""
        return self.admission.fewest_gpus(memory, sizes)

    def schedule(self, state: PoolState, now: float) -> list[Decision]:
        """One pass: :meth:`~jupyter_gpupool.core.scheduler.Scheduler.schedule`."""
        return self.scheduler.schedule(state, now)

    def queue_order(self, state: PoolState, now: float) -> list[Lease]:
        """Queued leases in service order: :meth:`~jupyter_gpupool.core.admission.Admission.queue_order`."""
        return self.admission.queue_order(state, now)

    def effective_rank(self, lease: Lease, now: float) -> float:
        """See :meth:`~jupyter_gpupool.core.admission.Admission.effective_rank`."""
        return self.admission.effective_rank(lease, now)

    def fair_share_usage(self, state: PoolState, now: float, owners: Collection[str] | None = None) -> dict[str, float]:
        """GiB·hours per owner: :meth:`~jupyter_gpupool.core.admission.Admission.fair_share_usage`."""
        return self.admission.fair_share_usage(state, now, owners)

    @staticmethod
    def taken_by_device(state: PoolState) -> Mapping[str, int]:
        """Bytes not free per device uuid: :func:`~jupyter_gpupool.core.capacity.taken_by_device`."""
        return taken_by_device(state)

    def free_by_device(self, state: PoolState, lease: Lease | None = None, reservations: bool = True) -> dict[str, int]:
        """See :func:`~jupyter_gpupool.core.capacity.free_by_device`."""
        return free_by_device(state, lease, reservations)

    def holdings(self, state: PoolState, owner: str | None = None, group: str | None = None) -> tuple[int, int]:
        """See :meth:`~jupyter_gpupool.core.quotas.Quotas.holdings`."""
        return self.quotas.holdings(state, owner, group)

    def guarantee_for(self, state: PoolState, lease: Lease, extra: int = 0) -> str:
        """See :meth:`~jupyter_gpupool.core.quotas.Quotas.guarantee_for`."""
        return self.quotas.guarantee_for(state, lease, extra)

    def within_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """See :meth:`~jupyter_gpupool.core.quotas.Quotas.within_guarantee`."""
        return self.quotas.within_guarantee(state, lease)

    def over_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """See :meth:`~jupyter_gpupool.core.quotas.Quotas.over_guarantee`."""
        return self.quotas.over_guarantee(state, lease)

    def grace_after_outage(self, state: PoolState, now: float) -> int:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.grace_after_outage`."""
        return self.accounting.grace_after_outage(state, now)

    def parked_budget(self, state: PoolState) -> int:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.parked_budget`."""
        return self.transitions.parked_budget(state)

    def suspend_refusal(self, state: PoolState, lease: Lease) -> str:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.suspend_refusal`."""
        return self.transitions.suspend_refusal(state, lease)

    def reserve_pinned_backup(self, state: PoolState, lease_id: str, amount: int, now: float) -> Lease:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.reserve_pinned_backup`."""
        return self.transitions.reserve_pinned_backup(state, lease_id, amount, now)

    def suspend(self, state: PoolState, lease_id: str, reason: str, now: float) -> Decision:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.suspend`."""
        return self.transitions.suspend(state, lease_id, reason, now)

    def resume(self, state: PoolState, lease_id: str, now: float, ahead: bool = False) -> Lease:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.resume`."""
        return self.transitions.resume(state, lease_id, now, ahead)

    def confirm_transition(self, state: PoolState, lease_id: str, now: float, parked_bytes: int | None = None) -> Lease:
        """Phase two: :meth:`~jupyter_gpupool.core.transitions.Transitions.confirm_transition`."""
        return self.transitions.confirm_transition(state, lease_id, now, parked_bytes)

    @staticmethod
    def bounded_parked_bytes(state: PoolState, lease: Lease, parked_bytes: int) -> int:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.bounded_parked_bytes`."""
        return Transitions.bounded_parked_bytes(state, lease, parked_bytes)

    def fail_transition(self, state: PoolState, lease_id: str, error: str, still_running: bool, now: float) -> list[Decision]:
        """See :meth:`~jupyter_gpupool.core.transitions.Transitions.fail_transition`."""
        return self.transitions.fail_transition(state, lease_id, error, still_running, now)

    def grow(self, state: PoolState, lease_id: str, needed: int, now: float, queue: bool = True) -> Decision | None:
        """See :meth:`~jupyter_gpupool.core.elastic.Elastic.grow`."""
        return self.elastic.grow(state, lease_id, needed, now, queue)

    def grow_wanters(self, state: PoolState) -> list[Lease]:
        """See :func:`~jupyter_gpupool.core.elastic.grow_wanters`."""
        return grow_wanters(state)

    def grow_place(self, state: PoolState, lease_id: str, now: float) -> int | None:
        """See :meth:`~jupyter_gpupool.core.elastic.Elastic.grow_place`."""
        return self.elastic.grow_place(state, lease_id, now)

    @staticmethod
    def active_reservations(state: PoolState, now: float) -> list[Reservation]:
        """See :func:`~jupyter_gpupool.core.reservations.active_reservations`."""
        return active_reservations(state, now)

    def reservation_needs(self, state: PoolState, now: float) -> list[tuple[Reservation, int]]:
        """See :meth:`~jupyter_gpupool.core.reservations.Reservations.reservation_needs`."""
        return self.reservations.reservation_needs(state, now)

    def check_reservation(
        self, devices: list[Device], reservation: Reservation, now: float, others: Iterable[Reservation] = ()
    ) -> None:
        """See :meth:`~jupyter_gpupool.core.reservations.Reservations.check_reservation`."""
        return self.reservations.check_reservation(devices, reservation, now, others)

    def get(self, state: PoolState, lease_id: str) -> Lease:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.get`."""
        return self.accounting.get(state, lease_id)

    def release(self, state: PoolState, lease_id: str, reason: str, now: float) -> Lease:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.release`."""
        return self.accounting.release(state, lease_id, reason, now)

    def resize(self, state: PoolState, lease_id: str, memory: int, now: float, limit: int | None = None) -> Lease:
        """See :meth:`~jupyter_gpupool.core.resizing.Resizing.resize`."""
        return self.resizing.resize(state, lease_id, memory, now, limit)

    def reserve_wanters(self, state: PoolState) -> list[Lease]:
        """See :func:`~jupyter_gpupool.core.elastic.reserve_wanters`."""
        return reserve_wanters(state)

    def keep(self, state: PoolState, lease_id: str, seconds: float, now: float) -> Lease:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.keep`."""
        return self.accounting.keep(state, lease_id, seconds, now)

    def report_activity(self, state: PoolState, lease_id: str, activity: Activity, now: float) -> Lease:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.report_activity`."""
        return self.accounting.report_activity(state, lease_id, activity, now)

    def heartbeat(self, state: PoolState, lease_id: str, now: float) -> Lease:
        """See :meth:`~jupyter_gpupool.core.accounting.Accounting.heartbeat`."""
        return self.accounting.heartbeat(state, lease_id, now)

    def report_usage(self, state: PoolState, usage: dict[str, int], now: float) -> list[Decision]:
        """See :meth:`~jupyter_gpupool.core.elastic.Elastic.report_usage`."""
        return self.elastic.report_usage(state, usage, now)

    def queue_info(self, state: PoolState, lease_id: str, now: float) -> QueueInfo | None:
        """See :meth:`~jupyter_gpupool.core.estimates.Estimates.queue_info`."""
        return self.estimates.queue_info(state, lease_id, now)

    def estimate_wait(self, state: PoolState, lease: Lease, order: list[Lease], now: float) -> float | None:
        """See :meth:`~jupyter_gpupool.core.estimates.Estimates.estimate_wait`."""
        return self.estimates.estimate_wait(state, lease, order, now)


__all__ = ["DriverPort", "Engine", "PoolState", "PriorityClass", "held_by_device"]
