"""A plain ``jupyter nbconvert --execute`` with the stock ``python3`` kernelspec is pooled as ``batch``.

Nothing names our provisioner here: the kernel reads the IPython kernel config the wheel installs
in ``sys.prefix/etc/ipython`` and leases for itself. The wheel's layout is built in a throwaway
virtual environment (its own ``sys.prefix``, the shared site-packages), never in this machine's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest
import tomllib
from envs import environment_over_this_one

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest, LeaseState, PriorityClass
from jupyter_gpupool.enforcement.unpooled import find_kernel_roots
from jupyter_gpupool.kernel import autolease

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3
ENV_CELL = (
    "import os, json\n"
    "started = dict(v.split('=', 1) for v in open('/proc/self/environ').read().split('\\0') if '=' in v)\n"
    "print(json.dumps({'pid': os.getpid(), 'started_with_lease': started.get('GPUPOOL_LEASE_ID'), **{k: os.environ.get(k) for k in "
    "('GPUPOOL_LEASE_ID', 'CUDA_VISIBLE_DEVICES', 'GPUPOOL_MEMORY_LIMIT', 'GPUPOOL_UNAVAILABLE')}}))"
)

pytestmark = pytest.mark.slow


# --- the wheel's layout in a prefix of its own -----------------------------------------------------


def shared_data() -> dict[str, str]:
    """pyproject.toml's wheel shared-data: source folder → path under the install prefix."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    return project["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]


@pytest.fixture(scope="module")
def kernel_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment over this one's packages (from a venv or not), with the kernel config
    where the wheel puts it."""
    prefix = environment_over_this_one(tmp_path_factory.mktemp("prefix") / "venv", commands=()).root
    target = {src: dest for src, dest in shared_data().items() if dest == "etc/ipython"}
    assert target, "pyproject.toml's shared-data installs nothing into etc/ipython"
    for src, dest in target.items():
        shutil.copytree(REPO / src, prefix / dest, dirs_exist_ok=True)
    return prefix


@pytest.fixture
def run_env(kernel_prefix: Path, gpupool_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The environment of a batch run: the simulated pool, a private IPython and Jupyter home."""
    env = dict(os.environ)
    # PYTEST_CURRENT_TEST: ipykernel sends the kernel's stderr (file descriptor 2) into the running
    # cell, except under pytest; a user's run has no such variable.
    for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_KERNEL_ID", "GPUPOOL_UNAVAILABLE", autolease.AUTOLEASE_ENV, "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    env.update(
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
    )
    return env


def python_of(prefix: Path) -> str:
    return str(prefix / "bin" / "python")


def write_notebook(path: Path, *cells: str, kernel: str = "python3") -> Path:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": kernel, "display_name": kernel, "language": "python"}})
    nb.cells.extend(nbformat.v4.new_code_cell(cell) for cell in cells)
    nbformat.write(nb, path)
    return path


