"""The Slurm backend: each lease is a Slurm job holding the slice as a GRES request.

:class:`SlurmPool` answers the same questions as :class:`~jupyter_gpupool.backends.local.pool.Pool` and
:class:`~jupyter_gpupool.backends.remote.RemotePool` (granted, or queued at position k because ..., expected
start ...), so the provisioner, the server extension, the REST API, the front end and the magics
work unchanged. Slurm does the scheduling: a request is ``sbatch`` of a *holder job* (``sleep``)
with ``--gres=shard:N`` (or ``gpu:k`` for whole GPUs); while it pends the lease is queued, with
the job's position among the pending jobs of its partition in Slurm's priority order, Slurm's
pending reason in words and ``squeue``'s expected start; once it runs the lease is granted and
the kernel runs as a step of that job (see :mod:`jupyter_gpupool.provisioner.slurm`), so a kernel
restart keeps the job. A release is ``scancel``; a job that ends on its own (time limit,
preemption, node failure, ``scancel`` from outside) releases its lease with Slurm's reason.

The lease ↔ job mapping lives in a small SQLite file (``c.SlurmPool.state_path``), so it
survives a server restart: the next server still sees, reports and cancels the jobs of the last.

:class:`SlurmPool` keeps the configuration (``c.SlurmPool.*``), the requests and the contract, and
composes its parts: :class:`~.leasefile.SlurmLeaseFile` (that file), :class:`~.jobs.SlurmJobs`
(following the jobs through :mod:`.commands`), :class:`~.idle.SlurmIdleReclaim` (the policy's idle
reclaim) and :class:`~.views.SlurmViews` (snapshot, lease details, usage reports).
"""

from __future__ import annotations

import contextlib
import getpass
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from traitlets import Dict, Float, Int, List, Unicode, validate
from traitlets.config import Config, LoggingConfigurable

from jupyter_gpupool.backends.contract import Capability
from jupyter_gpupool.backends.local.pool import Pool, new_lease_id
from jupyter_gpupool.backends.owner import default_owner
from jupyter_gpupool.backends.slurm.commands import (
    SlurmCommands,
    node_gpu_model,
    parse_node_gres,
    reason_sentence,
    shards_for,
)
from jupyter_gpupool.backends.slurm.idle import SlurmIdleReclaim
from jupyter_gpupool.backends.slurm.jobs import SlurmJobs
from jupyter_gpupool.backends.slurm.leasefile import SlurmLeaseFile
from jupyter_gpupool.backends.slurm.views import SlurmViews
from jupyter_gpupool.backends.waiting import GrantWaiting
from jupyter_gpupool.core.models import (
    Activity,
    Decision,
    DecisionKind,
    Device,
    Lease,
    LeaseRequest,
    LeaseState,
    PoolSnapshot,
    PriorityClass,
    QueueInfo,
)
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.base import process_alive
from jupyter_gpupool.errors import GpuPoolError, InvalidInput, LeaseNotFound, PoolUnavailable, RequestRefused
from jupyter_gpupool.units import SIZE_FORMS, format_duration, format_size, parse_size

BACKEND_NAME = "slurm"
PROVISIONER_NAME = "gpupool-slurm-provisioner"
#: Estimated starts further away than this are Slurm's "never, as far as I know" (e.g. +1 year).
MAX_ESTIMATE = 30 * 86400.0
#: Seconds before the description reads the nodes again after a read that failed (no read ever
#: succeeded): a view on the event loop must not wait on a silent controller each time it is shown.
UNREAD_RETRY = 10.0
HOSTNAME = socket.gethostname()


def default_state_path() -> str:
    """``$GPUPOOL_SLURM_STATE``, else ``slurm-leases.sqlite`` in Jupyter's data directory (in
    ``$HOME``, which a cluster shares between the login and compute nodes)."""
    if os.environ.get("GPUPOOL_SLURM_STATE"):
        return os.environ["GPUPOOL_SLURM_STATE"]
    from jupyter_core.paths import jupyter_data_dir

    return os.path.join(jupyter_data_dir(), "gpupool", "slurm-leases.sqlite")


