"""The kernel extension in real ipykernel kernels: load, framework caps through import hooks, OOM hint.

The helpers at the top (``pool_env``, ``Kernel``) are shared with test_magics.py and test_widget.py.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.enforcement.caps import (
    APPLIED,
    NOT_NEEDED,
    PENDING,
    TOO_LATE,
    FrameworkCaps,
    PostImportFinder,
    suggest_size,
)
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow

ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXTENSION = "--ext=jupyter_gpupool.kernel"


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


# ------------------------------------------------------------------------------------------------
# Shared helpers
# ------------------------------------------------------------------------------------------------


@dataclass
class PoolEnv:
    """A simulated pool in a temp dir, with one lease granted to the kernel under test."""

    pool: Pool
    env: dict[str, str]
    lease_id: str
    kernel_id: str
    tmp: Path

    def kernel_env(self, **extra: str) -> dict[str, str]:
        """The environment the provisioner would give the kernel."""
        base = {k: v for k, v in os.environ.items() if not k.startswith(("GPUPOOL_", "CUDA_", "XLA_", "CUPY_", "TF_"))}
        lease = self.pool.get(self.lease_id)
        env = {
            **base,
            **self.env,
            "GPUPOOL_LEASE_ID": lease.id,
            "GPUPOOL_KERNEL_ID": self.kernel_id,
            "GPUPOOL_OWNER": lease.owner,
            "CUDA_VISIBLE_DEVICES": ",".join(lease.devices),
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        if lease.state is LeaseState.GRANTED:
            env["GPUPOOL_MEMORY_LIMIT"] = str(lease.memory)
            env["CUPY_GPU_MEMORY_LIMIT"] = str(lease.memory)
        env.update(extra)
        return env


def make_pool_env(tmp_path: Path, memory: int = 4 * GIB, spec: str = "1x16GiB", owner: str = "alice") -> PoolEnv:
    env = {"GPUPOOL_SIMULATE": spec, "GPUPOOL_DB": str(tmp_path / "pool.sqlite"), "GPUPOOL_IDLE_TIMEOUT": "30m"}
    pool = Pool.from_env(environ=env)
    kernel_id = str(uuid.uuid4())
    lease = pool.request(
        LeaseRequest(
            owner=owner,
            memory=memory,
            kernel_id=kernel_id,
            holder_pid=os.getpid(),
            holder_host=socket.gethostname(),
            label="test kernel",
        )
    )
    return PoolEnv(pool=pool, env=env, lease_id=lease.id, kernel_id=kernel_id, tmp=tmp_path)


@pytest.fixture
def pool_env(tmp_path: Path) -> Iterator[PoolEnv]:
    penv = make_pool_env(tmp_path)
    assert penv.pool.get(penv.lease_id).state is LeaseState.GRANTED
    yield penv
    penv.pool.close()


@dataclass
class Result:
    """What one execute_request produced."""

    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> str:
        return str(self.reply["content"]["status"])

    def stream(self, name: str) -> str:
        return "".join(
            m["content"]["text"] for m in self.messages if m["msg_type"] == "stream" and m["content"]["name"] == name
        )

    @property
    def stdout(self) -> str:
        return self.stream("stdout")

    @property
    def errors(self) -> list[dict[str, Any]]:
        return [m["content"] for m in self.messages if m["msg_type"] == "error"]

    def error_text(self) -> str:
        return "\n".join(strip_ansi("\n".join(e["traceback"])) for e in self.errors)

    def data(self, mime: str) -> list[str]:
        return [
            m["content"]["data"][mime]
            for m in self.messages
            if m["msg_type"] in ("display_data", "update_display_data", "execute_result")
            and mime in m["content"]["data"]
        ]

    def plain(self) -> str:
        return "\n".join(self.data("text/plain"))

    def value(self) -> Any:
        """The execute_result's text/plain, evaluated (for small literals)."""
        import ast

        results = [m for m in self.messages if m["msg_type"] == "execute_result"]
        assert results, f"no execute_result: {self.messages}"
        return ast.literal_eval(results[-1]["content"]["data"]["text/plain"])

    def all_text(self) -> str:
        return strip_ansi("\n".join([self.stream("stdout"), self.stream("stderr"), self.plain(), self.error_text()]))


