"""Kernel starts outside a server that must not hang or leak: in workers forked from a process
that already ran a notebook (how parallel autograders and papermill batches run), and when the
launch itself fails. Real nbclient, real ipykernel kernels, real forked processes, simulated pool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner, shared_pool

pytestmark = pytest.mark.slow

#: Run a notebook in this process, then the same notebook in two workers forked from it.
FORKED_RUN = textwrap.dedent(
    """
    import json, multiprocessing, os, sys
    from concurrent.futures import ProcessPoolExecutor

    import nbformat
    from nbclient import NotebookClient

    CODE = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', 'unset'), os.environ.get('GPUPOOL_LEASE_ID', ''))"

    def run(tag):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(CODE)])
        NotebookClient(nb, kernel_name="python3", timeout=60, startup_timeout=60).execute()
        devices, lease = nb.cells[0].outputs[0]["text"].split()
        return {"tag": tag, "pid": os.getpid(), "devices": devices, "lease": lease}

    results = [run("parent")]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as workers:
        results += list(workers.map(run, ["worker-1", "worker-2"]))
    print("RESULTS " + json.dumps(results), flush=True)
    """
)


def test_notebooks_run_in_forked_workers_after_one_in_the_parent(tmp_path: Path, gpupool_env: dict[str, str]) -> None:
    """The parent's event loop, default executor and pool do not survive a fork: the workers'
    kernels still start, each with a lease of its own from the pool, all released after."""
    script = tmp_path / "forked_run.py"
    script.write_text(FORKED_RUN)
    env = dict(os.environ, JUPYTER_DEFAULT_PROVISIONER_NAME="gpupool-provisioner", GPUPOOL_DEFAULT_MEMORY="4GiB")
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # hung workers ignore SIGTERM
        out, _ = proc.communicate()
        pytest.fail(f"the notebook runs in forked workers did not finish within 180 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    results = json.loads(next(line for line in out.splitlines() if line.startswith("RESULTS "))[len("RESULTS "):])
    assert [r["tag"] for r in results] == ["parent", "worker-1", "worker-2"]
    assert len({r["pid"] for r in results}) >= 2, results  # the workers are other processes than the parent
    pool = shared_pool()
    uuids = {d.uuid for d in pool.devices()}
    for result in results:
        assert result["devices"] in uuids and result["lease"], results  # pooled, never unset or CPU-only
        lease = pool.get(result["lease"])
        assert lease.state is LeaseState.RELEASED and lease.holder_pid == result["pid"], lease
    assert len({r["lease"] for r in results}) == 3
    assert pool.leases() == []


def test_a_failed_launch_gives_its_lease_back_at_once(tmp_path: Path, gpupool_env: dict[str, str]) -> None:
    """A kernelspec naming a program that does not exist: the start fails with the launcher's
    error, and no lease stays live (it stayed granted until the heartbeat timeout)."""
    import asyncio

    spec_dir = tmp_path / "kernels" / "missing"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [str(tmp_path / "no-such-program"), "{connection_file}"],
                "display_name": "missing program",
                "language": "python",
                "metadata": {"kernel_provisioner": {"provisioner_name": "gpupool-provisioner"}},
            }
        )
    )
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    pool = shared_pool()

    async def scenario() -> None:
        km = AsyncKernelManager(kernel_name="missing", kernel_spec_manager=ksm)
        with pytest.raises(FileNotFoundError):
            await km.start_kernel()
        prov = km.provisioner
        assert isinstance(prov, GpuPoolProvisioner)
        assert pool.leases() == []  # right after the failed start: no live lease
        assert prov.phase == "failed" and "no-such-program" in (prov.failure or ""), prov.failure
        released = pool.last_lease_for_kernel(km.kernel_id)
        assert released is not None and released.state is LeaseState.RELEASED, released
        assert "did not launch" in released.release_reason and "no-such-program" in released.release_reason

    asyncio.run(scenario())
