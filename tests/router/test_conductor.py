"""The Conductor's decisions, exactly: prefill instance by estimated TTFT (prefix hits on the
instance and in its node's store), decode pool by predicted length, decode instance by freeness,
Best-of-N spread, admission refusals with their reason, and which branch is promoted when."""
import heapq
import math
import random

import pytest

from thinkserve.router import (BranchAssignment, BranchProgress, Conductor, ConductorConfig, LengthDistribution,
                               LengthFeatures, PlacementRequest, PredictorConfig, Refusal)
from thinkserve.router.predictor import features_for
from thinkserve.router.snapshot import (LONG_DECODE, MIXED, PREFILL, SHORT_DECODE, ClusterSnapshot,
                                        InstanceSnapshot, PoolSnapshot, PrefixIndex)

EDGES = PredictorConfig().edges
NB = len(EDGES) + 1
SHORT_PRIOR = tuple(8.0 if k == 2 else 1.0 for k in range(NB))      # mostly 32..63 tokens
LONG_PRIOR = tuple(8.0 if k == 7 else 1.0 for k in range(NB))       # mostly 1024..2047


def inst(iid, pool, free=1000, node="n0", **kw):
    return InstanceSnapshot(iid, pool, num_free_blocks=free, num_total_blocks=1000, node_id=node, **kw)


def cluster(prefills=(), shorts=(), longs=(), mixed=(), prefix=PrefixIndex()):
    return ClusterSnapshot((PoolSnapshot(PREFILL, tuple(prefills)), PoolSnapshot(SHORT_DECODE, tuple(shorts)),
                            PoolSnapshot(LONG_DECODE, tuple(longs)), PoolSnapshot(MIXED, tuple(mixed))), prefix)


def conductor(prior=SHORT_PRIOR, **kw):
    return Conductor(ConductorConfig(predictor=PredictorConfig(prior=prior), **kw))


def req(prompt_len=64, **kw):
    kw.setdefault("max_tokens", 4096)
    return PlacementRequest("r", prompt_len, **kw)


BASIC = dict(shorts=[inst("s0", SHORT_DECODE), inst("s1", SHORT_DECODE)], longs=[inst("l0", LONG_DECODE)])


def test_prefill_goes_to_the_lowest_estimated_ttft():
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=4000), inst("p1", PREFILL, queued_prefill_tokens=100)],
                   **BASIC)
    # (with conditional disaggregation, idle short_decode instances would prefill it themselves)
    p = conductor(conditional_disagg=False).place(req(), snap, 0.0)
    assert p.prefill_instance == "p1"
    assert p.estimated_ttft_s == pytest.approx(0.01 + (100 + 64) * 2e-4)


def test_prefix_hits_on_the_instance_and_in_its_nodes_store():
    hashes = tuple(range(100, 164))                       # 1024 tokens = 64 blocks of 16
    p0 = inst("p0", PREFILL, queued_prefill_tokens=600, node="a")
    p1 = inst("p1", PREFILL, queued_prefill_tokens=200, node="b")
    on_p0 = PrefixIndex.merged(on_instance={h: frozenset({"p0"}) for h in hashes})
    # p0 holds the whole prompt: (600 + 0) beats p1's (200 + 1024)
    p = conductor().place(req(1024, prompt_block_hashes=hashes), cluster([p0, p1], **BASIC, prefix=on_p0), 0.0)
    assert p.prefill_instance == "p0" and p.estimated_ttft_s == pytest.approx(0.01 + 600 * 2e-4)
    # a broken chain counts only the leading blocks: p0 holds blocks 0..9 and 11..63 -> 160 tokens
    gap = PrefixIndex.merged(on_instance={h: frozenset({"p0"}) for h in hashes if h != 110})
    p = conductor().place(req(1024, prompt_block_hashes=hashes), cluster([p0, p1], **BASIC, prefix=gap), 0.0)
    assert p.prefill_instance == "p1"
    # ... unless node b's CPU store holds it all: 200 queued + 1024 loaded at 2e-5 s/token
    both = PrefixIndex.merged(on_instance={h: frozenset({"p0"}) for h in hashes if h != 110},
                              in_store={h: frozenset({"b"}) for h in hashes})
    p = conductor().place(req(1024, prompt_block_hashes=hashes), cluster([p0, p1], **BASIC, prefix=both), 0.0)
    assert p.prefill_instance == "p1" and p.estimated_ttft_s == pytest.approx(0.01 + 200 * 2e-4 + 1024 * 2e-5)


def test_decode_pool_by_predicted_length():
    snap = cluster([inst("p0", PREFILL)], **BASIC)
    short = conductor(SHORT_PRIOR).place(req(), snap, 0.0)
    long_ = conductor(LONG_PRIOR).place(req(), snap, 0.0)
    assert (short.decode_pool, short.decode[0].instance_id) == (SHORT_DECODE, "s0")
    assert (long_.decode_pool, long_.decode[0].instance_id) == (LONG_DECODE, "l0")
    assert long_.length.prob_greater(512) > 0.5 and short.predicted_len < 64
    # max_tokens caps the prediction: a long-looking request that may only write 200 tokens is short
    capped = conductor(LONG_PRIOR).place(req(max_tokens=200), snap, 0.0)
    assert capped.decode_pool == SHORT_DECODE and capped.predicted_len <= 200
    # the predictor learns: after 30 short outcomes of this prompt, a long prior is overruled
    c = conductor(LONG_PRIOR)
    f = LengthFeatures(64, (7, 8, 9))
    for _ in range(30):
        c.observe_finished(f, 40)
    assert c.place(req(features=f), snap, 0.0).decode_pool == SHORT_DECODE


def test_decode_instance_by_freeness_and_branches_spread():
    # F = (free - need) / (batch + 1); need = ceil((64 + P90 of the length) / 16) blocks
    s0 = inst("s0", SHORT_DECODE, free=500, num_running_seqs=2)
    s1 = inst("s1", SHORT_DECODE, free=1000, num_running_seqs=10)
    snap = cluster([inst("p0", PREFILL)], shorts=[s0, s1], longs=[inst("l0", LONG_DECODE)])
    assert conductor().place(req(), snap, 0.0).decode[0].instance_id == "s0"
    # reserved blocks (predicted growth of running branches) count against free
    s0r = inst("s0", SHORT_DECODE, free=500, num_running_seqs=2, reserved_blocks=450)
    snap = cluster([inst("p0", PREFILL)], shorts=[s0r, s1], longs=[inst("l0", LONG_DECODE)])
    assert conductor().place(req(), snap, 0.0).decode[0].instance_id == "s1"
    # Best-of-4 over two equal instances alternates
    snap = cluster([inst("p0", PREFILL)], **BASIC)
    p = conductor().place(req(n=4), snap, 0.0)
    assert {a.instance_id: a.branch_indices for a in p.decode} == {"s0": (0, 2), "s1": (1, 3)}


def test_fallbacks_colocated_and_wait():
    # long predicted but no long pool: short_decode
    p = conductor(LONG_PRIOR).place(req(), cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)]), 0.0)
    assert p.decode_pool == SHORT_DECODE
    # no prefill pool: colocated on the mixed instance with the lowest TTFT estimate
    snap = cluster(mixed=[inst("m0", MIXED, queued_prefill_tokens=500), inst("m1", MIXED)])
    p = conductor().place(req(n=2), snap, 0.0)
    assert (p.mode, p.prefill_instance, p.decode_pool) == ("colocated", "m1", MIXED)
    assert p.decode[0].branch_indices == (0, 1)
    # nothing serving: wait (None), not a refusal
    assert conductor().place(req(), cluster([inst("p0", PREFILL, state="draining")], **BASIC), 0.0) is None


