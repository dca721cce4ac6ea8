"""MPS memory partitioning: a kernel's guarantee and limit as the driver's soft and hard bounds.

Where the driver offers it (CUDA 13.4 / driver r615 and newer, cgroup v2; Linux 6.14's ``dmem``
controller or the driver's own fallback on older kernels; not on MIG), NVML sets two bounds per
cgroup: a *soft* limit, memory the cgroup is guaranteed, and a *hard* limit, above which
allocations fail (``nvmlDeviceSetMemoryLimits_v1``). That is an elastic slice in hardware: the
soft limit is the slice's guarantee, the hard limit its burst limit. Each kernel then runs in a
cgroup of its own, which it joins before it starts (``python -m
jupyter_gpupool.enforcement.join_cgroup``).

Without it, MPS's per-client limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) is read once, when the
kernel creates its CUDA context, so an MPS slice cannot grow: it is a fixed slice.

Only :func:`probe_memory_partitioning` decides whether it is there; it was tested on a scripted
NVML, not on hardware (the GPUs we could run on have driver 580).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

#: The first driver branch with MPS memory partitioning (CUDA 13.4).
PARTITION_MIN_DRIVER = 615
#: Where cgroup v2 is mounted.
CGROUP_ROOT = "/sys/fs/cgroup"
#: The folder under the cgroup root that holds one cgroup per kernel.
CGROUP_PARENT = "gpupool"


@dataclass(frozen=True)
class MemoryPartitioning:
    """Whether this host can give kernels soft and hard memory bounds, and if not, why not."""

    available: bool
    why: str  # one clause for the admin: what is missing ("" when available)
    cgroup_root: str = CGROUP_ROOT


def _driver_branch(version: str) -> int | None:
    match = re.match(r"\s*(\d+)", version)
    return int(match.group(1)) if match else None


def _nvml_error_name(nvml: ModuleType, exc: Exception) -> str:
    code = getattr(exc, "value", None)
    names = {getattr(nvml, n): n for n in dir(nvml) if n.startswith("NVML_ERROR_")}
    return names.get(code, f"code {code}")


def _writable(path: str) -> bool:
    return os.access(path, os.W_OK)


def probe_memory_partitioning(
    nvml: ModuleType, cgroup_root: str = CGROUP_ROOT, may_write: Callable[[str], bool] = _writable
) -> MemoryPartitioning:
    """Ask this host whether MPS memory partitioning can be used, without changing anything:
    cgroup v2 mounted and writable by this process (kernels' cgroups are made here), an
    nvidia-ml-py that knows the call, a driver of r615 or newer, and NVML answering a read of the
    root cgroup's limits on the first GPU (initialises NVML if needed)."""
    root = Path(cgroup_root)
    if not (root / "cgroup.controllers").is_file():
        return MemoryPartitioning(False, f"cgroup v2 is not mounted at {cgroup_root}", cgroup_root)
    parent = root / CGROUP_PARENT if (root / CGROUP_PARENT).is_dir() else root
    if not may_write(str(parent)):
        return MemoryPartitioning(
            False, f"this process cannot create cgroups in {parent} (it needs root, or that folder delegated to it)", cgroup_root
        )
    if not hasattr(nvml, "nvmlDeviceGetMemoryLimits_v1") or not hasattr(nvml, "c_nvmlGetMemoryLimits_v1_t"):
        return MemoryPartitioning(False, "nvidia-ml-py is too old to set memory limits (needs 13.615 or newer)", cgroup_root)
    try:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlInit()
        version = nvml.nvmlSystemGetDriverVersion()
        version = version.decode() if isinstance(version, bytes) else str(version)
        branch = _driver_branch(version)
        if branch is None or branch < PARTITION_MIN_DRIVER:
            return MemoryPartitioning(
                False, f"driver {version} has no MPS memory partitioning (needs r{PARTITION_MIN_DRIVER} / CUDA 13.4 or newer)", cgroup_root
            )
        handle = nvml.nvmlDeviceGetHandleByIndex(0)
        limits = nvml.c_nvmlGetMemoryLimits_v1_t(nameSpace=str(root).encode())
        nvml.nvmlDeviceGetMemoryLimits_v1(handle, limits)
    except nvml.NVMLError as exc:
        name = _nvml_error_name(nvml, exc)
        why = {
            "NVML_ERROR_FUNCTION_NOT_FOUND": "the driver's NVML has no memory limits call",
            "NVML_ERROR_NOT_SUPPORTED": "this GPU does not support memory partitioning (MIG, or too old)",
            "NVML_ERROR_NO_PERMISSION": "setting memory limits needs root",
        }.get(name, f"NVML refused to read memory limits ({exc}, {name})")
        return MemoryPartitioning(False, why, cgroup_root)
    return MemoryPartitioning(True, "", cgroup_root)


def load_nvml() -> ModuleType:
    """pynvml, initialised (imported here: only a host using memory partitioning needs it)."""
    import pynvml  # optional dependency of this path alone

    pynvml.nvmlInit()
    return pynvml


def kernel_cgroup_path(lease_id: str, cgroup_root: str = CGROUP_ROOT) -> str:
    """The cgroup a lease's kernel runs in."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", lease_id) or lease_id in (".", ".."):
        raise ValueError(f"lease id {lease_id!r} cannot name a cgroup")
    return str(Path(cgroup_root) / CGROUP_PARENT / lease_id)


def create_kernel_cgroup(
    nvml: ModuleType, device_indices: Sequence[int], lease_id: str, soft: int, hard: int, cgroup_root: str = CGROUP_ROOT
) -> str:
    """Make the cgroup of a lease's kernel and set its soft (guaranteed) and hard (limit) bytes on
    each of its GPUs. Returns the cgroup's path; raises ``nvml.NVMLError`` or ``OSError``."""
    path = kernel_cgroup_path(lease_id, cgroup_root)
    os.makedirs(path, exist_ok=True)
    for index in device_indices:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        limits = nvml.c_nvmlSetMemoryLimits_v1_t(nameSpace=path.encode(), softLimit=int(soft), hardLimit=int(hard))
        nvml.nvmlDeviceSetMemoryLimits_v1(handle, limits)
    return path


def remove_kernel_cgroup(path: str) -> None:
    """Remove a kernel's cgroup (which clears its limits); nothing if it is gone or still in use."""
    with contextlib.suppress(OSError):
        os.rmdir(path)


def join_command(cgroup: str, cmd: Sequence[str], python: str) -> list[str]:
    """``cmd`` prefixed so that the process joins ``cgroup`` before it runs (see join_cgroup)."""
    return [python, "-m", "jupyter_gpupool.enforcement.join_cgroup", cgroup, "--", *cmd]


__all__ = [
    "CGROUP_ROOT",
    "PARTITION_MIN_DRIVER",
    "MemoryPartitioning",
    "create_kernel_cgroup",
    "join_command",
    "kernel_cgroup_path",
    "load_nvml",
    "probe_memory_partitioning",
    "remove_kernel_cgroup",
]
