"""An earlier jupyter-gpupool and this one on one pool file: the earlier version is a real install of
the package as it was at the last commit of the previous schema (its Python package, without the
lab extension, kept in ``$GPUPOOL_CACHE_DIR/old-versions``), run in its own process. While it has
the file open this version does not take the file forward, naming it; on a file this version
wrote, the earlier one refuses to decide. Nothing is granted twice; the kernel holding a lease
(a real process) keeps running and keeps its lease."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.backends.local.schema import SCHEMA_VERSION
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.units import GIB

REPO = Path(__file__).resolve().parent.parent
#: The last commit whose pool file had the schema before the limit a lease's user set (schema 6).
EARLIER = "e8a6917974dfc2f646f6188a5ae10f319154cfe1"

#: The earlier version's side: a pool opened on a file, requests made there, one JSON line each.
EARLIER_PROGRAM = r"""
import json, sys
import jupyter_gpupool
from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
from jupyter_gpupool.backends.local.schema import SCHEMA_VERSION
from jupyter_gpupool.core.models import LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.units import GIB

def say(**answer):
    print(json.dumps(answer), flush=True)

say(file=jupyter_gpupool.__file__, schema=SCHEMA_VERSION)
pool = None
for line in sys.stdin:
    command, *args = line.split()
    try:
        if command == "open":
            pool = Pool(SimulatedBackend.from_spec("1x16GiB"), args[0], PoolPolicy(heartbeat_ttl=10**9))
            say(ok=True)
        elif command == "request" and pool is None:
            say(ok=False, error="no pool open")
        elif command == "request":
            owner, gib, holder = args
            lease = pool.request(LeaseRequest(owner=owner, memory=int(gib) * GIB, kernel_id="k-" + owner,
                                              holder_pid=int(holder), holder_host=HOSTNAME))
            say(ok=True, id=lease.id, state=lease.state.value)
        else:
            break
    except GpuPoolError as err:
        say(ok=False, error=str(err))
if pool is not None:
    pool.close()
"""


@pytest.fixture(scope="session")
def earlier_install() -> Path:
    """The earlier version's package, extracted once from git into the cache (no build step: it is
    pure Python, and its lab extension, a build output, is not in git)."""
    cache = Path(os.environ.get("GPUPOOL_CACHE_DIR") or Path.home() / ".cache" / "jupyter-gpupool") / "old-versions"
    target = cache / EARLIER[:12]
    if (target / "jupyter_gpupool" / "__init__.py").exists():
        return target
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{EARLIER}^{{commit}}"],
                                                     capture_output=True, check=False).returncode != 0:
        pytest.skip(f"the earlier version ({EARLIER[:12]}) is neither cached in {cache} nor in this clone's history")
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="install-", dir=cache))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", EARLIER, "jupyter_gpupool"], capture_output=True, check=True).stdout
    with tempfile.TemporaryFile() as raw:
        raw.write(archive)
        raw.seek(0)
        with tarfile.open(fileobj=raw) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(staging, filter="data")
            else:  # Python before 3.10.12: our own git's archive of our own package
                tar.extractall(staging)
    try:
        os.rename(staging, target)  # atomic: another worker that got there first wins
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return target


class Earlier:
    """A process of the earlier version, driven one line at a time."""

    def __init__(self, install: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(install)}
        for key in ("GPUPOOL_URL", "GPUPOOL_DB", "GPUPOOL_LEASE_ID"):
            env.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, "-c", EARLIER_PROGRAM], env=env, cwd=str(install), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        self.first = self._answer()
        assert self.first["file"].startswith(str(install)), self.first  # not this checkout's package
        assert self.first["schema"] < SCHEMA_VERSION, self.first

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(self.proc.stderr.read()[-3000:])
        return json.loads(line)

    def call(self, *words: object) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(map(str, words)) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


@pytest.fixture
def kernel() -> Iterator[subprocess.Popen[bytes]]:
    """A running kernel (a real process) that holds alice's lease."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def open_pool(db: Path) -> Pool:
    return Pool(SimulatedBackend.from_spec("1x16GiB"), str(db), PoolPolicy(heartbeat_ttl=10**9))


def schema_of(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def test_this_version_does_not_take_forward_a_file_the_earlier_one_has_open(
    tmp_path: Path, earlier_install: Path, kernel: subprocess.Popen[bytes]
) -> None:
    db = tmp_path / "pool.sqlite"
    earlier = Earlier(earlier_install)
    try:
        old_schema = earlier.first["schema"]
        assert earlier.call("open", db)["ok"]
        alice = earlier.call("request", "alice", 12, kernel.pid)
        assert alice["state"] == "granted", alice
        with pytest.raises(PoolUnavailable) as refused:
            open_pool(db)
        line = str(refused.value)
        assert f"has schema {old_schema} and this jupyter-gpupool needs schema {SCHEMA_VERSION}" in line, line
        assert f"pid {earlier.proc.pid}: " in line and "\n" not in line, line
        assert schema_of(db) == old_schema, "the file was taken forward under the earlier version"
        bob = earlier.call("request", "bob", 8, kernel.pid)
        assert bob["state"] == "queued", bob  # the earlier version still decides, and sees alice's 12 GiB
    finally:
        earlier.stop()
    pool = open_pool(db)  # the earlier version has stopped: now the file is taken forward
    try:
        assert schema_of(db) == SCHEMA_VERSION
        leases = {lease.id: lease for lease in pool.leases()}
        assert leases[alice["id"]].state is LeaseState.GRANTED and leases[alice["id"]].memory == 12 * GIB
        assert leases[bob["id"]].state is LeaseState.QUEUED
        pool.tick()
        carol = pool.request(LeaseRequest(owner="carol", memory=8 * GIB, holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert carol.state is LeaseState.QUEUED, "alice's 12 GiB were granted again"
        assert pool.get(alice["id"]).state is LeaseState.GRANTED and kernel.poll() is None
    finally:
        pool.close()


def test_the_earlier_version_refuses_a_file_this_version_wrote(
    tmp_path: Path, earlier_install: Path, kernel: subprocess.Popen[bytes]
) -> None:
    db = tmp_path / "pool.sqlite"
    pool = open_pool(db)
    earlier = Earlier(earlier_install)
    try:
        alice = pool.request(LeaseRequest(owner="alice", memory=12 * GIB, kernel_id="k-alice", holder_pid=kernel.pid, holder_host=HOSTNAME))
        assert alice.state is LeaseState.GRANTED
        refused = earlier.call("open", db)
        old_schema = earlier.first["schema"]
        assert not refused["ok"] and f"has schema {SCHEMA_VERSION}, newer than this jupyter-gpupool knows ({old_schema})" in refused["error"], refused
        assert "\n" not in refused["error"]
        assert schema_of(db) == SCHEMA_VERSION
        assert not earlier.call("request", "bob", 8, kernel.pid)["ok"]  # it has no pool: it grants nothing
        bob = pool.request(LeaseRequest(owner="bob", memory=8 * GIB, holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert bob.state is LeaseState.QUEUED and [lease.id for lease in pool.leases() if lease.state is LeaseState.GRANTED] == [alice.id]
        assert kernel.poll() is None
    finally:
        earlier.stop()
        pool.close()
