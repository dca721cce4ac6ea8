"""How a granted slice is enforced: a plan of environment variables, chosen per device.

The plan is a pure function of the lease, the devices it holds and the admin's settings, so the
provisioner (which puts ``env`` into the kernel's environment) and the REST API (which shows
``level``/``mechanisms``/``description`` in the sidebar) always agree.

Mechanisms, strongest first (DESIGN.md, "Enforcement is a plan"):

``mig``             the device is an existing MIG instance: memory and SMs isolated by hardware.
``mps``             CUDA MPS with a per-client pinned memory limit (allocations above it fail); with
                    memory partitioning (driver r615+), a soft bound at the guarantee and a hard one
                    at the limit (see :mod:`.partition`).
``hami``            HAMi-core (``libvgpu.so`` preloaded) caps what the CUDA driver API hands out.
``framework-caps``  JAX, CuPy, TensorFlow (and PyTorch, via the kernel extension) cap themselves.
``watchdog``        NVML per-process usage is checked against the slice; always on.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traitlets import Bool, Enum, Unicode
from traitlets.config import Configurable

from jupyter_gpupool.core.models import Device, Lease, LeaseState
from jupyter_gpupool.enforcement.partition import CGROUP_ROOT, MemoryPartitioning, probe_memory_partitioning
from jupyter_gpupool.units import MIB, format_size

log = logging.getLogger(__name__)

#: ``level`` values, strongest first. ``none``: no slice (queued, released, or no GPU at all).
LEVELS = ("hard", "strong", "soft", "none")


@dataclass(frozen=True)
class EnforcementConfig:
    """What the admin set up on this host (plain data; see :class:`EnforcementSettings`)."""

    framework_caps: bool = True
    mps_pipe_directory: str | None = None  # an MPS control daemon serves this pipe directory
    mps_memory_partitioning: bool = False  # the driver sets soft and hard bounds per cgroup (probed)
    cgroup_root: str = CGROUP_ROOT  # where cgroup v2 is mounted (kernels' cgroups go under it)
    hami_library: str | None = None  # absolute path of HAMi-core's libvgpu.so
    hami_cache_dir: str | None = None  # where per-kernel shared-region files go (default: /tmp)


@dataclass(frozen=True)
class EnforcementPlan:
    """The environment a kernel gets for its slice, and what that amounts to."""

    env: dict[str, str]
    level: str
    mechanisms: tuple[str, ...]
    description: str
    #: variables to prepend to (not replace) in the kernel's environment, e.g. LD_PRELOAD
    prepend: dict[str, str] = field(default_factory=dict)
    #: Why this slice cannot grow above its guarantee ("" where it may burst).
    fixed_because: str = ""
    #: The kernel's cgroup gets these soft (guaranteed) and hard (limit) bytes (MPS memory partitioning).
    partition: tuple[int, int] | None = None

    def to_json(self) -> dict[str, Any]:
        """The part the sidebar and REST API show."""
        return {
            "level": self.level, "mechanisms": list(self.mechanisms), "description": self.description,
            "bursts": not self.fixed_because, "fixed_because": self.fixed_because or None,
        }

    def apply(self, env: Mapping[str, str]) -> dict[str, str]:
        """Return a copy of ``env`` with this plan's variables set (prepends joined with ``:``)."""
        result = dict(env)
        result.update(self.env)
        for key, value in self.prepend.items():
            existing = [p for p in result.get(key, "").split(":") if p and p != value]
            result[key] = ":".join([value, *existing])
        return result


def memory_fraction(memory: int, devices: Sequence[Device]) -> float:
    """Share of the smallest held device that ``memory`` bytes are, rounded down to 0.001."""
    totals = [d.memory_total for d in devices if d.memory_total > 0]
    if not totals:
        return 1.0
    fraction = memory / min(totals)
    return max(0.001, min(1.0, math.floor(fraction * 1000) / 1000))


