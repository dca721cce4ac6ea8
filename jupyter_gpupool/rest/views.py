"""The JSON views of a kernel's slice that both REST surfaces serve (single-user server and broker)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.enforcement.plan import EnforcementConfig, EnforcementPlan, plan_enforcement
from jupyter_gpupool.units import format_size
from jupyter_gpupool.wording import cpu_only_description

#: Kernel states besides a lease's: ``none`` (runs without a slice), ``unavailable`` (runs CPU-only
#: because the pool could not be used), ``failed`` (its start failed; no kernel process).
KERNEL_STATES_WITHOUT_LEASE = ("none", "unavailable", "failed")

_DESCRIPTIONS = {
    "none": "this kernel runs without a GPU slice",
    "unavailable": "GPU pool unavailable: this kernel runs CPU-only",
    "failed": "this kernel did not start",
}


def kernel_status_without_pool(
    kernel_id: str,
    owner: str,
    now: float,
    state: str,
    reason: str | None,
    lease: Lease | None = None,
    pool_is_back: bool = False,
) -> dict[str, Any]:
    """A kernel's body when no live slice describes it: ``state`` is one of
    :data:`KERNEL_STATES_WITHOUT_LEASE`, ``reason`` says why (one line, for the user);
    ``pool_is_back``: the pool that was unavailable when an ``unavailable`` kernel started is back."""
    body = _no_slice(kernel_id, owner, now, state)
    body["reason"] = reason
    if reason:
        if state == "unavailable":
            body["enforcement"]["description"] = cpu_only_description(reason, pool_is_back)
        else:
            body["enforcement"]["description"] = f"{_DESCRIPTIONS[state]}: {reason}"
    if lease is not None:  # e.g. a request released while queued: keep its id and why
        body["lease_id"] = lease.id
        body["release_reason"] = lease.release_reason or None
        body["released_at"] = lease.released_at
    return body


def queued_status_while_unreachable(
    kernel_id: str, lease: Lease, info: Any, owner: str, now: float
) -> dict[str, Any]:
    """A queued kernel's body while the pool cannot be asked: its last known place in the queue,
    and (``queue_reason``, ``reason``) what the provisioner last heard, e.g. "pool unavailable,
    retrying in 4 s: ..."."""
    body = _no_slice(kernel_id, owner, now)
    reason = getattr(info, "reason", None) or None
    body.update(
        {
            "lease_id": lease.id,
            "state": LeaseState.QUEUED.value,
            "memory": lease.memory,
            "num_gpus": lease.num_gpus,
            "queue_position": getattr(info, "position", None) or None,
            "queue_length": getattr(info, "length", None) or None,
            "queue_reason": reason,
            "reason": reason,
            "owner": lease.owner or owner,
        }
    )
    body["enforcement"]["description"] = "queued: " + (reason or "waiting for a GPU")
    return body


def _no_slice(kernel_id: str, owner: str, now: float, state: str = "none") -> dict[str, Any]:
    return {
        "kernel_id": kernel_id,
        "lease_id": None,
        "state": state,
        "memory": 0,
        "num_gpus": 0,
        "devices": [],
        "queue_position": None,
        "queue_length": None,
        "estimated_wait": None,
        "queue_reason": None,
        "used_memory": None,
        "peak_memory": None,
        "enforcement": {"level": "none", "mechanisms": [], "description": _DESCRIPTIONS[state]},
        "idle_seconds": 0.0,
        "busy": False,
        "reclaim_at": None,
        "reclaim_reason": None,
        "keep_until": None,
        "granted_at": None,
        "released_at": None,
        "release_reason": None,
        "owner": owner,
        "now": now,
        "reason": None,
        **_NO_SUSPEND,
        **_NO_BURST,
    }


#: The elastic-slice fields of a body with no lease (see :func:`elastic_fields`).
_NO_BURST: dict[str, Any] = {
    "guarantee": 0, "limit": 0, "burst": 0, "burst_note": None, "burst_taken_at": None, "burst_fixed": None,
    "grow_wanted": None, "grow_since": None, "grow_place": None, "reserve_wanted": None, "reserve_since": None,
}  # fmt: skip

