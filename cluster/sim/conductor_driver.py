"""Driving the router's Conductor from the simulator: what the frontend would hand it.

The Conductor (``thinkserve.router.conductor``) decides; this module only builds its inputs the
way the cluster's frontend does (the ``PlacementRequest`` with SLO class, predictor features and
arrival; ``BranchProgress`` of the short-decode branches for promotion) and feeds finished
lengths back to its online predictor. Switches turn its features off one at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

from thinkserve.router.conductor import (BATCH, INTERACTIVE, STANDARD, BranchProgress, Conductor,
                                         ConductorConfig, DecodeCostModel, PrefillCostModel, SLOClass)
from thinkserve.router.placement import PlacementRequest
from thinkserve.router.predictor import features_for

from .cost import BatchShape
from .workload import SHORT


@dataclass
class ConductorDriver:
    prediction: bool = True          # features + online learning; off: the predictor never learns
    slo_classes: bool = True         # short requests interactive (admission control, priority 0)
    promotion_interval_s: float = 0.5  # 0: no promotion
    config: ConductorConfig | None = None

    def request(self, r, tokens: list[int]) -> PlacementRequest:
        slo_class = INTERACTIVE if (self.slo_classes and r.cls == SHORT) else STANDARD
        features = features_for(tokens, self.config.predictor, max_tokens=r.max_tokens) if self.prediction else None
        return PlacementRequest(r.request_id, r.prompt_len, n=r.n, max_tokens=r.max_tokens, slo_class=slo_class,
                                features=features, arrival=r.arrival)

    def finished(self, conductor: Conductor, rec, output_len: int) -> None:
        if self.prediction and rec.preq is not None and rec.preq.features is not None:
            conductor.observe_finished(rec.preq.features, output_len)

    def progress(self, sim, pool: str) -> tuple[BranchProgress, ...]:
        """Output tokens so far of every unfinished branch on ``pool``'s instances (as of each
        instance's last step boundary or decode-run start, like the engine's reports)."""
        out = []
        for inst in sim.pools.get(pool, ()):
            for req in inst.scheduler.requests.values():
                rec = sim.records[req.request_id]
                length = getattr(rec.placement, "length", None)
                if length is None or req.request_id in inst.migrations:
                    continue
                for seq in req.unfinished_seqs:
                    out.append(BranchProgress(req.request_id, seq.index, pool, inst.instance_id,
                                              seq.num_output_tokens, length, req.num_prompt_tokens))
        return tuple(out)


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
