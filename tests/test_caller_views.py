"""The broker's ``/changes`` long poll reads each waiting caller's leases once per pool change.

A real broker object on a real SQLite pool file, its real worker thread, and a real second
process changing the file. Alice's change answers every one of her polls with her new version and
none of bob's; a change costs one lease read per distinct waiting caller, not one per poll (counted
per change, so it holds however slow the machine: no poll's timeout runs out during the count);
polls that look at a stale version together share one read; and a version is never served from
before a change, whichever process made it.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from broker_harness import BrokerHarness, wait_until
from pool_helpers import make_pool, req

from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.broker.app import Broker
from jupyter_gpupool.broker.caller_views import CallerViewVersions
from jupyter_gpupool.core.models import Lease, LeaseState
from jupyter_gpupool.rest.views import view_version

POLLS_EACH = 10


def _fresh(pool: Pool, owner: str) -> int:
    """The owner's view version read straight from the pool file, bypassing what the broker keeps."""
    return view_version(pool.leases(owner=owner))


class OwnerReads:
    """The pool as a backend without a lease cache shows it: one owner's leases per read."""

    def __init__(self, pool: Pool) -> None:
        self.changes = pool.changes
        self.leases = pool.leases


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Pool, Broker, Lease, Lease]]:
    """A broker on a pool file where alice and bob each hold a lease (alice's may be suspended)."""
    pool = make_pool(tmp_path, spec="2x16GiB", heartbeat_ttl=3600)
    alice = pool.request(req("alice", gib=4, suspendable=True))
    bob = pool.request(req("bob", gib=4))
    assert alice.state is LeaseState.GRANTED and bob.state is LeaseState.GRANTED
    broker = Broker(pool=pool)
    yield pool, broker, alice, bob
    broker.view_versions.close()
    broker.executor.shutdown(wait=True)
    pool.close()


READS = ["one pass over the lease cache", "one read per owner"]
#: Long enough that no poll's time runs out while the scenario runs, however loaded the machine.
NEVER = 600.0


def views_for(reads: str, pool: Pool, broker: Broker) -> CallerViewVersions:
    return broker.view_versions if reads.startswith("one pass") else CallerViewVersions(OwnerReads(pool), broker.run)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Wait on the event loop until ``predicate()`` holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("reads", READS)
def test_alices_change_answers_her_polls_not_bobs_with_one_read_per_caller(
    served: tuple[Pool, Broker, Lease, Lease], reads: str
) -> None:
    pool, broker, alice, bob = served
    views = views_for(reads, pool, broker)

    async def scenario() -> None:
        mine, theirs = await views.version("alice"), await views.version("bob")
        assert (mine, theirs) == (_fresh(pool, "alice"), _fresh(pool, "bob"))
        alices = [asyncio.ensure_future(views.wait("alice", mine, NEVER)) for _ in range(POLLS_EACH)]
        bobs = [asyncio.ensure_future(views.wait("bob", theirs, NEVER)) for _ in range(POLLS_EACH)]
        await until(lambda: views.polls_waiting() == 2 * POLLS_EACH, "every poll waits")
        await asyncio.sleep(0)  # and has looked (the version kept: no read)
        reads, counter = views.reads, pool.changes.version

        # A heartbeat is a pool change that moves nobody's view: no poll answers. (These looks
        # share the read the change started, or find what it kept.)
        await broker.run(pool.heartbeat, [alice.id, bob.id])
        assert (await views.version("alice"), await views.version("bob")) == (mine, theirs)
        await asyncio.sleep(0.1)
        assert not any(poll.done() for poll in alices + bobs)

        await broker.run(pool.suspend, alice.id, "lunch")
        answered = await asyncio.wait_for(asyncio.gather(*alices), 60.0)
        assert set(answered) == {_fresh(pool, "alice")} and answered[0] != mine
        assert await views.version("bob") == theirs
        assert not any(poll.done() for poll in bobs), "alice's change woke bob's polls"
        changes = pool.changes.version - counter
        assert changes >= 2
        # Each change read alice and bob once, 20 polls waiting (the polls woken read nothing more).
        assert views.reads - reads <= 2 * changes, (views.reads - reads, changes)

        # Bob's server hangs up: his polls stop waiting. A poll whose time runs out answers with
        # the version it had.
        for poll in bobs:
            poll.cancel()
        await asyncio.gather(*bobs, return_exceptions=True)
        await until(lambda: views.polls_waiting() == 0, "the cancelled polls stop waiting")
        assert await views.wait("bob", theirs, 0.3) == theirs

        # Not served from before a change: her version right after her next change is the new one.
        before = await views.version("alice")
        await broker.run(pool.confirm_transition, alice.id)
        assert await views.version("alice") == _fresh(pool, "alice") != before
        assert await views.version("bob") == theirs == _fresh(pool, "bob")

    try:
        asyncio.run(scenario())
    finally:
        views.close()


