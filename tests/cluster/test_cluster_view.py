"""The frontend's view of the cluster: marks that belong to one holder of an instance id, and
``snapshot`` (what the router sees, rebuilt per placement decision only where something changed:
an unchanged pool keeps its PoolSnapshot object and with it the placement index built on it; an
instance whose stats changed gets a new snapshot, in a new object for its pool only; a member
that left is gone from its pool and from the reuse cache)."""
from __future__ import annotations

import pytest

from thinkserve.cluster.cluster_view import ClusterView
from thinkserve.cluster.messages import InstanceInfo, InstanceStats, Member, Membership
from thinkserve.cluster.request_state import RequestTable
from thinkserve.router.snapshot import LONG_DECODE, POOL_ROLES, PREFILL, SERVING, SHORT_DECODE


def _membership(version: int, *ids: str) -> Membership:
    return Membership(version, tuple(Member(i, "prefill", SERVING) for i in ids), ())


def test_an_id_that_rejoins_after_being_lost_or_draining_serves_again():
    view = ClusterView(RequestTable())
    view.apply_membership(_membership(1, "prefill-0", "prefill-1"))
    assert view.mark_lost("prefill-1") and not view.serving("prefill-1")
    view.mark_draining("prefill-0")
    assert not view.serving("prefill-0")
    # a membership that still lists them changes nothing: the marks stay
    view.apply_membership(_membership(2, "prefill-0", "prefill-1"))
    assert not view.serving("prefill-1") and not view.serving("prefill-0")
    # both leave, then the same ids join again (a new holder): they are placed on again
    change = view.apply_membership(_membership(3))
    assert set(change.left) == {"prefill-0", "prefill-1"}
    view.apply_membership(_membership(4, "prefill-0", "prefill-1"))
    assert view.serving("prefill-1") and view.serving("prefill-0")
    assert view.mark_lost("prefill-1")          # and can be declared lost again


IDS = {PREFILL: ("prefill-1", "prefill-0"), SHORT_DECODE: ("short_decode-0",), LONG_DECODE: ("long_decode-1", "long_decode-0")}


def membership(version, ids):
    return Membership(version, tuple(
        Member(iid, pool, SERVING, None, InstanceInfo(iid, pool, POOL_ROLES[pool], "node0", "", 100, 16, 4096))
        for pool, names in ids.items() for iid in names), ())


def test_snapshot_reuses_what_did_not_change():
    view = ClusterView(RequestTable())
    view.apply_membership(membership(1, IDS))
    for pool, names in IDS.items():
        for iid in names:
            view.record_stats(iid, InstanceStats(iid, num_free_blocks=90, num_total_blocks=100))
    a = view.snapshot()
    # pools list their instances by id, whatever the membership order
    assert [i.instance_id for i in a.pool(PREFILL).instances] == ["prefill-0", "prefill-1"]
    assert [i.instance_id for i in a.pool(LONG_DECODE).instances] == ["long_decode-0", "long_decode-1"]
    b = view.snapshot()
    assert all(b.pool(p) is a.pool(p) for p in IDS)              # nothing changed: the same objects
    view.record_stats("long_decode-1", InstanceStats("long_decode-1", num_waiting=3, num_free_blocks=40,
                                                     num_total_blocks=100))
    c = view.snapshot()
    assert c.pool(PREFILL) is a.pool(PREFILL) and c.pool(SHORT_DECODE) is a.pool(SHORT_DECODE)
    longs = c.pool(LONG_DECODE)
    assert longs is not a.pool(LONG_DECODE)
    assert longs.instances[0] is a.pool(LONG_DECODE).instances[0]        # its unchanged instance too
    assert (longs.instances[1].num_waiting, longs.instances[1].num_free_blocks) == (3, 40)
    # a member leaves: gone from its pool, and its cached snapshot is dropped
    view.apply_membership(membership(2, {**IDS, PREFILL: ("prefill-0",)}))
    d = view.snapshot()
    assert [i.instance_id for i in d.pool(PREFILL).instances] == ["prefill-0"]
    assert d.pool(LONG_DECODE) is longs
    assert "prefill-1" not in view._inst_snaps


