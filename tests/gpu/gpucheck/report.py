"""Check results and the table, JSON and markdown written from them."""

from __future__ import annotations

import enum
import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


class Status(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"

    def __str__(self) -> str:
        return self.value


#: The most characters a check's detail keeps (the JSON's ``data`` keeps every reading).
DETAIL_LIMIT = 400


@dataclass
class Result:
    """What one check found: a status, one headline number and a one-line detail."""

    check: str
    status: Status
    number: str = ""  # the headline figure, already formatted with its unit
    detail: str = ""  # one line: why it failed or skipped, or what it measured
    seconds: float = 0.0  # wall time the check took
    data: dict[str, Any] = field(default_factory=dict)  # every measurement, for the JSON

    @classmethod
    def skip(cls, check: str, reason: str) -> Result:
        return cls(check=check, status=Status.SKIP, detail=reason)

    @classmethod
    def fail(cls, check: str, detail: str, **data: Any) -> Result:
        return cls(check=check, status=Status.FAIL, detail=detail, data=dict(data))

    @classmethod
    def verdict(
        cls, check: str, problems: list[str], *, number: str, detail: str | Callable[[], str], data: dict[str, Any],
        noted: str = "", limit: int | None = DETAIL_LIMIT,
    ) -> Result:
        """A check's end: FAIL when it found ``problems`` (its detail: them joined with ``; ``, then
        ``noted``), else PASS with ``detail``, or what ``detail()`` writes (called only on a pass: it
        may read what only a passing run records); either detail cut to ``limit`` characters (None: whole)."""
        if problems:
            status, text = Status.FAIL, "; ".join(problems) + noted
        else:
            status, text = Status.PASS, detail if isinstance(detail, str) else detail()
        return cls(check=check, status=status, number=number, detail=text[:limit], data=data)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = self.status.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Result:
        return cls(
            check=str(data["check"]),
            status=Status(data["status"]),
            number=str(data.get("number", "")),
            detail=str(data.get("detail", "")),
            seconds=float(data.get("seconds", 0.0)),
            data=dict(data.get("data") or {}),
        )


HEADERS = ("check", "result", "number", "detail")


def _one_line(text: str, width: int | None) -> str:
    flat = " ".join(str(text).split())
    if width is not None and len(flat) > width:
        return flat[: max(1, width - 1)] + "…"
    return flat


def _rows(results: Iterable[Result], detail_width: int | None) -> list[tuple[str, str, str, str]]:
    return [(r.check, r.status.value, _one_line(r.number, None), _one_line(r.detail, detail_width)) for r in results]


def format_table(results: Iterable[Result], detail_width: int | None = 100) -> str:
    """A plain-text table with the columns check | result | number | detail."""
    rows = _rows(results, detail_width)
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(HEADERS)]

    def line(cells: tuple[str, ...]) -> str:
        return " | ".join(cell.ljust(widths[i]) for i, cell in enumerate(cells)).rstrip()

    out = [line(HEADERS), "-+-".join("-" * w for w in widths)]
    out.extend(line(row) for row in rows)
    return "\n".join(out)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|") or " "


def format_markdown(results: Iterable[Result], meta: dict[str, Any] | None = None) -> str:
    """A markdown table (pipes in cells escaped) preceded by the run's metadata as a list."""
    lines: list[str] = []
    for key, value in (meta or {}).items():
        lines.append(f"- {key}: {_one_line(str(value), None)}")
    if lines:
        lines.append("")
    lines.append("| " + " | ".join(HEADERS) + " |")
    lines.append("| " + " | ".join("---" for _ in HEADERS) + " |")
    for row in _rows(results, None):
        lines.append("| " + " | ".join(_md_cell(cell) for cell in row) + " |")
    return "\n".join(lines) + "\n"


def summary_counts(results: Iterable[Result]) -> dict[str, int]:
    counts = {s.value: 0 for s in Status}
    for r in results:
        counts[r.status.value] += 1
    return counts


def write_outputs(out_dir: str, results: list[Result], meta: dict[str, Any]) -> list[str]:
    """Write ``results.json`` and ``results.md`` into ``out_dir`` (created); return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "results.json")
    md_path = os.path.join(out_dir, "results.md")
    payload = {
        "meta": meta,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summary_counts(results),
        "results": [r.to_json() for r in results],
    }
    with open(json_path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2, sort_keys=False, default=str)
        fh.write("\n")
    with open(md_path, "w", encoding="utf-8") as fh:
        fh.write(format_markdown(results, meta))
    return [json_path, md_path]
