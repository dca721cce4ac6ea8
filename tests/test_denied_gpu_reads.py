"""What a pooled user's own processes read of the GPUs where device control denies them every GPU node.

Under a root broker with device control, a user's server, its queued kernels and the commands the
user runs may not open ``/dev/nvidiaN``: NVML there still counts the GPUs but refuses each one
(``NVML_ERROR_NO_PERMISSION``). The scripted fake ``pynvml`` (``tests/fake_pynvml.py``) plays that
with ``$FAKE_PYNVML_DENIED``. A real broker process reads its GPUs from the same fake, undenied; a
real ``jupyter server`` and its kernel read through the broker, and its sidebar lists every GPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerProcess, JupyterServer, StandInHub, wait_until
from fake_pynvml import DENIED_ENV, GIB, FakeGpu, FakeNvml, FakeProcess

from jupyter_gpupool.backends.broker_devices import BrokerGpus
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.devices.checkpoint import CudaCheckpointer, checkpointer_for
from jupyter_gpupool.devices.nvml import NvmlBackend

TESTS = Path(__file__).resolve().parent
RECORD_ENV = "GPUPOOL_TEST_NVML_RECORD"

#: The host's ``pynvml`` for every process of the test: two 16 GiB GPUs, driver 580 with CUDA 12.8.
#: A process that device control denies (``$FAKE_PYNVML_DENIED``) writes a line to
#: ``$GPUPOOL_TEST_NVML_RECORD`` when it starts NVML: a read of the GPUs in the user's own process.
HOST_PYNVML = f"""
import os, sys
sys.path.insert(0, {str(TESTS)!r})
from fake_pynvml import GIB, FakeGpu, FakeNvml

class HostNvml(FakeNvml):
    def nvmlInitWithFlags(self, flags):
        record = os.environ.get({RECORD_ENV!r})
        if record and self.denied:
            with open(record, "a") as out:
                out.write(f"{{os.getpid()}} {{' '.join(sys.argv)[:300]}}\\n")
        super().nvmlInitWithFlags(flags)

    def nvmlSystemGetCudaDriverVersion_v2(self):
        self._enter("nvmlSystemGetCudaDriverVersion_v2")
        return 12080

