"""The CUDA driver API through ctypes: raw allocations that no framework cap sees, and the
process checkpoint API (``cuCheckpointProcess*``, driver 570 and later).

Also a small command-line program: ``python rawcuda.py alloc --bytes N --hold S`` allocates N
bytes with ``cuMemAlloc`` in a process of its own and holds them (the "``!python train.py``
that ignores the caps" of the watchdog and MPS checks).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time

CU_PROCESS_STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}


class CudaError(RuntimeError):
    """A CUDA driver call failed; ``name`` is the CUresult name, e.g. CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call = call
        self.code = code
        self.name = name


class Driver:
    """A thin, checked wrapper around ``libcuda.so.1``."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._initialized = False

    def _name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(ctypes.c_int(code), ctypes.byref(text)) == 0 and text.value:
            return text.value.decode()
        return f"CUresult {code}"

    def call(self, name: str, *args: object) -> None:
        code = int(getattr(self.lib, name)(*args))
        if code != 0:
            raise CudaError(name, code, self._name(code))

    def init(self) -> None:
        if not self._initialized:
            self.call("cuInit", ctypes.c_uint(0))
            self._initialized = True

    # --- raw memory ------------------------------------------------------------------------
    def primary_context(self, ordinal: int = 0) -> ctypes.c_void_p:
        self.init()
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        return ctx

    def mem_alloc(self, nbytes: int) -> int:
        """``cuMemAlloc`` then ``cuMemsetD8`` so the pages are really backed."""
        ptr = ctypes.c_uint64()
        self.call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        self.call("cuMemsetD8_v2", ptr, ctypes.c_ubyte(0x5A), ctypes.c_size_t(nbytes))
        self.call("cuCtxSynchronize")
        return int(ptr.value)

    def mem_free(self, ptr: int) -> None:
        self.call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def mem_get_info(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.call("cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    # --- checkpoint API ----------------------------------------------------------------------
    def has_checkpoint_api(self) -> bool:
        return all(
            hasattr(self.lib, sym)
            for sym in (
                "cuCheckpointProcessLock",
                "cuCheckpointProcessCheckpoint",
                "cuCheckpointProcessRestore",
                "cuCheckpointProcessUnlock",
            )
        )

    def process_state(self, pid: int) -> str:
        self.init()
        state = ctypes.c_int()
        self.call("cuCheckpointProcessGetState", ctypes.c_int(pid), ctypes.byref(state))
        return CU_PROCESS_STATES.get(state.value, f"state {state.value}")

    def checkpoint_lock(self, pid: int, timeout_ms: int = 10_000) -> None:
        self.init()
        # CUcheckpointLockArgs: unsigned timeoutMs; unsigned reserved0; cuuint64_t reserved1[7]
        args = (ctypes.c_uint32 * 16)()
        args[0] = timeout_ms
        self.call("cuCheckpointProcessLock", ctypes.c_int(pid), ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self.init()
        self.call("cuCheckpointProcessCheckpoint", ctypes.c_int(pid), None)

    def restore(self, pid: int) -> None:
        self.init()
        self.call("cuCheckpointProcessRestore", ctypes.c_int(pid), None)

    def unlock(self, pid: int) -> None:
        self.init()
        self.call("cuCheckpointProcessUnlock", ctypes.c_int(pid), None)


def _alloc_main(args: argparse.Namespace) -> int:
    """Allocate, report, hold; exit 0 after holding, 3 if the allocation was refused."""
    report: dict[str, object] = {"pid": os.getpid(), "bytes": args.bytes}
    remaining = args.bytes
    ptrs: list[int] = []
    try:
        drv = Driver()
        drv.primary_context(0)
        while remaining > 0:  # in chunks, so a limit shows where it bites
            chunk = min(remaining, args.chunk)
            ptrs.append(drv.mem_alloc(chunk))
            remaining -= chunk
        report["allocated"] = args.bytes
        report["ok"] = True
    except CudaError as exc:
        report["ok"] = False
        report["error"] = exc.name
        report["allocated"] = args.bytes - remaining
    except OSError as exc:  # no driver library at all
        report["ok"] = False
        report["error"] = f"libcuda.so.1 not loadable: {exc}"
        report["allocated"] = args.bytes - remaining
    line = json.dumps(report)
    print(line, flush=True)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(line)
        os.replace(tmp, args.ready_file)
    if not report["ok"]:
        return 3
    deadline = time.monotonic() + args.hold
    try:
        while time.monotonic() < deadline:  # until killed or the hold is over
            time.sleep(0.2)
            if args.stop_file and os.path.exists(args.stop_file):
                break
    except KeyboardInterrupt:  # interrupted with its kernel: the driver frees the memory at exit
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rawcuda.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    alloc = sub.add_parser("alloc", help="allocate raw device memory and hold it")
    alloc.add_argument("--bytes", type=int, required=True, help="how many bytes to allocate")
    alloc.add_argument("--chunk", type=int, default=256 * 1024**2, help="allocation size per cuMemAlloc call")
    alloc.add_argument("--hold", type=float, default=60.0, help="seconds to hold the memory before exiting")
    alloc.add_argument("--ready-file", default="", help="write the JSON report here once allocated")
    alloc.add_argument("--stop-file", default="", help="exit early once this file exists")
    args = parser.parse_args(argv)
    return _alloc_main(args)


if __name__ == "__main__":
    sys.exit(main())
