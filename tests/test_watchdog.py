"""The watchdog: GPU memory summed over real process trees, and warn → act after grace."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from traitlets import TraitError
from traitlets.config import Config

from jupyter_gpupool.core.models import Decision, DecisionKind
from jupyter_gpupool.devices import ProcessUsage
from jupyter_gpupool.devices.simulated import SimulatedBackend
from jupyter_gpupool.enforcement.watchdog import Watchdog, usage_by_root_pid
from jupyter_gpupool.units import GIB, MIB

# A process that starts a chain of `depth` descendants, prints the pids of its whole chain on one
# line (itself first), then serves commands on stdin: "exit-child" ends its descendants and
# answers "child-exited"; end of input ends the chain from the bottom up.
TREE = r"""
import os, subprocess, sys
depth = int(sys.argv[1])
child = None
pids = [os.getpid()]
if depth > 0:
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(depth - 1), sys.argv[2]],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    pids += [int(p) for p in child.stdout.readline().split()]
print(" ".join(map(str, pids)), flush=True)

def end_child():
    if child is not None and child.poll() is None:
        child.stdin.close()
        child.wait()

for line in sys.stdin:
    if line.strip() == "exit-child":
        end_child()
        print("child-exited", flush=True)
end_child()
"""


class Tree:
    """A real process chain: ``pids[0]`` is the root (the "kernel"), then its descendants."""

    def __init__(self, depth: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TREE, str(depth), TREE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.pids = [int(p) for p in self.proc.stdout.readline().split()]
        assert len(self.pids) == depth + 1, self.pids

    @property
    def root(self) -> int:
        return self.pids[0]

    def exit_child(self) -> None:
        """End every descendant (and wait for it to be reaped), keep the root."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("exit-child\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "child-exited"

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - only if the chain hangs
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def trees() -> Iterator[list[Tree]]:
    made: list[Tree] = []
    yield made
    for tree in made:
        tree.close()


def tree(trees: list[Tree], depth: int) -> Tree:
    made = Tree(depth)
    trees.append(made)
    return made


@pytest.fixture
def gpus() -> SimulatedBackend:
    return SimulatedBackend.from_spec("2xA100-80GB")


class RecordingPool:
    """Stands in for Pool.report_usage: records calls and flags leases over a fixed limit."""

    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits
        self.calls: list[tuple[dict[str, int], float | None]] = []

    def report_usage(self, usage: dict[str, int], now: float | None = None) -> list[Decision]:
        self.calls.append((dict(usage), now))
        return [
            Decision(DecisionKind.OVER_LIMIT, lease, None, "alice", "over", now or 0.0)
            for lease, used in usage.items()
            if used > self.limits.get(lease, used)
        ]


# --- usage per lease over real process trees ---------------------------------------------------------
def test_child_and_grandchild_usage_lands_on_the_root_lease(trees, gpus):
    kernel = tree(trees, depth=2)  # kernel -> `!python train.py` -> its worker
    gpu0, gpu1 = (d.uuid for d in gpus.devices())
    gpus.set_usage(kernel.root, gpu0, 1 * GIB)
    gpus.set_usage(kernel.pids[1], gpu0, 3 * GIB)
    gpus.set_usage(kernel.pids[2], gpu1, 2 * GIB)  # a second GPU of a multi-GPU lease
    gpus.set_usage(os.getpid(), gpu0, 5 * GIB)  # the test runner: an ancestor, not in the tree
    assert usage_by_root_pid(gpus.process_usage(), {"lease-1": kernel.root}) == {"lease-1": 6 * GIB}


def test_each_tree_counts_for_its_own_lease(trees, gpus):
    first, second, idle = tree(trees, 1), tree(trees, 1), tree(trees, 0)
    gpu0 = gpus.devices()[0].uuid
    gpus.set_usage(first.pids[1], gpu0, 7 * GIB)
    gpus.set_usage(second.root, gpu0, 2 * GIB)
    gpus.set_usage(second.pids[1], gpu0, 512 * MIB)
    roots = {"a": first.root, "b": second.root, "c": idle.root}
    assert usage_by_root_pid(gpus.process_usage(), roots) == {"a": 7 * GIB, "b": 2 * GIB + 512 * MIB, "c": 0}


def test_a_process_counts_for_its_nearest_root(trees, gpus):
    outer = tree(trees, depth=2)
    gpu0 = gpus.devices()[0].uuid
    gpus.set_usage(outer.pids[1], gpu0, 1 * GIB)
    gpus.set_usage(outer.pids[2], gpu0, 4 * GIB)
    roots = {"outer": outer.root, "inner": outer.pids[2]}
    assert usage_by_root_pid(gpus.process_usage(), roots) == {"outer": 1 * GIB, "inner": 4 * GIB}


