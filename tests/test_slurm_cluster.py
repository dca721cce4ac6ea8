"""The Slurm backend against a real single-node Slurm cluster (``tests/slurm_cluster.py``):
kernels started through a real ``jupyter server`` run as Slurm jobs on GRES shards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from server_process import Server, free_port, wait_for
from slurm_cluster import LOAD_MARGIN, SlurmCluster, skip_reason

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or ""),
]  # slow: a real Slurm cluster per test

GIB = 1 << 30
#: Slurm commands a server request may run one after the other: a queued kernel's status reads its
#: job, the partition's pending jobs, its fair share and, for a running job, its GPUs.
SERVER_ROUND_TRIPS = 5
#: Seconds a jupyter server takes to start on a loaded host, before its first Slurm command.
SERVER_START = 60
#: Seconds jupyter_client may take to shut a kernel down on a loaded host (its request, then SIGTERM, then SIGKILL).
KERNEL_SHUTDOWN = 30


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    root = Path(tempfile.mkdtemp(prefix="gpupool-slurm-"))
    running = SlurmCluster(root).start()
    try:
        yield running
    finally:
        running.stop()
        assert running.daemons_alive() == [], "the fixture left Slurm daemons running"


@pytest.fixture
def slurm(cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    cluster.cancel_all()
    yield cluster
    cluster.cancel_all()


def start_server(
    tmp: Path, cluster: SlurmCluster, name: str = "alice", extension: dict[str, Any] | None = None, **extra_env: str
) -> Server:
    """A server on the cluster; ``extension``: GpuPoolExtension settings over the fast defaults here."""
    config = tmp / name / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "jupyter_server_config.json").write_text(
        json.dumps(
            {
                "GpuPoolExtension": {"tick_interval": 0.5, "reconcile_interval": 1.0, **(extension or {})},
                "SlurmPool": {"cache_seconds": 0.3, "poll_interval": 0.5},
            }
        )
    )
    env = {
        **cluster.env,
        "GPUPOOL_BACKEND": "slurm",
        "GPUPOOL_SLURM_STATE": str(tmp / "slurm-leases.sqlite"),
        "GPUPOOL_DEFAULT_MEMORY": "80GiB",  # GPUs of 80 GiB with 8 shards each: 8 shards, one GPU's
        "GPUPOOL_USER": name,
        "GPUPOOL_DB": None,
        "GPUPOOL_SIMULATE": None,
        "GPUPOOL_URL": None,
        "GPUPOOL_IDLE_POLICY": "never",
        **extra_env,
    }
    return SlurmServer(tmp, name, env, cluster)


class SlurmServer(Server):
    """A real ``jupyter server`` with only the extensions these tests need (it starts faster).
    How long it may take to answer is the cluster's: see :meth:`call`."""

    def __init__(self, tmp: Path, user: str, env: dict[str, str | None], cluster: SlurmCluster) -> None:
        self.cluster = cluster
        self.port = free_port()
        self.token = f"{user}-server-token"
        self.root = tmp / user
        self.root.mkdir(exist_ok=True)
        environ = {
            **os.environ,
            "JUPYTER_RUNTIME_DIR": str(self.root / "runtime"),
            "JUPYTER_CONFIG_DIR": str(self.root / "config"),
        }
        for key, value in env.items():
            if value is None:
                environ.pop(key, None)
            else:
                environ[key] = value
        self.log_path = self.root / "server.log"
        self.log = open(self.log_path, "a")  # noqa: SIM115 (closed in stop)
        only = {
            name: False
            for name in ("jupyter_server_terminals", "jupyterlab", "notebook", "notebook_shim", "jupyter_lsp")
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyter", "server", f"--port={self.port}", "--no-browser", "--allow-root",
             f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
             f"--ServerApp.jpserver_extensions={ {**only, 'jupyter_gpupool': True} }"],
            env=environ, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        # The extension reads the partition's nodes (one Slurm command) as it loads.
        wait_for(self._up, SERVER_START + cluster.round_trip, f"{user}'s server to start (log: {self.log_path})")

    def call(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """As :meth:`Server.call`; by default the answer may take :data:`SERVER_ROUND_TRIPS` Slurm
        commands in a row on this cluster (a busy controller takes up to MessageTimeout for each)."""
        bound = self.cluster.within(SERVER_ROUND_TRIPS) if timeout is None else timeout
        return super().call(method, path, body, timeout=bound)

    def _up(self) -> bool:
        try:
            self.call("GET", "api/status")
            return True
        except (OSError, ConnectionError):
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited: {self.log_path.read_text()[-2000:]}") from None
            return False


def slice_of(server: Server, kernel_id: str) -> dict[str, Any]:
    return server.call("GET", f"api/gpupool/kernels/{kernel_id}")


def squeue(cluster: SlurmCluster) -> dict[str, str]:
    out = cluster.run(["squeue", "-h", "-o", "%i %T"])
    return dict(line.split() for line in out.splitlines() if line.strip())


def execute(server: SlurmServer, kernel_id: str, code: str, timeout: float | None = None) -> str:
    """Run ``code`` in the kernel through the server's websocket; its stdout (errors raise).
    ``timeout``: seconds for the reply; by default as long as a server request may take."""
    timeout = server.cluster.within(SERVER_ROUND_TRIPS) if timeout is None else timeout
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    async def run() -> str:
        url = f"ws://127.0.0.1:{server.port}/api/kernels/{kernel_id}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers={"Authorization": f"token {server.token}"}))
        msg_id = uuid.uuid4().hex
        await ws.write_message(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "username": "t",
                        "session": uuid.uuid4().hex,
                        "msg_type": "execute_request",
                        "version": "5.3",
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": False,
                        "user_expressions": {},
                        "allow_stdin": False,
                    },
                    "channel": "shell",
                }
            )
        )
        out: list[str] = []
        replied = idle = False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            raw = await asyncio.wait_for(ws.read_message(), timeout=deadline - time.monotonic())
            if raw is None:
                raise AssertionError("the kernel's websocket closed")
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "stream":
                out.append(msg["content"]["text"])
            elif kind in ("display_data", "execute_result"):
                out.append(msg["content"]["data"].get("text/plain", ""))
            elif kind == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif kind == "execute_reply":
                replied = True
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
            if replied and idle:  # iopub and shell are not ordered with each other: wait for both
                ws.close()
                return "".join(out)
        raise AssertionError(f"no reply within {timeout} s")

    return asyncio.run(run())


