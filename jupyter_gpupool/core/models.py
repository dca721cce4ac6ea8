"""Plain data the engine works on: devices, requests, leases, decisions.

No Jupyter, no I/O. Times are POSIX seconds passed in explicitly by the caller.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Device:
    """One poolable GPU (or MIG instance) as a backend reports it."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_free: int | None = None  # what the driver says is free right now (None: unknown)
    healthy: bool = True
    health_reason: str = ""
    is_mig: bool = False
    parent_uuid: str | None = None  # the physical GPU of a MIG instance
    mig_mode: bool = False  # the physical GPU has MIG enabled
    nvlink_peers: frozenset[str] = frozenset()  # uuids this device has NVLink to
    overcommit: float = 1.0  # leasable = memory_total * overcommit
    minor: int | None = None  # the driver's minor number: /dev/nvidiaN's N, not the index (None: unknown)
    mig_gi: int | None = None  # a MIG instance's GPU instance id (nvmlDeviceGetGpuInstanceId; None: unknown)
    mig_ci: int | None = None  # a MIG instance's compute instance id (nvmlDeviceGetComputeInstanceId)

    @property
    def model(self) -> str:
        """A short, comparable model name (``A100-80GB``, ``T4``) for model constraints."""
        return normalize_model(self.name)

    @property
    def leasable(self) -> int:
        return int(self.memory_total * self.overcommit)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["nvlink_peers"] = sorted(self.nvlink_peers)
        data["model"] = self.model
        return data


@functools.lru_cache(maxsize=1024)
def normalize_model(name: str) -> str:
    """``NVIDIA A100-SXM4-80GB`` → ``A100-SXM4-80GB``: vendor prefixes dropped, upper case, spaces as ``-``."""
    text = name.strip()
    for prefix in ("NVIDIA ", "Tesla ", "GeForce ", "Quadro "):
        if text.upper().startswith(prefix.upper()):
            text = text[len(prefix) :]
    return text.replace(" ", "-").upper()


_VENDOR_TOKENS = frozenset({"NVIDIA", "TESLA", "GEFORCE", "QUADRO"})
_SIZE_TOKEN = re.compile(r"^(\d+(?:\.\d+)?)(?:GB|G|GIB)$")
#: Brand words that are not a model on their own: ``RTX 3090`` is the family ``RTX3090``.
_BRAND_TOKENS = frozenset({"RTX", "GTX", "TITAN"})
#: How far a device's memory may be from a size in a request (``T4-16GB`` on a T4 with 15.4 GiB).
_SIZE_TOLERANCE = 0.06
#: How the release reasons of slices taken from a running kernel begin: by an idle reclaim, a
#: preemption, a failed suspend or restore ("stopped: …"), or Slurm ending the kernel's job.
TAKEN_BACK_PREFIXES = ("reclaimed", "preempted", "ended by Slurm", "stopped")

MODEL_FORMS = (
    "an exact name as the pool lists it (A100-SXM4-80GB, RTX-A4000), its family (A100: every A100), "
    "or the family with a size or variant (A100-80GB, H100-PCIE)"
)


def model_tokens(text: str) -> tuple[str, ...]:
    """``NVIDIA A100 80GB PCIe`` → ``("A100", "80GB", "PCIE")``: upper case, vendor words dropped,
    sizes written one way (``80G``, ``80GiB`` → ``80GB``)."""
    tokens = [t for t in re.split(r"[\s_\-/]+", text.strip().upper()) if t]
    while tokens and tokens[0] in _VENDOR_TOKENS:
        tokens.pop(0)
    out = []
    for token in tokens:
        size = _SIZE_TOKEN.match(token)
        out.append(f"{float(size.group(1)):g}GB" if size else token)
    return tuple(out)


