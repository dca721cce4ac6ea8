"""`jupyter gpupool broker --socket` as systemd runs it, for tests of what finds a broker by the
host's discovery file (a real broker process on a Unix socket)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def socket_broker(
    env: dict[str, str], log_path: Path, *, open_to_all: bool = False
) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A broker started with ``env`` (its ``GPUPOOL_BROKER_FILE`` names the discovery file it
    writes), logging to ``log_path``; (the process, its socket) once it listens and the file is
    there; stopped with SIGTERM (SIGKILL after 20 s) afterwards. Its socket is in a short-lived
    folder of its own under the system's temporary folder (a socket's path is at most 107 bytes);
    ``open_to_all``: every uid can reach it, as ``/run/jupyter-gpupool``."""
    discovery = Path(env["GPUPOOL_BROKER_FILE"])
    run_dir = Path(tempfile.mkdtemp(prefix="gpupool-run-"))
    if open_to_all:
        run_dir.chmod(0o755)
    sock = run_dir / "broker.sock"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_gpupool.broker", f"--socket={sock}", "--hub=off"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (discovery.exists() and sock.exists()):
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        yield proc, sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(run_dir, ignore_errors=True)
