"""Suspend and resume a kernel's GPU memory: park it in host RAM, free the GPU, bring it back.

Three checkpointers share one interface (:class:`Checkpointer`), picked by
:func:`checkpointer_for` from the device backend:

- :class:`CudaCheckpointer` (NVML backend): the CUDA driver's process checkpoint API
  (driver 570+, CUDA 12.8+) through ``cuda.core.checkpoint`` from the optional extra
  ``pip install jupyter-gpupool[cuda]``. The process keeps running; its next CUDA call blocks
  until it is restored, possibly onto another GPU of the same model.
- :class:`SimulatedCheckpointer` (simulated pools: demo, Binder, CI): the same contract played
  with files in the pool's usage folder, so it works across processes: the server suspends, the
  kernel's :func:`~jupyter_gpupool.devices.simulated.pretend_to_use` blocks until resumed.
- :class:`NoCheckpointer` (anything else): says why suspending is not possible here.

Under a broker's device control the user's server may open no GPU node, so it wraps the CUDA or
simulated one in :class:`~.checkpoint_worker.WorkerCheckpointer`, which runs each call in a worker
the broker places in the kernel's own GPU access. A simulated pool with a node folder plays that
rule: its checkpointer opens the nodes of the GPUs it works on and fails on ``EPERM``.

Every method blocks (the server calls them from a thread) and every failure is a
:class:`CheckpointError` whose message is one line saying what happened and what to do. The
interface, its error and :class:`NoCheckpointer` are in :mod:`.checkpoint_contract` (imported here).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import psutil

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices.base import process_alive as _alive
from jupyter_gpupool.devices.checkpoint_contract import (
    STATES,
    Checkpointer,
    CheckpointError,
    CheckpointSupport,
    NoCheckpointer,
    check_mapping,
    check_pid,
    check_timeout,
    complete_mapping,
    gone_error,
)
from jupyter_gpupool.units import format_size

if TYPE_CHECKING:
    from jupyter_gpupool.devices.base import DeviceBackend

log = logging.getLogger(__name__)

CUDA_EXTRA_HINT = "pip install jupyter-gpupool[cuda]"
MIN_DRIVER_MAJOR = 570
MIN_CUDA_API = 12080  # nvmlSystemGetCudaDriverVersion_v2 encodes 12.8 as 12080


# --- simulated --------------------------------------------------------------------------------------
class SimulatedCheckpointer(Checkpointer):
    """Suspend and resume on a simulated pool, through files in its usage folder.

    For process ``<pid>`` the folder holds:

    - ``<pid>.json``: the usage the process scripted (:func:`~.simulated.pretend_to_use`);
    - ``<pid>.parked.json``: that usage while suspended (the backend does not count it);
    - ``<pid>.suspended.json``: the marker: ``{"state": "suspended"|"failed", ...}``. While it says
      suspended, ``pretend_to_use`` in that process blocks, as a CUDA call does;
    - ``<pid>.remap.json``: old → new uuid after a resume onto other GPUs, which
      ``pretend_to_use`` applies to the GPUs it names;
    - ``<pid>.lock``: an advisory lock taken around each transition and each usage write;
    - ``fail-next-<action>.json``: one-shot fault injection (:meth:`fail_next`).

    ``backend`` (optional) is the simulated backend whose in-process usage (``set_usage``) is
    parked too and whose inventory a ``gpu_mapping`` is checked against.
    """

    name = "simulated"

    def __init__(self, usage_dir: str | None, backend: Any = None) -> None:
        super().__init__()
        self.usage_dir = usage_dir
        self.backend = backend
        #: Probe without the driver's start (a process device control denies every GPU node: each
        #: operation then runs where it may open its kernel's GPUs, see :mod:`.checkpoint_worker`).
        self.defer_driver_start = False
        self._parked_in_process: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()

    # --- fault injection (works from any process) --------------------------------------------
    @staticmethod
    def fail_next(usage_dir: str, action: str = "suspend", reason: str = "injected failure", state: str = "") -> None:
        """Make the next ``suspend`` or ``resume`` (of any pid) in ``usage_dir`` fail once with
        ``reason``. ``state="failed"`` on a resume plays a driver that lost the process's GPU
        memory (the kernel then gets an error on its next GPU use); otherwise a failed suspend
        leaves the process running and a failed resume leaves it suspended."""
        if action not in ("suspend", "resume"):
            raise CheckpointError(f"invalid action {action!r}: expected suspend or resume")
        if state not in ("", "failed"):
            raise CheckpointError(f"invalid state {state!r}: expected '' or 'failed'")
        os.makedirs(usage_dir, exist_ok=True)
        _write_json(os.path.join(usage_dir, f"fail-next-{action}.json"), {"reason": reason, "state": state})

    def _take_fault(self, action: str) -> dict[str, str] | None:
        assert self.usage_dir is not None
        path = os.path.join(self.usage_dir, f"fail-next-{action}.json")
        claimed = f"{path}.{os.getpid()}.{threading.get_ident()}"
        try:
            os.rename(path, claimed)  # atomic: exactly one caller consumes it
        except OSError:
            return None
        try:
            with open(claimed) as handle:
                fault = json.load(handle)
        except (OSError, ValueError):
            fault = {}
        finally:
            with contextlib.suppress(OSError):
                os.remove(claimed)
        return {"reason": str(fault.get("reason") or "injected failure"), "state": str(fault.get("state") or "")}

    # --- the interface -------------------------------------------------------------------------
    def _probe(self) -> CheckpointSupport:
        if not self.usage_dir:
            return CheckpointSupport(
                False, "simulated", "this simulated pool has no usage folder (GPUPOOL_DB unset), so kernels cannot be suspended"
            )
        if not self.defer_driver_start:
            why = self._driver_cannot_start(self._all_gpus(), every=True)
            if why:
                return CheckpointSupport(False, "simulated", f"the CUDA driver cannot start here: {why}")
        return CheckpointSupport(
            True, "simulated", f"simulated suspend: kernels' scripted usage is parked in {self.usage_dir}"
        )

    def _paths(self, pid: int) -> dict[str, str]:
        assert self.usage_dir is not None
        base = os.path.join(self.usage_dir, str(pid))
        return {
            "usage": f"{base}.json",
            "parked": f"{base}.parked.json",
            "marker": f"{base}.suspended.json",
            "remap": f"{base}.remap.json",
            "lock": f"{base}.lock",
        }

    def _require_dir(self, pid: int, action: str) -> None:
        support = self.probe()
        if not support.supported:
            raise CheckpointError(f"cannot {action} process {pid}: {support.reason}", state=self.state(pid))
        os.makedirs(self.usage_dir or "", exist_ok=True)

    def suspend(self, pid: int, timeout: float = 30.0) -> int:
        pid = check_pid(pid)
        timeout = check_timeout(timeout)
        self._require_dir(pid, "suspend")
        if not _alive(pid):
            raise gone_error(pid, "suspend")
        why = self._driver_cannot_start(self._gpus_of(pid))
        if why:
            raise CheckpointError(f"could not suspend process {pid}: the CUDA driver cannot start in this process: {why}; it keeps running", state="running")
        paths = self._paths(pid)
        with _file_lock(paths["lock"], timeout) as locked:  # per pid, across threads and processes
            if not locked:
                raise CheckpointError(
                    f"could not suspend process {pid}: it was busy on the GPU for the whole {timeout:g} s "
                    "lock timeout; it keeps running, try again once its cell is done",
                    state="running",
                )
            marker = _read_json(paths["marker"])
            if marker is not None:
                state = "failed" if marker.get("state") == "failed" else "suspended"
                raise CheckpointError(f"cannot suspend process {pid}: it is already {state}", state=state)
            fault = self._take_fault("suspend")
            if fault is not None:
                raise CheckpointError(f"could not suspend process {pid}: {fault['reason']}", state="running")
            usage = _read_json(paths["usage"]) or {}
            parked = {uuid: int(amount) for uuid, amount in usage.items() if isinstance(amount, int) and amount > 0}
            in_process = self._park_in_process(pid)
            total = sum(parked.values()) + sum(in_process.values())
            # The marker first: from here on the process's next use blocks.
            _write_json(paths["marker"], {"state": "suspended", "since": time.time(), "bytes": total})
            _write_json(paths["parked"], parked)
            with contextlib.suppress(FileNotFoundError):
                os.remove(paths["usage"])
        log.info("simulated suspend of process %s: %s parked", pid, format_size(total))
        return total

    def resume(self, pid: int, gpu_mapping: dict[str, str] | None = None) -> None:
        pid = check_pid(pid)
        mapping = check_mapping(gpu_mapping)
        self._require_dir(pid, "resume")
        paths = self._paths(pid)
        with _file_lock(paths["lock"], 30.0) as locked:
            if not locked:
                raise CheckpointError(
                    f"could not resume process {pid}: its lock file stayed taken for 30 s; try again", state=self.state(pid)
                )
            if not _alive(pid):
                self._forget(pid)
                raise gone_error(pid, "resume")
            marker = _read_json(paths["marker"])
            if marker is None:
                if mapping:
                    raise CheckpointError(f"cannot move process {pid} onto other GPUs: it is not suspended", state="running")
                return  # running already: nothing to do
            if marker.get("state") == "failed":
                raise CheckpointError(
                    f"cannot resume process {pid}: its GPU memory was lost in a failed restore; restart the kernel",
                    state="failed",
                )
            parked = _read_json(paths["parked"]) or {}
            with self._lock:
                in_process = dict(self._parked_in_process.get(pid, {}))
            if mapping and self.backend is not None:
                mapping = complete_mapping(mapping, [d.uuid for d in self.backend.devices()])
            self._check_targets(pid, parked, in_process, mapping)
            why = self._driver_cannot_start([mapping.get(u, u) for u in self._gpus_of(pid)])
            if why:
                raise CheckpointError(
                    f"could not resume process {pid}: the CUDA driver cannot start in this process: {why}; it stays suspended",
                    state="suspended",
                )
            fault = self._take_fault("resume")
            if fault is not None:
                if fault["state"] == "failed":
                    marker["state"] = "failed"
                    marker["reason"] = fault["reason"]
                    _write_json(paths["marker"], marker)
                    raise CheckpointError(
                        f"could not resume process {pid}: {fault['reason']}; its GPU memory is lost, restart the kernel",
                        state="failed",
                    )
                raise CheckpointError(
                    f"could not resume process {pid}: {fault['reason']}; it stays suspended, try again",
                    state="suspended",
                )
            restored: dict[str, int] = {}
            for uuid, amount in parked.items():
                target = mapping.get(uuid, uuid)
                restored[target] = restored.get(target, 0) + int(amount)
            if restored:
                _write_json(paths["usage"], restored)
            if mapping:
                self._record_remap(paths["remap"], mapping)
            self._unpark_in_process(pid, mapping)
            with contextlib.suppress(FileNotFoundError):
                os.remove(paths["parked"])
            os.remove(paths["marker"])  # last: from here on the process's next use goes through
        log.info("simulated resume of process %s%s", pid, f" onto {mapping}" if mapping else "")

    def state(self, pid: int) -> str:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            return "gone"
        if not _alive(pid):
            if self.usage_dir:
                self._forget(pid)
            return "gone"
        if not self.usage_dir:
            return "running"
        marker = _read_json(self._paths(pid)["marker"])
        if marker is None:
            return "running"
        return "failed" if marker.get("state") == "failed" else "suspended"

    # --- the driver's start, played on a node folder -------------------------------------------
    def _all_gpus(self) -> list[str]:
        return [d.uuid for d in self.backend.devices()] if self.backend is not None else []

    def _gpus_of(self, pid: int) -> list[str]:
        """The GPUs process ``pid`` works on now (its ``CUDA_VISIBLE_DEVICES`` through any move);
        every GPU of the pool where its environment cannot be read."""
        try:
            environ = psutil.Process(pid).environ()
        except psutil.Error:
            return self._all_gpus()
        found = [u for u in devices_now(self.usage_dir or "", pid, environ) if u.startswith("GPU-")]
        return found or self._all_gpus()

    def _driver_cannot_start(self, uuids: list[str], every: bool = False) -> str:
        """On a pool with a simulated node folder (device control on a simulated pool), what a real
        ``cuInit`` and checkpoint call meet: each GPU worked on must open in this process (``ENXIO``,
        no driver behind the node, is an open that got through; ``EPERM`` is device control's
        deny). ``""`` when they open, else one line why not. ``every``: fail only when every one
        refuses (``cuInit`` needs one GPU)."""
        node_dir = getattr(self.backend, "node_dir", None)
        if not node_dir or not uuids:
            return ""
        minors = {d.uuid: d.minor for d in self.backend.devices()}
        refused = []
        for uuid in dict.fromkeys(uuids):
            minor = minors.get(uuid)
            if minor is None:
                continue
            path = os.path.join(node_dir, f"nvidia{minor}")
            try:
                os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC))
            except PermissionError:
                refused.append(path)
                continue
            except OSError:
                pass  # ENXIO: the open got through (no driver behind a simulated node)
            if every:
                return ""
        if not refused:
            return ""
        return f"no CUDA device visible to this process ({', '.join(refused)}: EPERM, denied by device control)"

    # --- helpers -------------------------------------------------------------------------------
    def _forget(self, pid: int) -> None:
        """A process that exited leaves nothing parked (its memory went with it)."""
        paths = self._paths(pid)
        for key in ("parked", "marker", "remap", "lock"):
            with contextlib.suppress(OSError):
                os.remove(paths[key])
        with self._lock:
            self._parked_in_process.pop(pid, None)

    def _park_in_process(self, pid: int) -> dict[str, int]:
        backend = self.backend
        usage = getattr(backend, "_usage", None)
        if backend is None or usage is None:
            return {}
        with backend._lock:
            parked = {dev: amount for (p, dev), amount in usage.items() if p == pid}
            for dev in parked:
                del usage[(pid, dev)]
        if parked:
            with self._lock:
                self._parked_in_process[pid] = parked
        return parked

    def _unpark_in_process(self, pid: int, mapping: dict[str, str]) -> None:
        with self._lock:
            parked = self._parked_in_process.pop(pid, {})
        for dev, amount in parked.items():
            self.backend.set_usage(pid, mapping.get(dev, dev), amount)

    def _check_targets(self, pid: int, parked: dict[str, Any], in_process: dict[str, int], mapping: dict[str, str]) -> None:
        """With a known inventory: every GPU it goes back to exists, is healthy and has room (as the
        driver checks), whether it moves or returns to its own GPUs."""
        if self.backend is None:
            return
        devices = {d.uuid: d for d in self.backend.devices()}
        need: dict[str, int] = {}
        for uuid, amount in [*parked.items(), *in_process.items()]:
            target = mapping.get(uuid, uuid)
            need[target] = need.get(target, 0) + int(amount)
        for target in sorted(set(mapping.values()) | set(need)):
            device = devices.get(target)
            if device is None:
                raise CheckpointError(f"cannot resume process {pid} onto {target}: no such GPU in this pool", state="suspended")
            if not device.healthy:
                raise CheckpointError(
                    f"cannot resume process {pid} onto {target}: the GPU is unhealthy ({device.health_reason})",
                    state="suspended",
                )
            free = device.memory_free if device.memory_free is not None else device.memory_total
            if need.get(target, 0) > free:
                raise CheckpointError(
                    f"cannot resume process {pid} onto {target}: it needs {format_size(need[target])} "
                    f"but the GPU has {format_size(free)} free; it stays suspended",
                    state="suspended",
                )

    @staticmethod
    def _record_remap(path: str, mapping: dict[str, str]) -> None:
        """Compose with an earlier move: original uuid → where it lives now."""
        earlier = _read_json(path) or {}
        composed = {orig: mapping.get(now, now) for orig, now in earlier.items()}
        for old, new in mapping.items():
            if old not in earlier.values():
                composed.setdefault(old, new)
        _write_json(path, composed)


def _write_json(path: str, data: object) -> None:
    temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(temporary, "w") as handle:
        json.dump(data, handle)
    os.replace(temporary, path)  # readers never see half a file


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _file_lock(path: str, timeout: float) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path``, waited for up to ``timeout`` s; yields whether it was got."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.1)
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def wait_while_suspended(usage_dir: str, pid: int, max_poll: float = 0.25) -> Iterator[None]:
    """Block (polling, with backoff up to ``max_poll`` s) while process ``pid`` is suspended, then
    hold its lock for the caller's usage write (a context manager, used by
    :func:`~.simulated.pretend_to_use`); raises :class:`CheckpointError` when a failed restore lost
    the process's GPU memory. Interruptible (``KeyboardInterrupt`` between polls)."""
    marker = os.path.join(usage_dir, f"{pid}.suspended.json")
    lock_path = os.path.join(usage_dir, f"{pid}.lock")
    delay = 0.01
    while True:
        with _file_lock(lock_path, 3600.0) as locked:
            if locked:
                state = _read_json(marker)
                if state is None:
                    yield
                    return
                if state.get("state") == "failed":
                    raise CheckpointError(
                        f"this kernel's GPU memory was lost when resuming it ({state.get('reason') or 'restore failed'}); "
                        "restart the kernel"
                    )
        time.sleep(delay)
        delay = min(delay * 2, max_poll)


