"""Batch runs share the pool below live users: a kernel started outside a Jupyter server (here a real
``jupyter nbconvert --execute`` of a notebook on the plain ``python3`` kernelspec) leases as ``batch``
and waits behind a live user's kernel that asked later."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpec

from jupyter_gpupool.core.models import LeaseRequest, LeaseState, PriorityClass
from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner, holder_identity
from jupyter_gpupool.units import GIB

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

CELL = "import os\nprint(os.environ.get('GPUPOOL_LEASE_ID'))"


def plain_python3_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells.append(nbformat.v4.new_code_cell(CELL))
    nbformat.write(nb, path)


def test_outside_a_server_a_kernel_asks_for_batch_unless_its_kernelspec_says(gpupool_env) -> None:
    spec = KernelSpec(argv=["x"], display_name="Python 3", language="python")

    def priority(**config: str) -> PriorityClass | None:
        return GpuPoolProvisioner(kernel_id="k-1", kernel_spec=spec, **config).build_request().priority

    assert priority() is PriorityClass.BATCH
    assert priority(priority="high") is PriorityClass.HIGH  # a kernelspec's own class wins
    assert priority(unattended_priority="") is PriorityClass.NORMAL  # the admin's opt-out


def test_nbconvert_on_plain_python3_leases_as_batch_and_waits_behind_a_live_user(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, tmp_path: Path
):
    notebook = tmp_path / "grading.ipynb"
    plain_python3_notebook(notebook)
    # The one documented step for plain kernelspecs outside a server (see README, "Batch runs").
    env = dict(os.environ, JUPYTER_DEFAULT_PROVISIONER_NAME="gpupool-provisioner")
    pool = gpupool_ext.pool

    async def scenario() -> None:
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        live = json.loads(response.body)["id"]
        await gpupool_wait(
            lambda: (lease := pool.lease_for_kernel(live)) and lease.state is LeaseState.GRANTED, what="the live kernel's grant"
        )
        host, pid = holder_identity()
        filler = pool.request(LeaseRequest(owner="bob", memory=8 * GIB, holder_pid=pid, holder_host=host))
        assert filler.state is LeaseState.GRANTED  # the 16 GiB pool is now full

        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, then polled without blocking
            [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(notebook), "--output", "graded.ipynb"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            batch = await gpupool_wait(
                lambda: next((lease for lease in pool.leases() if lease.holder_pid == proc.pid), None),
                timeout=60,
                what="nbconvert's request in the pool",
            )
            assert batch.state is LeaseState.QUEUED and batch.priority is PriorityClass.BATCH

            # A live user opens a notebook after the batch run asked: it goes ahead of it.
            response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
            later = json.loads(response.body)["id"]
            second = await gpupool_wait(lambda: pool.lease_for_kernel(later), what="the second live kernel's request")
            assert second.priority is PriorityClass.NORMAL
            assert [lease.id for lease in pool.queue()] == [second.id, batch.id]

            pool.release(filler.id)
            await gpupool_wait(
                lambda: pool.get(second.id).state is LeaseState.GRANTED, what="the live kernel granted before the batch run"
            )
            ticks = gpupool_ext.tick_count
            await gpupool_wait(lambda: gpupool_ext.tick_count >= ticks + 2, what="two ticks while the batch run waits")
            assert pool.get(batch.id).state is LeaseState.QUEUED and proc.poll() is None

            # The first live kernel ends: now the batch run gets its slice, runs and finishes.
            await gpupool_fetch("api", "kernels", live, method="DELETE")
            started = time.monotonic()
            while proc.poll() is None:
                assert time.monotonic() - started < 90, "nbconvert did not finish after a slice freed up"
                await asyncio.sleep(0.2)
            output = proc.stdout.read().decode() if proc.stdout else ""
            assert proc.returncode == 0, output
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        graded = nbformat.read(tmp_path / "graded.ipynb", as_version=4)
        assert graded.cells[0].outputs[0]["text"].strip() == batch.id
        final = pool.get(batch.id)
        assert final.priority is PriorityClass.BATCH and final.granted_at is not None
        assert final.state is LeaseState.RELEASED

    arun(scenario())


def test_papermill_runs_lease_as_batch_too(tmp_path: Path) -> None:
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    db = tmp_path / "pool.sqlite"
    plain_python3_notebook(tmp_path / "in.ipynb")
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(db), "GPUPOOL_DEFAULT_MEMORY": "4GiB",
           "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner"}
    result = subprocess.run([sys.executable, "-m", "papermill", "in.ipynb", "out.ipynb"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lease_id = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[0].outputs[0]["text"].strip()
    lease = Pool(SimulatedBackend.from_spec("1x16GiB"), str(db)).get(lease_id)
    assert lease.priority is PriorityClass.BATCH and lease.granted_at is not None
