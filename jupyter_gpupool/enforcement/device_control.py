"""Device control: on a multi-user host, a process opens only the GPU its kernel was granted.

The watchdog sees GPU memory used outside the pool after the fact; a device cgroup stops the
``open()`` of a GPU's node before anything is allocated, as Slurm's ``ConstrainDevices``, systemd's
``DeviceAllow=`` and container runtimes do. Two levels:

- **The user-level deny**: the cgroups that hold every login and service process of pooled users
  (``c.DeviceControl.user_cgroups``) are denied every NVIDIA GPU node (``/dev/nvidiaN``) and the
  MIG capability nodes of each GPU (every GPU and compute instance slot the driver's
  ``mig-minors`` table lists, so an instance made later is covered). The control nodes a CUDA program needs (``nvidiactl``,
  ``nvidia-uvm``, ``nvidia-uvm-tools``) stay open, and so does every other device.
- **A kernel's allow**: a granted kernel's processes sit in a root-owned cgroup of their own whose
  rules deny every GPU node but those of the kernel's grant: a whole GPU's node and all its
  capability nodes, or, for a MIG instance, its GPU's node and the capability nodes of its own GPU
  instance and compute instance (``gpuN/giX/access``, ``gpuN/giX/ciY/access``) only. On cgroup v2 it is a child of the
  kernel's own cgroup (memory, CPU and pids limits still apply), with a device program that
  overrides the user-level one (attached with ``BPF_F_ALLOW_OVERRIDE``); on cgroup v1 only the
  ``devices`` hierarchy changes: kernels sit in a broker-owned subtree beside the users' cgroups
  (a v1 child never has more device access than its parent).

A device cgroup gates ``open()`` only: a descriptor opened before a deny keeps working, so a live
CUDA context keeps its GPU. The driver-read rule (what the driver shows held stays taken) stays
the guarantee for memory already held; device control stops new opens.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from traitlets import CaselessStrEnum, List, Unicode
from traitlets.config import LoggingConfigurable

from jupyter_gpupool.enforcement import cgroup_bpf
from jupyter_gpupool.enforcement.cgroup_bpf import DeviceRule

NodeNumber = tuple[int, int]  # (major, minor)
InstanceKey = tuple[int, int, int | None]  # (GPU minor, GPU instance id, compute instance id or None: the GI's own)
MODE_V2 = "cgroup v2 eBPF device program"
MODE_V1 = "cgroup v1 devices controller"
MODE_OFF = "off"
_CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
_GPU_NODE = re.compile(r"^nvidia(\d+)$")
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_CAP_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)
_MIG_MINOR = re.compile(r"^gpu(\d+)/gi(\d+)/(?:ci(\d+)/)?access\s+(\d+)\s*$")
_CAP_PATH = re.compile(r"^gpu(\d+)/mig/gi(\d+)(?:/ci(\d+))?$")


class DeviceControlError(OSError):
    """Device control could not do what was asked (the message says what and why)."""


@dataclass(frozen=True, order=True)
class MigSlice:
    """One MIG instance a kernel may open: its GPU's minor (``/dev/nvidiaN``'s N), its GPU
    instance id and its compute instance id, as NVML and the driver's ``mig-minors`` name them."""

    gpu: int
    gi: int
    ci: int


#: What a kernel is granted, item by item: a whole GPU (its minor) or one MIG instance.
Grant = int | MigSlice


def gpu_of(grant: Grant) -> int:
    """The GPU minor whose ``/dev/nvidiaN`` a grant opens."""
    return grant.gpu if isinstance(grant, MigSlice) else grant