def test_interactive_request_that_cannot_meet_ttft_is_refused_with_the_reason():
    # the short_decode instances are as busy (else one would prefill it in place: 33 ms)
    busy = dict(shorts=[inst("s0", SHORT_DECODE, queued_prefill_tokens=9000),
                        inst("s1", SHORT_DECODE, queued_prefill_tokens=9000)], longs=BASIC["longs"])
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=10_000), inst("p1", PREFILL, queued_prefill_tokens=8000)],
                   **busy)
    r = conductor().place(req(slo_class="interactive"), snap, 0.0)
    assert isinstance(r, Refusal)
    assert r.reason == ("interactive TTFT target 1000 ms cannot be met: the best prefill instance "
                        "(p1, 8000 prompt tokens queued) gives 1623 ms")
    assert r.estimated_ttft_s == pytest.approx(0.01 + 8064 * 2e-4) and r.target_s == 1.0
    # standard and batch queue instead
    assert conductor().place(req(slo_class="standard"), snap, 0.0).prefill_instance == "p1"
    assert conductor().place(req(slo_class="batch"), snap, 0.0).priority == 2
    # time already waited counts: an idle cluster, but the request arrived 0.99 s ago
    idle = cluster([inst("p0", PREFILL)], **BASIC)
    assert conductor().place(req(slo_class="interactive", arrival=10.0), idle, 10.5).priority == 0
    assert isinstance(conductor().place(req(slo_class="interactive", arrival=10.0), idle, 10.99), Refusal)


def test_interactive_refused_when_decode_tpot_cannot_be_met():
    busy = [inst("s0", SHORT_DECODE, num_running_seqs=190), inst("s1", SHORT_DECODE, num_running_seqs=200)]
    snap = cluster([inst("p0", PREFILL)], shorts=busy, longs=[inst("l0", LONG_DECODE, num_running_seqs=181)])
    r = conductor().place(req(slo_class="interactive"), snap, 0.0)
    assert isinstance(r, Refusal) and r.reason == ("interactive TPOT target 100 ms cannot be met: the short_decode "
                                                   "pool's freest instance would run 191 branches at 106 ms per token")


def test_interactive_spills_over_to_the_other_decode_pool_where_tpot_is_met():
    # short_decode would run 191 branches (106 ms > 100 ms); long_decode with 179 gives 100 ms: met
    busy = [inst("s0", SHORT_DECODE, num_running_seqs=190), inst("s1", SHORT_DECODE, num_running_seqs=200)]
    snap = cluster([inst("p0", PREFILL)], shorts=busy, longs=[inst("l0", LONG_DECODE, num_running_seqs=179),
                                                              inst("l1", LONG_DECODE, num_running_seqs=185)])
    p = conductor().place(req(slo_class="interactive"), snap, 0.0)
    assert not isinstance(p, Refusal)
    assert p.decode_pool == LONG_DECODE and [a.instance_id for a in p.decode] == ["l0"]
    # standard requests have no TPOT admission: they stay where their length puts them
    assert conductor().place(req(slo_class="standard"), snap, 0.0).decode_pool == SHORT_DECODE


def _progress(tokens, pool=SHORT_DECODE, branch=0, rid="a", instance="s0", refined=None):
    # predicted 32..63 tokens: P90 = 59, so with margin 1.5 the limit is 88.5 tokens
    length = LengthDistribution(EDGES, tuple(1.0 if k == 2 else 0.0 for k in range(NB)))
    return BranchProgress(rid, branch, pool, instance, tokens, length, prompt_len=16, refined=refined)


def test_promotion_when_a_branch_passes_its_predicted_length_by_the_margin():
    c = conductor()
    longs = [inst("l0", LONG_DECODE, free=300, num_running_seqs=1), inst("l1", LONG_DECODE, free=800,
                                                                          num_running_seqs=5)]
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)], longs=longs)
    assert c.promotions(snap, (_progress(88),)) == ()
    (p,) = c.promotions(snap, (_progress(89),))
    # it needs ceil((16 + 124) / 16) = 9 blocks: (300 - 9) / 2 > (800 - 9) / 6
    assert (p.request_id, p.branch, p.source, p.target) == ("a", 0, "s0", "l0")
    assert p.reason == "89 tokens > 1.5 x predicted P90 (88.5)"
    # already in long_decode: never; a larger margin: later
    assert c.promotions(snap, (_progress(500, pool=LONG_DECODE),)) == ()
    assert conductor(promotion_margin=3.0).promotions(snap, (_progress(120),)) == ()
    # several due: most overdue first, spread by remaining headroom, at most max_promotions
    due = (_progress(100, rid="a"), _progress(300, rid="b"), _progress(95, rid="c", branch=2), _progress(50, rid="d"))
    got = conductor(max_promotions=2).promotions(snap, due)
    assert [(p.request_id, p.branch) for p in got] == [("b", 0), ("a", 0)]
    # the reason of each move (the rule that made it due), formatted only for the branches moved
    assert [p.reason for p in got] == ["300 tokens > 1.5 x predicted P90 (88.5)", "100 tokens > 1.5 x predicted P90 (88.5)"]
    # past long_threshold before the margin (predicted 1024..2047): that rule is the reason
    long_length = LengthDistribution(EDGES, tuple(1.0 if k == 7 else 0.0 for k in range(NB)))
    (p,) = c.promotions(snap, (BranchProgress("e", 0, SHORT_DECODE, "s0", 600, long_length, prompt_len=16),))
    assert p.reason == "600 tokens > long_threshold 512"
    # no long pool serving: nothing to promote to
    assert c.promotions(cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)]), due) == ()


def test_promotion_from_refined_prediction():
    c = conductor()
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)], longs=[inst("l0", LONG_DECODE)])
    refined = LengthDistribution(EDGES, tuple(1.0 if k == 7 else 0.0 for k in range(NB)))
    (p,) = c.promotions(snap, (_progress(40, refined=refined),))
    assert p.reason.startswith("refined P(len > 512) = 1.00")


def test_classes_efforts_and_config_errors():
    c = conductor()
    assert [c.priority_of(n) for n in ("interactive", "standard", "batch")] == [0, 1, 2]
    assert [c.config.efforts.budget(e) for e in (None, "low", "medium", "high")] == [None, 256, 1024, None]
    with pytest.raises(ValueError, match="slo_class"):
        c.place(req(slo_class="urgent"), cluster(), 0.0)
    with pytest.raises(ValueError, match="reasoning_effort"):
        c.config.efforts.budget("max")
    with pytest.raises(ValueError, match="promotion_margin"):
        ConductorConfig(promotion_margin=0.5)


def test_prefix_index_counts_leading_blocks_per_holder():
    idx = PrefixIndex.merged(on_instance={1: frozenset({"a", "b", "c"}), 2: frozenset({"a", "b"}),
                                          3: frozenset({"a", "c"}), 4: frozenset({"a"})},
                             in_store={1: frozenset({"n0"})})
    assert idx.hits((1, 2, 3, 4, 5))[0] == {"a": 4, "b": 2, "c": 1}
    assert idx.hits((2, 3))[0] == {"a": 2, "b": 1}
    assert idx.hits((9, 1))[0] == {} and idx.hits(())[0] == {}
    assert idx.hits((1, 2))[1] == {"n0": 1}
    assert idx.hits((1, 2, 3)) == ({"a": 3, "b": 2, "c": 1}, {"n0": 1})     # one lookup per block for both
    assert idx.blocks[2] == (frozenset({"a", "b"}), frozenset())


