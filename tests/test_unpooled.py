"""The GPU is the truth: memory NVML shows held outside any granted lease is unpooled use — seen,
never granted to anyone — and no report can free memory a process still holds."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pool_helpers import T0

from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.backends.local.store import MIGRATIONS, SCHEMA_VERSION, Store
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState, Transition
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.unpooled import attribute
from jupyter_gpupool.enforcement.watchdog import Watchdog
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow  # real servers, kernels and processes outside the pool

HERE = Path(__file__).resolve().parent


@pytest.fixture
def pool(tmp_path):
    backend = SimulatedBackend.from_spec("1x16GiB")
    backend.usage_dir = str(tmp_path / "usage")
    pool = Pool(backend, str(tmp_path / "pool.sqlite"), PoolPolicy(reclaim_action="suspend"), clock=lambda: T0)
    yield pool
    pool.close()


@pytest.fixture
def sleeper():
    """Start a real process (optionally with a lease in its environment); all are killed after."""
    procs: list[subprocess.Popen] = []

    def start(lease_id: str | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_LEASE_ID"}
        if lease_id:
            env["GPUPOOL_LEASE_ID"] = lease_id
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"], env=env, stdout=subprocess.PIPE
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"  # running, its environment set
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def _uuid(pool: Pool) -> str:
    return pool.devices()[0].uuid


def _use(pool: Pool, pid: int, gib: int) -> None:
    """Script ``gib`` GiB of simulated GPU memory for process ``pid``, as pretend_to_use does."""
    folder = Path(pool.backend.usage_dir)
    folder.mkdir(exist_ok=True)
    (folder / f"{pid}.json").write_text(json.dumps({_uuid(pool): gib * GIB}))


def _watch(pool: Pool, now: float = T0) -> Watchdog:
    watchdog = Watchdog(backend=pool.backend, pool=pool)
    report = watchdog.check({}, {}, now=now, leases={lease.id: lease for lease in pool.leases()}, host=HOSTNAME)
    assert not report.error
    return watchdog


def _granted(pool: Pool, owner: str, gib: int, kernel_id: str | None = None):
    lease = pool.request(LeaseRequest(owner=owner, memory=gib * GIB, kernel_id=kernel_id, holder_host=HOSTNAME, suspendable=True))
    assert lease.state is LeaseState.GRANTED
    return lease


# --- attribution -----------------------------------------------------------------------------------
def test_a_process_without_a_lease_is_unpooled_with_its_pid_and_a_leases_own_process_is_not(pool, sleeper):
    lease = _granted(pool, "alice", 4)
    rogue, kernel = sleeper(), sleeper(lease.id)
    _use(pool, rogue.pid, 3)
    _use(pool, kernel.pid, 2)
    seen = attribute(pool.backend.process_usage(), {lease.id: pool.get(lease.id)}, HOSTNAME)
    assert seen.usage == {lease.id: 2 * GIB}
    assert [(u.pid, u.bytes, u.why, u.lease_id) for u in seen.unpooled] == [(rogue.pid, 3 * GIB, "no lease", None)]
    assert seen.unpooled[0].user and seen.unpooled[0].stoppable and "time.sleep" in seen.unpooled[0].command


def test_a_kernel_whose_lease_is_suspended_or_on_another_gpu_is_unpooled(tmp_path, sleeper):
    backend = SimulatedBackend.from_spec("2x16GiB")
    backend.usage_dir = str(tmp_path / "usage")
    pool = Pool(backend, str(tmp_path / "pool.sqlite"), clock=lambda: T0)
    try:
        lease = _granted(pool, "alice", 4)
        other = next(d.uuid for d in pool.devices() if d.uuid not in lease.devices)
        kernel = sleeper(lease.id)
        backend.set_usage(kernel.pid, other, GIB)
        seen = attribute(backend.process_usage(), {lease.id: lease}, HOSTNAME)
        assert [u.why for u in seen.unpooled] == ["outside its lease's GPUs"]
        suspended = lease.copy(state=LeaseState.SUSPENDED, devices=())
        seen = attribute(backend.process_usage(), {lease.id: suspended}, HOSTNAME)
        assert [(u.why, u.lease_id) for u in seen.unpooled] == [("its lease is suspended", lease.id)]
    finally:
        pool.close()


def test_a_kernel_that_released_and_reserved_again_counts_for_its_new_lease(pool):
    """Its environment still names the lease it gave back; its kernel id finds the new one."""
    old = _granted(pool, "alice", 4, kernel_id="k1")
    pool.release(old.id)
    new = _granted(pool, "alice", 6, kernel_id="k1")
    env = {**os.environ, "GPUPOOL_LEASE_ID": old.id, "GPUPOOL_KERNEL_ID": "k1"}
    kernel = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"], env=env, stdout=subprocess.PIPE)
    try:
        assert kernel.stdout is not None and kernel.stdout.readline().strip() == b"ready"  # running, its environment set
        _use(pool, kernel.pid, 5)
        seen = attribute(pool.backend.process_usage(), {new.id: pool.get(new.id)}, HOSTNAME)
        assert seen.usage == {new.id: 5 * GIB} and seen.unpooled == []
    finally:
        kernel.kill()
        kernel.wait()


def test_a_process_the_watcher_cannot_see_is_counted_and_never_stoppable(pool):
    """The driver lists a pid this host's process table has not (another container's process)."""
    pid = 2**22 + 12345  # above any pid_max: surely no process here
    pool.backend.set_usage(pid, _uuid(pool), 3 * GIB)
    [use] = attribute(pool.backend.process_usage(), {}, HOSTNAME).unpooled
    assert (use.pid, use.bytes, use.stoppable, use.user) == (pid, 3 * GIB, False, None)
    assert "cannot see" in use.why


def test_system_processes_on_the_allowlist_are_not_unpooled_use(pool, sleeper):
    proc = sleeper()
    _use(pool, proc.pid, 1)
    name = __import__("psutil").Process(proc.pid).name()
    assert attribute(pool.backend.process_usage(), {}, HOSTNAME, system_processes=[name]).unpooled == []
    assert len(attribute(pool.backend.process_usage(), {}, HOSTNAME).unpooled) == 1


# --- the scheduler plans around it --------------------------------------------------------------
def test_memory_held_outside_the_pool_is_never_granted_and_comes_back_when_it_is_gone(pool, sleeper):
    rogue = sleeper()
    _use(pool, rogue.pid, 12)
    _watch(pool)
    waiting = pool.request(LeaseRequest(owner="bob", memory=16 * GIB))
    assert waiting.state is LeaseState.QUEUED
    assert pool.request(LeaseRequest(owner="carol", memory=4 * GIB)).state is LeaseState.GRANTED
    snapshot = pool.snapshot(viewer="bob")
    assert snapshot.devices[0]["memory_unpooled"] == 12 * GIB
    assert [(u["bytes"], u["pid"], u["why"]) for u in snapshot.unpooled] == [(12 * GIB, None, "no lease")]  # whose: hidden
    assert pool.snapshot(admin=True).unpooled[0]["pid"] == rogue.pid
    assert any(e["kind"] == "unpooled" and str(rogue.pid) in e["reason"] for e in pool.events())
    rogue.kill()
    rogue.wait()
    _watch(pool)  # the process is gone: its figure goes, and the queue moves
    pool.release(pool.leases(owner="carol")[0].id)
    assert pool.get(waiting.id).state is LeaseState.GRANTED


def test_a_dead_watchers_figures_expire(pool, sleeper):
    rogue = sleeper()
    _use(pool, rogue.pid, 12)
    _watch(pool)
    assert pool.request(LeaseRequest(owner="bob", memory=16 * GIB)).state is LeaseState.QUEUED
    _use(pool, rogue.pid, 0)  # the driver shows it freed, but nobody watches to say so
    pool.tick(now=T0 + 1)
    assert pool.leases(owner="bob")[0].state is LeaseState.QUEUED  # the sighting stands while it lasts
    pool.tick(now=T0 + pool.unpooled_ttl + 1)  # nobody watched again: the sighting lapsed
    assert pool.leases(owner="bob")[0].state is LeaseState.GRANTED


# --- reports that lie -------------------------------------------------------------------------------
def test_a_forged_suspend_done_is_taken_at_once_and_frees_nothing_the_process_holds(pool, sleeper):
    """A "suspend done" while the kernel's process holds its 12 GiB: taken at once (no wait on the
    driver), the 12 GiB stay taken, as held not granted, until the driver shows them free."""
    alice = _granted(pool, "alice", 12, kernel_id="k-alice")
    kernel = sleeper(alice.id)
    _use(pool, kernel.pid, 12)
    pool.suspend(alice.id)
    started = time.monotonic()
    assert pool.confirm_transition(alice.id, parked_bytes=0).state is LeaseState.SUSPENDED
    assert time.monotonic() - started < 1.0  # one reading of the driver, no polling
    bob = pool.request(LeaseRequest(owner="bob", memory=16 * GIB))
    assert bob.state is LeaseState.QUEUED
    rows = pool.snapshot(admin=True).unpooled
    assert [(r["pid"], r["bytes"], r["lease_id"], r["why"]) for r in rows] == [(kernel.pid, 12 * GIB, alice.id, Pool.PARKED_BUT_HELD)]
    assert pool.snapshot(viewer="bob").devices[0]["memory_unpooled"] == 12 * GIB
    pool.tick()
    assert pool.get(bob.id).state is LeaseState.QUEUED  # held until the process lets go
    _use(pool, kernel.pid, 0)  # the process let go (its checkpoint finished after all)
    pool.tick()
    assert pool.get(bob.id).state is LeaseState.GRANTED
    assert pool.snapshot(admin=True).unpooled == []


def test_a_holder_host_named_by_the_client_does_not_skip_the_drivers_reading(tmp_path, sleeper):
    """A client that says its kernel runs elsewhere still has what its process holds here kept
    taken: the GPUs are this host's, so whatever holds them runs here."""
    backend = SimulatedBackend.from_spec("1x16GiB")
    backend.usage_dir = str(tmp_path / "usage")
    pool = Pool(backend, str(tmp_path / "pool.sqlite"), PoolPolicy(reclaim_action="suspend"), clock=lambda: T0)
    try:
        alice = pool.request(LeaseRequest(owner="alice", memory=12 * GIB, kernel_id="k", holder_host="elsewhere", suspendable=True))
        kernel = sleeper(alice.id)
        _use(pool, kernel.pid, 12)
        pool.suspend(alice.id)
        assert pool.confirm_transition(alice.id, parked_bytes=0).state is LeaseState.SUSPENDED
        assert pool.request(LeaseRequest(owner="bob", memory=8 * GIB)).state is LeaseState.QUEUED
    finally:
        pool.close()