def test_three_kernels_on_a_16_shard_node_two_run_as_jobs_the_third_pends_in_slurms_words(slurm, tmp_path):
    server = start_server(tmp_path, slurm)
    try:
        kernels = [server.call("POST", "api/kernels", {"name": "python3"})["id"] for _ in range(3)]

        def states() -> dict[str, str]:
            return {k: slice_of(server, k)["state"] for k in kernels}

        wait_for(
            lambda: sorted(states().values()) == ["granted", "granted", "queued"],
            slurm.within(4),
            "two granted and one queued",
        )
        granted = [k for k, s in states().items() if s == "granted"]
        queued = next(k for k, s in states().items() if s == "queued")
        # Right after submission Slurm's reason is "None" until its scheduler has looked at the job.
        # The reason in words comes from the pool's queue read, which may lag the job's own read by a cache.
        view = wait_for(
            lambda: (
                (v := slice_of(server, queued))["slurm"]["pending_reason"] != "None"
                and "has not looked at it yet" not in (v["queue_reason"] or "")
                and v
            ),
            slurm.within(2),
            "a pending reason",
        )
        assert view["state"] == "queued" and view["queue_position"] == 1 and view["queue_length"] == 1
        assert "GPUs it needs are in use" in view["queue_reason"] and "Resources" in view["queue_reason"]
        assert view["slurm"]["partition"] == "gpu" and view["slurm"]["position"] == 1
        assert isinstance(view["slurm"]["fair_share"], float)  # sprio's factor (0 here: no slurmdbd, no usage)
        # The backfill scheduler's expected start: when a running job reaches its 8 h time limit.
        view = wait_for(
            lambda: (v := slice_of(server, queued))["estimated_wait"] and v, slurm.within(2), "an expected start"
        )
        assert 7.9 * 3600 < view["estimated_wait"] <= 8 * 3600 and view["slurm"]["estimated_start"] > time.time()
        jobs = squeue(slurm)
        assert jobs[view["slurm"]["job_id"]] == "PENDING"
        running_views = [slice_of(server, k) for k in granted]
        assert {jobs[v["slurm"]["job_id"]] for v in running_views} == {"RUNNING"}
        assert all(v["slurm"]["gres"] == "shard:8" and v["memory"] == 80 * GIB for v in running_views)

        # Inside a running kernel: Slurm's GPU and the slice's limit.
        first = granted[0]
        env = json.loads(
            execute(
                server,
                first,
                "import os, json; print(json.dumps({k: os.environ.get(k) for k in "
                "('CUDA_VISIBLE_DEVICES', 'SLURM_SHARDS_ON_NODE', 'GPUPOOL_MEMORY_LIMIT', 'SLURM_JOB_ID')}))",
            )
        )
        assert env["SLURM_SHARDS_ON_NODE"] == "8"
        assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1")
        assert env["GPUPOOL_MEMORY_LIMIT"] == str(80 * GIB)
        assert env["SLURM_JOB_ID"] == running_views[0]["slurm"]["job_id"]

        # %gpupool status in the kernel names the job and the partition.
        status = execute(server, first, "get_ipython().run_line_magic('gpupool', 'status')")
        assert f"job {env['SLURM_JOB_ID']}" in status and "partition gpu" in status

        # Shutting a running kernel down cancels its job; the pending one starts and runs code.
        first_job = running_views[0]["slurm"]["job_id"]
        server.call("DELETE", f"api/kernels/{first}")
        wait_for(lambda: first_job not in squeue(slurm), slurm.within(2), "the first kernel's job to be cancelled")
        wait_for(
            lambda: slice_of(server, queued)["state"] == "granted", slurm.within(4), "the third kernel's job to start"
        )
        assert execute(server, queued, "print(6 * 7)").strip() == "42"

        # scancel from outside: the kernel is gone, with the reason.
        second = granted[1]
        second_job = running_views[1]["slurm"]["job_id"]
        slurm.run(["scancel", second_job])

        def gone() -> bool:
            return second not in {k["id"] for k in server.call("GET", "api/kernels")}

        wait_for(gone, slurm.within(2), "the cancelled kernel to be gone")
        assert slice_of(server, second)["state"] == "released"
        # While Slurm still kills the job's processes it says "is ending"; then how it ended.
        reason = f"ended by Slurm: job {second_job} was cancelled (scancel)"
        wait_for(
            lambda: slice_of(server, second)["release_reason"] == reason, slurm.within(2), "Slurm's reason for the end"
        )
    finally:
        server.stop()


