"""Whose is each byte of GPU memory: NVML's per-process figures set against the pool's leases.

The pool's books come from its clients; the driver's come from the hardware. Every watchdog
interval the watcher that owns a host's GPUs (a server's watchdog on a single-user host, the
broker's on a multi-user one) hands :func:`attribute` what the device backend lists per process
and every live lease of the pool, and gets back:

- bytes per granted lease, used on that lease's own GPUs (what the over-limit watchdog checks);
- **unpooled use**: memory held by a process that belongs to no granted lease on that GPU — a
  kernel started without the pool, a terminal's ``python train.py``, a kernel whose lease is
  suspended, queued, released or on another GPU. The pool plans around it (never grants it) and
  shows it; the admin's ``Watchdog.unpooled_action`` says what else happens.

A process belongs to a lease when it, or an ancestor, is the lease's kernel: a root pid the
watcher knows (its own kernels), or a process whose environment leads to the lease (it names
the lease, its kernel, or an earlier lease the same kernel gave back: the rule of
:class:`~jupyter_gpupool.enforcement.claims.KernelLeases`, as under device control) and that the lease may claim by :func:`~jupyter_gpupool.enforcement.claims.may_claim`
(it runs as the owner's Unix user as configured, or descends from the lease's own server), as
must every process between it and the GPU process: the walk up the ancestors stops at the first
process it may not claim, so nobody charges their use to another user's lease by copying the
variable, and attribution fails closed (unclaimed memory is unpooled use). System processes (the
MPS server, persistenced, DCGM, Xorg) are left out by name.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil

from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.devices import ProcessUsage
from jupyter_gpupool.enforcement.claims import EndedLookup, KernelLeases, UnixUsers, may_claim, process_alive
from jupyter_gpupool.units import format_size

#: Process names whose GPU memory is the system's, not a user's (the admin extends the list with
#: ``c.Watchdog.system_processes``).
SYSTEM_PROCESSES = (
    "nvidia-cuda-mps-server",
    "nvidia-cuda-mps-control",
    "nvidia-persistenced",
    "nv-hostengine",
    "dcgm",
    "dcgmi",
    "Xorg",
    "Xwayland",
    "gnome-shell",
)

#: Characters of a process's command line kept for the admin's view.
COMMAND_CHARS = 120


@dataclass(frozen=True)
class UnpooledUse:
    """GPU memory one process holds on one GPU outside any granted lease of that GPU."""

    device: str  # GPU uuid
    pid: int
    bytes: int
    host: str
    why: str  # one clause: "no lease", "its lease is suspended", ...
    user: str | None = None  # the process's Unix user (None when it cannot be read)
    command: str = ""  # the start of its command line ("" when it cannot be read)
    lease_id: str | None = None  # the lease its kernel has, if any (suspended, queued, ...)
    stoppable: bool = False  # the watcher may signal it (its own user's process, or a root watcher)
    since: float = 0.0  # when it was first seen

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Attribution:
    """What :func:`attribute` found."""

    usage: dict[str, int] = field(default_factory=dict)  # granted lease id → bytes on its own GPUs
    roots: dict[str, int] = field(default_factory=dict)  # lease id → its kernel's pid, where found
    unpooled: list[UnpooledUse] = field(default_factory=list)


def unpooled_line(use: UnpooledUse) -> str:
    """One line for the admin's log and the event log."""
    who = f"{use.user}'s " if use.user else ""
    what = f"process {use.pid}" + (f" ({use.command.split(' ')[0]})" if use.command else "")
    return f"{who}{what} holds {format_size(use.bytes)} of GPU {use.device} outside the pool ({use.why})"


def _alive(proc: psutil.Process) -> bool:
    return process_alive(proc.pid)


def _ancestry(pid: int) -> list[psutil.Process] | None:
    """A running process and its ancestors, nearest first; None when it is gone (or a zombie)."""
    try:
        proc = psutil.Process(pid)
        chain = [proc, *proc.parents()]
    except (psutil.Error, ValueError):
        return None
    return chain if _alive(proc) else None


