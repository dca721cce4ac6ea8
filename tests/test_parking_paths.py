"""Parking paths: the framework path when the kernel can take it, the driver checkpoint otherwise.

Real jupyter_server and ipykernel kernels on a simulated 1x16GiB pool. The framework path is
played in the kernel by the simulated memory saver (the memory ``pretend_to_use`` scripted stands
for PyTorch tensors in torch-memory-saver's region); the driver checkpoint by the simulated
checkpointer. Shown: the choice and where it is said (REST, ``%gpupool status``); a framework path
that fails midway falls back to the driver checkpoint with nothing lost; HAMi-core preloaded makes
the kernel refuse the framework path, saying why; the host's one pinned pool and the parked-memory
budget, booked by the pool itself on each lease, decide when a backup may be kept.
"""

from __future__ import annotations

import asyncio
import ctypes.util
import json
import os
import tempfile
from typing import Any

import pytest
from pool_helpers import make_pool, req
from server_kernels import KERNEL_START_TIMEOUT, listening_kernel_pid, release_flag, start_kernel

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.devices.parking import DRIVER_CHECKPOINT, FrameworkPath
from jupyter_gpupool.devices.simulated import SimulatedMemorySaver
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.kernel.parking import FrameworkParking
from jupyter_gpupool.serverextension.app import LEASE_SCHEMA_ID
from jupyter_gpupool.units import GIB

SIMULATED_SAVER = SimulatedMemorySaver.name

pytestmark = [pytest.mark.slow, pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")]


def _fake_hami_library() -> str:
    """A library named like HAMi-core's, harmless to preload (a link to libm), for the kernel to detect."""
    folder = tempfile.mkdtemp(prefix="gpupool-hami-")
    path = os.path.join(folder, "libvgpu.so")
    libm = ctypes.util.find_library("m")
    for candidate in (f"/lib/x86_64-linux-gnu/{libm}", f"/usr/lib/x86_64-linux-gnu/{libm}", f"/lib64/{libm}"):
        if libm and os.path.exists(candidate):
            os.symlink(candidate, path)
            break
    return path


def _gpu_bytes_of(pool: Any, pid: int) -> int:
    """What the simulated GPU shows process ``pid`` holding (as NVML would)."""
    return sum(u.used_memory for u in pool.backend.process_usage() if u.pid == pid)


async def _status(gpupool_fetch: Any, kernel_id: str) -> dict[str, Any]:
    response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id)
    assert response.code == 200, response.body
    return json.loads(response.body)


async def _kernel_holding(gpupool_fetch: Any, gpupool_wait: Any, jp_serverapp: Any, kernel_exec: Any, size: str) -> tuple[str, int]:
    kernel = await start_kernel(gpupool_fetch)
    pid = await gpupool_wait(lambda: listening_kernel_pid(jp_serverapp, kernel), timeout=KERNEL_START_TIMEOUT, what="the kernel to listen")
    await kernel_exec(kernel, f"x = 42\nfrom jupyter_gpupool.devices.simulated import pretend_to_use\npretend_to_use('{size}')")
    return kernel, pid


#: A cell that prints ``x`` and then ``%gpupool status`` as plain text (the magic displays it).
PRINT_X_AND_STATUS = (
    "print(x)\nfrom IPython.utils.capture import capture_output\nwith capture_output() as shown:\n"
    "    get_ipython().run_line_magic('gpupool', 'status')\nprint(shown.outputs[0].data['text/plain'])"
)


async def _suspend(gpupool_fetch: Any, gpupool_wait: Any, pool: Any, kernel: str) -> dict[str, Any]:
    response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
    assert response.code == 200, response.body
    await gpupool_wait(lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, timeout=120, what="the suspend")
    return await _status(gpupool_fetch, kernel)