@dataclass
class _PlanDraft:
    """The plan of a granted slice while its mechanisms are added, strongest first."""

    lease: Lease
    held: list[Device]
    env: dict[str, str]
    mib: int
    size: str
    prepend: dict[str, str] = field(default_factory=dict)
    mechanisms: list[str] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    level: str = "soft"
    fixed_because: str = ""
    partition: tuple[int, int] | None = None

    @property
    def share(self) -> str:
        """The compute share as the description words it ("" when none)."""
        return f", {self.lease.compute_share}% of the SMs" if self.lease.compute_share else ""


def _no_slice_plan(lease: Lease) -> EnforcementPlan:
    """A lease without a slice: an environment that hides every GPU."""
    why = {
        LeaseState.QUEUED: "waiting in the queue: no GPU yet",
        LeaseState.RELEASED: "slice released: no GPU",
    }.get(lease.state, "no GPU slice")
    return EnforcementPlan(
        env={"CUDA_VISIBLE_DEVICES": "", "GPUPOOL_LEASE_ID": lease.id, "GPUPOOL_ENFORCEMENT": "none"},
        level="none",
        mechanisms=(),
        description=why,
    )


def _add_mig(draft: _PlanDraft) -> None:
    """The slice is whole MIG instances: the GPU isolates it."""
    draft.mechanisms.append("mig")
    draft.level = "hard"
    smallest = format_size(min(d.memory_total for d in draft.held))
    draft.parts.append(f"MIG instance ({smallest}): memory and compute isolated by the GPU")
    draft.fixed_because = "a MIG instance has a fixed size"


