"""A broker in a background thread, with a stand-in for the hub's ``/hub/api/user``, for tests.

The broker code under test is the real one (handlers, :class:`HubIdentity` over JupyterHub's
``HubAuth``, peer credentials on a real Unix socket); only the hub is replaced by a small tornado
app that answers ``GET /hub/api/user`` from a token table as JupyterHub does (403 for tokens it
does not know). ``tests/test_hub_e2e.py`` runs the same broker under a real JupyterHub.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server_process import Server, free_port
from tornado import httpserver, netutil, web
from traitlets.config import Config

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.broker.app import Broker, make_app
from jupyter_gpupool.broker.auth import ADMIN_SCOPE, HubIdentity, PeerCredIdentity
from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.enforcement.watchdog import Watchdog

ACCESS = "access:services!service=gpupool"


def user_model(
    name: str, groups: tuple[str, ...] = (), admin: bool = False, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    scopes = [ACCESS, f"read:users:name!user={name}", f"read:users:groups!user={name}", *extra]
    if admin:
        scopes.append(ADMIN_SCOPE)
    return {"kind": "user", "name": name, "groups": list(groups), "scopes": scopes, "admin": False}


class _HubUser(web.RequestHandler):
    def get(self) -> None:
        header = self.request.headers.get("Authorization", "")
        token = header.split(None, 1)[1] if " " in header else ""
        model = self.settings["tokens"].get(token)
        self.settings["calls"].append(token)
        if model is None:
            self.set_status(403)
            self.finish(json.dumps({"status": 403, "message": "Missing or invalid credentials"}))
            return
        self.finish(json.dumps(model))


class BrokerHarness:
    """Start with :meth:`start`; call :meth:`stop` (the fixture does)."""

    def __init__(
        self,
        tmp_path: Path,
        simulate: str = "1x16GiB",
        policy: dict[str, Any] | None = None,
        watchdog: dict[str, Any] | None = None,
        broker: dict[str, Any] | None = None,
        peer: dict[str, Any] | None = None,
        socket_path: str | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.db = str(tmp_path / "broker.sqlite")
        self.socket_path = socket_path or str(tmp_path / "broker.sock")
        config = Config()
        config.PoolPolicy.default_memory = "8GiB"
        for key, value in (policy or {}).items():
            setattr(config.PoolPolicy, key, value)
        for key, value in (watchdog or {"interval": 0.2}).items():
            setattr(config.Watchdog, key, value)
        for key, value in (broker or {"tick_interval": 0.2, "wait_poll": 0.05}).items():
            setattr(config.Broker, key, value)
        for key, value in (peer or {}).items():
            setattr(config.PeerCredIdentity, key, value)
        self.config = config
        self.simulate = simulate
        self.tokens: dict[str, dict[str, Any]] = {}
        self.hub_calls: list[str] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.broker: Broker | None = None
        self.port = 0

    # --- life cycle -----------------------------------------------------------------------------
    def start(self) -> BrokerHarness:
        ready = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self._setup())
            except BaseException as err:  # noqa: BLE001 - reported to the test thread
                errors.append(err)
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self._teardown())
            self.loop.close()

        self.thread = threading.Thread(target=main, name="broker-harness", daemon=True)
        self.thread.start()
        ready.wait(30)
        if errors:
            raise errors[0]
        return self

    async def _setup(self) -> None:
        hub_app = web.Application([(r"/hub/api/user", _HubUser)], tokens=self.tokens, calls=self.hub_calls)
        hub_sockets = netutil.bind_sockets(0, "127.0.0.1")
        self.hub_port = hub_sockets[0].getsockname()[1]
        self.hub_server = httpserver.HTTPServer(hub_app)
        self.hub_server.add_sockets(hub_sockets)

        pool = Pool.from_env(config=self.config, environ={"GPUPOOL_SIMULATE": self.simulate, "GPUPOOL_DB": self.db})
        hub = HubIdentity(
            config=self.config,
            api_url=f"http://127.0.0.1:{self.hub_port}/hub/api/",
            api_token="broker-own-token",
            access_scopes={ACCESS},
            cache_seconds=0,
        )
        peer = PeerCredIdentity(config=self.config)
        watchdog = Watchdog(config=self.config, backend=pool.backend, pool=pool)
        self.broker = Broker(pool=pool, hub=hub, peer=peer, watchdog=watchdog, config=self.config)
        app = make_app(self.broker, "/services/gpupool/")
        sockets = netutil.bind_sockets(0, "127.0.0.1")
        self.port = sockets[0].getsockname()[1]
        self.server = httpserver.HTTPServer(app)
        self.server.add_sockets(sockets)
        self.server.add_socket(netutil.bind_unix_socket(self.socket_path, mode=0o666))
        self.broker.start()

    async def _teardown(self) -> None:
        self.server.stop()
        self.hub_server.stop()
        assert self.broker is not None
        await self.broker.stop()
        self.broker.pool.close()

    def stop(self) -> None:
        if self.loop is not None and self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)

    # --- helpers ---------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/services/gpupool"

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pool(self) -> Pool:
        assert self.broker is not None
        return self.broker.pool

    def on_broker(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the broker's pool thread (the pool is not shared across threads)."""
        assert self.broker is not None
        return self.broker.executor.submit(fn, *args).result(30)

    def add_user(
        self, token: str, name: str, groups: tuple[str, ...] = (), admin: bool = False, extra: tuple[str, ...] = ()
    ) -> str:
        self.tokens[token] = user_model(name, groups, admin, extra)
        return token

    def remote(self, token: str | None) -> RemotePool:
        return RemotePool(self.url, token=token, timeout=15)

    def http(
        self, method: str, path: str, token: str | None = None, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """One raw request over TCP; ``path`` is relative to the service prefix."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=15)
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"token {token}"
        data = json.dumps(body).encode() if body is not None else None
        if data is not None:
            hdrs["Content-Type"] = "application/json"
        conn.request(method, "/services/gpupool/" + path.lstrip("/"), body=data, headers=hdrs)
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = raw.decode(errors="replace")
        return response.status, payload


class StandInHub:
    """JupyterHub's ``GET /hub/api/user`` from a token table, in a thread of the test process, so that
    a real broker *process* (killed and restarted by a test) can identify callers as under a hub."""

    def __init__(self) -> None:
        self.tokens: dict[str, dict[str, Any]] = {}
        self.calls: list[str] = []
        self.port = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> StandInHub:
        ready = threading.Event()

        def main() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            app = web.Application([(r"/hub/api/user", _HubUser)], tokens=self.tokens, calls=self.calls)
            sockets = netutil.bind_sockets(0, "127.0.0.1")
            self.port = sockets[0].getsockname()[1]
            server = httpserver.HTTPServer(app)
            server.add_sockets(sockets)
            ready.set()
            self.loop.run_forever()
            server.stop()
            self.loop.close()

        self.thread = threading.Thread(target=main, name="stand-in-hub", daemon=True)
        self.thread.start()
        ready.wait(30)
        return self

    def stop(self) -> None:
        if self.loop is not None and self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(30)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hub/api/"

    def add_user(self, token: str, name: str, groups: tuple[str, ...] = (), admin: bool = False) -> str:
        self.tokens[token] = user_model(name, groups, admin)
        return token


class BrokerProcess:
    """``python -m jupyter_gpupool.broker`` as a real process (a JupyterHub service with a stand-in hub,
    and a Unix socket), on a fixed pool file and port, so a test can SIGKILL it and start it again."""

    def __init__(
        self,
        tmp_path: Path,
        hub: StandInHub,
        simulate: str = "1x16GiB",
        config: str = "",
        db: str | None = None,
        socket_path: str | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.hub = hub
        self.db = db or str(tmp_path / "broker.sqlite")
        self.socket_path = socket_path or str(tmp_path / "broker.sock")
        self.port = free_port()
        self.simulate = simulate
        self.config_file = tmp_path / "jupyter_gpupool_config.py"
        self.config_file.write_text(
            'c.PoolPolicy.default_memory = "8GiB"\n'
            "c.Broker.tick_interval = 0.2\n"
            "c.Broker.wait_poll = 0.05\n"
            "c.Broker.run_watchdog = False\n" + config
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.log_path = tmp_path / "broker.log"

    def start(self, timeout: float = 120) -> BrokerProcess:
        """Start it and wait until it serves its port and socket."""
        proc = self._launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"the broker exited ({proc.returncode}): {self.log()[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    pass
                if os.path.exists(self.socket_path):
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the broker did not start: {self.log()[-3000:]}")

    def run_until_exit(self, timeout: float = 60) -> int:
        """Start it and wait for it to exit (a broker that must refuse to start); its exit code."""
        return self._launch().wait(timeout)

    def _launch(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "JUPYTERHUB_API_URL": self.hub.api_url,
            "JUPYTERHUB_API_TOKEN": "broker-own-token",
            "JUPYTERHUB_SERVICE_NAME": "gpupool",
            "JUPYTERHUB_SERVICE_PREFIX": "/services/gpupool/",
            "GPUPOOL_SIMULATE": self.simulate,
        }
        for key in ("GPUPOOL_URL", "GPUPOOL_DB", "JUPYTERHUB_SERVICE_URL"):
            env.pop(key, None)
        self.starts += 1
        log = open(self.log_path, "a")  # noqa: SIM115 - the process writes it; closed below
        log.write(f"--- start {self.starts} ---\n")
        log.flush()
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter_gpupool.broker", f"--db={self.db}", f"--port={self.port}",
                "--ip=127.0.0.1", f"--socket={self.socket_path}", "--hub=on", f"--config={self.config_file}",
            ],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(self.tmp_path),
        )  # fmt: skip
        log.close()
        return self.proc

    def kill(self) -> None:
        """SIGKILL: no clean-up, no goodbye (the socket file stays behind)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/services/gpupool"

    @property
    def socket_url(self) -> str:
        return f"unix://{self.socket_path}"

    def leases(self, include_released: bool = True) -> list[Lease]:
        """Every lease in the pool file, read straight from SQLite (oldest first)."""
        from jupyter_gpupool.backends.local.store import lease_from_json

        conn = sqlite3.connect(self.db, timeout=30)
        try:
            rows = conn.execute("SELECT data FROM leases ORDER BY created_at").fetchall()
        finally:
            conn.close()
        leases = [lease_from_json(json.loads(row[0])) for row in rows]
        return leases if include_released else [lease for lease in leases if lease.live]

    def kernel_lease(self, kernel_id: str) -> Lease | None:
        """The newest lease of a kernel in the pool file."""
        found = [lease for lease in self.leases() if lease.kernel_id == kernel_id]
        return found[-1] if found else None


class JupyterServer(Server):
    """A real ``jupyter server`` process for one user, pointed at a broker with that user's hub token;
    ``config`` is written to its ``jupyter_server_config.json`` (e.g. the gpupool extension's intervals)."""

    def __init__(self, tmp: Path, user: str, broker_url: str, token: str, config: dict[str, Any] | None = None) -> None:
        config_dir = tmp / user / "config"
        config_dir.mkdir(parents=True, exist_ok=True)
        (config_dir / "jupyter_server_config.json").write_text(json.dumps(config or {}))
        env: dict[str, str | None] = {
            "GPUPOOL_URL": broker_url,
            "GPUPOOL_TOKEN": token,
            "GPUPOOL_DB": None,
            "GPUPOOL_SIMULATE": None,
        }
        super().__init__(tmp, user, env)

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def run_code(self, kernel_id: str, code: str, timeout: float = 60) -> str:
        """Run ``code`` in the kernel (over its ZMQ channels, as a front end would); its stdout."""
        from jupyter_client import BlockingKernelClient

        client = BlockingKernelClient(connection_file=str(self.root / "runtime" / f"kernel-{kernel_id}.json"))
        client.load_connection_file()
        client.start_channels()
        try:
            deadline = time.monotonic() + timeout
            while True:  # without its manager the client sees a kernel still starting as "died": ask again
                try:
                    client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
                    break
                except RuntimeError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            out: list[str] = []

            def hook(msg: dict[str, Any]) -> None:
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])

            reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
            assert reply["content"]["status"] == "ok", reply["content"]
            return "".join(out)
        finally:
            client.stop_channels()


