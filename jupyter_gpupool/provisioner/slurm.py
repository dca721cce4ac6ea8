"""``gpupool-slurm-provisioner``: a kernel runs as a step of its own Slurm job.

The kernel start asks the :class:`~jupyter_gpupool.backends.slurm.pool.SlurmPool` for a lease, which
submits a holder job with the slice as a GRES request and waits, as a pending job, for as long as
Slurm makes it wait (no timeout: ``use_pending_kernels`` keeps the server responsive meanwhile).
Once the job runs, the kernel is launched into it with ``srun --jobid=J --overlap``: Slurm sets
``CUDA_VISIBLE_DEVICES`` and ``SLURM_SHARDS_ON_NODE`` for the step, and the provisioner adds the
same ``GPUPOOL_*`` environment, framework caps and ``--ext=jupyter_gpupool.kernel`` as on one host.

**How the kernel connects back: a shared filesystem.** The kernel is started with ``-f`` naming a
file in :attr:`SlurmProvisioner.connection_dir` that does not exist yet and ``--ip`` set to the
node's address (``NodeAddr``); ipykernel binds free ports on the node and writes its connection
file there (ports and HMAC key); the server reads it and connects. On a cluster the directory must
be on a filesystem the login and compute nodes share (``$HOME`` usually is). The other way, for
clusters without one, is to report back to a listening port: the server would open a one-shot
TCP listener and pass its address to a small launcher in the job, which would bind the kernel and
send the connection info back over that socket (what ``jupyter_enterprise_gateway``'s remote
provisioners do); see docs/hpc.md.

A restart kills the step only and starts a new one in the same job: the slice is kept. A shutdown
cancels the job. A job that ends on its own (time limit, preemption, node failure, ``scancel``
from outside) leaves the kernel gone with Slurm's reason; it is not resubmitted. A restart never
leaves its job: while Slurm does not answer (a busy slurmctld) it waits for the answer, and if none
comes it fails, rather than run the kernel CPU-only on the server's host as a first start would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from jupyter_client.connect import KernelConnectionInfo
from traitlets import Float, Unicode

from jupyter_gpupool.backends.slurm.pool import PROVISIONER_NAME, SlurmPool
from jupyter_gpupool.core.models import Lease, LeaseRequest
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.provisioner.kernel_provisioner import (
    GpuPoolProvisioner,
    LeaseWaitAborted,
    one_line,
    server_binding,
)

STEP_NAME = "gpupool-kernel"


@dataclass(frozen=True)
class SlurmLeaseRequest(LeaseRequest):
    """A lease request with the job's Slurm placement (empty: the pool's configured default)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time_limit: str = ""


def _srun_env(env: dict[str, str]) -> dict[str, str]:
    """The server's environment for ``srun``, less the ``SLURM_*`` variables of a job the server
    itself may run in (Open OnDemand), which srun would take as options; ``SLURM_CONF`` stays."""
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


