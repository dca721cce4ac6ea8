"""What every checkpointer promises: the :class:`Checkpointer` interface, its error and support
answer, the checks its arguments pass, and :class:`NoCheckpointer` for hosts that cannot suspend.

The checkpointers themselves, and :func:`~jupyter_gpupool.devices.checkpoint.checkpointer_for`
that picks one, are in :mod:`jupyter_gpupool.devices.checkpoint`.
"""

from __future__ import annotations

import abc
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import process_alive as _alive
from jupyter_gpupool.errors import GpuPoolError

#: What :meth:`Checkpointer.state` answers.
STATES = ("running", "suspended", "locked", "failed", "gone")


class CheckpointError(GpuPoolError):
    """Suspending or resuming failed; :attr:`reason` is one line for the user.

    :attr:`state` is the process's state after the failure (one of :data:`STATES`, or ``""``
    when unknown), so the caller knows whether the kernel still runs, stays suspended or is lost.
    """

    http_status = 409

    def __init__(self, reason: str, state: str = "") -> None:
        self.reason = " ".join(str(reason).split())  # one line, whatever the driver said
        self.state = state
        super().__init__(self.reason)


@dataclass(frozen=True)
class CheckpointSupport:
    """Whether this host can suspend kernels, with which backend, and why (not)."""

    supported: bool
    backend: str  # "cuda" | "simulated" | "none"
    reason: str  # why not, or what is used
    driver_version: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "supported": self.supported,
            "backend": self.backend,
            "reason": self.reason,
            "driver_version": self.driver_version,
        }


class Checkpointer(abc.ABC):
    """Suspends a process's GPU memory to host RAM and resumes it (blocking calls)."""

    name: str = "abstract"

    def __init__(self) -> None:
        self._support: CheckpointSupport | None = None
        self._probe_lock = threading.Lock()

    def probe(self) -> CheckpointSupport:
        """Whether suspending works here; asked once, then cached."""
        with self._probe_lock:
            if self._support is None:
                self._support = self._probe()
            return self._support

    @abc.abstractmethod
    def _probe(self) -> CheckpointSupport:
        """Find out (uncached)."""

    def supports_devices(self, devices: list[Device]) -> str:
        """``""`` if a lease on ``devices`` can be suspended, else one line saying why not."""
        support = self.probe()
        if not support.supported:
            return support.reason
        return ""

    @abc.abstractmethod
    def suspend(self, pid: int, timeout: float = 30.0) -> int:
        """Park process ``pid``'s GPU memory in host RAM and free the GPU; return the bytes parked.

        Waits at most ``timeout`` seconds for GPU work in flight. On failure the process is left
        running (unlocked) where the driver allows, and :class:`CheckpointError` says why.
        """

    @abc.abstractmethod
    def resume(self, pid: int, gpu_mapping: dict[str, str] | None = None) -> None:
        """Bring process ``pid``'s GPU memory back and let it run; :class:`CheckpointError` on
        failure, with the state the process is left in. ``gpu_mapping`` (old → new uuid, one GPU
        each) moves it onto other GPUs; GPUs it does not name stay where they are (or, where
        another GPU moves onto theirs, take the place left free), as the driver needs every GPU named."""

    @abc.abstractmethod
    def state(self, pid: int) -> str:
        """``running`` | ``suspended`` | ``locked`` | ``failed`` | ``gone``, or ``""`` when the driver cannot be asked (never a guess)."""


def check_pid(pid: object) -> int:
    """``pid`` as a positive process id, or :class:`CheckpointError`."""
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise CheckpointError(f"cannot suspend or resume process {pid!r}: expected a positive process id")
    return pid


def check_timeout(timeout: object) -> float:
    """``timeout`` as a positive, finite number of seconds, or :class:`CheckpointError`."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout) or timeout <= 0:
        raise CheckpointError(f"invalid suspend timeout {timeout!r}: expected a positive number of seconds")
    return float(timeout)


def check_mapping(gpu_mapping: object) -> dict[str, str]:
    """``gpu_mapping`` as old → new uuid, one GPU each, or :class:`CheckpointError`."""
    if gpu_mapping is None:
        return {}
    if not isinstance(gpu_mapping, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) and k and v for k, v in gpu_mapping.items()
    ):
        raise CheckpointError("invalid gpu_mapping: expected a mapping of old GPU uuid to new GPU uuid (strings)")
    sources_of: dict[str, list[str]] = {}
    for old, new in gpu_mapping.items():
        sources_of.setdefault(new, []).append(old)
    for new, olds in sorted(sources_of.items()):
        if len(olds) > 1:
            raise CheckpointError(f"invalid gpu_mapping: it sends {' and '.join(sorted(olds))} all to {new}; one GPU each")
    return dict(gpu_mapping)


def complete_mapping(mapping: dict[str, str], gpus: list[str]) -> dict[str, str]:
    """A partial old → new mapping made a one-to-one mapping of all ``gpus`` (the driver wants
    every GPU it shows named): a GPU not named stays where it is, unless another moves onto it;
    then it takes a place left free. Unchanged if the mapping names GPUs outside ``gpus``."""
    if not mapping or not set(mapping) | set(mapping.values()) <= set(gpus):
        return dict(mapping)
    full = dict(mapping)
    taken = set(mapping.values())
    unnamed = [g for g in gpus if g not in mapping]
    for gpu in unnamed:
        if gpu not in taken:
            full[gpu] = gpu
            taken.add(gpu)
    free = [g for g in gpus if g not in taken]
    for gpu in [g for g in unnamed if g not in full]:
        full[gpu] = free.pop(0)
    return full


def gone_error(pid: int, action: str) -> CheckpointError:
    """The error for ``action`` on a process that has exited."""
    return CheckpointError(f"cannot {action} process {pid}: it has exited", state="gone")


# --- no checkpointing ------------------------------------------------------------------------------
class NoCheckpointer(Checkpointer):
    """For backends that cannot suspend: probe says why; suspend and resume raise."""

    name = "none"

    def __init__(self, reason: str = "this pool's device backend cannot suspend kernels") -> None:
        super().__init__()
        self.reason = reason

    def _probe(self) -> CheckpointSupport:
        return CheckpointSupport(False, "none", self.reason)

    def suspend(self, pid: int, timeout: float = 30.0) -> int:
        raise CheckpointError(f"cannot suspend process {pid}: {self.reason}", state=self.state(pid))

    def resume(self, pid: int, gpu_mapping: dict[str, str] | None = None) -> None:
        raise CheckpointError(f"cannot resume process {pid}: {self.reason}", state=self.state(pid))

    def state(self, pid: int) -> str:
        return "running" if isinstance(pid, int) and pid > 0 and _alive(pid) else "gone"


__all__ = [
    "STATES",
    "CheckpointError",
    "CheckpointSupport",
    "Checkpointer",
    "NoCheckpointer",
    "check_mapping",
    "check_pid",
    "check_timeout",
    "complete_mapping",
    "gone_error",
]
