"""``PoolStatus``: this kernel's GPU slice as a live ipywidget (Notebook 7, VS Code, Colab-like front ends).

Pure Python composition of standard ipywidgets 8 controls (no custom JavaScript), so it
renders wherever ipywidgets does::

    from jupyter_gpupool.widget import PoolStatus
    PoolStatus()            # refreshes every 5 s until .close()

Its refreshes speak on the quiet channel (:mod:`jupyter_gpupool.quiet`): a kernel showing it
still goes idle, and idle reclaim still takes it. A click on one of its buttons is activity.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

import ipywidgets as widgets

from jupyter_gpupool.core.models import LeaseState, Transition
from jupyter_gpupool.errors import GpuPoolError, PoolUnavailable
from jupyter_gpupool.kernel import get_client
from jupyter_gpupool.kernel.client import DEFAULT_KEEP, PoolClient
from jupyter_gpupool.kernel.status import KernelStatus, unavailable_status
from jupyter_gpupool.quiet import quiet_widget
from jupyter_gpupool.rest.views import elastic_line
from jupyter_gpupool.units import format_duration, format_size, parse_duration

_STATE_COLORS = {
    "granted": "#2e7d32",
    "queued": "#ef6c00",
    "suspended": "#6a1b9a",
    "resuming": "#6a1b9a",
    "suspending": "#6a1b9a",
    "restoring": "#6a1b9a",
    "migrating": "#1565c0",
    "released": "#757575",
    "none": "#757575",
    "unavailable": "#c62828",
}


class PoolStatus(widgets.VBox):
    """Share, usage bar, queue position and idle countdown of this kernel's slice, with a Keep button,
    and Suspend / Resume buttons (a suspended kernel's GPU memory is parked in host RAM).

    A background thread refreshes it every ``interval`` seconds, quietly (no activity for the
    pool's idle clock); :meth:`close` stops the thread.
    """

    def __init__(
        self,
        client: PoolClient | None = None,
        interval: float = 5.0,
        keep_for: str = DEFAULT_KEEP,
        autostart: bool = True,
        **kwargs: Any,
    ) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval <= 0:
            raise ValueError("interval must be above 0 seconds")
        self.keep_seconds = parse_duration(keep_for)
        self._client = client
        self.interval = float(interval)
        self.title = widgets.HTML(value="<b>GPU slice</b>")
        self.share = widgets.HTML(value="loading…")
        self.usage_bar = widgets.IntProgress(
            value=0, min=0, max=100, description="usage", bar_style="", layout=widgets.Layout(width="320px")
        )
        self.usage_text = widgets.HTML(value="")
        self.queue = widgets.HTML(value="")
        self.idle = widgets.HTML(value="")
        self.keep_button = widgets.Button(
            description=f"Keep {format_duration(self.keep_seconds)}",
            tooltip=f"hold this slice through idle for {format_duration(self.keep_seconds)}",
            icon="clock",
            button_style="",
        )
        self.message = widgets.HTML(value="")
        self.keep_button.on_click(self._on_keep)
        self.suspend_button = widgets.Button(
            description="Suspend",
            tooltip="park this kernel's GPU memory in host RAM and free the GPU; your next cell resumes it",
            icon="pause",
            layout=widgets.Layout(display="none"),
        )
        self.suspend_button.on_click(self._on_suspend)
        self.resume_button = widgets.Button(
            description="Resume",
            tooltip="bring this kernel back onto a GPU now (your next cell would too)",
            icon="play",
            button_style="info",
            layout=widgets.Layout(display="none"),
        )
        self.resume_button.on_click(self._on_resume)
        # The right-sizing hint (same rule as %gpupool status and the lab sidebar) and its action.
        self.hint = widgets.HTML(value="")
        self.shrink_button = widgets.Button(description="Shrink", icon="compress", layout=widgets.Layout(display="none"))
        self.shrink_button.on_click(self._on_shrink)
        super().__init__(
            children=[
                self.title,
                self.share,
                widgets.HBox([self.usage_bar, self.usage_text]),
                self.queue,
                self.idle,
                widgets.HBox([self.hint, self.shrink_button]),
                widgets.HBox([self.keep_button, self.suspend_button, self.resume_button, self.message]),
            ],
            **kwargs,
        )
        quiet_widget(self)  # its refreshes are the pool's own traffic, not the user's
        self.last_status: KernelStatus | None = None
        self.refresh_count = 0
        self._lock = threading.Lock()
        self.refresh()
        if autostart:
            self.start()

    # -- data --------------------------------------------------------------------------------
    @property
    def client(self) -> PoolClient:
        if self._client is None:
            self._client = get_client()
        return self._client

    def refresh(self) -> None:
        """Read the pool once and update every control (never raises: errors show in the widget)."""
        with self._lock:
            try:
                status = self.client.status()
            except PoolUnavailable as err:  # shown as the pool's state, like a CPU-only kernel's, with the reason
                status = unavailable_status(str(err))
                self.message.value = _error_html(f"GPU pool unavailable: {err}")
            except GpuPoolError as err:
                self.message.value = _error_html(str(err))
                return
            except Exception as err:  # noqa: BLE001 -- a broken refresh must not kill the thread
                self.message.value = _error_html(f"cannot read the pool: {err}")
                return
            if status.unavailable and not status.lease:
                self.message.value = _error_html(f"GPU pool unavailable: {status.unavailable}")
            self.last_status = status
            self._show(status)
            self.refresh_count += 1

    def _show(self, status: KernelStatus) -> None:
        color = _STATE_COLORS.get(status.state, "#757575")
        self.title.value = (
            f"<b>GPU slice</b> <span style='color:{color};font-weight:bold'>{html.escape(status.state)}</span>"
        )
        granted = status.lease is not None and status.lease.state is LeaseState.GRANTED
        elastic = elastic_line(status.lease) if granted and status.lease is not None else ""
        self.share.value = html.escape(status.share_text() + (f" — {elastic}" if elastic else ""))
        fraction = status.usage_fraction()
        percent = 0 if fraction is None else round(100 * fraction)
        self.usage_bar.value = max(0, min(100, percent))
        self.usage_bar.bar_style = (
            "" if fraction is None else "danger" if fraction > 1.0 else "warning" if fraction > 0.85 else "success"
        )
        self.usage_text.value = html.escape(status.usage_text())
        lease = status.lease
        queued = lease is not None and lease.state is LeaseState.QUEUED
        self.queue.value = html.escape(f"queue: {status.queue_text()}") if queued else ""
        self.idle.value = (
            html.escape(f"idle: {status.idle_text()}") if lease and lease.state is LeaseState.GRANTED else ""
        )
        hint = status.hint()
        self.hint.value = html.escape(hint.text) if hint else ""
        self.shrink_button.description = hint.button if hint else "Shrink"
        self.shrink_button.tooltip = f"%gpupool reserve {hint.memory}" if hint else ""
        self.shrink_button.layout.display = "" if hint else "none"
        self._hint_memory = hint.memory if hint else None
        self.keep_button.disabled = lease is None or lease.state is not LeaseState.GRANTED
        self.keep_button.button_style = "warning" if lease is not None and lease.reclaim_at is not None else ""
        self._show_suspend_resume(status)

    def _show_suspend_resume(self, status: KernelStatus) -> None:
        """Suspend while it runs on a GPU (enabled where its server can park memory); Resume while parked."""
        lease = status.lease
        running = lease is not None and lease.state is LeaseState.GRANTED
        parked = lease is not None and lease.state is LeaseState.SUSPENDED
        resuming = status.state == "resuming"
        self.suspend_button.layout.display = "" if running else "none"
        self.suspend_button.disabled = not (running and lease is not None and lease.suspendable and lease.transition is Transition.NONE)
        if running and lease is not None and not lease.suspendable:
            self.suspend_button.tooltip = "this kernel's server cannot park GPU memory (no checkpoint support there)"
        self.resume_button.layout.display = "" if parked or resuming else "none"
        self.resume_button.disabled = not parked
        self.resume_button.description = "Resuming…" if resuming else "Resume"

    def _on_keep(self, _button: Any = None) -> None:
        try:
            lease = self.client.keep(f"{int(self.keep_seconds)}s")
        except GpuPoolError as err:
            self.message.value = _error_html(str(err))
            return
        until = time.strftime("%H:%M", time.localtime(lease.keep_until)) if lease.keep_until else "?"
        self.message.value = html.escape(f"kept through idle until {until}")
        self.refresh()

    def _on_suspend(self, _button: Any = None) -> None:
        try:
            self.client.suspend()
        except GpuPoolError as err:
            self.message.value = _error_html(str(err))
            return
        self.message.value = html.escape("GPU memory will be parked in host RAM; your next cell resumes it")
        self.refresh()

    def _on_resume(self, _button: Any = None) -> None:
        try:
            self.client.resume()  # queued: the widget shows the position; the next cell waits for the GPU
        except GpuPoolError as err:
            self.message.value = _error_html(str(err))
            return
        self.message.value = html.escape("queued to resume; your next cell waits for the GPU")
        self.refresh()

    def _on_shrink(self, _button: Any = None) -> None:
        memory = getattr(self, "_hint_memory", None)
        if memory is None:
            return
        try:
            lease = self.client.reserve(memory)
        except GpuPoolError as err:
            self.message.value = _error_html(str(err))
            return
        self.message.value = html.escape(f"slice now {format_size(lease.memory)}")
        self.refresh()

    # -- background refresh ----------------------------------------------------------------
    def start(self) -> None:
        """Refresh every ``interval`` seconds in a daemon thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gpupool-widget-refresh", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop refreshing; the widget stays on screen with its last values."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self.interval + 5)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def close(self) -> None:
        """Stop the refresh thread and close the widget and its children."""
        if getattr(self, "_stop", None) is not None:  # __del__ may run on a half-built widget
            self.stop()
        for child in self._descendants():
            child.close()
        super().close()

    def _descendants(self) -> list[widgets.Widget]:
        found: list[widgets.Widget] = []
        stack = list(getattr(self, "children", ()))
        while stack:
            child = stack.pop()
            found.append(child)
            stack.extend(getattr(child, "children", ()))
        return found


def _error_html(text: str) -> str:
    return f"<span style='color:#c62828'>{html.escape(text)}</span>"


__all__ = ["PoolStatus"]
