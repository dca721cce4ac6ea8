"""A real jupyter_server in a private Jupyter environment, and kernels driven through it.

The server runs as a subprocess with its own config, data and runtime directories and its own
pool database; kernels are started with ``POST /api/kernels`` (so the provisioner the server
picks is the one under test) and driven over ZMQ with the connection file the server wrote.
Every process started here is written to a pid registry, so the runner can clean up after a
check that ran out of time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
GPU_DIR = Path(__file__).resolve().parents[1]
MARKER = "@@GPUCHECK@@"
# Variables of the calling environment that would point the server at another pool or GPU set.
SCRUBBED_ENV = (
    "GPUPOOL_SIMULATE",
    "GPUPOOL_DB",
    "GPUPOOL_DEFAULT_MEMORY",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "JUPYTER_DEFAULT_PROVISIONER_NAME",
    "JUPYTER_CONFIG_PATH",
    "JUPYTER_PATH",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "CUPY_GPU_MEMORY_LIMIT",
    "PYTORCH_CUDA_ALLOC_CONF",
)


class HarnessError(RuntimeError):
    """Something in the harness itself went wrong; the message is one line for the table."""


# --- pid registry -------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the ")" that closes the command name: state (3rd field), ..., starttime (22nd).
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in {"Z", "X"} else fields[19]  # a zombie counts as gone


def register_pid(pid: int, what: str) -> None:
    """Note a process this check started, so the runner can end it if the check is cut off."""
    path = os.environ.get("GPUCHECK_PIDFILE")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"pid": pid, "start": _start_time(pid), "what": what}) + "\n")


def register_cleanup(argv: list[str], env: dict[str, str], what: str) -> None:
    """Note a command the runner must run if the check is cut off (e.g. stopping a daemon)."""
    path = os.environ.get("GPUCHECK_PIDFILE")
    if not path:
        return
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"cmd": argv, "env": env, "what": what}) + "\n")


def reap_registered(pidfile: str, log: Callable[[str], None] = lambda _m: None, run_commands: bool = True) -> list[str]:
    """End what a check left behind: run its cleanup commands (when it was cut off, i.e.
    ``run_commands``), then kill its processes that still run.

    A pid is killed only while its start time still matches, so a reused pid is left alone.
    """
    done: list[str] = []
    try:
        lines = Path(pidfile).read_text().splitlines()
    except OSError:
        return done
    entries = [json.loads(line) for line in lines if line.strip()]
    for entry in entries if run_commands else []:
        if "cmd" in entry:
            try:
                subprocess.run(
                    entry["cmd"],
                    env={**os.environ, **entry.get("env", {})},
                    input="quit\n" if entry["cmd"][-1:] == ["nvidia-cuda-mps-control"] else None,
                    text=True,
                    capture_output=True,
                    timeout=20,
                    check=False,
                )
                done.append(f"ran cleanup for {entry.get('what')}")
            except Exception as exc:  # noqa: BLE001
                log(f"cleanup {entry.get('what')} failed: {exc}")
    for entry in reversed(entries):
        pid = entry.get("pid")
        if not pid or _start_time(pid) is None or _start_time(pid) != entry.get("start"):
            continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and _start_time(pid) == entry.get("start"):
                _reap_zombie(pid)
                time.sleep(0.05)
            if _start_time(pid) != entry.get("start"):
                break
        done.append(f"killed {entry.get('what')} (pid {pid})")
    return done


def _reap_zombie(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


# --- kernels --------------------------------------------------------------------------------------


@dataclass
class ExecResult:
    """What one cell did: its status, text streams, error and the JSON it printed with MARKER."""

    status: str
    stdout: str = ""
    stderr: str = ""
    ename: str = ""
    evalue: str = ""
    traceback: str = ""
    display: str = ""
    data: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    marked_at: float | None = None  # time.monotonic() when the first MARKER payload arrived

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def all_text(self) -> str:
        """Everything the user would see in the cell, tracebacks included, ANSI codes removed."""
        text = f"{self.stdout}\n{self.stderr}\n{self.display}\n{self.ename}\n{self.evalue}\n{self.traceback}"
        return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text)

    def last(self) -> Any:
        """The last MARKER payload of the cell (raises HarnessError naming the error if none)."""
        if not self.data:
            raise HarnessError(f"cell printed no result ({self.ename or self.status}: {self.evalue[:160]})")
        return self.data[-1]

    def brief(self) -> str:
        return f"{self.ename}: {self.evalue}".strip(": ")[:200] if self.ename else self.status


class KernelSession:
    """A client on a kernel the server started (ZMQ, through the server's connection file)."""

    def __init__(self, kernel_id: str, connection_file: str, ready_timeout: float = 60.0) -> None:
        from jupyter_client import BlockingKernelClient

        self.kernel_id = kernel_id
        self.client = BlockingKernelClient(connection_file=connection_file)
        self.client.load_connection_file()
        self.client.start_channels()
        # wait_for_ready gives up ("Kernel died before replying") while the heartbeat has not
        # started yet, which a slow kernel start looks like: ask again until the deadline.
        deadline = time.monotonic() + ready_timeout
        while True:
            try:
                self.client.wait_for_ready(timeout=max(1.0, min(10.0, deadline - time.monotonic())))
                break
            except RuntimeError as exc:
                if time.monotonic() >= deadline:
                    self.client.stop_channels()
                    raise HarnessError(
                        f"kernel {kernel_id[:8]} did not answer within {ready_timeout:.0f} s: {exc}"
                    ) from None
                time.sleep(0.5)
        self.pid: int | None = None
        self.env: dict[str, str] = {}

    def submit(self, code: str) -> str:
        """Send ``code`` for execution and return at once with its message id."""
        return str(self.client.execute(code, allow_stdin=False, stop_on_error=False))

    def collect(self, msg_id: str, timeout: float = 120.0) -> ExecResult:
        """Gather the outputs and reply of a submitted cell; raises HarnessError past ``timeout``."""
        from queue import Empty

        result = ExecResult(status="unknown")
        out: list[str] = []
        err: list[str] = []
        disp: list[str] = []
        start = time.monotonic()
        deadline = start + timeout
        idle = False
        while not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(f"cell did not finish within {timeout:.0f} s")
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 1.0))
            except Empty:
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            content = msg["content"]
            if kind == "stream":
                (out if content.get("name") == "stdout" else err).append(content.get("text", ""))
                if result.marked_at is None and MARKER in content.get("text", ""):
                    result.marked_at = time.monotonic()
            elif kind in {"display_data", "execute_result", "update_display_data"}:
                data = content.get("data", {})
                disp.extend(str(data[mime]) for mime in ("text/plain", "text/markdown", "text/html") if mime in data)
            elif kind == "error":
                result.ename = content.get("ename", "")
                result.evalue = content.get("evalue", "")
                result.traceback = "\n".join(content.get("traceback", []))
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HarnessError(f"no reply to the cell within {timeout:.0f} s")
            try:
                reply = self.client.get_shell_msg(timeout=min(left, 1.0))
            except Empty:
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                break
        result.seconds = time.monotonic() - start
        content = reply.get("content", {})
        result.status = content.get("status", "unknown")
        if result.status == "error" and not result.ename:
            result.ename = content.get("ename", "")
            result.evalue = content.get("evalue", "")
        result.stdout = "".join(out)
        result.stderr = "".join(err)
        result.display = "\n".join(disp)
        for line in result.stdout.splitlines():
            if line.startswith(MARKER):
                result.data.append(json.loads(line[len(MARKER) :]))
        return result

    def run(self, code: str, timeout: float = 120.0) -> ExecResult:
        """Execute ``code`` and wait; errors in the cell are in the result, never raised."""
        return self.collect(self.submit(code), timeout=timeout)

    def value(self, code: str, timeout: float = 120.0) -> Any:
        """Run ``code`` that ends by printing one MARKER payload; return it or raise HarnessError."""
        res = self.run(code, timeout=timeout)
        if not res.ok:
            raise HarnessError(f"cell failed: {res.brief()}")
        return res.last()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_channels()


