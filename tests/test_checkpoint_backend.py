"""The checkpoint layer: suspend/resume through the CUDA driver (scripted fake cuda.core and NVML),
on a simulated pool across real processes, and where neither is possible."""

from __future__ import annotations

import fcntl
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from fake_cuda_checkpoint import CHECKPOINTED, FAILED, LOCKED, RUNNING, FakeCudaDriver, give_cuda_version, hex_uuid
from fake_pynvml import GIB, FakeGpu, FakeMig, FakeNvml

from jupyter_gpupool.core.models import Device
from jupyter_gpupool.devices import checkpointer_for
from jupyter_gpupool.devices.checkpoint import (
    CheckpointError,
    CheckpointSupport,
    CudaCheckpointer,
    NoCheckpointer,
    SimulatedCheckpointer,
    complete_mapping,
)
from jupyter_gpupool.devices.nvml import NvmlBackend
from jupyter_gpupool.devices.simulated import SimulatedBackend

# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """``sleepers`` grows real, idle processes to stand in for kernels (killed at the end)."""
    started: list[subprocess.Popen[bytes]] = []

    class Pids(list):
        def new(self) -> int:
            proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            started.append(proc)
            self.append(proc.pid)
            return proc.pid

    yield Pids()
    for proc in started:
        proc.kill()
        proc.wait(10)


def two_h100s() -> list[FakeGpu]:
    return [FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, uuid=hex_uuid(i), mig=False) for i in range(2)]


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """``host(gpus, driver="570.86.10", cuda=12080, **driver_options)`` installs a fake NVML and a
    fake cuda.core driving the same GPUs and returns ``(nvml, cuda, checkpointer)``."""
    backends: list[NvmlBackend] = []

    def make(gpus: list[FakeGpu] | None = None, driver: str = "570.86.10", cuda: int | None = 12080, **options):
        nvml = FakeNvml(gpus if gpus is not None else two_h100s(), driver_version=driver)
        if cuda is not None:
            give_cuda_version(nvml, cuda)
        nvml.install(monkeypatch)
        fake = FakeCudaDriver(nvml=nvml, **options)
        fake.install(monkeypatch)
        backend = NvmlBackend()
        backends.append(backend)
        checkpointer = checkpointer_for(backend)
        assert isinstance(checkpointer, CudaCheckpointer)
        return nvml, fake, checkpointer

    yield make
    for backend in backends:
        backend.close()


def one_line(error: pytest.ExceptionInfo[CheckpointError]) -> str:
    message = str(error.value)
    assert "\n" not in message and "Traceback" not in message
    assert message == error.value.reason
    return message


# --- the fake is faithful to cuda.core.checkpoint -----------------------------------------------------


def test_fake_has_the_real_cuda_core_checkpoint_surface():
    """Names and signatures as in NVIDIA/cuda-python cuda_core/cuda/core/checkpoint.py (1.2.x)."""
    process = FakeCudaDriver().modules["cuda.core.checkpoint"].Process
    def shape(method) -> str:  # the signature as written in the real source, annotations as text
        return str(inspect.signature(method)).replace("'", "")

    assert shape(process.__init__) == "(self, pid: int)"
    assert shape(process.lock) == "(self, timeout_ms: int = 0) -> None"
    assert shape(process.checkpoint) == "(self) -> None"
    assert shape(process.restore) == "(self, gpu_mapping: Mapping[Any, Any] | None = None) -> None"
    assert shape(process.unlock) == "(self) -> None"
    assert all(isinstance(getattr(process, p), property) for p in ("pid", "state", "restore_thread_id"))
    assert process.__slots__ == ("_pid",)
    with pytest.raises(TypeError, match="pid must be an int"):
        process("12")
    with pytest.raises(ValueError, match="pid must be a positive int"):
        process(0)
    with pytest.raises(TypeError, match="timeout_ms must be an int"):
        process(5).lock(1.5)


def test_fake_driver_follows_the_state_machine():
    fake = FakeCudaDriver()
    fake.add_process(42, {hex_uuid(0): GIB})
    process = fake.modules["cuda.core.checkpoint"].Process(42)
    cuda_error = fake.modules["cuda.core._utils.cuda_utils"].CUDAError
    assert process.state == "running"
    with pytest.raises(cuda_error, match="^CUDA_ERROR_ILLEGAL_STATE: "):
        process.checkpoint()
    process.lock()
    process.checkpoint()
    assert process.state == "checkpointed"
    with pytest.raises(ValueError, match="32 hex characters"):
        process.restore({"GPU-not-hex": hex_uuid(1)})  # cuda.core takes bare hex UUIDs only
    process.restore()
    assert process.state == "locked"
    process.unlock()
    assert fake.ops() == ["checkpoint", "lock", "checkpoint", "restore", "unlock"]  # the refused one too
    with pytest.raises(cuda_error, match="CUDA_ERROR_INVALID_VALUE"):
        fake.modules["cuda.core.checkpoint"].Process(43).lock()
    old = FakeCudaDriver(driver_version=(12, 4, 0))
    with pytest.raises(RuntimeError, match="not supported by the installed NVIDIA driver"):
        old.modules["cuda.core.checkpoint"].Process(1).state  # noqa: B018


# --- CudaCheckpointer: the happy path ---------------------------------------------------------------


