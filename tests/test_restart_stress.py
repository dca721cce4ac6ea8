"""Kernel restarts mixed with reserve, release, stop and new starts, on a real server with real
kernels over a small simulated pool: a restart never fails because of the pool.

Bounded: a fixed number of seeded random operations, three in flight at once. On the code before
this test, restarts answered 500 "Exception restarting kernel" (a restart of a kernel still
waiting in the queue: "Kernel is in a pending state"), hung until a slice freed up (a restart that
had to queue again), and a DELETE during such a restart answered 500 (InvalidStateError).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

#: Seconds a restart may take to answer: a kernel that must queue again answers once it waits.
RESTART_ANSWER_LIMIT = 30.0


@pytest.mark.gpupool_env(GPUPOOL_SIMULATE="1x16GiB", GPUPOOL_DEFAULT_MEMORY="6GiB")
@pytest.mark.parametrize("seed", [1010, 2020])
def test_restarts_mixed_with_reserve_release_stop_never_fail(seed, arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext):
    """Seeded random start/stop/restart/reserve/release, 3 in flight: every restart of a kernel that
    exists answers 200 in bounded time (409 with the reason while its start still waits in the
    queue), no DELETE or gpupool route answers 5xx, and once every kernel is gone the pool holds
    no live lease."""
    rng = random.Random(seed)
    log: list[tuple[str, str, int, str]] = []
    kernels: list[str] = []
    km = jp_serverapp.kernel_manager
    causes: list[str] = []
    restart = km.restart_kernel

    async def recording_restart(kernel_id: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await restart(kernel_id, *args, **kwargs)
        except Exception as err:
            causes.append(repr(err))
            raise

    km.restart_kernel = recording_restart

    async def op(kind: str) -> None:
        if kind == "start" or not kernels:
            response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
            assert response.code == 201, response.body
            kernels.append(json.loads(response.body)["id"])
            return
        kernel_id = rng.choice(kernels)
        started = time.monotonic()
        if kind == "stop":
            kernels.remove(kernel_id)
            response = await gpupool_fetch("api", "kernels", kernel_id, method="DELETE")
        elif kind == "restart":
            response = await gpupool_fetch(
                "api", "kernels", kernel_id, "restart", method="POST", request_timeout=RESTART_ANSWER_LIMIT + 30
            )
        elif kind == "reserve":
            size = rng.choice(["2GiB", "4GiB", "8GiB", "12GiB"])
            response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id, "reserve", method="POST", body={"memory": size})
        else:
            response = await gpupool_fetch("api", "gpupool", "kernels", kernel_id, "release", method="POST")
        took = time.monotonic() - started
        if kind == "stop" or kernel_id in kernels:  # not stopped meanwhile (then a 404 is right)
            log.append((kind, kernel_id, response.code, f"{took:.1f}s {response.body.decode()[:200]}"))

    async def scenario() -> None:
        weights = {"start": 3, "stop": 2, "restart": 4, "reserve": 3, "release": 2}
        kinds = [k for k, w in weights.items() for _ in range(w)]
        for _ in range(16):
            batch = [op(rng.choice(kinds) if len(kernels) < 4 else rng.choice(kinds[3:])) for _ in range(3)]
            await asyncio.gather(*batch)
        for kernel_id in kernels:
            response = await gpupool_fetch("api", "kernels", kernel_id, method="DELETE")
            log.append(("stop", kernel_id, response.code, response.body.decode()[:200]))
        pool = gpupool_ext.pool
        await gpupool_wait(lambda: not pool.leases(), timeout=30, what="no live lease once every kernel is gone")

    arun(scenario())
    restarts = [entry for entry in log if entry[0] == "restart"]
    assert len(restarts) >= 5, log
    failed = [entry for entry in log if entry[2] >= 500]
    assert not failed, (failed, causes)
    # A kernel whose start still waits has no process to restart yet: 409 with the reason.
    not_started = [e for e in restarts if e[2] == 409 and "once it has started" in e[3]]
    assert all(entry[2] == 200 for entry in restarts if entry not in not_started), restarts
    assert len(restarts) - len(not_started) >= 3, restarts
    assert all(float(entry[3].split("s ", 1)[0]) < RESTART_ANSWER_LIMIT for entry in restarts), restarts
