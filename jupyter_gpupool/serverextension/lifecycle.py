"""The kernel lifecycle hooks of the ``gpupool`` server extension: start, restart, shutdown, pending kernels.

Makes ``gpupool-provisioner`` the default and teaches the server's kernel manager about starts that
wait for, or are refused by, the pool: a start that must queue is answered as a pending kernel, a
shutdown withdraws a queued request, a failed start leaves the kernel ``dead`` with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import os
import time
from importlib.metadata import EntryPoint
from typing import TYPE_CHECKING, Any

from jupyter_client.multikernelmanager import AsyncMultiKernelManager
from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.handlers import MainKernelHandler
from jupyter_server.services.sessions.handlers import SessionHandler, SessionRootHandler
from tornado import web

from jupyter_gpupool.backends.factory import backend_provisioner
from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.kernel.autolease import mark_unpooled_kernelspecs
from jupyter_gpupool.provisioner.kernel_provisioner import PROVISIONER_NAME, GpuPoolProvisioner, one_line
from jupyter_gpupool.serverextension.voila import VOILA_PAGE, spared_by_culler, start_for_voila_page

if TYPE_CHECKING:
    from jupyter_gpupool.serverextension.app import GpuPoolExtension


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


def restart_window(kernel_manager: Any, kernel_id: str) -> float | None:
    """Seconds the kernel's auto-restarter takes at most to bring a dead process back or to give up
    (the server then drops the kernel): ``time_to_dead`` × (``restart_limit`` + 1) while it polls the
    kernel; None when none does."""
    try:
        manager = kernel_manager.get_kernel(kernel_id)
    except KeyError:  # removed meanwhile
        return None
    restarter: Any = getattr(manager, "_restarter", None)  # jupyter_client's IOLoopKernelManager keeps it here
    if not getattr(manager, "autorestart", False) or getattr(restarter, "_pcallback", None) is None:
        return None
    return float(restarter.time_to_dead) * (int(restarter.restart_limit) + 1)


class KernelHooks:
    """The server's kernel manager, taught about starts that wait for the pool."""

    def __init__(self, ext: GpuPoolExtension) -> None:
        self.ext = ext
        self._restarts: dict[str, asyncio.Future[Any]] = {}
        #: Kernel id → when reconciliation first found its process dead (until it is seen running again).
        self._dead_since: dict[str, float] = {}

    def install_provisioner_default(self) -> None:
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
        assert self.ext.serverapp is not None
        # A backend with its own provisioner (Slurm: kernels as jobs) makes that one the default.
        provisioner_name, target = backend_provisioner(self.ext.serverapp.config)
        KernelProvisionerFactory.provisioners.setdefault(
            provisioner_name, EntryPoint(provisioner_name, target, KernelProvisionerFactory.GROUP_NAME)
        )
        explicit = self.ext.serverapp.config.get("KernelProvisionerFactory", {}).get("default_provisioner_name")
        from_env = os.environ.get(KernelProvisionerFactory.default_provisioner_name_env)
        opted_out = (
            "c.GpuPoolExtension.make_default_provisioner = False" if not self.ext.make_default_provisioner
            else f"c.KernelProvisionerFactory.default_provisioner_name = {explicit!r}" if explicit
            else f"${KernelProvisionerFactory.default_provisioner_name_env}={from_env}" if from_env
            else ""
        )
        # Kernels this server leaves unpooled say so in their env: the kernel-side autolease stands aside.
        default = KernelProvisionerFactory(config=self.ext.serverapp.config).default_provisioner_name if opted_out else provisioner_name
        mark_unpooled_kernelspecs(self.ext.serverapp.kernel_spec_manager, default)
        if opted_out:
            if (explicit or from_env) not in (PROVISIONER_NAME, provisioner_name):
                self.ext.log.warning(
                    "gpupool: kernels of this server do not ask the GPU pool (%s): they see every GPU; "
                    "GPU memory they use shows as unpooled use, which the pool never grants", opted_out,
                )
            return
        ksm = self.ext.serverapp.kernel_spec_manager
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
                self.ext.log.warning(
                    "gpupool: kernelspec %r names provisioner %r, so its kernels do not ask the GPU pool; "
                    "GPU memory they use shows as unpooled use", kernel_name, named,
                )
            return spec

        ksm.get_kernel_spec = get_kernel_spec  # type: ignore[method-assign]  # this server's instance only
        self.ext._restore_spec_manager = lambda: ksm.__dict__.pop("get_kernel_spec", None)

    #: Seconds a shutdown waits for a start or restart in progress to end (once its queued request is withdrawn).
    shutdown_wait = 30.0

    def wrap_kernel_manager(self, km: Any) -> None:
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
            if kernel_id in self.ext._queued_starts:
                self.ext._starting[kernel_id] = manager
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
            self.ext._failed.pop(kernel_id, None)
            if present and kernel_id not in km:
                return None  # removed while we waited (a shutdown already under way): done
            return await original_shutdown(kernel_id, now=now, restart=restart)

        async def finish_kernel_start(kernel_id: str) -> None:
            await original_finish(kernel_id)
            self._note_failed_start(km, kernel_id)

        async def restart_kernel(kernel_id: str, now: bool = False) -> Any:
            return await self._restart(km, original_restart, kernel_id, now)

        async def cull_kernel_if_idle(kernel_id: str) -> Any:
            # A start still under way (a Voilà page's, listed once granted, before it returns) or one
            # waiting in the queue: passed by, its idle time starting when it stops (see spared_by_culler).
            starting = kernel_id in self.ext._queued_starts or self.waits_for_gpu(kernel_id)
            if spared_by_culler(km._kernels.get(kernel_id), starting):
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
            self.ext.pending_kernels
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
            return await start_for_voila_page(self.ext, km, original, page, *args, **kwargs)
        if not self._may_answer_pending(km) or (kernel_id is not None and kernel_id in km):
            return await self._pool_errors_as_http(original(*args, **kwargs))
        if kernel_id is None:
            kernel_id = kwargs["kernel_id"] = km.new_kernel_id()
        queued = self.ext._queued_starts[kernel_id] = asyncio.Event()
        start = asyncio.ensure_future(original(*args, **kwargs))
        waiting = asyncio.ensure_future(queued.wait())
        try:
            await asyncio.wait([start, waiting], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            start.cancel()
            raise
        finally:
            waiting.cancel()
            self.ext._queued_starts.pop(kernel_id, None)
            manager = self.ext._starting.pop(kernel_id, None)
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
        self.ext.log.info("gpupool: kernel %s waits in the queue for its GPU slice: answered as a pending kernel", kernel_id)

        def done(task: asyncio.Future[Any]) -> None:
            if task.cancelled():
                return
            error = task.exception()  # retrieved: never "exception was never retrieved"
            if error is not None and kernel_id in km:
                self._note_failed_start(km, kernel_id, error)

        start.add_done_callback(done)

    def on_queued_start(self, action: str, lease: Lease, info: QueueInfo | None, message: str) -> None:
        """Listener: a start under way (see :meth:`_start`) now waits in the queue."""
        queued = self.ext._queued_starts.get(lease.kernel_id or "")
        if action == "queued" and queued is not None:
            queued.set()

    def not_started_reason(self, kernel_id: str, action: str) -> str | None:
        """Why ``kernel_id`` cannot be interrupted or restarted now, or None: its start is still
        waiting or under way (there is no process yet), or, for an interrupt, so is its restart.
        A restart during a restart stays what :meth:`_restart` makes it (nothing to restart)."""
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        if kernel_id not in km or self.ext.gateway is not None:
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
        limit = self.shutdown_wait if not self.ext._stopping else min(self.shutdown_wait, 3.0)
        deadline = time.monotonic() + limit
        while True:
            with contextlib.suppress(Exception):  # the pool may be unavailable: shut down anyway
                reason = "kernel shut down while queued"
                withdrawn = await asyncio.to_thread(self.withdraw_queued, kernel_id, reason)
                if withdrawn is not None:
                    self.ext.emit("released", withdrawn, message=reason)
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
        self.ext.log.warning("gpupool: kernel %s is shut down while its start still waits: cancelling the start", kernel_id)
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
        self.ext._failed[kernel_id] = reason
        kernel.execution_state = "dead"
        kernel.reason = reason
        (self.ext.log.debug if told else self.ext.log.warning)("gpupool: kernel %s failed to start: %s", kernel_id, reason)
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
            self.ext.log.info("gpupool: restart of kernel %s, which is still starting (%s): nothing to restart", kernel_id, phase)
            return None
        if not mine:
            return await original(kernel_id, now=now)  # not one of ours: jupyter_client's own answer
        self.ext._failed.pop(kernel_id, None)
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
            self.ext.log.error("gpupool: restart of kernel %s failed: %s", kernel_id, one_line(error))
            return None
        raise error

    def withdraw_queued(self, kernel_id: str, reason: str) -> Lease | None:
        """Release the lease of ``kernel_id`` if it is still queued (its start then fails fast)."""
        lease = self.ext.pool.lease_for_kernel(kernel_id)
        if lease is None or lease.state is not LeaseState.QUEUED:
            return None
        return self.ext.pool.release(lease.id, reason=reason)

    def provisioner_of(self, kernel_id: str) -> GpuPoolProvisioner | None:
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        if kernel_id not in km:
            return None
        prov = getattr(km.get_kernel(kernel_id), "provisioner", None)
        return prov if isinstance(prov, GpuPoolProvisioner) else None

    def kernel_leases(self) -> dict[str, tuple[GpuPoolProvisioner, Lease]]:
        """Kernel id → (provisioner, current lease) for our kernels that have requested one."""
        assert self.ext.serverapp is not None
        result = {}
        for kernel_id in list(self.ext.serverapp.kernel_manager.list_kernel_ids()):
            prov = self.provisioner_of(kernel_id)
            if prov is None or not prov.lease_id:
                continue
            try:
                lease = self.ext.pool.get(prov.lease_id)
                if lease.state is LeaseState.RELEASED:
                    # The kernel gave it back and asked anew itself (%gpupool release, reserve): follow it.
                    newer = self.ext.pool.lease_for_kernel(kernel_id)
                    if newer is not None:
                        prov.lease_id, lease = newer.id, newer
                result[kernel_id] = (prov, lease)
            except GpuPoolError as err:  # e.g. a pool file replaced under us: skip this kernel
                self.ext.log.debug("gpupool: lease %s of kernel %s: %s", prov.lease_id, kernel_id, err)
        return result

    def live_kernel_ids(self) -> set[str]:
        """Kernels whose process runs, or that are starting, queued, restarting or shutting down (their own
        cleanup releases the slice with the right reason; once gone from the server they are reconciled)."""
        assert self.ext.serverapp is not None
        km = self.ext.serverapp.kernel_manager
        live: set[str] = set()
        # A start under way is not in the map until it has started (no pending kernels): it is live.
        live.update(kernel_id for kernel_id, task in list(km._pending_kernels.items()) if not task.done())
        dead_since, self._dead_since = self._dead_since, {}
        for kernel_id in list(km.list_kernel_ids()):
            prov = self.provisioner_of(kernel_id)
            if prov is None or prov.phase in ("new", "waiting", "launching", "restarting", "stopping"):
                live.add(kernel_id)
                if kernel_id in dead_since:  # a restart under way: the window still runs from the death
                    self._dead_since[kernel_id] = dead_since[kernel_id]
                continue
            process = getattr(prov, "process", None)
            if process is not None and process.poll() is None:
                live.add(kernel_id)
                continue
            # Its process died: its restarter brings it back on the slice it holds, or gives up and the
            # server drops the kernel. A restart that keeps failing (the restarter counts none of those)
            # keeps the slice no longer than the restarter's own window from the death.
            died = self._dead_since[kernel_id] = dead_since.get(kernel_id, time.monotonic())
            window = restart_window(km, kernel_id)
            if window is not None and time.monotonic() - died <= window:
                live.add(kernel_id)
        return live
