"""Check 6: suspend an idle kernel holding N GiB of PyTorch tensors and resume it, through the
product's :class:`~jupyter_gpupool.devices.checkpoint.CudaCheckpointer` (``cuda.core.checkpoint``,
the ``[cuda]`` extra). Its GPU memory must be gone while suspended (NVML), a cell run while
suspended must wait and finish after the resume, and the tensors must be bit-identical after;
the speed each way is set against the host-link floor (slice ÷ ~63 GB/s).

Where cuda-core cannot be imported (not in ``tests/gpu/.wheels``, no numpy), the same steps run
through ctypes on ``libcuda.so.1`` (or the ``cuda-checkpoint`` tool), and the detail says the
product path was not exercised, and why.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import traceback
from typing import Any

from ..harness import JupyterServer, KernelSession
from ..probe import Probe, first, need_checkpoint_api, need_framework, need_gpu, need_provisioner, need_server
from ..rawcuda import Driver
from ..report import Result
from . import CheckSpec, Context, Options
from .common import (
    GIB,
    PINNED_LINK_SPEED,
    emit,
    nvml_device_used,
    nvml_process_memory,
    poll_until,
    regenerated_identical,
    seeded_tensors,
    slice_server,
)

HOST_LINK_BYTES_PER_S = 63e9  # PCIe Gen5 x16, one direction (DESIGN.md)
FLOOR_S_PER_GIB = GIB / HOST_LINK_BYTES_PER_S
LOCK_TIMEOUT_S = 60.0
SEED = 1234  # the tensors' (drawn again to compare them)


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe), need_checkpoint_api(probe), need_framework(probe, "torch"), need_server(probe), need_provisioner(probe)
    )


def _fill(gib: float) -> str:
    """Fill N GiB with seeded int32 tensors of 1 GiB (the last one smaller); keep per-chunk int64
    sums and host copies of both ends, then measure the pinned host link as this process sees it."""
    return f"""
{seeded_tensors(gib, SEED)}def _gc_sums():
    return [int(c.to(torch.int64).sum()) for t in _gc_x for c in t.split(1 << 26)]
