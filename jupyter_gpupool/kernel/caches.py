"""Free the frameworks' cached GPU memory before a checkpoint, so only live bytes are parked.

PyTorch's caching allocator and CuPy's memory pools keep freed blocks reserved on the GPU for
reuse; a checkpoint would copy them to host RAM and back for nothing. Before it parks a kernel,
the server asks the kernel (on the quiet channel, see :mod:`jupyter_gpupool.quiet`: not a cell,
not activity) to give those blocks back to the driver. Only frameworks the kernel already
imported are touched, and only when they already use the GPU: this never initialises CUDA.
JAX allocates from its own preallocated arena that it does not hand back while the process
lives; what it allows is dropping its compilation caches (``jax.clear_caches()``), which is done.

Other frameworks can add their own with :func:`register_cache_freer`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

#: A framework's freer: frees what it can, returns ``{"freed": bytes, "held": bytes}`` (either may be
#: absent), or None when the framework is not in use in this kernel.
CacheFreer = Callable[[], "dict[str, int] | None"]

_extra: dict[str, CacheFreer] = {}
_lock = threading.Lock()
#: How many times this kernel was asked to free its caches (``%gpupool status`` and tests read it).
requests_served = 0


def register_cache_freer(name: str, freer: CacheFreer) -> None:
    """Run ``freer`` with the built-in ones before each checkpoint (a later one of the same name replaces it)."""
    with _lock:
        _extra[name] = freer


def _torch() -> dict[str, int] | None:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available() or not cuda.is_initialized():
        return None
    devices = range(cuda.device_count())
    before = sum(int(cuda.memory_reserved(d)) for d in devices)
    cuda.empty_cache()
    after = sum(int(cuda.memory_reserved(d)) for d in devices)
    return {"freed": max(0, before - after), "held": sum(int(cuda.memory_allocated(d)) for d in devices)}


def _cupy() -> dict[str, int] | None:
    cupy = sys.modules.get("cupy")
    if cupy is None or not hasattr(cupy, "get_default_memory_pool"):
        return None
    pool = cupy.get_default_memory_pool()
    before = int(pool.total_bytes())
    pool.free_all_blocks()
    with contextlib.suppress(Exception):  # the pinned host pool: not GPU memory, but the same idea
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return {"freed": max(0, before - int(pool.total_bytes())), "held": int(pool.used_bytes())}


def _jax() -> dict[str, int] | None:
    jax = sys.modules.get("jax")
    clear = getattr(jax, "clear_caches", None)
    if not callable(clear):
        return None
    clear()
    return {"freed": 0}


BUILT_IN: dict[str, CacheFreer] = {"torch": _torch, "cupy": _cupy, "jax": _jax}


def free_framework_caches(_request: dict[str, Any] | None = None) -> dict[str, Any]:
    """Free every imported framework's cached GPU memory; ``{"freed": bytes, "held": bytes or None,
    "frameworks": {name: {...} or {"error": ...}}}``. A framework that fails is reported, not raised."""
    global requests_served
    with _lock:
        freers = {**BUILT_IN, **_extra}
        requests_served += 1
    report: dict[str, Any] = {}
    freed, held, known = 0, 0, False
    for name, freer in freers.items():
        try:
            result = freer()
        except Exception as err:  # noqa: BLE001 -- one framework's trouble must not stop the others or the suspend
            report[name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
            continue
        if result is None:
            continue
        report[name] = dict(result)
        freed += int(result.get("freed", 0) or 0)
        if "held" in result:
            held += int(result["held"] or 0)
            known = True
    return {"freed": freed, "held": held if known else None, "frameworks": report}


__all__ = ["BUILT_IN", "free_framework_caches", "register_cache_freer", "requests_served"]
