"""Where a decision's time goes: cProfile of grant+release cycles at N live leases, as shares by module.

``python bench/profile_decision.py [--live 1000] [--cycles 300]`` — a simulated 8-GPU pool on a
SQLite file in WAL mode (as in production), N live leases, then the profiled cycles (each a
request that is granted at once and its release, with time moving forward).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_gpupool.core.models import LeaseRequest  # noqa: E402
from jupyter_gpupool.core.policy import PoolPolicy  # noqa: E402
from jupyter_gpupool.devices.simulated import SimulatedBackend  # noqa: E402
from jupyter_gpupool.backends.local.pool import Pool  # noqa: E402
from jupyter_gpupool.units import MIB  # noqa: E402

T0 = 1_800_000_000.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=1000, help="live leases held during the cycles")
    parser.add_argument("--cycles", type=int, default=300, help="grant+release cycles profiled")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gpupool-profile-"))
    policy = PoolPolicy(idle_policy="never", heartbeat_ttl=10**9)
    pool = Pool(SimulatedBackend.from_spec("8x80GiB"), str(folder / "pool.sqlite"), policy, clock=lambda: T0)
    for i in range(args.live):
        pool.request(LeaseRequest(owner=f"u{i % 50}", memory=512 * MIB), now=T0)
    clock = [T0]

    def cycles(count: int) -> None:
        for i in range(count):
            clock[0] += 1
            lease = pool.request(LeaseRequest(owner=f"x{i % 20}", memory=512 * MIB), now=clock[0])
            pool.release(lease.id, now=clock[0])

    cycles(50)  # warm the caches
    started = time.perf_counter()
    cycles(args.cycles)
    rate = 2 * args.cycles / (time.perf_counter() - started)
    profiler = cProfile.Profile()
    profiler.runcall(cycles, args.cycles)
    stats = pstats.Stats(profiler)
    shares: collections.Counter[str] = collections.Counter()
    for (path, _, function), row in stats.stats.items():  # type: ignore[attr-defined]
        if "sqlite3" in function:
            key = "SQLite calls"
        elif "jupyter_gpupool" in path:
            key = path.split("jupyter_gpupool/")[-1]
        elif "json" in path:
            key = "json"
        else:
            key = "builtins and other"
        shares[key] += row[2]
    total = sum(shares.values()) or 1.0
    print(f"{rate:,.0f} grants+releases/s at {args.live:,} live leases (unprofiled, {args.cycles} cycles)")
    for key, seconds in shares.most_common(10):
        print(f"{100 * seconds / total:5.1f} %  {key}")
    pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
