"""nbgrader's autograder re-grades on a full pool as on an empty one, or fails clearly: never a wrong grade.

nbgrader 0.9.6 is pip-installed into an environment of its own over this one (its server
extension loads only there), with the kernel config where the wheel puts it. Its ``Execute``
timeouts are scaled down with the kernel's start wait, keeping the defaults' proportions (30 s a
cell, 60 s for the start, a 45 s start wait; here 5 s, 35 s and 20 s).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import nbformat
import pytest
import tomllib
from envs import Environment, environment_over_this_one

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import Lease, LeaseRequest, LeaseState
from jupyter_gpupool.kernel import autolease

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3
NBGRADER = "nbgrader==0.9.6"

pytestmark = pytest.mark.slow

CONFIG = """c = get_config()
c.CourseDirectory.course_id = "course"
c.Execute.timeout = 5
c.Execute.startup_timeout = 35
"""


@pytest.fixture(scope="module")
def grader(tmp_path_factory: pytest.TempPathFactory) -> Environment:
    """nbgrader in an environment of its own, with the pool's kernel config in its prefix."""
    try:
        env = environment_over_this_one(tmp_path_factory.mktemp("nbgrader") / "venv", packages=[NBGRADER], commands=("alembic",))
    except RuntimeError as err:
        # CI and every developer machine reach the package index: a failed install is a failure, never a quiet skip.
        pytest.fail(f"{NBGRADER} could not be installed from the package index: {str(err)[:300]}")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for src, dest in project["tool"]["hatch"]["build"]["targets"]["wheel"]["shared-data"].items():
        if dest == "etc/ipython":
            shutil.copytree(REPO / src, env.root / dest, dirs_exist_ok=True)
    return env


@pytest.fixture
def course(grader: Environment, gpupool_env: dict[str, str], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A course with one assignment (an import, then a test cell that needs it), released, and submitted by s01."""
    root = tmp_path / "course"
    (root / "source" / "ps1").mkdir(parents=True)
    (root / "nbgrader_config.py").write_text(CONFIG)
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    nb.cells.append(nbformat.v4.new_code_cell("import math, os"))
    test = nbformat.v4.new_code_cell("assert math.sqrt(16) == 4\nprint('test passed')")
    test.metadata["nbgrader"] = {"grade": True, "grade_id": "test_sqrt", "locked": True, "points": 1, "schema_version": 3,
                                 "solution": False, "task": False}
    nb.cells.append(test)
    nbformat.write(nb, root / "source" / "ps1" / "problem.ipynb")
    env = dict(os.environ)
    for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_KERNEL_ID", "GPUPOOL_UNAVAILABLE", autolease.AUTOLEASE_ENV):
        env.pop(name, None)
    env.update(
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter-config"),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter-data"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter-runtime"),
        # nbgrader runs `alembic` from PATH, which must import nbgrader: the environment's own first.
        PATH=os.pathsep.join([str(grader.bin), os.environ.get("PATH", "")]),
        **{autolease.START_WAIT_ENV: "20"},
    )
    nbgrader(grader, root, env, "generate_assignment", "ps1", "--force")
    (root / "submitted" / "s01" / "ps1").mkdir(parents=True)
    shutil.copy(root / "release" / "ps1" / "problem.ipynb", root / "submitted" / "s01" / "ps1" / "problem.ipynb")
    return root, env


def nbgrader(grader: Environment, root: Path, env: dict[str, str], *args: str) -> None:
    done = subprocess.run([str(grader.python), "-m", "nbgrader", *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=180, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def autograde(grader: Environment, root: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    command = [str(grader.python), "-m", "nbgrader", "autograde", "ps1", "--force", "--create", "--student=s01"]
    return subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def score(grader: Environment, root: Path) -> str:
    """s01's score in the gradebook, as ``score/max`` (``none`` when no submission was graded)."""
    code = (
        "from nbgrader.api import Gradebook, MissingEntry\n"
        f"with Gradebook('sqlite:///{root}/gradebook.db') as gb:\n"
        "    try:\n"
        "        s = gb.find_submission('ps1', 's01')\n"
        "        grades = [g for notebook in s.notebooks for g in notebook.grades]\n"
        "        print(f'{s.score:g}/{s.max_score:g}' if grades and all(g.auto_score is not None for g in grades) else 'none')\n"
        "    except MissingEntry:\n"
        "        print('none')\n"
    )
    done = subprocess.run([str(grader.python), "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def full_pool() -> tuple[Pool, Lease]:
    pool = Pool.from_env()
    holder = pool.request(LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), label="a live user"))
    assert holder.state is LeaseState.GRANTED
    return pool, holder


def queued(pool: Pool, proc: subprocess.Popen[str], timeout: float = 120) -> Lease:
    deadline = time.monotonic() + timeout
    while not (waiting := [lease for lease in pool.leases() if lease.state is LeaseState.QUEUED]):
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        assert time.monotonic() < deadline, "the grader's kernel never queued"
        time.sleep(0.1)
    return waiting[0]


def test_a_regrade_that_waits_longer_than_a_cell_timeout_gets_the_empty_pool_grade(grader: Environment, course: tuple[Path, dict[str, str]]):
    root, env = course
    pool, holder = full_pool()
    proc = autograde(grader, root, env)
    try:
        queued(pool, proc)
        time.sleep(8)  # longer than Execute.timeout, shorter than the start wait
        pool.release(holder.id, reason="the live user is done")
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert score(grader, root) == "1/1", out
    assert "waiting for a GPU slice (batch), position 1 of 1" in out, out
    # The wait was said on the grader's terminal; the graded notebook keeps only the cells' own outputs.
    graded = nbformat.read(root / "autograded" / "s01" / "ps1" / "problem.ipynb", as_version=4)
    assert graded.cells[0].outputs == [] and "test passed" in graded.cells[1].outputs[0]["text"], graded.cells


def test_a_regrade_that_waits_past_the_start_fails_clearly_and_is_not_graded(grader: Environment, course: tuple[Path, dict[str, str]]):
    root, env = course
    pool, holder = full_pool()
    proc = autograde(grader, root, env)
    try:
        request = queued(pool, proc)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pool.release(holder.id, reason="the live user is done")
    assert proc.returncode != 0, out
    assert "NameError" not in out, out
    stopped = [line for line in out.splitlines() if "stopped waiting for a GPU after" in line]
    assert stopped and "position 1 of 1" in stopped[0] and "Execute.timeout" in stopped[0], out
    assert score(grader, root) == "none", out
    assert pool.get(request.id).state is LeaseState.RELEASED
