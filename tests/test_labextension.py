"""The JupyterLab extension: its jest tests, its install from the package, the browser check
without Node.js, and the Playwright scenario in headless Chromium against a real server."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from slurm_cluster import skip_reason as slurm_skip_reason

ROOT = Path(__file__).resolve().parent.parent
EXT = ROOT / "labextension"
NODE_MODULES = EXT / "node_modules"
needs_node = pytest.mark.skipif(
    shutil.which("npm") is None or not NODE_MODULES.is_dir(),
    reason="front-end tests need Node.js and `npm ci` in labextension/ (.ci/run does both)",
)
needs_chromium = pytest.mark.skipif(
    not Path("/usr/bin/chromium").exists(), reason="needs Debian chromium (.ci/run installs it)"
)


@needs_node
def test_jest_unit_tests_pass():
    result = subprocess.run(["npm", "test", "--", "--ci"], cwd=EXT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Tests:" in result.stderr + result.stdout


def test_labextension_is_installed_enabled_and_ok():
    result = subprocess.run(["jupyter", "labextension", "list"], capture_output=True, text=True, timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "jupyter-gpupool" in line]
    assert lines, "jupyter-gpupool is not installed as a lab extension: pip install -e ."
    assert "enabled" in lines[0] and "OK" in lines[0]


def test_browser_check_passes_without_node_in_path(tmp_path):
    """Users never need Node.js: with only Python on PATH the prebuilt extension loads cleanly
    (JupyterLab's own check; its in-browser part needs Node, so the Playwright test below covers it)."""
    python_dir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": python_dir, "GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "p.sqlite")}
    assert shutil.which("node", path=env["PATH"]) is None
    args = [sys.executable, "-m", "jupyterlab.browser_check", "--no-browser-test"]
    if os.geteuid() == 0:
        args.append("--allow-root")
    result = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "jupyter_gpupool | extension was successfully loaded" in output


#: run.sh's default suites, one test each so that a parallel run spreads them over its workers.
DEFAULT_SUITES = ("gpupool", "idle", "suspend", "resume-ahead", "unpooled", "unavailable", "contrast",
                  "notebook7-where-possible")  # fmt: skip


def test_the_default_suites_are_run_shs_own() -> None:
    """Each of run.sh's default suites has its test here, and no other."""
    script = (EXT / "ui-tests" / "run.sh").read_text()
    defaults = next(line for line in script.splitlines() if line.strip().startswith("SUITES=(") and "gpupool" in line)
    assert defaults.strip() == f"SUITES=({' '.join(DEFAULT_SUITES)})", defaults


@pytest.mark.browser
@needs_node
@needs_chromium
@pytest.mark.parametrize("suite", DEFAULT_SUITES)
def test_sidebar_and_status_bar_in_headless_chromium(tmp_path, suite):
    """Two notebooks granted, a third queued at position 1, granted after a shutdown; Keep and Release act;
    an idle slice counts down; a suspended kernel shows with its Resume button, which brings it back;
    focusing a suspended kernel's notebook (or editing a cell) resumes it before any cell runs;
    a process without a lease shows as memory used outside the pool; every text of the sidebar meets
    WCAG AA contrast in the light and dark themes, measured from computed styles; Notebook 7 where
    it is installed (run.sh's default suites, one per test, on this checkout's build when it has one)."""
    shots = Path(os.environ.get("GPUPOOL_UI_SCREENSHOTS", tmp_path / "screenshots"))
    env = {**os.environ, "GPUPOOL_UI_SCREENSHOTS": str(shots), "PYTHON": sys.executable}
    returncode, output = run_suites([suite], env, timeout=600)
    print(output)
    assert returncode == 0, failure_report(output)
    not_run = [line for line in output.splitlines() if "the notebook7 suite does not run" in line]
    if not_run:
        pytest.skip(not_run[0])
    assert any(shots.glob("*.png")), "the browser test saves a screenshot of each step"


SERVER_LOG_MARK = "---- last lines of the server log"


