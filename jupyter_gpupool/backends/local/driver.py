"""What the driver shows, as the local pool reads it: the per-process GPU memory read once per
decision (:class:`DriverReading`, the engine's driver port), each process traced to the live lease
it is a kernel of, and memory held but not granted (a released, suspended or moved kernel's process
that has not let go yet) kept taken until the driver shows it free.

Which live lease a process counts for is the pool's one rule
(:class:`~jupyter_gpupool.enforcement.claims.KernelLeases`, as device control and the watchdog
read it): a kernel that released its lease and reserved again counts for its new lease, though its
start environment names only the one it released (:func:`lease_claims`)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import psutil

from jupyter_gpupool.core.engine import PoolState
from jupyter_gpupool.core.models import Lease, LeaseState, Transition
from jupyter_gpupool.devices import ProcessUsage
from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.enforcement.claims import EndedLookup
from jupyter_gpupool.enforcement.unpooled import UnpooledUse, _ancestry, _kernel_of, _Processes

#: This host's name, as leases' ``holder_host`` and unpooled rows' ``host`` give it.
HOSTNAME = socket.gethostname()


#: The variable the pool's provisioner (and a kernel that leases for itself) names its lease by.
LEASE_ENV = "GPUPOOL_LEASE_ID"


def lease_claims(leases: Mapping[str, Lease], ended: EndedLookup | None = None, env_var: str = LEASE_ENV) -> _Processes:
    """The claim rule of the pool's own reads of the driver, over ``leases`` (the live ones): a
    process counts for the live lease its start environment leads to by
    :class:`~jupyter_gpupool.enforcement.claims.KernelLeases` (its kernel's; the one it names; or,
    through ``ended``, the live successor of the earlier one it names: same owner and kernel, or
    same holder), where that lease may claim it and every process below it."""
    return _Processes(env_var, leases, ended=ended)


def lease_holdings(processes: Iterable[ProcessUsage], lease: Lease, devices: Iterable[str],
                   claims: _Processes) -> list[ProcessUsage]:
    """The driver's rows of ``lease``'s processes (its kernel and their children) on ``devices``,
    by ``claims`` (:func:`lease_claims`)."""
    wanted = set(devices)
    found: list[ProcessUsage] = []
    for usage in processes:
        if usage.device_uuid not in wanted or usage.used_memory <= 0:
            continue
        chain = _ancestry(int(usage.pid))
        if chain and _kernel_of(chain, {lease.id: lease}, {}, claims) is not None:
            found.append(usage)
    return found


def ended_in(store: Any) -> EndedLookup:
    """An :data:`~jupyter_gpupool.enforcement.claims.EndedLookup` over a pool file's ``store``:
    the released leases among the ids asked (read in the caller's transaction)."""

    def lookup(lease_ids: set[str]) -> dict[str, Lease]:
        found = {lease_id: store.lease(lease_id) for lease_id in lease_ids}
        return {lease_id: lease for lease_id, lease in found.items() if lease is not None and not lease.live}

    return lookup


class DriverReading:
    """The pool's driver port (:class:`~jupyter_gpupool.core.engine.DriverPort`): the backend's
    per-process GPU memory read once, on first use, and each process walked up ``/proc`` once to
    find the live lease it is a kernel (or a kernel's child) of, by :func:`lease_claims`
    (``ended``: the pool's released leases, which a re-reserved kernel's environment may name)."""

    def __init__(self, read: Callable[[], list[ProcessUsage]], processes: list[ProcessUsage] | None = None,
                 seen: dict[int, tuple[float, str, float]] | None = None, ended: EndedLookup | None = None) -> None:
        self._read = read
        self._seen = seen
        self._ended = ended
        self._processes = processes
        self._found: dict[str, list[tuple[int, str, int]]] = {}  # lease id → its rows
        self._held: dict[str, dict[str, int]] | None = None
        self._owner_of: dict[int, str | None] = {}  # pid → the live lease it counts for ("": none; None: gone)
        self._claims: _Processes | None = None
        self._leases: Mapping[str, Lease] = {}

    def bind(self, leases: Mapping[str, Lease]) -> DriverReading:
        """The live leases processes are attributed to."""
        self._leases = leases
        return self

    def processes(self) -> list[ProcessUsage]:
        if self._processes is None:
            self._processes = self._read()
        return self._processes

    def holdings(self, lease: Lease) -> list[tuple[int, str, int]]:
        if lease.id not in self._found:
            claims = lease_claims({**self._leases, lease.id: lease}, self._ended)
            rows = lease_holdings(self.processes(), lease, (*lease.devices, *lease.migrate_from), claims)
            self._found[lease.id] = [(int(u.pid), u.device_uuid, int(u.used_memory)) for u in rows]
        return self._found[lease.id]

    def held(self) -> Mapping[str, Mapping[str, int]]:
        if self._held is None:
            self._held = holders_by_device(self.processes(), self._leases, seen=self._seen, ended=self._ended,
                                           owner_of=self._owner_of)
        return self._held

    def lease_of(self, pid: int) -> str | None:
        """The id of the live lease process ``pid`` counts for ("" for none; None when it runs
        not here), as :meth:`held` attributes it (walked afresh: a lease that came since counts)."""
        if pid not in self._owner_of:
            if self._claims is None:
                self._claims = lease_claims(self._leases, self._ended)
            self._owner_of[pid] = _owner(pid, self._leases, self._claims, LEASE_ENV, None, time.monotonic())
        return self._owner_of[pid]


#: Seconds a process found to be no live lease's is taken as such without walking ``/proc`` again
#: (a lease that names it may have come since); one found to be a lease's stays so while its
#: lease lives and the pid is the same process.
NOBODYS_FOR = 10.0


def holders_by_device(processes: Iterable[ProcessUsage], leases: Mapping[str, Lease],
                      env_var: str = LEASE_ENV,
                      seen: dict[int, tuple[float, str, float]] | None = None, ended: EndedLookup | None = None,
                      owner_of: dict[int, str | None] | None = None) -> dict[str, dict[str, int]]:
    """Device uuid → {lease id, or "" for a process of no live lease → bytes} of the processes
    the driver lists that run here now (a pid gone, or in another PID namespace, is the host
    watcher's to report as unpooled use), by :func:`lease_claims`. Each process is walked up
    ``/proc`` once; ``seen`` (pid → (start time, owner, when found)) carries what earlier readings
    found, so a decision costs one ``stat`` per known process; ``owner_of`` gets what was found."""
    procs = lease_claims(leases, ended, env_var)
    owner_of = owner_of if owner_of is not None else {}
    held: dict[str, dict[str, int]] = {}
    now = time.monotonic()
    for usage in processes:
        used = max(0, int(usage.used_memory))
        if not used:
            continue
        pid = int(usage.pid)
        if pid not in owner_of:
            owner_of[pid] = _owner(pid, leases, procs, env_var, seen, now)
        owner = owner_of[pid]
        if owner is None:
            continue
        row = held.setdefault(usage.device_uuid, {})
        row[owner] = row.get(owner, 0) + used
    return held


def _owner(pid: int, leases: Mapping[str, Lease], procs: _Processes, env_var: str,
           seen: dict[int, tuple[float, str, float]] | None, now: float) -> str | None:
    """The live lease process ``pid`` is a kernel (or a kernel's child) of, "" for none, None
    when no such process runs here."""
    try:
        started = psutil.Process(pid).create_time()
    except (psutil.Error, ValueError, OverflowError):
        return None
    known = seen.get(pid) if seen is not None else None
    if known is not None and known[0] == started and (
        (known[1] and known[1] in leases) or (not known[1] and now - known[2] < NOBODYS_FOR)
    ):
        return known[1]
    chain = _ancestry(pid)
    if chain is None:
        return None
    found = _kernel_of(chain, leases, {}, procs)
    owner = found[0] if found else ""
    if seen is not None:
        if len(seen) > 4096:
            seen.clear()
        seen[pid] = (started, owner, now)
    return owner


def held_rows(lease: Lease, held: Iterable[tuple[int, str, int]], why: str, host: str, now: float, expires_at: float,
              released: bool) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(reporter, unpooled rows) for what ``lease``'s processes still hold (``held``: pid, GPU,
    bytes): one reporter for a release, one per GPU otherwise (a later move elsewhere keeps this one's)."""
    by_device: dict[str, list[dict[str, Any]]] = {}
    for pid, device, amount in held:
        use = UnpooledUse(device=device, pid=pid, bytes=amount, host=host, why=why, user=lease.owner, lease_id=lease.id, since=now)
        by_device.setdefault(device, []).append({**use.to_json(), "expires_at": expires_at})
    if released:
        yield f"released:{lease.id}", [row for rows in by_device.values() for row in rows]
        return
    for device, rows in by_device.items():
        yield f"parked:{lease.id}:{device}", rows


def still_held(rows: list[dict[str, Any]], whys: tuple[str, ...], parked_why: str, host: str, leases: Mapping[str, Lease],
               read: Callable[[], list[ProcessUsage]] | None,
               lease_of: Callable[[int], str | None] | None = None) -> tuple[list[dict[str, Any]], dict[str, list[dict[str, Any]]]]:
    """``rows`` of unpooled use less memory held but not granted (rows of ``whys`` on ``host``) that
    its process let go of: gone when the process exited (or its pid is another process's now), when
    its lease holds that GPU again (``parked_why`` rows: it is the grant's then), when its process
    counts now for a live lease granted that GPU (``lease_of``, :meth:`DriverReading.lease_of`: a
    kernel that released its lease and reserved again; it is that grant's), and, where the driver
    is read (``read``), lowered to what it shows that process holding there now. Returns the rows
    kept, and each reporter whose held rows changed → the rows it keeps."""
    mine = {id(row) for row in rows if row.get("why") in whys and row.get("host") == host}
    if not mine:
        return rows, {}
    shown: dict[tuple[int, str], int] | None = None
    if read is not None:
        shown = {}
        for usage in read():
            at = (int(usage.pid), usage.device_uuid)
            shown[at] = shown.get(at, 0) + max(0, int(usage.used_memory))
    kept: list[dict[str, Any]] = []
    by_reporter: dict[str, list[dict[str, Any]]] = {}
    changed: set[str] = set()
    for row in rows:
        if id(row) not in mine:
            kept.append(row)
            continue
        pid, reporter = int(row["pid"] or 0), str(row.get("reporter") or "")
        lease = leases.get(row.get("lease_id") or "")
        now_held = int(row["bytes"]) if shown is None else min(int(row["bytes"]), shown.get((pid, row["device"]), 0))
        regranted = (row["why"] == parked_why and lease is not None and lease.state is LeaseState.GRANTED
                     and row["device"] in (*lease.devices, *lease.migrate_from))
        if not regranted and lease_of is not None and now_held > 0:
            counts_for = leases.get(lease_of(pid) or "")
            regranted = (counts_for is not None and counts_for.state is LeaseState.GRANTED
                         and row["device"] in (*counts_for.devices, *counts_for.migrate_from))
        by_reporter.setdefault(reporter, [])
        if now_held <= 0 or regranted or not same_process_alive(pid, float(row.get("since") or 0.0)):
            changed.add(reporter)
            continue
        if now_held < int(row["bytes"]):
            row = {**row, "bytes": now_held}
            changed.add(reporter)
        kept.append(row)
        by_reporter[reporter].append(row)
    return kept, {reporter: by_reporter[reporter] for reporter in changed}


def freed_by_report(lease: Lease, failed_restore: bool = False) -> tuple[str, ...]:
    """The GPUs a report of ``lease``'s step frees: a suspend's, a move's old ones, or (a restore
    reported failed with its memory still parked: ``failed_restore``) the restore's."""
    if failed_restore:  # a failed suspend or move keeps its GPUs: nothing is freed
        return lease.devices if lease.transition is Transition.RESTORING else ()
    if lease.transition is Transition.SUSPENDING:
        return lease.devices
    if lease.transition is Transition.MIGRATING:
        return tuple(u for u in lease.migrate_from if u not in lease.devices)
    return ()

def held_where_freed(state: PoolState, lease: Lease, freed: tuple[str, ...]) -> list[tuple[int, str, int]]:
    """``(pid, GPU, bytes)`` the driver shows ``lease``'s processes holding on ``freed`` now
    (read before the step is applied, while the lease still names those GPUs)."""
    if not freed or state.driver is None:
        return []
    return [(pid, uuid, amount) for pid, uuid, amount in state.driver.holdings(lease) if uuid in freed and amount > 0]


def same_process_alive(pid: Any, seen_at: float) -> bool:
    """Whether the process seen with this id at ``seen_at`` (POSIX time) still runs: alive, and
    started before then (a process started later reuses the id)."""
    if not process_alive(pid):
        return False
    try:
        return bool(psutil.Process(pid).create_time() <= seen_at + 1.0)
    except psutil.Error:
        return False