def test_a_restore_reported_failed_keeps_what_the_process_still_holds_taken(pool, sleeper):
    """A restore that failed with its memory still parked gives its GPU back at once; what its
    process holds there anyway stays taken until it lets go."""
    alice = _granted(pool, "alice", 12, kernel_id="k-alice")
    kernel = sleeper(alice.id)
    pool.suspend(alice.id)
    pool.confirm_transition(alice.id, parked_bytes=12 * GIB)
    pool.resume(alice.id)
    assert pool.get(alice.id).transition is Transition.RESTORING
    _use(pool, kernel.pid, 12)  # it got its memory back, then failed and said the memory is still parked
    assert pool.fail_transition(alice.id, "restore failed", still_running=True).state is LeaseState.SUSPENDED
    bob = pool.request(LeaseRequest(owner="bob", memory=8 * GIB))
    assert bob.state is LeaseState.QUEUED
    _use(pool, kernel.pid, 0)
    pool.tick()
    assert pool.get(bob.id).state is LeaseState.GRANTED


def test_a_suspended_kernel_that_goes_on_using_its_gpu_is_unpooled_use(pool, sleeper):
    """The suspend was real (the driver showed the memory freed), then the process took memory
    again: the watcher counts it, and it is never granted to the next user."""
    alice = _granted(pool, "alice", 12, kernel_id="k-alice")
    kernel = sleeper(alice.id)
    pool.suspend(alice.id)
    assert pool.confirm_transition(alice.id, parked_bytes=0).state is LeaseState.SUSPENDED
    _use(pool, kernel.pid, 12)
    _watch(pool)
    assert pool.request(LeaseRequest(owner="bob", memory=16 * GIB)).state is LeaseState.QUEUED
    row = pool.snapshot(admin=True).unpooled[0]
    assert (row["pid"], row["why"], row["lease_id"]) == (kernel.pid, "its lease is suspended", alice.id)