def test_one_lookup_for_both_kinds_of_holder_counts_what_each_table_alone_says():
    """``PrefixIndex.hits`` (one table, one lookup per block) against the rule written out over
    the two per-kind tables: a holder counts the leading blocks it holds every one of."""
    import random
    rng = random.Random(5)

    def leading(table, hashes):
        out = {}
        for holder in set().union(*table.values()) if table else ():
            k = 0
            while k < len(hashes) and holder in table.get(hashes[k], ()):
                k += 1
            if k:
                out[holder] = k
        return out

    for _ in range(300):
        hashes = tuple(rng.sample(range(40), rng.randint(0, 12)))
        on, st = {}, {}
        for h in range(40):
            if rng.random() < 0.7:
                on[h] = frozenset(rng.sample("abcde", rng.randint(0, 3)))
            if rng.random() < 0.6:
                st[h] = frozenset(rng.sample(("n0", "n1", "n2"), rng.randint(0, 2)))
        if rng.random() < 0.3:          # a whole chain with the same holders (the ``count`` shortcut)
            for h in hashes:
                on[h], st[h] = frozenset("ab"), frozenset({"n1"})
        idx = PrefixIndex.merged(on, st)
        assert idx.hits(hashes) == (leading(on, hashes), leading(st, hashes))


def test_place_decode_at_handoff_follows_the_refined_length():
    snap = cluster([inst("p0", PREFILL)], **BASIC)
    c = conductor(SHORT_PRIOR)
    long_len = LengthDistribution(EDGES, tuple(1.0 if k == 7 else 0.0 for k in range(NB)))
    pool, decode = c.place_decode(req(n=2), snap, long_len)
    assert pool == LONG_DECODE and decode[0].instance_id == "l0" and decode[0].branch_indices == (0, 1)
    assert c.place_decode(req(), cluster([inst("p0", PREFILL)]), long_len) is None


def test_cold_start_uninformed_predictor_decodes_in_short_until_it_has_learned():
    snap = cluster([inst("p0", PREFILL)], **BASIC)
    c = Conductor(ConductorConfig(predictor=PredictorConfig(), long_threshold=64, cold_start_requests=3))
    long_req = req(features=LengthFeatures(64, (11, 12)))
    assert c.cold and c.is_long(c.predict(long_req))            # uniform prior: P(len > 64) is high ...
    assert c.place(long_req, snap, 0.0).decode_pool == SHORT_DECODE     # ... but it knows nothing yet
    for _ in range(3):
        c.observe_finished(LengthFeatures(64, (11, 12)), 3000)
    assert not c.cold and c.place(long_req, snap, 0.0).decode_pool == LONG_DECODE
    # A configured prior is information: no cold start.
    assert not conductor(LONG_PRIOR).cold
    # In short_decode, a long chain is promoted once it passes long_threshold.
    p = BranchProgress("r", 0, SHORT_DECODE, "s0", 65, LengthDistribution(EDGES, (1.0,) + (0.0,) * (NB - 1)))
    assert c.promotions(snap, (p,))[0].target == "l0"
    with pytest.raises(ValueError, match="cold_start_requests"):
        ConductorConfig(cold_start_requests=-1)


def test_ttft_cost_model_is_fitted_from_measured_prefills_and_admission_uses_it():
    c = conductor()
    prior = c.config.prefill_cost
    assert c.prefill_cost == prior                                   # before any measurement: the prior
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=2000)], **BASIC)
    big = req(2000, slo_class="interactive")
    placed = c.place(big, snap, 0.0)
    assert placed.prefill_tokens == 4000 and placed.estimated_ttft_s == pytest.approx(0.01 + 4000 * 2e-4)
    # Prefills measured 5x slower than the prior's rate: 5 ms + 1 ms per token.
    for k in range(200):
        x = 100 + 37 * (k % 50)
        c.observe_prefill(x, 0.005 + 1e-3 * x)
    for x in (500, 1000, 2000):         # the estimate tracks the measured rate (the prior pulls a little)
        assert c.prefill_cost.ttft(0, x) == pytest.approx(0.005 + 1e-3 * x, rel=0.05)
    refused = c.place(big, snap, 0.0)                                # 4000 tokens now take ~4 s > 1 s
    assert isinstance(refused, Refusal) and refused.estimated_ttft_s == pytest.approx(4.005, rel=0.03)
    # The rate changes back (a faster device, less contention): the fit follows within ~100 prefills.
    for k in range(150):
        x = 100 + 37 * (k % 50)
        c.observe_prefill(x, 0.005 + 1e-4 * x)
    for x in (500, 1000, 2000):
        assert c.prefill_cost.ttft(0, x) == pytest.approx(0.005 + 1e-4 * x, rel=0.1)
    assert not isinstance(c.place(big, snap, 0.0), Refusal)
    # Not measurements: a stalled prefill (over max_seconds) or a negative token count.
    before = c.prefill_cost
    c.observe_prefill(100, 3600.0)
    c.observe_prefill(-1, 0.1)
    assert c.prefill_cost is before and c.prefill_fit.measurements == 350


def test_serving_index_picks_what_the_freeness_rule_says_ties_included():
    """``ServingIndex.freest`` (C-level passes) against the rule written out: the highest
    (free − reserved − need) / (batch + 1), then the smaller batch, then the first listed."""
    import random

    from thinkserve.router.snapshot import DRAINING, ServingIndex
    rng = random.Random(5)
    for trial in range(600):
        common = rng.choice((1, 3, 8))          # trials 300..: one cap for every instance
        insts = tuple(inst(f"s{k}", SHORT_DECODE, free=rng.choice((100, 200, 300)), reserved_blocks=rng.choice((0, 100)),
                           num_running_seqs=rng.choice((0, 1, 3)), assigned_branches=rng.choice((0, 1, 3)),
                           max_num_seqs=rng.choice((0, 1, 3, 8)) if trial < 300 else common,
                           state=DRAINING if rng.random() < 0.2 else "serving") for k in range(rng.randint(1, 9)))
        idx = ServingIndex(insts)
        if not idx.serving:
            continue
        need = rng.choice((0, 50, 150, 400))

        # a full batch (cap 1 or 3 reached) is no target while another instance has a slot
        some_slot = any(i.max_num_seqs == 0 or max(i.num_running_seqs, i.assigned_branches) < i.max_num_seqs
                        for i in idx.serving)

        def key(pos):
            i = idx.serving[pos]
            b = max(i.num_running_seqs, i.assigned_branches)
            full = some_slot and 0 < i.max_num_seqs <= b
            return (full, -(i.num_free_blocks - i.reserved_blocks - need) / (b + 1), b, pos)
        assert idx.freest(need) == min(range(len(idx.serving)), key=key)
        assert idx.slots == [i.free_slots for i in idx.serving]
        for n in (1, 2, 4):
            assert idx.all_have_room(n) == all(i.free_slots >= n for i in idx.serving)
            assert idx.has_room(n) == (sum(i.free_slots for i in idx.serving) >= n)
        assert [i.instance_id for i in idx.serving] == [i.instance_id for i in insts if i.state == "serving"]


