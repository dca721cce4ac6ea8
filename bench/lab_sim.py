#!/usr/bin/env python
"""Run the notebook-lab scenarios of bench/RESULTS.md through ``jupyter gpupool simulate --json``
and print them as Markdown tables (the exact command above each table).

``python bench/lab_sim.py [--scenario lab|class|class-small|all] [--days N] [--jobs N] [--modes ...] [--requests ...]``

``--sweep-suspend-idle 30s,1m,2m,5m`` runs pooled+suspend once per idle timeout instead (with the
copy rates given by ``--checkpoint-rate``/``--restore-rate``) and prints one row per timeout.
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

from jupyter_gpupool.apps.simulate import copy_rates
from jupyter_gpupool.units import format_duration, format_size

SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "lab": ("4×A100-80GB lab, 60 users, workday", ["--gpus", "4xA100-80GB", "--users", "60", "--shape", "workday"]),
    "class": ("one 24 GiB GPU, class of 25 (9–11 peak)", ["--gpus", "1x24GiB", "--users", "25", "--shape", "class", "--rate", "12.5"]),
    "class-small": (
        "one 24 GiB GPU, class of 25, teaching-sized notebooks (1–4 GiB, an assumption, not a trace)",
        ["--gpus", "1x24GiB", "--users", "25", "--shape", "class", "--rate", "12.5", "--memory-need", "1GiB-4GiB"],
    ),
}
LABELS = {"exclusive": "exclusive GPUs", "pooled": "pooled", "reclaim": "pooled+reclaim", "suspend": "pooled+suspend", "elastic": "elastic"}


def run(args: list[str]) -> tuple[dict[str, Any], float]:
    cmd = [sys.executable, "-m", "jupyter_gpupool.apps.cli", "simulate", *args, "--json"]
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
    suspending = any(mode in ("suspend", "elastic") for mode in data["results"])
    elastic = "elastic" in data["results"]
    if suspending:
        lines[-1] += (
            f" pooled+suspend: idle timeout {format_duration(settings['suspend_idle_timeout'])}, host RAM for parked slices "
            f"{format_size(settings['parked_limit'])}, {copy_rates(settings['checkpoint_rate'], settings.get('restore_rate'))}."
        )
    extra_headers = " suspends | resume wait p95 | parked peak / p95 | work lost |" if suspending else ""
    extra_headers += " guaranteed | grows / taken back | grow wait p95 |" if elastic else ""
    lines += [
        "",
        "| mode | leased | used | busy | wait p50 | wait p95 | wait max | served/day | gave up/day | reclaims | Jain |" + extra_headers,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" * 4 if suspending else "")
        + (" ---: |" * 3 if elastic else ""),
    ]
    for mode, r in data["results"].items():
        row = (
            f"| {LABELS[mode]} | {r['leased_pct']:.1f}% | {r['used_pct']:.1f}% | {r['busy_pct']:.1f}% | "
            f"{format_duration(r['wait_p50'])} | {format_duration(r['wait_p95'])} | {format_duration(r['wait_max'])} | "
            f"{r['served_per_day']:.1f} | {r['abandoned_per_day']:.1f} | {r['reclaims']} | {r['jain']:.3f} |"
        )
        if suspending:
            lost = f"{r['work_lost'] / 3600:.1f} h"
            if mode in ("suspend", "elastic"):
                parked = f"{format_size(r['parked_peak'])} / {format_size(r['parked_p95'])}"
                row += f" {r['suspends']} | {format_duration(r['resume_wait_p95'])} | {parked} | {lost} |"
            else:
                row += f" – | – | – | {lost} |"
        if elastic:
            if mode == "elastic":
                row += f" {r['guaranteed_pct']:.1f}% | {r['grows']} / {r['shrinks']} | {format_duration(r['grow_wait_p95'])} |"
            else:
                row += " – | – | – |"
        lines.append(row)
    if "requests" in settings:
        lines += ["", notes_of_requests(data)]
    if data["search"]:
        first = next(iter(data["search"].values()))
        lines += ["", f"Fewest {first['model']} GPUs keeping p95 wait within {format_duration(first['target_p95_wait'])}:", ""]
        lines += ["| mode | fewest GPUs | p95 wait by GPU count |", "| --- | ---: | --- |"]
        for mode, s in data["search"].items():
            tried = ", ".join(f"{k}: {format_duration(v)}" for k, v in s["p95_wait_by_gpus"].items())
            lines.append(f"| {LABELS[mode]} | {s['gpus'] if s['gpus'] else '> ' + max(s['p95_wait_by_gpus'], key=int)} | {tried} |")
    return "\n".join(lines)


def notes_of_requests(data: dict[str, Any]) -> str:
    """The table's note on what sessions asked for (the same words as ``simulate`` prints)."""
    from jupyter_gpupool.apps.simulate import ModeResult, parse_requests, requests_note

    settings = data["settings"]
    results = {mode: ModeResult(**{k: v for k, v in r.items() if k in ModeResult.__dataclass_fields__}) for mode, r in data["results"].items()}
    return requests_note(parse_requests(settings["requests"]), data.get("default_slice", 0), results)


