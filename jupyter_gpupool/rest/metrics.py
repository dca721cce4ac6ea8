"""Prometheus metrics of a pool: capacity, leased and used memory, queue, waits, decisions, and
suspended kernels (suspends, resumes, moves, host RAM parked, time parked, restore time).

:class:`PoolCollector` is a custom ``prometheus_client`` collector: on every scrape it reads a
:meth:`~jupyter_gpupool.backends.local.pool.Pool.snapshot` and the store's decision counts, so the numbers are
those of the shared store (every process of the pool), not of one process' memory. The wait-time
histogram is built from the grant times of leases, each counted once per collector; resumes are
grants at or after a lease's ``resume_asked_at`` (its restore), each grant counted once. The
restore-time histogram needs the moment a restore is confirmed, which a lease does not keep: the
process that confirms it feeds it (:meth:`PoolCollector.observe_restore`): the broker from its
``.../transition`` route, a single-user server from its own restore.

Metric names (all prefixed ``gpupool_``) are listed in :data:`METRIC_NAMES`; the Grafana dashboard
(``deploy/grafana-dashboard.json``) and alert rules (``deploy/prometheus-alerts.yml``) use them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from jupyter_gpupool.backends.local.pool import host_memory

#: Upper bounds (seconds) of the wait-time histogram: from "at once" to "half a day".
WAIT_BUCKETS: tuple[float, ...] = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200)
#: Upper bounds (seconds) of the restore-time histogram: a slice over the host link takes seconds.
RESTORE_BUCKETS: tuple[float, ...] = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)

#: Decision kinds in the store's event log → counter names.
DECISION_COUNTERS: dict[str, tuple[str, str]] = {
    "grant": ("gpupool_grants", "Leases granted."),
    "reclaim_idle": ("gpupool_reclaims", "Idle leases reclaimed."),
    "preempt": ("gpupool_preemptions", "Leases preempted for a higher-priority or guaranteed request."),
    "release": ("gpupool_engine_releases", "Leases released by the engine (holder gone, duration over, GPU lost)."),
    "over_limit": ("gpupool_over_limit", "Times a kernel was seen using more GPU memory than its slice."),
    "warn_idle": ("gpupool_idle_warnings", "Idle warnings given before a reclaim."),
    "preempt_warn": ("gpupool_preemption_warnings", "Preemption warnings given before an eviction."),
    "suspend": ("gpupool_suspends", "Suspends begun: a kernel's GPU memory to be parked in host RAM."),
    "migrate": ("gpupool_migrations", "Live moves begun: a kernel's GPU memory to another GPU of the same model."),
    "grow": ("gpupool_slice_grows", "Times an elastic slice grew on demand."),
    "shrink": ("gpupool_burst_reclaims", "Times an elastic slice's burst was taken back for a waiting request."),
}

METRIC_NAMES: tuple[str, ...] = (
    "gpupool_device_memory_total_bytes",
    "gpupool_device_memory_leasable_bytes",
    "gpupool_device_memory_leased_bytes",
    "gpupool_device_memory_used_bytes",
    "gpupool_device_healthy",
    "gpupool_unpooled_bytes",
    "gpupool_memory_total_bytes",
    "gpupool_memory_leased_bytes",
    "gpupool_memory_used_bytes",
    "gpupool_memory_leased_ratio",
    "gpupool_leases",
    "gpupool_queue_length",
    "gpupool_queue_oldest_wait_seconds",
    "gpupool_wait_seconds",
    "gpupool_largest_free_bytes",
    "gpupool_fragmentation_ratio",
    "gpupool_transitions",
    "gpupool_parked_memory_bytes",
    "gpupool_parked_memory_limit_bytes",
    "gpupool_memory_guaranteed_bytes",
    "gpupool_memory_burst_bytes",
    "gpupool_parked_seconds_total",
    "gpupool_resumes_total",
    "gpupool_resume_wait_seconds",
    "gpupool_restore_seconds",
    *(f"{name}_total" for name, _ in DECISION_COUNTERS.values()),
)


def fragmentation(free_per_gpu: Iterable[int], request: int) -> float:
    """Share of free memory stranded in pieces too small for a typical ``request`` (0 = none).

    Each GPU's free memory beyond whole multiples of ``request`` cannot serve such a request;
    with 1 GiB free on each of 8 GPUs and an 8 GiB default, the pool has 8 GiB free and a
    fragmentation of 1.0: nothing fits.
    """
    frees = [max(0, int(f)) for f in free_per_gpu]
    total = sum(frees)
    if total <= 0 or request <= 0:
        return 0.0
    stranded = sum(f % request for f in frees)
    return stranded / total


#: Seconds a grant's ``granted_at`` may precede its commit (a decision waits for the writer lock).
GRANT_COMMIT_SLACK = 120.0


class _Histogram:
    """Counts per bucket and their sum: a Prometheus histogram a collector builds itself."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.total)


