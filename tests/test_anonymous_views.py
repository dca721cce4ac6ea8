"""No answer a non-admin gets names another user: the anonymity walk.

Each scenario fills a real pool file with decisions that name users (a live move, a preemption, an
idle reclaim, a burst take-back, an admin's release and suspend), then a real broker serves it and
every non-admin user walks every read route, on every lease id and kernel id there is. No answer
may hold another user's name, lease id, kernel id, label, holder pid or host. The remote backend
(the single-user server behind a broker) reads the same answers; the local, remote and Slurm
backends build a lease's view with the same allow-list, checked lease by lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from broker_harness import BrokerHarness

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.backends.slurm.pool import SlurmPool
from jupyter_gpupool.core.models import Activity, Lease, LeaseRequest, LeaseState, PriorityClass
from jupyter_gpupool.core.policy import PoolPolicy
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.rest.anonymous import OTHERS_FIELDS, rewrite_text, view_lease
from jupyter_gpupool.units import GIB

ADMIN = "boss_admin"
USERS = ("ada_lovelace", "bob_marley", "carol_king", "dave_grohl", "prof_xavier", "grader_bot")
#: Each user's kernels' holder pids start here (on a host of their own, so nobody checks them).
PIDS = {user: 31000 + 100 * i for i, user in enumerate(USERS)}
#: A start an hour ago: the broker's first scheduler run (at the real now) finds every step due.
T = time.time() - 3600


def req(owner: str, gib: float, n: int = 0, **kw: Any) -> LeaseRequest:
    """A request whose every identifying field names its owner (kernel id, label, pid, host)."""
    if isinstance(kw.get("priority"), str):
        kw["priority"] = PriorityClass(kw["priority"])
    return LeaseRequest(
        owner=owner,
        memory=int(gib * GIB),
        kernel_id=f"kern-{owner}-{n}",
        label=f"label-{owner}-{n}",
        holder_pid=PIDS[owner] + n,
        holder_host=f"host-{owner}",
        **kw,
    )


IDLE = {"idle_timeout": 600, "warning_period": 60, "preemption": False, "heartbeat_ttl": 10**9}


def live_move(pool: Pool) -> None:
    """Ada's idle kernel is moved to make room for Carol's 12 GiB ("... for carol_king")."""
    ada = pool.request(req("ada_lovelace", 8, suspendable=True), now=T)
    dave = pool.request(req("dave_grohl", 8), now=T)
    bob = pool.request(req("bob_marley", 8), now=T)
    pool.release(dave.id, now=T + 50)
    pool.report_activity(bob.id, Activity(busy=True), now=T + 100)
    pool.request(req("carol_king", 12), now=T + 100)
    assert "carol_king" in pool.get(ada.id).suspend_reason


def preemption(pool: Pool) -> None:
    """The grader's batch lease is preempted for the professor's ("(8 GiB for prof_xavier)")."""
    grader = pool.request(req("grader_bot", 12, priority="batch"), now=T)
    pool.request(req("ada_lovelace", 4), now=T + 50)
    pool.request(req("prof_xavier", 8, groups=("staff",)), now=T + 100)
    pool.tick(now=T + 101)
    assert "prof_xavier" in pool.get(grader.id).reclaim_reason


def idle_reclaim(pool: Pool) -> None:
    """Ada's idle kernel is suspended for Carol, who waits; Bob is busy."""
    ada = pool.request(req("ada_lovelace", 8, suspendable=True), now=T)
    bob = pool.request(req("bob_marley", 8), now=T)
    pool.report_activity(bob.id, Activity(busy=True), now=T + 1)
    pool.request(req("carol_king", 8), now=T + 700)
    pool.tick(now=T + 701)
    pool.report_activity(bob.id, Activity(busy=True), now=T + 770)
    pool.tick(now=T + 770)
    assert pool.get(ada.id).suspend_reason


def burst_take_back(pool: Pool) -> None:
    """Ada's slice grew into burst; Bob's request takes it back."""
    ada = pool.request(req("ada_lovelace", 2), now=T)
    pool.report_usage({ada.id: 6 * GIB}, now=T + 1)
    pool.request(req("bob_marley", 12), now=T + 4)
    assert pool.get(ada.id).burst_note


