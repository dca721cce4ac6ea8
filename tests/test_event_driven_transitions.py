"""No suspend, restore or move waits for the server's tick: each starts the moment it is decided.

The server's ``tick_interval`` is set to 10 minutes, so a step that waited for a tick would take
10 minutes; each test here asserts it took seconds, and that no tick ran meanwhile. Real
jupyter_server, real ipykernel kernels, a simulated pool and checkpointer (``GPUPOOL_SIMULATE``).

- a suspend decided in the server (``POST .../suspend``) is carried out at once (in-process wake-up);
- a cell sent to the suspended kernel resumes it at once: the kernel (another process) asks, the
  server hears the pool file change and restores;
- a suspend decided by another process sharing the pool file starts at once (cross-process wake-up);
- the same through a broker, whose ``GET /api/gpupool/changes`` long poll wakes the server.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerProcess, JupyterServer, StandInHub, wait_until
from server_kernels import start_running_kernel

from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import Lease, LeaseState, Transition

TEN_MINUTES = 600.0
#: Far below the tick: a step that waited for one would miss it by minutes.
PROMPT = 8.0

#: The server's loops at ten minutes: only an event-driven step can be prompt.
SLOW_LOOPS = {"GpuPoolExtension": {"tick_interval": TEN_MINUTES, "reconcile_interval": TEN_MINUTES}, "Watchdog": {"interval": TEN_MINUTES}}

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never"),
    pytest.mark.gpupool_config(SLOW_LOOPS),
]


def test_a_cell_sent_to_a_suspended_kernel_comes_back_at_once_with_a_ten_minute_tick(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        assert (await kernel_exec(kernel, "x = 42\nprint('set')")).strip() == "set"
        ticks = gpupool_ext.tick_count

        asked = time.monotonic()
        response = await gpupool_fetch("api", "gpupool", "kernels", kernel, "suspend", method="POST", body={})
        assert response.code == 200, response.body
        await gpupool_wait(
            lambda: pool.lease_for_kernel(kernel).state is LeaseState.SUSPENDED, timeout=PROMPT, interval=0.02, what="the suspend"
        )
        suspended_after = time.monotonic() - asked

        started = time.monotonic()
        out = await asyncio.wait_for(kernel_exec(kernel, "print(x)"), PROMPT)
        answered_after = time.monotonic() - started
        assert out.strip().splitlines()[-1] == "42", out
        back = pool.lease_for_kernel(kernel)
        assert back.state is LeaseState.GRANTED and back.transition is Transition.NONE and back.suspensions == 1
        assert gpupool_ext.tick_count == ticks, "a tick ran: the test did not prove anything"
        assert gpupool_ext.change_count > 0
        assert suspended_after < PROMPT and answered_after < PROMPT, (suspended_after, answered_after)

    arun(scenario())


def test_a_suspend_decided_by_another_process_sharing_the_pool_file_starts_at_once(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, gpupool_env, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        await kernel_exec(kernel, "y = 7")
        lease = pool.lease_for_kernel(kernel)
        ticks = gpupool_ext.tick_count
        code = (
            "import sys\nfrom jupyter_gpupool.backends.local.pool import Pool\n"
            "pool = Pool.from_env()\nprint(pool.suspend(sys.argv[1], reason='suspended by the admin').transition.value)\n"
        )
        started = time.monotonic()
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", code, lease.id], capture_output=True, text=True, timeout=60, env=None
        )
        assert done.returncode == 0 and done.stdout.strip() == "suspending", done.stderr
        decided = time.monotonic()
        await gpupool_wait(
            lambda: pool.get(lease.id).state is LeaseState.SUSPENDED, timeout=PROMPT, interval=0.02, what="the suspend"
        )
        assert time.monotonic() - decided < PROMPT
        assert pool.get(lease.id).suspend_reason == "suspended by the admin"
        assert gpupool_ext.tick_count == ticks, "a tick ran: the test did not prove anything"
        # The decision's process was a new Python: most of the time is its start, not the wake-up.
        assert time.monotonic() - started < PROMPT + 30

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_SIMULATE="2x16GiB", GPUPOOL_DEFAULT_MEMORY="8GiB", GPUPOOL_IDLE_POLICY="never")
@pytest.mark.gpupool_config({**SLOW_LOOPS, "PoolPolicy": {"preemption": False, "defragment_min_idle": 1}})
def test_a_move_decided_by_another_process_starts_at_once(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    """Another process asks for a whole 16 GiB GPU while the server's idle kernel sits beside 8 GiB
    free: that process's scheduler decides to move the kernel, and the server carries it out at once."""
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.provisioner.kernel_provisioner import holder_identity
    from jupyter_gpupool.units import GIB

    pool = gpupool_ext.pool

    async def scenario() -> None:
        kernel = await start_running_kernel(gpupool_fetch, jp_serverapp, gpupool_wait)
        host, me = holder_identity()
        home = pool.lease_for_kernel(kernel).devices
        beside = pool.request(LeaseRequest(owner="dave", memory=8 * GIB, holder_pid=me, holder_host=host))
        other = pool.request(LeaseRequest(owner="dave", memory=8 * GIB, holder_pid=me, holder_host=host))
        assert beside.devices == home and other.devices != home
        pool.release(beside.id)  # 8 GiB free beside the kernel, none on the other GPU
        await asyncio.sleep(1.5)  # the kernel idles past defragment_min_idle
        ticks = gpupool_ext.tick_count
        code = (
            "import sys\nfrom jupyter_gpupool.core.models import LeaseRequest\nfrom jupyter_gpupool.core.policy import PoolPolicy\n"
            "from jupyter_gpupool.backends.local.pool import Pool\n"
            "pool = Pool.from_env(policy=PoolPolicy(preemption=False, defragment_min_idle=1, idle_policy='never'))\n"
            "print(pool.request(LeaseRequest(owner='erin', memory=16 * 2**30, holder_pid=int(sys.argv[1]), holder_host=sys.argv[2])).id)\n"
        )
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", code, str(me), host], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        decided = time.monotonic()
        big = done.stdout.strip()
        granted = await gpupool_wait(
            lambda: (lease := pool.get(big)).state is LeaseState.GRANTED and lease, timeout=PROMPT, interval=0.02,
            what="the move and then the 16 GiB grant",
        )
        assert time.monotonic() - decided < PROMPT
        moved = pool.lease_for_kernel(kernel)
        assert moved.devices != home and granted.devices == home and moved.transition is Transition.NONE
        assert "migrate" in [e["kind"] for e in pool.events() if e["lease_id"] == moved.id]
        assert gpupool_ext.tick_count == ticks, "a tick ran: the test did not prove anything"

    arun(scenario())


