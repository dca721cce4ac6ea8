"""The contract every pool backend keeps: where kernels' GPU slices are decided.

A *pool backend* decides leases: the single-host pool on its SQLite file
(:class:`~jupyter_gpupool.backends.local.pool.Pool`), the broker's client
(:class:`~jupyter_gpupool.backends.remote.RemotePool`) and Slurm
(:class:`~jupyter_gpupool.backends.slurm.pool.SlurmPool`). It is not a *device backend*
(:mod:`jupyter_gpupool.devices`: NVML or simulated GPUs), which a pool backend reads through its
``backend`` attribute.

:class:`PoolBackend` is what every caller (the provisioner, the server extension, the broker, the
kernel side, the command line) may use on any of them. What only some can do is a
:class:`Capability`: an implementation lists the ones it has in ``capabilities``, and a caller asks
with :func:`supports` before it uses the members that :data:`CAPABILITY_MEMBERS` names for it. A
test (``tests/test_backend_contract.py``) checks that each implementation has every member of the
contract and of its claimed capabilities, with a compatible signature. See docs/architecture.md for
how to add a backend.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from jupyter_gpupool.core.models import Activity, Decision, Device, Lease, LeaseRequest, PoolSnapshot, QueueInfo

if TYPE_CHECKING:
    from jupyter_gpupool.core.policy import PoolPolicy

#: ``on_update(lease, queue_info)``: what a caller waiting for a grant hears at each look.
UpdateCallback = Callable[[Lease, "QueueInfo | None"], None]


class Capability(str, enum.Enum):
    """What a pool backend may or may not do, beyond :class:`PoolBackend`."""

    #: Park a kernel's GPU memory in host RAM and bring it back (``suspend``, ``resume`` and the
    #: holder's ``confirm_transition`` / ``fail_transition``). Slurm has none.
    SUSPEND = "suspend"
    #: Elastic slices: a slice has a guarantee and a limit and grows between them while its GPU has
    #: memory nobody is guaranteed (``grow``, and ``resize(..., limit=)`` / a request's
    #: ``burst_limit``). The single-host pool and the broker have it (the broker grows slices from
    #: its own NVML measurements and takes burst back for waiting requests). Slurm has none: a
    #: kernel's GPU shards are fixed when its job is submitted, so its slice never bursts.
    GROW = "grow"
    #: Set what NVML shows against the pool's leases (``report_unpooled``, ``unpooled``): only a pool
    #: that owns this host's GPUs. A client's word about unpooled use is never taken.
    UNPOOLED = "unpooled"
    #: Kernels reach the pool through variables of its own (``client_env``) instead of the pool file.
    CLIENT_ENV = "client_env"
    #: The pool says who the caller is and whether they are admin (``whoami``).
    WHOAMI = "whoami"
    #: A backend's own facts about a lease (``lease_details``: Slurm's job id, partition, position).
    LEASE_DETAILS = "lease_details"


@runtime_checkable
class PoolBackend(Protocol):
    """Leases of GPU memory for kernels, the queue behind them, and what admins read of them."""

    # Set on the class by each implementation.
    #: Which implementation this is: ``local``, ``broker`` or ``slurm``.
    kind: str
    #: The optional members this implementation has (see :class:`Capability`).
    capabilities: frozenset[Capability]
    #: Whether decisions are taken elsewhere (a broker, Slurm): then this process checks no owner itself.
    remote: bool
    #: The device backend the pool sees (``describe()``, ``devices()``, ``process_usage()``).
    backend: Any
    #: The word a wait's messages use for a lease not yet granted (``queued``; Slurm: ``pending``).
    waiting_word: str

    @property
    def policy(self) -> PoolPolicy:
        """The scheduling policy in force (a read-only copy where decisions are taken elsewhere)."""
        ...

    def devices(self) -> list[Device]:
        """The GPUs (or MIG instances) leases are placed on, with their memory and health."""
        ...

    def default_memory(self) -> int:
        """Bytes a request that names no size gets."""
        ...

    def parse_memory(self, text: str | int) -> int:
        """Bytes of a size a user wrote (``8GiB``, ``25%``, bytes); InvalidInput if it is not one."""
        ...

    def request(self, req: LeaseRequest, now: float | None = None) -> Lease:
        """Ask for a slice: granted now, queued, or RequestRefused saying why never."""
        ...

    def wait_for_grant(
        self, lease_id: str, timeout: float | None = None, poll: float = 0.5, on_update: UpdateCallback | None = None
    ) -> Lease:
        """Block until the lease is granted; TimeoutError after ``timeout``, RequestRefused if it is released."""
        ...

    async def await_grant(
        self, lease_id: str, timeout: float | None = None, poll: float = 0.5, on_update: UpdateCallback | None = None
    ) -> Lease:
        """:meth:`wait_for_grant` without blocking the event loop."""
        ...

    def get(self, lease_id: str) -> Lease:
        """One lease, in any state; LeaseNotFound if the pool never had it."""
        ...

    def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        """The kernel's live (not released) lease, if any."""
        ...

    def last_lease_for_kernel(self, kernel_id: str) -> Lease | None:
        """The kernel's newest lease, released ones included."""
        ...

    def leases(self, owner: str | None = None, include_released: bool = False) -> list[Lease]:
        """Leases, of one owner or all, live ones unless ``include_released``."""
        ...

    def queue(self, now: float | None = None) -> list[Lease]:
        """Queued leases in the order they will be considered."""
        ...

    def queue_info(self, lease_id: str, now: float | None = None) -> QueueInfo | None:
        """A queued lease's position and estimated wait; ``None`` if it is not queued."""
        ...

    def release(self, lease_id: str, reason: str = "released by user", now: float | None = None) -> Lease:
        """Give the slice back (idempotent); the memory is free for the queue at once."""
        ...

    def resize(
        self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None
    ) -> Lease:
        """Change a lease's size or time limit, where the pool has room; RequestRefused otherwise."""
        ...

    def keep(self, lease_id: str, seconds: float, now: float | None = None) -> Lease:
        """Keep an idle lease from being reclaimed for ``seconds``."""
        ...

    def set_priority(self, lease_id: str, priority: str, now: float | None = None) -> Lease:
        """Admins: move a lease to another priority class (``batch``, ``normal``, ``high``)."""
        ...

    def report_activity(self, lease_id: str, activity: Activity, now: float | None = None) -> None:
        """Tell the pool whether a lease's kernel is busy or idle (for idle reclaim)."""
        ...

    def report_activities(self, activities: dict[str, Activity], now: float | None = None) -> None:
        """:meth:`report_activity` for many leases at once."""
        ...

    def heartbeat(self, lease_ids: list[str], now: float | None = None) -> None:
        """The holder is alive: its leases are not reclaimed as orphans."""
        ...

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]:
        """Bytes each lease's kernel uses now (the watchdog's reading); returns decisions it causes."""
        ...

    def tick(self, now: float | None = None, activities: dict[str, Activity] | None = None) -> list[Decision]:
        """Run the scheduler once: grants, reclaims, expiries, suspends and moves due now."""
        ...

    def reconcile_kernels(
        self, holder_host: str, holder_pid: int, live_kernel_ids: set[str], now: float | None = None
    ) -> list[Lease]:
        """Release the leases a holder holds for kernels it no longer runs; returns them."""
        ...

    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """Devices, leases and queue as ``viewer`` may see them (others' details only for admins)."""
        ...

    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        """A lease as JSON for ``viewer``: another user's lease without its details unless admin."""
        ...

    def report(
        self,
        since: float | None = None,
        until: float | None = None,
        by: str = "user",
        now: float | None = None,
        period: str = "none",
    ) -> list[dict[str, Any]]:
        """Metering: GPU-hours and GiB·hours per user, group or kernel (and period)."""
        ...

    def reservations(self) -> list[Any]:
        """Booked reservations (memory set aside for users or groups in a window)."""
        ...

    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Any:
        """Admins: book a reservation; InvalidInput when it does not fit."""
        ...

    def cancel_reservation(self, name: str) -> None:
        """Admins: cancel a reservation by name."""
        ...

    def preference(self, owner: str) -> dict[str, Any]:
        """A user's saved preferences (default size, model)."""
        ...

    def set_preference(self, owner: str, **values: Any) -> None:
        """Save a user's preferences (validated; bad values change nothing)."""
        ...

    def events(self, after_seq: int = 0) -> list[dict[str, Any]]:
        """Lease events after sequence number ``after_seq``, oldest first."""
        ...

    def close(self) -> None:
        """Let go of files, connections and driver handles."""
        ...


