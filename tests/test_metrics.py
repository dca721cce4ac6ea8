"""Prometheus collector: capacity, leased, used, queue, wait histogram, decision counters, fragmentation."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Activity, LeaseRequest, Transition
from jupyter_gpupool.rest.metrics import METRIC_NAMES, PoolCollector, fragmentation, make_registry, render
from jupyter_gpupool.units import GIB


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pool(tmp_path: Path) -> Pool:
    clock = Clock()
    p = Pool.from_env(
        environ={
            "GPUPOOL_SIMULATE": "2x16GiB",
            "GPUPOOL_DB": str(tmp_path / "p.sqlite"),
            "GPUPOOL_DEFAULT_MEMORY": "8GiB",
        },
        clock=clock,
    )
    return p


def scrape(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = render(registry)[0].decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def test_collector_reports_capacity_leases_queue_and_counters(pool: Pool) -> None:
    registry = make_registry(pool)
    clock = pool.clock
    a = pool.request(LeaseRequest(owner="alice", memory=16 * GIB))
    b = pool.request(LeaseRequest(owner="bob", memory=12 * GIB))
    clock.now += 30  # type: ignore[attr-defined]
    queued = pool.request(LeaseRequest(owner="carol", memory=8 * GIB))
    clock.now += 45  # type: ignore[attr-defined]
    values = scrape(registry)
    assert values[("gpupool_memory_total_bytes", ())] == 32 * GIB
    assert values[("gpupool_memory_leased_bytes", ())] == 28 * GIB
    assert values[("gpupool_memory_leased_ratio", ())] == pytest.approx(28 / 32)
    assert values[("gpupool_leases", (("state", "granted"),))] == 2
    assert values[("gpupool_leases", (("state", "queued"),))] == 1
    assert values[("gpupool_queue_length", ())] == 1
    assert values[("gpupool_queue_oldest_wait_seconds", ())] == pytest.approx(45)
    assert values[("gpupool_largest_free_bytes", ())] == 4 * GIB
    # 4 GiB free, all of it in a piece smaller than the 8 GiB default: fully fragmented.
    assert values[("gpupool_fragmentation_ratio", ())] == 1.0
    assert values[("gpupool_grants_total", ())] == 2
    assert values[("gpupool_wait_seconds_count", ())] == 2
    assert values[("gpupool_wait_seconds_bucket", (("le", "1.0"),))] == 2
    per_device = [v for (name, labels), v in values.items() if name == "gpupool_device_memory_leased_bytes"]
    assert sorted(per_device) == [12 * GIB, 16 * GIB]

    pool.release(a.id)  # the queued request (made at +30 s) is granted at +75 s: it waited 45 s
    values = scrape(registry)
    assert values[("gpupool_grants_total", ())] == 3
    assert values[("gpupool_wait_seconds_count", ())] == 3
    assert values[("gpupool_wait_seconds_sum", ())] == pytest.approx(45)
    assert values[("gpupool_wait_seconds_bucket", (("le", "30.0"),))] == 2
    assert values[("gpupool_wait_seconds_bucket", (("le", "60.0"),))] == 3
    assert values[("gpupool_queue_length", ())] == 0
    # Scraping again counts no grant twice.
    assert scrape(registry)[("gpupool_wait_seconds_count", ())] == 3
    pool.release(b.id)
    pool.release(queued.id)


def test_suspend_resume_parked_memory_and_restore_time(pool: Pool) -> None:
    collector = PoolCollector(pool)
    registry = make_registry(pool, collector)
    clock = pool.clock
    lease = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, kernel_id="ka", suspendable=True))
    values = scrape(registry)
    assert values[("gpupool_suspends_total", ())] == 0 and values[("gpupool_resumes_total", ())] == 0
    assert values[("gpupool_parked_memory_bytes", ())] == 0 and values[("gpupool_parked_seconds_total", ())] == 0
    assert values[("gpupool_parked_memory_limit_bytes", ())] > 0  # 40% of this host's RAM

    pool.suspend(lease.id)
    values = scrape(registry)
    assert values[("gpupool_suspends_total", ())] == 1
    assert values[("gpupool_transitions", (("transition", "suspending"),))] == 1
    assert values[("gpupool_parked_memory_bytes", ())] == 8 * GIB, "set aside while the suspend is under way"
    clock.now += 2  # type: ignore[attr-defined]
    pool.confirm_transition(lease.id, parked_bytes=6 * GIB)
    clock.now += 100  # type: ignore[attr-defined]
    values = scrape(registry)
    assert values[("gpupool_leases", (("state", "suspended"),))] == 1
    assert values[("gpupool_transitions", (("transition", "suspending"),))] == 0
    assert values[("gpupool_parked_memory_bytes", ())] == 6 * GIB
    assert values[("gpupool_parked_seconds_total", ())] == pytest.approx(100)

    clock.now += 30  # type: ignore[attr-defined]
    assert pool.resume(lease.id).transition is Transition.RESTORING  # room: granted at once
    values = scrape(registry)
    assert values[("gpupool_resumes_total", ())] == 1
    assert values[("gpupool_transitions", (("transition", "restoring"),))] == 1
    clock.now += 4  # type: ignore[attr-defined]
    pool.confirm_transition(lease.id)
    collector.observe_restore(4.0)  # what the broker does when the server confirms the restore
    values = scrape(registry)
    assert values[("gpupool_parked_seconds_total", ())] == pytest.approx(134)  # parked until restored
    assert values[("gpupool_parked_memory_bytes", ())] == 0
    assert values[("gpupool_resumes_total", ())] == 1, "one resume, however often scraped"
    assert values[("gpupool_resume_wait_seconds_count", ())] == 1
    assert values[("gpupool_restore_seconds_count", ())] == 1
    assert values[("gpupool_restore_seconds_sum", ())] == 4.0
    assert values[("gpupool_restore_seconds_bucket", (("le", "2.0"),))] == 0
    assert values[("gpupool_restore_seconds_bucket", (("le", "5.0"),))] == 1
    assert values[("gpupool_wait_seconds_count", ())] == 1, "the resume's grant is not a second first wait"

    pool.release(lease.id)
    values = scrape(registry)
    assert values[("gpupool_parked_seconds_total", ())] == pytest.approx(134), "a counter keeps released leases' time"
    # A collector started later counts the resume it finds, never as a first wait.
    later = scrape(make_registry(pool))
    assert later[("gpupool_resumes_total", ())] == 1 and later[("gpupool_wait_seconds_count", ())] == 0


def test_a_live_move_is_counted(tmp_path: Path) -> None:
    from pool_helpers import T0, make_pool, req

    pool = make_pool(tmp_path, spec="2x16GiB", defragment_min_idle=60, idle_timeout=600, preemption=False)
    idle = pool.request(req("alice", suspendable=True), now=T0)
    gone = pool.request(req("dave"), now=T0)
    busy = pool.request(req("bob"), now=T0)
    pool.release(gone.id, now=T0 + 50)
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 100)
    pool.request(req("carol", gib=12), now=T0 + 100)  # fits on no GPU: alice's idle kernel moves
    assert pool.get(idle.id).transition is Transition.MIGRATING
    values = scrape(make_registry(pool))
    assert values[("gpupool_migrations_total", ())] == 1
    assert values[("gpupool_transitions", (("transition", "migrating"),))] == 1
    assert values[("gpupool_suspends_total", ())] == 0


def test_unhealthy_device_is_reported(pool: Pool) -> None:
    uuid = pool.devices()[1].uuid
    pool.backend.set_health(uuid, False, "GPU is lost")  # type: ignore[attr-defined]
    pool._devices = None  # drop the 2 s inventory cache
    values = scrape(make_registry(pool))
    health = {dict(labels)["gpu"]: v for (name, labels), v in values.items() if name == "gpupool_device_healthy"}
    assert health == {"0": 1.0, "1": 0.0}


def test_every_documented_metric_is_exposed(pool: Pool) -> None:
    names = {name for name, _ in scrape(make_registry(pool))}
    for metric in METRIC_NAMES:
        assert any(n == metric or n.startswith(metric + "_") for n in names), metric


def test_fragmentation() -> None:
    assert fragmentation([], 8 * GIB) == 0.0
    assert fragmentation([16 * GIB, 0], 8 * GIB) == 0.0
    assert fragmentation([4 * GIB, 4 * GIB], 8 * GIB) == 1.0
    assert fragmentation([12 * GIB, 4 * GIB], 8 * GIB) == 0.5
    assert fragmentation([5 * GIB], 0) == 0.0


def _exprs(node: object) -> list[str]:
    """Every ``expr`` in a Grafana dashboard, in rows and nested panels too."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for key, value in node.items() if key != "expr" for e in _exprs(value)]
    if isinstance(node, list):
        return [e for item in node for e in _exprs(item)]
    return []


