"""``%gpupool reserve`` in a running kernel that fits once the slices beside it are at their
guarantees: burst yields to it. The magic answers at once that the reserve is queued (the cell
does not wait), and the slice grows when the burst is given back. A real kernel on a simulated
``1x16GiB`` pool."""

from __future__ import annotations

from typing import Any

import pytest

from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.units import GIB

try:
    from test_kernel_extension import kernel_factory, make_pool_env
except ImportError:  # tests as a package
    from tests.test_kernel_extension import kernel_factory, make_pool_env  # noqa: F401

pytestmark = pytest.mark.slow


def test_a_reserve_that_fits_at_guarantees_is_queued_at_once_and_served_when_burst_is_given_back(
    tmp_path: Any, kernel_factory: Any
) -> None:
    penv = make_pool_env(tmp_path, memory=2 * GIB, owner="bob")
    pool = penv.pool
    other = pool.request(LeaseRequest(owner="alice", memory=2 * GIB))
    assert pool.grow(other.id, 8 * GIB).memory == 8 * GIB  # up to its 4x limit
    pool.report_usage({other.id: 7 * GIB})  # the watchdog saw it use its burst
    kernel = kernel_factory(penv.kernel_env())

    answer = kernel.run("%gpupool reserve 10GiB")
    assert answer.status == "ok", answer.all_text()
    text = answer.plain()
    assert "reserve of 10 GiB on 1 GPU queued" in text and "this cell does not wait" in text, text
    mine = pool.get(penv.lease_id)
    assert mine.reserve_wanted == 10 * GIB and mine.memory == 2 * GIB and mine.state is LeaseState.GRANTED
    assert pool.get(other.id).memory < 8 * GIB  # its burst is being taken back for the reserve

    pool.report_usage({other.id: 1 * GIB})  # its kernel gave the burst back
    pool.tick()
    served = pool.get(penv.lease_id)
    assert served.memory == served.guarantee == 10 * GIB and served.reserve_wanted == 0
    status = kernel.run("%gpupool status").plain()
    assert "10 GiB on GPU 0" in status, status