#: What fixes a kernel's size when it starts, by enforcement mechanism (the pool may grow its
#: lease, but the kernel cannot use more than it started with).
_FIXED_AT_START = {
    "mig": "a MIG instance has a fixed size",
    "mps": "CUDA MPS set this kernel's memory limit when it started",
    "hami": "HAMi-core set this kernel's memory limit when it started",
}


def elastic_line(lease: Lease) -> str:
    """``4 GiB guaranteed · 9.2 GiB now, up to 40 GiB`` (all its GPUs); ``""`` for a fixed slice."""
    if not lease.elastic:
        return ""
    gpus = max(1, lease.num_gpus)
    return (
        f"{format_size(lease.guarantee_size * gpus)} guaranteed · {format_size(lease.memory * gpus)} now, "
        f"up to {format_size(lease.limit_size * gpus)}"
    )


def elastic_fields(lease: Lease) -> dict[str, Any]:
    """What a user sees of an elastic slice (bytes per GPU): ``guarantee`` (never taken back),
    ``limit`` (how far it may grow; the guarantee for a fixed slice), ``burst`` (held above the
    guarantee now: ``memory`` is guarantee + burst), the last grow or give-back step and, while
    its burst is being given back, since when; while a grow waits for room, the size it waits
    for and since when (``grow_place``, its place in line, comes from the pool: see
    :func:`kernel_status`); while a ``%gpupool reserve`` waits in line, the guarantee it waits
    for and since when."""
    waiting = lease.grow_since is not None
    reserving = lease.reserve_since is not None and lease.reserve_wanted > 0
    return {
        "guarantee": lease.guarantee_size,
        "limit": lease.limit_size,
        "burst": lease.burst,
        "burst_note": lease.burst_note or None,
        "burst_taken_at": lease.burst_taken_at,
        "grow_wanted": lease.grow_wanted if waiting else None,
        "grow_since": lease.grow_since,
        "reserve_wanted": lease.reserve_wanted if reserving else None,
        "reserve_since": lease.reserve_since if reserving else None,
    }


def grow_place(pool: Any, lease: Lease) -> int | None:
    """The place in line of a kernel whose grow waits (None when it does not wait, or where the
    pool cannot say: a backend without ``grow_place``)."""
    place = getattr(pool, "grow_place", None)
    return place(lease.id) if lease.grow_since is not None and callable(place) else None


def _pool_bursts(pool: Any) -> bool:
    """Whether the pool's policy lets slices grow (``PoolPolicy.burst`` not 0); True where unknown."""
    burst = getattr(getattr(pool, "policy", None), "burst", None)
    return burst is None or str(burst).strip() != "0"


def burst_fixed(lease: Lease, plan: EnforcementPlan, backend_kind: str, pool_bursts: bool = True) -> str | None:
    """Why this kernel cannot use burst, where its enforcement fixed its size when it started
    (a MIG instance; an MPS limit without memory partitioning, a HAMi-core limit: such slices are
    asked for fixed; a Slurm job's shards, set at submission); None where nothing does, or where
    the pool lets no slice burst (``pool_bursts`` false) and so there is nothing to explain."""
    if backend_kind == "slurm":
        return "Slurm set this job's GPU shards when it was submitted"
    if not plan.fixed_because or not (pool_bursts or lease.elastic):
        return None
    return next((why for mechanism, why in _FIXED_AT_START.items() if mechanism in plan.mechanisms), plan.fixed_because)


#: The suspend fields of a body with no lease (see :func:`suspend_fields`).
_NO_SUSPEND: dict[str, Any] = {
    "transition": None,
    "suspendable": False,
    "resuming": False,
    "suspend_reason": None,
    "suspended_at": None,
    "parked_memory": None,
    "home_devices": [],
}


