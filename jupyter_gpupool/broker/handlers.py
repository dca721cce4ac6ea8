"""The broker's REST API: the single-user API (``/api/gpupool/pool``, ``.../kernels/...``) plus the
lease-level routes a remote :class:`~jupyter_gpupool.backends.remote.RemotePool` needs.

Every route first identifies the caller (401 without valid credentials, 403 without the
service's access scope), then checks the lease belongs to them unless they are an admin (403).
Domain errors become their HTTP status with ``{"error": <class>, "message": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from tornado import web

from jupyter_gpupool.broker.auth import Forbidden, Identity, Unauthenticated
from jupyter_gpupool.broker.interface import BrokerInterface
from jupyter_gpupool.broker.limits import TooManyConnections, TooManyRefusals
from jupyter_gpupool.core import validate
from jupyter_gpupool.core.models import Activity, Lease, LeaseState, PriorityClass, Transition
from jupyter_gpupool.core.validate import MAX_BODY_BYTES, BodyTooLarge
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, LeaseNotFound, NotAuthorized, RequestRefused
from jupyter_gpupool.rest import anonymous
from jupyter_gpupool.rest.jsonapi import JsonHandlerMixin, json_object, resize_on

#: Longest long poll of ``GET .../wait`` in seconds.
MAX_WAIT = 30.0
DEFAULT_KEEP = 3600.0


def lease_json(lease: Lease, queue: Any = None) -> dict[str, Any]:
    data = lease.to_json()
    data["queue"] = (
        None
        if queue is None
        else {
            "position": queue.position,
            "length": queue.length,
            "estimated_wait": queue.estimated_wait,
            "reason": queue.reason,
        }
    )
    return data


#: Answers a caller can have again at once by asking again: what ``Broker.refused_requests_allowed`` counts.
REFUSED_STATUSES = frozenset({400, 401, 403, 404, 413, 429})


@web.stream_request_body
class BrokerHandler(JsonHandlerMixin, web.RequestHandler):
    """Base: identity in ``prepare``, JSON errors, pool calls on the broker's worker thread.

    The body is streamed, not read whole before ``prepare``: a ``Content-Length`` over
    :data:`~jupyter_gpupool.core.validate.MAX_BODY_BYTES` is refused (413) before a byte of it is
    read or anyone is identified, and a body without one is counted as it comes, refused once past.
    """

    identity: Identity
    _chunks: list[bytes]
    _body_size = 0
    _body_refused = False

    @property
    def broker(self) -> BrokerInterface:
        return self.settings["gpupool_broker"]

    async def prepare(self) -> None:
        await self.pause_if_refused_often()
        self.begin()
        self.identity = await self.broker.identify(self)
        refusal = self.broker.connections.identified(self.request.connection.stream, self.identity.name)
        if refusal is not None:
            self.close_after_answer()
            raise TooManyConnections(refusal)
        self.check_path_arguments()

    def _caller(self) -> str | None:
        """Whom this connection's refusals count for (``uid:1000``, ``user:alice``); None for a TCP
        connection not identified yet (its address may be every hub user's)."""
        key = self.broker.connections.holder(self.request.connection.stream)
        return None if key is None or key[0] == "address" else f"{key[0]}:{key[1]}"

    async def pause_if_refused_often(self) -> None:
        """A caller past ``Broker.refused_requests_allowed`` refusals waits before its request is
        looked at (its body is not read meanwhile): its loop slows, nobody else's requests do."""
        caller = self._caller()
        wait = self.broker.refused_requests.wait_left(caller) if caller is not None else 0.0
        if wait > 0:
            await asyncio.sleep(min(wait, self.broker.refused_requests_pause))

    def begin(self) -> None:
        """Before any work for a request: mark its connection busy, refuse a body declared too large."""
        self._chunks = []
        self.broker.connections.started(self.request.connection.stream)
        length = self.request.headers.get("Content-Length")
        if length in (None, "0") and "Transfer-Encoding" not in self.request.headers:
            # Nothing left to read: an answer given now (a 401 from here) keeps the connection open
            # for the next request, as it did when bodies were read before prepare. (Tornado closes
            # a connection answered before its body was read; a proxy that pools connections to the
            # broker would then send its next request into a closing one and answer it 503.)
            connection = self.request.connection
            if hasattr(connection, "_read_finished"):
                connection._read_finished = True
        if length is not None:
            try:
                declared = int(length.split(",")[0])
            except ValueError:
                raise InvalidInput(f"Content-Length must be a whole number of bytes, got {length[:40]!r}") from None
            if declared > MAX_BODY_BYTES:
                raise BodyTooLarge(f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are accepted")

    def data_received(self, chunk: bytes) -> None:
        """A piece of the body: kept while the body stays within the bound, else the request is refused (413)."""
        if self._body_refused:
            return
        self._body_size += len(chunk)
        if self._body_size > MAX_BODY_BYTES:
            self._body_refused = True
            self._chunks = []
            error = BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES} are accepted")
            self.send_error(413, exc_info=(BodyTooLarge, error, None))
            return
        self._chunks.append(chunk)

    def json_body(self) -> dict[str, Any]:
        """The request body as a dict (see :meth:`JsonHandlerMixin.json_body`), from the streamed pieces."""
        if self._body_refused:
            raise BodyTooLarge(f"the request body is over {MAX_BODY_BYTES} bytes; at most {MAX_BODY_BYTES} are accepted")
        return json_object(b"".join(getattr(self, "_chunks", ())))

    def close_after_answer(self) -> None:
        """Close the connection once this answer is written (no keep-alive)."""
        connection = self.request.connection
        if hasattr(connection, "_disconnect_on_finish"):
            connection._disconnect_on_finish = True

    def on_finish(self) -> None:
        self.broker.connections.finished(self.request.connection.stream)
        if self.get_status() in REFUSED_STATUSES:
            caller = self._caller()
            if caller is not None:
                self.broker.refused_requests.refused(caller)

    def query(self, name: str) -> str | None:
        """A query argument (the last one given), bounded in length; None when absent."""
        value = self.get_argument(name, None)
        return None if value is None else validate.text(value, name)

    def query_flag(self, name: str) -> bool:
        value = self.query(name)
        return validate.flag(value, name) if value is not None else False

    def check_xsrf_cookie(self) -> None:
        """Token and socket credentials only, never cookies: nothing for XSRF to forge."""

    def write_json(self, data: Any, status: int = 200) -> None:
        """The answer as JSON; a caller who is not an admin gets every other user a decision names
        in it rewritten as "another user" (see :func:`~jupyter_gpupool.rest.anonymous.for_viewer`)."""
        identity = getattr(self, "identity", None)
        if identity is not None and not identity.admin:
            data = anonymous.for_viewer(data, identity.name)
        super().write_json(data, status)

    # --- helpers --------------------------------------------------------------------------------
    async def run(self, fn: Any, *args: Any) -> Any:
        return await self.broker.run(fn, *args)

    def own(self, lease: Lease) -> Lease:
        """The lease if the caller may see and change it; else 403."""
        if lease.owner != self.identity.name and not self.identity.admin:
            # Named as the caller named it: a kernel's route must not tell whose lease id it has.
            kernel_id = (self.path_kwargs or {}).get("kernel_id")
            what = f"kernel {kernel_id}'s lease" if kernel_id else f"lease {lease.id}"
            raise NotAuthorized(f"{what} belongs to another user; only its owner or a pool admin may see or change it")
        return lease

    def owned(self, lease_id: str) -> Lease:
        """Worker-thread helper: get (404) and check ownership (403)."""
        return self.own(self.broker.pool.get(lease_id))

    # --- errors -----------------------------------------------------------------------------------
    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, GpuPoolError):
            status, name, message = exc.http_status, type(exc).__name__, str(exc)
        elif isinstance(exc, (Unauthenticated, Forbidden)):
            status, name, message = exc.status_code, "NotAuthorized", exc.message
        elif isinstance(exc, web.HTTPError):
            status, name, message = exc.status_code, "HTTPError", exc.log_message or self._reason
        else:
            status, name, message = 500, "GpuPoolError", "internal error in the GPU pool broker; see its log"
        identity = getattr(self, "identity", None)
        if identity is not None and not identity.admin:
            message = anonymous.rewrite_text(message, identity.name)
        if not getattr(self.request.connection, "_read_finished", True):
            # Answered before its body was read: the connection closes after this answer, and says so
            # (tornado would close it anyway, after headers that promised keep-alive).
            self.close_after_answer()
        self.set_status(status)
        if status == 401:
            self.set_header("WWW-Authenticate", 'token realm="gpupool"')
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": name, "message": message}))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, (GpuPoolError, Unauthenticated, Forbidden)):
            # A refusal a caller can repeat at will: one line per kind and caller per interval.
            identity = getattr(self, "identity", None)
            who = identity.name if identity is not None else self.request.remote_ip or "socket"
            self.broker.note(
                ("refusal", type(value).__name__, who), logging.INFO, "%s %s: %s",
                self.request.method, self.request.path, getattr(value, "message", value),
            )  # fmt: skip
            return
        super().log_exception(typ, value, tb)


