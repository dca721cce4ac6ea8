"""Parking paths: the ways a suspended kernel's GPU memory goes to host RAM and comes back.

A suspend parks a kernel through one :class:`ParkingPath` (the declared contract, as
jupyter_client's ``KernelProvisionerBase`` is for starting kernels); :func:`park_kernel` tries
them in order and falls back, so a path that cannot park a kernel, or fails while it tries,
leaves it to the next. Two paths exist:

- :class:`FrameworkPath` (the fast path): the kernel's framework releases the GPU memory it
  manages through CUDA's virtual-memory API into a pinned host backup, and maps it back on resume
  at the same addresses (PyTorch through torch-memory-saver; see
  :mod:`jupyter_gpupool.kernel.parking`, which does the kernel's side). The driver checkpoint
  then parks the rest (the CUDA context, allocations outside the framework), which is small.
  The pinned backups of all kernels of a host come out of one :class:`HostPinnedPool`.
- :class:`DriverCheckpointPath`: the CUDA driver's process checkpoint (:mod:`.checkpoint`) parks
  everything, context included. It is always the last path: the fallback, as before.

The server reaches the kernel only on the quiet channel (``ParkingKernel.ask``): not a cell, not
activity, answered while a cell waits. Paths block nothing: they are ``async`` and run the
driver's blocking calls in a thread.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.devices.checkpoint import Checkpointer, CheckpointError, _file_lock, _read_json, _write_json
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.units import format_size

log = logging.getLogger(__name__)

#: ``ask(action, **content)``: one quiet request to the kernel; its reply, or None without an answer in time.
QuietAsk = Callable[..., Awaitable["dict[str, Any] | None"]]

DRIVER_CHECKPOINT = "driver checkpoint"


@dataclass
class ParkingKernel:
    """The kernel a path parks: its process, its lease, and how to reach it (None: it cannot be)."""

    pid: int
    lease_id: str
    ask: QuietAsk | None
    lock_timeout: float = 30.0  # seconds the driver waits for GPU work in flight


@dataclass
class Parked:
    """What parked a kernel: ``path`` (the path's name), bytes in host RAM, of which ``framework``
    went through the framework's own release, and ``note``: why a faster path was not used."""

    path: str
    parked: int
    framework: int = 0
    note: str = ""


class ParkingRefused(GpuPoolError):
    """This path cannot park this kernel now; nothing was changed, the next path may (one line why)."""


class ParkingPath(abc.ABC):
    """One way to park a kernel's GPU memory in host RAM and bring it back."""

    #: Shown in the sidebar and ``%gpupool status``: "parked by <name>".
    name: ClassVar[str]
    #: What it parks, one line for the docs and logs.
    covers: ClassVar[str]

    @abc.abstractmethod
    async def park(self, kernel: ParkingKernel) -> Parked:
        """Park the kernel's GPU memory. :class:`ParkingRefused`: not done, nothing changed (try
        the next path); :class:`~.checkpoint.CheckpointError`: the suspend failed, with the state
        the process is left in (as the driver checkpoint says it)."""

    @abc.abstractmethod
    async def unpark(self, kernel: ParkingKernel, parked: Parked, gpu_mapping: dict[str, str] | None) -> None:
        """Bring back what :meth:`park` parked (onto other GPUs per ``gpu_mapping``);
        :class:`~.checkpoint.CheckpointError` with the state it is left in."""


class DriverCheckpointPath(ParkingPath):
    """The CUDA driver's process checkpoint (or its simulation): parks the whole process."""

    name = DRIVER_CHECKPOINT
    covers = "everything: the CUDA context and every allocation of the process"

    def __init__(self, checkpointer: Checkpointer) -> None:
        self.checkpointer = checkpointer

    async def park(self, kernel: ParkingKernel) -> Parked:
        parked = await asyncio.to_thread(self.checkpointer.suspend, kernel.pid, kernel.lock_timeout)
        return Parked(self.name, parked)

    async def unpark(self, kernel: ParkingKernel, parked: Parked, gpu_mapping: dict[str, str] | None) -> None:
        await asyncio.to_thread(self.checkpointer.resume, kernel.pid, gpu_mapping)


class FrameworkPath(ParkingPath):
    """The kernel's framework releases its memory into a pinned host backup (addresses kept), then
    the driver checkpoint parks the rest. The kernel said at its start whether it can (its probe,
    asked again here: ``parking_probe``); the backup is reserved in the host's pinned pool first."""

    name = "torch-memory-saver"
    covers = "the PyTorch tensors allocated in the kernel's memory-saver region; the driver checkpoint parks the rest"

    def __init__(self, driver: DriverCheckpointPath, pinned: HostPinnedPool | None, reply_timeout: float = 30.0,
                 probe_timeout: float = 5.0, room: Callable[[ParkingKernel, int], str] | None = None) -> None:
        self.driver = driver
        self.pinned = pinned
        self.reply_timeout = reply_timeout  # a park or unpark copies the tensors: as long as a checkpoint may take
        self.probe_timeout = probe_timeout  # a kernel without the extension never answers: do not wait long
        #: ``room(kernel, bytes)``: ``""`` if the parked-memory budget has room for this backup, else why not.
        self.room = room

    async def _ask(self, kernel: ParkingKernel, action: str, timeout: float | None = None) -> dict[str, Any] | None:
        assert kernel.ask is not None
        return await kernel.ask(action, timeout=self.reply_timeout if timeout is None else timeout)

    async def park(self, kernel: ParkingKernel) -> Parked:
        if kernel.ask is None:
            raise ParkingRefused("the kernel cannot be reached on the quiet channel (no gpupool kernel extension)")
        if self.pinned is None:
            raise ParkingRefused("this host has no pinned parking pool (c.GpuPoolExtension.parking_pool_size is 0)")
        probe = await self._ask(kernel, "parking_probe", self.probe_timeout)
        if probe is None or probe.get("status") != "ok":
            why = (probe or {}).get("message") or "the kernel did not answer its parking probe"
            raise ParkingRefused(str(why))
        saver = str(probe.get("path") or "")
        if not saver:
            raise ParkingRefused(str(probe.get("reason") or "the kernel has no framework path"))
        need = max(0, int(probe.get("bytes") or 0))
        why_not = self.room(kernel, need) if self.room is not None else ""
        if why_not:
            raise ParkingRefused(why_not)
        why_not = await asyncio.to_thread(self.pinned.reserve, kernel.lease_id, kernel.pid, need)
        if why_not:
            raise ParkingRefused(why_not)
        reply = await self._ask(kernel, "park_framework")
        if reply is None or reply.get("status") != "ok":
            await asyncio.to_thread(self.pinned.release, kernel.lease_id)
            undone = await self._ask(kernel, "unpark_framework") if reply is None else reply
            if undone is None or (reply is None and undone.get("status") != "ok") or undone.get("undone") is False:
                raise CheckpointError(
                    f"the kernel's framework could not release its GPU memory and did not say it put it back "
                    f"({(reply or {}).get('message') or 'no answer'}); it keeps running, restart it if its tensors fail",
                    state="running",
                )
            raise ParkingRefused(f"{self.name} failed ({(reply or {}).get('message') or 'no answer'}); its memory was put back")
        framework = max(0, int(reply.get("bytes") or 0))
        try:
            rest = await self.driver.park(kernel)
        except CheckpointError:
            undone = await self._ask(kernel, "unpark_framework")
            if undone is None or undone.get("status") != "ok":
                log.warning("kernel process %s: its framework memory was not put back after a failed checkpoint: %s",
                            kernel.pid, (undone or {}).get("message") or "no answer")
            raise
        return Parked(saver, framework + rest.parked, framework=framework)

    async def unpark(self, kernel: ParkingKernel, parked: Parked, gpu_mapping: dict[str, str] | None) -> None:
        await self.driver.unpark(kernel, parked, gpu_mapping)  # the context first: the framework maps into it
        if kernel.ask is None:
            raise CheckpointError("cannot bring the kernel's PyTorch memory back: it cannot be reached", state="failed")
        reply = await self._ask(kernel, "unpark_framework")
        if reply is None or reply.get("status") != "ok":
            raise CheckpointError(
                f"the kernel's CUDA context is back but {self.name} could not bring its tensors back "
                f"({(reply or {}).get('message') or 'no answer'}); restart the kernel",
                state="failed",
            )


async def park_kernel(paths: Sequence[ParkingPath], kernel: ParkingKernel) -> tuple[ParkingPath, Parked]:
    """Park through the first path that takes the kernel; a path that refuses, or fails having put
    everything back (:class:`ParkingRefused`), leaves it to the next, and the note says why. A
    :class:`~.checkpoint.CheckpointError` ends the suspend (the last path's failure, as before)."""
    notes: list[str] = []
    for number, path in enumerate(paths):
        try:
            parked = await path.park(kernel)
        except ParkingRefused as refusal:
            if number == len(paths) - 1:
                raise CheckpointError(f"no way to park this kernel: {refusal}", state="running") from None
            log.info("kernel process %s: not parked by %s: %s", kernel.pid, path.name, refusal)
            notes.append(f"{path.name} not used: {refusal}")
            continue
        parked.note = "; ".join(notes)
        return path, parked
    raise CheckpointError("no way to park this kernel is configured", state="running")


class HostPinnedPool:
    """The host's one pool of pinned memory for parking: every kernel's framework backup is
    reserved here (a ledger file shared by every server of the host, locked per change), never
    an arena per kernel. A kernel keeps its pinned backup between suspends (so the next park copies
    at once), until its process ends; reservations of dead processes are dropped when read."""

    def __init__(self, path: str, capacity: int) -> None:
        self.path = path
        self.capacity = capacity

    def _read(self) -> dict[str, dict[str, int]]:
        data = _read_json(self.path) or {}
        return {
            lease: {"pid": int(entry["pid"]), "bytes": int(entry["bytes"])}
            for lease, entry in data.items()
            if isinstance(entry, dict) and isinstance(entry.get("pid"), int) and isinstance(entry.get("bytes"), int)
            and process_alive(int(entry["pid"]))
        }

    def reservations(self) -> dict[str, dict[str, int]]:
        """Lease id → ``{"pid", "bytes"}`` of live processes."""
        return self._read()

    def kept(self) -> dict[str, int]:
        """Lease id → bytes set aside for its backup, of live processes."""
        return {lease: entry["bytes"] for lease, entry in self._read().items()}

    def used(self) -> int:
        return sum(entry["bytes"] for entry in self._read().values())

    def reserve(self, lease_id: str, pid: int, amount: int) -> str:
        """Set aside ``amount`` bytes for ``lease_id``'s backup (a repeat keeps or grows its own);
        ``""`` when done, else one line why not (nothing changed)."""
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with _file_lock(f"{self.path}.lock", 10.0) as locked:
            if not locked:
                return "the host's pinned parking pool stayed locked for 10 s"
            entries = self._read()
            others = sum(e["bytes"] for lease, e in entries.items() if lease != lease_id)
            if others + amount > self.capacity:
                return (
                    f"the host's pinned parking pool has {format_size(max(0, self.capacity - others))} free of "
                    f"{format_size(self.capacity)}, and this kernel's backup needs {format_size(amount)}"
                )
            entries[lease_id] = {"pid": pid, "bytes": amount}
            _write_json(self.path, entries)
        return ""

    def release(self, lease_id: str) -> None:
        """Give a lease's reservation back (its kernel ended, or dropped its backup)."""
        with contextlib.suppress(OSError), _file_lock(f"{self.path}.lock", 10.0) as locked:
            if locked:
                entries = self._read()
                if entries.pop(lease_id, None) is not None:
                    _write_json(self.path, entries)


__all__ = [
    "DRIVER_CHECKPOINT",
    "DriverCheckpointPath",
    "FrameworkPath",
    "HostPinnedPool",
    "Parked",
    "ParkingKernel",
    "ParkingPath",
    "ParkingRefused",
    "park_kernel",
]
