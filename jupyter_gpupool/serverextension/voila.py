"""Voilà's pages on a full pool: the page shows its place in the queue, and a viewer who leaves gives it up.

Voilà's page handler starts the notebook's kernel before it sends the page a byte, then asks the
kernel for ``kernel_info`` at once (jupyter_client's ``wait_for_ready`` takes a kernel with no
process yet for a dead one), so its start is never answered as a pending kernel: the start returns
once the kernel has its slice and has started. While it waits, the page is streamed a small
document that says where it stands (``Waiting for a GPU: position 1 of 2``), updated as the queue
moves; once the kernel starts, that text is removed and Voilà's own page follows in the same
response. A viewer whose page closes while it waits (its HTTP connection closed) has its request
withdrawn at once; one that closes as its slice is granted has its kernel shut down. Voilà's
pages also get the server's ``_xsrf`` cookie, which the page needs to have its kernel shut down as
it unloads (Voilà 0.5 does not set it): a served viewer who leaves gives the slice back at once.

Both ways of running Voilà use it:

- as a server extension (``/voila/render/NAME.ipynb``), the pool's extension marks Voilà's page
  requests (:func:`mark_voila_pages`) and waits this way for them (:func:`start_for_voila_page`);
- standalone (``voila NAME.ipynb``), with the kernel manager :class:`PooledVoilaKernelManager`,
  whose kernels get the pool's provisioner.

A Voilà kernel leases as ``normal``: a person watches the page (the provisioner and the kernel
hook read Voilà's variables in the kernel's environment).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import html
import importlib.util
import inspect
import json
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from jupyter_client.provisioning.factory import KernelProvisionerFactory
from jupyter_server._tz import utcnow
from jupyter_server.services.kernels.kernelmanager import AsyncMappingKernelManager
from tornado import web

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.provisioner.kernel_provisioner import PROVISIONER_NAME, GpuPoolProvisioner, in_thread, one_line

__all__ = ["VOILA_PAGE", "PooledVoilaKernelManager", "WaitingPage", "mark_voila_pages", "spared_by_culler", "start_for_voila_page"]

#: The Voilà page handler whose request this task serves (set in its ``prepare``), else None.
VOILA_PAGE: contextvars.ContextVar[Any | None] = contextvars.ContextVar("gpupool_voila_page", default=None)

#: Why a request is withdrawn when its page closes ("the request was ... before it was granted").
LEFT_REASON = "withdrawn when its Voilà page was closed"

#: What a waiting page shows first: a document of its own, which Voilà's page then continues (a
#: browser folds the second ``<html>``/``<head>``/``<body>`` into this one and keeps their content).
PAGE_TOP = """<!DOCTYPE html>
<html><head><meta charset="utf-8"></head><body>
<div id="gpupool-wait" style="font-family: sans-serif; text-align: center; margin-top: 20vh">
<h2 id="gpupool-wait-text">{text}</h2>
<p>This page opens once a GPU slice is free for it. Closing the page gives its place in the queue up.</p>
</div>
"""


def _script(code: str) -> str:
    return f"<script>{code}</script>\n"


def _js_string(text: str) -> str:
    return json.dumps(text).replace("</", "<\\/")


class WaitingPage:
    """A Voilà page whose kernel waits for its GPU slice: what it shows, and whether its viewer left."""

    #: Seconds between bytes sent to a waiting page whose place did not change (keeps proxies from timing out).
    keepalive = 5.0

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.shown = ""
        self.left = asyncio.Event()
        self._last_sent = time.monotonic()
        original = handler.on_connection_close

        def on_connection_close() -> None:
            self.left.set()
            original()

        handler.on_connection_close = on_connection_close  # this request's handler only
        self.check_left()

    def check_left(self) -> bool:
        """Whether the viewer left: the page's connection is closed. Tornado notices a closed
        connection only when it next reads or writes it, so the socket is asked too (a peek)."""
        if not self.left.is_set():
            stream = getattr(getattr(self.handler.request, "connection", None), "stream", None)
            if stream is None or stream.closed() or _peer_closed(getattr(stream, "socket", None)):
                self.left.set()
        return self.left.is_set()

    def _send(self, text: str) -> None:
        if self.left.is_set():
            return
        self._last_sent = time.monotonic()
        try:
            self.handler.write(text)
            flushed = self.handler.flush()
        except Exception:  # noqa: BLE001 - the connection is gone, whatever tornado raised
            self.left.set()
            return

        def done(future: Any) -> None:
            if future.cancelled() or future.exception() is not None:
                self.left.set()

        if isinstance(flushed, asyncio.Future):
            flushed.add_done_callback(done)

    def show(self, text: str) -> None:
        """Show ``text`` (the place in the queue), or send a keep-alive byte when it did not change."""
        if text == self.shown:
            if time.monotonic() - self._last_sent >= self.keepalive:
                self._send("\n")
            return
        if not self.shown:
            self._send(PAGE_TOP.format(text=html.escape(text)))
        else:
            self._send(_script(f"document.getElementById('gpupool-wait-text').textContent = {_js_string(text)};"))
        self.shown = text

    def served(self) -> None:
        """The kernel started: remove the waiting text; Voilà's page follows."""
        if self.shown:
            self._send(_script("var w = document.getElementById('gpupool-wait'); if (w) { w.remove(); }"))

    def failed(self, reason: str) -> None:
        """The start failed: say why where the place in the queue was."""
        if self.shown:
            self.show(f"No GPU slice for this page: {reason}")


