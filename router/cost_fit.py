"""The Conductor's cost models fitted online from what the cluster measures.

Two linear models, each with configured coefficients that are only its prior:

    TTFT ≈ fixed_s + s_per_token · (queued prefill tokens + this prompt's uncached tokens)
                   + s_per_store_token · (prefix tokens loaded from the node's CPU store)
    TPOT ≈ step_s + s_per_seq · (branches in the decode batch)

Every prefill the cluster runs measures the first: the tokens and store tokens the estimate
counted when the request was placed, and the seconds from that decision until the prefill
instance reported the prompt done (``PrefillCostFit``). Every decode-only engine step measures
the second: an instance's stats say how many such steps it ran since its last report, how long
they took and how many branches they carried, so each report is one measurement of the mean
step time at the mean batch (``DecodeCostFit``; the model is linear, so means fit it too).

Both are one ridge regression (``LinearFit``) of seconds on the features ``x = (1, x_1, …)``,
pulled toward the prior ``θ0`` and forgetting old measurements exponentially (a load or hardware
change shows within ~1 / (1 − decay) measurements)::

    minimise  Σ_i decay^(n−i) (y_i − θ·x_i)²  +  w · Σ_j X_j² (θ_j − θ0_j)²

    (Σ_i decay^(n−i) x_i x_iᵀ + w·diag(X²)) θ  =  Σ_i decay^(n−i) y_i x_i  +  w·diag(X²) θ0

``w`` (``prior_weight``) is how many measurements the prior is worth; ``X_j`` the size of feature
j at which the prior's coefficient weighs as much as its intercept (``X_0 = 1``). The prior
makes the system definite whatever was measured: a feature the measurements never had (no
store hits yet) keeps its prior coefficient, and one they never varied (every batch the same
size) shares the measured time with the intercept as the prior's weights say, so the fit
matches the measurements where they were taken. One fit per model per deployment: its
instances run one model on one kind of device (per-instance fits would break the queue-order
shortcut of ``Conductor._best_prefill``). Pure Python, O(k²) per measurement for k features; the
system is solved (O(k³)) only when the fit is read, and at most once per new measurement: decode
reports come several times a second per instance, far more often than placements read the model.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from .conductor import DecodeCostModel, PrefillCostModel


@dataclass(frozen=True)
class PrefillFitConfig:
    decay: float = 0.95             # weight of a measurement per newer one (window ~20 prefills)
    prior_weight: float = 1.0       # the configured coefficients count as this many measurements
    token_scale: float = 128.0      # X: the prior's per-token (and per-store-token) slopes are as
                                    #    firm as its intercept at this many tokens
    max_seconds: float = 60.0       # a prefill slower than this measured a stall, not the model

    def __post_init__(self):
        _check(self.decay, self.prior_weight, self.token_scale, self.max_seconds, "token_scale")


@dataclass(frozen=True)
class DecodeFitConfig:
    decay: float = 0.99             # per report (every decode instance reports about 4 times a second)
    prior_weight: float = 1.0       # the configured coefficients count as this many reports
    batch_scale: float = 16.0       # X: the prior's per-branch slope is as firm as its intercept here
    max_seconds: float = 10.0       # a mean step slower than this measured a stall, not the model

    def __post_init__(self):
        _check(self.decay, self.prior_weight, self.batch_scale, self.max_seconds, "batch_scale")


def _check(decay: float, prior_weight: float, scale: float, max_seconds: float, scale_name: str) -> None:
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay must be in (0, 1], got {decay}")
    if prior_weight <= 0 or scale <= 0 or max_seconds <= 0:
        raise ValueError(f"prior_weight, {scale_name} and max_seconds must be > 0")


class LinearFit:
    """Exponentially forgetting ridge regression of ``y`` on ``x = (1, x_1, …)`` toward ``prior``.
    ``observe(x_1.., y)`` adds a measurement; ``coefficients`` is the current fit. Coefficients
    after the intercept are costs: one the measurements drive to ≤ 0 keeps a sliver (1e-3) of
    its prior and the others are solved with it held; the intercept is kept ≥ 0."""

    def __init__(self, prior: Sequence[float], scales: Sequence[float], decay: float, prior_weight: float):
        if len(prior) != len(scales) + 1:
            raise ValueError("one scale per coefficient after the intercept")
        self.prior = tuple(float(c) for c in prior)
        self.decay = decay
        k = len(self.prior)
        self._ridge = (prior_weight,) + tuple(prior_weight * s * s for s in scales)
        self._sxx = [[0.0] * k for _ in range(k)]       # Σ decay^(n−i) x_i x_iᵀ
        self._sxy = [0.0] * k                           # Σ decay^(n−i) y_i x_i
        self.measurements = 0
        self._coefficients: tuple[float, ...] | None = self.prior      # None: solve when read

    @property
    def coefficients(self) -> tuple[float, ...]:
        if self._coefficients is None:
            self._coefficients = self._solve()
        return self._coefficients

    def observe(self, features: Sequence[float], y: float) -> None:
        x = (1.0,) + tuple(float(v) for v in features)
        d, sxx, sxy = self.decay, self._sxx, self._sxy
        for r, xr in enumerate(x):
            row = sxx[r]
            for c, xc in enumerate(x):
                row[c] = d * row[c] + xr * xc
            sxy[r] = d * sxy[r] + xr * y
        self.measurements += 1
        self._coefficients = None

    def _solve(self) -> tuple[float, ...]:
        k = len(self.prior)
        m = [[self._sxx[r][c] + (self._ridge[r] if r == c else 0.0) for c in range(k)] for r in range(k)]
        rhs = [self._sxy[r] + self._ridge[r] * self.prior[r] for r in range(k)]
        held: dict[int, float] = {}
        while True:
            theta = _solve_held(m, rhs, held)
            bad = [j for j in range(1, k) if j not in held and theta[j] <= 0.0]
            if not bad:
                break
            for j in bad:       # measurements say this feature costs nothing: keep a sliver of the prior
                held[j] = self.prior[j] * 1e-3
        theta[0] = max(0.0, theta[0])
        return tuple(theta)


def _solve_held(m: list[list[float]], rhs: list[float], held: dict[int, float]) -> list[float]:
    """Solve ``m θ = rhs`` for the coefficients not in ``held`` (which keep their held values):
    Gaussian elimination on the free rows and columns (``m`` is symmetric positive definite, so
    no pivoting is needed)."""
    free = [j for j in range(len(rhs)) if j not in held]
    a = [[m[r][c] for c in free] + [rhs[r] - sum(m[r][j] * v for j, v in held.items())] for r in free]
    n = len(free)
    for p in range(n):
        for r in range(p + 1, n):
            f = a[r][p] / a[p][p]
            if f:
                for c in range(p, n + 1):
                    a[r][c] -= f * a[p][c]
    sol = [0.0] * n
    for r in range(n - 1, -1, -1):
        sol[r] = (a[r][n] - sum(a[r][c] * sol[c] for c in range(r + 1, n))) / a[r][r]
    theta = [0.0] * len(rhs)
    for j, v in held.items():
        theta[j] = v
    for j, v in zip(free, sol):
        theta[j] = v
    return theta


class _ModelFit:
    """A cost model refitted by a ``LinearFit``: ``model`` is the prior until a measurement, then
    the prior with the fitted coefficients (built when read, kept until the next measurement)."""

    def __init__(self, prior, fit: LinearFit):
        self.prior = prior
        self._fit = fit
        self._model, self._model_of = prior, fit.coefficients

    @property
    def measurements(self) -> int:
        return self._fit.measurements

    @property
    def model(self):
        coefficients = self._fit.coefficients
        if coefficients is not self._model_of:
            self._model, self._model_of = self._with(coefficients), coefficients
        return self._model

    def _with(self, coefficients: tuple[float, ...]):
        raise NotImplementedError


class PrefillCostFit(_ModelFit):
    """``observe(tokens, seconds, store_tokens)`` per measured prefill; ``model`` is the current
    estimate (``fixed_s``, ``s_per_token``, ``s_per_store_token`` fitted)."""

    def __init__(self, prior: "PrefillCostModel", config: PrefillFitConfig = PrefillFitConfig()):
        self.config = config
        super().__init__(prior, LinearFit((prior.fixed_s, prior.s_per_token, prior.s_per_store_token),
                                          (config.token_scale, config.token_scale), config.decay,
                                          config.prior_weight))

    def observe(self, tokens: int, seconds: float, store_tokens: int = 0) -> None:
        """One prefill: ``tokens`` the estimate counted (queued ahead + computed), ``store_tokens``
        the prefix tokens it counted as loaded from the node's CPU store (``Placement``), and
        ``seconds`` from placement to the prefill's result."""
        if tokens < 0 or store_tokens < 0 or not 0.0 <= seconds <= self.config.max_seconds:
            return                                  # not a measurement of the cost model
        self._fit.observe((tokens, store_tokens), seconds)

    def _with(self, coefficients: tuple[float, ...]) -> "PrefillCostModel":
        a, b, c = coefficients
        return replace(self.prior, fixed_s=a, s_per_token=b, s_per_store_token=c)


class DecodeCostFit(_ModelFit):
    """``observe(steps, seconds, seqs)`` per instance report of its decode-only steps; ``model``
    is the current TPOT estimate (``step_s``, ``s_per_seq`` fitted)."""

    def __init__(self, prior: "DecodeCostModel", config: DecodeFitConfig = DecodeFitConfig()):
        self.config = config
        super().__init__(prior, LinearFit((prior.step_s, prior.s_per_seq), (config.batch_scale,), config.decay,
                                          config.prior_weight))

    def observe(self, steps: int, seconds: float, seqs: int) -> None:
        """``steps`` decode-only engine steps that took ``seconds`` together and carried ``seqs``
        branches together: one measurement of the mean step time at the mean batch."""
        if steps <= 0 or seqs < steps or seconds < 0.0 or seconds > steps * self.config.max_seconds:
            return                                  # nothing measured, or a stall
        self._fit.observe((seqs / steps,), seconds / steps)

    def _with(self, coefficients: tuple[float, ...]) -> "DecodeCostModel":
        a, b = coefficients
        return replace(self.prior, step_s=a, s_per_seq=b)