def test_a_kernel_whose_framework_can_park_is_parked_by_it_and_comes_back_whole(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "3GiB")
        assert _gpu_bytes_of(pool, pid) == 3 * GIB
        status = await _suspend(gpupool_fetch, gpupool_wait, pool, kernel)
        assert status["parking"]["path"] == SIMULATED_SAVER and status["parking"]["path_note"] is None, status
        assert status["parked_memory"] == 3 * GIB, status
        assert _gpu_bytes_of(pool, pid) == 0, "the GPU memory was not freed"

        out = await kernel_exec(kernel, PRINT_X_AND_STATUS)
        assert out.splitlines()[0] == "42"
        assert f"parked by {SIMULATED_SAVER} for its PyTorch tensors" in out and f"last parked by {SIMULATED_SAVER}" in out, out
        assert _gpu_bytes_of(pool, pid) == 3 * GIB, "the framework's memory did not come back"
        assert (await _status(gpupool_fetch, kernel))["parking"] is None
        assert _pinned_backups(pool) == {kernel: 3 * GIB}  # kept pinned for its next park

        # A restart ends the process and its backup with it: its place in the pinned pool goes back.
        response = await gpupool_fetch("api", "kernels", kernel, "restart", method="POST", body={})
        assert response.code == 200, response.body
        assert _pinned_backups(pool) == {}
        assert pool.lease_for_kernel(kernel).state is LeaseState.GRANTED

    arun(scenario())


def test_a_server_that_forgot_which_path_parked_a_kernel_still_brings_its_framework_memory_back(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "2GiB")
        assert (await _suspend(gpupool_fetch, gpupool_wait, pool, kernel))["parking"]["path"] == SIMULATED_SAVER
        gpupool_ext._parked_by.clear()  # as after a restart of the server: only the driver checkpoint is known
        assert (await kernel_exec(kernel, "print(x)")).strip() == "42"
        assert _gpu_bytes_of(pool, pid) == 2 * GIB, "the tensors the framework released were not mapped back"

    arun(scenario())


def test_a_framework_path_that_fails_midway_falls_back_to_the_driver_checkpoint_and_nothing_is_lost(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "3GiB")
        SimulatedMemorySaver.fail_next(pool.backend.usage_dir, "cuMemUnmap failed")
        status = await _suspend(gpupool_fetch, gpupool_wait, pool, kernel)
        assert status["parking"]["path"] == DRIVER_CHECKPOINT, status
        note = status["parking"]["path_note"]
        assert note.startswith(f"{FrameworkPath.name} not used: {FrameworkPath.name} failed (RuntimeError: ") and "cuMemUnmap failed" in note, note
        assert "its memory was put back" in note, note
        assert status["parked_memory"] == 3 * GIB, "the driver checkpoint did not park what the framework put back"
        assert _gpu_bytes_of(pool, pid) == 0

        out = await kernel_exec(kernel, PRINT_X_AND_STATUS)
        assert out.splitlines()[0] == "42"
        assert f"parked by the {DRIVER_CHECKPOINT} instead" in out, out
        assert _gpu_bytes_of(pool, pid) == 3 * GIB, "memory was lost in the fallback"
        assert pool.lease_for_kernel(kernel).state is LeaseState.GRANTED

    arun(scenario())


def test_a_kernel_suspended_while_a_cell_runs_is_parked_by_the_driver_checkpoint(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec, tmp_path
):
    pool = gpupool_ext.pool
    started, release = tmp_path / "cell-started", tmp_path / "cell-may-end"
    events: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        events.append(dict(data))

    jp_serverapp.event_logger.add_listener(schema_id=LEASE_SCHEMA_ID, listener=listener)

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "2GiB")
        # The cell runs (its tensors may be in use) from when it says so until the test lets it end.
        cell = f"open({str(started)!r}, 'w').close()\n" + release_flag(release)
        running = asyncio.ensure_future(kernel_exec(kernel, cell))
        await gpupool_wait(started.exists, timeout=120, what="the cell to start")
        response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
        assert response.code == 200, response.body
        # What the sidebar hears. The kernel is busy, so the server brings it back at once (work
        # arrived): its suspended state may be too short to poll, the event is not.
        suspended = await gpupool_wait(
            lambda: next((e for e in events if e["kernel_id"] == kernel and e["action"] == "suspended"), None),
            timeout=120, what="the suspended event",
        )
        release.touch()
        assert "2 GiB parked in host RAM by driver checkpoint" in suspended["message"], suspended
        assert "a cell is running in the kernel" in suspended["message"], suspended
        assert (await asyncio.wait_for(running, 120)).strip() == "released"
        assert (await kernel_exec(kernel, "print(x)")).strip() == "42" and _gpu_bytes_of(pool, pid) == 2 * GIB

    arun(scenario())