def apply_remap(usage_dir: str, pid: int, uuids: list[str]) -> list[str]:
    """The GPUs a process uses now, after any resume onto other GPUs (``<pid>.remap.json``):
    ``uuids`` are the ones it was started on."""
    remap = _read_json(os.path.join(usage_dir, f"{pid}.remap.json")) or {}
    return [str(remap.get(uuid, uuid)) for uuid in uuids]


#: Set in a kernel's environment when it first follows a move: the GPUs it was started on (a
#: remap maps those), while ``CUDA_VISIBLE_DEVICES`` names where it runs now.
STARTED_ON_ENV = "GPUPOOL_STARTED_ON_DEVICES"


def devices_now(usage_dir: str, pid: int, environ: dict[str, str] | os._Environ[str]) -> list[str]:
    """The GPUs process ``pid`` (with ``environ``) uses now. A process that was moved maps the GPUs
    it was started on (:data:`STARTED_ON_ENV`, else ``CUDA_VISIBLE_DEVICES``) through its remap; any
    other (a child started after the move) uses ``CUDA_VISIBLE_DEVICES`` as it is."""
    visible = [u for u in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if u]
    if not os.path.exists(os.path.join(usage_dir, f"{pid}.remap.json")):
        return visible
    started_on = [u for u in environ.get(STARTED_ON_ENV, "").split(",") if u] or visible
    return apply_remap(usage_dir, pid, started_on)


