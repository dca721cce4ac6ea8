"""Checks that test the runner, not the GPU: one passes, one hangs, one crashes, one raises,
one leaves a process behind. Enabled only with ``GPUCHECK_EXTRA_CHECKS=gpucheck.selftest``
(tests/test_gpu_script.py); they never appear in a real run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from .checks import CheckSpec, Context, Options
from .harness import register_pid
from .report import Result, Status


def _ready(probe: object, options: Options) -> str | None:
    return None


def _passes(ctx: Context) -> Result:
    return Result(
        ctx.name, Status.PASS, number="1", detail=f"ran in pid {os.getpid()} with slice {ctx.options.slice_bytes}"
    )


def _hangs(ctx: Context) -> Result:
    time.sleep(3600)
    return Result(ctx.name, Status.PASS)


def _crashes(ctx: Context) -> Result:
    sys.stdout.flush()
    os._exit(7)


def _raises(ctx: Context) -> Result:
    raise RuntimeError("planted failure")


def _leaves_process(ctx: Context) -> Result:
    # A process in a session of its own, as jupyter_client starts kernels: the runner must end it.
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    register_pid(proc.pid, "sleeper")
    (ctx.workdir / "sleeper.pid").write_text(str(proc.pid))
    if os.environ.get("GPUCHECK_SELFTEST_PIDFILE"):
        with open(os.environ["GPUCHECK_SELFTEST_PIDFILE"], "w") as fh:
            fh.write(str(proc.pid))
    return Result(ctx.name, Status.PASS, detail="left a sleeper behind")


SPECS = [
    CheckSpec("selftest-pass", "passes", _ready, _passes, timeout=30, min_seconds=1),
    CheckSpec("selftest-hang", "hangs past its timeout", _ready, _hangs, timeout=2, min_seconds=1),
    CheckSpec("selftest-crash", "exits without a result", _ready, _crashes, timeout=30, min_seconds=1),
    CheckSpec("selftest-raise", "raises", _ready, _raises, timeout=30, min_seconds=1),
    CheckSpec("selftest-leak", "leaves a process behind", _ready, _leaves_process, timeout=30, min_seconds=1),
]
