"""The reasoning-workload study: the highest rate each policy sustains at 90% SLO attainment.

One steady-state simulation per (deployment, rate): Poisson arrivals of the reasoning mix go on
until a horizon; only requests arriving in a measurement window after a warm-up are judged (those
still running at the horizon on their TTFT and their TPOT so far: ``thinkserve sim --window``).
Each run is also judged on a second, earlier window of the same length, which shows whether the
warm-up was long enough (the two agree when the system is in steady state).

    nice -n 10 python bench/sim_study.py --gpus 16 --variant colocated --rates 50 55 --warmup 900 --window 60 --cooldown 10 \
        --out results/study16

writes OUT/VARIANT.json (one summary per rate). ``--plot`` gathers every OUT/*.json into
OUT/goodput_vs_rate.png and prints the table; ``--bound`` prints the executor model's estimate of
the steady-state capacity per layout (OUT/bound.json).

``--slo-ttft SHORT LONG`` / ``--slo-tpot SHORT LONG`` judge by other SLOs than ``thinkserve sim``'s
defaults (the Conductor's SLO classes take them as its targets; ``--bound`` holds colocated and
pd batches, which carry short requests among the long chains, to a step within the short TPOT);
one output directory per SLO. ``--same-max-tokens``: every request asks for 32,768 tokens, so that
``max_tokens`` does not give a request's class away. ``--sweep DIR ...`` reads such directories and writes each policy's
knee per SLO beside the bounds (OUT/slo_sweep.json, OUT/slo_sweep.png).

The Conductor starts from a length predictor fitted on a warm-up trace (the same generator with
another seed; ``--length-predictor warm``, the default), as a deployment ships a fitted one;
``--length-predictor cold`` starts it uninformed (results in OUT/VARIANT-cold.json).
"""
from __future__ import annotations

import argparse
import json
import time
from bisect import bisect_left
from dataclasses import replace
from pathlib import Path

from thinkserve.cluster.sim.conductor_driver import fit_length_predictor
from thinkserve.cluster.sim.metrics import summarize
from thinkserve.cluster.sim.setup import (WARM_UP_SEED_OFFSET, Deployment, build, default_slo, make_cost,
                                          make_workload, parse_pool_caps, warm_up_workload)
from thinkserve.cluster.sim.workload import ReasoningMix
from thinkserve.cluster.sim_cli import Progress

# The study's deployments: the three policies and the Conductor with one feature off each.
VARIANTS = {
    "colocated": dict(policy="colocated"),
    "pd": dict(policy="pd"),
    "conductor": dict(policy="conductor"),
    "conductor-no-prediction": dict(policy="conductor", prediction=False),
    "conductor-no-online-learning": dict(policy="conductor", learn_lengths=False),
    "conductor-no-promotion": dict(policy="conductor", promotion=False),
    "conductor-no-slo-classes": dict(policy="conductor", slo_classes=False),
    "conductor-no-early-consensus": dict(policy="conductor", early_stop="none"),
    "three-pools-least-loaded": dict(policy="conductor", router="least-loaded"),
}


def study_slo(args):
    """The SLOs the study judges by (and the Conductor targets): ``thinkserve sim``'s defaults for
    GPUs unless ``--slo-ttft`` / ``--slo-tpot`` say otherwise."""
    return default_slo("h200", getattr(args, "slo_ttft", None), getattr(args, "slo_tpot", None))


def study_mix(args) -> ReasoningMix:
    """The reasoning mix; with ``--same-max-tokens`` every request asks for its cap (32,768), as
    clients of a reasoning API that all send the model's limit: then ``max_tokens`` no longer
    tells a chat turn from a chain of thought, and only a length prediction can."""
    mix = ReasoningMix()
    return replace(mix, short_max=mix.max_output) if getattr(args, "same_max_tokens", False) else mix


