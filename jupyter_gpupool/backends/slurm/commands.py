"""A thin adapter over Slurm's commands (``sbatch``, ``squeue``, ``scancel``, ``scontrol``,
``sacct``), and pure functions that parse what they print.

Nothing here keeps state: :class:`SlurmCommands` runs one command per call and turns a failure
into :class:`~jupyter_gpupool.errors.PoolUnavailable` with one line saying what failed. The
parsers take text and return plain data, so they are tested without a cluster.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from jupyter_gpupool.errors import InvalidInput, PoolUnavailable

#: squeue's output format: one record per line, fields joined by this separator.
SEP = "\x1f"
#: ``squeue -o`` fields, in the order of :class:`JobRecord`'s constructor arguments.
SQUEUE_FIELDS = ("%i", "%j", "%T", "%r", "%Q", "%P", "%S", "%u", "%N", "%b", "%V")

#: What squeue/scontrol say about a job id slurmctld no longer (or never) knew.
GONE = "Invalid job id specified"
#: Job states in which the job holds its allocation (the kernel may run).
RUNNING_STATES = frozenset({"RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING"})
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})

#: Slurm's pending reasons, said as a sentence a notebook user understands.
REASONS: dict[str, str] = {
    "Resources": "the GPUs it needs are in use by other jobs; it starts when one of them ends",
    "Priority": "jobs with a higher priority are ahead of it in the queue",
    "Dependency": "it waits for another job to finish",
    "DependencyNeverSatisfied": "it depends on a job that failed, so it can never start; cancel it",
    "QOSMaxGRESPerUser": "you already use as many GPUs as your QOS allows; it starts when one of your jobs ends",
    "QOSMaxGRESPerJob": "it asks for more GPUs than your QOS allows for one job; ask for less",
    "QOSMaxJobsPerUserLimit": "you already run as many jobs as your QOS allows",
    "QOSMaxSubmitJobPerUserLimit": "you have as many jobs queued as your QOS allows",
    "QOSGrpGRES": "your group's QOS has all the GPUs it may use in use",
    "AssocMaxJobsLimit": "your account already runs as many jobs as it may",
    "AssocGrpGRES": "your account's group has all the GPUs it may use in use",
    "ReqNodeNotAvail": "the nodes it needs are unavailable (down, drained or reserved)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit is longer than the partition allows; ask for a shorter one",
    "PartitionDown": "the partition is down; an admin must bring it back up",
    "PartitionInactive": "the partition is inactive; an admin must bring it back up",
    "Reservation": "it waits for its advance reservation to start",
    "BeginTime": "it was asked to start later",
    "JobHeldUser": "you put it on hold; release it with scontrol release",
    "JobHeldAdmin": "an admin put it on hold",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "its constraints can never be met; cancel it and ask for something else",
    "InvalidQOS": "its QOS is invalid; ask your admin which one to use",
    "InvalidAccount": "its account is invalid; ask your admin which one to use",
    "Licenses": "it waits for a license",
    "None": "Slurm has not looked at it yet",
}

#: How a job that ended is said to a user (job state → what happened).
END_STATES: dict[str, str] = {
    "COMPLETED": "its job ended",
    "CANCELLED": "its job was cancelled (scancel)",
    "TIMEOUT": "its job reached its time limit",
    "PREEMPTED": "its job was preempted by a job with a higher priority",
    "NODE_FAIL": "the node running its job failed",
    "FAILED": "its job failed",
    "OUT_OF_MEMORY": "its job ran out of memory",
    "BOOT_FAIL": "the node for its job failed to boot",
    "DEADLINE": "its job reached its deadline",
    "REVOKED": "its job was revoked",
    "COMPLETING": "its job is ending",  # said until Slurm knows how it ended (then followed up)
}


def reason_sentence(reason: str) -> str:
    """Slurm's pending reason code (``Resources``) in words; unknown codes are kept as they are."""
    code = (reason or "").strip().strip("()")
    base = code.split(",")[0].split("(")[0]
    sentence = REASONS.get(base)
    return f"{sentence} (Slurm: {code})" if sentence else f"Slurm says: {code or 'no reason given'}"


def end_sentence(job_id: str, state: str, reason: str = "") -> str:
    """A job's end state in words, e.g. ``ended by Slurm: job 12 was cancelled (scancel)``."""
    base = (state or "").split()[0].upper() if state else "ENDED"
    what = END_STATES.get(base, f"its job ended in state {base}").replace("its job", f"job {job_id}", 1)
    extra = f" (Slurm: {reason})" if reason and reason not in ("None", "(null)") else ""
    return f"ended by Slurm: {what}{extra}"


@dataclass(frozen=True)
class JobRecord:
    """One job as ``squeue`` shows it."""

    job_id: str
    name: str
    state: str
    reason: str
    priority: int
    partition: str
    start_time: float | None
    user: str
    nodes: str
    gres: str
    submit_time: float | None = None

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES


def parse_time(text: str) -> float | None:
    """``2026-11-30T16:14:47`` (local time, as Slurm prints it) → POSIX seconds; ``N/A``,
    ``Unknown``, ``None`` → None."""
    text = (text or "").strip()
    if not text or text in ("N/A", "Unknown", "None", "(null)", "0"):
        return None
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def parse_squeue(text: str) -> list[JobRecord]:
    """Records of ``squeue -h -o`` with :data:`SQUEUE_FIELDS` joined by :data:`SEP`."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split(SEP)
        if len(parts) < len(SQUEUE_FIELDS):
            continue
        job_id, name, state, reason, priority, partition, start, user, nodes, gres, submit = parts[: len(SQUEUE_FIELDS)]
        try:
            prio = int(priority)
        except ValueError:
            prio = 0
        records.append(
            JobRecord(
                job_id=job_id.strip(),
                name=name,
                state=state.strip().upper(),
                reason=reason.strip(),
                priority=prio,
                partition=partition.strip(),
                start_time=parse_time(start),
                user=user.strip(),
                nodes=nodes.strip(),
                gres=gres.strip(),
                submit_time=parse_time(submit),
            )
        )
    return records


def parse_key_values(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` (``Key=Value Key2=Value two``) as a dict. Values may hold spaces
    (``OS=Linux 6.1 #1 SMP``): a word without ``=`` belongs to the previous value."""
    result: dict[str, str] = {}
    last = ""
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep and re.fullmatch(r"[A-Za-z_/:.]+", key):
            result[key] = value
            last = key
        elif last:
            result[last] += " " + word
    return result