def nbconvert(prefix: Path, notebook: Path, env: dict[str, str], *extra: str) -> subprocess.Popen[bytes]:
    command = [python_of(prefix), "-m", "nbconvert", "--to", "notebook", "--execute", str(notebook), *extra]
    command += ["--output", notebook.stem + ".done.ipynb"]
    return subprocess.Popen(command, env=env, cwd=notebook.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


class Output:
    """What a running nbconvert prints, read as it comes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    def wait_for(self, text: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert proc.poll() is None, "".join(self.lines)
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s: {''.join(self.lines)}"
            time.sleep(0.1)


_outputs: dict[int, Output] = {}


def watch(proc: subprocess.Popen[bytes]) -> Output:
    return _outputs.setdefault(proc.pid, Output(proc))


def finish(proc: subprocess.Popen[bytes], timeout: float = 120) -> str:
    out = watch(proc)
    try:
        proc.wait(timeout=timeout)
        out.thread.join(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(out.lines)
    assert proc.returncode == 0, text
    return text


def outputs(notebook: Path) -> list[list[dict[str, Any]]]:
    done = nbformat.read(notebook.with_name(notebook.stem + ".done.ipynb"), as_version=4)
    return [cell.outputs for cell in done.cells]


def printed(cell_outputs: list[dict[str, Any]]) -> dict[str, Any]:
    text = "".join(o.get("text", "") for o in cell_outputs if o.get("name") == "stdout")
    return json.loads(text.strip().splitlines()[-1])


def gpupool_cli(env: dict[str, str], *args: str) -> Any:
    result = subprocess.run([sys.executable, "-m", "jupyter", "gpupool", *args], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout) if "--json" in args else result.stdout


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"nbconvert exited before {path.name}: {proc.stdout.read().decode() if proc.stdout else ''}")
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.1)


# --- the promise -------------------------------------------------------------------------------------


def test_plain_nbconvert_leases_batch_and_gives_it_back(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    running, go = tmp_path / "running", tmp_path / "go"
    hold = (
        "import pathlib, time\n"
        f"pathlib.Path({str(running)!r}).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.05)"
    )
    notebook = write_notebook(tmp_path / "grade.ipynb", ENV_CELL, hold, "%gpupool status")
    proc = nbconvert(kernel_prefix, notebook, run_env)
    try:
        wait_for_file(running, proc)
        listed = gpupool_cli(run_env, "leases", "--all", "--json")
        (live,) = Pool.from_env().leases()
        # The pool's watcher finds the kernel's GPU processes by the lease named in the environment
        # the kernel started with: its memory counts for its lease, not as used outside the pool.
        roots = find_kernel_roots([live.holder_pid], {live.id: live})
        go.touch()
    finally:
        output = finish(proc)
    seen = printed(outputs(notebook)[0])
    pool = Pool.from_env()
    lease = pool.get(seen["GPUPOOL_LEASE_ID"])
    # While it ran, `jupyter gpupool leases` listed it: batch, held by the kernel's own process.
    row = next(r for r in listed if r["id"] == lease.id)
    assert row["state"] == "granted" and row["priority"] == "batch"
    assert lease.holder_pid == seen["pid"] and lease.priority is PriorityClass.BATCH
    assert seen["started_with_lease"] == lease.id and roots == {lease.id: seen["pid"]}
    assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(lease.devices) and lease.devices
    assert seen["GPUPOOL_MEMORY_LIMIT"] == str(8 * GIB)
    # Released when the kernel exited, and %gpupool worked in it.
    assert lease.state is LeaseState.RELEASED and lease.release_reason == autolease.EXIT_REASON
    status = outputs(notebook)[2][0]["data"]["text/plain"]
    assert "granted" in status and lease.id in status, status
    assert "CPU-only" not in output


def test_a_kernel_slow_to_exit_gives_its_lease_back_before_its_manager_kills_it(
    kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path
):
    # A thread the notebook left running keeps the kernel from exiting: its manager terminates it
    # (jupyter_client: SIGTERM, then SIGKILL) and no atexit handler runs. The lease is given back
    # on the shutdown request itself, with the reason a clean exit gives.
    linger = "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()"
    notebook = write_notebook(tmp_path / "linger.ipynb", ENV_CELL, linger)
    finish(nbconvert(kernel_prefix, notebook, run_env, "--ExecutePreprocessor.shutdown_kernel=graceful"))
    lease = Pool.from_env().get(printed(outputs(notebook)[0])["GPUPOOL_LEASE_ID"])
    assert lease.state is LeaseState.RELEASED and lease.release_reason == autolease.EXIT_REASON, lease


def test_a_queued_batch_kernel_waits_in_its_first_cell(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    """A full pool and no start wait (``GPUPOOL_START_WAIT=0``): the kernel answers its client at once
    (no startup timeout), and its first cell waits for the grant, as long as the queue takes."""
    pool = Pool.from_env()
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))
    assert holder.state is LeaseState.GRANTED
    notebook = write_notebook(tmp_path / "queued.ipynb", ENV_CELL)
    proc = nbconvert(kernel_prefix, notebook, {**run_env, autolease.START_WAIT_ENV: "0"})
    try:
        watch(proc).wait_for("gpupool: waiting for a GPU slice (batch)", proc)  # the first cell waits
        queued = [lease for lease in pool.leases() if lease.state is LeaseState.QUEUED]
        time.sleep(1.0)
        assert proc.poll() is None, "the notebook ran while the pool was full"
        pool.release(holder.id, reason="the live user is done")
    finally:
        output = finish(proc)
    cell = outputs(notebook)[0]
    seen = printed(cell)
    assert seen["GPUPOOL_LEASE_ID"] == queued[0].id and queued[0].priority is PriorityClass.BATCH
    assert seen["CUDA_VISIBLE_DEVICES"] == ",".join(pool.get(queued[0].id).devices) != ""
    # The wait was said on the terminal; the saved notebook keeps only the cell's own output.
    assert "waits for a GPU slice as batch (position 1 of 1" in output, output
    assert "granted after" in output, output
    assert [o.get("output_type") for o in cell] == ["stream"], cell


def test_a_start_wait_that_runs_out_then_a_grant_in_the_first_cell_keeps_the_saved_cell_clean(
    kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path
):
    """A start wait that runs out (``GPUPOOL_START_WAIT=3``), then the grant while the first cell waits:
    the terminal says every line (the wait, "granted after"); the saved cell keeps only its own output
    (the kernel's stderr reaches the cell, so a line for the terminal must not go through it)."""
    pool = Pool.from_env()
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))
    # The cell runs on a while after the grant: a line the kernel wrote to its stderr reaches the cell by then.
    notebook = write_notebook(tmp_path / "late.ipynb", ENV_CELL + "\nimport time\ntime.sleep(2)")
    proc = nbconvert(kernel_prefix, notebook, {**run_env, autolease.START_WAIT_ENV: "3"})
    try:
        out = watch(proc)
        out.wait_for("still queued 3 s after the kernel started", proc)
        deadline = time.monotonic() + 90
        while not any("waiting for a GPU slice (batch)" in line for line in "".join(out.lines).split("still queued", 1)[1].splitlines()):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(out.lines)
            time.sleep(0.1)  # the first cell waits
        pool.release(holder.id, reason="the live user is done")
    finally:
        output = finish(proc)
    cell = outputs(notebook)[0]
    assert printed(cell)["CUDA_VISIBLE_DEVICES"]
    assert "granted after" in output, output
    assert [(o.get("output_type"), o.get("name")) for o in cell] == [("stream", "stdout")], cell


