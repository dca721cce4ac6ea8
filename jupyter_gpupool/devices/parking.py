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
  The pinned backups of all kernels of a host come out of one pool, booked by the GPU pool
  itself (:class:`PinnedBackups`: a lease's ``pinned_backup``), never by a file a user may write.
- :class:`DriverCheckpointPath`: the CUDA driver's process checkpoint (:mod:`.checkpoint`) parks
  everything, context included. It is always the last path: the fallback, as before.

The server reaches the kernel only on the quiet channel (``ParkingKernel.ask``): not a cell, not
activity, answered while a cell waits. Paths block nothing: they are ``async`` and run the
driver's blocking calls in a thread.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from jupyter_gpupool.devices.checkpoint import Checkpointer, CheckpointError
from jupyter_gpupool.errors import GpuPoolError

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


class PinnedBackups(Protocol):
    """The books of the host's pinned parking pool: kept by the GPU pool (its store, or the
    broker's), which also counts every backup against the parked-memory budget."""

    def reserve(self, lease_id: str, amount: int) -> str:
        """Set aside ``amount`` bytes for the lease's backup (a repeat sets its own figure); ``""``
        when done, else one line why not (nothing changed)."""
        ...

    def release(self, lease_id: str) -> None:
        """Give the lease's reservation back (its kernel dropped its backup)."""
        ...


class FrameworkPath(ParkingPath):
    """The kernel's framework releases its memory into a pinned host backup (addresses kept), then
    the driver checkpoint parks the rest. The kernel said at its start whether it can (its probe,
    asked again here: ``parking_probe``); the backup is reserved in the host's pinned pool first."""

    name = "torch-memory-saver"
    covers = "the PyTorch tensors allocated in the kernel's memory-saver region; the driver checkpoint parks the rest"

    def __init__(self, driver: DriverCheckpointPath, pinned: PinnedBackups | None, reply_timeout: float = 30.0,
                 probe_timeout: float = 5.0) -> None:
        self.driver = driver
        self.pinned = pinned
        self.reply_timeout = reply_timeout  # a park or unpark copies the tensors: as long as a checkpoint may take
        self.probe_timeout = probe_timeout  # a kernel without the extension never answers: do not wait long

    async def _ask(self, kernel: ParkingKernel, action: str, timeout: float | None = None) -> dict[str, Any] | None:
        assert kernel.ask is not None
        return await kernel.ask(action, timeout=self.reply_timeout if timeout is None else timeout)

    async def park(self, kernel: ParkingKernel) -> Parked:
        if kernel.ask is None:
            raise ParkingRefused("the kernel cannot be reached on the quiet channel (no gpupool kernel extension)")
        if self.pinned is None:
            raise ParkingRefused("this pool keeps no books of pinned parking memory (it cannot suspend kernels)")
        probe = await self._ask(kernel, "parking_probe", self.probe_timeout)
        if probe is None or probe.get("status") != "ok":
            why = (probe or {}).get("message") or "the kernel did not answer its parking probe"
            raise ParkingRefused(str(why))
        saver = str(probe.get("path") or "")
        if not saver:
            raise ParkingRefused(str(probe.get("reason") or "the kernel has no framework path"))
        need = max(0, int(probe.get("bytes") or 0))  # the kernel's word: the pool bounds it by what the kernel may hold
        why_not = await asyncio.to_thread(self.pinned.reserve, kernel.lease_id, need)
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


__all__ = [
    "DRIVER_CHECKPOINT",
    "DriverCheckpointPath",
    "FrameworkPath",
    "Parked",
    "ParkingKernel",
    "ParkingPath",
    "ParkingRefused",
    "PinnedBackups",
    "park_kernel",
]
