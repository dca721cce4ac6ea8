"""Check: a plain CUDA process started outside the pool, next to a pooled kernel, is seen by the
server's watchdog through NVML as unpooled use — with its pid and NVML's bytes — in
``GET /api/gpupool/pool``, while the pooled kernel's own memory is not.
"""

from __future__ import annotations

import subprocess
from typing import Any

from ..harness import HarnessError
from ..probe import Probe, first, need_gpu, need_module, need_provisioner, need_server
from ..report import Result
from . import CheckSpec, Context
from .common import GIB, MIB, emit, grant_problems, nvml_process_memory, poll_until, slice_server, start_raw_holder

ROGUE_BYTES = 2 * GIB  # what the process outside the pool takes
KERNEL_RAW = 512 * MIB  # and the pooled kernel, inside its slice


def requires(probe: Probe, options: object) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.libcuda else "libcuda.so.1 not loadable: no raw cuMemAlloc",
        need_server(probe),
        need_provisioner(probe),
        need_module(probe, "jupyter_gpupool.enforcement.unpooled"),
    )


def problems_of(seen: dict[str, Any], interval: float) -> list[str]:
    """What the readings say went wrong (pure; tests/test_gpu_checks.py feeds it readings)."""
    found: list[str] = []
    if seen.get("detect_seconds") is None:
        found.append(f"GET /api/gpupool/pool did not list the process outside the pool within {seen.get('waited_s', '?')} s")
    else:
        reported, expected = int(seen.get("reported") or 0), int(seen.get("nvml_bytes") or 0)
        if abs(reported - expected) > max(64 * MIB, 0.03 * expected):
            found.append(f"the pool says {reported / GIB:.2f} GiB outside the pool, NVML {expected / GIB:.2f} GiB")
        if seen["detect_seconds"] > interval + 1.0:
            found.append(f"seen {seen['detect_seconds']:.1f} s after the allocation, more than the {interval:g} s interval (+1 s)")
    if seen.get("kernel_counted"):
        found.append("the pooled kernel's own memory was counted as unpooled use")
    return found


def run(ctx: Context) -> Result:
    interval = ctx.options.watchdog_interval
    data: dict[str, Any] = {"interval": interval, "rogue_bytes": ROGUE_BYTES}
    problems: list[str] = []
    ready = ctx.workdir / "rogue.ready"
    stop = ctx.workdir / "rogue.stop"
    server = slice_server(ctx.workdir, ctx.options.slice_bytes, "server-unpooled", ctx.log,
                          config={"Watchdog": {"interval": interval, "unpooled_action": "warn"}})
    rogue: subprocess.Popen[bytes] | None = None
    try:
        server.start()
        kid = server.start_kernel()
        kernel = server.connect(kid)
        problems += grant_problems(kernel, ctx.options.slice_bytes)
        res = kernel.run(
            "from gpucheck.rawcuda import Driver\n_gc_drv = Driver(); _gc_drv.primary_context(0); "
            f"_gc_ptr = _gc_drv.mem_alloc({KERNEL_RAW})\n" + emit('{"ok": True}'),
            timeout=60,
        )
        if res.status != "ok":
            return Result.fail(ctx.name, f"the pooled kernel's raw allocation failed: {res.brief()}", **data)
        env = {k: v for k, v in server.env().items() if not k.startswith("GPUPOOL_LEASE")}
        rogue, allocated = start_raw_holder(ROGUE_BYTES, env, ready, stop, hold=90)
        if not allocated:
            return Result.fail(ctx.name, "the process outside the pool could not allocate", **data)

        def seen() -> list[dict] | None:
            status, body = server.api("GET", "/api/gpupool/pool")
            items = (body or {}).get("unpooled") if status == 200 and isinstance(body, dict) else None
            return [u for u in items or [] if u.get("pid") == rogue.pid] or None

        found, latency = poll_until(seen, timeout=interval * 3 + 10, interval=0.2)
        data["waited_s"] = round(latency, 2)
        nvml = nvml_process_memory({rogue.pid, kernel.pid or -1})
        data["nvml_per_pid"] = {str(k): v for k, v in nvml.items()}
        data["nvml_bytes"] = nvml.get(rogue.pid, 0)
        if found:
            data["detect_seconds"] = round(latency, 2)
            data["reported"] = sum(int(u["bytes"]) for u in found)
        _status, body = server.api("GET", "/api/gpupool/pool")
        data["kernel_counted"] = bool(kernel.pid) and any(u.get("pid") == kernel.pid for u in (body or {}).get("unpooled") or [])
        data["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **data)
    finally:
        stop.touch()
        if rogue is not None:
            try:
                rogue.wait(10)
            except subprocess.TimeoutExpired:
                rogue.kill()
        server.stop()
    problems += problems_of(data, interval)
    number = f"seen in {data.get('detect_seconds', '?')} s (interval {interval:g} s)"
    return Result.verdict(ctx.name, problems, number=number, data=data,
                          detail=lambda: f"{data['reported'] / GIB:.2f} GiB outside the pool = NVML; the pooled kernel not counted")


SPEC = CheckSpec(
    name="unpooled",
    title="A CUDA process outside the pool is seen through NVML as unpooled use, with its pid",
    requires=requires,
    run=run,
    timeout=90,
    min_seconds=30,
)
