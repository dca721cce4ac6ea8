"""Notebook-session workloads for ``jupyter gpupool simulate``, drawn from public traces.

Three things describe a session: how long it stays open, how much GPU memory it needs, and
when its kernel computes versus sits idle while still holding that memory. The defaults come
from the traces in ``../shared/traces/`` (see its README), read at run time:

* **session length** — ``runtimes/philly_runtime.csv`` (83,154 Microsoft Philly GPU job run
  times). Jobs shorter than 5 minutes (failed or killed at start) and longer than 8 hours are
  dropped: what remains is read as "how long a kernel stays open". That a training job's run
  time stands in for a notebook session is an assumption, not a fact of the trace.
* **memory held and compute busy** — ``alibaba-genai-v2026/*.tar.gz`` (GPU memory used and
  GPU duty cycle per serving pod, sampled every 57 s over 22.8 h). Each pod becomes an
  :class:`ActivityProfile`: the memory it held (median of its non-zero samples) and the
  lengths of its busy runs (duty cycle above 1%) and idle runs. A session copies one pod:
  its memory, and busy/idle phases drawn from that pod's own runs — the trace's point is
  that memory stays held while compute is idle (about 70% of samples).

Only if the traces are absent (an installed package, no checkout) does :func:`load_workload`
fall back to :data:`FALLBACK`: quantile tables fitted from the same traces, labelled as such
in :attr:`Workload.sources`.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import io
import itertools
import json
import logging
import math
import os
import random
import re
import stat
import statistics
import tarfile
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB, parse_duration, parse_size

#: Memory of the GPUs in the GenAI trace: its largest sample is 47.3 GiB, read as a 48 GB card.
TRACE_GPU_MEMORY = 48 * GIB
#: Duty cycle (%) above which a 57 s sample counts as compute busy.
BUSY_DUTY_THRESHOLD = 1.0
#: Seconds between two samples of the GenAI trace.
TRACE_SAMPLE_SECONDS = 57.0
#: Session lengths kept from the Philly run times (seconds).
SESSION_MIN, SESSION_MAX = 300.0, 8 * 3600.0
#: Pods holding less than this are not using the GPU and are left out.
MIN_HELD = 256 * 1024**2
#: The GenAI trace's two series, under ``alibaba-genai-v2026``: GPU memory used, GPU duty cycle.
GENAI_TARBALLS = ("pod_gpu_memory_used_bytes_anon.tar.gz", "pod_gpu_duty_cycle_anon.tar.gz")

MEMORY_NEED_FORMS = (
    "'trace' (share of its GPU a GenAI-trace pod held), 'trace-bytes' (the bytes it held), "
    "a size like 8GiB, a share like 25%, or a range like 2GiB-8GiB (log-uniform)"
)
SESSION_LENGTH_FORMS = "'trace' (Philly run times, 5 min to 8 h), a duration like 45m, or a range like 30m-2h (log-uniform)"


# --- distributions ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Empirical:
    """Draws one of the observed values uniformly (a bootstrap of the trace)."""

    values: tuple[float, ...]

    def sample(self, rng: random.Random) -> float:
        return self.values[rng.randrange(len(self.values))]

    def quantile(self, q: float) -> float:
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class QuantileTable:
    """Inverse CDF by linear interpolation between equally spaced quantiles (the fallback)."""

    quantiles: tuple[float, ...]  # at 0, 1/(n-1), ..., 1

    def sample(self, rng: random.Random) -> float:
        u = rng.random() * (len(self.quantiles) - 1)
        i = min(int(u), len(self.quantiles) - 2)
        lo, hi = self.quantiles[i], self.quantiles[i + 1]
        return lo + (hi - lo) * (u - i)

    def quantile(self, q: float) -> float:
        return self.sample(_FixedRandom(q))


class _FixedRandom(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


@dataclass(frozen=True)
class Fixed:
    value: float

    def sample(self, rng: random.Random) -> float:
        return self.value

    def quantile(self, q: float) -> float:
        return self.value


@dataclass(frozen=True)
class LogUniform:
    low: float
    high: float

    def sample(self, rng: random.Random) -> float:
        return math.exp(rng.uniform(math.log(self.low), math.log(self.high)))

    def quantile(self, q: float) -> float:
        return math.exp(math.log(self.low) + q * (math.log(self.high) - math.log(self.low)))


Distribution = Empirical | QuantileTable | Fixed | LogUniform


# --- activity --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ActivityProfile:
    """One pod of the GenAI trace: memory held, and its busy and idle run lengths (seconds)."""

    memory_held: float  # bytes
    busy_runs: tuple[float, ...]
    idle_runs: tuple[float, ...]
    busy_fraction: float

    def phases(self, length: float, rng: random.Random) -> list[tuple[bool, float]]:
        """Alternating (busy, seconds) phases adding up to ``length``, starting busy (the first
        cell runs when a kernel starts) unless the pod never computed."""
        if not self.busy_runs:
            return [(False, length)]
        if not self.idle_runs:
            return [(True, length)]
        phases: list[tuple[bool, float]] = []
        busy, total = True, 0.0
        while total < length:
            runs = self.busy_runs if busy else self.idle_runs
            step = min(runs[rng.randrange(len(runs))], length - total)
            phases.append((busy, step))
            total += step
            busy = not busy
        return phases


@dataclass
class Workload:
    """Everything a simulated session is drawn from; ``sources`` says where each part came from."""

    session_length: Distribution
    profiles: tuple[ActivityProfile, ...]
    sources: dict[str, str] = field(default_factory=dict)

    def busy_fraction(self) -> float:
        """Share of time a drawn session computes, averaged over the profiles."""
        return statistics.fmean(p.busy_fraction for p in self.profiles)


# --- reading the traces ----------------------------------------------------------------------------
def find_traces(explicit: str | None = None) -> Path | None:
    """The traces folder: ``explicit``, ``$GPUPOOL_TRACES``, ``../shared/traces`` from the current
    folder, or beside the checkout this package lives in; None when none exists."""
    if explicit:
        if not _has_traces(Path(explicit)):
            raise InvalidInput(f"no traces under {explicit!r}: expected runtimes/philly_runtime.csv and alibaba-genai-v2026/*.tar.gz there")
        return Path(explicit).resolve()
    candidates = [os.environ.get("GPUPOOL_TRACES") or "", "../shared/traces", str(Path(__file__).resolve().parents[2] / "shared" / "traces")]
    for candidate in candidates:
        if candidate and _has_traces(Path(candidate)):
            return Path(candidate).resolve()
    return None


def _has_traces(folder: Path) -> bool:
    genai = folder / "alibaba-genai-v2026"
    return (folder / "runtimes" / "philly_runtime.csv").is_file() and all(
        (genai / name).is_file() for name in GENAI_TARBALLS
    )


T = TypeVar("T")

#: Bump when what is derived from the traces changes: older cached copies are then ignored.
CACHE_FORMAT = 1


def cache_folder() -> Path:
    """Where what is derived from the traces is kept between runs: ``$GPUPOOL_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/jupyter-gpupool`` (``~/.cache/jupyter-gpupool``)."""
    if os.environ.get("GPUPOOL_CACHE_DIR"):
        return Path(os.environ["GPUPOOL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jupyter-gpupool"


#: Largest kept copy read back (bytes): the real ones are a few MiB; a bigger file is not one of ours.
MAX_CACHE_BYTES = 256 * 1024 * 1024

_log = logging.getLogger(__name__)


def _read_cached(path: Path) -> str:
    """The text of a kept copy, read only if it is a regular file of at most :data:`MAX_CACHE_BYTES`:
    opened without blocking (a FIFO planted there never stalls a run) and without following a
    symlink, then checked with ``fstat`` before a byte is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_size > MAX_CACHE_BYTES:
            raise ValueError(f"{info.st_size} bytes, more than the {MAX_CACHE_BYTES} a copy may have")
        with os.fdopen(fd, "rb", closefd=True) as handle:
            fd = -1
            data = handle.read(MAX_CACHE_BYTES + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(data) > MAX_CACHE_BYTES:
        raise ValueError(f"more than the {MAX_CACHE_BYTES} bytes a copy may have")
    return data.decode("utf-8")


def _derived_from(sources: list[Path], name: str, build: Callable[[], Any], decode: Callable[[Any], T]) -> T:
    """``decode(build())``, with ``build()``'s JSON-ready value kept in :func:`cache_folder` under a
    key of the ``sources`` files (path, size, modification time) and the constants that shape it:
    an admin's what-if runs read the traces once, not on every run. A missing, stale, damaged or
    unwritable cache only means building again."""
    stats = [(str(path.resolve()), info.st_size, info.st_mtime_ns) for path in sources for info in [path.stat()]]
    constants = [CACHE_FORMAT, BUSY_DUTY_THRESHOLD, TRACE_SAMPLE_SECONDS, SESSION_MIN, SESSION_MAX, MIN_HELD]
    key = hashlib.sha256(json.dumps([name, stats, constants]).encode()).hexdigest()[:20]
    path = cache_folder() / f"{name}-{key}.json"
    try:
        return decode(json.loads(_read_cached(path)))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, MemoryError) as err:
        why = getattr(err, "strerror", None) or str(err).split("\n")[0][:120] or type(err).__name__
        _log.warning("the kept copy %s is damaged (%s); reading the traces again", path, why)
    value = build()
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        # A new file of a random name (never one planted there), then renamed: whole or not at
        # all, even with two runs at once.
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as partial:
            partial.write(json.dumps(value))
        try:
            os.replace(partial.name, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial.name)
    return decode(value)


