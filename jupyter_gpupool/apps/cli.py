"""``jupyter gpupool``: look at and manage the pool from a terminal.

Subcommands are traitlets applications; each maps domain errors to a one-line message and an
exit code (see :mod:`jupyter_gpupool.errors`), never a traceback.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import os
import sys
from typing import Any

from traitlets import Bool, Unicode

from jupyter_gpupool.application import (
    EXIT_USAGE,
    GpuPoolBaseApp,
    current_user,
)
from jupyter_gpupool.backends.local.pool import LOCAL_ADMIN_GROUP, local_admin
from jupyter_gpupool.backends.remote import RemotePool, remote_resume, remote_suspend
from jupyter_gpupool.core import validate
from jupyter_gpupool.core.metering import FORMATS, PERIODS, REPORT_KEYS, check_choice, columns
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState, PriorityClass
from jupyter_gpupool.core.policy import WEEKDAYS
from jupyter_gpupool.enforcement.claims import clear_kernel_claim
from jupyter_gpupool.errors import InvalidInput, NotAuthorized
from jupyter_gpupool.units import format_duration, format_size, parse_duration
from jupyter_gpupool.wording import slice_size


def device_rows(snapshot: Any) -> list[list[str]]:
    rows = []
    for d in snapshot.devices:
        outside = int(d.get("memory_unpooled") or 0)
        free = max(0, d["memory_leasable"] - d["memory_leased"] - outside)
        rows.append(
            [
                str(d["index"]),
                d["name"],
                format_size(d["memory_total"]),
                format_size(d["memory_leased"]),
                format_size(d["memory_used"]),
                format_size(outside) if outside else "-",
                format_size(free),
                "ok" if d["healthy"] else f"UNHEALTHY: {d['health_reason']}",
            ]
        )
    return rows


def unpooled_section(snapshot: Any) -> list[str]:
    """Lines on GPU memory held outside the pool (whose, where the viewer may see it)."""
    if not snapshot.unpooled:
        return []
    index = {d["uuid"]: str(d["index"]) for d in snapshot.devices}
    rows = [
        [
            index.get(item["device"], item["device"]),
            format_size(item["bytes"]),
            str(item["pid"]) if item.get("pid") is not None else "(hidden)",
            item.get("user") or "-",
            item["why"],
            (item.get("command") or "")[:40],
        ]
        for item in snapshot.unpooled
    ]
    total = sum(int(item["bytes"]) for item in snapshot.unpooled)
    return [
        "",
        f"Outside the pool ({format_size(total)} held by processes without a granted lease; the pool does not grant it):",
        table(["GPU", "memory", "pid", "user", "why", "command"], rows),
    ]


def lease_state_text(item: dict[str, Any]) -> str:
    """``granted``, ``suspended``, ``resuming`` (queued to come back), ``granted, restoring``."""
    if item["state"] == "queued" and item.get("resuming"):
        return "resuming"
    if item.get("transition"):
        return f"{item['state']}, {item['transition']}"
    return str(item["state"])


def lease_place_text(item: dict[str, Any]) -> str:
    """Where a lease is: its queue position, its parked host RAM, or its GPUs."""
    if item["state"] == "queued":
        return str(item.get("queue_position") or "")
    if item["state"] == "suspended":
        return f"{format_size(item.get('parked_memory') or 0)} parked in host RAM"
    return ",".join(u[:12] for u in item["devices"])


def memory_text(item: dict[str, Any]) -> str:
    """A lease's size per GPU: ``8 GiB``, or for an elastic slice ``2 GiB (6 GiB now, up to 16 GiB)``."""
    memory = int(item["memory"])
    guarantee = int(item.get("guarantee") or memory)
    limit = int(item.get("burst_limit") or 0)
    if limit <= guarantee:
        return format_size(memory)
    return f"{format_size(guarantee)} ({format_size(memory)} now, up to {format_size(limit)})"


def lease_rows(leases: list[dict[str, Any]], now: float) -> list[list[str]]:
    rows = []
    for item in leases:
        since = (item.get("suspended_at") if item["state"] == "suspended" else None) or item.get("granted_at") or item.get("created_at") or now
        rows.append(
            [
                item.get("id") or "-",
                item.get("owner") or "(another user)",
                lease_state_text(item),
                (f"{item['num_gpus']} × " if (item.get("num_gpus") or 1) > 1 else "") + memory_text(item),
                lease_place_text(item),
                format_duration(now - since),
                (item.get("kernel_id") or item.get("label") or "")[:36],
            ]
        )
    return rows


