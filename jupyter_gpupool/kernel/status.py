"""What a kernel knows about its GPU slice, and how the magics show it (HTML and plain text)."""

from __future__ import annotations

import datetime as dt
import html
import math
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_gpupool.core.models import Device, Lease, LeaseState, PoolSnapshot, QueueInfo, Transition
from jupyter_gpupool.rest.views import elastic_line
from jupyter_gpupool.units import GIB, MIB, format_duration, format_size
from jupyter_gpupool.wording import grow_wait, remaining, slice_size, upcoming_reclaim


@dataclass(frozen=True)
class RightSizeHint:
    """A suggestion to shrink a slice that peaked far below its size."""

    text: str  # "peaked at 2.1 GiB of 8 — shrink to 3 GiB?"
    memory: str  # the size to reserve, in a form every parser accepts: "3GiB"
    button: str  # "Shrink to 3 GiB"


def _unit(num_bytes: float) -> str:
    return format_size(num_bytes).rsplit(" ", 1)[-1]


def _size_argument(num_bytes: int) -> str:
    if num_bytes % GIB == 0:
        return f"{num_bytes // GIB}GiB"
    if num_bytes % MIB == 0:
        return f"{num_bytes // MIB}MiB"
    return str(int(num_bytes))


def right_size_hint(memory: float | None, peak: float | None) -> RightSizeHint | None:
    """The right-sizing rule of ``%gpupool status``, the widget and the lab sidebar (view.ts, kept equal by a test).

    Suggests the peak plus a quarter, rounded up to whole GiB (at least 1 GiB), and only
    when that is at most half the slice and frees at least 1 GiB.
    """
    if not peak or peak <= 0 or not memory or memory <= 0:
        return None
    suggested = max(1, math.ceil(peak * 1.25 / GIB)) * GIB
    if suggested > memory / 2 or memory - suggested < GIB:
        return None
    unit = _unit(memory)
    slice_text = format_size(memory).replace(f" {unit}", "") if unit == _unit(peak) else format_size(memory)
    target = format_size(suggested)
    return RightSizeHint(
        text=f"peaked at {format_size(peak)} of {slice_text} — shrink to {target}?",
        memory=_size_argument(suggested),
        button=f"Shrink to {target}",
    )


