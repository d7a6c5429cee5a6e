"""Best-of-N early consensus on the tiny-reasoner: branch tokens and accuracy of a fixed N against
the early-stopping rules, on thinkserve's engine, driven by the same wave/stop controller the
cluster's frontend uses (``thinkserve.router.consensus``).

    python bench/bench_consensus.py --out /tmp/consensus                      # levels 5-9, a few minutes
    python bench/bench_consensus.py --out DIR --problems 10 --rules none,unbeatable,adaptive,esc

Every rule runs over the same held-out problems (``tasks`` test split), all in one engine at once. A branch
is one engine request whose seed is ``branch_seed(problem seed, index)``, so branch i of a problem
samples the same chain under every rule (paired runs: a rule can only differ from the fixed N by
when it stops, not by luck of the draw; the table reports how many branches that finished under
both runs came out identical). The controller launches branches in waves of ``--wave`` (all N at
once for ``none``), and when it stops, its running branches are aborted in the engine at once
(their tokens so far count as spent) and the unlaunched ones never start.

Branch tokens: every token generated for the problem's branches, cancelled ones included.
Steps to done: engine steps until a problem's vote is decided (a latency proxy: waves trade
latency for work). Writes ``results.json`` and ``voting_curve.png`` (accuracy against branch
tokens: maj@k for k = 1, 2, 4, 8, 16 of the fixed-N run's branches 0..k-1, and each rule).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from thinkserve.router import majority_vote
from thinkserve.router.answers import get_extractor
from thinkserve.router.consensus import NONE, Consensus, WavePlan, make_rule
from thinkserve.workers.sampling_params import SamplingParams, branch_seed
from thinkserve.workers.tiny_reasoner import tasks


@dataclass
class ProblemRun:
    problem: tasks.Problem
    seed: int
    consensus: Consensus
    tokens: dict[int, int] = field(default_factory=dict)         # branch -> tokens generated
    answers: dict[int, str | None] = field(default_factory=dict)  # finished branches
    texts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    steps_to_done: int | None = None

    @property
    def correct(self) -> bool:
        return self.consensus.vote().answer == str(self.problem.answer)


def branch_weight(out) -> float:
    """Mean token probability of a branch (exp of its mean logprob), in (0, 1]."""
    lps = [d[t] for d, t in zip(out.logprobs or (), out.token_ids) if t in d]
    return math.exp(sum(lps) / len(lps)) if lps else 1.0


def run_rules(engine, problems, rules: list[str], *, n: int, wave: int, max_tokens: int, seed: int, extractor,
              weighted: bool) -> dict[str, list[ProblemRun]]:
    """Every rule's Best-of-N runs over ``problems``, all in the one engine at once (one clock: the
    rules' steps-to-done compare directly, and the wall time is the longest run's, not the sum)."""
    live: dict[str, tuple[ProblemRun, int]] = {}

    def rid(rule: str, run: ProblemRun, i: int) -> str:
        return f"{rule}/{run.seed}/{i}"

    def launch(rule: str, run: ProblemRun, branches) -> None:
        for i in branches:
            params = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, seed=branch_seed(run.seed, i),
                                    logprobs=0 if weighted else None)
            engine.add_request(rid(rule, run, i), tasks.prompt_for(run.problem), params)
            live[rid(rule, run, i)] = (run, i)
            run.tokens[i] = 0

    runs: dict[str, list[ProblemRun]] = {}
    by_run: dict[int, str] = {}
    for rule_name in rules:
        rule = make_rule(rule_name)
        runs[rule_name] = []
        for k, p in enumerate(problems):
            run = ProblemRun(p, seed * 100_003 + k, Consensus(n, rule, WavePlan.for_rule(n, rule, wave),
                                                              weighted=weighted))
            by_run[id(run)] = rule_name
            launch(rule_name, run, run.consensus.start().launch)
            runs[rule_name].append(run)
    t0, last_print, steps = time.time(), time.time(), 0
    while live:
        outs = engine.step()
        steps += 1
        for o in outs:
            entry = live.get(o.request_id)
            if entry is None:
                continue
            run, i = entry
            out = o.outputs[0]
            run.tokens[i] = len(out.token_ids)
            if not o.finished:
                continue
            del live[o.request_id]
            run.answers[i] = extractor(out.text)
            run.texts[i] = tuple(out.token_ids)
            run.weights[i] = branch_weight(out) if weighted else 1.0
            d = run.consensus.on_finished(i, run.answers[i], run.weights[i])
            rule = by_run[id(run)]
            for j in d.cancel:                       # free their KV now: the point of stopping
                engine.abort(rid(rule, run, j))
                live.pop(rid(rule, run, j))
            launch(rule, run, d.launch)
            if d.done:
                run.steps_to_done = steps
        if not outs and not engine.has_unfinished_requests() and live:
            raise RuntimeError(f"engine idle with {len(live)} branches outstanding")
        if time.time() - last_print > 15:
            done = {r: sum(x.consensus.done for x in rs) for r, rs in runs.items()}
            print(f"    step {steps}, {time.time() - t0:.0f}s: problems decided {done}, {len(live)} branches running",
                  flush=True)
            last_print = time.time()
    engine.check_integrity()
    stats = engine.stats()
    if stats.num_free_blocks != stats.num_total_blocks:
        raise RuntimeError(f"{stats.num_total_blocks - stats.num_free_blocks} KV blocks still held at the end")
    return runs


def replay_rule(rule_name: str, full: list[ProblemRun], *, n: int, wave: int, weighted: bool) -> list[ProblemRun]:
    """``rule_name``'s controller over branches already generated in full (the fixed-N run), on an
    engine-step clock: a launched branch emits one token per step (continuous batching with the
    batch below max_num_seqs, as in the live runs) and finishes after its recorded length; a
    cancelled one has spent the steps since its launch. Lets one fixed-N engine run price every
    rule without the waves' sequential depth in wall time."""
    import heapq

    rule = make_rule(rule_name)
    runs = []
    for base in full:
        run = ProblemRun(base.problem, base.seed, Consensus(n, rule, WavePlan.for_rule(n, rule, wave), weighted=weighted))
        launched_at: dict[int, int] = {}
        pending: list[tuple[int, int]] = []

        def launch(branches, t):
            for i in branches:
                launched_at[i] = t
                heapq.heappush(pending, (t + base.tokens[i], i))
        launch(run.consensus.start().launch, 0)
        while pending and not run.consensus.done:
            t, i = heapq.heappop(pending)
            run.tokens[i], run.answers[i] = base.tokens[i], base.answers[i]
            d = run.consensus.on_finished(i, base.answers[i], base.weights[i])
            for j in d.cancel:
                run.tokens[j] = t - launched_at[j]
            launch(d.launch, t)
            run.steps_to_done = t
        runs.append(run)
    return runs


