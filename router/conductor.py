"""The Conductor: placement by predicted cost, admission control, and short→long promotion.

Interface (the cluster and the simulator both drive exactly this)::

    c = Conductor(ConductorConfig())
    c.place(req: PlacementRequest, snap: ClusterSnapshot, now: float)
        -> Placement      where the prompt prefills, which decode pool, which instance per branch
         | Refusal        refuse now (gRPC RESOURCE_EXHAUSTED with ``Refusal.reason``)
         | None           nothing serving can take it now: wait and ask again
    c.place_decode(req, snap, length) -> (pool, branch assignments) | None
                          at handoff: decode placement again, with the length the prefill's
                          hidden state refined (``c.predict(req with features.hidden)``)
    c.promotions(snap, progress: tuple[BranchProgress, ...]) -> tuple[Promotion, ...]
                          branches in short_decode to live-migrate to long_decode, and where
    c.refine(length, ProgressState(tokens, hidden)) -> LengthDistribution   (while decoding)
    c.observe_running(features, tokens) -> int   (a branch passed long_threshold: learn it now;
                          c.censored_at(tokens): what it would learn, without learning it)
    c.observe_finished(features, output_len, progress=(), at_least=0)        (learn online;
                          c.observing_finished(...): the same, one SGD step per next())
    c.priority_of(slo_class) -> engine priority;  c.config.efforts.budget(effort) -> int | None

Decisions, for one request::

    length  = predictor(prompt n-grams, prompt length, prefill hidden state) capped at max_tokens
    prefill = argmin over prefill instances of estimated TTFT
              = fixed + (queued prefill tokens + prompt − prefix hits) · s_per_token
                + (store hits) · s_per_store_token       hits: its device prefix cache, and the
                                                          CPU store of its node (prefix affinity)
              fixed, s_per_token, s_per_store_token: fitted from measured prefills (cost_fit.py),
              the config the prior
    refuse  if the class has admission control and TTFT (counted from arrival) > its target
              (Mooncake's early rejection: refuse before any prefill is spent on it), or its
              TPOT estimate misses in the chosen decode pool and in the other one (spill-over);
              TPOT = step + batch · s_per_seq, fitted per pool from its instances' decode steps
              (cost_fit.py): a pool's contexts set its cost per branch (long chains read more KV)
    pool    = long_decode if P(len > long_threshold) > long_probability else short_decode
              (short_decode while the predictor is uninformed: ``cold_start_requests``);
              the other decode pool if that one's free batch slots (max_num_seqs − batch) cannot
              take the n branches and the other's can: short → long always, long → short only
              if P(len > long_threshold) ≤ ``spill_long_max_probability``; neither: it stays
    decode  = per branch, the instance of that pool with the highest Llumnix freeness
              F = (free blocks − reserved − blocks for the predicted length) / (batch + 1)
              among those with a free batch slot (any, once none has one: it queues there),
              counting branches placed by this decision (Best-of-N spreads)
    local   conditional disaggregation (NVIDIA Dynamo's term): a short_decode request whose
              branches all go to one instance D, with a prompt of at most
              ``max_local_prefill_length`` tokens and P(len > L) ≤ ``local_max_long_probability``
              (prefilled in place, it forgoes the prediction the prefill's hidden state refines
              at hand-off), prefills on D itself (``LOCAL_PREFILL``) when
                  ttft(D's queued prompt tokens, prompt, D's hits) + TPOT(D's batch)
                < ttft(best prefill instance) + handoff
              (the same models: D computes the prompt in steps that also decode its batch; ttft
              on a decode instance is fitted apart from the prefill pool's, from local prefills
              (``observe_local_prefill``): a decode engine runs behind its batch's step, at its
              own CPU share; handoff: prefilled → page set imported, fitted from the cluster's
              hand-offs), so a burst queued on the prefill pool does not wait there while
              short_decode has room, and the side measured faster takes the prompts

A branch in short_decode is promoted once its tokens pass its admission-time predicted length
at ``promotion_quantile`` by ``promotion_margin`` (or once it passes ``long_threshold``), to
the long_decode instance with the most headroom that has a free batch slot (none free: it waits). Without prefill + decode pools the request runs
colocated on the ``mixed`` instance with the lowest TTFT estimate.
"""
from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from .cost_fit import DecodeCostFit, DecodeFitConfig, LinearFit, PrefillCostFit, PrefillFitConfig
from .lengths import LengthDistribution
from .placement import COLOCATED, DISAGGREGATED, LOCAL_PREFILL, BranchAssignment, Placement, PlacementRequest
from .predictor import LengthFeatures, LengthPredictor, PredictorConfig, ProgressState
from .snapshot import (LONG_DECODE, MIXED, PREFILL, PREFILL_POOLS, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot,
                       ServingIndex)

INTERACTIVE = "interactive"
STANDARD = "standard"
BATCH = "batch"
EFFORTS = ("low", "medium", "high")


@dataclass(frozen=True)
class SLOClass:
    """Targets of one priority class. ``None``: no target. ``admission``: refuse at arrival when
    the TTFT target cannot be met (else queue). ``engine_priority``: lower runs first."""

    name: str
    ttft_s: float | None
    tpot_s: float | None
    engine_priority: int
    admission: bool = False


