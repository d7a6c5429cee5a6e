"""Least-loaded placement: where a request's prefill and its decode branches run.

    request ──▶ predicted length ──▶ decode pool (short / long, by a threshold)
           ──▶ prefill instance (least loaded in the prefill pool)
           ──▶ decode instance per branch (least loaded, counting branches placed so far,
               so Best-of-N branches spread across the pool)

Without a serving prefill pool, or without any serving decode pool, the request runs colocated on
one `mixed` instance (the baseline deployment). ``None`` means nothing can serve it now.
The Conductor (``conductor.py``, the default for three-pool deployments) replaces the threshold
with a learned length predictor; this policy stays for ``router.policy: least_loaded``.
"""
from __future__ import annotations

from dataclasses import dataclass

from .lengths import LengthDistribution
from .predictor import LengthFeatures
from .snapshot import LONG_DECODE, MIXED, PREFILL, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot

DISAGGREGATED = "disaggregated"
COLOCATED = "colocated"
# Conditional disaggregation (the Conductor): the prompt prefills on the short_decode instance that
# decodes it, in place, with no hand-off; ``Placement.prefill_instance`` is that decode instance.
LOCAL_PREFILL = "local_prefill"


@dataclass(frozen=True)
class PlacementRequest:
    request_id: str
    prompt_len: int
    n: int = 1
    max_tokens: int = 256
    thinking_budget: int | None = None
    priority: int = 0
    # For the Conductor (ignored by LeastLoadedPolicy):
    slo_class: str = "standard"                 # interactive | standard | batch
    prompt_block_hashes: tuple[int, ...] = ()   # chained hashes of the prompt's full KV blocks
    features: LengthFeatures | None = None      # predictor input (None: prompt length only)
    arrival: float | None = None                # when the request arrived (TTFT counts from here)
    length: LengthDistribution | None = None    # the prediction if made already (Conductor.predict)


@dataclass(frozen=True)
class BranchAssignment:
    instance_id: str
    branch_indices: tuple[int, ...]


@dataclass(frozen=True)
class Placement:
    mode: str                                   # DISAGGREGATED | COLOCATED | LOCAL_PREFILL
    prefill_instance: str                       # the mixed instance when colocated, the decode one when local
    decode_pool: str                            # SHORT_DECODE | LONG_DECODE | MIXED
    decode: tuple[BranchAssignment, ...]        # disjoint branch sets covering 0..n-1
    predicted_len: int
    priority: int = 0                           # engine priority (lower = more urgent)
    length: LengthDistribution | None = None    # the Conductor's predicted output-length distribution
    estimated_ttft_s: float = 0.0               # the Conductor's estimate on the chosen prefill instance
    prefill_tokens: int = 0                     # tokens that estimate counted (queued ahead + to compute)
    store_tokens: int = 0                       # ... and prefix tokens it counted as loaded from the CPU store
    decode_step_s: float = 0.0                  # LOCAL_PREFILL: the decode step of the instance's batch it counted


@dataclass(frozen=True)
class LeastLoadedPolicy:
    """``long_threshold``: predicted output lengths above it go to the long-decode pool.
    ``answer_margin``: tokens after the thinking budget that the answer is expected to take."""

    long_threshold: int = 1024
    answer_margin: int = 64

    def predict_len(self, req: PlacementRequest) -> int:
        if req.thinking_budget is not None:
            return min(req.max_tokens, req.thinking_budget + self.answer_margin)
        return req.max_tokens

    def decode_pool_for(self, req: PlacementRequest) -> str:
        return LONG_DECODE if self.predict_len(req) > self.long_threshold else SHORT_DECODE

    def place(self, req: PlacementRequest, snap: ClusterSnapshot) -> Placement | None:
        predicted = self.predict_len(req)
        prefills = snap.pool(PREFILL).serving()
        preferred = self.decode_pool_for(req)
        other = SHORT_DECODE if preferred == LONG_DECODE else LONG_DECODE
        decode_pool = next((p for p in (preferred, other) if snap.pool(p).serving()), None)
        if prefills and decode_pool is not None:
            prefill = min(prefills, key=_prefill_load)
            return Placement(DISAGGREGATED, prefill.instance_id, decode_pool,
                             spread_branches(req.n, snap.pool(decode_pool).serving()), predicted)
        mixed = snap.pool(MIXED).serving()
        if mixed:
            inst = min(mixed, key=_decode_load)
            return Placement(COLOCATED, inst.instance_id, MIXED,
                             (BranchAssignment(inst.instance_id, tuple(range(req.n))),), predicted)
        return None

    def pick_target(self, pool_instances: tuple[InstanceSnapshot, ...], *, exclude: frozenset[str] = frozenset(),
                    branches: int = 1) -> InstanceSnapshot | None:
        """Least-loaded serving instance for moved work (migration, resume), or ``None``."""
        candidates = [i for i in pool_instances if i.serving and i.instance_id not in exclude]
        if not candidates:
            return None
        return min(candidates, key=_decode_load)


def spread_branches(n: int, instances: tuple[InstanceSnapshot, ...]) -> tuple[BranchAssignment, ...]:
    """Each branch goes to the instance with the fewest branches, counting those just placed;
    ties go to the freer KV cache, then the lower instance id (deterministic)."""
    if not instances:
        raise ValueError("spread_branches needs at least one instance")
    extra = {i.instance_id: 0 for i in instances}
    chosen: dict[str, list[int]] = {}
    for b in range(n):
        inst = min(instances, key=lambda i: (i.assigned_branches + extra[i.instance_id], i.kv_usage, i.instance_id))
        extra[inst.instance_id] += 1
        chosen.setdefault(inst.instance_id, []).append(b)
    return tuple(BranchAssignment(iid, tuple(bs)) for iid, bs in chosen.items())


def _prefill_load(i: InstanceSnapshot) -> tuple:
    return (i.assigned_requests + i.num_waiting, i.kv_usage, i.instance_id)


def _decode_load(i: InstanceSnapshot) -> tuple:
    return (i.assigned_branches, i.kv_usage, i.instance_id)
