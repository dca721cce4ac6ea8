"""Random request/release/resize/activity/time sequences on random inventories keep the invariants."""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from pool_helpers import T0

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.engine import Engine, PoolState, held_by_device
from jupyter_gpupool.core.index import excess_per_device, pinned_ceiling
from jupyter_gpupool.core.models import (
    Activity,
    Lease,
    LeaseRequest,
    LeaseState,
    PriorityClass,
    Transition,
    model_matches,
)
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.unpooled import UnpooledUse
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound, RequestRefused
from jupyter_gpupool.units import GIB

USERS = ["ann", "ben", "cat", "dan"]
MAX_QUEUED = 3
#: Inventory items: plain sizes and named models (whose names look alike: A10/A100, L4/L40S, A40/RTX A4000).
GPUS = ["8GiB", "16GiB", "24GiB", "40GiB", "80GiB", "A100-80GB", "A100-40GB", "A10-24GB", "L4", "L40S-48GB", "RTX-A4000-16GB", "A40-48GB"]
MAX_WAIT_AFTER_FREE = 4  # scheduler passes within which a fitting head must be granted


class PoolMachine(RuleBasedStateMachine):
    @initialize(
        gpus=st.lists(st.sampled_from(GPUS), min_size=1, max_size=4),
        overcommit=st.sampled_from([1.0, 1.0, 1.5]),
        idle_policy=st.sampled_from(["pressure", "always", "never"]),
        placement=st.sampled_from(["best-fit", "fgd"]),
        user_max=st.sampled_from([None, 24, 48]),
        reserve=st.sampled_from([None, 8, 16]),
        burst=st.sampled_from(["0", "4x", "4x", "40GiB"]),
    )
    def setup(self, gpus, overcommit, idle_policy, placement, user_max, reserve, burst):
        spec = ",".join(f"1x{g}" for g in gpus)
        self.tmp = tempfile.TemporaryDirectory()
        quotas = {"ann": {"maximum": f"{user_max}GiB", "max_leases": 3}} if user_max else {}
        quotas["cat"] = {"guaranteed": "8GiB"}
        # A window the run's clock passes through: it frees memory for ben while open.
        self.window = (T0 + 600, T0 + 4800)
        reservations = (
            [{"name": "lab", "users": ["ben"], "memory": f"{reserve}GiB", "start": self.window[0], "end": self.window[1]}]
            if reserve
            else []
        )
        policy = PoolPolicy(
            overcommit=overcommit,
            idle_policy=idle_policy,
            idle_timeout=300,
            warning_period=60,
            heartbeat_ttl=10**9,
            placement=placement,
            min_runtime=120,
            grace_period=30,
            aging_interval=600,
            backfill_max_head_wait=900,
            user_quotas=quotas,
            group_quotas={"staff": {"guaranteed": "16GiB"}},
            group_priorities={"staff": "high"},
            max_queued_per_user=MAX_QUEUED,
            parked_memory_limit="48GiB",
            transition_timeout=600,
            defragment_min_idle=60,
            burst=burst,
            burst_settle=15,
        )
        if reserve:
            devices = SimulatedBackend.from_spec(spec).devices()
            if reserve * GIB > sum(int(d.memory_total * overcommit) for d in devices):
                reservations = []
        policy.reservations = reservations
        self.pool = Pool(SimulatedBackend.from_spec(spec), str(Path(self.tmp.name) / "p.sqlite"), policy, clock=lambda: T0)
        self.now = T0
        self.user_max = user_max
        self.ids: list[str] = []

    def teardown(self):
        self.pool.close()
        self.tmp.cleanup()

    @rule(
        user=st.sampled_from(USERS),
        gib=st.sampled_from([1, 2, 4, 8, 12, 20, 40, 100, 150]),
        gpus=st.sampled_from([1, 1, 1, 2]),
        priority=st.sampled_from([None, PriorityClass.BATCH]),
        staff=st.booleans(),
        model=st.sampled_from([None, None, None, "A10", "A100", "A100-80GB", "L4", "A40"]),
        suspendable=st.booleans(),
        kernel=st.sampled_from([None, None, "k1", "k2", "k3"]),
    )
    def request(self, user, gib, gpus, priority, staff, model, suspendable, kernel):
        """A new request; one naming a kernel that has a lease is that kernel asking again (a restart)."""
        try:
            lease = self.pool.request(
                LeaseRequest(
                    owner=user,
                    kernel_id=kernel,
                    memory=gib * GIB,
                    num_gpus=gpus,
                    priority=priority,
                    groups=("staff",) if staff else (),
                    model=model,
                    suspendable=suspendable,
                ),
                now=self.now,
            )
        except RequestRefused:
            return
        if gpus == 1 and lease.num_gpus > 1:  # spanned: the fewest GPUs that hold it, no less than asked
            assert lease.memory * lease.num_gpus >= gib * GIB
        self.ids.append(lease.id)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def release(self, data):
        self.pool.release(data.draw(st.sampled_from(self.ids)), now=self.now)

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), gib=st.sampled_from([1, 4, 16, 64]))
    def resize(self, data, gib):
        lease_id = data.draw(st.sampled_from(self.ids))
        if self.pool.get(lease_id).state is LeaseState.RELEASED:
            return
        try:
            self.pool.resize(lease_id, memory=gib * GIB, now=self.now)
        except (RequestRefused, InvalidInput):
            pass

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), busy=st.booleans(), active_now=st.booleans(), connections=st.sampled_from([0, 1, 2]))
    def activity(self, data, busy, active_now, connections):
        """A report: only the lease's liveness fields change, so the store rewrites only them."""
        last = self.now if active_now and not busy else None
        self.pool.report_activity(data.draw(st.sampled_from(self.ids)), Activity(busy=busy, last_activity=last, connections=connections), now=self.now)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def suspend(self, data):
        try:
            self.pool.suspend(data.draw(st.sampled_from(self.ids)), now=self.now)
        except (RequestRefused, LeaseNotFound):
            pass

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), gib=st.sampled_from([0, 1, 4, 64]))
    def keep_a_pinned_backup(self, data, gib):
        """A server books its kernel's framework backup in the host's pinned parking pool (0: gives it back)."""
        try:
            self.pool.reserve_pinned_backup(data.draw(st.sampled_from(self.ids)), gib * GIB, now=self.now)
        except (RequestRefused, LeaseNotFound):
            pass

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def resume(self, data):
        try:
            self.pool.resume(data.draw(st.sampled_from(self.ids)), now=self.now)
        except LeaseNotFound:
            pass

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), parked_gib=st.sampled_from([0, 1, 8]), fail=st.booleans(), still_running=st.booleans())
    def finish_transition(self, data, parked_gib, fail, still_running):
        """The server's side of a suspend, restore or move: it succeeds, or fails either way."""
        under_way = [l.id for l in self.pool.leases() if l.transition is not Transition.NONE]
        if not under_way:
            return
        lease_id = data.draw(st.sampled_from(under_way))
        if fail:
            self.pool.fail_transition(lease_id, "driver error", still_running=still_running, now=self.now)
        else:
            self.pool.confirm_transition(lease_id, parked_bytes=parked_gib * GIB, now=self.now)

    @rule(data=st.data(), gib=st.sampled_from([0, 1, 6, 30]))
    def outside_the_pool(self, data, gib):
        """The host's watcher sees a process without a lease holding ``gib`` GiB of one GPU (0: it is gone)."""
        device = data.draw(st.sampled_from(self.pool.devices()))
        uses = [UnpooledUse(device=device.uuid, pid=4242, bytes=gib * GIB, host="h", why="no lease")] if gib else []
        self.pool.report_unpooled(uses, reporter="watcher", ttl=10**9, now=self.now)
        self.unpooled = {device.uuid: gib * GIB} if gib else {}
        self.granted_before = {(l.id, l.granted_at) for l in self.pool.leases() if l.state is LeaseState.GRANTED}

    def _granted(self):
        return [lease for lease in self.pool.leases() if lease.state is LeaseState.GRANTED]

    def _check_no_grow_over_a_waiting_request(self, before, in_line=False):
        """A slice that grew did so while no queued request that would fit on its GPUs with every
        slice at its guarantee waited (``in_line``, a grow asked now: none that burst is taken back
        for, which a kernel waiting to grow yields to; a request that does not fit even at
        guarantees waits for a guarantee to end, not for burst)."""
        leases = self.pool.leases()
        queued = [lease for lease in leases if lease.state is LeaseState.QUEUED]
        state = self.pool._load(self.now)
        room = {d.uuid: d.leasable - getattr(self, "unpooled", {}).get(d.uuid, 0) for d in state.devices if d.healthy}
        for held in leases:
            if held.state is LeaseState.GRANTED:
                for uuid in held.devices:
                    if uuid in room:
                        room[uuid] -= held.guarantee_size
        for lease in self._granted():
            if lease.memory > before.get(lease.id, lease.memory):
                for other in queued:
                    if in_line and other.room_coming_at is None:
                        continue
                    candidates = {d.uuid for d in self.pool.engine.placer.lease_candidates(state, other)}
                    fits = [uuid for uuid in candidates & set(lease.devices) if room.get(uuid, 0) >= other.memory]
                    assert not fits, f"{lease.id} grew while {other.id} waited for its GPU"

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), gib=st.sampled_from([0, 1, 3, 6, 14, 30]))
    def use(self, data, gib):
        """The watchdog measures a granted kernel's use: near its size, an elastic slice grows."""
        granted = self._granted()
        if not granted:
            return
        lease = data.draw(st.sampled_from(granted))
        before = {lease.id: lease.memory for lease in granted}
        self.pool.report_usage({lease.id: gib * GIB}, now=self.now)
        self._check_no_grow_over_a_waiting_request(before)

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), gib=st.sampled_from([2, 8, 20, 60]))
    def grow(self, data, gib):
        """A framework cap's allocation failure asks for more."""
        granted = self._granted()
        if not granted:
            return
        lease = data.draw(st.sampled_from(granted))
        before = {lease.id: lease.memory for lease in granted}
        try:
            grown = self.pool.grow(lease.id, gib * GIB, now=self.now)
        except RequestRefused as refusal:
            assert str(refusal).startswith("the slice was not grown")
            return
        assert grown.memory * grown.num_gpus >= min(gib * GIB, grown.memory * grown.num_gpus)
        self._check_no_grow_over_a_waiting_request(before, in_line=True)

    @rule(seconds=st.sampled_from([1, 30, 200, 700, 3600]))
    def advance(self, seconds):
        self.now += seconds
        self.pool.tick(now=self.now)

    @invariant()
    def no_device_overcommitted_and_no_double_grant(self):
        if not hasattr(self, "pool"):
            return
        live = self.pool.leases()
        held = held_by_device(live)
        for device in self.pool.devices():
            assert held.get(device.uuid, 0) <= device.leasable
        for lease in live:
            if lease.state is LeaseState.GRANTED:
                assert len(set(lease.devices)) == lease.num_gpus  # one slice per distinct GPU

    @invariant()
    def guarantees_never_exceed_capacity_and_slices_stay_between_guarantee_and_limit(self):
        """Per GPU the guarantees of granted slices fit (so burst never holds memory someone is
        guaranteed: the current sizes fit too, checked above); each slice is at least its guarantee
        and at most its limit."""
        if not hasattr(self, "pool"):
            return
        guaranteed: dict[str, int] = {}
        for lease in self.pool.leases():
            if lease.state is LeaseState.GRANTED:
                for uuid in (*lease.devices, *lease.migrate_from):
                    guaranteed[uuid] = guaranteed.get(uuid, 0) + lease.guarantee_size
                assert lease.guarantee_size <= lease.memory <= lease.limit_size
            if lease.live:
                assert lease.burst_limit == 0 or lease.burst_limit > lease.guarantee_size
        for device in self.pool.devices():
            assert guaranteed.get(device.uuid, 0) <= device.leasable

    @invariant()
    def a_kernel_waits_to_grow_only_while_it_holds_an_elastic_slice_below_what_it_wants(self):
        """A grow that waits in line (served in place, by a move, or from neighbours' idle burst) is
        a granted elastic slice's, for more than it holds and at most its limit; a neighbour's burst
        is taken back only down to its guarantee (checked above)."""
        if not hasattr(self, "pool"):
            return
        for lease in self.pool.leases():
            if lease.grow_since is None:
                assert lease.grow_wanted == 0
                continue
            assert lease.state is LeaseState.GRANTED and lease.elastic, lease
            assert lease.memory < lease.grow_wanted <= lease.limit_size or lease.transition is not Transition.NONE

    @invariant()
    def nothing_granted_out_of_memory_held_outside_the_pool(self):
        """A device on which a lease was granted (or grew) since unpooled use was seen holds no
        more than its leasable memory less that use."""
        unpooled = getattr(self, "unpooled", {})
        if not hasattr(self, "pool") or not unpooled:
            return
        live = self.pool.leases()
        held = held_by_device(live)
        for device in self.pool.devices():
            newer = [l for l in live if l.state is LeaseState.GRANTED and device.uuid in l.devices
                     and (l.id, l.granted_at) not in self.granted_before]
            if newer and device.uuid in unpooled:
                outside = min(unpooled[device.uuid], device.memory_total)  # no GPU holds more than itself
                assert held.get(device.uuid, 0) + outside <= device.leasable

    @invariant()
    def one_live_lease_per_kernel_and_parked_no_more_than_held(self):
        if not hasattr(self, "pool"):
            return
        live = self.pool.leases()
        kernels = [l.kernel_id for l in live if l.kernel_id]
        assert len(kernels) == len(set(kernels))
        assert sum(l.pinned_backup for l in live) <= self.pool.policy.parking_pool_bytes(None)  # the pinned pool holds
        for lease in live:
            assert lease.parked_memory <= max(lease.memory * lease.num_gpus, lease.peak_memory or 0)
            assert lease.pinned_backup <= pinned_ceiling(lease)  # never more than its kernel may hold now
            if lease.state is LeaseState.RELEASED:
                assert lease.transition is Transition.NONE

    @invariant()
    def model_requests_land_on_their_model(self):
        if not hasattr(self, "pool"):
            return
        devices = {d.uuid: d for d in self.pool.devices()}
        for lease in self.pool.leases():
            if lease.model and lease.state is LeaseState.GRANTED:
                assert all(model_matches(lease.model, devices[u]) for u in lease.devices), (lease.model, lease.devices)

    @invariant()
    def no_user_queues_past_the_cap(self):
        if not hasattr(self, "pool"):
            return
        for user in USERS:
            assert sum(1 for l in self.pool.leases(owner=user) if l.state is LeaseState.QUEUED) <= MAX_QUEUED

    @invariant()
    def lease_cache_is_what_is_committed(self):
        """The store hands the engine its cached leases (copy-on-write): every change must be
        saved in its transaction, so the cache always equals a fresh read of the file."""
        if not hasattr(self, "pool"):
            return
        with self.pool.store.transaction():
            cached = self.pool.store.live_leases()
        committed = {lease.id: lease.to_json() for lease in self.pool.leases()}
        assert {lease_id: lease.to_json() for lease_id, lease in cached.items()} == committed

    @invariant()
    def derived_state_kept_up_to_date_equals_a_full_recomputation(self):
        """Memory held per device, holdings per owner and group, the queue, pending reclaims,
        flags and deadlines — updated lease by lease as decisions go — equal what a scan of
        every live lease (read afresh from the file) gives."""
        if not hasattr(self, "pool") or self.pool._index is None:
            return
        generation, index = self.pool._index
        if generation != self.pool.store.cache_generation:
            return  # stale: the next decision rebuilds it
        live = self.pool.leases()
        held = [l for l in live if l.state is LeaseState.GRANTED]
        others = [l for l in live if l.state not in (LeaseState.QUEUED, LeaseState.RELEASED)]
        owners, groups = {}, {}
        for lease in others:
            held_bytes = lease.memory * lease.num_gpus if lease.state is LeaseState.GRANTED else 0
            for table, key in [(owners, lease.owner), *((groups, g) for g in set(lease.groups))]:
                row = table.setdefault(key, [0, 0])
                row[0] += held_bytes
                row[1] += 1
        beats, ends = {}, {}
        for lease in live:
            if lease.heartbeat_at is None:
                continue
            if lease.holder_pid is None and lease.duration is not None:
                if lease.expected_end is not None:
                    ends[lease.id] = lease.expected_end
            else:
                beats[lease.id] = lease.heartbeat_at
        taken = dict(held_by_device(live))  # each slice, or what its kernel uses above it
        guaranteed: dict[str, int] = {}
        for lease in held:
            for uuid in (*lease.devices, *lease.migrate_from):
                taken[uuid] = taken.get(uuid, 0) + excess_per_device(lease)
                guaranteed[uuid] = guaranteed.get(uuid, 0) + lease.guarantee_size
        expected = {
            "held": {uuid: b for uuid, b in taken.items() if b},
            "guaranteed": {uuid: b for uuid, b in guaranteed.items() if b},
            "owners": {k: tuple(v) for k, v in owners.items()},
            "groups": {k: tuple(v) for k, v in groups.items()},
            "queued": {l.id for l in live if l.state is LeaseState.QUEUED},
            "reclaiming": {l.id for l in held if l.reclaim_at is not None},
            "flagged": sum(1 for l in held if l.flagged),
            "transitions": {l.id: l.transition for l in live if l.transition is not Transition.NONE},
            "parked": sum(l.parked_memory for l in live),
            "pinned": (sum(l.pinned_backup for l in live), sum(max(0, l.pinned_backup - l.parked_memory) for l in live)),
            "kernels": {l.kernel_id: l.id for l in live if l.kernel_id},
            "beats": beats,
            "ends": ends,
            "earliest": (min(beats.values(), default=None), min(ends.values(), default=None)),
        }
        assert index.snapshot() == expected
        for owner in USERS:
            assert self.pool.engine.holdings(PoolState(devices=[], leases={l.id: l for l in live}), owner=owner) == index.holdings(owner=owner)

    @invariant()
    def history_kept_up_to_date_is_what_sqlite_says(self):
        """Usage, typical hold and recent sizes, updated as the pool commits, equal a full re-read."""
        if not hasattr(self, "pool"):
            return
        store, half_life = self.pool.store, self.pool.policy.fair_share_half_life
        with store.transaction():
            store.live_leases()
            kept = store.history(self.now, half_life, max_age=10**9)
        assert kept["usage"] == store.usage(self.now, half_life)
        assert kept["typical_hold"] == store.typical_hold()
        assert sorted(kept["recent"]) == sorted(store.recent_request_sizes())
        assert kept["reservations"] == store.reservations()

    @invariant()
    def quotas_hold(self):
        if not hasattr(self, "pool") or not self.user_max:
            return
        ann = [l for l in self.pool.leases(owner="ann") if l.state is LeaseState.GRANTED]
        # Shrinking never breaks a quota and growing checks it, so the maximum holds at all times.
        assert sum(l.memory * l.num_gpus for l in ann) <= self.user_max * GIB
        assert len(ann) <= 3

    @invariant()
    def queue_follows_policy(self):
        """Class (with aging) first, then fair share, then arrival — checked pair by pair."""
        if not hasattr(self, "pool"):
            return
        order = self.pool.queue(now=self.now)
        engine = self.pool.engine
        with self.pool.store.transaction():
            usage = engine.fair_share_usage(self.pool._load(self.now), self.now)
        for first, second in zip(order, order[1:]):
            r1, r2 = engine.effective_rank(first, self.now), engine.effective_rank(second, self.now)
            assert r1 >= r2
            if r1 == r2 and first.resuming != second.resuming:
                assert first.resuming  # a kernel coming back from a suspend goes first within its class
            elif r1 == r2:
                u1, u2 = usage.get(first.owner, 0.0), usage.get(second.owner, 0.0)
                assert u1 <= u2
                if u1 == u2:
                    assert first.queued_since <= second.queued_since

    @invariant()
    def head_is_granted_when_capacity_frees(self):
        """No starvation: with every other lease released, the head of the queue is granted."""
        if not hasattr(self, "pool"):
            return
        queue = self.pool.queue(now=self.now)
        if not queue:
            return
        # Probe on a copy of the database, so the machine's own run goes on unchanged.
        probe_path = Path(self.tmp.name) / "probe.sqlite"
        copy = sqlite3.connect(probe_path)
        self.pool.store.conn.backup(copy)
        copy.close()
        # With a reservation's window open, the head (if not a member) may wait for its end.
        at = max(self.now, self.window[1]) if self.pool.policy.reservations and self.now < self.window[1] else self.now
        probe = Pool(self.pool.backend, str(probe_path), self.pool.policy, clock=lambda: at)
        probe.report_unpooled([], reporter="watcher", now=at)  # and nothing held outside the pool
        head = queue[0]
        for lease in probe.leases():
            if lease.id != head.id:
                probe.release(lease.id, now=at)
        for step in range(MAX_WAIT_AFTER_FREE):
            if probe.get(head.id).state is LeaseState.GRANTED:
                break
            probe.tick(now=at + step)
        assert probe.get(head.id).state is LeaseState.GRANTED
        probe.store.close()
        probe_path.unlink()


PoolMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPoolInvariants = PoolMachine.TestCase


# --- the engine against a driver whose processes hold memory ------------------------------------------
class Driver:
    """The driver as the engine's port sees it (:class:`~jupyter_gpupool.core.engine.DriverPort`),
    played by processes: each kernel's process holds memory on GPUs; it allocates only within its
    slice and where the GPU physically has room, and lets go only when it chooses to (a kernel
    slow to exit, caches freed late, a restore or move done in steps). Some processes cannot be
    traced to their lease (attribution fails): their memory is nobody's, never free."""

    def __init__(self, devices: dict[str, int]) -> None:
        self.capacity = devices  # uuid → bytes
        #: pid → [lease id it runs for ("" once its lease forgot it), traced, {uuid: bytes}]
        self.procs: dict[int, list] = {}
        self.of_lease: dict[str, int] = {}  # lease id → its kernel's current process
        self.next_pid = 100

    def spawn(self, lease_id: str, traced: bool) -> int:
        self.next_pid += 1
        self.procs[self.next_pid] = [lease_id, traced, {}]
        self.of_lease[lease_id] = self.next_pid
        return self.next_pid

    def used(self, uuid: str) -> int:
        return sum(held.get(uuid, 0) for _, _, held in self.procs.values())

    def holdings(self, lease: Lease) -> list[tuple[int, str, int]]:
        devices = (*lease.devices, *lease.migrate_from)
        return [(pid, uuid, amount) for pid, (owner, traced, held) in self.procs.items() if owner == lease.id and traced
                for uuid, amount in held.items() if uuid in devices and amount]

    def held(self) -> dict[str, dict[str, int]]:
        rows: dict[str, dict[str, int]] = {}
        for owner, traced, held in self.procs.values():
            for uuid, amount in held.items():
                if amount:
                    who = owner if traced else ""
                    rows.setdefault(uuid, {})[who] = rows.setdefault(uuid, {}).get(who, 0) + amount
        return rows


