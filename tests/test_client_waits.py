"""Clients that run notebooks wait their turn on a full pool and give the same result as on an empty one.

Each client runs as it does for its users, on a full simulated ``1x16GiB`` pool, with its
configurable timeouts scaled down where the test would otherwise take minutes, keeping the wait in
the same relation to them as with the defaults (nbgrader itself: tests/test_nbgrader_waits.py):

- ``jupyter run`` (10 s for the whole script's output, 60 s for the start: its defaults): a 15 s wait,
  then the script's output, exit 0;
- a grader (nbclient as nbgrader's autograder drives it) killed while its kernel waits: the kernel
  gives its request back and exits;
- jupyter_server's culler does not cull a kernel while it waits in the queue, and culls it by its
  usual rule once it is granted and idle;
- a notebook with ``%gpupool`` lines runs where there is no pool, one line per use;
- an admin's release of a slice just granted is not called a release before the grant.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import nbformat
import pytest
import tomllib
from envs import environment_over_this_one

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState
from jupyter_gpupool.kernel import autolease
from jupyter_gpupool.kernel.ports import kernel_ports

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3

pytestmark = pytest.mark.slow

#: nbgrader's ``Execute`` preprocessor, scaled: a per-cell timeout that interrupts, errors allowed.
GRADER = r"""
import sys, nbformat
from nbclient import NotebookClient

nb = nbformat.read(sys.argv[1], as_version=4)
client = NotebookClient(nb, kernel_name="python3", timeout=5, interrupt_on_timeout=True, allow_errors=True,
                        raise_on_iopub_timeout=True, startup_timeout=35)
code = 0
try:
    client.execute()
except Exception as err:  # nbgrader: UnresponsiveKernelError, the submission is not graded
    print(f"NOT GRADED: {type(err).__name__}: {err}", flush=True)
    code = 2
nbformat.write(nb, sys.argv[2])
sys.exit(code)
"""
#: A submission: its first cell imports, its test cell needs that import.
SUBMISSION = ("import math, os", "assert math.sqrt(16) == 4\nprint('test passed')")


@pytest.fixture(scope="module")
def kernel_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An environment over this one's packages with the kernel config where the wheel puts it, and ``jupyter-run``."""
    prefix = environment_over_this_one(tmp_path_factory.mktemp("prefix") / "venv", commands=("jupyter-run",)).root
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    shared = project["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"]
    for src, dest in shared.items():
        if dest == "etc/ipython":
            shutil.copytree(REPO / src, prefix / dest, dirs_exist_ok=True)
    return prefix


