#!/usr/bin/env python
"""System benchmarks of the pool itself: decision speed and memory of a long-running pool.

1. **Throughput and latency at N live leases** (default N = 100, 1,000, 10,000): a real
   SQLite file (WAL) already holding N granted leases; then alternately request a small slice
   (granted at once) and release it, each one :class:`~jupyter_gpupool.backends.local.pool.Pool` call = one
   transaction, timed one by one; plus ``tick()`` calls. Prints grants+releases per second and
   p50/p99 latency of each call.
2. **A long-running pool with 200 kernels**: 200 live leases, then many ticks, each with one
   activity report for every kernel (as the server extension sends) and a ``tick()``; a few
   kernels end and new ones start every tick. Prints RSS, database size and tick latency as it
   goes, so growth (a leak, an unbounded table) shows.

``python bench/system_bench.py [--sizes 100,1000,10000] [--decisions 200] [--ticks 5000]
[--kernels 200] [--json]``. Virtual time (explicit ``now``) keeps heartbeats fresh whatever the
real speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil

from jupyter_gpupool.core.models import Activity, Lease, LeaseRequest, LeaseState
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.units import MIB

INVENTORY = "8xH200"  # 8 x 141 GiB: room for 10,000 slices of 16 MiB
SLICE = 16 * MIB
T0 = 1_800_000_000.0  # virtual time origin


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered)) - 1))] if ordered else 0.0


def ms(values: list[float]) -> dict[str, float]:
    return {"p50_ms": round(percentile(values, 50) * 1000, 3), "p99_ms": round(percentile(values, 99) * 1000, 3), "n": len(values)}


#: What every benchmark pool runs with (set from the command line: --burst, --follow-changes).
POOL_OPTIONS: dict[str, Any] = {"burst": "4x", "follow_changes": False}


def make_pool(folder: str) -> Pool:
    """A fresh pool file; with ``follow_changes`` a listener is subscribed to its changes, as a
    Jupyter server's is (the change watcher's cost is in every decision then)."""
    policy = PoolPolicy(idle_policy="never", burst=POOL_OPTIONS["burst"])
    pool = Pool(SimulatedBackend.from_spec(INVENTORY), os.path.join(folder, "pool.sqlite"), policy=policy)
    if POOL_OPTIONS["follow_changes"]:
        pool.subscribe_changes(lambda: None)
    return pool


def prefill(pool: Pool, count: int, now: float) -> None:
    """Write ``count`` granted leases in one transaction (setting up "a pool that holds N")."""
    devices = pool.devices()
    leases = []
    for i in range(count):
        device = devices[i % len(devices)]
        leases.append(
            Lease(
                id=f"fill-{i:06d}",
                owner=f"user{i % 500:03d}",
                memory=SLICE,
                state=LeaseState.GRANTED,
                created_at=now,
                kernel_id=f"kernel-fill-{i:06d}",
                devices=(device.uuid,),
                granted_at=now,
                heartbeat_at=now,
                last_activity=now,
                label="prefill",
            )
        )
    with pool.store.transaction():
        pool.store.save_leases(leases)


def bench_size(live: int, decisions: int, ticks: int) -> dict[str, Any]:
    """Grant+release cycles and ticks on a file already holding ``live`` granted leases."""
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as folder:
        pool = make_pool(folder)
        now = T0
        prefill(pool, live, now)
        pool.tick(now=now)  # first load reads every row from SQLite; not timed
        grant_times: list[float] = []
        release_times: list[float] = []
        tick_times: list[float] = []
        place_times: list[float] = []
        snapshot_times: list[float] = []
        started = time.perf_counter()
        for i in range(decisions):
            now += 0.01
            t = time.perf_counter()
            lease = pool.request(LeaseRequest(owner=f"bench{i % 7}", memory=SLICE, kernel_id=f"kb-{i}"), now=now)
            grant_times.append(time.perf_counter() - t)
            assert lease.state is LeaseState.GRANTED, "the benchmark pool must have room"
            now += 0.01
            t = time.perf_counter()
            pool.release(lease.id, now=now)
            release_times.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - started
        for _ in range(ticks):
            now += 0.01
            t = time.perf_counter()
            pool.tick(now=now)
            tick_times.append(time.perf_counter() - t)
        # A view right after a decision (the sidebar's poll; a queued kernel's place), ticks times.
        for i in range(ticks):
            now += 0.01
            lease = pool.request(LeaseRequest(owner=f"bench{i % 7}", memory=SLICE, kernel_id=f"kv-{i}"), now=now)
            t = time.perf_counter()
            pool.queue_info(lease.id, now=now)
            place_times.append(time.perf_counter() - t)
            t = time.perf_counter()
            pool.snapshot(viewer=f"bench{i % 7}", now=now)
            snapshot_times.append(time.perf_counter() - t)
            pool.release(lease.id, now=now)
        assert len(pool.store.live_leases()) == live
        size = os.path.getsize(os.path.join(folder, "pool.sqlite"))
        pool.close()
    return {
        "live_leases": live,
        "decisions": 2 * decisions,
        "grants_releases_per_s": round(2 * decisions / elapsed, 1),
        "request_grant": ms(grant_times),
        "release": ms(release_times),
        "tick": ms(tick_times),
        "queue_info_after_decision": ms(place_times),
        "snapshot_after_decision": ms(snapshot_times),
        "db_bytes": size,
    }


def bench_long_running(kernels: int, ticks: int, churn: int, samples: int, seed: int = 1) -> dict[str, Any]:
    """RSS and DB size of a pool serving ``kernels`` leases over ``ticks`` ticks of 30 s."""
    rng = random.Random(seed)
    process = psutil.Process()
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as folder:
        pool = make_pool(folder)
        now = T0
        live: list[str] = []
        serial = 0

        def start_kernel() -> None:
            nonlocal serial
            serial += 1
            lease = pool.request(LeaseRequest(owner=f"user{serial % 60:02d}", memory=SLICE * 8, kernel_id=f"k-{serial}"), now=now)
            live.append(lease.id)

        for _ in range(kernels):
            start_kernel()
        gc.collect()
        trace: list[dict[str, Any]] = []
        tick_times: list[float] = []
        every = max(1, ticks // samples)
        rss_start = process.memory_info().rss
        for i in range(1, ticks + 1):
            now += 30.0
            activities = {lease_id: Activity(busy=rng.random() < 0.3, connections=1) for lease_id in live}
            t = time.perf_counter()
            pool.report_activities(activities, now=now)
            pool.tick(now=now)
            tick_times.append(time.perf_counter() - t)
            for _ in range(churn):  # some kernels end, new ones start
                pool.release(live.pop(rng.randrange(len(live))), reason="kernel shut down", now=now)
                start_kernel()
            if i % every == 0 or i == ticks:
                gc.collect()
                trace.append(
                    {
                        "tick": i,
                        "rss_mib": round(process.memory_info().rss / MIB, 1),
                        "db_mib": round(sum(p.stat().st_size for p in Path(folder).glob("pool.sqlite*")) / MIB, 2),
                        "tick_p50_ms": round(statistics.median(tick_times[-every:]) * 1000, 3),
                    }
                )
        events = pool.store.conn.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        ledger = pool.store.conn.execute("SELECT COUNT(*) FROM ledger").fetchone()[0]
        pool.close()
    first, last = trace[0], trace[-1]
    return {
        "kernels": kernels,
        "ticks": ticks,
        "virtual_hours": round(ticks * 30 / 3600, 1),
        "churn_per_tick": churn,
        "rss_start_mib": round(rss_start / MIB, 1),
        "rss_first_sample_mib": first["rss_mib"],
        "rss_end_mib": last["rss_mib"],
        "db_end_mib": last["db_mib"],
        "events_rows": events,
        "ledger_rows": ledger,
        "report_and_tick": ms(tick_times),
        "trace": trace,
    }


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,10000", help="live-lease counts to measure, comma-separated")
    parser.add_argument("--decisions", type=int, default=200, help="grant+release cycles per size")
    parser.add_argument("--ticks-per-size", type=int, default=50, help="tick() calls timed per size, and views (queue_info, snapshot) timed right after a decision")
    parser.add_argument("--kernels", type=int, default=200, help="kernels of the long-running pool")
    parser.add_argument("--ticks", type=int, default=5000, help="ticks (30 s of virtual time each) of the long-running pool")
    parser.add_argument("--churn", type=int, default=1, help="kernels that end (and are replaced) each tick")
    parser.add_argument("--samples", type=int, default=10, help="RSS samples taken over the long run")
    parser.add_argument("--burst", default="4x", help="PoolPolicy.burst of the pools (4x, the default; 0: fixed slices)")
    parser.add_argument("--follow-changes", action="store_true", help="subscribe a listener to each pool's changes, as a server does")
    parser.add_argument("--skip-long-run", action="store_true", help="measure only the decisions at --sizes")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: expected whole numbers like 100,1000,10000")
    if not sizes or min(sizes) < 0 or max(sizes) > 50_000:
        parser.error("--sizes: each between 0 and 50000 (the benchmark pool holds 16 MiB slices on 8 x 141 GiB)")
    for name in ("decisions", "kernels", "ticks", "samples"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if not 0 <= args.churn <= args.kernels:
        parser.error("--churn must be between 0 and --kernels")
    POOL_OPTIONS.update(burst=args.burst, follow_changes=args.follow_changes)
    result: dict[str, Any] = {"machine": machine(), "inventory": INVENTORY, "slice_bytes": SLICE, "throughput": [], **POOL_OPTIONS}
    # The long run goes first: after the 10,000-lease stage the allocator keeps its high-water
    # mark and RSS would no longer show this pool's own growth.
    long_run = None if args.skip_long_run else bench_long_running(args.kernels, args.ticks, args.churn, args.samples)
    result["long_running"] = long_run
    for live in sizes:
        row = bench_size(live, args.decisions, args.ticks_per_size)
        result["throughput"].append(row)
        if not args.json:
            print(
                f"{live:>6} live: {row['grants_releases_per_s']:>8.1f} grants+releases/s  "
                f"request p50 {row['request_grant']['p50_ms']:.2f} ms p99 {row['request_grant']['p99_ms']:.2f} ms  "
                f"release p50 {row['release']['p50_ms']:.2f} ms p99 {row['release']['p99_ms']:.2f} ms  "
                f"tick p50 {row['tick']['p50_ms']:.2f} ms p99 {row['tick']['p99_ms']:.2f} ms  "
                f"views after a decision p50: queue_info {row['queue_info_after_decision']['p50_ms']:.2f} ms, "
                f"snapshot {row['snapshot_after_decision']['p50_ms']:.1f} ms",
                flush=True,
            )
    if args.json:
        print(json.dumps(result, indent=2))
    elif long_run is not None:
        print(
            f"{long_run['kernels']} kernels, {long_run['ticks']} ticks ({long_run['virtual_hours']} h virtual): "
            f"RSS {long_run['rss_start_mib']} -> {long_run['rss_end_mib']} MiB, DB {long_run['db_end_mib']} MiB "
            f"({long_run['events_rows']} events, {long_run['ledger_rows']} ledger rows), report+tick p50 "
            f"{long_run['report_and_tick']['p50_ms']:.2f} ms p99 {long_run['report_and_tick']['p99_ms']:.2f} ms"
        )
        for sample in long_run["trace"]:
            print(f"  tick {sample['tick']:>6}: RSS {sample['rss_mib']} MiB, DB {sample['db_mib']} MiB, tick p50 {sample['tick_p50_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
