"""A host with a broker has one set of books: its servers and kernels find the broker by its discovery file.

With none of ``GPUPOOL_URL`` / ``_DB`` / ``_SIMULATE`` / ``_BACKEND`` set, a Jupyter server's pool
(``backends.factory.pool_from_env``) and a kernel's client (``kernel.client.connect``) use the broker
named by this host's trusted discovery file, as ``jupyter gpupool status`` does, and never open a pool
file of their own beside it. A file someone else could have written is skipped with one warning line
(the old behaviour: a pool of one's own); one that cannot be read is a clear PoolUnavailable.

The end-to-end tests run a real broker on a Unix socket (as systemd would) and a real ``jupyter
server`` with the extension; GPUs are simulated for the broker, and played by the fake ``pynvml`` for
a server that pools on its own.
"""

from __future__ import annotations

import json
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker_harness import JupyterServer, wait_until
from fake_pynvml import FakeGpu, FakeNvml
from server_process import Server
from socket_broker import socket_broker

from jupyter_gpupool.backends.factory import pool_from_env
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.kernel.client import HttpPoolClient, InProcessPoolClient, connect

GIB = 1024**3
TESTS = Path(__file__).resolve().parent
#: Every variable that chooses a pool, or who one is to a broker: none of them set in a "bare" process.
CHOOSERS = ("GPUPOOL_URL", "GPUPOOL_DB", "GPUPOOL_SIMULATE", "GPUPOOL_BACKEND", "GPUPOOL_TOKEN", "JUPYTERHUB_API_TOKEN")

#: The host's ``pynvml`` for a server that pools on its own: one 16 GiB GPU.
HOST_PYNVML = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from fake_pynvml import GIB, FakeGpu, FakeNvml
sys.modules[__name__] = FakeNvml([FakeGpu("NVIDIA A16-16GB", 16 * GIB)]).module
"""


def bare(discovery: Path, **extra: str) -> dict[str, str]:
    """This process's environment with no pool chosen, following ``discovery``."""
    env = {k: v for k, v in os.environ.items() if k not in CHOOSERS}
    env["GPUPOOL_BROKER_FILE"] = str(discovery)
    env.update(extra)
    return env


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """`jupyter gpupool broker --socket` as systemd runs it (a simulated 2x16GiB host), recording itself
    in a discovery file; (its socket, the discovery file)."""
    discovery = tmp_path / "etc" / "gpupool-broker.json"
    env = bare(discovery, GPUPOOL_SIMULATE="2x16GiB", GPUPOOL_DB=str(tmp_path / "broker.sqlite"), GPUPOOL_DEFAULT_MEMORY="4GiB")
    with socket_broker(env, tmp_path / "broker.log") as (_proc, sock):
        yield sock, discovery


def leases_in(db: Path) -> list[Lease]:
    """Every lease in a pool file, read straight from SQLite (oldest first)."""
    from jupyter_gpupool.backends.local.store import lease_from_json

    if not db.exists():
        return []
    conn = sqlite3.connect(db, timeout=30)
    try:
        rows = conn.execute("SELECT data FROM leases ORDER BY created_at").fetchall()
    finally:
        conn.close()
    return [lease_from_json(json.loads(row[0])) for row in rows]


class BareServer(JupyterServer):
    """A real ``jupyter server`` with the extension whose environment chooses no pool: only the
    discovery file can name one. Its Jupyter data folder (where a pool file of its own would go) is
    ``data/`` under its root."""

    def __init__(self, tmp: Path, discovery: Path, **extra: str) -> None:
        root = tmp / "alice"
        env: dict[str, str | None] = {name: None for name in CHOOSERS}
        env.update(GPUPOOL_BROKER_FILE=str(discovery), JUPYTER_DATA_DIR=str(root / "data"), **extra)
        Server.__init__(self, tmp, "alice", env)

    @property
    def own_pool_file(self) -> Path:
        return self.root / "data" / "gpupool" / "pool.sqlite"

    def magic(self, kernel_id: str, line: str) -> str:
        """``%gpupool LINE`` in the kernel: what it displays, as text."""
        code = (
            "from IPython.utils.capture import capture_output\n"
            "with capture_output() as shown:\n"
            f"    get_ipython().run_line_magic('gpupool', {line!r})\n"
            "print(shown.stdout, shown.stderr, *(o.data.get('text/plain', '') for o in shown.outputs))\n"
        )
        return self.run_code(kernel_id, code, timeout=60)


