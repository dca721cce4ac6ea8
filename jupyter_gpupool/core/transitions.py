"""Transitions of a running kernel's GPU memory: suspend (park in host RAM), resume, live moves
between GPUs (to make room, or to grow), their confirmation, failure and timeout, and the
host-RAM budget that bounds them."""

from __future__ import annotations

from collections.abc import Mapping

from jupyter_gpupool.core.accounting import Accounting
from jupyter_gpupool.core.capacity import free_by_device, free_with_room_on_its_way
from jupyter_gpupool.core.index import park_size, pinned_beside_park, pinned_ceiling
from jupyter_gpupool.core.models import Decision, DecisionKind, Lease, LeaseState, Transition
from jupyter_gpupool.core.placer import Placer
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.state import PoolState, decision
from jupyter_gpupool.errors import InvalidInput, RequestRefused
from jupyter_gpupool.units import format_duration, format_size


class Transitions:
    """Suspends, resumes and moves kernels' GPU memory, in two phases each."""

    def __init__(self, policy: PoolPolicy, *,
                 placer: Placer, accounting: Accounting) -> None:
        self.policy = policy
        self.placer = placer
        self.accounting = accounting

    def parked_budget(self, state: PoolState) -> int:
        """Bytes of host RAM parked slices may take together."""
        return self.policy.parked_budget(state.host_memory)

    def idle_timeout(self, state: PoolState, lease: Lease) -> float:
        """Idle time before ``lease`` may be reclaimed: the policy's suspend idle timeout where the
        reclaim would suspend it now, else its idle timeout (a cull)."""
        return self.policy.idle_timeout_for(not self.suspend_refusal(state, lease))

    def suspend_refusal(self, state: PoolState, lease: Lease) -> str:
        """Why ``lease`` cannot be suspended now (one clause for the user), or ``""`` if it can."""
        if self.policy.reclaim_action != "suspend":
            return "the pool's reclaim action is cull"
        if not lease.suspendable:
            return "its server cannot park GPU memory (no checkpoint support there)"
        if lease.state is not LeaseState.GRANTED or lease.transition is not Transition.NONE:
            return "it is not running on a GPU right now" if lease.state is not LeaseState.GRANTED else f"it is {lease.transition.value}"
        if lease.flagged:
            return f"its GPU is unusable ({lease.flagged})"
        budget = self.parked_budget(state)
        index = state.derived()
        parked = index.parked
        needed = park_size(lease)
        # Pinned backups beyond the parks that hold them; this one's becomes its park, all that does not fit in it stays beside.
        kept = index.pinned_kept - pinned_beside_park(lease) + max(0, lease.pinned_backup - needed)
        if parked + needed + kept > budget:
            beside = f" beside {format_size(kept)} of pinned backups running kernels keep" if kept else ""
            return (
                f"parked slices would take {format_size(parked + needed)} of host RAM{beside}, over the limit of "
                f"{format_size(budget)} (parked_memory_limit)"
            )
        return ""

    def reserve_pinned_backup(self, state: PoolState, lease_id: str, amount: int, now: float) -> Lease:
        """Set aside ``amount`` bytes of the host's pinned parking pool for this lease's framework
        backup (its holder's server asks before a fast park; a repeat sets its own figure, 0 gives it
        back). Raises :class:`RequestRefused` saying why when the pool or the parked-memory budget
        has no room, or the figure is more than the kernel may hold on its GPUs; nothing changes then."""
        lease = self.accounting.get(state, lease_id)
        if lease.state is LeaseState.RELEASED:
            raise RequestRefused("cannot keep a pinned backup: the lease was released")
        amount = max(0, int(amount))
        # What its kernel may hold now (its slice's current size, or its measured use), or has parked: never more.
        ceiling = pinned_ceiling(lease)
        if amount > ceiling:
            raise RequestRefused(
                f"a pinned backup of {format_size(amount)} is more than this kernel may hold on its GPUs "
                f"({format_size(ceiling)}); nothing was set aside"
            )
        index = state.derived()
        capacity = self.policy.parking_pool_bytes(state.host_memory)
        if amount > lease.pinned_backup:
            if lease.state is not LeaseState.GRANTED:
                raise RequestRefused(f"cannot set a pinned backup aside: the kernel is {lease.state.value}, not running on a GPU")
            if not lease.suspendable:  # nothing would ever be parked into it: it would only keep others from parking
                raise RequestRefused("cannot set a pinned backup aside: its server cannot park GPU memory (no checkpoint support there)")
            others = index.pinned - lease.pinned_backup
            if not capacity:
                raise RequestRefused("the pool has no pinned parking pool (parking_pool_size is 0, or no parked-memory budget)")
            if others + amount > capacity:
                raise RequestRefused(
                    f"the host's pinned parking pool has {format_size(max(0, capacity - others))} free of "
                    f"{format_size(capacity)}, and this kernel's backup needs {format_size(amount)}"
                )
            budget = self.parked_budget(state)
            kept = index.pinned_kept - pinned_beside_park(lease)
            if lease.parked_memory:  # being parked or restored: what exceeds its park is host RAM beside it
                parked, kept = index.parked, kept + max(0, amount - lease.parked_memory)
            else:  # running: its backup takes host RAM as a park does
                parked = index.parked + amount
            if parked + kept > budget:
                raise RequestRefused(
                    f"parked slices ({format_size(parked)}) and the pinned backups running kernels keep "
                    f"({format_size(kept)}) would take more than the parked-memory budget of {format_size(budget)} "
                    "(parked_memory_limit)"
                )
        if amount != lease.pinned_backup:
            lease.pinned_backup = amount
            state.touch(lease)
        return lease

    def suspend(self, state: PoolState, lease_id: str, reason: str, now: float) -> Decision:
        """Ask the holder's server to park this lease's GPU memory (a user's or an admin's wish);
        raises :class:`RequestRefused` saying why when it cannot be."""
        lease = self.accounting.get(state, lease_id)
        state.read_use(lease)  # judged at what the GPU shows now
        why_not = self.suspend_refusal(state, lease)
        if why_not:
            raise RequestRefused(f"cannot suspend this kernel: {why_not}")
        return self.begin_suspend(state, lease, reason, now)

    def begin_suspend(self, state: PoolState, lease: Lease, reason: str, now: float) -> Decision:
        """Phase one of a suspend: the lease still holds its GPU memory until the server confirms.
        Booked at no less than what the driver shows its kernel holding as it begins."""
        state.read_use(lease)
        lease.transition = Transition.SUSPENDING
        lease.transition_at = now
        lease.suspend_reason = reason
        lease.grow_wanted, lease.grow_since = 0, None  # parked, it wants nothing; back on a GPU it asks again
        lease.used_at_suspend = lease.used_memory or 0  # the GPU's word, before the server's: the floor of its report
        lease.parked_memory = park_size(lease)  # set aside now; the real figure on confirm
        lease.warned_at = lease.reclaim_at = None
        lease.reclaim_reason = ""
        state.touch(lease)
        return decision(DecisionKind.SUSPEND, lease, reason, now)

    def resume(self, state: PoolState, lease_id: str, now: float, ahead: bool = False) -> Lease:
        """Queue a suspended lease to come back (its next cell, a Resume button). Harmless on a lease
        that is already queued to resume, being restored, or running. ``ahead``: asked before any
        cell needs it (the notebook got focus), so it waits behind every real request; a real ask
        later makes it a real one."""
        lease = self.accounting.get(state, lease_id)
        if lease.state is LeaseState.SUSPENDED:
            lease.state = LeaseState.QUEUED
            lease.resuming = True
            lease.resume_asked_at = now
            lease.resume_ahead = ahead
            state.touch(lease)
        elif lease.resume_ahead and not ahead and lease.state is LeaseState.QUEUED:
            lease.resume_ahead = False
            state.touch(lease)
        return lease

    def confirm_transition(self, state: PoolState, lease_id: str, now: float, parked_bytes: int | None = None) -> Lease:
        """Phase two: the server finished the suspend (``parked_bytes`` now in host RAM), the
        restore or the move. Raises :class:`InvalidInput` if nothing was under way."""
        lease = self.accounting.get(state, lease_id)
        step = lease.transition
        if step is Transition.SUSPENDING and parked_bytes is not None:
            parked_bytes = self.bounded_parked_bytes(state, lease, parked_bytes)
        if step is Transition.SUSPENDING:
            # Metering: the granted interval ends here; a resume opens a new one.
            self.accounting.count_unwritten_busy_time(lease, now)
            state.closed_intervals.append(lease.copy(released_at=now))
            lease.state = LeaseState.SUSPENDED
            lease.home_devices = lease.devices
            known = {d.uuid: d for d in state.devices}
            lease.home_model = next((known[u].model for u in lease.devices if u in known), lease.home_model)
            lease.devices = ()
            lease.parked_memory = max(0, int(parked_bytes)) if parked_bytes is not None else lease.parked_memory
            lease.suspended_at = now
            lease.suspensions += 1
            lease.busy = False
            lease.memory_history = ()
            lease.active_seconds = 0.0  # the closed interval carries it: a resumed one starts again
            lease.used_memory = lease.over_limit_since = None  # it holds no GPU memory: no stale over-limit mark
            # ...and no burst still to give back: restored, it is a slice at its size again, not one to suspend at once
            lease.burst_taken_at, lease.burst_from = None, 0
        elif step is Transition.RESTORING:
            lease.restore_failures = 0
            if lease.suspended_at is not None:
                lease.parked_seconds += max(0.0, now - lease.suspended_at)
            lease.suspended_at = None
            lease.parked_memory = 0
            lease.home_devices = ()
            lease.suspend_reason = ""
            lease.last_activity = now
        elif step is Transition.MIGRATING:
            lease.migrate_from = ()
            lease.parked_memory = 0
            lease.suspend_reason = ""
        else:
            raise InvalidInput(f"lease {lease_id} is not being suspended, restored or moved")
        lease.transition = Transition.NONE
        lease.transition_at = None
        state.touch(lease)
        return lease

    @staticmethod
    def bounded_parked_bytes(state: PoolState, lease: Lease, parked_bytes: int) -> int:
        """What a suspend report may say was parked: never more than the lease held (its slice, or
        the most the watchdog saw it use), never less than the watchdog measured its kernel holding
        when the suspend began (a server cannot report its way under the host-RAM budget). A
        figure its GPUs could not even hold is refused."""
        known = {d.uuid: d.memory_total for d in state.devices}
        capacity = sum(known.get(uuid, 0) for uuid in lease.devices) or lease.memory * lease.num_gpus
        if parked_bytes > capacity:
            raise InvalidInput(
                f"parked_bytes {parked_bytes} is more than this lease's GPUs hold ({format_size(capacity)}); "
                "report the bytes the suspend copied to host RAM"
            )
        reported = min(max(0, int(parked_bytes)), max(lease.memory * lease.num_gpus, lease.peak_memory or 0))
        return max(reported, lease.used_at_suspend)

    def fail_transition(self, state: PoolState, lease_id: str, error: str, still_running: bool, now: float) -> list[Decision]:
        """The server could not finish a suspend, restore or move (``error``: why, one line).
        ``still_running``: the kernel is as it was before (a checkpoint that failed and was undone, or a
        restore that failed with the memory still parked).

        A failed suspend for a reclaim falls back to culling; one the user asked for is called off;
        a failed move is called off; a restore that failed with the memory still parked goes back to
        suspended once (the next try restores it). A second restore failure in a row, or anything
        that left the kernel broken, stops it: its lease is released (and nothing is counted twice).
        """
        lease = self.accounting.get(state, lease_id)
        step = lease.transition
        if step is Transition.NONE:
            raise InvalidInput(f"lease {lease_id} is not being suspended, restored or moved")
        if still_running and step is Transition.SUSPENDING and lease.suspend_reason.startswith(("reclaimed", "preempted")):
            kind = DecisionKind.PREEMPT if lease.suspend_reason.startswith("preempted") else DecisionKind.RECLAIM_IDLE
            reason = f"{lease.suspend_reason} (suspending failed: {error}; so the kernel was shut down)"
            self.accounting.release(state, lease_id, reason, now)
            return [decision(kind, lease, reason, now)]
        if still_running and step is Transition.RESTORING and lease.restore_failures < 1:
            # The memory is still parked, intact: back to suspended; the next cell (or Resume) tries again.
            state.closed_intervals.append(lease.copy(released_at=now))  # granted for the try: metered
            lease.state = LeaseState.SUSPENDED
            lease.devices = ()
            lease.transition = Transition.NONE
            lease.transition_at = None
            lease.restore_failures += 1
            lease.suspend_reason = f"restoring failed ({error}); it stays suspended and the next try restores it"
            lease.memory_history = ()
            state.touch(lease)
            return []
        if still_running and step in (Transition.SUSPENDING, Transition.MIGRATING):
            if step is Transition.MIGRATING:
                lease.devices, lease.migrate_from = lease.migrate_from, ()
            lease.transition = Transition.NONE
            lease.transition_at = None
            lease.parked_memory = 0
            lease.suspend_reason = ""
            state.touch(lease)
            return []
        what = {Transition.SUSPENDING: "suspending", Transition.RESTORING: "restoring", Transition.MIGRATING: "moving"}[step]
        reason = f"stopped: {what} its GPU memory failed ({error})"
        self.accounting.release(state, lease_id, reason, now)
        return [decision(DecisionKind.RELEASE, lease, reason, now)]

    def expire_transitions(self, state: PoolState, now: float) -> list[Decision]:
        """Give up on suspends, restores and moves that took longer than ``transition_timeout``."""
        index = state.derived()
        if not index.transitions:
            return []
        decisions: list[Decision] = []
        limit = self.policy.transition_timeout
        for lease_id, step in list(index.transitions.items()):
            lease = state.leases[lease_id]
            started = lease.transition_at if lease.transition_at is not None else now
            if now - started <= limit:
                continue
            error = f"it did not finish within {format_duration(limit)}"
            decisions += self.fail_transition(state, lease_id, error, still_running=step is Transition.SUSPENDING, now=now)
        return decisions

    def plan_defragmentation(self, state: PoolState, head: Lease, now: float) -> list[Decision]:
        """Make room for ``head`` by moving idle, suspendable kernels off one GPU onto others of the
        same model (suspend there, restore here), when that alone lets it fit. One plan at a time."""
        index = state.derived()
        if not self.policy.defragment or head.num_gpus != 1 or self.policy.reclaim_action != "suspend":
            return []
        if any(step is Transition.MIGRATING for step in index.transitions.values()):
            return []  # a move is under way: its room is coming
        free = free_with_room_on_its_way(state, head, now, self.policy.burst_settle)
        if self.placer.place(state, head, free) is not None:
            return []
        movable = [
            lease
            for lease in state.leases.values()
            if lease.state is LeaseState.GRANTED
            and lease.num_gpus == 1
            and lease.reclaim_at is None
            and self.accounting.still_idle(lease, now)
            and lease.idle_seconds(now) >= self.policy.defragment_min_idle
            and not self.suspend_refusal(state, lease)
        ]
        if not movable:
            return []
        known = {d.uuid: d for d in state.devices if d.healthy}
        budget_left = self.parked_budget(state) - index.parked
        targets = sorted(self.placer.lease_candidates(state, head), key=lambda d: head.memory - free.get(d.uuid, 0))
        for device in targets:
            missing = head.memory - free.get(device.uuid, 0)
            if device.leasable < head.memory or missing <= 0:
                continue
            room = {u: f for u, f in free_by_device(state, None, reservations=False).items() if u != device.uuid and u in known}
            plan: list[tuple[Lease, str]] = []
            gained = 0
            parked = 0
            for lease in sorted((m for m in movable if m.devices == (device.uuid,)), key=lambda m: -m.memory):
                fits = [(f, u) for u, f in room.items() if f >= lease.memory and known[u].model == device.model]
                if not fits or parked + park_size(lease) > budget_left:
                    continue
                _, target = min(fits)  # the tightest GPU that takes it
                room[target] -= lease.memory
                plan.append((lease, target))
                gained += lease.memory
                parked += park_size(lease)
                if gained >= missing:
                    break
            if gained < missing:
                continue
            decisions = []
            for lease, target in plan:
                lease.transition = Transition.MIGRATING
                lease.transition_at = now
                lease.migrate_from = lease.devices
                lease.devices = (target,)
                lease.parked_memory = park_size(lease)  # passes through host RAM
                lease.suspend_reason = f"moved to another GPU to make room for {format_size(head.memory)} for {head.owner}"
                state.touch(lease)
                decisions.append(decision(DecisionKind.MIGRATE, lease, lease.suspend_reason, now))
            return decisions
        return []

    def move_to_grow(self, state: PoolState, lease: Lease, wanted: int, free: Mapping[str, int], now: float) -> Decision | None:
        """A MIGRATE of ``lease`` to the tightest GPU of its model with ``wanted`` bytes free, or None."""
        if lease.num_gpus != 1 or not self.policy.defragment or self.suspend_refusal(state, lease):
            return None
        home = lease.devices[0]
        known = {d.uuid: d for d in state.devices if d.healthy}
        model = known[home].model if home in known else None
        fits = [(room, uuid) for uuid, room in free.items() if uuid != home and uuid in known and known[uuid].model == model and room >= wanted]
        if model is None or not fits:
            return None
        _, target = min(fits)
        lease.transition = Transition.MIGRATING
        lease.transition_at = now
        lease.migrate_from = lease.devices
        lease.devices = (target,)
        lease.parked_memory = park_size(lease)  # passes through host RAM
        lease.suspend_reason = f"moved to another GPU with room for its slice to grow to {format_size(wanted)}"
        state.touch(lease)
        return decision(DecisionKind.MIGRATE, lease, lease.suspend_reason, now)
