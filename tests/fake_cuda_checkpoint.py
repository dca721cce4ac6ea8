"""A scripted stand-in for ``cuda.core.checkpoint`` (cuda-core >= 1.2) for tests without a GPU.

It plays the real module's public surface: ``Process(pid)`` with the properties ``pid``,
``state`` ("running" | "locked" | "checkpointed" | "failed") and ``restore_thread_id``, and the
methods ``lock(timeout_ms=0)``, ``checkpoint()``, ``restore(gpu_mapping=None)`` and ``unlock()``;
the same argument checks (``TypeError``/``ValueError`` for a bad pid, timeout or UUID string); the
same errors: ``cuda.core._utils.cuda_utils.CUDAError("CUDA_ERROR_X: explanation")`` for a failed
driver call, and ``RuntimeError("CUDA checkpointing is not supported by the installed NVIDIA
driver. ...")`` for a too-old driver or bindings and for ``CUDA_ERROR_NOT_SUPPORTED`` /
``CUDA_ERROR_NOT_FOUND`` from any call. Modelled on NVIDIA/cuda-python
``cuda_core/cuda/core/checkpoint.py`` (commit 05aa37eb331d9767ec64331893d8509f21a2ce5b) and
``cuda_core/cuda/core/_utils/cuda_utils.pyx`` (``CUDAError``, ``handle_return``), with the driver
semantics of the CUDA driver API's ``cuCheckpointProcess*`` reference: a lock that times out
returns ``CUDA_ERROR_NOT_READY`` and leaves the process running; each step needs the state before
it (else ``CUDA_ERROR_ILLEGAL_STATE``); a restore ends locked; a restore mapping must name every
checkpointed GPU and, for a move, every GPU the driver shows (cuda.core's ``restore`` docstring),
one to one (else ``CUDA_ERROR_INVALID_VALUE``); and, as NVIDIA/cuda-checkpoint
issue 44 reports for driver 580, a restore that ran out of memory leaves the process checkpointed
and every later restore fails with ``CUDA_ERROR_OPERATING_SYSTEM``.

Use::

    driver = FakeCudaDriver(nvml=fake_nvml)      # optional FakeNvml: memory moves in NVML too
    driver.add_process(pid, {gpu_uuid: 4 * GIB})
    driver.install(monkeypatch)                  # sys.modules["cuda.core.checkpoint"], ...
    driver.fail("restore", "CUDA_ERROR_OUT_OF_MEMORY")   # script the next restore to fail
    driver.calls                                 # [("lock", pid, 30000), ("checkpoint", pid), ...]
"""

from __future__ import annotations

import enum
import sys
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fake_pynvml import FakeNvml, FakeProcess

RUNNING, LOCKED, CHECKPOINTED, FAILED = 0, 1, 2, 3
STATE_NAMES = {RUNNING: "running", LOCKED: "locked", CHECKPOINTED: "checkpointed", FAILED: "failed"}
UNSUPPORTED = (
    "CUDA checkpointing is not supported by the installed NVIDIA driver. "
    "Upgrade to a driver version with CUDA checkpoint API support."
)
# CUresult values and cuda.core's explanations (driver_cu_result_explanations) for the codes used.
CU_RESULTS: dict[str, tuple[int, str]] = {
    "CUDA_SUCCESS": (0, "The API call returned with no errors."),
    "CUDA_ERROR_INVALID_VALUE": (
        1,
        "This indicates that one or more of the parameters passed to the API call is not within an acceptable range of values.",
    ),
    "CUDA_ERROR_OUT_OF_MEMORY": (
        2,
        "The API call failed because it was unable to allocate enough memory or other resources to perform the requested operation.",
    ),
    "CUDA_ERROR_NOT_INITIALIZED": (
        3,
        "This indicates that the CUDA driver has not been initialized with ::cuInit() or that initialization has failed.",
    ),
    "CUDA_ERROR_OPERATING_SYSTEM": (304, "This indicates that an OS call failed."),
    "CUDA_ERROR_ILLEGAL_STATE": (
        401,
        "This indicates that a resource required by the API call is not in a valid state to perform the requested operation.",
    ),
    "CUDA_ERROR_NOT_FOUND": (500, "This indicates that a named symbol was not found."),
    "CUDA_ERROR_NOT_READY": (
        600,
        "This indicates that asynchronous operations issued previously have not completed yet.",
    ),
    "CUDA_ERROR_NOT_SUPPORTED": (
        801,
        "This error indicates that the attempted operation is not supported on the current system or device.",
    ),
}
CUresult = enum.IntEnum("CUresult", {name: code for name, (code, _) in CU_RESULTS.items()})


