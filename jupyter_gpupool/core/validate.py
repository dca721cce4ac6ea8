"""Typed, bounded values from untrusted input: REST bodies and query strings, saved preferences.

Every adapter that takes a value from a user (the server extension's and the broker's REST API,
saved preferences) reads it through one of these functions first. Each returns a value of the
documented type within documented bounds, or raises :class:`~jupyter_gpupool.errors.InvalidInput`
with one line naming the field and the accepted form, so nothing reaches the engine or the store
that could make it raise (a 400-digit integer, ``1e400``, a pid past the OS's range, a list where
a name belongs).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import (
    DURATION_FORMS,
    MAX_SIZE,
    MIN_SLICE,
    SIZE_FORMS,
    format_size,
    parse_duration,
    parse_size,
)
from jupyter_gpupool.wording import plural

# --- bounds -----------------------------------------------------------------------------------------

#: Largest JSON request body (bytes): the biggest legitimate one (a server's activity report for
#: a few hundred kernels) is a few KiB.
MAX_BODY_BYTES = 256 * 1024
#: Deepest nesting of objects and arrays in a body (the deepest legitimate one is 3).
MAX_JSON_DEPTH = 8
#: Longest identifier (lease id, kernel id, user, group, reservation name, host).
MAX_ID = 255
#: Longest free text (a label, a release reason).
MAX_TEXT = 1000
#: Most items in a list or mapping of a body (lease ids, live kernels, activities).
MAX_ITEMS = 10_000
#: Largest count (connections of a kernel, a queue position).
MAX_COUNT = 1_000_000
#: Latest time accepted (POSIX seconds, year 2286): later is a typo, and keeps SQLite's REAL exact.
MAX_TIME = 10_000_000_000.0
#: Linux's own ceiling for pids (PID_MAX_LIMIT on 64-bit); /proc/sys/kernel/pid_max may be lower.
PID_MAX_LIMIT = 2**22
PRIORITIES = ("batch", "normal", "high")
#: What a user may save as a preference, and what each accepts.
PREFERENCE_FORMS = {
    "memory": SIZE_FORMS,
    "num_gpus": "a whole number of GPUs from 1 to {max_gpus}",
    "compute_share": "a percentage of each GPU's SMs from 1 to 100",
    "model": 'a GPU model name such as "A100" or "A100-80GB"',
    "priority": "batch, normal or high",
}

_MODEL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._+-]{0,63}$")
_log = logging.getLogger(__name__)


def pid_max() -> int:
    """The highest pid this OS hands out: ``/proc/sys/kernel/pid_max``, at least Linux's 2**22."""
    try:
        with open("/proc/sys/kernel/pid_max") as fh:
            return max(PID_MAX_LIMIT, int(fh.read().strip()))
    except (OSError, ValueError):
        return PID_MAX_LIMIT


