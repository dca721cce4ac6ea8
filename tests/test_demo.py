"""`jupyter gpupool demo`: the command prepares a real demo, and its notebook runs end to end
(grant, queue, idle reclaim) through nbclient with the provisioner, as on Binder."""

from __future__ import annotations

import os
import subprocess
import sys

import nbformat
import pytest

from jupyter_gpupool.demo import DEMO_NOTEBOOK, demo_notebook


def test_dry_run_writes_the_notebook_and_prints_the_lab_command(tmp_path):
    env = {**os.environ, "GPUPOOL_SIMULATE": ""}
    result = subprocess.run(
        ["jupyter", "gpupool", "demo", "--dry-run", "--no-browser", f"--dir={tmp_path}", "--gpus=1x16GiB", "--port=8899"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "lab" in result.stdout and "--ServerApp.port=8899" in result.stdout and "--no-browser" in result.stdout
    assert "simulated pool 1x16GiB" in result.stderr
    nbformat.validate(nbformat.read(tmp_path / DEMO_NOTEBOOK, as_version=4))


@pytest.mark.parametrize("args, message", [(["--gpus=2xFOO"], "unknown GPU"), (["--default-memory=8XB"], "8GiB"),
                                           (["--idle-timeout=-1m"], "duration like")])
def test_bad_demo_options_are_one_line_errors(tmp_path, args, message):
    result = subprocess.run(["jupyter", "gpupool", "demo", "--dry-run", f"--dir={tmp_path}", *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_demo_notebook_shows_grant_queue_and_reclaim(tmp_path):
    """Run in its own process (as `jupyter nbconvert --execute`), so this test process's
    provisioner factory stays untouched."""
    env = {
        **os.environ,
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_DEFAULT_MEMORY": "4GiB",
        # The demo waits a minute for idleness; these make it seconds.
        "GPUPOOL_IDLE_TIMEOUT": "3s",
        "GPUPOOL_WARNING_PERIOD": "2s",
        "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner",
    }
    source = tmp_path / DEMO_NOTEBOOK
    nbformat.write(demo_notebook(), source)
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(source),
         "--output", "executed.ipynb", "--ExecutePreprocessor.timeout=180"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    notebook = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    text = "\n".join(
        output.get("text", "") or str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
    )
    assert "granted" in text  # the kernel's own slice
    assert "3 classmates hold 12 GiB" in text  # 16 GiB pool, the kernel holds 4
    assert "queued" in text
    assert "reclaimed: idle for" in text and "late-student is now granted" in text
    # The demo kernel reported its own activity, so the reclaimed slice was a classmate's, not its own.
    assert "classmate-" in text.split("reclaimed: idle for")[0].rsplit("\n", 1)[-1]
