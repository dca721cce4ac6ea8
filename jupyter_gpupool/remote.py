"""The pool contract over HTTP(S) or a Unix socket: how servers and kernels use a broker.

On a multi-user host the pool belongs to the broker (``jupyter gpupool broker``). Setting
``GPUPOOL_URL`` switches every client to it; :func:`pool_from_env` returns a :class:`RemotePool`
then, and a plain :class:`~jupyter_gpupool.pool.Pool` over ``GPUPOOL_DB`` otherwise. It never
falls back silently: if the broker cannot be reached every call raises
:class:`~jupyter_gpupool.errors.PoolUnavailable` with a message saying so, and a kernel start fails
instead of running with an unpooled GPU.

``GPUPOOL_URL`` forms:

- ``http://127.0.0.1:10101/services/gpupool`` (or ``https://...``): a broker running as a
  JupyterHub service; requests carry ``GPUPOOL_TOKEN``, else ``JUPYTERHUB_API_TOKEN`` (which every
  single-user server and its kernels have);
- ``unix:///run/jupyter-gpupool/broker.sock``: a broker on a Unix socket, which identifies the
  caller by its uid; no token needed.

The methods are synchronous (each one HTTP request); :meth:`RemotePool.await_grant` is the async
twin of :meth:`RemotePool.wait_for_grant`. The caller's identity is decided by the broker from the
token or the socket peer: ``owner`` fields, ``viewer`` and ``admin`` arguments are not sent.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

from .core.models import (
    Activity,
    Decision,
    DecisionKind,
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PoolSnapshot,
    QueueInfo,
)
from .errors import GpuPoolError, InvalidInput, LeaseNotFound, NotAuthorized, PoolUnavailable, RequestRefused
from .units import parse_size

URL_FORMS = "http://HOST:PORT[/PREFIX], https://HOST[:PORT][/PREFIX] or unix:///PATH/TO/SOCKET"
API = "api/gpupool"

_ERRORS: dict[str, type[GpuPoolError]] = {
    cls.__name__: cls
    for cls in (GpuPoolError, InvalidInput, RequestRefused, LeaseNotFound, NotAuthorized, PoolUnavailable)
}
_BY_STATUS: dict[int, type[GpuPoolError]] = {
    400: InvalidInput,
    401: NotAuthorized,
    403: NotAuthorized,
    404: LeaseNotFound,
    409: RequestRefused,
}


class _UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix stream socket."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


class _Endpoint:
    """Where the broker listens, parsed from ``GPUPOOL_URL``."""

    def __init__(self, url: str) -> None:
        self.url = url.strip()
        parsed = urllib.parse.urlsplit(self.url)
        self.scheme = parsed.scheme.lower()
        if self.scheme == "unix":
            self.socket_path = urllib.parse.unquote(parsed.path or "")
            if parsed.netloc:  # unix://run/x.sock: read as the absolute path /run/x.sock
                self.socket_path = "/" + parsed.netloc + self.socket_path
            if not self.socket_path:
                raise InvalidInput(f"GPUPOOL_URL={url!r} names no socket; use {URL_FORMS}")
            self.prefix = "/"
            self.host = ""
            self.port: int | None = None
        elif self.scheme == "http+unix":
            self.socket_path = urllib.parse.unquote(parsed.netloc)
            self.prefix = (parsed.path or "/").rstrip("/") + "/"
            self.host, self.port = "", None
        elif self.scheme in ("http", "https"):
            if not parsed.hostname:
                raise InvalidInput(f"GPUPOOL_URL={url!r} names no host; use {URL_FORMS}")
            self.socket_path = ""
            self.host = parsed.hostname
            try:
                self.port = parsed.port
            except ValueError:
                raise InvalidInput(f"GPUPOOL_URL={url!r} has an invalid port; use {URL_FORMS}") from None
            self.prefix = (parsed.path or "/").rstrip("/") + "/"
        else:
            raise InvalidInput(f"GPUPOOL_URL={url!r} is not a broker address; use {URL_FORMS}")

    @property
    def is_unix(self) -> bool:
        return bool(self.socket_path)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.is_unix:
            return _UnixHTTPConnection(self.socket_path, timeout)
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def path(self, route: str, query: Mapping[str, Any] | None = None) -> str:
        text = self.prefix + route.lstrip("/")
        if query:
            items = {k: v for k, v in query.items() if v is not None}
            if items:
                text += "?" + urllib.parse.urlencode(items)
        return text


class RemoteBackend:
    """The device backend as a :class:`RemotePool` client sees it: the broker's devices."""

    name = "remote"

    def __init__(self, pool: RemotePool) -> None:
        self._pool = pool

    @property
    def spec(self) -> str:
        return str(self._pool.info().get("backend", {}).get("spec", ""))

    def devices(self) -> list[Device]:
        return self._pool.devices()

    def process_usage(self) -> list[Any]:
        return []  # the broker's watchdog measures; clients never do

    def describe(self) -> str:
        remote = self._pool.info().get("backend", {}).get("describe", "")
        return f"broker {self._pool.url}" + (f" ({remote})" if remote else "")

    def close(self) -> None:
        """Nothing to release: connections are per request."""


