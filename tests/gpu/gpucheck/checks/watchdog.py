"""Check 3: a kernel whose child allocates past the slice with raw ``cuMemAlloc`` (no framework
cap sees it) is seen by the server's NVML watchdog within its interval, with usage summed over
the kernel's process tree as NVML reports it, and the policy action (interrupt) happens.
"""

from __future__ import annotations

import time

from ..harness import HarnessError
from ..probe import Probe, first, need_gpu, need_module, need_provisioner, need_server
from ..report import Result
from . import CheckSpec, Context, Options
from .common import GIB, MIB, emit, grant_problems, nvml_process_memory, poll_until, rest_slice, slice_server

GRACE = 5.0  # seconds between the warning and the interrupt: room for a full watchdog reading first
CHILD_SHARE = 1.25  # the child takes this much of the slice: clearly over, whatever the tolerance
KERNEL_RAW = 512 * MIB  # and the kernel itself this much, so the sum over the tree matters


def tolerance(total: int) -> float:
    """How far the watchdog's number may be from NVML's read a moment later."""
    return max(64 * MIB, 0.03 * total)


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.libcuda else "libcuda.so.1 not loadable: no raw cuMemAlloc",
        need_server(probe),
        need_provisioner(probe),
        need_module(probe, "jupyter_gpupool.enforcement.watchdog"),
    )


def _cell(child_bytes: int, ready: str, stop: str, hold: float) -> str:
    """Allocate KERNEL_RAW in the kernel, start the raw-allocating child, wait on it (busy cell)."""
    return f"""
import subprocess, time
from gpucheck.rawcuda import Driver
_gc_drv = Driver(); _gc_drv.primary_context(0); _gc_ptr = _gc_drv.mem_alloc({KERNEL_RAW})
_gc_child = subprocess.Popen([sys.executable, {str(__import__("pathlib").Path(__file__).resolve().parents[1] / "rawcuda.py")!r}, "alloc",
    "--bytes", "{child_bytes}", "--hold", "{hold}", "--ready-file", {ready!r}, "--stop-file", {stop!r}])
{emit('{"child_pid": _gc_child.pid}')}
try:
    while _gc_child.poll() is None:
        time.sleep(0.1)
finally:
    if _gc_child.poll() is None:
        _gc_child.terminate()
{emit('{"child_exit": _gc_child.returncode}')}
"""