_gc_before = _gc_sums()
_gc_head, _gc_tail = _gc_x[0][: 1 << 22].cpu(), _gc_x[-1][-(1 << 22):].cpu()
{PINNED_LINK_SPEED}{emit('{"elements": _gc_total, "tensors": len(_gc_x), "chunks": len(_gc_before), "h2d": _h2d, "d2h": _d2h, "reserved": int(torch.cuda.memory_reserved())}')}
"""


# Sent while the kernel is suspended: its first CUDA call must wait for the resume.
WHILE_SUSPENDED = f"""
import time
_gc_t0 = time.time()
_gc_probe = int(_gc_x[0][:1024].to(torch.int64).sum())
{emit('{"started": _gc_t0, "finished": time.time(), "value": _gc_probe}')}
"""

# Bit for bit: regenerate every tensor from the same seed, chunk by chunk, and compare exactly.
VERIFY = f"""
_gc_after = _gc_sums()
{regenerated_identical(SEED)}torch.cuda.empty_cache()
_gc_ok = _gc_identical and _gc_after == _gc_before and torch.equal(_gc_x[0][: 1 << 22].cpu(), _gc_head) and torch.equal(_gc_x[-1][-(1 << 22):].cpu(), _gc_tail)
{emit('{"intact": bool(_gc_ok), "bit_identical": bool(_gc_identical), "chunks": len(_gc_after)}')}
"""


def _cli(action: str, pid: int) -> None:
    exe = shutil.which("cuda-checkpoint") or "cuda-checkpoint"
    proc = subprocess.run(
        [exe, "--action", action, "--pid", str(pid)], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cuda-checkpoint --action {action}: {(proc.stderr or proc.stdout).strip()[:200]}")


class _Mover:
    """Suspend/resume one process: the product's CudaCheckpointer, else ctypes, else the CLI."""

    def __init__(self, log: Any) -> None:
        self.via = ""
        self.why_not_product = ""
        self.product: Any = None
        self._backend: Any = None
        self._driver: Driver | None = None
        try:
            from jupyter_gpupool.devices.checkpoint import CudaCheckpointer
            from jupyter_gpupool.devices.nvml import NvmlBackend

            self._backend = NvmlBackend()
            checkpointer = CudaCheckpointer(self._backend)
            support = checkpointer.probe()
        except Exception as exc:  # noqa: BLE001 - any failure means: fall back, and say why
            self.why_not_product = f"{type(exc).__name__}: {exc}"[:200]
        else:
            if support.supported:
                self.product = checkpointer
                self.via = f"jupyter_gpupool CudaCheckpointer ({support.reason})"
            else:
                self.why_not_product = support.reason
        if self.product is None:
            self._driver = Driver()
            self.via = (
                "cuCheckpointProcess* (ctypes)" if self._driver.has_checkpoint_api() else "cuda-checkpoint"
            ) + f"; product path not exercised: {self.why_not_product}"
            log(f"suspend via {self.via}")

    def state(self, pid: int) -> str:
        if self.product is not None:
            return str(self.product.state(pid))
        if self._driver is not None and self._driver.has_checkpoint_api():
            return self._driver.process_state(pid)
        return "unknown"

    def suspend(self, pid: int) -> int | None:
        """Park the process's GPU memory; the product returns the bytes parked."""
        if self.product is not None:
            return int(self.product.suspend(pid, timeout=LOCK_TIMEOUT_S))
        assert self._driver is not None
        if self._driver.has_checkpoint_api():
            self._driver.checkpoint_lock(pid, int(LOCK_TIMEOUT_S * 1000))
            self._driver.checkpoint(pid)
        else:
            _cli("lock", pid)
            _cli("checkpoint", pid)
        return None

    def resume(self, pid: int) -> None:
        if self.product is not None:
            self.product.resume(pid)
            return
        assert self._driver is not None
        if self._driver.has_checkpoint_api():
            self._driver.restore(pid)
            self._driver.unlock(pid)
        else:
            _cli("restore", pid)
            _cli("unlock", pid)

    def rescue(self, pid: int) -> None:
        """Never leave a process checkpointed or locked: it would block on its next CUDA call."""
        if self.product is not None:
            if self.product.state(pid) in ("suspended", "locked"):
                self.product.resume(pid)
            return
        if self._driver is not None and self._driver.has_checkpoint_api():
            state = self._driver.process_state(pid)
            if state == "checkpointed":
                self._driver.restore(pid)
                state = "locked"
            if state == "locked":
                self._driver.unlock(pid)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()