# --- in one process: which pool is chosen ------------------------------------------------------------


@pytest.fixture
def host_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host has one 16 GiB GPU (the fake ``pynvml``): a pool of this process's own can open."""
    FakeNvml([FakeGpu("NVIDIA A16-16GB", 16 * GIB)]).install(monkeypatch)


def write_discovery(path: Path, url: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"url": url, "urls": [url], "pid": 1}))
    path.chmod(mode)
    return path


def test_with_no_pool_chosen_the_server_and_kernel_use_the_discovered_broker(tmp_path: Path) -> None:
    discovery = write_discovery(tmp_path / "etc" / "gpupool-broker.json", f"unix://{tmp_path}/broker.sock")
    env = bare(discovery, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    pool = pool_from_env(environ=env)
    assert isinstance(pool, RemotePool) and pool.url == f"unix://{tmp_path}/broker.sock"
    client = connect(dict(env))
    assert isinstance(client, HttpPoolClient) and client.pool.url == pool.url
    # Nobody listens there: the message names the file the broker was found in, not a GPUPOOL_URL nobody set.
    with pytest.raises(PoolUnavailable) as down:
        pool_from_env(environ=env, check=True)
    assert f"not reachable (no socket at that path); start the broker (or ask your admin), set GPUPOOL_URL to where it runs now, or delete {discovery}" in str(down.value)
    assert "unset GPUPOOL_URL" not in str(down.value)
    assert not (tmp_path / "data").exists(), "no pool file was opened beside the broker"


@pytest.mark.parametrize("chooser", ["GPUPOOL_DB", "GPUPOOL_SIMULATE", "GPUPOOL_URL"])
def test_a_variable_that_chooses_a_pool_wins_over_the_discovery_file(tmp_path: Path, chooser: str, host_gpu: None) -> None:
    discovery = write_discovery(tmp_path / "etc" / "gpupool-broker.json", f"unix://{tmp_path}/broker.sock")
    value = {"GPUPOOL_DB": str(tmp_path / "mine.sqlite"), "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_URL": "http://127.0.0.1:9"}[chooser]
    env = bare(discovery, **{chooser: value}, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    pool = pool_from_env(environ=env)
    try:
        if chooser == "GPUPOOL_URL":
            assert isinstance(pool, RemotePool) and pool.url == "http://127.0.0.1:9"
        else:
            assert isinstance(pool, Pool)
    finally:
        pool.close()
    client = connect(dict(env))
    assert isinstance(client, HttpPoolClient if chooser == "GPUPOOL_URL" else InProcessPoolClient)


def test_an_untrusted_discovery_file_is_skipped_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], host_gpu: None
) -> None:
    discovery = write_discovery(tmp_path / "etc" / "gpupool-broker.json", f"unix://{tmp_path}/broker.sock", mode=0o666)
    env = bare(discovery, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    caplog.set_level("WARNING")
    for _ in range(2):  # a server retries its pool: it says so once
        pool = pool_from_env(environ=env)
        assert isinstance(pool, Pool)
        pool.close()
    said = [r.getMessage() for r in caplog.records if "ignoring the broker file" in r.getMessage()]
    assert len(said) == 1 and str(discovery) in said[0] and "other users may write it" in said[0], said
    assert isinstance(connect(dict(env)), InProcessPoolClient)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gpupool: warning: ignoring the broker file"), err


def test_an_unreadable_discovery_file_says_so(tmp_path: Path) -> None:
    discovery = tmp_path / "etc" / "gpupool-broker.json"
    discovery.parent.mkdir()
    discovery.write_text("{not json")
    env = bare(discovery, JUPYTER_DATA_DIR=str(tmp_path / "data"))
    with pytest.raises(PoolUnavailable, match=r"cannot read this host's broker file .*gpupool-broker\.json"):
        pool_from_env(environ=env)
    with pytest.raises(PoolUnavailable, match="cannot read this host's broker file"):
        connect(dict(env))
    assert not (tmp_path / "data").exists()


# --- a real broker, server and kernel ---------------------------------------------------------------


@pytest.mark.slow  # a broker process, a Jupyter server and its kernel
def test_a_server_that_chooses_no_pool_leases_from_the_hosts_broker(tmp_path: Path, broker: tuple[Path, Path]) -> None:
    """The kernel's lease is in the broker's pool, the server opens no pool file, ``%gpupool status``
    in the kernel reaches the broker, and so does a kernel's own client with no GPUPOOL_URL at all."""
    sock, discovery = broker
    server = BareServer(tmp_path, discovery)
    try:
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"}, timeout=90)["id"]
        leases = wait_until(lambda: [lease for lease in leases_in(tmp_path / "broker.sqlite") if lease.kernel_id == kernel_id], 60,
                            "the kernel's lease in the broker's pool")  # fmt: skip
        assert leases[0].memory == 4 * GIB, leases
        said = server.magic(kernel_id, "status")
        assert leases[0].id in said and "granted" in said and "Traceback" not in said, said
        # The kernel's own client, choosing no pool: it finds the broker by the discovery file too.
        found = server.run_code(kernel_id, (
            "import os\n"
            "from jupyter_gpupool.kernel.client import connect\n"
            "env = {k: v for k, v in os.environ.items() if k not in ('GPUPOOL_URL', 'GPUPOOL_DB', 'GPUPOOL_SIMULATE')}\n"
            "client = connect(env)\n"
            "print(type(client).__name__, client.pool.url, client.status().lease.id)\n"
        ))  # fmt: skip
        assert found.split() == ["HttpPoolClient", f"unix://{sock}", leases[0].id], found
        assert not server.own_pool_file.exists(), "the server opened a pool file of its own beside the broker"
        log = server.log_text()
        assert "Traceback" not in log and "ignoring the broker file" not in log, log[-3000:]
    finally:
        server.stop()


@pytest.mark.slow  # a broker process, a Jupyter server and its kernel
def test_a_discovery_file_others_may_write_is_ignored_and_the_server_pools_on_its_own(
    tmp_path: Path, broker: tuple[Path, Path]
) -> None:
    _sock, discovery = broker
    discovery.chmod(0o666)
    shim = tmp_path / "nvml"
    shim.mkdir()
    (shim / "pynvml.py").write_text(HOST_PYNVML)
    pythonpath = os.pathsep.join([str(shim), *filter(None, [os.environ.get("PYTHONPATH")])])
    server = BareServer(tmp_path, discovery, PYTHONPATH=pythonpath)
    try:
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"}, timeout=90)["id"]
        wait_until(lambda: server.call("GET", f"api/gpupool/kernels/{kernel_id}").get("state") == "granted", 60,
                   "the kernel's grant")  # fmt: skip
        assert [lease.kernel_id for lease in leases_in(server.own_pool_file)] == [kernel_id]
        assert leases_in(tmp_path / "broker.sqlite") == []
        warnings = [line for line in server.log_text().splitlines() if "ignoring the broker file" in line]
        assert len(warnings) == 1 and str(discovery) in warnings[0] and "other users may write it" in warnings[0], warnings
    finally:
        server.stop()


@pytest.mark.slow  # a broker process
def test_a_kernel_that_leases_for_itself_leases_from_the_discovered_broker(
    tmp_path: Path, broker: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that nbconvert or a kernel gateway started with the stock kernelspec (the hook's
    :class:`AutoLease`), in a process that chose no pool: its lease is the broker's, and the
    environment it hands to its cells names the broker."""
    from jupyter_gpupool.kernel.autolease import AutoLease
    from jupyter_gpupool.provisioner import kernel_provisioner

    sock, discovery = broker
    for name in CHOOSERS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("GPUPOOL_BROKER_FILE", str(discovery))
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(kernel_provisioner, "_pools", {})  # this process's pools, opened afresh
    env = dict(os.environ)
    auto = AutoLease(environ=env, kernel_id="k-self")
    auto.start("a kernel of nbconvert")
    try:
        assert auto.cpu_only_reason is None and auto.lease_id, auto.lines
        assert [lease.kernel_id for lease in leases_in(tmp_path / "broker.sqlite") if lease.live] == ["k-self"]
        assert env["GPUPOOL_URL"] == f"unix://{sock}" and "GPUPOOL_DB" not in env
        assert not (tmp_path / "data").exists(), "the kernel opened a pool file of its own beside the broker"
    finally:
        auto.release()
