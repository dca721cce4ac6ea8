"""The lines people read say what the state they describe is: counts agree, articles fit, a
countdown speaks of what is about to happen, sizes of a multi-GPU slice show both numbers, and
commands print each fact once. Checked against real pools (SQLite file, simulated GPUs) and the
real ``jupyter gpupool`` command."""

from __future__ import annotations

import os
import sqlite3
import subprocess
from pathlib import Path

import pytest
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.apps import simulate
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.local.store import MIGRATIONS, SCHEMA_VERSION, Store
from jupyter_gpupool.core.models import Activity, LeaseState, Transition
from jupyter_gpupool.kernel import status
from jupyter_gpupool.kernel.status import KernelStatus
from jupyter_gpupool.rest.views import kernel_status_without_pool
from jupyter_gpupool.units import GIB
from jupyter_gpupool.wording import article, count, cpu_only_description, remaining, slice_size, upcoming_reclaim

#: The ``pool_facts`` name of a simulated inventory (as the store spells it).
SIMULATED_INVENTORY = "simulated_inventory"

IDLE = {"idle_timeout": 600, "warning_period": 60, "preemption": False}


# --- the helpers, on the cases the messages meet -------------------------------------------------
@pytest.mark.parametrize(
    "word, expected",
    [("A100-80GB", "an"), ("H100", "an"), ("L40S", "an"), ("MI300X", "an"), ("RTX 6000", "an"), ("GPU", "a"),
     ("T4", "a"), ("V100", "a"), ("80 GiB", "an"), ("8 GiB", "an"), ("18 GiB", "an"), ("16 GiB", "a"),
     ("user", "a"), ("idle kernel", "an"), ("hour", "an"), ("Quadro", "a")],
)
def test_articles_go_by_how_the_word_is_read(word, expected):
    assert article(word) == expected


def test_counts_agree_with_their_noun():
    assert [count(0, "request"), count(1, "request"), count(2, "request")] == ["0 requests", "1 request", "2 requests"]
    assert [count(1, "GPU"), count(3, "GPU"), count(2, "process"), count(1.5, "hour")] == ["1 GPU", "3 GPUs", "2 processes", "1.5 hours"]
    assert [slice_size(70 * GIB, 2), slice_size(8 * GIB, 1)] == ["2 × 70 GiB", "8 GiB"]


def test_time_left_is_not_understated_by_the_moment_it_took_to_answer():
    assert remaining(3599.2) == "1 h"  # %gpupool keep 1h, read back a moment later
    assert remaining(3540.5) == "59 min"
    assert remaining(59.2) == "1 min"  # below 10 min, to the second, rounded up


# --- the idle countdown and the queue, against a real pool ---------------------------------------
def test_the_idle_countdown_says_what_is_about_to_happen_and_the_release_what_happened(tmp_path):
    pool = make_pool(tmp_path, **IDLE)
    idle = pool.request(req("alice", kernel_id="ka"), now=T0)
    busy = pool.request(req("bob", kernel_id="kb"), now=T0)
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 1)
    pool.request(req("carol"), now=T0 + 700)
    pool.tick(now=T0 + 701)
    warned = pool.get(idle.id)
    assert warned.reclaim_at is not None
    text = KernelStatus(lease=warned, now=warned.reclaim_at - 50).idle_text()
    assert text == "reclaimed in 50 s (idle for 11 min while 1 request waits for a GPU) unless you run %gpupool keep", text
    pool.report_activity(busy.id, Activity(busy=True), now=T0 + 770)
    pool.tick(now=T0 + 770)
    assert pool.get(idle.id).release_reason == "reclaimed: idle for 11 min while 1 request waited for a GPU"
    pool.close()


def test_the_queue_counts_the_requests_ahead_in_words(tmp_path):
    pool = make_pool(tmp_path)
    pool.request(req("alice", gib=16), now=T0)
    waiting = [pool.request(req(f"u{i}"), now=T0 + i) for i in range(1, 4)]
    reasons = [pool.queue_info(lease.id, now=T0 + 10).reason for lease in waiting[1:]]
    assert reasons == ["1 request ahead", "2 requests ahead"]
    pool.close()


def _restoring(tmp_path: Path, spec: str) -> tuple[Pool, str]:
    """A suspendable kernel on ``spec`` parked, then asked back: (pool, lease id) while it queues."""
    pool = make_pool(tmp_path, spec=spec, **IDLE)
    alice = pool.request(req("alice", gib=60, suspendable=True, kernel_id="ka"), now=T0)
    pool.suspend(alice.id, now=T0 + 10)
    pool.confirm_transition(alice.id, parked_bytes=3 * GIB, now=T0 + 11)
    pool.request(req("bob", gib=60, kernel_id="kb"), now=T0 + 12)  # takes the GPU alice left
    pool.resume(alice.id, now=T0 + 20)
    return pool, alice.id