class Kernel:
    """A real ipykernel started like the provisioner does: ``--ext=jupyter_gpupool.kernel`` and the grant's env."""

    def __init__(self, env: dict[str, str], extension: bool = True) -> None:
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=env, extra_arguments=[EXTENSION] if extension else [])
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 60, allow_error: bool = False) -> Result:
        messages: list[dict[str, Any]] = []
        reply = self.kc.execute_interactive(textwrap.dedent(code), output_hook=messages.append, timeout=timeout)
        result = Result(reply=reply, messages=messages)
        if not allow_error:
            assert result.status == "ok", result.all_text()
        return result

    def submit(self, code: str) -> str:
        """Start executing without waiting; collect with :meth:`collect`."""
        return self.kc.execute(textwrap.dedent(code))

    def collect(self, msg_id: str, timeout: float = 60) -> Result:
        deadline = time.monotonic() + timeout
        messages: list[dict[str, Any]] = []
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no idle for {msg_id} within {timeout} s; got {messages}"
            msg = self.kc.get_iopub_msg(timeout=remaining)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            messages.append(msg)
        reply = self.kc.get_shell_msg(timeout=timeout)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = self.kc.get_shell_msg(timeout=timeout)
        return Result(reply=reply, messages=messages)

    def shutdown(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel_factory() -> Iterator[Any]:
    kernels: list[Kernel] = []

    def start(env: dict[str, str], extension: bool = True) -> Kernel:
        kernel = Kernel(env, extension=extension)
        kernels.append(kernel)
        return kernel

    yield start
    for kernel in kernels:
        kernel.shutdown()


FAKE_TORCH_INIT = "from . import cuda\n__version__ = '0.0-fake'\n"
FAKE_TORCH_CUDA = """
calls = []
_queued = []
_initialized = False
TOTAL = {total}

class OutOfMemoryError(RuntimeError):
    pass

class _Props:
    total_memory = TOTAL

def is_available():
    return True

def is_initialized():
    return _initialized

def device_count():
    return 1

def get_device_properties(index):
    return _Props()

def set_per_process_memory_fraction(fraction, device=None):
    calls.append((round(fraction, 6), device))

def memory_reserved(index=None):
    return 0

def empty_cache():
    pass

def _lazy_call(callback):
    if _initialized:
        callback()
    else:
        _queued.append(callback)

def init():
    # what torch.cuda._lazy_init does: initialize, then run the queued calls
    global _initialized
    _initialized = True
    for callback in _queued:
        callback()
    _queued.clear()
"""
FAKE_TF = """
configured = {}
_initialized = False

class errors:
    class ResourceExhaustedError(Exception):
        pass

class config:
    class LogicalDeviceConfiguration:
        def __init__(self, memory_limit=None):
            self.memory_limit = memory_limit

    @staticmethod
    def list_physical_devices(kind):
        return ["/physical_device:GPU:0"] if kind == "GPU" else []

    @staticmethod
    def set_logical_device_configuration(device, logical):
        if _initialized:
            raise RuntimeError("Virtual devices cannot be modified after being initialized")
        configured[device] = [c.memory_limit for c in logical]
"""


def with_path(directory: Path) -> str:
    """PYTHONPATH with ``directory`` first (the repository may be on it in a source checkout)."""
    return os.pathsep.join([str(directory), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]])


def write_fake_frameworks(root: Path, total: int = 16 * GIB) -> Path:
    """A fake ``torch`` (CUDA available, lazy init) and ``tensorflow`` package under ``root``."""
    (root / "torch" / "cuda").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(FAKE_TORCH_INIT)
    (root / "torch" / "cuda" / "__init__.py").write_text(FAKE_TORCH_CUDA.format(total=total))
    (root / "tensorflow").mkdir()
    (root / "tensorflow" / "__init__.py").write_text(FAKE_TF)
    return root


# ------------------------------------------------------------------------------------------------
# Import-hook mechanics, in this process (fast)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "mods"
    path.mkdir()
    sys.path.insert(0, str(path))
    names_before = set(sys.modules)
    yield path
    sys.path.remove(str(path))
    for name in set(sys.modules) - names_before:
        if name.startswith("gpupool_fakefw"):
            del sys.modules[name]


