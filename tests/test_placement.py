"""Placement policies: best-fit, FGD, FGD with best-fit ties; cache correctness."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_gpupool.core.placement import (
    POLICIES,
    Demand,
    FgdPolicy,
    GpuSlot,
    NodeView,
    Placement,
    apply_placement,
    fragmentation,
    make_policy,
    typical_demands,
)
from jupyter_gpupool.errors import InvalidInput

GiB = 1 << 30


def gpu(uuid: str, free: int, capacity: int = 1000, model: str = "A100", peers: tuple[str, ...] = ()) -> GpuSlot:
    return GpuSlot(uuid, model, capacity, free, frozenset(peers))


def node(
    name: str, *gpus: GpuSlot, cpu: int = 0, cpu_free: int | None = None, mem: int = 0, mem_free: int | None = None
):
    return NodeView(
        name,
        list(gpus),
        cpu_total=cpu,
        cpu_free=cpu if cpu_free is None else cpu_free,
        mem_total=mem,
        mem_free=mem if mem_free is None else mem_free,
    )


# -- best-fit -----------------------------------------------------------------------------
def test_best_fit_takes_the_tightest_gpu_on_one_host_in_bytes() -> None:
    host = node("host", gpu("a", 10 * GiB, 80 * GiB), gpu("b", 6 * GiB, 80 * GiB), gpu("c", 8 * GiB, 16 * GiB))
    got = make_policy("best-fit").place([host], Demand(per_gpu=5 * GiB))
    assert got == Placement(0, ("b",))
    # 7 GiB no longer fits on b: the next tightest is c
    assert make_policy("best-fit").place([host], Demand(per_gpu=7 * GiB)) == Placement(0, ("c",))


def test_best_fit_prefers_the_node_left_with_least() -> None:
    roomy = node("roomy", gpu("r0", 1000), gpu("r1", 1000), cpu=64000)
    tight = node("tight", gpu("t0", 1000), gpu("t1", 200), cpu=64000)
    got = make_policy("best-fit").place([roomy, tight], Demand(per_gpu=500, cpu=1000))
    assert got is not None and got.node == 1
    assert got.gpus == ("t0",)  # t1 has only 200 left


def test_nothing_fits_returns_none() -> None:
    nodes = [node("n", gpu("g", 300))]
    for name in POLICIES:
        assert make_policy(name).place(nodes, Demand(per_gpu=400)) is None
        assert make_policy(name).place([], Demand(per_gpu=1)) is None


# -- FGD ----------------------------------------------------------------------------------
def test_fgd_avoids_the_placement_that_strands_capacity() -> None:
    """Typical pods need 500: best-fit leaves 400 stranded on b, FGD keeps both GPUs usable."""
    typical = [(Demand(per_gpu=500), 1.0)]
    host = node("h", gpu("a", 1000), gpu("b", 700))
    demand = Demand(per_gpu=300)
    assert make_policy("best-fit", typical).place([host], demand) == Placement(0, ("b",))
    assert make_policy("fgd", typical).place([host], demand) == Placement(0, ("a",))
    before = fragmentation(host, typical)
    assert before == 0.0


def test_fgd_picks_the_node_whose_fragmentation_grows_least() -> None:
    typical = [(Demand(per_gpu=1000, whole=True), 0.5), (Demand(per_gpu=600), 0.5)]
    # n0: placing 400 on the fresh GPU leaves 600 (still fits the 600-type) but no whole GPU;
    # n1: the partly used GPU (400 left) takes it exactly and the whole GPU stays free.
    n0 = node("n0", gpu("x", 1000))
    n1 = node("n1", gpu("y", 1000), gpu("z", 400))
    got = make_policy("fgd", typical).place([n0, n1], Demand(per_gpu=400))
    assert got == Placement(1, ("z",))


def test_fragmentation_counts_cpu_and_model_misfits_as_fully_fragmented() -> None:
    typical = [(Demand(per_gpu=500, cpu=8000), 0.5), (Demand(per_gpu=500, models=frozenset({"T4"})), 0.5)]
    n = node("n", gpu("g", 1000), cpu=16000, cpu_free=4000)
    # the first type lacks CPU, the second the model: all 1000 idle counts for both
    assert fragmentation(n, typical) == pytest.approx(1000)
    n.cpu_free = 16000
    assert fragmentation(n, typical) == pytest.approx(500)


def test_fgd_without_typical_demands_still_places() -> None:
    host = node("h", gpu("a", 10 * GiB, 16 * GiB), gpu("b", 16 * GiB, 16 * GiB))
    got = make_policy("fgd").place([host], Demand(per_gpu=4 * GiB))
    assert got is not None and got.node == 0


def test_fgd_bestfit_breaks_ties_toward_the_fuller_node() -> None:
    typical = [(Demand(per_gpu=1000, whole=True), 1.0)]
    empty = node("empty", gpu("e0", 1000), gpu("e1", 1000), gpu("e2", 1000), gpu("e3", 1000))
    busy = node("busy", gpu("b0", 1000), gpu("b1", 0), gpu("b2", 0), gpu("b3", 1000))
    d = Demand(per_gpu=1000, whole=True)
    # plain FGD sees equal integer scores and takes the first node; the hybrid packs
    assert make_policy("fgd", typical).place([empty, busy], d) == Placement(0, ("e0",))
    assert make_policy("fgd-bestfit", typical).place([empty, busy], d) == Placement(1, ("b0",))


# -- constraints ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_model_constraint_is_exact(name: str) -> None:
    host = node("h", gpu("t4", 1000, model="T4"), gpu("a100", 1000, model="A100-80GB"))
    p = make_policy(name)
    assert p.place([host], Demand(per_gpu=100, models=frozenset({"A100-80GB"}))) == Placement(0, ("a100",))
    assert make_policy(name).place([host], Demand(per_gpu=100, models=frozenset({"A100"}))) is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_cpu_and_ram_must_fit(name: str) -> None:
    short_cpu = node("c", gpu("c0", 1000), cpu=8000, cpu_free=1000, mem=1024)
    short_mem = node("m", gpu("m0", 1000), cpu=8000, mem=1024, mem_free=100)
    ok = node("ok", gpu("k0", 1000), cpu=8000, mem=1024)
    d = Demand(per_gpu=500, cpu=2000, mem=512)
    assert make_policy(name).place([short_cpu, short_mem, ok], d) == Placement(2, ("k0",))
    assert make_policy(name).place([short_cpu, short_mem], d) is None
    # CPU-only demands need CPU and RAM only, and take no GPU
    assert make_policy(name).place([short_cpu, ok], Demand(per_gpu=0, num_gpus=0, cpu=4000)) == Placement(1, ())


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_whole_gpus_must_be_completely_free(name: str) -> None:
    host = node("h", gpu("p", 999), gpu("f1", 1000), gpu("q", 10), gpu("f2", 1000))
    got = make_policy(name).place([host], Demand(per_gpu=1000, num_gpus=2, whole=True))
    assert got == Placement(0, ("f1", "f2"))
    assert make_policy(name).place([host], Demand(per_gpu=1000, num_gpus=3, whole=True)) is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_multi_gpu_prefers_nvlink_peers(name: str) -> None:
    host = node(
        "h",
        gpu("g0", 80, 80, peers=("g2",)),
        gpu("g1", 80, 80),
        gpu("g2", 80, 80, peers=("g0", "g3")),
        gpu("g3", 80, 80, peers=("g2",)),
    )
    assert make_policy(name).place([host], Demand(per_gpu=0, num_gpus=2, whole=True)) == Placement(0, ("g0", "g2"))
    got = make_policy(name).place([host], Demand(per_gpu=40, num_gpus=3))
    assert got is not None and set(got.gpus) == {"g0", "g2", "g3"}  # two links beat one


def test_multi_gpu_tightness_comes_before_nvlink() -> None:
    host = node("h", gpu("a", 500, peers=("b",)), gpu("b", 1000, peers=("a",)), gpu("c", 500))
    got = make_policy("best-fit").place([host], Demand(per_gpu=400, num_gpus=2))
    assert got == Placement(0, ("a", "c"))


# -- API ------------------------------------------------------------------------------------
def test_make_policy_rejects_unknown_names_with_the_accepted_ones() -> None:
    with pytest.raises(InvalidInput, match="best-fit, fgd, fgd-bestfit"):
        make_policy("first-fit")
    assert {"best-fit", "fgd", "fgd-bestfit"} <= set(POLICIES)
    assert make_policy("fgd-bestfit").name == "fgd-bestfit"


@pytest.mark.parametrize(
    "kwargs",
    [{"per_gpu": -1}, {"per_gpu": 0}, {"per_gpu": 5, "num_gpus": 0}, {"per_gpu": 1, "cpu": -1}],
)
def test_bad_demands_are_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        Demand(**kwargs)


def test_typical_demands_cover_95_percent_and_renormalise() -> None:
    a, b, c = Demand(per_gpu=500), Demand(per_gpu=1000, whole=True), Demand(per_gpu=250)
    typical = typical_demands([a] * 60 + [b] * 36 + [c] * 4, coverage=0.95)
    assert [d for d, _ in typical] == [a, b]
    assert sum(s for _, s in typical) == pytest.approx(1.0)
    assert dict(typical)[a] == pytest.approx(60 / 96)
    assert typical_demands([]) == []
    with pytest.raises(InvalidInput):
        typical_demands([a], coverage=0)


def test_apply_placement_takes_and_gives_back() -> None:
    n = node("n", gpu("g0", 1000), gpu("g1", 1000), cpu=100, mem=100)
    d = Demand(per_gpu=300, cpu=10, mem=20)
    apply_placement([n], d, Placement(0, ("g1",)))
    assert (n.gpus[1].free, n.cpu_free, n.mem_free) == (700, 90, 80)
    apply_placement([n], d, Placement(0, ("g1",)), sign=-1)
    assert (n.gpus[1].free, n.cpu_free, n.mem_free) == (1000, 100, 100)


# -- cache invalidation ---------------------------------------------------------------------
MODELS = ("T4", "V100", "A100")

demands = st.one_of(
    st.builds(
        lambda m, cpu, models: Demand(per_gpu=m, cpu=cpu, models=models),
        st.sampled_from([100, 250, 300, 500, 700]),
        st.sampled_from([0, 1000, 4000]),
        st.sampled_from([frozenset(), frozenset({"T4"}), frozenset({"V100", "A100"})]),
    ),
    st.builds(
        lambda k, cpu: Demand(per_gpu=1000, num_gpus=k, whole=True, cpu=cpu),
        st.sampled_from([1, 2, 4]),
        st.sampled_from([0, 8000]),
    ),
    st.builds(lambda cpu: Demand(per_gpu=0, num_gpus=0, cpu=cpu), st.sampled_from([1000, 6000])),
)


@st.composite
def inventories(draw: st.DrawFn) -> list[NodeView]:
    out = []
    for i in range(draw(st.integers(1, 6))):
        ngpu = draw(st.sampled_from([1, 2, 4, 8]))
        model = draw(st.sampled_from(MODELS))
        cpu = draw(st.sampled_from([0, 16000, 32000]))
        out.append(
            NodeView(
                f"n{i}",
                [GpuSlot(f"n{i}g{j}", model, 1000, 1000, frozenset({f"n{i}g{j ^ 1}"})) for j in range(ngpu)],
                cpu_total=cpu,
                cpu_free=cpu,
            )
        )
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nodes=inventories(),
    steps=st.lists(st.tuples(demands, st.booleans()), min_size=1, max_size=40),
    name=st.sampled_from(sorted(POLICIES)),
    seed=st.integers(0, 1000),
)
def test_cached_decisions_equal_uncached_ones(nodes, steps, name, seed) -> None:
    """A policy that reuses its caches (notify_changed) decides exactly as a fresh one."""
    typical = typical_demands([d for d, _ in steps])
    cached = make_policy(name, typical)
    rng = random.Random(seed)
    held: list[tuple[Demand, Placement]] = []
    for demand, release in steps:
        if release and held:
            d_old, p_old = held.pop(rng.randrange(len(held)))
            apply_placement(nodes, d_old, p_old, sign=-1)
            cached.notify_changed(p_old.node)
        got = cached.place(nodes, demand)
        want = make_policy(name, typical).place(list(nodes), demand)  # a new sequence: no caches
        assert got == want
        if isinstance(cached, FgdPolicy):
            for i, n in enumerate(nodes):
                value = cached._node_frag[i]
                assert value is None or value == pytest.approx(fragmentation(n, typical))
        if got is not None:
            apply_placement(nodes, demand, got)
            cached.notify_changed(got.node)
            held.append((demand, got))
            assert all(g.free >= 0 for n in nodes for g in n.gpus)
            assert all(n.cpu_free >= 0 for n in nodes)


def test_fgd_cpufit_packs_cpu_only_demands_where_gpus_are_taken() -> None:
    typical = [(Demand(per_gpu=1000, whole=True), 1.0)]
    idle_gpus = node("idle", gpu("i0", 1000), gpu("i1", 1000), cpu=32000)
    full_gpus = node("full", gpu("f0", 0), gpu("f1", 0), cpu=32000)
    cpu_only = Demand(per_gpu=0, num_gpus=0, cpu=4000)
    # FGD sees no change in fragmentation either way and takes the first node
    assert make_policy("fgd", typical).place([idle_gpus, full_gpus], cpu_only) == Placement(0, ())
    assert make_policy("fgd-cpufit", typical).place([idle_gpus, full_gpus], cpu_only) == Placement(1, ())


def test_fgd_cpufit_keeps_fgd_order_for_gpu_demands() -> None:
    typical = [(Demand(per_gpu=1000, whole=True), 1.0)]
    empty = node("empty", gpu("e0", 1000), gpu("e1", 1000), gpu("e2", 1000), gpu("e3", 1000))
    busy = node("busy", gpu("b0", 1000), gpu("b1", 0), gpu("b2", 0), gpu("b3", 1000))
    d = Demand(per_gpu=1000, whole=True)
    assert make_policy("fgd-cpufit", typical).place([empty, busy], d) == make_policy("fgd", typical).place(
        [empty, busy], d
    )
