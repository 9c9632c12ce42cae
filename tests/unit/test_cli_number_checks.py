"""The CLI's shared parsers refuse numbers JSON cannot carry: ``--param x=inf`` (for `elastic set`,
`memory set`, `policy set`) and a duration of ``inf``/``nan`` or below zero (time limits), which were
sent as JSON ``null`` and stored as events no service could read back."""

from __future__ import annotations

import pytest

from apps.cli.common import name_values, parse_duration
from gpuherd.errors import GpuherdError


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e999"])
def test_a_param_that_is_not_finite_is_refused(value: str) -> None:
    with pytest.raises(GpuherdError, match="must be a finite number"):
        name_values([f"target_s={value}"])


def test_finite_params_are_taken() -> None:
    assert name_values(["a=1", "b=-2.5", "c=1e-3"]) == {"a": 1.0, "b": -2.5, "c": 0.001}


@pytest.mark.parametrize("text", ["inf", "nan", "infs", "1e999h", "-5", "-1m", "inf:00", "1-inf:00:00"])
def test_a_duration_that_is_not_finite_or_below_zero_is_refused(text: str) -> None:
    with pytest.raises(GpuherdError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90.0), ("90m", 5400.0), ("2h", 7200.0), ("1-12:00:00", 129600.0), ("0", 0.0)]
)
def test_durations_are_read_as_before(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