class RemotePool:
    """:class:`~jupyter_gpupool.pool.Pool`'s contract, served by a broker."""

    #: Adapters may check this to skip work the broker does itself (watchdog, scheduler loop).
    remote = True
    #: Seconds a device list or policy read from the broker is reused.
    cache_seconds = 2.0
    #: Longest single long-poll while waiting for a grant (the broker caps it too).
    wait_chunk = 10.0

    def __init__(
        self, url: str, token: str | None = None, timeout: float = 30.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.endpoint = _Endpoint(url)
        self.url = self.endpoint.url
        self.token = token or None
        self.timeout = timeout
        self.clock = clock
        self.db_path = self.url  # shown where a local pool shows its file
        self.backend = RemoteBackend(self)
        self._info: tuple[float, dict[str, Any]] | None = None
        self._devices: tuple[float, list[Device]] | None = None
        self._policy: Any = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemotePool:
        """From ``GPUPOOL_URL`` and ``GPUPOOL_TOKEN`` / ``JUPYTERHUB_API_TOKEN``."""
        env = os.environ if environ is None else environ
        url = (env.get("GPUPOOL_URL") or "").strip()
        if not url:
            raise InvalidInput(f"GPUPOOL_URL is not set; set it to the broker's address ({URL_FORMS})")
        token = env.get("GPUPOOL_TOKEN") or env.get("JUPYTERHUB_API_TOKEN") or None
        timeout = float(env.get("GPUPOOL_TIMEOUT") or 30.0)
        return cls(url, token=token, timeout=timeout)

    # --- transport ------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        route: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """One request to the broker; the JSON answer, or the domain error it stands for."""
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token and not self.endpoint.is_unix:
            headers["Authorization"] = f"token {self.token}"
        conn = self.endpoint.connection(timeout or self.timeout)
        try:
            conn.request(method, self.endpoint.path(route, query), body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as err:
            raise PoolUnavailable(
                f"the GPU pool broker at {self.url} is not reachable ({_reason(err)}); GPUPOOL_URL is set, so the pool "
                "is used only through it: start the broker (or ask your admin), or unset GPUPOOL_URL for a single-user pool"
            ) from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        if response.status >= 400:
            raise self._error(response.status, payload, raw)
        return payload

    def _error(self, status: int, payload: Any, raw: bytes) -> GpuPoolError:
        message = ""
        name = ""
        if isinstance(payload, dict):
            message = str(payload.get("message") or "")
            name = str(payload.get("error") or "")
        if not message:
            message = raw.decode(errors="replace").strip()[:200] or f"HTTP {status}"
        if status == 401:
            if not self.token and not self.endpoint.is_unix:
                message = "no token to show the GPU pool broker: set GPUPOOL_TOKEN or JUPYTERHUB_API_TOKEN"
            return NotAuthorized(f"the GPU pool broker refused this request: {message}")
        cls = _ERRORS.get(name) or _BY_STATUS.get(status) or (PoolUnavailable if status >= 500 else GpuPoolError)
        if cls is PoolUnavailable and not name:
            message = f"the GPU pool broker at {self.url} failed: {message}"
        return cls(message)

    # --- what the broker is -----------------------------------------------------------------------
    def info(self, refresh: bool = False) -> dict[str, Any]:
        """Broker version, backend, policy and the caller's identity (``GET /api/gpupool/info``)."""
        now = time.monotonic()
        if refresh or self._info is None or now - self._info[0] > self.cache_seconds * 30:
            self._info = (now, self.call("GET", f"{API}/info"))
        return self._info[1]

    def whoami(self) -> dict[str, Any]:
        """Who the broker thinks the caller is: ``{"name", "groups", "admin", "kind"}``."""
        return dict(self.call("GET", f"{API}/whoami"))

    def check(self) -> RemotePool:
        """Contact the broker now (raises PoolUnavailable / NotAuthorized); returns self."""
        self.info(refresh=True)
        return self

    @property
    def policy(self) -> Any:
        """The broker's :class:`~jupyter_gpupool.core.policy.PoolPolicy` (read-only copy)."""
        if self._policy is None:
            from .core.policy import PoolPolicy

            policy = PoolPolicy()
            for key, value in (self.info().get("policy") or {}).items():
                if policy.has_trait(key) and value is not None:
                    try:
                        setattr(policy, key, value)
                    except Exception:  # noqa: BLE001, S112 - a newer broker may send a value this version rejects
                        continue
            self._policy = policy
        return self._policy

    def devices(self) -> list[Device]:
        now = time.monotonic()
        if self._devices is None or now - self._devices[0] > self.cache_seconds:
            items = self.call("GET", f"{API}/devices")
            self._devices = (now, [_device(item) for item in items])
        return list(self._devices[1])

    def default_memory(self) -> int:
        return int(self.info()["policy"]["default_memory_bytes"])

    def parse_memory(self, text: str | int) -> int:
        largest = max((d.memory_total for d in self.devices()), default=None)
        return parse_size(text, gpu_memory=largest)

    # --- leases -------------------------------------------------------------------------------------
    def request(self, req: LeaseRequest, now: float | None = None) -> Lease:
        body = {
            "memory": req.memory,
            "num_gpus": req.num_gpus,
            "compute_share": req.compute_share,
            "model": req.model,
            "priority": req.priority.value if req.priority is not None else None,  # None: the configured class
            "duration": req.duration,
            "kernel_id": req.kernel_id,
            "holder_pid": req.holder_pid,
            "holder_host": req.holder_host,
            "label": req.label,
        }
        return _lease(self.call("POST", f"{API}/leases", body))

    def get(self, lease_id: str) -> Lease:
        return _lease(self.call("GET", f"{API}/leases/{_q(lease_id)}"))

    def _kernel_leases(self, kernel_id: str) -> list[Lease]:
        items = self.call("GET", f"{API}/leases", query={"kernel_id": kernel_id, "released": 1})
        return [_lease(item) for item in items]

    def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        return next((lease for lease in self._kernel_leases(kernel_id) if lease.live), None)

    def last_lease_for_kernel(self, kernel_id: str) -> Lease | None:
        leases = self._kernel_leases(kernel_id)
        return leases[0] if leases else None

    def leases(self, owner: str | None = None, include_released: bool = False) -> list[Lease]:
        """Your leases; an admin's call without ``owner`` lists everyone's."""
        query = {"owner": owner, "all": 1 if owner is None else None, "released": 1 if include_released else None}
        return [_lease(item) for item in self.call("GET", f"{API}/leases", query=query)]

    def queue(self, now: float | None = None) -> list[Lease]:
        return [_lease(item) for item in self.call("GET", f"{API}/queue")]

    def queue_info(self, lease_id: str, now: float | None = None) -> QueueInfo | None:
        data = self.call("GET", f"{API}/leases/{_q(lease_id)}")
        return _queue(data.get("queue"))

    def release(self, lease_id: str, reason: str = "released by user", now: float | None = None) -> Lease:
        return _lease(self.call("DELETE", f"{API}/leases/{_q(lease_id)}", query={"reason": reason}))

    def set_priority(self, lease_id: str, priority: str, now: float | None = None) -> Lease:
        """Admins: re-prioritise a lease (``batch``, ``normal``, ``high``)."""
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/priority", {"priority": priority}))

    def resize(
        self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None
    ) -> Lease:
        return _lease(
            self.call("POST", f"{API}/leases/{_q(lease_id)}/resize", {"memory": memory, "duration": duration})
        )

    def keep(self, lease_id: str, seconds: float, now: float | None = None) -> Lease:
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/keepalive", {"duration": seconds}))

    def report_activity(self, lease_id: str, activity: Activity, now: float | None = None) -> None:
        self.call("POST", f"{API}/leases/{_q(lease_id)}/activity", _activity(activity))

    def report_activities(self, activities: dict[str, Activity], now: float | None = None) -> None:
        if activities:
            self.call("POST", f"{API}/activity", {"activities": {k: _activity(v) for k, v in activities.items()}})

    def heartbeat(self, lease_ids: list[str], now: float | None = None) -> None:
        if lease_ids:
            self.call("POST", f"{API}/heartbeat", {"lease_ids": list(lease_ids)})

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]:
        """No-op: in multi-user mode the broker's watchdog measures every process on the host."""
        return []

    def tick(self, now: float | None = None) -> list[Decision]:
        return [_decision(item) for item in self.call("POST", f"{API}/tick", {})]

    def reconcile_kernels(
        self, holder_host: str, holder_pid: int, live_kernel_ids: set[str], now: float | None = None
    ) -> list[Lease]:
        body = {"holder_host": holder_host, "holder_pid": holder_pid, "live_kernel_ids": sorted(live_kernel_ids)}
        return [_lease(item) for item in self.call("POST", f"{API}/reconcile", body)]

    # --- waiting ------------------------------------------------------------------------------------
    def _wait_once(self, lease_id: str, position: int | None, seconds: float) -> tuple[Lease, QueueInfo | None]:
        query = {"timeout": f"{seconds:.3f}", "position": position}
        data = self.call("GET", f"{API}/leases/{_q(lease_id)}/wait", query=query, timeout=seconds + self.timeout)
        return _lease(data), _queue(data.get("queue"))

    def _wait_step(self, lease_id: str, position: int | None, deadline: float | None) -> tuple[Lease, QueueInfo | None]:
        chunk = self.wait_chunk if deadline is None else max(0.0, min(self.wait_chunk, deadline - time.monotonic()))
        lease, info = self._wait_once(lease_id, position, chunk)
        if lease.state is LeaseState.RELEASED:
            raise RequestRefused(f"the request was {lease.release_reason or 'released'} before it was granted")
        return lease, info

    def wait_for_grant(
        self,
        lease_id: str,
        timeout: float | None = None,
        poll: float = 0.5,
        on_update: Callable[[Lease, QueueInfo | None], None] | None = None,
    ) -> Lease:
        """Block until granted (long-polling the broker, which heartbeats the request meanwhile)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        position: int | None = None
        while True:
            lease, info = self._wait_step(lease_id, position, deadline)
            if lease.state is LeaseState.GRANTED:
                return lease
            position = info.position if info else None
            if on_update is not None:
                on_update(lease, info)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"still queued after {timeout:.0f} s (position {position or '?'})")

    async def await_grant(
        self,
        lease_id: str,
        timeout: float | None = None,
        poll: float = 0.5,
        on_update: Callable[[Lease, QueueInfo | None], None] | None = None,
    ) -> Lease:
        """Async twin of :meth:`wait_for_grant`: each long poll runs in a thread."""
        deadline = None if timeout is None else time.monotonic() + timeout
        position: int | None = None
        while True:
            lease, info = await asyncio.to_thread(self._wait_step, lease_id, position, deadline)
            if lease.state is LeaseState.GRANTED:
                return lease
            position = info.position if info else None
            if on_update is not None:
                on_update(lease, info)
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"still queued after {timeout:.0f} s (position {position or '?'})")

    # --- views, metering, reservations, preferences --------------------------------------------
    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """The pool as the broker lets the caller see it (admins see every user)."""
        data = self.call("GET", f"{API}/pool")
        return PoolSnapshot(
            devices=data["devices"],
            leases=data["leases"],
            queue=data["queue"],
            now=data["now"],
            quota=data.get("quota") or {},
        )

    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        from .pool import Pool

        return Pool.view_lease(lease, viewer, admin, position)

    def report(
        self, since: float | None = None, until: float | None = None, by: str = "user", now: float | None = None, period: str = "none"
    ) -> list[dict[str, Any]]:
        return list(self.call("GET", f"{API}/report", query={"since": since, "until": until, "by": by, "period": period}))

    def reservations(self) -> list[Any]:
        return [_reservation(item) for item in self.call("GET", f"{API}/reservations")]

    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Any:
        """Admins only (403 otherwise)."""
        return _reservation(self.call("POST", f"{API}/reservations", spec))

    def cancel_reservation(self, name: str) -> None:
        self.call("DELETE", f"{API}/reservations/{_q(name)}")

    def preference(self, owner: str | None = None) -> dict[str, Any]:
        """The caller's saved preferences (``owner`` is decided by the broker)."""
        return dict(self.call("GET", f"{API}/preferences") or {})

    def set_preference(self, owner: str | None = None, **values: Any) -> None:
        self.call("PATCH", f"{API}/preferences", values)

    def events(self, after_seq: int = 0) -> list[dict[str, Any]]:
        return list(self.call("GET", f"{API}/events", query={"after": after_seq}))

    def client_env(self) -> dict[str, str]:
        """Variables a kernel needs to reach the same broker (its token comes from the server's env)."""
        return {"GPUPOOL_URL": self.url}

    def close(self) -> None:
        """Nothing to close: every call opens and closes its own connection."""


# --- JSON → models ----------------------------------------------------------------------------------
def _q(text: str) -> str:
    return urllib.parse.quote(str(text), safe="")


def _reason(err: BaseException) -> str:
    if isinstance(err, FileNotFoundError):
        return "no socket at that path"
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, socket.timeout):
        return "timed out"
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def _lease(data: Mapping[str, Any]) -> Lease:
    from .store import lease_from_json

    return lease_from_json(dict(data))