def test_spread_equals_a_full_heap_over_every_instance():
    """``spread`` keeps only the n freest instances (ties at the n-th included) in its heap: the
    same choices as a heap over the whole pool, on pools full of ties."""
    import heapq
    import random

    from thinkserve.router.snapshot import ServingIndex

    def full_heap(n, idx, need):
        # an instance without a free batch slot (its cap less its batch, counting this decision's
        # branches) comes after every one with a slot
        caps = [i.max_num_seqs or 10**9 for i in idx.serving]
        heap = [(b >= caps[pos], -(f - need) / (b + 1), b, pos, f)
                for pos, (f, b) in enumerate(zip(idx.headroom, idx.batch))]
        heapq.heapify(heap)
        chosen = {}
        for branch in range(n):
            _, _, b, pos, f = heapq.heappop(heap)
            chosen.setdefault(pos, []).append(branch)
            f -= need
            heapq.heappush(heap, (b + 1 >= caps[pos], -(f - need) / (b + 2), b + 1, pos, f))
        return [(idx.serving[pos].instance_id, tuple(bs)) for pos, bs in chosen.items()]

    rng = random.Random(3)
    c = conductor()
    for trial in range(900):
        common = rng.choice((2, 4, 6, 30))          # trials 600..: one cap for the pool
        pool = tuple(inst(f"s{k:02d}", SHORT_DECODE, free=rng.choice((100, 200, 400)),
                          num_running_seqs=rng.randrange(4), assigned_branches=rng.randrange(3),
                          max_num_seqs=0 if trial < 300 else rng.choice((0, 2, 4, 6, 30)) if trial < 600 else common)
                     for k in range(rng.randint(1, 40)))
        idx, n, need = ServingIndex(pool), rng.randint(2, 20), rng.choice((0, 10, 60))
        got, _ = c.spread(n, idx, need)
        assert [(a.instance_id, a.branch_indices) for a in got] == full_heap(n, idx, need)


def test_promotion_due_at_is_where_promotions_start():
    """``promotion_due_at`` is the first token count at which ``promotions`` moves a branch (to
    a long_decode instance with room), for every prediction (the simulator hands ``promotions``
    only branches past it)."""
    from thinkserve.router.lengths import DEFAULT_EDGES
    c = Conductor(ConductorConfig(long_threshold=1000))
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("i", SHORT_DECODE)], longs=[inst("l0", LONG_DECODE)])
    for k in range(len(DEFAULT_EDGES) + 1):
        for cap in (None, 700, 5000):
            w = [0.0] * (len(DEFAULT_EDGES) + 1)
            w[k] = 1.0
            length = LengthDistribution.from_weights(DEFAULT_EDGES, w, cap=cap)
            at = c.promotion_due_at(length)
            due = [t for t in range(0, 1100) if c.promotions(snap, (BranchProgress("r", 0, SHORT_DECODE, "i", t, length),))]
            assert due and due[0] == at and due == list(range(at, 1100))


def test_tpot_admission_uses_the_decode_model_fitted_from_measured_steps():
    from thinkserve.router.cost_fit import DecodeFitConfig
    c = conductor(decode_fit=DecodeFitConfig(decay=1.0, prior_weight=1e-9))
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=2)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=4)])
    assert c.decode_cost_of(SHORT_DECODE) == c.config.decode_cost       # the prior: 3 branches at 11.5 ms
    assert c.place(req(slo_class="interactive"), snap, 0.0).decode_pool == SHORT_DECODE
    # the instances of both decode pools report their decode steps: 40 ms + 20 ms per branch (a slow device)
    for pool in (SHORT_DECODE, LONG_DECODE):
        for steps, batch in ((12, 1), (30, 2), (9, 5)):
            c.observe_decode(pool, steps, steps * (0.04 + 0.02 * batch), steps * batch)
    assert c.decode_fit_of(SHORT_DECODE).measurements == 3
    assert c.decode_cost_of(SHORT_DECODE).tpot(3) == pytest.approx(0.1, rel=1e-6)
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=3)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=4)])
    r = c.place(req(slo_class="interactive"), snap, 0.0)
    assert isinstance(r, Refusal) and r.reason == ("interactive TPOT target 100 ms cannot be met: the short_decode "
                                                   "pool's freest instance would run 4 branches at 120 ms per token")
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=1)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=4)])
    assert c.place(req(slo_class="interactive"), snap, 0.0).decode_pool == SHORT_DECODE     # 2 branches: 80 ms


def test_each_decode_pool_is_priced_by_its_own_steps():
    """long_decode's steps read long chains' KV, so their cost per branch is many times
    short_decode's: fitted together they would price a short request's TPOT by the long chains'
    and refuse it where short_decode meets the target (the study's 10 ms SLO did)."""
    from thinkserve.router.conductor import DEFAULT_SLO_CLASSES, SLOClass
    from thinkserve.router.cost_fit import DecodeFitConfig
    classes = (SLOClass("interactive", ttft_s=1.0, tpot_s=0.012, engine_priority=0, admission=True),) + DEFAULT_SLO_CLASSES[1:]
    c = conductor(decode_fit=DecodeFitConfig(decay=1.0, prior_weight=1e-9), slo_classes=classes)
    # short_decode: 5 ms + 0.05 ms per branch; long_decode: 5 ms + 0.5 ms per branch
    for steps, batch in ((20, 10), (25, 40), (30, 80)):
        c.observe_decode(SHORT_DECODE, steps, steps * (0.005 + 0.00005 * batch), steps * batch)
        c.observe_decode(LONG_DECODE, steps, steps * (0.005 + 0.0005 * batch), steps * batch)
    assert c.decode_cost_of(SHORT_DECODE).tpot(100) == pytest.approx(0.010, rel=1e-6)
    assert c.decode_cost_of(LONG_DECODE).tpot(100) == pytest.approx(0.055, rel=1e-6)
    assert c.decode_cost_of(MIXED) == c.config.decode_cost                 # no reports: the prior
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=99)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=2)])
    assert c.place(req(slo_class="interactive"), snap, 0.0).decode_pool == SHORT_DECODE    # 100 branches: 10 ms
    # 160 branches on short_decode (13 ms) miss; long_decode with 2 more (7 ms) takes the spill-over
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=159)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=2)])
    assert c.place(req(slo_class="interactive"), snap, 0.0).decode_pool == LONG_DECODE
    # with 20 on long_decode (15.5 ms) neither meets 12 ms: refused, priced by short_decode's own model
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE, num_running_seqs=159)],
                   longs=[inst("l0", LONG_DECODE, num_running_seqs=20)])
    r = c.place(req(slo_class="interactive"), snap, 0.0)
    assert isinstance(r, Refusal) and r.reason == ("interactive TPOT target 12 ms cannot be met: the short_decode "
                                                   "pool's freest instance would run 160 branches at 13 ms per token")