def _local(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts)


def reservation_window(reservation: Any) -> str:
    """When it holds memory, in local time: ``Tue,Thu 09:00–11:00 weekly`` or ``Tue 2026-12-01 09:00–11:00``."""
    if reservation.weekdays:
        days = ",".join(WEEKDAYS[d].capitalize() for d in reservation.weekdays)
        return f"{days} {reservation.daily_start}–{reservation.daily_end} weekly"
    if reservation.start is None or reservation.end is None:
        return "-"
    start, end = _local(reservation.start), _local(reservation.end)
    end_text = f"{end:%H:%M}" if end.date() == start.date() else f"{end:%a %Y-%m-%d %H:%M}"
    return f"{start:%a %Y-%m-%d %H:%M}–{end_text}"


def reservation_times(reservation: Any, now: float) -> tuple[bool, float | None, float | None]:
    """(active now, when the current window closes, when the next one opens), as POSIX seconds."""
    active = reservation.active(now)
    if reservation.weekdays:
        here = _local(now)
        closes = opens = None
        for offset in range(8):
            day = (here + dt.timedelta(days=offset)).date()
            if day.weekday() not in reservation.weekdays:
                continue
            begin = dt.datetime.combine(day, dt.time.fromisoformat(reservation.daily_start))
            finish = dt.datetime.combine(day, dt.time.fromisoformat(reservation.daily_end))
            if active and closes is None and begin <= here < finish:
                closes = finish.timestamp()
            elif begin > here and opens is None:
                opens = begin.timestamp()
        return active, closes, opens
    if reservation.start is None or reservation.end is None:
        return False, None, None
    return active, reservation.end if active else None, reservation.start if reservation.start > now else None


def reservation_state(reservation: Any, now: float) -> str:
    """``active until 11:00``, ``next Tue 2026-12-01 09:00 (in 2 d 3 h)`` or ``ended``."""
    active, closes, opens = reservation_times(reservation, now)
    if active:
        return f"active until {_local(closes):%H:%M}" if closes else "active"
    if opens is not None:
        return f"next {_local(opens):%a %Y-%m-%d %H:%M} (in {format_duration(opens - now)})"
    return "ended"


def reservation_json(reservation: Any, now: float) -> dict[str, Any]:
    active, closes, opens = reservation_times(reservation, now)
    return {**reservation.to_json(), "active": active, "closes_at": closes, "next_start": opens}


def reservation_table(reservations: list[Any], now: float) -> str:
    rows = []
    for r in reservations:
        who = [f"group {g}" for g in r.groups] + [f"user {u}" for u in r.users]
        rows.append([r.name, ", ".join(who), format_size(r.memory), reservation_window(r), reservation_state(r, now)])
    zone = dt.datetime.now().astimezone().tzname() or "local"
    return table(["reservation", "for", "memory", f"window ({zone})", "now"], rows)


def table(headers: list[str], rows: list[list[str]]) -> str:
    if not rows:
        return "  (none)"
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def device_control_status(pool: Any) -> dict[str, Any]:
    """``device_control`` of ``status --json``: as the broker runs it (all of it for admins, the mode
    for others), or off without a broker (docs/device-control.md)."""
    if isinstance(pool, RemotePool):
        told = pool.info().get("device_control")
        return dict(told) if isinstance(told, dict) else {"mode": "off", "reason": "the broker does not say (an earlier version)"}
    return {"mode": "off", "reason": "no broker: a single-user pool, whose GPUs are all its user's"}


class StatusApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-status"
    description = "Show devices (total, leased, used, free), leases and the queue."
    flags = {
        **GpuPoolBaseApp.flags,
        "all": ({"StatusApp": {"all": True}}, "Show every lease with its user (admins)."),
    }
    all = Bool(False, help="Show every lease with its user.").tag(config=True)

    def run(self) -> None:
        self.refuse_extra_args()
        pool = self.make_pool()
        pool.tick()
        snapshot = pool.snapshot(viewer=current_user(), admin=self.all)
        reservations = pool.reservations()
        data = {
            "backend": pool.backend.describe(),
            "db": pool.db_path,
            "devices": snapshot.devices,
            "leases": snapshot.leases,
            "queue": snapshot.queue,
            "quota": snapshot.quota,
            "reservations": [reservation_json(r, snapshot.now) for r in reservations],
            "unpooled": snapshot.unpooled,
            "device_control": device_control_status(pool),
        }
        text = "\n".join(
            [
                f"Pool: {pool.backend.describe()}" + ("" if pool.db_path in pool.backend.describe() else f"  (db {pool.db_path})"),
                "",
                table(["GPU", "name", "total", "leased", "used", "outside pool", "free", "health"], device_rows(snapshot)),
                *unpooled_section(snapshot),
                "",
                f"Leases ({sum(1 for l in snapshot.leases if l['state'] != 'queued')} held, {len(snapshot.queue)} queued):",
                table(["lease", "user", "state", "memory", "GPU/pos", "for", "kernel"], lease_rows(snapshot.leases, snapshot.now)),
                *(["", "Reservations:", reservation_table(reservations, snapshot.now)] if reservations else []),
            ]
        )
        self.emit(data, text)


class LeasesApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-leases"
    description = "List live leases (yours, or everyone's with --all)."
    flags = {
        **GpuPoolBaseApp.flags,
        "all": ({"LeasesApp": {"all": True}}, "Every user's leases."),
        "released": ({"LeasesApp": {"released": True}}, "Include released leases."),
    }
    all = Bool(False, help="Every user's leases.").tag(config=True)
    released = Bool(False, help="Include released leases.").tag(config=True)

    def run(self) -> None:
        self.refuse_extra_args()
        pool = self.make_pool()
        pool.tick()
        owner = None if self.all else current_user()
        leases = pool.leases(owner=owner, include_released=self.released)
        now = pool.clock()
        data = [lease.to_json() for lease in leases]
        self.emit(data, table(["lease", "user", "state", "memory", "GPU/pos", "for", "kernel"], lease_rows(data, now)))


class QueueApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-queue"
    description = "Show the queue in service order with estimated waits."

    def run(self) -> None:
        self.refuse_extra_args()
        pool = self.make_pool()
        pool.tick()
        user = current_user()
        rows, data = [], []
        for lease in pool.queue():
            info = pool.queue_info(lease.id)
            view = pool.view_lease(lease, user, admin=True)
            view.update(position=info.position if info else None, estimated_wait=info.estimated_wait if info else None)
            data.append(view)
            rows.append(
                [
                    str(view["position"]),
                    lease.id,
                    lease.owner,
                    slice_size(lease.memory, lease.num_gpus),
                    lease.priority.value,
                    format_duration(info.estimated_wait if info else None),
                    info.reason if info else "",
                ]
            )
        self.emit(data, table(["pos", "lease", "user", "memory", "class", "wait", "why"], rows))


class ReleaseApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-release"
    takes_arguments = True
    description = "Release a lease: jupyter gpupool release LEASE_ID"

    def run(self) -> None:
        if len(self.extra_args) != 1:
            raise InvalidInput("give exactly one lease id: jupyter gpupool release LEASE_ID (see `jupyter gpupool leases`)")

        pool = self.make_pool()
        lease = pool.get(self.extra_args[0])
        user = current_user()
        if not getattr(pool, "remote", False) and lease.owner != user and not local_admin(pool.db_path):
            raise NotAuthorized(f"lease {lease.id} belongs to another user; only its owner or a pool admin may release it")
        released = pool.release(lease.id, reason=f"released by {user} from the command line")
        self.emit(released.to_json(), f"released {released.id} ({slice_size(released.memory, released.num_gpus)})")


class ClearClaimApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-clear-claim"
    takes_arguments = True
    description = (
        "Clear a stale claim on a kernel id (pool admins, on the pool file): jupyter gpupool clear-claim KERNEL_ID"
    )

    def run(self) -> None:
        if len(self.extra_args) != 1:
            raise InvalidInput("give exactly one kernel id: jupyter gpupool clear-claim KERNEL_ID")
        pool = self.make_pool()
        if getattr(pool, "remote", False):
            raise InvalidInput("clear a claim on the broker's host, on its pool file: jupyter gpupool clear-claim KERNEL_ID --db PATH")
        if not local_admin(pool.db_path):
            raise NotAuthorized(f"only a pool admin (root, the pool folder's owner, group {LOCAL_ADMIN_GROUP}) may clear a claim")
        kernel_id = self.extra_args[0]
        lease = clear_kernel_claim(pool, kernel_id, by=f"{current_user()} from the command line")
        owner = lease.owner if lease is not None else None
        text = f"kernel {kernel_id} is nobody's now" + (f" (it was {owner}'s)" if owner else " (no lease ever named it)")
        self.emit({"kernel_id": kernel_id, "was_owner": owner}, text)