DEFAULT_SLO_CLASSES = (
    SLOClass(INTERACTIVE, ttft_s=1.0, tpot_s=0.1, engine_priority=0, admission=True),
    SLOClass(STANDARD, ttft_s=10.0, tpot_s=0.25, engine_priority=1),
    SLOClass(BATCH, ttft_s=None, tpot_s=None, engine_priority=2),
)


@dataclass(frozen=True)
class ReasoningEfforts:
    """Thinking budget (tokens inside ``<think>``) per effort; ``None``: unlimited."""

    low: int | None = 256
    medium: int | None = 1024
    high: int | None = None

    def budget(self, effort: str | None) -> int | None:
        """The thinking budget of ``effort`` (None for no effort given, or an unlimited one)."""
        if effort is None:
            return None
        if effort not in EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {EFFORTS}, got {effort!r}")
        return getattr(self, effort)


@dataclass(frozen=True)
class PrefillCostModel:
    """TTFT estimate of a prompt on one instance (coefficients in seconds). The configured values
    are the prior: the Conductor refits all three from measured prefills
    (``cost_fit.PrefillCostFit``, fed by ``Conductor.observe_prefill``)."""

    fixed_s: float = 0.01                  # scheduling, handoff, first decode step
    s_per_token: float = 2e-4              # prefill compute per prompt token not cached
    s_per_store_token: float = 2e-5        # loading a prefix token from the node's CPU store

    def ttft(self, queued_tokens: int, prompt_tokens: int, device_hit_tokens: int = 0,
             store_hit_tokens: int = 0) -> float:
        tokens, store = self.work(queued_tokens, prompt_tokens, device_hit_tokens, store_hit_tokens)
        return self.fixed_s + tokens * self.s_per_token + store * self.s_per_store_token

    @staticmethod
    def work(queued_tokens: int, prompt_tokens: int, device_hit_tokens: int = 0,
             store_hit_tokens: int = 0) -> tuple[int, int]:
        """(tokens to compute, queue included; prefix tokens to load from the store)."""
        device = min(device_hit_tokens, prompt_tokens)
        store = max(0, min(store_hit_tokens, prompt_tokens) - device)   # what the device lacks
        return queued_tokens + prompt_tokens - device - store, store


@dataclass(frozen=True)
class DecodeCostModel:
    """Time per output token of an instance with ``b`` branches in its batch. The configured
    values are the prior: the Conductor refits both from the instances' decode steps
    (``cost_fit.DecodeCostFit``, fed by ``Conductor.observe_decode``)."""

    step_s: float = 0.01
    s_per_seq: float = 5e-4

    def tpot(self, batch: int) -> float:
        return self.step_s + self.s_per_seq * batch


