"""Driver checkpoints under device control: each one runs in a short-lived worker that the pool
places in the kernel's own GPU access.

Device control denies a user's Jupyter server every GPU node, and the CUDA driver's checkpoint
calls need a driver started in the calling process (``cuInit``: "the restoring process needs
persistence mode or its own cuInit"), which finds no device there. :class:`WorkerCheckpointer`
keeps the :class:`~.checkpoint_contract.Checkpointer` contract and runs each suspend, resume and
state query of its inner checkpointer in ``python -m jupyter_gpupool.devices.checkpoint_worker``:
a child of the server that names the kernel's lease in its environment (the lease of the kernel
device cgroup the kernel sits in), waits until the broker has put it in that cgroup, then starts
the driver and does the one operation there. The broker places a process by the pool's one claim
rule (:mod:`jupyter_gpupool.enforcement.claims`): a process of the lease owner's Unix user, or
root started by the lease's holder. A worker of anyone else is never placed: it gives up after
its join timeout and the operation fails, saying so. The probe the server makes before a kernel
starts checks all but the driver's start, which each worker makes inside the kernel's access.

The request goes to the worker as one JSON object on stdin, the answer comes back as one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import fields
from typing import Any

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.devices.checkpoint import CudaCheckpointer, SimulatedCheckpointer, untouched_state
from jupyter_gpupool.devices.checkpoint_contract import (
    Checkpointer,
    CheckpointError,
    CheckpointSupport,
    check_mapping,
    check_pid,
    check_timeout,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.device_join import POLL_SECONDS, in_kernel_cgroup
from jupyter_gpupool.errors import GpuPoolError

log = logging.getLogger(__name__)

#: Seconds a worker waits for the broker to place it (its passes come at least every second).
JOIN_TIMEOUT = 10.0
#: Seconds a worker may run past its join timeout and its operation's own before it is killed.
GRACE = 60.0

_KERNEL_CGROUP = "-kernel-"


def kernel_lease_of(pid: int, proc: str = "/proc") -> str:
    """The lease id of the kernel device cgroup process ``pid`` sits in (``…-kernel-<lease id>``
    on any hierarchy), or ``""`` when it sits in none."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return ""
    for line in lines:
        leaf = line.rsplit("/", 1)[-1]
        if _KERNEL_CGROUP in leaf:
            return leaf.rsplit(_KERNEL_CGROUP, 1)[1]
    return ""


# --- what a worker needs to rebuild the server's checkpointer ---------------------------------------------
class SnapshotGpus:
    """The broker's GPUs as the server read them for one operation (devices and driver versions),
    with process memory read in the worker, which may open its kernel's GPUs."""

    name = "nvml"

    def __init__(self, devices: list[Device], driver: str | None, cuda_api: int | None) -> None:
        self._devices = devices
        self._driver = (driver, cuda_api)
        self._local: Any = None

    def driver_versions(self) -> tuple[str | None, int | None]:
        return self._driver

    def devices(self) -> list[Device]:
        return list(self._devices)

    def process_usage(self) -> list[Any]:
        try:
            if self._local is None:
                from jupyter_gpupool.devices.nvml import NvmlBackend  # an NVML pool only: pynvml is optional

                self._local = NvmlBackend()
            return list(self._local.process_usage())
        except GpuPoolError as err:
            log.debug("no process memory from NVML in the checkpoint worker: %s", err)
            return []


def _device(data: dict[str, Any]) -> Device:
    names = {f.name for f in fields(Device)}
    given = {k: v for k, v in data.items() if k in names}
    given["nvlink_peers"] = frozenset(given.get("nvlink_peers") or ())
    return Device(**given)


def spec_of(inner: Checkpointer) -> dict[str, Any]:
    """What a worker needs to rebuild ``inner`` (read now: the GPUs' free memory changes)."""
    backend = getattr(inner, "backend", None)
    if isinstance(inner, SimulatedCheckpointer):
        return {
            "kind": "simulated",
            "usage_dir": inner.usage_dir,
            "spec": getattr(backend, "spec", "") or "",
            "node_dir": getattr(backend, "node_dir", None),
        }
    if isinstance(inner, CudaCheckpointer):
        told = getattr(backend, "driver_versions", None)
        driver, cuda_api = told() if callable(told) else (inner.probe().driver_version, None)
        devices = [d.to_json() for d in backend.devices()] if backend is not None else []
        return {"kind": "cuda", "devices": devices, "driver": driver, "cuda_api": cuda_api}
    raise CheckpointError(f"the {inner.name} checkpointer cannot run in a worker")


