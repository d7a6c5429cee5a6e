"""The frontend's view of the cluster: marks that belong to one holder of an instance id, and
``snapshot`` (what the router sees, rebuilt per placement decision only where something changed:
an unchanged pool keeps its PoolSnapshot object and with it the placement index built on it; an
instance whose stats changed gets a new snapshot, in a new object for its pool only; a member
that left is gone from its pool and from the reuse cache)."""
from __future__ import annotations

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
