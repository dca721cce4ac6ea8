"""The pool's own reads of the driver count a re-reserved kernel's memory for its new lease.

A kernel that leased for itself keeps its first lease in its start environment after
``%gpupool release`` and ``%gpupool reserve``. What the driver shows it holding is its new lease's
in every read the pool makes of the driver (what is free, what a lease holds, memory held after a
release, a lost pool file's rescue), by the one claim rule device control and the watchdog use
(:class:`~jupyter_gpupool.enforcement.claims.KernelLeases`: the live lease of the same owner and
kernel); a copy of the released lease's id in another user's process is nobody's. Real SQLite,
real processes of real Unix users; only the GPU is simulated.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from pool_helpers import T0, make_pool, req
from test_ownership import (  # noqa: F401 - processes and unix_users are fixtures
    ALICE,
    BOB,
    lease_process,
    processes,
    unix_users,
)

from jupyter_gpupool.backends.local.driver import DriverReading, ended_in
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other Unix users (root only)")

Start = Callable[..., subprocess.Popen[bytes]]


def test_a_re_reserved_kernels_memory_counts_for_its_new_lease_and_a_copy_of_its_old_id_for_nobody(
    tmp_path: Path, unix_users: dict[str, int], processes: Start  # noqa: F811 - fixtures
) -> None:
    pool = make_pool(tmp_path)
    first = pool.request(req(ALICE, 4, kernel_id="ka"), now=T0)
    kernel = lease_process(processes, first.id, ALICE)  # its start environment names its first lease
    gpu = first.devices[0]
    pool.backend.set_usage(kernel.pid, gpu, 3 * GIB)
    pool.release(first.id, reason="%gpupool release", now=T0 + 10)
    assert [row["pid"] for row in pool.unpooled(now=T0 + 10)] == [kernel.pid]  # held, not granted: nobody's yet
    again = pool.request(req(ALICE, 4, kernel_id="ka"), now=T0 + 11)  # %gpupool reserve
    assert again.state is LeaseState.GRANTED and again.id != first.id
    copy = lease_process(processes, first.id, BOB)  # bob copies the released lease's id
    pool.backend.set_usage(copy.pid, gpu, 2 * GIB)

    reading = DriverReading(pool.backend.process_usage, ended=ended_in(pool.store)).bind(pool.store.live_leases())
    assert reading.held() == {gpu: {again.id: 3 * GIB, "": 2 * GIB}}
    assert reading.holdings(pool.get(again.id)) == [(kernel.pid, gpu, 3 * GIB)]
    assert (reading.lease_of(kernel.pid), reading.lease_of(copy.pid)) == (again.id, "")

    # The pool's decisions read it so: the kernel's 3 GiB are within its 4 GiB slice, no longer
    # memory held after a release; bob's 2 GiB are taken, nobody's. 16 - 4 - 2 = 10 GiB free.
    pool.tick(now=T0 + 12)
    assert [row["pid"] for row in pool.unpooled(now=T0 + 12)] == []
    wide = pool.request(req(BOB, 10.5, kernel_id="kb-wide"), now=T0 + 13)
    assert wide.state is LeaseState.QUEUED  # bob's copy is not alice's: its 2 GiB are taken beside her slice
    pool.release(wide.id, now=T0 + 14)
    assert pool.request(req(BOB, 10, kernel_id="kb"), now=T0 + 15).state is LeaseState.GRANTED


def test_a_rescued_pool_adopts_a_re_reserved_kernel_by_its_old_lease_id_but_not_another_users_copy(
    tmp_path: Path, unix_users: dict[str, int], processes: Start  # noqa: F811 - fixtures
) -> None:
    for whose, adopted in ((ALICE, True), (BOB, False)):
        folder = tmp_path / whose
        folder.mkdir()
        pool = make_pool(folder)
        first = pool.request(req(ALICE, 4, kernel_id="ka"), now=T0)
        pool.release(first.id, reason="%gpupool release", now=T0 + 10)
        # Its server (the holder) is gone: only what the driver shows says the kernel still runs.
        again = pool.request(req(ALICE, 4, kernel_id="ka", holder_pid=2**22 - 1, holder_host="elsewhere"), now=T0 + 11)
        assert again.state is LeaseState.GRANTED
        process = lease_process(processes, first.id, whose)  # names the released lease
        pool.backend.set_usage(process.pid, again.devices[0], 3 * GIB)
        pool.close()
        os.replace(pool.db_path, f"{pool.db_path}.rescued-20260101T000000-1")  # the file lost, its copy saved
        fresh = Pool(pool.backend, pool.db_path, pool.policy, clock=lambda: T0 + 20)  # adopts from the copy
        try:
            assert [lease.id for lease in fresh.leases()] == ([again.id] if adopted else []), whose
        finally:
            fresh.close()
