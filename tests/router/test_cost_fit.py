"""The Conductor's online cost fits, with numbers worked by hand: the ridge regression toward the
prior, forgetting, a feature the measurements never vary keeping its prior coefficient, the
non-positive-cost guard, and the TTFT (store term included) and TPOT models built on it."""
import pytest

from thinkserve.router import DecodeCostModel, PrefillCostModel
from thinkserve.router.cost_fit import (DecodeCostFit, DecodeFitConfig, LinearFit, PrefillCostFit,
                                        PrefillFitConfig)


def test_ridge_toward_the_prior_worked_by_hand():
    # prior (a0, b0) = (0, 1), X = 1, w = 1, no forgetting; measurements (x, y) = (1, 3), (2, 5):
    #   [[2 + 1, 3], [3, 5 + 1]] (a, b) = (8 + 0, 13 + 1)  ->  a = 2/3, b = 2
    fit = LinearFit((0.0, 1.0), (1.0,), decay=1.0, prior_weight=1.0)
    assert fit.coefficients == (0.0, 1.0) and fit.measurements == 0
    fit.observe((1,), 3.0)
    fit.observe((2,), 5.0)
    a, b = fit.coefficients
    assert (a, b) == (pytest.approx(2 / 3), pytest.approx(2.0)) and fit.measurements == 2
    assert fit.coefficients is fit.coefficients                 # solved once per measurement


def test_forgetting_weighs_a_measurement_by_decay_per_newer_one():
    # intercept only, prior 1 worth one measurement: a = (Σ decay^(n-i) y_i + 1) / (Σ decay^(n-i) + 1)
    fit = LinearFit((1.0,), (), decay=0.5, prior_weight=1.0)
    fit.observe((), 4.0)
    assert fit.coefficients == (2.5,)                           # (4 + 1) / 2
    fit.observe((), 4.0)
    assert fit.coefficients == (pytest.approx(2.8),)             # (0.5·4 + 4 + 1) / (0.5 + 1 + 1)
    fit.observe((), 0.0)
    assert fit.coefficients == (pytest.approx(16 / 11),)         # (0.25·4 + 0.5·4 + 0 + 1) / (0.25 + 0.5 + 1 + 1)


def test_a_feature_never_varied_keeps_its_prior_and_a_cost_never_goes_negative():
    fit = LinearFit((0.01, 2e-4, 2e-5), (128.0, 128.0), decay=1.0, prior_weight=1e-9)
    for x in (100, 400, 900, 1600):
        fit.observe((x, 0), 0.005 + 1e-3 * x)
    a, b, c = fit.coefficients
    assert (a, b) == (pytest.approx(0.005, rel=1e-6), pytest.approx(1e-3, rel=1e-6)) and c == pytest.approx(2e-5)
    # measurements where more tokens take less time: the slope keeps 1e-3 of its prior
    fit = LinearFit((0.01, 2e-4), (128.0,), decay=1.0, prior_weight=1e-9)
    for x in (100, 200, 300):
        fit.observe((x,), 1.0 - 1e-3 * x)
    a, b = fit.coefficients
    assert b == pytest.approx(2e-7) and a == pytest.approx(0.8 - 2e-7 * 200, rel=1e-5)   # mean y - b·mean x
    with pytest.raises(ValueError, match="one scale"):
        LinearFit((1.0, 2.0), (), 1.0, 1.0)


def test_prefill_fit_learns_the_store_load_term_from_prefills_that_loaded_from_the_store():
    prior = PrefillCostModel(fixed_s=0.01, s_per_token=2e-4, s_per_store_token=2e-5)
    fit = PrefillCostFit(prior, PrefillFitConfig(decay=1.0, prior_weight=1e-9))
    # loading from the store measured at 5e-4 s per token (25x the prior), computing at 1e-3
    for tokens, store in ((100, 0), (300, 0), (200, 512), (50, 1024), (400, 256)):
        fit.observe(tokens, 0.005 + 1e-3 * tokens + 5e-4 * store, store)
    model = fit.model
    assert model.fixed_s == pytest.approx(0.005, rel=1e-5)
    assert model.s_per_token == pytest.approx(1e-3, rel=1e-5)
    assert model.s_per_store_token == pytest.approx(5e-4, rel=1e-5)
    assert fit.measurements == 5 and fit.model is model
    # not measurements: a stall, negative counts
    fit.observe(100, 3600.0)
    fit.observe(10, 0.1, -1)
    assert fit.model is model and fit.measurements == 5


def test_decode_fit_learns_tpot_from_mean_step_times_at_mean_batches():
    prior = DecodeCostModel(step_s=0.01, s_per_seq=5e-4)
    fit = DecodeCostFit(prior, DecodeFitConfig(decay=1.0, prior_weight=1e-9))
    assert fit.model == prior
    # reports of (steps, seconds, branches): steps at 40 ms + 12 ms per branch
    for steps, batch in ((10, 1), (20, 3), (5, 8), (8, 2)):
        fit.observe(steps, steps * (0.04 + 0.012 * batch), steps * batch)
    model = fit.model
    assert model.step_s == pytest.approx(0.04, rel=1e-5) and model.s_per_seq == pytest.approx(0.012, rel=1e-5)
    assert model.tpot(4) == pytest.approx(0.088, rel=1e-5) and fit.measurements == 4
    # every report at one batch size: the fit matches what was measured there, and the prior
    # (worth one report) says how the 40 ms beyond it split between the step and the branches
    fit = DecodeCostFit(prior, DecodeFitConfig(decay=1.0, prior_weight=1e-9))
    for _ in range(3):
        fit.observe(10, 10 * 0.05, 40)
    model = fit.model
    assert model.tpot(4) == pytest.approx(0.05, rel=1e-6) and model.s_per_seq > prior.s_per_seq
    # not measurements: no steps, fewer branches than steps, a stall
    for steps, seconds, seqs in ((0, 0.0, 0), (4, 0.1, 3), (1, 11.0, 1)):
        fit.observe(steps, seconds, seqs)
    assert fit.model is model and fit.measurements == 3
    with pytest.raises(ValueError, match="batch_scale"):
        DecodeFitConfig(batch_scale=0)