class EngineWithProcesses(RuleBasedStateMachine):
    """Every path that lowers what a lease holds (release, shrink, ask again, suspend and its
    confirmation, failed or timed-out transitions, moves, burst taken back) against processes
    that keep holding memory: after every step, per GPU, the slices granted plus what processes
    hold outside them fit in the GPU."""

    @initialize(
        gpus=st.lists(st.sampled_from([16, 24, 80]), min_size=1, max_size=3),
        burst=st.sampled_from(["0", "4x", "16GiB"]),
        idle_policy=st.sampled_from(["pressure", "always"]),
    )
    def setup(self, gpus, burst, idle_policy):
        backend = SimulatedBackend.from_spec(",".join(f"1x{g}GiB" for g in gpus))
        self.engine = Engine(PoolPolicy(
            idle_policy=idle_policy, idle_timeout=300, warning_period=60, heartbeat_ttl=10**9, min_runtime=120,
            grace_period=30, burst=burst, burst_settle=15, transition_timeout=600, defragment_min_idle=60,
            parked_memory_limit="200GiB", max_queued_per_user=MAX_QUEUED,
        ))
        devices = backend.devices()
        self.driver = Driver({d.uuid: d.memory_total for d in devices})
        self.state = PoolState(devices=devices, leases={}, driver=self.driver, host_memory=512 * GIB)
        self.now = T0
        self.count = 0
        self.kernels: dict[str, str] = {}  # kernel id → lease id

    def _decide(self, action) -> None:
        """One decision, as the pool makes it: the action, then a scheduling pass; refusals change nothing."""
        self.state.now = self.now
        before = {lease_id: lease.copy() for lease_id, lease in self.state.leases.items()}
        try:
            action()
        except (RequestRefused, InvalidInput, LeaseNotFound):
            self.state.leases = before  # the pool's transaction rolls back
            self.state.index = None
        self.engine.schedule(self.state, self.now)
        for lease_id in [i for i, lease in self.state.leases.items() if lease.state is LeaseState.RELEASED]:
            del self.state.leases[lease_id]  # the store keeps only live leases
        self.state.released.clear()
        self.state.closed_intervals.clear()
        self.state.released_holdings.clear()
        self.state.unpooled = {}
        self._processes_follow()

    def _processes_follow(self) -> None:
        """Each live lease's kernel has a process; a lease gone or asked again leaves its old one behind."""
        live = {lease.id for lease in self.state.leases.values()}
        for proc in self.driver.procs.values():
            if proc[0] and proc[0] not in live:
                proc[0] = ""  # its lease is gone: nobody's, until it exits
        for lease in self.state.leases.values():
            if lease.id not in self.driver.of_lease or self.driver.procs.get(self.driver.of_lease[lease.id], [""])[0] != lease.id:
                self.driver.spawn(lease.id, traced=self.count % 5 != 0)

    def _lease(self, data) -> Lease | None:
        live = sorted(self.state.leases)
        return self.state.leases[data.draw(st.sampled_from(live))] if live else None

    @rule(user=st.sampled_from(USERS), gib=st.sampled_from([1, 2, 4, 8, 12, 20]), kernel=st.sampled_from([None, "k1", "k2", "k3"]),
          suspendable=st.booleans())
    def request(self, user, gib, kernel, suspendable):
        """A request; one naming a kernel with a live lease asks again (its restart): the old process stays behind."""
        self.count += 1
        lease_id = f"l{self.count}"
        earlier = self.kernels.get(kernel or "")
        pid = None
        if earlier in self.state.leases and self.state.leases[earlier].owner == user:
            pid = self.driver.of_lease.pop(earlier, None)
            if pid is not None:
                self.driver.procs[pid][0] = ""  # the restarted kernel's old process, still exiting
        request = LeaseRequest(owner=user, memory=gib * GIB, kernel_id=kernel, suspendable=suspendable)

        def admit() -> None:
            try:
                lease = self.engine.admit(self.state, lease_id, request, self.now)
            except (RequestRefused, InvalidInput, LeaseNotFound):
                if pid is not None and earlier is not None:  # refused: no restart, the process is still its lease's
                    self.driver.procs[pid][0] = earlier
                    self.driver.of_lease[earlier] = pid
                raise
            if kernel:
                self.kernels[kernel] = lease.id

        self._decide(admit)

    @rule(data=st.data())
    def release(self, data):
        lease = self._lease(data)
        if lease is not None:
            self._decide(lambda: self.engine.release(self.state, lease.id, "released", self.now))

    @rule(data=st.data(), gib=st.sampled_from([1, 2, 4, 12, 20]), limit=st.sampled_from([None, None, 0, 40]))
    def resize(self, data, gib, limit):
        lease = self._lease(data)
        if lease is not None:
            self._decide(lambda: self.engine.resize(self.state, lease.id, gib * GIB, self.now, limit=None if limit is None else limit * GIB))

    @rule(data=st.data(), gib=st.sampled_from([4, 16, 40]))
    def grow(self, data, gib):
        lease = self._lease(data)
        if lease is not None:
            self._decide(lambda: self.engine.grow(self.state, lease.id, gib * GIB, self.now))

    @rule(data=st.data())
    def suspend(self, data):
        lease = self._lease(data)
        if lease is not None:
            self._decide(lambda: self.engine.suspend(self.state, lease.id, "suspended", self.now))

    @rule(data=st.data())
    def resume(self, data):
        lease = self._lease(data)
        if lease is not None:
            self._decide(lambda: self.engine.resume(self.state, lease.id, self.now))

    @rule(data=st.data(), outcome=st.sampled_from(["done", "done", "failed", "failed-running"]))
    def finish_transition(self, data, outcome):
        """The server's report, at once: whatever the driver still shows stays taken."""
        under_way = sorted(i for i, lease in self.state.leases.items() if lease.transition is not Transition.NONE)
        if not under_way:
            return
        lease_id = data.draw(st.sampled_from(under_way))
        if outcome == "done":
            self._decide(lambda: self.engine.confirm_transition(self.state, lease_id, self.now))
        else:
            self._decide(lambda: self.engine.fail_transition(self.state, lease_id, "driver error", outcome == "failed-running", self.now))

    @rule(data=st.data(), share=st.sampled_from([0.25, 0.5, 1.0, 1.0]))
    def allocate(self, data, share):
        """A granted kernel's process allocates within its slice, where the GPU physically has room."""
        lease = self._lease(data)
        if lease is None or lease.state is not LeaseState.GRANTED or lease.id not in self.driver.of_lease:
            return
        held = self.driver.procs[self.driver.of_lease[lease.id]][2]
        for uuid in lease.devices:
            want = int(lease.memory * share)
            room = self.driver.capacity[uuid] - self.driver.used(uuid) + held.get(uuid, 0)
            held[uuid] = max(held.get(uuid, 0), min(want, room))

    @rule(data=st.data(), keep=st.sampled_from([0.0, 0.0, 0.5]))
    def let_go(self, data, keep):
        """A process frees memory (``keep``: the share it keeps), or exits when its lease forgot it."""
        pids = sorted(self.driver.procs)
        if not pids:
            return
        pid = data.draw(st.sampled_from(pids))
        owner, _, held = self.driver.procs[pid]
        if not owner and keep == 0.0:
            del self.driver.procs[pid]
            return
        lease = self.state.leases.get(owner)
        for uuid in list(held):
            if lease is None or lease.state is not LeaseState.GRANTED or uuid not in lease.devices:
                held[uuid] = int(held[uuid] * keep)
            else:
                held[uuid] = min(held[uuid], max(int(held[uuid] * keep), lease.memory))

    @rule()
    def watch(self):
        """The watchdog's look: each granted lease's use, as the driver shows its processes."""
        usage = {lease.id: sum(amount for _, _, amount in self.driver.holdings(lease))
                 for lease in self.state.leases.values() if lease.state is LeaseState.GRANTED}
        self._decide(lambda: self.engine.report_usage(self.state, usage, self.now))

    @rule(seconds=st.sampled_from([1, 20, 200, 700]))
    def advance(self, seconds):
        self.now += seconds
        self._decide(lambda: None)

    @invariant()
    def granted_plus_held_outside_fits(self):
        """Per GPU: the slices granted, plus what processes hold above their lease's slice there or
        outside any granted lease (a released, restarted, shrunk, parked or moved kernel's), fit."""
        if not hasattr(self, "state"):
            return
        STEPS[0] += 1
        for uuid, capacity in self.driver.capacity.items():
            granted = 0
            inside: dict[str, int] = {}
            for lease in self.state.leases.values():
                if lease.state is LeaseState.GRANTED and uuid in (*lease.devices, *lease.migrate_from):
                    granted += lease.memory
                    inside[lease.id] = lease.memory
            outside = 0
            by_lease: dict[str, int] = {}
            for owner, _, held in self.driver.procs.values():
                amount = held.get(uuid, 0)
                if owner in inside:
                    by_lease[owner] = by_lease.get(owner, 0) + amount
                else:
                    outside += amount
            outside += sum(max(0, amount - inside[owner]) for owner, amount in by_lease.items())
            assert granted + outside <= capacity, (uuid, granted, outside, capacity)

    @invariant()
    def derived_state_is_a_recomputation(self):
        if hasattr(self, "state"):
            from jupyter_gpupool.core.index import LeaseIndex

            assert self.state.derived().snapshot() == LeaseIndex(self.state.leases.values()).snapshot()


#: Steps checked in a run of the machine above (its invariants run after each).
STEPS = [0]


def test_the_engine_frees_only_what_the_driver_shows_free_over_5000_random_steps():
    STEPS[0] = 0
    run_state_machine_as_test(EngineWithProcesses, settings=settings(
        max_examples=150, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    ))
    assert STEPS[0] >= 5000, f"only {STEPS[0]} steps were checked"