# --- through a broker ----------------------------------------------------------------------------------
ALICE = "alice-hub-token"


@pytest.fixture
def hub() -> Iterator[StandInHub]:
    stand_in = StandInHub().start()
    stand_in.add_user(ALICE, "alice")
    stand_in.add_user("bob-hub-token", "bob")
    yield stand_in
    stand_in.stop()


@pytest.fixture
def broker(tmp_path: Path, hub: StandInHub) -> Iterator[BrokerProcess]:
    process = BrokerProcess(tmp_path, hub, config="c.Broker.tick_interval = 600\nc.PoolPolicy.idle_policy = 'never'\n").start()
    yield process
    process.stop()


@pytest.fixture
def server(tmp_path: Path, broker: BrokerProcess) -> Iterator[JupyterServer]:
    """Alice's real Jupyter server on the broker, its own loops at ten minutes."""
    process = JupyterServer(
        tmp_path, "alice", broker.url, ALICE, config={"GpuPoolExtension": SLOW_LOOPS["GpuPoolExtension"]}
    )
    yield process
    process.stop()


def _kernel_holding(server: JupyterServer, broker: BrokerProcess, code: str) -> tuple[str, Lease]:
    """Start a kernel on ``server``, wait for its grant and its process, run ``code`` (which
    prints ``set``) in it; the kernel's id and lease."""
    kernel = server.call("POST", "api/kernels", {"name": "python3"})["id"]
    wait_until(lambda: (lease := broker.kernel_lease(kernel)) and lease.state is LeaseState.GRANTED, what="the grant")
    wait_until((server.root / "runtime" / f"kernel-{kernel}.json").exists, what="the kernel to launch")
    assert server.run_code(kernel, code).strip() == "set"
    lease = broker.kernel_lease(kernel)
    assert lease is not None
    return kernel, lease


