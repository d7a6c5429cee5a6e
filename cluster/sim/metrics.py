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


def request_latencies(rec, horizon: float | None = None) -> tuple[float, float, float | None] | None:
    """(TTFT, TPOT, end-to-end) of a request; TPOT over its longest branch. A request still
    running at a run's ``horizon`` is judged on what it did by then: TTFT is at least
    ``horizon - arrival`` when no token came yet, TPOT counts the time to the horizon over the
    tokens produced (a stall in progress counts), end-to-end is unknown (None)."""
    if rec.refused is not None:
        return None
    r = rec.req
    if rec.finish is None:
        if horizon is None:
            return None
        if rec.first_token is None:
            return horizon - r.arrival, 0.0, None
        n = max(1, rec.tokens_out)
        return rec.first_token - r.arrival, (horizon - rec.first_token) / max(1, n - 1), None
    ttft = rec.first_token - r.arrival
    longest = rec.tokens_out or max(r.output_lens)
    tpot = (rec.finish - rec.first_token) / (longest - 1) if longest > 1 else 0.0
    return ttft, tpot, rec.finish - r.arrival


def summarize(sim, slo: Slo, window: tuple[float, float] | None = None) -> dict:
    """``window`` (start, end): a steady-state measurement over the requests arriving in it
    (``sim.run(horizon=...)`` having run past its end); None: every request, run to the end."""
    horizon = getattr(sim, "horizon", None)
    records = list(sim.records.values())
    if window is not None:
        records = [r for r in records if window[0] <= r.req.arrival < window[1]]
    by_class: dict[str, dict[str, list]] = {}
    met = refused = truncated = unfinished = 0
    correct = voted = 0
    t_end = 0.0
    for rec in records:
        cls = rec.req.cls
        if rec.refused is not None:
            refused += 1
            continue
        truncated += rec.truncated
        ttft, tpot, e2e = request_latencies(rec, horizon)
        got_first = rec.first_token is not None
        if rec.finish is None:
            unfinished += 1
        else:
            t_end = max(t_end, rec.finish)
        for key in ("all", cls):
            d = by_class.setdefault(key, {"ttft": [], "tpot": [], "e2e": [], "met": 0})
            d["ttft"].append(ttft)
            if got_first:
                d["tpot"].append(tpot)
            if e2e is not None:
                d["e2e"].append(e2e)
        if got_first and not rec.truncated and slo.met(cls, ttft, tpot):
            met += 1
            by_class[cls]["met"] += 1
        if rec.req.answers and rec.finish is not None:
            voted += 1
            answers: list = [None] * rec.req.n
            for f in rec.finished_branches:
                answers[f.index] = f.answer
            correct += majority_vote(answers).answer == rec.req.correct_answer
    n = len(records)
    t0 = min((r.arrival for r in sim.requests), default=0.0)
    span = max(1e-9, (horizon if horizon is not None else t_end) - t0)
    if window is not None:
        offered = n / (window[1] - window[0])
    else:
        last_arrival = max((r.arrival for r in sim.requests), default=0.0)
        offered = (n - 1) / last_arrival if last_arrival > 0 else None
    kv_use = [i.kv_block_seconds / (i.bm.num_blocks * span) for i in sim.instances]
    classes = {}
    for key, d in sorted(by_class.items()):
        count = len(d["ttft"])
        total = n if key == "all" else sum(1 for r in records if r.req.cls == key)
        classes[key] = {"requests": count, "ttft": _pcts(d["ttft"]), "tpot": _pcts(d["tpot"]),
                        "e2e": _pcts(d["e2e"]),
                        "slo_attainment": (met if key == "all" else d["met"]) / total if total else 0.0}
    return {
        "requests": n,
        "finished": n - refused - unfinished,
        "refused": refused,
        "unfinished_at_horizon": unfinished,
        "truncated": truncated,
        "gpus": sim.num_gpus,
        "window": list(window) if window is not None else None,
        "horizon_s": horizon,
        "offered_rate": offered,
        "makespan_s": span,
        "slo_attainment": met / n if n else 0.0,
        # Requests/s per GPU that meet their SLO, over the offered stream (not the drain after it).
        "goodput_per_gpu": (met / n) * offered / sim.num_gpus if offered else None,
        "throughput_tokens_per_s": sum(sum(r.req.output_lens) if r.finish is not None else r.tokens_out
                                       for r in sim.records.values() if r.refused is None) / span,
        "classes": classes,
        "preemptions": sum(i.scheduler.num_preemptions for i in sim.instances),
        "promotions": sim.num_promotions,
        "local_prefills": sim.num_local_prefills,
        "migrations": sim.num_migrations,
        "promotions_not_executed": sim.num_promotions_skipped,
        "kv_transfers": sim.num_transfers,
        "bytes_moved": sim.bytes_moved,
        "kv_use_mean": float(np.mean(kv_use)) if kv_use else 0.0,
        "kv_use_max_instance": float(np.max(kv_use)) if kv_use else 0.0,
        # Whole run (not only the window): prompt tokens of the requests placed, and how many of
        # them the prefix caches served (the rest were computed).
        "prompt_tokens": sum(r.req.prompt_len for r in sim.records.values() if r.refused is None),
        "prefix_hit_tokens": sum(i.bm.num_prefix_hit_blocks for i in sim.instances) * sim.block_size,
        "engine_steps": sum(i.num_steps for i in sim.instances),
        "decode_runs": sum(i.num_runs for i in sim.instances),
        "best_of_n_accuracy": correct / voted if voted else None,
        "best_of_n_decided_early": sum(r.decided for r in sim.records.values()),
        "cancelled_branches": sim.num_cancelled_branches,
        "tokens_saved_by_early_stop": sum(r.tokens_saved for r in sim.records.values()),
    }
