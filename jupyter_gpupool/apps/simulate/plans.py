"""The simulator's settings and its sessions: modes, day shapes, request sizes, and each session's plan
(arrival, work, what it asks for), drawn once from the seed so that every mode sees the same ones."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from typing import Any

from jupyter_gpupool.apps.workload import (
    MemoryNeed,
    Workload,
    parse_session_length,
)
from jupyter_gpupool.core.policy import DEFAULT_SUSPEND_IDLE_TIMEOUT
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import (
    GIB,
    parse_size,
)
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

#: Idle time after which pooled+suspend and elastic may park a slice while someone waits: the
#: pool's own default (``PoolPolicy``'s suspend idle timeout, 2 min), so the lab runs the pool as
#: installed. Nothing is lost, so it can be far shorter than the 30 min a cull needs; the simulator's
#: sweep of 30 s to 5 min chose it (bench/RESULTS.md). Until 2026-12-03 the simulator's own default
#: was 5 min: tables from before then pass ``--suspend-idle-timeout 5m`` to be reproduced.
SUSPEND_IDLE_TIMEOUT = DEFAULT_SUSPEND_IDLE_TIMEOUT

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
    oracle_keeps: tuple[str, ...] = ()  # promises of the pool the oracle keeps too (none: the physical limit)

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