# --- who, what ----------------------------------------------------------------------------------------
class WhoAmIHandler(BrokerHandler):
    """``GET /api/gpupool/whoami``: the caller as the broker identified them."""

    async def get(self) -> None:
        self.write_json(self.identity.to_json())


class InfoHandler(BrokerHandler):
    """``GET /api/gpupool/info``: version, backend, policy and the caller."""

    async def get(self) -> None:
        self.write_json(await self.run(self.broker.info, self.identity))


class PoolHandler(BrokerHandler):
    """``GET /api/gpupool/pool``: devices, leases (others' anonymous unless admin), queue, quota."""

    async def get(self) -> None:
        ident = self.identity

        def snapshot() -> dict[str, Any]:
            pool = self.broker.pool
            snap = pool.snapshot(viewer=ident.name, admin=ident.admin)
            body = {
                "devices": snap.devices,
                "leases": snap.leases,
                "queue": snap.queue,
                "now": snap.now,
                "quota": snap.quota,
                "reservations": snap.reservations,
                "unpooled": snap.unpooled,
            }
            body["viewer"] = ident.to_json()
            body["backend"] = pool.backend.describe()
            body["policy"] = self.broker.policy_json()
            return body

        self.write_json(await self.run(snapshot))


class DevicesHandler(BrokerHandler):
    """``GET /api/gpupool/devices``: every device in full (what a remote provisioner plans with)."""

    async def get(self) -> None:
        devices = await self.run(self.broker.pool.devices)
        self.write_json([d.to_json() for d in devices])