def wait_until(predicate: Callable[[], Any], timeout: float = 60, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something true; its value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def unix_http_json(path: str, method: str, route: str, body: Any = None) -> tuple[int, Any]:
    """One JSON request over a Unix socket with ``http.client`` (the caller's pid is its peer pid)."""
    from jupyter_gpupool.backends.remote import _UnixHTTPConnection

    conn = _UnixHTTPConnection(path, timeout=15)
    data = json.dumps(body).encode() if body is not None else None
    try:
        conn.request(method, route, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    return response.status, json.loads(raw) if raw else None


def unix_http(path: str, method: str, route: str) -> tuple[int, bytes]:
    """One raw HTTP request over a Unix socket (stdlib only)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(15)
    sock.connect(path)
    sock.sendall(f"{method} {route} HTTP/1.0\r\nHost: localhost\r\n\r\n".encode())
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
    sock.close()
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


__all__ = [
    "ACCESS",
    "BrokerHarness",
    "BrokerProcess",
    "JupyterServer",
    "StandInHub",
    "free_port",
    "unix_http",
    "unix_http_json",
    "user_model",
    "wait_until",
]


def read_http_message(sock: socket.socket) -> bytes:
    """One HTTP message (headers and a Content-Length body) read from ``sock`` (for proxies that drop answers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body
