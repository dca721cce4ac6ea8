"""Check: device control (docs/device-control.md) on a real GPU. Through the product's own entry
points (:class:`jupyter_gpupool.enforcement.device_control.DeviceControl` and the cgroups it
returns), a cgroup of the check's own stands for the pooled users' cgroup and gets the user-level
deny. Then:

- a raw CUDA program (``rawcuda.py alloc``, ``cuMemAlloc``) started in this process's own cgroup
  allocates (the control: the GPU works, and the deny below is what stops it);
- the same program started in the denied cgroup does not get the GPU, and NVML shows it nothing;
- a PyTorch process of that cgroup granted GPU 0 (``grant``: moved into its kernel cgroup before
  it imports torch) sees exactly that GPU (count and UUID) and allocates on it;
- after ``release``, a new process in that kernel cgroup is denied again.

Skips with the product's own reason where device control cannot run on the machine (not root,
cgroups not writable, as in most containers, or no device-program support). Everything it makes
is named after its own pid and removed, also when the runner cuts it off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ..harness import register_cleanup, register_pid
from ..probe import Probe, first, need_framework, need_gpu, need_module
from ..report import Result
from . import CheckSpec, Context, Options
from .common import MIB, RAWCUDA, nvml_process_memory, poll_until

PROBE_BYTES = 256 * MIB  # what each raw program and the granted PyTorch process allocate

# Removes the check's cgroups (deepest first) after ending what is still in them; run by the
# runner when the check is cut off (register_cleanup), and by the check itself at its end.
CLEANUP = r"""
import os, signal, sys, time
for directory in sorted(sys.argv[1:], key=len, reverse=True):
    if not os.path.isdir(directory):
        continue
    for _ in range(50):
        try:
            pids = [int(p) for p in open(os.path.join(directory, "cgroup.procs")).read().split()]
        except OSError:
            break
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    for _ in range(20):
        try:
            os.rmdir(directory)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.1)
"""

# Waits for "go" (the check grants it its GPU first), then imports torch and says what it sees.
GRANTED_CHILD = r"""
import json, sys
sys.stdin.readline()
import torch
seen = {"count": torch.cuda.device_count() if torch.cuda.is_available() else 0, "uuids": [], "allocated": 0}
for i in range(seen["count"]):
    props = torch.cuda.get_device_properties(i)
    seen["uuids"].append(str(getattr(props, "uuid", "")))
if seen["count"]:
    try:
        t = torch.ones(int(sys.argv[1]) // 4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        seen["allocated"] = int(t.numel() * 4)
    except Exception as exc:
        seen["error"] = f"{type(exc).__name__}: {exc}"[:200]
print(json.dumps(seen), flush=True)
sys.stdin.readline()
"""


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.libcuda else "libcuda.so.1 not loadable: no raw cuMemAlloc",
        need_framework(probe, "torch"),
        need_module(probe, "jupyter_gpupool.enforcement.device_control"),
        None if probe.root else "not root: only root may change device cgroups, as the broker does",
    )


# --- the verdict (pure; tests/test_gpu_checks.py feeds it passing and failing readings) ------------


def same_gpu(torch_uuid: str, nvml_uuid: str) -> bool:
    """PyTorch names a GPU ``1f2e...``, NVML ``GPU-1f2e...``."""
    def bare(text: str) -> str:
        return text.lower().removeprefix("gpu-")

    return bool(torch_uuid) and bare(torch_uuid) == bare(nvml_uuid)


def problems_of(seen: dict[str, Any]) -> list[str]:
    """What the readings say went wrong; empty when the check passes."""
    found: list[str] = []
    control = seen.get("control") or {}
    if not control.get("ok"):
        found.append(f"the raw CUDA program outside the denied cgroup could not allocate either ({control.get('error')}): "
                     "nothing below says anything about device control")
        return found
    denied = seen.get("denied") or {}
    if denied.get("ok") or int(seen.get("denied_nvml_bytes") or 0) > 0:
        found.append(f"a raw CUDA program in the denied cgroup got the GPU ({int(denied.get('allocated') or 0) // MIB} MiB)")
    elif not denied:
        found.append("the raw CUDA program in the denied cgroup reported nothing")
    granted = seen.get("granted") or {}
    want = seen.get("granted_uuid", "")
    if granted.get("count") != 1 or not granted.get("uuids") or not same_gpu(granted["uuids"][0], want):
        found.append(f"the granted PyTorch process saw {granted.get('count')} GPU(s) {granted.get('uuids')}, "
                     f"not exactly its own ({want})")
    elif int(granted.get("allocated") or 0) < PROBE_BYTES:
        found.append(f"the granted PyTorch process could not allocate on its GPU: {granted.get('error')}")
    released = seen.get("after_release") or {}
    if released.get("ok"):
        found.append("after release, a new process in the kernel's cgroup still got the GPU")
    return found


# --- the check --------------------------------------------------------------------------------------


def _joiner(directory: str) -> Callable[[], None]:
    """A ``preexec_fn`` that puts the new process into ``directory`` before it runs anything."""
    procs = os.path.join(directory, "cgroup.procs")

    def join() -> None:
        with open(procs, "w", encoding="utf-8") as fh:
            fh.write("0\n")

    return join


def _raw(ctx: Context, name: str, directory: str | None) -> tuple[dict[str, Any], int]:
    """Run ``rawcuda.py alloc`` (in ``directory`` when given); its report and NVML's bytes for it."""
    ready = ctx.workdir / f"{name}.ready"
    stop = ctx.workdir / f"{name}.stop"
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # every GPU it can open
    proc = subprocess.Popen(
        [sys.executable, str(RAWCUDA), "alloc", "--bytes", str(PROBE_BYTES), "--hold", "30",
         "--ready-file", str(ready), "--stop-file", str(stop)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=_joiner(directory) if directory else None,  # noqa: PLW1509 - one write, no threads involved
    )
    register_pid(proc.pid, f"raw CUDA program ({name})")
    try:
        poll_until(lambda: ready.exists() or proc.poll() is not None, timeout=60, interval=0.05)
        report = json.loads(ready.read_text()) if ready.exists() else {"ok": False, "error": f"exited {proc.poll()} without a report"}
        held = nvml_process_memory({proc.pid}).get(proc.pid, 0)
    finally:
        stop.touch()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return report, held


def _gpu0() -> tuple[str, int]:
    """GPU 0's UUID and the driver's minor number (``/dev/nvidiaN``)."""
    import pynvml  # type: ignore[import-not-found]

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)), int(pynvml.nvmlDeviceGetMinorNumber(handle))
    finally:
        pynvml.nvmlShutdown()


