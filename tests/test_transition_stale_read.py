"""The server's transition driver acts on leases read before it took its lock (the tick's read,
the change follower's): a read from before the same step was confirmed must not do it again.
Under load a stale SUSPENDING read once parked a kernel a second time; its failure was reported
against the restore the kernel's next cell had asked for meanwhile, and the kernel was shut down."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from pool_helpers import T0, make_pool, req

from jupyter_gpupool.core.models import LeaseState, Transition
from jupyter_gpupool.serverextension.transitions import TransitionDriver


def _driver(pool: Any) -> tuple[TransitionDriver, list[str]]:
    """A driver on a real pool whose steps only record that they ran."""
    driver = TransitionDriver(SimpleNamespace(pool=pool, log=logging.getLogger("test")))  # type: ignore[arg-type]
    ran: list[str] = []

    async def step(name: str, *_: Any) -> None:
        ran.append(name)

    driver._suspend = lambda *a: step("suspend", *a)  # type: ignore[method-assign]
    driver._restore = lambda *a: step("restore", *a)  # type: ignore[method-assign]
    driver._move = lambda *a: step("move", *a)  # type: ignore[method-assign]
    return driver, ran


def test_a_step_read_before_it_was_confirmed_is_not_done_again(tmp_path: Path) -> None:
    pool = make_pool(tmp_path)
    try:
        lease = pool.request(req(kernel_id="k1", suspendable=True), now=T0)
        suspending = pool.suspend(lease.id, now=T0 + 1)
        assert suspending.transition is Transition.SUSPENDING
        prov = SimpleNamespace(process=SimpleNamespace(pid=4242))
        driver, ran = _driver(pool)
        asyncio.run(driver._carry_out_transition("k1", prov, suspending))  # type: ignore[arg-type]
        assert ran == ["suspend"]  # the step the pool asks for is done
        pool.confirm_transition(lease.id, 0, now=T0 + 2)
        restoring = pool.resume(lease.id, now=T0 + 3)  # the kernel's next cell asks it back at once
        assert restoring.state is LeaseState.GRANTED and restoring.transition is Transition.RESTORING
        asyncio.run(driver._carry_out_transition("k1", prov, suspending))  # type: ignore[arg-type]  # the stale read
        assert ran == ["suspend"], "a suspend confirmed already was carried out again"
        asyncio.run(driver._carry_out_transition("k1", prov, restoring))  # type: ignore[arg-type]
        assert ran == ["suspend", "restore"]
        assert pool.get(lease.id).transition is Transition.RESTORING  # nothing failed it
    finally:
        pool.close()
