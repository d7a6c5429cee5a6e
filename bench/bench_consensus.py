"""Best-of-N early consensus on the tiny-reasoner: branch tokens and accuracy of a fixed N against
the early-stopping rules, on thinkserve's engine, with the controller the cluster's frontend runs
(``thinkserve.router.consensus.Consensus``).

    # 1. sample every problem's N branches in full (resumable, shardable; token counting, no timing)
    nice -n 15 python bench/bench_consensus.py --mode generate --problems 40 --branches b0.jsonl --shard 0/2
    # 2. replay every rule over those branches: paired accuracy difference with a bootstrap 95% CI
    python bench/bench_consensus.py --mode replay --problems 40 --branches b0.jsonl,b1.jsonl --out DIR
    # 3. live: every rule drives the engine in turn (waves, real aborts), wall time beside fixed N
    python bench/bench_consensus.py --mode live --problems 2 --out DIR

Problems are the ``tasks`` held-out split, ``--problems`` per level; problem j of level L samples
branch i with seed ``branch_seed(problem_seed(seed, L, j), i)`` in every mode, so branch i is the
same chain under every rule and in replay and live runs alike (live runs check it).

Replay (``consensus_replay``) is Adaptive-Consistency's evaluation: each rule's controller over
the same branches in the order they would launch, on an engine-step clock; cancelled branches
count the tokens they had generated. Live mode runs the rules one after another in one engine:
the controller launches waves of ``--wave`` (all N at once for ``none``), aborts running branches
in the engine when it stops (their KV freed at once), and never starts the rest.
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

import consensus_replay as cr
from thinkserve.router.answers import get_extractor
from thinkserve.router.consensus import NONE, Consensus, WavePlan, make_rule
from thinkserve.workers.sampling_params import SamplingParams, branch_seed
from thinkserve.workers.tiny_reasoner import tasks


def problem_seed(seed: int, level: int, index: int) -> int:
    return seed * 100_003 + level * 1_000 + index


@dataclass
class ProblemRun:
    level: int
    index: int
    problem: tasks.Problem
    seed: int
    consensus: Consensus
    tokens: dict[int, int] = field(default_factory=dict)         # branch -> tokens generated
    answers: dict[int, str | None] = field(default_factory=dict)  # finished branches
    texts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    weights: dict[int, float] = field(default_factory=dict)
    steps_to_done: int | None = None

    def record(self) -> cr.BranchRecord:
        n = self.consensus.n
        return cr.BranchRecord(self.level, self.index, self.problem.operands, str(self.problem.answer), self.seed,
                               tuple(self.tokens[i] for i in range(n)), tuple(self.answers[i] for i in range(n)),
                               tuple(self.weights[i] for i in range(n)))


def branch_weight(out) -> float:
    """Mean token probability of a branch (exp of its mean logprob), in (0, 1]."""
    lps = [d[t] for d, t in zip(out.logprobs or (), out.token_ids) if t in d]
    return math.exp(sum(lps) / len(lps)) if lps else 1.0


def run_rule(engine, problems: list[tuple[int, int, tasks.Problem]], rule_name: str, *, n: int, wave: int,
             max_tokens: int, seed: int, extractor, weighted: bool, on_decided=None) -> tuple[list[ProblemRun], int]:
    """``rule_name``'s Best-of-N over ``problems`` ((level, index, problem)), all in ``engine`` at
    once; returns the runs and the engine steps taken. ``on_decided(run)`` is called as each
    problem's vote is decided."""
    live: dict[str, tuple[ProblemRun, int]] = {}

    def rid(run: ProblemRun, i: int) -> str:
        return f"{rule_name}/{run.seed}/{i}"

    def launch(run: ProblemRun, branches) -> None:
        for i in branches:
            params = SamplingParams(n=1, temperature=1.0, max_tokens=max_tokens, seed=branch_seed(run.seed, i),
                                    logprobs=0 if weighted else None)
            engine.add_request(rid(run, i), tasks.prompt_for(run.problem), params)
            live[rid(run, i)] = (run, i)
            run.tokens[i] = 0

    rule = make_rule(rule_name)
    runs = []
    for level, j, p in problems:
        run = ProblemRun(level, j, p, problem_seed(seed, level, j),
                         Consensus(n, rule, WavePlan.for_rule(n, rule, wave), weighted=weighted))
        launch(run, run.consensus.start().launch)
        runs.append(run)
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
            for j in d.cancel:                       # free their KV now: the point of stopping
                engine.abort(rid(run, j))
                live.pop(rid(run, j))
            launch(run, d.launch)
            if d.done:
                run.steps_to_done = steps
                if on_decided is not None:
                    on_decided(run)
        if not outs and not engine.has_unfinished_requests() and live:
            raise RuntimeError(f"engine idle with {len(live)} branches outstanding")
        if time.time() - last_print > 30:
            done = sum(r.consensus.done for r in runs)
            print(f"    {rule_name}: step {steps}, {time.time() - t0:.0f}s, {done}/{len(runs)} problems decided, "
                  f"{len(live)} branches running", flush=True)
            last_print = time.time()
    engine.check_integrity()
    stats = engine.stats()
    if stats.num_free_blocks != stats.num_total_blocks:
        raise RuntimeError(f"{stats.num_total_blocks - stats.num_free_blocks} KV blocks still held at the end")
    return runs, steps