def suspend_fields(lease: Lease) -> dict[str, Any]:
    """What a user sees of a suspend: ``transition`` (suspending, restoring, migrating or None),
    ``resuming`` (queued to come back), why, since when and how much is parked in host RAM."""
    parked = lease.state is LeaseState.SUSPENDED or lease.resuming or lease.transition.value in ("suspending", "restoring")
    return {
        "transition": lease.transition.value or None,
        "suspendable": lease.suspendable,
        "resuming": lease.resuming,
        "suspend_reason": lease.suspend_reason or None,
        "suspended_at": lease.suspended_at,
        "parked_memory": lease.parked_memory if parked else None,
        "home_devices": list(lease.home_devices),
    }


def kernel_status(pool: Any, kernel_id: str, lease: Lease | None, enforcement: EnforcementConfig, owner: str, now: float) -> dict[str, Any]:
    """The ``GET /api/gpupool/kernels/{kernel_id}`` body (see openapi.yaml); ``state: "none"``
    for a kernel that runs without a slice."""
    if lease is None:
        return _no_slice(kernel_id, owner, now)
    devices = {d.uuid: d for d in pool.devices()}
    info = pool.queue_info(lease.id) if lease.state is LeaseState.QUEUED else None
    plan = plan_enforcement(lease, devices, enforcement)
    details = getattr(pool, "lease_details", None)  # a backend's own facts (Slurm: job id, partition, position)
    return ({**details(lease)} if callable(details) else {}) | {
        "kernel_id": kernel_id,
        "lease_id": lease.id,
        "state": lease.state.value,
        "memory": lease.memory,
        "num_gpus": lease.num_gpus,
        "compute_share": lease.compute_share,
        "priority": lease.priority.value,
        "devices": [
            {"uuid": u, "index": devices[u].index, "name": devices[u].name, "memory_total": devices[u].memory_total}
            if u in devices
            else {"uuid": u, "index": None, "name": None, "memory_total": None}
            for u in lease.devices
        ],
        "queue_position": info.position if info else None,
        "queue_length": info.length if info else None,
        "estimated_wait": info.estimated_wait if info else None,
        "queue_reason": info.reason if info else None,
        "used_memory": lease.used_memory,
        "peak_memory": lease.peak_memory,
        "over_limit_since": lease.over_limit_since,
        "enforcement": plan.to_json(),
        "idle_seconds": lease.idle_seconds(now),
        "busy": lease.busy,
        "connections": lease.connections,
        "reclaim_at": lease.reclaim_at,
        "reclaim_reason": lease.reclaim_reason or None,
        "keep_until": lease.keep_until,
        "granted_at": lease.granted_at,
        "released_at": lease.released_at,
        "release_reason": lease.release_reason or None,
        "flagged": lease.flagged or None,
        "owner": lease.owner,
        "now": now,
        "reason": None,
        **suspend_fields(lease),
        **elastic_fields(lease),
        "burst_fixed": burst_fixed(lease, plan, getattr(pool, "kind", ""), _pool_bursts(pool)),
        "grow_place": grow_place(pool, lease),
        # A reclaim suspends it only if the pool allows suspends too (else the warning must say "shut down").
        "suspendable": lease.suspendable and getattr(getattr(pool, "policy", None), "reclaim_action", "suspend") == "suspend",
    }


def view_version(leases: Iterable[Lease]) -> int:
    """A number that moves when anything a server acts on changed in ``leases`` (a caller's live
    leases): their states, transitions, sizes, devices, warnings and burst steps, or the set itself
    (a lease released or new). Heartbeats and usage readings leave it alone. Opaque: only equality
    means anything (the broker's ``/changes`` answers with it, per caller)."""
    seen = sorted(
        (
            lease.id, lease.state.value, lease.transition.value, lease.memory, tuple(lease.devices), lease.resuming,
            lease.reclaim_at, lease.reclaim_reason, lease.burst_taken_at, lease.burst_note, lease.grow_since, lease.release_reason,
        )
        for lease in leases
    )
    return int.from_bytes(hashlib.blake2b(repr(seen).encode(), digest_size=7).digest(), "big")