def test_parked_bytes_are_bounded_by_what_the_lease_held(pool):
    lease = _granted(pool, "alice", 1)
    pool.suspend(lease.id)
    with pytest.raises(InvalidInput, match="more than this lease's GPUs hold"):
        pool.confirm_transition(lease.id, parked_bytes=2**50)
    assert pool.get(lease.id).transition is Transition.SUSPENDING  # nothing changed
    done = pool.confirm_transition(lease.id, parked_bytes=8 * GIB)
    assert done.parked_memory == GIB  # no more than the 1 GiB slice it held


def test_a_kernel_asking_again_keeps_its_one_lease_and_drops_its_parked_memory(pool):
    first = _granted(pool, "alice", 4, kernel_id="k1")
    pool.suspend(first.id)
    pool.confirm_transition(first.id, parked_bytes=4 * GIB)
    again = pool.request(LeaseRequest(owner="alice", memory=4 * GIB, kernel_id="k1", holder_host=HOSTNAME))
    assert again.id == first.id and again.state is LeaseState.GRANTED
    assert again.parked_memory == 0 and not again.resuming and again.transition is Transition.NONE
    assert [lease.id for lease in pool.leases() if lease.kernel_id == "k1"] == [first.id]
    with pytest.raises(RequestRefused, match="another user"):
        pool.request(LeaseRequest(owner="mallory", memory=GIB, kernel_id="k1"))


