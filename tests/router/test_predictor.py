"""The length predictor learns online: from prompt n-grams, from a hidden-state probe, and while
decoding (conditioning on tokens so far plus the decode probe)."""
import hashlib
import random

import pytest

from thinkserve.router.lengths import bucket_of
from thinkserve.router.predictor import (LengthFeatures, LengthPredictor, PredictorConfig, ProgressState,
                                         features_for, prompt_ngrams)

CFG = PredictorConfig()


def _stream(rng, n):
    """Prompts of 12 tokens; token 5 in them means ~20 output tokens, token 9 ~700, none ~150."""
    out = []
    for _ in range(n):
        kind = rng.choice((5, 9, 0))
        prompt = [rng.randrange(10, 60) for _ in range(12)]
        if kind:
            prompt[rng.randrange(12)] = kind
        length = {5: rng.randint(17, 30), 9: rng.randint(600, 1000), 0: rng.randint(130, 250)}[kind]
        out.append((prompt, length))
    return out


def _accuracy(pred, data, **kw):
    hits = 0
    for prompt, length in data:
        d = pred.predict(features_for(prompt, pred.config, **kw))
        hits += d.mode_bucket == bucket_of(pred.config.edges, length)
    return hits / len(data)


def test_ngrams_are_stable_and_distinct():
    a = prompt_ngrams([1, 2, 3])
    assert a == prompt_ngrams([1, 2, 3]) and len(a) == 6      # 3 unigrams, 2 bigrams, 1 trigram
    assert a != prompt_ngrams([3, 2, 1])
    assert len(prompt_ngrams(list(range(1000)))) < 3 * 66          # first and last 32 tokens only


def test_ngram_ids_are_fixed():
    """The ids are what a fitted predictor state is keyed by: a repeated n-gram counts once, and
    the ids themselves never change (these are the values every earlier version produced)."""
    assert prompt_ngrams([5, 5, 5, 9, 5, 5]) == (69125, 113957, 132421, 159329, 186742, 205206, 224615, 232114,
                                                 251523)
    ids = prompt_ngrams([3] * 16 + [-77] * 500 + list(range(40)))
    assert len(ids) == 108 and hashlib.sha256(repr(ids).encode()).hexdigest()[:16] == "16377866f5545600"


def test_cold_start_is_the_prior_and_learning_beats_it():
    rng = random.Random(0)
    train, test = _stream(rng, 600), _stream(rng, 300)
    prior = (1,) * 4 + (8,) + (1,) * 8          # the prior says 128..255
    pred = LengthPredictor(PredictorConfig(prior=prior))
    d0 = pred.predict(features_for(train[0][0], pred.config))
    assert d0.probs == pytest.approx(tuple(p / 20 for p in prior))
    cold = _accuracy(pred, test)
    assert 0.2 < cold < 0.45                     # right only on the unmarked third
    for prompt, length in train:
        pred.observe(features_for(prompt, pred.config), length)
    learned = _accuracy(pred, test)
    assert learned >= cold + 0.5 and learned > 0.9, (cold, learned)
    assert pred.observed == 600


def test_prompt_length_only_cannot_tell_these_apart():
    rng = random.Random(1)
    train, test = _stream(rng, 600), _stream(rng, 300)
    pred = LengthPredictor(PredictorConfig(use_ngrams=False))
    for prompt, length in train:
        pred.observe(features_for(prompt, pred.config), length)
    assert _accuracy(pred, test) < 0.5           # every prompt is 12 tokens: only the marginal is left


def test_hidden_state_probe_learns_what_the_prompt_does_not_say():
    rng = random.Random(2)
    dim = 16
    dirs = {b: [rng.gauss(0, 1) for _ in range(dim)] for b in (1, 5, 7)}   # one direction per length class

    def sample():
        b = rng.choice((1, 5, 7))
        length = {1: 20, 5: 300, 7: 1500}[b]
        hidden = [x + rng.gauss(0, 0.3) for x in dirs[b]]
        return LengthFeatures(8, (), None, None, tuple(hidden)), length

    without, with_probe = LengthPredictor(PredictorConfig(use_hidden=False)), LengthPredictor()
    for _ in range(500):
        f, n = sample()
        without.observe(f, n)
        with_probe.observe(f, n)
    test = [sample() for _ in range(200)]
    acc = lambda p: sum(p.predict(f).mode_bucket == bucket_of(CFG.edges, n) for f, n in test) / len(test)
    assert acc(without) < 0.5 and acc(with_probe) > 0.95


