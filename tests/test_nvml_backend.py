"""The NVML backend against a scripted fake pynvml (and against the real one where it can run)."""

from __future__ import annotations

import importlib
import inspect
import sys

import fake_pynvml
import pytest
from fake_pynvml import GIB, MIB, C, FakeGpu, FakeMig, FakeNvml, FakeProcess

from jupyter_gpupool.devices import ProcessUsage, make_backend
from jupyter_gpupool.devices.nvml import NvmlBackend
from jupyter_gpupool.errors import PoolUnavailable

LOST = "GPU is lost (NVML_ERROR_GPU_IS_LOST)"


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch):
    """``host(gpus, **options)`` installs a fake pynvml playing ``gpus`` and returns it."""

    def install(gpus: list[FakeGpu], **options) -> FakeNvml:
        fake = FakeNvml(gpus, **options)
        fake.install(monkeypatch)
        return fake

    return install


@pytest.fixture
def backends():
    made: list[NvmlBackend] = []
    yield made
    for backend in made:
        backend.close()


def open_backend(backends: list[NvmlBackend], **kw) -> NvmlBackend:
    backend = NvmlBackend(**kw)
    backends.append(backend)
    return backend


# --- the fake is faithful -------------------------------------------------------------------------
def test_fake_mimics_the_real_pynvml_api():
    real = importlib.import_module("pynvml")
    if getattr(real, "__fake__", None) is not None:  # pragma: no cover - only if a test leaked
        pytest.fail("sys.modules['pynvml'] is still the fake")
    fake = FakeNvml([]).module
    functions = [n for n in dir(fake) if n.startswith("nvml")]
    assert len(functions) >= 20
    for name in functions:
        assert hasattr(real, name), f"{name} is not in the real pynvml"
        assert inspect.signature(getattr(fake, name)) == inspect.signature(getattr(real, name)), name
    for name, value in C.items():
        assert getattr(real, name) == value, name
    for name in dir(fake):
        if name.startswith("NVMLError_"):
            assert hasattr(real, name), name
            assert getattr(fake, name)().value == getattr(real, name)().value
    # pynvml maps a code to its subclass; the fake does the same.
    assert isinstance(fake.NVMLError(C["NVML_ERROR_GPU_IS_LOST"]), fake.NVMLError_GpuIsLost)
    assert str(fake.NVMLError(C["NVML_ERROR_GPU_IS_LOST"])) == str(real.NVMLError(real.NVML_ERROR_GPU_IS_LOST))


# --- inventory ------------------------------------------------------------------------------------
def test_inventory_of_a_workstation(host, backends):
    gpus = fake_pynvml.workstation()
    gpus[0].memory_used = 3 * GIB
    fake = host(gpus)
    devices = open_backend(backends).devices()

    assert [d.index for d in devices] == [0, 1, 2]
    assert [d.uuid for d in devices] == [g.uuid for g in gpus]
    assert [d.minor for d in devices] == [4, 5, 6]  # /dev/nvidiaN's N is the driver's minor, not the index
    assert [d.name for d in devices] == ["NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090", "Tesla T4"]
    assert devices[0].memory_total == 24 * GIB and devices[0].memory_free == 21 * GIB
    assert devices[2].memory_total == 15 * GIB + 360 * MIB
    assert all(d.healthy and not d.is_mig and not d.mig_mode for d in devices)
    assert devices[0].model == "RTX-3090" and devices[2].model == "T4"
    # The NVLink bridge joins the two 3090s; the T4 has none.
    assert devices[0].nvlink_peers == {gpus[1].uuid}
    assert devices[1].nvlink_peers == {gpus[0].uuid}
    assert devices[2].nvlink_peers == frozenset()
    assert devices[0].to_json()["nvlink_peers"] == [gpus[1].uuid]
    assert fake.calls["nvmlInit"] == 1


def test_nvswitch_fabric_makes_every_gpu_a_peer(host, backends):
    gpus = fake_pynvml.dgx_a100(8)
    host(gpus)
    devices = open_backend(backends).devices()
    assert len(devices) == 8
    everyone = {g.uuid for g in gpus}
    for device in devices:
        assert device.nvlink_peers == everyone - {device.uuid}
        assert device.memory_total == 80 * GIB


def test_topology_fallback_pairs_gpus_behind_one_pcie_switch(host, backends):
    gpus = fake_pynvml.pcie_box()
    host(gpus)
    devices = open_backend(backends).devices()
    assert devices[0].nvlink_peers == {gpus[1].uuid}
    assert devices[3].nvlink_peers == {gpus[2].uuid}
    plain = open_backend(backends, topology_fallback=False).devices()
    assert all(d.nvlink_peers == frozenset() for d in plain)


