"""The verdicts of tests/gpu's checks that have never met a GPU, decided here from readings that
pass and readings that fail, before any device call: fast-parking, next-cell, unpooled, elastic
and device-control (released-held and power: tests/test_gpu_script.py and
tests/test_checkpoint_backend.py). The elastic and next-cell checks also run end to end on a
simulated pool, and the device-control check on this machine, where it must skip saying why."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"
sys.path.insert(0, str(GPU_DIR))

from gpucheck.checks import Context, Options, devicectl, elastic, fastpark, nextcell, registry, unpooled
from gpucheck.checks.common import emit, slice_server
from gpucheck.cli import select
from gpucheck.probe import Probe
from gpucheck.report import Result, Status

GIB, MIB = 1024**3, 1024**2


def assert_verdict(problems: list[str], expected: str | None) -> None:
    """No problem where ``expected`` is None; else exactly one, which says ``expected``."""
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems


# --- fast-parking ---------------------------------------------------------------------------------


def parked(gib: int, name: str, gbps: float = 25.0, **changes: Any) -> dict[str, Any]:
    """One park-and-restore round as the check records it (the child's events + NVML)."""
    entry = {"gib": gib, "round": name, "reply": {"status": "ok"}, "nvml_while_parked": 600 * MIB,
             "identical": True, "same_addresses": True, "park_gbps": gbps, "resume_gbps": gbps}
    entry.update(changes)
    return entry


def fastpark_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"sizes_gib": [8, 32], "cap_held": {"held": True, "detail": "OutOfMemoryError"},
                            "rounds": [parked(g, r) for g in (8, 32) for r in ("first", "again")]}
    data.update(changes)
    return data


def test_fast_parking_passes_at_the_goal_each_way_on_a_reused_backup() -> None:
    assert fastpark.problems_of(fastpark_data()) == []
    slow_first = fastpark_data(rounds=[parked(g, r, gbps=2.0 if r == "first" else 20.0) for g in (8, 32) for r in ("first", "again")])
    assert fastpark.problems_of(slow_first) == []  # the first park allocates the pinned backup: not judged


@pytest.mark.parametrize(
    ("rounds", "cap", "expected"),
    [
        ([parked(8, "first"), parked(8, "again", resume_gbps=19.9), parked(32, "first"), parked(32, "again")], True,
         "8 GiB reused-backup resume at 19.9 GB/s, below the 20 GB/s goal"),
        ([parked(8, "first"), parked(8, "again", nvml_while_parked=5 * GIB), parked(32, "first"), parked(32, "again")], True,
         "8 GiB parked but NVML still shows 5.0 GiB held by the process"),
        ([parked(8, "first", reply={"status": "error", "message": "no region"}), parked(8, "again"), parked(32, "first"),
          parked(32, "again")], True, "8 GiB first park failed: no region"),
        ([parked(8, "first"), parked(8, "again"), parked(32, "first", identical=False), parked(32, "again")], True,
         "32 GiB first restore: identical=False, same addresses=True"),
        ([parked(8, "first"), parked(8, "again")], True, "not every size was parked and restored twice"),
        ([parked(g, r) for g in (8, 32) for r in ("first", "again")], False,
         "PyTorch's per-process fraction did not hold inside the region"),
        ([parked(g, r) for g in (8, 32) for r in ("first", "again")], None, "the cap inside the region was never tried"),
    ],
)
def test_fast_parking_fails_naming_what_missed(rounds: list[dict[str, Any]], cap: bool | None, expected: str) -> None:
    data = fastpark_data(rounds=rounds)
    if cap is None:
        del data["cap_held"]
    else:
        data["cap_held"] = {"held": cap, "detail": "allocated past the slice"}
    problems = fastpark.problems_of(data)
    assert len(problems) == 1 and problems[0].startswith(expected), problems


# --- next-cell ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("elapsed", "gib", "gbps", "output_ok", "suspended_ok", "expected"),
    [
        (0.4, 8, 50.0, True, True, None),
        (1.17, 8, 50.0, True, True, None),  # 1 s + 8 GiB at 50 GB/s (0.172 s)
        (2.7, 8, 5.0, True, True, None),  # a slow link gives the copy more time: 1 s + 1.718 s
        (1.18, 8, 50.0, True, True,
         "the next cell's output came 1.18 s after it was sent, past 1 s + the copy (0.17 s for 8 GiB at 50.0 GB/s) = 1.17 s"),
        (6.5, 8, 53.0, True, True, "past 1 s + the copy (0.16 s for 8 GiB at 53.0 GB/s) = 1.16 s"),  # the server path's 6.5 s of 2026-11-30 (tick included)
        (None, 8, 50.0, False, True, "the next cell printed no output"),
        (0.4, 8, 50.0, False, True, "the next cell's output was wrong: the tensors changed across the suspend"),
        (0.4, 8, 0.0, True, True, "no restore speed was measured"),
        (None, 8, 50.0, False, False, "the kernel was not suspended with its GPU memory freed (NVML)"),
    ],
)
def test_next_cell_verdict_is_one_second_plus_the_copy(
    elapsed: float | None, gib: float, gbps: float, output_ok: bool, suspended_ok: bool, expected: str | None
) -> None:
    assert_verdict(nextcell.problems_of(elapsed, gib, gbps, output_ok, suspended_ok), expected)


