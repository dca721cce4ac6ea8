"""Check: a suspended kernel's next cell on a free GPU, through the server's own path. A PyTorch
kernel started by a real ``jupyter_server`` (the pool's extension on NVML) holds ``--ckpt-gib``
(8) GiB of seeded int32 tensors; ``POST /api/gpupool/kernels/{id}/suspend`` (what the lab extension's
Suspend) has the server park it (docs/suspend.md: torch-memory-saver's fast path, the driver
checkpoint for the rest), and once NVML shows its memory freed the next cell is sent on the
kernel's channels. That cell waits in the kernel's resume hook for the server's restore, then
prints the tensors' sum. Goal (docs/suspend.md, "At once, not on the next tick": the cell waits
for the copy only): its output arrives within 1 s + the copy time, the copy time being the
tensors' size over the pinned host-to-device speed measured in the kernel in the same run. The
sum must equal the one taken before the suspend, and every tensor is then compared bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..harness import HarnessError, KernelSession
from ..probe import Probe, first, need_checkpoint_api, need_framework, need_gpu, need_provisioner, need_server
from ..report import Result
from . import CheckSpec, Context, Options
from .common import (
    GIB,
    PINNED_LINK_SPEED,
    emit,
    nvml_process_memory,
    poll_until,
    regenerated_identical,
    seeded_tensors,
    slice_server,
)

OVERHEAD_S = 1.0  # what the next cell may take besides the copy
HEADROOM = 4 * GIB  # the slice: the tensors plus this (the context, the pinned-copy buffer)
SUSPEND_TIMEOUT_S = 60.0  # for the lease to say suspended (the first fast park pins its backup)
FREED_TIMEOUT_S = 10.0  # then for NVML to show the kernel's memory gone
NEXT_CELL_TIMEOUT_S = 30.0  # for the next cell to end (its output is due within seconds)
SEED = 4321  # the tensors' (drawn again to compare them)


def fill_cell(gib: float) -> str:
    """``gib`` GiB of seeded int32 tensors (1 GiB each, the last smaller) and their int64 sum; then
    the pinned host link as the kernel sees it (a 1 GiB buffer each way, freed again)."""
    return f"""
{seeded_tensors(gib, SEED)}_gc_sum = sum(int(t.sum(dtype=torch.int64)) for t in _gc_x)
{PINNED_LINK_SPEED}{emit('{"sum": _gc_sum, "tensors": len(_gc_x), "h2d": _h2d, "d2h": _d2h, "reserved": int(torch.cuda.memory_reserved())}')}
"""


# The timed cell: its first CUDA use needs the tensors back. Flushed, so the output leaves at once.
NEXT_CELL = f"""
{emit('{"sum": sum(int(t.sum(dtype=torch.int64)) for t in _gc_x)}')}
import sys; sys.stdout.flush()
"""

# Bit for bit: regenerate every tensor from its seed and compare exactly (not timed).
VERIFY_CELL = f"""
{regenerated_identical(SEED)}torch.cuda.empty_cache()
{emit('{"identical": bool(_gc_identical)}')}
"""


@dataclass(frozen=True)
class Cells:
    """The kernel code the check runs (the tests swap in a simulated pool's)."""

    fill: Callable[[float], str] = fill_cell
    next: str = NEXT_CELL
    verify: str = VERIFY_CELL


@dataclass(frozen=True)
class Host:
    """Where the check reads the GPU: NVML here; the tests give a simulated pool's readings."""

    process_memory: Callable[[set[int]], dict[int, int]] = nvml_process_memory
    server_env: dict[str, str] = field(default_factory=dict)
    server_config: dict[str, Any] = field(default_factory=dict)


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        need_checkpoint_api(probe),
        need_framework(probe, "torch"),
        need_framework(probe, "torch_memory_saver"),
        need_server(probe),
        need_provisioner(probe),
    )


# --- the verdict (pure; tests/test_gpu_checks.py feeds it passing and failing readings) ------------


def copy_seconds(gib: float, restore_gbps: float) -> float:
    """The copy the next cell must wait for: ``gib`` GiB at ``restore_gbps`` GB/s."""
    return gib * GIB / (restore_gbps * 1e9)


def limit_seconds(gib: float, restore_gbps: float) -> float:
    """The goal: the copy and at most OVERHEAD_S besides."""
    return OVERHEAD_S + copy_seconds(gib, restore_gbps)


