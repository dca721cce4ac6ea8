"""CPU-runnable parts of the GPU check script (tests/gpu/run_all.sh): argument handling, the
table writer, skips with reasons, the per-check process isolation, and the real-server harness
the GPU checks drive kernels with (on a simulated pool here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"
REPO = GPU_DIR.parents[1]
sys.path.insert(0, str(GPU_DIR))

from gpucheck import CHECK_NAMES, GROUPS
from gpucheck.checks import Options, registry
from gpucheck.cli import UsageError, main, select
from gpucheck.probe import Probe, probe_all
from gpucheck.report import Result, Status, format_markdown, format_table, write_outputs

HAS_GPU = probe_all().gpu
SELFTEST = ["selftest-pass", "selftest-hang", "selftest-crash", "selftest-raise", "selftest-leak"]


def run_script(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "OUT"}  # an $OUT set by the caller is not ours
    full_env = {
        **base,
        "GPUCHECK_SITE": str(Path(os.environ.get("TMPDIR", "/tmp")) / "gpucheck-site-test"),
        "GPUCHECK_WHEELS": str(GPU_DIR / "no-such-wheels"),  # a local tests/gpu/.wheels must not change the test
        **(env or {}),
    }
    return subprocess.run(
        ["bash", str(GPU_DIR / "run_all.sh"), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        check=False,
    )


def table_rows(stdout: str) -> dict[str, list[str]]:
    """Rows of the printed table by check name: [result, number, detail]."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.split(" | ")]
        if len(cells) == 4 and cells[0] not in ("check",) and not set(cells[0]) <= {"-", "+"}:
            rows[cells[0]] = cells[1:]
    return rows


# --- argument handling ---------------------------------------------------------------------------


def test_select_defaults_to_every_check_in_run_order() -> None:
    assert select(None, None) == list(CHECK_NAMES)


def test_select_only_skip_groups_and_commas() -> None:
    assert select(["slices"], None) == list(GROUPS["slices"])
    assert select(["watchdog,inventory", "mps"], None) == ["inventory", "watchdog", "mps"]
    assert select(["slices"], ["slices-jax"]) == ["slices-torch", "slices-cupy"]
    assert select(None, ["slices", "settings"]) == [
        "inventory", "watchdog", "unpooled", "released-held", "elastic", "device-control", "suspend", "fast-parking",
        "next-cell", "power", "overhead", "mps",
    ]
    assert select([" Inventory "], None) == ["inventory"]


