"""Fit the simulator's ``cpu`` kind: measure the real engine's step times on tiny-reasoner here.

Runs the in-process engine (``LLMEngine``, the one every instance runs) on a spread of batches:
single prompts of 8..1024 tokens, then decode batches of 1..64 branches whose contexts grow to
~1,400 tokens, with prompts joining running batches. Every ``step()`` is timed, and its plan is
summarised exactly as the simulator summarises one (``SimInstance._shape``). A least-squares fit

    step = c0 + c_prefill * prompt tokens + c_decode * decoding branches + c_ctx * attended positions

goes to ``cluster/sim/cpu_fit.json``, which ``--gpu cpu`` loads. The fit is only as good as this
machine was quiet: it is shared, so the script prints the fit's error on its own samples.

    python bench/fit_sim_cpu.py [--threads 1] [--out cluster/sim/cpu_fit.json]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from thinkserve.cluster.sim.instance import SimInstance
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
# TCP page-set transfer between two processes on this machine (docs/kvtransfer.md: ~3.5 GB/s at
# 64 MiB, less for small page sets); tiny-reasoner page sets are small, so latency dominates.
LOOPBACK_BW = 1.0e9
LOOPBACK_LATENCY_S = 0.003


class Recorder:
    """Wraps the engine's scheduler so each step's plan shape is known before it is computed."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.shape = engine, None
        orig = engine.scheduler.schedule

        def schedule():
            out = orig()
            self.shape = SimInstance._shape(out)
            return out

        engine.scheduler.schedule = schedule
        self.samples: list[tuple[int, int, int, int, float]] = []

    def step(self) -> list:
        t = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t
        s = self.shape
        if s is not None and (s.prefill_tokens or s.num_decode):
            self.samples.append((s.prefill_tokens, s.num_decode, s.prefill_ctx + s.decode_ctx, 1, dt))
        return outs


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 60) for _ in range(n)]


def measure(engine: LLMEngine, rec: Recorder, rng: random.Random, *, batches=(1, 2, 4, 8, 16, 32, 64),
            max_steps: int = 250, prefill_rounds: int = 2) -> None:
    rid = 0

    def add(prompt_len: int, max_tokens: int) -> None:
        nonlocal rid
        rid += 1
        engine.add_request(f"fit{rid}", random_prompt(rng, prompt_len),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=rid))

    for _ in range(prefill_rounds):  # prefill alone
        for n in (8, 32, 64, 128, 256, 512, 1024):
            add(n, 1)
            while engine.has_unfinished_requests():
                rec.step()
    for batch in batches:  # decode batches, prompts joining them
        for i in range(batch):
            add(rng.choice((16, 64, 200)), rng.randint(200, 1300))
        steps = 0
        while engine.has_unfinished_requests() and steps < max_steps:
            rec.step()
            steps += 1
            if steps % 97 == 0:
                add(rng.choice((64, 300, 600)), rng.randint(50, 400))
        for r in list(engine.scheduler.requests):
            engine.abort(r)


def fit(samples) -> tuple[dict, dict]:
    a = np.array(samples, dtype=float)
    warm = a[5:]  # the first steps pay for allocation and thread start-up
    x = np.column_stack([np.ones(len(warm)), warm[:, 0], warm[:, 1], warm[:, 2]])
    y = warm[:, 4]
    # Non-negative least squares by elimination: a term fitted negative is dropped and the rest
    # refitted (a step never gets faster with more work).
    keep = list(range(x.shape[1]))
    while True:
        sol, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (sol >= 0).all():
            break
        keep.pop(int(np.argmin(sol)))
    coef = np.zeros(x.shape[1])
    coef[keep] = sol
    pred = x @ coef
    rel = np.abs(pred - y) / y
    quality = {"samples": int(len(y)), "median_rel_error": float(np.median(rel)),
               "p90_rel_error": float(np.percentile(rel, 90)),
               "total_time_error": float(abs(pred.sum() - y.sum()) / y.sum())}
    return {k: float(v) for k, v in zip(("c0", "c_prefill", "c_decode", "c_ctx"), coef)}, quality


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "cluster" / "sim" / "cpu_fit.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_pretrained("tiny-reasoner", seed=args.seed)
    rec = Recorder(engine)
    t0 = time.perf_counter()
    measure(engine, rec, random.Random(args.seed))
    result = fit_result(engine, rec, args.threads)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    coeffs, quality = result["coeffs"], result["fit_quality"]
    print(f"{len(rec.samples)} steps in {time.perf_counter() - t0:.1f} s; fit {coeffs}")
    print(f"fit error on its samples: median {quality['median_rel_error']:.1%}, p90 {quality['p90_rel_error']:.1%}, "
          f"total time {quality['total_time_error']:.1%}; wrote {args.out}")
    return 0


def fit_result(engine: LLMEngine, rec: Recorder, threads: int) -> dict:
    coeffs, quality = fit(rec.samples)
    cfg = engine.config
    return {
        "model": "tiny-reasoner",
        "coeffs": coeffs,
        "fit_quality": quality,
        "kv_capacity_tokens": cfg.num_device_blocks * cfg.block_size,
        "engine": {"block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                   "max_num_batched_tokens": cfg.max_num_batched_tokens, "threads": threads},
        "transfer_bw": LOOPBACK_BW,
        "transfer_latency_s": LOOPBACK_LATENCY_S,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": "shared 2-core machine; refit with bench/fit_sim_cpu.py",
    }


if __name__ == "__main__":
    raise SystemExit(main())
