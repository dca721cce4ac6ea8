"""Device control on a MIG GPU, both cgroup paths: a kernel granted a MIG instance opens its GPU's
node and the capability nodes of its own GPU instance and compute instance, and no other
instance's of that GPU; a kernel granted a whole GPU opens every capability node of it.

The node folder is the simulated one (``make_node_folder``): ``mknod``-made nodes, the driver's
``mig-minors`` table and its ``capabilities`` tree, with no driver behind them, so an allowed open
fails with ``ENXIO`` and a denied one with ``EPERM``. Needs root (see tests/test_device_control.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_device_control import PATHS, UNIFIED, Host, Probe, made_host

from jupyter_gpupool.core.models import Device, Lease, LeaseState
from jupyter_gpupool.devices.simulated import mig_cap_minor
from jupyter_gpupool.enforcement.cgroup_bpf import MAX_INSNS, assemble
from jupyter_gpupool.enforcement.device_control import MigSlice
from jupyter_gpupool.enforcement.device_control_role import DeviceControlRole

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="device cgroups and mknod need root")

WHOLE, MIG = 2, 1  # GPU minors: one whole GPU, one in MIG mode with two instances
DEVICES = [
    Device(index=0, uuid="GPU-whole", name="A100-80GB", memory_total=80, minor=WHOLE),
    Device(index=1, uuid="MIG-one", name="A100-80GB MIG 3g.40gb", memory_total=40, is_mig=True, parent_uuid="GPU-mig", mig_mode=True, minor=MIG, mig_gi=1, mig_ci=0),
    Device(index=1, uuid="MIG-two", name="A100-80GB MIG 3g.40gb", memory_total=40, is_mig=True, parent_uuid="GPU-mig", mig_mode=True, minor=MIG, mig_gi=2, mig_ci=0),
]


@pytest.fixture
def mig_host(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Host]:
    with made_host(request.param, tmp_path, DEVICES) as made:
        yield made


def cap(on: Host, gpu: int, gi: int, ci: int | None = None) -> Path:
    return on.folder / "nvidia-caps" / f"nvidia-cap{mig_cap_minor(gpu, gi, ci)}"


def granted(lease_id: str, *uuids: str) -> Lease:
    return Lease(id=lease_id, owner="alice", memory=1, state=LeaseState.GRANTED, created_at=0.0, devices=uuids)


def test_the_node_folder_maps_each_instance_to_its_capability_nodes(tmp_path: Path) -> None:
    with made_host("v2" if UNIFIED is not None else "v1", tmp_path, DEVICES) as on:
        nodes = on.nodes
        assert set(nodes.gpus) == {WHOLE, MIG}
        assert (MIG, 1, None) in nodes.instances and (MIG, 1, 0) in nodes.instances and (MIG, 2, 0) in nodes.instances
        assert len(nodes.caps[MIG]) == 15 * 9  # every slot mig-minors lists: instances made later are denied too
        assert {major for major, _ in nodes.instances.values()} == {os.major(os.stat(cap(on, MIG, 1)).st_rdev)}
        assert nodes.instances[(MIG, 2, 0)] == (nodes.instances[(MIG, 2, 0)][0], mig_cap_minor(MIG, 2, 0))


@pytest.mark.parametrize("mig_host", PATHS, indirect=True)
def test_a_kernel_granted_a_mig_instance_opens_only_that_instances_capability_nodes(mig_host: Host) -> None:
    on = mig_host
    control = on.mechanism()
    control.deny_users(on.user)
    later = cap(on, MIG, 5, 3)  # an instance the admin makes after the broker started: its slot is denied already
    os.mknod(later, 0o666 | 0o020000, os.makedev(on.nodes.instances[(MIG, 5, 3)][0], mig_cap_minor(MIG, 5, 3)))
    first, second, whole, outsider = on.start(), on.start(), on.start(), on.start()
    pids = {"l-one": [first.pid], "l-two": [second.pid], "l-whole": [whole.pid]}
    role = DeviceControlRole(control, lambda lease: pids[lease.id])
    leases = [granted("l-one", "MIG-one"), granted("l-two", "MIG-two"), granted("l-whole", "GPU-whole")]
    assert role.apply(leases, DEVICES) == {"l-one": "allowed", "l-two": "allowed", "l-whole": "allowed"}
    assert control.granted["l-one"] == {MigSlice(MIG, 1, 0)} and control.granted["l-whole"] == {WHOLE}

    nodes = {
        "gpu": on.folder / f"nvidia{MIG}",
        "one gi": cap(on, MIG, 1),
        "one ci": cap(on, MIG, 1, 0),
        "two gi": cap(on, MIG, 2),
        "two ci": cap(on, MIG, 2, 0),
        "later": later,
        "whole gpu": on.folder / f"nvidia{WHOLE}",
        "whole gi0": cap(on, WHOLE, 0),
    }

    def opens(probe: Probe) -> dict[str, str]:
        return {name: probe.open(path) for name, path in nodes.items()}

    assert opens(first) == {
        "gpu": "ENXIO",  # allowed (no driver behind it)
        "one gi": "ENXIO",
        "one ci": "ENXIO",
        "two gi": "EPERM",  # another instance of the same GPU
        "two ci": "EPERM",
        "later": "EPERM",
        "whole gpu": "EPERM",
        "whole gi0": "EPERM",
    }
    assert opens(second) == {**opens(first), "one gi": "EPERM", "one ci": "EPERM", "two gi": "ENXIO", "two ci": "ENXIO"}
    assert opens(whole) == {name: "ENXIO" if name.startswith("whole") else "EPERM" for name in nodes}
    assert opens(outsider) == dict.fromkeys(nodes, "EPERM")
    assert first.fork_open(cap(on, MIG, 1, 0)) == "ENXIO" and first.fork_open(cap(on, MIG, 2, 0)) == "EPERM"
    assert first.open(on.folder / "nvidiactl") == "ENXIO"

    released = Lease(id="l-one", owner="alice", memory=1, state=LeaseState.RELEASED, created_at=0.0, devices=("MIG-one",))
    assert role.apply([released], DEVICES) == {"l-one": "denied"}  # its process still runs
    assert opens(first) == dict.fromkeys(nodes, "EPERM")
    assert second.open(cap(on, MIG, 2, 0)) == "ENXIO"  # the other instance's kernel is not touched


@pytest.mark.parametrize("mig_host", PATHS, indirect=True)
def test_a_mig_instance_whose_ids_are_unknown_opens_its_whole_gpu(mig_host: Host) -> None:
    on = mig_host
    control = on.mechanism()
    control.deny_users(on.user)
    kernel = on.start()
    unknown = [Device(**{**DEVICES[1].__dict__, "mig_gi": None, "mig_ci": None})]
    role = DeviceControlRole(control, lambda lease: [kernel.pid])
    assert role.apply([granted("l-unknown", "MIG-one")], unknown) == {"l-unknown": "allowed"}
    assert control.granted["l-unknown"] == {MIG}
    assert [kernel.open(p) for p in (on.folder / f"nvidia{MIG}", cap(on, MIG, 1, 0), cap(on, MIG, 2, 0))] == ["ENXIO"] * 3
    assert kernel.open(on.folder / f"nvidia{WHOLE}") == "EPERM"


@pytest.mark.parametrize("path", PATHS)
def test_eight_gpus_with_every_capability_slot_stay_a_small_program_that_denies_each_node_not_granted(path: str, tmp_path: Path) -> None:
    """mig-minors lists 135 slots per GPU: denied node by node, the users' program of an 8-GPU
    host was 1,088 rules, ~5,400 instructions, which a kernel before Linux 5.2 refuses (E2BIG,
    over 4,096) and the users were then denied nothing. Consecutive nodes are one range now."""
    gpus = [Device(index=i, uuid=f"GPU-{i}", name="H100", memory_total=80, minor=i) for i in range(8)]
    with made_host(path, tmp_path, gpus) as on:
        assert sum(len(numbers) for numbers in on.nodes.caps.values()) == 8 * 135
        slot = MigSlice(6, 4, 2)
        for grant in ((), (slot,)):
            assert len(assemble(on.nodes.rules(grant), default_allow=True)) // 8 < 100 < MAX_INSNS
        control = on.mechanism()
        control.deny_users(on.user)
        user, kernel = on.start(), on.start()
        control.grant("l-slot", [kernel.pid], [slot])
        every = [(gpu, gi, ci) for gpu in range(8) for gi in range(15) for ci in (None, *range(8))]
        opens = {key: cap(on, *key) for key in every}
        for key, node in opens.items():  # the slots no instance fills yet too: made here to be opened
            if not node.exists():
                os.mknod(node, 0o666 | 0o020000, os.makedev(on.nodes.instances[key][0], mig_cap_minor(*key)))
        assert {user.open(node) for node in opens.values()} == {"EPERM"}
        assert {user.open(on.folder / f"nvidia{i}") for i in range(8)} == {"EPERM"}
        mine = {(6, 4, None), (6, 4, 2)}
        kernel_opens = {key: kernel.open(node) for key, node in opens.items()}
        assert {key: said for key, said in kernel_opens.items() if said != "EPERM"} == dict.fromkeys(mine, "ENXIO")
        assert [kernel.open(on.folder / f"nvidia{i}") for i in range(8)] == ["EPERM"] * 6 + ["ENXIO", "EPERM"]
        assert user.open(on.folder / "nvidiactl") == "ENXIO" and kernel.open(on.folder / "nvidiactl") == "ENXIO"