def save_branches(path: Path, runs: list[ProblemRun]) -> None:
    """The fixed-N run's branches (length, answer, weight), for replays with other rules or waves."""
    path.write_text(json.dumps([{"level": r.problem.level, "operands": r.problem.operands, "seed": r.seed,
                                 "tokens": [r.tokens[i] for i in sorted(r.tokens)],
                                 "answers": [r.answers[i] for i in sorted(r.answers)],
                                 "weights": [r.weights[i] for i in sorted(r.weights)]} for r in runs]) + "\n")


def load_branches(path: Path, problems, n: int, weighted: bool) -> list[ProblemRun]:
    rows = json.loads(path.read_text())
    if [(r["level"], tuple(r["operands"])) for r in rows] != [(p.level, p.operands) for p in problems] \
            or any(len(r["tokens"]) != n for r in rows):
        raise ValueError(f"{path} holds other problems or another n than --levels/--problems/--seed/--n ask for")
    runs = []
    for r, p in zip(rows, problems):
        run = ProblemRun(p, r["seed"], Consensus(n, make_rule(NONE), WavePlan(n, n), weighted=weighted))
        run.tokens, run.answers = dict(enumerate(r["tokens"])), dict(enumerate(r["answers"]))
        run.weights = dict(enumerate(r["weights"])) if weighted else {i: 1.0 for i in range(n)}
        run.consensus.start()
        for i in range(n):
            run.consensus.on_finished(i, run.answers[i], run.weights[i])
        run.steps_to_done = max(r["tokens"])
        runs.append(run)
    return runs


