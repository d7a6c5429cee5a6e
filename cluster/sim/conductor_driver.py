"""Driving the router's Conductor from the simulator: what the frontend would hand it.

The Conductor (``thinkserve.router.conductor``) decides; this module only builds its inputs the
way the cluster's frontend does (``cluster/orchestrator.py``):

- the ``PlacementRequest`` with SLO class, predictor features, arrival and the prompt's block
  hashes (``workers.block_hash.hash_blocks``, as ``Orchestrator._block_hashes``);
- the snapshot's prefix index: the cluster's own ``PrefixTracker``, fed the ``PrefixDelta``s of
  the prefill instances' real block managers (``BlockManager.prefix_delta``) the way the
  frontend follows them on its polls, with the in-flight entry from placement to the prefill's
  first token;
- ``observe_prefill`` with the seconds from placement to the prefill's first token (the fitted
  TTFT cost model), ``observe_running`` for branches passing the long threshold, and
  ``observe_finished`` with each finished branch's length (the online predictor);
- ``BranchProgress`` of the short-decode branches for promotion.

Switches turn its features off one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from thinkserve.cluster.prefix_tracker import PrefixTracker
from thinkserve.router.conductor import (BATCH, INTERACTIVE, STANDARD, BranchProgress, Conductor,
                                         ConductorConfig, DecodeCostModel, PrefillCostModel, SLOClass)
from thinkserve.router.placement import DISAGGREGATED, PlacementRequest
from thinkserve.router.predictor import LengthFeatures, LengthPredictor, PredictorConfig, features_for
from thinkserve.router.snapshot import MIXED, PREFILL, ClusterSnapshot
from thinkserve.workers.block_hash import hash_blocks

from .cost import BatchShape
from .workload import SHORT


@dataclass
class ConductorDriver:
    prediction: bool = True          # features + online learning; off: the predictor never learns
    slo_classes: bool = True         # short requests interactive (admission control, priority 0)
    promotion_interval_s: float = 0.5  # 0: no promotion
    config: ConductorConfig | None = None
    # Prefix affinity: prompts carry their block hashes and the snapshot the prefix index (off, or
    # with the prefix cache off, neither: the index would stay empty).
    prefix_affinity: bool = True
    block_size: int = 16
    fit_prefill: bool = True           # observe_prefill: refit the TTFT cost model from prefills

    def __post_init__(self):
        # (request id, branch) -> what ``Conductor.observe_running`` learned from it (the frontend
        # keeps this per branch too); absent: not reported yet.
        self.reported: dict[tuple[str, int], int] = {}
        self.prefixes = PrefixTracker()
        self.placed_at: dict[str, float] = {}
        self._due: dict[str, _Slack] = {}    # instance id -> promotion slack of its branches
        self._long: dict[str, _Slack] = {}   # instance id -> long-threshold slack of its branches

    def request(self, r, tokens: list[int]) -> PlacementRequest:
        slo_class = INTERACTIVE if (self.slo_classes and r.cls == SHORT) else STANDARD
        features = self.features(r, tokens) if self.prediction else None
        hashes = tuple(hash_blocks(tokens, self.block_size)) if self.prefix_affinity else ()
        return PlacementRequest(r.request_id, r.prompt_len, n=r.n, max_tokens=r.max_tokens, slo_class=slo_class,
                                features=features, arrival=r.arrival, prompt_block_hashes=hashes)

    def features(self, r, tokens: list[int]) -> LengthFeatures:
        """The predictor's features of a request, as the frontend computes them at admission."""
        return features_for(tokens, self.config.predictor, max_tokens=r.max_tokens)

    # ---- prefix index and prefill measurements (the frontend's polls) ----------------------
    def snapshot(self, sim) -> ClusterSnapshot:
        """The simulator's snapshot with the prefix index, after following the journal of every
        prefill-capable instance that changed (the cluster reads them on its instance polls;
        here at every placement, so the index is as of the last step boundary)."""
        snap = sim.snapshot()
        if not self.prefix_affinity:
            return snap
        for pool in (PREFILL, MIXED):
            for inst in sim.pools.get(pool, ()):
                self._poll(inst)
        return replace(snap, prefix=self.prefixes.index())

    def _poll(self, inst) -> None:
        journal, cursor = inst.bm.prefix_journal, self.prefixes.instance_cursor(inst.instance_id)
        if journal is None or journal.version != cursor.version or journal.epoch != cursor.epoch:
            self.prefixes.instance_reported(inst.instance_id, inst.bm.prefix_delta(cursor))

    def placed(self, rec, now: float) -> None:
        """The Conductor placed ``rec``: its prompt counts as held where it prefills until that
        instance reports after the prefill (``PrefixTracker.in_flight``)."""
        p = rec.placement
        self.placed_at[rec.req.request_id] = now
        if self.prefix_affinity:
            self.prefixes.in_flight(rec.req.request_id, p.prefill_instance, rec.preq.prompt_block_hashes)

    def prefilled(self, conductor: Conductor, inst, rec, now: float) -> None:
        """The request's first token: the prefill instance's report now covers the prompt, and a
        disaggregated prefill is one measurement of the TTFT cost model (as the cluster's
        ``Orchestrator.drive``: placement to the prefill's result)."""
        request_id = rec.req.request_id
        if self.prefix_affinity:
            self._poll(inst)
            self.prefixes.settled(request_id)
        placed = self.placed_at.pop(request_id, None)
        if self.fit_prefill and placed is not None and rec.placement.mode == DISAGGREGATED:
            conductor.observe_prefill(rec.placement.prefill_tokens, now - placed, rec.placement.store_tokens)

    def finished(self, conductor: Conductor, rec, index: int, output_len: int) -> None:
        at_least = self.reported.pop((rec.req.request_id, index), 0)
        if self.prediction and rec.preq is not None and rec.preq.features is not None:
            conductor.observe_finished(rec.preq.features, output_len, at_least=at_least)

    def progress(self, conductor: Conductor, sim, pool: str) -> tuple[BranchProgress, ...]:
        """Output tokens so far of the unfinished branches on ``pool``'s instances (as of each
        instance's last step boundary or decode-run start, like the engine's reports) that
        reached ``Conductor.promotion_due_at`` their predicted length: the branches
        ``Conductor.promotions`` considers (thousands of others would be built and ignored at
        every round). An instance is walked only when one of its branches may have become due
        (``_Slack``)."""
        out, records, watch = [], sim.records, self._due

        def due_in(rid, req):
            rec = records[rid]
            length = getattr(rec.placement, "length", None)
            if length is None:
                return None
            if rec.promotion_due_at is None:
                rec.promotion_due_at = conductor.promotion_due_at(length)
            return rec.promotion_due_at

        for inst in sim.pools.get(pool, ()):
            slack = watch.get(inst.instance_id)
            if slack is None or slack.inst is not inst:
                slack = watch[inst.instance_id] = _Slack(inst)
            iid, migrations, tokens = inst.instance_id, inst.migrations, inst.output_tokens
            if not slack.may_reach(due_in):
                # no other branch can have become due: those due at the last walk (still due: a
                # branch's tokens only grow), while they are here and unfinished
                requests, kept = inst.scheduler.requests, []
                for d in slack.due:
                    rid, req, seq, length, prompt_len = d
                    if seq.finish_reason is None and requests.get(rid) is req:
                        kept.append(d)
                        if rid not in migrations:
                            out.append(BranchProgress(rid, seq.index, pool, iid, tokens(seq), length, prompt_len))
                slack.due = kept
                continue
            left, due = None, []
            for rid, req in inst.scheduler.requests.items():
                at = due_in(rid, req)
                if at is None:
                    continue
                for seq in req.seqs:
                    if seq.finish_reason is None:
                        n = tokens(seq)
                        if n >= at:
                            d = (rid, req, seq, records[rid].placement.length, req.num_prompt_tokens)
                            due.append(d)
                            if rid not in migrations:
                                out.append(BranchProgress(rid, seq.index, pool, iid, n, d[3], d[4]))
                        elif left is None or at - n < left:
                            left = at - n
            slack.due = due
            slack.walked(left)
        return tuple(out)

    def running(self, sim, conductor: Conductor, pools: tuple[str, ...]) -> int:
        """Report to the Conductor the branches decoding on ``pools`` that passed its long
        threshold since the last call (``Conductor.observe_running``, once per branch, as the
        frontend does on its polls). Returns how many were reported. An instance is walked only
        when one of its branches may have passed the threshold (``_Slack``)."""
        if not self.prediction:
            return 0
        threshold, reported, records, n, watch = conductor.config.long_threshold, self.reported, sim.records, 0, \
            self._long
        for pool in pools:
            for inst in sim.pools.get(pool, ()):
                slack = watch.get(inst.instance_id)
                if slack is None or slack.inst is not inst:
                    slack = watch[inst.instance_id] = _Slack(inst, skip=reported)
                if not slack.may_reach(lambda rid, req: threshold + 1):
                    continue
                output_tokens, left = inst.output_tokens, None
                for rid, req in inst.scheduler.requests.items():
                    for seq in req.seqs:
                        if seq.finish_reason is None and (rid, seq.index) not in reported:
                            tokens = output_tokens(seq)
                            if tokens > threshold:
                                reported[(rid, seq.index)] = conductor.observe_running(records[rid].preq.features,
                                                                                       tokens)
                                n += 1
                            elif left is None or threshold + 1 - tokens < left:
                                left = threshold + 1 - tokens
                slack.walked(left)
        return n


