"""MPS memory partitioning: probed on a scripted NVML, planned as soft/hard bounds, applied to a
real kernel process's cgroup; without it an MPS or HAMi-core slice is a fixed slice.

Not run on hardware: the partitioning call needs driver r615 / CUDA 13.4 (the GPUs we could run
on have 580), so these tests script NVML (tests/fake_pynvml.py) and stand a plain folder in for
the cgroup root.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_pynvml import C, FakeGpu, FakeNvml
from jupyter_client.manager import AsyncKernelManager
from test_provisioner import envdump_spec, read_dump  # noqa: F401 - the fixture is used by name
from traitlets.config import Config

from jupyter_gpupool.core.models import Device, Lease, LeaseState
from jupyter_gpupool.enforcement import plan as plan_module
from jupyter_gpupool.enforcement.partition import (
    create_kernel_cgroup,
    kernel_cgroup_path,
    probe_memory_partitioning,
)
from jupyter_gpupool.enforcement.plan import (
    EnforcementConfig,
    EnforcementSettings,
    plan_enforcement,
    size_fixed_at_start,
)
from jupyter_gpupool.units import GIB, MIB

H200 = Device(index=0, uuid="GPU-a", name="NVIDIA H200", memory_total=140 * GIB)


def cgroup_root(tmp_path: Path) -> Path:
    """A folder that looks like a cgroup v2 mount to the probe."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids dmem\n")
    return root


def nvml(driver: str = "615.20", gpus: list[FakeGpu] | None = None) -> FakeNvml:
    fake = FakeNvml(gpus or [FakeGpu("NVIDIA H200", 140 * GIB)], driver_version=driver)
    fake.module.nvmlInit()
    return fake


def elastic_lease(guarantee: int = 4 * GIB, memory: int = 6 * GIB, limit: int = 32 * GIB) -> Lease:
    return Lease(id="L1", owner="alice", memory=memory, devices=("GPU-a",), state=LeaseState.GRANTED, created_at=0.0,
                 guarantee=guarantee,
                 burst_limit=limit)


def test_the_probe_finds_partitioning_on_a_new_driver_with_cgroup_v2(tmp_path):
    found = probe_memory_partitioning(nvml().module, str(cgroup_root(tmp_path)))
    assert found.available and found.why == ""


@pytest.mark.parametrize(
    ("driver", "gpu", "error", "why"),
    [
        ("580.95.05", None, None, "needs r615 / CUDA 13.4"),
        ("615.20", FakeGpu("NVIDIA A100", 80 * GIB, mig=True), None, "does not support memory partitioning"),
        ("615.20", None, "NVML_ERROR_NO_PERMISSION", "needs root"),
        ("615.20", None, "NVML_ERROR_FUNCTION_NOT_FOUND", "has no memory limits call"),
    ],
)
def test_the_probe_says_what_is_missing(tmp_path, driver, gpu, error, why):
    gpu = gpu or FakeGpu("NVIDIA H200", 140 * GIB)
    if error:
        gpu.errors["nvmlDeviceGetMemoryLimits_v1"] = C[error]
    found = probe_memory_partitioning(nvml(driver, [gpu]).module, str(cgroup_root(tmp_path)))
    assert not found.available and why in found.why, found


def test_the_probe_needs_a_cgroup_folder_it_may_write(tmp_path):
    """A per-user server (not root) cannot make kernels' cgroups: it keeps fixed MPS slices. (The
    tests run as root, who may write anywhere, so the access check is the probe's argument here.)"""
    root = str(cgroup_root(tmp_path))
    found = probe_memory_partitioning(nvml().module, root, may_write=lambda path: False)
    assert not found.available and "cannot create cgroups" in found.why and "needs root" in found.why


def test_the_probe_needs_cgroup_v2_and_a_recent_nvidia_ml_py(tmp_path):
    assert "cgroup v2 is not mounted" in probe_memory_partitioning(nvml().module, str(tmp_path)).why
    old = nvml()
    del old.module.nvmlDeviceGetMemoryLimits_v1
    assert "nvidia-ml-py is too old" in probe_memory_partitioning(old.module, str(cgroup_root(tmp_path))).why