def test_suspend_locks_then_checkpoints_and_frees_the_gpu(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: 6 * GIB})
    assert checkpointer.probe().supported
    assert checkpointer.state(pid) == "running"

    parked = checkpointer.suspend(pid, timeout=12.5)

    assert parked == 6 * GIB  # what NVML listed for the process before the checkpoint
    assert [c for c in fake.calls if c[0] != "cuInit"] == [("lock", pid, 12500), ("checkpoint", pid)]
    assert checkpointer.state(pid) == "suspended"
    assert fake.processes[pid].state == CHECKPOINTED
    assert nvml.gpus[0].memory_used == 0 and nvml.gpus[0].compute == []  # NVML sees the GPU freed


def test_resume_restores_then_unlocks(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: 2 * GIB})
    checkpointer.suspend(pid)
    fake.calls.clear()

    checkpointer.resume(pid)

    assert fake.calls == [("restore", pid, None), ("unlock", pid)]
    assert checkpointer.state(pid) == "running"
    assert nvml.gpus[0].memory_used == 2 * GIB


def test_resume_onto_another_gpu_passes_the_mapping_in_the_drivers_uuid_form(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    old, new = nvml.gpus[0].uuid, nvml.gpus[1].uuid
    fake.add_process(pid, {old: 3 * GIB})
    checkpointer.suspend(pid)

    checkpointer.resume(pid, {old: new})

    restore = next(c for c in fake.calls if c[0] == "restore")
    bare_old, bare_new = old.removeprefix("GPU-"), new.removeprefix("GPU-")
    assert restore == ("restore", pid, {bare_old: bare_new, bare_new: bare_old})  # every GPU named, one to one
    assert nvml.gpus[0].memory_used == 0 and nvml.gpus[1].memory_used == 3 * GIB
    assert checkpointer.state(pid) == "running"


def test_resume_of_a_running_process_is_a_no_op_but_a_move_is_refused(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    checkpointer.resume(pid)
    assert "restore" not in fake.ops()
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid, {nvml.gpus[0].uuid: nvml.gpus[1].uuid})
    assert one_line(error) == f"cannot move process {pid} onto other GPUs: it is not suspended"
    assert error.value.state == "running"


# --- CudaCheckpointer: every error path --------------------------------------------------------------


def test_lock_timeout_says_the_kernel_was_busy_and_leaves_it_running(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB}, busy_ms=5000)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid, timeout=0.3)
    assert 0.25 < time.monotonic() - start < 3  # waited for the lock timeout, not the busy work
    assert one_line(error) == (
        f"could not suspend process {pid}: it was busy on the GPU for the whole 0.3 s lock timeout; "
        "it keeps running, try again once its cell is done"
    )
    assert error.value.state == "running" and fake.processes[pid].state == RUNNING
    assert fake.ops(pid) == ["lock"]
    assert nvml.gpus[0].memory_used == GIB


def test_checkpoint_of_unified_memory_unlocks_and_says_why(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB}, uvm=True)
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid)
    message = one_line(error)
    assert message.startswith(f"the CUDA driver could not suspend process {pid} (it probably uses unified (managed)")
    assert message.endswith("; it keeps running on its GPU")
    assert fake.ops(pid) == ["lock", "checkpoint", "unlock"]
    assert fake.processes[pid].state == RUNNING and error.value.state == "running"


def test_a_checkpoint_failure_that_cannot_be_unlocked_reports_the_state(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    fake.fail("checkpoint", "CUDA_ERROR_OUT_OF_MEMORY")
    fake.fail("unlock", "CUDA_ERROR_ILLEGAL_STATE")
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid)
    assert "(CUDA_ERROR_OUT_OF_MEMORY: The API call failed because it was unable to allocate" in one_line(error)
    assert one_line(error).endswith("; it is left locked")
    assert error.value.state == "locked"
    checkpointer.resume(pid)  # a locked process is only unlocked
    assert fake.ops(pid)[-1] == "unlock" and fake.processes[pid].state == RUNNING


def test_lock_refused_by_the_driver(host, sleepers):
    _nvml, _fake, checkpointer = host()
    pid = sleepers.new()  # no CUDA context at all
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid)
    assert one_line(error).startswith(f"the CUDA driver could not lock process {pid} for suspending (CUDA_ERROR_INVALID_VALUE: ")
    assert one_line(error).endswith("; it keeps running")


def test_suspending_twice_says_it_is_already_suspended(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    checkpointer.suspend(pid)
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid)
    assert one_line(error) == f"cannot suspend process {pid}: it is already suspended"


def test_a_partial_mapping_is_completed_to_every_gpu_of_the_host(host, sleepers):
    """The driver needs every GPU it shows named, one to one; the caller names only what moves."""
    gpus = [FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, uuid=hex_uuid(i), mig=False) for i in range(4)]
    _nvml, fake, checkpointer = host(gpus)
    pid = sleepers.new()
    fake.add_process(pid, {gpus[0].uuid: GIB, gpus[1].uuid: 2 * GIB})
    checkpointer.suspend(pid)
    checkpointer.resume(pid, {gpus[0].uuid: gpus[2].uuid})
    bare = [g.uuid.removeprefix("GPU-") for g in gpus]
    restore = next(c for c in fake.calls if c[0] == "restore")
    assert restore[2] == {bare[0]: bare[2], bare[1]: bare[1], bare[2]: bare[0], bare[3]: bare[3]}
    assert [g.memory_used for g in gpus] == [0, 2 * GIB, GIB, 0]


