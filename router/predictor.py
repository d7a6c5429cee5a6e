"""Output-length predictor: a distribution over log-spaced length buckets, learned online.

    prompt ──▶ hashed n-grams + log prompt-length bucket ──┐
                                                            ├─▶ softmax over buckets ──▶ cap at max_tokens
    prefill hidden state (final norm, sampled position) ───┘        (one log-linear model, SGD)

    while decoding, every k tokens:  posterior ∝ P(len | prompt, len ≥ t) · P(len | h_t, t) / P(len | t)
                                                 (the prior, conditioned)   (the decode probe)

Cold start: every weight is zero and the bias is the log of the prior (``PredictorConfig.prior``),
so an untrained predictor returns the prior — unless it starts from a fitted state (``state`` /
``load_state``: plain JSON, fitted offline for a model, e.g. ``bench/bench_predictor.py --fit``
for the shipped tiny-reasoner); each finished request is one SGD step of
cross-entropy (TRAIL, arXiv 2410.01035, trains such a probe on hidden states; S3 and others
classify into buckets), online scaled to a budget of full steps per second of the caller's
clock (``PredictorConfig.steps_per_s``: as fast per second at 8x the arrivals as at 1x).
The decode probe (TRAIL's refinement) is a second linear softmax on the decode-time hidden
state plus the bucket of tokens so far; dividing by its per-``t`` marginal turns its output
into a likelihood, so the update is Bayes' rule rather than a product of two priors. Pure
Python over lists of floats: the simulator runs the very same code.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import repeat
from operator import add, mul, sub, truediv

from .lengths import DEFAULT_EDGES, LengthDistribution, bucket_of

_MASK = (1 << 61) - 1


@dataclass(frozen=True)
class LengthFeatures:
    """What the predictor sees of one request (built once at admission, see ``features_for``)."""

    prompt_len: int
    ngrams: tuple[int, ...] = ()                # hashed prompt n-grams (``prompt_ngrams``)
    max_tokens: int | None = None               # the output cannot be longer
    thinking_budget: int | None = None
    hidden: tuple[float, ...] | None = None     # prefill instance's final hidden state, if returned


@dataclass(frozen=True)
class ProgressState:
    """A branch part-way through decoding: ``tokens`` produced so far, the hidden state at the
    last of them when the engine returned one (every ``hidden_state_interval`` tokens)."""

    tokens: int
    hidden: tuple[float, ...] | None = None


@dataclass(frozen=True)
class PredictorConfig:
    edges: tuple[int, ...] = DEFAULT_EDGES
    # Cold-start prior over the buckets (relative weights; None: uniform over buckets).
    prior: tuple[float, ...] | None = None
    use_ngrams: bool = True
    use_hidden: bool = True
    ngram_orders: tuple[int, ...] = (1, 2, 3)
    ngram_dim: int = 1 << 18                    # feature ids are hashed into [0, ngram_dim)
    max_ngram_tokens: int = 64                  # n-grams of the first and last 32 tokens only
    learning_rate: float = 0.2
    hidden_learning_rate: float = 0.5
    l2: float = 1e-5
    answer_margin: int = 64                     # tokens after a thinking budget for the answer
    # Online learning's pace (``observe(..., now=)``): at most about this many full
    # ``learning_rate`` steps per second of the caller's clock. Observations that come faster
    # share the budget (each step is scaled by budget / observed rate, the rate decayed over
    # ``pace_window_s``), so the predictor moves as far per second at 8x the arrivals as at 1x —
    # with less noise — instead of taking 8x the steps from the same start-up. Below the budget
    # every observation is one full step. None: always one full step (as an offline fit does;
    # ``observe`` without ``now`` too).
    steps_per_s: float | None = 1.0
    pace_window_s: float = 60.0

    def __post_init__(self):
        if list(self.edges) != sorted(set(self.edges)) or not self.edges or self.edges[0] < 1:
            raise ValueError(f"edges must be strictly increasing positive ints, got {self.edges}")
        if self.prior is not None and (len(self.prior) != len(self.edges) + 1 or min(self.prior) < 0
                                       or sum(self.prior) <= 0):
            raise ValueError(f"prior needs {len(self.edges) + 1} non-negative weights, got {self.prior}")
        if self.steps_per_s is not None and not self.steps_per_s > 0:
            raise ValueError(f"steps_per_s must be > 0 or None, got {self.steps_per_s}")
        if not self.pace_window_s > 0:
            raise ValueError(f"pace_window_s must be > 0, got {self.pace_window_s}")


def prompt_ngrams(token_ids, orders=(1, 2, 3), dim: int = 1 << 18, max_tokens: int = 64) -> tuple[int, ...]:
    """Distinct hashed n-gram ids of a prompt (stable across processes, unlike ``hash``).
    Long prompts contribute their first and last ``max_tokens // 2`` tokens."""
    if len(token_ids) > max_tokens:      # slice before copying: a prompt may be thousands of tokens
        half = max_tokens // 2
        ids = list(token_ids[:half]) + [-1] + list(token_ids[-half:])
    else:
        ids = list(token_ids)
    # An n-gram's id: h = n, then per token h = ((h ^ (token + C1)) * C2) & (2^61 - 1);
    # written inline with the offsets added once, since the router hashes every prompt. Each
    # distinct n-gram is hashed once (the arithmetic is on 125-bit integers; prompts repeat
    # n-grams, and the simulator's synthetic ones are mostly one repeated token).
    ids = [t + 0x9E3779B97F4A7C15 for t in ids]
    mul, mask = 0xBF58476D1CE4E5B9, _MASK
    out = set()
    for n in orders:
        for gram in set(zip(*(ids[j:] for j in range(n)))):
            h = n
            for t in gram:
                h = ((h ^ t) * mul) & mask
            out.add(h % dim)
    return tuple(sorted(out))


