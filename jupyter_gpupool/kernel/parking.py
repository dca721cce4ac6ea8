"""The kernel's side of the fast parking path (see :mod:`jupyter_gpupool.devices.parking`).

At the kernel's start the extension probes whether its PyTorch memory can be parked by the
framework itself (torch-memory-saver: released through CUDA's virtual-memory API into a pinned
CPU backup, mapped back at the same addresses, so tensors survive untouched) and, if so, enters
the saver's region the moment ``torch`` is imported, before the kernel's first allocation:
only tensors allocated inside the region are covered. The server then asks, on the quiet
channel, ``parking_probe`` (what the start found, and the bytes covered now), ``park_framework``
and ``unpark_framework``.

The framework path is refused, saying why, when:

- ``GPUPOOL_FAST_PARKING=off`` is in the kernel's environment;
- HAMi-core's ``libvgpu.so`` is in ``LD_PRELOAD``: HAMi-core counts and caps the kernel's memory
  by hooking the CUDA driver's allocation calls, and torch-memory-saver's hooks (its ``preload``
  mode is a second ``LD_PRELOAD`` of the same calls; its ``torch`` mode maps memory through the
  virtual-memory calls behind HAMi-core's accounting) would not be counted the same way;
- torch-memory-saver is not installed in the kernel's environment, or PyTorch already used the
  GPU before the extension loaded (earlier tensors would not be covered).

The region uses the ``torch`` hook mode (PyTorch's pluggable allocator, no preload of its own),
keeps its CPU backup on (without it paused memory is lost), and keeps the pinned backup between
suspends (the host's pinned pool counts it). PyTorch's per-process memory fraction (the
kernel's cap, :mod:`jupyter_gpupool.enforcement.caps`) still applies: the region's memory comes
from the same caching allocator. On a simulated pool the path is played by
:class:`~jupyter_gpupool.devices.simulated.SimulatedMemorySaver`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jupyter_gpupool.devices.parking import DRIVER_CHECKPOINT
from jupyter_gpupool.devices.simulated import SimulatedMemorySaver
from jupyter_gpupool.units import format_size

HAMI_LIBRARY = "libvgpu.so"
TORCH_SAVER = "torch-memory-saver"


class MemorySaver(Protocol):
    """A framework's own release and re-map of the memory it manages."""

    name: str

    def held(self) -> int:
        """Bytes covered now (what a pause would back up)."""

    def pause(self) -> int:
        """Release the covered memory into the backup; the bytes released."""

    def resume(self) -> None:
        """Map the backup back at the same addresses (a no-op when nothing is paused)."""


class TorchMemorySaverRegion:
    """torch-memory-saver's region, entered once for the kernel's main thread (where its cells run)."""

    name = TORCH_SAVER
    TAG = "gpupool"

    def __init__(self, torch: types.ModuleType) -> None:
        # In-function import: the library loads only where this path was chosen and torch is in use.
        from torch_memory_saver import torch_memory_saver as saver

        self.torch = torch
        self.saver = saver
        saver.hook_mode = "torch"  # PyTorch's pluggable allocator: no LD_PRELOAD of its own
        self._region = saver.region(tag=self.TAG, enable_cpu_backup=True, cpu_backup_backend="pinned")
        self._region.__enter__()  # never left: every later allocation of this thread is covered
        saver.retain_cpu_backup = True  # the pinned backup stays for the next suspend
        self.paused = False

    def held(self) -> int:
        cuda = self.torch.cuda
        return sum(int(cuda.memory_reserved(d)) for d in range(cuda.device_count()))

    def pause(self) -> int:
        self.torch.cuda.synchronize()
        held = self.held()
        self.saver.pause(self.TAG)
        self.paused = True
        return held

    def resume(self) -> None:
        if self.paused:
            self.saver.resume(self.TAG)
            self.paused = False


