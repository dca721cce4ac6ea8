"""The kernel side of suspend (issue 12): the waiting cell, ``%gpupool suspend|resume|status``.

Real ipykernel kernels on a simulated ``1x16GiB`` pool. No Jupyter server runs here, so the test
plays the kernel's server: :class:`PlayServer` watches the lease from its own thread and confirms
a suspend or a restore as the server does once it has checkpointed or restored the process.
"""

from __future__ import annotations

import os
import queue
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState, QueueInfo, Transition
from jupyter_gpupool.kernel.client import InProcessPoolClient
from jupyter_gpupool.kernel.resume import ResumeOnRun, needs_waiting, only_gpupool_magics, progress_text
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow  # real kernels suspended and resumed

try:
    from test_kernel_extension import Kernel, PoolEnv, Result, kernel_factory, strip_ansi
except ImportError:  # tests as a package
    from tests.test_kernel_extension import Kernel, PoolEnv, Result, kernel_factory, strip_ansi  # noqa: F401

PARKED = int(6.2 * GIB)


def make_suspendable_env(tmp_path: Path, memory: int = 8 * GIB) -> PoolEnv:
    """A simulated 16 GiB GPU with one suspendable 8 GiB lease for the kernel under test."""
    env = {
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_IDLE_TIMEOUT": "30m",
        "GPUPOOL_RECLAIM_ACTION": "suspend",
        "GPUPOOL_PARKED_MEMORY_LIMIT": "64GiB",  # not a share of this machine's RAM: the same on every host
    }
    pool = Pool.from_env(environ=env)
    kernel_id = str(uuid.uuid4())
    lease = pool.request(
        LeaseRequest(
            owner="alice",
            memory=memory,
            kernel_id=kernel_id,
            suspendable=True,
            holder_pid=os.getpid(),
            holder_host=socket.gethostname(),
            label="test kernel",
        )
    )
    assert lease.state is LeaseState.GRANTED
    return PoolEnv(pool=pool, env=env, lease_id=lease.id, kernel_id=kernel_id, tmp=tmp_path)


@pytest.fixture
def penv(tmp_path: Path) -> Iterator[PoolEnv]:
    pool_env = make_suspendable_env(tmp_path)
    yield pool_env
    pool_env.pool.close()


class PlayServer:
    """What the kernel's server does about transitions: confirm a suspend (``parked`` bytes) or a restore."""

    def __init__(self, env: dict[str, str], lease_id: str, parked: int = PARKED, restore_delay: float = 1.5) -> None:
        # restore_delay: longer than the kernel's 0.5 s poll, so its "restoring GPU memory…" line is
        # always seen (at 0.3 s a loaded machine's kernel could look only after the restore).
        self.env, self.lease_id, self.parked, self.restore_delay = env, lease_id, parked, restore_delay
        self.restored = 0
        self.suspended = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PlayServer:  # noqa: PYI034 -- a test helper, never subclassed
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        pool = Pool.from_env(environ=self.env)  # its own connection, as the server's process has
        try:
            while not self._stop.wait(0.1):
                lease = pool.get(self.lease_id)
                if lease.transition is Transition.SUSPENDING:
                    pool.confirm_transition(self.lease_id, parked_bytes=self.parked)
                    self.suspended += 1
                elif lease.transition is Transition.RESTORING:
                    time.sleep(self.restore_delay)  # copying host RAM back to the GPU takes a moment
                    pool.confirm_transition(self.lease_id)
                    self.restored += 1
        finally:
            pool.close()


def suspend_now(penv: PoolEnv) -> None:
    """Suspend the kernel's lease through the pool, as an idle reclaim and its server would."""
    penv.pool.suspend(penv.lease_id, reason="reclaimed after 30 min idle")
    penv.pool.confirm_transition(penv.lease_id, parked_bytes=PARKED)
    assert penv.pool.get(penv.lease_id).state is LeaseState.SUSPENDED


def fill_the_gpu(penv: PoolEnv) -> Lease:
    other = penv.pool.request(
        LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), holder_host=socket.gethostname())
    )
    assert other.state is LeaseState.GRANTED
    return other