def test_with_partitioning_the_guarantee_is_the_soft_bound_and_the_limit_the_hard_one():
    plan = plan_enforcement(elastic_lease(), [H200], EnforcementConfig(mps_pipe_directory="/run/mps", mps_memory_partitioning=True))
    assert plan.partition == (4 * GIB, 32 * GIB)
    assert plan.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={32 * GIB // MIB}M"  # the hard bound, in MPS's own words too
    assert plan.to_json()["bursts"] is True and plan.to_json()["fixed_because"] is None
    assert "guarantees this kernel 4 GiB" in plan.description and "above 32 GiB" in plan.description


@pytest.mark.parametrize(
    ("config", "why"),
    [
        (EnforcementConfig(mps_pipe_directory="/run/mps"), "CUDA MPS sets a kernel's memory limit when it starts"),
        (EnforcementConfig(hami_library="/opt/libvgpu.so"), "HAMi-core sets a kernel's memory limit when it starts"),
    ],
)
def test_without_partitioning_mps_and_hami_slices_are_fixed_and_say_why(config, why):
    plan = plan_enforcement(elastic_lease(memory=4 * GIB), [H200], config)
    assert plan.partition is None and plan.fixed_because == why == size_fixed_at_start(config)
    assert plan.to_json()["bursts"] is False and plan.to_json()["fixed_because"] == why
    assert size_fixed_at_start(EnforcementConfig()) == ""  # framework caps move live: slices may burst
    assert size_fixed_at_start(EnforcementConfig(mps_pipe_directory="/run/mps", mps_memory_partitioning=True)) == ""


def test_settings_probe_once_in_auto_and_obey_on_and_off(tmp_path, monkeypatch):
    fake = nvml()
    fake.install(monkeypatch)
    monkeypatch.setattr(plan_module, "_PROBES", {})
    root = str(cgroup_root(tmp_path))
    settings = EnforcementSettings(mps_pipe_directory="/run/mps", cgroup_root=root)
    assert settings.mps_memory_partitioning == "auto" and settings.to_config().mps_memory_partitioning
    settings.to_config()
    assert fake.calls["nvmlDeviceGetMemoryLimits_v1"] == 1  # probed once per process
    assert not EnforcementSettings(mps_pipe_directory="/run/mps", cgroup_root=root, mps_memory_partitioning="off").to_config().mps_memory_partitioning
    assert not EnforcementSettings(cgroup_root=root).to_config().mps_memory_partitioning  # no MPS: nothing probed
    fake.driver_version = "580.95.05"
    monkeypatch.setattr(plan_module, "_PROBES", {})
    assert not settings.to_config().mps_memory_partitioning
    assert EnforcementSettings(mps_pipe_directory="/run/mps", cgroup_root=root, mps_memory_partitioning="on").to_config().mps_memory_partitioning


def test_a_kernel_cgroup_gets_its_bounds_on_each_gpu_and_a_safe_name(tmp_path):
    fake = nvml(gpus=[FakeGpu("NVIDIA H200", 140 * GIB), FakeGpu("NVIDIA H200", 140 * GIB)])
    root = str(cgroup_root(tmp_path))
    path = create_kernel_cgroup(fake.module, [0, 1], "L1", 4 * GIB, 32 * GIB, root)
    assert path == kernel_cgroup_path("L1", root) and os.path.isdir(path)
    assert fake.memory_limits == {(0, path): (4 * GIB, 32 * GIB), (1, path): (4 * GIB, 32 * GIB)}
    with pytest.raises(ValueError, match="cannot name a cgroup"):
        kernel_cgroup_path("../escape", root)


def test_join_cgroup_moves_the_process_in_before_it_becomes_the_command(tmp_path):
    cgroup = tmp_path / "kernel"
    cgroup.mkdir()
    joined = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", str(cgroup), "--",
         sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert (cgroup / "cgroup.procs").read_text().strip() == joined.stdout.strip()  # the same process, after exec
    missing = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", str(tmp_path / "gone"), "--",
         sys.executable, "-c", "print('ran')"],
        capture_output=True, text=True, timeout=60,
    )
    assert missing.returncode == 0 and missing.stdout.strip() == "ran"
    assert "could not join" in missing.stderr and "MPS hard limit" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.gpupool_env(GPUPOOL_BURST="16GiB")
def test_a_kernel_started_with_partitioning_runs_in_its_cgroup_with_its_bounds(envdump_spec, tmp_path, monkeypatch):
    """The provisioner gives a real kernel process its cgroup, with the guarantee as the soft
    bound and the limit as the hard one, before the kernel runs."""
    ksm, dump = envdump_spec
    fake = nvml()
    fake.install(monkeypatch)
    root = str(cgroup_root(tmp_path))
    config = Config({"EnforcementSettings": {"mps_pipe_directory": str(tmp_path / "mps"), "cgroup_root": root,
                                             "mps_memory_partitioning": "on"}})

    async def scenario() -> None:
        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm, config=config)
        await km.start_kernel()
        try:
            prov = km.provisioner
            seen = await read_dump(dump, prov.pid)
            lease = prov.pool.get(prov.lease_id)
            path = kernel_cgroup_path(lease.id, root)
            assert prov.cgroup == path and (Path(path) / "cgroup.procs").read_text().strip() == str(prov.pid)
            assert fake.memory_limits == {(0, path): (4 * GIB, 16 * GIB)}
            assert seen["env"]["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={16 * GIB // MIB}M"
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())


def test_without_partitioning_an_mps_kernel_asks_for_a_fixed_slice(envdump_spec, tmp_path):
    ksm, dump = envdump_spec
    config = Config({"EnforcementSettings": {"mps_pipe_directory": str(tmp_path / "mps"), "mps_memory_partitioning": "off"}})

    async def scenario() -> None:
        km = AsyncKernelManager(kernel_name="envdump", kernel_spec_manager=ksm, config=config)
        await km.start_kernel()
        try:
            prov = km.provisioner
            await read_dump(dump, prov.pid)
            lease = prov.pool.get(prov.lease_id)
            assert lease.burst_limit == 0 and not lease.elastic and prov.cgroup is None
            assert prov.plan.to_json()["fixed_because"] == "CUDA MPS sets a kernel's memory limit when it starts"
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())