def test_next_cell_limit_and_kernel_code() -> None:
    assert nextcell.OVERHEAD_S == 1.0
    assert nextcell.copy_seconds(8, 8 * GIB / 1e9) == pytest.approx(1.0)
    assert nextcell.limit_seconds(32, 32 * GIB / 2e9) == pytest.approx(3.0)
    for name, code in {"fill": nextcell.fill_cell(8), "next": nextcell.NEXT_CELL, "verify": nextcell.VERIFY_CELL}.items():
        compile(code, name, "exec")


@pytest.mark.slow
def test_next_cell_check_end_to_end_on_a_simulated_pool(tmp_path: Path) -> None:
    """The check's own run on a real jupyter_server with a real kernel and a simulated 1x16GiB pool:
    pretend_to_use stands for PyTorch's tensors (the simulated memory saver parks them, the fast
    path's stand-in), the pool's usage files for NVML. The server suspends the kernel on
    ``POST .../suspend``; the next cell's first use of the GPU needs the kernel resumed, so its output
    comes only through the kernel's resume hook and the server's restore. Not timed here."""
    db = tmp_path / "server-next-cell" / "pool.sqlite"

    def usage(pids: set[int]) -> dict[int, int]:
        found = {}
        for pid in pids:
            path = Path(f"{db}.usage") / f"{pid}.json"
            if path.exists():
                found[pid] = sum(v for v in json.loads(path.read_text()).values() if isinstance(v, int))
        return found

    use = "from jupyter_gpupool.devices.simulated import pretend_to_use\n"
    cells = nextcell.Cells(
        fill=lambda gib: use + f"pretend_to_use({int(gib * GIB)})\n_gc_sum = 123456789\n"
        + emit('{"sum": _gc_sum, "h2d": 50e9, "d2h": 50e9}'),
        next=use + f"pretend_to_use({GIB})\n" + emit('{"sum": _gc_sum}'),  # blocks while suspended, as CUDA would
        verify=emit('{"identical": True}'),
    )
    host = nextcell.Host(process_memory=usage, server_env={"GPUPOOL_SIMULATE": "1x16GiB"})
    ctx = Context(name="next-cell", options=Options(ckpt_gib=1), probe=Probe(), workdir=tmp_path)
    result = nextcell.measure(ctx, cells, host)
    seen = result.data
    assert seen["held_before"] == GIB and seen["held_while_suspended"] == 0, seen
    assert seen["parked_memory"] == GIB and seen["parked_by"] == "torch-memory-saver (simulated)", seen
    assert seen["printed"] == {"sum": 123456789} and seen["identical"] and seen["state_after"] == "granted", seen
    assert seen["next_cell_s"] is not None and seen["restore_gbps"] == 50.0
    assert seen["server_restore_s"] is not None and "the server's restore" in result.detail  # its /metrics counted one
    problems = nextcell.problems_of(seen["next_cell_s"], 1, 50.0, True, True)
    assert result.status.value == ("fail" if problems else "pass"), (result.detail, seen)  # only the time may miss here


# --- unpooled -------------------------------------------------------------------------------------


def unpooled_seen(**changes: Any) -> dict[str, Any]:
    seen = {"detect_seconds": 1.4, "reported": 2 * GIB + 3 * MIB, "nvml_bytes": 2 * GIB, "kernel_counted": False, "waited_s": 1.4}
    seen.update(changes)
    return seen


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"detect_seconds": 3.0}, None),  # interval 2 s + 1 s
        ({"detect_seconds": 3.2}, "seen 3.2 s after the allocation, more than the 2 s interval (+1 s)"),
        ({"detect_seconds": None, "waited_s": 16.0}, "did not list the process outside the pool within 16.0 s"),
        ({"reported": 1 * GIB}, "the pool says 1.00 GiB outside the pool, NVML 2.00 GiB"),
        ({"kernel_counted": True}, "the pooled kernel's own memory was counted as unpooled use"),
    ],
)
def test_unpooled_verdict(changes: dict[str, Any], expected: str | None) -> None:
    problems = unpooled.problems_of(unpooled_seen(**changes), interval=2.0)
    assert_verdict(problems, expected)


