"""The lab extension's functions stay short enough to hold in one's head: none over 80 lines.

A small parser of the TypeScript in ``labextension/src`` (function declarations, class and object
methods, arrow functions assigned to a name, React function components), counting the lines
from a function's first line to its closing brace (or, for an arrow without braces, to the end of
its expression). It blanks comments, strings, template literals and regular expressions first, so
braces inside them do not count.
"""

from __future__ import annotations

import re
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parents[1] / "labextension" / "src"

MAX_FUNCTION_LINES = 80

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {")", "]", "}"}
#: Characters after which a ``/`` opens a regular expression rather than dividing.
REGEX_AFTER = set("(,=:[!&|?{};+-*%~^") | {""}
KEYWORDS = {"if", "for", "while", "switch", "catch", "return", "function", "with", "super", "new", "typeof", "await"}


def blank(source: str) -> str:
    """``source`` with comments, strings, template literals and regexes turned to spaces (newlines kept)."""
    out = list(source)
    i, n = 0, len(source)

    def wipe(start: int, end: int) -> None:
        for k in range(start, min(end, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = source[i]
        two = source[i : i + 2]
        if two == "//":
            end = source.find("\n", i)
            end = n if end < 0 else end
            wipe(i, end)
            i = end
        elif two == "/*":
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            wipe(i, end)
            i = end
        elif c in "'\"`":
            j = i + 1
            while j < n and source[j] != c:
                j += 2 if source[j] == "\\" else 1
                if c != "`" and j < n and source[j] == "\n":
                    break  # an apostrophe in JSX text, not a string
            if c != "`" and j < n and source[j] == "\n":
                i += 1
                continue
            wipe(i + 1, j)
            i = j + 1
        elif c == "/" and source[i + 1 : i + 2] != ">" and previous_token(source, i) in REGEX_AFTER:
            j, in_class = i + 1, False
            while j < n and source[j] != "\n" and (source[j] != "/" or in_class):
                if source[j] == "\\":
                    j += 1
                elif source[j] == "[":
                    in_class = True
                elif source[j] == "]":
                    in_class = False
                j += 1
            wipe(i + 1, j)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def previous_token(source: str, i: int) -> str:
    """The last non-blank character before ``i`` (``return`` counts as an operator), or ''."""
    j = i - 1
    while j >= 0 and source[j] in " \t\r\n":
        j -= 1
    if j < 0:
        return ""
    if source[max(0, j - 5) : j + 1] == "return":
        return "="
    return source[j]


def match(text: str, i: int) -> int:
    """The index of the bracket closing the one at ``i``."""
    depth = 0
    for k in range(i, len(text)):
        if text[k] in OPENERS:
            depth += 1
        elif text[k] in CLOSERS:
            depth -= 1
            if depth == 0:
                return k
    return len(text) - 1


def body_end(text: str, after_params: int) -> int | None:
    """Where the body that follows a parameter list (and its return type) ends, or None if none does."""
    k = after_params
    while k < len(text):
        c = text[k]
        if c in " \t\r\n":
            k += 1
            continue
        if text.startswith("=>", k):
            k += 2
            while k < len(text) and text[k] in " \t\r\n":
                k += 1
            if k < len(text) and text[k] == "{":
                return match(text, k)
            return expression_end(text, k)
        if c == "{":
            before = text[:k].rstrip()[-1:]
            if before in (":", "|", "&", "<", ",", "("):
                k = match(text, k) + 1  # an object type in the return type
                continue
            return match(text, k)
        if c in "([":
            k = match(text, k) + 1
            continue
        if c in ";,)}" or (c == "=" and not text.startswith("=>", k)):
            return None  # a call or a declaration without a body
        k += 1
    return None


def expression_end(text: str, k: int) -> int:
    """The end of an arrow's expression body: a `;` or `,` at its depth, or its enclosing bracket."""
    depth = 0
    while k < len(text):
        c = text[k]
        if c in OPENERS:
            depth += 1
        elif c in CLOSERS:
            if depth == 0:
                return k - 1
            depth -= 1
        elif c in ";," and depth == 0:
            return k
        k += 1
    return len(text) - 1


DECLARATION = re.compile(r"\bfunction\b\s*\*?\s*([\w$]+)\s*(?:<[^(]*>)?\s*\(")
ARROW = re.compile(r"(?:\b(?:const|let|var)\s+([\w$]+)\s*(?::[^=;]+)?=|^\s*([\w$]+)\s*:)\s*(?:async\s+)?(?:\(|[\w$]+\s*=>)", re.MULTILINE)
METHOD = re.compile(
    r"^[ \t]*(?:(?:public|private|protected|static|async|get|set|override|readonly)\s+)*([\w$]+)\s*(?:<[^(\n]*>)?\s*\(",
    re.MULTILINE,
)
CLASS = re.compile(r"\bclass\s+([\w$]+)[^{]*\{")


def functions(path: Path) -> dict[str, int]:
    """Each function of a TypeScript file by name (``Class.method`` for methods) → its lines."""
    text = blank(path.read_text(encoding="utf-8"))
    classes = [(m.start(), match(text, m.end() - 1), m.group(1)) for m in CLASS.finditer(text)]
    found: dict[str, int] = {}
    candidates: list[tuple[int, str, int]] = []  # (start, name, index of the parameter list's "(")
    for m in DECLARATION.finditer(text):
        candidates.append((m.start(), m.group(1), m.end() - 1))
    for m in ARROW.finditer(text):
        paren = text.find("(", m.end() - 1) if text[m.end() - 1] == "(" else -1
        candidates.append((m.start(), m.group(1) or m.group(2), paren if paren >= 0 else m.end() - 1))
    for m in METHOD.finditer(text):
        if m.group(1) not in KEYWORDS:
            candidates.append((m.start(), m.group(1), m.end() - 1))
    for start, name, paren in candidates:
        after = match(text, paren) + 1 if text[paren] == "(" else paren
        end = body_end(text, after)
        if end is None:
            continue
        first = text.count("\n", 0, text.find(name, start))
        last = text.count("\n", 0, end)
        owner = next((c for s, e, c in classes if s < start < e), None)
        key = f"{owner}.{name}" if owner else name
        found[key] = max(found.get(key, 0), last - first + 1)
    return found


def sizes() -> dict[str, int]:
    """Every function of the lab extension as ``file:name`` → its length in lines."""
    return {
        f"{path.name}:{name}": lines
        for path in sorted([*SOURCE_DIR.glob("*.ts"), *SOURCE_DIR.glob("*.tsx")])
        for name, lines in functions(path).items()
    }


def test_the_parser_counts_each_kind_of_function(tmp_path: Path) -> None:
    sample = tmp_path / "sample.tsx"
    sample.write_text(
        "// a { in a comment\n"
        "export function declared(props: { a: string }): { b: number } | null {\n"
        "  const text = '}'; const re = /[}]/g;\n"
        "  return null;\n"
        "}\n"
        "class Holder {\n"
        "  private _method(x: number): void {\n"
        "    call(x);\n"
        "  }\n"
        "}\n"
        "const arrow = async (a: number) => {\n"
        "  return `${a} }`;\n"
        "};\n"
        "const short = () =>\n"
        "  void arrow(1);\n"
        "function Component(): JSX.Element {\n"
        "  return <div className=\"x\">it's {1}</div>;\n"
        "}\n",
        encoding="utf-8",
    )
    assert functions(sample) == {
        "declared": 4,
        "Holder._method": 3,
        "arrow": 3,
        "short": 2,
        "Component": 3,
    }


def test_no_lab_extension_function_is_over_80_lines() -> None:
    found = sizes()
    assert len(found) > 100, f"the parser found too few functions to be counting them: {len(found)}"
    largest = max(found.items(), key=lambda item: item[1])
    over = sorted(((name, lines) for name, lines in found.items() if lines > MAX_FUNCTION_LINES), key=lambda i: -i[1])
    assert not over, f"over {MAX_FUNCTION_LINES} lines, largest first: {over} (largest in all: {largest})"
