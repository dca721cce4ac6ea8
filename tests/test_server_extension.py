"""The gpupool server extension against a real jupyter_server and real ipykernel kernels.

Every server here runs with ``allow_unauthenticated_access=False`` and fails on any
``JupyterServerAuthWarning``; users are told apart by token (see conftest.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest

from jupyter_gpupool.core.models import LeaseRequest, LeaseState
from jupyter_gpupool.serverextension.app import LEASE_SCHEMA_ID
from jupyter_gpupool.units import GIB, SIZE_FORMS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("error::jupyter_server.utils.JupyterServerAuthWarning"),
]

ENV_CODE = "import os, sys, json; print(json.dumps({'env': dict(os.environ), 'argv': sys.argv, 'pid': os.getpid()}))"


async def start_kernel(fetch: Any, user: str = "alice") -> tuple[str, float]:
    started = time.monotonic()
    response = await fetch("api", "kernels", method="POST", body={"name": "python3"}, user=user)
    assert response.code == 201, response.body
    return json.loads(response.body)["id"], time.monotonic() - started


async def kernel_state(fetch: Any, kernel_id: str, user: str = "alice") -> dict[str, Any]:
    response = await fetch("api", "gpupool", "kernels", kernel_id, user=user)
    assert response.code == 200, response.body
    return json.loads(response.body)


def _openapi_required(schema: str) -> set[str]:
    from pathlib import Path

    import yaml

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "openapi.yaml").read_text())
    return set(spec["components"]["schemas"][schema]["required"])


def record_events(serverapp: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        events.append(dict(data))

    serverapp.event_logger.add_listener(schema_id=LEASE_SCHEMA_ID, listener=listener)
    return events


def test_three_kernels_two_granted_one_queued_then_handover(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, kernel_exec, gpupool_env
):
    """1x16GiB, 8 GiB default: POSTs return at once, 2 granted + 1 queued, handover on shutdown."""
    events = record_events(jp_serverapp)

    async def scenario() -> None:
        ids, took = [], []
        for _ in range(3):
            kernel_id, seconds = await start_kernel(gpupool_fetch)
            ids.append(kernel_id)
            took.append(seconds)
        # A kernel that waits for a GPU must not hold up the REST call (pending kernels): one that
        # did would answer only at the handover below, never within the bound (load stretches the rest).
        assert max(took) < 30.0, took

        async def all_requested() -> list[dict[str, Any]] | None:
            states = [await kernel_state(gpupool_fetch, k) for k in ids]
            return states if all(s["state"] in ("granted", "queued") for s in states) else None

        states = await gpupool_wait(all_requested, what="three leases")
        by_state = sorted(s["state"] for s in states)
        assert by_state == ["granted", "granted", "queued"], states
        queued = next(s for s in states if s["state"] == "queued")
        granted = [s for s in states if s["state"] == "granted"]
        assert queued["queue_position"] == 1 and queued["queue_length"] == 1
        assert queued["devices"] == [] and queued["enforcement"]["level"] == "none"
        assert all(s["memory"] == 8 * GIB for s in states)
        required = _openapi_required("KernelSlice")
        assert all(required <= set(s) for s in states)

        # The queued kernel is "starting" for jupyter_server, not dead.
        response = await gpupool_fetch("api", "kernels", queued["kernel_id"])
        assert json.loads(response.body)["execution_state"] == "starting"

        # The pool view: the one GPU fully leased, one request queued.
        pool = json.loads((await gpupool_fetch("api", "gpupool", "pool")).body)
        assert pool["devices"][0]["memory_total"] == 16 * GIB
        assert pool["devices"][0]["memory_leased"] == 16 * GIB
        assert len(pool["queue"]) == 1 and pool["queue"][0]["kernel_id"] == queued["kernel_id"]

        # Inside a granted kernel, os.environ holds the grant.
        first = granted[0]
        seen = json.loads(await kernel_exec(first["kernel_id"], ENV_CODE))
        env = seen["env"]
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(d["uuid"] for d in first["devices"])
        assert env["GPUPOOL_LEASE_ID"] == first["lease_id"]
        assert env["GPUPOOL_MEMORY_LIMIT"] == str(8 * GIB)
        assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.500"
        assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
        assert env["CUPY_GPU_MEMORY_LIMIT"] == str(8 * GIB)
        assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
        assert env["GPUPOOL_DB"] == gpupool_env["GPUPOOL_DB"]
        assert env["GPUPOOL_SIMULATE"] == "1x16GiB"
        assert env["GPUPOOL_KERNEL_ID"] == first["kernel_id"]
        assert "--ext=jupyter_gpupool.kernel" in seen["argv"]
        assert first["enforcement"]["mechanisms"] == ["framework-caps", "watchdog"]

        # A fourth kernel queues behind; shutting it down withdraws its request at once.
        fourth, _ = await start_kernel(gpupool_fetch)
        await gpupool_wait(lambda: kernel_state(gpupool_fetch, fourth), what="fourth lease")
        assert (await kernel_state(gpupool_fetch, fourth))["queue_position"] == 2
        started = time.monotonic()
        response = await gpupool_fetch("api", "kernels", fourth, method="DELETE")
        assert response.code == 204 and time.monotonic() - started < 3.0
        withdrawn = await kernel_state(gpupool_fetch, fourth)
        assert withdrawn["state"] == "released" and "queued" in withdrawn["release_reason"]

        # Shut a granted kernel down: the queued one is granted, starts, and runs code.
        response = await gpupool_fetch("api", "kernels", first["kernel_id"], method="DELETE")
        assert response.code == 204

        async def handed_over() -> dict[str, Any] | None:
            state = await kernel_state(gpupool_fetch, queued["kernel_id"])
            return state if state["state"] == "granted" else None

        now_granted = await gpupool_wait(handed_over, what="the queued kernel to be granted")
        gone = await kernel_state(gpupool_fetch, first["kernel_id"])
        assert gone["state"] == "released" and gone["release_reason"] == "kernel shut down"
        seen = json.loads(await kernel_exec(queued["kernel_id"], ENV_CODE))
        assert seen["env"]["GPUPOOL_LEASE_ID"] == now_granted["lease_id"]

        async def idle() -> bool:
            model = json.loads((await gpupool_fetch("api", "kernels", queued["kernel_id"])).body)
            return model["execution_state"] == "idle"

        await gpupool_wait(idle, what="the formerly queued kernel to be idle")

    arun(scenario())
    actions = [(e["action"], e["kernel_id"]) for e in events]
    assert any(a == "queued" for a, _ in actions) and any(a == "granted" for a, _ in actions)
    assert all("owner" not in e for e in events)


def test_rest_auth_errors_restart_and_release(arun, jp_serverapp, gpupool_fetch, gpupool_wait, kernel_exec):
    """403 for another user, 404 unknown, 400 bad size; reserve/keepalive/release; restart keeps the lease."""

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)

        async def granted() -> dict[str, Any] | None:
            state = await kernel_state(gpupool_fetch, kernel_id)
            return state if state["state"] == "granted" else None

        state = await gpupool_wait(granted, what="a grant")
        lease_id = state["lease_id"]
        base = ("api", "gpupool", "kernels", kernel_id)

        # Another user: 403 on every kernel route, and the pool view hides who holds what.
        for parts, method in [(base, "GET"), ((*base, "reserve"), "POST"), ((*base, "release"), "POST"), ((*base, "keepalive"), "POST")]:
            response = await gpupool_fetch(*parts, method=method, user="bob", **({"body": {"memory": "1GiB"}} if method == "POST" else {}))
            assert response.code == 403, (parts, response.code, response.body)
            assert "another user" in json.loads(response.body)["message"]
        bob_view = json.loads((await gpupool_fetch("api", "gpupool", "pool", user="bob")).body)
        assert bob_view["viewer"] == {"name": "bob", "admin": False}
        assert [lease["owner"] for lease in bob_view["leases"]] == [None]
        assert bob_view["leases"][0]["kernel_id"] is None and bob_view["leases"][0]["mine"] is False
        # An admin sees and may act; the owner sees their own lease in full.
        assert (await gpupool_fetch(*base, user="carol")).code == 200
        admin_view = json.loads((await gpupool_fetch("api", "gpupool", "pool", user="carol")).body)
        assert admin_view["leases"][0]["owner"] == "alice"
        own_view = json.loads((await gpupool_fetch("api", "gpupool", "pool")).body)
        assert own_view["leases"][0]["mine"] is True and own_view["leases"][0]["kernel_id"] == kernel_id

        # Unknown kernel: 404. Bad size or duration: 400 naming the accepted forms.
        response = await gpupool_fetch("api", "gpupool", "kernels", "no-such-kernel")
        assert response.code == 404 and "no kernel" in json.loads(response.body)["message"]
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"memory": "lots"})
        assert response.code == 400 and SIZE_FORMS in json.loads(response.body)["message"]
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"duration": "forever"})
        assert response.code == 400 and "2h" in json.loads(response.body)["message"]
        response = await gpupool_fetch(*base, "reserve", method="POST", body={})
        assert response.code == 400 and "memory" in json.loads(response.body)["message"]
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"memory": "64GiB"})
        assert response.code == 409, response.body

        # Shrink, hold through idle, keep alive.
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"memory": "4GiB", "duration": "2h"})
        assert response.code == 200, response.body
        reserved = json.loads(response.body)
        assert reserved["memory"] == 4 * GIB and reserved["keep_until"] > time.time() + 7000
        # How far it may grow (%gpupool reserve 4GiB --limit 8GiB, the sidebar): a bad limit changes nothing.
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"limit": "lots"})
        assert response.code == 400 and "limit" in json.loads(response.body)["message"], response.body
        assert (await kernel_state(gpupool_fetch, kernel_id))["limit"] == reserved["limit"]
        # A bare 8 counts bytes: below the smallest GPU slice it is refused, naming the floor and the
        # unit likely meant, and the slice stays as it was (it once became an 8-byte slice).
        for body, said in (({"memory": 8}, 'memory 8 is 8 bytes'), ({"memory": "16MiB"}, "memory 16MiB is 16 MiB"),
                           ({"limit": 8}, "limit 8 is 8 bytes")):
            response = await gpupool_fetch(*base, "reserve", method="POST", body=body)
            message = json.loads(response.body)["message"]
            assert response.code == 400 and said in message and "smallest GPU slice of 64 MiB" in message, response.body
            assert '8GiB' in message or "16MiB" in body.values()
            after = await kernel_state(gpupool_fetch, kernel_id)
            assert (after["memory"], after["guarantee"], after["limit"]) == (4 * GIB, 4 * GIB, reserved["limit"])
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"limit": "8GiB"})
        assert response.code == 200 and json.loads(response.body)["limit"] == 8 * GIB, response.body
        response = await gpupool_fetch(*base, "reserve", method="POST", body={"limit": 0})
        fixed = json.loads(response.body)
        assert response.code == 200 and fixed["limit"] == fixed["guarantee"] == 4 * GIB, response.body
        # A shorter keep never cuts a longer hold; keepalive without a body uses the default (1 h).
        response = await gpupool_fetch(*base, "keepalive", method="POST", body={"duration": "30m"})
        assert response.code == 200 and json.loads(response.body)["keep_until"] == reserved["keep_until"]
        response = await gpupool_fetch(*base, "keepalive", method="POST")
        assert response.code == 200 and json.loads(response.body)["keep_until"] == reserved["keep_until"]
        response = await gpupool_fetch(*base, "keepalive", method="POST", body={"duration": "99d"})
        assert response.code == 400 and "at most" in json.loads(response.body)["message"]

        # Restart keeps the lease: same id, same grant in the new process.
        before = json.loads(await kernel_exec(kernel_id, ENV_CODE))
        response = await gpupool_fetch("api", "kernels", kernel_id, "restart", method="POST")
        assert response.code == 200, response.body
        after = json.loads(await kernel_exec(kernel_id, ENV_CODE))
        assert after["pid"] != before["pid"]
        assert after["env"]["GPUPOOL_LEASE_ID"] == lease_id
        assert after["env"]["CUDA_VISIBLE_DEVICES"] == before["env"]["CUDA_VISIBLE_DEVICES"]
        assert (await kernel_state(gpupool_fetch, kernel_id))["lease_id"] == lease_id

        # Release: the kernel keeps running without a slice; the next restart queues for a new one.
        response = await gpupool_fetch(*base, "release", method="POST")
        assert response.code == 200 and json.loads(response.body)["state"] == "released"
        assert json.loads(response.body)["release_reason"] == "released by user"
        assert "1" in await kernel_exec(kernel_id, "print(1)")
        response = await gpupool_fetch(*base, "release", method="POST")
        assert response.code == 409 and "restart the kernel" in json.loads(response.body)["message"]
        response = await gpupool_fetch("api", "kernels", kernel_id, "restart", method="POST")
        assert response.code == 200
        renewed = await gpupool_wait(granted, what="a new grant after restart")
        assert renewed["lease_id"] != lease_id

    arun(scenario())


@pytest.mark.gpupool_env(GPUPOOL_IDLE_TIMEOUT="1", GPUPOOL_WARNING_PERIOD="1", GPUPOOL_RECLAIM_ACTION="cull")  # the cull path; suspends: test_suspend_server.py
def test_idle_reclaim_only_under_pressure(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec):
    """Idle kernels keep their slices while nobody waits; a queued kernel gets one reclaimed."""
    events = record_events(jp_serverapp)

    async def scenario() -> None:
        first, _ = await start_kernel(gpupool_fetch)
        second, _ = await start_kernel(gpupool_fetch)
        for kernel_id in (first, second):
            await kernel_exec(kernel_id, "print('ready')")
        # Idle well past the timeout and warning period, over several ticks: nobody waits, nothing happens.
        await gpupool_wait(
            lambda: all(
                s.idle_seconds(time.time()) > 2.5 for s in gpupool_ext.pool.leases() if s.kernel_id in (first, second)
            ),
            what="both kernels idle past the timeout",
        )
        ticks = gpupool_ext.tick_count
        await gpupool_wait(lambda: gpupool_ext.tick_count >= ticks + 3, what="three more ticks")
        for kernel_id in (first, second):
            state = await kernel_state(gpupool_fetch, kernel_id)
            assert state["state"] == "granted" and state["reclaim_at"] is None, state
            assert state["idle_seconds"] > 2.0

        # Pressure: a third kernel queues; one idle slice is warned, then reclaimed, its kernel culled.
        third, _ = await start_kernel(gpupool_fetch)

        async def third_granted() -> dict[str, Any] | None:
            state = await kernel_state(gpupool_fetch, third)
            return state if state["state"] == "granted" else None

        await gpupool_wait(third_granted, timeout=30, what="the queued kernel to be granted")
        # The extension culls the kernel whose slice was reclaimed (at its next tick).
        culled = await gpupool_wait(
            lambda: [k for k in (first, second) if k not in jp_serverapp.kernel_manager], what="the reclaimed kernel to be culled"
        )
        assert len(culled) == 1, culled
        victim = await kernel_state(gpupool_fetch, culled[0])
        assert victim["state"] == "released" and victim["release_reason"].startswith("reclaimed: idle"), victim
        survivor = next(k for k in (first, second) if k not in culled)
        assert (await kernel_state(gpupool_fetch, survivor))["state"] == "granted"
        assert "ran" in await kernel_exec(third, "print('ran')")

    arun(scenario())
    actions = [e["action"] for e in events]
    assert "warned" in actions and "culled" in actions, actions
    assert actions.index("warned") < actions.index("culled")


@pytest.mark.gpupool_config({"KernelManager": {"autorestart": False}})
def test_sigkill_of_a_kernel_frees_its_lease(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec):
    """A kernel process killed with SIGKILL frees its slice within the reconciliation interval."""

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        pid = json.loads(await kernel_exec(kernel_id, ENV_CODE))["pid"]
        lease_id = (await kernel_state(gpupool_fetch, kernel_id))["lease_id"]
        os.kill(pid, signal.SIGKILL)
        # Reconciliation runs every 0.25 s here; without it only the heartbeat's lapse (minutes)
        # would free the slice. The bound leaves room for a host loaded ten times over.
        assert gpupool_ext.pool.policy.heartbeat_ttl > 60
        await gpupool_wait(
            lambda: gpupool_ext.pool.get(lease_id).state.value == "released", timeout=30, interval=0.05, what="release"
        )
        lease = gpupool_ext.pool.get(lease_id)
        assert "kernel is gone" in lease.release_reason
        pool = json.loads((await gpupool_fetch("api", "gpupool", "pool")).body)
        assert pool["devices"][0]["memory_leased"] == 0

    arun(scenario())


@pytest.mark.gpupool_config({"KernelRestarter": {"time_to_dead": 5.0}})
def test_a_kernel_that_died_keeps_its_slice_until_its_restarter_restarts_it(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    """A kernel whose process died is restarted by the server's auto-restarter, which polls every
    ``time_to_dead`` (5 s here): until it does, reconciliation (every 0.25 s here) keeps the slice, so
    the kernel comes back on the same lease and GPU instead of queueing again. The pool is full: a
    request queued behind the slice is never granted it while the kernel is dead."""
    events = record_events(jp_serverapp)

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        before = json.loads(await kernel_exec(kernel_id, ENV_CODE))
        lease_id = (await kernel_state(gpupool_fetch, kernel_id))["lease_id"]
        # Bob asks for the whole GPU: it fits only if the kernel's slice went back.
        waiting = gpupool_ext.pool.request(LeaseRequest(owner="bob", memory=16 * GIB))
        assert waiting.state is LeaseState.QUEUED
        manager = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        manager.stop_restarter()
        manager.start_restarter()  # its first poll is one time_to_dead from now: the window is known
        reconciled = gpupool_ext.reconcile_count
        os.kill(before["pid"], signal.SIGKILL)
        await gpupool_wait(lambda: manager.provisioner.process.poll() is not None, timeout=5, interval=0.02, what="the kernel to die")
        # Whole reconciliations run while the kernel is dead and not yet restarted: each keeps the slice.
        await gpupool_wait(lambda: gpupool_ext.reconcile_count >= reconciled + 3, timeout=30, what="reconciliations while dead")
        assert manager.provisioner.process.poll() is not None, "restarted before reconciliation ran: no window tested"

        async def restarted() -> dict[str, Any] | None:
            try:
                after = json.loads(await kernel_exec(kernel_id, ENV_CODE, timeout=10))
            except Exception:  # noqa: BLE001 - not back yet: the restart is under way
                return None
            return after if after["pid"] != before["pid"] else None

        after = await gpupool_wait(restarted, timeout=60, interval=0.5, what="the restarter to restart the kernel")
        lease = gpupool_ext.pool.get(lease_id)
        assert lease.state.value == "granted", (lease.state, lease.release_reason)
        assert (await kernel_state(gpupool_fetch, kernel_id))["lease_id"] == lease_id
        assert after["env"]["CUDA_VISIBLE_DEVICES"] == before["env"]["CUDA_VISIBLE_DEVICES"]

    arun(scenario())
    released = [e for e in events if e["action"] == "released"]
    assert not released, released


@pytest.mark.gpupool_config({"KernelRestarter": {"time_to_dead": 0.5, "restart_limit": 2}})
def test_a_dead_kernel_whose_restarts_keep_failing_gives_its_slice_back_after_the_restarters_window(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec
):
    """jupyter_client's restarter counts no restart that raised, so one that keeps failing is tried for
    ever: the dead kernel's slice is kept only for the restarter's own window (time_to_dead ×
    (restart_limit + 1), 1.5 s here), then reconciliation releases it."""

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        pid = json.loads(await kernel_exec(kernel_id, ENV_CODE))["pid"]
        lease_id = (await kernel_state(gpupool_fetch, kernel_id))["lease_id"]
        manager = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        attempts: list[float] = []

        async def failing_restart(*args: Any, **kwargs: Any) -> None:
            attempts.append(time.monotonic())
            raise RuntimeError("the kernel's environment is gone")

        manager.restart_kernel = failing_restart
        died = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await gpupool_wait(lambda: gpupool_ext.pool.get(lease_id).state.value == "released", timeout=30, what="release")
        assert time.monotonic() - died >= 1.5  # not before the window
        assert len(attempts) >= 2  # the restarter kept trying meanwhile
        assert "kernel is gone" in gpupool_ext.pool.get(lease_id).release_reason

    arun(scenario())


def test_provisioner_is_default_and_can_be_opted_out(jp_serverapp, gpupool_ext):
    """The extension made gpupool-provisioner the default; every start is not made pending (only a queued one is)."""
    spec = jp_serverapp.kernel_spec_manager.get_kernel_spec("python3")
    assert spec.metadata["kernel_provisioner"]["provisioner_name"] == "gpupool-provisioner"
    assert jp_serverapp.kernel_manager.use_pending_kernels is False
    assert gpupool_ext.owner == "alice"


@pytest.mark.gpupool_config({"GpuPoolExtension": {"make_default_provisioner": False}})
def test_global_opt_out(jp_serverapp, gpupool_ext):
    spec = jp_serverapp.kernel_spec_manager.get_kernel_spec("python3")
    assert "kernel_provisioner" not in spec.metadata


def test_openapi_spec_covers_every_route_and_field() -> None:
    """openapi.yaml names every handler route, and the kernel body carries every required field."""
    import re
    from pathlib import Path

    import yaml

    from jupyter_gpupool.serverextension.handlers import default_handlers

    spec = yaml.safe_load((Path(__file__).resolve().parent.parent / "openapi.yaml").read_text())
    routes = {re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", pattern) for pattern, _ in default_handlers}
    assert routes == set(spec["paths"])
    required = spec["components"]["schemas"]["KernelSlice"]["required"]
    assert {"state", "memory", "devices", "queue_position", "queue_length", "estimated_wait", "used_memory",
            "enforcement", "idle_seconds", "reclaim_at"} <= set(required)


@pytest.mark.gpupool_config({"Watchdog": {"interval": 0.2, "action": "stop", "grace": 0.5}})
@pytest.mark.gpupool_env(GPUPOOL_BURST="0")
def test_watchdog_warns_then_stops_a_kernel_over_its_slice(arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext, kernel_exec):
    """GPU memory of the kernel's process tree over a fixed slice (an elastic one would grow): warned,
    then (policy) stopped."""
    events = record_events(jp_serverapp)

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        pid = json.loads(await kernel_exec(kernel_id, ENV_CODE))["pid"]
        state = await kernel_state(gpupool_fetch, kernel_id)
        # The simulated driver reports 12 GiB held by the kernel process on its 8 GiB slice.
        gpupool_ext.pool.backend.set_usage(pid, state["devices"][0]["uuid"], 12 * GIB)

        async def measured() -> dict[str, Any] | None:
            current = await kernel_state(gpupool_fetch, kernel_id)
            return current if current["used_memory"] == 12 * GIB else None

        await gpupool_wait(measured, what="the watchdog's usage in the kernel state")
        await gpupool_wait(lambda: kernel_id not in jp_serverapp.kernel_manager, what="the over-limit kernel to be stopped")
        gpupool_ext.pool.backend.set_usage(pid, state["devices"][0]["uuid"], 0)

    arun(scenario())
    actions = [e["action"] for e in events]
    assert "over_limit" in actions and "stopped" in actions, actions
    assert actions.index("over_limit") < actions.index("stopped")


def test_the_pool_view_lists_reservations_with_whether_they_are_active(arun, gpupool_fetch, gpupool_ext):
    """``GET /api/gpupool/pool`` carries the reservations the sidebar lists (they shape the queue)."""
    now = time.time()
    gpupool_ext.pool.book_reservation(
        {"name": "exam", "groups": ["cs101"], "memory": "4GiB", "start": now - 60, "end": now + 3600}
    )
    gpupool_ext.pool.book_reservation(
        {"name": "later", "users": ["bob"], "memory": "2GiB", "start": now + 7200, "end": now + 9000}
    )

    async def scenario() -> dict:
        response = await gpupool_fetch("api", "gpupool", "pool")
        return json.loads(response.body)

    body = arun(scenario())
    by_name = {r["name"]: r for r in body["reservations"]}
    assert set(by_name) == {"exam", "later"}
    assert by_name["exam"]["active"] is True and by_name["later"]["active"] is False
    assert by_name["exam"]["memory"] == 4 * 1024**3 and by_name["exam"]["groups"] == ["cs101"]
    assert by_name["later"]["users"] == ["bob"] and abs(by_name["later"]["start"] - (now + 7200)) < 1


def test_a_tick_while_the_server_has_not_recorded_a_kernels_activity_yet_reports_none(
    arun, jp_serverapp, gpupool_fetch, gpupool_wait, gpupool_ext
):
    """jupyter_server sets a kernel's ``last_activity`` (and its activity stream) only once the kernel
    started: a tick in between read the unset trait, which raises TraitError, and the whole tick step
    failed with a traceback (seen with Voilà starting kernels). It reports no activity for it instead."""
    from jupyter_server.services.kernels.kernelmanager import ServerKernelManager

    from jupyter_gpupool.quiet import recorded_activity

    assert recorded_activity(ServerKernelManager()) is None

    async def scenario() -> None:
        kernel_id, _ = await start_kernel(gpupool_fetch)
        lease_id = (await kernel_state(gpupool_fetch, kernel_id))["lease_id"]
        kernel = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        assert recorded_activity(kernel) is not None
        stream, recorded = kernel._activity_stream, kernel._trait_values.pop("last_activity")
        kernel._activity_stream = None  # the state between the kernel's launch and the server's watching it
        gpupool_ext._activity_clocks.forget_others(())
        try:
            ticks = gpupool_ext.tick_count
            await gpupool_ext.watch_loops.tick_once()
            assert gpupool_ext.tick_count == ticks + 1
        finally:
            kernel._activity_stream, kernel.last_activity = stream, recorded
        assert gpupool_ext.pool.get(lease_id).state.value == "granted"

    arun(scenario())
