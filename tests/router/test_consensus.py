import random

import pytest

from thinkserve.router import majority_vote
from thinkserve.router.consensus import (ADAPTIVE, DIRICHLET, ESC, NONE, UNBEATABLE, Consensus, Finished, Tally,
                                         WavePlan, make_rule, prob_leader_ahead, prob_leader_largest,
                                         regularized_beta)


def controller(n: int, rule: str, wave: int, **opts) -> Consensus:
    r = make_rule(rule, **opts)
    return Consensus(n, r, WavePlan.for_rule(n, r, wave))


# ----------------------------------------------------------------- Beta values
def _beta_cdf_numeric(x: float, a: int, b: int, steps: int = 20000) -> float:
    """I_x(a, b) by Simpson's rule over the Beta density (an independent check of the sum)."""
    def f(p):
        return p ** (a - 1) * (1 - p) ** (b - 1)

    def simpson(lo, hi):
        h = (hi - lo) / steps
        s = f(lo) + f(hi) + sum((4 if k % 2 else 2) * f(lo + k * h) for k in range(1, steps))
        return s * h / 3
    return simpson(0.0, x) / simpson(0.0, 1.0)


def test_regularized_beta_known_values():
    assert regularized_beta(0.3, 2, 3) == pytest.approx(0.3483, abs=1e-12)   # 6·.3²·.7² + 4·.3³·.7 + .3⁴
    assert regularized_beta(0.5, 1, 1) == 0.5
    assert regularized_beta(0.0, 2, 2) == 0.0 and regularized_beta(1.0, 2, 2) == 1.0
    # P(p1 > p2) = 1 − I_0.5(v1+1, v2+1): with a uniform prior and v1 = k, v2 = 0 it is 1 − 2^−(k+1)
    assert prob_leader_ahead(3, 0) == 15 / 16
    assert prob_leader_ahead(4, 0) == 31 / 32
    assert prob_leader_ahead(2, 1) == 11 / 16
    assert prob_leader_ahead(6, 1) == 247 / 256
    assert prob_leader_ahead(5, 1) == 120 / 128
    assert prob_leader_ahead(3, 3) == 0.5


@pytest.mark.parametrize("x,a,b", [(0.5, 5, 1), (0.5, 7, 3), (0.25, 3, 4), (0.8, 6, 2), (0.5, 12, 9)])
def test_regularized_beta_matches_numeric_integration(x, a, b):
    assert regularized_beta(x, a, b) == pytest.approx(_beta_cdf_numeric(x, a, b), abs=1e-9)


def test_regularized_beta_rejects_bad_arguments():
    with pytest.raises(ValueError, match="positive integers"):
        regularized_beta(0.5, 0, 2)
    with pytest.raises(ValueError, match="x must be"):
        regularized_beta(1.5, 1, 2)


def test_dirichlet_probability_is_seeded_and_sensible():
    assert prob_leader_largest([9, 1, 1]) == prob_leader_largest([9, 1, 1])
    # against 200,000-sample estimates: 0.988, 0.937, 0.501, 0.250 (the default uses 2,000 samples)
    assert prob_leader_largest([9, 1, 1]) == pytest.approx(0.988, abs=0.01)
    assert prob_leader_largest([6, 1, 1]) == pytest.approx(0.937, abs=0.015)
    assert prob_leader_largest([3, 2, 2]) == pytest.approx(0.50, abs=0.03)
    assert prob_leader_largest([2, 2, 2, 2]) == pytest.approx(0.25, abs=0.03)


# ----------------------------------------------------------------- rules on constructed sequences
def test_none_launches_everything_and_never_cancels():
    c = controller(4, NONE, wave=2)
    assert c.start().launch == (0, 1, 2, 3)
    for i in (3, 1, 0):
        d = c.on_finished(i, "7")
        assert (d.launch, d.cancel, d.skip, d.done) == ((), (), (), False)
    assert c.on_finished(2, "7").done
    assert c.cancelled == () and c.stopped_by == ""


def test_unbeatable_cancels_once_the_leader_cannot_be_overtaken():
    c = controller(5, UNBEATABLE, wave=5)
    assert c.start().launch == (0, 1, 2, 3, 4)
    assert not c.on_finished(0, "7").done        # 1 vs 4 to come
    assert not c.on_finished(2, "7").done        # 2 vs 3 to come
    d = c.on_finished(4, "7")                    # 3 vs 2 to come: decided
    assert (d.cancel, d.skip, d.stopped_by, d.done) == ((1, 3), (), UNBEATABLE, True)
    assert c.vote().answer == "7" and c.cancelled == (1, 3)


def test_unbeatable_tie_break_follows_majority_vote():
    # 1 and 3 say "a"; 0 and 2 are still running and could both say "b": b would win the tie (branch 0)
    c = controller(4, UNBEATABLE, wave=4)
    c.start()
    assert not c.on_finished(1, "a").done
    assert not c.on_finished(3, "a").done
    # 0 and 1 say "a"; 2 and 3 could tie at 2-2, but "a" holds the lower first branch: decided
    c = controller(4, UNBEATABLE, wave=4)
    c.start()
    assert not c.on_finished(0, "a").done
    d = c.on_finished(1, "a")
    assert (d.cancel, d.stopped_by) == ((2, 3), UNBEATABLE)


def test_unbeatable_counts_unlaunched_branches_and_waves_refill():
    c = controller(6, UNBEATABLE, wave=2)
    assert c.start().launch == (0, 1)
    assert c.on_finished(1, "4").launch == (2,)
    assert c.on_finished(2, "4").launch == (3,)
    # 3 vs 3 to come (0, 4, 5): a 3-3 tie would go to their answer, whose first branch is 0
    assert c.on_finished(3, "4").launch == (4,)
    d = c.on_finished(4, "4")                      # 4 vs 2 to come
    assert (d.launch, d.cancel, d.skip, d.stopped_by) == ((), (0,), (5,), UNBEATABLE)
    assert c.cancelled == (0, 5)