def test_dashboard_and_alerts_use_only_exposed_metrics(pool: Pool) -> None:
    import json
    import re

    import yaml

    repo = Path(__file__).resolve().parent.parent
    dashboard = json.loads((repo / "deploy" / "grafana-dashboard.json").read_text())
    rules = yaml.safe_load((repo / "deploy" / "prometheus-alerts.yml").read_text())
    alerts = {rule["alert"]: rule["expr"] for group in rules["groups"] for rule in group["rules"]}
    exprs = _exprs(dashboard)
    assert len(exprs) >= 10
    # What a real scrape exposes (not only what METRIC_NAMES promises).
    pool.request(LeaseRequest(owner="alice", memory=8 * GIB))
    exposed = {name for name, _ in scrape(make_registry(pool))}
    for text in [*exprs, *alerts.values()]:
        for name in re.findall(r"gpupool_[a-z_]+", text):
            assert name in exposed, f"{name!r} in {text!r} is not a metric the pool exports"
    assert set(alerts) >= {
        "GpuPoolMemoryAbove90Percent",
        "GpuPoolGpuMemoryUsedAbove90Percent",
        "GpuPoolRequestQueuedTooLong",
        "GpuPoolGpuUnhealthy",
        "GpuPoolParkedMemoryNearLimit",
    }
    # Suspended kernels (issue 12) have their panels: counts, host RAM, restore time.
    shown = " ".join(exprs)
    for name in (
        "gpupool_suspends_total",
        "gpupool_resumes_total",
        "gpupool_migrations_total",
        "gpupool_parked_memory_bytes",
        "gpupool_parked_seconds_total",
        "gpupool_restore_seconds_bucket",
    ):
        assert name in shown, f"no dashboard panel shows {name}"
    assert "gpupool_memory_leased_bytes" in alerts["GpuPoolMemoryAbove90Percent"]
    assert "gpupool_device_memory_used_bytes" in alerts["GpuPoolGpuMemoryUsedAbove90Percent"]


needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="needs promtool from Debian's prometheus package (.ci/run installs it)"
)


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    repo = Path(__file__).resolve().parent.parent
    result = subprocess.run(
        ["promtool", "check", "rules", str(repo / "deploy" / "prometheus-alerts.yml")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


@needs_promtool
def test_alerts_fire_on_used_and_on_leased_memory_in_promtool_unit_tests() -> None:
    """tests/prometheus/alerts_test.yml: the used-memory alert fires on a GPU 95% in use with
    little leased, the leased one on a pool 94% leased with little in use, and not the other way."""
    folder = Path(__file__).resolve().parent / "prometheus"
    result = subprocess.run(
        ["promtool", "test", "rules", "alerts_test.yml"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=folder,
    )
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_guaranteed_and_burst_memory_are_exposed_apart(tmp_path) -> None:
    from pool_helpers import T0, make_pool, req

    pool = make_pool(tmp_path, name="elastic.sqlite", burst="16GiB")
    lease = pool.request(req(gib=2), now=T0)
    pool.grow(lease.id, 6 * GIB, now=T0 + 1)
    values = scrape(make_registry(pool))
    assert values[("gpupool_memory_guaranteed_bytes", ())] == 2 * GIB
    assert values[("gpupool_memory_burst_bytes", ())] == 4 * GIB
    assert values[("gpupool_slice_grows_total", ())] == 1
