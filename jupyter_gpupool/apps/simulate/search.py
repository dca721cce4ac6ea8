"""The fewest GPUs that keep the p95 wait within a target, searched per mode, the runs in parallel."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from traitlets.config import Config

from jupyter_gpupool.apps.simulate.modes import (
    ModeResult,
    inventory_model,
    run_mode,
    uniform_backend,
)
from jupyter_gpupool.apps.simulate.plans import SessionPlan, Settings, make_plans
from jupyter_gpupool.apps.workload import (
    Workload,
    load_workload,
)
from jupyter_gpupool.devices.simulated import SimulatedBackend


@dataclass
class SearchResult:
    """The fewest GPUs of a model that keep p95 wait within the target, for one mode."""

    mode: str
    model: str
    target: float
    gpus: int | None  # None: not reached within max_gpus
    tried: dict[int, float] = field(default_factory=dict)  # GPU count → p95 wait
    result: ModeResult | None = None
    over: str = "requests"  # the waits the p95 is over (:data:`WAIT_POPULATIONS`)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "model": self.model,
            "target_p95_wait": self.target,
            "p95_over": self.over,
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
    over: str = "requests",
) -> SearchResult:
    """Try 1, 2, ... GPUs of the inventory's model (same sessions each time) until p95 wait ≤ target.

    Counting up (not bisecting) makes the answer monotone in the target by construction: a looser
    target never needs more GPUs, even where p95 wait is not monotone in the GPU count. ``over``:
    the waits the p95 is taken over (:data:`WAIT_POPULATIONS`).
    """
    name, memory, _ = inventory_model(settings.gpus)
    plans = plans if plans is not None else make_plans(settings, workload or load_workload())
    search = SearchResult(mode, name, target, None, over=over)
    for count in range(1, max_gpus + 1):
        result = run_mode(settings, plans, mode, uniform_backend(name, memory, count), config)
        search.tried[count] = result.p95_wait(over)
        if search.tried[count] <= target:
            search.gpus, search.result = count, result
            break
    return search


def _run_one(settings: Settings, plans: list[SessionPlan], mode: str, gpus: str | tuple[str, int, int], config: Config | None) -> ModeResult:
    """One mode on an inventory (a spec, or ``(model, memory, count)`` of the search): a worker's task."""
    backend = SimulatedBackend.from_spec(gpus) if isinstance(gpus, str) else uniform_backend(*gpus)
    return run_mode(settings, plans, mode, backend, config)


def cpu_seconds() -> float:
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
    over: str = "requests",
) -> tuple[dict[str, ModeResult], dict[str, SearchResult]]:
    """Every mode, and (with ``target``) each mode's GPU-count search, in ``jobs`` processes.

    The same tables as running them one by one: every run is independent and deterministic, and a
    mode's search keeps the first count, from 1 up, that meets the target. To keep every process
    busy, counts past those still running are tried ahead (round-robin over the modes still
    searching); a result past a mode's answer is dropped, as the sequential search never ran it.
    """
    import concurrent.futures

    name, memory = (inventory_model(settings.gpus)[:2]) if target is not None else ("", 0)
    searches = {mode: SearchResult(mode, name, target, None, over=over) for mode in modes} if target is not None else {}
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
            search.tried[count] = result.p95_wait(over)
            if search.tried[count] <= search.target:
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
