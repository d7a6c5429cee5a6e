"""The frontend's record of a request: the source of truth for what the client has been sent.

Instances come and go; this record does not. Each branch keeps every output token streamed so
far, so a request whose instance dies resumes elsewhere from exactly here, and tokens that
arrive twice (from the old and the new instance of a moved branch) are placed by position and
sent once::

    branch.token_ids  [t0 t1 t2 t3]            delta(start=2, [t2 t3 t4])  → sends [t4]
                                               delta(start=6, [...])       → held until 4, 5 arrive

A *part* is an engine-level request: the branches of one request that live on one instance
(``part_id`` is unique for the frontend's lifetime, so a retried placement never collides).
``RequestTable`` holds every request in flight and every part, so "which parts are on instance X"
and "how loaded is X" are one lookup.
"""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
from thinkserve.router import extract_answer, majority_vote
from thinkserve.router.consensus import Consensus, ConsensusDecision

from .messages import BranchDelta, Failure, ParkedPart

FINISH = {None: pb.FINISH_REASON_UNSPECIFIED, "stop": pb.FINISH_REASON_STOP,
          "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT}

PREFILL, DECODE, COLOCATED = "prefill", "decode", "colocated"
RESERVE = "reserve"     # early consensus: the prompt's KV held on a prefill instance for later waves (waves.py)


@dataclass
class Part:
    part_id: str
    instance_id: str
    branches: tuple[int, ...]
    phase: str                          # PREFILL | DECODE | COLOCATED | RESERVE
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)


class BranchState:
    def __init__(self, index: int, decoder):
        self.index = index
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None
        self.decoder = decoder                  # the branch's text, decoded once as tokens arrive
        self.decoded_tokens = 0                 # tokens fed to the decoder (``RequestState._decode``)
        self.unsent_text = ""                   # text decoded and not yet put in a response
        self.sent_tokens = 0                    # tokens already put in a response
        self.finish_sent = False
        self._early: dict[int, tuple[tuple[int, ...], str | None]] = {}   # start -> (tokens, finish)
        # when its first token and its finish were placed (monotonic s): its decode time, which
        # the Conductor's predictor reads at the finish (``Orchestrator._observe``)
        self.t_first: float | None = None
        self.t_finished: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, start: int, tokens: tuple[int, ...], finish: str | None) -> bool:
        """Place tokens at ``start``; returns True if the branch changed."""
        if self.finished:
            return False
        if start > len(self.token_ids):
            self._early[start] = (tokens, finish)
            return False
        changed = False
        new = tokens[len(self.token_ids) - start:]
        if new:
            if not self.token_ids:
                self.t_first = time.monotonic()
            self.token_ids.extend(new)
            changed = True
        if finish is not None and start + len(tokens) >= len(self.token_ids):
            self.finish_reason = finish
            self.t_finished = time.monotonic()
            changed = True
        while self._early and not self.finished:
            nxt = min(self._early)
            if nxt > len(self.token_ids):
                break
            t, f = self._early.pop(nxt)
            changed |= self.apply(nxt, t, f)
        return changed

    def extend_to(self, tokens: list[int]) -> bool:
        """Adopt an authoritative token list that extends ours (e.g. from an exported request)."""
        if len(tokens) <= len(self.token_ids):
            return False
        return self.apply(len(self.token_ids), tuple(tokens[len(self.token_ids):]), None)


