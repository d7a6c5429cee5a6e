"""Paired replay of early-stopping rules over Best-of-N branches already sampled in full.

Adaptive-Consistency's evaluation design (Aggarwal et al. 2023, §4): sample every problem's N
branches once, then run each stopping rule's controller over the *same* branches in the order
they would launch. A rule then differs from the fixed N only by when it stops, never by the luck
of the draw, so the accuracy difference is exact per problem (−1, 0 or +1) and its spread over
problems gives a confidence interval (stratified bootstrap over problems, by level).

The controller is ``thinkserve.router.consensus.Consensus``, the class the cluster runs. Clock:
an engine step emits one token per running branch (continuous batching below max_num_seqs), so
branch i launched at step t finishes at t + tokens[i]; a branch cancelled at step t has spent
t − launch tokens.

Branch files are JSON lines, one problem per line (``BranchRecord``), appended as problems finish
so a long generation can be stopped, resumed and sharded.
"""
from __future__ import annotations

import heapq
import json
import math
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

from thinkserve.router import majority_vote
from thinkserve.router.consensus import Consensus, WavePlan, make_rule


@dataclass(frozen=True)
class BranchRecord:
    """One problem's N branches sampled in full (branch i: ``tokens[i]`` generated, ``answers[i]``)."""

    level: int
    index: int                      # the problem's position in its level's held-out list
    operands: tuple[int, ...]
    answer: str                     # the right answer
    seed: int                       # branch i was sampled with branch_seed(seed, i)
    tokens: tuple[int, ...]
    answers: tuple[str | None, ...]
    weights: tuple[float, ...]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> "BranchRecord":
        d = json.loads(line)
        return cls(d["level"], d["index"], tuple(d["operands"]), d["answer"], d["seed"], tuple(d["tokens"]),
                   tuple(d["answers"]), tuple(d["weights"]))


def read_records(paths: Iterable[Path]) -> dict[tuple[int, int], BranchRecord]:
    """Every problem in ``paths`` by (level, index); the same problem twice must agree."""
    out: dict[tuple[int, int], BranchRecord] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            r = BranchRecord.from_json(line)
            if out.setdefault((r.level, r.index), r) != r:
                raise ValueError(f"{path}: problem L{r.level} #{r.index} differs from an earlier file's")
    return out


def balanced(records: dict[tuple[int, int], BranchRecord], levels: list[int]) -> list[BranchRecord]:
    """The first m problems of every level, m the longest prefix complete in every level. A prefix,
    not whatever finished: short chains finish first, so taking those would bias the sample."""
    m = 0
    while all((lv, m) in records for lv in levels):
        m += 1
    return [records[(lv, j)] for lv in levels for j in range(m)]


@dataclass(frozen=True)
class Outcome:
    """One rule on one problem."""

    vote: str | None
    correct: bool
    tokens: int             # branch tokens spent, cancelled tails included
    launched: int           # branches started (samples used)
    finished: int           # branches that voted or abstained
    steps_to_done: int      # engine steps until the vote was decided


def replay(rule_name: str, rec: BranchRecord, *, wave: int, weighted: bool = False) -> Outcome:
    n = len(rec.tokens)
    rule = make_rule(rule_name)
    c = Consensus(n, rule, WavePlan.for_rule(n, rule, wave), weighted=weighted)
    launched_at: dict[int, int] = {}
    pending: list[tuple[int, int]] = []     # (finish step, branch)
    spent = {}

    def launch(branches, t):
        for i in branches:
            launched_at[i] = t
            heapq.heappush(pending, (t + rec.tokens[i], i))

    launch(c.start().launch, 0)
    t = 0
    while pending and not c.done:
        t, i = heapq.heappop(pending)
        spent[i] = rec.tokens[i]
        d = c.on_finished(i, rec.answers[i], rec.weights[i] if weighted else 1.0)
        for j in d.cancel:
            spent[j] = t - launched_at[j]
        launch(d.launch, t)
    vote = c.vote().answer
    return Outcome(vote, vote == rec.answer, sum(spent.values()), len(launched_at), len(c.finished), t)


def majority_curve(records: list[BranchRecord]) -> list[tuple[int, float, float]]:
    """(k, accuracy, mean branch tokens per problem) of maj@k over branches 0..k-1, k = 1, 2, 4, ..."""
    n = len(records[0].tokens)
    out, k = [], 1
    while k <= n:
        acc = statistics.mean(majority_vote(list(r.answers[:k])).answer == r.answer for r in records)
        out.append((k, acc, statistics.mean(sum(r.tokens[:k]) for r in records)))
        k *= 2
    return out


def paired_bootstrap(levels: list[int], base: list[Outcome], other: list[Outcome], recs: list[BranchRecord],
                     *, draws: int = 10_000, seed: int = 0) -> dict:
    """Accuracy difference (points) and token ratio of ``other`` against ``base`` on the same
    problems, with 95% percentile intervals from a bootstrap over problems stratified by level."""
    by_level = {lv: [k for k, r in enumerate(recs) if r.level == lv] for lv in levels}

    def stats(ks):
        diff = 100 * sum(other[k].correct - base[k].correct for k in ks) / len(ks)
        ratio = sum(other[k].tokens for k in ks) / sum(base[k].tokens for k in ks)
        return diff, ratio

    rng = random.Random(seed)
    diffs, ratios = [], []
    for _ in range(draws):
        ks = [rng.choice(idx) for idx in by_level.values() for _ in idx]
        d, q = stats(ks)
        diffs.append(d)
        ratios.append(q)
    diffs.sort()
    ratios.sort()
    lo, hi = int(0.025 * draws), int(0.975 * draws) - 1
    d, q = stats(range(len(recs)))
    return {"accuracy_delta_pt": d, "accuracy_delta_ci95": [diffs[lo], diffs[hi]],
            "token_ratio": q, "token_ratio_ci95": [ratios[lo], ratios[hi]],
            "problems_worse": (worse := sum(o.correct < b.correct for b, o in zip(base, other))),
            "worse_upper95_pt": 100 * upper_bound(worse, len(recs)),
            "problems_better": sum(o.correct > b.correct for b, o in zip(base, other))}


def upper_bound(k: int, m: int, confidence: float = 0.95) -> float:
    """Exact one-sided upper confidence bound on a rate seen ``k`` times in ``m`` trials
    (Clopper-Pearson: the p at which P(X <= k) = 1 - confidence; 3/m for k = 0, the "rule of
    three"). Bounds the share of problems a rule gets wrong where the fixed N gets them right,
    which a bootstrap cannot do when it saw none."""
    def cdf(p):
        return sum(math.comb(m, j) * p ** j * (1 - p) ** (m - j) for j in range(k + 1))
    lo, hi = k / m, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) > 1 - confidence else (lo, mid)
    return hi


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
