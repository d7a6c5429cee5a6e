"""Best-of-N early consensus: which branches to run, and when the vote is decided.

    start ─▶ launch the first wave ─▶ a branch finishes ─▶ rule(Tally) ──stop──▶ cancel the running
                   ▲                                          │                  branches, skip the
                   └────── launch more, up to `width` ◀──go on┘                  unlaunched ones

Branches run in waves (a rolling window of at most ``width`` running branches), so a rule that
stops early saves the branches never launched, not just the tails of the running ones.

Rules (``make_rule(name)``), over the answers of the branches finished so far:

* ``none``: every branch runs to its end.
* ``unbeatable``: stop once no outcome of the branches still to finish (running or not yet
  launched) can change the full vote, ties included: the result always equals the full vote.
* ``adaptive``: Adaptive-Consistency (Aggarwal et al., EMNLP 2023, arXiv 2305.11860), Beta
  criterion on the two leading answers: stop once P(p1 > p2) = 1 − I_0.5(v1+1, v2+1) ≥ 0.95.
* ``dirichlet``: the same paper's Dirichlet criterion for three or more distinct answers (seeded
  Monte Carlo over the top five; Beta below three).
* ``esc``: Early-Stopping Self-Consistency (Li et al., ICLR 2024, arXiv 2401.10480): stop once one
  window of ``window`` consecutive finished branches agrees.

Every rule but ``none`` also stops when ``unbeatable`` does (the vote is then decided anyway).
An answer of ``None`` (no answer, unparsable, cut at max_tokens) abstains: it uses up a branch
but votes for nothing. Pure Python: the cluster's frontend, the benchmark and the simulator all
drive this module.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from .answers import VoteResult, majority_vote

NONE, UNBEATABLE, ADAPTIVE, DIRICHLET, ESC = "none", "unbeatable", "adaptive", "dirichlet", "esc"
RULES = (NONE, UNBEATABLE, ADAPTIVE, DIRICHLET, ESC)
MAX_VOTE_WEIGHT = 1.0   # a branch's vote weight is in (0, 1] (mean token probability); bounds what is still to come


# ----------------------------------------------------------------- the snapshot rules decide on
@dataclass(frozen=True)
class Finished:
    index: int              # the branch
    answer: str | None      # None abstains
    weight: float = 1.0     # its vote weight, in (0, MAX_VOTE_WEIGHT]


@dataclass(frozen=True)
class Tally:
    """What a rule sees: the budget and the finished branches, in the order they finished."""

    n: int
    finished: tuple[Finished, ...]
    weighted: bool = False

    @property
    def remaining(self) -> int:
        """Branches still to finish: running or not yet launched."""
        return self.n - len(self.finished)

    def pending(self) -> tuple[int, ...]:
        done = {f.index for f in self.finished}
        return tuple(i for i in range(self.n) if i not in done)

    def vote(self) -> VoteResult:
        """The vote over the finished branches (unfinished ones abstain), as ``majority_vote``."""
        answers: list[str | None] = [None] * self.n
        weights = [0.0] * self.n
        for f in self.finished:
            answers[f.index], weights[f.index] = f.answer, f.weight
        return majority_vote(answers, weights if self.weighted else None)


# ----------------------------------------------------------------- Beta / Dirichlet
def regularized_beta(x: float, a: int, b: int) -> float:
    """I_x(a, b) for positive integers: the probability that at least ``a`` of ``a+b−1``
    Bernoulli(x) trials succeed, an exact finite binomial sum (no special functions needed)."""
    if a < 1 or b < 1 or int(a) != a or int(b) != b:
        raise ValueError(f"a and b must be positive integers, got {a}, {b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    m = a + b - 1
    if x == 0.5:    # exact in integers: sum C(m, j) / 2^m
        return sum(math.comb(m, j) for j in range(a, m + 1)) / 2 ** m
    return sum(math.comb(m, j) * x ** j * (1 - x) ** (m - j) for j in range(a, m + 1))


def prob_leader_ahead(v1: int, v2: int) -> float:
    """P(p1 > p2) under a uniform prior on the two leading answers' shares (Adaptive-Consistency's
    Beta criterion): 1 − I_0.5(v1+1, v2+1)."""
    return 1.0 - regularized_beta(0.5, v1 + 1, v2 + 1)


def prob_leader_largest(counts: Sequence[int], samples: int = 2000) -> float:
    """P(the first count's share is the largest) under Dirichlet(counts + 1), by Monte Carlo seeded
    from the counts (the same tally always gives the same decision)."""
    seed = 0
    for c in counts:
        seed = seed * 1_000_003 + int(c) + 1
    rng = random.Random(seed)
    wins = 0
    for _ in range(samples):
        draws = [rng.gammavariate(c + 1, 1.0) for c in counts]
        wins += draws[0] >= max(draws)
    return wins / samples


# ----------------------------------------------------------------- rules
class StoppingRule:
    """``should_stop(tally)`` is side-effect free; the controller asks it after every finish."""

    name = NONE

    def should_stop(self, tally: Tally) -> bool:
        return False


class Unbeatable(StoppingRule):
    name = UNBEATABLE

    def should_stop(self, tally: Tally) -> bool:
        r = tally.remaining
        if r == 0:
            return True
        vote = tally.vote()
        if vote.answer is None:
            return False
        lead, rivals = vote.votes[0], vote.votes[1:]
        first_pending = min(tally.pending())
        # Each rival, and an answer nobody gave yet, could take every remaining branch: it would
        # then have weight + r·MAX and, for the tie-break, its lowest branch index could drop to
        # the lowest pending one.
        candidates = [(v.weight, v.branch_indices[0]) for v in rivals] + [(0.0, first_pending)]
        for weight, first in candidates:
            margin = lead.weight - (weight + r * MAX_VOTE_WEIGHT)
            if margin < 0 or (margin == 0 and lead.branch_indices[0] > min(first, first_pending)):
                return False
        return True


_UNBEATABLE = Unbeatable()


class AdaptiveBeta(StoppingRule):
    name = ADAPTIVE

    def __init__(self, threshold: float = 0.95):
        if not 0.5 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0.5, 1), got {threshold}")
        self.threshold = threshold

    @staticmethod
    def _counts(tally: Tally) -> list[int]:
        return [v.count for v in tally.vote().votes]    # in vote order: the leader first

    def confidence(self, counts: list[int]) -> float:
        return prob_leader_ahead(counts[0], counts[1] if len(counts) > 1 else 0)

    def should_stop(self, tally: Tally) -> bool:
        if _UNBEATABLE.should_stop(tally):
            return True
        counts = self._counts(tally)
        return bool(counts) and self.confidence(counts) >= self.threshold


class AdaptiveDirichlet(AdaptiveBeta):
    name = DIRICHLET

    def __init__(self, threshold: float = 0.95, top: int = 5, samples: int = 2000):
        super().__init__(threshold)
        self.top, self.samples = top, samples

    def confidence(self, counts: list[int]) -> float:
        if len(counts) < 3:
            return super().confidence(counts)
        return prob_leader_largest(counts[:self.top], self.samples)


class WindowedESC(StoppingRule):
    name = ESC

    def __init__(self, window: int = 4):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window

    def should_stop(self, tally: Tally) -> bool:
        if _UNBEATABLE.should_stop(tally):
            return True
        k = len(tally.finished)
        if k == 0 or k % self.window:       # windows are disjoint: decide when one completes
            return False
        answers = {f.answer for f in tally.finished[-self.window:]}
        return len(answers) == 1 and None not in answers


def make_rule(name: str, **options) -> StoppingRule:
    """A rule by name (``RULES``); ``options`` go to its constructor (threshold, window, ...)."""
    kinds = {NONE: StoppingRule, UNBEATABLE: Unbeatable, ADAPTIVE: AdaptiveBeta, DIRICHLET: AdaptiveDirichlet,
             ESC: WindowedESC}
    if name not in kinds:
        raise ValueError(f"early_stop must be one of {list(RULES)}, got {name!r}")
    return kinds[name](**options)


# ----------------------------------------------------------------- waves
@dataclass(frozen=True)
class WavePlan:
    """How many branches run at once: ``first_wave`` at the start, then a rolling window of at
    most ``width`` running branches. Narrow waves save more when a rule stops, at the price of
    latency (a request needs about n / width branch lengths)."""

    first_wave: int
    width: int

    @classmethod
    def for_rule(cls, n: int, rule: StoppingRule, wave: int) -> "WavePlan":
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if wave < 1:
            raise ValueError(f"wave must be >= 1, got {wave}")
        if rule.name == NONE:   # nothing can stop early: holding branches back only adds latency
            return cls(n, n)
        return cls(min(n, wave), min(n, wave))


@dataclass(frozen=True)
class ConsensusDecision:
    launch: tuple[int, ...] = ()    # branches to start now
    cancel: tuple[int, ...] = ()    # running branches to abort now (they end with finish reason abort)
    skip: tuple[int, ...] = ()      # branches never launched that never will be (also abort, no tokens)
    stopped_by: str = ""            # the rule that decided the vote early; "" if none did
    done: bool = False              # nothing more will run

    @property
    def cancelled(self) -> tuple[int, ...]:
        return tuple(sorted(self.cancel + self.skip))


class Consensus:
    """One Best-of-N request's branches: drive it with ``start()`` then ``on_finished()`` for every
    branch that ends (in the order they end), and carry out each decision."""

    def __init__(self, n: int, rule: StoppingRule, plan: WavePlan, *, weighted: bool = False):
        self.n, self.rule, self.plan, self.weighted = n, rule, plan, weighted
        self.running: set[int] = set()
        self.next_index = 0
        self.finished: list[Finished] = []
        self.cancelled: tuple[int, ...] = ()
        self.stopped_by = ""
        self.done = False

    def tally(self) -> Tally:
        return Tally(self.n, tuple(self.finished), self.weighted)

    def vote(self) -> VoteResult:
        return self.tally().vote()

    def _launch(self, count: int) -> tuple[int, ...]:
        count = max(0, min(count, self.n - self.next_index))
        out = tuple(range(self.next_index, self.next_index + count))
        self.next_index += count
        self.running.update(out)
        return out

    def start(self) -> ConsensusDecision:
        if self.next_index:
            raise RuntimeError("Consensus.start called twice")
        return ConsensusDecision(launch=self._launch(self.plan.first_wave))

    def on_finished(self, index: int, answer: str | None, weight: float = 1.0) -> ConsensusDecision:
        if self.done:
            return ConsensusDecision(done=True)
        if index not in self.running:
            raise ValueError(f"branch {index} is not running (running: {sorted(self.running)})")
        if not 0.0 < weight <= MAX_VOTE_WEIGHT:
            raise ValueError(f"weight must be in (0, {MAX_VOTE_WEIGHT}], got {weight}")
        self.running.discard(index)
        self.finished.append(Finished(index, answer, weight if self.weighted else 1.0))
        if len(self.finished) == self.n:
            self.done = True
            return ConsensusDecision(done=True)
        if self.rule.should_stop(self.tally()):
            cancel = tuple(sorted(self.running))
            skip = tuple(range(self.next_index, self.n))
            self.running.clear()
            self.next_index = self.n
            self.cancelled, self.stopped_by, self.done = tuple(sorted(cancel + skip)), self.rule.name, True
            return ConsensusDecision(cancel=cancel, skip=skip, stopped_by=self.rule.name, done=True)
        return ConsensusDecision(launch=self._launch(self.plan.width - len(self.running)))