FRESH_DRAWS = 20_000     # draws of the held-out stream searched for problems not yet in the list


def held_out_level(level: int, count: int, seed: int, fresh_from: int | None) -> list[tasks.Problem]:
    """``count`` held-out problems of ``level``: the ``tasks`` test-split stream as drawn (with
    repeats: L5's held-out pool has 70 problems) up to index ``fresh_from``, then only problems
    not already in the list, so an extension is disjoint from the set sampled before it."""
    if fresh_from is None or count <= fresh_from:
        return tasks.generate_problems(level, count, seed, split="test")
    stream = tasks.generate_problems(level, FRESH_DRAWS, seed, split="test")
    out = stream[:fresh_from]
    seen = {p.operands for p in out}
    for p in stream[fresh_from:]:
        if len(out) == count:
            break
        if p.operands not in seen:
            seen.add(p.operands)
            out.append(p)
    if len(out) < count:
        raise ValueError(f"level {level}: only {len(out)} held-out problems distinct from the first {fresh_from}, "
                         f"{count} asked (--problems)")
    return out


def held_out(levels: list[int], count: int, seed: int,
             fresh_from: int | None = None) -> list[tuple[int, int, tasks.Problem]]:
    """(level, index, problem), interleaved by level (j-th of every level, then the (j+1)-th) so a
    generation stopped part way holds a balanced prefix of every level."""
    per_level = {lv: held_out_level(lv, count, seed, fresh_from) for lv in levels}
    return [(lv, j, per_level[lv][j]) for j in range(count) for lv in levels]


def make_engine(args):
    import torch

    from thinkserve.workers.engine import LLMEngine

    torch.set_num_threads(args.threads)
    return LLMEngine.from_pretrained(args.model, device=args.device, max_num_seqs=args.max_num_seqs, seed=0,
                                     kv_cache_memory_bytes=1024 * 2**20)


def generate(args, levels: list[int]) -> int:
    """Fixed N over every problem of this shard not yet in the branch file, appending each as it ends."""
    path = Path(args.branches)
    done = cr.read_records([path]) if path.exists() else {}
    k, of = (int(x) for x in args.shard.split("/"))
    todo = [(lv, j, p) for lv, j, p in held_out(levels, args.problems, args.seed, args.fresh_from)
            if j % of == k and (lv, j) not in done]
    print(f"generate: {len(todo)} problems to sample (shard {k}/{of}, {len(done)} already in {path}), "
          f"Best-of-{args.n} at T=1.0", flush=True)
    t0 = time.time()
    tokens = 0

    def save(run: ProblemRun) -> None:
        nonlocal tokens
        tokens += sum(run.tokens.values())
        with path.open("a") as f:
            f.write(run.record().to_json() + "\n")
        print(f"  L{run.level} #{run.index}: {sum(run.tokens.values()):,} tokens; {tokens / (time.time() - t0):.0f} "
              f"tok/s so far", flush=True)

    if todo:
        run_rule(make_engine(args), todo, NONE, n=args.n, wave=args.wave, max_tokens=args.max_tokens,
                 seed=args.seed, extractor=get_extractor(args.extractor), weighted=args.weighted, on_decided=save)
    return 0