@functools.lru_cache(maxsize=4)
def philly_session_lengths(traces: Path) -> tuple[float, ...]:
    """Philly run times between :data:`SESSION_MIN` and :data:`SESSION_MAX` seconds."""
    source = traces / "runtimes" / "philly_runtime.csv"

    def build() -> list[float]:
        with open(source, newline="") as handle:
            values = (float(row["runtime"]) for row in csv.DictReader(handle))
            return [v for v in values if SESSION_MIN <= v <= SESSION_MAX]

    return _derived_from([source], "philly-session-lengths", build, lambda values: tuple(map(float, values)))


def _read_tar_csv(path: Path) -> dict[str, list[tuple[float, float]]]:
    """``container_ip → [(timestamp, value)]`` from the one CSV inside a trace tarball."""
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    with tarfile.open(path, "r:gz") as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".csv"))
        handle = tar.extractfile(member)
        assert handle is not None
        rows = csv.reader(io.TextIOWrapper(handle, encoding="utf-8"))
        header = next(rows)  # plain rows, columns by name once: a DictReader was half of a run's start-up
        ip, at, value = header.index("container_ip"), header.index("timestamp_anon"), header.index("value")
        for row in rows:
            if row:
                series[row[ip]].append((float(row[at]), float(row[value])))
    for samples in series.values():
        samples.sort()
    return series


