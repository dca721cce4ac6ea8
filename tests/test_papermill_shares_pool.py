"""papermill (and so nbclient) runs get their slice from the same pool file and give it back."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.devices.simulated import SimulatedBackend

pytestmark = pytest.mark.slow


def test_papermill_run_leases_and_releases(tmp_path):
    db = tmp_path / "pool.sqlite"
    notebook = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    notebook.cells = [
        nbformat.v4.new_code_cell("size = 'unset'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import os\nprint(os.environ['GPUPOOL_LEASE_ID'], os.environ['GPUPOOL_MEMORY_LIMIT'], size)"),
    ]
    nbformat.write(notebook, tmp_path / "in.ipynb")
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(db), "GPUPOOL_DEFAULT_MEMORY": "6GiB",
           "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner"}
    result = subprocess.run([sys.executable, "-m", "papermill", "in.ipynb", "out.ipynb", "-p", "size", "six"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in out.cells for o in c.get("outputs", []))
    lease_id, limit, size = printed.split()
    assert (limit, size) == (str(6 * 1024**3), "six")
    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), str(db))
    lease = pool.get(lease_id)
    assert lease.state is LeaseState.RELEASED and lease.granted_at is not None  # given back at the end
    assert pool.report(by="user")[0]["leases"] == 1  # and metered
