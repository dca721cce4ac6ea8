"""The suite's own guard (tests/suite_guard.py): the run has a private HOME and TMPDIR; a write outside
the sandbox (a system Jupyter folder, the real home's) fails the run, naming the path and the test,
and what another process writes meanwhile does not; a skip for want of a system package is counted
in the last line, with the command that fixes it."""

from __future__ import annotations

import os
import pwd
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
import suite_guard
from suite_guard import APT_LINE, APT_PACKAGES, SUMMARY_KEY, TORCH_LINE, changes, need_of, snapshot, watched_roots

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def test_a_snapshot_sees_files_created_modified_and_removed_and_skips_what_it_is_told(tmp_path: Path) -> None:
    root = tmp_path / "etc-jupyter"
    (root / "runtime").mkdir(parents=True)
    (root / "kept.json").write_text("{}")
    (root / "gone.json").write_text("{}")
    before = snapshot([root, tmp_path / "absent"], skip={str(root / "runtime")})
    assert snapshot([root], skip={str(root / "runtime")}) == before  # reading changes nothing
    (root / "runtime" / "kernel-1.json").write_text("{}")  # not watched
    assert changes(before, snapshot([root], skip={str(root / "runtime")})) == []
    (root / "gpupool-broker.json").write_text("{}")
    (root / "kept.json").write_text('{"changed": true}')
    (root / "gone.json").unlink()
    found = changes(before, snapshot([root], skip={str(root / "runtime")}))
    assert f"created  {root / 'gpupool-broker.json'}" in found
    assert f"removed  {root / 'gone.json'}" in found
    assert f"modified {root / 'kept.json'}" in found


def test_the_system_folders_are_listed_and_the_real_homes_jupyter_folders_watched() -> None:
    roots = {str(p) for p in watched_roots()}
    assert "/etc/jupyter" in roots
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir).resolve()
    watched = {str(p) for p in suite_guard.watched_home_folders(suite_guard.real_homes())}
    for inside in (".jupyter", ".local/share/jupyter", ".ipython", ".cache/jupyter-gpupool"):
        assert str(home / inside) in watched


