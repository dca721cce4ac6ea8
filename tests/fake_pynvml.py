"""A scripted stand-in for the ``pynvml`` module (nvidia-ml-py) for tests without a GPU.

It has the real module's names, signatures, error classes and error-code values (a test checks
them against the installed nvidia-ml-py), and plays a scripted host: GPU inventories of several
models, MIG layouts, NVLink (direct bridges and NVSwitch), PCIe topology, per-process memory, and
errors such as ``NVML_ERROR_GPU_IS_LOST`` or a missing library at ``nvmlInit``.

Use::

    fake = FakeNvml([FakeGpu("NVIDIA A100-SXM4-80GB", 80 * GIB)])
    fake.install(monkeypatch)          # sys.modules["pynvml"] = fake.module
    backend = NvmlBackend()            # runs against the fake
    fake.gpus[0].lost = True           # script a failure mid-test

A process that device control denies GPU nodes (a pooled user's process outside a granted
kernel) is played by ``denied`` (or ``$FAKE_PYNVML_DENIED``: ``all`` or indices such as ``0,2``):
NVML still counts every GPU and starts, but a denied GPU's handle lookup, and every query on it,
raises ``NVML_ERROR_NO_PERMISSION``, as NVML answers when the open of ``/dev/nvidiaN`` fails.
"""

from __future__ import annotations

import os
import string
import sys
import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

GIB = 1024**3
MIB = 1024**2

# The real values (tests/test_nvml_backend.py checks them against the installed pynvml).
NVML_SUCCESS = 0
ERROR_CODES: dict[str, int] = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_INVALID_ARGUMENT": 2,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_ALREADY_INITIALIZED": 5,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_INSUFFICIENT_SIZE": 7,
    "NVML_ERROR_INSUFFICIENT_POWER": 8,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_TIMEOUT": 10,
    "NVML_ERROR_IRQ_ISSUE": 11,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_CORRUPTED_INFOROM": 14,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_RESET_REQUIRED": 16,
    "NVML_ERROR_OPERATING_SYSTEM": 17,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_IN_USE": 19,
    "NVML_ERROR_MEMORY": 20,
    "NVML_ERROR_NO_DATA": 21,
    "NVML_ERROR_VGPU_ECC_NOT_SUPPORTED": 22,
    "NVML_ERROR_INSUFFICIENT_RESOURCES": 23,
    "NVML_ERROR_FREQ_NOT_SUPPORTED": 24,
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH": 25,
    "NVML_ERROR_DEPRECATED": 26,
    "NVML_ERROR_NOT_READY": 27,
    "NVML_ERROR_GPU_NOT_FOUND": 28,
    "NVML_ERROR_INVALID_STATE": 29,
    "NVML_ERROR_RESET_TYPE_NOT_SUPPORTED": 30,
    "NVML_ERROR_UNKNOWN": 999,
}
OTHER_CONSTANTS: dict[str, int] = {
    "NVML_SUCCESS": NVML_SUCCESS,
    "NVML_FEATURE_DISABLED": 0,
    "NVML_FEATURE_ENABLED": 1,
    "NVML_DEVICE_MIG_DISABLE": 0,
    "NVML_DEVICE_MIG_ENABLE": 1,
    "NVML_NVLINK_MAX_LINKS": 36,
    "NVML_NVLINK_DEVICE_TYPE_GPU": 0,
    "NVML_NVLINK_DEVICE_TYPE_IBMNPU": 1,
    "NVML_NVLINK_DEVICE_TYPE_SWITCH": 2,
    "NVML_NVLINK_DEVICE_TYPE_UNKNOWN": 255,
    "NVML_TOPOLOGY_INTERNAL": 0,
    "NVML_TOPOLOGY_SINGLE": 10,
    "NVML_TOPOLOGY_MULTIPLE": 20,
    "NVML_TOPOLOGY_HOSTBRIDGE": 30,
    "NVML_TOPOLOGY_NODE": 40,
    "NVML_TOPOLOGY_CPU": 40,
    "NVML_TOPOLOGY_SYSTEM": 50,
}
C = {**ERROR_CODES, **OTHER_CONSTANTS}
#: GPUs this process may not open (as a device cgroup denies their nodes): ``all``, or ``0,2``.
DENIED_ENV = "FAKE_PYNVML_DENIED"
_MESSAGES = {
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    8: "Insufficient External Power",
    9: "Driver Not Loaded",
    10: "Timeout",
    11: "Interrupt Request Issue",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    14: "Corrupted infoROM",
    15: "GPU is lost",
    16: "GPU requires restart",
    17: "The operating system has blocked the request.",
    18: "RM has detected an NVML/RM version mismatch.",
    20: "Insufficient Memory",
    999: "Unknown Error",
}