def test_post_import_hook_fires_once_after_the_module_ran(module_dir: Path) -> None:
    name = f"gpupool_fakefw_{uuid.uuid4().hex[:8]}"
    (module_dir / name).mkdir()
    (module_dir / name / "__init__.py").write_text("from . import sub\nVALUE = sub.X + 1\n")
    (module_dir / name / "sub.py").write_text("X = 41\n")
    seen: list[tuple[str, int]] = []
    finder = PostImportFinder()
    finder.install()
    try:
        finder.register(name, lambda mod: seen.append((mod.__name__, mod.VALUE)))
        module = __import__(name)
        __import__(name)  # a second import must not call back again
        assert seen == [(name, 42)]
        # The module keeps its real loader: resources and pkgutil still work.
        assert type(module.__loader__).__name__ == "SourceFileLoader"
        assert type(module.__spec__.loader).__name__ == "SourceFileLoader"
        assert finder.watched() == set()
    finally:
        finder.uninstall()
    assert finder not in sys.meta_path


def test_post_import_hook_on_already_imported_module_fires_at_once(module_dir: Path) -> None:
    name = f"gpupool_fakefw_{uuid.uuid4().hex[:8]}"
    (module_dir / f"{name}.py").write_text("VALUE = 1\n")
    __import__(name)
    seen: list[str] = []
    finder = PostImportFinder()
    finder.register(name, lambda mod: seen.append(mod.__name__))
    assert seen == [name]


def test_failed_import_does_not_fire_and_can_be_retried(module_dir: Path) -> None:
    name = f"gpupool_fakefw_{uuid.uuid4().hex[:8]}"
    path = module_dir / f"{name}.py"
    path.write_text("raise ImportError('broken install')\n")
    seen: list[str] = []
    finder = PostImportFinder()
    finder.install()
    try:
        finder.register(name, lambda mod: seen.append(mod.__name__))
        with pytest.raises(ImportError, match="broken install"):
            __import__(name)
        assert seen == []
        path.write_text("VALUE = 2\n")
        sys.modules.pop(name, None)
        import importlib

        importlib.invalidate_caches()
        __import__(name)
        assert seen == [name]
    finally:
        finder.uninstall()


