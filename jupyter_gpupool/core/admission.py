"""Admission and queue order: whether a request may ever be granted, the shape it is granted
as, its growth limit, and the order the queue is served in (priority with aging, fair share,
arrival)."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.models import (
    MODEL_FORMS,
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PriorityClass,
    Transition,
    model_family,
    model_tokens,
)
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.state import HELD_STATES, PoolState
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB, MIB, format_size


class Admission:
    """Admits requests and orders the queue."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting

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
        candidates = self.placer.candidate_devices(state.devices, request.model)
        if request.model and not candidates:
            models = sorted({d.model for d in state.devices if d.healthy})
            raise RequestRefused(
                f"no GPU of model {request.model!r} in this pool; models here: {', '.join(models) or 'none'} "
                f"(a family name such as {model_family(model_tokens(models[0])) if models else 'A100'} matches every size of it)"
            )
        if not candidates:
            raise RequestRefused("this pool has no GPUs")
        memory, num_gpus = self.shape(request, candidates)
        total = memory * num_gpus
        for who, quota in self.quotas.limits(request.owner, request.groups):
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
            self.accounting.count_unwritten_busy_time(lease, now)
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

    def shape(self, request: LeaseRequest, candidates: list[Device]) -> tuple[int, int]:
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
                most_k, most = self.most_that_fits(sizes)
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
        for _, quota in self.quotas.limits(owner, groups):
            if quota.maximum is not None:
                limit = min(limit, quota.maximum // max(1, num_gpus))
        return limit if limit > guarantee else 0

    def most_that_fits(self, sizes: list[int]) -> tuple[int, int]:
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

    def may_backfill(self, head: Lease, now: float) -> bool:
        return self.policy.backfill and now - head.created_at < self.policy.backfill_max_head_wait

    def check_fits_ever(self, state: PoolState, request: LeaseRequest) -> Lease:
        """The lease ``request`` would be admitted as on an empty pool; raises if it never fits."""
        probe_state = PoolState(devices=state.devices, leases={})
        return self.admit(probe_state, "probe", request, 0.0)