def test_through_a_broker_suspend_and_the_next_cell_do_not_wait_for_any_tick(
    server: JupyterServer, broker: BrokerProcess
) -> None:
    kernel, lease = _kernel_holding(server, broker, "z = 5\nprint('set')")

    # Another client of the broker (an admin tool, another of alice's processes) decides the suspend.
    remote = RemotePool(broker.url, token=ALICE, timeout=15)
    decided = time.monotonic()
    remote.call("POST", f"api/gpupool/leases/{lease.id}/suspend", {"reason": "lunch"}, idempotent=False)
    wait_until(lambda: remote.get(lease.id).state is LeaseState.SUSPENDED, timeout=PROMPT, what="the suspend")
    assert time.monotonic() - decided < PROMPT

    started = time.monotonic()
    out = server.run_code(kernel, "print(z)", timeout=PROMPT)
    assert out.strip().splitlines()[-1] == "5", out
    assert time.monotonic() - started < PROMPT
    assert remote.get(lease.id).transition is Transition.NONE


def test_a_broker_killed_during_the_long_poll_is_followed_again_once_it_is_back(
    server: JupyterServer, broker: BrokerProcess
) -> None:
    """SIGKILL the broker while the server's ``/changes`` long poll is open, start it again: a
    suspend decided the moment it is back is carried out within one backoff, not at a tick."""
    kernel, lease = _kernel_holding(server, broker, "w = 7\nprint('set')")
    time.sleep(0.5)  # the server's long poll is open now
    broker.kill()
    time.sleep(1.5)  # its poll failed; it backs off and tries again
    broker.start()
    remote = RemotePool(broker.url, token=ALICE, timeout=15)
    decided = time.monotonic()
    remote.call("POST", f"api/gpupool/leases/{lease.id}/suspend", {"reason": "lunch"}, idempotent=False)
    wait_until(lambda: remote.get(lease.id).state is LeaseState.SUSPENDED, timeout=PROMPT + RemotePool.retry_max,
               what="the suspend after the broker came back")
    assert time.monotonic() - decided < PROMPT + RemotePool.retry_max
    out = server.run_code(kernel, "print(w)", timeout=PROMPT + RemotePool.retry_max)
    assert out.strip().splitlines()[-1] == "7", out  # nothing lost across the broker's death


def test_the_changes_long_poll_answers_when_the_callers_leases_change_and_needs_credentials(broker: BrokerProcess) -> None:
    """Alice's poll answers when her own lease changes, within seconds; bob's request does not
    wake her (nor tell her when bob is active)."""
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.units import GIB

    remote = RemotePool(broker.url, token=ALICE, timeout=15)
    version = remote.wait_for_change(None, 0)
    started = time.monotonic()
    assert remote.wait_for_change(version, 0.5) == version  # nothing changed: it waited, then said so
    assert time.monotonic() - started >= 0.4

    def poll_while(action: Any, timeout: float) -> dict[str, Any]:
        result: dict[str, Any] = {}

        def wait() -> None:
            begun = time.monotonic()
            result["version"] = remote.wait_for_change(version, timeout)
            result["after"] = time.monotonic() - begun

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.3)
        action()
        waiter.join(timeout + 30)
        return result

    bob = RemotePool(broker.url, token="bob-hub-token", timeout=15)
    others = poll_while(lambda: bob.request(LeaseRequest(owner="bob", memory=GIB)), 2.0)
    assert others["version"] == version and others["after"] >= 1.5, others  # bob's grant is not alice's news
    own = poll_while(lambda: remote.request(LeaseRequest(owner="alice", memory=GIB)), 20.0)
    assert own["version"] != version and own["after"] < 5, own

    stranger = RemotePool(broker.url, token="no-such-token", timeout=15)
    from jupyter_gpupool.errors import NotAuthorized

    with pytest.raises(NotAuthorized):
        stranger.wait_for_change(None, 0)
    bad = RemotePool(broker.url, token=ALICE, timeout=15)
    from jupyter_gpupool.errors import InvalidInput

    with pytest.raises(InvalidInput, match="since"):
        bad.call("GET", "api/gpupool/changes", query={"since": "soon"})
