"""The pool connection of the ``gpupool`` server extension: opening the pool, and its health.

Opens the pool (from ``GPUPOOL_*`` and the server's config), keeps why it cannot be used and since when
(the extension's degraded mode), tries again every ``retry_interval`` seconds, and registers the
pool's ``/metrics`` collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.factory import pool_from_env
from jupyter_gpupool.errors import GpuPoolError, NoGpuFound, PoolUnavailable
from jupyter_gpupool.provisioner.kernel_provisioner import one_line
from jupyter_gpupool.rest.metrics import PoolCollector

if TYPE_CHECKING:
    from jupyter_gpupool.serverextension.app import GpuPoolExtension


class PoolConnection:
    """Opens the pool and keeps its health (the extension's ``pool`` and ``availability``)."""

    def __init__(self, ext: GpuPoolExtension) -> None:
        self.ext = ext
        self.open_attempts = 0

    def pool_for_kernels(self) -> Any:
        """The pool for a kernel start; PoolUnavailable carrying just the reason while there is none."""
        if self.ext._pool is None:
            raise PoolUnavailable(self.ext.unavailable_reason or "the GPU pool is not open yet")
        return self.ext._pool

    def availability(self) -> dict[str, Any]:
        """The pool's state for REST and the UI: ``available``, or ``unavailable`` with the reason."""
        return {
            "state": "available" if self.ext.available else "unavailable",
            "reason": None if self.ext.available else (self.ext.unavailable_reason or "the GPU pool is not open yet"),
            "unavailable_since": None if self.ext.available else self.ext.unavailable_since,
            "no_gpu": bool(self.ext.no_gpu) and not self.ext.available,
            "when_unavailable": self.ext.when_unavailable,
        }

    def open_pool(self) -> bool:
        """Try to open the pool (from GPUPOOL_* and the server's config); False, with the reason kept, if it cannot."""
        assert self.ext.serverapp is not None
        self.open_attempts += 1
        try:
            self.ext.raise_for_invalid_config()  # an invalid c.* setting: degraded until fixed (configguard.py)
            pool = pool_from_env(config=self.ext.serverapp.config)
            self._after_open(pool)
        except Exception as err:  # noqa: BLE001 - any cause: one line in the log, the extension stays up (degraded)
            self.set_unavailable(err)
            return False
        self.ext._pool = pool
        self.set_available()
        self.ext.log.info("gpupool: %s, pool file %s, owner %s", pool.backend.describe(), getattr(pool, "db_path", ""), self.ext.owner)
        return True

    def _after_open(self, pool: Any) -> None:
        """Per-pool set-up: the broker's name for us, the metrics collector."""
        configured = "owner" in self.ext.config.get(type(self.ext).__name__, {}) or os.environ.get("GPUPOOL_USER")
        if getattr(pool, "remote", False) and not configured:
            # The broker names the user from our token; leases and views must use that name.
            try:
                self.ext.owner = pool.whoami()["name"]
            except GpuPoolError as err:
                self.ext.log.error("gpupool: the broker at %s cannot be reached (%s); kernels will not start until it can", pool.url, err)
        self._register_metrics(pool)

    def set_unavailable(self, err: BaseException) -> None:
        """Record why the pool cannot be used; say it in the log once per new reason, without a traceback."""
        reason = one_line(err)
        changed = reason != self.ext.unavailable_reason
        if self.ext.unavailable_reason is None:
            self.ext.unavailable_since = time.time()
        self.ext.unavailable_reason = reason
        self.ext.no_gpu = isinstance(err, NoGpuFound)
        if not changed:
            return
        if not isinstance(err, GpuPoolError):
            self.ext.log.debug("gpupool: the pool failed", exc_info=err)
        if self.ext.no_gpu:
            self.ext.log.info("gpupool: no NVIDIA GPU found and no simulated pool configured: kernels run CPU-only")
            return
        kernels = "start CPU-only" if self.ext.when_unavailable == "cpu-only" else "are refused"
        self.ext.log.warning(
            "gpupool: the GPU pool is unavailable: %s; kernels %s until it is fixed (trying again every %g s)",
            reason,
            kernels,
            self.ext.retry_interval,
        )

    def set_available(self) -> None:
        if self.ext.unavailable_reason is not None and self.open_attempts > 1:
            self.ext.log.info("gpupool: the GPU pool is available again")
        self.ext.unavailable_reason = None
        self.ext.unavailable_since = None
        self.ext.no_gpu = False
        self.ext._failed_call = False

    def _register_metrics(self, pool: Any) -> None:
        """Add the pool's collector to the registry jupyter_server serves at ``/metrics``
        (authenticated unless ``ServerApp.authenticate_prometheus`` is turned off)."""
        if getattr(pool, "remote", False):
            return  # the broker serves the pool's metrics
        from prometheus_client import REGISTRY


        previous = type(self.ext)._metrics_collector
        if previous is not None:
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(previous)
        collector = PoolCollector(pool)
        REGISTRY.register(collector)
        type(self.ext)._metrics_collector = collector

    async def reopen_until_available(self) -> None:
        """While the pool could not be opened, try again every ``retry_interval`` seconds."""
        while self.ext._pool is None:
            await asyncio.sleep(max(0.05, float(self.ext.retry_interval)))
            if await asyncio.to_thread(self.open_pool):
                self.ext.watch_loops.ensure_started()
