"""``PoolStatus`` ipywidget: its model state in a real kernel, and its rendering of each lease state."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import ipywidgets
import pytest

from jupyter_gpupool.core.models import LeaseRequest, LeaseState, Transition
from jupyter_gpupool.errors import PoolUnavailable
from jupyter_gpupool.kernel.client import InProcessPoolClient
from jupyter_gpupool.units import GIB
from jupyter_gpupool.widget import PoolStatus

try:
    from test_kernel_extension import PoolEnv, kernel_factory, make_pool_env, pool_env
except ImportError:  # tests as a package
    from tests.test_kernel_extension import PoolEnv, kernel_factory, make_pool_env, pool_env  # noqa: F401


def client_for(penv: PoolEnv) -> InProcessPoolClient:
    env = {"GPUPOOL_LEASE_ID": penv.lease_id, "GPUPOOL_KERNEL_ID": penv.kernel_id}
    return InProcessPoolClient(env=env, pool_factory=lambda: penv.pool)


# -- rendering, in this process ---------------------------------------------------------------


def test_granted_slice_shows_share_usage_idle_and_keep(pool_env: PoolEnv) -> None:
    pool_env.pool.report_usage({pool_env.lease_id: 3 * GIB})
    widget = PoolStatus(client=client_for(pool_env), autostart=False)
    try:
        assert "granted" in widget.title.value
        assert widget.share.value == "4 GiB on GPU 0 (Simulated GPU 16GiB) — 4 GiB guaranteed · 4 GiB now, up to 16 GiB"
        assert widget.usage_bar.value == 75 and widget.usage_bar.bar_style == "success"
        assert "3 GiB of 4 GiB (75%)" in widget.usage_text.value
        assert widget.queue.value == ""
        assert "reclaimable in" in widget.idle.value
        assert not widget.keep_button.disabled
        widget.keep_button.click()
        lease = pool_env.pool.get(pool_env.lease_id)
        assert lease.keep_until is not None and abs(lease.keep_until - (time.time() + 3600)) < 120
        assert "kept through idle until" in widget.message.value
        assert "kept through idle until" in widget.idle.value
    finally:
        widget.close()


def test_a_slice_that_peaked_far_below_its_size_gets_the_right_sizing_hint(pool_env: PoolEnv) -> None:
    """The lab sidebar's hint, from the one rule in kernel/status.py: the widget shows it and acts on it."""
    pool_env.pool.report_usage({pool_env.lease_id: 1 * GIB})  # peak 1 GiB of a 4 GiB slice
    widget = PoolStatus(client=client_for(pool_env), autostart=False)
    try:
        assert widget.hint.value == "peaked at 1 GiB of 4 — shrink to 2 GiB?"
        assert widget.shrink_button.description == "Shrink to 2 GiB"
        assert widget.shrink_button.layout.display == ""
        widget.shrink_button.click()
        assert pool_env.pool.get(pool_env.lease_id).memory == 2 * GIB
        assert widget.hint.value == "" and widget.shrink_button.layout.display == "none"
    finally:
        widget.close()


def test_queued_slice_shows_position_and_disables_keep(tmp_path: Path) -> None:
    penv = make_pool_env(tmp_path, memory=14 * GIB, owner="bob")
    queued = penv.pool.request(
        LeaseRequest(
            owner="alice", memory=4 * GIB, kernel_id="k-a", holder_pid=os.getpid(), holder_host=socket.gethostname()
        )
    )
    assert queued.state is LeaseState.QUEUED
    penv.lease_id, penv.kernel_id = queued.id, "k-a"
    widget = PoolStatus(client=client_for(penv), autostart=False)
    try:
        assert "queued" in widget.title.value
        assert "position 1 of 1" in widget.queue.value
        assert widget.keep_button.disabled
        assert widget.usage_bar.value == 0
    finally:
        widget.close()
        penv.pool.close()


def test_usage_over_the_slice_turns_the_bar_red(pool_env: PoolEnv) -> None:
    pool_env.pool.resize(pool_env.lease_id, 4 * GIB, limit=0)  # a fixed slice: an elastic one would grow
    pool_env.pool.report_usage({pool_env.lease_id: 5 * GIB})
    widget = PoolStatus(client=client_for(pool_env), autostart=False)
    try:
        assert widget.usage_bar.value == 100 and widget.usage_bar.bar_style == "danger"
        assert "OVER THE SLICE" in widget.usage_text.value
    finally:
        widget.close()


def test_pool_errors_show_in_the_widget_not_as_exceptions() -> None:
    def broken() -> Any:
        raise PoolUnavailable("cannot open the GPU pool at /nowhere: disk gone")

    widget = PoolStatus(client=InProcessPoolClient(env={}, pool_factory=broken), autostart=False)
    try:
        assert "cannot open the GPU pool at /nowhere" in widget.message.value
        # The pool's state, not a crash: "unavailable", and the kernel has no slice.
        assert widget.last_status is not None and widget.last_status.state == "unavailable"
        assert "unavailable" in widget.title.value and widget.keep_button.disabled
    finally:
        widget.close()


def test_background_refresh_follows_the_pool_and_close_stops_it(pool_env: PoolEnv) -> None:
    widget = PoolStatus(client=client_for(pool_env), interval=0.05)
    try:
        assert widget.running
        pool_env.pool.report_usage({pool_env.lease_id: 2 * GIB})
        deadline = time.monotonic() + 20
        while widget.usage_bar.value != 50:
            assert time.monotonic() < deadline, "the widget never picked up the new usage"
            time.sleep(0.05)
    finally:
        widget.close()
    assert not widget.running
    count = widget.refresh_count
    pool_env.pool.report_usage({pool_env.lease_id: 1 * GIB})
    widget._stop.wait(0.3)  # would be several refreshes if the thread were still running
    assert widget.refresh_count == count
    assert widget.comm is None  # closed: the front end drops the view


