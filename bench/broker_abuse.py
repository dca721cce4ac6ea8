#!/usr/bin/env python
"""A victim's latency on a broker that one local user attacks, against the load one user may legitimately put on it.

A real broker process on a Unix socket (``python -m jupyter_gpupool.broker --socket``, started with
the 1,024 open files systemd gives a service by default, soft and hard). The attacker runs as
``nobody``, the victim as ``daemon`` (``tests/abuse_clients.py``: ``whoami`` and a lease request,
released at once, one after another). Conditions, each for ``--seconds`` of victim requests:

- ``idle broker``: the victim alone;
- ``allowed load``: 64 change polls held open by one user (the per-user long-poll bound);
- ``idle connections``: 1,100 connections that send nothing;
- ``declared bodies``: 10 connections each declaring 95 MiB of body and sending it, each declaring
  another as soon as it is refused, for the whole condition;
- ``chunked bodies``: 10 connections each streaming 8 MiB of chunked body, likewise repeated;
- ``refused reports``: 8 connections at a time looping a "suspend done" report for a lease that
  is not being suspended;
- ``forged suspend reports``: the same loop for the attacker's own lease while its suspend is
  under way and its process still holds the memory on the GPU (the simulated driver lists it).

Per condition: the victim's p50 and p99, p99 over the allowed load's p99, its statuses, the
broker's RSS growth, its log growth and what the attacker was answered. Medians over ``--runs``.
Needs root (to run clients as other users), ``/usr/bin/python3`` and ``prlimit``.

``python bench/broker_abuse.py [--runs 3] [--seconds 6] [--only "refused reports,..."] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SYSTEM_PYTHON = "/usr/bin/python3"

CONDITIONS: list[tuple[str, list[str]]] = [
    ("idle broker", []),
    ("allowed load", ["longpolls", "--count", "64"]),
    ("idle connections", ["idle", "--count", "1100"]),
    ("declared bodies", ["bodies", "--count", "10", "--repeat"]),
    ("chunked bodies", ["chunked", "--count", "10", "--size", str(8 << 20), "--repeat"]),
    ("refused reports", ["reports", "--count", "8"]),
    ("forged suspend reports", ["reports", "--count", "8", "--while-held"]),
]

#: What the lease of ``forged suspend reports`` holds on the GPU while its suspend is under way.
HELD = 2 << 30


class Broker:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.socket_path = str(folder / "broker.sock")
        self.log_path = folder / "broker.log"
        config = folder / "jupyter_gpupool_config.py"
        config.write_text('c.PoolPolicy.default_memory = "1GiB"\nc.Broker.run_watchdog = False\n')
        env = {**os.environ, "GPUPOOL_SIMULATE": "1x16GiB"}
        for key in ("GPUPOOL_URL", "GPUPOOL_DB", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_SERVICE_URL"):
            env.pop(key, None)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["GPUPOOL_BROKER_FILE"] = str(folder / "gpupool-broker.json")  # never /etc/jupyter's
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [
                    shutil.which("prlimit") or "prlimit", "--nofile=1024:1024", sys.executable, "-m",
                    "jupyter_gpupool.broker", f"--db={folder / 'pool.sqlite'}", "--port=0",
                    f"--socket={self.socket_path}", "--hub=off", f"--config={config}",
                ],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(folder),
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(self.socket_path)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the broker did not start:\n" + self.log_path.read_text()[-3000:]) from None
                time.sleep(0.1)

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def client(folder: Path, user: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [SYSTEM_PYTHON, str(folder / "abuse_clients.py"), *args],
        user=user, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(folder),
    )  # fmt: skip


def result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise SystemExit(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def hold_memory(folder: Path, lease: dict[str, Any]) -> subprocess.Popen[bytes]:
    """A process of the attacker's that is the lease's kernel, holding :data:`HELD` on its GPU (as
    the simulated driver lists it: a file in the pool's usage folder)."""
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", "import time; time.sleep(600)"], user="nobody", cwd=str(folder),
        env={"PATH": "/usr/bin:/bin", "GPUPOOL_LEASE_ID": lease["id"]},
    )  # fmt: skip
    usage = folder / "pool.sqlite.usage"
    usage.mkdir(exist_ok=True)
    (usage / f"{proc.pid}.json").write_text(json.dumps({lease["devices"][0]: HELD}))
    return proc


