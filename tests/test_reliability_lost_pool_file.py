"""A pool file lost under a running broker (``rm pool.sqlite*``): the broker stops granting and saves
its last state as ``pool.sqlite.rescued-*``; restarted, it adopts from that copy the lease of the
kernel that still runs, so the kernel is not stopped as "outside the pool" and its memory is not
granted to anyone else, and it says so in one log line. A real broker process, a real kernel-like
process whose GPU memory the simulated driver lists, SIGKILL."""

from __future__ import annotations

import glob
import os
import time
from pathlib import Path

from broker_harness import BrokerProcess, StandInHub, wait_until
from reliability import _Processes

from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.units import GIB


def test_a_restarted_broker_adopts_the_running_kernel_of_a_lost_pool_file(tmp_path: Path) -> None:
    hub = StandInHub().start()
    alice_token, bob_token = hub.add_user("tok-alice", "alice"), hub.add_user("tok-bob", "bob")
    # Its watchdog stops what holds GPU memory outside the pool after 0.5 s: a forgotten kernel would be.
    config = "c.Broker.run_watchdog = True\nc.Watchdog.interval = 0.2\nc.Watchdog.unpooled_action = 'stop'\nc.Watchdog.grace = 0.5\n"
    broker = BrokerProcess(tmp_path, hub, simulate="1x16GiB", config=config)
    procs = _Processes(f"{broker.db}.usage")
    try:
        broker.start()
        alice, bob = RemotePool(broker.url, token=alice_token, timeout=15), RemotePool(broker.url, token=bob_token, timeout=15)
        lease = alice.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-alice", holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert lease.state is LeaseState.GRANTED
        kernel = procs.start(lease.id)  # its server (this process) runs it
        procs.use(kernel, {lease.devices[0]: 10 * GIB})
        for path in glob.glob(broker.db + "*"):
            if os.path.isfile(path):
                os.unlink(path)  # rm pool.sqlite* (the usage folder of the simulated driver stays)
        rescued = wait_until(lambda: glob.glob(broker.db + ".rescued-*"), timeout=15, what="the broker to save the lost file")
        broker.kill()
        broker.start()
        assert alice.get(lease.id).state is LeaseState.GRANTED, "the running kernel's lease was forgotten"
        waiting = bob.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-bob"))
        time.sleep(1.5)  # past the watchdog's grace, several ticks
        assert bob.get(waiting.id).state is LeaseState.QUEUED, "the kernel's memory was granted again"
        assert procs.procs[kernel].poll() is None, "the broker stopped the adopted kernel"
        log = broker.log()
        assert f"1 lease(s) whose kernels still run were adopted from its rescued copy (kept as {rescued[0]}.adopted)" in log
        assert "alice's k-alice (granted)" in log
        procs.kill(kernel)
        alice.release(lease.id)
        assert bob.wait_for_grant(waiting.id, timeout=10).state is LeaseState.GRANTED
    except GpuPoolError as err:
        raise AssertionError(f"{err}\n{broker.log()[-3000:]}") from None
    finally:
        procs.close()
        broker.stop()
        hub.stop()
