"""A pool file lost under running kernels: the process that found it gone saved its last state as
``pool.sqlite.rescued-*`` (see :meth:`Store._rescue`); the next process that makes a new pool on
that path adopts from the newest such copy the leases whose kernels still run here, so they are
neither forgotten (their memory would be "outside the pool", and a watchdog would stop them) nor
granted to anyone else, and tells the admin in one log line."""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import re
import socket
import sqlite3
from typing import TYPE_CHECKING

import psutil

from jupyter_gpupool.backends.local.driver import lease_claims, lease_holdings, same_process_alive
from jupyter_gpupool.backends.local.store import lease_from_json
from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.devices import ProcessUsage
from jupyter_gpupool.enforcement.claims import EndedLookup
from jupyter_gpupool.enforcement.unpooled import _Processes, find_kernel_roots
from jupyter_gpupool.units import format_size

if TYPE_CHECKING:
    from jupyter_gpupool.backends.local.pool import Pool

log = logging.getLogger(__name__)


def rescued_copies(db_path: str) -> list[str]:
    """The rescued copies of ``db_path`` not yet adopted, oldest first."""
    found = glob.glob(glob.escape(db_path) + ".rescued-*")
    copies = [path for path in found if not path.endswith(("-wal", "-shm", "-journal", ".adopted"))]
    return sorted(copies, key=lambda path: (os.path.getmtime(path), path))


def live_leases_of(copy: str) -> list[Lease]:
    """The live (not released) leases a rescued copy holds, read without changing it."""
    conn = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
    try:
        rows = conn.execute("SELECT data FROM leases WHERE state != 'released'").fetchall()
    finally:
        conn.close()
    return [lease_from_json(json.loads(data)) for (data,) in rows]


def released_leases_of(copy: str) -> EndedLookup:
    """The released leases of a rescued copy, by id (read without changing it): those a kernel's
    start environment may still name after it released its lease and reserved again."""

    def lookup(lease_ids: set[str]) -> dict[str, Lease]:
        ids = sorted(lease_ids)
        conn = sqlite3.connect(f"file:{copy}?mode=ro", uri=True)
        try:
            rows = conn.execute(f"SELECT data FROM leases WHERE state = 'released' AND id IN ({','.join('?' * len(ids))})",
                                ids).fetchall() if ids else []
        except sqlite3.Error:
            rows = []
        finally:
            conn.close()
        found = [lease_from_json(json.loads(data)) for (data,) in rows]
        return {lease.id: lease for lease in found}

    return lookup


def still_running(lease: Lease, processes: list[ProcessUsage], host: str, claims: _Processes | None = None) -> bool:
    """Whether ``lease``'s kernel still runs here: its holder process (the same one, started before
    the lease), or a process the driver lists holding memory for it, by the pool's claim rule
    (``claims``: :func:`~jupyter_gpupool.backends.local.driver.lease_claims` over the copy's live
    leases and its released ones; by default, over ``lease`` alone)."""
    if lease.holder_host == host and lease.holder_pid and same_process_alive(lease.holder_pid, lease.created_at):
        return True
    devices = (*lease.devices, *lease.home_devices, *lease.migrate_from)
    claims = claims if claims is not None else lease_claims({lease.id: lease})
    return bool(devices) and bool(lease_holdings(processes, lease, devices, claims))


def adopt_rescued(pool: Pool) -> list[Lease]:
    """Adopt into ``pool`` (a pool file just made) the leases of the newest rescued copy whose
    kernels still run on this host; the copy is then renamed ``*.adopted``. With no rescued copy,
    what the driver shows running is adopted instead (:func:`adopt_from_driver`). Returns them."""
    copies = rescued_copies(pool.db_path)
    if not copies:
        return adopt_from_driver(pool)
    copy = copies[-1]
    try:
        leases = live_leases_of(copy)
    except (sqlite3.Error, ValueError, KeyError, TypeError) as err:
        log.warning("gpupool: the pool file %s was made afresh; its rescued copy %s could not be read (%s)", pool.db_path, copy, err)
        return []
    processes = pool.backend.process_usage() if getattr(pool.backend, "name", "") in ("nvml", "simulated") else []
    inventory = {device.uuid for device in pool.devices()}
    host = socket.gethostname()
    claims = lease_claims({lease.id: lease for lease in leases}, released_leases_of(copy))
    running = [lease for lease in leases if set(lease.devices) <= inventory and still_running(lease, processes, host, claims)]
    with pool.store.transaction():
        adopted = [lease for lease in running if pool.store.lease(lease.id) is None]
        pool.store.save_leases(adopted)
    with contextlib.suppress(OSError):
        os.replace(copy, f"{copy}.adopted")
    kernels = ", ".join(f"{lease.owner}'s {lease.kernel_id or lease.id} ({lease.state.value})" for lease in adopted[:10])
    log.warning(
        "gpupool: the pool file %s was lost and made afresh; %d lease(s) whose kernels still run were adopted from "
        "its rescued copy (kept as %s.adopted)%s; %d other lease(s) there were left out",
        pool.db_path, len(adopted), copy, f": {kernels}" if kernels else "", len(leases) - len(adopted),
    )  # fmt: skip
    return adopted


#: What a lease id or kernel id read from a process's environment may look like (anything else is
#: not ours: the process is left outside the pool).
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


