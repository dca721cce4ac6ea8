"""The pool engine: admission, queue order, placement, quotas, preemption, idle reclaim.

Pure: it works on a :class:`PoolState` held in memory and an explicit ``now``; the store loads
and saves that state around each call (one SQLite transaction per decision). Nothing here
touches Jupyter, HTTP, NVML or the clock.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from jupyter_gpupool.core.index import LeaseIndex, excess_per_device, park_size, pinned_beside_park, pinned_ceiling
from jupyter_gpupool.core.models import (
    MODEL_FORMS,
    Activity,
    Decision,
    DecisionKind,
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PriorityClass,
    QueueInfo,
    Transition,
    model_family,
    model_matches,
    model_tokens,
)
from jupyter_gpupool.core.placement import Demand, GpuSlot, NodeView, PlacementPolicy, make_policy, typical_demands
from jupyter_gpupool.core.policy import PoolPolicy, Quota, Reservation
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound, RequestRefused
from jupyter_gpupool.units import GIB, MIB, format_duration, format_size
from jupyter_gpupool.wording import count as counted
from jupyter_gpupool.wording import with_article

HELD_STATES = (LeaseState.GRANTED,)  # suspended leases hold no GPU memory
#: Reclaim reasons of leases freed for a reservation (idle reclaims, then preemptions).
RESERVATION_RECLAIM = "reclaimed for the reservation "
RESERVATION_PREEMPT = "preempted for the reservation "
#: How a lease's ``burst_note`` begins once the pool took its burst back.
BURST_TAKEN = "burst taken back"
#: Share of its current size a kernel's measured use must reach before its elastic slice grows.
GROW_WHEN_USED = 0.9


class DriverPort(Protocol):
    """The one way the engine reads the driver: what processes hold on the GPUs now. Read at most
    once per decision by the pool's adapter; attribution (whose a process is) is the adapter's."""

    def holdings(self, lease: Lease) -> list[tuple[int, str, int]]:
        """``(pid, device uuid, bytes)`` the driver shows ``lease``'s processes holding now."""
        ...

    def held(self) -> Mapping[str, Mapping[str, int]]:
        """Device uuid → {lease id, or "" for a process of no live lease → bytes} the driver shows
        live processes holding now."""
        ...


@dataclass
class PoolState:
    """What one decision sees: devices, live leases and usage history."""

    devices: list[Device]
    leases: dict[str, Lease]
    usage: Mapping[str, float] = field(default_factory=dict)  # decayed past GiB·h per owner
    typical_hold: float | None = None  # median seconds a lease was held, from history
    reservations: list[Reservation] = field(default_factory=list)
    recent_requests: list[int] = field(default_factory=list)  # memory of recent requests (FGD's typical pods)
    now: float = 0.0  # the time this state was loaded for
    changed: set[str] = field(default_factory=set)
    #: Leases whose liveness fields alone changed (see :meth:`touch_liveness`); ``changed`` wins.
    beats: set[str] = field(default_factory=set)
    released: list[Lease] = field(default_factory=list)
    #: Derived state of ``leases``, kept up to date by :meth:`touch` (the pool hands in one that
    #: lives as long as its lease cache; built from ``leases`` on first use otherwise).
    index: LeaseIndex | None = None
    host_memory: int | None = None  # bytes of host RAM (the parked-slice budget is a share of it)
    #: Granted intervals closed without a release (a suspend): metered like released leases.
    closed_intervals: list[Lease] = field(default_factory=list)
    #: Bytes per device uuid that processes outside any granted lease hold (unpooled use, as the
    #: host's watcher last saw it through NVML): taken, so never granted to anyone.
    unpooled: Mapping[str, int] = field(default_factory=dict)
    #: What the driver shows held on the GPUs now, read at most once per decision (the pool's
    #: adapter; None where the pool sees no processes, as Slurm). Memory goes back to the pool only
    #: as it shows it free: see :meth:`Engine.taken_by_device`.
    driver: DriverPort | None = None
    #: Leases released in this decision whose processes still held memory, and what they held.
    released_holdings: list[tuple[Lease, list[tuple[int, str, int]]]] = field(default_factory=list)

    def touch(self, lease: Lease) -> None:
        """Record that ``lease`` changed (it is saved, and the index updated): call after every change.
        Its pinned backup follows its size down here (:func:`pinned_ceiling`), whatever shrank it."""
        lease.pinned_backup = min(lease.pinned_backup, pinned_ceiling(lease))
        self.changed.add(lease.id)
        if self.index is not None:
            self.index.update(lease)

    def touch_liveness(self, lease: Lease) -> None:
        """As :meth:`touch`, for a change confined to the lease's ``LIVENESS_FIELDS`` (an activity
        report, a heartbeat): the store then rewrites only their part of the lease's text."""
        self.beats.add(lease.id)
        if self.index is not None:
            self.index.update_liveness(lease)

    def read_use(self, lease: Lease) -> None:
        """Raise a granted lease's measured use to what the driver shows its kernel holding on its
        GPUs now, where the watchdog's last reading is lower (its kernel allocated since)."""
        if self.driver is None or lease.state is not LeaseState.GRANTED:
            return
        held = sum(amount for _, uuid, amount in self.driver.holdings(lease) if uuid in lease.devices)
        if held > (lease.used_memory or 0):
            lease.used_memory = held
            lease.peak_memory = max(lease.peak_memory or 0, held)
            self.touch(lease)

    def keep_taken_after_release(self, lease: Lease) -> None:
        """A granted lease was just released: what the driver shows its processes still holding
        (a kernel not yet exited) is written down as theirs, so views say whose it is. Whether it
        is taken does not hang on that: every decision counts what the driver shows held on a GPU,
        whoever holds it (:meth:`Engine.taken_by_device`)."""
        held = self.driver.holdings(lease) if self.driver is not None else []
        if not held:
            return
        unpooled = dict(self.unpooled)
        for _, uuid, amount in held:
            unpooled[uuid] = unpooled.get(uuid, 0) + amount
        self.unpooled = unpooled
        self.released_holdings.append((lease, held))

    def derived(self) -> LeaseIndex:
        if self.index is None:
            self.index = LeaseIndex(self.leases.values())
        return self.index


def held_by_device(leases: Iterable[Lease]) -> dict[str, int]:
    """Bytes leased on each device uuid by leases that hold GPU memory."""
    held: dict[str, int] = {}
    for lease in leases:
        if lease.state in HELD_STATES:
            for uuid in (*lease.devices, *lease.migrate_from):  # a move holds both ends until done
                held[uuid] = held.get(uuid, 0) + lease.memory
    return held