def parse_detail_gres_indices(text: str) -> dict[str, list[int]]:
    """GPU indices per node from ``scontrol show job -d``: ``Nodes=node0 ... GRES=shard:8(IDX:0)``
    or ``GRES=gpu:2(IDX:0-1)``, ``gpu:a100:1(IDX:3)`` → ``{"node0": [0]}``."""
    result: dict[str, list[int]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("Nodes="):
            continue
        node = line.split()[0].split("=", 1)[1]
        indices: list[int] = []
        for match in re.finditer(r"IDX:([0-9,\-]+)", line):
            for part in match.group(1).split(","):
                if "-" in part:
                    low, high = part.split("-", 1)
                    indices.extend(range(int(low), int(high) + 1))
                elif part:
                    indices.append(int(part))
        result[node] = sorted(set(indices))
    return result


def parse_node_gres(gres: str) -> dict[str, int]:
    """A node's ``Gres=gpu:a100:2(S:0),shard:16`` → ``{"gpu": 2, "shard": 16}`` (counts per name;
    a typed GRES counts towards its name)."""
    counts: dict[str, int] = {}
    for item in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        parts = [p for p in item.strip().split(":") if p]
        if len(parts) < 2 or parts[0] in ("(null)",):
            continue
        try:
            count = int(parts[-1])
        except ValueError:
            continue
        counts[parts[0]] = counts.get(parts[0], 0) + count
    return counts


def node_gpu_model(gres: str) -> str:
    """The GPU type of ``gpu:a100:2`` (``a100``), or "" when the GRES names none."""
    for item in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        parts = item.strip().split(":")
        if len(parts) >= 3 and parts[0] == "gpu":
            return parts[1]
    return ""


def shards_for(memory: int, memory_per_shard: int, shards_per_gpu: int) -> int:
    """Shards that hold ``memory`` bytes (rounded up); an InvalidInput if more than one GPU has."""
    if memory_per_shard <= 0:
        raise InvalidInput("the memory per shard is unknown; set c.SlurmPool.gpu_memory to a GPU's memory")
    count = max(1, math.ceil(memory / memory_per_shard))
    if count > shards_per_gpu:
        raise InvalidInput(
            f"a slice of {count} shards is more than one GPU's {shards_per_gpu}; ask for at most "
            f"{memory_per_shard * shards_per_gpu // 2**30} GiB, or for whole GPUs"
        )
    return count


@dataclass(frozen=True)
class JobEnd:
    """One finished job from the job-completion log (``sacct --completion``)."""

    job_id: str
    user: str
    group: str
    state: str
    partition: str
    start: float | None
    end: float | None
    elapsed: float
    tres: dict[str, str] = field(default_factory=dict)


def parse_sacct(text: str) -> list[JobEnd]:
    """``sacct -p -n --format=JobID,User,Group,State,Partition,Start,End,ElapsedRaw,AllocTRES``."""
    rows = []
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 9 or not parts[0].strip():
            continue
        job_id, user, group, state, partition, start, end, elapsed, tres = parts[:9]
        try:
            seconds = float(elapsed or 0)
        except ValueError:
            seconds = 0.0
        rows.append(
            JobEnd(
                job_id=job_id.strip(),
                user=user.split("(")[0].strip(),
                group=group.split("(")[0].strip(),
                state=state.split()[0] if state.strip() else "",
                partition=partition.strip(),
                start=parse_time(start),
                end=parse_time(end),
                elapsed=seconds,
                tres=dict(item.split("=", 1) for item in tres.split(",") if "=" in item),
            )
        )
    return rows


def parse_steps(text: str) -> list[tuple[str, str]]:
    """``squeue -h -s -o "%i|%j"`` → ``[("12.0", "gpupool-kernel"), ...]``."""
    steps = []
    for line in text.splitlines():
        step, _, name = line.strip().partition("|")
        if step:
            steps.append((step, name))
    return steps


class SlurmCommands:
    """Runs Slurm's client commands (found on PATH, or under ``bin_dir``)."""

    def __init__(self, env: Mapping[str, str] | None = None, bin_dir: str = "", timeout: float = 30.0) -> None:
        self.env = dict(os.environ if env is None else env)
        self.bin_dir = bin_dir
        self.timeout = timeout

    def _path(self, name: str) -> str:
        if self.bin_dir:
            return os.path.join(self.bin_dir, name)
        return shutil.which(name, path=self.env.get("PATH")) or name

    def run(
        self, argv: Sequence[str], check: bool = True, input_text: str | None = None, empty_if: tuple[str, ...] = ()
    ) -> str:
        """Run one command; its stdout. A failure raises PoolUnavailable naming the command, unless
        its message contains ``empty_if`` (then the answer is empty: e.g. every job asked about is gone)."""
        command = [self._path(argv[0]), *argv[1:]]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                env=self.env,
                timeout=self.timeout,
                check=False,
                input=input_text,
            )
        except FileNotFoundError:
            raise PoolUnavailable(
                f"{argv[0]} is not installed here: the Slurm backend needs Slurm's client commands on PATH"
            ) from None
        except subprocess.TimeoutExpired:
            raise PoolUnavailable(f"{argv[0]} did not answer within {self.timeout:g} s: is slurmctld up?") from None
        if done.returncode != 0 and any(text in done.stderr for text in empty_if):
            return ""
        if check and done.returncode != 0:
            message = (done.stderr or done.stdout).strip().splitlines()
            raise PoolUnavailable(f"{argv[0]} failed: {message[-1] if message else f'exit status {done.returncode}'}")
        return done.stdout

    # --- the commands the backend uses ------------------------------------------------------------
    def sbatch(self, args: Sequence[str], script: str) -> str:
        """Submit ``script`` with ``args``; the job id."""
        out = self.run(["sbatch", "--parsable", *args], input_text=script)
        job_id = out.strip().split(";")[0]
        if not job_id.isdigit():
            raise PoolUnavailable(f"sbatch answered {out.strip()!r} instead of a job id")
        return job_id

    def squeue(self, job_ids: Sequence[str] | None = None, partition: str = "", states: str = "") -> list[JobRecord]:
        argv = ["squeue", "-h", "-o", SEP.join(SQUEUE_FIELDS), "--sort=-p,i"]
        if job_ids is not None:
            if not job_ids:
                return []
            argv += ["-j", ",".join(job_ids)]
        if partition:
            argv += ["-p", partition]
        if states:
            argv += ["-t", states]
        # squeue -j fails once every listed job is gone from slurmctld's memory: that is "none";
        # any other failure (controller down) must not read as "every job ended".
        return parse_squeue(self.run(argv, empty_if=(GONE,)))

    def steps(self, job_id: str) -> list[tuple[str, str]]:
        return parse_steps(self.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"], check=False))

    def scancel(self, job_id: str, signal: str = "", batch: bool = False) -> None:
        argv = ["scancel"]
        if signal:
            argv.append(f"--signal={signal}")
        if batch:
            argv.append("--batch")
        # A job that is gone or already ending needs no cancelling; a controller that does not answer
        # is an error (the caller must not think the job is cancelled).
        self.run([*argv, job_id], empty_if=(GONE, "already completing or completed"))

    def show_job(self, job_id: str, detail: bool = False) -> tuple[dict[str, str], str]:
        """``scontrol show job`` as a dict (empty once Slurm forgot the job) and the raw text."""
        argv = ["scontrol", "show", "job", job_id] + (["-d"] if detail else [])
        text = self.run(argv, empty_if=(GONE,))
        return parse_key_values(text), text

    def show_nodes(self) -> list[dict[str, str]]:
        text = self.run(["scontrol", "show", "node", "-o"])
        return [parse_key_values(line) for line in text.splitlines() if line.strip()]

    def show_partition(self, name: str) -> dict[str, str]:
        return parse_key_values(self.run(["scontrol", "show", "partition", name, "-o"]))

    def sacct(self, job_ids: Sequence[str], completion: bool = True) -> list[JobEnd]:
        if not job_ids:
            return []
        argv = ["sacct", "-a", "-p", "-n", "-X", "-j", ",".join(job_ids)]
        if completion:
            argv.append("--completion")
        argv.append("--format=JobID,User,Group,State,Partition,Start,End,ElapsedRaw,AllocTRES")
        return parse_sacct(self.run(argv))
