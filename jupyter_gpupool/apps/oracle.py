"""The ``oracle`` mode of ``jupyter gpupool simulate``: the physical limit for the same sessions.

No scheduler can do better than one that knows when every cell runs and pays nothing to act on it:
each session holds exactly what it uses while a cell computes and nothing while it is idle (parked
and moved for free, at once), and a cell starts as soon as the cells running with it could be
packed onto the GPUs. The oracle plays that scheduler on the sessions every mode sees.

Packing is per GPU, not a fluid sum, and is judged by a lower bound on the number of GPUs a set of
uses needs (:func:`gpus_needed`): the larger of ⌈Σ use ÷ GPU size⌉ (the GPUs together hold at most
N × GPU size) and the number of uses over half a GPU (two of them never share a GPU). A set any
scheduler can run at once passes the test, so the oracle may start a cell no real packing could,
never the reverse. A heuristic packing such as first-fit decreasing would overstate the GPUs a set
needs and make the oracle pessimistic; the bound only errs the other way.

Every cell that starts after an idle spell asks for its memory again (it held none while idle), so
each busy phase is a request: its wait is from when the cell wanted to run until it starts. Waiting
cells start first come, first served, and a later one that fits starts ahead of an earlier one that
does not (backfill). A user whose cell waits longer than ``--patience`` gives up, as in every mode.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from jupyter_gpupool.apps.simstats import jain_index, percentile
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput

if TYPE_CHECKING:  # the simulator runs the oracle: its types only, so no import cycle
    from jupyter_gpupool.apps.simulate import ModeResult, SessionPlan, Settings

_ARRIVE, _PHASE_END, _GIVEUP, _TICK = 0, 1, 2, 3


def gpus_needed(uses: Iterable[int], gpu_size: int) -> int:
    """A lower bound on the GPUs of ``gpu_size`` bytes that can hold ``uses`` at once, each on one GPU.

    The larger of ⌈Σ use ÷ gpu_size⌉ and the number of uses over half a GPU. Both hold for any
    packing: the GPUs together hold N × gpu_size, and two uses over half a GPU never fit on one.
    """
    total = big = 0
    for use in uses:
        if use > gpu_size:
            raise InvalidInput(f"a use of {use} bytes does not fit on one GPU of {gpu_size} bytes")
        total += use
        big += 2 * use > gpu_size
    return max(-(-total // gpu_size), big)


def no_wait_gpus(plans: Iterable[SessionPlan], gpu_size: int, largest: int, horizon: float = math.inf) -> int:
    """GPUs no scheduler can go below without ever delaying a cell: the most :func:`gpus_needed`
    over every instant before ``horizon``, with each cell computing when its session planned it (use:
    its need on a GPU of ``largest`` bytes). Cells ending at an instant give their memory back first."""
    changes: list[tuple[float, int, int]] = []  # (time, +1 start / -1 end, use); ends sort first
    for plan in plans:
        use, t = plan.need_bytes(largest), plan.arrival
        for busy, length in plan.phases:
            if busy:
                changes += [(t, 1, use), (t + length, -1, use)]
            t += length
    changes.sort()
    total = big = peak = 0
    for t, sign, use in changes:
        if t >= horizon:
            break
        total += sign * use
        big += sign * (2 * use > gpu_size)
        peak = max(peak, -(-total // gpu_size), big)
    return peak


class OracleRun:
    """The oracle on one inventory of one GPU model: the same sessions, the fewest constraints."""

    def __init__(self, settings: Settings, plans: list[SessionPlan], backend: SimulatedBackend) -> None:
        devices = backend.devices()
        totals = {d.memory_total for d in devices}
        if len(totals) != 1:
            raise InvalidInput(f"mode oracle packs GPUs of one size, got {backend.describe()!r}; give e.g. --gpus 4xA100-80GB")
        self.settings, self.plans, self.backend = settings, plans, backend
        self.gpu_size = totals.pop()
        self.gpu_count = len(devices)
        # Each session's use is what the other modes' kernels use (their need on the largest leasable GPU).
        largest = max(d.leasable for d in devices)
        self.uses = [min(self.gpu_size, plan.need_bytes(largest)) for plan in plans]
        self.total = 0  # bytes the running cells hold
        self.big = 0  # running cells that use over half a GPU
        self.phase = [0] * len(plans)
        self.state = ["pending"] * len(plans)  # pending | busy | idle | waiting | done | abandoned
        self.asked_at = [0.0] * len(plans)  # when a waiting cell wanted to run
        self.started = [0.0] * len(plans)  # when the running cell started
        self.gen = [0] * len(plans)
        self.waiting: list[int] = []  # sessions whose cell waits, in the order they asked
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.waits: list[float] = []
        #: per wait, the idle spell its session had just ended (infinite for its first cell)
        self.idle_before: list[float] = []
        self.user_wait: dict[str, float] = {}
        self.user_held: dict[str, float] = {}
        self.served = self.abandoned = 0
        self.held_sum = 0.0  # Σ bytes held over the ticks of the open hours
        self.ticks = 0

    def fits(self, use: int) -> bool:
        """Whether the running cells and one more using ``use`` pass the packing bound."""
        return self.total + use <= self.gpu_count * self.gpu_size and self.big + (2 * use > self.gpu_size) <= self.gpu_count

    def _push(self, t: float, kind: int, index: int, gen: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, index, gen))

    def run(self, result_type: type[ModeResult]) -> ModeResult:
        """Run every session; the figures as ``result_type`` (the simulator's ``ModeResult``)."""
        started = time.perf_counter()
        horizon = self.settings.days * 86400
        for plan in self.plans:
            self._push(plan.arrival, _ARRIVE, plan.index)
        self._push(0.0, _TICK, -1)
        while self.heap:
            t, kind, _, index, gen = heapq.heappop(self.heap)
            if t > horizon:
                break
            if kind == _TICK:
                if self.settings.shape.weight(t) > 0:
                    self.held_sum += self.total
                    self.ticks += 1
                self._push(t + self.settings.tick, _TICK, -1)
            elif kind == _ARRIVE:
                self._enter_phase(index, t)
            elif kind == _PHASE_END and gen == self.gen[index]:
                self._phase_end(index, t)
            elif kind == _GIVEUP and gen == self.gen[index] and self.state[index] == "waiting":
                self._give_up(index, t)
        return self._result(result_type, horizon, time.perf_counter() - started)

    def _enter_phase(self, index: int, t: float) -> None:
        """The session's current phase begins: an idle spell runs its course, a cell asks for memory."""
        busy, length = self.plans[index].phases[self.phase[index]]
        if not busy:
            self.state[index] = "idle"
            self.gen[index] += 1
            self._push(t + length, _PHASE_END, index, self.gen[index])
            return
        self.state[index], self.asked_at[index] = "waiting", t
        self.gen[index] += 1
        if self.fits(self.uses[index]):
            self._start(index, t)
            return
        self.waiting.append(index)
        if self.settings.patience is not None:
            self._push(t + self.settings.patience, _GIVEUP, index, self.gen[index])

    def _start(self, index: int, t: float) -> None:
        """A waiting cell gets its memory and computes for its whole phase."""
        use = self.uses[index]
        self.total += use
        self.big += 2 * use > self.gpu_size
        self._count_wait(index, t - self.asked_at[index])
        self.state[index], self.started[index] = "busy", t
        self.gen[index] += 1
        self._push(t + self.plans[index].phases[self.phase[index]][1], _PHASE_END, index, self.gen[index])

    def _free(self, index: int, t: float) -> None:
        """A running cell ends: its memory goes back at once, and waiting cells that now fit start."""
        use = self.uses[index]
        self.total -= use
        self.big -= 2 * use > self.gpu_size
        user = self.plans[index].user
        self.user_held[user] = self.user_held.get(user, 0.0) + (t - self.started[index])
        still: list[int] = []
        for other in self.waiting:
            if self.fits(self.uses[other]):
                self._start(other, t)
            else:
                still.append(other)
        self.waiting = still

    def _phase_end(self, index: int, t: float) -> None:
        if self.state[index] == "busy":
            self.state[index] = "idle"
            self._free(index, t)
        self.phase[index] += 1
        if self.phase[index] >= len(self.plans[index].phases):
            self.state[index] = "done"
            self.served += 1
            return
        self._enter_phase(index, t)

    def _give_up(self, index: int, t: float) -> None:
        self._count_wait(index, t - self.asked_at[index])
        self.waiting.remove(index)
        self.state[index] = "abandoned"
        self.abandoned += 1

    def _count_wait(self, index: int, wait: float) -> None:
        phase = self.phase[index]
        self.waits.append(wait)
        self.idle_before.append(self.plans[index].phases[phase - 1][1] if phase else math.inf)
        user = self.plans[index].user
        self.user_wait[user] = self.user_wait.get(user, 0.0) + wait

    def _result(self, result_type: type[ModeResult], horizon: float, elapsed: float) -> ModeResult:
        still = 0
        for index, state in enumerate(self.state):
            if state == "waiting":
                still += 1
                self._count_wait(index, horizon - self.asked_at[index])
            elif state == "busy":
                user = self.plans[index].user
                self.user_held[user] = self.user_held.get(user, 0.0) + (horizon - self.started[index])
        shares = []
        for user in sorted(set(self.user_wait) | set(self.user_held)):
            held, waited = self.user_held.get(user, 0.0), self.user_wait.get(user, 0.0)
            shares.append(held / (held + waited) if held + waited > 0 else 1.0)
        capacity = self.gpu_count * self.gpu_size
        held_pct = 100 * self.held_sum / (capacity * max(1, self.ticks))
        return result_type(
            mode="oracle",
            inventory=self.backend.describe().removeprefix("simulated "),
            gpus=self.gpu_count,
            capacity=capacity,
            sessions=len(self.plans),
            served=self.served,
            abandoned=self.abandoned,
            refused=0,
            still_waiting=still,
            requests=len(self.waits),
            leased_pct=held_pct,  # a cell holds exactly its use, and only while it computes
            used_pct=held_pct,
            busy_pct=held_pct,
            wait_p50=percentile(self.waits, 50),
            wait_p95=percentile(self.waits, 95),
            wait_max=max(self.waits, default=0.0),
            wait_mean=statistics.fmean(self.waits) if self.waits else 0.0,
            reclaims=0,
            idle_warnings=0,
            preemptions=0,
            expired=0,
            jain=jain_index(shares),
            days=self.settings.days,
            pool_calls=0,
            elapsed=elapsed,
            cells=len(self.waits),  # every cell asks for its memory: each is a request
            cell_wait_p95=percentile(self.waits, 95),
        )
