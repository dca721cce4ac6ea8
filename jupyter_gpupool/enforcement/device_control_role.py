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

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import psutil

from jupyter_gpupool.core.models import Device, Lease, LeaseState, Transition
from jupyter_gpupool.enforcement.claims import EndedLeases, KernelLeases, UnixUsers, may_claim
from jupyter_gpupool.enforcement.device_control import DeviceCgroups, DeviceControl, DeviceControlError, Grant, MigSlice

#: What a granted kernel's status says under device control (``enforcement.device_access``).
DEVICE_ACCESS = "this kernel's GPU only"


def allowed_devices(lease: Lease) -> tuple[str, ...] | None:
    """The device uuids a lease's kernel may open now; None once the lease is over."""
    if lease.state is LeaseState.RELEASED:
        return None
    if lease.state is not LeaseState.GRANTED:
        return ()
    if lease.transition is Transition.MIGRATING:
        return tuple(dict.fromkeys(lease.devices + lease.migrate_from))
    return lease.devices


def minors_of(uuids: Iterable[str], devices: Mapping[str, Device]) -> frozenset[Grant]:
    """What device uuids open: a whole GPU by its minor (``/dev/nvidiaN``'s N); a MIG instance as
    its GPU's minor with its GPU and compute instance ids (its GPU's node and its own capability
    nodes). A MIG instance whose ids are unknown opens its whole GPU, as the GPU itself would."""
    minors: set[Grant] = set()
    for uuid in uuids:
        device = devices.get(uuid)
        if device is None or device.minor is None:
            continue
        if device.is_mig and device.mig_gi is not None and device.mig_ci is not None:
            minors.add(MigSlice(device.minor, device.mig_gi, device.mig_ci))
        else:
            minors.add(device.minor)
    return frozenset(minors)


def lease_processes(
    leases: Iterable[Lease],
    users: UnixUsers,
    host: str,
    earlier: Callable[[set[str]], Mapping[str, Lease]] | None = None,
) -> dict[str, list[int]]:
    """Each lease's processes by the pool's one claim rule: a process the lease may claim (it runs
    as the owner's uid, or is root and the lease's holder or started by it) whose environment
    names the lease, or names its kernel: the kernel id (``GPUPOOL_KERNEL_ID``, which the pool's
    provisioner gives every kernel, with a lease or without), or an earlier lease of the same
    owner and kernel (a kernel that released its lease and reserved again), or of the same
    holder process when the process is that holder (a kernel that leased for itself). A kernel
    that leases later is so found although the environment it started with, the one
    ``/proc/PID/environ`` shows, cannot name its new lease. A process that only copied a
    variable is not. ``earlier(ids)`` looks up leases no longer live that environments name."""
    leads = KernelLeases(leases, host, earlier)
    named: list[tuple[psutil.Process, dict[str, str]]] = []
    for process in psutil.process_iter(["environ"]):
        environ = process.info.get("environ") or {}
        if leads.may_lead(environ):
            named.append((process, environ))
    leads.look_up_ended(environ.get("GPUPOOL_LEASE_ID", "") for _p, environ in named)
    found: dict[str, list[int]] = {}
    uids: dict[int, int | None] = {}
    for process, environ in named:
        lease = leads.lease_of(process.pid, environ)
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

    def apply(self, leases: Iterable[Lease], devices: Iterable[Device], all_live: bool = False) -> dict[str, str]:
        """Bring every lease's cgroup in line; returns what changed per lease id: ``allowed``,
        ``denied``, ``removed``, ``no process`` (granted, its kernel not started yet), or the error.
        With ``all_live``, ``leases`` are every live lease: a kernel cgroup of any other is over."""
        by_uuid = {d.uuid: d for d in devices}
        done: dict[str, str] = {}
        leases = list(leases)
        if all_live:
            given = {lease.id for lease in leases}
            for key in [k for k in self.cgroups.kernels if k not in given]:
                outcome = self._over(key)
                if outcome:
                    done[key] = outcome
        for lease in leases:
            try:
                outcome = self._apply_one(lease, by_uuid)
            except (DeviceControlError, OSError) as exc:
                outcome = f"failed: {exc.strerror or exc}"
            if outcome:
                done[lease.id] = outcome
        return done

    def _over(self, key: str) -> str:
        """A lease that ended: deny its kernel, and remove its cgroup once empty; what changed."""
        was_allowed = bool(self.cgroups.granted.get(key))
        try:
            if self.cgroups.forget(key):
                return "removed"
        except (DeviceControlError, OSError) as exc:
            return f"failed: {exc.strerror or exc}"
        return "denied" if was_allowed else ""

    def _apply_one(self, lease: Lease, devices: Mapping[str, Device]) -> str:
        uuids = allowed_devices(lease)
        known = lease.id in self.cgroups.kernels
        if uuids is None:
            return self._over(lease.id) if known else ""
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


