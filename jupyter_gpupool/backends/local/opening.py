"""Opening a local pool: where its file is by default, what :meth:`Pool.from_env` makes of the
environment, and the simulated inventory a pool file remembers."""

from __future__ import annotations

import os
from typing import Any

from traitlets.config import Config

from jupyter_gpupool.backends.local.schema import SIMULATED_INVENTORY
from jupyter_gpupool.backends.local.store import Store
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices import DeviceBackend, make_backend
from jupyter_gpupool.devices.base import nvidia_driver_present
from jupyter_gpupool.devices.simulated import SimulatedBackend, usage_dir_for


def default_db_path() -> str:
    """``$GPUPOOL_DB``, else a per-user file in Jupyter's data directory."""
    if os.environ.get("GPUPOOL_DB"):
        return os.environ["GPUPOOL_DB"]
    from jupyter_core.paths import jupyter_data_dir

    return os.path.join(jupyter_data_dir(), "gpupool", "pool.sqlite")


def pool_arguments(config: Config | None, environ: dict[str, str] | None, overrides: dict[str, Any]) -> dict[str, Any]:
    """A :class:`Pool`'s arguments from ``GPUPOOL_SIMULATE`` (inventory; empty → NVML), ``GPUPOOL_DB``
    and the policy variables (``GPUPOOL_DEFAULT_MEMORY``, ``GPUPOOL_IDLE_TIMEOUT``, ...), with ``overrides``."""
    env = dict(os.environ) if environ is None else environ
    policy = overrides.pop("policy", None) or PoolPolicy(config=config)
    policy.apply_env(env)
    chosen_db = overrides.pop("db_path", None) or env.get("GPUPOOL_DB")
    db_path = chosen_db or default_db_path()
    backend = overrides.pop("backend", None)
    if backend is None:
        spec = (env.get("GPUPOOL_SIMULATE") or "").strip() or None
        if spec is None and chosen_db and not nvidia_driver_present():
            # A file named alone opens the pool it was: a simulated one stays simulated. Not on
            # a host with an NVIDIA driver: there the real GPUs are pooled, and NVML watches them.
            spec = Store.recorded_fact(chosen_db, SIMULATED_INVENTORY)
        backend = make_backend(spec)
    if isinstance(backend, SimulatedBackend) and backend.usage_dir is None:
        backend.usage_dir = env.get("GPUPOOL_SIMULATE_USAGE_DIR") or usage_dir_for(db_path)
    return {"backend": backend, "db_path": db_path, "policy": policy, **overrides}


def remember_inventory(backend: DeviceBackend, store: Store) -> None:
    """Record a simulated inventory's spec in the pool file (once; again only if it changes)."""
    spec = getattr(backend, "spec", None) if getattr(backend, "name", "") == "simulated" else None
    if not spec or store.fact(SIMULATED_INVENTORY) == spec:
        return
    with store.transaction():
        store.remember(SIMULATED_INVENTORY, spec)
