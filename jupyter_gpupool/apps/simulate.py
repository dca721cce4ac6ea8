"""``jupyter gpupool simulate``: how many people can share these GPUs, and how long do they wait?

A discrete-event simulation in virtual time that drives the production :class:`~jupyter_gpupool.backends.local.pool.Pool`
(engine, SQLite store, simulated devices) with an explicit ``now`` on every call, exactly as the
server extension would: sessions request a slice, wait in the pool's queue, report busy/idle
activity and heartbeats every tick, and release their slice when they leave. Grants, warnings and
reclaims are read back from the pool's own event log.

Five modes are compared on the same arrivals (common random numbers):

``exclusive``   one kernel per whole GPU: every request asks for a full GPU; idle policy ``never``.
``pooled``      each session asks for what ``--requests`` says (``exact``, the default: its need rounded
                up to a GiB), a fixed slice (``PoolPolicy.burst = 0``); idle policy ``never``. A session
                whose need is above what it asked for is taken to have asked for its need.
``reclaim``     pooled, with idle policy ``pressure``: idle slices go back while others wait. A
                reclaimed user comes back when their idle spell ends and requests again (that
                wait counts too).
``suspend``     pooled, idle policy ``pressure`` with a short idle timeout, sessions' requests
                ``suspendable``, ``reclaim_action = "suspend"``: an idle slice is parked in host RAM
                (nothing is lost) within the host-RAM budget ``parked_memory_limit``, else culled.
                The simulator plays each kernel's server: it confirms a suspend after the checkpoint
                time (used memory ÷ :data:`CHECKPOINT_BYTES_PER_SECOND`), resumes a suspended session
                when its next busy phase starts (``pool.resume``; the wait until the memory is
                restored is a *resume wait*), confirms a restore after the restore time, and a live
                move (``MIGRATE``) after a suspend plus a restore.
``elastic``     pooled+suspend with elastic slices: a session is guaranteed what it asked for and its
                slice grows on the real engine (``pool.grow``, as a framework cap's allocation failure
                asks, and the watchdog's usage reports) up to the pool's ``burst`` limit while its GPU
                has memory nobody is guaranteed; the engine takes burst back for a waiting request
                (``shrink``) and parks a kernel left above its slice when it is idle. A cell whose
                slice cannot grow waits (a *grow wait*, also in the wait columns) while the engine
                serves the grow in line: in place, by a live move to a GPU with room, or from idle
                neighbours' burst; the cell runs on the pool's ``grow`` decision. Its user gives up
                after ``--patience``. Usage is reported when it changes. "leased" is the slices'
                current sizes.
``oracle``      the physical limit, not run on the pool (:mod:`jupyter_gpupool.apps.oracle`): each
                session holds exactly its use while a cell computes and nothing while idle, parked
                and moved for free; a cell starts when the running cells pass a proven per-GPU
                packing bound. Only with ``--modes``; every cell after an idle spell is a request.

The inverse question (``--target-p95-wait 5m``) searches GPU counts of the inventory's model
upwards from one and reports, per mode, the fewest that keep the p95 wait within the target.

What the table reports:

* **leased / used / busy** — GPU memory held by granted leases / needed by their kernels / needed
  by kernels that are computing right now, as a share of all GPU memory, sampled every tick
  during the day shape's open hours (hours with a weight above 0).
* **wait p50 / p95 / max** — over every request: first requests, requests again after a reclaim,
  requests given up after ``--patience`` (counted at the patience) and requests still queued
  when the run ends (counted until the end).
* **served/day** — sessions that finished their work; **gave up/day** — users who stopped waiting.
* **reclaims** — idle slices the pool took back by shutting the kernel down (its ``reclaim_idle``
  events: culls); **suspends** — slices parked in host RAM instead (its ``suspend`` events).
* **resume wait** — from a suspended session's next busy phase (or from a cell blocked by a suspend
  or a move) until its memory is back on a GPU: queueing plus restore time. These waits are also in
  the wait columns.
* **work lost** — GPU-busy time that culled kernels had computed before they were shut down: their
  variables and models are gone (the simulation does not make the user re-run it; it only counts it).
* **parked peak / p95** — host RAM held by parked slices (set aside when a suspend or move begins,
  returned when the restore or move is done or the session ends): the peak over the run, and the
  p95 over the ticks of the open hours.
* **Jain** — Jain's index over users of (time holding a slice) ÷ (time holding + time waiting).
"""

from __future__ import annotations

import heapq
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from traitlets import Float, Integer, Unicode
from traitlets.config import Config

from jupyter_gpupool.application import GpuPoolBaseApp
from jupyter_gpupool.apps.cli import table
from jupyter_gpupool.apps.oracle import OracleRun
from jupyter_gpupool.apps.simstats import jain_index, percentile
from jupyter_gpupool.apps.workload import MemoryNeed, Workload, load_workload, parse_memory_need, parse_session_length
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Activity, LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend, parse_inventory
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB, format_duration, format_size, parse_duration, parse_size
from jupyter_gpupool.wording import count as counted
from jupyter_gpupool.wording import with_article