def test_restart_keeps_the_job_a_pending_kernel_just_waits_and_a_job_that_dies_takes_its_kernel_along(slurm, tmp_path):
    server = start_server(tmp_path, slurm)
    try:
        first = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_for(
            lambda: slice_of(server, first)["state"] == "granted", slurm.within(4), "the first kernel's job to run"
        )
        job = slice_of(server, first)["slurm"]["job_id"]
        execute(server, first, "x = 1")
        server.call("POST", f"api/kernels/{first}/restart")
        assert execute(server, first, "print('x' in globals())").strip() == "False"  # a new kernel process ...
        assert slice_of(server, first)["slurm"]["job_id"] == job  # ... in the same job, which never stopped
        assert squeue(slurm)[job] == "RUNNING"

        # An interrupt reaches the kernel in its step (as a control message; a signal to srun would not).
        import threading

        outcome: list[str] = []

        def long_cell() -> None:
            try:
                execute(server, first, "import time; time.sleep(60)")
                outcome.append("finished")
            except AssertionError as err:
                outcome.append(str(err))

        cell = threading.Thread(target=long_cell)
        cell.start()
        # Interrupt once the cell runs (the server has seen the kernel busy): one sent before would find nothing to stop.
        wait_for(
            lambda: server.call("GET", f"api/kernels/{first}")["execution_state"] == "busy",
            slurm.within(2),
            "the cell to run",
        )
        server.call("POST", f"api/kernels/{first}/interrupt")
        cell.join(slurm.within(2))
        assert outcome and "KeyboardInterrupt" in outcome[0]
        assert len(slurm.run(["sacct", "--completion", "-a", "-n", "-X", "-j", job, "-o", "JobID"]).split()) == 0

        # The kernel's process dies on its node: jupyter_server's restarter starts it again within its
        # time_to_dead (3 s), and the server's reconciliations meanwhile (every 1 s here) keep its job.
        died = int(execute(server, first, "import os; print(os.getpid())").strip())
        os.kill(died, signal.SIGKILL)

        def restarted() -> int | None:
            try:
                # A short wait per try: the first ones go to the dead process and are never answered.
                pid = int(execute(server, first, "import os; print(os.getpid())", timeout=LOAD_MARGIN).strip())
            except Exception:  # noqa: BLE001 - not back yet: the restart is under way
                return None
            return pid if pid != died else None

        wait_for(restarted, slurm.within(4), "the restarter to start the kernel again")
        assert slice_of(server, first)["slurm"]["job_id"] == job  # the same job, never given back
        assert squeue(slurm)[job] == "RUNNING"

        second = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_for(
            lambda: slice_of(server, second)["state"] == "granted", slurm.within(4), "the second kernel's job to run"
        )
        third = server.call("POST", "api/kernels", {"name": "python3"})
        assert third["execution_state"] == "starting"  # pending kernels: answered while its job pends, no blocking
        third_id = third["id"]
        wait_for(lambda: slice_of(server, third_id)["state"] == "queued", slurm.within(2), "the third kernel to pend")
        time.sleep(4)  # nothing times a waiting kernel out: it is still there, still a pending job
        assert slice_of(server, third_id)["state"] == "queued"
        assert third_id in {k["id"] for k in server.call("GET", "api/kernels")}
        assert squeue(slurm)[slice_of(server, third_id)["slurm"]["job_id"]] == "PENDING"

        # The first job dies on its own (its holder killed): the kernel is gone with Slurm's word for it,
        # and is not resubmitted; the pending kernel gets the GPU and runs.
        slurm.run(["scancel", "--batch", "--signal=KILL", job])
        wait_for(
            lambda: first not in {k["id"] for k in server.call("GET", "api/kernels")},
            slurm.within(2),
            "the first kernel to be gone",
        )
        wait_for(
            lambda: slice_of(server, first)["release_reason"].startswith(f"ended by Slurm: job {job} failed"),
            slurm.within(2),
            "Slurm's reason",
        )
        wait_for(
            lambda: slice_of(server, third_id)["state"] == "granted", slurm.within(4), "the third kernel's job to run"
        )
        assert execute(server, third_id, "print(6 * 7)").strip() == "42"
        assert len([j for j, s in squeue(slurm).items() if s == "RUNNING"]) == 2  # nothing resubmitted for the first

        # Shutting down a kernel that still pends cancels its pending job at once.
        fourth = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        pending_job = wait_for(
            lambda: slice_of(server, fourth).get("slurm", {}).get("job_id"), slurm.within(2), "the fourth kernel's job"
        )
        assert squeue(slurm)[pending_job] == "PENDING"
        server.call("DELETE", f"api/kernels/{fourth}")  # answered although the job never starts: no wait for it
        wait_for(lambda: pending_job not in squeue(slurm), slurm.within(2), "the pending job to be cancelled")
        assert slice_of(server, fourth)["release_reason"] == "kernel shut down while queued"
    finally:
        server.stop()