SCENARIOS: dict[str, tuple[str, dict[str, Any], Callable[[Pool], None]]] = {
    "live move": ("2x16GiB", {**IDLE, "defragment_min_idle": 60}, live_move),
    "preemption": ("1x16GiB", {"min_runtime": 60, "grace_period": 30, "group_priorities": {"staff": "high"}, "heartbeat_ttl": 10**9}, preemption),
    "idle reclaim": ("1x16GiB", IDLE, idle_reclaim),
    "burst take-back": ("1x16GiB", {"burst": "16GiB", "heartbeat_ttl": 10**9}, burst_take_back),
}


@pytest.fixture(params=list(SCENARIOS))
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BrokerHarness]:
    """The scenario's pool file, served by a real broker (hub tokens: each user's name is their token)."""
    spec, policy, build = SCENARIOS[request.param]
    pool = Pool(SimulatedBackend.from_spec(spec), str(tmp_path / "broker.sqlite"), PoolPolicy(**policy), clock=lambda: T)
    build(pool)
    pool.close()
    harness = BrokerHarness(
        tmp_path, simulate=spec, policy=policy, broker={"tick_interval": 3600, "wait_poll": 0.05, "run_watchdog": False}
    ).start()
    for user in USERS:
        harness.add_user(user, user, groups=("staff",) if user == "prof_xavier" else ("cs101",))
    harness.add_user(ADMIN, ADMIN, admin=True)
    try:
        admin_acts(harness)
        yield harness
    finally:
        harness.stop()


def admin_acts(h: BrokerHarness) -> None:
    """The admin releases one live lease and asks to suspend a suspendable one ("(by admin boss_admin)")."""
    status, leases = h.http("GET", "api/gpupool/leases?all=1", ADMIN)
    assert status == 200
    granted = [lease for lease in leases if lease["state"] == "granted" and not lease["transition"]]
    suspendable = [lease for lease in granted if lease["suspendable"]]
    if suspendable:
        status, _ = h.http("POST", f"api/gpupool/leases/{suspendable[0]['id']}/suspend", ADMIN, {"reason": "room for a class"})
        assert status == 200
    others = [lease for lease in granted if lease not in suspendable[:1]]
    if others:
        status, _ = h.http("DELETE", f"api/gpupool/leases/{others[0]['id']}?reason=shut+down+for+maintenance", ADMIN)
        assert status == 200


def secrets_of(leases: list[dict[str, Any]], user: str) -> set[str]:
    """What identifies ``user``: their name, host, kernel ids, labels, lease ids."""
    found = {user, f"host-{user}", f"kern-{user}", f"label-{user}"}
    for lease in leases:
        if lease["owner"] == user:
            found.update({lease["id"], lease["kernel_id"], lease["label"]})
    return found


def leaks(answer: Any, secrets: set[str], pids: set[int], path: str = "") -> list[str]:
    """Where ``answer`` holds one of ``secrets`` (as text) or ``pids`` (as a number, or "process N")."""
    found = []
    if isinstance(answer, dict):
        for key, value in answer.items():
            found += leaks(value, secrets, pids, f"{path}.{key}")
    elif isinstance(answer, list):
        for i, value in enumerate(answer):
            found += leaks(value, secrets, pids, f"{path}[{i}]")
    elif isinstance(answer, str):
        found += [f"{path}: {answer!r} holds {s!r}" for s in secrets if s and s in answer]
        found += [f"{path}: {answer!r} holds pid {p}" for p in pids if f"process {p}" in answer]
    elif isinstance(answer, int) and not isinstance(answer, bool) and answer in pids:
        found.append(f"{path}: pid {answer}")
    return found