#: The modes run on the pool, compared by default.
MODES = ("exclusive", "pooled", "reclaim", "suspend", "elastic")
#: Every mode ``--modes`` accepts: the pool's, and the oracle (the physical limit, run without the pool).
ALL_MODES = (*MODES, "oracle")
MODE_LABELS = {
    "exclusive": "exclusive GPUs", "pooled": "pooled", "reclaim": "pooled+reclaim", "suspend": "pooled+suspend", "elastic": "elastic",
    "oracle": "oracle",
}
#: Modes whose idle kernels are parked in host RAM instead of culled (the suspend columns are theirs).
SUSPENDING = ("suspend", "elastic")
MODE_ALIASES = {
    "exclusive": "exclusive",
    "pooled": "pooled",
    "reclaim": "reclaim",
    "pooled+reclaim": "reclaim",
    "suspend": "suspend",
    "pooled+suspend": "suspend",
    "elastic": "elastic",
    "oracle": "oracle",
}

#: Effective rate, bytes per second, at which a kernel's GPU memory is copied to host RAM (suspend)
#: or back (restore). The physical floor is the host link: PCIe Gen5 x16 moves ≈ 63 GB/s a
#: direction; cuda-checkpoint was reported at ~15 s per GPU on 8×H100 (../shared/DESIGN.md), which
#: for a full 80 GB GPU is ≈ 5 GB/s including the driver's own work. 25 GB/s (≈ 40% of the link)
#: is in between: a 37 GiB trace session parks in 1.6 s. ``--checkpoint-rate`` tries others.
CHECKPOINT_BYTES_PER_SECOND = 25e9

#: Idle time after which pooled+suspend may park a slice while someone waits. Nothing is lost, so
#: it can be far shorter than the 30 min a cull needs. In the GenAI trace three idle spells in four
#: are under 4.8 min (median 1.9 min), so with 5 min (plus the 2 min warning) a user between two cells
#: is rarely parked, while spells over 5 min hold 92% of all idle slice-time: that is what it frees.
SUSPEND_IDLE_TIMEOUT = 300.0

#: Host RAM that parked slices may take in pooled+suspend: a lab server's share, not this machine's.
PARKED_MEMORY_LIMIT = 512 * GIB
SHAPE_FORMS = "flat, workday, class, or hour ranges with weights like 9-11:1,13-17:0.4"

#: Named day shapes: arrival weight per hour of the day (the peak is 1).
SHAPES: dict[str, tuple[float, ...]] = {
    "flat": (1.0,) * 24,
    # Office hours with a lunch dip and an evening tail.
    "workday": (0, 0, 0, 0, 0, 0, 0, 0, 0.4, 1, 1, 1, 0.6, 1, 1, 1, 1, 0.6, 0.3, 0.3, 0.3, 0.15, 0, 0),
    # A 9-11 class, with a little homework during the rest of the day.
    "class": (0, 0, 0, 0, 0, 0, 0, 0, 0.1, 1, 1, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.15, 0.1, 0.1, 0.1, 0, 0, 0),
}


