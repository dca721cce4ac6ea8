"""Framework memory caps applied inside the kernel, before the first GPU allocation.

The provisioner already puts the env-level caps in the kernel's environment
(``CUPY_GPU_MEMORY_LIMIT``, ``XLA_PYTHON_CLIENT_MEM_FRACTION``, ``TF_FORCE_GPU_ALLOW_GROWTH``).
PyTorch and TensorFlow have no such variable for a hard limit, so this module installs a
post-import hook (a :data:`sys.meta_path` finder) that caps them the moment user code
imports them, wherever that import happens:

- PyTorch: ``torch.cuda.set_per_process_memory_fraction(limit / total, device)`` for each
  visible device, queued with ``torch.cuda._lazy_call`` so that importing torch does not
  create a CUDA context; it runs when CUDA initializes, before the first allocation.
- TensorFlow: one logical device per GPU with ``memory_limit`` in MiB (must happen before
  TensorFlow initializes its GPUs).
- CuPy: the default memory pool's limit (CuPy reads ``CUPY_GPU_MEMORY_LIMIT`` itself; the
  in-process call keeps it right after ``%gpupool reserve`` changes the slice).

It also installs an IPython custom exception handler that appends a hint naming this
kernel's slice to the framework's out-of-memory errors; with an elastic slice it first asks the
pool to grow it, and says whether it was grown (re-run the cell) or why not.

Elastic slices move the caps while the kernel runs: the server sends a quiet control request
(the quiet channel's ``set_caps`` request, answered even while a cell runs, and no activity) when the pool grew the
slice or took its burst back. PyTorch's per-process fraction and CuPy's pool limit follow at once
(and their free caches are emptied first when the slice shrinks). TensorFlow's logical-device
limit and JAX's preallocation are fixed when they start their GPU backend: a kernel using them
keeps the limit it started with (``%gpupool status`` says so), so give it the size it needs, or a
fixed slice at its limit (``--limit`` equal to the size).

Nothing here may break an import or a cell: failures are recorded and shown by
``%gpupool status``, never raised.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import math
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

from jupyter_gpupool.units import MIB, format_size
from jupyter_gpupool.wording import gpus as gpu_count

ImportCallback = Callable[[types.ModuleType], None]
#: Callback that asks the pool to grow this kernel's slice to hold ``needed`` bytes: returns the
#: new size per GPU, or raises with the pool's reason.
GrowCallback = Callable[[int], int]

# Status words of a CapRecord.
APPLIED = "applied"
PENDING = "pending"  # queued until the framework initializes CUDA
NOT_NEEDED = "not needed"
TOO_LATE = "too late"
FAILED = "failed"
ENV = "env"  # enforced by an environment variable the framework reads itself


@dataclass
class CapRecord:
    """What this kernel did to cap one framework, for ``%gpupool status``."""

    framework: str
    status: str
    detail: str

    def describe(self) -> str:
        return f"{self.framework}: {self.detail}"


# --------------------------------------------------------------------------------------------
# Post-import hooks
# --------------------------------------------------------------------------------------------


class _HookedLoader(importlib.abc.Loader):
    """Runs the real loader, then the callbacks for the module it loaded."""

    def __init__(self, loader: importlib.abc.Loader, finder: PostImportFinder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # Let the module see its real loader (resources, pkgutil, isinstance checks).
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)  # type: ignore[attr-defined]
        self._finder.fire(module.__name__, sys.modules.get(module.__name__, module))

    def __getattr__(self, name: str) -> Any:  # anything else the import system asks for
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A :data:`sys.meta_path` entry that calls back once a watched top-level module is imported.

    It finds nothing itself: it asks the finders after it for the spec and wraps its loader.
    """

    def __init__(self) -> None:
        self._hooks: dict[str, list[ImportCallback]] = {}
        self._busy = threading.local()
        self._lock = threading.RLock()

    def register(self, name: str, callback: ImportCallback) -> None:
        """Call ``callback(module)`` when ``name`` is imported, or now if it already is."""
        with self._lock:
            module = sys.modules.get(name)
            if module is None:
                self._hooks.setdefault(name, []).append(callback)
                return
        _safe_call(callback, module)

    def watched(self) -> set[str]:
        with self._lock:
            return set(self._hooks)

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._hooks:
            return None
        busy: set[str] = getattr(self._busy, "names", set())
        if fullname in busy:  # our own lookup below
            return None
        busy.add(fullname)
        self._busy.names = busy
        try:
            spec = importlib.util.find_spec(fullname)
        except (ImportError, ValueError):
            return None
        finally:
            busy.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _HookedLoader(spec.loader, self)
        return spec

    def fire(self, name: str, module: types.ModuleType) -> None:
        with self._lock:
            callbacks = self._hooks.pop(name, [])
        for callback in callbacks:
            _safe_call(callback, module)

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def uninstall(self) -> None:
        while self in sys.meta_path:
            sys.meta_path.remove(self)


