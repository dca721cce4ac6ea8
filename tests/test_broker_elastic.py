"""Elastic slices behind a broker, and what the broker trusts when burst goes to someone else.

A real broker process (``python -m jupyter_gpupool.broker``) on an NVML host played by the scripted
fake ``pynvml`` (``tests/fake_pynvml.py``, loaded in the broker through a ``pynvml`` module on its
path whose per-process memory the test rewrites). Kernels are real processes whose environment names
their lease, as the provisioner starts them: the broker's watchdog finds them in ``/proc``.

On a broker, every user's server is that user's word: only the broker's own watchdog (NVML, set
against the leases) may say a slice's kernel came down to its new size. These tests play the
attacker: a kernel that still holds memory while its user's side says otherwise, and a request
timed between two of the broker's measurements.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerProcess, StandInHub, wait_until

from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState
from jupyter_gpupool.errors import RequestRefused
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent

#: The broker's ``pynvml``: one 16 GiB GPU whose processes are read from ``$GPUPOOL_TEST_NVML``
#: (a JSON object, pid → bytes) at every query, so the test changes what the driver shows.
SCRIPTED_PYNVML = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
from fake_pynvml import FakeGpu, FakeNvml, FakeProcess

class ScriptedNvml(FakeNvml):
    def _look(self):
        try:
            with open(os.environ["GPUPOOL_TEST_NVML"]) as f:
                held = json.load(f)
        except (OSError, ValueError):
            held = {{}}
        gpu = self.gpus[0]
        gpu.compute = [FakeProcess(int(pid), int(used)) for pid, used in held.items()]
        gpu.memory_used = sum(p.used for p in gpu.compute)

    def _running(self, fn, handle, kind):
        self._look()
        return super()._running(fn, handle, kind)

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        self._look()
        return super().nvmlDeviceGetMemoryInfo(handle, version)

sys.modules[__name__] = ScriptedNvml([FakeGpu("NVIDIA A16-16GB", 16 * 1024**3)]).module
"""


#: Alice has no Unix account here: her lease claims the processes of her server, which this test process plays.
ALICES_SERVER = {"holder_pid": os.getpid(), "holder_host": socket.gethostname()}