@pytest.mark.parametrize(
    ("mapping", "full"),
    [
        ({"a": "b"}, {"a": "b", "b": "a", "c": "c", "d": "d"}),
        ({"a": "c", "b": "d"}, {"a": "c", "b": "d", "c": "a", "d": "b"}),
        ({"a": "a"}, {"a": "a", "b": "b", "c": "c", "d": "d"}),
        ({"a": "x"}, {"a": "x"}),  # names a GPU this host does not have: left for the driver to refuse
        ({}, {}),
    ],
)
def test_complete_mapping_is_one_to_one_over_the_host(mapping, full):
    completed = complete_mapping(mapping, ["a", "b", "c", "d"])
    assert completed == full
    assert len(set(completed.values())) == len(completed)


def test_a_mapping_that_sends_two_gpus_to_one_is_refused(host, sleepers):
    gpus = [FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, uuid=hex_uuid(i), mig=False) for i in range(3)]
    _nvml, fake, checkpointer = host(gpus)
    pid = sleepers.new()
    fake.add_process(pid, {gpus[0].uuid: GIB, gpus[1].uuid: GIB})
    checkpointer.suspend(pid)
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid, {gpus[0].uuid: gpus[2].uuid, gpus[1].uuid: gpus[2].uuid})
    assert one_line(error) == f"invalid gpu_mapping: it sends {gpus[0].uuid} and {gpus[1].uuid} all to {gpus[2].uuid}; one GPU each"
    assert "restore" not in fake.ops(pid) and checkpointer.state(pid) == "suspended"


def test_resume_onto_a_gpu_without_room_is_refused_before_the_driver_tries(host, sleepers):
    """A restore that runs out of memory can break the process for good (driver 580): check first."""
    nvml, fake, checkpointer = host()
    pid, other = sleepers.new(), sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: 50 * GIB})
    checkpointer.suspend(pid)
    fake.add_process(other, {nvml.gpus[0].uuid: 40 * GIB})  # someone took the GPU meanwhile
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid)
    assert one_line(error) == (
        f"cannot resume process {pid} onto GPU 0: it needs 50 GiB but the GPU has 40 GiB free; "
        "it stays suspended, try again when memory is free"
    )
    assert error.value.state == "suspended" and "restore" not in fake.ops(pid)
    checkpointer.resume(pid, {nvml.gpus[0].uuid: nvml.gpus[1].uuid})  # the other GPU has room
    assert checkpointer.state(pid) == "running"


def test_restore_failure_that_leaves_the_process_checkpointed(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    checkpointer.suspend(pid)
    fake.fail("restore", "CUDA_ERROR_OPERATING_SYSTEM")
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid)
    message = one_line(error)
    assert message.startswith(f"the CUDA driver could not resume process {pid} (CUDA_ERROR_OPERATING_SYSTEM: ")
    assert "it stays suspended with its memory in host RAM" in message
    assert error.value.state == "suspended" and fake.processes[pid].state == CHECKPOINTED
    assert "unlock" not in fake.ops(pid)
    checkpointer.resume(pid)  # a retry works on this driver
    assert checkpointer.state(pid) == "running"


def test_restore_failure_that_loses_the_process(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    checkpointer.suspend(pid)
    fake.fail("restore", "CUDA_ERROR_ILLEGAL_STATE", then_state=FAILED)
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid)
    assert one_line(error).endswith("; its GPU state is lost; restart the kernel")
    assert error.value.state == "failed" and checkpointer.state(pid) == "failed"
    with pytest.raises(CheckpointError, match="reports its GPU state as failed; restart the kernel"):
        checkpointer.resume(pid)


def test_unlock_failure_after_restore_is_retried_by_the_next_resume(host, sleepers):
    nvml, fake, checkpointer = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: GIB})
    checkpointer.suspend(pid)
    fake.fail("unlock", "CUDA_ERROR_NOT_INITIALIZED")
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid)
    assert one_line(error).endswith("; it is left locked, try resuming again")
    assert error.value.state == "locked" and checkpointer.state(pid) == "locked"
    fake.calls.clear()
    checkpointer.resume(pid)
    assert fake.calls == [("unlock", pid)]


def test_a_process_that_exited_is_gone(host, sleepers):
    _nvml, _fake, checkpointer = host()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    assert checkpointer.state(proc.pid) == "gone"
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(proc.pid)
    assert one_line(error) == f"cannot suspend process {proc.pid}: it has exited" and error.value.state == "gone"
    with pytest.raises(CheckpointError, match="it has exited"):
        checkpointer.resume(proc.pid)


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda c: c.suspend(0), "cannot suspend or resume process 0: expected a positive process id"),
        (lambda c: c.suspend(True), "expected a positive process id"),
        (lambda c: c.suspend(os.getpid(), timeout=0), "invalid suspend timeout 0: expected a positive number of seconds"),
        (lambda c: c.suspend(os.getpid(), timeout=float("nan")), "invalid suspend timeout nan"),
        (lambda c: c.resume(os.getpid(), {"GPU-a": 3}), "invalid gpu_mapping: expected a mapping of old GPU uuid"),
        (lambda c: c.resume(os.getpid(), ["GPU-a"]), "invalid gpu_mapping"),
    ],
)
def test_bad_arguments_are_one_line_errors_that_touch_nothing(host, call, says):
    _nvml, fake, checkpointer = host()
    with pytest.raises(CheckpointError) as error:
        call(checkpointer)
    assert says in one_line(error)
    assert [c for c in fake.calls if c[0] != "cuInit"] == []