class _TransitionApp(GpuPoolBaseApp):
    """``suspend`` and ``resume``: one lease id; its owner or a pool admin (a broker decides for itself)."""

    verb = ""
    takes_arguments = True

    def lease_for_caller(self) -> tuple[Any, Lease]:
        if len(self.extra_args) != 1:
            raise InvalidInput(
                f"give exactly one lease id: jupyter gpupool {self.verb} LEASE_ID (see `jupyter gpupool leases`)"
            )

        pool = self.make_pool()
        lease = pool.get(self.extra_args[0])
        if not getattr(pool, "remote", False) and lease.owner != current_user() and not local_admin(pool.db_path):
            raise NotAuthorized(
                f"lease {lease.id} belongs to another user; only its owner or a pool admin may {self.verb} it"
            )
        return pool, lease


class SuspendApp(_TransitionApp):
    name = "jupyter-gpupool-suspend"
    description = (
        "Suspend a kernel: park its GPU memory in host RAM and free the GPU; its next cell resumes it. "
        "jupyter gpupool suspend LEASE_ID"
    )
    verb = "suspend"

    def run(self) -> None:
        pool, lease = self.lease_for_caller()
        reason = f"suspended by {current_user()} from the command line"
        if getattr(pool, "remote", False):
            changed = remote_suspend(pool, lease.id, reason)
        else:
            changed = pool.suspend(lease.id, reason=reason)  # RequestRefused says why not (exit 3)
        self.emit(
            changed.to_json(),
            f"suspending {changed.id} ({slice_size(changed.memory, changed.num_gpus)}): its server parks the GPU memory in host RAM;"
            " the kernel's next cell resumes it",
        )


class ResumeApp(_TransitionApp):
    name = "jupyter-gpupool-resume"
    description = "Queue a suspended kernel to come back onto a GPU: jupyter gpupool resume LEASE_ID"
    verb = "resume"

    def run(self) -> None:
        pool, lease = self.lease_for_caller()
        if lease.state is LeaseState.RELEASED:
            raise InvalidInput(f"lease {lease.id} was released ({lease.release_reason or 'no reason given'}); nothing to resume")
        if getattr(pool, "remote", False):
            changed = remote_resume(pool, lease.id)
        else:
            changed = pool.resume(lease.id)
        if changed.state is LeaseState.QUEUED and changed.resuming:
            position = getattr(pool.queue_info(changed.id), "position", None)
            text = f"{changed.id} is queued to resume" + (f", position {position}" if position else "")
        elif lease.state is LeaseState.SUSPENDED:
            text = f"{changed.id} is being restored onto {','.join(u[:12] for u in changed.devices)}"
        else:
            text = f"{changed.id} is not suspended ({lease_state_text(changed.to_json())}); nothing to resume"
        self.emit(changed.to_json(), text)


class PriorityApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-priority"
    takes_arguments = True
    description = (
        "Re-prioritise a lease: jupyter gpupool priority LEASE_ID batch|normal|high "
        "(admins; on a local pool anyone may lower their own lease)"
    )

    def run(self) -> None:
        if len(self.extra_args) != 2:
            raise InvalidInput("give a lease id and a class: jupyter gpupool priority LEASE_ID batch|normal|high")
        lease_id, priority = self.extra_args
        try:
            wanted = PriorityClass(priority)
        except ValueError:
            raise InvalidInput(f"invalid priority class {priority!r}: use batch, normal or high") from None

        pool = self.make_pool()
        lease = pool.get(lease_id)
        # A broker decides for itself (admins only); on a local pool anyone may lower their own lease.
        if not getattr(pool, "remote", False) and not local_admin(pool.db_path):
            who = f"root, the owner of {os.path.dirname(os.path.abspath(pool.db_path))} or members of {LOCAL_ADMIN_GROUP}"
            if lease.owner != current_user():
                raise NotAuthorized(f"lease {lease.id} belongs to another user; only a pool admin ({who}) may re-prioritise it")
            if wanted.rank > lease.priority.rank:
                raise NotAuthorized(
                    f"only a pool admin ({who}) may raise a lease's priority; you may lower your own (e.g. to batch)"
                )
        changed = pool.set_priority(lease_id, wanted.value)
        self.emit(changed.to_json(), f"{changed.id} is now {changed.priority.value}")


