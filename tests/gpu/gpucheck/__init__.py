"""GPU-only checks of jupyter-gpupool, run end to end by ``tests/gpu/run_all.sh``.

Each check runs in its own process with a deadline, skips with a reason when what it needs
(a GPU, a framework, a tool, the code under test) is missing, and never stops the others.
"""

from __future__ import annotations

__all__ = ["CHECK_NAMES", "GROUPS"]

# The order is the run order: cheap and basic first, so a short budget still says most.
CHECK_NAMES: tuple[str, ...] = (
    "inventory",
    "slices-torch",
    "slices-jax",
    "slices-cupy",
    "watchdog",
    "unpooled",
    "released-held",
    "elastic",
    "device-control",
    "suspend",
    "fast-parking",
    "next-cell",
    "power",
    "overhead",
    "mps",
    "settings",
)

# Names that select several checks in --only/--skip.
GROUPS: dict[str, tuple[str, ...]] = {
    "slices": ("slices-torch", "slices-jax", "slices-cupy"),
}