# --- elastic --------------------------------------------------------------------------------------


def elastic_seen(**changes: Any) -> dict[str, Any]:
    wanted = elastic.KEEP + elastic.BURST_USE
    seen = {"grew": True, "grown_memory": wanted, "caps_grown": wanted, "kept_running": True, "nvml_back_s": 3.1,
            "nvml_a_last": 1600 * MIB, "b_granted_s": 3.4, "waited_s": 3.5, "caps_after": elastic.GUARANTEE,
            "memory_after": elastic.GUARANTEE, "a_state_after": "granted", "intact_after": True}
    seen.update(changes)
    return seen


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"nvml_back_s": 17.0, "b_granted_s": 17.0}, None),  # burst_settle 15 s + interval 2 s, exactly
        ({"caps_after": 8 * GIB, "memory_after": 8 * GIB}, None),  # taken back only as far as the request needed
        ({"nvml_back_s": 17.5}, "burst was back (NVML) 17.5 s after B asked, past burst_settle + interval = 17 s"),
        ({"nvml_back_s": None, "nvml_a_last": 13 * GIB, "waited_s": 27.0}, "A's process still held 13.00 GiB (NVML) 27 s after B asked"),
        ({"b_granted_s": None, "waited_s": 27.0}, "B was not granted within 27 s"),
        ({"b_granted_s": 20.0}, "B was granted 20.0 s after it asked, past burst_settle + interval = 17 s"),
        ({"caps_after": 13 * GIB}, "A's cap was not lowered to its slice"),
        ({"a_state_after": "suspended"}, "A did not keep running after the take-back (state suspended"),
        ({"intact_after": False}, "tensors intact False"),
        ({"kept_running": False}, "A did not keep running with its tensors after the growth"),
        ({"grown_memory": 4 * GIB}, "A's slice is 4.00 GiB after it allocated 13 GiB"),
        ({"grew": False, "grow_error": "OutOfMemoryError: ... (try 1; the cap did not say it grew the slice)"},
         "A's PyTorch allocation past its guarantee failed: OutOfMemoryError"),
    ],
)
def test_elastic_verdict_is_the_burst_back_rule(changes: dict[str, Any], expected: str | None) -> None:
    problems = elastic.problems_of(elastic_seen(**changes), interval=2.0)
    assert_verdict(problems, expected)
    assert elastic.settle_limit(2.0) == 17.0 and elastic.settle_limit(0.5, settle=15) == 15.5


def test_elastic_second_kernel_fits_only_once_the_burst_is_back() -> None:
    total = 143_771 * MIB  # an H200
    big = elastic.b_size(total)
    assert big % MIB == 0 and big + elastic.GUARANTEE <= total  # fits beside A at its guarantee...
    assert big + elastic.KEEP + elastic.BURST_USE > total  # ...and not beside A holding its burst
    spec = elastic.big_kernelspec(big)[elastic.BIG_SPEC]["metadata"]["kernel_provisioner"]
    assert spec == {"provisioner_name": "gpupool-provisioner", "config": {"memory": str(big)}}
    for name, code in {"grow": elastic.GROW_CELL, "drop": elastic.DROP_CELL, "after": elastic.AFTER_CELL}.items():
        compile(code, name, "exec")


SIM_USE = "from jupyter_gpupool.devices.simulated import pretend_to_use\nimport jupyter_gpupool.kernel as _gc_kernel\n"


