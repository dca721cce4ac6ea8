"""Statistics the simulator's modes report (the pool's modes and the oracle alike)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (Σx)² / (n·Σx²): 1 when all equal, 1/n when one gets everything."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    if not xs or squares == 0:
        return 1.0
    return sum(xs) ** 2 / (len(xs) * squares)


__all__ = ["jain_index", "percentile"]
