"""The Slurm backend's idle reclaim: the pool policy's idle rules, carried out by cancelling jobs."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.core.models import Decision, DecisionKind, Lease
from jupyter_gpupool.errors import GpuPoolError
from jupyter_gpupool.units import format_duration
from jupyter_gpupool.wording import count as counted

if TYPE_CHECKING:
    from jupyter_gpupool.backends.slurm.pool import SlurmPool


class SlurmIdleReclaim:
    """Warns an idle kernel's lease and cancels its job after the warning period (``c.PoolPolicy.idle_*``)."""

    def __init__(self, pool: SlurmPool) -> None:
        self.pool = pool

    def _still_idle(self, lease: Lease, now: float) -> bool:
        if lease.busy or (lease.keep_until is not None and lease.keep_until > now):
            return False
        return not (
            lease.warned_at is not None and lease.last_activity is not None and lease.last_activity > lease.warned_at
        )

    def step(self, lease: Lease, job: dict[str, Any], now: float) -> Decision | None:
        """The policy's idle reclaim, in Slurm's terms: with ``idle_policy = "pressure"`` a kernel
        idle for ``idle_timeout`` while jobs pend in its partition is warned, and after
        ``warning_period`` (unless kept or active again) its job is cancelled; ``"always"``
        without waiting for pressure; ``"never"`` not at all."""
        policy = self.pool.policy.idle_policy
        waiting = 0
        if policy == "pressure":
            with contextlib.suppress(GpuPoolError):
                waiting = len(self.pool.jobs.pending_in(str(job.get("partition") or "")))
        pressure = policy == "always" or waiting > 0
        if lease.reclaim_at is not None:
            if policy == "never" or not pressure or not self._still_idle(lease, now):
                lease.warned_at = lease.reclaim_at = None
                lease.reclaim_reason = ""
                self.pool.file.put(lease, job)
                return None
            if lease.reclaim_at > now:
                return None
            reason = lease.reclaim_reason
            released = self.pool.release(lease.id, reason, now)
            return Decision(DecisionKind.RECLAIM_IDLE, released.id, released.kernel_id, released.owner, reason, now)
        if (
            policy == "never"
            or not pressure
            or not self._still_idle(lease, now)
            or lease.idle_seconds(now) < self.pool.policy.idle_timeout
        ):
            return None
        idle_for = format_duration(lease.idle_seconds(now))
        lease.warned_at = now
        lease.reclaim_at = now + self.pool.policy.warning_period
        lease.reclaim_reason = (
            f"reclaimed: idle for {idle_for} while {counted(waiting, 'job')} waited in partition {job.get('partition') or '(default)'}"
            if policy == "pressure"
            else f"reclaimed: idle for {idle_for}, over the {format_duration(self.pool.policy.idle_timeout)} idle timeout"
        )
        self.pool.file.put(lease, job)
        return Decision(
            DecisionKind.WARN_IDLE,
            lease.id,
            lease.kernel_id,
            lease.owner,
            f"idle for {idle_for}; its job is cancelled unless kept",
            now,
            lease.reclaim_at,
        )

