"""The ``gpupool`` Jupyter Server extension: the pool's adapter inside a running server.

- makes ``gpupool-provisioner`` the default provisioner; a kernel start the pool grants at once
  behaves exactly as jupyter_server's own (``POST /api/kernels`` answers a started kernel, errors
  come back from the call), and only one that must wait in the queue is answered at once as a
  pending kernel, so it never blocks the server or times out;
- feeds the engine each kernel's activity, runs its scheduler and carries out its decisions
  (idle and preemption reclaims: suspend where this host can checkpoint, else cull);
- reconciles leases against live kernels (a kernel process that died frees its slice);
- runs the NVML watchdog over each kernel's process tree;
- serves the REST API (see ``openapi.yaml``) and emits ``lease`` events.

It fails closed and visibly: when the pool cannot be opened (no NVIDIA driver and no simulated
pool, a broken pool file, invalid settings, an unreachable broker) the extension still loads, in
a degraded mode: kernels start CPU-only (or are refused: :attr:`GpuPoolExtension.when_unavailable`),
the REST API answers ``state: "unavailable"`` with the reason, and the pool is opened again every
:attr:`GpuPoolExtension.retry_interval` seconds until it works. A kernel whose start failed is
shown as such (``execution_state: "dead"`` with the reason, and ``state: "failed"`` here).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import os
import time
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any, ClassVar

from jupyter_client.multikernelmanager import AsyncMultiKernelManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server._tz import utcnow
from jupyter_server.auth.decorator import authorized
from jupyter_server.extension.application import ExtensionApp
from jupyter_server.services.kernels.handlers import KernelActionHandler, MainKernelHandler
from jupyter_server.services.sessions.handlers import SessionHandler, SessionRootHandler
from tornado import web
from traitlets import Bool, Enum, Float, List, Unicode, default

from jupyter_gpupool.backends.contract import Capability, supports
from jupyter_gpupool.backends.factory import backend_provisioner, pool_from_env
from jupyter_gpupool.backends.local.pool import HOSTNAME
from jupyter_gpupool.core.models import Activity, Decision, DecisionKind, Lease, LeaseState, QueueInfo, Transition
from jupyter_gpupool.devices.checkpoint import CheckpointError, checkpointer_for
from jupyter_gpupool.devices.nvml import NvmlBackend
from jupyter_gpupool.devices.parking import (
    DriverCheckpointPath,
    FrameworkPath,
    Parked,
    ParkingKernel,
    ParkingPath,
    park_kernel,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.plan import EnforcementPlan, EnforcementSettings, plan_enforcement
from jupyter_gpupool.enforcement.watchdog import Watchdog
from jupyter_gpupool.errors import GpuPoolError, NoGpuFound, PoolUnavailable
from jupyter_gpupool.kernel.autolease import mark_unpooled_kernelspecs
from jupyter_gpupool.provisioner.kernel_provisioner import (
    PROVISIONER_NAME,
    UNAVAILABLE_ENV,
    WHEN_UNAVAILABLE,
    GpuPoolProvisioner,
    ServerBinding,
    default_owner,
    holder_identity,
    one_line,
    when_unavailable_from_env,
)
from jupyter_gpupool.quiet import ActivityClocks, quiet_request
from jupyter_gpupool.rest.metrics import PoolCollector
from jupyter_gpupool.rest.views import kernel_status, kernel_status_without_pool, queued_status_while_unreachable
from jupyter_gpupool.serverextension.configguard import FailClosedConfig
from jupyter_gpupool.serverextension.gateway import GatewayKernels, gateway_url
from jupyter_gpupool.serverextension.handlers import default_handlers
from jupyter_gpupool.serverextension.voila import VOILA_PAGE, mark_voila_pages, start_for_voila_page
from jupyter_gpupool.units import format_size

LEASE_SCHEMA_ID = "https://events.jupyter.org/jupyter_gpupool/lease/v2"
LEASE_SCHEMA_PATH = Path(__file__).parent / "events" / "lease-v2.yaml"

#: Release reasons (set by the engine) after which the kernel must go: its slice was taken back.
RECLAIM_PREFIXES = ("reclaimed", "preempted", "ended by Slurm", "stopped")


class KernelActionWhileStartingHandler(KernelActionHandler):  # type: ignore[misc]
    """``POST /api/kernels/{id}/interrupt|restart``: 409 with the reason while the kernel's start
    (or restart) still waits for its GPU slice or is under way; else jupyter_server's own handler.

    jupyter_server answers 500 there ("Kernel is in a pending state"): there is no process yet
    to interrupt or restart, which is the client's to retry, not a server error."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        ext = self.settings.get("gpupool")
        reason = ext.not_started_reason(kernel_id, action) if ext is not None else None
        if reason is not None:
            raise web.HTTPError(409, reason.replace("%", "%%"))
        answered = super().post(kernel_id, action)
        if answered is not None:
            await answered



#: True while a kernel start is made for a REST call whose client awaits the kernel's ``ready``
#: (JupyterLab, Notebook: their websocket waits for it); another caller (Voilà's page, which asks the
#: kernel for ``kernel_info`` at once) gets a start that returns once the kernel has started.
AWAITS_READY: contextvars.ContextVar[bool] = contextvars.ContextVar("gpupool_awaits_ready", default=False)
#: The REST routes whose kernel starts may be answered as pending kernels (class, HTTP method).
REST_STARTS = ((MainKernelHandler, "POST"), (SessionRootHandler, "POST"), (SessionHandler, "PATCH"))