@dataclass(frozen=True)
class NvidiaNodes:
    """The host's NVIDIA device nodes, by number: what is denied and what stays open."""

    folder: str
    gpus: Mapping[int, NodeNumber]  # GPU minor → /dev/nvidiaN's number
    caps: Mapping[int, tuple[NodeNumber, ...]] = field(default_factory=dict)  # GPU minor → its MIG capability nodes
    control: tuple[NodeNumber, ...] = ()
    instances: Mapping[InstanceKey, NodeNumber] = field(default_factory=dict)  # which capability node is whose

    @classmethod
    def read(cls, node_dir: str = "/dev", proc_dir: str = "/proc") -> NvidiaNodes:
        """Read the nodes in ``node_dir`` and the capability map under ``proc_dir``: the driver's
        ``driver/nvidia-caps/mig-minors`` (every instance slot of every GPU), and the instances that
        exist now (``driver/nvidia/capabilities/gpuN/mig/giX[/ciY]/access``) on drivers without it.
        ``nvidia-caps`` has a dynamic major, read from ``proc_dir/devices``."""
        gpus: dict[int, NodeNumber] = {}
        control: list[NodeNumber] = []
        try:
            names = sorted(os.listdir(node_dir))
        except OSError as exc:
            raise DeviceControlError(exc.errno or errno.ENOENT, f"cannot read the device folder {node_dir}: {exc.strerror}") from None
        for name in names:
            number = _char_node(os.path.join(node_dir, name))
            if number is None:
                continue
            match = _GPU_NODE.match(name)
            if match:
                gpus[int(match.group(1))] = number
            elif name in _CONTROL_NODES:
                control.append(number)
        caps_major = _proc_major(os.path.join(proc_dir, "devices"), "nvidia-caps")
        minors: dict[InstanceKey, int] = {}
        if caps_major is not None:
            minors.update(_cap_tree(os.path.join(proc_dir, "driver", "nvidia", "capabilities")))
            minors.update(_mig_minors(os.path.join(proc_dir, "driver", "nvidia-caps", "mig-minors")))
        instances = {key: (caps_major, minor) for key, minor in sorted(minors.items(), key=_instance_order) if key[0] in gpus and caps_major is not None}
        caps: dict[int, list[NodeNumber]] = {}
        for (gpu, _gi, _ci), number in instances.items():
            caps.setdefault(gpu, []).append(number)
        return cls(
            folder=node_dir,
            gpus=gpus,
            caps={gpu: tuple(sorted(set(numbers))) for gpu, numbers in sorted(caps.items())},
            control=tuple(control),
            instances=instances,
        )

    def allowed(self, granted: Iterable[Grant] = ()) -> tuple[frozenset[int], frozenset[NodeNumber]]:
        """The GPU minors and capability nodes a kernel of ``granted`` opens: a whole GPU's node
        and every capability node of it; a MIG instance's GPU node and its own instance's
        capability nodes (its GPU instance's and its compute instance's), no other of that GPU."""
        gpus: set[int] = set()
        caps: set[NodeNumber] = set()
        for grant in granted:
            if isinstance(grant, MigSlice):
                gpus.add(grant.gpu)
                for key in ((grant.gpu, grant.gi, None), (grant.gpu, grant.gi, grant.ci)):
                    if key in self.instances:
                        caps.add(self.instances[key])
            else:
                gpus.add(grant)
                caps.update(self.caps.get(grant, ()))
        return frozenset(gpus), frozenset(caps)

    def rules(self, granted: Iterable[Grant] = ()) -> list[DeviceRule]:
        """Deny rules for every GPU node and GPU capability node except those ``granted`` opens
        (see :meth:`allowed`); everything else (control nodes, ``/dev/null``, ttys) stays open.
        Nodes of one major with consecutive minors are one rule (a range): the users' deny of an
        8-GPU host, whose ``mig-minors`` lists 1,080 capability slots, is a handful of rules, and a
        kernel's adds at most two per MIG instance granted, so its device program stays far under
        the 4,096 instructions a kernel before Linux 5.2 loads. :meth:`DeviceRule.expand` gives
        the nodes one by one (cgroup v1)."""
        gpus, caps = self.allowed(granted)
        rules = _ranges(number for gpu, number in self.gpus.items() if gpu not in gpus)
        return rules + _ranges(number for nodes in self.caps.values() for number in nodes if number not in caps)

    def describe(self) -> dict[str, object]:
        """What is denied outside a granted kernel, for status."""
        return {
            "gpu_nodes": [f"{self.folder}/nvidia{gpu} (c {major}:{minor})" for gpu, (major, minor) in sorted(self.gpus.items())],
            "capability_nodes": sum(len(nodes) for nodes in self.caps.values()),
            "open": [f"c {major}:{minor}" for major, minor in self.control],
        }


