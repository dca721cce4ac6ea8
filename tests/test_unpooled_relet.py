"""A kernel that leased for itself, released and reserved again, keeps its GPU memory pooled.

A kernel started without the pool's provisioner (nbconvert, papermill: the stock kernelspec)
leases through the broker by itself and starts again with that first lease in its environment
(no ``GPUPOOL_KERNEL_ID``). After ``%gpupool release`` and ``%gpupool reserve`` its start
environment still names only the released lease: the broker's watchdog must attribute its memory
to the new lease by the same claim rule device control uses (the earlier lease of the same owner
and kernel), never list it as unpooled use, never stop it; another user's process naming either
lease stays unpooled. A real broker (its watchdog stops unpooled use after a 1 s grace), a real
IPython kernel that leases for itself, real Unix users; only the GPU is simulated.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager
from test_ownership import (  # noqa: F401 - processes and unix_users are fixtures
    ALICE,
    BOB,
    TOKENS,
    environ_names,
    gpu_use,
    lease_process,
    processes,
    start_broker,
    unix_users,
    unpooled_pids,
    wait_for,
)

from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as other Unix users (root only)")

REPO = Path(__file__).resolve().parent.parent
GRACE = 1.0  # the broker's watchdog stops unpooled use after this long (its interval: 0.1 s)


@pytest.fixture
def self_leasing_kernel(tmp_path: Path) -> Iterator[Callable[..., tuple[KernelManager, BlockingKernelClient]]]:
    """``start(env, connection_file="")``: a stock IPython kernel that reads the kernel config the
    wheel installs (so it leases for itself), with ``env`` over this process's environment; shut
    down after the test. nbclient's connection file is a temporary name (the lease names no
    kernel); jupyter_server's is ``kernel-<its id>.json``."""
    started: list[tuple[KernelManager, BlockingKernelClient]] = []
    profile = tmp_path / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    shutil.copy(REPO / "jupyter-config" / "kernel-config" / "ipython_kernel_config.py", profile)

    def start(env: dict[str, str], connection_file: str = "") -> tuple[KernelManager, BlockingKernelClient]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "JUPYTERHUB_"))}
        km = KernelManager(kernel_name="python3", connection_file=connection_file)
        km.start_kernel(env={**base, "IPYTHONDIR": str(tmp_path / "ipython"), **env})
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=120)
        started.append((km, client))
        return km, client

    yield start
    for km, client in started:
        client.stop_channels()
        km.shutdown_kernel(now=True)


def run(client: BlockingKernelClient, code: str) -> str:
    out: list[str] = []
    reply = client.execute_interactive(
        code, timeout=60, output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None
    )
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(out)


@pytest.mark.parametrize("started_by", ["nbclient", "server"])
def test_a_self_leased_kernel_that_reserves_again_counts_for_its_new_lease_and_is_never_stopped(
    started_by: str, tmp_path: Path, unix_users: dict[str, int], processes: Callable[..., subprocess.Popen[bytes]],  # noqa: F811 - fixtures
    self_leasing_kernel: Callable[..., tuple[KernelManager, BlockingKernelClient]],
) -> None:
    h = start_broker(tmp_path, watchdog={"interval": 0.1, "grace": GRACE, "unpooled_action": "stop", "tolerance_bytes": 0})
    try:
        kernel_id = str(uuid.uuid4()) if started_by == "server" else None
        connection_file = str(tmp_path / f"kernel-{kernel_id}.json") if kernel_id else ""
        env = {"GPUPOOL_URL": h.url, "GPUPOOL_TOKEN": TOKENS[ALICE], "GPUPOOL_SIMULATE": "1x16GiB"}
        km, client = self_leasing_kernel(env, connection_file)
        pid = int(km.provisioner.process.pid)  # type: ignore[union-attr]

        def leases_of_alice() -> list[Lease]:
            return [lease for lease in h.on_broker(h.pool.leases) if lease.owner == ALICE]

        (first,) = wait_for(leases_of_alice, what="the kernel's own lease")
        assert (first.holder_pid, first.kernel_id, first.state) == (pid, kernel_id, LeaseState.GRANTED)
        assert wait_for(lambda: environ_names(pid, first.id), what="the kernel started again with its lease")
        assert "GPUPOOL_KERNEL_ID" not in psutil.Process(pid).environ()

        run(client, "%gpupool release\n%gpupool reserve 2GiB")  # release frees the frameworks' memory first
        (again,) = leases_of_alice()
        assert again.id != first.id and again.state is LeaseState.GRANTED
        assert (again.kernel_id, again.holder_pid) == (first.kernel_id, pid)
        assert h.on_broker(h.pool.get, first.id).state is LeaseState.RELEASED

        gpu_use(h, pid, 1)  # the kernel uses 1 GiB of its new 2 GiB slice
        wait_for(lambda: h.on_broker(h.pool.get, again.id).used_memory == GIB, timeout=10, what="its use charged to its new lease")
        # Bob copies each of its lease variables: his processes are nobody's.
        copies = {lease_process(processes, lease_id, BOB).pid for lease_id in (first.id, again.id)}
        for copy in copies:
            gpu_use(h, copy, 1)
        seen = wait_for(lambda: (u := unpooled_pids(h)) and copies <= u.keys() and u, timeout=10, what="bob's copies seen unpooled")
        assert {seen[copy] for copy in copies} == {(BOB, "no lease")}
        # Past the grace, every look: the kernel is never unpooled use, never stopped.
        until = time.monotonic() + GRACE + 0.5
        while time.monotonic() < until:
            assert pid not in unpooled_pids(h)
            time.sleep(0.1)
        assert psutil.Process(pid).is_running() and run(client, "print('alive')").strip() == "alive"
        assert h.on_broker(h.pool.get, again.id).used_memory == GIB
        assert not [e for e in h.on_broker(h.pool.events) if e.get("kind") == "signal" and f"process {pid} " in e.get("reason", "")]
    finally:
        h.stop()
        shutil.rmtree(os.path.dirname(h.socket_path), ignore_errors=True)
