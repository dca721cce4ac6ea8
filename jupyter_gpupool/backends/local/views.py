"""The local pool's views: the snapshot (devices, leases, queue, quota, unpooled use), a queued
kernel's place, lease views as another user may see them, and the metering reports."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.local.store import Store
from jupyter_gpupool.core.engine import PoolState, held_by_device
from jupyter_gpupool.core.metering import PERIODS, REPORT_KEYS, DeviceInfo, Interval, check_choice, report_rows
from jupyter_gpupool.core.models import (
    Lease,
    LeaseState,
    PoolSnapshot,
    QueueInfo,
)
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.rest import anonymous

if TYPE_CHECKING:
    from jupyter_gpupool.backends.local.pool import Pool


class PoolViews:
    """What the REST API, the sidebar and ``jupyter gpupool report`` show of a local pool."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def live_leases_of(self, owners: Iterable[str]) -> dict[str, list[Lease]]:
        """Each of ``owners``' live leases (copies; as :meth:`leases` lists them, in no order), from
        the lease cache: nothing is read from the file unless another connection wrote to it since.
        Many owners at once cost one pass over the live leases, not a query and a parse each."""
        wanted = set(owners)
        found: dict[str, list[Lease]] = {owner: [] for owner in wanted}
        reader = self.pool.loading.reader()
        # As a view: this process's connection when no decision holds it, else the second one.
        store = self.pool.store if reader is None or self.pool.store.lock.acquire(blocking=False) else reader
        try:
            with store.read_transaction():
                for lease in store.live_leases().values():
                    if lease.owner in wanted:
                        found[lease.owner].append(lease.copy())
        finally:
            if store is self.pool.store and reader is not None:
                self.pool.store.lock.release()
        return found

    def queue(self, now: float | None = None) -> list[Lease]:
        now = self.pool._now(now)
        with self.pool._viewing(now) as (state, _):
            return [lease.copy() for lease in self.pool.engine.queue_order(state, now)]

    def queue_info(self, lease_id: str, now: float | None = None) -> QueueInfo | None:
        now = self.pool._now(now)
        with self.pool._viewing(now) as (state, _):
            if lease_id in state.leases:
                return self.pool.engine.queue_info(state, lease_id, now)
        self.pool.get(lease_id)  # 404 for unknown ids
        return None

    def grow_place(self, lease_id: str, now: float | None = None) -> int | None:
        """1-based place in line of a kernel waiting for its slice to grow; None when it does not wait."""
        now = self.pool._now(now)
        with self.pool._viewing(now) as (state, _):
            if lease_id in state.leases:
                return self.pool.engine.grow_place(state, lease_id, now)
        self.pool.get(lease_id)  # 404 for unknown ids
        return None

    def unpooled(self, now: float | None = None) -> list[dict[str, Any]]:
        """Unexpired unpooled use on this pool's hosts, one row per (host, GPU, pid)."""
        now = self.pool._now(now)
        with self.pool._viewing(now) as (state, store):
            return self.pool.loading.unpooled_rows(state, store, now)

    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """Devices, leases and queue as ``viewer`` may see them (others anonymous unless admin)."""
        now = self.pool._now(now)
        with self.pool._viewing(now) as (state, store):
            order = self.pool.engine.queue_order(state, now)
            month_start = dt.datetime.fromtimestamp(now).replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
            used_gib_hours = self._gib_hours(viewer, month_start, now, state, store) if viewer else 0.0
            # The leases are the store's cached objects, changed in place by decisions of other
            # threads once the lock is released: build the view from copies taken under it.
            live = {lease_id: lease.copy() for lease_id, lease in state.leases.items()}
            order = [live[lease.id] for lease in order]
            held_bytes, count = self.pool.engine.holdings(state, owner=viewer) if viewer else (0, 0)
            outside = self.pool.loading.unpooled_rows(state, store, now)
            unpooled_by_device = dict(state.unpooled)
        held = held_by_device(live.values())
        used_by_device: dict[str, int] = {}
        for lease in live.values():
            if lease.state is LeaseState.GRANTED and lease.used_memory and lease.devices:
                share = lease.used_memory // len(lease.devices)
                for uuid_ in lease.devices:
                    used_by_device[uuid_] = used_by_device.get(uuid_, 0) + share
        devices = []
        for d in state.devices:
            measured = d.memory_total - d.memory_free if d.memory_free is not None else None
            devices.append(
                {
                    "index": d.index,
                    "uuid": d.uuid,
                    "name": d.name,
                    "model": d.model,
                    "memory_total": d.memory_total,
                    "memory_leasable": d.leasable,
                    "memory_leased": held.get(d.uuid, 0),
                    "memory_used": max(measured or 0, used_by_device.get(d.uuid, 0) + unpooled_by_device.get(d.uuid, 0)),
                    "memory_unpooled": unpooled_by_device.get(d.uuid, 0),
                    "healthy": d.healthy,
                    "health_reason": d.health_reason,
                    "is_mig": d.is_mig,
                }
            )
        positions = {lease.id: i + 1 for i, lease in enumerate(order)}
        leases = [self.view_lease(lease, viewer, admin, positions.get(lease.id)) for lease in live.values()]
        leases.sort(key=lambda item: (item["state"] != "granted", item.get("queue_position") or 0))
        queue = [self.view_lease(lease, viewer, admin, positions[lease.id]) for lease in order]
        quota: dict[str, Any] = {}
        if viewer:
            own = self.pool.policy.quota_for_user(viewer)
            quota = {**own.to_json(), "held": held_bytes, "leases": count, "gib_hours_this_month": round(used_gib_hours, 3)}
        reservations = [{**r.to_json(), "active": r.active(now)} for r in state.reservations]
        unpooled = [self.view_unpooled(row, viewer, admin) for row in outside]
        return PoolSnapshot(devices=devices, leases=leases, queue=queue, now=now, quota=quota, reservations=reservations,
                            unpooled=unpooled)

    @staticmethod
    def view_unpooled(row: dict[str, Any], viewer: str | None, admin: bool) -> dict[str, Any]:
        """Unpooled use as ``viewer`` may see it: that memory is taken, and whose only for admins
        and for the viewer's own processes."""
        mine = viewer is not None and row.get("user") == viewer
        keys = ("device", "bytes", "why", "since")
        item = {key: row[key] for key in keys}
        for key in ("pid", "user", "command", "host", "lease_id"):
            item[key] = row.get(key) if admin or mine else None
        item["stoppable"] = bool(row.get("stoppable"))
        item["mine"] = mine
        return item

    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        """A lease as JSON for ``viewer``: another user's through an allow-list of fields (see
        :func:`jupyter_gpupool.rest.anonymous.view_lease`)."""
        return anonymous.view_lease(lease, viewer, admin, position)

    def _gib_hours(self, owner: str, since: float, now: float, state: PoolState, store: Store) -> float:
        """``owner``'s GiB·hours held since ``since``: the ledger's closed intervals and the open
        ones of ``state``, read in the same transaction of ``store`` (as :meth:`_viewing` hands them)."""
        rows = self._report_rows(store.ledger(since, now), state.leases.values(), since, now, "user", "none", now)
        return next((row["gib_hours_held"] for row in rows if row["user"] == owner), 0.0)

    def report(
        self,
        since: float | None = None,
        until: float | None = None,
        by: str = "user",
        now: float | None = None,
        period: str = "none",
    ) -> list[dict[str, Any]]:
        """GPU-hours, GiB·hours held and active (and cost, with prices in the policy) per user,
        group or kernel, per ``period`` (none, day, week, month), closed and still-open intervals;
        see :mod:`jupyter_gpupool.core.metering`."""
        check_choice(by, REPORT_KEYS, "by")
        check_choice(period, PERIODS, "period")
        now = self.pool._now(now)
        until = now if until is None else until
        store = self.pool._reads()
        return self._report_rows(store.ledger(since, until), store.leases(), since, until, by, period, now)

    def _report_rows(
        self, rows: list[dict[str, Any]], leases: Iterable[Lease], since: float | None, until: float, by: str, period: str, now: float
    ) -> list[dict[str, Any]]:
        """:meth:`report` of ledger ``rows`` and the open intervals of the granted ones of ``leases``."""
        live = [lease for lease in leases if lease.state is LeaseState.GRANTED and lease.granted_at is not None]
        # Rows record their GPUs; older rows and open intervals take them from the inventory.
        unrecorded = any(row.get("device_info") is None for row in rows)
        inventory = self._inventory() if live or unrecorded else {}
        intervals = [self._closed_interval(row, inventory) for row in rows]
        for lease in live:
            intervals.append(
                Interval(
                    lease_id=lease.id,
                    owner=lease.owner,
                    groups=tuple(lease.groups),
                    kernel_id=lease.kernel_id,
                    memory=lease.memory * lease.num_gpus,
                    start=lease.granted_at,  # type: ignore[arg-type]
                    end=now,
                    active_seconds=lease.active_seconds,
                    devices=tuple(inventory.get(u) for u in lease.devices),
                    memory_history=tuple((at, memory * lease.num_gpus) for at, memory in lease.memory_history),
                    guarantee=lease.guarantee_size * lease.num_gpus,
                )
            )
        return report_rows(intervals, by=by, period=period, since=since, until=until, prices=self.pool.policy.prices())

    @staticmethod
    def _closed_interval(row: dict[str, Any], inventory: dict[str, DeviceInfo]) -> Interval:
        recorded = {d["uuid"]: DeviceInfo.from_json(d) for d in row.get("device_info") or ()}
        return Interval(
            lease_id=row["lease_id"],
            owner=row["owner"],
            groups=tuple(row["groups"]),
            kernel_id=row["kernel_id"],
            memory=int(row["memory"]),
            start=float(row["start"]),
            end=float(row["end"]),
            active_seconds=float(row["active_seconds"]),
            devices=tuple(recorded.get(u) or inventory.get(u) for u in row["devices"]),
            memory_history=tuple(row.get("memory_history") or ()),
            guarantee=int(row["guarantee"]) if row.get("guarantee") is not None else None,
        )

    def _inventory(self) -> dict[str, DeviceInfo]:
        """The devices as metering needs them; empty when the backend cannot say (a report of the
        ledger never fails on a missing driver)."""
        try:
            return {d.uuid: DeviceInfo.of(d) for d in self.pool.devices()}
        except GpuPoolError:
            return {}
