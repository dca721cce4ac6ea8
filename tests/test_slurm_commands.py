"""The Slurm command adapter's parsers and the backend choice: pure functions, no cluster."""

from __future__ import annotations

import datetime as dt
import re

import pytest
from traitlets.config import Config

from jupyter_gpupool.backends.factory import selected_backend
from jupyter_gpupool.backends.slurm.commands import (
    SEP,
    end_sentence,
    node_gpu_model,
    parse_detail_gres_indices,
    parse_key_values,
    parse_node_gres,
    parse_sacct,
    parse_squeue,
    parse_steps,
    parse_time,
    reason_sentence,
    shards_for,
)
from jupyter_gpupool.errors import InvalidInput

GIB = 1 << 30


def test_squeue_records_in_slurms_order_with_times_and_states():
    line = SEP.join(
        [
            "3",
            "gpupool-ab",
            "PENDING",
            "Resources",
            "4294901757",
            "gpu",
            "2026-11-30T17:00:00",
            "alice",
            "",
            "gres:shard:8",
            "2026-11-30T16:00:00",
        ]
    )
    running = SEP.join(
        [
            "1",
            "gpupool-cd",
            "RUNNING",
            "None",
            "4294901759",
            "gpu",
            "2026-11-30T16:00:01",
            "alice",
            "node0",
            "gres:shard:8",
            "N/A",
        ]
    )
    first, second = parse_squeue(line + "\n" + running + "\n\nnot a record\n")
    assert first.job_id == "3" and first.pending and not first.running and first.reason == "Resources"
    assert first.start_time == dt.datetime(2026, 11, 30, 17).timestamp() and first.priority == 4294901757
    assert second.running and second.nodes == "node0" and second.submit_time is None


def test_pending_reasons_become_sentences_and_unknown_codes_are_kept():
    assert (
        reason_sentence("Resources")
        == "the GPUs it needs are in use by other jobs; it starts when one of them ends (Slurm: Resources)"
    )
    assert reason_sentence("Priority").startswith("jobs with a higher priority are ahead of it")
    assert "as many GPUs as your QOS allows" in reason_sentence("QOSMaxGRESPerUser")
    assert "unavailable" in reason_sentence("ReqNodeNotAvail, UnavailableNodes:node3")
    assert reason_sentence("SomethingNew") == "Slurm says: SomethingNew"


def test_end_states_in_words():
    assert end_sentence("12", "CANCELLED") == "ended by Slurm: job 12 was cancelled (scancel)"
    assert end_sentence("12", "TIMEOUT") == "ended by Slurm: job 12 reached its time limit"
    assert end_sentence("12", "PREEMPTED") == "ended by Slurm: job 12 was preempted by a job with a higher priority"
    assert (
        end_sentence("12", "NODE_FAIL", "NodeDown")
        == "ended by Slurm: the node running job 12 failed (Slurm: NodeDown)"
    )
    assert end_sentence("12", "FAILED", "JobLaunchFailure") == "ended by Slurm: job 12 failed (Slurm: JobLaunchFailure)"
    assert end_sentence("12", "CANCELLED by 0") == "ended by Slurm: job 12 was cancelled (scancel)"
    assert end_sentence("12", "WEIRD") == "ended by Slurm: job 12 ended in state WEIRD"


def test_scontrol_key_values_keep_values_with_spaces():
    info = parse_key_values(
        "NodeName=node0 Arch=x86_64 Gres=gpu:2,shard:16 OS=Linux 6.1 #1 SMP State=IDLE NodeAddr=10.0.0.5"
    )
    assert info["Gres"] == "gpu:2,shard:16" and info["OS"] == "Linux 6.1 #1 SMP" and info["NodeAddr"] == "10.0.0.5"


