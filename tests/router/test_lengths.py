"""Length distributions over log buckets: quantiles, conditioning, capping, Bayes updates."""
import pytest

from thinkserve.router.lengths import DEFAULT_EDGES, LengthDistribution, bucket_of, log_edges

EDGES = (10, 20, 40)          # buckets [0,10) [10,20) [20,40) [40,80)


def test_buckets_and_edges():
    assert DEFAULT_EDGES[0] == 16 and DEFAULT_EDGES[-1] == 32768 and len(DEFAULT_EDGES) == 12
    assert [bucket_of(EDGES, n) for n in (0, 9, 10, 19, 20, 39, 40, 10_000)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert log_edges(16, 128) == (16, 32, 64, 128)
    with pytest.raises(ValueError):
        log_edges(0, 10)


def test_quantile_mean_and_tail():
    d = LengthDistribution(EDGES, (0.5, 0.25, 0.25, 0.0))
    # uniform over the integers of a bucket: P(len <= 9) = 0.5
    assert d.quantile(0.5) == 9 and d.quantile(0.25) == 4 and d.quantile(0.875) == 29
    assert d.mean() == pytest.approx(0.5 * 4.5 + 0.25 * 14.5 + 0.25 * 29.5)
    assert d.prob_greater(19) == pytest.approx(0.25)
    assert d.prob_greater(29) == pytest.approx(0.25 * 10 / 20)
    assert d.mode_bucket == 0
    with pytest.raises(ValueError):
        LengthDistribution(EDGES, (1.0,))


def test_at_least_drops_what_is_already_passed():
    d = LengthDistribution(EDGES, (0.5, 0.25, 0.25, 0.0))
    c = d.at_least(15)          # half of bucket 1 stays, bucket 0 goes
    assert c.probs == pytest.approx((0.0, 0.125 / 0.375, 0.25 / 0.375, 0.0))
    assert c.floor == 15 and c.quantile(0.0) == 15 and c.prob_greater(14) == pytest.approx(1.0)
    assert d.at_least(100).probs == (0.0, 0.0, 0.0, 1.0)   # past everything: the open bucket


def test_at_most_moves_the_tail_onto_the_cap():
    d = LengthDistribution(EDGES, (0.25, 0.25, 0.25, 0.25))
    c = d.at_most(15)
    assert c.probs == pytest.approx((0.25, 0.75, 0.0, 0.0)) and c.quantile(1.0) == 15 and c.prob_greater(15) == 0
    assert c.at_least(30).floor == 15          # a branch past max_tokens stops at it
    assert d.times((1, 0, 0, 1)).probs == pytest.approx((0.5, 0, 0, 0.5))


def test_quantile_skips_empty_buckets_at_every_level():
    d = LengthDistribution(EDGES, (0.0, 0.5, 0.0, 0.5))
    assert d.quantile(0.0) == 10                 # the first bucket with mass, not bucket 0
    assert d.quantile(0.5) == 19                 # bucket 1 reaches 0.5 exactly: its top
    assert d.quantile(0.5000001) == 40           # bucket 2 is empty: straight to bucket 3
    assert d.quantile(1.0) == 79
    assert LengthDistribution(EDGES, (0.0, 0.0, 0.0, 0.0)).quantile(0.3) == 79    # no mass: the top