def _cleanup(dirs: list[str]) -> None:
    subprocess.run([sys.executable, "-c", CLEANUP, *dirs], timeout=30, check=False)


def run(ctx: Context) -> Result:
    from jupyter_gpupool.enforcement.device_control import DeviceControl, DeviceControlError, cgroup_mounts

    tag = f"gpucheck{os.getpid()}"
    unified, devices = cgroup_mounts()
    mount = devices or unified  # where mode "auto" puts its rules (v1 'devices' where mounted)
    if mount is None:
        return Result.skip(ctx.name, "no cgroup hierarchy is mounted: device control cannot run on this machine")
    users, subtree = os.path.join(mount, f"{tag}-users"), os.path.join(mount, f"{tag}-kernels")
    kernel_name = f"{tag}-kernel-granted"  # DeviceCgroups.kernel_dir_name("granted"): v2 under users, v1 under subtree
    made = [os.path.join(users, kernel_name), os.path.join(subtree, kernel_name), users, subtree]
    try:
        os.mkdir(users, 0o755)
    except OSError as exc:
        return Result.skip(ctx.name, f"cgroups not writable here: cannot make {users} ({exc.strerror}); "
                                     "device control cannot run on this machine")
    register_cleanup([sys.executable, "-c", CLEANUP, *made], {}, "the device-control check's cgroups")
    seen: dict[str, Any] = {"mount": mount}
    control = DeviceControl(mode="auto", user_cgroups=[os.path.basename(users)], name=tag, kernel_subtree=subtree)
    cgroups = None
    child: subprocess.Popen[str] | None = None
    try:
        cgroups = control.start(single_user=False)
        seen["device_control"] = control.describe()
        if cgroups is None:
            return Result.skip(ctx.name, f"device control is off on this machine: {control.reason}")
        if os.path.basename(users) not in control.denied_in:
            return Result.fail(ctx.name, f"the user-level deny was not put on {users} (not found: {control.missing})", **seen)
        uuid, minor = _gpu0()
        seen.update(granted_uuid=uuid, granted_minor=minor, mode=cgroups.mode)
        seen["control"], _ = _raw(ctx, "control", None)
        seen["denied"], seen["denied_nvml_bytes"] = _raw(ctx, "denied", users)
        child = subprocess.Popen(
            [sys.executable, "-c", GRANTED_CHILD, str(PROBE_BYTES)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
            preexec_fn=_joiner(users),  # noqa: PLW1509
        )
        register_pid(child.pid, "granted PyTorch process")
        assert child.stdin is not None and child.stdout is not None
        t0 = time.perf_counter()
        kernel_dir = cgroups.grant("granted", [child.pid], [minor])
        seen["kernel_cgroup"] = kernel_dir
        seen["grant_s"] = round(time.perf_counter() - t0, 4)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline()
        seen["granted"] = json.loads(line) if line.strip() else {"error": f"exited {child.poll()} without a report"}
        cgroups.release("granted")
        seen["after_release"], _ = _raw(ctx, "after-release", kernel_dir)
    except DeviceControlError as exc:
        return Result.fail(ctx.name, f"DeviceControlError: {exc.strerror or exc}", **seen)
    finally:
        if child is not None:
            child.kill()
            child.wait()
        if cgroups is not None:
            cgroups.remove_all()
        _cleanup(made)
        seen["left_cgroups"] = [d for d in made if os.path.isdir(d)]
    problems = problems_of(seen)
    number = f"{seen['mode']}: denied {'no' if seen['denied'].get('ok') else 'yes'}, granted sees {seen['granted'].get('count')} GPU"
    return Result.verdict(ctx.name, problems, number=number, data=seen, detail=lambda: (
        f"raw cuMemAlloc outside: ok; in the denied cgroup: {seen['denied'].get('error')}; the granted PyTorch "
        f"process saw exactly {uuid} and allocated {PROBE_BYTES // MIB} MiB; denied again after release "
        f"({seen['after_release'].get('error')})"))


SPEC = CheckSpec(
    name="device-control",
    title="Device control: a denied process's raw CUDA gets no GPU; a granted kernel's PyTorch sees exactly its GPU",
    requires=requires,
    run=run,
    timeout=90,
    min_seconds=30,
)

__all__ = ["SPEC"]