def test_select_refuses_unknown_names_and_empty_selection() -> None:
    with pytest.raises(UsageError, match=r"unknown check 'gpu-burn': expected names from inventory, .*slices"):
        select(["gpu-burn"], None)
    with pytest.raises(UsageError, match="no check left"):
        select(["mps"], ["mps"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "nope"], "unknown check 'nope'"),
        (["--slice", "abc"], "--slice: invalid size 'abc': expected a size like 8GiB"),
        (["--slice", "512MiB"], "below 1 GiB"),
        (["--budget", "0"], "--budget must be a positive number"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--ckpt-gib", "500"], "--ckpt-gib must be between"),
        (["--watchdog-interval", "0"], "--watchdog-interval must be between"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--budget", "soon"])
    assert exc.value.code == 2
    assert "invalid float value" in capsys.readouterr().err


def test_slice_option_reaches_the_checks(tmp_path: Path) -> None:
    proc = run_script(
        "--only",
        "selftest-pass",
        "--slice",
        "6GiB",
        "--out",
        str(tmp_path),
        env={"GPUCHECK_EXTRA_CHECKS": "gpucheck.selftest"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "results.json").read_text())["results"][0]
    assert result["status"] == "pass" and str(6 * 1024**3) in result["detail"]


def test_list_names_every_check_and_its_readiness() -> None:
    proc = run_script("--list")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    assert listed == list(CHECK_NAMES)
    assert "bootstrap:" not in proc.stdout  # --list installs nothing


# --- the table writer -----------------------------------------------------------------------------


def test_table_has_the_four_columns_aligned_one_line_per_check() -> None:
    results = [
        Result("inventory", Status.PASS, number="1 GPU", detail="matches nvidia-smi"),
        Result("overhead", Status.FAIL, number="matmul 0.91x", detail="slow\nin two lines"),
        Result.skip("mps", "nvidia-cuda-mps-control not on PATH"),
    ]
    lines = format_table(results).splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["check", "result", "number", "detail"]
    assert len(lines) == 2 + len(results)
    bars = {line.index("|") for line in lines if "|" in line}
    assert len(bars) == 1  # first column aligned
    assert lines[3].split("|")[3].strip() == "slow in two lines"
    assert table_rows("\n".join(lines))["mps"] == ["skip", "", "nvidia-cuda-mps-control not on PATH"]


def test_table_truncates_long_details_but_markdown_keeps_them() -> None:
    long = "x" * 300
    table = format_table([Result("a", Status.FAIL, detail=long)], detail_width=50)
    assert "x" * 49 + "…" in table and "x" * 51 not in table
    md = format_markdown([Result("a|b", Status.FAIL, number="1|2", detail=long)], meta={"gpu": "H200"})
    assert "- gpu: H200" in md
    assert "| a\\|b | fail | 1\\|2 | " + long + " |" in md


def test_write_outputs_json_round_trip_and_summary(tmp_path: Path) -> None:
    results = [Result("inventory", Status.PASS, number="1 GPU", data={"devices": [1]}), Result.skip("mps", "no MPS")]
    paths = write_outputs(str(tmp_path / "out"), results, {"date": "today"})
    assert sorted(Path(p).name for p in paths) == ["results.json", "results.md"]
    payload = json.loads((tmp_path / "out" / "results.json").read_text())
    assert payload["summary"] == {"pass": 1, "fail": 0, "skip": 1}
    assert [Result.from_json(r) for r in payload["results"]] == results


# --- skips with reasons -----------------------------------------------------------------------------


def gpu_probe(**changes: object) -> Probe:
    """A machine as the probe would describe one with a GPU and everything installed."""
    probe = Probe(
        gpu=True,
        gpu_count=1,
        driver="580.159.04",
        nvidia_smi="/usr/bin/nvidia-smi",
        frameworks={"torch": "2.11.0", "jax": "0.11.2", "cupy": "14.2.0", "torch_memory_saver": "0.0.10"},
        provisioner_registered=True,
        mps_control="/usr/bin/nvidia-cuda-mps-control",
        checkpoint_api=True,
        libcuda=True,
        root=True,
    )
    for key, value in changes.items():
        setattr(probe, key, value)
    return probe


def reasons(probe: Probe) -> dict[str, str | None]:
    return {name: spec.requires(probe, Options()) for name, spec in registry().items() if name in CHECK_NAMES}


def test_nothing_skips_on_a_complete_gpu_machine() -> None:
    assert reasons(gpu_probe()) == {name: None for name in CHECK_NAMES}


def test_without_gpu_every_check_skips_naming_why() -> None:
    probe = Probe(gpu=False, gpu_reason="no NVIDIA GPU: nvidia-smi not on PATH")
    assert set(reasons(probe).values()) == {"no NVIDIA GPU: nvidia-smi not on PATH"}


@pytest.mark.parametrize(
    ("changes", "check", "expected"),
    [
        ({"frameworks": {"torch": "2.11.0", "jax": None, "cupy": "14"}}, "slices-jax", "JAX not installed"),
        ({"frameworks": {"torch": None, "jax": "0.11", "cupy": "14"}}, "overhead", "PyTorch not installed"),
        ({"frameworks": {"torch": None, "jax": "0.11", "cupy": "14"}}, "suspend", "PyTorch not installed"),
        ({"mps_control": None}, "mps", "nvidia-cuda-mps-control not on PATH"),
        ({"checkpoint_api": False, "cuda_checkpoint": None}, "suspend", "no CUDA checkpoint API"),
        ({"checkpoint_api": False, "cuda_checkpoint": None}, "power", "no CUDA checkpoint API"),
        ({"frameworks": {"torch": None, "jax": "0.11", "cupy": "14"}}, "power", "PyTorch not installed"),
        ({"server_stack_missing": ["jupyter_server", "zmq"]}, "slices-torch", "jupyter_server, zmq not importable"),
        ({"server_stack_missing": ["ipykernel"]}, "watchdog", "run tests/gpu/prepare.sh"),
        ({"provisioner_registered": False}, "slices-cupy", "'gpupool-provisioner' is not registered"),
        (
            {"modules_missing": {"jupyter_gpupool.enforcement.watchdog": "ModuleNotFoundError: x"}},
            "watchdog",
            "jupyter_gpupool.enforcement.watchdog not importable",
        ),
        (
            {"modules_missing": {"jupyter_gpupool.devices.nvml": "ImportError: y"}},
            "inventory",
            "devices.nvml not importable",
        ),
        ({"nvidia_smi": None}, "inventory", "nvidia-smi not on PATH"),
        ({"libcuda": False}, "watchdog", "libcuda.so.1 not loadable"),
        ({"libcuda": False}, "device-control", "libcuda.so.1 not loadable"),
        ({"root": False}, "device-control", "not root: only root may change device cgroups"),
        ({"frameworks": {"torch": None, "jax": "0.11", "cupy": "14"}}, "elastic", "PyTorch not installed"),
        ({"frameworks": {"torch": None, "jax": "0.11", "cupy": "14"}}, "device-control", "PyTorch not installed"),
        ({"provisioner_registered": False}, "elastic", "'gpupool-provisioner' is not registered"),
        (
            {"modules_missing": {"jupyter_gpupool.enforcement.device_control": "ImportError: z"}},
            "device-control",
            "enforcement.device_control not importable",
        ),
    ],
)
def test_each_missing_need_skips_only_the_checks_that_need_it(changes: dict, check: str, expected: str) -> None:
    got = reasons(gpu_probe(**changes))
    assert got[check] is not None and expected in got[check]
    if "frameworks" in changes or "mps_control" in changes:
        assert got["inventory"] is None  # the others still run


def test_a_cuda_checkpoint_binary_is_enough_for_suspend() -> None:
    got = reasons(gpu_probe(checkpoint_api=False, cuda_checkpoint="/usr/bin/cuda-checkpoint"))
    assert got["suspend"] is None and got["power"] is None


def test_the_power_check_needs_no_server_and_names_the_driver_it_lacks() -> None:
    got = reasons(gpu_probe(server_stack_missing=["jupyter_server"], provisioner_registered=False))
    assert got["power"] is None and got["suspend"] is not None  # it drives a plain child process
    old_driver = reasons(gpu_probe(checkpoint_api=False, cuda_checkpoint=None, driver="550.54.15"))
    assert old_driver["power"] == old_driver["suspend"]
    assert "(driver 550.54.15; needs 570+)" in old_driver["power"]


def test_raw_allocator_reports_a_missing_driver_as_json(tmp_path: Path) -> None:
    if HAS_GPU:
        pytest.skip("a GPU is present")
    ready = tmp_path / "ready.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(GPU_DIR / "gpucheck" / "rawcuda.py"),
            "alloc",
            "--bytes",
            "1024",
            "--hold",
            "0",
            "--ready-file",
            str(ready),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 3
    report = json.loads(ready.read_text())
    assert report["ok"] is False and "libcuda.so.1 not loadable" in report["error"]


# --- the whole script here (no GPU) ---------------------------------------------------------------


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: run_all.sh would run the real checks")
def test_script_without_gpu_skips_everything_with_reasons_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_script(env={"OUT": str(out)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert list(rows) == list(CHECK_NAMES)
    for name, (result, _number, detail) in rows.items():
        assert result == "skip", name
        assert detail.startswith("no NVIDIA GPU"), (name, detail)
    payload = json.loads((out / "results.json").read_text())
    assert payload["summary"] == {"pass": 0, "fail": 0, "skip": len(CHECK_NAMES)}
    assert all(r["detail"] for r in payload["results"])
    assert (out / "results.md").read_text().count("| skip |") == len(CHECK_NAMES)
    run_log = (out / "run.log").read_text()  # $OUT gets a copy of the output
    assert all(f"{name} " in run_log for name in CHECK_NAMES) and "wrote " in run_log


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_require_gpu_exits_2_after_the_table() -> None:
    proc = run_script("--require-gpu", "--only", "inventory")
    assert proc.returncode == 2
    assert table_rows(proc.stdout)["inventory"][0] == "skip"
    assert "--require-gpu: no NVIDIA GPU" in proc.stderr


def test_one_check_failing_never_stops_the_others(tmp_path: Path) -> None:
    pidfile = tmp_path / "sleeper.pid"
    start = time.monotonic()
    proc = run_script(
        "--only",
        ",".join(["inventory", *SELFTEST]),
        "--out",
        str(tmp_path),
        env={"GPUCHECK_EXTRA_CHECKS": "gpucheck.selftest", "GPUCHECK_SELFTEST_PIDFILE": str(pidfile)},
    )
    assert time.monotonic() - start < 60
    assert proc.returncode == 1  # a check failed
    rows = table_rows(proc.stdout)
    assert list(rows) == ["inventory", *SELFTEST]
    assert rows["selftest-pass"][0] == "pass"
    assert rows["selftest-hang"][:1] == ["fail"] and "did not finish within 2 s" in rows["selftest-hang"][2]
    assert "exited with code 7 and no result" in rows["selftest-crash"][2]
    assert rows["selftest-raise"][2] == "RuntimeError: planted failure"
    assert rows["selftest-leak"][0] == "pass"
    # The process the check left in a session of its own was ended by the runner.
    sleeper = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{sleeper}").exists() and "Z" not in Path(f"/proc/{sleeper}/stat").read_text().split(")")[1][:3]:
        assert time.monotonic() < deadline, "sleeper still running"
        time.sleep(0.1)
    data = {r["check"]: r for r in json.loads((tmp_path / "results.json").read_text())["results"]}
    assert data["selftest-leak"]["data"]["left_behind"] == [f"killed sleeper (pid {sleeper})"]
    assert "Traceback" in data["selftest-raise"]["data"]["traceback"]


def test_budget_spent_skips_the_rest_with_a_reason() -> None:
    proc = run_script(
        "--only", "selftest-hang,selftest-raise", "--budget", "2.5", env={"GPUCHECK_EXTRA_CHECKS": "gpucheck.selftest"}
    )
    rows = table_rows(proc.stdout)
    assert rows["selftest-hang"][0] == "fail"
    assert rows["selftest-raise"][0] == "skip"
    assert (
        rows["selftest-raise"][2].startswith("not started: ")
        and "of the 2 s budget left, it needs 1 s" in rows["selftest-raise"][2]
    )


# --- the kernel code the GPU checks send compiles -------------------------------------------------


def test_kernel_code_of_every_check_compiles() -> None:
    from gpucheck.checks import common, overhead, power, suspend, watchdog
    from gpucheck.harness import PRELUDE

    snippets = {
        "prelude": PRELUDE,
        "overhead-setup": overhead.SETUP,
        "overhead-measure": overhead.MEASURE,
        "suspend-fill": suspend._fill(8),
        "suspend-verify": suspend.VERIFY,
        "power-child": power.CHILD,
        "watchdog-cell": watchdog._cell(5 * 1024**3, "/tmp/r", "/tmp/s", hold=90),
    }
    snippets.update({f"setup-{k}": v for k, v in common.SETUP.items()})
    for name, code in snippets.items():
        compile(code, name, "exec")


def test_slice_message_matcher() -> None:
    from gpucheck.checks.common import is_framework_oom, names_slice

    gib4 = 4 * 1024**3
    hint = "gpupool: this kernel's GPU slice is 4 GiB; ask for more with %gpupool reserve 8GiB"
    assert names_slice("Traceback ...\n" + hint, gib4)
    assert not names_slice(hint.replace("4 GiB", "8 GiB"), gib4)  # names another size only
    assert not names_slice("CUDA out of memory. Tried to allocate 4.00 GiB", gib4)  # framework text, not ours
    assert names_slice("gpupool: slice 6.5 GiB", int(6.5 * 1024**3))
    assert is_framework_oom("OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.40 GiB")
    assert is_framework_oom("JaxRuntimeError", "RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    assert not is_framework_oom("ValueError", "bad shape")


# --- the power check's statistics ----------------------------------------------------------------


def test_the_released_held_verdict_wants_the_request_kept_waiting_at_nvmls_figure_then_granted() -> None:
    from gpucheck.checks.released import GIB, problems_of

    good = {"state_while_held": "queued", "listed_bytes": 4 * GIB + 2**20, "nvml_bytes": 4 * GIB, "granted_after_exit_s": 0.4}
    assert problems_of(good) == []
    assert "was granted while the released process" in problems_of({**good, "state_while_held": "granted"})[0]
    assert "not listed as unpooled use" in problems_of({**good, "listed_bytes": 0})[0]
    assert "kept 2.00 GiB taken, NVML showed the process holding 4.00 GiB" in problems_of({**good, "listed_bytes": 2 * GIB})[0]
    assert "not granted within 5 s" in problems_of({**good, "granted_after_exit_s": None})[0]


def test_power_median_is_in_watts_and_refuses_no_readings() -> None:
    from gpucheck.checks.power import median_watts

    assert median_watts([71_000, 250_000, 70_500]) == 71.0  # one spike does not move it
    assert median_watts([70_000, 71_000, 72_000, 90_000]) == 71.5
    with pytest.raises(ValueError, match="no power readings"):
        median_watts([])


def test_power_window_summary_names_the_usual_performance_state() -> None:
    from gpucheck.checks.power import PSTATE_UNKNOWN, pstate_name, summarize_window

    summary = summarize_window([(112_000, 0), (110_000, 0), (150_000, 2), (111_000, PSTATE_UNKNOWN)])
    assert summary["median_w"] == 111.5 and (summary["min_w"], summary["max_w"]) == (110.0, 150.0)
    assert (summary["first_w"], summary["last_w"]) == (112.0, 111.0)
    assert summary["samples"] == 4 and summary["pstate"] == "P0"
    assert summary["pstates"] == {"P0": 2, "P2": 1, "P?": 1}
    assert [pstate_name(p) for p in (0, 8, 15, 16, PSTATE_UNKNOWN)] == ["P0", "P8", "P15", "P?", "P?"]


@pytest.mark.parametrize(
    ("baseline", "idle", "suspended", "within", "allowed"),
    [
        (72.0, 112.0, 72.0, True, 5.0),  # back to the baseline
        (72.0, 112.0, 76.9, True, 5.0),  # 5 W is the floor of the margin
        (72.0, 112.0, 77.5, False, 5.0),  # the context still draws power
        (72.0, 112.0, 65.0, True, 5.0),  # below the baseline is fine
        (400.0, 460.0, 419.0, True, 20.0),  # 5 % of a large baseline is more than 5 W
        (400.0, 460.0, 421.0, False, 20.0),
    ],
)
def test_power_verdict_allows_5_watts_or_5_percent_over_the_baseline(
    baseline: float, idle: float, suspended: float, within: bool, allowed: float
) -> None:
    from gpucheck.checks.power import PowerVerdict

    verdict = PowerVerdict(baseline, idle, suspended)
    assert verdict.within is within and verdict.allowed_w == allowed
    assert verdict.context_w == idle - baseline and verdict.saved_w == idle - suspended
    assert verdict.to_json()["within"] is within
    assert verdict.explain().startswith("suspended within" if within else "suspended NOT within")
    assert verdict.number() == f"baseline {baseline:.1f} W, idle context {idle:.1f} W, suspended {suspended:.1f} W"


def test_power_sampling_reads_every_interval_for_the_window() -> None:
    from gpucheck.checks.power import sample

    now = [0.0]
    readings = iter(range(1000))

    def sleep(seconds: float) -> None:
        now[0] += seconds

    got = sample(lambda: (float(next(readings)), 0), 10.0, 0.2, clock=lambda: now[0], sleep=sleep)
    assert len(got) == 51 and got[0] == (0.0, 0) and got[-1] == (50.0, 0)  # t = 0, 0.2, ..., 10.0
    assert len(sample(lambda: (1.0, 0), 0.0, 0.2, clock=lambda: now[0], sleep=sleep)) == 1


# --- the harness against a real jupyter_server (simulated pool, CPU kernels) -----------------------


@pytest.mark.slow
def test_harness_starts_a_server_leases_kernels_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gpucheck.checks.common import is_framework_oom, names_slice
    from gpucheck.harness import JupyterServer, bare_kernelspec, reap_registered

    pidfile = tmp_path / "pids.jsonl"
    monkeypatch.setenv("GPUCHECK_PIDFILE", str(pidfile))
    server = JupyterServer(
        tmp_path / "srv",
        env={"GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DEFAULT_MEMORY": "4GiB"},
        kernelspecs=bare_kernelspec(),
        log=lambda m: None,
    )
    with server:
        sliced = server.kernel()
        bare = server.kernel("python3-bare")
        assert sliced.env["GPUPOOL_MEMORY_LIMIT"] == str(4 * 1024**3)
        assert sliced.env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        assert "GPUPOOL_LEASE_ID" not in bare.env  # the opt-out kernelspec gets no lease
        status, body = server.gpupool_kernel(sliced.kernel_id)
        assert status == 200 and body["state"] == "granted" and body["memory"] == 4 * 1024**3
        failed = sliced.run("print('before')\nraise ValueError('planted')")
        assert (failed.status, failed.ename, failed.evalue, failed.stdout) == (
            "error",
            "ValueError",
            "planted",
            "before\n",
        )
        # The OOM text path the slice checks read: the kernel extension's hint on a framework OOM.
        if importlib.util.find_spec("torch") is not None:
            oom = sliced.run(
                "import torch\nraise torch.cuda.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.40 GiB')"
            )
            assert oom.ename == "OutOfMemoryError" and is_framework_oom(oom.ename, oom.evalue)
            assert names_slice(oom.all_text, 4 * 1024**3), oom.all_text
        msg_id = sliced.submit(
            "import time; time.sleep(0.5)\n" + __import__("gpucheck.checks.common", fromlist=["emit"]).emit("{'x': 1}")
        )
        assert sliced.collect(msg_id, timeout=30).last() == {"x": 1}
        pids = [sliced.pid, bare.pid, server.proc.pid]
    for pid in pids:
        deadline = time.monotonic() + 15
        while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]:
            assert time.monotonic() < deadline, f"pid {pid} outlived the server"
            time.sleep(0.1)
    assert reap_registered(str(pidfile)) == []  # nothing left for the runner to kill
    registered = [json.loads(line)["what"] for line in pidfile.read_text().splitlines()]
    assert registered[0] == "jupyter_server" and len(registered) == 3


# --- bootstrap: wheels for the bare GPU machine ------------------------------------------------------


def make_wheel(folder: Path, name: str, version: str = "1.0", tag: str = "py3-none-any") -> Path:
    import zipfile

    path = folder / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(
            f"{name}-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        archive.writestr(
            f"{name}-{version}.dist-info/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tag}\n"
        )
        archive.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


def test_bootstrap_picks_wheels_this_python_can_use() -> None:
    from gpucheck.bootstrap import compatible

    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    other = "cp39" if here != "cp39" else "cp38"
    assert compatible(Path("a-1-py3-none-any.whl"))
    assert compatible(Path("b-1-py2.py3-none-any.whl"))
    assert compatible(Path(f"c-1-{here}-{here}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")) == (
        os.uname().machine == "x86_64"
    )
    assert not compatible(Path(f"d-1-{other}-{other}-manylinux_2_17_x86_64.whl"))
    assert compatible(Path("e-1-cp38-abi3-manylinux_2_28_x86_64.whl")) == (os.uname().machine == "x86_64")
    assert not compatible(Path("f-1-cp399-abi3-manylinux_2_28_x86_64.whl"))  # a Python newer than this one
    assert not compatible(Path("g-1-py3-none-win_amd64.whl"))


def test_bootstrap_installs_only_what_is_missing_and_registers_entry_points(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    wheels.mkdir()
    make_wheel(wheels, "gpucheck_demo_pkg")
    make_wheel(wheels, "pytest", version="0.0.1")  # installed here already: must not shadow it
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def bootstrap() -> str:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpucheck.bootstrap",
                "--wheels",
                str(wheels),
                "--site",
                str(site),
                "--repo",
                str(REPO),
            ],
            cwd=GPU_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return proc.stdout

    first_run = bootstrap()
    assert "installed 1 of 2 wheels" in first_run and "gpucheck-demo-pkg" in first_run
    assert (site / "gpucheck_demo_pkg" / "__init__.py").exists()
    assert not (site / "pytest").exists()
    assert "already installed" in bootstrap()  # a second run on a warm machine installs nothing


def test_bootstrap_writes_entry_points_from_pyproject(tmp_path: Path) -> None:
    from gpucheck.bootstrap import register_entry_points

    repo = tmp_path / "repo"
    (repo / "jupyter_gpupool").mkdir(parents=True)
    (repo / "jupyter_gpupool" / "_version.py").write_text('__version__ = "9.9.9"\n')
    (repo / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    site = tmp_path / "site"
    assert "registered jupyter_gpupool 9.9.9" in register_entry_points(repo, site, force=True)
    text = (site / "jupyter_gpupool-9.9.9.dist-info" / "entry_points.txt").read_text()
    assert "[jupyter_client.kernel_provisioners]" in text
    assert "gpupool-provisioner = jupyter_gpupool.provisioner:GpuPoolProvisioner" in text
    assert "Name: jupyter-gpupool" in (site / "jupyter_gpupool-9.9.9.dist-info" / "METADATA").read_text()


def test_unpack_is_a_working_install_without_pip(tmp_path: Path) -> None:
    from gpucheck.bootstrap import unpack

    wheel = make_wheel(tmp_path, "gpucheck_unpacked", version="2.5")
    unpack(wheel, tmp_path / "site")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import gpucheck_unpacked, importlib.metadata as m; print(gpucheck_unpacked.VERSION, m.version('gpucheck_unpacked'))",
        ],
        env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == ["2.5", "2.5"]


def test_the_fast_parking_check_skips_without_torch_memory_saver_and_its_child_compiles() -> None:
    from gpucheck.checks import fastpark

    probe = gpu_probe(frameworks={"torch": "2.11.0"})
    assert reasons(probe)["fast-parking"] == f"torch-memory-saver not installed for {probe.python} (import torch_memory_saver fails)"
    compile(fastpark.CHILD, "fast-parking child", "exec")
