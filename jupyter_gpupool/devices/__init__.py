"""Device backends: where the pool learns which GPUs exist and how much memory processes use.

Two backends share one interface: ``nvml`` (real GPUs through nvidia-ml-py) and
``simulated`` (from a spec such as ``2xA100-80GB``), chosen by :func:`make_backend`; :func:`checkpointer_for` gives the matching way to suspend a
kernel's GPU memory to host RAM (see :mod:`.checkpoint`).
"""

from __future__ import annotations

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import DeviceBackend, ProcessUsage, process_alive
from jupyter_gpupool.devices.checkpoint import Checkpointer, CheckpointError, CheckpointSupport, checkpointer_for
from jupyter_gpupool.devices.nvml import NvmlBackend
from jupyter_gpupool.devices.simulated import SimulatedBackend


def make_backend(spec: str | None) -> DeviceBackend:
    """``None``/``""``/``"nvml"`` → NVML; anything else is a simulated inventory spec.

    Raises :class:`~jupyter_gpupool.errors.PoolUnavailable` when NVML is asked for but absent.
    """
    if spec and spec.strip().lower() not in {"nvml", "auto"}:
        return SimulatedBackend.from_spec(spec)
    return NvmlBackend()


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
