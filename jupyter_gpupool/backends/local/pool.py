"""The pool facade every adapter uses: engine + store + device backend.

Each public method is one SQLite transaction: load the live state, let the pure
:class:`~jupyter_gpupool.core.engine.Engine` decide, save what changed. Processes sharing a DB
file (JupyterLab, ``nbconvert --execute``, the CLI, kernels running ``%gpupool``) therefore
share one pool without a daemon.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from traitlets.config import Config

from jupyter_gpupool.backends.changes import PoolChanges
from jupyter_gpupool.backends.contract import Capability
from jupyter_gpupool.backends.local.bookings import PoolBookings
from jupyter_gpupool.backends.local.driver import (
    HOSTNAME,
    freed_by_report,
    held_where_freed,
)
from jupyter_gpupool.backends.local.loading import (
    PoolLoading,
    host_memory,  # noqa: F401 (rest/metrics.py reads it here)
)
from jupyter_gpupool.backends.local.opening import pool_arguments, remember_inventory
from jupyter_gpupool.backends.local.rescue import adopt_rescued
from jupyter_gpupool.backends.local.store import Store
from jupyter_gpupool.backends.local.views import PoolViews
from jupyter_gpupool.backends.waiting import GrantWaiting
from jupyter_gpupool.core.engine import Engine, PoolState
from jupyter_gpupool.core.index import LeaseIndex
from jupyter_gpupool.core.models import (
    Activity,
    Decision,
    DecisionKind,
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PoolSnapshot,
    PriorityClass,
    QueueInfo,
    Transition,
)
from jupyter_gpupool.core.policy import PoolPolicy, Reservation, parse_reservation
from jupyter_gpupool.core.validate import PID_MAX_LIMIT
from jupyter_gpupool.devices import DeviceBackend, ProcessUsage
from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.enforcement.unpooled import (
    UnpooledUse,
    unpooled_line,
)
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound, RequestRefused
from jupyter_gpupool.units import parse_size


class Pool(GrantWaiting):
    """Who gets which slice of which GPU, who waits, and what is given back.

    The ``local`` :class:`~jupyter_gpupool.backends.contract.PoolBackend`: every process that opens
    the same pool file decides on it, in one SQLite transaction per decision."""

    kind = "local"
    capabilities = frozenset({Capability.SUSPEND, Capability.GROW, Capability.UNPOOLED})
    #: Decisions are taken in this process (the watchdog and scheduler loop run here).
    remote = False

    #: Seconds a backend inventory read is reused (NVML queries cost milliseconds).
    device_cache_seconds = 2.0
    #: Seconds history statistics (typical hold, recent sizes, usage) may lag other processes'
    #: decisions (this pool's own are applied as they commit).
    history_cache_seconds = 5.0

    def __init__(
        self,
        backend: DeviceBackend,
        db_path: str,
        policy: PoolPolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.backend = backend
        self.db_path = db_path
        self.policy = policy or PoolPolicy()
        self.policy.validate_all()
        self.clock = clock
        self.engine = Engine(self.policy)
        fresh = db_path != ":memory:" and not os.path.lexists(db_path)
        self.store = Store(db_path)
        remember_inventory(self.backend, self.store)
        #: Wakes whoever waits on this pool when it changed (this process's commits at once, other
        #: processes' within ``PoolChanges.interval``): see :meth:`wait_for_change`.
        self.changes = PoolChanges(None if self.store.path == ":memory:" else self.store.path)
        self.store.on_commit = self.changes.notify
        self._devices: tuple[float, list[Device]] | None = None
        self._simulated_host_memory: int | None = None  # of the cached device list (forgotten when it is read again)
        self._parsed_reservations: tuple[list[dict[str, Any]], list[Reservation]] | None = None
        #: Derived state of the store's cached leases, and the cache generation it was built for.
        self._index: tuple[int, LeaseIndex] | None = None
        #: The second connection views read through (see :meth:`_viewing`), and its derived state.
        self._view_store: Store | None = None
        self._view_index: tuple[int, LeaseIndex] | None = None
        self._view_store_lock = threading.Lock()
        #: Watchers whose last sighting of unpooled use is on file (see report_unpooled): read once
        #: here, so that an empty sighting clears rows an earlier pool object of the same watcher wrote.
        self._unpooled_reporters: set[str] = self.store.unpooled_reporters()
        #: What earlier driver readings found each GPU process to be (see :func:`holders_by_device`).
        self._owners_seen: dict[int, tuple[float, str, float]] = {}
        #: In a kernel's own process the driver is read before the write lock, as the inventory is
        #: (NVML there waits while a CUDA checkpoint holds the process); elsewhere in the decision,
        #: only when one needs it.
        self.read_driver_first = bool(os.environ.get("GPUPOOL_LEASE_ID") or os.environ.get("GPUPOOL_KERNEL_ID"))
        self._read_first: list[ProcessUsage] | None = None
        #: Reporter → its rows of memory held but not granted, where the last decision's load found
        #: some let go of (dropped or lowered); its save writes them down. Under the store's lock.
        self._settle: dict[str, list[dict[str, Any]]] = {}
        #: Loading and saving the state a decision or a view works on (loading.py), and the views (views.py).
        self.loading = PoolLoading(self)
        self.views = PoolViews(self)
        self.bookings = PoolBookings(self)
        if fresh:  # a pool file lost under running kernels: adopt them from its rescued copy
            adopt_rescued(self)

    @classmethod
    def from_env(cls, config: Config | None = None, environ: dict[str, str] | None = None, **overrides: Any) -> Pool:
        """A pool from ``GPUPOOL_SIMULATE`` (inventory; empty → NVML), ``GPUPOOL_DB`` and the
        policy variables (``GPUPOOL_DEFAULT_MEMORY``, ``GPUPOOL_IDLE_TIMEOUT``, ...)."""
        return cls(**pool_arguments(config, environ, overrides))

    # --- state loading ----------------------------------------------------------------------------
    def devices(self) -> list[Device]:
        """Poolable devices with this pool's overcommit factors applied."""
        now = time.monotonic()
        if self._devices is None or now - self._devices[0] > self.device_cache_seconds:
            devices = [
                Device(**{**d.__dict__, "overcommit": self.policy.overcommit_for(d.uuid, d.index)}) for d in self.backend.devices()
            ]
            self._devices = (now, devices)
            self._simulated_host_memory = None
        return list(self._devices[1])

    def _cached_devices(self) -> list[Device]:
        """The device list ``_load`` uses: the cached one, read afresh only if there is none yet."""
        return list(self._devices[1]) if self._devices is not None else self.devices()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's write transaction, entered only after the device inventory is fresh.

        A device query can block: NVML in a kernel whose process a CUDA checkpoint has locked
        waits until the kernel is restored. Made under the pool's write lock, that wait would
        stall every other process on the pool file, the server that must do the restore
        included; so the inventory is read first, and ``_load`` only reads the cache. So is the
        driver's per-process use in a kernel's own process (:attr:`read_driver_first`).
        """
        self.devices()
        if self.read_driver_first:
            self._read_first = self._processes_seen()
        with self.store.transaction():
            yield

    def _load(self, now: float, store: Store | None = None, processes: list[ProcessUsage] | None = None) -> PoolState:
        """The state a decision works on, or a view's (see :meth:`PoolLoading.load`)."""
        return self.loading.load(now, store, processes)

    def _viewing(self, now: float) -> contextlib.AbstractContextManager[tuple[PoolState, Store]]:
        """The state a view reads without the write lock, and its store (see :meth:`PoolLoading.viewing`)."""
        return self.loading.viewing(now)

    def _save(self, state: PoolState, decisions: list[Decision] | None = None) -> None:
        self.loading.save(state, decisions)

    #: Why memory a released lease's process still holds is not free (an unpooled row's ``why``).
    RELEASED_BUT_HELD = "its lease was released; the process has not let go of its memory yet"
    #: Why memory is not free that a kernel's process still holds on a GPU its suspend, move or
    #: failed restore was reported to have freed (the report is taken at once; this stays taken).
    PARKED_BUT_HELD = "its kernel's memory was reported parked or moved off this GPU; the process has not let go of it yet"
    #: Seconds such memory stays taken at the most, should its process never exit (a watchdog
    #: that sees it meanwhile reports it as unpooled use of its own).
    released_hold_ttl = 600.0

    def _reads(self) -> Store:
        """The store a plain read (a lease, a kernel's lease, a listing) goes to: the views' connection."""
        return self.loading.reader() or self.store

    @contextmanager
    def _decide(self, now: float) -> Iterator[PoolState]:
        with self._locked():
            state = self._load(now)
            yield state
            self._save(state)

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    # --- requests and leases ----------------------------------------------------------------------
    def default_memory(self) -> int:
        """The policy's default slice in bytes (a percentage is of the largest GPU)."""
        devices = self.devices()
        largest = max((d.memory_total for d in devices), default=0)
        return self.policy.default_memory_bytes(largest or 1)

    def parse_memory(self, text: str | int) -> int:
        """A user's size (``8GiB``, ``25%`` of the largest GPU) in bytes."""
        largest = max((d.memory_total for d in self.devices()), default=None)
        return parse_size(text, gpu_memory=largest)

    def request(self, req: LeaseRequest, now: float | None = None) -> Lease:
        """Queue a request and grant it at once if it fits; raises RequestRefused if it never can."""
        check_holder_pid(req.holder_pid)
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            lease = self.engine.admit(state, new_lease_id(), req, now)
            decisions = self.engine.schedule(state, now)
            if state.leases[lease.id].state is LeaseState.QUEUED:
                # It waits: a slice whose holder here died (a kernel SIGKILLed before it said so) goes first.
                released = self._release_dead_holders(state, now, granted_only=True)
                decisions += released + (self.engine.schedule(state, now) if released else [])
            self._save(state, decisions)
            return state.leases[lease.id].copy()

    def get(self, lease_id: str) -> Lease:
        return self._found(self._reads().lease(lease_id), lease_id)

    @staticmethod
    def _found(lease: Lease | None, lease_id: str) -> Lease:
        if lease is None:
            raise LeaseNotFound(f"no lease {lease_id!r}; list them with `jupyter gpupool leases`")
        return lease

    def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        lease = self._reads().latest_for_kernel(kernel_id)
        return lease if lease is not None and lease.live else None

    def last_lease_for_kernel(self, kernel_id: str) -> Lease | None:
        """The newest lease of a kernel, released or not (to say why it was reclaimed)."""
        return self._reads().latest_for_kernel(kernel_id)

    def leases(self, owner: str | None = None, include_released: bool = False, kernel_id: str | None = None) -> list[Lease]:
        """Every matching lease, newest first (filtered in SQL, never cut short)."""
        return self._reads().leases(owner=owner, include_released=include_released, kernel_id=kernel_id)

    def live_leases_of(self, owners: Iterable[str]) -> dict[str, list[Lease]]:
        """Each of ``owners``' live leases (copies), from the lease cache (see :meth:`PoolViews.live_leases_of`)."""
        return self.views.live_leases_of(owners)

    def lease_owners(self, lease_ids: list[str]) -> dict[str, str]:
        """``{lease id: owner}`` for the ids that exist: authorization by id, not by listing."""
        return self._reads().lease_owners(lease_ids)

    def queue(self, now: float | None = None) -> list[Lease]:
        return self.views.queue(now)

    def queue_info(self, lease_id: str, now: float | None = None) -> QueueInfo | None:
        return self.views.queue_info(lease_id, now)

    def grow_place(self, lease_id: str, now: float | None = None) -> int | None:
        """1-based place in line of a kernel waiting for its slice to grow; None when it does not wait."""
        return self.views.grow_place(lease_id, now)

    def release(self, lease_id: str, reason: str = "released by user", now: float | None = None) -> Lease:
        now = self._now(now)
        processes = self._processes_seen()  # before the write lock: what its kernel may still hold
        with self._locked():
            state = self._load(now)
            if lease_id not in state.leases:
                return self._found(self.store.lease(lease_id), lease_id)  # already released: releasing twice is harmless
            state.driver = self.loading.holdings_reader(state.leases, processes)
            lease = self.engine.release(state, lease_id, reason, now)
            decisions = [Decision(DecisionKind.RELEASE, lease.id, lease.kernel_id, lease.owner, reason, now)]
            decisions += self.engine.schedule(state, now)
            self._save(state, decisions)
            return lease.copy()

    # --- suspend, resume, moves (two-phase: the engine decides, the holder's server does it) ------
    def suspend(self, lease_id: str, reason: str = "suspended by its user", now: float | None = None) -> Lease:
        """Ask for this lease's GPU memory to be parked in host RAM; its server carries it out and
        confirms. Raises :class:`RequestRefused` saying why when it cannot be suspended."""
        now = self._now(now)
        processes = self._processes_seen()  # read once, before the write lock: judged and booked at it
        with self._locked():
            state = self._load(now)
            state.driver = self.loading.holdings_reader(state.leases, processes)
            decisions = [self.engine.suspend(state, lease_id, reason, now)]
            decisions += self.engine.schedule(state, now)
            self._save(state, decisions)
            return state.leases[lease_id].copy()

    def _sees_processes(self) -> bool:
        """Whether this pool's backend lists the processes on its GPUs (NVML, simulated; not Slurm)."""
        return getattr(self.backend, "name", "") in ("nvml", "simulated")

    def _processes_seen(self) -> list[ProcessUsage]:
        """The driver's per-process GPU use now ([] where the backend sees no processes)."""
        return self.backend.process_usage() if self._sees_processes() else []

    def resume(self, lease_id: str, now: float | None = None, ahead: bool = False) -> Lease:
        """Queue a suspended lease to come back; granted by policy like any request. ``ahead``: a
        resume asked before a cell needs it, which queues behind every real request."""
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            self.engine.resume(state, lease_id, now, ahead=ahead)
            decisions = self.engine.schedule(state, now)
            self._save(state, decisions)
            return state.leases[lease_id].copy()

    def confirm_transition(self, lease_id: str, parked_bytes: int | None = None, now: float | None = None) -> Lease:
        """The holder's server finished a suspend (``parked_bytes`` in host RAM), restore or move.

        Taken at once, from one reading of the driver and without waiting on it: whatever the
        driver still shows the kernel's processes holding on the GPUs the step frees stays taken
        (held, not granted: :attr:`PARKED_BUT_HELD`) until the driver shows it free, so no report
        can free memory that a process still holds (nor, by being refused, hold up the pool)."""
        now = self._now(now)
        if parked_bytes is not None:  # a bad figure is a 400 before anything else is looked at
            with self._viewing(now) as (state, _):
                lease = state.leases.get(lease_id)
                if lease is not None and lease.transition is Transition.SUSPENDING:
                    self.engine.bounded_parked_bytes(state, lease, parked_bytes)
        processes = self._processes_seen()  # one driver read, before the write lock
        with self._locked():
            state = self._load(now, processes=processes)
            lease = self.engine.get(state, lease_id)
            held = held_where_freed(state, lease, freed_by_report(lease))
            lease = self.engine.confirm_transition(state, lease_id, now, parked_bytes)
            if held:
                state.released_holdings.append((lease, held))
            decisions = self.engine.schedule(state, now)
            self._save(state, decisions)
            return (state.leases.get(lease_id) or lease).copy()

    def fail_transition(self, lease_id: str, error: str, still_running: bool, now: float | None = None) -> Lease:
        """The holder's server could not finish a suspend, restore or move (see
        :meth:`Engine.fail_transition`); returns the lease as it is now (released if the kernel must stop).
        A restore that failed with the memory still parked gives its GPUs back at once; whatever the
        driver shows the kernel holding there stays taken, as after a suspend's confirmation."""
        now = self._now(now)
        processes = self._processes_seen()  # one driver read, before the write lock
        with self._locked():
            state = self._load(now, processes=processes)
            lease = self.engine.get(state, lease_id)
            parked_again = still_running and lease.restore_failures < 1  # a second failure in a row stops it instead
            held = held_where_freed(state, lease, freed_by_report(lease, failed_restore=True)) if parked_again else []
            decisions = self.engine.fail_transition(state, lease_id, error, still_running, now)
            if held and lease.state is not LeaseState.RELEASED:  # a release keeps its own (the engine's seam)
                state.released_holdings.append((lease, held))
            decisions += self.engine.schedule(state, now)
            self._save(state, decisions)
            return lease.copy()

    def resize(self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None,
               limit: int | None = None) -> Lease:
        """Grow or shrink what a lease is guaranteed (``limit``: how far it may grow, 0 for a fixed
        slice); ``duration`` holds it through idle that long. Metering bills each size for its own
        time (the engine records it: see core.metering.memory_segments)."""
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            lease = self.engine.get(state, lease_id)
            if memory is not None or limit is not None:
                self.engine.resize(state, lease_id, memory if memory is not None else lease.guarantee_size, now, limit)
            if duration is not None:
                self.engine.keep(state, lease_id, duration, now)
            decisions = self.engine.schedule(state, now)
            self._save(state, decisions)
            return state.leases[lease_id].copy()

    def set_priority(self, lease_id: str, priority: str, now: float | None = None) -> Lease:
        """Re-prioritise a lease (admins): ``batch``, ``normal`` or ``high``; the queue re-orders at once."""
        try:
            cls = PriorityClass(priority)
        except ValueError:
            raise InvalidInput(f"invalid priority class {priority!r}: use batch, normal or high") from None
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            lease = self.engine.get(state, lease_id)
            lease.priority = cls
            state.touch(lease)
            decisions = self.engine.schedule(state, now)
            self._save(state, decisions)
            return lease.copy()

    def keep(self, lease_id: str, seconds: float, now: float | None = None) -> Lease:
        return self.resize(lease_id, None, seconds, now)

    def report_activity(self, lease_id: str, activity: Activity, now: float | None = None) -> None:
        now = self._now(now)
        with self._decide(now) as state:
            if lease_id in state.leases:
                self.engine.report_activity(state, lease_id, activity, now)

    def report_activities(self, activities: dict[str, Activity], now: float | None = None) -> None:
        """Many kernels' activity in one transaction (see :meth:`tick` to report and schedule in one)."""
        now = self._now(now)
        with self._decide(now) as state:
            self._take_activities(state, activities, now)

    def _take_activities(self, state: PoolState, activities: dict[str, Activity], now: float) -> None:
        for lease_id, activity in activities.items():
            if lease_id in state.leases:
                self.engine.report_activity(state, lease_id, activity, now)

    def heartbeat(self, lease_ids: list[str], now: float | None = None) -> None:
        now = self._now(now)
        with self._decide(now) as state:
            for lease_id in lease_ids:
                if lease_id in state.leases:
                    self.engine.heartbeat(state, lease_id, now)

    def grace_after_outage(self, now: float | None = None) -> int:
        """A fresh start for every live lease after an outage (see :meth:`Engine.grace_after_outage`)."""
        now = self._now(now)
        with self._decide(now) as state:
            return self.engine.grace_after_outage(state, now)

    def reserve_pinned_backup(self, lease_id: str, amount: int, now: float | None = None) -> Lease:
        """Set aside ``amount`` bytes of the host's pinned parking pool for the lease's framework
        backup (see :meth:`Engine.reserve_pinned_backup`); nothing changes when it is refused."""
        now = self._now(now)
        with self._decide(now) as state:
            return self.engine.reserve_pinned_backup(state, lease_id, amount, now).copy()

    def grow(self, lease_id: str, needed: int, now: float | None = None) -> Lease:
        """Grow an elastic slice so its kernel can hold ``needed`` bytes (all its GPUs), as a
        framework cap's allocation failure asks; raises :class:`RequestRefused` saying why not."""
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            refusal: RequestRefused | None = None
            try:
                decision = self.engine.grow(state, lease_id, needed, now)
            except RequestRefused as refused:
                # A grow refused for room waits in line: that is kept. Raised after the commit, so a
                # refusal (a framework cap's retry, often) costs no rollback of the lease cache.
                refusal, decision = refused, None
            self._save(state, [decision] if decision is not None else [])
            lease = state.leases[lease_id].copy()
        if refusal is not None:
            raise refusal
        return lease

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]:
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            decisions = self.engine.report_usage(state, usage, now)
            self._save(state, [d for d in decisions if d.kind is not DecisionKind.OVER_LIMIT or self._first_over(state, d)])
            return decisions

    #: Seconds a watcher's sighting of unpooled use counts: a watcher that stopped looking (it died)
    #: stops holding memory back after this long.
    unpooled_ttl = 30.0

    def report_unpooled(self, uses: list[UnpooledUse], reporter: str | None = None, ttl: float | None = None,
                        now: float | None = None) -> list[Decision]:
        """The host's watcher saw ``uses`` (its whole sighting: it replaces the last one). Memory
        they hold is not granted to anyone while the sighting lasts (``ttl`` seconds); use first
        seen now is recorded as an event. Only the process that owns the GPUs calls this: a
        client's word about unpooled use is never taken (see RemotePool)."""
        now = self._now(now)
        ttl = self.unpooled_ttl if ttl is None else ttl
        reporter = reporter or f"{HOSTNAME}:{os.getpid()}"
        if not uses and reporter not in self._unpooled_reporters:
            return []  # nothing seen now, nothing of ours on file: no write (a watchdog step's usual case)
        with self._locked():
            earlier = self.store.unpooled_keys(reporter, now)
            rows = [{**use.to_json(), "expires_at": now + ttl} for use in uses]
            self.store.replace_unpooled(reporter, rows, now)
            (self._unpooled_reporters.add if rows else self._unpooled_reporters.discard)(reporter)
            decisions = [
                Decision(DecisionKind.UNPOOLED, "", None, use.user or "", unpooled_line(use), now)
                for use in uses
                if (use.host, use.device, use.pid) not in earlier
            ]
            self.store.record_decisions(decisions)
            if earlier or rows:  # memory taken or given back outside the pool changes who fits: decide again
                state = self._load(now)
                scheduled = self.engine.schedule(state, now)
                self._save(state, scheduled)
                decisions += scheduled
            return decisions

    def unpooled(self, now: float | None = None) -> list[dict[str, Any]]:
        """Unexpired unpooled use on this pool's hosts, one row per (host, GPU, pid)."""
        return self.views.unpooled(now)

    @staticmethod
    def _first_over(state: PoolState, decision: Decision) -> bool:
        lease = state.leases.get(decision.lease_id)
        return lease is not None and lease.over_limit_since == decision.at

    #: Seconds between two prunes of old rows by one process (see PoolPolicy.retention_days).
    prune_interval = 3600.0

    def prune(self, now: float | None = None) -> dict[str, int]:
        """Delete released leases, events and ledger rows past the policy's retention."""
        now = self._now(now)
        day = 86400.0
        leases_before = now - self.policy.retention_days * day if self.policy.retention_days > 0 else None
        ledger_before = now - self.policy.ledger_retention_days * day if self.policy.ledger_retention_days > 0 else None
        with self.store.transaction():
            removed = self.store.prune(leases_before, ledger_before)
        self._last_prune = now
        return removed

    def tick(self, now: float | None = None, activities: dict[str, Activity] | None = None) -> list[Decision]:
        """Run the scheduler once; also release leases whose holder process on this host died,
        and now and then prune rows past their retention. ``activities`` (kernels' activity, as
        :meth:`report_activities` takes it) are taken first, in the same transaction: a server's
        periodic round costs one transaction, not two."""
        now = self._now(now)
        if now - getattr(self, "_last_prune", float("-inf")) >= self.prune_interval:
            self.prune(now)
        with self._locked():
            state = self._load(now)
            if activities:
                self._take_activities(state, activities, now)
            decisions = self._release_dead_holders(state, now)
            decisions += self.engine.schedule(state, now)
            self._save(state, decisions)
            return decisions

    def _release_dead_holders(self, state: PoolState, now: float, granted_only: bool = False) -> list[Decision]:
        """Release live leases (``granted_only``: granted ones) whose holder process on this host exited."""
        decisions: list[Decision] = []
        for lease in list(state.leases.values()):
            if granted_only and lease.state is not LeaseState.GRANTED:
                continue
            if lease.holder_pid and lease.holder_host == HOSTNAME and not process_alive(lease.holder_pid):
                reason = f"released: its holder process {lease.holder_pid} exited"
                self.engine.release(state, lease.id, reason, now)
                decisions.append(Decision(DecisionKind.RELEASE, lease.id, lease.kernel_id, lease.owner, reason, now))
        return decisions

    def reconcile_kernels(self, holder_host: str, holder_pid: int, live_kernel_ids: set[str], now: float | None = None) -> list[Lease]:
        """Release live leases of this holder whose kernel no longer exists."""
        now = self._now(now)
        with self._locked():
            state = self._load(now)
            gone = [
                lease
                for lease in state.leases.values()
                if lease.holder_host == holder_host
                and lease.holder_pid == holder_pid
                and lease.kernel_id
                and lease.kernel_id not in live_kernel_ids
            ]
            decisions = []
            for lease in gone:
                reason = "released: its kernel is gone"
                self.engine.release(state, lease.id, reason, now)
                decisions.append(Decision(DecisionKind.RELEASE, lease.id, lease.kernel_id, lease.owner, reason, now))
            if gone:
                decisions += self.engine.schedule(state, now)
            self._save(state, decisions)
            return [lease.copy() for lease in gone]

    # --- waiting ----------------------------------------------------------------------------------
    def _look_at_request(self, lease_id: str, last: QueueInfo | None, deadline: float | None) -> tuple[Lease, QueueInfo | None]:
        """Run the scheduler, heartbeat the waiting request, and say where it stands (see GrantWaiting)."""
        now = self.clock()
        with self._locked():
            state = self._load(now)
            lease = state.leases.get(lease_id)
            if lease is not None and lease.state is LeaseState.QUEUED:
                self.engine.heartbeat(state, lease_id, now)
            decisions = self.engine.schedule(state, now)
            self._save(state, decisions)
            lease = state.leases.get(lease_id)
            if lease is None:
                released = self._found(self.store.lease(lease_id), lease_id)
                raise RequestRefused(
                    f"the request was {released.release_reason or 'released'} before it was granted" if released.granted_at is None
                    else f"its GPU slice was {released.release_reason or 'released'} after it was granted, before the kernel started"
                )
            info = self.engine.queue_info(state, lease_id, now) if lease.state is LeaseState.QUEUED else None
            return lease.copy(), info

    # --- views and metering (see views.py) ------------------------------------------------------
    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """Devices, leases and queue as ``viewer`` may see them (others anonymous unless admin)."""
        return self.views.snapshot(viewer, admin, now)

    @staticmethod
    def view_unpooled(row: dict[str, Any], viewer: str | None, admin: bool) -> dict[str, Any]:
        """Unpooled use as ``viewer`` may see it (see :meth:`PoolViews.view_unpooled`)."""
        return PoolViews.view_unpooled(row, viewer, admin)

    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        """A lease as JSON for ``viewer`` (see :meth:`PoolViews.view_lease`)."""
        return PoolViews.view_lease(lease, viewer, admin, position)

    def report(
        self,
        since: float | None = None,
        until: float | None = None,
        by: str = "user",
        now: float | None = None,
        period: str = "none",
    ) -> list[dict[str, Any]]:
        """GPU-hours, GiB·hours held and active per user, group or kernel (see :meth:`PoolViews.report`)."""
        return self.views.report(since, until, by, now, period)

    # --- reservations and preferences (see bookings.py) ------------------------------------------
    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Reservation:
        """Hold capacity for users or groups (see :attr:`PoolPolicy.reservations` for the forms)."""
        return self.bookings.book_reservation(spec, now)

    def cancel_reservation(self, name: str) -> None:
        self.bookings.cancel_reservation(name)

    def reservations(self) -> list[Reservation]:
        return self.policy.parsed_reservations() + [parse_reservation(r) for r in self._reads().reservations()]

    def preference(self, owner: str) -> dict[str, Any]:
        return self._reads().preference(owner)

    def set_preference(self, owner: str, **values: Any) -> None:
        """Save ``owner``'s defaults; a value not in its accepted form is an InvalidInput, saving nothing."""
        self.bookings.set_preference(owner, values)

    def events(self, after_seq: int = 0) -> list[dict[str, Any]]:
        return self._reads().events(after_seq)

    # --- hearing of changes -------------------------------------------------------------------
    def wait_for_change(self, since: int | None, timeout: float) -> int:
        """Block until the pool changed after version ``since`` (any process's commit) or ``timeout``
        seconds passed; the version now (``since`` None: at once). Wakes in milliseconds, not on a tick."""
        return self.changes.wait(since, timeout)

    def subscribe_changes(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` (from any thread) after every change of the pool; returns the unsubscriber."""
        return self.changes.subscribe(listener)

    def close(self) -> None:
        self.changes.close()
        self.store.close()
        if self._view_store is not None:
            self._view_store.close()
        self.backend.close()


#: Members of this Unix group are admins of a local pool (as they are of the broker, over its socket).
LOCAL_ADMIN_GROUP = "gpupool-admin"


def local_admin(db_path: str, uid: int | None = None) -> bool:
    """Whether this process (or ``uid``) administers the local pool at ``db_path``: ``root``, the
    owner of the pool file's folder, or a member of :data:`LOCAL_ADMIN_GROUP`. Decided by the real
    uid, never by ``$USER``. (A broker decides for itself who its admins are.)"""
    import grp
    import pwd

    uid = os.geteuid() if uid is None else uid
    if uid == 0:
        return True
    with contextlib.suppress(OSError):
        if os.stat(os.path.dirname(os.path.abspath(db_path))).st_uid == uid:
            return True
    try:
        entry = pwd.getpwuid(uid)
        group = grp.getgrnam(LOCAL_ADMIN_GROUP)
    except KeyError:
        return False
    return entry.pw_name in group.gr_mem or entry.pw_gid == group.gr_gid


def new_lease_id() -> str:
    """``l-`` + creation time in µs (hex) + randomness: unique across processes and ordered by
    creation, so requests made at the same instant keep their order in the queue."""
    return f"l-{time.time_ns() // 1000:013x}{uuid.uuid4().hex[:6]}"


def check_holder_pid(pid: Any) -> None:
    """Refuse a holder pid no process can have (it would never be reclaimed, or break the check)."""
    if pid is None:
        return
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid <= PID_MAX_LIMIT:
        raise InvalidInput(f"invalid holder_pid {pid!r}: a process id is a whole number from 1 to {PID_MAX_LIMIT}")