def silenceable_slurm_commands(folder: Path, silence: Path) -> Path:
    """A folder of ``squeue`` and ``sacct`` that fail as a busy slurmctld makes them fail while the
    file ``silence`` exists, and run the real commands otherwise; put it first on a server's PATH."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("squeue", "sacct"):
        real = shutil.which(name)
        assert real, name
        script = folder / name
        script.write_text(
            f"#!/bin/sh\nif [ -e '{silence}' ]; then\n"
            "  echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1\nfi\n"
            f'exec {real} "$@"\n'
        )
        script.chmod(0o755)
    return folder


def test_a_restart_while_slurm_does_not_answer_waits_for_it_and_never_leaves_the_job(slurm, tmp_path):
    """The kernel's job is killed while slurmctld is too busy to answer (squeue and sacct time out):
    the restarter restarts the kernel, and the restart cannot learn whether the job still runs. It
    waits for Slurm's answer instead of starting the kernel CPU-only on the server's host, outside
    any job (as a first start with the pool unavailable would); once Slurm answers the kernel is
    gone with Slurm's reason."""
    silence = tmp_path / "slurmctld-busy"
    commands = silenceable_slurm_commands(tmp_path / "bin", silence)
    # The server's reconcile, which releases the slice of a kernel whose process died before the
    # restarter restarts it, is kept out of the way: this test is about the restart. (Should it run
    # first, the restart queues a new job: a race of its own, not this one.)
    server = start_server(
        tmp_path, slurm, extension={"reconcile_interval": 600.0}, PATH=f"{commands}:{os.environ['PATH']}"
    )
    try:
        kernel = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        wait_for(lambda: slice_of(server, kernel)["state"] == "granted", slurm.within(4), "the kernel's job to run")
        job = slice_of(server, kernel)["slurm"]["job_id"]
        assert execute(server, kernel, "print(6 * 7)").strip() == "42"
        silence.write_text("")
        slurm.run(["scancel", "--batch", "--signal=KILL", job])
        wait_for(lambda: "restarts once Slurm answers" in server.log_path.read_text(), 30, "the restart to wait for Slurm")
        silence.unlink()
        wait_for(
            lambda: kernel not in {k["id"] for k in server.call("GET", "api/kernels")},
            slurm.within(2) + KERNEL_SHUTDOWN,
            "the kernel to be gone",
        )
        assert slice_of(server, kernel)["release_reason"].startswith(f"ended by Slurm: job {job}")
        assert "starts CPU-only" not in server.log_path.read_text()
    finally:
        with contextlib.suppress(FileNotFoundError):
            silence.unlink()
        server.stop()