def test_a_bad_start_wait_says_so_on_the_terminal_and_the_kernel_starts(
    kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path
):
    """One line naming the variable, its value and the accepted form, on a free pool and a full one
    (said once, though a queued kernel reads it again once it has restarted itself); the default is used."""
    pool = Pool.from_env()
    notebook = write_notebook(tmp_path / "bad.ipynb", "print('ran')")
    for bad, full in (("abc", False), ("-5", True)):
        holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user")) if full else None
        proc = nbconvert(kernel_prefix, notebook, {**run_env, autolease.START_WAIT_ENV: bad})
        try:
            if holder is not None:
                watch(proc).wait_for("waiting for a GPU slice (batch)", proc)
                pool.release(holder.id, reason="the live user is done")  # granted: the kernel starts
        finally:
            output = finish(proc)
        lines = [line for line in output.splitlines() if autolease.START_WAIT_ENV in line and "ignored" in line]
        assert len(lines) == 1, output
        assert f"{autolease.START_WAIT_ENV}={bad!r}" in lines[0] and "seconds from 0 to 3599" in lines[0], lines
        assert "using 45" in lines[0] and "Traceback" not in output, output
        assert outputs(notebook)[0] == [{"name": "stdout", "output_type": "stream", "text": "ran\n"}]


def test_start_wait_parses_seconds_and_says_why_it_ignores_a_bad_value(monkeypatch: pytest.MonkeyPatch):
    said: list[str] = []
    monkeypatch.setattr(autolease, "say", lambda text, stream=None: said.append(text))
    assert autolease.start_wait({}) == autolease.DEFAULT_START_WAIT
    assert autolease.start_wait({autolease.START_WAIT_ENV: " 12.5 "}) == 12.5
    assert autolease.start_wait({autolease.START_WAIT_ENV: "0"}) == 0
    for bad in ("abc", "-5", "nan", "inf", "3600"):
        assert autolease.start_wait({autolease.START_WAIT_ENV: bad}) == autolease.DEFAULT_START_WAIT
    assert autolease.start_wait({autolease.START_WAIT_ENV: "abc"}, quiet=True) == autolease.DEFAULT_START_WAIT
    assert len(said) == 5 and all("ignored GPUPOOL_START_WAIT=" in line and "seconds from 0 to 3599" in line for line in said), said


