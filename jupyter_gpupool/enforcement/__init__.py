"""Enforcement: keeping each kernel inside its slice, as hard as the hardware allows.

- :mod:`.plan`: which mechanisms a kernel gets (MIG, MPS, HAMi-core, framework caps) and the
  environment that sets them up;
- :mod:`.caps`: the framework caps, applied inside the kernel (PyTorch, TensorFlow, CuPy, JAX);
- :mod:`.watchdog`: the NVML watchdog, always on, that acts on use over a slice;
- :mod:`.unpooled`: which lease each process on the GPUs belongs to, and the memory held outside the pool.
"""

from __future__ import annotations

from jupyter_gpupool.enforcement.plan import EnforcementConfig, EnforcementPlan, EnforcementSettings, plan_enforcement

__all__ = ["EnforcementConfig", "EnforcementPlan", "EnforcementSettings", "plan_enforcement"]
