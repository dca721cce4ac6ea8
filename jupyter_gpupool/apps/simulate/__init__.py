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
                ``--oracle-keeps idle,asked`` has it keep the pool's promises as well (an idle
                kernel parked no sooner than the pool parks it, a guarantee held whole).

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

The package: :mod:`.plans` (settings, day shapes, request sizes, each session's plan),
:mod:`.modes` (one mode on one inventory: :class:`LabRun` on the pool, or the oracle),
:mod:`.search` (the fewest GPUs within a p95 target, runs in parallel), :mod:`.tables` (what is
printed) and :mod:`.app` (the command line).
"""

from __future__ import annotations

from jupyter_gpupool.apps.simstats import jain_index, percentile
from jupyter_gpupool.apps.simulate.app import SimulateApp, main
from jupyter_gpupool.apps.simulate.modes import LabRun, ModeResult, inventory_model, run_mode, simulate, uniform_backend
from jupyter_gpupool.apps.simulate.plans import (
    ALL_MODES,
    CHECKPOINT_BYTES_PER_SECOND,
    MODE_LABELS,
    MODES,
    PARKED_MEMORY_LIMIT,
    SHAPES,
    SUSPEND_IDLE_TIMEOUT,
    SUSPENDING,
    DayShape,
    RequestSizes,
    SessionPlan,
    Settings,
    day_of_shape,
    make_plans,
    parse_requests,
    parse_shape,
)
from jupyter_gpupool.apps.simulate.search import SearchResult, fewest_gpus, run_parallel
from jupyter_gpupool.apps.simulate.tables import copy_rates, requests_note, results_table, search_table

__all__ = [
    "ALL_MODES",
    "CHECKPOINT_BYTES_PER_SECOND",
    "MODES",
    "MODE_LABELS",
    "PARKED_MEMORY_LIMIT",
    "SHAPES",
    "SUSPENDING",
    "SUSPEND_IDLE_TIMEOUT",
    "DayShape",
    "LabRun",
    "ModeResult",
    "RequestSizes",
    "SearchResult",
    "SessionPlan",
    "Settings",
    "SimulateApp",
    "copy_rates",
    "day_of_shape",
    "fewest_gpus",
    "inventory_model",
    "jain_index",
    "main",
    "make_plans",
    "parse_requests",
    "parse_shape",
    "percentile",
    "requests_note",
    "results_table",
    "run_mode",
    "run_parallel",
    "search_table",
    "simulate",
    "uniform_backend",
]
