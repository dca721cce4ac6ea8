"""A kernelspec asking for more memory than one GPU holds starts a kernel on the fewest GPUs that
hold it, with the per-GPU share in its environment (docs/scheduling.md, "Requests larger than one GPU")."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
from test_provisioner import ENV_DUMPER, read_dump

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner
from jupyter_gpupool.units import GIB


@pytest.mark.gpupool_env(GPUPOOL_SIMULATE="2xA100-16GB")
def test_a_24gib_kernelspec_on_16gib_gpus_spans_two_gpus(tmp_path: Path, gpupool_env: dict[str, str]) -> None:
    script = tmp_path / "envdump.py"
    script.write_text(ENV_DUMPER)
    spec_dir = tmp_path / "kernels" / "big"
    spec_dir.mkdir(parents=True)
    dump = tmp_path / "dump"
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, str(script), "{connection_file}"],
                "display_name": "big",
                "language": "shell",
                "env": {"DUMP_TO": str(dump)},
                "metadata": {"kernel_provisioner": {"provisioner_name": "gpupool-provisioner", "config": {"memory": "24GiB"}}},
            }
        )
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])

    async def scenario() -> None:
        km = AsyncKernelManager(kernel_name="big", kernel_spec_manager=ksm)
        await km.start_kernel()
        try:
            prov = km.provisioner
            assert isinstance(prov, GpuPoolProvisioner)
            lease = prov.pool.get(prov.lease_id)
            assert lease.state is LeaseState.GRANTED
            assert (lease.num_gpus, lease.memory) == (2, 12 * GIB)
            env = (await read_dump(dump, prov.pid))["env"]
            assert env["CUDA_VISIBLE_DEVICES"] == ",".join(lease.devices) and len(set(lease.devices)) == 2
            assert env["GPUPOOL_MEMORY_LIMIT"] == str(12 * GIB)  # the share on each GPU
            assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.750"
        finally:
            await km.shutdown_kernel(now=True)

    asyncio.run(scenario())
