"""What device control promises beyond who opens which node, on both cgroup paths: a granted kernel
stays under its spawner's memory and pids limits; a pool's move opens the GPU it goes to and, once confirmed,
shuts the one it left, each within one decision; a descriptor opened before a release keeps working
and its memory stays taken (only what the driver shows free is free); a host that cannot do it
says so once and the pool runs on.

Same host as ``tests/test_device_control.py``: ``mknod``-made nodes, real cgroups named per run,
real processes. Needs root.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from pool_helpers import T0, make_pool, req
from test_device_control import DEVICES, MEMORY, PATHS, UNIFIED, Host, Probe, _remove_tree, made_host

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseState, Transition
from jupyter_gpupool.devices.simulated import SimulatedBackend, parse_inventory
from jupyter_gpupool.enforcement import device_control
from jupyter_gpupool.enforcement.claims import UnixUsers
from jupyter_gpupool.enforcement.device_control import CgroupV1, CgroupV2, DeviceCgroups, DeviceControl, NvidiaNodes
from jupyter_gpupool.enforcement.device_control_role import DeviceControlRole, DeviceControlService
from jupyter_gpupool.errors import RequestRefused
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups and mknod need root")
PIDS = "/sys/fs/cgroup/pids" if os.path.isdir("/sys/fs/cgroup/pids/") else None

# A kernel's process: opens a node, holds a descriptor and reads it, or fills memory, per line of stdin.
PROBE = textwrap.dedent(
    """
    import errno, os, sys
    held = []
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        try:
            if words[0] == "open":
                os.close(os.open(words[1], os.O_RDWR))
            elif words[0] == "hold":
                held.append(os.open(words[1], os.O_RDONLY))
            elif words[0] == "read":
                assert len(os.read(held[-1], 4)) == 4
            elif words[0] == "fork":
                child = os.fork()
                if child == 0:
                    os._exit(0)
                os.waitpid(child, 0)
            elif words[0] == "fill":
                block = bytearray(int(words[1]) << 20)
                for at in range(0, len(block), 4096):
                    block[at] = 1
            print("OK", flush=True)
        except OSError as exc:
            print(errno.errorcode.get(exc.errno, str(exc.errno)), flush=True)
    """
)


def start(on: Host, lease_id: str = "", also: tuple[str, ...] = ()) -> Probe:
    """A pooled user's process born in the users' cgroups (and in ``also``), a kernel of ``lease_id``."""
    env = {**os.environ, "GPUPOOL_LEASE_ID": lease_id} if lease_id else None
    process = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    probe = Probe(process)
    on.probes.append(probe)
    for directory in (*on.spawner_dirs, *also):
        Path(directory, "cgroup.procs").write_text(str(process.pid))
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return probe


def mechanism(on: Host, nodes: NvidiaNodes) -> DeviceCgroups:
    if on.path == "v2":
        assert UNIFIED is not None
        return CgroupV2(nodes, UNIFIED, on.tag)
    assert DEVICES is not None
    return CgroupV1(nodes, DEVICES, on.tag, f"{on.tag}/kernels")


@pytest.fixture
def host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    with made_host(request.param, tmp_path, SimulatedBackend(parse_inventory("2x40GiB")).devices()) as made:
        yield made


# --- 4. the spawner's memory limit ---------------------------------------------------------------------
def _limit_memory(on: Host, limit: int) -> tuple[str, ...]:
    """Cap the memory of the cgroups a process of ``on`` is born in; the cgroups to add it to."""
    swap = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("SwapTotal:")))
    if on.path == "v2" and UNIFIED is not None and "memory" in Path(UNIFIED, "cgroup.controllers").read_text().split():
        spawner = on.spawner_dirs[0]  # <tag>/user/spawner: memory enabled down to it (none of them holds a process)
        for directory in (os.path.dirname(os.path.dirname(spawner)), os.path.dirname(spawner)):
            Path(directory, "cgroup.subtree_control").write_text("+memory")
        Path(spawner, "memory.max").write_text(str(limit))
        if os.path.exists(os.path.join(spawner, "memory.swap.max")):
            Path(spawner, "memory.swap.max").write_text("0")
        elif swap:
            pytest.skip("swap without a cgroup swap limit: an over-limit kernel would swap, not stop")
        return ()
    if MEMORY is None:
        pytest.skip("no memory controller on either hierarchy")
    memory = os.path.join(MEMORY, on.tag, "spawner")
    os.makedirs(memory, exist_ok=True)  # the v1 host already has it; a hybrid host's v2 path adds it
    Path(memory, "memory.limit_in_bytes").write_text(str(limit))
    if os.path.exists(os.path.join(memory, "memory.memsw.limit_in_bytes")):
        Path(memory, "memory.memsw.limit_in_bytes").write_text(str(limit))
    elif swap:
        pytest.skip("swap without memsw accounting: an over-limit kernel would swap, not stop")
    return () if memory in on.spawner_dirs else (memory,)


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_granted_kernel_stays_under_its_spawners_memory_limit(host: Host) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    also = _limit_memory(host, 96 << 20)
    kernel = start(host, also=also)
    control.grant("lease-m", [kernel.pid], [host.minors[0]])
    assert kernel.ask(f"open {host.gpu(0)}") == "ENXIO" and kernel.ask(f"open {host.gpu(1)}") == "EPERM"  # in its kernel cgroup
    assert kernel.ask("fill 16") == "OK"  # under the limit
    assert kernel.ask("fill 512") == ""  # over it: the spawner's limit stopped it
    assert kernel.process.wait(timeout=30) == -9


def _limit_pids(on: Host, limit: int) -> tuple[str, ...]:
    """Cap the number of processes of the cgroups a process of ``on`` is born in; the cgroups to add it to."""
    if on.path == "v2" and UNIFIED is not None and "pids" in Path(UNIFIED, "cgroup.controllers").read_text().split():
        spawner = on.spawner_dirs[0]
        for directory in (os.path.dirname(os.path.dirname(spawner)), os.path.dirname(spawner)):
            Path(directory, "cgroup.subtree_control").write_text("+pids")
        Path(spawner, "pids.max").write_text(str(limit))
        return ()
    if PIDS is None:
        pytest.skip("no pids controller on either hierarchy")
    spawner = os.path.join(PIDS, on.tag, "spawner")
    os.makedirs(spawner)
    Path(spawner, "pids.max").write_text(str(limit))
    return (spawner,)


@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_granted_kernel_stays_under_its_spawners_pids_limit(host: Host) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    try:
        kernel = start(host, also=_limit_pids(host, 1))  # itself only
        control.grant("lease-p", [kernel.pid], [host.minors[0]])
        assert kernel.ask(f"open {host.gpu(0)}") == "ENXIO"  # in its kernel cgroup
        assert kernel.ask("fork") == "EAGAIN"  # still its spawner's: a fork past the limit is refused
    finally:
        if PIDS is not None:
            _remove_tree(os.path.join(PIDS, host.tag))


# --- 5. a move, each step within one decision --------------------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_move_opens_the_gpu_it_goes_to_and_shuts_the_one_it_left_each_on_its_decision(host: Host, tmp_path: Path) -> None:
    control = host.mechanism()
    control.deny_users(host.user)
    pool = make_pool(tmp_path, "2x40GiB", burst="40GiB", placement="best-fit")
    uuids = [d.uuid for d in pool.devices()]
    assert [d.minor for d in pool.devices()] == host.minors
    kernel, bystander = start(host), start(host)
    moving = pool.request(req("ann", 10, suspendable=True, kernel_id="k1"), now=T0)
    pool.request(req("bob", 25, kernel_id="k2"), now=T0)  # beside it (best fit): 5 GiB left there
    role = DeviceControlRole(control, lambda lease: [kernel.pid] if lease.id == moving.id else [])

    def decided() -> str | None:
        return role.apply(pool.leases(include_released=True), pool.devices()).get(moving.id)

    def opens() -> list[str]:
        return [kernel.ask(f"open {host.gpu(i)}") for i in range(2)]

    home = uuids.index(moving.devices[0])
    assert decided() == "allowed" and opens() == ["ENXIO" if i == home else "EPERM" for i in range(2)]
    with pytest.raises(RequestRefused, match="GPU is full"):
        pool.grow(moving.id, 30 * GIB, now=T0 + 1)
    pool.tick(now=T0 + 2)
    lease = pool.get(moving.id)
    assert lease.transition is Transition.MIGRATING and uuids.index(lease.devices[0]) != home
    assert decided() == "allowed" and opens() == ["ENXIO", "ENXIO"]  # both ends, while its memory is copied over
    pool.confirm_transition(moving.id, now=T0 + 4)
    assert decided() == "allowed" and opens() == ["EPERM" if i == home else "ENXIO" for i in range(2)]  # the one it left: shut
    assert [bystander.ask(f"open {host.gpu(i)}") for i in range(2)] == ["EPERM", "EPERM"]


# --- 7. a descriptor opened before a release -----------------------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_descriptor_opened_before_a_release_works_on_and_its_memory_stays_taken(host: Host, tmp_path: Path) -> None:
    """A device cgroup gates ``open()`` only. The GPU's node here is a node with a driver behind it
    (``/dev/zero``'s number), so a descriptor can be held and read, as a CUDA context holds its GPU's."""
    pool = make_pool(tmp_path, "1x16GiB")
    gpu = pool.devices()[0]
    assert gpu.minor is not None
    folder = tmp_path / "held"
    folder.mkdir()
    node = folder / f"nvidia{gpu.minor}"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 5))
    control = mechanism(host, NvidiaNodes(str(folder), gpus={gpu.minor: (1, 5)}))
    control.deny_users(host.user)
    alice = pool.request(req("alice", 12, kernel_id="ka"), now=T0)
    bob = pool.request(req("bob", 12, kernel_id="kb"), now=T0 + 1)
    assert bob.state is LeaseState.QUEUED
    kernel, bystander = start(host, alice.id), start(host)
    role = DeviceControlRole(control, lambda lease: [kernel.pid] if lease.id == alice.id else [])

    def decided() -> str | None:
        return role.apply(pool.leases(include_released=True), pool.devices()).get(alice.id)

    assert decided() == "allowed" and kernel.ask(f"hold {node}") == "OK" and bystander.ask(f"open {node}") == "EPERM"
    pool.backend.set_usage(kernel.pid, gpu.uuid, 10 * GIB)  # what the driver shows its context holds
    pool.release(alice.id, reason="%gpupool release", now=T0 + 10)
    assert decided() == "denied"
    assert kernel.ask(f"open {node}") == "EPERM"  # a new open: refused
    assert kernel.ask("read") == "OK"  # the descriptor it held: still works
    pool.tick(now=T0 + 11)
    assert pool.get(bob.id).state is LeaseState.QUEUED  # 12 GiB do not fit beside the 10 GiB still held
    assert [(row["pid"], row["bytes"], row["why"]) for row in pool.unpooled(now=T0 + 12)] == [(kernel.pid, 10 * GIB, Pool.RELEASED_BUT_HELD)]
    kernel.process.kill()
    kernel.process.wait()
    pool.tick(now=T0 + 13)  # its process exited: the driver shows it free, so it is
    assert pool.get(bob.id).state is LeaseState.GRANTED
    assert decided() == "removed"


# --- a host that cannot do it ---------------------------------------------------------------------------
@pytest.fixture
def read_only_cgroups(tmp_path: Path) -> Iterator[Path]:
    """A cgroup2 and a v1 ``devices`` mount this host does not let anyone write (a container's)."""
    folder = tmp_path / "cgroup"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "gpupool-test-ro", str(folder)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a folder here: {mounted.stderr.strip()}")
    try:
        (folder / "unified").mkdir()
        (folder / "devices").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_host_whose_cgroups_cannot_be_written_says_so_once_and_the_pool_runs_on(
    read_only_cgroups: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from jupyter_gpupool.devices.simulated import NODE_DIR_ENV, make_node_folder

    devices = SimulatedBackend(parse_inventory("1x16GiB")).devices()
    make_node_folder(str(tmp_path / "dev"), devices, caps_major=233, uvm_major=232)
    monkeypatch.setenv(NODE_DIR_ENV, str(tmp_path / "dev"))
    unified, devices_mount = str(read_only_cgroups / "unified"), str(read_only_cgroups / "devices")
    monkeypatch.setattr(device_control, "cgroup_mounts", lambda: (unified, devices_mount))
    pool = make_pool(tmp_path, "1x16GiB")
    service = DeviceControlService(DeviceControl(), pool, UnixUsers(names={"alice": 4242}), interval=0.2)
    with caplog.at_level(logging.INFO):
        started = service.start()
    service.stop()
    assert started is False  # off: nothing raised, no thread started
    said = [r.getMessage() for r in caplog.records if "device control" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("device control: off (cannot make a cgroup under ") and "Read-only file system" in said[0], said
    assert said[0].endswith("; unpooled GPU use is policed by the watchdog")
    assert service.describe() == {"mode": "off", "reason": service.config.reason}
    assert service.apply_now() == {}
    lease = pool.request(req("alice", 8, kernel_id="k1"), now=T0)  # the pool runs on as before
    assert lease.state is LeaseState.GRANTED


# --- 8. a restart after a crash: the grants as they are now ---------------------------------------------
@pytest.mark.parametrize("host", PATHS, indirect=True)
def test_a_restart_sets_each_adopted_kernels_rules_to_its_grant_now(host: Host) -> None:
    """While the broker was down the pool moved one kernel and parked another: the restart's sweep
    opens each what its lease holds now, no more, and leaves no cgroup of an ended lease."""
    crashed = host.mechanism()
    crashed.deny_users(host.user)
    moved, parked, ended = start(host), start(host), start(host)
    for key, probe, gpu in (("moved", moved, 0), ("parked", parked, 1), ("ended", ended, 0)):
        crashed.grant(key, [probe.pid], [host.minors[gpu]])
    ended.process.kill()
    ended.process.wait()
    restarted = host.mechanism()  # a new broker: it knows its cgroups by name only
    done = restarted.sweep({"moved": frozenset({host.minors[1]}), "parked": frozenset()})
    assert done == {"moved": "adopted", "parked": "adopted", "ended": "removed"}
    assert [moved.ask(f"open {host.gpu(i)}") for i in range(2)] == ["EPERM", "ENXIO"]
    assert [parked.ask(f"open {host.gpu(i)}") for i in range(2)] == ["EPERM"] * 2
    assert sorted(restarted.kernels) == ["moved", "parked"]