def test_a_kernel_resuming_waits_for_an_a100_and_its_wait_ends_restoring(tmp_path):
    pool, lease_id = _restoring(tmp_path, "1xA100-80GB")
    info = pool.queue_info(lease_id, now=T0 + 21)
    assert info.reason == "resuming: waits for an A100-80GB GPU with 60 GiB free", info.reason
    pool.release(pool.lease_for_kernel("kb").id, now=T0 + 30)
    back = pool.get(lease_id)
    assert back.state is LeaseState.GRANTED and back.transition is Transition.RESTORING
    assert status.granted_title(back) == "gpupool: slice granted, restoring its GPU memory from host RAM"
    assert status.granted_title(pool.confirm_transition(lease_id, now=T0 + 31)) == "gpupool: slice granted"
    pool.close()


# --- the broker-down description ------------------------------------------------------------------
def test_a_kernel_started_while_the_broker_is_down_is_told_in_two_short_sentences():
    reason = ("the GPU pool broker at unix:///run/gp.sock is not reachable (connection refused); start the broker "
              "(or ask your admin), or unset GPUPOOL_URL to use a pool of your own")
    body = kernel_status_without_pool("k1", "alice", T0, "unavailable", reason)
    text = body["enforcement"]["description"]
    assert text == (
        "This kernel runs CPU-only: the GPU pool broker at unix:///run/gp.sock is not reachable (connection refused). "
        "Start the broker (or ask your admin), or unset GPUPOOL_URL to use a pool of your own, then restart this kernel."
    )
    back = kernel_status_without_pool("k1", "alice", T0, "unavailable", reason, pool_is_back=True)["enforcement"]["description"]  # type: ignore[call-arg]
    assert back == (
        "This kernel runs CPU-only: when it started, the GPU pool broker at unix:///run/gp.sock was not reachable "
        "(connection refused). The pool is back: restart this kernel to get a GPU slice."
    )
    for description in (text, back):
        assert description.count(". ") == 1 and description.endswith(".") and "((" not in description
        depth, deepest = 0, 0
        for char in description:
            depth += {"(": 1, ")": -1}.get(char, 0)
            deepest = max(deepest, depth)
        assert deepest == 1  # an aside, never one inside another
    assert cpu_only_description("no NVIDIA driver found") == "This kernel runs CPU-only: no NVIDIA driver found. Restart this kernel once the pool is back."


def test_the_reclaim_reasons_read_ahead_of_time():
    assert upcoming_reclaim("reclaimed: idle for 31 min while 2 requests waited for a GPU") == "idle for 31 min while 2 requests wait for a GPU"
    assert upcoming_reclaim("reclaimed for the reservation lab: idle for 5 min") == "for the reservation lab: idle for 5 min"


# --- the simulator's words ------------------------------------------------------------------------
def test_the_simulator_names_its_day_once():
    assert [simulate.day_of_shape("workday"), simulate.day_of_shape("flat"), simulate.day_of_shape("9-11:1")] == ["a workday", "a flat day", "a day shaped 9-11:1"]


