"""Driving the router's Conductor from the simulator: what the frontend would hand it.

The Conductor (``thinkserve.router.conductor``) decides; this module only builds its inputs the
way the cluster's frontend does (``cluster/orchestrator.py``):

- the ``PlacementRequest`` with SLO class, predictor features, arrival and the prompt's block
  hashes (``workers.block_hash.hash_blocks``, as ``Orchestrator._block_hashes``);
- the snapshot's prefix index: the cluster's own ``PrefixTracker``, fed the ``PrefixDelta``s of
  the prefill instances' real block managers (``BlockManager.prefix_delta``) the way the
  frontend follows them on its polls, with the in-flight entry from placement to the prefill's
  first token;
- ``observe_first_token`` with the seconds from placement to the prefill's first token (the fitted
  TTFT cost model of the placement's mode), ``observe_decode`` with each instance's decode-only steps since its last
  report, every ``report_interval_s`` (the fitted TPOT model), ``observe_running`` for branches passing the long threshold, and
  ``observe_finished`` with each finished branch's length (the online predictor);
- ``BranchProgress`` of the short-decode branches for promotion.

Switches turn its features off one at a time.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from operator import attrgetter

from thinkserve.cluster.prefix_tracker import PrefixTracker
from thinkserve.router.conductor import (BATCH, INTERACTIVE, STANDARD, BranchProgress, Conductor,
                                         ConductorConfig, DecodeCostModel, PrefillCostModel, SLOClass)
from thinkserve.router.placement import PlacementRequest
from thinkserve.router.predictor import LengthFeatures, LengthPredictor, PredictorConfig, features_for
from thinkserve.router.snapshot import ClusterSnapshot
from thinkserve.workers.block_hash import hash_blocks

from .cost import BatchShape
from .workload import SHORT


@dataclass
class ConductorDriver:
    prediction: bool = True          # features + online learning; off: the predictor never learns
    learn: bool = True               # online learning; off: the predictor keeps its starting state
    slo_classes: bool = True         # short requests interactive (admission control, priority 0)
    promotion_interval_s: float = 0.5  # 0: no promotion
    config: ConductorConfig | None = None
    # Prefix affinity: prompts carry their block hashes and the snapshot the prefix index (off, or
    # with the prefix cache off, neither: the index would stay empty).
    prefix_affinity: bool = True
    block_size: int = 16
    fit_prefill: bool = True           # observe_first_token: refit the TTFT cost models from first tokens
    fit_decode: bool = True            # observe_decode: refit the TPOT model from decode-only steps
    report_interval_s: float = 0.25    # how often each instance reports them (the cluster's poll)

    def __post_init__(self):
        # (request id, branch) -> what ``Conductor.observe_running`` learned from it (the frontend
        # keeps this per branch too); absent: not reported yet.
        self.reported: dict[tuple[str, int], int] = {}
        self.prefixes = PrefixTracker()
        self.placed_at: dict[str, float] = {}
        self._due: dict[str, _Watch] = {}    # instance id -> its branches on their way to promotion
        self._long: dict[str, _Watch] = {}   # instance id -> its branches on their way to long_threshold
        self._decode_seen: dict[str, tuple[int, float, int]] = {}   # instance id -> totals last reported

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
        for pool in sim.policy.prefix_pools:   # the driver runs only with a Conductor
            for inst in sim.pools.get(pool, ()):
                self._poll(inst)
        return snap.with_prefix(self.prefixes.index())

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
            if inst.pool in conductor.prefix_pools:   # as ``snapshot`` follows them
                self._poll(inst)
            self.prefixes.settled(request_id)
        placed = self.placed_at.pop(request_id, None)
        if self.fit_prefill and placed is not None:
            conductor.observe_first_token(rec.placement, now - placed)

    def decode_reports(self, conductor: Conductor, sim, now: float) -> None:
        """Every instance reports its decode-only steps since its last report (count, seconds,
        branches): one measurement of its pool's TPOT model in the Conductor each, as the cluster's
        ``Orchestrator.follow`` hands each poll's difference to ``observe_decode``."""
        seen = self._decode_seen
        for inst in sim.instances:
            totals = inst.decode_totals(now)
            before = seen.get(inst.instance_id, (0, 0.0, 0))
            if totals[0] > before[0]:
                conductor.observe_decode(inst.pool, totals[0] - before[0], totals[1] - before[1], totals[2] - before[2])
                seen[inst.instance_id] = totals

    def finished(self, conductor: Conductor, rec, index: int, output_len: int, now: float) -> None:
        """Branch ``index`` of ``rec`` finished at ``now`` with ``output_len`` tokens: the
        predictor learns it (``observe_finished``, with the seconds since the request's first
        token, as the frontend does)."""
        at_least = self.reported.pop((rec.req.request_id, index), 0)
        if self.prediction and self.learn and rec.preq is not None and rec.preq.features is not None:
            decode_s = None if rec.first_token is None else max(0.0, now - rec.first_token)
            conductor.observe_finished(rec.preq.features, output_len, at_least=at_least, now=now,
                                       decode_s=decode_s)

    def progress(self, conductor: Conductor, sim, pool: str) -> tuple[BranchProgress, ...]:
        """Output tokens so far of the unfinished branches on ``pool``'s instances (as of each
        instance's last step boundary or decode-run start, like the engine's reports) that
        reached ``Conductor.promotion_due_at`` their predicted length: the branches
        ``Conductor.promotions`` considers (thousands of others would be built and ignored at
        every round; which of them it takes does not depend on their order). Per instance a
        ``_Watch`` finds the branches that became due since the last round; those due before
        stay due (a branch's tokens only grow) while they are there and unfinished."""
        out, records, watches = [], sim.records, self._due

        def due_at(rid, req):
            rec = records[rid]
            length = getattr(rec.placement, "length", None)
            if length is None:
                return None
            if rec.promotion_due_at is None:
                rec.promotion_due_at = conductor.promotion_due_at(length)
            return rec.promotion_due_at

        for inst in sim.pools.get(pool, ()):
            w = watches.get(inst.instance_id)
            if w is None or w.inst is not inst:
                w = watches[inst.instance_id] = _Watch(inst, due_at)
            w.due += [(rid, req, seq, records[rid].placement.length, req.num_prompt_tokens)
                      for rid, req, seq in w.poll()]
            iid, migrations, tokens, requests, kept = inst.instance_id, inst.migrations, inst.output_tokens, \
                inst.scheduler.requests, []
            for d in w.due:
                rid, req, seq, length, prompt_len = d
                if seq.finish_reason is None and requests.get(rid) is req:
                    kept.append(d)
                    if rid not in migrations:
                        out.append(BranchProgress(rid, seq.index, pool, iid, tokens(seq), length, prompt_len))
            w.due = kept
        return tuple(out)

    def running(self, sim, conductor: Conductor, pools: tuple[str, ...], now: float) -> int:
        """Report to the Conductor the branches decoding on ``pools`` that passed its long
        threshold since the last call (``Conductor.observe_running``, once per branch, as the
        frontend does on its polls), instance by instance in the order the instance lists them.
        Returns how many were reported. A ``_Watch`` per instance finds them."""
        if not (self.prediction and self.learn):
            return 0
        threshold, reported, records, n, watches = conductor.config.long_threshold, self.reported, sim.records, 0, \
            self._long
        mark = threshold + 1
        for pool in pools:
            for inst in sim.pools.get(pool, ()):
                w = watches.get(inst.instance_id)
                if w is None or w.inst is not inst:
                    w = watches[inst.instance_id] = _Watch(inst, lambda rid, req: mark, skip=reported)
                output_tokens = inst.output_tokens
                for rid, req, seq in w.poll():
                    reported[(rid, seq.index)] = conductor.observe_running(records[rid].preq.features,
                                                                           output_tokens(seq), now)
                    n += 1
        return n