class QueueHandler(BrokerHandler):
    """``GET /api/gpupool/queue``: queued leases in service order (others anonymous unless admin)."""

    async def get(self) -> None:
        ident = self.identity

        def queue() -> list[dict[str, Any]]:
            pool = self.broker.pool
            return [pool.view_lease(lease, ident.name, ident.admin, i + 1) for i, lease in enumerate(pool.queue())]

        self.write_json(await self.run(queue))


# --- leases ---------------------------------------------------------------------------------------------
class LeasesHandler(BrokerHandler):
    """``GET /api/gpupool/leases`` (yours; ``?all=1`` for admins; ``?kernel_id=``; ``?released=1``)
    and ``POST`` a request (the owner and groups are the caller's, never from the body)."""

    async def get(self) -> None:
        ident = self.identity
        everyone = self.query_flag("all") and ident.admin
        owner = self.query("owner")
        if owner is not None and owner != ident.name and not ident.admin:
            raise NotAuthorized("only pool admins may list another user's leases")
        kernel_id = self.query("kernel_id")
        released = self.query_flag("released")

        def leases() -> list[dict[str, Any]]:
            who = None if everyone and owner is None else (owner or ident.name)
            found = self.broker.pool.leases(owner=who, include_released=released, kernel_id=kernel_id)
            return [lease.to_json() for lease in found]

        self.write_json(await self.run(leases))

    async def post(self) -> None:
        raw = self.json_body()
        ident = self.identity

        def request() -> tuple[dict[str, Any], bool]:
            body = validate.lease_request_body(raw, self.broker.pool.policy.max_gpus_per_lease)
            if (suspendable := raw.get("suspendable")) is not None:
                body["suspendable"] = validate.boolean(suspendable, "suspendable")  # its server can checkpoint it
            return self.broker.request_lease(ident, body)

        data, created = await self.run(request)
        self.write_json(data, status=201 if created else 200)


