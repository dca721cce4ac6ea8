"""Under device control a kernel is suspended and resumed, not culled: the user's server, denied
every GPU node, runs each driver checkpoint call in a worker the broker places in the kernel's own
GPU access. A worker of another user naming that kernel's lease is never placed and fails.

The simulated checkpointer plays the driver's rule on the node folder: the process that suspends or
restores must open the kernel's GPU node (``ENXIO`` here: allowed; ``EPERM``: no CUDA device, as
``cuInit`` finds in a denied process). Real broker, real server, real kernel, real cgroups (v2), a
real Unix user; needs root (see ``tests/test_device_control_broker.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from broker_harness import BrokerProcess, JupyterServer, StandInHub
from test_device_control import PATHS, UNIFIED, Host, _until, host  # noqa: F401 - host is a fixture
from test_device_control_broker import broker_config, call, started_line, tmp_path, users_server  # noqa: F401 - tmp_path is a fixture
from test_ownership import ALICE, BOB, unix_users  # noqa: F401 - unix_users is a fixture

from jupyter_gpupool.core.models import LeaseState, Transition
from jupyter_gpupool.devices.checkpoint import CheckpointError
from jupyter_gpupool.devices.simulated import NODE_DIR_ENV

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups, mknod and other users' processes need root")]

# bob's process running the server's checkpoint worker: Python and the package load as root (the
# test's Python may not be readable by bob), then it becomes bob and serves the request on stdin.
AS_BOB = (
    "import os, sys\n"
    "from jupyter_gpupool.devices import checkpoint_worker, simulated  # noqa: F401\n"
    "for d in sys.argv[3:]:\n    open(os.path.join(d, 'cgroup.procs'), 'w').write(str(os.getpid()))\n"
    "os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[1]))\n"
    "sys.exit(checkpoint_worker.main())\n"
)

# The broker keeps every kernel as it is until the test suspends or moves it: no tick, no culling.
STILL = "c.Broker.tick_interval = 600\nc.PoolPolicy.idle_policy = 'never'\n"


def granted_kernel(broker: BrokerProcess, server: JupyterServer) -> str:
    """A Python kernel of ``server``, its lease granted, with ``z = 5`` set in it: its id."""
    kernel_id = server.call("POST", "api/kernels", {"name": "python3"}, timeout=60)["id"]
    assert _until(lambda: (lease := broker.kernel_lease(kernel_id)) is not None and lease.state is LeaseState.GRANTED, 30)
    assert server.run_code(kernel_id, "z = 5\nprint('set')").strip() == "set"
    return kernel_id


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_kernel_under_device_control_is_suspended_and_resumed_through_a_worker_in_its_gpu_access(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice = hub.add_user("tok-alice", ALICE)
    broker = BrokerProcess(tmp_path, hub, simulate="3x16GiB", config=broker_config(host, STILL))
    server = None
    try:
        broker.start()
        assert _until(lambda: started_line(host) in broker.log(), 5), broker.log()
        server = users_server(tmp_path, broker, alice, host)
        kernel_id = granted_kernel(broker, server)
        lease = broker.kernel_lease(kernel_id)
        assert lease is not None and lease.suspendable, server.log_text()[-3000:]  # the server can checkpoint here

        server.call("POST", f"api/gpupool/kernels/{kernel_id}/suspend", {})
        assert _until(lambda: broker.kernel_lease(kernel_id).state is LeaseState.SUSPENDED, 30), server.log_text()[-3000:]  # type: ignore[union-attr]
        assert "ran in checkpoint worker" in server.log_text() and "suspend of process" in server.log_text()

        # Its next cell brings it back (restored by a worker too), with its state intact.
        assert server.run_code(kernel_id, "print(z)", timeout=60).strip().splitlines()[-1] == "5"
        back = broker.kernel_lease(kernel_id)
        assert back is not None and back.state is LeaseState.GRANTED and back.transition is Transition.NONE, back
        assert "resume of process" in server.log_text(), server.log_text()[-3000:]
        assert "culled" not in server.log_text() and "suspend_failed" not in server.log_text()

        # bob's process naming alice's kernel lease is never placed in its GPU access: it fails closed.
        kernel_pid = int(server.run_code(kernel_id, "import os; print(os.getpid())").strip().splitlines()[-1])
        request = {"op": "suspend", "pid": kernel_pid, "lease_id": back.id, "join_timeout": 3,
                   "checkpointer": {"kind": "simulated", "usage_dir": str(tmp_path / "bob-usage"), "spec": "3x16GiB",
                                    "node_dir": str(host.folder)}}
        bob = pwd.getpwnam(BOB)
        env = {**os.environ, "GPUPOOL_LEASE_ID": back.id, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        done = subprocess.run(
            [sys.executable, "-c", AS_BOB, str(bob.pw_uid), str(bob.pw_gid), *host.spawner_dirs],
            input=json.dumps(request), capture_output=True, text=True, env=env, timeout=60, check=False,
        )
        answer = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
        assert "did not place the checkpoint worker" in answer.get("error", ""), (done.stdout, done.stderr, broker.log()[-2000:])
        assert answer.get("state") == "running"
        assert server.run_code(kernel_id, "print(z + 1)").strip().splitlines()[-1] == "6"  # untouched
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        hub.stop()


@pytest.mark.parametrize("host", PATHS[:1], indirect=True)
def test_a_kernel_under_device_control_is_moved_onto_another_gpu_through_a_worker(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    """A move parks the kernel and restores it onto the GPU the pool chose (a restore with a GPU
    mapping): both by workers in its GPU access, which a move opens to the GPUs it leaves and goes to."""
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice, bob = hub.add_user("tok-alice", ALICE), hub.add_user("tok-bob", BOB)
    config = broker_config(host, STILL + "c.PoolPolicy.preemption = False\nc.PoolPolicy.defragment_min_idle = 1\n")
    broker = BrokerProcess(tmp_path, hub, simulate="2x16GiB", config=config)
    server = None
    try:
        broker.start()
        assert _until(lambda: started_line(host) in broker.log(), 5), broker.log()
        server = users_server(tmp_path, broker, alice, host)
        kernel_id = granted_kernel(broker, server)
        home = broker.kernel_lease(kernel_id).devices  # type: ignore[union-attr]
        beside = call(broker, "POST", "leases", bob, {"memory": "8GiB"})
        other = call(broker, "POST", "leases", bob, {"memory": "8GiB"})
        assert beside["devices"] == list(home) and other["devices"] != list(home), (beside, other)
        call(broker, "POST", f"leases/{beside['id']}/release", bob, {})  # 8 GiB free beside the kernel, none on the other GPU
        time.sleep(1.5)  # the kernel idles past defragment_min_idle
        big = call(broker, "POST", "leases", bob, {"memory": "16GiB"})  # a whole GPU: only a move makes one
        assert _until(lambda: call(broker, "GET", f"leases/{big['id']}", bob)["state"] == "granted", 30), server.log_text()[-3000:]
        moved = broker.kernel_lease(kernel_id)
        assert moved is not None and moved.devices != home and moved.transition is Transition.NONE, moved
        log = server.log_text()
        assert "suspend of process" in log and "resume of process" in log and "ran in checkpoint worker" in log, log[-3000:]
        assert server.run_code(kernel_id, "print(z)").strip().splitlines()[-1] == "5"
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        hub.stop()


# The worker's side on the CUDA path, in a process the test places as the broker would (a cgroup
# named as a kernel's): a fake driver and NVML (tests/fake_cuda_checkpoint.py) play the GPU. Each
# request builds its checkpointer anew, as each worker does; the suspend's bytes go back with the resume.
CUDA_WORKER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import pytest
from fake_cuda_checkpoint import FakeCudaDriver
from fake_pynvml import FakeNvml
from test_checkpoint_backend import give_cuda_version, two_h100s
from jupyter_gpupool.devices import checkpoint_worker
from jupyter_gpupool.devices.nvml import NvmlBackend
kernel_pid, lease_id = int(sys.argv[2]), sys.argv[3]
nvml = FakeNvml(two_h100s(), driver_version="580.65.06")
give_cuda_version(nvml, 12090)
nvml.install(pytest.MonkeyPatch())
driver = FakeCudaDriver(nvml=nvml)
driver.install(pytest.MonkeyPatch())
gpus = [d.to_json() for d in NvmlBackend().devices()]
driver.add_process(kernel_pid, {gpus[0]["uuid"]: 4 << 30})
spec = {"kind": "cuda", "devices": gpus, "driver": "580.65.06", "cuda_api": 12090}
base = {"pid": kernel_pid, "lease_id": lease_id, "join_timeout": 30, "checkpointer": spec}
suspended = checkpoint_worker.serve({**base, "op": "suspend", "timeout": 5})
state = checkpoint_worker.serve({**base, "op": "state"})
moved = checkpoint_worker.serve({**base, "op": "resume", "gpu_mapping": {gpus[0]["uuid"]: gpus[1]["uuid"]},
                                 "parked": suspended.get("parked")})
print(json.dumps({"answers": [suspended, state, moved], "calls": [c[0] for c in driver.calls], "gpus": [g["uuid"] for g in gpus]}))
"""


