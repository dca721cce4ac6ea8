"""Check: the GPU's power draw with every kernel suspended, against one idle kernel holding its
context. A live CUDA context costs tens of watts on HBM GPUs even when it computes nothing, so a
suspend that drops the context (the CUDA checkpoint, through the product's
:class:`~jupyter_gpupool.devices.checkpoint.CudaCheckpointer`) should bring GPU 0 back to what
it draws with nothing on it; freeing memory alone would not.

Three windows of NVML power readings (``nvmlDeviceGetPowerUsage``, every 0.2 s for 10 s, the
median of each): nothing of ours on GPU 0 (the baseline); one child process (PyTorch) holding a
CUDA context and 8 GiB, idle; the same child suspended (NVML must show its memory freed). Then
the child is resumed and must still read its memory back intact. The persistence mode and the
performance state are read for the detail; no GPU setting is ever changed.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..harness import register_pid
from ..probe import Probe, first, need_checkpoint_api, need_framework, need_gpu
from ..report import Result
from . import CheckSpec, Context, Options
from .common import GIB, gpu_uuids, nvml_process_memory, poll_until
from .suspend import _Mover  # the suspend check's product-first checkpoint path, reused as it is

CHILD_GIB = 8
CHILD_LOG = "power-child.log"  # the child's stderr; the runner copies *.log into checks.log
MARGIN_W = 5.0  # suspended may draw this much above the baseline...
MARGIN_FRACTION = 0.05  # ...or this share of it, whichever is larger
PSTATE_UNKNOWN = 32  # NVML_PSTATE_UNKNOWN


@dataclass(frozen=True)
class Timing:
    """How long each window samples and how long the GPU is given to settle first (seconds)."""

    sample_s: float = 10.0
    interval_s: float = 0.2
    settle_s: float = 5.0  # a GPU lowers its clocks a few seconds after its last context goes
    baseline_settle_s: float = 5.0  # the check before this one may have left the GPU clocked up
    ready_s: float = 90.0  # the child's PyTorch import, CUDA context and allocation
    released_s: float = 10.0  # NVML showing the suspended child's memory gone


# --- statistics and the verdict (pure) ---------------------------------------------------------------


def median_watts(samples_mw: Sequence[float]) -> float:
    """The median of NVML power readings (milliwatts), in watts."""
    if not samples_mw:
        raise ValueError("no power readings to take the median of")
    return float(statistics.median(samples_mw)) / 1000.0


def pstate_name(value: int) -> str:
    """``P0`` … ``P15``, or ``P?`` for NVML's unknown performance state."""
    return f"P{value}" if 0 <= value <= 15 else "P?"


def summarize_window(samples: Sequence[tuple[float, int]]) -> dict[str, Any]:
    """One window of ``(milliwatts, performance state)`` readings: median, spread, the usual P-state."""
    watts = [mw for mw, _ in samples]
    states = Counter(pstate_name(p) for _, p in samples)
    return {
        "median_w": round(median_watts(watts), 2),
        "min_w": round(min(watts) / 1000.0, 2),
        "max_w": round(max(watts) / 1000.0, 2),
        "first_w": round(watts[0] / 1000.0, 2),  # first and last show whether it was still settling
        "last_w": round(watts[-1] / 1000.0, 2),
        "samples": len(samples),
        "pstate": states.most_common(1)[0][0],
        "pstates": dict(states),
    }


@dataclass(frozen=True)
class PowerVerdict:
    """The three medians (W) and whether suspended came back to the baseline."""

    baseline_w: float
    idle_w: float
    suspended_w: float
    margin_w: float = MARGIN_W
    margin_fraction: float = MARGIN_FRACTION

    @property
    def allowed_w(self) -> float:
        """How far above the baseline suspended may be: the margin, or its share of the baseline."""
        return max(self.margin_w, self.margin_fraction * self.baseline_w)

    @property
    def context_w(self) -> float:
        """What the idle kernel's context costs over the baseline."""
        return self.idle_w - self.baseline_w

    @property
    def saved_w(self) -> float:
        """What suspending the kernel saved against it idling with its context."""
        return self.idle_w - self.suspended_w

    @property
    def excess_w(self) -> float:
        """Suspended less the baseline (negative: below it)."""
        return self.suspended_w - self.baseline_w

    @property
    def within(self) -> bool:
        return self.excess_w <= self.allowed_w

    def number(self) -> str:
        return f"baseline {self.baseline_w:.1f} W, idle context {self.idle_w:.1f} W, suspended {self.suspended_w:.1f} W"

    def explain(self) -> str:
        where = "within" if self.within else "NOT within"
        return (
            f"suspended {where} {self.allowed_w:.1f} W of the baseline ({self.excess_w:+.1f} W); "
            f"the idle context cost {self.context_w:+.1f} W, suspending saved {self.saved_w:.1f} W"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "baseline_w": self.baseline_w,
            "idle_w": self.idle_w,
            "suspended_w": self.suspended_w,
            "context_w": round(self.context_w, 2),
            "saved_w": round(self.saved_w, 2),
            "excess_w": round(self.excess_w, 2),
            "allowed_w": round(self.allowed_w, 2),
            "within": self.within,
        }