@dataclass
class KernelStatus:
    """This kernel's lease as the magics and the widget show it."""

    lease: Lease | None
    queue: QueueInfo | None = None
    devices: list[Device] = field(default_factory=list)
    idle_timeout: float | None = None
    idle_policy: str = ""
    enforcement: list[str] = field(default_factory=list)
    local_usage: int | None = None  # bytes PyTorch/CuPy of this process hold (None: unknown)
    now: float = field(default_factory=time.time)
    note: str = ""  # e.g. why there is no lease
    unavailable: str | None = None  # why the GPU pool cannot be used (this kernel then runs CPU-only)
    backend: dict[str, Any] = field(default_factory=dict)  # a backend's own facts, e.g. {"slurm": {"job_id": ...}}
    parking: str = ""  # which path parks this kernel and which did last (see kernel/parking.py)
    grow_place: int | None = None  # while its grow waits for room: its place in line (None: unknown)

    # -- derived values, shared by text, HTML and the widget ---------------------------------
    @property
    def state(self) -> str:
        """``granted``, ``queued``, ``suspended``, ``released``; ``resuming`` for a suspended kernel
        queued to come back; ``suspending``, ``restoring`` or ``migrating`` while its server moves it."""
        if self.lease is None and self.unavailable:
            return "unavailable"
        if self.lease is None:
            return "none"
        if self.lease.state is LeaseState.QUEUED and self.lease.resuming:
            return "resuming"
        if self.lease.state is LeaseState.GRANTED and self.lease.transition is not Transition.NONE:
            return self.lease.transition.value
        return self.lease.state.value

    @property
    def parked_text(self) -> str:
        """``6.2 GiB parked in host RAM`` (the whole slice when the server has not said yet)."""
        lease = self.lease
        if lease is None:
            return ""
        parked = lease.parked_memory or lease.memory * max(1, lease.num_gpus)
        return f"{format_size(parked)} parked in host RAM"

    @property
    def used(self) -> int | None:
        """Bytes in use: the watchdog's number (whole process tree) else what frameworks report."""
        if self.lease is not None and self.lease.used_memory is not None:
            return self.lease.used_memory
        return self.local_usage

    @property
    def capacity(self) -> int | None:
        """Bytes the slice spans over all its GPUs."""
        if self.lease is None or self.lease.state in (LeaseState.RELEASED, LeaseState.SUSPENDED):
            return None  # a suspended kernel holds no GPU memory
        return self.lease.memory * max(1, self.lease.num_gpus)

    def share_text(self) -> str:
        lease = self.lease
        if lease is None and self.unavailable:
            return "none: the GPU pool is unavailable, so this kernel runs CPU-only (CUDA_VISIBLE_DEVICES=''); restart it once the pool is back"
        if lease is None:
            return "no GPU slice" + (f": {self.note}" if self.note else "")
        per = slice_size(lease.memory, lease.num_gpus)
        if lease.state is LeaseState.GRANTED:
            on = f"{per} on {self.devices_text()}"
            if lease.transition is Transition.SUSPENDING:
                return f"{on}, being suspended: its GPU memory is being parked in host RAM"
            if lease.transition is Transition.RESTORING:
                return f"{on}, restoring its GPU memory from host RAM"
            if lease.transition is Transition.MIGRATING:
                return f"{on}, moving there from another GPU"
            return on
        if lease.state is LeaseState.QUEUED and lease.resuming:
            return f"{per} resuming — waiting for a GPU ({self.parked_text})"
        if lease.state is LeaseState.QUEUED:
            return f"{per} requested, waiting in the queue"
        if lease.state is LeaseState.SUSPENDED:
            return f"{per} suspended ({self.parked_text}) — resumes on your next cell"
        reason = f": {lease.release_reason}" if lease.release_reason else ""
        return f"released{reason}; ask for a slice with %gpupool reserve SIZE"

    def devices_text(self) -> str:
        if not self.devices:
            return ", ".join(self.lease.devices) if self.lease and self.lease.devices else "no GPU"
        return ", ".join(f"GPU {d.index} ({d.name})" for d in self.devices)

    def usage_text(self) -> str:
        used, capacity = self.used, self.capacity
        if capacity is None:
            return "—"
        if used is None:
            return f"unknown of {format_size(capacity)} (no usage reported yet)"
        percent = 100.0 * used / capacity if capacity else 0.0
        allowed = self.lease.watch_limit() if self.lease is not None else capacity
        over = "  OVER THE SLICE" if used > allowed else ""
        return f"{format_size(used)} of {format_size(capacity)} ({percent:.0f}%){over}"

    def usage_fraction(self) -> float | None:
        used, capacity = self.used, self.capacity
        if used is None or not capacity:
            return None
        return used / capacity

    def hint(self) -> RightSizeHint | None:
        """The right-sizing hint of a granted slice that peaked far below its size, or None."""
        lease = self.lease
        if lease is None or lease.state is not LeaseState.GRANTED:
            return None
        return right_size_hint(lease.guarantee_size, lease.peak_memory)  # burst above the guarantee goes back by itself

    def queue_text(self) -> str:
        if self.lease is None or self.lease.state is not LeaseState.QUEUED:
            return "not queued"
        prefix = "resuming — waiting for a GPU, " if self.lease.resuming else ""
        if self.queue is None:
            return prefix.rstrip(", ") or "queued"
        wait = f", estimated wait {format_duration(self.queue.estimated_wait)}" if self.queue.estimated_wait else ""
        reason = f" ({self.queue.reason})" if self.queue.reason else ""
        return f"{prefix}position {self.queue.position} of {self.queue.length}{wait}{reason}"

    def suspended_text(self) -> str:
        """Why and since when a suspended kernel is parked, and how it comes back."""
        lease = self.lease
        if lease is None or lease.state is not LeaseState.SUSPENDED:
            return ""
        why = lease.suspend_reason or "suspended"
        since = f" {format_duration(self.now - lease.suspended_at)} ago" if lease.suspended_at else ""
        return f"{why}{since}; your next cell resumes it (or %gpupool resume)"

    def idle_text(self) -> str:
        lease = self.lease
        if lease is None or lease.state is not LeaseState.GRANTED:
            return "—"
        if lease.reclaim_at is not None:
            why = f" ({upcoming_reclaim(lease.reclaim_reason)})" if lease.reclaim_reason else ""
            left = max(0.0, lease.reclaim_at - self.now)
            return f"reclaimed in {format_duration(left)}{why} unless you run %gpupool keep"
        if lease.keep_until is not None and lease.keep_until > self.now:
            return f"kept through idle until {_clock(lease.keep_until)} ({remaining(lease.keep_until - self.now)} left)"
        if lease.busy:
            return "busy"
        idle = lease.idle_seconds(self.now)
        if self.idle_timeout and self.idle_policy != "never":
            when = "when others wait" if self.idle_policy == "pressure" else "always"
            left = max(0.0, self.idle_timeout - idle)
            return f"idle {format_duration(idle)}; reclaimable in {format_duration(left)} ({when})"
        return f"idle {format_duration(idle)}"

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs in display order."""
        rows = [("GPU slice", self.share_text()), ("state", self.state)]
        if self.unavailable:
            rows.append(("GPU pool", f"unavailable: {self.unavailable}"))
        if self.lease is not None and self.lease.state is not LeaseState.RELEASED:
            rows.append(("usage", self.usage_text()))
            if self.lease.elastic:
                rows.append(("elastic", elastic_line(self.lease)))
                if self.lease.burst_note:
                    rows.append(("last step", self.lease.burst_note))
                if self.lease.grow_since is not None:
                    wanted = self.lease.grow_wanted * max(1, self.lease.num_gpus)
                    rows.append(("waiting", grow_wait(wanted, _clock(self.lease.grow_since), self.grow_place)))
            if self.lease.state is LeaseState.QUEUED:
                rows.append(("queue", self.queue_text()))
            if self.lease.state is LeaseState.SUSPENDED:
                rows.append(("suspended", self.suspended_text()))
            else:
                rows.append(("idle", self.idle_text()))
            hint = self.hint()
            if hint is not None:
                rows.append(("right size", f"{hint.text} %gpupool reserve {hint.memory}"))
            if self.lease.flagged:
                rows.append(("flagged", self.lease.flagged))
        slurm = self.backend.get("slurm")
        if slurm:
            where = f"Slurm job {slurm.get('job_id')}, partition {slurm.get('partition') or '(default)'}"
            where += f", node {slurm['node']}" if slurm.get("node") else ""
            where += f", position {slurm['position']} among pending jobs" if slurm.get("position") else ""
            rows.append(("slurm", where))
        if self.lease is not None:
            rows.append(("lease", f"{self.lease.id} (owner {self.lease.owner})"))
        if self.enforcement:
            rows.append(("enforcement", "; ".join(self.enforcement)))
        if self.parking:
            rows.append(("parking", f"parked by {self.parking}"))
        return rows


def _clock(when: float) -> str:
    return dt.datetime.fromtimestamp(when).strftime("%H:%M")


def _table_html(title: str, rows: list[tuple[str, str]]) -> str:
    body = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(v)}</td></tr>"
        for k, v in rows
    )
    return f"<div class='gpupool-status'><b>{html.escape(title)}</b><table>{body}</table></div>"


def _table_text(title: str, rows: list[tuple[str, str]]) -> str:
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([title] + [f"  {k.ljust(width)}  {v}" for k, v in rows])


class Report:
    """A titled key/value table with an HTML and a plain-text form (``display(Report(...))``)."""

    def __init__(self, title: str, rows: list[tuple[str, str]], footer: str = "") -> None:
        self.title = title
        self.rows = rows
        self.footer = footer

    def _repr_html_(self) -> str:
        foot = f"<div>{html.escape(self.footer)}</div>" if self.footer else ""
        return _table_html(self.title, self.rows) + foot

    def __repr__(self) -> str:
        return _table_text(self.title, self.rows) + (f"\n{self.footer}" if self.footer else "")

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def unavailable_status(reason: str) -> KernelStatus:
    """What this kernel shows while the pool cannot be used: no slice, and why."""
    return KernelStatus(lease=None, unavailable=reason)


def status_report(status: KernelStatus, title: str = "gpupool: this kernel's GPU slice") -> Report:
    return Report(title, status.rows())


def granted_title(lease: Lease | None) -> str:
    """The heading once a wait ends: what the slice is doing now, not only that it was granted."""
    if lease is not None and lease.state is LeaseState.GRANTED:
        if lease.transition is Transition.RESTORING:
            return "gpupool: slice granted, restoring its GPU memory from host RAM"
        if lease.transition is Transition.MIGRATING:
            return "gpupool: slice granted, moving to another GPU"
        if lease.transition is Transition.SUSPENDING:
            return "gpupool: slice granted, being suspended"
        return "gpupool: slice granted"
    return "gpupool: this kernel's GPU slice"


class QueueReport:
    """The pool's devices and queue, from a snapshot filtered for this user."""

    def __init__(self, snapshot: PoolSnapshot, own_lease_id: str | None) -> None:
        self.snapshot = snapshot
        self.own = own_lease_id

    def device_rows(self) -> list[list[str]]:
        rows = []
        for dev in self.snapshot.devices:
            total = dev.get("memory_total") or 0
            leased = dev.get("memory_leased") or 0
            health = "" if dev.get("healthy", True) else " (unhealthy)"
            rows.append(
                [
                    f"GPU {dev.get('index')}",
                    str(dev.get("name", "")) + health,
                    f"{format_size(leased)} of {format_size(total)} leased",
                ]
            )
        return rows

    def queue_rows(self) -> list[list[str]]:
        rows = []
        for position, item in enumerate(self.snapshot.queue, start=1):
            lease_id = str(item.get("id") or "")
            mine = " ← this kernel" if lease_id and lease_id == self.own else ""
            who = str(item.get("owner") or ("you" if item.get("mine") else "another user"))
            since = item.get("created_at")
            waited = format_duration(self.snapshot.now - since) if isinstance(since, (int, float)) else "?"
            gpus = int(item.get("num_gpus") or 1)
            size = format_size(item.get("memory"))
            rows.append(
                [
                    str(item.get("queue_position") or position),
                    f"{gpus} × {size}" if gpus > 1 else size,
                    who,
                    waited + mine,
                ]
            )
        return rows

    def _repr_html_(self) -> str:
        def table(head: list[str], rows: list[list[str]]) -> str:
            th = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in head)
            trs = "".join(
                "<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in r) + "</tr>"
                for r in rows
            )
            return f"<table><tr>{th}</tr>{trs}</table>"

        queue = (
            table(["#", "memory", "owner", "waiting"], self.queue_rows())
            if self.snapshot.queue
            else "<div>the queue is empty</div>"
        )
        return (
            "<div class='gpupool-queue'><b>gpupool: GPUs</b>"
            + table(["GPU", "model", "memory"], self.device_rows())
            + "<b>queue</b>"
            + queue
            + "</div>"
        )

    def __repr__(self) -> str:
        lines = ["gpupool: GPUs"] + ["  " + "  ".join(r) for r in self.device_rows()]
        if self.snapshot.queue:
            lines.append(f"queue ({len(self.snapshot.queue)} waiting)")
            lines += ["  " + "  ".join(r) for r in self.queue_rows()]
        else:
            lines.append("queue: empty")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))