def _make_error_classes(module: types.ModuleType) -> type[Exception]:
    """``NVMLError`` and one subclass per code, built the way pynvml builds them."""

    class NVMLError(Exception):
        _valClassMapping: ClassVar[dict[int, type]] = {}
        _errcode_to_string: ClassVar[dict[int, str]] = dict(_MESSAGES)

        def __new__(typ, value):  # same as pynvml
            if typ == NVMLError:
                typ = NVMLError._valClassMapping.get(value, typ)
            obj = Exception.__new__(typ)
            obj.value = value
            return obj

        def __str__(self) -> str:
            return self._errcode_to_string.get(self.value, f"NVML Error with code {self.value}")

        def __eq__(self, other: object) -> bool:
            return self.value == getattr(other, "value", None)

        __hash__ = Exception.__hash__

    NVMLError.__module__ = "pynvml"
    module.NVMLError = NVMLError
    for err_name, err_val in ERROR_CODES.items():
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def gen_new(val: int):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)

            return new

        cls = type(class_name, (NVMLError,), {"__new__": gen_new(err_val)})
        cls.__module__ = "pynvml"
        setattr(module, class_name, cls)
        NVMLError._valClassMapping[err_val] = cls
    return NVMLError


# --- the scripted host ------------------------------------------------------------------------
@dataclass
class FakeProcess:
    """A process on a device; ``used=None`` plays NVML's "not available" (``usedGpuMemory is None``)."""

    pid: int
    used: int | None


@dataclass
class FakeMig:
    """An existing MIG instance (the admin made it; the backend must only read it)."""

    name: str
    memory_total: int
    memory_used: int = 0
    uuid: str = ""
    processes: list[FakeProcess] = field(default_factory=list)
    gpu_instance_id: int = 0
    compute_instance_id: int = 0


@dataclass
class FakeGpu:
    """One physical GPU.

    ``mig``: None = MIG not supported, False = supported but off, True = on.
    ``mig_slots``: MIG instances by slot (None = empty slot), up to ``max_mig``.
    ``nvlinks``: None = NVLink not supported; else one entry per link: ``None`` (inactive),
    an int (index of the GPU at the other end) or ``"switch"`` (an NVSwitch).
    ``pcie_switch``: GPUs with the same value share a PCIe switch (topology SINGLE).
    ``errors``: function name → NVML error code raised when that function is called on this GPU.
    ``lost``: every call on this GPU, including getting its handle, raises GPU_IS_LOST.
    Power (``nvmlDeviceGetPowerUsage``, mW): ``idle_power_mw`` plus ``context_power_mw`` for each
    compute process listed (a live CUDA context draws power even when it computes nothing).
    """

    name: str
    memory_total: int
    memory_used: int = 0
    uuid: str = ""
    bus: int | None = None
    mig: bool | None = None
    mig_slots: list[FakeMig | None] = field(default_factory=list)
    max_mig: int = 7
    nvlinks: list[int | str | None] | None = None
    pcie_switch: int | None = None
    numa_node: int = 0
    compute: list[FakeProcess] = field(default_factory=list)
    graphics: list[FakeProcess] = field(default_factory=list)
    mps: list[FakeProcess] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    idle_power_mw: int = 72_000
    context_power_mw: int = 40_000
    pstate: int = 0
    persistence: int = 1
    #: /dev/nvidiaN's N, the driver's minor number; None: the GPU's index + 4 (minors differ from
    #: indexes on real hosts, where the order NVML lists GPUs in is not the order their nodes got)
    minor: int | None = None