class LeaseHandler(BrokerHandler):
    """``GET`` a lease (with its queue position, or its place in line while its grow waits) and
    ``DELETE`` it (release; ``?reason=``)."""

    async def get(self, lease_id: str) -> None:
        def get() -> dict[str, Any]:
            lease = self.owned(lease_id)
            info = self.broker.pool.queue_info(lease.id) if lease.state is LeaseState.QUEUED else None
            place = self.broker.pool.grow_place(lease.id) if lease.grow_since is not None else None
            return lease_json(lease, info) | {"grow_place": place}

        self.write_json(await self.run(get))

    async def delete(self, lease_id: str) -> None:
        await release_lease(self, lease_id, validate.text(self.get_argument("reason", ""), "reason", validate.MAX_TEXT))


class LeaseReleaseHandler(BrokerHandler):
    """``POST .../leases/{id}/release`` ``{"reason": ...}``: the same as ``DELETE``, for clients without DELETE."""

    async def post(self, lease_id: str) -> None:
        reason = validate.optional(self.json_body(), "reason")
        await release_lease(
            self, lease_id, validate.text(reason, "reason", validate.MAX_TEXT) if reason is not None else ""
        )


async def release_lease(handler: BrokerHandler, lease_id: str, reason: str) -> None:
    ident = handler.identity
    reason = reason or "released by user"

    def release() -> dict[str, Any]:
        lease = handler.owned(lease_id)
        why = reason if lease.owner == ident.name else f"{reason} (by admin {ident.name})"
        return lease_json(handler.broker.pool.release(lease.id, reason=why))

    handler.write_json(await handler.run(release))


class LeaseResizeHandler(BrokerHandler):
    """``POST .../leases/{id}/resize`` ``{"memory": "12GiB" | bytes, "limit": "32GiB" | 0, "duration": "2h" | seconds}``."""

    async def post(self, lease_id: str) -> None:
        memory, seconds, limit = validate.resize_limit_body(self.json_body())

        def resize() -> dict[str, Any]:
            return lease_json(resize_on(self.broker.pool, self.owned(lease_id), memory, seconds, limit))

        self.write_json(await self.run(resize))


class LeaseGrowHandler(BrokerHandler):
    """``POST .../leases/{id}/grow`` ``{"needed": "6GiB" | bytes}``: grow an elastic slice so its kernel
    can hold that much (all its GPUs), as a framework cap's allocation failure asks (owner or admin);
    409 saying why not (the GPU is full, the slice is fixed, its limit, a request waits)."""

    async def post(self, lease_id: str) -> None:
        needed = validate.grow_body(self.json_body())

        def grow() -> dict[str, Any]:
            pool = self.broker.pool
            lease = self.owned(lease_id)
            return lease_json(pool.grow(lease.id, pool.parse_memory(needed)))

        self.write_json(await self.run(grow))


class LeasePinnedBackupHandler(BrokerHandler):
    """``POST .../leases/{id}/pinned-backup`` ``{"bytes": N}``: set aside N bytes of the host's pinned
    parking pool for the lease's framework backup before a fast park (owner or admin; 0 gives it
    back). The broker keeps these books, so no server's file decides what another user may park;
    409 saying why when the pool or the parked-memory budget has no room."""

    async def post(self, lease_id: str) -> None:
        amount = validate.pinned_backup_body(self.json_body())

        def reserve() -> dict[str, Any]:
            return lease_json(self.broker.pool.reserve_pinned_backup(self.owned(lease_id).id, amount))

        self.write_json(await self.run(reserve))


class LeasePriorityHandler(BrokerHandler):
    """``POST .../leases/{id}/priority`` ``{"priority": "batch" | "normal" | "high"}``: admins re-prioritise."""

    async def post(self, lease_id: str) -> None:
        body = self.json_body()
        if not self.identity.admin:
            raise NotAuthorized("only pool admins may re-prioritise a lease")
        priority = validate.priority(body.get("priority"))

        def set_priority() -> dict[str, Any]:
            return lease_json(self.broker.pool.set_priority(lease_id, priority))

        self.write_json(await self.run(set_priority))