def test_a_released_lease_keeps_no_transition(pool):
    lease = _granted(pool, "alice", 4)
    pool.suspend(lease.id)
    released = pool.release(lease.id)
    assert released.transition is Transition.NONE and released.parked_memory == 0


def test_a_heartbeat_never_moves_backwards(pool):
    lease = _granted(pool, "alice", 4)
    pool.heartbeat([lease.id], now=T0 + 100)
    pool.heartbeat([lease.id], now=T0 + 50)
    assert pool.get(lease.id).heartbeat_at == T0 + 100


# --- the store ----------------------------------------------------------------------------------------
def test_a_pool_file_of_the_previous_version_is_migrated_with_its_leases(tmp_path):
    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    conn.executescript(";".join(MIGRATIONS[:3]) + f"; PRAGMA user_version=3; PRAGMA application_id={0x4A475050};")
    lease = Lease(id="l-old", owner="alice", memory=GIB, state=LeaseState.GRANTED, created_at=T0, devices=("GPU-x",))
    conn.execute("INSERT INTO leases VALUES (?,?,?,?,?,?)", ("l-old", "granted", "alice", None, T0, lease.to_json_text()))
    conn.commit()
    conn.close()
    store = Store(str(path))
    try:
        assert store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION >= 4
        with store.transaction():
            assert list(store.live_leases()) == ["l-old"]
            assert store.unpooled(T0) == []
    finally:
        store.close()


# --- a real server on a simulated pool ------------------------------------------------------------
def _server_env(tmp_path: Path, **extra: str) -> dict[str, str | None]:
    """A single-user server's environment on a 1x16GiB simulated pool of its own."""
    return {
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_USER": None,
        "GPUPOOL_URL": None,
        "GPUPOOL_BROKER_FILE": str(tmp_path / "no-broker.json"),
        **extra,
    }


