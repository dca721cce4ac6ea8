"""Sizes are whole bytes: a fraction of a byte is refused with a clear error (a 400 over REST),
never truncated (a ``needed`` of 1.5 was a 1-byte grow, a ``limit`` of 0.5 a fixed slice)."""

from __future__ import annotations

import pytest

from jupyter_gpupool.core import validate
from jupyter_gpupool.errors import InvalidInput
from jupyter_gpupool.units import GIB


@pytest.mark.parametrize("value", [1.5, 0.5, "1.5", "0.5", "2.5B", " 7.25 b "])
def test_a_fraction_of_a_byte_is_refused_wherever_a_size_is_taken(value) -> None:
    with pytest.raises(InvalidInput, match="a count of bytes is a whole number"):
        validate.grow_body({"needed": value})
    with pytest.raises(InvalidInput, match="a count of bytes is a whole number"):
        validate.resize_limit_body({"limit": value})
    with pytest.raises(InvalidInput, match="a count of bytes is a whole number"):
        validate.size(value)


@pytest.mark.parametrize(("value", "expected"), [(3.0, 3), ("3", "3"), ("2.0", "2.0"), ("1.5GiB", "1.5GiB"), (GIB, GIB)])
def test_whole_byte_counts_and_sizes_with_a_unit_are_taken(value, expected) -> None:
    assert validate.size(value) == expected


def test_a_fixed_slice_is_asked_for_with_zero_only() -> None:
    assert validate.burst_limit(0) == 0 and validate.burst_limit("0") == 0 and validate.burst_limit(0.0) == 0
    with pytest.raises(InvalidInput):
        validate.burst_limit(0.5)
