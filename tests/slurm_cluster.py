"""A real single-node Slurm cluster for the tests: ``munged``, ``slurmctld`` and ``slurmd`` as
root in a temporary directory, with its own ``slurm.conf`` and ``gres.conf``.

The node has two stand-in GPUs (``/dev/null`` and ``/dev/zero``: there is no NVIDIA device here)
and 16 GRES shards, 8 per GPU: a job asking for ``--gres=shard:8`` gets one GPU's shards, and a
third such job pends with reason ``Resources``. Everything it starts is started in the
foreground and stopped by its pid (SIGTERM, then SIGKILL), even when a test fails.

Usable on its own too::

    python tests/slurm_cluster.py      # starts a cluster, prints its SLURM_CONF, Ctrl-C stops it
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from server_process import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
MISSING = (
    "Slurm is not installed (no {names} on PATH): apt-get install -y slurm-wlm munge "
    "(the Debian packages; .ci/run installs them)"
)
#: Seconds a Slurm command or daemon may wait for a CPU on a loaded 2-core host (a second suite beside
#: this one: load 8-13), on top of what Slurm itself allows a message (MessageTimeout).
LOAD_MARGIN = 5


def missing_tools() -> list[str]:
    """The daemons and client commands this fixture needs that are not installed."""
    needed = [*DAEMONS, "sbatch", "squeue", "scancel", "scontrol", "sacct", "srun"]
    return [name for name in needed if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def skip_reason() -> str | None:
    """Why a real cluster cannot run here, or None when it can."""
    missing = missing_tools()
    if missing:
        return MISSING.format(names=", ".join(missing))
    if os.geteuid() != 0:
        return "a test Slurm cluster runs slurmd as root; these tests need root"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    """One node (this host, called ``node0`` at 127.0.0.1), one partition ``gpu``."""

    node = "node0"
    partition = "gpu"
    shards = 16
    gpus = 2
    #: Slurm's MessageTimeout for this cluster: every wait on the controller below is derived from it.
    message_timeout = 10

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.etc = self.root / "etc"
        self.conf = self.etc / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.jobcomp = self.root / "jobcomp.txt"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    # --- how long Slurm may take ---------------------------------------------------------------------
    @property
    def round_trip(self) -> float:
        """Seconds one Slurm command may take on a loaded host: a busy controller answers it, or the
        client gives up, within MessageTimeout; plus :data:`LOAD_MARGIN` for the command's own CPU."""
        return self.message_timeout + LOAD_MARGIN

    def within(self, round_trips: int) -> float:
        """Seconds for ``round_trips`` Slurm commands one after the other: the bound of a wait on
        something that needs the controller (a server's answer, a job leaving the queue)."""
        return round_trips * self.round_trip

    @property
    def command_timeout(self) -> float:
        """Seconds before :meth:`run` gives up on one command: a client retries its connection for
        MessageTimeout, then waits as long for the answer."""
        return 2 * self.message_timeout + LOAD_MARGIN

    # --- configuration ----------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Variables a client (sbatch, squeue, our backend) needs to reach this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def outage_env(self, message_timeout: int = 4) -> dict[str, str]:
        """Like :attr:`env`, for a client that meets a stopped controller: the same cluster, with
        a shorter ``MessageTimeout`` (a client retries its connection for that long, less a
        second), so a test of an outage does not wait :attr:`message_timeout` per command."""
        client = self.etc / f"slurm-client-{message_timeout}.conf"
        if not client.exists():
            lines = self.conf.read_text().splitlines()
            shorter = f"MessageTimeout={message_timeout}"
            client.write_text(
                "\n".join(shorter if line.startswith("MessageTimeout=") else line for line in lines) + "\n"
            )
        return {"SLURM_CONF": str(client)}

    def _write_config(self) -> None:
        for sub in ("etc", "munge", "state", "spool", "log", "run"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.etc / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        ctld_port, slurmd_port = free_port(), free_port()
        r = self.root
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=gpupool-test",
                    f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={r / 'state'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    "GresTypes=gpu,shard",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core_Memory",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SchedulerType=sched/backfill",
                    "SchedulerParameters=bf_interval=1,sched_min_interval=100000",
                    "PriorityType=priority/multifactor",  # sprio then reports the fair-share factor
                    "PriorityWeightFairshare=1000",
                    "PriorityWeightAge=100",
                    "MpiDefault=none",
                    "ReturnToService=2",
                    "SlurmdParameters=config_overrides",
                    "DefMemPerCPU=256",
                    "MinJobAge=600",
                    "KillWait=2",
                    # Slurm's default: on a loaded 2-core host a daemon or client can wait seconds for
                    # the CPU, and at 2 s slurmctld dropped messages ("Socket timed out on send/recv").
                    # A client facing a stopped controller retries for as long: see outage_env().
                    f"MessageTimeout={self.message_timeout}",
                    "InactiveLimit=0",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/filetxt",
                    f"JobCompLoc={self.jobcomp}",
                    (
                        f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs=8 "
                        f"RealMemory=4096 Gres=gpu:{self.gpus},shard:{self.shards} State=UNKNOWN"
                    ),
                    f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )
        (self.etc / "gres.conf").write_text(
            f"NodeName={self.node} Name=gpu File=/dev/null\n"
            f"NodeName={self.node} Name=gpu File=/dev/zero\n"
            f"NodeName={self.node} Name=shard Count={self.shards}\n"
        )

    # --- life cycle -------------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - closed with the process
        env = {**os.environ, **self.env}
        self.processes[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()

    def start(self, timeout: float | None = None) -> SlurmCluster:
        """Write the configuration, start the three daemons, wait until the controller answers and
        the node is idle (``timeout``: seconds for each; default :meth:`within` 4 round trips)."""
        timeout = self.within(4) if timeout is None else timeout
        reap_stale_clusters()
        self._write_config()
        (self.root / "owner.pid").write_text(str(os.getpid()))
        try:
            self.start_munged()
            self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._spawn("slurmd", [_tool("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
            self.wait_for_controller(timeout)
            self._wait_for(self._node_ready, "the node to register idle", timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_munged(self) -> None:
        """Start this cluster's ``munged`` (its own socket and key under :attr:`root`)."""
        r = self.root
        self._spawn(
            "munged",
            [
                _tool("munged"), "--foreground", "--force",
                f"--socket={self.munge_socket}", f"--key-file={self.etc / 'munge.key'}",
                f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait_for(lambda: self.munge_socket.exists(), "munged to open its socket", 10)

    def stop_controller(self) -> None:
        """Stop slurmctld only (an outage): jobs keep running on the node. It saves its state
        first, which a loaded host may make take a while (bounded by :attr:`command_timeout`)."""
        proc = self.processes.pop("slurmctld")
        proc.terminate()
        proc.wait(timeout=self.command_timeout)

    def start_controller(self, timeout: float | None = None) -> None:
        """Start slurmctld again from its saved state (without ``-i``: it recovers its jobs); return
        once ``scontrol ping`` says it is up and it sees the node again (``timeout``: seconds for
        each; default :meth:`within` 4 round trips)."""
        timeout = self.within(4) if timeout is None else timeout
        self._spawn("slurmctld", [_tool("slurmctld"), "-D", "-f", str(self.conf)])
        self.wait_for_controller(timeout)
        self._wait_for(self._node_ready, "slurmctld to see the node again", timeout)

    def controller_up(self) -> bool:
        """Whether ``scontrol ping`` says slurmctld is up: it answers at once when it is, says DOWN
        at once when it is not running, and after MessageTimeout when it is too busy to answer."""
        try:
            return " is UP" in self.run(["scontrol", "ping"], check=False)
        except RuntimeError:  # scontrol itself did not finish (a host too loaded to run it)
            return False

    def wait_for_controller(self, timeout: float | None = None) -> None:
        """Wait until slurmctld answers ``scontrol ping`` (default bound: :meth:`within` 4 round
        trips); a RuntimeError with the daemons' logs if it does not."""
        timeout = self.within(4) if timeout is None else timeout
        self._wait_for(
            lambda: self._daemons_running() and self.controller_up(), "slurmctld to answer scontrol ping", timeout
        )

    def _daemons_running(self) -> bool:
        """True, or a RuntimeError naming a daemon that exited (no wait on it can succeed)."""
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs()}")
        return True

    def _node_ready(self) -> bool:
        self._daemons_running()
        out = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False)
        # Exactly: "idle*" (a "*" suffix) is a node slurmd has not answered for yet, not a ready one.
        return out.strip() in ("idle", "mixed", "allocated")

    def _wait_for(self, check: object, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.logs()}")

    def run(self, argv: list[str], check: bool = True) -> str:
        """Run a Slurm client command against this cluster; its stdout. A command that does not
        finish within :attr:`command_timeout` is a RuntimeError saying so."""
        try:
            done = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                env={**os.environ, **self.env},
                timeout=self.command_timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"{' '.join(argv)} did not finish within {self.command_timeout:g} s "
                f"(MessageTimeout={self.message_timeout}):\n{self.logs()}"
            ) from None
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def logs(self, lines: int = 30) -> str:
        """The tail of each daemon's log (for failure messages)."""
        parts = []
        for path in sorted((self.root / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def jobs(self) -> list[str]:
        """Ids of the jobs the controller still lists (pending, running or completing)."""
        return self.run(["squeue", "-h", "-o", "%i"]).split()

    def cancel_all(self) -> None:
        """Cancel every job (between tests) and wait until none is left: first until the controller
        answers (``scontrol ping``), then ``scancel`` of the jobs ``squeue`` lists, by id (one
        request; a filtered ``scancel --state=...`` retries a job in transition for 5 s, 6 s, ...),
        then until ``squeue`` lists none. Every wait is bounded by the cluster's MessageTimeout
        (:meth:`within`); past it a RuntimeError names the jobs left, with the daemons' logs."""
        self.wait_for_controller()
        self._cancel_jobs(self.within(4))

    def _cancel_jobs(self, timeout: float) -> None:
        """``scancel`` the listed jobs by id until ``squeue`` lists none, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        cancelled: set[str] = set()
        while True:
            left = self.jobs()
            if not left:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs {', '.join(left)} are still listed after scancel:\n{self.logs()}")
            new = [job for job in left if job not in cancelled]
            if new:
                self.run(["scancel", *new], check=False)  # a job that ended meanwhile is no error here
                cancelled.update(new)
            time.sleep(0.3)

    def stop(self) -> None:
        """Stop everything this cluster started, by pid: its jobs (``scancel``, then SIGKILL of
        what ``slurmstepd`` left), then the daemons (SIGTERM, then SIGKILL)."""
        ctld = self.processes.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            # Only a controller that answers scontrol ping is asked; what it leaves running is killed below.
            with contextlib.suppress(RuntimeError):
                if self.controller_up():
                    self._cancel_jobs(self.within(2))
        for name in reversed(DAEMONS):
            proc = self.processes.get(name)
            if proc is None or proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        self._kill_steps()
        self.processes.clear()

    def _kill_steps(self) -> None:
        """SIGKILL each ``slurmstepd`` of this cluster and its job processes (they outlive slurmd)."""
        import psutil

        for pid in self._stepd_pids():
            with contextlib.suppress(psutil.Error):
                stepd = psutil.Process(pid)
                victims = [stepd, *stepd.children(recursive=True)]
                for victim in victims:
                    with contextlib.suppress(psutil.Error):
                        victim.kill()
                psutil.wait_procs(victims, timeout=5)

    def _stepd_pids(self) -> list[int]:
        """slurmstepd processes of this cluster (their environment is cleared: they are known by the
        files of ours they hold open, slurmd's log)."""
        import psutil

        pids = []
        for proc in psutil.process_iter(["name"]):
            if proc.info["name"] == "slurmstepd" and _cluster_root(proc) == self.root:
                pids.append(proc.pid)
        return pids

    def daemons_alive(self) -> list[str]:
        """Names of daemons of this cluster still running (empty after :meth:`stop`)."""
        alive = []
        for name, proc in self.processes.items():
            if proc.poll() is None:
                alive.append(name)
        return alive + [f"slurmstepd {pid}" for pid in self._stepd_pids()]


#: A cluster's folder where a word names it: an absolute path (after ``--socket=`` or alone) to a
#: ``gpupool-slurm-*`` folder.
_CLUSTER_FOLDER = re.compile(r"(/[^\s=:]*?/gpupool-slurm-[^/\s]+)")


def _cluster_root(proc: object) -> Path | None:
    """The ``gpupool-slurm-*`` folder a daemon or slurmstepd belongs to: named in its command line
    (``munged --socket=FOLDER/munge/…``, ``slurmctld -f FOLDER/etc/slurm.conf``) or ``SLURM_CONF``,
    or among its open files."""
    import psutil

    words: list[str] = []
    with contextlib.suppress(psutil.Error):
        words += proc.cmdline()  # type: ignore[attr-defined]
        words.append(proc.environ().get("SLURM_CONF", ""))  # type: ignore[attr-defined]
        words += [f.path for f in proc.open_files()]  # type: ignore[attr-defined]
    for word in words:
        found = _CLUSTER_FOLDER.search(word)
        if found:
            return Path(found.group(1))
    return None


def is_stale(root: Path) -> bool:
    """Whether a cluster's daemons may be killed: its folder is gone, or ``owner.pid`` names a
    process no longer running. A folder whose owner cannot be read is left alone (another run may
    be writing it): only a cluster known to be orphaned is killed."""
    import psutil

    if not root.is_dir():
        return True
    try:
        owner = int((root / "owner.pid").read_text())
    except (OSError, ValueError):
        return False
    return not psutil.pid_exists(owner)


def reap_stale_clusters() -> list[int]:
    """SIGKILL the daemons and job processes of test clusters whose owner process is gone (a
    test run killed with SIGKILL cannot clean up after itself); their pids. Clusters of other
    runs and workers on the host, alive, are never touched."""
    import psutil

    killed = []
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] not in (*DAEMONS, "slurmstepd"):
            continue
        root = _cluster_root(proc)
        if root is None or not is_stale(root):
            continue
        with contextlib.suppress(psutil.Error):
            for victim in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    victim.kill()
                    killed.append(victim.pid)
    return killed


if __name__ == "__main__":  # pragma: no cover - manual use
    import tempfile

    reason = skip_reason()
    if reason:
        sys.exit(reason)
    with tempfile.TemporaryDirectory(prefix="gpupool-slurm-") as tmp:
        cluster = SlurmCluster(Path(tmp)).start()
        print(f"export SLURM_CONF={cluster.conf}")
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            cluster.stop()