def cell_blocks_through_the_server(server: JupyterServer, kernel_id: str, kernel: KernelSession) -> dict[str, Any]:
    """The product path end to end: ``POST /api/gpupool/kernels/{id}/suspend`` makes the server park
    the kernel's GPU memory (the lease goes ``suspended``, NVML shows the process's memory gone); a
    cell then sent to the kernel waits in the kernel extension's resume hook until the server has
    restored the memory, and only then runs and reads its tensors. The server must answer its REST
    API promptly all the while. Returns the measurements; a ``problems`` list names what did not
    hold (with every thread's stack of the server and the kernel in ``checks.log`` when stuck)."""
    problems: list[str] = []
    pid = kernel.pid or -1
    slowest = [0.0]

    def lease_state() -> dict[str, Any] | None:
        asked = time.monotonic()
        try:
            body = server.api("GET", f"/api/gpupool/kernels/{kernel_id}", timeout=15)[1]
        except Exception:  # noqa: BLE001 - a REST call that times out is measured as a stall
            body = None
        slowest[0] = max(slowest[0], time.monotonic() - asked)
        return body if isinstance(body, dict) else None

    def stuck(what: str) -> dict[str, Any]:
        server.dump_stacks(pid)
        problems.append(f"{what} (stacks of the server and the kernel are in checks.log)")
        return {"problems": problems, "last": lease_state(), "slowest_rest_s": round(slowest[0], 2)}

    held = nvml_process_memory({pid}).get(pid, 0)
    code, body = server.api("POST", f"/api/gpupool/kernels/{kernel_id}/suspend")
    if code != 200:
        message = (body or {}).get("message") if isinstance(body, dict) else body
        return {"refused": code, "message": message, "problems": [f"suspend refused ({code}): {message}"]}
    t0 = time.monotonic()
    status, waited = poll_until(lambda: (s := lease_state()) and s.get("state") == "suspended" and s, timeout=60)
    if not status:
        return stuck("the server did not suspend the kernel within 60 s")
    result: dict[str, Any] = {
        "suspend_s": round(waited, 3),
        "parked_memory": status.get("parked_memory"),
        "held_before": held,
    }
    result["process_bytes_suspended"] = nvml_process_memory({pid}).get(pid, 0)
    if held and result["process_bytes_suspended"] > 0.05 * held:
        problems.append(
            f"NVML still shows {result['process_bytes_suspended'] / GIB:.2f} GiB for the kernel while suspended"
        )
    sent = time.time()
    waiting = kernel.submit(WHILE_SUSPENDED)
    states: list[str] = []

    def restored() -> bool:
        s = lease_state()
        if s is None:
            return False
        states.append(f"{s.get('state')}/{s.get('transition')}")
        return s.get("state") == "granted" and not s.get("transition")

    back, _ = poll_until(restored, timeout=60)
    restored_at = time.time()
    result["states_seen"] = sorted(set(states))
    result["resume_s"] = round(restored_at - sent, 3)
    if not back:
        result.update(stuck("the server did not restore the kernel within 60 s of a cell"))
        return result
    cell = kernel.collect(waiting, timeout=60)
    if not cell.ok:
        problems.append(f"the cell run while suspended failed: {cell.brief()}")
    else:
        timing = cell.last()
        result["cell_started_after_send_s"] = round(timing["started"] - sent, 3)
        if timing["started"] < restored_at - 1.0:
            problems.append("the cell ran before the server had restored its GPU memory")
    result["total_s"] = round(time.monotonic() - t0, 3)
    result["slowest_rest_s"] = round(slowest[0], 2)
    if slowest[0] > 5.0:
        problems.append(f"a REST call to the server took {slowest[0]:.1f} s while the kernel was suspended")
    result["problems"] = problems
    return result


