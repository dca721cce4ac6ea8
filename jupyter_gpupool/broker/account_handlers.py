"""The broker's routes about the pool as a whole rather than one lease: metering reports,
reservations, a user's saved preferences, the event log, an admin clearing a stale claim on a kernel
id, and Prometheus metrics."""

from __future__ import annotations

from typing import Any

from jupyter_gpupool.broker.handlers import BrokerHandler
from jupyter_gpupool.core import validate
from jupyter_gpupool.enforcement.claims import clear_kernel_claim
from jupyter_gpupool.errors import NotAuthorized


class ReportHandler(BrokerHandler):
    """``GET /api/gpupool/report?since=&until=&by=user|group|kernel&period=none|day|week|month`` (POSIX
    seconds): admins see all rows, users their own rows of ``by=user``."""

    async def get(self) -> None:
        by = self.query("by") or "user"  # the pool names the choices (PoolPolicy's report forms)
        period = self.query("period") or "none"
        raw_since, raw_until = self.query("since"), self.query("until")
        since = validate.timestamp(raw_since, "since (POSIX seconds)") if raw_since else None
        until = validate.timestamp(raw_until, "until (POSIX seconds)") if raw_until else None
        validate.time_range(since, until, f"since={raw_since}", f"until={raw_until}")
        ident = self.identity
        if not ident.admin and by != "user":
            raise NotAuthorized("only pool admins may see reports by group or kernel; ask for by=user")

        def report() -> list[dict[str, Any]]:
            rows = self.broker.pool.report(since=since, until=until, by=by, period=period)
            return rows if ident.admin else [row for row in rows if row.get("user") == ident.name]

        self.write_json(await self.run(report))


class ReservationsHandler(BrokerHandler):
    """``GET`` reservations (everyone: they shape the queue); ``POST`` one (admins)."""

    async def get(self) -> None:
        self.write_json([r.to_json() for r in await self.run(self.broker.pool.reservations)])

    async def post(self) -> None:
        if not self.identity.admin:
            raise NotAuthorized("only pool admins may book reservations")
        spec = validate.reservation_body(self.json_body())
        reservation = await self.run(self.broker.pool.book_reservation, spec)
        self.write_json(reservation.to_json(), status=201)


class ReservationHandler(BrokerHandler):
    """``DELETE /api/gpupool/reservations/{name}`` (admins)."""

    async def delete(self, name: str) -> None:
        if not self.identity.admin:
            raise NotAuthorized("only pool admins may cancel reservations")
        await self.run(self.broker.pool.cancel_reservation, name)
        self.set_status(204)
        self.finish()


class PreferencesHandler(BrokerHandler):
    """``GET`` / ``PATCH /api/gpupool/preferences``: the caller's saved defaults (memory, num_gpus, ...)."""

    async def get(self) -> None:
        self.write_json(await self.run(self.broker.pool.preference, self.identity.name))

    async def patch(self) -> None:
        values = validate.preferences(self.json_body(), self.broker.pool.policy.max_gpus_per_lease)
        name = self.identity.name
        await self.run(lambda: self.broker.pool.set_preference(name, **values))
        self.write_json(await self.run(self.broker.pool.preference, name))


class EventsHandler(BrokerHandler):
    """``GET /api/gpupool/events?after=SEQ``: decisions about the caller's leases (all for admins)."""

    async def get(self) -> None:
        raw_after = self.query("after")
        after = validate.whole_number(raw_after, "after (the last seq you saw)", 0, 2**63 - 1) if raw_after else 0
        ident = self.identity
        events = await self.run(self.broker.pool.events, after)
        self.write_json([e for e in events if ident.admin or e["owner"] == ident.name])

class ClaimHandler(BrokerHandler):
    """``DELETE /api/gpupool/claims/{kernel_id}`` (admins): the kernel id is nobody's from now on, so
    its user (or anyone) may name it in a new lease. Refused while a live lease holds the kernel."""

    async def delete(self, kernel_id: str) -> None:
        if not self.identity.admin:
            raise NotAuthorized("only pool admins may clear a claim on a kernel id")
        by = f"{self.identity.name} (admin, over HTTP)"
        lease = await self.run(lambda: clear_kernel_claim(self.broker.pool, kernel_id, by=by))
        self.write_json({"kernel_id": kernel_id, "was_owner": lease.owner if lease is not None else None})


class MetricsHandler(BrokerHandler):
    """``GET /metrics``: Prometheus exposition; needs a token with ``read:metrics`` or the admin scope
    (hub), or an admin / metrics group (socket), unless ``Broker.metrics_require_auth`` is off."""

    async def prepare(self) -> None:
        await self.pause_if_refused_often()
        self.begin()
        if not self.broker.metrics_require_auth:
            return
        await self.broker.authorize_metrics(self)

    async def get(self) -> None:
        body, content_type = await self.run(self.broker.render_metrics)
        self.set_header("Content-Type", content_type)
        self.finish(body)


__all__ = [
    "ClaimHandler",
    "EventsHandler",
    "MetricsHandler",
    "PreferencesHandler",
    "ReportHandler",
    "ReservationHandler",
    "ReservationsHandler",
]
