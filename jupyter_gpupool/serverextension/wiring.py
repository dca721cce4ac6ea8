"""The HTTP side of the ``gpupool`` server extension: routes, kernel status views and ``lease`` events.

The REST routes it adds (the API in ``handlers.py``, and a 409 for acting on a kernel whose start still
waits), the ``GET /api/gpupool/kernels/{id}`` body, and the ``lease`` events front ends follow.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.services.kernels.handlers import KernelActionHandler
from tornado import web

from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo
from jupyter_gpupool.enforcement.device_control_role import DEVICE_ACCESS
from jupyter_gpupool.enforcement.plan import EnforcementPlan, plan_enforcement
from jupyter_gpupool.provisioner.kernel_provisioner import device_control_runs
from jupyter_gpupool.rest.views import kernel_status, kernel_status_without_pool, queued_status_while_unreachable
from jupyter_gpupool.serverextension.handlers import default_handlers
from jupyter_gpupool.units import format_size

if TYPE_CHECKING:
    from jupyter_gpupool.serverextension.app import GpuPoolExtension


LEASE_SCHEMA_ID = "https://events.jupyter.org/jupyter_gpupool/lease/v2"


LEASE_SCHEMA_PATH = Path(__file__).parent / "events" / "lease-v2.yaml"


class KernelActionWhileStartingHandler(KernelActionHandler):  # type: ignore[misc]
    """``POST /api/kernels/{id}/interrupt|restart``: 409 with the reason while the kernel's start
    (or restart) still waits for its GPU slice or is under way; else jupyter_server's own handler.

    jupyter_server answers 500 there ("Kernel is in a pending state"): there is no process yet
    to interrupt or restart, which is the client's to retry, not a server error."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        ext = self.settings.get("gpupool")
        reason = ext.kernel_hooks.not_started_reason(kernel_id, action) if ext is not None else None
        if reason is not None:
            raise web.HTTPError(409, reason.replace("%", "%%"))
        answered = super().post(kernel_id, action)
        if answered is not None:
            await answered


def routes() -> list[tuple[str, Any]]:
    """The routes the extension adds: the REST API (see handlers.py) and, ahead of jupyter_server's
    own route (extension routes are matched first), the 409 for acting on a kernel whose start waits."""
    kernel_action = r"/api/kernels/(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)/(?P<action>restart|interrupt)"
    return [*default_handlers, (kernel_action, KernelActionWhileStartingHandler)]


class HttpWiring:
    """Kernel status views and ``lease`` events for the REST API and front ends."""

    def __init__(self, ext: GpuPoolExtension) -> None:
        self.ext = ext

    def emit_unpooled(self, nbytes: int, device: str) -> None:
        """Emit an ``unpooled`` event (no lease; never whose): front ends re-read the pool view."""
        data: dict[str, Any] = {
            "action": "unpooled", "lease_id": None, "kernel_id": None, "state": None, "memory": int(nbytes),
            "guarantee": None, "limit": None,
            "queue_position": None, "queue_length": None, "deadline": None,
            "message": f"{format_size(nbytes)} of GPU {device} is used outside the pool; the pool does not grant it",
        }
        if self.ext.event_logger is None:  # the server has no event logger: nothing to emit to
            return
        try:
            self.ext.event_logger.emit(schema_id=LEASE_SCHEMA_ID, data=data)
        except Exception:
            self.ext.log.exception("gpupool: could not emit an unpooled event")

    def culled_reason(self, kernel_id: str) -> str | None:
        return self.ext._culled.get(kernel_id)

    def plan_for(self, lease: Lease) -> EnforcementPlan:
        return plan_enforcement(lease, self.ext.pool.devices(), self.ext.enforcement)

    def failure_of(self, kernel_id: str) -> str | None:
        """Why the last start of ``kernel_id`` failed (None if it did not, or if it is gone)."""
        prov = self.ext.provisioner_of(kernel_id)
        if prov is not None and prov.failure and prov.phase == "failed":
            return prov.failure
        return self.ext._failed.get(kernel_id)

    def kernel_status(self, kernel_id: str, lease: Lease | None) -> dict[str, Any]:
        """The ``GET /api/gpupool/kernels/{kernel_id}`` body (see openapi.yaml): ``failed`` with the
        reason for a kernel whose start failed, ``unavailable`` for one running CPU-only because
        the pool could not be used, else its lease."""
        now = time.time()
        failure = self.failure_of(kernel_id)
        if failure is not None:
            return kernel_status_without_pool(kernel_id, self.ext.owner, now, "failed", failure, lease)
        prov = self.ext.provisioner_of(kernel_id)
        if prov is not None and prov.cpu_only_reason and not prov.lease_id:
            return kernel_status_without_pool(
                kernel_id, self.ext.owner, now, "unavailable", prov.cpu_only_reason, None, pool_is_back=self.ext.available
            )
        if lease is None and prov is not None and prov.phase == "waiting" and prov.queue_update is not None:
            # Queued, and the pool cannot be asked now: what the wait last heard ("pool unavailable, retrying").
            queued, info = prov.queue_update
            return queued_status_while_unreachable(kernel_id, queued, info, self.ext.owner, now)
        if self.ext._pool is None or (lease is None and not self.ext.available):
            return kernel_status_without_pool(kernel_id, self.ext.owner, now, "unavailable", self.ext.availability()["reason"], None)
        status = kernel_status(self.ext.pool, kernel_id, lease, self.ext.enforcement, self.ext.owner, now)
        if lease is not None and lease.state is LeaseState.GRANTED and device_control_runs(self.ext.pool):
            status["enforcement"]["device_access"] = DEVICE_ACCESS  # the broker opens its GPUs, no other
        status["parking"] = self.ext.transition_driver.parking_of(lease)
        return status

    def on_lease(self, action: str, lease: Lease, info: QueueInfo | None, message: str) -> None:
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
        if self.ext.event_logger is None:  # the server has no event logger: nothing to emit to
            return
        try:
            self.ext.event_logger.emit(schema_id=LEASE_SCHEMA_ID, data=data)
        except Exception:
            self.ext.log.exception("gpupool: could not emit a lease event")