# --- suspend, resume and their confirmations ---------------------------------------------------------------
class LeaseSuspendHandler(BrokerHandler):
    """``POST .../leases/{id}/suspend`` ``{"reason": "..."}``: ask the holder's server to park the
    lease's GPU memory in host RAM (owner or admin); 409 saying why when it cannot be suspended."""

    async def post(self, lease_id: str) -> None:
        reason = validate.suspend_reason(self.json_body())
        ident = self.identity

        def suspend() -> dict[str, Any]:
            lease = self.owned(lease_id)
            why = reason if lease.owner == ident.name else f"{reason} (by admin {ident.name})"
            return lease_json(self.broker.pool.suspend(lease.id, reason=why))

        self.write_json(await self.run(suspend))


class LeaseResumeHandler(BrokerHandler):
    """``POST .../leases/{id}/resume``: queue a suspended lease to come back (owner or admin); harmless
    on a lease already queued to resume, being restored, or running."""

    async def post(self, lease_id: str) -> None:
        # {"ahead": true}: asked before a cell needs it; queues behind every real request (owner only).
        ahead = validate.boolean(self.json_body().get("ahead", False), "ahead")

        def resume() -> dict[str, Any]:
            pool = self.broker.pool
            owned = self.owned(lease_id)
            if ahead and owned.owner != self.identity.name:
                raise NotAuthorized(f"lease {lease_id} belongs to another user; only its owner may resume it ahead of a cell")
            lease = pool.resume(owned.id, ahead=True) if ahead else pool.resume(owned.id)
            return lease_json(lease, pool.queue_info(lease.id) if lease.state is LeaseState.QUEUED else None)

        self.write_json(await self.run(resume))


#: Where a lease stands once each step was confirmed: a retried confirmation that finds it there was
#: already applied (its first answer was lost), so it answers the lease and changes nothing.
_AFTER_CONFIRM: dict[str, frozenset[LeaseState]] = {
    "suspending": frozenset({LeaseState.SUSPENDED, LeaseState.QUEUED}),
    "restoring": frozenset({LeaseState.GRANTED}),
    "migrating": frozenset({LeaseState.GRANTED}),
}


def already_finished(lease: Lease, step: str, outcome: str) -> bool:
    """Whether ``lease`` shows ``step`` already finished with ``outcome`` (a repeated report)."""
    if lease.transition is not Transition.NONE:
        return False
    if outcome == "failed":
        return True  # a failure was called off (running again) or ended the lease: nothing left to fail
    return lease.state in _AFTER_CONFIRM[step] and (lease.state is not LeaseState.QUEUED or lease.resuming)


class LeaseTransitionHandler(BrokerHandler):
    """``POST .../leases/{id}/transition`` ``{"outcome": "done"|"failed", "transition"?, "parked_bytes"?,
    "error"?, "still_running"?}``: the holder's server reports a suspend, restore or move it carried out.

    Only the lease's owner (its server, which holds the user's identity) or an admin: confirming someone
    else's suspend would free GPU memory still in use. Naming the ``transition`` being finished makes a
    report safe to repeat: one already applied answers the lease unchanged (200); one about another
    step than the lease's is refused (409). Without it, the step under way is finished (400 when none).
    """

    async def post(self, lease_id: str) -> None:
        body = validate.transition_body(self.json_body())
        step, outcome = body["transition"], body["outcome"]
        ident = self.identity
        # Each refused report costs the shared worker; past a few, a caller's next ones wait, not everyone.
        wait = self.broker.refused_reports.wait_left(ident.name)
        if wait > 0:
            # Answered after a pause (up to a second): a client that loops at once holds its own
            # connection meanwhile, instead of the broker's CPU that serves everyone.
            await asyncio.sleep(min(wait, 1.0))
            raise TooManyRefusals(
                f"{ident.name}'s reports of finished steps were refused too often lately; try again in "
                f"{wait:.0f} s (c.Broker.refused_reports_allowed and c.Broker.refused_reports_budget per "
                "c.Broker.refused_reports_window)"
            )

        started = [time.monotonic()]

        def finish() -> dict[str, Any]:
            started[0] = time.monotonic()  # the worker's time, not the wait for it
            pool = self.broker.pool
            lease = self.owned(lease_id)
            if step is not None and lease.transition.value != step:
                if already_finished(lease, step, outcome):
                    return lease_json(lease)
                where = lease.transition.value or lease.state.value
                raise RequestRefused(f"lease {lease.id} is not {step} (it is {where}); nothing was changed")
            restoring_since = lease.transition_at if lease.transition is Transition.RESTORING else None
            if outcome == "done":
                now = pool.clock()
                done = pool.confirm_transition(lease.id, parked_bytes=body["parked_bytes"], now=now)
                if restoring_since is not None:
                    self.broker.observe_restore(max(0.0, now - restoring_since))
                return lease_json(done)
            error = body["error"] if lease.owner == ident.name else f"{body['error']} (reported by admin {ident.name})"
            return lease_json(pool.fail_transition(lease.id, error, body["still_running"]))

        try:
            answer = await self.run(finish)
        except GpuPoolError as err:
            if err.http_status == 409:
                self.broker.refused_reports.refused(ident.name, time.monotonic() - started[0])
            raise
        self.write_json(answer)


