"""A device query that hangs in one process never holds the pool's write lock.

Seen on a real GPU: a kernel whose process a CUDA checkpoint had locked (suspended) made an
NVML query from its activity thread inside a pool transaction. NVML waited for the restore,
the transaction held the SQLite write lock meanwhile, and so the server, the one process that
could restore the kernel, stalled on the lock: a deadlock until the busy timeout, with every
REST call of the server waiting 30 s. The pool now reads the inventory before it takes the lock.

Here the frozen kernel is a real second process whose device backend blocks while a file
exists; the other process must still make decisions on the same pool file at once.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from pool_helpers import req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend

FROZEN_KERNEL = textwrap.dedent(
    """
    import os, sys, time
    from jupyter_gpupool.core.models import Activity
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.backends.local.pool import Pool

    db, lease_id, freeze, entered = sys.argv[1:5]

    class FrozenDriver(SimulatedBackend):
        def devices(self):
            if os.path.exists(freeze):  # the process is checkpointed: driver calls wait for the restore
                open(entered, "w").close()
                while os.path.exists(freeze):
                    time.sleep(0.02)
            return super().devices()

    pool = Pool(FrozenDriver.from_spec("1x16GiB"), db)
    pool.device_cache_seconds = 0  # every decision asks the driver afresh
    pool.report_activity(lease_id, Activity(busy=True, last_activity=time.time()))
    print("reported", flush=True)
    """
)


def test_a_device_query_hanging_in_another_process_does_not_stall_the_pool(tmp_path: Path) -> None:
    db = str(tmp_path / "pool.sqlite")
    server = Pool(SimulatedBackend.from_spec("1x16GiB"), db, PoolPolicy(heartbeat_ttl=3600))
    kernel_lease = server.request(req("alice", 4))
    freeze, entered = tmp_path / "frozen", tmp_path / "entered"
    freeze.touch()
    kernel = subprocess.Popen(
        [sys.executable, "-c", FROZEN_KERNEL, db, kernel_lease.id, str(freeze), str(entered)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not entered.exists():
            assert kernel.poll() is None, kernel.stderr.read() if kernel.stderr else ""
            assert time.monotonic() < deadline, "the frozen kernel never asked for the devices"
            time.sleep(0.02)

        decided: list[LeaseState] = []
        server_decides = threading.Thread(
            target=lambda: decided.append(server.request(req("bob", 4)).state), daemon=True
        )
        started = time.monotonic()
        server_decides.start()
        server_decides.join(timeout=5)
        waited = time.monotonic() - started
        assert decided == [LeaseState.GRANTED], (
            f"the server could not decide for {waited:.1f} s while another process's device query hung"
        )
        assert kernel.poll() is None  # still frozen: the decision above did not wait for it
    finally:
        freeze.unlink()
        out, err = kernel.communicate(timeout=60)
    assert kernel.returncode == 0, err
    assert "reported" in out
    assert server.get(kernel_lease.id).busy  # its report went through once it was thawed
