"""How a kernel reaches the pool about its own lease.

:class:`PoolClient` is the interface the magics and the widget use. Two transports:

- :class:`InProcessPoolClient` (single-user mode, today): the pool engine in this process
  over the SQLite file ``GPUPOOL_DB``, the same file JupyterLab and nbconvert runs use.
- :class:`HttpPoolClient` (multi-user hosts): the same logic over the broker at ``GPUPOOL_URL`` (or,
  with no ``GPUPOOL_*`` variable choosing a pool, the one this host's discovery file names),
  through :class:`~jupyter_gpupool.backends.remote.RemotePool`; identity comes from the kernel's
  hub token (``JUPYTERHUB_API_TOKEN``, inherited from its single-user server) or its uid on the
  broker's socket.

Sizes and durations are passed as the user typed them (``"12GiB"``, ``"25%"``, ``"2h"``),
so an HTTP client can send them unchanged to ``POST .../reserve``.
"""

from __future__ import annotations

import abc
import getpass
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from jupyter_gpupool.backends.changes import wait_for_change
from jupyter_gpupool.backends.contract import NO_BURST, Capability, supports
from jupyter_gpupool.core.models import (
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PoolSnapshot,
    PriorityClass,
    QueueInfo,
    Transition,
)
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, LeaseNotFound, PoolUnavailable, RequestRefused
from jupyter_gpupool.kernel.status import KernelStatus
from jupyter_gpupool.rest.views import grow_place
from jupyter_gpupool.units import parse_duration, parse_size
from jupyter_gpupool.wording import count

UpdateCallback = Callable[[Lease, "QueueInfo | None"], None]
NO_LEASE = (
    "this kernel has no GPU slice (it was not started through the GPU pool); ask for one with %gpupool reserve SIZE"
)


class PoolClient(abc.ABC):
    """This kernel's view of the pool: its own lease, and the queue."""

    @property
    @abc.abstractmethod
    def pool(self) -> Any:
        """The pool backend this client talks to, opened on first use."""

    @property
    @abc.abstractmethod
    def lease_id(self) -> str | None:
        """The id of this kernel's current lease (None before it has one)."""

    @abc.abstractmethod
    def status(self) -> KernelStatus:
        """The lease, its queue position, its devices and the idle policy, fresh from the pool."""

    @abc.abstractmethod
    def reserve(self, memory: str | None, duration: str | None = None, num_gpus: int | None = None,
                limit: str | None = None) -> Lease:
        """Grow, shrink or hold the slice; or ask for a new one if the kernel has none. ``limit``:
        how far the slice may grow above ``memory`` while the GPU has room (``0``: a fixed slice).

        Raises InvalidInput for a bad size or duration, RequestRefused when it cannot be granted.
        """

    @abc.abstractmethod
    def release(self) -> Lease:
        """Give the slice back. Raises LeaseNotFound when there is none."""

    @abc.abstractmethod
    def keep(self, duration: str | None) -> Lease:
        """Hold the slice through idle for ``duration`` (None: the default, one hour)."""

    @abc.abstractmethod
    def snapshot(self) -> PoolSnapshot:
        """The pool's devices and queue as this user may see them."""

    @abc.abstractmethod
    def wait_for_grant(self, timeout: float | None = None, on_update: UpdateCallback | None = None) -> Lease:
        """Block until the lease is granted (or released), calling ``on_update`` as the queue moves."""

    @abc.abstractmethod
    def current(self) -> Lease | None:
        """This kernel's lease as the pool has it now (one read), or None when it has none."""

    @abc.abstractmethod
    def suspend(self) -> Lease:
        """Ask for this kernel's GPU memory to be parked in host RAM (its server carries it out).

        Raises RequestRefused with the pool's reason when it cannot be suspended.
        """

    @abc.abstractmethod
    def resume(self) -> Lease:
        """Queue a suspended kernel to come back (harmless when it is already resuming or running)."""

    @abc.abstractmethod
    def wait_until_running(self, timeout: float | None = None, on_update: UpdateCallback | None = None) -> Lease:
        """Block until the lease is granted with no transition under way, resuming it if it is suspended.

        Calls ``on_update`` as the queue moves and while a transition runs; raises TimeoutError,
        or RequestRefused / LeaseNotFound when the lease is released meanwhile (with the reason).
        """

    def grow(self, needed: int) -> Lease:
        """Ask the pool to grow this kernel's elastic slice so it holds ``needed`` bytes (all its
        GPUs), as a framework cap's allocation failure does; the caps follow. Raises
        RequestRefused with the pool's reason (the GPU is full, the slice is fixed, its limit)."""
        raise RequestRefused("the slice was not grown: this pool connection cannot grow a slice")

    def close(self) -> None:
        """Release connections and file handles."""


