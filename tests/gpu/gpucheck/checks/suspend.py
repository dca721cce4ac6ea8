"""Check 6: suspend feasibility. An idle kernel holding N GiB of PyTorch tensors is checkpointed
with the CUDA driver API (lock, checkpoint; then restore, unlock), its GPU memory must be gone
while suspended and the tensors intact after; seconds per GiB are set against the host link.
"""

from __future__ import annotations

import shutil
import subprocess
import time

from ..harness import HarnessError
from ..probe import Probe, first, need_framework, need_gpu, need_provisioner, need_server
from ..rawcuda import CudaError, Driver
from ..report import Result, Status
from . import CheckSpec, Context, Options
from .common import GIB, emit, nvml_device_used, nvml_process_memory, poll_until, slice_server

HOST_LINK_BYTES_PER_S = 63e9  # PCIe Gen5 x16, one direction (DESIGN.md)
FLOOR_S_PER_GIB = GIB / HOST_LINK_BYTES_PER_S


def requires(probe: Probe, options: Options) -> str | None:
    api = (
        None
        if (probe.checkpoint_api or probe.cuda_checkpoint)
        else (
            f"no CUDA checkpoint API: libcuda lacks cuCheckpointProcess* (driver {probe.driver or 'unknown'}; needs 570+) and cuda-checkpoint is not on PATH"
        )
    )
    return first(need_gpu(probe), api, need_framework(probe, "torch"), need_server(probe), need_provisioner(probe))


def _fill(gib: float) -> str:
    """Fill N GiB with seeded int32 tensors of 1 GiB (the last one smaller); keep per-chunk int64
    sums and host copies of both ends, then measure the pinned host link as this process sees it."""
    return f"""
import time, torch
_gc_gen = torch.Generator(device="cuda").manual_seed(1234)
_gc_total = int({gib} * 2**30) // 4
_gc_x = [torch.randint(0, 2**31 - 1, (min(2**28, _gc_total - i),), dtype=torch.int32, device="cuda", generator=_gc_gen)
         for i in range(0, _gc_total, 2**28)]
def _gc_sums():
    return [int(c.to(torch.int64).sum()) for t in _gc_x for c in t.split(1 << 26)]
_gc_before = _gc_sums()
_gc_head, _gc_tail = _gc_x[0][: 1 << 22].cpu(), _gc_x[-1][-(1 << 22):].cpu()
_gc_h = torch.empty(2**30, dtype=torch.uint8).pin_memory(); _gc_d = torch.empty(2**30, dtype=torch.uint8, device="cuda")
_gc_d.copy_(_gc_h); torch.cuda.synchronize()
_t = time.perf_counter(); [_gc_d.copy_(_gc_h, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize(); _h2d = 4 * 2**30 / (time.perf_counter() - _t)
_t = time.perf_counter(); [_gc_h.copy_(_gc_d, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize(); _d2h = 4 * 2**30 / (time.perf_counter() - _t)
del _gc_d, _gc_h; torch.cuda.empty_cache()
getattr(torch._C, "_host_emptyCache", lambda: None)()  # no pinned host blocks held across the checkpoint
{emit('{"elements": _gc_total, "tensors": len(_gc_x), "chunks": len(_gc_before), "h2d": _h2d, "d2h": _d2h, "reserved": int(torch.cuda.memory_reserved())}')}
"""


VERIFY = f"""
_gc_after = _gc_sums()
_gc_ok = _gc_after == _gc_before and torch.equal(_gc_x[0][: 1 << 22].cpu(), _gc_head) and torch.equal(_gc_x[-1][-(1 << 22):].cpu(), _gc_tail)
{emit('{"intact": bool(_gc_ok), "chunks": len(_gc_after)}')}
"""


