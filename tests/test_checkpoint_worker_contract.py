"""The checkpoint worker's edges, without root: where a kernel sits, a kernel in no kernel cgroup,
a bad request, a worker never placed. (The worker placed by a real broker: tests/test_checkpoint_worker.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_device_control import PATHS, Host, host  # noqa: F401 - host is a fixture

from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer
from jupyter_gpupool.devices.checkpoint_contract import CheckpointError, NoCheckpointer
from jupyter_gpupool.devices.checkpoint_worker import WorkerCheckpointer, build, kernel_lease_of, serve, spec_of
from jupyter_gpupool.devices.simulated import NODE_DIR_ENV, SimulatedBackend


def test_the_lease_a_kernel_sits_under_is_read_from_its_cgroup_on_either_path(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("0::/user.slice/jupyter-alice.service/gpupool-kernel-l-abc123\n")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text("12:devices:/gpupool/kernels/gpupool-kernel-l-v1\n4:memory:/user.slice\n0::/user.slice\n")
    (tmp_path / "9").mkdir()
    (tmp_path / "9" / "cgroup").write_text("0::/user.slice/user-1000.slice/session-3.scope\n")
    assert [kernel_lease_of(pid, str(tmp_path)) for pid in (7, 8, 9, 10)] == ["l-abc123", "l-v1", "", ""]


def test_a_process_in_no_kernel_cgroup_is_refused_at_once_with_the_reason(tmp_path: Path) -> None:
    backend = SimulatedBackend.from_spec("2x16GiB")
    worker = WorkerCheckpointer(SimulatedCheckpointer(str(tmp_path), backend))
    assert worker.probe().supported and "worker inside its kernel's GPU access" in worker.probe().reason
    with pytest.raises(CheckpointError, match="in no kernel device cgroup of the pool") as caught:
        worker.suspend(os.getpid())
    assert caught.value.state == "running"
    with pytest.raises(CheckpointError, match="in no kernel device cgroup") as caught:
        worker.resume(os.getpid())
    assert caught.value.state == "suspended"
    with pytest.raises(CheckpointError, match="cannot run in a worker"):
        WorkerCheckpointer(NoCheckpointer())


def test_a_worker_never_placed_gives_up_and_leaves_the_kernel_as_it_was(tmp_path: Path) -> None:
    spec = spec_of(SimulatedCheckpointer(str(tmp_path), SimulatedBackend.from_spec("2x16GiB")))
    assert build(spec).name == "simulated"
    answer = serve({"op": "suspend", "pid": os.getpid(), "lease_id": "l-nobody", "join_timeout": 0.2, "checkpointer": spec})
    assert answer == {
        "error": f"cannot suspend process {os.getpid()}: the pool did not place the checkpoint worker in its kernel's GPU "
        "access within 0.2 s (it places only a process of the kernel's owner)",
        "state": "running",
    }
    assert not list(tmp_path.iterdir())  # nothing parked, no marker


@pytest.mark.parametrize(("given", "said"), [("not json", "not JSON"), ("[1, 2]", "not an object")])
def test_a_bad_request_is_one_usage_line_not_a_traceback(given: str, said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "jupyter_gpupool.devices.checkpoint_worker"], input=given,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: a checkpoint request as one JSON object on stdin") and said in done.stderr
    assert "Traceback" not in done.stderr


# --- the driver's rule on a simulated node folder (root: device cgroups and mknod) ----------------------
IN_A_DENIED_PROCESS = """
import json, os, sys
from jupyter_gpupool.devices.checkpoint import CheckpointError, SimulatedCheckpointer
from jupyter_gpupool.devices.simulated import NODE_DIR_ENV, SimulatedBackend
backend = SimulatedBackend.from_spec("3x16GiB")
backend.usage_dir = sys.argv[1]
seen = {"probe": SimulatedCheckpointer(sys.argv[1], backend).probe().reason}
deferred = SimulatedCheckpointer(sys.argv[1], backend)
deferred.defer_driver_start = True
try:
    deferred.suspend(int(sys.argv[2]))
except CheckpointError as err:
    seen["suspend"] = [err.reason, err.state]
print(json.dumps(seen))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups and mknod need root")
@pytest.mark.parametrize("host", PATHS[:1], indirect=True)
def test_a_process_denied_every_gpu_node_cannot_start_the_driver_and_one_allowed_can(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - a fixture
) -> None:
    """What made a server under device control cull instead of suspend: its own checkpoint calls
    meet EPERM on every GPU node, as cuInit does."""
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    host.mechanism().deny_users(host.user)
    usage = tmp_path / "usage"
    usage.mkdir()
    kernel = subprocess.Popen(["sleep", "60"])
    try:
        born = [a for d in host.spawner_dirs for a in (sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", d, "--")]
        done = subprocess.run([*born, sys.executable, "-c", IN_A_DENIED_PROCESS, str(usage), str(kernel.pid)],
                              capture_output=True, text=True, timeout=60, check=False)
        seen = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
        assert seen, done.stderr
        nodes = ", ".join(str(host.folder / f"nvidia{m}") for m in (3, 2, 1))
        assert seen["probe"] == f"the CUDA driver cannot start here: no CUDA device visible to this process ({nodes}: EPERM, denied by device control)"
        assert seen["suspend"][1] == "running" and "the CUDA driver cannot start in this process: no CUDA device visible" in seen["suspend"][0]
        # This (root's, not denied) process opens them: ENXIO, no driver behind them; the suspend goes through.
        backend = SimulatedBackend.from_spec("3x16GiB")
        backend.usage_dir = str(usage)
        allowed = SimulatedCheckpointer(str(usage), backend)
        assert allowed.probe().supported
        assert allowed.suspend(kernel.pid) == 0 and allowed.state(kernel.pid) == "suspended"
        allowed.resume(kernel.pid)
        assert allowed.state(kernel.pid) == "running"
    finally:
        kernel.kill()
        kernel.wait()
