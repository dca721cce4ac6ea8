"""A reserve in a running kernel takes burst back as a queued request does, with a real
jupyter_server, real kernels and the server's watchdog on a simulated 1x16GiB pool (2 GiB default,
burst 16 GiB): kernel A grows to 6 GiB and then uses 1 GiB; kernel B's ``%gpupool reserve 12GiB``
is answered at once, never refused, and B holds 12 GiB within 30 s with A back near its guarantee.
"""

from __future__ import annotations

import pytest
from server_kernels import start_kernel

from jupyter_gpupool.core.models import LeaseState
from jupyter_gpupool.units import GIB

pytestmark = [
    pytest.mark.slow,
    pytest.mark.gpupool_env(GPUPOOL_DEFAULT_MEMORY="2GiB", GPUPOOL_BURST="16GiB"),
]

USE = "from jupyter_gpupool.devices.simulated import pretend_to_use\n"
RESERVE = (
    "from IPython.utils.capture import capture_output\n"
    "with capture_output() as shown:\n"
    "    get_ipython().run_line_magic('gpupool', 'reserve 12GiB')\n"
    "print(' | '.join(o.data.get('text/plain', '') for o in shown.outputs))\n"
)


def test_a_reserve_in_a_granted_kernel_takes_back_the_burst_beside_it(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    pool = gpupool_ext.pool

    async def scenario() -> None:
        a = await start_kernel(gpupool_fetch)
        lease_a = await gpupool_wait(lambda: (l := pool.lease_for_kernel(a)) and l.state is LeaseState.GRANTED and l,
                                     what="kernel A's slice")
        await kernel_exec(a, USE + "pretend_to_use('6GiB')")
        assert pool.get(lease_a.id).memory >= 6 * GIB
        await kernel_exec(a, USE + "pretend_to_use('1GiB')")
        await gpupool_wait(lambda: (pool.get(lease_a.id).used_memory or 99 * GIB) <= GIB, what="A's use down to 1 GiB")
        b = await start_kernel(gpupool_fetch)
        lease_b = await gpupool_wait(lambda: (l := pool.lease_for_kernel(b)) and l.state is LeaseState.GRANTED and l,
                                     what="kernel B's slice")
        assert lease_b.memory == 2 * GIB and pool.get(lease_a.id).memory >= 6 * GIB  # 8 GiB free: 10 GiB more do not fit now
        answer = await kernel_exec(b, RESERVE)
        assert "cannot grow" not in answer and "release and request" not in answer, answer
        assert "reserve of 12 GiB on 1 GPU queued" in answer or "slice changed from 2 GiB to 12 GiB" in answer, answer
        served = await gpupool_wait(lambda: (l := pool.get(lease_b.id)).memory == 12 * GIB and l, timeout=30,
                                    what="kernel B's reserve of 12 GiB")
        assert served.guarantee == 12 * GIB and served.reserve_wanted == 0
        back = pool.get(lease_a.id)
        assert back.state is LeaseState.GRANTED and back.guarantee == 2 * GIB and back.memory <= 4 * GIB

    arun(scenario())
