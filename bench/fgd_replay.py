#!/usr/bin/env python3
"""Replay the FGD paper's placement experiment with the engine's own placement policies.

Follows ``../shared/traces/README.md`` ("How the FGD paper evaluates placement"):

* inventory ``openb_node_list_gpu_node.csv`` (1,213 nodes, 6,212 GPUs); CPU and RAM enforced;
* per seed: pods sorted by name and shuffled; pods drawn with replacement and appended while
  the total GPU demand stays within 130 % of capacity (the draw that would pass it is
  discarded); a trace that starts above 130 % has random pods removed until it is not;
* pods never leave, a pod that fits nowhere is skipped;
* metric: before each attempt "arrived" grows by ``num_gpu × gpu_milli``; after it the
  allocated share is logged; column *k* is the mean allocated % over the attempts whose
  arrived % rounds to *k*. ``alloc_100`` and ``alloc_130`` are columns 100 and 130.

The placement code is ``jupyter_gpupool.core.placement`` — the engine's, not a copy.

Examples::

    python bench/fgd_replay.py --pods ../shared/traces/alibaba-gpu-v2023/openb_pod_list_default.csv \\
        --policy fgd --seeds 42-51 --json
    python bench/fgd_replay.py --all-variants --seeds 42-51 --jobs 2 --markdown bench/out/fgd.md
    python bench/fgd_replay.py --pods ... --policy best-fit --seeds 42-43 --sample 0.1 --json
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jupyter_gpupool.core.placement import (
    POLICIES,
    Demand,
    GpuSlot,
    NodeView,
    apply_placement,
    make_policy,
    typical_demands,
)

TRACES = ROOT.parent / "shared" / "traces"
TRACE_DIR = TRACES / "alibaba-gpu-v2023"
PUBLISHED = TRACES / "fgd-published" / "analysis_allo_discrete.csv"
DEFAULT_NODES = TRACE_DIR / "openb_node_list_gpu_node.csv"
MILLI = 1000
RATIO = 1.3
COVERAGE = 0.95
PUBLISHED_POLICIES = {"best-fit": "05-BestFit", "fgd": "06-FGD"}
DEFAULT_POLICIES = ("best-fit", "fgd", "fgd-cpufit")


class ReplayError(Exception):
    """A bad argument or input file; printed as one line."""


# -- inputs ------------------------------------------------------------------------------
@functools.cache
def load_nodes(path: str) -> tuple[tuple[str, int, int, int, str], ...]:
    """(name, cpu_milli, memory_mib, gpus, model) of every node that has GPUs."""
    rows = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if int(row["gpu"]) > 0:
                rows.append((row["sn"], int(row["cpu_milli"]), int(row["memory_mib"]), int(row["gpu"]), row["model"]))
    if not rows:
        raise ReplayError(f"{path}: no GPU nodes (expected columns sn,cpu_milli,memory_mib,gpu,model)")
    return tuple(rows)


@functools.cache
def load_pods(path: str) -> tuple[tuple[str, Demand], ...]:
    """(name, demand) of every pod, sorted by name."""
    pods = []
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            num, milli = int(row["num_gpu"]), int(row["gpu_milli"])
            spec = (row.get("gpu_spec") or "").strip()
            models = frozenset(m for m in spec.split("|") if m) if spec else frozenset()
            cpu, mem = int(row["cpu_milli"]), int(row["memory_mib"])
            if num == 0 or milli == 0:
                d = Demand(per_gpu=0, num_gpus=0, cpu=cpu, mem=mem)
            elif milli >= MILLI:
                d = Demand(per_gpu=MILLI, num_gpus=num, whole=True, models=models, cpu=cpu, mem=mem)
            else:
                d = Demand(per_gpu=milli, num_gpus=num, models=models, cpu=cpu, mem=mem)
            pods.append((row["name"], d))
    if not pods:
        raise ReplayError(f"{path}: no pods (expected columns name,cpu_milli,memory_mib,num_gpu,gpu_milli)")
    pods.sort(key=lambda p: p[0])
    return tuple(pods)


def gpu_demand(d: Demand) -> int:
    """Σ num_gpu × gpu_milli of one pod."""
    return d.num_gpus * d.per_gpu


def paper_typical(pods: Sequence[tuple[str, Demand]]) -> list[tuple[Demand, float]]:
    """The paper's typical pods: keyed by (cpu, gpu_milli, num_gpu, gpu_spec) — no memory."""
    keyed = [Demand(d.per_gpu, d.num_gpus, d.whole, d.models, d.cpu, 0) for _, d in pods]
    return typical_demands(keyed, COVERAGE)


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,45,50`` (or both) → list of ints."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = part.split("-", 1)
                seeds.extend(range(int(lo), int(hi) + 1))
            elif part:
                seeds.append(int(part))
    except ValueError:
        raise ReplayError(f"bad --seeds {text!r}; use a range like 42-51 or a list like 42,43") from None
    if not seeds:
        raise ReplayError(f"bad --seeds {text!r}; use a range like 42-51 or a list like 42,43")
    return seeds


