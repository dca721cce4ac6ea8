"""``%gpupool`` line magic: see, grow, shrink, keep and give back this kernel's GPU slice."""

from __future__ import annotations

import argparse
import re
import shlex
import time
from collections.abc import Callable
from typing import Any

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.display import display

from jupyter_gpupool.core import validate
from jupyter_gpupool.core.models import Lease, LeaseState, QueueInfo
from jupyter_gpupool.enforcement.caps import free_framework_caches
from jupyter_gpupool.errors import GpuPoolError, PoolUnavailable
from jupyter_gpupool.kernel.client import DEFAULT_KEEP, PoolClient
from jupyter_gpupool.kernel.resume import ProgressLine, needs_waiting, progress_text
from jupyter_gpupool.kernel.status import QueueReport, Report, granted_title, status_report, unavailable_status
from jupyter_gpupool.units import DURATION_FORMS, SIZE_FORMS, format_duration, format_size, parse_duration
from jupyter_gpupool.wording import remaining, slice_on

DESCRIPTION = (
    """\
See and manage this kernel's slice of the GPU pool.

  %gpupool status                      this kernel's slice, usage, queue position, idle time
  %gpupool reserve 12GiB [--limit 32GiB] [--for 2h] [--gpus 2]
                                       grow or shrink the slice (or ask for one); --limit: how far
                                       it may grow while the GPU has room (0: fixed); --for holds
                                       it through idle for that long
  %gpupool release                     give the slice back to the pool
  %gpupool queue                       the pool's GPUs and who waits
  %gpupool keep [1h]                   hold the slice through idle (default 1h)
  %gpupool wait [--timeout 10m]        block until the slice is granted, showing the queue position
  %gpupool suspend                     park this kernel's GPU memory in host RAM and free the GPU;
                                       your variables stay, and your next cell resumes it
  %gpupool resume [--timeout 10m]      bring a suspended kernel back now, waiting for a GPU
  %gpupool help                        this text

Sizes: """
    + SIZE_FORMS
    + """.
Durations: """
    + DURATION_FORMS
    + "."
)


class MagicError(Exception):
    """A one-line error for the user: IPython shows ``_render_traceback_`` instead of a traceback.

    The cell still fails, so "Run all", nbclient and papermill stop there.
    """

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cause = cause

    def _render_traceback_(self) -> list[str]:
        from IPython import get_ipython

        shell = get_ipython()
        colors = str(getattr(shell, "colors", "")).lower()
        if colors == "nocolor":
            return [f"gpupool: {self.message}"]
        return [f"\x1b[31mgpupool: {self.message}\x1b[0m"]


class _HelpShown(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class _Parser(argparse.ArgumentParser):
    """argparse that reports instead of exiting the kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # "-5GiB" and "-1h" are (bad) values, not options: units.py says what is wrong with them.
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> Any:  # type: ignore[override]
        one_line = " ".join(message.split())  # argparse quotes what was typed, line breaks included
        raise MagicError(f"{one_line}; {self.prog} --help shows the accepted forms")

    def exit(self, status: int = 0, message: str | None = None) -> Any:  # type: ignore[override]
        raise _HelpShown(message or "")

    def print_help(self, file: Any = None) -> None:
        raise _HelpShown(self.format_help())


class _JoinWords(argparse.Action):
    """``12 GB`` typed as two words is one value (units.py reads it; one grammar with the REST API)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, " ".join(values) or None)


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid GPU count {text!r}: expected a whole number from 1 to 64") from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"invalid GPU count {text!r}: expected a whole number from 1 to 64")
    return value


