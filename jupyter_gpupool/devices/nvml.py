"""Real GPUs through NVML (nvidia-ml-py, imported as ``pynvml``).

What the pool gets from here:

- one :class:`~jupyter_gpupool.core.models.Device` per poolable unit: a whole GPU, or, on a GPU
  with MIG enabled, each MIG instance the admin created (the parent GPU itself is then not
  poolable). MIG instances are only read, never created or destroyed;
- NVLink neighbours of each GPU (peers over direct links or one NVSwitch fabric), or, where no GPU
  on the host reports NVLink, the GPUs behind the same PCIe switch;
- health: an NVML error such as ``NVML_ERROR_GPU_IS_LOST`` on a device query marks that device
  unhealthy with a reason instead of raising;
- GPU memory per process (compute, graphics and MPS clients) for the watchdog;
- in a process that may not open a GPU's node (device control denies it to a pooled user's
  processes outside a granted kernel), NVML still counts that GPU but refuses its handle
  (``NVML_ERROR_NO_PERMISSION``): it is listed as not open to this process, said at debug level
  only, and skipped when reading memory per process. A user's process under a broker reads GPUs
  through the broker instead (:class:`~jupyter_gpupool.backends.broker_devices.BrokerGpus`).

The module imports ``pynvml`` when a backend is made, so tests can put a scripted fake
(``tests/fake_pynvml.py``) into ``sys.modules`` and run these same code paths.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import DeviceBackend, ProcessUsage
from jupyter_gpupool.errors import NoGpuFound, PoolUnavailable

log = logging.getLogger(__name__)

SIMULATE_HINT = "set GPUPOOL_SIMULATE=1x16GiB to try a simulated pool"

# Errors that mean "this query is not available here", not "this GPU is broken".
_BENIGN_ERRORS = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NOT_FOUND",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_INVALID_ARGUMENT",
    "NVML_ERROR_NO_DATA",
)
# nvmlInit errors that mean there is no usable driver at all.
_NO_DRIVER_ERRORS = ("NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED", "NVML_ERROR_FUNCTION_NOT_FOUND")
# PCIe levels at or below which two GPUs count as neighbours when no NVLink is present.
_PCIE_NEIGHBOUR_LEVEL = "NVML_TOPOLOGY_MULTIPLE"


def _text(value: Any) -> str:
    """Old pynvml versions (and ctypes char arrays) return ``bytes``; newer ones ``str``."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


def _pci_key(info: Any) -> tuple[int, int, int] | None:
    """A comparable PCI address (domain, bus, device) from an ``nvmlPciInfo_t``."""
    try:
        return (int(info.domain), int(info.bus), int(info.device))
    except (AttributeError, TypeError, ValueError):
        pass
    bus_id = _text(getattr(info, "busId", "") or getattr(info, "busIdLegacy", ""))
    try:  # "00000000:07:00.0"
        domain, bus, rest = bus_id.split(":")
        return (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16))
    except ValueError:
        return None


@dataclass
class _Gpu:
    """What one enumeration learned about a physical GPU (internal)."""

    index: int
    handle: Any = None
    uuid: str = ""
    name: str = ""
    memory_total: int = 0
    memory_free: int | None = None
    mig_enabled: bool = False
    migs: list[Device] = field(default_factory=list)
    mig_handles: list[tuple[str, Any]] = field(default_factory=list)
    pci: tuple[int, int, int] | None = None
    minor: int | None = None  # /dev/nvidiaN's N (nvmlDeviceGetMinorNumber)
    error: str = ""  # health reason when a query failed
    denied: bool = False  # this process may not open the GPU's node (NVML_ERROR_NO_PERMISSION)