def build(spec: dict[str, Any], parked: dict[str, int] | None = None, pid: int = 0) -> Checkpointer:
    """The checkpointer ``spec`` describes, in this (worker) process; ``parked``: what the suspend
    of ``pid`` found it held (a resume checks room for it)."""
    if spec.get("kind") == "simulated":
        backend = None
        if spec.get("spec"):
            backend = SimulatedBackend.from_spec(str(spec["spec"]))
            backend.usage_dir = spec.get("usage_dir")
            backend.node_dir = spec.get("node_dir")
        return SimulatedCheckpointer(spec.get("usage_dir"), backend)
    if spec.get("kind") == "cuda":
        gpus = SnapshotGpus([_device(d) for d in spec.get("devices") or []], spec.get("driver"), spec.get("cuda_api"))
        checkpointer = CudaCheckpointer(gpus)
        if parked and pid:
            checkpointer._parked[pid] = dict(parked)
        return checkpointer
    raise CheckpointError(f"unknown checkpointer kind {spec.get('kind')!r}")


# --- the server's side ----------------------------------------------------------------------------------
class WorkerCheckpointer(Checkpointer):
    """``inner``'s suspend, resume and state, each run in a worker placed in the kernel's GPU
    access (device control); its probe checks all but the driver's start, which each worker makes."""

    def __init__(self, inner: Checkpointer, log_to: logging.Logger | Any = None, join_timeout: float = JOIN_TIMEOUT,
                 python: str = sys.executable, grace: float = GRACE) -> None:
        super().__init__()
        if not isinstance(inner, (SimulatedCheckpointer, CudaCheckpointer)):
            raise CheckpointError(f"the {inner.name} checkpointer cannot run in a worker")
        self.inner = inner
        inner.defer_driver_start = True
        self.name = inner.name
        self.log = log_to or log
        self.join_timeout = join_timeout
        self.python = python
        self.grace = grace
        self._parked: dict[int, dict[str, int]] = {}

    def _probe(self) -> CheckpointSupport:
        found = self.inner.probe()
        if not found.supported:
            return found
        return CheckpointSupport(
            True, found.backend, f"{found.reason}; under device control each runs in a worker inside its kernel's GPU access",
            found.driver_version,
        )

    def supports_devices(self, devices: list[Device]) -> str:
        return self.inner.supports_devices(devices)

    def suspend(self, pid: int, timeout: float = 30.0) -> int:
        pid = check_pid(pid)
        timeout = check_timeout(timeout)
        answer = self._run("suspend", pid, timeout, {"timeout": timeout})
        if answer.get("parked"):
            self._parked[pid] = dict(answer["parked"])
        return int(answer.get("value") or 0)

    def resume(self, pid: int, gpu_mapping: dict[str, str] | None = None) -> None:
        pid = check_pid(pid)
        mapping = check_mapping(gpu_mapping)
        self._run("resume", pid, 60.0, {"gpu_mapping": mapping or None, "parked": self._parked.get(pid)})
        self._parked.pop(pid, None)

    def state(self, pid: int) -> str:
        """As the driver says in a worker placed in the kernel's GPU access; ``""`` (not known)
        where no worker could ask it. Also what a worker that was killed or died left behind."""
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not process_alive(pid):
            return "gone"
        try:
            return str(self._run("state", pid, 30.0, {}).get("value") or "")
        except CheckpointError as err:
            self.log.warning("gpupool: the state of process %s is not known: %s", pid, err)
            return "gone" if not process_alive(pid) else ""

    def _run(self, op: str, pid: int, op_seconds: float, args: dict[str, Any]) -> dict[str, Any]:
        """Run ``op`` on ``pid`` in a worker; its answer, or :class:`CheckpointError` as it said."""
        lease_id = kernel_lease_of(pid)
        if not lease_id:
            raise CheckpointError(
                f"cannot {op} process {pid}: it is in no kernel device cgroup of the pool, so no process may open "
                "its GPU for the driver's checkpoint (device control)",
                state=untouched_state(pid, op),
            )
        request = {"op": op, "pid": pid, "lease_id": lease_id, "join_timeout": self.join_timeout,
                   "checkpointer": spec_of(self.inner), **args}
        env = {k: v for k, v in os.environ.items() if k not in ("GPUPOOL_KERNEL_ID", "GPUPOOL_LEASE_ID")}
        env["GPUPOOL_LEASE_ID"] = lease_id  # what the broker places it by, for a process of the owner only
        limit = self.join_timeout + op_seconds + self.grace
        try:
            done = subprocess.run(
                [self.python, "-m", "jupyter_gpupool.devices.checkpoint_worker"],
                input=json.dumps(request), capture_output=True, check=False, text=True, env=env, timeout=limit,
            )
        except OSError as err:  # never started: the driver was not touched
            raise CheckpointError(f"the checkpoint worker for process {pid} could not start: {err}",
                                  state=untouched_state(pid, op)) from None
        except subprocess.TimeoutExpired:
            # Killed, perhaps inside the driver's lock, checkpoint or restore: only the driver knows now.
            raise self._lost(op, pid, f"did not answer within {limit:g} s and was killed") from None
        answer = _last_json(done.stdout)
        if answer is None:
            said = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise self._lost(op, pid, f"failed without an answer ({said})")
        if "error" in answer:
            raise CheckpointError(str(answer["error"]), state=str(answer.get("state") or ""))
        if op != "state":
            self.log.info("gpupool: %s of process %s ran in checkpoint worker %s, placed in lease %s's GPU access",
                          op, pid, answer.get("worker"), lease_id)
        return answer


    def _lost(self, op: str, pid: int, what: str) -> CheckpointError:
        """The error for a worker that gave no answer: it may have stopped anywhere in ``op``, so
        the state is asked of a fresh worker; ``""`` (not known) where none can tell, never a guess."""
        after = "" if op == "state" else self.state(pid)
        left = f"the driver shows it {after}" if after else "its state is not known"
        return CheckpointError(f"the checkpoint worker to {op} process {pid} {what}; {left}", state=after)


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        try:
            found = json.loads(line)
        except ValueError:
            continue
        return found if isinstance(found, dict) else None
    return None