def test_nvlink_topology_is_cached_but_free_memory_is_live(host, backends):
    gpus = fake_pynvml.dgx_a100(2)
    fake = host(gpus)
    backend = open_backend(backends)
    backend.devices()
    link_calls = fake.calls["nvmlDeviceGetNvLinkState"]
    gpus[1].memory_used = 10 * GIB
    devices = backend.devices()
    assert fake.calls["nvmlDeviceGetNvLinkState"] == link_calls
    assert devices[1].memory_free == 70 * GIB
    assert fake.calls["nvmlInit"] == 1


def test_inactive_and_unsupported_links_are_skipped(host, backends):
    gpus = [
        FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, nvlinks=[None, 1, None]),
        FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, nvlinks=[None, 0]),
        FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, nvlinks=[None, None]),
    ]
    host(gpus)
    devices = open_backend(backends).devices()
    assert devices[0].nvlink_peers == {gpus[1].uuid}
    assert devices[2].nvlink_peers == frozenset()


def test_no_gpus_gives_an_empty_pool(host, backends):
    host([])
    backend = open_backend(backends)
    assert backend.devices() == []
    assert backend.process_usage() == []


def test_old_pynvml_bytes_are_decoded(host, backends):
    gpus = fake_pynvml.a100_mig()
    host(gpus, legacy_bytes=True)
    backend = open_backend(backends)
    devices = backend.devices()
    assert all(isinstance(d.uuid, str) and isinstance(d.name, str) for d in devices)
    assert devices[0].uuid.startswith("MIG-") and devices[0].parent_uuid == gpus[0].uuid
    assert backend.describe() == "nvml (driver 550.54.15)"


# --- MIG --------------------------------------------------------------------------------------------
def test_mig_instances_are_poolable_and_the_parent_is_not(host, backends):
    gpus = fake_pynvml.a100_mig()
    fake = host(gpus)
    devices = open_backend(backends).devices()
    migs = [d for d in devices if d.is_mig]
    assert [d.uuid for d in migs] == [gpus[0].mig_slots[i].uuid for i in (0, 2, 3)]
    assert [d.memory_total for d in migs] == [19968 * MIB, 4864 * MIB, 4864 * MIB]
    assert all(d.parent_uuid == gpus[0].uuid and d.mig_mode and d.index == 0 for d in migs)
    assert all(d.minor == gpus[0].minor for d in migs)  # a MIG instance opens its GPU's node
    assert migs[0].name == "NVIDIA A100-PCIE-40GB MIG 3g.20gb"
    assert gpus[0].uuid not in {d.uuid for d in devices}
    whole = [d for d in devices if not d.is_mig]
    assert [d.uuid for d in whole] == [gpus[1].uuid] and whole[0].memory_total == 40 * GIB
    # Only reads: nothing that would create or destroy an instance was called.
    assert all(fn.startswith(("nvmlDeviceGet", "nvmlSystemGet", "nvmlInit")) for fn in fake.calls), fake.calls


def test_a_mig_instance_names_its_gpu_and_compute_instance_for_device_control(host, backends):
    """Device control opens a MIG kernel only its own instance's capability nodes
    (``gpuN/giX/ciY/access``): the ids come from NVML; a driver that does not give them leaves
    them unknown (the kernel then opens its whole GPU), never a guess."""
    gpus = fake_pynvml.a100_mig()
    gpus[0].mig_slots[0].compute_instance_id = 2
    host(gpus)
    migs = sorted((d for d in open_backend(backends).devices() if d.is_mig), key=lambda d: d.uuid)
    assert {(d.mig_gi, d.mig_ci) for d in migs} == {(1, 2), (7, 0), (8, 0)}
    gpus[0].errors["nvmlDeviceGetGpuInstanceId"] = C["NVML_ERROR_NOT_SUPPORTED"]
    again = [d for d in open_backend(backends).devices() if d.is_mig]
    assert {(d.mig_gi, d.mig_ci) for d in again} == {(None, None)}


def test_mig_layout_changes_show_up_on_the_next_enumeration(host, backends):
    gpus = fake_pynvml.a100_mig()
    host(gpus)
    backend = open_backend(backends)
    assert len(backend.devices()) == 4
    gpus[0].mig_slots[1] = FakeMig("2g.10gb", 9856 * MIB, gpu_instance_id=5)  # the admin made one
    gpus[0].mig_slots[0] = None  # ... and destroyed another
    devices = backend.devices()
    assert sorted(d.memory_total for d in devices if d.is_mig) == [4864 * MIB, 4864 * MIB, 9856 * MIB]


def test_mig_enabled_without_instances_offers_nothing(host, backends):
    host([FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB, mig=True, mig_slots=[])])
    assert open_backend(backends).devices() == []