gpus = [FakeGpu("NVIDIA A16-16GB", 16 * GIB, memory_used=GIB * i) for i in (1, 2)]
sys.modules[__name__] = HostNvml(gpus, driver_version="580.65.06").module
"""


def magic(server: JupyterServer, kernel_id: str, line: str) -> str:
    """``%gpupool LINE`` in the kernel: what it displays, as text."""
    code = (
        "from IPython.utils.capture import capture_output\n"
        "with capture_output() as shown:\n"
        f"    get_ipython().run_line_magic('gpupool', {line!r})\n"
        "print(shown.stdout, shown.stderr, *(o.data.get('text/plain', '') for o in shown.outputs))\n"
    )
    return server.run_code(kernel_id, code, timeout=60)


# --- NVML in a process that may open no GPU ----------------------------------------------------------
def test_nvml_in_a_denied_process_says_so_quietly_and_reads_no_process_memory(monkeypatch, caplog):
    """Every GPU refused (as device control refuses a user's process): listed as not open to this
    process, never as a failing GPU, with no warning; memory per process is read from none of them."""
    nvml = FakeNvml([FakeGpu("NVIDIA A16-16GB", 16 * GIB, compute=[FakeProcess(4321, GIB)]) for _ in range(2)], denied={0, 1})
    nvml.install(monkeypatch)
    backend = NvmlBackend()
    with caplog.at_level(logging.DEBUG, logger="jupyter_gpupool.devices.nvml"):
        devices = backend.devices()
        usage = backend.process_usage()
    assert len(devices) == 2 and not any(d.healthy for d in devices)
    assert all("this process may not open it" in d.health_reason and "NVML_ERROR_NO_PERMISSION" in d.health_reason for d in devices)
    assert usage == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]


def test_a_gpu_denied_to_this_process_does_not_hide_the_others(monkeypatch):
    """One GPU refused (``$FAKE_PYNVML_DENIED=1``): the other reads in full, its processes too."""
    monkeypatch.setenv(DENIED_ENV, "1")
    nvml = FakeNvml([FakeGpu("NVIDIA A16-16GB", 16 * GIB, compute=[FakeProcess(4321, GIB)]) for _ in range(2)])
    assert nvml.denied == {1}
    nvml.install(monkeypatch)
    backend = NvmlBackend()
    first, second = backend.devices()
    assert first.healthy and first.memory_total == 16 * GIB and not second.healthy
    assert [(u.pid, u.device_uuid) for u in backend.process_usage()] == [(4321, first.uuid)]


def test_kernelspec_install_without_a_broker_says_no_gpu_is_open_to_it(tmp_path, monkeypatch, capsys):
    """No broker to ask and NVML here refused every GPU: the slice cannot be checked, and the refusal
    says why per GPU (it named a model '' before)."""
    from jupyter_gpupool.apps.kernelspec import KernelSpecInstallApp

    FakeNvml([FakeGpu("NVIDIA A16-16GB", 16 * GIB) for _ in range(2)], denied={0, 1}).install(monkeypatch)
    for name in [name for name in os.environ if name.startswith("GPUPOOL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GPUPOOL_BROKER_FILE", "none")
    app = KernelSpecInstallApp()
    app.initialize(["--prefix", str(tmp_path), "--name", "k", "--memory", "8GiB"])
    with pytest.raises(SystemExit) as exit_:
        app.start()
    assert exit_.value.code == 3
    err = capsys.readouterr().err
    assert "no healthy GPU in nvml (driver 550.54.15) (GPU 0: this process may not open it" in err and "model ''" not in err, err
    assert "Traceback" not in err


# --- a user's server, kernel and commands behind a broker --------------------------------------------
@pytest.mark.slow  # a broker process, a Jupyter server and its kernel
def test_a_denied_users_server_kernel_and_commands_read_every_gpu_through_the_broker(tmp_path, monkeypatch):
    """Alice's server, her queued kernel, `jupyter gpupool status` and `kernelspec install` run
    denied every GPU: the sidebar lists both GPUs with their memory, `%gpupool status` answers, the
    server's checkpointer takes the driver's version from the broker, no traceback is logged, and
    none of her processes starts NVML."""
    shim = tmp_path / "nvml"
    shim.mkdir()
    (shim / "pynvml.py").write_text(HOST_PYNVML)
    record = tmp_path / "denied-nvml-reads.txt"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("GPUPOOL_BROKER_FILE", str(tmp_path / "gpupool-broker.json"))
    hub = StandInHub().start()
    hub.add_user("tok-alice", "alice")
    hub.add_user("tok-bob", "bob")
    broker = BrokerProcess(tmp_path, hub, simulate="", config='c.PoolPolicy.default_memory = "8GiB"\n')
    server: JupyterServer | None = None
    try:
        broker.start()  # the broker is root's: NVML there opens every GPU
        bob = RemotePool(broker.url, token="tok-bob", timeout=15)
        assert bob.info()["backend"]["name"] == "nvml", broker.log()[-2000:]
        # Bob holds what both GPUs have free (15 and 14 GiB): alice's kernel queues.
        held = [bob.request(LeaseRequest(owner="", memory=size * GIB, kernel_id=f"k-bob-{size}")) for size in (15, 14)]
        assert all(lease.state is LeaseState.GRANTED for lease in held)

        monkeypatch.setenv(DENIED_ENV, "all")  # every process of alice's from here on
        monkeypatch.setenv(RECORD_ENV, str(record))
        server = JupyterServer(tmp_path, "alice", broker.url, "tok-alice")
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"}, timeout=60)["id"]
        wait_until(lambda: (lease := broker.kernel_lease(kernel_id)) is not None and lease.state is LeaseState.QUEUED, 60, "alice's queued lease")

        pool = server.call("GET", "api/gpupool/pool")  # what the sidebar reads
        devices = sorted(pool["devices"], key=lambda d: d["index"])
        assert [(d["index"], d["memory_total"], d["healthy"]) for d in devices] == [(0, 16 * GIB, True), (1, 16 * GIB, True)], devices
        assert [(d["memory_used"], d["memory_leased"]) for d in devices] == [(GIB, 15 * GIB), (2 * GIB, 14 * GIB)], devices
        assert server.call("GET", f"api/gpupool/kernels/{kernel_id}")["state"] == "queued"

        # Bob gives GPU 0 back: alice's kernel starts; it releases its slice and asks again while bob holds it.
        bob.release(held[0].id)
        wait_until(lambda: server.call("GET", f"api/gpupool/kernels/{kernel_id}")["state"] == "granted", 60, "alice's grant")
        connection = server.root / "runtime" / f"kernel-{kernel_id}.json"
        wait_until(connection.exists, 60, "alice's kernel to start once granted")
        assert "granted" in magic(server, kernel_id, "status")
        magic(server, kernel_id, "release")
        assert bob.request(LeaseRequest(owner="", memory=15 * GIB, kernel_id="k-bob-again")).state is LeaseState.GRANTED
        assert "queued" in magic(server, kernel_id, "reserve 8GiB")
        said = magic(server, kernel_id, "status")  # a queued kernel, denied every GPU
        assert "state        queued" in said and "up to 16 GiB" in said and "Traceback" not in said, said

        env = {**os.environ, "GPUPOOL_URL": broker.url, "GPUPOOL_TOKEN": "tok-alice"}
        env.pop("GPUPOOL_DB", None)
        env.pop("GPUPOOL_SIMULATE", None)
        cli = subprocess.run([sys.executable, "-m", "jupyter_gpupool.apps.cli", "status", "--json"], env=env,
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
        assert cli.returncode == 0 and "Traceback" not in cli.stderr, cli.stderr
        assert '"healthy": false' not in cli.stdout and cli.stdout.count("NVIDIA A16-16GB") >= 2, cli.stdout

        # `kernelspec install` finds this host's broker by its discovery file and checks the slice there.
        env.pop("GPUPOOL_URL")
        installed = subprocess.run(
            ["jupyter", "gpupool", "kernelspec", "install", "--prefix", str(tmp_path / "ks"),
             "--name", "gpu8", "--memory", "8GiB"], env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert installed.returncode == 0 and "Traceback" not in installed.stderr, installed.stderr
        assert "could not be checked" not in installed.stderr, installed.stderr

        log = server.log_text()
        assert "Traceback" not in log and "unhealthy" not in log, log[-3000:]
        assert not record.exists() or not record.read_text(), f"NVML started in a denied process of alice's:\n{record.read_text()}"

        # The server's checkpointer, as the server builds it: the broker's GPUs and driver, no NVML here.
        alice = BrokerGpus(RemotePool(broker.url, token="tok-alice", timeout=15))
        checkpointer: Any = checkpointer_for(alice)
        assert isinstance(checkpointer, CudaCheckpointer)
        assert alice.driver_versions() == ("580.65.06", 12080)
        assert [d.uuid for d in alice.devices()] == [d["uuid"] for d in devices]
        support = checkpointer.probe()
        assert support.driver_version == "580.65.06", support
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        hub.stop()
