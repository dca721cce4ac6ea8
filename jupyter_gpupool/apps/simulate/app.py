"""``jupyter gpupool simulate``: the command line (options, the search, the tables)."""

from __future__ import annotations

import math
import sys
import time

from traitlets import CaselessStrEnum, Float, Integer, Unicode

from jupyter_gpupool.application import GpuPoolBaseApp
from jupyter_gpupool.apps.oracle import parse_oracle_keeps
from jupyter_gpupool.apps.simulate.modes import WAIT_POPULATIONS, ModeResult, inventory_model, run_mode
from jupyter_gpupool.apps.simulate.plans import (
    ALL_MODES,
    CHECKPOINT_BYTES_PER_SECOND,
    MODE_ALIASES,
    MODE_LABELS,
    MODES,
    SHAPE_FORMS,
    SUSPEND_IDLE_TIMEOUT,
    Settings,
    day_of_shape,
    make_plans,
    parse_requests,
    parse_shape,
)
from jupyter_gpupool.apps.simulate.search import (
    SearchResult,
    cpu_seconds,
    fewest_gpus,
    run_parallel,
)
from jupyter_gpupool.apps.simulate.tables import (
    copy_rates,
    requests_note,
    results_table,
    search_table,
)
from jupyter_gpupool.apps.workload import (
    load_workload,
    parse_memory_need,
    parse_session_length,
)
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend, parse_inventory
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import (
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)
from jupyter_gpupool.wording import count as counted


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
        "p95-over": "SimulateApp.p95_over",
        "oracle-keeps": "SimulateApp.oracle_keeps",
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
        help="Idle time after which pooled+suspend and elastic may park a slice in host RAM while others wait (nothing is lost, "
        "so it can be short); the pool's own default suspend idle timeout unless given.",
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
    p95_over = CaselessStrEnum(
        list(WAIT_POPULATIONS),
        "requests",
        help="What --target-p95-wait's p95 is over: 'requests' (every request for the GPU: first cells, cells after a "
        "reclaim or suspend, cells waiting for a slice to grow) or 'cells' (every cell run, 0 for one that ran at once "
        "on its kernel's slice: the population of the oracle, where every cell is a request).",
    ).tag(config=True)
    oracle_keeps = Unicode(
        "",
        help="Promises of the pool the oracle keeps too, to split the gap to the physical limit: 'idle' (an idle kernel "
        "keeps its memory for --suspend-idle-timeout, or PoolPolicy.burst_settle if it uses more than it asked for), "
        "'asked' (a session holds at least what it asked for while it holds anything), both as idle,asked, or '' (none: "
        "the physical limit). The oracle stays a lower bound on every scheduler that keeps them.",
    ).tag(config=True)
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
            oracle_keeps=parse_oracle_keeps(self.oracle_keeps),
        )
        target = parse_duration(self.target_p95_wait) if self.target_p95_wait else None
        if target is not None:
            inventory_model(self.gpus)
        return settings, modes, target

    def run(self) -> None:
        started, cpu_started = time.perf_counter(), cpu_seconds()
        settings, modes, target = self.settings()
        workload = load_workload(self.traces or None)
        parse_session_length(settings.session_length, workload)  # fail before any run
        plans = make_plans(settings, workload)
        results: dict[str, ModeResult] = {}
        searches: dict[str, SearchResult] = {}
        if self.jobs > 1:
            results, searches = run_parallel(settings, plans, modes, target, self.max_gpus, self.jobs, self.config, self.p95_over)
        else:
            for mode in modes:
                results[mode] = run_mode(settings, plans, mode, SimulatedBackend.from_spec(settings.gpus), self.config)
        if target is not None and self.jobs <= 1:
            for mode in modes:
                if not self.json:
                    print(f"searching GPU counts for {MODE_LABELS[mode]} ...", file=sys.stderr)
                searches[mode] = fewest_gpus(settings, mode, target, self.max_gpus, workload, self.config, plans, self.p95_over)
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
            "cpu_s": round(cpu_seconds() - cpu_started, 2),  # --jobs workers included
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
            requests_note(settings.requests, default_slice, results, settings.oracle_keeps),
        ]
        if searches:
            over = "every cell run" if self.p95_over == "cells" else "every request for the GPU"
            lines += ["", f"Fewest {next(iter(searches.values())).model} GPUs keeping p95 wait ({over}) within {format_duration(target)}:", search_table(searches)]
        lines.append(f"\n({elapsed:.1f} s, {data['cpu_s']:.1f} s of CPU)")
        self.emit(data, "\n".join(lines))


main = SimulateApp.launch_instance
