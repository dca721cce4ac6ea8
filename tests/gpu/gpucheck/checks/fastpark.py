"""Check 7: the fast parking path. Park and restore 8 and 32 GiB of PyTorch tensors through the
product's framework path (:mod:`jupyter_gpupool.kernel.parking`: torch-memory-saver's region,
entered when ``torch`` is imported, CPU backup on, kept between suspends), in a child process set
up as a pooled kernel is (the framework caps installed first, a slice in ``GPUPOOL_MEMORY_LIMIT``).

Measured each way, for a first park (the pinned backup is allocated then) and a second one (the
backup kept from the first is reused): GB/s against a pinned ``copy_`` measured in the same
process. Checked: the tensors are bit-identical and at the same addresses after each restore,
NVML shows the child's memory freed while parked, and PyTorch's per-process fraction (the cap)
still refuses an allocation past the slice inside the region. Goal: 20 GB/s each way on a reused
backup. The server's side (choosing the path, falling back) is tested without a GPU
(tests/test_parking_paths.py); the driver checkpoint of what is left is the suspend check's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from ..probe import Probe, first, need_framework, need_gpu, need_module
from ..report import Result
from . import CheckSpec, Context, Options
from .common import GIB, gpu_uuids, nvml_process_memory

SIZES_GIB = (8, 32)
GOAL_BYTES_PER_S = 20e9
SLICE_BYTES = 48 * GIB  # above the largest size, below an H200's memory: the cap is checked against it

CHILD = r"""
import json, sys, time
from jupyter_gpupool.enforcement.caps import FrameworkCaps
from jupyter_gpupool.kernel.parking import FrameworkParking

def say(**fields):
    print(json.dumps(fields), flush=True)

caps = FrameworkCaps.from_env()
caps.install()
parking = FrameworkParking()
parking.start(caps.finder.register)
import torch  # the region is entered here, before the first allocation, as in a kernel

if parking.saver is None:
    say(event="refused", reason=parking.reason)
    sys.exit(0)
torch.cuda.init()
say(event="cap", record=caps.describe())