# --- CudaCheckpointer: probing ----------------------------------------------------------------------


def test_probe_when_supported_names_the_driver_and_is_cached(host):
    nvml, fake, checkpointer = host()
    support = checkpointer.probe()
    assert support == CheckpointSupport(True, "cuda", "CUDA checkpoint API (driver 570.86.10, cuda.core 1.2.2)", "570.86.10")
    assert support.to_json() == {
        "supported": True,
        "backend": "cuda",
        "reason": "CUDA checkpoint API (driver 570.86.10, cuda.core 1.2.2)",
        "driver_version": "570.86.10",
    }
    assert ("cuInit", 0) in fake.calls  # the restoring process needs its own cuInit
    asked = nvml.calls["nvmlSystemGetCudaDriverVersion_v2"]
    assert checkpointer.probe() is support
    assert nvml.calls["nvmlSystemGetCudaDriverVersion_v2"] == asked == 1


def test_probe_without_cuda_core_says_how_to_install_it(host, monkeypatch):
    _nvml, _fake, checkpointer = host()
    monkeypatch.setitem(sys.modules, "cuda.core.checkpoint", None)  # as if not installed
    support = checkpointer.probe()
    assert not support.supported and support.backend == "cuda"
    assert support.reason.startswith("cuda-core is not installed (")
    assert support.reason.endswith("): pip install jupyter-gpupool[cuda] to suspend kernels")
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(os.getpid())
    assert "pip install jupyter-gpupool[cuda]" in one_line(error) and error.value.state == "running"
    assert checkpointer.state(os.getpid()) == ""  # not known: no driver could be asked


def test_probe_with_an_old_driver(host):
    _nvml, fake, checkpointer = host(driver="550.54.15", cuda=12040)
    support = checkpointer.probe()
    assert support == CheckpointSupport(
        False,
        "cuda",
        "NVIDIA driver 550.54.15 is older than 570: suspending kernels needs the CUDA checkpoint API of driver 570 "
        "or newer; upgrade the driver",
        "550.54.15",
    )
    assert fake.calls == []  # never asked the driver


def test_probe_with_an_old_cuda_api(host):
    _nvml, _fake, checkpointer = host(driver="570.00.01", cuda=12040)
    assert checkpointer.probe().reason.startswith("the NVIDIA driver offers CUDA 12.4, older than 12.8: ")


def test_probe_when_cuda_core_says_the_driver_cannot(host):
    _nvml, _fake, checkpointer = host(cuda=None, driver_version=(12, 4, 0))
    support = checkpointer.probe()
    assert not support.supported
    assert support.reason == (
        "the CUDA checkpoint API is not usable here: CUDA checkpointing is not supported by the installed NVIDIA "
        "driver. Upgrade to a driver version with CUDA checkpoint API support."
    )


def test_probe_when_cuinit_fails(host):
    _nvml, fake, checkpointer = host()
    fake.init_error = "CUDA_ERROR_NOT_INITIALIZED"
    support = checkpointer.probe()
    assert not support.supported and support.reason == "the CUDA driver cannot start here: cuInit failed: CUDA_ERROR_NOT_INITIALIZED"


def test_a_resume_whose_driver_cannot_start_leaves_the_process_suspended(host, sleepers):
    """A failed ``cuInit`` means the driver never touched the process: a resume leaves it as it was
    (suspended, its memory parked), a suspend leaves it running; its state is not guessed."""
    _nvml, fake, checkpointer = host()
    fake.init_error = "CUDA_ERROR_NOT_INITIALIZED"
    pid = sleepers.new()
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(pid)
    assert one_line(error) == f"cannot resume process {pid}: the CUDA driver cannot start here: cuInit failed: CUDA_ERROR_NOT_INITIALIZED"
    assert error.value.state == "suspended"
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(pid)
    assert error.value.state == "running" and "cuInit failed" in one_line(error)
    assert checkpointer.state(pid) == ""  # not "running": the driver could not be asked
    assert [c[0] for c in fake.calls] == ["cuInit"]  # nothing but the failed start


def test_mig_instances_cannot_be_suspended(host):
    gpus = [
        FakeGpu("NVIDIA A100-PCIE-40GB", 40 * GIB, uuid=hex_uuid(0), mig=True, mig_slots=[FakeMig("3g.20gb", 20 * GIB)]),
        FakeGpu("NVIDIA A100-PCIE-40GB", 40 * GIB, uuid=hex_uuid(1), mig=False),
    ]
    _nvml, _fake, checkpointer = host(gpus)
    devices = checkpointer.backend.devices()
    mig = [d for d in devices if d.is_mig]
    whole = [d for d in devices if not d.is_mig]
    assert checkpointer.supports_devices(whole) == ""
    assert checkpointer.supports_devices(mig) == (
        "GPU 0 (NVIDIA A100-PCIE-40GB MIG 3g.20gb) is a MIG instance: the CUDA checkpoint API does not support MIG, "
        "so this kernel cannot be suspended"
    )


