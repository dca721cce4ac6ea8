"""IPython extension loaded in pooled kernels (``--ext=jupyter_gpupool.kernel``).

On load it caps PyTorch / TensorFlow / CuPy at this kernel's slice when they are imported
(see :mod:`.caps`), adds a hint to out-of-memory errors, registers the ``%gpupool``
magic, makes a cell wait while the kernel is suspended (see :mod:`.resume`), and answers the
server's quiet requests (freeing framework caches before a checkpoint:
:func:`~jupyter_gpupool.enforcement.caps.free_framework_caches`). The pool
itself is opened only when a cell, a magic or the widget needs it, so the kernel starts as
fast as without the extension.

Load it by hand in any IPython session with ``%load_ext jupyter_gpupool.kernel``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jupyter_gpupool.enforcement.caps import FrameworkCaps
    from jupyter_gpupool.kernel.client import PoolClient
    from jupyter_gpupool.kernel.parking import FrameworkParking

# In-function imports: the parts are imported when first used, so a kernel that only reads this
# package's ``autolease`` module at start (and stands aside) pays nothing for the rest.
_state: dict[str, Any] = {}


def __getattr__(name: str) -> Any:
    if name == "FrameworkCaps":
        from jupyter_gpupool.enforcement.caps import FrameworkCaps

        return FrameworkCaps
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_caps() -> FrameworkCaps:
    """The caps of this process (created from ``GPUPOOL_MEMORY_LIMIT`` on first use)."""
    from jupyter_gpupool.enforcement.caps import FrameworkCaps

    caps = _state.get("caps")
    if caps is None:
        caps = _state["caps"] = FrameworkCaps.from_env()
    return caps


def get_parking() -> FrameworkParking:
    """What this kernel's start found about parking its PyTorch memory itself (see :mod:`.parking`)."""
    from jupyter_gpupool.kernel.parking import FrameworkParking

    parking = _state.get("parking")
    if parking is None:
        parking = _state["parking"] = FrameworkParking()
    return parking


def get_client() -> PoolClient:
    """This kernel's pool client, shared by the magics and the widget."""
    from jupyter_gpupool.kernel.client import connect

    client = _state.get("client")
    if client is None:
        client = _state["client"] = connect(caps=get_caps())
    return client


def load_ipython_extension(ipython: Any) -> None:
    """Install the framework caps, the out-of-memory hint, the ``%gpupool`` magic and the waiting cell."""
    from jupyter_gpupool.kernel.activity import ActivityReporter
    from jupyter_gpupool.kernel.magics import GpuPoolMagics
    from jupyter_gpupool.kernel.resume import ResumeOnRun

    if _state.get("shell") is ipython:
        return
    caps = get_caps()
    caps.install(ipython)
    if os.environ.get("GPUPOOL_LEASE_ID"):
        caps.oom.grow = _grow_slice
    if os.environ.get("GPUPOOL_SIMULATE"):  # pretend_to_use then fails past the slice as a framework cap would
        from jupyter_gpupool.devices import simulated

        simulated.kernel_hooks.update(caps_limit=lambda: get_caps().limit, grow=_grow_slice)
    ipython.register_magics(GpuPoolMagics(ipython, client_factory=get_client, parking_line=lambda: get_parking().line()))
    _state["shell"] = ipython
    waiting = _state["resume"] = ResumeOnRun(get_client)  # costs nothing until the kernel has a lease
    waiting.start(ipython)
    parking = get_parking()
    parking.start(caps.finder.register, ipython)  # before the kernel's first allocation: the region covers only later ones
    _answer_quiet_requests(ipython)
    if os.environ.get("GPUPOOL_LEASE_ID"):
        reporter = _state["activity"] = ActivityReporter(lambda: get_client().lease_id, lambda: get_client().pool)
        reporter.start(ipython)


def _answer_quiet_requests(ipython: Any) -> None:
    """Let the server reach this kernel on the quiet channel (control, not a cell, no activity):
    ``free_caches`` before a checkpoint, ``set_caps`` when its slice grew or shrank, and the framework
    parking path's ``parking_probe``, ``park_framework`` and ``unpark_framework``."""
    from jupyter_gpupool.enforcement.caps import free_framework_caches
    from jupyter_gpupool.quiet import install_quiet_requests

    install_quiet_requests(
        getattr(ipython, "kernel", None),
        {
            "free_caches": free_framework_caches,
            "set_caps": get_caps().move_live,
            "kernel_status": _own_kernel_status,
            **get_parking().actions(),
        },
    )


def _own_kernel_status(content: dict[str, Any]) -> dict[str, Any]:
    """This kernel's ``GET /api/gpupool/kernels/{id}`` body from its own pool (``kernel``), or None
    with why (``message``): a server whose kernels run on a gateway asks, since the gateway host's
    pool, not the server's, holds the lease."""
    import time

    from jupyter_gpupool.enforcement.plan import EnforcementSettings
    from jupyter_gpupool.rest.views import kernel_status

    client = get_client()
    lease_id = client.lease_id
    if not lease_id:
        why = os.environ.get("GPUPOOL_UNAVAILABLE") or "it was not started through the GPU pool"
        return {"kernel": None, "message": f"this kernel has no GPU slice: {why}"}
    pool = client.pool
    lease = pool.get(lease_id)
    kernel_id = os.environ.get("GPUPOOL_KERNEL_ID") or lease.kernel_id or ""
    body = kernel_status(pool, kernel_id, lease, EnforcementSettings().to_config(), lease.owner, time.time())
    return {"kernel": body}


def _grow_slice(needed: int) -> int:
    """Ask the pool to grow this kernel's slice to hold ``needed`` bytes; its new size per GPU."""
    return get_client().grow(needed).memory


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the import hooks, the OOM hint, the magic and the waiting cell; close the pool client."""
    for name in ("activity", "resume"):
        hook = _state.pop(name, None)
        if hook is not None:
            hook.stop(ipython)
    handlers = getattr(getattr(ipython, "kernel", None), "control_handlers", None)
    if isinstance(handlers, dict):
        from jupyter_gpupool.quiet import QUIET_REQUEST

        handlers.pop(QUIET_REQUEST, None)
    parking = _state.pop("parking", None)
    if parking is not None:
        parking.stop(ipython)
    caps = _state.pop("caps", None)
    if caps is not None:
        caps.uninstall()
    client = _state.pop("client", None)
    if client is not None:
        client.close()
    _state.pop("shell", None)
    line_magics = ipython.magics_manager.magics.get("line", {})
    line_magics.pop("gpupool", None)


__all__ = ["FrameworkCaps", "get_caps", "get_client", "get_parking", "load_ipython_extension", "unload_ipython_extension"]