@pytest.mark.skipif(UNIFIED is None, reason="no cgroup2 hierarchy mounted")
def test_the_cuda_path_runs_each_call_in_the_worker_once_it_is_placed_and_carries_the_parked_bytes(tmp_path: Path) -> None:  # noqa: F811 - a fixture
    lease_id = f"l-ckptw{os.getpid()}"
    assert UNIFIED is not None
    kernel_dir = Path(UNIFIED, f"gpo-ckptw{os.getpid()}-kernel-{lease_id}")
    kernel_dir.mkdir()
    kernel = subprocess.Popen(["sleep", "60"])  # the kernel's process, as the fake driver knows it
    tests = str(Path(__file__).resolve().parent)
    worker = subprocess.Popen([sys.executable, "-c", CUDA_WORKER, tests, str(kernel.pid), lease_id],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        (kernel_dir / "cgroup.procs").write_text(str(worker.pid))  # what the broker's pass does
        out, err = worker.communicate(timeout=60)
        seen = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
        assert seen, err
        suspended, state, moved = seen["answers"]
        assert suspended["value"] == 4 << 30 and suspended["parked"] == {seen["gpus"][0]: 4 << 30}, seen
        assert state["value"] == "suspended" and "error" not in moved, seen
        assert seen["calls"].count("cuInit") >= 1 and seen["calls"][-2:] == ["restore", "unlock"], seen
    finally:
        kernel.kill()
        kernel.wait()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        _until(lambda: not (kernel_dir / "cgroup.procs").read_text().strip(), 5)
        kernel_dir.rmdir()


# --- a worker that fails or never answers ----------------------------------------------------------
# Stand-ins for the server's Python (WorkerCheckpointer's ``python``): each is started as
# ``<it> -m jupyter_gpupool.devices.checkpoint_worker`` and reads the request on stdin.

# The CUDA driver cannot start in the worker (cuInit fails, as with no CUDA device visible); the
# worker places itself in the kernel's cgroup, as the broker's pass would, then serves the request.
NO_DRIVER = """#!{python}
import os, sys
sys.path.insert(0, {tests!r})
with open({procs!r}, "w") as procs:
    procs.write(str(os.getpid()))
import pytest
from fake_cuda_checkpoint import FakeCudaDriver
driver = FakeCudaDriver()
driver.init_error = "CUDA_ERROR_NOT_INITIALIZED"
driver.install(pytest.MonkeyPatch())
from jupyter_gpupool.devices import checkpoint_worker
sys.exit(checkpoint_worker.main())
"""

# Never answers a suspend or resume (it hangs, inside the driver for all the server knows); a state
# request gets ``state`` from it, or, with none, it dies without an answer.
HANGS = """#!{python}
import json, sys, time
request = json.loads(sys.stdin.read())
if request["op"] == "state":
    if {state!r}:
        print(json.dumps({{"value": {state!r}}}))
    sys.exit(0 if {state!r} else 3)
time.sleep(60)
"""


def _python(folder: Path, name: str, text: str, **values: str) -> str:
    path = folder / name
    path.write_text(text.format(python=sys.executable, **values))
    path.chmod(0o755)
    return str(path)


class KernelCgroup:
    """A real process in a cgroup named as lease ``lease_id``'s kernel cgroup (as the broker names them)."""

    def __init__(self, lease_id: str) -> None:
        assert UNIFIED is not None
        self.dir = Path(UNIFIED, f"gpo-ckptw{os.getpid()}-kernel-{lease_id}")
        self.dir.mkdir()
        self.kernel = subprocess.Popen(["sleep", "60"])
        (self.dir / "cgroup.procs").write_text(str(self.kernel.pid))
        self.pid = self.kernel.pid

    def close(self) -> None:
        self.kernel.kill()
        self.kernel.wait()
        _until(lambda: not (self.dir / "cgroup.procs").read_text().strip(), 5)
        self.dir.rmdir()


def _cuda_inner() -> Any:
    from jupyter_gpupool.devices.checkpoint import CudaCheckpointer
    from jupyter_gpupool.devices.checkpoint_worker import SnapshotGpus
    from jupyter_gpupool.devices.simulated import SimulatedBackend

    return CudaCheckpointer(SnapshotGpus(SimulatedBackend.from_spec("1x16GiB").devices(), "580.65.06", 12090))


@pytest.mark.skipif(UNIFIED is None, reason="no cgroup2 hierarchy mounted")
def test_a_resume_whose_driver_cannot_start_in_the_worker_leaves_the_kernel_suspended(tmp_path: Path) -> None:  # noqa: F811 - a fixture
    """The worker's cuInit fails: the driver never touched the kernel, so its restore failed with
    the memory still parked. The lease goes back to suspended (the next try restores it), saying
    why; the kernel is not shut down."""
    from pool_helpers import T0, make_pool, req

    from jupyter_gpupool.devices.checkpoint_worker import WorkerCheckpointer
    from jupyter_gpupool.serverextension.transitions import TransitionDriver

    pool = make_pool(tmp_path)
    lease = pool.request(req(kernel_id="k1", suspendable=True), now=T0)
    pool.suspend(lease.id, now=T0 + 1)
    pool.confirm_transition(lease.id, 4 << 30, now=T0 + 2)
    restoring = pool.resume(lease.id, now=T0 + 3)
    assert restoring.transition is Transition.RESTORING
    emitted: list[str] = []
    ext = SimpleNamespace(pool=pool, log=logging.getLogger("test"), _parked_by={},
                          emit=lambda kind, _lease, message="": emitted.append(f"{kind}: {message}"))
    driver = TransitionDriver(ext)  # type: ignore[arg-type]
    stopped: list[str] = []

    async def stop(kernel_id: str, _lease: Any) -> None:
        stopped.append(kernel_id)

    driver._stop_kernel = stop  # type: ignore[method-assign]
    kernel = KernelCgroup(lease.id)
    python = _python(tmp_path, "no-driver", NO_DRIVER, tests=str(Path(__file__).resolve().parent), procs=str(kernel.dir / "cgroup.procs"))
    try:
        driver._checkpointer = WorkerCheckpointer(_cuda_inner(), join_timeout=10, python=python)
        with pytest.raises(CheckpointError) as error:
            asyncio.run(driver._restore("k1", restoring, kernel.pid, {}))
        assert error.value.state == "suspended", error.value
        assert str(error.value) == (f"cannot resume process {kernel.pid}: the CUDA driver cannot start here: "
                                    "cuInit failed: CUDA_ERROR_NOT_INITIALIZED")
        after = pool.get(lease.id)
        assert after.state is LeaseState.SUSPENDED and after.transition is Transition.NONE, after
        assert after.parked_memory == 4 << 30 and after.devices == ()
        assert "cuInit failed: CUDA_ERROR_NOT_INITIALIZED" in after.suspend_reason and "stays suspended" in after.suspend_reason
        assert stopped == [] and emitted == [f"suspend_failed: {after.suspend_reason}"]
        assert kernel.kernel.poll() is None
    finally:
        kernel.close()
        pool.close()


@pytest.mark.skipif(UNIFIED is None, reason="no cgroup2 hierarchy mounted")
@pytest.mark.parametrize("shown", ["locked", ""])
def test_a_worker_that_never_answers_is_killed_and_its_state_asked_of_a_fresh_one(tmp_path: Path, shown: str) -> None:  # noqa: F811 - a fixture
    """Killed mid-operation, a worker may have left the kernel locked, checkpointed or restored:
    the state is what a fresh worker finds the driver showing, or not known (``""``, which the pool
    treats as a failed step whose memory is not free), never "running" by default."""
    from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer
    from jupyter_gpupool.devices.checkpoint_worker import WorkerCheckpointer

    python = _python(tmp_path, "hangs", HANGS, state=shown)
    worker = WorkerCheckpointer(SimulatedCheckpointer(str(tmp_path)), join_timeout=0.2, python=python, grace=0.5)
    kernel = KernelCgroup(f"l-hang{os.getpid()}")
    try:
        with pytest.raises(CheckpointError) as error:
            worker.suspend(kernel.pid, timeout=0.1)
        assert error.value.state == shown and error.value.state != "running"
        said = f"the driver shows it {shown}" if shown else "its state is not known"
        assert str(error.value).startswith(f"the checkpoint worker to suspend process {kernel.pid} did not answer within ")
        assert str(error.value).endswith(f" s and was killed; {said}")
        assert worker.state(kernel.pid) == shown  # asked again: the same answer, never a guess
    finally:
        kernel.close()