def model_family(tokens: tuple[str, ...]) -> str:
    """The product a name is of: ``A100`` for every A100, ``RTX3090`` for ``RTX 3090``."""
    if not tokens:
        return ""
    if tokens[0] in _BRAND_TOKENS and len(tokens) > 1 and not _SIZE_TOKEN.match(tokens[1]):
        return tokens[0] + tokens[1]
    return tokens[0]


def _family_aliases(family: str) -> set[str]:
    """A family and the names it is also asked by: ``RTXA4000`` is also ``A4000``."""
    names = {family}
    for brand in _BRAND_TOKENS:
        rest = family.removeprefix(brand)
        if rest != family and rest[:1].isalpha():
            names.add(rest)
    return names


def model_matches(wanted: str, device: Device) -> bool:
    """Whether a model constraint names this device's model. Never by substring: ``A10`` is not an
    A100, ``L4`` not an L40S, ``A40`` not an RTX A4000.

    It matches when it is the device's exact name (after :func:`model_tokens`), or names the
    device's family (:func:`model_family`) and only sizes or variants the device has: ``A100``
    matches both A100 sizes, ``A100-80GB`` only the 80 GB one (by the name's size, or by the
    device's memory when its name gives none), ``RTX3090`` matches ``NVIDIA GeForce RTX 3090``.
    """
    want = model_tokens(wanted)
    have = model_tokens(device.name)
    if not want or not have:
        return False
    if "".join(want) == "".join(have):
        return True
    want_family = model_family(want)
    have_family = model_family(have)
    if want_family not in _family_aliases(have_family):
        return False
    family_width = 2 if want_family != want[0] else 1
    have_rest = set(have[2 if have_family != have[0] else 1 :])
    has_size = any(_SIZE_TOKEN.match(t) for t in have_rest)
    for token in want[family_width:]:
        if token in have_rest:
            continue
        size = _SIZE_TOKEN.match(token)
        if size and not has_size:
            gib = float(size.group(1))
            if gib > 0 and abs(device.memory_total / 1024**3 - gib) <= _SIZE_TOLERANCE * gib:
                continue
        return False
    return True


class LeaseState(str, enum.Enum):
    QUEUED = "queued"
    GRANTED = "granted"
    SUSPENDED = "suspended"
    RELEASED = "released"

    def __str__(self) -> str:
        return self.value


class PriorityClass(str, enum.Enum):
    """Higher ``rank`` is served first and may preempt lower ranks."""

    BATCH = "batch"  # autograding, nbconvert runs
    NORMAL = "normal"  # live notebook users
    HIGH = "high"  # instructors, staff

    @property
    def rank(self) -> int:
        return {"batch": 0, "normal": 1, "high": 2}[self.value]

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class LeaseRequest:
    """What a kernel (or any client) asks the pool for."""

    owner: str
    memory: int  # bytes per GPU
    groups: tuple[str, ...] = ()
    kernel_id: str | None = None
    num_gpus: int = 1
    compute_share: int | None = None  # percent of SMs, for MPS/HAMi
    model: str | None = None  # GPU model constraint, e.g. "A100"
    priority: PriorityClass | None = None  # None: the class the admin set for the user/group
    duration: float | None = None  # seconds the holder expects to need it
    holder_pid: int | None = None  # process that holds the lease (reconciled if it dies)
    holder_host: str | None = None
    label: str = ""  # free text: notebook path, "nbconvert", ...
    #: The holder can park the kernel's GPU memory in host RAM and restore it (its server has a
    #: working checkpoint backend); only such leases are suspended instead of culled.
    suspendable: bool = False
    #: Bytes per GPU the slice may grow to while its GPU has room (an elastic slice's limit):
    #: None takes the pool's ``PoolPolicy.burst``, 0 asks for a fixed slice. ``memory`` is what
    #: is guaranteed.
    burst_limit: int | None = None


