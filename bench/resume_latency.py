#!/usr/bin/env python
"""How long a cell sent to a suspended kernel takes to print, and a suspend to start, on a real server.

A real ``jupyter server`` with the gpupool extension at its **default settings** (``tick_interval``
5 s), a real ipykernel kernel, a simulated pool (``GPUPOOL_SIMULATE=1x16GiB``) whose checkpointer
copies nothing: what is measured is the protocol, not a copy. Each try:

1. ``POST /api/gpupool/kernels/{id}/suspend``; time until the pool shows the lease ``suspended``
   (the server carried out and confirmed the suspend): **suspend latency**;
2. send ``print(x)`` over the kernel's channels; time until its output arrives: **cell-to-output
   latency** (the cell asks to resume, the server restores, the cell runs).

``--via broker`` runs the same with the pool behind a broker process on a Unix socket
(``GPUPOOL_URL=unix://...``). Medians of ``--tries`` (default 5), after one warm-up try.

``python bench/resume_latency.py [--via direct|broker|both] [--tries 5] [--json]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(predicate: Any, timeout: float, what: str, interval: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise SystemExit(f"resume_latency: timed out after {timeout:.0f} s waiting for {what}")


class _Process:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "a")  # noqa: SIM115 -- closed in stop()
        self.proc = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(log.parent))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


class _Server(_Process):
    """``jupyter server`` with the extension's defaults, reached with its own token."""

    def __init__(self, folder: Path, env: dict[str, str]) -> None:
        self.port, self.token, self.folder = _free_port(), "bench-token", folder
        env = {**env, "JUPYTER_RUNTIME_DIR": str(folder / "runtime"), "JUPYTER_CONFIG_DIR": str(folder / "config")}
        super().__init__(
            [sys.executable, "-m", "jupyter", "server", f"--port={self.port}", "--no-browser", "--allow-root",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={folder}",
             "--ServerApp.jpserver_extensions={'jupyter_server_terminals': False}"],
            env, folder / "server.log",
        )  # fmt: skip
        _wait(lambda: self._up(), 60, "the server to start", 0.2)

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise SystemExit(f"resume_latency: the server exited: {self.log_path.read_text()[-2000:]}")
        try:
            self.call("GET", "api/status")
            return True
        except OSError:
            return False

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/{path}", data=data, method=method, headers={"Authorization": f"token {self.token}"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
        return json.loads(raw) if raw else None


def _client(server: _Server, kernel_id: str) -> Any:
    from jupyter_client import BlockingKernelClient

    connection = server.folder / "runtime" / f"kernel-{kernel_id}.json"
    _wait(connection.exists, 60, "the kernel to launch", 0.1)
    client = BlockingKernelClient(connection_file=str(connection))
    client.load_connection_file()
    client.start_channels()
    deadline = time.monotonic() + 60
    while True:  # without its manager, a client sees a kernel still starting as "died": ask again
        try:
            client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
            return client
        except RuntimeError:
            if time.monotonic() > deadline:
                raise SystemExit("resume_latency: the kernel did not answer within 60 s") from None
            time.sleep(0.5)


def _run(client: Any, code: str, timeout: float = 120) -> tuple[str, float]:
    """Run ``code``; its stdout and the seconds from sending it to its first output."""
    first: list[float] = []
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            if not first:
                first.append(time.perf_counter())
            out.append(msg["content"]["text"])

    started = time.perf_counter()
    reply = client.execute_interactive(code, timeout=timeout, output_hook=hook)
    if reply["content"]["status"] != "ok":
        raise SystemExit(f"resume_latency: the cell failed: {reply['content']}")
    return "".join(out), (first[0] if first else time.perf_counter()) - started


def _state(server: _Server, kernel_id: str) -> str:
    return str(server.call("GET", f"api/gpupool/kernels/{kernel_id}")["state"])


def measure(via: str, tries: int) -> dict[str, Any]:
    """One server (and broker), one kernel, ``tries`` + 1 suspend/cell rounds (the first a warm-up)."""
    folder = Path(tempfile.mkdtemp(prefix=f"gpupool-resume-{via}-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["GPUPOOL_BROKER_FILE"] = str(folder / "broker.json")  # a broker started here is found by nothing else
    broker: _Process | None = None
    if via == "broker":
        sock = folder / "broker.sock"
        broker = _Process(
            [sys.executable, "-m", "jupyter_gpupool.broker", f"--db={folder / 'broker.sqlite'}", f"--socket={sock}", "--port=0",
             "--hub=off"],
            {**env, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DEFAULT_MEMORY": "8GiB"}, folder / "broker.log",
        )  # fmt: skip
        _wait(sock.exists, 60, "the broker's socket", 0.1)
        env["GPUPOOL_URL"] = f"unix://{sock}"
    else:
        env.update({"GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(folder / "pool.sqlite"), "GPUPOOL_DEFAULT_MEMORY": "8GiB"})
    (folder / "server").mkdir()
    server = _Server(folder / "server", env)
    suspends: list[float] = []
    cells: list[float] = []
    try:
        kernel_id = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        client = _client(server, kernel_id)
        try:
            _run(client, "x = 42")
            _wait(lambda: _state(server, kernel_id) == "granted", 30, "the grant")
            for attempt in range(tries + 1):
                started = time.perf_counter()
                server.call("POST", f"api/gpupool/kernels/{kernel_id}/suspend", {})
                _wait(lambda: _state(server, kernel_id) == "suspended", 60, "the suspend", 0.005)
                suspended = time.perf_counter() - started
                out, latency = _run(client, "print(x)")
                if out.strip().splitlines()[-1:] != ["42"]:
                    raise SystemExit(f"resume_latency: the cell printed {out!r}, not 42")
                if attempt:  # the first round warms imports and connections
                    suspends.append(suspended)
                    cells.append(latency)
                time.sleep(0.5)
        finally:
            client.stop_channels()
    finally:
        server.stop()
        if broker is not None:
            broker.stop()
    return {
        "via": via,
        "tries": tries,
        "suspend_s": {"median": round(statistics.median(suspends), 3), "max": round(max(suspends), 3), "all": [round(v, 3) for v in suspends]},
        "cell_to_output_s": {"median": round(statistics.median(cells), 3), "max": round(max(cells), 3), "all": [round(v, 3) for v in cells]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--via", choices=("direct", "broker", "both"), default="both", help="the pool file directly, a broker, or both")
    parser.add_argument("--tries", type=int, default=5, help="measured rounds per setting (after one warm-up)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if not 1 <= args.tries <= 100:
        parser.error(f"--tries {args.tries}: give 1 to 100")
    runs = [measure(via, args.tries) for via in (("direct", "broker") if args.via == "both" else (args.via,))]
    result = {"runs": runs, "machine": {"python": platform.python_version(), "cpus": os.cpu_count()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print("| via | suspend: median (max) | cell to output: median (max) | tries |")
    print("| --- | ---: | ---: | ---: |")
    for run in runs:
        s, c = run["suspend_s"], run["cell_to_output_s"]
        print(f"| {run['via']} | {s['median']:.3f} s ({s['max']:.3f}) | {c['median']:.3f} s ({c['max']:.3f}) | {run['tries']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