def test_suspend_and_resume_buttons_follow_the_lease(tmp_path: Path) -> None:
    try:
        from test_kernel_suspend import PARKED, make_suspendable_env
    except ImportError:  # tests as a package
        from tests.test_kernel_suspend import PARKED, make_suspendable_env
    penv = make_suspendable_env(tmp_path)
    pool = penv.pool
    widget = PoolStatus(client=client_for(penv), autostart=False)
    try:
        assert widget.suspend_button.layout.display == "" and not widget.suspend_button.disabled
        assert widget.resume_button.layout.display == "none"
        widget.suspend_button.click()
        assert pool.get(penv.lease_id).transition is Transition.SUSPENDING
        assert "GPU memory will be parked in host RAM; your next cell resumes it" in widget.message.value
        assert "suspending" in widget.title.value and widget.suspend_button.disabled

        pool.confirm_transition(penv.lease_id, parked_bytes=PARKED)  # what the kernel's server does
        widget.refresh()
        assert "suspended" in widget.title.value
        assert widget.share.value == "8 GiB suspended (6.2 GiB parked in host RAM) — resumes on your next cell"
        assert widget.suspend_button.layout.display == "none"
        assert widget.resume_button.layout.display == "" and not widget.resume_button.disabled
        assert widget.usage_bar.value == 0 and widget.usage_text.value == "—"

        other = pool.request(
            LeaseRequest(owner="bob", memory=16 * GIB, holder_pid=os.getpid(), holder_host=socket.gethostname())
        )
        widget.resume_button.click()
        lease = pool.get(penv.lease_id)
        assert lease.state is LeaseState.QUEUED and lease.resuming
        assert "resuming" in widget.title.value
        assert "resuming — waiting for a GPU, position 1 of 1" in widget.queue.value
        assert widget.resume_button.disabled and widget.resume_button.description == "Resuming…"

        pool.release(other.id)
        pool.confirm_transition(penv.lease_id)  # restored
        widget.refresh()
        assert "granted" in widget.title.value and widget.resume_button.layout.display == "none"
        assert not widget.suspend_button.disabled
    finally:
        widget.close()
        pool.close()


def test_suspend_is_disabled_where_the_server_cannot_park_memory(pool_env: PoolEnv) -> None:
    widget = PoolStatus(client=client_for(pool_env), autostart=False)
    try:
        assert widget.suspend_button.layout.display == "" and widget.suspend_button.disabled
        assert "cannot park GPU memory" in widget.suspend_button.tooltip
    finally:
        widget.close()


def test_interval_must_be_positive(pool_env: PoolEnv) -> None:
    with pytest.raises(ValueError, match="interval must be above 0"):
        PoolStatus(client=client_for(pool_env), interval=0)


# -- model state in a real kernel -------------------------------------------------------------


@pytest.mark.slow
def test_widget_model_state_in_a_real_kernel(pool_env: PoolEnv, kernel_factory: Any) -> None:
    kernel = kernel_factory(pool_env.kernel_env())
    result = kernel.run(
        """
        from jupyter_gpupool.widget import PoolStatus
        w = PoolStatus(interval=0.1)
        display(w)
        """
    )
    opened = [m["content"] for m in result.messages if m["msg_type"] == "comm_open"]
    # Each model's state as the front end holds it: the open, then every update.
    by_comm = {c["comm_id"]: dict(c["data"]["state"]) for c in opened if c["target_name"] == "jupyter.widget"}
    for m in result.messages:
        if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update":
            by_comm[m["content"]["comm_id"]].update(m["content"]["data"]["state"])
    states = list(by_comm.values())
    views = [m for m in result.messages if m["msg_type"] == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in m["content"]["data"] for m in views)
    html_values = [s.get("value", "") for s in states if s.get("_model_name") == "HTMLModel"]
    assert "4 GiB on GPU 0 (Simulated GPU 16GiB) — 4 GiB guaranteed · 4 GiB now, up to 16 GiB" in html_values
    progress = [s for s in states if s.get("_model_name") == "IntProgressModel"]
    assert len(progress) == 1 and progress[0]["max"] == 100
    buttons = [s for s in states if s.get("_model_name") == "ButtonModel"]
    assert buttons and buttons[0]["description"] == "Keep 1 h" and buttons[0]["disabled"] is False
    assert ipywidgets.__version__.startswith("8")
    assert {c["data"]["state"]["_model_module_version"] for c in opened} <= {"2.0.0"}

    # The kernel's refresh thread picks up a change made by another process (started by the cell,
    # so the update the thread sends belongs to this cell's output however slow the machine).
    result = kernel.run(
        f"""
        import subprocess, sys, time
        subprocess.run([sys.executable, "-c", "import sys; from jupyter_gpupool.backends.local.pool import Pool; "
                        "Pool.from_env().report_usage({{sys.argv[1]: 2**30}})", {pool_env.lease_id!r}], check=True)
        deadline = time.monotonic() + 60
        while w.usage_bar.value != 25 and time.monotonic() < deadline:
            time.sleep(0.05)
        (w.usage_bar.value, w.running)
        """,
        timeout=120,
    )
    assert result.value() == (25, True)
    # ... and sends it to the front end from its thread.
    updates = [m["content"]["data"]["state"] for m in result.messages if m["msg_type"] == "comm_msg"]
    assert {"value": 25} in updates

    kernel.run("w.keep_button.click()")
    assert pool_env.pool.get(pool_env.lease_id).keep_until is not None

    assert kernel.run("w.close(); (w.running, w.comm is None)").value() == (False, True)
