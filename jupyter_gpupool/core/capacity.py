"""What is free on each GPU: the one rule that only what the driver shows free is free.

Every decision that asks where memory is free asks here. Taken on a GPU is what its granted
leases hold (``max(slice, used)``), plus whatever the driver shows held there that no grant
accounts for (a released kernel still exiting, a shrunk slice above its size, a process of
nobody's), never less than the watchers' last sighting of unpooled use. Pure functions of a
:class:`~jupyter_gpupool.core.state.PoolState`.
"""

from __future__ import annotations

from collections.abc import Mapping

from jupyter_gpupool.core.index import excess_per_device
from jupyter_gpupool.core.models import Lease, LeaseState, Transition
from jupyter_gpupool.core.state import HELD_STATES, PoolState, now_within


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


def free_by_device(state: PoolState, lease: Lease | None = None, reservations: bool = True) -> dict[str, int]:
    """Leasable bytes left per healthy device, as ``lease``'s owner sees it (reservations held back,
    unless ``reservations`` is False)."""
    taken = taken_by_device(state)
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


def free_with_room_on_its_way(state: PoolState, head: Lease, now: float, burst_settle: float) -> dict[str, int]:
    """Free bytes per device as ``head`` sees them, plus what leases already on their way out
    will free: warned leases, leases being suspended, the GPUs moving leases leave, and burst
    being given back (within ``burst_settle`` of being taken back)."""
    free = free_by_device(state, head)
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
        if lease.burst_taken_at is not None and now_within(lease.burst_taken_at, now, burst_settle):
            for uuid in lease.devices:
                free[uuid] = free.get(uuid, 0) + excess_per_device(lease)
    return free


def lowered(state: PoolState, lease: Lease, before: int) -> None:
    """A path just lowered what granted ``lease`` may hold on its GPUs (from ``before`` bytes per
    GPU). Whatever the driver shows held stays taken in every decision (see
    :func:`taken_by_device`); besides, a kernel the watchdog measured counts at ``before``
    until it measures it within its new size (:attr:`Lease.burst_from`). One nobody measured
    counts for what the driver shows, decision by decision; where the pool reads no driver, at
    ``before`` too."""
    measured = lease.used_memory is not None
    lease.burst_from = before if measured or state.driver is None else 0
    state.touch(lease)


def room_at_guarantees(state: PoolState) -> dict[str, int]:
    """Bytes free per device if every slice gave its burst back (what admission counts)."""
    room = free_by_device(state)
    for other in state.leases.values():
        if other.state in HELD_STATES:
            above = max(0, other.memory + excess_per_device(other) - other.guarantee_size)
            for uuid in other.devices:
                if uuid in room:
                    room[uuid] += above
    return room


def free_less(free: dict[str, int], held_back: Mapping[str, int]) -> dict[str, int]:
    return {uuid: room - held_back.get(uuid, 0) for uuid, room in free.items()} if held_back else free


def hold_back(held_back: dict[str, int], lease: Lease, wanted: int) -> None:
    for uuid in lease.devices:
        held_back[uuid] = held_back.get(uuid, 0) + max(0, wanted - lease.memory)