def _named_lease(pid: int, env_var: str) -> tuple[str, str, str] | None:
    """(lease id, pool user, kernel id) the environment of ``pid`` or its nearest ancestor that
    names a lease gives (the provisioner sets ``GPUPOOL_LEASE_ID``, ``GPUPOOL_USER`` and
    ``GPUPOOL_KERNEL_ID`` in every kernel it starts), or None."""
    try:
        chain = [psutil.Process(pid), *psutil.Process(pid).parents()]
    except (psutil.Error, ValueError):
        return None
    for proc in chain:
        try:
            environ = proc.environ()
        except (psutil.Error, OSError):
            continue
        lease_id = environ.get(env_var, "")
        if lease_id:
            return lease_id, environ.get("GPUPOOL_USER", ""), environ.get("GPUPOOL_KERNEL_ID", "")
    return None


def adopt_from_driver(pool: Pool, env_var: str = "GPUPOOL_LEASE_ID") -> list[Lease]:
    """Adopt into ``pool`` (a pool file just made, with no rescued copy) the kernels the driver
    shows holding GPU memory: each process (or its nearest ancestor) whose environment names a
    lease and the pool user it belongs to, and that this user may claim (it runs as their Unix
    user: the claim rule of :mod:`~jupyter_gpupool.enforcement.claims`), becomes a granted lease of
    that user with that id and kernel id, its size on each GPU what the driver shows its processes
    holding there. Anything else stays outside the pool: the watchdog sees it as memory held
    outside any lease, granted to nobody. One log line says what was done. Returns the leases."""
    if getattr(pool.backend, "name", "") not in ("nvml", "simulated"):
        return []
    try:
        processes = [usage for usage in pool.backend.process_usage() if usage.used_memory > 0]
    except Exception as err:  # noqa: BLE001 - a driver that cannot list processes adopts nothing
        log.warning("gpupool: the pool file %s was made afresh; the driver's processes could not be read (%s)", pool.db_path, err)
        return []
    order = [device.uuid for device in pool.devices()]
    processes = [usage for usage in processes if usage.device_uuid in order]
    named: dict[str, set[tuple[str, str]]] = {}  # lease id -> {(user, kernel id)} its processes name
    unnamed_pids: set[int] = set()
    for usage in processes:
        found = _named_lease(int(usage.pid), env_var)
        if found is None:
            unnamed_pids.add(int(usage.pid))
            continue
        lease_id, user, kernel_id = found
        named.setdefault(lease_id, set()).add((user, kernel_id))
    if not named:
        return []
    now, host = pool.clock(), socket.gethostname()
    candidates: list[Lease] = []
    for lease_id, names in named.items():
        if len(names) != 1:
            continue  # processes naming one lease for two users or kernels: none of them is believed
        ((user, kernel_id),) = names
        if not _NAME.fullmatch(lease_id) or not _NAME.fullmatch(user) or (kernel_id and not _NAME.fullmatch(kernel_id)):
            continue
        candidates.append(Lease(id=lease_id, owner=user, memory=0, state=LeaseState.GRANTED, created_at=now,
                                kernel_id=kernel_id or None, devices=tuple(order), holder_host=host))  # fmt: skip
    kernels_named: dict[str, int] = {}
    for lease in candidates:
        if lease.kernel_id:
            kernels_named[lease.kernel_id] = kernels_named.get(lease.kernel_id, 0) + 1
    adopted: list[Lease] = []
    for lease in candidates:
        held: dict[str, int] = {}
        rows = lease_holdings(processes, lease, order, lease_claims({lease.id: lease}, env_var=env_var))  # only processes its user may claim
        for usage in rows:
            held[usage.device_uuid] = held.get(usage.device_uuid, 0) + int(usage.used_memory)
        if not held:
            continue
        root = find_kernel_roots([int(usage.pid) for usage in rows], {lease.id: lease}, env_var).get(lease.id)
        size = max(held.values())
        kernel = lease.kernel_id if lease.kernel_id and kernels_named[lease.kernel_id] == 1 else None
        adopted.append(Lease(
            id=lease.id, owner=lease.owner, memory=size, guarantee=size, state=LeaseState.GRANTED, created_at=now,
            kernel_id=kernel, devices=tuple(uuid for uuid in order if uuid in held), num_gpus=len(held),
            granted_at=now, heartbeat_at=now, holder_pid=root, holder_host=host if root else None,
            used_memory=sum(held.values()), peak_memory=sum(held.values()),
            label="adopted from the driver: its pool file was lost",
        ))  # fmt: skip
    with pool.store.transaction():
        adopted = [lease for lease in adopted if pool.store.lease(lease.id) is None]
        pool.store.save_leases(adopted)
    claimed = {int(usage.pid) for lease in adopted
               for usage in lease_holdings(processes, lease, lease.devices, lease_claims({lease.id: lease}, env_var=env_var))}
    outside = sorted({int(usage.pid) for usage in processes} - claimed - unnamed_pids)
    kernels = ", ".join(
        f"{lease.owner}'s {lease.kernel_id or lease.id} ({format_size(lease.used_memory or 0)} on {len(lease.devices)} GPU(s))"
        for lease in adopted[:10]
    )
    log.warning(
        "gpupool: the pool file %s was made afresh and no rescued copy of it was found; %d running kernel(s) the "
        "driver shows were adopted as leases of the users their environment names%s; %d process(es) naming a lease "
        "they may not claim were left outside the pool, granted to nobody%s",
        pool.db_path, len(adopted), f": {kernels}" if kernels else "", len(outside),
        f" (pids {', '.join(map(str, outside[:10]))})" if outside else "",
    )  # fmt: skip
    return adopted