class _Handle:
    """Opaque like ``c_nvmlDevice_t``."""

    __slots__ = ("gpu", "slot")

    def __init__(self, gpu: int, slot: int | None = None) -> None:
        self.gpu = gpu
        self.slot = slot

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.gpu}{'' if self.slot is None else f'/mig{self.slot}'}>"


class _Struct:
    """Attribute bag like nvmlFriendlyObject / a ctypes struct."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def __repr__(self) -> str:
        return f"<fake {self.__dict__}>"


class FakeNvml:
    """The scripted host plus a ``pynvml``-shaped module (``self.module``) that plays it."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        init_error: int | None = None,
        legacy_bytes: bool = False,
        driver_version: str = "550.54.15",
        denied: set[int] | None = None,
    ) -> None:
        self.gpus = gpus
        #: Indexes of GPUs this process may not open (default: from ``$FAKE_PYNVML_DENIED``).
        self.denied: set[int] = set(denied) if denied is not None else denied_from_env(len(gpus))
        self.init_error = init_error
        self.legacy_bytes = legacy_bytes
        self.driver_version = driver_version
        self.calls: Counter[str] = Counter()
        #: MPS memory partitioning: (GPU index, cgroup path) -> (soft, hard) bytes that were set.
        self.memory_limits: dict[tuple[int, str], tuple[int, int]] = {}
        self.init_count = 0  # NVML's reference count of nvmlInit minus nvmlShutdown
        for i, gpu in enumerate(gpus):
            gpu.uuid = gpu.uuid or f"GPU-{i:08x}-fake-4000-8000-{i:012x}"
            gpu.bus = gpu.bus if gpu.bus is not None else 0x07 + 0x10 * i
            gpu.minor = gpu.minor if gpu.minor is not None else i + 4
            for slot, mig in enumerate(gpu.mig_slots):
                if mig is not None:
                    mig.uuid = mig.uuid or f"MIG-{i:08x}-fake-4000-8000-{slot:012x}"
        self.module = self._build_module()

    # --- wiring ---------------------------------------------------------------------------------
    def install(self, monkeypatch: Any) -> types.ModuleType:
        """Put the fake module into ``sys.modules["pynvml"]`` for the test's duration."""
        monkeypatch.setitem(sys.modules, "pynvml", self.module)
        return self.module

    def _build_module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml", "fake pynvml (tests/fake_pynvml.py)")
        for name, value in C.items():
            setattr(module, name, value)
        self.NVMLError = _make_error_classes(module)
        module.c_nvmlGetMemoryLimits_v1_t = _Struct  # ctypes structs take their fields as keywords too
        module.c_nvmlSetMemoryLimits_v1_t = _Struct
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(module, name, getattr(self, name))
        module.__fake__ = self
        return module

    def _raise(self, code: int) -> None:
        raise self.NVMLError(code)

    def _str(self, text: str) -> str | bytes:
        return text.encode() if self.legacy_bytes else text

    def _enter(self, fn: str) -> None:
        self.calls[fn] += 1
        if self.init_count <= 0:
            self._raise(C["NVML_ERROR_UNINITIALIZED"])

    def _gpu(self, fn: str, handle: Any) -> FakeGpu:
        """The GPU a handle names, raising the scripted error for ``fn`` on it."""
        self._enter(fn)
        if not isinstance(handle, _Handle) or not 0 <= handle.gpu < len(self.gpus):
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])
        gpu = self.gpus[handle.gpu]
        if handle.gpu in self.denied:
            self._raise(C["NVML_ERROR_NO_PERMISSION"])  # its /dev/nvidiaN refuses this process
        if gpu.lost:
            self._raise(C["NVML_ERROR_GPU_IS_LOST"])
        if fn in gpu.errors:
            self._raise(gpu.errors[fn])
        return gpu

    def _mig(self, gpu: FakeGpu, handle: _Handle) -> FakeMig | None:
        if handle.slot is None:
            return None
        if not gpu.mig or handle.slot >= len(gpu.mig_slots) or gpu.mig_slots[handle.slot] is None:
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])  # the instance was destroyed
        return gpu.mig_slots[handle.slot]

    @staticmethod
    def _pci(domain: int, bus: int) -> _Struct:
        return _Struct(
            busIdLegacy=f"{domain:04x}:{bus:02x}:00.0".upper().encode(),
            domain=domain,
            bus=bus,
            device=0,
            pciDeviceId=0x20B210DE,
            pciSubSystemId=0x134F10DE,
            busId=f"{domain:08x}:{bus:02x}:00.0".upper().encode(),  # ctypes char arrays are bytes
        )

    @staticmethod
    def _procs(processes: list[FakeProcess], gpu_instance: int = 0xFFFFFFFF) -> list[_Struct]:
        return [
            _Struct(pid=p.pid, usedGpuMemory=p.used, gpuInstanceId=gpu_instance, computeInstanceId=0xFFFFFFFF)
            for p in processes
        ]

    # --- the pynvml API (names and signatures as in nvidia-ml-py) -------------------------------
    def nvmlInit(self):
        self.nvmlInitWithFlags(0)

    def nvmlInitWithFlags(self, flags):
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            self._raise(self.init_error)
        self.init_count += 1

    def nvmlShutdown(self):
        self._enter("nvmlShutdown")
        self.init_count -= 1

    def nvmlErrorString(self, result):
        return _MESSAGES.get(result, "Unknown Error")

    def nvmlSystemGetDriverVersion(self):
        self._enter("nvmlSystemGetDriverVersion")
        return self._str(self.driver_version)

    def nvmlDeviceGetCount(self):
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        handle = _Handle(index)
        self._gpu("nvmlDeviceGetHandleByIndex", handle)  # INVALID_ARGUMENT past the last GPU
        return handle

    def nvmlDeviceGetIndex(self, handle):
        self._gpu("nvmlDeviceGetIndex", handle)
        return handle.gpu

    def nvmlDeviceGetUUID(self, handle):
        gpu = self._gpu("nvmlDeviceGetUUID", handle)
        mig = self._mig(gpu, handle)
        return self._str(mig.uuid if mig else gpu.uuid)

    def nvmlDeviceGetName(self, handle):
        gpu = self._gpu("nvmlDeviceGetName", handle)
        mig = self._mig(gpu, handle)
        return self._str(f"{gpu.name} MIG {mig.name}" if mig else gpu.name)

    def nvmlDeviceGetMinorNumber(self, handle):
        gpu = self._gpu("nvmlDeviceGetMinorNumber", handle)
        if handle.slot is not None:
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])  # a MIG instance has no /dev/nvidiaN of its own
        return gpu.minor

    def nvmlDeviceGetMemoryInfo(self, handle, version=None):
        gpu = self._gpu("nvmlDeviceGetMemoryInfo", handle)
        mig = self._mig(gpu, handle)
        total, used = (mig.memory_total, mig.memory_used) if mig else (gpu.memory_total, gpu.memory_used)
        return _Struct(total=total, free=total - used, used=used)

    def nvmlDeviceGetPciInfo(self, handle):
        gpu = self._gpu("nvmlDeviceGetPciInfo", handle)
        return self._pci(0, gpu.bus or 0)

    def nvmlDeviceGetMigMode(self, device):
        gpu = self._gpu("nvmlDeviceGetMigMode", device)
        if gpu.mig is None or device.slot is not None:
            self._raise(C["NVML_ERROR_NOT_SUPPORTED"])
        mode = C["NVML_DEVICE_MIG_ENABLE"] if gpu.mig else C["NVML_DEVICE_MIG_DISABLE"]
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, device):
        gpu = self._gpu("nvmlDeviceGetMaxMigDeviceCount", device)
        return gpu.max_mig if gpu.mig is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device, index):
        gpu = self._gpu("nvmlDeviceGetMigDeviceHandleByIndex", device)
        if not gpu.mig:
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])
        if not 0 <= index < gpu.max_mig:
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])
        if index >= len(gpu.mig_slots) or gpu.mig_slots[index] is None:
            self._raise(C["NVML_ERROR_NOT_FOUND"])
        return _Handle(device.gpu, index)

    def _mig_of(self, fn: str, device: _Handle) -> FakeMig:
        """The MIG instance behind a MIG device handle; INVALID_ARGUMENT for a whole GPU's (as NVML)."""
        mig = self._mig(self._gpu(fn, device), device)
        if mig is None:
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])
        return mig

    def nvmlDeviceGetGpuInstanceId(self, device):
        return self._mig_of("nvmlDeviceGetGpuInstanceId", device).gpu_instance_id

    def nvmlDeviceGetComputeInstanceId(self, device):
        return self._mig_of("nvmlDeviceGetComputeInstanceId", device).compute_instance_id

    def nvmlDeviceIsMigDeviceHandle(self, device):
        self._gpu("nvmlDeviceIsMigDeviceHandle", device)
        return 1 if device.slot is not None else 0

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice):  # pynvml's parameter name
        self._gpu("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
        return _Handle(migDevice.gpu)

    def _link(self, fn: str, device: _Handle, link: int) -> int | str | None:
        gpu = self._gpu(fn, device)
        if gpu.nvlinks is None or device.slot is not None:
            self._raise(C["NVML_ERROR_NOT_SUPPORTED"])
        if not 0 <= link < len(gpu.nvlinks):
            self._raise(C["NVML_ERROR_INVALID_ARGUMENT"])
        return gpu.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, device, link):
        remote = self._link("nvmlDeviceGetNvLinkState", device, link)
        return C["NVML_FEATURE_ENABLED"] if remote is not None else C["NVML_FEATURE_DISABLED"]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, device, link):
        remote = self._link("nvmlDeviceGetNvLinkRemotePciInfo", device, link)
        if remote is None:
            self._raise(C["NVML_ERROR_NOT_SUPPORTED"])
        if remote == "switch":
            return self._pci(0, 0xF0)  # an NVSwitch: no GPU has this address
        return self._pci(0, self.gpus[int(remote)].bus or 0)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        remote = self._link("nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        if remote is None:
            self._raise(C["NVML_ERROR_NOT_SUPPORTED"])
        return C["NVML_NVLINK_DEVICE_TYPE_SWITCH"] if remote == "switch" else C["NVML_NVLINK_DEVICE_TYPE_GPU"]

    def nvmlDeviceGetTopologyCommonAncestor(self, device1, device2):
        first = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device1)
        second = self._gpu("nvmlDeviceGetTopologyCommonAncestor", device2)
        if first.pcie_switch is not None and first.pcie_switch == second.pcie_switch:
            return C["NVML_TOPOLOGY_SINGLE"]
        return C["NVML_TOPOLOGY_NODE"] if first.numa_node == second.numa_node else C["NVML_TOPOLOGY_SYSTEM"]

    def _running(self, fn: str, handle: _Handle, kind: str) -> list[_Struct]:
        gpu = self._gpu(fn, handle)
        mig = self._mig(gpu, handle)
        if mig is not None:
            return self._procs(mig.processes, mig.gpu_instance_id) if kind == "compute" else []
        if gpu.mig and kind == "compute":
            # A MIG parent lists every instance's processes (as root), tagged with the instance.
            return [p for m in gpu.mig_slots if m is not None for p in self._procs(m.processes, m.gpu_instance_id)]
        return self._procs(getattr(gpu, kind))

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        return self._running("nvmlDeviceGetComputeRunningProcesses", handle, "compute")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle):
        return self._running("nvmlDeviceGetGraphicsRunningProcesses", handle, "graphics")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle):
        return self._running("nvmlDeviceGetMPSComputeRunningProcesses", handle, "mps")

    def nvmlDeviceGetPowerUsage(self, handle):
        gpu = self._gpu("nvmlDeviceGetPowerUsage", handle)
        return gpu.idle_power_mw + gpu.context_power_mw * len(gpu.compute)

    def nvmlDeviceGetPerformanceState(self, handle):
        return self._gpu("nvmlDeviceGetPerformanceState", handle).pstate

    def nvmlDeviceGetPersistenceMode(self, handle):
        return self._gpu("nvmlDeviceGetPersistenceMode", handle).persistence

    # MPS memory partitioning: the call exists from driver r615 (older drivers: FUNCTION_NOT_FOUND,
    # as pynvml's _nvmlGetFunctionPointer raises); MIG handles are not supported.
    def _limits_gpu(self, fn: str, handle: _Handle) -> FakeGpu:
        gpu = self._gpu(fn, handle)
        if int(self.driver_version.split(".")[0]) < 615:
            self._raise(C["NVML_ERROR_FUNCTION_NOT_FOUND"])
        if gpu.mig or handle.slot is not None:
            self._raise(C["NVML_ERROR_NOT_SUPPORTED"])
        return gpu

    def nvmlDeviceGetMemoryLimits_v1(self, device, limits):
        self._limits_gpu("nvmlDeviceGetMemoryLimits_v1", device)
        name = limits.nameSpace.decode()
        soft, hard = self.memory_limits.get((device.gpu, name), (0, 2**64 - 1))  # none set: 0 and NVML_DEVICE_MEMORY_LIMIT_MAX
        limits.softLimit, limits.hardLimit, limits.currentUsed = soft, hard, 0

    def nvmlDeviceSetMemoryLimits_v1(self, device, limits):
        self._limits_gpu("nvmlDeviceSetMemoryLimits_v1", device)
        self.memory_limits[(device.gpu, limits.nameSpace.decode())] = (int(limits.softLimit), int(limits.hardLimit))