class _Watch:
    """The branches of one instance on their way to a mark (promotion due, long threshold), so
    that a round touches only those that may have reached it. A branch gains at most one output
    token per engine step, so one that lacked ``d`` tokens when the instance had run ``s`` steps
    cannot reach its mark before step ``s + d``: requests wait in a heap by that step (the least
    over their unfinished branches), and a round checks only those whose step has come. A request
    that joined since the last round has a higher arrival number (``SimInstance._next_arrival``,
    in the order of ``scheduler.requests``) and is read from the end of ``scheduler.requests``.
    ``mark(request id, request)``: the tokens its branches' mark is at (None: never watched);
    ``skip``: (request id, branch) pairs not to watch."""

    def __init__(self, inst, mark, skip=None):
        self.inst, self.mark, self.skip = inst, mark, skip
        self.arrivals = 0
        self.heap: list = []          # (step, arrival, request id, request)
        self.reached: set[int] = set()  # seq ids found at their mark
        # (request id, request, branch, predicted length, prompt tokens) at their mark (the
        # promotion round's; kept by ``progress``)
        self.due: list = []

    def poll(self) -> list:
        """(request id, request, branch) of the branches that reached the mark since the last
        poll, in the order of ``scheduler.requests`` (then of their branches)."""
        inst = self.inst
        requests, heap, steps = inst.scheduler.requests, self.heap, inst.num_steps
        check = []
        if inst._arrivals != self.arrivals:
            for rid, req in reversed(requests.items()):
                if req.arrival <= self.arrivals:
                    break
                check.append(req)
            self.arrivals = inst._arrivals
        while heap and heap[0][0] <= steps:
            req = heapq.heappop(heap)[3]
            if requests.get(req.request_id) is req:
                check.append(req)
        if not check:
            return []
        check.sort(key=_arrival)
        out, tokens, skip, reached, mark = [], inst.output_tokens, self.skip, self.reached, self.mark
        for req in check:
            rid = req.request_id
            at = mark(rid, req)
            if at is None:
                continue
            left = 1 if req.needs_fork else None   # its branches are not made yet: look again
            for seq in req.seqs:
                if seq.finish_reason is None and seq.seq_id not in reached and \
                        (skip is None or (rid, seq.index) not in skip):
                    d = at - tokens(seq)
                    if d <= 0:
                        reached.add(seq.seq_id)
                        out.append((rid, req, seq))
                    elif left is None or d < left:
                        left = d
            if left is not None:
                heapq.heappush(heap, (steps + left, req.arrival, rid, req))
        return out