def _ranges(numbers: Iterable[NodeNumber]) -> list[DeviceRule]:
    """Deny rules for ``numbers``, one per run of consecutive minors of a major."""
    rules: list[DeviceRule] = []
    for major, minor in sorted(set(numbers)):
        last = rules[-1] if rules else None
        if last is not None and last.major == major and last.minor is not None and (last.minor if last.last is None else last.last) + 1 == minor:
            rules[-1] = DeviceRule(False, major, last.minor, last=minor)
        else:
            rules.append(DeviceRule(False, major, minor))
    return rules


def _char_node(path: str) -> NodeNumber | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (os.major(info.st_rdev), os.minor(info.st_rdev)) if stat.S_ISCHR(info.st_mode) else None


def _proc_major(devices_file: str, name: str) -> int | None:
    """The character major ``/proc/devices`` gives a driver name (``nvidia-caps``), or None."""
    try:
        with open(devices_file, encoding="ascii", errors="replace") as handle:
            text = handle.read().split("Block devices:")[0]
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == name and parts[0].isdigit():
            return int(parts[0])
    return None


def _instance_order(item: tuple[InstanceKey, int]) -> tuple[int, int, int]:
    (gpu, gi, ci), _minor = item
    return (gpu, gi, -1 if ci is None else ci)


def _mig_minors(path: str) -> dict[InstanceKey, int]:
    """The driver's table of MIG capability minors (``gpu0/gi1/access 12``, ``gpu0/gi1/ci0/access
    13``; ``config`` and ``monitor`` are host-wide, not a GPU's, and stay open); {} if absent."""
    table: dict[InstanceKey, int] = {}
    with contextlib.suppress(OSError), open(path, encoding="ascii", errors="replace") as handle:
        for line in handle:
            match = _MIG_MINOR.match(line.strip())
            if match:
                gpu, gi, ci, minor = match.groups()
                table[(int(gpu), int(gi), None if ci is None else int(ci))] = int(minor)
    return table


def _cap_tree(cap_root: str) -> dict[InstanceKey, int]:
    """The MIG instances that exist now, from ``capabilities/gpuN/mig/giX[/ciY]/access``
    (``DeviceFileMinor:``): what a driver without ``mig-minors`` shows."""
    table: dict[InstanceKey, int] = {}
    if not os.path.isdir(cap_root):
        return table
    for root, _dirs, files in os.walk(cap_root):
        match = _CAP_PATH.match(os.path.relpath(root, cap_root))
        if match is None or "access" not in files:
            continue
        with contextlib.suppress(OSError), open(os.path.join(root, "access"), encoding="ascii") as handle:
            minor = _CAP_MINOR.search(handle.read())
            if minor:
                gpu, gi, ci = match.groups()
                table[(int(gpu), int(gi), None if ci is None else int(ci))] = int(minor.group(1))
    return table


def check_key(key: str) -> str:
    """A kernel's key (its lease id) as a cgroup name part; anything else is refused."""
    if not _KEY.match(key):
        raise DeviceControlError(errno.EINVAL, f"{key!r} cannot name a cgroup: use letters, digits, '.', '_' and '-'")
    return key


def cgroup_mounts(mounts_file: str = "/proc/self/mounts") -> tuple[str | None, str | None]:
    """Where the cgroup2 hierarchy and the v1 ``devices`` hierarchy are mounted (None: not mounted)."""
    unified = devices = None
    with contextlib.suppress(OSError), open(mounts_file, encoding="utf-8") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) < 4:
                continue
            if parts[2] == "cgroup2" and unified is None:
                unified = parts[1]
            elif parts[2] == "cgroup" and "devices" in parts[3].split(",") and devices is None:
                devices = parts[1]
    return unified, devices


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(text)