def _add_mps(draft: _PlanDraft, config: EnforcementConfig) -> None:
    """CUDA MPS pins the kernel's memory (and, with partitioning, bounds an elastic slice)."""
    lease, env = draft.lease, draft.env
    assert config.mps_pipe_directory
    draft.mechanisms.append("mps")
    draft.level = "strong"
    env["CUDA_MPS_PIPE_DIRECTORY"] = config.mps_pipe_directory
    if config.mps_memory_partitioning and lease.elastic:
        # The hard bound is the limit: the slice grows under it, its guarantee is the soft bound.
        limit = int(lease.limit_size)
        draft.partition = (int(lease.guarantee_size), limit)
        draft.mib = max(1, limit // MIB)
        draft.parts.append(
            f"CUDA MPS guarantees this kernel {format_size(lease.guarantee_size)} and fails allocations above "
            f"{format_size(limit)}{draft.share} (memory partitioning)"
        )
    else:
        draft.fixed_because = "CUDA MPS sets a kernel's memory limit when it starts"
        draft.parts.append(f"CUDA MPS limits this kernel to {draft.size}{draft.share}; allocations above it fail")
    # Indices are relative to CUDA_VISIBLE_DEVICES: 0..n-1.
    env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{i}={draft.mib}M" for i in range(len(lease.devices)))
    if lease.compute_share:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(int(lease.compute_share))


def _add_hami(draft: _PlanDraft, config: EnforcementConfig) -> None:
    """HAMi-core, preloaded, caps what the CUDA driver hands the kernel."""
    lease, env = draft.lease, draft.env
    assert config.hami_library
    draft.mechanisms.append("hami")
    draft.level = "strong"
    draft.prepend["LD_PRELOAD"] = config.hami_library
    for i in range(len(lease.devices)):
        env[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{draft.mib}m"
        if lease.compute_share:
            env[f"CUDA_DEVICE_SM_LIMIT_{i}"] = str(int(lease.compute_share))
    # One shared-region file per lease: the limit is a per-kernel budget, not a per-user one.
    cache_dir = config.hami_cache_dir or "/tmp"
    env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = os.path.join(cache_dir, f"gpupool-{lease.id}.cache")
    draft.parts.append(f"HAMi-core limits this kernel to {draft.size}{draft.share}; allocations above it fail")
    draft.fixed_because = "HAMi-core sets a kernel's memory limit when it starts"


def _add_framework_caps(draft: _PlanDraft) -> None:
    """PyTorch, JAX, CuPy and TensorFlow cap themselves at the slice."""
    memory, env = int(draft.lease.memory), draft.env
    draft.mechanisms.append("framework-caps")
    fraction = memory_fraction(memory, draft.held)
    env["GPUPOOL_MEMORY_FRACTION"] = f"{fraction:.3f}"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.3f}"
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["CUPY_GPU_MEMORY_LIMIT"] = str(memory)
    env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
    if not draft.parts:
        draft.parts.append(f"PyTorch, JAX, CuPy and TensorFlow are capped at {draft.size}")
    else:
        draft.parts.append("frameworks capped too")


def plan_enforcement(
    lease: Lease,
    devices: Sequence[Device] | Mapping[str, Device],
    config: EnforcementConfig | None = None,
) -> EnforcementPlan:
    """Build the enforcement plan of ``lease`` on ``devices`` (all devices, or those it holds).

    A lease that is not granted gets ``level="none"`` and an environment that hides every GPU,
    so a kernel that somehow starts without a slice cannot use one by accident.
    """
    config = config or EnforcementConfig()
    by_uuid = dict(devices) if isinstance(devices, Mapping) else {d.uuid: d for d in devices}
    if lease.state not in (LeaseState.GRANTED, LeaseState.SUSPENDED) or not lease.devices:
        return _no_slice_plan(lease)

    held = [by_uuid[u] for u in lease.devices if u in by_uuid]
    memory = int(lease.memory)
    draft = _PlanDraft(
        lease=lease,
        held=held,
        env={
            "CUDA_VISIBLE_DEVICES": ",".join(lease.devices),
            "GPUPOOL_LEASE_ID": lease.id,
            "GPUPOOL_MEMORY_LIMIT": str(memory),
        },
        mib=max(1, memory // MIB),
        size=format_size(memory) + (f" on each of {len(lease.devices)} GPUs" if len(lease.devices) > 1 else ""),
    )
    if bool(held) and all(d.is_mig for d in held):
        _add_mig(draft)
    elif config.mps_pipe_directory:
        _add_mps(draft, config)
    elif config.hami_library:
        _add_hami(draft, config)
    if config.framework_caps:
        _add_framework_caps(draft)

    draft.mechanisms.append("watchdog")
    draft.parts.append("the watchdog stops a kernel far over it" if draft.level == "soft" else "the watchdog checks usage")
    draft.env["GPUPOOL_ENFORCEMENT"] = draft.level
    return EnforcementPlan(
        env=draft.env, level=draft.level, mechanisms=tuple(draft.mechanisms), description="; ".join(draft.parts) + ".",
        prepend=draft.prepend, fixed_because=draft.fixed_because, partition=draft.partition,
    )


def size_fixed_at_start(config: EnforcementConfig) -> str:
    """Why slices on this host cannot grow once their kernel runs ("" where they can): MPS without
    memory partitioning and HAMi-core read their limit once, when the kernel starts."""
    if config.mps_pipe_directory and not config.mps_memory_partitioning:
        return "CUDA MPS sets a kernel's memory limit when it starts"
    if not config.mps_pipe_directory and config.hami_library:
        return "HAMi-core sets a kernel's memory limit when it starts"
    return ""


class EnforcementSettings(Configurable):
    """Admin settings that choose the enforcement mechanisms (``c.EnforcementSettings.*``)."""

    framework_caps = Bool(
        True,
        config=True,
        help="Set the framework caps (JAX, CuPy, TensorFlow; PyTorch via the kernel extension) in the kernel's environment.",
    )
    mps_pipe_directory = Unicode(
        os.environ.get("GPUPOOL_MPS_PIPE_DIRECTORY", ""),
        config=True,
        help=(
            "CUDA_MPS_PIPE_DIRECTORY of a running MPS control daemon (nvidia-cuda-mps-control -d). When set, "
            "each kernel gets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT for its slice. Empty: MPS is not used. "
            "Env: GPUPOOL_MPS_PIPE_DIRECTORY."
        ),
    )
    mps_memory_partitioning = Enum(
        ["auto", "on", "off"],
        os.environ.get("GPUPOOL_MPS_MEMORY_PARTITIONING", "auto").strip().lower() or "auto",
        config=True,
        help=(
            "With MPS: give each kernel a cgroup whose soft memory bound is its guarantee and whose hard bound is its "
            "burst limit (MPS memory partitioning, driver r615 / CUDA 13.4 and newer, cgroup v2, root). 'auto': use it "
            "where a probe of NVML finds it; 'on': always (kernels fail to get their bounds where it is missing); "
            "'off': never. Without it an MPS slice does not grow. Env: GPUPOOL_MPS_MEMORY_PARTITIONING."
        ),
    )
    cgroup_root = Unicode(
        os.environ.get("GPUPOOL_CGROUP_ROOT", CGROUP_ROOT),
        config=True,
        help="Where cgroup v2 is mounted; kernels' cgroups for MPS memory partitioning go in its gpupool/ folder. "
        "Env: GPUPOOL_CGROUP_ROOT.",
    )
    hami_library = Unicode(
        os.environ.get("GPUPOOL_HAMI_LIBRARY", ""),
        config=True,
        help=(
            "Absolute path of HAMi-core's libvgpu.so. When set (and MPS is not), kernels run with it in LD_PRELOAD "
            "and CUDA_DEVICE_MEMORY_LIMIT_<i> set to their slice. Empty: HAMi-core is not used. Env: GPUPOOL_HAMI_LIBRARY."
        ),
    )
    hami_cache_dir = Unicode(
        os.environ.get("GPUPOOL_HAMI_CACHE_DIR", ""),
        config=True,
        help="Directory for HAMi-core's per-kernel shared-region files (CUDA_DEVICE_MEMORY_SHARED_CACHE). Empty: /tmp.",
    )

    def partitioning(self) -> MemoryPartitioning | None:
        """The probe's answer (``None`` where MPS is not used or partitioning is off)."""
        if not self.mps_pipe_directory or self.mps_memory_partitioning == "off":
            return None
        if self.mps_memory_partitioning == "on":
            return MemoryPartitioning(True, "", self.cgroup_root)
        return _probe_once(self.cgroup_root)

    def to_config(self) -> EnforcementConfig:
        """The plain-data form :func:`plan_enforcement` takes."""
        partitioning = self.partitioning()
        return EnforcementConfig(
            framework_caps=self.framework_caps,
            mps_pipe_directory=self.mps_pipe_directory or None,
            mps_memory_partitioning=bool(partitioning and partitioning.available),
            cgroup_root=self.cgroup_root,
            hami_library=self.hami_library or None,
            hami_cache_dir=self.hami_cache_dir or None,
        )


_PROBES: dict[str, MemoryPartitioning] = {}


def _probe_once(cgroup_root: str) -> MemoryPartitioning:
    """Probe MPS memory partitioning once per process (NVML is asked only where MPS is used)."""
    if cgroup_root not in _PROBES:
        try:
            import pynvml  # optional at this point: only a host with MPS configured gets here
        except ImportError:
            _PROBES[cgroup_root] = MemoryPartitioning(False, "nvidia-ml-py is not installed", cgroup_root)
        else:
            _PROBES[cgroup_root] = probe_memory_partitioning(pynvml, cgroup_root)
        found = _PROBES[cgroup_root]
        if not found.available:
            log.info("gpupool: MPS memory partitioning is not available (%s): MPS slices do not grow", found.why)
    return _PROBES[cgroup_root]


__all__ = ["LEVELS", "EnforcementConfig", "EnforcementPlan", "EnforcementSettings", "memory_fraction", "plan_enforcement", "size_fixed_at_start"]
