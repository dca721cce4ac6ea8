"""One mode on one inventory: :class:`LabRun` drives the real pool through a day in virtual time
(exclusive, pooled, reclaim, suspend, elastic); the oracle runs without the pool."""

from __future__ import annotations

import heapq
import math
import statistics
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from traitlets.config import Config

from jupyter_gpupool.apps.oracle import OracleRun
from jupyter_gpupool.apps.simstats import jain_index, percentile
from jupyter_gpupool.apps.simulate.plans import (
    MODES,
    SUSPENDING,
    SessionPlan,
    Settings,
    make_plans,
)
from jupyter_gpupool.apps.workload import (
    Workload,
    load_workload,
)
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Activity, LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend, parse_inventory
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import (
    GIB,
    format_duration,
)

# --- results ----------------------------------------------------------------------------------------
#: What a p95 wait is taken over: every request for the GPU (a first cell, a cell after a reclaim or
#: a suspend, a cell waiting for its slice to grow), or every cell the users ran (0 for a cell that
#: ran at once on its kernel's slice): the oracle's population, where every cell is a request.
WAIT_POPULATIONS = ("requests", "cells")


@dataclass
class ModeResult:
    """What one mode achieved on one inventory."""

    mode: str
    inventory: str
    gpus: int
    capacity: int
    sessions: int
    served: int
    abandoned: int
    refused: int
    still_waiting: int
    requests: int
    leased_pct: float
    used_pct: float
    busy_pct: float
    wait_p50: float
    wait_p95: float
    wait_max: float
    wait_mean: float
    reclaims: int
    idle_warnings: int
    preemptions: int
    expired: int
    jain: float
    days: float
    pool_calls: int
    elapsed: float
    suspends: int = 0  # suspend decisions (slices parked in host RAM instead of culled)
    resumes: int = 0  # suspended sessions whose memory was restored onto a GPU
    moves: int = 0  # live moves (MIGRATE) to make room for the head of the queue
    resume_waits: int = 0
    resume_wait_p50: float = 0.0
    resume_wait_p95: float = 0.0
    resume_wait_max: float = 0.0
    parked_peak: int = 0  # bytes of host RAM held by parked slices, at most
    parked_p95: int = 0  # ... p95 over the ticks of the open hours
    parked_limit: int = 0  # the host-RAM budget of the run (0 outside pooled+suspend)
    work_lost: float = 0.0  # busy seconds culled kernels had computed (their state is gone; not replayed)
    raised: int = 0  # sessions that needed more than they asked for: taken to have asked for their need
    guaranteed_pct: float = 0.0  # GPU memory granted leases are guaranteed (elastic: below leased by the burst)
    grows: int = 0  # elastic: slices grown on demand
    shrinks: int = 0  # elastic: burst taken back for a waiting request
    over_limit: int = 0  # the pool's over-limit warnings (elastic: a busy kernel above a slice whose burst was taken back)
    grow_waits: int = 0  # elastic: cells that waited for their slice to grow
    grow_wait_p95: float = 0.0
    gave_up_growing: int = 0  # elastic: users of ``abandoned`` who gave up while their slice waited to grow
    #: elastic: share of the GPU time (open hours) in which every kernel on a GPU waited for its slice to
    #: grow: the GPU held slices, and none of its kernels could compute
    grow_stalled_pct: float = 0.0
    #: every cell the users ran or gave up waiting to run (``requests`` are the cells that may wait:
    #: the rest ran at once on a slice their kernel held), and the p95 wait over them (0 for those)
    cells: int = 0
    cell_wait_p95: float = 0.0

    @property
    def served_per_day(self) -> float:
        return self.served / self.days

    def p95_wait(self, over: str) -> float:
        """p95 wait over ``requests`` (every request for the GPU) or over ``cells`` (every cell run)."""
        if over not in WAIT_POPULATIONS:
            raise InvalidInput(f"p95 wait is over one of {', '.join(WAIT_POPULATIONS)}, not {over!r}")
        return self.wait_p95 if over == "requests" else self.cell_wait_p95

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["served_per_day"] = round(self.served_per_day, 2)
        data["abandoned_per_day"] = round(self.abandoned / self.days, 2)
        for key in (
            "leased_pct", "used_pct", "busy_pct", "jain", "wait_p50", "wait_p95", "wait_max", "wait_mean", "elapsed",
            "resume_wait_p50", "resume_wait_p95", "resume_wait_max", "work_lost", "guaranteed_pct", "grow_wait_p95",
            "grow_stalled_pct", "cell_wait_p95",
        ):
            data[key] = round(data[key], 4)
        return data




