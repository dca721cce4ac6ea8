"""A simulated inventory for demos, Binder, CI and benchmarks, with scripted process usage."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import uuid as uuid_module
from collections.abc import Callable
from typing import Any

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import DeviceBackend, ProcessUsage
from jupyter_gpupool.devices.base import process_alive as _alive
from jupyter_gpupool.devices.checkpoint import devices_now, wait_while_suspended
from jupyter_gpupool.errors import GpuPoolError, InvalidInput
from jupyter_gpupool.units import GIB, format_size, parse_size

SPEC_FORMS = "a spec like 1x16GiB, 2xA100-80GB or 4xRTX3090-24GB,1xT4-16GB"

# Models named without a size get their usual memory.
KNOWN_MODELS: dict[str, int] = {
    "A100": 80 * GIB,
    "A100-40GB": 40 * GIB,
    "A100-80GB": 80 * GIB,
    "H100": 80 * GIB,
    "H200": 141 * GIB,
    "V100": 32 * GIB,
    "T4": 16 * GIB,
    "L4": 24 * GIB,
    "A10": 24 * GIB,
    "RTX3090": 24 * GIB,
    "RTX4090": 24 * GIB,
    "RTX2080TI": 11 * GIB,
}

_ITEM = re.compile(r"^\s*(?:(?P<count>\d+)\s*[xX]\s*)?(?P<what>[A-Za-z0-9][A-Za-z0-9._-]*)\s*$")
_SIZE_SUFFIX = re.compile(r"^(?P<model>(?:[A-Za-z].*?)?)-?(?P<size>\d+(?:\.\d+)?\s*(?:GiB|GB|G|MiB|MB|M|TiB|TB))$", re.IGNORECASE)


def parse_inventory(spec: str) -> list[tuple[str, int]]:
    """``"2xA100-80GB,1x16GiB"`` → ``[("A100-80GB", 80 GiB), ("A100-80GB", ...), ("GPU-16GiB", 16 GiB)]``."""
    if not spec or not spec.strip():
        raise InvalidInput(f"empty simulated inventory: expected {SPEC_FORMS}")
    gpus: list[tuple[str, int]] = []
    for item in spec.split(","):
        match = _ITEM.match(item)
        if not match:
            raise InvalidInput(f"invalid inventory item {item.strip()!r}: expected {SPEC_FORMS}")
        count = int(match.group("count") or 1)
        if not 1 <= count <= 1024:
            raise InvalidInput(f"invalid GPU count {count} in {item.strip()!r}: expected 1 to 1024")
        what = match.group("what")
        sized = _SIZE_SUFFIX.match(what)
        if sized:
            memory = parse_size(sized.group("size"))
            model = sized.group("model") or "GPU"
            name = f"{model}-{sized.group('size')}" if sized.group("model") else f"Simulated GPU {sized.group('size')}"
        elif what.upper() in KNOWN_MODELS:
            memory = KNOWN_MODELS[what.upper()]
            name = what
        else:
            example = f"{count}x{what}GiB" if what.replace(".", "", 1).isdigit() else f"{count}x{what}-24GB"
            raise InvalidInput(
                f"unknown GPU {what!r} in {item.strip()!r}: give its memory with a unit (e.g. {example}); expected {SPEC_FORMS}"
            )
        gpus.extend((name, memory) for _ in range(count))
    return gpus


class SimulatedBackend(DeviceBackend):
    """GPUs that exist only in memory; usage is scripted with :meth:`set_usage`."""

    name = "simulated"

    def __init__(
        self, gpus: list[tuple[str, int]], spec: str = "", nvlink: bool = True, usage_dir: str | None = None, node_dir: str | None = None
    ) -> None:
        self.spec = spec
        #: A folder of ``mknod``-made device nodes the pool treats as these GPUs' (see
        #: :func:`make_node_folder`); None: the GPUs have no nodes, and device control stays off.
        self.node_dir = node_dir
        #: Folder where processes (e.g. kernels running :func:`pretend_to_use`) script their usage.
        self.usage_dir = usage_dir
        self._lock = threading.Lock()
        self._devices: list[Device] = []
        namespace = uuid_module.UUID("6f1c1f9e-5f0b-4d0e-9d7e-3b8f0c2a9a10")
        uuids = [f"GPU-{uuid_module.uuid5(namespace, f'{spec}/{i}')}" for i in range(len(gpus))]
        for index, (name, memory) in enumerate(gpus):
            # GPUs of the same model in one spec item are NVLink peers, as in a DGX box.
            peers = frozenset(u for j, u in enumerate(uuids) if j != index and gpus[j][0] == name) if nvlink else frozenset()
            self._devices.append(
                Device(
                    index=index,
                    uuid=uuids[index],
                    name=name,
                    memory_total=memory,
                    memory_free=memory,
                    nvlink_peers=peers,
                    minor=simulated_minor(index, len(gpus)),
                )
            )
        self._usage: dict[tuple[int, str], int] = {}

    @classmethod
    def from_spec(cls, spec: str) -> SimulatedBackend:
        """The inventory of ``spec``; ``$GPUPOOL_SIMULATE_NODES`` names its node folder, if any."""
        return cls(parse_inventory(spec), spec=spec.strip(), node_dir=os.environ.get(NODE_DIR_ENV) or None)

    def _all_usage(self) -> dict[tuple[int, str], int]:
        """Usage set in this process plus what live processes scripted in :attr:`usage_dir`."""
        usage = dict(self._usage)
        if not self.usage_dir or not os.path.isdir(self.usage_dir):
            return usage
        for entry in os.listdir(self.usage_dir):
            pid_text = entry.removesuffix(".json")
            if not pid_text.isdigit():
                continue
            pid = int(pid_text)
            path = os.path.join(self.usage_dir, entry)
            if not _alive(pid):
                with contextlib.suppress(OSError):
                    os.remove(path)  # the process is gone, and so is its memory
                continue
            try:
                with open(path) as handle:
                    scripted = json.load(handle)
            except (OSError, ValueError):
                continue  # being written right now: next read
            for uuid, amount in scripted.items():
                if isinstance(amount, int) and amount > 0:
                    usage[(pid, uuid)] = usage.get((pid, uuid), 0) + amount
        return usage

    def devices(self) -> list[Device]:
        with self._lock:
            used: dict[str, int] = {}
            for (_, dev), amount in self._all_usage().items():
                used[dev] = used.get(dev, 0) + amount
            return [
                Device(**{**d.__dict__, "memory_free": max(0, d.memory_total - used.get(d.uuid, 0))}) for d in self._devices
            ]

    def process_usage(self) -> list[ProcessUsage]:
        with self._lock:
            return [ProcessUsage(pid=pid, device_uuid=dev, used_memory=amount) for (pid, dev), amount in self._all_usage().items()]

    # --- scripting, for tests and demos -------------------------------------------------------
    def set_usage(self, pid: int, device_uuid: str, used_memory: int) -> None:
        """Pretend process ``pid`` holds ``used_memory`` bytes on a device (0 removes it)."""
        with self._lock:
            if used_memory <= 0:
                self._usage.pop((pid, device_uuid), None)
            else:
                self._usage[(pid, device_uuid)] = used_memory

    def set_health(self, device_uuid: str, healthy: bool, reason: str = "") -> None:
        """Mark a simulated GPU lost (``healthy=False``) or back."""
        with self._lock:
            self._devices = [
                Device(**{**d.__dict__, "healthy": healthy, "health_reason": reason}) if d.uuid == device_uuid else d
                for d in self._devices
            ]

    def describe(self) -> str:
        return f"simulated {self.spec}"


#: Environment variable naming a simulated pool's node folder (made by :func:`make_node_folder`).
NODE_DIR_ENV = "GPUPOOL_SIMULATE_NODES"
#: NVIDIA's fixed character major: ``/dev/nvidiaN`` is ``195:N``, ``/dev/nvidiactl`` ``195:255``.
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255


def simulated_minor(index: int, count: int) -> int:
    """A simulated GPU's driver minor number: the indexes backwards from ``count`` (1 GPU: minor 1),
    so code that takes an index for ``/dev/nvidiaN``'s N is caught, as on hosts where they differ."""
    return count - index