# -- one replay ----------------------------------------------------------------------------
def build_nodes(rows: Sequence[tuple[str, int, int, int, str]]) -> list[NodeView]:
    return [
        NodeView(
            name=name,
            gpus=[GpuSlot(f"{name}/{i}", model, MILLI, MILLI) for i in range(ngpu)],
            cpu_total=cpu,
            cpu_free=cpu,
            mem_total=mem,
            mem_free=mem,
        )
        for name, cpu, mem, ngpu, model in rows
    ]


def workload(pods: Sequence[tuple[str, Demand]], capacity: int, rng: random.Random) -> list[Demand]:
    """Shuffle, then draw with replacement up to 130 % of capacity (or remove down to it)."""
    original = [d for _, d in pods]
    work = list(original)
    rng.shuffle(work)
    target = RATIO * capacity
    total = sum(gpu_demand(d) for d in work)
    if total > target:
        while total > target and work:
            total -= gpu_demand(work.pop(rng.randrange(len(work))))
    else:
        while True:
            d = original[rng.randrange(len(original))]
            if total + gpu_demand(d) > target:
                break
            total += gpu_demand(d)
            work.append(d)
    return work


def replay_seed(
    pods_path: str,
    nodes_path: str,
    policy_name: str,
    seed: int,
    sample: float = 1.0,
    max_pods: int | None = None,
) -> dict[str, Any]:
    """One seed: allocation % at 100 and 130 % arrived demand, and decision timings."""
    pods = load_pods(pods_path)
    node_rows = list(load_nodes(nodes_path))
    if sample < 1.0:
        keep = max(1, round(len(node_rows) * sample))
        node_rows = random.Random(0).sample(node_rows, keep)
    rng = random.Random(seed)
    capacity = sum(r[3] for r in node_rows) * MILLI
    work = workload(pods, capacity, rng)
    if max_pods is not None:
        work = work[:max_pods]
    rng.shuffle(node_rows)  # the fixed per-seed node order that breaks ties
    nodes = build_nodes(node_rows)
    policy = make_policy(policy_name, paper_typical(pods))

    arrived = allocated = placed = 0
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    times: list[float] = []
    clock = time.perf_counter
    start = clock()
    for d in work:
        arrived += gpu_demand(d)
        t0 = clock()
        where = policy.place(nodes, d)
        times.append(clock() - t0)
        if where is not None:
            apply_placement(nodes, d, where)
            policy.notify_changed(where.node)
            allocated += gpu_demand(d)
            placed += 1
        k = round(100 * arrived / capacity)
        sums[k] = sums.get(k, 0.0) + 100 * allocated / capacity
        counts[k] = counts.get(k, 0) + 1
    wall = clock() - start
    times.sort()
    curve = {k: sums[k] / counts[k] for k in sorted(sums)}
    return {
        "seed": seed,
        "alloc_100": curve.get(100),
        "alloc_130": curve.get(130),
        "attempts": len(work),
        "placed": placed,
        "decision_s": sum(times),
        "p50_ms": 1000 * times[len(times) // 2] if times else None,
        "p99_ms": 1000 * times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)] if times else None,
        "wall_s": wall,
        "gpus": capacity // MILLI,
        "nodes": len(nodes),
    }