def _runs(flags: Sequence[bool]) -> tuple[list[float], list[float]]:
    """Lengths in seconds of the busy and of the idle runs in a sample sequence."""
    busy: list[float] = []
    idle: list[float] = []
    if not flags:
        return busy, idle
    run = 1
    for previous, current in itertools.pairwise(flags):
        if current == previous:
            run += 1
            continue
        (busy if previous else idle).append(run * TRACE_SAMPLE_SECONDS)
        run = 1
    (busy if flags[-1] else idle).append(run * TRACE_SAMPLE_SECONDS)
    return busy, idle


@functools.lru_cache(maxsize=4)
def genai_profiles(traces: Path) -> tuple[ActivityProfile, ...]:
    """One :class:`ActivityProfile` per pod present in both GenAI series that held GPU memory."""
    folder = traces / "alibaba-genai-v2026"
    memory, duty = (folder / name for name in GENAI_TARBALLS)

    def build() -> list[list[Any]]:
        return [[p.memory_held, list(p.busy_runs), list(p.idle_runs), p.busy_fraction] for p in _read_genai_profiles(memory, duty)]

    def decode(rows: list[list[Any]]) -> tuple[ActivityProfile, ...]:
        return tuple(
            ActivityProfile(memory_held=float(held), busy_runs=tuple(map(float, busy)), idle_runs=tuple(map(float, idle)), busy_fraction=float(fraction))
            for held, busy, idle, fraction in rows
        )

    return _derived_from([memory, duty], "genai-profiles", build, decode)