def test_supports_devices_gives_the_probe_reason_when_unsupported(host):
    _nvml, _fake, checkpointer = host(driver="535.104.05")
    assert checkpointer.supports_devices(checkpointer.backend.devices()).startswith("NVIDIA driver 535.104.05 is older than 570")


# --- which checkpointer, and none ----------------------------------------------------------------------


def test_checkpointer_for_each_backend(tmp_path):
    simulated = SimulatedBackend.from_spec("1x16GiB")
    simulated.usage_dir = str(tmp_path)
    assert isinstance(checkpointer_for(simulated), SimulatedCheckpointer)
    assert checkpointer_for(simulated).probe().supported

    class Remote:
        name = "remote"

    class Odd:
        name = "odd"

    remote = checkpointer_for(Remote())
    assert isinstance(remote, NoCheckpointer)
    assert remote.probe() == CheckpointSupport(
        False, "none", "a broker's device backend is not on this host: give the server a local backend of its kind"
    )
    assert checkpointer_for(Odd()).probe().reason == "the odd device backend cannot suspend kernels"
    with pytest.raises(CheckpointError) as error:
        checkpointer_for(Odd()).suspend(os.getpid())
    assert one_line(error) == f"cannot suspend process {os.getpid()}: the odd device backend cannot suspend kernels"
    with pytest.raises(CheckpointError, match="cannot resume"):
        checkpointer_for(Odd()).resume(os.getpid())
    assert checkpointer_for(Odd()).state(os.getpid()) == "running"
    assert checkpointer_for(Odd()).supports_devices([]) == "the odd device backend cannot suspend kernels"


# --- the simulated checkpointer across real processes ---------------------------------------------------

KERNEL = """
import sys, time
from jupyter_gpupool.devices.simulated import pretend_to_use
print(pretend_to_use(sys.argv[1]), flush=True)
for line in sys.stdin:
    try:
        pretend_to_use(line.strip())
        print("done", time.monotonic(), flush=True)
    except Exception as exc:
        print("error", type(exc).__name__, exc, flush=True)
"""


