"""``%gpupool`` in real kernels, checked against the pool as another process sees it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.units import GIB, SIZE_FORMS, SIZE_UNITS_NAMED

try:
    from test_kernel_extension import (
        Kernel,
        PoolEnv,
        kernel_factory,
        make_pool_env,
        pool_env,
        strip_ansi,
        with_path,
        write_fake_frameworks,
    )
except ImportError:  # tests as a package
    from tests.test_kernel_extension import (  # noqa: F401
        Kernel,
        PoolEnv,
        kernel_factory,
        make_pool_env,
        pool_env,
        strip_ansi,
        with_path,
        write_fake_frameworks,
    )

pytestmark = pytest.mark.slow


def one_line_error(result: Any) -> str:
    """The cell failed with exactly one short line, no traceback."""
    assert result.status == "error"
    assert len(result.errors) == 1, result.errors
    lines = [strip_ansi(line) for line in result.errors[0]["traceback"]]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "Traceback" not in lines[0] and "File " not in lines[0]
    assert result.stream("stderr") == ""
    return lines[0]


@pytest.fixture(scope="module")
def shared_kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PoolEnv, Kernel]]:
    """One kernel for tests that must leave the pool unchanged (bad input, help): saves kernel starts."""
    penv = make_pool_env(tmp_path_factory.mktemp("shared"))
    kernel = Kernel(penv.kernel_env())
    yield penv, kernel
    kernel.shutdown()
    penv.pool.close()


def test_reserve_status_release_round_trip(pool_env: PoolEnv, kernel_factory: Any, tmp_path: Any) -> None:
    fakes = write_fake_frameworks(tmp_path / "fakes")
    # As the provisioner starts it: 4 GiB of the 16 GiB GPU.
    kernel = kernel_factory(
        pool_env.kernel_env(
            PYTHONPATH=with_path(fakes), GPUPOOL_MEMORY_FRACTION="0.250", XLA_PYTHON_CLIENT_MEM_FRACTION="0.250"
        )
    )
    pool = pool_env.pool
    kernel.run("import torch; torch.cuda.init()")

    grown = kernel.run("%gpupool reserve 8GiB --for 2h")
    lease = pool.get(pool_env.lease_id)
    assert lease.memory == 8 * GIB and lease.state is LeaseState.GRANTED
    assert lease.keep_until is not None and abs(lease.keep_until - (time.time() + 7200)) < 120
    assert "slice changed from 4 GiB to 8 GiB" in grown.plain()
    # The kernel re-capped PyTorch and updated the env its child processes get.
    result = kernel.run(
        "import os; (torch.cuda.calls[-1], os.environ['GPUPOOL_MEMORY_LIMIT'], os.environ['CUPY_GPU_MEMORY_LIMIT'],"
        " os.environ['GPUPOOL_MEMORY_FRACTION'], os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    )
    assert result.value() == ((0.5, 0), str(8 * GIB), str(8 * GIB), "0.500", "0.500")

    spaced = kernel.run("%gpupool reserve 6 GB")  # the grammar REST and the CLI accept
    assert pool.get(pool_env.lease_id).memory == 6 * GIB, spaced.plain()

    shrunk = kernel.run("%gpupool reserve 25%")  # of the 16 GiB GPU
    assert pool.get(pool_env.lease_id).memory == 4 * GIB
    assert "4 GiB on GPU 0" in shrunk.plain()

    status = kernel.run("%gpupool status").plain()
    assert "4 GiB on GPU 0" in status and "granted" in status

    limited = kernel.run("%gpupool reserve 4GiB --limit 12GiB")
    assert (pool.get(pool_env.lease_id).guarantee, pool.get(pool_env.lease_id).burst_limit) == (4 * GIB, 12 * GIB)
    assert "4 GiB guaranteed · 4 GiB now, up to 12 GiB" in limited.plain()
    assert "below the slice's size" in one_line_error(kernel.run("%gpupool reserve 4GiB --limit 2GiB", allow_error=True))

    kept = kernel.run("%gpupool keep 3h")
    keep_until = pool.get(pool_env.lease_id).keep_until
    assert keep_until is not None and abs(keep_until - (time.time() + 3 * 3600)) < 120
    kernel.run("%gpupool keep 30m")  # a shorter keep never cuts the longer hold
    assert pool.get(pool_env.lease_id).keep_until == keep_until
    assert "held through idle until" in kept.plain()

    released = kernel.run("%gpupool release")
    lease = pool.get(pool_env.lease_id)
    assert lease.state is LeaseState.RELEASED
    assert "%gpupool release" in lease.release_reason
    assert "slice released" in released.plain()
    assert pool.lease_for_kernel(pool_env.kernel_id) is None
    after = kernel.run("%gpupool status").plain()
    assert "released" in after

    # Asking again gives the same kernel a new lease, which the pool knows by kernel id.
    again = kernel.run("%gpupool reserve 2GiB")
    new = pool.lease_for_kernel(pool_env.kernel_id)
    assert new is not None and new.id != pool_env.lease_id
    assert new.memory == 2 * GIB and new.state is LeaseState.GRANTED and new.owner == "alice"
    assert new.holder_pid is not None and new.holder_pid != os.getpid()  # held by the kernel process
    assert "new slice requested" in again.plain()
    assert kernel.run("import os; os.environ['GPUPOOL_LEASE_ID']").value() == new.id


def test_status_gives_the_right_sizing_hint(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    assert "right size" not in kernel.run("%gpupool status").plain()  # nothing measured yet
    pool_env.pool.report_usage({pool_env.lease_id: 1 * GIB})  # peak 1 GiB of a 4 GiB slice
    status = kernel.run("%gpupool status").plain()
    assert "peaked at 1 GiB of 4 — shrink to 2 GiB? %gpupool reserve 2GiB" in status


def test_state_changed_elsewhere_shows_in_status(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    pool_env.pool.report_usage({pool_env.lease_id: 3 * GIB})
    status = kernel.run("%gpupool").plain()  # bare %gpupool is status
    assert "3 GiB of 4 GiB (75%)" in status
    pool_env.pool.release(pool_env.lease_id, reason="reclaimed: idle 30 min while 1 request waited")
    status = kernel.run("%gpupool status").plain()
    assert "released: reclaimed: idle 30 min while 1 request waited" in status


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("reserve 12XB", f"invalid size '12XB': unknown unit 'XB'; units are {SIZE_UNITS_NAMED}"),
        ("reserve lots", f"invalid size 'lots': expected {SIZE_FORMS}"),
        ("reserve 8GiB --for soon", "invalid duration 'soon'"),
        ("reserve 8GiB --gpus x", "invalid GPU count 'x': expected a whole number from 1 to 64"),
        ("keep forever", "invalid duration 'forever'"),
        ("reserve -5GiB", "invalid size '-5GiB': a size must be above 0"),
        ("reserve 8GiB --for -1h", "invalid duration '-1h': must be above 0"),
        ("keep -1h", "invalid duration '-1h': must be above 0"),
        ("reserve 12 parsecs", "invalid size '12 parsecs'"),
        ("frobnicate", "invalid choice: 'frobnicate'"),
        ("reserve 64GiB", "64 GiB"),  # more than any GPU has: refused, saying what fits
        ("reserve 8GiB --gpus -2", "invalid GPU count '-2'"),
        ("reserve 12 GB extra", "invalid size '12 GB extra'"),
        # Below the smallest GPU slice: 8 counts bytes, so the 8GiB it likely meant is suggested.
        ("reserve 8", "8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB; did you mean %gpupool reserve 8GiB?"),
        ("reserve 16MiB", "16MiB is 16 MiB, below the smallest GPU slice of 64 MiB"),
        ("reserve 8GiB --limit 8", "--limit 8 is 8 bytes (a number without a unit counts bytes), below the smallest GPU slice of 64 MiB"),
    ],
)
def test_bad_input_is_one_line_without_traceback(
    shared_kernel: tuple[PoolEnv, Kernel], line: str, expected: str
) -> None:
    penv, kernel = shared_kernel
    result = kernel.run(f"%gpupool {line}", allow_error=True)
    message = one_line_error(result)
    assert message.startswith("gpupool: ")
    assert expected in message
    assert "usage:" not in message and "[-h]" not in message
    lease = penv.pool.get(penv.lease_id)
    assert lease.memory == 4 * GIB and lease.state is LeaseState.GRANTED  # nothing changed


def test_a_size_in_two_words_is_read_as_over_rest(pool_env: PoolEnv, kernel_factory: Any) -> None:
    """``12 GB`` means the same in the magic as over REST: one grammar (units.parse_size)."""
    kernel = kernel_factory(pool_env.kernel_env())
    kernel.run("%gpupool reserve 6 GB")
    assert pool_env.pool.get(pool_env.lease_id).memory == 6 * GIB


def test_help_lists_commands_and_forms(shared_kernel: tuple[PoolEnv, Kernel]) -> None:
    _, kernel = shared_kernel
    text = kernel.run("%gpupool help").stdout
    for command in ("status", "reserve 12GiB [--limit 32GiB] [--for 2h] [--gpus 2]", "release", "queue", "keep [1h]", "wait"):
        assert command in text
    assert SIZE_FORMS in text
    sub = kernel.run("%gpupool reserve --help").stdout
    assert "--for DURATION" in sub and "--gpus N" in sub


def test_queue_and_wait_until_granted(tmp_path: Any, kernel_factory: Any) -> None:
    # The pool is full (bob holds 14 GiB of 16), so the kernel's 4 GiB request waits.
    penv = make_pool_env(tmp_path, memory=14 * GIB, owner="bob")
    pool = penv.pool
    blocker = penv.lease_id
    queued = pool.request(
        LeaseRequest(
            owner="alice", memory=4 * GIB, kernel_id="k-alice", holder_pid=os.getpid(), holder_host=socket.gethostname()
        )
    )
    assert queued.state is LeaseState.QUEUED
    behind = pool.request(
        LeaseRequest(owner="carol", memory=8 * GIB, holder_pid=os.getpid(), holder_host=socket.gethostname())
    )
    assert behind.state is LeaseState.QUEUED
    penv.lease_id, penv.kernel_id = queued.id, "k-alice"
    kernel = kernel_factory(penv.kernel_env())

    status = kernel.run("%gpupool status").plain()
    assert "queued" in status and "position 1 of 2" in status
    queue = kernel.run("%gpupool queue").plain()
    assert "14 GiB of 16 GiB leased" in queue
    assert "queue (2 waiting)" in queue
    assert "alice" in queue and "this kernel" in queue
    assert "another user" in queue and "carol" not in queue  # others stay anonymous

    timed_out = kernel.run("%gpupool wait --timeout 1s", allow_error=True)
    assert "still queued" in one_line_error(timed_out)

    msg_id = kernel.submit("%gpupool wait --timeout 2m")
    # Release the blocker once the kernel is visibly waiting (its progress display is out).
    deadline = time.monotonic() + 60
    seen_progress = False
    while not seen_progress:
        assert time.monotonic() < deadline, "the kernel never showed its queue position"
        msg = kernel.kc.get_iopub_msg(timeout=deadline - time.monotonic())
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "display_data":
            seen_progress = "position 1 of 2" in msg["content"]["data"]["text/plain"]
    pool.release(blocker)
    result = kernel.collect(msg_id, timeout=60)
    assert result.status == "ok", result.all_text()
    assert "slice granted" in result.plain() and "4 GiB on GPU 0" in result.plain()
    assert pool.get(queued.id).state is LeaseState.GRANTED
    env = kernel.run("import os; (os.environ['GPUPOOL_LEASE_ID'], os.environ['GPUPOOL_MEMORY_LIMIT'])").value()
    assert env == (queued.id, str(4 * GIB))
    pool.close()


def test_changing_the_gpu_count_of_a_running_slice_says_what_to_do(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    message = one_line_error(kernel.run("%gpupool reserve 4GiB --gpus 2", allow_error=True))
    assert "%gpupool release" in message and "--gpus 2" in message


def test_kernel_without_a_lease_says_so_and_can_ask_for_one(pool_env: PoolEnv, kernel_factory: Any) -> None:
    env = pool_env.kernel_env()
    for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_KERNEL_ID", "GPUPOOL_MEMORY_LIMIT"):
        env.pop(name)
    env["GPUPOOL_AUTOLEASE"] = "off"  # or, where the kernel config is installed, it would lease for itself
    kernel = kernel_factory(env)
    assert "no GPU slice" in kernel.run("%gpupool status").plain()
    assert "no GPU slice" in one_line_error(kernel.run("%gpupool release", allow_error=True))
    kernel.run("%gpupool reserve 2GiB")
    mine = [lease for lease in pool_env.pool.leases(owner="alice") if lease.id != pool_env.lease_id]
    assert len(mine) == 1 and mine[0].memory == 2 * GIB and mine[0].state is LeaseState.GRANTED


def test_terminal_ipython_prints_plain_text(pool_env: PoolEnv) -> None:
    script = "%gpupool status\n%gpupool reserve 12XB\n"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "IPython",
            "--ext=jupyter_gpupool.kernel",
            "--no-banner",
            "--colors=nocolor",
            "--simple-prompt",
        ],
        input=script,
        check=False,
        env=pool_env.kernel_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = strip_ansi(proc.stdout + proc.stderr)
    assert "gpupool: this kernel's GPU slice" in out and "4 GiB on GPU 0" in out
    assert "<table" not in out
    assert "gpupool: invalid size '12XB'" in out and "Traceback" not in out


def test_cpu_only_kernel_and_unreachable_pool_say_unavailable_with_the_reason(
    pool_env: PoolEnv, kernel_factory: Any, tmp_path: Any
) -> None:
    """A kernel started CPU-only (the pool was unavailable) says so and why; a pool that cannot be
    opened now shows as ``unavailable`` with the reason, not as a failed magic."""
    env = pool_env.kernel_env()
    for name in ("GPUPOOL_LEASE_ID", "GPUPOOL_MEMORY_LIMIT"):
        env.pop(name)
    env["GPUPOOL_UNAVAILABLE"] = "no NVIDIA driver found (NVML: NVML Shared Library Not Found)"
    env["CUDA_VISIBLE_DEVICES"] = ""
    text = kernel_factory(env).run("%gpupool status").plain()
    assert "unavailable" in text and "no NVIDIA driver found" in text and "CPU-only" in text, text

    broken = tmp_path / "broken.sqlite"
    broken.write_bytes(b"not a pool file\n" * 64)
    env = pool_env.kernel_env()
    env["GPUPOOL_DB"] = str(broken)
    result = kernel_factory(env).run("%gpupool status", allow_error=True)
    assert result.status == "ok", result.errors
    text = result.plain()
    assert "unavailable" in text and str(broken) in text, text


def test_a_keep_reads_back_as_the_time_asked_for_not_a_minute_less(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    kept = kernel.run("%gpupool keep 1h").plain()
    assert "held through idle until" in kept and "(1 h)" in kept, kept
    time.sleep(1.5)  # a status read a moment later still says the hour the user asked for
    status = kernel.run("%gpupool status").plain()
    assert "(1 h left)" in status and "59 min" not in status, status


def test_a_wait_that_ends_in_a_restore_says_so_in_its_heading(tmp_path: Any, kernel_factory: Any) -> None:
    """A suspended kernel asked back is granted while its memory comes back: `%gpupool wait`'s
    heading says "restoring", as its state does, not only "slice granted"."""
    penv = make_pool_env(tmp_path)
    pool = penv.pool
    pool.release(penv.lease_id)
    lease = pool.request(
        LeaseRequest(owner="alice", memory=4 * GIB, kernel_id=penv.kernel_id, suspendable=True,
                     holder_pid=os.getpid(), holder_host=socket.gethostname())
    )
    penv.lease_id = lease.id
    kernel = kernel_factory(penv.kernel_env())
    pool.suspend(lease.id)
    pool.confirm_transition(lease.id, parked_bytes=GIB)
    pool.resume(lease.id)
    back = pool.get(lease.id)
    assert back.state is LeaseState.GRANTED and back.transition.value == "restoring"
    result = kernel.run("%gpupool wait --timeout 5s")
    assert result.status == "ok", result.all_text()
    text = result.plain()
    assert "gpupool: slice granted, restoring its GPU memory from host RAM" in text, text
    pool.close()