# --- health -----------------------------------------------------------------------------------------
def test_a_lost_gpu_is_reported_unhealthy_not_raised(host, backends):
    gpus = fake_pynvml.workstation()
    host(gpus)
    backend = open_backend(backends)
    before = backend.devices()
    gpus[1].lost = True
    devices = backend.devices()
    assert [d.healthy for d in devices] == [True, False, True]
    lost = devices[1]
    assert lost.health_reason == LOST
    # What we knew stays, so leases on it can be found and flagged.
    assert (lost.uuid, lost.name, lost.memory_total) == (before[1].uuid, before[1].name, before[1].memory_total)
    assert lost.memory_free is None
    assert gpus[1].uuid not in devices[0].nvlink_peers
    gpus[1].lost = False  # back after a reset
    assert all(d.healthy for d in backend.devices())
    assert backend.devices()[0].nvlink_peers == {gpus[1].uuid}


def test_a_gpu_lost_before_first_sight_gets_a_placeholder(host, backends):
    gpus = fake_pynvml.workstation()
    gpus[2].lost = True
    host(gpus)
    devices = open_backend(backends).devices()
    assert devices[2].uuid == "GPU-unknown-index-2"
    assert not devices[2].healthy and devices[2].health_reason == LOST
    assert devices[2].memory_total == 0


@pytest.mark.parametrize(
    ("function", "code", "reason"),
    [
        ("nvmlDeviceGetMemoryInfo", "NVML_ERROR_GPU_IS_LOST", LOST),
        ("nvmlDeviceGetUUID", "NVML_ERROR_RESET_REQUIRED", "GPU requires restart (NVML_ERROR_RESET_REQUIRED)"),
        ("nvmlDeviceGetMigMode", "NVML_ERROR_UNKNOWN", "Unknown Error (NVML_ERROR_UNKNOWN)"),
        ("nvmlDeviceGetPciInfo", "NVML_ERROR_GPU_IS_LOST", LOST),
    ],
)
def test_any_nvml_error_on_a_device_query_marks_it_unhealthy(host, backends, function, code, reason):
    gpus = fake_pynvml.dgx_a100(2)
    gpus[0].errors[function] = C[code]
    host(gpus)
    devices = open_backend(backends).devices()
    assert not devices[0].healthy and devices[0].health_reason == reason
    assert devices[1].healthy


def test_unsupported_optional_queries_do_not_make_a_gpu_unhealthy(host, backends):
    gpus = [FakeGpu("Tesla V100-SXM2-32GB", 32 * GIB, errors={"nvmlDeviceGetPciInfo": C["NVML_ERROR_NOT_SUPPORTED"]})]
    host(gpus)
    devices = open_backend(backends).devices()
    assert devices[0].healthy and devices[0].memory_total == 32 * GIB


def test_a_lost_mig_parent_flags_its_instances(host, backends):
    gpus = fake_pynvml.a100_mig()
    host(gpus)
    backend = open_backend(backends)
    backend.devices()
    gpus[0].lost = True
    devices = backend.devices()
    migs = [d for d in devices if d.is_mig]
    assert len(migs) == 3 and all(not d.healthy and d.health_reason == LOST for d in migs)
    assert [d.healthy for d in devices if not d.is_mig] == [True]
    assert all(p.device_uuid == gpus[1].uuid for p in backend.process_usage())


# --- processes --------------------------------------------------------------------------------------
def test_process_usage_per_device(host, backends):
    gpus = fake_pynvml.workstation()
    gpus[0].compute = [FakeProcess(100, 2 * GIB), FakeProcess(101, None)]
    gpus[0].graphics = [FakeProcess(100, 2 * GIB), FakeProcess(102, 64 * MIB)]  # 100 has both contexts
    gpus[2].compute = [FakeProcess(100, 1 * GIB)]
    host(gpus)
    usage = open_backend(backends).process_usage()
    assert sorted(usage, key=lambda u: (u.device_uuid, u.pid)) == sorted(
        [
            ProcessUsage(100, gpus[0].uuid, 2 * GIB),
            ProcessUsage(101, gpus[0].uuid, 0),  # usedGpuMemory None: known on the GPU, size unknown
            ProcessUsage(102, gpus[0].uuid, 64 * MIB),
            ProcessUsage(100, gpus[2].uuid, 1 * GIB),
        ],
        key=lambda u: (u.device_uuid, u.pid),
    )