def _safe_call(callback: ImportCallback, module: types.ModuleType) -> None:
    try:
        callback(module)
    except Exception as err:  # noqa: BLE001 -- a cap must never break the user's import
        print(f"gpupool: could not apply the GPU memory cap for {module.__name__}: {err}", file=sys.stderr)


# --------------------------------------------------------------------------------------------
# Freeing the frameworks' caches
# --------------------------------------------------------------------------------------------

#: A framework's freer: frees what it can, returns ``{"freed": bytes, "held": bytes}`` (either may be
#: absent), or None when the framework is not in use in this kernel.
CacheFreer = Callable[[], "dict[str, int] | None"]

_extra_freers: dict[str, CacheFreer] = {}
_freers_lock = threading.Lock()
#: How many times this process freed its frameworks' caches (``%gpupool status`` and tests read it).
requests_served = 0


def register_cache_freer(name: str, freer: CacheFreer) -> None:
    """Run ``freer`` with the built-in ones each time the caches are freed (a later one of the same name replaces it)."""
    with _freers_lock:
        _extra_freers[name] = freer


def _free_torch() -> dict[str, int] | None:
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available() or not cuda.is_initialized():
        return None
    devices = range(cuda.device_count())
    before = sum(int(cuda.memory_reserved(d)) for d in devices)
    cuda.empty_cache()
    after = sum(int(cuda.memory_reserved(d)) for d in devices)
    return {"freed": max(0, before - after), "held": sum(int(cuda.memory_allocated(d)) for d in devices)}


def _free_cupy() -> dict[str, int] | None:
    cupy = sys.modules.get("cupy")
    if cupy is None or not hasattr(cupy, "get_default_memory_pool"):
        return None
    pool = cupy.get_default_memory_pool()
    before = int(pool.total_bytes())
    pool.free_all_blocks()
    with contextlib.suppress(Exception):  # the pinned host pool: not GPU memory, but the same idea
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    return {"freed": max(0, before - int(pool.total_bytes())), "held": int(pool.used_bytes())}


def _free_jax() -> dict[str, int] | None:
    jax = sys.modules.get("jax")
    clear = getattr(jax, "clear_caches", None)
    if not callable(clear):
        return None
    clear()
    return {"freed": 0}


#: The built-in freers, by framework.
BUILT_IN_FREERS: dict[str, CacheFreer] = {"torch": _free_torch, "cupy": _free_cupy, "jax": _free_jax}


def free_framework_caches(_request: dict[str, Any] | None = None) -> dict[str, Any]:
    """Free every imported framework's cached GPU memory (before a checkpoint, when a slice shrinks,
    after a release); ``{"freed": bytes, "held": bytes or None, "frameworks": {name: {...} or
    {"error": ...}}}``. Only frameworks already using the GPU are touched: this never initialises
    CUDA. JAX does not hand its arena back while the process lives; its compilation caches are
    dropped. A framework that fails is reported, not raised. (Also the quiet channel's
    ``free_caches`` action: ``_request`` is its content, unused.)"""
    global requests_served
    with _freers_lock:
        freers = {**BUILT_IN_FREERS, **_extra_freers}
        requests_served += 1
    report: dict[str, Any] = {}
    freed, held, known = 0, 0, False
    for name, freer in freers.items():
        try:
            result = freer()
        except Exception as err:  # noqa: BLE001 -- one framework's trouble must not stop the others or the suspend
            report[name] = {"error": f"{type(err).__name__}: {err}".splitlines()[0]}
            continue
        if result is None:
            continue
        report[name] = dict(result)
        freed += int(result.get("freed", 0) or 0)
        if "held" in result:
            held += int(result["held"] or 0)
            known = True
    return {"freed": freed, "held": held if known else None, "frameworks": report}