def run_point(variant: str, rate: float, args) -> dict:
    cost = make_cost("h200", "qwen2.5-7b")
    slo = study_slo(args)
    window = (args.warmup, args.warmup + args.window)
    horizon = window[1] + args.cooldown
    mix = study_mix(args)
    reqs = make_workload("reasoning", rate=rate, requests=int(rate * horizon) + 1, seed=args.seed,
                         max_model_len=cost.model.max_model_len, mix=mix)
    v = dict(VARIANTS[variant])
    v.setdefault("early_stop", args.early_stop if v["policy"] == "conductor" else "none")
    dep = Deployment(**v, prefill_share=args.prefill_share, long_share=args.long_share,
                     max_promotions=args.max_promotions,
                     promotions_per_long_instance=args.promotions_per_long_instance)
    warm = dep.policy == "conductor" and args.length_predictor == "warm"
    w0, c0 = time.perf_counter(), time.process_time()
    state = None
    if warm:
        # A deployment ships a fitted predictor: fit one on a warm-up trace (same generator, another seed).
        state = fit_length_predictor(warm_up_workload("reasoning", rate=rate, requests=args.warm_up_requests, skip=0,
                                                      seed=args.seed, max_model_len=cost.model.max_model_len,
                                                      mix=mix))
    progress = Progress(f"{variant} @ {rate}", args.quiet, horizon)
    sim = build(reqs, dep, cost, args.gpus, block_size=64, max_num_seqs=args.max_num_seqs, slo=slo,
                length_predictor=state, progress=progress, pool_max_num_seqs=parse_pool_caps(args.pool_max_num_seqs))
    stop = FailingStop(sim, slo, args.window, args.stop_failing_from) if args.stop_failing_from >= 0 else None
    sampler = PoolSampler(sim, args.sample_every, Path(args.out) / f"{variant}{args.tag}@{rate:g}.state.jsonl",
                          stop=stop)
    try:
        sim.run(horizon)
    except Failing as failing:
        # Stopped early: the point fails. Its pool state to then and the windows that failed are
        # kept; the measured window was never reached, so nothing else is summarized.
        progress.end()
        return {"variant": variant + args.tag, "policy": dep.policy, "rate": rate, "stopped_failing": failing.verdict,
                "slo_attainment": None, "gpus": sim.num_gpus, "pool_state": sampler.rows,
                "drift": drift(sampler.rows, args.drift_span), "placements": placements_by_period(sim, args.period),
                "preemptions": sum(i.scheduler.num_preemptions for i in sim.instances),
                "promotions": sim.num_promotions, "wall_s": time.perf_counter() - w0,
                "cpu_s": time.process_time() - c0, "pools": {name: len(m) for name, m in sim.pools.items()},
                "max_num_seqs": args.max_num_seqs, "window": list(window), "slo": {"ttft": slo.ttft, "tpot": slo.tpot}}
    progress.end()
    s = summarize(sim, slo, window)
    early = (window[0] - args.window, window[0])
    s["early_window"] = summarize(sim, slo, early) if early[0] >= 0 else None
    s["placements"] = placements_by_period(sim, args.period)
    s["pool_state"] = sampler.rows
    s["drift"] = drift(sampler.rows, args.drift_span)
    s.update(variant=variant + args.tag, policy=dep.policy, rate=rate, wall_s=time.perf_counter() - w0,
             same_max_tokens=getattr(args, "same_max_tokens", False),
             cpu_s=time.process_time() - c0, pools={name: len(m) for name, m in sim.pools.items()},
             slo={"ttft": slo.ttft, "tpot": slo.tpot}, max_num_seqs=args.max_num_seqs,
             pool_max_num_seqs=parse_pool_caps(args.pool_max_num_seqs),
             max_promotions=args.max_promotions, promotions_per_long_instance=args.promotions_per_long_instance,
             length_predictor=(f"warm: fitted on {args.warm_up_requests} requests, seed {args.seed + WARM_UP_SEED_OFFSET}"
                               if warm else "cold" if dep.policy == "conductor" else None))
    return s