def test_gpu_indices_of_a_job_from_scontrol_detail():
    text = "JobId=1\n   JOB_GRES=shard:8\n     Nodes=node0 CPU_IDs=0 Mem=256 GRES=shard:8(IDX:1)\n"
    assert parse_detail_gres_indices(text) == {"node0": [1]}
    assert parse_detail_gres_indices("     Nodes=n1 CPU_IDs=0-3 GRES=gpu:a100:3(IDX:0-1,3)") == {"n1": [0, 1, 3]}


def test_node_gres_counts_and_model():
    assert parse_node_gres("gpu:2,shard:16") == {"gpu": 2, "shard": 16}
    assert parse_node_gres("gpu:a100:4(S:0-1),shard:a100:32") == {"gpu": 4, "shard": 32}
    assert parse_node_gres("(null)") == {}
    assert node_gpu_model("gpu:a100:4(S:0-1)") == "a100" and node_gpu_model("gpu:2") == ""


def test_a_slice_in_shards_rounds_up_and_never_spans_gpus():
    assert shards_for(80 * GIB, 10 * GIB, 8) == 8
    assert shards_for(75 * GIB, 10 * GIB, 8) == 8
    assert shards_for(1, 10 * GIB, 8) == 1
    with pytest.raises(InvalidInput, match="more than one GPU's 8"):
        shards_for(81 * GIB, 10 * GIB, 8)


def test_sacct_rows_and_steps():
    (row,) = parse_sacct("7|root(0)|root|CANCELLED by 0|gpu|2026-11-30T16:14:47|2026-11-30T16:14:51|4||\n")
    assert (row.job_id, row.user, row.state, row.elapsed, row.partition) == ("7", "root", "CANCELLED", 4.0, "gpu")
    assert row.end - row.start == 4
    assert parse_steps("12.0|gpupool-kernel\n12.batch|batch\n") == [("12.0", "gpupool-kernel"), ("12.batch", "batch")]
    assert parse_time("Unknown") is None and parse_time("N/A") is None


def test_backend_choice_from_config_or_environment():
    assert selected_backend(None, {}) == "local"
    assert selected_backend(None, {"GPUPOOL_BACKEND": "Slurm"}) == "slurm"
    config = Config()
    config.GpuPool.backend = "slurm"
    assert selected_backend(config, {}) == "slurm"
    with pytest.raises(InvalidInput, match="is not a backend; use one of local, slurm"):
        selected_backend(None, {"GPUPOOL_BACKEND": "kubernetes"})
    bad = Config()
    bad.GpuPool.backend = "lsf"
    with pytest.raises(InvalidInput, match="c.GpuPool.backend: expected one of local, slurm"):
        selected_backend(bad, {})


def test_the_gres_of_a_slice_whole_gpus_and_a_model(tmp_path):
    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    assert pool.gres_for(20 * GIB, 1) == ("shard:2", 20 * GIB)
    assert pool.gres_for(75 * GIB, 1) == ("shard:8", 80 * GIB)
    assert pool.gres_for(8 * GIB, 2) == ("gpu:2", 80 * GIB)
    assert pool.gres_for(8 * GIB, 1, "A100") == ("gpu:a100:1", 80 * GIB)
    with pytest.raises(InvalidInput, match="invalid GPU model 'a100:2'"):
        pool.gres_for(8 * GIB, 1, "a100:2")
    with pytest.raises(InvalidInput, match="more than one GPU's 8"):
        pool.gres_for(90 * GIB, 1)
    pool.close()


