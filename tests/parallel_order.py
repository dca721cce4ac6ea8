"""A pytest plugin (loaded by conftest.py): how the suite spreads over pytest-xdist's workers.

pyproject.toml runs every ``python -m pytest`` with ``-n auto --dist loadgroup
--no-loadscope-reorder``; ``-n 0`` runs in one process (for ``--pdb``, or one test at a time).

- **Workers**: one per core the run may use, and one more: most tests wait on the servers,
  kernels and browsers they start, so a third worker on two cores finds one idle.
- **Tests that share a module-scoped fixture** (a server, a gateway, a hub, a Slurm cluster) stay
  on one worker, as one group (``xdist_group`` named after the module), so the fixture is built
  once; every other test is scheduled on its own.
- **The longest first**: the modules of :data:`LONGEST_FIRST` (the top of the README's durations
  table) are handed out before the rest, then the other ``slow`` tests, so that no worker starts a
  four-minute test when the others are nearly done. Otherwise the collection's order is kept.
- **The fast tier**: ``python -m pytest -m "not slow"`` leaves out every test marked ``slow``, and
  every ``browser`` and ``hub`` test with them (they start JupyterLab, Chromium or JupyterHub).
"""

from __future__ import annotations

import os

import pytest

#: Modules whose tests take longest, longest first (see the README's durations table).
LONGEST_FIRST = (
    "test_readme_install",
    "test_upstream_suites",
    "test_labextension",
    "test_nbgrader_waits",
    "test_enterprise_gateway",
    "test_gateway",
    "test_voila",
    "test_slurm_cluster",
    "test_hub_e2e",
    "test_client_waits",
    "test_broker_restarts",
    "test_broker_servers",
)

#: Fixture scopes whose fixture is built once for many tests (a session's is built once per worker anyway).
SHARED_SCOPES = ("package", "module", "class")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: the cores this process may use, plus one."""
    return len(os.sched_getaffinity(0)) + 1


def shares_a_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a fixture built once for its module (or class, or package)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(definition.scope in SHARED_SCOPES for definitions in info.name2fixturedefs.values() for definition in definitions)


def module_name(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    grouped = {module_name(item) for item in items if shares_a_fixture(item)}
    for item in items:
        if not item.get_closest_marker("slow") and (item.get_closest_marker("browser") or item.get_closest_marker("hub")):
            item.add_marker(pytest.mark.slow)
        if module_name(item) in grouped:
            item.add_marker(pytest.mark.xdist_group(module_name(item)))

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = module_name(item)
        longest = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        # a grouped module keeps its own order; elsewhere a slow test goes before the quick ones
        slow = 0 if name in grouped or item.get_closest_marker("slow") else 1
        return longest, slow

    items.sort(key=rank)  # stable: ties keep the collection's order