_arrival = attrgetter("arrival")


def conductor_config(cost, slo, long_threshold: int, conditional_disagg: bool = False,
                     max_promotions: int | None = None,
                     promotions_per_long_instance: float | None = None) -> ConductorConfig:
    """The Conductor's cost models priced by the simulator's executor model, and SLO classes
    that are the simulation's SLOs: short requests interactive (refused at arrival when their
    TTFT target cannot be met), long chains standard (queued). ``max_promotions`` and
    ``promotions_per_long_instance``: the floor of the moves per promotion round and the moves
    per long_decode instance above it (None: the router's defaults, ``Conductor.promotion_cap``)."""
    per_tok = cost.step_time(BatchShape(prefill_tokens=2048, prefill_ctx=2048 * 2049 // 2)) / 2048
    one = cost.step_time(BatchShape(num_decode=1, decode_ctx=2000))
    many = cost.step_time(BatchShape(num_decode=129, decode_ctx=129 * 2000))
    classes = (SLOClass(INTERACTIVE, slo.ttft[SHORT], slo.tpot[SHORT], engine_priority=0, admission=True),
               SLOClass(STANDARD, slo.ttft["long"], slo.tpot["long"], engine_priority=1),
               SLOClass(BATCH, None, None, engine_priority=2))
    return ConductorConfig(slo_classes=classes, prefill_cost=PrefillCostModel(fixed_s=one, s_per_token=per_tok),
                           decode_cost=DecodeCostModel(step_s=one, s_per_seq=(many - one) / 128),
                           long_threshold=long_threshold, conditional_disagg=conditional_disagg,
                           **({} if max_promotions is None else {"max_promotions": max_promotions}),
                           **({} if promotions_per_long_instance is None
                              else {"promotions_per_long_instance": promotions_per_long_instance}))


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
