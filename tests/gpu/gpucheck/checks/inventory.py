"""Check 1: the NVML backend reports each GPU as ``nvidia-smi`` does; MIG mode is read only."""

from __future__ import annotations

from ..probe import first, need_gpu, need_module, nvidia_smi_query
from ..report import Result
from . import CheckSpec, Context, Options

MIB = 1024**2


def requires(probe, options: Options) -> str | None:  # type: ignore[no-untyped-def]
    return first(
        need_gpu(probe),
        None if probe.nvidia_smi else "nvidia-smi not on PATH",
        need_module(probe, "jupyter_gpupool.devices.nvml"),
    )


def run(ctx: Context) -> Result:
    from jupyter_gpupool.devices.nvml import NvmlBackend

    smi_rows = nvidia_smi_query("index,name,uuid,memory.total,mig.mode.current")
    smi = {row[2]: row for row in smi_rows}
    backend = NvmlBackend()
    try:
        devices = backend.devices()
        describe = backend.describe()
        usage = backend.process_usage()
    finally:
        backend.close()
    problems: list[str] = []
    physical = [d for d in devices if not d.is_mig]
    mig_instances = [d for d in devices if d.is_mig]
    if {d.uuid for d in physical} | {d.parent_uuid for d in mig_instances if d.parent_uuid} != set(smi):
        problems.append(f"GPU UUIDs differ: NVML backend {sorted(d.uuid for d in devices)} vs nvidia-smi {sorted(smi)}")
    rows = []
    for device in physical:
        row = smi.get(device.uuid)
        if row is None:
            continue
        index, name, uuid, mem_mib, mig = row
        smi_mig = mig.strip().lower() == "enabled"
        rows.append(
            {
                "uuid": uuid,
                "index": device.index,
                "name": device.name,
                "memory_total": device.memory_total,
                "mig_mode": device.mig_mode,
                "healthy": device.healthy,
            }
        )
        if device.name != name:
            problems.append(f"name {device.name!r} != nvidia-smi {name!r}")
        if str(device.index) != index:
            problems.append(f"index {device.index} != nvidia-smi {index} for {uuid}")
        # nvidia-smi prints whole MiB; NVML gives bytes.
        if mem_mib.isdigit() and abs(device.memory_total // MIB - int(mem_mib)) > 1:
            problems.append(f"memory {device.memory_total // MIB} MiB != nvidia-smi {mem_mib} MiB")
        if mig.strip().lower() in {"enabled", "disabled"} and device.mig_mode != smi_mig:
            problems.append(f"MIG mode {device.mig_mode} != nvidia-smi {mig!r}")
        if not device.healthy:
            problems.append(f"{uuid} reported unhealthy: {device.health_reason}")
    # MIG must be read, never changed: the mode after is the mode before.
    after = {row[2]: row[4] for row in nvidia_smi_query("index,name,uuid,memory.total,mig.mode.current")}
    if after != {u: r[4] for u, r in smi.items()}:
        problems.append(f"MIG mode changed while reading: {after}")
    summary = ", ".join(
        f"{d.name} {d.memory_total / 1024**3:.1f} GiB MIG {'on' if d.mig_mode else 'off'}" for d in physical
    )
    data = {
        "devices": rows,
        "mig_instances": [d.uuid for d in mig_instances],
        "nvidia_smi": smi_rows,
        "backend": describe,
        "processes_seen": len(usage),
    }
    return Result.verdict(ctx.name, problems, number=f"{len(physical)} GPU", data=data,
                          detail=lambda: f"matches nvidia-smi: {summary}; {len(mig_instances)} MIG instances")


SPEC = CheckSpec(
    name="inventory",
    title="NVML backend inventory vs nvidia-smi (MIG mode read only)",
    requires=requires,
    run=run,
    timeout=45,
    min_seconds=10,
)