def failure_report(output: str, limit: int = 6000) -> str:
    """What a failed run.sh said, shortest first: Playwright's report (what it waited for, what it
    got, the page's state), then the tail of the server log run.sh prints after it. A plain tail
    of the output would be the server log alone, and the failed expectation would be cut off."""
    report, _, server_log = output.partition(SERVER_LOG_MARK)
    failures = report.find("\n  1) ")
    report = report[failures:] if failures >= 0 else report
    head = report[: limit * 2 // 3] + ("\n[…]\n" if len(report) > limit * 2 // 3 else "")
    if not server_log:
        return head
    title, _, lines = server_log.partition("\n")  # "(path) ----", then the log's last lines
    title = SERVER_LOG_MARK + title + "\n"
    return head + title + lines[-max(0, limit - len(head) - len(title)) :]



def test_a_failed_browser_run_reports_playwrights_error_before_the_server_log() -> None:
    """However long the server log, the report keeps the expectation that failed and the log's end."""
    playwright = "  ✘  1 suite.spec.ts:3:1 › a test (20.0s)\n\n  1) suite.spec.ts:3:1 › a test\n\n    Error: expected 'suspended'\n"
    log = "".join(f"[I server] line {i}\n" for i in range(2000))
    report = failure_report(f"Running 1 test\n{playwright}  1 failed\n{SERVER_LOG_MARK} (server.log) ----\n{log}")
    assert "Error: expected 'suspended'" in report
    assert report.index("Error: expected") < report.index(SERVER_LOG_MARK)
    assert report.rstrip().endswith("line 1999") and len(report) <= 6100
    assert failure_report("no report at all") == "no report at all"

def run_suites(suites: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``ui-tests/run.sh`` with ``suites`` in a process group of its own: past ``timeout`` the whole
    group (run.sh, jupyter lab, Chromium, a Slurm cluster's owner) gets SIGTERM, so run.sh's traps
    stop what it started, then SIGKILL; nothing is left running, and the test fails with the output."""
    run = subprocess.Popen(
        ["bash", str(EXT / "ui-tests" / "run.sh"), *suites],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGTERM)
        try:
            output, _ = run.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            output, _ = run.communicate()
        if "slurm" in suites:  # a cluster whose owner was killed too: stop its daemons
            reap = [sys.executable, str(EXT / "ui-tests" / "slurm_cluster_steps.py"), "reap"]
            subprocess.run(reap, timeout=60, check=False)
        pytest.fail(f"the browser suites {suites or 'default'} ran past {timeout:.0f} s:\n" + failure_report(output))
    return run.returncode, output


SLURM_SHOTS = ("slurm-01-first-running", "slurm-02-second-running", "slurm-03-third-pending",
               "slurm-04-third-running-after-shutdown")  # fmt: skip


@pytest.mark.browser
@needs_node
@needs_chromium
@pytest.mark.skipif(
    slurm_skip_reason() is not None,
    reason=f"the slurm browser suite runs a real Slurm cluster: {slurm_skip_reason()}",
)
def test_sidebar_shows_slurm_job_partition_and_queue_position_in_headless_chromium(tmp_path):
    """Issue 13: JupyterLab on the Slurm backend against a real single-node Slurm cluster; the
    sidebar and the status bar name each kernel's job and partition (checked against squeue), a
    third kernel's pending job its position and Slurm's reason in words, and follow it when it
    starts (run.sh's slurm suite, which starts and always stops the cluster)."""
    shots = Path(os.environ.get("GPUPOOL_UI_SCREENSHOTS", tmp_path / "screenshots"))
    env = {**os.environ, "GPUPOOL_UI_SCREENSHOTS": str(shots), "PYTHON": sys.executable}
    returncode, output = run_suites(["slurm"], env, timeout=900)
    print(output)
    assert returncode == 0, failure_report(output)
    for name in SLURM_SHOTS:
        assert (shots / f"{name}.png").is_file(), f"no screenshot {name}.png"


ELASTIC_SHOTS = ("elastic-01-default-slice", "elastic-02-grown-on-demand", "elastic-03-second-kernel-granted",
                 "elastic-04-burst-given-back")  # fmt: skip


@pytest.mark.browser
@needs_node
@needs_chromium
def test_sidebar_shows_an_elastic_slice_grow_and_give_its_burst_back_in_headless_chromium(tmp_path):
    """A simulated 1x16GiB pool, a 2 GiB default and GPUPOOL_BURST=16GiB: a kernel that uses 6 GiB
    shows `2 GiB guaranteed · 6 GiB now, up to 16 GiB` (or more now) in the sidebar; once its use
    drops to 1 GiB a notebook whose kernelspec asks for 12 GiB is granted, and the first kernel's
    line is back near its guarantee with the pool's reason (run.sh's elastic suite)."""
    shots = Path(os.environ.get("GPUPOOL_UI_SCREENSHOTS", tmp_path / "screenshots"))
    env = {**os.environ, "GPUPOOL_UI_SCREENSHOTS": str(shots), "PYTHON": sys.executable}
    returncode, output = run_suites(["elastic"], env, timeout=600)
    print(output)
    assert returncode == 0, failure_report(output)
    for name in ELASTIC_SHOTS:
        assert (shots / f"{name}.png").is_file(), f"no screenshot {name}.png"