def summarize(runs: list[ProblemRun]) -> dict:
    return {
        "problems": len(runs),
        "accuracy": statistics.mean(r.correct for r in runs),
        "branch_tokens": sum(sum(r.tokens.values()) for r in runs),
        "branches_finished": statistics.mean(len(r.answers) for r in runs),
        "branches_cancelled": statistics.mean(len(r.consensus.cancelled) for r in runs),
        "steps_to_done": statistics.mean(r.steps_to_done for r in runs),
    }


def majority_curve(runs: list[ProblemRun], n: int) -> list[tuple[int, float, float]]:
    """(k, accuracy, mean branch tokens per problem) voting over branches 0..k-1 of a fixed-N run."""
    out = []
    k = 1
    while k <= n:
        acc = statistics.mean(majority_vote([r.answers[i] for i in range(k)]).answer == str(r.problem.answer)
                              for r in runs)
        out.append((k, acc, statistics.mean(sum(r.tokens[i] for i in range(k)) for r in runs)))
        k *= 2
    return out


def plot(curve, points: dict[str, tuple[float, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([c[2] for c in curve], [100 * c[1] for c in curve], marker="o", color="gray", label="fixed N (maj@k)")
    for k, acc, tok in curve:
        ax.annotate(f"k={k}", (tok, 100 * acc), textcoords="offset points", xytext=(4, -10), fontsize=7)
    for name, (tok, acc) in points.items():
        ax.plot([tok], [100 * acc], marker="*", markersize=12, linestyle="none", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("branch tokens per problem (log)")
    ax.set_ylabel("vote accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for results.json and voting_curve.png")
    p.add_argument("--model", default="tiny-reasoner")
    p.add_argument("--device", default="cpu")
    p.add_argument("--levels", default="5,6,7,8,9")
    p.add_argument("--problems", type=int, default=2, help="held-out problems per level")
    p.add_argument("--n", type=int, default=16, help="branches per problem (Best-of-N)")
    p.add_argument("--wave", type=int, default=4, help="branches running at once per problem under a stopping rule")
    p.add_argument("--rules", default="none,unbeatable,adaptive", help="comma-separated; the first is the baseline")
    p.add_argument("--extractor", default="answer", help="answer extractor: answer, boxed, last_number")
    p.add_argument("--weighted", action="store_true", help="weight votes by each branch's mean token probability")
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--branches", help="replay: read the fixed-N branches from this branches.json of an earlier run "
                                      "instead of generating them")
    p.add_argument("--mode", choices=("live", "replay"), default="live",
                   help="live: every rule drives the engine (all at once); replay: the engine runs the fixed N, "
                        "every rule's controller then replays over those branches on a step clock")
    args = p.parse_args(argv)
    rules = args.rules.split(",")
    if rules[0] != NONE:
        p.error("--rules must start with none (the fixed-N baseline)")
    import torch

    from thinkserve.workers.engine import LLMEngine

    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extractor = get_extractor(args.extractor)
    problems = [pr for lv in levels for pr in tasks.generate_problems(lv, args.problems, args.seed, split="test")]
    print(f"early consensus: levels {levels}, {args.problems} held-out problems/level, Best-of-{args.n} at T=1.0, "
          f"wave {args.wave}, rules {rules}, mode {args.mode}; one shared 2-core machine", flush=True)
    t0 = time.time()
    if args.branches:
        if args.mode != "replay":
            p.error("--branches needs --mode replay")
        live_none = load_branches(Path(args.branches), problems, args.n, args.weighted)
    else:
        engine = LLMEngine.from_pretrained(args.model, device=args.device, max_num_seqs=args.max_num_seqs, seed=0,
                                           kv_cache_memory_bytes=1024 * 2**20)
        results = run_rules(engine, problems, rules if args.mode == "live" else [NONE], n=args.n, wave=args.wave,
                            max_tokens=args.max_tokens, seed=args.seed, extractor=extractor, weighted=args.weighted)
        live_none = results[NONE]
        save_branches(out / "branches.json", live_none)
    wall = time.time() - t0
    if args.mode == "replay":
        results = {rule: replay_rule(rule, live_none, n=args.n, wave=args.wave, weighted=args.weighted) for rule in rules}
        assert summarize(results[NONE])["branch_tokens"] == summarize(live_none)["branch_tokens"]

    base = results[rules[0]]
    rows, report = [], {"mode": args.mode, "levels": levels, "problems_per_level": args.problems, "n": args.n, "wave": args.wave,
                        "weighted": args.weighted, "wall_s": wall, "rules": {}}
    head = (f"{'rule':<11} {'level':>5} {'acc':>6} {'Δacc pt':>7} {'branch tok':>10} {'vs N':>6} {'fin/prob':>8} "
            f"{'canc/prob':>9} {'steps':>6} {'=vote N':>7}")
    for rule in rules:
        report["rules"][rule] = {}
        for lv in levels + ["all"]:
            sel = [k for k, pr in enumerate(problems) if lv == "all" or pr.level == lv]
            s = summarize([results[rule][k] for k in sel])
            b = summarize([base[k] for k in sel])
            same_vote = statistics.mean(results[rule][k].consensus.vote().answer == base[k].consensus.vote().answer
                                        for k in sel)
            s.update(token_ratio=s["branch_tokens"] / b["branch_tokens"], accuracy_delta_pt=100 * (s["accuracy"] - b["accuracy"]),
                     same_vote_as_fixed_n=same_vote)
            report["rules"][rule][str(lv)] = s
            rows.append(f"{rule:<11} {lv!s:>5} {s['accuracy']:>6.1%} {s['accuracy_delta_pt']:>+7.1f} "
                        f"{s['branch_tokens']:>10,} {s['token_ratio']:>6.2f} {s['branches_finished']:>8.1f} "
                        f"{s['branches_cancelled']:>9.1f} {s['steps_to_done']:>6.0f} {same_vote:>7.0%}")
    # paired runs: branches that finished under both runs should be the same chain
    both = same = 0
    for rule in rules[1:] if args.mode == "live" else ():
        for r, b in zip(results[rule], base):
            for i, toks in r.texts.items():
                both += 1
                same += toks == b.texts.get(i)
    report["paired_identical_branches"] = same / both if both else None
    curve = majority_curve(base, args.n)
    report["fixed_n_curve"] = [{"k": k, "accuracy": a, "branch_tokens_per_problem": t} for k, a, t in curve]
    print()
    print(head)
    print("-" * len(head))
    print("\n".join(rows))
    print(f"\nfixed N majority curve (branches 0..k-1): " + ", ".join(f"maj@{k} {a:.0%} @ {t:,.0f} tok" for k, a, t in curve))
    if both:
        print(f"paired check: {same}/{both} branches finished under both a rule and fixed N are identical chains")
    print(f"mode {args.mode}; engine wall time {wall:.0f}s (shared 2-core machine)")
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    points = {rule: (report["rules"][rule]["all"]["branch_tokens"] / len(problems), report["rules"][rule]["all"]["accuracy"])
              for rule in rules}
    plot(curve, points, out / "voting_curve.png",
         f"tiny-reasoner L{levels[0]}-{levels[-1]}, Best-of-{args.n}, T=1.0, wave {args.wave} "
         f"({len(problems)} problems, {args.mode})")
    print(f"wrote {out / 'results.json'} and {out / 'voting_curve.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