def _procs(cgroup_dir: str) -> list[int]:
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), encoding="ascii") as handle:
            return [int(line) for line in handle if line.strip()]
    except OSError:
        return []


class DeviceCgroups(ABC):
    """One cgroup path's mechanism: the user-level deny and the kernels' allow cgroups.

    ``name`` tags every cgroup this instance makes (``{name}-kernel-{key}``), so a restart finds
    its own (:meth:`sweep`) and two pools on one host never touch each other's.
    """

    mode = MODE_OFF

    def __init__(self, nodes: NvidiaNodes, mount: str, name: str) -> None:
        self.nodes = nodes
        self.mount = mount
        self.name = check_key(name)
        self.kernels: dict[str, str] = {}  # key → the kernel's allow cgroup
        self._lock = threading.RLock()
        self.granted: dict[str, frozenset[Grant]] = {}  # key → the GPUs and MIG instances it may open now

    def path(self, cgroup: str) -> str:
        """A cgroup named relative to the mount (``user.slice``), or already absolute under it."""
        if cgroup.startswith(self.mount.rstrip("/") + "/"):
            return cgroup
        return os.path.join(self.mount, cgroup.lstrip("/"))

    def kernel_dir_name(self, key: str) -> str:
        return f"{self.name}-kernel-{check_key(key)}"

    # The three steps of a grant's life; each subclass writes its rules its own way.
    @abstractmethod
    def deny_users(self, cgroup: str) -> None:
        """Deny every GPU node to the processes of ``cgroup`` and its descendants."""
        raise NotImplementedError

    @abstractmethod
    def undeny_users(self, cgroup: str) -> None:
        """Take back what :meth:`deny_users` put on ``cgroup`` (device control is turning off)."""
        raise NotImplementedError

    def grant(self, key: str, pids: Iterable[int], minors: Iterable[Grant]) -> str:
        """Let kernel ``key``'s processes (``pids`` and what they fork) open the GPUs and MIG
        instances ``minors`` and no other; returns its cgroup. Done when this returns: the kernel
        may be told. A kernel whose grant is already ``minors`` only takes ``pids`` in: its rules
        are not written again (no program reloaded, no v1 entries rewritten)."""
        wanted, processes = frozenset(minors), list(pids)
        with self._lock:
            directory = self.kernels.get(key)
            if directory is None or self.granted.get(key) != wanted:  # the same rules: only processes join
                directory = directory or self._kernel_dir(key, processes)
                self._set_rules(directory, wanted)  # before any process is in it
            self.kernels[key], self.granted[key] = directory, wanted
            for pid in processes:
                self._join(directory, pid)
        return directory

    def release(self, key: str) -> None:
        """Deny kernel ``key`` every GPU from now on (its processes stay in their cgroup)."""
        with self._lock:
            directory = self.kernels.get(key)
            if directory is not None:
                self._set_rules(directory, frozenset())
                self.granted[key] = frozenset()

    def forget(self, key: str) -> bool:
        """Remove kernel ``key``'s cgroup once no process is left in it; False while some are."""
        with self._lock:
            directory = self.kernels.get(key)
            if directory is None:
                return True
            if _procs(directory):
                if self.granted.get(key):
                    self.release(key)
                return False
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(directory)
            self.kernels.pop(key, None)
            self.granted.pop(key, None)
            return True

    def sweep(self, keep: Mapping[str, frozenset[Grant]]) -> dict[str, str]:
        """After a restart: adopt this instance's kernel cgroups whose key is in ``keep`` (their
        rules set to ``keep[key]``), deny and remove the rest (kept denied while a process is
        still in one). Returns what was done per key (``adopted``, ``removed``, ``denied``)."""
        done: dict[str, str] = {}
        prefix = f"{self.name}-kernel-"
        for directory in self._find(prefix):
            key = os.path.basename(directory)[len(prefix) :]
            self.kernels[key] = directory
            if key in keep:
                self._set_rules(directory, keep[key])
                self.granted[key] = keep[key]
                done[key] = "adopted"
            elif _procs(directory):  # its lease ended while we were away: deny, keep until empty
                self._set_rules(directory, frozenset())
                self.granted[key] = frozenset()
                done[key] = "denied"
            else:
                self.forget(key)
                done[key] = "removed"
        return done

    def remove_all(self) -> None:
        """Deny and remove every kernel cgroup this instance made (empty ones go at once)."""
        for key in list(self.kernels):
            self.forget(key)

    # -- per path --------------------------------------------------------------------------------
    @abstractmethod
    def _kernel_dir(self, key: str, pids: list[int]) -> str:
        raise NotImplementedError

    @abstractmethod
    def _set_rules(self, directory: str, minors: frozenset[Grant]) -> None:
        raise NotImplementedError

    def _join(self, directory: str, pid: int) -> None:
        try:
            _write(os.path.join(directory, "cgroup.procs"), f"{pid}\n")
        except ProcessLookupError:
            pass  # it exited: nothing to allow
        except OSError as exc:
            raise DeviceControlError(exc.errno or errno.EIO, f"cannot move process {pid} into {directory}: {exc.strerror}") from None

    def _find(self, prefix: str) -> list[str]:
        found = []
        for root, dirs, _files in os.walk(self.mount):
            for name in list(dirs):
                if name.startswith(prefix):
                    found.append(os.path.join(root, name))
                    dirs.remove(name)
        return found


