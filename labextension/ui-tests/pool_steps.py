"""Act on the pool file of a browser test's server directly (``suspend.spec.ts``).

Until the server carries out suspends and restores itself (issue 12: it checkpoints the kernel
and confirms), the browser test plays the server's part here, on the same SQLite pool file, so
the sidebar can be shown every state of a suspend on a real JupyterLab:

    python pool_steps.py mark-suspendable KERNEL_ID       # as a server that can checkpoint asks
    python pool_steps.py begin-suspend KERNEL_ID REASON   # mark suspendable if needed, pool.suspend
    python pool_steps.py confirm KERNEL_ID [PARKED_BYTES]  # confirm_transition (harmless if done)
    python pool_steps.py resume KERNEL_ID                  # pool.resume (what POST .../resume does)

Reads GPUPOOL_DB and GPUPOOL_SIMULATE as the server does; prints the lease as one JSON line.
"""

from __future__ import annotations

import json
import sys

from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.backends.local.pool import Pool


def lease_of(pool: Pool, kernel_id: str) -> Lease:
    """The kernel's live lease, or exit saying there is none."""
    lease = pool.lease_for_kernel(kernel_id)
    if lease is None:
        sys.exit(f"pool_steps: no live lease for kernel {kernel_id}")
    return lease


def mark_suspendable(pool: Pool, kernel_id: str) -> Lease:
    """A server that cannot checkpoint yet asks for leases that are not suspendable: mark this
    one so, as a server with the simulated checkpoint backend would have asked for it."""
    lease = lease_of(pool, kernel_id)
    if not lease.suspendable:
        with pool._decide(pool.clock()) as state:
            held = state.leases[lease.id]
            held.suspendable = True
            state.touch(held)
    return pool.get(lease.id)


def begin_suspend(pool: Pool, kernel_id: str, reason: str) -> Lease:
    """Phase one of a suspend (what ``POST .../suspend`` does), on a lease marked suspendable."""
    return pool.suspend(mark_suspendable(pool, kernel_id).id, reason=reason)


def confirm(pool: Pool, kernel_id: str, parked_bytes: int | None) -> Lease:
    """Phase two (suspend, restore or move done); the server may have confirmed it already."""
    lease = lease_of(pool, kernel_id)
    try:
        return pool.confirm_transition(lease.id, parked_bytes=parked_bytes)
    except InvalidInput:
        return pool.get(lease.id)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] not in ("mark-suspendable", "begin-suspend", "confirm", "resume"):
        sys.exit(
            "usage: pool_steps.py mark-suspendable KERNEL_ID | begin-suspend KERNEL_ID REASON"
            " | confirm KERNEL_ID [PARKED_BYTES] | resume KERNEL_ID"
        )
    step, kernel_id = argv[0], argv[1]
    pool = Pool.from_env()
    if step == "mark-suspendable":
        lease = mark_suspendable(pool, kernel_id)
    elif step == "begin-suspend":
        lease = begin_suspend(pool, kernel_id, argv[2] if len(argv) > 2 else "suspended by its user")
    elif step == "confirm":
        lease = confirm(pool, kernel_id, int(argv[2]) if len(argv) > 2 else None)
    else:
        lease = pool.resume(lease_of(pool, kernel_id).id)
    print(json.dumps({"lease_id": lease.id, "state": lease.state.value, "transition": lease.transition.value or None,
                      "resuming": lease.resuming, "parked_memory": lease.parked_memory}))


if __name__ == "__main__":
    main(sys.argv[1:])