# --- one run ----------------------------------------------------------------------------------------
_ARRIVE, _PHASE, _GIVEUP, _TICK, _TRANSITION_DONE = 0, 1, 2, 3, 4


class _Session:
    __slots__ = (
        "asked",
        "attempt",
        "blocked_since",
        "busy",
        "busy_since",
        "devices",
        "gen",
        "granted_at",
        "last_busy_end",
        "lease_id",
        "limit",
        "parked",
        "phase",
        "phase_end",
        "plan",
        "ran_at_once",
        "remaining",
        "request",
        "request_at",
        "resume_at",
        "size",
        "state",
        "tgen",
        "transition",
        "used",
        "wait_from",
        "wait_resume",
        "work_done",
    )

    def __init__(self, plan: SessionPlan, request: int, used: int, asked: int = 0) -> None:
        self.plan = plan
        self.asked = asked or request  # what the user asked for (``--requests``), before any raise to the need
        self.size = request  # the slice's current size (elastic: the guarantee, grown on demand, taken back under pressure)
        self.devices: tuple[str, ...] = ()  # elastic: the GPUs its slice is on (read back with its size)
        self.limit = 0  # elastic: the limit the request asks for (0: the pool's burst)
        # queued | running | away | done | abandoned | refused; pooled+suspend: suspended | resuming
        self.state = "pending"
        self.lease_id: str | None = None
        self.request = request
        self.used = used
        self.request_at = 0.0
        self.phase = 0
        self.busy = False
        self.busy_since = 0.0
        self.last_busy_end: float | None = None
        self.granted_at = 0.0
        self.gen = 0
        self.attempt = 0
        self.phase_end = 0.0
        # pooled+suspend: the server's work under way ("suspending", "migrating", "restoring") and its generation
        self.transition: str | None = None
        self.tgen = 0
        self.parked = 0  # bytes of host RAM this session's parked memory holds
        self.blocked_since: float | None = None  # a cell waits on the GPU since (a suspend or move under way)
        self.remaining: float | None = None  # seconds left of a busy phase a suspend or move paused
        self.resume_at = 0.0  # when the user first needed the GPU back
        self.work_done = 0.0  # busy seconds this kernel has computed: what a cull throws away
        # elastic: when the cell's wait began (its request, or the cell that resumed it), if it goes
        # on as a grow wait: one wait for the user, from then until the slice has grown
        self.wait_from: float | None = None
        self.wait_resume = False
        self.ran_at_once = False  # its current cell started on its slice with no wait (counted so)

    def distinct(self, t: float) -> float:
        """``t`` plus a microsecond per session index: two users coming back at the same instant
        would otherwise tie on arrival time, which the queue breaks by (random) lease id."""
        return t + 1e-6 * (1 + self.plan.index)


def limit_asked(policy: PoolPolicy, guarantee: int, used: int, largest: int) -> int:
    """Elastic: the limit a session asks for, 0 for the pool's ``burst`` — unless its need is above
    that, when it is taken to have asked for a limit of its need rounded up to a GiB."""
    need = min(largest, math.ceil(used / GIB) * GIB)
    if need <= guarantee or need <= (policy.burst_limit_bytes(guarantee, largest) or guarantee):
        return 0
    return need


