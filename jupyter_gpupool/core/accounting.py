"""A lease's books: heartbeats and activity reports, busy time, keeps, lost GPUs, expiry and release."""

from __future__ import annotations

from jupyter_gpupool.core.models import Activity, Decision, DecisionKind, Lease, LeaseState, Transition
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.core.state import HELD_STATES, PoolState, decision
from jupyter_gpupool.errors import InvalidInput, LeaseNotFound
from jupyter_gpupool.units import format_duration


class Accounting:
    """Keeps each lease's books: liveness, activity, busy time, expiry and release."""

    def __init__(self, policy: PoolPolicy) -> None:
        self.policy = policy

    def expire_heartbeats(self, state: PoolState, now: float) -> list[Decision]:
        if state.derived().nothing_expires(now, self.policy.heartbeat_ttl):
            return []
        decisions = []
        for lease in list(state.leases.values()):
            if lease.state is LeaseState.RELEASED or lease.heartbeat_at is None:
                continue
            if lease.holder_pid is None and lease.duration is not None:
                # A booked slice (CLI, API) with no process behind it lasts its duration.
                if lease.expected_end is not None and lease.expected_end <= now:
                    reason = f"released: its time ({format_duration(lease.duration)}) is over"
                    self.release(state, lease.id, reason, now)
                    decisions.append(decision(DecisionKind.RELEASE, lease, reason, now))
                continue
            if now - lease.heartbeat_at > self.policy.heartbeat_ttl:
                reason = f"released: its holder sent no heartbeat for {format_duration(now - lease.heartbeat_at)}"
                self.release(state, lease.id, reason, now)
                decisions.append(decision(DecisionKind.RELEASE, lease, reason, now))
        return decisions

    def flag_unhealthy(self, state: PoolState) -> None:
        """Flag held leases whose GPU is unhealthy or gone from the inventory (a MIG instance the
        admin destroyed, a GPU that vanished): their users are told, the lease is never moved."""
        index = state.derived()
        if not index.flagged and {d.uuid for d in state.devices if d.healthy}.issuperset(index.held):
            return  # no held lease is flagged, and every GPU a lease holds is here and healthy
        lost = {d.uuid: d.health_reason or "GPU unhealthy" for d in state.devices if not d.healthy}
        present = {d.uuid for d in state.devices}
        gone = "GPU or MIG instance no longer present (the admin changed the layout, or the GPU fell off the bus)"
        for lease in state.leases.values():
            if lease.state in HELD_STATES:
                flag = "; ".join(lost.get(u, gone) for u in lease.devices if u in lost or u not in present)
                if flag != lease.flagged:
                    lease.flagged = flag
                    state.touch(lease)

    def still_idle(self, lease: Lease, now: float) -> bool:
        if lease.busy:
            return False
        if lease.keep_until is not None and lease.keep_until > now:
            return False
        # Active again since the warning: the warning no longer stands.
        return not (lease.warned_at is not None and lease.last_activity is not None and lease.last_activity > lease.warned_at)

    def grace_after_outage(self, state: PoolState, now: float) -> int:
        """After the pool could not be reached (a broker restart): every live lease gets a fresh
        heartbeat, warnings whose deadline passed or is near start over (their users could not
        answer them), and suspends, restores and moves under way get a full ``transition_timeout``.
        Returns how many leases were touched."""
        for lease in state.leases.values():
            lease.heartbeat_at = now
            if lease.reclaim_at is not None:
                period = self.policy.grace_period if lease.reclaim_reason.startswith("preempt") else self.policy.warning_period
                if lease.reclaim_at < now + period:
                    lease.warned_at = now
                    lease.reclaim_at = now + period
            if lease.transition is not Transition.NONE:
                lease.transition_at = now
            state.touch(lease)
        return len(state.leases)

    def get(self, state: PoolState, lease_id: str) -> Lease:
        lease = state.leases.get(lease_id)
        if lease is None:
            raise LeaseNotFound(f"no live lease {lease_id!r}; list them with `jupyter gpupool leases`")
        return lease

    def release(self, state: PoolState, lease_id: str, reason: str, now: float) -> Lease:
        lease = self.get(state, lease_id)
        self.count_unwritten_busy_time(lease, now)
        # Only a granted interval is metered here: a suspended (or queued to resume) lease's was
        # closed when it was suspended, and billing it again up to now would count the parked time.
        metered = lease.state is LeaseState.GRANTED
        if metered:
            state.keep_taken_after_release(lease)  # before its devices count as free
        lease.state = LeaseState.RELEASED
        lease.released_at = now
        lease.release_reason = reason
        lease.warned_at = lease.reclaim_at = None
        # Nothing is under way for a released lease: a suspend, restore or move it was in ends with it.
        lease.transition = Transition.NONE
        lease.transition_at = None
        lease.parked_memory = 0
        lease.migrate_from = ()
        state.touch(lease)
        if metered:
            state.released.append(lease)
        return lease

    def keep(self, state: PoolState, lease_id: str, seconds: float, now: float) -> Lease:
        lease = self.get(state, lease_id)
        if seconds > self.policy.max_keep:
            raise InvalidInput(f"can keep a slice through idle for at most {format_duration(self.policy.max_keep)}; asked {format_duration(seconds)}")
        lease.keep_until = max(lease.keep_until or 0.0, now + seconds)  # a shorter keep never cuts a longer hold
        if not lease.reclaim_reason.startswith("preempt"):
            lease.warned_at = lease.reclaim_at = None
            lease.reclaim_reason = ""
        lease.last_activity = now
        state.touch(lease)
        return lease

    def report_activity(self, state: PoolState, lease_id: str, activity: Activity, now: float) -> Lease:
        """Take a kernel's activity (and heartbeat). A report that says nothing new (still idle since
        the same moment, or still busy, with the same connections) changes nothing while the
        heartbeat on file is fresh (younger than a quarter of the TTL): rewriting every kernel's
        lease every few seconds was most of a report's cost, and of a simulated day's."""
        lease = self.get(state, lease_id)
        if (
            activity.busy == lease.busy
            and activity.connections == lease.connections
            # busy, it stays "active now"; idle, its last activity is what the lease says
            and (activity.busy or activity.last_activity is None or activity.last_activity <= (lease.last_activity or 0.0))
            and self._heartbeat_fresh(lease, now)
        ):
            return lease  # the busy time since the heartbeat is counted at the next write
        self._count_busy_time(lease, now)
        lease.busy = activity.busy
        if activity.last_activity is not None:
            lease.last_activity = max(lease.last_activity or 0.0, activity.last_activity)
        if activity.busy:
            lease.last_activity = now
        lease.connections = activity.connections
        lease.heartbeat_at = max(now, lease.heartbeat_at or now)  # two writers' clocks may cross: never backwards
        state.touch_liveness(lease)
        return lease

    def heartbeat(self, state: PoolState, lease_id: str, now: float) -> Lease:
        """A holder's sign of life with nothing else to say (a waiting request's look, a client's
        heartbeat): written only once the heartbeat on file is no longer fresh, as a report that
        says nothing new. A kernel waiting for a GPU looks twice a second; writing its lease each
        time made every other process on the pool file read all live leases again."""
        lease = self.get(state, lease_id)
        if lease.heartbeat_at is not None and now < lease.heartbeat_at:
            return lease  # an older sign of life than the one on file (two writers raced): it says nothing new
        if not self._heartbeat_fresh(lease, now):
            self._count_busy_time(lease, now)
            lease.heartbeat_at = now
            state.touch_liveness(lease)
        return lease

    def _heartbeat_fresh(self, lease: Lease, now: float) -> bool:
        """Whether the heartbeat on file is younger than a quarter of the TTL."""
        return lease.heartbeat_at is not None and 0.0 <= now - lease.heartbeat_at < self.policy.heartbeat_ttl / 4

    def _count_busy_time(self, lease: Lease, until: float) -> None:
        """Add the busy time from the heartbeat on file to ``until`` (called before the heartbeat moves)."""
        if lease.busy and lease.state in HELD_STATES:
            lease.active_seconds += max(0.0, until - (lease.heartbeat_at or until))

    def count_unwritten_busy_time(self, lease: Lease, now: float) -> None:
        """Before an interval closes, add the busy time since the heartbeat on file: reports that
        said only "still busy" while it was fresh were not written (see :meth:`report_activity`).
        Counted up to ``now``, but not past the moment such a report would have been written (a
        holder silent since then may have died busy)."""
        if lease.heartbeat_at is not None:
            until = min(now, lease.heartbeat_at + self.policy.heartbeat_ttl / 4)
            self._count_busy_time(lease, until)
            lease.heartbeat_at = max(lease.heartbeat_at, until)
