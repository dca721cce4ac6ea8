"""``jupyter nbconvert --execute`` shares the pool file with a running server and waits its turn."""

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

from jupyter_gpupool.core.models import LeaseState

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

CELL = "import os, json\nprint(json.dumps({k: os.environ.get(k) for k in ('GPUPOOL_LEASE_ID', 'CUDA_VISIBLE_DEVICES', 'GPUPOOL_MEMORY_LIMIT')}))"


def test_nbconvert_waits_while_lab_kernels_hold_the_pool(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, tmp_path: Path
):
    notebook = tmp_path / "job.ipynb"
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells.append(nbformat.v4.new_code_cell(CELL))
    nbformat.write(nb, notebook)
    env = dict(os.environ, JUPYTER_DEFAULT_PROVISIONER_NAME="gpupool-provisioner")
    pool = gpupool_ext.pool

    async def scenario() -> None:
        lab = []
        for _ in range(2):
            response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
            lab.append(json.loads(response.body)["id"])
        await gpupool_wait(
            lambda: all((lease := pool.lease_for_kernel(k)) and lease.state is LeaseState.GRANTED for k in lab),
            what="the lab kernels to hold the pool",
        )
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, then polled without blocking
            [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(notebook), "--output", "done.ipynb"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            # nbconvert's kernel asks the same pool (same GPUPOOL_DB) and queues behind the lab kernels.
            queued = await gpupool_wait(
                lambda: next((lease for lease in pool.leases() if lease.holder_pid == proc.pid), None),
                timeout=60,
                what="nbconvert's request in the shared pool",
            )
            assert queued.state is LeaseState.QUEUED
            assert pool.queue_info(queued.id).position == 1
            ticks = gpupool_ext.tick_count
            await gpupool_wait(lambda: gpupool_ext.tick_count >= ticks + 3, what="three ticks while nbconvert waits")
            assert proc.poll() is None, "nbconvert finished while the pool was full"
            assert pool.get(queued.id).state is LeaseState.QUEUED

            # A lab kernel shuts down: nbconvert gets the slice, runs, and gives it back.
            started = time.monotonic()
            await gpupool_fetch("api", "kernels", lab[0], method="DELETE")
            while proc.poll() is None:
                assert time.monotonic() - started < 90, "nbconvert did not finish after a slice freed up"
                await asyncio.sleep(0.2)
            output = proc.stdout.read().decode() if proc.stdout else ""
            assert proc.returncode == 0, output
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        done = nbformat.read(tmp_path / "done.ipynb", as_version=4)
        seen = json.loads(done.cells[0].outputs[0]["text"])
        assert seen["GPUPOOL_LEASE_ID"] == queued.id
        assert seen["GPUPOOL_MEMORY_LIMIT"] == str(8 * 1024**3)
        final = pool.get(queued.id)
        assert final.state is LeaseState.RELEASED and final.release_reason == "kernel shut down"
        assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(final.devices)
        # The remaining lab kernel still holds its slice.
        assert pool.lease_for_kernel(lab[1]).state is LeaseState.GRANTED

    arun(scenario())
