#!/usr/bin/env python
"""Run the notebook-lab scenarios of bench/RESULTS.md through ``jupyter gpupool simulate --json``
and print them as Markdown tables (the exact command above each table).

``python bench/lab_sim.py [--scenario lab|class|class-small|all] [--days N] [--jobs N] [--modes ...]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jupyter_gpupool.simulate import copy_rates
from jupyter_gpupool.units import format_duration, format_size

SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "lab": ("4×A100-80GB lab, 60 users, workday", ["--gpus", "4xA100-80GB", "--users", "60", "--shape", "workday"]),
    "class": ("one 24 GiB GPU, class of 25 (9–11 peak)", ["--gpus", "1x24GiB", "--users", "25", "--shape", "class", "--rate", "12.5"]),
    "class-small": (
        "one 24 GiB GPU, class of 25, teaching-sized notebooks (1–4 GiB, an assumption, not a trace)",
        ["--gpus", "1x24GiB", "--users", "25", "--shape", "class", "--rate", "12.5", "--memory-need", "1GiB-4GiB"],
    ),
}
LABELS = {"exclusive": "exclusive GPUs", "pooled": "pooled", "reclaim": "pooled+reclaim", "suspend": "pooled+suspend"}


def run(args: list[str]) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, "-m", "jupyter_gpupool.cli", "simulate", *args, "--json"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"lab_sim: {' '.join(cmd)} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout), time.perf_counter() - started


def markdown(title: str, args: list[str], data: dict[str, Any], wall: float) -> str:
    lines = [f"### {title}", "", "```", "jupyter gpupool simulate " + shlex.join(args), "```", ""]
    settings = data["settings"]
    lines.append(
        f"{data['sessions']} sessions over {settings['days']:g} day(s), {settings['rate']:g}/h at the peak, seed {settings['seed']}, "
        f"idle timeout {format_duration(settings['idle_timeout'])}, users give up after "
        f"{format_duration(settings['patience']) if settings['patience'] else 'never'}; wall time {wall:.0f} s "
        f"(simulation {data['elapsed_s']:.0f} s, {data.get('cpu_s', 0):.0f} s of CPU)."
    )
    suspending = "suspend" in data["results"]
    if suspending:
        lines[-1] += (
            f" pooled+suspend: idle timeout {format_duration(settings['suspend_idle_timeout'])}, host RAM for parked slices "
            f"{format_size(settings['parked_limit'])}, {copy_rates(settings['checkpoint_rate'], settings.get('restore_rate'))}."
        )
    extra_headers = " suspends | resume wait p95 | parked peak / p95 | work lost |" if suspending else ""
    lines += [
        "",
        "| mode | leased | used | busy | wait p50 | wait p95 | wait max | served/day | gave up/day | reclaims | Jain |" + extra_headers,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" * 4 if suspending else ""),
    ]
    for mode, r in data["results"].items():
        row = (
            f"| {LABELS[mode]} | {r['leased_pct']:.1f}% | {r['used_pct']:.1f}% | {r['busy_pct']:.1f}% | "
            f"{format_duration(r['wait_p50'])} | {format_duration(r['wait_p95'])} | {format_duration(r['wait_max'])} | "
            f"{r['served_per_day']:.1f} | {r['abandoned_per_day']:.1f} | {r['reclaims']} | {r['jain']:.3f} |"
        )
        if suspending:
            lost = f"{r['work_lost'] / 3600:.1f} h"
            if mode == "suspend":
                parked = f"{format_size(r['parked_peak'])} / {format_size(r['parked_p95'])}"
                row += f" {r['suspends']} | {format_duration(r['resume_wait_p95'])} | {parked} | {lost} |"
            else:
                row += f" – | – | – | {lost} |"
        lines.append(row)
    if data["search"]:
        first = next(iter(data["search"].values()))
        lines += ["", f"Fewest {first['model']} GPUs keeping p95 wait within {format_duration(first['target_p95_wait'])}:", ""]
        lines += ["| mode | fewest GPUs | p95 wait by GPU count |", "| --- | ---: | --- |"]
        for mode, s in data["search"].items():
            tried = ", ".join(f"{k}: {format_duration(v)}" for k, v in s["p95_wait_by_gpus"].items())
            lines.append(f"| {LABELS[mode]} | {s['gpus'] if s['gpus'] else '> ' + max(s['p95_wait_by_gpus'], key=int)} | {tried} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="all", choices=[*SCENARIOS, "all"], help="which scenario to run")
    parser.add_argument("--days", default="3", help="simulated days")
    parser.add_argument("--target", default="5m", help="p95 wait target of the GPU-count search ('' to skip)")
    parser.add_argument("--seed", default="42", help="random seed")
    parser.add_argument("--jobs", default="1", help="processes per scenario (simulate --jobs; same tables)")
    parser.add_argument("--modes", default="", help="modes to run (simulate --modes; default: all)")
    options = parser.parse_args()
    names = list(SCENARIOS) if options.scenario == "all" else [options.scenario]
    print(f"Machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; date {time.strftime('%Y-%m-%d')}\n")
    for name in names:
        title, args = SCENARIOS[name]
        args = [*args, "--days", options.days, "--seed", options.seed]
        if options.target:
            args += ["--target-p95-wait", options.target]
        if options.modes:
            args += ["--modes", options.modes]
        if options.jobs != "1":
            args += ["--jobs", options.jobs]
        data, wall = run(args)
        print(markdown(title, args, data, wall) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
