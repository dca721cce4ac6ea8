"""Device control on this host's real cgroups, both paths: a cgroup v2 eBPF device program and the
cgroup v1 ``devices`` controller.

The GPUs are simulated, their nodes are not: ``mknod`` makes ``/dev/nvidiaN``-like nodes (major
195, the simulated GPUs' minors) in a temporary folder. With no driver behind them, an open that a
device cgroup lets through fails with ``ENXIO``; one it stops fails with ``EPERM``. Each "process"
here is a real Python process that tries ``os.open``. Needs root (``mknod``, cgroups); every
cgroup is named per run (two runs may share the host) and removed afterwards, also on failure.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import pwd
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from pool_helpers import make_pool, req

from jupyter_gpupool.core.models import Device, LeaseState, Transition
from jupyter_gpupool.devices.simulated import NODE_DIR_ENV, SimulatedBackend, make_node_folder, parse_inventory
from jupyter_gpupool.enforcement import cgroup_bpf
from jupyter_gpupool.enforcement.claims import UnixUsers
from jupyter_gpupool.enforcement.device_control import (
    MODE_V1,
    MODE_V2,
    CgroupV1,
    CgroupV2,
    DeviceCgroups,
    DeviceControl,
    DeviceControlError,
    NvidiaNodes,
    cgroup_mounts,
)
from jupyter_gpupool.enforcement.device_control_role import DeviceControlRole, DeviceControlService, lease_processes

UNIFIED, DEVICES = cgroup_mounts()
MEMORY = "/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory/") else None
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups and mknod need root")
PATHS = [
    pytest.param("v2", marks=pytest.mark.skipif(UNIFIED is None, reason="no cgroup2 hierarchy mounted")),
    pytest.param("v1", marks=pytest.mark.skipif(DEVICES is None, reason="no cgroup v1 devices controller mounted")),
]

# A "process" of a user: runs each line of stdin ("open PATH", "fork open PATH") and answers.
PROBE = textwrap.dedent(
    """
    import errno, os, sys
    def try_open(path):
        try:
            os.close(os.open(path, os.O_RDWR))
            return "OK"
        except OSError as exc:
            return errno.errorcode.get(exc.errno, str(exc.errno))
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "open":
            print(try_open(words[1]), flush=True)
        elif words[0] == "fork":
            read, write = os.pipe()
            child = os.fork()
            if child == 0:
                os.write(write, try_open(words[1]).encode())
                os._exit(0)
            os.waitpid(child, 0)
            print(os.read(read, 64).decode(), flush=True)
    """
)


@dataclass
class Probe:
    """A real process that opens nodes when asked."""

    process: subprocess.Popen[str]

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, line: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def open(self, path: str | Path) -> str:
        return self.ask(f"open {path}")

    def fork_open(self, path: str | Path) -> str:
        return self.ask(f"fork {path}")

    def cgroups(self) -> dict[str, str]:
        """``/proc/PID/cgroup`` as hierarchy → path (``""`` for cgroup v2)."""
        lines = Path(f"/proc/{self.pid}/cgroup").read_text().splitlines()
        return {line.split(":", 2)[1]: line.split(":", 2)[2] for line in lines}


@dataclass
class Host:
    """The simulated GPUs' node folder, and this run's cgroups on one path."""

    path: str
    tag: str
    folder: Path
    nodes: NvidiaNodes
    minors: list[int]  # the simulated GPUs' minors, by index
    user: str  # the user-level cgroup (denied), absolute
    spawner_dirs: list[str]  # cgroups a user's process starts in (v2: under `user`; v1: user + a memory cgroup)
    probes: list[Probe] = field(default_factory=list)

    def mechanism(self, name: str | None = None) -> DeviceCgroups:
        name = name or self.tag
        if self.path == "v2":
            assert UNIFIED is not None
            return CgroupV2(self.nodes, UNIFIED, name)
        assert DEVICES is not None
        return CgroupV1(self.nodes, DEVICES, name, f"{self.tag}/kernels")

    def start(self, lease_id: str = "") -> Probe:
        """A pooled user's process: in the user-level cgroup (a spawner's unit on v2); a kernel of
        ``lease_id`` when given (the variable a pooled kernel gets)."""
        env = {**os.environ, "GPUPOOL_LEASE_ID": lease_id} if lease_id else None
        process = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        probe = Probe(process)
        self.probes.append(probe)
        for directory in self.spawner_dirs:  # before it is asked to open anything
            Path(directory, "cgroup.procs").write_text(str(process.pid))
        assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        return probe

    def gpu(self, index: int) -> Path:
        return self.folder / f"nvidia{self.minors[index]}"

    def cap(self, index: int) -> Path:
        (_major, minor), *_ = self.nodes.caps[self.minors[index]]
        return self.folder / "nvidia-caps" / f"nvidia-cap{minor}"


def _free_majors(count: int) -> list[int]:
    """Character majors no driver of this host uses (for the simulated dynamic ones)."""
    used = {int(line.split()[0]) for line in Path("/proc/devices").read_text().split("Block")[0].splitlines()[1:] if line.strip()}
    return [major for major in range(234, 200, -1) if major not in used][:count]


def _remove_tree(root: str) -> None:
    """Kill what is left in a cgroup tree, then remove it, deepest first."""
    if not os.path.isdir(root):
        return
    for directory, _dirs, _files in os.walk(root, topdown=False):
        with contextlib.suppress(OSError):
            for pid in Path(directory, "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
    for directory, _dirs, _files in os.walk(root, topdown=False):
        for _ in range(50):
            try:
                os.rmdir(directory)
                break
            except FileNotFoundError:
                break
            except OSError:  # a killed process not yet reaped by the kernel
                time.sleep(0.02)


@pytest.fixture
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    with made_host(request.param, tmp_path, SimulatedBackend(parse_inventory("3x16GiB")).devices()) as made:
        yield made


@contextlib.contextmanager
def made_host(path: str, tmp_path: Path, devices: list[Device]) -> Iterator[Host]:
    """A node folder for ``devices`` and this run's cgroups on ``path``, removed afterwards."""
    tag = f"gpupool-test-{os.getpid()}-{secrets.token_hex(3)}"
    caps_major, uvm_major = _free_majors(2)
    folder = tmp_path / "dev"
    make_node_folder(str(folder), devices, caps_major=caps_major, uvm_major=uvm_major)
    nodes = NvidiaNodes.read(str(folder), str(folder / "proc"))
    probes: list[Probe] = []
    try:
        if path == "v2":
            assert UNIFIED is not None
            user = os.path.join(UNIFIED, tag, "user")
            spawner = [os.path.join(user, "spawner")]
            os.makedirs(spawner[0])
        else:
            assert DEVICES is not None
            user = os.path.join(DEVICES, tag, "user")
            os.makedirs(user)
            spawner = [user]
            if MEMORY is not None:
                memory = os.path.join(MEMORY, tag, "spawner")
                os.makedirs(memory)
                spawner.append(memory)
        yield Host(path, tag, folder, nodes, [d.minor or 0 for d in devices if not d.is_mig], user, spawner, probes)
    finally:
        for probe in probes:
            probe.process.kill()
            probe.process.wait()
        # Its own trees, and any kernel cgroup made beside them (a process in a mount's root cgroup).
        for mount in (UNIFIED, DEVICES, MEMORY):
            for root in glob.glob(os.path.join(mount, f"{tag}*")) if mount else ():
                _remove_tree(root)