@pytest.mark.gpupool_config({"EnforcementSettings": {"hami_library": _fake_hami_library()}})
def test_a_kernel_with_hami_core_preloaded_refuses_the_framework_path_and_says_why(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "2GiB")
        assert "libvgpu.so" in (await kernel_exec(kernel, "import os; print(os.environ['LD_PRELOAD'])"))
        status = await _suspend(gpupool_fetch, gpupool_wait, pool, kernel)
        assert status["parking"]["path"] == DRIVER_CHECKPOINT, status
        assert "HAMi-core (libvgpu.so) is preloaded in this kernel" in status["parking"]["path_note"], status
        assert status["parked_memory"] == 2 * GIB and _gpu_bytes_of(pool, pid) == 0
        out = await kernel_exec(kernel, PRINT_X_AND_STATUS)
        assert out.splitlines()[0] == "42" and "HAMi-core" in out, out
        assert _gpu_bytes_of(pool, pid) == 2 * GIB

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="6GiB", GPUPOOL_IDLE_POLICY="never", GPUPOOL_PARKED_MEMORY_LIMIT="10GiB")
def test_pinned_backups_kept_between_suspends_count_against_the_parked_memory_budget(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a, pid_a = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "3GiB")
        b, _ = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "2GiB")
        assert pool.policy.parking_pool_bytes(None) == 5 * GIB  # 50% of the 10 GiB budget
        assert (await _suspend(gpupool_fetch, gpupool_wait, pool, a))["parking"]["path"] == SIMULATED_SAVER
        assert (await kernel_exec(a, "print(x)")).strip() == "42"  # resumed: A keeps its pinned backup
        assert _pinned_backups(pool) == {a: 3 * GIB}  # booked on A's lease, in the pool's own store

        # B's slice (6 GiB, set aside while it is parked) and A's kept 3 GiB make 9 GiB: within the
        # 10 GiB budget; the pool has 2 GiB left of 5, and B needs 2: B's backup fits beside A's.
        assert (await _suspend(gpupool_fetch, gpupool_wait, pool, b))["parking"]["path"] == SIMULATED_SAVER
        assert (await kernel_exec(b, "print(x)")).strip() == "42"
        assert _pinned_backups(pool) == {a: 3 * GIB, b: 2 * GIB}

        # A again: its own reservation is reused, whatever else the pool holds.
        assert (await _suspend(gpupool_fetch, gpupool_wait, pool, a))["parking"]["path"] == SIMULATED_SAVER
        assert (await kernel_exec(a, "print(x)\npretend_to_use('4GiB')")).strip() == "42"

        # A now holds 4 GiB: the pool (5 GiB, 2 kept by B) has 3 left, so the driver checkpoint parks it.
        status = await _suspend(gpupool_fetch, gpupool_wait, pool, a)
        assert status["parking"]["path"] == DRIVER_CHECKPOINT, status
        assert "pinned parking pool has 3 GiB free of 5 GiB" in status["parking"]["path_note"], status
        assert status["parked_memory"] == 4 * GIB and _gpu_bytes_of(pool, pid_a) == 0
        assert (await kernel_exec(a, "print(x)")).strip() == "42" and _gpu_bytes_of(pool, pid_a) == 4 * GIB

    arun(scenario())


