"""Per-request sampling parameters, validated where a request enters the engine.

Pure Python (no torch): the router, the gRPC frontend and the engine all share this type.
Every invalid value raises ``ValueError`` naming the field and its limit.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Below the floor,
# logits / temperature overflows float32 (every candidate becomes +inf and the draw is no longer
# the argmax); above the ceiling the distribution is already uniform noise, and +inf or 1e30 made
# every logit 0 -- garbage, never what a caller meant.
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 10.0


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. ``temperature == 0`` means greedy.

    ``seed`` makes sampling reproducible: the random draw for output position ``i`` depends only
    on ``(seed, i)``, never on batch composition, preemption or migration between instances.
    A request without a seed gets a random one when the engine admits it.
    """

    n: int = 1
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: whole vocabulary
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token (0: only the sampled one)
    thinking_budget: int | None = None  # max tokens inside <think> before </think> is forced

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        t = self.temperature
        if not (t == 0.0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE):   # NaN fails both
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], got {t}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.thinking_budget is not None and self.thinking_budget < 0:
            raise ValueError(f"thinking_budget must be >= 0, got {self.thinking_budget}")
        # Accept lists from callers but store tuples so the object stays hashable and frozen.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data for msgpack (crossing a process boundary)."""
        d = dataclasses.asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown sampling field(s): {sorted(unknown)}")
        return cls(**d)


def branch_seed(seed: int, index: int) -> int:
    """Seed of branch ``index`` of a request seeded with ``seed`` (stable across processes)."""
    return (seed + index * 0x9E3779B97F4A7C15) % (2**63)