# --- inputs -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DayShape:
    """Relative arrival rate per hour of the day, peak normalised to 1."""

    name: str
    weights: tuple[float, ...]

    def weight(self, t: float) -> float:
        return self.weights[int(t // 3600) % 24]

    @property
    def open_hours(self) -> int:
        return sum(1 for w in self.weights if w > 0)

    @property
    def peak_hours(self) -> float:
        """Arrivals per day ÷ the peak hourly rate."""
        return sum(self.weights)


def day_of_shape(name: str) -> str:
    """A day shape as a summary names it: ``a workday``, ``a flat day``, ``a day shaped 9-11:1``."""
    if name.endswith("day"):
        return with_article(name)
    return f"{with_article(name)} day" if name in SHAPES else f"a day shaped {name}"


def parse_shape(text: str) -> DayShape:
    """``workday`` or ``9-11:1,13-17:0.4`` → :class:`DayShape`; InvalidInput names the forms."""
    value = (text or "").strip().lower()
    if value in SHAPES:
        return DayShape(value, SHAPES[value])
    weights = [0.0] * 24
    try:
        for part in value.split(","):
            hours, _, weight = part.partition(":")
            start, _, end = hours.partition("-")
            lo, hi, w = int(start), int(end), float(weight or 1)
            if not (0 <= lo < hi <= 24) or w < 0 or not math.isfinite(w):
                raise ValueError
            for hour in range(lo, hi):
                weights[hour] = w
    except ValueError:
        raise InvalidInput(f"invalid day shape {text!r}: expected {SHAPE_FORMS}") from None
    peak = max(weights)
    if peak <= 0:
        raise InvalidInput(f"invalid day shape {text!r}: at least one hour needs a weight above 0; expected {SHAPE_FORMS}")
    return DayShape(value, tuple(w / peak for w in weights))


REQUEST_FORMS = (
    "'exact' (each session asks for its need rounded up to a GiB), 'default' (the pool's default slice, "
    "c.PoolPolicy.default_memory), or sizes with weights like 8GiB:0.5,20GiB:0.3,40GiB:0.2 (weights are relative)"
)


@dataclass(frozen=True)
class RequestSizes:
    """What sessions ask the pool for, whatever they need (``--requests``).

    ``exact``: the need rounded up to a GiB (users who know their peak: the default, as before
    ``--requests`` existed). ``default``: the pool's default slice, as users who never set a size.
    ``mix``: one of ``sizes`` drawn with ``weights`` (normalised to sum to 1), as a lab's kernelspecs
    offer them. A size is in the project's size grammar (``20GiB``, or ``25%`` of the largest GPU).
    """

    kind: str = "exact"  # "exact" | "default" | "mix"
    sizes: tuple[str, ...] = ()
    weights: tuple[float, ...] = ()

    @property
    def text(self) -> str:
        if self.kind != "mix":
            return self.kind
        return ",".join(f"{size}:{weight:g}" for size, weight in zip(self.sizes, self.weights, strict=True))

    def choose(self, rng: random.Random) -> int:
        """Index of the size a session asks for (0 outside ``mix``)."""
        if self.kind != "mix":
            return 0
        return rng.choices(range(len(self.sizes)), weights=self.weights)[0]

    def size(self, choice: int, need: int, default: int, largest: int) -> int:
        """Bytes asked for by a session that needs ``need`` (at most the largest GPU)."""
        if self.kind == "exact":
            asked = math.ceil(need / GIB) * GIB
        elif self.kind == "default":
            asked = default
        else:
            asked = parse_size(self.sizes[choice], gpu_memory=largest)
        return min(largest, asked)


def parse_requests(text: str) -> RequestSizes:
    """``exact``, ``default`` or ``8GiB:0.5,20GiB:0.3,40GiB:0.2`` → :class:`RequestSizes`.

    Weights are relative (``8GiB:1,40GiB:1`` is half and half) and must be above 0; each size is
    checked with :func:`~jupyter_gpupool.units.parse_size` (a share like ``25%`` is of the largest GPU).
    """
    value = (text or "").strip()
    if value.lower() in ("exact", "default"):
        return RequestSizes(value.lower())
    if not value:
        raise InvalidInput(f"invalid --requests '': expected {REQUEST_FORMS}")
    sizes: list[str] = []
    weights: list[float] = []
    for part in value.split(","):
        size, colon, weight_text = part.strip().rpartition(":")
        if not colon or not size.strip():
            raise InvalidInput(f"invalid --requests {text[:80]!r}: {part.strip()[:40]!r} needs a size and a weight, like 20GiB:0.3; expected {REQUEST_FORMS}")
        try:
            parse_size(size.strip(), gpu_memory=GIB)  # the grammar only: a share is taken of the real GPU later
        except InvalidInput as err:
            raise InvalidInput(f"invalid --requests {text[:80]!r}: {err}") from None
        try:
            weight = float(weight_text)
        except ValueError:
            weight = -1.0
        if not (weight > 0 and math.isfinite(weight)):
            raise InvalidInput(f"invalid --requests {text[:80]!r}: the weight of {size.strip()[:40]!r} must be a number above 0, got {weight_text.strip()[:20]!r}")
        if size.strip() in sizes:
            raise InvalidInput(f"invalid --requests {text[:80]!r}: {size.strip()[:40]!r} is given twice; give each size once")
        sizes.append(size.strip())
        weights.append(weight)
    total = sum(weights)
    return RequestSizes("mix", tuple(sizes), tuple(w / total for w in weights))


@dataclass(frozen=True)
class Settings:
    """One simulated scenario (everything except the mode and the GPU count)."""

    gpus: str = "4xA100-80GB"
    users: int = 60
    rate: float = 9.0  # arrivals per hour at the shape's peak
    shape: DayShape = field(default_factory=lambda: DayShape("workday", SHAPES["workday"]))
    days: float = 1.0
    seed: int = 42
    memory_need: MemoryNeed = field(default_factory=lambda: MemoryNeed("trace"))
    session_length: str = "trace"
    requests: RequestSizes = field(default_factory=RequestSizes)  # what sessions ask for (exact: as before)
    idle_timeout: float = 1800.0
    suspend_idle_timeout: float = SUSPEND_IDLE_TIMEOUT  # pooled+suspend's idle timeout
    parked_limit: int = PARKED_MEMORY_LIMIT  # host RAM for parked slices in pooled+suspend (0: none)
    checkpoint_rate: float = CHECKPOINT_BYTES_PER_SECOND  # bytes/s copied by a suspend (and a restore, unless restore_rate)
    restore_rate: float | None = None  # bytes/s copied back by a restore (None: checkpoint_rate)
    tick: float = 30.0
    patience: float | None = 3600.0  # a queued user gives up after this long (None: never)
    quota_max: int | None = None  # bytes a user may hold
    max_leases: int | None = None  # concurrent leases per user
    store: str = "memory"  # "memory" or "file"

    def describe(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = self.shape.name
        data["memory_need"] = asdict(self.memory_need)
        data["requests"] = self.requests.text
        return data


@dataclass
class SessionPlan:
    """What one session will do, drawn once per scenario and shared by every mode."""

    index: int
    arrival: float
    user: str
    need_kind: str  # "share" (of the largest GPU) or "bytes"
    need: float
    phases: list[tuple[bool, float]]  # (busy, seconds), in the order they happen while granted
    asks: int = 0  # which of ``--requests``' sizes the session asks for (a mix's index; 0 otherwise)

    def need_bytes(self, largest: int) -> int:
        raw = self.need * largest if self.need_kind == "share" else self.need
        return max(1, min(largest, int(raw)))


def make_plans(settings: Settings, workload: Workload) -> list[SessionPlan]:
    """Poisson arrivals shaped by the day (thinning), users drawn uniformly, work from the traces."""
    rng = random.Random(settings.seed)
    lengths = parse_session_length(settings.session_length, workload)
    horizon = settings.days * 86400
    plans: list[SessionPlan] = []
    t = 0.0
    while True:
        t += rng.expovariate(settings.rate / 3600)
        if t >= horizon:
            break
        if rng.random() >= settings.shape.weight(t):
            continue
        profile = workload.profiles[rng.randrange(len(workload.profiles))]
        kind, need = settings.memory_need.draw(profile, rng)
        length = lengths.sample(rng)
        user = f"user{rng.randrange(settings.users):03d}"
        plans.append(SessionPlan(len(plans), t, user, kind, need, profile.phases(length, rng)))
    # The sizes asked for come from a stream of their own: the arrivals and the work drawn above stay
    # those of the same seed whatever --requests is, and every mode sees the same choices.
    asking = random.Random(f"requests-{settings.seed}")
    for plan in plans:
        plan.asks = settings.requests.choose(asking)
    return plans


# --- results ----------------------------------------------------------------------------------------
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

    @property
    def served_per_day(self) -> float:
        return self.served / self.days

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["served_per_day"] = round(self.served_per_day, 2)
        data["abandoned_per_day"] = round(self.abandoned / self.days, 2)
        for key in (
            "leased_pct", "used_pct", "busy_pct", "jain", "wait_p50", "wait_p95", "wait_max", "wait_mean", "elapsed",
            "resume_wait_p50", "resume_wait_p95", "resume_wait_max", "work_lost", "guaranteed_pct", "grow_wait_p95",
            "grow_stalled_pct",
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
                session.limit = self._limit(policy, asked, used, largest)
                self.raised += session.limit > 0
            self.sessions.append(session)
        self.by_lease: dict[str, _Session] = {}
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.event_seq = 0
        self.waits: list[float] = []
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

    @staticmethod
    def _limit(policy: PoolPolicy, guarantee: int, used: int, largest: int) -> int:
        """Elastic: the limit a session asks for, 0 for the pool's ``burst`` — unless its need is above
        that, when it is taken to have asked for a limit of its need rounded up to a GiB."""
        need = min(largest, math.ceil(used / GIB) * GIB)
        if need <= guarantee or need <= (policy.burst_limit_bytes(guarantee, largest) or guarantee):
            return 0
        return need

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

    def _count_wait(self, session: _Session, wait: float, resume: bool = False) -> None:
        self.waits.append(wait)
        if resume:
            self.resume_waits.append(wait)
        user = session.plan.user
        self.user_wait[user] = self.user_wait.get(user, 0.0) + wait

    def _start_phase(self, session: _Session, t: float, length: float | None = None) -> None:
        """Start the session's current phase (``length``: what is left of a paused one)."""
        busy, planned = session.plan.phases[session.phase]
        length = planned if length is None else length
        session.busy = busy
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
                self._push(self._distinct(t, session), _ARRIVE, session.plan.index)
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
            self._start_phase(session, t)

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

    @staticmethod
    def _distinct(t: float, session: _Session) -> float:
        """``t`` plus a microsecond per session index: two users coming back at the same instant
        would otherwise tie on arrival time, which the queue breaks by (random) lease id."""
        return t + 1e-6 * (1 + session.plan.index)

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
        session.busy, session.blocked_since, session.remaining = False, None, None
        if needs_gpu:  # the user notices at once and asks again (the work of this phase starts over)
            session.gen += 1
            self._push(self._distinct(t, session), _ARRIVE, session.plan.index)
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
        return OracleRun(settings, plans, backend).run(ModeResult)
    return LabRun(settings, plans, mode, backend, config).run()


@dataclass
class SearchResult:
    """The fewest GPUs of a model that keep p95 wait within the target, for one mode."""

    mode: str
    model: str
    target: float
    gpus: int | None  # None: not reached within max_gpus
    tried: dict[int, float] = field(default_factory=dict)  # GPU count → p95 wait
    result: ModeResult | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "target_p95_wait": self.target,
            "gpus": self.gpus,
            "p95_wait_by_gpus": {str(k): round(v, 1) for k, v in sorted(self.tried.items())},
            "result": self.result.to_json() if self.result else None,
        }


def fewest_gpus(
    settings: Settings,
    mode: str,
    target: float,
    max_gpus: int = 32,
    workload: Workload | None = None,
    config: Config | None = None,
    plans: list[SessionPlan] | None = None,
) -> SearchResult:
    """Try 1, 2, ... GPUs of the inventory's model (same sessions each time) until p95 wait ≤ target.

    Counting up (not bisecting) makes the answer monotone in the target by construction: a looser
    target never needs more GPUs, even where p95 wait is not monotone in the GPU count.
    """
    name, memory, _ = inventory_model(settings.gpus)
    plans = plans if plans is not None else make_plans(settings, workload or load_workload())
    search = SearchResult(mode, name, target, None)
    for count in range(1, max_gpus + 1):
        result = run_mode(settings, plans, mode, uniform_backend(name, memory, count), config)
        search.tried[count] = result.wait_p95
        if result.wait_p95 <= target:
            search.gpus, search.result = count, result
            break
    return search


def _run_one(settings: Settings, plans: list[SessionPlan], mode: str, gpus: str | tuple[str, int, int], config: Config | None) -> ModeResult:
    """One mode on an inventory (a spec, or ``(model, memory, count)`` of the search): a worker's task."""
    backend = SimulatedBackend.from_spec(gpus) if isinstance(gpus, str) else uniform_backend(*gpus)
    return run_mode(settings, plans, mode, backend, config)


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished child processes (the --jobs workers)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def run_parallel(
    settings: Settings,
    plans: list[SessionPlan],
    modes: list[str],
    target: float | None,
    max_gpus: int = 32,
    jobs: int = 1,
    config: Config | None = None,
) -> tuple[dict[str, ModeResult], dict[str, SearchResult]]:
    """Every mode, and (with ``target``) each mode's GPU-count search, in ``jobs`` processes.

    The same tables as running them one by one: every run is independent and deterministic, and a
    mode's search keeps the first count, from 1 up, that meets the target. To keep every process
    busy, counts past those still running are tried ahead (round-robin over the modes still
    searching); a result past a mode's answer is dropped, as the sequential search never ran it.
    """
    import concurrent.futures

    name, memory = (inventory_model(settings.gpus)[:2]) if target is not None else ("", 0)
    searches = {mode: SearchResult(mode, name, target, None) for mode in modes} if target is not None else {}
    done_runs: dict[tuple[str, int], ModeResult] = {}  # (mode, GPU count) -> result, until the search uses it
    next_count = dict.fromkeys(searches, 1)

    def closed(mode: str) -> bool:
        """The mode's search has its answer, or has tried every count."""
        search = searches[mode]
        return search.gpus is not None or len(search.tried) >= max_gpus

    def settle(mode: str) -> None:
        """Walk the mode's finished counts in order from the lowest untried; stop at the answer."""
        search = searches[mode]
        count = len(search.tried) + 1
        while (mode, count) in done_runs:
            result = done_runs.pop((mode, count))
            search.tried[count] = result.wait_p95
            if result.wait_p95 <= search.target:
                search.gpus, search.result = count, result
                break
            count += 1

    def next_task() -> tuple[str, int] | None:
        """The next count to try: the mode with the fewest counts handed out goes first."""
        open_modes = [m for m in searches if not closed(m) and next_count[m] <= max_gpus]
        if not open_modes:
            return None
        mode = min(open_modes, key=lambda m: (next_count[m], modes.index(m)))
        next_count[mode] += 1
        return mode, next_count[mode] - 1

    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs) as executor:
        bases = {mode: executor.submit(_run_one, settings, plans, mode, settings.gpus, config) for mode in modes}
        running: dict[concurrent.futures.Future[ModeResult], tuple[str, int]] = {}
        while True:
            in_flight = {*running, *(f for f in bases.values() if not f.done())}
            while len(in_flight) < jobs and (task := next_task()):
                mode, count = task
                future = executor.submit(_run_one, settings, plans, mode, (name, memory, count), config)
                running[future] = task
                in_flight.add(future)
            if not in_flight:
                break
            finished, _ = concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                if future not in running:  # a mode's run on the configured inventory
                    continue
                mode, count = running.pop(future)
                if not closed(mode):
                    done_runs[(mode, count)] = future.result()
                    settle(mode)
                    if closed(mode):  # its answer is known: counts past it will not be used
                        for other, (other_mode, _) in list(running.items()):
                            if other_mode == mode and other.cancel():
                                running.pop(other)
        results = {mode: future.result() for mode, future in bases.items()}
    return results, searches


# --- presentation -----------------------------------------------------------------------------------
def results_table(results: dict[str, ModeResult]) -> str:
    """One row per mode; with pooled+suspend, also its suspends, resume waits and parked host RAM."""
    suspending = any(r.mode in SUSPENDING for r in results.values())
    elastic = any(r.mode == "elastic" for r in results.values())
    headers = ["mode", "leased", "used", "busy", "wait p50", "wait p95", "wait max", "served/day", "gave up/day", "reclaims", "Jain"]
    if suspending:
        headers += ["suspends", "resume wait p95", "parked peak / p95", "work lost"]
    if elastic:
        headers += ["guaranteed", "grows / taken back", "grow wait p95"]
    rows = [
        [
            MODE_LABELS[r.mode],
            f"{r.leased_pct:.1f}%",
            f"{r.used_pct:.1f}%",
            f"{r.busy_pct:.1f}%",
            format_duration(r.wait_p50),
            format_duration(r.wait_p95),
            format_duration(r.wait_max),
            f"{r.served_per_day:.1f}",
            f"{r.abandoned / r.days:.1f}",
            str(r.reclaims),
            f"{r.jain:.3f}",
            *(suspend_columns(r) if suspending else []),
            *(elastic_columns(r) if elastic else []),
        ]
        for r in results.values()
    ]
    return table(headers, rows)


def suspend_columns(r: ModeResult) -> list[str]:
    """Suspends, p95 resume wait and parked host RAM (peak / p95) of a pooled+suspend result (dashes for
    the other modes), and every mode's work lost: GPU-busy time culled kernels had computed."""
    lost = f"{r.work_lost / 3600:.1f} h"
    if r.mode not in SUSPENDING:
        return ["-", "-", "-", lost]
    return [str(r.suspends), format_duration(r.resume_wait_p95), f"{format_size(r.parked_peak)} / {format_size(r.parked_p95)}", lost]


def copy_rates(checkpoint_rate: float, restore_rate: float | None) -> str:
    """``suspend/restore at 25 GB/s``, or ``suspend at 2 GB/s, restore at 6 GB/s`` where they differ."""
    if not restore_rate or restore_rate == checkpoint_rate:
        return f"suspend/restore at {checkpoint_rate / 1e9:g} GB/s"
    return f"suspend at {checkpoint_rate / 1e9:g} GB/s, restore at {restore_rate / 1e9:g} GB/s"


def requests_note(requests: RequestSizes, default_slice: int, results: dict[str, ModeResult]) -> str:
    """What sessions asked for, and the rule for those that needed more (a note under the table)."""
    if requests.kind == "exact":
        asked = "exact: each session asks for its need rounded up to a GiB"
    elif requests.kind == "default":
        asked = f"default: each session asks for the pool's default slice ({format_size(default_slice)})"
    else:
        asked = f"a mix: {', '.join(f'{w:.0%} ask for {size}' for size, w in zip(requests.sizes, requests.weights, strict=True))}"
    note = f"Requests {asked}; exclusive GPUs ask for a whole GPU."
    pooled = [r for r in results.values() if r.mode not in ("exclusive", "elastic", "oracle")]
    if requests.kind != "exact" and pooled:
        note += (
            f" In the fixed-slice modes a session that needs more than it asked for is taken to have asked for its need "
            f"rounded up to a GiB ({pooled[0].raised} of {pooled[0].sessions} sessions here)."
        )
    if "elastic" in results:
        r = results["elastic"]
        note += (
            f" elastic: each is guaranteed what it asked for and its slice grows on demand up to the pool's burst limit "
            f"(PoolPolicy.burst) while its GPU has memory nobody is guaranteed; leased counts current sizes. A session "
            f"whose need is above that limit is taken to have asked for a limit of its need ({r.raised} of {r.sessions})."
        )
        if r.abandoned:
            note += (
                f" Of the {r.abandoned} elastic sessions given up, {r.gave_up_growing} waited for their slice to grow; "
                f"every kernel on a GPU waited to grow {r.grow_stalled_pct:.1f}% of the GPU time."
            )
    if "oracle" in results:
        r = results["oracle"]
        note += (
            f" oracle: the physical limit for these sessions, whatever they ask for: a cell holds exactly its use while it "
            f"computes and nothing while idle (parked and moved for free), and starts when the running cells pass a per-GPU "
            f"packing bound (the larger of total use over GPU size and the uses over half a GPU); every cell after an idle "
            f"spell is a request ({r.requests} here)."
        )
    return note


def elastic_columns(r: ModeResult) -> list[str]:
    """Elastic slices: memory guaranteed (leased is their current size), grows and burst taken back, and
    the p95 wait of a cell for its slice to grow (dashes for the other modes)."""
    if r.mode != "elastic":
        return ["-", "-", "-"]
    return [f"{r.guaranteed_pct:.1f}%", f"{r.grows} / {r.shrinks}", format_duration(r.grow_wait_p95)]


def search_table(searches: dict[str, SearchResult]) -> str:
    rows = []
    for s in searches.values():
        tried = ", ".join(f"{k}:{format_duration(v)}" for k, v in sorted(s.tried.items()))
        rows.append([MODE_LABELS[s.mode], str(s.gpus) if s.gpus else f"> {max(s.tried, default=0)}", tried])
    return table(["mode", "fewest GPUs", "p95 wait by GPU count"], rows)


class SimulateApp(GpuPoolBaseApp):
    """What-if for admins: exclusive GPUs vs pooled vs pooled with idle reclaim or suspend, in virtual time."""

    name = "jupyter-gpupool-simulate"
    description = (
        "Simulate a notebook lab on the real pool engine: jupyter gpupool simulate --gpus 4xA100-80GB --users 60 "
        "[--rate 9 --shape workday --days 1 --seed 42] [--target-p95-wait 5m]"
    )
    aliases = {
        **GpuPoolBaseApp.aliases,
        "gpus": "SimulateApp.gpus",
        "users": "SimulateApp.users",
        "rate": "SimulateApp.rate",
        "shape": "SimulateApp.shape",
        "days": "SimulateApp.days",
        "seed": "SimulateApp.seed",
        "memory-need": "SimulateApp.memory_need",
        "session-length": "SimulateApp.session_length",
        "requests": "SimulateApp.requests",
        "idle-timeout": "SimulateApp.idle_timeout",
        "suspend-idle-timeout": "SimulateApp.suspend_idle_timeout",
        "parked-memory-limit": "SimulateApp.parked_memory_limit",
        "checkpoint-rate": "SimulateApp.checkpoint_rate",
        "restore-rate": "SimulateApp.restore_rate",
        "tick": "SimulateApp.tick",
        "patience": "SimulateApp.patience",
        "quota": "SimulateApp.quota",
        "max-leases": "SimulateApp.max_leases",
        "modes": "SimulateApp.modes",
        "target-p95-wait": "SimulateApp.target_p95_wait",
        "max-gpus": "SimulateApp.max_gpus",
        "jobs": "SimulateApp.jobs",
        "store": "SimulateApp.store",
        "traces": "SimulateApp.traces",
        "placement": "PoolPolicy.placement",
    }

    gpus = Unicode("4xA100-80GB", help="Inventory to simulate, e.g. 4xA100-80GB or 1x24GiB.").tag(config=True)
    users = Integer(60, help="Number of distinct users sessions are drawn from.").tag(config=True)
    rate = Unicode("auto", help="Session arrivals per hour at the day's peak; 'auto' = 0.15 per user.").tag(config=True)
    shape = Unicode("workday", help=f"Day shape of arrivals: {SHAPE_FORMS}.").tag(config=True)
    days = Float(1.0, help="Simulated days (the day shape repeats).").tag(config=True)
    seed = Integer(42, help="Random seed: the same seed gives every mode the same sessions.").tag(config=True)
    memory_need = Unicode("trace", help="Memory a session needs: " + "'trace' (share of its GPU a GenAI-trace pod held), "
                          "'trace-bytes', a size like 8GiB, a share like 25%, or a range like 2GiB-8GiB.").tag(config=True)
    session_length = Unicode("trace", help="How long a session stays open: 'trace' (Philly run times, 5 min-8 h), 45m, or 30m-2h.").tag(config=True)
    requests = Unicode(
        "exact",
        help="What each session asks for: 'exact' (its need rounded up to a GiB; the default, as before this option), "
        "'default' (the pool's default slice), or sizes with relative weights like 8GiB:0.5,20GiB:0.3,40GiB:0.2 "
        "(as a lab's kernelspecs offer them). Exclusive GPUs always ask for a whole GPU.",
    ).tag(config=True)
    idle_timeout = Unicode("30m", help="Idle time after which pooled+reclaim may take a slice back while others wait.").tag(config=True)
    suspend_idle_timeout = Unicode(
        f"{SUSPEND_IDLE_TIMEOUT / 60:g}m",
        help="Idle time after which pooled+suspend may park a slice in host RAM while others wait (nothing is lost, so it can be short).",
    ).tag(config=True)
    parked_memory_limit = Unicode(
        "512GiB",
        help="Simulated host RAM that pooled+suspend's parked slices may take together, e.g. 512GiB; over it a reclaim culls ('0': never park).",
    ).tag(config=True)
    checkpoint_rate = Float(
        CHECKPOINT_BYTES_PER_SECOND / 1e9,
        help="GB/s (decimal) at which a suspend copies GPU memory to host RAM and a restore copies it back "
        "(PCIe Gen5 x16 is ~63 GB/s a direction; cuda-checkpoint was reported at ~15 s per 80 GB H100).",
    ).tag(config=True)
    restore_rate = Float(
        0.0,
        help="GB/s (decimal) at which a restore copies parked memory back onto a GPU; 0: the --checkpoint-rate "
        "(an H200 through the CUDA checkpoint API parked at ~2 GB/s and restored at ~6 GB/s, tests/gpu/RESULTS.md).",
    ).tag(config=True)
    tick = Unicode("30s", help="Virtual time between engine ticks (activity reports, reclaims, grants).").tag(config=True)
    patience = Unicode("1h", help="A queued user gives up after waiting this long ('none': never).").tag(config=True)
    quota = Unicode("", help="Most memory one user may hold at once, e.g. 40GiB (default: no limit).").tag(config=True)
    max_leases = Integer(0, help="Most concurrent leases per user (0: no limit).").tag(config=True)
    modes = Unicode(",".join(MODES), help="Modes to compare: exclusive, pooled, reclaim (pooled+reclaim), suspend (pooled+suspend), "
                    "elastic (guaranteed what was asked, grown on demand, with suspend), oracle (the physical limit: "
                    "each cell holds its use only while it computes, packed per GPU; not in the default).").tag(config=True)
    target_p95_wait = Unicode("", help="Also find, per mode, the fewest GPUs of the model that keep p95 wait within this, e.g. 5m.").tag(config=True)
    max_gpus = Integer(32, help="Largest GPU count the --target-p95-wait search tries.").tag(config=True)
    jobs = Integer(1, help="Processes running the modes and the GPU-count search in parallel (same tables as 1).").tag(config=True)
    store = Unicode("memory", help="SQLite store of the simulated pool: 'memory' or 'file' (a temporary file, WAL).").tag(config=True)
    traces = Unicode("", help="Folder of the public traces (default: $GPUPOOL_TRACES or ../shared/traces).").tag(config=True)

    def settings(self) -> tuple[Settings, list[str], float | None]:
        """Check every option; InvalidInput names the accepted forms."""
        parse_inventory(self.gpus)
        if not 1 <= self.users <= 100_000:
            raise InvalidInput(f"invalid --users {self.users}: expected a whole number from 1 to 100000")
        if not 0 < self.days <= 366:
            raise InvalidInput(f"invalid --days {self.days:g}: expected a number above 0 and at most 366")
        if self.rate.strip().lower() == "auto":
            rate = 0.15 * self.users
        else:
            try:
                rate = float(self.rate)
            except ValueError:
                rate = -1.0
            if not 0 < rate <= 1e6 or not math.isfinite(rate):
                raise InvalidInput(f"invalid --rate {self.rate!r}: expected arrivals per hour at the peak, like 12, or 'auto'")
        modes = []
        for item in self.modes.split(","):
            key = MODE_ALIASES.get(item.strip().lower())
            if key is None:
                raise InvalidInput(f"invalid mode {item.strip()!r}: choose from {', '.join(ALL_MODES)}")
            if key not in modes:
                modes.append(key)
        if self.store not in ("memory", "file"):
            raise InvalidInput(f"invalid --store {self.store!r}: expected memory or file")
        if self.max_leases < 0:
            raise InvalidInput(f"invalid --max-leases {self.max_leases}: expected 0 (no limit) or more")
        if not 1 <= self.max_gpus <= 1024:
            raise InvalidInput(f"invalid --max-gpus {self.max_gpus}: expected 1 to 1024")
        if not 1 <= self.jobs <= 256:
            raise InvalidInput(f"invalid --jobs {self.jobs}: expected a whole number of processes from 1 to 256")
        if not 0.01 <= self.checkpoint_rate <= 10_000 or not math.isfinite(self.checkpoint_rate):
            raise InvalidInput(f"invalid --checkpoint-rate {self.checkpoint_rate:g}: expected GB/s from 0.01 to 10000, like 25")
        if self.restore_rate != 0 and (not 0.01 <= self.restore_rate <= 10_000 or not math.isfinite(self.restore_rate)):
            raise InvalidInput(f"invalid --restore-rate {self.restore_rate:g}: expected GB/s from 0.01 to 10000, like 6, or 0 for the --checkpoint-rate")
        parked_limit = 0
        if self.parked_memory_limit.strip() != "0":
            try:
                if "%" in self.parked_memory_limit:
                    raise InvalidInput("a share")
                parked_limit = parse_size(self.parked_memory_limit)
            except InvalidInput:
                raise InvalidInput(
                    f"invalid --parked-memory-limit {self.parked_memory_limit[:40]!r}: expected a size of host RAM like 512GiB, or 0"
                ) from None
        patience = None if self.patience.strip().lower() in ("none", "never", "") else parse_duration(self.patience)
        settings = Settings(
            gpus=self.gpus,
            users=self.users,
            rate=rate,
            shape=parse_shape(self.shape),
            days=self.days,
            seed=self.seed,
            memory_need=parse_memory_need(self.memory_need),
            session_length=self.session_length,
            requests=parse_requests(self.requests),
            idle_timeout=parse_duration(self.idle_timeout),
            suspend_idle_timeout=parse_duration(self.suspend_idle_timeout),
            parked_limit=parked_limit,
            checkpoint_rate=self.checkpoint_rate * 1e9,
            restore_rate=self.restore_rate * 1e9 or None,
            tick=parse_duration(self.tick),
            patience=patience,
            quota_max=parse_size(self.quota) if self.quota else None,
            max_leases=self.max_leases or None,
            store=self.store,
        )
        target = parse_duration(self.target_p95_wait) if self.target_p95_wait else None
        if target is not None:
            inventory_model(self.gpus)
        return settings, modes, target

    def run(self) -> None:
        started, cpu_started = time.perf_counter(), _cpu_seconds()
        settings, modes, target = self.settings()
        workload = load_workload(self.traces or None)
        parse_session_length(settings.session_length, workload)  # fail before any run
        plans = make_plans(settings, workload)
        results: dict[str, ModeResult] = {}
        searches: dict[str, SearchResult] = {}
        if self.jobs > 1:
            results, searches = run_parallel(settings, plans, modes, target, self.max_gpus, self.jobs, self.config)
        else:
            for mode in modes:
                results[mode] = run_mode(settings, plans, mode, SimulatedBackend.from_spec(settings.gpus), self.config)
        if target is not None and self.jobs <= 1:
            for mode in modes:
                if not self.json:
                    print(f"searching GPU counts for {MODE_LABELS[mode]} ...", file=sys.stderr)
                searches[mode] = fewest_gpus(settings, mode, target, self.max_gpus, workload, self.config, plans)
        elapsed = time.perf_counter() - started
        backend = SimulatedBackend.from_spec(settings.gpus)
        capacity = sum(d.memory_total for d in backend.devices())
        largest = max(d.memory_total for d in backend.devices())
        default_slice = PoolPolicy(config=self.config).default_memory_bytes(largest)
        data = {
            "settings": settings.describe(),
            "sessions": len(plans),
            "workload": workload.sources,
            "results": {mode: r.to_json() for mode, r in results.items()},
            "search": {mode: s.to_json() for mode, s in searches.items()},
            "default_slice": default_slice,
            "elapsed_s": round(elapsed, 2),
            "cpu_s": round(_cpu_seconds() - cpu_started, 2),  # --jobs workers included
        }
        lines = [
            (
                f"Simulated lab: {settings.gpus} ({format_size(capacity)}), {settings.users} users, "
                f"{settings.rate:g} sessions/h at the peak of {day_of_shape(settings.shape.name)}, {counted(settings.days, 'day')}, "
                f"seed {settings.seed}: {len(plans)} sessions"
            ),
            (
                f"Idle timeout {format_duration(settings.idle_timeout)}, tick {format_duration(settings.tick)}, "
                f"users give up after {format_duration(settings.patience) if settings.patience else 'never'}"
            ),
            *(
                [
                    (
                        f"pooled+suspend: idle timeout {format_duration(settings.suspend_idle_timeout)}, host RAM for parked "
                        f"slices {format_size(settings.parked_limit) if settings.parked_limit else 'none'}, "
                        + copy_rates(settings.checkpoint_rate, settings.restore_rate)
                    )
                ]
                if "suspend" in modes
                else []
            ),
            "Workload: " + "; ".join(f"{k}: {v}" for k, v in workload.sources.items()),
            "",
            results_table(results),
            "",
            (
                "leased/used/busy: GPU memory held by leases / needed by their kernels / needed by kernels computing, "
                "as a share of all GPU memory, averaged over the day's open hours."
            ),
            requests_note(settings.requests, default_slice, results),
        ]
        if searches:
            lines += ["", f"Fewest {next(iter(searches.values())).model} GPUs keeping p95 wait within {format_duration(target)}:", search_table(searches)]
        lines.append(f"\n({elapsed:.1f} s, {data['cpu_s']:.1f} s of CPU)")
        self.emit(data, "\n".join(lines))


main = SimulateApp.launch_instance

if __name__ == "__main__":
    main()