@pytest.mark.gpupool_env(
    GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never", GPUPOOL_PARKED_MEMORY_LIMIT="10GiB",
    GPUPOOL_PARKING_POOL_SIZE="8GiB",
)
def test_a_suspend_that_would_take_the_parked_memory_budget_past_its_limit_beside_kept_backups_is_refused(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a, _ = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "3GiB")
        b, pid_b = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "1GiB")
        assert (await _suspend(gpupool_fetch, gpupool_wait, pool, a))["parking"]["path"] == SIMULATED_SAVER
        assert (await kernel_exec(a, "print(x)")).strip() == "42"  # A keeps 3 GiB pinned while it runs
        # B parked, by any path: its 8 GiB slice is set aside, and A's 3 GiB kept pinned make 11 GiB, over 10.
        # The pool refuses it before any path is tried, as it refuses its own reclaims' suspends.
        response = await gpupool_fetch("api", "gpupool", "kernels", b, "suspend", method="POST", body={})
        assert response.code == 409, response.body
        assert json.loads(response.body)["message"] == (
            "cannot suspend this kernel: parked slices would take 8 GiB of host RAM beside 3 GiB of pinned backups "
            "running kernels keep, over the limit of 10 GiB (parked_memory_limit)"
        )
        lease_b = pool.lease_for_kernel(b)
        assert lease_b.state is LeaseState.GRANTED and lease_b.parked_memory == 0 and _gpu_bytes_of(pool, pid_b) == GIB
        with pytest.raises(RequestRefused, match="beside 3 GiB of pinned backups"):
            pool.suspend(lease_b.id, reason="reclaimed")  # the pool's own decision counts them too
        assert (await kernel_exec(b, "print(x)")).strip() == "42"

    arun(scenario())


