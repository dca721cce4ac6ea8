"""Loading and saving the state a decision or a view of the local pool works on: the live leases,
history and unpooled use read in one transaction, the driver read at most once, and what a decision
changed written back (see :class:`~jupyter_gpupool.backends.local.pool.Pool`)."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.local.driver import (
    HOSTNAME,
    DriverReading,
    ended_in,
    held_rows,
    still_held,
)
from jupyter_gpupool.backends.local.store import Store
from jupyter_gpupool.core.engine import PoolState
from jupyter_gpupool.core.index import LeaseIndex
from jupyter_gpupool.core.metering import DeviceInfo
from jupyter_gpupool.core.models import (
    Decision,
    Lease,
    LeaseState,
)
from jupyter_gpupool.core.policy import parse_reservation
from jupyter_gpupool.devices import ProcessUsage

if TYPE_CHECKING:
    from jupyter_gpupool.backends.local.pool import Pool


class PoolLoading:
    """The pool's state as a decision or a view reads it, and a decision's save; the caches it keeps
    (the derived lease index, parsed reservations, the views' connection) stay the pool's."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def load(self, now: float, store: Store | None = None, processes: list[ProcessUsage] | None = None) -> PoolState:
        """The state a decision works on; or, read through the views' ``store``, a view.
        ``processes``: the driver's per-process use, when already read (before the write lock)."""
        store = store or self.pool.store
        viewing = store is not self.pool.store
        leases = store.live_leases()
        # Kept up to date with this pool's own decisions; other processes' at most every
        # history_cache_seconds (a view's, whenever the file changed: it never decides).
        stats = store.history(now, self.pool.policy.fair_share_half_life, 0.0 if viewing else self.pool.history_cache_seconds)
        parsed = self.pool._parsed_reservations
        if parsed is None or parsed[0] is not stats["reservations"]:
            parsed = self.pool._parsed_reservations = (stats["reservations"], [parse_reservation(r) for r in stats["reservations"]])
        generation = store.cache_generation
        index = self.pool._view_index if viewing else self.pool._index
        if index is None or index[0] != generation:
            # The leases are other objects than last time: derive again (O(leases), then O(changes)).
            index = (generation, LeaseIndex(leases.values()))
            if viewing:
                self.pool._view_index = index
            else:
                self.pool._index = index
        if processes is None and self.pool.read_driver_first:
            processes = self.pool._read_first
        driver = None if viewing else self.holdings_reader(leases, processes)
        return PoolState(
            devices=self.pool._cached_devices(),
            leases=leases,
            usage=stats["usage"],
            typical_hold=stats["typical_hold"],
            reservations=self.pool.policy.parsed_reservations() + list(parsed[1]),
            recent_requests=stats["recent"],
            now=now,
            index=index[1],
            host_memory=self.host_memory(),
            unpooled=self.unpooled_by_device(self.still_held(store.unpooled(now), leases, driver, settle=not viewing)),
            driver=driver,
        )

    def holdings_reader(self, leases: Mapping[str, Lease], processes: list[ProcessUsage] | None = None) -> DriverReading | None:
        """What :attr:`PoolState.driver` reads: the driver at most once per decision (``processes``
        when already read), where the backend lists processes (NVML, simulated; not Slurm)."""
        if not self.pool._sees_processes():
            return None
        return DriverReading(self.pool.backend.process_usage, processes, self.pool._owners_seen,
                             ended=ended_in(self.pool.store)).bind(leases)

    def write_released_holdings(self, state: PoolState, now: float) -> None:
        """Write down what released leases' processes still held (and what suspended or moved
        ones' still hold where their report freed a GPU), as unpooled use on this host: held, not
        granted, until the driver shows it free."""
        for lease, held in state.released_holdings:
            released = lease.state is LeaseState.RELEASED
            why = self.pool.RELEASED_BUT_HELD if released else self.pool.PARKED_BUT_HELD
            for reporter, rows in held_rows(lease, held, why, HOSTNAME, now, now + self.pool.released_hold_ttl, released):
                self.pool.store.replace_unpooled(reporter, rows, now)
        state.released_holdings.clear()

    def still_held(self, rows: list[dict[str, Any]], leases: Mapping[str, Lease] | None = None,
                    driver: DriverReading | None = None, settle: bool = False) -> list[dict[str, Any]]:
        """Unpooled rows less memory held but not granted that its process let go of (see
        :func:`~jupyter_gpupool.backends.local.driver.still_held`). ``settle``: the next save writes
        that down (see :meth:`_save`), so memory once shown free is never taken again by these rows."""
        kept, changed = still_held(rows, (self.pool.RELEASED_BUT_HELD, self.pool.PARKED_BUT_HELD), self.pool.PARKED_BUT_HELD,
                                   HOSTNAME, leases or {}, driver.processes if driver is not None else None,
                                   driver.lease_of if driver is not None else None)
        if settle:
            self.pool._settle = changed
        return kept

    def unpooled_by_device(self, rows: list[dict[str, Any]]) -> dict[str, int]:
        """Bytes of unpooled use per device uuid, each device's at most its memory."""
        totals: dict[str, int] = {}
        for row in rows:
            totals[row["device"]] = totals.get(row["device"], 0) + max(0, int(row["bytes"]))
        capacity = {d.uuid: d.memory_total for d in self.pool._cached_devices()}
        return {uuid: min(total, capacity.get(uuid, total)) for uuid, total in totals.items() if total}

    @contextmanager
    def viewing(self, now: float) -> Iterator[tuple[PoolState, Store]]:
        """The state a view (status, queue, a queued kernel's place) reads, without the write
        lock, and the store it was read from (for more reads in the same transaction).

        Views read in a read transaction, which in WAL mode never waits for a writer; when this
        process's connection is busy with a decision, through a second connection to the pool
        file. So a decision stuck behind another process's write lock (a CLI stopped with Ctrl-Z
        mid-decision, a frozen kernel) leaves every sidebar and status view answering. An
        in-memory pool has one connection: its views wait for its decisions.
        """
        self.pool.devices()
        reader = self.reader()
        # The writer's connection, whose lease cache is up to date with this process's decisions,
        # unless a decision holds it now (it may be waiting for the write lock): then the reader's,
        # which reads every live lease again whenever the file changed.
        if reader is None or self.pool.store.lock.acquire(blocking=False):
            try:
                with self.pool.store.read_transaction():
                    yield self.load(now), self.pool.store
            finally:
                if reader is not None:
                    self.pool.store.lock.release()
            return
        with reader.read_transaction():
            yield self.load(now, reader), reader

    def reader(self) -> Store | None:
        """The views' connection to the pool file, opened on first use (None for ``:memory:``)."""
        if self.pool._view_store is not None or self.pool.store.path == ":memory:":
            return self.pool._view_store
        with self.pool._view_store_lock:
            if self.pool._view_store is None:
                self.pool._view_store = Store(self.pool.store.path, timeout=self.pool.store.timeout, reader_of=self.pool.store)
            return self.pool._view_store

    def host_memory(self) -> int | None:
        """This host's RAM; a simulated pool stands for a GPU server, whose RAM is taken to be twice
        its GPUs' memory (the usual build), so its parked-slice budget is that of such a server."""
        if getattr(self.pool.backend, "name", "") == "simulated":
            if self.pool._simulated_host_memory is None:
                self.pool._simulated_host_memory = 2 * sum(d.memory_total for d in self.pool._cached_devices())
            return self.pool._simulated_host_memory
        return host_memory()

    def save(self, state: PoolState, decisions: list[Decision] | None = None) -> None:
        for reporter, rows in self.pool._settle.items():  # held memory its load found let go of (see _still_held)
            self.pool.store.replace_unpooled(reporter, rows, state.now)
        self.pool._settle = {}
        if state.released_holdings:
            self.write_released_holdings(state, state.now)
        changed = [state.leases[i] for i in state.changed if i in state.leases]
        beats = [state.leases[i] for i in state.beats if i not in state.changed and i in state.leases]
        self.pool.store.save_leases(changed, beats)
        if state.released or state.closed_intervals:
            known = {d.uuid: d for d in state.devices}
            for lease in (*state.released, *state.closed_intervals):
                # What each GPU was, for GPU-hours and prices after it leaves (a GPU already gone is left out).
                info = [DeviceInfo.of(known[u]).to_json() for u in lease.devices if u in known]
                self.pool.store.record_interval(lease, self.pool.policy.fair_share_half_life, info)
        if decisions:
            self.pool.store.record_decisions(decisions)

    def unpooled_rows(self, state: PoolState, store: Store, now: float) -> list[dict[str, Any]]:
        """The unpooled rows a view of ``state`` (read through ``store``) shows."""
        return self.still_held(store.unpooled(now), state.leases, state.driver if isinstance(state.driver, DriverReading) else None)


@functools.lru_cache(maxsize=1)
def host_memory() -> int | None:
    """Bytes of RAM on this host (the parked-slice budget is a share of it), None if unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None
