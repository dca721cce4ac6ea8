"""Where a lease goes: the GPUs it may use, the placement policy's choice among those with room,
and the grant that seats it there. (:mod:`~jupyter_gpupool.core.placement` holds the placement
policies themselves, over any nodes; this module applies them to the pool's leases.)"""

from __future__ import annotations

from collections.abc import Mapping

from jupyter_gpupool.core.capacity import free_by_device
from jupyter_gpupool.core.models import Device, Lease, LeaseState, Transition, model_matches
from jupyter_gpupool.core.placement import Demand, GpuSlot, NodeView, PlacementPolicy, make_policy, typical_demands
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.state import PoolState


class Placer:
    """Places leases on the pool's GPUs and grants them there."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy
        self._placement_cache: tuple[str, tuple[int, ...], PlacementPolicy] | None = None

    def candidate_devices(self, devices: list[Device], model: str | None) -> list[Device]:
        """Healthy devices of ``model`` (any model when None)."""
        return [d for d in devices if d.healthy and (not model or model_matches(model, d))]

    def lease_candidates(self, state: PoolState, lease: Lease) -> list[Device]:
        """Devices ``lease`` may be placed on: its model constraint, and for a kernel resuming after
        a suspend only GPUs of the exact model it ran on (its memory image restores onto no other);
        one that ran on GPUs of several models goes back only to those very GPUs (each image onto
        its own model), so it is never left waiting for GPUs of one model it cannot all have."""
        devices = self.candidate_devices(state.devices, lease.model)
        if lease.resuming and lease.home_model:
            home = set(lease.home_devices)
            if len({d.model for d in state.devices if d.uuid in home}) > 1:
                return [d for d in devices if d.uuid in home]
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

    def place(self, state: PoolState, lease: Lease, free: dict[str, int] | None = None) -> tuple[str, ...] | None:
        """The devices ``lease`` goes on with ``free`` bytes per device (what :mod:`.capacity` shows
        free to it when None), or None when it does not fit now."""
        free = free if free is not None else free_by_device(state, lease)
        candidates = self.lease_candidates(state, lease)
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

    def grant(self, state: PoolState, lease: Lease, devices: tuple[str, ...], now: float) -> None:
        """Grant ``lease`` on ``devices`` (a resume starts restoring there)."""
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
