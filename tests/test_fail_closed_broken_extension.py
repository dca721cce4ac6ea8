"""The last line of defence: if the gpupool server extension itself breaks while it starts (a bug,
a broken install), the kernels it would have pooled start with every GPU hidden — never unpooled.

The fault is injected (no real input makes our start-up raise any more: bad settings take the
degraded path, see test_fail_closed_bad_config.py); the server and the kernel are real.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from jupyter_gpupool.enforcement.plan import EnforcementSettings

pytestmark = [pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(autouse=True)
def broken_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Any) -> Any:
        raise RuntimeError("injected fault while the extension starts")

    monkeypatch.setattr(EnforcementSettings, "to_config", boom)


def test_a_broken_extension_start_hides_every_gpu_from_kernels(arun, jp_serverapp, gpupool_fetch, gpupool_wait, kernel_exec, caplog):
    assert "gpupool" not in jp_serverapp.web_app.settings or not getattr(jp_serverapp.web_app.settings["gpupool"], "binding", None)

    async def scenario() -> None:
        response = await gpupool_fetch("api", "kernels", method="POST", body={"name": "python3"})
        assert response.code == 201, response.body
        kernel_id = json.loads(response.body)["id"]
        out = await kernel_exec(kernel_id, "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), os.environ.get('GPUPOOL_UNAVAILABLE'))")
        visible, _, reason = out.strip().partition(" ")
        assert visible == "''", out
        assert "the gpupool server extension failed to start: RuntimeError: injected fault while the extension starts" in reason, out

    with caplog.at_level(logging.ERROR):
        arun(scenario())
