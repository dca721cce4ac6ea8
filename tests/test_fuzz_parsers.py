"""Hypothesis over every parser of user input: sizes, durations, reservations, preferences, the REST
body validators and the ``%gpupool`` argument parser.

For any input at all, a parser either returns a value of its type within its documented bounds or
raises :class:`~jupyter_gpupool.errors.InvalidInput` with a one-line message; never anything else.
Where a format and a parse exist, they round-trip.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from jupyter_gpupool.core import validate
from jupyter_gpupool.core.policy import parse_quota, parse_reservation
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.kernel.magics import MagicError, _HelpShown, build_parser
from jupyter_gpupool.units import (
    GIB,
    KIB,
    MAX_DURATION,
    MAX_SIZE,
    MIB,
    TIB,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
)

EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_EXAMPLES", "50"))
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: Any JSON value, including the hostile ones (huge ints, non-finite floats, nesting).
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**300, max_value=10**400)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=80),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
#: Text shaped like sizes and durations, with signs, exponents, spaces and units.
size_like = st.from_regex(
    r"\A\s?[-+]?\d{0,420}(\.\d{0,5})?(e\d{1,3})?\s?(B|k|KiB|MB|GiB|G|gb|T|TiB|%|h|m|s|d|min|parsecs)?\s?\Z"
)
any_input = json_values | size_like


def one_line(err: InvalidInput) -> None:
    message = str(err)
    assert message and "\n" not in message and len(message) < 400, message


# --- units ------------------------------------------------------------------------------------------------


@fuzz
@given(any_input, st.none() | st.integers(min_value=1, max_value=MAX_SIZE))
@example("9" * 400, None)
@example(10**400, None)
@example("1e400", None)
@example(float("inf"), None)
@example("-5GiB", None)
@example("12 GB", None)
def test_parse_size_returns_bytes_in_range_or_one_line_error(value: Any, gpu_memory: int | None) -> None:
    try:
        result = parse_size(value, gpu_memory=gpu_memory)
    except InvalidInput as err:
        one_line(err)
        return
    assert isinstance(result, int) and 1 <= result <= MAX_SIZE


@fuzz
@given(any_input)
@example(10**400)
@example("-1h")
@example(1e308)
@example("1h 30m")
def test_parse_duration_returns_seconds_in_range_or_one_line_error(value: Any) -> None:
    try:
        result = parse_duration(value)
    except InvalidInput as err:
        one_line(err)
        return
    assert isinstance(result, float) and math.isfinite(result) and 0 < result <= MAX_DURATION


@fuzz
@given(
    st.integers(min_value=1, max_value=1023), st.sampled_from([(KIB, "KiB"), (MIB, "MiB"), (GIB, "GiB"), (TIB, "TiB")])
)
def test_format_size_round_trips_through_parse_size(count: int, unit: tuple[int, str]) -> None:
    factor, _ = unit
    size = count * factor
    assert parse_size(format_size(size)) == size
    assert parse_size(format_size(size).replace(" ", "")) == size  # "8GiB" and "8 GiB" are one grammar


@fuzz
@given(st.integers(min_value=1, max_value=10**6), st.sampled_from(["B", "KiB", "MiB", "GiB", "G", "GB", "gib"]))
def test_spaces_between_number_and_unit_do_not_matter(count: int, unit: str) -> None:
    try:
        joined = parse_size(f"{count}{unit}")
    except InvalidInput:
        return  # over 1 PiB
    assert parse_size(f"{count} {unit}") == joined


@fuzz
@given(st.integers(min_value=1, max_value=MAX_DURATION))
def test_whole_seconds_round_trip_through_parse_duration(seconds: int) -> None:
    assert parse_duration(seconds) == seconds
    assert parse_duration(str(seconds)) == seconds
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = "".join(f"{n}{u}" for n, u in ((hours, "h"), (minutes, "m"), (secs, "s")) if n)
    assert parse_duration(text) == seconds
    assert format_duration(seconds) != "unknown"


# --- policy: reservations and quotas ----------------------------------------------------------------------

reservation_specs = st.dictionaries(
    st.sampled_from(
        ["name", "memory", "users", "user", "groups", "group", "weekdays", "days", "start", "end", "duration"]
    ),
    json_values | size_like | st.sampled_from(["09:00", "11:00", "tue", "now", "2026-12-01T09:00"]),
    max_size=8,
)


@fuzz
@given(reservation_specs)
@example({"name": "lab", "memory": "40GiB", "groups": ["cs101"], "weekdays": ["tue"], "start": "09:00", "end": "11:00"})
@example({"name": "x", "memory": 10**400, "groups": "g", "duration": "1h"})
def test_reservation_parsing_is_total(spec: dict[str, Any]) -> None:
    """What the REST validator lets through, the policy parses or refuses with InvalidInput."""
    try:
        clean = validate.reservation_body(spec)
        reservation = parse_reservation(clean, now=1_767_225_600.0)
    except InvalidInput as err:
        one_line(err)
        return
    assert 1 <= reservation.memory <= MAX_SIZE


@fuzz
@given(
    st.dictionaries(
        st.sampled_from(["guaranteed", "maximum", "max_leases", "other"]), json_values | size_like, max_size=4
    )
)
def test_quota_parsing_is_total(spec: dict[str, Any]) -> None:
    try:
        quota = parse_quota(spec, "fuzz")
    except InvalidInput as err:
        one_line(err)
        return
    assert quota.guaranteed >= 0


# --- preferences and REST bodies --------------------------------------------------------------------------

preference_maps = st.dictionaries(
    st.sampled_from(["memory", "num_gpus", "compute_share", "model", "priority", "colour"]),
    json_values | size_like | st.sampled_from(["A100", "high", "batch", "8GiB", 2, "2"]),
    max_size=5,
)


@fuzz
@given(preference_maps)
@example({"num_gpus": "two"})
@example({"priority": 5})
@example({"model": ["A100"]})
@example({"num_gpus": "0\x1f"})  # found by this test: int() refused what the regex let through
def test_preferences_are_saved_only_in_their_accepted_form(values: dict[str, Any]) -> None:
    try:
        clean = validate.preferences(values, max_gpus=8)
    except InvalidInput as err:
        one_line(err)
        return
    # What was accepted is read back unchanged, and reads back as usable: a saved preference never
    # turns into one that a kernel start skips.
    assert validate.usable_preferences(clean) == {k: v for k, v in clean.items() if v is not None}


@fuzz
@given(json_values)
def test_reading_any_stored_preference_never_raises(stored: Any) -> None:
    usable = validate.usable_preferences(stored, "fuzz")
    assert validate.preferences(usable) == usable


@fuzz
@given(st.dictionaries(st.text(max_size=15), json_values, max_size=8), st.integers(min_value=1, max_value=16))
def test_lease_request_body_is_total_and_bounded(body: dict[str, Any], max_gpus: int) -> None:
    try:
        clean = validate.lease_request_body(body, max_gpus)
    except InvalidInput as err:
        one_line(err)
        return
    if "num_gpus" in clean:
        assert 1 <= clean["num_gpus"] <= max_gpus
    if "holder_pid" in clean:
        assert 1 <= clean["holder_pid"] <= validate.pid_max()
    if "duration" in clean:
        assert 0 < clean["duration"] <= MAX_DURATION
    for key in ("kernel_id", "holder_host", "model"):
        if key in clean:
            assert isinstance(clean[key], str) and len(clean[key]) <= validate.MAX_ID


@fuzz
@given(json_values)
def test_activity_and_resize_bodies_are_total(data: Any) -> None:
    for check in (validate.activity_fields, validate.resize_body, validate.keep_body):
        try:
            check(data if check is validate.activity_fields or isinstance(data, dict) else {"duration": data})
        except InvalidInput as err:
            one_line(err)


@fuzz
@given(st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
@example(b"[" * 5000 + b"]" * 5000)
@example(b'{"a": NaN}')
@example(b'{"a": ' + b"9" * 5000 + b"}")
def test_json_object_reads_any_bytes_as_a_dict_or_one_line_error(raw: bytes) -> None:
    try:
        value = validate.json_object(raw)
    except InvalidInput as err:
        one_line(err)
        return
    assert isinstance(value, dict)


# --- the %gpupool argument parser ------------------------------------------------------------------------

MAGIC_PARSER = build_parser()


@fuzz
@given(
    st.lists(
        size_like | st.sampled_from(["reserve", "keep", "--for", "--gpus", "wait", "--timeout", "12", "GB", "-5GiB"]),
        max_size=6,
    )
)
def test_magic_arguments_parse_or_give_one_line(words: list[str]) -> None:
    try:
        args = MAGIC_PARSER.parse_args(words or ["status"])
    except MagicError as err:
        assert "\n" not in err.message
        return
    except _HelpShown:
        return
    # A size the magic took is handed to the one grammar; a bad one is a one-line InvalidInput.
    if getattr(args, "size", None):
        try:
            parse_size(args.size, gpu_memory=16 * GIB)
        except InvalidInput as err:
            one_line(err)
