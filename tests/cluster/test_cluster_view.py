"""The frontend's view of the membership: marks that belong to one holder of an instance id."""
from __future__ import annotations

from thinkserve.cluster.cluster_view import ClusterView
from thinkserve.cluster.messages import Member, Membership
from thinkserve.cluster.request_state import RequestTable
from thinkserve.router.snapshot import SERVING


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
