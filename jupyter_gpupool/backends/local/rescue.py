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
import socket
import sqlite3
from typing import TYPE_CHECKING

from jupyter_gpupool.backends.local.driver import same_process_alive
from jupyter_gpupool.backends.local.store import lease_from_json
from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.devices import ProcessUsage
from jupyter_gpupool.enforcement.unpooled import holdings_of_lease

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


def still_running(lease: Lease, processes: list[ProcessUsage], host: str) -> bool:
    """Whether ``lease``'s kernel still runs here: its holder process (the same one, started before
    the lease), or a process the driver lists holding memory for it."""
    if lease.holder_host == host and lease.holder_pid and same_process_alive(lease.holder_pid, lease.created_at):
        return True
    devices = (*lease.devices, *lease.home_devices, *lease.migrate_from)
    return bool(devices) and bool(holdings_of_lease(processes, lease, devices))


def adopt_rescued(pool: Pool) -> list[Lease]:
    """Adopt into ``pool`` (a pool file just made) the leases of the newest rescued copy whose
    kernels still run on this host; the copy is then renamed ``*.adopted``. Returns them."""
    copies = rescued_copies(pool.db_path)
    if not copies:
        return []
    copy = copies[-1]
    try:
        leases = live_leases_of(copy)
    except (sqlite3.Error, ValueError, KeyError, TypeError) as err:
        log.warning("gpupool: the pool file %s was made afresh; its rescued copy %s could not be read (%s)", pool.db_path, copy, err)
        return []
    processes = pool.backend.process_usage() if getattr(pool.backend, "name", "") in ("nvml", "simulated") else []
    inventory = {device.uuid for device in pool.devices()}
    host = socket.gethostname()
    running = [lease for lease in leases if set(lease.devices) <= inventory and still_running(lease, processes, host)]
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
