"""The loops of the ``gpupool`` server extension: the tick, reconciling, following changes, the watchdog.

Starts, on the running event loop, the periodic steps (activity and the scheduler's tick, reconciling
leases against live kernels, the NVML watchdog) and the follower that acts the moment the pool changed;
a failing step is said once in the log, and an unreachable pool marks the extension unavailable.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.core.models import Activity, Decision, DecisionKind, Lease, LeaseState
from jupyter_gpupool.enforcement.watchdog import Watchdog
from jupyter_gpupool.errors import GpuPoolError, PoolUnavailable
from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner, holder_identity
from jupyter_gpupool.quiet import ActivityClocks, recorded_activity

if TYPE_CHECKING:
    from jupyter_gpupool.serverextension.app import GpuPoolExtension


class WatchLoops:
    """The extension's periodic steps and the follower of the pool's changes."""

    def __init__(self, ext: GpuPoolExtension) -> None:
        self.ext = ext
        self._changed: asyncio.Event | None = None
        self._unsubscribe_changes: Any = None

    def ensure_started(self) -> None:
        """Start the periodic loops once, on the running event loop (the pool's loops once it is open)."""
        loop = asyncio.get_running_loop()
        if not self.ext._tasks:
            self.ext._tasks.append(loop.create_task(self.ext.pool_connection.reopen_until_available()))
        if self.ext._pool is None or len(self.ext._tasks) > 1:
            return
        self.ext._tasks += [
            loop.create_task(self._every(lambda: self.ext.tick_interval, self.tick_once, "tick")),
            loop.create_task(self._every(lambda: self.ext.reconcile_interval, self.reconcile_once, "reconcile")),
            loop.create_task(self._follow_changes()),
        ]
        if self.ext.watchdog_enabled and not getattr(self.ext._pool, "remote", False):
            self.ext.watchdog = Watchdog(backend=self.ext._pool.backend, pool=self.ext._pool, parent=self.ext)
            self.ext._tasks.append(loop.create_task(self._every(lambda: self.ext.watchdog.interval, self.watchdog_once, "watchdog")))

    async def _follow_changes(self) -> None:
        """Act on the pool the moment it changed (see jupyter_gpupool.backends.changes): in this process, in
        another sharing the pool file, or behind the broker. No suspend, restore or move waits for
        ``tick_interval``; the tick remains for activity reports and the scheduler's clock."""
        loop = asyncio.get_running_loop()
        changed = self._changed = asyncio.Event()
        subscribe = getattr(self.ext._pool, "subscribe_changes", None)
        if not callable(subscribe):
            return  # a pool that cannot tell (Slurm): the tick does it
        self._unsubscribe_changes = subscribe(lambda: loop.call_soon_threadsafe(changed.set))
        try:
            while True:
                await changed.wait()
                changed.clear()
                try:
                    await self.ext.transition_driver.act_on_changes()
                except asyncio.CancelledError:
                    raise
                except GpuPoolError as err:  # the tick reports an unavailable pool; once here is enough
                    self.ext.log.debug("gpupool: acting on a change of the pool failed: %s", err)
                except Exception:
                    self.ext.log.exception("gpupool: acting on a change of the pool failed")
                # A burst of commits is one round (behind a broker each round is a few HTTP reads).
                await asyncio.sleep(self.change_debounce * (5 if getattr(self.ext._pool, "remote", False) else 1))
        finally:
            unsubscribe, self._unsubscribe_changes = self._unsubscribe_changes, None
            if unsubscribe is not None:
                with contextlib.suppress(Exception):
                    unsubscribe()

    #: Seconds between two rounds of acting on changes (a burst of commits is read once).
    change_debounce = 0.02

    #: Steps whose failure with PoolUnavailable means the pool is unavailable (shown to users), not just a failed step.
    POOL_STEPS = ("tick", "reconcile")

    async def _every(self, interval: Any, step: Any, name: str) -> None:
        last_problem = ""
        while True:
            try:
                await step()
                if last_problem:
                    self.ext.log.info("gpupool: %s works again", name)
                last_problem = ""
                if name in self.POOL_STEPS and self.ext._failed_call:
                    self.ext.pool_connection.set_available()
            except asyncio.CancelledError:
                raise
            except GpuPoolError as err:  # e.g. the broker is down: one line, once, not a traceback a second
                if name in self.POOL_STEPS and isinstance(err, PoolUnavailable):
                    self.ext._failed_call = True
                    self.ext.pool_connection.set_unavailable(err)
                elif str(err) != last_problem:
                    self.ext.log.warning("gpupool: %s step failed: %s", name, err)
                last_problem = str(err)
            except Exception:
                self.ext.log.exception("gpupool: %s step failed", name)
            await asyncio.sleep(max(0.05, float(interval())))

    async def tick_once(self) -> list[Decision]:
        """Report activity, run the scheduler, carry out reclaims of our kernels."""
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        # jupyter_server's last_activity and execution_state, less the quiet channel (the widget's
        # refreshes and our own requests to a kernel are no activity): see jupyter_gpupool.quiet.
        clocks: ActivityClocks | None = getattr(self.ext, "_activity_clocks", None)
        if clocks is None:
            clocks = self.ext._activity_clocks = ActivityClocks(km)
        activities: dict[str, Activity] = {}
        kernel_ids = list(km.list_kernel_ids())
        clocks.forget_others(kernel_ids)
        for kernel_id in kernel_ids:
            prov = self.ext.provisioner_of(kernel_id)
            if prov is None or not prov.lease_id or prov.phase not in ("running", "launching"):
                continue
            kernel = km.get_kernel(kernel_id)
            clock = clocks.clock(kernel_id)
            last = clock.last_activity if clock is not None else recorded_activity(kernel)
            state = clock.execution_state if clock is not None else getattr(kernel, "execution_state", None)
            connections = 0
            with contextlib.suppress(Exception):
                connections = int(km._kernel_connections.get(kernel_id, 0))
            activities[prov.lease_id] = Activity(
                busy=state == "busy",
                last_activity=last.timestamp() if last is not None else None,
                connections=connections,
                busy_with=clock.busy_with if clock is not None and state == "busy" else "",
            )

        stale = [p for k in km.list_kernel_ids() if (p := self.ext.provisioner_of(k)) is not None and p.stale_lease_id]

        def step() -> tuple[list[Decision], dict[str, tuple[GpuPoolProvisioner, Lease]], list[tuple[GpuPoolProvisioner, Lease]]]:
            decisions = self.ext.pool.tick(activities=activities)
            handed_back = []
            for prov in stale:  # leases held before a CPU-only restart: the pool answers again, hand them back
                lease = prov._release_stale_quietly("its kernel restarted CPU-only while the pool was unavailable")
                if lease is not None:
                    handed_back.append((prov, lease))
            return decisions, self.ext.kernel_hooks.kernel_leases(), handed_back

        decisions, leases, handed_back = await asyncio.to_thread(step)
        self.ext.transition_driver.follow_sizes(leases)
        for prov, lease in handed_back:  # told on the event loop: events need it
            prov._notify("released", lease, None, lease.release_reason)
        await self.ext.transition_driver.act_on(leases, activities)
        self.ext.tick_count += 1
        return decisions

    async def reconcile_once(self) -> list[Lease]:
        """Release leases of kernels that are gone or whose process died."""
        host, pid = holder_identity()
        live = self.ext.kernel_hooks.live_kernel_ids()
        released = await asyncio.to_thread(self.ext.pool.reconcile_kernels, host, pid, live)
        for lease in released:
            self.ext.log.warning("gpupool: kernel %s is gone: released its lease %s", lease.kernel_id, lease.id)
            self.ext.emit("released", lease, message=lease.release_reason or "its kernel is gone")
        self.ext.reconcile_count += 1
        return released

    async def watchdog_once(self) -> None:
        """One watchdog step: usage of our kernels' granted leases against their slices, and every
        GPU process of this host set against every live lease of the pool (unpooled use)."""
        leases = await asyncio.to_thread(self.ext.kernel_hooks.kernel_leases)
        live = await asyncio.to_thread(lambda: {lease.id: lease for lease in self.ext.pool.leases()})
        roots: dict[str, int] = {}
        limits: dict[str, int | None] = {}
        kernel_of: dict[str, str] = {}
        own_pids: dict[int, str] = {}
        by_kernel = {lease.kernel_id: lease for lease in live.values() if lease.kernel_id}
        for kernel_id, (prov, lease) in list(leases.items()):
            lease = by_kernel.get(kernel_id, lease)  # a kernel that released its lease and reserved anew has the new one
            leases[kernel_id] = (prov, lease)
            if prov.pid:
                own_pids[int(prov.pid)] = kernel_id
                roots[lease.id] = int(prov.pid)  # a kernel whose lease is suspended, too: its use is unpooled
                kernel_of[lease.id] = kernel_id
            if lease.state is LeaseState.GRANTED and prov.pid:
                limits[lease.id] = lease.watch_limit()  # an elastic slice's limit, or its size once its burst was taken back
        self.ext.watchdog.act_on_process = lambda use, action: (
            None if use.pid in own_pids else self.ext.watchdog._signal_process(use, action)  # our kernels: below, through the kernel manager
        )
        report = await asyncio.to_thread(self.ext.watchdog.check, roots, limits, None, live, HOSTNAME)
        assert self.ext.serverapp is not None
        km: Any = self.ext.serverapp.kernel_manager  # async at run time, whatever MultiKernelManager's annotations say
        if any(d.kind in (DecisionKind.GROW, DecisionKind.SHRINK) for d in report.decisions):
            grown = {d.lease_id for d in report.decisions}
            fresh = await asyncio.to_thread(lambda: {l.id: l for l in self.ext.pool.leases() if l.id in grown})
            self.ext.transition_driver.follow_sizes({k: (p, fresh.get(l.id, l)) for k, (p, l) in leases.items()})
        for kind, use, action, line in report.unpooled_events:
            own_kernel = own_pids.get(use.pid)
            if own_kernel is not None:
                self.ext.emit(
                    "over_limit" if kind == "warn" else "interrupted" if action == "interrupt" else "stopped",
                    leases[own_kernel][1],
                    message=line,
                )
                if kind == "act" and own_kernel in km:
                    await (km.interrupt_kernel(own_kernel) if action == "interrupt" else km.shutdown_kernel(own_kernel))
            elif kind == "warn":
                self.ext.emit_unpooled(use.bytes, use.device)
        for event in report.events:
            event_kernel = kernel_of.get(event.lease_id)
            if event_kernel is None:
                continue
            lease = leases[event_kernel][1]
            if event.kind == "warn":
                self.ext.emit("over_limit", lease, message=event.message, deadline=event.deadline)
            elif event.kind == "clear":
                self.ext.emit("within_limit", lease, message=event.message)
            elif event.kind == "act":
                self.ext.emit("interrupted" if event.action == "interrupt" else "stopped", lease, message=event.message)
                if event.action == "interrupt":
                    await km.interrupt_kernel(event_kernel)
                elif event.action == "stop":
                    await km.shutdown_kernel(event_kernel)
