"""Sizes a newcomer can hold in their head: no module over 900 lines, no class over 600, no function
over 80 in the package.

Code that is still over a limit is listed in ``STILL_OVER`` with its size today as a ceiling: it
may only shrink, a listed entry that is back within its limit must leave the list, and anything
new over a limit fails with its name and size.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "jupyter_gpupool"

MAX_MODULE_LINES = 900
MAX_CLASS_LINES = 600
MAX_FUNCTION_LINES = 80

#: (kind, "path relative to the package[:qualified name]") → lines today: ceilings while a split is due.
STILL_OVER: dict[tuple[str, str], int] = {}

LIMITS = {"module": MAX_MODULE_LINES, "class": MAX_CLASS_LINES, "function": MAX_FUNCTION_LINES}


def sizes() -> dict[tuple[str, str], int]:
    """Every module, class and function of the package with its length in lines."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        relative = path.relative_to(PACKAGE_DIR).as_posix()
        source = path.read_text(encoding="utf-8")
        found[("module", relative)] = len(source.splitlines())

        def visit(node: ast.AST, prefix: str, relative: str = relative) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    kind = "class" if isinstance(child, ast.ClassDef) else "function"
                    assert child.end_lineno is not None
                    found[(kind, f"{relative}:{name}")] = child.end_lineno - child.lineno + 1
                    visit(child, f"{name}.", relative)
                else:
                    visit(child, prefix, relative)

        visit(ast.parse(source), "")
    return found


def test_nothing_new_is_over_its_limit_and_the_listed_only_shrink() -> None:
    found = sizes()
    over = {key: lines for key, lines in found.items() if lines > LIMITS[key[0]]}
    new = {key: lines for key, lines in over.items() if key not in STILL_OVER}
    grown = {key: (STILL_OVER[key], lines) for key, lines in over.items() if key in STILL_OVER and lines > STILL_OVER[key]}
    assert not new, f"over the limit ({LIMITS}): {sorted(new.items(), key=lambda item: -item[1])}"
    assert not grown, f"listed as still over and grown (ceiling, now): {grown}"


def test_the_still_over_list_names_only_what_is_still_over() -> None:
    found = sizes()
    stale = sorted(key for key in STILL_OVER if found.get(key, 0) <= LIMITS[key[0]])
    assert not stale, f"back within the limit or gone: remove from STILL_OVER: {stale}"


def test_the_largest_of_each_kind_is_named() -> None:
    """The counts' largest entries, for the record (``-s`` prints them)."""
    found = sizes()
    for kind, limit in LIMITS.items():
        largest = max((item for item in found.items() if item[0][0] == kind), key=lambda item: item[1])
        print(f"largest {kind}: {largest[0][1]} ({largest[1]} lines; limit {limit})")
        assert largest[1] > 0