@pytest.mark.parametrize("reads", READS)
def test_polls_that_look_at_a_stale_version_together_share_one_read(
    served: tuple[Pool, Broker, Lease, Lease], reads: str
) -> None:
    """As when many polls time out at once after a change: one read for them all, not one each."""
    pool, broker, alice, bob = served
    views = views_for(reads, pool, broker)

    async def scenario() -> None:
        theirs = await views.version("bob")
        await broker.run(pool.heartbeat, [alice.id, bob.id])  # a change: the version kept is stale
        before = views.reads
        looks = await asyncio.gather(*(views.version("bob") for _ in range(POLLS_EACH)))
        assert looks == [theirs] * POLLS_EACH
        assert views.reads - before == 1
        assert await views.version("bob") == theirs and views.reads - before == 1  # kept: no read

        # A change while a read is in flight: the next look does not join it, it reads again.
        await broker.run(pool.suspend, alice.id, "lunch")
        first = asyncio.ensure_future(views.version("alice"))
        await asyncio.sleep(0)
        await broker.run(pool.confirm_transition, alice.id)
        assert await views.version("alice") == _fresh(pool, "alice")
        await first

    try:
        asyncio.run(scenario())
    finally:
        views.close()


def test_a_change_made_by_another_process_is_not_served_stale(tmp_path: Path, served: tuple[Pool, Broker, Lease, Lease]) -> None:
    pool, broker, alice, _ = served
    views = broker.view_versions
    code = (
        "import sys\nsys.path.insert(0, sys.argv[2])\nfrom pathlib import Path\nfrom pool_helpers import make_pool\n"
        "pool = make_pool(Path(sys.argv[3]), spec='2x16GiB', heartbeat_ttl=3600)\n"
        "pool.suspend(sys.argv[1], reason='suspended by the admin')\n"
    )

    async def scenario() -> None:
        mine, theirs = await views.version("alice"), await views.version("bob")
        alices = asyncio.ensure_future(views.wait("alice", mine, 60.0))
        bobs = asyncio.ensure_future(views.wait("bob", theirs, 60.0))
        await asyncio.sleep(0.2)
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-c", code, alice.id, str(Path(__file__).parent), str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )
        assert done.returncode == 0, done.stderr
        # The broker's pool hears the other process through the file's change watcher.
        assert await asyncio.wait_for(alices, 30.0) == _fresh(pool, "alice") != mine
        assert await views.version("alice") == _fresh(pool, "alice")
        assert not bobs.done()
        bobs.cancel()
        assert await views.version("bob") == theirs

    asyncio.run(scenario())


def test_a_poll_whose_client_hung_up_stops_waiting_at_once(tmp_path: Path) -> None:
    """A server that opens /changes polls and drops them (or a user who opens many and walks away)
    leaves nothing waiting in the broker: each poll ends when its connection closes, not at its
    timeout."""
    h = BrokerHarness(tmp_path, simulate="1x16GiB").start()
    try:
        h.add_user("tok-alice", "alice")
        status, body = h.http("GET", "api/gpupool/changes", "tok-alice")
        assert status == 200, body
        views = h.broker.view_versions
        route = f"/services/gpupool/api/gpupool/changes?since={body['version']}&timeout=30"
        clients = []
        for _ in range(POLLS_EACH):
            client = socket.create_connection(("127.0.0.1", h.port), timeout=10)
            client.sendall(f"GET {route} HTTP/1.1\r\nHost: x\r\nAuthorization: token tok-alice\r\n\r\n".encode())
            clients.append(client)
        wait_until(lambda: views.polls_waiting() == POLLS_EACH, 20, "every poll waits")
        for client in clients:
            client.close()
        wait_until(lambda: views.polls_waiting() == 0, 5, "the hung-up polls stop waiting")
        assert h.http("GET", "api/gpupool/changes", "tok-alice")[0] == 200  # and the broker answers as before
    finally:
        h.stop()