# --------------------------------------------------------------------------------------------
# Caps
# --------------------------------------------------------------------------------------------


class FrameworkCaps:
    """Caps PyTorch, TensorFlow and CuPy at this kernel's slice (``GPUPOOL_MEMORY_LIMIT`` bytes per GPU)."""

    FRAMEWORKS: ClassVar[tuple[str, ...]] = ("torch", "tensorflow", "cupy", "jax")
    LABELS: ClassVar[dict[str, str]] = {"torch": "PyTorch", "tensorflow": "TensorFlow", "cupy": "CuPy", "jax": "JAX"}

    def __init__(self, limit: int | None, env: MutableMapping[str, str] | None = None) -> None:
        self.limit = limit
        self.env: MutableMapping[str, str] = os.environ if env is None else env
        self.records: dict[str, CapRecord] = {}
        self.finder = PostImportFinder()
        self.oom = OomHint(self)
        self._lock = threading.RLock()
        self._installed = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FrameworkCaps:
        source = os.environ if env is None else env
        raw = source.get("GPUPOOL_MEMORY_LIMIT", "").strip()
        limit = int(raw) if raw.isdigit() and int(raw) > 0 else None
        return cls(limit, env=os.environ if env is None else dict(env))

    # -- lifecycle ------------------------------------------------------------------------
    def install(self, shell: Any = None) -> None:
        """Hook the framework imports (applying at once to those already imported) and the OOM hint."""
        if shell is not None:
            self.oom.install(shell)
        if self._installed:
            return
        self._installed = True
        self.finder.install()
        self.finder.register("torch", self._on_torch)
        self.finder.register("tensorflow", self._on_tensorflow)
        self.finder.register("cupy", self._on_cupy)
        self.finder.register("jax", self._on_jax)

    def uninstall(self) -> None:
        self.finder.uninstall()
        self.oom.uninstall()
        self._installed = False

    def free_cache(self) -> dict[str, Any]:
        """Give the frameworks' cached, unused GPU memory back to the driver (see
        :func:`free_framework_caches`): the first step when the pool takes a slice's burst back."""
        return free_framework_caches()

    def move_live(self, content: dict[str, Any]) -> dict[str, Any]:
        """The server's ``set_caps`` quiet request (see :func:`jupyter_gpupool.quiet.install_quiet_requests`):
        free the frameworks' caches if asked, set the caps to the slice (``limit`` bytes per GPU),
        and say how much this process uses now. A bad request raises ValueError (one line back)."""
        try:
            limit = int(content["limit"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"bad caps request: {err}") from None
        if limit <= 0:
            raise ValueError("bad caps request: limit must be positive")
        if content.get("free_cache"):
            self.free_cache()
        gpu_memory = content.get("gpu_memory")
        self.set_limit(limit, int(gpu_memory) if gpu_memory else None)
        return {"limit": limit, "used": self.local_usage()}

    def set_limit(self, limit: int | None, gpu_memory: int | None = None) -> None:
        """The slice changed (``%gpupool reserve``): update the env for child processes and re-cap.

        ``gpu_memory`` is the smallest held GPU's memory; with it the fractions
        (``GPUPOOL_MEMORY_FRACTION``, ``XLA_PYTHON_CLIENT_MEM_FRACTION``) are computed as the
        provisioner computes them at start, else scaled from their old values.
        """
        with self._lock:
            old = self.limit
            self.limit = limit
        if limit is None:
            self.env.pop("GPUPOOL_MEMORY_LIMIT", None)
            return
        self.env["GPUPOOL_MEMORY_LIMIT"] = str(limit)
        if "CUPY_GPU_MEMORY_LIMIT" in self.env and not self.env["CUPY_GPU_MEMORY_LIMIT"].endswith("%"):
            self.env["CUPY_GPU_MEMORY_LIMIT"] = str(limit)
        for name in ("GPUPOOL_MEMORY_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION"):
            fraction = _new_fraction(self.env.get(name), old, limit, gpu_memory)
            if fraction is not None:
                self.env[name] = fraction
        # PyTorch and CuPy take a new limit at any time; TensorFlow and JAX (once started) do not.
        if "torch" in sys.modules:
            self._on_torch(sys.modules["torch"])
        if "cupy" in sys.modules:
            self._on_cupy(sys.modules["cupy"], resized=True)
        if "tensorflow" in sys.modules and old != limit:
            self._record(
                "tensorflow",
                TOO_LATE,
                f"still capped at {format_size(old)}: TensorFlow cannot change its limit; restart the kernel",
            )
        if "jax" in sys.modules and old != limit and self.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
            self._record(
                "jax",
                TOO_LATE,
                f"XLA_PYTHON_CLIENT_MEM_FRACTION is now {self.env['XLA_PYTHON_CLIENT_MEM_FRACTION']}, but JAX reads it"
                " only when its GPU backend starts; restart the kernel if JAX already used the GPU",
            )

    # -- per framework --------------------------------------------------------------------
    def _record(self, framework: str, status: str, detail: str) -> None:
        with self._lock:
            self.records[framework] = CapRecord(self.LABELS.get(framework, framework), status, detail)

    def _on_torch(self, torch: types.ModuleType) -> None:
        self.oom.add_type(getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None))
        cuda = getattr(torch, "cuda", None)
        limit = self.limit
        if cuda is None or not cuda.is_available():
            self._record("torch", NOT_NEEDED, "no CUDA: cap not needed")
            return
        if limit is None:
            self._record("torch", NOT_NEEDED, "no slice: not capped")
            return

        def apply() -> None:
            try:
                fractions = []
                for index in range(cuda.device_count()):
                    total = int(cuda.get_device_properties(index).total_memory)
                    fraction = min(1.0, limit / total)
                    cuda.set_per_process_memory_fraction(fraction, index)
                    fractions.append(f"{fraction:.3f} of {format_size(total)}")
                self._record(
                    "torch",
                    APPLIED,
                    f"caching allocator capped at {format_size(limit)} per GPU ({', '.join(fractions)});"
                    " checked per allocation, memory outside the allocator is not counted",
                )
            except Exception as err:  # noqa: BLE001 -- never break CUDA initialization
                self._record("torch", FAILED, f"could not cap: {err}")

        lazy_call = getattr(cuda, "_lazy_call", None)
        is_initialized = getattr(cuda, "is_initialized", None)
        if lazy_call is not None and is_initialized is not None and not is_initialized():
            self._record("torch", PENDING, f"cap of {format_size(limit)} per GPU applies when CUDA initializes")
            lazy_call(apply)
        else:
            apply()

    def _on_tensorflow(self, tf: types.ModuleType) -> None:
        errors = getattr(tf, "errors", None)
        self.oom.add_type(getattr(errors, "ResourceExhaustedError", None))
        limit = self.limit
        config = getattr(tf, "config", None)
        if config is None:
            self._record("tensorflow", FAILED, "tf.config not found: not capped")
            return
        gpus = config.list_physical_devices("GPU")
        if not gpus:
            self._record("tensorflow", NOT_NEEDED, "no CUDA: cap not needed")
            return
        if limit is None:
            self._record("tensorflow", NOT_NEEDED, "no slice: not capped")
            return
        megabytes = max(1, limit // MIB)
        try:
            for gpu in gpus:
                config.set_logical_device_configuration(
                    gpu, [config.LogicalDeviceConfiguration(memory_limit=megabytes)]
                )
        except RuntimeError as err:
            self._record("tensorflow", TOO_LATE, f"GPUs already initialized, not capped ({err}); restart the kernel")
            return
        self._record("tensorflow", APPLIED, f"memory_limit {megabytes} MiB on {gpu_count(len(gpus))}")

    def _on_cupy(self, cupy: types.ModuleType, resized: bool = False) -> None:
        memory = getattr(getattr(cupy, "cuda", None), "memory", None)
        self.oom.add_type(getattr(memory, "OutOfMemoryError", None))
        limit = self.limit
        is_available = getattr(cupy, "is_available", None)
        if is_available is not None and not is_available():
            self._record("cupy", NOT_NEEDED, "no CUDA: cap not needed")
            return
        if limit is None:
            self._record("cupy", NOT_NEEDED, "no slice: not capped")
            return
        if not resized and self.env.get("CUPY_GPU_MEMORY_LIMIT"):
            self._record(
                "cupy", ENV, f"memory pool capped by CUPY_GPU_MEMORY_LIMIT={self.env['CUPY_GPU_MEMORY_LIMIT']}"
            )
            return
        try:
            pool = cupy.get_default_memory_pool()
            for index in range(cupy.cuda.runtime.getDeviceCount()):
                with cupy.cuda.Device(index):
                    pool.set_limit(size=limit)
        except Exception as err:  # noqa: BLE001 -- never break the user's CuPy
            self._record("cupy", FAILED, f"could not cap: {err}")
            return
        self._record("cupy", APPLIED, f"memory pool capped at {format_size(limit)} per GPU")

    def _on_jax(self, jax: types.ModuleType) -> None:
        errors = getattr(jax, "errors", None)
        self.oom.add_type(getattr(errors, "JaxRuntimeError", None), needs="RESOURCE_EXHAUSTED")
        fraction = self.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
        if fraction:
            self._record(
                "jax", ENV, f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} (read when JAX starts its GPU backend)"
            )
        else:
            self._record("jax", NOT_NEEDED, "no XLA_PYTHON_CLIENT_MEM_FRACTION set: not capped")

    # -- reporting ------------------------------------------------------------------------
    def describe(self) -> list[str]:
        """One line per framework the kernel imported or capped through its environment."""
        with self._lock:
            lines = [record.describe() for record in self.records.values()]
        seen = set(self.records)
        if "cupy" not in seen and self.env.get("CUPY_GPU_MEMORY_LIMIT"):
            lines.append(f"CuPy (env): CUPY_GPU_MEMORY_LIMIT={self.env['CUPY_GPU_MEMORY_LIMIT']}")
        if "jax" not in seen and self.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
            lines.append(f"JAX (env): XLA_PYTHON_CLIENT_MEM_FRACTION={self.env['XLA_PYTHON_CLIENT_MEM_FRACTION']}")
        if not lines and self.limit is not None:
            lines.append("no GPU framework imported yet: PyTorch, TensorFlow and CuPy are capped when imported")
        return lines

    def local_usage(self) -> int | None:
        """Bytes this process's PyTorch / CuPy pools hold right now (None when unknown)."""
        total = 0
        known = False
        torch = sys.modules.get("torch")
        cuda = getattr(torch, "cuda", None)
        with contextlib.suppress(Exception):  # a broken driver must not break %gpupool status
            if cuda is not None and cuda.is_available() and cuda.is_initialized():
                total += sum(int(cuda.memory_reserved(i)) for i in range(cuda.device_count()))
                known = True
        cupy = sys.modules.get("cupy")
        with contextlib.suppress(Exception):
            if cupy is not None and cupy.is_available():
                total += int(cupy.get_default_memory_pool().total_bytes())
                known = True
        return total if known else None