# --- the worker's side ----------------------------------------------------------------------------------
def serve(request: dict[str, Any]) -> dict[str, Any]:
    """Wait to be placed in the kernel's GPU access, then run the request's operation there."""
    op, pid, lease_id = str(request.get("op")), int(request.get("pid") or 0), str(request.get("lease_id") or "")
    wait = float(request.get("join_timeout") or JOIN_TIMEOUT)
    deadline = time.monotonic() + wait
    while not (lease_id and in_kernel_cgroup(lease_id)):
        if time.monotonic() >= deadline:
            return {"error": f"cannot {op} process {pid}: the pool did not place the checkpoint worker in its kernel's "
                             f"GPU access within {wait:g} s (it places only a process of the kernel's owner)", "state": untouched_state(pid, op)}
        time.sleep(POLL_SECONDS)
    try:
        inner = build(dict(request.get("checkpointer") or {}), request.get("parked"), pid)
        if op == "suspend":
            value: Any = inner.suspend(pid, float(request.get("timeout") or 30.0))
        elif op == "resume":
            value = inner.resume(pid, request.get("gpu_mapping"))
        elif op == "state":
            value = inner.state(pid)
        else:
            return {"error": f"unknown checkpoint operation {op!r}", "state": ""}
    except CheckpointError as err:
        return {"error": err.reason, "state": err.state}
    except Exception as err:  # noqa: BLE001 - one line back to the server, never a traceback
        return {"error": f"the checkpoint worker failed to {op} process {pid}: {err}", "state": untouched_state(pid, op)}
    parked = getattr(inner, "_parked", {}).get(pid) if op == "suspend" and isinstance(getattr(inner, "_parked", None), dict) else None
    return {"value": value, "parked": parked, "worker": os.getpid()}


def main() -> int:
    """Read one request on stdin, answer one JSON line on stdout."""
    try:
        request = json.loads(sys.stdin.read())
    except ValueError as err:
        request = f"not JSON: {err}"
    if not isinstance(request, dict):
        sys.stderr.write(f"usage: a checkpoint request as one JSON object on stdin ({request if isinstance(request, str) else 'not an object'})\n")
        return 2
    sys.stdout.write(json.dumps(serve(request)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