# --- CUDA ------------------------------------------------------------------------------------------
_CUDA_ERROR = re.compile(r"\b(CUDA_ERROR_[A-Z_]+)\b")
_DRIVER_STATES = {"running": "running", "locked": "locked", "checkpointed": "suspended", "failed": "failed"}


def untouched_state(pid: int, action: str) -> str:
    """The state process ``pid`` is in after an ``action`` the driver never started on it (the
    driver could not start, the checkpoint API is missing, no worker reached it): the state it was
    in before, ``running`` for a suspend and ``suspended`` for a resume, ``gone`` once it exited,
    else ``""`` (not known). Never a guess from a driver that was not asked."""
    if not _alive(pid):
        return "gone"
    return {"suspend": "running", "resume": "suspended"}.get(action, "")


def _error_name(exc: BaseException) -> str:
    """``CUDA_ERROR_NOT_READY`` from cuda.core's ``CUDAError("CUDA_ERROR_NOT_READY: ...")``;
    ``NOT_SUPPORTED`` for its RuntimeError about an unsupported driver; else the class name."""
    text = str(exc)
    match = _CUDA_ERROR.search(text)
    if match:
        return match.group(1)
    if "not supported by the installed NVIDIA driver" in text:
        return "NOT_SUPPORTED"
    return type(exc).__name__


