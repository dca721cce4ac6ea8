"""`jupyter gpupool` as an admin runs it: a root shell on a broker host, reservations, mistakes.

Every test runs the real CLI as a subprocess (and, for discovery, a real broker process on a
Unix socket); exit codes and the exact lines a person sees are what is checked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.broker.auth import ADMIN_SCOPE
from jupyter_gpupool.core.models import LeaseRequest
from tests.broker_harness import BrokerHarness
from tests.socket_broker import socket_broker

GIB = 1024**3
SELECTORS = ("GPUPOOL_URL", "GPUPOOL_DB", "GPUPOOL_SIMULATE", "GPUPOOL_TOKEN", "JUPYTERHUB_API_TOKEN")


def bare_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A shell that chose no pool: none of GPUPOOL_URL / _DB / _SIMULATE, and no NVML.

    A ``pynvml`` that fails to import stands in for a host without the driver, so the test
    means the same on a GPU machine."""
    no_nvml = tmp_path / "no-nvml"
    no_nvml.mkdir(exist_ok=True)
    (no_nvml / "pynvml.py").write_text("raise ImportError('libnvidia-ml.so.1: cannot open shared object file')\n")
    env = {k: v for k, v in os.environ.items() if k not in SELECTORS}
    env["PYTHONPATH"] = os.pathsep.join([str(no_nvml), env.get("PYTHONPATH", "")])
    env["GPUPOOL_BROKER_FILE"] = str(tmp_path / "etc" / "gpupool-broker.json")
    env.update(extra)
    return env


def cli(args: list[str], env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["jupyter", "gpupool", *args], check=False, capture_output=True, text=True, env=env, timeout=60, **kwargs
    )


def one_line(result: subprocess.CompletedProcess) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1, result.stderr
    return lines[0]


# --- 1. a root shell on a broker host finds the host's broker -------------------------------------


@pytest.fixture
def broker_process(tmp_path: Path):
    """`jupyter gpupool broker --socket` as systemd would run it, recording itself in a discovery file."""
    env = bare_env(tmp_path, GPUPOOL_SIMULATE="1x16GiB", GPUPOOL_DB=str(tmp_path / "broker.sqlite"))
    # Where every uid can reach it (pytest's tmp_path is root-only), as /run/jupyter-gpupool is.
    with socket_broker(env, tmp_path / "broker.log", open_to_all=True) as (proc, sock):
        yield proc, sock, Path(env["GPUPOOL_BROKER_FILE"])


def lease_as_nobody(sock: Path, memory: int) -> tuple[str, int]:
    """Fork a process that becomes uid ``nobody``, takes a lease over the socket and keeps it."""
    from jupyter_gpupool.backends.remote import RemotePool

    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(reader)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            lease = RemotePool(f"unix://{sock}", timeout=30).request(
                LeaseRequest(owner="", memory=memory, label="nobody's")
            )
            os.write(writer, lease.id.encode())
            os.close(writer)
            time.sleep(600)
        except BaseException as err:  # noqa: BLE001 - reported to the parent through the pipe
            os.write(writer, f"{type(err).__name__}: {err}".encode())
        finally:
            os._exit(0)
    os.close(writer)
    lease_id = os.read(reader, 200).decode()
    os.close(reader)
    assert lease_id.startswith("l-"), f"the child could not take a lease: {lease_id}"
    return lease_id, pid


def test_root_shell_status_all_finds_the_hosts_broker(tmp_path: Path, broker_process) -> None:
    _broker, sock, discovery = broker_process
    assert json.loads(discovery.read_text())["url"] == f"unix://{sock}"
    env = bare_env(tmp_path)
    # Another user's lease, taken through the broker by a process of another uid (which holds it).
    theirs_id, holder = lease_as_nobody(sock, 6 * GIB)
    try:
        result = cli(["status", "--all", "--json"], env)
        table = cli(["status", "--all"], env)
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    theirs = {"id": theirs_id}
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["db"] == f"unix://{sock}"  # the broker, not a new local file
    assert data["backend"].endswith("simulated 1x16GiB") or "1x16GiB" in data["backend"]
    owners = {lease["id"]: lease.get("owner") for lease in data["leases"]}
    assert owners.get(theirs["id"]) == "nobody"  # root is an admin on the socket: every user's lease
    assert table.returncode == 0 and theirs["id"] in table.stdout and "nobody" in table.stdout