def test_the_store_load_term_is_fitted_and_moves_the_prefill_off_a_slow_store():
    from thinkserve.router.cost_fit import PrefillFitConfig
    hashes = tuple(range(100, 164))                       # 1024 tokens = 64 blocks of 16
    p0 = inst("p0", PREFILL, queued_prefill_tokens=600, node="a")
    p1 = inst("p1", PREFILL, queued_prefill_tokens=200, node="b")
    prefix = PrefixIndex.merged(on_instance={h: frozenset({"p0"}) for h in hashes if h != 110},    # p0: 160 tokens
                         in_store={h: frozenset({"b"}) for h in hashes})                     # node b: all
    snap = cluster([p0, p1], **BASIC, prefix=prefix)
    c = conductor(prefill_fit=PrefillFitConfig(decay=1.0, prior_weight=1e-9))
    p = c.place(req(1024, prompt_block_hashes=hashes), snap, 0.0)
    # the prior: 200 queued + 1024 loaded at 2e-5 s/token beats 600 queued + 864 computed
    assert (p.prefill_instance, p.prefill_tokens, p.store_tokens) == ("p1", 200, 1024)
    # measured prefills: computing at 2e-4 s/token, but loading from the store at 4e-4 (a slow store)
    for tokens, store in ((300, 0), (100, 512), (500, 0), (60, 1024)):
        c.observe_prefill(tokens, 0.01 + 2e-4 * tokens + 4e-4 * store, store)
    assert c.prefill_cost.s_per_store_token == pytest.approx(4e-4, rel=1e-6)
    p = c.place(req(1024, prompt_block_hashes=hashes), snap, 0.0)
    # p1: 0.01 + 200·2e-4 + 1024·4e-4 = 0.4596 s; p0: 0.01 + (600 + 864)·2e-4 = 0.3028 s
    assert (p.prefill_instance, p.prefill_tokens, p.store_tokens) == ("p0", 1464, 0)
    assert p.estimated_ttft_s == pytest.approx(0.3028, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_a_slow_store_prefill_is_the_lowest_ttft_over_the_whole_pool(seed):
    """With the store measured slower than computing, the instances without hits are not all
    beaten by the least queued: ``_best_prefill`` takes the least queued outside the holders from
    the pool's queue order (no pass over the pool). Against every instance's estimate, written out."""
    import random

    from thinkserve.router.cost_fit import PrefillFitConfig
    rng = random.Random(seed)
    c = conductor(prefill_fit=PrefillFitConfig(decay=1.0, prior_weight=1e-9))
    for tokens, store in ((300, 0), (100, 512), (500, 0), (60, 1024)):      # store 4e-4 s/token > 2e-4
        c.observe_prefill(tokens, 0.01 + 2e-4 * tokens + 4e-4 * store, store)
    cost = c.prefill_cost
    for trial in range(40):
        pool = [inst(f"p{k:02d}", PREFILL, queued_prefill_tokens=rng.choice((0, 100, 300, 800, 2000)),
                     node=f"n{k % 4}") for k in range(24)]
        hashes = tuple(range(trial * 1000, trial * 1000 + 32))
        holders = frozenset(rng.sample([i.instance_id for i in pool], 3))
        upto = rng.randint(1, 32)
        prefix = PrefixIndex.merged(on_instance={h: holders for h in hashes[:upto]},
                                    in_store={h: frozenset({rng.choice(("n0", "n1", "n2", "n3"))}) for h in hashes})
        snap = cluster(pool, **BASIC, prefix=prefix)
        dev, store = prefix.hits(hashes)
        want = min(range(len(pool)), key=lambda k: (cost.ttft(pool[k].queued_prefill_tokens, 512,
                                                              dev.get(pool[k].instance_id, 0) * 16,
                                                              store.get(pool[k].node_id, 0) * 16), k))
        p = c.place(req(512, prompt_block_hashes=hashes), snap, 0.0)
        assert p.prefill_instance == pool[want].instance_id, trial


# ---- conditional disaggregation: a short_decode instance prefills the prompt itself ----------
# Priors: prefill 0.01 + 2e-4 s/token, TPOT 0.01 + 5e-4 s/branch, hand-off 0.005 s. A 64-token
# prompt on an idle short_decode instance: local = 0.01 + 64·2e-4 + 0.01 = 0.0328 s.
LOCAL_IDLE = 0.01 + 64 * 2e-4 + 0.01
# Only a request predicted confidently short prefills locally (P(len > 512) ≤ 0.1): this prior
# gives 0.06 (SHORT_PRIOR: 0.35).
SURE_SHORT = tuple(100.0 if k == 2 else 1.0 for k in range(NB))


def test_conditional_disaggregation_prefills_on_the_decode_instance_when_the_prefill_pool_is_queued():
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=400)], **BASIC)
    p = conductor(SURE_SHORT, conditional_disagg=True).place(req(), snap, 0.0)
    # remote: 0.01 + 464·2e-4 + 0.005 = 0.1078 s > local 0.0328 s
    assert (p.mode, p.prefill_instance, p.decode_pool) == ("local_prefill", "s0", SHORT_DECODE)
    assert p.decode == (BranchAssignment("s0", (0,)),)
    assert (p.estimated_ttft_s, p.prefill_tokens, p.store_tokens) == (pytest.approx(LOCAL_IDLE), 64, 0)
    # an idle prefill pool wins: 0.01 + 64·2e-4 + 0.005 = 0.0278 s < 0.0328 s
    p = conductor(SURE_SHORT, conditional_disagg=True).place(req(), cluster([inst("p0", PREFILL)], **BASIC), 0.0)
    assert (p.mode, p.prefill_instance, p.estimated_ttft_s) == ("disaggregated", "p0", pytest.approx(0.0228))
    # off: the prefill pool, however queued
    p = conductor(SURE_SHORT, conditional_disagg=False).place(req(), snap, 0.0)
    assert (p.mode, p.prefill_instance) == ("disaggregated", "p0")


def test_local_prefill_counts_the_decode_instances_queue_and_batch():
    # local < remote  <=>  0.005 + 2e-4·q_local + 5e-4·batch < 2e-4·q_prefill
    def mode(q_prefill, **s0):
        shorts = [inst("s0", SHORT_DECODE, **s0)]
        p = conductor(SURE_SHORT, conditional_disagg=True).place(req(), cluster([inst("p0", PREFILL, queued_prefill_tokens=q_prefill)], shorts,
                                             BASIC["longs"]), 0.0)
        return p.mode, p.prefill_instance, p.estimated_ttft_s
    assert mode(24)[:2] == ("disaggregated", "p0")
    assert mode(26) == ("local_prefill", "s0", pytest.approx(LOCAL_IDLE))
    # 10 branches decoding there: one step of them costs 5 ms more, so q_prefill must pass 50
    assert mode(49, num_running_seqs=10)[:2] == ("disaggregated", "p0")
    assert mode(51, num_running_seqs=10) == ("local_prefill", "s0", pytest.approx(LOCAL_IDLE + 10 * 5e-4))
    # 100 prompt tokens already queued there: q_prefill must pass 125
    assert mode(124, queued_prefill_tokens=100)[:2] == ("disaggregated", "p0")
    assert mode(126, queued_prefill_tokens=100) == ("local_prefill", "s0", pytest.approx(LOCAL_IDLE + 100 * 2e-4))


def test_local_prefill_counts_the_decode_instances_prefix_hits():
    hashes = tuple(range(100, 104))                        # 64 tokens = 4 blocks of 16
    on_s0 = PrefixIndex.merged(on_instance={h: frozenset({"s0"}) for h in hashes[:3]})   # 48 tokens cached on s0
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=10)], **BASIC, prefix=on_s0)
    p = conductor(SURE_SHORT, conditional_disagg=True).place(req(prompt_block_hashes=hashes), snap, 0.0)
    # local: 0.01 + 16·2e-4 + 0.01 = 0.0232 s; remote: 0.01 + 74·2e-4 + 0.005 = 0.0298 s
    assert (p.mode, p.prefill_instance, p.prefill_tokens) == ("local_prefill", "s0", 16)
    assert p.estimated_ttft_s == pytest.approx(0.0232)


