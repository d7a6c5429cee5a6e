"""The frontend's per-branch token bookkeeping: deltas placed by position, sent exactly once."""
import time

from thinkserve.cluster.messages import BranchDelta
from thinkserve.cluster.request_state import BranchState, RequestState
from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
from thinkserve.workers.sampling_params import SamplingParams
from thinkserve.workers.tokenizer import IncrementalDecoder


class ByteTokenizer:
    """Token i is byte i (a multi-byte character spans tokens); the production incremental decoder."""

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode(errors="replace")

    def incremental_decoder(self):
        return IncrementalDecoder(self)


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


def _byte_tokenizer(path):
    """The tiny models' byte-level tokenizer (``tests/tiny_llama.py``): a character may span tokens."""
    from tokenizers import Tokenizer as HFTokenizer

    from thinkserve.workers.tokenizer import Tokenizer
    from tiny_llama import EOS_ID, write_byte_tokenizer
    write_byte_tokenizer(path)
    return Tokenizer(HFTokenizer.from_file(str(path / "tokenizer.json")), eos_token_ids=(EOS_ID,))


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every token list it decodes."""

    def __init__(self, tok):
        self.tok, self.eos_token_ids, self.decoded = tok, tok.eos_token_ids, []

    def decode(self, ids, skip_special_tokens=False):
        self.decoded.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self):
        return IncrementalDecoder(self)


def test_the_final_text_is_the_streamed_decode_of_the_ids_and_costs_no_second_decode(tmp_path):
    """A Best-of-4's final text per branch equals the tokenizer's decode of its ids (EOS left out),
    whether the stream took every delta, some or none, and whether the vote read it first; and
    building the final decodes only a window at the end of each branch, not its whole text."""
    import random
    base = _byte_tokenizer(tmp_path)
    eos = base.eos_token_ids[0]
    rng = random.Random(7)
    text_ids = [i for i in range(base.vocab_size) if i != eos]      # bytes, <think>, </think>
    words = ("12", " +", " 7", " =", " 19", ". ", "naïve", " café", " 🙂", "<think>", "</think>", " answer:", "\n")
    for trial in range(60):
        tok = CountingTokenizer(base)
        req = RequestState("r", (5, 6), SamplingParams(n=4, max_tokens=400, seed=1), 0, tok)
        if trial < 20:      # any token sequence: invalid UTF-8 anywhere
            ids = {i: [rng.choice(text_ids) for _ in range(rng.randint(0, 120))] for i in range(4)}
        else:               # what a model writes: text, a character may span tokens
            ids = {i: base.encode("".join(rng.choice(words) for _ in range(rng.randint(0, 40))),
                                  add_special_tokens=False) for i in range(4)}
        for i in ids:
            if rng.random() < 0.7:
                ids[i].append(eos)               # EOS ends it
        # raw bytes cut mid-character at the end of one branch: the held-back tail still counts
        if trial % 3 == 0:
            ids[1] = ids[1][:-1] + base.encode("é🙂", add_special_tokens=False)[:1]
        pos = {i: 0 for i in ids}
        streamed = {i: "" for i in ids}
        while any(pos[i] < len(ids[i]) for i in ids):
            i = rng.choice([i for i in ids if pos[i] < len(ids[i])])
            k = rng.randint(1, 9)
            chunk = ids[i][pos[i]:pos[i] + k]
            done = pos[i] + len(chunk) == len(ids[i])
            req.apply((BranchDelta(i, pos[i], tuple(chunk), "stop" if done else None),))
            pos[i] += len(chunk)
            if rng.random() < 0.5:
                msg = req.take_response()
                for d in (msg.deltas if msg else ()):
                    streamed[d.index] += d.text
            if rng.random() < 0.2:
                req.answer_of(i)                 # the vote reads a branch's text mid-stream
        if trial % 2:
            msg = req.take_response()           # what the frontend does before the final
            for d in (msg.deltas if msg else ()):
                streamed[d.index] += d.text
        # what the final may decode: for a branch whose last characters are held back, its short
        # window at the end (up to 5 tokens of context, then the held-back ones), nothing else
        held = [b.decoder for b in req.branches if b.decoded_tokens == len(b.token_ids)
                and b.decoder._read < len(b.decoder.token_ids)]
        windows = sorted(n for d in held for n in (d._read - d._prefix, len(d.token_ids) - d._prefix))
        tok.decoded.clear()
        final = req.final_response().final
        for b in final.branches:
            want = base.decode([t for t in ids[b.index] if t != eos])
            assert b.text == want, (trial, b.index)
            assert list(b.token_ids) == ids[b.index]
            if trial % 2:
                assert want.startswith(streamed[b.index])       # the stream sent all but a held-back tail
        if trial % 2:
            # the stream took every token: the final decodes those windows only, never a whole branch
            assert sorted(tok.decoded) == windows, (trial, tok.decoded, windows)