class DeviceControlService:
    """What a broker runs, once per pool: device control started (one log line), its cgroups left
    by an earlier run adopted or removed, then every lease's cgroup brought in line after each
    change of the pool and every ``interval`` seconds (a kernel that started after its grant is
    found on the next pass). ``call(fn)`` runs a pool read where the pool's owner runs them (the
    broker's worker thread); the default calls it here."""

    def __init__(
        self,
        config: DeviceControl,
        pool: Any,
        users: UnixUsers,
        host: str = "",
        interval: float = 1.0,
        call: Callable[[Callable[[], Any]], Any] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.users = users
        self.host = host
        self.interval = interval
        self.call = call or (lambda fn: fn())
        self.role: DeviceControlRole | None = None
        self._pids: dict[str, list[int]] = {}
        # Leases no longer live that environments name, each read once on the pool's thread.
        self._ended = EndedLeases(lambda lease_id: self.call(lambda: self.pool.get(lease_id)))
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None

    def start(self, single_user: bool = False) -> bool:
        """Start device control if this host and pool call for it; whether it runs."""
        backend = self.pool.backend
        cgroups = self.config.start(
            single_user=single_user,
            simulated=getattr(backend, "name", "") == "simulated",
            simulated_node_dir=getattr(backend, "node_dir", None),
        )
        if cgroups is None:
            return False
        self.role = DeviceControlRole(cgroups, lambda lease: self._pids.get(lease.id, []))
        live, devices = self.call(lambda: (self.pool.leases(), self.pool.devices()))
        by_uuid = {d.uuid: d for d in devices}
        swept = cgroups.sweep({lease.id: minors_of(allowed_devices(lease) or (), by_uuid) for lease in live})
        if swept:
            self.config.log.info("device control: kernel cgroups of an earlier run: %s", _counted(swept))
        self._unsubscribe = self.pool.subscribe_changes(self._wake.set)
        self._thread = threading.Thread(target=self._run, name="gpupool-device-control", daemon=True)
        self._thread.start()
        self._wake.set()
        return True

    def apply_now(self) -> dict[str, str]:
        """One pass over every live lease; what changed per lease id."""
        if self.role is None:
            return {}
        live, devices = self.call(lambda: (self.pool.leases(), self.pool.devices()))
        self._pids = lease_processes(live, self.users, self.host, self._ended)
        return self.role.apply(live, devices, all_live=True)

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._closed.is_set():
                break
            try:
                done = self.apply_now()
            except Exception:  # a pass that failed is logged; the next one tries again
                self.config.log.exception("device control: a pass failed")
                continue
            for lease_id, outcome in done.items():
                if outcome != "no process":
                    self.config.log.info("device control: lease %s: %s", lease_id, outcome)

    def stop(self) -> None:
        """Stop following the pool; the rules stay in place (as after a crash)."""
        self._closed.set()
        self._wake.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def describe(self) -> dict[str, object]:
        """``device_control`` for status: mode, what is denied, or why it is off."""
        return self.config.describe()


def _counted(outcomes: Mapping[str, str]) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    return ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