def replay(args, levels: list[int], rules: list[str]) -> int:
    records = cr.balanced(cr.read_records(Path(p) for p in args.branches.split(",")), levels)
    if not records:
        raise SystemExit(f"{args.branches}: no level has a complete first problem")
    recs = [r for r in records if r.index < args.problems]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    m = len(recs) // len(levels)
    print(f"replay: levels {levels}, {m} held-out problems per level ({len(recs)}, "
          f"{len({(r.level, r.operands) for r in recs})} distinct), Best-of-{len(recs[0].tokens)} at T=1.0, "
          f"wave {args.wave}, rules {rules}", flush=True)
    outcomes = {rule: [cr.replay(rule, r, wave=args.wave, weighted=args.weighted) for r in recs] for rule in rules}
    base = outcomes[rules[0]]
    report = {"mode": "replay", "levels": levels, "problems_per_level": m, "n": len(recs[0].tokens),
              "wave": args.wave, "weighted": args.weighted, "branches": args.branches, "rules": {}}
    head = (f"{'rule':<11} {'level':>5} {'acc':>6} {'Δacc pt [95% CI]':>22} {'tok/prob':>9} {'vs N [95% CI]':>19} "
            f"{'launched':>8} {'steps':>6} {'worse/better':>12} {'worse ≤ pt':>10}")
    rows = []
    for rule in rules:
        report["rules"][rule] = {}
        for lv in levels + ["all"]:
            ks = [k for k, r in enumerate(recs) if lv == "all" or r.level == lv]
            o, b, rs = [outcomes[rule][k] for k in ks], [base[k] for k in ks], [recs[k] for k in ks]
            s = {"problems": len(ks), "accuracy": statistics.mean(x.correct for x in o),
                 "branch_tokens": sum(x.tokens for x in o), "launched": statistics.mean(x.launched for x in o),
                 "finished": statistics.mean(x.finished for x in o),
                 "steps_to_done": statistics.mean(x.steps_to_done for x in o),
                 "same_vote_as_fixed_n": statistics.mean(x.vote == y.vote for x, y in zip(o, b))}
            s.update(cr.paired_bootstrap(levels if lv == "all" else [lv], b, o, rs, draws=args.bootstrap))
            report["rules"][rule][str(lv)] = s
            ci, qi = s["accuracy_delta_ci95"], s["token_ratio_ci95"]
            rows.append(f"{rule:<11} {lv!s:>5} {s['accuracy']:>6.1%} {s['accuracy_delta_pt']:>+6.1f} "
                        f"[{ci[0]:+5.1f},{ci[1]:+5.1f}] {s['branch_tokens'] / len(ks):>9,.0f} "
                        f"{s['token_ratio']:>5.2f} [{qi[0]:.2f},{qi[1]:.2f}] {s['launched']:>8.1f} "
                        f"{s['steps_to_done']:>6.0f} {s['problems_worse']:>6}/{s['problems_better']:<5} "
                        f"{s['worse_upper95_pt']:>10.1f}")
    curve = cr.majority_curve(recs)
    report["fixed_n_curve"] = [{"k": k, "accuracy": a, "branch_tokens_per_problem": t} for k, a, t in curve]
    print("\n" + head + "\n" + "-" * len(head) + "\n" + "\n".join(rows))
    print("\nfixed N majority curve (branches 0..k-1): " + ", ".join(f"maj@{k} {a:.1%} @ {t:,.0f} tok"
                                                                       for k, a, t in curve))
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    points = {rule: (report["rules"][rule]["all"]["branch_tokens"] / len(recs), report["rules"][rule]["all"]["accuracy"])
              for rule in rules}
    cr.plot(curve, points, out / "voting_curve.png",
            f"tiny-reasoner L{levels[0]}-{levels[-1]}, Best-of-{report['n']}, T=1.0, wave {args.wave} "
            f"({len(recs)} problems, paired replay)")
    print(f"wrote {out / 'results.json'} and {out / 'voting_curve.png'}")
    return 0