class _Processes:
    """Cached ``/proc`` reads for one attribution pass (each process is read once), and the claim
    rule of :mod:`~jupyter_gpupool.enforcement.claims` with the watcher's user mapping and host."""

    def __init__(self, env_var: str, leases: Mapping[str, Lease] | None = None, users: UnixUsers | None = None,
                 host: str | None = None, ended: EndedLookup | None = None) -> None:
        self.env_var = env_var
        self.users = users if users is not None else UnixUsers.single_user()
        self.host = host or socket.gethostname()
        #: Which live lease an environment leads to: a kernel whose environment names a lease it
        #: gave back (``%gpupool release``, then ``reserve``) is its newer lease's, as under device control.
        self._leads = KernelLeases((leases or {}).values(), self.host, ended, env_var)
        self._lease_of: dict[int, str | None] = {}
        self._uid: dict[int, int | None] = {}

    def lease_named_by(self, proc: psutil.Process) -> str | None:
        """The id of the live lease ``proc``'s start environment leads to (see :class:`KernelLeases`)."""
        if proc.pid not in self._lease_of:
            try:
                environ = proc.environ()
            except (psutil.Error, OSError):
                environ = {}
            lease = self._leads.lease_of(proc.pid, environ)
            self._lease_of[proc.pid] = lease.id if lease is not None else None
        return self._lease_of[proc.pid]

    def uid(self, proc: psutil.Process) -> int | None:
        if proc.pid not in self._uid:
            try:
                self._uid[proc.pid] = proc.uids().real
            except psutil.Error:
                self._uid[proc.pid] = None
        return self._uid[proc.pid]

    def may_claim(self, chain: list[psutil.Process], index: int, lease: Lease) -> bool:
        """Whether ``chain[index]`` may count as ``lease``'s (see :func:`~jupyter_gpupool.enforcement.claims.may_claim`)."""
        return may_claim(chain, index, lease, self.users, self.host, self._uid)


def _kernel_of(chain: list[psutil.Process], leases: Mapping[str, Lease], known: Mapping[int, str],
               procs: _Processes) -> tuple[str, int] | None:
    """(lease id, kernel pid) of a GPU process given its ancestry (itself first), or None.

    A pid the watcher knows as a kernel wins (nearest first) when every process from the GPU
    process up to it runs as that kernel's user. Else the nearest ancestor whose environment names
    a live lease is that lease's kernel if the lease may claim it and every process below it (a
    child that dropped the variable, ``env -i python train.py``, still counts for its kernel); the
    kernel is the topmost of the consecutive ancestors naming that lease that it may claim. The
    walk stops at the first process the lease may not claim: None, whatever names a lease above."""
    for index, proc in enumerate(chain):
        if proc.pid in known:
            root_uid = procs.uid(proc)
            if root_uid is not None and all(procs.uid(below) == root_uid for below in chain[:index]):
                return known[proc.pid], proc.pid
            return None
    found: tuple[str, int] | None = None
    for index, proc in enumerate(chain):
        lease_id = procs.lease_named_by(proc)
        lease = leases.get(lease_id) if lease_id else None
        if found is None:
            if lease is None:
                continue  # names no live lease: judged with the lease its kernel names, if any
            if not all(procs.may_claim(chain, below, lease) for below in range(index + 1)):
                return None
            found = (lease.id, proc.pid)
            continue
        if lease is not None and lease.id == found[0] and procs.may_claim(chain, index, lease):
            found = (lease.id, proc.pid)
            continue
        break
    return found


def _describe(proc: psutil.Process) -> tuple[str | None, str, str]:
    """(user, command line, process name) of a process, as far as they can be read."""
    try:
        user: str | None = proc.username()
    except (psutil.Error, KeyError):
        user = None
    try:
        command = " ".join(proc.cmdline())[:COMMAND_CHARS]
    except psutil.Error:
        command = ""
    try:
        name = proc.name()
    except psutil.Error:
        name = ""
    return user, command, name


