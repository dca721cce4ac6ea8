"""Pieces the kernel-based checks share: framework snippets, NVML readings, slice servers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..harness import MARKER, JupyterServer, KernelSession
from ..probe import FRAMEWORKS

GIB = 1024**3
MIB = 1024**2
RAWCUDA = Path(__file__).resolve().parents[1] / "rawcuda.py"


def emit(expr: str) -> str:
    return f"print({MARKER!r} + __import__('json').dumps({expr}))"


def seeded_tensors(gib: float, seed: int) -> str:
    """PyTorch kernel code: ``_gc_x``, ``gib`` GiB of int32 tensors drawn on the GPU from ``seed``
    (1 GiB each, the last smaller), ``_gc_total`` elements in all."""
    return f"""import time, torch
_gc_gen = torch.Generator(device="cuda").manual_seed({seed})
_gc_total = int({gib} * 2**30) // 4
_gc_x = [torch.randint(0, 2**31 - 1, (min(2**28, _gc_total - i),), dtype=torch.int32, device="cuda", generator=_gc_gen)
         for i in range(0, _gc_total, 2**28)]
"""


# PyTorch kernel code: the pinned host link as the kernel sees it, in bytes a second each way
# (``_h2d``, ``_d2h``): a 1 GiB buffer copied 4 times, then freed with no pinned host blocks held
# (none is carried across a checkpoint).
PINNED_LINK_SPEED = """_gc_h = torch.empty(2**30, dtype=torch.uint8).pin_memory(); _gc_d = torch.empty(2**30, dtype=torch.uint8, device="cuda")
_gc_d.copy_(_gc_h); torch.cuda.synchronize()
_t = time.perf_counter(); [_gc_d.copy_(_gc_h, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize(); _h2d = 4 * 2**30 / (time.perf_counter() - _t)
_t = time.perf_counter(); [_gc_h.copy_(_gc_d, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize(); _d2h = 4 * 2**30 / (time.perf_counter() - _t)
del _gc_d, _gc_h; torch.cuda.empty_cache()
getattr(torch._C, "_host_emptyCache", lambda: None)()
"""


def regenerated_identical(seed: int) -> str:
    """PyTorch kernel code: ``_gc_identical``, whether every tensor of :func:`seeded_tensors` is bit
    for bit the one ``seed`` draws again (one at a time, so never a second copy of them all)."""
    return f"""_gc_ref_gen = torch.Generator(device="cuda").manual_seed({seed})
_gc_identical = True
for _gc_i, _gc_t in zip(range(0, _gc_total, 2**28), _gc_x):
    _gc_ref = torch.randint(0, 2**31 - 1, (min(2**28, _gc_total - _gc_i),), dtype=torch.int32, device="cuda", generator=_gc_ref_gen)
    _gc_identical = _gc_identical and bool(torch.equal(_gc_ref, _gc_t))
    del _gc_ref
"""


# Per framework: set-up code that defines _gc_alloc(nbytes) (keeps what it allocates in _gc_hold;
# 4-byte elements, so no array needs 64-bit indexing)
# and _gc_info() (a dict of what the framework sees), and proves the framework sees a GPU.
SETUP: dict[str, str] = {
    "torch": """
import torch
_gc_hold = []
assert torch.cuda.is_available(), "PyTorch sees no CUDA device"
torch.empty(1, device="cuda")
def _gc_alloc(nbytes):
    t = torch.empty(int(nbytes) // 4, dtype=torch.float32, device="cuda")
    t.fill_(1.0)
    torch.cuda.synchronize()
    _gc_hold.append(t)
def _gc_info():
    return {"framework": "torch " + torch.__version__, "device": torch.cuda.get_device_name(0),
            "allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved())}
""",
    "jax": """
import jax, jax.numpy as jnp
_gc_hold = []
assert jax.devices()[0].platform == "gpu", f"JAX sees no GPU: {jax.devices()}"
def _gc_alloc(nbytes):
    a = jnp.ones((int(nbytes) // 4,), dtype=jnp.float32)
    a.block_until_ready()
    _gc_hold.append(a)
def _gc_info():
    stats = jax.devices()[0].memory_stats() or {}
    return {"framework": "jax " + jax.__version__, "device": str(jax.devices()[0]),
            "allocated": int(stats.get("bytes_in_use", 0)), "limit": int(stats.get("bytes_limit", 0))}
""",
    "cupy": """
import cupy
_gc_hold = []
cupy.cuda.runtime.getDeviceCount()
def _gc_alloc(nbytes):
    a = cupy.empty(int(nbytes) // 4, dtype=cupy.float32)
    a.fill(1.0)
    cupy.cuda.Device().synchronize()
    _gc_hold.append(a)
def _gc_info():
    pool = cupy.get_default_memory_pool()
    return {"framework": "cupy " + cupy.__version__, "allocated": int(pool.used_bytes()),
            "limit": int(pool.get_limit())}
""",
}

OOM_RE = re.compile(r"out of memory|RESOURCE_EXHAUSTED|OutOfMemory", re.IGNORECASE)


def is_framework_oom(ename: str, evalue: str) -> bool:
    return bool(OOM_RE.search(ename) or OOM_RE.search(evalue))


def names_slice(text: str, slice_bytes: int) -> bool:
    """Does ``text`` carry gpupool's message naming the slice (``4 GiB``, ``4GiB``, bytes)?"""
    if "gpupool" not in text.lower():
        return False
    gib = slice_bytes / GIB
    forms = {str(slice_bytes)}
    if abs(gib - round(gib)) < 1e-9:
        forms.add(rf"{round(gib)}(\.0+)?\s?Gi?B")
    else:
        forms.add(rf"{gib:.1f}\s?Gi?B")
    mib = slice_bytes / MIB
    if abs(mib - round(mib)) < 1e-9:
        forms.add(rf"{round(mib)}\s?Mi?B")
    return any(re.search(rf"(?<![\d.]){form}\b", text) for form in forms)


def framework_label(key: str) -> str:
    return FRAMEWORKS[key][1]


def nvml_process_memory(pids: set[int]) -> dict[int, int]:
    """Bytes of GPU memory NVML attributes to each of ``pids`` (summed over GPUs)."""
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        found: dict[int, int] = {}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in pids and proc.usedGpuMemory is not None:
                    found[proc.pid] = found.get(proc.pid, 0) + int(proc.usedGpuMemory)
        return found
    finally:
        pynvml.nvmlShutdown()


def nvml_device_used(index: int = 0) -> int:
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    finally:
        pynvml.nvmlShutdown()


def gpu_total_memory(index: int = 0) -> int:
    """GPU ``index``'s memory as NVML reports it (what the pool leases with no overcommit)."""
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).total)
    finally:
        pynvml.nvmlShutdown()


def gpu_uuids() -> list[str]:
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        out = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            out.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        return out
    finally:
        pynvml.nvmlShutdown()


def grant_problems(session: KernelSession, slice_bytes: int) -> list[str]:
    """What is wrong with the grant a kernel sees in its environment (empty when all is right)."""
    env = session.env
    problems = []
    if not env.get("GPUPOOL_LEASE_ID"):
        problems.append("GPUPOOL_LEASE_ID missing in the kernel: the gpupool provisioner did not start it")
        return problems
    if env.get("GPUPOOL_MEMORY_LIMIT") != str(slice_bytes):
        problems.append(f"GPUPOOL_MEMORY_LIMIT={env.get('GPUPOOL_MEMORY_LIMIT')!r}, expected {slice_bytes}")
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not visible:
        problems.append("CUDA_VISIBLE_DEVICES not set in the kernel")
    else:
        known = set(gpu_uuids())
        unknown = [v for v in visible.split(",") if v.startswith("GPU-") and v not in known]
        if unknown:
            problems.append(f"CUDA_VISIBLE_DEVICES names unknown GPUs {unknown}")
    return problems


def rest_slice(server: JupyterServer, kernel_id: str) -> tuple[dict[str, Any] | None, str]:
    """The kernel's slice from ``GET /api/gpupool/kernels/{id}`` and a note when it is missing."""
    status, body = server.gpupool_kernel(kernel_id)
    if status == 200 and isinstance(body, dict):
        return body, ""
    return None, f"GET /api/gpupool/kernels/{kernel_id[:8]} answered {status}"


def slice_server(
    ctx_workdir: Path, slice_bytes: int, name: str, log: Callable[[str], None], **kwargs: Any
) -> JupyterServer:
    """A server whose pool (real NVML inventory, private DB) gives each kernel ``slice_bytes``.

    Fixed slices (``GPUPOOL_BURST=0``) unless ``env`` says otherwise: the slice, watchdog, MPS and
    overhead checks prove what a slice refuses, and the pool's default since 2026-12-01 is elastic
    (burst 4x), which would grow the slice instead of refusing."""
    env = {"GPUPOOL_DEFAULT_MEMORY": str(slice_bytes), "GPUPOOL_BURST": "0"}
    env.update(kwargs.pop("env", {}))
    return JupyterServer(ctx_workdir / name, env=env, log=log, **kwargs)


def poll_until(fn: Callable[[], Any], timeout: float, interval: float = 0.1) -> tuple[Any, float]:
    """Call ``fn`` until it returns something truthy or ``timeout`` passes; return (value, seconds)."""
    start = time.monotonic()
    value = fn()
    while not value and time.monotonic() - start < timeout:
        time.sleep(interval)
        value = fn()
    return value, time.monotonic() - start


def start_raw_holder(nbytes: int, env: dict[str, str], ready: Path, stop: Path, hold: float) -> tuple[subprocess.Popen[bytes], bool]:
    """A process that holds ``nbytes`` of raw ``cuMemAlloc`` (``rawcuda.py alloc``) until ``stop``
    exists or ``hold`` seconds pass, and whether it allocated them (its ``ready`` report, 60 s)."""
    proc = subprocess.Popen(
        [sys.executable, str(RAWCUDA), "alloc", "--bytes", str(nbytes), "--hold", str(hold),
         "--ready-file", str(ready), "--stop-file", str(stop)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    poll_until(ready.exists, timeout=60, interval=0.05)
    return proc, ready.exists() and bool(json.loads(ready.read_text()).get("ok"))