def emit(expr: str) -> str:
    """Code that prints ``expr`` as a MARKER payload (for use inside kernel code)."""
    return f"print({MARKER!r} + __import__('json').dumps({expr}))"


PRELUDE = f"""import os, sys, json
sys.path.insert(0, {str(GPU_DIR)!r})
_gpucheck_env = {{k: v for k, v in os.environ.items() if k.startswith(("GPUPOOL_", "CUDA_", "XLA_", "CUPY_", "TF_", "PYTORCH_"))}}
print({MARKER!r} + json.dumps({{"pid": os.getpid(), "env": _gpucheck_env}}))
"""


# --- the server ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


STACKS_ON_SIGUSR2 = """import faulthandler, signal, sys
faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
"""


def server_extension_config() -> dict[str, Any]:
    """What the wheel's auto-enable file holds (read from the repository), merged into one dict."""
    config: dict[str, Any] = {}
    folder = REPO_ROOT / "jupyter-config" / "server-config"
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            _merge(config, json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    if not config:
        config = {"ServerApp": {"jpserver_extensions": {"jupyter_gpupool": True}}}
    return config


def _merge(into: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    for key, value in more.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value
    return into


class JupyterServer:
    """A real ``jupyter_server`` with the gpupool extension, in a private Jupyter environment."""

    def __init__(
        self,
        workdir: Path,
        env: dict[str, str] | None = None,
        config: dict[str, Any] | None = None,
        kernelspecs: dict[str, dict[str, Any]] | None = None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.workdir = Path(workdir)
        self.extra_env = dict(env or {})
        self.config = _merge(server_extension_config(), config or {})
        self.kernelspecs = dict(kernelspecs or {})
        self.log = log
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.sessions: dict[str, KernelSession] = {}
        self.log_path = self.workdir / "server.log"

    # paths of the private environment
    @property
    def runtime_dir(self) -> Path:
        return self.workdir / "runtime"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        env.update(
            {
                "JUPYTER_CONFIG_DIR": str(self.workdir / "config"),
                "JUPYTER_DATA_DIR": str(self.workdir / "data"),
                "JUPYTER_RUNTIME_DIR": str(self.runtime_dir),
                "IPYTHONDIR": str(self.workdir / "ipython"),
                "JUPYTER_PLATFORM_DIRS": "1",
                "GPUPOOL_DB": str(self.workdir / "pool.sqlite"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    def _write_environment(self) -> None:
        for sub in ("config", "data/kernels", "runtime", "ipython", "root"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        (self.workdir / "config" / "jupyter_server_config.json").write_text(json.dumps(self.config, indent=1))
        # SIGUSR2 prints every thread's stack into the log (server and kernels): see dump_stacks.
        (self.workdir / "config" / "jupyter_server_config.py").write_text(STACKS_ON_SIGUSR2)
        startup = self.workdir / "ipython" / "profile_default" / "startup"
        startup.mkdir(parents=True, exist_ok=True)
        (startup / "00-gpucheck-stacks.py").write_text(STACKS_ON_SIGUSR2)
        for name, spec in self.kernelspecs.items():
            folder = self.workdir / "data" / "kernels" / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "kernel.json").write_text(json.dumps(spec, indent=1))

    def dump_stacks(self, *pids: int) -> None:
        """Have the server and the given kernel processes print all their threads' stacks into the
        log (for a check that found something stuck; ``checks.log`` then shows where)."""
        for pid in (self.proc.pid if self.proc else None, *pids):
            if pid and pid > 0:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)

    def start(self, timeout: float = 60.0) -> JupyterServer:
        self._write_environment()
        argv = [
            sys.executable,
            "-m",
            "jupyter_server",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            "--ServerApp.open_browser=False",
            "--ServerApp.allow_root=True",
            f"--ServerApp.root_dir={self.workdir / 'root'}",
        ]
        logfile = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            argv, env=self.env(), stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True
        )
        logfile.close()
        register_pid(self.proc.pid, "jupyter_server")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise HarnessError(f"jupyter_server exited with code {self.proc.returncode}: {self.log_tail(1)}")
            try:
                status, _ = self.api("GET", "/api/status", timeout=2)
                if status == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.2)
        raise HarnessError(f"jupyter_server did not answer within {timeout:.0f} s: {self.log_tail(1)}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        useful = [line for line in text if line.strip()]
        return " / ".join(useful[-lines:])[-600:]

    def log_errors(self) -> list[str]:
        """Lines of the server log that report errors or tracebacks (for the JSON)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []
        return [line for line in text if re.search(r"\b(ERROR|Traceback|Exception|CRITICAL)\b|^\[E ", line)][-20:]

    # REST
    def api(self, method: str, path: str, body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}/{path.lstrip('/')}", data=data, method=method)
        req.add_header("Authorization", f"token {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            status = exc.code
        try:
            payload = json.loads(raw) if raw else None
        except json.JSONDecodeError:
            payload = raw.decode(errors="replace")
        return status, payload

    def start_kernel(self, name: str = "python3") -> str:
        status, model = self.api("POST", "/api/kernels", {"name": name})
        if status not in (200, 201) or not isinstance(model, dict):
            raise HarnessError(f"POST /api/kernels ({name}) answered {status}: {str(model)[:200]}")
        return str(model["id"])

    def connect(self, kernel_id: str, timeout: float = 90.0) -> KernelSession:
        """Wait until the server has launched the kernel (it may be queued), then connect.

        The connection file appears when the provisioner launches the kernel, i.e. once its
        lease is granted; ``execution_state`` is no guide (it stays "starting" until the
        server sees the kernel's first status message).
        """
        path = self.runtime_dir / f"kernel-{kernel_id}.json"
        deadline = time.monotonic() + timeout
        while True:
            if path.exists() and path.stat().st_size > 0:
                break
            status, model = self.api("GET", f"/api/kernels/{kernel_id}")
            if status == 404:
                raise HarnessError(f"kernel {kernel_id[:8]} vanished while starting: {self.log_tail(2)}")
            if time.monotonic() > deadline:
                state = model.get("execution_state", "unknown") if isinstance(model, dict) else status
                raise HarnessError(
                    f"kernel {kernel_id[:8]} not launched within {timeout:.0f} s (state {state}): {self.log_tail(2)}"
                )
            time.sleep(0.2)
        session = KernelSession(kernel_id, str(path), ready_timeout=max(5.0, deadline - time.monotonic()))
        self.sessions[kernel_id] = session
        info = session.value(PRELUDE, timeout=60)
        session.pid = int(info["pid"])
        register_pid(session.pid, f"kernel {kernel_id[:8]}")
        session.env = dict(info["env"])
        return session

    def kernel(self, name: str = "python3", timeout: float = 90.0) -> KernelSession:
        return self.connect(self.start_kernel(name), timeout=timeout)

    def gpupool_kernel(self, kernel_id: str) -> tuple[int, Any]:
        """``GET /api/gpupool/kernels/{id}``: the slice as the server extension reports it."""
        return self.api("GET", f"/api/gpupool/kernels/{kernel_id}")

    def kernel_alive(self, kernel_id: str) -> bool:
        status, _ = self.api("GET", f"/api/kernels/{kernel_id}")
        return status == 200

    def shutdown_kernel(self, kernel_id: str) -> None:
        session = self.sessions.pop(kernel_id, None)
        if session:
            session.close()
        self.api("DELETE", f"/api/kernels/{kernel_id}", timeout=60)

    def stop(self) -> None:
        """Shut every kernel down through the server, then the server; kill what lingers."""
        if self.proc is None:
            return
        for kid in list(self.sessions):
            try:
                self.shutdown_kernel(kid)
            except Exception as exc:  # noqa: BLE001 - shut down what can be, whatever fails
                self.log(f"shutting kernel {kid[:8]} down failed: {exc}")
        try:
            status, kernels = self.api("GET", "/api/kernels", timeout=5)
            for model in kernels if status == 200 and isinstance(kernels, list) else []:
                self.api("DELETE", f"/api/kernels/{model['id']}", timeout=30)
            self.api("POST", "/api/shutdown", timeout=5)
        except Exception as exc:  # noqa: BLE001
            self.log(f"server did not take the shutdown request: {exc}")
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)
        self.proc = None

    def __enter__(self) -> JupyterServer:  # noqa: PYI034
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bare_kernelspec(name: str = "python3-bare") -> dict[str, dict[str, Any]]:
    """An IPython kernelspec that opts out of the pool (jupyter_client's own local provisioner)."""
    return {
        name: {
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "Python 3 (no GPU pool)",
            "language": "python",
            "metadata": {"kernel_provisioner": {"provisioner_name": "local-provisioner", "config": {}}},
        }
    }


def copy_log(src: Path, dest_dir: str | None, name: str) -> None:
    if dest_dir and src.exists():
        os.makedirs(dest_dir, exist_ok=True)
        shutil.copy(src, Path(dest_dir) / name)