@pytest.mark.gpupool_config({"GpuPoolExtension": {"fast_parking": False}})
def test_fast_parking_off_parks_every_kernel_by_the_driver_checkpoint(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel, pid = await _kernel_holding(gpupool_fetch, gpupool_wait, jp_serverapp, kernel_exec, "1GiB")
        status = await _suspend(gpupool_fetch, gpupool_wait, pool, kernel)
        assert status["parking"]["path"] == DRIVER_CHECKPOINT and status["parking"]["path_note"] is None, status
        assert (await kernel_exec(kernel, "print(x)")).strip() == "42" and _gpu_bytes_of(pool, pid) == GIB

    arun(scenario())


# --- the kernel's probe, without a server ------------------------------------------------------------


def test_the_kernels_probe_names_each_reason_to_refuse_the_framework_path() -> None:
    base = {"CUDA_VISIBLE_DEVICES": "GPU-1"}
    assert "GPUPOOL_FAST_PARKING=off" in FrameworkParking({**base, "GPUPOOL_FAST_PARKING": "off"}).refusal()
    hami = FrameworkParking({**base, "LD_PRELOAD": "/opt/hami/libvgpu.so:/usr/lib/other.so", "GPUPOOL_SIMULATE": "1x16GiB"})
    assert hami.refusal().startswith("HAMi-core (libvgpu.so) is preloaded in this kernel")
    assert FrameworkParking({"CUDA_VISIBLE_DEVICES": ""}).refusal() == "this kernel has no GPU"
    assert FrameworkParking({**base, "GPUPOOL_SIMULATE": "1x16GiB"}).refusal() == ""


def _pinned_backups(pool: Any) -> dict[str, int]:
    """Kernel id → bytes of the pinned parking pool its live lease holds, as the pool's store says."""
    return {lease.kernel_id: lease.pinned_backup for lease in pool.leases() if lease.pinned_backup}


def test_the_pinned_parking_pool_is_booked_by_the_pool_for_every_server_of_its_file(tmp_path: Any) -> None:
    policy = {"parked_memory_limit": "8GiB", "parking_pool_size": "6GiB", "reclaim_action": "suspend"}
    first = make_pool(tmp_path, "1x16GiB", **policy)
    second = make_pool(tmp_path, "1x16GiB", **policy)  # another server of the same user, same pool file
    a, b, c = (
        pool.request(req("alice", 4, kernel_id=kernel, suspendable=True))
        for pool, kernel in ((first, "k-a"), (second, "k-b"), (second, "k-c"))
    )
    assert first.reserve_pinned_backup(a.id, 3 * GIB).pinned_backup == 3 * GIB
    before = second.get(b.id)
    with pytest.raises(RequestRefused, match=r"^the host's pinned parking pool has 3 GiB free of 6 GiB, and this kernel's backup needs 4 GiB$"):
        second.reserve_pinned_backup(b.id, 4 * GIB)
    assert second.get(b.id) == before, "a refused reservation changed the lease"
    assert first.reserve_pinned_backup(a.id, 4 * GIB).pinned_backup == 4 * GIB  # its own grows in place
    # A kernel's word is bounded by what its lease may hold: a made-up figure takes nothing.
    with pytest.raises(RequestRefused, match=r"more than this kernel may hold on its GPUs \(4 GiB\)"):
        second.reserve_pinned_backup(b.id, 64 * GIB)
    # B parked (its 4 GiB slice set aside) beside A's kept 4 GiB fill the 8 GiB budget: C's backup does not fit.
    assert second.suspend(b.id).parked_memory == 4 * GIB
    with pytest.raises(RequestRefused, match=r"^parked slices \(5 GiB\) and the pinned backups running kernels keep \(4 GiB\) would take more"):
        second.reserve_pinned_backup(c.id, GIB)
    first.release(a.id)  # a lease that ends gives its backup back with it
    assert second.reserve_pinned_backup(c.id, 2 * GIB).pinned_backup == 2 * GIB
    assert second.reserve_pinned_backup(c.id, 0).pinned_backup == 0


def test_a_suspended_kernel_that_restarts_asks_again_with_no_backup_booked(tmp_path: Any) -> None:
    """The old process took its pinned backup with it: the lease that asks again for the new one
    holds no place in the host's pinned pool, whatever it had (so it is not counted against the
    parked-memory budget while the new kernel runs)."""
    pool = make_pool(tmp_path, "1x16GiB", parked_memory_limit="8GiB", parking_pool_size="8GiB")
    lease = pool.request(req("alice", 4, kernel_id="k-a", suspendable=True))
    pool.suspend(lease.id, reason="suspended by its user")
    assert pool.reserve_pinned_backup(lease.id, 4 * GIB).pinned_backup == 4 * GIB
    assert pool.confirm_transition(lease.id, parked_bytes=4 * GIB).state is LeaseState.SUSPENDED
    again = pool.request(req("alice", 4, kernel_id="k-a", suspendable=True))  # its restart
    assert again.id == lease.id and again.state is LeaseState.GRANTED and again.parked_memory == 0
    assert again.pinned_backup == 0 and _pinned_backups(pool) == {}


def test_without_a_pinned_parking_pool_a_reservation_is_refused_in_one_line(tmp_path: Any) -> None:
    pool = make_pool(tmp_path, "1x16GiB", parked_memory_limit="8GiB", parking_pool_size="0")
    lease = pool.request(req("alice", 4, kernel_id="k-a", suspendable=True))
    with pytest.raises(RequestRefused, match=r"^the pool has no pinned parking pool \(parking_pool_size is 0"):
        pool.reserve_pinned_backup(lease.id, GIB)
    queued = pool.request(req("alice", 16, kernel_id="k-q", suspendable=True))
    with pytest.raises(RequestRefused, match=r"^cannot set a pinned backup aside: the kernel is queued"):
        pool.reserve_pinned_backup(queued.id, GIB)  # a kernel that holds no GPU parks nothing


@pytest.mark.parametrize("value", ["lots", "150%", "-2GiB", "nan%"])
def test_a_bad_parking_pool_size_is_refused_in_one_line(value: str) -> None:
    from jupyter_gpupool.core.policy import PoolPolicy

    with pytest.raises(InvalidInput, match=r"^invalid parking_pool_size .*give a size \(32GiB\)"):
        PoolPolicy(parking_pool_size=value)
    assert PoolPolicy(parking_pool_size=" 25% ").parking_pool_size == "25%"
    assert PoolPolicy(parked_memory_limit="10GiB", parking_pool_size="25%").parking_pool_bytes(None) == round(2.5 * GIB)
    assert PoolPolicy(parked_memory_limit="10GiB", parking_pool_size="64GiB").parking_pool_bytes(None) == 10 * GIB