def _why(lease: Lease | None, device: str) -> str:
    if lease is None:
        return "no lease"
    if lease.state is LeaseState.GRANTED:
        return "outside its lease's GPUs"
    return f"its lease is {lease.state.value}"


def _may_signal(proc: psutil.Process, procs: _Processes) -> bool:
    return os.geteuid() == 0 or procs.uid(proc) == os.getuid()


def _live_known_roots(known_roots: Mapping[str, int], leases: Mapping[str, Lease], result: Attribution) -> dict[int, str]:
    """The watcher's own kernels that are alive, pid → lease id; each recorded as its lease's root
    in ``result`` (with a usage of 0 while granted, so an over-limit mark can clear)."""
    known: dict[int, str] = {}
    for lease_id, pid in known_roots.items():
        lease = leases.get(lease_id)
        if pid is None or int(pid) in known:
            continue
        try:
            proc = psutil.Process(int(pid))
        except (psutil.Error, ValueError):
            continue
        if not _alive(proc):
            continue
        known[int(pid)] = lease_id
        result.roots[lease_id] = int(pid)
        if lease is not None and lease.state is LeaseState.GRANTED:
            result.usage[lease_id] = 0
    return known


def _memory_per_process(processes: Iterable[ProcessUsage]) -> dict[int, dict[str, int]]:
    """The memory each process uses, pid → device uuid → bytes (processes using none left out)."""
    per_process: dict[int, dict[str, int]] = {}
    for usage in processes:
        used = max(0, int(usage.used_memory))
        if used:
            devices = per_process.setdefault(int(usage.pid), {})
            devices[usage.device_uuid] = devices.get(usage.device_uuid, 0) + used
    return per_process


def _inspect(pid: int) -> tuple[psutil.Process | None, list[psutil.Process], bool]:
    """The process, its chain of ancestors (itself first), and whether it is hidden from this watcher."""
    try:
        proc = psutil.Process(pid)
        return proc, [proc, *proc.parents()], False
    except psutil.NoSuchProcess:
        # Not in this watcher's process table: it just exited, or it runs in another PID
        # namespace (a container) that uses the same GPU. Counted (conservatively, until the
        # next look), never stopped.
        return None, [], True
    except (psutil.Error, ValueError):
        return None, [], False  # cannot be inspected: counted, never stopped


def attribute(
    processes: Iterable[ProcessUsage],
    leases: Mapping[str, Lease],
    host: str,
    known_roots: Mapping[str, int] | None = None,
    env_var: str = "GPUPOOL_LEASE_ID",
    system_processes: Iterable[str] = SYSTEM_PROCESSES,
    now: float = 0.0,
    first_seen: Mapping[tuple[str, int], float] | None = None,
    users: UnixUsers | None = None,
    ended: EndedLookup | None = None,
) -> Attribution:
    """Split the backend's per-process GPU memory into granted leases' use and unpooled use.

    ``leases``: every live lease of the pool (whoever holds it); ``known_roots``: lease id → the
    kernel pid of the watcher's own kernels. Every known root that is alive appears in ``usage``
    (0 when it uses nothing), so the pool can clear an over-limit mark. ``first_seen``: when each
    (device, pid) was first seen unpooled, carried from the previous pass. ``users``: the pool
    user → Unix uid mapping the claims are judged by (None: a single-user host's, see
    :meth:`~jupyter_gpupool.enforcement.claims.UnixUsers.single_user`). ``ended``: looks up the
    leases no longer live that processes' environments name (see
    :class:`~jupyter_gpupool.enforcement.claims.KernelLeases`): without it, a kernel that released
    the lease it started with and reserved again counts for its new lease only by its kernel id.
    """
    procs = _Processes(env_var, leases, users, host, ended)
    system = set(system_processes)
    result = Attribution()
    known = _live_known_roots(known_roots or {}, leases, result)
    for pid, on_devices in _memory_per_process(processes).items():
        proc, chain, hidden = _inspect(pid)
        if proc is not None and not _alive(proc):
            continue
        owner = _kernel_of(chain, leases, known, procs) if chain else None
        lease = leases.get(owner[0]) if owner else None
        if owner is not None:
            result.roots.setdefault(owner[0], owner[1])
        described: tuple[str | None, str, str] | None = None
        for device, used in on_devices.items():
            if lease is not None and lease.state is LeaseState.GRANTED and device in (*lease.devices, *lease.migrate_from):
                result.usage[lease.id] = result.usage.get(lease.id, 0) + used
                continue
            if described is None:
                described = _describe(proc) if proc is not None else (None, "", "")
            user, command, name = described
            if lease is None and name in system:
                continue
            result.unpooled.append(
                UnpooledUse(
                    device=device,
                    pid=pid,
                    bytes=used,
                    host=host,
                    why="a process this watcher cannot see (another container?)" if hidden else _why(lease, device),
                    user=user,
                    command=command,
                    lease_id=lease.id if lease is not None else None,
                    stoppable=proc is not None and _may_signal(proc, procs),
                    since=(first_seen or {}).get((device, pid), now),
                )
            )
    return result