def test_no_local_prefill_for_long_requests_long_prompts_or_spread_branches():
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=2000)], **BASIC)
    # predicted long: it decodes in long_decode, never prefills there
    assert conductor(LONG_PRIOR).place(req(), snap, 0.0).mode == "disaggregated"
    # a prompt past max_local_prefill_length
    assert conductor(SURE_SHORT, conditional_disagg=True, max_local_prefill_length=63).place(req(), snap, 0.0).mode == "disaggregated"
    assert conductor(SURE_SHORT, conditional_disagg=True, max_local_prefill_length=64).place(req(), snap, 0.0).mode == "local_prefill"
    # Best-of-4 spread over s0 and s1: no single instance decodes it
    assert conductor(SURE_SHORT, conditional_disagg=True).place(req(n=4), snap, 0.0).mode == "disaggregated"
    # ... with one short_decode instance it prefills there once for all four branches
    one = cluster([inst("p0", PREFILL, queued_prefill_tokens=2000)], [inst("s0", SHORT_DECODE)], BASIC["longs"])
    p = conductor(SURE_SHORT, conditional_disagg=True).place(req(n=4), one, 0.0)
    assert (p.mode, p.prefill_instance, p.decode) == ("local_prefill", "s0", (BranchAssignment("s0", (0, 1, 2, 3)),))


def test_a_local_prefill_meets_a_ttft_target_the_prefill_pool_cannot():
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=10_000)], **BASIC)
    p = conductor(SURE_SHORT, conditional_disagg=True).place(req(slo_class="interactive"), snap, 0.0)
    assert (p.mode, p.prefill_instance, p.estimated_ttft_s) == ("local_prefill", "s0", pytest.approx(LOCAL_IDLE))
    assert isinstance(conductor(SURE_SHORT, conditional_disagg=False).place(req(slo_class="interactive"), snap, 0.0), Refusal)


def test_the_handoff_time_is_fitted_and_moves_the_decision():
    c = conductor(SURE_SHORT, conditional_disagg=True)
    assert c.handoff_s == 0.005
    # one measured hand-off of 45 ms against the prior's weight of one: (0.005 + 0.045) / 2
    c.observe_handoff(0.045)
    assert c.handoff_s == pytest.approx(0.025)
    c.observe_handoff(61.0)                                         # a stall is not a measurement
    assert c.handoff_s == pytest.approx(0.025) and c.handoff_fit.measurements == 1
    # the idle prefill pool (0.0228 s) now loses to the idle decode instance: 0.0228 + 0.025 > 0.0328
    p = c.place(req(), cluster([inst("p0", PREFILL)], **BASIC), 0.0)
    assert (p.mode, p.prefill_instance) == ("local_prefill", "s0")


def test_only_a_confidently_short_request_prefills_locally():
    snap = cluster([inst("p0", PREFILL, queued_prefill_tokens=400)], **BASIC)
    assert conductor(SURE_SHORT, conditional_disagg=True).place(req(), snap, 0.0).mode == "local_prefill"
    # P(len > 512) = 0.35: short_decode, but through the prefill pool (re-predicted at hand-off)
    p = conductor(SHORT_PRIOR).place(req(), snap, 0.0)
    assert (p.mode, p.prefill_instance, p.decode_pool) == ("disaggregated", "p0", SHORT_DECODE)
    assert p.length.prob_greater(512) == pytest.approx(0.35, abs=1e-3)
    assert conductor(SHORT_PRIOR, conditional_disagg=True, local_max_long_probability=0.35).place(req(), snap, 0.0).mode == "local_prefill"


def test_prefills_on_decode_instances_are_fitted_apart_and_move_the_decision():
    from thinkserve.router.cost_fit import PrefillFitConfig
    c = conductor(SURE_SHORT, conditional_disagg=True, prefill_fit=PrefillFitConfig(decay=1.0, prior_weight=1e-9))
    queued = lambda q: cluster([inst("p0", PREFILL, queued_prefill_tokens=q)], **BASIC)     # noqa: E731
    # the prior: local 0.0328 s < remote 0.01 + 164·2e-4 + 0.005 = 0.0478 s
    p = c.place(req(), queued(100), 0.0)
    assert (p.mode, p.decode_step_s) == ("local_prefill", pytest.approx(0.01))
    # measured on the decode instance: 50 ms fixed (behind its batch's step, at its CPU share),
    # 2e-4 s/token, beyond the 10 ms decode step each estimate counted
    for tokens in (64, 128, 200):
        c.observe_local_prefill(tokens, 0.05 + 2e-4 * tokens + 0.01, 0, 0.01)
    assert c.local_prefill_fit.model.fixed_s == pytest.approx(0.05, rel=1e-6)
    assert c.prefill_fit.measurements == 0                     # the prefill pool's model is apart
    # local now 0.05 + 64·2e-4 + 0.01 = 0.0728 s: the prefill pool wins at 100 queued tokens ...
    assert c.place(req(), queued(100), 0.0).mode == "disaggregated"
    # ... not at 400 (0.1078 s)
    p = c.place(req(), queued(400), 0.0)
    assert (p.mode, p.estimated_ttft_s) == ("local_prefill", pytest.approx(0.0728, rel=1e-6))


def test_the_pools_asked_for_prefix_reports_are_those_a_prompt_can_prefill_in():
    # the cluster's polls and the simulator's ask only these instances for their prefix caches
    assert conductor().prefix_pools == (PREFILL, MIXED)
    # a local prefill's estimate counts the short_decode instance's own hits
    assert conductor(conditional_disagg=True).prefix_pools == (PREFILL, MIXED, SHORT_DECODE)


def test_a_first_token_refits_the_model_its_placement_mode_was_estimated_by():
    # the one dispatch the cluster's orchestrator and the simulator's driver call
    from thinkserve.router import COLOCATED, DISAGGREGATED, LOCAL_PREFILL, Placement
    c = conductor(conditional_disagg=True)
    one = (BranchAssignment("d0", (0,)),)
    c.observe_first_token(Placement(COLOCATED, "m0", MIXED, one, 64, prefill_tokens=64), 0.02)
    assert (c.prefill_fit.measurements, c.local_prefill_fit.measurements) == (0, 0)
    c.observe_first_token(Placement(DISAGGREGATED, "p0", SHORT_DECODE, one, 64, prefill_tokens=64), 0.02)
    assert (c.prefill_fit.measurements, c.local_prefill_fit.measurements) == (1, 0)
    c.observe_first_token(Placement(LOCAL_PREFILL, "d0", SHORT_DECODE, one, 64, prefill_tokens=64,
                                    decode_step_s=0.01), 0.02)
    assert (c.prefill_fit.measurements, c.local_prefill_fit.measurements) == (1, 1)


# ---- batch caps: a full instance is no decode target ----------------------------------------
def capped(iid, pool, batch, cap, free=1000, **kw):
    return inst(iid, pool, free=free, num_running_seqs=batch, max_num_seqs=cap, **kw)