class FrameworkParking:
    """What this kernel's start found about the framework path, and its quiet actions."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.saver: MemorySaver | None = None
        self.reason = ""  # why the framework path is not used ("" while it may be)
        self.last_parked_by = ""  # which path parked this kernel last, as far as it knows
        self.last_failure = ""
        self._paused = False
        self._cells_running = 0  # a cell may be using its tensors: the framework must not release them then
        self._lock = threading.Lock()

    # --- the probe, at the kernel's start ---------------------------------------------------------
    def refusal(self) -> str:
        """Why the framework path cannot be used in this kernel ("" if it can)."""
        env = self.env
        if env.get("GPUPOOL_FAST_PARKING", "auto").strip().lower() in ("off", "0", "false", "no"):
            return "turned off in this kernel (GPUPOOL_FAST_PARKING=off)"
        if HAMI_LIBRARY in env.get("LD_PRELOAD", ""):
            return (
                f"HAMi-core ({HAMI_LIBRARY}) is preloaded in this kernel: it caps memory by hooking the CUDA "
                f"allocation calls, and {TORCH_SAVER}'s own hooks would not be counted alike"
            )
        if env.get("GPUPOOL_SIMULATE"):
            return ""
        if not any(u for u in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if u.strip()):
            return "this kernel has no GPU"
        if importlib.util.find_spec("torch_memory_saver") is None:
            return f"{TORCH_SAVER} is not installed in the kernel's environment (pip install {TORCH_SAVER})"
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
            return "PyTorch used the GPU before the gpupool extension loaded: its earlier tensors would not be covered"
        return ""

    def start(self, on_import: Callable[[str, Callable[[types.ModuleType], None]], None], shell: Any = None) -> None:
        """Probe, and enter the region when ``torch`` is imported (``on_import(name, callback)``
        calls back at once if it already is); with ``shell`` (IPython), follow whether a cell runs."""
        events = getattr(shell, "events", None)
        if events is not None:
            events.register("pre_run_cell", self._cell_started)
            events.register("post_run_cell", self._cell_ended)
        self.reason = self.refusal()
        if self.reason:
            return
        if self.env.get("GPUPOOL_SIMULATE"):
            saver = SimulatedMemorySaver()
            try:
                saver.enter()
            except Exception as err:  # noqa: BLE001 -- never break the kernel's start: the driver parks it
                self.reason = f"the simulated memory saver could not start: {err}"
                return
            self.saver = saver
            return
        self.reason = f"PyTorch not imported yet: its tensors are covered by {TORCH_SAVER} once it is"
        on_import("torch", self._enter_torch)

    def _enter_torch(self, torch: types.ModuleType) -> None:
        try:
            if not torch.cuda.is_available():
                self.reason = "PyTorch sees no GPU in this kernel"
                return
            self.saver = TorchMemorySaverRegion(torch)
            self.reason = ""
        except Exception as err:  # noqa: BLE001 -- never break the user's import: the driver parks it
            self.reason = f"{TORCH_SAVER} could not start: {type(err).__name__}: {err}".splitlines()[0]

    def stop(self, shell: Any) -> None:
        """Stop following cells (the extension is unloaded; an entered region stays, as PyTorch's allocator keeps it)."""
        events = getattr(shell, "events", None)
        if events is None:
            return
        for name, callback in (("pre_run_cell", self._cell_started), ("post_run_cell", self._cell_ended)):
            with contextlib.suppress(Exception):
                events.unregister(name, callback)

    def _cell_started(self, *_: Any) -> None:
        with self._lock:
            self._cells_running += 1

    def _cell_ended(self, *_: Any) -> None:
        with self._lock:
            self._cells_running = max(0, self._cells_running - 1)

    # --- the quiet actions ------------------------------------------------------------------------
    def probe(self, _request: dict[str, Any] | None = None) -> dict[str, Any]:
        """``parking_probe``: the framework path's name (None when refused), why not, and the bytes covered."""
        saver = self.saver
        if saver is None:
            return {"path": None, "reason": self.reason or "no framework path in this kernel", "bytes": 0}
        return {"path": saver.name, "reason": None, "bytes": saver.held()}

    def park(self, _request: dict[str, Any] | None = None) -> dict[str, Any]:
        """``park_framework``: release the covered memory; on a failure midway put it back and say so."""
        saver = self.saver
        if saver is None:
            return {"status": "error", "message": self.reason or "no framework path in this kernel", "undone": True}
        with self._lock:
            if self._cells_running:
                # The driver checkpoint waits for the cell's GPU work; releasing tensors under it would not.
                return {"status": "error", "message": "a cell is running in the kernel", "undone": True}
            try:
                released = saver.pause()
            except Exception as err:  # noqa: BLE001 -- one line back; the server falls back to the driver checkpoint
                message = f"{type(err).__name__}: {err}".splitlines()[0]
                try:
                    saver.resume()
                except Exception as undo:  # noqa: BLE001
                    self.last_failure = f"{message}; putting it back failed too: {undo}"
                    return {"status": "error", "message": self.last_failure, "undone": False}
                self.last_failure = message
                return {"status": "error", "message": message, "undone": True}
            self._paused = True
        return {"bytes": released}

    def unpark(self, _request: dict[str, Any] | None = None) -> dict[str, Any]:
        """``unpark_framework``: map the backup back (also the undo of a park; nothing paused: nothing to do)."""
        saver = self.saver
        with self._lock:
            if saver is None or not self._paused:
                return {"undone": True}
            saver.resume()
            self._paused = False
            self.last_parked_by = saver.name
        return {"undone": True}

    def actions(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {"parking_probe": self.probe, "park_framework": self.park, "unpark_framework": self.unpark}

    # --- %gpupool status ---------------------------------------------------------------------------
    def line(self) -> str:
        """One line for ``%gpupool status``: which path would park this kernel, and which did last."""
        saver = self.saver
        if saver is not None:
            held = saver.held()
            what = f"{saver.name} for its PyTorch tensors ({format_size(held)} now, addresses kept), the {DRIVER_CHECKPOINT} for the rest"
        else:
            what = f"the {DRIVER_CHECKPOINT} ({self.reason or 'no framework path'})"
        last = f"; last parked by {self.last_parked_by}" if self.last_parked_by else ""
        failed = f"; {self.last_failure}, parked by the {DRIVER_CHECKPOINT} instead" if self.last_failure and not last else ""
        return f"{what}{last}{failed}"


__all__ = ["HAMI_LIBRARY", "FrameworkParking", "MemorySaver", "TorchMemorySaverRegion"]
