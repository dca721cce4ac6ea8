"""The package's shape: no import cycle, dependencies one way, few loose modules, the documented folders.

The import graph counts every ``import`` the package's own code does, at module level and inside
functions, and the package ``__init__`` modules those imports run: importing
``jupyter_gpupool.a.b`` runs ``jupyter_gpupool.a`` first, so a module that imports it depends on
``a``'s ``__init__`` too, unless that package is one the importing module already sits in.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "jupyter_gpupool"
ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = ROOT / PACKAGE

#: Modules that may sit at the package top, besides ``__init__`` and ``_version``.
MAX_LOOSE_MODULES = 10

#: Folders and what must never be imported from them (the layers' direction).
CORE_FORBIDDEN = ("jupyter_server", "jupyter_client", "ipykernel", "tornado", "IPython", "ipywidgets")


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    in_function: bool


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted name, is a package ``__init__``) of a file in the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if "labextension" in path.relative_to(PACKAGE_DIR).parts:
            continue
        modules[module_name(path)[0]] = path
    return modules


def _function_imports(tree: ast.AST) -> set[int]:
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside.update(id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return inside


def _type_checking_imports(tree: ast.AST) -> set[int]:
    """Imports under ``if TYPE_CHECKING:``: never run, so no dependency at run time."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child) if isinstance(n, (ast.Import, ast.ImportFrom)))
    return skipped


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[Edge]:
    """Every module of the package that importing ``name`` (or calling its functions) runs."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    in_function = _function_imports(tree)
    skipped = _type_checking_imports(tree)
    own_packages = {".".join(name.split(".")[:n]) for n in range(1, name.count(".") + 1 + is_package)}

    def edges_to(target: str, node: ast.stmt, whole: bool = True) -> Iterator[Edge]:
        parts = target.split(".")
        for n in range(1, len(parts) + 1):
            prefix = ".".join(parts[:n])
            if prefix not in modules or prefix == name:
                continue
            if prefix in own_packages and (n < len(parts) or not whole):
                continue  # a package this module sits in: already being imported, not run again
            yield Edge(name, prefix, node.lineno, id(node) in in_function)

    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    yield from edges_to(alias.name, node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != PACKAGE:
                continue
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            # ``from package import submodule`` needs only the submodule when the package is one
            # this module sits in; any other name is the package's own attribute.
            yield from edges_to(target, node, whole=len(submodules) < len(node.names))
            for submodule in submodules:
                yield Edge(name, submodule, node.lineno, id(node) in in_function)


def import_graph() -> dict[str, list[Edge]]:
    modules = package_modules()
    return {name: list(imports_of(name, path, modules)) for name, path in modules.items()}


def find_cycles(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, []):
            if edge.target not in index:
                visit(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def describe_cycle(component: list[str], graph: dict[str, list[Edge]]) -> str:
    members = set(component)
    lines = [
        f"  {e.source} -> {e.target} (line {e.line}{', in a function' if e.in_function else ''})"
        for name in component
        for e in graph[name]
        if e.target in members
    ]
    return "\n".join(lines)


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n\n".join(describe_cycle(c, graph) for c in cycles)


def test_the_cycle_finder_sees_cycles_through_functions_and_package_inits(tmp_path: Path) -> None:
    """The check can fail: a cycle made only of an in-function import and a package ``__init__``."""
    graph = {
        "p.a": [Edge("p.a", "p.sub", 3, in_function=True)],
        "p.sub": [Edge("p.sub", "p.sub.b", 1, in_function=False)],
        "p.sub.b": [Edge("p.sub.b", "p.a", 5, in_function=False)],
        "p.c": [],
    }
    assert find_cycles(graph) == [["p.a", "p.sub", "p.sub.b"]]
    modules = {"jupyter_gpupool": Path(), "jupyter_gpupool.x": Path(), "jupyter_gpupool.x.y": Path()}
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from jupyter_gpupool.x.y import z\n")
    edges = list(imports_of("jupyter_gpupool.m", source, modules))
    assert {(e.target, e.in_function) for e in edges} == {  # the top package is one m sits in
        ("jupyter_gpupool.x", True),
        ("jupyter_gpupool.x.y", True),
    }


def test_at_most_ten_modules_are_loose_at_the_package_top() -> None:
    loose = sorted(p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem not in {"__init__", "_version"})
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules: {loose}"


def test_the_core_imports_nothing_of_jupyter() -> None:
    for path in (PACKAGE_DIR / "core").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            for imported in names:
                top = imported.split(".")[0]
                assert top not in CORE_FORBIDDEN, f"{path.relative_to(ROOT)}:{node.lineno} imports {imported}"
                if top == PACKAGE:
                    inner = imported.split(".")[1] if "." in imported else ""
                    assert inner in {"core", "errors", "units", "wording"}, (
                        f"{path.relative_to(ROOT)}:{node.lineno} imports {imported}: the core depends on nothing above it"
                    )


def test_every_in_function_import_of_the_package_says_why() -> None:
    """In-function imports are for start-up time or optional parts, never to step around a cycle."""
    unexplained = []
    for name, edges in import_graph().items():
        lines = package_modules()[name].read_text().splitlines()
        if any(line.startswith("# In-function imports:") for line in lines):
            continue  # the module says once why all of its own are
        for edge in edges:
            if not edge.in_function:
                continue
            here = lines[edge.line - 1]
            above = edge.line - 2  # the comment may head a group of such imports
            while above >= 0 and lines[above].strip().startswith(("from ", "import ")):
                above -= 1
            if "#" not in here and not (above >= 0 and lines[above].strip().startswith("#")):
                unexplained.append(f"{name}:{edge.line} {here.strip()}")
    assert not unexplained, "in-function imports without a comment saying why:\n" + "\n".join(sorted(set(unexplained)))


def folders_named_in(doc: Path) -> set[str]:
    return set(re.findall(r"`(jupyter_gpupool/[\w/]+/)`", doc.read_text()))


def test_every_folder_the_architecture_doc_names_exists() -> None:
    doc = ROOT / "docs" / "architecture.md"
    named = folders_named_in(doc)
    assert len(named) >= 8, named
    missing = sorted(f for f in named if not (ROOT / f).is_dir())
    assert not missing, f"docs/architecture.md names folders that do not exist: {missing}"
    packages = {
        p.parent.relative_to(ROOT).as_posix() + "/"
        for p in PACKAGE_DIR.rglob("__init__.py")
        if "labextension" not in p.parts and p.parent != PACKAGE_DIR
    }
    unnamed = sorted(packages - named)
    assert not unnamed, f"docs/architecture.md does not say what these folders hold: {unnamed}"


@pytest.mark.parametrize(
    "target",
    [
        "jupyter_gpupool.widget",
        "jupyter_gpupool.devices.simulated:pretend_to_use",
        "jupyter_gpupool.kernel:load_ipython_extension",
        "jupyter_gpupool.broker.__main__",
        "jupyter_gpupool.provisioner:GpuPoolProvisioner",
        "jupyter_gpupool.provisioner:SlurmProvisioner",
    ],
)
def test_the_names_users_and_configs_use_still_import(target: str) -> None:
    import importlib

    module, _, attribute = target.partition(":")
    loaded = importlib.import_module(module)
    if attribute:
        assert getattr(loaded, attribute)
