"""Prometheus metrics of a pool: capacity, leased and used memory, queue, waits, decisions.

:class:`PoolCollector` is a custom ``prometheus_client`` collector: on every scrape it reads a
:meth:`~jupyter_gpupool.pool.Pool.snapshot` and the store's decision counts, so the numbers are
those of the shared store (every process of the pool), not of one process' memory. The wait-time
histogram is built from the grant times of leases, each counted once per collector.

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

#: Upper bounds (seconds) of the wait-time histogram: from "at once" to "half a day".
WAIT_BUCKETS: tuple[float, ...] = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200)

#: Decision kinds in the store's event log → counter names.
DECISION_COUNTERS: dict[str, tuple[str, str]] = {
    "grant": ("gpupool_grants", "Leases granted."),
    "reclaim_idle": ("gpupool_reclaims", "Idle leases reclaimed."),
    "preempt": ("gpupool_preemptions", "Leases preempted for a higher-priority or guaranteed request."),
    "release": ("gpupool_engine_releases", "Leases released by the engine (holder gone, duration over, GPU lost)."),
    "over_limit": ("gpupool_over_limit", "Times a kernel was seen using more GPU memory than its slice."),
    "warn_idle": ("gpupool_idle_warnings", "Idle warnings given before a reclaim."),
    "preempt_warn": ("gpupool_preemption_warnings", "Preemption warnings given before an eviction."),
}

METRIC_NAMES: tuple[str, ...] = (
    "gpupool_device_memory_total_bytes",
    "gpupool_device_memory_leasable_bytes",
    "gpupool_device_memory_leased_bytes",
    "gpupool_device_memory_used_bytes",
    "gpupool_device_healthy",
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


class PoolCollector(Collector):
    """Reads the pool at scrape time. Register it with a registry (not the global one by default)."""

    def __init__(self, pool: Any, clock: Any = time.time) -> None:
        self.pool = pool
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._buckets = [0] * (len(WAIT_BUCKETS) + 1)  # the last one is +Inf
        self._wait_sum = 0.0
        self._wait_count = 0
        self._granted_watermark = float("-inf")

    # --- wait-time histogram ------------------------------------------------------------------------
    def _observe_grants(self) -> None:
        # Only grants since the last scrape (filtered in SQL): every grant counted once, never a
        # re-read of the whole history, never a cut-off listing.
        since = self._granted_watermark - GRANT_COMMIT_SLACK  # a decision may commit a little after its "now"
        for lease in self.pool.store.leases(include_released=True, granted_since=since):
            if lease.granted_at is None or lease.id in self._seen:
                continue
            self._seen.add(lease.id)
            self._granted_watermark = max(self._granted_watermark, lease.granted_at)
            wait = max(0.0, lease.granted_at - lease.created_at)
            self._wait_sum += wait
            self._wait_count += 1
            for i, bound in enumerate(WAIT_BUCKETS):
                if wait <= bound:
                    self._buckets[i] += 1
                    break
            else:
                self._buckets[-1] += 1

    def _histogram(self) -> HistogramMetricFamily:
        cumulative, running = [], 0
        for bound, count in zip([*map(floatToGoString, WAIT_BUCKETS), "+Inf"], self._buckets):
            running += count
            cumulative.append((bound, running))
        return HistogramMetricFamily(
            "gpupool_wait_seconds",
            "Seconds from a request to its grant (granted leases, counted once).",
            buckets=cumulative,
            sum_value=self._wait_sum,
        )

    # --- the collector ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Any]:
        with self._lock:
            snapshot = self.pool.snapshot(admin=True)
            now = snapshot.now
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
            }
            totals = {"memory_total": 0, "memory_leasable": 0, "memory_leased": 0, "memory_used": 0}
            frees: list[int] = []
            for d in snapshot.devices:
                values = [str(d["index"]), str(d["uuid"]), str(d["name"])]
                for key in totals:
                    families[key].add_metric(values, float(d[key]))
                    totals[key] += int(d[key])
                families["healthy"].add_metric(values, 1.0 if d["healthy"] else 0.0)
                if d["healthy"]:
                    frees.append(int(d["memory_leasable"]) - int(d["memory_leased"]))
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

            by_state = GaugeMetricFamily("gpupool_leases", "Live leases by state.", labels=["state"])
            counts: dict[str, int] = {"granted": 0, "queued": 0, "suspended": 0}
            for lease in snapshot.leases:
                counts[lease["state"]] = counts.get(lease["state"], 0) + 1
            for state, count in sorted(counts.items()):
                by_state.add_metric([state], count)
            yield by_state
            yield GaugeMetricFamily("gpupool_queue_length", "Requests waiting for a slice.", value=len(snapshot.queue))
            oldest = max((now - q["created_at"] for q in snapshot.queue), default=0.0)
            yield GaugeMetricFamily(
                "gpupool_queue_oldest_wait_seconds",
                "How long the longest-waiting request has waited (0 when none).",
                value=oldest,
            )
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

            self._observe_grants()
            yield self._histogram()

            event_counts = self.pool.store.event_counts()
            for kind, (name, text) in DECISION_COUNTERS.items():
                yield CounterMetricFamily(name, text, value=float(event_counts.get(kind, 0)))


def make_registry(pool: Any) -> CollectorRegistry:
    """A fresh registry holding only this pool's collector (what ``/metrics`` serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PoolCollector(pool))
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

    return generate_latest(registry), CONTENT_TYPE_LATEST


__all__ = ["METRIC_NAMES", "WAIT_BUCKETS", "PoolCollector", "fragmentation", "make_registry", "render"]