# --- the node folder --------------------------------------------------------------------------------
def test_simulated_gpus_have_minors_that_are_not_their_indexes(tmp_path: Path) -> None:
    devices = SimulatedBackend(parse_inventory("3x16GiB")).devices()
    assert [d.minor for d in devices] == [3, 2, 1]
    folder = tmp_path / "dev"
    make_node_folder(str(folder), devices, caps_major=233, uvm_major=232)
    nodes = NvidiaNodes.read(str(folder), str(folder / "proc"))
    assert nodes.gpus == {1: (195, 1), 2: (195, 2), 3: (195, 3)}
    assert sorted(nodes.control) == [(195, 255), (232, 0), (232, 1)]  # nvidiactl, nvidia-uvm, nvidia-uvm-tools
    assert set(nodes.caps) == {1, 2, 3} and all(major == 233 for caps in nodes.caps.values() for major, _ in caps)
    # Allowed (no cgroup in the way) but no driver: ENXIO, which a deny turns into EPERM.
    with pytest.raises(OSError) as opened:
        os.open(folder / "nvidia3", os.O_RDWR)
    assert opened.value.errno == errno.ENXIO


# --- the v2 program itself ----------------------------------------------------------------------------
def test_a_rule_matches_only_the_access_it_names(tmp_path: Path) -> None:
    if UNIFIED is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    os.mknod(tmp_path / "node", 0o666 | 0o020000, os.makedev(195, 7))
    directory = os.path.join(UNIFIED, f"gpupool-test-{os.getpid()}-{secrets.token_hex(3)}")
    os.mkdir(directory)
    try:
        cgroup_bpf.attach_rules(directory, [cgroup_bpf.DeviceRule(False, 195, 7, access="w")], True, 0)
        assert cgroup_bpf.attached_count(directory)[0] == 1
        script = (
            "import os,errno\n"
            f"for flags in (os.O_RDONLY, os.O_RDWR):\n"
            f"    try: os.open({str(tmp_path / 'node')!r}, flags)\n"
            "    except OSError as e: print(errno.errorcode[e.errno])\n"
        )
        out = subprocess.run(
            [sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", directory, "--", sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out == ["ENXIO", "EPERM"]  # a read is not a write
        assert cgroup_bpf.detach(directory) and not cgroup_bpf.detach(directory)
    finally:
        _remove_tree(directory)


def test_a_program_the_verifier_refuses_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    if UNIFIED is None:
        pytest.skip("no cgroup2 hierarchy mounted")
    # Loaded without the verifier's log first; a refusal is loaded again with it, to say why.
    monkeypatch.setattr(cgroup_bpf, "assemble", lambda rules, default_allow: cgroup_bpf._insn(0xB4, 0, imm=1))  # no exit
    with pytest.raises(OSError) as refused:
        cgroup_bpf.load([], True)
    assert not isinstance(refused.value, cgroup_bpf.BpfUnavailable)
    assert refused.value.errno == errno.EINVAL
    assert str(refused.value.strerror).startswith("the kernel refused the device program: Invalid argument; ")
    assert "last insn is not an exit or jmp" in str(refused.value.strerror)  # the verifier's own words


# --- both paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_outside_any_kernel_every_gpu_node_is_denied_and_the_control_nodes_stay_open(host: Host) -> None:
    host.mechanism().deny_users(host.user)
    user = host.start()
    assert [user.open(host.gpu(i)) for i in range(3)] == ["EPERM"] * 3
    assert [user.open(host.cap(i)) for i in range(3)] == ["EPERM"] * 3
    for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        assert user.open(host.folder / name) == "ENXIO", name  # allowed: CPU work and CUDA's setup run
    assert user.open("/dev/null") == "OK"
    assert user.fork_open(host.gpu(0)) == "EPERM"


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_granted_kernel_opens_its_gpu_only_and_follows_moves_and_releases(host: Host) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    kernel, other_user_process = host.start(), host.start()
    before = kernel.cgroups()

    with pytest.raises(DeviceControlError, match="cannot name a cgroup"):
        control.grant("../escape", [kernel.pid], [host.minors[1]])
    assert kernel.cgroups() == before and kernel.open(host.gpu(1)) == "EPERM"  # nothing changed
    directory = control.grant("lease-a", [kernel.pid], [host.minors[1]])
    # Its first open after the grant is never EPERM.
    assert [kernel.open(host.gpu(i)) for i in range(3)] == ["EPERM", "ENXIO", "EPERM"]
    assert [kernel.open(host.cap(i)) for i in range(3)] == ["EPERM", "ENXIO", "EPERM"]
    assert kernel.fork_open(host.gpu(1)) == "ENXIO" and kernel.fork_open(host.gpu(0)) == "EPERM"  # a child inherits
    assert kernel.open(host.folder / "nvidiactl") == "ENXIO"
    assert other_user_process.open(host.gpu(1)) == "EPERM"  # the same user, not the kernel
    # The kernel keeps its spawner's cgroups for memory, CPU and pids.
    after = kernel.cgroups()
    if host.path == "v2":
        assert after[""] == f"{before['']}/{os.path.basename(directory)}"  # a child of its own cgroup
        assert Path(directory).stat().st_uid == 0
    else:
        assert after["devices"].endswith(f"/kernels/{os.path.basename(directory)}")
        assert {k: v for k, v in after.items() if k != "devices"} == {k: v for k, v in before.items() if k != "devices"}

    control.grant("lease-a", [kernel.pid], [host.minors[2]])  # moved to GPU 2
    assert [kernel.open(host.gpu(i)) for i in range(3)] == ["EPERM", "EPERM", "ENXIO"]
    control.release("lease-a")
    assert [kernel.open(host.gpu(i)) for i in range(3)] == ["EPERM"] * 3
    assert kernel.open(host.folder / "nvidia-uvm") == "ENXIO"
    assert not control.forget("lease-a")  # its process still runs: it stays, denied
    kernel.process.kill()
    kernel.process.wait()
    assert control.forget("lease-a") and not os.path.exists(directory)


BROKER = textwrap.dedent(
    """
    import sys, time
    from jupyter_gpupool.enforcement.device_control import CgroupV1, CgroupV2, NvidiaNodes
    path, folder, mount, name, subtree, user, kernels = sys.argv[1:8]
    nodes = NvidiaNodes.read(folder, folder + "/proc")
    control = CgroupV2(nodes, mount, name) if path == "v2" else CgroupV1(nodes, mount, name, subtree)
    control.deny_users(user)
    for grant in kernels.split(","):
        key, pid, minor = grant.split(":")
        control.grant(key, [int(pid)], [int(minor)])
    print("ready", flush=True)
    time.sleep(60)
    """
)


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_killed_broker_leaves_the_deny_and_a_restart_adopts_or_removes_its_cgroups(host: Host) -> None:
    kept, gone, ended = host.start(), host.start(), host.start()
    mount = UNIFIED if host.path == "v2" else DEVICES
    grants = f"kept:{kept.pid}:{host.minors[0]},gone:{gone.pid}:{host.minors[1]},ended:{ended.pid}:{host.minors[2]}"
    broker = subprocess.Popen(
        [sys.executable, "-c", BROKER, host.path, str(host.folder), str(mount), host.tag, f"{host.tag}/kernels", host.user, grants],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert broker.stdout is not None and broker.stdout.readline().strip() == "ready"
    finally:
        broker.send_signal(signal.SIGKILL)
        broker.wait()
    # What a crash leaves: every rule in place (an attached program outlives its loader).
    assert [kept.open(host.gpu(i)) for i in range(3)] == ["ENXIO", "EPERM", "EPERM"]
    assert gone.open(host.gpu(1)) == "ENXIO"
    assert host.start().open(host.gpu(0)) == "EPERM"
    ended.process.kill()
    ended.process.wait()

    restarted = host.mechanism()
    done = restarted.sweep({"kept": frozenset({host.minors[0]})})
    assert done == {"kept": "adopted", "gone": "denied", "ended": "removed"}
    assert [kept.open(host.gpu(i)) for i in range(3)] == ["ENXIO", "EPERM", "EPERM"]
    assert [gone.open(host.gpu(i)) for i in range(3)] == ["EPERM"] * 3  # its lease is no more
    assert sorted(restarted.kernels) == ["gone", "kept"]
    gone.process.kill()
    gone.process.wait()
    restarted.remove_all()
    assert sorted(restarted.kernels) == ["kept"]  # its process still runs


# --- choosing the mode ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_root_broker_on_a_simulated_pool_with_a_node_folder_runs_it_and_says_so_in_one_line(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    config = DeviceControl(mode=host.path, user_cgroups=[host.user, "no-such-slice"], name=host.tag, kernel_subtree=f"{host.tag}/kernels")
    with caplog.at_level("INFO"):
        cgroups = config.start(single_user=False, simulated=True, simulated_node_dir=str(host.folder))
    assert cgroups is not None and cgroups.mode == (MODE_V2 if host.path == "v2" else MODE_V1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device control:")]
    assert len(lines) == 1 and cgroups.mode in lines[0] and "nvidia1, nvidia2, nvidia3" in lines[0]
    described = json.loads(json.dumps(config.describe()))
    assert described["mode"] == cgroups.mode and described["not_found"] == ["no-such-slice"]
    assert described["denied_in"] == [host.user] and len(described["denied"]["gpu_nodes"]) == 3
    assert host.start().open(host.gpu(2)) == "EPERM"


@pytest.mark.parametrize(
    ("kwargs", "mode", "reason"),
    [
        ({"single_user": True}, "auto", "single-user server"),
        ({"single_user": False, "simulated": True}, "auto", "without a node folder"),
        ({"single_user": False}, "off", "'off'"),
    ],
)
def test_off_says_why_in_one_line(kwargs: dict[str, bool], mode: str, reason: str, caplog: pytest.LogCaptureFixture) -> None:
    config = DeviceControl(mode=mode)
    with caplog.at_level("INFO"):
        assert config.start(**kwargs) is None
    assert config.describe() == {"mode": "off", "reason": config.reason} and reason in config.reason
    assert [r.getMessage() for r in caplog.records if "device control" in r.getMessage()] == [
        f"device control: off ({config.reason}); unpooled GPU use is policed by the watchdog"
    ]


def test_a_broker_that_is_not_root_falls_back_and_says_so(tmp_path: Path) -> None:
    devices = SimulatedBackend(parse_inventory("1x16GiB")).devices()
    make_node_folder(str(tmp_path / "dev"), devices, caps_major=233, uvm_major=232)
    script = (
        "import os, json, logging\n"
        "from jupyter_gpupool.enforcement.device_control import DeviceControl\n"
        "config = DeviceControl()\n"
        "config.log.info('logging set up')  # traitlets imports its logger on first use\n"
        "os.setgid(65534); os.setuid(65534)  # nobody, once Python's own files are read\n"
        f"print(json.dumps([config.start(single_user=False, simulated=True, simulated_node_dir={str(tmp_path / 'dev')!r}) is None, config.describe()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    off, described = json.loads(done.stdout)
    assert off and described == {"mode": "off", "reason": "the broker does not run as root, and only root may change device cgroups"}


@pytest.mark.parametrize("host", ["v2"], indirect=True)
@pytest.mark.skipif(UNIFIED is None, reason="no cgroup2 hierarchy mounted")
def test_a_users_deny_the_kernel_refuses_leaves_device_control_off_and_says_why(
    host: Host, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that refuses the users' program (E2BIG: too many instructions) leaves nobody
    denied: device control must say off, with why, never on with the cgroup as "not found"."""
    real = cgroup_bpf.assemble

    def over_any_limit(rules: list[cgroup_bpf.DeviceRule], default_allow: bool) -> bytes:
        if not rules:
            return real(rules, default_allow)  # the start's probe (allow-all) loads as before
        return cgroup_bpf._insn(0xB4, 0, imm=1) * 1_000_001 + cgroup_bpf._insn(0x95)  # a million and one instructions

    monkeypatch.setattr(cgroup_bpf, "assemble", over_any_limit)
    other = os.path.join(str(UNIFIED), host.tag, "other")
    os.makedirs(other)
    cgroup_bpf.attach_rules(other, [], True, cgroup_bpf.BPF_F_ALLOW_OVERRIDE)  # stands in for a users' cgroup denied first
    config = DeviceControl(mode="v2", user_cgroups=[host.user], name=host.tag)
    with caplog.at_level("INFO"):
        assert config.start(single_user=False, simulated=True, simulated_node_dir=str(host.folder)) is None
    described = json.loads(json.dumps(config.describe()))
    assert described == {"mode": "off", "reason": config.reason}
    assert config.reason.startswith(f"cannot attach the device deny to {host.user}: ") and "Argument list too long" in config.reason
    assert config.reason.endswith(f"; no GPU node is denied (the path chosen: {MODE_V2} on {UNIFIED} (c.DeviceControl.mode is 'v2'))")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device control:")]
    assert lines == [f"device control: off ({config.reason}); unpooled GPU use is policed by the watchdog"]
    assert cgroup_bpf.attached_count(host.user)[0] == 0 and host.start().open(host.gpu(0)) == "ENXIO"  # nothing half-done is left
    monkeypatch.setattr(cgroup_bpf, "assemble", real)
    config = DeviceControl(mode="v2", user_cgroups=[other, host.user], name=host.tag)  # the first denied, the second refused
    monkeypatch.setattr(CgroupV2, "deny_users", _refuse_second(CgroupV2.deny_users))
    assert config.start(single_user=False, simulated=True, simulated_node_dir=str(host.folder)) is None
    assert config.describe()["mode"] == "off" and cgroup_bpf.attached_count(other)[0] == 0  # the first deny taken back


def _refuse_second(deny: Callable[[CgroupV2, str], None]) -> Callable[[CgroupV2, str], None]:
    calls: list[str] = []

    def refusing(self: CgroupV2, cgroup: str) -> None:
        calls.append(cgroup)
        if len(calls) > 1:
            raise DeviceControlError(errno.E2BIG, f"cannot attach the device deny to {cgroup}: Argument list too long")
        deny(self, cgroup)

    return refusing


HYBRID = UNIFIED is not None and DEVICES is not None


@pytest.mark.skipif(not HYBRID, reason="not a hybrid host (cgroup2 and the v1 devices controller both mounted)")
@pytest.mark.parametrize("host", ["v2"], indirect=True)
def test_auto_on_a_hybrid_host_takes_the_device_program_on_the_cgroup2_hierarchy_and_says_why(
    host: Host, caplog: pytest.LogCaptureFixture
) -> None:
    config = DeviceControl(mode="auto", user_cgroups=[host.user], name=host.tag, kernel_subtree=f"{host.tag}/kernels")
    with caplog.at_level("INFO"):
        cgroups = config.start(single_user=False, simulated=True, simulated_node_dir=str(host.folder))
    assert cgroups is not None and cgroups.mode == MODE_V2 and cgroups.mount == UNIFIED
    assert config.reason.startswith(f"{MODE_V2} on {UNIFIED} (hybrid host:") and str(DEVICES) in config.reason
    described = json.loads(json.dumps(config.describe()))
    assert described["mode"] == MODE_V2 and described["reason"] == config.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device control:")]
    assert len(lines) == 1 and lines[0].startswith(f"device control: {config.reason}; GPU nodes (nvidia1, nvidia2, nvidia3")
    assert host.start().open(host.gpu(0)) == "EPERM"  # denied by the program the users' cgroup2 cgroup got
    assert not [p for p in glob.glob(os.path.join(str(UNIFIED), f"{host.tag}-probe-*"))]  # the probe left nothing


@pytest.mark.skipif(not HYBRID, reason="not a hybrid host (cgroup2 and the v1 devices controller both mounted)")
@pytest.mark.parametrize("host", ["v1"], indirect=True)
def test_auto_falls_back_to_the_v1_devices_controller_where_no_device_program_can_be_attached(
    host: Host, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_gpupool.enforcement import device_control

    monkeypatch.setattr(device_control, "program_refused", lambda unified, name: "cannot load a device program (Operation not permitted)")
    config = DeviceControl(mode="auto", user_cgroups=[host.user], name=host.tag, kernel_subtree=f"{host.tag}/kernels")
    with caplog.at_level("INFO"):
        cgroups = config.start(single_user=False, simulated=True, simulated_node_dir=str(host.folder))
    assert cgroups is not None and cgroups.mode == MODE_V1
    assert config.reason == f"{MODE_V1} on {DEVICES} (no device program can be attached on {UNIFIED}: cannot load a device program (Operation not permitted))"
    assert json.loads(json.dumps(config.describe()))["reason"] == config.reason
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("device control:")]
    assert len(lines) == 1 and lines[0].startswith(f"device control: {config.reason}; GPU nodes")
    assert host.start().open(host.gpu(0)) == "EPERM"  # denied through devices.deny


# --- the role on a real pool's transitions ------------------------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_each_decision_of_the_pool_is_followed_by_the_kernels_device_access(host: Host, tmp_path: Path) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    pool = make_pool(tmp_path, "3x16GiB")
    assert [d.minor for d in pool.devices()] == host.minors
    kernel, bystander = host.start(), host.start()
    kernels: dict[str, list[int]] = {}
    role = DeviceControlRole(control, lambda lease: kernels.get(lease.id, []))

    def decided() -> dict[str, str]:
        return role.apply(pool.leases(include_released=True), pool.devices())

    def opens(probe: Probe) -> list[str]:
        return [probe.open(host.gpu(i)) for i in range(3)]

    first = pool.request(req("alice", 8, suspendable=True, kernel_id="k1"))
    assert first.state is LeaseState.GRANTED
    assert decided() == {first.id: "no process"}  # its kernel has not started: nothing to allow yet
    kernels[first.id] = [kernel.pid]
    assert decided() == {first.id: "allowed"}
    index = [d.uuid for d in pool.devices()].index(first.devices[0])
    assert opens(kernel) == ["ENXIO" if i == index else "EPERM" for i in range(3)]
    assert opens(bystander) == ["EPERM"] * 3
    assert decided() == {}  # nothing changed, nothing done

    pool.suspend(first.id)  # still copying its memory off: the GPU stays open
    assert decided() == {} and kernel.open(host.gpu(index)) == "ENXIO"
    pool.confirm_transition(first.id, parked_bytes=0)
    assert pool.get(first.id).state is LeaseState.SUSPENDED
    assert decided() == {first.id: "denied"} and opens(kernel) == ["EPERM"] * 3  # parked

    resumed = pool.resume(first.id)
    if resumed.transition is not Transition.NONE:
        pool.confirm_transition(first.id)
    again = pool.get(first.id)
    assert again.state is LeaseState.GRANTED
    assert decided() == {first.id: "allowed"}
    index = [d.uuid for d in pool.devices()].index(again.devices[0])
    assert opens(kernel) == ["ENXIO" if i == index else "EPERM" for i in range(3)]

    pool.release(first.id)
    assert decided() == {first.id: "denied"} and opens(kernel) == ["EPERM"] * 3
    kernel.process.kill()
    kernel.process.wait()
    assert decided() == {first.id: "removed"} and control.kernels == {}


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_process_that_joins_a_kernel_whose_grant_did_not_change_writes_no_rules(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint worker, or a kernel process found outside its cgroup, only joins: no program
    loaded and attached again (v2), no devices.deny/devices.allow written again (v1)."""
    from jupyter_gpupool.enforcement import device_control

    writes: list[str] = []
    real_write, real_attach = device_control._write, cgroup_bpf.attach_rules
    monkeypatch.setattr(device_control, "_write", lambda path, text: (writes.append(os.path.basename(path)), real_write(path, text))[1])
    monkeypatch.setattr(cgroup_bpf, "attach_rules", lambda *args: (writes.append("program"), real_attach(*args))[1])
    control = host.mechanism()
    control.deny_users(host.user)
    pool = make_pool(tmp_path, "3x16GiB")
    kernel, worker = host.start(), host.start()
    kernels: dict[str, list[int]] = {}
    role = DeviceControlRole(control, lambda lease: kernels.get(lease.id, []))
    lease = pool.request(req("alice", 8, kernel_id="k1"))
    index = [d.uuid for d in pool.devices()].index(lease.devices[0])
    kernels[lease.id] = [kernel.pid]
    assert role.apply(pool.leases(), pool.devices()) == {lease.id: "allowed"}
    assert worker.open(host.gpu(index)) == "EPERM"
    writes.clear()
    kernels[lease.id] = [kernel.pid, worker.pid]  # a worker started after the grant: found on the next pass
    assert role.apply(pool.leases(), pool.devices()) == {}
    assert writes == ["cgroup.procs"]  # it joined; the rules stayed as they were
    assert worker.open(host.gpu(index)) == "ENXIO" and kernel.open(host.gpu(index)) == "ENXIO"
    assert [worker.open(host.gpu(i)) for i in range(3) if i != index] == ["EPERM"] * 2
    writes.clear()
    control.grant(lease.id, [worker.pid], [host.minors[(index + 1) % 3]])  # another GPU: new rules
    assert writes.count("program" if host.path == "v2" else "devices.deny") >= 1
    assert worker.open(host.gpu((index + 1) % 3)) == "ENXIO" and worker.open(host.gpu(index)) == "EPERM"


FIRST_OPEN = "import errno, os, sys\ntry:\n    os.close(os.open(sys.argv[1], os.O_RDWR))\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n"


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_kernel_started_through_device_join_runs_only_once_its_gpu_is_open_to_it(host: Host, tmp_path: Path) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    pool = make_pool(tmp_path, "3x16GiB")
    # This test (root) is the lease's holder, as a root Jupyter server would be.
    lease = pool.request(req("alice", 8, kernel_id="k1", holder_pid=os.getpid(), holder_host="here"))
    index = [d.uuid for d in pool.devices()].index(lease.devices[0])
    users = UnixUsers(names={"alice": 4242})  # alice's processes would run as uid 4242
    role = DeviceControlRole(control, lambda lease: lease_processes([lease], users, "here").get(lease.id, []))

    def launch(timeout: str) -> subprocess.Popen[str]:
        # Born in its spawner's cgroups (join_cgroup), as a kernel a user's server starts is.
        born = [arg for d in host.spawner_dirs for arg in (sys.executable, "-m", "jupyter_gpupool.enforcement.join_cgroup", d, "--")]
        command = [*born, sys.executable, "-m", "jupyter_gpupool.enforcement.device_join", "--timeout", timeout, "--"]
        env = {**os.environ, "GPUPOOL_LEASE_ID": lease.id, "GPUPOOL_SIMULATE_NODES": str(host.folder)}
        return subprocess.Popen(
            [*command, sys.executable, "-c", FIRST_OPEN, str(host.gpu(index))], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    late = launch("0.3")  # nobody sets up its access: it runs anyway, and says why its GPU refuses
    out, err = late.communicate(timeout=20)
    assert out.split() == ["EPERM"] and "did not set up this kernel's GPU access within 0.3 s" in err

    # Where no device control holds it, it does not wait: a launcher may start every kernel through it.
    free = subprocess.run(
        [sys.executable, "-m", "jupyter_gpupool.enforcement.device_join", "--timeout", "20", "--", sys.executable, "-c", FIRST_OPEN, str(host.gpu(index))],
        env={**os.environ, "GPUPOOL_LEASE_ID": lease.id, "GPUPOOL_SIMULATE_NODES": str(host.folder)},
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    assert free.stdout.split() == ["ENXIO"] and free.stderr == ""

    kernel = launch("20")
    # Once it is waiting (its launcher's own cgroup joins done), the pool's next pass lets it in.
    assert _until(lambda: psutil.Process(kernel.pid).cmdline()[1:3] == ["-m", "jupyter_gpupool.enforcement.device_join"])
    assert role.apply([lease], pool.devices()) == {lease.id: "allowed"}
    out, err = kernel.communicate(timeout=20)
    assert out.split() == ["ENXIO"] and err == ""  # its very first open: allowed (no driver behind it)

    # A root process that only copied the lease's variable, and that its holder did not start, is not its kernel.
    started = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)' >/dev/null 2>&1 & echo $!"],
        env={**os.environ, "GPUPOOL_LEASE_ID": lease.id},
        capture_output=True,
        text=True,
        check=True,
    )
    stranger = psutil.Process(int(started.stdout))  # its shell exited: it is nobody's child here
    try:
        assert os.getpid() not in [p.pid for p in stranger.parents()]
        assert lease_processes([lease], users, "here") == {}
    finally:
        stranger.kill()


def _until(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_the_service_follows_the_pools_changes_and_a_restart_adopts_what_it_left(
    host: Host, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NODE_DIR_ENV, str(host.folder))
    pool = make_pool(tmp_path, "3x16GiB")
    users = UnixUsers(names={"alice": 4242})

    def service() -> DeviceControlService:
        config = DeviceControl(mode=host.path, user_cgroups=[host.user], name=host.tag, kernel_subtree=f"{host.tag}/kernels")
        return DeviceControlService(config, pool, users, interval=0.2)

    first = service()
    assert first.start() and first.describe()["mode"] in (MODE_V2, MODE_V1)
    try:
        lease = pool.request(req("alice", 8, kernel_id="k1", holder_pid=os.getpid()))
        index = [d.uuid for d in pool.devices()].index(lease.devices[0])
        kernel = host.start(lease.id)
        assert _until(lambda: kernel.open(host.gpu(index)) == "ENXIO")  # found on the next pass
        assert kernel.open(host.gpu((index + 1) % 3)) == "EPERM" and host.start().open(host.gpu(index)) == "EPERM"
    finally:
        first.stop()  # as a crash would: the rules stay
    assert kernel.open(host.gpu(index)) == "ENXIO"

    second = service()
    assert second.start() and second.role is not None and list(second.role.cgroups.kernels) == [lease.id]  # adopted
    try:
        pool.release(lease.id)  # the pool's change wakes it: denied within that decision's pass
        assert _until(lambda: kernel.open(host.gpu(index)) == "EPERM", seconds=5)
        kernel.process.kill()
        kernel.process.wait()
        assert _until(lambda: second.role is not None and not second.role.cgroups.kernels)  # removed once empty
    finally:
        second.stop()


def test_a_pooled_user_added_after_start_is_found_within_the_retry_of_a_miss(tmp_path: Path) -> None:
    """A hub's new user (TLJH makes ``jupyter-NAME`` at first login) may get its Unix account after
    device control first looked its name up: a miss is looked up again, at most once per retry."""
    name = f"gpo-late-{secrets.token_hex(3)}"  # per run: two runs may share the host
    users = UnixUsers(miss_retry_seconds=1.0)
    pool = make_pool(tmp_path, "1x16GiB")
    lease = pool.request(req(name, 8, kernel_id="k1"))
    assert users.uid(name) is None  # no such user yet
    missed = time.monotonic()
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    kernel = None
    try:
        if time.monotonic() - missed < 0.9:
            assert users.uid(name) is None  # a miss is not looked up again at once
        kernel = subprocess.Popen(
            ["setpriv", f"--reuid={name}", f"--regid={name}", "--clear-groups", "/bin/sleep", "30"],
            env={"PATH": "/usr/bin:/bin", "GPUPOOL_LEASE_ID": lease.id},
        )
        assert _until(lambda: psutil.Process(kernel.pid).uids().real != 0, 5)
        assert _until(lambda: lease_processes([lease], users, "here") == {lease.id: [kernel.pid]}, 5)
        assert users.uid(name) == pwd.getpwnam(name).pw_uid
    finally:
        if kernel is not None:
            kernel.kill()
            kernel.wait()
        subprocess.run(["userdel", name], check=False)