class Engine:
    """Decides; never does. One instance per policy; state comes in per call."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self._placement_cache: tuple[str, tuple[int, ...], PlacementPolicy] | None = None

    # --- admission --------------------------------------------------------------------------------
    def admit(self, state: PoolState, lease_id: str, request: LeaseRequest, now: float) -> Lease:
        """Validate a request and queue it; raises :class:`RequestRefused` if it can never fit."""
        if request.memory <= 0:
            raise InvalidInput("memory must be positive")
        if not 1 <= request.num_gpus <= self.policy.max_gpus_per_lease:
            raise InvalidInput(f"number of GPUs must be between 1 and {self.policy.max_gpus_per_lease}, got {request.num_gpus}")
        if request.compute_share is not None and not 1 <= request.compute_share <= 100:
            raise InvalidInput(f"compute share must be a percentage between 1 and 100, got {request.compute_share}")
        if request.duration is not None and request.duration <= 0:
            raise InvalidInput("duration must be positive")
        if request.model is not None and not model_tokens(request.model):
            raise InvalidInput(f"invalid GPU model {request.model!r}: give {MODEL_FORMS}")
        candidates = self._candidate_devices(state.devices, request.model)
        if request.model and not candidates:
            models = sorted({d.model for d in state.devices if d.healthy})
            raise RequestRefused(
                f"no GPU of model {request.model!r} in this pool; models here: {', '.join(models) or 'none'} "
                f"(a family name such as {model_family(model_tokens(models[0])) if models else 'A100'} matches every size of it)"
            )
        if not candidates:
            raise RequestRefused("this pool has no GPUs")
        memory, num_gpus = self._shape(request, candidates)
        total = memory * num_gpus
        for who, quota in self._quotas(request.owner, request.groups):
            if quota.maximum is not None and total > quota.maximum:
                raise RequestRefused(
                    f"requested {format_size(total)} but {who} maximum quota is {format_size(quota.maximum)}; "
                    f"ask for at most {format_size(quota.maximum)}"
                )
        limit = self.burst_limit_for(request.burst_limit, memory, num_gpus, candidates, request.owner, request.groups)
        self._check_queue_limits(state, request)
        priority = self.policy.priority_for(request.owner, request.groups, request.priority)
        earlier = state.derived().kernels.get(request.kernel_id) if request.kernel_id else None
        if earlier is not None:
            return self._ask_again(state, state.leases[earlier], request, memory, num_gpus, priority, now, limit)
        lease = Lease(
            id=lease_id,
            owner=request.owner,
            memory=memory,
            state=LeaseState.QUEUED,
            created_at=now,
            groups=tuple(request.groups),
            kernel_id=request.kernel_id,
            num_gpus=num_gpus,
            compute_share=request.compute_share,
            model=request.model,
            priority=priority,
            duration=request.duration,
            holder_pid=request.holder_pid,
            holder_host=request.holder_host,
            label=request.label,
            heartbeat_at=now,
            last_activity=now,
            suspendable=request.suspendable,
            guarantee=memory,
            burst_limit=limit,
            limit_asked=request.burst_limit,
        )
        state.leases[lease.id] = lease
        state.touch(lease)
        state.recent_requests = [*state.recent_requests, memory]  # a new list: the store may share the one it handed in
        return lease

    def _ask_again(self, state: PoolState, lease: Lease, request: LeaseRequest, memory: int, num_gpus: int,
                   priority: PriorityClass, now: float, limit: int = 0) -> Lease:
        """A request for a kernel that has a live lease (its restart, most often): the same lease
        asks again, so a kernel never holds two. Whatever it held or parked is worthless to the new
        process: parked memory is dropped (no restore), a granted interval is closed for metering,
        and the lease queues with the new request's shape."""
        if lease.owner != request.owner:
            raise RequestRefused(f"kernel {request.kernel_id} already has a lease of another user; a kernel has one lease")
        if lease.state is LeaseState.GRANTED:
            self._count_unwritten_busy_time(lease, now)
            state.closed_intervals.append(lease.copy(released_at=now))
        elif lease.state is LeaseState.SUSPENDED and lease.suspended_at is not None:
            lease.parked_seconds += max(0.0, now - lease.suspended_at)
        lease.state = LeaseState.QUEUED
        lease.created_at = now  # it queues from now, behind those who asked before
        lease.memory, lease.num_gpus, lease.priority = memory, num_gpus, priority
        lease.guarantee, lease.burst_limit, lease.limit_asked = memory, limit, request.burst_limit
        lease.reserve_wanted, lease.reserve_since = 0, None
        lease.burst_taken_at, lease.burst_from, lease.burst_note = None, 0, ""
        lease.grow_wanted, lease.grow_since, lease.room_coming_at = 0, None, None
        lease.compute_share, lease.model, lease.duration = request.compute_share, request.model, request.duration
        lease.holder_pid, lease.holder_host, lease.label = request.holder_pid, request.holder_host, request.label
        lease.suspendable = request.suspendable
        lease.devices = lease.home_devices = lease.migrate_from = ()
        lease.home_model = ""
        lease.granted_at = lease.suspended_at = lease.resume_asked_at = None
        lease.transition, lease.transition_at = Transition.NONE, None
        lease.parked_memory = 0
        lease.pinned_backup = 0  # the old process took its backup with it
        lease.resuming = False
        lease.suspend_reason = ""
        lease.restore_failures = 0
        lease.warned_at = lease.reclaim_at = None
        lease.reclaim_reason = ""
        lease.used_memory = lease.over_limit_since = None
        lease.busy, lease.active_seconds, lease.memory_history = False, 0.0, ()
        lease.heartbeat_at = lease.last_activity = max(now, lease.heartbeat_at or now)
        state.touch(lease)
        return lease

    def _shape(self, request: LeaseRequest, candidates: list[Device]) -> tuple[int, int]:
        """(memory per GPU, number of GPUs) a request is granted as; refuses one that can never fit.

        A request for one GPU with more memory than the largest candidate GPU spans the fewest GPUs
        that hold it, in equal shares (``span_large_requests``), or is refused naming that choice.
        """
        sizes = sorted((d.leasable for d in candidates), reverse=True)
        largest = sizes[0]
        of_model = f" of model {request.model}" if request.model else ""
        if request.num_gpus == 1 and request.memory > largest:
            span = self.fewest_gpus(request.memory, sizes)
            if span is None:
                most_k, most = self._most_that_fits(sizes)
                raise RequestRefused(
                    f"too large: requested {format_size(request.memory)} but at most {format_size(most)} fits on this pool's GPUs{of_model} "
                    f"({most_k} × {format_size(most // most_k)}); ask for at most {format_size(most)}"
                )
            num_gpus, per_gpu = span
            if self.policy.span_large_requests:
                return per_gpu, num_gpus
            raise RequestRefused(
                f"too large for one GPU: requested {format_size(request.memory)} but the largest GPU{of_model} has {format_size(largest)}; "
                f"ask for --gpus {num_gpus} with {format_size(per_gpu)} each, or at most {format_size(largest)} on one GPU"
            )
        if request.num_gpus > len(sizes):
            raise RequestRefused(
                f"too many GPUs: requested {request.num_gpus} but this pool has {len(sizes)}{of_model}; ask for at most {len(sizes)}"
            )
        fitting = sizes[request.num_gpus - 1]
        if request.memory > fitting:
            raise RequestRefused(
                f"too large: requested {format_size(request.memory)} on each of {request.num_gpus} GPUs but only "
                f"{format_size(fitting)} fits on {request.num_gpus} GPUs; ask for at most {format_size(fitting)} each"
            )
        return request.memory, request.num_gpus

    def burst_limit_for(self, asked: int | None, guarantee: int, num_gpus: int, candidates: list[Device], owner: str,
                        groups: Iterable[str]) -> int:
        """Bytes per GPU a slice guaranteed ``guarantee`` may grow to: what the kernel asked for
        (``asked``; None: the pool's ``burst``; 0: a fixed slice), never above the largest GPU nor
        the user's or a group's maximum quota. 0 when it cannot grow at all."""
        if asked == 0:
            return 0
        largest = max((d.leasable for d in candidates), default=0)
        if asked is None:
            limit = self.policy.burst_limit_bytes(guarantee, largest)
        elif self.policy.burst == "0":
            raise RequestRefused(
                "this pool's slices are fixed (PoolPolicy.burst = 0), so a slice cannot have a limit above its size; ask without --limit"
            )
        elif asked < guarantee:
            raise InvalidInput(
                f"limit {format_size(asked)} is below the slice's size {format_size(guarantee)}; give a limit of at least the size"
            )
        else:
            limit = min(asked, largest)
        for _, quota in self._quotas(owner, groups):
            if quota.maximum is not None:
                limit = min(limit, quota.maximum // max(1, num_gpus))
        return limit if limit > guarantee else 0

    def _most_that_fits(self, sizes: list[int]) -> tuple[int, int]:
        """(GPUs, total bytes) of the largest single lease GPUs of ``sizes`` (largest first) can hold."""
        return max(((k, k * sizes[k - 1]) for k in range(1, min(len(sizes), self.policy.max_gpus_per_lease) + 1)), key=lambda item: item[1])

    def fewest_gpus(self, memory: int, sizes: list[int]) -> tuple[int, int] | None:
        """(GPUs, bytes each) of the fewest equal shares of ``memory`` that fit on GPUs of ``sizes``
        (largest first), within ``max_gpus_per_lease``; None when no number does. Shares are rounded
        up to whole MiB where that still fits."""
        for count in range(2, min(len(sizes), self.policy.max_gpus_per_lease) + 1):
            exact = -(-memory // count)
            rounded = -(-exact // MIB) * MIB
            if sizes[count - 1] >= rounded:
                return count, rounded
            if sizes[count - 1] >= exact:
                return count, exact
        return None

    def _check_queue_limits(self, state: PoolState, request: LeaseRequest) -> None:
        """Refuse a request past the per-user (or per-group) limit on waiting requests."""
        queued = [state.leases[lease_id] for lease_id in state.derived().queued]
        cap = self.policy.max_queued_per_user
        if cap:
            mine = sum(1 for lease in queued if lease.owner == request.owner)
            if mine >= cap:
                raise RequestRefused(
                    f"you already have {mine} requests waiting in the queue, the most one user may "
                    f"(PoolPolicy.max_queued_per_user = {cap}); wait for one to be granted, or release one "
                    "(jupyter gpupool leases, then jupyter gpupool release LEASE_ID)"
                )
        group_cap = self.policy.max_queued_per_group
        if group_cap:
            for group in request.groups:
                theirs = sum(1 for lease in queued if group in lease.groups)
                if theirs >= group_cap:
                    raise RequestRefused(
                        f"group {group} already has {theirs} requests waiting in the queue, the most one group may "
                        f"(PoolPolicy.max_queued_per_group = {group_cap}); wait for one of them to be granted"
                    )

    # --- the scheduler ----------------------------------------------------------------------------
    def schedule(self, state: PoolState, now: float) -> list[Decision]:
        """One pass: expire, flag lost GPUs, carry out due reclaims, grant, then plan reclaims."""
        decisions: list[Decision] = []
        decisions += self._expire_heartbeats(state, now)
        self._flag_unhealthy(state)
        decisions += self._expire_transitions(state, now)
        decisions += self._carry_out_due_reclaims(state, now)

        queue = self.queue_order(state, now)
        held_back: dict[str, int] = {}  # room the kernels waiting to grow, and not grown, wait for
        for wanter in self.reserve_wanters(state):  # a guarantee asked in a running kernel: burst yields to it
            decisions += self._serve_reserve(state, wanter, held_back, now)
        for wanter in self.grow_wanters(state):  # ahead of the queued requests: they hold a GPU and cannot run their cell
            decisions += self._serve_growth(state, wanter, held_back, now)
        blocked: Lease | None = None
        for lease in queue:
            if self._quota_block_reason(state, lease):
                continue
            if blocked is not None and not self._may_backfill(blocked, now):
                break
            free = self.free_by_device(state, lease)
            devices = self._place(state, lease, self._free_less(free, held_back) if held_back else free)
            if devices is None:
                if blocked is None and not lease.resume_ahead:  # a resume ahead of a cell makes no room for itself
                    blocked = lease
                continue
            self._grant(state, lease, devices, now)
            restoring = lease.transition is Transition.RESTORING
            moved = restoring and tuple(lease.devices) != tuple(lease.home_devices)
            what = ("resumed: restoring " + ("onto another GPU of the same model" if moved else "on its GPU")) if restoring else "granted"
            decisions.append(self._decision(DecisionKind.GRANT, lease, f"{what} {format_size(lease.memory)}", now))
        grown_now = {d.lease_id for d in decisions if d.kind is DecisionKind.GROW}  # like a backfill: not taken back at once

        decisions += self._follow_burst_reclaims(state, now)
        if blocked is not None:
            given_back, coming = self._plan_burst_reclaims(state, blocked, now, spare=grown_now, held_back=held_back)
            decisions += given_back
            if coming:
                if blocked.state is LeaseState.GRANTED:  # what it was short of was burst alone, and is free now
                    decisions.append(self._decision(DecisionKind.GRANT, blocked, f"granted {format_size(blocked.memory)}", now))
                blocked = None  # room is on its way from others' burst: nobody's guarantee is touched
        waiting = bool(state.derived().queued)
        decisions += self._plan_reservation_reclaims(state, now)
        moves = self._plan_defragmentation(state, blocked, now) if blocked is not None else []
        decisions += moves
        if moves:
            blocked = None  # moving idle kernels makes room: nobody loses their GPU for it
        decisions += self._plan_idle_reclaims(state, now, blocked if waiting else None)
        if blocked is None and self.policy.idle_policy == "pressure":
            decisions += self._plan_idle_reclaims_for_growth(state, now)
        if blocked is not None:
            decisions += self._plan_preemption(state, blocked, now)
        return decisions

    def queue_order(self, state: PoolState, now: float) -> list[Lease]:
        """Queued leases in service order: priority class (with aging), fair share, arrival."""
        queued = [state.leases[lease_id] for lease_id in state.derived().queued]
        if len(queued) < 2:
            return queued  # nothing to order: no need for everyone's fair-share usage
        usage = self.fair_share_usage(state, now, owners={lease.owner for lease in queued})
        return sorted(
            queued,
            key=lambda lease: (
                lease.resume_ahead,  # asked ahead of a cell: behind every real request
                -self.effective_rank(lease, now),
                not lease.resuming,  # a kernel resuming after a suspend goes first within its class
                usage.get(lease.owner, 0.0),
                lease.queued_since,
                lease.id,
            ),
        )

    def effective_rank(self, lease: Lease, now: float) -> float:
        rank = float(lease.priority.rank)
        if self.policy.aging_interval > 0:
            rank += math.floor(max(0.0, now - lease.queued_since) / self.policy.aging_interval)
        return rank

    def fair_share_usage(self, state: PoolState, now: float, owners: Collection[str] | None = None) -> dict[str, float]:
        """GiB·hours per owner: decayed history plus what live leases have held so far; only for
        ``owners`` when given (ordering a queue needs its owners', not everyone's)."""
        if owners is None:
            usage = dict(state.usage)
        else:
            usage = {owner: state.usage[owner] for owner in owners if owner in state.usage}
        for lease in state.leases.values():
            if lease.state in HELD_STATES and lease.granted_at is not None and (owners is None or lease.owner in owners):
                held = lease.memory * lease.num_gpus / GIB * max(0.0, now - lease.granted_at) / 3600
                usage[lease.owner] = usage.get(lease.owner, 0.0) + held
        return usage

    def _may_backfill(self, head: Lease, now: float) -> bool:
        return self.policy.backfill and now - head.created_at < self.policy.backfill_max_head_wait

    # --- placement --------------------------------------------------------------------------------
    def _candidate_devices(self, devices: list[Device], model: str | None) -> list[Device]:
        return [d for d in devices if d.healthy and (not model or model_matches(model, d))]

    def _lease_candidates(self, state: PoolState, lease: Lease) -> list[Device]:
        """Devices ``lease`` may be placed on: its model constraint, and for a kernel resuming after
        a suspend only GPUs of the exact model it ran on (its memory image restores onto no other)."""
        devices = self._candidate_devices(state.devices, lease.model)
        if lease.resuming and lease.home_model:
            devices = [d for d in devices if d.model == lease.home_model]
        return devices

    def _placement_policy(self, state: PoolState) -> PlacementPolicy:
        sizes = tuple(sorted(set(state.recent_requests[-200:])))
        cached = self._placement_cache
        if cached is not None and cached[0] == self.policy.placement and cached[1] == sizes:
            return cached[2]
        typical = typical_demands([Demand(per_gpu=size) for size in state.recent_requests[-200:]]) if sizes else None
        policy = make_policy(self.policy.placement, typical=typical)
        self._placement_cache = (self.policy.placement, sizes, policy)
        return policy

    @staticmethod
    def taken_by_device(state: PoolState) -> Mapping[str, int]:
        """Bytes not free per device uuid: ``max(slice, used)`` of each granted lease, plus memory
        held outside every grant. With a driver reading (:attr:`PoolState.driver`), what it shows
        is taken whoever holds it: a granted lease's processes count for no less than they hold,
        and what no granted lease on that GPU accounts for (a released or restarted kernel's, a
        shrunk slice's above its size, a process of nobody's) is taken beside the grants, never
        less than the watchers' last sighting of unpooled use."""
        held = state.derived().held
        if state.driver is None:
            if not state.unpooled:
                return held
            return {uuid: held.get(uuid, 0) + state.unpooled.get(uuid, 0) for uuid in {*held, *state.unpooled}}
        taken = dict(held)
        outside: dict[str, int] = {}
        for uuid, holders in state.driver.held().items():
            for lease_id, amount in holders.items():
                lease = state.leases.get(lease_id) if lease_id else None
                if lease is not None and lease.state is LeaseState.GRANTED and uuid in (*lease.devices, *lease.migrate_from):
                    booked = lease.memory + excess_per_device(lease)
                    if amount > booked:
                        taken[uuid] = taken.get(uuid, 0) + amount - booked
                else:
                    outside[uuid] = outside.get(uuid, 0) + amount
        for uuid in {*outside, *state.unpooled}:
            taken[uuid] = taken.get(uuid, 0) + max(outside.get(uuid, 0), state.unpooled.get(uuid, 0))
        return taken

    def free_by_device(self, state: PoolState, lease: Lease | None = None, reservations: bool = True) -> dict[str, int]:
        """Leasable bytes left per healthy device, as ``lease``'s owner sees it (reservations held back,
        unless ``reservations`` is False)."""
        taken = self.taken_by_device(state)
        free = {d.uuid: d.leasable - taken.get(d.uuid, 0) for d in state.devices if d.healthy}
        for reservation in state.reservations if reservations else ():
            if not reservation.active(state.now):
                continue
            if lease is not None and reservation.applies_to(lease.owner, lease.groups):
                continue
            members_hold = sum(
                other.memory * other.num_gpus
                for other in state.leases.values()
                if other.state in HELD_STATES and reservation.applies_to(other.owner, other.groups)
            )
            unused = max(0, reservation.memory - members_hold)
            # Hold the unused part back on the emptiest devices first.
            for uuid in sorted(free, key=lambda u: -free[u]):
                if unused <= 0:
                    break
                take = min(unused, max(0, free[uuid]))
                free[uuid] -= take
                unused -= take
        return free

    def _place(self, state: PoolState, lease: Lease, free: dict[str, int] | None = None) -> tuple[str, ...] | None:
        free = free if free is not None else self.free_by_device(state, lease)
        candidates = self._lease_candidates(state, lease)
        roomy = self._place_elastic(lease, candidates, free) if lease.elastic and lease.num_gpus == 1 and lease.peak_memory else None
        if lease.resuming and lease.home_devices and (roomy is None or roomy == lease.home_devices):
            # Back where it was when that GPU has room: a restore without a move.
            usable = {d.uuid for d in candidates}
            if all(u in usable and free.get(u, 0) >= lease.memory for u in lease.home_devices):
                return lease.home_devices
        if roomy is not None:
            return roomy
        if sum(1 for d in candidates if free.get(d.uuid, 0) >= lease.memory) < lease.num_gpus:
            return None  # too few GPUs with room: no placement policy finds one (the queue's head, tick after tick)
        gpus = [
            GpuSlot(uuid=d.uuid, model=d.model, capacity=d.leasable, free=max(0, free.get(d.uuid, 0)), nvlink_peers=d.nvlink_peers)
            for d in candidates
        ]
        node = NodeView(name="host", gpus=gpus)
        placement = self._placement_policy(state).place([node], Demand(per_gpu=lease.memory, num_gpus=lease.num_gpus))
        if placement is None:
            return None
        return tuple(placement.gpus)

    @staticmethod
    def _place_elastic(lease: Lease, candidates: list[Device], free: Mapping[str, int]) -> tuple[str, ...] | None:
        """A one-GPU elastic slice whose kernel ran before (a resume) goes where it can grow back to
        its last peak: the tightest GPU with that much free; None (the pool's placement) when none
        has. Packed by its guarantee beside others, it could not grow there and would have to move."""
        expected = min(lease.limit_size, max(lease.memory, -(-(lease.peak_memory or 0) // max(1, lease.num_gpus))))
        roomy = [(free.get(d.uuid, 0), d.uuid) for d in candidates if free.get(d.uuid, 0) >= expected]
        return (min(roomy)[1],) if roomy else None

    def _grant(self, state: PoolState, lease: Lease, devices: tuple[str, ...], now: float) -> None:
        if lease.resuming:  # its server restores the parked memory onto `devices`, then confirms
            lease.resuming = lease.resume_ahead = False
            lease.transition = Transition.RESTORING
            lease.transition_at = now
        lease.state = LeaseState.GRANTED
        lease.devices = devices
        lease.room_coming_at = None
        if lease.burst_limit:  # it grows on these GPUs: no further than the smallest of them holds
            smallest = min((d.leasable for d in state.devices if d.uuid in devices), default=lease.burst_limit)
            lease.burst_limit = min(lease.burst_limit, smallest) if min(lease.burst_limit, smallest) > lease.guarantee_size else 0
        lease.granted_at = now
        lease.heartbeat_at = now
        lease.last_activity = now
        lease.warned_at = lease.reclaim_at = None
        lease.reclaim_reason = ""
        state.touch(lease)

    # --- quotas -----------------------------------------------------------------------------------
    def _quotas(self, owner: str, groups: Iterable[str]) -> list[tuple[str, Quota]]:
        """(who, quota) pairs that limit this owner: their own, then each group's."""
        result = [("your", self.policy.quota_for_user(owner))]
        for group in groups:
            quota = self.policy.quota_for_group(group)
            if quota is not None:
                result.append((f"group {group}'s", quota))
        return result

    def holdings(self, state: PoolState, owner: str | None = None, group: str | None = None) -> tuple[int, int]:
        """(bytes held, number of live non-queued leases) for an owner or a group."""
        return state.derived().holdings(owner=owner, group=group)


    def _quota_block_reason(self, state: PoolState, lease: Lease) -> str:
        """Why quota keeps this queued lease waiting, or ``""``."""
        total = lease.memory * lease.num_gpus
        for who, quota in self._quotas(lease.owner, lease.groups):
            if who == "your":
                held, count = self.holdings(state, owner=lease.owner)
            else:
                held, count = self.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + total > quota.maximum:
                return f"waits for {who} quota: {format_size(held)} of {format_size(quota.maximum)} in use"
            if quota.max_leases is not None and count >= quota.max_leases:
                return f"waits for {who} lease limit: {count} of {quota.max_leases} in use"
        return ""

    def guarantee_for(self, state: PoolState, lease: Lease, extra: int = 0) -> str:
        """Whose guarantee covers ``lease`` (``"your"``, ``"group staff's"``) with ``extra`` bytes more held, or ``""``.

        User and group guarantees combine as alternatives: a lease is within guarantee when what its
        owner holds fits in the owner's own guarantee, or what one of its groups' members hold
        together fits in that group's guarantee. A group's guarantee is shared by its members.
        """
        user_guarantee = self.policy.quota_for_user(lease.owner).guaranteed
        if user_guarantee > 0:
            held, _ = self.holdings(state, owner=lease.owner)
            if held + extra <= user_guarantee:
                return "your"
        for group in lease.groups:
            quota = self.policy.quota_for_group(group)
            if quota is not None and quota.guaranteed > 0:
                held, _ = self.holdings(state, group=group)
                if held + extra <= quota.guaranteed:
                    return f"group {group}'s"
        return ""

    def within_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """Whether a queued lease, once granted, stays within its owner's or one of its groups' guarantee."""
        return bool(self.guarantee_for(state, lease, extra=lease.memory * lease.num_gpus))

    def over_guarantee(self, state: PoolState, lease: Lease) -> bool:
        """Whether a granted lease is covered by no guarantee (so a request within one may preempt it)."""
        return not self.guarantee_for(state, lease)

    # --- reclaim: idle and preemption -------------------------------------------------------------
    def _expire_heartbeats(self, state: PoolState, now: float) -> list[Decision]:
        if state.derived().nothing_expires(now, self.policy.heartbeat_ttl):
            return []
        decisions = []
        for lease in list(state.leases.values()):
            if lease.state is LeaseState.RELEASED or lease.heartbeat_at is None:
                continue
            if lease.holder_pid is None and lease.duration is not None:
                # A booked slice (CLI, API) with no process behind it lasts its duration.
                if lease.expected_end is not None and lease.expected_end <= now:
                    reason = f"released: its time ({format_duration(lease.duration)}) is over"
                    self.release(state, lease.id, reason, now)
                    decisions.append(self._decision(DecisionKind.RELEASE, lease, reason, now))
                continue
            if now - lease.heartbeat_at > self.policy.heartbeat_ttl:
                reason = f"released: its holder sent no heartbeat for {format_duration(now - lease.heartbeat_at)}"
                self.release(state, lease.id, reason, now)
                decisions.append(self._decision(DecisionKind.RELEASE, lease, reason, now))
        return decisions

    def _flag_unhealthy(self, state: PoolState) -> None:
        """Flag held leases whose GPU is unhealthy or gone from the inventory (a MIG instance the
        admin destroyed, a GPU that vanished): their users are told, the lease is never moved."""
        index = state.derived()
        if not index.flagged and {d.uuid for d in state.devices if d.healthy}.issuperset(index.held):
            return  # no held lease is flagged, and every GPU a lease holds is here and healthy
        lost = {d.uuid: d.health_reason or "GPU unhealthy" for d in state.devices if not d.healthy}
        present = {d.uuid for d in state.devices}
        gone = "GPU or MIG instance no longer present (the admin changed the layout, or the GPU fell off the bus)"
        for lease in state.leases.values():
            if lease.state in HELD_STATES:
                flag = "; ".join(lost.get(u, gone) for u in lease.devices if u in lost or u not in present)
                if flag != lease.flagged:
                    lease.flagged = flag
                    state.touch(lease)

    def _still_idle(self, lease: Lease, now: float) -> bool:
        if lease.busy:
            return False
        if lease.keep_until is not None and lease.keep_until > now:
            return False
        # Active again since the warning: the warning no longer stands.
        return not (lease.warned_at is not None and lease.last_activity is not None and lease.last_activity > lease.warned_at)

    def _carry_out_due_reclaims(self, state: PoolState, now: float) -> list[Decision]:
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
                    pressure_gone = not self.reservation_needs(state, now)  # window closed, or members hold it
                else:
                    pressure_gone = self.policy.idle_policy == "pressure" and not someone_waits
                if not self._still_idle(lease, now) or pressure_gone or self.policy.idle_policy == "never":
                    lease.warned_at = lease.reclaim_at = None
                    lease.reclaim_reason = ""
                    state.touch(lease)
                    continue
            if lease.reclaim_at > now:
                continue
            kind = DecisionKind.PREEMPT if preempting else DecisionKind.RECLAIM_IDLE
            reason = lease.reclaim_reason
            why_not = self.suspend_refusal(state, lease)
            if not why_not:
                decisions.append(self._begin_suspend(state, lease, reason, now))
                continue
            if self.policy.reclaim_action == "suspend" and lease.suspendable:
                reason += f" (not suspended: {why_not})"
            self.release(state, lease.id, reason, now)
            decisions.append(self._decision(kind, lease, reason, now))
        return decisions

    def _plan_idle_reclaims(self, state: PoolState, now: float, blocked: Lease | None) -> list[Decision]:
        policy = self.policy.idle_policy
        if policy == "never":
            return []
        protected = self._reserved_for_others(state, blocked, now) if blocked is not None else (lambda lease: False)
        idle = [
            lease
            for lease in state.leases.values()
            if lease.state in HELD_STATES
            and lease.reclaim_at is None
            and lease.transition is Transition.NONE
            and self._still_idle(lease, now)
            and lease.idle_seconds(now) >= self._idle_timeout(state, lease)
            and (policy == "always" or not protected(lease))
        ]
        idle.sort(key=lambda lease: -lease.idle_seconds(now))
        chosen: list[Lease] = []
        if policy == "always":
            chosen = idle
        elif blocked is not None:
            # Longest idle first, only as many as make room for the request that cannot fit.
            free = self._free_with_room_on_its_way(state, blocked, now)
            for lease in idle:
                if self._place(state, blocked, free) is not None:
                    break
                chosen.append(lease)
                for uuid in lease.devices:
                    free[uuid] = free.get(uuid, 0) + lease.memory
            if chosen and self._place(state, blocked, free) is None:
                chosen = []  # reclaiming every idle slice would still not make room: leave them alone
        decisions = []
        waiting = sum(1 for lease in state.leases.values() if lease.state is LeaseState.QUEUED)
        for lease in chosen:
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.warning_period
            idle_for = format_duration(lease.idle_seconds(now))
            lease.reclaim_reason = (
                f"reclaimed: idle for {idle_for} while {counted(waiting, 'request')} waited for a GPU"
                if policy == "pressure"
                else f"reclaimed: idle for {idle_for}, over the {format_duration(self._idle_timeout(state, lease))} idle timeout"
            )
            state.touch(lease)
            decisions.append(
                self._decision(DecisionKind.WARN_IDLE, lease, f"idle for {idle_for}; its slice goes back unless kept", now, lease.reclaim_at)
            )
        return decisions

    def _plan_idle_reclaims_for_growth(self, state: PoolState, now: float) -> list[Decision]:
        """Under pressure a kernel waiting to grow is pressure too: reclaim kernels idle past their
        timeout (longest idle first, as for a request) where that makes its room, on its own GPU or
        on one of its model it can move to. One kernel at a time; none while a reclaim is under way."""
        index = state.derived()
        if index.reclaiming or any(step is Transition.SUSPENDING for step in index.transitions.values()):
            return []  # room is on its way
        wanters = [lease for lease in self.grow_wanters(state) if lease.state is LeaseState.GRANTED
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
            and self._still_idle(lease, now)
            and lease.idle_seconds(now) >= self._idle_timeout(state, lease)
        ]
        if not idle:
            return []
        idle.sort(key=lambda lease: -lease.idle_seconds(now))
        known = {d.uuid: d for d in state.devices if d.healthy}
        wanter = wanters[0]
        free = self.free_by_device(state, wanter)
        home = wanter.devices[0]
        model = known[home].model if home in known else None
        movable = self.policy.defragment and not self.suspend_refusal(state, wanter)
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
                idle_for = format_duration(lease.idle_seconds(now))
                lease.reclaim_reason = f"reclaimed: idle for {idle_for} while a kernel beside it waited for its slice to grow"
                state.touch(lease)
                decisions.append(
                    self._decision(DecisionKind.WARN_IDLE, lease, f"idle for {idle_for}; its slice goes back unless kept", now, lease.reclaim_at)
                )
            return decisions
        return []

    def _free_with_room_on_its_way(self, state: PoolState, head: Lease, now: float) -> dict[str, int]:
        """Free bytes per device as ``head`` sees them, plus what leases already on their way out
        will free: warned leases, leases being suspended, the GPUs moving leases leave, and burst
        being given back (within ``burst_settle`` of being taken back)."""
        free = self.free_by_device(state, head)
        index = state.derived()
        for lease_id in (*index.reclaiming, *index.transitions):
            lease = state.leases[lease_id]
            if lease.transition is Transition.MIGRATING:
                leaving: tuple[str, ...] = lease.migrate_from
            elif lease.transition is Transition.RESTORING:
                continue  # coming back, not leaving
            else:
                leaving = lease.devices
            for uuid in leaving:
                free[uuid] = free.get(uuid, 0) + lease.memory
        for lease in state.leases.values():  # burst being given back, within the time it has for that
            if lease.burst_taken_at is not None and now_within(lease.burst_taken_at, now, self.policy.burst_settle):
                for uuid in lease.devices:
                    free[uuid] = free.get(uuid, 0) + excess_per_device(lease)
        return free

    def grace_after_outage(self, state: PoolState, now: float) -> int:
        """After the pool could not be reached (a broker restart): every live lease gets a fresh
        heartbeat, warnings whose deadline passed or is near start over (their users could not
        answer them), and suspends, restores and moves under way get a full ``transition_timeout``.
        Returns how many leases were touched."""
        for lease in state.leases.values():
            lease.heartbeat_at = now
            if lease.reclaim_at is not None:
                period = self.policy.grace_period if lease.reclaim_reason.startswith("preempt") else self.policy.warning_period
                if lease.reclaim_at < now + period:
                    lease.warned_at = now
                    lease.reclaim_at = now + period
            if lease.transition is not Transition.NONE:
                lease.transition_at = now
            state.touch(lease)
        return len(state.leases)

    # --- suspend, resume and live moves ------------------------------------------------------------
    def parked_budget(self, state: PoolState) -> int:
        """Bytes of host RAM parked slices may take together."""
        return self.policy.parked_budget(state.host_memory)

    def _idle_timeout(self, state: PoolState, lease: Lease) -> float:
        """Idle time before ``lease`` may be reclaimed: the policy's suspend idle timeout where the
        reclaim would suspend it now, else its idle timeout (a cull)."""
        return self.policy.idle_timeout_for(not self.suspend_refusal(state, lease))

    def suspend_refusal(self, state: PoolState, lease: Lease) -> str:
        """Why ``lease`` cannot be suspended now (one clause for the user), or ``""`` if it can."""
        if self.policy.reclaim_action != "suspend":
            return "the pool's reclaim action is cull"
        if not lease.suspendable:
            return "its server cannot park GPU memory (no checkpoint support there)"
        if lease.state is not LeaseState.GRANTED or lease.transition is not Transition.NONE:
            return "it is not running on a GPU right now" if lease.state is not LeaseState.GRANTED else f"it is {lease.transition.value}"
        if lease.flagged:
            return f"its GPU is unusable ({lease.flagged})"
        budget = self.parked_budget(state)
        index = state.derived()
        parked = index.parked
        needed = park_size(lease)
        # Pinned backups beyond the parks that hold them; this one's becomes its park, all that does not fit in it stays beside.
        kept = index.pinned_kept - pinned_beside_park(lease) + max(0, lease.pinned_backup - needed)
        if parked + needed + kept > budget:
            beside = f" beside {format_size(kept)} of pinned backups running kernels keep" if kept else ""
            return (
                f"parked slices would take {format_size(parked + needed)} of host RAM{beside}, over the limit of "
                f"{format_size(budget)} (parked_memory_limit)"
            )
        return ""

    def reserve_pinned_backup(self, state: PoolState, lease_id: str, amount: int, now: float) -> Lease:
        """Set aside ``amount`` bytes of the host's pinned parking pool for this lease's framework
        backup (its holder's server asks before a fast park; a repeat sets its own figure, 0 gives it
        back). Raises :class:`RequestRefused` saying why when the pool or the parked-memory budget
        has no room, or the figure is more than the kernel may hold on its GPUs; nothing changes then."""
        lease = self.get(state, lease_id)
        if lease.state is LeaseState.RELEASED:
            raise RequestRefused("cannot keep a pinned backup: the lease was released")
        amount = max(0, int(amount))
        # What its kernel may hold now (its slice's current size, or its measured use), or has parked: never more.
        ceiling = pinned_ceiling(lease)
        if amount > ceiling:
            raise RequestRefused(
                f"a pinned backup of {format_size(amount)} is more than this kernel may hold on its GPUs "
                f"({format_size(ceiling)}); nothing was set aside"
            )
        index = state.derived()
        capacity = self.policy.parking_pool_bytes(state.host_memory)
        if amount > lease.pinned_backup:
            if lease.state is not LeaseState.GRANTED:
                raise RequestRefused(f"cannot set a pinned backup aside: the kernel is {lease.state.value}, not running on a GPU")
            if not lease.suspendable:  # nothing would ever be parked into it: it would only keep others from parking
                raise RequestRefused("cannot set a pinned backup aside: its server cannot park GPU memory (no checkpoint support there)")
            others = index.pinned - lease.pinned_backup
            if not capacity:
                raise RequestRefused("the pool has no pinned parking pool (parking_pool_size is 0, or no parked-memory budget)")
            if others + amount > capacity:
                raise RequestRefused(
                    f"the host's pinned parking pool has {format_size(max(0, capacity - others))} free of "
                    f"{format_size(capacity)}, and this kernel's backup needs {format_size(amount)}"
                )
            budget = self.parked_budget(state)
            kept = index.pinned_kept - pinned_beside_park(lease)
            if lease.parked_memory:  # being parked or restored: what exceeds its park is host RAM beside it
                parked, kept = index.parked, kept + max(0, amount - lease.parked_memory)
            else:  # running: its backup takes host RAM as a park does
                parked = index.parked + amount
            if parked + kept > budget:
                raise RequestRefused(
                    f"parked slices ({format_size(parked)}) and the pinned backups running kernels keep "
                    f"({format_size(kept)}) would take more than the parked-memory budget of {format_size(budget)} "
                    "(parked_memory_limit)"
                )
        if amount != lease.pinned_backup:
            lease.pinned_backup = amount
            state.touch(lease)
        return lease

    def suspend(self, state: PoolState, lease_id: str, reason: str, now: float) -> Decision:
        """Ask the holder's server to park this lease's GPU memory (a user's or an admin's wish);
        raises :class:`RequestRefused` saying why when it cannot be."""
        lease = self.get(state, lease_id)
        state.read_use(lease)  # judged at what the GPU shows now
        why_not = self.suspend_refusal(state, lease)
        if why_not:
            raise RequestRefused(f"cannot suspend this kernel: {why_not}")
        return self._begin_suspend(state, lease, reason, now)

    def _begin_suspend(self, state: PoolState, lease: Lease, reason: str, now: float) -> Decision:
        """Phase one of a suspend: the lease still holds its GPU memory until the server confirms.
        Booked at no less than what the driver shows its kernel holding as it begins."""
        state.read_use(lease)
        lease.transition = Transition.SUSPENDING
        lease.transition_at = now
        lease.suspend_reason = reason
        lease.grow_wanted, lease.grow_since = 0, None  # parked, it wants nothing; back on a GPU it asks again
        lease.used_at_suspend = lease.used_memory or 0  # the GPU's word, before the server's: the floor of its report
        lease.parked_memory = park_size(lease)  # set aside now; the real figure on confirm
        lease.warned_at = lease.reclaim_at = None
        lease.reclaim_reason = ""
        state.touch(lease)
        return self._decision(DecisionKind.SUSPEND, lease, reason, now)

    def resume(self, state: PoolState, lease_id: str, now: float, ahead: bool = False) -> Lease:
        """Queue a suspended lease to come back (its next cell, a Resume button). Harmless on a lease
        that is already queued to resume, being restored, or running. ``ahead``: asked before any
        cell needs it (the notebook got focus), so it waits behind every real request; a real ask
        later makes it a real one."""
        lease = self.get(state, lease_id)
        if lease.state is LeaseState.SUSPENDED:
            lease.state = LeaseState.QUEUED
            lease.resuming = True
            lease.resume_asked_at = now
            lease.resume_ahead = ahead
            state.touch(lease)
        elif lease.resume_ahead and not ahead and lease.state is LeaseState.QUEUED:
            lease.resume_ahead = False
            state.touch(lease)
        return lease

    def confirm_transition(self, state: PoolState, lease_id: str, now: float, parked_bytes: int | None = None) -> Lease:
        """Phase two: the server finished the suspend (``parked_bytes`` now in host RAM), the
        restore or the move. Raises :class:`InvalidInput` if nothing was under way."""
        lease = self.get(state, lease_id)
        step = lease.transition
        if step is Transition.SUSPENDING and parked_bytes is not None:
            parked_bytes = self.bounded_parked_bytes(state, lease, parked_bytes)
        if step is Transition.SUSPENDING:
            # Metering: the granted interval ends here; a resume opens a new one.
            self._count_unwritten_busy_time(lease, now)
            state.closed_intervals.append(lease.copy(released_at=now))
            lease.state = LeaseState.SUSPENDED
            lease.home_devices = lease.devices
            known = {d.uuid: d for d in state.devices}
            lease.home_model = next((known[u].model for u in lease.devices if u in known), lease.home_model)
            lease.devices = ()
            lease.parked_memory = max(0, int(parked_bytes)) if parked_bytes is not None else lease.parked_memory
            lease.suspended_at = now
            lease.suspensions += 1
            lease.busy = False
            lease.memory_history = ()
            lease.active_seconds = 0.0  # the closed interval carries it: a resumed one starts again
            lease.used_memory = lease.over_limit_since = None  # it holds no GPU memory: no stale over-limit mark
            # ...and no burst still to give back: restored, it is a slice at its size again, not one to suspend at once
            lease.burst_taken_at, lease.burst_from = None, 0
        elif step is Transition.RESTORING:
            lease.restore_failures = 0
            if lease.suspended_at is not None:
                lease.parked_seconds += max(0.0, now - lease.suspended_at)
            lease.suspended_at = None
            lease.parked_memory = 0
            lease.home_devices = ()
            lease.suspend_reason = ""
            lease.last_activity = now
        elif step is Transition.MIGRATING:
            lease.migrate_from = ()
            lease.parked_memory = 0
            lease.suspend_reason = ""
        else:
            raise InvalidInput(f"lease {lease_id} is not being suspended, restored or moved")
        lease.transition = Transition.NONE
        lease.transition_at = None
        state.touch(lease)
        return lease

    @staticmethod
    def bounded_parked_bytes(state: PoolState, lease: Lease, parked_bytes: int) -> int:
        """What a suspend report may say was parked: never more than the lease held (its slice, or
        the most the watchdog saw it use), never less than the watchdog measured its kernel holding
        when the suspend began (a server cannot report its way under the host-RAM budget). A
        figure its GPUs could not even hold is refused."""
        known = {d.uuid: d.memory_total for d in state.devices}
        capacity = sum(known.get(uuid, 0) for uuid in lease.devices) or lease.memory * lease.num_gpus
        if parked_bytes > capacity:
            raise InvalidInput(
                f"parked_bytes {parked_bytes} is more than this lease's GPUs hold ({format_size(capacity)}); "
                "report the bytes the suspend copied to host RAM"
            )
        reported = min(max(0, int(parked_bytes)), max(lease.memory * lease.num_gpus, lease.peak_memory or 0))
        return max(reported, lease.used_at_suspend)

    def fail_transition(self, state: PoolState, lease_id: str, error: str, still_running: bool, now: float) -> list[Decision]:
        """The server could not finish a suspend, restore or move (``error``: why, one line).
        ``still_running``: the kernel is as it was before (a checkpoint that failed and was undone, or a
        restore that failed with the memory still parked).

        A failed suspend for a reclaim falls back to culling; one the user asked for is called off;
        a failed move is called off; a restore that failed with the memory still parked goes back to
        suspended once (the next try restores it). A second restore failure in a row, or anything
        that left the kernel broken, stops it: its lease is released (and nothing is counted twice).
        """
        lease = self.get(state, lease_id)
        step = lease.transition
        if step is Transition.NONE:
            raise InvalidInput(f"lease {lease_id} is not being suspended, restored or moved")
        if still_running and step is Transition.SUSPENDING and lease.suspend_reason.startswith(("reclaimed", "preempted")):
            kind = DecisionKind.PREEMPT if lease.suspend_reason.startswith("preempted") else DecisionKind.RECLAIM_IDLE
            reason = f"{lease.suspend_reason} (suspending failed: {error}; so the kernel was shut down)"
            self.release(state, lease_id, reason, now)
            return [self._decision(kind, lease, reason, now)]
        if still_running and step is Transition.RESTORING and lease.restore_failures < 1:
            # The memory is still parked, intact: back to suspended; the next cell (or Resume) tries again.
            state.closed_intervals.append(lease.copy(released_at=now))  # granted for the try: metered
            lease.state = LeaseState.SUSPENDED
            lease.devices = ()
            lease.transition = Transition.NONE
            lease.transition_at = None
            lease.restore_failures += 1
            lease.suspend_reason = f"restoring failed ({error}); it stays suspended and the next try restores it"
            lease.memory_history = ()
            state.touch(lease)
            return []
        if still_running and step in (Transition.SUSPENDING, Transition.MIGRATING):
            if step is Transition.MIGRATING:
                lease.devices, lease.migrate_from = lease.migrate_from, ()
            lease.transition = Transition.NONE
            lease.transition_at = None
            lease.parked_memory = 0
            lease.suspend_reason = ""
            state.touch(lease)
            return []
        what = {Transition.SUSPENDING: "suspending", Transition.RESTORING: "restoring", Transition.MIGRATING: "moving"}[step]
        reason = f"stopped: {what} its GPU memory failed ({error})"
        self.release(state, lease_id, reason, now)
        return [self._decision(DecisionKind.RELEASE, lease, reason, now)]

    def _expire_transitions(self, state: PoolState, now: float) -> list[Decision]:
        """Give up on suspends, restores and moves that took longer than ``transition_timeout``."""
        index = state.derived()
        if not index.transitions:
            return []
        decisions: list[Decision] = []
        limit = self.policy.transition_timeout
        for lease_id, step in list(index.transitions.items()):
            lease = state.leases[lease_id]
            started = lease.transition_at if lease.transition_at is not None else now
            if now - started <= limit:
                continue
            error = f"it did not finish within {format_duration(limit)}"
            decisions += self.fail_transition(state, lease_id, error, still_running=step is Transition.SUSPENDING, now=now)
        return decisions

    def _plan_defragmentation(self, state: PoolState, head: Lease, now: float) -> list[Decision]:
        """Make room for ``head`` by moving idle, suspendable kernels off one GPU onto others of the
        same model (suspend there, restore here), when that alone lets it fit. One plan at a time."""
        index = state.derived()
        if not self.policy.defragment or head.num_gpus != 1 or self.policy.reclaim_action != "suspend":
            return []
        if any(step is Transition.MIGRATING for step in index.transitions.values()):
            return []  # a move is under way: its room is coming
        free = self._free_with_room_on_its_way(state, head, now)
        if self._place(state, head, free) is not None:
            return []
        movable = [
            lease
            for lease in state.leases.values()
            if lease.state is LeaseState.GRANTED
            and lease.num_gpus == 1
            and lease.reclaim_at is None
            and self._still_idle(lease, now)
            and lease.idle_seconds(now) >= self.policy.defragment_min_idle
            and not self.suspend_refusal(state, lease)
        ]
        if not movable:
            return []
        known = {d.uuid: d for d in state.devices if d.healthy}
        budget_left = self.parked_budget(state) - index.parked
        targets = sorted(self._lease_candidates(state, head), key=lambda d: head.memory - free.get(d.uuid, 0))
        for device in targets:
            missing = head.memory - free.get(device.uuid, 0)
            if device.leasable < head.memory or missing <= 0:
                continue
            room = {u: f for u, f in self.free_by_device(state, None, reservations=False).items() if u != device.uuid and u in known}
            plan: list[tuple[Lease, str]] = []
            gained = 0
            parked = 0
            for lease in sorted((m for m in movable if m.devices == (device.uuid,)), key=lambda m: -m.memory):
                fits = [(f, u) for u, f in room.items() if f >= lease.memory and known[u].model == device.model]
                if not fits or parked + park_size(lease) > budget_left:
                    continue
                _, target = min(fits)  # the tightest GPU that takes it
                room[target] -= lease.memory
                plan.append((lease, target))
                gained += lease.memory
                parked += park_size(lease)
                if gained >= missing:
                    break
            if gained < missing:
                continue
            decisions = []
            for lease, target in plan:
                lease.transition = Transition.MIGRATING
                lease.transition_at = now
                lease.migrate_from = lease.devices
                lease.devices = (target,)
                lease.parked_memory = park_size(lease)  # passes through host RAM
                lease.suspend_reason = f"moved to another GPU to make room for {format_size(head.memory)} for {head.owner}"
                state.touch(lease)
                decisions.append(self._decision(DecisionKind.MIGRATE, lease, lease.suspend_reason, now))
            return decisions
        return []

    # --- elastic slices: grow on demand, give burst back under pressure -----------------------------
    def _set_size(self, state: PoolState, lease: Lease, memory: int, now: float) -> None:
        """Change a lease's current size, keeping what metering needs: each size's time."""
        if memory == lease.memory:
            return
        if lease.state is LeaseState.GRANTED:
            lease.memory_history = (*lease.memory_history, (now, lease.memory))
        lease.memory = memory
        state.touch(lease)

    @staticmethod
    def _lowered(state: PoolState, lease: Lease, before: int) -> None:
        """A path just lowered what granted ``lease`` may hold on its GPUs (from ``before`` bytes per
        GPU). Whatever the driver shows held stays taken in every decision (see
        :meth:`taken_by_device`); besides, a kernel the watchdog measured counts at ``before``
        until it measures it within its new size (:attr:`Lease.burst_from`). One nobody measured
        counts for what the driver shows, decision by decision; where the pool reads no driver, at
        ``before`` too."""
        measured = lease.used_memory is not None
        lease.burst_from = before if measured or state.driver is None else 0
        state.touch(lease)

    def _waiting_for(self, state: PoolState, lease: Lease, in_line: bool = False) -> list[Lease]:
        """Queued requests that would fit on one of ``lease``'s GPUs if every slice there were at
        its guarantee (``in_line``: only those the pool is taking burst back for, which a kernel
        waiting to grow yields to): burst never takes their room. A request that does not fit even
        then waits for a guarantee to end, not for burst."""
        mine = set(lease.devices)
        waiting = [other for other in self.reserve_wanters(state) if other.id != lease.id and mine & set(other.devices)]
        room: dict[str, int] | None = None
        for lease_id in state.derived().queued:
            other = state.leases[lease_id]
            if other.id == lease.id or (in_line and other.room_coming_at is None):
                continue
            if room is None:
                room = self._room_at_guarantees(state)
            if any(d.uuid in mine and room.get(d.uuid, 0) >= other.memory for d in self._lease_candidates(state, other)):
                waiting.append(other)
        return waiting

    def _room_at_guarantees(self, state: PoolState) -> dict[str, int]:
        """Bytes free per device if every slice gave its burst back (what admission counts)."""
        room = self.free_by_device(state)
        for other in state.leases.values():
            if other.state in HELD_STATES:
                above = max(0, other.memory + excess_per_device(other) - other.guarantee_size)
                for uuid in other.devices:
                    if uuid in room:
                        room[uuid] += above
        return room

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
        lease = self.get(state, lease_id)
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
        result = self._grow_into(state, lease, wanted, self.free_by_device(state, lease), now)
        if isinstance(result, str):
            if result.startswith("the slice was not grown: the GPU is full"):
                self._want_growth(state, lease, wanted, now, queue)
            raise RequestRefused(result)
        return result

    def _want_growth(self, state: PoolState, lease: Lease, wanted: int, now: float, queue: bool) -> None:
        """Record a grow refused for room: it waits in line (see :meth:`_serve_growth`)."""
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
        for who, quota in self._quotas(lease.owner, lease.groups):
            held, _ = self.holdings(state, owner=lease.owner) if who == "your" else self.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + (target - lease.memory) * gpus > quota.maximum:
                most = lease.memory + max(0, quota.maximum - held) // gpus
                if most < wanted:
                    return f"the slice was not grown: {who} maximum quota is {format_size(quota.maximum)}; it stays {size}"
                target = most
        self._set_size(state, lease, target, now)
        lease.burst_taken_at, lease.burst_from = None, 0
        lease.over_limit_since = None
        if target >= lease.grow_wanted:
            lease.grow_wanted, lease.grow_since = 0, None
        lease.burst_note = (
            f"grown to {format_size(target * gpus)} on demand ({format_size(lease.guarantee_size * gpus)} guaranteed, "
            f"up to {format_size(limit * gpus)})"
        )
        state.touch(lease)
        return self._decision(DecisionKind.GROW, lease, lease.burst_note, now)

    def grow_wanters(self, state: PoolState) -> list[Lease]:
        """Granted kernels waiting for their slice to grow, in line order."""
        wanters = [lease for lease in state.leases.values() if lease.grow_since is not None]
        return sorted(wanters, key=lambda lease: (lease.line_time, lease.id))

    def grow_place(self, state: PoolState, lease_id: str, now: float) -> int | None:
        """1-based place in line of a kernel waiting to grow, counting only who the scheduler
        serves before it and who could take room on its GPUs: queued requests ahead of its turn
        (not held back by quota) and kernels that wait to grow and joined the line before it.
        None when it does not wait to grow."""
        lease = self.get(state, lease_id)
        if lease.grow_since is None:
            return None
        mine = set(lease.devices)
        # Requests the pool takes burst back for, that would fit at guarantees on its GPUs, come first.
        ahead = sum(1 for other in self._waiting_for(state, lease, in_line=True) if not self._quota_block_reason(state, other))
        for other in self.grow_wanters(state):
            if other.id == lease.id:
                break
            ahead += bool(mine & set(other.devices))
        return ahead + 1

    def _serve_growth(self, state: PoolState, lease: Lease, held_back: dict[str, int], now: float) -> list[Decision]:
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
            self._hold_back(held_back, lease, wanted)
            return []
        if self._waiting_for(state, lease, in_line=True):
            return []  # a request that burst is taken back for, and that fits at guarantees, goes first
        free = self._free_less(self.free_by_device(state, lease), held_back)
        grown = self._grow_into(state, lease, wanted, free, now)
        if not isinstance(grown, str):
            return [grown]
        if not grown.startswith("the slice was not grown: the GPU is full"):
            lease.burst_note = grown
            self._grow_wanted_done(state, lease)  # its limit or quota: waiting does not help
            return []
        moved = self._move_to_grow(state, lease, wanted, free, now)
        if moved is not None:
            self._hold_back(held_back, lease, wanted)
            return [moved]
        decisions = self._take_neighbours_burst(state, lease, wanted, free, now)
        self._hold_back(held_back, lease, wanted)
        return decisions

    @staticmethod
    def _free_less(free: dict[str, int], held_back: Mapping[str, int]) -> dict[str, int]:
        return {uuid: room - held_back.get(uuid, 0) for uuid, room in free.items()} if held_back else free

    @staticmethod
    def _hold_back(held_back: dict[str, int], lease: Lease, wanted: int) -> None:
        for uuid in lease.devices:
            held_back[uuid] = held_back.get(uuid, 0) + max(0, wanted - lease.memory)

    def _move_to_grow(self, state: PoolState, lease: Lease, wanted: int, free: Mapping[str, int], now: float) -> Decision | None:
        """A MIGRATE of ``lease`` to the tightest GPU of its model with ``wanted`` bytes free, or None."""
        if lease.num_gpus != 1 or not self.policy.defragment or self.suspend_refusal(state, lease):
            return None
        home = lease.devices[0]
        known = {d.uuid: d for d in state.devices if d.healthy}
        model = known[home].model if home in known else None
        fits = [(room, uuid) for uuid, room in free.items() if uuid != home and uuid in known and known[uuid].model == model and room >= wanted]
        if model is None or not fits:
            return None
        _, target = min(fits)
        lease.transition = Transition.MIGRATING
        lease.transition_at = now
        lease.migrate_from = lease.devices
        lease.devices = (target,)
        lease.parked_memory = park_size(lease)  # passes through host RAM
        lease.suspend_reason = f"moved to another GPU with room for its slice to grow to {format_size(wanted)}"
        state.touch(lease)
        return self._decision(DecisionKind.MIGRATE, lease, lease.suspend_reason, now)

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
            if not (self._still_idle(other, now) and not self.suspend_refusal(state, other)):
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
            decisions.append(self._take_burst_back(state, other, new_size, f"a neighbour's slice that needs {format_size(wanted)}", now))
        return decisions

    def _take_burst_back(self, state: PoolState, lease: Lease, new_size: int, taken_for: str, now: float) -> Decision:
        """Lower ``lease`` to ``new_size`` bytes per GPU for ``taken_for`` (its kernel frees caches and
        lowers its caps to it): a SHRINK decision. What its kernel still holds above the new size
        stays taken (see :meth:`_lowered`)."""
        gpus = max(1, lease.num_gpus)
        before = max(lease.memory, lease.burst_from if lease.burst_taken_at is not None else 0)
        self._set_size(state, lease, new_size, now)
        self._lowered(state, lease, before)
        lease.burst_taken_at = now
        lease.burst_note = (
            f"{BURST_TAKEN} for {taken_for}: the slice is {format_size(new_size * gpus)} now "
            f"({format_size(lease.guarantee_size * gpus)} guaranteed)"
        )
        state.touch(lease)
        return self._decision(DecisionKind.SHRINK, lease, lease.burst_note, now)

    def _plan_burst_reclaims(self, state: PoolState, head: Lease, now: float, spare: Collection[str] = (),
                             held_back: Mapping[str, int] | None = None) -> tuple[list[Decision], bool]:
        """Make room for ``head`` from other slices' burst, before anyone's guarantee: lower their
        size toward their guarantee (their kernels free framework caches and lower caps to it).
        Spared: ``spare`` (grown in this pass) and kernels whose grow was asked before ``head``; a
        busy kernel gives its burst back too (warned by the watchdog if it does not, never killed).
        ``held_back``: room kernels waiting to grow wait for, which ``head`` may not take (burst taken
        back for ``head`` is its own: they yield it, :attr:`Lease.room_coming_at`). Returns the
        decisions and whether room for ``head`` is on its way (it may be granted already)."""
        free = self._free_less(self.free_by_device(state, head), held_back or {})
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
        devices = self._place(state, head, coming)
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
                    decisions.append(self._take_burst_back(state, lease, new_size, f"a request of {format_size(head.memory * head.num_gpus)}", now))
        placed = self._place(state, head, self._free_less(self.free_by_device(state, head), held_back or {}))
        if placed is not None and not self._quota_block_reason(state, head):
            self._grant(state, head, placed, now)
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

    def _follow_burst_reclaims(self, state: PoolState, now: float) -> list[Decision]:
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
            if lease.transition is not Transition.NONE or lease.reclaim_at is not None or not self._still_idle(lease, now):
                continue
            if self.suspend_refusal(state, lease):
                continue
            used = format_size(lease.used_memory or 0)
            reason = (
                f"suspended: its burst was taken back for a waiting request and it still used {used} of its "
                f"{format_size(lease.memory * max(1, lease.num_gpus))} slice; it resumes on its next cell"
            )
            decisions.append(self._begin_suspend(state, lease, reason, now))
        return decisions

    # --- reservations -----------------------------------------------------------------------------
    @staticmethod
    def active_reservations(state: PoolState, now: float) -> list[Reservation]:
        return [reservation for reservation in state.reservations if reservation.active(now)]

    def reservation_needs(self, state: PoolState, now: float) -> list[tuple[Reservation, int]]:
        """Active reservations whose members hold less than reserved, with the bytes still unused."""
        needs = []
        for reservation in self.active_reservations(state, now):
            members_hold = sum(
                lease.memory * lease.num_gpus
                for lease in state.leases.values()
                if lease.state in HELD_STATES and reservation.applies_to(lease.owner, lease.groups)
            )
            if reservation.memory > members_hold:
                needs.append((reservation, reservation.memory - members_hold))
        return needs

    def _reserved_for_others(self, state: PoolState, head: Lease, now: float) -> Callable[[Lease], bool]:
        """Whether a lease belongs to an active reservation ``head`` is not part of: reclaiming it
        would free memory that the reservation holds back from ``head`` anyway."""
        others = [r for r in self.active_reservations(state, now) if not r.applies_to(head.owner, head.groups)]
        return lambda lease: any(r.applies_to(lease.owner, lease.groups) for r in others)

    def _plan_reservation_reclaims(self, state: PoolState, now: float) -> list[Decision]:
        """While a reservation's window is open, make its unused memory free by the pool's own means:
        idle leases of non-members first (warning, then reclaim), then preemption of non-members by
        policy (not before ``min_runtime``, after ``grace_period``, never a lease within a guarantee)."""
        needs = self.reservation_needs(state, now)
        if not needs:
            return []
        taken = self.taken_by_device(state)
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
        shortfall = sum(unused for _, unused in needs) - free - coming - giving_back
        if shortfall <= 0:
            return []
        reservation = needs[0][0]
        active = self.active_reservations(state, now)
        candidates = [
            lease
            for lease in state.leases.values()
            if lease.state in HELD_STATES
            and lease.reclaim_at is None
            and lease.transition is Transition.NONE
            and not any(r.applies_to(lease.owner, lease.groups) for r in active)
        ]
        decisions = []
        # Burst yields to a reservation too: taken back first, before anyone is reclaimed or preempted.
        for lease in sorted(candidates, key=lambda lease: (-(lease.memory - lease.guarantee_size), lease.id)):
            above = lease.memory - lease.guarantee_size
            if shortfall <= 0 or above <= 0:
                continue
            gpus = max(1, len(lease.devices))
            give = min(above, -(-shortfall // gpus))
            decisions.append(self._take_burst_back(state, lease, lease.memory - give, f"the reservation {reservation.describe()}", now))
            shortfall -= give * gpus
        if shortfall <= 0:
            return decisions
        if self.policy.idle_policy != "never":
            idle = [
                lease
                for lease in candidates
                if self._still_idle(lease, now) and lease.idle_seconds(now) >= self._idle_timeout(state, lease)
            ]
            idle.sort(key=lambda lease: -lease.idle_seconds(now))
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
                    self._decision(
                        DecisionKind.WARN_IDLE,
                        lease,
                        f"idle for {idle_for}; its slice goes back for the reservation {reservation.describe()} unless kept",
                        now,
                        lease.reclaim_at,
                    )
                )
        if shortfall > 0 and self.policy.preemption:
            victims = [
                lease
                for lease in candidates
                if lease.reclaim_at is None
                and not (lease.granted_at is not None and now - lease.granted_at < self.policy.min_runtime)
                and self.over_guarantee(state, lease)
            ]
            victims.sort(key=lambda v: (v.busy, -(v.granted_at or 0.0)))  # idle before busy, youngest first
            for lease in victims:
                if shortfall <= 0:
                    break
                lease.warned_at = now
                lease.reclaim_at = now + self.policy.grace_period
                lease.reclaim_reason = f"{RESERVATION_PREEMPT}{reservation.describe()}"
                state.touch(lease)
                shortfall -= lease.memory * len(lease.devices)
                decisions.append(self._decision(DecisionKind.PREEMPT_WARN, lease, lease.reclaim_reason, now, lease.reclaim_at))
        return decisions

    def _reservation_wait_reason(self, state: PoolState, lease: Lease, now: float) -> str:
        """Why a reservation keeps this queued lease waiting, or ``""``."""
        active = self.active_reservations(state, now)
        if not active:
            return ""
        for reservation in active:
            if reservation.applies_to(lease.owner, lease.groups) and any(
                other.state in HELD_STATES and reservation.describe() in other.reclaim_reason for other in state.leases.values()
            ):
                return f"waits while memory is freed for the reservation {reservation.describe()}"
        if self._place(state, lease) is None and self._place(state, lease, self.free_by_device(state, lease, reservations=False)) is not None:
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
        for instant in sorted({now, *(t for item in (reservation, *others) for t in _window_starts(item, now, horizon))}):
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

    def _plan_preemption(self, state: PoolState, head: Lease, now: float) -> list[Decision]:
        if not self.policy.preemption:
            return []
        entitled = self.guarantee_for(state, head, extra=head.memory * head.num_gpus)
        protected = self._reserved_for_others(state, head, now)
        victims = []
        for lease in state.leases.values():
            if lease.state not in HELD_STATES or lease.owner == head.owner or lease.reclaim_at is not None:
                continue
            if lease.transition is not Transition.NONE:
                continue
            if lease.granted_at is not None and now - lease.granted_at < self.policy.min_runtime:
                continue
            if protected(lease):
                continue
            lower_class = lease.priority.rank < head.priority.rank
            if lower_class or (entitled and self.over_guarantee(state, lease)):
                victims.append(lease)
        if not victims:
            return []
        # Least cost first: idle before busy, over-quota before within, youngest before oldest.
        victims.sort(key=lambda v: (v.busy, not self.over_guarantee(state, v), -(v.granted_at or 0.0)))
        free = self._free_with_room_on_its_way(state, head, now)
        if self._place(state, head, free) is not None:
            return []  # room is already on its way (warned, suspending or moving leases)
        chosen = []
        for lease in victims:
            chosen.append(lease)
            for uuid in lease.devices:
                free[uuid] = free.get(uuid, 0) + lease.memory
            if self._place(state, head, free) is not None:
                break
        else:
            return []  # even evicting every candidate would not make room
        decisions = []
        if any(v.priority.rank < head.priority.rank for v in chosen):
            why = "a higher-priority request"
        else:
            why = "a request within its guaranteed quota" if entitled == "your" else f"a request within {entitled} guaranteed quota"
        for lease in chosen:
            lease.warned_at = now
            lease.reclaim_at = now + self.policy.grace_period
            lease.reclaim_reason = f"preempted for {why} ({format_size(head.memory)} for {head.owner})"
            state.touch(lease)
            decisions.append(self._decision(DecisionKind.PREEMPT_WARN, lease, lease.reclaim_reason, now, lease.reclaim_at))
        return decisions

    # --- lease operations -------------------------------------------------------------------------
    def get(self, state: PoolState, lease_id: str) -> Lease:
        lease = state.leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no live lease {lease_id!r}; list them with `jupyter gpupool leases`")
        return lease

    def release(self, state: PoolState, lease_id: str, reason: str, now: float) -> Lease:
        lease = self.get(state, lease_id)
        self._count_unwritten_busy_time(lease, now)
        # Only a granted interval is metered here: a suspended (or queued to resume) lease's was
        # closed when it was suspended, and billing it again up to now would count the parked time.
        metered = lease.state is LeaseState.GRANTED
        if metered:
            state.keep_taken_after_release(lease)  # before its devices count as free
        lease.state = LeaseState.RELEASED
        lease.released_at = now
        lease.release_reason = reason
        lease.warned_at = lease.reclaim_at = None
        # Nothing is under way for a released lease: a suspend, restore or move it was in ends with it.
        lease.transition = Transition.NONE
        lease.transition_at = None
        lease.parked_memory = 0
        lease.migrate_from = ()
        state.touch(lease)
        if metered:
            state.released.append(lease)
        return lease

    def resize(self, state: PoolState, lease_id: str, memory: int, now: float, limit: int | None = None) -> Lease:
        """Set what a lease is guaranteed (and, with ``limit``, how far it may grow: 0 for a fixed
        slice): shrink at once; grow in place if the same devices have room, else refuse with what fits."""
        lease = self.get(state, lease_id)
        if memory <= 0:
            raise InvalidInput("memory must be positive")
        if lease.state is LeaseState.SUSPENDED or lease.resuming:
            raise RequestRefused("cannot resize a suspended slice: resume it first (run a cell, or %gpupool resume)")
        if lease.transition is not Transition.NONE:
            raise RequestRefused(f"cannot resize the slice while it is {lease.transition.value}; try again in a moment")
        if limit is not None:  # a limit that cannot be is refused before anything changes
            self.burst_limit_for(limit, memory, lease.num_gpus, self._candidate_devices(state.devices, lease.model),
                                 lease.owner, lease.groups)
        if lease.state is LeaseState.QUEUED:
            probe = LeaseRequest(owner=lease.owner, memory=memory, groups=lease.groups, num_gpus=lease.num_gpus, model=lease.model)
            shaped = self._check_fits_ever(state, probe)
            lease.memory, lease.num_gpus = shaped.memory, shaped.num_gpus  # may span GPUs, as a new request would
            lease.guarantee = lease.memory
            self._set_limit(state, lease, limit)
            state.touch(lease)
            return lease
        if memory <= lease.memory:
            before = lease.memory
            self._set_size(state, lease, memory, now)
            lease.guarantee = memory
            self._set_limit(state, lease, limit)
            lease.reserve_wanted, lease.reserve_since = 0, None
            if memory < before:
                self._lowered(state, lease, before)
            state.touch(lease)
            return lease
        sizes = sorted((d.leasable for d in self._candidate_devices(state.devices, lease.model)), reverse=True)
        if sizes and memory > sizes[0]:
            span = self.fewest_gpus(memory * lease.num_gpus, sizes) if lease.num_gpus == 1 else None
            if span is None:
                most_k, most = self._most_that_fits(sizes)
                spanning = (
                    f" (a new slice may span up to {format_size(most)} on {most_k} GPUs)"
                    if lease.num_gpus == 1 and most_k > 1 and self.policy.span_large_requests
                    else ""
                )
                raise RequestRefused(
                    f"cannot grow to {format_size(memory)}: the largest GPU has {format_size(sizes[0])}; "
                    f"ask for at most {format_size(sizes[0])}{spanning}"
                )
            raise RequestRefused(
                f"cannot grow to {format_size(memory)} in place: that spans {span[0]} GPUs ({format_size(span[1])} each), "
                "which a running kernel cannot change; release this slice, request the size again, then restart the kernel"
            )
        extra = memory - lease.memory
        total_extra = extra * lease.num_gpus
        for who, quota in self._quotas(lease.owner, lease.groups):
            held, _ = self.holdings(state, owner=lease.owner) if who == "your" else self.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + total_extra > quota.maximum:
                room = max(0, quota.maximum - held) // lease.num_gpus + lease.memory
                raise RequestRefused(f"{who} maximum quota is {format_size(quota.maximum)}; this lease can grow to at most {format_size(room)}")
        free = self.free_by_device(state, lease)
        room = min(free.get(uuid, 0) for uuid in lease.devices) if lease.devices else 0
        if extra > room and self._fits_at_guarantees(state, lease, memory):
            # Burst yields to every guarantee: it waits in line, and the pool takes burst back for it.
            if limit is not None:
                lease.limit_asked = limit
            lease.reserve_wanted = memory
            lease.reserve_since = now if lease.reserve_since is None else lease.reserve_since
            lease.burst_note = (
                f"reserve of {format_size(memory * lease.num_gpus)} queued: burst beside it is taken back for it"
            )
            state.touch(lease)
            return lease
        if extra > room:
            gpus = "its GPU has" if lease.num_gpus == 1 else f"its {lease.num_gpus} GPUs have"
            if room == 0:
                raise RequestRefused(
                    f"cannot grow to {format_size(memory)} now: {gpus} no free memory, so the slice stays "
                    f"{format_size(lease.memory)}; release and request {format_size(memory)} again to queue for it"
                    + (f" (a GPU here holds at most {format_size(sizes[0])})" if sizes else "")
                )
            raise RequestRefused(
                f"cannot grow to {format_size(memory)}: {gpus} {format_size(room)} free; "
                f"ask for at most {format_size(lease.memory + room)} now, or release and request again to queue"
            )
        self._reserve_now(state, lease, memory, limit, now)
        return lease

    def _reserve_now(self, state: PoolState, lease: Lease, memory: int, limit: int | None, now: float) -> None:
        """Make ``memory`` bytes per GPU the granted lease's guarantee and size (room checked)."""
        self._set_size(state, lease, memory, now)
        lease.guarantee = memory
        self._set_limit(state, lease, limit)
        lease.reserve_wanted, lease.reserve_since = 0, None
        lease.burst_taken_at, lease.burst_from = None, 0
        state.touch(lease)

    def _fits_at_guarantees(self, state: PoolState, lease: Lease, memory: int) -> bool:
        """Whether granted ``lease`` could hold ``memory`` bytes per GPU if every slice on its GPUs
        were at its guarantee (its own included)."""
        if not lease.devices:
            return False
        room = self._room_at_guarantees(state)
        return all(room.get(uuid, 0) >= memory - lease.guarantee_size for uuid in lease.devices)

    def reserve_wanters(self, state: PoolState) -> list[Lease]:
        """Granted kernels whose reserve waits for burst beside them to be taken back, in line order."""
        wanters = [lease for lease in state.leases.values() if lease.reserve_wanted]
        return sorted(wanters, key=lambda lease: (lease.reserve_since if lease.reserve_since is not None else 0.0, lease.id))

    def _serve_reserve(self, state: PoolState, lease: Lease, held_back: dict[str, int], now: float) -> list[Decision]:
        """Serve a waiting reserve in its turn: granted once its GPUs have the room (as the driver
        shows it), after the burst of the slices beside it is taken back; the room it waits for is
        held back from those behind it (``held_back``)."""
        wanted = lease.reserve_wanted
        if lease.state is not LeaseState.GRANTED or lease.resuming:
            lease.reserve_wanted, lease.reserve_since = 0, None
            state.touch(lease)
            return []
        if lease.transition is not Transition.NONE:
            return []  # being suspended or moved: it waits
        if not self._fits_at_guarantees(state, lease, wanted):
            lease.reserve_wanted, lease.reserve_since = 0, None
            lease.burst_note = (
                f"reserve of {format_size(wanted * lease.num_gpus)} given up: guarantees granted since leave no room "
                "for it on its GPU; ask again for less"
            )
            state.touch(lease)
            return []
        decisions: list[Decision] = []
        for attempt in range(2):
            free = self._free_less(self.free_by_device(state, lease), held_back)
            missing = {uuid: wanted - lease.memory - free.get(uuid, 0) for uuid in lease.devices}
            if all(gap <= 0 for gap in missing.values()):
                self._reserve_now(state, lease, wanted, None, now)
                lease.burst_note = f"reserved {format_size(wanted * lease.num_gpus)}"
                decisions.append(self._decision(DecisionKind.GROW, lease, lease.burst_note, now))
                return decisions
            if attempt:
                break
            for uuid, gap in missing.items():
                decisions += self._take_burst_on(state, uuid, gap, lease, f"a reserve of {format_size(wanted)}", now)
        self._hold_back(held_back, lease, wanted)
        return decisions

    def _take_burst_on(self, state: PoolState, uuid: str, missing: int, lease: Lease, taken_for: str, now: float) -> list[Decision]:
        """Take back up to ``missing`` bytes of burst from the slices on GPU ``uuid`` beside
        ``lease``, most burst first, never below a guarantee."""
        decisions = []
        others = [
            other for other in state.leases.values()
            if other.id != lease.id and other.state is LeaseState.GRANTED and uuid in other.devices
            and other.transition is Transition.NONE and other.memory + excess_per_device(other) > other.guarantee_size
        ]
        for other in sorted(others, key=lambda o: -(o.memory - o.guarantee_size)):
            if missing <= 0:
                break
            taken = other.memory + excess_per_device(other)
            new_size = min(other.memory, max(other.guarantee_size, taken - missing))
            missing -= taken - new_size
            if new_size < other.memory or other.burst_taken_at is None:
                decisions.append(self._take_burst_back(state, other, new_size, taken_for, now))
        return decisions

    def _set_limit(self, state: PoolState, lease: Lease, limit: int | None) -> None:
        """After a size change, one rule: the limit its user set (``limit`` now, or one set
        before), else the pool's burst of its guarantee now. A limit set before that is below the
        new guarantee leaves the slice fixed at it."""
        candidates = self._candidate_devices(state.devices, lease.model)
        if lease.devices:
            candidates = [d for d in candidates if d.uuid in lease.devices] or candidates
        asked = limit if limit is not None else lease.limit_asked
        if limit is None and asked is not None and asked < lease.guarantee_size:
            asked = 0
        lease.burst_limit = self.burst_limit_for(asked, lease.guarantee_size, lease.num_gpus, candidates, lease.owner, lease.groups)
        if limit is not None:
            lease.limit_asked = limit

    def _check_fits_ever(self, state: PoolState, request: LeaseRequest) -> Lease:
        """The lease ``request`` would be admitted as on an empty pool; raises if it never fits."""
        probe_state = PoolState(devices=state.devices, leases={})
        return self.admit(probe_state, "probe", request, 0.0)

    def keep(self, state: PoolState, lease_id: str, seconds: float, now: float) -> Lease:
        lease = self.get(state, lease_id)
        if seconds > self.policy.max_keep:
            raise InvalidInput(f"can keep a slice through idle for at most {format_duration(self.policy.max_keep)}; asked {format_duration(seconds)}")
        lease.keep_until = max(lease.keep_until or 0.0, now + seconds)  # a shorter keep never cuts a longer hold
        if not lease.reclaim_reason.startswith("preempt"):
            lease.warned_at = lease.reclaim_at = None
            lease.reclaim_reason = ""
        lease.last_activity = now
        state.touch(lease)
        return lease

    def report_activity(self, state: PoolState, lease_id: str, activity: Activity, now: float) -> Lease:
        """Take a kernel's activity (and heartbeat). A report that says nothing new (still idle since
        the same moment, or still busy, with the same connections) changes nothing while the
        heartbeat on file is fresh (younger than a quarter of the TTL): rewriting every kernel's
        lease every few seconds was most of a report's cost, and of a simulated day's."""
        lease = self.get(state, lease_id)
        if (
            activity.busy == lease.busy
            and activity.connections == lease.connections
            # busy, it stays "active now"; idle, its last activity is what the lease says
            and (activity.busy or activity.last_activity is None or activity.last_activity <= (lease.last_activity or 0.0))
            and self._heartbeat_fresh(lease, now)
        ):
            return lease  # the busy time since the heartbeat is counted at the next write
        self._count_busy_time(lease, now)
        lease.busy = activity.busy
        if activity.last_activity is not None:
            lease.last_activity = max(lease.last_activity or 0.0, activity.last_activity)
        if activity.busy:
            lease.last_activity = now
        lease.connections = activity.connections
        lease.heartbeat_at = max(now, lease.heartbeat_at or now)  # two writers' clocks may cross: never backwards
        state.touch_liveness(lease)
        return lease

    def heartbeat(self, state: PoolState, lease_id: str, now: float) -> Lease:
        """A holder's sign of life with nothing else to say (a waiting request's look, a client's
        heartbeat): written only once the heartbeat on file is no longer fresh, as a report that
        says nothing new. A kernel waiting for a GPU looks twice a second; writing its lease each
        time made every other process on the pool file read all live leases again."""
        lease = self.get(state, lease_id)
        if lease.heartbeat_at is not None and now < lease.heartbeat_at:
            return lease  # an older sign of life than the one on file (two writers raced): it says nothing new
        if not self._heartbeat_fresh(lease, now):
            self._count_busy_time(lease, now)
            lease.heartbeat_at = now
            state.touch_liveness(lease)
        return lease

    def _heartbeat_fresh(self, lease: Lease, now: float) -> bool:
        """Whether the heartbeat on file is younger than a quarter of the TTL."""
        return lease.heartbeat_at is not None and 0.0 <= now - lease.heartbeat_at < self.policy.heartbeat_ttl / 4

    def _count_busy_time(self, lease: Lease, until: float) -> None:
        """Add the busy time from the heartbeat on file to ``until`` (called before the heartbeat moves)."""
        if lease.busy and lease.state in HELD_STATES:
            lease.active_seconds += max(0.0, until - (lease.heartbeat_at or until))

    def _count_unwritten_busy_time(self, lease: Lease, now: float) -> None:
        """Before an interval closes, add the busy time since the heartbeat on file: reports that
        said only "still busy" while it was fresh were not written (see :meth:`report_activity`).
        Counted up to ``now``, but not past the moment such a report would have been written (a
        holder silent since then may have died busy)."""
        if lease.heartbeat_at is not None:
            until = min(now, lease.heartbeat_at + self.policy.heartbeat_ttl / 4)
            self._count_busy_time(lease, until)
            lease.heartbeat_at = max(lease.heartbeat_at, until)

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
                    self._decision(DecisionKind.OVER_LIMIT, lease, f"uses {format_size(used)}, over {what} of {format_size(limit)}", now)
                )
            else:
                lease.over_limit_since = None
            state.touch(lease)
        return decisions

    # --- queue information ------------------------------------------------------------------------
    def queue_info(self, state: PoolState, lease_id: str, now: float) -> QueueInfo | None:
        lease = self.get(state, lease_id)
        if lease.state is not LeaseState.QUEUED:
            return None
        order = self.queue_order(state, now)
        position = next(i for i, item in enumerate(order) if item.id == lease_id) + 1
        reason = (
            self._quota_block_reason(state, lease)
            or self._reservation_wait_reason(state, lease, now)
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
        free = self.free_by_device(state, lease)
        pending = order[: order.index(lease) + 1]
        current = now
        while True:
            # Grant, in queue order, whatever fits at `current`; stop when `lease` is granted.
            while pending:
                head = pending[0]
                devices = self._place(state, head, free)
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
        eligible = max(idle_since + self.policy.idle_timeout_for(suspends), lease.keep_until or 0.0, now)
        return eligible + self.policy.warning_period

    # --- helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _decision(kind: DecisionKind, lease: Lease, reason: str, now: float, deadline: float | None = None) -> Decision:
        return Decision(kind=kind, lease_id=lease.id, kernel_id=lease.kernel_id, owner=lease.owner, reason=reason, at=now, deadline=deadline)


def now_within(since: float, now: float, seconds: float) -> bool:
    """Whether ``now`` is less than ``seconds`` after ``since``."""
    return now - since < seconds


def _window_starts(reservation: Reservation, start: float, end: float) -> list[float]:
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


__all__ = ["Engine", "PoolState", "PriorityClass", "held_by_device"]