@pytest.fixture
def run_env(kernel_prefix: Path, gpupool_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_KERNEL_ID", "GPUPOOL_UNAVAILABLE", autolease.AUTOLEASE_ENV, autolease.START_WAIT_ENV):
        env.pop(name, None)
    env.update(
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
        PATH=f"{kernel_prefix / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


def write_notebook(path: Path, *cells: str) -> Path:
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells.extend(nbformat.v4.new_code_cell(cell) for cell in cells)
    nbformat.write(nb, path)
    return path


class Run:
    """A client process, its output read as it comes."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path) -> None:
        self.proc = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace"))

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def finish(self, timeout: float) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.reader.join(timeout=30)
        return self.proc.returncode


def fill_pool() -> tuple[Pool, Lease]:
    """The whole simulated GPU held by a live user (this test process)."""
    pool = Pool.from_env()
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))
    assert holder.state is LeaseState.GRANTED
    return pool, holder


def queued_request(pool: Pool, run: Run, timeout: float = 90) -> Lease:
    """The client's kernel's request, once it waits in the queue."""
    deadline = time.monotonic() + timeout
    while True:
        waiting = [lease for lease in pool.leases() if lease.state is LeaseState.QUEUED]
        if waiting:
            return waiting[0]
        assert run.proc.poll() is None, f"the client ended before its kernel queued:\n{run.text}"
        assert time.monotonic() < deadline, f"no queued request within {timeout} s:\n{run.text}"
        time.sleep(0.1)


def ports_free_to_others(runtime_dir: Path) -> list[int]:
    """The ports of the waiting kernel's connection file that another process could bind now
    (all of them while there is no connection file yet)."""
    files = sorted(runtime_dir.glob("kernel-*.json"))
    ip, ports = kernel_ports(str(files[0])) if files else ("", [0])
    free = []
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind((ip, port))
            except OSError:
                continue
            free.append(port)
    return free


def grade(kernel_prefix: Path, notebook: Path, env: dict[str, str]) -> Run:
    graded = notebook.with_name(notebook.stem + ".graded.ipynb")
    return Run([str(kernel_prefix / "bin" / "python"), "-c", GRADER, str(notebook), str(graded)], env, notebook.parent)


# --- jupyter run --------------------------------------------------------------------------------------


def test_jupyter_run_waits_fifteen_seconds_then_prints_the_scripts_output(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    """``jupyter run``'s 10 s is for the whole script's output: the kernel's wait happens before it
    answers ``kernel_info`` (60 s), with the default start wait."""
    pool, holder = fill_pool()
    script = tmp_path / "script.py"
    script.write_text("import os\nprint('script ran with CUDA_VISIBLE_DEVICES=' + os.environ['CUDA_VISIBLE_DEVICES'])\n")
    run = Run([str(kernel_prefix / "bin" / "jupyter-run"), str(script)], run_env, tmp_path)
    try:
        queued = queued_request(pool, run)
        # The kernel keeps the ports its client chose bound while it waits: neither another process
        # nor its client's reconnecting sockets take one before the kernel can bind it.
        runtime = Path(run_env["JUPYTER_RUNTIME_DIR"])
        deadline = time.monotonic() + 60
        while ports_free_to_others(runtime) and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ports_free_to_others(runtime), f"the waiting kernel leaves ports free: {ports_free_to_others(runtime)}\n{run.text}"
        time.sleep(15)
        assert run.proc.poll() is None, run.text
        assert not ports_free_to_others(runtime), run.text
        pool.release(holder.id, reason="the live user is done")
    finally:
        code = run.finish(timeout=120)
    assert code == 0, run.text
    granted = pool.get(queued.id)
    assert f"script ran with CUDA_VISIBLE_DEVICES={','.join(granted.devices)}" in run.text, run.text
    assert "waiting for a GPU slice (batch), position 1 of 1" in run.text, run.text


# --- jupyter_server's culler --------------------------------------------------------------------------


@pytest.mark.gpupool_config({"MappingKernelManager": {"cull_idle_timeout": 3, "cull_interval": 1}})
@pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")
def test_the_culler_spares_a_kernel_while_it_waits_and_culls_it_once_granted_and_idle(
    arun, jp_serverapp, gpupool_ext, gpupool_fetch, gpupool_wait
):
    km = jp_serverapp.kernel_manager
    km.initialize_culler()  # as on a server where a kernel has started before
    pool = gpupool_ext.pool
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))

    async def scenario() -> None:
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        kernel_id = json.loads(response.body)["id"]
        queued = await gpupool_wait(
            lambda: (lease := pool.lease_for_kernel(kernel_id)) is not None and lease.state is LeaseState.QUEUED and lease,
            what="the kernel's request in the queue",
        )
        # Well past the cull timeout, with no connection, while it waits: still there, still queued.
        for _ in range(8):
            await asyncio.sleep(1)
            assert kernel_id in km, "the culler culled a kernel waiting in the queue"
        assert pool.get(queued.id).state is LeaseState.QUEUED
        pool.release(holder.id, reason="the live user is done")
        await gpupool_wait(lambda: pool.get(queued.id).state is not LeaseState.QUEUED, timeout=60, what="the grant")
        # Granted, idle, no connection: the usual rule culls it.
        await gpupool_wait(lambda: kernel_id not in km, timeout=90, what="the culler to cull the idle kernel")
        await gpupool_wait(lambda: pool.get(queued.id).state is LeaseState.RELEASED, timeout=30, what="its slice back")

    arun(scenario())


# --- no pool -----------------------------------------------------------------------------------------


def test_gpupool_lines_run_where_there_is_no_pool(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    """The package installed, no simulated pool and no NVIDIA driver: each use prints one line."""
    if any(os.path.exists(p) for p in autolease.NVIDIA_MARKERS):
        pytest.skip("this host has an NVIDIA driver")
    env = {k: v for k, v in run_env.items() if k != "GPUPOOL_SIMULATE"}
    notebook = write_notebook(tmp_path / "course.ipynb", "%gpupool status", "%gpupool reserve 4GiB\nx = 1", "print(x)")
    command = [str(kernel_prefix / "bin" / "python"), "-m", "nbconvert", "--to", "notebook", "--execute", str(notebook),
               "--output", "course.done.ipynb"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    cells = nbformat.read(tmp_path / "course.done.ipynb", as_version=4).cells
    texts = ["".join(o.get("text", "") for o in cell.outputs) for cell in cells]
    for text in texts[:2]:
        assert text.count("\n") == 1 and text.startswith("gpupool: this kernel runs without the GPU pool: no NVIDIA driver"), texts
    assert texts[2] == "1\n", texts


# --- an admin's release of a slice just granted ---------------------------------------------------------


def test_a_release_after_the_grant_is_not_called_a_release_before_it(gpupool_env: dict[str, str]):
    """The waiter (a kernel's start) had not looked yet when an admin released its just-granted slice."""
    from jupyter_gpupool.errors import RequestRefused

    pool, holder = fill_pool()
    waiting = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, holder_pid=os.getpid(), label="a kernel"))
    withdrawn = pool.request(LeaseRequest(owner="alice", memory=8 * GIB, holder_pid=os.getpid(), label="another kernel"))
    assert waiting.state is withdrawn.state is LeaseState.QUEUED
    pool.release(withdrawn.id, reason="released by user (by admin carol)")
    with pytest.raises(RequestRefused, match=r"^the request was released by user \(by admin carol\) before it was granted$"):
        pool.wait_for_grant(withdrawn.id, timeout=5)
    pool.release(holder.id, reason="the live user is done")
    assert pool.get(waiting.id).state is LeaseState.GRANTED
    pool.release(waiting.id, reason="released by user (by admin carol)")
    with pytest.raises(RequestRefused) as refused:
        pool.wait_for_grant(waiting.id, timeout=5)
    assert str(refused.value) == "its GPU slice was released by user (by admin carol) after it was granted, before the kernel started"


def test_a_killed_grader_gives_its_kernels_request_back(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    """The grader is killed while its kernel waits before answering: the kernel withdraws its request and exits."""
    pool, holder = fill_pool()
    notebook = write_notebook(tmp_path / "killed.ipynb", *SUBMISSION)
    run = grade(kernel_prefix, notebook, {**run_env, autolease.START_WAIT_ENV: "300"})
    try:
        queued = queued_request(pool, run)
        run.proc.kill()
        run.finish(timeout=60)
        deadline = time.monotonic() + 30
        while pool.get(queued.id).state is LeaseState.QUEUED:
            assert time.monotonic() < deadline, f"the request stayed queued after its client was killed:\n{run.text}"
            time.sleep(0.2)
    finally:
        pool.release(holder.id, reason="the live user is done")
    assert pool.get(queued.id).release_reason == autolease.CLIENT_LEFT_REASON


# --- a start not made through the REST API (Voilà's page) ---------------------------------------------


@pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")
def test_a_start_whose_caller_talks_to_the_kernel_at_once_returns_once_the_kernel_started(
    arun, jp_serverapp, gpupool_ext, gpupool_wait
):
    """As Voilà's page does: ``start_kernel`` on the server's manager, then ``wait_for_ready`` at once.
    A pending kernel (no process yet) would be taken for a dead one; such a start waits in the queue."""
    km = jp_serverapp.kernel_manager
    pool = gpupool_ext.pool
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))

    async def scenario() -> None:
        start = asyncio.ensure_future(km.start_kernel(kernel_name="python3"))
        queued = await gpupool_wait(
            lambda: next((lease for lease in pool.leases() if lease.kernel_id and lease.state is LeaseState.QUEUED), None),
            what="the start's request in the queue",
        )
        for _ in range(4):
            await asyncio.sleep(0.5)
            assert not start.done(), "the start returned a kernel that has no process yet"
        pool.release(holder.id, reason="the live user is done")
        kernel_id = await asyncio.wait_for(start, 120)
        assert kernel_id == queued.kernel_id
        client = km.get_kernel(kernel_id).client()
        client.start_channels()
        try:
            await client.wait_for_ready(timeout=60)
        finally:
            client.stop_channels()
        await km.shutdown_kernel(kernel_id)

    arun(scenario())