class CgroupV2(DeviceCgroups):
    """cgroup v2: device programs; a kernel's allow is a root-owned child of its own cgroup."""

    mode = MODE_V2

    def deny_users(self, cgroup: str) -> None:
        directory = self.path(cgroup)
        try:
            cgroup_bpf.attach_rules(directory, self.nodes.rules(), True, cgroup_bpf.BPF_F_ALLOW_OVERRIDE)
        except OSError as exc:
            raise DeviceControlError(exc.errno or errno.EIO, f"cannot attach the device deny to {directory}: {exc.strerror}") from None

    def undeny_users(self, cgroup: str) -> None:
        with contextlib.suppress(OSError):
            cgroup_bpf.detach(self.path(cgroup))

    def _kernel_dir(self, key: str, pids: list[int]) -> str:
        if not pids:
            raise DeviceControlError(errno.ESRCH, f"kernel {key} has no process to put in a device cgroup")
        own = self._cgroup_of(pids[0])
        if os.path.basename(own).startswith(f"{self.name}-kernel-"):
            own = os.path.dirname(own)  # still in an earlier lease's cgroup: a sibling, not a child
        directory = os.path.join(self.mount, own.lstrip("/"), self.kernel_dir_name(key))
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)  # root's: the user cannot move other processes into it
        return directory

    def _set_rules(self, directory: str, minors: frozenset[Grant]) -> None:
        # The same flags as before: the kernel replaces the program atomically, no gap.
        cgroup_bpf.attach_rules(directory, self.nodes.rules(minors), True, 0)

    @staticmethod
    def _cgroup_of(pid: int) -> str:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("0::"):
                    return line[3:].strip()
        raise DeviceControlError(errno.ENOENT, f"process {pid} is in no cgroup v2 cgroup")