def test_an_exited_child_is_dropped_even_if_still_listed(trees, gpus):
    kernel = tree(trees, depth=1)
    gpu0 = gpus.devices()[0].uuid
    gpus.set_usage(kernel.root, gpu0, 1 * GIB)
    gpus.set_usage(kernel.pids[1], gpu0, 3 * GIB)
    roots = {"lease-1": kernel.root}
    assert usage_by_root_pid(gpus.process_usage(), roots) == {"lease-1": 4 * GIB}
    kernel.exit_child()  # the driver may list a dead pid for a moment; it must not count
    assert usage_by_root_pid(gpus.process_usage(), roots) == {"lease-1": 1 * GIB}


def test_a_lease_whose_kernel_exited_is_left_out(trees, gpus):
    kernel, other = tree(trees, depth=1), tree(trees, depth=0)
    gpu0 = gpus.devices()[0].uuid
    gpus.set_usage(kernel.pids[1], gpu0, 3 * GIB)
    kernel.close()
    usage = usage_by_root_pid(gpus.process_usage(), {"gone": kernel.root, "here": other.root})
    assert usage == {"here": 0}


def test_usage_without_roots_or_with_a_missing_pid():
    usage = [ProcessUsage(os.getpid(), "GPU-x", GIB)]
    assert usage_by_root_pid(usage, {}) == {}
    assert usage_by_root_pid(usage, {"me": os.getpid(), "nobody": 2**22 + 12345}) == {"me": GIB}


# --- decisions (pure: explicit time) ---------------------------------------------------------------------
LIMIT = 8 * GIB


def make(**traits) -> tuple[Watchdog, list[tuple[str, str]]]:
    acted: list[tuple[str, str]] = []
    dog = Watchdog(act=lambda lease, action: acted.append((lease, action)), **traits)
    return dog, acted


def test_tolerance_sets_the_threshold():
    dog, _ = make(tolerance=0.05, tolerance_bytes=256 * MIB)
    assert dog.threshold(LIMIT) == LIMIT + int(LIMIT * 0.05)
    assert dog.threshold(1 * GIB) == 1 * GIB + 256 * MIB
    assert dog.evaluate({"a": dog.threshold(LIMIT)}, {"a": LIMIT}, now=0) == []
    assert [e.kind for e in dog.evaluate({"a": dog.threshold(LIMIT) + 1}, {"a": LIMIT}, now=0)] == ["warn"]


def test_warn_first_then_act_after_grace_then_repeat():
    dog, _ = make(action="interrupt", grace=30)
    over = {"a": 10 * GIB}
    [warn] = dog.evaluate(over, {"a": LIMIT}, now=100)
    assert (warn.kind, warn.action, warn.deadline, warn.used, warn.limit) == ("warn", "interrupt", 130, 10 * GIB, LIMIT)
    assert warn.message.startswith("kernel uses 10 GiB of its 8 GiB GPU slice; it will be interrupted in 30 s")
    assert dog.evaluate(over, {"a": LIMIT}, now=129.9) == []
    [act] = dog.evaluate(over, {"a": LIMIT}, now=130)
    assert (act.kind, act.action) == ("act", "interrupt")
    assert act.message == "kernel interrupted: it used 10 GiB of its 8 GiB GPU slice for 30 s"
    assert dog.evaluate(over, {"a": LIMIT}, now=131) == []
    assert [e.action for e in dog.evaluate(over, {"a": LIMIT}, now=160)] == ["interrupt"]  # still over: again
    assert dog.over_since() == {"a": 100}


def test_back_under_the_limit_clears_and_restarts_the_clock():
    dog, _ = make(grace=30)
    dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=0)
    [clear] = dog.evaluate({"a": 7 * GIB}, {"a": LIMIT}, now=20)
    assert clear.kind == "clear" and "7 GiB of 8 GiB" in clear.message
    assert dog.over_since() == {}
    assert [e.kind for e in dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=40)] == ["warn"]
    assert dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=60) == []  # a new 30 s grace from t=40
    assert [e.kind for e in dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=70)] == ["act"]


def test_warn_only_never_acts():
    dog, _ = make(action="warn", grace=1)
    [warn] = dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=0)
    assert warn.deadline is None and "reserve more" in warn.message
    for now in (1, 10, 1000):
        assert dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=now) == []