def mark_rest_starts() -> None:
    """Make the kernel starts of :data:`REST_STARTS` run with :data:`AWAITS_READY` set (once per process).

    Set in the handler's ``prepare``, which tornado awaits in the request's own task before the
    method (the methods themselves stay as jupyter_server decorated them: it checks their auth)."""
    for cls, verb in REST_STARTS:
        original = cls.prepare
        if getattr(original, "_gpupool_awaits_ready", False):
            continue

        async def prepare(self: Any, *args: Any, _original: Any = original, _verb: str = verb, **kwargs: Any) -> Any:
            AWAITS_READY.set(self.request.method == _verb)  # this request's task only
            result = _original(self, *args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        prepare._gpupool_awaits_ready = True  # type: ignore[attr-defined]
        cls.prepare = prepare  # type: ignore[method-assign]


class PoolPinnedBackups:
    """The host's pinned parking pool, booked by the GPU pool (the server's store, or the broker's):
    a lease's ``pinned_backup``, counted against the parked-memory budget where decisions are made."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool

    def reserve(self, lease_id: str, amount: int) -> str:
        try:
            self.pool.reserve_pinned_backup(lease_id, amount)
        except GpuPoolError as refusal:
            return str(refusal)
        return ""

    def release(self, lease_id: str) -> None:
        with contextlib.suppress(GpuPoolError):
            self.pool.reserve_pinned_backup(lease_id, 0)


class GpuPoolExtension(FailClosedConfig, ExtensionApp):
    """Pool the host's GPU memory across the kernels of this server."""

    name = "gpupool"
    load_other_extensions = True

    make_default_provisioner = Bool(
        True,
        config=True,
        help=(
            "Make gpupool-provisioner the default for every kernel whose kernelspec names no provisioner. "
            "Opt out globally with False, or per kernelspec with metadata.kernel_provisioner.provisioner_name = "
            "'local-provisioner'. An explicit c.KernelProvisionerFactory.default_provisioner_name or "
            "$JUPYTER_DEFAULT_PROVISIONER_NAME wins. Kernels left unpooled get GPUPOOL_AUTOLEASE=off, so they do not "
            "lease for themselves either (docs/batch-runs.md)."
        ),
    )
    pending_kernels = Bool(
        True,
        config=True,
        help="Answer POST /api/kernels at once, with a pending kernel (execution_state 'starting'), when the kernel must "
        "wait in the queue for its GPU slice; a start the pool grants at once answers a started kernel, as without "
        "the extension. False: the call waits for the grant. Needs the default AsyncMappingKernelManager; "
        "MappingKernelManager.use_pending_kernels = True makes every start pending, as jupyter_server does.",
    )
    owner = Unicode(
        config=True,
        help="User the kernels of this server are charged to. Default: $GPUPOOL_USER, else $JUPYTERHUB_USER, else the OS user.",
    )
    admin_users = List(
        Unicode(),
        config=True,
        help="User names that see every lease with its owner and may act on any kernel. JupyterHub users with the "
        "custom:gpupool:admin scope are admins too.",
    )
    identity_is_owner = Bool(
        None,
        allow_none=True,
        config=True,
        help=(
            "Treat every authenticated user as the server's owner. Default (None): True with jupyter_server's own "
            "token/password identity (single-user, whose user names are random), False with any other IdentityProvider "
            "(JupyterHub's, or custom), whose user names are real."
        ),
    )
    tick_interval = Float(
        5.0,
        config=True,
        help="Seconds between two rounds of activity reports, scheduler runs and reclaims.",
    )
    reconcile_interval = Float(
        10.0,
        config=True,
        help="Seconds between two reconciliations of leases against live kernels (a dead kernel frees its slice within this).",
    )
    watchdog_enabled = Bool(True, config=True, help="Run the NVML watchdog (interval and action: c.Watchdog.*).")
    reclaim_action = Enum(
        ["suspend", "cull"],
        "suspend",
        config=True,
        help="What this server lets the pool do to its kernels when their slice is reclaimed (idle) or preempted: "
        "'suspend' parks the kernel's GPU memory in host RAM where this host can (CUDA driver 570+ with "
        "`pip install jupyter-gpupool[cuda]`, or a simulated pool) and culls it where not; 'cull' always shuts it "
        "down. The pool's own c.PoolPolicy.reclaim_action can forbid suspends for everyone.",
    )
    caps_timeout = Float(
        10.0,
        config=True,
        help="Seconds the server waits for a kernel to answer a request to move its framework caps (an elastic "
        "slice grew or gave its burst back); the watchdog holds a kernel that does not answer to its size.",
    )
    checkpoint_timeout = Float(
        30.0,
        config=True,
        help="Seconds a suspend waits for the kernel's running GPU work to finish before it gives up "
        "(and the reclaim falls back to culling).",
    )
    free_caches_timeout = Float(
        5.0,
        config=True,
        help="Seconds a suspend or move waits for the kernel to free its frameworks' cached GPU memory first "
        "(PyTorch's caching allocator, CuPy's pools: asked on the quiet channel, not a cell, not activity), so "
        "only live bytes are parked; the checkpoint goes ahead when the kernel does not answer in time. 0: never ask.",
    )
    fast_parking = Bool(
        True,
        config=True,
        help="Park a kernel's PyTorch memory through the framework itself where its start found that it can "
        "(torch-memory-saver installed in the kernel, no HAMi-core preloaded; see docs/suspend.md), the driver "
        "checkpoint parking the rest; any failure falls back to the driver checkpoint alone. False: always the "
        "driver checkpoint. A kernel can refuse for itself with GPUPOOL_FAST_PARKING=off.",
    )
    when_unavailable = Enum(
        list(WHEN_UNAVAILABLE),
        "cpu-only",
        config=True,
        help=(
            "What a kernel start does while the GPU pool is unavailable (no NVIDIA driver and no GPUPOOL_SIMULATE, "
            "a broken pool file, an unreachable broker, invalid GPUPOOL_* settings): 'cpu-only' starts it with "
            "CUDA_VISIBLE_DEVICES='' and no slice, 'refuse' fails the start with the reason. Never with the host's "
            "GPUs unpooled. A restart always falls back to CPU-only. Env: GPUPOOL_WHEN_UNAVAILABLE."
        ),
    )
    retry_interval = Float(
        30.0,
        config=True,
        help="Seconds between two attempts to open the GPU pool while it is unavailable (it recovers once the cause is fixed).",
    )
    keepalive_default = Float(
        3600.0,
        config=True,
        help="Seconds POST .../keepalive holds a slice through idle when the request gives no duration (capped by the policy's max_keep).",
    )

    @default("owner")
    def _default_owner(self) -> str:
        return default_owner()

    @default("when_unavailable")
    def _default_when_unavailable(self) -> str:
        return when_unavailable_from_env()

    # Set before anything can fail, so a half-initialised extension still stops cleanly.
    _tasks: list[asyncio.Task[None]]
    _pool: Any = None
    #: Why the pool cannot be used now (None while it works), since when, and whether it is simply "no GPU here".
    unavailable_reason: str | None = None
    unavailable_since: float | None = None
    no_gpu: bool = False
    _failed_call: bool = False  # unavailable because a call on an open pool failed (not because it could not open)
    _stopping: bool = False

    @property
    def pool(self) -> Any:
        """The open pool; raises PoolUnavailable (503 over REST) with the reason while there is none."""
        if self._pool is None:
            raise PoolUnavailable(f"the GPU pool is unavailable: {self.unavailable_reason or 'not opened yet'}")
        return self._pool

    def _pool_for_kernels(self) -> Any:
        """The pool for a kernel start; PoolUnavailable carrying just the reason while there is none."""
        if self._pool is None:
            raise PoolUnavailable(self.unavailable_reason or "the GPU pool is not open yet")
        return self._pool

    @property
    def available(self) -> bool:
        return self._pool is not None and self.unavailable_reason is None

    def availability(self) -> dict[str, Any]:
        """The pool's state for REST and the UI: ``available``, or ``unavailable`` with the reason."""
        return {
            "state": "available" if self.available else "unavailable",
            "reason": None if self.available else (self.unavailable_reason or "the GPU pool is not open yet"),
            "unavailable_since": None if self.available else self.unavailable_since,
            "no_gpu": bool(self.no_gpu) and not self.available,
            "when_unavailable": self.when_unavailable,
        }

    # --- set-up ---------------------------------------------------------------------------------

    def initialize_settings(self) -> None:
        """Make the provisioner the default, turn on pending kernels, bind, and open the pool.

        Never fails because of the pool: a pool that cannot be opened leaves the extension in its
        degraded mode (kernels CPU-only or refused, REST says why) and is tried again later. And
        never fails open: if starting the extension itself breaks (a bug, a broken install), the
        kernels it would have pooled start with every GPU hidden, and the log says why.
        """
        try:
            self._initialize_settings()
        except Exception as err:
            reason = f"the gpupool server extension failed to start: {one_line(err)}"
            self.log.exception("gpupool: %s; kernels of this server start CPU-only until it is fixed", reason)
            self._hide_gpus_from_pooled_kernels(reason)

    def _hide_gpus_from_pooled_kernels(self, reason: str) -> None:
        """The last line of defence: kernelspecs this server would have pooled get
        ``CUDA_VISIBLE_DEVICES=""`` (a kernelspec that names another provisioner is an admin's opt-out)."""
        assert self.serverapp is not None
        ksm = self.serverapp.kernel_spec_manager
        assert ksm is not None
        original = ksm.get_kernel_spec
        pooled_by_default = self.make_default_provisioner

        def get_kernel_spec(kernel_name: str, *args: Any, **kwargs: Any) -> Any:
            spec = original(kernel_name, *args, **kwargs)
            metadata = spec.metadata if isinstance(spec.metadata, dict) else {}
            named = metadata.get("kernel_provisioner", {}).get("provisioner_name")
            if named == PROVISIONER_NAME or (named is None and pooled_by_default):
                spec.env = {**(spec.env or {}), "CUDA_VISIBLE_DEVICES": "", UNAVAILABLE_ENV: reason}
            return spec

        ksm.get_kernel_spec = get_kernel_spec  # type: ignore[method-assign]  # this server's instance only

    def _initialize_settings(self) -> None:
        assert self.serverapp is not None
        self._tasks = []
        self._culled: dict[str, str] = {}
        self._acting: set[str] = set()
        self._warned: dict[str, float] = {}
        self._failed: dict[str, str] = {}
        self._moving: set[str] = set()  # lease ids whose suspend, restore or move this server is carrying out
        self._caps_sent: dict[str, int] = {}  # lease id → bytes per GPU its kernel's caps were last moved to
        #: Steps done here whose confirmation the pool did not get (an outage): confirmed again, never redone.
        self._unconfirmed: dict[str, tuple[Transition, int | None]] = {}
        self._transition_tasks: set[asyncio.Future[None]] = set()
        self._checkpointer: Any = None
        #: Lease id → the path that parked its kernel and what it parked (for its restore).
        self._parked_by: dict[str, tuple[ParkingPath, Parked, ParkingKernel]] = {}
        #: Lease id → what freeing the kernel's caches before its last park found (see _free_caches).
        self._parking: dict[str, dict[str, Any]] = {}
        self._no_quiet_answer: set[str] = set()  # kernels that never answered a quiet request: not asked again
        self._restarts: dict[str, asyncio.Future[Any]] = {}
        self._stopping = False
        self.tick_count = 0
        self.change_count = 0  # rounds of act_on_changes (a change of the pool, heard at once)
        self._act_lock = asyncio.Lock()
        self._changed: asyncio.Event | None = None
        self._unsubscribe_changes: Any = None
        self.reconcile_count = 0
        self.open_attempts = 0
        self.watchdog: Any = None
        self.enforcement = EnforcementSettings(parent=self.serverapp).to_config()
        km = self.serverapp.kernel_manager
        self._starting: dict[str, Any] = {}  # kernel id → its KernelManager while its start is under way
        self._queued_starts: dict[str, asyncio.Event] = {}  # set once that start waits in the queue
        url = gateway_url(self.serverapp)
        #: Set when this server's kernels run on a kernel gateway: its managers are left as they are.
        self.gateway = GatewayKernels(url, self.log) if url is not None else None
        if self.gateway is not None:
            self.gateway.start()
        else:
            self._install_provisioner_default()
            self._wrap_kernel_manager(km)
            mark_rest_starts()
            mark_voila_pages()
        self.event_logger = self.serverapp.event_logger
        with contextlib.suppress(Exception):  # already registered by an earlier server in this process
            assert self.event_logger is not None
            self.event_logger.register_event_schema(LEASE_SCHEMA_PATH)
        self.binding = ServerBinding(
            open_pool=self._pool_for_kernels,
            current_owner=lambda: self.owner,
            enforcement=self.enforcement,
            listeners=[self._on_lease, self._on_queued_start],
            when_unavailable=lambda: self.when_unavailable,
            can_suspend=self.can_suspend,
        )
        self.settings["gpupool"] = self
        self.open_pool()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the usual case: the server starts the loops in _start_jupyter_server_extension
        else:
            self._ensure_started()  # initialized inside a running loop (embedded servers, tests)

    def open_pool(self) -> bool:
        """Try to open the pool (from GPUPOOL_* and the server's config); False, with the reason kept, if it cannot."""
        assert self.serverapp is not None
        self.open_attempts += 1
        try:
            self.raise_for_invalid_config()  # an invalid c.* setting: degraded until fixed (configguard.py)
            pool = pool_from_env(config=self.serverapp.config)
            self._after_open(pool)
        except Exception as err:  # noqa: BLE001 - any cause: one line in the log, the extension stays up (degraded)
            self._set_unavailable(err)
            return False
        self._pool = pool
        self._set_available()
        self.log.info("gpupool: %s, pool file %s, owner %s", pool.backend.describe(), getattr(pool, "db_path", ""), self.owner)
        return True

    def _after_open(self, pool: Any) -> None:
        """Per-pool set-up: the broker's name for us, the metrics collector."""
        configured = "owner" in self.config.get(type(self).__name__, {}) or os.environ.get("GPUPOOL_USER")
        if getattr(pool, "remote", False) and not configured:
            # The broker names the user from our token; leases and views must use that name.
            try:
                self.owner = pool.whoami()["name"]
            except GpuPoolError as err:
                self.log.error("gpupool: the broker at %s cannot be reached (%s); kernels will not start until it can", pool.url, err)
        self._register_metrics(pool)

    def _set_unavailable(self, err: BaseException) -> None:
        """Record why the pool cannot be used; say it in the log once per new reason, without a traceback."""
        reason = one_line(err)
        changed = reason != self.unavailable_reason
        if self.unavailable_reason is None:
            self.unavailable_since = time.time()
        self.unavailable_reason = reason
        self.no_gpu = isinstance(err, NoGpuFound)
        if not changed:
            return
        if not isinstance(err, GpuPoolError):
            self.log.debug("gpupool: the pool failed", exc_info=err)
        if self.no_gpu:
            self.log.info("gpupool: no NVIDIA GPU found and no simulated pool configured: kernels run CPU-only")
            return
        kernels = "start CPU-only" if self.when_unavailable == "cpu-only" else "are refused"
        self.log.warning(
            "gpupool: the GPU pool is unavailable: %s; kernels %s until it is fixed (trying again every %g s)",
            reason,
            kernels,
            self.retry_interval,
        )

    def _set_available(self) -> None:
        if self.unavailable_reason is not None and self.open_attempts > 1:
            self.log.info("gpupool: the GPU pool is available again")
        self.unavailable_reason = None
        self.unavailable_since = None
        self.no_gpu = False
        self._failed_call = False

    def initialize_handlers(self) -> None:
        self.handlers.extend(default_handlers)
        # Ahead of jupyter_server's own route (extension routes are matched first).
        self.handlers.append((r"/api/kernels/(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)/(?P<action>restart|interrupt)", KernelActionWhileStartingHandler))

    def _install_provisioner_default(self) -> None:
        """Kernelspecs of this server that name no provisioner get gpupool-provisioner.

        Done on this server's KernelSpecManager, not on the process-wide
        KernelProvisionerFactory singleton, so nothing outlives the server; a kernelspec that
        names a provisioner (e.g. ``local-provisioner``) keeps it: the per-kernelspec opt-out.
        """
        # A source checkout has no entry point metadata: make the name resolvable in this process.
        KernelProvisionerFactory.provisioners.setdefault(
            PROVISIONER_NAME,
            EntryPoint(PROVISIONER_NAME, "jupyter_gpupool.provisioner.kernel_provisioner:GpuPoolProvisioner", KernelProvisionerFactory.GROUP_NAME),
        )
        assert self.serverapp is not None
        # A backend with its own provisioner (Slurm: kernels as jobs) makes that one the default.
        provisioner_name, target = backend_provisioner(self.serverapp.config)
        KernelProvisionerFactory.provisioners.setdefault(
            provisioner_name, EntryPoint(provisioner_name, target, KernelProvisionerFactory.GROUP_NAME)
        )
        explicit = self.serverapp.config.get("KernelProvisionerFactory", {}).get("default_provisioner_name")
        from_env = os.environ.get(KernelProvisionerFactory.default_provisioner_name_env)
        opted_out = (
            "c.GpuPoolExtension.make_default_provisioner = False" if not self.make_default_provisioner
            else f"c.KernelProvisionerFactory.default_provisioner_name = {explicit!r}" if explicit
            else f"${KernelProvisionerFactory.default_provisioner_name_env}={from_env}" if from_env
            else ""
        )
        # Kernels this server leaves unpooled say so in their env: the kernel-side autolease stands aside.
        default = KernelProvisionerFactory(config=self.serverapp.config).default_provisioner_name if opted_out else provisioner_name
        mark_unpooled_kernelspecs(self.serverapp.kernel_spec_manager, default)
        if opted_out:
            if (explicit or from_env) not in (PROVISIONER_NAME, provisioner_name):
                self.log.warning(
                    "gpupool: kernels of this server do not ask the GPU pool (%s): they see every GPU; "
                    "GPU memory they use shows as unpooled use, which the pool never grants", opted_out,
                )
            return
        ksm = self.serverapp.kernel_spec_manager
        assert ksm is not None
        original = ksm.get_kernel_spec
        warned: set[str] = set()

        def get_kernel_spec(kernel_name: str, *args: Any, **kwargs: Any) -> Any:
            spec = original(kernel_name, *args, **kwargs)
            metadata = spec.metadata if isinstance(spec.metadata, dict) else {}
            named = metadata.get("kernel_provisioner", {}).get("provisioner_name")
            if named is None:
                metadata["kernel_provisioner"] = {"provisioner_name": provisioner_name, "config": {}}
                spec.metadata = metadata
            elif named not in (PROVISIONER_NAME, provisioner_name) and kernel_name not in warned:
                warned.add(kernel_name)
                self.log.warning(
                    "gpupool: kernelspec %r names provisioner %r, so its kernels do not ask the GPU pool; "
                    "GPU memory they use shows as unpooled use", kernel_name, named,
                )
            return spec

        ksm.get_kernel_spec = get_kernel_spec  # type: ignore[method-assign]  # this server's instance only
        self._restore_spec_manager = lambda: ksm.__dict__.pop("get_kernel_spec", None)

    #: Seconds a shutdown waits for a start or restart in progress to end (once its queued request is withdrawn).
    shutdown_wait = 30.0

    def _wrap_kernel_manager(self, km: Any) -> None:
        """Teach the server's kernel manager about starts that wait for, or are refused by, the pool.

        - a start the pool grants at once is jupyter_server's own (the call returns a started
          kernel, or raises; a refusal by the pool is an HTTP error with the reason); one that
          must wait in the queue is answered at once as a pending kernel (see :meth:`_start`);
        - shutting down a queued kernel withdraws its request first, so the shutdown returns at
          once (jupyter_client awaits a pending start before shutting it down), and a shutdown
          during a start or restart waits for it to end instead of failing;
        - a start that failed marks the kernel ``dead`` with the reason (jupyter_client would
          leave it ``starting`` for ever);
        - a restart never fails because of the pool: a kernel still waiting for its slice has
          nothing to restart, a restart that must queue again returns once it waits (the kernel
          shows ``starting`` and its queue position), and a restart the pool refuses leaves the
          kernel ``dead`` with the reason;
        - jupyter_server's culler never culls a kernel while it waits for its slice (it would cull
          a ``starting`` kernel with no connection by the time its start was answered): its idle
          time counts from the moment it stops waiting, and the usual rule applies from there.
        """
        original_shutdown = km._async_shutdown_kernel
        original_finish = km._finish_kernel_start
        original_restart = km._async_restart_kernel
        original_start = km.start_kernel
        original_pre_start = km.pre_start_kernel
        original_cull: Any = getattr(km, "cull_kernel_if_idle", None)

        def pre_start_kernel(kernel_name: str | None, kwargs: Any) -> Any:
            manager, name, kernel_id = original_pre_start(kernel_name, kwargs)
            if kernel_id in self._queued_starts:
                self._starting[kernel_id] = manager
            return manager, name, kernel_id

        async def start_kernel(*args: Any, **kwargs: Any) -> Any:
            return await self._start(km, original_start, *args, **kwargs)

        async def shutdown_kernel(kernel_id: str, now: bool = False, restart: bool = False) -> Any:
            present = kernel_id in km
            removing = km._pending_kernels.get(kernel_id)
            if not present and removing is not None:  # shutdown_all lists kernels already being removed
                with contextlib.suppress(BaseException):
                    await asyncio.wait_for(asyncio.shield(removing), self.shutdown_wait)
                return None
            if not restart:
                await self._settle(km, kernel_id)
            self._failed.pop(kernel_id, None)
            if present and kernel_id not in km:
                return None  # removed while we waited (a shutdown already under way): done
            return await original_shutdown(kernel_id, now=now, restart=restart)

        async def finish_kernel_start(kernel_id: str) -> None:
            await original_finish(kernel_id)
            self._note_failed_start(km, kernel_id)

        async def restart_kernel(kernel_id: str, now: bool = False) -> Any:
            return await self._restart(km, original_restart, kernel_id, now)

        async def cull_kernel_if_idle(kernel_id: str) -> Any:
            kernel = km._kernels.get(kernel_id)
            if kernel is not None and self.waits_for_gpu(kernel_id):
                kernel.last_activity = utcnow()  # waiting is not idleness: the idle time starts when it stops
                return None
            return await original_cull(kernel_id)

        if original_cull is not None:
            km.cull_kernel_if_idle = cull_kernel_if_idle
        km._async_shutdown_kernel = km.shutdown_kernel = shutdown_kernel
        km._finish_kernel_start = finish_kernel_start
        km._async_restart_kernel = km.restart_kernel = restart_kernel
        km.pre_start_kernel = pre_start_kernel
        km.start_kernel = start_kernel

    def waits_for_gpu(self, kernel_id: str) -> bool:
        """Whether ``kernel_id``'s start or restart is waiting in the pool's queue for its slice."""
        prov = self.provisioner_of(kernel_id)
        return prov is not None and prov.phase == "waiting"

    def _may_answer_pending(self, km: Any) -> bool:
        """Whether a start that must queue may be answered as a pending kernel: asked for, on the
        asynchronous manager (the synchronous one is left as jupyter_server made it), not already
        every start (``use_pending_kernels`` set by the admin), and for a REST call whose client
        awaits the kernel's ``ready`` (:data:`AWAITS_READY`). Any other caller, such as Voilà's page,
        talks to the kernel as soon as the start returns, and takes a kernel with no process yet for
        a dead one: its start returns once the kernel has its slice and has started."""
        return (
            self.pending_kernels
            and AWAITS_READY.get()
            and isinstance(km, AsyncMultiKernelManager)
            and not km._using_pending_kernels()
        )

    async def _start(self, km: Any, original: Any, *args: Any, **kwargs: Any) -> Any:
        """jupyter_server's start, answered early (as a pending kernel) only once it waits in the queue.

        The start runs as jupyter_server runs it, without pending kernels. If the pool grants the
        slice at once, the call ends as upstream's: the kernel started (its ports and keys exist),
        or the error raised; a refusal by the pool is an HTTP error with the reason (409, 503...).
        If the request queues, the kernel becomes a pending kernel, exactly as with
        ``use_pending_kernels``: listed ``starting``, its start goes on in the background and
        ends in a started kernel, or ``dead`` with the reason; a shutdown withdraws the request.
        """
        kernel_id = kwargs.get("kernel_id")
        page = VOILA_PAGE.get()
        if page is not None and (kernel_id is None or kernel_id not in km):  # it shows the queue while it waits
            return await start_for_voila_page(self, km, original, page, *args, **kwargs)
        if not self._may_answer_pending(km) or (kernel_id is not None and kernel_id in km):
            return await self._pool_errors_as_http(original(*args, **kwargs))
        if kernel_id is None:
            kernel_id = kwargs["kernel_id"] = km.new_kernel_id()
        queued = self._queued_starts[kernel_id] = asyncio.Event()
        start = asyncio.ensure_future(original(*args, **kwargs))
        waiting = asyncio.ensure_future(queued.wait())
        try:
            await asyncio.wait([start, waiting], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            start.cancel()
            raise
        finally:
            waiting.cancel()
            self._queued_starts.pop(kernel_id, None)
            manager = self._starting.pop(kernel_id, None)
        if start.done() or manager is None:
            return await self._pool_errors_as_http(start)
        self._answer_pending(km, kernel_id, manager, start)
        return kernel_id

    async def _pool_errors_as_http(self, start: Any) -> Any:
        """Await a start; a refusal by the pool (a GpuPoolError) becomes an HTTP error with its reason, never a 500."""
        try:
            return await start
        except GpuPoolError as err:
            reason = one_line(err)
            raise web.HTTPError(err.http_status if err.http_status != 500 else 503, reason.replace("%", "%%")) from None

    def _answer_pending(self, km: Any, kernel_id: str, manager: Any, start: asyncio.Future[Any]) -> None:
        """Make a start that waits in the queue a pending kernel, as jupyter_client's
        ``use_pending_kernels`` does: in the map and ``starting`` while the start goes on."""
        km._kernels[kernel_id] = manager
        km._kernel_connections.setdefault(kernel_id, 0)
        manager.execution_state = "starting"
        manager.reason = ""
        manager.last_activity = utcnow()
        self.log.info("gpupool: kernel %s waits in the queue for its GPU slice: answered as a pending kernel", kernel_id)

        def done(task: asyncio.Future[Any]) -> None:
            if task.cancelled():
                return
            error = task.exception()  # retrieved: never "exception was never retrieved"
            if error is not None and kernel_id in km:
                self._note_failed_start(km, kernel_id, error)

        start.add_done_callback(done)

    def _on_queued_start(self, action: str, lease: Lease, info: QueueInfo | None, message: str) -> None:
        """Listener: a start under way (see :meth:`_start`) now waits in the queue."""
        queued = self._queued_starts.get(lease.kernel_id or "")
        if action == "queued" and queued is not None:
            queued.set()

    def not_started_reason(self, kernel_id: str, action: str) -> str | None:
        """Why ``kernel_id`` cannot be interrupted or restarted now, or None: its start is still
        waiting or under way (there is no process yet), or, for an interrupt, so is its restart.
        A restart during a restart stays what :meth:`_restart` makes it (nothing to restart)."""
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        if kernel_id not in km or self.gateway is not None:
            return None  # jupyter_server's own 404, or the gateway's own answer
        kernel = km.get_kernel(kernel_id)
        ready = getattr(kernel, "ready", None)
        restarting = self._restarts.get(kernel_id)
        if restarting is not None and not restarting.done():
            if action != "interrupt":
                return None
        elif ready is None or ready.done():
            return None
        prov = self.provisioner_of(kernel_id)
        verb = "interrupted" if action == "interrupt" else "restarted"
        if prov is not None and prov.phase == "waiting":
            _lease, info = prov.queue_update if prov.queue_update is not None else (None, None)
            where = prov._queue_message(info)
            return f"kernel {kernel_id} is {where}; it can be {verb} once it has started (shut it down to withdraw the request)"
        return f"kernel {kernel_id} is still starting; it can be {verb} once it has started"

    async def _settle(self, km: Any, kernel_id: str) -> None:
        """Before a shutdown: withdraw the kernel's queued request (its start or restart then fails
        fast) and wait, bounded, for a start or restart in progress to end; past the bound (the
        pool cannot be reached to withdraw it) cancel the start, so a shutdown never hangs."""
        limit = self.shutdown_wait if not self._stopping else min(self.shutdown_wait, 3.0)
        deadline = time.monotonic() + limit
        while True:
            with contextlib.suppress(Exception):  # the pool may be unavailable: shut down anyway
                reason = "kernel shut down while queued"
                withdrawn = await asyncio.to_thread(self.withdraw_queued, kernel_id, reason)
                if withdrawn is not None:
                    self.emit("released", withdrawn, message=reason)
            restart = self._restarts.get(kernel_id)
            kernel = km._kernels.get(kernel_id)
            ready = getattr(kernel, "ready", None)
            busy = (restart is not None and not restart.done()) or (ready is not None and not ready.done())
            if not busy:
                return
            if time.monotonic() > deadline:
                self._cancel_start(km, kernel_id, kernel)
                return
            await asyncio.sleep(0.1)

    def _cancel_start(self, km: Any, kernel_id: str, kernel: Any) -> None:
        """Cancel a start or restart that still waits, and end its ``ready`` with the reason
        (jupyter_client leaves a cancelled start's ``ready`` pending, and then cannot shut it down)."""
        self.log.warning("gpupool: kernel %s is shut down while its start still waits: cancelling the start", kernel_id)
        for task in (km._pending_kernels.get(kernel_id), self._restarts.get(kernel_id)):
            if task is not None and not task.done():
                task.cancel()
        ready = getattr(kernel, "_ready", None)
        if isinstance(ready, asyncio.Future) and not ready.done():
            ready.set_exception(RuntimeError("kernel start cancelled: shut down while it waited for a GPU slice"))
            ready.exception()  # retrieved: no "exception was never retrieved" warning

    def _note_failed_start(self, km: Any, kernel_id: str, error: BaseException | None = None) -> str | None:
        """If the last start of ``kernel_id`` failed, mark the kernel dead with the reason; return it."""
        kernel = km._kernels.get(kernel_id)
        if kernel is None:
            return None
        if error is None:
            ready = getattr(kernel, "ready", None)
            if ready is None or not ready.done() or ready.cancelled() or ready.exception() is None:
                return None
            error = ready.exception()
        prov = self.provisioner_of(kernel_id)
        told = prov is not None and bool(prov.failure)  # the provisioner said why, in one line
        reason = (prov.failure if prov is not None and prov.failure else None) or f"the kernel did not start: {one_line(error)}"
        self._failed[kernel_id] = reason
        kernel.execution_state = "dead"
        kernel.reason = reason
        (self.log.debug if told else self.log.warning)("gpupool: kernel %s failed to start: %s", kernel_id, reason)
        return reason

    #: Seconds a restart request waits for the kernel to be back before answering (it goes on in the background).
    restart_answer_wait = 60.0

    async def _restart(self, km: Any, original: Any, kernel_id: str, now: bool) -> Any:
        kernel = km.get_kernel(kernel_id)  # KeyError → 404 as before
        mine = getattr(kernel, "provisioner", None) is None or self.provisioner_of(kernel_id) is not None
        in_progress = self._restarts.get(kernel_id)
        ready = getattr(kernel, "ready", None)
        if mine and ((in_progress is not None and not in_progress.done()) or (ready is not None and not ready.done())):
            # Still starting, restarting or waiting for its slice: the process it will get is already a fresh one.
            phase = getattr(self.provisioner_of(kernel_id), "phase", "new")
            self.log.info("gpupool: restart of kernel %s, which is still starting (%s): nothing to restart", kernel_id, phase)
            return None
        if not mine:
            return await original(kernel_id, now=now)  # not one of ours: jupyter_client's own answer
        self._failed.pop(kernel_id, None)
        task = asyncio.ensure_future(original(kernel_id, now=now))
        self._restarts[kernel_id] = task
        task.add_done_callback(lambda t: self._restarts.pop(kernel_id, None) if self._restarts.get(kernel_id) is t else None)
        deadline = time.monotonic() + self.restart_answer_wait
        while not task.done() and time.monotonic() < deadline:
            prov = self.provisioner_of(kernel_id)
            if prov is not None and prov.phase == "waiting":
                break  # queued for a new slice: answer now, the kernel shows its queue position
            await asyncio.wait([task], timeout=0.1)
        if not task.done():
            task.add_done_callback(lambda t: self._restart_done(km, kernel_id, t, background=True))
            return None
        return self._restart_done(km, kernel_id, task)

    def _restart_done(self, km: Any, kernel_id: str, task: asyncio.Future[Any], background: bool = False) -> Any:
        """The result of a restart; one the pool made fail leaves the kernel dead with the reason (not a 500)."""
        if task.cancelled():
            return None
        error = task.exception()
        if error is None:
            return task.result()
        prov = self.provisioner_of(kernel_id)
        if isinstance(error, GpuPoolError) or (prov is not None and prov.failure):
            self._note_failed_start(km, kernel_id, error)
            return None
        if background:
            self.log.error("gpupool: restart of kernel %s failed: %s", kernel_id, one_line(error))
            return None
        raise error

    def withdraw_queued(self, kernel_id: str, reason: str) -> Lease | None:
        """Release the lease of ``kernel_id`` if it is still queued (its start then fails fast)."""
        lease = self.pool.lease_for_kernel(kernel_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            return None
        return self.pool.release(lease.id, reason=reason)

    _metrics_collector: ClassVar[Any] = None  # the one collector this process registered

    def _register_metrics(self, pool: Any) -> None:
        """Add the pool's collector to the registry jupyter_server serves at ``/metrics``
        (authenticated unless ``ServerApp.authenticate_prometheus`` is turned off)."""
        if getattr(pool, "remote", False):
            return  # the broker serves the pool's metrics
        from prometheus_client import REGISTRY


        previous = type(self)._metrics_collector
        if previous is not None:
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(previous)
        collector = PoolCollector(pool)
        REGISTRY.register(collector)
        type(self)._metrics_collector = collector

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        self._ensure_started()

    def _ensure_started(self) -> None:
        """Start the periodic loops once, on the running event loop (the pool's loops once it is open)."""
        loop = asyncio.get_running_loop()
        if not self._tasks:
            self._tasks.append(loop.create_task(self._reopen_until_available()))
        if self._pool is None or len(self._tasks) > 1:
            return
        self._tasks += [
            loop.create_task(self._every(lambda: self.tick_interval, self.tick_once, "tick")),
            loop.create_task(self._every(lambda: self.reconcile_interval, self.reconcile_once, "reconcile")),
            loop.create_task(self._follow_changes()),
        ]
        if self.watchdog_enabled and not getattr(self._pool, "remote", False):
            self.watchdog = Watchdog(backend=self._pool.backend, pool=self._pool, parent=self)
            self._tasks.append(loop.create_task(self._every(lambda: self.watchdog.interval, self.watchdog_once, "watchdog")))

    async def _follow_changes(self) -> None:
        """Act on the pool the moment it changed (see jupyter_gpupool.backends.changes): in this process, in
        another sharing the pool file, or behind the broker. No suspend, restore or move waits for
        ``tick_interval``; the tick remains for activity reports and the scheduler's clock."""
        loop = asyncio.get_running_loop()
        changed = self._changed = asyncio.Event()
        subscribe = getattr(self._pool, "subscribe_changes", None)
        if not callable(subscribe):
            return  # a pool that cannot tell (Slurm): the tick does it
        self._unsubscribe_changes = subscribe(lambda: loop.call_soon_threadsafe(changed.set))
        try:
            while True:
                await changed.wait()
                changed.clear()
                try:
                    await self.act_on_changes()
                except asyncio.CancelledError:
                    raise
                except GpuPoolError as err:  # the tick reports an unavailable pool; once here is enough
                    self.log.debug("gpupool: acting on a change of the pool failed: %s", err)
                except Exception:
                    self.log.exception("gpupool: acting on a change of the pool failed")
                # A burst of commits is one round (behind a broker each round is a few HTTP reads).
                await asyncio.sleep(self.change_debounce * (5 if getattr(self._pool, "remote", False) else 1))
        finally:
            unsubscribe, self._unsubscribe_changes = self._unsubscribe_changes, None
            if unsubscribe is not None:
                with contextlib.suppress(Exception):
                    unsubscribe()

    #: Seconds between two rounds of acting on changes (a burst of commits is read once).
    change_debounce = 0.02

    async def _reopen_until_available(self) -> None:
        """While the pool could not be opened, try again every ``retry_interval`` seconds."""
        while self._pool is None:
            await asyncio.sleep(max(0.05, float(self.retry_interval)))
            if await asyncio.to_thread(self.open_pool):
                self._ensure_started()

    async def stop_extension(self) -> None:
        """Stop the loops, withdraw queued starts, shut our kernels down (releasing their slices).

        Each step on its own: whatever failed before (a pool that never opened), the server stops.
        """
        self._stopping = True
        tasks, self._tasks = list(getattr(self, "_tasks", [])) + list(getattr(self, "_transition_tasks", ())), []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, 5)
        serverapp = self.serverapp
        km = getattr(serverapp, "kernel_manager", None)
        if km is not None and self._pool is not None:
            for kernel_id in list(km.list_kernel_ids()):
                with contextlib.suppress(Exception):
                    withdrawn = self.withdraw_queued(kernel_id, "server stopped while the kernel was queued")
                    if withdrawn is not None:
                        self.emit("released", withdrawn, message=withdrawn.release_reason)
        gateway = getattr(self, "gateway", None)
        if gateway is not None:
            gateway.stop()  # the gateway's kernels are jupyter_server's to shut down, as without the extension
        elif km is not None:
            with contextlib.suppress(Exception):
                await km.shutdown_all()
        clocks = getattr(self, "_activity_clocks", None)
        if clocks is not None:
            clocks.close()
        restore = getattr(self, "_restore_spec_manager", None)
        if restore is not None:
            restore()

    #: Steps whose failure with PoolUnavailable means the pool is unavailable (shown to users), not just a failed step.
    POOL_STEPS = ("tick", "reconcile")

    async def _every(self, interval: Any, step: Any, name: str) -> None:
        last_problem = ""
        while True:
            try:
                await step()
                if last_problem:
                    self.log.info("gpupool: %s works again", name)
                last_problem = ""
                if name in self.POOL_STEPS and self._failed_call:
                    self._set_available()
            except asyncio.CancelledError:
                raise
            except GpuPoolError as err:  # e.g. the broker is down: one line, once, not a traceback a second
                if name in self.POOL_STEPS and isinstance(err, PoolUnavailable):
                    self._failed_call = True
                    self._set_unavailable(err)
                elif str(err) != last_problem:
                    self.log.warning("gpupool: %s step failed: %s", name, err)
                last_problem = str(err)
            except Exception:
                self.log.exception("gpupool: %s step failed", name)
            await asyncio.sleep(max(0.05, float(interval())))

    # --- kernels and their leases -----------------------------------------------------------------

    def provisioner_of(self, kernel_id: str) -> GpuPoolProvisioner | None:
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        if kernel_id not in km:
            return None
        prov = getattr(km.get_kernel(kernel_id), "provisioner", None)
        return prov if isinstance(prov, GpuPoolProvisioner) else None

    def _kernel_leases(self) -> dict[str, tuple[GpuPoolProvisioner, Lease]]:
        """Kernel id → (provisioner, current lease) for our kernels that have requested one."""
        assert self.serverapp is not None
        result = {}
        for kernel_id in list(self.serverapp.kernel_manager.list_kernel_ids()):
            prov = self.provisioner_of(kernel_id)
            if prov is None or not prov.lease_id:
                continue
            try:
                lease = self.pool.get(prov.lease_id)
                if lease.state is LeaseState.RELEASED:
                    # The kernel gave it back and asked anew itself (%gpupool release, reserve): follow it.
                    newer = self.pool.lease_for_kernel(kernel_id)
                    if newer is not None:
                        prov.lease_id, lease = newer.id, newer
                result[kernel_id] = (prov, lease)
            except GpuPoolError as err:  # e.g. a pool file replaced under us: skip this kernel
                self.log.debug("gpupool: lease %s of kernel %s: %s", prov.lease_id, kernel_id, err)
        return result

    async def tick_once(self) -> list[Decision]:
        """Report activity, run the scheduler, carry out reclaims of our kernels."""
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        # jupyter_server's last_activity and execution_state, less the quiet channel (the widget's
        # refreshes and our own requests to a kernel are no activity): see jupyter_gpupool.quiet.
        clocks: ActivityClocks | None = getattr(self, "_activity_clocks", None)
        if clocks is None:
            clocks = self._activity_clocks = ActivityClocks(km)
        activities: dict[str, Activity] = {}
        kernel_ids = list(km.list_kernel_ids())
        clocks.forget_others(kernel_ids)
        for kernel_id in kernel_ids:
            prov = self.provisioner_of(kernel_id)
            if prov is None or not prov.lease_id or prov.phase not in ("running", "launching"):
                continue
            kernel = km.get_kernel(kernel_id)
            clock = clocks.clock(kernel_id)
            last = clock.last_activity if clock is not None else getattr(kernel, "last_activity", None)
            state = clock.execution_state if clock is not None else getattr(kernel, "execution_state", None)
            connections = 0
            with contextlib.suppress(Exception):
                connections = int(km._kernel_connections.get(kernel_id, 0))
            activities[prov.lease_id] = Activity(
                busy=state == "busy",
                last_activity=last.timestamp() if last is not None else None,
                connections=connections,
            )

        stale = [p for k in km.list_kernel_ids() if (p := self.provisioner_of(k)) is not None and p.stale_lease_id]

        def step() -> tuple[list[Decision], dict[str, tuple[GpuPoolProvisioner, Lease]], list[tuple[GpuPoolProvisioner, Lease]]]:
            decisions = self.pool.tick(activities=activities)
            handed_back = []
            for prov in stale:  # leases held before a CPU-only restart: the pool answers again, hand them back
                lease = prov._release_stale_quietly("its kernel restarted CPU-only while the pool was unavailable")
                if lease is not None:
                    handed_back.append((prov, lease))
            return decisions, self._kernel_leases(), handed_back

        decisions, leases, handed_back = await asyncio.to_thread(step)
        self.follow_sizes(leases)
        for prov, lease in handed_back:  # told on the event loop: events need it
            prov._notify("released", lease, None, lease.release_reason)
        await self._act_on(leases, activities)
        self.tick_count += 1
        return decisions

    async def act_on_changes(self) -> None:
        """Carry out at once what the pool now says about our kernels (a suspend, restore or move,
        a warning, a reclaim), whoever decided it: called whenever the pool changed."""
        leases = await asyncio.to_thread(self._kernel_leases)
        await self._act_on(leases, {})
        self.change_count += 1

    async def _act_on(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]], activities: dict[str, Activity]) -> None:
        """Act on our kernels' leases as read; one caller at a time (the tick and the change follower)."""
        async with self._act_lock:
            await self._act_on_leases(leases, activities)

    async def _act_on_leases(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]], activities: dict[str, Activity]) -> None:
        # State, not decisions: another process sharing the pool file (nbconvert waiting for a
        # grant) may be the one whose scheduler run warned or reclaimed one of our kernels.
        for kernel_id, (prov, lease) in leases.items():
            if lease.state in (LeaseState.GRANTED, LeaseState.SUSPENDED) and lease.reclaim_at is not None:
                if self._warned.get(lease.id) != lease.reclaim_at:
                    self._warned[lease.id] = lease.reclaim_at
                    self.emit("warned", lease, message=lease.reclaim_reason, deadline=lease.reclaim_at)
            elif (
                lease.state is LeaseState.RELEASED
                and lease.release_reason.startswith(RECLAIM_PREFIXES)
                and prov.phase == "running"
                and kernel_id not in self._acting
                and kernel_id not in self._culled
            ):
                self._warned.pop(lease.id, None)
                action = "preempted" if lease.release_reason.startswith("preempted") else "reclaimed"
                if lease.release_reason.startswith("stopped"):
                    action = "stopped"
                self.emit(action, lease, message=lease.release_reason)
                await self.reclaim_kernel(kernel_id, lease)
            elif lease.transition is not Transition.NONE and lease.id not in self._moving and prov.phase == "running":
                self._moving.add(lease.id)
                self._spawn(self._carry_out_transition(kernel_id, prov, lease))
            elif lease.state is LeaseState.SUSPENDED and activities.get(lease.id, Activity(busy=False)).busy:
                # Work arrived (a cell, from a client without our kernel extension): bring it back.
                resumed = await asyncio.to_thread(self.pool.resume, lease.id)
                self.emit("resuming", resumed, message="resuming: the kernel got work")

    # --- suspend, resume and moves ----------------------------------------------------------------

    @property
    def checkpointer(self) -> Any:
        """This host's way to park and restore a kernel's GPU memory (see devices/checkpoint.py).

        The server checkpoints its own kernels, whoever keeps the books: with a broker, the kind of
        GPUs is the broker's (NVML: this host's driver; simulated: files beside the server)."""
        if self._checkpointer is None:
            backend = self.pool.backend
            if getattr(backend, "name", "") == "remote":
                backend = self._local_backend_like(backend)
            self._checkpointer = checkpointer_for(backend)
        return self._checkpointer

    def _local_backend_like(self, remote: Any) -> Any:
        """A device backend of this host of the broker's kind, for checkpoints only."""
        kind = str(self.pool.info().get("backend", {}).get("name", "")) if hasattr(self.pool, "info") else ""
        if kind == "nvml":
            return NvmlBackend()
        if kind == "simulated":
            local = SimulatedBackend.from_spec(getattr(remote, "spec", "") or "1x16GiB")
            runtime = getattr(self.serverapp, "runtime_dir", None) or os.getcwd()
            local.usage_dir = os.path.join(runtime, "gpupool-usage")
            return local
        return remote

    def can_suspend(self) -> bool:
        """Whether kernels started now may be suspended instead of culled (told to the pool per lease)."""
        if self.reclaim_action != "suspend" or self._pool is None:
            return False
        try:
            return bool(self.checkpointer.probe().supported)
        except Exception as err:  # noqa: BLE001 - a probe that breaks means: cull, as before
            self.log.warning("gpupool: checkpoint support could not be probed: %s", err)
            return False

    def _spawn(self, coroutine: Any) -> None:
        """Run a suspend, restore or move beside the tick (each takes seconds); stopped with the server."""
        task = asyncio.ensure_future(coroutine)
        self._transition_tasks.add(task)
        task.add_done_callback(self._transition_tasks.discard)

    async def _carry_out_transition(self, kernel_id: str, prov: GpuPoolProvisioner, lease: Lease) -> None:
        """Do what the engine decided for this kernel's GPU memory, then confirm (or report the failure)."""
        process = getattr(prov, "process", None)
        pid = getattr(process, "pid", None)
        step = lease.transition
        try:
            pending = self._unconfirmed.get(lease.id)
            if pending is not None and pending[0] is step:  # done already: only the pool's answer was lost
                done = await asyncio.to_thread(self.pool.confirm_transition, lease.id, pending[1])
                self._unconfirmed.pop(lease.id, None)
                if step is Transition.RESTORING:
                    self._observe_restore(lease)
                self.emit({Transition.SUSPENDING: "suspended", Transition.MIGRATING: "migrated"}.get(step, "resumed"), done)
                return
            if pid is None:
                raise CheckpointError("the kernel has no process on this host")
            if step is Transition.SUSPENDING:
                await self._suspend(kernel_id, lease, pid)
            elif step is Transition.RESTORING:
                await self._restore(kernel_id, lease, pid, dict(zip(lease.home_devices, lease.devices)))
            elif step is Transition.MIGRATING:
                await self._move(kernel_id, lease, pid)
        except CheckpointError as err:
            self.log.warning("gpupool: %s of kernel %s failed: %s", step.value, kernel_id, err)
        except GpuPoolError as err:  # the pool could not be told: the engine's timeout settles it
            self.log.warning("gpupool: %s of kernel %s could not be confirmed: %s", step.value, kernel_id, err)
        except Exception:
            self.log.exception("gpupool: %s of kernel %s failed", step.value, kernel_id)
        finally:
            self._moving.discard(lease.id)

    async def _suspend(self, kernel_id: str, lease: Lease, pid: int) -> None:
        refusal = self.checkpointer.supports_devices([d for d in self.pool.devices() if d.uuid in lease.devices])
        try:
            if refusal:
                raise CheckpointError(refusal)
            freed = await self._free_caches(kernel_id, lease)
            parked = (await self._park(kernel_id, lease, pid)).parked
        except CheckpointError as err:
            running = getattr(err, "state", "running") in ("running", "")  # a failed checkpoint is undone where it can be
            after = await asyncio.to_thread(self.pool.fail_transition, lease.id, str(err), running)
            what = "the kernel was shut down instead" if after.state is LeaseState.RELEASED else "the kernel keeps running"
            self.emit("suspend_failed", after, message=f"suspending failed: {err}; {what}")
            raise
        done = await self._confirm(lease, parked)
        first = f"; {format_size(freed)} of framework cache freed first" if freed else ""
        by = self._parking.get(lease.id, {}).get("path") or "driver checkpoint"
        note = self._parking.get(lease.id, {}).get("path_note")
        first += f"; {note}" if note else ""  # why a faster path was not used
        self.log.info("gpupool: kernel %s suspended (%s parked by %s%s): %s", kernel_id, format_size(parked), by, first, lease.suspend_reason)
        self.emit("suspended", done, message=f"suspended ({format_size(parked)} parked in host RAM by {by}{first}): {lease.suspend_reason}")

    def _parking_paths(self) -> list[ParkingPath]:
        """The paths a park tries, fastest first; the driver checkpoint last (the fallback)."""
        driver = DriverCheckpointPath(self.checkpointer)
        if not self.fast_parking:
            return [driver]
        pinned = PoolPinnedBackups(self.pool) if supports(self.pool, Capability.SUSPEND) else None
        probe_timeout = self.free_caches_timeout if self.free_caches_timeout > 0 else 5.0
        return [FrameworkPath(driver, pinned, reply_timeout=self.checkpoint_timeout, probe_timeout=probe_timeout), driver]

    def _parking_kernel(self, kernel_id: str, lease: Lease, pid: int) -> ParkingKernel:
        """The kernel as the parking paths see it: its process, and its quiet channel where it answers."""
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager

        async def ask(action: str, timeout: float, **content: Any) -> dict[str, Any] | None:
            return await quiet_request(km.get_kernel(kernel_id), action, timeout, **content)

        reachable = kernel_id not in self._no_quiet_answer  # a kernel that never answered is not asked again
        return ParkingKernel(pid=pid, lease_id=lease.id, ask=ask if reachable else None, lock_timeout=self.checkpoint_timeout)

    async def _park(self, kernel_id: str, lease: Lease, pid: int) -> Parked:
        """Park the kernel through the first path that takes it (see devices/parking.py); remember which."""
        kernel = self._parking_kernel(kernel_id, lease, pid)
        path, parked = await park_kernel(self._parking_paths(), kernel)
        self._parked_by[lease.id] = (path, parked, kernel)
        entry = self._parking.setdefault(lease.id, {"used_before": lease.used_memory, "cache_freed": None})
        entry.update(path=parked.path, path_note=parked.note or None)
        return parked

    async def _unpark(self, kernel_id: str, lease: Lease, pid: int, moved: dict[str, str] | None) -> None:
        """Bring back what :meth:`_park` parked, by the path that parked it. A kernel this server does
        not know the path of (it parked it before a restart) is restored by the driver checkpoint,
        then asked to map back any framework memory it released (a no-op where it released none)."""
        by = self._parked_by.get(lease.id)
        if by is None:
            await asyncio.to_thread(self.checkpointer.resume, pid, moved)
            kernel = self._parking_kernel(kernel_id, lease, pid)
            if kernel.ask is not None:
                reply = await kernel.ask("unpark_framework", timeout=max(1.0, self.free_caches_timeout))
                if reply is not None and reply.get("status") != "ok":
                    raise CheckpointError(f"the kernel's CUDA context is back but its PyTorch memory is not ({reply.get('message')}); "
                                          "restart the kernel", state="failed")
            return
        path, parked, kernel = by
        await path.unpark(kernel, parked, moved)
        self._parked_by.pop(lease.id, None)

    async def _restore(self, kernel_id: str, lease: Lease, pid: int, mapping: dict[str, str], action: str = "resumed") -> None:
        moved = {old: new for old, new in mapping.items() if old != new}
        try:
            await self._unpark(kernel_id, lease, pid, moved or None)
        except CheckpointError as err:
            parked = getattr(err, "state", "") == "suspended"  # nothing lost: it may be tried again
            after = await asyncio.to_thread(self.pool.fail_transition, lease.id, str(err), parked)
            if after.state is LeaseState.RELEASED:
                await self._stop_kernel(kernel_id, after)
            else:
                self.emit("suspend_failed", after, message=after.suspend_reason)
            raise
        started = lease.transition_at or time.time()
        done = await self._confirm(lease, None)
        if lease.transition is Transition.RESTORING:
            self._observe_restore(lease)
        where = "onto another GPU of the same model" if moved else "on its GPU"
        self.emit(action, done, message=f"{action} {where} after {time.time() - started:.1f} s")

    async def _free_caches(self, kernel_id: str, lease: Lease) -> int:
        """Ask the kernel to free its frameworks' cached GPU memory before it is parked (the quiet
        channel: its control channel, not a cell, not activity, answered while a cell waits); bytes
        freed (0 when it did not answer within ``free_caches_timeout``: the checkpoint goes ahead)."""
        self._parking[lease.id] = {"used_before": lease.used_memory, "cache_freed": None}
        if self.free_caches_timeout <= 0 or kernel_id in self._no_quiet_answer:
            return 0
        assert self.serverapp is not None
        try:
            kernel = self.serverapp.kernel_manager.get_kernel(kernel_id)
            reply = await quiet_request(kernel, "free_caches", self.free_caches_timeout)
        except Exception as err:  # noqa: BLE001 -- the checkpoint goes ahead, caches and all
            self.log.info("gpupool: kernel %s: could not ask it to free its caches before parking: %s", kernel_id, err)
            return 0
        if reply is None:
            self._no_quiet_answer.add(kernel_id)
            self.log.info("gpupool: kernel %s did not answer a request to free its caches (no gpupool kernel extension?); "
                          "parking its GPU memory as it is", kernel_id)
            return 0
        if reply.get("status") != "ok":
            self.log.info("gpupool: kernel %s could not free its caches: %s", kernel_id, reply.get("message"))
            return 0
        freed = max(0, int(reply.get("freed") or 0))
        self._parking[lease.id] = {"used_before": lease.used_memory, "cache_freed": freed, "held": reply.get("held")}
        return freed

    def parking_of(self, lease: Lease | None) -> dict[str, Any] | None:
        """For a suspended (or resuming) lease: the GPU memory its kernel used before it was parked,
        and how much framework cache was freed first (None where this server did not park it)."""
        if lease is None:
            return None
        parked = lease.state is LeaseState.SUSPENDED or lease.resuming or lease.transition is Transition.RESTORING
        return self._parking.get(lease.id) if parked else None

    def _observe_restore(self, lease: Lease) -> None:
        """Count a confirmed restore in ``gpupool_restore_seconds`` (from the resumed kernel's grant
        to now), on this server's /metrics, as the broker counts those it confirms."""
        collector = type(self)._metrics_collector
        if collector is not None and lease.transition_at is not None:
            collector.observe_restore(max(0.0, time.time() - lease.transition_at))

    async def _confirm(self, lease: Lease, parked: int | None) -> Lease:
        """Tell the pool the step is done; if it cannot be told, remember it (the next tick confirms
        again instead of checkpointing a process that is already parked)."""
        self._unconfirmed[lease.id] = (lease.transition, parked)
        done = await asyncio.to_thread(self.pool.confirm_transition, lease.id, parked)
        self._unconfirmed.pop(lease.id, None)
        return done

    async def _move(self, kernel_id: str, lease: Lease, pid: int) -> None:
        """Live defragmentation: park the kernel's memory, restore it on the GPU the engine chose."""
        self.emit("migrating", lease, message=lease.suspend_reason)
        try:
            await self._free_caches(kernel_id, lease)
            await self._park(kernel_id, lease, pid)
        except CheckpointError as err:
            running = getattr(err, "state", "running") in ("running", "")
            after = await asyncio.to_thread(self.pool.fail_transition, lease.id, str(err), running)
            if after.state is LeaseState.RELEASED:
                await self._stop_kernel(kernel_id, after)
            else:
                self.emit("suspend_failed", after, message=f"moving failed: {err}; the kernel keeps running where it was")
            raise
        await self._restore(kernel_id, lease, pid, dict(zip(lease.migrate_from, lease.devices)), action="migrated")

    async def _stop_kernel(self, kernel_id: str, lease: Lease) -> None:
        """A kernel whose GPU memory could not be restored cannot go on: shut it down, saying why."""
        self._culled[kernel_id] = lease.release_reason
        self.emit("stopped", lease, message=lease.release_reason)
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        with contextlib.suppress(Exception):
            km.get_kernel(kernel_id).reason = f"GPU slice {lease.release_reason}"  # type: ignore[attr-defined]  # ServerKernelManager's
        try:
            await km.shutdown_kernel(kernel_id)
        except Exception:
            self.log.exception("gpupool: could not shut down kernel %s", kernel_id)

    async def reclaim_kernel(self, kernel_id: str, lease: Lease) -> None:
        """Carry out the engine's release of ``kernel_id``'s slice: shut the kernel down. (A reclaim
        that suspends is a transition instead: see :meth:`_carry_out_transition`.)"""
        await self._reclaim_cull(kernel_id, lease)

    async def _reclaim_cull(self, kernel_id: str, lease: Lease) -> None:
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        reason = lease.release_reason or "GPU slice reclaimed"
        self._acting.add(kernel_id)
        self._culled[kernel_id] = reason
        self.log.warning("gpupool: shutting down kernel %s: %s", kernel_id, reason)
        kernel = km.get_kernel(kernel_id)
        with contextlib.suppress(Exception):
            kernel.reason = f"GPU slice {reason}"  # type: ignore[attr-defined]  # ServerKernelManager's
        self.emit("culled", lease, message=f"kernel shut down: its GPU slice was {reason}")
        try:
            await km.shutdown_kernel(kernel_id)
        except Exception:
            self.log.exception("gpupool: could not shut down kernel %s", kernel_id)
        finally:
            self._acting.discard(kernel_id)

    def live_kernel_ids(self) -> set[str]:
        """Kernels whose process runs, or that are starting, queued, restarting or shutting down (their own
        cleanup releases the slice with the right reason; once gone from the server they are reconciled)."""
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        live: set[str] = set()
        # A start under way is not in the map until it has started (no pending kernels): it is live.
        live.update(kernel_id for kernel_id, task in list(km._pending_kernels.items()) if not task.done())
        for kernel_id in list(km.list_kernel_ids()):
            prov = self.provisioner_of(kernel_id)
            if prov is None or prov.phase in ("new", "waiting", "launching", "restarting", "stopping"):
                live.add(kernel_id)
                continue
            process = getattr(prov, "process", None)
            if process is not None and process.poll() is None:
                live.add(kernel_id)
        return live

    async def reconcile_once(self) -> list[Lease]:
        """Release leases of kernels that are gone or whose process died."""
        host, pid = holder_identity()
        live = self.live_kernel_ids()
        released = await asyncio.to_thread(self.pool.reconcile_kernels, host, pid, live)
        for lease in released:
            self.log.warning("gpupool: kernel %s is gone: released its lease %s", lease.kernel_id, lease.id)
            self.emit("released", lease, message=lease.release_reason or "its kernel is gone")
        self.reconcile_count += 1
        return released

    async def watchdog_once(self) -> None:
        """One watchdog step: usage of our kernels' granted leases against their slices, and every
        GPU process of this host set against every live lease of the pool (unpooled use)."""
        leases = await asyncio.to_thread(self._kernel_leases)
        live = await asyncio.to_thread(lambda: {lease.id: lease for lease in self.pool.leases()})
        roots: dict[str, int] = {}
        limits: dict[str, int | None] = {}
        kernel_of: dict[str, str] = {}
        own_pids: dict[int, str] = {}
        by_kernel = {lease.kernel_id: lease for lease in live.values() if lease.kernel_id}
        for kernel_id, (prov, lease) in list(leases.items()):
            lease = by_kernel.get(kernel_id, lease)  # a kernel that released its lease and reserved anew has the new one
            leases[kernel_id] = (prov, lease)
            if prov.pid:
                own_pids[int(prov.pid)] = kernel_id
                roots[lease.id] = int(prov.pid)  # a kernel whose lease is suspended, too: its use is unpooled
                kernel_of[lease.id] = kernel_id
            if lease.state is LeaseState.GRANTED and prov.pid:
                limits[lease.id] = lease.watch_limit()  # an elastic slice's limit, or its size once its burst was taken back
        self.watchdog.act_on_process = lambda use, action: (
            None if use.pid in own_pids else self.watchdog._signal_process(use, action)  # our kernels: below, through the kernel manager
        )
        report = await asyncio.to_thread(self.watchdog.check, roots, limits, None, live, HOSTNAME)
        assert self.serverapp is not None
        km: Any = self.serverapp.kernel_manager  # async at run time, whatever MultiKernelManager's annotations say
        if any(d.kind in (DecisionKind.GROW, DecisionKind.SHRINK) for d in report.decisions):
            grown = {d.lease_id for d in report.decisions}
            fresh = await asyncio.to_thread(lambda: {l.id: l for l in self.pool.leases() if l.id in grown})
            self.follow_sizes({k: (p, fresh.get(l.id, l)) for k, (p, l) in leases.items()})
        for kind, use, action, line in report.unpooled_events:
            own_kernel = own_pids.get(use.pid)
            if own_kernel is not None:
                self.emit(
                    "over_limit" if kind == "warn" else "interrupted" if action == "interrupt" else "stopped",
                    leases[own_kernel][1],
                    message=line,
                )
                if kind == "act" and own_kernel in km:
                    await (km.interrupt_kernel(own_kernel) if action == "interrupt" else km.shutdown_kernel(own_kernel))
            elif kind == "warn":
                self.emit_unpooled(use.bytes, use.device)
        for event in report.events:
            event_kernel = kernel_of.get(event.lease_id)
            if event_kernel is None:
                continue
            lease = leases[event_kernel][1]
            if event.kind == "warn":
                self.emit("over_limit", lease, message=event.message, deadline=event.deadline)
            elif event.kind == "clear":
                self.emit("within_limit", lease, message=event.message)
            elif event.kind == "act":
                self.emit("interrupted" if event.action == "interrupt" else "stopped", lease, message=event.message)
                if event.action == "interrupt":
                    await km.interrupt_kernel(event_kernel)
                elif event.action == "stop":
                    await km.shutdown_kernel(event_kernel)

    # --- elastic slices: the kernel's caps follow its size -------------------------------------------

    def follow_sizes(self, leases: dict[str, tuple[GpuPoolProvisioner, Lease]]) -> None:
        """Move each running kernel's framework caps to its slice's current size when the pool
        grew it or took its burst back (through the quiet channel: no activity), and tell the user."""
        for kernel_id, (prov, lease) in leases.items():
            if lease.state is not LeaseState.GRANTED or prov.phase != "running" or not prov.pid:
                self._caps_sent.pop(lease.id, None)
                continue
            sent = self._caps_sent.setdefault(lease.id, lease.guarantee_size)  # it started at its guarantee
            if lease.memory == sent:
                continue
            self._caps_sent[lease.id] = lease.memory
            shrinking = lease.memory < sent
            if shrinking or lease.burst_note.startswith("burst taken back"):
                self.emit("burst_taken_back", lease, message=lease.burst_note or f"the slice is {format_size(lease.memory)} now")
            else:
                self.emit("grown", lease, message=lease.burst_note or f"the slice grew to {format_size(lease.memory)}")
            self._spawn(self._move_caps(kernel_id, lease, free_cache=shrinking))

    async def _move_caps(self, kernel_id: str, lease: Lease, free_cache: bool) -> dict[str, Any] | None:
        """Ask the kernel (a quiet control request: it is answered while a cell runs, and is no
        activity) to free its frameworks' caches if ``free_cache`` and set its caps to the slice."""
        assert self.serverapp is not None
        km = self.serverapp.kernel_manager
        if kernel_id not in km:
            return None
        gpu_memory = min((d.memory_total for d in self.pool.devices() if d.uuid in lease.devices), default=None)
        try:
            reply = await quiet_request(
                km.get_kernel(kernel_id), "set_caps", self.caps_timeout,
                limit=int(lease.memory), free_cache=free_cache, gpu_memory=gpu_memory,
            )
        except Exception as err:  # noqa: BLE001 - a kernel without the extension, or busy in C code: the watchdog still holds it
            self.log.warning("gpupool: could not move the caps of kernel %s to %s: %s", kernel_id, format_size(lease.memory), err)
            return None
        if reply is None or reply.get("status") != "ok":
            why = "no answer" if reply is None else reply.get("message", "an error")
            self.log.warning("gpupool: could not move the caps of kernel %s to %s: %s", kernel_id, format_size(lease.memory), why)
        return reply

    def emit_unpooled(self, nbytes: int, device: str) -> None:
        """Emit an ``unpooled`` event (no lease; never whose): front ends re-read the pool view."""
        data: dict[str, Any] = {
            "action": "unpooled", "lease_id": None, "kernel_id": None, "state": None, "memory": int(nbytes),
            "guarantee": None, "limit": None,
            "queue_position": None, "queue_length": None, "deadline": None,
            "message": f"{format_size(nbytes)} of GPU {device} is used outside the pool; the pool does not grant it",
        }
        if self.event_logger is None:  # the server has no event logger: nothing to emit to
            return
        try:
            self.event_logger.emit(schema_id=LEASE_SCHEMA_ID, data=data)
        except Exception:
            self.log.exception("gpupool: could not emit an unpooled event")

    # --- views ----------------------------------------------------------------------------------

    def culled_reason(self, kernel_id: str) -> str | None:
        return self._culled.get(kernel_id)

    def plan_for(self, lease: Lease) -> EnforcementPlan:
        return plan_enforcement(lease, self.pool.devices(), self.enforcement)

    def failure_of(self, kernel_id: str) -> str | None:
        """Why the last start of ``kernel_id`` failed (None if it did not, or if it is gone)."""
        prov = self.provisioner_of(kernel_id)
        if prov is not None and prov.failure and prov.phase == "failed":
            return prov.failure
        return self._failed.get(kernel_id)

    def kernel_status(self, kernel_id: str, lease: Lease | None) -> dict[str, Any]:
        """The ``GET /api/gpupool/kernels/{kernel_id}`` body (see openapi.yaml): ``failed`` with the
        reason for a kernel whose start failed, ``unavailable`` for one running CPU-only because
        the pool could not be used, else its lease."""
        now = time.time()
        failure = self.failure_of(kernel_id)
        if failure is not None:
            return kernel_status_without_pool(kernel_id, self.owner, now, "failed", failure, lease)
        prov = self.provisioner_of(kernel_id)
        if prov is not None and prov.cpu_only_reason and not prov.lease_id:
            return kernel_status_without_pool(
                kernel_id, self.owner, now, "unavailable", prov.cpu_only_reason, None, pool_is_back=self.available
            )
        if lease is None and prov is not None and prov.phase == "waiting" and prov.queue_update is not None:
            # Queued, and the pool cannot be asked now: what the wait last heard ("pool unavailable, retrying").
            queued, info = prov.queue_update
            return queued_status_while_unreachable(kernel_id, queued, info, self.owner, now)
        if self._pool is None or (lease is None and not self.available):
            return kernel_status_without_pool(kernel_id, self.owner, now, "unavailable", self.availability()["reason"], None)
        status = kernel_status(self.pool, kernel_id, lease, self.enforcement, self.owner, now)
        status["parking"] = self.parking_of(lease)
        return status

    # --- events -----------------------------------------------------------------------------------

    def _on_lease(self, action: str, lease: Lease, info: QueueInfo | None, message: str) -> None:
        """Listener the provisioners call (queued, waiting, granted, released)."""
        self.emit(action, lease, info=info, message=message)

    def emit(
        self,
        action: str,
        lease: Lease,
        info: QueueInfo | None = None,
        message: str = "",
        deadline: float | None = None,
    ) -> None:
        """Emit one ``lease`` event (never raises)."""
        data: dict[str, Any] = {
            "action": action,
            "lease_id": lease.id,
            "kernel_id": lease.kernel_id,
            "state": lease.state.value,
            "memory": int(lease.memory),
            "guarantee": int(lease.guarantee_size),
            "limit": int(lease.limit_size),
            "queue_position": info.position if info else None,
            "queue_length": info.length if info else None,
            "deadline": deadline,
            "message": message or lease.release_reason or "",
        }
        if self.event_logger is None:  # the server has no event logger: nothing to emit to
            return
        try:
            self.event_logger.emit(schema_id=LEASE_SCHEMA_ID, data=data)
        except Exception:
            self.log.exception("gpupool: could not emit a lease event")