def keep_seconds(body: dict[str, Any], pool: Any) -> float:
    """The hold a keepalive body asks for: its ``duration``, else one hour (within ``max_keep``)."""
    seconds = validate.keep_body(body)
    return seconds if seconds is not None else float(min(DEFAULT_KEEP, pool.policy.max_keep))


class LeaseKeepHandler(BrokerHandler):
    """``POST .../leases/{id}/keepalive`` ``{"duration": "1h"}``: hold through idle (default 1 h)."""

    async def post(self, lease_id: str) -> None:
        body = self.json_body()

        def keep() -> dict[str, Any]:
            pool = self.broker.pool
            seconds = keep_seconds(body, pool)
            lease = self.owned(lease_id)
            return lease_json(pool.keep(lease.id, seconds))

        self.write_json(await self.run(keep))


class LeaseActivityHandler(BrokerHandler):
    """``POST .../leases/{id}/activity`` ``{"busy": bool, "last_activity": time, "connections": n}`` (+ heartbeat)."""

    async def post(self, lease_id: str) -> None:
        activity = parse_activity(self.json_body())

        def report() -> None:
            lease = self.owned(lease_id)
            self.broker.pool.report_activity(lease.id, activity)

        await self.run(report)
        self.set_status(204)
        self.finish()


class LeaseWaitHandler(BrokerHandler):
    """``GET .../leases/{id}/wait?timeout=S&position=P``: long poll while queued (heartbeats it);
    answers when granted or released, when the position is no longer ``P``, or after ``S`` seconds."""

    async def get(self, lease_id: str) -> None:
        raw_timeout, raw_position = self.query("timeout"), self.query("position")
        # Longer waits are cut to MAX_WAIT (a client asks again); a wrong type is a 400.
        timeout = validate.number(raw_timeout, "timeout", 0.0, validate.MAX_TIME) if raw_timeout else 10.0
        timeout = min(MAX_WAIT, timeout)
        position = validate.whole_number(raw_position, "position", 0, validate.MAX_COUNT) if raw_position else None
        deadline = time.monotonic() + timeout
        pool = self.broker.pool

        def poll() -> tuple[Lease, Any]:
            lease = self.owned(lease_id)
            if lease.state is LeaseState.QUEUED:
                pool.heartbeat([lease.id])
                return lease, pool.queue_info(lease.id)
            return lease, None

        with self.broker.open_waits.held(self.identity.name):
            while True:
                lease, info = await self.run(poll)
                if lease.state is not LeaseState.QUEUED:
                    break
                if info is None or info.position != position or time.monotonic() >= deadline:
                    break
                stream = getattr(self.request.connection, "stream", None)
                if stream is not None and stream.closed():
                    return
                await asyncio.sleep(min(self.broker.wait_poll, max(0.0, deadline - time.monotonic())))
        self.write_json(lease_json(lease, info))


