"""The frontend's per-branch token bookkeeping: deltas placed by position, sent exactly once."""
import time

from thinkserve.cluster.messages import BranchDelta
from thinkserve.cluster.request_state import BranchState, RequestState
from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
from thinkserve.workers.sampling_params import SamplingParams


class ByteTokenizer:
    def decode(self, ids):
        return bytes(ids).decode(errors="replace")

    def incremental_decoder(self):
        tok = self

        class Dec:
            def __init__(self):
                self.ids = []

            def add(self, new):
                before = tok.decode(self.ids)
                self.ids += list(new)
                return tok.decode(self.ids)[len(before):]
        return Dec()


def test_repeated_and_overlapping_deltas_are_placed_once():
    b = BranchState(0, None)
    assert b.t_first is None and b.t_finished is None
    before = time.monotonic()
    assert b.apply(0, (1, 2, 3), None)
    first = b.t_first
    assert before <= first and b.t_finished is None     # its first token's time, for its decode time
    assert not b.apply(1, (2, 3), None)         # a repeat after a move
    assert b.apply(2, (3, 4, 5), None)          # overlaps: only 4, 5 are new
    assert b.token_ids == [1, 2, 3, 4, 5]
    assert b.apply(5, (6,), "stop")
    assert b.t_first == first <= b.t_finished <= time.monotonic()


def test_early_deltas_wait_for_the_gap_and_finish_applies_at_the_end():
    b = BranchState(0, None)
    b.apply(0, (1,), None)
    assert not b.apply(3, (4, 5), "length")     # from the new instance, before the export's tokens
    assert b.token_ids == [1] and not b.finished
    assert b.extend_to([1, 2, 3])               # the export says where the old instance stopped
    assert b.token_ids == [1, 2, 3, 4, 5] and b.finish_reason == "length"
    assert not b.apply(5, (6,), None)           # nothing after a finish


def test_stale_finish_from_an_old_instance_is_ignored():
    b = BranchState(0, None)
    b.apply(0, (1, 2, 3), None)
    b.apply(0, (1,), "abort")                   # ends before our tokens: not our finish
    assert not b.finished


def test_responses_carry_each_token_once_and_final_votes():
    req = RequestState("r", (10, 11), SamplingParams(n=2, max_tokens=8, seed=1), 1, ByteTokenizer())
    req.apply((BranchDelta(0, 0, tuple(b"answer: ")), BranchDelta(1, 0, tuple(b"answer: 4"), "stop")))
    m1 = req.take_response()
    assert [(d.index, bytes(d.token_ids), d.num_tokens, d.finish_reason) for d in m1.deltas] == [
        (0, b"answer: ", 8, pb.FINISH_REASON_UNSPECIFIED), (1, b"answer: 4", 9, pb.FINISH_REASON_STOP)]
    assert req.take_response() is None
    req.apply((BranchDelta(0, 6, tuple(b": 4"), "stop"),))
    m2 = req.take_response()
    assert [(d.index, bytes(d.token_ids), d.text) for d in m2.deltas] == [(0, b"4", "4")]
    assert req.finished
    final = req.final_response()
    assert final.final.answer == "4" and final.final.votes[0].count == 2
    assert final.usage.prompt_tokens == 2 and final.usage.completion_tokens == 18


def test_finished_branches_feed_the_vote_and_cancelled_ones_end_with_abort_and_do_not_vote():
    from thinkserve.router.consensus import Consensus, WavePlan, make_rule
    rule = make_rule("unbeatable")
    req = RequestState("r", (1, 2), SamplingParams(n=4, seed=1), 0, ByteTokenizer(),
                       consensus=Consensus(4, rule, WavePlan.for_rule(4, rule, 2)))
    assert req.first_wave == (0, 1) and [req.launched(i) for i in range(4)] == [True, True, False, False]
    assert req.apply((BranchDelta(1, 0, tuple(b"answer: 7"), "stop"),))[0].launch == (2,)
    req.apply((BranchDelta(0, 0, tuple(b"<think>x"), None),))          # branch 0 half way
    d = req.apply((BranchDelta(2, 0, tuple(b"answer: 7"), "stop"),))    # 2 vs 2 to come, the tie goes to 0's answer
    assert d[0].launch == (3,) and not d[0].cancel
    d = req.apply((BranchDelta(3, 0, tuple(b"answer: 7"), "stop"),))    # 3 vs 1 to come: decided
    assert (d[0].cancel, d[0].stopped_by) == ((0,), "unbeatable") and req.finished
    req.apply((BranchDelta(0, 8, tuple(b"</think>answer: 9"), "stop"),))  # late tokens of the cancelled branch
    final = req.final_response().final
    assert [b.finish_reason for b in final.branches] == [pb.FINISH_REASON_ABORT] + [pb.FINISH_REASON_STOP] * 3
    assert (final.answer, final.cancelled_branches, final.early_stop_rule) == ("7", 1, "unbeatable")
    assert [(v.answer, v.count) for v in final.votes] == [("7", 3)] and final.branches[0].answer == ""
