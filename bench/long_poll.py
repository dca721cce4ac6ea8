#!/usr/bin/env python
"""What one pool change costs a broker whose servers all wait in ``GET /api/gpupool/changes``.

A real :class:`~jupyter_gpupool.broker.app.Broker` (its one worker thread) on a real SQLite pool
file; ``--callers`` long polls wait, one per user (as each user's Jupyter server keeps one open),
each user holding a lease. Then pool changes that move nobody's view (the common kind: a
heartbeat of another user's kernel), timed one by one, and a burst of as many back-to-back
changes as there are callers (every server's periodic heartbeat at about the same moment).

Two ways of answering the polls, alternated in the same run on the same broker and pool:

- ``each poll reads``: how the handler answered before: every poll is woken by every change and
  reads its caller's leases itself on the worker thread;
- ``one job per change``: :class:`~jupyter_gpupool.broker.caller_views.CallerViewVersions`, the
  broker's way now: one job per change reads each waiting caller once, and wakes no poll whose view
  did not move.

Per change: pool reads on the worker thread (a query of one caller's leases, or one pass over the
pool's lease cache for every waiting caller), worker time spent reading, time from the change's
commit to the last read it caused, and the wait of a request sent right after the change (it
queues behind those reads). Medians over ``--repeats`` rounds of ``--changes`` changes.

``python bench/long_poll.py [--callers 40] [--changes 30] [--repeats 5] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.broker.app import Broker
from jupyter_gpupool.broker.caller_views import CallerViewVersions
from jupyter_gpupool.core.models import LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.rest.views import view_version
from jupyter_gpupool.units import MIB

SLICE = 64 * MIB


class CountedPool:
    """The pool, with its lease reads counted and timed (what the polls cost the worker thread)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.changes = pool.changes
        self.reads = 0
        self.read_seconds = 0.0
        self.last_read = 0.0

    def _timed(self, read: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        found = read(*args, **kwargs)
        self.last_read = time.perf_counter()
        self.reads += 1
        self.read_seconds += self.last_read - started
        return found

    def leases(self, owner: str | None = None) -> Any:
        return self._timed(self.pool.leases, owner=owner)

    def live_leases_of(self, owners: Any) -> Any:
        return self._timed(self.pool.live_leases_of, owners)


async def poll_as_before(broker: Broker, pool: CountedPool, owner: str, since: int, timeout: float) -> int:
    """The ``/changes`` handler's loop before: woken by every pool change, reads its caller itself."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    changes = pool.changes
    pool_version = changes.version
    while True:
        mine = await broker.run(lambda: view_version(pool.leases(owner=owner)))
        left = deadline - loop.time()
        if mine != since or left <= 0:
            return mine
        pool_version = await changes.wait_async(pool_version, left)


async def settle(pool: CountedPool, broker: Broker) -> None:
    """Until the reads a change caused are over: no new read across a few empty worker jobs."""
    quiet = 0
    while quiet < 3:
        reads = pool.reads
        await asyncio.sleep(0.01)
        await broker.run(lambda: None)
        quiet = quiet + 1 if pool.reads == reads else 0


async def measure(way: str, broker: Broker, pool: CountedPool, owners: list[str], other: str, changes: int) -> dict[str, Any]:
    """``changes`` single changes then one burst, with every owner's poll waiting the ``way`` given."""
    views = CallerViewVersions(pool, broker.run)
    versions = {owner: view_version(pool.pool.leases(owner=owner)) for owner in owners}
    if way == "before":
        polls = [asyncio.ensure_future(poll_as_before(broker, pool, o, versions[o], 3600.0)) for o in owners]
    else:
        polls = [asyncio.ensure_future(views.wait(o, versions[o], 3600.0)) for o in owners]
    await settle(pool, broker)
    reads, spent, latency, probe = [], [], [], []
    for _ in range(changes):
        before, before_seconds = pool.reads, pool.read_seconds
        started = time.perf_counter()
        await broker.run(pool.pool.heartbeat, [other])
        asked = time.perf_counter()
        await broker.run(pool.pool.get, other)  # a request sent right after the change
        probe.append(time.perf_counter() - asked)
        await settle(pool, broker)
        reads.append(pool.reads - before)
        spent.append(pool.read_seconds - before_seconds)
        latency.append(max(0.0, pool.last_read - started) if pool.reads > before else 0.0)
    before, started = pool.reads, time.perf_counter()
    await asyncio.gather(*(broker.run(pool.pool.heartbeat, [other]) for _ in owners))
    await settle(pool, broker)
    burst = {"reads": pool.reads - before, "seconds_to_last_read": round(max(0.0, pool.last_read - started), 4)}
    assert not any(poll.done() for poll in polls), "a change that moved nobody's view answered a poll"
    for poll in polls:
        poll.cancel()
    await asyncio.gather(*polls, return_exceptions=True)
    views.close()
    return {
        "reads_per_change": statistics.median(reads),
        "read_ms_per_change": round(statistics.median(spent) * 1000, 3),
        "ms_to_last_read": round(statistics.median(latency) * 1000, 3),
        "request_after_change_ms": round(statistics.median(probe) * 1000, 3),
        "burst": burst,
    }


async def run(callers: int, changes: int, repeats: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-") as folder:
        raw = Pool(SimulatedBackend.from_spec("8xH200"), os.path.join(folder, "pool.sqlite"), PoolPolicy(idle_policy="never"))
        owners = [f"user{i:03d}" for i in range(callers)]
        for owner in owners:
            raw.request(LeaseRequest(owner=owner, memory=SLICE, kernel_id=f"k-{owner}"))
        other = raw.request(LeaseRequest(owner="nobody-waits", memory=SLICE, kernel_id="k-other")).id
        pool = CountedPool(raw)
        broker = Broker(pool=raw)
        rounds: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        try:
            for _ in range(repeats):
                for way in ("before", "after"):
                    rounds[way].append(await measure(way, broker, pool, owners, other, changes))
        finally:
            broker.view_versions.close()
            broker.executor.shutdown(wait=True)
            raw.close()

    def median_of(way: str, key: str, inner: str | None = None) -> float:
        values = [r[key][inner] if inner else r[key] for r in rounds[way]]
        return round(statistics.median(values), 4)

    keys = ("reads_per_change", "read_ms_per_change", "ms_to_last_read", "request_after_change_ms")
    summary = {
        way: {**{k: median_of(way, k) for k in keys},
              "burst_reads": median_of(way, "burst", "reads"), "burst_seconds": median_of(way, "burst", "seconds_to_last_read")}
        for way in rounds
    }
    ratio = {
        k: round(summary["before"][k] / summary["after"][k], 2) if summary["after"][k] else None
        for k in (*keys, "burst_reads", "burst_seconds")
    }
    return {
        "callers": callers, "changes": changes, "repeats": repeats, "summary": summary, "before_over_after": ratio,
        "rounds": rounds, "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "load": os.getloadavg()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=40, help="long polls waiting, one per user")
    parser.add_argument("--changes", type=int, default=30, help="single changes timed per round")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each way, alternated")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    args = parser.parse_args(argv)
    for name, most in (("callers", 1000), ("changes", 10000), ("repeats", 100)):
        if not 1 <= getattr(args, name) <= most:
            parser.error(f"--{name} {getattr(args, name)}: give 1 to {most}")
    command = "python bench/long_poll.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, **asyncio.run(run(args.callers, args.changes, args.repeats))}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(command)
    print(f"{args.callers} waiting callers, medians of {args.repeats} rounds of {args.changes} changes; load {result['machine']['load']}")
    for way, label in (("before", "each poll reads"), ("after", "one job per change")):
        s = result["summary"][way]
        print(
            f"{label:>22}: {s['reads_per_change']:g} reads/change, {s['read_ms_per_change']:.2f} ms reading, "
            f"last read {s['ms_to_last_read']:.2f} ms after, request after it waits {s['request_after_change_ms']:.2f} ms; "
            f"burst of {args.callers}: {s['burst_reads']:g} reads, {s['burst_seconds'] * 1000:.0f} ms"
        )
    print("before / after:", result["before_over_after"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