@dataclass(frozen=True)
class ConductorConfig:
    predictor: PredictorConfig = PredictorConfig()
    slo_classes: tuple[SLOClass, ...] = DEFAULT_SLO_CLASSES
    efforts: ReasoningEfforts = ReasoningEfforts()
    prefill_cost: PrefillCostModel = PrefillCostModel()    # the prior of the fitted model
    prefill_fit: PrefillFitConfig = PrefillFitConfig()
    decode_cost: DecodeCostModel = DecodeCostModel()        # the prior of the fitted model
    decode_fit: DecodeFitConfig = DecodeFitConfig()
    long_threshold: int = 512               # L: a branch longer than this is long
    long_probability: float = 0.5           # p: long_decode when P(len > L) > p
    headroom_quantile: float = 0.9          # KV reserved for this quantile of the predicted length
    promotion_quantile: float = 0.9
    promotion_margin: float = 1.5           # promote once tokens > margin · that quantile
    # Promotions per call (a round): migrations are not free. The cap grows with the long pool,
    # ``promotions_per_long_instance`` per serving long_decode instance (rounded up), with
    # ``max_promotions`` the floor: a cluster 8x the size, at 8x the arrivals, has 8x the chains
    # to promote per round (a cap for the whole cluster starved the 128-GPU study). 0: the
    # constant cap ``max_promotions`` alone.
    max_promotions: int = 8
    promotions_per_long_instance: float = 0.5
    # Survivorship (``observe_finished`` with ``now`` and ``decode_s``): a branch that finished
    # at or below ``long_threshold`` is learned when it would have passed the threshold at its
    # own pace (finish + (threshold + 1 − tokens) × its seconds per token, at most
    # ``max_learning_delay_s`` later), which is when a long branch admitted with it is learned
    # (``observe_running``). Learned at its finish, the short outcomes of a cohort come before
    # its long ones, and a start-up under load teaches the predictor that everything is short.
    survivorship_delay: bool = True
    max_learning_delay_s: float = 600.0
    # Batch caps (``InstanceSnapshot.max_num_seqs``): when no instance of the predicted decode
    # pool has a free batch slot for the request's branches, they spill to the other decode pool
    # if it has room — short → long always (a long instance decodes a short request as well, only
    # beside longer chains), long → short only for a request that is more likely than not to
    # finish in short_decode: P(len > long_threshold) ≤ this. A chain predicted long would hold a
    # short_decode slot for its whole life (promotion waits for a long_decode slot too), and the
    # short requests the pools protect would queue behind it; so by default (with
    # long_probability 0.5) a request predicted long waits for a long_decode slot.
    spill_long_max_probability: float = 0.5
    # Cold start: an uninformed predictor (no configured prior, no fitted state, fewer finished
    # requests than this) knows nothing of lengths, so every request decodes in short_decode and
    # the long ones are promoted once they pass long_threshold — a misplaced short request would
    # otherwise sit behind long chains, and promotion cannot move it back.
    cold_start_requests: int = 16
    # Conditional disaggregation (module doc): a short prompt may prefill on its short_decode
    # instance when that is estimated faster than the prefill pool plus the hand-off. Off by
    # default: on the CPU cluster it raised the short requests' TTFT P99 in every measured pair
    # (a local prompt waits for the decode step in flight); see README "Pools, conditional
    # disaggregation".
    conditional_disagg: bool = False
    max_local_prefill_length: int = 512     # longer prompts always prefill in the prefill pool
    # A local prefill forgoes the re-prediction with the prefill's hidden state at hand-off, so
    # only a request predicted confidently short takes it: P(len > long_threshold) ≤ this.
    local_max_long_probability: float = 0.1
    handoff_s: float = 0.005                # prior of the hand-off time (refitted from hand-offs)
    handoff_fit_decay: float = 0.95         # weight of a measured hand-off per newer one

    def __post_init__(self):
        names = [c.name for c in self.slo_classes]
        if sorted(names) != sorted(set(names)) or STANDARD not in names:
            raise ValueError(f"slo_classes must have distinct names including {STANDARD!r}, got {names}")
        if not 0.0 <= self.long_probability < 1.0:
            raise ValueError(f"long_probability must be in [0, 1), got {self.long_probability}")
        for name in ("headroom_quantile", "promotion_quantile"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.max_promotions < 0 or not self.promotions_per_long_instance >= 0:
            raise ValueError(f"max_promotions and promotions_per_long_instance must be >= 0, got "
                             f"{self.max_promotions} and {self.promotions_per_long_instance}")
        if not self.max_learning_delay_s >= 0:
            raise ValueError(f"max_learning_delay_s must be >= 0, got {self.max_learning_delay_s}")
        if self.promotion_margin < 1.0:
            raise ValueError(f"promotion_margin must be >= 1, got {self.promotion_margin}")
        if self.cold_start_requests < 0:
            raise ValueError(f"cold_start_requests must be >= 0, got {self.cold_start_requests}")
        if self.max_local_prefill_length < 0 or self.handoff_s < 0:
            raise ValueError("max_local_prefill_length and handoff_s must be >= 0")
        if not 0.0 <= self.spill_long_max_probability <= 1.0:
            raise ValueError(f"spill_long_max_probability must be in [0, 1], got {self.spill_long_max_probability}")
        if not 0.0 <= self.local_max_long_probability <= 1.0:
            raise ValueError(f"local_max_long_probability must be in [0, 1], got {self.local_max_long_probability}")
        if not 0.0 < self.handoff_fit_decay <= 1.0:
            raise ValueError(f"handoff_fit_decay must be in (0, 1], got {self.handoff_fit_decay}")


@dataclass(frozen=True)
class Refusal:
    """Refused at admission (``RESOURCE_EXHAUSTED``); ``reason`` is what the client reads."""

    reason: str
    slo_class: str
    estimated_ttft_s: float
    target_s: float


class BranchProgress(NamedTuple):
    """One decoding branch as the frontend tracks it. A named tuple rather than a frozen
    dataclass: a caller builds one per due branch per promotion round (thousands at overload),
    and a tuple is built several times faster."""

    request_id: str
    branch: int
    pool: str
    instance_id: str
    tokens: int                         # output tokens so far
    length: LengthDistribution          # predicted at admission (Placement.length)
    prompt_len: int = 0
    refined: LengthDistribution | None = None   # the latest ``refine`` of it, if any


@dataclass(frozen=True)
class Promotion:
    request_id: str
    branch: int
    source: str
    target: str
    reason: str


class Conductor:
    def __init__(self, config: ConductorConfig = ConductorConfig(), predictor: LengthPredictor | None = None):
        self.config = config
        self.predictor = predictor or LengthPredictor(config.predictor)
        self._classes = {c.name: c for c in config.slo_classes}
        self.prefill_fit = PrefillCostFit(config.prefill_cost, config.prefill_fit)
        # The TPOT model per decode pool (``decode_cost_of``): a step's cost per branch grows with
        # the context it reads, and the pools hold different contexts (short_decode's chat turns,
        # long_decode's chains), so one fit over all of them misjudges both.
        self.decode_fits: dict[str, DecodeCostFit] = {}
        # TTFT of a prompt prefilled on a decode instance (conditional disaggregation): the same
        # model and prior, fitted from local prefills only.
        self.local_prefill_fit = PrefillCostFit(config.prefill_cost, config.prefill_fit)
        # The hand-off time: an intercept-only fit (a forgetting mean, the prior worth one hand-off).
        self.handoff_fit = LinearFit((config.handoff_s,), (), config.handoff_fit_decay, 1.0)
        # Finished branches whose learning waits (``ConductorConfig.survivorship_delay``): a heap
        # of (time to learn, order, features, output_len, progress).
        self._held: list[tuple[float, int, LengthFeatures, int, tuple[ProgressState, ...]]] = []
        self._held_count = 0

    @property
    def prefix_pools(self) -> tuple[str, ...]:
        """The pools whose instances' prefix caches placement weighs, so the only ones asked to
        report them: where a prompt can prefill (prefill, mixed, and short_decode under
        conditional disaggregation, whose local estimate counts the decode instance's hits)."""
        return PREFILL_POOLS + ((SHORT_DECODE,) if self.config.conditional_disagg else ())

    @property
    def prefill_cost(self) -> PrefillCostModel:
        """The TTFT cost model in use: the configured prior refitted from measured prefills."""
        return self.prefill_fit.model

    def observe_prefill(self, tokens: int, seconds: float, store_tokens: int = 0) -> None:
        """A prefill finished ``seconds`` after its placement, which counted ``tokens`` to compute
        and ``store_tokens`` to load from the CPU store (``Placement.prefill_tokens`` and
        ``.store_tokens``): refit the TTFT cost model."""
        self.prefill_fit.observe(tokens, seconds, store_tokens)

    def observe_local_prefill(self, tokens: int, seconds: float, store_tokens: int = 0,
                              decode_step_s: float = 0.0) -> None:
        """A ``LOCAL_PREFILL`` placement's first token came ``seconds`` after it: refit the TTFT
        model of prefills on decode instances from ``seconds`` less the decode step its estimate
        counted (``Placement.decode_step_s``; at least 0: the batch stepped faster than the TPOT
        model said), with its ``prefill_tokens`` and ``store_tokens``."""
        self.local_prefill_fit.observe(tokens, max(0.0, seconds - decode_step_s), store_tokens)

    def observe_first_token(self, placement: Placement, seconds: float) -> None:
        """A placement's first token came ``seconds`` after it: refit the TTFT model its estimate
        came from, by its mode: a disaggregated prefill refits ``observe_prefill``, a prefill on
        its decode instance ``observe_local_prefill``; a colocated one is neither (its instance's
        step mixes prompts with decodes). The one entry point the cluster's orchestrator and the
        simulator's driver call."""
        if placement.mode == DISAGGREGATED:
            self.observe_prefill(placement.prefill_tokens, seconds, placement.store_tokens)
        elif placement.mode == LOCAL_PREFILL:
            self.observe_local_prefill(placement.prefill_tokens, seconds, placement.store_tokens,
                                       placement.decode_step_s)

    @property
    def handoff_s(self) -> float:
        """The hand-off time in use: the configured prior refitted from measured hand-offs."""
        return self.handoff_fit.coefficients[0]

    def observe_handoff(self, seconds: float) -> None:
        """A prefilled request's KV reached its decode instances ``seconds`` after the prefill's
        result: refit the hand-off time (a stall past ``prefill_fit.max_seconds`` is not one)."""
        if 0.0 <= seconds <= self.config.prefill_fit.max_seconds:
            self.handoff_fit.observe((), seconds)

    def decode_fit_of(self, pool: str) -> DecodeCostFit:
        """``pool``'s TPOT fit (from the configured prior until its instances report)."""
        fit = self.decode_fits.get(pool)
        if fit is None:
            fit = self.decode_fits[pool] = DecodeCostFit(self.config.decode_cost, self.config.decode_fit)
        return fit

    def decode_cost_of(self, pool: str) -> DecodeCostModel:
        """The TPOT model in use for ``pool``: the configured prior refitted from its instances'
        measured decode steps."""
        return self.decode_fit_of(pool).model

    def observe_decode(self, pool: str, steps: int, seconds: float, seqs: int) -> None:
        """An instance of ``pool`` ran ``steps`` decode-only engine steps since its last report,
        taking ``seconds`` and carrying ``seqs`` branches in all: refit that pool's TPOT model."""
        self.decode_fit_of(pool).observe(steps, seconds, seqs)

    # ---- classes and efforts ------------------------------------------------------------
    def slo(self, name: str) -> SLOClass:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(f"slo_class must be one of {sorted(self._classes)}, got {name!r}") from None

    def priority_of(self, slo_class: str) -> int:
        return self.slo(slo_class).engine_priority

    # ---- prediction ---------------------------------------------------------------------
    def predict(self, req: PlacementRequest) -> LengthDistribution:
        f = req.features or LengthFeatures(req.prompt_len)
        if f.max_tokens is None or f.thinking_budget is None:
            f = LengthFeatures(f.prompt_len, f.ngrams, req.max_tokens if f.max_tokens is None else f.max_tokens,
                               req.thinking_budget if f.thinking_budget is None else f.thinking_budget, f.hidden)
        return self.predictor.predict(f)

    def refine(self, length: LengthDistribution, progress: ProgressState) -> LengthDistribution:
        return self.predictor.refine(length, progress)

    def observe_running(self, features: LengthFeatures, tokens: int, now: float | None = None) -> int:
        """A branch still decoding has produced ``tokens``. Once they pass ``long_threshold``
        the predictor learns P(len > long_threshold) from it at once (a right-censored
        observation) instead of when the chain finishes, which for the longest takes minutes:
        fed finished lengths only, a cold predictor sees long requests' short tail first and
        places them in short_decode (survivorship bias; in the simulator at 120 req/s it sent
        ~3 of 4 long requests there for minutes and admission then refused short ones).
        Returns the tokens it learned from (0: none yet); the frontend calls it for a branch
        until it returns non-zero and hands that to ``observe_finished(at_least=)``. ``now``:
        the caller's clock in seconds (the predictor's pace, ``PredictorConfig.steps_per_s``)."""
        learned = self.censored_at(tokens)
        if learned:
            self.predictor.observe_at_least(features, learned, now)
        return learned

    def censored_at(self, tokens: int) -> int:
        """What ``observe_running`` learns from a branch with ``tokens`` so far, without learning
        it: ``long_threshold + 1`` once past the threshold, else 0."""
        threshold = self.config.long_threshold
        return threshold + 1 if tokens > threshold else 0

    def observe_finished(self, features: LengthFeatures, output_len: int,
                         progress: tuple[ProgressState, ...] = (), at_least: int = 0,
                         now: float | None = None, decode_s: float | None = None) -> None:
        """A branch finished with ``output_len`` tokens; ``at_least``: what ``observe_running``
        returned for it (so the finish adds only what the censored observation did not say).
        ``now``: the caller's clock in seconds; ``decode_s``: the seconds from the branch's first
        output token to its finish. With both, a branch that ended at or below ``long_threshold``
        is held until it would have passed the threshold (``learning_delay``), and the branches
        held until ``now`` are learned first; without, it is learned at once, one full step."""
        for _ in self.observing_finished(features, output_len, progress, at_least, now, decode_s):
            pass

    def observing_finished(self, features: LengthFeatures, output_len: int,
                           progress: tuple[ProgressState, ...] = (), at_least: int = 0,
                           now: float | None = None, decode_s: float | None = None) -> Iterator[None]:
        """``observe_finished`` one SGD step at a time (``LengthPredictor.observing``), for a
        caller that interleaves other work between the steps (the frontend's ``Learner``). Bad
        input raises here, not when a held branch is learned."""
        self.predictor.check_observation(output_len, at_least)
        if decode_s is not None and not (math.isfinite(decode_s) and decode_s >= 0):
            raise ValueError(f"decode_s must be a finite number of seconds >= 0, got {decode_s}")
        delay = 0.0 if now is None else self.learning_delay(output_len, at_least, decode_s)
        return self._observing(features, output_len, tuple(progress), at_least, now, delay)

    def learning_delay(self, output_len: int, at_least: int, decode_s: float | None) -> float:
        """How long after its finish a branch is learned (``ConductorConfig.survivorship_delay``):
        0 for a branch that passed ``long_threshold`` (its long outcome was learned when it passed,
        by ``observe_running``; the finish adds the rest) or when the delay is off or its pace is
        unknown; else the time it would have taken to reach ``long_threshold + 1`` tokens at its
        own seconds per token, at most ``max_learning_delay_s``."""
        cfg = self.config
        if not cfg.survivorship_delay or decode_s is None or at_least or output_len > cfg.long_threshold:
            return 0.0
        return min(cfg.max_learning_delay_s, (cfg.long_threshold + 1 - output_len) * decode_s / max(1, output_len))

    @property
    def held(self) -> int:
        """Finished branches waiting to be learned (``learning_delay``)."""
        return len(self._held)

    def _observing(self, features: LengthFeatures, output_len: int, progress: tuple[ProgressState, ...],
                   at_least: int, now: float | None, delay: float) -> Iterator[None]:
        observing, held = self.predictor.observing, self._held
        if now is not None:
            while held and held[0][0] <= now:           # the branches due by now, oldest first
                _, _, f, n, pr = heapq.heappop(held)
                yield from observing(f, n, pr, 0, now)
        if delay > 0.0:
            self._held_count += 1
            heapq.heappush(held, (now + delay, self._held_count, features, output_len, progress))
            return
        yield from observing(features, output_len, progress, at_least, now)

    def is_long(self, length: LengthDistribution) -> bool:
        return length.prob_greater(self.config.long_threshold) > self.config.long_probability

    @property
    def cold(self) -> bool:
        """The predictor is uninformed (see ``ConductorConfig.cold_start_requests``)."""
        p = self.predictor
        return p.config.prior is None and p.observed < self.config.cold_start_requests

    # ---- placement ----------------------------------------------------------------------
    def place(self, req: PlacementRequest, snap: ClusterSnapshot, now: float) -> Placement | Refusal | None:
        slo = self.slo(req.slo_class)
        length = req.length or self.predict(req)
        prefills = snap.pool(PREFILL).index
        pool, decoders = self.decode_pool_for(length, snap, req.n)
        mode = DISAGGREGATED
        if not prefills.serving or decoders is None:
            mode, pool = COLOCATED, MIXED
            prefills = decoders = snap.pool(MIXED).index
            if not prefills.serving:
                return None
        waited = 0.0 if req.arrival is None else max(0.0, now - req.arrival)
        hashes = req.prompt_block_hashes
        dev, store = snap.prefix.hits(hashes) if hashes else ({}, {})     # one lookup per block
        prefill, ttft, prefill_tokens, store_tokens = self._best_prefill(req, prefills, dev, store)
        if mode == COLOCATED:
            decode = (BranchAssignment(prefill.instance_id, tuple(range(req.n))),)
            batch = self._batch(prefill) + req.n
        else:
            decode, batch = self.spread(req.n, decoders,
                                        self.blocks_needed(req.prompt_len, length, decoders.serving[0]))
        tpot = None
        if slo.admission and slo.tpot_s is not None:
            tpot = self.decode_cost_of(pool).tpot(batch)
            if tpot > slo.tpot_s and mode == DISAGGREGATED:
                # The preferred pool is too busy (e.g. short_decode full of long chains awaiting
                # promotion): spill over to the other decode pool if it meets the target there,
                # rather than refuse a request the cluster can serve.
                other = LONG_DECODE if pool == SHORT_DECODE else SHORT_DECODE
                spill = snap.pool(other).index
                if spill.serving and spill.has_room(req.n):
                    d2, b2 = self.spread(req.n, spill, self.blocks_needed(req.prompt_len, length, spill.serving[0]))
                    tpot2 = self.decode_cost_of(other).tpot(b2)
                    if tpot2 <= slo.tpot_s:
                        pool, decode, batch, tpot = other, d2, b2, tpot2
        cfg = self.config
        if (mode == DISAGGREGATED and pool == SHORT_DECODE and len(decode) == 1 and cfg.conditional_disagg
                and req.prompt_len <= cfg.max_local_prefill_length
                and length.prob_greater(cfg.long_threshold) <= cfg.local_max_long_probability):
            index = snap.pool(SHORT_DECODE).index
            here = index.serving[index.position[decode[0].instance_id]]
            local_t, local_tokens, local_store, step_s = self._local_prefill(req, here, dev, store)
            if local_t < ttft + self.handoff_s:
                mode, prefill, ttft, prefill_tokens, store_tokens = LOCAL_PREFILL, here, local_t, local_tokens, \
                    local_store
        ttft += waited
        if slo.admission and slo.ttft_s is not None and ttft > slo.ttft_s:
            return Refusal(f"{slo.name} TTFT target {slo.ttft_s * 1e3:.0f} ms cannot be met: the best prefill "
                           f"instance ({prefill.instance_id}, {prefill.queued_prefill_tokens} prompt tokens queued) "
                           f"gives {ttft * 1e3:.0f} ms", slo.name, ttft, slo.ttft_s)
        if tpot is not None and tpot > slo.tpot_s:
            return Refusal(f"{slo.name} TPOT target {slo.tpot_s * 1e3:.0f} ms cannot be met: the {pool} pool's "
                           f"freest instance would run {batch} branches at {tpot * 1e3:.0f} ms per token",
                           slo.name, ttft, slo.ttft_s or 0.0)
        predicted = min(length.median(), req.max_tokens)
        return Placement(mode, prefill.instance_id, pool, decode, predicted, slo.engine_priority, length, ttft,
                         prefill_tokens, store_tokens, step_s if mode == LOCAL_PREFILL else 0.0)

    def place_decode(self, req: PlacementRequest, snap: ClusterSnapshot,
                     length: LengthDistribution) -> tuple[str, tuple[BranchAssignment, ...]] | None:
        """At handoff, with the prediction the prefill's hidden state refined: the decode pool and
        an instance per branch; ``None`` when no decode pool serves (keep the admission plan)."""
        pool, decoders = self.decode_pool_for(length, snap, req.n)
        if decoders is None:
            return None
        decode, _ = self.spread(req.n, decoders, self.blocks_needed(req.prompt_len, length, decoders.serving[0]))
        return pool, decode

    def decode_pool_for(self, length: LengthDistribution, snap: ClusterSnapshot,
                        n: int = 1) -> tuple[str, ServingIndex | None]:
        """The decode pool for a predicted length and ``n`` branches, and the index of its serving
        instances; ``None`` when neither decode pool serves. The other decode pool when the
        predicted one has no serving instance, or when its free batch slots cannot take the ``n``
        branches and the other's can (``spill_long_max_probability`` says when a request predicted
        long may spill to short_decode); when neither has room, the predicted pool (they queue)."""
        pool = LONG_DECODE if not self.cold and self.is_long(length) else SHORT_DECODE
        decoders = snap.pool(pool).index
        other = SHORT_DECODE if pool == LONG_DECODE else LONG_DECODE
        if not decoders.serving:
            pool, decoders = other, snap.pool(other).index
        elif not decoders.has_room(n) and (
                other == LONG_DECODE
                or length.prob_greater(self.config.long_threshold) <= self.config.spill_long_max_probability):
            spill = snap.pool(other).index
            if spill.serving and spill.has_room(n):
                pool, decoders = other, spill
        return pool, (decoders if decoders.serving else None)

    def blocks_needed(self, prompt_len: int, length: LengthDistribution, inst: InstanceSnapshot) -> int:
        """KV blocks one branch is predicted to need: prompt plus the headroom quantile of its length."""
        return -(-(prompt_len + length.quantile(self.config.headroom_quantile)) // max(1, inst.block_size))

    def _local_prefill(self, req: PlacementRequest, inst: InstanceSnapshot, dev: dict[str, int],
                       store: dict[str, int]) -> tuple[float, int, int, float]:
        """Estimated TTFT of prefilling on decode instance ``inst`` itself: its queued prompt
        tokens and this prompt less its hits (the prefill model fitted on decode instances), plus
        one decode step of its batch (the TPOT model: the prompt's steps also decode that batch);
        the tokens counted, and that step."""
        cost = self.local_prefill_fit.model
        device, stored = dev.get(inst.instance_id, 0) * inst.block_size, store.get(inst.node_id, 0) * inst.block_size
        step = self.decode_cost_of(inst.pool).tpot(self._batch(inst))
        t = cost.ttft(inst.queued_prefill_tokens, req.prompt_len, device, stored) + step
        return (t,) + cost.work(inst.queued_prefill_tokens, req.prompt_len, device, stored) + (step,)

    def _best_prefill(self, req: PlacementRequest, prefills: ServingIndex, dev: dict[str, int],
                      store: dict[str, int]) -> tuple[InstanceSnapshot, float, int, int]:
        """The instance with the lowest estimated TTFT (ties go to the one listed first), that
        estimate, and the tokens it counted (queued + to compute; to load from the store), for
        ``observe_prefill``. ``dev`` / ``store``: the prompt's prefix hits (``PrefixIndex.hits``)."""
        cost = self.prefill_fit.model
        instances = prefills.serving
        best_pos = prefills.least_queued
        candidates: set[int] = set()
        if dev or store:
            # Without hits TTFT is monotone in the queue, so the first least-queued instance is the
            # best of those; only instances with hits (on the device, or in their node's store) can
            # beat it.
            candidates = {prefills.position[iid] for iid in dev if iid in prefills.position}
            for node in store:
                candidates.update(prefills.by_node.get(node, ()))
            if best_pos in candidates and cost.s_per_store_token > cost.s_per_token:
                # A store measured slower than computing: the engine still loads what it holds, so
                # the least-queued instance may be slower with its hits than one without any.
                # The least queued without hits: the first outside them in the queue order.
                rest = prefills.least_queued_outside(candidates)
                if rest >= 0:
                    best_pos = rest
        best = instances[best_pos]
        best_t = cost.ttft(best.queued_prefill_tokens, req.prompt_len, dev.get(best.instance_id, 0) * best.block_size,
                           store.get(best.node_id, 0) * best.block_size)
        for pos in candidates:
            i = instances[pos]
            t = cost.ttft(i.queued_prefill_tokens, req.prompt_len, dev.get(i.instance_id, 0) * i.block_size,
                          store.get(i.node_id, 0) * i.block_size)
            if t < best_t or (t == best_t and pos < best_pos):
                best_pos, best, best_t = pos, i, t
        tokens, store_tokens = cost.work(best.queued_prefill_tokens, req.prompt_len,
                                         dev.get(best.instance_id, 0) * best.block_size,
                                         store.get(best.node_id, 0) * best.block_size)
        return best, best_t, tokens, store_tokens

    @staticmethod
    def _batch(i: InstanceSnapshot) -> int:
        return max(i.num_running_seqs, i.assigned_branches)

    def spread(self, n: int, instances: ServingIndex, need: int) -> tuple[tuple[BranchAssignment, ...], int]:
        """Each branch to the instance with the highest Llumnix freeness (free − reserved − need)
        / (batch + 1) among those with a free batch slot, counting this decision's branches (and
        slots); once no instance has a slot left the rest go by freeness alone (they queue there).
        Ties go to the smaller batch, then the instance listed first (the cluster lists by id).
        Also returns the smallest resulting batch among the chosen instances (for the TPOT check)."""
        serving = instances.serving
        if n == 1:                          # most requests: one C-level pass over the pool
            pos = instances.freest(need)
            return (BranchAssignment(serving[pos].instance_id, (0,)),), instances.batch[pos] + 1
        # A heap of (full, −freeness, batch, position, headroom, slots): placing a branch only
        # changes its own instance, and only lowers its freeness, so while every instance has a
        # slot for each of the n branches an instance below n others is never chosen: the heap
        # holds just the n freest (with the ties at the n-th). An instance that can fill up
        # within this decision drops behind every one with a slot, so then all are candidates.
        headroom, batch, slots = instances.headroom, instances.batch, instances.slots
        f = instances.freeness(need)
        if len(f) > n and instances.all_have_room(n):
            t = heapq.nlargest(n, f)[-1]
            cand = [pos for pos, x in enumerate(f) if x >= t]
        else:
            cand = range(len(f))
        heap = [(slots[pos] <= 0, -f[pos], batch[pos], pos, headroom[pos], slots[pos]) for pos in cand]
        heapq.heapify(heap)
        chosen: dict[int, list[int]] = {}
        for branch in range(n):
            _, _, b, pos, free, left = heapq.heappop(heap)
            chosen.setdefault(pos, []).append(branch)
            free -= need
            left -= 1
            heapq.heappush(heap, (left <= 0, -(free - need) / (b + 2), b + 1, pos, free, left))
        batches = {pos: b for _, _, b, pos, _, _ in heap if pos in chosen}
        return (tuple(BranchAssignment(serving[pos].instance_id, tuple(bs)) for pos, bs in chosen.items()),
                min(batches.values()))

    def pick_target(self, pool_instances: tuple[InstanceSnapshot, ...], *, exclude: frozenset[str] = frozenset(),
                    branches: int = 1) -> InstanceSnapshot | None:
        """The freest serving instance for moved work (migration, resume), or ``None``; the same
        contract as ``LeastLoadedPolicy.pick_target``."""
        candidates = tuple(i for i in pool_instances if i.serving and i.instance_id not in exclude)
        if not candidates:
            return None
        return candidates[ServingIndex(candidates).freest(0)]     # one with a free slot, if any

    # ---- promotion ----------------------------------------------------------------------
    # The promotion rules, in the order they are tried (the first that holds is the reason).
    _MARGIN, _THRESHOLD, _REFINED = 0, 1, 2

    def _due_rule(self, p: BranchProgress, q: int) -> int | None:
        """Which rule makes ``p`` due (``_MARGIN``, ``_THRESHOLD``, ``_REFINED``), or ``None``; ``q``:
        its predicted length at ``promotion_quantile``. The numeric test alone, so that
        ``promotions`` formats a reason only for the branches it moves (at overload thousands are
        due every round and at most ``promotion_cap`` move)."""
        cfg = self.config
        if p.pool != SHORT_DECODE:
            return None
        if p.tokens > cfg.promotion_margin * q:
            return self._MARGIN
        if p.tokens > cfg.long_threshold:
            return self._THRESHOLD
        if p.refined is not None and self.is_long(p.refined):
            return self._REFINED
        return None

    def _due_reason(self, p: BranchProgress, rule: int, q: int) -> str:
        cfg = self.config
        if rule == self._MARGIN:
            limit = cfg.promotion_margin * q
            return f"{p.tokens} tokens > {cfg.promotion_margin:g} x predicted P{cfg.promotion_quantile * 100:g} ({limit:g})"
        if rule == self._THRESHOLD:
            return f"{p.tokens} tokens > long_threshold {cfg.long_threshold}"
        return (f"refined P(len > {cfg.long_threshold}) = {p.refined.prob_greater(cfg.long_threshold):.2f}"
                f" > {cfg.long_probability:g}")

    def promotion_due_at(self, length: LengthDistribution) -> int:
        """The fewest output tokens at which a short_decode branch predicted ``length`` (not
        refined since) is due (``promotions`` would move it): a caller tracking many branches needs to hand
        ``promotions`` only those that reached it (the others are not considered there)."""
        cfg = self.config
        return min(math.floor(cfg.promotion_margin * length.quantile(cfg.promotion_quantile)) + 1,
                   cfg.long_threshold + 1)

    def promotion_cap(self, long_instances: int) -> int:
        """The most branches one ``promotions`` call moves into a long pool of ``long_instances``
        serving instances: ``promotions_per_long_instance`` each (rounded up), at least
        ``max_promotions``."""
        cfg = self.config
        return max(cfg.max_promotions, math.ceil(cfg.promotions_per_long_instance * long_instances))

    def promotions(self, snap: ClusterSnapshot, progress: tuple[BranchProgress, ...]) -> tuple[Promotion, ...]:
        """Branches to move short→long, most overdue first, each to the long_decode instance with
        the most headroom for its remaining predicted length among those with a free batch slot
        (counting moves decided here); none once no long_decode instance has a slot (a migration
        to a full batch would only wait there, its KV held twice)."""
        cfg = self.config
        index = snap.pool(LONG_DECODE).index
        targets = index.serving
        if not targets:
            return ()
        due, pq, rule_of = [], cfg.promotion_quantile, self._due_rule
        for pos, p in enumerate(progress):
            q = p.length.quantile(pq)
            rule = rule_of(p, q)
            if rule is not None:
                # most overdue first, then by request and branch (then as listed: never reached
                # for distinct branches; it keeps the tuples from comparing BranchProgress)
                due.append((-(p.tokens / max(1, q)), p.request_id, p.branch, pos, p, rule, q))
        if not due:
            return ()
        # the promotion_cap most overdue (what sorting all of them and slicing gives; at overload
        # thousands are due every round, waiting for room in long_decode)
        due = heapq.nsmallest(self.promotion_cap(len(targets)), due)
        free = {i.instance_id: i.num_free_blocks - i.reserved_blocks for i in targets}
        batch = {i.instance_id: self._batch(i) for i in targets}
        # slots counted only where some target could fill up within this call
        slots = None if index.all_have_room(len(due)) else dict(zip(free, index.slots))
        if slots is not None:
            free = {iid: f for iid, f in free.items() if slots[iid] > 0}
        out = []
        for *_, p, rule, q in due:
            if not free:
                break
            need = self.blocks_needed(p.prompt_len, p.refined or p.length.at_least(p.tokens), targets[0])
            iid = max(free, key=lambda k: ((free[k] - need) / (batch[k] + 1), -batch[k]))
            free[iid] -= need
            batch[iid] += 1
            if slots is not None:
                slots[iid] -= 1
                if slots[iid] <= 0:
                    del free[iid]
            out.append(Promotion(p.request_id, p.branch, p.instance_id, iid, self._due_reason(p, rule, q)))
        return tuple(out)