def problems_of(elapsed: float | None, gib: float, restore_gbps: float, output_ok: bool, suspended_ok: bool) -> list[str]:
    """What went wrong: the kernel was not parked (NVML; then no next cell was sent, and nothing else
    is judged), the next cell's output came later than 1 s + the copy (or never), or it was wrong
    (tensors changed). Empty when the check passes."""
    if not suspended_ok:
        return ["the kernel was not suspended with its GPU memory freed (NVML) before the next cell"]
    found: list[str] = []
    if restore_gbps <= 0:
        found.append("no restore speed was measured, so the copy time is unknown")
    elif elapsed is None:
        found.append("the next cell printed no output")
    elif elapsed > limit_seconds(gib, restore_gbps):
        found.append(
            f"the next cell's output came {elapsed:.2f} s after it was sent, past {OVERHEAD_S:g} s + the copy "
            f"({copy_seconds(gib, restore_gbps):.2f} s for {gib:g} GiB at {restore_gbps:.1f} GB/s) = "
            f"{limit_seconds(gib, restore_gbps):.2f} s"
        )
    if elapsed is not None and not output_ok:
        found.append("the next cell's output was wrong: the tensors changed across the suspend")
    return found


# --- the check --------------------------------------------------------------------------------------


def run(ctx: Context) -> Result:
    return measure(ctx)


def _lease(server: Any, kernel_id: str) -> dict[str, Any]:
    status, body = server.gpupool_kernel(kernel_id)
    return body if status == 200 and isinstance(body, dict) else {}


def suspend_through_the_server(server: Any, kernel_id: str, pid: int, held: int, seen: dict[str, Any],
                               host: Host) -> bool:
    """``POST .../suspend``, then wait for the lease to say suspended and for the process's memory to
    be gone (at most 5 % of ``held`` left, as the GPU shows it). Records what it saw in ``seen``."""
    code, body = server.api("POST", f"/api/gpupool/kernels/{kernel_id}/suspend", {})
    if code != 200:
        seen["suspend_refused"] = f"{code}: {(body or {}).get('message') if isinstance(body, dict) else body}"
        return False
    asked = time.monotonic()
    lease, _ = poll_until(
        lambda: (b := _lease(server, kernel_id)).get("state") == "suspended" and not b.get("transition") and b,
        timeout=SUSPEND_TIMEOUT_S, interval=0.1,
    )
    seen["suspend_s"] = round(time.monotonic() - asked, 2)
    if not lease:
        seen["state_seen"] = _lease(server, kernel_id).get("state")
        return False
    parking = lease.get("parking") or {}
    seen.update(parked_memory=lease.get("parked_memory"), parked_by=parking.get("path"), path_note=parking.get("path_note"))
    freed, _ = poll_until(lambda: host.process_memory({pid}).get(pid, 0) <= 0.05 * held, timeout=FREED_TIMEOUT_S)
    seen["held_while_suspended"] = host.process_memory({pid}).get(pid, 0)
    return bool(freed)


def next_cell(server: Any, kernel: KernelSession, code: str, seen: dict[str, Any]) -> Any:
    """Send ``code`` and time from sending to its MARKER output; returns what it printed (None when
    nothing came within NEXT_CELL_TIMEOUT_S: then the server's and the kernel's stacks go into the
    log). Records the seconds and the cell's status in ``seen``."""
    sent = time.monotonic()
    try:
        result = kernel.collect(kernel.submit(code), timeout=NEXT_CELL_TIMEOUT_S)
    except HarnessError as exc:
        server.dump_stacks(kernel.pid or -1)
        seen["next_cell_status"] = f"{exc} (stacks of the server and the kernel are in checks.log)"
        seen["next_cell_s"] = None
        return None
    seen["next_cell_status"] = result.brief()
    seen["next_cell_s"] = None if result.marked_at is None else round(result.marked_at - sent, 3)
    seen["next_cell_done_s"] = round(time.monotonic() - sent, 3)  # its reply and idle status too
    return result.data[-1] if result.ok and result.data else None


def server_restore_seconds(server: Any) -> float | None:
    """The server's own count of its restore (``gpupool_restore_seconds`` on its ``/metrics``: from
    the resumed kernel's grant to the restore confirmed), when it counted exactly one."""
    try:
        status, text = server.api("GET", "/metrics", timeout=10)
    except OSError:
        return None
    found = dict(line.split(" ", 1) for line in str(text).splitlines() if line.startswith("gpupool_restore_seconds_"))
    if status != 200 or found.get("gpupool_restore_seconds_count", "").strip() not in ("1", "1.0"):
        return None
    return round(float(found["gpupool_restore_seconds_sum"]), 3)