def pinned_speed():
    host = torch.empty(2**30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dev.copy_(host); torch.cuda.synchronize()
    t = time.perf_counter(); [dev.copy_(host, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize()
    h2d = 4 * 2**30 / (time.perf_counter() - t)
    t = time.perf_counter(); [host.copy_(dev, non_blocking=True) for _ in range(4)]; torch.cuda.synchronize()
    d2h = 4 * 2**30 / (time.perf_counter() - t)
    del host, dev
    torch.cuda.empty_cache()
    return h2d, d2h

h2d, d2h = pinned_speed()
say(event="pinned", h2d=h2d, d2h=d2h)

def fill(gib, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = int(gib * 2**30) // 4
    return [torch.randint(0, 2**31 - 1, (min(2**28, total - i),), dtype=torch.int32, device="cuda", generator=gen)
            for i in range(0, total, 2**28)], total

def identical(tensors, total, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for start, tensor in zip(range(0, total, 2**28), tensors):
        ref = torch.randint(0, 2**31 - 1, (min(2**28, total - start),), dtype=torch.int32, device="cuda", generator=gen)
        if not torch.equal(ref, tensor):
            return False
        del ref
    torch.cuda.empty_cache()
    return True

for gib in [int(a) for a in sys.argv[1:]]:
    tensors, total = fill(gib, 1234 + gib)
    addresses = [t.data_ptr() for t in tensors]
    torch.cuda.synchronize()
    for round_name in ("first", "again"):
        t = time.perf_counter()
        reply = parking.park()
        park_s = time.perf_counter() - t
        say(event="parked", gib=gib, round=round_name, reply=reply, park_s=park_s)
        sys.stdin.readline()  # the parent reads NVML meanwhile
        t = time.perf_counter()
        back = parking.unpark()
        torch.cuda.synchronize()
        resume_s = time.perf_counter() - t
        same = [t.data_ptr() for t in tensors] == addresses
        say(event="resumed", gib=gib, round=round_name, reply=back, resume_s=resume_s, same_addresses=same,
            identical=identical(tensors, total, 1234 + gib))
    del tensors
    torch.cuda.empty_cache()

try:
    over = torch.empty(caps.limit + 2**30, dtype=torch.uint8, device="cuda")
    say(event="cap_held", held=False, detail="allocated past the slice inside the region")
    del over
except torch.cuda.OutOfMemoryError as err:
    say(event="cap_held", held=True, detail=str(err).splitlines()[0][:160])
say(event="done")
"""


def requires(probe: Probe, options: Options) -> str | None:
    return first(
        need_gpu(probe),
        need_framework(probe, "torch"),
        need_framework(probe, "torch_memory_saver"),
        need_module(probe, "jupyter_gpupool.devices.nvml"),
    )


def _gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def problems_of(data: dict[str, Any]) -> list[str]:
    """What the child's events and NVML's readings say went wrong (pure; tests/test_gpu_checks.py
    feeds it readings): each park freed the memory (NVML), each restore bit-identical at the same
    addresses, the cap held inside the region, and both ways at least the goal on a reused backup."""
    found: list[str] = []
    for r in data.get("rounds", []):
        gib, name = r["gib"], r["round"]
        held = int(r.get("nvml_while_parked") or 0)
        if (r.get("reply") or {}).get("status") == "error":
            found.append(f"{gib} GiB {name} park failed: {r['reply'].get('message')}")
        elif held > gib * GIB * 0.1 + 2 * GIB:  # the context and a little besides may stay
            found.append(f"{gib} GiB parked but NVML still shows {held / GIB:.1f} GiB held by the process")
        if "identical" in r and (not r["identical"] or not r["same_addresses"]):
            found.append(f"{gib} GiB {name} restore: identical={r['identical']}, same addresses={r['same_addresses']}")
    cap = data.get("cap_held")
    if cap is None:
        found.append("the cap inside the region was never tried")
    elif not cap.get("held"):
        found.append("PyTorch's per-process fraction did not hold inside the region: " + str(cap.get("detail")))
    reused = [r for r in data.get("rounds", []) if r.get("round") == "again" and "resume_gbps" in r]
    if sorted(r["gib"] for r in reused) != sorted(data.get("sizes_gib", SIZES_GIB)):
        found.append("not every size was parked and restored twice")
    for r in reused:
        for way in ("park_gbps", "resume_gbps"):
            if r[way] * 1e9 < GOAL_BYTES_PER_S:
                found.append(f"{r['gib']} GiB reused-backup {way.split('_')[0]} at {r[way]:.1f} GB/s, "
                             f"below the {GOAL_BYTES_PER_S / 1e9:.0f} GB/s goal")
    return found


def run(ctx: Context) -> Result:
    data: dict[str, Any] = {"sizes_gib": list(SIZES_GIB), "rounds": []}
    uuids = gpu_uuids()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": uuids[0] if uuids else "0",
        "GPUPOOL_MEMORY_LIMIT": str(SLICE_BYTES),
        "GPUPOOL_FAST_PARKING": "auto",
    }
    env.pop("LD_PRELOAD", None)
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *map(str, SIZES_GIB)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(ctx.workdir),
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        for line in child.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                ctx.log(line.rstrip())
                continue
            kind = event.get("event")
            if kind == "refused":
                return Result.fail(ctx.name, f"the kernel's probe refused the framework path: {event.get('reason')}", **data)
            if kind == "pinned":
                data["pinned_h2d"], data["pinned_d2h"] = event["h2d"], event["d2h"]
            elif kind == "cap":
                data["caps"] = event.get("record")
            elif kind == "parked":
                gib = event["gib"]
                event["nvml_while_parked"] = nvml_process_memory({child.pid}).get(child.pid, 0)
                data["rounds"].append(event)
                ctx.log(f"{gib} GiB {event['round']}: parked, NVML shows {event['nvml_while_parked'] / GIB:.2f} GiB held")
                child.stdin.write("go\n")
                child.stdin.flush()
            elif kind == "resumed":
                parked = data["rounds"][-1]
                parked.update(resume_s=event["resume_s"], same_addresses=event["same_addresses"], identical=event["identical"])
                size = event["gib"] * GIB
                parked["park_gbps"], parked["resume_gbps"] = _gbps(size, parked["park_s"]), _gbps(size, event["resume_s"])
                ctx.log(f"{event['gib']} GiB {event['round']}: park {parked['park_gbps']:.1f} GB/s, "
                        f"restore {parked['resume_gbps']:.1f} GB/s")
            elif kind == "cap_held":
                data["cap_held"] = event
            elif kind == "done":
                break
        child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    if child.returncode not in (0, None):
        tail = (child.stderr.read() if child.stderr else "")[-400:].strip().splitlines()
        return Result.fail(ctx.name, f"the child process failed ({child.returncode}): {tail[-1] if tail else 'no output'}", **data)
    problems = problems_of(data)
    reused = [r for r in data["rounds"] if r.get("round") == "again" and "resume_gbps" in r]
    pinned = f"pinned copy {data.get('pinned_d2h', 0) / 1e9:.0f}/{data.get('pinned_h2d', 0) / 1e9:.0f} GB/s d2h/h2d"
    number = ", ".join(f"{r['gib']} GiB {r['park_gbps']:.0f}/{r['resume_gbps']:.0f} GB/s" for r in reused) or "-"
    firsts = [r for r in data["rounds"] if r.get("round") == "first" and "resume_gbps" in r]
    first_parks = ", ".join(f"{r['park_gbps']:.1f}" for r in firsts)
    detail = f"park/restore on a reused pinned backup; first park {first_parks} GB/s; {pinned}"
    return Result.verdict(ctx.name, problems, number=number, detail=detail, data=data, noted="; " + detail, limit=None)


SPEC = CheckSpec(
    name="fast-parking",
    title="Fast parking path: 8 and 32 GiB of PyTorch tensors parked and restored through torch-memory-saver",
    requires=requires,
    run=run,
    timeout=240,
    min_seconds=90,
)

__all__ = ["SPEC"]