def features_for(token_ids, config: PredictorConfig, *, max_tokens: int | None = None,
                 thinking_budget: int | None = None, hidden=None) -> LengthFeatures:
    ngrams = (prompt_ngrams(token_ids, config.ngram_orders, config.ngram_dim, config.max_ngram_tokens)
              if config.use_ngrams else ())
    return LengthFeatures(len(token_ids), ngrams, max_tokens, thinking_budget,
                          None if hidden is None else tuple(float(x) for x in hidden))


def _softmax(logits: list[float]) -> list[float]:
    m = max(logits)
    e = [math.exp(x - m) for x in logits]
    s = sum(e)
    return [x / s for x in e]


def _restricted(probs: list[float], first: int) -> list[float]:
    """``probs`` restricted to buckets ``first`` and above, renormalised (all of it there if
    the model gives them no mass)."""
    tail = sum(probs[first:])
    if tail <= 0.0:
        return [0.0] * first + [1.0 / (len(probs) - first)] * (len(probs) - first)
    return [0.0] * first + [p / tail for p in probs[first:]]


def _unit(hidden) -> list[float]:
    # C-level passes, the same float operations in the same order as sum(x * x) and x / norm
    norm = math.sqrt(sum(map(mul, hidden, hidden))) or 1.0
    return list(map(truediv, hidden, repeat(norm)))


STATE_FORMAT = "thinkserve-length-predictor/1"


