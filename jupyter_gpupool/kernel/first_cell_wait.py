"""A kernel whose lease is still queued when its first cell runs: the cell waits for the grant.

The wait shows as a progress line in the cell and as lines on the terminal; a wait stopped by an
interrupt stops the cell, and no later cell runs as if it had run (:class:`FirstCellWait`). Used by
:mod:`jupyter_gpupool.kernel.autolease`, which imports it only once a kernel leases.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.kernel.resume import ProgressLine, _RejectCell, only_gpupool_magics
from jupyter_gpupool.units import format_duration

if TYPE_CHECKING:
    from jupyter_gpupool.kernel.autolease import AutoLease


def waiting_line(priority: str, info: Any) -> str:
    """``waiting for a GPU slice (batch), position 2 of 3 (reason)``: what a waiting kernel says."""
    text = f"waiting for a GPU slice ({priority})"
    if info is not None:
        text += f", position {info.position} of {info.length}"
        if info.reason:
            text += f" ({info.reason})"
    return text


#: Seconds a ``batch`` kernel whose first cell stopped waiting takes to send the cell its last line.
END_AFTER_STOPPED_WAIT = 0.5


class FirstCellWait:
    """``pre_run_cell`` hook: while this kernel's lease is queued, a cell waits for the grant.

    The wait shows as one progress line in the cell, cleared once it ends (a batch run's saved
    notebook keeps only its own outputs), and as lines on the terminal. A request that is withdrawn
    stops the cell with one line; ``%gpupool``-only cells never wait. A wait that is stopped (an
    interrupt: a user's, or a per-cell timeout's) stops the cell, and no later cell runs as if it
    had run: a ``batch`` kernel (no person at it: a grader, a script) gives its request back and
    ends, so its client fails clearly instead of running the rest; any other kernel rejects every
    later cell until it is restarted.
    """

    def __init__(self, owner: AutoLease, display: Callable[..., Any] | None = None, end: Callable[[str], None] | None = None) -> None:
        self.owner = owner
        self._display = display
        self._end = end or _end_kernel
        self.rejection: str | None = None
        #: Why every later cell is rejected (a cell stopped waiting and did not run), else None.
        self.stopped: str | None = None
        self.transformer = _RejectCell(self)  # type: ignore[arg-type]

    def start(self, shell: Any) -> None:
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.ast_transformers.append(self.transformer)

    def stop(self, shell: Any) -> None:
        try:
            shell.events.unregister("pre_run_cell", self.pre_run_cell)
        except ValueError:
            pass
        if self.transformer in shell.ast_transformers:
            shell.ast_transformers.remove(self.transformer)

    def pre_run_cell(self, info: Any = None) -> None:
        self.rejection = None
        if only_gpupool_magics(getattr(info, "raw_cell", "") or ""):
            return
        if self.owner.first_cell_rejection:
            self.rejection, self.owner.first_cell_rejection = self.owner.first_cell_rejection, None
            return
        if self.stopped:
            self.rejection = self.stopped
            return
        if self.owner.queued:
            self.rejection = self.wait()

    def wait(self) -> str | None:
        """The one-line reason to reject the cell, or None to run it (granted, or CPU-only)."""
        progress = ProgressLine(self._display)
        started = time.monotonic()
        last: list[str] = []
        position: list[str] = []

        def on_update(lease: Any, info: Any) -> None:
            text = "gpupool: " + waiting_line(self.owner.priority, info)
            if info is not None:
                position[:] = [f"position {info.position} of {info.length}"]
            progress.show(text)
            if text != (last[-1] if last else None):
                last.append(text)
                self.owner.tell_terminal(text.removeprefix("gpupool: "))

        try:
            on_update(None, None)
            self.owner.wait_for_grant(on_update=on_update)
        except KeyboardInterrupt:
            self._clear(progress)
            return self._stopped(format_duration(time.monotonic() - started), position[0] if position else "queued")
        except GpuPoolError as err:
            why = self.owner.release_reason() or str(err)
            self.owner.cpu_only(f"its queued GPU request ended: {why}")
            return f"no GPU slice for this kernel (its queued request ended: {why}); it runs CPU-only from now on"
        except Exception as err:  # noqa: BLE001 - one line, never a traceback
            self.owner.cpu_only(f"waiting for a GPU failed: {err}")
            return f"waiting for a GPU failed: {err}; this kernel runs CPU-only from now on"
        finally:
            self._clear(progress)
        devices = self.owner.environ.get("CUDA_VISIBLE_DEVICES", "")
        self.owner.say(f"granted after {format_duration(time.monotonic() - started)}: CUDA_VISIBLE_DEVICES={devices}")
        return None

    def _stopped(self, waited: str, where: str) -> str:
        """A wait stopped by an interrupt: the cell's one line; later cells never run as if it had run."""
        lengthen = (
            "let the wait finish: lengthen the client's cell timeout (nbgrader: Execute.timeout; nbconvert: "
            "--ExecutePreprocessor.timeout), or run when the pool has room"
        )
        if self.owner.priority == "batch":
            self.owner.release("its first cell stopped waiting for a GPU")
            message = (
                f"stopped waiting for a GPU after {waited} ({where}); this cell did not run, so this kernel ends "
                f"rather than run the next cells without it; {lengthen}"
            )
            self.owner.say(message)
            self.stopped = message
            self._end(message)  # before any reply: its client sees a kernel that died, never a cell that ran
            return message
        self.stopped = (
            f"an earlier cell stopped waiting for a GPU after {waited} ({where}) and did not run, so this cell does not "
            "run either; restart the kernel to run from the top (it stays queued: %gpupool status shows its place)"
        )
        return f"stopped waiting for a GPU after {waited} ({where}); this cell did not run, nor will later cells: restart the kernel"

    @staticmethod
    def _clear(progress: Any) -> None:
        if progress.handle is None:
            return
        try:
            from IPython.display import clear_output

            clear_output()
        except Exception:  # noqa: BLE001, S110 - the line stays; the cell still runs
            pass


def _end_kernel(message: str, delay: float = END_AFTER_STOPPED_WAIT) -> None:
    """End this kernel now, without replying to the cell: its client fails the run (a dead kernel).
    The cell gets ``message`` on its stderr first (sent within ``delay`` seconds)."""
    try:
        sys.stderr.write(f"gpupool: {message}\n")
        sys.stderr.flush()
        time.sleep(delay)
    except Exception:  # noqa: BLE001, S110 - the terminal has the line already
        pass
    os._exit(1)