class PoolCollector(Collector):
    """Reads the pool at scrape time. Register it with a registry (not the global one by default)."""

    def __init__(self, pool: Any, clock: Any = time.time) -> None:
        self.pool = pool
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._waits = _Histogram(WAIT_BUCKETS)
        self._granted_watermark = float("-inf")
        self._resumes_seen: set[tuple[str, float]] = set()  # (lease id, grant time) of each resume
        self._resume_waits = _Histogram(WAIT_BUCKETS)
        self._restores = _Histogram(RESTORE_BUCKETS)
        self._parked_last: dict[str, float] = {}  # seconds parked per live lease at the last scrape
        self._parked_gone = 0.0  # seconds parked by leases no longer live (as last seen)

    def observe_restore(self, seconds: float) -> None:
        """A restore after a suspend took ``seconds`` from its grant to its server's confirmation."""
        with self._lock:
            self._restores.observe(max(0.0, float(seconds)))

    # --- histograms and counters kept across scrapes ----------------------------------------------
    def _observe_grants(self) -> None:
        # Only grants since the last scrape (filtered in SQL): every grant counted once, never a
        # re-read of the whole history, never a cut-off listing.
        since = self._granted_watermark - GRANT_COMMIT_SLACK  # a decision may commit a little after its "now"
        for lease in self.pool.store.leases(include_released=True, granted_since=since):
            if lease.granted_at is None:
                continue
            asked = lease.resume_asked_at
            if asked is not None and lease.granted_at >= asked:  # granted again after a resume
                self._seen.add(lease.id)  # its first grant is long past: not a first wait
                if (lease.id, lease.granted_at) not in self._resumes_seen:
                    self._resumes_seen.add((lease.id, lease.granted_at))
                    self._granted_watermark = max(self._granted_watermark, lease.granted_at)
                    self._resume_waits.observe(lease.granted_at - asked)
                continue
            if lease.id in self._seen:
                continue
            self._seen.add(lease.id)
            self._granted_watermark = max(self._granted_watermark, lease.granted_at)
            self._waits.observe(max(0.0, lease.granted_at - lease.created_at))

    def _parked_seconds(self, leases: list[dict[str, Any]], now: float) -> float:
        """Seconds parked in host RAM by every lease this collector has seen: live leases' past
        suspensions plus the current one, and what leases gone since had when last seen."""
        current: dict[str, float] = {}
        for lease in leases:
            seconds = float(lease.get("parked_seconds") or 0.0)
            if lease.get("suspended_at") is not None:
                seconds += max(0.0, now - float(lease["suspended_at"]))
            if seconds > 0 and lease.get("id"):
                current[str(lease["id"])] = seconds
        self._parked_gone += sum(v for k, v in self._parked_last.items() if k not in current)
        self._parked_last = current
        return self._parked_gone + sum(current.values())

    def _parked_limit(self) -> float:
        """Bytes of host RAM the policy lets parked slices take (0 when unknown or none)."""
        try:
            return float(self.pool.policy.parked_budget(host_memory()))
        except Exception:  # noqa: BLE001 - a metric must never fail the scrape
            return 0.0

    # --- the collector ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        with self._lock:
            snapshot = self.pool.snapshot(admin=True)
            yield from self._device_families(snapshot)
            yield from self._lease_families(snapshot)
            yield from self._transition_families(snapshot)
            self._observe_grants()
            yield from self._wait_families()
            event_counts = self.pool.store.event_counts()
            for kind, (name, text) in DECISION_COUNTERS.items():
                yield CounterMetricFamily(name, text, value=float(event_counts.get(kind, 0)))

    @staticmethod
    def _device_families(snapshot: Any) -> Iterator[Any]:
        """Per-device memory and health, then the pool-wide memory totals."""
        labels = ["gpu", "uuid", "name"]
        families = {
            "memory_total": GaugeMetricFamily(
                "gpupool_device_memory_total_bytes", "GPU memory per device.", labels=labels
            ),
            "memory_leasable": GaugeMetricFamily(
                "gpupool_device_memory_leasable_bytes",
                "Memory the pool may lease per device (total × overcommit).",
                labels=labels,
            ),
            "memory_leased": GaugeMetricFamily(
                "gpupool_device_memory_leased_bytes", "Memory held by leases per device.", labels=labels
            ),
            "memory_used": GaugeMetricFamily(
                "gpupool_device_memory_used_bytes", "Memory in use per device (driver or watchdog).", labels=labels
            ),
            "healthy": GaugeMetricFamily(
                "gpupool_device_healthy", "1 if the device is healthy, 0 if lost or failing.", labels=labels
            ),
            "unpooled": GaugeMetricFamily(
                "gpupool_unpooled_bytes",
                "GPU memory per device held by processes outside any granted lease (never granted).",
                labels=labels,
            ),
        }
        totals = {"memory_total": 0, "memory_leasable": 0, "memory_leased": 0, "memory_used": 0}
        for d in snapshot.devices:
            values = [str(d["index"]), str(d["uuid"]), str(d["name"])]
            for key in totals:
                families[key].add_metric(values, float(d[key]))
                totals[key] += int(d[key])
            families["healthy"].add_metric(values, 1.0 if d["healthy"] else 0.0)
            families["unpooled"].add_metric(values, float(d.get("memory_unpooled") or 0))
        yield from families.values()
        yield GaugeMetricFamily(
            "gpupool_memory_total_bytes", "GPU memory of every pooled device.", value=totals["memory_total"]
        )
        yield GaugeMetricFamily(
            "gpupool_memory_leased_bytes", "GPU memory held by leases, all devices.", value=totals["memory_leased"]
        )
        yield GaugeMetricFamily(
            "gpupool_memory_used_bytes", "GPU memory in use, all devices.", value=totals["memory_used"]
        )
        ratio = totals["memory_leased"] / totals["memory_leasable"] if totals["memory_leasable"] else 0.0
        yield GaugeMetricFamily(
            "gpupool_memory_leased_ratio", "Leased share of leasable memory (0..1).", value=ratio
        )

    def _lease_families(self, snapshot: Any) -> Iterator[Any]:
        """Leases by state, the queue, and how free memory lies on the healthy devices."""
        by_state = GaugeMetricFamily("gpupool_leases", "Live leases by state.", labels=["state"])
        counts: dict[str, int] = {"granted": 0, "queued": 0, "suspended": 0}
        for lease in snapshot.leases:
            counts[lease["state"]] = counts.get(lease["state"], 0) + 1
        for state, count in sorted(counts.items()):
            by_state.add_metric([state], count)
        yield by_state
        yield GaugeMetricFamily("gpupool_queue_length", "Requests waiting for a slice.", value=len(snapshot.queue))
        oldest = max((snapshot.now - q["created_at"] for q in snapshot.queue), default=0.0)
        yield GaugeMetricFamily(
            "gpupool_queue_oldest_wait_seconds",
            "How long the longest-waiting request has waited (0 when none).",
            value=oldest,
        )
        frees = [int(d["memory_leasable"]) - int(d["memory_leased"]) for d in snapshot.devices if d["healthy"]]
        yield GaugeMetricFamily(
            "gpupool_largest_free_bytes", "Largest free memory on one healthy device.", value=max(frees, default=0)
        )
        try:
            request = int(self.pool.default_memory())
        except Exception:  # noqa: BLE001 - a metric must never fail the scrape
            request = 0
        yield GaugeMetricFamily(
            "gpupool_fragmentation_ratio",
            "Share of free memory in pieces smaller than the default slice (0 = none stranded).",
            value=fragmentation(frees, request),
        )

    def _transition_families(self, snapshot: Any) -> Iterator[Any]:
        """Suspends, restores and moves under way; parked host memory; guaranteed and burst memory."""
        transitions = GaugeMetricFamily(
            "gpupool_transitions",
            "Kernels whose GPU memory is being suspended, restored or moved now (their servers confirm).",
            labels=["transition"],
        )
        steps = {"suspending": 0, "restoring": 0, "migrating": 0}
        for lease in snapshot.leases:
            if lease.get("transition") in steps:
                steps[lease["transition"]] += 1
        for step, count in steps.items():
            transitions.add_metric([step], count)
        yield transitions
        yield GaugeMetricFamily(
            "gpupool_parked_memory_bytes",
            "Host RAM taken by suspended kernels' parked GPU memory (and set aside for suspends under way).",
            value=sum(int(lease.get("parked_memory") or 0) for lease in snapshot.leases),
        )
        granted = [lease for lease in snapshot.leases if lease.get("state") == "granted"]
        guaranteed = sum(int(l.get("guarantee") or l["memory"]) * int(l.get("num_gpus") or 1) for l in granted)
        yield GaugeMetricFamily(
            "gpupool_memory_guaranteed_bytes",
            "GPU memory granted leases are guaranteed (never taken back for anyone's request).",
            value=guaranteed,
        )
        yield GaugeMetricFamily(
            "gpupool_memory_burst_bytes",
            "GPU memory elastic slices hold above their guarantee now (taken back first under pressure).",
            value=sum(int(l["memory"]) * int(l.get("num_gpus") or 1) for l in granted) - guaranteed,
        )
        yield GaugeMetricFamily(
            "gpupool_parked_memory_limit_bytes",
            "Host RAM parked GPU memory may take together (PoolPolicy.parked_memory_limit; 0: none).",
            value=self._parked_limit(),
        )
        yield CounterMetricFamily(
            "gpupool_parked_seconds",
            "Seconds kernels have spent suspended, summed over kernels (its rate: kernels suspended on average).",
            value=self._parked_seconds(snapshot.leases, snapshot.now),
        )

    def _wait_families(self) -> Iterator[Any]:
        """Waits for a grant, resumes and restores, as observed so far."""
        yield self._waits.family(
            "gpupool_wait_seconds", "Seconds from a request to its grant (granted leases, counted once)."
        )
        yield CounterMetricFamily(
            "gpupool_resumes",
            "Suspended kernels granted a GPU again to be restored onto (each resume counted once).",
            value=float(len(self._resumes_seen)),
        )
        yield self._resume_waits.family(
            "gpupool_resume_wait_seconds",
            "Seconds a suspended kernel waited for a GPU, from its resume to its grant.",
        )
        yield self._restores.family(
            "gpupool_restore_seconds",
            "Seconds from a resumed kernel's grant to its server confirming the restore (as the pool's server saw them: the broker, or a single-user server).",
        )


def make_registry(pool: Any, collector: PoolCollector | None = None) -> CollectorRegistry:
    """A fresh registry holding only this pool's collector (what ``/metrics`` serves); pass the
    ``collector`` to keep a handle on it (to :meth:`~PoolCollector.observe_restore`)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector if collector is not None else PoolCollector(pool))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


__all__ = [
    "METRIC_NAMES",
    "RESTORE_BUCKETS",
    "WAIT_BUCKETS",
    "PoolCollector",
    "fragmentation",
    "make_registry",
    "render",
]
