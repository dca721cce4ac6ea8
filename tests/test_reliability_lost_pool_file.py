"""A pool file lost under a running broker (``rm pool.sqlite*``): the broker stops granting and saves
its last state as ``pool.sqlite.rescued-*``; restarted, it adopts from that copy the lease of the
kernel that still runs, so the kernel is not stopped as "outside the pool" and its memory is not
granted to anyone else, and it says so in one log line. A real broker process, a real kernel-like
process whose GPU memory the simulated driver lists, SIGKILL."""

from __future__ import annotations

import glob
from pathlib import Path

from broker_harness import wait_until
from reliability import lost_pool_file_broker

from jupyter_gpupool.core.models import LeaseState


def test_a_restarted_broker_adopts_the_running_kernel_of_a_lost_pool_file(tmp_path: Path) -> None:
    # Alice's kernel is a process of its server (this process) that names its lease.
    with lost_pool_file_broker(tmp_path, lambda procs, lease_id: procs.start(lease_id)) as lost:
        broker, alice, bob, lease = lost.broker, lost.alice, lost.bob, lost.lease
        lost.remove_pool_file()
        rescued = wait_until(lambda: glob.glob(broker.db + ".rescued-*"), timeout=15, what="the broker to save the lost file")
        broker.kill()
        broker.start()
        assert alice.get(lease.id).state is LeaseState.GRANTED, "the running kernel's lease was forgotten"
        waiting = lost.bob_waits()
        log = broker.log()
        assert f"1 lease(s) whose kernels still run were adopted from its rescued copy (kept as {rescued[0]}.adopted)" in log
        assert "alice's k-alice (granted)" in log
        lost.procs.kill(lost.kernel)
        alice.release(lease.id)
        assert bob.wait_for_grant(waiting.id, timeout=10).state is LeaseState.GRANTED
