"""The NVML watchdog: GPU memory per lease, summed over each kernel's process tree, and what to
do when a kernel uses more than its slice.

It is the backstop under every other enforcement (MIG, MPS, HAMi-core, framework caps): those can
be missing or leaky (PyTorch's cap only covers its caching allocator; a ``!python train.py`` child
has no cap at all), while the driver always knows how much memory each process holds.

Two layers:

- :func:`usage_by_root_pid` turns the backend's per-process numbers into bytes per lease, given
  each lease's root pid (the kernel process); a GPU process counts for the nearest root among its
  ancestors (itself included), so children such as ``!python train.py`` count for their kernel.
- :class:`Watchdog` keeps, per lease, when it went over the limit, and decides: warn first; after
  ``grace`` seconds still over, the configured action (``interrupt`` or ``stop``) through a callback.
  :meth:`Watchdog.evaluate` is pure given its inputs and the watchdog's own memory;
  :meth:`Watchdog.check` is one full step for the server extension's periodic loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

import psutil
from traitlets import Bool, Enum, Float, Int
from traitlets.config import LoggingConfigurable

from .core.models import Decision
from .devices import DeviceBackend, ProcessUsage
from .units import MIB, format_duration, format_size

Action = Literal["warn", "interrupt", "stop"]
EventKind = Literal["warn", "act", "clear"]
_PAST = {"interrupt": "interrupted", "stop": "stopped"}


# --- usage per lease --------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:  # another user's process: it exists
        return True


def _lineage(pid: int) -> list[int]:
    """``pid`` and its ancestors, nearest first; empty when the process is gone."""
    try:
        process = psutil.Process(pid)
        return [pid] + [parent.pid for parent in process.parents()]
    except (psutil.NoSuchProcess, psutil.ZombieProcess, ValueError):
        return []
    except psutil.AccessDenied:
        return [pid]


def usage_by_root_pid(backend_usage: Iterable[ProcessUsage], roots: Mapping[str, int]) -> dict[str, int]:
    """Bytes of GPU memory per lease id, summed over each root pid's process tree (all devices).

    ``roots`` maps a lease id to its root pid (the kernel process). Every lease whose root is
    alive appears in the result (0 when it uses nothing), so the pool can clear an over-limit
    state; a lease whose root has exited is left out. A process that has exited no longer counts
    even while the driver (or a scripted backend) still lists it.
    """
    lease_of_root: dict[int, str] = {}
    result: dict[str, int] = {}
    for lease_id, pid in roots.items():
        if pid is None or pid in lease_of_root or not _alive(int(pid)):
            continue
        lease_of_root[int(pid)] = lease_id
        result[lease_id] = 0
    if not lease_of_root:
        return result
    per_pid: dict[int, int] = {}
    for usage in backend_usage:
        per_pid[usage.pid] = per_pid.get(usage.pid, 0) + max(0, int(usage.used_memory))
    for pid, used in per_pid.items():
        for ancestor in _lineage(pid):
            if ancestor in lease_of_root:
                result[lease_of_root[ancestor]] += used
                break
    return result


# --- decisions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WatchdogEvent:
    """Something to show the user or do, about one lease.

    ``warn``: it went over its limit (``deadline``: when the action comes; None for warn-only);
    ``act``: the action (``interrupt``/``stop``) is due now and was handed to the callback;
    ``clear``: it is back within its limit.
    """

    kind: EventKind
    lease_id: str
    action: Action
    used: int
    limit: int
    at: float
    deadline: float | None
    message: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class WatchdogReport:
    """What one :meth:`Watchdog.check` saw and decided."""

    usage: dict[str, int]  # bytes per lease id (alive roots only)
    events: list[WatchdogEvent]
    decisions: list[Decision]  # what ``pool.report_usage`` returned
    over: dict[str, float]  # lease id -> since when it is over its limit
    error: str = ""  # why the backend could not be read this time (the step did nothing)


@dataclass
class _Episode:
    over_since: float
    deadline: float | None
    actions: int = 0


class UsageSink(Protocol):
    """The part of :class:`~jupyter_gpupool.pool.Pool` the watchdog needs."""

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]: ...


ActCallback = Callable[[str, str], Any]  # (lease_id, "interrupt" | "stop")


class Watchdog(LoggingConfigurable):
    """Decides, per lease, warn → (after grace) interrupt or stop, from measured GPU memory."""

    interval = Float(
        5.0,
        min=0.1,
        help="Seconds between two watchdog checks (the server extension's loop reads this).",
    ).tag(config=True)
    action = Enum(
        ["warn", "interrupt", "stop"],
        default_value="interrupt",
        help=(
            "What to do with a kernel still over its GPU memory slice after the grace period: "
            "'warn' (tell the user only), 'interrupt' (like Ctrl-C) or 'stop' (shut the kernel down)."
        ),
    ).tag(config=True)
    grace = Float(
        30.0,
        min=0.0,
        help="Seconds a kernel may stay over its slice after the warning before the action is taken (and between repeats).",
    ).tag(config=True)
    tolerance = Float(
        0.05,
        min=0.0,
        help="Fraction of the slice a kernel may use above it before it counts as over (0.05 = 5%).",
    ).tag(config=True)
    tolerance_bytes = Int(
        256 * MIB,
        min=0,
        help=(
            "Bytes a kernel may use above its slice before it counts as over, whichever of this and "
            "'tolerance' is larger (CUDA contexts take a few hundred MiB outside any framework cap)."
        ),
    ).tag(config=True)
    escalate = Bool(
        False,
        help="With action 'interrupt': stop the kernel if it is still over its slice one grace period after an interrupt.",
    ).tag(config=True)

    def __init__(
        self,
        backend: DeviceBackend | None = None,
        pool: UsageSink | None = None,
        act: ActCallback | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.pool = pool
        self.act = act
        self._episodes: dict[str, _Episode] = {}

    # --- pure part ------------------------------------------------------------------------------
    def threshold(self, limit: int) -> int:
        """Bytes above which a lease with ``limit`` counts as over."""
        return limit + max(int(limit * self.tolerance), int(self.tolerance_bytes))

    def over_since(self) -> dict[str, float]:
        """Leases currently over their limit, and since when."""
        return {lease_id: ep.over_since for lease_id, ep in self._episodes.items()}

    def forget(self, lease_id: str) -> None:
        """Drop what the watchdog remembers about a lease (released, resized, ...)."""
        self._episodes.pop(lease_id, None)

    def evaluate(self, usage: Mapping[str, int], limits: Mapping[str, int | None], now: float) -> list[WatchdogEvent]:
        """Decide from bytes used and allowed per lease at time ``now``; updates only this object.

        Leases missing from ``usage`` (their kernel is gone) or without a limit are forgotten.
        """
        events: list[WatchdogEvent] = []
        for lease_id in list(self._episodes):
            if lease_id not in usage or not limits.get(lease_id):
                self.forget(lease_id)
        for lease_id, used in usage.items():
            limit = limits.get(lease_id)
            if not limit:
                continue
            configured: Action = self.action  # type: ignore[assignment]  # an Enum trait of Action values
            episode = self._episodes.get(lease_id)
            if used <= self.threshold(limit):
                if episode is not None:
                    self.forget(lease_id)
                    events.append(
                        self._event("clear", lease_id, configured, used, limit, now, None,
                                    f"GPU memory back within the slice: {format_size(used)} of {format_size(limit)}")
                    )
                continue
            if episode is None:
                deadline = None if self.action == "warn" else now + self.grace
                episode = self._episodes[lease_id] = _Episode(over_since=now, deadline=deadline)
                events.append(self._event("warn", lease_id, configured, used, limit, now, deadline, self._warning(used, limit)))
            if episode.deadline is not None and now >= episode.deadline:
                action: Action = configured
                if action == "interrupt" and self.escalate and episode.actions >= 1:
                    action = "stop"
                episode.actions += 1
                episode.deadline = now + self.grace
                held = format_duration(now - episode.over_since)
                events.append(
                    self._event("act", lease_id, action, used, limit, now, None,
                                f"kernel {_PAST[action]}: it used {format_size(used)} of its {format_size(limit)} GPU slice for {held}")
                )
        return events

    def _warning(self, used: int, limit: int) -> str:
        text = f"kernel uses {format_size(used)} of its {format_size(limit)} GPU slice"
        if self.action == "warn":
            return f"{text}; free GPU memory or reserve more (%gpupool reserve)"
        return (
            f"{text}; it will be {_PAST[self.action]} in {format_duration(self.grace)} unless usage drops "
            f"to {format_size(self.threshold(limit))} or less"
        )

    @staticmethod
    def _event(kind: EventKind, lease_id: str, action: Action, used: int, limit: int, now: float,
               deadline: float | None, message: str) -> WatchdogEvent:
        return WatchdogEvent(kind=kind, lease_id=lease_id, action=action, used=used, limit=limit, at=now,
                             deadline=deadline, message=message)

    # --- one step with the world ----------------------------------------------------------------
    def check(self, roots: Mapping[str, int], limits: Mapping[str, int | None], now: float | None = None) -> WatchdogReport:
        """One watchdog step: read the backend, sum per lease, report to the pool, decide, act.

        ``roots``: lease id → kernel pid; ``limits``: lease id → bytes allowed (memory × GPUs).
        Errors reading the backend are logged and leave every lease as it was; errors from the
        pool or the action callback are logged, never raised, so the loop keeps running.
        Blocking (NVML, /proc): run it in a thread from an event loop.
        """
        now = time.time() if now is None else now
        if self.backend is None:
            raise RuntimeError("Watchdog.check needs a backend")
        try:
            processes = self.backend.process_usage()
        except Exception as exc:  # noqa: BLE001 - a failing driver must not kill the loop
            self.log.warning("GPU watchdog could not read process usage: %s", exc)
            return WatchdogReport(usage={}, events=[], decisions=[], over=self.over_since(), error=str(exc))
        usage = usage_by_root_pid(processes, roots)
        decisions: list[Decision] = []
        if self.pool is not None:
            try:
                decisions = list(self.pool.report_usage(usage, now=now))
            except Exception as exc:  # noqa: BLE001
                self.log.warning("GPU watchdog could not report usage to the pool: %s", exc)
        events = self.evaluate(usage, limits, now)
        for event in events:
            if event.kind == "warn":
                self.log.warning("lease %s: %s", event.lease_id, event.message)
            elif event.kind == "act":
                self.log.warning("lease %s: %s", event.lease_id, event.message)
                if self.act is not None:
                    try:
                        self.act(event.lease_id, event.action)
                    except Exception as exc:  # noqa: BLE001
                        self.log.error("GPU watchdog could not %s the kernel of lease %s: %s", event.action, event.lease_id, exc)
        return WatchdogReport(usage=usage, events=events, decisions=decisions, over=self.over_since())


__all__ = ["UsageSink", "Watchdog", "WatchdogEvent", "WatchdogReport", "usage_by_root_pid"]