def _peer_closed(sock: Any) -> bool:
    """Whether the other end of ``sock`` closed it (a zero-byte peek); False when it cannot tell."""
    if sock is None:
        return False
    try:
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing sent: the viewer is still there
    except ConnectionError:
        return True  # reset by the viewer's side
    except (OSError, ValueError, TypeError):
        return False


def queue_text(manager: Any) -> str | None:
    """``Waiting for a GPU: position 1 of 2`` while ``manager``'s kernel waits in the queue, else None."""
    prov = getattr(manager, "provisioner", None)
    update = prov.queue_update if isinstance(prov, GpuPoolProvisioner) else None
    if update is None:
        return None
    text = GpuPoolProvisioner._queue_message(update[1])
    return text[:1].upper() + text[1:]


async def wait_on_page(
    handler: Any,
    start: Awaitable[Any],
    waiting_text: Callable[[], str | None],
    withdraw: Callable[[], Awaitable[bool]],
    shut_down: Callable[[Any], Awaitable[Any]],
    poll: float = 0.25,
) -> Any:
    """Run ``start`` (a kernel start) for the page of ``handler``, showing ``waiting_text()`` on it.

    If the page closes before the start ends, ``withdraw()`` is called (again each ``poll`` until
    it withdrew or the start ended): a queued request withdrawn makes the start fail fast. A start
    that succeeds after the page closed has its kernel shut down (``shut_down(kernel_id)``)."""
    page = WaitingPage(handler)
    task = asyncio.ensure_future(start)
    left = asyncio.ensure_future(page.left.wait())
    withdrawn = False
    try:
        while not task.done():
            # Once the viewer left, only the start is waited for (``left`` is done: no busy loop).
            await asyncio.wait([task] if page.left.is_set() else [task, left], timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            if page.check_left() and not withdrawn and not task.done():
                withdrawn = await withdraw()
                continue
            text = waiting_text()
            if text and not task.done():
                page.show(text)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        left.cancel()
    try:
        result = task.result()
    except Exception as err:
        reason = str(getattr(err, "log_message", None) or err or type(err).__name__).replace("%%", "%")
        page.failed(reason.splitlines()[0])
        raise
    if page.left.is_set():
        with contextlib.suppress(Exception):
            await shut_down(result)
        raise web.HTTPError(503, "the Voilà page was closed before its kernel had a GPU slice")
    page.served()
    return result


# --- Voilà as a server extension ------------------------------------------------------------------


def mark_voila_pages() -> bool:
    """Make Voilà's page requests run with :data:`VOILA_PAGE` set (once per process).

    Set in the handler's ``prepare``, which tornado awaits in the request's own task before the
    page is rendered. False where Voilà is not installed (nothing is imported then)."""
    if importlib.util.find_spec("voila") is None:
        return False
    try:
        from voila.handler import VoilaHandler
    except Exception:  # noqa: BLE001 - a broken Voilà install: its pages are left as they are
        return False
    original = VoilaHandler.prepare
    if getattr(original, "_gpupool_voila_page", False):
        return True

    async def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        VOILA_PAGE.set(self)  # this request's task only
        result = original(self, *args, **kwargs)
        result = await result if inspect.isawaitable(result) else result
        # The server's _xsrf cookie, which Voilà's page sends when it asks, as it unloads, for its
        # kernel to be shut down: without it that request is refused and the slice stays taken.
        with contextlib.suppress(Exception):
            self.xsrf_token  # noqa: B018 - read for its effect: it sets the cookie
        return result

    prepare._gpupool_voila_page = True  # type: ignore[attr-defined]
    VoilaHandler.prepare = prepare  # type: ignore[method-assign]
    return True


async def start_for_voila_page(ext: Any, km: Any, original: Any, page: Any, *args: Any, **kwargs: Any) -> Any:
    """The server's kernel start for a Voilà page (``ext``: the pool's extension, ``original``:
    jupyter_server's start): returns once the kernel started, showing the queue on the page."""
    kernel_id = kwargs.get("kernel_id") or km.new_kernel_id()
    kwargs["kernel_id"] = kernel_id
    # Registered as a start to follow: the extension keeps the kernel's manager while it starts.
    ext._queued_starts[kernel_id] = asyncio.Event()

    async def withdraw() -> bool:
        withdrawn = await asyncio.to_thread(ext.withdraw_queued, kernel_id, LEFT_REASON)
        if withdrawn is None:
            return False
        ext.log.info("gpupool: kernel %s: request %s", kernel_id, LEFT_REASON)
        ext.emit("released", withdrawn, message=LEFT_REASON)
        return True

    try:
        return await wait_on_page(
            page,
            ext._pool_errors_as_http(original(*args, **kwargs)),
            lambda: queue_text(ext._starting.get(kernel_id)),
            withdraw,
            lambda started: km.shutdown_kernel(started),
        )
    finally:
        ext._queued_starts.pop(kernel_id, None)
        ext._starting.pop(kernel_id, None)


# --- standalone Voilà -----------------------------------------------------------------------------


class PooledVoilaKernelManager(AsyncMappingKernelManager):
    """Standalone Voilà's kernel manager with the GPU pool (``voila NAME.ipynb
    --VoilaConfiguration.multi_kernel_manager_class=jupyter_gpupool.serverextension.voila.PooledVoilaKernelManager``).

    Its kernels get the pool's provisioner (unless a kernelspec names another, or
    ``$JUPYTER_DEFAULT_PROVISIONER_NAME`` is set), so they wait for their slice in the start,
    and a page whose kernel waits shows its place in the queue."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._page_starts: dict[str, Any] = {}  # kernel id → its KernelManager while a page's start is under way
        factory = KernelProvisionerFactory.instance(parent=self.parent)
        if not os.environ.get(KernelProvisionerFactory.default_provisioner_name_env):
            KernelProvisionerFactory.provisioners.setdefault(
                PROVISIONER_NAME,
                KernelProvisionerFactory.provisioners.get(PROVISIONER_NAME) or _provisioner_entry_point(),
            )
            factory.default_provisioner_name = PROVISIONER_NAME
        mark_voila_pages()

    def pre_start_kernel(self, kernel_name: str | None, kwargs: Any) -> Any:
        manager, name, kernel_id = super().pre_start_kernel(kernel_name, kwargs)
        if kernel_id in self._page_starts:
            self._page_starts[kernel_id] = manager
            # Listed once granted, a moment before jupyter_server marks it: the culler, which passes
            # it by (see cull_kernel_if_idle), must find it starting, not without a last activity.
            listed: Any = manager  # a ServerKernelManager, whose traits these are
            listed.execution_state = "starting"
            listed.last_activity = utcnow()
        return manager, name, kernel_id

    async def cull_kernel_if_idle(self, kernel_id: str) -> None:
        """jupyter_server's culler, which passes by a kernel whose start is under way (a page's
        start, waiting for its GPU or granted and still starting; a start or restart waiting in the
        queue): see :func:`spared_by_culler`."""
        prov = getattr(self._kernels.get(kernel_id), "provisioner", None)
        waiting = isinstance(prov, GpuPoolProvisioner) and prov.phase == "waiting"
        if spared_by_culler(self._kernels.get(kernel_id), kernel_id in self._page_starts or waiting):
            return
        await super().cull_kernel_if_idle(kernel_id)

    async def start_kernel(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        page = VOILA_PAGE.get()
        if page is None or kwargs.get("kernel_id") in self.list_kernel_ids():
            return await super().start_kernel(*args, **kwargs)
        kernel_id = kwargs.get("kernel_id") or self.new_kernel_id()
        kwargs["kernel_id"] = kernel_id
        self._page_starts[kernel_id] = None

        async def withdraw() -> bool:
            prov = getattr(self._page_starts.get(kernel_id), "provisioner", None)
            if not isinstance(prov, GpuPoolProvisioner) or not prov.lease_id:
                return False
            lease = await in_thread(prov.pool.get, prov.lease_id)
            if lease.state is not LeaseState.QUEUED:
                return False
            await in_thread(prov.pool.release, lease.id, LEFT_REASON)
            self.log.info("gpupool: kernel %s: request %s", kernel_id, LEFT_REASON)
            return True

        try:
            started: str = await wait_on_page(
                page,
                pool_errors_as_http(super().start_kernel(*args, **kwargs)),
                lambda: queue_text(self._page_starts.get(kernel_id)),
                withdraw,
                lambda started: self.shutdown_kernel(started),
            )
            return started
        finally:
            self._page_starts.pop(kernel_id, None)
            if kernel_id not in self._kernels:  # a failed start: jupyter_client would list it (and shut it down) for ever
                self._pending_kernels.pop(kernel_id, None)


def spared_by_culler(kernel: Any, starting: bool) -> bool:
    """The pool's rule for jupyter_server's culler: a listed ``kernel`` whose start is under way
    (``starting``: waiting in the queue for its slice, or granted and not yet started) is never
    culled, and the culler's pass never waits on its start; its idle time starts over, so it counts
    from the moment the start ends. True when the culler must pass it by (its last activity is now)."""
    if kernel is None or not starting:
        return False
    kernel.last_activity = utcnow()  # waiting is not idleness
    return True


async def pool_errors_as_http(start: Awaitable[Any]) -> Any:
    """Await a start; a refusal by the pool (a GpuPoolError) becomes an HTTP error with its reason (a
    line in the log, not a traceback)."""
    try:
        return await start
    except GpuPoolError as err:
        status = err.http_status if err.http_status != 500 else 503
        raise web.HTTPError(status, one_line(err).replace("%", "%%")) from None


def _provisioner_entry_point() -> Any:
    """The provisioner's entry point, for a source checkout without package metadata."""
    from importlib.metadata import EntryPoint

    return EntryPoint(PROVISIONER_NAME, f"{GpuPoolProvisioner.__module__}:GpuPoolProvisioner", KernelProvisionerFactory.GROUP_NAME)
