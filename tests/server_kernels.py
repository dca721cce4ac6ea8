"""Kernels on the in-process jupyter_server of the ``jp_serverapp`` fixtures: start one over REST,
find its process."""

from __future__ import annotations

import json
from typing import Any


async def start_kernel(fetch: Any, name: str = "python3") -> str:
    """``POST /api/kernels`` through ``gpupool_fetch``; the new kernel's id."""
    response = await fetch("api", "kernels", method="POST", body={"name": name})
    assert response.code == 201, response.body
    return str(json.loads(response.body)["id"])


def kernel_pid(serverapp: Any, kernel_id: str) -> int | None:
    """The kernel's process id, once its provisioner launched it (None before)."""
    kernel = serverapp.kernel_manager.get_kernel(kernel_id)
    return getattr(getattr(kernel.provisioner, "process", None), "pid", None)