def _escape(text: str) -> str:
    """argparse %-formats help strings: ``25%`` must be written ``25%%``."""
    return text.replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="%gpupool",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.add_parser("status", help="this kernel's slice, usage, queue position and idle time")
    reserve = sub.add_parser(
        "reserve",
        help="grow or shrink the slice, hold it through idle, or ask for one",
        description=f"Grow or shrink this kernel's slice, or ask for one. SIZE is {SIZE_FORMS}.",
    )
    reserve.add_argument("size", nargs="*", action=_JoinWords, help=_escape(f"memory per GPU: {SIZE_FORMS}"))
    reserve.add_argument(
        "--for", dest="duration", metavar="DURATION", help=_escape(f"hold through idle this long: {DURATION_FORMS}")
    )
    reserve.add_argument("--gpus", type=_gpu_count, metavar="N", help="number of GPUs (1 to 64)")
    reserve.add_argument(
        "--limit", metavar="LIMIT",
        help=_escape(f"how far the slice may grow above its size while the GPU has room: {SIZE_FORMS}; 0 for a fixed slice"),
    )
    sub.add_parser("release", help="give the slice back to the pool")
    sub.add_parser("queue", help="the pool's GPUs and its queue")
    keep = sub.add_parser("keep", help="hold the slice through idle (default 1h)")
    keep.add_argument("duration", nargs="*", action=_JoinWords, default=None, help=_escape(f"{DURATION_FORMS} (default {DEFAULT_KEEP})"))
    wait = sub.add_parser("wait", help="block until the slice is granted")
    wait.add_argument("--timeout", metavar="DURATION", help=_escape(f"give up after this long: {DURATION_FORMS}"))
    sub.add_parser("suspend", help="park the GPU memory in host RAM; the next cell resumes it")
    resume = sub.add_parser("resume", help="bring a suspended kernel back now, waiting for a GPU")
    resume.add_argument("--timeout", metavar="DURATION", help=_escape(f"stop waiting after this long: {DURATION_FORMS}"))
    sub.add_parser("help", help="show this help")
    return parser


