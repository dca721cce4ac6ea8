"""``jupyter gpupool broker``: one pool for every Jupyter server on the host.

On a multi-user host (The Littlest JupyterHub, a lab server) each user runs their own Jupyter
server, so a pool inside one server cannot be shared. The broker owns the pool's store, runs the
scheduler and the watchdog for the whole host, and serves the pool over HTTP:

- as a JupyterHub managed service (``c.JupyterHub.services``): callers are identified by their
  hub token, groups come from the hub, ``custom:gpupool:admin`` makes an admin;
- on a Unix socket (``--socket``, e.g. under systemd): callers are identified by the uid of the
  connecting process (``SO_PEERCRED``).

Servers and kernels use it when ``GPUPOOL_URL`` points at it (see :mod:`jupyter_gpupool.backends.remote`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import urllib.parse
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tornado import netutil, web
from traitlets import Bool, Float, Integer, Unicode
from traitlets.config import LoggingConfigurable

from jupyter_gpupool._version import __version__
from jupyter_gpupool.application import GpuPoolBaseApp
from jupyter_gpupool.backends.discovery import listen_urls, write_discovery
from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.broker.auth import Forbidden, HubIdentity, Identity, PeerCredIdentity, Unauthenticated, unix_peer
from jupyter_gpupool.broker.caller_views import CallerViewVersions
from jupyter_gpupool.broker.handlers import NotFoundHandler, lease_json, parse_priority
from jupyter_gpupool.broker.interface import BrokerInterface
from jupyter_gpupool.broker.limits import (
    ConnectionBook,
    LimitedHTTPServer,
    RateLimitedLog,
    Throttle,
    raise_descriptor_limit,
)
from jupyter_gpupool.broker.open_waits import OpenWaits
from jupyter_gpupool.broker.routes import routes
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.validate import MAX_BODY_BYTES
from jupyter_gpupool.enforcement.claims import UnixUsers, check_kernel_claim
from jupyter_gpupool.enforcement.device_control import DeviceControl
from jupyter_gpupool.enforcement.device_control_role import DeviceControlService
from jupyter_gpupool.enforcement.plan import EnforcementSettings
from jupyter_gpupool.enforcement.unpooled import find_kernel_roots, terminate_tree
from jupyter_gpupool.enforcement.watchdog import Watchdog
from jupyter_gpupool.errors import InvalidInput, NotAuthorized, RequestRefused
from jupyter_gpupool.rest.anonymous import device_control_view
from jupyter_gpupool.rest.metrics import PoolCollector, make_registry, render
from jupyter_gpupool.rest.views import kernel_status
from jupyter_gpupool.units import parse_duration
from jupyter_gpupool.wording import count

#: Policy traits a client may read (``GET /api/gpupool/info``).
PUBLIC_POLICY = (
    "default_memory",
    "idle_timeout",
    "idle_policy",
    "warning_period",
    "max_keep",
    "heartbeat_ttl",
    "placement",
    "preemption",
    "grace_period",
    "min_runtime",
)


#: Connections the kernel queues before the broker accepts them (tornado's default is 128; the
#: kernel caps it at net.core.somaxconn). A burst of connections, an attacker's or a hub's servers
#: starting at once, then waits a moment in the queue instead of having its new connections'
#: SYNs dropped, which a client retries only a second later (every victim request then took 1 s).
LISTEN_BACKLOG = socket.SOMAXCONN

class Broker(LoggingConfigurable):
    """The pool served to many users: identity, authorization helpers, scheduler and watchdog loops."""

    tick_interval = Float(
        1.0,
        help="Seconds between two scheduler runs (grants after time passes, idle reclaims, expiry of dead holders).",
    ).tag(config=True)
    wait_poll = Float(
        0.25,
        help="Seconds between checks while a client long-polls for its grant (GET .../leases/{id}/wait).",
    ).tag(config=True)
    run_watchdog = Bool(
        True,
        help="Run the GPU memory watchdog over every process on the host (the broker should run as root for it "
        "to see and signal every user's kernels).",
    ).tag(config=True)
    lease_env_var = Unicode(
        "GPUPOOL_LEASE_ID",
        help="Environment variable the provisioner sets in each kernel; the watchdog finds a lease's kernel "
        "(and so its process tree) by reading it from /proc/<pid>/environ of GPU processes' ancestors.",
    ).tag(config=True)
    metrics_require_auth = Bool(
        True,
        help="Require a hub token with read:metrics (or the admin scope), or an admin on the socket, for /metrics.",
    ).tag(config=True)
    max_waits_per_user = Integer(
        64,
        help="Long polls (grant waits and change polls) one user may hold open at once; more are answered "
        "429 at once and their clients look again with backoff. A Jupyter server holds one change poll and "
        "one wait per queued kernel. 0: no bound.",
    ).tag(config=True)
    max_connections_per_user = Integer(
        256,
        help="Connections one user may hold open to the broker at once (on the Unix socket: one uid, counted "
        "from the moment it connects; on TCP: once a request on it is identified). More are answered "
        "429 and closed at once. Sized for one user's busiest legitimate use: a standalone Voila or a "
        "grader runs many kernels as one user, each holding a wait (at most max_waits_per_user) besides "
        "short requests. 0: no bound.",
    ).tag(config=True)
    max_unidentified_per_address = Integer(
        256,
        help="TCP connections from one address that have had no request identified yet (under JupyterHub "
        "every user's server may come from the proxy's one address). When an address has this many, a "
        "new one first closes its oldest that has sent no request; if none can be closed it is answered "
        "429. 0: no bound.",
    ).tag(config=True)
    idle_connection_timeout = Float(
        10.0,
        help="Seconds a connection may stay open without sending a request (before its first one and "
        "between two); then it is closed. Long polls are requests and are not cut by it.",
    ).tag(config=True)
    body_timeout = Float(
        10.0, help="Seconds a request's body may take to arrive once its headers did; then the connection is closed."
    ).tag(config=True)
    max_header_size = Integer(
        16 * 1024, help="Bytes a request's line and headers may take; a larger head closes the connection."
    ).tag(config=True)
    released_claim_seconds = Float(
        3600.0,
        min=0.0,
        help="Seconds a released or ended lease keeps its kernel id for its owner, whatever else is known: "
        "another user's lease naming that id is refused meanwhile (and for as long as the lease's holder "
        "process runs on this host). A pool admin clears a stale claim at once with `jupyter gpupool "
        "clear-claim` or DELETE /api/gpupool/claims/{kernel_id}.",
    ).tag(config=True)
    log_interval = Float(
        60.0,
        help="Seconds between two log lines about the same kind of refusal from the same caller, or about "
        "running out of descriptors (the lines left out are counted in the next one).",
    ).tag(config=True)
    refused_reports_allowed = Integer(
        5,
        help="Reports of a finished suspend, restore or move one user may have refused (409) within "
        "refused_reports_window; past it that user's next reports are answered 429 at once, without "
        "work on the broker's shared worker. 0: no bound.",
    ).tag(config=True)
    refused_reports_window = Float(
        10.0,
        help="Seconds over which refused_reports_allowed and refused_reports_budget count a user's refused "
        "reports, and refused_requests_allowed a caller's refused requests.",
    ).tag(config=True)
    refused_requests_allowed = Integer(
        50,
        help="Requests one caller may have refused (400, 401, 403, 404, 413, 429) within refused_reports_window "
        "before each of its next requests waits refused_requests_pause before it is looked at: a loop of "
        "requests refused at once (bodies declared too large) then costs its own caller time instead of "
        "everyone the broker's one event loop. A caller is a uid on the Unix socket and a user on TCP once a "
        "request on the connection was identified; TCP connections not identified yet share their address "
        "(every hub user's server may) and are not slowed. 0: no bound.",
    ).tag(config=True)
    refused_requests_pause = Float(
        1.0, min=0.0, help="Seconds a request of a caller past refused_requests_allowed waits before it is looked at."
    ).tag(config=True)
    refused_reports_budget = Float(
        0.0,
        help="Seconds of the broker's shared worker one user's refused reports may take together within "
        "refused_reports_window; past it that user's next reports are answered 429 after a pause. A report "
        "is judged from one driver read and never waits for the driver, so refused_reports_allowed is "
        "bound enough by default. 0: no bound.",
    ).tag(config=True)

    def __init__(
        self,
        pool: Any,
        hub: HubIdentity | None = None,
        peer: PeerCredIdentity | None = None,
        watchdog: Watchdog | None = None,
        device_control: DeviceControlService | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pool = pool
        self.hub = hub
        self.peer = peer
        self.watchdog = watchdog
        self.device_control = device_control
        if self.watchdog is not None and self.watchdog.act is None:
            self.watchdog.act = self._act
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpupool-broker")
        self.view_versions = CallerViewVersions(pool, self.run)
        self.open_waits = OpenWaits(lambda: self.max_waits_per_user)
        self.connections = ConnectionBook(lambda: self.max_connections_per_user, lambda: self.max_unidentified_per_address)
        self.note = RateLimitedLog(self.log, lambda: self.log_interval)
        self.refused_reports = Throttle(
            lambda: self.refused_reports_allowed, lambda: self.refused_reports_window, lambda: self.refused_reports_budget
        )
        self.refused_requests = Throttle(lambda: self.refused_requests_allowed, lambda: self.refused_reports_window)
        self.enforcement = EnforcementSettings(parent=self).to_config()
        self._roots: dict[str, int] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._registry: Any = None
        self._collector: Any = None

    # --- plumbing ---------------------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        """Run a (blocking, SQLite) pool call on the broker's one worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, lambda: fn(*args))

    def start(self) -> None:
        """Start the scheduler and watchdog loops on the running event loop.

        Before the first scheduler run, every live lease gets a fresh heartbeat: its holder could not
        reach the broker while it was down, and must not lose its slice or queue position for that.
        The worker thread runs jobs in order, so this grace comes before any tick or request.
        """
        self.executor.submit(self.grace_after_restart)
        if self.device_control is not None:  # after the grace: it reads the live leases through the worker
            self.device_control.start()
        self._tasks.append(asyncio.ensure_future(self._loop(self.pool.tick, self.tick_interval, "scheduler")))
        if self.run_watchdog and self.watchdog is not None:
            self._tasks.append(
                asyncio.ensure_future(self._loop(self.watchdog_step, self.watchdog.interval, "watchdog"))
            )

    async def stop(self) -> None:
        if self.device_control is not None:  # its rules stay in place, as after a crash
            await asyncio.get_running_loop().run_in_executor(None, self.device_control.stop)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                continue
            except Exception:
                self.log.exception("gpupool broker: a loop failed while stopping")
        self._tasks.clear()
        self.view_versions.close()
        self.executor.shutdown(wait=True)

    def grace_after_restart(self) -> int:
        """A fresh start for every live lease now (see :meth:`start` and
        :meth:`~jupyter_gpupool.backends.local.pool.Pool.grace_after_outage`); returns how many got one.

        Dead holders are still reclaimed at once (their pid is gone); a holder that is alive but
        was cut off gets a full ``heartbeat_ttl`` to report again, a warning whose deadline passed
        while nobody could see it starts over, and a suspend, restore or move under way gets a full
        ``transition_timeout`` for its server to report it (the server could not while we were down).
        """
        try:
            touched = int(self.pool.grace_after_outage())
            if touched:
                verb = "gets" if touched == 1 else "get"
                self.log.info("gpupool broker: %s from the pool file %s a fresh start", count(touched, "live lease"), verb)
            return touched
        except Exception:  # the scheduler loop reports a broken store on its own
            self.log.exception("gpupool broker: could not refresh the heartbeats of the live leases")
            return 0

    async def _loop(self, step: Any, interval: float, what: str) -> None:
        while True:
            try:
                await self.run(step)
            except asyncio.CancelledError:
                raise
            except Exception:
                self.log.exception("gpupool broker: %s step failed", what)
            await asyncio.sleep(interval)

    # --- identity -----------------------------------------------------------------------------------
    async def identify(self, handler: web.RequestHandler) -> Identity:
        """The caller: the socket peer's uid on a Unix socket, else the hub token's user."""
        peer = unix_peer(handler)
        if peer is not None:
            if self.peer is None:
                raise Forbidden("this broker does not serve its Unix socket")
            return self.peer.identify_peer(*peer)
        if self.hub is None:
            raise Unauthenticated(
                "this broker takes TCP requests only with JupyterHub tokens; connect over its Unix socket"
                if self.peer is not None
                else "this broker takes TCP requests only with JupyterHub tokens and has no hub to check them: "
                "run it as a JupyterHub service, or serve callers on this host with --socket PATH"
            )
        return await self.hub.identify(handler)

    async def authorize_metrics(self, handler: web.RequestHandler) -> None:
        peer = unix_peer(handler)
        if peer is not None:
            identity = await self.identify(handler)
            if self.peer is None or not self.peer.may_read_metrics(identity):
                raise Forbidden("only pool admins and members of PeerCredIdentity.metrics_groups may read /metrics")
            return
        if self.hub is None:
            raise Unauthenticated("/metrics needs a JupyterHub token with read:metrics")
        if not await self.hub.may_read_metrics(handler):
            raise Forbidden("this token may not read /metrics: it needs read:metrics or custom:gpupool:admin")

    def check_owned(self, identity: Identity, lease_ids: Iterable[str]) -> None:
        """403 if any of these leases belongs to someone else (admins may touch all)."""
        if identity.admin:
            return
        ids = list(lease_ids)
        owners = self.pool.lease_owners(ids)  # looked up by id: never a listing that could be cut short
        for lease_id in ids:
            owner = owners.get(lease_id)
            if owner is not None and owner != identity.name:
                raise NotAuthorized(f"lease {lease_id} belongs to another user")

    # --- views ----------------------------------------------------------------------------------------
    def policy_json(self) -> dict[str, Any]:
        policy: PoolPolicy = self.pool.policy
        data = {name: getattr(policy, name) for name in PUBLIC_POLICY}
        data["default_memory_bytes"] = self.pool.default_memory()
        return data

    def info(self, identity: Identity) -> dict[str, Any]:
        backend = self.pool.backend
        about = {"name": backend.name, "spec": getattr(backend, "spec", ""), "describe": backend.describe()}
        # What a user's process would otherwise ask NVML for, which device control denies it.
        for key in ("driver_version", "cuda_driver_version"):
            if getattr(backend, key, None):
                about[key] = getattr(backend, key)
        return {
            "version": __version__,
            "backend": about,
            "policy": self.policy_json(),
            "identity": identity.to_json(),
            "watchdog": bool(self.run_watchdog and self.watchdog is not None),
            "device_control": device_control_view(self.device_control_json(), identity.admin),
        }

    def device_control_json(self) -> dict[str, Any]:
        """Device control as it runs here: mode, what is denied, or why it is off (admins see all)."""
        if self.device_control is None:
            return {"mode": "off", "reason": "this broker was not given device control"}
        return dict(self.device_control.describe())

    def lease_request(self, identity: Identity, body: Mapping[str, Any]) -> LeaseRequest:
        """A request from a JSON body; owner and groups are the caller's, whatever the body says."""
        pool = self.pool
        memory_raw = body.get("memory")
        memory = pool.default_memory() if memory_raw in (None, "") else pool.parse_memory(memory_raw)
        try:
            num_gpus = int(body.get("num_gpus") or 1)
            share = body.get("compute_share")
            compute_share = int(share) if share not in (None, "", 0) else None
            holder_pid = int(body["holder_pid"]) if body.get("holder_pid") not in (None, "") else None
        except (TypeError, ValueError):
            raise InvalidInput("num_gpus, compute_share and holder_pid must be whole numbers") from None
        if not 1 <= num_gpus <= pool.policy.max_gpus_per_lease:
            raise InvalidInput(f"num_gpus must be from 1 to {pool.policy.max_gpus_per_lease}, got {num_gpus}")
        if compute_share is not None and not 1 <= compute_share <= 100:
            raise InvalidInput(f"compute_share is a percentage from 1 to 100, got {compute_share}")
        limit_raw = body.get("limit")
        burst_limit = None if limit_raw in (None, "") else 0 if limit_raw == 0 else pool.parse_memory(limit_raw)
        duration_raw = body.get("duration")
        duration = parse_duration(duration_raw) if duration_raw not in (None, "") else None
        if identity.pid is not None and holder_pid is None and duration is None:
            # A socket peer that names no holder and books no time: the connecting process holds it.
            # A booking with a duration (``jupyter gpupool request 1GiB --for 2h``) outlives the CLI.
            holder_pid = identity.pid
        return LeaseRequest(
            owner=identity.name,
            memory=memory,
            groups=tuple(identity.groups),
            kernel_id=str(body["kernel_id"]) if body.get("kernel_id") else None,
            num_gpus=num_gpus,
            compute_share=compute_share,
            model=str(body["model"]) if body.get("model") else None,
            priority=parse_priority(body.get("priority")),  # None: the configured class
            duration=duration,
            holder_pid=holder_pid,
            holder_host=str(body["holder_host"]) if body.get("holder_host") else None,
            label=str(body.get("label") or "")[:200],
            suspendable=bool(body.get("suspendable")),
            burst_limit=burst_limit,  # None: the pool's burst policy; 0: a fixed slice
        )

    def request_lease(self, identity: Identity, body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Worker thread: ``POST /api/gpupool/leases``. Returns (the lease as JSON with its queue place, created).

        Idempotent per kernel: a request naming a kernel that already has a live lease of the caller
        answers that lease instead of queueing a second one. So a client that retries after the broker
        committed its request but died (or the connection dropped) before answering never holds two.
        A lease :attr:`~Lease.tied_to_its_process` (suspended, resuming, mid-step) is asked again
        instead: its kernel restarted, and what the old process parked went with it.
        """
        pool = self.pool
        req = self.lease_request(identity, body)
        created = True
        lease = None
        if req.kernel_id:
            check_kernel_claim(pool, req.kernel_id, identity.name, HOSTNAME, self.released_claim_seconds)  # live, released or suspended
            lease = pool.lease_for_kernel(req.kernel_id)
            if lease is not None and lease.owner != identity.name:
                raise RequestRefused(f"kernel {req.kernel_id} already has a lease of another user")
            created = lease is None
        if lease is None or lease.tied_to_its_process:
            lease = pool.request(req)  # the same lease asks again (the engine keeps one per kernel)
        info = pool.queue_info(lease.id) if lease.state is LeaseState.QUEUED else None
        return lease_json(lease, info), created

    def kernel_status(self, kernel_id: str, lease: Lease) -> dict[str, Any]:
        """The ``GET /api/gpupool/kernels/{kernel_id}`` body, exactly as the single-user server gives it."""
        return kernel_status(self.pool, kernel_id, lease, self.enforcement, lease.owner, self.pool.clock())

    def _metrics(self) -> Any:
        """The pool's collector and its registry, made on first use."""
        if self._registry is None:
            self._collector = PoolCollector(self.pool)
            self._registry = make_registry(self.pool, self._collector)
        return self._collector

    def render_metrics(self) -> tuple[bytes, str]:
        self._metrics()
        return render(self._registry)

    def observe_restore(self, seconds: float) -> None:
        """A restore after a suspend took ``seconds`` from its grant to its confirmation (for /metrics)."""
        self._metrics().observe_restore(seconds)

    # --- watchdog -----------------------------------------------------------------------------------
    def watchdog_step(self) -> Any:
        """Find each granted lease's kernel among the GPU processes' ancestors, then check usage."""
        assert self.watchdog is not None
        pool = self.pool
        live = {lease.id: lease for lease in pool.leases()}
        granted = {lease_id: lease for lease_id, lease in live.items() if lease.state is LeaseState.GRANTED}
        limits = {lease_id: lease.watch_limit() for lease_id, lease in granted.items()}  # an elastic slice: its limit
        self.watchdog.default_unpooled_action = "stop"  # a multi-user host: GPUs are used through the pool
        self.watchdog.multi_user = True  # claims by the configured uid mapping, failing closed
        report = self.watchdog.check({}, limits, leases=live, host=HOSTNAME, env_var=self.lease_env_var)
        if report.error:
            return None
        self._roots = report.roots
        idle = {
            lease_id: 0 for lease_id, lease in granted.items() if lease_id not in report.usage and lease.used_memory
        }
        if idle:
            pool.report_usage(idle)
        return report

    def _act(self, lease_id: str, action: str) -> None:
        pid = (self.watchdog.last_roots if self.watchdog is not None else self._roots).get(lease_id)
        if pid is None:
            return
        if action == "interrupt":
            os.kill(pid, signal.SIGINT)
        elif action == "stop":
            self.pool.release(lease_id, reason="stopped: it kept using more GPU memory than its slice")
            terminate_tree(pid)


def socket_answers(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket at ``path`` (a dead one's file refuses)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def as_interface(broker: Broker) -> BrokerInterface:
    """The broker as its handlers see it (and a static check that it offers all they use)."""
    return broker


#: Mode of the broker's pool file and its ``-wal``/``-shm`` companions: the owner only, since they hold
#: every user's leases and kernels (the API anonymises them; the file must not bypass that).
POOL_FILE_MODE = 0o600
#: The broker's umask: whatever it (or SQLite) creates is the owner's alone (files 0600, folders 0700).
BROKER_UMASK = 0o077


def secure_pool_files(db_path: str, log: Any = None) -> list[str]:
    """Make the pool file, its ``-wal`` and ``-shm`` owner-only (0600); returns the paths it tightened.

    SQLite gives the WAL and shared-memory files the main file's mode when it creates them, so a
    tight main file keeps them tight; files left looser by an older version are tightened here,
    with a warning. A folder readable by others is reported too (it is the admin's to change:
    ``StateDirectory`` under systemd makes it 0755, and that only shows file names).
    """
    tightened = []
    for path in (db_path, f"{db_path}-wal", f"{db_path}-shm"):
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            os.chmod(path, POOL_FILE_MODE)
            tightened.append(path)
            if log is not None:
                log.warning("gpupool broker: %s was readable by other users (mode %o); it is now 0600", path, mode)
    folder = os.path.dirname(os.path.abspath(db_path))
    try:
        folder_mode = stat.S_IMODE(os.stat(folder).st_mode)
    except OSError:
        folder_mode = 0
    if folder_mode & 0o002 and log is not None:
        log.warning(
            "gpupool broker: the pool's folder %s is writable by every user (mode %o): anyone may replace the "
            "pool file; make it 0700 or 0755 (chmod o-w %s)",
            folder,
            folder_mode,
            folder,
        )
    return tightened


def make_server(broker: Broker, app: web.Application) -> LimitedHTTPServer:
    """The HTTP server for ``app``: per-caller connection bounds at accept, bounded heads and bodies,
    idle connections closed (see :mod:`jupyter_gpupool.broker.limits`)."""
    return LimitedHTTPServer(
        app,
        book=broker.connections,
        note=broker.note,
        xheaders=False,
        idle_connection_timeout=broker.idle_connection_timeout,
        body_timeout=broker.body_timeout,
        max_header_size=broker.max_header_size,
        # The handlers refuse bodies over MAX_BODY_BYTES with a JSON 413 as they stream; this is a
        # backstop for a chunk that claims more at once (tornado's bare 400, nothing buffered).
        max_body_size=4 * MAX_BODY_BYTES,
        max_buffer_size=4 * MAX_BODY_BYTES,
    )


def make_app(broker: Broker, base_url: str = "/") -> web.Application:
    """The tornado application serving ``broker`` under ``base_url``."""
    prefix = "/" + base_url.strip("/") + "/" if base_url.strip("/") else "/"
    # Also at the root: a socket client (unix:///path) has no room for a prefix in its URL.
    handlers = routes(prefix) + (routes("/") if prefix != "/" else [])
    return web.Application(
        handlers,
        gpupool_broker=as_interface(broker),
        default_handler_class=NotFoundHandler,
        xsrf_cookies=False,
        log_function=_log_request,
    )


def _log_request(handler: web.RequestHandler) -> None:
    status = handler.get_status()
    broker: Broker = handler.settings["gpupool_broker"]
    level = broker.log.info if status < 400 else broker.log.warning
    if handler.request.path.endswith("/wait") and status < 400:
        level = broker.log.debug
    identity = getattr(handler, "identity", None)
    who = identity.name if identity is not None else "-"
    if status in (400, 401, 403, 404, 409, 413, 429):  # what a caller can repeat at will: one line per interval
        caller = who if identity is not None else handler.request.remote_ip or "socket"
        broker.note(
            ("request", status, caller), logging.WARNING, "%d %s %s (%s) %.1fms", status, handler.request.method,
            handler.request.path, who, 1000 * handler.request.request_time(),
        )  # fmt: skip
        return
    level(
        "%d %s %s (%s) %.1fms",
        status,
        handler.request.method,
        handler.request.path,
        who,
        1000 * handler.request.request_time(),
    )


class BrokerApp(GpuPoolBaseApp):
    """``jupyter gpupool broker``: serve one pool to every Jupyter server on the host."""

    name = "jupyter-gpupool-broker"
    description = (
        "Serve one GPU pool to every Jupyter server on this host: as a JupyterHub service (hub tokens) "
        "and/or on a Unix socket (peer credentials). Servers and kernels use it when GPUPOOL_URL points at it."
    )
    classes = [PoolPolicy, Broker, HubIdentity, PeerCredIdentity, Watchdog, EnforcementSettings, DeviceControl]
    discover_broker = False  # the broker is what others discover
    aliases = {
        **GpuPoolBaseApp.aliases,
        "ip": "BrokerApp.ip",
        "port": "BrokerApp.port",
        "socket": "BrokerApp.socket",
        "socket-mode": "BrokerApp.socket_mode",
        "base-url": "BrokerApp.base_url",
        "hub": "BrokerApp.hub",
    }

    ip = Unicode(
        "", help="Address to listen on for HTTP. Default: the host of $JUPYTERHUB_SERVICE_URL, else 127.0.0.1."
    ).tag(config=True)
    port = Integer(
        -1,
        help="TCP port for HTTP. Default (-1): the port of $JUPYTERHUB_SERVICE_URL; else 10101 when no --socket is given, "
        "else no TCP listener. 0 turns TCP off.",
    ).tag(config=True)
    socket = Unicode("", help="Path of a Unix socket to serve on (callers identified by their uid). Empty: none.").tag(
        config=True
    )
    socket_mode = Unicode(
        "0666",
        help="Permissions of the Unix socket, octal. Every user may connect: the broker tells them apart by uid.",
    ).tag(config=True)
    base_url = Unicode("", help="URL prefix of every route. Default: $JUPYTERHUB_SERVICE_PREFIX, else /.").tag(
        config=True
    )
    hub = Unicode(
        "auto",
        help="Identify TCP callers by JupyterHub token: 'auto' (when $JUPYTERHUB_API_TOKEN is set), 'on', or 'off' "
        "(TCP callers then get 401; use the socket).",
    ).tag(config=True)

    def _listen_address(self) -> tuple[str, int]:
        service_url = urllib.parse.urlsplit(os.environ.get("JUPYTERHUB_SERVICE_URL", ""))
        ip = self.ip or service_url.hostname or "127.0.0.1"
        if self.port >= 0:
            return ip, self.port
        if service_url.port:
            return ip, service_url.port
        return ip, 0 if self.socket else 10101

    def _base_url(self) -> str:
        return self.base_url or os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "") or "/"

    def build_broker(self) -> Broker:
        pool = self.make_pool()
        hub_mode = self.hub.lower()
        if hub_mode not in ("auto", "on", "off"):
            raise InvalidInput(f"--hub must be auto, on or off, got {self.hub!r}")
        hub = None
        if hub_mode == "on" or (hub_mode == "auto" and os.environ.get("JUPYTERHUB_API_TOKEN")):
            try:
                hub = HubIdentity(parent=self)
            except ValueError as err:
                raise InvalidInput(str(err)) from None
        peer = PeerCredIdentity(parent=self) if self.socket else None
        watchdog = Watchdog(parent=self, backend=pool.backend, pool=pool)
        broker = Broker(parent=self, pool=pool, hub=hub, peer=peer, watchdog=watchdog)
        # The pool's one claim rule finds each kernel's processes, by the watchdog's uid mapping.
        users = UnixUsers(template=watchdog.unix_user_template, names=dict(watchdog.unix_users))
        broker.device_control = DeviceControlService(
            DeviceControl(parent=self), pool, users, host=HOSTNAME, call=lambda fn: broker.executor.submit(fn).result()
        )
        return broker

    def run(self) -> None:
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise InvalidInput(f"--socket-mode must be octal like 0666, got {self.socket_mode!r}") from None
        # The pool file (and SQLite's -wal and -shm beside it) holds every user's leases: owner-only.
        os.umask(BROKER_UMASK)
        soft, hard = raise_descriptor_limit(self.log)
        self.log.info("gpupool broker: up to %d open files (hard limit %d)", soft, hard)
        broker = self.build_broker()
        secure_pool_files(broker.pool.db_path, self.log)
        asyncio.run(self._serve(broker, mode))

    async def _serve(self, broker: Broker, socket_mode: int) -> None:
        # Before anything listens: a SIGTERM that comes as soon as the port answers must stop the
        # broker cleanly (socket removed, pool closed), not kill it mid-start.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        app = make_app(broker, self._base_url())
        server = make_server(broker, app)
        ip, port = self._listen_address()
        where = []
        if port:
            try:
                server.listen(port, address=ip, backlog=LISTEN_BACKLOG)
            except OSError as err:
                raise InvalidInput(
                    f"cannot listen on {ip}:{port} ({err.strerror or err}); is another broker running there? "
                    "stop it, or give another --port"
                ) from None
            where.append(
                f"http://{ip}:{port}{self._base_url()}" + (" (hub tokens)" if broker.hub else " (no hub: 401 for all)")
            )
        if self.socket:
            path = os.path.abspath(self.socket)
            if os.path.exists(path) and stat.S_ISSOCK(os.stat(path).st_mode):
                if socket_answers(path):  # never steal the socket of a broker that still runs
                    raise InvalidInput(f"another broker is serving on {path}; stop it first, or give another --socket")
                os.unlink(path)  # left behind by a killed broker
            folder = os.path.dirname(path)
            if not os.path.isdir(folder):
                os.makedirs(folder)
                os.chmod(folder, 0o755)  # every user connects (the umask would make it the broker's alone)
            server.add_socket(netutil.bind_unix_socket(path, mode=socket_mode, backlog=LISTEN_BACKLOG))
            where.append(f"unix:{path} (peer uid)")
        if not where:
            raise InvalidInput("nothing to listen on: give --port or --socket")
        broker.start()

        recorded = write_discovery(listen_urls(where), db=broker.pool.db_path)
        self.log.info(
            "jupyter-gpupool broker %s: %s on %s", __version__, broker.pool.backend.describe(), ", ".join(where)
        )
        self.log.info("pool database: %s; recorded for `jupyter gpupool` in %s", broker.pool.db_path, recorded or "no file")
        await stop.wait()
        self.log.info("jupyter-gpupool broker: stopping")
        server.stop()
        await broker.stop()
        if self.socket and os.path.exists(self.socket):
            os.unlink(self.socket)
        broker.pool.close()


main = BrokerApp.launch_instance

__all__ = ["Broker", "BrokerApp", "find_kernel_roots", "make_app", "make_server", "secure_pool_files", "terminate_tree"]
