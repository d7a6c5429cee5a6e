"""The prefill cost model fitted online from measured prefills.

The Conductor estimates a prompt's time to first token on an instance as

    TTFT ≈ fixed_s + s_per_token · (queued prefill tokens + this prompt's uncached tokens)

The configured coefficients (``PrefillCostModel``) are only the prior. Every prefill the cluster
runs is a measurement: the tokens the estimate counted when the request was placed, and the
seconds from that decision until the prefill instance reported the prompt done. The fit is a
ridge regression of seconds on tokens, pulled toward the prior and forgetting old measurements
exponentially (a load or hardware change shows within ~1 / (1 − decay) prefills)::

    minimise  Σ_i decay^(n−i) (y_i − a − b·x_i)²  +  w·(a − a0)²  +  w·X²·(b − b0)²

    ⎡ S0 + w     Sx      ⎤ ⎡a⎤   ⎡ Sy  + w·a0    ⎤      S0 = Σ decay^(n−i),  Sx = Σ ... x_i,
    ⎣ Sx       Sxx + wX² ⎦ ⎣b⎦ = ⎣ Sxy + wX²·b0  ⎦      Sy, Sxx, Sxy likewise

``w`` (``prior_weight``) is how many measurements the prior is worth, ``X`` (``token_scale``) the
prompt size at which its slope weighs as much as its intercept. One fit per deployment: its
instances run one model on one kind of device (per-instance fits would break the queue-order
shortcut of ``Conductor._best_prefill``). Pure Python, O(1) per measurement.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .conductor import PrefillCostModel


@dataclass(frozen=True)
class PrefillFitConfig:
    decay: float = 0.95             # weight of a measurement per newer one (window ~20 prefills)
    prior_weight: float = 1.0       # the configured coefficients count as this many measurements
    token_scale: float = 128.0      # X: the prior's slope is as firm as its intercept at this size
    max_seconds: float = 60.0       # a prefill slower than this measured a stall, not the model

    def __post_init__(self):
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")
        if self.prior_weight <= 0 or self.token_scale <= 0 or self.max_seconds <= 0:
            raise ValueError("prior_weight, token_scale and max_seconds must be > 0")


class PrefillCostFit:
    """``observe(tokens, seconds)`` per measured prefill; ``model`` is the current estimate."""

    def __init__(self, prior: "PrefillCostModel", config: PrefillFitConfig = PrefillFitConfig()):
        self.prior = prior
        self.config = config
        self.model = prior
        self.measurements = 0
        self._s0 = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def observe(self, tokens: int, seconds: float) -> "PrefillCostModel":
        """One prefill: ``tokens`` the estimate counted (queued ahead + computed), ``seconds``
        from placement to the prefill's result. Returns the refitted model."""
        if tokens < 0 or not 0.0 <= seconds <= self.config.max_seconds:
            return self.model                       # not a measurement of the cost model
        d = self.config.decay
        x, y = float(tokens), float(seconds)
        self._s0 = d * self._s0 + 1.0
        self._sx = d * self._sx + x
        self._sy = d * self._sy + y
        self._sxx = d * self._sxx + x * x
        self._sxy = d * self._sxy + x * y
        self.measurements += 1
        self.model = self._solve()
        return self.model

    def _solve(self) -> "PrefillCostModel":
        w, scale = self.config.prior_weight, self.config.token_scale
        a0, b0 = self.prior.fixed_s, self.prior.s_per_token
        m00, m01, m11 = self._s0 + w, self._sx, self._sxx + w * scale * scale
        r0, r1 = self._sy + w * a0, self._sxy + w * scale * scale * b0
        det = m00 * m11 - m01 * m01                 # > 0: the prior makes the system definite
        a = (r0 * m11 - m01 * r1) / det
        b = (m00 * r1 - m01 * r0) / det
        if b <= 0.0:        # measurements say tokens cost nothing: keep a sliver of the prior's slope
            b = b0 * 1e-3
            a = (r0 - m01 * b) / m00
        return replace(self.prior, fixed_s=max(0.0, a), s_per_token=b)
