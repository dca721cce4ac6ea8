"""A Jupyter server whose kernels run on a kernel gateway (``--gateway-url``).

Such a server starts no kernel process: jupyter_server's ``GatewayMappingKernelManager`` asks the
gateway over HTTP, and the gateway's host runs the kernel. So the server extension

- leaves the gateway's kernel manager and kernelspec manager exactly as jupyter_server made them
  (no pending kernels, no provisioner default, no wrapped start, shutdown or restart): the pool of
  the gateway's host leases for the kernel there, through the kernel's own hook
  (:mod:`jupyter_gpupool.kernel.autolease`) or a ``gpupool-provisioner`` kernelspec on that host;
- marks the kernels it asks for as started by a person (:data:`INTERACTIVE_HINT_ENV`, a
  ``KERNEL_`` variable, the only kind every gateway passes on), so they lease as ``normal``,
  not ``batch``; a hint only: it never chooses a pool or whether to pool;
- answers ``GET /api/gpupool/kernels/{id}`` with what the kernel reports of its own lease,
  asked on the quiet channel (control, no cell, no activity), as ``%gpupool status`` would
  show it, plus where it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import time
from typing import Any

from jupyter_gpupool.kernel.autolease import INTERACTIVE_HINT_ENV
from jupyter_gpupool.quiet import QUIET_REQUEST, mark_quiet
from jupyter_gpupool.rest.views import kernel_status_without_pool

#: The quiet action a pooled kernel answers with its own ``GET /api/gpupool/kernels/{id}`` body.
KERNEL_STATUS_ACTION = "kernel_status"


def gateway_url(serverapp: Any) -> str | None:
    """The kernel gateway this server's kernels run on, or None when it runs them itself."""
    try:
        from jupyter_server.gateway.managers import GatewayMappingKernelManager
    except ImportError:  # pragma: no cover - every jupyter_server 2 has it
        return None
    km = getattr(serverapp, "kernel_manager", None)
    config = getattr(serverapp, "gateway_config", None)
    if isinstance(km, GatewayMappingKernelManager) or bool(getattr(config, "gateway_enabled", False)):
        return str(getattr(config, "url", "") or "the configured gateway")
    return None


async def gateway_quiet_request(kernel: Any, action: str, timeout: float) -> dict[str, Any] | None:
    """:func:`~jupyter_gpupool.quiet.quiet_request` through a gateway's websocket: the reply's content,
    or None when the kernel did not answer within ``timeout`` seconds.

    jupyter_server's gateway client routes every message it hears to its channel's queue (so every
    channel is opened: a message for a closed one stops its router) and sends a message on the
    channel the message names (so the request names ``control``)."""
    client = kernel.client()
    await client.start_channels()
    try:
        msg = mark_quiet(client.session.msg(QUIET_REQUEST, {"action": action}))
        msg["channel"] = "control"
        client.control_channel.send(msg)
        deadline = time.monotonic() + max(0.0, timeout)
        while (left := deadline - time.monotonic()) > 0:
            try:
                reply = await client.control_channel.get_msg(timeout=left)
            except (queue.Empty, asyncio.TimeoutError, TimeoutError, RuntimeError):
                return None
            if (reply.get("parent_header") or {}).get("msg_id") == msg["header"]["msg_id"]:
                return dict(reply.get("content") or {})
        return None
    finally:
        with contextlib.suppress(Exception):
            client.stop_channels()


class GatewayKernels:
    """What the server extension does for kernels that run on a gateway."""

    #: Seconds a status request waits for the kernel's answer.
    answer_timeout = 5.0
    #: Seconds a kernel that did not answer is not asked again (each status poll would wait).
    silent_for = 30.0

    def __init__(self, url: str, log: Any) -> None:
        self.url = url
        self.log = log
        self._silent: dict[str, float] = {}  # kernel id → monotonic time it last failed to answer
        self._hint_was: str | None = None

    def start(self) -> None:
        """Mark the kernels this server asks the gateway for as started by a person, and say once
        where they are pooled. jupyter_server's gateway client sends every ``KERNEL_`` variable of
        the server's environment with a start, and every gateway passes those on to the kernel."""
        self._hint_was = os.environ.get(INTERACTIVE_HINT_ENV)
        os.environ[INTERACTIVE_HINT_ENV] = "1"
        self.log.info(
            "gpupool: kernels run on the kernel gateway at %s: the GPU pool of the gateway's host leases for them "
            "(docs/gateways.md); this server leaves its gateway kernel manager as jupyter_server made it",
            self.url,
        )

    def stop(self) -> None:
        """Put the server's environment back as it was (servers embedded in one process, tests)."""
        if self._hint_was is None:
            os.environ.pop(INTERACTIVE_HINT_ENV, None)
        else:
            os.environ[INTERACTIVE_HINT_ENV] = self._hint_was

    def refusal(self, kernel_id: str) -> str:
        """Why this server cannot act on a gateway kernel's slice itself."""
        return (
            f"kernel {kernel_id} runs on the kernel gateway at {self.url}, whose host's pool holds its GPU slice: "
            "change it from the notebook with %gpupool (e.g. %gpupool reserve 8GiB, %gpupool release)"
        )

    async def status(self, kernel_manager: Any, kernel_id: str, owner: str) -> dict[str, Any]:
        """The kernel's ``GET /api/gpupool/kernels/{id}`` body as the kernel reports it, with
        ``gateway`` set; ``state: none`` with the reason when it reports no lease."""
        now = time.time()
        answer: dict[str, Any] | None = None
        silent_since = self._silent.get(kernel_id)
        if silent_since is None or time.monotonic() - silent_since > self.silent_for:
            try:
                kernel = kernel_manager.get_kernel(kernel_id)
                answer = await gateway_quiet_request(kernel, KERNEL_STATUS_ACTION, self.answer_timeout)
            except Exception as err:  # noqa: BLE001 - the gateway or the kernel cannot be reached: no report
                self.log.debug("gpupool: kernel %s on the gateway did not report its lease: %s", kernel_id, err)
        if answer is not None and answer.get("status") == "ok" and isinstance(answer.get("kernel"), dict):
            self._silent.pop(kernel_id, None)
            body = dict(answer["kernel"])
            body["kernel_id"] = kernel_id
            body["gateway"] = self.url
            return body
        if answer is None:
            self._silent[kernel_id] = time.monotonic()
        reason = (
            answer.get("message") if answer is not None and answer.get("status") == "ok" and answer.get("message")
            else f"it runs on the kernel gateway at {self.url} and reports no GPU lease from the gateway host's pool"
        )
        body = kernel_status_without_pool(kernel_id, owner, now, "none", str(reason))
        body["gateway"] = self.url
        return body


__all__ = ["KERNEL_STATUS_ACTION", "GatewayKernels", "gateway_url"]