class LabRun:
    """One mode on one inventory: feeds the sessions' plans through a real :class:`Pool`."""

    def __init__(self, settings: Settings, plans: list[SessionPlan], mode: str, backend: SimulatedBackend, config: Config | None = None) -> None:
        if mode not in MODES:
            raise InvalidInput(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        self.settings, self.plans, self.mode = settings, plans, mode
        policy = PoolPolicy(config=config)
        policy.idle_policy = "pressure" if mode in ("reclaim", *SUSPENDING) else "never"
        policy.idle_timeout = settings.suspend_idle_timeout if mode in SUSPENDING else settings.idle_timeout
        policy.suspend_idle_timeout = policy.idle_timeout  # the simulator's own setting, not the pool's default
        policy.reclaim_action = "suspend" if mode in SUSPENDING else "cull"
        self.parked_limit = settings.parked_limit if mode in SUSPENDING else 0
        self.elastic = mode == "elastic"
        if self.elastic and policy.burst == "0":
            raise InvalidInput("mode elastic needs slices that may grow, but PoolPolicy.burst is 0; give a limit like 4x or 80GiB")
        elif not self.elastic:
            policy.burst = "0"  # fixed slices: what every other mode compares
        policy.parked_memory_limit = str(self.parked_limit)  # a byte count ("0": nothing may be parked)
        if settings.quota_max is not None or settings.max_leases is not None:
            quota: dict[str, Any] = {}
            if settings.quota_max is not None:
                quota["maximum"] = settings.quota_max
            if settings.max_leases is not None:
                quota["max_leases"] = settings.max_leases
            policy.default_quota = quota
        if settings.tick * 2 > policy.heartbeat_ttl:
            raise InvalidInput(
                f"tick {format_duration(settings.tick)} is too long for the heartbeat TTL of "
                f"{format_duration(policy.heartbeat_ttl)}; use a tick of at most {format_duration(policy.heartbeat_ttl / 2)}"
            )
        self._tmp = tempfile.TemporaryDirectory(prefix="gpupool-sim-") if settings.store == "file" else None
        db = f"{self._tmp.name}/pool.sqlite" if self._tmp else ":memory:"
        self.backend = backend
        self.pool = Pool(backend, db, policy=policy, clock=lambda: self.now)
        # The pool reuses history statistics for a few *wall-clock* seconds; in virtual time that
        # would make results depend on the machine's speed, so recompute them every decision.
        self.pool.history_cache_seconds = 0.0
        self.now = 0.0
        devices = backend.devices()
        self.capacity = sum(d.leasable for d in devices)
        self.gpu_count = len(devices)
        self.sizes = sorted({d.leasable for d in devices})
        largest = self.sizes[-1]
        self.default_slice = self.pool.default_memory()
        self.sessions = []
        self.raised = 0  # sessions that needed more than they asked for (taken to have asked for their need)
        for plan in plans:
            used = plan.need_bytes(largest)
            asked = settings.requests.size(plan.asks, used, self.default_slice, largest)
            request = asked if self.elastic else self._request_size(used, asked)
            self.raised += request > asked and mode != "exclusive"
            session = _Session(plan, request, used, asked)
            if self.elastic:
                session.limit = limit_asked(policy, asked, used, largest)
                self.raised += session.limit > 0
            self.sessions.append(session)
        self.by_lease: dict[str, _Session] = {}
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.event_seq = 0
        self.waits: list[float] = []
        self.cells_at_once = 0  # cells that ran when their user ran them, on their kernel's slice
        self.resume_waits: list[float] = []
        self.work_lost = 0.0
        self.parked_total = 0  # bytes of host RAM held by parked slices now
        self.parked_peak = 0
        self.parked_samples: list[int] = []  # parked_total at each tick of the open hours (pooled+suspend)
        self.user_wait: dict[str, float] = {}
        self.user_held: dict[str, float] = {}
        self.counts = {
            "served": 0, "abandoned": 0, "refused": 0, "reclaims": 0, "warnings": 0, "preemptions": 0, "expired": 0,
            "suspends": 0, "resumes": 0, "moves": 0, "grows": 0, "shrinks": 0, "over_limit": 0, "gave_up_growing": 0,
        }
        self.gpu_ticks = self.stalled_gpu_ticks = 0  # elastic: GPUs × ticks of the open hours; those stalled on grows
        self.grow_waits: list[float] = []  # elastic: cells that waited for their slice to grow
        self.reported: dict[str, tuple[int, int]] = {}  # elastic: (use, slice size) last reported per lease
        self.samples = [0.0, 0.0, 0.0, 0, 0.0]  # Σ leased, Σ used, Σ busy bytes over ticks in open hours; tick count; Σ guaranteed
        self.calls = 0
        self._draining = False

    def _request_size(self, used: int, asked: int) -> int:
        """The slice a session's lease asks for: a whole GPU (exclusive), else what the user asked for
        (``--requests``), raised to the need rounded up to a GiB where that is more — a fixed slice
        below the need would only be interrupted, so the user is taken to have asked for enough."""
        if self.mode == "exclusive":
            return next(size for size in self.sizes if size >= used)
        return max(asked, min(self.sizes[-1], math.ceil(used / GIB) * GIB))

    # --- event plumbing ---------------------------------------------------------------------------
    def _push(self, t: float, kind: int, index: int, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, index, gen))

    def run(self) -> ModeResult:
        started = time.perf_counter()
        horizon = self.settings.days * 86400
        for session in self.sessions:
            self._push(session.plan.arrival, _ARRIVE, session.plan.index)
        self._push(0.0, _TICK, -1)
        while self.heap:
            t, kind, _, index, gen = heapq.heappop(self.heap)
            if t > horizon:
                break
            self.now = t
            if kind == _TICK:
                self._tick(t)
                self._push(t + self.settings.tick, _TICK, -1)
                continue
            session = self.sessions[index]
            if kind == _ARRIVE:
                self._request(session, t)
            elif kind == _PHASE and gen == session.gen:
                self._phase_end(session, t)
            elif kind == _GIVEUP and gen == session.gen and (session.state in ("queued", "resuming") or self._short(session)):
                self._give_up(session, t)
            elif kind == _TRANSITION_DONE and gen == session.tgen and session.transition is not None:
                self._transition_done(session, t)
        self.now = horizon
        result = self._result(horizon, time.perf_counter() - started)
        self.pool.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        return result

    def _drain(self) -> None:
        """Act on what the pool decided, from its event log: grants, reclaims, preemptions.

        Not re-entrant: acting on an event may call the pool again (a preempted user asks
        again), and the outer loop then reads the events that call produced."""
        if self._draining:
            return
        self._draining = True
        try:
            while True:
                events = self.pool.events(self.event_seq)
                if not events:
                    return
                for event in events:
                    self.event_seq = event["seq"]
                    kind, at = event["kind"], event["at"]
                    if kind == "warn_idle":
                        self.counts["warnings"] += 1
                    session = self.by_lease.get(event["lease_id"])
                    if session is None:
                        continue
                    if kind == "grant" and session.state == "resuming":
                        self._restore(session, at)
                    elif kind == "grant":
                        self._granted(session, at)
                    elif kind == "suspend":
                        self.counts["suspends"] += 1
                        self._begin_transition(session, "suspending", at, session.used / self.settings.checkpoint_rate)
                    elif kind in ("grow", "shrink"):
                        self.counts[kind + "s"] += 1
                        self._resized(session)
                        if self._short(session) and session.used <= session.size:
                            self._grown(session, at)  # the pool served its wait to grow: the cell runs
                        elif self._short(session) and self._fits(session, at):  # still short: its caps ask again
                            self._grown(session, at)
                    elif kind == "over_limit":
                        self.counts["over_limit"] += 1
                    elif kind == "migrate":
                        self.counts["moves"] += 1
                        self._begin_transition(session, "migrating", at, session.used / self.settings.checkpoint_rate + self._restore_seconds(session))
                    elif kind in ("reclaim_idle", "preempt", "release"):
                        self.counts[{"reclaim_idle": "reclaims", "preempt": "preemptions", "release": "expired"}[kind]] += 1
                        self._lost(session, at)
        finally:
            self._draining = False

    # --- session life -----------------------------------------------------------------------------
    def _request(self, session: _Session, t: float) -> None:
        session.attempt += 1
        plan = session.plan
        request = LeaseRequest(
            owner=plan.user,
            memory=session.request,
            kernel_id=f"k{plan.index}-{session.attempt}",
            label=f"session {plan.index}",
            suspendable=self.mode in SUSPENDING,
            burst_limit=(session.limit or None) if self.elastic else 0,  # None: the pool's burst; 0: a fixed slice
        )
        self.calls += 1
        try:
            lease = self.pool.request(request, now=t)
        except RequestRefused:
            session.state = "refused"
            self.counts["refused"] += 1
            return
        session.state, session.lease_id, session.request_at = "queued", lease.id, t
        session.gen += 1
        self.by_lease[lease.id] = session
        if self.settings.patience is not None:
            self._push(t + self.settings.patience, _GIVEUP, plan.index, session.gen)
        self._drain()

    def _granted(self, session: _Session, t: float) -> None:
        session.state, session.granted_at = "running", t
        session.gen += 1
        self._resized(session)
        if self._fits(session, t):
            self._count_wait(session, t - session.request_at)
            self._start_phase(session, t)
        else:
            self._wait_for_growth(session, t, since=session.request_at)  # its first cell waits on, for the slice to grow

    # --- elastic: the kernel's framework caps ask the pool to grow its slice -------------------------
    def _resized(self, session: _Session) -> None:
        """Read the slice's current size back from the pool (elastic slices change size)."""
        if self.elastic and session.lease_id:
            self.calls += 1
            lease = self.pool.get(session.lease_id)
            session.size, session.devices = lease.memory, lease.devices

    def _fits(self, session: _Session, t: float) -> bool:
        """Whether the kernel's need fits its slice, asking the pool to grow it first where it does
        not (as a framework cap's allocation failure does): False while the pool cannot."""
        if not self.elastic or session.used <= session.size:
            return True
        self.calls += 1
        try:
            session.size = self.pool.grow(session.lease_id or "", session.used, now=t).memory
        except RequestRefused:
            return False
        finally:
            self._drain()
        return session.used <= session.size

    def _holding(self, session: _Session) -> int:
        """Bytes the kernel holds: its need, or (elastic, its slice not grown yet) what its caps allow."""
        return min(session.used, session.size) if self._short(session) else session.used

    @staticmethod
    def _short(session: _Session) -> bool:
        """A running kernel whose cell waits for its slice to grow (not for a suspend or move)."""
        return session.state == "running" and session.transition is None and session.blocked_since is not None

    def _wait_for_growth(self, session: _Session, t: float, since: float | None = None, resume: bool = False) -> None:
        """The kernel's cell failed for memory its slice could not grow to: the user runs it again each
        round until the slice grows, and gives up after ``--patience`` like a queued user. ``since``:
        the cell has waited since then already (for its grant or its resume): one wait with this one,
        and its user's patience runs from then."""
        session.blocked_since = t
        session.wait_from, session.wait_resume = (t if since is None else since), resume
        if self.settings.patience is not None:
            self._push(max(t, session.wait_from + self.settings.patience), _GIVEUP, session.plan.index, session.gen)

    def _grown(self, session: _Session, t: float) -> None:
        """A kernel short of memory got it (the pool grew its slice in its turn): its cell runs now."""
        self._count_grow_wait(session, t)
        self._continue(session, t)

    def _count_grow_wait(self, session: _Session, t: float) -> None:
        """A grow wait ends (grown, given up, or the run's end): the cell's whole wait counts once."""
        self.grow_waits.append(t - (session.blocked_since if session.blocked_since is not None else t))
        since = session.wait_from if session.wait_from is not None else session.blocked_since
        self._count_wait(session, t - (since if since is not None else t), resume=session.wait_resume)
        session.wait_from, session.wait_resume = None, False

    def _uncount_at_once(self, session: _Session) -> None:
        """A running cell is paused (a suspend or move) or lost: its wait from now is its one count."""
        self.cells_at_once -= session.ran_at_once
        session.ran_at_once = False

    def _count_wait(self, session: _Session, wait: float, resume: bool = False) -> None:
        self.waits.append(wait)
        if resume:
            self.resume_waits.append(wait)
        user = session.plan.user
        self.user_wait[user] = self.user_wait.get(user, 0.0) + wait

    def _start_phase(self, session: _Session, t: float, length: float | None = None, at_once: bool = False) -> None:
        """Start the session's current phase (``length``: what is left of a paused one; ``at_once``: a
        cell that starts when its user ran it, on the slice its kernel holds: a cell that waited 0)."""
        busy, planned = session.plan.phases[session.phase]
        length = planned if length is None else length
        session.busy = busy
        session.ran_at_once = busy and at_once
        self.cells_at_once += session.ran_at_once
        if busy:
            session.busy_since = t
        session.phase_end = t + length
        self._push(t + length, _PHASE, session.plan.index, session.gen)

    def _phase_end(self, session: _Session, t: float) -> None:
        last = session.phase + 1 >= len(session.plan.phases)
        if session.state == "away":  # reclaimed during this idle spell: the user is back now
            session.phase += 1
            if last:
                session.state = "done"
                self.counts["served"] += 1
            else:
                self._push(session.distinct(t), _ARRIVE, session.plan.index)
            return
        if session.state == "suspended":  # parked during this idle spell: the user's next cell resumes it
            session.phase += 1
            if last:
                self._finish(session, t)
            else:
                self._resume(session, t, t)
            return
        if session.state != "running":
            return
        if session.busy:
            session.last_busy_end = t
            session.busy = False
            session.work_done += t - session.busy_since
        session.phase += 1
        if last:
            self._end_lease(session, t)
            self._finish(session, t)
        elif session.transition is not None:
            session.blocked_since = t  # the next cell waits until the suspend or move is done
        else:
            self._start_phase(session, t, at_once=True)

    def _finish(self, session: _Session, t: float) -> None:
        """The session's work is done: it leaves and its lease goes back (parked memory too)."""
        self.by_lease.pop(session.lease_id or "", None)
        self._unpark(session, t)
        session.state = "done"
        session.transition = None
        self.counts["served"] += 1
        self.calls += 1
        self.pool.release(session.lease_id or "", reason="session ended", now=t)
        self._drain()

    # --- pooled+suspend: the simulator plays each kernel's server ----------------------------------
    def _park(self, session: _Session, t: float) -> None:
        if session.parked == 0:
            session.parked = session.used
            self.parked_total += session.used
            self.parked_peak = max(self.parked_peak, self.parked_total)

    def _unpark(self, session: _Session, t: float) -> None:
        self.parked_total -= session.parked
        session.parked = 0

    def _begin_transition(self, session: _Session, step: str, t: float, seconds: float) -> None:
        """The engine decided a suspend or a move: the server starts copying (done in ``seconds``)."""
        if session.state != "running" or session.transition is not None:
            return
        if session.busy:  # a cell ran when the engine decided (ticks are 30 s apart): it waits
            self._uncount_at_once(session)
            session.work_done += t - session.busy_since
            session.remaining = max(0.0, session.phase_end - t)
            session.busy = False
            session.gen += 1  # its phase end no longer stands: it resumes with what is left
            session.blocked_since = t
        session.transition = step
        session.tgen += 1
        self._park(session, t)  # set aside when the copy begins, as the engine does
        self._push(t + seconds, _TRANSITION_DONE, session.plan.index, session.tgen)

    def _transition_done(self, session: _Session, t: float) -> None:
        """The server finished a suspend, restore or move and confirms it to the pool."""
        step, session.transition = session.transition, None
        self.calls += 1
        if step == "suspending":
            self.pool.confirm_transition(session.lease_id or "", parked_bytes=session.used, now=t)
            self._end_lease(session, t, keep=True)
            session.state = "suspended"
            if session.blocked_since is not None:  # a cell has been waiting since the suspend began
                self._resume(session, t, session.blocked_since)
                return
        elif step == "restoring":
            self.pool.confirm_transition(session.lease_id or "", now=t)
            self._unpark(session, t)
            self.counts["resumes"] += 1
            session.state, session.granted_at = "running", t
            self._resized(session)
            if self._fits(session, t):
                self._count_wait(session, t - session.resume_at, resume=True)
                self._continue(session, t)
            else:  # back on a GPU, its cell waits on, for the slice to grow
                self._wait_for_growth(session, t, since=session.resume_at, resume=True)
        else:  # migrating: the kernel runs on, on its new GPU
            self.pool.confirm_transition(session.lease_id or "", now=t)
            self._unpark(session, t)
            self._resized(session)  # on its new GPU
            short, since = session.used > session.size, session.blocked_since
            # (its slice may grow as it lands, and a grow served on the pool's events runs the cell)
            if since is not None and self._fits(session, t) and session.blocked_since is not None:
                if short:  # moved to a GPU with room for its slice to grow: a grow wait
                    self._grown(session, t)
                else:
                    self._count_wait(session, t - since, resume=True)
                    self._continue(session, t)
        self._drain()

    def _continue(self, session: _Session, t: float) -> None:
        """Run on after a wait on the GPU: the paused busy phase, or the next one."""
        session.gen += 1
        length, session.remaining, session.blocked_since = session.remaining, None, None
        self._start_phase(session, t, length)

    def _resume(self, session: _Session, t: float, asked_at: float) -> None:
        """The user needs the GPU again (since ``asked_at``): ask the pool to bring the memory back."""
        session.state, session.resume_at = "resuming", asked_at
        session.gen += 1
        self.calls += 1
        self.pool.resume(session.lease_id or "", now=t)
        if self.settings.patience is not None:
            self._push(max(t, asked_at + self.settings.patience), _GIVEUP, session.plan.index, session.gen)
        self._drain()

    def _restore(self, session: _Session, t: float) -> None:
        """A resuming lease was granted: the server restores the parked memory, then confirms."""
        session.gen += 1  # the user no longer gives up
        session.transition = "restoring"
        session.tgen += 1
        self._push(t + self._restore_seconds(session), _TRANSITION_DONE, session.plan.index, session.tgen)

    def _restore_seconds(self, session: _Session) -> float:
        """How long copying the session's parked memory back onto a GPU takes."""
        return session.used / (self.settings.restore_rate or self.settings.checkpoint_rate)

    def _give_up(self, session: _Session, t: float) -> None:
        if self._short(session):
            self.counts["gave_up_growing"] += 1
            self._count_grow_wait(session, t)
            self._end_lease(session, t)
        elif session.state == "resuming":
            self._count_wait(session, t - session.resume_at, resume=True)
            self._unpark(session, t)
        else:
            self._count_wait(session, t - session.request_at)
        self.by_lease.pop(session.lease_id or "", None)
        session.state = "abandoned"
        self.counts["abandoned"] += 1
        self.calls += 1
        self.pool.release(session.lease_id or "", reason="gave up waiting", now=t)
        self._drain()

    def _lost(self, session: _Session, t: float) -> None:
        """The pool took the slice back (idle reclaim, preemption or expiry): the kernel is gone."""
        holding = session.state == "running" and session.transition != "restoring"
        if holding:
            self._end_lease(session, t)
        else:
            self.by_lease.pop(session.lease_id or "", None)
        if session.state == "resuming":
            self._count_wait(session, t - session.resume_at, resume=True)
        self.work_lost += session.work_done + (t - session.busy_since if session.busy else 0.0)
        session.work_done = 0.0
        self._unpark(session, t)
        session.transition = None
        session.tgen += 1
        needs_gpu = session.busy or session.blocked_since is not None or session.state == "resuming"
        if session.busy:
            self._uncount_at_once(session)
        session.busy, session.blocked_since, session.remaining = False, None, None
        if needs_gpu:  # the user notices at once and asks again (the work of this phase starts over)
            session.gen += 1
            self._push(session.distinct(t), _ARRIVE, session.plan.index)
        else:
            session.state = "away"  # back when this idle spell ends (its phase event still stands)

    def _end_lease(self, session: _Session, t: float, keep: bool = False) -> None:
        """The session stops holding GPU memory (``keep``: its lease lives on, suspended)."""
        if not keep:
            self.by_lease.pop(session.lease_id or "", None)
        user = session.plan.user
        self.user_held[user] = self.user_held.get(user, 0.0) + (t - session.granted_at)

    # --- ticks ------------------------------------------------------------------------------------
    def _tick(self, t: float) -> None:
        """What a server's periodic round does: report every kernel's activity and run the scheduler."""
        open_hour = self.settings.shape.weight(t) > 0
        if open_hour and self.mode in SUSPENDING:
            self.parked_samples.append(self.parked_total)
        if open_hour and self.elastic:
            self._count_stalled_gpus()
        if not self.by_lease:
            if open_hour:
                self.samples[3] += 1
            return
        activities: dict[str, Activity] = {}
        leased = used = busy = guaranteed = 0
        usage: dict[str, int] = {}
        for lease_id, session in self.by_lease.items():
            if session.state == "running" and session.transition != "restoring":
                computing = (session.busy and session.transition is None) or self._short(session)  # a short one retries its cell
                activities[lease_id] = Activity(busy=computing, last_activity=None if computing else session.last_busy_end, connections=1)
                holding = self._holding(session)
                usage[lease_id] = holding
                leased += session.size
                guaranteed += session.request
                used += holding
                busy += holding if session.busy and session.transition is None else 0  # a short kernel only retries
            else:
                activities[lease_id] = _NOT_RUNNING
        if open_hour:
            self.samples[0] += leased
            self.samples[1] += used
            self.samples[2] += busy
            self.samples[3] += 1
            self.samples[4] += guaranteed
        if self.elastic:  # what the watchdog measures: near its size a slice grows, over its limit it is told
            # Only what changed since the last report (a use, or a slice's size): the engine acts on
            # nothing else, and one report per kernel per tick was most of an elastic run's time.
            seen = {lease_id: (used, self.by_lease[lease_id].size) for lease_id, used in usage.items()}
            changed = {lease_id: usage[lease_id] for lease_id, mark in seen.items() if self.reported.get(lease_id) != mark}
            self.reported = seen
            if changed:
                self.calls += 1
                self.pool.report_usage(changed, now=t)
        self.calls += 1
        self.pool.tick(now=t, activities=activities)
        self._drain()

    def _count_stalled_gpus(self) -> None:
        """Elastic: count this tick's GPUs, and those where every kernel holding a slice waits for it to grow."""
        self.gpu_ticks += self.gpu_count
        waiting: dict[str, bool] = {}  # per GPU: whether every kernel running there waits to grow
        for session in self.by_lease.values():
            if session.state == "running" and session.transition is None:
                for uuid in session.devices:
                    waiting[uuid] = waiting.get(uuid, True) and self._short(session)
        self.stalled_gpu_ticks += sum(waiting.values())

    def _result(self, horizon: float, elapsed: float) -> ModeResult:
        still = 0
        for session in self.sessions:
            if self._short(session):  # still waiting for its slice to grow
                still += 1
                self._count_grow_wait(session, horizon)
            if session.state == "running":
                self._end_lease(session, horizon)
            elif session.state == "queued":
                still += 1
                self._count_wait(session, horizon - session.request_at)
            elif session.state == "resuming":
                still += 1
                self._count_wait(session, horizon - session.resume_at, resume=True)
        users = set(self.user_wait) | set(self.user_held)
        shares = []
        for user in sorted(users):
            held, waited = self.user_held.get(user, 0.0), self.user_wait.get(user, 0.0)
            shares.append(held / (held + waited) if held + waited > 0 else 1.0)
        ticks = max(1, int(self.samples[3]))
        cap = self.capacity * ticks
        return ModeResult(
            mode=self.mode,
            inventory=self.backend.describe().removeprefix("simulated "),
            gpus=len(self.backend.devices()),
            capacity=self.capacity,
            sessions=len(self.sessions),
            served=self.counts["served"],
            abandoned=self.counts["abandoned"],
            refused=self.counts["refused"],
            still_waiting=still,
            requests=len(self.waits),
            leased_pct=100 * self.samples[0] / cap,
            used_pct=100 * self.samples[1] / cap,
            busy_pct=100 * self.samples[2] / cap,
            wait_p50=percentile(self.waits, 50),
            wait_p95=percentile(self.waits, 95),
            wait_max=max(self.waits, default=0.0),
            wait_mean=statistics.fmean(self.waits) if self.waits else 0.0,
            reclaims=self.counts["reclaims"],
            idle_warnings=self.counts["warnings"],
            preemptions=self.counts["preemptions"],
            expired=self.counts["expired"],
            jain=jain_index(shares),
            days=self.settings.days,
            pool_calls=self.calls,
            elapsed=elapsed,
            suspends=self.counts["suspends"],
            resumes=self.counts["resumes"],
            moves=self.counts["moves"],
            resume_waits=len(self.resume_waits),
            resume_wait_p50=percentile(self.resume_waits, 50),
            resume_wait_p95=percentile(self.resume_waits, 95),
            resume_wait_max=max(self.resume_waits, default=0.0),
            parked_peak=self.parked_peak,
            parked_p95=int(percentile([float(b) for b in self.parked_samples], 95)),
            parked_limit=self.parked_limit,
            work_lost=self.work_lost,
            raised=self.raised,
            guaranteed_pct=100 * self.samples[4] / cap,
            grows=self.counts["grows"],
            shrinks=self.counts["shrinks"],
            over_limit=self.counts["over_limit"],
            grow_waits=len(self.grow_waits),
            grow_wait_p95=percentile(self.grow_waits, 95),
            gave_up_growing=self.counts["gave_up_growing"],
            grow_stalled_pct=100 * self.stalled_gpu_ticks / self.gpu_ticks if self.gpu_ticks else 0.0,
            cells=len(self.waits) + self.cells_at_once,
            cell_wait_p95=percentile([*self.waits, *[0.0] * self.cells_at_once], 95),
        )


