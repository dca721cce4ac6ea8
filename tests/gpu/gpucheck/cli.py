"""Command line and runner: pick the checks, run each in its own process under a deadline,
print the table, write ``results.json`` / ``results.md`` / ``checks.log`` into ``--out``.

Exit status: 0 when nothing failed (skips are fine), 1 when a check failed, 2 for a usage
error or, with ``--require-gpu``, when there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import GROUPS
from .checks import Context, Options, all_check_names, registry
from .probe import Probe, probe_all
from .report import Result, Status, format_table, write_outputs

DEFAULT_BUDGET = 400.0  # seconds for all checks: with installs (≈ 30 s) the call stays under 8 minutes
EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A bad command line; the message is one line naming the accepted forms."""


def _names(values: Sequence[str] | None) -> list[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]`` with groups expanded and names checked."""
    names: list[str] = []
    for value in values or []:
        for raw in value.split(","):
            name = raw.strip().lower()
            if not name:
                continue
            if name in GROUPS:
                names.extend(GROUPS[name])
            elif name in all_check_names():
                names.append(name)
            else:
                accepted = ", ".join([*all_check_names(), *GROUPS])
                raise UsageError(f"unknown check {raw.strip()!r}: expected names from {accepted} (comma-separated)")
    return names


def select(only: Sequence[str] | None, skip: Sequence[str] | None) -> list[str]:
    """The checks to run, in run order: ``--only`` (default all) minus ``--skip``."""
    wanted = set(_names(only)) if only else set(all_check_names())
    dropped = set(_names(skip))
    chosen = [name for name in all_check_names() if name in wanted and name not in dropped]
    if not chosen:
        raise UsageError("no check left to run after --only/--skip")
    return chosen


def parse_slice(text: str) -> int:
    from jupyter_gpupool.errors import InvalidInput
    from jupyter_gpupool.units import parse_size

    try:
        value = parse_size(text)
    except InvalidInput as exc:
        raise UsageError(f"--slice: {exc}") from None
    if value < 1024**3:
        raise UsageError(
            f"--slice {text!r} is below 1 GiB: the checks allocate hundreds of MiB inside it; expected e.g. 4GiB"
        )
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tests/gpu/run_all.sh",
        description="Run jupyter-gpupool's GPU-only checks end to end and print a table.",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="CHECKS",
        help="run only these checks (comma-separated; 'slices' means all three)",
    )
    parser.add_argument("--skip", action="append", metavar="CHECKS", help="do not run these checks (comma-separated)")
    parser.add_argument(
        "--out",
        metavar="DIR",
        default=os.environ.get("OUT") or None,
        help="write results.json, results.md and checks.log here (default: $OUT when set)",
    )
    parser.add_argument(
        "--slice",
        default="4GiB",
        metavar="SIZE",
        help="slice size for the slice, watchdog and MPS checks (default 4GiB)",
    )
    parser.add_argument(
        "--require-gpu",
        action="store_true",
        help="exit 2 when no NVIDIA GPU is present (instead of skipping everything)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET,
        metavar="SECONDS",
        help=f"time for all checks together (default {DEFAULT_BUDGET:.0f})",
    )
    parser.add_argument(
        "--ckpt-gib", type=float, default=8.0, metavar="GIB", help="GiB of tensors the suspend check parks (default 8)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="repeats per side in the overhead check (default 5)")
    parser.add_argument(
        "--watchdog-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="watchdog poll interval configured for the watchdog check (default 2)",
    )
    parser.add_argument("--list", action="store_true", help="list the checks and what each needs, then exit")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result-file", help=argparse.SUPPRESS)
    parser.add_argument("--options-json", help=argparse.SUPPRESS)
    return parser


def options_from(args: argparse.Namespace) -> Options:
    if args.budget <= 0:
        raise UsageError(f"--budget must be a positive number of seconds, got {args.budget}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    if not 0.1 <= args.ckpt_gib <= 64:
        raise UsageError(f"--ckpt-gib must be between 0.1 and 64, got {args.ckpt_gib}")
    if not 0.1 <= args.watchdog_interval <= 30:
        raise UsageError(f"--watchdog-interval must be between 0.1 and 30 seconds, got {args.watchdog_interval}")
    return Options(
        slice_bytes=parse_slice(args.slice),
        ckpt_gib=args.ckpt_gib,
        repeats=args.repeats,
        watchdog_interval=args.watchdog_interval,
        out_dir=args.out,
    )


# --- one check, in a process of its own ------------------------------------------------------------


def run_child(name: str, result_file: str, options_json: str) -> int:
    """Run one check in this process and write its Result as JSON (never raises)."""
    start = time.monotonic()
    options = Options.from_json(json.loads(options_json))
    probe = probe_all()
    spec = registry()[name]
    ctx = Context.make(name, options, probe)
    try:
        result = spec.run(ctx)
    except Exception as exc:  # noqa: BLE001 - a check's crash is its failure, not the runner's
        first = str(exc).splitlines()[0] if str(exc) else ""
        result = Result.fail(name, f"{type(exc).__name__}: {first}"[:300], traceback=traceback.format_exc())
    result.check = name
    result.seconds = round(time.monotonic() - start, 1)
    if ctx.notes:
        result.data.setdefault("notes", ctx.notes)
    Path(result_file).write_text(json.dumps(result.to_json(), default=str))
    return 0


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_isolated(name: str, options: Options, timeout: float, log_path: Path | None) -> Result:
    """Run check ``name`` in a child process; a crash or overrun becomes a failed Result."""
    from .harness import reap_registered

    scratch = Path(tempfile.mkdtemp(prefix=f"gpucheck-{name}-"))
    result_file = scratch / "result.json"
    pidfile = scratch / "pids.jsonl"
    env = {
        **os.environ,
        "GPUCHECK_PIDFILE": str(pidfile),
        "GPUCHECK_WORKDIR": str(scratch / "work"),
        "PYTHONUNBUFFERED": "1",
    }
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    repo_root = str(Path(__file__).resolve().parents[3])
    if repo_root not in paths:  # the kernels the check starts must import jupyter_gpupool too
        env["PYTHONPATH"] = os.pathsep.join([repo_root, *paths])
    argv = [
        sys.executable,
        "-m",
        "gpucheck",
        "--child",
        name,
        "--result-file",
        str(result_file),
        "--options-json",
        json.dumps(options.to_json()),
    ]
    start = time.monotonic()
    proc = subprocess.Popen(argv, env=env, cwd=str(Path(__file__).resolve().parents[1]), start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    cut_off = timed_out or not result_file.exists()
    cleaned = reap_registered(str(pidfile), log=lambda m: print(f"[{name}] {m}", flush=True), run_commands=cut_off)
    elapsed = round(time.monotonic() - start, 1)
    if log_path is not None:
        _append_logs(log_path, name, scratch / "work")
    if timed_out:
        result = Result.fail(name, f"did not finish within {timeout:.0f} s; stopped it", cleanup=cleaned)
    elif result_file.exists():
        result = Result.from_json(json.loads(result_file.read_text()))
    else:
        result = Result.fail(name, f"check process exited with code {proc.returncode} and no result")
    if cleaned and not timed_out:
        result.data["left_behind"] = cleaned
    result.seconds = elapsed
    if not os.environ.get("GPUCHECK_KEEP"):  # the logs are in checks.log when --out is given
        shutil.rmtree(scratch, ignore_errors=True)
    return result


def _append_logs(log_path: Path, name: str, workdir: Path) -> None:
    """Copy the logs a check left in its work folder (server logs) into one file."""
    logs = sorted(workdir.rglob("*.log")) if workdir.is_dir() else []
    if not logs:
        return
    with open(log_path, "a", encoding="utf-8") as out:
        for path in logs:
            lines = path.read_text(errors="replace").splitlines()
            out.write(
                f"===== {name}: {path.relative_to(workdir)} (last {min(len(lines), 300)} of {len(lines)} lines)\n"
            )
            out.write("\n".join(lines[-300:]) + "\n")


# --- the whole run ---------------------------------------------------------------------------------


def _commit() -> dict[str, str]:
    """The tree's commit, marked when the tree has changes not committed (the results are of those)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", *args],
                capture_output=True,
                text=True,
                timeout=5,
                cwd=Path(__file__).resolve().parents[3],
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return {}
    changed = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit + (" with uncommitted changes" if changed else "")}