def _shown(value: Any) -> str:
    """A bad value for a message: short, one line, never the 400-digit original."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
        return f"a {int(abs(value).bit_length() * 0.30103) + 1}-digit number"
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --- JSON bodies ------------------------------------------------------------------------------------


class BodyTooLarge(InvalidInput):
    """A request body over :data:`MAX_BODY_BYTES`."""

    http_status = 413


def _reject_constant(name: str) -> Any:
    raise InvalidInput(f"the request body contains {name}, which is not a JSON number; send a finite number")


def json_object(raw: bytes | str, example: str = '{"memory": "12GiB"}') -> dict[str, Any]:
    """The request body as a dict (``{}`` when empty): at most :data:`MAX_BODY_BYTES`, nested at most
    :data:`MAX_JSON_DEPTH` deep, no ``NaN``/``Infinity``; else :class:`InvalidInput` (400, or 413)."""
    if not raw:
        return {}
    if len(raw) > MAX_BODY_BYTES:
        raise BodyTooLarge(f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    data = raw.encode() if isinstance(raw, str) else raw
    depth = _nesting(data)
    if depth > MAX_JSON_DEPTH:
        raise InvalidInput(f"the request body is nested {depth} deep; at most {MAX_JSON_DEPTH} levels are accepted")
    try:
        value = json.loads(data, parse_constant=_reject_constant)
    except InvalidInput:
        raise
    except (ValueError, RecursionError):  # RecursionError cannot happen after _nesting; kept as a guard
        raise InvalidInput(f"the request body is not JSON; send an object such as {example}") from None
    if not isinstance(value, dict):
        raise InvalidInput(f"the request body must be a JSON object such as {example}")
    where = _lone_surrogate(value)
    if where is not None:
        raise InvalidInput(
            f"the request body has a lone UTF-16 surrogate (\\ud800-\\udfff) in {where}, "
            "which is not text; send valid Unicode (a character above U+FFFF as a surrogate pair, or as UTF-8)"
        )
    return value


def has_lone_surrogate(value: str) -> bool:
    """True when ``value`` holds a code point U+D800..U+DFFF: JSON's ``"\\ud800"`` decodes to one, and
    no UTF-8 text (SQLite's, a log's, a reply's) can hold it."""
    return _SURROGATE.search(value) is not None


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """The field of a decoded JSON value (``kernel_id``, ``activities.<key>``) whose key or string
    holds a lone surrogate, or None. The body's nesting is already bounded, so the walk is short."""
    if isinstance(value, str):
        return (f"the field {_shown(where)}" if where else "a string") if has_lone_surrogate(value) else None
    items: list[tuple[str, Any]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if has_lone_surrogate(key):
                return f"a key of the field {_shown(where)}" if where else "a key"
            items.append((f"{where}.{key}" if where else key, item))
    elif isinstance(value, list):
        items = [(f"{where}[{index}]" if where else f"[{index}]", item) for index, item in enumerate(value)]
    for name, item in items:
        found = _lone_surrogate(item, name)
        if found is not None:
            return found
    return None


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _nesting(data: bytes) -> int:
    """The deepest ``[``/``{`` nesting of a JSON text, strings skipped (without parsing it)."""
    depth = deepest = 0
    for char in _STRINGS.sub(b'""', data):
        if char in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif char in (0x5D, 0x7D):  # ] }
            depth -= 1
    return deepest


# --- scalars ----------------------------------------------------------------------------------------


def whole_number(value: Any, field: str, low: int, high: int) -> int:
    """An int from ``low`` to ``high``: a JSON integer, an integral float, or digits in a string."""
    integral_float = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    digits = isinstance(value, str) and re.fullmatch(r" *-?[0-9]{1,20} *", value) is not None
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif integral_float or digits:
        number = int(value)
    if number is None or not low <= number <= high:
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected a whole number from {low} to {high}")
    return number


def number(value: Any, field: str, low: float, high: float) -> float:
    """A finite float from ``low`` to ``high`` (a JSON number or a number in a string)."""
    result: float | None = None
    if isinstance(value, bool):
        result = None
    elif isinstance(value, int):
        result = float(value) if abs(value) <= 2**63 else None
    elif isinstance(value, float):
        result = value
    elif isinstance(value, str) and len(value) <= 40:
        try:
            result = float(value)
        except ValueError:
            result = None
    if result is None or not math.isfinite(result) or not low <= result <= high:
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected a number from {low:g} to {high:g}")
    return result


def timestamp(value: Any, field: str) -> float:
    """POSIX seconds from 0 to :data:`MAX_TIME`."""
    return number(value, field, 0.0, MAX_TIME)


def time_range(since: float | None, until: float | None, since_text: str = "", until_text: str = "") -> None:
    """Refuse a range whose start is after its end (``--since 2026-12-05 --until 2026-12-01``): it
    would select nothing, silently. ``*_text`` is how each end was written, for the message."""
    if since is not None and until is not None and since > until:
        raise InvalidInput(
            f"the date range is backwards: {since_text or f'since {since:g}'} is after {until_text or f'until {until:g}'};"
            " give the earlier date as since"
        )


def pid(value: Any, field: str = "holder_pid") -> int:
    """A process id in the OS's range (1 to :func:`pid_max`)."""
    return whole_number(value, field, 1, pid_max())


def flag(value: Any, field: str) -> bool:
    """A query-string boolean: ``true``/``false``, ``1``/``0``, ``yes``/``no`` (as URLs write them).
    A field of a JSON body is read with :func:`boolean` instead."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "0", "false", "no", ""):
        return value.strip().lower() in ("1", "true", "yes")
    raise InvalidInput(f"invalid {field} {_shown(value)}: expected true or false")


def boolean(value: Any, field: str) -> bool:
    """A JSON body's boolean field: ``true`` or ``false`` and nothing else (JSON has a type for it;
    ``"yes"``, ``1`` or ``"false"`` is a mistake, and reading ``"false"`` as true would be worse)."""
    if isinstance(value, bool):
        return value
    raise InvalidInput(f"invalid {field} {_shown(value)}: expected true or false (a JSON boolean, not a string or number)")


def text(value: Any, field: str, max_length: int = MAX_ID, *, allow_empty: bool = True) -> str:
    """A string of at most ``max_length`` characters, without control characters."""
    if not isinstance(value, str):
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected a string of at most {max_length} characters")
    if len(value) > max_length:
        raise InvalidInput(f"invalid {field}: {len(value)} characters; at most {max_length} are accepted")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidInput(f"invalid {field} {_shown(value)}: control characters are not accepted")
    if has_lone_surrogate(value):
        raise InvalidInput(f"invalid {field} {_shown(value)}: a lone UTF-16 surrogate is not text; send valid Unicode")
    if not allow_empty and not value.strip():
        raise InvalidInput(f"invalid {field}: it must not be empty")
    return value


def text_list(value: Any, field: str, max_items: int = MAX_ITEMS, max_length: int = MAX_ID) -> list[str]:
    """A list of at most ``max_items`` strings (see :func:`text`)."""
    if not isinstance(value, list):
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected a list of strings")
    if len(value) > max_items:
        raise InvalidInput(f"invalid {field}: {len(value)} items; at most {max_items} are accepted")
    return [text(item, f"{field} item", max_length) for item in value]


def size(value: Any, field: str = "memory") -> int | str:
    """A size a user may send (see :data:`~jupyter_gpupool.units.SIZE_FORMS`): a byte count is
    returned as an int, text as it was (a percentage is resolved later, against the pool's GPUs)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected {SIZE_FORMS}")
    if _part_of_a_byte(value):
        raise InvalidInput(f"invalid {field} {_shown(value)}: a count of bytes is a whole number; expected {SIZE_FORMS}")
    try:
        parse_size(value, gpu_memory=MAX_SIZE)  # the grammar and bounds; a percentage of any GPU
    except InvalidInput as err:
        raise InvalidInput(f"{field}: {err}") from None
    return int(value) if isinstance(value, (int, float)) else value


_BYTES_WITH_FRACTION = re.compile(r"\s*[0-9]*\.([0-9]*)\s*[bB]?\s*")


def _part_of_a_byte(value: float | str) -> bool:
    """Whether ``value`` counts bytes with a fraction (``1.5``, ``"0.5"``, ``"2.5B"``): sizes are whole bytes."""
    if isinstance(value, float):
        return math.isfinite(value) and not value.is_integer()
    if isinstance(value, str):
        match = _BYTES_WITH_FRACTION.fullmatch(value)
        return match is not None and match.group(1).strip("0") != ""
    return False


def slice_floor(value: float | str, typed: str = "memory {}", suggest: str = "") -> None:
    """Refuse a slice's guarantee or explicit limit below :data:`~jupyter_gpupool.units.MIN_SLICE`
    (the one rule every surface applies to a size a user asks a slice to have). ``typed`` is how the
    user wrote it, ``{}`` standing for the value (``--memory {}``, ``%gpupool reserve {}``), so a bare
    number is answered with the unit it most likely lacked (written as ``suggest``, else as
    ``typed``). A percentage passes: it is of a GPU, resolved later."""
    raw = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value).strip()
    if raw.endswith("%"):
        return
    try:
        asked = parse_size(value, gpu_memory=MAX_SIZE)
    except InvalidInput:
        return  # not a size at all, or too large: the caller's own check says which, as before
    if asked >= MIN_SLICE:
        return
    bare = re.fullmatch(r"[0-9]+", raw) is not None
    what = f"{asked} byte{'s' if asked != 1 else ''} (a number without a unit counts bytes)" if bare else format_size(asked)
    suggestion = f"; did you mean {(suggest or typed).format(raw + 'GiB')}?" if bare else ""
    raise InvalidInput(f"{typed.format(raw)} is {what}, below the smallest GPU slice of {format_size(MIN_SLICE)}{suggestion}")


def slice_size(value: Any, field: str = "memory", typed: str = "") -> int | str:
    """A slice's size (see :func:`size`) at least the smallest GPU slice (see :func:`slice_floor`)."""
    checked = size(value, field)
    slice_floor(checked, typed or f"{field} {{}}", '"{}"')
    return checked


#: What a slice's ``limit`` accepts.
LIMIT_FORMS = f"{SIZE_FORMS}, or 0 for a fixed slice"


def burst_limit(value: Any, field: str = "limit") -> int | str:
    """How far an elastic slice may grow (see :func:`size`): ``0`` (or ``"0"``) asks for a fixed slice."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool) and str(value).strip() in ("0", "0.0"):
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected {LIMIT_FORMS}")
    return slice_size(value, field)


def duration(value: Any, field: str = "duration") -> float:
    """Seconds from a duration (see :data:`~jupyter_gpupool.units.DURATION_FORMS`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidInput(f"invalid {field} {_shown(value)}: expected {DURATION_FORMS}")
    try:
        return parse_duration(value)
    except InvalidInput as err:
        raise InvalidInput(f"{field}: {err}") from None


def priority(value: Any, field: str = "priority") -> str:
    """``batch``, ``normal`` or ``high`` (any case)."""
    if isinstance(value, str) and value.strip().lower() in PRIORITIES:
        return value.strip().lower()
    raise InvalidInput(f"invalid {field} {_shown(value)}: expected batch, normal or high")


def choice(value: Any, field: str, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise InvalidInput(f"invalid {field} {_shown(value)}: expected {', '.join(choices[:-1])} or {choices[-1]}")


def model(value: Any, field: str = "model") -> str:
    """A GPU model name (``A100``, ``A100-80GB``, ``RTX 4090``)."""
    if isinstance(value, str) and _MODEL.match(value):
        return value
    raise InvalidInput(f"invalid {field} {_shown(value)}: expected {PREFERENCE_FORMS['model']}")


def optional(body: Mapping[str, Any], key: str) -> Any:
    """``body[key]``, with ``null`` and ``""`` read as absent."""
    value = body.get(key)
    return None if value is None or value == "" else value


# --- request bodies ---------------------------------------------------------------------------------


def lease_request_body(body: Mapping[str, Any], max_gpus: int) -> dict[str, Any]:
    """``POST /api/gpupool/leases``: each known field typed and bounded; unknown fields dropped
    (``owner`` and ``groups`` come from the caller's identity, never from the body)."""
    clean: dict[str, Any] = {}
    if (value := optional(body, "memory")) is not None:
        clean["memory"] = slice_size(value)
    if (value := optional(body, "num_gpus")) is not None:
        clean["num_gpus"] = whole_number(value, "num_gpus", 1, max_gpus)
    if (value := optional(body, "compute_share")) is not None and value != 0:
        clean["compute_share"] = whole_number(value, "compute_share", 1, 100)
    if (value := optional(body, "model")) is not None:
        clean["model"] = model(value)
    if (value := optional(body, "priority")) is not None:
        clean["priority"] = priority(value)
    if (value := optional(body, "duration")) is not None:
        clean["duration"] = duration(value)
    if (value := optional(body, "kernel_id")) is not None:
        clean["kernel_id"] = text(value, "kernel_id")
    if (value := optional(body, "holder_pid")) is not None:
        clean["holder_pid"] = pid(value)
    if (value := optional(body, "holder_host")) is not None:
        clean["holder_host"] = text(value, "holder_host")
    if (value := optional(body, "label")) is not None:
        clean["label"] = text(value, "label", MAX_TEXT)
    if (value := body.get("limit")) is not None and value != "":
        clean["limit"] = burst_limit(value)
    return clean


def resize_body(body: Mapping[str, Any]) -> tuple[int | str | None, float | None]:
    """``{"memory": ..., "duration": ...}`` of a resize or reserve: at least one of them."""
    memory, seconds = optional(body, "memory"), optional(body, "duration")
    if memory is None and seconds is None:
        raise InvalidInput(f'give "memory" ({SIZE_FORMS}) and/or "duration" ({DURATION_FORMS})')
    return (slice_size(memory) if memory is not None else None), (duration(seconds) if seconds is not None else None)


def resize_limit_body(body: Mapping[str, Any]) -> tuple[int | str | None, float | None, int | str | None]:
    """``{"memory", "duration", "limit"}`` of a resize or reserve where slices are elastic: at
    least one of them (``limit``: see :func:`burst_limit`)."""
    memory, seconds, raw_limit = optional(body, "memory"), optional(body, "duration"), body.get("limit")
    limit = burst_limit(raw_limit) if raw_limit is not None and raw_limit != "" else None
    if memory is None and seconds is None and limit is None:
        raise InvalidInput(f'give "memory" ({SIZE_FORMS}), "limit" ({LIMIT_FORMS}) and/or "duration" ({DURATION_FORMS})')
    return (slice_size(memory) if memory is not None else None), (duration(seconds) if seconds is not None else None), limit


def grow_body(body: Mapping[str, Any]) -> int | str:
    """``{"needed": ...}`` of a grow: the bytes (all the slice's GPUs) its kernel needs to hold."""
    value = optional(body, "needed")
    if value is None:
        raise InvalidInput(f'give "needed", what the kernel needs to hold on its GPUs: expected {SIZE_FORMS}')
    return size(value, "needed")


def pinned_backup_body(body: Mapping[str, Any]) -> int:
    """``{"bytes": N}`` of a pinned-backup reservation: bytes of the host's pinned parking pool (0 gives it back)."""
    value = optional(body, "bytes")
    if value is None:
        raise InvalidInput('give "bytes", the size of the kernel\'s framework backup: expected a whole number of bytes (0 gives it back)')
    return whole_number(value, "bytes", 0, MAX_SIZE)


def keep_body(body: Mapping[str, Any]) -> float | None:
    """The optional ``duration`` of a keepalive."""
    value = optional(body, "duration")
    return duration(value) if value is not None else None


def activity_fields(data: Any) -> tuple[bool, float | None, int]:
    """``{"busy": bool, "last_activity": POSIX seconds | null, "connections": n}`` → its typed fields."""
    example = '{"busy": false, "last_activity": 1767225600, "connections": 1}'
    if not isinstance(data, dict):
        raise InvalidInput(f"activity must be an object like {example}")
    busy = boolean(data.get("busy", False), "busy")
    last = data.get("last_activity")
    last_activity = timestamp(last, "last_activity") if last is not None else None
    connections = whole_number(data.get("connections") or 0, "connections", 0, MAX_COUNT)
    return busy, last_activity, connections


def reservation_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """A reservation to book: the fields of :attr:`PoolPolicy.reservations`, each typed and bounded
    (the policy then checks how they fit together)."""
    allowed = {"name", "memory", "users", "user", "groups", "group", "weekdays", "days", "start", "end", "duration"}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise InvalidInput(f"unknown reservation {plural(len(unknown), 'field')} {_shown(unknown[:5])}; use {', '.join(sorted(allowed))}")
    clean: dict[str, Any] = {}
    for key, value in body.items():
        if key == "name":
            clean[key] = text(value, "name", allow_empty=False)
            if "/" in value:
                raise InvalidInput("invalid name: a reservation name may not contain '/'")
        elif key == "memory":
            clean[key] = slice_size(value)
        elif key in ("users", "user", "groups", "group", "weekdays", "days"):
            clean[key] = text_list(value, key, 1000) if isinstance(value, list) else text(value, key, MAX_TEXT)
        elif key in ("start", "end"):
            clean[key] = (
                timestamp(value, key)
                if isinstance(value, (int, float)) and not isinstance(value, bool)
                else text(value, key, 64)
            )
        elif key == "duration":
            clean[key] = duration(value)
    return clean


#: Longest reason a server gives for a failed suspend, restore or move (one line).
MAX_TRANSITION_ERROR = 500
#: Steps of a suspend, restore or move a server can finish (``Lease.transition`` values).
TRANSITION_STEPS = ("suspending", "restoring", "migrating")
TRANSITION_OUTCOMES = ("done", "failed")


def suspend_reason(body: Mapping[str, Any], default: str = "suspended by its user") -> str:
    """The optional one-line ``reason`` of a suspend (at most :data:`MAX_TEXT` characters)."""
    value = optional(body, "reason")
    return default if value is None else text(value, "reason", MAX_TEXT)


def transition_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """``POST .../leases/{id}/transition``: ``{"outcome": "done" | "failed", "transition"?: step,
    "parked_bytes"?: bytes >= 0, "error"?: one line, "still_running"?: bool}``, checked together
    (``parked_bytes`` only with ``done``; ``error`` required with ``failed`` and refused with ``done``)."""
    example = '{"outcome": "done", "transition": "suspending", "parked_bytes": 8589934592}'
    if "outcome" not in body:
        raise InvalidInput(f'say how it went: send {example} or {{"outcome": "failed", "error": "...", "still_running": true}}')
    clean: dict[str, Any] = {"outcome": choice(body.get("outcome"), "outcome", TRANSITION_OUTCOMES)}
    step = optional(body, "transition")
    clean["transition"] = choice(step, "transition", TRANSITION_STEPS) if step is not None else None
    parked = body.get("parked_bytes")
    error = body.get("error")
    running = body.get("still_running")
    if clean["outcome"] == "done":
        if error is not None or running is not None:
            raise InvalidInput('"error" and "still_running" go with "outcome": "failed" only')
        clean["parked_bytes"] = whole_number(parked, "parked_bytes", 0, MAX_SIZE) if parked is not None else None
    else:
        if parked is not None:
            raise InvalidInput('"parked_bytes" goes with "outcome": "done" only')
        if error is None:
            raise InvalidInput('a failed transition needs "error": one line saying why (at most 500 characters)')
        clean["error"] = text(error, "error", MAX_TRANSITION_ERROR, allow_empty=False)
        clean["still_running"] = boolean(running, "still_running") if running is not None else False
    return clean


# --- saved preferences ------------------------------------------------------------------------------


def preference_value(key: str, value: Any, max_gpus: int = 64) -> Any:
    """One saved preference, checked; ``None`` clears it."""
    if value is None:
        return None
    if key == "memory":
        return slice_size(value)
    if key == "num_gpus":
        return whole_number(value, "num_gpus", 1, max_gpus)
    if key == "compute_share":
        return whole_number(value, "compute_share", 1, 100)
    if key == "model":
        return model(value)
    if key == "priority":
        return priority(value)
    raise InvalidInput(f"unknown preference {_shown(key)}; use {', '.join(sorted(PREFERENCE_FORMS))}")


def preferences(values: Mapping[str, Any], max_gpus: int = 64) -> dict[str, Any]:
    """Preferences a user saves (``PATCH /api/gpupool/preferences``): each key known and its value
    in the accepted form, else :class:`InvalidInput` naming the key and the form."""
    if not isinstance(values, Mapping):
        raise InvalidInput('preferences must be an object such as {"memory": "8GiB", "num_gpus": 1}')
    unknown = sorted(str(k) for k in values if k not in PREFERENCE_FORMS)
    if unknown:
        raise InvalidInput(f"unknown {plural(len(unknown), 'preference')} {_shown(unknown[:5])}; use {', '.join(sorted(PREFERENCE_FORMS))}")
    clean = {}
    for key, value in values.items():
        try:
            clean[key] = preference_value(key, value, max_gpus)
        except InvalidInput:
            form = PREFERENCE_FORMS[key].format(max_gpus=max_gpus)
            raise InvalidInput(f"invalid preference {key} {_shown(value)}: expected {form}") from None
    return clean


def usable_preferences(
    stored: Any, owner: str = "", log: logging.Logger | logging.LoggerAdapter[Any] | None = None
) -> dict[str, Any]:
    """The saved preferences that can be used, read leniently: an entry that is not in the accepted
    form (saved by an older version, or written straight into the store) is left out with a
    warning, so a bad preference never stops a kernel from starting."""
    logger = log or _log
    if not isinstance(stored, Mapping):
        if stored:
            logger.warning("gpupool: ignoring %s's saved preferences: not an object", owner or "the user")
        return {}
    usable: dict[str, Any] = {}
    for key, value in stored.items():
        if value is None:
            continue
        try:
            usable[key] = preference_value(str(key), value)
        except InvalidInput as err:
            logger.warning("gpupool: ignoring %s's saved preference %s: %s", owner or "the user", key, err)
    return usable


__all__ = [
    "LIMIT_FORMS",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "BodyTooLarge",
    "activity_fields",
    "boolean",
    "burst_limit",
    "duration",
    "flag",
    "grow_body",
    "has_lone_surrogate",
    "json_object",
    "keep_body",
    "lease_request_body",
    "number",
    "pid",
    "pid_max",
    "preferences",
    "priority",
    "reservation_body",
    "resize_body",
    "resize_limit_body",
    "size",
    "slice_floor",
    "slice_size",
    "suspend_reason",
    "text",
    "text_list",
    "time_range",
    "timestamp",
    "transition_body",
    "usable_preferences",
    "whole_number",
]
