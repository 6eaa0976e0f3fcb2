"""Prediction error and the admission headroom that follows from it, over plain numbers."""
import math

import pytest

from pdserve.coordinator.calibration import Calibration, CalibrationConfig, ErrorTracker
from pdserve.coordinator.slo import SloTargets

BASE = SloTargets(ttft_s=2.0, tpot_s=0.25)


def fed(errors_ttft, errors_tpot=(), cfg=CalibrationConfig(min_samples=10)):
    """A calibration that saw requests predicted at 1 s / 0.1 s and observed (1 + e) times that."""
    c = Calibration(cfg)
    for e in errors_ttft:
        c.record_ttft(1.0, 1.0 + e)
    for e in errors_tpot:
        c.record_tpot(0.1, 0.1 * (1 + e))
    return c


def test_static_headroom_until_enough_samples():
    c = fed([0.5] * 9)
    assert c.targets(BASE, 0.8, 0.9) == SloTargets(1.6, 0.225)


def test_headroom_follows_the_under_prediction():
    c = fed([0.0] * 80 + [0.25] * 20, [-0.1] * 100)  # TTFT: a fifth 25% late; TPOT: always early
    t = c.targets(BASE, 0.8, 0.9)
    assert t.ttft_s == pytest.approx(2.0 / 1.25)  # the p99 error is 0.25
    assert t.tpot_s == pytest.approx(0.225)  # over-prediction never loosens the static headroom (0.9)


def test_admitting_at_the_limit_then_meets_the_target_for_the_quantile():
    errors = [i / 100 for i in range(100)]  # uniform 0..0.99 late
    c = fed(errors, cfg=CalibrationConfig(min_samples=10, quantile=99.0))
    limit = c.targets(BASE, 0.8, 0.9).ttft_s
    observed = [limit * (1 + e) for e in errors]  # every request predicted right at the limit
    assert sum(o <= BASE.ttft_s for o in observed) >= 99


def test_k_scales_and_the_floor_bounds_the_headroom():
    assert fed([0.2] * 20, cfg=CalibrationConfig(min_samples=10, k=2.0)).targets(BASE, 0.8, 0.9).ttft_s == pytest.approx(2.0 / 1.4)
    assert fed([5.0] * 20).targets(BASE, 0.8, 0.9).ttft_s == pytest.approx(1.0)  # floor 0.5


def test_bad_numbers_are_not_errors():
    t = ErrorTracker(8)
    for predicted, observed in ((None, 1.0), (0.0, 1.0), (1.0, None), (math.inf, 1.0), (1.0, math.nan)):
        t.add(predicted, observed)
    assert t.percentiles() == {"count": 0}


def test_the_window_forgets_old_errors():
    c = fed([3.0] * 20 + [0.1] * 256)
    assert c.targets(BASE, 0.95, 0.9).ttft_s == pytest.approx(2.0 / 1.1)


def test_errors_never_loosen_the_static_headroom():
    c = fed([-0.2] * 20 + [0.1] * 20)  # over-predicted, then 10% late: both within the static 20%
    assert c.targets(BASE, 0.8, 0.9).ttft_s == pytest.approx(1.6)


def test_summary_exports_errors_and_headroom():
    s = fed([0.1] * 20).summary(0.95, 0.9)
    assert s["ttft"]["error"]["count"] == 20 and s["ttft"]["error"]["p99"] == pytest.approx(0.1)
    assert s["ttft"]["headroom"] == pytest.approx(1 / 1.1, abs=1e-4) and s["tpot"] == {"error": {"count": 0}, "headroom": 0.9}


def test_errors_of_short_predictions_are_measured_against_the_floor_share_of_the_target():
    """A fixed lateness (a prompt waiting out a step in progress) is not a large relative error of
    a short prediction: predicted 0.2 s, observed 0.5 s against a 2 s target is +0.3 s of a 1 s
    scale (floor 0.5 x target), not +150%; near the limit the plain relative error counts."""
    c = Calibration(CalibrationConfig(min_samples=10))
    for _ in range(20):
        c.record_ttft(0.2, 0.5, targets=BASE)
    assert c.summary(0.8, 0.9)["ttft"]["error"]["p99"] == pytest.approx(0.3)
    assert c.targets(BASE, 0.8, 0.9).ttft_s == pytest.approx(2.0 / 1.3)
    limit = c.targets(BASE, 0.8, 0.9).ttft_s
    assert limit + 0.3 * max(limit, 0.5 * BASE.ttft_s) <= BASE.ttft_s + 1e-9  # admitted at the limit, late by as much: on time
    c.record_ttft(1.5, 1.8, targets=BASE)  # at or above the floor share: relative to the prediction
    assert c.ttft.errors[-1] == pytest.approx(0.2)


def test_ttft_and_tpot_errors_are_recorded_apart():
    """The TTFT error counts when the first token is out, the TPOT error when the request ends."""
    c = Calibration(CalibrationConfig(min_samples=10))
    for _ in range(20):
        c.record_ttft(1.0, 1.25, path="remote", targets=BASE)
    assert c.summary(0.8, 0.9)["tpot"]["error"] == {"count": 0}
    assert c.targets(BASE, 0.8, 0.9, "remote").ttft_s == pytest.approx(2.0 / 1.25)  # pooled: remote has no TPOT errors yet
    for _ in range(10):
        c.record_tpot(0.1, 0.1, path="remote", targets=BASE)
    assert c.summary(0.8, 0.9)["paths"]["remote"]["tpot"]["error"]["count"] == 10
