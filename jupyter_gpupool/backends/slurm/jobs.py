"""The Slurm backend following its jobs: ``squeue``, ``scontrol`` and ``sacct`` answers made lease states."""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from jupyter_gpupool.backends.slurm.commands import JobRecord, end_sentence, parse_detail_gres_indices
from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.errors import GpuPoolError

if TYPE_CHECKING:
    from jupyter_gpupool.backends.slurm.pool import SlurmPool


class SlurmJobs:
    """Brings leases up to date with their jobs (state, devices, Slurm's reasons), with short-lived caches."""

    def __init__(self, pool: SlurmPool) -> None:
        self.pool = pool
        self._jobs_cache: tuple[float, dict[str, JobRecord]] | None = None
        self._pending_cache: tuple[float, str, list[JobRecord]] | None = None

    def forget(self) -> None:
        """Drop what ``squeue`` said: the next look asks again (after a cancel)."""
        self._jobs_cache = None
        self._pending_cache = None

    def records(self, job_ids: list[str]) -> dict[str, JobRecord]:
        now = time.monotonic()
        cached = self._jobs_cache
        if cached is not None and now - cached[0] <= self.pool.cache_seconds and all(j in cached[1] for j in job_ids):
            return cached[1]
        records = {r.job_id: r for r in self.pool.commands.squeue(job_ids)}
        self._jobs_cache = (now, records)
        return records

    def refresh(self, rows: list[tuple[Lease, dict[str, Any]]]) -> list[tuple[Lease, dict[str, Any]]]:
        """Bring live leases up to date with their jobs (state, devices, end reason)."""
        live = [(lease, job) for lease, job in rows if _followed(lease, job)]
        if not live:
            return rows
        records = self.records([str(job["job_id"]) for _, job in live])
        result = []
        for lease, job in rows:
            if _followed(lease, job):
                lease, job = self.follow(lease, job, records.get(str(job["job_id"])))
            result.append((lease, job))
        return result

    def follow(self, lease: Lease, job: dict[str, Any], record: JobRecord | None) -> tuple[Lease, dict[str, Any]]:
        job_id = str(job["job_id"])
        before = (lease.state, lease.devices, job.get("reason"), job.get("start_time"), lease.release_reason)
        if not lease.live:  # released while its job was still COMPLETING: say how it ended, once Slurm knows
            state, reason = (record.state, record.reason) if record is not None else self.final_state(job_id)
            if state != "COMPLETING":
                lease.release_reason = end_sentence(job_id, state, reason if state != "CANCELLED" else "")
                job.update(end_state=state)
        elif record is not None and record.pending:
            lease.state = LeaseState.QUEUED
            job.update(
                reason=record.reason, start_time=record.start_time, priority=record.priority, partition=record.partition
            )
        elif record is not None and record.running and record.state != "COMPLETING":
            lease.state = LeaseState.SUSPENDED if record.state in ("SUSPENDED", "STOPPED") else LeaseState.GRANTED
            job.update(node=record.nodes, reason="", partition=record.partition)
            if lease.granted_at is None:
                lease.granted_at = record.start_time or self.pool.clock()
            if not lease.devices:
                _, text = self.pool.commands.show_job(job_id, detail=True)
                indices = parse_detail_gres_indices(text)
                lease.devices = tuple(f"slurm:{node}:gpu{i}" for node, found in indices.items() for i in found)
        else:
            state, reason = (record.state, record.reason) if record is not None else self.final_state(job_id)
            lease.state = LeaseState.RELEASED
            lease.released_at = self.pool.clock()
            lease.release_reason = end_sentence(job_id, state, reason if state != "CANCELLED" else "")
            job.update(end_state=state)
        after = (lease.state, lease.devices, job.get("reason"), job.get("start_time"), lease.release_reason)
        if after != before:
            if before[0] is LeaseState.RELEASED:  # a released lease's job that was still ending
                self.pool.file.put(lease, job)
            elif not self.pool.file.put_unless_released(lease, job):  # released meanwhile: that record stands
                return self.pool.file.row(lease.id)
        return lease, job

    def final_state(self, job_id: str) -> tuple[str, str]:
        info, _ = self.pool.commands.show_job(job_id)
        if info.get("JobState"):
            return info["JobState"], info.get("Reason", "")
        with contextlib.suppress(GpuPoolError):
            for end in self.pool.commands.sacct([job_id]):
                if end.job_id == job_id:
                    return end.state, ""
        return "GONE", "Slurm no longer knows the job"

    def pending_in(self, partition: str) -> list[JobRecord]:
        now = time.monotonic()
        cached = self._pending_cache
        if cached is not None and cached[1] == partition and now - cached[0] <= self.pool.cache_seconds:
            return cached[2]
        pending = self.pool.commands.squeue(partition=partition, states="PENDING")
        self._pending_cache = (now, partition, pending)
        return pending


def _followed(lease: Lease, job: dict[str, Any]) -> bool:
    """Leases whose job the pool still watches: live ones, and those whose job was still ending."""
    return lease.live or job.get("end_state") == "COMPLETING"


