"""Last check: the run changed none of the GPU's settings (compute mode, MIG mode, persistence,
application clocks) and left no GPU process behind."""

from __future__ import annotations

from typing import Any

from ..probe import Probe, first, need_gpu, nvidia_smi_query
from ..report import Result
from . import CheckSpec, Context, Options

FIELDS = (
    "compute_mode",
    "mig.mode.current",
    "persistence_mode",
    "clocks.applications.graphics",
    "clocks.applications.memory",
)


def read_settings() -> dict[str, Any]:
    """The settings of every GPU, keyed by UUID, and how many compute processes run."""
    rows = nvidia_smi_query("uuid," + ",".join(FIELDS))
    gpus = {row[0]: dict(zip(FIELDS, row[1:])) for row in rows}
    return {"gpus": gpus, "compute_processes": _compute_pids()}


def _compute_pids() -> list[int]:
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        pids: set[int] = set()
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pids.update(int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
        return sorted(pids)
    finally:
        pynvml.nvmlShutdown()


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.nvidia_smi else "nvidia-smi not on PATH",
    )


def run(ctx: Context) -> Result:
    before = ctx.options.settings_before or {}
    if not before:
        return Result.fail(ctx.name, "no settings were read before the first check")
    if "error" in before:
        return Result.fail(ctx.name, f"could not read the settings before the run: {before['error']}")
    after = read_settings()
    changed = []
    for uuid, fields in before.get("gpus", {}).items():
        now = after["gpus"].get(uuid, {})
        changed += [f"{uuid[:12]} {k}: {v} -> {now.get(k)}" for k, v in fields.items() if now.get(k) != v]
    leaked = sorted(set(after["compute_processes"]) - set(before.get("compute_processes", [])))
    data = {"before": before, "after": after}
    problems = []
    if changed:
        problems.append("GPU settings changed: " + "; ".join(changed))
    if leaked:
        problems.append(f"GPU processes left behind: pids {leaked}")
    summary = ", ".join(f"{k}={v}" for k, v in next(iter(after["gpus"].values()), {}).items())
    return Result.verdict(ctx.name, problems, number=f"{len(changed)} changed", data=data,
                          detail=f"unchanged ({summary}); no GPU process left")


SPEC = CheckSpec(
    name="settings",
    title="GPU settings untouched and no GPU process left behind",
    requires=requires,
    run=run,
    timeout=30,
    min_seconds=3,
)