class SlurmBackend:
    """The device backend as the pool shows it: the GPUs of the partition's nodes."""

    name = BACKEND_NAME

    def __init__(self, pool: SlurmPool) -> None:
        self._pool = pool

    @property
    def spec(self) -> str:
        return f"slurm:{self._pool.partition or 'default'}"

    def devices(self) -> list[Device]:
        return self._pool.devices()

    def process_usage(self) -> list[Any]:
        return []  # processes run on compute nodes: Slurm accounts for them

    def describe(self) -> str:
        """One line for logs and the pool view. It runs no Slurm command once the nodes were read
        (the REST API calls it on the server's event loop, which must never wait on slurmctld); until
        then it reads them at most once per :data:`UNREAD_RETRY` seconds, and says the shards are not
        known yet while Slurm does not answer."""
        return f"Slurm partition {self._pool.partition or '(default)'}, {self._pool.shards_per_gpu_text(read_once=True)}"

    def close(self) -> None:
        """Nothing to release."""


class SlurmPool(GrantWaiting, LoggingConfigurable):
    """Leases as Slurm jobs on GPU shards; Slurm queues, orders and accounts.

    The ``slurm`` :class:`~jupyter_gpupool.backends.contract.PoolBackend`: no suspend (a job's memory
    cannot be parked), no NVML view of the nodes."""

    kind = "slurm"
    capabilities = frozenset({Capability.CLIENT_ENV, Capability.WHOAMI, Capability.LEASE_DETAILS})

    #: Adapters skip what only a local pool does (watchdog over local processes, Prometheus collector).
    remote = True
    provisioner_name = PROVISIONER_NAME

    partition = Unicode(
        "", config=True, help="Partition the kernels' jobs go to (sbatch --partition). Empty: Slurm's default."
    )
    account = Unicode(
        "", config=True, help="Account charged for the jobs (sbatch --account). Empty: the user's default."
    )
    qos = Unicode("", config=True, help="Quality of service of the jobs (sbatch --qos). Empty: the default.")
    time_limit = Unicode(
        "8:00:00",
        config=True,
        help="Time limit of a kernel's job (sbatch --time, e.g. 8:00:00 or 1-00:00:00). Empty: the partition's default. "
        "A limit also gives squeue --start something to estimate with.",
    )
    gpu_memory = Unicode(
        "80GiB",
        config=True,
        help=f"Memory of one GPU of the partition, {SIZE_FORMS}: a slice of M bytes is ceil(M / (gpu_memory / shards per GPU)) shards.",
    )
    shards_per_gpu = Int(
        0,
        config=True,
        help="GRES shards per GPU. 0: read from the nodes' Gres (shard count / gpu count).",
    )
    mig_profiles = Dict(
        {},
        config=True,
        help="MIG GRES types of the partition and each one's memory, e.g. {'1g.10gb': '10GiB', '3g.40gb': '40GiB'} "
        "(what AutoDetect=nvml lists as gpu:<type>). A one-GPU slice then asks for the smallest type that holds it "
        "(--gres=gpu:3g.40gb:1): a hard memory limit, where shards are only a share. A slice larger than every "
        "type gets shards or a whole GPU as before. Empty: no MIG.",
    )

    @validate("mig_profiles")
    def _check_mig_profiles(self, proposal: Any) -> dict[str, str]:
        checked = {}
        for name, size in dict(proposal["value"]).items():
            if not str(name) or any(c in str(name) for c in ":,= "):
                raise InvalidInput(f"c.SlurmPool.mig_profiles: {name!r} is not a GRES type (e.g. 1g.10gb)")
            parse_size(str(size))  # raises InvalidInput naming the forms
            checked[str(name)] = str(size)
        return checked

    sbatch_args = List(
        Unicode(),
        config=True,
        help="More sbatch arguments for every kernel job, e.g. ['--constraint=a100', '--mem=16G'].",
    )
    holder_command = Unicode(
        "exec sleep infinity",
        config=True,
        help="What the job's batch step runs while the kernel runs as a step beside it (it holds the allocation).",
    )
    state_path = Unicode(
        config=True,
        help="SQLite file of the lease ↔ job mapping. Default: $GPUPOOL_SLURM_STATE, else slurm-leases.sqlite in Jupyter's data dir.",
    )
    job_output_dir = Unicode(
        "",
        config=True,
        help="Where the jobs' stdout/stderr go (sbatch --output). Empty: a 'jobs' folder beside the state file.",
    )
    cache_seconds = Float(1.0, config=True, help="Seconds a squeue answer is reused (views and waits poll it).")
    poll_interval = Float(1.0, config=True, help="Seconds between squeue checks while a kernel's job pends.")

    def __init__(
        self,
        commands: SlurmCommands | None = None,
        policy: PoolPolicy | None = None,
        clock: Callable[[], float] = time.time,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if not self.state_path:
            self.state_path = default_state_path()
        self.commands = commands or SlurmCommands()
        self.policy = policy or PoolPolicy(parent=self)
        self.clock = clock
        self.db_path = self.state_path
        self.backend = SlurmBackend(self)
        self.file = SlurmLeaseFile(self.state_path)
        self.jobs = SlurmJobs(self)
        self.views = SlurmViews(self)
        self.idle = SlurmIdleReclaim(self)
        self._nodes: tuple[float, list[dict[str, str]]] | None = None
        #: When the last read of the nodes failed, and why (None once a read succeeds).
        self._nodes_unread: tuple[float, str] | None = None

    @classmethod
    def from_env(cls, config: Config | None = None, environ: Mapping[str, str] | None = None) -> SlurmPool:
        """A pool from ``c.SlurmPool.*`` and ``GPUPOOL_SLURM_*`` (``PARTITION``, ``ACCOUNT``,
        ``QOS``, ``TIME_LIMIT``, ``GPU_MEMORY``, ``STATE``) plus the policy's variables."""
        env = dict(os.environ if environ is None else environ)
        policy = PoolPolicy(config=config)
        policy.apply_env(env)
        overrides: dict[str, Any] = {}
        for trait in ("partition", "account", "qos", "time_limit", "gpu_memory"):
            value = env.get(f"GPUPOOL_SLURM_{trait.upper()}")
            if value:
                overrides[trait] = value
        if env.get("GPUPOOL_SLURM_STATE"):
            overrides["state_path"] = env["GPUPOOL_SLURM_STATE"]
        return cls(commands=SlurmCommands(env=env), policy=policy, config=config or Config(), **overrides)

    # --- what the partition has -------------------------------------------------------------------
    def _node_records(self, max_age: float = 10.0, retry_after: float = 0.0) -> list[dict[str, str]]:
        """The partition's nodes (``scontrol show node``), read again once older than ``max_age`` seconds.

        A read that fails raises PoolUnavailable; while no read ever succeeded, a failure younger
        than ``retry_after`` seconds is raised again without asking Slurm."""
        now = time.monotonic()
        if self._nodes is None and self._nodes_unread is not None and now - self._nodes_unread[0] < retry_after:
            raise PoolUnavailable(self._nodes_unread[1])
        if self._nodes is None or now - self._nodes[0] > max_age:
            try:
                nodes = self.commands.show_nodes()
            except GpuPoolError as err:
                self._nodes_unread = (time.monotonic(), short_reason(err))
                raise
            if self.partition:
                nodes = [n for n in nodes if self.partition in n.get("Partitions", "").split(",")]
            answered_late = self._nodes is None and self._nodes_unread is not None
            self._nodes, self._nodes_unread = (now, nodes), None
            if answered_late:  # the start-up line said the shards were not known yet: say them now
                self.log.info("gpupool: Slurm answered: %s", self.backend.describe())
        return self._nodes[1]

    def _gpu_memory(self) -> int:
        try:
            return parse_size(self.gpu_memory)
        except InvalidInput as err:
            raise InvalidInput(f"c.SlurmPool.gpu_memory: {err}") from None

    def _shards_per_gpu(self, max_age: float = 10.0, retry_after: float = 0.0) -> int:
        """Shards per GPU (configured, else from the nodes' Gres); 0 where the partition has no shard
        GRES. Nodes that cannot be read raise PoolUnavailable, never 0: that would mean whole GPUs."""
        if self.shards_per_gpu > 0:
            return self.shards_per_gpu
        for node in self._node_records(max_age, retry_after):
            counts = parse_node_gres(node.get("Gres", ""))
            if counts.get("gpu") and counts.get("shard"):
                return max(1, counts["shard"] // counts["gpu"])
        return 0

    def shards_per_gpu_text(self, read_once: bool = False) -> str:
        """The GPUs' memory and shards in words; ``read_once``: from the nodes as last read, if ever
        (else read, at most once per :data:`UNREAD_RETRY` seconds). Nodes that could not be read are
        said as such ("shards not known yet"), never as whole GPUs."""
        gpus = f"{format_size(self._gpu_memory())} GPUs"
        try:
            shards = self._shards_per_gpu(*((math.inf, UNREAD_RETRY) if read_once else (10.0, 0.0)))
        except GpuPoolError as err:
            return f"{gpus}, shards not known yet (the nodes could not be read: {short_reason(err)})"
        if not shards:
            if self._nodes is not None and not self._nodes[1]:  # Slurm answered, and listed no node of the partition
                where = f"partition {self.partition}" if self.partition else "the cluster"
                return f"{gpus}, no nodes in {where} (Slurm lists none: check c.SlurmPool.partition and the nodes' Partitions)"
            return f"{gpus}, whole GPUs (no shard GRES)"
        return f"{gpus}, {shards} shards of {format_size(self._gpu_memory() // shards)} per GPU"

    def devices(self) -> list[Device]:
        """One device per GPU of the partition's nodes (uuid ``slurm:NODE:gpuI``)."""
        devices: list[Device] = []
        memory = self._gpu_memory()
        for node in self._node_records():
            name = node.get("NodeName", "?")
            counts = parse_node_gres(node.get("Gres", ""))
            model = node_gpu_model(node.get("Gres", "")) or "GPU"
            state = node.get("State", "")
            healthy = not any(bad in state.upper() for bad in ("DOWN", "DRAIN", "FAIL", "NOT_RESPONDING"))
            for index in range(counts.get("gpu", 0)):
                devices.append(
                    Device(
                        index=len(devices),
                        uuid=f"slurm:{name}:gpu{index}",
                        name=f"{model} {index} on {name}",
                        memory_total=memory,
                        healthy=healthy,
                        health_reason="" if healthy else f"node {name} is {state}",
                    )
                )
        return devices

    def default_memory(self) -> int:
        return self.policy.default_memory_bytes(self._gpu_memory())

    def parse_memory(self, text: str | int) -> int:
        return parse_size(text, gpu_memory=self._gpu_memory())

    def whoami(self) -> dict[str, Any]:
        """Jobs run as the Unix user of this process: that is who the leases belong to."""
        return {"name": default_owner(), "groups": [], "admin": False, "kind": "slurm"}

    # --- requests ---------------------------------------------------------------------------------
    def gres_for(self, memory: int, num_gpus: int, model: str | None = None) -> tuple[str, int]:
        """The GRES request for a slice (``shard:N``, or ``gpu[:model]:k`` for whole GPUs, a model
        constraint always asking for whole GPUs of that GRES type) and the memory it holds."""
        gpu_memory = self._gpu_memory()
        if model:
            if any(c in model for c in ":,= "):
                raise InvalidInput(f"invalid GPU model {model!r}: give the GRES type of the GPUs, e.g. a100")
            return f"gpu:{model.lower()}:{max(1, num_gpus)}", gpu_memory
        if num_gpus <= 1 and self.mig_profiles:
            fitting = sorted((parse_size(size), name) for name, size in self.mig_profiles.items() if parse_size(size) >= memory)
            if fitting:
                size, name = fitting[0]
                return f"gpu:{name}:1", size
        if num_gpus > 1:
            return f"gpu:{num_gpus}", gpu_memory
        try:
            shards = self._shards_per_gpu()
        except GpuPoolError as err:
            # Not knowing the shards is not "no shards": a whole GPU is asked for only where the partition has none.
            raise PoolUnavailable(
                f"nothing was submitted: the partition's GPU shards are not known yet, the nodes could not be read ({short_reason(err)})"
            ) from None
        if not shards:
            return "gpu:1", gpu_memory
        per_shard = gpu_memory // shards
        count = shards_for(memory, per_shard, shards)
        return f"shard:{count}", count * per_shard

    def request(self, req: LeaseRequest, now: float | None = None) -> Lease:
        """Submit the holder job for ``req``; the lease, queued (or granted if Slurm started it at once)."""
        now = self.clock() if now is None else now
        if req.burst_limit and req.burst_limit > req.memory:
            raise RequestRefused(f"nothing was submitted: {self.no_burst}")
        gres, memory = self.gres_for(req.memory, req.num_gpus, req.model)
        partition = getattr(req, "partition", "") or self.partition
        account = getattr(req, "account", "") or self.account
        qos = getattr(req, "qos", "") or self.qos
        time_limit = getattr(req, "time_limit", "") or self.time_limit
        lease_id = new_lease_id()
        out_dir = self.job_output_dir or os.path.join(os.path.dirname(os.path.abspath(self.state_path)), "jobs")
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as err:
            raise PoolUnavailable(f"cannot create the folder for the jobs' output {out_dir}: {err.strerror}") from None
        args = [
            f"--job-name=gpupool-{(req.kernel_id or lease_id)[:8]}",
            f"--gres={gres}",
            "--ntasks=1",
            f"--output={os.path.join(out_dir, 'job-%j.out')}",
            f"--comment=gpupool lease {lease_id} kernel {req.kernel_id or '-'}",
        ]
        args += [f"--partition={partition}"] if partition else []
        args += [f"--account={account}"] if account else []
        args += [f"--qos={qos}"] if qos else []
        args += [f"--time={time_limit}"] if time_limit else []
        if req.priority is PriorityClass.BATCH:
            args.append("--nice=100")  # graders yield to live users, in Slurm's own terms
        args += list(self.sbatch_args)
        script = f"#!/bin/sh\n# jupyter-gpupool: holds GPU slice {lease_id} while its kernel runs as a step\n{self.holder_command}\n"
        job_id = self.commands.sbatch(args, script)
        lease = Lease(
            id=lease_id,
            owner=req.owner,
            memory=memory,
            state=LeaseState.QUEUED,
            created_at=now,
            groups=req.groups,
            kernel_id=req.kernel_id,
            num_gpus=req.num_gpus,
            model=req.model,
            priority=req.priority or PriorityClass.NORMAL,
            duration=req.duration,
            holder_pid=req.holder_pid,
            holder_host=req.holder_host,
            label=req.label,
        )
        job = {
            "job_id": job_id,
            "partition": partition,
            "gres": gres,
            "account": account,
            "qos": qos,
            "time_limit": time_limit,
        }
        self.file.put(lease, job)
        self.jobs.forget()
        return self.jobs.refresh([(lease, job)])[0][0]

    def job_of(self, lease_id: str) -> dict[str, Any]:
        """The Slurm side of a lease: ``job_id``, ``partition``, ``gres``, ``node``, ``reason``, ..."""
        return dict(self.jobs.refresh([self.file.row(lease_id)])[0][1])

    # --- the Pool contract: leases --------------------------------------------------------------
    def get(self, lease_id: str) -> Lease:
        return self.jobs.refresh([self.file.row(lease_id)])[0][0]

    def lease_for_kernel(self, kernel_id: str) -> Lease | None:
        lease = self.last_lease_for_kernel(kernel_id)
        return lease if lease is not None and lease.live else None

    def last_lease_for_kernel(self, kernel_id: str) -> Lease | None:
        rows = self.file.rows("WHERE kernel_id = ?", (kernel_id,))
        if not rows:
            return None
        return self.jobs.refresh([rows[-1]])[0][0]

    def leases(self, owner: str | None = None, include_released: bool = False) -> list[Lease]:
        rows = self.file.rows("WHERE owner = ?", (owner,)) if owner else self.file.rows()
        leases = [lease for lease, _ in self.jobs.refresh(rows)]
        return [lease for lease in leases if include_released or lease.live]

    def _live_rows(self) -> list[tuple[Lease, dict[str, Any]]]:
        rows = [row for row in self.file.rows() if row[0].live]
        return [row for row in self.jobs.refresh(rows) if row[0].live]


    def queue(self, now: float | None = None) -> list[Lease]:
        """Our queued leases in Slurm's order."""
        queued = [(lease, job) for lease, job in self._live_rows() if lease.state is LeaseState.QUEUED]
        order = {}
        for partition in {str(job.get("partition") or "") for _, job in queued}:
            for i, record in enumerate(self.jobs.pending_in(partition)):
                order[record.job_id] = i
        queued.sort(key=lambda row: order.get(str(row[1]["job_id"]), 1 << 30))
        return [lease for lease, _ in queued]

    def queue_info(self, lease_id: str, now: float | None = None) -> QueueInfo | None:
        """Position among the pending jobs of the job's partition, in Slurm's priority order."""
        lease, job = self.jobs.refresh([self.file.row(lease_id)])[0]
        if lease.state is not LeaseState.QUEUED:
            return None
        now = self.clock() if now is None else now
        pending = self.jobs.pending_in(str(job.get("partition") or ""))
        ids = [r.job_id for r in pending]
        job_id = str(job["job_id"])
        position = ids.index(job_id) + 1 if job_id in ids else len(ids) + 1
        start = job.get("start_time")
        wait = start - now if isinstance(start, (int, float)) and 0 < start - now < MAX_ESTIMATE else None
        if isinstance(start, (int, float)) and start <= now:
            wait = 0.0
        return QueueInfo(
            position=position,
            length=max(len(ids), position),
            estimated_wait=wait,
            reason=reason_sentence(job.get("reason", "")),
        )


    def release(self, lease_id: str, reason: str = "released by user", now: float | None = None) -> Lease:
        """``scancel`` the lease's job; the lease is released with ``reason``."""
        lease, job = self.file.row(lease_id)
        if not lease.live:
            return lease
        held = lease.copy(), dict(job)
        lease.state = LeaseState.RELEASED
        lease.released_at = self.clock() if now is None else now
        lease.release_reason = reason
        job["end_state"] = "CANCELLED"
        # The release is recorded before the job is cancelled: whoever sees the job gone from then
        # on (a tick, a status view in another thread) finds it released with this reason, and
        # does not say Slurm ended it.
        self.file.put(lease, job)
        try:
            self.commands.scancel(str(job["job_id"]))
        except BaseException:
            self.file.put(*held)  # the job still runs: so does its lease
            raise
        finally:
            self.jobs.forget()
        return lease

    #: What a user who asks for a limit or a grow is told (Slurm has no Capability.GROW).
    no_burst = (
        "a Slurm kernel's slice does not burst: its job's GPU shards are fixed when the job is submitted; "
        "start the kernel with the size it needs, without a limit"
    )

    def resize(
        self, lease_id: str, memory: int | None = None, duration: float | None = None, now: float | None = None,
        limit: int | None = None,
    ) -> Lease:
        """A Slurm lease's time can change (``duration``); its size and limit cannot while its job runs."""
        if limit:
            raise RequestRefused(f"no limit was set: {self.no_burst}")
        lease, job = self.file.row(lease_id)
        if memory is not None and memory != lease.memory:
            raise RequestRefused(
                f"a Slurm kernel's slice is its job's GRES ({job.get('gres')}): it cannot change while the job runs; "
                "shut the kernel down and start it with another size"
            )
        if duration is not None:
            return self.keep(lease_id, duration, now)
        return lease

    def keep(self, lease_id: str, seconds: float, now: float | None = None) -> Lease:
        lease, job = self.file.row(lease_id)
        if seconds > self.policy.max_keep:
            raise InvalidInput(
                f"can keep a slice through idle for at most {format_duration(self.policy.max_keep)}; asked {format_duration(seconds)}"
            )
        lease.keep_until = (self.clock() if now is None else now) + seconds
        lease.warned_at = lease.reclaim_at = None
        lease.reclaim_reason = ""
        self.file.put(lease, job)
        return lease

    def set_priority(self, lease_id: str, priority: str, now: float | None = None) -> Lease:
        raise RequestRefused(
            "on the Slurm backend priorities are Slurm's: an admin changes them with scontrol update job"
        )

    # --- activity, ticks, reconciliation -----------------------------------------------------------
    def report_activity(self, lease_id: str, activity: Activity, now: float | None = None) -> None:
        self.report_activities({lease_id: activity}, now)

    def report_activities(self, activities: dict[str, Activity], now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for lease_id, activity in activities.items():
            with contextlib.suppress(LeaseNotFound):
                lease, job = self.file.row(lease_id)
                if not lease.live:
                    continue
                lease.busy = activity.busy
                lease.last_activity = activity.last_activity or lease.last_activity
                lease.connections = activity.connections
                lease.heartbeat_at = now
                self.file.put(lease, job)

    def heartbeat(self, lease_ids: list[str], now: float | None = None) -> None:
        """Nothing to do: a lease lives as long as its job."""

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]:
        return []

    def tick(self, now: float | None = None, activities: dict[str, Activity] | None = None) -> list[Decision]:
        """Follow every live job (a job that ended releases its lease with Slurm's reason), and
        cancel the jobs of holders on this host that died (a server killed with SIGKILL).
        ``activities`` are reported first (as :meth:`report_activities`)."""
        now = self.clock() if now is None else now
        if activities:
            self.report_activities(activities, now)
        decisions = []
        for lease, job in self.file.rows():
            if not lease.live:
                continue
            ((lease, job),) = self.jobs.refresh([(lease, job)])
            if not lease.live:
                decisions.append(
                    Decision(DecisionKind.RELEASE, lease.id, lease.kernel_id, lease.owner, lease.release_reason, now)
                )
            elif lease.holder_host == HOSTNAME and lease.holder_pid and not process_alive(lease.holder_pid):
                released = self.release(lease.id, f"released: its holder process {lease.holder_pid} exited", now)
                decisions.append(
                    Decision(
                        DecisionKind.RELEASE,
                        released.id,
                        released.kernel_id,
                        released.owner,
                        released.release_reason,
                        now,
                    )
                )
            elif lease.state is LeaseState.GRANTED:
                decision = self.idle.step(lease, job, now)
                if decision is not None:
                    decisions.append(decision)
        return decisions


    def reconcile_kernels(
        self, holder_host: str, holder_pid: int, live_kernel_ids: set[str], now: float | None = None
    ) -> list[Lease]:
        """Cancel the jobs of this holder's kernels that no longer exist."""
        gone = []
        for lease, _ in self._live_rows():
            if (
                lease.holder_host == holder_host
                and lease.holder_pid == holder_pid
                and lease.kernel_id
                and lease.kernel_id not in live_kernel_ids
            ):
                gone.append(self.release(lease.id, "released: its kernel is gone", now))
        return gone

    # --- waiting ----------------------------------------------------------------------------------
    def _check(self, lease_id: str) -> tuple[Lease, QueueInfo | None]:
        lease = self.get(lease_id)
        if lease.state is LeaseState.RELEASED:
            raise RequestRefused(
                f"the request was {lease.release_reason or 'released'} before it was granted" if lease.granted_at is None
                else f"its GPU slice was {lease.release_reason or 'released'} after it was granted, before the kernel started"
            )
        return lease, (self.queue_info(lease_id) if lease.state is LeaseState.QUEUED else None)

    # GrantWaiting: a pending job waits as long as Slurm says (no timeout unless given), and a
    # slurmctld that does not answer is waited out: the job still pends there.
    waiting_word = "pending"

    def _look_at_request(self, lease_id: str, last: QueueInfo | None, deadline: float | None) -> tuple[Lease, QueueInfo | None]:
        return self._check(lease_id)

    def _pause_between_looks(self, poll: float) -> float:
        return max(poll, self.poll_interval)

    def _outage_state(self, lease_id: str, deadline: float | None, poll: float) -> tuple[str, float]:
        return lease_id, max(poll, self.poll_interval)

    def _on_outage(
        self,
        err: PoolUnavailable,
        outage: Any,
        last: tuple[Lease, QueueInfo | None] | None,
        on_update: Callable[[Lease, QueueInfo | None], None] | None,
        deadline: float | None,
    ) -> float:
        if deadline is not None and time.monotonic() >= deadline:
            raise err
        lease_id, pause = outage
        self.log.warning("gpupool: lease %s waits on, Slurm does not answer: %s", lease_id, err)
        return float(pause)

    # --- views and metering -----------------------------------------------------------------------
    @staticmethod
    def view_lease(lease: Lease, viewer: str | None, admin: bool, position: int | None = None) -> dict[str, Any]:
        return Pool.view_lease(lease, viewer, admin, position)


    def lease_details(self, lease: Lease) -> dict[str, Any]:
        """See :meth:`SlurmViews.lease_details`."""
        return self.views.lease_details(lease)

    def fair_share(self, job_id: str) -> float | None:
        """See :meth:`SlurmViews.fair_share`."""
        return self.views.fair_share(job_id)

    def snapshot(self, viewer: str | None = None, admin: bool = False, now: float | None = None) -> PoolSnapshot:
        """See :meth:`SlurmViews.snapshot`."""
        return self.views.snapshot(viewer, admin, now)

    def report(
        self, since: float | None = None, until: float | None = None, by: str = "user", now: float | None = None,
        period: str = "none",
    ) -> list[dict[str, Any]]:
        """See :meth:`SlurmViews.report`."""
        return self.views.report(since, until, by, now, period)

    # --- what the rest of the contract needs --------------------------------------------------
    def preference(self, owner: str | None = None) -> dict[str, Any]:
        return {}

    def set_preference(self, owner: str | None = None, **values: Any) -> None:
        raise RequestRefused("saved preferences are not kept on the Slurm backend; set the size in the kernelspec")

    def reservations(self) -> list[Any]:
        return []

    def book_reservation(self, spec: dict[str, Any], now: float | None = None) -> Any:
        raise RequestRefused(
            "on the Slurm backend reservations are Slurm's: an admin makes them with scontrol create reservation"
        )

    def cancel_reservation(self, name: str) -> None:
        raise RequestRefused("on the Slurm backend reservations are Slurm's: scontrol delete reservation")

    def events(self, after_seq: int = 0) -> list[dict[str, Any]]:
        return []

    def client_env(self) -> dict[str, str]:
        """What a kernel (in its job, on a compute node) needs to reach the same leases."""
        env = {"GPUPOOL_BACKEND": BACKEND_NAME, "GPUPOOL_SLURM_STATE": os.path.abspath(self.state_path)}
        if self.commands.env.get("SLURM_CONF"):
            env["SLURM_CONF"] = self.commands.env["SLURM_CONF"]
        return env

    def close(self) -> None:
        self.file.close()


def short_reason(err: BaseException, limit: int = 200) -> str:
    """The first line of an error, at most ``limit`` characters: what a one-line text can hold."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


def default_user() -> str:
    """The Unix user jobs run as."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


__all__ = ["BACKEND_NAME", "PROVISIONER_NAME", "SlurmBackend", "SlurmPool", "default_state_path"]
