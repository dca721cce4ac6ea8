"""Parse and format memory sizes and durations as users type them.

Every parser raises :class:`InvalidInput` with a one-line message that names the accepted
forms, so adapters (CLI, REST, magics) can show it as is.
"""

from __future__ import annotations

import math
import re

from jupyter_gpupool.errors import InvalidInput, SizeTooLarge

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4
PIB = 1024**5
EIB = 1024**6

SIZE_FORMS = "a size like 8GiB, 8G, 8GB, 512MiB, 1073741824 (bytes) or 25% (of a GPU)"
#: The units a size may carry, as an error names them (each also as its one letter or its "B" form).
SIZE_UNITS_NAMED = "B, KiB, MiB, GiB, TiB, PiB, EiB, as in 8GiB (K/KB, M/MB, G/GB, T/TB, P/PB, E/EB are the same binary units)"
DURATION_FORMS = "a duration like 90s, 30m, 2h, 1h30m, 1d or 3600 (seconds)"

# Binary units on purpose: GPU memory is sold in GiB even when labelled "GB" (docs/sizes.md).
# Every prefix up to exa is known, so a size too large for any GPU says so rather than
# "unknown unit".
_SIZE_UNITS = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtpe", start=1):
    _SIZE_UNITS.update({_letter: 1024**_power, _letter + "b": 1024**_power, _letter + "ib": 1024**_power})
