"""The broker's URL table: every route and its handler (the authorization matrix test reads it)."""

from __future__ import annotations

from jupyter_gpupool.broker.account_handlers import (
    ClaimHandler,
    EventsHandler,
    MetricsHandler,
    PreferencesHandler,
    ReportHandler,
    ReservationHandler,
    ReservationsHandler,
)
from jupyter_gpupool.broker.handlers import (
    ActivityHandler,
    BrokerHandler,
    ChangesHandler,
    DevicesHandler,
    HeartbeatHandler,
    InfoHandler,
    KernelKeepaliveHandler,
    KernelReleaseHandler,
    KernelReserveHandler,
    KernelResumeHandler,
    KernelStatusHandler,
    KernelSuspendHandler,
    LeaseActivityHandler,
    LeaseGrowHandler,
    LeaseHandler,
    LeaseKeepHandler,
    LeasePinnedBackupHandler,
    LeasePriorityHandler,
    LeaseReleaseHandler,
    LeaseResizeHandler,
    LeaseResumeHandler,
    LeasesHandler,
    LeaseSuspendHandler,
    LeaseTransitionHandler,
    LeaseWaitHandler,
    PoolHandler,
    QueueHandler,
    ReconcileHandler,
    TickHandler,
    WhoAmIHandler,
)

_ID = r"(?P<lease_id>[A-Za-z0-9_.:-]+)"
_KERNEL = r"(?P<kernel_id>[\w-]+)"


def routes(prefix: str) -> list[tuple[str, type[BrokerHandler]]]:
    """The URL patterns under ``prefix`` (``/`` or a hub service prefix such as ``/services/gpupool/``)."""
    api = prefix.rstrip("/") + "/api/gpupool"
    return [
        (rf"{api}/whoami", WhoAmIHandler),
        (rf"{api}/info", InfoHandler),
        (rf"{api}/pool", PoolHandler),
        (rf"{api}/devices", DevicesHandler),
        (rf"{api}/queue", QueueHandler),
        (rf"{api}/leases", LeasesHandler),
        (rf"{api}/leases/{_ID}", LeaseHandler),
        (rf"{api}/leases/{_ID}/release", LeaseReleaseHandler),
        (rf"{api}/leases/{_ID}/resize", LeaseResizeHandler),
        (rf"{api}/leases/{_ID}/grow", LeaseGrowHandler),
        (rf"{api}/leases/{_ID}/pinned-backup", LeasePinnedBackupHandler),
        (rf"{api}/leases/{_ID}/keepalive", LeaseKeepHandler),
        (rf"{api}/leases/{_ID}/priority", LeasePriorityHandler),
        (rf"{api}/leases/{_ID}/activity", LeaseActivityHandler),
        (rf"{api}/leases/{_ID}/wait", LeaseWaitHandler),
        (rf"{api}/leases/{_ID}/suspend", LeaseSuspendHandler),
        (rf"{api}/leases/{_ID}/resume", LeaseResumeHandler),
        (rf"{api}/leases/{_ID}/transition", LeaseTransitionHandler),
        (rf"{api}/changes", ChangesHandler),
        (rf"{api}/activity", ActivityHandler),
        (rf"{api}/heartbeat", HeartbeatHandler),
        (rf"{api}/reconcile", ReconcileHandler),
        (rf"{api}/tick", TickHandler),
        (rf"{api}/kernels/{_KERNEL}", KernelStatusHandler),
        (rf"{api}/kernels/{_KERNEL}/reserve", KernelReserveHandler),
        (rf"{api}/kernels/{_KERNEL}/release", KernelReleaseHandler),
        (rf"{api}/kernels/{_KERNEL}/keepalive", KernelKeepaliveHandler),
        (rf"{api}/kernels/{_KERNEL}/suspend", KernelSuspendHandler),
        (rf"{api}/kernels/{_KERNEL}/resume", KernelResumeHandler),
        (rf"{api}/report", ReportHandler),
        (rf"{api}/reservations", ReservationsHandler),
        (rf"{api}/reservations/(?P<name>[^/]+)", ReservationHandler),
        (rf"{api}/preferences", PreferencesHandler),
        (rf"{api}/events", EventsHandler),
        (rf"{api}/claims/{_KERNEL}", ClaimHandler),
        (prefix.rstrip("/") + "/metrics", MetricsHandler),
    ]


__all__ = ["routes"]