def _fresh(view: ClusterView) -> ClusterView:
    """A new view over the same state, which builds its snapshot from scratch."""
    fresh = ClusterView(view.table)
    fresh.members.update(view.members)
    fresh.stats.update(view.stats)
    fresh.draining |= view.draining
    fresh.lost |= view.lost
    return fresh


@pytest.mark.parametrize("seed", range(4))
def test_incremental_snapshot_equals_one_built_from_scratch(seed):
    """Random stats, membership (joins, leaves, pool changes, draining) and placement changes,
    one to three at a time: after each, the incremental snapshot equals a fresh view's, pools
    untouched since the previous snapshot keep their object (and the placement index built on it),
    a pool's index patched for replaced instances equals one built anew, and the reuse cache
    holds members only."""
    import random

    from thinkserve.cluster.request_state import DECODE, PREFILL as PREFILL_PHASE, RESERVE, RequestState
    from thinkserve.router.snapshot import ServingIndex
    from thinkserve.workers.sampling_params import SamplingParams

    from test_request_state import ByteTokenizer

    rng = random.Random(seed)
    pools = (PREFILL, SHORT_DECODE, LONG_DECODE)
    ids = [f"i{k:02d}" for k in range(24)]
    table = RequestTable()
    view = ClusterView(table)
    pool_of = {iid: rng.choice(pools) for iid in ids}
    # batch caps (0: unknown): per instance, or one for all (as pools of one engine config report)
    caps = {iid: rng.choice((0, 1, 2, 4)) if seed < 2 else 3 for iid in ids}
    present = set(rng.sample(ids, 16))
    version = 0

    def publish():
        nonlocal version
        version += 1
        view.apply_membership(Membership(version, tuple(
            Member(iid, pool_of[iid], SERVING if rng.random() < 0.9 else "draining", None,
                   InstanceInfo(iid, pool_of[iid], POOL_ROLES[pool_of[iid]], f"node{k % 3}", "", 100, 16, 4096,
                                max_num_seqs=caps[iid]))
            for k, iid in enumerate(sorted(present))), ()))

    publish()
    parts = []
    prev = view.snapshot()
    for step in range(400):
        touched_pools = set()
        for _ in range(rng.randint(1, 3)):
            what = rng.random()
            if what < 0.4 and present:           # a poll lands
                iid = rng.choice(sorted(present))
                view.record_stats(iid, InstanceStats(iid, num_waiting=rng.randint(0, 3),
                                                     num_free_blocks=rng.randint(0, 100), num_total_blocks=100,
                                                     queued_prefill_tokens=rng.randint(0, 50),
                                                     num_running_seqs=rng.randint(0, 4)))
                touched_pools.add(pool_of[iid])
            elif what < 0.55:                     # join, leave, or move to another pool
                held = [i for i in sorted(present) if not view.serving(i)]
                iid = held[0] if held and rng.random() < 0.7 else rng.choice(ids)   # marks do not pile up
                touched_pools.add(pool_of[iid])
                if iid in present and rng.random() < 0.5:
                    present.discard(iid)
                else:
                    present.add(iid)
                    pool_of[iid] = rng.choice(pools)
                    touched_pools.add(pool_of[iid])
                touched_pools.update(pools)       # a membership may redraw every member's state
                publish()
            elif what < 0.6 and any(map(view.serving, present)):   # a serving one marked draining or lost
                iid = rng.choice([i for i in sorted(present) if view.serving(i)])
                (view.mark_draining if rng.random() < 0.5 else view.mark_lost)(iid)
                touched_pools.add(pool_of[iid])
            elif what < 0.85 and present:         # a part placed
                iid = rng.choice(sorted(present))
                req = RequestState(f"r{step}", tuple(range(rng.randint(1, 40))),
                                   SamplingParams(n=rng.randint(1, 3), max_tokens=8), 0, ByteTokenizer())
                phase = rng.choice((PREFILL_PHASE, DECODE, RESERVE))
                parts.append((req, table.new_part(req, iid, range(req.params.n), phase)))
                touched_pools.add(pool_of[iid])
            elif what < 0.9 and parts:            # a prompt computed (no longer queued), a branch finished
                req, part = rng.choice(parts)
                part.prefilled.set()
                for b in rng.sample(part.branches, rng.randint(0, len(part.branches))):
                    req.branches[b].apply(0, (), "stop")
                touched_pools.add(pool_of[part.instance_id])
            elif parts:                           # a part dropped
                req, part = parts.pop(rng.randrange(len(parts)))
                table.drop_part(req, part)
                touched_pools.add(pool_of.get(part.instance_id, PREFILL))
        snap = view.snapshot()
        assert snap == _fresh(view).snapshot(), step
        for i in snap.instances():       # state and queued prompt tokens, by the rules written out
            m, st = view.members[i.instance_id], view.stats.get(i.instance_id)
            assert i.state == ("draining" if m.state == SERVING and not view.serving(i.instance_id) else m.state)
            placed = sum(len(r.prompt_token_ids) for r, pt in parts
                         if pt.instance_id == i.instance_id and pt.part_id in table.parts and (
                             not pt.prefilled.is_set() if pt.phase == PREFILL_PHASE else
                             pt.phase == DECODE and not any(r.branches[b].token_ids for b in pt.branches)))
            assert i.queued_prefill_tokens == max(st.queued_prefill_tokens if st else 0, placed), step
        for p in snap.pools:      # a placement index patched from the previous one equals one built anew
            got, want = p.index, ServingIndex(p.instances)
            assert got.serving == want.serving, (step, p.name)
            assert (got.headroom, got.batch, got.freeness(3), got.least_queued, got.position, got.by_node) == \
                (want.headroom, want.batch, want.freeness(3), want.least_queued, want.position, want.by_node), (step, p.name)
            # the free batch slots too, and what placement reads of them
            assert (got.cap, [got.all_have_room(k) for k in (1, 3)], [got.has_room(k) for k in (1, 3)]) == \
                (want.cap, [want.all_have_room(k) for k in (1, 3)], [want.has_room(k) for k in (1, 3)]), (step, p.name)
            assert got.slots == want.slots, (step, p.name)
            assert got.slots == [i.free_slots for i in p.index.serving], (step, p.name)
            if want.serving:
                assert got.freest(3) == want.freest(3), (step, p.name)
            # the queue order carried through patches (the slow-store placement reads it)
            taken = set(rng.sample(range(len(want.serving)), min(2, len(want.serving))))
            assert (got.queue_order, got.least_queued_outside(taken)) == \
                (want.queue_order, want.least_queued_outside(taken)), (step, p.name)
        for p in pools:
            if p not in touched_pools:
                assert snap.pool(p) is prev.pool(p), (step, p)
        assert set(view._inst_snaps) <= set(view.members)
        prev = snap
    assert sum(len(p.instances) for p in prev.pools) == len(present)


