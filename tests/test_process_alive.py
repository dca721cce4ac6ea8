"""One answer to "is this process alive", given by every part of the pool (the watchdog, the claim
rule, unpooled attribution, the local and Slurm pools, the simulated driver): a zombie is dead, a
process one may not inspect exists, an id no process can have is dead. And a slice whose holder
was SIGKILLed goes to the next request at once, not at the next tick. Real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.backends.local import driver as local_driver
from jupyter_gpupool.backends.local import pool as local_pool
from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.backends.slurm import pool as slurm_pool
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.core.validate import pid_max
from jupyter_gpupool.devices import base, simulated
from jupyter_gpupool.enforcement import claims, unpooled, watchdog


def test_every_part_of_the_pool_asks_the_one_helper() -> None:
    for module in (claims, unpooled, watchdog, local_pool, local_driver, slurm_pool):
        assert module.process_alive is base.process_alive, module.__name__
    assert simulated._alive is base.process_alive


def test_a_running_process_is_alive_and_a_zombie_or_an_impossible_id_is_not() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        os.sched_yield()
    try:
        assert base.process_alive(os.getpid())
        assert not base.process_alive(child.pid), "a zombie runs no more code"
    finally:
        child.wait()
    assert not base.process_alive(child.pid)
    for impossible in (0, -1, pid_max() + 1, True, "1", None, 2**70):
        assert not base.process_alive(impossible), impossible


def test_a_process_one_may_not_inspect_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's AccessDenied (another user's process under ``hidepid``): it exists, so it is alive,
    wherever the question is asked (before, the Slurm pool called it dead)."""

    class Hidden:
        def __init__(self, pid: int) -> None:
            raise psutil.AccessDenied(pid)

    monkeypatch.setattr(base.psutil, "Process", Hidden)
    assert base.process_alive(1)
    assert slurm_pool.process_alive(1) and claims.process_alive(1)


def test_a_slice_whose_holder_was_sigkilled_goes_to_the_next_request_without_a_tick(tmp_path) -> None:
    """A gateway kernel holds its own lease and is SIGKILLed before it can release it: the next
    request that would wait for that memory finds the holder gone and is granted at once."""
    pool = make_pool(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alice = pool.request(req("alice", 12, kernel_id="ka", holder_pid=holder.pid, holder_host=HOSTNAME), now=T0)
        assert alice.state is LeaseState.GRANTED
        carol = pool.request(req("carol", 8, kernel_id="kc"), now=T0 + 1)
        assert carol.state is LeaseState.QUEUED  # alice's holder runs: her slice stays hers
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        bob = pool.request(req("bob", 8, kernel_id="kb"), now=T0 + 2)
        assert pool.get(alice.id).state is LeaseState.RELEASED
        assert pool.get(alice.id).release_reason == f"released: its holder process {holder.pid} exited"
        assert bob.state is LeaseState.GRANTED and pool.get(carol.id).state is LeaseState.GRANTED
    finally:
        holder.kill()
        holder.wait()
        pool.close()
