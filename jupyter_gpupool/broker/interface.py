"""What the broker's handlers need of the broker, as a :class:`~typing.Protocol`.

The handlers reach the broker through ``self.settings["gpupool_broker"]``; typing it with this
protocol rather than with :class:`~jupyter_gpupool.broker.app.Broker` keeps the imports one way
(``app`` imports ``handlers``, never the other way round), as jupyter_server's handlers reach
their application through settings.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from tornado import web

from jupyter_gpupool.broker.auth import Identity
from jupyter_gpupool.broker.caller_views import CallerViewVersions
from jupyter_gpupool.broker.limits import ConnectionBook, RateLimitedLog, Throttle
from jupyter_gpupool.broker.open_waits import OpenWaits
from jupyter_gpupool.core.models import Lease, LeaseRequest


class BrokerInterface(Protocol):
    """The broker as a request handler sees it."""

    #: The pool (a :class:`~jupyter_gpupool.backends.local.pool.Pool`); use it only on the broker's worker thread.
    pool: Any
    log: logging.Logger | logging.LoggerAdapter[Any]
    wait_poll: float
    #: Each caller's view version for ``GET /api/gpupool/changes``, read once per pool change.
    view_versions: CallerViewVersions
    #: Each caller's open long polls, bounded by ``Broker.max_waits_per_user``.
    open_waits: OpenWaits
    #: Each caller's open connections, bounded by ``Broker.max_connections_per_user``.
    connections: ConnectionBook
    #: Each caller's refused reports of finished steps, bounded by ``Broker.refused_reports_allowed``.
    refused_reports: Throttle
    #: Each caller's refused requests (uid on the socket, identified user on TCP), bounded by
    #: ``Broker.refused_requests_allowed``; past it their requests wait ``refused_requests_pause``.
    refused_requests: Throttle
    refused_requests_pause: float
    #: Log lines about repeated refusals, one per kind and caller per ``Broker.log_interval``.
    note: RateLimitedLog
    metrics_require_auth: bool

    async def run(self, fn: Any, *args: Any) -> Any:
        """Run a blocking pool call on the broker's worker thread."""

    async def identify(self, handler: web.RequestHandler) -> Identity:
        """The caller (401/403 errors when unknown or without the service's scope)."""

    async def authorize_metrics(self, handler: web.RequestHandler) -> None:
        """Raise 401/403 unless the caller may read /metrics."""

    def check_owned(self, identity: Identity, lease_ids: Iterable[str]) -> None:
        """403 if any of these live leases belongs to someone else (admins may touch all)."""

    def policy_json(self) -> dict[str, Any]:
        """The policy values a client may read."""

    def info(self, identity: Identity) -> dict[str, Any]:
        """Version, backend, policy and the caller."""

    def lease_request(self, identity: Identity, body: Mapping[str, Any]) -> LeaseRequest:
        """A request from a JSON body; owner and groups are the caller's."""

    def request_lease(self, identity: Identity, body: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Worker thread: queue a request (or find the live lease of its kernel); (lease JSON, created)."""

    def kernel_status(self, kernel_id: str, lease: Lease) -> dict[str, Any]:
        """The ``GET /api/gpupool/kernels/{kernel_id}`` body."""

    def render_metrics(self) -> tuple[bytes, str]:
        """Prometheus exposition and its content type."""

    def observe_restore(self, seconds: float) -> None:
        """Record how long a confirmed restore took (the ``gpupool_restore_seconds`` histogram)."""


__all__ = ["BrokerInterface"]