def test_a_process_outside_the_pool_shows_in_status_and_the_pool_view_and_a_request_for_its_memory_waits(tmp_path):
    sys.path.insert(0, str(HERE))
    from server_process import Server, wait_for

    env = _server_env(tmp_path)
    server = Server(tmp_path, "alice", env, args=("--Watchdog.interval=0.5",))
    rogue = None
    try:
        uuid = server.call("GET", "api/gpupool/pool")["devices"][0]["uuid"]
        rogue_env = {**os.environ, **{k: v for k, v in env.items() if v is not None}, "CUDA_VISIBLE_DEVICES": uuid}
        rogue = subprocess.Popen(
            [sys.executable, "-c", ("from jupyter_gpupool.devices.simulated import pretend_to_use; import time; "
                                    "pretend_to_use('3GiB'); time.sleep(120)")],
            env=rogue_env,
        )
        view = wait_for(lambda: (v := server.call("GET", "api/gpupool/pool"))["unpooled"] and v, timeout=30,
                        what="the unpooled use in GET /api/gpupool/pool")
        assert [(u["pid"], u["bytes"]) for u in view["unpooled"]] == [(rogue.pid, 3 * GIB)]  # her own process: she sees it
        assert view["devices"][0]["memory_unpooled"] == 3 * GIB
        cli_env = {**{k: v for k, v in rogue_env.items() if k != "CUDA_VISIBLE_DEVICES"}}
        status = subprocess.run([sys.executable, "-m", "jupyter_gpupool.apps.cli", "status", "--json"], check=False, env=cli_env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert [u["pid"] for u in json.loads(status.stdout)["unpooled"]] == [rogue.pid]
        text = subprocess.run([sys.executable, "-m", "jupyter_gpupool.apps.cli", "status"], check=True, env=cli_env,
                              capture_output=True, text=True, timeout=60).stdout
        assert "Outside the pool" in text and str(rogue.pid) in text
        pool = Pool.from_env(environ={k: v for k, v in env.items() if v is not None})
        try:
            assert pool.request(LeaseRequest(owner="bob", memory=14 * GIB)).state is LeaseState.QUEUED
            assert pool.request(LeaseRequest(owner="carol", memory=12 * GIB)).state is LeaseState.GRANTED
        finally:
            pool.close()
        assert "outside the pool" in (tmp_path / "alice" / "server.log").read_text()
    finally:
        if rogue is not None:
            rogue.kill()
            rogue.wait()
        server.stop()


def test_a_server_opted_out_by_its_environment_says_so_and_its_kernels_gpu_use_is_unpooled(tmp_path):
    """``JUPYTER_DEFAULT_PROVISIONER_NAME=local-provisioner``: the server logs that its kernels do
    not ask the pool, and a kernel that uses a GPU shows up as unpooled use with its pid."""
    sys.path.insert(0, str(HERE))
    from jupyter_client import BlockingKernelClient
    from server_process import Server, wait_for

    env = _server_env(tmp_path, JUPYTER_DEFAULT_PROVISIONER_NAME="local-provisioner")
    server = Server(tmp_path, "alice", env, args=("--Watchdog.interval=0.5",))
    client = None
    try:
        log = (tmp_path / "alice" / "server.log").read_text()
        assert "do not ask the GPU pool ($JUPYTER_DEFAULT_PROVISIONER_NAME=local-provisioner)" in log
        uuid = server.call("GET", "api/gpupool/pool")["devices"][0]["uuid"]
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        connection = tmp_path / "alice" / "runtime" / f"kernel-{kernel_id}.json"
        # The file is created first and written a moment later: wait until it is whole.
        wait_for(lambda: connection.exists() and connection.stat().st_size > 0, timeout=60,
                 what="the kernel's connection file")
        client = BlockingKernelClient(connection_file=str(connection))
        client.load_connection_file()
        client.start_channels(hb=False)  # no manager here: the heartbeat check is the server's
        # A cell sent before the kernel's IOPub has our subscription loses its output (and its
        # idle status): execute_interactive then waits out its timeout on a busy machine. The
        # kernel_info round trip with an IOPub message back proves both channels are connected.
        client.wait_for_ready(timeout=60)
        reply = client.execute_interactive(
            f"import os; assert 'GPUPOOL_LEASE_ID' not in os.environ; os.environ['CUDA_VISIBLE_DEVICES'] = {uuid!r}\n"
            "from jupyter_gpupool.devices.simulated import pretend_to_use; pretend_to_use('2GiB'); print(os.getpid())",
            timeout=60,
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        view = wait_for(lambda: (v := server.call("GET", "api/gpupool/pool"))["unpooled"] and v, timeout=30,
                        what="the opted-out kernel's GPU use as unpooled use")
        assert [(u["bytes"], u["why"]) for u in view["unpooled"]] == [(2 * GIB, "no lease")]
    finally:
        if client is not None:
            client.stop_channels()
        server.stop()


def test_an_empty_sighting_clears_the_reporters_rows_whichever_pool_object_wrote_them(tmp_path):
    """A watcher that reopened its pool (a new Pool on the same file, same reporter) and now sees
    nothing gives the memory back at once, not when the old sighting expires."""
    from jupyter_gpupool.enforcement.unpooled import UnpooledUse

    backend = SimulatedBackend.from_spec("1x16GiB")
    first = Pool(backend, str(tmp_path / "pool.sqlite"), clock=lambda: T0)
    uuid = first.devices()[0].uuid
    first.report_unpooled([UnpooledUse(device=uuid, pid=4242, bytes=12 * GIB, host="h", why="no lease")],
                          reporter="watcher", ttl=3600, now=T0)
    first.close()
    reopened = Pool(backend, str(tmp_path / "pool.sqlite"), clock=lambda: T0)
    try:
        assert reopened.unpooled(now=T0)
        reopened.report_unpooled([], reporter="watcher", now=T0 + 1)
        assert reopened.unpooled(now=T0 + 1) == []
        assert _granted(reopened, "alice", 15).state is LeaseState.GRANTED
    finally:
        reopened.close()