class Transition(str, enum.Enum):
    """A move of a lease's GPU memory that its holder's server is carrying out (two-phase: the
    engine decides, the server does it and confirms; memory stays counted until confirmed)."""

    NONE = ""
    SUSPENDING = "suspending"  # granted, being checkpointed to host RAM
    RESTORING = "restoring"  # granted again after a suspend, being restored onto ``devices``
    MIGRATING = "migrating"  # granted, being moved from ``migrate_from`` to ``devices``

    def __str__(self) -> str:
        return self.value


@dataclass
class Lease:
    """A request as the pool tracks it, through its whole life."""

    id: str
    owner: str
    memory: int
    state: LeaseState
    created_at: float
    groups: tuple[str, ...] = ()
    kernel_id: str | None = None
    num_gpus: int = 1
    compute_share: int | None = None
    model: str | None = None
    priority: PriorityClass = PriorityClass.NORMAL
    duration: float | None = None
    holder_pid: int | None = None
    holder_host: str | None = None
    label: str = ""
    devices: tuple[str, ...] = ()  # uuids, when granted
    granted_at: float | None = None
    released_at: float | None = None
    release_reason: str = ""
    heartbeat_at: float | None = None
    busy: bool = False
    last_activity: float | None = None
    connections: int = 0
    active_seconds: float = 0.0
    keep_until: float | None = None  # held through idle until then (``%gpupool keep``)
    warned_at: float | None = None  # idle/preemption warning given
    reclaim_at: float | None = None  # when the warned lease will be reclaimed
    reclaim_reason: str = ""
    used_memory: int | None = None  # from the watchdog, bytes (sum over GPUs)
    peak_memory: int | None = None
    over_limit_since: float | None = None
    flagged: str = ""  # e.g. "GPU lost": the device went unhealthy under the lease
    # (when, bytes per GPU held until then) for each resize while granted, so metering bills
    # each size for its own time, not the last size for the whole lease.
    memory_history: tuple[tuple[float, int], ...] = ()
    suspendable: bool = False  # see LeaseRequest.suspendable
    transition: Transition = Transition.NONE
    transition_at: float | None = None  # when the transition was decided (it times out)
    suspend_reason: str = ""  # why it is (being) suspended, for the user
    suspended_at: float | None = None
    parked_memory: int = 0  # bytes of host RAM its parked GPU memory takes (or is set aside for)
    #: Bytes of the host's pinned parking pool set aside for its kernel's framework backup (the
    #: fast parking path), kept between suspends until the lease ends; reserved through the pool
    #: (:meth:`Engine.reserve_pinned_backup`), so the pool's owner, never a file a user may write,
    #: holds the books. While the kernel runs it counts against the parked-memory budget as
    #: well; while parked, what of it exceeds its ``parked_memory`` does. Never more than its kernel
    #: may hold now (:func:`~jupyter_gpupool.core.index.pinned_ceiling`): a slice that shrinks takes it down.
    pinned_backup: int = 0
    #: Bytes (all GPUs) the pool measured its kernel holding when its suspend began (its watchdog's
    #: reading, or the driver's read then where that is more; 0: not measured): its confirmation is
    #: booked at no less, whatever its server reports parked.
    used_at_suspend: int = 0
    home_devices: tuple[str, ...] = ()  # uuids it ran on before it was suspended (restore maps from them)
    home_model: str = ""  # exact model of those GPUs: it is restored onto that model only
    resuming: bool = False  # queued to resume after a suspend
    resume_asked_at: float | None = None
    #: Queued to resume ahead of a cell (the notebook got focus): it queues behind every real request,
    #: never blocks, reclaims or preempts anyone, and a cell's own resume makes it a real one.
    resume_ahead: bool = False
    migrate_from: tuple[str, ...] = ()  # uuids it is moving off (held until the move is confirmed)
    suspensions: int = 0
    parked_seconds: float = 0.0  # total time spent suspended
    restore_failures: int = 0  # restores in a row that failed and left the memory parked
    # --- elastic slices: ``memory`` is the slice's current size; it never goes below ``guarantee``
    # and grows up to ``burst_limit`` while the GPU has memory nobody is guaranteed.
    #: Bytes per GPU the lease is guaranteed (what was asked, or the default). 0 on a lease written
    #: before elastic slices existed: its ``memory`` is its guarantee.
    guarantee: int = 0
    #: Bytes per GPU the slice may grow to (0: it never grows above its guarantee).
    burst_limit: int = 0
    #: When the pool last took this slice's burst back for someone else's request; its kernel's use
    #: must follow down to ``memory`` (its caps are lowered). None once its use is back within.
    burst_taken_at: float | None = None
    #: Bytes per GPU the slice held when its burst was taken back, until the pool's own watchdog
    #: measured its kernel within its new size after that (0 otherwise): the room it gave back
    #: counts as taken till then, so neither a measurement older than the shrink nor anyone's word
    #: hands it to the waiting request.
    burst_from: int = 0
    #: The last grow or give-back step, for the user ("grown to 8 GiB: ...", "burst taken back: ...").
    burst_note: str = ""
    #: Bytes per GPU its kernel asked to grow to and could not have yet (0: none): the pool serves
    #: it in order with queued requests, in place, by a move to a GPU with room, or from neighbours'
    #: idle burst.
    grow_wanted: int = 0
    #: When that ask was first refused.
    grow_since: float | None = None
    #: A queued request's: when the pool began taking burst back from slices to make room for it
    #: (None: it has not). A kernel waiting to grow yields that room to it.
    room_coming_at: float | None = None
    #: Bytes per GPU its kernel asked to be guaranteed (``%gpupool reserve``, a resize) that did
    #: not fit at once but fits once the slices beside it are at their guarantees (0: none): it
    #: waits in line as a queued request does, and the pool takes that burst back for it.
    reserve_wanted: int = 0
    #: When that reserve began to wait.
    reserve_since: float | None = None
    #: The limit its user set (``--limit``, the kernelspec, the REST API; 0: a fixed slice), None
    #: when never set: its limit is then the pool's burst of its current guarantee, recomputed
    #: on every size change.
    limit_asked: int | None = None

    @property
    def guarantee_size(self) -> int:
        """Bytes per GPU guaranteed: the lease's ``guarantee`` (its ``memory`` on a lease from before elastic slices)."""
        return self.guarantee or self.memory

    @property
    def limit_size(self) -> int:
        """Bytes per GPU the slice may grow to: its burst limit, never less than its current size."""
        return max(self.burst_limit, self.memory)

    @property
    def burst(self) -> int:
        """Bytes per GPU the slice holds now above its guarantee."""
        return max(0, self.memory - self.guarantee_size)

    @property
    def elastic(self) -> bool:
        """Whether the slice may grow above its guarantee."""
        return self.burst_limit > self.guarantee_size

    def watch_limit(self) -> int:
        """Bytes (all GPUs) the watchdog lets the kernel use before it warns and interrupts: the
        slice's limit, or its current size once the pool took its burst back."""
        per_gpu = self.memory if self.burst_taken_at is not None or not self.elastic else self.limit_size
        return per_gpu * max(1, self.num_gpus)

    @property
    def line_time(self) -> float:
        """When a granted kernel's wait for its slice to grow joined the line (its first grow refused
        for room); infinity while it waits for nothing. Grows are served in that order, ahead of the
        queued requests but for those the pool is taking burst back for (:attr:`room_coming_at`)."""
        return self.grow_since if self.grow_since is not None else float("inf")

    @property
    def queued_since(self) -> float:
        """When it joined the queue: its request, or its ask to resume."""
        return self.resume_asked_at if self.resuming and self.resume_asked_at is not None else self.created_at

    @property
    def expected_end(self) -> float | None:
        if self.duration is None or self.granted_at is None:
            return None
        return self.granted_at + self.duration

    @property
    def live(self) -> bool:
        return self.state is not LeaseState.RELEASED

    @property
    def taken_back(self) -> bool:
        """Released because the pool (or Slurm) took the slice from its kernel, not because the kernel
        ended or gave it back: that kernel is shut down, never restarted into a new request."""
        return not self.live and self.release_reason.startswith(TAKEN_BACK_PREFIXES)

    @property
    def tied_to_its_process(self) -> bool:
        """Whether the lease holds what only its kernel's current process can use: memory parked,
        being parked, restored or moved. A restarted kernel's new process asks again instead."""
        return self.state is LeaseState.SUSPENDED or self.resuming or self.transition is not Transition.NONE

    def idle_seconds(self, now: float) -> float:
        if self.busy or self.state is not LeaseState.GRANTED:
            return 0.0
        since = self.last_activity or self.granted_at or self.created_at
        return max(0.0, now - since)

    def copy(self, **changes: Any) -> Lease:
        """A copy (shallow: every field is immutable), with ``changes`` applied."""
        duplicate = object.__new__(type(self))
        duplicate.__dict__.update(self.__dict__)  # three times faster than copy.copy
        for key, value in changes.items():
            setattr(duplicate, key, value)
        return duplicate

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict. Built field by field: ``dataclasses.asdict`` deep-copies and was
        half the time of a decision at a thousand leases (bench/system_bench.py)."""
        data = {name: getattr(self, name) for name in _LEASE_FIELDS}
        data["state"] = self.state.value
        data["priority"] = self.priority.value
        data["transition"] = self.transition.value
        data["home_devices"] = list(self.home_devices)
        data["migrate_from"] = list(self.migrate_from)
        data["groups"] = list(self.groups)
        data["devices"] = list(self.devices)
        data["memory_history"] = [list(change) for change in self.memory_history]
        return data

    def to_json_text(self) -> str:
        """``json.dumps(self.to_json())`` without building the dict first (the enums are ``str``,
        tuples encode as lists): 2-3x faster, and what the store writes for every changed lease."""
        fields = self.__dict__
        if len(fields) != len(_LEASE_FIELDS):  # an attribute that is not a field: the long way
            return json.dumps(self.to_json())
        return _LEASE_ENCODER.encode(fields)

    def liveness_json_text(self) -> str:
        """The part of :meth:`to_json_text` that holds the :data:`LIVENESS_FIELDS`, exactly as it
        writes them (``"heartbeat_at": 12.5, "busy": false, ...``)."""
        j = _scalar_json
        return (
            f'"heartbeat_at": {j(self.heartbeat_at)}, "busy": {j(self.busy)}, "last_activity": {j(self.last_activity)}, '
            f'"connections": {j(self.connections)}, "active_seconds": {j(self.active_seconds)}'
        )


_LEASE_FIELDS = tuple(Lease.__dataclass_fields__)
#: ``json.dumps``'s text, without its check for cycles (a lease's fields hold none): ~20 % faster.
_LEASE_ENCODER = json.JSONEncoder(check_circular=False)

#: What a kernel's activity report or heartbeat changes, and nothing else does as often: fields
#: next to each other in a lease, so in its JSON text. A lease whose change is confined to them
#: is written by putting their new text between the unchanged text before and after them (see
#: :func:`split_json_text` and ``Store.save_leases``): most writes of a pool are such reports.
LIVENESS_FIELDS = ("heartbeat_at", "busy", "last_activity", "connections", "active_seconds")
_first = _LEASE_FIELDS.index(LIVENESS_FIELDS[0])
assert _LEASE_FIELDS[_first : _first + len(LIVENESS_FIELDS)] == LIVENESS_FIELDS, "liveness fields must be adjacent"
_LIVENESS_START = f', "{LIVENESS_FIELDS[0]}": '
_LIVENESS_END = f', "{_LEASE_FIELDS[_first + len(LIVENESS_FIELDS)]}": '


def _scalar_json(value: Any) -> str:
    """``json.dumps(value)`` for a liveness field's value (None, a bool, a number), without its overhead."""
    kind = type(value)
    if kind is float:
        return float.__repr__(value) if value - value == 0.0 else _LEASE_ENCODER.encode(value)  # not inf, nan
    if kind is int:
        return int.__repr__(value)
    return _SCALARS.get(value, "") if kind is bool or value is None else _LEASE_ENCODER.encode(value)