#: The activity of a kernel that waits for its slice, or for its restore: no kernel runs yet.
_NOT_RUNNING = Activity(busy=False)


def uniform_backend(name: str, memory: int, count: int) -> SimulatedBackend:
    """``count`` GPUs of one model."""
    return SimulatedBackend([(name, memory)] * count, spec=f"{count}x{name}")


def inventory_model(spec: str) -> tuple[str, int, int]:
    """(model name, memory, count) of a one-model inventory; InvalidInput for a mixed one."""
    gpus = parse_inventory(spec)
    if len({g for g in gpus}) != 1:
        raise InvalidInput(f"the GPU-count search needs one GPU model, got {spec!r}; give e.g. --gpus 4xA100-80GB")
    return gpus[0][0], gpus[0][1], len(gpus)


def simulate(settings: Settings, modes: Iterable[str] = MODES, workload: Workload | None = None, config: Config | None = None) -> dict[str, ModeResult]:
    """Every mode on the settings' inventory, with the same sessions."""
    workload = workload or load_workload()
    plans = make_plans(settings, workload)
    return {mode: run_mode(settings, plans, mode, SimulatedBackend.from_spec(settings.gpus), config) for mode in modes}


def run_mode(settings: Settings, plans: list[SessionPlan], mode: str, backend: SimulatedBackend, config: Config | None = None) -> ModeResult:
    """One mode on one inventory: the pool's modes through :class:`LabRun`, the oracle without the pool."""
    if mode == "oracle":
        return OracleRun(settings, plans, backend, PoolPolicy(config=config)).run(ModeResult)
    return LabRun(settings, plans, mode, backend, config).run()
