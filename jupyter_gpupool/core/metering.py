"""Metering: turn held intervals of leases into report rows of GPU-hours, GiB·hours and cost.

Pure: no Jupyter, no I/O, times passed in. :meth:`jupyter_gpupool.backends.local.pool.Pool.report` feeds it the
ledger (closed intervals) and the granted leases (intervals still open at ``now``).

Units:

* **GiB·hours held**: the lease's memory (all its GPUs) × hours held.
* **GiB·hours active**: the same, counting only the time its kernel was busy.
* **GPU-hours** (card-hours): per GPU of the lease, its share of that GPU × hours. A slice counts
  slice ÷ GPU memory (8 GiB of an 80 GiB GPU for 10 h = 1 GPU-hour); a slice as large as the GPU
  counts 1; a lease on a MIG instance counts the instance whole (1 per hour: the instance is the
  GPU it was given). A lease on 2 GPUs counts both.
* **cost**: GPU-hours × the price of each GPU's model + GiB·hours held × the price per GiB·hour.

Periods (``day``, ``week`` from Monday, ``month``) are in local time; an interval that spans two
periods splits its hours between them. A lease resized while held counts each size for its own
time (:func:`memory_segments`).
"""

from __future__ import annotations

import datetime as dt
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from jupyter_gpupool.core.models import Device, normalize_model
from jupyter_gpupool.errors import InvalidInput

GIB = 1024**3
HOUR = 3600.0

#: What a report can be grouped by.
REPORT_KEYS: tuple[str, ...] = ("user", "group", "kernel")
#: Report periods; ``none`` gives one row per key over the whole range.
PERIODS: tuple[str, ...] = ("none", "day", "week", "month")
#: Output formats of ``jupyter gpupool report``.
FORMATS: tuple[str, ...] = ("table", "csv", "json")
#: Key of the catch-all price in :attr:`PoolPolicy.price_per_gpu_hour`.
ANY_MODEL = "*"

NO_GROUP = "(no group)"


def check_choice(value: str, choices: Iterable[str], option: str) -> str:
    """``value`` if it is one of ``choices``, else :class:`InvalidInput` naming them all."""
    allowed = tuple(choices)
    if value not in allowed:
        raise InvalidInput(f"invalid {option} {value!r}: use one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class DeviceInfo:
    """What metering needs of a GPU (or MIG instance), recorded when a lease's interval closes so a
    report stays right after the GPU left the inventory or a MIG layout changed."""

    uuid: str
    model: str
    memory_total: int
    is_mig: bool = False

    @classmethod
    def of(cls, device: Device) -> DeviceInfo:
        return cls(uuid=device.uuid, model=device.model, memory_total=device.memory_total, is_mig=device.is_mig)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeviceInfo:
        return cls(
            uuid=str(data["uuid"]),
            model=str(data.get("model") or ""),
            memory_total=int(data.get("memory_total") or 0),
            is_mig=bool(data.get("is_mig", False)),
        )

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "model": self.model, "memory_total": self.memory_total, "is_mig": self.is_mig}


@dataclass(frozen=True)
class Interval:
    """A lease held from ``start`` to ``end`` with ``memory`` bytes in all on ``devices``.

    ``devices`` has one entry per GPU of the lease; ``None`` where nothing is known of the GPU (a
    ledger row from before devices were recorded, of a GPU no longer in the inventory): such a GPU
    counts whole and is priced at the ``*`` price.
    """

    lease_id: str
    owner: str
    groups: tuple[str, ...]
    kernel_id: str | None
    memory: int  # bytes, all GPUs together
    start: float
    end: float
    active_seconds: float = 0.0
    devices: tuple[DeviceInfo | None, ...] = ()
    #: (when, bytes of all GPUs held until then) for each resize; ``memory`` is held after the last.
    memory_history: tuple[tuple[float, int], ...] = ()
    #: Bytes (all GPUs) the lease was guaranteed; what it held above is burst. None: all of it was
    #: guaranteed (fixed slices, and rows written before elastic slices). A resize by the user
    #: changes the guarantee: the interval is billed with the one it had when it closed.
    guarantee: int | None = None

    def keys(self, by: str) -> list[str]:
        """The report rows this interval counts in (a lease of two groups counts in both)."""
        if by == "user":
            return [self.owner]
        if by == "group":
            return list(self.groups) or [NO_GROUP]
        return [self.kernel_id or f"(lease {self.lease_id})"]


