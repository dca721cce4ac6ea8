"""`jupyter gpupool kernelspec install` writes kernelspecs a teacher can offer in the launcher."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from jupyter_client.kernelspec import KernelSpecManager


def install(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")}
    return subprocess.run(["jupyter", "gpupool", "kernelspec", "install", "--prefix", str(tmp_path), *args],
                          capture_output=True, text=True, env=env, timeout=60, check=False)


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


def test_a_slice_no_gpu_of_the_pool_holds_is_refused(tmp_path):
    """`--memory 999TiB` once installed a kernelspec whose kernels could never start."""
    result = install(tmp_path, "--name", "huge", "--memory", "999TiB")
    assert result.returncode == 3 and "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error) == 1 and "GPU 0 (Simulated GPU 16GiB), has 16 GiB" in error[0] and "at most 16 GiB" in error[0]
    for args, expect in [(["--memory", "8GiB", "--model", "A100"], "no GPU of model 'A100'"),
                         (["--memory", "8GiB", "--gpus", "2"], "at most 1")]:
        result = install(tmp_path, "--name", "huge", *args)
        assert result.returncode == 3 and expect in result.stderr, result.stderr
    assert not (tmp_path / "share/jupyter/kernels/huge").exists()
    assert install(tmp_path, "--name", "whole", "--memory", "16GiB").returncode == 0
    assert not (tmp_path / "p.sqlite").exists()  # checking the pool's GPUs creates no pool file


def test_a_slice_is_checked_against_the_brokers_gpus(tmp_path):
    """With GPUPOOL_URL set, the broker's GPUs count, not this host's (here: none)."""
    from broker_harness import BrokerHarness

    harness = BrokerHarness(tmp_path, simulate="2xA100-80GB").start()
    try:
        env = {key: value for key, value in os.environ.items() if not key.startswith("GPUPOOL_")}
        env["GPUPOOL_URL"] = harness.socket_url

        def run(memory: str) -> subprocess.CompletedProcess:
            argv = ["jupyter", "gpupool", "kernelspec", "install", "--prefix", str(tmp_path), "--name", "k", "--replace"]
            return subprocess.run([*argv, "--memory", memory], check=False, capture_output=True, text=True, env=env, timeout=60)

        assert run("80GiB").returncode == 0
        refused = run("200GiB")
        assert refused.returncode == 3 and "broker" in refused.stderr and "at most 160 GiB" in refused.stderr
        assert "GPU 0 (A100-80GB), has 80 GiB" in refused.stderr
        assert refused.stderr.startswith("jupyter gpupool kernelspec install: error:")
        spread = run("140GiB")  # more than one GPU holds, as the engine grants it: spanning 2 GPUs
        assert spread.returncode == 0 and "span 2 GPUs" in spread.stderr and "70 GiB each" in spread.stderr
    finally:
        harness.stop()


def test_without_a_pool_a_size_is_installed_with_a_warning(tmp_path):
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPUPOOL_")}
    env["GPUPOOL_URL"] = "http://127.0.0.1:9"  # nothing listens: no pool to check against
    result = subprocess.run(["jupyter", "gpupool", "kernelspec", "install", "--prefix", str(tmp_path), "--name", "k",
                             "--memory", "999TiB"], capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "warning: --memory 999TiB could not be checked" in result.stderr and "Traceback" not in result.stderr
    assert (tmp_path / "share/jupyter/kernels/k/kernel.json").exists()


def test_a_slice_is_checked_against_the_nvml_gpus(tmp_path, monkeypatch, capsys):
    """Without GPUPOOL_SIMULATE or GPUPOOL_URL, the host's GPUs as NVML reports them count."""
    from fake_pynvml import GIB, FakeGpu, FakeNvml

    from jupyter_gpupool.apps.kernelspec import KernelSpecInstallApp

    FakeNvml([FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GIB), FakeGpu("Tesla T4", 15 * GIB)]).install(monkeypatch)
    for name in [name for name in os.environ if name.startswith("GPUPOOL_")]:
        monkeypatch.delenv(name)
    app = KernelSpecInstallApp()
    app.initialize(["--prefix", str(tmp_path), "--name", "k", "--memory", "48GiB"])
    with pytest.raises(SystemExit) as exit_:
        app.start()
    assert exit_.value.code == 3
    assert "GPU 0 (NVIDIA A100-SXM4-40GB), has 40 GiB" in capsys.readouterr().err
    assert not (tmp_path / "share/jupyter/kernels/k").exists()


def test_a_size_split_in_two_words_or_without_a_unit_is_refused(tmp_path):
    """`--memory 8 GiB` once exited 0 and installed an 8-byte slice ("(GPU 8)"), dropping "GiB"."""
    for args, expect in [
        (["--memory", "8", "GiB"], "unexpected argument 'GiB' (a value is one word: --memory 8GiB)"),
        (["--memory=8", "GiB"], "(a value is one word: --memory 8GiB)"),
        (["--memory", "8GiB", "extra", "words"], "unexpected arguments 'extra', 'words'"),
        (["--memory", "8"], "--memory 8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB; did you mean --memory 8GiB?"),
        (["--memory", "16MiB"], "--memory 16MiB is 16 MiB, below the smallest GPU slice of 64 MiB"),
        (["--memory", "8GiB", "--limit", "8"],
         "--limit 8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB; did you mean --limit 8GiB?"),
    ]:
        result = install(tmp_path, "--name", "k", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expect in lines[0], (args, result.stderr)
    assert not (tmp_path / "share/jupyter/kernels/k").exists()
    assert install(tmp_path, "--name", "k", "--memory", "64MiB").returncode == 0
    assert install(tmp_path, "--name", "k2", "--memory", str(8 * 1024**3)).returncode == 0  # bytes, as documented
    spec = tmp_path / "share/jupyter/kernels/k/kernel.json"
    installed = spec.read_bytes()
    assert install(tmp_path, "--name", "k", "--memory", "8").returncode == 2
    assert spec.read_bytes() == installed  # a refused reinstall leaves the kernelspec as it was


@pytest.mark.parametrize("command", [["report"], ["demo", "--no-browser"], ["simulate"], ["leases"], ["queue"]])
def test_every_subcommand_refuses_stray_words(tmp_path, command):
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")}
    result = subprocess.run(["jupyter", "gpupool", *command, "stray"], capture_output=True, text=True, env=env,
                            timeout=60, check=False)
    assert result.returncode == 2, (command, result.stdout[-500:], result.stderr[-500:])
    assert "unexpected argument 'stray'" in result.stderr and "Traceback" not in result.stderr


def test_a_kernelspec_may_give_its_kernels_a_limit_to_grow_to(tmp_path):
    result = install(tmp_path, "--name", "python3-gpu-elastic", "--memory", "4GiB", "--limit", "32GiB")
    assert result.returncode == 0, result.stderr
    manager = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    spec = manager.get_kernel_spec("python3-gpu-elastic")
    assert spec.metadata["kernel_provisioner"]["config"] == {"memory": "4GiB", "limit": "32GiB"}
    assert spec.display_name.endswith("(GPU 4GiB, up to 32GiB)")
    below = install(tmp_path, "--name", "k2", "--memory", "8GiB", "--limit", "4GiB")
    assert below.returncode == 2 and "--limit 4GiB is below --memory 8GiB" in below.stderr and "Traceback" not in below.stderr