def test_this_run_has_a_private_home_and_tmpdir(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    real = Path(pwd.getpwuid(os.geteuid()).pw_dir).resolve()
    home, tmp = Path(os.environ["HOME"]), Path(os.environ["TMPDIR"])
    assert home.name == "home" and tmp.name == "tmp" and home.parent == tmp.parent
    assert home.parent.name.startswith("gpupool-") and home.parent.parent == Path(os.environ[suite_guard.TMP_ROOT_ENV])
    assert not home.resolve().is_relative_to(real) or real == Path("/").resolve()
    assert Path.home() == home and os.path.expanduser("~") == str(home)
    if Path(request.config.option.basetemp).is_relative_to(home.parent):  # unless --basetemp said otherwise
        assert tmp_path.resolve().is_relative_to(tmp.resolve()), tmp_path
    assert tempfile.gettempdir() == str(tmp)
    seen = subprocess.run([sys.executable, "-c", "import os, tempfile; print(os.environ['HOME'], tempfile.gettempdir())"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert seen == [str(home), str(tmp)]


def test_a_failed_runs_folder_is_kept_three_days(tmp_path: Path) -> None:
    old, recent, other = tmp_path / "gpupool-old", tmp_path / "gpupool-recent", tmp_path / "gpupool-ui.abc"
    for folder in (old, recent, other):
        folder.mkdir()
    for folder in (old, recent):
        (folder / suite_guard.MARK).write_text("")
    days_ago = time.time() - 4 * 24 * 3600
    os.utime(old / suite_guard.MARK, (days_ago, days_ago))
    os.utime(other, (days_ago, days_ago))
    suite_guard.forget_old_runs(tmp_path)
    assert not old.exists() and recent.exists() and other.exists()  # only a run's own folder, only when old


def test_every_skip_for_a_missing_package_in_the_suite_is_recognised() -> None:
    from slurm_cluster import MISSING
    from test_kernel_extension import test_real_torch_without_cuda_is_left_alone
    from test_labextension import needs_chromium
    from test_metrics import needs_promtool

    [torch_skip] = [m for m in test_real_torch_without_cuda_is_left_alone.pytestmark if m.name == "skipif"]

    assert need_of(needs_chromium.kwargs["reason"]).name == "chromium"
    assert need_of(needs_promtool.kwargs["reason"]).name == "promtool"
    assert need_of(MISSING.format(names="slurmctld, sbatch")).name == "slurm-wlm"
    assert need_of("configurable-http-proxy is not installed (npm install -g configurable-http-proxy@5)") is not None
    assert need_of("needs root to connect as another Unix user") is None
    assert need_of(torch_skip.kwargs["reason"]).name == "torch"


def test_ci_and_the_readme_install_what_the_guard_names() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    installed = re.search(r"apt-get install (.*?)(?:>|$)", ci, re.MULTILINE)
    assert installed, ".ci/run installs no apt packages"
    assert set(APT_PACKAGES) <= set(shlex.split(installed.group(1))), installed.group(1)
    assert APT_LINE in (REPO / "README.md").read_text(), "the README's Set-up must give the line the guard prints"
    assert TORCH_LINE in (REPO / "README.md").read_text(), "the README's Set-up must say how to get PyTorch's CPU build"
    assert re.search(r"pip install .*\btorch\b", ci), ".ci/run must install PyTorch for the real-torch test"


def run_guarded(tmp_path: Path, test_source: str, watched: Path, real_home: Path | None = None,
                beside: list[str] | None = None, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """A small suite with only this plugin, in a subprocess listing ``watched`` too (and taking
    ``real_home`` for the real home); ``beside``: a Python program run beside it meanwhile, not
    by the tests."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text('pytest_plugins = ["suite_guard"]\n')
    (project / "test_sample.py").write_text(textwrap.dedent(test_source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           suite_guard.EXTRA_ROOTS_ENV: str(watched)}
    if real_home is not None:
        env[suite_guard.REAL_HOME_ENV] = str(real_home)
    other = None
    if beside is not None:  # started before the run with an environment of its own, as a person's JupyterLab
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("SUITE_GUARD", "PYTEST"))}
        clean["PYTHONPATH"] = ""
        other = subprocess.Popen([sys.executable, "-c", *beside], env=clean)
    try:
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *args, str(project)],
                              capture_output=True, text=True, env=env, cwd=project, timeout=120, check=False)
    finally:
        if other is not None:
            other.terminate()
            other.wait(timeout=30)


@pytest.mark.slow  # a pytest run of its own
def test_a_write_outside_the_sandbox_fails_the_run_naming_the_path_and_the_test(tmp_path: Path) -> None:
    """A test writes a system Jupyter folder: the run fails naming both. A broker someone else
    started records itself there meanwhile: shown, not counted."""
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    started = tmp_path / "started"
    other = (f"import pathlib, time\nwatched = pathlib.Path({str(watched)!r})\n"
             f"pathlib.Path({str(started)!r}).write_text('')\n"
             "for i in range(3000):\n"
             "    (watched / 'their-broker.json').write_text(str(i))\n"
             "    time.sleep(0.01)\n")
    result = run_guarded(tmp_path, f"""
        import pathlib, time

        def test_writes_a_system_file():
            while not pathlib.Path({str(started)!r}).exists():
                time.sleep(0.05)
            time.sleep(0.3)
            open({str(watched / 'gpupool-broker.json')!r}, "w").write("{{}}")
        """, watched, beside=[other])
    out = result.stdout
    assert result.returncode == 1, out
    assert "tests wrote outside their sandbox" in out
    assert f"wrote    {watched / 'gpupool-broker.json'} (open, in test_sample.py::test_writes_a_system_file (call)" in out, out
    assert "changed meanwhile by programs the tests did not start (not counted)" in out, out
    theirs = str(watched / "their-broker.json")
    assert any(line.startswith(("created  ", "modified ")) and line.endswith(theirs) for line in out.splitlines()), out
    assert "1 passed, 1 wrote outside the sandbox" in out.splitlines()[-1], out.splitlines()[-1]


@pytest.mark.slow  # a pytest run of its own
def test_a_write_to_the_real_home_fails_the_run_naming_the_test_but_another_process_writes_freely(tmp_path: Path) -> None:
    """The tests' HOME is private, so a test reaches the real home only through its absolute path
    (here, or in a process it starts); a process the tests did not start (a person's JupyterLab)
    writes there all through the run and is not reported."""
    real = tmp_path / "real-home"
    (real / ".jupyter" / "lab" / "workspaces").mkdir(parents=True)
    (real / ".local" / "share" / "jupyter" / "runtime").mkdir(parents=True)
    started = tmp_path / "started"
    person = (f"import pathlib, time\nhome = pathlib.Path({str(real)!r})\n"
              f"pathlib.Path({str(started)!r}).write_text('')\n"
              "for i in range(3000):\n"
              "    (home / '.jupyter/lab/workspaces/default.jupyterlab-workspace').write_text(str(i))\n"
              "    (home / '.local/share/jupyter/runtime' / f'kernel-{i % 5}.json').write_text('{}')\n"
              "    time.sleep(0.01)\n")
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    result = run_guarded(tmp_path, f"""
        import os, pathlib, subprocess, sys, time

        def test_home_is_private():
            assert os.environ["HOME"] != {str(real)!r}
            (pathlib.Path.home() / ".jupyter").mkdir()  # the private home: allowed
            (pathlib.Path.home() / ".jupyter" / "mine.json").write_text("{{}}")

        def test_writes_the_real_home():
            while not pathlib.Path({str(started)!r}).exists():
                time.sleep(0.05)
            time.sleep(0.5)
            open({str(real / '.jupyter' / 'jupyter_server_config.json')!r}, "w").write("{{}}")

        def test_a_subprocess_writes_the_real_home():
            code = "open({str(real / '.ipython' / 'written.txt')!r}, 'w').write('x')"
            os.makedirs({str(real / '.ipython')!r}, exist_ok=True)
            subprocess.run([sys.executable, "-c", code], check=True)
        """, watched, real_home=real, beside=[person])
    assert result.returncode == 1, result.stdout
    out = result.stdout
    assert f"wrote    {real / '.jupyter' / 'jupyter_server_config.json'} (open, in test_sample.py::test_writes_the_real_home (call)" in out, out
    assert f"wrote    {real / '.ipython' / 'written.txt'} (open, in test_sample.py::test_a_subprocess_writes_the_real_home (call)" in out, out
    assert "workspaces" not in out and "runtime" not in out, out  # the other process's writes
    assert "mine.json" not in out, out
    assert "3 passed" in out.splitlines()[-1], out.splitlines()[-1]
    assert (real / ".jupyter" / "lab" / "workspaces" / "default.jupyterlab-workspace").exists()


@pytest.mark.slow  # a pytest run of its own
def test_a_clean_run_passes_and_a_skip_for_want_of_a_package_is_in_the_last_line(tmp_path: Path) -> None:
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    result = run_guarded(tmp_path, """
        import pytest

        @pytest.mark.skipif(True, reason="needs Debian chromium (.ci/run installs it)")
        def test_in_a_browser():
            pass

        def test_other():
            pytest.skip("needs root to run a process as another user")
        """, watched)
    assert result.returncode == 0, result.stdout
    last = result.stdout.splitlines()[-1]
    assert f"2 skipped, 1 {SUMMARY_KEY}" in last, last
    assert "1 tests skipped because this machine lacks them (chromium: 1)" in result.stdout
    assert f"Install them and run again: as root: {APT_LINE}" in result.stdout


@pytest.mark.parametrize("present", [True, False])
def test_the_header_names_what_is_missing(present: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite_guard.SystemNeed, "present", lambda self: present or self.name != "promtool")
    header = suite_guard.pytest_report_header(None)  # type: ignore[arg-type]
    if present:
        assert header == []
    else:
        assert header == [f"gpupool: not on this machine: promtool (their tests will skip; to install: as root: {APT_LINE})"]


def test_a_listing_leaves_out_the_users_own_ipython_history(tmp_path: Path) -> None:
    profile = tmp_path / ".ipython" / "profile_default"
    profile.mkdir(parents=True)
    before = snapshot([tmp_path / ".ipython"])
    (profile / "history.sqlite").write_text("their own IPython's history")
    (profile / "history.sqlite-journal").write_text("")
    assert changes(before, snapshot([tmp_path / ".ipython"])) == []
    (profile / "startup").mkdir()
    assert changes(before, snapshot([tmp_path / ".ipython"])) == [f"created  {profile / 'startup'}"]


@pytest.mark.slow  # a pytest run of its own
def test_in_a_parallel_run_a_workers_write_fails_the_run_and_each_worker_has_a_home_of_its_own(tmp_path: Path) -> None:
    """Under pytest-xdist each worker gets a private HOME of its own (not its controller's, not
    another worker's), and a write outside the sandbox made in a worker fails the whole run."""
    watched = tmp_path / "etc-jupyter"
    watched.mkdir()
    homes = tmp_path / "homes"
    homes.mkdir()
    result = run_guarded(tmp_path, f"""
        import os, pathlib, pytest

        @pytest.mark.parametrize("n", range(4))
        def test_records_its_home(n):
            pathlib.Path({str(homes)!r}, os.environ["PYTEST_XDIST_WORKER"] + "-" + str(n)).write_text(os.environ["HOME"])

        def test_writes_a_system_file():
            open({str(watched / 'gpupool-broker.json')!r}, "w").write("{{}}")
        """, watched, args=("-n", "2"))
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"wrote    {watched / 'gpupool-broker.json'} (open, in test_sample.py::test_writes_a_system_file (call)" in out, out
    seen: dict[str, set[str]] = {}
    for record in homes.iterdir():
        seen.setdefault(record.name.split("-")[0], set()).add(record.read_text())
    assert all(len(worker_homes) == 1 for worker_homes in seen.values()), seen
    every_home = [home for worker_homes in seen.values() for home in worker_homes]
    assert len(set(every_home)) == len(every_home), seen  # no two workers share one
    assert not any(home.startswith(str(Path.home())) for home in every_home), (seen, Path.home())