def _replay_task(args: tuple[str, str, str, int, float, int | None]) -> dict[str, Any]:
    return replay_seed(*args)


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def summarize(policy: str, pods_path: str, results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds, per-seed values and decision speed for one (trace, policy)."""
    results = sorted(results, key=lambda r: r["seed"])
    attempts = sum(r["attempts"] for r in results)
    decision_s = sum(r["decision_s"] for r in results)
    return {
        "policy": policy,
        "pods": os.path.basename(pods_path),
        "seeds": [r["seed"] for r in results],
        "alloc_100": _mean([r["alloc_100"] for r in results]),
        "alloc_130": _mean([r["alloc_130"] for r in results]),
        "per_seed": [
            {k: r[k] for k in ("seed", "alloc_100", "alloc_130", "attempts", "placed", "wall_s")} for r in results
        ],
        "speed": {
            "nodes": results[0]["nodes"] if results else 0,
            "gpus": results[0]["gpus"] if results else 0,
            "decisions_per_s": attempts / decision_s if decision_s else None,
            "placed_per_s": sum(r["placed"] for r in results) / decision_s if decision_s else None,
            "p50_ms": statistics.median(r["p50_ms"] for r in results) if results else None,
            "p99_ms": max(r["p99_ms"] for r in results) if results else None,
            "p99_ms_median_over_seeds": statistics.median(r["p99_ms"] for r in results) if results else None,
        },
    }


def published_means(path: Path = PUBLISHED) -> dict[tuple[str, str], dict[str, float]]:
    """{(variant, policy): {alloc_100, alloc_130, seeds}} of the paper's BestFit and FGD."""
    acc: dict[tuple[str, str], list[tuple[float, float]]] = {}
    wanted = {v: k for k, v in PUBLISHED_POLICIES.items()}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            pol = wanted.get(row["sc_policy"])
            if pol is None:
                continue
            variant = row["workload"].removeprefix("openb_pod_list_")
            acc.setdefault((variant, pol), []).append((float(row["100"]), float(row["130"])))
    return {
        key: {
            "alloc_100": statistics.fmean(v[0] for v in vals),
            "alloc_130": statistics.fmean(v[1] for v in vals),
            "seeds": len(vals),
        }
        for key, vals in acc.items()
    }


def _task_key(task: tuple[Any, ...]) -> str:
    pods, nodes, policy, seed, sample, max_pods = task
    return json.dumps([os.path.basename(pods), os.path.basename(nodes), policy, seed, sample, max_pods])


def run_many(
    tasks: list[tuple[str, str, str, int, float, int | None]], jobs: int, cache: str | None = None
) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Run replay tasks (in ``jobs`` processes) → {(pods_path, policy): [seed results]}.

    With ``cache`` (a JSON-lines file), each finished seed is appended as it ends and seeds
    already there are not run again, so a long run can be stopped and resumed.
    """
    out: dict[tuple[str, str], list[dict[str, Any]]] = {}
    done: dict[str, dict[str, Any]] = {}
    if cache and Path(cache).is_file():
        for line in Path(cache).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["key"]] = rec["result"]
    todo = [t for t in tasks if _task_key(t) not in done]
    sink = open(cache, "a") if cache else None  # noqa: SIM115 - closed below

    def record(task: tuple[Any, ...], res: dict[str, Any]) -> None:
        done[_task_key(task)] = res
        if sink:
            sink.write(json.dumps({"key": _task_key(task), "result": res}) + "\n")
            sink.flush()

    try:
        if jobs <= 1:
            for task in todo:
                record(task, _replay_task(task))
        else:
            # longest first (FGD variants) keeps every core busy to the end
            todo.sort(key=lambda t: t[2] == "best-fit")
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                futures = {pool.submit(_replay_task, t): t for t in todo}
                for fut in as_completed(futures):
                    record(futures[fut], fut.result())
    finally:
        if sink:
            sink.close()
    for task in tasks:
        out.setdefault((task[0], task[2]), []).append(done[_task_key(task)])
    return out


def fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def markdown_table(rows: list[dict[str, Any]], policies: Sequence[str]) -> str:
    """The variant table: published BestFit/FGD beside ours, alloc@100 / alloc@130.

    The last column compares the last policy given (by default fgd-cpufit) with the paper's FGD.
    """
    last = policies[-1]
    head = ["variant", "paper BestFit", "paper FGD"] + [f"ours {p}" for p in policies] + [f"{last} − paper FGD"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        pub = row["published"]
        cells = [row["variant"]]
        for p in ("best-fit", "fgd"):
            m = pub.get(p)
            cells.append(f"{fmt(m['alloc_100'])} / {fmt(m['alloc_130'])}" if m else "–")
        for p in policies:
            m = row["ours"].get(p)
            cells.append(f"{fmt(m['alloc_100'])} / {fmt(m['alloc_130'])}" if m else "–")
        f, m = pub.get("fgd"), row["ours"].get(last)
        if f and m and m["alloc_100"] is not None and m["alloc_130"] is not None:
            cells.append(f"{m['alloc_100'] - f['alloc_100']:+.2f} / {m['alloc_130'] - f['alloc_130']:+.2f}")
        else:
            cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", help="pod list CSV (openb_pod_list_*.csv)")
    ap.add_argument("--nodes", default=str(DEFAULT_NODES), help="node list CSV (default: the 1,213 GPU nodes)")
    ap.add_argument(
        "--policy",
        default=None,
        help=f"policy name, or several separated by commas; one of {', '.join(POLICIES)} "
        f"(default: fgd; with --all-variants: {','.join(DEFAULT_POLICIES)})",
    )
    ap.add_argument("--seeds", default="42-51", help="seed range or list, e.g. 42-51 or 42,43 (default: 42-51)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--all-variants",
        action="store_true",
        help="every trace variant with published numbers, policies best-fit,fgd,fgd-bestfit unless --policy is given",
    )
    ap.add_argument(
        "--variants", help="with --all-variants: only these variants (comma-separated, e.g. default,cpu050)"
    )
    ap.add_argument("--sample", type=float, default=1.0, help="use this fraction of the nodes (smoke runs), e.g. 0.1")
    ap.add_argument("--max-pods", type=int, default=None, help="stop each seed after this many pods (smoke runs)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--markdown", help="also write the variant table as Markdown to this file")
    ap.add_argument("--published", default=str(PUBLISHED), help="the paper's analysis_allo_discrete.csv")
    ap.add_argument(
        "--resume",
        metavar="FILE.jsonl",
        help="append each finished seed to this file and skip seeds already in it (stop and resume long runs)",
    )
    args = ap.parse_args(argv)

    try:
        seeds = parse_seeds(args.seeds)
        if not 0 < args.sample <= 1:
            raise ReplayError(f"--sample must be a fraction in (0, 1], got {args.sample}")
        if args.max_pods is not None and args.max_pods < 1:
            raise ReplayError(f"--max-pods must be a positive count, got {args.max_pods}")
        default = ",".join(DEFAULT_POLICIES) if args.all_variants else "fgd"
        policies_given = [p.strip() for p in (args.policy or default).split(",") if p.strip()]
        for p in policies_given:
            if p not in POLICIES:
                raise ReplayError(f"unknown --policy {p!r}; use one of: {', '.join(POLICIES)}")
        if not Path(args.nodes).is_file():
            raise ReplayError(f"node list not found: {args.nodes} (expected ../shared/traces next to the repo)")
        load_nodes(args.nodes)
        started = time.time()
        if args.all_variants:
            policies = policies_given
            pub = published_means(Path(args.published))
            variants = sorted({v for v, _ in pub})
            if args.variants:
                chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
                unknown = [v for v in chosen if v not in variants]
                if unknown:
                    raise ReplayError(f"no published numbers for {unknown}; known: {', '.join(variants)}")
                variants = chosen
            paths = {v: str(TRACE_DIR / f"openb_pod_list_{v}.csv") for v in variants}
            for v, pth in paths.items():
                if not Path(pth).is_file():
                    raise ReplayError(f"pod list not found: {pth}")
            tasks = [
                (paths[v], args.nodes, p, s, args.sample, args.max_pods)
                for v in variants
                for p in policies
                for s in seeds
            ]
            results = run_many(tasks, args.jobs, args.resume)
            rows = []
            for v in variants:
                ours = {p: summarize(p, paths[v], results[(paths[v], p)]) for p in policies}
                rows.append(
                    {
                        "variant": v,
                        "published": {p: pub[(v, p)] for p in PUBLISHED_POLICIES if (v, p) in pub},
                        "ours": ours,
                    }
                )
            out: dict[str, Any] = {
                "variants": rows,
                "policies": policies,
                "seeds": seeds,
                "sample": args.sample,
                "machine": f"{platform.machine()} {os.cpu_count()} cores, Python {platform.python_version()}",
                "elapsed_s": time.time() - started,
            }
            if args.markdown:
                Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
                Path(args.markdown).write_text(markdown_table(rows, policies))
            if args.json:
                print(json.dumps(out, indent=1))
            else:
                print(markdown_table(rows, policies), end="")
            return 0

        if not args.pods:
            raise ReplayError("give --pods PODS.csv (or --all-variants)")
        if not Path(args.pods).is_file():
            raise ReplayError(f"pod list not found: {args.pods}")
        load_pods(args.pods)
        tasks = [(args.pods, args.nodes, p, s, args.sample, args.max_pods) for p in policies_given for s in seeds]
        results = run_many(tasks, args.jobs, args.resume)
        summaries = [summarize(p, args.pods, results[(args.pods, p)]) for p in policies_given]
        result: dict[str, Any] = summaries[0] if len(summaries) == 1 else {"results": summaries}
        result["elapsed_s"] = time.time() - started
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            for s in summaries:
                sp = s["speed"]
                print(
                    f"{s['pods']} {s['policy']}: alloc@100 {fmt(s['alloc_100'])} %, alloc@130 {fmt(s['alloc_130'])} % "
                    f"(seeds {args.seeds}); {sp['decisions_per_s']:.0f} decisions/s, "
                    f"p50 {sp['p50_ms']:.2f} ms, p99 {sp['p99_ms']:.2f} ms on {sp['gpus']} GPUs"
                )
        return 0
    except (ReplayError, OSError, KeyError, ValueError) as exc:
        print(f"fgd_replay: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