def sweep(title: str, args: list[str], timeouts: list[str]) -> str:
    """pooled+suspend once per idle timeout on the same sessions: one Markdown row each."""
    base = [*args, "--modes", "suspend"]
    lines = [f"### {title}: pooled+suspend by idle timeout", "", "```"]
    lines += [f"jupyter gpupool simulate {shlex.join([*base, '--suspend-idle-timeout', t])}" for t in timeouts]
    lines += ["```", ""]
    rows = []
    walls = 0.0
    sessions, settings = 0, {}
    for timeout in timeouts:
        data, wall = run([*base, "--suspend-idle-timeout", timeout])
        walls += wall
        sessions, settings = data["sessions"], data["settings"]
        r = data["results"]["suspend"]
        search = data["search"].get("suspend")
        fewest = ""
        if search:
            fewest = f" {search['gpus'] if search['gpus'] else '> ' + max(search['p95_wait_by_gpus'], key=int)} |"
        rows.append(
            f"| {format_duration(settings['suspend_idle_timeout'])} | {format_duration(r['wait_p50'])} | "
            f"{format_duration(r['wait_p95'])} | {r['served_per_day']:.1f} | {r['abandoned_per_day']:.1f} | {r['suspends']} | "
            f"{r['reclaims']} | {format_duration(r['resume_wait_p50'])} | {format_duration(r['resume_wait_p95'])} | "
            f"{format_size(r['parked_peak'])} / {format_size(r['parked_p95'])} | {r['jain']:.3f} |" + fewest
        )
    lines.append(
        f"{sessions} sessions over {settings['days']:g} day(s), seed {settings['seed']}, host RAM for parked slices "
        f"{format_size(settings['parked_limit'])}, {copy_rates(settings['checkpoint_rate'], settings.get('restore_rate'))}; "
        f"wall time {walls:.0f} s for the {len(timeouts)} runs."
    )
    target = "fewest GPUs |" if any(r.count("|") > 12 for r in rows) else ""
    lines += [
        "",
        "| suspend idle timeout | wait p50 | wait p95 | served/day | gave up/day | suspends | culls | resume wait p50 | "
        "resume wait p95 | parked peak / p95 | Jain |" + (" " + target if target else ""),
        "| ---: |" + " ---: |" * (11 if target else 10),
        *rows,
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="all", choices=[*SCENARIOS, "all"], help="which scenario to run")
    parser.add_argument("--days", default="3", help="simulated days")
    parser.add_argument("--target", default="5m", help="p95 wait target of the GPU-count search ('' to skip)")
    parser.add_argument("--seed", default="42", help="random seed")
    parser.add_argument("--jobs", default="1", help="processes per scenario (simulate --jobs; same tables)")
    parser.add_argument("--modes", default="", help="modes to run (simulate --modes; default: all)")
    parser.add_argument("--requests", default="", help="what sessions ask for (simulate --requests; default: exact)")
    parser.add_argument("--gpus", default="", help="another inventory than the scenario's (simulate --gpus)")
    parser.add_argument("--checkpoint-rate", default="", help="GB/s of a suspend's copy (simulate --checkpoint-rate)")
    parser.add_argument("--restore-rate", default="", help="GB/s of a restore's copy (simulate --restore-rate)")
    parser.add_argument("--sweep-suspend-idle", default="", help="idle timeouts of pooled+suspend to sweep, like 30s,1m,2m,5m")
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
        if options.gpus:  # another inventory than the scenario's
            args[args.index("--gpus") + 1] = options.gpus
        for flag in ("requests", "checkpoint_rate", "restore_rate"):
            if getattr(options, flag):
                args += ["--" + flag.replace("_", "-"), getattr(options, flag)]
        if options.sweep_suspend_idle:
            print(sweep(title, args, options.sweep_suspend_idle.split(",")) + "\n", flush=True)
            continue
        data, wall = run(args)
        print(markdown(title, args, data, wall) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
