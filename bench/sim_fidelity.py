"""Simulator fidelity: the fitted ``cpu`` kind against the real engine on the same arrivals.

The same tiny-reasoner request stream (prompt lengths, output lengths, arrival times; a scaled
reasoning mix) is run twice:

- real: the in-process engine (``LLMEngine``, what every cluster instance runs), driven by a
  small loop that adds each request at its arrival time (wall clock) and steps the engine;
  outputs have exactly the asked length (``ignore_eos``);
- simulated: ``thinkserve sim``'s colocated deployment on one ``cpu`` instance with the engine's
  own configuration (block size, batch limits, KV blocks) and the fit in cluster/sim/cpu_fit.json.

It prints mean and P90 TTFT and TPOT of both and the relative error (target: <= 15%). The machine
is shared: both runs see its load, the real one live and the simulated one through the fit.

    python bench/sim_fidelity.py [--requests 100] [--rate 1.0] [--threads 1] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from thinkserve.cluster.sim.cost import CPU_FIT_PATH, LinearCost
from thinkserve.cluster.sim.hardware import TINY_REASONER
from thinkserve.cluster.sim.setup import Deployment, build
from thinkserve.cluster.sim.workload import ReasoningMix
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_sim_cpu  # noqa: E402  (the measuring half of the fit, shared)

# The reasoning mix scaled to tiny-reasoner's 1,536-token context.
TINY_MIX = ReasoningMix(long_share=0.4, short_median=40, short_sigma=0.6, short_max=200, long_median=250,
                        max_output=1000, prompt_median_short=40, prompt_median_long=24, prompt_sigma=0.5,
                        prompt_max=300, best_of_n_share=0.0)


def run_real(reqs, seed: int, recorder: list | None = None) -> dict[str, tuple[float, float]]:
    engine = LLMEngine.from_pretrained("tiny-reasoner", seed=seed)
    rng = random.Random(seed)
    engine.generate([[5, 6, 7, 8]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    step = engine.step
    if recorder is not None:  # time every step of this very run (for --fit-from-run)
        rec = fit_sim_cpu.Recorder(engine)
        recorder.append((engine, rec))
        step = rec.step
    first, finish = {}, {}
    i, n = 0, len(reqs)
    t0 = time.perf_counter()
    while len(finish) < n:
        now = time.perf_counter() - t0
        while i < n and reqs[i].arrival <= now:
            r = reqs[i]
            engine.add_request(r.request_id, [rng.randrange(3, 60) for _ in range(r.prompt_len)],
                               SamplingParams(max_tokens=r.output_lens[0], ignore_eos=True, seed=i))
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, reqs[i].arrival - now)))
            continue
        outs = step()
        t = time.perf_counter() - t0
        for o in outs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = t
            if o.finished:
                finish[o.request_id] = t
    return {rid: (first[rid], finish[rid]) for rid in finish}


def run_sim(reqs, engine_cfg: dict, fit_path: Path) -> dict[str, tuple[float, float]]:
    cost = LinearCost.from_fit(TINY_REASONER, fit_path)
    sim = build(reqs, Deployment("colocated"), cost, 1, block_size=engine_cfg["block_size"],
                max_num_seqs=engine_cfg["max_num_seqs"],
                max_num_batched_tokens=engine_cfg["max_num_batched_tokens"]).run()
    return {rid: (rec.first_token, rec.finish) for rid, rec in sim.records.items()}


def stats(reqs, times) -> dict:
    ttft = [times[r.request_id][0] - r.arrival for r in reqs]
    tpot = [(times[r.request_id][1] - times[r.request_id][0]) / (r.output_lens[0] - 1)
            for r in reqs if r.output_lens[0] > 1]
    return {"ttft_mean": float(np.mean(ttft)), "ttft_p90": float(np.percentile(ttft, 90)),
            "tpot_mean": float(np.mean(tpot)), "tpot_p90": float(np.percentile(tpot, 90))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--refit", action="store_true",
                    help="measure a fresh (shorter) cpu fit right before the real run, so both see the same "
                         "machine load, and simulate with it instead of cluster/sim/cpu_fit.json")
    ap.add_argument("--fit-from-run", action="store_true",
                    help="also fit the step times of the real run itself and simulate with that fit: the "
                         "remaining error is the simulator's (scheduling, events), not the machine's load")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fit_path = CPU_FIT_PATH
    if args.refit:
        fit_path = Path(tempfile.mkdtemp()) / "cpu_fit.json"
        engine = LLMEngine.from_pretrained("tiny-reasoner", seed=args.seed)
        rec = fit_sim_cpu.Recorder(engine)
        fit_sim_cpu.measure(engine, rec, random.Random(args.seed), batches=(1, 4, 16, 32), max_steps=120,
                            prefill_rounds=1)
        fit_path.write_text(json.dumps(fit_sim_cpu.fit_result(engine, rec, args.threads)))
        del engine
    fit = json.loads(fit_path.read_text())
    reqs = TINY_MIX.generate(args.rate, args.requests, args.seed, max_model_len=1536)
    t = time.perf_counter()
    recorded: list = []
    real = run_real(reqs, args.seed, recorded if args.fit_from_run else None)
    real_wall = time.perf_counter() - t
    in_run = None
    if recorded:
        engine, rec = recorded[0]
        in_run_path = Path(tempfile.mkdtemp()) / "cpu_fit.json"
        in_run_path.write_text(json.dumps(fit_sim_cpu.fit_result(engine, rec, args.threads)))
        in_run = stats(reqs, run_sim(reqs, json.loads(in_run_path.read_text())["engine"], in_run_path))
    t = time.perf_counter()
    simulated = run_sim(reqs, fit["engine"], fit_path)
    sim_wall = time.perf_counter() - t
    a, b = stats(reqs, real), stats(reqs, simulated)
    report = {"requests": args.requests, "rate": args.rate, "real": a, "sim": b,
              "rel_error": {k: (b[k] - a[k]) / a[k] for k in a}, "real_wall_s": real_wall, "sim_wall_s": sim_wall,
              "fit": fit["coeffs"], "fit_measured": fit["measured"], "fit_quality": fit["fit_quality"],
              "refit": args.refit}
    print(f"{'metric':<10} {'real':>10} {'sim':>10} {'error':>8}   (shared 2-core machine)")
    for k in a:
        print(f"{k:<10} {a[k]:10.4f} {b[k]:10.4f} {report['rel_error'][k]:+8.1%}")
    print(f"real run {real_wall:.1f} s wall, simulation {sim_wall:.2f} s")
    if in_run is not None:
        report["sim_fit_from_run"] = in_run
        report["rel_error_fit_from_run"] = {k: (in_run[k] - a[k]) / a[k] for k in a}
        print("with a fit of the real run's own steps:")
        for k in a:
            print(f"{k:<10} {a[k]:10.4f} {in_run[k]:10.4f} {report['rel_error_fit_from_run'][k]:+8.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
