"""REST API of the pool (``/api/gpupool/...``; the spec is ``openapi.yaml`` in the repository).

One base handler turns domain errors (:class:`~jupyter_gpupool.errors.GpuPoolError`) into HTTP
statuses with a JSON ``{"message": ...}`` body; every route is ``@authenticated`` and
``@authorized`` on a ``gpupool:`` resource.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict
from typing import Any, Protocol

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.extension.handler import ExtensionHandlerMixin
from tornado import web

from jupyter_gpupool.core import validate
from jupyter_gpupool.core.models import Lease
from jupyter_gpupool.errors import GpuPoolError, LeaseNotFound, NotAuthorized, PoolUnavailable, RequestRefused
from jupyter_gpupool.rest.jsonapi import JsonHandlerMixin, resize_on


class PoolExtension(Protocol):
    """What the handlers use of the :class:`~jupyter_gpupool.serverextension.app.GpuPoolExtension`
    (``settings["gpupool"]``): the app imports the handlers, never the other way round."""

    pool: Any
    owner: str
    admin_users: list[str]
    identity_is_owner: bool | None
    keepalive_default: float
    #: A :class:`~jupyter_gpupool.serverextension.gateway.GatewayKernels` when kernels run on a gateway, else None.
    gateway: Any

    @property
    def available(self) -> bool: ...

    def availability(self) -> dict[str, Any]: ...

    def kernel_status(self, kernel_id: str, lease: Lease | None) -> dict[str, Any]: ...

    def emit(
        self, action: str, lease: Lease, info: Any = None, message: str = "", deadline: float | None = None
    ) -> None: ...


ADMIN_SCOPE = "custom:gpupool:admin"
_KERNEL_ID = r"(?P<kernel_id>[\w-]+)"


def _default_identity_classes() -> tuple[type, ...]:
    from jupyter_server.auth.identity import IdentityProvider, PasswordIdentityProvider

    return (IdentityProvider, PasswordIdentityProvider)


class GpuPoolHandler(JsonHandlerMixin, ExtensionHandlerMixin, APIHandler):  # type: ignore[misc]
    """Base handler: who is asking, may they, and domain errors as JSON."""

    auth_resource = "gpupool:pool"

    @property
    def ext(self) -> PoolExtension:
        return self.settings["gpupool"]

    # --- identity ---------------------------------------------------------------------------------
    def viewer(self) -> str:
        """The pool user this request acts as: the lease owner name to compare with."""
        ext = self.ext
        identity_is_owner = ext.identity_is_owner
        if identity_is_owner is None:
            identity_is_owner = type(self.identity_provider) in _default_identity_classes()
        if identity_is_owner:
            return ext.owner
        user = self.current_user
        return str(getattr(user, "username", "") or getattr(user, "name", ""))

    def is_admin(self) -> bool:
        user = self.current_user
        name = str(getattr(user, "username", "") or "")
        if name and name in self.ext.admin_users:
            return True
        hub_user = getattr(user, "hub_user", None)
        scopes = (hub_user or {}).get("scopes", []) if isinstance(hub_user, dict) else []
        return ADMIN_SCOPE in scopes

    # --- errors -----------------------------------------------------------------------------------
    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, GpuPoolError):
            self.set_status(exc.http_status)
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": str(exc)}))
            return
        if status_code >= 500:  # never a traceback in a reply: it is in the server's log
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": "internal error in the GPU pool; see the Jupyter server's log"}))
            return
        super().write_error(status_code, **kwargs)

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, GpuPoolError):
            self.log.info("gpupool: %s %s: %s", self.request.method, self.request.path, value)
            return
        super().log_exception(typ, value, tb)


class PoolHandler(GpuPoolHandler):
    """``GET /api/gpupool/pool``: devices, leases (others' anonymous unless admin), queue, quota."""

    auth_resource = "gpupool:pool"

    @web.authenticated
    @authorized
    async def get(self) -> None:
        viewer, admin = self.viewer(), self.is_admin()
        try:
            snapshot = await asyncio.to_thread(self.ext.pool.snapshot, viewer, admin)
        except PoolUnavailable as err:  # the pool's state, not an error: "unavailable" with the reason
            body = {"devices": [], "leases": [], "queue": [], "now": time.time(), "quota": {}, "backend": None, "policy": None}
            body.update(self.ext.availability(), viewer={"name": viewer, "admin": admin})
            if body["state"] == "available":  # a call failed before the server's own loops noticed
                body.update(state="unavailable", reason=str(err))
            self.write_json(body)
            return
        body = asdict(snapshot)
        body.update(self.ext.availability())
        body["viewer"] = {"name": viewer, "admin": admin}
        body["backend"] = self.ext.pool.backend.describe()
        policy = self.ext.pool.policy
        body["policy"] = {
            "default_memory": self.ext.pool.default_memory(),
            "idle_timeout": policy.idle_timeout,
            "idle_policy": policy.idle_policy,
            "warning_period": policy.warning_period,
            "max_keep": policy.max_keep,
        }
        self.write_json(body)


class KernelHandlerBase(GpuPoolHandler):
    """Resolve ``kernel_id`` to its lease and check the caller may act on it."""

    auth_resource = "gpupool:kernels"

    def kernel_lease(self, kernel_id: str) -> Lease | None:
        """The kernel's newest lease (live, else the last released one); 404 / 403 as due."""
        self.check_path_arguments()  # here, after @authenticated: a stranger learns nothing from a 400
        ext = self.ext
        in_server = kernel_id in self.kernel_manager
        try:
            pool = ext.pool
            lease = pool.lease_for_kernel(kernel_id) or pool.last_lease_for_kernel(kernel_id)
        except PoolUnavailable:
            if not in_server:
                raise
            lease = None  # on this server: its status says the pool is unavailable (to its owner)
        if lease is None and not in_server:
            raise LeaseNotFound(f"no kernel {kernel_id!r} on this server and no GPU lease for it")
        owner = lease.owner if lease is not None else ext.owner
        if owner != self.viewer() and not self.is_admin():
            raise NotAuthorized(
                f"kernel {kernel_id} belongs to another user; only its owner or an admin may see or change its GPU slice"
            )
        return lease

    def live_lease(self, kernel_id: str) -> Lease:
        lease = self.kernel_lease(kernel_id)
        gateway = self.ext.gateway
        if lease is None and gateway is not None and kernel_id in self.kernel_manager:
            raise RequestRefused(gateway.refusal(kernel_id))
        if lease is None and not self.ext.available:
            raise PoolUnavailable(f"the GPU pool is unavailable: {self.ext.availability()['reason']}")
        if lease is None or not lease.live:
            why = f" ({lease.release_reason})" if lease is not None and lease.release_reason else ""
            raise RequestRefused(f"kernel {kernel_id} has no GPU slice{why}; restart the kernel to queue for a new one")
        return lease


class KernelStatusHandler(KernelHandlerBase):
    """``GET /api/gpupool/kernels/{kernel_id}``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        gateway = self.ext.gateway
        if gateway is not None and kernel_id in self.kernel_manager:
            await asyncio.to_thread(self.kernel_lease, kernel_id)  # who may ask: as for any kernel
            self.write_json(await gateway.status(self.kernel_manager, kernel_id, self.ext.owner))
            return

        def status() -> dict[str, Any]:
            return self.ext.kernel_status(kernel_id, self.kernel_lease(kernel_id))

        self.write_json(await asyncio.to_thread(status))


class ReserveHandler(KernelHandlerBase):
    """``POST .../reserve`` ``{"memory": "12GiB", "limit": "32GiB", "duration": "2h"}``: grow,
    shrink, set how far the slice may grow, hold through idle."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        memory, seconds, limit = validate.resize_limit_body(self.json_body())
        pool = self.ext.pool

        def reserve() -> dict[str, Any]:
            updated = resize_on(pool, self.live_lease(kernel_id), memory, seconds, limit)
            return {"lease": updated, "status": self.ext.kernel_status(kernel_id, updated)}

        result = await asyncio.to_thread(reserve)
        action = "resized" if memory is not None or limit is not None else "kept"
        self.ext.emit(action, result["lease"], message=f"{action} by the user")
        self.write_json(result["status"])


class ReleaseHandler(KernelHandlerBase):
    """``POST .../release``: give the slice back; the kernel keeps running without a GPU."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        pool = self.ext.pool

        def release() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            released = pool.release(lease.id, reason="released by user")
            return {"lease": released, "status": self.ext.kernel_status(kernel_id, released)}

        result = await asyncio.to_thread(release)
        self.ext.emit("released", result["lease"], message="released by the user")
        self.write_json(result["status"])


class KeepaliveHandler(KernelHandlerBase):
    """``POST .../keepalive`` ``{"duration": "1h"}`` (optional): keep the slice through idle."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        asked = validate.keep_body(self.json_body())
        pool = self.ext.pool

        def keep() -> dict[str, Any]:
            seconds = asked if asked is not None else min(self.ext.keepalive_default, pool.policy.max_keep)
            lease = self.live_lease(kernel_id)
            kept = pool.keep(lease.id, seconds)
            return {"lease": kept, "status": self.ext.kernel_status(kernel_id, kept)}

        result = await asyncio.to_thread(keep)
        self.ext.emit("kept", result["lease"], message="kept through idle by the user")
        self.write_json(result["status"])


class SuspendHandler(KernelHandlerBase):
    """``POST .../suspend``: park the kernel's GPU memory in host RAM now; its next cell resumes it."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        pool = self.ext.pool
        viewer = self.viewer()

        def suspend() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            who = "its user" if lease.owner == viewer else f"the admin {viewer}"
            suspended = pool.suspend(lease.id, reason=f"suspended by {who}")
            return {"lease": suspended, "status": self.ext.kernel_status(kernel_id, suspended)}

        result = await asyncio.to_thread(suspend)
        self.ext.emit("suspending", result["lease"], message=result["lease"].suspend_reason)
        self.write_json(result["status"])


class ResumeHandler(KernelHandlerBase):
    """``POST .../resume``: bring a suspended kernel back; it queues for a GPU by policy.

    ``{"ahead": true}`` (the front end, when the user starts working in the kernel's notebook):
    a resume asked before any cell needs it, which queues behind every real request and takes
    nothing from anyone; only the kernel's owner may ask it. Unused, the idle rules park the
    kernel again."""

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str) -> None:
        pool = self.ext.pool
        ahead = validate.boolean(self.json_body().get("ahead", False), "ahead")

        def resume() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            if ahead and lease.owner != self.viewer():
                raise NotAuthorized(f"kernel {kernel_id} belongs to another user; only its owner may resume it ahead of a cell")
            resumed = pool.resume(lease.id, ahead=True) if ahead else pool.resume(lease.id)
            return {"lease": resumed, "status": self.ext.kernel_status(kernel_id, resumed)}

        result = await asyncio.to_thread(resume)
        why = "resuming ahead of a cell: the user is working in its notebook" if ahead else "resuming: asked by the user"
        self.ext.emit("resuming", result["lease"], message=why)
        self.write_json(result["status"])


default_handlers: list[tuple[str, type[GpuPoolHandler]]] = [
    (r"/api/gpupool/pool", PoolHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}", KernelStatusHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}/reserve", ReserveHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}/release", ReleaseHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}/keepalive", KeepaliveHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}/suspend", SuspendHandler),
    (rf"/api/gpupool/kernels/{_KERNEL_ID}/resume", ResumeHandler),
]
