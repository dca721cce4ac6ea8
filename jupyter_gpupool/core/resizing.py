"""Resizing a lease: a new guarantee and limit, at once when there is room, or a reserve that
waits in line while burst beside it is taken back."""

from __future__ import annotations

from typing import NoReturn

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.admission import Admission
from jupyter_gpupool.core.capacity import free_by_device, free_less, hold_back, lowered, room_at_guarantees
from jupyter_gpupool.core.elastic import Elastic
from jupyter_gpupool.core.index import excess_per_device
from jupyter_gpupool.core.models import Decision, DecisionKind, Lease, LeaseRequest, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.quotas import Quotas
from jupyter_gpupool.core.state import PoolState, decision
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import format_size


class Resizing:
    """Changes what a lease is guaranteed and how far it may grow."""

    def __init__(self, policy: PoolPolicy, *,
                 quotas: Quotas, placer: Placer, accounting: Accounting, admission: Admission, elastic: Elastic) -> None:
        self.policy = policy
        self.quotas = quotas
        self.placer = placer
        self.accounting = accounting
        self.admission = admission
        self.elastic = elastic

    def resize(self, state: PoolState, lease_id: str, memory: int, now: float, limit: int | None = None) -> Lease:
        """Set what a lease is guaranteed (and, with ``limit``, how far it may grow: 0 for a fixed
        slice): shrink at once; grow in place if the same devices have room, else refuse with what fits."""
        lease = self.accounting.get(state, lease_id)
        if memory <= 0:
            raise InvalidInput("memory must be positive")
        if lease.state is LeaseState.SUSPENDED or lease.resuming:
            raise RequestRefused("cannot resize a suspended slice: resume it first (run a cell, or %gpupool resume)")
        if lease.transition is not Transition.NONE:
            raise RequestRefused(f"cannot resize the slice while it is {lease.transition.value}; try again in a moment")
        if limit is not None:  # a limit that cannot be is refused before anything changes
            self.admission.burst_limit_for(limit, memory, lease.num_gpus, self.placer.candidate_devices(state.devices, lease.model),
                                 lease.owner, lease.groups)
        if lease.state is LeaseState.QUEUED:
            probe = LeaseRequest(owner=lease.owner, memory=memory, groups=lease.groups, num_gpus=lease.num_gpus, model=lease.model)
            shaped = self.admission.check_fits_ever(state, probe)
            lease.memory, lease.num_gpus = shaped.memory, shaped.num_gpus  # may span GPUs, as a new request would
            lease.guarantee = lease.memory
            self._set_limit(state, lease, limit)
            state.touch(lease)
            return lease
        if memory <= lease.memory:
            before = lease.memory
            self.elastic.set_size(state, lease, memory, now)
            lease.guarantee = memory
            self._set_limit(state, lease, limit)
            lease.reserve_wanted, lease.reserve_since = 0, None
            if memory < before:
                lowered(state, lease, before)
            state.touch(lease)
            return lease
        sizes = sorted((d.leasable for d in self.placer.candidate_devices(state.devices, lease.model)), reverse=True)
        if sizes and memory > sizes[0]:
            self._refuse_beyond_largest(lease, memory, sizes)
        extra = memory - lease.memory
        self._check_quota_room(state, lease, extra * lease.num_gpus)
        free = free_by_device(state, lease)
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

    def _refuse_beyond_largest(self, lease: Lease, memory: int, sizes: list[int]) -> NoReturn:
        """Refuse growing granted ``lease`` to ``memory`` bytes per GPU, more than the largest GPU of
        ``sizes`` (largest first) holds, saying what could be asked instead."""
        span = self.admission.fewest_gpus(memory * lease.num_gpus, sizes) if lease.num_gpus == 1 else None
        if span is None:
            most_k, most = self.admission.most_that_fits(sizes)
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

    def _check_quota_room(self, state: PoolState, lease: Lease, total_extra: int) -> None:
        """Refuse ``total_extra`` bytes more for ``lease`` past its owner's or a group's maximum quota."""
        for who, quota in self.quotas.limits(lease.owner, lease.groups):
            held, _ = self.quotas.holdings(state, owner=lease.owner) if who == "your" else self.quotas.holdings(state, group=who.split(" ", 1)[1].rsplit("'", 1)[0])
            if quota.maximum is not None and held + total_extra > quota.maximum:
                room = max(0, quota.maximum - held) // lease.num_gpus + lease.memory
                raise RequestRefused(f"{who} maximum quota is {format_size(quota.maximum)}; this lease can grow to at most {format_size(room)}")

    def _reserve_now(self, state: PoolState, lease: Lease, memory: int, limit: int | None, now: float) -> None:
        """Make ``memory`` bytes per GPU the granted lease's guarantee and size (room checked)."""
        self.elastic.set_size(state, lease, memory, now)
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
        room = room_at_guarantees(state)
        return all(room.get(uuid, 0) >= memory - lease.guarantee_size for uuid in lease.devices)

    def serve_reserve(self, state: PoolState, lease: Lease, held_back: dict[str, int], now: float) -> list[Decision]:
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
            free = free_less(free_by_device(state, lease), held_back)
            missing = {uuid: wanted - lease.memory - free.get(uuid, 0) for uuid in lease.devices}
            if all(gap <= 0 for gap in missing.values()):
                self._reserve_now(state, lease, wanted, None, now)
                lease.burst_note = f"reserved {format_size(wanted * lease.num_gpus)}"
                decisions.append(decision(DecisionKind.GROW, lease, lease.burst_note, now))
                return decisions
            if attempt:
                break
            for uuid, gap in missing.items():
                decisions += self._take_burst_on(state, uuid, gap, lease, f"a reserve of {format_size(wanted)}", now)
        hold_back(held_back, lease, wanted)
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
                decisions.append(self.elastic.take_burst_back(state, other, new_size, taken_for, now))
        return decisions

    def _set_limit(self, state: PoolState, lease: Lease, limit: int | None) -> None:
        """After a size change, one rule: the limit its user set (``limit`` now, or one set
        before), else the pool's burst of its guarantee now. A limit set before that is below the
        new guarantee leaves the slice fixed at it."""
        candidates = self.placer.candidate_devices(state.devices, lease.model)
        if lease.devices:
            candidates = [d for d in candidates if d.uuid in lease.devices] or candidates
        asked = limit if limit is not None else lease.limit_asked
        if limit is None and asked is not None and asked < lease.guarantee_size:
            asked = 0
        lease.burst_limit = self.admission.burst_limit_for(asked, lease.guarantee_size, lease.num_gpus, candidates, lease.owner, lease.groups)
        if limit is not None:
            lease.limit_asked = limit
