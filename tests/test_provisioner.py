"""The enforcement plan (pure) and the provisioner with real kernel processes, without a server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from jupyter_gpupool.core.models import Device, Lease, LeaseRequest, LeaseState
from jupyter_gpupool.enforcement.plan import EnforcementConfig, plan_enforcement
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.provisioner.kernel_provisioner import (
    GpuPoolProvisioner,
    LeaseWaitAborted,
    holder_identity,
    shared_pool,
)
from jupyter_gpupool.units import GIB, MIB, SIZE_FORMS

A100 = Device(index=0, uuid="GPU-a", name="A100-SXM4-80GB", memory_total=80 * GIB)
A100_B = Device(index=1, uuid="GPU-b", name="A100-SXM4-80GB", memory_total=80 * GIB)
MIG = Device(index=2, uuid="MIG-c", name="A100 MIG 3g.40gb", memory_total=40 * GIB, is_mig=True, parent_uuid="GPU-a")


def lease(memory: int, devices: tuple[str, ...], state: LeaseState = LeaseState.GRANTED, **kw: Any) -> Lease:
    return Lease(id="l-1", owner="alice", memory=memory, state=state, created_at=0.0, devices=devices, **kw)


# --- the plan --------------------------------------------------------------------------------------


def test_plan_framework_caps_and_watchdog_by_default() -> None:
    plan = plan_enforcement(lease(20 * GIB, ("GPU-a",)), [A100, A100_B])
    assert plan.level == "soft" and plan.mechanisms == ("framework-caps", "watchdog")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "GPU-a"
    assert plan.env["GPUPOOL_MEMORY_LIMIT"] == str(20 * GIB)
    assert plan.env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
    assert plan.env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert plan.env["CUPY_GPU_MEMORY_LIMIT"] == str(20 * GIB)
    assert plan.env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in plan.env and "LD_PRELOAD" not in plan.apply({})
    assert "20 GiB" in plan.description and plan.to_json()["level"] == "soft"


def test_plan_fraction_rounds_down_so_jax_never_exceeds_the_slice() -> None:
    plan = plan_enforcement(lease(int(26.66 * GIB), ("GPU-a",)), [A100])
    assert float(plan.env["XLA_PYTHON_CLIENT_MEM_FRACTION"]) * 80 * GIB <= 26.66 * GIB


def test_plan_mig_instance_is_hard() -> None:
    plan = plan_enforcement(lease(40 * GIB, ("MIG-c",)), [A100, MIG], EnforcementConfig(mps_pipe_directory="/tmp/mps"))
    assert plan.level == "hard" and plan.mechanisms[0] == "mig" and "watchdog" in plan.mechanisms
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "MIG-c"
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in plan.env  # MIG already isolates


def test_plan_mps_limits_every_visible_device() -> None:
    config = EnforcementConfig(mps_pipe_directory="/run/mps")
    plan = plan_enforcement(lease(8 * GIB, ("GPU-a", "GPU-b"), num_gpus=2, compute_share=25), [A100, A100_B], config)
    assert plan.level == "strong" and plan.mechanisms == ("mps", "framework-caps", "watchdog")
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert plan.env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/mps"
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={8 * GIB // MIB}M,1={8 * GIB // MIB}M"
    assert plan.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


def test_plan_hami_preloads_and_uses_one_cache_file_per_lease() -> None:
    config = EnforcementConfig(hami_library="/opt/hami/libvgpu.so", hami_cache_dir="/var/cache/gpupool", framework_caps=False)
    plan = plan_enforcement(lease(6 * GIB, ("GPU-a",), compute_share=50), [A100], config)
    assert plan.level == "strong" and plan.mechanisms == ("hami", "watchdog")
    env = plan.apply({"LD_PRELOAD": "/usr/lib/other.so"})
    assert env["LD_PRELOAD"] == "/opt/hami/libvgpu.so:/usr/lib/other.so"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "6144m" and env["CUDA_DEVICE_SM_LIMIT_0"] == "50"
    assert env["CUDA_DEVICE_MEMORY_SHARED_CACHE"] == "/var/cache/gpupool/gpupool-l-1.cache"
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in env
    # Applying twice does not stack the preload.
    assert plan.apply(env)["LD_PRELOAD"] == env["LD_PRELOAD"]


def test_plan_without_a_grant_hides_every_gpu() -> None:
    for state in (LeaseState.QUEUED, LeaseState.RELEASED):
        plan = plan_enforcement(lease(8 * GIB, (), state=state), [A100])
        assert plan.level == "none" and plan.env["CUDA_VISIBLE_DEVICES"] == "" and plan.mechanisms == ()


# --- the provisioner with real processes ---------------------------------------------------------

ENV_DUMPER = """
import json, os, sys, time
with open(os.environ["DUMP_TO"] + "." + str(os.getpid()), "w") as f:
    json.dump({"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid()}, f)
while True:
    time.sleep(1)
"""


@pytest.fixture
def envdump_spec(tmp_path: Path, gpupool_env: dict[str, str]) -> tuple[KernelSpecManager, Path]:
    """A non-IPython "kernel": a script that records the environment it was started with."""
    script = tmp_path / "envdump.py"
    script.write_text(ENV_DUMPER)
    kernels = tmp_path / "kernels" / "envdump"
    kernels.mkdir(parents=True)
    dump = tmp_path / "dump"
    (kernels / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, str(script), "{connection_file}"],
                "display_name": "env dumper",
                "language": "shell",
                "env": {"DUMP_TO": str(dump), "CUDA_VISIBLE_DEVICES": "all"},
                "metadata": {"kernel_provisioner": {"provisioner_name": "gpupool-provisioner", "config": {"memory": "4GiB"}}},
            }
        )
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return ksm, dump


async def read_dump(dump: Path, pid: int, timeout: float = 20.0) -> dict[str, Any]:
    path = Path(f"{dump}.{pid}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"the kernel process {pid} wrote no environment")


@contextlib.asynccontextmanager
async def envdump_kernel(ksm: Any) -> AsyncIterator[tuple[AsyncKernelManager, GpuPoolProvisioner]]:
    """The ``envdump`` kernel started under the pool's provisioner; shut down on the way out."""
    km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
    await km.start_kernel()
    try:
        prov = km.provisioner
        assert isinstance(prov, GpuPoolProvisioner)
        yield km, prov
    finally:
        await km.shutdown_kernel(now=True)


@pytest.mark.gpupool_env(GPUPOOL_HEARTBEAT_TTL="2")
def test_non_ipython_kernel_gets_its_grant_keeps_it_on_restart_and_releases_it(envdump_spec) -> None:
    ksm, dump = envdump_spec

    async def scenario() -> None:
        async with envdump_kernel(ksm) as (km, prov):
            pool = prov.pool
            seen = await read_dump(dump, prov.pid)
            lease = pool.get(prov.lease_id)
            assert lease.state is LeaseState.GRANTED and lease.memory == 4 * GIB  # from the kernelspec config
            assert lease.kernel_id == km.kernel_id and (lease.holder_host, lease.holder_pid) == holder_identity()
            env = seen["env"]
            # The grant wins over the kernelspec's own CUDA_VISIBLE_DEVICES.
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(lease.devices)
            assert env["GPUPOOL_LEASE_ID"] == lease.id and env["GPUPOOL_MEMORY_LIMIT"] == str(4 * GIB)
            assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.250"
            assert env["GPUPOOL_DB"] == str(pool.db_path) and env["GPUPOOL_SIMULATE"] == "1x16GiB"
            assert not any("--ext" in arg for arg in seen["argv"])  # not an IPython kernel

            # Outside a server the provisioner heartbeats its lease itself (a batch run counts as busy).
            first_beat = pool.get(lease.id).heartbeat_at
            await asyncio.sleep(0.8)
            beat = pool.get(lease.id)
            assert beat.heartbeat_at > first_beat and beat.busy

            old_pid = prov.pid
            await km.restart_kernel(now=True)
            assert km.provisioner.pid != old_pid
            again = await read_dump(dump, km.provisioner.pid)
            assert again["env"]["GPUPOOL_LEASE_ID"] == lease.id
            assert pool.get(lease.id).state is LeaseState.GRANTED
        released = pool.get(lease.id)
        assert released.state is LeaseState.RELEASED and released.release_reason == "kernel shut down"

    asyncio.run(scenario())


@pytest.mark.parametrize(
    "reason, taken_back",
    [("reclaimed: idle for 3 s while 1 job waited in partition gpu", True), ("kernel k is gone: its process ended", False)],
)
def test_a_restart_after_the_slice_was_taken_back_shuts_down_instead_of_asking_again(envdump_spec, reason, taken_back) -> None:
    """The pool took the slice back (an idle reclaim) and the kernel's process died before the server
    shut it down (a Slurm step is cancelled with its job): the restarter's restart must not queue a
    new request behind the user's back, as it does when the kernel merely died."""
    ksm, _ = envdump_spec

    async def scenario() -> None:
        async with envdump_kernel(ksm) as (km, prov):
            pool, first = prov.pool, prov.lease_id
            pool.release(first, reason=reason)
            if taken_back:
                with pytest.raises(LeaseWaitAborted, match=r"its GPU slice was taken back \(reclaimed: idle for 3 s"):
                    await km.restart_kernel(now=True)
                assert prov.slice_ended == reason  # the server shuts the kernel down with this reason
                assert [lease.id for lease in pool.leases(include_released=True, kernel_id=km.kernel_id)] == [first]
            else:
                await km.restart_kernel(now=True)
                again = pool.lease_for_kernel(km.kernel_id)
                assert again.id != first and again.state is LeaseState.GRANTED and not prov.slice_ended

    asyncio.run(scenario())


def test_queued_start_waits_without_blocking_the_loop(envdump_spec) -> None:
    ksm, dump = envdump_spec

    async def scenario() -> None:
        pool = shared_pool()
        host, pid = holder_identity()
        blocker = pool.request(LeaseRequest(owner="bob", memory=14 * GIB, holder_pid=pid, holder_host=host))
        assert blocker.state is LeaseState.GRANTED
        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
        start = asyncio.ensure_future(km.start_kernel())
        beats = 0
        while pool.lease_for_kernel(km.kernel_id or "") is None:
            beats += 1
            await asyncio.sleep(0.02)
        queued = pool.lease_for_kernel(km.kernel_id)
        assert queued.state is LeaseState.QUEUED
        for _ in range(10):  # the loop keeps running while the start waits
            await asyncio.sleep(0.05)
            beats += 1
        assert not start.done() and beats >= 10
        pool.release(blocker.id)
        await asyncio.wait_for(start, 30)
        try:
            seen = await read_dump(dump, km.provisioner.pid)
            assert seen["env"]["GPUPOOL_LEASE_ID"] == queued.id
        finally:
            await km.shutdown_kernel(now=True)

        # A queued start whose request is withdrawn (what the server does on shutdown) fails fast.
        blocker = pool.request(LeaseRequest(owner="bob", memory=14 * GIB, holder_pid=pid, holder_host=host))
        km2 = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
        start = asyncio.ensure_future(km2.start_kernel())
        while pool.lease_for_kernel(km2.kernel_id or "") is None:
            await asyncio.sleep(0.02)
        pool.release(pool.lease_for_kernel(km2.kernel_id).id, reason="kernel shut down while queued")
        with pytest.raises(LeaseWaitAborted, match="shut down while queued"):
            await asyncio.wait_for(start, 10)
        pool.release(blocker.id)

    asyncio.run(scenario())


def test_size_from_kernelspec_then_saved_preference_then_policy(gpupool_env) -> None:
    pool = shared_pool()

    def request(config: dict[str, Any]) -> LeaseRequest:
        spec = KernelSpec(argv=["x"], display_name="GPU", language="python")
        return GpuPoolProvisioner(kernel_id="k-1", kernel_spec=spec, **config).build_request()

    assert request({}).memory == 8 * GIB  # GPUPOOL_DEFAULT_MEMORY
    pool.set_preference("alice", memory="6GiB", num_gpus=1)
    assert request({}).memory == 6 * GIB
    assert request({"memory": "2GiB"}).memory == 2 * GIB
    assert request({"memory": "25%"}).memory == 4 * GIB  # of the largest GPU (16 GiB)
    req = request({"memory": "1GiB", "priority": "high", "label": "training"})
    assert req.owner == "alice" and req.kernel_id == "k-1" and req.label == "training" and req.priority.value == "high"
    with pytest.raises(InvalidInput) as err:
        request({"memory": "lots"})
    assert SIZE_FORMS in str(err.value) and "kernelspec" in str(err.value)
    with pytest.raises(InvalidInput, match="batch, normal or high"):
        request({"priority": "urgent"})


# --- fail closed outside a server (nbconvert, nbclient, papermill) -------------------------------


@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="soon")
def test_pool_that_cannot_open_gives_a_cpu_only_kernel_never_an_unpooled_one(envdump_spec, caplog) -> None:
    """Outside a server, a pool that cannot be opened (here an invalid GPUPOOL_* value) starts the
    kernel with every GPU hidden, no lease, and a warning naming the cause; restart keeps it so."""
    ksm, dump = envdump_spec

    async def scenario() -> None:
        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
        with caplog.at_level("WARNING"):
            await km.start_kernel()
        try:
            prov = km.provisioner
            env = (await read_dump(dump, prov.pid))["env"]
            # The kernelspec asked for CUDA_VISIBLE_DEVICES=all: fail closed wins over it.
            assert env["CUDA_VISIBLE_DEVICES"] == "" and env["NVIDIA_VISIBLE_DEVICES"] == "void"
            assert "GPUPOOL_LEASE_ID" not in env and "GPUPOOL_MEMORY_LIMIT" not in env
            assert "GPUPOOL_IDLE_TIMEOUT" in env["GPUPOOL_UNAVAILABLE"]
            assert prov.lease_id is None and prov.cpu_only_reason and prov.failure is None
            assert any("starts CPU-only" in r.getMessage() and "GPUPOOL_IDLE_TIMEOUT" in r.getMessage() for r in caplog.records)
            await km.restart_kernel(now=True)
            again = (await read_dump(dump, km.provisioner.pid))["env"]
            assert again["CUDA_VISIBLE_DEVICES"] == ""
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())


