"""The transition driver of the ``gpupool`` server extension: suspend, resume and move kernels.

Carries out what the pool decided for this server's kernels (a suspend to host RAM, a restore, a move
onto another GPU, a warning, a reclaim), confirms each step to the pool, and moves a running
kernel's framework caps when its elastic slice grows or shrinks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.broker_devices import BrokerGpus
from jupyter_gpupool.backends.contract import Capability, supports
from jupyter_gpupool.core.elastic import size_generation
from jupyter_gpupool.core.models import Activity, Lease, LeaseState, Transition
from jupyter_gpupool.devices.checkpoint import CheckpointError, checkpointer_for
from jupyter_gpupool.devices.checkpoint_worker import WorkerCheckpointer
from jupyter_gpupool.devices.parking import (
    DriverCheckpointPath,
    FrameworkPath,
    Parked,
    ParkingKernel,
    ParkingPath,
    park_kernel,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner, device_control_runs
from jupyter_gpupool.quiet import quiet_request
from jupyter_gpupool.units import format_size

if TYPE_CHECKING:
    from jupyter_gpupool.serverextension.app import GpuPoolExtension


#: Release reasons (set by the engine) after which the kernel must go: its slice was taken back.
@dataclass(frozen=True)
class CapsMove:
    """Where a running kernel's framework caps go now: ``limit`` bytes per GPU, after freeing its
    frameworks' caches when ``free_cache``."""

    limit: int
    free_cache: bool


def caps_move(lease: Lease, caps_were: int, take_back_followed: float | None) -> CapsMove | None:
    """How a granted kernel's caps follow its slice; None when they stay.

    ``caps_were``: the size this server last moved them to (its guarantee at first);
    ``take_back_followed``: the ``burst_taken_at`` of the last take-back this server told the kernel
    of. The kernel frees its caches whenever its slice goes below what its caps were, and on every
    take-back of its burst it was not told of yet: the kernel may have grown its slice itself (a
    framework's out-of-memory grow) past anything this server sent, and the pool's ``burst_from``
    or its measured use, not the size this server last sent, is what it must come down from."""
    if lease.burst_taken_at is not None and lease.burst_taken_at != take_back_followed:
        return CapsMove(lease.memory, free_cache=True)
    if lease.memory == caps_were:
        return None
    return CapsMove(lease.memory, free_cache=lease.memory < caps_were)


class PoolPinnedBackups:
    """The host's pinned parking pool, booked by the GPU pool (the server's store, or the broker's):
    a lease's ``pinned_backup``, counted against the parked-memory budget where decisions are made."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def reserve(self, lease_id: str, amount: int) -> str:
        try:
            self.pool.reserve_pinned_backup(lease_id, amount)
        except GpuPoolError as refusal:
            return str(refusal)
        return ""

    def release(self, lease_id: str) -> None:
        with contextlib.suppress(GpuPoolError):
            self.pool.reserve_pinned_backup(lease_id, 0)


#: What a suspended kernel may be busy with that needs its GPU memory back: a cell, and a widget's
#: message (its callback runs the user's code). A front end that connects (``kernel_info``,
#: ``comm_info``, a widget manager's ``comm_open``) or asks for completions only looks.
WORK_REQUESTS = ("execute_request", "comm_msg")


def got_work(activity: Activity | None, kernel_extension: bool) -> bool:
    """Whether a suspended kernel got work that needs its GPU, by what it is busy with. A kernel with
    the pool's kernel extension decides for its cells itself (a cell of only ``%gpupool`` lines only
    looks, any other waits for the resume it asks for), so only a widget's message counts here."""
    if activity is None or not activity.busy:
        return False
    if activity.busy_with in ("", "execute_request"):  # a cell, or not known
        return not kernel_extension
    return activity.busy_with in WORK_REQUESTS


