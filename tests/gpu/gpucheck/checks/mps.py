"""Check 4: CUDA MPS. A control daemon in a private pipe directory; a raw client under
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` cannot allocate past it; a kernel started by the
provisioner (``GPUPOOL_MPS_PIPE_DIRECTORY`` set) gets the limit of its slice and raw
``cuMemAlloc`` past the slice fails; the daemon is stopped at the end. The GPU's compute mode
is never touched (MPS runs in the Default mode too).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..harness import HarnessError, register_cleanup, register_pid
from ..probe import Probe, first, need_gpu, need_provisioner, need_server
from ..report import Result, Status
from . import CheckSpec, Context, Options
from .common import GIB, MIB, emit, grant_problems, poll_until, slice_server

RAWCUDA = str(Path(__file__).resolve().parents[1] / "rawcuda.py")
DIRECT_LIMIT_MIB = 2048


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.mps_control else "nvidia-cuda-mps-control not on PATH: MPS not installed here",
        None if probe.libcuda else "libcuda.so.1 not loadable: no raw cuMemAlloc",
        need_server(probe),
        need_provisioner(probe),
    )


def mps_processes(pipe: Path) -> list[int]:
    """Pids of MPS control daemons and servers serving ``pipe`` (found through /proc)."""
    found = []
    needle = f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "comm").read_text().startswith("nvidia-cuda-mps"):
                continue
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _control(env: dict[str, str], command: str, timeout: float = 20) -> str:
    proc = subprocess.run(
        ["nvidia-cuda-mps-control"],
        input=command + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return (proc.stdout + proc.stderr).strip()


def _raw_alloc(env: dict[str, str], nbytes: int, workdir: Path, tag: str) -> dict[str, object]:
    """Run rawcuda.py in a fresh process with ``env``; return its JSON report."""
    ready = workdir / f"{tag}.json"
    proc = subprocess.run(
        [sys.executable, RAWCUDA, "alloc", "--bytes", str(nbytes), "--hold", "0", "--ready-file", str(ready)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if ready.exists():
        return json.loads(ready.read_text())
    return {"ok": False, "error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-200:]}"}


def run(ctx: Context) -> Result:
    slice_bytes = ctx.options.slice_bytes
    pipe = ctx.workdir / "mps-pipe"
    logs = ctx.workdir / "mps-log"
    pipe.mkdir(parents=True, exist_ok=True)
    logs.mkdir(parents=True, exist_ok=True)
    mps_env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(mps_env)
    data: dict[str, object] = {"pipe_directory": str(pipe), "slice": slice_bytes}
    problems: list[str] = []
    register_cleanup(["nvidia-cuda-mps-control"], mps_env, "MPS control daemon")
    started = subprocess.run(
        ["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    if started.returncode != 0:
        return Result.fail(
            ctx.name,
            f"nvidia-cuda-mps-control -d failed ({started.returncode}): {(started.stderr or started.stdout).strip()[:200]}",
            **data,
        )
    server = None
    try:
        up, _ = poll_until(lambda: (pipe / "control").exists(), timeout=10, interval=0.1)
        if not up:
            return Result.fail(ctx.name, f"MPS control daemon made no control pipe in {pipe}", **data)
        for pid in mps_processes(pipe):
            register_pid(pid, "MPS control daemon")
        # 1. The mechanism alone: a raw client under a 2 GiB pinned limit.
        direct_env = {**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={DIRECT_LIMIT_MIB}M"}
        small = _raw_alloc(direct_env, 1 * GIB, ctx.workdir, "direct-small")
        big = _raw_alloc(direct_env, 3 * GIB, ctx.workdir, "direct-big")
        data["direct"] = {"limit_mib": DIRECT_LIMIT_MIB, "1GiB": small, "3GiB": big}
        data["server_list"] = _control(env, "get_server_list")
        if not small.get("ok"):
            problems.append(
                f"under MPS a 1 GiB raw allocation failed ({small.get('error')}): the MPS server does not serve clients here"
            )
        elif big.get("ok"):
            problems.append(f"MPS let a client with a {DIRECT_LIMIT_MIB} MiB pinned limit allocate 3 GiB")
        if problems:
            return Result(
                ctx.name, Status.FAIL, number="limit not enforced", detail="; ".join(problems)[:400], data=data
            )
        # 2. Through the provisioner: the kernel's env carries the slice's limit, and it bites.
        server = slice_server(
            ctx.workdir, slice_bytes, "server-mps", ctx.log, env={"GPUPOOL_MPS_PIPE_DIRECTORY": str(pipe)}
        )
        server.start()
        kernel = server.kernel()
        problems += grant_problems(kernel, slice_bytes)
        expected = f"0={slice_bytes // MIB}M"
        data["kernel_env"] = kernel.env
        if kernel.env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") != expected:
            problems.append(
                f"kernel got CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={kernel.env.get('CUDA_MPS_PINNED_DEVICE_MEM_LIMIT')!r}, expected {expected!r}"
            )
        if kernel.env.get("CUDA_MPS_PIPE_DIRECTORY") != str(pipe):
            problems.append(f"kernel got CUDA_MPS_PIPE_DIRECTORY={kernel.env.get('CUDA_MPS_PIPE_DIRECTORY')!r}")
        chunk = int(slice_bytes * 0.6)
        cell = kernel.run(
            "from gpucheck.rawcuda import Driver, CudaError\n"
            "_gc_drv = Driver(); _gc_drv.primary_context(0)\n"
            f"_gc_first = _gc_drv.mem_alloc({chunk})\n"
            "try:\n"
            f"    _gc_drv.mem_alloc({chunk}); _gc_second = 'ok'\n"
            "except CudaError as e:\n"
            "    _gc_second = e.name\n" + emit('{"second": _gc_second, "info": _gc_drv.mem_get_info()}'),
            timeout=60,
        )
        if not cell.ok:
            problems.append(
                f"raw allocation of {chunk / GIB:.1f} GiB within the slice failed under MPS: {cell.brief()}"
            )
        else:
            data["kernel_alloc"] = cell.last()
            if cell.last()["second"] == "ok":
                problems.append(
                    f"raw cuMemAlloc reached {2 * chunk / GIB:.1f} GiB in a {slice_bytes / GIB:g} GiB slice under MPS"
                )
        data["server_errors"] = server.log_errors()
    except HarnessError as exc:
        problems.append(str(exc))
    finally:
        if server is not None:
            server.stop()
        data["quit"] = _control(env, "quit")
        stopped, _ = poll_until(lambda: not mps_processes(pipe), timeout=15, interval=0.2)
        data["daemon_stopped"] = bool(stopped)
        if not stopped:
            problems.append("MPS control daemon still running after quit")
    number = f"{slice_bytes / GIB:g} GiB slice: {0.6 * slice_bytes / GIB:.1f} ok, {1.2 * slice_bytes / GIB:.1f} refused"
    return Result.verdict(
        ctx.name, problems, number=number, data=data,
        detail=lambda: f"private pipe dir; {DIRECT_LIMIT_MIB} MiB pinned limit refused 3 GiB; provisioner set {expected}; daemon stopped",
    )


SPEC = CheckSpec(
    name="mps",
    title="CUDA MPS pinned memory limit from the provisioner (private daemon)",
    requires=requires,
    run=run,
    timeout=120,
    min_seconds=40,
)
