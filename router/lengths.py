"""Output-length distributions over log-spaced buckets.

A reasoning chain's length is a heavy-tailed distribution per prompt, not a number, so the
Conductor works with probabilities over buckets::

    edges (16, 32, 64, ..., 32768)  ──▶  buckets [0,16) [16,32) ... [16384,32768) [32768, ∞)

Within a bucket the length is taken as uniform; the open last bucket is [e, 2e). A distribution
conditioned on ``len >= floor`` (a branch already that long) or capped at ``len <= cap``
(``max_tokens``) narrows the buckets it cuts to ``[floor, hi)`` / ``[lo, cap]``. Everything here is
pure Python over tuples of floats.
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import accumulate


def log_edges(first: int, last: int, factor: float = 2.0) -> tuple[int, ...]:
    """Bucket edges ``first, first·factor, ...`` up to ``last`` (integers, strictly increasing)."""
    if first < 1 or last <= first or factor <= 1.0:
        raise ValueError(f"log_edges needs 1 <= first < last and factor > 1, got {first}, {last}, {factor}")
    out, e = [], float(first)
    while e <= last:
        if not out or int(e) > out[-1]:
            out.append(int(e))
        e *= factor
    return tuple(out)


DEFAULT_EDGES: tuple[int, ...] = log_edges(16, 32768)      # 16, 32, ..., 32768: 13 buckets


def bucket_of(edges: tuple[int, ...], length: int) -> int:
    """Index of the bucket holding ``length`` (0 .. len(edges))."""
    return bisect_right(edges, length)


def bucket_bounds(edges: tuple[int, ...], k: int) -> tuple[int, int]:
    lo = edges[k - 1] if k > 0 else 0
    hi = edges[k] if k < len(edges) else 2 * edges[-1]
    return lo, hi


@dataclass(frozen=True)
class LengthDistribution:
    """P(output length in bucket k) for k = 0 .. len(edges); ``probs`` sums to 1."""

    edges: tuple[int, ...]
    probs: tuple[float, ...]
    floor: int = 0                  # lengths are >= floor
    cap: int | None = None          # lengths are <= cap

    def bounds(self, k: int) -> tuple[int, int]:
        """Bucket k's length range [lo, hi), narrowed by ``floor`` and ``cap``."""
        lo, hi = bucket_bounds(self.edges, k)
        lo = max(lo, self.floor)
        if self.cap is not None:
            hi = min(hi, self.cap + 1)
        return lo, max(hi, lo + 1)

    def __post_init__(self):
        if len(self.probs) != len(self.edges) + 1:
            raise ValueError(f"probs has {len(self.probs)} entries; {len(self.edges) + 1} buckets")
        # P(len in buckets 0..k), summed in bucket order once (not a field: derived), so that a
        # quantile is a bisection; placement asks each prediction for two.
        object.__setattr__(self, "_cumulative", list(accumulate(self.probs)))

    @classmethod
    def from_weights(cls, edges: tuple[int, ...], weights, floor: int = 0,
                     cap: int | None = None) -> "LengthDistribution":
        w = [max(0.0, float(x)) for x in weights]
        total = sum(w)
        if total <= 0.0:
            return cls(edges, tuple(1.0 / len(w) for _ in w), floor, cap)
        return cls(edges, tuple(x / total for x in w), floor, cap)

    @property
    def mode_bucket(self) -> int:
        return max(range(len(self.probs)), key=self.probs.__getitem__)

    def mean(self) -> float:
        total = 0.0
        for k, p in enumerate(self.probs):
            if p:
                lo, hi = self.bounds(k)
                total += p * (lo + hi - 1) / 2
        return total

    def quantile(self, q: float) -> int:
        """The smallest length L with P(len <= L) >= q (linear within a bucket)."""
        # Memoized per distribution (it is immutable): promotion asks every short-decode
        # branch's admission-time prediction for the same quantile at every round.
        memo = self.__dict__.get("_quantiles")
        if memo is None:
            memo = self.__dict__["_quantiles"] = {}
        elif q in memo:
            return memo[q]
        memo[q] = out = self._quantile(q)
        return out

    def _quantile(self, q: float) -> int:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"quantile q must be in [0, 1], got {q}")
        cum = self._cumulative
        # The first bucket whose cumulative mass reaches q: it has mass, since one without has the
        # cumulative mass of the bucket before (for q > 1e-12; below, skip empty leading buckets).
        k = bisect_left(cum, q - 1e-12)
        if k < len(cum) and q <= 1e-12:
            while k < len(cum) and not self.probs[k] > 0:
                k += 1
        if k == len(cum):
            return self.bounds(len(self.probs) - 1)[1] - 1
        p, acc = self.probs[k], cum[k - 1] if k else 0.0
        lo, hi = self.bounds(k)
        return int(lo + (hi - 1 - lo) * min(1.0, max(0.0, q - acc) / p))

    def median(self) -> int:
        return self.quantile(0.5)

    def prob_greater(self, length: int) -> float:
        """P(len > length)."""
        k = bucket_of(self.edges, length)
        lo, hi = self.bounds(k)
        inside = self.probs[k] * min(1.0, (hi - length - 1) / (hi - lo))
        return max(0.0, inside) + sum(self.probs[k + 1:])

    def at_least(self, tokens: int) -> "LengthDistribution":
        """Conditioned on len >= ``tokens`` (a branch that has produced ``tokens`` and goes on).
        Mass below is dropped, the bucket holding ``tokens`` keeps its part above; if nothing
        is left, all mass goes to that bucket."""
        if tokens <= self.floor:
            return self
        if self.cap is not None and tokens > self.cap:
            tokens = self.cap           # past its cap it stops at the cap (max_tokens)
        k = bucket_of(self.edges, tokens)
        lo, hi = self.bounds(k)
        w = [0.0] * len(self.probs)
        w[k] = self.probs[k] * max(0.0, min(1.0, (hi - tokens) / (hi - lo)))
        w[k + 1:] = self.probs[k + 1:]
        if sum(w) <= 0.0:
            w[k] = 1.0
        return LengthDistribution.from_weights(self.edges, w, tokens, self.cap)

    def at_most(self, tokens: int) -> "LengthDistribution":
        """Capped at ``tokens`` (``max_tokens``): mass above moves onto the bucket holding it."""
        if self.cap is not None and self.cap <= tokens:
            return self
        k = bucket_of(self.edges, tokens)
        w = list(self.probs[:k + 1]) + [0.0] * (len(self.probs) - k - 1)
        w[k] += sum(self.probs[k + 1:])
        return LengthDistribution.from_weights(self.edges, w, min(self.floor, tokens), tokens)

    def times(self, likelihood) -> "LengthDistribution":
        """Bayes: this distribution as prior, times a per-bucket likelihood, normalised."""
        return LengthDistribution.from_weights(self.edges, [p * l for p, l in zip(self.probs, likelihood)],
                                               self.floor, self.cap)