class WaitProgress:
    """Shows the queue position while ``%gpupool wait`` blocks: one display, updated in place."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.last: tuple[Any, ...] | None = None
        self.started = time.time()

    def __call__(self, lease: Lease, info: QueueInfo | None) -> None:
        # The reason counts: "pool unavailable, retrying in 4 s" changes nothing else.
        key = (lease.state, info.position if info else None, info.length if info else None, info.reason if info else None)
        if key == self.last:
            return
        self.last = key
        if lease.state is LeaseState.QUEUED and info is not None:
            wait = f", estimated wait {format_duration(info.estimated_wait)}" if info.estimated_wait else ""
            reason = f" ({info.reason})" if info.reason else ""
            text = f"waiting for {format_size(lease.memory)}: position {info.position} of {info.length}{wait}{reason}"
        elif lease.state is LeaseState.QUEUED:
            text = f"waiting for {format_size(lease.memory)}"
        else:
            text = f"lease {lease.state.value}"
        report = Report("gpupool: waiting for a GPU slice", [("status", text)])
        if self.handle is None:
            self.handle = display(report, display_id=True)
        else:
            self.handle.update(report)


@magics_class
class GpuPoolMagics(Magics):
    """The ``%gpupool`` magic. The client is made on first use, so loading the extension stays cheap."""

    def __init__(self, shell: Any, client_factory: Any, parking_line: Callable[[], str] | None = None) -> None:
        super().__init__(shell)
        self._client_factory = client_factory
        self._parking_line = parking_line  # which path parks this kernel (see kernel/parking.py)
        self._client: PoolClient | None = None
        self.parser = build_parser()

    @property
    def client(self) -> PoolClient:
        if self._client is None:
            self._client = self._client_factory()
        return self._client

    @line_magic
    def gpupool(self, line: str) -> None:
        """See and manage this kernel's GPU slice: %gpupool help."""
        try:
            words = shlex.split(line)
        except ValueError as err:  # unbalanced quotes
            raise MagicError(f"cannot read the arguments: {err}") from None
        try:
            args = self.parser.parse_args(words or ["status"])
        except _HelpShown as shown:
            print(shown.text.rstrip())
            return None
        handler = getattr(self, f"_do_{args.command}")
        try:
            return handler(args)
        except MagicError:
            raise
        except GpuPoolError as err:
            raise MagicError(str(err), err) from None

    # -- subcommands -----------------------------------------------------------------------------
    def _do_help(self, args: argparse.Namespace) -> None:
        print(self.parser.format_help().rstrip())

    def _do_status(self, args: argparse.Namespace) -> None:
        try:
            status = self.client.status()
        except PoolUnavailable as err:  # the pool's state, not a failure of the magic
            status = unavailable_status(str(err))
        if self._parking_line is not None and status.lease is not None:
            status.parking = self._parking_line()
        display(status_report(status))

    def _do_reserve(self, args: argparse.Namespace) -> None:
        # The smallest-slice rule every surface applies, before the pool is asked anything.
        if args.size is not None:
            validate.slice_floor(args.size, "{}", "%gpupool reserve {}")
        if args.limit is not None and args.limit.strip() != "0":
            validate.slice_floor(args.limit, "--limit {}", "%gpupool reserve SIZE --limit {}")
        before = self.client.status().lease
        lease = self.client.reserve(args.size, duration=args.duration, num_gpus=args.gpus, limit=args.limit)
        status = self.client.status()
        waiting = getattr(lease, "reserve_wanted", 0)
        if waiting and lease.state is LeaseState.GRANTED:
            # Burst beside it is taken back for it; it waits in line and this cell does not.
            title = f"gpupool: reserve of {slice_on(waiting, lease.num_gpus)} queued"
            footer = (
                f"the slice stays {format_size(lease.memory)} until the burst other kernels use beside it is given back, "
                "then grows to it; this cell does not wait (%gpupool status shows it)"
            )
            display(Report(title, status.rows(), footer))
            return
        if before is None or before.state is LeaseState.RELEASED:
            title = "gpupool: new slice requested"
        elif before.memory != lease.memory:
            title = f"gpupool: slice changed from {format_size(before.memory)} to {format_size(lease.memory)}"
        else:
            title = "gpupool: slice unchanged"
        footer = ""
        if lease.keep_until is not None and args.duration:
            footer = f"held through idle until {time.strftime('%H:%M', time.localtime(lease.keep_until))}"
        if lease.state is LeaseState.QUEUED:
            footer = "queued: run %gpupool wait to block until it is granted"
        elif before is not None and before.devices and lease.devices and tuple(before.devices) != tuple(lease.devices):
            footer = "the slice moved to other GPUs: restart the kernel to use them"
        display(Report(title, status.rows(), footer))

    def _do_release(self, args: argparse.Namespace) -> None:
        lease = self.client.release()
        free_framework_caches()  # after a release, hand cached blocks back so the memory really frees
        display(
            Report(
                "gpupool: slice released",
                [("released", slice_on(lease.memory, len(lease.devices) or lease.num_gpus))],
                "GPU memory this kernel still holds is not yours anymore; %gpupool reserve SIZE asks for a new slice",
            )
        )

    def _do_queue(self, args: argparse.Namespace) -> None:
        display(QueueReport(self.client.snapshot(), self.client.lease_id))

    def _do_keep(self, args: argparse.Namespace) -> None:
        lease = self.client.keep(args.duration)
        until = lease.keep_until
        text = time.strftime("%H:%M", time.localtime(until)) if until else "unknown"
        left = remaining(until - time.time()) if until else "?"
        display(Report("gpupool: slice kept", [("held through idle until", f"{text} ({left})")]))

    def _do_wait(self, args: argparse.Namespace) -> None:
        timeout = parse_duration(args.timeout) if args.timeout else None
        progress = WaitProgress()
        try:
            lease = self.client.wait_for_grant(timeout=timeout, on_update=progress)
        except KeyboardInterrupt:
            raise MagicError("stopped waiting; the request stays in the queue (%gpupool queue shows it)") from None
        except TimeoutError:
            raise MagicError(f"still queued after {format_duration(timeout)}; the request stays in the queue") from None
        if lease.state is LeaseState.QUEUED:
            raise MagicError(f"still queued after {format_duration(timeout)}; the request stays in the queue")
        if lease.state is LeaseState.RELEASED:
            raise MagicError(f"the request was released while waiting: {lease.release_reason or 'no reason given'}")
        status = self.client.status()
        report = status_report(status, granted_title(status.lease))
        if progress.handle is not None:
            progress.handle.update(report)
        else:
            display(report)


    def _do_suspend(self, args: argparse.Namespace) -> None:
        lease = self.client.suspend()  # RequestRefused carries the pool's one-line reason
        if lease.state is LeaseState.SUSPENDED:
            title = "gpupool: suspended"
        else:
            title = "gpupool: suspending"
        display(
            Report(
                title,
                [("GPU slice", slice_on(lease.memory, len(lease.devices) or lease.num_gpus))],
                "GPU memory will be parked in host RAM; your next cell resumes it",
            )
        )

    def _do_resume(self, args: argparse.Namespace) -> None:
        timeout = parse_duration(args.timeout) if args.timeout else None
        client = self.client
        if not needs_waiting(client.current()):
            display(status_report(client.status(), "gpupool: this kernel is not suspended; nothing to resume"))
            return
        progress = ProgressLine()
        started = time.time()

        def on_update(lease: Lease, info: QueueInfo | None) -> None:
            progress.show(progress_text(lease, info))

        try:
            on_update(client.resume(), None)
            client.wait_until_running(timeout=timeout, on_update=on_update)
        except KeyboardInterrupt:
            raise MagicError("stopped waiting; this kernel stays queued to resume (%gpupool status shows its place)") from None
        except TimeoutError:
            raise MagicError(
                f"not resumed after {format_duration(timeout)}; it stays queued to resume (%gpupool status shows its place)"
            ) from None
        status = client.status()
        progress.show(f"gpupool: resumed on {status.devices_text()} after {format_duration(time.time() - started)}")