def wait_for_display(kernel: Kernel, msg_id: str, needle: str, timeout: float = 60) -> list[dict[str, Any]]:
    """IOPub messages of ``msg_id`` up to the first display whose text contains ``needle``."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"no display with {needle!r}; got {seen}"
        msg = kernel.kc.get_iopub_msg(timeout=left)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        seen.append(msg)
        if msg["msg_type"] in ("display_data", "update_display_data") and needle in msg["content"]["data"]["text/plain"]:
            return seen


def assert_still_running(kernel: Kernel, seconds: float) -> None:
    """No execute_reply arrives for ``seconds``: the cell is still waiting."""
    with pytest.raises(queue.Empty):
        kernel.kc.get_shell_msg(timeout=seconds)


def collect_after(kernel: Kernel, msg_id: str, earlier: list[dict[str, Any]], timeout: float = 60) -> Result:
    result = kernel.collect(msg_id, timeout=timeout)
    return Result(reply=result.reply, messages=earlier + result.messages)


# --- the waiting cell, in a real kernel ---------------------------------------------------------------


def test_a_cell_in_a_suspended_kernel_waits_for_a_gpu_then_runs(penv: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(penv.kernel_env())
    kernel.run("x = 42")
    suspend_now(penv)
    other = fill_the_gpu(penv)

    with PlayServer(penv.env, penv.lease_id) as server:
        msg_id = kernel.submit("print(x)")
        earlier = wait_for_display(kernel, msg_id, "position 1 of 1")
        lease = penv.pool.get(penv.lease_id)
        assert lease.state is LeaseState.QUEUED and lease.resuming  # the cell asked the pool to resume
        assert_still_running(kernel, 1.5)  # the GPU is full: the cell waits
        penv.pool.release(other.id)
        result = collect_after(kernel, msg_id, earlier)
        assert server.restored == 1

    assert result.status == "ok", result.all_text()
    assert result.stdout == "42\n"
    lines = [m["content"]["data"]["text/plain"] for m in result.messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert lines[0].startswith("gpupool: resuming — waiting for a GPU")
    assert any(line.startswith("gpupool: resuming — waiting for a GPU, position 1 of 1") for line in lines), lines
    assert "gpupool: restoring GPU memory…" in lines
    assert lines[-1].startswith("gpupool: resumed on GPU 0 after "), lines
    # One display, updated in place: every later line replaces the first.
    kinds = [m["msg_type"] for m in result.messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert kinds[0] == "display_data" and set(kinds[1:]) == {"update_display_data"}
    lease = penv.pool.get(penv.lease_id)
    assert lease.state is LeaseState.GRANTED and lease.transition is Transition.NONE and lease.parked_memory == 0

    # Running again: no waiting, no progress line.
    again = kernel.run("print(x + 1)")
    assert again.stdout == "43\n" and again.plain() == ""


def test_interrupt_while_waiting_stops_the_cell_in_one_line_and_keeps_the_place(penv: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(penv.kernel_env())
    kernel.run("x = 42")
    suspend_now(penv)
    other = fill_the_gpu(penv)

    msg_id = kernel.submit("x = 'the cell ran'")
    earlier = wait_for_display(kernel, msg_id, "position 1 of 1")
    kernel.km.interrupt_kernel()
    result = collect_after(kernel, msg_id, earlier)
    assert result.status == "error"
    lines = [strip_ansi(line) for error in result.errors for line in error["traceback"]]
    assert lines == [
        (
            "gpupool: stopped waiting for a GPU; this kernel stays queued to resume, and your next cell waits again"
            " (%gpupool status shows its place)"
        )
    ]
    assert result.stream("stderr") == ""
    lease = penv.pool.get(penv.lease_id)
    assert lease.state is LeaseState.QUEUED and lease.resuming

    status = kernel.run("%gpupool status").plain()  # a magic-only cell does not wait
    assert "resuming — waiting for a GPU, position 1 of 1" in status, status
    assert re.search(r"^\s*state\s+resuming$", status, re.MULTILINE), status

    with PlayServer(penv.env, penv.lease_id):
        penv.pool.release(other.id)
        after = kernel.run("x", timeout=60)
    assert after.value() == 42  # the interrupted cell never ran


def test_suspend_status_and_resume_magics(penv: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(penv.kernel_env())
    with PlayServer(penv.env, penv.lease_id) as server:
        suspended = kernel.run("%gpupool suspend")
        assert "GPU memory will be parked in host RAM; your next cell resumes it" in suspended.plain()
        deadline = time.monotonic() + 30
        while penv.pool.get(penv.lease_id).state is not LeaseState.SUSPENDED:
            assert time.monotonic() < deadline, "the played server never confirmed the suspend"
            time.sleep(0.1)
        lease = penv.pool.get(penv.lease_id)
        assert lease.suspend_reason == "suspended by its user with %gpupool suspend"

        status = kernel.run("%gpupool status").plain()
        assert "8 GiB suspended (6.2 GiB parked in host RAM) — resumes on your next cell" in status, status
        assert "suspended by its user with %gpupool suspend" in status
        assert penv.pool.get(penv.lease_id).state is LeaseState.SUSPENDED  # looking does not resume it

        resumed = kernel.run("%gpupool resume")
        assert server.restored == 1
        lines = resumed.data("text/plain")
        assert "gpupool: restoring GPU memory…" in lines
        assert lines[-1].startswith("gpupool: resumed on GPU 0 (") and " after " in lines[-1], lines
        assert penv.pool.get(penv.lease_id).state is LeaseState.GRANTED

        nothing = kernel.run("%gpupool resume").plain()
        assert "not suspended; nothing to resume" in nothing

    help_text = kernel.run("%gpupool help").stdout
    assert "%gpupool suspend" in help_text and "%gpupool resume" in help_text


def test_suspend_refused_is_one_line_with_the_pools_reason(tmp_path: Path, kernel_factory: Any) -> None:
    try:
        from test_kernel_extension import make_pool_env
    except ImportError:
        from tests.test_kernel_extension import make_pool_env
    penv = make_pool_env(tmp_path)  # a lease whose server cannot checkpoint (suspendable=False)
    kernel = kernel_factory(penv.kernel_env())
    result = kernel.run("%gpupool suspend", allow_error=True)
    lines = [strip_ansi(line) for error in result.errors for line in error["traceback"]]
    assert lines == ["gpupool: cannot suspend this kernel: its server cannot park GPU memory (no checkpoint support there)"]
    assert penv.pool.get(penv.lease_id).transition is Transition.NONE
    penv.pool.close()


def test_a_restore_that_fails_stops_the_cell_with_the_reason(penv: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(penv.kernel_env())
    suspend_now(penv)
    msg_id = kernel.submit("print('ran')")
    earlier = wait_for_display(kernel, msg_id, "restoring GPU memory")
    penv.pool.fail_transition(penv.lease_id, "the driver refused the restore", still_running=False)
    result = collect_after(kernel, msg_id, earlier)
    assert result.status == "error" and result.stdout == ""
    lines = [strip_ansi(line) for error in result.errors for line in error["traceback"]]
    assert len(lines) == 1 and lines[0].startswith("gpupool: cannot resume this kernel: "), lines
    assert "restoring its GPU memory failed (the driver refused the restore)" in lines[0]


# --- the hook in this process: cost, and what waits --------------------------------------------------


def test_the_check_on_a_running_kernel_costs_under_5_ms(penv: PoolEnv) -> None:
    client = InProcessPoolClient(env={**penv.env, "GPUPOOL_LEASE_ID": penv.lease_id}, pool_factory=lambda: Pool.from_env(environ=penv.env))
    hook = ResumeOnRun(lambda: client, display=lambda *a, **k: pytest.fail("a running kernel shows nothing"))

    class Info:
        raw_cell = "y = 1"

    hook.pre_run_cell(Info())  # opens the pool once
    costs = []
    for _ in range(30):
        started = time.perf_counter()
        hook.pre_run_cell(Info())
        costs.append(time.perf_counter() - started)
    costs.sort()
    assert costs[len(costs) // 2] < 0.005, costs
    assert hook.rejection is None and hook.errors == 0
    client.close()


def test_a_pool_that_cannot_be_read_lets_the_cell_run() -> None:
    class Broken(InProcessPoolClient):
        def current(self) -> Lease | None:
            raise OSError("database is locked")

    hook = ResumeOnRun(lambda: Broken(env={"GPUPOOL_LEASE_ID": "L1"}))

    class Info:
        raw_cell = "y = 1"

    hook.pre_run_cell(Info())
    assert hook.rejection is None and hook.errors == 1


def test_which_leases_make_a_cell_wait() -> None:
    base = Lease(id="L1", owner="alice", memory=8 * GIB, state=LeaseState.GRANTED, created_at=0.0)
    assert not needs_waiting(None)
    assert not needs_waiting(base)
    assert needs_waiting(base.copy(state=LeaseState.SUSPENDED))
    assert needs_waiting(base.copy(state=LeaseState.QUEUED, resuming=True))
    assert not needs_waiting(base.copy(state=LeaseState.QUEUED))  # a plain request: %gpupool wait's job
    for step in (Transition.SUSPENDING, Transition.RESTORING, Transition.MIGRATING):
        assert needs_waiting(base.copy(transition=step))
    assert not needs_waiting(base.copy(state=LeaseState.RELEASED))


def test_magic_only_cells_never_wait() -> None:
    assert only_gpupool_magics("%gpupool status")
    assert only_gpupool_magics("# look\n%gpupool status\n\n%gpupool queue\n")
    assert not only_gpupool_magics("%gpupool status\nprint(x)")
    assert not only_gpupool_magics("%gpupoolx")
    assert not only_gpupool_magics("%%time\n%gpupool status")
    assert not only_gpupool_magics("")


def test_progress_lines() -> None:
    lease = Lease(id="L1", owner="alice", memory=8 * GIB, state=LeaseState.QUEUED, created_at=0.0, resuming=True)
    info = QueueInfo(position=2, length=3, estimated_wait=240.0, reason="resuming: waits for an A100 with 8 GiB free")
    assert progress_text(lease, info) == (
        "gpupool: resuming — waiting for a GPU, position 2 of 3 (est. 4 min); waits for an A100 with 8 GiB free"
    )
    assert progress_text(lease, QueueInfo(position=1, length=1, estimated_wait=None)) == "gpupool: resuming — waiting for a GPU, position 1 of 1"
    granted = lease.copy(state=LeaseState.GRANTED, resuming=False)
    assert progress_text(granted.copy(transition=Transition.RESTORING), None) == "gpupool: restoring GPU memory…"
    assert "another GPU" in progress_text(granted.copy(transition=Transition.MIGRATING), None)


# --- the broker client: the paths it calls ------------------------------------------------------------


def test_the_broker_client_posts_suspend_and_resume_to_the_lease_routes(penv: PoolEnv) -> None:
    """The broker's routes are another change; a stand-in HTTP server checks what the client sends
    and that a 409 refusal reaches the user as the pool's one line."""
    import http.server
    import json

    from jupyter_gpupool.errors import RequestRefused
    from jupyter_gpupool.kernel.client import HttpPoolClient

    seen: list[tuple[str, str, Any]] = []
    lease_json = penv.pool.get(penv.lease_id).to_json()

    class StandIn(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            seen.append(("POST", self.path, body))
            if self.path.endswith("/suspend") and sum(path.endswith("/suspend") for _, path, _ in seen) > 1:
                status, payload = 409, {"error": "RequestRefused", "message": "cannot suspend this kernel: it is suspending"}
            else:
                status, payload = 200, lease_json
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/services/gpupool"
        client = HttpPoolClient.from_env({"GPUPOOL_URL": url, "GPUPOOL_TOKEN": "t", "GPUPOOL_LEASE_ID": penv.lease_id})
        client.current = lambda: penv.pool.get(penv.lease_id)  # type: ignore[method-assign]  # GET is not under test
        assert client.resume().id == penv.lease_id
        assert client.suspend().id == penv.lease_id
        with pytest.raises(RequestRefused, match="^cannot suspend this kernel: it is suspending$"):
            client.suspend()
    finally:
        server.shutdown()
        server.server_close()
    route = f"/services/gpupool/api/gpupool/leases/{penv.lease_id}"
    assert seen[0] == ("POST", f"{route}/resume", {})
    assert seen[1] == ("POST", f"{route}/suspend", {"reason": "suspended by its user with %gpupool suspend"})


def test_a_slice_asked_for_again_from_the_kernel_can_be_suspended_as_its_first(penv: PoolEnv, kernel_factory: Any) -> None:
    """After `%gpupool release` and `%gpupool reserve 12 GB` the new lease could not be suspended
    ("its server cannot park GPU memory"), although the same server suspends the kernel's first."""
    kernel = kernel_factory(penv.kernel_env())
    assert "released" in kernel.run("%gpupool release").plain()
    kernel.run("%gpupool reserve 12 GB")
    lease = penv.pool.lease_for_kernel(penv.kernel_id)
    assert lease is not None and lease.id != penv.lease_id and lease.memory == 12 * GIB
    assert lease.suspendable, "the new slice lost its suspendable flag"
    with PlayServer(penv.env, lease.id):
        suspended = kernel.run("%gpupool suspend")
        assert "GPU memory will be parked in host RAM" in suspended.plain(), suspended.plain()
        deadline = time.monotonic() + 30
        while penv.pool.get(lease.id).state is not LeaseState.SUSPENDED:
            assert time.monotonic() < deadline, "the played server never confirmed the suspend"
            time.sleep(0.1)


def test_a_first_slice_asked_for_from_the_kernel_is_suspendable_as_its_server_says(tmp_path: Path) -> None:
    """A kernel that started without a slice has no earlier lease to copy: GPUPOOL_SUSPENDABLE,
    set by its server, says whether that server can park it."""
    env = {"GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite"), "GPUPOOL_RECLAIM_ACTION": "suspend"}
    for said, expected in (("1", True), ("0", False), ("", False)):
        kernel_env = {**env, "GPUPOOL_KERNEL_ID": f"k-{said or 'none'}", "GPUPOOL_SUSPENDABLE": said}
        client = InProcessPoolClient(env=kernel_env, pool_factory=lambda: Pool.from_env(environ=env))
        try:
            lease = client.reserve("2GiB")
            assert lease.suspendable is expected, (said, lease)
            client.release()
        finally:
            client.close()