def run(ctx: Context) -> Result:

    gib = ctx.options.ckpt_gib
    slice_bytes = int((gib + 2) * GIB)
    data: dict[str, Any] = {"tensor_gib": gib, "slice": slice_bytes, "floor_s_per_gib": round(FLOOR_S_PER_GIB, 4)}
    problems: list[str] = []
    mover = _Mover(ctx.log)
    data["via"] = mover.via
    server = slice_server(ctx.workdir, slice_bytes, "server-suspend", ctx.log)
    suspended = False
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
        data["state_before"] = mover.state(pid)
        # Suspend: lock (waits for running work), checkpoint (device memory to host).
        t0 = time.perf_counter()
        parked = mover.suspend(pid)
        suspended = True
        t1 = time.perf_counter()
        data["bytes_parked"] = parked
        data["state_suspended"] = mover.state(pid)
        if parked is not None and abs(parked - held) > 0.01 * held:
            problems.append(f"suspend reported {parked / GIB:.2f} GiB parked but NVML showed {held_gib:.2f} GiB held")
        released, _ = poll_until(lambda: nvml_process_memory({pid}).get(pid, 0) < 0.05 * held, timeout=5, interval=0.1)
        dev_suspended = nvml_device_used()
        data["device_used_suspended"] = dev_suspended
        data["process_bytes_suspended"] = nvml_process_memory({pid}).get(pid, 0)
        if not released or dev_before - dev_suspended < 0.9 * held:
            problems.append(
                f"GPU memory not released while suspended: device used {dev_before / GIB:.2f} -> {dev_suspended / GIB:.2f} GiB, process held {held_gib:.2f} GiB"
            )
        # A cell run now must wait: its first CUDA call blocks until the resume.
        waiting = kernel.submit(WHILE_SUSPENDED)
        time.sleep(2.0)
        # Resume: restore (host to device), unlock.
        resumed_at = time.time()
        t2 = time.perf_counter()
        mover.resume(pid)
        suspended = False
        t3 = time.perf_counter()
        data["state_after"] = mover.state(pid)
        blocked = kernel.collect(waiting, timeout=60)
        if not blocked.ok:
            problems.append(f"the cell run while suspended failed: {blocked.brief()}")
        else:
            timing = blocked.last()
            data["cell_while_suspended"] = {
                "waited_s": round(timing["finished"] - timing["started"], 3),
                "finished_after_resume_s": round(timing["finished"] - resumed_at, 3),
            }
            if timing["finished"] < resumed_at - 0.05:
                problems.append("a cell run while suspended finished before the resume (the kernel was not blocked)")
        through = cell_blocks_through_the_server(server, kid, kernel)
        data["through_server"] = through
        problems += [f"through the server: {problem}" for problem in through.get("problems", [])]
        suspend_s, resume_s = t1 - t0, t3 - t2
        data["seconds"] = {"suspend": round(suspend_s, 3), "resume": round(resume_s, 3)}
        data["suspend_gb_per_s"] = round(held / suspend_s / 1e9, 2)
        data["resume_gb_per_s"] = round(held / resume_s / 1e9, 2)
        data["suspend_s_per_gib"] = round(suspend_s / held_gib, 4)
        data["resume_s_per_gib"] = round(resume_s / held_gib, 4)
        data["suspend_x_floor"] = round(suspend_s / held_gib / FLOOR_S_PER_GIB, 2)
        data["resume_x_floor"] = round(resume_s / held_gib / FLOOR_S_PER_GIB, 2)
        verify = kernel.run(VERIFY, timeout=180)
        if not verify.ok:
            problems.append(f"kernel failed after resume: {verify.brief()}")
        elif not verify.last().get("intact"):
            problems.append("tensors changed across suspend/resume")
        data["verify"] = verify.last() if verify.ok and verify.data else verify.brief()
        data["server_errors"] = server.log_errors()
    except Exception as exc:  # noqa: BLE001 - any error is this check's fail row, with what was measured so far
        data["traceback"] = traceback.format_exc()
        return Result.fail(ctx.name, f"{type(exc).__name__}: {exc}"[:300], **data)
    finally:
        try:
            if suspended or pid > 0:  # whatever happened, never leave the kernel locked or checkpointed
                mover.rescue(pid)
        except Exception as exc:  # noqa: BLE001
            ctx.notes.append(f"cleanup restore/unlock failed: {exc}")
        mover.close()
        server.stop()
    number = (
        f"suspend {data['suspend_gb_per_s']} GB/s, resume {data['resume_gb_per_s']} GB/s "
        f"(floor {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s)"
    )
    fill = data["fill"]
    detail = (
        f"memory released, a cell waited for the resume, tensors bit-identical; {held_gib:.2f} GiB held; "
        f"{data['suspend_x_floor']}x / {data['resume_x_floor']}x the floor's time; "
        f"pinned copies {fill['h2d'] / 1e9:.0f} GB/s up, {fill['d2h'] / 1e9:.0f} GB/s down; via {mover.via}"
    )
    return Result.verdict(ctx.name, problems, number=number, detail=detail, data=data)


SPEC = CheckSpec(
    name="suspend",
    title="suspend/resume of an idle kernel holding tensors (jupyter_gpupool CudaCheckpointer)",
    requires=requires,
    run=run,
    timeout=180,
    min_seconds=50,
)
