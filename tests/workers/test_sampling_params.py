"""SamplingParams refuses values outside its documented ranges, naming the field."""
import math

import pytest

from thinkserve.workers.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("t", [math.inf, -math.inf, math.nan, 1e30, MAX_TEMPERATURE * 1.01, -0.5, 1e-30,
                               MIN_TEMPERATURE / 2])
def test_temperature_outside_its_range_is_refused(t):
    with pytest.raises(ValueError) as e:
        SamplingParams(temperature=t)
    msg = str(e.value)
    assert msg.startswith("temperature ") and f"[{MIN_TEMPERATURE}, {MAX_TEMPERATURE}]" in msg


@pytest.mark.parametrize("t", [0.0, MIN_TEMPERATURE, 0.7, 1.0, MAX_TEMPERATURE])
def test_temperature_inside_its_range_is_kept(t):
    assert SamplingParams(temperature=t).temperature == t


@pytest.mark.parametrize("p", [math.nan, math.inf, -math.inf, 0.0, 1.0000001])
def test_top_p_outside_0_1_is_refused(p):
    with pytest.raises(ValueError) as e:
        SamplingParams(top_p=p)
    assert str(e.value).startswith("top_p must be in (0, 1]")
