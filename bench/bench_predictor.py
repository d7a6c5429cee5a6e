"""Output-length predictor quality on the tiny-reasoner realistic mix (held-out split).

The shipped tiny-reasoner generates every problem (greedy, and temperature 1) with
``hidden_state_interval`` on, so each output comes with its real length, the prefill's final
hidden state and a decode hidden state every ``--interval`` tokens. Predictors learn online
over the ``train`` split (one SGD step per finished request, in arrival order) and are scored,
frozen, on the ``test`` split of ``tasks.py``:

* ``max_tokens``  today's LeastLoadedPolicy: the prediction is max_tokens (every request asks 1,500)
* ``prompt length`` the same LengthPredictor with only the prompt-length feature
* ``n-grams``       + hashed prompt n-grams
* ``n-grams + probe`` + the linear probe on the prefill hidden state (TRAIL-style)

Scores: MAE of the median (tokens), bucket accuracy (the most likely log2 bucket is the true
one), Kendall's tau-b of the medians against the true lengths, and the mean log-likelihood of
the true bucket. A second table scores refinement while decoding: for test outputs still running
at t tokens, the admission prediction, it conditioned on len >= t, and that times the decode probe.

    python bench/bench_predictor.py --train 600 --test 300      # ~3-5 min on a shared 2-core machine

``--fit PATH`` also fits the predictor a deployment starts from (its cold-start prior): the
Conductor's own model, trained for ``--fit-epochs`` passes over the train split of every
temperature (with the prefill and decode hidden states, as the cluster trains it online), scored
on the test split as it predicts at admission (prompt only) and at handoff (with the prefill's
hidden state), and written as JSON (``LengthPredictor.state``). The shipped tiny-reasoner's is
``workers/models/tiny_reasoner/length_predictor.json``, which a deployment serving that model loads
(``router.length_predictor: auto``)::

    python bench/bench_predictor.py --cache /tmp/gen.json --fit workers/models/tiny_reasoner/length_predictor.json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

from thinkserve.router.lengths import bucket_of
from thinkserve.router.predictor import LengthPredictor, PredictorConfig, ProgressState, features_for
from thinkserve.workers.tiny_reasoner import tasks

MAX_TOKENS = 1500


def generate(jobs: list[tuple[tasks.Problem, float]], interval: int, seed: int) -> list[dict]:
    """Run the tiny-reasoner on every (problem, temperature) in one engine (one continuous
    batch, so the longest chain bounds the run once); one record per output."""
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams

    eng = LLMEngine.from_pretrained("tiny-reasoner", max_num_seqs=256, seed=seed, kv_cache_memory_bytes=2**30,
                                    hidden_state_interval=interval)
    records: dict[str, dict] = {}
    for i, (p, temperature) in enumerate(jobs):
        rid = f"q{i}"
        eng.add_request(rid, tasks.prompt_for(p), SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS,
                                                                 seed=seed + i))
        records[rid] = {"level": p.level, "states": []}
    done = 0
    t0 = time.monotonic()
    while eng.has_unfinished_requests():
        for o in eng.step():
            c = o.outputs[0]
            rec = records[o.request_id]
            if c.hidden_state is not None:
                rec["states"].append((len(c.token_ids), [round(x, 5) for x in c.hidden_state]))
            if o.finished:
                rec.update(prompt=list(o.prompt_token_ids), length=len(c.token_ids),
                           correct=tasks.is_correct(jobs[int(o.request_id[1:])][0], c.text))
                done += 1
                if done % 200 == 0:
                    print(f"    {done}/{len(jobs)} generated ({time.monotonic() - t0:.0f} s)", flush=True)
    return [records[f"q{i}"] for i in range(len(jobs))]


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    conc = disc = tx = ty = 0
    n = len(x)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = x[i] - x[j], y[i] - y[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                conc += 1
            else:
                disc += 1
    denom = math.sqrt((conc + disc + tx) * (conc + disc + ty))
    return (conc - disc) / denom if denom else 0.0


def score(points: list[float], buckets: list[int], loglik: list[float], truth: list[int], edges) -> dict:
    n = len(truth)
    return {
        "mae": sum(abs(p - t) for p, t in zip(points, truth)) / n,
        "bucket_acc": sum(b == bucket_of(edges, t) for b, t in zip(buckets, truth)) / n,
        "tau": kendall_tau_b(points, truth),
        "loglik": sum(loglik) / n if loglik else float("nan"),
    }


PREDICTORS = {
    "prompt length": dict(use_ngrams=False, use_hidden=False),
    "n-grams": dict(use_hidden=False),
    "n-grams + probe": dict(),
}


def run(train: list[dict], test: list[dict]) -> tuple[dict, dict]:
    edges = PredictorConfig().edges
    truth = [r["length"] for r in test]
    table = {"max_tokens": score([MAX_TOKENS] * len(test), [bucket_of(edges, MAX_TOKENS)] * len(test), [],
                                 truth, edges)}
    refine_rows: dict = {}
    for name, kw in PREDICTORS.items():
        cfg = PredictorConfig(**kw)
        pred = LengthPredictor(cfg)

        def feats(r):
            hidden = r["states"][0][1] if r["states"] else None
            return features_for(r["prompt"], cfg, max_tokens=MAX_TOKENS, hidden=hidden)

        for r in train:                          # online: one step per finished request, in order
            progress = tuple(ProgressState(n, tuple(h)) for n, h in r["states"][1:])
            pred.observe(feats(r), r["length"], progress)
        dists = [pred.predict(feats(r)) for r in test]
        table[name] = score([d.median() for d in dists], [d.mode_bucket for d in dists],
                            [math.log(max(d.probs[bucket_of(edges, t)], 1e-12)) for d, t in zip(dists, truth)],
                            truth, edges)
        if name == "n-grams + probe":
            refine_rows = refinement(pred, test, dists, edges)
    return table, refine_rows


def refinement(pred: LengthPredictor, test: list[dict], dists, edges) -> dict:
    """At each decode checkpoint t, over test outputs longer than t: admission prediction vs
    conditioned on len >= t vs conditioned times the decode probe."""
    rows = {}
    checkpoints = sorted({n for r in test for n, _ in r["states"][1:]})
    for t in [c for c in checkpoints if c in (32, 64, 128, 256, 512)]:
        sel = [(r, d, dict((n, h) for n, h in r["states"])[t]) for r, d in zip(test, dists)
               if r["length"] > t and any(n == t for n, _ in r["states"])]
        if len(sel) < 10:
            continue
        truth = [r["length"] for r, _, _ in sel]
        variants = {
            "admission": [d for _, d, _ in sel],
            "conditioned": [d.at_least(t) for _, d, _ in sel],
            "conditioned + probe": [pred.refine(d, ProgressState(t, tuple(h))) for _, d, h in sel],
        }
        rows[t] = {"count": len(sel)}
        for name, ds in variants.items():
            rows[t][name] = score([d.median() for d in ds], [d.mode_bucket for d in ds],
                                  [math.log(max(d.probs[bucket_of(edges, n)], 1e-12)) for d, n in zip(ds, truth)],
                                  truth, edges)
    return rows


def print_tables(label: str, table: dict, refine_rows: dict) -> None:
    print(f"\n{label}: held-out test split, predictors trained online on the train split")
    print(f"  {'predictor':18s} {'MAE (tokens)':>13s} {'bucket acc':>11s} {'Kendall tau':>12s} {'mean loglik':>12s}")
    for name, s in table.items():
        print(f"  {name:18s} {s['mae']:13.1f} {s['bucket_acc']:11.3f} {s['tau']:12.3f} {s['loglik']:12.3f}")
    for t, row in refine_rows.items():
        print(f"  refinement at t = {t} tokens ({row['count']} outputs still running):")
        for name in ("admission", "conditioned", "conditioned + probe"):
            s = row[name]
            print(f"    {name:22s} MAE {s['mae']:7.1f}  bucket acc {s['bucket_acc']:.3f}  tau {s['tau']:.3f}  "
                  f"loglik {s['loglik']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train", type=int, default=600)
    ap.add_argument("--test", type=int, default=300)
    ap.add_argument("--interval", type=int, default=32, help="decode hidden state every k tokens")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--cache", type=Path, default=None, help="JSON file of generated outputs (reused if present)")
    ap.add_argument("--out", type=Path, default=None, help="write the tables as JSON here")
    ap.add_argument("--fit", type=Path, default=None, help="write a fitted predictor state (JSON) here")
    ap.add_argument("--fit-epochs", type=int, default=3)
    args = ap.parse_args()
    train_p = tasks.sample_mix(tasks.REALISTIC_MIX, args.train, seed=1, split="train")
    test_p = tasks.sample_mix(tasks.REALISTIC_MIX, args.test, seed=2, split="test")
    temps = [float(t) for t in args.temperatures.split(",")]
    data = json.loads(args.cache.read_text()) if args.cache and args.cache.exists() else {}
    missing = [t for t in temps if f"T={t:g}" not in data]
    if missing:
        jobs = [(p, t) for t in missing for p in train_p + test_p]
        print(f"generating {len(jobs)} outputs ({args.train} train + {args.test} test problems at temperatures "
              f"{', '.join(f'{t:g}' for t in missing)}) ...", flush=True)
        records = generate(jobs, args.interval, seed=11)
        per = len(train_p) + len(test_p)
        for k, t in enumerate(missing):
            chunk = records[k * per:(k + 1) * per]
            data[f"T={t:g}"] = {"train": chunk[:len(train_p)], "test": chunk[len(train_p):]}
        if args.cache:
            args.cache.write_text(json.dumps(data))
    results = {}
    for temp in temps:
        key = f"T={temp:g}"
        table, refine_rows = run(data[key]["train"], data[key]["test"])
        lengths = sorted(r["length"] for r in data[key]["test"])
        print_tables(f"temperature {temp:g} (test lengths: median {lengths[len(lengths) // 2]}, "
                     f"p90 {lengths[int(0.9 * len(lengths))]}, max {lengths[-1]})", table, refine_rows)
        results[key] = {"table": table, "refinement": {str(k): v for k, v in refine_rows.items()}}
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    if args.fit:
        fit(data, temps, args.fit_epochs, args.fit)


def fit(data: dict, temps: list[float], epochs: int, path: Path) -> None:
    """Train the deployment's starting predictor on every train record and write its state."""
    cfg = PredictorConfig()
    pred = LengthPredictor(cfg)
    train = [r for t in temps for r in data[f"T={t:g}"]["train"]]
    order = random.Random(0)

    def feats(r, hidden=True):
        h = r["states"][0][1] if hidden and r["states"] else None
        return features_for(r["prompt"], cfg, max_tokens=MAX_TOKENS, hidden=h)

    for _ in range(epochs):
        order.shuffle(train)
        for r in train:
            pred.observe(feats(r), r["length"], tuple(ProgressState(n, tuple(h)) for n, h in r["states"][1:]))
    edges = cfg.edges
    print(f"\nfitted predictor: {len(train)} train outputs x {epochs} epochs; held-out test split:")
    for t in temps:
        test = data[f"T={t:g}"]["test"]
        truth = [r["length"] for r in test]
        for label, hidden in (("admission (prompt)", False), ("handoff (+ prefill hidden)", True)):
            dists = [pred.predict(feats(r, hidden)) for r in test]
            sc = score([d.median() for d in dists], [d.mode_bucket for d in dists],
                       [math.log(max(d.probs[bucket_of(edges, x)], 1e-12)) for d, x in zip(dists, truth)], truth, edges)
            print(f"  T={t:g} {label:28s} MAE {sc['mae']:6.1f}  bucket acc {sc['bucket_acc']:.3f}  "
                  f"tau {sc['tau']:.3f}  loglik {sc['loglik']:.3f}")
    path.write_text(json.dumps(_rounded(pred.state()), separators=(",", ":")) + "\n")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


def _rounded(x):
    """Six significant digits: the file stays small, the predictions do not change visibly."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    return x


if __name__ == "__main__":
    main()