def live(args, levels: list[int], rules: list[str]) -> int:
    """Every rule in turn in one engine, each timed on its own; the first is the baseline."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    problems = held_out(levels, args.problems, args.seed, args.fresh_from)
    engine = make_engine(args)
    print(f"live: levels {levels}, {args.problems} held-out problems/level, Best-of-{args.n} at T=1.0, wave "
          f"{args.wave}, rules {rules}, one after another in one engine", flush=True)
    results, report = {}, {"mode": "live", "levels": levels, "problems_per_level": args.problems, "n": args.n,
                           "wave": args.wave, "rules": {}}
    for rule in rules:
        t0 = time.perf_counter()
        runs, steps = run_rule(engine, problems, rule, n=args.n, wave=args.wave, max_tokens=args.max_tokens,
                               seed=args.seed, extractor=get_extractor(args.extractor), weighted=args.weighted)
        wall = time.perf_counter() - t0
        results[rule] = runs
        base = results[rules[0]]
        same = both = 0         # paired: a branch finished under both runs is the same chain
        for r, b in zip(runs, base):
            for i, toks in r.texts.items():
                if i in b.texts:
                    both += 1
                    same += toks == b.texts[i]
        s = {"wall_s": wall, "steps": steps, "branch_tokens": sum(sum(r.tokens.values()) for r in runs),
             "accuracy": statistics.mean(r.consensus.vote().answer == str(r.problem.answer) for r in runs),
             "launched": statistics.mean(len(r.tokens) for r in runs),
             "cancelled": statistics.mean(len(r.consensus.cancelled) for r in runs),
             "identical_branches": [same, both]}
        b = report["rules"][rules[0]] if report["rules"] else s
        s.update(token_ratio=s["branch_tokens"] / b["branch_tokens"], wall_ratio=wall / b["wall_s"])
        report["rules"][rule] = s
        print(f"  {rule:<11} wall {wall:6.1f}s ({s['wall_ratio']:.2f}x)  steps {steps:5d}  branch tokens "
              f"{s['branch_tokens']:>8,} ({s['token_ratio']:.2f}x)  launched {s['launched']:.1f}/prob  accuracy "
              f"{s['accuracy']:.0%}  identical branches {same}/{both}", flush=True)
        if same != both:
            raise RuntimeError(f"{rule}: {both - same} branches differ from the fixed-N run's (pairing broken)")
    (out / "live.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'live.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("generate", "replay", "live"), required=True)
    p.add_argument("--out", help="replay/live: directory for results.json, voting_curve.png, live.json")
    p.add_argument("--branches", help="generate: the JSON-lines file to append to; replay: comma-separated files")
    p.add_argument("--shard", default="0/1", help="generate: K/OF samples problems whose index %% OF == K")
    p.add_argument("--model", default="tiny-reasoner")
    p.add_argument("--device", default="cpu")
    p.add_argument("--levels", default="5,6,7,8,9")
    p.add_argument("--problems", type=int, default=2, help="held-out problems per level")
    p.add_argument("--fresh-from", type=int, default=40,
                   help="problems from this index on are distinct from every earlier one (indices 0-39, the first "
                        "200-problem set, were drawn with repeats; the extension is disjoint from them)")
    p.add_argument("--n", type=int, default=16, help="branches per problem (Best-of-N)")
    p.add_argument("--wave", type=int, default=4, help="branches running at once per problem under a stopping rule")
    p.add_argument("--rules", default="none,unbeatable,adaptive,esc", help="comma-separated; the first is the baseline")
    p.add_argument("--extractor", default="answer", help="answer extractor: answer, boxed, last_number")
    p.add_argument("--weighted", action="store_true", help="weight votes by each branch's mean token probability")
    p.add_argument("--max-tokens", type=int, default=1500)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bootstrap", type=int, default=10_000, help="replay: bootstrap draws for the 95%% intervals")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    rules = args.rules.split(",")
    if rules[0] != NONE:
        p.error("--rules must start with none (the fixed-N baseline)")
    if args.mode in ("generate", "replay") and not args.branches:
        p.error(f"--mode {args.mode} needs --branches")
    if args.mode in ("replay", "live") and not args.out:
        p.error(f"--mode {args.mode} needs --out")
    if args.mode == "generate":
        return generate(args, levels)
    return replay(args, levels, rules) if args.mode == "replay" else live(args, levels, rules)


if __name__ == "__main__":
    sys.exit(main())