def test_an_idle_kernel_gives_its_job_back_while_another_pends_unless_kept_and_jobs_outlive_a_killed_server(
    slurm, tmp_path
):
    from jupyter_gpupool.backends.slurm.pool import SlurmPool

    server = start_server(
        tmp_path, slurm, GPUPOOL_IDLE_POLICY="pressure", GPUPOOL_IDLE_TIMEOUT="2", GPUPOOL_WARNING_PERIOD="2"
    )
    try:
        kept, idle = (server.call("POST", "api/kernels", {"name": "python3"})["id"] for _ in range(2))
        wait_for(
            lambda: {slice_of(server, k)["state"] for k in (kept, idle)} == {"granted"},
            slurm.within(4),
            "both kernels' jobs to run",
        )
        server.call("POST", f"api/gpupool/kernels/{kept}/keepalive", {"duration": "1h"})
        waiting = server.call("POST", "api/kernels", {"name": "python3"})["id"]
        warned = wait_for(
            lambda: (v := slice_of(server, idle))["reclaim_at"] and v, slurm.within(2), "the idle kernel to be warned"
        )
        assert (
            warned["reclaim_reason"].startswith("reclaimed: idle for")
            and "waited in partition gpu" in warned["reclaim_reason"]
        )
        job = warned["slurm"]["job_id"]
        wait_for(
            lambda: idle not in {k["id"] for k in server.call("GET", "api/kernels")},
            slurm.within(2) + KERNEL_SHUTDOWN,  # its 2 s warning, a scancel, and jupyter_client's shutdown
            "the idle kernel to be shut down",
        )
        assert slice_of(server, idle)["release_reason"].startswith("reclaimed: idle for")
        # Slurm lists a cancelled job as COMPLETING for a moment before it leaves the queue.
        assert squeue(slurm).get(job) in (None, "COMPLETING")
        wait_for(lambda: job not in squeue(slurm), slurm.within(2), "the idle kernel's job to leave the queue")
        wait_for(
            lambda: slice_of(server, waiting)["state"] == "granted", slurm.within(4), "the waiting kernel's job to run"
        )
        kept_view = slice_of(server, kept)
        assert kept_view["state"] == "granted" and kept_view["reclaim_at"] is None
    finally:
        server.proc.send_signal(signal.SIGKILL)  # no clean shutdown: the jobs stay behind
        server.proc.wait()
        server.stop()

    # The lease <-> job mapping is in the lease file: the jobs outlive the server and are still known.
    assert squeue(slurm)[kept_view["slurm"]["job_id"]] == "RUNNING"
    state = str(tmp_path / "slurm-leases.sqlite")
    pool = SlurmPool.from_env(environ={**os.environ, **slurm.env, "GPUPOOL_SLURM_STATE": state})
    lease = pool.lease_for_kernel(kept)
    assert lease is not None and lease.id == kept_view["lease_id"]
    assert pool.job_of(lease.id)["job_id"] == kept_view["slurm"]["job_id"]

    # The next server on the same lease file finds the jobs of the dead server's kernels and cancels them.
    again = start_server(tmp_path, slurm, name="alice-again")
    try:
        wait_for(lambda: not squeue(slurm), slurm.within(2), "the orphaned jobs to be cancelled")
        released = pool.get(lease.id)
        assert released.state.value == "released" and "holder process" in released.release_reason
    finally:
        again.stop()
        pool.close()


