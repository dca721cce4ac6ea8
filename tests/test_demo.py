"""`jupyter gpupool demo`: the command prepares a real demo, and its notebook runs end to end
(grant, queue, idle reclaim) through nbclient with the provisioner, as on Binder."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import nbformat
import pytest

from jupyter_gpupool.apps.demo import DEMO_NOTEBOOK, DemoApp

pytestmark = pytest.mark.slow  # the demo's JupyterLab and its kernels


def test_dry_run_writes_the_notebook_and_prints_the_lab_command(tmp_path):
    env = {**os.environ, "GPUPOOL_SIMULATE": ""}
    result = subprocess.run(
        ["jupyter", "gpupool", "demo", "--dry-run", "--no-browser", f"--dir={tmp_path}", "--gpus=1x16GiB", "--port=8899"],
        capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "lab" in result.stdout and "--ServerApp.port=8899" in result.stdout and "--no-browser" in result.stdout
    assert "simulated pool 1x16GiB" in result.stderr
    nbformat.validate(nbformat.read(tmp_path / DEMO_NOTEBOOK, as_version=4))


@pytest.mark.parametrize("args, message", [(["--gpus=2xFOO"], "unknown GPU"), (["--default-memory=8XB"], "8GiB"),
                                           (["--idle-timeout=-1m"], "duration like")])
def test_bad_demo_options_are_one_line_errors(tmp_path, args, message):
    result = subprocess.run(["jupyter", "gpupool", "demo", "--dry-run", f"--dir={tmp_path}", *args],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("gpus, default_slice", [("1x16GiB", "4GiB"), ("2xA100-80GB", "20GiB"), ("1x6GiB", "1536MiB")])
def test_default_slice_is_a_quarter_of_the_smallest_gpu(tmp_path, gpus, default_slice):
    """`--gpus 1x16GiB` (a README example) once kept a 20 GiB default: no kernel could start."""
    _, env, _ = DemoApp(gpus=gpus, directory=str(tmp_path)).prepare()
    assert env["GPUPOOL_DEFAULT_MEMORY"] == default_slice


def test_a_default_slice_larger_than_every_gpu_is_refused(tmp_path):
    result = subprocess.run(["jupyter", "gpupool", "demo", "--dry-run", f"--dir={tmp_path}", "--gpus=1x16GiB",
                             "--default-memory=20GiB"], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 3 and "Traceback" not in result.stderr
    assert "16 GiB" in result.stderr and "4GiB" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_printed_cli_line_shows_the_demo_pool(tmp_path):
    """The demo says how to point `jupyter gpupool` at its pool; that line, pasted into a shell, works."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUPOOL_")}
    result = subprocess.run(["jupyter", "gpupool", "demo", "--dry-run", "--no-browser", f"--dir={tmp_path}", "--gpus=1x16GiB"],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    line = re.search(r"from another terminal: (.*jupyter gpupool status)$", result.stderr, re.MULTILINE)
    assert line, result.stderr
    status = subprocess.run(["bash", "-c", line.group(1)], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert status.returncode == 0, status.stderr
    assert "simulated 1x16GiB" in status.stdout and str(tmp_path / ".gpupool.sqlite") in status.stdout


@pytest.mark.slow
@pytest.mark.parametrize("gpus, classmates", [("1x16GiB", "3 classmates hold 12 GiB"), ("2xA100-80GB", "7 classmates hold 140 GiB")])
def test_demo_notebook_shows_grant_queue_and_reclaim(tmp_path, gpus, classmates):
    """The pool the demo command sets up (its default slice included) runs the notebook end to end.
    Run in its own process (as `jupyter nbconvert --execute`), so this test process's
    provisioner factory stays untouched."""
    # The demo waits a minute for idleness; these make it seconds.
    _, demo_env, _ = DemoApp(gpus=gpus, directory=str(tmp_path), idle_timeout="3s", warning_period="2s").prepare()
    env = {**demo_env, "JUPYTER_DEFAULT_PROVISIONER_NAME": "gpupool-provisioner"}
    source = tmp_path / DEMO_NOTEBOOK
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute", str(source),
         "--output", "executed.ipynb", "--ExecutePreprocessor.timeout=180"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=400, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    notebook = nbformat.read(tmp_path / "executed.ipynb", as_version=4)
    text = "\n".join(
        output.get("text", "") or str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
    )
    assert "granted" in text  # the kernel's own slice
    assert classmates in text  # the pool less the kernel's own slice, in default slices
    assert "queued" in text
    assert "reclaimed: idle for" in text and "late-student is now granted" in text
    # The demo kernel reported its own activity, so the reclaimed slice was a classmate's, not its own.
    assert "classmate-" in text.split("reclaimed: idle for")[0].rsplit("\n", 1)[-1]
