"""`jupyter gpupool` as a user runs it: real subprocesses, real exit codes, no tracebacks."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys

import pytest


def run(args: list[str], tmp_path, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.sqlite"), **env}
    return subprocess.run(["jupyter", "gpupool", *args], capture_output=True, text=True, env=environ, timeout=60)


def test_status_json_shows_one_16gib_device(tmp_path):
    result = run(["status", "--json"], tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["memory_total"] for d in data["devices"]] == [16 * 1024**3]
    assert data["backend"] == "simulated 1x16GiB"
    assert data["device_control"]["mode"] == "off" and "single-user" in data["device_control"]["reason"]


def test_request_queue_release_report_round_trip(tmp_path):
    ids = []
    for _ in range(3):
        result = run(["request", "8GiB", "--for", "1h", "--json"], tmp_path)
        assert result.returncode == 0, result.stderr
        ids.append(json.loads(result.stdout))
    assert [x["state"] for x in ids] == ["granted", "granted", "queued"]
    queue = run(["queue"], tmp_path)
    assert ids[2]["id"] in queue.stdout and " min " in queue.stdout  # position and estimated wait (about 1 h)
    table = run(["status"], tmp_path).stdout
    assert "16 GiB" in table and "queued" in table
    assert run(["release", ids[0]["id"]], tmp_path).returncode == 0
    leases = json.loads(run(["leases", "--json"], tmp_path).stdout)
    assert {l["id"]: l["state"] for l in leases}[ids[2]["id"]] == "granted"
    report = run(["report", "--since", "2000-01-01", "--by", "user", "--format", "csv"], tmp_path)
    rows = list(csv.DictReader(io.StringIO(report.stdout)))
    assert rows and rows[0]["leases"] == "3" and float(rows[0]["gib_hours_held"]) >= 0
    assert json.loads(run(["report", "--format", "json"], tmp_path).stdout)[0]["leases"] == 3


def test_a_request_says_how_long_its_slice_is_held_once_the_command_exits(tmp_path):
    """Without ``--for`` nothing sends a shell slice's heartbeats: the command says it lapses, and how
    to hold it; with ``--for`` it says until when, queued or granted. ``--json`` stays pure JSON."""
    bare = run(["request", "8GiB"], tmp_path, GPUPOOL_HEARTBEAT_TTL="120")
    assert bare.returncode == 0 and " granted 8 GiB" in bare.stdout, bare.stderr
    assert "nothing holds it once this command exits: it lapses within 2 min" in bare.stderr and "--for 2h" in bare.stderr
    booked = [run(["request", "8GiB", "--for", "90m"], tmp_path) for _ in range(2)]
    assert "queued" in booked[1].stdout
    lease_id = booked[1].stdout.split()[0]
    assert booked[0].stderr.startswith("held for 1 h 30 min (--for), then released; jupyter gpupool release l-"), booked[0].stderr
    assert booked[1].stderr.startswith(f"once granted, held for 1 h 30 min (--for), then released; jupyter gpupool release {lease_id}")
    as_json = run(["request", "1GiB", "--json"], tmp_path)
    assert json.loads(as_json.stdout)["state"] == "queued" and as_json.stderr == ""


@pytest.mark.parametrize("size", ["-1", "abc", "1e30", "0", "8XB"])
def test_bad_sizes_are_one_line_errors(tmp_path, size):
    result = run(["request", f"--", size], tmp_path) if size.startswith("-") else run(["request", size], tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "8GiB" in lines[0]


def test_bad_duration_and_unknown_lease(tmp_path):
    result = run(["request", "1GiB", "--for=-5m"], tmp_path)
    assert result.returncode == 2 and "duration like 90s" in result.stderr and "Traceback" not in result.stderr
    result = run(["release", "l-doesnotexist"], tmp_path)
    assert result.returncode == 4 and "no lease 'l-doesnotexist'" in result.stderr
    result = run(["report", "--since", "yesterday-ish"], tmp_path)
    assert result.returncode == 2 and "2026-11-01" in result.stderr


def test_refusals_and_bad_config_exit_non_zero(tmp_path):
    result = run(["request", "20GiB"], tmp_path)
    assert result.returncode == 3 and "ask for at most 16 GiB" in result.stderr
    result = run(["status"], tmp_path, GPUPOOL_SIMULATE="2xFOO")
    assert result.returncode == 2 and "unknown GPU 'FOO'" in result.stderr and "Traceback" not in result.stderr
    result = run(["status"], tmp_path, GPUPOOL_IDLE_TIMEOUT="soon")
    assert result.returncode == 2 and "GPUPOOL_IDLE_TIMEOUT" in result.stderr


def test_unknown_command_and_help(tmp_path):
    result = run(["frobnicate"], tmp_path)
    assert result.returncode == 2 and "unknown command 'frobnicate'" in result.stderr
    result = run([], tmp_path)
    assert result.returncode == 0 and "status" in result.stdout and "report" in result.stdout


def test_reservations_from_the_cli(tmp_path):
    result = run(["reserve", "lab", "--memory", "8GiB", "--groups", "cs101", "--weekdays", "tue", "--start", "09:00", "--end", "11:00"], tmp_path)
    assert result.returncode == 0, result.stderr
    listed = json.loads(run(["reserve", "--list", "--json"], tmp_path).stdout)
    assert listed[0]["weekdays"] == ["tue"] and listed[0]["groups"] == ["cs101"]
    bad = run(["reserve", "x", "--memory", "8GiB", "--groups", "g", "--weekdays", "someday", "--start", "09:00", "--end", "10:00"], tmp_path)
    assert bad.returncode == 2 and "unknown weekday" in bad.stderr
    assert run(["reserve", "lab", "--cancel"], tmp_path).returncode == 0
    assert run(["reserve", "lab", "--cancel"], tmp_path).returncode == 4


def test_python_module_entry_point(tmp_path):
    result = subprocess.run([sys.executable, "-m", "jupyter_gpupool.apps.cli", "status", "--json"], capture_output=True, text=True,
                            env={**os.environ, "GPUPOOL_SIMULATE": "2xA100-80GB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")})
    assert result.returncode == 0 and len(json.loads(result.stdout)["devices"]) == 2


# --- a damaged pool and local authorization ---------------------------------------------------------------
def one_line_error(result: subprocess.CompletedProcess, code: int) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "foreign"])
def test_a_damaged_pool_file_is_one_line_and_exit_6(tmp_path, damage):
    import sqlite3

    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    db = tmp_path / "pool.sqlite"
    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), str(db))
    for _ in range(100):
        pool.request(LeaseRequest(owner="alice", memory=100 * 2**20, label="x" * 200))
    pool.close()
    size = db.stat().st_size
    if damage == "empty":
        db.write_bytes(b"")
    elif damage == "truncated":
        os.truncate(db, size // 2)
    elif damage == "random":
        db.write_bytes(b"SQLite format 3\x00" + os.urandom(size))
    else:
        db.unlink()
        conn = sqlite3.connect(db)
        conn.executescript("CREATE TABLE moz_places (url TEXT); INSERT INTO moz_places VALUES ('https://jupyter.org');")
        conn.close()
    before = db.read_bytes()
    for command in (["status"], ["leases", "--all"], ["request", "1GiB"]):
        line = one_line_error(run(command, tmp_path), 6)
        assert str(db) in line and ("move it away" in line or "another path" in line)
    assert db.read_bytes() == before  # refused, never made into a fresh pool


def test_a_read_only_pool_folder_is_one_line_and_exit_6(tmp_path):
    """Permission checks apply even to root once CAP_DAC_OVERRIDE is dropped (setpriv)."""
    import shutil

    drop = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"] if os.geteuid() == 0 else []
    if drop and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv (util-linux) ignores a folder's permissions")
    assert run(["request", "1GiB"], tmp_path).returncode == 0
    os.chmod(tmp_path, 0o555)
    try:
        for db in ("pool.sqlite", "new.sqlite"):  # an existing pool, and a new one
            environ = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / db)}
            result = subprocess.run(
                [*drop, "jupyter", "gpupool", "status"],
                capture_output=True, text=True, env=environ, timeout=60,
            )
            line = one_line_error(result, 6)
            assert "writable" in line
    finally:
        os.chmod(tmp_path, 0o755)


def user_namespace_available() -> bool:
    try:
        probe = subprocess.run(["unshare", "-U", "--map-user=1000", "--map-group=1000", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0 or not user_namespace_available(), reason="needs root and user namespaces")
def test_on_a_local_pool_only_an_admin_raises_priority(tmp_path):
    """A shared pool whose folder belongs to another user: alice (uid 1000, in a user namespace,
    so really not root) may lower her own lease but never raise it, nor touch bob's; root may."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    env = {"GPUPOOL_DB": str(shared / "pool.sqlite")}
    mine = json.loads(run(["request", "1GiB", "--json"], tmp_path, USER="alice", **env).stdout)
    theirs = json.loads(run(["request", "1GiB", "--json"], tmp_path, USER="bob", **env).stdout)
    os.chown(shared, 65534, 65534)  # the folder's owner is the pool admin; alice is not it
    for path in shared.iterdir():
        os.chmod(path, 0o666)

    def as_alice(*args: str, uid: str = "1000") -> subprocess.CompletedProcess:
        environ = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "USER": "alice", "LOGNAME": "alice", **env}
        command = ["unshare", "-U", f"--map-user={uid}", f"--map-group={uid}", "jupyter", "gpupool", "priority", *args]
        return subprocess.run(command, capture_output=True, text=True, env=environ, timeout=60)

    line = one_line_error(as_alice(mine["id"], "high"), 5)
    assert "only a pool admin (root, the owner of" in line and "may raise a lease's priority" in line
    line = one_line_error(as_alice(theirs["id"], "batch"), 5)
    assert "belongs to another user" in line
    assert as_alice(mine["id"], "batch").returncode == 0  # lowering her own is fine
    one_line_error(as_alice(mine["id"], "normal"), 5)  # and raising it back is not
    leases = {l["id"]: l["priority"] for l in json.loads(run(["leases", "--all", "--json"], tmp_path, **env).stdout)}
    assert leases == {mine["id"]: "batch", theirs["id"]: "normal"}
    # "root" in $USER is no key: the uid decides.
    result = subprocess.run(
        ["unshare", "-U", "--map-user=1000", "--map-group=1000", "jupyter", "gpupool", "priority", mine["id"], "high"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "USER": "root", "LOGNAME": "root", **env},
    )
    one_line_error(result, 5)
    result = subprocess.run(
        ["unshare", "-U", "--map-user=1000", "--map-group=1000", "jupyter", "gpupool", "release", theirs["id"]],
        capture_output=True, text=True, timeout=60, check=False,
        env={**os.environ, "GPUPOOL_SIMULATE": "1x16GiB", "USER": "root", "LOGNAME": "root", **env},
    )
    assert "belongs to another user" in one_line_error(result, 5)
    # Root, and the owner of the pool's folder, are admins.
    assert run(["priority", theirs["id"], "high"], tmp_path, USER="carol", **env).returncode == 0
    os.chown(shared, 0, 0)  # inside the namespace, alice's uid maps to the folder's owner now
    assert as_alice(mine["id"], "high").returncode == 0


