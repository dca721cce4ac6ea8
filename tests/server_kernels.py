"""Kernels on the in-process jupyter_server of the ``jp_serverapp`` fixtures: start one over REST,
wait for its process, find it; keep a cell busy until the test lets it finish."""

from __future__ import annotations

import json
from typing import Any

import psutil


async def start_kernel(fetch: Any, name: str = "python3") -> str:
    """``POST /api/kernels`` through ``gpupool_fetch``; the new kernel's id."""
    response = await fetch("api", "kernels", method="POST", body={"name": name})
    assert response.code == 201, response.body
    return str(json.loads(response.body)["id"])


def kernel_pid(serverapp: Any, kernel_id: str) -> int | None:
    """The kernel's process id, once its provisioner launched it (None before)."""
    kernel = serverapp.kernel_manager.get_kernel(kernel_id)
    return getattr(getattr(kernel.provisioner, "process", None), "pid", None)


def listening_kernel_pid(serverapp: Any, kernel_id: str) -> int | None:
    """The kernel's process id once that process listens on every port of its connection info
    (None before). A kernel whose port another process took between its choice and its bind dies
    and is restarted on new ports: this is the pid of the one that bound them, not of the dead one."""
    kernel = serverapp.kernel_manager.get_kernel(kernel_id)
    pid = kernel_pid(serverapp, kernel_id)
    ports = {kernel.shell_port, kernel.iopub_port, kernel.stdin_port, kernel.control_port, kernel.hb_port}
    if pid is None or 0 in ports:
        return None
    try:
        listening = {conn.laddr.port for conn in psutil.Process(pid).net_connections("tcp") if conn.status == psutil.CONN_LISTEN}
    except psutil.Error:  # gone (its restart comes next) or not yet readable
        return None
    return pid if ports <= listening else None


#: Seconds a kernel may take to start on a loaded machine (a 2-core CI runner starts several at once).
KERNEL_START_TIMEOUT = 120.0


async def start_running_kernel(fetch: Any, serverapp: Any, wait: Any, name: str = "python3", what: str = "the kernel") -> str:
    """:func:`start_kernel`, then wait (``gpupool_wait``) until its process listens on its ports
    (:func:`listening_kernel_pid`); the kernel's id."""
    kernel = await start_kernel(fetch, name)
    await wait(lambda: listening_kernel_pid(serverapp, kernel), timeout=KERNEL_START_TIMEOUT, what=f"{what}'s process to listen")
    return kernel


def release_flag(path: Any) -> str:
    """Code for a cell that stays busy until the file ``path`` exists (the test creates it): a
    kernel kept busy for as long as the test needs, however slow the machine, not for a guess."""
    return f"import os, time\nwhile not os.path.exists({str(path)!r}):\n    time.sleep(0.05)\nprint('released')"
