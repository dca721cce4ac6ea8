"""What every device backend provides: the devices, and the memory each process holds on them."""

from __future__ import annotations

import abc
import functools
import os
from dataclasses import dataclass
from typing import Any

import psutil

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.core.validate import pid_max


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


def process_alive(pid: Any) -> bool:
    """Whether a process with this id exists and runs now: the one answer every part of the pool
    gives. A zombie (exited, not yet reaped) is dead; a process this one may not inspect
    (``AccessDenied``: another user's, ``hidepid``) exists, so it is alive; an id no process can
    have (not a whole number, past ``pid_max``) is dead; where the OS cannot tell, alive (a
    heartbeat's timeout decides then). Never raises."""
    if isinstance(pid, bool) or not isinstance(pid, int) or not 1 <= pid <= _pid_max():
        return False
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:  # a zombie too (psutil.ZombieProcess)
        return False
    except psutil.AccessDenied:
        return True
    except (psutil.Error, OSError, ValueError, OverflowError):
        try:
            return bool(psutil.pid_exists(pid))
        except (OSError, ValueError, OverflowError):
            return True


#: The OS's highest pid (core's reading of ``/proc/sys/kernel/pid_max``), read once per process.
_pid_max = functools.lru_cache(maxsize=1)(pid_max)