class CUDAError(Exception):
    """As ``cuda.core._utils.cuda_utils.CUDAError`` (a plain Exception, not a RuntimeError)."""


CUDAError.__module__ = "cuda.core._utils.cuda_utils"


@dataclass
class FakeCudaProcess:
    """A CUDA process as the driver tracks it.

    ``memory``: bytes on each GPU (NVML uuid) while on the GPU; ``host``: the same while
    checkpointed. ``uvm``: it uses managed memory, which the driver cannot checkpoint.
    ``busy_ms``: GPU work in flight; a lock with a shorter (non-zero) timeout times out.
    """

    pid: int
    memory: dict[str, int]
    uvm: bool = False
    busy_ms: int = 0
    state: int = RUNNING
    host: dict[str, int] = field(default_factory=dict)
    restore_broken: bool = False  # after a restore that ran out of memory (cuda-checkpoint issue 44)


class FakeCudaDriver:
    """The scripted driver plus the modules (``cuda.core.checkpoint``, ``cuda.bindings.driver``,
    ...) that play it once :meth:`install` puts them into ``sys.modules``."""

    def __init__(
        self,
        *,
        driver_version: tuple[int, int, int] = (12, 9, 0),
        bindings_version: tuple[int, int, int] = (12, 9, 4),
        nvml: FakeNvml | None = None,
        cuda_core_version: str = "1.2.2",
    ) -> None:
        self.driver_version = driver_version
        self.bindings_version = bindings_version
        self.nvml = nvml
        self.cuda_core_version = cuda_core_version
        self.processes: dict[int, FakeCudaProcess] = {}
        self.calls: list[tuple[Any, ...]] = []
        self.scripted: dict[str, list[tuple[str, int | None]]] = {}
        self.init_error: str | None = None
        self.modules = self._build_modules()

    # --- scripting -------------------------------------------------------------------------------
    def add_process(self, pid: int, memory: dict[str, int], *, uvm: bool = False, busy_ms: int = 0) -> FakeCudaProcess:
        """A process with a CUDA context holding ``memory`` (uuid → bytes); shown in NVML too."""
        process = FakeCudaProcess(pid=pid, memory=dict(memory), uvm=uvm, busy_ms=busy_ms)
        self.processes[pid] = process
        self._place(process, process.memory)
        return process

    def fail(self, step: str, error: str, *, then_state: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` calls of ``step`` (lock, checkpoint, restore, unlock, state)
        return ``error`` (a CUresult name); ``then_state`` is the state the process is left in."""
        assert error in CU_RESULTS, error
        self.scripted.setdefault(step, []).extend([(error, then_state)] * times)

    def ops(self, pid: int | None = None) -> list[str]:
        """The steps called, in order (for one pid, or all)."""
        return [c[0] for c in self.calls if pid is None or c[1] == pid]

    # --- wiring ----------------------------------------------------------------------------------
    def install(self, monkeypatch: Any) -> types.ModuleType:
        """Put the fake modules into ``sys.modules`` for the test's duration; returns the checkpoint module."""
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        return self.modules["cuda.core.checkpoint"]

    def _build_modules(self) -> dict[str, types.ModuleType]:
        def package(name: str) -> types.ModuleType:
            module = types.ModuleType(name, f"fake {name} (tests/fake_cuda_checkpoint.py)")
            module.__path__ = []  # a package, so submodules import
            return module

        cuda, core, utils, bindings = package("cuda"), package("cuda.core"), package("cuda.core._utils"), package("cuda.bindings")
        cuda_utils = types.ModuleType("cuda.core._utils.cuda_utils")
        cuda_utils.CUDAError = CUDAError
        driver = types.ModuleType("cuda.bindings.driver")
        driver.CUresult = CUresult
        driver.cuInit = self._cu_init
        checkpoint = types.ModuleType("cuda.core.checkpoint", "fake cuda.core.checkpoint (tests/fake_cuda_checkpoint.py)")
        checkpoint.Process = self._process_class()
        checkpoint.__all__ = ["Process"]
        checkpoint.__fake__ = self
        core.checkpoint, core.__version__ = checkpoint, self.cuda_core_version
        core._utils, utils.cuda_utils = utils, cuda_utils
        cuda.core, cuda.bindings, bindings.driver = core, bindings, driver
        return {
            "cuda": cuda,
            "cuda.core": core,
            "cuda.core._utils": utils,
            "cuda.core._utils.cuda_utils": cuda_utils,
            "cuda.core.checkpoint": checkpoint,
            "cuda.bindings": bindings,
            "cuda.bindings.driver": driver,
        }

    def _cu_init(self, Flags: int) -> tuple[Any]:  # cuda.bindings' parameter name
        self.calls.append(("cuInit", Flags))
        return (CUresult[self.init_error or "CUDA_SUCCESS"],)

    # --- the driver ------------------------------------------------------------------------------
    def _get_driver(self) -> None:
        """cuda.core's capability check: bindings and driver new enough, else RuntimeError."""
        major, minor, patch = self.bindings_version
        if not ((major == 12 and (minor, patch) >= (8, 0)) or (major == 13 and (minor, patch) >= (0, 2)) or major > 13):
            raise RuntimeError(
                "CUDA checkpointing requires cuda.bindings with CUDA checkpoint API support. "
                f"Found cuda.bindings {major}.{minor}.{patch}."
            )
        if self.driver_version < (12, 8, 0):
            raise RuntimeError(UNSUPPORTED)

    @staticmethod
    def _raise(name: str) -> None:
        """cuda.core's ``_call_driver`` + ``handle_return`` for a failed call."""
        if name in ("CUDA_ERROR_NOT_FOUND", "CUDA_ERROR_NOT_SUPPORTED"):
            raise RuntimeError(UNSUPPORTED)
        raise CUDAError(f"{name}: {CU_RESULTS[name][1]}")

    def _step(self, step: str, pid: int, *extra: Any) -> FakeCudaProcess:
        self._get_driver()
        self.calls.append((step, pid, *extra))
        queued = self.scripted.get(step)
        if queued:
            error, then_state = queued.pop(0)
            if then_state is not None and pid in self.processes:
                self.processes[pid].state = then_state
            self._raise(error)
        process = self.processes.get(pid)
        if process is None:
            self._raise("CUDA_ERROR_INVALID_VALUE")  # no CUDA state for this pid
        return process  # type: ignore[return-value]

    def _need(self, process: FakeCudaProcess, state: int) -> None:
        if process.state != state:
            self._raise("CUDA_ERROR_ILLEGAL_STATE")

    def _gpu(self, uuid: str) -> Any:
        if self.nvml is None:
            return None
        for gpu in self.nvml.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None

    def _place(self, process: FakeCudaProcess, memory: dict[str, int]) -> None:
        for uuid, amount in memory.items():
            gpu = self._gpu(uuid)
            if gpu is not None:
                gpu.compute.append(FakeProcess(process.pid, amount))
                gpu.memory_used += amount

    def _release(self, process: FakeCudaProcess) -> None:
        for uuid, amount in process.memory.items():
            gpu = self._gpu(uuid)
            if gpu is not None:
                gpu.compute = [p for p in gpu.compute if p.pid != process.pid]
                gpu.memory_used -= amount

    @staticmethod
    def _as_uuid(value: Any) -> str:
        """cuda.core's ``_as_cuuuid`` for strings: 32 hex digits, hyphens optional."""
        if not isinstance(value, str):
            raise TypeError("GPU UUID values must be CUDA UUID objects or UUID strings")
        try:
            raw = bytes.fromhex(value.replace("-", ""))
        except ValueError:
            raise ValueError(f"GPU UUID string must be 32 hex characters (with optional hyphens), got {value!r}") from None
        if len(raw) != 16:
            raise ValueError(f"GPU UUID string must be 32 hex characters (with optional hyphens), got {value!r}")
        return raw.hex()

    def _nvml_uuid_by_hex(self, process: FakeCudaProcess) -> dict[str, str]:
        return {self._as_uuid(uuid.removeprefix("GPU-")): uuid for uuid in process.host}

    def lock(self, pid: int, timeout_ms: int) -> None:
        process = self._step("lock", pid, timeout_ms)
        self._need(process, RUNNING)
        if process.busy_ms and timeout_ms and process.busy_ms > timeout_ms:
            time.sleep(timeout_ms / 1000)
            self._raise("CUDA_ERROR_NOT_READY")  # timed out: left running
        if process.busy_ms:
            time.sleep(process.busy_ms / 1000)
        process.state = LOCKED

    def checkpoint(self, pid: int) -> None:
        process = self._step("checkpoint", pid)
        self._need(process, LOCKED)
        if process.uvm:
            self._raise("CUDA_ERROR_NOT_SUPPORTED")  # managed memory: left locked
        self._release(process)
        process.host, process.memory = process.memory, {}
        process.state = CHECKPOINTED

    def restore(self, pid: int, gpu_mapping: Any) -> None:
        pairs: dict[str, str] | None = None
        if gpu_mapping is not None:
            if not isinstance(gpu_mapping, Mapping):
                raise TypeError("gpu_mapping must be a mapping from checkpointed GPU UUID to restore GPU UUID")
            pairs = {self._as_uuid(old): self._as_uuid(new) for old, new in gpu_mapping.items()} or None
        process = self._step("restore", pid, None if gpu_mapping is None else dict(gpu_mapping))
        self._need(process, CHECKPOINTED)
        if process.restore_broken:
            self._raise("CUDA_ERROR_OPERATING_SYSTEM")
        by_hex = self._nvml_uuid_by_hex(process)
        if pairs is not None:
            host_gpus = {self._as_uuid(g.uuid.removeprefix("GPU-")) for g in (self.nvml.gpus if self.nvml else [])}
            if not set(by_hex) <= set(pairs) or not host_gpus <= set(pairs) or len(set(pairs.values())) != len(pairs):
                # every checkpointed GPU, and for a move every GPU the kernel-mode driver shows, one to one
                self._raise("CUDA_ERROR_INVALID_VALUE")
        target_of: dict[str, str] = {}
        for old_hex, nvml_uuid in by_hex.items():
            new_hex = pairs[old_hex] if pairs else old_hex
            target = next((g.uuid for g in (self.nvml.gpus if self.nvml else []) if g.uuid[4:].replace("-", "") == new_hex), None)
            target_of[nvml_uuid] = target or (nvml_uuid if new_hex == old_hex else "GPU-" + new_hex)
        needed: dict[str, int] = {}
        for old, amount in process.host.items():
            needed[target_of[old]] = needed.get(target_of[old], 0) + amount
        for uuid, amount in needed.items():
            gpu = self._gpu(uuid)
            if gpu is not None and gpu.memory_total - gpu.memory_used < amount:
                process.restore_broken = True
                self._raise("CUDA_ERROR_OUT_OF_MEMORY")  # left checkpointed
        process.memory, process.host = needed, {}
        self._place(process, process.memory)
        process.state = LOCKED

    def unlock(self, pid: int) -> None:
        process = self._step("unlock", pid)
        self._need(process, LOCKED)
        process.state = RUNNING

    def get_state(self, pid: int) -> str:
        self._get_driver()
        queued = self.scripted.get("state")
        if queued:
            self._raise(queued.pop(0)[0])
        process = self.processes.get(pid)
        if process is None:
            self._raise("CUDA_ERROR_INVALID_VALUE")
        return STATE_NAMES[process.state]  # type: ignore[union-attr]

    def _process_class(self) -> type:
        fake = self

        def check_pid(pid: Any) -> int:
            if isinstance(pid, bool) or not isinstance(pid, int):
                raise TypeError("pid must be an int")
            if pid <= 0:
                raise ValueError("pid must be a positive int")
            return pid

        class Process:
            """CUDA process that can be locked, checkpointed, restored, and unlocked."""

            __slots__ = ("_pid",)

            def __init__(self, pid: int):
                self._pid = check_pid(pid)

            @property
            def pid(self) -> int:
                return self._pid

            @property
            def state(self) -> str:
                return fake.get_state(self._pid)

            @property
            def restore_thread_id(self) -> int:
                fake._get_driver()
                if self._pid not in fake.processes:
                    fake._raise("CUDA_ERROR_INVALID_VALUE")
                return self._pid + 1

            def lock(self, timeout_ms: int = 0) -> None:
                if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, int):
                    raise TypeError("timeout_ms must be an int")
                if timeout_ms < 0:
                    raise ValueError("timeout_ms must be >= 0")
                fake.lock(self._pid, timeout_ms)

            def checkpoint(self) -> None:
                fake.checkpoint(self._pid)

            def restore(self, gpu_mapping: Mapping[Any, Any] | None = None) -> None:
                fake.restore(self._pid, gpu_mapping)

            def unlock(self) -> None:
                fake.unlock(self._pid)

        Process.__module__ = "cuda.core.checkpoint"
        return Process


def hex_uuid(index: int) -> str:
    """An NVML-style GPU uuid whose body is real hex, as the driver's UUIDs are."""
    return f"GPU-{index:08x}-0000-4000-8000-{index:012x}"


def give_cuda_version(nvml: FakeNvml, version: int) -> None:
    """Add ``nvmlSystemGetCudaDriverVersion_v2`` (e.g. 12080 for 12.8) to a fake pynvml module."""

    def nvmlSystemGetCudaDriverVersion_v2():
        nvml.calls["nvmlSystemGetCudaDriverVersion_v2"] += 1
        return version

    nvml.module.nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion_v2
