"""Device control as a role on the grant's transitions: from the pool's leases, what each kernel
may open now, applied to its device cgroup (:mod:`.device_control`).

- granted, also while being suspended (its memory is being copied off the GPU): its GPUs;
- granted and being moved: the GPUs it leaves and the ones it goes to, until the move is confirmed;
- suspended (parked) or queued: no GPU;
- released: no GPU, and its cgroup goes once its last process has exited.

A device cgroup gates ``open()`` only: a kernel that keeps its CUDA context after a release or a
park keeps its descriptor; the pool's driver-read rule keeps that memory taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import psutil

from jupyter_gpupool.core.models import Device, Lease, LeaseState, Transition
from jupyter_gpupool.enforcement.claims import UnixUsers, may_claim
from jupyter_gpupool.enforcement.device_control import DeviceCgroups, DeviceControlError


def allowed_devices(lease: Lease) -> tuple[str, ...] | None:
    """The device uuids a lease's kernel may open now; None once the lease is over."""
    if lease.state is LeaseState.RELEASED:
        return None
    if lease.state is not LeaseState.GRANTED:
        return ()
    if lease.transition is Transition.MIGRATING:
        return tuple(dict.fromkeys(lease.devices + lease.migrate_from))
    return lease.devices


def minors_of(uuids: Iterable[str], devices: Mapping[str, Device]) -> frozenset[int]:
    """GPU minors (``/dev/nvidiaN``'s N) of device uuids; a MIG instance opens its GPU's node."""
    minors = set()
    for uuid in uuids:
        device = devices.get(uuid)
        if device is not None and device.minor is not None:
            minors.add(device.minor)
    return frozenset(minors)


def lease_processes(leases: Iterable[Lease], users: UnixUsers, host: str) -> dict[str, list[int]]:
    """Each lease's processes by the pool's one claim rule: a process whose environment names the
    lease (``GPUPOOL_LEASE_ID``) and that the lease may claim (it runs as the owner's uid, or is
    root and the lease's holder or started by it). A process that only copied the variable is not."""
    wanted = {lease.id: lease for lease in leases}
    found: dict[str, list[int]] = {}
    uids: dict[int, int | None] = {}
    for process in psutil.process_iter(["environ"]):
        lease = wanted.get((process.info.get("environ") or {}).get("GPUPOOL_LEASE_ID", ""))
        if lease is None:
            continue
        try:
            chain = [process, *process.parents()]
        except psutil.Error:
            continue  # it exited
        if may_claim(chain, 0, lease, users, host, uids):
            found.setdefault(lease.id, []).append(process.pid)
    return found


class DeviceControlRole:
    """Keeps every kernel's device cgroup in step with its lease (call :meth:`apply` after each
    decision). ``pids_of(lease)`` names the kernel's processes by the pool's claim rule."""

    def __init__(self, cgroups: DeviceCgroups, pids_of: Callable[[Lease], list[int]]) -> None:
        self.cgroups = cgroups
        self.pids_of = pids_of

    def apply(self, leases: Iterable[Lease], devices: Iterable[Device]) -> dict[str, str]:
        """Bring every lease's cgroup in line; returns what changed per lease id: ``allowed``,
        ``denied``, ``removed``, ``no process`` (granted, its kernel not started yet), or the error."""
        by_uuid = {d.uuid: d for d in devices}
        done: dict[str, str] = {}
        for lease in leases:
            try:
                outcome = self._apply_one(lease, by_uuid)
            except (DeviceControlError, OSError) as exc:
                outcome = f"failed: {exc.strerror or exc}"
            if outcome:
                done[lease.id] = outcome
        return done

    def _apply_one(self, lease: Lease, devices: Mapping[str, Device]) -> str:
        uuids = allowed_devices(lease)
        known = lease.id in self.cgroups.kernels
        if uuids is None:
            if not known:
                return ""
            return "removed" if self.cgroups.forget(lease.id) else "denied"
        minors = minors_of(uuids, devices)
        if known and self.cgroups.granted.get(lease.id) == minors:
            # the same rules; a process the kernel started by other means than fork joins too
            pids = [pid for pid in self.pids_of(lease) if pid not in _procs_of(self.cgroups.kernels[lease.id])]
            if pids:
                self.cgroups.grant(lease.id, pids, minors)
            return ""
        if not minors and not known:
            return ""  # queued or parked and never granted here: the user-level deny holds it
        pids = self.pids_of(lease)
        if not pids and not known:
            return "no process"
        self.cgroups.grant(lease.id, pids, minors)
        return "allowed" if minors else "denied"


def _procs_of(directory: str) -> set[int]:
    try:
        with open(f"{directory}/cgroup.procs", encoding="ascii") as handle:
            return {int(line) for line in handle if line.strip()}
    except OSError:
        return set()