def denied_from_env(count: int, environ: Any = None) -> set[int]:
    """The GPU indexes ``$FAKE_PYNVML_DENIED`` names (``all``: every one of ``count``)."""
    text = ((os.environ if environ is None else environ).get(DENIED_ENV) or "").strip().lower()
    if text == "all":
        return set(range(count))
    return {int(part) for part in text.split(",") if part.strip()}


# --- inventories -------------------------------------------------------------------------------
def dgx_a100(count: int = 8) -> list[FakeGpu]:
    """A100-SXM4-80GB GPUs, all on one NVSwitch fabric (12 links each)."""
    return [FakeGpu("NVIDIA A100-SXM4-80GB", 80 * GIB, mig=False, nvlinks=["switch"] * 12) for _ in range(count)]


def workstation() -> list[FakeGpu]:
    """Two RTX 3090 joined by an NVLink bridge (4 links), plus a T4 with no NVLink."""
    return [
        FakeGpu("NVIDIA GeForce RTX 3090", 24 * GIB, nvlinks=[1, 1, 1, 1]),
        FakeGpu("NVIDIA GeForce RTX 3090", 24 * GIB, nvlinks=[0, 0, 0, 0]),
        FakeGpu("Tesla T4", 15 * GIB + 360 * MIB),
    ]


