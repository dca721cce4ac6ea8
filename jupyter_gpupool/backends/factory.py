"""Which pool backend this process uses: this host's GPUs (the default), a broker (``GPUPOOL_URL``, else
the one this host's discovery file names) or Slurm.

``c.GpuPool.backend = "slurm"`` (or ``GPUPOOL_BACKEND=slurm``) makes kernels run as Slurm jobs on
GPU shards; see docs/hpc.md.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

from traitlets import Enum
from traitlets.config import Configurable

from jupyter_gpupool.backends.contract import PoolBackend
from jupyter_gpupool.backends.discovery import broker_pool, find_broker
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.backends.slurm.pool import SlurmPool
from jupyter_gpupool.errors import InvalidInput

BACKENDS = ("local", "slurm")

log = logging.getLogger(__name__)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it (a server retries its pool)."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    log.warning("%s", message)


class GpuPool(Configurable):
    """The backend every pool client in this process uses."""

    backend = Enum(
        ["", *BACKENDS],
        "",
        config=True,
        help="Where kernels get their GPU slices: 'local' (this host's GPUs, or a broker: the one at $GPUPOOL_URL, else the one this host's trusted discovery file names) or 'slurm' "
        "(each kernel a Slurm job with a GRES shard/gpu request; c.SlurmPool.*). Empty: $GPUPOOL_BACKEND, else 'local'.",
    )


def selected_backend(config: Any = None, environ: Mapping[str, str] | None = None) -> str:
    """``c.GpuPool.backend``, else ``$GPUPOOL_BACKEND``, else ``local``; a bad name is an InvalidInput."""
    env = os.environ if environ is None else environ
    name = ""
    if config is not None:
        try:
            name = str(GpuPool(config=config).backend or "")
        except Exception as err:  # noqa: BLE001 - traitlets' TraitError: say it in one line
            raise InvalidInput(f"c.GpuPool.backend: expected one of {', '.join(BACKENDS)} ({err})") from None
    name = name or (env.get("GPUPOOL_BACKEND") or "").strip().lower() or "local"
    if name not in BACKENDS:
        raise InvalidInput(f"GPUPOOL_BACKEND={name!r} is not a backend; use one of {', '.join(BACKENDS)}")
    return name


def backend_provisioner(config: Any = None, environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(entry point name, ``module:Class``) of the provisioner the selected backend's kernels use;
    the single-host one when the selection is invalid (the pool then reports why it is unavailable)."""
    try:
        slurm = selected_backend(config, environ) == "slurm"
    except InvalidInput:
        slurm = False
    if slurm:
        return "gpupool-slurm-provisioner", "jupyter_gpupool.provisioner:SlurmProvisioner"
    return "gpupool-provisioner", "jupyter_gpupool.provisioner:GpuPoolProvisioner"


def pool_from_env(
    config: Any = None,
    environ: Mapping[str, str] | None = None,
    check: bool = False,
    discover: bool = True,
    on_ignored: Callable[[str], None] | None = None,
) -> PoolBackend:
    """:class:`RemotePool` when ``GPUPOOL_URL`` is set or (``discover``, and no ``GPUPOOL_*`` variable
    chooses a pool) this host's discovery file names a broker, else :meth:`Pool.from_env`. No
    fallback: with a broker chosen, an unreachable one raises PoolUnavailable (at once with
    ``check``, else on first use); so does an unreadable discovery file."""
    env = os.environ if environ is None else environ
    if selected_backend(config, env) == "slurm":  # kernels as Slurm jobs (docs/hpc.md)
        return SlurmPool.from_env(config=config, environ=env)
    # A host with a broker has one set of books: a process that chose no pool never opens a file beside it.
    found = find_broker(env, on_ignored=on_ignored or warn_once) if discover else None
    if found is not None or (env.get("GPUPOOL_URL") or "").strip():
        remote: RemotePool = broker_pool(found, env) if found is not None else RemotePool.from_env(env)
        return remote.check() if check else remote
    return Pool.from_env(config=config, environ=dict(env))


__all__ = [
    "BACKENDS",
    "GpuPool",
    "backend_provisioner",
    "pool_from_env",
    "selected_backend",
    "warn_once",
]