def test_max_tokens_and_thinking_budget_cap_the_prediction():
    pred = LengthPredictor()
    d = pred.predict(LengthFeatures(10, max_tokens=100))
    assert d.prob_greater(100) == 0.0 and d.quantile(1.0) == 100
    d = pred.predict(LengthFeatures(10, max_tokens=10_000, thinking_budget=30))   # 30 + answer margin 64
    assert d.prob_greater(94) == 0.0 and d.cap == 94


def test_refine_conditions_on_tokens_so_far():
    pred = LengthPredictor()
    d = pred.predict(LengthFeatures(10, max_tokens=4096))
    r = pred.refine(d, ProgressState(300))
    assert sum(r.probs[:bucket_of(CFG.edges, 300)]) == 0.0
    assert r.prob_greater(299) == pytest.approx(1.0)
    assert r.median() > 300


def test_decode_probe_refines_toward_the_true_length():
    """Every request looks the same at admission; at 40 tokens the decode hidden state says
    whether it will stop at ~100 or run to ~2000. After training, refine follows it."""
    rng = random.Random(3)
    short, long_ = [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]
    pred = LengthPredictor()
    f = LengthFeatures(10, max_tokens=4096)
    for _ in range(400):
        is_long = rng.random() < 0.5
        h = tuple(x + rng.gauss(0, 0.2) for x in (long_ if is_long else short))
        n = rng.randint(1500, 2500) if is_long else rng.randint(80, 120)
        pred.observe(f, n, (ProgressState(40, h),))
    d = pred.predict(f)
    assert 0.2 < d.prob_greater(1024) < 0.8                   # the prompt cannot tell
    says_long = pred.refine(d, ProgressState(40, tuple(long_)))
    says_short = pred.refine(d, ProgressState(40, tuple(short)))
    assert says_long.prob_greater(1024) > 0.9 and says_short.prob_greater(1024) < 0.1
    # a probe state that is past its own length is not used for training
    before = pred.probe.bias[:]
    pred.observe(f, 10, (ProgressState(40, tuple(short)),))
    assert pred.probe.bias == before


def test_bad_config_and_input():
    with pytest.raises(ValueError, match="edges"):
        PredictorConfig(edges=(16, 8))
    with pytest.raises(ValueError, match="prior"):
        PredictorConfig(prior=(1.0,))
    with pytest.raises(ValueError, match="output_len"):
        LengthPredictor().observe(LengthFeatures(3), -1)


def test_fitted_state_round_trips_through_json_and_is_checked():
    import json
    cfg = PredictorConfig()
    trained = LengthPredictor(cfg)
    rng = random.Random(3)
    for i in range(200):
        short = rng.random() < 0.5
        f = features_for([1, 2, 3] if short else [7, 8, 9, 10], cfg, hidden=[rng.random(), 1.0, 0.5])
        trained.observe(f, 20 if short else 900, (ProgressState(64, (0.1, 0.2, 0.3)),) if not short else ())
    state = json.loads(json.dumps(trained.state()))        # plain JSON, no pickle
    fresh = LengthPredictor(cfg)
    fresh.load_state(state)
    assert fresh.observed == 200
    for tokens, hidden in (([1, 2, 3], None), ([7, 8, 9, 10], (0.3, 1.0, 0.5))):
        f = features_for(tokens, cfg, hidden=hidden)
        assert fresh.predict(f) == trained.predict(f)
    d = trained.predict(features_for([7, 8, 9, 10], cfg))
    assert fresh.refine(d, ProgressState(64, (0.1, 0.2, 0.3))) == trained.refine(d, ProgressState(64, (0.1, 0.2, 0.3)))
    with pytest.raises(ValueError, match="edges is"):
        LengthPredictor(PredictorConfig(edges=(16, 64, 256))).load_state(state)
    with pytest.raises(ValueError, match="format must be"):
        fresh.load_state({"format": "pickle"})
    bad = json.loads(json.dumps(state))
    bad["model"]["bias"] = bad["model"]["bias"][:3]
    with pytest.raises(ValueError, match="model: weights do not have 13 buckets"):
        fresh.load_state(bad)
    del bad["model"]
    with pytest.raises(ValueError, match="malformed"):
        fresh.load_state(bad)


