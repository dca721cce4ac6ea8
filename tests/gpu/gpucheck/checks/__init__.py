"""The checks: what each needs (``requires``), how long it may take, and how it runs."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..probe import Probe
from ..report import Result

GIB = 1024**3


@dataclass
class Options:
    """What the command line sets for the checks (passed to each check's process as JSON)."""

    slice_bytes: int = 4 * GIB
    ckpt_gib: float = 8.0
    repeats: int = 5
    watchdog_interval: float = 2.0
    out_dir: str | None = None
    settings_before: dict[str, Any] | None = None  # GPU settings read before the first check

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Options:
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass
class Context:
    """Handed to a running check: options, the probe, a scratch folder and a logger."""

    name: str
    options: Options
    probe: Probe
    workdir: Path
    notes: list[str] = field(default_factory=list)

    def log(self, message: str) -> None:
        print(f"[{self.name}] {message}", flush=True)

    @classmethod
    def make(cls, name: str, options: Options, probe: Probe) -> Context:
        root = os.environ.get("GPUCHECK_WORKDIR") or tempfile.mkdtemp(prefix=f"gpucheck-{name}-")
        path = Path(root)
        path.mkdir(parents=True, exist_ok=True)
        return cls(name=name, options=options, probe=probe, workdir=path)


@dataclass(frozen=True)
class CheckSpec:
    """One row of the table."""

    name: str
    title: str
    requires: Callable[[Probe, Options], str | None]
    run: Callable[[Context], Result]
    timeout: float  # seconds the check may take at most
    min_seconds: float  # not started with less budget left than this


EXTRA_ENV = "GPUCHECK_EXTRA_CHECKS"


def _extra_specs() -> list[CheckSpec]:
    """Checks from the module named by $GPUCHECK_EXTRA_CHECKS (its ``SPECS``), run after ours.

    Only the runner's own tests use it (``gpucheck.selftest``: checks that hang, crash or leave
    a process behind), to prove that one check's failure never stops the others.
    """
    name = os.environ.get(EXTRA_ENV, "").strip()
    if not name:
        return []
    import importlib

    return list(importlib.import_module(name).SPECS)


def all_check_names() -> tuple[str, ...]:
    """Run order: the GPU checks, then any extra ones."""
    from .. import CHECK_NAMES

    return CHECK_NAMES + tuple(spec.name for spec in _extra_specs())


def registry() -> dict[str, CheckSpec]:
    """All checks by name (imports the check modules, which import no framework at load time)."""
    from . import (
        devicectl,
        elastic,
        fastpark,
        inventory,
        mps,
        nextcell,
        overhead,
        power,
        released,
        settings,
        slices,
        suspend,
        unpooled,
        watchdog,
    )

    specs = [
        inventory.SPEC,
        *slices.SPECS,
        watchdog.SPEC,
        unpooled.SPEC,
        released.SPEC,
        elastic.SPEC,
        devicectl.SPEC,
        suspend.SPEC,
        fastpark.SPEC,
        nextcell.SPEC,
        power.SPEC,
        overhead.SPEC,
        mps.SPEC,
        settings.SPEC,
        *_extra_specs(),
    ]
    return {spec.name: spec for spec in specs}
