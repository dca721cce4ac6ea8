"""Check: elastic growth in PyTorch. A kernel on a 4 GiB guarantee (burst limit 32 GiB) allocates
12 GiB more with PyTorch: its slice is grown (ahead of need by the watchdog, or on the framework
cap's out-of-memory error, which says "re-run the cell") and the kernel keeps running with its
tensors. It then drops them; PyTorch's cache keeps the memory, so NVML still shows it held. A
second kernel asks for all of the GPU but twice the guarantee: it fits only once the first gives its
burst back. The server must empty the first kernel's framework cache and lower its cap, and the
room must be back as NVML shows it, judged by the rule every burst take-back is held to: within
``burst_settle`` + one watchdog interval of the request (docs/scheduling.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..harness import HarnessError, KernelSession
from ..probe import Probe, first, need_framework, need_gpu, need_module, need_provisioner, need_server
from ..report import Result, Status
from . import CheckSpec, Context, Options
from .common import GIB, MIB, emit, gpu_total_memory, grant_problems, nvml_process_memory, slice_server

GUARANTEE = 4 * GIB  # what kernel A asks for
BURST_LIMIT = 32 * GIB  # how far its slice may grow
KEEP = 1 * GIB  # tensors A keeps throughout (its work, which must survive everything)
BURST_USE = 12 * GIB  # what A allocates past its guarantee
BURST_SETTLE = 15.0  # c.PoolPolicy.burst_settle: the policy default, set explicitly
GROW_TRIES = 4  # a cell refused with "re-run the cell" is re-run at most this often
BIG_SPEC = "gpucheck-big"  # kernel B's kernelspec: a slice of all but 2 x GUARANTEE

# Allocates KEEP once and then 1 GiB chunks up to BURST_USE; idempotent, so a cell the cap refused
# ("the slice was grown ...: re-run the cell") is simply run again and goes on where it stopped.
GROW_CELL = f"""
import torch, jupyter_gpupool.kernel as _gc_kernel
if "_gc_keep" not in globals():
    _gc_keep = torch.full(({KEEP} // 4,), 7, dtype=torch.int32, device="cuda")
_gc_burst = globals().get("_gc_burst") or []
while sum(t.numel() * 4 for t in _gc_burst) < {BURST_USE}:
    _gc_burst.append(torch.full((2**28,), 3, dtype=torch.int32, device="cuda"))
torch.cuda.synchronize()
_gc_ok = bool(all(int(t[::4096].sum()) == 3 * (2**28 // 4096) for t in _gc_burst)) and int(_gc_keep[::4096].sum()) == 7 * (_gc_keep.numel() // 4096)
{emit('{"ok": _gc_ok, "caps_limit": _gc_kernel.get_caps().limit, "reserved": int(torch.cuda.memory_reserved())}')}
"""

# Drops the burst tensors but not PyTorch's cache: NVML still shows them held until the server
# has the kernel free its caches.
DROP_CELL = f"""
del _gc_burst
import gc; gc.collect()
{emit('{"reserved": int(torch.cuda.memory_reserved()), "allocated": int(torch.cuda.memory_allocated())}')}
"""

# After the take-back: the kernel still runs, its kept tensors are intact, its cap followed.
AFTER_CELL = f"""
_gc_intact = int(_gc_keep[::4096].sum()) == 7 * (_gc_keep.numel() // 4096)
import jupyter_gpupool.enforcement.caps as _gc_caps
{emit('{"intact": _gc_intact, "caps_limit": _gc_kernel.get_caps().limit, "reserved": int(torch.cuda.memory_reserved()), "cache_frees": _gc_caps.requests_served}')}
"""


@dataclass(frozen=True)
class Cells:
    """The kernel code the check runs in kernel A (the tests swap in a simulated pool's)."""

    grow: str = GROW_CELL
    drop: str = DROP_CELL
    after: str = AFTER_CELL


def big_kernelspec(memory: int) -> dict[str, dict[str, Any]]:
    """Kernel B's kernelspec: the pool's provisioner with a slice of ``memory`` bytes."""
    return {
        BIG_SPEC: {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (large GPU slice)",
            "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": "gpupool-provisioner", "config": {"memory": str(memory)}}},
        }
    }


def b_size(total: int) -> int:
    """Kernel B's slice: all of the GPU but twice A's guarantee, in whole MiB. It fits with A at its
    guarantee and not while A holds its burst (KEEP + BURST_USE is more than 2 x GUARANTEE)."""
    return (total - 2 * GUARANTEE) // MIB * MIB


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        need_framework(probe, "torch"),
        need_server(probe),
        need_provisioner(probe),
        need_module(probe, "jupyter_gpupool.devices.nvml"),
    )


# --- the verdict (pure; tests/test_gpu_checks.py feeds it passing and failing readings) ------------


def settle_limit(interval: float, settle: float = BURST_SETTLE) -> float:
    """The rule: burst given back within ``burst_settle`` + one watchdog interval."""
    return settle + interval


def problems_of(seen: dict[str, Any], interval: float, settle: float = BURST_SETTLE) -> list[str]:
    """What the readings say went wrong; empty when the check passes."""
    found: list[str] = []
    limit = settle_limit(interval, settle)
    grown = int(seen.get("grown_memory") or 0)
    wanted = KEEP + BURST_USE
    if not seen.get("grew"):
        found.append(f"A's PyTorch allocation past its guarantee failed: {seen.get('grow_error') or 'no result'}")
        return found
    if grown < wanted:
        found.append(f"A's slice is {grown / GIB:.2f} GiB after it allocated {wanted / GIB:.0f} GiB")
    if int(seen.get("caps_grown") or 0) < wanted:
        found.append(f"A's cap did not follow the growth ({int(seen.get('caps_grown') or 0) / GIB:.2f} GiB)")
    if not seen.get("kept_running"):
        found.append("A did not keep running with its tensors after the growth")
    back = seen.get("nvml_back_s")
    held = int(seen.get("nvml_a_last") or 0)
    if back is None:
        found.append(f"A's process still held {held / GIB:.2f} GiB (NVML) {seen.get('waited_s', limit):.0f} s after B asked")
    elif back > limit:
        found.append(f"A's burst was back (NVML) {back:.1f} s after B asked, past burst_settle + interval = {limit:g} s")
    granted = seen.get("b_granted_s")
    if granted is None:
        found.append(f"B was not granted within {seen.get('waited_s', limit):.0f} s")
    elif granted > limit:
        found.append(f"B was granted {granted:.1f} s after it asked, past burst_settle + interval = {limit:g} s")
    caps_after, memory_after = seen.get("caps_after"), int(seen.get("memory_after") or 0)
    if caps_after is None or int(caps_after) > max(memory_after, GUARANTEE) or int(caps_after) >= int(seen.get("caps_grown") or 0):
        found.append(f"A's cap was not lowered to its slice (cap {caps_after}, slice {memory_after})")
    if seen.get("a_state_after") != "granted" or not seen.get("intact_after"):
        found.append(f"A did not keep running after the take-back (state {seen.get('a_state_after')}, "
                     f"tensors intact {seen.get('intact_after')})")
    return found


def summary(seen: dict[str, Any], interval: float) -> str:
    grown = int(seen.get("grown_memory") or 0) / GIB
    back = seen.get("nvml_back_s")
    return (f"grown to {grown:.1f} GiB; burst back in {'-' if back is None else f'{back:.1f}'} s "
            f"(limit {settle_limit(interval):g} s)")


# --- the check --------------------------------------------------------------------------------------


def _grow(kernel: KernelSession, cell: str, seen: dict[str, Any], log: Callable[[str], None]) -> None:
    """Run the growing cell until it passes (re-run as the cap's message says) or GROW_TRIES."""
    for attempt in range(1, GROW_TRIES + 1):
        res = kernel.run(cell, timeout=90)
        seen["grow_tries"] = attempt
        if res.ok:
            got = res.last()
            seen.update(grew=True, caps_grown=got["caps_limit"], kept_running=bool(got["ok"]))
            return
        seen.setdefault("grow_messages", []).append(res.brief())
        if "re-run the cell" not in res.all_text:
            seen["grow_error"] = f"{res.brief()} (try {attempt}; the cap did not say it grew the slice)"
            return
        log(f"try {attempt}: {res.evalue[:160]}")
    seen["grow_error"] = f"still refused after {GROW_TRIES} tries: {seen['grow_messages'][-1]}"


@dataclass(frozen=True)
class Host:
    """Where the check reads the GPU: NVML here; the tests give a simulated pool's readings."""

    process_memory: Callable[[set[int]], dict[int, int]] = nvml_process_memory
    total_memory: Callable[[int], int] = gpu_total_memory
    grant_problems: Callable[[KernelSession, int], list[str]] = grant_problems
    server_env: dict[str, str] = field(default_factory=dict)
    server_config: dict[str, Any] = field(default_factory=dict)


def run(ctx: Context) -> Result:
    return measure(ctx)


def measure(ctx: Context, cells: Cells = Cells(), host: Host = Host()) -> Result:  # frozen defaults: one shared instance is safe
    """Kernel A grows, B asks, A gives back: the readings and the verdict."""
    interval = ctx.options.watchdog_interval
    limit = settle_limit(interval)
    seen: dict[str, Any] = {"interval": interval, "burst_settle": BURST_SETTLE, "limit_s": limit}
    total = host.total_memory(0)
    seen["b_memory"] = big = b_size(total)
    server = slice_server(
        ctx.workdir, GUARANTEE, "server-elastic", ctx.log,
        env={"GPUPOOL_BURST": str(BURST_LIMIT), **host.server_env},
        config={"Watchdog": {"interval": interval}, "PoolPolicy": {"burst_settle": BURST_SETTLE}, **host.server_config},
        kernelspecs=big_kernelspec(big),
    )
    try:
        server.start()
        a_id = server.start_kernel()
        a = server.connect(a_id)
        if problems := host.grant_problems(a, GUARANTEE):
            return Result.fail(ctx.name, "; ".join(problems), **seen)
        _grow(a, cells.grow, seen, ctx.log)
        status, body = server.gpupool_kernel(a_id)
        seen["grown_memory"] = int(body.get("memory") or 0) if status == 200 else 0
        seen["nvml_a_grown"] = host.process_memory({a.pid or -1}).get(a.pid or -1, 0)
        if not seen.get("grew"):
            return Result(ctx.name, Status.FAIL, number=summary(seen, interval), detail="; ".join(problems_of(seen, interval))[:400], data=seen)
        seen["dropped"] = a.value(cells.drop, timeout=30)
        seen["nvml_a_cached"] = host.process_memory({a.pid or -1}).get(a.pid or -1, 0)
        asked = time.monotonic()
        b_id = server.start_kernel(BIG_SPEC)  # queued until A's burst is back
        deadline = asked + limit + 10  # past the limit, to say how late it was
        while time.monotonic() < deadline and (seen.get("nvml_back_s") is None or seen.get("b_granted_s") is None):
            held = host.process_memory({a.pid or -1}).get(a.pid or -1, 0)
            seen["nvml_a_last"] = held
            now = time.monotonic() - asked
            if seen.get("nvml_back_s") is None and held <= GUARANTEE:
                seen["nvml_back_s"] = round(now, 2)
            if seen.get("b_granted_s") is None:
                status, body = server.gpupool_kernel(b_id)
                if status == 200 and isinstance(body, dict) and body.get("state") == "granted":
                    seen["b_granted_s"] = round(now, 2)
            time.sleep(0.1)
        seen["waited_s"] = round(time.monotonic() - asked, 1)
        status, body = server.gpupool_kernel(a_id)
        if status == 200 and isinstance(body, dict):
            seen.update(a_state_after=body.get("state"), memory_after=int(body.get("memory") or 0),
                        burst_note=body.get("burst_note"))
        after = a.value(cells.after, timeout=30)
        seen.update(caps_after=after["caps_limit"], intact_after=bool(after["intact"]), after=after)
        seen["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **seen)
    finally:
        server.stop()
    problems = problems_of(seen, interval)
    number = summary(seen, interval)
    return Result.verdict(ctx.name, problems, number=number, data=seen, detail=lambda: (
        f"A grew from {GUARANTEE / GIB:.0f} GiB in {seen.get('grow_tries')} cell run(s) and kept running; "
        f"B ({big / GIB:.0f} GiB) granted {seen['b_granted_s']} s after it asked; A's cache emptied "
        f"({seen.get('nvml_a_cached', 0) / GIB:.1f} -> {seen.get('nvml_a_last', 0) / GIB:.1f} GiB NVML), "
        f"cap {int(seen['caps_after']) / GIB:.1f} GiB; {seen.get('burst_note') or ''}"))


SPEC = CheckSpec(
    name="elastic",
    title="Elastic growth in PyTorch: grown past the guarantee, burst back for another kernel within burst_settle + interval",
    requires=requires,
    run=run,
    timeout=150,
    min_seconds=60,
)

__all__ = ["SPEC"]
