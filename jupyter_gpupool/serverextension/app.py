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

The extension holds the configuration (``c.GpuPoolExtension.*``) and the server's state, and
assembles its roles, each a class of its own: :class:`~.connection.PoolConnection` (opening the
pool, its health), :class:`~.lifecycle.KernelHooks` (kernel start, restart and shutdown, pending
kernels), :class:`~.transitions.TransitionDriver` (suspend, resume, move, reclaim),
:class:`~.loops.WatchLoops` (the tick, reconciling, following changes, the watchdog) and
:class:`~.wiring.HttpWiring` (kernel status views and ``lease`` events); the config guards are
:class:`~.configguard.FailClosedConfig`, and the REST handlers are in :mod:`.handlers`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, ClassVar

from jupyter_server.extension.application import ExtensionApp
from traitlets import Bool, Enum, Float, List, Unicode, default

from jupyter_gpupool.core.models import Lease, QueueInfo
from jupyter_gpupool.devices.parking import Parked, ParkingKernel, ParkingPath
from jupyter_gpupool.enforcement.plan import EnforcementSettings
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.provisioner.kernel_provisioner import (
    PROVISIONER_NAME,
    UNAVAILABLE_ENV,
    WHEN_UNAVAILABLE,
    GpuPoolProvisioner,
    ServerBinding,
    default_owner,
    one_line,
    when_unavailable_from_env,
)
from jupyter_gpupool.quiet import ActivityClocks
from jupyter_gpupool.serverextension.configguard import FailClosedConfig
from jupyter_gpupool.serverextension.connection import PoolConnection
from jupyter_gpupool.serverextension.gateway import GatewayKernels, gateway_url
from jupyter_gpupool.serverextension.lifecycle import KernelHooks, mark_rest_starts
from jupyter_gpupool.serverextension.loops import WatchLoops
from jupyter_gpupool.serverextension.transitions import TransitionDriver
from jupyter_gpupool.serverextension.voila import mark_voila_pages
from jupyter_gpupool.serverextension.wiring import LEASE_SCHEMA_ID, LEASE_SCHEMA_PATH, HttpWiring, routes


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
        help="Seconds between two reconciliations of leases against live kernels: a kernel gone from the server frees its "
        "slice within this; one whose process died keeps it while the server's auto-restarter restarts it, "
        "for at most KernelRestarter.time_to_dead x (restart_limit + 1).",
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
    _activity_clocks: ActivityClocks | None = None  # jupyter_server's activity less the quiet channel (the tick's)
    _restore_spec_manager: Any = None  # undoes the kernelspec default this server's hooks installed

    @property
    def pool(self) -> Any:
        """The open pool; raises PoolUnavailable (503 over REST) with the reason while there is none."""
        if self._pool is None:
            raise PoolUnavailable(f"the GPU pool is unavailable: {self.unavailable_reason or 'not opened yet'}")
        return self._pool

    @property
    def available(self) -> bool:
        return self._pool is not None and self.unavailable_reason is None

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
        # The roles (see the module's docstring), each keeping its own state; what more than one of
        # them reads, or that the handlers and tests look at, is the server's state, kept here.
        self.pool_connection = PoolConnection(self)
        self.kernel_hooks = KernelHooks(self)
        self.transition_driver = TransitionDriver(self)
        self.watch_loops = WatchLoops(self)
        self.http_wiring = HttpWiring(self)
        self._culled: dict[str, str] = {}  # kernel id → why the pool shut it down (its status says so)
        self._failed: dict[str, str] = {}  # kernel id → why its last start failed
        self._caps_sent: dict[str, int] = {}  # lease id → bytes per GPU its kernel's caps were last moved to
        self._transition_tasks: set[asyncio.Future[None]] = set()
        #: Lease id → the path that parked its kernel and what it parked (for its restore).
        self._parked_by: dict[str, tuple[ParkingPath, Parked, ParkingKernel]] = {}
        self._stopping = False
        self.tick_count = 0
        self.change_count = 0  # rounds of act_on_changes (a change of the pool, heard at once)
        self.reconcile_count = 0
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
            self.kernel_hooks.install_provisioner_default()
            self.kernel_hooks.wrap_kernel_manager(km)
            mark_rest_starts()
            mark_voila_pages()
        self.event_logger = self.serverapp.event_logger
        with contextlib.suppress(Exception):  # already registered by an earlier server in this process
            assert self.event_logger is not None
            self.event_logger.register_event_schema(LEASE_SCHEMA_PATH)
        self.binding = ServerBinding(
            open_pool=self.pool_connection.pool_for_kernels,
            current_owner=lambda: self.owner,
            enforcement=self.enforcement,
            listeners=[self.http_wiring.on_lease, self.kernel_hooks.on_queued_start],
            when_unavailable=lambda: self.when_unavailable,
            can_suspend=self.can_suspend,
        )
        self.settings["gpupool"] = self
        self.pool_connection.open_pool()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # the usual case: the server starts the loops in _start_jupyter_server_extension
        else:
            self.watch_loops.ensure_started()  # initialized inside a running loop (embedded servers, tests)

    def initialize_handlers(self) -> None:
        self.handlers.extend(routes())

    _metrics_collector: ClassVar[Any] = None  # the one collector this process registered

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        self.watch_loops.ensure_started()

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

    # --- what handlers, provisioners and the roles ask of the extension (each role's own answer) --------

    def availability(self) -> dict[str, Any]:
        """See :meth:`PoolConnection.availability`."""
        return self.pool_connection.availability()

    def provisioner_of(self, kernel_id: str) -> GpuPoolProvisioner | None:
        """See :meth:`KernelHooks.provisioner_of`."""
        return self.kernel_hooks.provisioner_of(kernel_id)

    def withdraw_queued(self, kernel_id: str, reason: str) -> Lease | None:
        """See :meth:`KernelHooks.withdraw_queued`."""
        return self.kernel_hooks.withdraw_queued(kernel_id, reason)

    async def _pool_errors_as_http(self, start: Any) -> Any:
        """See :meth:`KernelHooks._pool_errors_as_http`."""
        return await self.kernel_hooks._pool_errors_as_http(start)

    def can_suspend(self) -> bool:
        """See :meth:`TransitionDriver.can_suspend`."""
        return self.transition_driver.can_suspend()

    def kernel_status(self, kernel_id: str, lease: Lease | None) -> dict[str, Any]:
        """See :meth:`HttpWiring.kernel_status`."""
        return self.http_wiring.kernel_status(kernel_id, lease)

    def emit(
        self, action: str, lease: Lease, info: QueueInfo | None = None, message: str = "", deadline: float | None = None
    ) -> None:
        """See :meth:`HttpWiring.emit`."""
        self.http_wiring.emit(action, lease, info=info, message=message, deadline=deadline)

    def emit_unpooled(self, nbytes: int, device: str) -> None:
        """See :meth:`HttpWiring.emit_unpooled`."""
        self.http_wiring.emit_unpooled(nbytes, device)


__all__ = ["LEASE_SCHEMA_ID", "GpuPoolExtension"]