def capacity_bound(args) -> list[dict]:
    """The highest rate any placement can sustain, from the executor model alone: a decode
    instance's tokens/s peaks with its KV cache full of branches at their mean attended context
    (weighted by time decoding, so the long tail dominates), a step's length growing with the
    KV it reads; colocated batches are also capped at ``max_num_seqs`` and carry the prompts'
    prefill in the same steps (their share per output token); pools decode on the instances that
    do not prefill. Outputs as generated (no early consensus), block rounding and preemption
    ignored: an upper bound, not a prediction.

    The Conductor's three-pool splits (``conductor P+S+L``: P prefill, S short_decode, L
    long_decode instances, every split with 1 to 3/16 of the GPUs prefilling (at least 3) and 1 to
    a quarter short (at least 4); the 12 best are printed) are bounded the
    same way per pool, with placement as good as it can be: the branches over the long
    threshold decode in the long pool for their whole life, the others in the short pool (whose
    batch is also held to a step within the short requests' TPOT SLO), the prompts on the
    prefill pool at full chunks; a split sustains the least of its three pools' rates.

    Also the longest branch's life at that step (``longest_branch_s``): near the bound a run
    reaches steady state only after it, since the long chains carry most of the context (the
    running population and its KV keep growing until the longest chains start finishing), so a
    warm-up shorter than it judges a cluster still filling up."""
    from thinkserve.cluster.sim.cost import BatchShape
    cost = make_cost("h200", "qwen2.5-7b")
    slo = study_slo(args)
    threshold = Deployment("conductor").long_threshold
    reqs = make_workload("reasoning", rate=100.0, requests=args.bound_requests, seed=args.seed,
                         max_model_len=cost.model.max_model_len, mix=study_mix(args))
    n_req = len(reqs)
    prompt_per_req = sum(r.prompt_len for r in reqs) / n_req
    prompt_ctx = sum(r.prompt_len * (r.prompt_len + 1) // 2 for r in reqs) / n_req
    capacity = cost.kv_capacity_tokens()

    def branches(keep):
        """Output tokens per request, time-weighted mean context and longest branch of the kept branches."""
        out = sum(n for r in reqs for n in r.output_lens if keep(n))
        ctx = sum(n * (r.prompt_len + n / 2) for r in reqs for n in r.output_lens if keep(n)) / out
        return out / n_req, ctx, max(n for r in reqs for n in r.output_lens if keep(n))

    def decode_ceiling(instances, out_per_req, ctx, longest, cap=None, prefill_inline=False, tpot=None):
        batch = int(capacity // ctx) if cap is None else min(cap, int(capacity // ctx))

        def step_of(b):
            # Colocated: a step also computes its share of prompts (they ride in memory-bound decode
            # steps almost for free on a roofline).
            share = b / out_per_req if prefill_inline else 0.0
            return cost.step_time(BatchShape(prefill_tokens=int(share * prompt_per_req),
                                             prefill_ctx=int(share * prompt_ctx), num_decode=b, decode_ctx=int(b * ctx)))
        unheld = batch
        while tpot is not None and batch > 1 and step_of(batch) > tpot:
            batch -= 1
        step = step_of(batch)
        return {"decode_instances": instances, "batch": batch, "held_to_tpot": batch < unheld, "step_ms": step * 1e3,
                "tokens_per_s_per_instance": batch / step, "max_rate": instances * batch / step / out_per_req,
                "mean_context": ctx, "output_tokens_per_request": out_per_req,
                "longest_branch_tokens": longest, "longest_branch_s": longest * step}

    out_all, ctx_all, longest_all = branches(lambda n: True)
    # Colocated and pd decode short and long branches in the same batches, so the step must stay
    # within the tighter TPOT SLO (the short requests') for those to meet it.
    tightest = min(slo.tpot.values())
    rows = []
    for label, decoders, cap, inline in (
            ("colocated", args.gpus, args.max_num_seqs, True),
            ("pools", args.gpus - max(1, round(args.gpus * args.prefill_share)), None, False)):
        row = {"layout": label, **decode_ceiling(decoders, out_all, ctx_all, longest_all, cap, inline, tpot=tightest)}
        rows.append(row)
        held = f" (held to a step within the {tightest * 1e3:g} ms TPOT SLO)" if row["held_to_tpot"] else ""
        print(f"{label:<10} {decoders} decode instances, {row['batch']} branches each{held} (KV {capacity:,} tokens / mean "
              f"context {ctx_all:,.0f}{'' if cap is None else f', at most {cap}'}), step {row['step_ms']:.1f} ms: "
              f"{row['tokens_per_s_per_instance']:,.0f} tok/s per instance -> at most {row['max_rate']:.1f} req/s "
              f"({out_all:,.0f} output tokens per request); the longest branch ({longest_all:,} tokens) "
              f"lives {row['longest_branch_s']:,.0f} s")

    # The Conductor's splits: each pool's ceiling, the split's the least of them.
    chunk = 8192  # the engine's max_num_batched_tokens (cluster/sim/setup.py::build)
    prefill_tok_s = chunk / cost.step_time(BatchShape(prefill_tokens=chunk, prefill_ctx=int(chunk * prompt_ctx / prompt_per_req)))
    long_b = branches(lambda n: n > threshold)
    short_b = branches(lambda n: n <= threshold)
    splits = []
    for p in range(1, max(3, args.gpus * 3 // 16) + 1):
        for sh in range(1, max(4, args.gpus // 4) + 1):
            lng = args.gpus - p - sh
            if lng < 1:
                continue
            short = decode_ceiling(sh, *short_b, tpot=slo.tpot["short"])
            long_ = decode_ceiling(lng, *long_b, tpot=slo.tpot["long"])
            prefill_rate = p * prefill_tok_s / prompt_per_req
            rate = min(short["max_rate"], long_["max_rate"], prefill_rate)
            splits.append({"layout": f"conductor {p}+{sh}+{lng}", "prefill": p, "short": sh, "long": lng,
                           "max_rate": rate, "prefill_max_rate": prefill_rate, "short_pool": short, "long_pool": long_,
                           "limited_by": min((("prefill", prefill_rate), ("short", short["max_rate"]),
                                              ("long", long_["max_rate"])), key=lambda kv: kv[1])[0]})
    splits.sort(key=lambda r: -r["max_rate"])
    print(f"conductor splits (P prefill + S short + L long; branches <= {threshold:,} tokens decode in the short pool: "
          f"{short_b[0]:,.0f} output tokens per request, context {short_b[1]:,.0f}; the longer ones in the long pool: "
          f"{long_b[0]:,.0f}, context {long_b[1]:,.0f}; a prefill instance computes {prefill_tok_s:,.0f} prompt tokens/s, "
          f"{prompt_per_req:,.0f} per request):")
    for r in splits[:12]:
        sp, lp = r["short_pool"], r["long_pool"]
        print(f"  {r['layout']:<18} at most {r['max_rate']:5.1f} req/s (limited by {r['limited_by']}): prefill "
              f"{r['prefill_max_rate']:6.1f}; short {sp['max_rate']:6.1f} ({sp['batch']} branches, {sp['step_ms']:.1f} ms); "
              f"long {lp['max_rate']:5.1f} ({lp['batch']} branches, {lp['step_ms']:.1f} ms, longest branch lives "
              f"{lp['longest_branch_s']:,.0f} s)")
    return rows + splits


class PoolSampler:
    """Every ``every`` simulated seconds, per pool: the mean running branches, KV in use (tokens
    per instance and the share of the cache), waiting requests, preemptions so far and the
    engine's step time over the period, to show
    when a run reaches steady state (the population stops growing) and what its decode batches
    are. Sampled when a request finishes (the simulator's progress hook), so at that rate."""

    def __init__(self, sim, every: float, log: Path | None = None, stop: "FailingStop | None" = None):
        self.sim, self.every, self.next, self.stop = sim, every, every, stop
        self.rows: list[dict] = []
        self.log = None if log is None else log.open("w")  # each row as it is taken (a run stopped early keeps them)
        self.steps = {inst.instance_id: 0 for inst in sim.instances}
        self.forward, sim.progress = sim.progress, self

    def __call__(self, done: int, total: int, now: float) -> None:
        if self.forward is not None:
            self.forward(done, total, now)
        if now < self.next:
            return
        self.next = (now // self.every + 1) * self.every
        span = now - (self.rows[-1]["t"] if self.rows else 0.0)
        row = {"t": now}
        for pool, members in self.sim.pools.items():
            # Read, not ``inst.snapshot()``: caching a snapshot would change what the simulator patches.
            n = len(members)
            steps = sum(inst.num_steps - self.steps[inst.instance_id] for inst in members)
            for inst in members:
                self.steps[inst.instance_id] = inst.num_steps
            bms = [inst.bm for inst in members]
            used = sum((bm.num_blocks - bm.num_free_blocks) * bm.block_size for bm in bms)
            running = sum(inst.scheduler.num_running_seqs() if inst._num_running_seqs is None
                          else inst._num_running_seqs for inst in members)
            row[pool] = {"running_seqs": running / n, "kv_tokens": used / n,
                         "kv_use": used / sum(bm.num_blocks * bm.block_size for bm in bms),
                         "waiting": sum(len(inst.scheduler.waiting) + len(inst.scheduler.swapped) + len(inst.inbox)
                                        for inst in members) / n,
                         "preemptions": sum(inst.scheduler.num_preemptions for inst in members),
                         # the mean step over the period, if the instances were never idle
                         "step_ms": 1e3 * span * n / steps if steps else None}
        self.rows.append(row)
        if self.log is not None:
            self.log.write(json.dumps(row) + "\n")
            self.log.flush()
        if self.stop is not None:
            self.stop.check(now)


class Failing(Exception):
    """Raised out of the simulation by ``FailingStop``: the point is clearly failing."""

    def __init__(self, verdict: dict):
        super().__init__(verdict["reason"])
        self.verdict = verdict


class FailingStop:
    """Stops a point once it is clearly failing, so that points above a knee cost little. The
    rule, the same for every policy: from ``start`` simulated seconds on, at each pool sample
    ``now``, the two adjacent windows of ``window`` seconds ending 10 s before ``now`` (the
    study's cooldown) are judged by what is already certain of their requests; when more than
    10% of each window's requests are certain to miss their SLO (attainment below 90% whatever
    happens next), the run stops (``Failing``). Certain misses, read without changing anything:
    refused; truncated; a first token later than the TTFT SLO, or none yet and the SLO already
    past; finished with its TPOT over the SLO; or still running with a TPOT over the SLO even if
    its longest branch's drawn length were all produced right now (its TPOT at the horizon can
    only be higher: the time grows, the tokens are at most that many). Requests that could
    still meet their SLO count as meeting it, so a point stopped by this rule would be judged
    under 90% in two windows in a row as they stand; one that is not stopped runs to its
    horizon and is judged as before (the rule only reads)."""

    MISS_SHARE = 0.10

    def __init__(self, sim, slo, window: float, start: float, lag: float = 10.0):
        self.sim, self.slo, self.window, self.start, self.lag = sim, slo, window, start, lag
        self.arrivals = [r.arrival for r in sim.requests]      # sorted: the simulator sorts them

    def certain_misses(self, lo: float, hi: float, now: float) -> tuple[int, int]:
        """(requests arriving in [lo, hi), of those certain to miss their SLO as of ``now``)."""
        sim, ttft_slo, tpot_slo = self.sim, self.slo.ttft, self.slo.tpot
        a, b = bisect_left(self.arrivals, lo), bisect_left(self.arrivals, hi)
        misses = 0
        for r in sim.requests[a:b]:
            rec = sim.records.get(r.request_id)
            if rec is None:
                continue                                       # not arrived (cannot happen for hi <= now)
            if rec.refused is not None or rec.truncated:
                misses += 1
                continue
            if rec.first_token is None:
                misses += now - r.arrival > ttft_slo[r.cls]
                continue
            if rec.first_token - r.arrival > ttft_slo[r.cls]:
                misses += 1
                continue
            if rec.finish is not None:
                longest = rec.tokens_out or max(r.output_lens)
                misses += longest > 1 and (rec.finish - rec.first_token) / (longest - 1) > tpot_slo[r.cls]
                continue
            longest = max(r.output_lens)
            misses += longest > 1 and (now - rec.first_token) / (longest - 1) > tpot_slo[r.cls]
        return b - a, misses

    def check(self, now: float) -> None:
        if now < self.start:
            return
        hi = now - self.lag
        judged = []
        for lo in (hi - self.window, hi - 2 * self.window):
            n, misses = self.certain_misses(lo, lo + self.window, now)
            if n == 0 or misses <= self.MISS_SHARE * n:
                return
            judged.append({"window": [lo, lo + self.window], "requests": n, "certain_misses": misses,
                           "slo_attainment_at_most": 1 - misses / n})
        raise Failing({"stopped_at_s": now, "windows": judged[::-1],
                       "reason": f"over {self.MISS_SHARE:.0%} of the requests of two adjacent {self.window:g} s "
                                 f"windows ending {self.lag:g} s before {now:.0f} s are certain to miss their SLO"})


# A prefill pool holding this much of its KV cache on average is backed up: its cache holds the
# prompts it computes and the hand-offs waiting for a decoding instance to take them, which
# leave within a step or a transfer when the decoding pools keep up (healthy runs: under 20%).
PREFILL_BACKED_UP_KV = 0.5


def drift(rows: list[dict], span: float, steady_kv: float = 0.01) -> dict:
    """Whether a run had reached steady state by its end, from its pool state: per pool, the
    least-squares slope over the last ``span`` simulated seconds of the KV in use (share of the
    cache per 100 s), the running branches per instance (per 100 s) and the waiting requests
    per instance (per 100 s), with their values at the end. A decoding pool is ``steady`` when
    its KV in use moves less than ``steady_kv`` per 100 s and its queue does not grow;
    ``filling`` when its KV still rises; ``queueing`` when its queue grows (a colocated instance
    at its batch cap queues with its KV flat). The prefill pool is judged the same way, and is
    also ``backed up`` when its KV in use averages ``PREFILL_BACKED_UP_KV`` or more over the
    span: hand-offs pile up there when the decoding instances do not take them (one at its batch
    cap leaves them with the sender, its own KV and queue flat), and then the prompts queue
    behind them. The run is steady when every pool is: a point judged before then measures a
    cluster still filling up, and a point above capacity never gets there."""
    if not rows:
        return {"steady": None, "span_s": span, "pools": {}}
    t_end = rows[-1]["t"]
    last = [r for r in rows if r["t"] >= t_end - span]
    pools = {}
    for pool in (p for p in rows[-1] if p != "t"):
        def slope(key):
            xs = [r["t"] for r in last]
            ys = [r[pool][key] for r in last]
            if len(xs) < 3:
                return None
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            sxx = sum((x - mx) ** 2 for x in xs)
            return 100 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None
        kv, running, waiting = slope("kv_use"), slope("running_seqs"), slope("waiting")
        end = rows[-1][pool]
        mean_kv = sum(r[pool]["kv_use"] for r in last) / len(last)
        if kv is None:
            state = "unknown"
        elif waiting > 1.0:
            state = "queueing"
        elif pool == "prefill" and mean_kv >= PREFILL_BACKED_UP_KV:
            state = "backed up"
        else:
            state = "filling" if kv > steady_kv else "draining" if kv < -steady_kv else "steady"
        pools[pool] = {"state": state, "kv_use_per_100s": kv, "running_per_100s": running,
                       "waiting_per_100s": waiting, "kv_use": end["kv_use"], "mean_kv_use": mean_kv,
                       "running_seqs": end["running_seqs"], "waiting": end["waiting"], "step_ms": end["step_ms"]}
    return {"steady": all(v["state"] == "steady" for v in pools.values()), "span_s": span,
            "from_s": last[0]["t"], "to_s": t_end, "pools": pools}


def describe_drift(d: dict) -> str:
    if not d["pools"]:
        return "no pool state sampled"
    parts = [f"{pool} {v['state']}: KV {v['kv_use']:.0%} ({v['kv_use_per_100s'] * 100:+.1f} points / 100 s), "
             f"{v['running_seqs']:.0f} running ({v['running_per_100s']:+.1f} / 100 s), "
             f"{v['waiting']:.1f} waiting ({v['waiting_per_100s']:+.1f} / 100 s)"
             for pool, v in d["pools"].items() if v["state"] != "unknown"]
    verdict = "steady" if d["steady"] else "NOT steady"
    return f"{verdict} over [{d['from_s']:.0f}, {d['to_s']:.0f}] s: " + "; ".join(parts)


def placements_by_period(sim, period: float) -> list[dict]:
    """Per ``period`` seconds of arrivals: where each class was placed (decode pool) or why it
    was refused (the Refusal's first words: "interactive TTFT", "interactive TPOT"), to see
    how a run got where it is (a predictor misplacing long chains shows as long -> short_decode)."""
    rows: dict[int, dict[str, int]] = {}
    for rec in sim.records.values():
        row = rows.setdefault(int(rec.req.arrival // period), {})
        if rec.refused is not None:
            key = f"{rec.req.cls} refused: " + " ".join(rec.refused.split()[:2])
        else:
            key = f"{rec.req.cls} -> {getattr(rec.placement, 'decode_pool', '?')}"
        row[key] = row.get(key, 0) + 1
    return [{"from_s": k * period, **dict(sorted(v.items()))} for k, v in sorted(rows.items())]


def load_runs(out: Path, span: float) -> dict[str, list[dict]]:
    """Every results file in ``out`` (not the summaries ``--plot``, ``--sweep`` and ``--bound``
    write there): its stem -> its points by rate, each with its drift verdict (fitted over
    ``span`` for files written before runs carried it)."""
    rows = {}
    for f in sorted(out.glob("*.json")):
        if f.name not in ("study.json", "slo_sweep.json") and not f.name.startswith("bound"):
            runs = sorted(json.loads(f.read_text()), key=lambda s: s["rate"])
            for s in runs:
                s.setdefault("drift", drift(s.get("pool_state") or [], span))
            rows[f.stem] = runs
    return rows


def plot(out: Path, span: float) -> None:
    rows = load_runs(out, span)
    table = []
    for variant, runs in rows.items():
        ok = [s for s in runs if (s["slo_attainment"] or 0.0) >= 0.9]   # None: stopped failing
        best = max(ok, key=lambda s: s["rate"]) if ok else None
        table.append({"variant": variant, "max_rate_at_90": best["rate"] if best else None,
                      "steady_there": best["drift"]["steady"] if best else None,
                      "goodput_per_gpu": best["goodput_per_gpu"] if best else None,
                      "short_ttft_p99": best["classes"]["short"]["ttft"]["p99"] if best else None,
                      "rates": [(s["rate"], "failing (stopped at %.0f s)" % s["stopped_failing"]["stopped_at_s"]
                                 if s.get("stopped_failing") else round(s["slo_attainment"], 3), s["drift"]["steady"])
                                for s in runs]})
        print(f"{variant:<28} max rate @90%: {table[-1]['max_rate_at_90']} (steady: {table[-1]['steady_there']})  "
              f"short TTFT p99 there: {table[-1]['short_ttft_p99']}  points (rate, SLO, steady): {table[-1]['rates']}")
        for s in runs:
            print(f"  @ {s['rate']:g}: " + describe_drift(s["drift"]))
    (out / "study.json").write_text(json.dumps(table, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, runs in rows.items():
        judged = [s for s in runs if not s.get("stopped_failing")]
        a1.plot([s["rate"] for s in judged], [s["goodput_per_gpu"] for s in judged], "o-", label=variant)
        a2.plot([s["rate"] for s in judged], [s["slo_attainment"] for s in judged], "o-", label=variant)
        failing = [s["rate"] for s in runs if s.get("stopped_failing")]
        if failing:   # stopped once certain to be under 90%: marked at 0
            a2.plot(failing, [0.0] * len(failing), "x", color=a2.lines[-1].get_color())
    gpus = next(iter(rows.values()))[0]["gpus"]
    a1.set_ylabel("goodput (req/s per GPU meeting the SLO)")
    a2.set_ylabel("SLO attainment (measured window)")
    a2.axhline(0.9, color="grey", ls="--", lw=0.8)
    for a in (a1, a2):
        a.set_xlabel(f"offered rate (req/s, {gpus} H200, Qwen2.5-7B, reasoning mix)")
        a.grid(True, alpha=0.3)
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_rate.png", dpi=110)
    print(f"wrote {out / 'study.json'}, {out / 'goodput_vs_rate.png'}")
    sampled = [(variant, s) for variant, runs in rows.items() for s in runs if s.get("pool_state")]
    if not sampled:
        return
    # How each run fills up: the decode instances' KV in use and mean step against simulated time.
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for variant, s in sampled:
        rows_ = s["pool_state"]
        pools = [p for p in rows_[0] if p != "t" and p != "prefill"]
        t = [r["t"] for r in rows_]
        kv = [sum(r[p]["kv_use"] * s["pools"][p] for p in pools) / sum(s["pools"][p] for p in pools) for r in rows_]
        step = [max((r[p]["step_ms"] or 0.0) for p in pools) for r in rows_]
        label = f"{variant} @ {s['rate']:g}"
        a1.plot(t, kv, label=label)
        a2.plot(t, step, label=label)
    a1.set_ylabel("KV in use, decoding instances")
    a2.set_ylabel("mean step (ms), slowest decode pool")
    for a in (a1, a2):
        a.set_xlabel("simulated time (s)")
        a.grid(True, alpha=0.3)
    a1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fill.png", dpi=110)
    print(f"wrote {out / 'fill.png'}")


def knee(runs: list[dict]) -> dict:
    """The highest rate meeting >= 90% in a steady run (``holds``) and the lowest rate above it
    that does not (``fails``: under 90%, stopped failing, or not steady), over ``runs``."""
    held = [s for s in runs if (s.get("slo_attainment") or 0.0) >= 0.9 and s["drift"]["steady"]]
    best = max(held, key=lambda s: s["rate"]) if held else None
    above = [s["rate"] for s in runs if s not in held and (best is None or s["rate"] > best["rate"])]
    return {"holds": best["rate"] if best else None, "fails": min(above) if above else None,
            "variant": best["variant"] if best else None,
            "goodput_per_gpu": best["goodput_per_gpu"] if best else None,
            "short_ttft_p99": best["classes"]["short"]["ttft"]["p99"] if best else None,
            "short_tpot_p99": best["classes"]["short"]["tpot"]["p99"] if best else None}


POLICIES = ("colocated", "pd", "conductor")


def slo_sweep(out: Path, dirs: list[str], args) -> list[dict]:
    """The knee of each policy (its best deployment: any batch cap or split run) in each of
    ``dirs`` — one directory of runs per SLO, as ``--slo-tpot`` wrote them — beside the
    executor model's bound under that SLO (colocated; the best Conductor split). Writes
    OUT/slo_sweep.json and OUT/slo_sweep.png."""
    import contextlib
    import io
    rows = []
    for d in dirs:
        runs = [s for file_runs in load_runs(Path(d), args.drift_span).values() for s in file_runs]
        slos = {(tuple(s["slo"]["ttft"].values()), tuple(s["slo"]["tpot"].values())) for s in runs if s.get("slo")}
        if len(slos) != 1:
            raise SystemExit(f"--sweep: {d} holds runs under {len(slos)} SLOs; one directory per SLO")
        (ttft, tpot), = slos
        if {s["gpus"] for s in runs} != {args.gpus}:
            raise SystemExit(f"--sweep: {d} holds runs on {sorted({s['gpus'] for s in runs})} GPUs; give --gpus to match")
        row = {"dir": d, "slo_ttft": ttft, "slo_tpot": tpot}
        for policy in POLICIES:
            mine = [s for s in runs if s.get("policy") == policy]
            if mine:
                row[policy] = knee(mine) | {"runs": sorted((s["variant"], s["rate"]) for s in mine)}
        with contextlib.redirect_stdout(io.StringIO()):
            b = capacity_bound(argparse.Namespace(**{**vars(args), "slo_ttft": ttft, "slo_tpot": tpot}))
        best = max((r for r in b if r["layout"].startswith("conductor")), key=lambda r: r["max_rate"])
        row["bound"] = {"colocated": b[0]["max_rate"], "conductor": best["max_rate"], "conductor_split": best["layout"]}
        rows.append(row)
    rows.sort(key=lambda r: -r["slo_tpot"][0])
    for r in rows:
        parts = []
        for policy in POLICIES:
            k = r.get(policy)
            if k:
                parts.append(f"{policy} holds {k['holds']} ({k['variant']}), fails at {k['fails']}")
        c, cc = r.get("conductor", {}).get("holds"), r.get("colocated", {}).get("holds")
        ratio = f"; knee ratio conductor / colocated {c / cc:.2f}x" if c and cc else ""
        print(f"short TPOT SLO {r['slo_tpot'][0] * 1e3:g} ms: " + "; ".join(parts) + ratio
              + f" (bound: colocated {r['bound']['colocated']:.1f}, {r['bound']['conductor_split']} "
                f"{r['bound']['conductor']:.1f})")
    (out / "slo_sweep.json").write_text(json.dumps(rows, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = [r["slo_tpot"][0] * 1e3 for r in rows]
    for policy, color in zip(POLICIES, ("tab:blue", "tab:orange", "tab:green")):
        pts = [(xi, r[policy]) for xi, r in zip(x, rows) if r.get(policy) and r[policy]["holds"]]
        if not pts:
            continue
        xs, ks = [p for p, _ in pts], [k for _, k in pts]
        a1.plot(xs, [k["holds"] for k in ks], "o-", color=color, label=f"{policy}: holds (>= 90%, steady)")
        fails = [(xi, k["fails"]) for xi, k in pts if k["fails"]]
        a1.plot([f[0] for f in fails], [f[1] for f in fails], "v", color=color, alpha=0.5,
                label=f"{policy}: fails")
        if policy in ("colocated", "conductor"):
            a1.plot(x, [r["bound"][policy] for r in rows], "--", color=color, lw=0.8, label=f"{policy}: bound")
    both = [(xi, r["conductor"]["holds"] / r["colocated"]["holds"]) for xi, r in zip(x, rows)
            if r.get("conductor", {}).get("holds") and r.get("colocated", {}).get("holds")]
    a2.plot([b[0] for b in both], [b[1] for b in both], "o-", color="tab:green", label="measured knees")
    a2.plot(x, [r["bound"]["conductor"] / r["bound"]["colocated"] for r in rows], "--", color="grey", lw=0.8,
            label="bounds")
    a2.axhline(2.0, color="red", ls=":", lw=0.8)
    a1.set_ylabel("offered rate (req/s)")
    a2.set_ylabel("Conductor's knee / colocated's")
    for a in (a1, a2):
        a.set_xlabel(f"short requests' TPOT SLO (ms; long chains' {rows[0]['slo_tpot'][1] * 1e3:g} ms), {args.gpus} H200")
        a.invert_xaxis()
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "slo_sweep.png", dpi=110)
    print(f"wrote {out / 'slo_sweep.json'}, {out / 'slo_sweep.png'}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=16)
    p.add_argument("--variant", choices=sorted(VARIANTS))
    p.add_argument("--rates", type=float, nargs="*", default=[])
    p.add_argument("--warmup", type=float, default=480.0)
    p.add_argument("--window", type=float, default=60.0)
    p.add_argument("--cooldown", type=float, default=20.0)
    p.add_argument("--prefill-share", type=float, default=0.125)
    p.add_argument("--long-share", type=float, default=0.85)
    p.add_argument("--split", type=int, nargs=3, metavar=("P", "S", "L"),
                   help="conductor: P prefill + S short_decode + L long_decode instances (sets --prefill-share and "
                        "--long-share; results in OUT/VARIANT-P+S+L.json unless --tag is given)")
    p.add_argument("--early-stop", default="adaptive")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="each engine's batch cap (vLLM's default 256); with another, give a --tag")
    p.add_argument("--pool-max-num-seqs", nargs="+", metavar="POOL=N", default=None,
                   help="a pool's batch cap instead of --max-num-seqs (e.g. short_decode=1024); give a --tag")
    p.add_argument("--max-promotions", type=int, default=None,
                   help="conductor: promotions per round at least (default the router's, 8; every 0.5 s "
                        "here); with another, give a --tag")
    p.add_argument("--promotions-per-long-instance", type=float, default=None,
                   help="conductor: and per long_decode instance above that floor (default the router's, 0.5; "
                        "0: the floor alone, the cap before 2026-12-02 #4); with another, give a --tag")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--same-max-tokens", action="store_true",
                   help="every request asks for 32,768 tokens (max_tokens no longer tells chat from chains); "
                        "give a --tag or another --out")
    p.add_argument("--slo-ttft", type=float, nargs=2, metavar=("SHORT", "LONG"), default=None,
                   help="seconds to the first token (default 1 and 5, as thinkserve sim on GPUs); another: give a --tag")
    p.add_argument("--slo-tpot", type=float, nargs=2, metavar=("SHORT", "LONG"), default=None,
                   help="seconds per output token (default 0.05 and 0.08); another: give a --tag")
    p.add_argument("--length-predictor", choices=("warm", "cold"), default="warm",
                   help="conductor: start from a predictor fitted on a warm-up trace of the same generator with "
                        "another seed (warm, as a deployment ships one) or uninformed (cold; writes VARIANT-cold.json)")
    p.add_argument("--warm-up-requests", type=int, default=2000)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--tag", default="", help="suffix of the results file (e.g. another GPU split)")
    p.add_argument("--period", type=float, default=30.0, help="seconds per row of the placements table")
    p.add_argument("--sample-every", type=float, default=10.0,
                   help="simulated seconds per row of the pool state table (running branches, KV, step time)")
    p.add_argument("--drift-span", type=float, default=300.0,
                   help="simulated seconds at a run's end over which its pool state's drift is fitted (steady or not)")
    p.add_argument("--stop-failing-from", type=float, default=600.0,
                   help="from this simulated second on, stop a point once two adjacent windows (each --window long, "
                        "ending 10 s before the sample) have over 10%% of their requests certain to miss the SLO "
                        "(FailingStop; the point is recorded as failing, 'stopped_failing'); a negative value: never")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", action="store_true")
    p.add_argument("--sweep", nargs="+", metavar="DIR", default=None,
                   help="each policy's knee in each DIR (one per SLO, as --slo-tpot wrote them) beside the bound "
                        "under that SLO: OUT/slo_sweep.json and OUT/slo_sweep.png")
    p.add_argument("--bound", action="store_true", help="print the executor model's capacity bound (OUT/bound.json, or OUT/bound{TAG}.json)")
    p.add_argument("--bound-requests", type=int, default=40000, help="--bound: generated requests averaged over")
    args = p.parse_args()
    try:
        parse_pool_caps(args.pool_max_num_seqs)
    except ValueError as e:
        p.error(f"--pool-max-num-seqs: {e}")
    if args.split:
        prefill, short, long_ = args.split
        if prefill + short + long_ != args.gpus or min(args.split) < 1:
            p.error(f"--split {prefill} {short} {long_} must be three counts of at least 1 adding up to --gpus {args.gpus}")
        args.prefill_share, args.long_share = prefill / args.gpus, long_ / (short + long_)
        args.tag = args.tag or f"-{prefill}+{short}+{long_}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        return plot(out, args.drift_span)
    if args.sweep:
        slo_sweep(out, args.sweep, args)
        return
    if args.bound:
        (out / f"bound{args.tag}.json").write_text(json.dumps(capacity_bound(args), indent=1))
        return
    cold = args.length_predictor == "cold" and VARIANTS[args.variant]["policy"] == "conductor"
    path = out / f"{args.variant}{'-cold' if cold else ''}{args.tag}.json"
    done = json.loads(path.read_text()) if path.exists() else []
    for rate in args.rates:
        if any(s["rate"] == rate for s in done):
            continue
        s = run_point(args.variant, rate, args)
        done.append(s)
        path.write_text(json.dumps(done, indent=1))
        if s.get("stopped_failing"):
            f = s["stopped_failing"]
            print(f"{args.variant} @ {rate}: FAILING, stopped at {f['stopped_at_s']:.0f} s: " + "; ".join(
                f"[{w['window'][0]:.0f}, {w['window'][1]:.0f}) s: {w['certain_misses']} of {w['requests']} certain "
                f"misses (SLO <= {w['slo_attainment_at_most']:.1%})" for w in f["windows"])
                + f", cpu {s['cpu_s']:.0f} s", flush=True)
            print("  " + describe_drift(s["drift"]), flush=True)
            continue
        e = s["early_window"] or {}
        print(f"{args.variant} @ {rate}: SLO {s['slo_attainment']:.1%} (earlier window {e.get('slo_attainment', 0):.1%}), "
              f"short TTFT p99 {s['classes']['short']['ttft']['p99']:.3f} s, unfinished {s['unfinished_at_horizon']}, "
              f"cpu {s['cpu_s']:.0f} s", flush=True)
        print("  " + describe_drift(s["drift"]), flush=True)


if __name__ == "__main__":
    main()
