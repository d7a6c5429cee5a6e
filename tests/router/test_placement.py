from thinkserve.router import (COLOCATED, DISAGGREGATED, BranchAssignment, ClusterSnapshot, InstanceSnapshot,
                               LeastLoadedPolicy, PlacementRequest, PoolSnapshot, spread_branches)
from thinkserve.router.snapshot import DRAINING, STARTING


def inst(iid, pool, **kw):
    return InstanceSnapshot(iid, pool, num_total_blocks=kw.pop("total", 100), num_free_blocks=kw.pop("free", 100), **kw)


def snap(*instances):
    pools = {}
    for i in instances:
        pools.setdefault(i.pool, []).append(i)
    return ClusterSnapshot(tuple(PoolSnapshot(name, tuple(ix)) for name, ix in pools.items()))


POLICY = LeastLoadedPolicy(long_threshold=512, answer_margin=32)


def test_predicted_length_uses_thinking_budget_plus_margin_capped_by_max_tokens():
    assert POLICY.predict_len(PlacementRequest("a", 10, max_tokens=300)) == 300
    assert POLICY.predict_len(PlacementRequest("a", 10, max_tokens=4096, thinking_budget=100)) == 132
    assert POLICY.predict_len(PlacementRequest("a", 10, max_tokens=50, thinking_budget=100)) == 50
    assert POLICY.decode_pool_for(PlacementRequest("a", 10, max_tokens=512)) == "short_decode"
    assert POLICY.decode_pool_for(PlacementRequest("a", 10, max_tokens=513)) == "long_decode"
    assert POLICY.decode_pool_for(PlacementRequest("a", 10, max_tokens=9000, thinking_budget=400)) == "short_decode"


def test_disaggregated_placement_picks_least_loaded_prefill_and_decode():
    s = snap(inst("p0", "prefill", assigned_requests=3), inst("p1", "prefill", assigned_requests=1),
             inst("s0", "short_decode", assigned_branches=2), inst("s1", "short_decode", assigned_branches=0),
             inst("l0", "long_decode"))
    p = POLICY.place(PlacementRequest("r", 20, max_tokens=100), s)
    assert p.mode == DISAGGREGATED
    assert p.prefill_instance == "p1"
    assert p.decode_pool == "short_decode"
    assert p.decode == (BranchAssignment("s1", (0,)),)
    assert p.predicted_len == 100


def test_long_requests_go_to_long_pool_and_fall_back_to_the_other_decode_pool():
    s = snap(inst("p0", "prefill"), inst("s0", "short_decode"), inst("l0", "long_decode"))
    assert POLICY.place(PlacementRequest("r", 5, max_tokens=2000), s).decode_pool == "long_decode"
    no_long = snap(inst("p0", "prefill"), inst("s0", "short_decode"), inst("l0", "long_decode", state=STARTING))
    p = POLICY.place(PlacementRequest("r", 5, max_tokens=2000), no_long)
    assert (p.decode_pool, p.decode) == ("short_decode", (BranchAssignment("s0", (0,)),))


def test_best_of_n_branches_spread_across_decode_instances():
    s = snap(inst("p0", "prefill"), inst("s0", "short_decode", assigned_branches=1),
             inst("s1", "short_decode"), inst("s2", "short_decode", assigned_branches=3))
    p = POLICY.place(PlacementRequest("r", 5, n=5, max_tokens=64), s)
    # s1 (0) takes 0; s0 and s1 tie at 1 -> s0 (id) takes 1; s1 takes 2; s0 / s1 at 2 -> s0 takes 3, s1 takes 4
    assert p.decode == (BranchAssignment("s1", (0, 2, 4)), BranchAssignment("s0", (1, 3)))


def test_spread_breaks_ties_by_kv_usage_then_id():
    a = inst("a", "short_decode", free=10)
    b = inst("b", "short_decode", free=90)
    assert spread_branches(1, (a, b)) == (BranchAssignment("b", (0,)),)
    assert spread_branches(2, (inst("y", "short_decode"), inst("x", "short_decode"))) == (
        BranchAssignment("x", (0,)), BranchAssignment("y", (1,)))


def test_draining_and_starting_instances_are_never_chosen():
    s = snap(inst("p0", "prefill", state=DRAINING), inst("p1", "prefill", assigned_requests=50),
             inst("s0", "short_decode", state=DRAINING), inst("s1", "short_decode", assigned_branches=9))
    p = POLICY.place(PlacementRequest("r", 5), s)
    assert (p.prefill_instance, p.decode) == ("p1", (BranchAssignment("s1", (0,)),))


def test_colocated_when_no_prefill_or_no_decode_pool_serves():
    s = snap(inst("m0", "mixed", assigned_branches=2), inst("m1", "mixed"), inst("s0", "short_decode"))
    p = POLICY.place(PlacementRequest("r", 5, n=3), s)
    assert p.mode == COLOCATED
    assert p.prefill_instance == "m1" and p.decode_pool == "mixed"
    assert p.decode == (BranchAssignment("m1", (0, 1, 2)),)


def test_nothing_serving_means_no_placement():
    assert POLICY.place(PlacementRequest("r", 5), ClusterSnapshot()) is None
    assert POLICY.place(PlacementRequest("r", 5), snap(inst("p0", "prefill"))) is None


def test_pick_target_excludes_the_source_and_non_serving():
    pool = (inst("s0", "short_decode"), inst("s1", "short_decode", assigned_branches=4),
            inst("s2", "short_decode", state=DRAINING))
    assert POLICY.pick_target(pool, exclude=frozenset({"s0"})).instance_id == "s1"
    assert POLICY.pick_target(pool).instance_id == "s0"
    assert POLICY.pick_target(pool, exclude=frozenset({"s0", "s1"})) is None
