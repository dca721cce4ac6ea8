"""Small builders shared by the engine tests (not fixtures, so any test file can import them)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest, PriorityClass
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB

T0 = 1_800_000_000.0  # a fixed "now" so tests never depend on the wall clock


def make_pool(tmp_path: Any, spec: str = "1x16GiB", name: str = "pool.sqlite", **policy: Any) -> Pool:
    policy.setdefault("heartbeat_ttl", 10**9)  # tests drive time by hand; heartbeats are tested on their own
    return Pool(SimulatedBackend.from_spec(spec), str(tmp_path / name), PoolPolicy(**policy), clock=lambda: T0)


def req(owner: str = "alice", gib: float = 8, **kw: Any) -> LeaseRequest:
    if "priority" in kw and isinstance(kw["priority"], str):
        kw["priority"] = PriorityClass(kw["priority"])
    return LeaseRequest(owner=owner, memory=int(gib * GIB), **kw)


def start_kernel_process(env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A live process started with ``env`` (and a ``PATH``), as the pool's provisioner starts a kernel;
    returned once it runs its own program. ``Popen`` returns when the exec closes the parent's pipe,
    before the new program's environment is in place: until then ``/proc`` shows it empty, and the
    pool could not tell whose the process is (a test's scripted GPU memory would be nobody's)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(120)"],
                            env={**env, "PATH": "/usr/bin:/bin"}, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


@contextmanager
def kernel_process(env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """:func:`start_kernel_process`, killed and reaped on the way out."""
    proc = start_kernel_process(env)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()