def one(broker: Broker, folder: Path, attack: list[str], seconds: float) -> dict[str, Any]:
    target = f"unix:{broker.socket_path}"
    rss0, log0 = broker.rss(), broker.log_size()
    peak = [rss0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], broker.rss())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    attacker = holder = None
    if attack:
        extra = ["--hold", str(seconds + 1.5)] if attack[0] != "reports" else ["--seconds", str(seconds + 1.5)]
        if attack[0] == "reports":
            lease = result(client(folder, "nobody", "lease", "--target", target))["lease"]
            extra += ["--lease", lease["id"]]
            if "--while-held" in attack:
                attack = [a for a in attack if a != "--while-held"]
                holder = hold_memory(folder, lease)
                suspended = result(client(folder, "nobody", "suspend", "--target", target, "--lease", lease["id"]))
                if suspended["status"] != 200:
                    raise SystemExit(f"the attacker's lease could not be suspended: {suspended}")
        attacker = client(folder, "nobody", attack[0], "--target", target, *attack[1:], *extra)
        time.sleep(1.0)
    victim = result(client(folder, "daemon", "victim", "--target", target, "--seconds", str(seconds)))
    seen = result(attacker) if attacker is not None else {}
    if holder is not None:
        holder.kill()
        holder.wait()
    done.set()
    sampler.join(5)
    return {"victim": victim, "attack": seen, "rss_growth": peak[0] - rss0, "log_growth": broker.log_size() - log0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated conditions to run (the allowed load always runs)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the attacker and the victim run as other Unix users (nobody, daemon)")
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    conditions = [(n, a) for n, a in CONDITIONS if not only or n in only or n == "allowed load"]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in conditions}
    for _ in range(args.runs):
        folder = Path(tempfile.mkdtemp(prefix="gpupool-abuse-bench-", dir="/tmp"))
        os.chmod(folder, 0o755)
        shutil.copy(REPO / "tests" / "abuse_clients.py", folder / "abuse_clients.py")
        broker = Broker(folder)
        try:
            for name, attack in conditions:
                runs[name].append(one(broker, folder, attack, args.seconds))
                time.sleep(11)  # what the attack left open idles out (idle_connection_timeout, 10 s)
        finally:
            broker.stop()
            shutil.rmtree(folder, ignore_errors=True)
    med = statistics.median
    allowed_p99 = med(r["victim"]["p99"] for r in runs["allowed load"])
    rows = []
    for name, _ in conditions:
        rs = runs[name]
        p99 = med(r["victim"]["p99"] for r in rs)
        statuses: dict[str, int] = {}
        answers: dict[str, int] = {}
        for r in rs:
            for k, v in r["victim"]["statuses"].items():
                statuses[k] = statuses.get(k, 0) + v
            for k, v in r["attack"].get("answers", {}).items():
                answers[k] = answers.get(k, 0) + v
        rows.append({
            "condition": name,
            "victim_p50_ms": round(1000 * med(r["victim"]["p50"] for r in rs), 1),
            "victim_p99_ms": round(1000 * p99, 1),
            "p99_over_allowed": round(p99 / allowed_p99, 2) if allowed_p99 else None,
            "victim_statuses": statuses,
            "rss_growth_mib": round(med(r["rss_growth"] for r in rs) / 2**20, 1),
            "log_growth_kib": round(med(r["log_growth"] for r in rs) / 1024, 1),
            "attacker_answers": answers,
        })  # fmt: skip
    meta = {"runs": args.runs, "seconds": args.seconds, "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return
    print(f"runs={args.runs}, {args.seconds:g} s of victim requests per condition, {os.cpu_count()} CPUs")
    print("| condition | victim p50 | victim p99 | p99 / allowed load's | victim answers | broker RSS | broker log | attacker was answered |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(row["attacker_answers"].items())) or "-"
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(row["victim_statuses"].items()))
        print(
            f"| {row['condition']} | {row['victim_p50_ms']} ms | {row['victim_p99_ms']} ms | {row['p99_over_allowed']}× | "
            f"{statuses} | +{row['rss_growth_mib']} MiB | +{row['log_growth_kib']} KiB | {answers} |"
        )


if __name__ == "__main__":
    main()
