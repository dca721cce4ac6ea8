"""The suspend protocol and memory used outside the pool, kept under attack at CI size
(``python tests/reliability.py --only suspend_soak --minutes 10`` runs the long soak): forged and
replayed transition reports, a 1 PiB ``parked_bytes``, processes outside the pool on the fake
``pynvml`` and on the simulated pool, a real broker and a real server SIGKILLed mid-step, and a
soak whose invariants are checked after every step."""

from __future__ import annotations

from pathlib import Path

import pytest
import reliability
from pool_helpers import T0

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.core.models import LeaseRequest
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.units import GIB

pytestmark = pytest.mark.slow


def test_unpooled_use_on_nvml_is_seen_and_never_granted_and_a_forged_suspend_frees_nothing(tmp_path: Path) -> None:
    figures = reliability.unpooled_nvml(tmp_path)
    assert "the 30 GiB NVML still lists stay taken" in figures["forged_suspend_done"]
    assert "more than this lease's GPUs hold" in figures["pib_parked_bytes"]


def test_a_real_broker_frees_nothing_by_forged_reports_and_finishes_steps_it_was_killed_in(tmp_path: Path) -> None:
    figures = reliability.broker_suspend_attacks(tmp_path)
    assert figures["forged_suspend_done"].startswith("200") and figures["pib_parked_bytes"] == 400
    assert figures["replayed_confirmations"] == [200, 200, 400]
    assert figures["broker_kills"] == 3


def test_a_server_killed_mid_suspend_leaves_nothing_parked_or_held(tmp_path: Path) -> None:
    figures = reliability.server_kill_mid_step(tmp_path, steps=("suspend",))
    assert "released" in figures["killed_mid_suspend"]


def test_the_suspend_soak_keeps_its_invariants_after_every_step(tmp_path: Path) -> None:
    figures = reliability.suspend_soak(tmp_path, seconds=5, min_operations=150)
    assert figures["failures"] == 0, figures["failure_lines"]
    assert figures["operations"] >= 150 and figures["invariant_checks"] == figures["operations"]
    assert figures["suspends_confirmed"] > 5 and figures["restores_confirmed"] > 0 and figures["restarts"] > 5
    assert figures["forged_taken"] > 0 and figures["forged_let_go"] > 0 and figures["replays_harmless"] > 0 and figures["outside_started"] > 0
    assert figures["fds_end"] <= figures["fds_start"] + 2


def test_a_suspended_lease_released_is_metered_once_for_its_granted_time(tmp_path: Path) -> None:
    """Granted 100 s, suspended 1,000 s, then released: the ledger holds the 100 s granted, once;
    the suspended time held no GPU and is not metered again when the lease goes."""
    clock = [T0]
    pool = Pool(SimulatedBackend.from_spec("1x16GiB"), str(tmp_path / "pool.sqlite"), PoolPolicy(heartbeat_ttl=10**9),
                clock=lambda: clock[0])
    try:
        lease = pool.request(LeaseRequest(owner="alice", memory=4 * GIB, suspendable=True))
        clock[0] += 100
        pool.suspend(lease.id)
        pool.confirm_transition(lease.id, parked_bytes=GIB)
        clock[0] += 1000
        pool.release(lease.id)
        intervals = [(row["start"] - T0, row["end"] - T0) for row in pool.store.ledger()]
        assert intervals == [(0.0, 100.0)], intervals
        assert pool.store.usage(clock[0], 10**9)["alice"] == pytest.approx(4 * 100 / 3600, rel=1e-3)
    finally:
        pool.close()
