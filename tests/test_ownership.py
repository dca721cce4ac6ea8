"""A kernel belongs to the user who started it: nobody names another user's kernel id or claims
their processes, hub names map to Unix users by configuration, and the broker signals a process
only for a lease whose claim it proved, writing each signal down as an event.

Real Unix users (made here with ``useradd``; the tests run as root), real processes run as them,
and a real broker (hub identities on TCP, peer credentials on its Unix socket); only the GPU is
simulated."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from broker_harness import BrokerHarness
from pool_helpers import T0
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpupool.apps.tljh import configure_hub
from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.claims import UnixUsers, kernel_claim_refusal
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="makes Unix users and runs processes as them (root only)")

#: Unix users made for these tests; ``gpo-dave`` is a hub user with no Unix account.
ALICE, BOB, DAVE, ERIN = "gpo-alice", "gpo-bob", "gpo-dave", "gpo-erin"
PROF = "prof"  # the pool admin
TLJH_ERIN = "jupyter-gpo-erin"  # erin's Unix name under The Littlest JupyterHub's template
TOKENS = {ALICE: "tok-alice", BOB: "tok-bob", DAVE: "tok-dave", ERIN: "tok-erin", PROF: "tok-prof"}
CLEAN_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _has_account(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.fixture(scope="module")
def unix_users() -> dict[str, int]:
    """alice, bob and TLJH-named erin as real Unix users (kept: made once per host)."""
    uids = {}
    for name in (ALICE, BOB, TLJH_ERIN):
        try:
            pwd.getpwnam(name)
        except KeyError:
            # A parallel run's other worker may make the same user at the same moment: its account does as well.
            made = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                                  capture_output=True, text=True)
            assert made.returncode == 0 or _has_account(name), made.stderr
        uids[name] = pwd.getpwnam(name).pw_uid
    for name in (DAVE, ERIN):
        with pytest.raises(KeyError):
            pwd.getpwnam(name)  # hub-only under the default mapping
    return uids


@pytest.fixture
def processes() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """``start(argv, user=None, env=None)``: a real process; every one (and its children) is killed after."""
    started: list[subprocess.Popen[bytes]] = []

    def start(argv: list[str], user: str | None = None, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, user=user, env={**CLEAN_ENV, **(env or {})}, start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            except psutil.Error:
                pass
            proc.kill()
        proc.wait()


def environ_names(pid: int, lease_id: str) -> bool:
    try:
        return psutil.Process(pid).environ().get("GPUPOOL_LEASE_ID") == lease_id
    except psutil.Error:
        return False


def start_broker(tmp_path: Path, watchdog: dict[str, Any] | None = None, policy: dict[str, Any] | None = None,
                 broker: dict[str, Any] | None = None) -> BrokerHarness:
    sockets = Path(tempfile.mkdtemp(prefix="gpo-broker-", dir="/tmp"))  # other users can reach it (the test's TMPDIR is private)
    sockets.chmod(0o755)
    h = BrokerHarness(
        tmp_path,
        socket_path=str(sockets / "broker.sock"),
        simulate="1x16GiB",
        policy={"burst": "0", "heartbeat_ttl": 3600.0, **(policy or {})},
        watchdog={"interval": 0.1, **(watchdog or {})},
        broker=broker,
    ).start()
    for name, token in TOKENS.items():
        h.add_user(token, name, admin=name == PROF)
    return h


@pytest.fixture
def broker(tmp_path: Path, unix_users: dict[str, int]) -> Iterator[BrokerHarness]:
    h = start_broker(tmp_path)
    yield h
    h.stop()
    shutil.rmtree(os.path.dirname(h.socket_path), ignore_errors=True)


def post_lease(h: BrokerHarness, user: str, **body: Any) -> tuple[int, Any]:
    return h.http("POST", "api/gpupool/leases", TOKENS[user], {"memory": "1GiB", "limit": 0, **body})


def socket_post_as(h: BrokerHarness, unix_user: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """``POST /api/gpupool/leases`` on the broker's Unix socket from a process of ``unix_user``."""
    data = json.dumps(body)
    out = subprocess.run(
        ["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", h.socket_path, "-X", "POST",
         "-H", "Content-Type: application/json", "-d", data, "http://localhost/api/gpupool/leases"],
        user=unix_user, env=CLEAN_ENV, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    text, _, code = out.rpartition("\n")
    return int(code), json.loads(text)


# --- 1. a kernel id is its owner's for the kernel's life -----------------------------------------------
def test_another_users_live_suspended_or_released_kernel_id_is_refused_and_the_owners_restart_is_granted(
    broker: BrokerHarness, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    server = processes(["/bin/sleep", "120"], user=BOB)  # bob's Jupyter server: the lease's holder
    holder = {"holder_pid": server.pid, "holder_host": HOSTNAME}
    status, bobs = post_lease(broker, BOB, kernel_id="k-bob", suspendable=True, **holder)
    assert status == 201 and bobs["state"] == "granted"

    def refused(user: str) -> str:
        status, body = post_lease(broker, user, kernel_id="k-bob")
        assert status == 409, (user, status, body)
        assert "\n" not in body["message"] and "Traceback" not in body["message"]
        return str(body["message"])

    assert "another user" in refused(ALICE)  # live
    broker.on_broker(broker.pool.suspend, bobs["id"])
    broker.on_broker(broker.pool.confirm_transition, bobs["id"])
    assert broker.on_broker(broker.pool.get, bobs["id"]).state is LeaseState.SUSPENDED
    assert "another user" in refused(DAVE)  # suspended
    broker.on_broker(broker.pool.release, bobs["id"])
    assert "belongs to another user" in refused(ALICE)  # released, while its server runs
    assert "belongs to another user" in refused(DAVE)
    # ... and on the Unix socket, from a process of alice's.
    status, body = socket_post_as(broker, ALICE, {"memory": "1GiB", "kernel_id": "k-bob"})
    assert status == 409 and "belongs to another user" in body["message"]
    assert [lease.owner for lease in broker.on_broker(lambda: broker.pool.leases(kernel_id="k-bob", include_released=True))] == [BOB]
    # Bob's restart of his kernel gets its queue place (granted: the GPU is free).
    status, again = post_lease(broker, BOB, kernel_id="k-bob", **holder)
    assert status == 201 and again["state"] == "granted" and again["owner"] == BOB


def test_an_admin_clears_a_stale_claim_from_the_command_line(
    broker: BrokerHarness, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    server = processes(["/bin/sleep", "120"], user=BOB)
    status, bobs = post_lease(broker, BOB, kernel_id="k-stale", holder_pid=server.pid, holder_host=HOSTNAME)
    assert status == 201
    broker.on_broker(broker.pool.release, bobs["id"])
    assert post_lease(broker, ALICE, kernel_id="k-stale")[0] == 409
    env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB"}
    env.pop("GPUPOOL_URL", None)
    unknown = subprocess.run(["jupyter", "gpupool", "clear-claim", "k-other", "--db", broker.db],
                             capture_output=True, text=True, env=env, timeout=120, check=False)
    assert unknown.returncode == 0 and "no lease ever named it" in unknown.stdout, unknown.stderr
    cleared = subprocess.run(["jupyter", "gpupool", "clear-claim", "k-stale", "--db", broker.db],
                             capture_output=True, text=True, env=env, timeout=120, check=False)
    assert cleared.returncode == 0, cleared.stderr
    assert f"kernel k-stale is nobody's now (it was {BOB}'s)" in cleared.stdout
    [event] = [e for e in events(broker, BOB) if e["kind"] == "claim_cleared"]  # bob learns it was cleared
    assert (event["kernel_id"], event["lease_id"]) == ("k-stale", bobs["id"]) and "from the command line" in event["reason"]
    status, alices = post_lease(broker, ALICE, kernel_id="k-stale")
    assert status == 201 and alices["owner"] == ALICE
    # From now on the id is alice's: bob is the one refused.
    assert post_lease(broker, BOB, kernel_id="k-stale")[0] == 409


def test_an_admin_clears_a_stale_claim_over_http(
    broker: BrokerHarness, processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    server = processes(["/bin/sleep", "120"], user=BOB)
    status, bobs = post_lease(broker, BOB, kernel_id="k-http", holder_pid=server.pid, holder_host=HOSTNAME)
    assert status == 201

    def clear(user: str, kernel_id: str = "k-http") -> tuple[int, Any]:
        return broker.http("DELETE", f"api/gpupool/claims/{kernel_id}", TOKENS[user])

    status, body = clear(PROF)  # a live lease keeps its kernel, admin or not
    assert status == 409 and "release it first" in body["message"]
    broker.on_broker(broker.pool.release, bobs["id"])
    assert post_lease(broker, ALICE, kernel_id="k-http")[0] == 409
    status, body = clear(ALICE)  # only admins; the refusal changes nothing and names nobody
    assert status == 403 and BOB not in json.dumps(body)
    assert post_lease(broker, ALICE, kernel_id="k-http")[0] == 409
    assert clear(PROF, "k-nobody") == (200, {"kernel_id": "k-nobody", "was_owner": None})
    assert clear(PROF) == (200, {"kernel_id": "k-http", "was_owner": BOB})
    [event] = [e for e in events(broker, BOB) if e["kind"] == "claim_cleared"]
    assert event["kernel_id"] == "k-http" and f"{PROF} (admin, over HTTP)" in event["reason"]
    status, alices = post_lease(broker, ALICE, kernel_id="k-http")
    assert status == 201 and alices["owner"] == ALICE


def test_the_claims_time_bound_is_the_brokers_setting(tmp_path: Path, unix_users: dict[str, int]) -> None:
    """``c.Broker.released_claim_seconds`` 0: a released lease whose holder is gone keeps no claim."""
    h = start_broker(tmp_path, broker={"tick_interval": 0.2, "wait_poll": 0.05, "released_claim_seconds": 0.0})
    try:
        status, bobs = post_lease(h, BOB, kernel_id="k-bound")
        assert status == 201
        h.on_broker(h.pool.release, bobs["id"])
        status, alices = post_lease(h, ALICE, kernel_id="k-bound")
        assert status == 201 and alices["owner"] == ALICE
    finally:
        h.stop()
        shutil.rmtree(os.path.dirname(h.socket_path), ignore_errors=True)


def test_a_released_claim_lasts_while_its_holder_runs_or_for_a_bounded_time(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_spec("1x16GiB")
    clock = [T0]
    pool = Pool(backend, str(tmp_path / "pool.sqlite"), clock=lambda: clock[0])
    holder = subprocess.Popen(["/bin/sleep", "120"])
    try:
        lease = pool.request(LeaseRequest(owner=BOB, memory=GIB, kernel_id="k1", holder_pid=holder.pid, holder_host=HOSTNAME))
        pool.release(lease.id)
        later = T0 + 2 * 3600
        assert kernel_claim_refusal(pool, "k1", ALICE, T0 + 60, HOSTNAME)  # just released
        assert kernel_claim_refusal(pool, "k1", ALICE, later, HOSTNAME)  # its server still runs
        assert kernel_claim_refusal(pool, "k1", ALICE, later, "another-host") is None  # bounded where unseen
        assert kernel_claim_refusal(pool, "k1", BOB, later, HOSTNAME) is None  # the owner's own
        holder.kill()
        holder.wait()
        assert kernel_claim_refusal(pool, "k1", ALICE, T0 + 60, HOSTNAME)  # bounded time after its release
        assert kernel_claim_refusal(pool, "k1", ALICE, later, HOSTNAME) is None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        pool.close()


def test_the_unix_user_of_a_pool_user_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    from jupyter_gpupool.enforcement.watchdog import Watchdog

    assert Watchdog().unix_user_template == "{name}"
    monkeypatch.setenv("GPUPOOL_UNIX_USER_TEMPLATE", "jupyter-{name}")
    assert Watchdog().unix_user_template == "jupyter-{name}"
    monkeypatch.setenv("GPUPOOL_UNIX_USER_TEMPLATE", "jupyter")  # names nobody: fails closed
    assert Watchdog().unix_user_template == ""
    with pytest.raises(TraitError, match="names the pool user once"):
        Watchdog(unix_user_template="{name}-{name}")
    users = UnixUsers()
    assert users.uid("root") == 0 and users.uid("gpo-no-such-user") is None
    assert UnixUsers(template="jupyter-{name}").unix_name("erin") == "jupyter-erin"
    assert UnixUsers(template="", names={"dave": 0}).uid("dave") == 0
    assert UnixUsers(template="").uid("root") is None


# --- 2-4. whose processes, and which the broker may signal ---------------------------------------------
WATCH = {"interval": 0.1, "grace": 0.0, "action": "interrupt", "tolerance_bytes": 0, "tolerance": 0.0}


def gpu_use(h: BrokerHarness, pid: int, gib: int) -> None:
    device = h.on_broker(lambda: h.pool.devices()[0].uuid)
    h.pool.backend.set_usage(pid, device, gib * GIB)  # type: ignore[attr-defined]


def lease_process(start: Callable[..., subprocess.Popen[bytes]], lease_id: str, user: str | None) -> subprocess.Popen[bytes]:
    """A process of ``user`` whose environment names ``lease_id`` (a kernel, or a copy of its variable)."""
    proc = start(["/bin/sleep", "120"], user=user, env={"GPUPOOL_LEASE_ID": lease_id})
    wait_for(lambda: environ_names(proc.pid, lease_id), what=f"process {proc.pid} running")
    return proc


def unpooled_pids(h: BrokerHarness) -> dict[int, tuple[str | None, str]]:
    _, view = h.http("GET", "api/gpupool/pool", TOKENS["prof"])
    return {u["pid"]: (u["user"], u["why"]) for u in view.get("unpooled") or []}


def events(h: BrokerHarness, user: str = "prof") -> list[dict[str, Any]]:
    status, body = h.http("GET", "api/gpupool/events", TOKENS[user])
    assert status == 200
    return list(body)


def test_bobs_processes_never_count_for_alices_or_a_hub_only_users_lease_nor_get_their_signals(
    tmp_path: Path, unix_users: dict[str, int], processes: Callable[..., subprocess.Popen[bytes]]
) -> None:
    h = start_broker(tmp_path, watchdog={**WATCH, "unpooled_action": "warn"})
    try:
        _, alices = post_lease(h, ALICE, kernel_id="k-alice")
        _, daves = post_lease(h, DAVE, kernel_id="k-dave")  # a hub user with no Unix account
        # Bob copies their lease variables: each process holds 3 GiB, over their 1 GiB slices.
        copies = [lease_process(processes, lease["id"], BOB) for lease in (alices, daves)]
        # A process of bob's started under a root runuser that carries alice's environment.
        runuser = processes(["runuser", "-u", BOB, "--", "/bin/sleep", "120"], env={"GPUPOOL_LEASE_ID": alices["id"]})
        under_root = wait_for(lambda: psutil.Process(runuser.pid).children(), what="runuser's child")[0]
        wait_for(lambda: environ_names(under_root.pid, alices["id"]), what="bob's process under runuser")
        bobs = [*copies, under_root]
        for proc in bobs:
            gpu_use(h, proc.pid, 3)
        seen = wait_for(lambda: (u := unpooled_pids(h)) and len(u) == 3 and u, what="bob's processes seen as unpooled use")
        assert seen == {proc.pid: (BOB, "no lease") for proc in bobs}
        # Alice's own kernel counts for her lease, as before (a later step than bob's were seen in).
        mine = lease_process(processes, alices["id"], ALICE)
        gpu_use(h, mine.pid, 1)
        wait_for(lambda: h.on_broker(h.pool.get, alices["id"]).used_memory == GIB, what="alice's own use charged")
        assert not h.on_broker(h.pool.get, daves["id"]).used_memory
        assert all(proc.poll() is None for proc in (*copies, runuser)) and under_root.is_running()  # never signalled
        assert [e for e in events(h) if e["kind"] in ("over_limit", "signal")] == []
        assert [e for e in events(h, DAVE) if e["kind"] == "over_limit"] == []
    finally:
        h.stop()
        shutil.rmtree(os.path.dirname(h.socket_path), ignore_errors=True)


def test_with_the_tljh_mapping_a_users_kernel_counts_for_her_lease_and_each_signal_is_an_event(
    tmp_path: Path, unix_users: dict[str, int], processes: Callable[..., subprocess.Popen[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    c = Config()
    configure_hub(c, {})  # the TLJH plugin: the broker service's environment carries the mapping
    (service,) = [s for s in c.JupyterHub.services if s["name"] == "gpupool"]
    monkeypatch.setenv("GPUPOOL_UNIX_USER_TEMPLATE", service["environment"]["GPUPOOL_UNIX_USER_TEMPLATE"])
    h = start_broker(tmp_path, watchdog={**WATCH, "unpooled_action": "stop"})
    try:
        _, erins = post_lease(h, ERIN, kernel_id="k-erin")
        kernel = lease_process(processes, erins["id"], TLJH_ERIN)  # runs as jupyter-gpo-erin
        gpu_use(h, kernel.pid, 3)  # over her 1 GiB slice
        wait_for(lambda: kernel.poll() is not None, what="erin's kernel interrupted")
        assert kernel.returncode == -signal.SIGINT
        lease = h.on_broker(h.pool.get, erins["id"])
        assert lease.used_memory == 3 * GIB and lease.over_limit_since is not None
        sent = [e for e in events(h, ERIN) if e["kind"] == "signal"]  # erin sees what was done to her kernel
        assert [(e["lease_id"], e["kernel_id"], e["owner"]) for e in sent] == [(erins["id"], "k-erin", ERIN)]
        assert f"SIGINT to process {kernel.pid} (uid {unix_users[TLJH_ERIN]})" in sent[0]["reason"]
        assert "GPU slice" in sent[0]["reason"]
        # A process of no lease is stopped (unpooled_action "stop"), and that is an event for the admin.
        rogue = processes(["/bin/sleep", "120"], user=BOB)
        gpu_use(h, rogue.pid, 2)
        wait_for(lambda: rogue.poll() is not None, what="the rogue process stopped")
        stopped = wait_for(lambda: [e for e in events(h) if e["kind"] == "signal" and f"process {rogue.pid} " in e["reason"]],
                           what="the stop's event")
        assert f"(uid {unix_users[BOB]})" in stopped[0]["reason"] and "outside the pool (no lease)" in stopped[0]["reason"]
        assert [e for e in events(h, ERIN) if e["kind"] == "signal"] == sent  # not erin's to see
    finally:
        h.stop()
        shutil.rmtree(os.path.dirname(h.socket_path), ignore_errors=True)


def test_the_pools_own_read_of_a_leases_memory_finds_its_kernels_by_the_same_rule(
    unix_users: dict[str, int], processes: Callable[..., subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the pool reads a lease's processes holding (a suspend's or a release's check) in a root
    broker: a TLJH user's kernel by the template in the broker's environment, a hub-only user's
    kernel under her own server; a copy of her lease variable by another user is nobody's."""
    from jupyter_gpupool.core.models import Lease
    from jupyter_gpupool.devices import ProcessUsage
    from jupyter_gpupool.enforcement.unpooled import held_by_lease

    monkeypatch.setenv("GPUPOOL_UNIX_USER_TEMPLATE", "jupyter-{name}")
    erins = Lease(id="l-erin", owner=ERIN, memory=GIB, state=LeaseState.GRANTED, created_at=T0, devices=("GPU-0",))
    kernel = lease_process(processes, erins.id, TLJH_ERIN)
    server = processes(["/bin/sh", "-c", "/bin/sleep 120 & wait"], user="nobody", env={"GPUPOOL_LEASE_ID": "l-dave"})
    daves = Lease(id="l-dave", owner=DAVE, memory=GIB, state=LeaseState.GRANTED, created_at=T0, devices=("GPU-0",),
                  holder_pid=server.pid, holder_host=HOSTNAME)
    dave_kernel = wait_for(lambda: psutil.Process(server.pid).children(), what="dave's kernel")[0]
    copy = lease_process(processes, daves.id, BOB)
    rows = [ProcessUsage(pid, "GPU-0", GIB) for pid in (kernel.pid, dave_kernel.pid, copy.pid)]
    assert held_by_lease(rows, erins, ("GPU-0",)) == {kernel.pid: GIB}
    assert held_by_lease(rows, daves, ("GPU-0",)) == {dave_kernel.pid: GIB}
