"""Sizes and durations as users type them."""

import pytest

from jupyter_gpupool.errors import InvalidInput, RequestRefused, SizeTooLarge
from jupyter_gpupool.units import EIB, GIB, MIB, PIB, TIB, format_duration, format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text, expected",
    [
        ("8GiB", 8 * GIB),
        ("8G", 8 * GIB),
        ("8GB", 8 * GIB),
        ("8 gib", 8 * GIB),
        ("512MiB", 512 * MIB),
        ("1.5GiB", int(1.5 * GIB)),
        ("1073741824", GIB),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_the_documented_forms(text, expected):
    assert parse_size(text) == expected


def test_percent_is_of_the_given_gpu():
    assert parse_size("25%", gpu_memory=16 * GIB) == 4 * GIB


@pytest.mark.parametrize("bad", ["-1", "abc", "1e30", "0", "8XB", "", "101%", "0%", "nan", True, -5, float("inf")])
def test_bad_sizes_name_the_accepted_forms(bad):
    with pytest.raises(InvalidInput) as err:
        parse_size(bad, gpu_memory=16 * GIB)
    message = str(err.value)
    assert "\n" not in message
    assert "8GiB" in message or "%" in message


def test_percent_without_a_gpu_is_an_error():
    with pytest.raises(InvalidInput, match="needs a GPU"):
        parse_size("25%")


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("2h", 7200), ("1h30m", 5400), ("1d", 86400), ("3600", 3600)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["-5m", "0", "soon", "5x", "", "1h-5m", "400d"])
def test_bad_durations(bad):
    with pytest.raises(InvalidInput, match="duration like 90s"):
        parse_duration(bad)


def test_formatting():
    assert format_size(8 * GIB) == "8 GiB"
    assert format_size(int(3.1 * GIB)) == "3.1 GiB"
    assert format_size(None) == "unknown"
    assert format_duration(None) == "unknown"
    assert format_duration(270) == "4 min 30 s"
    assert format_duration(3 * 3600 + 60) == "3 h 1 min"


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("-5GiB", "a size must be above 0"),
        (" -5 GiB", "a size must be above 0"),
        (10**400, "too large: no GPU pool holds more than 1 PiB"),
        (-(10**400), "a size must be above 0"),
        ("9" * 400, "too long"),
        ("1e400", "expected a size like"),
        ([1], "expected a size like"),
        (None, "expected a size like"),
    ],
)
def test_negative_huge_and_wrong_typed_sizes_are_one_short_line(bad, expected):
    with pytest.raises(InvalidInput, match=expected) as err:
        parse_size(bad, gpu_memory=16 * GIB)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize(
    "bad, expected",
    [
        ("-1h", "must be above 0"),
        (-5, "must be above 0"),
        (10**400, "a 401-digit number: must be above 0 and at most 366 days"),
        (1e308, "at most 366 days"),
        ("9" * 400, "too long"),
        ({"h": 1}, "expected a duration like"),
    ],
)
def test_negative_huge_and_wrong_typed_durations_are_one_short_line(bad, expected):
    with pytest.raises(InvalidInput, match=expected) as err:
        parse_duration(bad)
    assert "\n" not in str(err.value) and len(str(err.value)) < 200


@pytest.mark.parametrize("text", ["12 GB", "12GB", "12 gib", " 12G "])
def test_one_size_grammar_for_rest_magic_and_cli(text):
    """REST bodies, the %gpupool magic and the CLI all read sizes with units.parse_size."""
    from jupyter_gpupool.core import validate
    from jupyter_gpupool.kernel.magics import build_parser

    assert parse_size(text) == 12 * GIB
    assert validate.size(text) == text  # accepted over REST as typed
    args = build_parser().parse_args(["reserve", *text.split()])
    assert parse_size(args.size) == 12 * GIB


@pytest.mark.parametrize("text, expected", [("1PB", PIB), ("1P", PIB), ("1 pib", PIB), ("0.5PiB", PIB // 2), ("2TB", 2 * TIB)])
def test_every_unit_up_to_peta_is_read_as_binary(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1025TiB", "4PB", "2PiB", "1EB", "3EiB", "1e", 2 * PIB])
def test_a_size_over_1_pib_is_too_large_not_an_unknown_unit(text):
    """Too large is the pool's refusal (exit 3) wherever the size is typed, and still bad input (HTTP 400)."""
    with pytest.raises(SizeTooLarge) as err:
        parse_size(text)
    assert isinstance(err.value, RequestRefused) and isinstance(err.value, InvalidInput)
    assert (err.value.exit_code, err.value.http_status) == (RequestRefused.exit_code, InvalidInput.http_status)
    assert "too large: no GPU pool holds more than 1 PiB" in str(err.value)
    assert "unknown unit" not in str(err.value)


def test_an_unknown_unit_names_the_units_there_are():
    with pytest.raises(InvalidInput, match=r"unknown unit 'XB'; units are B, KiB, MiB, GiB, TiB, PiB, EiB") as err:
        parse_size("8XB")
    assert not isinstance(err.value, SizeTooLarge)


def test_sizes_are_printed_up_to_exbibytes():
    assert [format_size(PIB), format_size(3 * EIB), format_size(int(1.5 * TIB))] == ["1 PiB", "3 EiB", "1.5 TiB"]