@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="soon", GPUPOOL_WHEN_UNAVAILABLE="refuse")
def test_refuse_outside_a_server_fails_the_start_with_the_reason(envdump_spec) -> None:
    ksm, dump = envdump_spec

    async def scenario() -> None:
        from jupyter_gpupool.errors import PoolUnavailable

        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
        with pytest.raises(PoolUnavailable, match="GPUPOOL_IDLE_TIMEOUT"):
            await km.start_kernel()
        assert km.provisioner is None or not km.provisioner.has_process
        assert not list(dump.parent.glob(dump.name + ".*"))  # no kernel process ever ran

    asyncio.run(scenario())


def test_a_request_larger_than_any_gpu_fails_the_start_with_the_reason(envdump_spec, gpupool_env) -> None:
    ksm, _dump = envdump_spec
    shared_pool().set_preference("alice", memory="64GiB")
    spec = json.loads((Path(ksm.kernel_dirs[0]) / "envdump" / "kernel.json").read_text())
    spec["metadata"]["kernel_provisioner"]["config"] = {}
    (Path(ksm.kernel_dirs[0]) / "envdump" / "kernel.json").write_text(json.dumps(spec))

    async def scenario() -> None:
        from jupyter_gpupool.errors import RequestRefused

        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm)
        with pytest.raises(RequestRefused):
            await km.start_kernel()
        assert km.provisioner.phase == "failed" and "16 GiB" in km.provisioner.failure

    asyncio.run(scenario())


def test_the_shared_pool_follows_every_variable_that_chooses_a_pool(gpupool_env, monkeypatch, tmp_path) -> None:
    """A process whose environment changes to another backend or another broker file gets that
    pool, not the one opened under the old settings."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    local = shared_pool()
    assert shared_pool() is local
    monkeypatch.setenv("GPUPOOL_BACKEND", "slurm")
    monkeypatch.setenv("GPUPOOL_SLURM_STATE", str(tmp_path / "slurm.sqlite"))
    assert isinstance(shared_pool(), SlurmPool)
    monkeypatch.delenv("GPUPOOL_BACKEND")
    assert shared_pool() is local
    monkeypatch.setenv("GPUPOOL_BROKER_FILE", str(tmp_path / "none-here.json"))
    assert shared_pool() is not local