@pytest.mark.slow
def test_elastic_check_end_to_end_on_a_simulated_pool(tmp_path: Path) -> None:
    """The check's own run, on a real jupyter_server with real kernels and a simulated 1x16GiB pool:
    pretend_to_use stands for PyTorch's allocations, and a cache freer that drops A's use to what it
    keeps stands for PyTorch's cache (freed only when the server asks). The server's tick is short:
    a take-back that comes before the server's next pass after a grow made in the kernel frees no
    cache today (the kernel's caps were never "sent" at the grown size)."""
    db = tmp_path / "server-elastic" / "pool.sqlite"

    def usage(pids: set[int]) -> dict[int, int]:
        found = {}
        for pid in pids:
            path = Path(f"{db}.usage") / f"{pid}.json"
            if path.exists():
                found[pid] = sum(json.loads(path.read_text()).values())
        return found

    keep = elastic.KEEP
    cells = elastic.Cells(
        grow=SIM_USE + f"pretend_to_use({keep + elastic.BURST_USE})\n"
        + emit('{"ok": True, "caps_limit": _gc_kernel.get_caps().limit, "reserved": 0}'),
        drop=SIM_USE + "from jupyter_gpupool.enforcement.caps import register_cache_freer\n"
        f"register_cache_freer('gpucheck', lambda: (pretend_to_use({keep}), {{'freed': {elastic.BURST_USE}}})[1])\n"
        + emit('{"reserved": 0}'),
        after=SIM_USE + "import jupyter_gpupool.enforcement.caps as _c\n"
        + emit('{"intact": True, "caps_limit": _gc_kernel.get_caps().limit, "cache_frees": _c.requests_served}'),
    )
    host = elastic.Host(
        process_memory=usage,
        total_memory=lambda _index: 16 * GIB,
        grant_problems=lambda kernel, _size: [] if kernel.env.get("GPUPOOL_LEASE_ID") else ["no lease"],
        server_env={"GPUPOOL_SIMULATE": "1x16GiB"},
        server_config={"GpuPoolExtension": {"tick_interval": 0.2}},
    )
    ctx = Context(name="elastic", options=Options(watchdog_interval=0.5), probe=Probe(), workdir=tmp_path)
    result = elastic.measure(ctx, cells, host)
    assert result.status.value == "pass", (result.detail, result.data)
    seen = result.data
    # Grown to what the cell holds; with A's use then at its slice and room free, the watchdog may grow
    # it one burst step (1 GiB) further, ahead of need, before the reading: either is right.
    assert seen["grown_memory"] in (keep + elastic.BURST_USE, keep + elastic.BURST_USE + GIB), seen["grown_memory"]
    assert seen["b_memory"] == 8 * GIB
    assert seen["nvml_a_cached"] == keep + elastic.BURST_USE and seen["nvml_a_last"] == keep
    assert seen["nvml_back_s"] <= 15.5 and seen["b_granted_s"] <= 15.5
    assert seen["after"]["cache_frees"] >= 1 and seen["caps_after"] <= seen["memory_after"] < seen["grown_memory"]
    assert result.number.startswith(f"grown to {seen['grown_memory'] / GIB:.1f} GiB; burst back in ") and "(limit 15.5 s)" in result.number


# --- device-control --------------------------------------------------------------------------------

UUID = "GPU-1f2e3d4c-0000-1111-2222-333344445555"


def devicectl_seen(**changes: Any) -> dict[str, Any]:
    seen = {
        "control": {"ok": True, "allocated": devicectl.PROBE_BYTES},
        "denied": {"ok": False, "error": "CUDA_ERROR_NO_DEVICE", "allocated": 0},
        "denied_nvml_bytes": 0,
        "granted_uuid": UUID,
        "granted": {"count": 1, "uuids": [UUID.removeprefix("GPU-")], "allocated": devicectl.PROBE_BYTES},
        "after_release": {"ok": False, "error": "CUDA_ERROR_NO_DEVICE"},
    }
    seen.update(changes)
    return seen


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, None),
        ({"control": {"ok": False, "error": "CUDA_ERROR_UNKNOWN"}}, "outside the denied cgroup could not allocate either"),
        ({"denied": {"ok": True, "allocated": 256 * MIB}}, "a raw CUDA program in the denied cgroup got the GPU (256 MiB)"),
        ({"denied_nvml_bytes": 500 * MIB}, "in the denied cgroup got the GPU"),
        ({"denied": {}}, "the raw CUDA program in the denied cgroup reported nothing"),
        ({"granted": {"count": 2, "uuids": ["a", "b"], "allocated": 256 * MIB}}, "saw 2 GPU(s)"),
        ({"granted": {"count": 1, "uuids": ["99999999-0000"], "allocated": 256 * MIB}}, "not exactly its own"),
        ({"granted": {"count": 0, "uuids": [], "allocated": 0}}, "saw 0 GPU(s)"),
        ({"granted": {"count": 1, "uuids": [UUID], "allocated": 0, "error": "OutOfMemoryError"}},
         "could not allocate on its GPU: OutOfMemoryError"),
        ({"after_release": {"ok": True}}, "after release, a new process in the kernel's cgroup still got the GPU"),
    ],
)
def test_device_control_verdict(changes: dict[str, Any], expected: str | None) -> None:
    problems = devicectl.problems_of(devicectl_seen(**changes))
    assert_verdict(problems, expected)