def describe(seen: dict[str, Any]) -> str:
    """The detail: what was parked, by which path, and how the output compared."""
    gbps = float(seen.get("restore_gbps") or 0.0)
    copy = copy_seconds(seen["tensor_gib"], gbps) if gbps > 0 else 0.0
    if seen.get("suspend_refused"):
        parked = f"suspend refused ({seen['suspend_refused']})"
    elif "held_while_suspended" not in seen:
        parked = f"still {seen.get('state_seen')} {seen.get('suspend_s')} s after the suspend was asked"
    else:
        parked = (f"parked by {seen.get('parked_by') or '?'} in {seen.get('suspend_s')} s, "
                  f"{int(seen['held_while_suspended']) / GIB:.2f} GiB left (NVML)")
        parked += f" ({seen['path_note']})" if seen.get("path_note") else ""
    output = (f"sum {'equal to' if seen.get('summed') else 'not'} the one before, tensors bit-identical {seen.get('identical')}"
              if seen.get("printed") is not None else f"next cell: {seen.get('next_cell_status', 'not sent')}")
    restore = seen.get("server_restore_s")
    restored = f", the server's restore {restore:.2f} s (its /metrics)" if restore is not None else ""
    return f"{output}; copy {copy:.2f} s at the pinned {gbps:.1f} GB/s{restored}; {parked}"


def measure(ctx: Context, cells: Cells = Cells(), host: Host = Host()) -> Result:  # frozen defaults: one shared instance is safe
    """Fill, suspend through the server, send the next cell: the readings and the verdict."""
    gib = ctx.options.ckpt_gib
    seen: dict[str, Any] = {"tensor_gib": gib, "overhead_s": OVERHEAD_S, "restore_gbps": 0.0}
    slice_bytes = int(gib * GIB) + HEADROOM
    server = slice_server(ctx.workdir, slice_bytes, "server-next-cell", ctx.log, env=host.server_env, config=host.server_config)
    suspended_ok = False
    try:
        server.start()
        kid = server.start_kernel()
        kernel = server.connect(kid)
        pid = kernel.pid or -1
        filled = kernel.run(cells.fill(gib), timeout=90)
        if not filled.ok or not filled.data:
            return Result.fail(ctx.name, f"could not put {gib:g} GiB of tensors in the kernel: {filled.brief()}", **seen)
        seen["fill"] = fill = filled.last()
        seen["restore_gbps"] = float(fill["h2d"]) / 1e9
        seen["held_before"] = held = host.process_memory({pid}).get(pid, 0)
        if held <= 0:
            return Result.fail(ctx.name, "the GPU lists no memory for the kernel process: nothing to suspend", **seen)
        suspended_ok = suspend_through_the_server(server, kid, pid, held, seen, host)
        ctx.log(f"suspended: {suspended_ok} after {seen.get('suspend_s')} s, parked by {seen.get('parked_by')}, "
                f"{int(seen.get('held_while_suspended') or 0) / GIB:.2f} GiB left")
        if suspended_ok:  # else nothing is sent: a cell would wait for a suspend that never ended
            seen["printed"] = printed = next_cell(server, kernel, cells.next, seen)
            ctx.log(f"next cell: output after {seen.get('next_cell_s')} s ({seen.get('next_cell_status')})")
            if printed is not None:
                seen["summed"] = printed.get("sum") == fill["sum"]
                seen["state_after"] = _lease(server, kid).get("state")
                seen["server_restore_s"] = server_restore_seconds(server)  # the restore's share of the wait
                verify = kernel.run(cells.verify, timeout=60)
                seen["identical"] = bool(verify.ok and verify.data and verify.last().get("identical"))
        seen["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **seen)
    finally:
        server.stop()
    elapsed = seen.get("next_cell_s")
    gbps = seen["restore_gbps"]
    output_ok = bool(seen.get("summed") and seen.get("identical"))
    problems = problems_of(elapsed, gib, gbps, output_ok, suspended_ok)
    limit = f"{limit_seconds(gib, gbps):.2f}" if gbps > 0 else "-"
    number = f"{'-' if elapsed is None else f'{elapsed:.2f}'} s for {gib:g} GiB (limit {limit} s)"
    detail = describe(seen)
    return Result.verdict(ctx.name, problems, number=number, detail=detail, data=seen, noted="; " + detail)


SPEC = CheckSpec(
    name="next-cell",
    title="A suspended kernel's next cell on a free GPU: its output within 1 s + the copy, through the server",
    requires=requires,
    run=run,
    timeout=120,
    min_seconds=45,
)

__all__ = ["SPEC"]