class _Slack:
    """The fewest output tokens any watched branch of one instance still lacks to reach its
    mark (promotion due, long threshold), as of a step count: a branch gains at most one output
    token per engine step, and branches arrive with a fresh arrival number (``SimInstance.
    _next_arrival``, in the order of ``scheduler.requests``), so while the steps since are
    fewer than the slack and the arrivals since are checked one by one, no branch can have
    reached its mark and the instance need not be walked. ``None`` slack: nothing watched. The
    slack counts only branches short of their mark; those past it are kept in ``due``."""

    def __init__(self, inst, skip=None):
        self.inst, self.skip = inst, skip
        self.steps, self.arrivals, self.left = -1, 0, 0   # walk at first
        # (request id, request, branch, predicted length, prompt tokens) that had reached the mark
        # at the last walk
        self.due: list = []

    def may_reach(self, mark) -> bool:
        inst = self.inst
        if self.steps < 0:
            return True
        left = None if self.left is None else self.left - (inst.num_steps - self.steps)
        if left is not None and left <= 0:
            return True
        if inst._arrivals != self.arrivals:
            tokens, skip = inst.output_tokens, self.skip
            for rid, req in reversed(inst.scheduler.requests.items()):
                if req.arrival <= self.arrivals:
                    break
                at = mark(rid, req)
                if at is None:
                    continue
                for seq in req.seqs:
                    if seq.finish_reason is None and (skip is None or (rid, seq.index) not in skip):
                        d = at - tokens(seq)
                        if d <= 0:
                            return True
                        if left is None or d < left:
                            left = d
        self.steps, self.arrivals, self.left = inst.num_steps, inst._arrivals, left
        return False

    def walked(self, left: int | None) -> None:
        self.steps, self.arrivals, self.left = self.inst.num_steps, self.inst._arrivals, left