def test_report_by_user_matches_sacct(slurm, tmp_path):
    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.provisioner.slurm import SlurmLeaseRequest

    env = {
        **os.environ,
        **slurm.env,
        "GPUPOOL_BACKEND": "slurm",
        "GPUPOOL_SLURM_STATE": str(tmp_path / "leases.sqlite"),
    }
    pool = SlurmPool.from_env(environ=env)
    # A kernelspec's Slurm placement (SlurmProvisioner.time_limit, partition, ...) reaches sbatch.
    small = pool.request(SlurmLeaseRequest(owner="alice", memory=20 * GIB, kernel_id="k-small", time_limit="0:30:00"))
    large = pool.request(LeaseRequest(owner="alice", memory=80 * GIB, kernel_id="k-large"))  # shard:8
    wait_for(
        lambda: all(pool.get(x.id).state.value == "granted" for x in (small, large)),
        slurm.within(2),
        "both jobs to run",
    )
    time.sleep(2.2)
    for lease in (small, large):
        pool.release(lease.id, "done")
    jobs = {lease.id: pool.job_of(lease.id)["job_id"] for lease in (small, large)}
    assert pool.job_of(small.id)["gres"] == "shard:2"
    assert "TimeLimit=00:30:00" in slurm.run(["scontrol", "show", "job", jobs[small.id]])
    wait_for(lambda: not set(jobs.values()) & set(squeue(slurm)), slurm.within(2), "both jobs to end")

    out = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.apps.cli", "report", "--by", "user", "--format", "json"],
        capture_output=True, text=True, env=env, timeout=slurm.within(4), check=True,
    ).stdout  # fmt: skip
    rows = json.loads(out)

    # What Slurm itself recorded (its job-completion log), computed here independently.
    records = slurm.run(
        ["sacct", "--completion", "-a", "-p", "-n", "-X", "-j", ",".join(jobs.values()), "-o", "JobID,User,ElapsedRaw"]
    )
    elapsed = {
        line.split("|")[0]: (line.split("|")[1].split("(")[0], int(line.split("|")[2])) for line in records.splitlines()
    }
    assert set(elapsed) == set(jobs.values())
    users = {user for user, _ in elapsed.values()}
    assert [row["user"] for row in rows] == sorted(users)
    seconds = {
        jobs[small.id]: (elapsed[jobs[small.id]][1], 20, 2 / 8),
        jobs[large.id]: (elapsed[jobs[large.id]][1], 80, 8 / 8),
    }
    assert rows[0]["leases"] == 2
    assert rows[0]["gib_hours_held"] == round(sum(s * gib for s, gib, _ in seconds.values()) / 3600, 4)
    assert rows[0]["gpu_hours"] == round(sum(s * gpus for s, _, gpus in seconds.values()) / 3600, 4)
    assert all(s >= 2 for s, _, _ in seconds.values())
    pool.close()


