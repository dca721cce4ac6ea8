"""The waiting cell: a suspended kernel resumes when it is given work, and the cell waits for it.

When an idle kernel's slice is taken back by suspending it (its GPU memory parked in host RAM),
the next cell the user runs should simply work. :class:`ResumeOnRun` hooks IPython's
``pre_run_cell``: if this kernel's lease is suspended (or already queued to resume, or being
restored), it asks the pool to resume it and blocks until the lease is granted again and its
server has restored the GPU memory, showing one progress line that updates in place::

    gpupool: resuming — waiting for a GPU, position 2 of 3 (est. 4 min)
    gpupool: restoring GPU memory…
    gpupool: resumed on GPU 0 after 12 s

Then the cell runs. An interrupt while waiting stops the cell with one line (the lease stays
queued to resume, so the next cell waits again). IPython's event callbacks swallow exceptions,
so the hook cannot stop a cell itself: it leaves its verdict for :class:`_RejectCell`, an AST
transformer that rejects the cell before it runs.

When the kernel is running (the common case) the hook costs one lease read from the pool.
Cells made only of ``%gpupool`` lines never wait: ``%gpupool status`` must show a suspended
kernel as suspended, not resume it.
"""

from __future__ import annotations

import ast
import html
import time
from collections.abc import Callable
from typing import Any

from IPython.core.error import InputRejected

from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo, Transition
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.kernel.client import PoolClient
from jupyter_gpupool.units import format_duration


def needs_waiting(lease: Lease | None) -> bool:
    """True when a cell must wait for this lease before it may use the GPU."""
    if lease is None:
        return False
    if lease.state is LeaseState.SUSPENDED:
        return True
    if lease.state is LeaseState.QUEUED:
        return lease.resuming
    return lease.state is LeaseState.GRANTED and lease.transition is not Transition.NONE


def only_gpupool_magics(cell: str) -> bool:
    """True for a cell of nothing but ``%gpupool`` lines (and blank or comment lines)."""
    lines = [line.strip() for line in cell.splitlines()]
    code = [line for line in lines if line and not line.startswith("#")]
    return bool(code) and all(line == "%gpupool" or line.startswith("%gpupool ") for line in code)


def progress_text(lease: Lease, info: QueueInfo | None) -> str:
    """The progress line for a lease the cell waits on."""
    if lease.state is LeaseState.QUEUED:
        if info is None:
            return "gpupool: resuming — waiting for a GPU"
        wait = f" (est. {format_duration(info.estimated_wait)})" if info.estimated_wait else ""
        reason = info.reason.removeprefix("resuming: ")  # the line already says so
        reason = f"; {reason}" if reason else ""
        return f"gpupool: resuming — waiting for a GPU, position {info.position} of {info.length}{wait}{reason}"
    if lease.state is LeaseState.SUSPENDED:
        return "gpupool: resuming — asking the pool for a GPU"
    if lease.transition is Transition.SUSPENDING:
        return "gpupool: this kernel is being suspended; it resumes as soon as its GPU memory is parked…"
    if lease.transition is Transition.RESTORING:
        return "gpupool: restoring GPU memory…"
    if lease.transition is Transition.MIGRATING:
        return "gpupool: moving this kernel's GPU memory to another GPU…"
    return f"gpupool: lease {lease.state.value}"


class ProgressLine:
    """One line of cell output (plain text and HTML), shown once and then updated in place."""

    def __init__(self, display: Callable[..., Any] | None = None) -> None:
        if display is None:
            from IPython.display import display as ipython_display

            display = ipython_display
        self._display = display
        self.handle: Any = None
        self.text = ""
        self.shown: list[str] = []  # every distinct line shown, in order (tests and logs read it)

    def show(self, text: str) -> None:
        if text == self.text:
            return
        self.text = text
        self.shown.append(text)
        line = _Line(text)
        if self.handle is None:
            self.handle = self._display(line, display_id=True)
        else:
            self.handle.update(line)


class _Line:
    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<div class='gpupool-resume'>{html.escape(self.text)}</div>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


