"""Device control as the broker runs it: a real broker process (root, a hub service and a Unix
socket) on a simulated pool with a node folder, real Unix users' processes, real cgroups on both
paths. A pooled user's process outside a kernel cannot open a GPU node; a granted lease's kernel
opens its GPU only; a release denies it; a SIGKILLed broker leaves every rule in place, and its
restart adopts the live kernels' cgroups and removes the ended ones. Needs root (see
``tests/test_device_control.py`` for the node folder and the cgroup layout it reuses).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerProcess, JupyterServer, StandInHub
from test_device_control import DEVICES, PATHS, UNIFIED, Host, Probe, _until, host  # noqa: F401 - host is a fixture
from test_ownership import ALICE, BOB, PROF, unix_users  # noqa: F401 - unix_users is a fixture

from jupyter_gpupool.devices.simulated import NODE_DIR_ENV, SimulatedBackend, parse_inventory
from jupyter_gpupool.enforcement.device_control import MODE_V1, MODE_V2
from jupyter_gpupool.enforcement.device_control_role import DEVICE_ACCESS

pytestmark = [pytest.mark.slow, pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups, mknod and other users' processes need root")]  # slow: a real broker and other users' processes

# A user's process (a login shell, a terminal's job, a kernel): opens a node on each line it reads.
# Plain sh, not Python: the test's Python may not be readable by other users.
SHELL_PROBE = (
    'echo ready; while read -r word path; do msg=$( { : <>"$path"; } 2>&1 ) && echo OK || case "$msg" in '
    '*"not permitted"*) echo EPERM;; *"No such device or address"*) echo ENXIO;; *) echo "$msg";; esac; done'
)


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """Replaces pytest's own (private to root): other users' processes open the nodes in it."""
    folder = Path(tempfile.mkdtemp(prefix="gpo-devctl-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def user_process(on: Host, lease_id: str = "", kernel_id: str = "", user: str = ALICE) -> Probe:
    """A process of ``user`` born in the users' cgroup (a spawner's unit on v2), as a spawner starts
    it; a kernel of ``lease_id`` when given, and of ``kernel_id`` (as the pool's provisioner starts
    every kernel, with a lease or without). It joins its cgroups as root, then becomes the user's."""
    env = {"PATH": "/usr/bin:/bin", "LANG": "C", "LC_ALL": "C", **({"GPUPOOL_LEASE_ID": lease_id} if lease_id else {})}
    env.update({"GPUPOOL_KERNEL_ID": kernel_id} if kernel_id else {})
    joins = "".join(f"echo $$ > {directory}/cgroup.procs; " for directory in on.spawner_dirs)
    become = f"exec setpriv --reuid={user} --regid={user} --init-groups /bin/bash -c {shlex.quote(SHELL_PROBE)}"
    process = subprocess.Popen(["/bin/sh", "-c", joins + become], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    probe = Probe(process)
    on.probes.append(probe)
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return probe


def call(broker: BrokerProcess, method: str, path: str, token: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(f"{broker.url}/api/gpupool/{path}", data=data, method=method)
    request.add_header("Authorization", f"token {token}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=15) as answer:
        return json.loads(answer.read() or b"null")


def broker_config(on: Host, extra: str = "") -> str:
    """A broker's device control on ``on``'s path and cgroups, named after this run; then ``extra``."""
    return (
        f"c.DeviceControl.mode = {on.path!r}\nc.DeviceControl.user_cgroups = [{on.user!r}]\n"
        f"c.DeviceControl.name = {on.tag!r}\nc.DeviceControl.kernel_subtree = '{on.tag}/kernels'\n"
    ) + extra


def started_line(on: Host) -> str:
    """The start of the broker's one line saying device control runs on ``on``'s path."""
    mode, mount = (MODE_V2, UNIFIED) if on.path == "v2" else (MODE_V1, DEVICES)
    return f"device control: {mode} on {mount} (c.DeviceControl.mode is '{on.path}'); GPU nodes"


def users_server(tmp_path: Path, broker: BrokerProcess, token: str, on: Host) -> JupyterServer:
    """alice's Jupyter server on ``broker``, in the users' cgroup as a spawner puts it."""
    server = JupyterServer(tmp_path, "alice", broker.url, token)
    for directory in on.spawner_dirs:
        Path(directory, "cgroup.procs").write_text(str(server.proc.pid))
    return server


def kernel_cgroups(on: Host) -> list[str]:
    """The kernel cgroups this run's broker made, on either path."""
    found = []
    for root, dirs, _files in os.walk(os.path.dirname(on.user)):
        found += [os.path.join(root, d) for d in dirs if d.startswith(f"{on.tag}-kernel-")]
    return found


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_the_broker_denies_every_gpu_but_a_granted_kernels_and_a_killed_broker_leaves_it_so(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice, prof = hub.add_user("tok-alice", ALICE), hub.add_user("tok-prof", PROF, admin=True)
    config = broker_config(host)
    broker = BrokerProcess(tmp_path, hub, simulate="3x16GiB", config=config)
    uuids = [d.uuid for d in SimulatedBackend(parse_inventory("3x16GiB"), spec="3x16GiB").devices()]
    try:
        broker.start()
        mode = MODE_V2 if host.path == "v2" else MODE_V1
        mount = UNIFIED if host.path == "v2" else DEVICES
        reason = f"{mode} on {mount} (c.DeviceControl.mode is '{host.path}')"
        assert _until(lambda: f"device control: {reason}; GPU nodes (nvidia1, nvidia2, nvidia3 in {host.folder})" in broker.log(), 5)
        seen = call(broker, "GET", "info", prof)["device_control"]
        assert seen["mode"] == mode and seen["reason"] == reason and seen["denied_in"] == [host.user] and len(seen["denied"]["gpu_nodes"]) == 3
        plain = {"mode": mode, "reason": reason}  # not which cgroups, not how many kernels
        assert call(broker, "GET", "info", alice)["device_control"] == plain
        for token, shown in ((prof, seen), (alice, plain)):  # `jupyter gpupool status --json` says the same
            env = {**os.environ, "GPUPOOL_URL": broker.url, "GPUPOOL_TOKEN": token}
            status = subprocess.run(["jupyter", "gpupool", "status", "--json"], env=env, capture_output=True, text=True, timeout=60, check=True)
            assert json.loads(status.stdout)["device_control"] == shown

        outsider = user_process(host)  # a terminal's `python train.py`: no kernel, no lease
        assert [outsider.open(host.gpu(i)) for i in range(3)] == ["EPERM"] * 3

        kept, ended = (call(broker, "POST", "leases", alice, {"memory": "8GiB", "kernel_id": k}) for k in ("k1", "k2"))
        kernel, other = user_process(host, kept["id"]), user_process(host, ended["id"])
        assert kept["id"] != ended["id"]
        index, other_index = uuids.index(kept["devices"][0]), uuids.index(ended["devices"][0])
        assert _until(lambda: kernel.open(host.gpu(index)) == "ENXIO", 5)  # allowed (no driver behind it)
        assert _until(lambda: other.open(host.gpu(other_index)) == "ENXIO", 5)
        assert kernel.open(host.gpu((index + 1) % 3)) == "EPERM" and outsider.open(host.gpu(index)) == "EPERM"
        assert kernel.fork_open(host.gpu(index)) == "ENXIO"  # what it forks inherits its access

        call(broker, "POST", f"leases/{ended['id']}/release", alice, {})
        assert _until(lambda: other.open(host.gpu(other_index)) == "EPERM", 5)  # released: denied within its pass

        broker.kill()  # SIGKILL: the rules stay, as documented
        assert kernel.open(host.gpu(index)) == "ENXIO" and outsider.open(host.gpu(index)) == "EPERM", broker.log()
        other.process.kill()
        other.process.wait()
        assert len(kernel_cgroups(host)) == 2  # the ended lease's, now empty, left by the killed broker

        broker.start()
        assert _until(lambda: "device control: kernel cgroups of an earlier run: 1 adopted, 1 removed" in broker.log(), 5), broker.log()
        assert len(kernel_cgroups(host)) == 1 and kernel.open(host.gpu(index)) == "ENXIO"  # adopted, still open
        assert call(broker, "GET", "info", prof)["device_control"]["kernels"] == 1
        call(broker, "POST", f"leases/{kept['id']}/release", alice, {})
        assert _until(lambda: kernel.open(host.gpu(index)) == "EPERM", 5)
        kernel.process.kill()
        kernel.process.wait()
        assert _until(lambda: not kernel_cgroups(host), 5)  # removed once empty: no stale cgroup
    finally:
        broker.stop()
        hub.stop()


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_kernel_that_leases_later_opens_its_gpu_on_that_decisions_pass_and_a_release_shuts_it(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    """The environment a kernel started with cannot name a lease it takes later: it is found by its
    kernel id, or by the earlier lease of its kernel its environment names."""
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice = hub.add_user("tok-alice", ALICE)
    config = broker_config(host)
    broker = BrokerProcess(tmp_path, hub, simulate="3x16GiB", config=config)
    uuids = [d.uuid for d in SimulatedBackend(parse_inventory("3x16GiB"), spec="3x16GiB").devices()]

    def lease(kernel_id: str) -> tuple[str, int]:
        granted = call(broker, "POST", "leases", alice, {"memory": "8GiB", "kernel_id": kernel_id})
        return granted["id"], uuids.index(granted["devices"][0])

    try:
        broker.start()
        assert _until(lambda: started_line(host) in broker.log(), 5), broker.log()
        # Started by the pool's provisioner without a lease (CPU-only), then `%gpupool reserve`.
        cpu_only = user_process(host, kernel_id="k-later")
        bystander = user_process(host, kernel_id="k-other")  # alice's too, another kernel
        stranger = user_process(host, kernel_id="k-later", user=BOB)  # copied the kernel id
        assert cpu_only.open(host.gpu(0)) == "EPERM"
        first, index = lease("k-later")
        assert _until(lambda: cpu_only.open(host.gpu(index)) == "ENXIO", 5), broker.log()[-2000:]
        assert bystander.open(host.gpu(index)) == "EPERM" and stranger.open(host.gpu(index)) == "EPERM"
        call(broker, "POST", f"leases/{first}/release", alice, {})  # `%gpupool release`
        assert _until(lambda: cpu_only.open(host.gpu(index)) == "EPERM", 5)
        again, index = lease("k-later")  # `%gpupool reserve`: a new lease of the same kernel
        assert again != first and _until(lambda: cpu_only.open(host.gpu(index)) == "ENXIO", 5)

        # Started with a lease it named in its environment (and no kernel id), released, reserved again.
        old, old_index = lease("k-named")
        named = user_process(host, lease_id=old)
        assert _until(lambda: named.open(host.gpu(old_index)) == "ENXIO", 5)
        call(broker, "POST", f"leases/{old}/release", alice, {})
        assert _until(lambda: named.open(host.gpu(old_index)) == "EPERM", 5)
        new, new_index = lease("k-named")
        assert _until(lambda: named.open(host.gpu(new_index)) == "ENXIO", 5), broker.log()[-2000:]
        assert bystander.open(host.gpu(new_index)) == "EPERM"
        assert call(broker, "GET", f"leases/{new}", alice)["state"] == "granted"
    finally:
        broker.stop()
        hub.stop()


# A kernel no provisioner started (nbconvert's, papermill's): it leases for itself and re-executes
# with its lease in its environment. Its first instruction after that says what it can open.
SELF_LEASING = """
import errno, json, os, sys
if os.environ.get("GPUPOOL_AUTOLEASE_HELD"):
    seen = {{"lease": os.environ.get("GPUPOOL_LEASE_ID"), "cgroup": open("/proc/self/cgroup").read(), "opens": []}}
    for node in {nodes!r}:
        try:
            os.close(os.open(node, os.O_RDWR))
            seen["opens"].append("OK")
        except OSError as exc:
            seen["opens"].append(errno.errorcode[exc.errno])
    open({out!r}, "w").write(json.dumps(seen))
    sys.exit(0)
import signal
from jupyter_gpupool.kernel import autolease
reexec = os.execve
def execve(*args):  # leased and about to run again: the broker's next pass cannot come before the test says
    os.kill({broker_pid}, signal.SIGSTOP)
    reexec(*args)
os.execve = execve
autolease.configure()
print("it did not re-execute itself:", autolease.current().lines)
"""


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_kernel_that_leases_for_itself_runs_again_only_once_its_gpu_is_open_to_it(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice = hub.add_user("tok-alice", ALICE)
    config = broker_config(host)
    broker = BrokerProcess(tmp_path, hub, simulate="3x16GiB", config=config)
    uuids = [d.uuid for d in SimulatedBackend(parse_inventory("3x16GiB"), spec="3x16GiB").devices()]
    out = tmp_path / "first-instruction.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "JUPYTERHUB_"))}
    env.update(GPUPOOL_URL=broker.url, GPUPOOL_TOKEN=alice, GPUPOOL_SIMULATE="3x16GiB", GPUPOOL_SIMULATE_NODES=str(host.folder))
    try:
        broker.start()
        assert _until(lambda: started_line(host) in broker.log(), 5), broker.log()
        assert broker.proc is not None
        broker_pid = broker.proc.pid
        script = SELF_LEASING.format(nodes=[str(host.gpu(i)) for i in range(3)], out=str(out), broker_pid=broker_pid)
        # Born in its spawner's cgroup (denied every GPU node), as a kernel nbconvert starts is.
        born = [a for d in host.spawner_dirs for a in (sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", d, "--")]
        kernel = subprocess.Popen([*born, sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The broker is held from the moment the kernel leased until well after a re-executed Python
        # reaches its first instruction: only a kernel that waits for its GPU opens it.
        assert _until(lambda: kernel.poll() is not None or _stopped(broker_pid), 30)
        time.sleep(1.0)
        os.kill(broker_pid, signal.SIGCONT)
        stdout, stderr = kernel.communicate(timeout=30)
        assert kernel.returncode == 0 and out.exists(), stdout + stderr
        seen = json.loads(out.read_text())
        lease = call(broker, "GET", f"leases/{seen['lease']}", alice)
        index = uuids.index(lease["devices"][0])
        # Its very first instruction runs in its kernel's cgroup and opens its GPU (no driver behind it), no other.
        assert f"-kernel-{seen['lease']}" in seen["cgroup"], seen
        assert seen["opens"] == ["ENXIO" if i == index else "EPERM" for i in range(3)], (seen, stderr)
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            os.kill(broker.proc.pid, signal.SIGCONT)
        broker.stop()
        hub.stop()


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


OPEN_IN_KERNEL = """
import errno, os
try:
    os.close(os.open({path!r}, os.O_RDWR))
    print("OK")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_kernel_a_server_starts_under_device_control_opens_its_gpu_from_its_first_instruction(
    host: Host, tmp_path: Path, unix_users: dict[str, int], monkeypatch: pytest.MonkeyPatch  # noqa: F811 - fixtures
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    hub = StandInHub().start()
    alice = hub.add_user("tok-alice", ALICE)
    config = broker_config(host)
    broker = BrokerProcess(tmp_path, hub, simulate="3x16GiB", config=config)
    uuids = [d.uuid for d in SimulatedBackend(parse_inventory("3x16GiB"), spec="3x16GiB").devices()]
    server = None
    try:
        broker.start()
        assert _until(lambda: started_line(host) in broker.log(), 5), broker.log()  # the users' deny in place
        # A kernel whose very first instruction opens its GPU's node, then runs as ipykernel.
        first = tmp_path / "first-open"
        spec = tmp_path / "share" / "kernels" / "first-open"
        spec.mkdir(parents=True)
        nodes = [str(host.gpu(i)) for i in range(3)]
        starts = (
            "import errno, os\nseen = []\n"
            f"for node in {nodes!r}:\n"
            "    try:\n        os.close(os.open(node, os.O_RDWR)); seen.append('OK')\n"
            "    except OSError as exc:\n        seen.append(errno.errorcode[exc.errno])\n"
            f"open({str(first)!r}, 'w').write(' '.join(seen))\nfrom ipykernel import kernelapp\nkernelapp.launch_new_instance()\n"
        )
        argv = [sys.executable, "-c", starts, "-f", "{connection_file}"]
        (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "first open", "language": "python"}))
        monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share"))
        server = users_server(tmp_path, broker, alice, host)
        kernel_id = server.call("POST", "api/kernels", {"name": "first-open"}, timeout=60)["id"]
        lease = broker.kernel_lease(kernel_id)
        assert lease is not None and lease.live
        index = uuids.index(lease.devices[0])
        # Its very first instruction opened its GPU (allowed: no driver behind it); every other GPU refused.
        assert _until(lambda: first.exists() and first.read_text() != "", 20), server.log_text()[-2000:]
        assert first.read_text().split() == ["ENXIO" if i == index else "EPERM" for i in range(3)]
        assert server.run_code(kernel_id, OPEN_IN_KERNEL.format(path=str(host.gpu(index)))).split() == ["ENXIO"]
        assert server.run_code(kernel_id, OPEN_IN_KERNEL.format(path=str(host.gpu((index + 1) % 3)))).split() == ["EPERM"]
        assert "did not set up this kernel's GPU access" not in server.log_text()  # it waited for its grant's cgroup
        # The sidebar's enforcement line says so (the server's view of the kernel).
        enforcement = server.call("GET", f"api/gpupool/kernels/{kernel_id}")["enforcement"]
        assert enforcement["device_access"] == DEVICE_ACCESS == "this kernel's GPU only", enforcement
        # The sidebar's GPU list (the server's pool view, read where every GPU node refuses it): every GPU.
        listed = server.call("GET", "api/gpupool/pool")["devices"]
        assert sorted((d["uuid"], d["healthy"]) for d in listed) == sorted((uuid, True) for uuid in uuids), listed
        # An opt-out route of docs/unpooled.md (a kernelspec naming another provisioner): denied every GPU.
        opted = tmp_path / "share" / "kernels" / "opt-out"
        opted.mkdir()
        plain = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        metadata = {"kernel_provisioner": {"provisioner_name": "local-provisioner"}}
        (opted / "kernel.json").write_text(json.dumps({"argv": plain, "display_name": "opt out", "language": "python", "metadata": metadata}))
        outside = server.call("POST", "api/kernels", {"name": "opt-out"}, timeout=60)["id"]
        assert broker.kernel_lease(outside) is None  # no lease: the pool does not know it
        assert [server.run_code(outside, OPEN_IN_KERNEL.format(path=node)).split() for node in nodes] == [["EPERM"]] * 3
    finally:
        if server is not None:
            server.stop()
        broker.stop()
        hub.stop()