class ChangesHandler(BrokerHandler):
    """``GET /api/gpupool/changes?since=V&timeout=S``: long poll until something changed in the
    caller's own leases after version ``V`` (a suspend, restore or move decided, a warning, a grow,
    a lease granted or released), or ``S`` seconds passed; answers ``{"version": ...}``, an opaque
    number of the caller's view. Without ``since`` it answers at once. What changed is not said: a
    server reads its own leases and carries out the decision the moment it is taken. Others'
    decisions do not wake it, so the poll tells nobody when other users are active. A poll whose
    client hung up stops waiting then, not at its timeout."""

    _poll: asyncio.Future[int] | None = None
    _hung_up = False

    async def get(self) -> None:
        raw_since, raw_timeout = self.query("since"), self.query("timeout")
        since = validate.whole_number(raw_since, "since (the version you last saw)", 0, 2**63 - 1) if raw_since else None
        timeout = validate.number(raw_timeout, "timeout", 0.0, validate.MAX_TIME) if raw_timeout else 10.0
        if self._hung_up:
            return  # while it was identified
        with self.broker.open_waits.held(self.identity.name):
            self._poll = asyncio.ensure_future(self.broker.view_versions.wait(self.identity.name, since, min(MAX_WAIT, timeout)))
            try:
                mine = await self._poll
            except asyncio.CancelledError:
                if self._hung_up:
                    return  # nobody to answer
                raise  # the broker stops
        self.write_json({"version": mine})

    def on_connection_close(self) -> None:
        """The client hung up: its poll stops waiting."""
        super().on_connection_close()  # a streamed body's wait ends too
        self._hung_up = True
        if self._poll is not None:
            self._poll.cancel()


# --- batch routes for a server's periodic loop ----------------------------------------------------------
class ActivityHandler(BrokerHandler):
    """``POST /api/gpupool/activity`` ``{"activities": {lease_id: {busy, last_activity, connections}}}``."""

    async def post(self) -> None:
        raw = self.json_body().get("activities") or {}
        if not isinstance(raw, dict) or len(raw) > validate.MAX_ITEMS:
            raise InvalidInput(
                f'"activities" must map at most {validate.MAX_ITEMS} lease ids to {{"busy": ..., "connections": ...}}'
            )
        activities = {validate.text(k, "lease id"): parse_activity(v) for k, v in raw.items()}

        def report() -> None:
            self.broker.check_owned(self.identity, activities)
            self.broker.pool.report_activities(activities)

        await self.run(report)
        self.set_status(204)
        self.finish()


class HeartbeatHandler(BrokerHandler):
    """``POST /api/gpupool/heartbeat`` ``{"lease_ids": [...]}``."""

    async def post(self) -> None:
        ids = validate.text_list(self.json_body().get("lease_ids") or [], "lease_ids")

        def beat() -> None:
            self.broker.check_owned(self.identity, ids)
            self.broker.pool.heartbeat(ids)

        await self.run(beat)
        self.set_status(204)
        self.finish()


class ReconcileHandler(BrokerHandler):
    """``POST /api/gpupool/reconcile`` ``{"holder_host", "holder_pid", "live_kernel_ids"}``: release the
    caller's leases of that holder whose kernel is gone (never another user's)."""

    async def post(self) -> None:
        body = self.json_body()
        if "holder_host" not in body or "holder_pid" not in body:
            raise InvalidInput('send {"holder_host": "...", "holder_pid": 123, "live_kernel_ids": [...]}')
        host = validate.text(body["holder_host"], "holder_host")
        pid = validate.pid(body["holder_pid"])
        live = set(validate.text_list(body.get("live_kernel_ids") or [], "live_kernel_ids"))
        ident = self.identity

        def reconcile() -> list[dict[str, Any]]:
            pool = self.broker.pool
            gone = [
                lease
                for lease in pool.leases(owner=None if ident.admin else ident.name)
                if lease.holder_host == host
                and lease.holder_pid == pid
                and lease.kernel_id
                and lease.kernel_id not in live
            ]
            return [pool.release(lease.id, reason="released: its kernel is gone").to_json() for lease in gone]

        self.write_json(await self.run(reconcile))


class TickHandler(BrokerHandler):
    """``POST /api/gpupool/tick``: run the scheduler now; answers the decisions about the caller's leases
    (every decision for admins)."""

    async def post(self) -> None:
        ident = self.identity

        def tick() -> list[dict[str, Any]]:
            decisions = self.broker.pool.tick()
            return [d.to_json() for d in decisions if ident.admin or d.owner == ident.name]

        self.write_json(await self.run(tick))


