"""The lab's fewest GPUs per mode against the oracle, from ``jupyter gpupool simulate --json`` outputs.

Each file is one run with ``--target-p95-wait`` (any modes; ``oracle`` among them for its column).
The table gives, per run, the fewest GPUs of each mode and, recomputed from the run's own sessions,
the oracle counted two more ways: its p95 over the cells the pool too would have to bring back (a
session's first cell, and cells after an idle spell at least the pool's delay before parking:
the run's suspend idle timeout, the idle warning running within it as the pool's default has it), and the GPUs no scheduler can go below
without ever delaying a cell (``oracle.no_wait_gpus``). Hours waited: Σ of every wait at that count. Where an
``elastic`` run is present it also splits the memory of its run on the configured inventory into
what busy kernels need, what idle kernels hold, and what slices hold above their kernels' use.

    python bench/oracle_gap.py bench/out/lab-*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jupyter_gpupool.apps.oracle import OracleRun, no_wait_gpus
from jupyter_gpupool.apps.simulate import (
    ModeResult,
    Settings,
    inventory_model,
    make_plans,
    parse_requests,
    parse_shape,
    percentile,
    uniform_backend,
)
from jupyter_gpupool.apps.workload import MemoryNeed, load_workload
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.units import format_duration

MODES = ("exclusive", "pooled", "reclaim", "suspend", "elastic", "oracle")


def settings_of(data: dict[str, Any]) -> Settings:
    """The scenario a run's JSON describes (what its sessions are drawn from)."""
    s = data["settings"]
    return Settings(
        gpus=s["gpus"], users=s["users"], rate=s["rate"], shape=parse_shape(s["shape"]), days=s["days"], seed=s["seed"],
        memory_need=MemoryNeed(**s["memory_need"]), session_length=s["session_length"], requests=parse_requests(s["requests"]),
        tick=s["tick"], patience=s["patience"],
    )


def oracle_on_long_spells(settings: Settings, plans: list[Any], delay: float, target: float, max_gpus: int = 64) -> int | None:
    """Fewest GPUs for which the oracle's p95 wait, over first cells and cells after an idle spell of at
    least ``delay``, is within ``target`` (None: not within ``max_gpus``)."""
    name, memory, _ = inventory_model(settings.gpus)
    for count in range(1, max_gpus + 1):
        run = OracleRun(settings, plans, uniform_backend(name, memory, count))
        run.run(ModeResult)
        waits = [w for w, idle in zip(run.waits, run.idle_before, strict=True) if idle >= delay]
        if percentile(waits, 95) <= target:
            return count
    return None


def row(path: Path, traces: str | None) -> dict[str, Any]:
    data = json.loads(path.read_text())
    settings = settings_of(data)
    _, memory, _ = inventory_model(settings.gpus)
    plans = make_plans(settings, load_workload(traces))
    # The pool's delay before parking while someone waits: its default warns within the timeout.
    timeout = data["settings"]["suspend_idle_timeout"]
    policy = PoolPolicy()
    delay = max(timeout, policy.warning_period) if policy.warn_within_idle_timeout else timeout + policy.warning_period
    target = next(iter(data["search"].values()))["target_p95_wait"]
    out: dict[str, Any] = {
        "file": path.name, "requests": settings.requests.text, "seed": settings.seed, "sessions": len(plans),
        # the oracle column's promises (--oracle-keeps); the two oracle counts recomputed here keep none
        "oracle_keeps": ",".join(data["settings"].get("oracle_keeps") or []),
        "no_wait": no_wait_gpus(plans, memory, memory, settings.days * 86400),
        "park_delay": delay,
        "oracle_long_spells": oracle_on_long_spells(settings, plans, delay, target),
        "hours_waited": {
            mode: round(s["result"]["wait_mean"] * s["result"]["requests"] / 3600, 1) for mode, s in data["search"].items() if s["result"]
        },
        "requests_at_count": {mode: s["result"]["requests"] for mode, s in data["search"].items() if s["result"]},
        "fewest": {mode: s["gpus"] for mode, s in data["search"].items()},
        "p95": {mode: s["p95_wait_by_gpus"] for mode, s in data["search"].items()},
    }
    elastic = data["results"].get("elastic")
    if elastic:
        out["elastic_memory"] = {
            "gpus": elastic["gpus"], "busy": elastic["busy_pct"], "idle": elastic["used_pct"] - elastic["busy_pct"],
            "above_use": elastic["leased_pct"] - elastic["used_pct"], "guaranteed": elastic["guaranteed_pct"],
        }
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    modes = [m for m in MODES if any(m in r["fewest"] for r in rows)]
    lines = [
        "| requests | seed | " + " | ".join(modes) + " | oracle, cells the pool would bring back | oracle, no cell ever waits "
        "| p95 wait (requests, hours waited) at each mode's count |",
        "| --- | ---: | " + " | ".join("---:" for _ in modes) + " | ---: | ---: | --- |",
    ]
    for r in rows:
        counts = [str(r["fewest"].get(m, "–") or "> max") for m in modes]
        at = "; ".join(
            f"{m} {format_duration(r['p95'][m][str(r['fewest'][m])])} ({r['requests_at_count'][m]}, {r['hours_waited'][m]} h)"
            for m in modes
            if r["fewest"].get(m)
        )
        long_spells = r["oracle_long_spells"] or "> 64"
        requests = r["requests"] + (f" (oracle keeping {r['oracle_keeps']})" if r["oracle_keeps"] else "")
        lines.append(f"| {requests} | {r['seed']} | " + " | ".join(counts) + f" | {long_spells} | {r['no_wait']} | {at} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path, help="outputs of jupyter gpupool simulate --target-p95-wait ... --json")
    parser.add_argument("--traces", default=None, help="folder of the public traces (default: as the simulator finds them)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a markdown table")
    args = parser.parse_args(argv)
    rows = [row(path, args.traces) for path in args.files]
    print(json.dumps(rows, indent=1) if args.json else markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