def _read_genai_profiles(memory_tarball: Path, duty_tarball: Path) -> list[ActivityProfile]:
    memory = _read_tar_csv(memory_tarball)
    duty = _read_tar_csv(duty_tarball)
    profiles = []
    for pod in sorted(set(memory) & set(duty)):
        held = [v for _, v in memory[pod] if v > 0]
        if not held or statistics.median(held) < MIN_HELD:
            continue
        flags = [v > BUSY_DUTY_THRESHOLD for _, v in duty[pod]]
        busy, idle = _runs(flags)
        profiles.append(
            ActivityProfile(
                memory_held=float(statistics.median(held)),
                busy_runs=tuple(busy),
                idle_runs=tuple(idle),
                busy_fraction=sum(flags) / len(flags),
            )
        )
    return profiles


# --- the fallback (only when the traces are absent) ------------------------------------------------
#: Quantiles (0, 5, ..., 100%) fitted from the traces above, used ONLY when they are absent.
FALLBACK = {
    "session_length": (
        300.0, 429.0, 561.0, 684.0, 859.0, 1009.0, 1211.0, 1440.0, 1580.0, 1853.0, 2048.0,
        2342.0, 2543.0, 2714.0, 3370.0, 4046.0, 5252.0, 6038.0, 9144.0, 13894.0, 28791.0,
    ),
    "memory_held_share": (
        0.02, 0.35, 0.36, 0.45, 0.45, 0.46, 0.46, 0.46, 0.46, 0.46, 0.47,
        0.47, 0.48, 0.48, 0.49, 0.5, 0.51, 0.56, 0.62, 0.63, 0.66,
    ),
    "busy_run": (
        57.0, 57.0, 57.0, 57.0, 57.0, 57.0, 57.0, 114.0, 114.0, 114.0, 114.0,
        114.0, 114.0, 171.0, 171.0, 228.0, 228.0, 285.0, 399.0, 513.0, 2850.0,
    ),
    "idle_run": (
        57.0, 57.0, 57.0, 57.0, 57.0, 57.0, 57.0, 57.0, 114.0, 114.0, 114.0,
        171.0, 171.0, 228.0, 228.0, 342.0, 399.0, 570.0, 855.0, 1596.0, 78945.0,
    ),
    "never_busy_share": 0.063,
}
FALLBACK_NOTE = (
    "FALLBACK (traces not found): built-in quantiles fitted from ../shared/traces "
    "(Philly run times 5 min-8 h; GenAI pods' memory share and busy/idle runs)"
)


def _fallback_profiles(seed: int = 0, count: int = 200) -> tuple[ActivityProfile, ...]:
    """Synthetic pods drawn from the fallback quantile tables (deterministic)."""
    rng = random.Random(seed)
    share = QuantileTable(FALLBACK["memory_held_share"])  # type: ignore[arg-type]
    busy = QuantileTable(FALLBACK["busy_run"])  # type: ignore[arg-type]
    idle = QuantileTable(FALLBACK["idle_run"])  # type: ignore[arg-type]
    never = float(FALLBACK["never_busy_share"])  # type: ignore[arg-type]
    profiles = []
    for _ in range(count):
        held = share.sample(rng) * TRACE_GPU_MEMORY
        if rng.random() < never:
            profiles.append(ActivityProfile(held, (), (TRACE_SAMPLE_SECONDS,), 0.0))
            continue
        busy_runs = tuple(round(busy.sample(rng) / TRACE_SAMPLE_SECONDS) * TRACE_SAMPLE_SECONDS or TRACE_SAMPLE_SECONDS for _ in range(25))
        idle_runs = tuple(round(idle.sample(rng) / TRACE_SAMPLE_SECONDS) * TRACE_SAMPLE_SECONDS or TRACE_SAMPLE_SECONDS for _ in range(25))
        fraction = sum(busy_runs) / (sum(busy_runs) + sum(idle_runs))
        profiles.append(ActivityProfile(held, busy_runs, idle_runs, fraction))
    return tuple(profiles)