class TransitionDriver:
    """Carries out suspends, restores, moves and reclaims of this server's kernels."""

    def __init__(self, ext: GpuPoolExtension) -> None:
        self.ext = ext
        self._acting: set[str] = set()
        self._warned: dict[str, float] = {}
        self._moving: set[str] = set()  # lease ids whose suspend, restore or move this server is carrying out
        #: Steps done here whose confirmation the pool did not get (an outage): confirmed again, never redone.
        self._unconfirmed: dict[str, tuple[Transition, int | None]] = {}
        self._checkpointer: Any = None
        #: Lease id → what freeing the kernel's caches before its last park found (see _free_caches).
        self._parking: dict[str, dict[str, Any]] = {}
        self._no_quiet_answer: set[str] = set()  # kernels that never answered a quiet request: not asked again
        self._act_lock = asyncio.Lock()
        #: Lease id → the ``burst_taken_at`` of the last take-back its kernel was told of.
        self._take_backs_followed: dict[str, float] = {}
        #: Lease id → the newest :func:`size_generation` its caps followed (older reads are stale).
        self._sizes_followed: dict[str, tuple[float, int, float, int]] = {}
        #: Lease id → the lock that sends its caps moves one at a time.
        self._caps_locks: dict[str, asyncio.Lock] = {}

    async def act_on_changes(self) -> None:
        """Carry out at once what the pool now says about our kernels (a suspend, restore or move,
        a warning, a reclaim), whoever decided it: called whenever the pool changed."""
        leases = await asyncio.to_thread(self.ext.kernel_hooks.kernel_leases)
        self.follow_sizes(leases)
        await self.act_on(leases, {})
        self.ext.change_count += 1

    async def act_on(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]], activities: dict[str, Activity]) -> None:
        """Act on our kernels' leases as read; one caller at a time (the tick and the change follower)."""
        async with self._act_lock:
            await self._act_on_leases(leases, activities)

    async def _act_on_leases(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]], activities: dict[str, Activity]) -> None:
        # State, not decisions: another process sharing the pool file (nbconvert waiting for a
        # grant) may be the one whose scheduler run warned or reclaimed one of our kernels.
        for kernel_id, (prov, lease) in leases.items():
            if lease.state in (LeaseState.GRANTED, LeaseState.SUSPENDED) and lease.reclaim_at is not None:
                if self._warned.get(lease.id) != lease.reclaim_at:
                    self._warned[lease.id] = lease.reclaim_at
                    self.ext.emit("warned", lease, message=lease.reclaim_reason, deadline=lease.reclaim_at)
            elif (
                lease.taken_back
                # "failed": a restart that could not learn in time that the slice was taken back.
                and (prov.phase in ("running", "failed") or bool(prov.slice_ended))
                and kernel_id not in self._acting
                and kernel_id not in self.ext._culled
            ):
                self._warned.pop(lease.id, None)
                action = "preempted" if lease.release_reason.startswith("preempted") else "reclaimed"
                if lease.release_reason.startswith("stopped"):
                    action = "stopped"
                self.ext.emit(action, lease, message=lease.release_reason)
                await self.reclaim_kernel(kernel_id, lease)
            elif lease.transition is not Transition.NONE and lease.id not in self._moving and prov.phase == "running":
                self._moving.add(lease.id)
                self._spawn(self._carry_out_transition(kernel_id, prov, lease))
            elif lease.state is LeaseState.SUSPENDED and got_work(activities.get(lease.id), prov.kernel_extension):
                resumed = await asyncio.to_thread(self.ext.pool.resume, lease.id)
                self.ext.emit("resuming", resumed, message="resuming: the kernel got work")

    @property
    def checkpointer(self) -> Any:
        """This host's way to park and restore a kernel's GPU memory (see devices/checkpoint.py).

        The server checkpoints its own kernels, whoever keeps the books: with a broker, the kind of
        GPUs is the broker's (NVML: this host's driver; simulated: files beside the server). Where
        the broker's device control denies this server every GPU node, each driver call runs in a
        worker the broker places in the kernel's own GPU access (devices/checkpoint_worker.py)."""
        if self._checkpointer is None:
            backend = self.ext.pool.backend
            if getattr(backend, "name", "") == "remote":
                backend = self._local_backend_like(backend)
            checkpointer = checkpointer_for(backend)
            if checkpointer.name in ("cuda", "simulated") and device_control_runs(self.ext.pool):
                checkpointer = WorkerCheckpointer(checkpointer, self.ext.log)
            self._checkpointer = checkpointer
        return self._checkpointer

    def _local_backend_like(self, remote: Any) -> Any:
        """A device backend of this host of the broker's kind, for checkpoints only. NVML: the
        broker's GPUs and driver versions, read through the broker (device control denies this
        process every GPU node, so NVML here would see none of them)."""
        kind = str(self.ext.pool.info().get("backend", {}).get("name", "")) if hasattr(self.ext.pool, "info") else ""
        if kind == "nvml":
            return BrokerGpus(self.ext.pool)
        if kind == "simulated":
            local = SimulatedBackend.from_spec(getattr(remote, "spec", "") or "1x16GiB")
            runtime = getattr(self.ext.serverapp, "runtime_dir", None) or os.getcwd()
            local.usage_dir = os.path.join(runtime, "gpupool-usage")
            return local
        return remote

    def can_suspend(self) -> bool:
        """Whether kernels started now may be suspended instead of culled (told to the pool per lease)."""
        if self.ext.reclaim_action != "suspend" or self.ext._pool is None:
            return False
        try:
            return bool(self.checkpointer.probe().supported)
        except Exception as err:  # noqa: BLE001 - a probe that breaks means: cull, as before
            self.ext.log.warning("gpupool: checkpoint support could not be probed: %s", err)
            return False

    def _spawn(self, coroutine: Any) -> None:
        """Run a suspend, restore or move beside the tick (each takes seconds); stopped with the server."""
        task = asyncio.ensure_future(coroutine)
        self.ext._transition_tasks.add(task)
        task.add_done_callback(self.ext._transition_tasks.discard)

    async def _carry_out_transition(self, kernel_id: str, prov: GpuPoolProvisioner, lease: Lease) -> None:
        """Do what the engine decided for this kernel's GPU memory, then confirm (or report the failure)."""
        process = getattr(prov, "process", None)
        pid = getattr(process, "pid", None)
        step = lease.transition
        try:
            if not await self._still_due(lease):
                return
            pending = self._unconfirmed.get(lease.id)
            if pending is not None and pending[0] is step:  # done already: only the pool's answer was lost
                done = await asyncio.to_thread(self.ext.pool.confirm_transition, lease.id, pending[1])
                self._unconfirmed.pop(lease.id, None)
                if step is Transition.RESTORING:
                    self._observe_restore(lease)
                self.ext.emit({Transition.SUSPENDING: "suspended", Transition.MIGRATING: "migrated"}.get(step, "resumed"), done)
                return
            if pid is None:
                raise CheckpointError("the kernel has no process on this host")
            if step is Transition.SUSPENDING:
                await self._suspend(kernel_id, lease, pid)
            elif step is Transition.RESTORING:
                await self._restore(kernel_id, lease, pid, dict(zip(lease.home_devices, lease.devices)))
            elif step is Transition.MIGRATING:
                await self._move(kernel_id, lease, pid)
        except CheckpointError as err:
            self.ext.log.warning("gpupool: %s of kernel %s failed: %s", step.value, kernel_id, err)
        except GpuPoolError as err:  # the pool could not be told: the engine's timeout settles it
            self.ext.log.warning("gpupool: %s of kernel %s could not be confirmed: %s", step.value, kernel_id, err)
        except Exception:
            self.ext.log.exception("gpupool: %s of kernel %s failed", step.value, kernel_id)
        finally:
            self._moving.discard(lease.id)

    async def _still_due(self, lease: Lease) -> bool:
        """Whether the pool still asks for ``lease``'s step. The leases acted on were read before
        the act lock was taken (by the tick, or the change follower): a read from before an
        earlier task of ours confirmed the same step would do it twice (a second suspend of a
        kernel already parked fails, and its failure, reported against the restore its next
        cell asked for meanwhile, would shut the kernel down)."""
        now = await asyncio.to_thread(self.ext.pool.get, lease.id)
        return now.transition is lease.transition and now.transition_at == lease.transition_at

    async def _suspend(self, kernel_id: str, lease: Lease, pid: int) -> None:
        refusal = self.checkpointer.supports_devices([d for d in self.ext.pool.devices() if d.uuid in lease.devices])
        try:
            if refusal:
                raise CheckpointError(refusal)
            freed = await self._free_caches(kernel_id, lease)
            parked = (await self._park(kernel_id, lease, pid)).parked
        except CheckpointError as err:
            running = getattr(err, "state", "running") in ("running", "")  # a failed checkpoint is undone where it can be
            after = await asyncio.to_thread(self.ext.pool.fail_transition, lease.id, str(err), running)
            what = "the kernel was shut down instead" if after.state is LeaseState.RELEASED else "the kernel keeps running"
            self.ext.emit("suspend_failed", after, message=f"suspending failed: {err}; {what}")
            raise
        done = await self._confirm(lease, parked)
        first = f"; {format_size(freed)} of framework cache freed first" if freed else ""
        by = self._parking.get(lease.id, {}).get("path") or "driver checkpoint"
        note = self._parking.get(lease.id, {}).get("path_note")
        first += f"; {note}" if note else ""  # why a faster path was not used
        self.ext.log.info("gpupool: kernel %s suspended (%s parked by %s%s): %s", kernel_id, format_size(parked), by, first, lease.suspend_reason)
        self.ext.emit("suspended", done, message=f"suspended ({format_size(parked)} parked in host RAM by {by}{first}): {lease.suspend_reason}")

    def _parking_paths(self) -> list[ParkingPath]:
        """The paths a park tries, fastest first; the driver checkpoint last (the fallback)."""
        driver = DriverCheckpointPath(self.checkpointer)
        if not self.ext.fast_parking:
            return [driver]
        pinned = PoolPinnedBackups(self.ext.pool) if supports(self.ext.pool, Capability.SUSPEND) else None
        probe_timeout = self.ext.free_caches_timeout if self.ext.free_caches_timeout > 0 else 5.0
        return [FrameworkPath(driver, pinned, reply_timeout=self.ext.checkpoint_timeout, probe_timeout=probe_timeout), driver]

    def _parking_kernel(self, kernel_id: str, lease: Lease, pid: int) -> ParkingKernel:
        """The kernel as the parking paths see it: its process, and its quiet channel where it answers."""
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager

        async def ask(action: str, timeout: float, **content: Any) -> dict[str, Any] | None:
            return await quiet_request(km.get_kernel(kernel_id), action, timeout, **content)

        reachable = kernel_id not in self._no_quiet_answer  # a kernel that never answered is not asked again
        return ParkingKernel(pid=pid, lease_id=lease.id, ask=ask if reachable else None, lock_timeout=self.ext.checkpoint_timeout)

    async def _park(self, kernel_id: str, lease: Lease, pid: int) -> Parked:
        """Park the kernel through the first path that takes it (see devices/parking.py); remember which."""
        kernel = self._parking_kernel(kernel_id, lease, pid)
        path, parked = await park_kernel(self._parking_paths(), kernel)
        self.ext._parked_by[lease.id] = (path, parked, kernel)
        entry = self._parking.setdefault(lease.id, {"used_before": lease.used_memory, "cache_freed": None})
        entry.update(path=parked.path, path_note=parked.note or None)
        return parked

    async def _unpark(self, kernel_id: str, lease: Lease, pid: int, moved: dict[str, str] | None) -> None:
        """Bring back what :meth:`_park` parked, by the path that parked it. A kernel this server does
        not know the path of (it parked it before a restart) is restored by the driver checkpoint,
        then asked to map back any framework memory it released (a no-op where it released none)."""
        by = self.ext._parked_by.get(lease.id)
        if by is None:
            await asyncio.to_thread(self.checkpointer.resume, pid, moved)
            kernel = self._parking_kernel(kernel_id, lease, pid)
            if kernel.ask is not None:
                reply = await kernel.ask("unpark_framework", timeout=max(1.0, self.ext.free_caches_timeout))
                if reply is not None and reply.get("status") != "ok":
                    raise CheckpointError(f"the kernel's CUDA context is back but its PyTorch memory is not ({reply.get('message')}); "
                                          "restart the kernel", state="failed")
            return
        path, parked, kernel = by
        await path.unpark(kernel, parked, moved)
        self.ext._parked_by.pop(lease.id, None)

    async def _restore(self, kernel_id: str, lease: Lease, pid: int, mapping: dict[str, str], action: str = "resumed") -> None:
        moved = {old: new for old, new in mapping.items() if old != new}
        try:
            await self._unpark(kernel_id, lease, pid, moved or None)
        except CheckpointError as err:
            parked = getattr(err, "state", "") == "suspended"  # nothing lost: it may be tried again
            after = await asyncio.to_thread(self.ext.pool.fail_transition, lease.id, str(err), parked)
            if after.state is LeaseState.RELEASED:
                await self._stop_kernel(kernel_id, after)
            else:
                self.ext.emit("suspend_failed", after, message=after.suspend_reason)
            raise
        started = lease.transition_at or time.time()
        done = await self._confirm(lease, None)
        if lease.transition is Transition.RESTORING:
            self._observe_restore(lease)
        where = "onto another GPU of the same model" if moved else "on its GPU"
        self.ext.emit(action, done, message=f"{action} {where} after {time.time() - started:.1f} s")

    async def _free_caches(self, kernel_id: str, lease: Lease) -> int:
        """Ask the kernel to free its frameworks' cached GPU memory before it is parked (the quiet
        channel: its control channel, not a cell, not activity, answered while a cell waits); bytes
        freed (0 when it did not answer within ``free_caches_timeout``: the checkpoint goes ahead)."""
        self._parking[lease.id] = {"used_before": lease.used_memory, "cache_freed": None}
        if self.ext.free_caches_timeout <= 0 or kernel_id in self._no_quiet_answer:
            return 0
        assert self.ext.serverapp is not None
        try:
            kernel = self.ext.serverapp.kernel_manager.get_kernel(kernel_id)
            reply = await quiet_request(kernel, "free_caches", self.ext.free_caches_timeout)
        except Exception as err:  # noqa: BLE001 -- the checkpoint goes ahead, caches and all
            self.ext.log.info("gpupool: kernel %s: could not ask it to free its caches before parking: %s", kernel_id, err)
            return 0
        if reply is None:
            self._no_quiet_answer.add(kernel_id)
            self.ext.log.info("gpupool: kernel %s did not answer a request to free its caches (no gpupool kernel extension?); "
                          "parking its GPU memory as it is", kernel_id)
            return 0
        if reply.get("status") != "ok":
            self.ext.log.info("gpupool: kernel %s could not free its caches: %s", kernel_id, reply.get("message"))
            return 0
        freed = max(0, int(reply.get("freed") or 0))
        self._parking[lease.id] = {"used_before": lease.used_memory, "cache_freed": freed, "held": reply.get("held")}
        return freed

    def parking_of(self, lease: Lease | None) -> dict[str, Any] | None:
        """For a suspended (or resuming) lease: the GPU memory its kernel used before it was parked,
        and how much framework cache was freed first (None where this server did not park it)."""
        if lease is None:
            return None
        parked = lease.state is LeaseState.SUSPENDED or lease.resuming or lease.transition is Transition.RESTORING
        return self._parking.get(lease.id) if parked else None

    def _observe_restore(self, lease: Lease) -> None:
        """Count a confirmed restore in ``gpupool_restore_seconds`` (from the resumed kernel's grant
        to now), on this server's /metrics, as the broker counts those it confirms."""
        collector = type(self.ext)._metrics_collector
        if collector is not None and lease.transition_at is not None:
            collector.observe_restore(max(0.0, time.time() - lease.transition_at))

    async def _confirm(self, lease: Lease, parked: int | None) -> Lease:
        """Tell the pool the step is done; if it cannot be told, remember it (the next tick confirms
        again instead of checkpointing a process that is already parked)."""
        self._unconfirmed[lease.id] = (lease.transition, parked)
        done = await asyncio.to_thread(self.ext.pool.confirm_transition, lease.id, parked)
        self._unconfirmed.pop(lease.id, None)
        return done

    async def _move(self, kernel_id: str, lease: Lease, pid: int) -> None:
        """Live defragmentation: park the kernel's memory, restore it on the GPU the engine chose."""
        self.ext.emit("migrating", lease, message=lease.suspend_reason)
        try:
            await self._free_caches(kernel_id, lease)
            await self._park(kernel_id, lease, pid)
        except CheckpointError as err:
            running = getattr(err, "state", "running") in ("running", "")
            after = await asyncio.to_thread(self.ext.pool.fail_transition, lease.id, str(err), running)
            if after.state is LeaseState.RELEASED:
                await self._stop_kernel(kernel_id, after)
            else:
                self.ext.emit("suspend_failed", after, message=f"moving failed: {err}; the kernel keeps running where it was")
            raise
        await self._restore(kernel_id, lease, pid, dict(zip(lease.migrate_from, lease.devices)), action="migrated")

    async def _stop_kernel(self, kernel_id: str, lease: Lease) -> None:
        """A kernel whose GPU memory could not be restored cannot go on: shut it down, saying why."""
        self.ext._culled[kernel_id] = lease.release_reason
        self.ext.emit("stopped", lease, message=lease.release_reason)
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        with contextlib.suppress(Exception):
            km.get_kernel(kernel_id).reason = f"GPU slice {lease.release_reason}"  # type: ignore[attr-defined]  # ServerKernelManager's
        try:
            await km.shutdown_kernel(kernel_id)
        except Exception:
            self.ext.log.exception("gpupool: could not shut down kernel %s", kernel_id)

    async def reclaim_kernel(self, kernel_id: str, lease: Lease) -> None:
        """Carry out the engine's release of ``kernel_id``'s slice: shut the kernel down. (A reclaim
        that suspends is a transition instead: see :meth:`_carry_out_transition`.)"""
        await self._reclaim_cull(kernel_id, lease)

    async def _reclaim_cull(self, kernel_id: str, lease: Lease) -> None:
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        reason = lease.release_reason or "GPU slice reclaimed"
        self._acting.add(kernel_id)
        self.ext._culled[kernel_id] = reason
        self.ext.log.warning("gpupool: shutting down kernel %s: %s", kernel_id, reason)
        kernel = km.get_kernel(kernel_id)
        with contextlib.suppress(Exception):
            kernel.reason = f"GPU slice {reason}"  # type: ignore[attr-defined]  # ServerKernelManager's
        self.ext.emit("culled", lease, message=f"kernel shut down: its GPU slice was {reason}")
        try:
            await km.shutdown_kernel(kernel_id)
        except Exception:
            self.ext.log.exception("gpupool: could not shut down kernel %s", kernel_id)
        finally:
            self._acting.discard(kernel_id)

    def follow_sizes(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]]) -> None:
        """Move each running kernel's framework caps to its slice's current size when the pool
        grew it or took its burst back (through the quiet channel: no activity), and tell the user.
        Called by the tick, the watchdog and on every change of the pool (a burst taken back must
        not wait for the tick: the kernel has ``burst_settle`` to come down). Each caller read the
        leases a moment before, and another may have followed a newer read since: a lease read
        before the newest size this server followed (:func:`size_generation`) is stale and moves
        nothing (a tick's read from before a take-back would set the caps back up)."""
        newest = self._sizes_followed
        self._sizes_followed = {lease.id: newest[lease.id] for _, lease in leases.values() if lease.id in newest}
        for kernel_id, (prov, lease) in leases.items():
            generation = size_generation(lease)
            if generation < self._sizes_followed.get(lease.id, generation):
                continue
            self._sizes_followed[lease.id] = generation
            if lease.state is not LeaseState.GRANTED or prov.phase != "running" or not prov.pid:
                self.ext._caps_sent.pop(lease.id, None)
                self._take_backs_followed.pop(lease.id, None)
                self._caps_locks.pop(lease.id, None)
                continue
            sent = self.ext._caps_sent.setdefault(lease.id, lease.guarantee_size)  # it started at its guarantee
            move = caps_move(lease, sent, self._take_backs_followed.get(lease.id))
            if move is None:
                continue
            self.ext._caps_sent[lease.id] = lease.memory
            if lease.burst_taken_at is not None:
                self._take_backs_followed[lease.id] = lease.burst_taken_at
            if move.free_cache or lease.burst_note.startswith("burst taken back"):
                self.ext.emit("burst_taken_back", lease, message=lease.burst_note or f"the slice is {format_size(lease.memory)} now")
            else:
                self.ext.emit("grown", lease, message=lease.burst_note or f"the slice grew to {format_size(lease.memory)}")
            self._spawn(self._move_caps(kernel_id, lease, free_cache=move.free_cache))

    async def _move_caps(self, kernel_id: str, lease: Lease, free_cache: bool) -> dict[str, Any] | None:
        """Ask the kernel (a quiet control request: it is answered while a cell runs, and is no
        activity) to free its frameworks' caches if ``free_cache`` and set its caps to the slice."""
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        if kernel_id not in km:
            return None
        # One move at a time per slice, each sending the newest size followed: a grow and the take-back
        # after it, sent at once, could reach the kernel in the other order and leave its caps above its slice.
        async with self._caps_locks.setdefault(lease.id, asyncio.Lock()):
            limit = int(self.ext._caps_sent.get(lease.id, lease.memory))
            devices = await asyncio.to_thread(self.ext.pool.devices)  # a pool read: never on the event loop
            gpu_memory = min((d.memory_total for d in devices if d.uuid in lease.devices), default=None)
            try:
                reply = await quiet_request(
                    km.get_kernel(kernel_id), "set_caps", self.ext.caps_timeout,
                    limit=limit, free_cache=free_cache, gpu_memory=gpu_memory,
                )
                why = "no answer" if reply is None else reply.get("message", "an error")
            except Exception as err:  # noqa: BLE001 - a kernel without the extension, or busy in C code: the watchdog still holds it
                reply, why = None, str(err)
        if reply is None or reply.get("status") != "ok":
            self.ext.log.warning("gpupool: could not move the caps of kernel %s to %s: %s", kernel_id, format_size(limit), why)
        return reply
