"""A real Jupyter Kernel Gateway for tests, and cells run through a Jupyter server's websocket.

The gateway runs in this environment (the wheel's kernel hook is installed here), with a pool
file of its own; a ``jupyter server --gateway-url`` (see :mod:`server_process`) runs kernels on it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from server_process import free_port, stop_process


class KernelGateway:
    """``jupyter kernelgateway`` on a free loopback port, its runtime files under ``root``.

    ``env``: its process environment on top of this one (None removes a variable); ``args``:
    more command-line options."""

    def __init__(self, root: Path, env: dict[str, str | None], args: tuple[str, ...] = (), start_timeout: float = 90) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        root.mkdir(parents=True, exist_ok=True)
        environ = {**os.environ, "JUPYTER_RUNTIME_DIR": str(root / "runtime")}
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        argv = [sys.executable, "-m", "jupyter", "kernelgateway", f"--KernelGatewayApp.port={self.port}",
                "--KernelGatewayApp.ip=127.0.0.1", *args]
        self.serve(argv, environ, root, "the kernel gateway", start_timeout)

    def serve(self, argv: list[str], environ: dict[str, str], root: Path, what: str, start_timeout: float) -> None:
        """Start ``argv`` (a gateway on ``self.port``), its output in ``root/gateway.log``; return once
        it answers, or stop it and fail with the end of its log."""
        self.log_path = root / "gateway.log"
        self.log = open(self.log_path, "a")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(argv, env=environ, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            try:
                self.call("GET", "api")
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None:
                    break
                time.sleep(0.3)
        self.stop()
        raise AssertionError(f"{what} did not start: {self.log_path.read_text()[-3000:]}")

    def call(self, method: str, path: str, body: Any = None, timeout: float = 60) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method=method, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
        return json.loads(raw) if raw else None

    def kernel_ids(self) -> set[str]:
        return {k["id"] for k in self.call("GET", "api/kernels")}

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def _request(code: str) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    message = {
        "header": {"msg_id": msg_id, "username": "t", "session": uuid.uuid4().hex, "msg_type": "execute_request", "version": "5.3"},
        "parent_header": {},
        "metadata": {},
        "content": {"code": code, "silent": False, "store_history": True, "user_expressions": {}, "allow_stdin": False},
        "channel": "shell",
    }
    return msg_id, json.dumps(message)


async def run_cell(port: int, token: str, kernel_id: str, code: str, timeout: float = 120,
                   outputs: list[str] | None = None) -> tuple[str, list[str]]:
    """Run ``code`` in a server's kernel through its websocket, as a notebook does.

    Returns the reply's status (``ok``/``error``) and every text the cell showed, in order (stream
    text, ``text/plain`` of displays, error names and values); ``outputs`` is filled as they arrive,
    so a caller can watch a cell that waits."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    shown: list[str] = outputs if outputs is not None else []
    url = f"ws://127.0.0.1:{port}/api/kernels/{kernel_id}/channels"
    ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {token}"}, connect_timeout=60))
    try:
        msg_id, message = _request(code)
        await ws.write_message(message)
        status = ""
        idle = False
        deadline = time.monotonic() + timeout
        while not (status and idle):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"the cell did not finish within {timeout} s; it showed {shown}")
            raw = await asyncio.wait_for(ws.read_message(), timeout=left)
            if raw is None:
                raise AssertionError(f"the kernel's websocket closed; the cell showed {shown}")
            msg = json.loads(raw)
            if (msg.get("parent_header") or {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                shown.append(content["text"])
            elif kind in ("display_data", "execute_result", "update_display_data"):
                shown.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                shown.append(f"{content['ename']}: {content['evalue']}")
            elif kind == "execute_reply":
                status = content["status"]
            elif kind == "status" and content.get("execution_state") == "idle":
                idle = True
        return status, shown
    finally:
        ws.close()


__all__ = ["KernelGateway", "run_cell"]