def test_a_stopped_broker_is_named_not_replaced_by_a_local_pool(tmp_path: Path, broker_process) -> None:
    proc, sock, discovery = broker_process
    proc.kill()  # SIGKILL: no clean-up at all
    proc.wait()
    result = cli(["status", "--all"], bare_env(tmp_path))
    assert result.returncode == 6
    line = one_line(result)
    assert f"unix://{sock}" in line and str(discovery) in line and "not answering" in line
    assert "GPUPOOL_URL" in line


def test_no_broker_and_no_driver_says_what_to_set(tmp_path: Path) -> None:
    result = cli(["status", "--all"], bare_env(tmp_path))
    assert result.returncode == 6
    line = one_line(result)
    assert "no NVIDIA driver" in line and "GPUPOOL_URL" in line and "GPUPOOL_SIMULATE=1x16GiB" in line


def test_explicit_choice_wins_over_the_discovery_file(tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    Path(env["GPUPOOL_BROKER_FILE"]).parent.mkdir(parents=True)
    Path(env["GPUPOOL_BROKER_FILE"]).write_text(json.dumps({"url": f"unix://{tmp_path}/nowhere.sock"}))
    result = cli(["status", "--json"], {**env, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")})
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["backend"] == "simulated 1x16GiB"


@pytest.fixture
def token_catcher():
    """An HTTP server that records the Authorization header of every request sent to it (a planted
    discovery file would name one like it) and answers 503."""
    import http.server
    import threading

    seen: list[str] = []

    class Catch(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization") or "")
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Catch)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs root")
@pytest.mark.parametrize("planted", ["other owner", "world-writable folder", "group-writable folder", "writable file", "fifo"])
def test_a_root_shell_never_follows_a_discovery_file_another_user_could_write(
    tmp_path: Path, token_catcher, planted: str
) -> None:
    """`status --all` in a root shell once sent the admin's token to whatever URL the discovery
    file named, whoever had written it."""
    url, seen = token_catcher
    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    discovery = folder / "gpupool-broker.json"
    if planted == "fifo":
        os.mkfifo(discovery)
    else:
        discovery.write_text(json.dumps({"url": url, "pid": 1}))
        discovery.chmod(0o644)
    if planted == "other owner":
        os.chown(discovery, 54321, 54321)
    elif planted == "world-writable folder":
        folder.chmod(0o777)
    elif planted == "group-writable folder":
        folder.chmod(0o775)
    elif planted == "writable file":
        discovery.chmod(0o666)
    env = bare_env(tmp_path, GPUPOOL_BROKER_FILE=str(discovery), GPUPOOL_TOKEN="the-admins-token")
    result = cli(["status", "--all"], env)
    assert seen == [], f"the token went to the URL of a {planted} discovery file"
    warnings = [line for line in result.stderr.splitlines() if "ignoring the broker file" in line]
    assert len(warnings) == 1 and str(discovery) in warnings[0], result.stderr
    why = {
        "other owner": "owned by uid 54321, not by root or you",
        "world-writable folder": "other users may write its folder",
        "group-writable folder": "other users may write its folder",
        "writable file": "other users may write it",
        "fifo": "not a regular file",
    }[planted]
    assert why in warnings[0] and "GPUPOOL_URL" in warnings[0], warnings[0]
    assert "Traceback" not in result.stderr and result.returncode == 6  # then: no broker, no driver


def test_a_discovery_file_of_root_or_the_brokers_user_is_followed(tmp_path: Path, token_catcher) -> None:
    """The trusted cases still work: root's own file, and one of the user $GPUPOOL_BROKER_USER names."""
    url, seen = token_catcher
    folder = tmp_path / "etc"
    folder.mkdir(mode=0o755)
    discovery = folder / "gpupool-broker.json"
    discovery.write_text(json.dumps({"url": url, "pid": 1}))
    env = bare_env(tmp_path, GPUPOOL_BROKER_FILE=str(discovery), GPUPOOL_TOKEN="the-admins-token")
    result = cli(["status", "--all"], env)
    assert seen and set(seen) == {"token the-admins-token"} and "ignoring" not in result.stderr, result.stderr
    assert result.returncode == 6 and "not answering" in result.stderr  # a 503: named as such
    if os.geteuid() == 0:
        os.chown(discovery, 54321, 54321)
        os.chown(folder, 54321, 54321)
        seen.clear()
        result = cli(["status", "--all"], {**env, "GPUPOOL_BROKER_USER": "54321"})
        assert seen and "ignoring" not in result.stderr, result.stderr


# --- 2. reservations are visible, in local time ----------------------------------------------------


def sim_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "GPUPOOL_SIMULATE": "1x16GiB",
        "GPUPOOL_DB": str(tmp_path / "pool.sqlite"),
        "TZ": "Asia/Tokyo",  # UTC+9, no daylight saving: 09:00 UTC is 18:00 here
        **extra,
    }


def test_reserve_list_is_a_table_in_local_time_and_json_only_on_request(tmp_path: Path) -> None:
    env = sim_env(tmp_path)
    booked = cli(
        ["reserve", "lab", "--memory", "4GiB", "--groups", "cs101", "--start", "2030-01-07T09:00+00:00", "--for", "2h"],
        env,
    )
    assert booked.returncode == 0, booked.stderr
    weekly = cli(
        [
            "reserve",
            "tut",
            "--memory",
            "2GiB",
            "--users",
            "alice",
            "--weekdays",
            "tue,thu",
            "--start",
            "09:00",
            "--end",
            "11:00",
        ],
        env,
    )
    assert weekly.returncode == 0, weekly.stderr
    listed = cli(["reserve", "--list"], env)
    assert listed.returncode == 0, listed.stderr
    assert not listed.stdout.lstrip().startswith("[")
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:3] == ["reservation", "for", "memory"] and "JST" in lines[0]
    lab = next(line for line in lines if line.startswith("lab "))
    assert "group cs101" in lab and "4 GiB" in lab and "Mon 2030-01-07 18:00–20:00" in lab
    assert "next Mon 2030-01-07 18:00" in lab
    tut = next(line for line in lines if line.startswith("tut "))
    assert (
        "user alice" in tut
        and "Tue,Thu 09:00–11:00 weekly" in tut
        and ("next Tue" in tut or "next Thu" in tut or "active" in tut)
    )
    data = json.loads(cli(["reserve", "--list", "--json"], env).stdout)
    assert {r["name"]: r["next_start"] for r in data}["lab"] == 1894006800.0


def test_status_lists_reservations_and_whether_they_hold_now(tmp_path: Path) -> None:
    env = sim_env(tmp_path)
    assert cli(["reserve", "now", "--memory", "4GiB", "--groups", "cs101", "--for", "2h"], env).returncode == 0
    status = cli(["status"], env)
    assert status.returncode == 0, status.stderr
    assert "Reservations:" in status.stdout
    row = next(line for line in status.stdout.splitlines() if line.startswith("now "))
    assert "group cs101" in row and "4 GiB" in row and "active until" in row
    data = json.loads(cli(["status", "--json"], env).stdout)
    assert [(r["name"], r["active"]) for r in data["reservations"]] == [("now", True)]


# --- 3. every mistake, one clear line ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["request", "-5GiB"], "invalid size '-5GiB'"),
        (["request", "1GiB", "--for", "-1h"], "invalid duration '-1h'"),
        (["reserve", "lab", "--memory", "4GiB", "--groups", "x", "--for", "-1h"], "invalid duration '-1h'"),
        (["reserve", "lab", "--memory", "-4GiB", "--groups", "x", "--for", "1h"], "invalid size '-4GiB'"),
        (["request", "1GiB", "--model"], "argument --model: expected one argument"),
        (["status", "--bogus"], "unknown option --bogus"),
        (["status", "extra"], "unexpected argument 'extra'"),
        (["reserve", "--list", "extra"], "unexpected argument 'extra'"),
        (["simulate", "--users", "abc"], "--users expected an int, not the str 'abc'"),
        (["broker", "--port", "abc"], "--port expected an int"),
        (["status", "--log-level=bogus"], "--log-level expected any of"),
        (["kernelspec", "install", "--memory", "-5GiB", "--name", "x"], "invalid size '-5GiB'"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    result = cli(args, sim_env(tmp_path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = one_line(result)
    assert expected in line
    assert "usage:" not in result.stdout + result.stderr


def fill_pool(tmp_path: Path, leases: int) -> None:
    pool = Pool.from_env(environ={"GPUPOOL_SIMULATE": "8x80GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite")})
    try:
        for i in range(leases):
            pool.request(LeaseRequest(owner=f"user{i:04d}", memory=64 * 1024**2, label=f"filler-{i}"))
    finally:
        pool.close()


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path: Path) -> None:
    fill_pool(tmp_path, 900)  # the table is larger than a pipe's buffer
    env = sim_env(tmp_path, GPUPOOL_SIMULATE="8x80GiB")
    # `jupyter gpupool leases --all | head -1`
    head = subprocess.Popen(["head", "-1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    leases = subprocess.run(
        ["jupyter", "gpupool", "leases", "--all"],
        check=False,
        stdout=head.stdin,
        stderr=subprocess.PIPE,
        env=env,
        timeout=120,
    )
    head.stdin.close()
    first = head.stdout.read().decode()
    head.wait()
    assert first.startswith("lease ")
    assert leases.returncode in (0, 141), leases.stderr
    assert leases.stderr == b"", leases.stderr.decode()
    # `status --json | head -c 10`: the reader is gone before the first write
    reader, writer = os.pipe()
    proc = subprocess.Popen(["jupyter", "gpupool", "status", "--json"], stdout=writer, stderr=subprocess.PIPE, env=env)
    os.close(writer)
    assert os.read(reader, 10)
    os.close(reader)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode in (0, 141), err
    assert err == b"", err.decode()


# --- 4. the 403 names the scope a role must grant ---------------------------------------------------


def test_forbidden_names_the_service_scope_not_the_bare_one(tmp_path: Path) -> None:
    harness = BrokerHarness(tmp_path).start()
    try:
        # What JupyterHub puts in $JUPYTERHUB_OAUTH_ACCESS_SCOPES for a service: both forms.
        assert harness.broker is not None and harness.broker.hub is not None
        harness.broker.hub.hub_auth.access_scopes = {"access:services", "access:services!service=gpupool"}
        harness.tokens["tok-no-scope"] = {
            "kind": "user",
            "name": "mallory",
            "groups": [],
            "scopes": ["read:users:name!user=mallory", ADMIN_SCOPE.replace("admin", "other")],
        }
        status, payload = harness.http("GET", "api/gpupool/pool", "tok-no-scope")
    finally:
        harness.stop()
    assert status == 403
    assert payload["message"].endswith("it needs the scope access:services!service=gpupool"), payload


# --- the help of every subcommand -----------------------------------------------------------------


@pytest.mark.slow  # one process per subcommand
def test_help_of_every_subcommand_runs(tmp_path: Path) -> None:
    from jupyter_gpupool.apps.cli import SUBCOMMANDS

    env = sim_env(tmp_path)
    top = cli(["--help"], env)
    assert top.returncode == 0 and "Traceback" not in top.stderr
    for name in SUBCOMMANDS:
        result = cli([name, "--help"], env)
        assert result.returncode == 0, (name, result.stderr)
        assert "Traceback" not in result.stderr, (name, result.stderr)
        assert result.stdout.strip(), name


# --- suspend and resume (issue 12) ------------------------------------------------------------------


def test_suspend_and_resume_a_lease_from_the_command_line(tmp_path: Path) -> None:
    env = sim_env(tmp_path, GPUPOOL_SIMULATE="1x16GiB", GPUPOOL_PARKED_MEMORY_LIMIT="64GiB", GPUPOOL_RECLAIM_ACTION="suspend")
    pool = Pool.from_env(environ=env)
    try:
        kernel = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, kernel_id="k-a", suspendable=True))
        plain = pool.request(LeaseRequest(owner="bob", memory=4 * GIB, kernel_id="k-b"))

        suspended = cli(["suspend", kernel.id], env)
        assert suspended.returncode == 0, suspended.stderr
        assert suspended.stdout.strip() == (
            f"suspending {kernel.id} (8 GiB): its server parks the GPU memory in host RAM; the kernel's next cell resumes it"
        )
        lease = pool.get(kernel.id)
        assert lease.transition.value == "suspending" and lease.suspend_reason.endswith("from the command line")

        refused = cli(["suspend", plain.id], env)
        assert refused.returncode == 3
        assert one_line(refused) == (
            "jupyter gpupool suspend: error: cannot suspend this kernel: its server cannot park GPU memory"
            " (no checkpoint support there)"
        )
        assert one_line(cli(["suspend"], env)).endswith("give exactly one lease id: jupyter gpupool suspend LEASE_ID (see `jupyter gpupool leases`)")
        assert cli(["resume", "no-such-lease"], env).returncode == 4

        pool.confirm_transition(kernel.id, parked_bytes=int(6.2 * GIB))  # what the kernel's server does
        table = cli(["leases", "--all"], env).stdout
        row = next(line for line in table.splitlines() if line.startswith(kernel.id))
        assert " suspended " in row and "6.2 GiB parked in host RAM" in row, table
        listed = {item["id"]: item for item in json.loads(cli(["leases", "--all", "--json"], env).stdout)}
        assert listed[kernel.id]["state"] == "suspended" and listed[kernel.id]["parked_memory"] == int(6.2 * GIB)

        filler = pool.request(LeaseRequest(owner="carol", memory=12 * GIB))  # the GPU is full now
        resumed = cli(["resume", kernel.id], env)
        assert resumed.returncode == 0, resumed.stderr
        assert resumed.stdout.strip() == f"{kernel.id} is queued to resume, position 1"
        row = next(line for line in cli(["leases", "--all"], env).stdout.splitlines() if line.startswith(kernel.id))
        assert " resuming " in row, row
        pool.release(filler.id)
        assert pool.get(kernel.id).transition.value == "restoring"
        again = cli(["resume", kernel.id], env)
        assert again.stdout.strip() == f"{kernel.id} is not suspended (granted, restoring); nothing to resume"
    finally:
        pool.close()


def test_only_the_owner_or_an_admin_suspends_a_lease(tmp_path: Path) -> None:
    """alice (uid 1000 in a user namespace, really not root) may not suspend bob's kernel on a shared pool."""
    try:
        from test_cli import user_namespace_available
    except ImportError:
        from tests.test_cli import user_namespace_available
    if os.geteuid() != 0 or not user_namespace_available():
        pytest.skip("needs root and user namespaces")
    shared = tmp_path / "shared"
    shared.mkdir()
    env = sim_env(tmp_path, GPUPOOL_SIMULATE="1x16GiB", GPUPOOL_DB=str(shared / "pool.sqlite"), GPUPOOL_PARKED_MEMORY_LIMIT="64GiB")
    pool = Pool.from_env(environ=env)
    theirs = pool.request(LeaseRequest(owner="bob", memory=8 * GIB, suspendable=True))
    pool.close()
    os.chmod(shared, 0o777)
    for path in shared.iterdir():
        os.chmod(path, 0o666)
    os.chown(shared, 65534, 65534)  # the folder's owner is the pool admin; alice is not it
    for verb in ("suspend", "resume"):
        result = subprocess.run(
            ["unshare", "-U", "--map-user=1000", "--map-group=1000", "jupyter", "gpupool", verb, theirs.id],
            capture_output=True, text=True, timeout=60, check=False, env={**env, "USER": "alice", "LOGNAME": "alice"},
        )
        assert result.returncode == 5, result.stderr
        assert one_line(result).endswith(f"lease {theirs.id} belongs to another user; only its owner or a pool admin may {verb} it")
    pool = Pool.from_env(environ=env)
    try:
        assert pool.get(theirs.id).transition.value == ""
    finally:
        pool.close()