class CgroupV1(DeviceCgroups):
    """cgroup v1: ``devices.deny``/``devices.allow``; kernels sit in a broker-owned subtree of
    the ``devices`` hierarchy, every other hierarchy (memory, cpu, pids) stays as it was."""

    mode = MODE_V1

    def __init__(self, nodes: NvidiaNodes, mount: str, name: str, subtree: str) -> None:
        super().__init__(nodes, mount, name)
        self.subtree = self.path(subtree)

    def deny_users(self, cgroup: str) -> None:
        directory = self.path(cgroup)
        self._rules(directory, self.nodes.rules())

    def undeny_users(self, cgroup: str) -> None:
        directory = self.path(cgroup)
        for rule in _each(self.nodes.rules()):
            with contextlib.suppress(DeviceControlError):
                self._entry(directory, "devices.allow", rule)

    def _kernel_dir(self, key: str, pids: list[int]) -> str:
        os.makedirs(self.subtree, mode=0o755, exist_ok=True)
        directory = os.path.join(self.subtree, self.kernel_dir_name(key))
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
        return directory

    def _set_rules(self, directory: str, minors: frozenset[Grant]) -> None:
        denied = self.nodes.rules(minors)
        self._rules(directory, denied)
        held = set(_each(denied))
        for rule in _each(self.nodes.rules()):  # a GPU granted now may have been denied before
            if rule not in held:
                self._entry(directory, "devices.allow", rule)

    def _rules(self, directory: str, rules: list[DeviceRule]) -> None:
        for rule in _each(rules):  # v1 takes no range: one entry per node
            self._entry(directory, "devices.deny", rule)

    @staticmethod
    def _entry(directory: str, file: str, rule: DeviceRule) -> None:
        entry = f"{rule.kind} {rule.major}:{rule.minor} {rule.access}\n"
        try:
            _write(os.path.join(directory, file), entry)
        except OSError as exc:
            raise DeviceControlError(exc.errno or errno.EIO, f"cannot write {entry.strip()!r} to {directory}/{file}: {exc.strerror}") from None


def _each(rules: Iterable[DeviceRule]) -> list[DeviceRule]:
    """``rules`` node by node (a range's minors one by one)."""
    return [single for rule in rules for single in rule.expand()]