class SimKernel:
    """A real child process that scripts its GPU usage like a kernel on a simulated pool."""

    def __init__(self, env: dict[str, str], first: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", KERNEL, first], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.proc.pid
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline().strip()

    def use(self, size: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(size + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> str | None:
        """The child's next line, or None if it prints nothing within ``timeout`` s (blocked)."""
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                return None
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def simpool(tmp_path) -> Iterator:
    """``(backend, checkpointer, start_kernel)`` on a simulated 2-GPU pool with a real usage folder."""
    db = str(tmp_path / "pool.sqlite")
    backend = SimulatedBackend.from_spec("2x16GiB")
    backend.usage_dir = f"{db}.usage"
    checkpointer = checkpointer_for(backend)
    kernels: list[SimKernel] = []

    def start(first: str = "2GiB", gpu: int = 0) -> SimKernel:
        env = {
            **os.environ,
            "GPUPOOL_SIMULATE": "2x16GiB",
            "GPUPOOL_DB": db,
            "CUDA_VISIBLE_DEVICES": backend.devices()[gpu].uuid,
        }
        env.pop("GPUPOOL_SIMULATE_USAGE_DIR", None)
        kernel = SimKernel(env, first)
        kernels.append(kernel)
        return kernel

    yield backend, checkpointer, start
    for kernel in kernels:
        kernel.close()


def usage_of(backend: SimulatedBackend, pid: int) -> dict[str, int]:
    return {u.device_uuid: u.used_memory for u in backend.process_usage() if u.pid == pid}


def test_a_suspended_kernel_blocks_on_its_next_gpu_use_and_goes_on_after_resume(simpool):
    backend, checkpointer, start = simpool
    gpu0, gpu1 = (d.uuid for d in backend.devices())
    kernel = start("2GiB")
    assert kernel.first == str(2 * GIB)
    assert usage_of(backend, kernel.pid) == {gpu0: 2 * GIB}

    assert checkpointer.suspend(kernel.pid) == 2 * GIB
    assert checkpointer.state(kernel.pid) == "suspended"
    assert usage_of(backend, kernel.pid) == {}  # parked: the GPU is free
    assert backend.devices()[0].memory_free == 16 * GIB

    kernel.use("3GiB")
    assert kernel.answer(timeout=1.5) is None  # blocked, as a CUDA call on a locked process is
    resumed_at = time.monotonic()
    checkpointer.resume(kernel.pid, {gpu0: gpu1})
    answer = kernel.answer(timeout=10)
    assert answer is not None and answer.startswith("done ")
    assert float(answer.split()[1]) >= resumed_at - 0.05  # it went on only after the resume
    assert checkpointer.state(kernel.pid) == "running"
    assert usage_of(backend, kernel.pid) == {gpu1: 3 * GIB}  # on the GPU it was moved to


def test_resume_without_mapping_brings_the_usage_back_where_it_was(simpool):
    backend, checkpointer, start = simpool
    gpu0 = backend.devices()[0].uuid
    kernel = start("1GiB")
    checkpointer.suspend(kernel.pid)
    checkpointer.resume(kernel.pid)
    assert usage_of(backend, kernel.pid) == {gpu0: GIB}
    kernel.use("1GiB")
    assert (kernel.answer(timeout=10) or "").startswith("done")


def test_a_kernel_that_used_no_gpu_memory_suspends_with_0_bytes_and_still_blocks(simpool):
    _backend, checkpointer, start = simpool
    kernel = start("0")
    assert checkpointer.suspend(kernel.pid) == 0
    kernel.use("1GiB")
    assert kernel.answer(timeout=1.0) is None
    checkpointer.resume(kernel.pid)
    assert (kernel.answer(timeout=10) or "").startswith("done")


def test_injected_suspend_failure_from_another_process_leaves_the_kernel_running(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    subprocess.run(
        [
            sys.executable,
            "-c",
            (
                "import sys; from jupyter_gpupool.devices.checkpoint import SimulatedCheckpointer as S; "
                "S.fail_next(sys.argv[1], 'suspend', 'host RAM is full')"
            ),
            backend.usage_dir,
        ],
        check=True,
        timeout=60,
    )
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(kernel.pid)
    assert one_line(error) == f"could not suspend process {kernel.pid}: host RAM is full"
    assert error.value.state == "running" and checkpointer.state(kernel.pid) == "running"
    assert usage_of(backend, kernel.pid) == {backend.devices()[0].uuid: GIB}
    kernel.use("2GiB")
    assert (kernel.answer(timeout=10) or "").startswith("done")  # not blocked
    assert checkpointer.suspend(kernel.pid) == 2 * GIB  # one-shot: the next one works


def test_injected_resume_failure_leaves_the_kernel_suspended_then_a_retry_works(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    checkpointer.suspend(kernel.pid)
    SimulatedCheckpointer.fail_next(backend.usage_dir, "resume", "restore timed out")
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid)
    assert one_line(error) == f"could not resume process {kernel.pid}: restore timed out; it stays suspended, try again"
    assert error.value.state == "suspended" and checkpointer.state(kernel.pid) == "suspended"
    checkpointer.resume(kernel.pid)
    assert checkpointer.state(kernel.pid) == "running"


def test_injected_resume_failure_that_loses_the_memory_surfaces_in_the_kernel(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    checkpointer.suspend(kernel.pid)
    kernel.use("1GiB")
    assert kernel.answer(timeout=0.5) is None
    SimulatedCheckpointer.fail_next(backend.usage_dir, "resume", "GPU fell off the bus", state="failed")
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid)
    assert one_line(error).endswith("GPU fell off the bus; its GPU memory is lost, restart the kernel")
    assert error.value.state == "failed" and checkpointer.state(kernel.pid) == "failed"
    answer = kernel.answer(timeout=10) or ""
    assert answer.startswith("error CheckpointError this kernel's GPU memory was lost when resuming it (GPU fell off the bus)")
    with pytest.raises(CheckpointError, match="restart the kernel"):
        checkpointer.resume(kernel.pid)


def test_fail_next_refuses_unknown_actions(tmp_path):
    with pytest.raises(CheckpointError, match="invalid action 'pause': expected suspend or resume"):
        SimulatedCheckpointer.fail_next(str(tmp_path), "pause")
    assert os.listdir(tmp_path) == []


def test_a_kernel_busy_writing_its_usage_makes_suspend_time_out(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    with open(os.path.join(backend.usage_dir, f"{kernel.pid}.lock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a usage write in flight holds it
        begun = time.monotonic()
        with pytest.raises(CheckpointError) as error:
            checkpointer.suspend(kernel.pid, timeout=0.3)
        assert 0.25 < time.monotonic() - begun < 3
    assert "busy on the GPU for the whole 0.3 s lock timeout" in one_line(error)
    assert checkpointer.state(kernel.pid) == "running"


def test_simulated_mapping_errors_leave_the_kernel_suspended(simpool):
    backend, checkpointer, start = simpool
    gpu0, gpu1 = (d.uuid for d in backend.devices())
    kernel = start("12GiB")
    other = start("10GiB", gpu=1)
    checkpointer.suspend(kernel.pid)
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid, {gpu0: gpu1, gpu1: gpu1})
    assert one_line(error) == f"invalid gpu_mapping: it sends {gpu0} and {gpu1} all to {gpu1}; one GPU each"
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid, {gpu0: "GPU-nowhere"})
    assert one_line(error) == f"cannot resume process {kernel.pid} onto GPU-nowhere: no such GPU in this pool"
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid, {gpu0: gpu1})
    assert one_line(error) == (
        f"cannot resume process {kernel.pid} onto {gpu1}: it needs 12 GiB but the GPU has 6 GiB free; it stays suspended"
    )
    assert checkpointer.state(kernel.pid) == "suspended"
    assert other.first == str(10 * GIB)
    checkpointer.resume(kernel.pid)
    assert usage_of(backend, kernel.pid) == {gpu0: 12 * GIB}


def test_resume_in_place_waits_while_others_took_the_gpu(simpool):
    backend, checkpointer, start = simpool
    gpu0 = backend.devices()[0].uuid
    kernel = start("10GiB")
    checkpointer.suspend(kernel.pid)
    other = start("8GiB")  # takes the freed GPU meanwhile
    with pytest.raises(CheckpointError) as error:
        checkpointer.resume(kernel.pid)
    assert one_line(error) == (
        f"cannot resume process {kernel.pid} onto {gpu0}: it needs 10 GiB but the GPU has 8 GiB free; it stays suspended"
    )
    assert checkpointer.state(kernel.pid) == "suspended"
    other.use("0")
    assert (other.answer(timeout=10) or "").startswith("done")
    checkpointer.resume(kernel.pid)
    assert usage_of(backend, kernel.pid) == {gpu0: 10 * GIB}


def test_in_process_usage_is_parked_too(tmp_path, sleepers):
    backend = SimulatedBackend.from_spec("1x16GiB")
    backend.usage_dir = str(tmp_path / "usage")
    checkpointer = SimulatedCheckpointer(backend.usage_dir, backend)
    pid = sleepers.new()
    uuid = backend.devices()[0].uuid
    backend.set_usage(pid, uuid, 5 * GIB)
    assert checkpointer.suspend(pid) == 5 * GIB
    assert backend.process_usage() == []
    checkpointer.resume(pid)
    assert [(u.pid, u.used_memory) for u in backend.process_usage()] == [(pid, 5 * GIB)]


def test_a_suspended_kernel_that_exits_leaves_nothing_parked(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    checkpointer.suspend(kernel.pid)
    kernel.close()
    assert checkpointer.state(kernel.pid) == "gone"
    assert not [f for f in os.listdir(backend.usage_dir) if f.startswith(f"{kernel.pid}.")]
    with pytest.raises(CheckpointError, match="it has exited"):
        checkpointer.resume(kernel.pid)


def test_simulated_pool_without_a_usage_folder_cannot_suspend():
    checkpointer = checkpointer_for(SimulatedBackend.from_spec("1x16GiB"))
    assert not checkpointer.probe().supported
    with pytest.raises(CheckpointError) as error:
        checkpointer.suspend(os.getpid())
    assert "has no usage folder" in one_line(error)
    assert checkpointer.supports_devices([Device(0, "GPU-x", "T4", GIB)]).startswith("this simulated pool has no usage folder")


def test_marker_files_are_json_the_lead_can_read(simpool):
    backend, checkpointer, start = simpool
    kernel = start("1GiB")
    checkpointer.suspend(kernel.pid)
    with open(os.path.join(backend.usage_dir, f"{kernel.pid}.suspended.json")) as handle:
        marker = json.load(handle)
    assert marker["state"] == "suspended" and marker["bytes"] == GIB
    assert LOCKED == 1  # the fake's numbering is the driver's CUprocessState


# --- the GPU check drives the product's checkpointer ----------------------------------------------------


def test_gpu_suspend_check_uses_the_product_checkpointer(host, sleepers):
    """tests/gpu's suspend check goes through CudaCheckpointer when cuda.core is usable (here: the
    fake), and its kernel code compiles; on a GPU it runs the same calls for real."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    try:
        from gpucheck.checks import suspend as check
    finally:
        sys.path.pop(0)
    nvml, fake, _ = host()
    pid = sleepers.new()
    fake.add_process(pid, {nvml.gpus[0].uuid: 8 * GIB})
    mover = check._Mover(lambda message: None)
    try:
        assert mover.product is not None and mover.via.startswith("jupyter_gpupool CudaCheckpointer (CUDA checkpoint API")
        assert mover.suspend(pid) == 8 * GIB
        assert mover.state(pid) == "suspended" and nvml.gpus[0].memory_used == 0
        mover.rescue(pid)  # the clean-up path resumes a kernel left suspended
        assert mover.state(pid) == "running" and nvml.gpus[0].memory_used == 8 * GIB
        assert fake.ops(pid) == ["lock", "checkpoint", "restore", "unlock"]
        assert ("lock", pid, int(check.LOCK_TIMEOUT_S * 1000)) in fake.calls
    finally:
        mover.close()
    for name, code in {"fill": check._fill(8), "while": check.WHILE_SUSPENDED, "verify": check.VERIFY}.items():
        compile(code, name, "exec")


def _gpu_check(name: str):
    """A module of tests/gpu's checks (``gpucheck.checks.<name>``)."""
    import importlib
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    try:
        return importlib.import_module(f"gpucheck.checks.{name}")
    finally:
        sys.path.pop(0)


# Speaks the power check's child protocol without a GPU; the fake driver holds its "context".
POWER_STAND_IN = r"""
import json, sys
print(json.dumps({"event": "ready", "bytes": int(sys.argv[1]) * 2**30}), flush=True)
for line in sys.stdin:
    if line.strip() != "check":
        break
    print(json.dumps({"event": "checked", "intact": True}), flush=True)
"""


@pytest.fixture
def power_check(host, tmp_path):
    """``run(on_start=None, stand_in=..., **host_options)`` runs tests/gpu's power check against the fake NVML
    and cuda.core with a stand-in child (short windows); returns ``(result, nvml, fake, child)``."""
    power = _gpu_check("power")
    from gpucheck.checks import Context, Options
    from gpucheck.probe import Probe

    children: list[subprocess.Popen[str]] = []

    def run(on_start=None, stand_in=POWER_STAND_IN, **options):
        nvml, fake, _ = host(**options)

        def start(ctx, gib, gpu):
            with open(ctx.workdir / power.CHILD_LOG, "w") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-c", stand_in, str(gib)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                )
            children.append(proc)
            fake.add_process(proc.pid, {gpu: gib * GIB})
            if on_start is not None:
                on_start(fake)
            return proc

        ctx = Context(name="power", options=Options(), probe=Probe(), workdir=tmp_path)
        timing = power.Timing(sample_s=0.3, interval_s=0.05, settle_s=0, baseline_settle_s=0, ready_s=30, released_s=2)
        opened = nvml.init_count  # the host's own backend holds NVML open
        result = power.measure(ctx, start_child=start, timing=timing)
        assert nvml.init_count == opened  # the check shut down every nvmlInit it made
        return result, nvml, fake, children[0] if children else None

    yield run
    for proc in children:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_gpu_power_check_suspends_through_the_product_and_compares_the_medians(power_check):
    """The power check drives the product's CudaCheckpointer; the fake GPU draws 40 W per live
    context over 72 W idle, so suspended must come back to the baseline. It reads, never sets."""
    result, nvml, fake, child = power_check()
    assert result.status.value == "pass", result.detail
    verdict = result.data["verdict"]
    assert (verdict["baseline_w"], verdict["idle_w"], verdict["suspended_w"]) == (72.0, 112.0, 72.0)
    assert verdict["saved_w"] == 40.0 and verdict["within"] is True
    assert result.number == "baseline 72.0 W, idle context 112.0 W, suspended 72.0 W"
    assert "persistence on" in result.detail and "P-states P0/P0/P0" in result.detail
    assert "via jupyter_gpupool CudaCheckpointer" in result.detail and "8.00 GiB freed" in result.detail
    assert result.data["bytes_parked"] == 8 * GIB and result.data["process_bytes_suspended"] == 0
    assert fake.ops(child.pid) == ["lock", "checkpoint", "restore", "unlock"]
    assert child.wait(10) == 0  # ended once it had read its memory back
    assert not [name for name in nvml.calls if "Set" in name]  # no GPU setting touched


def test_gpu_power_check_fails_when_the_suspended_gpu_draws_more_than_the_baseline(power_check):
    """Another context on the GPU during the run keeps the suspended window high: a fail row
    that says by how much and names the other process."""
    result, _nvml, _fake, child = power_check(on_start=lambda fake: fake.add_process(4_000_000, {hex_uuid(0): GIB}))
    assert result.status.value == "fail"
    assert result.data["verdict"]["suspended_w"] == 112.0 and result.data["verdict"]["within"] is False
    assert "suspended NOT within 5.0 W of the baseline (+40.0 W)" in result.detail
    assert "other GPU processes [4000000]" in result.detail
    assert child.wait(10) == 0


def test_gpu_power_check_fails_on_a_refused_checkpoint_and_leaves_the_child_running(power_check):
    def refuse(fake):
        fake.fail("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", then_state=LOCKED)

    result, _nvml, fake, child = power_check(on_start=refuse)
    assert result.status.value == "fail", result.detail
    assert result.detail.startswith(f"CheckpointError: the CUDA driver could not suspend process {child.pid}")
    assert "suspended" not in result.data and "baseline" in result.data and "idle_context" in result.data
    assert fake.processes[child.pid].state == RUNNING  # unlocked again, never left blocked
    assert child.wait(10) == 0


def test_gpu_power_check_fails_with_the_childs_last_words_when_it_cannot_allocate(power_check):
    dies = "import sys; print('torch.OutOfMemoryError: CUDA out of memory.', file=sys.stderr); sys.exit(1)"
    result, _nvml, fake, child = power_check(stand_in=dies)
    assert result.status.value == "fail"
    assert result.detail == (
        "RuntimeError: the child ended (exit code 1) before sending 'ready': torch.OutOfMemoryError: CUDA out of memory."
    )
    assert fake.ops(child.pid) == []  # nothing to suspend


def test_gpu_power_check_skips_a_gpu_without_power_readings(power_check):
    from fake_pynvml import C

    gpus = two_h100s()
    gpus[0].errors["nvmlDeviceGetPowerUsage"] = C["NVML_ERROR_NOT_SUPPORTED"]
    result, _nvml, _fake, child = power_check(gpus=gpus)
    assert result.status.value == "skip" and child is None
    assert result.detail == "GPU 0 reports no power draw (nvmlDeviceGetPowerUsage: Not Supported)"


def test_a_moved_kernel_that_names_its_new_gpus_is_mapped_from_the_ones_it_started_on(simpool):
    """The kernel's CUDA_VISIBLE_DEVICES follows its moves (what its children and frameworks read);
    its own usage is still mapped from the GPUs it started on (a move is completed into a swap, so
    mapping the new name again would put it back), and a child started after the move uses the new one."""
    from jupyter_gpupool.devices.checkpoint import STARTED_ON_ENV, devices_now

    backend, checkpointer, start = simpool
    gpu0, gpu1 = (d.uuid for d in backend.devices())
    kernel = start("2GiB")
    checkpointer.suspend(kernel.pid)
    checkpointer.resume(kernel.pid, {gpu0: gpu1})
    folder = backend.usage_dir
    followed = {"CUDA_VISIBLE_DEVICES": gpu1, STARTED_ON_ENV: gpu0}
    assert devices_now(folder, kernel.pid, followed) == [gpu1]
    assert devices_now(folder, kernel.pid, {"CUDA_VISIBLE_DEVICES": gpu0}) == [gpu1]  # never followed
    assert devices_now(folder, 999_999_999, {"CUDA_VISIBLE_DEVICES": gpu1}) == [gpu1]  # a child: as named