def test_a_poll_that_changes_nothing_placement_reads_keeps_the_snapshot():
    """The frontend asks for a snapshot per decision and every instance's poll lands a new stats
    record: one that differs only in counters the snapshot does not read (tokens, steps, decode
    steps) keeps the same snapshot object, so the placement indexes built on its pools are reused;
    ``snapshot(prefix)`` is that snapshot with the prefix index, its pool lookup kept."""
    from thinkserve.router.snapshot import PrefixIndex

    view = ClusterView(RequestTable())
    view.apply_membership(membership(1, IDS))
    for names in IDS.values():
        for iid in names:
            view.record_stats(iid, InstanceStats(iid, num_free_blocks=90, num_total_blocks=100))
    a = view.snapshot()
    assert view.snapshot() is a                                     # nothing written: the same object
    view.record_stats("long_decode-1", InstanceStats("long_decode-1", num_free_blocks=90, num_total_blocks=100,
                                                     generated_tokens=7, steps=3, decode_steps=2))
    assert view.snapshot() is a                                     # written, but nothing it reads changed
    index = PrefixIndex.merged({1: frozenset({"prefill-0"})})
    b = view.snapshot(index)
    assert b.prefix is index and b.pools is a.pools and b.pool(LONG_DECODE) is a.pool(LONG_DECODE)
    view.record_stats("long_decode-1", InstanceStats("long_decode-1", num_free_blocks=89, num_total_blocks=100))
    c = view.snapshot()
    assert c is not a and c.pool(PREFILL) is a.pool(PREFILL)
    assert c.pool(LONG_DECODE).instances[1].num_free_blocks == 89