def memory_segments(start: float, end: float, memory: int, history: Iterable[tuple[float, int]] = ()) -> list[tuple[float, float, int]]:
    """``(from, to, bytes)`` pieces of a lease held from ``start`` to ``end``: ``history`` lists
    (when, bytes held until then) for each resize; ``memory`` is held after the last one."""
    pieces: list[tuple[float, float, int]] = []
    since = start
    for at, held in sorted(history):
        at = min(max(at, start), end)
        if at > since:
            pieces.append((since, at, held))
        since = max(since, at)
    if end > since or not pieces:
        pieces.append((since, end, memory))
    return pieces


def gpu_share(device: DeviceInfo | None, memory_per_gpu: float) -> float:
    """How much of one GPU a slice of ``memory_per_gpu`` bytes on ``device`` counts as (0..1)."""
    if device is None or device.is_mig or device.memory_total <= 0:
        return 1.0
    return min(1.0, memory_per_gpu / device.memory_total)


_TOKEN_SPLIT = re.compile(r"[-\s_]+")


def _tokens(model: str) -> tuple[str, ...]:
    return tuple(t for t in _TOKEN_SPLIT.split(normalize_model(model)) if t)


@dataclass(frozen=True)
class Prices:
    """Prices per GPU-hour by model and per GiB·hour held; ``priced`` is False when none is set."""

    per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    per_gib_hour: float = 0.0
    currency: str = ""

    def __post_init__(self) -> None:
        for model, price in self.per_gpu_hour.items():
            _check_price(price, f"price_per_gpu_hour[{model!r}]")
        _check_price(self.per_gib_hour, "price_per_gib_hour")

    @property
    def priced(self) -> bool:
        return bool(self.per_gpu_hour) or self.per_gib_hour > 0

    def gpu_hour_price(self, model: str | None) -> float:
        """The price of a GPU-hour of ``model``: an exact name (case, spaces and dashes aside), else
        the most specific key all of whose parts are parts of the name (``A100-80GB`` and ``A100``
        price an ``A100-SXM4-80GB``; ``A10`` never prices an A100), else ``*``, else 0."""
        if model:
            wanted = _tokens(model)
            candidates: list[tuple[int, str, float]] = []
            for key, price in self.per_gpu_hour.items():
                if key == ANY_MODEL:
                    continue
                have = _tokens(key)
                if "".join(have) == "".join(wanted):
                    return float(price)
                if have and set(have) <= set(wanted):
                    candidates.append((len(have), key, float(price)))
            if candidates:
                return max(candidates)[2]
        return float(self.per_gpu_hour.get(ANY_MODEL, 0.0))