def run_meta(probe: Probe, args: argparse.Namespace, selected: list[str]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": f"{probe.python} ({platform.python_version()})",
        "gpu": probe.gpu_reason or "present",
        "driver": probe.driver or "none",
        "checks": ",".join(selected),
        "command": "tests/gpu/run_all.sh " + " ".join(a for a in sys.argv[1:]),
    }
    if probe.gpu:
        from .probe import nvidia_smi_query

        try:
            meta["gpus"] = "; ".join(" ".join(row) for row in nvidia_smi_query("index,name,memory.total"))
        except Exception as exc:  # noqa: BLE001
            meta["gpus"] = f"nvidia-smi failed: {exc}"
    meta.update(_commit())
    versions = {k: v for k, v in probe.frameworks.items() if v}
    if versions:
        meta["frameworks"] = ", ".join(f"{k} {v}" for k, v in versions.items())
    return meta


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child, args.result_file, args.options_json)
    try:
        selected = select(args.only, args.skip)
        options = options_from(args)
    except UsageError as exc:
        print(f"run_all.sh: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    specs = registry()
    probe = probe_all()
    if args.list:
        for name in all_check_names():
            reason = specs[name].requires(probe, options)
            print(f"{name:14} {specs[name].title} -- {'ready' if reason is None else 'would skip: ' + reason}")
        return EXIT_OK

    log_path: Path | None = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        log_path = Path(args.out) / "checks.log"
        log_path.write_text("")
    if probe.gpu and probe.nvidia_smi:
        from .checks.settings import read_settings

        try:
            options.settings_before = read_settings()
        except Exception as exc:  # noqa: BLE001
            options.settings_before = {"error": str(exc)}

    started = time.monotonic()
    results: list[Result] = []
    for name in selected:
        spec = specs[name]
        reason = spec.requires(probe, options)
        if reason:
            results.append(Result.skip(name, reason))
            continue
        left = args.budget - (time.monotonic() - started)
        if left < spec.min_seconds:
            results.append(
                Result.skip(
                    name,
                    f"not started: {max(0, left):.0f} s of the {args.budget:.0f} s budget left, it needs {spec.min_seconds:.0f} s",
                )
            )
            continue
        print(f"== {name}: {spec.title} (up to {min(spec.timeout, left):.0f} s)", flush=True)
        if name == "settings":  # reads the snapshot taken above: runs here, it is quick
            ctx = Context.make(name, options, probe)
            try:
                result = spec.run(ctx)
            except Exception as exc:  # noqa: BLE001
                result = Result.fail(name, f"{type(exc).__name__}: {exc}")
            finally:
                shutil.rmtree(ctx.workdir, ignore_errors=True)
        else:
            result = run_isolated(name, options, min(spec.timeout, left), log_path)
        print(f"== {name}: {result.status} {result.number} {result.detail}", flush=True)
        results.append(result)

    meta = run_meta(probe, args, selected)
    meta["seconds"] = round(time.monotonic() - started, 1)
    print()
    print(format_table(results))
    if args.out:
        write_outputs(args.out, results, meta)
        print(f"\nwrote {args.out}/results.json, results.md" + (", checks.log" if log_path else ""))
    if args.require_gpu and not probe.gpu:
        print(f"run_all.sh: error: --require-gpu: {probe.gpu_reason}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_FAIL if any(r.status is Status.FAIL for r in results) else EXIT_OK