def test_abstaining_branches_use_up_the_budget_but_do_not_vote():
    c = controller(3, UNBEATABLE, wave=3)
    c.start()
    assert not c.on_finished(0, None).done
    assert not c.on_finished(1, None).done      # nobody answered: nothing to decide
    assert c.on_finished(2, "9").done and c.stopped_by == ""
    assert c.vote().answer == "9"
    c = controller(4, UNBEATABLE, wave=4)
    c.start()
    c.on_finished(0, "1")
    c.on_finished(1, None)
    d = c.on_finished(2, "1")                  # 2 vs the 1 branch to come
    assert d.cancel == (3,) and c.vote().answer == "1"


def test_adaptive_stops_after_four_agreeing_answers_in_waves_of_four():
    c = controller(16, ADAPTIVE, wave=4)
    assert c.start().launch == (0, 1, 2, 3)
    assert c.on_finished(2, "5").launch == (4,)
    assert c.on_finished(0, "5").launch == (5,)
    assert c.on_finished(1, "5").launch == (6,)     # P = 15/16 < 0.95
    d = c.on_finished(3, "5")                        # P = 31/32 >= 0.95
    assert (d.cancel, d.skip, d.stopped_by) == ((4, 5, 6), tuple(range(7, 16)), ADAPTIVE)
    assert len(d.cancelled) == 12


def test_adaptive_waits_while_answers_disagree():
    c = controller(16, ADAPTIVE, wave=4)
    c.start()
    seq = [(0, "5"), (1, "6"), (2, "5"), (3, "5"), (4, "5"), (5, "5"), (6, "5")]
    decisions = [c.on_finished(i, a) for i, a in seq]
    # counts 5-1 give 120/128 < 0.95 (after branch 5); 6-1 give 247/256 >= 0.95 (after branch 6)
    assert [d.done for d in decisions] == [False] * 6 + [True]
    assert decisions[-1].cancel == (7, 8, 9) and decisions[-1].skip == tuple(range(10, 16))


def test_dirichlet_uses_all_answers_when_three_or_more_differ():
    r = make_rule(DIRICHLET)
    t = Tally(16, tuple(Finished(i, a) for i, a in enumerate(["5"] * 8 + ["6", "7"])))
    assert r.should_stop(t)                 # P ≈ 0.98 (Beta on 8 vs 1 alone would say 0.99 as well)
    t = Tally(16, tuple(Finished(i, a) for i, a in enumerate(["5"] * 6 + ["6", "7"])))
    assert not r.should_stop(t)             # P ≈ 0.94 < 0.95, where Beta on 6 vs 1 says 0.965
    assert make_rule(ADAPTIVE).should_stop(t)
    t = Tally(16, tuple(Finished(i, a) for i, a in enumerate(["5", "5", "5", "6", "6", "7"])))
    assert not r.should_stop(t)
    beta = make_rule(ADAPTIVE)
    two = Tally(16, tuple(Finished(i, a) for i, a in enumerate(["5"] * 4)))
    assert r.should_stop(two) == beta.should_stop(two) is True


def test_esc_stops_when_a_whole_window_agrees():
    c = controller(16, ESC, wave=4, window=4)
    c.start()
    first = [c.on_finished(i, a) for i, a in [(0, "3"), (1, "3"), (2, "8"), (3, "3")]]
    assert not any(d.done for d in first)                     # window 1 disagrees
    second = [c.on_finished(i, "3") for i in (4, 5, 6)]
    assert not any(d.done for d in second)                    # window 2 incomplete
    d = c.on_finished(7, "3")
    assert d.stopped_by == ESC and d.cancel == (8, 9, 10) and d.skip == tuple(range(11, 16))


def test_bad_rule_and_bad_calls_are_named():
    with pytest.raises(ValueError, match="early_stop must be one of"):
        make_rule("majority")
    c = controller(2, UNBEATABLE, wave=1)
    c.start()
    with pytest.raises(ValueError, match="branch 1 is not running"):
        c.on_finished(1, "x")
    with pytest.raises(ValueError, match="weight"):
        c.on_finished(0, "x", weight=1.5)


# ----------------------------------------------------------------- the exact rule never changes the vote
@pytest.mark.parametrize("weighted", [False, True])
def test_unbeatable_never_changes_the_final_vote(weighted):
    rng = random.Random(1234)
    stopped_early = 0
    for _ in range(3000):
        n = rng.randint(1, 12)
        alphabet = ["a", "b", "c", None][:rng.randint(1, 4)]
        answers = [rng.choice(alphabet) for _ in range(n)]
        weights = [rng.choice([1.0, 0.5, 0.25, rng.uniform(0.05, 1.0)]) for _ in range(n)]
        r = make_rule(UNBEATABLE)
        c = Consensus(n, r, WavePlan.for_rule(n, r, rng.randint(1, n)), weighted=weighted)
        running = list(c.start().launch)
        while running:
            i = running.pop(rng.randrange(len(running)))
            d = c.on_finished(i, answers[i], weights[i])
            running += d.launch
            if d.done:
                assert not set(running) - set(d.cancel)
                break
        full = majority_vote(answers, weights if weighted else None)
        assert c.vote().answer == full.answer, (answers, c.finished)
        stopped_early += bool(c.stopped_by)
        finished = {f.index for f in c.finished}
        assert finished | set(c.cancelled) == set(range(n)) and not finished & set(c.cancelled)
    assert stopped_early > 500      # the property is not vacuous
