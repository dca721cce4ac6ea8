"""The single-user server serves the pool's Prometheus metrics at its own /metrics, behind auth."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning")]


def test_pool_metrics_on_the_servers_metrics_endpoint(arun, jp_serverapp, gpupool_fetch, jp_fetch):
    async def scenario() -> None:
        response = await gpupool_fetch("metrics")
        assert response.code == 200
        text = response.body.decode()
        assert "gpupool_memory_total_bytes 1.7179869184e+10" in text  # the simulated 1x16GiB pool
        assert "gpupool_queue_length" in text and "gpupool_grants_total" in text
        # Suspended kernels (issue 12): the same collector as the broker's.
        for name in (
            'gpupool_leases{state="suspended"} 0.0',
            "gpupool_suspends_total 0.0",
            "gpupool_resumes_total 0.0",
            "gpupool_migrations_total 0.0",
            "gpupool_parked_memory_bytes 0.0",
            "gpupool_parked_seconds_total 0.0",
            'gpupool_transitions{transition="restoring"} 0.0',
            'gpupool_restore_seconds_bucket{le="+Inf"} 0.0',
        ):
            assert name in text, name
        anonymous = await jp_fetch("metrics", raise_error=False, headers={"Authorization": "token not-a-token"})
        assert anonymous.code in (401, 403)

    arun(scenario())
