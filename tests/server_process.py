"""A real `jupyter server` process for tests, with the gpupool extension and a token of its own."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

#: Where test servers' ports are drawn from: below the kernel's ephemeral range, so no kernel
#: (jupyter_client picks its ports by binding port 0) and no outgoing connection can take one
#: between its choice and the server's bind; only another draw here could, one time in thousands.
TEST_PORTS_FROM = 10000


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free now on 127.0.0.1, drawn outside the ephemeral range (see ``TEST_PORTS_FROM``).
    Drawn with the system's randomness: pytest-randomly seeds ``random`` alike in every worker."""
    draw = random.SystemRandom()
    top = _ephemeral_ports_start() - 1
    for _ in range(200):
        port = draw.randint(TEST_PORTS_FROM, top) if top > TEST_PORTS_FROM else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise AssertionError(f"no free TCP port from {TEST_PORTS_FROM} to {top} in 200 draws")


def wait_for(predicate: Any, timeout: float = 60, what: str = "") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


class Server:
    """`jupyter server` in its own folder under ``tmp``, its environment overridden by ``env``
    (a value of None removes the variable), reached with its own token; ``start_timeout``: seconds
    it may take to answer (over a minute on a machine loaded ten times over its cores)."""

    def __init__(
        self, tmp: Path, user: str, env: dict[str, str | None], args: tuple[str, ...] = (), start_timeout: float = 180
    ) -> None:
        self.port = free_port()
        self.token = f"{user}-server-token"
        self.root = tmp / user
        self.root.mkdir(exist_ok=True)
        environ = {**os.environ, "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"), "JUPYTER_CONFIG_DIR": str(self.root / "config")}
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        self.log_path = self.root / "server.log"
        self.log = open(self.log_path, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "server", f"--port={self.port}", "--no-browser", "--allow-root",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             "--ServerApp.jpserver_extensions={'jupyter_server_terminals': False}", *args],
            env=environ, stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            try:
                self.call("GET", "api/status")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None:
                    break
                time.sleep(0.3)
        raise AssertionError(f"{user}'s server did not start: {self.log_path.read_text()[-2000:]}")

    def call(self, method: str, path: str, body: Any = None, timeout: float = 30) -> Any:
        """A request with the server's token; its JSON answer. ``timeout``: seconds for the answer
        (starting a kernel answers once the kernel runs: give a loaded machine more)."""
        data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/{path}", data=data, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM a server the tests started; SIGKILL it if it has not exited within 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