def run(ctx: Context) -> Result:
    opts = ctx.options
    slice_bytes = opts.slice_bytes
    interval = opts.watchdog_interval
    child_bytes = int(slice_bytes * CHILD_SHARE)
    config = {"Watchdog": {"interval": interval, "action": "interrupt", "grace": GRACE, "escalate": False}}
    data: dict[str, object] = {
        "slice": slice_bytes,
        "interval": interval,
        "grace": GRACE,
        "child_bytes": child_bytes,
        "kernel_raw": KERNEL_RAW,
    }
    problems: list[str] = []
    ready = ctx.workdir / "child.ready"
    stop = ctx.workdir / "child.stop"
    server = slice_server(ctx.workdir, slice_bytes, "server-watchdog", ctx.log, config=config)
    try:
        server.start()
        kid = server.start_kernel()
        kernel = server.connect(kid)
        problems += grant_problems(kernel, slice_bytes)
        if problems:
            return Result.fail(ctx.name, "; ".join(problems), **data)
        body, note = rest_slice(server, kid)
        if body is None:
            return Result.fail(
                ctx.name, f"{note}: the gpupool server extension (and its watchdog) is not running", **data
            )
        msg_id = kernel.submit(_cell(child_bytes, str(ready), str(stop), hold=90))
        _, _waited = poll_until(ready.exists, timeout=60, interval=0.05)
        if not ready.exists():
            res = kernel.collect(msg_id, timeout=30)
            return Result.fail(
                ctx.name,
                f"raw allocation in the kernel's child did not happen: {res.brief()} {res.stderr[-200:]}",
                **data,
            )
        allocated_at = time.monotonic()
        child = __import__("json").loads(ready.read_text())
        data["child"] = child
        if not child.get("ok"):
            return Result.fail(
                ctx.name,
                f"the child's raw cuMemAlloc of {child_bytes / GIB:.1f} GiB failed: {child.get('error')}",
                **data,
            )
        limit_seen = slice_bytes + max(int(slice_bytes * 0.05), 256 * MIB)

        def seen() -> dict | None:
            got, _ = rest_slice(server, kid)
            used = (got or {}).get("used_memory")
            return got if used is not None and int(used) > limit_seen else None

        state, latency = poll_until(seen, timeout=interval * 3 + 10, interval=0.1)
        nvml = nvml_process_memory({kernel.pid or -1, int(child["pid"])})
        data["nvml_per_pid"] = {str(k): v for k, v in nvml.items()}
        data["detect_seconds"] = round(latency, 2)
        if not state:
            last, _ = rest_slice(server, kid)
            data["rest_last"] = last
            problems.append(
                f"watchdog did not report usage over the slice within {interval * 3 + 10:.0f} s "
                f"(REST used_memory={(last or {}).get('used_memory')}, NVML per pid {nvml or 'empty'})"
            )
        else:
            data["rest_over"] = state
            # The first reading over the slice may come from a tick during the child's allocation:
            # compare a reading taken after it (the next tick) with NVML's sum over the tree.
            pair = [0, 0]

            def agree() -> bool:
                got, _ = rest_slice(server, kid)
                pair[0] = int((got or {}).get("used_memory") or 0)
                pair[1] = sum(nvml_process_memory({kernel.pid or -1, int(child["pid"])}).values())
                return abs(pair[0] - pair[1]) <= tolerance(pair[1])

            poll_until(agree, timeout=interval * 1.5 + 0.5, interval=0.2)
            used, expected = pair
            data["used_reported"], data["used_nvml"] = used, expected
            if not nvml:
                problems.append(
                    "NVML lists no compute processes for the kernel or its child: per-process usage unavailable here"
                )
            elif abs(used - expected) > tolerance(expected):
                problems.append(
                    f"watchdog reports {used / GIB:.2f} GiB, NVML says the kernel tree holds {expected / GIB:.2f} GiB"
                )
            if latency > interval + 1.0:
                problems.append(
                    f"seen {latency:.1f} s after the allocation, more than the {interval:g} s interval (+1 s)"
                )
        # The action: the busy cell is interrupted (SIGINT to the kernel's process group ends the child).
        res = kernel.collect(msg_id, timeout=GRACE + interval * 3 + 20)
        acted_after = time.monotonic() - allocated_at
        data["cell"] = {"status": res.status, "ename": res.ename, "seconds_after_alloc": round(acted_after, 1)}
        if res.ename != "KeyboardInterrupt":
            problems.append(f"the busy cell was not interrupted (it ended {res.brief()} after {acted_after:.1f} s)")
        child_gone, _ = poll_until(
            lambda: int(child["pid"]) not in nvml_process_memory({int(child["pid"])}), timeout=10, interval=0.2
        )
        if not child_gone:
            problems.append("the child still holds GPU memory after the interrupt")
        after, _ = rest_slice(server, kid)
        data["rest_after"] = after
        data["server_errors"] = server.log_errors()
    except HarnessError as exc:
        return Result.fail(ctx.name, str(exc), **data)
    finally:
        stop.touch()
        server.stop()
    number = f"seen in {data.get('detect_seconds', '?')} s (interval {interval:g} s)"
    return Result.verdict(ctx.name, problems, number=number, data=data, detail=lambda: (
        f"{data['used_reported'] / GIB:.2f} GiB over the kernel tree = NVML; "  # type: ignore[operator]
        f"interrupted {data['cell']['seconds_after_alloc']} s after the allocation (grace {GRACE:g} s)"  # type: ignore[index]
    ))


SPEC = CheckSpec(
    name="watchdog",
    title="NVML watchdog sees a caps-bypassing child process and interrupts the kernel",
    requires=requires,
    run=run,
    timeout=120,
    min_seconds=40,
)
