"""What a simulation measured: latency percentiles per request class, SLO attainment, goodput."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thinkserve.router.answers import majority_vote

PERCENTILES = (50, 90, 99, 99.9)


@dataclass(frozen=True)
class Slo:
    """Per request class: time to first token and time per output token, in seconds."""

    ttft: dict
    tpot: dict

    def met(self, cls: str, ttft: float, tpot: float) -> bool:
        return ttft <= self.ttft[cls] and tpot <= self.tpot[cls]


def _pcts(values: list[float]) -> dict:
    if not values:
        return {}
    a = np.asarray(values)
    out = {f"p{p:g}": float(np.percentile(a, p)) for p in PERCENTILES}
    out["mean"] = float(a.mean())
    return out


def request_latencies(rec) -> tuple[float, float, float] | None:
    """(TTFT, TPOT, end-to-end) of a finished request; TPOT over its longest branch."""
    if rec.refused is not None or rec.finish is None:
        return None
    r = rec.req
    ttft = rec.first_token - r.arrival
    longest = rec.tokens_out or max(r.output_lens)
    tpot = (rec.finish - rec.first_token) / (longest - 1) if longest > 1 else 0.0
    return ttft, tpot, rec.finish - r.arrival


def summarize(sim, slo: Slo) -> dict:
    by_class: dict[str, dict[str, list]] = {}
    met = refused = truncated = 0
    correct = voted = 0
    t_end = 0.0
    for rec in sim.records.values():
        cls = rec.req.cls
        if rec.refused is not None:
            refused += 1
            continue
        truncated += rec.truncated
        ttft, tpot, e2e = request_latencies(rec)
        t_end = max(t_end, rec.finish)
        for key in ("all", cls):
            d = by_class.setdefault(key, {"ttft": [], "tpot": [], "e2e": [], "met": 0})
            d["ttft"].append(ttft)
            d["tpot"].append(tpot)
            d["e2e"].append(e2e)
        if not rec.truncated and slo.met(cls, ttft, tpot):
            met += 1
            by_class[cls]["met"] += 1
        if rec.req.answers:
            voted += 1
            answers: list = [None] * rec.req.n
            for f in rec.finished_branches:
                answers[f.index] = f.answer
            correct += majority_vote(answers).answer == rec.req.correct_answer
    n = len(sim.records)
    t0 = min((r.arrival for r in sim.requests), default=0.0)
    span = max(1e-9, t_end - t0)
    last_arrival = max((r.arrival for r in sim.requests), default=0.0)
    kv_use = [i.kv_block_seconds / (i.bm.num_blocks * span) for i in sim.instances]
    classes = {}
    for key, d in sorted(by_class.items()):
        count = len(d["ttft"])
        total = n if key == "all" else sum(1 for r in sim.records.values() if r.req.cls == key)
        classes[key] = {"requests": count, "ttft": _pcts(d["ttft"]), "tpot": _pcts(d["tpot"]),
                        "e2e": _pcts(d["e2e"]),
                        "slo_attainment": (met if key == "all" else d["met"]) / total if total else 0.0}
    return {
        "requests": n,
        "finished": n - refused,
        "refused": refused,
        "truncated": truncated,
        "gpus": sim.num_gpus,
        "offered_rate": (n - 1) / last_arrival if last_arrival > 0 else None,
        "makespan_s": span,
        "slo_attainment": met / n if n else 0.0,
        # Requests/s per GPU that meet their SLO, over the offered stream (not the drain after it).
        "goodput_per_gpu": (met / n) * ((n - 1) / last_arrival) / sim.num_gpus if last_arrival > 0 else None,
        "throughput_tokens_per_s": sum(sum(r.req.output_lens) for r in sim.records.values()
                                       if r.refused is None) / span,
        "classes": classes,
        "preemptions": sum(i.scheduler.num_preemptions for i in sim.instances),
        "promotions": sim.num_promotions,
        "migrations": sim.num_migrations,
        "promotions_not_executed": sim.num_promotions_skipped,
        "kv_transfers": sim.num_transfers,
        "bytes_moved": sim.bytes_moved,
        "kv_use_mean": float(np.mean(kv_use)) if kv_use else 0.0,
        "kv_use_max_instance": float(np.max(kv_use)) if kv_use else 0.0,
        "engine_steps": sum(i.num_steps for i in sim.instances),
        "decode_runs": sum(i.num_runs for i in sim.instances),
        "best_of_n_accuracy": correct / voted if voted else None,
        "best_of_n_decided_early": sum(r.decided for r in sim.records.values()),
        "cancelled_branches": sim.num_cancelled_branches,
        "tokens_saved_by_early_stop": sum(r.tokens_saved for r in sim.records.values()),
    }
