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

``--oracle-keeps`` gives the oracle promises the pool keeps (:data:`ORACLE_PROMISES`), one at a time
or together, so the gap between the pool and the physical limit can be split by what it is made
of. Each keeps the oracle a lower bound on every scheduler that keeps the same promise:

- ``idle``: an idle kernel is parked no sooner than the pool parks it: a session keeps what it
  holds through the first ``--suspend-idle-timeout`` of each idle spell (a cell in that time runs
  at once), or ``PoolPolicy.burst_settle`` for a session using more than it asked for (its burst is
  taken back that soon).
- ``asked``: a guarantee is held whole: a session holds at least what it asked for while it holds
  anything, so a cell starts only when its whole guarantee could be packed.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from jupyter_gpupool.apps.simstats import jain_index, percentile
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import InvalidInput

if TYPE_CHECKING:  # the simulator runs the oracle: its types only, so no import cycle
    from jupyter_gpupool.apps.simulate import ModeResult, SessionPlan, Settings

_ARRIVE, _PHASE_END, _GIVEUP, _TICK, _PARK = 0, 1, 2, 3, 4

#: Promises of the pool the oracle may keep too (``--oracle-keeps``): none by default, the physical limit.
ORACLE_PROMISES = {
    "idle": "an idle kernel keeps its memory for the suspend idle timeout (for burst_settle if it uses more than it asked for)",
    "asked": "a session holds at least what it asked for while it holds anything",
}