def _first_line(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _driver_said(exc: BaseException, limit: int = 140) -> str:
    """``CUDA_ERROR_X: explanation`` (cuda.core's CUDAError text already starts with the name)."""
    text = _first_line(exc, limit)
    name = _error_name(exc)
    return text if text.startswith(name) else f"{name}: {text}"


def _cuda_core_version() -> str:
    with contextlib.suppress(Exception):
        import cuda.core

        version = str(getattr(cuda.core, "__version__", "") or "")
        if version:
            return version
    with contextlib.suppress(Exception):
        from importlib.metadata import version as dist_version

        return dist_version("cuda-core")
    return "installed"


def _driver_uuid(uuid: str) -> str:
    """NVML's ``GPU-xxxxxxxx-…`` → the bare ``xxxxxxxx-…`` form cuda.core's gpu_mapping takes."""
    return uuid[4:] if uuid.upper().startswith(("GPU-", "MIG-")) else uuid


class CudaCheckpointer(Checkpointer):
    """The CUDA driver's process checkpoint API through ``cuda.core.checkpoint`` (imported lazily).

    ``backend`` is the :class:`~.nvml.NvmlBackend` (its NVML module gives the driver version, its
    ``process_usage`` the bytes a process holds, its ``devices`` the free memory of restore targets),
    or, in a user's server under a broker, a :class:`~jupyter_gpupool.backends.broker_devices.BrokerGpus`,
    whose ``driver_versions()`` gives the versions instead of NVML in this process.
    """

    name = "cuda"

    def __init__(self, backend: Any = None) -> None:
        super().__init__()
        self.backend = backend
        self._module: ModuleType | None = None
        self._driver_version: str | None = None
        self._initialized = False
        self._parked: dict[int, dict[str, int]] = {}  # pid -> bytes per device uuid at suspend
        self._lock = threading.Lock()
        #: Probe without ``cuInit`` (a process device control denies every GPU node finds no device):
        #: each operation then runs in a worker inside its kernel's GPU access (:mod:`.checkpoint_worker`).
        self.defer_driver_start = False

    # --- probing ---------------------------------------------------------------------------------
    def _nvml(self) -> Any:
        nvml = getattr(self.backend, "_nvml", None)
        if nvml is not None:
            return nvml
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # noqa: BLE001 - no NVML: versions unknown, the driver call decides
            return None
        return pynvml

    def _probe(self) -> CheckpointSupport:
        driver: str | None = None
        cuda_api: int | None = None
        told = getattr(self.backend, "driver_versions", None)  # a broker's GPUs: it says, not NVML here
        nvml = None if callable(told) else self._nvml()
        if callable(told):
            driver, cuda_api = told()
        elif nvml is not None:
            with contextlib.suppress(Exception):
                raw = nvml.nvmlSystemGetDriverVersion()
                driver = raw.decode() if isinstance(raw, bytes) else str(raw)
            getter = getattr(nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or getattr(
                nvml, "nvmlSystemGetCudaDriverVersion", None
            )
            if getter is not None:
                with contextlib.suppress(Exception):
                    cuda_api = int(getter())
        self._driver_version = driver
        if driver:
            with contextlib.suppress(ValueError):
                major = int(driver.split(".")[0])
                if major < MIN_DRIVER_MAJOR:
                    return CheckpointSupport(
                        False,
                        "cuda",
                        f"NVIDIA driver {driver} is older than {MIN_DRIVER_MAJOR}: suspending kernels needs the CUDA "
                        f"checkpoint API of driver {MIN_DRIVER_MAJOR} or newer; upgrade the driver",
                        driver,
                    )
        if cuda_api is not None and cuda_api < MIN_CUDA_API:
            return CheckpointSupport(
                False,
                "cuda",
                f"the NVIDIA driver offers CUDA {cuda_api // 1000}.{cuda_api % 1000 // 10}, older than 12.8: "
                "suspending kernels needs the CUDA checkpoint API of 12.8 or newer; upgrade the driver",
                driver,
            )
        try:
            import cuda.core.checkpoint as module  # the optional extra
        except ImportError as exc:
            return CheckpointSupport(
                False,
                "cuda",
                f"cuda-core is not installed ({_first_line(exc, 80)}): {CUDA_EXTRA_HINT} to suspend kernels",
                driver,
            )
        except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
            return CheckpointSupport(
                False, "cuda", f"cuda.core.checkpoint cannot be imported ({_first_line(exc)}); reinstall with {CUDA_EXTRA_HINT}", driver
            )
        try:
            if not self.defer_driver_start:
                self._init_driver()
        except Exception as exc:  # noqa: BLE001
            return CheckpointSupport(False, "cuda", f"the CUDA driver cannot start here: {_first_line(exc)}", driver)
        try:
            # Asks the driver about this (CUDA-less) server process: cuda.core raises RuntimeError
            # when the bindings or the driver lack the checkpoint API; a CUDA error about this
            # process having no CUDA state is the expected, fine answer.
            module.Process(os.getpid()).state  # noqa: B018
        except Exception as exc:  # noqa: BLE001
            text = str(exc)
            if _error_name(exc) == "NOT_SUPPORTED" or "requires cuda.bindings" in text:
                return CheckpointSupport(
                    False, "cuda", f"the CUDA checkpoint API is not usable here: {_first_line(exc)}", driver
                )
        self._module = module
        return CheckpointSupport(
            True,
            "cuda",
            f"CUDA checkpoint API (driver {driver or 'unknown'}, cuda.core {_cuda_core_version()})",
            driver,
        )

    def _init_driver(self) -> None:
        """``cuInit`` in this process: the driver needs it to restore another process."""
        if self._initialized:
            return
        from cuda.bindings import driver

        result = driver.cuInit(0)
        err = result[0] if isinstance(result, tuple) else result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuInit failed: {getattr(err, 'name', err)}")
        self._initialized = True

    def supports_devices(self, devices: list[Device]) -> str:
        reason = super().supports_devices(devices)
        if reason:
            return reason
        for device in devices:
            if device.is_mig or device.mig_mode:
                return f"GPU {device.index} ({device.name}) is a MIG instance: the CUDA checkpoint API does not support MIG, so this kernel cannot be suspended"
            if not device.healthy:
                return f"GPU {device.index} ({device.name}) is unhealthy ({device.health_reason}): its kernels cannot be suspended"
        return ""

    def _process(self, pid: int, action: str) -> Any:
        support = self.probe()
        if not support.supported or self._module is None:
            raise CheckpointError(f"cannot {action} process {pid}: {support.reason}", state=untouched_state(pid, action))
        return self._module.Process(pid)

    # --- suspend / resume ------------------------------------------------------------------------
    def _held_bytes(self, pid: int) -> dict[str, int]:
        usage = getattr(self.backend, "process_usage", None)
        if usage is None:
            return {}
        try:
            return {u.device_uuid: u.used_memory for u in usage() if u.pid == pid and u.used_memory > 0}
        except Exception as exc:  # noqa: BLE001 - the count is informative; the driver decides
            log.warning("could not read GPU memory of process %s before suspending it: %s", pid, exc)
            return {}

    def _driver_state(self, process: Any) -> str:
        try:
            return _DRIVER_STATES.get(str(process.state), "")
        except Exception:  # noqa: BLE001
            return ""

    def suspend(self, pid: int, timeout: float = 30.0) -> int:
        pid = check_pid(pid)
        timeout = check_timeout(timeout)
        process = self._process(pid, "suspend")
        if not _alive(pid):
            raise gone_error(pid, "suspend")
        held = self._held_bytes(pid)
        timeout_ms = max(1, round(timeout * 1000))
        try:
            process.lock(timeout_ms)
        except Exception as exc:  # noqa: BLE001
            name = _error_name(exc)
            state = self._driver_state(process) or ("running" if _alive(pid) else "gone")
            if name == "CUDA_ERROR_NOT_READY":
                raise CheckpointError(
                    f"could not suspend process {pid}: it was busy on the GPU for the whole {timeout:g} s lock "
                    "timeout; it keeps running, try again once its cell is done",
                    state=state,
                ) from None
            if state == "suspended":
                raise CheckpointError(f"cannot suspend process {pid}: it is already suspended", state=state) from None
            raise CheckpointError(
                f"the CUDA driver could not lock process {pid} for suspending ({_driver_said(exc)}); "
                "it keeps running",
                state=state,
            ) from None
        try:
            process.checkpoint()
        except Exception as exc:  # noqa: BLE001
            name = _error_name(exc)
            why = (
                "it probably uses unified (managed) or IPC-shared GPU memory, which the driver cannot checkpoint"
                if name == "NOT_SUPPORTED"
                else _driver_said(exc)
            )
            state = self._unlock_after_failure(process, pid)
            outcome = "it keeps running on its GPU" if state == "running" else f"it is left {state or 'in an unknown state'}"
            raise CheckpointError(f"the CUDA driver could not suspend process {pid} ({why}); {outcome}", state=state) from None
        with self._lock:
            self._parked[pid] = held
        total = sum(held.values())
        log.info("suspended process %s: %s parked in host RAM", pid, format_size(total))
        return total

    def _unlock_after_failure(self, process: Any, pid: int) -> str:
        """Put a process whose checkpoint failed back to running; return the state it is in."""
        state = self._driver_state(process)
        if state == "locked":
            try:
                process.unlock()
            except Exception as exc:  # noqa: BLE001
                log.warning("could not unlock process %s after a failed checkpoint: %s", pid, exc)
            state = self._driver_state(process)
        if not state:
            state = "running" if _alive(pid) else "gone"
        return state

    def resume(self, pid: int, gpu_mapping: dict[str, str] | None = None) -> None:
        pid = check_pid(pid)
        mapping = check_mapping(gpu_mapping)
        process = self._process(pid, "resume")
        if not _alive(pid):
            with self._lock:
                self._parked.pop(pid, None)
            raise gone_error(pid, "resume")
        state = self._driver_state(process)
        if state == "running":
            if mapping:
                raise CheckpointError(f"cannot move process {pid} onto other GPUs: it is not suspended", state="running")
            return  # nothing to do
        if state == "failed":
            raise CheckpointError(
                f"cannot resume process {pid}: the CUDA driver reports its GPU state as failed; restart the kernel",
                state="failed",
            )
        if state != "locked":  # checkpointed, or unknown: restore
            with self._lock:
                parked = dict(self._parked.get(pid, {}))
            if mapping:
                mapping = complete_mapping(mapping, self._host_gpus())
            self._check_room(pid, parked, mapping)
            driver_mapping = {_driver_uuid(old): _driver_uuid(new) for old, new in mapping.items()} or None
            try:
                process.restore(driver_mapping)
            except Exception as exc:  # noqa: BLE001
                after = self._driver_state(process) or ("suspended" if _alive(pid) else "gone")
                outcome = {
                    "suspended": "it stays suspended with its memory in host RAM; after a failed restore some drivers "
                    "cannot restore it again, so restart the kernel if a retry fails too",
                    "failed": "its GPU state is lost; restart the kernel",
                    "gone": "the process has exited",
                }.get(after, f"it is left {after}")
                raise CheckpointError(
                    f"the CUDA driver could not resume process {pid} ({_driver_said(exc)}); {outcome}",
                    state=after,
                ) from None
        try:
            process.unlock()
        except Exception as exc:  # noqa: BLE001
            after = self._driver_state(process) or ("locked" if _alive(pid) else "gone")
            raise CheckpointError(
                f"process {pid}'s GPU memory is back but the CUDA driver could not unlock it "
                f"({_driver_said(exc)}); it is left {after}, try resuming again",
                state=after,
            ) from None
        with self._lock:
            self._parked.pop(pid, None)
        log.info("resumed process %s%s", pid, f" onto {mapping}" if mapping else "")

    def _host_gpus(self) -> list[str]:
        """Every whole GPU of the host (what a restore mapping has to name), or [] if unknown."""
        devices_of = getattr(self.backend, "devices", None)
        if devices_of is None:
            return []
        try:
            return [d.uuid for d in devices_of() if not d.is_mig]
        except Exception as exc:  # noqa: BLE001 - cannot tell: pass the mapping as given
            log.warning("could not list the GPUs to complete a restore mapping: %s", exc)
            return []

    def _check_room(self, pid: int, parked: dict[str, int], mapping: dict[str, str]) -> None:
        """Refuse a restore that would run out of GPU memory: a failed restore can leave a process
        that no later restore brings back (driver 580), so check free memory first."""
        devices_of = getattr(self.backend, "devices", None)
        if not parked or devices_of is None:
            return
        need: dict[str, int] = {}
        for uuid, amount in parked.items():
            target = mapping.get(uuid, uuid)
            need[target] = need.get(target, 0) + amount
        try:
            devices = {d.uuid: d for d in devices_of()}
        except Exception as exc:  # noqa: BLE001 - cannot tell: let the driver decide
            log.warning("could not read free GPU memory before resuming process %s: %s", pid, exc)
            return
        for target, amount in sorted(need.items()):
            device = devices.get(target)
            if device is None:
                raise CheckpointError(f"cannot resume process {pid} onto {target}: no such GPU on this host", state="suspended")
            if device.memory_free is not None and device.memory_free < amount:
                raise CheckpointError(
                    f"cannot resume process {pid} onto GPU {device.index}: it needs {format_size(amount)} but the GPU "
                    f"has {format_size(device.memory_free)} free; it stays suspended, try again when memory is free",
                    state="suspended",
                )

    def state(self, pid: int) -> str:
        """As :meth:`Checkpointer.state`; ``""`` (not known) where the driver cannot be asked here."""
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or not _alive(pid):
            return "gone"
        support = self.probe()
        if not support.supported or self._module is None:
            return ""  # the driver was not asked: a suspended process would pass for a running one
        try:
            return _DRIVER_STATES.get(str(self._module.Process(pid).state), "running")
        except Exception:  # noqa: BLE001 - a process without CUDA runs normally
            return "running"


def checkpointer_for(backend: DeviceBackend | Any) -> Checkpointer:
    """The checkpointer for a device backend: simulated → :class:`SimulatedCheckpointer`,
    NVML → :class:`CudaCheckpointer`, anything else → :class:`NoCheckpointer` saying why."""
    name = getattr(backend, "name", "")
    if name == "simulated":
        return SimulatedCheckpointer(getattr(backend, "usage_dir", None), backend)
    if name == "nvml":
        return CudaCheckpointer(backend)
    if name == "remote":
        return NoCheckpointer("a broker's device backend is not on this host: give the server a local backend of its kind")
    if name == "slurm":
        return NoCheckpointer("GPUs here are allocated by Slurm, which has no suspend to host RAM")
    return NoCheckpointer(f"the {name or 'unknown'} device backend cannot suspend kernels")


__all__ = [
    "STATES",
    "CheckpointError",
    "CheckpointSupport",
    "Checkpointer",
    "CudaCheckpointer",
    "NoCheckpointer",
    "SimulatedCheckpointer",
    "checkpointer_for",
    "untouched_state",
]
