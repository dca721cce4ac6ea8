"""The simulated backend: inventory specs (good and bad), scripted usage and health."""

from __future__ import annotations

import pytest

from jupyter_gpupool.core.models import model_matches
from jupyter_gpupool.devices import ProcessUsage, make_backend
from jupyter_gpupool.devices.simulated import SPEC_FORMS, SimulatedBackend, parse_inventory
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB, MIB, SIZE_FORMS


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("1x16GiB", [("Simulated GPU 16GiB", 16 * GIB)]),
        ("16GiB", [("Simulated GPU 16GiB", 16 * GIB)]),
        ("2xA100-80GB", [("A100-80GB", 80 * GIB)] * 2),
        ("A100", [("A100", 80 * GIB)]),
        ("2xa100-40gb", [("a100-40gb", 40 * GIB)] * 2),
        ("1xT4", [("T4", 16 * GIB)]),
        ("3x512MiB", [("Simulated GPU 512MiB", 512 * MIB)] * 3),
        ("2 x H100-94GB", [("H100-94GB", 94 * GIB)] * 2),
        ("4xRTX3090-24GB,1xT4-16GB", [("RTX3090-24GB", 24 * GIB)] * 4 + [("T4-16GB", 16 * GIB)]),
        (" 1xH200 , 2xL4 ", [("H200", 141 * GIB), ("L4", 24 * GIB), ("L4", 24 * GIB)]),
    ],
)
def test_specs(spec, expected):
    assert parse_inventory(spec) == expected


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("0x16GiB", "invalid GPU count 0 in '0x16GiB': expected 1 to 1024"),
        ("1025xT4", "invalid GPU count 1025"),
        ("2xFOO", "unknown GPU 'FOO' in '2xFOO': give its memory with a unit (e.g. 2xFOO-24GB)"),
        ("abc", "unknown GPU 'abc'"),
        ("", "empty simulated inventory"),
        ("   ", "empty simulated inventory"),
        ("1x0GiB", "invalid size '0GiB'"),
        ("-1x16GiB", "invalid inventory item '-1x16GiB'"),
        ("1x-16GiB", "unknown GPU '1x-16GiB'"),
        ("1x1e30GB", "unknown GPU '1e30GB'"),
        ("1x16XB", "unknown GPU '16XB'"),
        ("2xA100-80GB,,1xT4", "invalid inventory item ''"),
        ("1x16GiB;rm -rf", "invalid inventory item"),
        ("1x2000TiB", "too large: no GPU pool holds more than 1 PiB"),
        ("1x24", "unknown GPU '24' in '1x24': give its memory with a unit (e.g. 1x24GiB)"),
    ],
)
def test_bad_specs_are_one_line_errors_naming_the_forms(spec, says):
    with pytest.raises(InvalidInput) as info:
        parse_inventory(spec)
    message = str(info.value)
    assert says in message
    assert "\n" not in message
    assert SPEC_FORMS in message or "expected 1 to 1024" in message or "1 PiB" in message or SIZE_FORMS in message


def test_make_backend_reads_a_spec_and_rejects_a_bad_one():
    backend = make_backend("2xA100-80GB")
    assert isinstance(backend, SimulatedBackend) and backend.describe() == "simulated 2xA100-80GB"
    with pytest.raises(InvalidInput):
        make_backend("0x16GiB")


def test_heterogeneous_inventory():
    backend = SimulatedBackend.from_spec("4xRTX3090-24GB,1xT4-16GB")
    devices = backend.devices()
    assert [d.index for d in devices] == [0, 1, 2, 3, 4]
    assert [d.memory_total for d in devices] == [24 * GIB] * 4 + [16 * GIB]
    assert all(d.memory_free == d.memory_total and d.healthy and not d.is_mig for d in devices)
    assert len({d.uuid for d in devices}) == 5 and all(d.uuid.startswith("GPU-") for d in devices)
    # Same-model GPUs are NVLink peers; the odd one out has none.
    rtx = [d.uuid for d in devices[:4]]
    assert devices[0].nvlink_peers == set(rtx[1:])
    assert devices[4].nvlink_peers == frozenset()
    # Model constraints match them.
    assert [model_matches("RTX3090", d) for d in devices] == [True] * 4 + [False]
    assert model_matches("T4", devices[4])
    assert SimulatedBackend(parse_inventory("2xA100-80GB"), nvlink=False).devices()[0].nvlink_peers == frozenset()


def test_uuids_are_stable_per_spec_so_processes_sharing_a_pool_agree():
    first = [d.uuid for d in SimulatedBackend.from_spec("2xA100-80GB").devices()]
    again = [d.uuid for d in SimulatedBackend.from_spec(" 2xA100-80GB ").devices()]
    other = [d.uuid for d in SimulatedBackend.from_spec("2xA100-40GB").devices()]
    assert first == again
    assert not set(first) & set(other)


def test_scripted_usage_shows_in_processes_and_free_memory():
    backend = SimulatedBackend.from_spec("2x16GiB")
    gpu0, gpu1 = (d.uuid for d in backend.devices())
    backend.set_usage(100, gpu0, 3 * GIB)
    backend.set_usage(101, gpu0, 1 * GIB)
    backend.set_usage(100, gpu1, 2 * GIB)
    assert sorted(backend.process_usage(), key=lambda u: (u.device_uuid == gpu1, u.pid)) == [
        ProcessUsage(100, gpu0, 3 * GIB),
        ProcessUsage(101, gpu0, 1 * GIB),
        ProcessUsage(100, gpu1, 2 * GIB),
    ]
    assert [d.memory_free for d in backend.devices()] == [12 * GIB, 14 * GIB]
    backend.set_usage(100, gpu0, 5 * GIB)  # replaces, does not add
    backend.set_usage(101, gpu0, 0)  # 0 removes
    assert {(u.pid, u.device_uuid): u.used_memory for u in backend.process_usage()} == {(100, gpu0): 5 * GIB, (100, gpu1): 2 * GIB}
    backend.set_usage(100, gpu0, 20 * GIB)  # more than the GPU: free never goes negative
    assert backend.devices()[0].memory_free == 0


def test_set_health_marks_a_gpu_lost_and_back():
    backend = SimulatedBackend.from_spec("2xA100-80GB")
    gpu1 = backend.devices()[1].uuid
    backend.set_usage(7, gpu1, GIB)
    backend.set_health(gpu1, False, "GPU is lost (NVML_ERROR_GPU_IS_LOST)")
    devices = backend.devices()
    assert [d.healthy for d in devices] == [True, False]
    assert devices[1].health_reason == "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
    assert devices[1].memory_free == 79 * GIB  # the rest of the record is kept
    backend.set_health(gpu1, True)
    assert all(d.healthy and not d.health_reason for d in backend.devices())
