"""Counts, articles and sizes as every message of the product words them.

One place, so the CLI, the magics, REST ``message``/``reason`` fields and log lines say
"1 request", "2 requests", "an A100-80GB GPU" and "2 × 70 GiB" alike (the lab extension's
``labextension/src/units.ts`` words them the same way; a test compares the two).
"""

from __future__ import annotations

import math
import re

from jupyter_gpupool.units import format_duration, format_size

# Irregular plurals of nouns our messages count; every other noun takes "s".
_PLURALS = {"process": "processes", "day": "days", "this": "these", "is": "are", "was": "were", "has": "have"}
# Letters read with a vowel sound when spelt out (an H100, an L40S, an MI300X, an RTX 6000).
_VOWEL_SOUND_LETTERS = set("AEFHILMNORSX")
# Lower-case words that start with a vowel letter but a consonant sound, and the reverse.
_CONSONANT_SOUND_WORDS = ("uni", "use", "usa", "one", "once", "eu")
_VOWEL_SOUND_WORDS = ("hour", "honest")


def plural(n: float, noun: str, many: str | None = None) -> str:
    """``noun`` as it goes with ``n``: ``request`` for 1, ``requests`` for 0, 2 or 1.5."""
    if n == 1:
        return noun
    return many or _PLURALS.get(noun) or noun + "s"


def count(n: float, noun: str, many: str | None = None) -> str:
    """``1 request``, ``2 requests``, ``0 GPUs``: the number with its noun agreeing."""
    number = f"{n:g}" if isinstance(n, float) else str(n)
    return f"{number} {plural(n, noun, many)}"


def article(word: str) -> str:
    """``a`` or ``an`` for ``word`` as it is read aloud: an A100, an H100, a GPU, an 80 GiB, a T4."""
    text = word.strip()
    if not text:
        return "a"
    first = text[0]
    if first.isdigit():
        number = re.match(r"\d+", text)
        digits = number.group(0) if number else first
        # eight, eleven, eighteen, eighty..., eight hundred...: the number read aloud starts with a vowel
        eleven_or_eighteen = len(digits) % 3 == 2 and digits[:2] in {"11", "18"}  # 11, 18 000, 11 000 000
        return "an" if digits[0] == "8" or eleven_or_eighteen else "a"
    lower = text.lower()
    if lower.startswith(_VOWEL_SOUND_WORDS):
        return "an"
    if lower.startswith(_CONSONANT_SOUND_WORDS):
        return "a"
    word_head = re.match(r"[A-Za-z]+", text)
    head = word_head.group(0) if word_head else first
    if head.isupper() and (len(head) <= 4 or any(c.isdigit() for c in text)):  # spelt out letter by letter
        return "an" if first.upper() in _VOWEL_SOUND_LETTERS else "a"
    return "an" if first.lower() in "aeiou" else "a"


def with_article(word: str) -> str:
    """``word`` after its article: ``an A100-80GB``, ``a GPU``."""
    return f"{article(word)} {word}"


def gpus(n: int) -> str:
    """``1 GPU``, ``2 GPUs``."""
    return count(n, "GPU")


def slice_size(memory_per_gpu: int, num_gpus: int) -> str:
    """A slice as it is held: ``70 GiB`` on one GPU, ``2 × 70 GiB`` across two."""
    return format_size(memory_per_gpu) if num_gpus <= 1 else f"{num_gpus} × {format_size(memory_per_gpu)}"


def slice_on(memory_per_gpu: int, num_gpus: int) -> str:
    """``8 GiB on 1 GPU``, ``70 GiB on each of 2 GPUs``."""
    if num_gpus <= 1:
        return f"{format_size(memory_per_gpu)} on 1 GPU"
    return f"{format_size(memory_per_gpu)} on each of {gpus(num_gpus)}"


def upcoming_reclaim(reason: str) -> str:
    """A reclaim's recorded reason as the countdown before it says it: what is about to happen,
    not what happened (``reclaimed: idle for 1 min while 1 request waited for a GPU`` →
    ``idle for 1 min while 1 request waits for a GPU``)."""
    text = reason.strip()
    for done, ahead in (("reclaimed for ", "for "), ("preempted for ", "for "), ("reclaimed: ", "")):
        if text.startswith(done):
            text = ahead + text[len(done) :]
            break
    text = re.sub(r"\b(\d+|a|one) (request|job) waited\b", r"\1 \2 waits", text)
    text = re.sub(r"\b(\d+) (requests|jobs) waited\b", r"\1 \2 wait", text)
    return text.replace(" others waited", " others wait")


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``22nd``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def grow_wait(wanted: int, since: str, place: int | None = None) -> str:
    """A kernel whose grow waits for room: ``waiting to grow to 12 GiB since 14:02 (2nd in line)``
    (``wanted``: bytes, all its GPUs; ``since``: a clock time; ``place``: 1-based, None if unknown)."""
    where = "" if place is None else " (next in line)" if place <= 1 else f" ({ordinal(place)} in line)"
    return f"waiting to grow to {format_size(wanted)} since {since}{where}"


def remaining(seconds: float) -> str:
    """Time left as a person reads it: from 10 min on, to the nearest minute, so the moment it
    took to answer does not turn "1 h" into "59 min"; below, to the second, rounded up."""
    left = max(0.0, seconds)
    return format_duration(round(left / 60) * 60 if left >= 600 else math.ceil(left))


def sentence(text: str) -> str:
    """``text`` as a sentence: a capital first letter and one full stop."""
    text = text.strip().rstrip(".;:")
    return text[:1].upper() + text[1:] + "." if text else ""


def cpu_only_description(reason: str, pool_is_back: bool = False) -> str:
    """Why a kernel runs CPU-only, in two short sentences: what happened, then what to do.

    ``reason`` is the pool's one-line error, ``what happened; what to do`` as every error of the
    product is worded (the second part may be missing)."""
    what, _, todo = " ".join(reason.split()).partition("; ")
    if pool_is_back:
        then = what.replace(" is not ", " was not ", 1)
        return f"{sentence(f'this kernel runs CPU-only: when it started, {then}')} The pool is back: restart this kernel to get a GPU slice."
    then = f"{todo}, then restart this kernel" if todo else "restart this kernel once the pool is back"
    return f"{sentence(f'this kernel runs CPU-only: {what}')} {sentence(then)}"


def duration(seconds: float | None) -> str:
    """A duration as messages show it (``4 min 30 s``); the same as :func:`units.format_duration`."""
    return format_duration(seconds)


__all__ = ["article", "count", "cpu_only_description", "duration", "gpus", "plural", "remaining", "sentence", "slice_on", "slice_size", "upcoming_reclaim", "with_article"]