def _cli(action: str, pid: int) -> None:
    exe = shutil.which("cuda-checkpoint") or "cuda-checkpoint"
    proc = subprocess.run(
        [exe, "--action", action, "--pid", str(pid)], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cuda-checkpoint --action {action}: {(proc.stderr or proc.stdout).strip()[:200]}")


def run(ctx: Context) -> Result:
    gib = ctx.options.ckpt_gib
    slice_bytes = int((gib + 2) * GIB)
    data: dict[str, object] = {"tensor_gib": gib, "slice": slice_bytes, "floor_s_per_gib": round(FLOOR_S_PER_GIB, 4)}
    problems: list[str] = []
    driver = Driver()
    use_api = driver.has_checkpoint_api()
    data["via"] = "cuCheckpointProcess* (ctypes)" if use_api else "cuda-checkpoint"
    server = slice_server(ctx.workdir, slice_bytes, "server-suspend", ctx.log)
    locked = checkpointed = False
    pid = -1
    try:
        server.start()
        kid = server.start_kernel()
        kernel = server.connect(kid)
        pid = kernel.pid or -1
        filled = kernel.run(_fill(gib), timeout=180)
        if not filled.ok:
            return Result.fail(
                ctx.name, f"could not put {gib:g} GiB of tensors in the kernel: {filled.brief()}", **data
            )
        data["fill"] = filled.last()
        held = nvml_process_memory({pid}).get(pid, 0)
        dev_before = nvml_device_used()
        data["held_bytes"], data["device_used_before"] = held, dev_before
        if held <= 0:
            return Result.fail(
                ctx.name, "NVML lists no GPU memory for the kernel process: cannot measure the suspend", **data
            )
        held_gib = held / GIB
        if use_api:
            data["state_before"] = driver.process_state(pid)
        # Suspend: lock (waits for running work), checkpoint (device memory to host).
        t0 = time.perf_counter()
        (driver.checkpoint_lock(pid) if use_api else _cli("lock", pid))
        locked = True
        t1 = time.perf_counter()
        (driver.checkpoint(pid) if use_api else _cli("checkpoint", pid))
        checkpointed = True
        t2 = time.perf_counter()
        if use_api:
            data["state_suspended"] = driver.process_state(pid)
        released, _ = poll_until(lambda: nvml_process_memory({pid}).get(pid, 0) < 0.05 * held, timeout=5, interval=0.1)
        dev_suspended = nvml_device_used()
        data["device_used_suspended"] = dev_suspended
        data["process_bytes_suspended"] = nvml_process_memory({pid}).get(pid, 0)
        if not released or dev_before - dev_suspended < 0.9 * held:
            problems.append(
                f"GPU memory not released while suspended: device used {dev_before / GIB:.2f} -> {dev_suspended / GIB:.2f} GiB, process held {held_gib:.2f} GiB"
            )
        # Resume: restore (host to device), unlock.
        t3 = time.perf_counter()
        (driver.restore(pid) if use_api else _cli("restore", pid))
        checkpointed = False
        t4 = time.perf_counter()
        (driver.unlock(pid) if use_api else _cli("unlock", pid))
        locked = False
        t5 = time.perf_counter()
        if use_api:
            data["state_after"] = driver.process_state(pid)
        timings = {"lock": t1 - t0, "checkpoint": t2 - t1, "restore": t4 - t3, "unlock": t5 - t4}
        data["seconds"] = {k: round(v, 3) for k, v in timings.items()}
        suspend_s = timings["lock"] + timings["checkpoint"]
        resume_s = timings["restore"] + timings["unlock"]
        data["suspend_s_per_gib"] = round(suspend_s / held_gib, 4)
        data["resume_s_per_gib"] = round(resume_s / held_gib, 4)
        data["suspend_x_floor"] = round(suspend_s / held_gib / FLOOR_S_PER_GIB, 2)
        data["resume_x_floor"] = round(resume_s / held_gib / FLOOR_S_PER_GIB, 2)
        verify = kernel.run(VERIFY, timeout=120)
        if not verify.ok:
            problems.append(f"kernel failed after resume: {verify.brief()}")
        elif not verify.last().get("intact"):
            problems.append("tensors changed across suspend/resume")
        data["verify"] = verify.last() if verify.ok and verify.data else verify.brief()
        data["server_errors"] = server.log_errors()
    except (HarnessError, CudaError, RuntimeError) as exc:
        return Result.fail(ctx.name, f"{type(exc).__name__}: {exc}"[:300], **data)
    finally:
        # Never leave a process checkpointed or locked: it would block on its next CUDA call.
        try:
            if checkpointed:
                (driver.restore(pid) if use_api else _cli("restore", pid))
            if locked:
                (driver.unlock(pid) if use_api else _cli("unlock", pid))
        except Exception as exc:  # noqa: BLE001
            ctx.notes.append(f"cleanup restore/unlock failed: {exc}")
        server.stop()
    number = f"suspend {data['suspend_s_per_gib']} s/GiB, resume {data['resume_s_per_gib']} s/GiB (floor {FLOOR_S_PER_GIB:.3f})"
    fill = data["fill"]
    detail = (
        f"{held_gib:.2f} GiB held; {data['suspend_x_floor']}x / {data['resume_x_floor']}x the 63 GB/s floor; "
        f"pinned copies {fill['h2d'] / 1e9:.0f} GB/s up, {fill['d2h'] / 1e9:.0f} GB/s down"  # type: ignore[index]
    )
    if problems:
        return Result(ctx.name, Status.FAIL, number=number, detail="; ".join(problems)[:400], data=data)
    return Result(
        ctx.name, Status.PASS, number=number, detail=f"memory released and tensors intact; {detail}", data=data
    )


SPEC = CheckSpec(
    name="suspend",
    title="cuCheckpointProcess* suspend/resume of an idle kernel holding tensors",
    requires=requires,
    run=run,
    timeout=150,
    min_seconds=45,
)