# --- the command line -----------------------------------------------------------------------------
def gpupool(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_")}
    environ.update(GPUPOOL_BROKER_FILE="none", JUPYTER_DATA_DIR=str(tmp_path / "data"), **env)
    return subprocess.run(["jupyter", "gpupool", *args], capture_output=True, text=True, env=environ, timeout=90, cwd=tmp_path, check=False)


def test_a_request_across_two_gpus_shows_both_numbers(tmp_path):
    result = gpupool(["request", "140GiB", "--db", str(tmp_path / "p.sqlite")], tmp_path, GPUPOOL_SIMULATE="2xA100-80GB")
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip().endswith("granted 2 × 70 GiB"), result.stdout


@pytest.mark.parametrize("size", ["4TB", "4PB", "2EiB"])
def test_every_size_larger_than_the_pool_is_too_large_with_one_exit_code(tmp_path, size):
    result = gpupool(["request", size, "--db", str(tmp_path / "p.sqlite")], tmp_path, GPUPOOL_SIMULATE="2xA100-80GB")
    assert result.returncode == 3, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "too large" in lines[0] and "unknown unit" not in lines[0], lines


def test_an_unknown_unit_is_bad_input_that_lists_the_units(tmp_path):
    result = gpupool(["request", "4XB", "--db", str(tmp_path / "p.sqlite")], tmp_path, GPUPOOL_SIMULATE="2xA100-80GB")
    assert result.returncode == 2 and "units are B, KiB, MiB, GiB, TiB, PiB, EiB" in result.stderr, result.stderr


def test_the_pool_file_alone_opens_the_simulated_pool_it_was(tmp_path):
    db = str(tmp_path / "demo.sqlite")
    made = gpupool(["request", "8GiB", "--db", db, "--json"], tmp_path, GPUPOOL_SIMULATE="2xA100-80GB")
    assert made.returncode == 0, made.stderr
    lease_id = made.stdout.split('"id": "')[1].split('"')[0]
    released = gpupool(["release", lease_id, "--db", db], tmp_path)  # no GPUPOOL_SIMULATE, no driver
    assert released.returncode == 0, released.stderr
    assert released.stdout.strip() == f"released {lease_id} (8 GiB)"
    status = gpupool(["status", "--db", db], tmp_path)
    assert status.returncode == 0 and status.stdout.startswith("Pool: simulated 2xA100-80GB"), status.stdout + status.stderr


def test_a_recorded_simulated_inventory_is_not_used_on_a_host_with_an_nvidia_driver(tmp_path, monkeypatch):
    """On a GPU host a pool file that was once simulated opens on the real GPUs (NVML), never on
    fake ones nobody watches; the kernel's autolease looks for the driver in the same places."""
    from jupyter_gpupool.devices import base
    from jupyter_gpupool.devices.nvml import NvmlBackend
    from jupyter_gpupool.errors import PoolUnavailable
    from jupyter_gpupool.kernel import autolease

    assert autolease.NVIDIA_MARKERS == base.NVIDIA_MARKERS
    path = str(tmp_path / "was-simulated.sqlite")
    Pool.from_env(environ={"GPUPOOL_SIMULATE": "1xT4-16GB", "GPUPOOL_DB": path}).close()
    driver = tmp_path / "nvidiactl"
    driver.touch()
    monkeypatch.setattr(base, "NVIDIA_MARKERS", (str(driver),))
    try:
        pool = Pool.from_env(environ={"GPUPOOL_DB": path})
    except PoolUnavailable:
        return  # NVML was asked for, and this machine has none: not the recorded fake inventory
    try:
        assert isinstance(pool.backend, NvmlBackend), pool.backend.describe()
    finally:
        pool.close()


def test_a_pool_file_of_the_previous_version_is_taken_forward_and_then_remembers(tmp_path):
    """The file of the schema before ``pool_facts`` opens, keeps its leases, and learns its inventory."""
    path = tmp_path / "old.sqlite"
    before = next(step for step, sql in enumerate(MIGRATIONS) if "CREATE TABLE pool_facts" in sql)
    conn = sqlite3.connect(path)
    conn.executescript(";".join(MIGRATIONS[:before]) + f"; PRAGMA user_version={before}; PRAGMA application_id={0x4A475050};")
    conn.close()
    assert Store.recorded_fact(str(path), SIMULATED_INVENTORY) is None  # read-only, and it predates the table
    old = Pool.from_env(environ={"GPUPOOL_SIMULATE": "1xT4-16GB", "GPUPOOL_DB": str(path)})
    try:
        assert old.store.conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert old.store.fact(SIMULATED_INVENTORY) == "1xT4-16GB"
    finally:
        old.close()
    again = Pool.from_env(environ={"GPUPOOL_DB": str(path)})
    try:
        assert again.backend.describe() == "simulated 1xT4-16GB"
    finally:
        again.close()


def test_kernelspec_install_says_installed_once_and_its_help_names_the_real_command(tmp_path):
    result = gpupool(
        ["kernelspec", "install", "--name", "py-gpu-4g", "--memory", "4GiB", "--user"], tmp_path,
        GPUPOOL_SIMULATE="1x16GiB", HOME=str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    said = (result.stdout + result.stderr).lower()
    assert said.count("installed") == 1, said
    help_text = gpupool(["kernelspec", "--help"], tmp_path).stdout
    section = help_text.split("Subcommands\n===========\n", 1)[1].split("\nOptions\n", 1)[0]
    assert "install\n    Install a kernelspec" in section and "jupyter-gpupool-kernelspec" not in section, section


def test_an_idle_timeout_countdown_has_no_parentheses_inside_parentheses(tmp_path):
    pool = make_pool(tmp_path, idle_policy="always", idle_timeout=60, warning_period=600)
    lease = pool.request(req("alice", kernel_id="ka"), now=T0)
    pool.tick(now=T0 + 120)
    warned = pool.get(lease.id)
    text = KernelStatus(lease=warned, now=warned.reclaim_at - 300).idle_text()
    assert text == "reclaimed in 5 min (idle for 2 min, over the 1 min idle timeout) unless you run %gpupool keep", text
    pool.close()


def test_the_soft_enforcement_line_is_one_short_sentence(tmp_path):
    from jupyter_gpupool.enforcement import EnforcementConfig, plan_enforcement

    pool = make_pool(tmp_path)
    lease = pool.request(req("alice", kernel_id="ka"), now=T0)
    plan = plan_enforcement(lease, pool.devices(), EnforcementConfig())
    assert plan.level == "soft"
    assert plan.description == "PyTorch, JAX, CuPy and TensorFlow are capped at 8 GiB; the watchdog stops a kernel far over it."
    pool.close()