# --- the single-user API: kernels -------------------------------------------------------------------------
class KernelHandlerBase(BrokerHandler):
    def kernel_lease(self, kernel_id: str) -> Lease:
        pool = self.broker.pool
        lease = pool.lease_for_kernel(kernel_id) or pool.last_lease_for_kernel(kernel_id)
        if lease is None:
            raise LeaseNotFound(f"no GPU lease for kernel {kernel_id!r}")
        return self.own(lease)

    def live_lease(self, kernel_id: str) -> Lease:
        lease = self.kernel_lease(kernel_id)
        if not lease.live:
            why = f" ({lease.release_reason})" if lease.release_reason else ""
            raise RequestRefused(f"kernel {kernel_id} has no GPU slice{why}; restart the kernel to queue for a new one")
        return lease


class KernelStatusHandler(KernelHandlerBase):
    """``GET /api/gpupool/kernels/{kernel_id}``."""

    async def get(self, kernel_id: str) -> None:
        self.write_json(await self.run(lambda: self.broker.kernel_status(kernel_id, self.kernel_lease(kernel_id))))


class KernelReserveHandler(KernelHandlerBase):
    """``POST .../kernels/{kernel_id}/reserve`` ``{"memory": "12GiB", "limit": "32GiB", "duration": "2h"}``."""

    async def post(self, kernel_id: str) -> None:
        memory, seconds, limit = validate.resize_limit_body(self.json_body())

        def reserve() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            return self.broker.kernel_status(kernel_id, resize_on(self.broker.pool, lease, memory, seconds, limit))

        self.write_json(await self.run(reserve))


class KernelReleaseHandler(KernelHandlerBase):
    """``POST .../kernels/{kernel_id}/release``."""

    async def post(self, kernel_id: str) -> None:
        def release() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            return self.broker.kernel_status(kernel_id, self.broker.pool.release(lease.id, reason="released by user"))

        self.write_json(await self.run(release))


class KernelKeepaliveHandler(KernelHandlerBase):
    """``POST .../kernels/{kernel_id}/keepalive`` ``{"duration": "1h"}`` (optional)."""

    async def post(self, kernel_id: str) -> None:
        body = self.json_body()

        def keep() -> dict[str, Any]:
            pool = self.broker.pool
            seconds = keep_seconds(body, pool)
            lease = self.live_lease(kernel_id)
            return self.broker.kernel_status(kernel_id, pool.keep(lease.id, seconds))

        self.write_json(await self.run(keep))


class KernelSuspendHandler(KernelHandlerBase):
    """``POST .../kernels/{kernel_id}/suspend`` ``{"reason": "..."}``: as the single-user API's (the
    kernel's server carries it out); 409 saying why when it cannot be suspended."""

    async def post(self, kernel_id: str) -> None:
        reason = validate.suspend_reason(self.json_body())
        ident = self.identity

        def suspend() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            why = reason if lease.owner == ident.name else f"{reason} (by admin {ident.name})"
            return self.broker.kernel_status(kernel_id, self.broker.pool.suspend(lease.id, reason=why))

        self.write_json(await self.run(suspend))


class KernelResumeHandler(KernelHandlerBase):
    """``POST .../kernels/{kernel_id}/resume``: queue a suspended kernel to come back (the Resume button)."""

    async def post(self, kernel_id: str) -> None:
        self.json_body()

        def resume() -> dict[str, Any]:
            lease = self.live_lease(kernel_id)
            return self.broker.kernel_status(kernel_id, self.broker.pool.resume(lease.id))

        self.write_json(await self.run(resume))


class NotFoundHandler(BrokerHandler):
    """Any other path: 401/403 first (an unknown route tells a stranger nothing), then 404."""

    async def prepare(self) -> None:
        await super().prepare()
        raise web.HTTPError(404, "no such route; the API is under /api/gpupool/ (see openapi.yaml)")


def parse_activity(data: Any) -> Activity:
    """A kernel's activity report, typed and bounded (see :func:`~jupyter_gpupool.core.validate.activity_fields`)."""
    busy, last_activity, connections = validate.activity_fields(data)
    return Activity(busy=busy, last_activity=last_activity, connections=connections)


def parse_priority(value: Any) -> PriorityClass | None:
    """The class a request asks for; None (absent) means "whatever my user or group is configured
    for" (a ``staff: high`` group gets high). A user may ask for less, never for more."""
    if value in (None, ""):
        return None
    return PriorityClass(validate.priority(value))


__all__ = ["MAX_WAIT", "BrokerHandler", "NotFoundHandler", "lease_json", "parse_activity", "parse_priority"]