class CellRejected(InputRejected):
    """Stops a cell before it runs, shown as one line (IPython uses ``_render_traceback_``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        if str(getattr(get_ipython(), "colors", "")).lower() == "nocolor":
            return [f"gpupool: {self.message}"]
        return [f"\x1b[31mgpupool: {self.message}\x1b[0m"]


class _RejectCell(ast.NodeTransformer):
    """Rejects the cell the hook decided must not run; passes every other cell unchanged."""

    def __init__(self, owner: ResumeOnRun) -> None:
        self.owner = owner

    def visit(self, node: ast.AST) -> ast.AST:
        message, self.owner.rejection = self.owner.rejection, None
        if message:
            raise CellRejected(message)
        return node


class ResumeOnRun:
    """The ``pre_run_cell`` hook that makes a cell wait for its suspended kernel to resume."""

    def __init__(self, client: Callable[[], PoolClient], poll: float = 0.5, display: Callable[..., Any] | None = None) -> None:
        self._client = client
        self.poll = poll
        self._display = display
        self.rejection: str | None = None
        self.transformer = _RejectCell(self)
        self.last_check_seconds = 0.0  # what the last "is it suspended?" read cost (kept < 5 ms)
        self.errors = 0
        self.last_progress: ProgressLine | None = None

    def start(self, shell: Any) -> None:
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.events.register("post_run_cell", self.post_run_cell)
        shell.ast_transformers.append(self.transformer)

    def stop(self, shell: Any) -> None:
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                shell.events.unregister(name, callback)
            except ValueError:
                pass
        if self.transformer in shell.ast_transformers:
            shell.ast_transformers.remove(self.transformer)

    def post_run_cell(self, *_: Any) -> None:
        self.rejection = None  # a cell that never reached the transformer (a syntax error) leaves none behind

    def pre_run_cell(self, info: Any = None) -> None:
        """Wait for the GPU if this kernel is suspended; never raises (IPython would print a traceback)."""
        self.rejection = None
        cell = getattr(info, "raw_cell", "") or ""
        if only_gpupool_magics(cell):
            return
        try:
            client = self._client()
            if not client.lease_id:
                return
            started = time.perf_counter()
            lease = client.current()
            self.last_check_seconds = time.perf_counter() - started
        except Exception:  # noqa: BLE001 -- the pool cannot be read now: run the cell as if nothing were parked
            self.errors += 1  # (a hook that raised would print a traceback before every cell)
            return
        if needs_waiting(lease):
            self.rejection = self.wait(client)

    def wait(self, client: PoolClient) -> str | None:
        """Resume and block until running; the one-line reason to reject the cell, or None to run it."""
        progress = self.last_progress = ProgressLine(self._display)
        started = time.monotonic()

        def on_update(lease: Lease, info: QueueInfo | None) -> None:
            progress.show(progress_text(lease, info))

        try:
            lease = client.resume()
            on_update(lease, None)
            lease = client.wait_until_running(on_update=on_update)
        except KeyboardInterrupt:
            return (
                "stopped waiting for a GPU; this kernel stays queued to resume, and your next cell waits again"
                " (%gpupool status shows its place)"
            )
        except GpuPoolError as err:
            return f"cannot resume this kernel: {err}"
        except Exception as err:  # noqa: BLE001 -- one line, never a traceback
            return f"cannot resume this kernel: {err}"
        progress.show(f"gpupool: resumed on {_where(client, lease)} after {format_duration(time.monotonic() - started)}")
        return None


def _where(client: PoolClient, lease: Lease) -> str:
    """``GPU 0`` or ``GPUs 0, 1``: the indices of the lease's devices (uuids when unknown)."""
    try:
        devices = {d.uuid: d.index for d in client.pool.devices()}  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 -- a label only
        devices = {}
    names = [str(devices.get(uuid, uuid)) for uuid in lease.devices]
    if not names:
        return "its GPU"
    return ("GPU " if len(names) == 1 else "GPUs ") + ", ".join(names)


__all__ = ["CellRejected", "ProgressLine", "ResumeOnRun", "needs_waiting", "only_gpupool_magics", "progress_text"]
