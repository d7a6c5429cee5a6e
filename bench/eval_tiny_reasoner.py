"""Evaluates the tiny-reasoner: accuracy per level (greedy and temperature 1.0), output length
per level (mean / p50 / p99), answer-format rate, and Best-of-N majority-vote accuracy
maj@1/4/8/16.

    python bench/eval_tiny_reasoner.py --out /tmp/tiny-eval             # thinkserve's engine, ~15 min on 2 cores
    python bench/eval_tiny_reasoner.py --out /tmp/tiny-eval --quick     # a couple of minutes
    python bench/eval_tiny_reasoner.py --backend hf --model DIR ...     # Hugging Face transformers

Problems come from the held-out ``test`` split of ``tasks.py`` (seeded, so runs compare).
maj@k: the 16 samples of a problem are cut into 16/k disjoint groups; each group votes (the most
frequent parsed answer, ties to the one seen first; unparsable outputs do not vote) and maj@k is
the mean correctness over groups and problems, so maj@1 is the single-sample accuracy at T=1.0.
Output length counts generated tokens, EOS included, over the greedy and the sampled outputs
(a sample that never closes its chain stops at --max-tokens). Writes ``results.json`` and
``maj_at_k.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from thinkserve.workers.tiny_reasoner import tasks

VOTE_KS = (1, 4, 8, 16)


# ---------------------------------------------------------------- generation backends


class Backend:
    name = "?"

    def generate(self, prompts: list[str], *, n: int, temperature: float, max_tokens: int, seed: int) -> list[list[tuple[str, int]]]:
        """For each prompt, ``n`` outputs as (text, number of generated tokens)."""
        raise NotImplementedError


class EngineBackend(Backend):
    """thinkserve's own engine (continuous batching, paged KV cache)."""

    name = "thinkserve"

    def __init__(self, model: str, device: str):
        from thinkserve.workers.engine import LLMEngine

        self.engine = LLMEngine.from_pretrained(model, device=device, max_num_seqs=128, seed=0,
                                                kv_cache_memory_bytes=512 * 2**20)

    def generate(self, prompts, *, n, temperature, max_tokens, seed):
        from thinkserve.workers.sampling_params import SamplingParams

        params = [SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(len(prompts))]
        results = []
        chunk = max(1, 128 // n)  # keep the batch near max_num_seqs
        for start in range(0, len(prompts), chunk):
            outs = self.engine.generate(prompts[start:start + chunk], params[start:start + chunk])
            for out in outs:
                results.append([(c.text, len(c.token_ids)) for c in sorted(out.outputs, key=lambda c: c.index)])
        return results


class HFBackend(Backend):
    """Hugging Face transformers ``generate`` (the fallback, and a cross-check of the engine)."""

    name = "hf"

    def __init__(self, model: str, device: str):
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        from thinkserve.workers.loader import resolve_model_path

        path = resolve_model_path(model)
        self.torch = torch
        self.device = device
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id

    def generate(self, prompts, *, n, temperature, max_tokens, seed):
        torch = self.torch
        batch = max(1, 64 // n)
        results = []
        for start in range(0, len(prompts), batch):
            chunk = prompts[start:start + batch]
            enc = self.tok(chunk, return_tensors="pt", padding=True).to(self.device)
            torch.manual_seed(seed + start)
            kwargs = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
            with torch.no_grad():
                out = self.model.generate(**enc, max_new_tokens=max_tokens, num_return_sequences=n,
                                          eos_token_id=self.eos, pad_token_id=self.pad, **kwargs)
            gen = out[:, enc["input_ids"].shape[1]:].tolist()
            for i in range(len(chunk)):
                group = []
                for ids in gen[i * n:(i + 1) * n]:
                    if self.eos in ids:
                        ids = ids[:ids.index(self.eos) + 1]
                    else:
                        ids = [t for t in ids if t != self.pad]
                    text = self.tok.decode([t for t in ids if t != self.eos], skip_special_tokens=False)
                    group.append((text, len(ids)))
                results.append(group)
        return results


def make_backend(name: str, model: str, device: str) -> Backend:
    if name == "auto":
        try:
            return EngineBackend(model, device)
        except ImportError as e:  # the engine is not part of this checkout
            print(f"thinkserve engine unavailable ({e}); falling back to transformers", file=sys.stderr)
            return HFBackend(model, device)
    return EngineBackend(model, device) if name == "thinkserve" else HFBackend(model, device)


# ---------------------------------------------------------------- metrics


def majority_vote(answers: Sequence[int | None]) -> int | None:
    """The most frequent non-None answer; ties go to the answer seen first."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    return next(a for a in answers if a is not None and counts[a] == best)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(values)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


@dataclass
class LevelResult:
    level: int
    name: str
    greedy_acc: float = 0.0
    greedy_format: float = 0.0
    sample_acc: float = 0.0
    len_mean: float = 0.0
    len_p50: float = 0.0
    len_p99: float = 0.0
    maj: dict[int, float] = field(default_factory=dict)
    n_greedy: int = 0
    n_vote: int = 0


def evaluate(backend: Backend, levels: Sequence[int], n_greedy: int, n_vote: int, samples: int, seed: int,
             max_tokens: int) -> list[LevelResult]:
    results = []
    for level in levels:
        lv = tasks.get_level(level)
        t0 = time.time()
        res = LevelResult(level, lv.name, n_greedy=n_greedy, n_vote=n_vote)
        problems = tasks.generate_problems(level, n_greedy, seed, split="test")
        greedy = backend.generate([tasks.prompt_for(p) for p in problems], n=1, temperature=0.0, max_tokens=max_tokens, seed=seed)
        answers = [tasks.parse_answer(g[0][0]) for g in greedy]
        res.greedy_acc = statistics.mean(a == p.answer for a, p in zip(answers, problems))
        res.greedy_format = statistics.mean(a is not None for a in answers)
        lengths = [g[0][1] for g in greedy]

        vote_problems = problems[:n_vote]
        sampled = backend.generate([tasks.prompt_for(p) for p in vote_problems], n=samples, temperature=1.0,
                                   max_tokens=max_tokens, seed=seed + 1000)
        per_k: dict[int, list[bool]] = {k: [] for k in VOTE_KS if k <= samples}
        sample_correct = []
        for p, outs in zip(vote_problems, sampled):
            ans = [tasks.parse_answer(text) for text, _ in outs]
            sample_correct += [a == p.answer for a in ans]
            lengths += [n for _, n in outs]
            for k in per_k:
                for g in range(samples // k):
                    per_k[k].append(majority_vote(ans[g * k:(g + 1) * k]) == p.answer)
        res.sample_acc = statistics.mean(sample_correct) if sample_correct else float("nan")
        res.maj = {k: statistics.mean(v) for k, v in per_k.items() if v}
        res.len_mean = statistics.mean(lengths)
        res.len_p50 = percentile(lengths, 50)
        res.len_p99 = percentile(lengths, 99)
        results.append(res)
        print(f"  level {level} done in {time.time() - t0:.0f}s: greedy {res.greedy_acc:.0%}, T=1 {res.sample_acc:.0%}, "
              f"maj@{max(per_k)} {res.maj.get(max(per_k), float('nan')):.0%}", flush=True)
    return results


def mix_length_stats(count: int = 4000, seed: int = 0) -> dict[str, float]:
    """Reference-solution output lengths (tokens, EOS included) of REALISTIC_MIX."""
    from thinkserve.workers.tiny_reasoner.tokenizer_build import build_tokenizer

    tok = build_tokenizer()
    lengths = [len(tok.encode(tasks.solution_for(p), add_special_tokens=False).ids) + 1
               for p in tasks.sample_mix(tasks.REALISTIC_MIX, count, seed)]
    p50, p99 = percentile(lengths, 50), percentile(lengths, 99)
    return {"p50": p50, "p99": p99, "max": max(lengths), "p99_over_p50": p99 / p50}


def format_table(results: list[LevelResult]) -> str:
    ks = sorted({k for r in results for k in r.maj})
    head = (f"{'level':<26} {'greedy':>7} {'fmt':>5} {'T=1.0':>6} {'len mean':>8} {'p50':>5} {'p99':>5}  "
            + " ".join(f"{'maj@' + str(k):>7}" for k in ks))
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.name:<26} {r.greedy_acc:>7.1%} {r.greedy_format:>5.0%} {r.sample_acc:>6.1%} {r.len_mean:>8.0f} "
                     f"{r.len_p50:>5.0f} {r.len_p99:>5.0f}  " + " ".join(f"{r.maj.get(k, float('nan')):>7.1%}" for k in ks))
    return "\n".join(lines)


def plot(results: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ks = sorted(r.maj)
        ax.plot(ks, [100 * r.maj[k] for k in ks], marker="o", label=r.name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(VOTE_KS), [str(k) for k in VOTE_KS])
    ax.set_xlabel("samples voting (k), temperature 1.0")
    ax.set_ylabel("majority-vote accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-reasoner", help="tiny-reasoner (shipped) or a model directory")
    p.add_argument("--out", required=True, help="directory for results.json and maj_at_k.png")
    p.add_argument("--backend", choices=("auto", "thinkserve", "hf"), default="auto",
                   help="auto: thinkserve's engine, transformers if the engine cannot be imported")
    p.add_argument("--device", default="cpu")
    p.add_argument("--levels", default="all", help="comma-separated level ids, or 'all'")
    p.add_argument("--problems", type=int, default=40, help="greedy problems per level")
    p.add_argument("--vote-problems", type=int, default=10, help="problems per level sampled --samples times at T=1.0")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="10 greedy problems and 3 voted problems per level")
    args = p.parse_args(argv)
    if args.quick:
        args.problems, args.vote_problems = 10, 3

    import torch

    torch.set_num_threads(args.threads)
    levels = [lv.level for lv in tasks.LEVELS] if args.levels == "all" else [int(x) for x in args.levels.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = make_backend(args.backend, args.model, args.device)
    print(f"tiny-reasoner eval: model={args.model} backend={backend.name} levels={levels} greedy={args.problems}/level "
          f"voting={args.vote_problems}x{args.samples}/level", flush=True)
    t0 = time.time()
    results = evaluate(backend, levels, args.problems, min(args.vote_problems, args.problems), args.samples, args.seed,
                       args.max_tokens)
    mix = mix_length_stats()
    table = format_table(results)
    print()
    print(table)
    print(f"\nrealistic mix (reference chains, tokens): p50 {mix['p50']:.0f}, p99 {mix['p99']:.0f} "
          f"(p99/p50 = {mix['p99_over_p50']:.0f}x), max {mix['max']:.0f}")
    print(f"wall time {time.time() - t0:.0f}s")
    (out / "results.json").write_text(json.dumps({
        "model": args.model, "backend": backend.name, "seed": args.seed, "samples": args.samples,
        "levels": [r.__dict__ for r in results], "realistic_mix_lengths": mix,
    }, indent=2, default=str) + "\n")
    plot(results, out / "maj_at_k.png", f"tiny-reasoner maj@k ({backend.name}, T=1.0)")
    print(f"wrote {out / 'results.json'} and {out / 'maj_at_k.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
