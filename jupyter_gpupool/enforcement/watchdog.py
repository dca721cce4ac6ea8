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

import os
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import psutil
from traitlets import Bool, Dict, Enum, Float, Int, List, TraitError, Unicode, Union, default, validate
from traitlets.config import LoggingConfigurable

from jupyter_gpupool.core.models import Decision, Lease
from jupyter_gpupool.devices import DeviceBackend, ProcessUsage, process_alive
from jupyter_gpupool.enforcement.claims import EndedLeases, UnixUsers, check_template
from jupyter_gpupool.enforcement.unpooled import (
    SYSTEM_PROCESSES,
    UnpooledUse,
    attribute,
    tell_terminal,
    terminate_tree,
    unpooled_line,
)
from jupyter_gpupool.units import MIB, format_duration, format_size

Action = Literal["warn", "interrupt", "stop"]
EventKind = Literal["warn", "act", "clear"]
_PAST = {"interrupt": "interrupted", "stop": "stopped"}


# --- usage per lease --------------------------------------------------------------------------------
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
        if pid is None or pid in lease_of_root or not process_alive(int(pid)):
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
    #: GPU memory held outside any granted lease (checked only when the step was given the leases).
    unpooled: list[UnpooledUse] = field(default_factory=list)
    #: What was decided about it: (kind "warn"/"act", the use, action, one line for its user).
    unpooled_events: list[tuple[str, UnpooledUse, str, str]] = field(default_factory=list)
    #: Lease id → kernel pid of every lease whose processes were found (the watcher's own and others').
    roots: dict[str, int] = field(default_factory=dict)


@dataclass
class _Episode:
    over_since: float
    deadline: float | None
    actions: int = 0


class UsageSink(Protocol):
    """The part of :class:`~jupyter_gpupool.backends.local.pool.Pool` the watchdog needs."""

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]: ...


ActCallback = Callable[[str, str], Any]  # (lease_id, "interrupt" | "stop")
ProcessCallback = Callable[[UnpooledUse, str], Any]  # (the use, "interrupt" | "stop")