class RequestState:
    def __init__(self, request_id: str, prompt_token_ids: tuple[int, ...], params, priority: int,
                 tokenizer, *, predicted_len: int = 0, consensus: Consensus | None = None,
                 extractor: Callable[[str], str | None] = extract_answer, slo_class: str = "standard"):
        """``consensus``: the Best-of-N early-stop controller (router/consensus.py) deciding which
        branches run when and which are cancelled; None runs every branch at once to its end.
        ``extractor`` reads a branch's answer for the vote."""
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.priority = priority
        self.tokenizer = tokenizer
        self.branches = [BranchState(i, tokenizer.incremental_decoder()) for i in range(params.n)]
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", ()))
        self.parts: dict[str, Part] = {}
        self.parked: list[ParkedPart] = []      # KV waiting in a CPU store for an instance to take it
        self.lock = asyncio.Lock()              # serialises moves: handoff, migration, resume, abort
        self.changed = asyncio.Event()          # new tokens or a finish to send
        self.aborted = False
        self.error: Failure | None = None       # set when the request failed for good
        self.decode_pool = ""
        self.predicted_len = predicted_len
        # timings (monotonic seconds)
        self.t_admitted = time.monotonic()
        self.t_prefill_start: float | None = None
        self.t_prefilled: float | None = None
        self.t_handoff_done: float | None = None
        self.t_first_token: float | None = None
        self.t_finished: float | None = None
        self.prefill_instance = ""
        self.decode_instances: list[str] = []
        self.migrations = 0
        self.promotions = 0                     # of the migrations: short_decode -> long_decode
        # The Conductor's view: SLO class, predictor features, predicted length distribution.
        self.slo_class = slo_class
        self.features = None
        self.length = None
        self.observed = False                   # its outcome was fed back to the predictor
        self.prefill_hidden = None              # the prefill's final hidden state (branch 0), if returned
        self.block_hashes: tuple[int, ...] | None = None   # chained hashes of the prompt's full blocks
        self.progress: dict[int, list] = {}     # branch -> ProgressState(tokens, hidden) seen while decoding
        self.refined: dict = {}                 # branch -> the length refined by the latest of them
        self.refining: set[int] = set()         # branches with a refinement queued (Orchestrator._refine)
        self.holds_learner = False              # on its way to its first token: no learning step runs
        self.learned_running: dict[int, int] = {}   # branch -> tokens Conductor.observe_running learned
        self.resumes = 0
        self.recomputed_tokens = 0
        self.extractor = extractor
        self.consensus = consensus
        self.first_wave = consensus.start().launch if consensus is not None else tuple(range(params.n))
        self.cancelled_branches = 0
        self.early_stop_rule = ""

    # ----------------------------------------------------------------- branches
    @property
    def finished(self) -> bool:
        return all(b.finished for b in self.branches)

    def unfinished(self, indices) -> tuple[int, ...]:
        return tuple(i for i in indices if not self.branches[i].finished)

    def launched(self, index: int) -> bool:
        """Whether branch ``index`` has started (under early consensus later waves start later)."""
        return self.consensus is None or index < self.consensus.next_index

    def answer_of(self, index: int) -> str | None:
        return self.extractor(self.text_of(self.branches[index]))

    def _decode(self, b: BranchState) -> None:
        """Feed the branch's decoder the tokens it has not seen (EOS ends a branch; it is not
        text), keeping what they complete for the next response: each token is decoded once,
        whether a response, a vote or the final asks first."""
        if b.decoded_tokens < len(b.token_ids):
            eos = self._eos
            new = b.token_ids[b.decoded_tokens:]
            shown = [t for t in new if t not in eos] if eos else new
            b.decoded_tokens = len(b.token_ids)
            if shown:
                b.unsent_text += b.decoder.add(shown)

    def text_of(self, b: BranchState) -> str:
        """The branch's whole text so far (what ``Tokenizer.decode`` of its tokens less EOS gives)."""
        self._decode(b)
        return b.decoder.full_text()

    def apply(self, deltas: tuple[BranchDelta, ...]) -> list[ConsensusDecision]:
        """Place deltas; returns the early-consensus decisions they caused (branches to cancel on
        their instances, branches to launch), for the orchestrator to carry out. Cancelled and
        skipped branches are marked finished (abort) here, so the client sees them end now."""
        changed = False
        decisions = []
        for d in deltas:
            if not 0 <= d.index < len(self.branches):
                continue
            b = self.branches[d.index]
            was_finished = b.finished
            changed |= b.apply(d.start, d.token_ids, d.finish_reason)
            c = self.consensus
            if b.finished and not was_finished and c is not None and not c.done and d.index in c.running:
                decision = c.on_finished(d.index, self.answer_of(d.index))
                if decision.cancelled:
                    for i in decision.cancelled:
                        self.branches[i].finish_reason = "abort"
                    self.cancelled_branches += len(decision.cancelled)
                    self.early_stop_rule = decision.stopped_by
                if decision.cancelled or decision.launch:
                    decisions.append(decision)
        if changed:
            self.changed.set()
        if self.finished and self.t_finished is None:
            self.t_finished = time.monotonic()
            self.changed.set()
        return decisions

    def finish_all(self, reason: str) -> None:
        for b in self.branches:
            if not b.finished:
                b.finish_reason = reason
        if self.t_finished is None:
            self.t_finished = time.monotonic()
        self.changed.set()

    def fail(self, error: Failure) -> None:
        self.error = error
        self.changed.set()

    # ----------------------------------------------------------------- responses
    def take_response(self) -> pb.GenerateResponse | None:
        """The deltas not yet sent, as one message; ``None`` when there is nothing new."""
        deltas = []
        for b in self.branches:
            new = b.token_ids[b.sent_tokens:]
            finishing = b.finished and b.sent_tokens == len(b.token_ids) and not b.finish_sent
            if not new and not finishing:
                continue
            self._decode(b)
            text, b.unsent_text = b.unsent_text, ""
            b.sent_tokens = len(b.token_ids)
            d = pb.BranchDelta(index=b.index, token_ids=new, text=text, num_tokens=len(b.token_ids))
            if b.finished:
                d.finish_reason = FINISH[b.finish_reason]
                b.finish_sent = True
            deltas.append(d)
        if not deltas:
            return None
        if self.t_first_token is None:
            self.t_first_token = time.monotonic()
        return pb.GenerateResponse(request_id=self.request_id, deltas=deltas)

    def final_response(self) -> pb.GenerateResponse:
        branches, answers = [], []
        for b in self.branches:
            text = self.text_of(b)          # decoded as the tokens streamed: no second decode here
            # a branch cancelled by early consensus was cut short: it does not vote
            cancelled = self.consensus is not None and b.index in self.consensus.cancelled
            ans = None if cancelled else self.extractor(text)
            answers.append(ans)
            branches.append(pb.Branch(index=b.index, token_ids=b.token_ids, text=text,
                                      finish_reason=FINISH[b.finish_reason], answer=ans or ""))
        vote = majority_vote(answers)
        final = pb.FinalResult(branches=branches, answer=vote.answer or "", best_branch=vote.best_branch or 0,
                               votes=[pb.Vote(answer=v.answer, count=v.count, branch_indices=v.branch_indices)
                                      for v in vote.votes],
                               cancelled_branches=self.cancelled_branches, early_stop_rule=self.early_stop_rule)
        usage = pb.Usage(prompt_tokens=len(self.prompt_token_ids),
                         completion_tokens=sum(len(b.token_ids) for b in self.branches),
                         recomputed_tokens=self.recomputed_tokens)
        return pb.GenerateResponse(request_id=self.request_id, final=final, usage=usage, timings=self.timings())

    def timings(self) -> pb.Timings:
        def ms(a, b):
            return 0.0 if a is None or b is None else max(0.0, (b - a) * 1000.0)
        end = self.t_finished or time.monotonic()
        return pb.Timings(queued_ms=ms(self.t_admitted, self.t_prefill_start),
                          prefill_ms=ms(self.t_prefill_start, self.t_prefilled),
                          handoff_ms=ms(self.t_prefilled, self.t_handoff_done),
                          ttft_ms=ms(self.t_admitted, self.t_first_token), total_ms=ms(self.t_admitted, end),
                          migrations=self.migrations, promotions=self.promotions,
                          predicted_tokens=self.predicted_len, resumes=self.resumes,
                          prefill_instance=self.prefill_instance, decode_instances=self.decode_instances)