class Host:
    """The broker, its scripted GPU, alice's kernel process and both users' clients."""

    def __init__(self, tmp_path: Path, hub: StandInHub, watchdog_interval: float) -> None:
        self.script = tmp_path / "nvml.json"
        self.script.write_text("{}")
        shim = tmp_path / "nvml"
        shim.mkdir()
        (shim / "pynvml.py").write_text(SCRIPTED_PYNVML)
        self.env = {
            "PYTHONPATH": os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "GPUPOOL_TEST_NVML": str(self.script),
        }
        config = (
            "c.Broker.run_watchdog = True\n"
            f"c.Watchdog.interval = {watchdog_interval}\n"
            "c.Watchdog.grace = 600.0\n"  # a kernel over its slice is warned, not interrupted, while the test looks
            'c.PoolPolicy.default_memory = "2GiB"\n'
            'c.PoolPolicy.burst = "16GiB"\n'
            "c.PoolPolicy.burst_settle = 600.0\n"
        )
        self.broker = BrokerProcess(tmp_path, hub, simulate="", config=config)
        hub.add_user("tok-alice", "alice")
        hub.add_user("tok-bob", "bob")
        self.kernels: list[subprocess.Popen[bytes]] = []

    def start(self, monkeypatch: pytest.MonkeyPatch) -> Host:
        for key, value in self.env.items():
            monkeypatch.setenv(key, value)
        self.broker.start()
        self.alice = RemotePool(self.broker.url, token="tok-alice", timeout=15)
        self.bob = RemotePool(self.broker.url, token="tok-bob", timeout=15)
        assert self.alice.info()["backend"]["name"] == "nvml", "the broker does not run on the scripted NVML host"
        return self

    def kernel(self, lease: Lease) -> int:
        """A process standing in for the lease's kernel (the provisioner sets the lease id in its environment)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
        env["GPUPOOL_LEASE_ID"] = lease.id
        proc = subprocess.Popen(["sleep", "3600"], env=env)
        self.kernels.append(proc)
        return proc.pid

    def holds(self, pid: int, amount: int) -> None:
        """What the driver shows the process holding from now on."""
        tmp = self.script.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(pid): amount}))
        os.replace(tmp, self.script)

    def stop(self) -> None:
        for proc in self.kernels:
            proc.kill()
            proc.wait(10)
        self.broker.stop()


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    stand_in = StandInHub().start()
    yield stand_in
    stand_in.stop()


def host(tmp_path: Path, hub: StandInHub, monkeypatch: pytest.MonkeyPatch, interval: float) -> Host:
    return Host(tmp_path, hub, interval).start(monkeypatch)


def stays_queued(pool: RemotePool, lease_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        lease = pool.get(lease_id)
        assert lease.state is LeaseState.QUEUED, f"granted while the driver shows the memory held: {lease.to_json()}"
        time.sleep(0.2)


def test_a_forged_report_never_frees_burst_the_kernel_still_holds(
    tmp_path: Path, hub: StandInHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Alice's kernel grows to 6 GiB (the broker's own NVML measurement grows its 2 GiB slice); her side
    then says it uses 1 GiB, by every route a server has. Bob's 12 GiB request on the 16 GiB GPU is
    not granted while the driver shows the 6 GiB held, and is granted within seconds once it shows them freed."""
    h = host(tmp_path, hub, monkeypatch, interval=0.3)
    try:
        lease = h.alice.request(LeaseRequest(owner="", memory=2 * GIB, kernel_id="k-alice", **ALICES_SERVER))
        assert lease.state is LeaseState.GRANTED and lease.elastic
        pid = h.kernel(lease)
        h.holds(pid, 6 * GIB)
        grown = wait_until(lambda: (l := h.alice.get(lease.id)).memory >= 6 * GIB and l, 20, "the broker to grow the slice")
        assert grown.guarantee_size == 2 * GIB and grown.used_memory == 6 * GIB

        # Every way alice's server could tell the broker "1 GiB": none is taken.
        assert h.alice.report_usage({lease.id: GIB}) == []
        for route in ("api/gpupool/usage", f"api/gpupool/leases/{lease.id}/usage"):
            status, _ = raw(h.broker, "POST", route, "tok-alice", {"usage": {lease.id: GIB}, "used": GIB})
            assert status == 404, route
        assert h.alice.grow(lease.id, GIB).memory == grown.memory  # a grow asks for more, never frees

        bob = h.bob.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-bob"))
        assert bob.state is LeaseState.QUEUED
        stays_queued(h.bob, bob.id, 3.0)
        taken = h.alice.get(lease.id)
        assert taken.burst_taken_at is not None and taken.memory < grown.memory, "the burst was not taken back"
        assert taken.used_memory == 6 * GIB, "a forged figure replaced the broker's measurement"
        with pytest.raises(RequestRefused, match=r"burst is taken back on this GPU for 1 waiting request\(s\)"):
            h.alice.grow(lease.id, 8 * GIB)  # nor can her kernel take the burst back while bob waits

        h.holds(pid, GIB)  # the kernel's caps came down and its cache was freed: the driver shows it
        freed_at = time.monotonic()
        wait_until(lambda: h.bob.get(bob.id).state is LeaseState.GRANTED, 10, "bob's grant once the memory is freed")
        assert time.monotonic() - freed_at < 10
    finally:
        h.stop()


def test_burst_taken_back_waits_for_the_brokers_own_measurement_after_the_shrink(
    tmp_path: Path, hub: StandInHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between two of the broker's measurements a kernel fills the slice it was grown to (its caps
    allow it). A request that comes then must not get that memory on the strength of the last
    measurement, taken before the kernel filled it and before its caps were lowered: the memory a
    shrunk slice gives up goes on only once the broker measured the kernel within its new size."""
    h = host(tmp_path, hub, monkeypatch, interval=4.0)
    try:
        lease = h.alice.request(LeaseRequest(owner="", memory=2 * GIB, kernel_id="k-alice", **ALICES_SERVER))
        pid = h.kernel(lease)
        h.holds(pid, 9 * GIB)
        grown = wait_until(lambda: (l := h.alice.get(lease.id)).memory >= 9 * GIB and l, 30, "the broker to grow the slice")
        h.holds(pid, GIB)  # the kernel frees most of it; its slice stays as large (it may fill it again)
        wait_until(lambda: h.alice.get(lease.id).used_memory == GIB, 30, "the broker to measure 1 GiB")
        assert h.alice.get(lease.id).memory == grown.memory

        h.holds(pid, 9 * GIB)  # just after a measurement: the next one is seconds away
        bob = h.bob.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-bob"))
        assert bob.state is LeaseState.QUEUED, "granted on a measurement taken before the kernel filled its slice"
        stays_queued(h.bob, bob.id, 6.0)  # a measurement came meanwhile: it shows the 9 GiB
        assert h.alice.get(lease.id).used_memory == 9 * GIB

        h.holds(pid, GIB)
        wait_until(lambda: h.bob.get(bob.id).state is LeaseState.GRANTED, 15, "bob's grant once the broker measured the memory freed")
    finally:
        h.stop()


def raw(broker: BrokerProcess, method: str, path: str, token: str, body: Any) -> tuple[int, Any]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", broker.port, timeout=15)
    conn.request(method, "/services/gpupool/" + path, body=json.dumps(body).encode(),
                 headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    response = conn.getresponse()
    payload = response.read()
    conn.close()
    return response.status, payload