def _queue(data: Mapping[str, Any] | None) -> QueueInfo | None:
    if not data:
        return None
    return QueueInfo(
        position=int(data["position"]),
        length=int(data["length"]),
        estimated_wait=data.get("estimated_wait"),
        reason=data.get("reason") or "",
    )


def _device(data: Mapping[str, Any]) -> Device:
    known = Device.__dataclass_fields__
    values = {k: v for k, v in data.items() if k in known}
    values["nvlink_peers"] = frozenset(values.get("nvlink_peers") or ())
    return Device(**values)


def _decision(data: Mapping[str, Any]) -> Decision:
    known = Decision.__dataclass_fields__
    values = {k: v for k, v in data.items() if k in known}
    values["kind"] = DecisionKind(values["kind"])
    return Decision(**values)


def _reservation(data: Mapping[str, Any]) -> Any:
    """A :class:`~jupyter_gpupool.core.policy.Reservation` from its ``to_json()`` form."""
    from .core.policy import WEEKDAYS, Reservation

    return Reservation(
        name=str(data["name"]),
        memory=int(data["memory"]),
        users=tuple(data.get("users") or ()),
        groups=tuple(data.get("groups") or ()),
        start=data.get("start"),
        end=data.get("end"),
        weekdays=tuple(WEEKDAYS.index(d) for d in data.get("weekdays") or ()),
        daily_start=str(data.get("daily_start") or ""),
        daily_end=str(data.get("daily_end") or ""),
    )


def _activity(activity: Activity) -> dict[str, Any]:
    return {"busy": activity.busy, "last_activity": activity.last_activity, "connections": activity.connections}


def pool_from_env(config: Any = None, environ: Mapping[str, str] | None = None, check: bool = False) -> Any:
    """:class:`RemotePool` when ``GPUPOOL_URL`` is set, else :meth:`Pool.from_env`. No fallback:
    with ``GPUPOOL_URL`` set, an unreachable broker raises PoolUnavailable (at once with ``check``,
    else on first use)."""
    env = os.environ if environ is None else environ
    if (env.get("GPUPOOL_URL") or "").strip():
        remote = RemotePool.from_env(env)
        return remote.check() if check else remote
    from .pool import Pool

    return Pool.from_env(config=config, environ=dict(env))


__all__ = ["URL_FORMS", "RemoteBackend", "RemotePool", "pool_from_env"]