class RequestTable:
    """Every request in flight (by id) and every part (by part id), for the frontend's lifetime."""

    def __init__(self):
        self.requests: dict[str, RequestState] = {}
        self.parts: dict[str, tuple[RequestState, Part]] = {}
        self._part_seq = itertools.count()
        self.on_drop: Callable[[str], None] = lambda part_id: None     # the prefix index's in-flight entries
        # Decode branches placed on an instance whose hand-off has not created their part there
        # yet: request id -> (request, ((instance id, branches), ...)). ``load`` counts them, so
        # a burst placed before any hand-off does not take the same batch slots many times.
        self.planned: dict[str, tuple[RequestState, tuple[tuple[str, tuple[int, ...]], ...]]] = {}

    def new_part(self, req: RequestState, instance_id: str, branches, phase: str) -> Part:
        part = Part(f"{req.request_id}#{next(self._part_seq)}", instance_id, tuple(branches), phase)
        req.parts[part.part_id] = part
        self.parts[part.part_id] = (req, part)
        return part

    def drop_part(self, req: RequestState, part: Part) -> None:
        req.parts.pop(part.part_id, None)
        self.parts.pop(part.part_id, None)
        self.on_drop(part.part_id)

    def plan_decode(self, req: RequestState, decode) -> None:
        """The decode instances a placement chose for ``req``'s first-wave branches
        (``BranchAssignment``s): they count there (``load``) until ``unplan_decode``, which the
        hand-off calls as it creates the decode parts (and the driver when the request ends)."""
        wave = set(req.first_wave)
        plan = tuple((a.instance_id, bs) for a in decode if (bs := tuple(b for b in a.branch_indices if b in wave)))
        self.planned[req.request_id] = (req, plan)

    def unplan_decode(self, req: RequestState) -> None:
        self.planned.pop(req.request_id, None)

    def parts_on(self, instance_id: str) -> list[tuple[RequestState, Part]]:
        return [(r, p) for r, p in list(self.parts.values()) if p.instance_id == instance_id]

    def load(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Per instance, in one pass over the parts (the frontend reads this per placement):
        parts placed there; their unfinished branches, counting the decode branches planned there
        (``plan_decode``: placed, not yet handed off); and the prompt tokens of the parts whose
        prompt is not computed yet. The last is exact from the moment of placement, where the
        engine's own count is a poll behind (a burst placed between two polls would all see an
        idle instance)."""
        reqs: dict[str, int] = {}
        branches: dict[str, int] = {}
        queued: dict[str, int] = {}
        for req, part in self.parts.values():
            phase, iid = part.phase, part.instance_id
            if phase == RESERVE:            # held prompt KV, nothing running, nothing to compute
                continue
            reqs[iid] = reqs.get(iid, 0) + 1
            unfinished = req.unfinished(part.branches)
            branches[iid] = branches.get(iid, 0) + len(unfinished)
            # A colocated part, or a decode part started with its prompt (a local prefill), has
            # computed its prompt once a branch has a token.
            if (phase == PREFILL and not part.prefilled.is_set()) or \
                    (phase != PREFILL and not any(req.branches[b].token_ids for b in part.branches)):
                queued[iid] = queued.get(iid, 0) + len(req.prompt_token_ids)
        for req, plan in self.planned.values():
            for iid, bs in plan:
                if n := len(req.unfinished(bs)):
                    branches[iid] = branches.get(iid, 0) + n
        return reqs, branches, queued
