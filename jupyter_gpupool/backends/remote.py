"""The pool contract over HTTP(S) or a Unix socket: how servers and kernels use a broker.

On a multi-user host the pool belongs to the broker (``jupyter gpupool broker``). Setting
``GPUPOOL_URL`` switches every client to it; :func:`~jupyter_gpupool.backends.factory.pool_from_env` returns a :class:`RemotePool`
then, and a plain :class:`~jupyter_gpupool.backends.local.pool.Pool` over ``GPUPOOL_DB`` otherwise. It never
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

Outages: a call that finds the broker unreachable (or a proxy answering 502/503/504) is retried a
few times with exponential backoff when repeating it is harmless; a lease request is harmless to
repeat when it names its kernel (the broker answers a kernel's live lease instead of queueing a
second). A wait for a grant rides out a longer outage (a restart of the broker): it keeps retrying
with backoff, for up to :attr:`RemotePool.outage_limit` seconds, and tells its ``on_update``
listener "pool unavailable, retrying" meanwhile. :meth:`RemotePool.availability` says whether the
broker answered the last call, since when not, and when the next try is.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jupyter_gpupool.backends.broker_devices import RemoteBackend
from jupyter_gpupool.backends.contract import Capability
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.local.store import lease_from_json
from jupyter_gpupool.backends.waiting import GrantWaiting
from jupyter_gpupool.core.models import (
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
from jupyter_gpupool.core.policy import WEEKDAYS, PoolPolicy, Reservation
from jupyter_gpupool.errors import (
    GpuPoolError,
    InvalidInput,
    LeaseNotFound,
    NotAuthorized,
    PoolUnavailable,
    RequestRefused,
    TooManyWaits,
)
from jupyter_gpupool.units import format_duration, parse_duration, parse_size

log = logging.getLogger(__name__)

URL_FORMS = "http://HOST:PORT[/PREFIX], https://HOST[:PORT][/PREFIX] or unix:///PATH/TO/SOCKET"
API = "api/gpupool"

_ERRORS: dict[str, type[GpuPoolError]] = {
    cls.__name__: cls
    for cls in (GpuPoolError, InvalidInput, RequestRefused, LeaseNotFound, NotAuthorized, PoolUnavailable, TooManyWaits)
}
_BY_STATUS: dict[int, type[GpuPoolError]] = {
    400: InvalidInput,
    401: NotAuthorized,
    403: NotAuthorized,
    404: LeaseNotFound,
    409: RequestRefused,
    429: TooManyWaits,
}
#: Answers of a proxy (JupyterHub's) in front of a broker that is down or restarting.
_GATEWAY_DOWN = (502, 503, 504)


class BrokerUnreachable(PoolUnavailable):
    """The broker did not answer. ``request_sent``: the request may have reached it (the connection
    dropped after sending), so repeating a request that is not idempotent could do it twice."""

    def __init__(self, message: str, request_sent: bool) -> None:
        super().__init__(message)
        self.request_sent = request_sent


@dataclass
class Outage:
    """The broker cannot be reached: since when (POSIX seconds), why, and when the next try is."""

    since: float
    reason: str
    attempts: int = 1
    retry_at: float | None = None  # None: nobody is retrying right now

    @property
    def message(self) -> str:
        if self.retry_at is None:
            return f"pool unavailable: {self.reason}"
        wait = max(0.0, self.retry_at - time.time())
        return f"pool unavailable, retrying in {wait:.0f} s: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {
            "state": "unavailable",
            "reason": self.reason,
            "message": self.message,
            "since": self.since,
            "attempts": self.attempts,
            "retrying": self.retry_at is not None,
            "retry_at": self.retry_at,
        }


class _Backoff:
    """Exponential backoff with jitter over one outage; gives up after ``limit`` seconds of it."""

    def __init__(self, pool: RemotePool, limit: float | None, deadline: float | None = None) -> None:
        self.pool = pool
        self.limit = limit
        self.deadline = deadline  # time.monotonic() of the caller's own timeout
        self.started: float | None = None
        self.attempts = 0

    def delay(self, err: PoolUnavailable) -> float:
        """Seconds to sleep before the next try; re-raises ``err`` once the outage outlasts ``limit``."""
        now = time.monotonic()
        if self.started is None:
            self.started = now
        down_for = now - self.started
        if self.limit is not None and down_for >= self.limit:
            self.pool._mark_down(err, None)
            raise PoolUnavailable(f"{err} (still unreachable after retrying for {format_duration(down_for)})") from None
        delay = min(self.pool.retry_cap(), self.pool.retry_initial * 2**self.attempts) * random.uniform(0.8, 1.2)
        if self.limit is not None:
            delay = min(delay, self.limit - down_for)
        if self.deadline is not None:
            delay = min(delay, max(0.0, self.deadline - now))
        self.attempts += 1
        self.pool._mark_down(err, max(0.0, delay))
        return max(0.0, delay)

    def reset(self) -> None:
        self.started = None
        self.attempts = 0


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


class RemotePool(GrantWaiting):
    """The ``broker`` :class:`~jupyter_gpupool.backends.contract.PoolBackend`: the contract, served by a broker."""

    kind = "broker"
    capabilities = frozenset({Capability.SUSPEND, Capability.GROW, Capability.CLIENT_ENV, Capability.WHOAMI})

    #: Adapters may check this to skip work the broker does itself (watchdog, scheduler loop).
    remote = True
    #: Seconds a device list or policy read from the broker is reused.
    cache_seconds = 2.0
    #: Longest single long-poll while waiting for a grant (the broker caps it too).
    wait_chunk = 10.0
    #: Extra tries of a call that is harmless to repeat when the broker is unreachable (the sync
    #: calls block their caller meanwhile, so this stays short: 0.25 s + 0.5 s).
    call_retries = 2
    #: First backoff delay in seconds; it doubles with each try up to :attr:`retry_max`.
    retry_initial = 0.25
    #: Longest backoff delay in seconds (see :meth:`retry_cap`).
    retry_max = 5.0
    #: Seconds a wait for a grant keeps retrying through an outage of the broker before it gives up
    #: (``GPUPOOL_RETRY_FOR``, e.g. ``15m``); a broker restarted by JupyterHub or systemd is back long before.
    outage_limit = 900.0
    #: The way out an unreachable broker's message offers besides starting it (one that this host's
    #: discovery file named says that file: see :func:`~jupyter_gpupool.backends.discovery.broker_pool`).
    unreachable_hint = "or unset GPUPOOL_URL to use a pool of your own"

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
        #: Set while the broker cannot be reached (the last call failed); None once a call got an answer.
        self.outage: Outage | None = None
        #: lease id → the step (suspending, restoring, migrating) of a transition report not answered.
        self._unanswered_steps: dict[str, str] = {}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RemotePool:
        """From ``GPUPOOL_URL`` and ``GPUPOOL_TOKEN`` / ``JUPYTERHUB_API_TOKEN``."""
        env = os.environ if environ is None else environ
        url = (env.get("GPUPOOL_URL") or "").strip()
        if not url:
            raise InvalidInput(f"GPUPOOL_URL is not set; set it to the broker's address ({URL_FORMS})")
        token = env.get("GPUPOOL_TOKEN") or env.get("JUPYTERHUB_API_TOKEN") or None
        try:
            timeout = float(env.get("GPUPOOL_TIMEOUT") or 30.0)
        except ValueError:
            raise InvalidInput(f"GPUPOOL_TIMEOUT={env.get('GPUPOOL_TIMEOUT')!r} is not seconds, e.g. 30") from None
        pool = cls(url, token=token, timeout=timeout)
        retry_for = (env.get("GPUPOOL_RETRY_FOR") or "").strip()
        if retry_for:
            try:
                pool.outage_limit = parse_duration(retry_for)
            except InvalidInput as err:
                raise InvalidInput(f"GPUPOOL_RETRY_FOR: {err}") from None
        return pool

    # --- availability -----------------------------------------------------------------------------
    def availability(self) -> dict[str, Any]:
        """Whether the broker answered the last call: ``{"state": "available"}``, or while it cannot be
        reached ``{"state": "unavailable", "reason", "message", "since", "attempts", "retrying", "retry_at"}``
        (``message`` reads "pool unavailable, retrying in 4 s: ..." while a wait retries)."""
        outage = self.outage
        return {"state": "available"} if outage is None else outage.to_json()

    def retry_cap(self) -> float:
        """Longest backoff delay: :attr:`retry_max`, but short enough that a waiter's first try after
        the broker is back comes well within its heartbeat TTL (a third of it, if the policy is known)."""
        info = self._info[1] if self._info is not None else {}
        try:
            ttl = float((info.get("policy") or {}).get("heartbeat_ttl") or 0)
        except (TypeError, ValueError):
            ttl = 0.0
        return min(self.retry_max, max(self.retry_initial, ttl / 3)) if ttl > 0 else self.retry_max

    def _mark_down(self, err: BaseException, retry_in: float | None) -> None:
        previous = self.outage
        now = time.time()
        self.outage = Outage(
            since=previous.since if previous is not None else now,
            reason=str(err),
            attempts=(previous.attempts + 1) if previous is not None else 1,
            retry_at=None if retry_in is None else now + retry_in,
        )

    def _mark_up(self) -> None:
        self.outage = None

    # --- transport ------------------------------------------------------------------------------
    def call(
        self,
        method: str,
        route: str,
        body: Any = None,
        query: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        idempotent: bool = True,
        retries: int | None = None,
    ) -> Any:
        """One request to the broker; the JSON answer, or the domain error it stands for.

        While the broker is unreachable the request is tried ``retries`` (default :attr:`call_retries`)
        more times with backoff: any request whose connection failed (it never reached the broker),
        and an ``idempotent`` one (harmless to repeat) also when the connection dropped after sending.
        """
        backoff = _Backoff(self, limit=None)
        left = self.call_retries if retries is None else retries
        while True:
            try:
                result = self._call_once(method, route, body, query, timeout)
            except PoolUnavailable as err:
                may_repeat = idempotent or not getattr(err, "request_sent", True)
                if left <= 0 or not may_repeat:
                    self._mark_down(err, None)
                    raise
                left -= 1
                time.sleep(backoff.delay(err))
                continue
            except GpuPoolError:
                self._mark_up()  # the broker answered (with a refusal): it is reachable
                raise
            self._mark_up()
            return result

    def _call_once(
        self, method: str, route: str, body: Any, query: Mapping[str, Any] | None, timeout: float | None
    ) -> Any:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.token and not self.endpoint.is_unix:
            headers["Authorization"] = f"token {self.token}"
        conn = self.endpoint.connection(timeout or self.timeout)
        sent = False
        try:
            conn.connect()
            sent = True
            conn.request(method, self.endpoint.path(route, query), body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        except (OSError, http.client.HTTPException) as err:
            if not sent:
                raise BrokerUnreachable(
                    f"the GPU pool broker at {self.url} is not reachable ({_reason(err)}); start the broker "
                    f"(or ask your admin), {self.unreachable_hint}",
                    request_sent=False,
                ) from None
            raise BrokerUnreachable(
                f"the GPU pool broker at {self.url} did not answer ({_reason(err)}); it may be restarting",
                request_sent=True,
            ) from None
        finally:
            conn.close()
        try:
            payload = json.loads(raw) if raw else None
        except ValueError:
            payload = None
        if response.status >= 400:
            error = self._error(response.status, payload, raw)
            if response.status in _GATEWAY_DOWN and isinstance(error, PoolUnavailable):
                raise BrokerUnreachable(str(error), request_sent=True)
            raise error
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
            "suspendable": req.suspendable,
            "limit": req.burst_limit,  # None: the broker's burst policy; 0: a fixed slice
        }
        # Naming its kernel makes the request idempotent: the broker answers the kernel's live lease
        # if an earlier try was committed but its answer lost. Without a kernel it is repeated only
        # when it never reached the broker.
        try:
            return _lease(self.call("POST", f"{API}/leases", body, idempotent=bool(req.kernel_id)))
        except BrokerUnreachable as err:
            if err.request_sent and not req.kernel_id:
                raise BrokerUnreachable(
                    f"{err}; the request may have been queued before the connection dropped: look with "
                    "`jupyter gpupool leases` before asking again",
                    request_sent=True,
                ) from None
            raise

    def get(self, lease_id: str) -> Lease:
        return _lease(self.call("GET", f"{API}/leases/{_q(lease_id)}"))

    def _kernel_leases(self, kernel_id: str) -> list[Lease]:
        """The kernel's leases, newest first: any owner's for a broker admin (so an admin's server can
        act on another user's kernel, as the docs promise), the caller's own for everyone else (the
        broker ignores ``all`` from non-admins)."""
        items = self.call("GET", f"{API}/leases", query={"kernel_id": kernel_id, "released": 1, "all": 1})
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

    # --- suspend, resume and the server's confirmations ---------------------------------------------
    def suspend(self, lease_id: str, reason: str = "suspended by its user", now: float | None = None) -> Lease:
        """Ask for this lease's GPU memory to be parked in host RAM; its server carries it out and
        confirms. Raises :class:`RequestRefused` saying why when it cannot be suspended."""
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/suspend", {"reason": reason}))

    def resume(self, lease_id: str, now: float | None = None, ahead: bool = False) -> Lease:
        """Queue a suspended lease to come back (harmless if already resuming or running); ``ahead``:
        before a cell needs it, behind every real request."""
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/resume", {"ahead": True} if ahead else {}))

    def confirm_transition(self, lease_id: str, parked_bytes: int | None = None, now: float | None = None) -> Lease:
        """The holder's server finished a suspend (``parked_bytes`` in host RAM), restore or move.

        It names the step it finishes (read from the lease first), so a retry after a lost answer
        finds it done and gets the lease back instead of an error, and a late report never finishes
        a later step. Raises :class:`InvalidInput` when nothing is under way (as the local pool does)."""
        body: dict[str, Any] = {"outcome": "done"}
        if parked_bytes is not None:
            body["parked_bytes"] = int(parked_bytes)
        return self._finish_transition(lease_id, body)

    def fail_transition(self, lease_id: str, error: str, still_running: bool, now: float | None = None) -> Lease:
        """The holder's server could not finish a suspend, restore or move (``error``: why, one line);
        returns the lease as it is now (released if the kernel must stop)."""
        line = " ".join(str(error).split())[:500] or "unknown error"
        return self._finish_transition(
            lease_id, {"outcome": "failed", "error": line, "still_running": bool(still_running)}
        )

    def _finish_transition(self, lease_id: str, body: dict[str, Any]) -> Lease:
        """POST ``.../transition`` naming the step under way. A report whose answer never came (the
        broker was unreachable) is remembered, and its next try names the same step whatever the lease
        shows now: the broker answers the lease if that step was done, and refuses (409) if another
        step is under way by then, so a late report can never finish a later suspend (which would
        free GPU memory still in use)."""
        step = self._unanswered_steps.get(lease_id) or self.get(lease_id).transition.value
        if not step:
            raise InvalidInput(f"lease {lease_id} is not being suspended, restored or moved")
        self._unanswered_steps[lease_id] = step
        try:
            result = _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/transition", {**body, "transition": step}))
        except PoolUnavailable:
            raise  # no answer: remembered for the next try
        except GpuPoolError:
            self._unanswered_steps.pop(lease_id, None)
            raise
        self._unanswered_steps.pop(lease_id, None)
        return result

    def resize(
        self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None,
        limit: int | None = None,
    ) -> Lease:
        """As :meth:`Pool.resize <jupyter_gpupool.backends.local.pool.Pool.resize>`, decided by the broker."""
        body: dict[str, Any] = {"memory": memory, "duration": duration}
        if limit is not None:
            body["limit"] = int(limit)
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/resize", body))

    def grow(self, lease_id: str, needed: int, now: float | None = None) -> Lease:
        """Grow an elastic slice so its kernel can hold ``needed`` bytes (all its GPUs); the broker
        decides (RequestRefused saying why not). Safe to repeat: a slice that large already stays."""
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/grow", {"needed": int(needed)}))

    def reserve_pinned_backup(self, lease_id: str, amount: int, now: float | None = None) -> Lease:
        """Set aside ``amount`` bytes of the host's pinned parking pool for the lease's framework
        backup; the broker keeps the books (RequestRefused saying why when there is no room)."""
        return _lease(self.call("POST", f"{API}/leases/{_q(lease_id)}/pinned-backup", {"bytes": int(amount)}))

    def grow_place(self, lease_id: str, now: float | None = None) -> int | None:
        """As :meth:`Pool.grow_place <jupyter_gpupool.backends.local.pool.Pool.grow_place>`, from the broker's view of the lease."""
        place = self.call("GET", f"{API}/leases/{_q(lease_id)}").get("grow_place")
        return int(place) if place is not None else None

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
        """No-op, and on purpose: a server's figures are its user's word. The broker's own watchdog
        measures every process on its host (NVML, set against the leases), and only that decides
        when a slice grows or when the burst it gave back may go to someone else."""
        return []

    def tick(self, now: float | None = None, activities: dict[str, Activity] | None = None) -> list[Decision]:
        """The broker's scheduler run, after reporting ``activities`` (as :meth:`Pool.tick`)."""
        if activities:
            self.report_activities(activities, now)
        return [_decision(item) for item in self.call("POST", f"{API}/tick", {})]

    def reconcile_kernels(
        self, holder_host: str, holder_pid: int, live_kernel_ids: set[str], now: float | None = None
    ) -> list[Lease]:
        body = {"holder_host": holder_host, "holder_pid": holder_pid, "live_kernel_ids": sorted(live_kernel_ids)}
        return [_lease(item) for item in self.call("POST", f"{API}/reconcile", body)]

    # --- hearing of changes ---------------------------------------------------------------------
    def wait_for_change(self, since: int | None, timeout: float) -> int:
        """Long-poll the broker (``GET .../changes``) until its pool changed after version ``since``
        or ``timeout`` seconds passed (cut into polls of at most :attr:`wait_chunk`); the version now."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            chunk = max(0.0, min(self.wait_chunk, deadline - time.monotonic()))
            query = {"timeout": f"{chunk:.3f}"} if since is None else {"since": since, "timeout": f"{chunk:.3f}"}
            data = self.call("GET", f"{API}/changes", query=query, timeout=chunk + self.timeout, retries=0)
            version = int((data or {}).get("version", 0))
            if since is None or version != since or time.monotonic() >= deadline:
                return version

    def subscribe_changes(self, listener: Callable[[], None]) -> Callable[[], None]:
        """Call ``listener()`` after every change of the broker's pool, from a thread that long-polls
        it (riding out an outage with backoff); returns the function that stops it."""
        stopped = threading.Event()

        def follow() -> None:
            since: int | None = None
            reconnected = False  # the broker did not answer: what it decided meanwhile is unknown
            backoff = _Backoff(self, limit=None)
            while not stopped.is_set():
                try:
                    version = self.wait_for_change(since, self.wait_chunk)
                except PoolUnavailable as err:
                    since, reconnected = None, True  # the broker may have restarted: its versions start again
                    stopped.wait(backoff.delay(err))
                    listener()  # look again once it answers: a decision may have been missed
                    continue
                except Exception:  # noqa: BLE001 -- a refusal (e.g. an old broker): look now and then instead
                    stopped.wait(self.wait_chunk)
                    listener()
                    continue
                backoff.reset()
                # Look once more on the first answer after an outage: a decision taken between the
                # last look and this answer is in ``version`` already, so no later change reveals it.
                if (reconnected or (since is not None and version != since)) and not stopped.is_set():
                    listener()
                since, reconnected = version, False

        threading.Thread(target=follow, name="gpupool-broker-changes", daemon=True).start()
        return stopped.set

    # --- waiting ------------------------------------------------------------------------------------
    def _wait_once(self, lease_id: str, position: int | None, seconds: float) -> tuple[Lease, QueueInfo | None]:
        query = {"timeout": f"{seconds:.3f}", "position": position}
        # No retries here: the wait loops below ride out outages with their own, longer backoff.
        data = self.call(
            "GET", f"{API}/leases/{_q(lease_id)}/wait", query=query, timeout=seconds + self.timeout, retries=0
        )
        return _lease(data), _queue(data.get("queue"))

    def _outage_update(
        self,
        last: tuple[Lease, QueueInfo | None] | None,
        on_update: Callable[[Lease, QueueInfo | None], None] | None,
    ) -> None:
        """Tell the waiter "pool unavailable, retrying ..." with its last known place in the queue."""
        if on_update is None or last is None or self.outage is None:
            return
        lease, info = last
        reason = self.outage.message
        place = info if info is not None else QueueInfo(position=0, length=0, estimated_wait=None, reason="")
        on_update(lease, QueueInfo(position=place.position, length=place.length, estimated_wait=None, reason=reason))

    def _wait_step(self, lease_id: str, position: int | None, deadline: float | None) -> tuple[Lease, QueueInfo | None]:
        chunk = self.wait_chunk if deadline is None else max(0.0, min(self.wait_chunk, deadline - time.monotonic()))
        lease, info = self._wait_once(lease_id, position, chunk)
        if lease.state is LeaseState.RELEASED:
            raise RequestRefused(
                f"the request was {lease.release_reason or 'released'} before it was granted" if lease.granted_at is None
                else f"its GPU slice was {lease.release_reason or 'released'} after it was granted, before the kernel started"
            )
        return lease, info

    # GrantWaiting: a look is one long poll (the broker heartbeats the request meanwhile); an outage
    # of the broker is ridden out with backoff for up to ``outage_limit`` seconds, and the waiter
    # hears "pool unavailable, retrying ..." with its last known place in the queue.
    def _look_at_request(self, lease_id: str, last: QueueInfo | None, deadline: float | None) -> tuple[Lease, QueueInfo | None]:
        return self._wait_step(lease_id, last.position if last else None, deadline)

    def _pause_between_looks(self, poll: float) -> float:
        return 0.0

    def _outage_state(self, lease_id: str, deadline: float | None, poll: float) -> _Backoff:
        return _Backoff(self, self.outage_limit, deadline)

    def _on_outage(
        self,
        err: PoolUnavailable,
        outage: Any,
        last: tuple[Lease, QueueInfo | None] | None,
        on_update: Callable[[Lease, QueueInfo | None], None] | None,
        deadline: float | None,
    ) -> float:
        delay = outage.delay(err)
        self._outage_update(last, on_update)
        return delay

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
            reservations=list(data.get("reservations") or []),
            unpooled=list(data.get("unpooled") or []),
        )

    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        return Pool.view_lease(lease, viewer, admin, position)

    def report(
        self, since: float | None = None, until: float | None = None, by: str = "user", now: float | None = None, period: str = "none"
    ) -> list[dict[str, Any]]:
        return list(self.call("GET", f"{API}/report", query={"since": since, "until": until, "by": by, "period": period}))

    def reservations(self) -> list[Any]:
        return [_reservation(item) for item in self.call("GET", f"{API}/reservations")]

    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Any:
        """Admins only (403 otherwise)."""
        return _reservation(self.call("POST", f"{API}/reservations", spec, idempotent=False))

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


def remote_suspend(pool: RemotePool, lease_id: str, reason: str) -> Lease:
    """``POST .../leases/{id}/suspend``: the broker begins a suspend (409 with its reason when refused)."""
    return _lease(pool.call("POST", f"{API}/leases/{_q(lease_id)}/suspend", {"reason": reason}, idempotent=False))


def remote_resume(pool: RemotePool, lease_id: str) -> Lease:
    """``POST .../leases/{id}/resume``: queue a suspended lease to come back (harmless to repeat)."""
    return _lease(pool.call("POST", f"{API}/leases/{_q(lease_id)}/resume", {}))


__all__ = ["URL_FORMS", "BrokerUnreachable", "Outage", "RemoteBackend", "RemotePool", "remote_resume", "remote_suspend"]
