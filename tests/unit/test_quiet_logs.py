"""What the log says: figures in the unit that fits (never ``0.000 B parameters``)."""

import pytest

from distzo.runtime.units import format_bytes, format_count


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (999, "999 B"),
        (1023, "1.02 KB"),
        (1024, "1.02 KB"),
        (999_999, "1.00 MB"),  # rounds up into the next unit, not "1000.00 KB"
        (1.5e9, "1.50 GB"),
        (695.85e9, "695.85 GB"),
        (2.5e12, "2.50 TB"),
    ],
)
def test_bytes_take_the_decimal_unit_that_fits(n, text):
    assert format_bytes(n) == text


@pytest.mark.parametrize(
    "n, text",
    [(0, "0"), (999, "999"), (21_310, "21.31 K"), (1.2e6, "1.20 M"), (7e9, "7.00 B")],
)
def test_parameter_counts_take_the_unit_that_fits(n, text):
    assert format_count(n) == text
