"""An accuracy's interval: the Wilson score interval over the test images it was measured on."""

from __future__ import annotations

import pytest

from tapp_core.measure.stats import proportion_interval


@pytest.mark.parametrize(
    ("value", "trials", "low", "high"),
    [
        (0.5, 100, 0.4038, 0.5962),  # Brown, Cai & DasGupta's and any textbook's Wilson interval at 95 %
        (0.1, 500, 0.0767, 0.1294),  # chance on 500 Fashion-MNIST test images: ±2.6 points
        (0.7, 1000, 0.6709, 0.7276),
    ],
)
def test_the_wilson_interval_matches_its_formula(value: float, trials: int, low: float, high: float) -> None:
    found = proportion_interval(value, trials)
    assert (found.low, found.high) == pytest.approx((low, high), abs=1e-4)
    assert found.low < value < found.high and found.confidence == 0.95


def test_the_interval_stays_inside_zero_and_one_and_narrows_with_more_images() -> None:
    none_right, all_right = proportion_interval(0.0, 20), proportion_interval(1.0, 20)
    assert none_right.low == pytest.approx(0.0) and 0.1 < none_right.high < 0.2
    assert all_right.high == 1.0 and 0.8 < all_right.low < 0.9
    widths = [proportion_interval(0.6, n).high - proportion_interval(0.6, n).low for n in (100, 500, 2000)]
    assert widths == sorted(widths, reverse=True)
    assert (proportion_interval(0.3, 0).low, proportion_interval(0.3, 0).high) == (0.0, 1.0)
    assert proportion_interval(0.632, 1000).text() == "63.2 % [60.2, 66.1]"
