"""The pool's policy: every knob an admin can turn, as traitlets with help text.

Set them in ``jupyter_server_config.py`` / ``jupyter_gpupool_config.py`` as
``c.PoolPolicy.idle_timeout = 600`` or through the ``GPUPOOL_*`` environment variables that
:meth:`PoolPolicy.from_env` reads. The engine only reads attributes; it never imports Jupyter.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from typing import Any

from traitlets import Bool, Dict, Enum, Float, Integer, List, Unicode, validate
from traitlets.config import Configurable

from jupyter_gpupool.core.metering import Prices
from jupyter_gpupool.core.models import PriorityClass
from jupyter_gpupool.core.placement import POLICIES
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import parse_duration, parse_size
from jupyter_gpupool.wording import plural

#: Environment variables that override traits (name → (trait, parser)).
ENV_TRAITS: dict[str, str] = {
    "GPUPOOL_DEFAULT_MEMORY": "default_memory",
    "GPUPOOL_IDLE_TIMEOUT": "idle_timeout",
    "GPUPOOL_SUSPEND_IDLE_TIMEOUT": "suspend_idle_timeout",
    "GPUPOOL_IDLE_POLICY": "idle_policy",
    "GPUPOOL_WARNING_PERIOD": "warning_period",
    "GPUPOOL_PLACEMENT": "placement",
    "GPUPOOL_OVERCOMMIT": "overcommit",
    "GPUPOOL_HEARTBEAT_TTL": "heartbeat_ttl",
    "GPUPOOL_PREEMPTION": "preemption",
    "GPUPOOL_GRACE_PERIOD": "grace_period",
    "GPUPOOL_MAX_KEEP": "max_keep",
    "GPUPOOL_RECLAIM_ACTION": "reclaim_action",
    "GPUPOOL_PARKED_MEMORY_LIMIT": "parked_memory_limit",
    "GPUPOOL_PARKING_POOL_SIZE": "parking_pool_size",
    "GPUPOOL_TRANSITION_TIMEOUT": "transition_timeout",
    "GPUPOOL_BURST": "burst",
    "GPUPOOL_BURST_STEP": "burst_step",
}

_DURATION_TRAITS = {
    "idle_timeout",
    "suspend_idle_timeout",
    "warning_period",
    "heartbeat_ttl",
    "grace_period",
    "max_keep",
    "min_runtime",
    "aging_interval",
    "fair_share_half_life",
    "backfill_max_head_wait",
    "transition_timeout",
    "defragment_min_idle",
    "burst_settle",
}

WEEKDAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")

DEFAULT_SUSPEND_IDLE_TIMEOUT = 120.0
"""Idle seconds before a suspend when ``suspend_idle_timeout`` is unset: the simulator's sweep of
30 s, 1, 2 and 5 min (bench/RESULTS.md, "Suspend idle timeout") served the most sessions with the
shortest waits at 2 min on both the lab and the class scenario."""


@dataclass(frozen=True)
class Quota:
    """Limits for one user or group. ``None`` means unlimited."""

    guaranteed: int = 0  # bytes always available to them (preemption makes room)
    maximum: int | None = None  # bytes they may hold at most (burst into idle capacity)
    max_leases: int | None = None  # concurrent leases

    def to_json(self) -> dict[str, Any]:
        return {"guaranteed": self.guaranteed, "maximum": self.maximum, "max_leases": self.max_leases}


@dataclass(frozen=True)
class Reservation:
    """Capacity held for a user or group during a window (one-off or weekly)."""

    name: str
    memory: int
    users: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    start: float | None = None  # one-off window, POSIX seconds
    end: float | None = None
    weekdays: tuple[int, ...] = ()  # weekly window: 0 = Monday
    daily_start: str = ""  # "09:00" local time
    daily_end: str = ""

    def applies_to(self, owner: str, groups: tuple[str, ...]) -> bool:
        return owner in self.users or any(g in self.groups for g in groups)

    def active(self, now: float) -> bool:
        if self.start is not None and self.end is not None:
            return self.start <= now < self.end
        if self.weekdays and self.daily_start and self.daily_end:
            local = dt.datetime.fromtimestamp(now)
            if local.weekday() not in self.weekdays:
                return False
            hhmm = local.strftime("%H:%M")
            return self.daily_start <= hhmm < self.daily_end
        return False

    @property
    def weekly(self) -> bool:
        return bool(self.weekdays and self.daily_start and self.daily_end)

    def window_text(self) -> str:
        """``Tue 09:00–11:00`` (weekly) or ``2026-12-01 09:00–11:00`` (one-off), local time."""
        if self.weekly:
            days = ", ".join(WEEKDAYS[d].capitalize() for d in self.weekdays)
            return f"{days} {self.daily_start}–{self.daily_end}"
        if self.start is None or self.end is None:
            return "no window"
        start, end = dt.datetime.fromtimestamp(self.start), dt.datetime.fromtimestamp(self.end)
        if start.date() == end.date():
            return f"{start:%Y-%m-%d %H:%M}–{end:%H:%M}"
        return f"{start:%Y-%m-%d %H:%M} – {end:%Y-%m-%d %H:%M}"

    def describe(self) -> str:
        """``'lab' (cs101, Tue 09:00–11:00)``: how users see a reservation in queue reasons."""
        who = ", ".join([*self.groups, *self.users])
        return f"{self.name!r} ({who}, {self.window_text()})"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "memory": self.memory,
            "users": list(self.users),
            "groups": list(self.groups),
            "start": self.start,
            "end": self.end,
            "weekdays": [WEEKDAYS[d] for d in self.weekdays],
            "daily_start": self.daily_start,
            "daily_end": self.daily_end,
        }


def parse_quota(spec: dict[str, Any], where: str) -> Quota:
    """``{"guaranteed": "8GiB", "maximum": "16GiB", "max_leases": 2}`` → :class:`Quota`."""
    unknown = set(spec) - {"guaranteed", "maximum", "max_leases"}
    if unknown:
        raise InvalidInput(f"{where}: unknown quota {plural(len(unknown), 'key')} {str(sorted(map(str, unknown)))[:80]}; use guaranteed, maximum, max_leases")
    guaranteed = parse_size(spec["guaranteed"]) if spec.get("guaranteed") else 0
    maximum = parse_size(spec["maximum"]) if spec.get("maximum") else None
    max_leases = spec.get("max_leases")
    if max_leases is not None and (not isinstance(max_leases, int) or max_leases < 1):
        shown = repr(max_leases)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."  # a hostile value must not flood the one line
        raise InvalidInput(f"{where}: max_leases must be a whole number of at least 1, got {shown}")
    if maximum is not None and guaranteed > maximum:
        raise InvalidInput(f"{where}: guaranteed ({spec['guaranteed']}) is above maximum ({spec['maximum']})")
    return Quota(guaranteed=guaranteed, maximum=maximum, max_leases=max_leases)


def parse_reservation(spec: dict[str, Any], now: float | None = None) -> Reservation:
    """Read one reservation from config; see :attr:`PoolPolicy.reservations` for the forms."""
    name = str(spec.get("name") or "reservation")
    if "memory" not in spec:
        raise InvalidInput(f"reservation {name!r}: needs 'memory', e.g. '40GiB'")
    memory = parse_size(spec["memory"])
    users = tuple(_as_list(spec.get("users", spec.get("user", ()))))
    groups = tuple(_as_list(spec.get("groups", spec.get("group", ()))))
    if not users and not groups:
        raise InvalidInput(f"reservation {name!r}: name the 'users' or 'groups' it is for")
    if "weekdays" in spec or "days" in spec:
        days = []
        for day in _as_list(spec.get("weekdays", spec.get("days"))):
            key = str(day).strip().lower()[:3]
            if key not in WEEKDAYS:
                raise InvalidInput(f"reservation {name!r}: unknown weekday {day!r}; use mon, tue, ... sun")
            days.append(WEEKDAYS.index(key))
        start_text, end_text = str(spec.get("start", "")), str(spec.get("end", ""))
        for text in (start_text, end_text):
            try:
                dt.datetime.strptime(text, "%H:%M")
            except ValueError:
                raise InvalidInput(f"reservation {name!r}: times must look like 09:00, got {text!r}") from None
        if start_text >= end_text:
            raise InvalidInput(f"reservation {name!r}: start {start_text} must be before end {end_text}")
        return Reservation(name, memory, users, groups, weekdays=tuple(sorted(days)), daily_start=start_text, daily_end=end_text)
    start = _parse_time(spec.get("start"), name, now)
    if "end" in spec:
        end = _parse_time(spec["end"], name, now)
    elif "duration" in spec:
        end = start + parse_duration(spec["duration"])
    else:
        raise InvalidInput(f"reservation {name!r}: needs 'end' or 'duration' (e.g. '2h')")
    if end <= start:
        raise InvalidInput(f"reservation {name!r}: end must be after start")
    return Reservation(name, memory, users, groups, start=start, end=end)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return list(value)
    return [v for v in str(value).split(",") if v.strip()]


def _parse_time(value: Any, name: str, now: float | None) -> float:
    if value in (None, "", "now"):
        import time

        return now if now is not None else time.time()
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return dt.datetime.fromisoformat(str(value)).timestamp()
    except ValueError:
        raise InvalidInput(f"reservation {name!r}: times must be ISO 8601 like 2026-12-01T09:00, got {value!r}") from None


class PoolPolicy(Configurable):
    """How the pool sizes, orders, places, limits and reclaims leases."""

    default_memory = Unicode(
        "25%",
        help="Slice a kernel gets when neither its kernelspec nor the user asks for a size: "
        "a size (8GiB, 512MiB) or a share of the largest GPU (25%). Env: GPUPOOL_DEFAULT_MEMORY.",
    ).tag(config=True)

    placement = Unicode(
        "fgd-cpufit",
        help="Placement policy: 'fgd-cpufit' (fragmentation-aware after the FGD paper, CPU-only work packed "
        "best-fit; the best on the Alibaba trace replay), 'fgd' (the paper's FGD), 'fgd-bestfit' (FGD with "
        "best-fit ties) or 'best-fit' (tightest GPU that fits); see bench/RESULTS.md. Env: GPUPOOL_PLACEMENT.",
    ).tag(config=True)

    overcommit = Float(
        1.0,
        help="Leasable memory per GPU as a multiple of its real memory (1.0 = never overcommit). "
        "Above 1 only makes sense with suspend or unified memory. Env: GPUPOOL_OVERCOMMIT.",
    ).tag(config=True)

    device_overcommit = Dict(
        {},
        help="Per-device overcommit factors by GPU uuid or index, e.g. {'0': 1.5}; others use `overcommit`.",
    ).tag(config=True)

    idle_policy = Enum(
        ["pressure", "always", "never"],
        "pressure",
        help="When idle slices go back: 'pressure' (only while someone waits, longest idle first), "
        "'always' (after idle_timeout), 'never'. Env: GPUPOOL_IDLE_POLICY.",
    ).tag(config=True)

    idle_timeout = Float(
        1800.0,
        help="Seconds a kernel must be idle before its slice may be reclaimed. Env: GPUPOOL_IDLE_TIMEOUT (e.g. 30m).",
    ).tag(config=True)

    suspend_idle_timeout = Float(
        None,
        allow_none=True,
        help="Seconds a kernel must be idle before its slice may be taken back by suspending it (its GPU memory "
        "parked in host RAM, restored on its next cell), where it can be suspended now: its server can checkpoint, "
        "reclaim_action is 'suspend', the parked-memory budget has room. Kernels that would be culled instead keep "
        "idle_timeout. None (the default): 2 minutes, or idle_timeout where that is shorter (chosen from the "
        "simulator's sweep in bench/RESULTS.md). Env: GPUPOOL_SUSPEND_IDLE_TIMEOUT (e.g. 2m).",
    ).tag(config=True)

    @validate("suspend_idle_timeout")
    def _check_suspend_idle_timeout(self, proposal: Any) -> float | None:
        value = proposal["value"]
        if value is None:
            return None
        if not 0 <= float(value) < float("inf"):
            raise InvalidInput(f"suspend_idle_timeout must be 0 seconds or more (or None for idle_timeout), got {value}")
        return float(value)

    def idle_timeout_for(self, suspends: bool) -> float:
        """The idle time before a reclaim: where the reclaim would suspend the kernel
        (``suspends``), :attr:`suspend_idle_timeout`, or when that is unset
        :data:`DEFAULT_SUSPEND_IDLE_TIMEOUT` capped at :attr:`idle_timeout`; else :attr:`idle_timeout`."""
        if not suspends:
            return float(self.idle_timeout)
        if self.suspend_idle_timeout is not None:
            return float(self.suspend_idle_timeout)
        return min(DEFAULT_SUSPEND_IDLE_TIMEOUT, float(self.idle_timeout))

    warning_period = Float(
        120.0,
        help="Seconds between the idle (or preemption) warning and the reclaim; the user can Keep in between. "
        "Env: GPUPOOL_WARNING_PERIOD.",
    ).tag(config=True)

    warn_within_idle_timeout = Bool(
        True,
        help="While someone waits for GPU memory (idle_policy 'pressure'), a kernel that would be suspended gets its "
        "warning_period during its suspend idle timeout rather than after it: warned once idle for "
        "suspend_idle_timeout - warning_period (at once when that is 0 or less), parked once the warning runs out, "
        "so it is parked after its suspend idle timeout (or its warning, if longer), not after both. The warning, "
        "Keep, a cell that cancels it and the state a resume restores are unchanged; kernels that would be culled "
        "wait for idle_timeout before their warning as before; a preemption cuts a warning under way short to its "
        "grace_period, as it would preempt an unwarned kernel. False: the warning starts only after the timeout.",
    ).tag(config=True)

    def warn_after(self, suspends: bool, pressure: bool) -> float:
        """Idle seconds before the idle warning: :meth:`idle_timeout_for`, less :attr:`warning_period`
        where the reclaim would suspend the kernel while someone waits and
        :attr:`warn_within_idle_timeout` is on (never below 0)."""
        timeout = self.idle_timeout_for(suspends)
        if suspends and pressure and self.warn_within_idle_timeout:
            return max(0.0, timeout - float(self.warning_period))
        return timeout

    max_keep = Float(
        8 * 3600.0,
        help="Longest a user may hold an idle slice with %gpupool keep / reserve --for. Env: GPUPOOL_MAX_KEEP.",
    ).tag(config=True)

    heartbeat_ttl = Float(
        180.0,
        help="A granted lease whose holder sent no heartbeat for this long is released. Env: GPUPOOL_HEARTBEAT_TTL.",
    ).tag(config=True)

    fair_share_half_life = Float(
        24 * 3600.0,
        help="Half-life in seconds of past usage (GiB·hours) in fair-share ordering.",
    ).tag(config=True)

    aging_interval = Float(
        600.0,
        help="Every this many seconds of waiting lifts a queued request one priority class, so none starves "
        "(0 turns aging off).",
    ).tag(config=True)

    backfill = Bool(
        True,
        help="Let smaller requests that fit now go ahead of a head-of-queue request that cannot fit yet.",
    ).tag(config=True)

    backfill_max_head_wait = Float(
        900.0,
        help="Stop backfilling once the head of the queue has waited this many seconds, so capacity "
        "accumulates for it.",
    ).tag(config=True)

    preemption = Bool(
        True,
        help="Let a request within a guaranteed quota (its user's or one of its groups'), or of a higher class, "
        "reclaim leases within no guarantee or of a lower class; and let an open reservation reclaim non-members' "
        "leases. Env: GPUPOOL_PREEMPTION (true/false).",
    ).tag(config=True)

    min_runtime = Float(
        300.0,
        help="A lease is not preempted before it has run this many seconds.",
    ).tag(config=True)

    grace_period = Float(
        60.0,
        help="Seconds between a preemption decision and the eviction. Env: GPUPOOL_GRACE_PERIOD.",
    ).tag(config=True)

    default_quota = Dict(
        {},
        help="Quota for every user without their own: {'guaranteed': '4GiB', 'maximum': '32GiB', 'max_leases': 4} (each key optional; no 'guaranteed': nothing guaranteed).",
    ).tag(config=True)

    user_quotas = Dict(
        {},
        help="Quotas per user name: {'alice': {'guaranteed': '8GiB', 'maximum': '24GiB', 'max_leases': 3}}.",
    ).tag(config=True)

    group_quotas = Dict(
        {},
        help="Quotas per group, applied to the group's members together: {'cs101': {'maximum': '40GiB'}, "
        "'staff': {'guaranteed': '8GiB'}}. A group's guarantee is shared by its members and counts like a user's.",
    ).tag(config=True)

    user_priorities = Dict(
        {},
        help="Priority class per user: {'prof': 'high'}. Classes: batch < normal < high.",
    ).tag(config=True)

    group_priorities = Dict(
        {},
        help="Priority class per group: {'staff': 'high', 'graders': 'batch'}; the highest that applies wins.",
    ).tag(config=True)

    reservations: List[Any] = List(
        [],
        help="Capacity held for users or groups: one-off {'name': 'exam', 'groups': ['cs101'], 'memory': '40GiB', "
        "'start': '2026-12-01T09:00', 'end': '2026-12-01T11:00'} or weekly {'name': 'lab', 'groups': ['cs101'], "
        "'memory': '40GiB', 'weekdays': ['tue'], 'start': '09:00', 'end': '11:00'} (local time).",
    ).tag(config=True)

    retention_days = Float(
        90.0,
        help="Released leases and decision events older than this many days are deleted from the store "
        "(0 keeps them forever). The metering ledger is kept; see ledger_retention_days.",
    ).tag(config=True)

    ledger_retention_days = Float(
        0.0,
        help="Metering ledger rows older than this many days are deleted (0, the default, keeps them forever).",
    ).tag(config=True)

    reclaim_action = Enum(
        ["suspend", "cull"],
        "suspend",
        help="What an idle reclaim or a preemption does to a kernel: 'suspend' parks its GPU memory in host RAM "
        "(variables, models and tensors survive; it resumes on its next cell, on the same GPU or another of the "
        "same model) where its server can checkpoint it (CUDA driver 570+ with cuda-core, or a simulated pool), "
        "and culls it where not, saying why; 'cull' always shuts the kernel down. Env: GPUPOOL_RECLAIM_ACTION.",
    ).tag(config=True)

    parked_memory_limit = Unicode(
        "50%",
        help="Host RAM that suspended kernels' parked GPU memory may take together: a size (64GiB) or a share of "
        "the host's RAM (50%). A reclaim that would go over it culls instead of suspending, and says so. "
        "Env: GPUPOOL_PARKED_MEMORY_LIMIT.",
    ).tag(config=True)

    parking_pool_size = Unicode(
        "50%",
        help="The host's one pool of pinned memory for the fast parking path's backups (kernels keep theirs "
        "between suspends, so it is pinned ahead): a size (32GiB) or a share of the parked-memory budget "
        "(parked_memory_limit), which it is counted against; held to that budget. 0: no pool, every kernel "
        "is parked by the driver checkpoint. Set where the pool is kept: a server's config, or the broker's. "
        "Env: GPUPOOL_PARKING_POOL_SIZE.",
    ).tag(config=True)

    transition_timeout = Float(
        300.0,
        help="Seconds a suspend, restore or move of a kernel's GPU memory may take before the pool gives up on it: "
        "a suspend that did not finish falls back to culling, a restore or move that did not finish stops the "
        "kernel. Env: GPUPOOL_TRANSITION_TIMEOUT.",
    ).tag(config=True)

    defragment = Bool(
        True,
        help="When the request at the head of the queue fits on no single GPU but moving idle, suspendable kernels "
        "to other GPUs of the same model would make room, move them (suspend, then restore elsewhere) instead "
        "of reclaiming or preempting anyone.",
    ).tag(config=True)

    defragment_min_idle = Float(
        60.0,
        help="Seconds a kernel must have been idle before live defragmentation may move it.",
    ).tag(config=True)

    burst = Unicode(
        "4x",
        help="How far an elastic slice may grow above what its kernel asked for (its guarantee) while its GPU has "
        "memory nobody is guaranteed: a limit (40GiB), a factor of the guarantee (4x), or 0 for fixed slices. "
        "Bounded by the user's and group's maximum quota and by the GPU. Burst is taken back, before anyone's "
        "guarantee, when a request cannot be placed. A kernel may ask for its own limit (%gpupool reserve 8GiB "
        "--limit 32GiB). Env: GPUPOOL_BURST.",
    ).tag(config=True)

    burst_step = Unicode(
        "1GiB",
        help="Least a slice grows by at a time when its kernel's use nears its size (a size, or a share of the "
        "GPU: 5%). Env: GPUPOOL_BURST_STEP.",
    ).tag(config=True)

    burst_settle = Float(
        15.0,
        help="Seconds a kernel has to bring its use down to its guarantee after its burst was taken back (its "
        "caps lowered, its framework caches freed). Still above it after that: it is suspended if idle; if busy "
        "the watchdog warns and, after its grace, interrupts it, and it is suspended when idle.",
    ).tag(config=True)

    @validate("burst", "burst_step")
    def _check_burst(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        name = proposal["trait"].name
        if name == "burst":
            if value in ("0", "off", ""):
                return "0"
            if value.lower().endswith("x"):
                try:
                    factor = float(value[:-1])
                except ValueError:
                    factor = 0.0
                if not 1.0 <= factor <= 1000.0:
                    raise InvalidInput(f"invalid burst {value!r}: a factor is 1x to 1000x (4x: up to four times the guarantee)")
                return value.lower()
        try:
            parse_size(value, gpu_memory=1 << 40)
        except InvalidInput as err:
            forms = "a size (40GiB), a factor of the guarantee (4x) or 0 for fixed slices" if name == "burst" else "a size (1GiB) or a share of the GPU (5%)"
            raise InvalidInput(f"invalid {name} {value!r}: give {forms}") from err
        return value

    def burst_limit_bytes(self, guarantee: int, gpu_memory: int) -> int:
        """Bytes per GPU a slice guaranteed ``guarantee`` may grow to by the pool's ``burst`` (never
        above ``gpu_memory``); 0 when slices do not burst."""
        value = self.burst
        if value == "0":
            return 0
        if value.endswith("x"):
            limit = int(guarantee * float(value[:-1]))
        else:
            limit = parse_size(value, gpu_memory=gpu_memory)
        limit = min(limit, gpu_memory)
        return limit if limit > guarantee else 0

    def burst_step_bytes(self, gpu_memory: int) -> int:
        return parse_size(self.burst_step, gpu_memory=gpu_memory)

    def parked_budget(self, host_memory: int | None) -> int:
        """Bytes of host RAM parked slices may take (a share is of ``host_memory``; 0 when unknown)."""
        if self.parked_memory_limit == "0" or ("%" in self.parked_memory_limit and not host_memory):
            return 0
        return parse_size(self.parked_memory_limit, gpu_memory=host_memory)

    def parking_pool_bytes(self, host_memory: int | None) -> int:
        """Bytes of the host's pinned parking pool: ``parking_pool_size``, a share of the parked-memory
        budget or a size, never more than that budget (0: no pool)."""
        budget = self.parked_budget(host_memory)
        size = self.parking_pool_size
        if size == "0" or not budget:
            return 0
        return min(budget, round(budget * float(size[:-1]) / 100) if size.endswith("%") else parse_size(size))

    max_gpus_per_lease = Integer(
        8,
        help="Most GPUs one lease may span.",
    ).tag(config=True)

    price_per_gpu_hour = Dict(
        {},
        help="Price of a GPU-hour by GPU model, for the cost column of `jupyter gpupool report`: "
        "{'A100-80GB': 2.5, 'T4': 0.35, '*': 1.0}. A model matches by its exact name, else by the most "
        "specific key whose parts are all in its name (A100 prices both A100 sizes, A10 never an A100), "
        "else '*'; a MIG instance is priced by its own name (e.g. 'A100-40GB-MIG-3g.20gb'), else as its GPU. "
        "A slice counts its share of the GPU (slice / GPU memory); a whole GPU or a MIG instance counts 1. "
        "Empty (and no price_per_gib_hour): no cost column.",
    ).tag(config=True)

    price_per_gib_hour = Float(
        0.0,
        help="Price of one GiB of GPU memory held for an hour, added to the GPU-hour price in the report's "
        "cost column (0: memory is not charged on its own).",
    ).tag(config=True)

    currency = Unicode(
        "USD",
        help="Currency of price_per_gpu_hour and price_per_gib_hour, shown in the report's currency column.",
    ).tag(config=True)

    @validate("price_per_gpu_hour")
    def _check_price_per_gpu_hour(self, proposal: Any) -> dict[str, float]:
        value = {str(model): price for model, price in dict(proposal["value"]).items()}
        Prices(per_gpu_hour=value)  # raises InvalidInput on a negative or non-numeric price
        return {model: float(price) for model, price in value.items()}

    @validate("price_per_gib_hour")
    def _check_price_per_gib_hour(self, proposal: Any) -> float:
        Prices(per_gib_hour=proposal["value"])
        return float(proposal["value"])

    def prices(self) -> Prices:
        """The prices of the report's cost column."""
        return Prices(per_gpu_hour=dict(self.price_per_gpu_hour), per_gib_hour=self.price_per_gib_hour, currency=self.currency)

    span_large_requests = Bool(
        True,
        help="A request for more memory than the largest GPU holds (e.g. 140GiB on 80 GiB GPUs), asked for one GPU, "
        "spans the fewest GPUs that hold it, as equal per-GPU shares (2 × 70 GiB; NVLink peers first among "
        "equally free GPUs). False: such a request is refused with the --gpus/size that would fit.",
    ).tag(config=True)

    max_queued_per_user = Integer(
        20,
        help="Most requests one user may have waiting in the queue at once; more are refused at once "
        "(a long queue slows every decision for everyone). 0: no limit.",
    ).tag(config=True)

    max_queued_per_group = Integer(
        0,
        help="Most requests the members of one group may have waiting in the queue together; more are refused. "
        "0: no limit.",
    ).tag(config=True)

    @validate("max_queued_per_user", "max_queued_per_group")
    def _check_counts(self, proposal: Any) -> int:
        value = int(proposal["value"])
        if value < 0:
            raise InvalidInput(f"{proposal['trait'].name} must be 0 or more, got {value}")
        return value

    @validate("default_memory", "parked_memory_limit")
    def _check_size_or_share(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        name = proposal["trait"].name
        if value == "0" and name == "parked_memory_limit":  # never park: reclaims cull
            return value
        try:
            parse_size(value, gpu_memory=1 << 40)  # raises InvalidInput on a bad form
        except InvalidInput:
            if name == "parked_memory_limit":
                raise InvalidInput(
                    f"invalid parked_memory_limit {value!r}: give a size (256GiB), a share of the host's RAM (50%), or 0 to never park"
                ) from None
            raise
        return value

    @validate("parking_pool_size")
    def _check_parking_pool_size(self, proposal: Any) -> str:
        value = str(proposal["value"]).strip()
        try:
            if value.endswith("%"):
                share = float(value[:-1])
                if not 0 <= share <= 100:
                    raise ValueError(value)
            elif value != "0":
                parse_size(value)
        except (ValueError, InvalidInput):
            raise InvalidInput(
                f"invalid parking_pool_size {value[:40]!r}: give a size (32GiB), a share of the parked-memory "
                "budget (50%), or 0 for no pinned parking pool"
            ) from None
        return value

    @validate("placement")
    def _check_placement(self, proposal: Any) -> str:
        value = str(proposal["value"])
        if value not in POLICIES:
            raise InvalidInput(f"unknown placement policy {value!r}; choose one of {', '.join(sorted(POLICIES))}")
        return value

    @validate("overcommit")
    def _check_overcommit(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 1.0 <= value <= 4.0:
            raise InvalidInput(f"overcommit must be between 1.0 and 4.0, got {value}")
        return value

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **kwargs: Any) -> PoolPolicy:
        """A policy from config plus the ``GPUPOOL_*`` environment variables (env wins)."""
        policy = cls(**kwargs)
        policy.apply_env(environ if environ is not None else dict(os.environ))
        return policy

    def apply_env(self, environ: dict[str, str]) -> None:
        for var, trait in ENV_TRAITS.items():
            raw = environ.get(var)
            if raw is None or raw == "":
                continue
            try:
                if trait in _DURATION_TRAITS:
                    setattr(self, trait, parse_duration(raw))
                elif trait == "preemption":
                    setattr(self, trait, raw.strip().lower() in {"1", "true", "yes", "on"})
                elif trait == "overcommit":
                    setattr(self, trait, float(raw))
                else:
                    setattr(self, trait, raw)
            except (InvalidInput, ValueError) as err:
                raise InvalidInput(f"{var}={raw!r}: {err}") from None
            except Exception as err:  # noqa: BLE001 - traitlets TraitError, or a validator's own error
                raise InvalidInput(f"{var}={raw!r}: {err}") from None

    # --- derived views the engine uses -----------------------------------------------------------
    def default_memory_bytes(self, largest_gpu: int) -> int:
        return parse_size(self.default_memory, gpu_memory=largest_gpu)

    def quota_for_user(self, owner: str) -> Quota:
        if owner in self.user_quotas:
            return parse_quota(self.user_quotas[owner], f"user_quotas[{owner!r}]")
        if self.default_quota:
            return parse_quota(self.default_quota, "default_quota")
        return Quota()

    def quota_for_group(self, group: str) -> Quota | None:
        if group in self.group_quotas:
            return parse_quota(self.group_quotas[group], f"group_quotas[{group!r}]")
        return None

    def priority_for(self, owner: str, groups: tuple[str, ...], asked: PriorityClass | None = None) -> PriorityClass:
        """The class a request runs at: the admin's setting for the user or group, else what was asked
        (a user may lower their own class, e.g. to ``batch``, but not raise it above ``normal``)."""
        configured: list[PriorityClass] = []
        if owner in self.user_priorities:
            configured.append(PriorityClass(self.user_priorities[owner]))
        configured += [PriorityClass(self.group_priorities[g]) for g in groups if g in self.group_priorities]
        ceiling = max(configured, key=lambda c: c.rank) if configured else PriorityClass.NORMAL
        if asked is None:
            return ceiling
        return asked if asked.rank <= ceiling.rank else ceiling

    def overcommit_for(self, uuid: str, index: int) -> float:
        factor = self.device_overcommit.get(uuid, self.device_overcommit.get(str(index), self.overcommit))
        return float(factor)

    def parsed_reservations(self) -> list[Reservation]:
        return [parse_reservation(spec) for spec in self.reservations]

    def validate_all(self) -> None:
        """Parse every quota and reservation now, so a config typo fails at start-up, not mid-grant."""
        self.quota_for_user("")
        for user in self.user_quotas:
            self.quota_for_user(user)
        for group in self.group_quotas:
            self.quota_for_group(group)
        for mapping in (self.user_priorities, self.group_priorities):
            for who, cls in mapping.items():
                try:
                    PriorityClass(cls)
                except ValueError:
                    raise InvalidInput(f"priority for {who!r} must be batch, normal or high, got {cls!r}") from None
        self.parsed_reservations()