def parse_oracle_keeps(text: str) -> tuple[str, ...]:
    """``idle,asked`` → the promises, in :data:`ORACLE_PROMISES`' order; '' or ``none``: none."""
    value = (text or "").strip().lower()
    if value in ("", "none"):
        return ()
    given = [part.strip() for part in value.split(",")]
    unknown = [part for part in given if part not in ORACLE_PROMISES]
    if unknown:
        forms = "; ".join(f"{name}: {what}" for name, what in ORACLE_PROMISES.items())
        raise InvalidInput(f"invalid --oracle-keeps {text[:60]!r}: {unknown[0][:20]!r} is no promise; give none, or some of {forms}")
    return tuple(name for name in ORACLE_PROMISES if name in given)


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

    def __init__(self, settings: Settings, plans: list[SessionPlan], backend: SimulatedBackend, policy: PoolPolicy | None = None) -> None:
        devices = backend.devices()
        totals = {d.memory_total for d in devices}
        if len(totals) != 1:
            raise InvalidInput(f"mode oracle packs GPUs of one size, got {backend.describe()!r}; give e.g. --gpus 4xA100-80GB")
        self.settings, self.plans, self.backend = settings, plans, backend
        self.gpu_size = totals.pop()
        self.gpu_count = len(devices)
        # Each session's use is what the other modes' kernels use (their need on the largest leasable GPU).
        largest = max(d.leasable for d in devices)
        needs = [min(self.gpu_size, plan.need_bytes(largest)) for plan in plans]
        policy = policy or PoolPolicy()
        default_slice = policy.default_memory_bytes(largest)
        asked = [settings.requests.size(plan.asks, need, default_slice, largest) for plan, need in zip(plans, needs, strict=True)]
        keeps = settings.oracle_keeps
        #: what a session holds while it holds anything: its use, or its guarantee if larger (``asked``)
        self.needs = needs
        self.uses = [max(need, ask) if "asked" in keeps else need for need, ask in zip(needs, asked, strict=True)]
        #: how long into an idle spell a session keeps what it holds (``idle``; 0: it lets go at once)
        self.keep_idle = [
            (settings.suspend_idle_timeout if need <= ask else policy.burst_settle) if "idle" in keeps else 0.0
            for need, ask in zip(needs, asked, strict=True)
        ]
        self.holding = [False] * len(plans)  # whether the session's memory is in ``total``
        self.held_since = [0.0] * len(plans)
        self.park_gen = [0] * len(plans)  # a park event is stale once a cell took the memory on
        self.requested: list[float] = []  # waits of the cells that asked for memory (not held through an idle spell)
        self.total = 0  # bytes the running cells hold
        self.big = 0  # running cells that use over half a GPU
        self.phase = [0] * len(plans)
        self.state = ["pending"] * len(plans)  # pending | busy | idle | waiting | done | abandoned
        self.asked_at = [0.0] * len(plans)  # when a waiting cell wanted to run
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
        self.used = 0  # what the sessions holding memory need (below ``total`` where ``asked`` holds more)
        self.used_sum = 0.0
        self.busy = 0  # what the computing cells need (below ``used`` where ``idle`` keeps idle sessions' memory)
        self.busy_sum = 0.0
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
                    self.used_sum += self.used
                    self.busy_sum += self.busy
                    self.ticks += 1
                self._push(t + self.settings.tick, _TICK, -1)
            elif kind == _ARRIVE:
                self._enter_phase(index, t)
            elif kind == _PHASE_END and gen == self.gen[index]:
                self._phase_end(index, t)
            elif kind == _GIVEUP and gen == self.gen[index] and self.state[index] == "waiting":
                self._give_up(index, t)
            elif kind == _PARK and gen == self.park_gen[index] and self.holding[index] and self.state[index] == "idle":
                self._free(index, t)
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
        if self.holding[index]:  # still held from its last cell (``idle``): it runs at once
            self.park_gen[index] += 1
            self._start(index, t)
            return
        if self.fits(self.uses[index]):
            self._start(index, t)
            return
        self.waiting.append(index)
        if self.settings.patience is not None:
            self._push(t + self.settings.patience, _GIVEUP, index, self.gen[index])

    def _start(self, index: int, t: float) -> None:
        """A waiting cell gets its memory (or keeps what its session holds) and computes for its whole phase."""
        if self.holding[index]:
            self._count_wait(index, 0.0, requested=False)
        else:
            use = self.uses[index]
            self.total += use
            self.big += 2 * use > self.gpu_size
            self.used += self.needs[index]
            self.holding[index], self.held_since[index] = True, t
            self._count_wait(index, t - self.asked_at[index])
        self.busy += self.needs[index]
        self.state[index] = "busy"
        self.gen[index] += 1
        self._push(t + self.plans[index].phases[self.phase[index]][1], _PHASE_END, index, self.gen[index])

    def _free(self, index: int, t: float) -> None:
        """A session lets its memory go (its cell ended, or its idle keep ran out): waiting cells that now fit start."""
        use = self.uses[index]
        self.total -= use
        self.big -= 2 * use > self.gpu_size
        self.used -= self.needs[index]
        self.holding[index] = False
        user = self.plans[index].user
        self.user_held[user] = self.user_held.get(user, 0.0) + (t - self.held_since[index])
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
            self.busy -= self.needs[index]
            last = self.phase[index] + 1 >= len(self.plans[index].phases)
            if self.keep_idle[index] > 0 and not last:
                self.park_gen[index] += 1
                self._push(t + self.keep_idle[index], _PARK, index, self.park_gen[index])
            else:
                self._free(index, t)
        self.phase[index] += 1
        if self.phase[index] >= len(self.plans[index].phases):
            if self.holding[index]:
                self._free(index, t)
            self.state[index] = "done"
            self.served += 1
            return
        self._enter_phase(index, t)

    def _give_up(self, index: int, t: float) -> None:
        self._count_wait(index, t - self.asked_at[index])
        self.waiting.remove(index)
        self.state[index] = "abandoned"
        self.abandoned += 1

    def _count_wait(self, index: int, wait: float, requested: bool = True) -> None:
        """A cell's wait; ``requested``: it asked for memory (it was not held from its session's last cell)."""
        phase = self.phase[index]
        self.waits.append(wait)
        if requested:
            self.requested.append(wait)
        self.idle_before.append(self.plans[index].phases[phase - 1][1] if phase else math.inf)
        user = self.plans[index].user
        self.user_wait[user] = self.user_wait.get(user, 0.0) + wait

    def _result(self, result_type: type[ModeResult], horizon: float, elapsed: float) -> ModeResult:
        still = 0
        for index, state in enumerate(self.state):
            if state == "waiting":
                still += 1
                self._count_wait(index, horizon - self.asked_at[index])
            if self.holding[index]:
                user = self.plans[index].user
                self.user_held[user] = self.user_held.get(user, 0.0) + (horizon - self.held_since[index])
        shares = []
        for user in sorted(set(self.user_wait) | set(self.user_held)):
            held, waited = self.user_held.get(user, 0.0), self.user_wait.get(user, 0.0)
            shares.append(held / (held + waited) if held + waited > 0 else 1.0)
        capacity = self.gpu_count * self.gpu_size
        ticks = capacity * max(1, self.ticks)
        held_pct, used_pct, busy_pct = (100 * total / ticks for total in (self.held_sum, self.used_sum, self.busy_sum))
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
            requests=len(self.requested),
            leased_pct=held_pct,  # without promises, a cell holds exactly its use, and only while it computes: all three equal
            used_pct=used_pct,
            busy_pct=busy_pct,
            wait_p50=percentile(self.requested, 50),
            wait_p95=percentile(self.requested, 95),
            wait_max=max(self.requested, default=0.0),
            wait_mean=statistics.fmean(self.requested) if self.requested else 0.0,
            reclaims=0,
            idle_warnings=0,
            preemptions=0,
            expired=0,
            jain=jain_index(shares),
            days=self.settings.days,
            pool_calls=0,
            elapsed=elapsed,
            cells=len(self.waits),  # without ``idle`` every cell asks for its memory: each is a request
            cell_wait_p95=percentile(self.waits, 95),
        )