def test_a_size_below_the_smallest_slice_is_refused_and_changes_nothing(tmp_path):
    """``request 8`` once queued an 8-byte slice; a reservation of 1MiB was booked. Both are typos."""
    for args, expect in [
        (["request", "8"], "8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB; "
                           "did you mean jupyter gpupool request 8GiB?"),
        (["request", "16MiB"], "16MiB is 16 MiB, below the smallest GPU slice of 64 MiB"),
        (["reserve", "lab", "--memory", "8", "--groups", "cs101", "--for", "2h"],
         "--memory 8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB; did you mean --memory 8GiB?"),
    ]:
        result = run(args, tmp_path)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and expect in lines[0], (args, result.stderr)
        assert lines[0].startswith(f"jupyter gpupool {args[0]}: error: ")
    assert json.loads(run(["leases", "--json"], tmp_path).stdout) == []
    assert json.loads(run(["reserve", "--list", "--json"], tmp_path).stdout) == []


def test_a_backwards_date_range_is_refused(tmp_path):
    """``--since`` after ``--until`` once printed "(none)" and exited 0."""
    assert run(["request", "1GiB", "--for", "1h"], tmp_path).returncode == 0
    result = run(["report", "--since", "2026-12-05", "--until", "2026-12-01"], tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and result.stdout == "" and len(lines) == 1, result
    assert lines[0] == ("jupyter gpupool report: error: the date range is backwards: --since 2026-12-05 is after "
                        "--until 2026-12-01; give the earlier date as since")
    assert run(["report", "--since", "2026-12-01", "--until", "2026-12-01"], tmp_path).returncode == 0


def test_the_error_prefix_is_the_command_as_typed(tmp_path):
    result = run(["clear-claim"], tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith("jupyter gpupool clear-claim: error: give exactly one kernel id"), result.stderr