def test_device_control_reads_torch_and_nvml_uuids_alike() -> None:
    assert devicectl.same_gpu("1f2e3d4c-0000", "GPU-1F2E3D4C-0000")
    assert not devicectl.same_gpu("", "GPU-")
    assert not devicectl.same_gpu("1f2e3d4c-0001", "GPU-1f2e3d4c-0000")
    compile(devicectl.GRANTED_CHILD, "granted child", "exec")
    compile(devicectl.CLEANUP, "cleanup", "exec")


def test_device_control_check_skips_here_saying_why_and_leaves_no_cgroup(tmp_path: Path) -> None:
    """Run as it would on a machine without an NVIDIA driver or without writable cgroups: a skip
    with the product's reason, never a failure, and nothing left under the cgroup mounts."""
    from jupyter_gpupool.enforcement.device_control import cgroup_mounts

    ctx = Context(name="device-control", options=Options(), probe=Probe(), workdir=tmp_path)
    result = devicectl.run(ctx)
    assert result.status.value == "skip", result.detail
    assert re.search(r"no /dev/nvidiactl|cgroups not writable|not root|no cgroup hierarchy", result.detail), result.detail
    for mount in filter(None, cgroup_mounts()):
        assert not [n for n in os.listdir(mount) if n.startswith(f"gpucheck{os.getpid()}")]


# --- every check's end ---------------------------------------------------------------------------


def test_a_checks_verdict_fails_naming_its_problems_and_passes_with_its_detail() -> None:
    def unreadable() -> str:
        raise AssertionError("a failing run's pass detail was written")

    failed = Result.verdict("c", ["too slow", "x" * 500], number="1 GB/s", detail=unreadable, data={"a": 1}, noted="; note")
    assert (failed.status, failed.number, failed.data) == (Status.FAIL, "1 GB/s", {"a": 1})
    assert failed.detail.startswith("too slow; xxx") and len(failed.detail) == 400
    whole = Result.verdict("c", ["too slow"], number="", detail="measured", data={}, noted="; measured", limit=None)
    assert whole.detail == "too slow; measured"
    passed = Result.verdict("c", [], number="2 GB/s", detail=lambda: "fast " * 100, data={})
    assert passed.status is Status.PASS and passed.detail == ("fast " * 100)[:400]
    assert Result.verdict("c", [], number="", detail="measured", data={}, noted="; n").detail == "measured"


# --- the two device calls ----------------------------------------------------------------------------


def test_the_first_device_call_runs_the_never_run_checks_cheapest_first_within_its_budget() -> None:
    calls: dict[str, dict[str, tuple[str, str, int]]] = {}
    for doc in ("README.md", "RESULTS.md"):
        text = (GPU_DIR / doc).read_text()
        found = re.findall(r"run_all\.sh --(only|skip) (\S+) --budget (\d+) --out \$OUT/(first|second)", text)
        calls[doc] = {call: (flag, names, int(budget)) for flag, names, budget, call in found}
    assert calls["README.md"] == calls["RESULTS.md"] and set(calls["README.md"]) == {"first", "second"}, calls
    (flag, names, budget), (other_flag, other_names, _) = calls["README.md"]["first"], calls["README.md"]["second"]
    assert (flag, other_flag, names) == ("only", "skip", other_names)
    first = select([names], None)
    assert first == ["unpooled", "released-held", "elastic", "fast-parking", "next-cell", "power"]
    specs = registry()
    assert sum(specs[name].min_seconds for name in first) <= budget  # all can start when each takes its minimum
    second = select(None, [names])
    assert "device-control" in second and second[-1] == "settings"


def test_readme_gives_each_checks_timeout_and_min_seconds() -> None:
    readme = (GPU_DIR / "README.md").read_text()
    for name, spec in registry().items():
        if name.startswith("selftest"):
            continue
        row = re.search(rf"^\| `{re.escape(name)}` \| (\d+) \| (\d+) \|", readme, re.MULTILINE)
        assert row, f"{name} has no row in README.md's timeout table"
        assert (int(row[1]), int(row[2])) == (int(spec.timeout), int(spec.min_seconds)), name


def test_checks_of_a_fixed_slice_ask_for_fixed_slices() -> None:
    """The pool's slices are elastic by default (burst 4x); the slice, watchdog and MPS checks
    prove what a slice refuses, so their servers turn burst off, and the elastic check on."""
    fixed = slice_server(Path("/nonexistent"), 4 * GIB, "s", lambda _m: None)
    assert fixed.env()["GPUPOOL_BURST"] == "0" and fixed.env()["GPUPOOL_DEFAULT_MEMORY"] == str(4 * GIB)
    grown = slice_server(Path("/nonexistent"), 4 * GIB, "s", lambda _m: None, env={"GPUPOOL_BURST": "32GiB"})
    assert grown.env()["GPUPOOL_BURST"] == "32GiB"
