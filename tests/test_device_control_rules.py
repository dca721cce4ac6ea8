"""Device control's pure parts, without root: what each lease's kernel may open, the device program's
verdicts (run by a small interpreter of the instructions it is made of), and reading the host's
mounts and ``/proc/devices``. tests/test_device_control.py runs it all on real cgroups as root."""

from __future__ import annotations

import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpupool.core.models import Device, Lease, LeaseState, Transition
from jupyter_gpupool.enforcement.cgroup_bpf import MAX_INSNS, DeviceRule, assemble
from jupyter_gpupool.enforcement.device_control import (
    MODE_V1,
    MODE_V2,
    MigSlice,
    NvidiaNodes,
    _cap_tree,
    _mig_minors,
    _proc_major,
    cgroup_mounts,
    choose_path,
)
from jupyter_gpupool.enforcement.device_control_role import allowed_devices, minors_of

CHAR, BLOCK = 2, 1
MKNOD, READ, WRITE = 1, 2, 4


def run_program(code: bytes, kind: int, access: int, major: int, minor: int) -> int:
    """Interpret the instructions ``assemble`` emits, on one device context; returns R0."""
    context = [(access << 16) | kind, major, minor]
    regs = [0] * 11
    pc = 0
    for _ in range(10_000):
        op, reg_byte, off, imm = struct.unpack_from("<BBhi", code, pc * 8)
        dst, src = reg_byte & 0xF, reg_byte >> 4
        pc += 1
        if op == 0x61:  # ldx word from the context (R1)
            assert src == 1
            regs[dst] = context[off // 4]
        elif op == 0x54:
            regs[dst] &= imm & 0xFFFFFFFF
        elif op == 0x74:
            regs[dst] >>= imm
        elif op == 0xBC:
            regs[dst] = regs[src]
        elif op == 0xB4:
            regs[dst] = imm & 0xFFFFFFFF
        elif op == 0x55:
            pc += off if regs[dst] != imm else 0
        elif op == 0x5D:
            pc += off if regs[dst] != regs[src] else 0
        elif op == 0x15:
            pc += off if regs[dst] == imm else 0
        elif op == 0x25:  # unsigned >
            pc += off if regs[dst] > imm & 0xFFFFFFFF else 0
        elif op == 0xA5:  # unsigned <
            pc += off if regs[dst] < imm & 0xFFFFFFFF else 0
        elif op == 0x95:
            return regs[0]
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")
    raise AssertionError("the program did not exit")


def test_the_users_program_denies_gpu_nodes_in_every_access_and_nothing_else() -> None:
    code = assemble([DeviceRule(False, 195, 0), DeviceRule(False, 195, 3), DeviceRule(False, 509, 4)], default_allow=True)
    for access in (READ, WRITE, READ | WRITE, MKNOD):
        assert run_program(code, CHAR, access, 195, 0) == 0
        assert run_program(code, CHAR, access, 195, 3) == 0
        assert run_program(code, CHAR, access, 509, 4) == 0  # a GPU's capability node
    assert run_program(code, CHAR, READ | WRITE, 195, 255) == 1  # nvidiactl
    assert run_program(code, CHAR, READ | WRITE, 195, 1) == 1  # a GPU the rules do not name
    assert run_program(code, BLOCK, READ, 195, 0) == 1  # a block device of the same numbers
    assert run_program(code, CHAR, READ | WRITE, 1, 3) == 1  # /dev/null


def test_access_letters_deny_any_access_named_and_allow_only_all_access_named() -> None:
    deny_write = assemble([DeviceRule(False, 195, 7, access="w")], default_allow=True)
    assert run_program(deny_write, CHAR, READ, 195, 7) == 1
    assert run_program(deny_write, CHAR, READ | WRITE, 195, 7) == 0
    allow_read = assemble([DeviceRule(True, 195, 7, access="r")], default_allow=False)
    assert run_program(allow_read, CHAR, READ, 195, 7) == 1
    assert run_program(allow_read, CHAR, READ | WRITE, 195, 7) == 0
    wildcard = assemble([DeviceRule(True, 195, None, kind="a")], default_allow=False)
    assert run_program(wildcard, BLOCK, READ, 195, 12) == 1 and run_program(wildcard, CHAR, READ, 196, 12) == 0


def test_the_first_matching_rule_decides() -> None:
    code = assemble([DeviceRule(True, 195, 2), DeviceRule(False, 195, None)], default_allow=True)
    assert run_program(code, CHAR, READ | WRITE, 195, 2) == 1
    assert run_program(code, CHAR, READ | WRITE, 195, 5) == 0


def lease(state: LeaseState, devices: tuple[str, ...] = (), **kw: Any) -> Lease:
    return Lease(id="l1", owner="alice", memory=1, state=state, created_at=0.0, devices=devices, **kw)


@pytest.mark.parametrize(
    ("made", "allowed"),
    [
        (lease(LeaseState.GRANTED, ("a",)), ("a",)),
        (lease(LeaseState.GRANTED, ("a",), transition=Transition.SUSPENDING), ("a",)),  # still copying off
        (lease(LeaseState.GRANTED, ("b",), transition=Transition.RESTORING), ("b",)),
        (lease(LeaseState.GRANTED, ("b",), transition=Transition.MIGRATING, migrate_from=("a",)), ("b", "a")),
        (lease(LeaseState.SUSPENDED, (), home_devices=("a",)), ()),  # parked
        (lease(LeaseState.QUEUED), ()),
        (lease(LeaseState.RELEASED, ("a",)), None),
    ],
)
def test_what_a_kernel_may_open_follows_its_lease(made: Lease, allowed: tuple[str, ...] | None) -> None:
    assert allowed_devices(made) == allowed


def test_a_mig_instance_opens_its_gpus_node_and_its_own_instance() -> None:
    gpu = Device(index=0, uuid="GPU-a", name="A100", memory_total=1, minor=5)
    mig = Device(index=0, uuid="MIG-a", name="A100 MIG 1g", memory_total=1, is_mig=True, parent_uuid="GPU-a", minor=5, mig_gi=3, mig_ci=0)
    unknown = Device(index=0, uuid="MIG-u", name="A100 MIG 1g", memory_total=1, is_mig=True, parent_uuid="GPU-a", minor=5)
    nameless = Device(index=1, uuid="GPU-b", name="A100", memory_total=1)  # no minor known: nothing to allow
    devices = {d.uuid: d for d in (gpu, mig, unknown, nameless)}
    assert minors_of(["MIG-a"], devices) == {MigSlice(5, 3, 0)} and minors_of(["GPU-a"], devices) == {5}
    assert minors_of(["MIG-u"], devices) == {5}  # its instance unknown: its whole GPU, as before instances were told apart
    assert minors_of(["GPU-b", "GPU-gone"], devices) == frozenset()


def nodes_of(rules: list[DeviceRule]) -> list[tuple[int | None, int | None]]:
    """The nodes rules name, one by one (a range's minors each)."""
    return [(r.major, r.minor) for rule in rules for r in rule.expand()]


def test_rules_deny_every_gpu_but_the_granted_ones_and_their_capability_nodes() -> None:
    nodes = NvidiaNodes("/dev", gpus={0: (195, 0), 1: (195, 1)}, caps={0: ((509, 3),), 1: ((509, 4), (509, 5))}, control=((195, 255),))
    assert nodes_of(nodes.rules()) == [(195, 0), (195, 1), (509, 3), (509, 4), (509, 5)]
    assert nodes_of(nodes.rules([1])) == [(195, 0), (509, 3)]
    assert not any(r.allow for r in nodes.rules())


def test_a_mig_instance_is_allowed_its_own_gpu_and_compute_instance_capability_nodes_only() -> None:
    instances = {(0, 1, None): (509, 12), (0, 1, 0): (509, 13), (0, 2, None): (509, 21), (0, 2, 0): (509, 22), (1, 1, None): (509, 147)}
    nodes = NvidiaNodes(
        "/dev", gpus={0: (195, 0), 1: (195, 1)}, caps={0: ((509, 12), (509, 13), (509, 21), (509, 22)), 1: ((509, 147),)}, instances=instances
    )
    denied = nodes_of(nodes.rules([MigSlice(0, 1, 0)]))
    assert denied == [(195, 1), (509, 21), (509, 22), (509, 147)]  # its GPU's node and gi1, gi1/ci0 open
    assert nodes_of(nodes.rules([MigSlice(0, 2, 0), MigSlice(0, 1, 0)])) == [(195, 1), (509, 147)]
    assert nodes_of(nodes.rules([0])) == [(195, 1), (509, 147)]  # a whole GPU: all its capability nodes
    # an instance the tables do not know: its GPU's node only
    assert nodes_of(nodes.rules([MigSlice(1, 4, 0)])) == [(195, 0), (509, 12), (509, 13), (509, 21), (509, 22), (509, 147)]


def test_a_range_rule_matches_every_minor_from_its_first_to_its_last_and_no_other() -> None:
    code = assemble([DeviceRule(False, 509, 3, last=137), DeviceRule(False, 195, 0, last=0)], default_allow=True)
    assert [run_program(code, CHAR, READ, 509, minor) for minor in (1, 2, 3, 70, 137, 138)] == [1, 1, 0, 0, 0, 1]
    assert run_program(code, CHAR, READ, 195, 0) == 0 and run_program(code, CHAR, READ, 195, 1) == 1
    assert DeviceRule(False, 509, 3, last=5).describe() == "deny c 509:3-5 rwm"
    assert [r.minor for r in DeviceRule(False, 509, 3, last=5).expand()] == [3, 4, 5]


def eight_gpus_with_every_mig_slot() -> NvidiaNodes:
    """What ``NvidiaNodes.read`` makes of an 8-GPU host: ``mig-minors`` lists 15 GPU instances of
    (1 + 8 compute instances) for every GPU, 135 capability nodes each, minors from 3 on."""
    instances: dict[tuple[int, int, int | None], tuple[int, int]] = {}
    minor = 3
    for gpu in range(8):
        for gi in range(15):
            for ci in (None, *range(8)):
                instances[(gpu, gi, ci)] = (509, minor)
                minor += 1
    caps = {gpu: tuple(sorted(n for (g, _gi, _ci), n in instances.items() if g == gpu)) for gpu in range(8)}
    return NvidiaNodes("/dev", gpus={gpu: (195, gpu) for gpu in range(8)}, caps=caps, control=((195, 255),), instances=instances)


@pytest.mark.parametrize(
    "grant",
    [(), (3,), (MigSlice(2, 4, 1),), (MigSlice(0, 0, 0), MigSlice(7, 14, 7), 5), tuple(MigSlice(g, gi, 0) for g in range(8) for gi in range(15))],
    ids=["users", "a GPU", "a MIG instance", "three", "a slice of every instance"],
)
def test_the_program_of_eight_gpus_with_every_mig_slot_stays_small_and_denies_every_node_not_granted(grant: tuple[Any, ...]) -> None:
    """1,088 nodes to deny one by one were ~5,400 instructions: more than a kernel before 5.2
    loads (4,096, E2BIG even for root), and a refused users' deny denied nothing."""
    nodes = eight_gpus_with_every_mig_slot()
    code = assemble(nodes.rules(grant), default_allow=True)
    assert len(code) // 8 < (100 if len(grant) < 10 else MAX_INSNS // 4)  # at most two rules more per instance granted
    gpus, caps = nodes.allowed(grant)
    for number in [*nodes.gpus.values(), *(n for numbers in nodes.caps.values() for n in numbers)]:
        gpu_open = number[0] == 195 and number[1] in gpus
        assert run_program(code, CHAR, READ | WRITE, *number) == int(gpu_open or number in caps), number
    for other in ((195, 255), (509, 1), (509, 2), (509, 3 + 8 * 135), (1, 3)):  # nvidiactl, config, monitor, past the table, /dev/null
        assert run_program(code, CHAR, READ | WRITE, *other) == 1


def test_the_drivers_mig_tables_are_read_instance_by_instance(tmp_path: Path) -> None:
    table = tmp_path / "mig-minors"
    table.write_text("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi0/ci0/access 4\ngpu1/gi1/access 147\ngpu1/gi1/ci7/access 155\nnonsense\n")
    assert _mig_minors(str(table)) == {(0, 0, None): 3, (0, 0, 0): 4, (1, 1, None): 147, (1, 1, 7): 155}  # config, monitor: host-wide
    assert _mig_minors(str(tmp_path / "none")) == {}
    tree = tmp_path / "capabilities"
    for parts, minor in (("gpu2/mig/gi1", 12), ("gpu2/mig/gi1/ci0", 13), ("mig", 1)):
        (tree / parts).mkdir(parents=True, exist_ok=True)
        (tree / parts / "access").write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\n")
    assert _cap_tree(str(tree)) == {(2, 1, None): 12, (2, 1, 0): 13}


@pytest.mark.parametrize(
    ("requested", "unified", "devices", "refused", "path", "reason"),
    [
        ("auto", "/sys/fs/cgroup", None, None, "v2", f"{MODE_V2} on /sys/fs/cgroup (a cgroup v2 host)"),
        ("auto", "/u", "/d", None, "v2", f"{MODE_V2} on /u (hybrid host: kernels keep their cgroups; the v1 'devices' controller at /d is left as it is)"),
        ("auto", "/u", "/d", "no bpf", "v1", f"{MODE_V1} on /d (no device program can be attached on /u: no bpf)"),
        ("auto", None, "/d", None, "v1", f"{MODE_V1} on /d (no cgroup2 hierarchy is mounted)"),
        ("auto", "/u", None, "no bpf", None, "no device program can be attached on /u (no bpf) and no cgroup v1 'devices' controller is mounted"),
        ("auto", None, None, None, None, "no cgroup v2 hierarchy and no cgroup v1 'devices' controller is mounted"),
        ("v1", "/u", "/d", None, "v1", f"{MODE_V1} on /d (c.DeviceControl.mode is 'v1')"),
        ("v1", "/u", None, None, None, "c.DeviceControl.mode is 'v1' but no cgroup v1 'devices' hierarchy is mounted"),
        ("v2", "/u", "/d", None, "v2", f"{MODE_V2} on /u (c.DeviceControl.mode is 'v2')"),
        ("v2", "/u", "/d", "no bpf", None, "c.DeviceControl.mode is 'v2' but no device program can be attached on /u (no bpf)"),
        ("v2", None, "/d", None, None, "c.DeviceControl.mode is 'v2' but no cgroup2 hierarchy is mounted"),
    ],
)
def test_the_path_is_a_rule_of_what_the_host_has(
    requested: str, unified: str | None, devices: str | None, refused: str | None, path: str | None, reason: str
) -> None:
    assert choose_path(requested, unified, devices, refused) == (path, reason)


def test_mounts_and_dynamic_majors_are_read_from_the_hosts_files(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0\n"
        "cgroup /sys/fs/cgroup/devices cgroup rw,relatime,devices 0 0\n"
        "cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0\n"
    )
    assert cgroup_mounts(str(mounts)) == ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/devices")
    assert cgroup_mounts(str(tmp_path / "none")) == (None, None)
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n195 nvidia-frontend\n509 nvidia-caps\n\nBlock devices:\n510 nvidia-caps\n")
    assert _proc_major(str(devices), "nvidia-caps") == 509 and _proc_major(str(devices), "nvidia-uvm") is None


def test_device_join_runs_the_kernel_at_once_without_a_lease_and_refuses_bad_usage() -> None:
    module = [sys.executable, "-m", "jupyter_gpupool.enforcement.device_join"]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ran = subprocess.run([*module, "--", sys.executable, "-c", "print('kernel')"], check=False, env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0 and ran.stdout == "kernel\n" and ran.stderr == ""
    bad = subprocess.run([*module, "--timeout", "soon", "--", "true"], check=False, env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")


def test_the_unpooled_pages_table_says_every_opt_out_route_is_denied_where_device_control_runs() -> None:
    """docs/unpooled.md lists every way a kernel can start without asking the pool; where device
    control runs each is denied (a kernel of one is a process outside any granted kernel:
    tests/test_device_control_broker.py starts one through a kernelspec naming local-provisioner)."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "unpooled.md").read_text()
    header = "| how | who sets it | how an admin locks it | where [device control](device-control.md) runs |"
    assert header in page
    separator, *routes = page.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()
    assert separator.startswith("| --- |") and len(routes) >= 8 and all(row.startswith("| ") for row in routes)
    said = [row.rstrip(" |").rsplit(" | ", 1)[1] for row in routes]
    assert all(cell.startswith("denied") for cell in said), said