class NvmlBackend(DeviceBackend):
    """The GPUs of this host, as NVML reports them.

    ``topology_fallback``: where no GPU reports NVLink, count GPUs behind one PCIe switch as
    neighbours (``Device.nvlink_peers``) so multi-GPU leases still prefer close pairs.
    """

    name = "nvml"

    def __init__(self, topology_fallback: bool = True) -> None:
        self._nvml = self._load()
        self._lock = threading.Lock()
        self._closed = False
        self.topology_fallback = topology_fallback
        self._error_names = {
            getattr(self._nvml, n): n for n in dir(self._nvml) if n.startswith("NVML_ERROR_")
        }
        self._peers_cache: tuple[tuple[str, ...], dict[str, frozenset[str]]] | None = None
        self._known: dict[int, _Gpu] = {}  # last good facts per index, to name a GPU once it is lost
        self.driver_version = ""
        try:
            self.driver_version = _text(self._nvml.nvmlSystemGetDriverVersion())
        except self._nvml.NVMLError as exc:  # cosmetic only
            log.debug("no driver version: %s", exc)
        self._cuda_version: tuple[int | None] | None = None

    # --- set-up ---------------------------------------------------------------------------------
    @staticmethod
    def _load() -> ModuleType:
        """Import pynvml and run ``nvmlInit`` once; a missing driver is a one-line PoolUnavailable."""
        try:
            import pynvml  # imported late so tests can substitute a fake module
        except ImportError as exc:
            raise NoGpuFound(f"no NVIDIA driver found (NVML: nvidia-ml-py is not installed: {exc}); {SIMULATE_HINT}") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            code = getattr(exc, "value", None)
            names = {getattr(pynvml, n): n for n in dir(pynvml) if n.startswith("NVML_ERROR_")}
            name = names.get(code, f"code {code}")
            if name in _NO_DRIVER_ERRORS:
                raise NoGpuFound(f"no NVIDIA driver found (NVML: {exc}); {SIMULATE_HINT}") from None
            raise PoolUnavailable(f"NVML could not start (NVML: {exc} ({name})); fix the NVIDIA driver or {SIMULATE_HINT}") from None
        except OSError as exc:  # very old pynvml let the dlopen error through
            raise NoGpuFound(f"no NVIDIA driver found (NVML: {exc}); {SIMULATE_HINT}") from None
        return pynvml

    def close(self) -> None:
        """Shut NVML down (once; later calls do nothing)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._nvml.nvmlShutdown()
            except self._nvml.NVMLError as exc:
                log.debug("nvmlShutdown failed: %s", exc)

    @property
    def cuda_driver_version(self) -> int | None:
        """The CUDA API the driver offers (12080 for 12.8), None when NVML cannot say; asked once."""
        if self._cuda_version is None:
            version: int | None = None
            getter = getattr(self._nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or getattr(
                self._nvml, "nvmlSystemGetCudaDriverVersion", None
            )
            if getter is not None:
                try:
                    version = int(getter())
                except (self._nvml.NVMLError, TypeError, ValueError) as exc:
                    log.debug("no CUDA driver version: %s", exc)
            self._cuda_version = (version,)
        return self._cuda_version[0]

    def describe(self) -> str:
        driver = f" (driver {self.driver_version})" if self.driver_version else ""
        return f"nvml{driver}"

    # --- helpers --------------------------------------------------------------------------------
    def _reason(self, exc: Exception) -> str:
        """``GPU is lost (NVML_ERROR_GPU_IS_LOST)``."""
        code = getattr(exc, "value", None)
        name = self._error_names.get(code, f"NVML error {code}")
        return f"{exc} ({name})"

    def _benign(self, exc: Exception) -> bool:
        return self._error_names.get(getattr(exc, "value", None)) in _BENIGN_ERRORS

    def _check_open(self) -> None:
        if self._closed:
            raise PoolUnavailable("the NVML backend was closed; make a new one")

    # --- enumeration ----------------------------------------------------------------------------
    def _enumerate(self) -> list[_Gpu]:
        nv = self._nvml
        self._check_open()
        try:
            count = int(nv.nvmlDeviceGetCount())
        except nv.NVMLError as exc:
            raise PoolUnavailable(f"NVML cannot count the GPUs ({self._reason(exc)}); check the driver with nvidia-smi") from None
        gpus = [self._read_gpu(i) for i in range(count)]
        for gpu in gpus:
            if not gpu.error:
                self._known[gpu.index] = gpu
        return gpus

    def _read_gpu(self, index: int) -> _Gpu:
        nv = self._nvml
        gpu = _Gpu(index=index)
        try:
            gpu.handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            gpu.denied = self._error_names.get(getattr(exc, "value", None)) == "NVML_ERROR_NO_PERMISSION"
            return self._lost(gpu, exc)
        try:
            gpu.uuid = _text(nv.nvmlDeviceGetUUID(gpu.handle))
            gpu.name = _text(nv.nvmlDeviceGetName(gpu.handle))
            memory = nv.nvmlDeviceGetMemoryInfo(gpu.handle)
            gpu.memory_total = int(memory.total)
            gpu.memory_free = int(memory.free)
        except nv.NVMLError as exc:
            return self._lost(gpu, exc)
        try:
            gpu.pci = _pci_key(nv.nvmlDeviceGetPciInfo(gpu.handle))
        except nv.NVMLError as exc:
            if not self._benign(exc):
                return self._lost(gpu, exc)
        try:
            gpu.minor = int(nv.nvmlDeviceGetMinorNumber(gpu.handle))
        except nv.NVMLError as exc:  # NOT_SUPPORTED: no device node to name (device control skips it)
            if not self._benign(exc):
                return self._lost(gpu, exc)
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(gpu.handle)
            gpu.mig_enabled = current == getattr(nv, "NVML_DEVICE_MIG_ENABLE", 1)
        except nv.NVMLError as exc:  # NOT_SUPPORTED on GPUs without MIG
            if not self._benign(exc):
                return self._lost(gpu, exc)
        if gpu.mig_enabled:
            try:
                self._read_migs(gpu)
            except nv.NVMLError as exc:
                return self._lost(gpu, exc)
        return gpu

    def _read_migs(self, gpu: _Gpu) -> None:
        """Each existing MIG instance of ``gpu`` becomes a poolable device."""
        nv = self._nvml
        slots = int(nv.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))
        for slot in range(slots):
            try:
                handle = nv.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
            except nv.NVMLError as exc:
                if self._benign(exc):  # NOT_FOUND: no instance in this slot
                    continue
                raise
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
            try:
                name = _text(nv.nvmlDeviceGetName(handle))
            except nv.NVMLError as exc:
                if not self._benign(exc):
                    raise
                name = f"{gpu.name} MIG {slot}"
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            instance, compute = self._mig_ids(handle)
            gpu.mig_handles.append((uuid, handle))
            gpu.migs.append(
                Device(
                    index=gpu.index,
                    uuid=uuid,
                    name=name,
                    memory_total=int(memory.total),
                    memory_free=int(memory.free),
                    is_mig=True,
                    parent_uuid=gpu.uuid,
                    mig_mode=True,
                    minor=gpu.minor,  # a MIG instance opens its GPU's node (and its own capability nodes)
                    mig_gi=instance,
                    mig_ci=compute,
                )
            )

    def _mig_ids(self, handle: Any) -> tuple[int | None, int | None]:
        """A MIG instance's GPU and compute instance ids, which name its capability nodes
        (``gpuN/giX/ciY/access``); (None, None) where the driver does not say: device control then
        opens the instance's whole GPU to its kernel, as for a whole-GPU grant."""
        nv = self._nvml
        try:
            return int(nv.nvmlDeviceGetGpuInstanceId(handle)), int(nv.nvmlDeviceGetComputeInstanceId(handle))
        except AttributeError:  # an nvidia-ml-py without these calls
            return None, None
        except nv.NVMLError as exc:
            if not self._benign(exc):
                raise
            return None, None

    def _lost(self, gpu: _Gpu, exc: Exception) -> _Gpu:
        """Keep what we knew of the GPU and record why it is unhealthy."""
        known = self._known.get(gpu.index)
        if known is not None and (not gpu.uuid or gpu.uuid == known.uuid):
            gpu.uuid, gpu.name, gpu.memory_total = known.uuid, known.name, known.memory_total
            gpu.mig_enabled, gpu.migs, gpu.pci = known.mig_enabled, list(known.migs), known.pci
            gpu.minor = known.minor
        gpu.uuid = gpu.uuid or f"GPU-unknown-index-{gpu.index}"
        gpu.name = gpu.name or f"GPU {gpu.index}"
        gpu.memory_free = None
        gpu.mig_handles = []
        gpu.error = self._reason(exc)
        if gpu.denied:  # device control at work, not a failing GPU: nothing to warn about
            gpu.error = f"this process may not open it ({gpu.error}); its pool's broker reads it"
            log.debug("GPU %s is not open to this process: %s", gpu.index, gpu.error)
        else:
            log.warning("GPU %s (%s) is unhealthy: %s", gpu.index, gpu.uuid, gpu.error)
        return gpu

    def _peers(self, gpus: list[_Gpu]) -> dict[str, frozenset[str]]:
        """NVLink neighbours per GPU uuid; cached while the set of GPUs stays the same."""
        key = tuple(g.uuid for g in gpus)
        if self._peers_cache is not None and self._peers_cache[0] == key:
            return self._peers_cache[1]
        if any(g.error for g in gpus):  # do not cache an answer made with a lost GPU
            return self._compute_peers([g for g in gpus if not g.error])
        peers = self._compute_peers(gpus)
        self._peers_cache = (key, peers)
        return peers

    def _compute_peers(self, gpus: list[_Gpu]) -> dict[str, frozenset[str]]:
        nv = self._nvml
        by_pci = {g.pci: g.uuid for g in gpus if g.pci is not None}
        peers: dict[str, set[str]] = {g.uuid: set() for g in gpus}
        on_switch: set[str] = set()
        any_nvlink = False
        switch_type = getattr(nv, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        max_links = int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))
        for gpu in gpus:
            for link in range(max_links):
                try:
                    if not nv.nvmlDeviceGetNvLinkState(gpu.handle, link):
                        continue
                    remote = nv.nvmlDeviceGetNvLinkRemotePciInfo(gpu.handle, link)
                except nv.NVMLError as exc:
                    name = self._error_names.get(getattr(exc, "value", None))
                    if name == "NVML_ERROR_INVALID_ARGUMENT" or link == 0 or not self._benign(exc):
                        # past the last link, no NVLink on this GPU at all, or the GPU is failing
                        if not self._benign(exc):
                            log.debug("NVLink query failed on GPU %s link %s: %s", gpu.index, link, exc)
                        break
                    continue  # this one link is not supported; later ones may be
                any_nvlink = True
                remote_key = _pci_key(remote)
                other = by_pci.get(remote_key) if remote_key is not None else None
                if other is not None and other != gpu.uuid:
                    peers[gpu.uuid].add(other)
                    peers[other].add(gpu.uuid)
                    continue
                remote_type = None
                if hasattr(nv, "nvmlDeviceGetNvLinkRemoteDeviceType"):
                    try:
                        remote_type = nv.nvmlDeviceGetNvLinkRemoteDeviceType(gpu.handle, link)
                    except nv.NVMLError:
                        remote_type = None
                if remote_type == switch_type:
                    on_switch.add(gpu.uuid)
        # GPUs on one NVSwitch fabric all reach each other over NVLink.
        for uuid in on_switch:
            peers[uuid] |= on_switch - {uuid}
        if not any_nvlink and self.topology_fallback:
            self._pcie_neighbours(gpus, peers)
        return {uuid: frozenset(p) for uuid, p in peers.items()}

    def _pcie_neighbours(self, gpus: list[_Gpu], peers: dict[str, set[str]]) -> None:
        nv = self._nvml
        limit = getattr(nv, _PCIE_NEIGHBOUR_LEVEL, 20)
        for i, first in enumerate(gpus):
            for second in gpus[i + 1 :]:
                try:
                    level = nv.nvmlDeviceGetTopologyCommonAncestor(first.handle, second.handle)
                except nv.NVMLError:
                    continue
                if int(level) <= limit:
                    peers[first.uuid].add(second.uuid)
                    peers[second.uuid].add(first.uuid)

    # --- the DeviceBackend interface ------------------------------------------------------------
    def devices(self) -> list[Device]:
        """Poolable devices: whole GPUs, or the MIG instances of GPUs in MIG mode."""
        with self._lock:
            gpus = self._enumerate()
            peers = self._peers(gpus)
        lost = frozenset(g.uuid for g in gpus if g.error)
        result: list[Device] = []
        for gpu in gpus:
            healthy = not gpu.error
            if gpu.mig_enabled:
                if not gpu.migs and healthy:
                    log.info("GPU %s (%s) has MIG enabled but no MIG instances: nothing to pool", gpu.index, gpu.uuid)
                for mig in gpu.migs:
                    if healthy:
                        result.append(mig)
                    else:
                        result.append(
                            Device(**{**mig.__dict__, "healthy": False, "health_reason": gpu.error, "memory_free": None})
                        )
                continue
            result.append(
                Device(
                    index=gpu.index,
                    uuid=gpu.uuid,
                    name=gpu.name,
                    memory_total=gpu.memory_total,
                    memory_free=gpu.memory_free,
                    healthy=healthy,
                    health_reason=gpu.error,
                    nvlink_peers=peers.get(gpu.uuid, frozenset()) - lost,
                    minor=gpu.minor,
                )
            )
        return result

    def process_usage(self) -> list[ProcessUsage]:
        """GPU memory per process on every device (and per MIG instance); lost GPUs are skipped."""
        with self._lock:
            gpus = self._enumerate()
        usage: list[ProcessUsage] = []
        for gpu in gpus:
            if gpu.error:
                continue
            targets = gpu.mig_handles if gpu.mig_enabled else [(gpu.uuid, gpu.handle)]
            for uuid, handle in targets:
                usage.extend(self._processes(uuid, handle))
        return usage

    def _processes(self, uuid: str, handle: Any) -> list[ProcessUsage]:
        """Compute, graphics and MPS-client processes of one device, one entry per pid."""
        nv = self._nvml
        per_pid: dict[int, int] = {}
        for fn_name in (
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses",
            "nvmlDeviceGetMPSComputeRunningProcesses",
        ):
            fn = getattr(nv, fn_name, None)
            if fn is None:
                continue
            try:
                processes = fn(handle)
            except nv.NVMLError as exc:
                if not self._benign(exc):
                    log.warning("%s failed on %s: %s", fn_name, uuid, self._reason(exc))
                continue
            for proc in processes or ():
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:  # not available (WDDM, or no permission in MIG mode)
                    used = 0
                pid = int(proc.pid)
                # A process with both a compute and a graphics context is listed twice.
                per_pid[pid] = max(per_pid.get(pid, 0), int(used))
        return [ProcessUsage(pid=pid, device_uuid=uuid, used_memory=used) for pid, used in sorted(per_pid.items())]


__all__ = ["SIMULATE_HINT", "NvmlBackend"]
