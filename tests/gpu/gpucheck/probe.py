"""What this machine has: a GPU, frameworks, tools and the code under test.

Probing imports no framework and creates no CUDA context, so the runner stays light and every
check can say up front why it cannot run.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

FRAMEWORKS: dict[str, tuple[str, str]] = {
    # check suffix: (import name, name people know it by)
    "torch": ("torch", "PyTorch"),
    "jax": ("jax", "JAX"),
    "cupy": ("cupy", "CuPy"),
    "torch_memory_saver": ("torch_memory_saver", "torch-memory-saver"),
}

SERVER_STACK = ("jupyter_server", "jupyter_client", "ipykernel", "traitlets", "tornado", "zmq")
CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)
PROVISIONER_NAME = "gpupool-provisioner"


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _module_error(name: str) -> str | None:
    """Import ``name``; return None if it imports, else a one-line reason."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to skip
        return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
    return None


@dataclass
class Probe:
    """Facts about this machine; each check's ``requires`` reads them."""

    python: str = sys.executable
    gpu: bool = False
    gpu_reason: str = ""  # why no GPU counts as present
    gpu_count: int = 0
    driver: str = ""
    nvidia_smi: str | None = None
    nvml_error: str | None = None
    frameworks: dict[str, str | None] = field(default_factory=dict)  # key -> version or None
    server_stack_missing: list[str] = field(default_factory=list)
    provisioner_registered: bool = False
    modules_missing: dict[str, str] = field(default_factory=dict)  # jupyter_gpupool.x -> reason
    mps_control: str | None = None
    cuda_checkpoint: str | None = None
    checkpoint_api: bool = False
    libcuda: bool = False
    root: bool = False  # device cgroups are root's to change

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def probe_gpu(probe: Probe) -> None:
    probe.nvidia_smi = shutil.which("nvidia-smi")
    reasons: list[str] = []
    if probe.nvidia_smi is None:
        reasons.append("nvidia-smi not on PATH")
    try:
        import pynvml  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001
        probe.nvml_error = f"nvidia-ml-py not importable ({type(exc).__name__})"
    else:
        try:
            pynvml.nvmlInit()
            try:
                probe.gpu_count = int(pynvml.nvmlDeviceGetCount())
                driver = pynvml.nvmlSystemGetDriverVersion()
                probe.driver = driver.decode() if isinstance(driver, bytes) else str(driver)
            finally:
                pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001
            probe.nvml_error = f"NVML: {exc}"
    if probe.nvml_error:
        reasons.append(probe.nvml_error)
    elif probe.gpu_count == 0:
        reasons.append("NVML reports 0 GPUs")
    probe.gpu = probe.nvml_error is None and probe.gpu_count > 0
    probe.gpu_reason = "" if probe.gpu else "no NVIDIA GPU: " + "; ".join(reasons)


def probe_libcuda(probe: Probe) -> None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return
    probe.libcuda = True
    probe.checkpoint_api = all(hasattr(lib, sym) for sym in CHECKPOINT_SYMBOLS)


def probe_all() -> Probe:
    """Probe everything; cheap (no framework import, no CUDA context)."""
    probe = Probe(root=os.geteuid() == 0)
    probe_gpu(probe)
    for key, (module, _) in FRAMEWORKS.items():
        probe.frameworks[key] = (
            (_version(module) or _version(f"{module}-cuda13x") or "unknown") if _has_module(module) else None
        )
    if probe.frameworks.get("cupy") == "unknown":
        for dist in ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy"):
            if _version(dist):
                probe.frameworks["cupy"] = _version(dist)
                break
    probe.server_stack_missing = [m for m in SERVER_STACK if not _has_module(m)]
    for module in (
        "jupyter_gpupool.provisioner.kernel_provisioner",
        "jupyter_gpupool.devices.nvml",
        "jupyter_gpupool.enforcement.watchdog",
        "jupyter_gpupool.backends.local.pool",
        "jupyter_gpupool.enforcement.unpooled",
        "jupyter_gpupool.enforcement.device_control",
    ):
        reason = _module_error(module) if _has_module("jupyter_gpupool") else "jupyter_gpupool not importable"
        if reason:
            probe.modules_missing[module] = reason
    try:
        eps = importlib.metadata.entry_points(group="jupyter_client.kernel_provisioners")
        probe.provisioner_registered = any(ep.name == PROVISIONER_NAME for ep in eps)
    except Exception:  # noqa: BLE001
        probe.provisioner_registered = False
    probe.mps_control = shutil.which("nvidia-cuda-mps-control")
    probe.cuda_checkpoint = shutil.which("cuda-checkpoint")
    probe_libcuda(probe)
    return probe


# --- requirement helpers: each returns None when satisfied, else the skip reason --------------


def need_gpu(probe: Probe) -> str | None:
    return None if probe.gpu else probe.gpu_reason or "no NVIDIA GPU"


def need_framework(probe: Probe, key: str) -> str | None:
    if probe.frameworks.get(key):
        return None
    return f"{FRAMEWORKS[key][1]} not installed for {probe.python} (import {FRAMEWORKS[key][0]} fails)"


def need_server(probe: Probe) -> str | None:
    if probe.server_stack_missing:
        return (
            f"{', '.join(probe.server_stack_missing)} not importable in {probe.python}: "
            "run tests/gpu/prepare.sh where pip works and carry tests/gpu/.wheels"
        )
    return None


def need_module(probe: Probe, module: str) -> str | None:
    reason = probe.modules_missing.get(module)
    return f"{module} not importable ({reason})" if reason else None


def need_checkpoint_api(probe: Probe) -> str | None:
    """The CUDA checkpoint API in libcuda, or the ``cuda-checkpoint`` tool that drives it."""
    if probe.checkpoint_api or probe.cuda_checkpoint:
        return None
    return (
        f"no CUDA checkpoint API: libcuda lacks cuCheckpointProcess* (driver {probe.driver or 'unknown'}; "
        "needs 570+) and cuda-checkpoint is not on PATH"
    )


def need_provisioner(probe: Probe) -> str | None:
    reason = need_module(probe, "jupyter_gpupool.provisioner.kernel_provisioner")
    if reason:
        return reason
    if not probe.provisioner_registered:
        return f"kernel provisioner {PROVISIONER_NAME!r} is not registered (no jupyter_gpupool entry points)"
    return None


def first(*reasons: str | None) -> str | None:
    """The first reason that is not None (requirements in the order they matter)."""
    for reason in reasons:
        if reason:
            return reason
    return None


def nvidia_smi_query(fields: str, timeout: float = 20.0) -> list[list[str]]:
    """``nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits`` as rows of stripped cells."""
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        check=True,
        capture_output=True,
        text=True,
        timeout=timeout,
    ).stdout
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}
