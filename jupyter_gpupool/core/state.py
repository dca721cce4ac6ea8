"""What one decision sees: the pool's state, loaded for one call and saved after it.

:class:`PoolState` is the snapshot every decision module works on; :class:`DriverPort` is the one
way a decision reads the driver (what processes hold on the GPUs now). Pure: nothing here touches
Jupyter, HTTP, NVML or the clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from jupyter_gpupool.core.index import LeaseIndex, pinned_ceiling
from jupyter_gpupool.core.models import Decision, DecisionKind, Device, Lease, LeaseState
from jupyter_gpupool.core.policy import Reservation

HELD_STATES = (LeaseState.GRANTED,)  # suspended leases hold no GPU memory


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
    #: as it shows it free: see :func:`~jupyter_gpupool.core.capacity.taken_by_device`.
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
        whoever holds it (:func:`~jupyter_gpupool.core.capacity.taken_by_device`)."""
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


def decision(kind: DecisionKind, lease: Lease, reason: str, now: float, deadline: float | None = None) -> Decision:
    """A decision about ``lease``, as the pool records and reports it."""
    return Decision(kind=kind, lease_id=lease.id, kernel_id=lease.kernel_id, owner=lease.owner, reason=reason, at=now, deadline=deadline)


def now_within(since: float, now: float, seconds: float) -> bool:
    """Whether ``now`` is less than ``seconds`` after ``since``."""
    return now - since < seconds