def load_workload(traces: str | None = None) -> Workload:
    """The default workload from the traces, or the labelled fallback when they are absent."""
    folder = find_traces(traces)
    if folder is None:
        return Workload(
            session_length=QuantileTable(FALLBACK["session_length"]),  # type: ignore[arg-type]
            profiles=_fallback_profiles(),
            sources={"session_length": FALLBACK_NOTE, "activity": FALLBACK_NOTE, "memory": FALLBACK_NOTE},
        )
    lengths = philly_session_lengths(folder)
    profiles = genai_profiles(folder)
    return Workload(
        session_length=Empirical(lengths),
        profiles=profiles,
        sources={
            "session_length": f"{folder}/runtimes/philly_runtime.csv: {len(lengths)} run times between 5 min and 8 h",
            "activity": f"{folder}/alibaba-genai-v2026: {len(profiles)} pods, busy = duty cycle > {BUSY_DUTY_THRESHOLD:g}%",
            "memory": f"{folder}/alibaba-genai-v2026: median memory each pod held (GPU read as 48 GiB)",
        },
    )


# --- user-facing specs -----------------------------------------------------------------------------
_RANGE = re.compile(r"^\s*([^-\s][^-]*?)\s*-\s*([^-\s][^-]*?)\s*$")


@dataclass(frozen=True)
class MemoryNeed:
    """How a session's memory need is drawn: from its trace profile, or from the user's spec."""

    kind: str  # "trace" | "trace-bytes" | "fixed" | "share" | "range"
    low: float = 0.0  # bytes, or a share for "share"
    high: float = 0.0

    def draw(self, profile: ActivityProfile, rng: random.Random) -> tuple[str, float]:
        """``("share", fraction of the largest GPU)`` or ``("bytes", n)``."""
        if self.kind == "trace":
            return "share", min(1.0, profile.memory_held / TRACE_GPU_MEMORY)
        if self.kind == "trace-bytes":
            return "bytes", profile.memory_held
        if self.kind == "share":
            return "share", self.low
        if self.kind == "fixed":
            return "bytes", self.low
        return "bytes", LogUniform(self.low, self.high).sample(rng)


def parse_memory_need(text: str) -> MemoryNeed:
    """Read ``--memory-need``; raises :class:`InvalidInput` naming the accepted forms."""
    value = (text or "").strip()
    if value.lower() in ("trace", "trace-bytes"):
        return MemoryNeed(value.lower())
    try:
        if value.endswith("%"):
            share = parse_size(value, gpu_memory=10**6) / 10**6
            return MemoryNeed("share", share)
        ranged = _RANGE.match(value)
        if ranged and not value.replace(".", "").isdigit():
            low, high = parse_size(ranged.group(1)), parse_size(ranged.group(2))
            if low >= high:
                raise InvalidInput(f"invalid memory need {text!r}: the range must go from small to large")
            return MemoryNeed("range", low, high)
        return MemoryNeed("fixed", parse_size(value))
    except InvalidInput as err:
        if "range must" in str(err):
            raise
        raise InvalidInput(f"invalid memory need {text!r}: expected {MEMORY_NEED_FORMS}") from None


def parse_session_length(text: str, workload: Workload) -> Distribution:
    """Read ``--session-length`` (``trace`` uses the workload's own distribution)."""
    value = (text or "").strip()
    if value.lower() == "trace":
        return workload.session_length
    try:
        ranged = _RANGE.match(value)
        if ranged:
            low, high = parse_duration(ranged.group(1)), parse_duration(ranged.group(2))
            if low >= high:
                raise InvalidInput(f"invalid session length {text!r}: the range must go from short to long")
            return LogUniform(low, high)
        return Fixed(parse_duration(value))
    except InvalidInput as err:
        if "range must" in str(err):
            raise
        raise InvalidInput(f"invalid session length {text!r}: expected {SESSION_LENGTH_FORMS}") from None


def fitted_quantiles(values: Sequence[float], steps: int = 20) -> tuple[float, ...]:
    """``steps + 1`` equally spaced quantiles: how :data:`FALLBACK` was fitted."""
    ordered = sorted(values)
    return tuple(round(ordered[min(len(ordered) - 1, round(i * (len(ordered) - 1) / steps))], 2) for i in range(steps + 1))