def holdings_of_lease(processes: Iterable[ProcessUsage], lease: Lease, devices: Iterable[str],
                      env_var: str = "GPUPOOL_LEASE_ID") -> list[ProcessUsage]:
    """The driver's rows of ``lease``'s processes (its kernel and their children) on ``devices``."""
    wanted = set(devices)
    procs = _Processes(env_var, {lease.id: lease})
    found: list[ProcessUsage] = []
    for usage in processes:
        if usage.device_uuid not in wanted or usage.used_memory <= 0:
            continue
        chain = _ancestry(int(usage.pid))
        if chain and _kernel_of(chain, {lease.id: lease}, {}, procs) is not None:
            found.append(usage)
    return found


def held_by_lease(processes: Iterable[ProcessUsage], lease: Lease, devices: Iterable[str],
                  env_var: str = "GPUPOOL_LEASE_ID") -> dict[int, int]:
    """Pid → bytes that ``lease``'s processes hold on ``devices``, as the driver lists them."""
    held: dict[int, int] = {}
    for usage in holdings_of_lease(processes, lease, devices, env_var):
        held[int(usage.pid)] = held.get(int(usage.pid), 0) + int(usage.used_memory)
    return held


def find_kernel_roots(pids: Iterable[int], leases: Mapping[str, Lease], env_var: str = "GPUPOOL_LEASE_ID") -> dict[str, int]:
    """Lease id → kernel pid, for the leases whose processes (or their descendants) are among
    ``pids``, found by the lease environment variable alone (see :func:`attribute`)."""
    procs = _Processes(env_var, leases)
    roots: dict[str, int] = {}
    for pid in set(pids):
        chain = _ancestry(pid)
        found = _kernel_of(chain, leases, {}, procs) if chain else None
        if found is not None:
            roots.setdefault(*found)
    return roots


def terminate_tree(pid: int, grace: float = 3.0) -> None:
    """SIGTERM a process and its descendants, SIGKILL what is left after ``grace`` seconds."""
    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def tell_terminal(pid: int, line: str) -> bool:
    """Write one line to the terminal a process runs in (a shell's ``python train.py``), so its
    user learns why it was stopped; False when it has none or it cannot be written."""
    try:
        terminal = psutil.Process(pid).terminal()
    except psutil.Error:
        return False
    if not terminal:
        return False
    try:
        fd = os.open(terminal, os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, f"\r\njupyter-gpupool: {line}\r\n".encode(errors="replace"))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


__all__ = ["SYSTEM_PROCESSES", "Attribution", "UnpooledUse", "attribute", "find_kernel_roots", "held_by_lease", "holdings_of_lease", "tell_terminal", "terminate_tree", "unpooled_line"]