def test_a_full_decode_instance_is_no_target_while_another_has_a_slot():
    # s0 is the freer by KV ((1000 - need) / 5 > (500 - need) / 6) but its batch is at its cap
    snap = cluster([inst("p0", PREFILL)], shorts=[capped("s0", SHORT_DECODE, 4, 4), capped("s1", SHORT_DECODE, 5, 8,
                                                                                            free=500)],
                   longs=[inst("l0", LONG_DECODE)])
    p = conductor().place(req(), snap, 0.0)
    assert (p.decode_pool, [a.instance_id for a in p.decode]) == (SHORT_DECODE, ["s1"])
    # unknown caps (0) keep the old choice: the freest by KV
    snap = cluster([inst("p0", PREFILL)], shorts=[capped("s0", SHORT_DECODE, 4, 0), capped("s1", SHORT_DECODE, 5, 0,
                                                                                            free=500)])
    assert conductor().place(req(), snap, 0.0).decode[0].instance_id == "s0"
    # Best-of-3: s0 has 2 slots, s1 1 (freeness s0 185 > s1 160 > s0 96)
    s0, s1 = capped("s0", SHORT_DECODE, 3, 5), capped("s1", SHORT_DECODE, 3, 4, free=900)
    snap = cluster([inst("p0", PREFILL)], shorts=[s0, s1], longs=[capped("l0", LONG_DECODE, 0, 0)])
    p = conductor().place(req(n=3), snap, 0.0)
    assert {a.instance_id: a.branch_indices for a in p.decode} == {"s0": (0, 2), "s1": (1,)}


def test_a_full_short_pool_spills_to_long_decode_where_there_is_a_slot():
    shorts = [capped("s0", SHORT_DECODE, 4, 4), capped("s1", SHORT_DECODE, 9, 8)]     # s1 above its cap
    # need = 260 blocks (the prior's P90 is 4096 tokens): F(l0) = 740 / 7 < F(l1) = 740 / 3
    longs = [capped("l0", LONG_DECODE, 6, 8), capped("l1", LONG_DECODE, 2, 8)]
    snap = cluster([inst("p0", PREFILL)], shorts=shorts, longs=longs)
    p = conductor().place(req(), snap, 0.0)
    assert (p.decode_pool, [a.instance_id for a in p.decode]) == (LONG_DECODE, ["l1"])
    # the same at the hand-off (place_decode)
    assert conductor().place_decode(req(), snap, p.length) == (LONG_DECODE, (BranchAssignment("l1", (0,)),))
    # Best-of-8: short_decode has 3 slots in all, long_decode 8: all eight go to long_decode, by
    # freeness while l0 has a slot (l1 120 > l0 106 > l1 44 ...), the rest to l1's slots
    shorts3 = [capped("s0", SHORT_DECODE, 2, 4), capped("s1", SHORT_DECODE, 7, 8)]
    p = conductor().place(req(n=8), cluster([inst("p0", PREFILL)], shorts=shorts3, longs=longs), 0.0)
    assert p.decode_pool == LONG_DECODE
    assert {a.instance_id: a.branch_indices for a in p.decode} == {"l1": (0, 1, 4, 5, 6, 7), "l0": (2, 3)}
    # ... but short_decode keeps a request whose branches fit its slots: two on s0 (the freer,
    # 246 then 120 > 92), then s0 is full and the third goes to s1
    p = conductor().place(req(n=3), cluster([inst("p0", PREFILL)], shorts=shorts3, longs=longs), 0.0)
    assert p.decode_pool == SHORT_DECODE
    assert {a.instance_id: a.branch_indices for a in p.decode} == {"s0": (0, 1), "s1": (2,)}
    # every decode instance full: today's choice, the predicted pool's freest (it queues there)
    full_longs = [capped("l0", LONG_DECODE, 8, 8), capped("l1", LONG_DECODE, 8, 8)]
    p = conductor().place(req(), cluster([inst("p0", PREFILL)], shorts=shorts, longs=full_longs), 0.0)
    assert (p.decode_pool, p.decode[0].instance_id) == (SHORT_DECODE, "s0")


def test_a_request_predicted_long_spills_to_short_decode_only_if_likely_to_finish_there():
    full_longs = [capped("l0", LONG_DECODE, 8, 8)]
    shorts = [capped("s0", SHORT_DECODE, 1, 8)]
    snap = cluster([inst("p0", PREFILL)], shorts=shorts, longs=full_longs)
    # confidently long (P(len > 512) = 1): waits for a long_decode slot
    p = conductor(LONG_PRIOR).place(req(), snap, 0.0)
    assert (p.decode_pool, p.decode[0].instance_id) == (LONG_DECODE, "l0")
    # P(len > 512) = 0.4, routed long by long_probability 0.3: more likely short, so it spills
    mixed_len = LengthDistribution(EDGES, tuple(0.6 if k == 2 else 0.4 if k == 7 else 0.0 for k in range(NB)))
    c = conductor(long_probability=0.3)
    assert c.is_long(mixed_len)
    p = c.place(req(length=mixed_len), snap, 0.0)
    assert (p.decode_pool, p.decode[0].instance_id) == (SHORT_DECODE, "s0")
    # ... unless the operator allows less: spill_long_max_probability 0.3
    c = conductor(long_probability=0.3, spill_long_max_probability=0.3)
    assert c.place(req(length=mixed_len), snap, 0.0).decode_pool == LONG_DECODE
    # and a long_decode with a slot keeps it
    snap = cluster([inst("p0", PREFILL)], shorts=shorts, longs=[capped("l0", LONG_DECODE, 7, 8)])
    assert conductor(long_probability=0.3).place(req(length=mixed_len), snap, 0.0).decode_pool == LONG_DECODE
    with pytest.raises(ValueError, match="spill_long_max_probability"):
        ConductorConfig(spill_long_max_probability=1.5)


def test_the_tpot_spill_over_does_not_go_to_a_full_pool():
    # short_decode misses the TPOT target (191 branches); long_decode would meet it but is full
    busy = [inst("s0", SHORT_DECODE, num_running_seqs=190), inst("s1", SHORT_DECODE, num_running_seqs=200)]
    snap = cluster([inst("p0", PREFILL)], shorts=busy, longs=[capped("l0", LONG_DECODE, 179, 179)])
    r = conductor().place(req(slo_class="interactive"), snap, 0.0)
    assert isinstance(r, Refusal) and "short_decode pool's freest instance would run 191 branches" in r.reason


def test_promotion_skips_full_long_decode_instances():
    c = conductor()
    # l0 is the freer by KV but full; l1 has one slot: the most overdue branch goes there, the
    # next waits (no slot left anywhere)
    longs = [capped("l0", LONG_DECODE, 4, 4, free=900), capped("l1", LONG_DECODE, 3, 4, free=300)]
    snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)], longs=longs)
    due = (_progress(100, rid="a"), _progress(300, rid="b"))
    assert [(p.request_id, p.target) for p in c.promotions(snap, due)] == [("b", "l1")]
    full = [capped("l0", LONG_DECODE, 4, 4), capped("l1", LONG_DECODE, 5, 4)]
    assert c.promotions(cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)], longs=full), due) == ()


def test_pick_target_for_moved_work_skips_full_instances():
    c = conductor()
    pool = (capped("l0", LONG_DECODE, 4, 4, free=900), capped("l1", LONG_DECODE, 3, 4, free=300))
    assert c.pick_target(pool).instance_id == "l1"
    # all full: the freest (the caller's room wait holds the KV until a slot frees)
    assert c.pick_target((pool[0], capped("l1", LONG_DECODE, 4, 4, free=300))).instance_id == "l0"