class DeviceControl(LoggingConfigurable):
    """Whether device control runs, where, and how (``c.DeviceControl.*``)."""

    mode = CaselessStrEnum(
        ["auto", "v2", "v1", "off"],
        default_value="auto",
        help=(
            "'auto': on under a root broker on a host with /dev/nvidiactl (a cgroup v2 eBPF device program "
            "where one can be attached on the cgroup2 hierarchy, hybrid hosts included, else the cgroup v1 "
            "'devices' controller), off on a single-user server; 'v2' or 'v1' to choose the path; 'off' to "
            "turn device control off."
        ),
    ).tag(config=True)
    user_cgroups = List(
        Unicode(),
        default_value=["user.slice"],
        help=(
            "cgroups (relative to the cgroup mount) that hold every login and service process of pooled "
            "users; each is denied every GPU node. systemd hosts: 'user.slice', plus the slice the hub's "
            "spawner puts servers in (TLJH, SystemdSpawner: c.SystemdSpawner.slice)."
        ),
    ).tag(config=True)
    kernel_subtree = Unicode(
        "gpupool",
        help="cgroup v1 only: the broker-owned subtree of the 'devices' hierarchy granted kernels sit in.",
    ).tag(config=True)
    name = Unicode(
        "gpupool",
        help="Tags the kernel cgroups this pool makes ('<name>-kernel-<lease id>'), so a restart finds its own.",
    ).tag(config=True)
    node_dir = Unicode("/dev", help="Where the NVIDIA device nodes are (a simulated pool's node folder replaces it).").tag(
        config=True
    )
    proc_dir = Unicode("/proc", help="Where /proc/devices and the driver's capability map are read from.").tag(config=True)

    #: Why device control runs on its path, or why it is off.
    reason = ""
    cgroups: DeviceCgroups | None = None
    denied_in: list[str]
    missing: list[str]

    def start(self, *, single_user: bool, simulated: bool = False, simulated_node_dir: str | None = None) -> DeviceCgroups | None:
        """Choose the mode, put the user-level deny in place, and log one line saying which mode
        runs (or why none does). Never raises: a host that cannot do it falls back to policing,
        also when a users' cgroup that exists cannot be denied (its deny refused: off, and what
        this start denied is taken back, never on while it denies nothing)."""
        self.denied_in, self.missing = [], []
        try:
            self.cgroups = self._choose(single_user, simulated, simulated_node_dir)
        except (OSError, cgroup_bpf.BpfUnavailable) as exc:
            self.cgroups, self.reason = None, f"{exc.strerror or exc}{_container_hint()}"
        if self.cgroups is None:
            self.log.info("device control: off (%s); unpooled GPU use is policed by the watchdog", self.reason)
            return None
        for cgroup in self.user_cgroups:
            if not os.path.isdir(self.cgroups.path(cgroup)):
                self.missing.append(cgroup)
                continue
            try:
                self.cgroups.deny_users(cgroup)
            except DeviceControlError as exc:
                # Fail closed: never report device control on while a users' cgroup is not denied.
                # What this start denied is taken back: off, the watchdog polices every GPU.
                for done in [*self.denied_in, cgroup]:
                    self.cgroups.undeny_users(done)
                self.cgroups, self.denied_in, self.missing = None, [], []
                self.reason = f"{exc.strerror}; no GPU node is denied (the path chosen: {self.reason})"
                self.log.warning("device control: off (%s); unpooled GPU use is policed by the watchdog", self.reason)
                return None
            self.denied_in.append(cgroup)
        gpus = ", ".join(f"nvidia{gpu}" for gpu in sorted(self.cgroups.nodes.gpus)) or "none"
        where = ", ".join(self.denied_in) or "no cgroup yet"
        self.log.info(
            "device control: %s; GPU nodes (%s in %s) denied in %s outside granted kernels%s",
            self.reason,
            gpus,
            self.cgroups.nodes.folder,
            where,
            f" (not found: {', '.join(self.missing)})" if self.missing else "",
        )
        return self.cgroups

    def _choose(self, single_user: bool, simulated: bool, simulated_node_dir: str | None) -> DeviceCgroups | None:
        if self.mode == "off":
            self.reason = "c.DeviceControl.mode is 'off'"
            return None
        if single_user:
            self.reason = "a single-user server: every GPU of the pool is its user's"
            return None
        if simulated and not simulated_node_dir:
            self.reason = "a simulated pool without a node folder ($GPUPOOL_SIMULATE_NODES)"
            return None
        node_dir = simulated_node_dir or self.node_dir
        proc_dir = os.path.join(simulated_node_dir, "proc") if simulated_node_dir else self.proc_dir
        if not simulated_node_dir and not os.path.exists(os.path.join(node_dir, "nvidiactl")):
            self.reason = f"no {node_dir}/nvidiactl: no NVIDIA driver on this host"
            return None
        if os.geteuid() != 0:
            self.reason = "the broker does not run as root, and only root may change device cgroups"
            return None
        nodes = NvidiaNodes.read(node_dir, proc_dir)
        unified, devices = cgroup_mounts()
        refused = program_refused(unified, self.name) if unified is not None and self.mode in ("auto", "v2") else None
        path, self.reason = choose_path(self.mode, unified, devices, refused)
        if path is None and refused is not None:
            self.reason += _container_hint()
        if path == "v1" and devices is not None:
            _probe(devices, self.name)
            return CgroupV1(nodes, devices, self.name, self.kernel_subtree)
        if path == "v2" and unified is not None:
            return CgroupV2(nodes, unified, self.name)
        return None

    def describe(self) -> dict[str, object]:
        """``device_control`` in ``jupyter gpupool status --json``: mode, what is denied, why off."""
        if self.cgroups is None:
            return {"mode": MODE_OFF, "reason": self.reason}
        return {
            "mode": self.cgroups.mode,
            "reason": self.reason,
            "denied": self.cgroups.nodes.describe(),
            "denied_in": list(self.denied_in),
            "not_found": list(self.missing),
            "kernels": len(self.cgroups.kernels),
        }