def conductor_config(cost, slo, long_threshold: int) -> ConductorConfig:
    """The Conductor's cost models priced by the simulator's executor model, and SLO classes
    that are the simulation's SLOs: short requests interactive (refused at arrival when their
    TTFT target cannot be met), long chains standard (queued)."""
    per_tok = cost.step_time(BatchShape(prefill_tokens=2048, prefill_ctx=2048 * 2049 // 2)) / 2048
    one = cost.step_time(BatchShape(num_decode=1, decode_ctx=2000))
    many = cost.step_time(BatchShape(num_decode=129, decode_ctx=129 * 2000))
    classes = (SLOClass(INTERACTIVE, slo.ttft[SHORT], slo.tpot[SHORT], engine_priority=0, admission=True),
               SLOClass(STANDARD, slo.ttft["long"], slo.tpot["long"], engine_priority=1),
               SLOClass(BATCH, None, None, engine_priority=2))
    return ConductorConfig(slo_classes=classes, prefill_cost=PrefillCostModel(fixed_s=one, s_per_token=per_tok),
                           decode_cost=DecodeCostModel(step_s=one, s_per_seq=(many - one) / 128),
                           long_threshold=long_threshold)


def fit_length_predictor(requests, config: PredictorConfig = PredictorConfig(), epochs: int = 1) -> dict:
    """A fitted starting state for the Conductor's length predictor, as a deployment ships one
    (the cluster loads ``router.length_predictor``; ``bench/bench_predictor.py --fit`` writes the
    tiny-reasoner's): the real predictor learns every branch's final length of ``requests`` — a
    warm-up trace, never the one simulated — in arrival order, ``epochs`` times, through its own
    ``observe``; the result is its ``state()`` (JSON-ready), for ``LengthPredictor.load_state``."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    driver = ConductorDriver(config=ConductorConfig(predictor=config), prefix_affinity=False)
    predictor = LengthPredictor(config)
    seen = [(driver.features(r, r.prompt_tokens()), r.output_lens) for r in requests]
    for _ in range(epochs):
        for features, lengths in seen:
            for n in lengths:
                predictor.observe(features, n)
    return predictor.state()