def test_a_slice_asks_for_the_smallest_mig_type_that_holds_it(tmp_path):
    from traitlets import TraitError

    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    profiles = {"3g.40gb": "40GiB", "1g.10gb": "10GiB", "2g.20gb": "20GiB"}
    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", mig_profiles=profiles, state_path=str(tmp_path / "leases.sqlite"))
    assert pool.gres_for(8 * GIB, 1) == ("gpu:1g.10gb:1", 10 * GIB)
    assert pool.gres_for(10 * GIB, 1) == ("gpu:1g.10gb:1", 10 * GIB)
    assert pool.gres_for(12 * GIB, 1) == ("gpu:2g.20gb:1", 20 * GIB)
    assert pool.gres_for(60 * GIB, 1) == ("shard:6", 60 * GIB)  # larger than every MIG type: shards as before
    assert pool.gres_for(8 * GIB, 2) == ("gpu:2", 80 * GIB)
    pool.close()
    for bad, message in [({"1g:10gb": "10GiB"}, "is not a GRES type"), ({"1g.10gb": "ten"}, "ten")]:
        with pytest.raises((InvalidInput, TraitError), match=message):
            SlurmPool(mig_profiles=bad, state_path=str(tmp_path / "other.sqlite"))


def test_a_shutdown_is_not_mistaken_for_slurm_ending_the_job(tmp_path):
    """A kernel shut down while its job pends: another thread (a tick, a status view) that read the
    lease as live just before, and asks squeue just after the scancel, finds the job gone. The
    lease must keep the shutdown's reason, not "ended by Slurm: cancelled". Under load the real
    cluster test hit this ordering; here it is forced, with Slurm's answers scripted."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import Lease, LeaseState

    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    lease = Lease(id="l-1", owner="alice", memory=8 * GIB, state=LeaseState.QUEUED, created_at=1.0, kernel_id="k-1")
    pool.file.put(lease, {"job_id": "7", "gres": "shard:1"})
    stale = pool.file.row("l-1")  # what the other thread read while the lease was live

    class ScriptedSlurm:
        cancelled: list[str] = []

        def scancel(self, job_id: str) -> None:
            self.cancelled.append(job_id)
            # The other thread now follows its stale copy: squeue no longer lists job 7.
            followed, _ = pool.jobs.follow(*stale, None)
            assert followed.release_reason == "kernel shut down while queued"

        def show_job(self, job_id: str, detail: bool = False) -> tuple[dict[str, str], str]:
            return {"JobState": "CANCELLED", "Reason": "None"}, ""

    pool.commands = ScriptedSlurm()  # type: ignore[assignment]
    released = pool.release("l-1", reason="kernel shut down while queued")
    assert ScriptedSlurm.cancelled == ["7"]
    assert released.release_reason == pool.file.row("l-1")[0].release_reason == "kernel shut down while queued"
    pool.close()


def test_a_release_whose_scancel_fails_keeps_the_lease_live(tmp_path):
    """The controller does not answer: the job may still run, so its lease does too (and says why not)."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import Lease, LeaseState
    from jupyter_gpupool.errors import PoolUnavailable

    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    lease = Lease(id="l-1", owner="alice", memory=8 * GIB, state=LeaseState.GRANTED, created_at=1.0, kernel_id="k-1")
    pool.file.put(lease, {"job_id": "7", "gres": "shard:1"})

    class SilentController:
        def scancel(self, job_id: str) -> None:
            raise PoolUnavailable("scancel: Unable to contact slurm controller (connect failure)")

    pool.commands = SilentController()  # type: ignore[assignment]
    with pytest.raises(PoolUnavailable, match="Unable to contact"):
        pool.release("l-1", reason="kernel shut down")
    kept, job = pool.file.row("l-1")
    assert kept.state is LeaseState.GRANTED and kept.release_reason == "" and "end_state" not in job
    pool.close()