def choose_path(requested: str, unified: str | None, devices: str | None, refused: str | None) -> tuple[str | None, str]:
    """Which cgroup path device control takes, and why: ``("v2" | "v1" | None, reason)``.

    ``requested`` is ``c.DeviceControl.mode`` (``auto``, ``v2`` or ``v1``); ``unified`` and
    ``devices`` where the cgroup2 hierarchy and the v1 ``devices`` controller are mounted (None:
    not mounted); ``refused`` why no device program can be attached on ``unified`` (None: it can).

    ``auto`` prefers a device program on the cgroup2 hierarchy, also on a hybrid host that mounts
    the v1 ``devices`` controller too (the kernel applies both): a kernel's allow is then a child
    of its own cgroup, so it keeps every cgroup its spawner gave it, while on v1 it would move into
    a broker-owned subtree of a hierarchy that systemd manages on such hosts (``DevicePolicy=``)
    and may move it back from. v1 is the fallback where no program can be attached.
    """
    why_v2 = f"{MODE_V2} on {unified}"
    if requested == "v1":
        if devices is None:
            return None, "c.DeviceControl.mode is 'v1' but no cgroup v1 'devices' hierarchy is mounted"
        return "v1", f"{MODE_V1} on {devices} (c.DeviceControl.mode is 'v1')"
    if requested == "v2":
        if unified is None:
            return None, "c.DeviceControl.mode is 'v2' but no cgroup2 hierarchy is mounted"
        if refused is not None:
            return None, f"c.DeviceControl.mode is 'v2' but no device program can be attached on {unified} ({refused})"
        return "v2", f"{why_v2} (c.DeviceControl.mode is 'v2')"
    if unified is not None and refused is None:
        if devices is None:
            return "v2", f"{why_v2} (a cgroup v2 host)"
        return "v2", f"{why_v2} (hybrid host: kernels keep their cgroups; the v1 'devices' controller at {devices} is left as it is)"
    if devices is not None:
        if unified is None:
            return "v1", f"{MODE_V1} on {devices} (no cgroup2 hierarchy is mounted)"
        return "v1", f"{MODE_V1} on {devices} (no device program can be attached on {unified}: {refused})"
    if unified is not None:
        return None, f"no device program can be attached on {unified} ({refused}) and no cgroup v1 'devices' controller is mounted"
    return None, "no cgroup v2 hierarchy and no cgroup v1 'devices' controller is mounted"


def program_refused(unified: str, name: str) -> str | None:
    """Why a device program cannot be attached on the cgroup2 hierarchy at ``unified`` (a cgroup
    made, an allow-all program attached with ``BPF_F_ALLOW_OVERRIDE`` and removed), or None."""
    try:
        directory = _probe_cgroup(unified, name)
    except OSError as exc:
        return f"cannot make a cgroup there: {exc.strerror}"
    try:
        cgroup_bpf.attach_rules(directory, [], True, cgroup_bpf.BPF_F_ALLOW_OVERRIDE)
        cgroup_bpf.detach(directory)
    except OSError as exc:  # BpfUnavailable included
        return str(exc.strerror or exc)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(directory)
    return None


def _probe_cgroup(mount: str, name: str) -> str:
    """Make this process's probe cgroup under ``mount`` (one already there is taken as it is): its
    path. Raises OSError when this host does not let us."""
    directory = os.path.join(mount, f"{name}-probe-{os.getpid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory)
    return directory


def _probe(mount: str, name: str) -> None:
    """Make and remove a cgroup under ``mount``: raises when this host does not let us."""
    try:
        directory = _probe_cgroup(mount, name)
    except OSError as exc:
        raise DeviceControlError(exc.errno or errno.EACCES, f"cannot make a cgroup under {mount} ({exc.strerror})") from None
    os.rmdir(directory)


def _container_hint() -> str:
    inside = os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
    return "; this looks like a container, whose cgroups its runtime owns" if inside else ""
