"""What every device backend provides: the devices, and the memory each process holds on them."""

from __future__ import annotations

import abc
import contextlib
import os
from dataclasses import dataclass

from jupyter_gpupool.core.models import Device


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


#: Where an NVIDIA driver shows itself on a host (the kernel's autolease keeps its own copy, so that
#: a kernel that stands aside imports nothing of the pool).
NVIDIA_MARKERS = ("/dev/nvidiactl", "/proc/driver/nvidia/version")


def nvidia_driver_present() -> bool:
    """Whether this host shows an NVIDIA driver (two ``stat`` calls, no NVML)."""
    return any(os.path.exists(path) for path in NVIDIA_MARKERS)


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