#: The driver's MIG capability slots per GPU: GPU instances 0-14, compute instances 0-7 in each.
MIG_GPU_INSTANCES, MIG_COMPUTE_INSTANCES = 15, 8


def mig_cap_minor(gpu: int, gi: int, ci: int | None = None) -> int:
    """The ``nvidia-caps`` minor of a MIG capability (``gpuN/giX/access`` or
    ``gpuN/giX/ciY/access``), laid out as the driver's ``mig-minors`` lays them out: 1 and 2 are
    the host-wide ``config`` and ``monitor``, then each GPU minor's slots in order."""
    per_gi = 1 + MIG_COMPUTE_INSTANCES
    return 3 + gpu * MIG_GPU_INSTANCES * per_gi + gi * per_gi + (0 if ci is None else 1 + ci)


def make_node_folder(folder: str, devices: list[Device], caps_major: int, uvm_major: int) -> None:
    """Lay out a host's NVIDIA nodes in ``folder`` as the driver does in ``/dev`` and ``/proc``
    (needs root, for ``mknod``): ``nvidiaN`` (195:N) per GPU minor, ``nvidiactl``, ``nvidia-uvm``
    and ``nvidia-uvm-tools``; ``proc/devices`` naming the dynamic majors;
    ``proc/driver/nvidia-caps/mig-minors``, the minor of every MIG capability slot of each GPU;
    and capability nodes in ``nvidia-caps/`` (with their ``proc/driver/nvidia/capabilities/gpuN/mig/``
    entries) for GPU instance 0 of each whole GPU and for the GPU and compute instance of each MIG
    device (``is_mig`` with ``mig_gi`` and ``mig_ci``). Opening any of them fails with ``ENXIO``
    (there is no driver), unless a device cgroup denies it first (``EPERM``)."""
    import stat

    def node(path: str, major: int, minor: int) -> None:
        if not os.path.exists(path):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
            os.chmod(path, 0o666)

    def capability(gpu: int, gi: int, ci: int | None = None) -> None:
        minor = mig_cap_minor(gpu, gi, ci)
        node(os.path.join(folder, "nvidia-caps", f"nvidia-cap{minor}"), caps_major, minor)
        parts = [folder, "proc", "driver", "nvidia", "capabilities", f"gpu{gpu}", "mig", f"gi{gi}"]
        access = os.path.join(*parts, *([f"ci{ci}"] if ci is not None else []))
        os.makedirs(access, exist_ok=True)
        with open(os.path.join(access, "access"), "w", encoding="ascii") as handle:
            handle.write(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")

    os.makedirs(os.path.join(folder, "nvidia-caps"), exist_ok=True)
    os.makedirs(os.path.join(folder, "proc", "driver", "nvidia-caps"), exist_ok=True)
    node(os.path.join(folder, "nvidiactl"), NVIDIA_MAJOR, NVIDIACTL_MINOR)
    node(os.path.join(folder, "nvidia-uvm"), uvm_major, 0)
    node(os.path.join(folder, "nvidia-uvm-tools"), uvm_major, 1)
    minors = sorted({d.minor for d in devices if d.minor is not None})
    for minor in minors:
        node(os.path.join(folder, f"nvidia{minor}"), NVIDIA_MAJOR, minor)
    for device in devices:
        if device.minor is None:
            continue
        if not device.is_mig:
            capability(device.minor, 0)
        elif device.mig_gi is not None and device.mig_ci is not None:
            capability(device.minor, device.mig_gi)
            capability(device.minor, device.mig_gi, device.mig_ci)
    lines = ["config 1", "monitor 2"]
    for minor in minors:
        for gi in range(MIG_GPU_INSTANCES):
            lines.append(f"gpu{minor}/gi{gi}/access {mig_cap_minor(minor, gi)}")
            lines.extend(f"gpu{minor}/gi{gi}/ci{ci}/access {mig_cap_minor(minor, gi, ci)}" for ci in range(MIG_COMPUTE_INSTANCES))
    with open(os.path.join(folder, "proc", "driver", "nvidia-caps", "mig-minors"), "w", encoding="ascii") as handle:
        handle.write("\n".join(lines) + "\n")
    with open(os.path.join(folder, "proc", "devices"), "w", encoding="ascii") as handle:
        handle.write(
            f"Character devices:\n  1 mem\n{NVIDIA_MAJOR} nvidia-frontend\n{caps_major} nvidia-caps\n{uvm_major} nvidia-uvm\n\n"
            "Block devices:\n  7 loop\n"
        )


def usage_dir_for(db_path: str) -> str:
    """Where processes sharing the pool file ``db_path`` script their simulated GPU usage."""
    return os.environ.get("GPUPOOL_SIMULATE_USAGE_DIR") or f"{db_path}.usage"


class SimulatedOutOfMemoryError(MemoryError):
    """What a framework cap raises when an allocation would go past the kernel's slice."""


#: Set by the kernel extension when it loads in a kernel of a simulated pool (this layer never
#: imports the kernel's): ``caps_limit()``, the live caps' bytes per GPU, and ``grow(needed)``,
#: which asks the pool to grow the slice and returns its new size per GPU.
kernel_hooks: dict[str, Callable[..., Any]] = {}


def _slice_limit() -> int | None:
    """Bytes per GPU this process's framework caps allow now (the kernel's live caps, else
    ``GPUPOOL_MEMORY_LIMIT``); None when nothing caps it."""
    caps_limit = kernel_hooks.get("caps_limit")
    if caps_limit is not None:
        limit: int | None = caps_limit()
        return limit
    raw = os.environ.get("GPUPOOL_MEMORY_LIMIT", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _within_slice(amount: int, gpus: int) -> None:
    """As a framework cap does: an allocation past the slice first asks the pool to grow an elastic
    slice; if it cannot, it fails saying why."""
    limit = _slice_limit()
    if limit is None or amount <= limit * gpus:
        return
    grow = kernel_hooks.get("grow")
    try:
        grown = grow(amount) if grow is not None and os.environ.get("GPUPOOL_LEASE_ID") else limit
    except GpuPoolError as refusal:
        reason = str(refusal)
    else:
        if amount <= grown * gpus:
            return
        reason = "the slice was not grown"
    raise SimulatedOutOfMemoryError(
        f"out of GPU memory (simulated): tried to hold {format_size(amount)} in a slice of {format_size(limit * gpus)}; {reason}"
    )


def pretend_to_use(size: str | int, pid: int | None = None) -> int:
    """Inside a kernel on a simulated pool: pretend this process now holds ``size`` of GPU memory
    (``"3GiB"``; ``0`` frees it), spread over its visible GPUs. The watchdog, the sidebar and
    ``%gpupool status`` then show it, as they would real usage. Returns the bytes set.

    Past the kernel's slice it behaves as a framework cap: an elastic slice is first grown (the
    pool says no when the GPU is full, the slice is fixed, or past its limit), else it raises
    :class:`SimulatedOutOfMemoryError` saying why, and holds what it held before.

    While the pool has this kernel suspended it blocks until the kernel is resumed, as a CUDA
    call does (interrupt the cell to stop waiting); after a resume onto other GPUs it uses those.
    """
    db = os.environ.get("GPUPOOL_DB")
    if not os.environ.get("GPUPOOL_SIMULATE") or not db:
        raise InvalidInput("pretend_to_use works only in a kernel on a simulated pool (GPUPOOL_SIMULATE and GPUPOOL_DB set)")
    amount = 0 if size in (0, "0") else parse_size(size)
    visible = [u for u in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u.startswith("GPU-")]
    if amount and not visible:
        raise InvalidInput("this kernel holds no GPU slice to use (CUDA_VISIBLE_DEVICES names none)")
    if amount and pid is None:
        _within_slice(amount, len(visible))
    folder = usage_dir_for(db)
    os.makedirs(folder, exist_ok=True)
    owner = pid or os.getpid()
    path = os.path.join(folder, f"{owner}.json")
    with wait_while_suspended(folder, owner):
        if not amount:
            with contextlib.suppress(OSError):
                os.remove(path)
            return 0
        now_on = [u for u in devices_now(folder, owner, os.environ) if u.startswith("GPU-")] or visible
        share: dict[str, int] = {}
        for uuid in now_on:
            share[uuid] = share.get(uuid, 0) + amount // len(visible)
        temporary = f"{path}.tmp"
        with open(temporary, "w") as handle:
            json.dump(share, handle)
        os.replace(temporary, path)  # readers never see half a file
    return amount


class SimulatedMemorySaver:
    """torch-memory-saver played in a kernel on a simulated pool: the memory :func:`pretend_to_use`
    scripted stands for PyTorch tensors in the saver's region. :meth:`pause` moves it into a backup
    in this process (the pool then sees the GPU memory freed), :meth:`resume` maps it back onto the
    GPUs the process uses now (after a move, the new ones).

    ``fail-next-framework-park.json`` in the usage folder (:meth:`fail_next`) makes the next pause
    of any kernel fail once *midway*: the memory is released, then it raises, as a library that
    failed partway would, so the caller has to put it back."""

    name = "torch-memory-saver (simulated)"

    def __init__(self) -> None:
        db = os.environ.get("GPUPOOL_DB", "")
        self.folder = usage_dir_for(db) if db else ""
        self.backup: dict[str, int] | None = None
        self._lock = threading.Lock()

    @staticmethod
    def fail_next(usage_dir: str, reason: str = "injected failure") -> None:
        """Make the next pause in any kernel of this usage folder fail midway, once."""
        os.makedirs(usage_dir, exist_ok=True)
        with open(os.path.join(usage_dir, "fail-next-framework-park.json"), "w") as handle:
            json.dump({"reason": reason}, handle)

    def _usage_path(self) -> str:
        return os.path.join(self.folder, f"{os.getpid()}.json")

    def enter(self) -> None:
        """Nothing to hook: the region is the whole of :func:`pretend_to_use`."""
        if not self.folder:
            raise InvalidInput("the simulated memory saver needs GPUPOOL_DB (a kernel on a simulated pool)")

    def held(self) -> int:
        """Bytes in the region now (what a pause would back up)."""
        try:
            with open(self._usage_path()) as handle:
                usage = json.load(handle)
        except (OSError, ValueError):
            return 0
        return sum(v for v in usage.values() if isinstance(v, int) and v > 0)

    def pause(self) -> int:
        """Release the region's memory into the backup; the bytes released."""
        with self._lock:
            if self.backup is not None:
                return sum(self.backup.values())
            path = self._usage_path()
            try:
                with open(path) as handle:
                    usage = {k: v for k, v in json.load(handle).items() if isinstance(v, int) and v > 0}
            except FileNotFoundError:
                usage = {}
            self.backup = usage
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)  # the GPU memory is free now, as NVML would show
            fault = os.path.join(self.folder, "fail-next-framework-park.json")
            claimed = f"{fault}.{os.getpid()}"
            with contextlib.suppress(OSError):
                os.rename(fault, claimed)  # one pause takes it
                with open(claimed) as handle:
                    reason = str(json.load(handle).get("reason") or "injected failure")
                os.remove(claimed)
                raise RuntimeError(f"simulated memory saver failed midway: {reason}")
            return sum(usage.values())

    def resume(self) -> None:
        """Map the backup back onto the GPUs this process uses now (a no-op when nothing is paused)."""
        with self._lock:
            if self.backup is None:
                return
            total = sum(self.backup.values())
            if total:
                visible = [u for u in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u.startswith("GPU-")]
                now_on = [u for u in devices_now(self.folder, os.getpid(), os.environ) if u.startswith("GPU-")] or visible
                share: dict[str, int] = {}
                for uuid in now_on:
                    share[uuid] = share.get(uuid, 0) + total // max(1, len(now_on))
                temporary = f"{self._usage_path()}.tmp"
                with open(temporary, "w") as handle:
                    json.dump(share, handle)
                os.replace(temporary, self._usage_path())
            self.backup = None
