"""Tried as a new user and as an admin would: a real ``jupyter server`` process on a host with no
GPU and no simulated pool (kernels run CPU-only, the API says "no GPU pool"), and one whose pool
file is corrupt; both stop cleanly on SIGTERM and on Ctrl-C Ctrl-C.

On the code before these tests the extension failed to load (kernels got every GPU, unpooled)
and the server then ignored SIGTERM and Ctrl-C; only SIGKILL stopped it.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient
from server_process import free_port

pytestmark = [pytest.mark.slow]

TOKEN = "fail-closed-token"
NO_GPU_LINE = "no NVIDIA GPU found and no simulated pool configured: kernels run CPU-only"
#: Seconds the server may take to exit after SIGTERM or a second Ctrl-C.
STOP_LIMIT = 15.0


def _nvml_works() -> bool:
    try:
        from jupyter_gpupool.devices.nvml import NvmlBackend

        NvmlBackend().close()
    except Exception:  # noqa: BLE001 - any failure means no usable GPU here
        return False
    return True


class ServerProcess:
    """``python -m jupyter_server`` with the gpupool extension, its log in a file."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.runtime = tmp / "runtime"
        self.log_path = tmp / "server.log"
        config_dir = tmp / "config"
        config_dir.mkdir()
        (config_dir / "jupyter_server_config.json").write_text(
            json.dumps({"ServerApp": {"jpserver_extensions": {"jupyter_gpupool": True, "jupyter_server_terminals": False}}})
        )
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
        full_env.update(JUPYTER_RUNTIME_DIR=str(self.runtime), JUPYTER_CONFIG_DIR=str(config_dir), GPUPOOL_USER="alice")
        full_env.update(env)
        full_env.pop("JUPYTER_DEFAULT_PROVISIONER_NAME", None)
        self.tmp, self.env = tmp, full_env
        self.log = self.log_path.open("w")
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter_server", "--no-browser", "--allow-root", f"--port={self.port}",
             "--ServerApp.port_retries=0", f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={self.tmp}"],
            env=self.env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=self.tmp,
        )  # fmt: skip

    def request(self, path: str, method: str = "GET", body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        req.add_header("Authorization", f"token {TOKEN}")
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                text = response.read()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def wait_up(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        respawned = 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and self.text().count("already in use") > respawned and respawned < 3:
                respawned += 1
                # Another test's process (a kernel's ZeroMQ socket) took the free port first: another port.
                self.port = free_port()
                self._spawn()
            assert self.proc.poll() is None, self.text()
            try:
                if self.request("/api/status")[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass  # not listening yet, or the port answers for someone else (ZeroMQ's greeting)
            time.sleep(0.3)
        raise AssertionError(f"the server did not come up:\n{self.text()}")

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop_within(self, signals: list[signal.Signals], limit: float = STOP_LIMIT) -> float:
        """Send ``signals`` (0.5 s apart); return the seconds until the process exited."""
        started = time.monotonic()
        for sig in signals:
            self.proc.send_signal(sig)
            time.sleep(0.5)
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the server ignored {[s.name for s in signals]} for {limit:g} s:\n{self.text()[-3000:]}") from None
        return time.monotonic() - started

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def server_factory(tmp_path: Path):
    servers: list[ServerProcess] = []

    def make(name: str, env: dict[str, str]) -> ServerProcess:
        where = tmp_path / name
        where.mkdir()
        server = ServerProcess(where, env)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.kill()


def run_in_kernel(server: ServerProcess, kernel_id: str, code: str, timeout: float = 60.0) -> str:
    """stdout of ``code`` run in the server's kernel (once it is idle), through its connection file."""
    connection = server.runtime / f"kernel-{kernel_id}.json"
    deadline = time.monotonic() + timeout
    while not connection.exists() or connection.stat().st_size == 0:  # created first, written a moment later
        assert time.monotonic() < deadline, f"no connection file for kernel {kernel_id}:\n{server.text()[-3000:]}"
        time.sleep(0.2)
    client = BlockingKernelClient(connection_file=str(connection))
    client.load_connection_file()
    client.start_channels()
    try:
        while True:  # the heartbeat needs a moment after the channels start
            try:
                client.wait_for_ready(timeout=10)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, f"kernel {kernel_id} never answered:\n{server.text()[-3000:]}"
                time.sleep(0.5)
        out: list[str] = []
        reply = client.execute_interactive(
            code, timeout=timeout, output_hook=lambda msg: out.append(msg["content"].get("text", "")) if msg["msg_type"] == "stream" else None
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)
    finally:
        client.stop_channels()


@pytest.mark.skipif(_nvml_works(), reason="this host has an NVIDIA GPU: the no-GPU case cannot be tried here")
def test_new_user_without_gpu_gets_cpu_only_kernels_and_ctrl_c_stops_the_server(tmp_path: Path, server_factory) -> None:
    """`jupyter server` on a host with no GPU and no GPUPOOL_SIMULATE: the pool API says so, the
    log says so once and quietly (no traceback), a kernel runs with CUDA_VISIBLE_DEVICES="", and
    Ctrl-C Ctrl-C stops the server."""
    server = server_factory("nogpu", {"GPUPOOL_DB": str(tmp_path / "pool.sqlite")})
    server.wait_up()
    code, pool = server.request("/api/gpupool/pool")
    assert code == 200, pool
    assert pool["state"] == "unavailable" and pool["no_gpu"] is True and "no NVIDIA driver" in pool["reason"], pool
    code, model = server.request("/api/kernels", "POST", {"name": "python3"})
    assert code == 201, model
    kernel_id = model["id"]
    seen = run_in_kernel(server, kernel_id, 'import os; print(repr(os.environ["CUDA_VISIBLE_DEVICES"]))')
    assert seen.strip() == "''", seen
    code, status = server.request(f"/api/gpupool/kernels/{kernel_id}")
    assert code == 200 and status["state"] == "unavailable" and "no NVIDIA driver" in status["reason"], status
    log = server.text()
    assert log.count(NO_GPU_LINE) == 1, log
    assert "Traceback" not in log and "failed loading" not in log, log
    took = server.stop_within([signal.SIGINT, signal.SIGINT])
    assert server.proc.returncode is not None and took < STOP_LIMIT


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT twice"])
def test_a_server_whose_pool_file_is_corrupt_serves_degraded_and_stops(tmp_path: Path, server_factory, stop: str) -> None:
    """A corrupt pool file: the server serves with the pool ``unavailable`` (the reason names the
    file), kernels run CPU-only, and SIGTERM or Ctrl-C Ctrl-C stops it within seconds."""
    db = tmp_path / "pool.sqlite"
    db.write_bytes(b"garbage, not SQLite\n" * 100)
    server = server_factory("corrupt", {"GPUPOOL_DB": str(db), "GPUPOOL_SIMULATE": "1x16GiB"})
    server.wait_up()
    code, pool = server.request("/api/gpupool/pool")
    assert code == 200 and pool["state"] == "unavailable" and pool["no_gpu"] is False, pool
    code, model = server.request("/api/kernels", "POST", {"name": "python3"})
    assert code == 201, model
    seen = run_in_kernel(server, model["id"], 'import os; print(repr(os.environ.get("CUDA_VISIBLE_DEVICES")))')
    assert seen.strip() == "''", seen
    assert "Traceback" not in server.text()
    signals = [signal.SIGTERM] if stop == "SIGTERM" else [signal.SIGINT, signal.SIGINT]
    server.stop_within(signals)
    assert db.read_bytes().startswith(b"garbage")  # never silently replaced
