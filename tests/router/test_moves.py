"""The decisions about moving placed work, with exact expectations."""
from thinkserve.router import LeastLoadedPolicy
from thinkserve.router.moves import (DrainAction, VictimCandidate, drain_action, first_target, migration_pools,
                                     resume_pools, retry_target, victim_order)
from thinkserve.router.snapshot import (DRAINING, LONG_DECODE, MIXED, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot,
                                        PoolSnapshot)


def test_resume_pools_own_pool_then_the_other_decode_pool_then_mixed():
    assert resume_pools(SHORT_DECODE) == (SHORT_DECODE, LONG_DECODE, MIXED)
    assert resume_pools(LONG_DECODE) == (LONG_DECODE, SHORT_DECODE, MIXED)
    assert resume_pools("") == (SHORT_DECODE, LONG_DECODE, MIXED)      # not placed yet
    assert resume_pools(MIXED) == (MIXED, SHORT_DECODE, LONG_DECODE)
    assert migration_pools(MIXED, colocated=True) == (MIXED, MIXED, SHORT_DECODE, LONG_DECODE)
    assert migration_pools(LONG_DECODE, colocated=False) == (LONG_DECODE, SHORT_DECODE, MIXED)


def _inst(iid, pool, branches=0, state="serving", free=10):
    return InstanceSnapshot(iid, pool, state, num_free_blocks=free, num_total_blocks=10, assigned_branches=branches)


def test_first_target_walks_the_pools_in_order_and_skips_excluded_and_draining():
    snap = ClusterSnapshot((PoolSnapshot(SHORT_DECODE, (_inst("s0", SHORT_DECODE), _inst("s1", SHORT_DECODE, state=DRAINING))),
                            PoolSnapshot(LONG_DECODE, (_inst("l0", LONG_DECODE, 3), _inst("l1", LONG_DECODE, 1)))))
    pick = LeastLoadedPolicy().pick_target
    p = lambda insts, ex: pick(insts, exclude=ex)  # noqa: E731
    assert first_target(snap, resume_pools(SHORT_DECODE), frozenset(), p).instance_id == "s0"
    assert first_target(snap, resume_pools(SHORT_DECODE), frozenset({"s0"}), p).instance_id == "l1"
    assert first_target(snap, resume_pools(SHORT_DECODE), frozenset({"s0", "l0", "l1"}), p) is None


def test_retry_target_gives_up_after_three_attempts_or_without_a_candidate():
    c = _inst("d1", SHORT_DECODE)
    assert retry_target(1, c) == "d1"
    assert retry_target(2, c) == "d1"
    assert retry_target(3, c) is None
    assert retry_target(1, None) is None


def test_a_refusal_for_room_is_no_failure_and_counts_toward_no_limit():
    c = _inst("d1", SHORT_DECODE)
    assert retry_target(3, c, no_room=True) == retry_target(30, c, no_room=True) == "d1"
    assert retry_target(3, None, no_room=True) is None      # every instance full: the sender waits


def test_drain_action():
    assert drain_action(True, peer_available=True, past_deadline=False) is DrainAction.WAIT
    assert drain_action(True, peer_available=True, past_deadline=True) is DrainAction.PARK
    assert drain_action(False, peer_available=True, past_deadline=False) is DrainAction.MIGRATE
    assert drain_action(False, peer_available=False, past_deadline=False) is DrainAction.PARK
    assert drain_action(False, peer_available=True, past_deadline=True) is DrainAction.PARK


def test_victim_order_starting_first_then_least_parts_then_newest():
    cands = [VictimCandidate("a", True, 5, 1.0), VictimCandidate("b", True, 1, 2.0),
             VictimCandidate("c", False, 0, 3.0), VictimCandidate("d", True, 1, 4.0),
             VictimCandidate("e", True, -1, 0.5)]
    assert victim_order(cands, 5) == ("c", "e", "d", "b", "a")
    assert victim_order(cands, 2) == ("c", "e")
    assert victim_order(cands, 0) == ()


def _pool(*insts):
    return PoolSnapshot(SHORT_DECODE, tuple(InstanceSnapshot(iid, SHORT_DECODE, state, num_free_blocks=100 - used,
                                                             num_total_blocks=100) for iid, used, state in insts))