def test_zero_grace_acts_at_once_and_stop_is_the_action():
    dog, _ = make(action="stop", grace=0)
    events = dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=5)
    assert [(e.kind, e.action) for e in events] == [("warn", "stop"), ("act", "stop")]
    assert events[1].message.startswith("kernel stopped:")


def test_escalate_stops_after_an_interrupt_that_did_not_help():
    dog, _ = make(action="interrupt", grace=10, escalate=True)
    actions = []
    for now in range(0, 31, 5):
        actions += [e.action for e in dog.evaluate({"a": 10 * GIB}, {"a": LIMIT}, now=now) if e.kind == "act"]
    assert actions == ["interrupt", "stop", "stop"]


def test_leases_without_limit_or_gone_are_forgotten():
    dog, _ = make(grace=10)
    dog.evaluate({"a": 10 * GIB, "b": 10 * GIB}, {"a": LIMIT, "b": LIMIT}, now=0)
    assert set(dog.over_since()) == {"a", "b"}
    assert dog.evaluate({"b": 10 * GIB}, {"a": LIMIT}, now=20) == []  # a: kernel gone; b: limit unknown
    assert dog.over_since() == {}


def test_config_and_validation():
    dog = Watchdog(config=Config({"Watchdog": {"action": "stop", "grace": 5.0, "interval": 2.0}}))
    assert (dog.action, dog.grace, dog.interval) == ("stop", 5.0, 2.0)
    with pytest.raises(TraitError):
        Watchdog(action="kill")
    with pytest.raises(TraitError):
        Watchdog(grace=-1)
    for name in ("interval", "action", "grace", "tolerance", "tolerance_bytes", "escalate"):
        assert Watchdog.class_traits()[name].help, name


# --- one full step: backend -> process trees -> pool -> decision -> callback ---------------------------
def test_check_with_real_processes_warns_then_acts(trees, gpus):
    kernel, calm = tree(trees, depth=1), tree(trees, depth=0)
    gpu0 = gpus.devices()[0].uuid
    pool = RecordingPool({"big": LIMIT, "calm": LIMIT})
    acted: list[tuple[str, str]] = []
    dog = Watchdog(backend=gpus, pool=pool, act=lambda lease, action: acted.append((lease, action)), grace=30)
    roots = {"big": kernel.root, "calm": calm.root}
    limits = {"big": LIMIT, "calm": LIMIT}

    gpus.set_usage(kernel.root, gpu0, 1 * GIB)
    gpus.set_usage(kernel.pids[1], gpu0, 9 * GIB)  # `!python train.py` blows the slice
    gpus.set_usage(calm.root, gpu0, 2 * GIB)
    report = dog.check(roots, limits, now=1000)
    assert report.usage == {"big": 10 * GIB, "calm": 2 * GIB}
    assert pool.calls == [({"big": 10 * GIB, "calm": 2 * GIB}, 1000)]
    assert [d.lease_id for d in report.decisions] == ["big"]
    assert [(e.kind, e.lease_id) for e in report.events] == [("warn", "big")]
    assert acted == []

    report = dog.check(roots, limits, now=1030)
    assert [(e.kind, e.lease_id, e.action) for e in report.events] == [("act", "big", "interrupt")]
    assert acted == [("big", "interrupt")]

    kernel.exit_child()  # the offending child is gone; its stale entry no longer counts
    report = dog.check(roots, limits, now=1031)
    assert report.usage == {"big": 1 * GIB, "calm": 2 * GIB}
    assert [(e.kind, e.lease_id) for e in report.events] == [("clear", "big")]
    assert acted == [("big", "interrupt")]


def test_check_survives_a_failing_backend_and_callback(trees, gpus):
    kernel = tree(trees, depth=0)
    gpus.set_usage(kernel.root, gpus.devices()[0].uuid, 20 * GIB)

    def broken_act(lease: str, action: str) -> None:
        raise RuntimeError("kernel manager went away")

    dog = Watchdog(backend=gpus, act=broken_act, grace=0)
    report = dog.check({"a": kernel.root}, {"a": LIMIT}, now=0)
    assert [e.kind for e in report.events] == ["warn", "act"]

    class Lost:
        def process_usage(self):
            raise OSError("NVML went away")

    dog.backend = Lost()  # type: ignore[assignment]
    report = dog.check({"a": kernel.root}, {"a": LIMIT}, now=1)
    assert report.error == "NVML went away" and report.events == [] and report.over == {"a": 0}