def test_a_person_s_kernel_whose_wait_was_stopped_runs_no_later_cell(kernel_prefix: Path, run_env: dict[str, str], tmp_path: Path):
    """A kernel a person uses (a gateway kernel their server marked interactive) waits in its first
    cell; a stopped wait rejects that cell and every later one, saying to restart."""
    pool, holder = fill_pool()
    notebook = write_notebook(tmp_path / "person.ipynb", "import math", "print('second ran', math.pi)")
    env = {**run_env, "KERNEL_GATEWAY": "1", autolease.INTERACTIVE_HINT_ENV: "1"}
    run = grade(kernel_prefix, notebook, env)
    try:
        queued_request(pool, run)
        code = run.finish(timeout=120)
    finally:
        pool.release(holder.id, reason="the live user is done")
    assert code == 0, run.text
    done = nbformat.read(notebook.with_name(notebook.stem + ".graded.ipynb"), as_version=4)
    first, second = (" ".join(" ".join(o.get("traceback", [])) for o in cell.outputs) for cell in done.cells)
    assert "stopped waiting for a GPU after" in first and "restart the kernel" in first, done.cells[0].outputs
    assert "did not run, so this cell does not run either" in second, done.cells[1].outputs
    assert "second ran" not in json.dumps(done.cells[1].outputs), done.cells[1].outputs