_SCALARS = {None: "null", True: "true", False: "false"}


def split_json_text(text: str) -> tuple[str, str] | None:
    """``(before, after)``: a lease's JSON text around its liveness fields, so that ``before +
    lease.liveness_json_text() + after`` is the text with new liveness values. None if the text
    does not hold them in that order. (A key's opening quote is never escaped, a quote inside a
    string value always is: the markers cannot match inside a value.)"""
    start = text.find(_LIVENESS_START)
    end = text.find(_LIVENESS_END, start)
    if start < 0 or end < 0:
        return None
    return text[: start + 2], text[end:]


@dataclass(frozen=True)
class Activity:
    """A kernel's activity as the server sees it."""

    busy: bool
    last_activity: float | None = None
    connections: int = 0
    #: While busy, the Jupyter message type of the request it is busy with (``execute_request``: a cell;
    #: ``comm_msg``: a widget's message; ``comm_open``: a front end connecting its widget manager);
    #: "" where it is not known.
    busy_with: str = ""


class DecisionKind(str, enum.Enum):
    GRANT = "grant"
    WARN_IDLE = "warn_idle"  # reclaim coming at lease.reclaim_at unless the user keeps it
    RECLAIM_IDLE = "reclaim_idle"  # adapters cull the kernel (a suspend is a SUSPEND decision)
    PREEMPT_WARN = "preempt_warn"  # eviction decided, grace period running
    PREEMPT = "preempt"  # grace over: adapters stop the kernel now
    RELEASE = "release"  # released by the engine (expired holder, duration over, GPU lost)
    OVER_LIMIT = "over_limit"  # watchdog saw usage above the slice's limit (or above it once its burst was taken back)
    GROW = "grow"  # an elastic slice grew on demand: adapters move the kernel's caps up
    SHRINK = "shrink"  # an elastic slice's burst was taken back: adapters free caches and move caps down
    SUSPEND = "suspend"  # adapters checkpoint the kernel's GPU memory to host RAM, then confirm
    MIGRATE = "migrate"  # adapters move the kernel's GPU memory to other GPUs, then confirm
    UNPOOLED = "unpooled"  # the watcher saw GPU memory held outside any granted lease (no lease id)