class UnpooledSink(Protocol):
    """The part of a local :class:`~jupyter_gpupool.backends.local.pool.Pool` that takes unpooled use."""

    def report_unpooled(self, uses: list[UnpooledUse], reporter: str | None = None, ttl: float | None = None,
                        now: float | None = None) -> list[Decision]: ...


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
    unpooled_action = Enum(
        ["", "warn", "interrupt", "stop"],
        default_value="",
        help=(
            "What to do with a process that holds GPU memory outside any granted lease (a kernel started "
            "without the pool, a terminal's python, a kernel whose lease is suspended) once 'grace' seconds "
            "have passed: 'warn' (log, event, the admin's status), 'interrupt' (SIGINT) or 'stop' (SIGTERM, "
            "then SIGKILL). Its memory is never granted to anyone either way. Empty: 'warn' on a single-user "
            "server, 'stop' under the broker. Processes the watcher may not signal are only shown."
        ),
    ).tag(config=True)
    system_processes = List(
        Unicode(),
        default_value=[],
        help=(
            "More process names whose GPU memory is the system's, not a user's, besides "
            f"{', '.join(SYSTEM_PROCESSES)}: never counted as unpooled use."
        ),
    ).tag(config=True)

    unix_user_template = Unicode(
        "{name}",
        help=(
            "The Unix user a pool user's kernels run as, with {name} for the pool (hub) user name: "
            "'{name}' (the same name, JupyterHub's LocalProcessSpawner) or 'jupyter-{name}' (The Littlest "
            "JupyterHub). A process counts for a lease only when it runs as that user's uid; where no Unix "
            "user maps, only when it descends from the lease's own Jupyter server (never by its environment "
            "alone). Empty: map nobody by name (only 'unix_users'). Env: GPUPOOL_UNIX_USER_TEMPLATE (the TLJH "
            "plugin sets 'jupyter-{name}')."
        ),
    ).tag(config=True)
    unix_users = Dict(
        value_trait=Union([Unicode(), Int()]),
        default_value={},
        help=(
            "Pool user name -> Unix user name or uid, for users the template does not map right "
            "(e.g. {'dave': 'dave2', 'erin': 1007}); these win over 'unix_user_template'."
        ),
    ).tag(config=True)

    @default("unix_user_template")
    def _template_from_env(self) -> str:
        template = os.environ.get("GPUPOOL_UNIX_USER_TEMPLATE", "{name}")
        try:
            check_template(template)
        except ValueError as err:
            self.log.error("GPUPOOL_UNIX_USER_TEMPLATE: %s; no pool user maps to a Unix user by name", err)
            return ""  # fails closed: only processes of each lease's own server count
        return template

    @validate("unix_user_template")
    def _valid_template(self, proposal: Any) -> str:
        try:
            check_template(proposal["value"])
        except ValueError as err:
            raise TraitError(str(err)) from None
        return str(proposal["value"])

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
        self._ended_leases: EndedLeases | None = None  # see ended_leases()
        #: How to act on an unpooled process (default: signal it); the server stops its own kernels its way.
        self.act_on_process: ProcessCallback = self._signal_process
        #: The action for unpooled use when ``unpooled_action`` is empty (the owner's default).
        self.default_unpooled_action = "warn"
        #: Whether this watcher serves many Unix users (the broker's): claims are judged by the
        #: configured mapping (``unix_user_template``, ``unix_users``), failing closed.
        self.multi_user = False
        self._episodes: dict[str, _Episode] = {}
        self._unpooled_episodes: dict[tuple[str, int], _Episode] = {}
        #: Lease id → kernel pid as the last step found them.
        self.last_roots: dict[str, int] = {}

    def users(self) -> UnixUsers | None:
        """Pool user → Unix uid on a multi-user host, as configured (a fresh lookup each step:
        accounts come and go); None on a single-user host (every lease is this user's)."""
        if not self.multi_user:
            return None
        return UnixUsers(template=self.unix_user_template, names=dict(self.unix_users))

    def ended_leases(self) -> EndedLeases | None:
        """The pool's leases no longer live, each read once: a kernel whose environment names the
        lease it gave back before it reserved again counts for its new lease (None without a pool)."""
        get = getattr(self.pool, "get", None)
        if not callable(get):
            return None
        if self._ended_leases is None:
            self._ended_leases = EndedLeases(get)
        return self._ended_leases

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

    @property
    def effective_unpooled_action(self) -> Action:
        return (self.unpooled_action or self.default_unpooled_action)  # type: ignore[return-value]

    def evaluate_unpooled(self, uses: list[UnpooledUse], now: float) -> list[tuple[str, UnpooledUse, str, str]]:
        """Warn about each unpooled use first seen; once it lasted ``grace``, the action (only for
        processes the watcher may signal). Updates only this object's memory of them."""
        action = self.effective_unpooled_action
        current = {(use.device, use.pid): use for use in uses}
        for key in list(self._unpooled_episodes):
            if key not in current:
                del self._unpooled_episodes[key]
        decided: list[tuple[str, UnpooledUse, str, str]] = []
        for key, use in current.items():
            episode = self._unpooled_episodes.get(key)
            acting = action != "warn" and use.stoppable
            if episode is None:
                deadline = now + self.grace if acting else None
                episode = self._unpooled_episodes[key] = _Episode(over_since=now, deadline=deadline)
                then = f"; it will be {_PAST[action]} in {format_duration(self.grace)}" if acting else ""
                decided.append(("warn", use, action, f"{unpooled_line(use)}{then}"))
            if acting and episode.deadline is not None and now >= episode.deadline:
                episode.actions += 1
                episode.deadline = now + self.grace
                line = (
                    f"process {use.pid} {_PAST[action]}: it held {format_size(use.bytes)} of a GPU outside the pool "
                    f"({use.why}) for {format_duration(now - episode.over_since)}; GPUs are used through a pooled kernel"
                )
                decided.append(("act", use, action, line))
        return decided

    def first_seen(self) -> dict[tuple[str, int], float]:
        """(device, pid) → when that unpooled use was first seen."""
        return {key: episode.over_since for key, episode in self._unpooled_episodes.items()}

    def record_signal(self, lease: Lease | None, pid: int | None, action: str, why: str, now: float,
                      lease_id: str = "") -> None:
        """Write down a signal about to be sent as an event an admin can read (``GET .../events``,
        ``kind`` ``signal``): the lease it is for, the process, its uid and why. Never raises."""
        store = getattr(self.pool, "store", None)
        if pid is None or store is None or not hasattr(store, "record_event"):
            return  # a remote pool: the broker that owns the GPUs writes its own
        try:
            uid: int | None = psutil.Process(pid).uids().real if pid else None
        except psutil.Error:
            uid = None
        sent = "SIGINT" if action == "interrupt" else "SIGTERM (then SIGKILL)"
        reason = f"{sent} to process {pid} (uid {uid if uid is not None else 'unknown'}): {why}"
        try:
            store.record_event(now, "signal", lease.id if lease is not None else lease_id,
                               lease.kernel_id if lease is not None else None, lease.owner if lease is not None else "", reason)
        except Exception as exc:  # noqa: BLE001 - an unwritable log must not stop enforcement
            self.log.warning("GPU watchdog could not record a signal: %s", exc)

    def _signal_process(self, use: UnpooledUse, action: str) -> None:
        if action == "interrupt":
            os.kill(use.pid, signal.SIGINT)
        elif action == "stop":
            terminate_tree(use.pid)

    # --- one step with the world ----------------------------------------------------------------
    def check(self, roots: Mapping[str, int], limits: Mapping[str, int | None], now: float | None = None,
              leases: Mapping[str, Lease] | None = None, host: str = "", env_var: str = "GPUPOOL_LEASE_ID") -> WatchdogReport:
        """One watchdog step: read the backend, sum per lease, report to the pool, decide, act.

        ``roots``: lease id → kernel pid; ``limits``: lease id → bytes allowed (memory × GPUs).
        With ``leases`` (every live lease of the pool), the step also sets NVML's per-process
        figures against them (see :mod:`jupyter_gpupool.enforcement.unpooled`): usage counts for a lease only
        on its own GPUs, the rest is unpooled use, reported to the pool (which then never grants
        that memory) and acted on by ``unpooled_action``.

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
        unpooled: list[UnpooledUse] = []
        found_roots = dict(roots)
        if leases is None:
            usage = usage_by_root_pid(processes, roots)
        else:
            system = (*SYSTEM_PROCESSES, *self.system_processes)
            seen = attribute(processes, leases, host, roots, env_var, system, now, self.first_seen(), self.users(), self.ended_leases())
            usage, unpooled, found_roots = seen.usage, seen.unpooled, {**seen.roots, **roots}
        self.last_roots = found_roots  # what the action callbacks of this step look kernels up in
        decisions: list[Decision] = []
        if self.pool is not None:
            try:
                decisions = list(self.pool.report_usage(usage, now=now))
            except Exception as exc:  # noqa: BLE001
                self.log.warning("GPU watchdog could not report usage to the pool: %s", exc)
            report_unpooled = getattr(self.pool, "report_unpooled", None)
            if leases is not None and report_unpooled is not None:
                try:
                    report_unpooled(unpooled, ttl=max(30.0, 6 * self.interval), now=now)
                except Exception as exc:  # noqa: BLE001
                    self.log.warning("GPU watchdog could not report unpooled GPU use to the pool: %s", exc)
        unpooled_events = self.evaluate_unpooled(unpooled, now) if leases is not None else []
        for kind, use, action, line in unpooled_events:
            self.log.warning("GPU memory outside the pool: %s", line)
            if kind == "act":
                tell_terminal(use.pid, line)
                self.record_signal(leases.get(use.lease_id) if leases and use.lease_id else None, use.pid, action,
                                   f"GPU memory outside the pool ({use.why})", now)
                try:
                    self.act_on_process(use, action)
                except Exception as exc:  # noqa: BLE001
                    self.log.error("GPU watchdog could not %s process %s: %s", action, use.pid, exc)
        events = self.evaluate(usage, limits, now)
        for event in events:
            if event.kind == "warn":
                self.log.warning("lease %s: %s", event.lease_id, event.message)
            elif event.kind == "act":
                self.log.warning("lease %s: %s", event.lease_id, event.message)
                if self.act is not None:
                    self.record_signal((leases or {}).get(event.lease_id), found_roots.get(event.lease_id), event.action,
                                       event.message, now, event.lease_id)
                    try:
                        self.act(event.lease_id, event.action)
                    except Exception as exc:  # noqa: BLE001
                        self.log.error("GPU watchdog could not %s the kernel of lease %s: %s", event.action, event.lease_id, exc)
        return WatchdogReport(usage=usage, events=events, decisions=decisions, over=self.over_since(),
                              unpooled=unpooled, unpooled_events=unpooled_events, roots=found_roots)


__all__ = ["UnpooledSink", "UsageSink", "Watchdog", "WatchdogEvent", "WatchdogReport", "usage_by_root_pid"]