def test_no_non_admin_answer_names_another_user(served: BrokerHarness) -> None:
    h = served
    status, everything = h.http("GET", "api/gpupool/leases?all=1&released=1", ADMIN)
    assert status == 200 and everything
    states = {(lease["state"], lease["transition"]) for lease in everything}
    texts = [lease[key] for lease in everything for key in ("suspend_reason", "reclaim_reason", "release_reason", "burst_note")]
    assert any(name in text for text in texts for name in (*USERS, ADMIN)), "the scenario must name a user somewhere"
    lease_ids = [lease["id"] for lease in everything]
    kernel_ids = [lease["kernel_id"] for lease in everything]
    walked = 0
    for viewer in USERS:
        others = [u for u in USERS if u != viewer]
        secrets = set().union(*(secrets_of(everything, u) for u in others)) | {ADMIN}
        pids = {lease["holder_pid"] for lease in everything if lease["owner"] != viewer}
        routes = [
            "whoami", "info", "pool", "devices", "queue", "leases", "leases?released=1", "leases?all=1",
            "events", "report", "reservations", "preferences", "changes",
        ]  # fmt: skip
        answers = [(route, *h.http("GET", f"api/gpupool/{route}", viewer)) for route in routes]
        for lease_id in lease_ids:
            answers += [(f"leases/{lease_id}", *h.http("GET", f"api/gpupool/leases/{lease_id}", viewer))]
            answers += [(f"leases/{lease_id}/wait", *h.http("GET", f"api/gpupool/leases/{lease_id}/wait?timeout=0", viewer))]
        for kernel_id in kernel_ids:
            answers += [(f"kernels/{kernel_id}", *h.http("GET", f"api/gpupool/kernels/{kernel_id}", viewer))]
        answers += [("tick", *h.http("POST", "api/gpupool/tick", viewer, {}))]
        for route, status, body in answers:
            assert status < 500, (viewer, route, body)
            asked = route.split("/")[1] if "/" in route else ""  # an id the caller sent may come back in its refusal
            found = leaks(body, {s for s in secrets if s not in asked}, pids)
            assert not found, f"{viewer} GET {route} ({status}): " + "; ".join(found)
            walked += 1
        # The single-user server behind the broker (the remote backend) serves what the broker answers.
        snap = RemotePool(h.url, token=viewer, timeout=15).snapshot(viewer=viewer)
        assert not leaks([snap.leases, snap.queue, snap.unpooled, snap.devices], secrets, pids)
    assert walked > 100 and len(states) >= 2


@pytest.mark.parametrize("backend", [Pool, RemotePool, SlurmPool])
def test_every_backend_builds_others_leases_from_the_allow_list(backend: Any, tmp_path: Path) -> None:
    """Each scenario's leases, through each backend's ``view_lease``, for each user."""
    for name, (spec, policy, build) in SCENARIOS.items():
        pool = Pool(SimulatedBackend.from_spec(spec), str(tmp_path / f"{name}.sqlite"), PoolPolicy(**policy), clock=lambda: T)
        build(pool)
        leases: list[Lease] = pool.leases(include_released=True)
        pool.close()
        everything = [lease.to_json() for lease in leases]
        for viewer in USERS:
            secrets = set().union(*(secrets_of(everything, u) for u in USERS if u != viewer))
            pids = {lease.holder_pid for lease in leases if lease.owner != viewer and lease.holder_pid}
            for lease in leases:
                view = backend.view_lease(lease, viewer, False, 1)
                assert not leaks(view, secrets, pids), (name, viewer, view)
                if lease.owner != viewer:
                    shown = {key for key, value in view.items() if value not in (None, [])}
                    assert shown <= OTHERS_FIELDS, (name, shown - OTHERS_FIELDS)


def test_a_field_a_lease_gains_later_is_hidden_from_other_users() -> None:
    lease = Lease(id="l1", owner="ada_lovelace", memory=GIB, state=LeaseState.GRANTED, created_at=T)
    lease.device_control = "allowed for pid 31000"  # type: ignore[attr-defined]  # a field of a later version
    data = view_lease(lease, "bob_marley", False)
    assert "device_control" not in data or data.get("device_control") is None


@pytest.mark.parametrize(
    ("text", "viewer", "shown"),
    [
        ("moved to another GPU to make room for 16 GiB for carol_king", "ada_lovelace", "moved to another GPU to make room for 16 GiB for another user"),
        ("preempted for a higher-priority request (8 GiB for prof_xavier)", "grader_bot", "preempted for a higher-priority request (8 GiB for another user)"),
        ("released by user (by admin boss_admin)", "bob_marley", "released by user (by a pool admin)"),
        ("no room (reported by admin boss_admin)", "bob_marley", "no room (reported by a pool admin)"),
        ("moved ... for 1.5 GiB for carol_king (suspending failed: no; so the kernel was shut down)", "ada_lovelace",
         "moved ... for 1.5 GiB for another user (suspending failed: no; so the kernel was shut down)"),
        ("preempted for a higher-priority request (8 GiB for ada_lovelace)", "ada_lovelace", "preempted for a higher-priority request (8 GiB for ada_lovelace)"),
        ("burst taken back for a request of 12 GiB: the slice is 4 GiB now (2 GiB guaranteed)", "ada_lovelace",
         "burst taken back for a request of 12 GiB: the slice is 4 GiB now (2 GiB guaranteed)"),
    ],
)  # fmt: skip
def test_decisions_names_are_rewritten(text: str, viewer: str, shown: str) -> None:
    assert rewrite_text(text, viewer) == shown