def test_a_withdrawn_request_stops_the_waiting_cell_and_leaves_the_kernel_cpu_only(
    kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path
):
    pool = Pool.from_env()
    pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))
    notebook = write_notebook(tmp_path / "withdrawn.ipynb", "print('never ran')", ENV_CELL)
    proc = nbconvert(kernel_prefix, notebook, run_env, "--allow-errors")
    try:
        watch(proc).wait_for("gpupool: waiting for a GPU slice (batch)", proc)
        queued = [lease for lease in pool.leases() if lease.state is LeaseState.QUEUED]
        pool.release(queued[0].id, reason="withdrawn by an admin")
    finally:
        output = finish(proc)
    first, second = outputs(notebook)
    error = [o for o in first if o.get("output_type") == "error"]
    assert len(error) == 1 and "never ran" not in json.dumps(first), first
    assert "withdrawn by an admin" in " ".join(error[0]["traceback"]) and "CPU-only" in " ".join(error[0]["traceback"])
    seen = printed(second)
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["GPUPOOL_LEASE_ID"] is None and seen["GPUPOOL_UNAVAILABLE"]
    assert "runs CPU-only" in output


def test_a_kernelspec_naming_local_provisioner_gets_nothing(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    kernels = tmp_path / "jupyter-data" / "kernels" / "plain"
    kernels.mkdir(parents=True)
    spec = {
        "argv": [python_of(kernel_prefix), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (no pool)",
        "language": "python",
        "metadata": {"kernel_provisioner": {"provisioner_name": "local-provisioner"}},
    }
    (kernels / "kernel.json").write_text(json.dumps(spec))
    # %lsmagic's table (each magic's class), printed: IPython 9's %lsmagic sends no application/json.
    lsmagic = ("import json; print(json.dumps({kind: {name: type(f.__self__).__name__ if hasattr(f, '__self__') else 'Other' "
               "for name, f in table.items()} for kind, table in get_ipython().magics_manager.lsmagic().items()}))")
    notebook = write_notebook(tmp_path / "plain.ipynb", ENV_CELL, lsmagic, kernel="plain")
    finish(nbconvert(kernel_prefix, notebook, run_env))
    seen = printed(outputs(notebook)[0])
    assert seen["GPUPOOL_LEASE_ID"] is None and seen["CUDA_VISIBLE_DEVICES"] is None
    # Not the pool's extension: only the %gpupool that says, in one line, why this kernel runs without the pool.
    magics = json.loads(outputs(notebook)[1][0]["text"])
    assert magics["line"]["gpupool"] == "Other" and "GpuPoolMagics" not in json.dumps(magics), magics
    assert Pool.from_env().leases(include_released=True) == []


def test_gpupool_autolease_off_gets_nothing(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    notebook = write_notebook(tmp_path / "off.ipynb", ENV_CELL)
    finish(nbconvert(kernel_prefix, notebook, {**run_env, autolease.AUTOLEASE_ENV: "off"}))
    seen = printed(outputs(notebook)[0])
    assert seen["GPUPOOL_LEASE_ID"] is None and seen["CUDA_VISIBLE_DEVICES"] is None
    assert Pool.from_env().leases(include_released=True) == []


def test_an_unusable_pool_means_cpu_only_with_one_line(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    broken = tmp_path / "not-a-pool"
    broken.mkdir()
    notebook = write_notebook(tmp_path / "broken.ipynb", ENV_CELL, "%gpupool status")
    output = finish(nbconvert(kernel_prefix, notebook, {**run_env, "GPUPOOL_DB": str(broken)}))
    seen = printed(outputs(notebook)[0])
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["GPUPOOL_LEASE_ID"] is None
    assert seen["GPUPOOL_UNAVAILABLE"]
    lines = [line for line in output.splitlines() if line.startswith("gpupool:")]
    assert len(lines) == 1 and "runs CPU-only (CUDA_VISIBLE_DEVICES='')" in lines[0], output
    assert "unavailable" in outputs(notebook)[1][0]["data"]["text/plain"]


def test_a_killed_kernel_gives_its_lease_back(kernel_prefix: Path, run_env: dict[str, str], monkeypatch: pytest.MonkeyPatch):
    """SIGKILL runs no exit handler: the lease's holder is the kernel's process, so the pool's next round frees it."""
    from jupyter_client.manager import KernelManager

    for name in ("IPYTHONDIR", "JUPYTER_RUNTIME_DIR"):
        monkeypatch.setenv(name, run_env[name])
    km = KernelManager(kernel_name="python3")
    km.kernel_spec.argv[0] = python_of(kernel_prefix)
    km.start_kernel(env=run_env)
    try:
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=60)
        pool = Pool.from_env()
        (lease,) = pool.leases()
        assert lease.state is LeaseState.GRANTED and lease.holder_pid == km.provisioner.process.pid
        os.kill(lease.holder_pid, signal.SIGKILL)
        km.provisioner.process.wait(timeout=30)
        client.stop_channels()
        pool.tick()
        after = pool.get(lease.id)
        assert after.state is LeaseState.RELEASED and "holder process" in (after.release_reason or "")
    finally:
        if km.is_alive():
            km.shutdown_kernel(now=True)


# --- deciding, in process --------------------------------------------------------------------------


def test_stand_aside_reasons(tmp_path: Path):
    no_gpu = lambda env: False
    gpu = lambda env: True
    assert autolease.stand_aside_reason({"GPUPOOL_AUTOLEASE": "off"}, has_gpu=gpu) == "GPUPOOL_AUTOLEASE=off"
    assert "provisioner" in autolease.stand_aside_reason({"GPUPOOL_LEASE_ID": "l-1"}, has_gpu=gpu)
    assert "provisioner" in autolease.stand_aside_reason({"GPUPOOL_UNAVAILABLE": "broken"}, has_gpu=gpu)
    assert "no NVIDIA driver" in autolease.stand_aside_reason({}, has_gpu=no_gpu)
    assert "Slurm job 42" in autolease.stand_aside_reason({"SLURM_JOB_ID": "42"}, has_gpu=gpu)
    assert autolease.stand_aside_reason({}, has_gpu=gpu) is None
    assert not autolease.has_gpu_to_pool({}, markers=(str(tmp_path / "nothing"),))
    assert autolease.has_gpu_to_pool({"GPUPOOL_SIMULATE": "1x16GiB"}, markers=())
    connection = tmp_path / "kernel-abc.json"
    connection.write_text(json.dumps({"kernel_name": "no-such-kernelspec"}))
    assert autolease.kernel_name_of(str(connection)) == "no-such-kernelspec"
    assert autolease.stand_aside_reason({}, str(connection), has_gpu=gpu) is None  # not found: pooled
    assert autolease.kernel_name_of(str(tmp_path / "missing.json")) == ""


def test_standing_aside_on_a_host_without_gpu_imports_none_of_the_pool(run_env: dict[str, str]):
    """Import and decision in a fresh interpreter that already has ipykernel loaded, as a kernel has.
    What it costs in time is measured in bench/stand_aside.py (against ipykernel's own import)."""
    env = {k: v for k, v in run_env.items() if k != "GPUPOOL_SIMULATE"}
    code = (
        "import ipykernel.kernelapp\n"
        "from jupyter_gpupool.kernel.autolease import configure\n"
        "result = configure()\n"
        "print(result, sorted(m for m in __import__('sys').modules if m.startswith('jupyter_gpupool')))"
    )
    if any(os.path.exists(p) for p in autolease.NVIDIA_MARKERS):
        pytest.skip("this host has an NVIDIA driver")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    result, modules = out.split(" ", 1)
    assert result == "None"
    # Standing aside imports none of the pool: only the package, its version and this module.
    assert eval(modules) == ["jupyter_gpupool", "jupyter_gpupool._version", "jupyter_gpupool.kernel", "jupyter_gpupool.kernel.autolease"]


# --- a server's opt-out reaches its kernels ------------------------------------------------------


@pytest.mark.gpupool_config({"GpuPoolExtension": {"make_default_provisioner": False}})
def test_a_server_that_pools_no_kernel_by_default_marks_them(jp_serverapp, gpupool_ext):
    spec = jp_serverapp.kernel_spec_manager.get_kernel_spec("python3")
    assert "kernel_provisioner" not in spec.metadata
    assert spec.env[autolease.AUTOLEASE_ENV] == "off"


def test_a_pooling_server_marks_only_the_kernelspecs_it_leaves_alone(jp_serverapp, gpupool_ext, tmp_path: Path):
    ksm = jp_serverapp.kernel_spec_manager
    assert autolease.AUTOLEASE_ENV not in (ksm.get_kernel_spec("python3").env or {})
    plain = Path(ksm.kernel_dirs[0]) / "plain"
    plain.mkdir(parents=True, exist_ok=True)
    (plain / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "plain",
                "language": "python",
                "metadata": {"kernel_provisioner": {"provisioner_name": "local-provisioner"}},
            }
        )
    )
    assert ksm.get_kernel_spec("plain").env[autolease.AUTOLEASE_ENV] == "off"