def test_process_usage_per_mig_instance_without_double_counting(host, backends):
    gpus = fake_pynvml.a100_mig()
    gpus[0].mig_slots[0].processes = [FakeProcess(200, 12 * GIB)]
    gpus[0].mig_slots[3].processes = [FakeProcess(201, 3 * GIB), FakeProcess(202, None)]
    gpus[1].compute = [FakeProcess(203, 30 * GIB)]
    host(gpus)
    usage = {(u.pid, u.device_uuid): u.used_memory for u in open_backend(backends).process_usage()}
    assert usage == {
        (200, gpus[0].mig_slots[0].uuid): 12 * GIB,
        (201, gpus[0].mig_slots[3].uuid): 3 * GIB,
        (202, gpus[0].mig_slots[3].uuid): 0,
        (203, gpus[1].uuid): 30 * GIB,
    }


def test_mps_clients_are_reported(host, backends):
    gpus = [FakeGpu("NVIDIA H100 80GB HBM3", 80 * GIB)]
    gpus[0].compute = [FakeProcess(300, 9 * GIB)]  # the MPS server
    gpus[0].mps = [FakeProcess(301, 4 * GIB), FakeProcess(302, 5 * GIB)]
    host(gpus)
    usage = {u.pid: u.used_memory for u in open_backend(backends).process_usage()}
    assert usage == {300: 9 * GIB, 301: 4 * GIB, 302: 5 * GIB}


def test_process_queries_that_fail_are_skipped(host, backends):
    gpus = fake_pynvml.dgx_a100(3)
    gpus[0].compute = [FakeProcess(1, GIB)]
    gpus[1].compute = [FakeProcess(2, GIB)]
    gpus[1].errors["nvmlDeviceGetComputeRunningProcesses"] = C["NVML_ERROR_NO_PERMISSION"]
    gpus[2].compute = [FakeProcess(3, GIB)]
    host(gpus)
    backend = open_backend(backends)
    backend.devices()
    gpus[2].lost = True
    assert [u.pid for u in backend.process_usage()] == [1]


# --- start and stop ---------------------------------------------------------------------------------
@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_missing_driver_is_one_clear_line(host, code):
    host([], init_error=C[code])
    with pytest.raises(PoolUnavailable) as info:
        NvmlBackend()
    message = str(info.value)
    assert message.startswith("no NVIDIA driver found (NVML: ")
    assert message.endswith("; set GPUPOOL_SIMULATE=1x16GiB to try a simulated pool")
    assert "\n" not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_library_not_found_message_exactly(host):
    host([], init_error=C["NVML_ERROR_LIBRARY_NOT_FOUND"])
    with pytest.raises(PoolUnavailable, match=r"^no NVIDIA driver found \(NVML: NVML Shared Library Not Found\); set "):
        make_backend(None)


def test_a_broken_driver_says_what_failed(host):
    host([], init_error=C["NVML_ERROR_LIB_RM_VERSION_MISMATCH"])
    with pytest.raises(PoolUnavailable, match=r"NVML could not start .*NVML_ERROR_LIB_RM_VERSION_MISMATCH.*GPUPOOL_SIMULATE"):
        NvmlBackend()


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    with pytest.raises(PoolUnavailable, match=r"^no NVIDIA driver found \(NVML: nvidia-ml-py is not installed"):
        NvmlBackend()


def test_make_backend_picks_nvml_for_empty_specs(host, backends):
    host(fake_pynvml.dgx_a100(1))
    for spec in (None, "", "nvml", "auto"):
        backend = make_backend(spec)
        backends.append(backend)  # type: ignore[arg-type]
        assert isinstance(backend, NvmlBackend) and len(backend.devices()) == 1


def test_init_once_and_shutdown_once(host):
    fake = host(fake_pynvml.workstation())
    backend = NvmlBackend()
    for _ in range(3):
        backend.devices()
        backend.process_usage()
    assert fake.calls["nvmlInit"] == 1 and fake.init_count == 1
    backend.close()
    backend.close()
    assert fake.calls["nvmlShutdown"] == 1 and fake.init_count == 0
    with pytest.raises(PoolUnavailable, match="closed"):
        backend.devices()


def test_the_real_pynvml_here():
    """On this host (no GPU) the real module must fail cleanly; with a GPU it must enumerate."""
    assert getattr(sys.modules.get("pynvml"), "__fake__", None) is None
    try:
        backend = NvmlBackend()
    except PoolUnavailable as exc:
        assert str(exc).startswith(("no NVIDIA driver found (NVML: ", "NVML could not start (NVML: "))
        assert "GPUPOOL_SIMULATE=1x16GiB" in str(exc)
        return
    try:  # pragma: no cover - only on a GPU host
        devices = backend.devices()
        assert devices and all(d.uuid.startswith(("GPU-", "MIG-")) and d.memory_total > 0 for d in devices)
        assert all(isinstance(u.pid, int) for u in backend.process_usage())
    finally:
        backend.close()