#: What the pool records as the reason when a kernel's user suspends it from the kernel.
SUSPEND_REASON = "suspended by its user with %gpupool suspend"
#: Set by the provisioner in a kernel's environment: ``1`` when its server can park the kernel's
#: GPU memory (the lease it asks for is ``suspendable``), ``0`` when not.
SUSPENDABLE_ENV = "GPUPOOL_SUSPENDABLE"
DEFAULT_KEEP = "1h"
#: How long a kernel reuses its read of the GPU inventory. The server keeps the live one; a kernel
#: needs it for sizes and labels, and a driver query made while a CUDA checkpoint has locked the
#: kernel's process waits until the kernel is restored, so the kernel asks the driver rarely.
KERNEL_DEVICE_CACHE_SECONDS = 300.0


def _owner_from_env(env: Mapping[str, str]) -> str:
    for name in ("GPUPOOL_OWNER", "JUPYTERHUB_USER"):
        if env.get(name):
            return env[name]
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry in some containers
        return str(os.getuid())


class InProcessPoolClient(PoolClient):
    """The pool engine in this process, over the shared SQLite file (single-user mode)."""

    def __init__(
        self,
        env: MutableMapping[str, str] | None = None,
        pool_factory: Callable[[], Any] | None = None,
        caps: Any = None,
    ) -> None:
        self.env: MutableMapping[str, str] = os.environ if env is None else env
        self._lease_id: str | None = self.env.get("GPUPOOL_LEASE_ID") or None
        self._kernel_id: str | None = self.env.get("GPUPOOL_KERNEL_ID") or None
        self._pool_factory = pool_factory
        self._pool: Any = None
        self.caps = caps  # FrameworkCaps to re-cap after a resize (None: leave frameworks alone)

    # -- plumbing ----------------------------------------------------------------------------
    @property
    def pool(self) -> Any:
        """The :class:`~jupyter_gpupool.backends.local.pool.Pool`, opened on first use (kernel start stays fast)."""
        if self._pool is None:
            try:
                if self._pool_factory is not None:
                    self._pool = self._pool_factory()
                else:
                    from jupyter_gpupool.backends.local.pool import Pool  # not at module level: kernel start stays fast

                    pool = Pool.from_env()
                    pool.device_cache_seconds = KERNEL_DEVICE_CACHE_SECONDS
                    self._pool = pool
            except GpuPoolError:
                raise
            except Exception as err:
                where = self.env.get("GPUPOOL_DB") or "the default pool file"
                raise PoolUnavailable(f"cannot open the GPU pool at {where}: {err}") from err
        return self._pool

    @property
    def lease_id(self) -> str | None:
        return self._lease_id

    def _set_lease(self, lease: Lease) -> None:
        self._lease_id = lease.id
        self.env["GPUPOOL_LEASE_ID"] = lease.id
        if lease.kernel_id:
            self._kernel_id = lease.kernel_id

    def current(self) -> Lease | None:
        """This kernel's lease: the one in GPUPOOL_LEASE_ID, or a newer live one of the same kernel."""
        pool = self.pool
        lease: Lease | None = None
        if self._lease_id:
            try:
                lease = pool.get(self._lease_id)
            except LeaseNotFound:
                lease = None
        kernel_id = (lease.kernel_id if lease else None) or self._kernel_id
        if (lease is None or lease.state is LeaseState.RELEASED) and kernel_id:
            newer = pool.lease_for_kernel(kernel_id)
            if newer is not None:
                self._set_lease(newer)
                lease = newer
        if lease is not None:
            self._follow_devices(lease)
        return lease

    def _follow_devices(self, lease: Lease) -> None:
        """After a resume or a move onto other GPUs, make ``CUDA_VISIBLE_DEVICES`` name the GPUs
        the kernel runs on now, as it named the first ones: what ``%gpupool status``, frameworks
        that read it and processes the kernel starts (``!nvidia-smi``) see. The CUDA context of
        the kernel itself was moved by the checkpoint; a kernel started with no GPU is left so."""
        if lease.state is not LeaseState.GRANTED or lease.transition is not Transition.NONE or not lease.devices:
            return
        shown = self.env.get("CUDA_VISIBLE_DEVICES")
        now = ",".join(lease.devices)

        def uuids(names: list[str]) -> bool:  # not Slurm's indices and pseudo-devices: Slurm sets those itself
            return bool(names) and all(name.startswith(("GPU-", "MIG-")) for name in names)

        if shown and shown != now and uuids(shown.split(",")) and uuids(list(lease.devices)):
            # on first use: the kernel starts as fast as without the extension
            from jupyter_gpupool.devices.checkpoint import STARTED_ON_ENV

            self.env.setdefault(STARTED_ON_ENV, shown)  # what its checkpoint's remap maps from
            self.env["CUDA_VISIBLE_DEVICES"] = now

    def _live(self) -> Lease:
        lease = self.current()
        if lease is None:
            raise LeaseNotFound(NO_LEASE)
        if lease.state is LeaseState.RELEASED:
            reason = f" ({lease.release_reason})" if lease.release_reason else ""
            raise LeaseNotFound(f"this kernel's GPU slice was released{reason}; ask for one with %gpupool reserve SIZE")
        return lease

    def _devices(self) -> list[Device]:
        try:
            return list(self.pool.devices())
        except GpuPoolError:
            return []

    def _largest(self, lease: Lease | None) -> int | None:
        devices = self._devices()
        if lease is not None and lease.devices:
            mine = [d for d in devices if d.uuid in lease.devices]
            if mine:
                return min(d.memory_total for d in mine)
        return max((d.memory_total for d in devices), default=None)

    def _enforcement(self) -> list[str]:
        lines: list[str] = []
        level = self.env.get("GPUPOOL_ENFORCEMENT")
        if level:
            lines.append(f"level {level} (set when the kernel started)")
        if self.caps is not None:
            lines += self.caps.describe()
        return lines

    def _recap(self, lease: Lease) -> None:
        if self.caps is not None and lease.state is not LeaseState.RELEASED:
            self.caps.set_limit(lease.memory, gpu_memory=self._largest(lease) if lease.devices else None)
        elif lease.state is not LeaseState.RELEASED:
            self.env["GPUPOOL_MEMORY_LIMIT"] = str(lease.memory)

    # -- the interface -----------------------------------------------------------------------
    def status(self) -> KernelStatus:
        started_without_pool = self.env.get("GPUPOOL_UNAVAILABLE")
        if started_without_pool and not self._lease_id:
            # Started CPU-only because the pool was unavailable: say so without opening it.
            return KernelStatus(lease=None, unavailable=started_without_pool, now=time.time())
        lease = self.current()
        policy = getattr(self.pool, "policy", None)
        info: QueueInfo | None = None
        if lease is not None and lease.state is LeaseState.QUEUED:
            info = self.pool.queue_info(lease.id)
        devices = [d for d in self._devices() if lease is not None and d.uuid in lease.devices]
        devices.sort(key=lambda d: lease.devices.index(d.uuid) if lease else 0)
        return KernelStatus(
            lease=lease,
            queue=info,
            devices=devices,
            idle_timeout=getattr(policy, "idle_timeout", None),
            idle_policy=str(getattr(policy, "idle_policy", "") or ""),
            enforcement=self._enforcement(),
            local_usage=self.caps.local_usage() if self.caps is not None else None,
            now=time.time(),
            note="" if lease else "not started through the GPU pool",
            backend=self.pool.lease_details(lease) if lease is not None and hasattr(self.pool, "lease_details") else {},
            grow_place=grow_place(self.pool, lease) if lease is not None else None,
        )

    def grow(self, needed: int) -> Lease:
        if not supports(self.pool, Capability.GROW):
            raise RequestRefused(f"the slice was not grown: {getattr(self.pool, 'no_burst', NO_BURST)}")
        lease = self._live()
        updated: Lease = self.pool.grow(lease.id, needed)
        self._set_lease(updated)
        self._recap(updated)
        return updated

    def reserve(self, memory: str | None, duration: str | None = None, num_gpus: int | None = None,
                limit: str | None = None) -> Lease:
        if memory is None and duration is None and num_gpus is None and limit is None:
            raise InvalidInput("nothing to reserve: give a size (e.g. 12GiB), --limit LIMIT, --for DURATION or --gpus N")
        limit_bytes: int | None = None
        if limit is not None:
            limit_bytes = 0 if str(limit).strip() == "0" else parse_size(limit, gpu_memory=self._largest(None))
            if limit_bytes and not supports(self.pool, Capability.GROW):
                raise RequestRefused(f"no limit was set: {getattr(self.pool, 'no_burst', NO_BURST)}")
        if num_gpus is not None and not 1 <= num_gpus <= 64:
            raise InvalidInput(f"invalid GPU count {num_gpus}: expected a whole number from 1 to 64")
        seconds = parse_duration(duration) if duration is not None else None
        size: int | None = None
        if memory is not None and not str(memory).strip().endswith("%"):
            size = parse_size(memory)  # a bad size is reported before the pool is even opened
        lease = self.current()
        if memory is not None and size is None:
            size = parse_size(memory, gpu_memory=self._largest(lease))
        if lease is None or lease.state is LeaseState.RELEASED:
            return self._request_new(lease, size, seconds, num_gpus, limit_bytes)
        if num_gpus is not None and num_gpus != lease.num_gpus:
            raise RequestRefused(
                f"this kernel's slice spans {count(lease.num_gpus, 'GPU')} and the pool cannot change that while the kernel runs;"
                f" %gpupool release, then %gpupool reserve {memory or 'SIZE'} --gpus {num_gpus} and restart the kernel"
            )
        extra = {"limit": limit_bytes} if limit_bytes is not None else {}
        updated = self.pool.resize(lease.id, memory=size, duration=seconds, **extra)
        self._set_lease(updated)
        self._recap(updated)
        return updated

    def _request_new(self, old: Lease | None, size: int | None, seconds: float | None, num_gpus: int | None,
                     limit: int | None = None) -> Lease:
        policy = getattr(self.pool, "policy", None)
        memory = size or (old.memory if old else None) or getattr(policy, "default_memory", None)
        if not memory:
            raise InvalidInput("give a size for the new slice, e.g. %gpupool reserve 8GiB")
        request = LeaseRequest(
            owner=old.owner if old else _owner_from_env(self.env),
            memory=int(memory),
            groups=tuple(old.groups) if old else (),
            kernel_id=(old.kernel_id if old else None) or self._kernel_id,
            num_gpus=num_gpus or (old.num_gpus if old else 1),
            priority=old.priority if old else PriorityClass.NORMAL,
            duration=seconds,
            holder_pid=os.getpid(),
            holder_host=socket.gethostname(),
            label=(old.label if old else "") or "requested from the kernel with %gpupool reserve",
            suspendable=self._suspendable(old),
            burst_limit=limit,
        )
        lease = self.pool.request(request)
        self._set_lease(lease)
        self._recap(lease)
        return lease

    def _suspendable(self, old: Lease | None) -> bool:
        """Whether a new slice asked for from this kernel can be suspended: as its earlier lease
        could (the server that decided that still runs the kernel), else as its server said in
        :data:`SUSPENDABLE_ENV` when it started the kernel."""
        if old is not None:
            return old.suspendable
        return self.env.get(SUSPENDABLE_ENV, "").strip() == "1"

    def release(self) -> Lease:
        lease = self._live()
        released = self.pool.release(lease.id, reason="released from the kernel with %gpupool release")
        return released

    def keep(self, duration: str | None) -> Lease:
        seconds = parse_duration(duration if duration is not None else DEFAULT_KEEP)
        lease = self._live()
        return self.pool.keep(lease.id, seconds)

    def suspend(self) -> Lease:
        lease = self._live()
        return self._pool_suspend(lease.id, SUSPEND_REASON)

    def resume(self) -> Lease:
        lease = self._live()
        return self._pool_resume(lease.id)

    def _pool_suspend(self, lease_id: str, reason: str) -> Lease:
        """The pool's suspend (the broker client sends it over HTTP instead)."""
        lease: Lease = self.pool.suspend(lease_id, reason=reason)
        return lease

    def _pool_resume(self, lease_id: str) -> Lease:
        """The pool's resume (the broker client sends it over HTTP instead)."""
        lease: Lease = self.pool.resume(lease_id)
        return lease

    def wait_until_running(
        self, timeout: float | None = None, on_update: UpdateCallback | None = None, poll: float = 0.5
    ) -> Lease:
        deadline = None if timeout is None else time.monotonic() + timeout
        since = wait_for_change(self.pool, None, 0.0)  # the pool's version before each look
        while True:
            lease = self._live()
            if lease.state is LeaseState.GRANTED and lease.transition is Transition.NONE:
                self._recap(lease)
                return lease
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"this kernel's GPU slice is still {_phase(lease)} after {timeout:.0f} s")
            if lease.state is LeaseState.SUSPENDED:
                self._pool_resume(lease.id)
                continue
            if lease.state is LeaseState.QUEUED:
                # The pool's own wait: heartbeats, schedules and reports the queue position.
                self.pool.wait_for_grant(lease.id, timeout=left, on_update=on_update)
                continue
            if on_update is not None:  # granted, with a suspend, restore or move still under way
                on_update(lease, None)
            # Woken the moment the pool changes (the server confirmed the restore), else after ``poll``.
            since = wait_for_change(self.pool, since, poll if left is None else max(0.0, min(poll, left)))

    def snapshot(self) -> PoolSnapshot:
        lease = self.current()
        return self.pool.snapshot(viewer=lease.owner if lease else _owner_from_env(self.env))

    def wait_for_grant(self, timeout: float | None = None, on_update: UpdateCallback | None = None) -> Lease:
        lease = self._live()
        granted = self.pool.wait_for_grant(lease.id, timeout=timeout, on_update=on_update)
        self._recap(granted)
        return granted

    def close(self) -> None:
        pool, self._pool = self._pool, None
        closer = getattr(pool, "close", None)
        if callable(closer):
            closer()