def sample(
    read: Callable[[], tuple[float, int]],
    seconds: float,
    interval: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[tuple[float, int]]:
    """Call ``read`` every ``interval`` seconds for ``seconds`` (at least once)."""
    samples = [read()]
    end = clock() + seconds
    while clock() + interval <= end:
        sleep(interval)
        samples.append(read())
    return samples


# --- the child holding a context ------------------------------------------------------------------------

# Holds a CUDA context and N GiB in 1 GiB chunks, each filled with its own value; then idles on
# stdin (no CUDA call) until told to read its memory back ("check") or to end (anything else).
CHILD = r"""
import json, sys
import torch
gib = int(sys.argv[1])
chunks = [torch.full((2**30,), i % 251 + 1, dtype=torch.uint8, device="cuda") for i in range(gib)]
torch.cuda.synchronize()
print(json.dumps({"event": "ready", "bytes": sum(c.numel() for c in chunks), "device": torch.cuda.get_device_name(0),
                  "reserved": int(torch.cuda.memory_reserved())}), flush=True)
for line in sys.stdin:
    if line.strip() != "check":
        break
    intact = all(bool((c == i % 251 + 1).all()) for i, c in enumerate(chunks))
    torch.cuda.synchronize()
    print(json.dumps({"event": "checked", "intact": intact}), flush=True)
"""


def start_torch_child(ctx: Context, gib: int, gpu: str) -> subprocess.Popen[str]:
    """The child process on ``gpu`` (a UUID); its stderr goes to a log that lands in checks.log."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
    env.pop("LD_PRELOAD", None)
    log = open(ctx.workdir / CHILD_LOG, "w", encoding="utf-8")  # noqa: SIM115 - the child owns it
    try:
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, str(gib)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=str(ctx.workdir),
        )
    finally:
        log.close()


class _Child:
    """Line-by-line JSON events from the child, read with a timeout."""

    def __init__(self, proc: subprocess.Popen[str], log: Callable[[str], None], stderr: Path) -> None:
        self.proc = proc
        self.stderr = stderr
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log = log
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def event(self, kind: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.0, left))
            except queue.Empty:
                raise TimeoutError(f"the child sent no {kind!r} within {timeout:.0f} s") from None
            if line is None:
                code = self.proc.wait()
                raise RuntimeError(f"the child ended (exit code {code}) before sending {kind!r}{self._last_words()}")
            try:
                event = json.loads(line)
            except ValueError:
                self._log(f"child: {line.rstrip()}")
                continue
            if event.get("event") == kind:
                return dict(event)

    def _last_words(self) -> str:
        try:
            lines = [line for line in self.stderr.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return ""
        return f": {lines[-1].strip()[:200]}" if lines else ""

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the child's loop ends at end of input
            self.proc.wait(timeout=15)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=15)


class _Gpu0:
    """Read-only NVML readings of GPU 0 (nothing here sets anything)."""

    def __init__(self, pynvml: Any) -> None:
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def read(self) -> tuple[float, int]:
        mw = float(self.nvml.nvmlDeviceGetPowerUsage(self.handle))
        try:
            pstate = int(self.nvml.nvmlDeviceGetPerformanceState(self.handle))
        except self.nvml.NVMLError:
            pstate = PSTATE_UNKNOWN
        return mw, pstate

    def persistence(self) -> str:
        try:
            mode = int(self.nvml.nvmlDeviceGetPersistenceMode(self.handle))
        except self.nvml.NVMLError as exc:
            return f"unknown ({exc})"
        return "on" if mode == self.nvml.NVML_FEATURE_ENABLED else "off"

    def compute_pids(self) -> list[int]:
        return sorted(int(p.pid) for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle))


# --- the check --------------------------------------------------------------------------------------------


def requires(probe: Probe, options: Options) -> str | None:
    return first(need_gpu(probe), need_checkpoint_api(probe), need_framework(probe, "torch"))


def run(ctx: Context) -> Result:
    return measure(ctx)


def measure(
    ctx: Context,
    start_child: Callable[[Context, int, str], subprocess.Popen[str]] = start_torch_child,
    timing: Timing = Timing(),  # frozen, so one shared default is safe
    gib: int = CHILD_GIB,
) -> Result:
    """The three windows and the verdict; ``start_child`` and ``timing`` are set only by the tests."""
    import pynvml  # type: ignore[import-not-found]

    data: dict[str, Any] = {"child_gib": gib, "timing": asdict(timing)}
    problems: list[str] = []
    pynvml.nvmlInit()
    gpu: _Gpu0 | None = None
    mover: _Mover | None = None
    child: _Child | None = None
    suspended = False

    def window(name: str, settle: float) -> dict[str, Any]:
        assert gpu is not None
        time.sleep(settle)
        summary = summarize_window(sample(gpu.read, timing.sample_s, timing.interval_s))
        summary["compute_pids"] = gpu.compute_pids()
        data[name] = summary
        ctx.log(f"{name}: {summary['median_w']} W median of {summary['samples']} readings, {summary['pstate']}")
        return summary

    try:
        gpu = _Gpu0(pynvml)
        try:
            gpu.read()
        except pynvml.NVMLError as exc:
            return Result.skip(ctx.name, f"GPU 0 reports no power draw (nvmlDeviceGetPowerUsage: {exc})")
        data["persistence_mode"] = gpu.persistence()
        # 1. Nothing of ours on GPU 0 (this process holds NVML only, no CUDA context).
        baseline = window("baseline", timing.baseline_settle_s)
        mover = _Mover(ctx.log)
        data["via"] = mover.via
        # 2. One child holding a context and memory, idle.
        uuids = gpu_uuids()
        child = _Child(start_child(ctx, gib, uuids[0] if uuids else "0"), ctx.log, ctx.workdir / CHILD_LOG)
        pid = child.proc.pid
        register_pid(pid, "the power check's CUDA process")
        data["ready"] = child.event("ready", timing.ready_s)
        held = nvml_process_memory({pid}).get(pid, 0)
        data["held_bytes"] = held
        if held <= 0:
            return Result.fail(ctx.name, "NVML lists no GPU memory for the child: cannot measure its suspend", **data)
        idle = window("idle_context", timing.settle_s)
        # 3. The same child suspended through the checkpointer: its memory (and context) gone.
        t0 = time.perf_counter()
        data["bytes_parked"] = mover.suspend(pid)
        suspended = True
        data["suspend_s"] = round(time.perf_counter() - t0, 3)
        data["state_suspended"] = mover.state(pid)
        released, _ = poll_until(
            lambda: nvml_process_memory({pid}).get(pid, 0) < 0.05 * held, timeout=timing.released_s, interval=0.1
        )
        data["process_bytes_suspended"] = nvml_process_memory({pid}).get(pid, 0)
        if not released:
            problems.append(
                f"NVML still shows {data['process_bytes_suspended'] / GIB:.2f} GiB for the suspended child "
                f"(held {held / GIB:.2f} GiB)"
            )
        parked = window("suspended", timing.settle_s)
        # 4. Resume: the child must read its memory back intact.
        t0 = time.perf_counter()
        mover.resume(pid)
        suspended = False
        data["resume_s"] = round(time.perf_counter() - t0, 3)
        child.send("check")
        checked = child.event("checked", timing.ready_s)
        if not checked.get("intact"):
            problems.append("the child's memory was not intact after the resume")
        verdict = PowerVerdict(baseline["median_w"], idle["median_w"], parked["median_w"])
        data["verdict"] = verdict.to_json()
        if not verdict.within:
            problems.append(verdict.explain())
    except Exception as exc:  # noqa: BLE001 - any error is this check's fail row, with what was measured so far
        data["traceback"] = traceback.format_exc()
        return Result.fail(ctx.name, f"{type(exc).__name__}: {exc}"[:300], **data)
    finally:
        try:
            if suspended and mover is not None and child is not None:  # never leave the child checkpointed
                mover.rescue(child.proc.pid)
        except Exception as exc:  # noqa: BLE001
            ctx.notes.append(f"cleanup restore/unlock failed: {exc}")
        if child is not None:
            child.end()
        if mover is not None:
            mover.close()
        pynvml.nvmlShutdown()
    windows = ("baseline", "idle_context", "suspended")
    others = sorted({p for name in windows for p in data[name]["compute_pids"]} - {pid})
    noted = f"; other GPU processes {others}" if others else ""
    return Result.verdict(ctx.name, problems, number=verdict.number(), data=data, noted=noted, detail=lambda: (
        f"{verdict.explain()}; {held / GIB:.2f} GiB freed while suspended and intact after the resume; "
        f"P-states {'/'.join(data[name]['pstate'] for name in windows)} (baseline/idle/suspended); "
        f"persistence {data['persistence_mode']}; via {mover.via}{noted}"
    ))


SPEC = CheckSpec(
    name="power",
    title="GPU power with every kernel suspended vs one idle kernel holding its context",
    requires=requires,
    run=run,
    timeout=120,
    min_seconds=75,
)

__all__ = ["SPEC"]
