"""Every pool backend keeps the declared contract: each member of PoolBackend, and of each capability
it claims, with a signature a caller of the contract can use."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from jupyter_gpupool.backends import (
    CAPABILITY_MEMBERS,
    Capability,
    ElasticBackend,
    PoolBackend,
    SuspendingBackend,
    supports,
)
from jupyter_gpupool.backends.local.pool import Pool
from jupyter_gpupool.backends.remote import RemotePool
from jupyter_gpupool.backends.slurm.pool import SlurmPool

IMPLEMENTATIONS = [Pool, RemotePool, SlurmPool]

#: Members every implementation sets on its class (the rest are methods, or set per instance).
CLASS_ATTRIBUTES = ("kind", "capabilities", "remote", "waiting_word")
INSTANCE_ATTRIBUTES = ("backend", "policy")


def protocol_methods(protocol: type) -> dict[str, Any]:
    own = {}
    for klass in reversed(protocol.__mro__):
        if klass in (object,) or klass.__name__ in {"Protocol", "Generic"}:
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in CLASS_ATTRIBUTES or name in INSTANCE_ATTRIBUTES:
                continue
            if callable(value) or isinstance(value, (staticmethod, classmethod)):
                own[name] = value
    return own


def signature_problems(name: str, promised: Any, implemented: Any) -> list[str]:
    """What a caller of ``promised`` could pass that ``implemented`` would not take."""
    want = inspect.signature(promised)
    have = inspect.signature(implemented)
    problems = []
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in have.parameters.values())
    for parameter in want.parameters.values():
        if parameter.name == "self" or parameter.kind is parameter.VAR_KEYWORD:
            continue
        theirs = have.parameters.get(parameter.name)
        if theirs is None:
            if not accepts_kwargs:
                problems.append(f"{name}: no parameter {parameter.name!r}")
            continue
        if parameter.default is not parameter.empty and theirs.default is theirs.empty:
            problems.append(f"{name}: {parameter.name!r} is optional in the contract, required here")
        if parameter.kind is parameter.POSITIONAL_OR_KEYWORD and theirs.kind is theirs.KEYWORD_ONLY:
            problems.append(f"{name}: {parameter.name!r} must be passable by position")
    order = [p for p in want.parameters if p != "self"]
    theirs_order = [p for p in have.parameters if p != "self"]
    if theirs_order[: len(order)] != order and not accepts_kwargs:
        positional = [p for p in order if want.parameters[p].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        if theirs_order[: len(positional)] != positional:
            problems.append(f"{name}: parameters in another order ({theirs_order} for {order})")
    for parameter in have.parameters.values():
        if parameter.name not in want.parameters and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
            if parameter.default is parameter.empty and parameter.name != "self":
                problems.append(f"{name}: requires {parameter.name!r}, which the contract does not pass")
    return problems


def contract_problems(implementation: type) -> list[str]:
    problems = []
    for name in CLASS_ATTRIBUTES:
        if name not in dir(implementation):
            problems.append(f"no class attribute {name!r}")
    capabilities = getattr(implementation, "capabilities", frozenset())
    if not all(isinstance(c, Capability) for c in capabilities):
        problems.append(f"capabilities must be Capability members: {capabilities!r}")
    promised = protocol_methods(PoolBackend)
    if Capability.SUSPEND in capabilities:
        promised.update(protocol_methods(SuspendingBackend))
    if Capability.GROW in capabilities:
        promised.update(protocol_methods(ElasticBackend))
    for name, member in promised.items():
        ours = inspect.getattr_static(implementation, name, None)
        if ours is None:
            problems.append(f"no member {name!r}")
            continue
        if isinstance(member, property):
            continue
        problems.extend(signature_problems(name, member, getattr(implementation, name)))
    for capability in capabilities:
        for name in CAPABILITY_MEMBERS[capability]:
            if not callable(getattr(implementation, name, None)):
                problems.append(f"claims {capability.value!r} but has no {name}()")
    return problems


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_each_backend_keeps_the_contract_and_its_claimed_capabilities(implementation: type) -> None:
    assert contract_problems(implementation) == []


def test_backends_say_what_they_are_and_what_they_can() -> None:
    assert [c.kind for c in IMPLEMENTATIONS] == ["local", "broker", "slurm"]
    assert supports(Pool, Capability.SUSPEND) and supports(RemotePool, Capability.SUSPEND)
    assert not supports(SlurmPool, Capability.SUSPEND)  # a Slurm job's memory cannot be parked
    assert supports(Pool, Capability.UNPOOLED) and not supports(RemotePool, Capability.UNPOOLED)
    assert not supports(object(), Capability.SUSPEND)
    # Elastic slices: the local pool and the broker grow a slice; a Slurm job's shards are fixed at submit.
    assert supports(Pool, Capability.GROW) and supports(RemotePool, Capability.GROW)
    assert not supports(SlurmPool, Capability.GROW) and "fixed when the job is submitted" in SlurmPool.no_burst


def test_the_contract_check_finds_a_missing_member_and_an_incompatible_signature() -> None:
    """The check can fail: a backend without ``queue``, with a ``release`` that needs another argument,
    and claiming suspend without having it."""

    class Incomplete(RemotePool):
        capabilities = frozenset({Capability.SUSPEND, Capability.WHOAMI})
        queue = None  # type: ignore[assignment]
        resume = None  # type: ignore[assignment]

        def release(self, lease_id: str, why: str, now: float | None = None) -> Any:  # type: ignore[override]
            return None

    problems = contract_problems(Incomplete)
    assert "no member 'queue'" in problems
    assert "no member 'resume'" in problems
    assert any("release: no parameter 'reason'" in p for p in problems)
    assert any("release: requires 'why'" in p for p in problems)
    assert not any("grow" in p or "limit" in p for p in problems), problems

    class FixedResize(RemotePool):
        """Claims elastic slices, but its resize takes no limit and it has no grow."""

        grow = None  # type: ignore[assignment]

        def resize(self, lease_id: str, memory: int | None = None, duration: float | None = None,  # type: ignore[override]
                   now: float | None = None) -> Any:
            return None

    problems = contract_problems(FixedResize)
    assert "no member 'grow'" in problems and "claims 'grow' but has no grow()" in problems
    assert "resize: no parameter 'limit'" in problems


def test_the_factory_returns_the_backend_the_environment_names(tmp_path: Any) -> None:
    from jupyter_gpupool.backends.factory import pool_from_env

    pool = pool_from_env(environ={"GPUPOOL_SIMULATE": "1x16GiB", "GPUPOOL_DB": str(tmp_path / "pool.db")})
    try:
        assert isinstance(pool, PoolBackend) and pool.kind == "local"
    finally:
        pool.close()
    remote = pool_from_env(environ={"GPUPOOL_URL": "http://127.0.0.1:9", "GPUPOOL_TOKEN": "t"})
    assert remote.kind == "broker"