class _LinearSoftmax:
    """Multinomial logistic regression over sparse indicator features plus an optional dense
    vector, trained online by SGD on cross-entropy."""

    def __init__(self, k: int, bias: list[float], lr: float, dense_lr: float, l2: float):
        self.k = k
        self.bias = list(bias)
        self.sparse: dict[int, list[float]] = {}
        self.dense: list[list[float]] | None = None     # k rows of the hidden size, made on first use
        self.lr, self.dense_lr, self.l2 = lr, dense_lr, l2

    def logits(self, sparse: tuple[int, ...], dense: list[float] | None) -> list[float]:
        rows = [self.bias, *filter(None, map(self.sparse.get, sparse))]     # lookups and filter in C
        out = list(map(sum, zip(*rows))) if len(rows) > 1 else list(self.bias)
        if dense is not None and self.dense is not None and len(dense) == len(self.dense[0]):
            for j, row in enumerate(self.dense):
                out[j] += sum(map(float.__mul__, row, dense))
        return out

    def state(self) -> dict:
        return {"bias": self.bias, "sparse": {str(f): w for f, w in sorted(self.sparse.items())},
                "dense": self.dense}

    def load_state(self, state: dict, where: str) -> None:
        bias, sparse, dense = state["bias"], state["sparse"], state["dense"]
        rows = [bias, *sparse.values(), *(dense or ())]
        if len(bias) != self.k or any(len(w) != self.k for w in sparse.values()) or \
                (dense is not None and (len(dense) != self.k or len({len(r) for r in dense}) != 1)):
            raise ValueError(f"{where}: weights do not have {self.k} buckets")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for r in rows for x in r):
            raise ValueError(f"{where}: weights must be finite numbers")
        self.bias = [float(x) for x in bias]
        self.sparse = {int(f): [float(x) for x in w] for f, w in sparse.items()}
        self.dense = None if dense is None else [[float(x) for x in r] for r in dense]

    def step(self, sparse: tuple[int, ...], dense: list[float] | None, target: int, given_from: int = 0,
             scale: float = 1.0) -> None:
        """One SGD step on −log P(target | features, bucket ≥ ``given_from``): with
        ``given_from`` 0 the plain cross-entropy (gradient p − e_target), else the likelihood of
        the target given the censored event already learned by ``step_at_least`` (gradient
        q − e_target, q = p restricted to buckets ≥ ``given_from`` and renormalised). ``scale``:
        of the learning rates, for this step (the pace, ``_Pace``)."""
        probs = _softmax(self.logits(sparse, dense))
        grad = _restricted(probs, given_from) if given_from else probs
        grad[target] -= 1.0
        self._apply(sparse, dense, grad, scale)

    def step_at_least(self, sparse: tuple[int, ...], dense: list[float] | None, first: int,
                      scale: float = 1.0) -> None:
        """One SGD step on −log P(bucket ≥ ``first`` | features), a right-censored observation
        (gradient p − q). With ``step(..., given_from=first)`` at the finish, the two gradients
        add up to one plain step's on the final length (p − e_target): nothing is counted twice."""
        probs = _softmax(self.logits(sparse, dense))
        q = _restricted(probs, first)
        self._apply(sparse, dense, [p - r for p, r in zip(probs, q)], scale)

    def _apply(self, sparse: tuple[int, ...], dense: list[float] | None, grad: list[float],
               scale: float = 1.0) -> None:
        lr, l2, rows = self.lr * scale, self.l2, self.sparse
        self.bias = [b - lr * g for b, g in zip(self.bias, grad)]
        # x - lr * (g + l2 * x) per weight of each feature's row, as C-level passes (the same
        # float operations in the same order; the frontend learns from every finished branch)
        lrs, l2s = repeat(lr), repeat(l2)
        for f in sparse:
            w = rows.get(f) or [0.0] * self.k
            rows[f] = list(map(sub, w, map(mul, lrs, map(add, grad, map(mul, l2s, w)))))
        if dense is not None:
            if self.dense is None:
                self.dense = [[0.0] * len(dense) for _ in range(self.k)]
            if len(dense) != len(self.dense[0]):
                return                                  # another model's hidden size: not this probe's
            for j, row in enumerate(self.dense):
                g = self.dense_lr * scale * grad[j]
                if g:       # w - g * x per weight, as a C-level pass
                    self.dense[j] = list(map(sub, row, map(mul, repeat(g), dense)))


class _Pace:
    """The scale of each online step so that about ``steps_per_s`` full steps are taken per second
    however fast observations come (``PredictorConfig.steps_per_s``): the observed rate is a
    count decayed with time constant ``window_s`` over the span seen so far (at least 1 s), and
    a step's scale is ``min(1, steps_per_s / rate)``. Times may repeat or come slightly out of
    order (a learner runs queued work late): the clock never goes back."""

    def __init__(self, steps_per_s: float, window_s: float):
        self.steps_per_s, self.window_s = steps_per_s, window_s
        self.start: float | None = None
        self.last = 0.0
        self.count = 0.0                    # steps, each weighted exp(-age / window_s)

    def scale(self, now: float) -> float:
        """Count one step at ``now``; its scale."""
        if not math.isfinite(now):
            raise ValueError(f"now must be a finite time in seconds, got {now}")
        if self.start is None:
            self.start = self.last = now
        elif now > self.last:
            self.count *= math.exp(-(now - self.last) / self.window_s)
            self.last = now
        self.count += 1.0
        span = self.window_s * -math.expm1(-(self.last - self.start) / self.window_s)
        return min(1.0, self.steps_per_s * max(span, 1.0) / self.count)


