"""`jupyter gpupool kernelspec install` writes kernelspecs a teacher can offer in the launcher."""

from __future__ import annotations

import json
import os
import subprocess

from jupyter_client.kernelspec import KernelSpecManager


def install(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")}
    return subprocess.run(["jupyter", "gpupool", "kernelspec", "install", "--prefix", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, timeout=60)


def test_install_small_and_large_gpu_kernels(tmp_path):
    assert install(tmp_path, "--name", "python3-gpu-4g", "--memory", "4GiB").returncode == 0
    result = install(tmp_path, "--name", "grader-gpu", "--memory", "25%", "--priority", "batch", "--display-name", "Autograder")
    assert result.returncode == 0, result.stderr
    manager = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    small = manager.get_kernel_spec("python3-gpu-4g")
    assert small.metadata["kernel_provisioner"] == {"provisioner_name": "gpupool-provisioner", "config": {"memory": "4GiB"}}
    assert small.display_name.endswith("(GPU 4GiB)") and "ipykernel" in " ".join(small.argv)
    grader = manager.get_kernel_spec("grader-gpu")
    assert grader.metadata["kernel_provisioner"]["config"] == {"memory": "25%", "priority": "batch"}
    assert grader.display_name == "Autograder"


def test_refuses_bad_input_and_existing_names(tmp_path):
    assert install(tmp_path, "--name", "k", "--memory", "8GiB").returncode == 0
    again = install(tmp_path, "--name", "k", "--memory", "8GiB")
    assert again.returncode == 2 and "--replace" in again.stderr
    assert install(tmp_path, "--name", "k", "--memory", "4GiB", "--replace").returncode == 0
    spec = json.loads((tmp_path / "share/jupyter/kernels/k/kernel.json").read_text())
    assert spec["metadata"]["kernel_provisioner"]["config"]["memory"] == "4GiB"
    for args, expect in [
        (["--name", "bad name", "--memory", "8GiB"], "--name"),
        (["--name", "x", "--memory", "8XB"], "8GiB"),
        (["--name", "x"], "--memory"),
        (["--name", "x", "--memory", "8GiB", "--kernel", "nope"], "no kernelspec 'nope'"),
        (["--name", "x", "--memory", "8GiB", "--priority", "urgent"], "batch, normal or high"),
    ]:
        result = install(tmp_path, *args)
        assert result.returncode == 2, args
        assert expect in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "share/jupyter/kernels/x").exists()