def _check_price(value: Any, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{name} must be a price of 0 or more, like 2.5; got {value!r}")


# --- periods -----------------------------------------------------------------------------------------
def period_start(moment: float, period: str) -> dt.datetime:
    """Local start of the day, week (Monday) or month that holds ``moment``."""
    local = dt.datetime.fromtimestamp(moment).replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "week":
        return local - dt.timedelta(days=local.weekday())
    if period == "month":
        return local.replace(day=1)
    return local


def next_period(start: dt.datetime, period: str) -> dt.datetime:
    if period == "week":
        return start + dt.timedelta(days=7)
    if period == "month":
        return start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start + dt.timedelta(days=1)


def split_by_period(start: float, end: float, period: str) -> Iterator[tuple[str | None, float, float]]:
    """``(label, piece_start, piece_end)`` for each period ``[start, end)`` touches; the label is the
    period's first day (``2026-11-23``), ``None`` for the whole range."""
    if end <= start:
        return
    if period == "none":
        yield None, start, end
        return
    bucket = period_start(start, period)
    while True:
        following = next_period(bucket, period)
        piece_end = min(end, following.timestamp())
        piece_start = max(start, bucket.timestamp())
        if piece_end > piece_start:
            yield bucket.date().isoformat(), piece_start, piece_end
        if following.timestamp() >= end:
            return
        bucket = following


# --- the report --------------------------------------------------------------------------------------
def columns(by: str, period: str, priced: bool) -> list[str]:
    """The fields of each report row, in order (the CSV header); ``cost`` and ``currency`` only
    when prices are set."""
    head = ["period"] if period != "none" else []
    tail = ["cost", "currency"] if priced else []
    return [*head, by, "leases", "gpu_hours", "gib_hours_held", "gib_hours_active", "gib_hours_burst", "gpu_hours_burst", *tail]


def report_rows(
    intervals: Iterable[Interval],
    by: str = "user",
    period: str = "none",
    since: float | None = None,
    until: float | None = None,
    prices: Prices | None = None,
) -> list[dict[str, Any]]:
    """One row per key (user, group or kernel) per period, with the parts of intervals inside
    ``[since, until)``: ``leases`` (distinct leases), ``gpu_hours``, ``gib_hours_held``,
    ``gib_hours_active``, the parts of ``gib_hours_held`` and ``gpu_hours`` held above the
    guarantee (``gib_hours_burst``, ``gpu_hours_burst``; the rest was guaranteed) and, when
    prices are set, ``cost`` and ``currency``."""
    check_choice(by, REPORT_KEYS, "by")
    check_choice(period, PERIODS, "period")
    prices = prices or Prices()
    totals: dict[tuple[str | None, str], dict[str, Any]] = {}
    lease_ids: dict[tuple[str | None, str], set[str]] = {}
    for item in intervals:
        start = item.start if since is None else max(item.start, since)
        end = item.end if until is None else min(item.end, until)
        if end <= start:
            continue
        length = item.end - item.start
        gpu_prices = [prices.gpu_hour_price(d.model if d else None) for d in item.devices]
        pieces = [
            (label, a, b, memory)
            for seg_start, seg_end, memory in memory_segments(item.start, item.end, item.memory, item.memory_history)
            for label, a, b in split_by_period(max(start, seg_start), min(end, seg_end), period)
        ]
        for label, a, b, memory in pieces:
            hours = (b - a) / HOUR
            fraction = (b - a) / length if length > 0 else 0.0
            gib = memory / GIB
            held = gib * hours
            active = gib * min(item.active_seconds * fraction, b - a) / HOUR
            per_gpu = memory / len(item.devices) if item.devices else float(memory)
            shares = [gpu_share(d, per_gpu) for d in item.devices]
            gpu_hours = sum(shares) * hours
            above = max(0, memory - item.guarantee) if item.guarantee is not None and memory > 0 else 0
            burst_share = above / memory if memory > 0 else 0.0
            cost = sum(share * price for share, price in zip(shares, gpu_prices)) * hours + held * prices.per_gib_hour
            for key in item.keys(by):
                slot = (label, key)
                row = totals.get(slot)
                if row is None:
                    row = totals[slot] = {
                        **({"period": label} if period != "none" else {}),
                        by: key,
                        "leases": 0,
                        "gpu_hours": 0.0,
                        "gib_hours_held": 0.0,
                        "gib_hours_active": 0.0,
                        "gib_hours_burst": 0.0,
                        "gpu_hours_burst": 0.0,
                        **({"cost": 0.0, "currency": prices.currency} if prices.priced else {}),
                    }
                    lease_ids[slot] = set()
                lease_ids[slot].add(item.lease_id)
                row["gpu_hours"] += gpu_hours
                row["gib_hours_held"] += held
                row["gib_hours_active"] += active
                row["gib_hours_burst"] += held * burst_share
                row["gpu_hours_burst"] += gpu_hours * burst_share
                if prices.priced:
                    row["cost"] += cost
    for slot, row in totals.items():
        row["leases"] = len(lease_ids[slot])
        for name in ("gpu_hours", "gib_hours_held", "gib_hours_active", "gib_hours_burst", "gpu_hours_burst", "cost"):
            if name in row:
                row[name] = round(row[name], 4)
    return sorted(totals.values(), key=lambda r: (r.get("period") or "", -r["gib_hours_held"], str(r[by])))