class LengthPredictor:
    """``predict`` at admission, ``refine`` while decoding, ``observe`` when a request finishes."""

    def __init__(self, config: PredictorConfig = PredictorConfig()):
        self.config = config
        k = len(config.edges) + 1
        self.num_buckets = k
        prior = config.prior or tuple(1.0 for _ in range(k))
        total = sum(prior)
        self.prior = LengthDistribution(config.edges, tuple(p / total for p in prior))
        bias = [math.log(max(p, 1e-6)) for p in self.prior.probs]
        self.model = _LinearSoftmax(k, bias, config.learning_rate, config.hidden_learning_rate, config.l2)
        # Decode probe: bucket of the final length from (h_t, bucket of t); and, per bucket of t,
        # the counts of final buckets (its marginal, for the likelihood ratio).
        self.probe = _LinearSoftmax(k, [0.0] * k, config.learning_rate, config.hidden_learning_rate, config.l2)
        self._marginal: dict[int, list[float]] = {}
        self.observed = 0
        self._pace = None if config.steps_per_s is None else _Pace(config.steps_per_s, config.pace_window_s)

    def step_scale(self, now: float | None) -> float:
        """The scale of an online step taken at ``now`` (counted toward the pace); 1 without a
        clock (``now`` None, an offline fit) or a pace (``steps_per_s`` None)."""
        return 1.0 if now is None or self._pace is None else self._pace.scale(now)

    # ---- features ------------------------------------------------------------------------
    def _sparse(self, f: LengthFeatures) -> tuple[int, ...]:
        # Prompt length enters as the indicator of its log bucket (ids above the n-gram space).
        length_id = self.config.ngram_dim + bucket_of(self.config.edges, f.prompt_len)
        return (f.ngrams if self.config.use_ngrams else ()) + (length_id,)

    def _dense(self, hidden) -> list[float] | None:
        return _unit(hidden) if hidden is not None and self.config.use_hidden else None

    def cap(self, f: LengthFeatures) -> int | None:
        caps = [c for c in (f.max_tokens, None if f.thinking_budget is None
                            else f.thinking_budget + self.config.answer_margin) if c is not None]
        return min(caps) if caps else None

    # ---- inference -----------------------------------------------------------------------
    def predict(self, f: LengthFeatures) -> LengthDistribution:
        probs = _softmax(self.model.logits(self._sparse(f), self._dense(f.hidden)))
        dist = LengthDistribution(self.config.edges, tuple(probs))
        cap = self.cap(f)
        return dist if cap is None else dist.at_most(cap)

    def refine(self, dist: LengthDistribution, progress: ProgressState) -> LengthDistribution:
        """The admission-time ``dist`` updated by what decoding showed: the branch has ``tokens``
        already, and (once the probe has learned anything) what its hidden state says."""
        post = dist.at_least(progress.tokens)
        dense = self._dense(progress.hidden)
        if dense is None or self.probe.dense is None:
            return post
        t_bucket = bucket_of(self.config.edges, progress.tokens)
        q = _softmax(self.probe.logits((t_bucket,), dense))
        marginal = self._marginal.get(t_bucket)
        if marginal is None:
            return post
        total = sum(marginal)
        return post.times([qk / (mk / total) for qk, mk in zip(q, marginal)])

    # ---- fitted state (JSON) --------------------------------------------------------------
    def state(self) -> dict:
        """Everything learned, as JSON-ready data (never pickle: a state file may come from anywhere)."""
        c = self.config
        return {"format": STATE_FORMAT, "edges": list(c.edges), "ngram_orders": list(c.ngram_orders),
                "ngram_dim": c.ngram_dim, "max_ngram_tokens": c.max_ngram_tokens, "observed": self.observed,
                "model": self.model.state(), "probe": self.probe.state(),
                "marginal": {str(t): m for t, m in sorted(self._marginal.items())}}

    def load_state(self, state: dict) -> None:
        """Start from a fitted ``state`` (as ``state()`` wrote it). Raises ``ValueError`` naming
        what does not match this predictor's configuration (buckets, n-gram hashing)."""
        c = self.config
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"length predictor state: format must be {STATE_FORMAT!r}")
        for key, mine in (("edges", list(c.edges)), ("ngram_orders", list(c.ngram_orders)),
                          ("ngram_dim", c.ngram_dim), ("max_ngram_tokens", c.max_ngram_tokens)):
            if state.get(key) != mine:
                raise ValueError(f"length predictor state: {key} is {state.get(key)!r}, this predictor uses {mine!r}")
        try:
            self.model.load_state(state["model"], "length predictor state: model")
            self.probe.load_state(state["probe"], "length predictor state: probe")
            marginal = {int(t): [float(x) for x in m] for t, m in state["marginal"].items()}
            observed = int(state["observed"])
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"length predictor state: malformed ({type(e).__name__}: {e})") from None
        if any(len(m) != self.num_buckets for m in marginal.values()):
            raise ValueError(f"length predictor state: marginal does not have {self.num_buckets} buckets")
        self._marginal = marginal
        self.observed = observed

    # ---- learning ------------------------------------------------------------------------
    def observe_at_least(self, f: LengthFeatures, tokens: int, now: float | None = None) -> None:
        """A branch still running has produced ``tokens``: learn that its length is at least
        that now, not only when it finishes. Finished lengths alone arrive shortest first —
        after a cold start the first long chains to finish are the short ones among them — so
        a predictor fed only those underrates long requests for as long as the longest chains
        take (survivorship bias). Call ``observe(..., at_least=tokens)`` when it finishes.
        ``now``: the caller's clock in seconds, for the pace (``PredictorConfig.steps_per_s``)."""
        if tokens < 0:
            raise ValueError(f"tokens must be >= 0, got {tokens}")
        first = bucket_of(self.config.edges, tokens)
        if first:
            self.model.step_at_least(self._sparse(f), self._dense(f.hidden), first, self.step_scale(now))

    def observe(self, f: LengthFeatures, output_len: int, progress: tuple[ProgressState, ...] = (),
                at_least: int = 0, now: float | None = None) -> None:
        """One finished branch: its features at admission, its output length, and the decode
        hidden states the engine returned on the way (for the decode probe). ``at_least``: the
        tokens an earlier ``observe_at_least`` of this branch reported (0: none), so that this
        step learns only what the finish adds to it. ``now``: the caller's clock in seconds, for
        the pace (``PredictorConfig.steps_per_s``); None: one full step (an offline fit)."""
        for _ in self.observing(f, output_len, progress, at_least, now):
            pass

    @staticmethod
    def check_observation(output_len: int, at_least: int) -> None:
        """Raises ``ValueError`` naming the field when a finished branch's figures are impossible."""
        if output_len < 0:
            raise ValueError(f"output_len must be >= 0, got {output_len}")
        if not 0 <= at_least <= output_len:
            raise ValueError(f"at_least must be in [0, output_len = {output_len}], got {at_least}")

    def observing(self, f: LengthFeatures, output_len: int, progress: tuple[ProgressState, ...] = (),
                  at_least: int = 0, now: float | None = None) -> Iterator[None]:
        """``observe`` one SGD step at a time: a generator that yields after each step (the
        length model's, then one per decode state), so a caller on an event loop can run other
        work in between; a Best-of-8 finish with 16 decode states per branch is 136 steps. Run
        to its end, it is ``observe`` step for step; it raises on bad input at its first step.
        The pace's scale (``now``) applies to the length model's step and the probe's alike."""
        self.check_observation(output_len, at_least)
        target = bucket_of(self.config.edges, output_len)
        scale = self.step_scale(now)
        self.model.step(self._sparse(f), self._dense(f.hidden), target, bucket_of(self.config.edges, at_least), scale)
        yield
        for p in progress:
            if p.tokens > output_len:
                continue
            t_bucket = bucket_of(self.config.edges, p.tokens)
            m = self._marginal.setdefault(t_bucket, [1.0] * self.num_buckets)   # Laplace smoothing
            m[target] += 1.0
            dense = self._dense(p.hidden)
            if dense is not None:
                self.probe.step((t_bucket,), dense, target, scale=scale)
                yield
        self.observed += 1


__all__ = ["STATE_FORMAT", "LengthFeatures", "LengthPredictor", "PredictorConfig", "ProgressState",
           "features_for", "prompt_ngrams"]
