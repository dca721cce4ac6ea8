"""The reliability suite: faults injected into real processes on a real SQLite pool file, with the
invariants the pool promises checked after each scenario.

Every scenario returns a dict of figures. ``tests/test_reliability.py`` runs each one at a CI size
and asserts its invariants; run the long version and print the figures (what RELIABILITY.md
records) with::

    python tests/reliability.py --minutes 10 --json
    python tests/reliability.py --only suspend_soak --minutes 10 --json   # the 10-minute suspend soak

Scenarios:

- ``kill_storm``: several OS processes request, release and tick on one pool file while a killer
  SIGKILLs them at random moments (mid-transaction included) and starts replacements. Afterwards:
  ``PRAGMA integrity_check`` is ok, no device holds more than it has, no lease id or kernel id is
  live twice, every request a worker saw committed is in the store (nothing lost), every granted
  and released lease is in the ledger exactly once, and the leases of killed holders are reclaimed
  by the next tick.
- ``burst``: N requests from several processes at once against room for R: exactly R granted,
  the rest queued; then every release grants exactly the lease the engine had at the head of its
  queue (policy order); request latency percentiles and the processes' peak memory.
- ``device_faults``: the NVML backend over the scripted fake ``pynvml``: a GPU lost mid-run (its
  leases are flagged for their users, new requests go elsewhere, the rest keeps serving), a MIG
  instance destroyed under a lease, NVML missing at start (a clear PoolUnavailable).
- ``soak``: a bounded stream of random operations in one pool with the invariants checked all
  along, and the process's RSS and open file descriptors sampled from start to end.

The suspend protocol and memory used outside the pool (each kernel a real process whose GPU
memory is scripted, so the pool's books can be set against what the GPU holds):

- ``unpooled_nvml``: on the NVML backend over the fake ``pynvml``: a process without a lease, a
  kernel outside its lease's GPUs and a suspended kernel still holding memory are seen and never
  granted; a 'suspend done' while NVML lists the kernel's memory is taken at once and that memory
  stays taken until it is freed; a 1 PiB ``parked_bytes`` is refused.
- ``broker_suspend_attacks``: a real broker process: forged and replayed transition reports over
  HTTP, a process outside the pool, and the broker SIGKILLed mid-resume, mid-suspend and mid-move.
- ``server_kill_mid_step``: a real `jupyter server` SIGKILLed at a random moment of a suspend and
  of a resume: the lease is released with a reason, nothing stays parked or held.
- ``suspend_soak``: random kernels with suspends, resumes, moves, restarts, server restarts,
  failed steps, forged and replayed reports and processes outside the pool; after every step:
  nothing granted out of memory held outside the pool, one live lease per kernel, parked bytes
  within what was held and the parked total consistent (see :func:`check_suspend_invariants`).
  ``GPUPOOL_RELIABILITY_DEBUG=1`` prints each broken promise with the pool's last events.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import itertools
import json
import logging
import os
import random
import resource
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.engine import held_by_device
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState, PriorityClass, Transition
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, RequestRefused
from jupyter_gpupool.units import GIB

if TYPE_CHECKING:
    from broker_harness import BrokerProcess

    from jupyter_gpupool.backends.remote import RemotePool


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    return env


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --- invariants ---------------------------------------------------------------------------------


def check_pool_file(db: str, spec: str, intervals: bool = False, ledger: bool = True) -> dict[str, Any]:
    """The invariants of one pool file; raises AssertionError naming the first that fails.
    ``intervals``: leases may have been granted more than once (suspended and resumed, restarted),
    so the ledger holds one row per granted interval instead of one per released lease;
    ``ledger``: False leaves metering out (a scenario about something else)."""
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok", "the pool file is corrupt"
    finally:
        raw.close()
    pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))
    try:
        leases = pool.store.leases(include_released=True, limit=10**9)
        ids = [lease.id for lease in leases]
        assert len(ids) == len(set(ids)), "a lease id is stored twice"
        live = [lease for lease in leases if lease.state is not LeaseState.RELEASED]
        kernels = [lease.kernel_id for lease in live if lease.kernel_id]
        assert len(kernels) == len(set(kernels)), "a kernel holds two live leases"
        held = held_by_device(leases)
        for device in pool.devices():
            assert held.get(device.uuid, 0) <= device.memory_total, f"{device.uuid} is granted more than it has"
        for lease in leases:
            if lease.state is LeaseState.GRANTED:
                assert len(lease.devices) == lease.num_gpus, f"lease {lease.id} holds {lease.devices}"
        rows = pool.store.ledger() if ledger else []
        metered_ids = [row["lease_id"] for row in rows]
        metered = {lease.id for lease in leases if lease.state is LeaseState.RELEASED and lease.granted_at is not None}
        if ledger and not intervals:
            assert len(metered_ids) == len(set(metered_ids)), "a lease is metered twice"
            assert metered == set(metered_ids), "the ledger and the released leases disagree"
        elif ledger:  # a suspend or a restart closes a granted interval: one row per interval, never overlapping
            spans: dict[str, list[tuple[float, float]]] = {}
            for row in rows:
                spans.setdefault(row["lease_id"], []).append((row["start"], row["end"]))
            for lease_id, periods in spans.items():
                periods.sort()
                assert all(a[1] <= b[0] for a, b in itertools.pairwise(periods)), f"lease {lease_id} is metered twice for one time: {periods}"
            assert metered <= set(spans), "a released lease's last granted interval is not metered"
        return {"leases": len(leases), "live": len(live), "metered": len(metered_ids)}
    finally:
        pool.close()


# --- kill storm ---------------------------------------------------------------------------------

STORM_WORKER = textwrap.dedent(
    """
    import os, random, sys, uuid
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.errors import PoolUnavailable, RequestRefused
    from jupyter_gpupool.backends.local.pool import HOSTNAME, Pool
    from jupyter_gpupool.units import GIB

    db, spec, journal_path, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    for attempt in range(5):  # the pool's own advice when others hold its lock for long: try again
        try:
            pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))
            break
        except PoolUnavailable as err:
            if "try again" not in str(err) or attempt == 4:
                raise
    rng = random.Random(seed)
    journal = open(journal_path, "a", buffering=1)
    mine = []
    print("ready", flush=True)

    def attempt(call):
        # A lock held past the busy timeout while processes die all around: the call changed
        # nothing (its transaction never began, or was rolled back), and the pool says try again.
        while True:
            try:
                return call()
            except PoolUnavailable as err:
                if "try again" not in str(err):
                    raise

    while True:
        if mine and rng.random() < 0.45:
            lease_id = mine.pop(rng.randrange(len(mine)))
            attempt(lambda: pool.release(lease_id, reason="worker released it"))
            journal.write("released " + lease_id + "\\n")
        else:
            kernel_id = str(uuid.uuid4())
            request = LeaseRequest(owner="user%d" % rng.randrange(6), memory=rng.choice([1, 2, 4, 6]) * GIB,
                                   kernel_id=kernel_id, holder_pid=os.getpid(), holder_host=HOSTNAME)
            try:
                lease = attempt(lambda: pool.request(request))
            except RequestRefused:  # past PoolPolicy.max_queued_per_user: nothing was committed
                lease = None
            if lease is not None:
                journal.write("requested " + lease.id + " " + kernel_id + "\\n")
                mine.append(lease.id)
        attempt(pool.tick)
    """
)


def kill_storm(workdir: Path, seconds: float = 20.0, workers: int = 3, spec: str = "2x16GiB", seed: int = 1) -> dict[str, Any]:
    """SIGKILL pool clients at random moments for ``seconds``; check that nothing is lost or doubled."""
    db = str(workdir / "storm.sqlite")
    Pool(SimulatedBackend.from_spec(spec), db).close()
    rng = random.Random(seed)
    journals: list[Path] = []
    procs: list[subprocess.Popen[str]] = []

    def spawn() -> None:
        """Start a worker and wait until it has opened the pool (so a kill lands mid-work, not mid-import)."""
        journal = workdir / f"journal-{len(journals)}.txt"
        journals.append(journal)
        proc = subprocess.Popen(
            [sys.executable, "-c", STORM_WORKER, db, spec, str(journal), str(rng.randrange(10**9))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""

    for _ in range(workers):
        spawn()
    kills = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.05, 0.6))
        alive = [p for p in procs if p.poll() is None]
        for proc in procs:
            if proc.poll() not in (None, -signal.SIGKILL):
                raise AssertionError(f"a worker failed on its own: {proc.stderr.read() if proc.stderr else ''}")
        if alive:
            rng.choice(alive).send_signal(signal.SIGKILL)
            kills += 1
        while sum(p.poll() is None for p in procs) < workers:
            spawn()
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    committed: dict[str, str] = {}
    for journal in journals:
        if journal.exists():
            for line in journal.read_text().splitlines():
                parts = line.split()
                if parts and parts[0] == "requested" and len(parts) == 3:
                    committed[parts[1]] = parts[2]
    pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))
    try:
        stored = {lease.id: lease for lease in pool.store.leases(include_released=True, limit=10**9)}
        lost = [lease_id for lease_id in committed if lease_id not in stored]
        assert not lost, f"{len(lost)} committed leases are missing from the store"
        assert all(stored[i].kernel_id == k for i, k in committed.items()), "a lease changed kernels"
        leaked_before = sum(1 for lease in stored.values() if lease.live)
        started = time.perf_counter()
        pool.tick()  # every holder is dead now: their leases must all go
        reclaim_ms = (time.perf_counter() - started) * 1000
        leaked_after = sum(1 for lease in pool.leases())
    finally:
        pool.close()
    assert leaked_after == 0, f"{leaked_after} leases of killed holders were not reclaimed by the next tick"
    figures = check_pool_file(db, spec)
    return {
        "seconds": seconds,
        "workers": workers,
        "kills": kills,
        "requests_committed": len(committed),
        "leases_lost": len(lost),
        "leases_duplicated": 0,
        "leaked_leases_reclaimed": leaked_before,
        "reclaim_ms": round(reclaim_ms, 1),
        **figures,
    }


# --- burst --------------------------------------------------------------------------------------

BURST_WORKER = textwrap.dedent(
    """
    import json, os, resource, sys, time
    from jupyter_gpupool.core.models import LeaseRequest, PriorityClass
    from jupyter_gpupool.core.policy import PoolPolicy
    from jupyter_gpupool.devices.simulated import SimulatedBackend
    from jupyter_gpupool.backends.local.pool import Pool
    from jupyter_gpupool.units import GIB

    db, spec, first, count, go = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))
    classes = [PriorityClass.NORMAL, PriorityClass.NORMAL, PriorityClass.BATCH, PriorityClass.HIGH]
    while time.time() < go:
        time.sleep(0.001)
    latencies = []
    for i in range(first, first + count):
        started = time.perf_counter()
        pool.request(LeaseRequest(owner="user%d" % i, memory=GIB, priority=classes[i % len(classes)], label=str(i)))
        latencies.append(time.perf_counter() - started)
    print(json.dumps({"latencies": latencies, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    """
)


def burst(workdir: Path, requests: int = 200, room: int = 20, processes: int = 4) -> dict[str, Any]:
    """``requests`` one-GiB requests from ``processes`` processes at once against room for ``room``."""
    spec = f"1x{room}GiB"
    db = str(workdir / "burst.sqlite")
    Pool(SimulatedBackend.from_spec(spec), db).close()
    go = time.time() + 1.5
    share = requests // processes
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BURST_WORKER, db, spec, str(i * share), str(share if i < processes - 1 else requests - i * share), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_child_env(),
        )
        for i in range(processes)
    ]
    latencies: list[float] = []
    peak_rss = 0
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        result = json.loads(out.strip().splitlines()[-1])
        latencies += result["latencies"]
        peak_rss = max(peak_rss, result["maxrss_kib"])
    pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))
    try:
        live = pool.leases()
        granted = [lease for lease in live if lease.state is LeaseState.GRANTED]
        queued = [lease for lease in live if lease.state is LeaseState.QUEUED]
        assert len(live) == requests, f"{requests - len(live)} requests were lost"
        assert len(granted) == room and len(queued) == requests - room, (len(granted), len(queued))
        handovers = 0
        out_of_order = 0
        while granted:
            head = pool.queue()[0] if pool.queue() else None
            pool.release(granted.pop(0).id, reason="done")
            now_granted = [lease for lease in pool.leases() if lease.state is LeaseState.GRANTED]
            assert len(now_granted) == min(room, len(pool.leases())), "a release did not hand the slice on exactly once"
            if head is not None:
                handovers += 1
                newly = [lease for lease in now_granted if lease.id == head.id]
                out_of_order += 0 if newly else 1
                granted = [lease for lease in now_granted if lease.id != head.id] + newly
            else:
                granted = now_granted
            if handovers >= 60:
                break
        assert out_of_order == 0, f"{out_of_order} hand-overs skipped the head of the queue"
    finally:
        pool.close()
    check_pool_file(db, spec)
    return {
        "requests": requests,
        "room": room,
        "processes": processes,
        "granted_at_once": room,
        "queued": requests - room,
        "handovers_checked": handovers,
        "handovers_out_of_policy_order": out_of_order,
        "request_ms_p50": round(percentile(latencies, 0.5) * 1000, 2),
        "request_ms_p99": round(percentile(latencies, 0.99) * 1000, 2),
        "request_ms_max": round(max(latencies) * 1000, 2),
        "peak_rss_mib": round(peak_rss / 1024, 1),
    }


# --- device faults ------------------------------------------------------------------------------


def device_faults(workdir: Path) -> dict[str, Any]:
    """A GPU lost mid-run, a MIG instance destroyed under a lease, NVML missing at start."""
    import fake_pynvml
    from fake_pynvml import FakeGpu, FakeNvml

    from jupyter_gpupool.devices import make_backend
    from jupyter_gpupool.errors import PoolUnavailable

    figures: dict[str, Any] = {}
    saved = sys.modules.get("pynvml")
    try:
        # A GPU lost mid-run: its leases are flagged, the others keep serving, new requests avoid it.
        fake = FakeNvml([FakeGpu("NVIDIA A100-SXM4-80GB", 80 * GIB) for _ in range(2)])
        sys.modules["pynvml"] = fake.module
        pool = Pool(make_backend("nvml"), str(workdir / "faults.sqlite"), PoolPolicy(heartbeat_ttl=10**9))
        pool.device_cache_seconds = 0
        first = pool.request(LeaseRequest(owner="alice", memory=60 * GIB))
        second = pool.request(LeaseRequest(owner="bob", memory=60 * GIB))
        assert {first.devices[0], second.devices[0]} == {d.uuid for d in pool.devices()}
        lost_index = next(i for i, d in enumerate(pool.devices()) if d.uuid == first.devices[0])
        fake.gpus[lost_index].lost = True
        pool.tick()
        flagged = pool.get(first.id)
        assert "lost" in flagged.flagged.lower(), f"the lease on the lost GPU was not flagged: {flagged.flagged!r}"
        assert pool.get(second.id).flagged == "", "a lease on a healthy GPU was flagged"
        view = pool.view_lease(flagged, viewer="alice", admin=False)
        assert "lost" in json.dumps(view).lower(), "the owner's view does not say the GPU was lost"
        third = pool.request(LeaseRequest(owner="carol", memory=10 * GIB))
        assert third.state is LeaseState.GRANTED and third.devices == second.devices, "a new request went to the lost GPU"
        figures["gpu_lost"] = "flagged for its user; new requests placed on the healthy GPU"
        pool.close()

        # A MIG instance destroyed under a lease: the lease is flagged, never silently moved.
        gpus = fake_pynvml.a100_mig()
        fake = FakeNvml(gpus)
        sys.modules["pynvml"] = fake.module
        pool = Pool(make_backend("nvml"), str(workdir / "mig.sqlite"), PoolPolicy(heartbeat_ttl=10**9))
        pool.device_cache_seconds = 0
        migs = [d for d in pool.devices() if d.is_mig]
        on_mig = pool.request(LeaseRequest(owner="dave", memory=min(d.memory_total for d in migs)))
        slot = next(i for i, s in enumerate(gpus[0].mig_slots) if s is not None and s.uuid == on_mig.devices[0])
        gpus[0].mig_slots[slot] = None
        pool.tick()
        after = pool.get(on_mig.id)
        assert after.devices == on_mig.devices, "a lease moved to another MIG instance"
        assert after.flagged, "the lease on a destroyed MIG instance was not flagged for its user"
        figures["mig_destroyed"] = f"flagged: {after.flagged}"
        pool.close()

        # NVML missing at start: one clear PoolUnavailable, no traceback for the user to read.
        fake = FakeNvml([], init_error=fake_pynvml.ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"])
        sys.modules["pynvml"] = fake.module
        try:
            make_backend("nvml").devices()
        except PoolUnavailable as err:
            figures["nvml_missing"] = str(err)
        else:
            raise AssertionError("a missing NVML did not make the pool unavailable")
    finally:
        if saved is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved
    return figures


# --- soak ---------------------------------------------------------------------------------------


def soak(workdir: Path, seconds: float = 10.0, spec: str = "2x24GiB", seed: int = 7) -> dict[str, Any]:
    """Random operations for ``seconds`` with the invariants checked all along; RSS and fds."""
    db = str(workdir / "soak.sqlite")
    clock = [1_800_000_000.0]
    pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9, idle_timeout=600), clock=lambda: clock[0])
    me = psutil.Process()
    rng = random.Random(seed)
    samples: list[tuple[float, int]] = []
    live: list[str] = []
    operations = 0
    checks = 0
    deadline = time.monotonic() + seconds
    warmup = min(2.0, seconds / 4)
    started = time.monotonic()
    while time.monotonic() < deadline:
        roll = rng.random()
        if roll < 0.35 or not live:
            try:
                lease = pool.request(
                    LeaseRequest(owner=f"user{rng.randrange(12)}", memory=rng.choice([1, 2, 4, 8]) * GIB, priority=rng.choice(list(PriorityClass)))
                )
            except RequestRefused:  # past PoolPolicy.max_queued_per_user: refused, nothing changed
                pass
            else:
                live.append(lease.id)
        elif roll < 0.65:
            lease_id = live.pop(rng.randrange(len(live)))
            pool.release(lease_id)
        elif roll < 0.75:
            lease = pool.get(rng.choice(live))
            if lease.live:
                with contextlib.suppress(RequestRefused):  # growing past the GPU's free memory is refused
                    pool.resize(lease.id, memory=rng.choice([1, 2, 4]) * GIB)
        else:
            clock[0] += rng.uniform(1, 120)
            pool.tick()
        live = [i for i in live if pool.get(i).live]
        operations += 1
        if operations % 200 == 0:
            pool.store.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            check_pool_file(db, spec)
            checks += 1
            if time.monotonic() - started >= warmup:
                samples.append((me.memory_info().rss / 2**20, me.num_fds()))
    pool.close()
    check_pool_file(db, spec)
    if not samples:
        samples.append((me.memory_info().rss / 2**20, me.num_fds()))
    return {
        "seconds": seconds,
        "operations": operations,
        "invariant_checks": checks + 1,
        "rss_mib_start": round(samples[0][0], 1),
        "rss_mib_end": round(samples[-1][0], 1),
        "fds_start": samples[0][1],
        "fds_end": samples[-1][1],
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "rss_mib_median": round(statistics.median(s[0] for s in samples), 1),
    }


# --- a server killed with its kernels -----------------------------------------------------------


def server_kill(workdir: Path, spec: str = "1x16GiB") -> dict[str, Any]:
    """SIGKILL a real `jupyter server` holding two granted kernels and one queued: its kernels
    end, the next pool decision reclaims all three leases, and a new server on the same pool file
    is granted at once."""
    from server_process import Server, wait_for

    db = str(workdir / "server.sqlite")
    env: dict[str, str | None] = {"GPUPOOL_SIMULATE": spec, "GPUPOOL_DB": db, "GPUPOOL_DEFAULT_MEMORY": "8GiB", "GPUPOOL_URL": None}
    server = Server(workdir, "first", env)
    try:
        kernels = [server.call("POST", "api/kernels", {"name": "python3"})["id"] for _ in range(3)]
        pool = Pool(SimulatedBackend.from_spec(spec), db, PoolPolicy(heartbeat_ttl=10**9))

        def states() -> list[str]:
            return [(lease.state.value if (lease := pool.lease_for_kernel(k)) else "none") for k in kernels]

        wait_for(lambda: sorted(states()) == ["granted", "granted", "queued"], what="two grants and one queued")
        kernel_pids = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        killed_at = time.monotonic()
        # ipykernel polls its parent: the orphaned kernels end by themselves.
        wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in kernel_pids),
                 timeout=30, what="the killed server's kernels to end")
        kernels_gone_s = time.monotonic() - killed_at
        pool.tick()
        reclaimed_s = time.monotonic() - killed_at
        left = states()
        pool.close()
        assert not {"granted", "queued"} & set(left), f"leases of the killed server survived: {left}"
    finally:
        server.stop()
    check_pool_file(db, spec)
    second = Server(workdir, "second", env)
    try:
        kernel = second.call("POST", "api/kernels", {"name": "python3"})["id"]
        restarted = time.monotonic()
        wait_for(lambda: second.call("GET", f"api/gpupool/kernels/{kernel}")["state"] == "granted", what="a grant on the new server")
        grant_s = time.monotonic() - restarted
    finally:
        second.stop()
    return {
        "kernels": 3,
        "orphaned_kernels_ended_s": round(kernels_gone_s, 1),
        "leases_reclaimed_after_s": round(reclaimed_s, 1),
        "new_server_grant_s": round(grant_s, 1),
    }


# --- the suspend protocol and unpooled use -----------------------------------------------------


class _Processes:
    """Real processes standing in for kernels and for programs run outside the pool: each is a
    ``sleep`` whose environment names its lease (``GPUPOOL_LEASE_ID``) or none, and whose GPU memory
    is scripted in the simulated pool's usage folder, as ``pretend_to_use`` does in a kernel."""

    def __init__(self, usage_dir: str) -> None:
        self.usage_dir = usage_dir
        os.makedirs(usage_dir, exist_ok=True)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.usage: dict[int, dict[str, int]] = {}
        self.changes = 0  # how many times any process's GPU memory changed

    def start(self, lease_id: str | None = None) -> int:
        env = {k: v for k, v in os.environ.items() if k != "GPUPOOL_LEASE_ID"}
        if lease_id:
            env["GPUPOOL_LEASE_ID"] = lease_id
        proc = subprocess.Popen(["sleep", "3600"], env=env)
        self.procs[proc.pid] = proc
        return proc.pid

    def use(self, pid: int, usage: dict[str, int]) -> None:
        """Process ``pid`` now holds ``usage`` (GPU uuid → bytes; empty frees it all)."""
        self.changes += 1
        path = Path(self.usage_dir) / f"{pid}.json"
        usage = {uuid: amount for uuid, amount in usage.items() if amount > 0}
        if usage:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(usage))
            os.replace(tmp, path)
            self.usage[pid] = usage
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            self.usage.pop(pid, None)

    def kill(self, pid: int) -> None:
        proc = self.procs.pop(pid, None)
        if proc is not None:
            proc.kill()
            proc.wait()
        self.use(pid, {})

    def close(self) -> None:
        for pid in list(self.procs):
            self.kill(pid)


@dataclass
class LostPoolFile:
    """A running broker whose pool file is about to be lost: alice holds a granted 12 GiB lease for
    her kernel ``k-alice``, a real process that holds 10 GiB of it on the simulated GPU (1x16GiB);
    bob has asked for nothing yet. The broker's watchdog stops what holds GPU memory outside the
    pool after 0.5 s, as a forgotten kernel would."""

    broker: BrokerProcess
    alice: RemotePool
    bob: RemotePool
    procs: _Processes
    lease: Lease
    kernel: int  # the kernel's pid

    def remove_pool_file(self) -> None:
        """``rm pool.sqlite*`` (the simulated driver's usage folder stays)."""
        for path in glob.glob(self.broker.db + "*"):
            if os.path.isfile(path):
                os.unlink(path)

    def bob_waits(self) -> Lease:
        """Bob asks for 8 GiB, which only the kernel's memory could give him: past the watchdog's
        grace his request still waits and the kernel still runs. Returns his queued lease."""
        waiting = self.bob.request(LeaseRequest(owner="", memory=8 * GIB, kernel_id="k-bob"))
        time.sleep(1.5)  # past the watchdog's grace, several ticks
        assert self.bob.get(waiting.id).state is LeaseState.QUEUED, "the kernel's memory was granted again"
        assert self.procs.procs[self.kernel].poll() is None, "the broker stopped the adopted kernel"
        return waiting


@contextlib.contextmanager
def lost_pool_file_broker(workdir: Path, start_kernel: Callable[[_Processes, str], int]) -> Iterator[LostPoolFile]:
    """A real broker process in ``workdir`` (stand-in hub with alice and bob) set up as
    :class:`LostPoolFile` says; ``start_kernel(procs, lease_id)`` starts alice's kernel process and
    returns its pid. A pool error in the block fails with the broker's log; everything stops after."""
    from broker_harness import BrokerProcess, StandInHub

    from jupyter_gpupool.backends.local.pool import HOSTNAME
    from jupyter_gpupool.backends.remote import RemotePool

    hub = StandInHub().start()
    alice_token, bob_token = hub.add_user("tok-alice", "alice"), hub.add_user("tok-bob", "bob")
    config = "c.Broker.run_watchdog = True\nc.Watchdog.interval = 0.2\nc.Watchdog.unpooled_action = 'stop'\nc.Watchdog.grace = 0.5\n"
    broker = BrokerProcess(workdir, hub, simulate="1x16GiB", config=config)
    procs = _Processes(f"{broker.db}.usage")
    try:
        broker.start()
        alice, bob = RemotePool(broker.url, token=alice_token, timeout=15), RemotePool(broker.url, token=bob_token, timeout=15)
        lease = alice.request(LeaseRequest(owner="", memory=12 * GIB, kernel_id="k-alice", holder_pid=os.getpid(), holder_host=HOSTNAME))
        assert lease.state is LeaseState.GRANTED, lease
        kernel = start_kernel(procs, lease.id)
        procs.use(kernel, {lease.devices[0]: 10 * GIB})
        yield LostPoolFile(broker, alice, bob, procs, lease, kernel)
    except GpuPoolError as err:
        raise AssertionError(f"{err}\n{broker.log()[-3000:]}") from None
    finally:
        procs.close()
        broker.stop()
        hub.stop()


def _granted_pairs(leases: list[Any]) -> set[tuple[str, str]]:
    """(lease id, GPU uuid) of every slice the pool holds for a lease (a move holds both ends)."""
    return {(lease.id, uuid) for lease in leases if lease.state is LeaseState.GRANTED for uuid in (*lease.devices, *lease.migrate_from)}


def check_suspend_invariants(pool: Pool, procs: _Processes, kernel_of_pid: dict[int, str], before: set[tuple[str, str]]) -> list[str]:
    """The promises of the suspend protocol and of unpooled use, against the ground truth of what
    each process holds on each GPU; one line per broken promise (none when all hold):

    - nothing is granted out of memory held outside the pool: a slice granted since ``before``
      (a grant, a restore, a move's target) fits on its GPU beside the other slices *and* what
      processes outside any granted lease of that GPU hold there;
    - one live lease per kernel;
    - a lease's parked bytes are at most what it held (its slice or its peak use), only a lease
      with something to restore parks any, and the pool's parked total is the sum of them, within
      the parked-memory budget.
    """
    problems: list[str] = []
    leases = pool.leases()
    by_id = {lease.id: lease for lease in leases}
    now_pairs = _granted_pairs(leases)
    devices = {d.uuid: d for d in pool.devices()}
    slices: dict[str, int] = {}
    for lease in leases:
        if lease.state is LeaseState.GRANTED:
            for uuid in (*lease.devices, *lease.migrate_from):
                slices[uuid] = slices.get(uuid, 0) + lease.memory
    outside: dict[str, int] = {}
    for pid, usage in procs.usage.items():
        owner = by_id.get(kernel_of_pid.get(pid, ""))
        for uuid, amount in usage.items():
            if owner is None or owner.state is not LeaseState.GRANTED or uuid not in (*owner.devices, *owner.migrate_from):
                outside[uuid] = outside.get(uuid, 0) + amount
    for lease_id, uuid in sorted(now_pairs - before):
        taken = slices.get(uuid, 0) + outside.get(uuid, 0)
        if taken > devices[uuid].leasable:
            problems.append(
                f"lease {lease_id} was granted on {uuid} although its slices ({slices.get(uuid, 0) // GIB} GiB) and "
                f"use outside the pool ({outside.get(uuid, 0) // GIB} GiB) exceed its {devices[uuid].leasable // GIB} GiB"
            )
    kernels = [lease.kernel_id for lease in leases if lease.kernel_id]
    doubled = {k for k in kernels if kernels.count(k) > 1}
    if doubled:
        problems.append(f"kernels with two live leases: {sorted(doubled)}")
    parked_total = 0
    for lease in leases:  # parked until restored: suspended, queued to resume, restoring; a move passes through host RAM
        bound = max(lease.memory * lease.num_gpus, lease.peak_memory or 0)
        if lease.parked_memory > bound:
            problems.append(f"lease {lease.id} ({lease.state.value}) parks {lease.parked_memory} bytes, more than the {bound} it held")
        if lease.parked_memory and not (lease.state is LeaseState.SUSPENDED or lease.resuming or lease.transition is not Transition.NONE):
            problems.append(f"lease {lease.id} ({lease.state.value}) keeps {lease.parked_memory} bytes parked with nothing to restore")
        parked_total += lease.parked_memory or 0
    with pool._viewing(pool.clock()) as (state, _):
        indexed, budget = state.derived().parked, pool.engine.parked_budget(state)
    if indexed != parked_total:
        problems.append(f"the pool counts {indexed} bytes parked, its suspended leases {parked_total}")
    if parked_total > budget:
        problems.append(f"{parked_total} bytes parked, over the budget of {budget}")
    return problems


def suspend_soak(workdir: Path, seconds: float = 10.0, spec: str = "2x24GiB", seed: int = 11, min_operations: int = 0) -> dict[str, Any]:
    """Random kernels on one pool file for ``seconds``, each a real process whose GPU memory is
    scripted, with everything the suspend protocol does in the mix: the pool's own suspends and
    moves (idle reclaim, defragmentation), users' suspends and resumes, restores, kernel restarts
    (a suspended kernel's included), the holder's server restarting (the pool reopened), failed
    steps, forged confirmations (a suspend or move reported done while the process still holds its
    memory), replayed confirmations, inflated and impossible ``parked_bytes``, and processes
    outside the pool starting and stopping (a terminal's ``python``, a suspended kernel that keeps
    using its GPU). The host's watchdog reconciles after every step, and the invariants of
    :func:`check_suspend_invariants` and :func:`check_pool_file` are checked after every step.
    It runs ``seconds``, and on for at least ``min_operations`` steps (the same steps for a seed)."""
    from jupyter_gpupool.backends.local.pool import HOSTNAME
    from jupyter_gpupool.core.models import Activity
    from jupyter_gpupool.enforcement.watchdog import Watchdog

    db = str(workdir / "suspend-soak.sqlite")
    clock = [1_800_000_000.0]
    backend = SimulatedBackend.from_spec(spec)
    backend.usage_dir = str(workdir / "usage")
    policy = {"heartbeat_ttl": 10**9, "idle_timeout": 600, "warning_period": 30, "defragment_min_idle": 60, "reclaim_action": "suspend"}
    procs = _Processes(backend.usage_dir)
    rng = random.Random(seed)
    uuids = [d.uuid for d in backend.devices()]
    total = {d.uuid: d.memory_total for d in backend.devices()}
    watchdog_problems: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: Any) -> None:
            if "could not" in record.getMessage():
                watchdog_problems.append(record.getMessage())

    watchdog_log = logging.getLogger(f"gpupool.reliability.watchdog.{id(workdir)}")
    watchdog_log.addHandler(_Collect())
    watchdog_log.propagate = False  # hundreds of sightings: the figures count them

    def open_pool() -> tuple[Pool, Watchdog]:
        pool = Pool(backend, db, PoolPolicy(**policy), clock=lambda: clock[0])
        watchdog = Watchdog(backend=backend, pool=pool)
        watchdog.log = watchdog_log
        return pool, watchdog

    pool, watchdog = open_pool()
    kernels: dict[str, dict[str, Any]] = {}  # kernel id → {"lease", "pid", "owner", "gib"}
    kernel_of_pid: dict[int, str] = {}  # pid → lease id
    rogues: list[int] = []
    counts = {key: 0 for key in (
        "kernels_started", "releases", "user_suspends", "suspends_confirmed", "suspends_failed", "resumes_asked",
        "restores_confirmed", "restores_failed", "moves_confirmed", "restarts", "restarts_of_suspended",
        "server_restarts", "forged_taken", "forged_let_go", "replays_harmless", "parked_bytes_bounded", "parked_bytes_refused",
        "outside_started", "suspended_kernels_using_gpu", "unpooled_sightings", "grants_checked", "invariant_checks",
    )}
    violations: list[str] = []
    first_lines: list[str] = []  # each broken promise once, with the step that first broke it
    step = ["start"]  # what the current step did, for those lines
    operations = 0

    seen_lines: set[str] = set()

    def violate(line: str) -> None:
        violations.append(line)
        if line not in seen_lines and len(seen_lines) < 20:
            seen_lines.add(line)
            first_lines.append(f"op {operations} ({step[0]}): {line}")

    def watch() -> None:
        live = {lease.id: lease for lease in pool.leases()}
        report = watchdog.check({}, {}, now=clock[0], leases=live, host=HOSTNAME)
        if report.error:
            violate(f"the watchdog failed: {report.error}")
        counts["unpooled_sightings"] += len(pool.unpooled())

    def free_outside(uuid: str) -> int:
        """What a process outside the pool can still take on ``uuid`` without touching a slice."""
        slices = sum(lease.memory for lease in pool.leases() if lease.state is LeaseState.GRANTED
                     for u in (*lease.devices, *lease.migrate_from) if u == uuid)
        used = sum(usage.get(uuid, 0) for usage in procs.usage.values())
        return total[uuid] - max(slices, 0) - used

    def unchanged(lease_id: str, expected: type[BaseException], what: str, **report: Any) -> bool:
        """The confirmation ``report`` must be refused with ``expected`` and change nothing of the lease."""
        before = pool.get(lease_id).to_json()
        try:
            pool.confirm_transition(lease_id, **report)
        except expected:
            after = pool.get(lease_id).to_json()
            if after != before:
                violate(f"{what} was refused but changed lease {lease_id}")
            return True
        violate(f"{what} was accepted")
        return False

    def serve() -> None:
        """What each kernel's server does with the pool's decisions: use a new slice, carry out a
        suspend, restore or move (now and then failing it, or first forging its confirmation), stop
        a kernel whose lease went."""
        def stop_if_released(kernel_id: str) -> bool:
            # The server stops a kernel whose lease went (a cull after a failed suspend, a failed
            # restore) as soon as it hears: the pool hands that slice on at once.
            kernel = kernels[kernel_id]
            if pool.get(kernel["lease"]).state is not LeaseState.RELEASED:
                return False
            procs.kill(kernel["pid"])
            kernel_of_pid.pop(kernel["pid"], None)
            del kernels[kernel_id]
            return True

        for kernel_id, kernel in list(kernels.items()):
            if kernel_id not in kernels or stop_if_released(kernel_id):
                continue
            lease = pool.get(kernel["lease"])
            pid = kernel["pid"]
            if kernel.get("holds_after_report") and rng.random() < 0.5:
                # The process whose step was reported done early lets go of what it still held there.
                kept = {u: a for u, a in procs.usage.get(pid, {}).items() if lease.state is LeaseState.GRANTED and u in lease.devices}
                procs.use(pid, kept)
                kernel["holds_after_report"] = False
                counts["forged_let_go"] += 1
            if lease.state is LeaseState.GRANTED and lease.transition is Transition.NONE and pid not in procs.usage:
                per_gpu = lease.memory * rng.choice([5, 8, 10]) // 10
                procs.use(pid, {uuid: per_gpu for uuid in lease.devices})
            elif lease.transition is Transition.SUSPENDING:
                if pid in procs.usage and rng.random() < 0.25:
                    # A 'suspend done' while the process holds its memory: taken at once, and what the
                    # process holds stays taken until it lets go (the invariants check every grant).
                    kernel["parked"] = sum(procs.usage[pid].values())
                    pool.confirm_transition(lease.id, parked_bytes=0)
                    kernel["holds_after_report"] = True
                    counts["forged_taken"] += 1
                    continue
                if rng.random() < 0.1:
                    pool.fail_transition(lease.id, "could not suspend: injected failure", still_running=True)
                    counts["suspends_failed"] += 1
                    stop_if_released(kernel_id)
                    continue
                held = sum(procs.usage.get(pid, {}).values())
                procs.use(pid, {})
                if rng.random() < 0.1:
                    capacity = sum(total[u] for u in lease.devices)
                    if not unchanged(lease.id, InvalidInput, "a 1 PiB parked_bytes", parked_bytes=capacity + 2**50):
                        continue
                    counts["parked_bytes_refused"] += 1
                reported = held if rng.random() < 0.8 else sum(total[u] for u in lease.devices)
                done = pool.confirm_transition(lease.id, parked_bytes=reported)
                counts["suspends_confirmed"] += 1
                if reported > held and done.parked_memory <= lease.memory * lease.num_gpus:
                    counts["parked_bytes_bounded"] += 1
                kernel["parked"] = held
                if rng.random() < 0.3 and unchanged(lease.id, InvalidInput, "a replayed 'suspend done'", parked_bytes=held):
                    counts["replays_harmless"] += 1
            elif lease.transition is Transition.RESTORING:
                if rng.random() < 0.05:
                    pool.fail_transition(lease.id, "could not restore: injected failure", still_running=False)
                    counts["restores_failed"] += 1
                    stop_if_released(kernel_id)
                    continue
                per_gpu = min(lease.memory, max(GIB, kernel.get("parked", lease.memory) // max(1, lease.num_gpus)))
                procs.use(pid, {uuid: per_gpu for uuid in lease.devices})
                pool.confirm_transition(lease.id)
                counts["restores_confirmed"] += 1
                if rng.random() < 0.3 and unchanged(lease.id, InvalidInput, "a replayed 'restore done'"):
                    counts["replays_harmless"] += 1
            elif lease.transition is Transition.MIGRATING:
                if pid in procs.usage and rng.random() < 0.3:
                    # A 'move done' while the process still holds its old GPU: taken; that memory stays taken.
                    pool.confirm_transition(lease.id)
                    kernel["holds_after_report"] = True
                    counts["forged_taken"] += 1
                    continue
                held = sum(procs.usage.get(pid, {}).values()) or lease.memory // 2
                procs.use(pid, {uuid: min(lease.memory, held) for uuid in lease.devices})
                pool.confirm_transition(lease.id)
                counts["moves_confirmed"] += 1
                if rng.random() < 0.3 and unchanged(lease.id, InvalidInput, "a replayed 'move done'"):
                    counts["replays_harmless"] += 1

    def start_kernel(kernel_id: str, owner: str, gib: int) -> Lease | None:
        try:
            lease = pool.request(LeaseRequest(owner=owner, memory=gib * GIB, kernel_id=kernel_id, holder_pid=os.getpid(),
                                              holder_host=HOSTNAME, suspendable=True))
        except RequestRefused:  # past max_queued_per_user: nothing was committed
            return None
        pid = procs.start(lease.id)
        kernels[kernel_id] = {"lease": lease.id, "pid": pid, "owner": owner, "gib": gib}
        kernel_of_pid[pid] = lease.id
        return lease

    me = psutil.Process()
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    changes = 0
    try:
        while time.monotonic() < deadline or operations < min_operations:
            before = _granted_pairs(pool.leases())
            roll = rng.random()
            mine = list(kernels.values())
            if roll < 0.16 or not mine:
                step[0] = 'request'
                kernel_id = f"k{operations}"
                if start_kernel(kernel_id, f"user{rng.randrange(8)}", rng.choice([2, 4, 6, 8, 12])):
                    counts["kernels_started"] += 1
            elif roll < 0.26:
                step[0] = 'release'
                kernel = rng.choice(mine)
                pool.release(kernel["lease"], reason="the kernel was shut down")
                counts["releases"] += 1
            elif roll < 0.38:
                step[0] = 'suspend'
                kernel = rng.choice(mine)
                with contextlib.suppress(RequestRefused, InvalidInput):  # not running on a GPU, budget, ...
                    pool.suspend(kernel["lease"])
                    counts["user_suspends"] += 1
            elif roll < 0.48:
                step[0] = 'resume'
                suspended = [k for k in mine if pool.get(k["lease"]).state is LeaseState.SUSPENDED]
                if suspended:
                    with contextlib.suppress(RequestRefused, InvalidInput):
                        pool.resume(rng.choice(suspended)["lease"])
                        counts["resumes_asked"] += 1
            elif roll < 0.56:
                step[0] = 'restart'
                # A kernel restart: a new process asks again for the same kernel and keeps its one lease.
                kernel = rng.choice(mine)
                old = pool.get(kernel["lease"])
                procs.kill(kernel["pid"])
                kernel_of_pid.pop(kernel["pid"], None)
                kernels.pop(next(k for k, v in kernels.items() if v is kernel))
                again = start_kernel(old.kernel_id or "", kernel["owner"], kernel["gib"])
                counts["restarts"] += 1
                counts["restarts_of_suspended"] += old.state is LeaseState.SUSPENDED
                if again is not None and (again.id != old.id or again.parked_memory or again.transition is not Transition.NONE):
                    violate(f"a restart of kernel {old.kernel_id} got lease {again.id} {again.state.value} "
                            f"{again.transition.value} parked {again.parked_memory} (had {old.id})")
            elif roll < 0.63:
                step[0] = 'outside start'
                uuid = rng.choice(uuids)
                room = free_outside(uuid)
                if room >= GIB:
                    pid = procs.start()
                    procs.use(pid, {uuid: rng.randrange(1, room // GIB + 1) * GIB})
                    rogues.append(pid)
                    counts["outside_started"] += 1
            elif roll < 0.69 and rogues:
                step[0] = 'outside stop'
                procs.kill(rogues.pop(rng.randrange(len(rogues))))
            elif roll < 0.72:
                step[0] = 'suspended kernel uses a GPU'
                # A suspended kernel that goes on using a GPU (it ignored its suspend): unpooled use.
                suspended = [k for k in mine if pool.get(k["lease"]).state is LeaseState.SUSPENDED]
                uuid = rng.choice(uuids)
                if suspended and free_outside(uuid) >= GIB:
                    procs.use(rng.choice(suspended)["pid"], {uuid: GIB})
                    counts["suspended_kernels_using_gpu"] += 1
            elif roll < 0.76:
                step[0] = 'busy'
                busy = rng.choice(mine)
                pool.report_activity(busy["lease"], Activity(busy=True, last_activity=clock[0]))
            elif roll < 0.78:
                step[0] = 'server restart'
                pool.close()  # the holder's server restarts: a new process opens the same pool file
                pool, watchdog = open_pool()
                counts["server_restarts"] += 1
            else:
                step[0] = 'tick'
                clock[0] += rng.uniform(1, 90)
                watch()
                pool.tick()
            if procs.changes != changes:
                watch()  # the host's watchdog sees what changed on the GPUs (within one interval)
            changes = procs.changes
            serve()
            if procs.changes != changes:
                watch()
            changes = procs.changes
            operations += 1
            counts["grants_checked"] += len(_granted_pairs(pool.leases()) - before)
            for problem in check_suspend_invariants(pool, procs, kernel_of_pid, before):
                if os.environ.get("GPUPOOL_RELIABILITY_DEBUG"):
                    print(problem, step, [(e["kind"], e["lease_id"], e["reason"][:90]) for e in pool.events()[-4:]], file=sys.stderr)
                violate(problem)
            counts["invariant_checks"] += 1
            if operations % 100 == 0:
                try:
                    check_pool_file(db, spec, intervals=True)
                except AssertionError as err:
                    violate(f"the pool file: {err}")
                if time.monotonic() - started >= min(2.0, seconds / 4):
                    samples.append((me.memory_info().rss / 2**20, me.num_fds()))
    finally:
        pool.close()
        procs.close()
    try:
        check_pool_file(db, spec, intervals=True)
    except AssertionError as err:
        violate(f"the pool file: {err}")
    for problem in watchdog_problems[:5]:
        violate(f"the watchdog logged: {problem}")
    if not samples:
        samples.append((me.memory_info().rss / 2**20, me.num_fds()))
    return {
        "seconds": seconds,
        "operations": operations,
        **counts,
        "failures": len(violations),
        "failure_lines": first_lines[:10],
        "rss_mib_start": round(samples[0][0], 1),
        "rss_mib_end": round(samples[-1][0], 1),
        "fds_start": samples[0][1],
        "fds_end": samples[-1][1],
    }


def unpooled_nvml(workdir: Path) -> dict[str, Any]:
    """Unpooled use on the NVML backend over the scripted fake ``pynvml`` (real processes, scripted
    per-process memory): a process without a lease, a kernel on a GPU outside its lease and a
    suspended kernel that still holds memory are each seen with their pid, and what they hold is
    never granted; a 'suspend done' while NVML lists the process is taken at once, and what it lists
    stays taken until it is freed; a process that
    exits gives its memory back."""
    from fake_pynvml import FakeGpu, FakeNvml, FakeProcess

    from jupyter_gpupool.backends.local.pool import HOSTNAME
    from jupyter_gpupool.devices import make_backend
    from jupyter_gpupool.enforcement.watchdog import Watchdog

    figures: dict[str, Any] = {}
    saved = sys.modules.get("pynvml")
    procs = _Processes(str(workdir / "unused"))
    clock = [1_800_000_000.0]
    try:
        fake = FakeNvml([FakeGpu("NVIDIA A100-SXM4-80GB", 80 * GIB) for _ in range(2)])
        sys.modules["pynvml"] = fake.module
        pool = Pool(make_backend("nvml"), str(workdir / "nvml.sqlite"), PoolPolicy(heartbeat_ttl=10**9, parked_memory_limit="64GiB"),
                    clock=lambda: clock[0])
        pool.device_cache_seconds = 0
        watchdog = Watchdog(backend=pool.backend, pool=pool)
        uuids = [d.uuid for d in pool.devices()]
        gpu_of = {d.uuid: fake.gpus[d.index] for d in pool.devices()}

        def use(pid: int, uuid: str, amount: int) -> None:
            gpu = gpu_of[uuid]
            gpu.compute = [p for p in gpu.compute if p.pid != pid] + ([FakeProcess(pid, amount)] if amount else [])
            gpu.memory_used = sum(p.used or 0 for p in gpu.compute)

        def watch() -> list[dict[str, Any]]:
            report = watchdog.check({}, {}, now=clock[0], leases={lease.id: lease for lease in pool.leases()}, host=HOSTNAME)
            assert not report.error, report.error
            return pool.snapshot(admin=True).unpooled

        alice = pool.request(LeaseRequest(owner="alice", memory=40 * GIB, kernel_id="k-alice", holder_host=HOSTNAME, suspendable=True))
        home, other = alice.devices[0], next(u for u in uuids if u not in alice.devices)
        kernel, rogue = procs.start(alice.id), procs.start()
        use(kernel, home, 30 * GIB)
        use(rogue, other, 50 * GIB)
        seen = watch()
        assert [(u["pid"], u["bytes"], u["why"]) for u in seen] == [(rogue, 50 * GIB, "no lease")], seen
        assert pool.get(alice.id).used_memory == 30 * GIB, "the kernel's use on its own GPU was not counted for its lease"
        big = pool.request(LeaseRequest(owner="bob", memory=60 * GIB))
        assert big.state is LeaseState.QUEUED, "60 GiB were granted although only 40 and 30 GiB are free"
        figures["outside_the_pool"] = f"pid {rogue} seen with 50 GiB; a 60 GiB request waits"

        use(kernel, other, 4 * GIB)  # the kernel reaches past its lease onto the other GPU
        seen = watch()
        assert sorted((u["pid"], u["why"]) for u in seen) == sorted([(rogue, "no lease"), (kernel, "outside its lease's GPUs")]), seen
        use(kernel, other, 0)

        pool.suspend(alice.id)
        try:
            pool.confirm_transition(alice.id, parked_bytes=2**50)
        except InvalidInput as err:
            figures["pib_parked_bytes"] = str(err)
        else:
            raise AssertionError("1 PiB of parked_bytes was taken")
        started = time.monotonic()
        parked = pool.confirm_transition(alice.id, parked_bytes=30 * GIB)  # while NVML still lists the kernel's 30 GiB
        took = time.monotonic() - started
        assert parked.state is LeaseState.SUSPENDED and parked.parked_memory == 30 * GIB
        held = [(u["pid"], u["bytes"], u["why"]) for u in pool.snapshot(admin=True).unpooled if u["device"] == home]
        assert held == [(kernel, 30 * GIB, Pool.PARKED_BUT_HELD)], held
        pool.tick()
        assert pool.get(big.id).state is LeaseState.QUEUED, "60 GiB were granted where the suspended kernel still holds 30 GiB"
        figures["forged_suspend_done"] = (f"taken in {took * 1000:.0f} ms; the 30 GiB NVML still lists stay taken "
                                          "(held, not granted) and the 60 GiB request waits")
        use(kernel, home, 0)  # the real suspend: the driver frees it
        pool.tick()
        assert pool.get(big.id).devices == (home,), "the suspend freed 80 GiB on its GPU: the 60 GiB request goes there"
        use(kernel, home, 15 * GIB)  # a suspended kernel that goes on using its GPU
        seen = watch()
        assert (kernel, "its lease is suspended", alice.id) in [(u["pid"], u["why"], u["lease_id"]) for u in seen], seen
        small = pool.request(LeaseRequest(owner="carol", memory=10 * GIB))
        assert small.devices == (other,), "10 GiB were granted where only 5 GiB are free beside a suspended kernel's use"
        figures["suspended_but_using"] = "seen as 'its lease is suspended'; its 15 GiB not granted"
        waiting = pool.request(LeaseRequest(owner="dave", memory=40 * GIB))
        assert waiting.state is LeaseState.QUEUED
        procs.kill(rogue)  # it exits, and the driver frees its memory with it
        use(rogue, other, 0)
        watch()
        assert pool.get(waiting.id).state is LeaseState.GRANTED and pool.get(waiting.id).devices == (other,)
        figures["exited"] = "its 50 GiB granted to a waiting 40 GiB request at the next watch"
        pool.close()
    finally:
        procs.close()
        if saved is None:
            sys.modules.pop("pynvml", None)
        else:
            sys.modules["pynvml"] = saved
    return figures


def _post(url: str, token: str, body: dict[str, Any]) -> tuple[int, Any]:
    """One JSON POST with a hub token; (status, body)."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def broker_suspend_attacks(workdir: Path, spec: str = "2x16GiB") -> dict[str, Any]:
    """The suspend protocol against a real broker process (``python -m jupyter_gpupool.broker`` on
    a simulated pool, its watchdog on), each kernel a real process whose GPU memory is scripted:

    - forged and replayed reports: a 1 PiB ``parked_bytes`` (400); alice's server reports her
      suspend done while her kernel still holds 12 GiB (taken at once, and bob's 16 GiB request
      waits until her kernel lets go); the same report replayed (answered, unchanged) and replayed
      without its step (400); bob is granted exactly once;
    - a process outside the pool holds 3 GiB: the broker's watchdog lists it and a request that
      needs it waits until it exits;
    - the broker SIGKILLed in the middle of a resume, a suspend and a move (the server carries the
      step out while the broker is down, then reports it to the restarted broker): each step
      finishes, a 'move done' reported early keeps the old GPU's memory taken, and after every restart no GPU is granted more
      than it has, each kernel has one live lease and the parked total is consistent.
    """
    from broker_harness import BrokerProcess, StandInHub, wait_until

    from jupyter_gpupool.backends.local.pool import HOSTNAME
    from jupyter_gpupool.backends.remote import RemotePool

    hub = StandInHub().start()
    tokens = {name: hub.add_user(f"tok-{name}", name, admin=name == "prof") for name in ("alice", "bob", "carol", "prof")}
    config = (
        "c.Broker.run_watchdog = True\nc.Watchdog.interval = 0.3\nc.Watchdog.unpooled_action = 'warn'\n"
        "c.PoolPolicy.heartbeat_ttl = 3600\nc.PoolPolicy.parked_memory_limit = '64GiB'\nc.PoolPolicy.preemption = False\n"
        "c.PoolPolicy.idle_policy = 'never'\nc.PoolPolicy.defragment_min_idle = 1.0\n"
    )
    broker = BrokerProcess(workdir, hub, simulate=spec, config=config)
    procs = _Processes(f"{broker.db}.usage")
    reader = None
    figures: dict[str, Any] = {"broker_kills": 0}
    try:
        broker.start()
        remote = {name: RemotePool(broker.url, token=token, timeout=30) for name, token in tokens.items()}
        reader = Pool(SimulatedBackend.from_spec(spec), broker.db, PoolPolicy(heartbeat_ttl=10**9))
        base = f"{broker.url}/api/gpupool/leases"

        def ask(name: str, gib: int, kernel_id: str | None = None, suspendable: bool = True) -> Lease:
            return remote[name].request(LeaseRequest(owner="", memory=gib * GIB, kernel_id=kernel_id, suspendable=suspendable,
                                                     holder_pid=os.getpid(), holder_host=HOSTNAME))

        def report(name: str, lease_id: str, **body: Any) -> tuple[int, Any]:
            return _post(f"{base}/{lease_id}/transition", tokens[name], {"outcome": "done", **body})

        def kill_and_restart() -> None:
            broker.kill()
            figures["broker_kills"] += 1

        def restarted() -> None:
            broker.start()
            check_pool_file(broker.db, spec, intervals=True)

        # --- forged and replayed reports ---------------------------------------------------------
        alice = ask("alice", 12, "k-alice")
        carol = ask("carol", 16, "k-carol", suspendable=False)
        assert alice.state is carol.state is LeaseState.GRANTED and alice.devices != carol.devices
        kernel = procs.start(alice.id)
        procs.use(kernel, {alice.devices[0]: 12 * GIB})
        remote["alice"].suspend(alice.id)
        status, body = report("alice", alice.id, parked_bytes=2**50)
        assert status == 400 and "more than this lease's GPUs hold" in body["message"], (status, body)
        figures["pib_parked_bytes"] = status
        started = time.monotonic()
        status, done = report("alice", alice.id, transition="suspending", parked_bytes=12 * GIB)  # her kernel still holds 12 GiB
        took = time.monotonic() - started
        assert status == 200 and done["state"] == "suspended" and done["parked_memory"] == 12 * GIB, done
        bob = ask("bob", 16, "k-bob")
        replays = [report("alice", alice.id, transition="suspending", parked_bytes=12 * GIB)[0] for _ in range(2)]
        replays.append(report("alice", alice.id, parked_bytes=12 * GIB)[0])
        time.sleep(1.0)  # several broker ticks and watchdog passes
        assert remote["bob"].get(bob.id).state is LeaseState.QUEUED, "bob was granted memory alice's kernel still holds"
        figures["forged_suspend_done"] = f"200 in {took * 1000:.0f} ms; bob's 16 GiB waited while her kernel held its 12 GiB"
        procs.use(kernel, {})  # her kernel lets go: the memory is freed
        granted = remote["bob"].wait_for_grant(bob.id, timeout=30)
        assert replays == [200, 200, 400], replays
        after = remote["alice"].get(alice.id)
        assert after.state is LeaseState.SUSPENDED and after.parked_memory == 12 * GIB
        assert remote["bob"].get(bob.id).devices == granted.devices, "a replay moved or doubled bob's grant"
        figures["replayed_confirmations"] = replays
        check_pool_file(broker.db, spec, intervals=True)

        # --- a process outside the pool -----------------------------------------------------------
        remote["carol"].release(carol.id)
        free_gpu = carol.devices[0]
        rogue = procs.start()
        procs.use(rogue, {free_gpu: 3 * GIB})
        seen = wait_until(lambda: [u for u in reader.unpooled() if u["pid"] == rogue], timeout=20, what="the broker's watchdog to see pid")
        assert seen[0]["bytes"] == 3 * GIB and seen[0]["why"] == "no lease", seen
        waiting = ask("carol", 16, "k-carol2", suspendable=False)
        time.sleep(0.8)
        assert remote["carol"].get(waiting.id).state is LeaseState.QUEUED, "16 GiB granted beside 3 GiB used outside the pool"
        procs.kill(rogue)
        remote["carol"].wait_for_grant(waiting.id, timeout=30)
        figures["outside_the_pool"] = f"pid {rogue}'s 3 GiB listed by the broker's watchdog; 16 GiB waited until it exited"
        remote["carol"].release(waiting.id)
        remote["bob"].release(bob.id)

        # --- SIGKILL mid-resume --------------------------------------------------------------------
        remote["alice"].resume(alice.id)
        restoring = remote["alice"].wait_for_grant(alice.id, timeout=30)
        assert restoring.transition is Transition.RESTORING
        kill_and_restart()
        procs.use(kernel, {restoring.devices[0]: 12 * GIB})  # the server restores while the broker is down
        restarted()
        status, back = report("alice", alice.id, transition="restoring")
        assert status == 200 and back["state"] == "granted" and back["transition"] == "" and back["parked_memory"] == 0, back
        figures["killed_mid_resume"] = "restored after the restart"

        # --- SIGKILL mid-suspend -------------------------------------------------------------------
        remote["alice"].suspend(alice.id)
        kill_and_restart()
        procs.use(kernel, {})
        restarted()
        status, parked = report("alice", alice.id, transition="suspending", parked_bytes=12 * GIB)
        assert status == 200 and parked["state"] == "suspended" and parked["parked_memory"] == 12 * GIB, parked
        figures["killed_mid_suspend"] = "suspended after the restart"
        remote["alice"].resume(alice.id)
        restoring = remote["alice"].wait_for_grant(alice.id, timeout=30)
        procs.use(kernel, {restoring.devices[0]: 12 * GIB})
        assert report("alice", alice.id, transition="restoring")[0] == 200
        remote["alice"].release(alice.id)
        procs.kill(kernel)
        check_pool_file(broker.db, spec, intervals=True)

        # --- SIGKILL mid-move ----------------------------------------------------------------------
        moving = ask("alice", 8, "k-move")
        filler = ask("carol", 8, "k-fill", suspendable=False)
        other = ask("bob", 8, "k-other", suspendable=False)
        assert filler.devices == moving.devices != other.devices, (moving.devices, filler.devices, other.devices)
        mover = procs.start(moving.id)
        procs.use(mover, {moving.devices[0]: 6 * GIB})
        remote["carol"].release(filler.id)
        time.sleep(1.5)  # the kernel idles past defragment_min_idle
        big = ask("carol", 12, "k-big", suspendable=False)
        assert big.state is LeaseState.QUEUED
        plan = wait_until(lambda: (lease := remote["alice"].get(moving.id)).transition is Transition.MIGRATING and lease,
                          timeout=30, what="the broker to move the idle kernel")
        kill_and_restart()
        restarted()
        status, moved = report("alice", moving.id, transition="migrating")  # while the kernel still holds its old GPU
        assert status == 200 and moved["state"] == "granted" and moved["devices"] == list(plan.devices), moved
        time.sleep(0.8)  # broker ticks and watchdog passes
        assert remote["carol"].get(big.id).state is LeaseState.QUEUED, "12 GiB granted where the moved kernel still held 6 GiB"
        procs.use(mover, {plan.devices[0]: 6 * GIB})  # the move, carried out after the restart: it lets go of the old GPU
        granted_big = remote["carol"].wait_for_grant(big.id, timeout=30)
        assert granted_big.devices == moving.devices, "the room the move made went elsewhere"
        figures["killed_mid_move"] = ("a 'move done' reported early taken (200), the old GPU's 6 GiB kept taken until the "
                                      "kernel let go; the 12 GiB request granted then")
        check_pool_file(broker.db, spec, intervals=True)
        live = [lease for lease in broker.leases(include_released=False)]
        kernels = [lease.kernel_id for lease in live]
        assert len(kernels) == len(set(kernels))
        figures["live_leases_at_end"] = len(live)
    finally:
        if reader is not None:
            reader.close()
        procs.close()
        broker.stop()
        hub.stop()
    return figures


def server_kill_mid_step(workdir: Path, spec: str = "1x16GiB", seed: int = 5, steps: tuple[str, ...] = ("suspend", "resume")) -> dict[str, Any]:
    """SIGKILL a real `jupyter server` (single-user, its own pool file) at a random moment of a
    kernel's suspend, and of its resume: the kernel, whose process held 6 GiB, ends with its
    server; the next pool decision releases its lease with a reason, nothing stays parked, no GPU
    memory is left held by a dead process, and the whole GPU is granted to the next request."""
    from broker_harness import JupyterServer
    from server_process import Server, wait_for

    rng = random.Random(seed)
    figures: dict[str, Any] = {}

    def one(step: str) -> str:
        db = str(workdir / f"{step}.sqlite")
        env: dict[str, str | None] = {"GPUPOOL_SIMULATE": spec, "GPUPOOL_DB": db, "GPUPOOL_DEFAULT_MEMORY": "8GiB",
                                      "GPUPOOL_URL": None, "GPUPOOL_USER": "alice", "GPUPOOL_PARKED_MEMORY_LIMIT": "32GiB"}
        server = Server(workdir, step, env, args=("--GpuPoolExtension.tick_interval=0.25",))
        pool = Pool.from_env(environ={k: v for k, v in env.items() if v is not None}, policy=PoolPolicy(heartbeat_ttl=10**9))
        try:
            kernel = server.call("POST", "api/kernels", {"name": "python3"})["id"]
            wait_for(lambda: server.call("GET", f"api/gpupool/kernels/{kernel}")["state"] == "granted", what="the grant")
            JupyterServer.run_code(server, kernel, "from jupyter_gpupool.devices.simulated import pretend_to_use; pretend_to_use('6GiB')")  # type: ignore[arg-type]
            granted = pool.lease_for_kernel(kernel)
            assert granted is not None
            lease_id = granted.id
            if step == "resume":
                server.call("POST", f"api/gpupool/kernels/{kernel}/suspend")
                wait_for(lambda: pool.get(lease_id).state is LeaseState.SUSPENDED, what="the suspend")
            kernel_pids = [p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)]
            server.call("POST", f"api/gpupool/kernels/{kernel}/{step}")
            delay = rng.uniform(0.0, 0.12)
            time.sleep(delay)
            caught = pool.get(lease_id)
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait()
            wait_for(lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in kernel_pids),
                     timeout=30, what="the killed server's kernel to end")
            pool.tick()
            after = pool.last_lease_for_kernel(kernel)
            assert after is not None and after.state is LeaseState.RELEASED and after.release_reason, after
            assert not pool.leases(), "a lease of the killed server survived"
            assert not [u for u in pool.backend.process_usage() if u.pid in kernel_pids], "a dead kernel still holds GPU memory"
            with pool._viewing(pool.clock()) as (state, _):
                assert state.derived().parked == 0, "parked memory of a released lease still counts"
            whole = pool.request(LeaseRequest(owner="bob", memory=16 * GIB))
            assert whole.state is LeaseState.GRANTED, "the GPU was not whole again"
            pool.release(whole.id)
            check_pool_file(db, spec, intervals=True, ledger=False)
            return (f"killed {delay:.2f} s in ({caught.state.value} {caught.transition.value or 'done'}); "
                    f"then {after.release_reason}")
        finally:
            pool.close()
            server.stop()

    for step in steps:
        figures[f"killed_mid_{step}"] = one(step)
    return figures


# --- the command line ---------------------------------------------------------------------------


#: Every scenario, in the order a run takes them.
SCENARIOS = ("kill_storm", "burst", "device_faults", "server_kill", "soak", "unpooled_nvml", "broker_suspend_attacks",
             "server_kill_mid_step", "suspend_soak")


def run_all(minutes: float, only: tuple[str, ...] = ()) -> dict[str, Any]:
    """Every scenario (or those named in ``only``), sized so the whole run takes about ``minutes``."""
    timed = {"kill_storm": 0.2, "soak": 0.3, "suspend_soak": 0.3}  # share of ``minutes`` in a whole run
    if only:  # the scenarios chosen share all of it: `--only suspend_soak --minutes 10` soaks 10 minutes
        chosen = sum(share for name, share in timed.items() if name in only) or 1.0
        timed = {name: share / chosen for name, share in timed.items()}
    with tempfile.TemporaryDirectory(prefix="gpupool-reliability-") as tmp:
        base = Path(tmp)
        results: dict[str, Any] = {}
        for name, fn in (
            ("kill_storm", lambda d: kill_storm(d, seconds=minutes * 60 * timed["kill_storm"])),
            ("burst", lambda d: burst(d)),
            ("device_faults", device_faults),
            ("server_kill", server_kill),
            ("soak", lambda d: soak(d, seconds=minutes * 60 * timed["soak"])),
            ("unpooled_nvml", unpooled_nvml),
            ("broker_suspend_attacks", broker_suspend_attacks),
            ("server_kill_mid_step", server_kill_mid_step),
            ("suspend_soak", lambda d: suspend_soak(d, seconds=minutes * 60 * timed["suspend_soak"])),
        ):
            if only and name not in only:
                continue
            folder = base / name
            folder.mkdir()
            started = time.monotonic()
            results[name] = fn(folder)
            results[name]["wall_s"] = round(time.monotonic() - started, 1)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run the pool's reliability scenarios and print their figures.")
    parser.add_argument("--minutes", type=float, default=2.0, help="about how long the whole run takes (default 2)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of one line per figure")
    parser.add_argument("--only", action="append", default=[], metavar="SCENARIO",
                        help="run only this scenario (repeatable), e.g. --only suspend_soak")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.only) - set(SCENARIOS))
    if unknown:
        parser.error(f"unknown scenario {', '.join(unknown)}: choose from {', '.join(SCENARIOS)}")
    results = run_all(args.minutes, tuple(args.only))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for scenario, figures in results.items():
            for key, value in figures.items():
                print(f"{scenario:22} {key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