def test_a_slurm_slice_does_not_burst_and_says_why_where_a_user_asks(tmp_path):
    """A limit on a kernelspec or ``%gpupool reserve --limit``, and a framework cap's grow: each is
    refused with Slurm's reason (shards are fixed at submit), and nothing is submitted."""
    from jupyter_gpupool.backends.contract import Capability, supports
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.errors import RequestRefused
    from jupyter_gpupool.kernel.client import InProcessPoolClient

    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    assert not supports(pool, Capability.GROW)
    why = "its job's GPU shards are fixed when the job is submitted"
    with pytest.raises(RequestRefused, match=f"nothing was submitted: .*{why}"):
        pool.request(LeaseRequest(owner="alice", memory=8 * GIB, burst_limit=32 * GIB))
    assert pool.leases(include_released=True) == []
    kernel = InProcessPoolClient(env={"GPUPOOL_LEASE_ID": "l-any"}, pool_factory=lambda: pool)
    with pytest.raises(RequestRefused, match=f"the slice was not grown: .*{why}"):
        kernel.grow(9 * GIB)
    with pytest.raises(RequestRefused, match=f"no limit was set: .*{why}"):
        kernel.reserve("8GiB", limit="32GiB")
    pool.close()


def test_a_kernel_launch_asks_slurm_for_its_node_off_the_event_loop(tmp_path, monkeypatch):
    """The launch reads the node's address (``scontrol show node``, when the pool's reading of the
    nodes is older than its cache) in a worker thread: on the server's event loop a controller that
    is slow to answer would stall every request of the server (GET /api/status too) meanwhile.
    Slurm's answers are scripted: the node list comes only once the event loop has run on."""
    import asyncio
    import threading

    from jupyter_client.kernelspec import KernelSpec

    from jupyter_gpupool.backends.slurm.commands import JobRecord
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import Lease, LeaseState
    from jupyter_gpupool.provisioner.kernel_provisioner import GpuPoolProvisioner
    from jupyter_gpupool.provisioner.slurm import SlurmProvisioner

    pool = SlurmPool(shards_per_gpu=8, gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    lease = Lease(
        id="l-1", owner="alice", memory=80 * GIB, state=LeaseState.GRANTED, created_at=1.0, kernel_id="k-1",
        devices=("slurm:node0:gpu0",),
    )  # fmt: skip
    pool.file.put(lease, {"job_id": "7", "gres": "shard:8", "node": "node0"})
    asked, loop_ran = threading.Event(), threading.Event()

    class SlowController:
        def squeue(self, job_ids: object = None, partition: str = "", states: str = "") -> list[JobRecord]:
            return [JobRecord("7", "gpupool-k-1", "RUNNING", "None", 1, "gpu", 1.0, "alice", "node0", "gres:shard:8")]

        def show_nodes(self) -> list[dict[str, str]]:
            asked.set()
            loop_ran.wait(5)  # never set while this call holds the event loop
            return [{"NodeName": "node0", "NodeAddr": "10.0.0.7", "Gres": "gpu:2,shard:16"}]

    pool.commands = SlowController()  # type: ignore[assignment]

    async def leased(self: GpuPoolProvisioner, **kwargs: object) -> dict[str, object]:
        return dict(kwargs)  # the lease is granted already (above); only the Slurm launch is under test

    monkeypatch.setattr(GpuPoolProvisioner, "pre_launch", leased)
    spec = KernelSpec(argv=["python", "-m", "ipykernel_launcher", "-f", "{connection_file}"], display_name="py")
    prov = SlurmProvisioner(kernel_id="k-1", kernel_spec=spec)
    prov._pool = pool
    prov.lease_id = "l-1"

    async def launch() -> dict[str, object]:
        async def meanwhile() -> None:
            while not asked.is_set():
                await asyncio.sleep(0.01)
            loop_ran.set()

        other = asyncio.ensure_future(meanwhile())
        kwargs = await prov.pre_launch(cmd=["python", "-m", "ipykernel_launcher", "-f", "conn.json"], env={})
        other.cancel()
        return kwargs

    kwargs = asyncio.run(launch())
    assert loop_ran.is_set(), "the event loop waited for scontrol show node"
    assert "--ip=10.0.0.7" in kwargs["cmd"] and "--jobid=7" in kwargs["cmd"]
    pool.close()


def test_the_pool_view_describes_the_partition_without_asking_slurm_again(tmp_path):
    """``GET /api/gpupool/pool`` describes the backend on the server's event loop, after its snapshot
    (in a worker thread) read the nodes: once read, the description never runs ``scontrol`` again,
    even when that reading is older than the cache (a snapshot that waited on a busy controller)."""
    import time

    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    pool = SlurmPool(gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    asked: list[str] = []

    class Controller:
        def show_nodes(self) -> list[dict[str, str]]:
            asked.append("scontrol show node")
            return [{"NodeName": "node0", "NodeAddr": "10.0.0.7", "Gres": "gpu:2,shard:16", "State": "IDLE"}]

    pool.commands = Controller()  # type: ignore[assignment]
    assert len(pool.devices()) == 2 and asked == ["scontrol show node"]  # the snapshot's reading
    assert pool._nodes is not None
    pool._nodes = (time.monotonic() - 3600, pool._nodes[1])  # an hour old
    described = "Slurm partition (default), 80 GiB GPUs, 8 shards of 10 GiB per GPU"
    assert pool.backend.describe() == described and asked == ["scontrol show node"]
    assert len(pool.devices()) == 2 and len(asked) == 2  # what the snapshot uses is read again, as before
    pool.close()


class ScriptedNodes:
    """Slurm's answers, scripted: ``scontrol show node`` answers each of ``answers`` in turn (an
    exception is raised: the controller timed out), ``sbatch`` records its arguments and the job pends."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.submitted: list[list[str]] = []

    def show_nodes(self) -> list[dict[str, str]]:
        self.asked += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, list)
        return answer

    def sbatch(self, args: list[str], script: str) -> str:
        self.submitted.append(list(args))
        return str(len(self.submitted))

    def squeue(self, job_ids: object = None, partition: str = "", states: str = "") -> list[object]:
        from jupyter_gpupool.backends.slurm.commands import JobRecord

        return [JobRecord(str(i + 1), "gpupool", "PENDING", "Resources", 1, "gpu", None, "alice", "", "") for i in range(len(self.submitted))]


TIMED_OUT = "scontrol did not answer within 30 s: is slurmctld up?"
SHARDED = [{"NodeName": "node0", "NodeAddr": "10.0.0.7", "Gres": "gpu:2,shard:16", "State": "IDLE"}]


def test_nodes_slurm_did_not_read_are_not_known_yet_never_whole_gpus(tmp_path, caplog):
    """The controller times out while the server starts: the start-up line and the pool view say the
    shards are not known yet and why, not "whole GPUs (no shard GRES)" (the partition has shards).
    A failed read is not kept forever: once the nodes are read (the snapshot, in a worker thread,
    or the description itself after UNREAD_RETRY seconds), the text is the real one, said in the log
    too; within UNREAD_RETRY the description does not ask Slurm again (it runs on the event loop)."""
    import logging
    import time

    from jupyter_gpupool.backends.slurm import pool as slurm_pool
    from jupyter_gpupool.errors import PoolUnavailable

    pool = slurm_pool.SlurmPool(gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    slurm = ScriptedNodes(PoolUnavailable(TIMED_OUT), PoolUnavailable(TIMED_OUT), SHARDED)
    pool.commands = slurm  # type: ignore[assignment]
    unknown = f"Slurm partition (default), 80 GiB GPUs, shards not known yet (the nodes could not be read: {TIMED_OUT})"
    assert pool.backend.describe() == unknown and slurm.asked == 1  # the start-up line
    UNREAD_RETRY = slurm_pool.UNREAD_RETRY
    assert pool.backend.describe() == unknown and slurm.asked == 1  # a view within UNREAD_RETRY: no scontrol
    assert pool._nodes_unread is not None
    pool._nodes_unread = (time.monotonic() - UNREAD_RETRY - 1, pool._nodes_unread[1])
    assert pool.backend.describe() == unknown and slurm.asked == 2  # read again: still silent
    with caplog.at_level(logging.INFO):
        assert len(pool.devices()) == 2 and slurm.asked == 3  # the snapshot's read: Slurm answers
    real = "Slurm partition (default), 80 GiB GPUs, 8 shards of 10 GiB per GPU"
    assert pool.backend.describe() == real and slurm.asked == 3
    assert any(f"Slurm answered: {real}" in r.getMessage() for r in caplog.records)

    later = slurm_pool.SlurmPool(gpu_memory="80GiB", state_path=str(tmp_path / "later.sqlite"))
    later.commands = ScriptedNodes(PoolUnavailable(TIMED_OUT), SHARDED)  # type: ignore[assignment]
    assert "not known yet" in later.backend.describe()
    assert later._nodes_unread is not None
    later._nodes_unread = (time.monotonic() - UNREAD_RETRY - 1, later._nodes_unread[1])
    assert later.backend.describe() == real  # the description's own read, once the failure is old
    pool.close()
    later.close()


def test_a_partition_without_shard_gres_is_said_to_have_whole_gpus(tmp_path):
    """Slurm answers, and the partition's nodes have GPUs but no shard GRES: that, and only that, is
    "whole GPUs (no shard GRES)", and a slice asks for a whole GPU."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import LeaseRequest

    pool = SlurmPool(gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    slurm = ScriptedNodes([{"NodeName": "node0", "Gres": "gpu:a100:4(S:0-1)", "State": "IDLE"}])
    pool.commands = slurm  # type: ignore[assignment]
    assert pool.backend.describe() == "Slurm partition (default), 80 GiB GPUs, whole GPUs (no shard GRES)"
    pool.request(LeaseRequest(owner="alice", memory=8 * GIB))
    assert "--gres=gpu:1" in slurm.submitted[0]
    pool.close()


def test_a_partition_slurm_lists_no_node_of_is_said_so_not_whole_gpus(tmp_path):
    """Slurm answers, but no node is in the partition (a misspelt ``c.SlurmPool.partition``): the
    pool says so, not "whole GPUs (no shard GRES)", which would send the admin looking at GRES."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    pool = SlurmPool(gpu_memory="80GiB", partition="gpuz", state_path=str(tmp_path / "leases.sqlite"))
    pool.commands = ScriptedNodes([{**SHARDED[0], "Partitions": "gpu"}])  # type: ignore[assignment]
    described = pool.backend.describe()
    assert "no nodes in partition gpuz (Slurm lists none: check c.SlurmPool.partition" in described, described
    assert "whole GPUs" not in described and pool.devices() == []
    pool.close()


def test_a_slice_is_not_asked_as_a_whole_gpu_while_the_shards_are_not_known(tmp_path):
    """``scontrol show node`` fails while a kernel asks for 8 GiB: nothing is submitted (no
    ``--gres=gpu:1`` in place of one shard), and the error says why; a slice of whole GPUs needs no
    shards and is submitted. Once Slurm answers, the slice is asked for in shards."""
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.errors import PoolUnavailable

    pool = SlurmPool(gpu_memory="80GiB", state_path=str(tmp_path / "leases.sqlite"))
    slurm = ScriptedNodes(PoolUnavailable(TIMED_OUT), SHARDED)
    pool.commands = slurm  # type: ignore[assignment]
    why = f"nothing was submitted: the partition's GPU shards are not known yet, the nodes could not be read ({TIMED_OUT})"
    with pytest.raises(PoolUnavailable, match=re.escape(why)):
        pool.request(LeaseRequest(owner="alice", memory=8 * GIB))
    assert slurm.submitted == [] and pool.leases(include_released=True) == []
    pool.request(LeaseRequest(owner="alice", memory=8 * GIB, num_gpus=2))
    pool.request(LeaseRequest(owner="alice", memory=8 * GIB))  # Slurm answers now
    assert [a for args in slurm.submitted for a in args if a.startswith("--gres")] == ["--gres=gpu:2", "--gres=shard:1"]
    pool.close()
