"""Device backends: where the pool learns which GPUs exist and how much memory processes use.

Two backends share one interface: ``nvml`` (real GPUs through nvidia-ml-py) and
``simulated`` (from a spec such as ``2xA100-80GB``), chosen by :func:`make_backend`; :func:`checkpointer_for` gives the matching way to suspend a
kernel's GPU memory to host RAM (see :mod:`.checkpoint`).
"""

from __future__ import annotations

import abc
import contextlib
import os
from dataclasses import dataclass

from ..core.models import Device


@dataclass(frozen=True)
class ProcessUsage:
    """GPU memory one OS process holds on one device."""

    pid: int
    device_uuid: str
    used_memory: int  # bytes


class DeviceBackend(abc.ABC):
    """What the pool needs from the hardware layer."""

    name: str = "abstract"

    @abc.abstractmethod
    def devices(self) -> list[Device]:
        """Poolable devices (GPUs, or MIG instances of GPUs in MIG mode), with health."""

    @abc.abstractmethod
    def process_usage(self) -> list[ProcessUsage]:
        """GPU memory per process on every device (for the watchdog)."""

    def describe(self) -> str:
        """One line for status output, e.g. ``simulated 2xA100-80GB``."""
        return self.name

    def close(self) -> None:
        """Release driver handles (NVML shutdown)."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (another user's counts; a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone: it runs no more cells.
    with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as handle:
        if handle.read().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def make_backend(spec: str | None) -> DeviceBackend:
    """``None``/``""``/``"nvml"`` → NVML; anything else is a simulated inventory spec.

    Raises :class:`~jupyter_gpupool.errors.PoolUnavailable` when NVML is asked for but absent.
    """
    from .simulated import SimulatedBackend

    if spec and spec.strip().lower() not in {"nvml", "auto"}:
        return SimulatedBackend.from_spec(spec)
    from .nvml import NvmlBackend

    return NvmlBackend()


from .checkpoint import Checkpointer, CheckpointError, CheckpointSupport, checkpointer_for

__all__ = [
    "CheckpointError",
    "CheckpointSupport",
    "Checkpointer",
    "Device",
    "DeviceBackend",
    "ProcessUsage",
    "checkpointer_for",
    "make_backend",
    "process_alive",
]