def test_the_promotion_cap_grows_with_the_long_pool():
    """``promotion_cap``: ``promotions_per_long_instance`` per serving long_decode instance,
    rounded up, never under ``max_promotions``; ``promotions`` moves at most that many."""
    c = conductor(max_promotions=2, promotions_per_long_instance=0.5)
    assert [c.promotion_cap(n) for n in (0, 1, 4, 5, 6, 112)] == [2, 2, 2, 3, 3, 56]
    assert conductor().promotion_cap(14) == 8 and conductor().promotion_cap(112) == 56
    assert conductor(promotions_per_long_instance=0.0).promotion_cap(112) == 8
    due = tuple(_progress(100 + i, rid=f"r{i}") for i in range(10))
    for n_long, moved in ((4, 2), (6, 3), (20, 10)):
        snap = cluster([inst("p0", PREFILL)], shorts=[inst("s0", SHORT_DECODE)],
                       longs=[inst(f"l{i}", LONG_DECODE) for i in range(n_long)])
        got = c.promotions(snap, due)
        # the most overdue first
        assert [p.request_id for p in got] == [f"r{i}" for i in range(9, 9 - moved, -1)]
    with pytest.raises(ValueError, match="promotions_per_long_instance"):
        ConductorConfig(promotions_per_long_instance=-1.0)


def test_a_short_finish_is_learned_when_it_would_have_passed_the_threshold():
    """With the clock, a branch that ended at or below ``long_threshold`` (512 here) is held for
    (513 − tokens) x its seconds per token (at most ``max_learning_delay_s``) and learned by the
    first observation at or after that; one that passed the threshold is learned at once."""
    c = conductor(prior=None, max_learning_delay_s=100.0)
    f, g = LengthFeatures(64, (11,)), LengthFeatures(64, (12,))
    assert c.learning_delay(100, 0, 2.0) == pytest.approx(413 * 0.02)
    assert c.learning_delay(10, 0, 50.0) == 100.0                   # at most max_learning_delay_s
    assert c.learning_delay(600, 513, 12.0) == 0.0 and c.learning_delay(100, 0, None) == 0.0
    assert conductor(survivorship_delay=False).learning_delay(100, 0, 2.0) == 0.0
    start = c.predictor.predict(f).probs
    before = c.predictor.predict(f).prob_greater(512)
    c.observe_finished(f, 100, now=10.0, decode_s=2.0)              # due at 18.26 s
    assert c.held == 1 and c.predictor.observed == 0 and c.predictor.predict(f).probs == start
    c.observe_running(g, 600, now=12.0)                             # a censored step: at once, nothing released
    assert c.held == 1 and c.predictor.observed == 0
    c.observe_finished(g, 700, at_least=513, now=18.0, decode_s=14.0)
    assert c.held == 1 and c.predictor.observed == 1
    c.observe_finished(g, 900, at_least=513, now=18.3, decode_s=18.0)   # releases the held one first
    assert c.held == 0 and c.predictor.observed == 3
    assert c.predictor.predict(f).prob_greater(512) < before < c.predictor.predict(g).prob_greater(512)
    # without the clock: learned at once, one full step (as before)
    d = conductor(prior=None)
    d.observe_finished(f, 100)
    assert d.held == 0 and d.predictor.observed == 1
    # bad input raises at the call, not when a held branch is learned
    with pytest.raises(ValueError, match="at_least"):
        c.observing_finished(f, 100, at_least=200, now=20.0, decode_s=1.0)
    with pytest.raises(ValueError, match="decode_s"):
        c.observing_finished(f, 100, now=20.0, decode_s=-1.0)


def _mean_long(c, probes, threshold):
    return sum(c.predictor.predict(f).prob_greater(threshold) for f in probes) / len(probes)


def _replay(c, stream, tpot, threshold, until, every, probes, clock=True):
    """Branches of ``stream`` ((arrival, features, length)) decode at ``tpot`` from arrival: the
    Conductor hears each pass ``threshold`` and finish at its time; the mean P(len > threshold)
    of ``probes`` every ``every`` seconds."""
    events = []
    for i, (t, f, n) in enumerate(stream):
        heapq.heappush(events, (t + n * tpot, i, f, n, True))
        if n > threshold:
            heapq.heappush(events, (t + (threshold + 1) * tpot, i, f, n, False))
    learned, out, t_next = {}, [], every
    while t_next <= until:
        if events and events[0][0] <= t_next:
            t, i, f, n, finish = heapq.heappop(events)
            if finish:
                c.observe_finished(f, n, at_least=learned.pop(i, 0), now=t if clock else None,
                                   decode_s=n * tpot if clock else None)
            else:
                learned[i] = c.observe_running(f, n, t if clock else None)
        else:
            out.append(_mean_long(c, probes, threshold))
            t_next += every
    return out


def test_online_learning_is_the_same_at_8x_the_rate_and_does_not_drift_short_in_a_start_up():
    """A fitted Conductor starts taking a stream where one kind of prompt runs 1,000-8,000 tokens
    (P(len > 2,048) = 2/3) and another 20-100, at 20 and at 160 requests/s, branches decoding at
    30 ms a token. In the first 62 s only long-kind branches under 2,048 finish. Driven with the
    clock (as the simulator and the cluster do), its mean P(len > 2,048) for long-kind prompts
    stays within 0.1 of the truth, and within 0.08 between the two rates, at every 5 s (the
    slower stream's steps are 8x larger, so it is the noisier); driven without it (one full step
    per finish, as before), the 8x stream drives it under 0.1 by 40 s."""
    threshold, tpot = 2048, 0.03
    cfg = PredictorConfig()

    def draw(rng, kind):
        return int(1000 * 8 ** rng.random()) if kind == 9 else rng.randint(20, 100)

    def features(rng, kind):
        return features_for([kind] + [rng.randrange(100, 5000) for _ in range(11)], cfg, max_tokens=32768)

    fit_rng = random.Random(1)
    fitted = Conductor(ConductorConfig(predictor=PredictorConfig(learning_rate=0.02), long_threshold=threshold))
    for _ in range(4000):
        kind = fit_rng.choice((5, 9))
        fitted.observe_finished(features(fit_rng, kind), draw(fit_rng, kind))
    state = fitted.predictor.state()
    probes = [features(random.Random(s), 9) for s in range(2, 22)]
    truth = 1 - math.log(2.048) / math.log(8)       # log-uniform over 1,000 x 8^[0, 1)
    assert 0.6 < truth < 0.7

    def stream(rate):
        rng, out, t = random.Random(7), [], 0.0
        while t < 100.0:
            t += rng.expovariate(rate)
            kind = rng.choice((5, 9))
            out.append((t, features(rng, kind), draw(rng, kind)))
        return out

    def run(arrivals, clock):
        c = Conductor(ConductorConfig(long_threshold=threshold))
        c.predictor.load_state(state)
        return _replay(c, arrivals, tpot, threshold, 100.0, 5.0, probes, clock)

    start = Conductor(ConductorConfig(long_threshold=threshold))
    start.predictor.load_state(state)
    assert _mean_long(start, probes, threshold) == pytest.approx(truth, abs=0.1)
    eightfold = stream(160.0)
    slow, fast = run(stream(20.0), True), run(eightfold, True)
    assert all(abs(p - truth) < 0.1 for p in slow + fast), (slow, fast)
    assert max(abs(a - b) for a, b in zip(slow, fast)) < 0.08, (slow, fast)
    unpaced = run(eightfold, False)
    assert min(unpaced[:8]) < 0.1, unpaced
