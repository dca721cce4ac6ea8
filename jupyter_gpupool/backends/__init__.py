"""Pool backends: where kernels' GPU slices are decided, behind one contract.

- :mod:`.contract`: :class:`PoolBackend`, what every backend promises, and its optional
  :class:`Capability` members;
- :mod:`.factory`: :func:`pool_from_env`, which picks the backend for this process
  (``c.GpuPool.backend``, ``GPUPOOL_BACKEND``, ``GPUPOOL_URL``);
- :mod:`.local`: the single-host pool on its SQLite file; :mod:`.remote`: the broker's client;
  :mod:`.slurm`: kernels as Slurm jobs;
- :mod:`.waiting` (waiting for a grant, shared by all three), :mod:`.discovery` (finding this
  host's broker) and :mod:`.owner` (who a lease is charged to).

Not to be confused with the *device* backends of :mod:`jupyter_gpupool.devices` (NVML or
simulated GPUs), which a pool backend reads through its ``backend`` attribute.
"""

from __future__ import annotations

# Only the contract here: importing one backend's module (or the kernel side's wake-ups) loads
# no other backend. The factory is ``jupyter_gpupool.backends.factory``.
from jupyter_gpupool.backends.contract import (
    CAPABILITY_MEMBERS,
    Capability,
    ElasticBackend,
    PoolBackend,
    SuspendingBackend,
    supports,
)

__all__ = ["CAPABILITY_MEMBERS", "Capability", "ElasticBackend", "PoolBackend", "SuspendingBackend", "supports"]