def parse_day(text: str) -> float:
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise InvalidInput(f"invalid date {text!r}: expected a date like 2026-11-01 or 2026-11-01T09:00") from None


class ReportApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-report"
    description = "GPU-hours, GiB·hours held and active, and cost, per user, group or kernel, per day, week or month."
    aliases = {
        **GpuPoolBaseApp.aliases,
        "since": "ReportApp.since",
        "until": "ReportApp.until",
        "by": "ReportApp.by",
        "period": "ReportApp.period",
        "format": "ReportApp.format",
    }
    since = Unicode("", help="Start date (ISO 8601, e.g. 2026-11-01); default: everything.").tag(config=True)
    until = Unicode("", help="End date (ISO 8601); default: now.").tag(config=True)
    # Plain strings checked in run(): a traitlets Enum would fail as "CRITICAL | Bad config", exit 1.
    by = Unicode("user", help="Group rows by user, group or kernel.").tag(config=True)
    period = Unicode("none", help="One row per key per day, week (from Monday) or month, local time; none: one per key.").tag(
        config=True
    )
    format = Unicode("table", help="Output format: table, csv or json.").tag(config=True)

    def run(self) -> None:
        by = check_choice(self.by, REPORT_KEYS, "--by")
        period = check_choice(self.period, PERIODS, "--period")
        fmt = "json" if self.json else check_choice(self.format, FORMATS, "--format")
        since = parse_day(self.since) if self.since else None
        until = parse_day(self.until) if self.until else None
        validate.time_range(since, until, f"--since {self.since}", f"--until {self.until}")
        pool = self.make_pool()
        rows = pool.report(since=since, until=until, by=by, period=period)
        policy = getattr(pool, "policy", None)  # a broker's pool prices on its side
        priced = any("cost" in row for row in rows) or (policy is not None and policy.prices().priced)
        fields = columns(by, period, priced)
        if fmt == "json":
            print(json.dumps(rows, indent=2))
        elif fmt == "csv":
            out = io.StringIO()
            writer = csv.DictWriter(out, fieldnames=fields, lineterminator="\n", restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)
            print(out.getvalue(), end="")
        else:
            titles = {
                "period": period,
                "leases": "leases",
                "gpu_hours": "GPU·h",
                "gib_hours_held": "GiB·h held",
                "gib_hours_active": "GiB·h active",
                "gib_hours_burst": "GiB·h burst",
                "gpu_hours_burst": "GPU·h burst",
                "cost": "cost",
                "currency": "",
            }
            shown = [f for f in fields if f != "currency"]
            cells = []
            for row in rows:
                line = []
                for f in shown:
                    value = row.get(f, "")
                    if f == "cost" and value != "":
                        line.append(f"{value:.2f} {row.get('currency', '')}".rstrip())
                    elif isinstance(value, float):
                        line.append(f"{value:.3f}")
                    else:
                        line.append(str(value))
                cells.append(line)
            print(table([titles.get(f, f) for f in shown], cells))


class ReserveApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-reserve"
    takes_arguments = True
    description = (
        "Book capacity for users or groups: jupyter gpupool reserve NAME --memory 40GiB --groups cs101 "
        "(--start 2026-12-01T09:00 --for 2h | --weekdays tue --start 09:00 --end 11:00); --cancel NAME; --list."
    )
    aliases = {
        **GpuPoolBaseApp.aliases,
        "memory": "ReserveApp.memory",
        "groups": "ReserveApp.groups",
        "users": "ReserveApp.users",
        "start": "ReserveApp.window_start",
        "end": "ReserveApp.window_end",
        "for": "ReserveApp.duration",
        "weekdays": "ReserveApp.weekdays",
    }
    flags = {
        **GpuPoolBaseApp.flags,
        "cancel": ({"ReserveApp": {"cancel": True}}, "Cancel the named reservation."),
        "list": ({"ReserveApp": {"show_list": True}}, "List reservations."),
    }
    memory = Unicode("", help="Memory to hold, e.g. 40GiB.").tag(config=True)
    groups = Unicode("", help="Comma-separated groups it is for.").tag(config=True)
    users = Unicode("", help="Comma-separated users it is for.").tag(config=True)
    window_start = Unicode("", help="Start: ISO time (one-off, default now) or HH:MM with --weekdays.").tag(config=True)
    window_end = Unicode("", help="End: ISO time or HH:MM with --weekdays.").tag(config=True)
    duration = Unicode("", help="Length of a one-off window, e.g. 2h (instead of --end).").tag(config=True)
    weekdays = Unicode("", help="Weekly days, e.g. tue,thu.").tag(config=True)
    cancel = Bool(False, help="Cancel the named reservation.").tag(config=True)
    show_list = Bool(False, help="List reservations.").tag(config=True)

    def run(self) -> None:
        pool = self.make_pool()
        if self.show_list:
            self.refuse_extra_args()
            now = pool.clock()
            reservations = pool.reservations()
            data = [reservation_json(r, now) for r in reservations]
            self.emit(data, reservation_table(reservations, now) if reservations else "  (no reservations)")
            return
        if len(self.extra_args) != 1:
            raise InvalidInput("name the reservation: jupyter gpupool reserve NAME --memory 40GiB --groups cs101 --for 2h")
        name = self.extra_args[0]
        if self.cancel:
            pool.cancel_reservation(name)
            print(f"cancelled reservation {name}")
            return
        spec: dict[str, Any] = {"name": name, "memory": self.memory or None, "groups": self.groups, "users": self.users}
        if not self.memory:
            raise InvalidInput("give --memory, e.g. --memory 40GiB")
        validate.slice_floor(validate.size(self.memory, "--memory"), "--memory {}")
        if self.weekdays:
            spec.update(weekdays=self.weekdays, start=self.window_start, end=self.window_end)
        else:
            spec["start"] = self.window_start or None
            if self.window_end:
                spec["end"] = self.window_end
            elif self.duration:
                spec["duration"] = self.duration
        reservation = pool.book_reservation(spec)
        self.emit(reservation.to_json(), f"reserved {format_size(reservation.memory)} as {name!r}")


class RequestApp(GpuPoolBaseApp):
    name = "jupyter-gpupool-request"
    takes_arguments = True
    description = "Ask for a slice from a shell and wait for it: jupyter gpupool request 8GiB [--for 2h] [--wait]."
    aliases = {**GpuPoolBaseApp.aliases, "for": "RequestApp.duration", "gpus": "RequestApp.gpus", "model": "RequestApp.model"}
    flags = {**GpuPoolBaseApp.flags, "wait": ({"RequestApp": {"wait": True}}, "Wait until granted, showing the position.")}
    duration = Unicode("", help="Expected duration, e.g. 2h.").tag(config=True)
    gpus = Unicode("1", help="Number of GPUs.").tag(config=True)
    model = Unicode("", help="GPU model constraint, e.g. A100.").tag(config=True)
    wait = Bool(False, help="Wait until granted.").tag(config=True)

    def run(self) -> None:
        if len(self.extra_args) != 1:
            raise InvalidInput("give the size: jupyter gpupool request 8GiB")
        validate.slice_floor(self.extra_args[0], "{}", "jupyter gpupool request {}")
        pool = self.make_pool()
        memory = pool.parse_memory(self.extra_args[0])
        duration = parse_duration(self.duration) if self.duration else None
        if not self.gpus.isdigit():
            raise InvalidInput(f"invalid --gpus {self.gpus!r}: expected a whole number like 2")
        lease = pool.request(
            LeaseRequest(owner=current_user(), memory=memory, num_gpus=int(self.gpus), model=self.model or None, duration=duration, label="cli")
        )
        if self.wait and lease.state is LeaseState.QUEUED:

            def show(current: Lease, info: Any) -> None:
                if info is not None:
                    print(f"\rwaiting for a GPU: position {info.position} of {info.length}, about {format_duration(info.estimated_wait)}", end="", file=sys.stderr)

            lease = pool.wait_for_grant(lease.id, on_update=show)
            print(file=sys.stderr)
        self.emit(lease.to_json(), f"{lease.id} {lease.state.value} {slice_size(lease.memory, lease.num_gpus)}")
        if not self.json:
            print(how_long_it_is_held(lease, pool.policy.heartbeat_ttl), file=sys.stderr)