def pcie_box() -> list[FakeGpu]:
    """Four L4 without NVLink: GPUs 0-1 share one PCIe switch, 2-3 another (other NUMA node)."""
    return [
        FakeGpu("NVIDIA L4", 24 * GIB, pcie_switch=0, numa_node=0),
        FakeGpu("NVIDIA L4", 24 * GIB, pcie_switch=0, numa_node=0),
        FakeGpu("NVIDIA L4", 24 * GIB, pcie_switch=1, numa_node=1),
        FakeGpu("NVIDIA L4", 24 * GIB, pcie_switch=1, numa_node=1),
    ]


def a100_mig() -> list[FakeGpu]:
    """GPU 0: A100-40GB in MIG mode with 3g.20gb + 2x 1g.5gb (slot 1 empty); GPU 1: same model, MIG off."""
    return [
        FakeGpu(
            "NVIDIA A100-PCIE-40GB",
            40 * GIB,
            mig=True,
            mig_slots=[
                FakeMig("3g.20gb", 19968 * MIB, gpu_instance_id=1),
                None,
                FakeMig("1g.5gb", 4864 * MIB, gpu_instance_id=7),
                FakeMig("1g.5gb", 4864 * MIB, gpu_instance_id=8),
            ],
        ),
        FakeGpu("NVIDIA A100-PCIE-40GB", 40 * GIB, mig=False),
    ]