def test_a_controller_outage_releases_nothing_and_a_pending_wait_rides_it_out(slurm, tmp_path):
    import threading

    from jupyter_gpupool.backends.slurm.pool import SlurmPool
    from jupyter_gpupool.core.models import LeaseRequest
    from jupyter_gpupool.errors import PoolUnavailable

    env = {**os.environ, **slurm.env, "GPUPOOL_SLURM_STATE": str(tmp_path / "leases.sqlite")}
    pool = SlurmPool.from_env(environ=env)
    pool.cache_seconds = 0.0
    first, second, waiting = (
        pool.request(LeaseRequest(owner="alice", memory=80 * GIB, kernel_id=f"k-{i}")) for i in range(3)
    )
    wait_for(
        lambda: pool.get(waiting.id).state.value == "queued" and pool.get(first.id).state.value == "granted",
        slurm.within(2),
        "two jobs running, one pending",
    )
    job = pool.job_of(first.id)["job_id"]
    outcome: list[str] = []
    # How long the outage below may last: the stop, three commands that fail, the restart's two waits.
    outage = slurm.command_timeout + slurm.within(3) + 2 * slurm.within(4)

    def wait() -> None:
        try:
            outcome.append(pool.wait_for_grant(waiting.id, timeout=outage + slurm.within(2)).state.value)
        except Exception as err:  # noqa: BLE001 - what ended the wait is the test's finding
            outcome.append(f"{type(err).__name__}: {err}")

    waiter = threading.Thread(target=wait)
    # During the outage the pool's commands give up on the stopped controller in seconds (a shorter
    # MessageTimeout); before and after it they wait as long as any client of the cluster.
    pool.commands.env = {**env, **slurm.outage_env()}
    slurm.stop_controller()
    try:
        waiter.start()
        with pytest.raises(PoolUnavailable, match="^squeue failed: .*Unable to contact slurm controller"):
            pool.get(first.id)
        with pytest.raises(PoolUnavailable):
            pool.tick()  # the server's loop logs this once; no lease is released
        with pytest.raises(PoolUnavailable, match="^scancel failed"):
            pool.release(first.id, "shut down during the outage")
    finally:
        slurm.start_controller()
        pool.commands.env = env
    assert pool.get(first.id).state.value == "granted" and squeue(slurm)[job] == "RUNNING"  # nothing released
    assert waiter.is_alive() and not outcome  # the pending wait did not fail with the controller ...
    assert pool.get(waiting.id).state.value == "queued"  # ... and its job still pends
    pool.release(waiting.id, "withdrawn")  # (Slurm takes its time to schedule after a restart: end it here)
    waiter.join(slurm.within(2))
    assert outcome == ["RequestRefused: the request was withdrawn before it was granted"]
    for lease in (first, second):
        pool.release(lease.id, "done")
    pool.close()


def test_starting_a_cluster_never_kills_another_live_cluster_only_an_orphaned_one(cluster):
    """Every cluster start reaps the daemons of clusters whose test run died; a cluster of another
    worker or run on the host, alive, must come through whole (its ``munged`` names its folder
    after ``--socket=``, which once read as a folder of nobody's and was killed)."""
    from slurm_cluster import reap_stale_clusters

    alive_before = {name: proc.pid for name, proc in cluster.processes.items()}
    orphan = SlurmCluster(Path(tempfile.mkdtemp(prefix="gpupool-slurm-")))
    orphan._write_config()
    ended = subprocess.Popen(["true"])
    ended.wait()
    (orphan.root / "owner.pid").write_text(str(ended.pid))  # its run is gone
    orphan.start_munged()
    munged = orphan.processes["munged"]
    try:
        killed = reap_stale_clusters()
        assert munged.wait(timeout=10) == -signal.SIGKILL, "an orphaned cluster's munged was left running"
        assert munged.pid in killed
        assert {name: proc.pid for name, proc in cluster.processes.items() if proc.poll() is None} == alive_before
        assert set(killed).isdisjoint(alive_before.values())
        assert cluster.controller_up()
    finally:
        orphan.stop()
