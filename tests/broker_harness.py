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
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tornado import httpserver, netutil, web
from traitlets.config import Config

from jupyter_gpupool.broker.app import Broker, make_app
from jupyter_gpupool.broker.auth import ADMIN_SCOPE, HubIdentity, PeerCredIdentity
from jupyter_gpupool.pool import Pool
from jupyter_gpupool.remote import RemotePool
from jupyter_gpupool.watchdog import Watchdog

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


__all__ = ["ACCESS", "BrokerHarness", "unix_http", "user_model"]