def test_a_failing_callback_does_not_break_the_import(module_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    name = f"gpupool_fakefw_{uuid.uuid4().hex[:8]}"
    (module_dir / f"{name}.py").write_text("VALUE = 3\n")
    finder = PostImportFinder()
    finder.install()
    try:
        finder.register(name, lambda mod: 1 / 0)
        module = __import__(name)
        assert module.VALUE == 3
    finally:
        finder.uninstall()
    assert "could not apply the GPU memory cap" in capsys.readouterr().err


def fake_torch(available: bool = True, total: int = 16 * GIB, initialized: bool = False) -> types.ModuleType:
    calls: list[tuple[float, int]] = []
    queued: list[Any] = []
    cuda = types.SimpleNamespace(
        calls=calls,
        queued=queued,
        is_available=lambda: available,
        is_initialized=lambda: initialized,
        device_count=lambda: 2,
        get_device_properties=lambda i: types.SimpleNamespace(total_memory=total),
        set_per_process_memory_fraction=lambda f, d: calls.append((round(f, 6), d)),
        _lazy_call=queued.append,
        OutOfMemoryError=type("OutOfMemoryError", (RuntimeError,), {}),
    )
    module = types.ModuleType("torch")
    module.cuda = cuda  # type: ignore[attr-defined]
    return module


def test_torch_cap_is_queued_until_cuda_initializes_then_caps_every_device() -> None:
    caps = FrameworkCaps(4 * GIB, env={})
    torch = fake_torch()
    caps._on_torch(torch)
    assert caps.records["torch"].status == PENDING
    assert torch.cuda.calls == []  # importing torch did not create a CUDA context
    for callback in torch.cuda.queued:  # CUDA initializes
        callback()
    assert torch.cuda.calls == [(0.25, 0), (0.25, 1)]
    assert caps.records["torch"].status == APPLIED


def test_torch_cap_applies_at_once_when_cuda_is_already_up_and_follows_a_resize() -> None:
    env: dict[str, str] = {"CUPY_GPU_MEMORY_LIMIT": str(4 * GIB), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.250"}
    caps = FrameworkCaps(4 * GIB, env=env)
    torch = fake_torch(initialized=True)
    caps._on_torch(torch)
    assert torch.cuda.calls == [(0.25, 0), (0.25, 1)]
    sys.modules["torch"], saved = torch, sys.modules.get("torch")
    try:
        caps.set_limit(8 * GIB)
    finally:
        if saved is None:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved
    assert torch.cuda.calls[-2:] == [(0.5, 0), (0.5, 1)]
    assert env["GPUPOOL_MEMORY_LIMIT"] == str(8 * GIB)
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(8 * GIB)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.500"


def test_a_resize_updates_every_memory_variable_the_kernel_holds() -> None:
    """GPUPOOL_MEMORY_FRACTION and XLA's fraction follow the new slice, as the provisioner writes them."""
    env: dict[str, str] = {
        "GPUPOOL_MEMORY_LIMIT": str(4 * GIB),
        "GPUPOOL_MEMORY_FRACTION": "0.250",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.250",
        "CUPY_GPU_MEMORY_LIMIT": str(4 * GIB),
    }
    caps = FrameworkCaps(4 * GIB, env=env)
    caps.set_limit(12 * GIB, gpu_memory=16 * GIB)
    assert env == {
        "GPUPOOL_MEMORY_LIMIT": str(12 * GIB),
        "GPUPOOL_MEMORY_FRACTION": "0.750",
        "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.750",
        "CUPY_GPU_MEMORY_LIMIT": str(12 * GIB),
    }
    caps.set_limit(6 * GIB)  # no GPU size known: scaled from the old values
    assert env["GPUPOOL_MEMORY_FRACTION"] == "0.375" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.375"


def test_torch_without_cuda_records_that_no_cap_is_needed() -> None:
    caps = FrameworkCaps(4 * GIB, env={})
    torch = fake_torch(available=False)
    caps._on_torch(torch)
    assert caps.records["torch"].status == NOT_NEEDED
    assert caps.records["torch"].detail == "no CUDA: cap not needed"
    assert torch.cuda.queued == [] and torch.cuda.calls == []


def test_tensorflow_after_gpu_init_is_reported_too_late() -> None:
    caps = FrameworkCaps(4 * GIB, env={})

    def refuse(device: Any, logical: Any) -> None:
        raise RuntimeError("Virtual devices cannot be modified after being initialized")

    config = types.SimpleNamespace(
        list_physical_devices=lambda kind: ["GPU:0"],
        set_logical_device_configuration=refuse,
        LogicalDeviceConfiguration=lambda memory_limit: memory_limit,
    )
    tf = types.ModuleType("tensorflow")
    tf.config = config  # type: ignore[attr-defined]
    caps._on_tensorflow(tf)
    assert caps.records["tensorflow"].status == TOO_LATE
    assert "restart the kernel" in caps.records["tensorflow"].detail


def test_suggested_size_is_a_form_the_magic_accepts() -> None:
    from jupyter_gpupool.units import parse_size

    assert suggest_size(4 * GIB) == "8GiB"
    assert parse_size(suggest_size(3 * GIB + GIB // 2)) == 7 * GIB
    assert suggest_size(None) == "8GiB"


# ------------------------------------------------------------------------------------------------
# In real kernels
# ------------------------------------------------------------------------------------------------


def test_extension_loads_in_a_real_kernel_and_reports_the_granted_slice(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    result = kernel.run("%gpupool status")
    plain = result.plain()
    assert "4 GiB on GPU 0" in plain
    assert pool_env.lease_id in plain
    assert "granted" in plain
    html = "\n".join(result.data("text/html"))
    assert "<table>" in html and "4 GiB on GPU 0" in html
    # Loading the extension did not open the pool before it was needed, nor import any framework.
    # (A silent request runs no pre_run_cell hook; a cell does open the pool: it checks whether
    # the kernel is suspended, see kernel/resume.py.)
    fresh = kernel_factory(pool_env.kernel_env())
    probe = "sorted(m for m in ('torch', 'tensorflow', 'jupyter_gpupool.backends.local.pool') if m in sys.modules)"
    assert loaded_modules(fresh, probe) == []
    # A kernel the pool did not start (no lease) never opens it, whatever its cells do.
    unpooled = kernel_factory({k: v for k, v in pool_env.kernel_env().items() if k != "GPUPOOL_LEASE_ID"})
    unpooled.run("x = 1")
    assert loaded_modules(unpooled, probe) == []


def loaded_modules(kernel: Kernel, expression: str) -> Any:
    """``expression`` evaluated by a silent request (no cell hooks run), with ``sys`` imported."""
    import ast

    msg_id = kernel.kc.execute("import sys", silent=True, user_expressions={"probe": expression})
    reply = kernel.kc.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kernel.kc.get_shell_msg(timeout=60)
    value = reply["content"]["user_expressions"]["probe"]
    assert value["status"] == "ok", value
    return ast.literal_eval(value["data"]["text/plain"])


def test_fake_torch_and_tensorflow_are_capped_on_import_and_oom_gets_the_hint(
    pool_env: PoolEnv, kernel_factory: Any, tmp_path: Path
) -> None:
    fakes = write_fake_frameworks(tmp_path / "fakes")
    kernel = kernel_factory(pool_env.kernel_env(PYTHONPATH=with_path(fakes)))
    # Imported inside a function in another module: the hook catches imports anywhere.
    (fakes / "user_code.py").write_text("def load():\n    import torch\n    return torch\n")
    result = kernel.run(
        """
        import user_code
        torch = user_code.load()
        before = list(torch.cuda.calls)
        torch.cuda.init()          # CUDA initializes: the queued cap runs before any allocation
        (before, torch.cuda.calls)
        """
    )
    assert result.value() == ([], [(0.25, 0)])
    result = kernel.run("import tensorflow as tf; tf.configured")
    assert result.value() == {"/physical_device:GPU:0": [4096]}
    status = kernel.run("%gpupool status").plain()
    assert "PyTorch: caching allocator capped at 4 GiB per GPU" in status
    assert "TensorFlow: memory_limit 4096 MiB on 1 GPU" in status

    oom = kernel.run(
        "raise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 6.00 GiB')", allow_error=True
    )
    assert oom.status == "error"
    text = oom.error_text()
    assert "OutOfMemoryError" in text and "Tried to allocate 6.00 GiB" in text
    # The slice is elastic (the pool's default): the hint asked the pool for the 6 GiB PyTorch wanted.
    assert "gpupool: the slice was grown from 4 GiB to 6 GiB: re-run the cell" in text
    tf_oom = kernel.run("raise tf.errors.ResourceExhaustedError('OOM when allocating tensor')", allow_error=True)
    # TensorFlow's limit is fixed when it starts: no grow is asked for it, the hint names the slice.
    assert "this kernel's GPU slice is 6 GiB" in tf_oom.error_text()
    # Other errors keep their plain traceback.
    other = kernel.run("raise ValueError('not about memory')", allow_error=True)
    assert "ValueError" in other.error_text() and "GPU slice" not in other.error_text()


def test_framework_imported_before_the_extension_is_capped_when_it_loads(
    pool_env: PoolEnv, kernel_factory: Any, tmp_path: Path
) -> None:
    fakes = write_fake_frameworks(tmp_path / "fakes")
    kernel = kernel_factory(pool_env.kernel_env(PYTHONPATH=with_path(fakes)), extension=False)
    kernel.run("import torch; torch.cuda.init()")
    result = kernel.run("%load_ext jupyter_gpupool.kernel\ntorch.cuda.calls")
    assert result.value() == [(0.25, 0)]


def test_unload_removes_magic_hook_and_oom_hint(pool_env: PoolEnv, kernel_factory: Any, tmp_path: Path) -> None:
    fakes = write_fake_frameworks(tmp_path / "fakes")
    kernel = kernel_factory(pool_env.kernel_env(PYTHONPATH=with_path(fakes)))
    kernel.run("import torch")
    kernel.run("%unload_ext jupyter_gpupool.kernel")
    gone = kernel.run("%gpupool status", allow_error=True)
    assert gone.status == "error" and "gpupool" in gone.all_text()
    result = kernel.run(
        "import sys; [type(f).__name__ for f in sys.meta_path if type(f).__name__ == 'PostImportFinder']"
    )
    assert result.value() == []
    oom = kernel.run("raise torch.cuda.OutOfMemoryError('CUDA out of memory')", allow_error=True)
    assert "GPU slice" not in oom.error_text()


@pytest.mark.skipif(
    subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, check=False).returncode != 0,
    reason="torch not installed",
)
def test_real_torch_without_cuda_is_left_alone(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    result = kernel.run("import torch; float(torch.ones(3).sum())", timeout=120)
    assert result.value() == 3.0
    status = kernel.run("%gpupool status").plain()
    assert "PyTorch: no CUDA: cap not needed" in status
