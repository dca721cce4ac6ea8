"""The ``gpupool-provisioner`` kernel provisioner: every kernel start asks the pool for a slice.

It is a :class:`~jupyter_client.provisioning.LocalProvisioner` that, before launching the kernel,

1. requests a lease (size from the kernelspec's provisioner config, else the user's saved
   preference, else the policy default) and waits, asynchronously, while it is queued;
2. launches the kernel with the grant in its environment (see :mod:`jupyter_gpupool.enforcement.plan`),
   plus ``GPUPOOL_DB``/``GPUPOOL_SIMULATE`` so ``%gpupool`` in the kernel reaches the same pool,
   and ``--ext=jupyter_gpupool.kernel`` for IPython kernels;
3. keeps the lease across restarts and releases it when the kernel shuts down.

It fails closed: a kernel never sees a GPU the pool did not grant it. When the pool cannot be
used (no NVIDIA driver and no simulated pool, a broken pool file, an unreachable broker, invalid
``GPUPOOL_*`` settings) the kernel starts CPU-only (``CUDA_VISIBLE_DEVICES=""``, no lease) with
the reason logged, or, where the admin chose ``refuse``, its start fails with the reason; a
restart always falls back to CPU-only. A start the pool refuses (a slice larger than any GPU, a
request withdrawn while queued) fails with the reason in :attr:`GpuPoolProvisioner.failure`.

It works the same inside Jupyter Server (where the ``gpupool`` server extension binds its pool
and reports activity) and outside it (``jupyter nbconvert --execute``, nbclient, papermill), where
it opens the pool from the environment and keeps its own lease alive with heartbeats. It works in
processes forked from one that already ran kernels (``ProcessPoolExecutor`` workers of a parallel
autograder): a child gets fresh worker threads and opens its own pool. A launch that fails (a
kernelspec naming a missing program) gives its lease back at once.

Kernelspec example (``kernel.json``)::

    "metadata": {"kernel_provisioner": {"provisioner_name": "gpupool-provisioner",
                                        "config": {"memory": "8GiB"}}}
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from jupyter_client.provisioning import LocalProvisioner
from traitlets import Bool, Float, Int, Unicode

from jupyter_gpupool.backends.contract import Capability, SuspendingBackend, supports
from jupyter_gpupool.backends.discovery import ENV_VAR as BROKER_FILE_VAR
from jupyter_gpupool.backends.discovery import EXPLICIT_VARS
from jupyter_gpupool.backends.factory import pool_from_env
from jupyter_gpupool.backends.owner import default_owner, holder_identity
from jupyter_gpupool.core.models import Activity, Lease, LeaseRequest, LeaseState, PriorityClass, QueueInfo
from jupyter_gpupool.core.validate import usable_preferences
from jupyter_gpupool.enforcement import device_join
from jupyter_gpupool.enforcement.partition import create_kernel_cgroup, join_command, load_nvml, remove_kernel_cgroup
from jupyter_gpupool.enforcement.plan import (
    EnforcementConfig,
    EnforcementPlan,
    EnforcementSettings,
    plan_enforcement,
    size_fixed_at_start,
)
from jupyter_gpupool.errors import (
    GpuPoolError,
    InvalidInput,
    LeaseNotFound,
    NoGpuFound,
    NotAuthorized,
    PoolUnavailable,
    RequestRefused,
)
from jupyter_gpupool.units import SIZE_FORMS
from jupyter_gpupool.wording import cpu_only_description

if TYPE_CHECKING:
    from jupyter_gpupool.backends.contract import PoolBackend

PROVISIONER_NAME = "gpupool-provisioner"
KERNEL_EXTENSION = "jupyter_gpupool.kernel"

#: What a kernel start does while the pool is unavailable: ``cpu-only`` (the default) or ``refuse``.
WHEN_UNAVAILABLE = ("cpu-only", "refuse")
#: Environment variable naming that choice outside a server (a server uses GpuPoolExtension.when_unavailable).
WHEN_UNAVAILABLE_ENV = "GPUPOOL_WHEN_UNAVAILABLE"
#: Set in a CPU-only kernel's environment: why it has no GPU (read by ``%gpupool status``).
UNAVAILABLE_ENV = "GPUPOOL_UNAVAILABLE"

#: Variables that hide every GPU from a kernel (``NVIDIA_VISIBLE_DEVICES`` for a container runtime inside it).
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": "", "NVIDIA_VISIBLE_DEVICES": "void"}


#: Voilà puts this in the environment of every kernel it starts for a page (standalone or as a
#: server extension, preheated or not): a person watches the page, so the kernel leases as ``normal``.
VOILA_KERNEL_ENV = "VOILA_BASE_URL"


def watched_by_a_person(environ: Mapping[str, str]) -> bool:
    """Whether a kernel with ``environ`` serves a page a person watches (Voilà's): a hint for its priority only."""
    return VOILA_KERNEL_ENV in environ


def when_unavailable_from_env(environ: dict[str, str] | None = None) -> str:
    """``$GPUPOOL_WHEN_UNAVAILABLE`` if it is one of :data:`WHEN_UNAVAILABLE`, else ``cpu-only``."""
    value = (os.environ if environ is None else environ).get(WHEN_UNAVAILABLE_ENV, "").strip().lower()
    return value if value in WHEN_UNAVAILABLE else "cpu-only"


def one_line(err: BaseException) -> str:
    """The user-facing text of an error: its message, else its type, on one line."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if isinstance(err, GpuPoolError) else f"{type(err).__name__}: {text}"


def cpu_only_plan(reason: str) -> EnforcementPlan:
    """The plan of a kernel that runs without the pool: every GPU hidden, the reason said."""
    return EnforcementPlan(
        env={**NO_GPU_ENV, "GPUPOOL_ENFORCEMENT": "none", UNAVAILABLE_ENV: reason},
        level="none",
        mechanisms=(),
        description=cpu_only_description(reason),
    )


#: Listener signature: (action, lease, queue info or None, message). Actions: "queued", "waiting",
#: "granted", "released", "failed".
LeaseListener = Callable[[str, Lease, "QueueInfo | None", str], None]


# --- binding to a running server ---------------------------------------------------------------


@dataclass
class ServerBinding:
    """What the ``gpupool`` server extension shares with the provisioners of its kernels (``ext.binding``).

    ``open_pool`` returns the server's pool, or raises PoolUnavailable (with the reason) while
    the server could not open it; ``when_unavailable`` is the admin's choice for that case.
    """

    open_pool: Callable[[], PoolBackend]
    current_owner: Callable[[], str]
    enforcement: EnforcementConfig
    listeners: list[LeaseListener] = field(default_factory=list)
    when_unavailable: Callable[[], str] = field(default=lambda: "cpu-only")
    #: Whether this server can park its kernels' GPU memory in host RAM (then their leases are
    #: ``suspendable``: a reclaim suspends them instead of shutting them down).
    can_suspend: Callable[[], bool] = field(default=lambda: False)

    @property
    def pool(self) -> PoolBackend:
        return self.open_pool()

    @property
    def owner(self) -> str:
        return self.current_owner()


#: The variables that choose which pool :func:`shared_pool` opens.
POOL_CHOOSING_VARS = (*EXPLICIT_VARS, BROKER_FILE_VAR)
_pools: dict[tuple[str, ...], PoolBackend] = {}
_pools_lock = threading.Lock()

# --- kernel starts in forked processes -------------------------------------------------------------
# A process forked from one that ran kernels (ProcessPoolExecutor workers on Linux) inherits its
# event loop objects, whose epoll instance and self-pipe it shares with its parent and siblings (a
# wake-up written in one may be read by another: the loop then sleeps for ever), and whose default
# executor's threads do not exist in it (work handed to it never runs). So in a child every loop a
# kernel start ran on is abandoned unused (marked closed, so jupyter_core and asyncio make a fresh
# one; never polled, and never closed, which would unregister the parent's descriptors), pool calls
# run on an executor of this module that the child creates anew, and the child opens its own pools
# (a SQLite connection never crosses a fork).

_T = TypeVar("_T")
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_loops_used: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


def _pool_executor() -> ThreadPoolExecutor:
    """The threads that run this process's blocking pool calls (created on first use, again after a fork)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gpupool")
        return _executor


async def in_thread(function: Callable[..., _T], *args: Any) -> _T:
    """``asyncio.to_thread`` on this module's executor: fork-safe, and never short of threads
    because other work filled the loop's default executor."""
    loop = asyncio.get_running_loop()
    _loops_used.add(loop)
    call = functools.partial(contextvars.copy_context().run, function, *args)
    return await loop.run_in_executor(_pool_executor(), call)


def _after_fork_in_child() -> None:
    """Drop what a fork left dead or shared: worker threads, the loops kernels started on, open pools."""
    global _executor, _executor_lock, _pools_lock
    _executor = None
    _executor_lock = threading.Lock()
    _pools_lock = threading.Lock()
    _pools.clear()
    inherited = [loop for loop in list(_loops_used) if not loop.is_closed()]
    _loops_used.clear()
    if not inherited:
        return
    for loop in inherited:
        loop._closed = True  # type: ignore[attr-defined]  # abandoned, not closed: its descriptors are the parent's too
    with contextlib.suppress(Exception):
        asyncio.set_event_loop(None)  # this thread's next get_event_loop() / run_sync() makes a fresh loop


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _OneLineForPoolRefusals(logging.Filter):
    """Drop jupyter_client's and jupyter_server's tracebacks of a start the pool refused or
    cancelled (a queued kernel shut down, a request withdrawn): the provisioner already said why,
    in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(record.msg, BaseException) and error is None:
            error = record.msg
        return not isinstance(error, GpuPoolError)


_ONE_LINE_FILTER = _OneLineForPoolRefusals()


def _quiet_pool_refusals(log: Any) -> None:
    """Install the one-line filter on ``log`` (the kernel manager's, which is the server's in a server)."""
    if isinstance(log, logging.Logger) and _ONE_LINE_FILTER not in log.filters:
        log.addFilter(_ONE_LINE_FILTER)


def server_binding(provisioner: Any) -> ServerBinding | None:
    """The binding of the server that runs this provisioner's kernel, if any.

    Found through the parent chain (KernelManager → MappingKernelManager → ServerApp), so two
    servers in one process (tests) never share state, and nothing global outlives a server.
    """
    kernel_manager = getattr(provisioner, "parent", None)
    mapping = getattr(kernel_manager, "parent", None)
    server = getattr(mapping, "parent", None)
    web_app = getattr(server, "web_app", None)
    extension = web_app.settings.get("gpupool") if web_app is not None else None
    binding = getattr(extension, "binding", None)
    return binding if isinstance(binding, ServerBinding) else None


def shared_pool(config: Any = None) -> PoolBackend:
    """One pool per set of the variables that choose it (``GPUPOOL_URL``, ``_DB``, ``_SIMULATE``,
    ``_BACKEND``, ``_BROKER_FILE``) in this process, opened on first use."""

    key = tuple(os.environ.get(name, "") for name in POOL_CHOOSING_VARS)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            # GPUPOOL_URL set: the broker, and never a silent fall-back to an unpooled GPU.
            pool = pool_from_env(config=config)
            _pools[key] = pool
        return pool


def device_control_runs(pool: Any) -> bool:
    """Whether the pool's broker denies GPU nodes outside granted kernels (its info says so)."""
    info = getattr(pool, "info", None)
    if not callable(info):
        return False  # a pool of this server's own: no broker, no device control
    try:
        told = info().get("device_control")
    except Exception:  # noqa: BLE001 - an unreachable broker fails the start elsewhere; here: no wait
        return False
    return isinstance(told, dict) and told.get("mode") not in (None, "", "off")


def pool_env(pool: PoolBackend) -> dict[str, str]:
    """Variables that let code in the kernel (magics, CLI) open the same pool."""
    if supports(pool, Capability.CLIENT_ENV):  # a broker: the kernel reaches it by URL, never by a local file
        return dict(pool.client_env())  # type: ignore[attr-defined]  # the capability's member
    env = {"GPUPOOL_DB": str(getattr(pool, "db_path", ""))}
    spec = os.environ.get("GPUPOOL_SIMULATE") or getattr(pool.backend, "spec", "")
    if getattr(pool.backend, "name", "") == "simulated" and spec:
        env["GPUPOOL_SIMULATE"] = spec
    return env


class LeaseWaitAborted(GpuPoolError):
    """The lease was released (kernel shut down, engine decision) while the kernel waited for it."""

    http_status = 409
    exit_code = 3


class GpuPoolProvisioner(LocalProvisioner):  # type: ignore[misc]
    """Launch a local kernel inside a GPU slice leased from the pool."""

    memory = Unicode(
        "",
        config=True,
        help=f"GPU memory per GPU for this kernel, {SIZE_FORMS}. Empty: the user's saved preference, else the policy default.",
    )
    limit = Unicode(
        "",
        config=True,
        help=f"How far this kernel's slice may grow above `memory` while its GPU has memory nobody is guaranteed, "
        f"{SIZE_FORMS}; 0: a fixed slice. Empty: the pool's c.PoolPolicy.burst.",
    )
    num_gpus = Int(0, config=True, help="Number of GPUs. 0: the user's saved preference, else 1.")
    compute_share = Int(
        0, config=True, help="Percent of each GPU's SMs (MPS/HAMi only). 0: the saved preference, else no compute cap."
    )
    model = Unicode("", config=True, help="GPU model this kernel needs, e.g. A100. Empty: any.")
    priority = Unicode(
        "", config=True, help="Priority class: batch, normal or high. Empty: normal (the pool's quotas may lower it)."
    )
    unattended_priority = Unicode(
        "batch",
        config=True,
        help="Priority class of kernels started outside a Jupyter server (jupyter nbconvert --execute, nbclient, "
        "papermill, nbgrader, jupyter console) whose kernelspec sets none, so batch runs share the pool below live "
        "users. Empty: as inside a server (the saved preference, else normal).",
    )
    label = Unicode("", config=True, help="Free text shown with the lease (e.g. the notebook). Empty: the kernel name.")
    owner = Unicode(
        "",
        config=True,
        help="User the lease is charged to. Empty: the server's owner, else $JUPYTERHUB_USER, else the OS user.",
    )
    wait_timeout = Float(
        0.0,
        config=True,
        help="Seconds a kernel start may wait in the queue before it fails. 0: wait as long as it takes.",
    )
    poll_interval = Float(0.5, config=True, help="Seconds between queue checks while waiting for a grant.")
    load_kernel_extension = Bool(
        True, config=True, help=f"Add --ext={KERNEL_EXTENSION} to IPython kernels (framework caps and %%gpupool magics)."
    )

    lease_id: str | None = None
    plan: EnforcementPlan | None = None
    #: The kernel's cgroup (MPS memory partitioning); None where it has none.
    cgroup: str | None = None
    phase: str = "new"  # new, waiting, launching, running, restarting, stopping, stopped, failed
    #: Why the last start failed (the pool refused it, or was unavailable with ``refuse``); None if it did not.
    failure: str | None = None
    #: Set when a restart found that the slice the running kernel held was taken back under it
    #: (:attr:`Lease.taken_back`: reclaimed, preempted, its Slurm job ended) as its process died:
    #: the server shuts the kernel down with this reason, as it does a running kernel's.
    slice_ended: str = ""
    #: Whether the kernel runs with the pool's kernel extension (an IPython kernel): its cells then
    #: wait for a resume themselves, and a cell of only ``%gpupool`` lines does not resume it.
    kernel_extension: bool = False
    #: Why the kernel runs CPU-only (the pool was unavailable when it started); None if it has the pool.
    cpu_only_reason: str | None = None
    #: The last word from the queue while waiting: the lease and its place, whose ``reason`` says
    #: "pool unavailable, retrying in N s: ..." while the pool cannot be reached (None: not waiting).
    queue_update: tuple[Lease, QueueInfo | None] | None = None
    #: Whether the kernel serves a page a person watches (Voilà's): it leases as ``normal`` even outside a server.
    watched: bool = False
    #: A lease this kernel held before it fell back to CPU-only: released once the pool answers again.
    stale_lease_id: str | None = None
    _heartbeat_task: asyncio.Task[None] | None = None
    _pool: PoolBackend | None = None

    # --- helpers --------------------------------------------------------------------------------

    @property
    def pool(self) -> PoolBackend:
        """The server's pool when bound to a server, else one opened from the environment."""
        if self._pool is None:
            binding = server_binding(self)
            self._pool = binding.pool if binding is not None else shared_pool(self.config)
        return self._pool

    def _owner(self) -> str:
        if self.owner:
            return self.owner
        binding = server_binding(self)
        return binding.owner if binding is not None else default_owner()

    def _enforcement(self) -> EnforcementConfig:
        binding = server_binding(self)
        if binding is not None:
            return binding.enforcement
        return EnforcementSettings(config=self.config).to_config()

    def _notify(self, action: str, lease: Lease, info: QueueInfo | None = None, message: str = "") -> None:
        binding = server_binding(self)
        for listener in list(binding.listeners if binding else []):
            try:
                listener(action, lease, info, message)
            except Exception:  # a listener must never break a kernel start
                self.log.exception("gpupool: lease listener failed")

    def _is_ipython(self) -> bool:
        argv = list(getattr(self.kernel_spec, "argv", []) or [])
        return any("ipykernel" in str(arg) for arg in argv)

    def build_request(self) -> LeaseRequest:
        """The lease request for this kernel: kernelspec config, then saved preference, then policy."""
        pool = self.pool
        owner = self._owner()
        prefs = usable_preferences(pool.preference(owner), owner, self.log)  # a bad one is skipped, with a warning
        memory_text: str | int | None = self.memory or prefs.get("memory")
        if memory_text:
            try:
                memory = pool.parse_memory(memory_text)
            except InvalidInput as err:
                where = "the kernelspec's provisioner config" if self.memory else f"{owner}'s saved preference"
                raise InvalidInput(f"{err} (from {where})") from None
        else:
            memory = pool.default_memory()
        burst_limit: int | None = None
        if self.limit.strip():
            try:
                burst_limit = 0 if self.limit.strip() == "0" else pool.parse_memory(self.limit)
            except InvalidInput as err:
                raise InvalidInput(f"{err} (the limit in the kernelspec's provisioner config)") from None
        fixed_because = size_fixed_at_start(self._enforcement())
        if fixed_because and burst_limit != 0:
            if burst_limit:
                self.log.warning("gpupool: kernel %s gets a fixed slice, not its limit: %s", self.kernel_id, fixed_because)
            burst_limit = 0  # the limit the kernel starts with is the one it keeps: no burst to promise
        num_gpus = self.num_gpus or int(prefs.get("num_gpus") or 1)
        share = self.compute_share or prefs.get("compute_share") or None
        # Outside a server (no ServerBinding) nobody is at the keyboard: a batch run unless the kernelspec
        # says, or the kernel serves a page a person watches (standalone Voilà).
        unattended = self.unattended_priority if server_binding(self) is None and not self.watched else ""
        priority_text = (self.priority or unattended or prefs.get("priority") or "normal").lower()
        try:
            priority = PriorityClass(priority_text)
        except ValueError:
            raise InvalidInput(f"invalid priority {priority_text!r}: expected batch, normal or high") from None
        host, pid = holder_identity()
        kernel_name = getattr(self.kernel_spec, "display_name", "") or "kernel"
        return LeaseRequest(
            owner=owner,
            memory=memory,
            kernel_id=self.kernel_id,
            num_gpus=num_gpus,
            compute_share=int(share) if share else None,
            model=self.model or prefs.get("model") or None,
            priority=priority,
            holder_pid=pid,
            holder_host=host,
            label=self.label or kernel_name,
            suspendable=self._suspendable(),
            burst_limit=burst_limit,
        )

    def _suspendable(self) -> bool:
        """Only an IPython kernel of a server that can checkpoint: the kernel extension makes its next cell wait for the resume."""
        binding = server_binding(self)
        return binding is not None and self._is_ipython() and binding.can_suspend()

    async def acquire(self) -> Lease:
        """Get a granted lease for this kernel: reuse the live one (restart) or request and wait.

        Every pool call runs in a thread: a broker that retries through an outage must never
        stall the server's event loop (and every other user's kernels with it)."""
        pool = self.pool
        if self.lease_id:
            try:
                kept: Lease | None = await asyncio.to_thread(pool.get, self.lease_id)
            except LeaseNotFound:
                kept = None  # pruned: queue again (PoolUnavailable propagates: the lease may well be alive)
            if kept is not None and kept.tied_to_its_process:
                kept = None  # parked (or mid-step) for the old process: the new one asks again below
            if kept is not None and kept.state is LeaseState.GRANTED:
                if kept.pinned_backup and supports(pool, Capability.SUSPEND):
                    # The old process's pinned backup went with it: give its place in the host's pool back.
                    suspending = cast(SuspendingBackend, pool)
                    with contextlib.suppress(GpuPoolError):
                        return await asyncio.to_thread(suspending.reserve_pinned_backup, kept.id, 0)
                return kept
            if kept is not None and kept.state is LeaseState.QUEUED:
                return await self._wait(kept)
            if kept is not None and kept.taken_back:
                # Taken back while the kernel was down (its process died before the server shut it
                # down: a cancelled Slurm step, an OOM kill): the server shuts it down, with the reason.
                self.slice_ended = kept.release_reason
                raise LeaseWaitAborted(f"kernel {self.kernel_id} is gone: its GPU slice was taken back ({kept.release_reason})")
            self.lease_id = None  # released while the kernel was down (it ended, or gave it back): queue again
        request = await asyncio.to_thread(self.build_request)
        lease = await asyncio.to_thread(pool.request, request)
        self.lease_id = lease.id
        if lease.state is LeaseState.GRANTED:
            self._notify("granted", lease)
            return lease
        return await self._wait(lease)

    async def _wait(self, lease: Lease) -> Lease:
        self.phase = "waiting"
        info = await in_thread(self.pool.queue_info, lease.id)
        self.queue_update = (lease, info)
        self._notify("queued", lease, info, self._queue_message(info))
        self.log.info("gpupool: kernel %s waits for a GPU slice: %s", self.kernel_id, self._queue_message(info))
        last: tuple[Any, ...] = ()

        def on_update(current: Lease, qi: QueueInfo | None) -> None:
            nonlocal last
            if current.state is LeaseState.RELEASED:
                raise LeaseWaitAborted(current.release_reason or "the queued GPU request was cancelled")
            if current.state is LeaseState.QUEUED:
                self.queue_update = (current, qi)
            # The reason is part of what listeners hear: "pool unavailable, retrying in 4 s: ..." (an
            # outage of the broker) changes nothing else, and the user must still see it.
            key = (current.state, qi.position if qi else None, qi.length if qi else None, qi.reason if qi else None)
            if key != last and current.state is LeaseState.QUEUED:
                last = key
                self._notify("waiting", current, qi, self._queue_message(qi))

        timeout = self.wait_timeout or None
        try:
            try:
                granted = await self.pool.await_grant(
                    lease.id, timeout=timeout, poll=self.poll_interval, on_update=on_update
                )
            finally:
                self.queue_update = None
        except (LeaseWaitAborted, RequestRefused) as err:
            # Released while queued: the kernel was shut down, or the request withdrawn.
            raise LeaseWaitAborted(f"kernel start cancelled while waiting for a GPU: {err}") from None
        except (TimeoutError, asyncio.TimeoutError):
            self._release(f"gave up after waiting {timeout:g} s in the queue")
            raise RequestRefused(
                f"no GPU slice within {timeout:g} s; raise GpuPoolProvisioner.wait_timeout or ask for less memory"
            ) from None
        except asyncio.CancelledError:
            self._release("kernel start cancelled while queued")
            raise
        if granted.state is not LeaseState.GRANTED:
            reason = granted.release_reason or f"lease is {granted.state.value}"
            raise LeaseWaitAborted(f"kernel start cancelled while waiting for a GPU: {reason}")
        self._notify("granted", granted)
        return granted

    @staticmethod
    def _queue_message(info: QueueInfo | None) -> str:
        if info is None:
            return "waiting for a GPU"
        text = f"waiting for a GPU: position {info.position} of {info.length}"
        if info.reason:
            text += f" ({info.reason})"
        return text

    def _release(self, reason: str) -> None:
        lease = self._release_quietly(reason)
        if lease is not None:
            self._notify("released", lease, None, reason)

    def _release_quietly(self, reason: str) -> Lease | None:
        """Give the lease back without telling listeners (safe in a worker thread: listeners emit
        events, which need the event loop); None if there was none or the pool did not answer."""
        if not self.lease_id:
            return None
        try:
            return self.pool.release(self.lease_id, reason=reason)
        except Exception as err:  # noqa: BLE001 - the pool is unavailable: its holder check or heartbeat timeout frees it
            self.log.debug("gpupool: release of %s: %s", self.lease_id, err)
            return None

    # --- provisioner life cycle ---------------------------------------------------------------

    #: Errors by which the pool refuses this start: the kernel fails with the reason.
    REFUSALS: tuple[type[Exception], ...] = (InvalidInput, RequestRefused, LeaseWaitAborted, NotAuthorized, LeaseNotFound)

    def _when_unavailable(self) -> str:
        binding = server_binding(self)
        return binding.when_unavailable() if binding is not None else when_unavailable_from_env()

    def _open_pool(self) -> PoolBackend:
        """The pool, or PoolUnavailable saying why it cannot be opened (bad settings included)."""
        try:
            return self.pool
        except PoolUnavailable:
            raise
        except Exception as err:
            raise PoolUnavailable(f"cannot open the GPU pool: {one_line(err)}") from err

    def _fail(self, reason: str) -> None:
        self.phase = "failed"
        self.failure = reason
        self.log.warning("gpupool: kernel %s did not start: %s", self.kernel_id, reason)

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Lease a slice (waiting while queued), then prepare the launch with the grant's env.

        Fails closed: while the pool is unavailable the kernel starts CPU-only (or, with
        ``refuse``, not at all); a start the pool refuses fails with the reason.
        """
        restarting = self.phase == "restarting"
        self.failure = None
        self.watched = watched_by_a_person(kwargs.get("env") or {})
        _quiet_pool_refusals(self.log)
        try:
            await in_thread(self._open_pool)
            lease = await self.acquire()
        except self.REFUSALS as err:
            self._fail(f"no GPU slice: {one_line(err)}")
            raise
        except asyncio.CancelledError:
            self.phase = "stopped"
            raise
        except Exception as err:  # the pool cannot be used (PoolUnavailable, a broken store, a bug): fail closed
            reason = one_line(err)
            if not isinstance(err, GpuPoolError):
                self.log.debug("gpupool: pool error for kernel %s", self.kernel_id, exc_info=True)
            if not restarting and self._when_unavailable() == "refuse":
                self._fail(f"the GPU pool is unavailable: {reason}")
                raise PoolUnavailable(f"the GPU pool is unavailable ({reason}); kernels start once it is back") from None
            return await self._launch_cpu_only(reason, err, **kwargs)
        self.cpu_only_reason = None
        self.phase = "launching"
        devices = {d.uuid: d for d in await in_thread(self.pool.devices)}
        enforcement = self._enforcement()
        self.plan = plan_enforcement(lease, devices, enforcement)
        if self.plan.partition is not None:
            indices = [devices[uuid].index for uuid in lease.devices if uuid in devices]
            await in_thread(self._make_cgroup, lease.id, indices, enforcement.cgroup_root)
        env = dict(kwargs.get("env") or os.environ)
        env.pop(UNAVAILABLE_ENV, None)
        env.update(pool_env(self.pool))
        env["GPUPOOL_KERNEL_ID"] = str(self.kernel_id or "")
        env["GPUPOOL_USER"] = lease.owner
        env["GPUPOOL_SUSPENDABLE"] = "1" if lease.suspendable else "0"  # a slice the kernel asks for again is so too
        kwargs["env"] = self.plan.apply(env)
        self.kernel_extension = (
            self.load_kernel_extension and self._is_ipython() and importlib.util.find_spec(KERNEL_EXTENSION) is not None
        )
        if self.kernel_extension:
            extra = list(kwargs.get("extra_arguments") or [])
            flag = f"--ext={KERNEL_EXTENSION}"
            if flag not in extra:
                extra.append(flag)
            kwargs["extra_arguments"] = extra
        self.log.info(
            "gpupool: kernel %s %s lease %s (%s): %s",
            self.kernel_id,
            "keeps" if restarting else "got",
            lease.id,
            self.plan.level,
            self.plan.env.get("CUDA_VISIBLE_DEVICES", ""),
        )
        return await super().pre_launch(**kwargs)

    async def _launch_cpu_only(self, reason: str, err: BaseException, **kwargs: Any) -> dict[str, Any]:
        """Launch with every GPU hidden and no lease, saying why (the pool is unavailable)."""
        if self.lease_id:  # a restart whose lease cannot be confirmed: hand it back once the pool answers
            self.stale_lease_id = self.lease_id
            self.lease_id = None
        self.cpu_only_reason = reason
        self.phase = "launching"
        self.plan = cpu_only_plan(reason)
        env = dict(kwargs.get("env") or os.environ)
        for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_MEMORY_LIMIT"):  # GPUPOOL_DB/URL stay: %gpupool finds the pool once back
            env.pop(name, None)
        env["GPUPOOL_KERNEL_ID"] = str(self.kernel_id or "")
        env["GPUPOOL_SUSPENDABLE"] = "1" if self._suspendable() else "0"
        kwargs["env"] = self.plan.apply(env)
        # In a server, the extension has said why once (quietly when there is simply no GPU).
        quiet = server_binding(self) is not None or isinstance(err, NoGpuFound)
        (self.log.info if quiet else self.log.warning)(
            "gpupool: kernel %s starts CPU-only (CUDA_VISIBLE_DEVICES=''): the GPU pool is unavailable: %s", self.kernel_id, reason
        )
        return await super().pre_launch(**kwargs)

    def _make_cgroup(self, lease_id: str, device_indices: list[int], cgroup_root: str) -> None:
        """Give the kernel its cgroup with the plan's soft and hard bounds (MPS memory partitioning).
        A failure is a warning: the kernel still has its MPS hard limit and the watchdog."""
        assert self.plan is not None and self.plan.partition is not None
        soft, hard = self.plan.partition
        try:
            self.cgroup = create_kernel_cgroup(load_nvml(), device_indices, lease_id, soft, hard, cgroup_root)
        except Exception as err:  # noqa: BLE001 - NVMLError, OSError: the start goes on with the hard limit
            self.cgroup = None
            self.log.warning("gpupool: kernel %s runs without its memory partition: %s", self.kernel_id, one_line(err))

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
        """Launch the kernel; a launch that fails (a missing program, a bad ``cwd``) gives its lease back at once."""
        guarded: bool = bool(self.lease_id) and await in_thread(device_control_runs, self.pool)
        if guarded:
            # The broker opens the kernel's GPU once it finds the process: wait for that before it runs,
            # inside the memory cgroup below (on cgroup v2 its device cgroup is a child of that one).
            cmd = device_join.join_command(cmd, sys.executable)
        if self.cgroup:
            cmd = join_command(self.cgroup, cmd, sys.executable)
        try:
            return await super().launch_kernel(cmd, **kwargs)
        except Exception as err:
            reason = f"the kernel did not launch: {one_line(err)}"
            self.phase = "failed"
            self.failure = reason
            # The kernel never ran: nothing keeps this slice, on a restart either.
            released = await in_thread(self._release_quietly, reason)
            self.lease_id = None
            if released is not None:
                self._notify("released", released, None, reason)
            self.log.warning("gpupool: kernel %s did not start: %s", self.kernel_id, reason)
            raise

    def _finalize_env(self, env: dict[str, str]) -> None:
        """Re-apply the plan after kernelspec ``env`` substitutions: the grant wins over the spec."""
        super()._finalize_env(env)
        if self.plan is not None:
            env.update(self.plan.apply(env))

    async def post_launch(self, **kwargs: Any) -> None:
        await super().post_launch(**kwargs)
        self.phase = "running"
        if server_binding(self) is None and self._heartbeat_task is None and self.lease_id:
            # Outside a server nobody reports for us: keep the lease alive while the kernel runs.
            self._heartbeat_task = asyncio.ensure_future(self._heartbeat_loop())

    async def _heartbeat_loop(self) -> None:
        interval = max(0.5, float(getattr(self.pool.policy, "heartbeat_ttl", 60.0)) / 4)
        while True:
            lease_id = self.lease_id
            if lease_id:
                try:
                    # A batch run (nbconvert, papermill) executes cells back to back: count it as busy.
                    await in_thread(self.pool.report_activity, lease_id, Activity(busy=True, connections=1))
                except GpuPoolError as err:
                    self.log.debug("gpupool: heartbeat for %s: %s", lease_id, err)
                except Exception:
                    self.log.exception("gpupool: heartbeat failed")
            await asyncio.sleep(interval)

    # A restart (or shutdown) is announced before the process goes: mark it so the server's
    # reconciliation does not take the brief gap for a dead kernel and free the slice.
    async def shutdown_requested(self, restart: bool = False) -> None:
        self.phase = "restarting" if restart else "stopping"
        await super().shutdown_requested(restart=restart)

    async def terminate(self, restart: bool = False) -> None:
        self.phase = "restarting" if restart else "stopping"
        await super().terminate(restart=restart)

    async def kill(self, restart: bool = False) -> None:
        self.phase = "restarting" if restart else "stopping"
        await super().kill(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        """Keep the lease on restart; release it when the kernel is gone for good."""
        await super().cleanup(restart=restart)
        if restart:
            self.phase = "restarting"
            return
        self.phase = "stopped"
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(BaseException):
                await self._heartbeat_task
            self._heartbeat_task = None
        released = await in_thread(self._release_quietly, "kernel shut down")
        if released is not None:
            self._notify("released", released, None, "kernel shut down")
        self.lease_id = None
        if self.cgroup:
            remove_kernel_cgroup(self.cgroup)
            self.cgroup = None
        stale = await in_thread(self._release_stale_quietly, "kernel shut down")
        if stale is not None:
            self._notify("released", stale, None, "kernel shut down")

    def release_stale(self, reason: str = "its kernel restarted CPU-only while the pool was unavailable") -> None:
        """Hand back the lease held before a CPU-only restart (best effort: the pool may still be down)."""
        lease = self._release_stale_quietly(reason)
        if lease is not None:
            self._notify("released", lease, None, reason)

    def _release_stale_quietly(self, reason: str) -> Lease | None:
        if not self.stale_lease_id:
            return None
        try:
            lease = self.pool.release(self.stale_lease_id, reason=reason)
        except Exception as err:  # noqa: BLE001 - still unavailable: try again later (or the heartbeat timeout frees it)
            self.log.debug("gpupool: release of stale lease %s: %s", self.stale_lease_id, err)
            return None
        self.stale_lease_id = None
        return lease

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info["gpupool_lease_id"] = self.lease_id
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.lease_id = provisioner_info.get("gpupool_lease_id")


__all__ = [
    "NO_GPU_ENV",
    "PROVISIONER_NAME",
    "UNAVAILABLE_ENV",
    "WHEN_UNAVAILABLE",
    "GpuPoolProvisioner",
    "LeaseWaitAborted",
    "ServerBinding",
    "cpu_only_plan",
    "default_owner",
    "holder_identity",
    "in_thread",
    "one_line",
    "server_binding",
    "shared_pool",
]