class SuspendingBackend(PoolBackend, Protocol):
    """A pool backend with :attr:`Capability.SUSPEND`."""

    def suspend(self, lease_id: str, reason: str = "suspended by its user", now: float | None = None) -> Lease:
        """Begin parking the lease's GPU memory in host RAM (its holder carries it out and confirms)."""
        ...

    def resume(self, lease_id: str, now: float | None = None) -> Lease:
        """Queue a suspended lease to come back (harmless if already resuming or running)."""
        ...

    def confirm_transition(self, lease_id: str, parked_bytes: int | None = None, now: float | None = None) -> Lease:
        """The holder finished the suspend, restore or move under way (``parked_bytes`` in host RAM)."""
        ...

    def fail_transition(self, lease_id: str, error: str, still_running: bool, now: float | None = None) -> Lease:
        """The holder could not finish the step under way; the lease as it is now."""
        ...

    def reserve_pinned_backup(self, lease_id: str, amount: int, now: float | None = None) -> Lease:
        """Set aside ``amount`` bytes of the host's pinned parking pool for the lease's framework
        backup (0 gives it back); RequestRefused saying why when there is no room."""
        ...


class ElasticBackend(PoolBackend, Protocol):
    """A pool backend with :attr:`Capability.GROW`."""

    def resize(
        self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None,
        limit: int | None = None,
    ) -> Lease:
        """As :meth:`PoolBackend.resize`; ``limit``: bytes per GPU the slice may grow to (0: a fixed
        slice; None keeps the one it has)."""
        ...

    def grow(self, lease_id: str, needed: int, now: float | None = None) -> Lease:
        """Grow the elastic slice so its kernel can hold ``needed`` bytes (all its GPUs), into memory
        nobody is guaranteed and up to its limit; RequestRefused saying why not."""
        ...

    def grow_place(self, lease_id: str, now: float | None = None) -> int | None:
        """1-based place in line of a kernel whose grow waits for room (``Lease.grow_since``),
        counting those served before it who could take room on its GPUs; None when it does not wait."""
        ...


#: What a user who asks a backend without :attr:`Capability.GROW` for a limit or a grow is told.
NO_BURST = "this pool's slices are fixed in size: they do not grow above what was asked"

#: The members each capability adds to :class:`PoolBackend`.
CAPABILITY_MEMBERS: dict[Capability, tuple[str, ...]] = {
    Capability.SUSPEND: ("suspend", "resume", "confirm_transition", "fail_transition", "reserve_pinned_backup"),
    Capability.GROW: ("grow",),
    Capability.UNPOOLED: ("report_unpooled", "unpooled"),
    Capability.CLIENT_ENV: ("client_env",),
    Capability.WHOAMI: ("whoami",),
    Capability.LEASE_DETAILS: ("lease_details",),
}


def supports(pool: object, capability: Capability) -> bool:
    """Whether ``pool`` claims ``capability`` (and so has the members it names)."""
    return capability in getattr(pool, "capabilities", frozenset())


__all__ = ["CAPABILITY_MEMBERS", "NO_BURST", "Capability", "ElasticBackend", "PoolBackend", "SuspendingBackend", "UpdateCallback", "supports"]