def test_a_censored_step_and_the_conditional_finish_add_up_to_one_plain_step():
    """``observe_at_least(f, t)`` then ``observe(f, L, at_least=t)`` learn what ``observe(f, L)``
    does (their gradients sum to its; they differ only by the weights moving in between)."""
    cfg = PredictorConfig(learning_rate=1e-3)
    f = features_for([3, 1, 4, 1, 5, 9, 2, 6], cfg)
    plain, split, prior = LengthPredictor(cfg), LengthPredictor(cfg), LengthPredictor(cfg).predict(f).probs
    plain.observe(f, 5000)
    split.observe_at_least(f, 2049)
    split.observe(f, 5000, at_least=2049)
    a, b = plain.predict(f).probs, split.predict(f).probs
    moved = max(abs(x - y) for x, y in zip(a, prior))
    assert moved > 1e-3
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.01 * moved
    assert plain.observed == split.observed == 1
    # The censored step alone moves mass from below 2,048 to above it, in proportion.
    only = LengthPredictor(cfg)
    only.observe_at_least(f, 2049)
    p = only.predict(f)
    k = bucket_of(cfg.edges, 2049)
    assert sum(p.probs[k:]) > sum(prior[k:]) + 1e-4 and all(x < y for x, y in zip(p.probs[:k], prior[:k]))
    assert max(p.probs[k:]) == pytest.approx(min(p.probs[k:]), rel=1e-9)   # the uniform prior's shape above
    with pytest.raises(ValueError, match="at_least"):
        plain.observe(f, 100, at_least=200)
    with pytest.raises(ValueError, match="tokens"):
        plain.observe_at_least(f, -1)


def test_censored_observations_undo_survivorship_bias():
    """One kind of prompt runs 1,000-8,000 tokens. Early on, only its branches under 2,048 have
    finished (the rest still decode): fed those alone, the predictor calls the kind short; told
    also that the others passed 2,048, it says P(len > 2,048) is what it is (~2/3)."""
    rng = random.Random(3)
    lengths = [int(1000 * 8 ** rng.random()) for _ in range(400)]
    prompt = [7] * 12
    finished_only, with_running = LengthPredictor(CFG), LengthPredictor(CFG)
    f = features_for(prompt, CFG)
    for n in lengths:
        if n < 2048:
            finished_only.observe(f, n)
            with_running.observe(f, n)
        else:
            with_running.observe_at_least(f, 2049)
    truth = sum(n > 2048 for n in lengths) / len(lengths)
    assert 0.5 < truth < 0.8
    assert finished_only.predict(f).prob_greater(2048) < 0.05
    assert with_running.predict(f).prob_greater(2048) == pytest.approx(truth, abs=0.15)


def test_the_pace_shares_a_budget_of_full_steps_per_second():
    """With a clock, observations faster than ``steps_per_s`` share it: at 80 a second each step
    is scaled to ~8/80 once the window has filled, at 4 a second every step is full; without a
    clock (an offline fit) every step is full."""
    def scales(rate, seconds, cfg=PredictorConfig(steps_per_s=8.0, pace_window_s=10.0)):
        pred = LengthPredictor(cfg)
        return [pred.step_scale(i / rate) for i in range(int(rate * seconds))]
    fast, slow = scales(80.0, 60.0), scales(4.0, 60.0)
    assert fast[:8] == [1.0] * 8 and fast[-1] == pytest.approx(0.1, rel=0.03)
    assert sum(fast[-80:]) == pytest.approx(8.0, rel=0.03)        # the last second: 8 full steps' worth
    assert min(slow) == 1.0
    assert LengthPredictor().step_scale(None) == 1.0
    assert LengthPredictor(PredictorConfig(steps_per_s=None)).step_scale(5.0) == 1.0
    with pytest.raises(ValueError, match="steps_per_s"):
        PredictorConfig(steps_per_s=0.0)
    with pytest.raises(ValueError, match="pace_window_s"):
        PredictorConfig(pace_window_s=-1.0)
    with pytest.raises(ValueError, match="now"):
        LengthPredictor().step_scale(float("nan"))


def test_a_paced_step_is_a_scaled_step_and_the_unpaced_path_is_unchanged():
    """``observe(..., now=)`` takes the step ``observe`` takes, scaled by the pace: with
    ``learning_rate`` 0.2 paced to 0.5 it equals an unpaced step at learning_rate 0.1."""
    f = features_for([3, 1, 4, 1, 5, 9, 2, 6], CFG)
    paced = LengthPredictor(PredictorConfig(steps_per_s=1.0, pace_window_s=1e9))
    plain = LengthPredictor(CFG)
    paced.observe(f, 300, now=0.0)          # the first step: full
    plain.observe(f, 300)
    assert paced.predict(f).probs == plain.predict(f).probs
    paced.observe(f, 300, now=0.0)          # 2 steps in 1 s at a budget of 1: scale 0.5
    plain.model.lr = 0.1
    plain.observe(f, 300)
    assert paced.predict(f).probs == pytest.approx(plain.predict(f).probs, rel=1e-12)
    assert paced.predict(f).probs != LengthPredictor(CFG).predict(f).probs