_SIZE_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*(?P<unit>[a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*(?P<num>\d+(?:\.\d+)?)\s*%\s*$")
# Largest size we accept: no GPU has more than 1 PiB, and bigger numbers are typos.
MAX_SIZE = PIB
#: What a size over :data:`MAX_SIZE` is told, wherever it is typed.
TOO_LARGE = "too large: no GPU pool holds more than 1 PiB; expected at most 1PiB"
#: Longest size or duration text we read: anything longer is a mistake, not a size.
MAX_TEXT = 64
#: Smallest GPU slice a user may ask for (its guarantee, or an explicit limit): less cannot hold a
#: CUDA context, so it is a typo (``8`` for 8GiB counts bytes) rather than a choice. The rule lives
#: in :func:`jupyter_gpupool.core.validate.slice_floor`.
MIN_SLICE = 64 * MIB


def parse_size(text: str | float, *, gpu_memory: int | None = None) -> int:
    """Return a positive number of bytes from ``text``.

    ``25%`` is a share of ``gpu_memory`` (the GPU the request is for, or the largest GPU).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise InvalidInput(f"invalid size {_shown(text)}: expected {SIZE_FORMS}")
    if isinstance(text, (int, float)):
        # Compared as numbers, never converted first: a 400-digit int does not fit a float.
        if isinstance(text, float) and not math.isfinite(text):
            raise InvalidInput(f"invalid size {_shown(text)}: expected {SIZE_FORMS}")
        if text <= 0:
            raise InvalidInput(f"invalid size {_shown(text)}: a size must be above 0; expected {SIZE_FORMS}")
        if text > MAX_SIZE:
            raise SizeTooLarge(f"invalid size {_shown(text)}: {TOO_LARGE}")
        return max(1, int(text))
    raw = str(text)
    if len(raw) > MAX_TEXT:
        raise InvalidInput(f"invalid size {_shown(raw)}: too long; expected {SIZE_FORMS}")
    if raw.strip().startswith("-"):
        raise InvalidInput(f"invalid size {raw!r}: a size must be above 0; expected {SIZE_FORMS}")
    percent = _PERCENT_RE.match(raw)
    if percent:
        share = float(percent.group("num"))
        if not 0 < share <= 100:
            raise InvalidInput(f"invalid size {raw!r}: a percentage must be above 0% and at most 100%")
        if gpu_memory is None:
            raise InvalidInput(f"invalid size {raw!r}: a percentage needs a GPU to take it of")
        return max(1, int(gpu_memory * share / 100))
    match = _SIZE_RE.match(raw)
    if not match:
        raise InvalidInput(f"invalid size {raw!r}: expected {SIZE_FORMS}")
    unit = match.group("unit").lower()
    if unit not in _SIZE_UNITS:
        raise InvalidInput(f"invalid size {raw!r}: unknown unit {match.group('unit')!r}; units are {SIZE_UNITS_NAMED}")
    value = float(match.group("num")) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value > MAX_SIZE:
        raise SizeTooLarge(f"invalid size {raw!r}: {TOO_LARGE}")
    if value < 1:
        raise InvalidInput(f"invalid size {raw!r}: a size must be at least 1 byte; expected {SIZE_FORMS}")
    return int(value)


_DURATION_UNITS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(d|h|min|m|sec|s)", re.IGNORECASE)
MAX_DURATION = 366 * 86400
_DURATION_RANGE = "must be above 0 and at most 366 days"


def parse_duration(text: str | float) -> float:
    """Return a positive number of seconds from ``text`` (``2h``, ``1h30m``, ``90``)."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise InvalidInput(f"invalid duration {_shown(text)}: expected {DURATION_FORMS}")
    if isinstance(text, int):
        if not 0 < text <= MAX_DURATION:  # compared as an int: a 400-digit one does not fit a float
            raise InvalidInput(f"invalid duration {_shown(text)}: {_DURATION_RANGE}; expected {DURATION_FORMS}")
        seconds = float(text)
    elif isinstance(text, float):
        seconds = text
    else:
        raw = str(text).strip()
        if len(raw) > MAX_TEXT:
            raise InvalidInput(f"invalid duration {_shown(raw)}: too long; expected {DURATION_FORMS}")
        if raw.startswith("-"):
            raise InvalidInput(f"invalid duration {raw!r}: {_DURATION_RANGE}; expected {DURATION_FORMS}")
        if re.fullmatch(r"\d+(?:\.\d+)?", raw):
            seconds = float(raw)
        else:
            compact = raw.replace(" ", "")
            parts = _DURATION_PART.findall(compact)
            if not parts or "".join(n + u for n, u in parts).lower() != compact.lower():
                raise InvalidInput(f"invalid duration {text!r}: expected {DURATION_FORMS}")
            seconds = sum(float(n) * _DURATION_UNITS[u.lower()] for n, u in parts)
    if not math.isfinite(seconds) or seconds <= 0 or seconds > MAX_DURATION:
        raise InvalidInput(f"invalid duration {_shown(text)}: {_DURATION_RANGE}; expected {DURATION_FORMS}")
    return seconds


def _shown(value: object) -> str:
    """``repr`` of a bad value, cut short: a message stays one readable line."""
    text = repr(value) if not isinstance(value, int) or isinstance(value, bool) else _int_repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _int_repr(value: int) -> str:
    # str() of an int over 4300 digits raises ValueError; say how long it is instead.
    if abs(value) < 10**30:
        return str(value)
    digits = int(abs(value).bit_length() * 0.30103) + 1
    return f"a {'negative ' if value < 0 else ''}{digits}-digit number"


def format_size(num_bytes: float | None) -> str:
    """``8589934592`` → ``8 GiB``; ``3.1 GiB`` keeps one decimal when it matters."""
    if num_bytes is None:
        return "unknown"
    value = float(num_bytes)
    for unit, factor in (("EiB", EIB), ("PiB", PIB), ("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(value) >= factor:
            scaled = value / factor
            text = f"{scaled:.1f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
    return f"{int(value)} B"


def format_duration(seconds: float | None) -> str:
    """``270`` → ``4 min 30 s``; ``None`` → ``unknown``."""
    if seconds is None:
        return "unknown"
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min" + (f" {sec} s" if sec and minutes < 10 else "")
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h" + (f" {minutes} min" if minutes else "")
    days, hours = divmod(hours, 24)
    return f"{days} d" + (f" {hours} h" if hours else "")