@dataclass(frozen=True)
class Decision:
    """Something the engine decided that an adapter may need to act on or tell the user."""

    kind: DecisionKind
    lease_id: str
    kernel_id: str | None
    owner: str
    reason: str
    at: float
    deadline: float | None = None

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        return data


@dataclass
class QueueInfo:
    """Where a queued lease stands."""

    position: int  # 1-based
    length: int
    estimated_wait: float | None  # seconds, None when unknown
    reason: str = ""  # why it waits: "pool full", "over your quota of 16 GiB", ...


@dataclass
class PoolSnapshot:
    """Everything a status view shows, already filtered for the viewer."""

    devices: list[dict[str, Any]]
    leases: list[dict[str, Any]]
    queue: list[dict[str, Any]]
    now: float
    quota: dict[str, Any] = field(default_factory=dict)
    #: The pool's reservations (``Reservation.to_json()`` plus ``active`` now): they shape the queue.
    reservations: list[dict[str, Any]] = field(default_factory=list)
    #: GPU memory held outside any granted lease, one item per (host, GPU, process): ``device``,
    #: ``bytes``, ``why``, ``since``; ``pid``, ``user``, ``command``, ``host``, ``lease_id`` only
    #: for admins and for the viewer's own processes (null otherwise); ``mine``.
    unpooled: list[dict[str, Any]] = field(default_factory=list)