# --------------------------------------------------------------------------------------------
# Out-of-memory hint
# --------------------------------------------------------------------------------------------


def _new_fraction(current: str | None, old: int | None, limit: int, gpu_memory: int | None) -> str | None:
    """A memory-fraction variable after a resize, formatted as the provisioner writes it (None: leave it)."""
    if not current:
        return None
    if gpu_memory and gpu_memory > 0:
        fraction = limit / gpu_memory
    elif old:
        try:
            fraction = float(current) * limit / old
        except ValueError:
            return None
    else:
        return None
    # As enforcement.memory_fraction: rounded down to 0.001, between 0.001 and 1.
    return f"{max(0.001, min(1.0, math.floor(fraction * 1000) / 1000)):.3f}"


def suggest_size(limit: int | None) -> str:
    """What to suggest in ``%gpupool reserve``: twice the slice, in a form parse_size accepts."""
    if not limit:
        return "8GiB"
    return format_size(2 * limit).replace(" ", "")


class OomHint:
    """Appends a line naming this kernel's slice to out-of-memory tracebacks (IPython custom exc)."""

    def __init__(self, caps: FrameworkCaps) -> None:
        self.caps = caps
        #: Set by the kernel extension when the slice is elastic: asks the pool to grow it.
        self.grow: GrowCallback | None = None
        self.types: list[tuple[type[BaseException], str | None]] = []
        self.shell: Any = None
        self._previous: tuple[tuple[type[BaseException], ...], Any] | None = None
        self._lock = threading.Lock()

    def install(self, shell: Any) -> None:
        self.shell = shell
        self._apply()

    def uninstall(self) -> None:
        shell, self.shell = self.shell, None
        if shell is None:
            return
        if (
            getattr(shell, "CustomTB", None) is not None
            and getattr(shell.CustomTB, "__func__", None) is self._handler_func()
        ):
            if self._previous is not None and self._previous[0]:
                shell.custom_exceptions, shell.CustomTB = self._previous
            else:
                shell.set_custom_exc((), None)

    def add_type(self, exc_type: Any, needs: str | None = None) -> None:
        """Treat ``exc_type`` as out-of-memory (only when its message contains ``needs``, if given)."""
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            return
        with self._lock:
            if any(t is exc_type for t, _ in self.types):
                return
            self.types.append((exc_type, needs))
        self._apply()

    def message(self, error: BaseException | None = None) -> str:
        limit = self.caps.limit
        live = error is not None and type(error).__module__.split(".")[0] in ("torch", "cupy", "cupy_backends")
        if limit is not None and self.grow is not None and error is not None and live:  # caps that follow a grow
            grown = self._try_grow(limit, error)
            if grown:
                return grown
        if limit is None:
            return "gpupool: this kernel has no GPU slice; ask for one with %gpupool reserve 8GiB"
        return (
            f"gpupool: this kernel's GPU slice is {format_size(limit)}; "
            f"ask for more with %gpupool reserve {suggest_size(limit)}"
        )

    def _try_grow(self, limit: int, error: BaseException) -> str:
        """Ask the pool to grow the slice by what the failed allocation wanted (PyTorch names it;
        else one more slice's worth); the line to show, or ``""`` to show the plain hint."""
        import re

        wanted = re.search(r"[Tt]ried to allocate (\d+(?:\.\d+)?) ?([KMGT]i?B)", str(error))
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
        extra = int(float(wanted.group(1)) * scale[wanted.group(2)[0]]) if wanted else limit
        used = self.local_usage_or(limit)
        assert self.grow is not None
        try:
            size = self.grow(used + extra)
        except Exception as refusal:  # noqa: BLE001 - RequestRefused with the pool's reason, or the pool unreachable
            return f"gpupool: this kernel's GPU slice is {format_size(limit)}; {refusal}"
        if size > limit:
            return f"gpupool: the slice was grown from {format_size(limit)} to {format_size(size)}: re-run the cell"
        return ""

    def local_usage_or(self, default: int) -> int:
        used = self.caps.local_usage()
        return used if used is not None else default

    def matches(self, value: BaseException) -> bool:
        for exc_type, needs in list(self.types):
            if isinstance(value, exc_type) and (needs is None or needs in str(value)):
                return True
        return False

    # The handler IPython calls: shows the normal traceback with our line appended.
    def _handler_func(self) -> Any:
        return getattr(self, "_bound_func", None)

    def _apply(self) -> None:
        shell = self.shell
        if shell is None or not self.types:
            return
        ours = tuple(t for t, _ in self.types)
        current_func = getattr(getattr(shell, "CustomTB", None), "__func__", None)
        if self._previous is None and current_func is not self._handler_func():
            existing = tuple(getattr(shell, "custom_exceptions", ()) or ())
            self._previous = (existing, shell.CustomTB if existing else None)
        previous_types = self._previous[0] if self._previous else ()
        hint = self

        def gpupool_custom_tb(sh: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> None:
            if not hint.matches(value):
                if hint._previous and hint._previous[1] is not None and isinstance(value, hint._previous[0]):
                    return hint._previous[1](etype, value, tb, tb_offset=tb_offset)
                sh.showtraceback((etype, value, tb), tb_offset=tb_offset)
                return None
            sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
            stb = sh.InteractiveTB.structured_traceback(etype, value, tb, tb_offset=tb_offset)
            stb = list(stb) + [f"\x1b[1;33m{hint.message(value)}\x1b[0m"]
            sh._showtraceback(etype, value, stb)
            return None

        shell.set_custom_exc(ours + tuple(t for t in previous_types if t not in ours), gpupool_custom_tb)
        self._bound_func = shell.CustomTB.__func__