def how_long_it_is_held(lease: Lease, heartbeat_ttl: float) -> str:
    """What keeps a slice booked from a shell once the command exits: its ``--for``, else nothing
    (no process sends its heartbeats, so it lapses after ``heartbeat_ttl``)."""
    release = f"jupyter gpupool release {lease.id} gives it back sooner"
    if lease.duration is not None:
        when = "once granted, " if lease.state is LeaseState.QUEUED else ""
        return f"{when}held for {format_duration(lease.duration)} (--for), then released; {release}"
    return (
        f"nothing holds it once this command exits: it lapses within {format_duration(heartbeat_ttl)} (no process "
        "sends its heartbeats); to hold it, book it for a time: --for 2h"
    )


SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "status": ("jupyter_gpupool.apps.cli.StatusApp", StatusApp.description),
    "leases": ("jupyter_gpupool.apps.cli.LeasesApp", LeasesApp.description),
    "queue": ("jupyter_gpupool.apps.cli.QueueApp", QueueApp.description),
    "release": ("jupyter_gpupool.apps.cli.ReleaseApp", ReleaseApp.description),
    "clear-claim": ("jupyter_gpupool.apps.cli.ClearClaimApp", ClearClaimApp.description),
    "priority": ("jupyter_gpupool.apps.cli.PriorityApp", PriorityApp.description),
    "suspend": ("jupyter_gpupool.apps.cli.SuspendApp", SuspendApp.description),
    "resume": ("jupyter_gpupool.apps.cli.ResumeApp", ResumeApp.description),
    "report": ("jupyter_gpupool.apps.cli.ReportApp", ReportApp.description),
    "reserve": ("jupyter_gpupool.apps.cli.ReserveApp", ReserveApp.description),
    "request": ("jupyter_gpupool.apps.cli.RequestApp", RequestApp.description),
    "kernelspec": ("jupyter_gpupool.apps.kernelspec.KernelSpecApp", "Install kernelspecs with a fixed GPU slice."),
    "simulate": ("jupyter_gpupool.apps.simulate.SimulateApp", "What-if: how many users can share these GPUs, with what wait?"),
    "demo": ("jupyter_gpupool.apps.demo.DemoApp", "Start JupyterLab on a simulated pool with a demo notebook."),
    "broker": ("jupyter_gpupool.broker.BrokerApp", "Serve one pool to every Jupyter server on the host."),
}


class GpuPoolApp(GpuPoolBaseApp):
    """``jupyter gpupool``: the entry point; dispatches to subcommands."""

    name = "jupyter-gpupool"
    description = "Pool the GPU memory of this host across Jupyter kernels."
    subcommands: dict[str, tuple[str, str]] = {}  # filled in initialize(): only the installed ones

    def initialize(self, argv: Any = None) -> None:
        self.subcommands = {name: (target, text) for name, (target, text) in SUBCOMMANDS.items() if _importable(target)}
        super().initialize(argv)

    def run(self) -> None:
        if self.subapp is None:
            print("usage: jupyter gpupool {" + ",".join(self.subcommands) + "} [options]\n")
            for name, (_, text) in self.subcommands.items():
                print(f"  {name:<11} {text}")
            print("\nRun `jupyter gpupool COMMAND --help` for a command's options.")
            self.exit(EXIT_USAGE if self.extra_args else 0)

    def start(self) -> None:
        if self.subapp is not None:
            self.subapp.start()
            return
        if self.extra_args:
            print(f"jupyter gpupool: error: unknown command {self.extra_args[0]!r}; choose one of {', '.join(self.subcommands)}", file=sys.stderr)
            self.exit(EXIT_USAGE)
        super().start()


def _importable(target: str) -> bool:
    import importlib.util

    module = target.rsplit(".", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def main() -> None:
    """The ``jupyter-gpupool`` script. A reader that stops early (``| head``) ends it quietly."""
    try:
        try:
            GpuPoolApp.launch_instance()
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        # Nothing more can be shown; keep the interpreter's last flush from complaining too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)  # 128 + SIGPIPE, as a shell reports a command killed by the pipe


if __name__ == "__main__":
    main()
