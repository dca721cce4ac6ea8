"""A pool file lost with no rescued copy of it (the broker was SIGKILLed, then ``rm pool.sqlite*``):
the next pool made on that path adopts from the driver alone the kernels that still run, each a
granted lease of the user its environment names and may claim, sized by what the driver shows it
holding; a process that names a lease it may not claim stays outside the pool, granted to nobody.
Nothing is granted twice and no running kernel is stopped. Real processes, the simulated driver's
per-process memory, a real broker killed with SIGKILL."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
from pathlib import Path

import pytest
from reliability import _Processes, lost_pool_file_broker

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB


def kernel(procs: _Processes, lease_id: str, user: str, kernel_id: str, run_as: str | None = None) -> int:
    """A process started as the provisioner starts a kernel (its environment names its lease, its
    user and its kernel id), run as ``run_as`` (default: this process's user)."""
    env = {"PATH": "/usr/bin:/bin", "GPUPOOL_LEASE_ID": lease_id, "GPUPOOL_USER": user, "GPUPOOL_KERNEL_ID": kernel_id}
    proc = subprocess.Popen(["sleep", "600"], env=env, user=run_as)
    procs.procs[proc.pid] = proc
    return proc.pid


def test_a_broker_restarted_on_a_lost_file_with_no_rescued_copy_adopts_kernels_from_the_driver(tmp_path: Path) -> None:
    with lost_pool_file_broker(tmp_path, lambda procs, lease_id: kernel(procs, lease_id, "alice", "k-alice")) as lost:
        broker, alice, bob, lease = lost.broker, lost.alice, lost.bob, lost.lease
        broker.kill()  # SIGKILL: nobody is left to save the file's last state
        lost.remove_pool_file()
        broker.start()
        assert not glob.glob(broker.db + ".rescued-*")
        adopted = alice.get(lease.id)
        assert adopted.state is LeaseState.GRANTED and adopted.owner == "alice" and adopted.kernel_id == "k-alice", adopted
        assert adopted.devices == lease.devices and adopted.memory == 10 * GIB, adopted
        waiting = lost.bob_waits()
        lines = [line for line in broker.log().splitlines() if "no rescued copy of it was found" in line]
        assert len(lines) == 1 and "1 running kernel(s) the driver shows were adopted" in lines[0], lines
        assert "alice's k-alice (10 GiB on 1 GPU(s))" in lines[0] and "0 process(es) naming a lease" in lines[0], lines
        lost.procs.kill(lost.kernel)  # the kernel ends: its lease is reclaimed, and the memory goes to bob
        assert bob.wait_for_grant(waiting.id, timeout=10).state is LeaseState.GRANTED


def test_a_process_naming_a_lease_it_may_not_claim_stays_outside_the_pool(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two processes of other Unix users name leases: daemon's names its own user (adopted as
    daemon's), nobody's names alice (not adopted: its 4 GiB stays held, granted to nobody)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the processes as other Unix users")
    db = str(tmp_path / "pool.sqlite")
    procs = _Processes(f"{db}.usage")
    device = SimulatedBackend.from_spec("1x16GiB").devices()[0].uuid
    try:
        own = kernel(procs, "l-daemons", "daemon", "k-daemon", run_as="daemon")
        forged = kernel(procs, "l-forged", "alice", "k-alice", run_as="nobody")
        procs.use(own, {device: 6 * GIB})
        procs.use(forged, {device: 4 * GIB})
        with caplog.at_level(logging.WARNING, logger="jupyter_gpupool.backends.local.rescue"):
            backend = SimulatedBackend.from_spec("1x16GiB")
            backend.usage_dir = f"{db}.usage"
            pool = Pool(backend, db, PoolPolicy(heartbeat_ttl=10**9))
        try:
            [lease] = pool.leases()
            assert (lease.id, lease.owner, lease.kernel_id, lease.memory) == ("l-daemons", "daemon", "k-daemon", 6 * GIB)
            assert lease.holder_pid == own and lease.state is LeaseState.GRANTED
            assert f"1 process(es) naming a lease they may not claim were left outside the pool, granted to nobody (pids {forged})" in caplog.text
            assert pool.request(LeaseRequest(owner="bob", memory=7 * GIB)).state is LeaseState.QUEUED, "the forged 4 GiB was granted"
            assert pool.request(LeaseRequest(owner="carol", memory=6 * GIB)).state is LeaseState.GRANTED
        finally:
            pool.close()
        assert all(proc.poll() is None for proc in procs.procs.values()), "a running process was stopped"
    finally:
        procs.close()
