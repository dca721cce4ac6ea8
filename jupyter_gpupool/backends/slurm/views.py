"""The Slurm backend's views: the pool snapshot, a lease's Slurm details, and usage reports from Slurm's records."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jupyter_gpupool.core.metering import PERIODS, REPORT_KEYS, DeviceInfo, Interval, check_choice, report_rows
from jupyter_gpupool.core.models import Lease, LeaseState, PoolSnapshot
from jupyter_gpupool.errors import GpuPoolError, LeaseNotFound

if TYPE_CHECKING:
    from jupyter_gpupool.backends.slurm.pool import SlurmPool


class SlurmViews:
    """What the REST API, the sidebar and ``jupyter gpupool report`` show of a Slurm pool."""

    def __init__(self, pool: SlurmPool) -> None:
        self.pool = pool

    def lease_details(self, lease: Lease) -> dict[str, Any]:
        """What the views add for a Slurm lease: ``{"slurm": {job_id, partition, node, gres, state,
        reason, position, estimated_start, fair_share}}``."""
        try:
            job = self.pool.job_of(lease.id)
        except LeaseNotFound:
            return {}
        info = self.pool.queue_info(lease.id) if lease.state is LeaseState.QUEUED else None
        start = job.get("start_time")
        return {
            "slurm": {
                "job_id": job.get("job_id"),
                "partition": job.get("partition") or None,
                "node": job.get("node") or None,
                "gres": job.get("gres"),
                "account": job.get("account") or None,
                "qos": job.get("qos") or None,
                "time_limit": job.get("time_limit") or None,
                "pending_reason": job.get("reason") or None,
                "position": info.position if info else None,
                "estimated_start": start if info and info.estimated_wait is not None else None,
                "end_state": job.get("end_state"),
                "fair_share": self.fair_share(str(job.get("job_id"))) if info else None,
            }
        }

    def fair_share(self, job_id: str) -> float | None:
        """The job's normalized fair-share factor (0..1) from ``sprio -n`` (None where priority/multifactor
        is not in use; 0 for every job where no slurmdbd keeps the associations' usage)."""
        try:
            out = self.pool.commands.run(["sprio", "-h", "-n", "-j", job_id, "-o", "%F"], check=False)
        except GpuPoolError:
            return None
        text = out.strip().splitlines()
        try:
            return float(text[-1]) if text else None
        except ValueError:
            return None

    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """Our jobs' leases on the partition's GPUs (Slurm's other jobs are not ours to show)."""
        now = self.pool.clock() if now is None else now
        rows = self.pool._live_rows()
        held: dict[str, int] = {}
        for lease, _ in rows:
            if lease.state is LeaseState.GRANTED:
                for uuid_ in lease.devices:
                    held[uuid_] = held.get(uuid_, 0) + lease.memory
        devices = [
            {**d.to_json(), "memory_leasable": d.leasable, "memory_leased": held.get(d.uuid, 0), "memory_used": 0}
            for d in self.pool.devices()
        ]
        order = self.pool.queue(now)
        positions = {lease.id: i + 1 for i, lease in enumerate(order)}
        leases = [self.pool.view_lease(lease, viewer, admin, positions.get(lease.id)) for lease, _ in rows]
        queue = [self.pool.view_lease(lease, viewer, admin, positions[lease.id]) for lease in order]
        return PoolSnapshot(devices=devices, leases=leases, queue=queue, now=now, quota={})

    def report(
        self,
        since: float | None = None,
        until: float | None = None,
        by: str = "user",
        now: float | None = None,
        period: str = "none",
    ) -> list[dict[str, Any]]:
        """GPU-hours and GiB·hours per user, group or kernel (and period), from Slurm's own records
        of our jobs: ``sacct`` for jobs that ended, ``squeue`` for those running. The user and group
        are Slurm's (who the job ran as); the slice is the one the job's GRES stands for, recorded
        with the lease (``sacct`` shows GRES only with slurmdbd: see docs/hpc.md). Each row also
        lists its Slurm ``jobs``."""
        check_choice(by, REPORT_KEYS, "by")
        check_choice(period, PERIODS, "period")
        now = self.pool.clock() if now is None else now
        until = now if until is None else until
        by_job = {str(job["job_id"]): (lease, job) for lease, job in self.pool.file.rows()}
        ended = {end.job_id: end for end in self.pool.commands.sacct(list(by_job))}
        running = {r.job_id: r for r in self.pool.commands.squeue(list(by_job))}
        gpu_memory = self.pool._gpu_memory()
        intervals: list[Interval] = []
        for job_id, (lease, _job) in by_job.items():
            end_record = ended.get(job_id)
            record = running.get(job_id)
            start: float | None
            if end_record is not None and end_record.start is not None and end_record.end is not None:
                start, end, user, group = end_record.start, end_record.end, end_record.user, end_record.group
            elif record is not None and record.running and record.start_time is not None:
                start, end, user, group = record.start_time, now, record.user, ""
            else:
                continue  # never ran, or Slurm has no record of it
            gpus = max(1, lease.num_gpus)
            devices = tuple(
                DeviceInfo(uuid=f"slurm:{job_id}:{i}", model="", memory_total=gpu_memory) for i in range(gpus)
            )
            intervals.append(
                Interval(
                    lease_id=job_id,
                    owner=user or lease.owner,
                    groups=(group,) if group else tuple(lease.groups),
                    kernel_id=lease.kernel_id,
                    memory=lease.memory * gpus,
                    start=start,
                    end=end,
                    active_seconds=0.0,  # Slurm does not see kernel activity
                    devices=devices,
                )
            )
        rows = report_rows(intervals, by=by, period=period, since=since, until=until, prices=self.pool.policy.prices())
        for row in rows:
            jobs = [
                i.lease_id
                for i in intervals
                if row[by] in i.keys(by) and i.start < until and (since is None or i.end > since)
            ]
            row["jobs"] = ",".join(jobs)
        return rows