class SlurmProvisioner(GpuPoolProvisioner):
    """Run the kernel as a step of a Slurm job that holds its GPU slice."""

    partition = Unicode("", config=True, help="Partition for this kernelspec's jobs. Empty: c.SlurmPool.partition.")
    account = Unicode("", config=True, help="Account for this kernelspec's jobs. Empty: c.SlurmPool.account.")
    qos = Unicode("", config=True, help="QOS for this kernelspec's jobs. Empty: c.SlurmPool.qos.")
    time_limit = Unicode(
        "", config=True, help="Time limit for this kernelspec's jobs (e.g. 2:00:00). Empty: c.SlurmPool.time_limit."
    )
    connection_dir = Unicode(
        "",
        config=True,
        help="Folder, shared by the login and compute nodes, where a kernel in its job writes its connection file. "
        "Empty: 'connections' beside the Slurm lease file.",
    )
    connect_timeout = Float(
        120.0,
        config=True,
        help="Seconds a kernel whose job already runs may take to write its connection file. (Waiting for the job "
        "to start has no limit.)",
    )
    kernel_ip = Unicode(
        "", config=True, help="Address the kernel binds on its node. Empty: the node's NodeAddr in Slurm."
    )
    restart_answer_timeout = Float(
        60.0,
        config=True,
        help="Seconds a restart waits for Slurm to answer about the kernel's job (slurmctld busy or down). "
        "Past them the restart fails, saying so; the kernel is never restarted outside its job.",
    )

    job_id: str | None = None
    step_id: str | None = None
    kernel_connection_file: str | None = None

    @property
    def slurm_pool(self) -> SlurmPool:
        pool = self.pool
        if not isinstance(pool, SlurmPool):
            raise LeaseWaitAborted(
                f"{PROVISIONER_NAME} needs the Slurm backend: set c.GpuPool.backend = 'slurm' (or GPUPOOL_BACKEND=slurm)"
            )
        return pool

    def build_request(self) -> SlurmLeaseRequest:
        base = super().build_request()
        values = {name: getattr(base, name) for name in LeaseRequest.__dataclass_fields__}
        return SlurmLeaseRequest(
            **values, partition=self.partition, account=self.account, qos=self.qos, time_limit=self.time_limit
        )

    async def acquire(self) -> Lease:
        """As on one host; a restart (the job's lease is known) waits for Slurm to answer about the
        job, retrying with backoff for :attr:`restart_answer_timeout`, then fails: its job may have
        ended, and a CPU-only kernel on the server's host would have left it."""
        if not self.lease_id:
            return await super().acquire()
        deadline = time.monotonic() + self.restart_answer_timeout
        delay = 0.5
        while True:
            try:
                return await super().acquire()
            except PoolUnavailable as err:
                if time.monotonic() + delay > deadline:
                    raise LeaseWaitAborted(
                        f"kernel {self.kernel_id} did not restart: Slurm did not answer about its job "
                        f"{self.job_id or ''} within {self.restart_answer_timeout:g} s ({one_line(err)}); "
                        "restart it once Slurm answers"
                    ) from None
                self.log.info(
                    "gpupool: kernel %s restarts once Slurm answers about its job: %s", self.kernel_id, one_line(err)
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- launch ---------------------------------------------------------------------------------
    def _connection_dir(self) -> Path:
        if self.connection_dir:
            return Path(self.connection_dir)
        return Path(os.path.abspath(self.slurm_pool.state_path)).parent / "connections"

    def _node_address(self, node: str) -> str:
        if self.kernel_ip:
            return self.kernel_ip
        for record in self.slurm_pool._node_records():
            if record.get("NodeName") == node:
                return record.get("NodeAddr") or node
        return node

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        """Wait for the job to run, then make the launch an ``srun`` step in it."""
        km = self.parent
        if km is not None:
            from jupyter_client.localinterfaces import localhost

            km.ip = localhost()  # the last kernel's node address is not ours to check as local
        kwargs = await super().pre_launch(**kwargs)
        if not self.lease_id or self.cpu_only_reason is not None:
            # The pool (Slurm) could not be used: the kernel runs here, CPU-only, saying why (fail closed).
            self.job_id = self.kernel_connection_file = None
            return kwargs
        pool = self.slurm_pool
        job = await asyncio.to_thread(pool.job_of, self.lease_id)
        self.job_id = str(job["job_id"])
        node = str(job.get("node") or "")
        directory = self._connection_dir()
        directory.mkdir(parents=True, exist_ok=True)
        conn_file = directory / f"kernel-{self.kernel_id}.json"
        with contextlib.suppress(FileNotFoundError):
            conn_file.unlink()
        self.kernel_connection_file = str(conn_file)
        server_file = getattr(km, "connection_file", "") if km is not None else ""
        cmd = [str(conn_file) if server_file and arg == server_file else arg for arg in kwargs["cmd"]]
        if self._is_ipython():
            # scontrol, when the nodes were read long ago: off the event loop, like every Slurm command
            cmd.append(f"--ip={await asyncio.to_thread(self._node_address, node)}")
            if self.kernel_spec is not None:
                self.kernel_spec.interrupt_mode = "message"  # a control message crosses nodes; a signal would not
        env = dict(kwargs.get("env") or {})
        env.pop("CUDA_VISIBLE_DEVICES", None)  # Slurm sets it for the step, from the job's GRES
        kwargs["env"] = _srun_env(env)
        cwd = kwargs.get("cwd") or os.getcwd()
        kwargs["cmd"] = [
            "srun",
            f"--jobid={self.job_id}",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--job-name={STEP_NAME}",
            f"--chdir={cwd}",
            "--quiet",
            "--unbuffered",
            # jupyter_client sets JPY_PARENT_PID to the server's pid; on the node ipykernel would
            # take its parent (slurmstepd) for a dead server and exit.
            "env",
            "-u",
            "JPY_PARENT_PID",
            *cmd,
        ]
        return kwargs

    def _finalize_env(self, env: dict[str, str]) -> None:
        super()._finalize_env(env)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        for key in [k for k in env if k.startswith("SLURM_") and k != "SLURM_CONF"]:
            env.pop(key)

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        """Start the ``srun`` step, then read the connection file the kernel writes on its node."""
        local = await super().launch_kernel(cmd, **kwargs)
        if not self.job_id or not self.kernel_connection_file:
            return local  # a CPU-only kernel on this host
        path = Path(self.kernel_connection_file)
        deadline = time.monotonic() + self.connect_timeout
        while True:
            info = _read_connection_file(path)
            if info is not None:
                break
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"the kernel's step in Slurm job {self.job_id} exited ({self.process.returncode}) before it wrote "
                    f"{path}; see the server log for srun's message"
                )
            if time.monotonic() > deadline:
                await self.kill()
                raise RuntimeError(
                    f"the kernel in Slurm job {self.job_id} wrote no connection file to {path} within "
                    f"{self.connect_timeout:g} s; is {path.parent} shared with the compute nodes?"
                )
            await asyncio.sleep(0.1)
        self.connection_info = info
        self.step_id = await asyncio.to_thread(self._find_step)
        self.log.info("gpupool: kernel %s runs as step %s of Slurm job %s", self.kernel_id, self.step_id, self.job_id)
        return info

    def _find_step(self) -> str | None:
        if not self.job_id:
            return None
        steps = [step for step, name in self.slurm_pool.commands.steps(self.job_id) if name == STEP_NAME]
        return max(steps, key=lambda s: int(s.split(".")[-1]) if s.split(".")[-1].isdigit() else -1, default=None)

    async def poll(self) -> int | None:
        """The ``srun`` step's exit code, except while the server is about to shut the kernel down
        because its slice was taken back (Slurm ended its job; the pool reclaimed or preempted it and
        cancelled the job, which ends the step first): the restarter must not restart it."""
        code = await super().poll()
        if code is None or self.phase != "running" or not self.lease_id or server_binding(self) is None:
            return code
        with contextlib.suppress(Exception):
            lease = await asyncio.to_thread(self.slurm_pool.get, self.lease_id)
            if lease.taken_back:
                return None  # the server extension's tick shuts it down, with the reason
        return code

    # --- signals and stopping -------------------------------------------------------------------
    def _signal_step(self, name: str) -> None:
        if not self.job_id:
            return
        step = self.step_id or self._find_step()
        if step:
            self.slurm_pool.commands.scancel(step, signal=name)

    async def send_signal(self, signum: int) -> None:
        """Signals go to the kernel's step through Slurm (the local ``srun`` would not pass SIGINT on)."""
        if signum == 0 or not self.job_id:
            await super().send_signal(signum)
            return
        name = signal.Signals(signum).name.removeprefix("SIG")
        await asyncio.to_thread(self._signal_step, name)

    async def terminate(self, restart: bool = False) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._signal_step, "TERM")
        await super().terminate(restart=restart)

    async def kill(self, restart: bool = False) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self._signal_step, "KILL")
        await super().kill(restart=restart)

    async def cleanup(self, restart: bool = False) -> None:
        """Keep the job on restart (a new step starts in it); cancel it when the kernel is gone."""
        await super().cleanup(restart=restart)
        self.step_id = None
        if self.kernel_connection_file:
            with contextlib.suppress(OSError):
                os.unlink(self.kernel_connection_file)
        if not restart:
            self.job_id = None

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        info.update(gpupool_slurm_job_id=self.job_id, gpupool_slurm_step_id=self.step_id)
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        self.job_id = provisioner_info.get("gpupool_slurm_job_id")
        self.step_id = provisioner_info.get("gpupool_slurm_step_id")


def _read_connection_file(path: Path) -> KernelConnectionInfo | None:
    """The kernel's connection info, once the file is complete (``key`` as bytes), else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("shell_port") or "key" not in data:
        return None
    data["key"] = str(data["key"]).encode()
    return cast(KernelConnectionInfo, data)


__all__ = ["STEP_NAME", "SlurmLeaseRequest", "SlurmProvisioner"]