def test_rebalance_moves_the_largest_part_that_narrows_the_gap_to_the_freest():
    from thinkserve.router.moves import Move, MovablePart, rebalance_moves
    pool = _pool(("a", 90, "serving"), ("b", 0, "serving"), ("c", 30, "serving"))
    parts = [MovablePart("p1", "a", 50), MovablePart("p2", "a", 30), MovablePart("p3", "a", 30),
             MovablePart("p4", "c", 10)]
    # gap a-b = 0.9: p1 (0.5 + 0.5 = 1.0) would reverse it; p2 and p3 tie, the lower id goes.
    assert rebalance_moves(pool, parts, margin=0.2) == (Move("p2", "a", "b"),)
    # then a=60 b=30 c=30: gap 0.3 > 0.2; p3 (0.6) would reverse it, nothing else fits: stop.
    assert rebalance_moves(pool, parts, margin=0.2, max_moves=3) == (Move("p2", "a", "b"),)
    assert rebalance_moves(pool, parts, margin=0.95) == ()                    # within the margin
    assert rebalance_moves(_pool(("a", 90, "serving"), ("b", 0, DRAINING)), parts, margin=0.2) == ()
    assert rebalance_moves(pool, [MovablePart("p4", "c", 10)], margin=0.2) == ()   # nothing on the busiest


def test_rebalance_to_a_new_empty_instance_moves_several_parts():
    from thinkserve.router.moves import Move, MovablePart, rebalance_moves
    pool = _pool(("old", 80, "serving"), ("new", 0, "serving"))
    parts = [MovablePart(f"p{i}", "old", 20) for i in range(4)]
    assert rebalance_moves(pool, parts, margin=0.1, max_moves=4) == (Move("p0", "old", "new"), Move("p1", "old", "new"))


def _capped(iid, pool, batch, cap, used=0):
    return InstanceSnapshot(iid, pool, num_free_blocks=100 - used, num_total_blocks=100, num_running_seqs=batch,
                            max_num_seqs=cap)


def test_first_target_prefers_an_instance_with_free_batch_slots_in_any_pool():
    from thinkserve.router import Conductor
    snap = ClusterSnapshot((PoolSnapshot(SHORT_DECODE, (_capped("s0", SHORT_DECODE, 8, 8), _capped("s1", SHORT_DECODE, 6, 8))),
                            PoolSnapshot(LONG_DECODE, (_capped("l0", LONG_DECODE, 5, 8),))))
    for policy in (LeastLoadedPolicy(), Conductor()):
        p = lambda insts, ex: policy.pick_target(insts, exclude=ex)  # noqa: E731
        # one branch: s1 has 2 slots; three branches: only l0 has room, in the next pool
        assert first_target(snap, resume_pools(SHORT_DECODE), frozenset(), p).instance_id == "s1"
        assert first_target(snap, resume_pools(SHORT_DECODE), frozenset(), p, branches=3).instance_id == "l0"
        # nine: no instance has room, so the first pool's pick (the branches wait there for a
        # slot): the Conductor's freest with a slot, the baseline's fewest assigned branches (a tie)
        got = first_target(snap, resume_pools(SHORT_DECODE), frozenset(), p, branches=9).instance_id
        assert got == ("s1" if isinstance(policy, Conductor) else "s0")
        assert first_target(snap, resume_pools(SHORT_DECODE), frozenset({"s0", "s1", "l0"}), p, branches=9) is None


def test_rebalance_moves_only_to_an_instance_with_free_batch_slots():
    from thinkserve.router.moves import Move, MovablePart, rebalance_moves
    # b is the emptiest by KV but its batch is full: c (30% used, 2 slots) is the target
    pool = PoolSnapshot(SHORT_DECODE, (_capped("a", SHORT_DECODE, 4, 8, used=90), _capped("b", SHORT_DECODE, 4, 4),
                                       _capped("c", SHORT_DECODE, 6, 8, used=30)))
    parts = [MovablePart("p1", "a", 25, branches=3), MovablePart("p2", "a", 20, branches=2),
             MovablePart("p3", "a", 10, branches=1)]
    # p1 (3 branches) does not fit c's 2 slots; p2 does; then c is full and nothing else moves
    assert rebalance_moves(pool, parts, margin=0.2, max_moves=3) == (Move("p2", "a", "c"),)
    # every other batch full: nothing moves
    full = PoolSnapshot(SHORT_DECODE, (_capped("a", SHORT_DECODE, 4, 8, used=90), _capped("b", SHORT_DECODE, 4, 4)))
    assert rebalance_moves(full, parts, margin=0.2) == ()