def _phase(lease: Lease) -> str:
    """One word for where a lease stands: ``queued to resume``, ``restoring``, ``suspended``."""
    if lease.state is LeaseState.QUEUED:
        return "queued to resume" if lease.resuming else "queued"
    if lease.transition is not Transition.NONE:
        return lease.transition.value
    return lease.state.value


class HttpPoolClient(InProcessPoolClient):
    """This kernel's lease, through the broker at ``GPUPOOL_URL``."""

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None, caps: Any = None) -> HttpPoolClient:
        # The pool backends are imported when the pool is first used: a kernel starts without them.
        from jupyter_gpupool.backends.remote import RemotePool

        source: MutableMapping[str, str] = os.environ if env is None else env
        return cls(env=source, pool_factory=lambda: RemotePool.from_env(source), caps=caps)

    def _pool_suspend(self, lease_id: str, reason: str) -> Lease:
        from jupyter_gpupool.backends.remote import remote_suspend  # see from_env

        return remote_suspend(self.pool, lease_id, reason)

    def _pool_resume(self, lease_id: str) -> Lease:
        from jupyter_gpupool.backends.remote import remote_resume  # see from_env

        return remote_resume(self.pool, lease_id)


def connect(env: MutableMapping[str, str] | None = None, caps: Any = None) -> PoolClient:
    """The client for this kernel: the broker's when ``GPUPOOL_URL`` is set or, when no ``GPUPOOL_*``
    variable chooses a pool, when this host's discovery file names one; else in-process.

    Raises PoolUnavailable when the discovery file cannot be read; one that someone untrusted could
    have written is skipped with one warning (see :mod:`jupyter_gpupool.backends.discovery`)."""
    source: MutableMapping[str, str] = os.environ if env is None else env
    if source.get("GPUPOOL_BACKEND", "").strip().lower() == "slurm":  # a kernel in its Slurm job
        from jupyter_gpupool.backends.slurm.pool import SlurmPool  # imported on first use, as Pool is

        return InProcessPoolClient(env=source, caps=caps, pool_factory=lambda: SlurmPool.from_env(environ=source))
    if source.get("GPUPOOL_URL", "").strip():
        return HttpPoolClient.from_env(source, caps=caps)
    # Only the small discovery module here: the pool backends are imported on first use.
    from jupyter_gpupool.backends.discovery import broker_pool, find_broker

    found = find_broker(source, on_ignored=lambda why: print(f"gpupool: warning: {why}", file=sys.stderr))
    if found is None:
        return InProcessPoolClient(env=source, caps=caps)
    return HttpPoolClient(env=source, pool_factory=lambda: broker_pool(found, source), caps=caps)
