"""Check: memory a released lease's process still holds is granted to nobody until NVML shows it
freed. A raw CUDA process started with lease A in its environment holds 4 GiB; A is released
while a request that needs all but 2 GiB of that GPU waits. The product's pool (its NVML backend,
a pool file of the check's own) must keep the request queued and list the process as unpooled use
at NVML's figure, then grant the request once the process has exited.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from typing import Any

from ..probe import Probe, first, need_gpu, need_module
from ..report import Result
from . import CheckSpec, Context
from .common import GIB, MIB, nvml_process_memory, poll_until, start_raw_holder

HELD_BYTES = 4 * GIB  # what the released kernel's process keeps
ROOM_LEFT = 2 * GIB  # the waiting request needs all of the GPU but this
GRANT_WITHIN_S = 5.0  # after the process exits, at the next scheduling round


def requires(probe: Probe, options: object) -> str | None:
    return first(
        need_gpu(probe),
        None if probe.libcuda else "libcuda.so.1 not loadable: no raw cuMemAlloc",
        need_module(probe, "jupyter_gpupool.backends.local.pool"),
    )


def problems_of(seen: dict[str, Any]) -> list[str]:
    """What the readings say went wrong (pure; the test suite checks it)."""
    found: list[str] = []
    if seen.get("state_while_held") != "queued":
        found.append(f"the waiting request was {seen.get('state_while_held')} while the released process still held its memory")
    listed, nvml = int(seen.get("listed_bytes") or 0), int(seen.get("nvml_bytes") or 0)
    if not listed:
        found.append("the released process was not listed as unpooled use")
    elif abs(listed - nvml) > max(64 * MIB, 0.03 * nvml):
        found.append(f"the pool kept {listed / GIB:.2f} GiB taken, NVML showed the process holding {nvml / GIB:.2f} GiB")
    granted_after = seen.get("granted_after_exit_s")
    if granted_after is None:
        found.append(f"the waiting request was not granted within {GRANT_WITHIN_S:g} s of the process exiting")
    return found


def run(ctx: Context) -> Result:
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.core.models import LeaseRequest, LeaseState

    data: dict[str, Any] = {"held_bytes": HELD_BYTES}
    pool = Pool.from_env(environ={"GPUPOOL_DB": str(ctx.workdir / "released.sqlite"), "PATH": os.environ.get("PATH", "")})
    owner, me = getpass.getuser(), os.getpid()

    def ask(memory: int, name: str) -> Any:
        return pool.request(LeaseRequest(owner=owner, memory=memory, kernel_id=name, holder_pid=me, label="gpucheck released"))

    leasable = {d["uuid"]: int(d["memory_leasable"]) for d in pool.snapshot(viewer=owner, admin=True).devices}
    ready, stop = ctx.workdir / "held.ready", ctx.workdir / "held.stop"
    child: subprocess.Popen[bytes] | None = None
    leases: list[Any] = []
    try:
        first_lease = ask(max(leasable.values()), "gpucheck-released-a")
        leases.append(first_lease)
        if first_lease.state is not LeaseState.GRANTED:
            return Result.fail(ctx.name, f"a whole-GPU lease was not granted on an idle GPU ({first_lease.state.value})", **data)
        target = first_lease.devices[0]
        for index, uuid in enumerate(u for u in leasable if u != target):  # other GPUs filled: the request must wait for this one
            leases.append(ask(leasable[uuid], f"gpucheck-released-fill-{index}"))
        env = {**os.environ, "GPUPOOL_LEASE_ID": first_lease.id, "CUDA_VISIBLE_DEVICES": target}
        child, allocated = start_raw_holder(HELD_BYTES, env, ready, stop, hold=120)
        if not allocated:
            return Result.fail(ctx.name, "the process with the lease in its environment could not allocate", **data)
        waiting = ask(leasable[target] - ROOM_LEFT, "gpucheck-released-b")
        leases.append(waiting)
        pool.release(first_lease.id, reason="kernel shut down")
        pool.tick()
        data["state_while_held"] = pool.get(waiting.id).state.value
        rows = [row for row in pool.unpooled() if row.get("pid") == child.pid]
        data["listed_bytes"] = sum(int(row["bytes"]) for row in rows)
        data["listed_why"] = rows[0]["why"] if rows else ""
        data["nvml_bytes"] = nvml_process_memory({child.pid}).get(child.pid, 0)
        stop.touch()
        child.wait(30)
        exited = time.monotonic()

        def granted() -> bool:
            pool.tick()
            return pool.get(waiting.id).state is LeaseState.GRANTED

        done, _ = poll_until(granted, timeout=GRANT_WITHIN_S, interval=0.1)
        data["granted_after_exit_s"] = round(time.monotonic() - exited, 2) if done else None
    finally:
        stop.touch()
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        for lease in leases:
            pool.release(lease.id, reason="gpucheck done")
        pool.close()
    problems = problems_of(data)
    number = f"{data['listed_bytes'] / GIB:.2f} GiB kept taken; granted {data['granted_after_exit_s']} s after exit"
    return Result.verdict(ctx.name, problems, number=number, data=data,
                          detail="the waiting request stayed queued while the released process held its memory (= NVML)")


SPEC = CheckSpec(
    name="released-held",
    title="Memory a released lease's process still holds goes to nobody until NVML shows it freed",
    requires=requires,
    run=run,
    timeout=120,
    min_seconds=30,
)
