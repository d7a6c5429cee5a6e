"""Executor model: how long one engine step takes, from what the batch computes and reads.

A step is summarised by four numbers (``BatchShape``): prompt tokens computed, how many cached
tokens those prompt tokens attend to, decoding sequences, and the cached tokens they attend to.

- ``RooflineCost`` (GPU kinds): time = overhead + max(FLOPs / peak, bytes / bandwidth) + TP
  all-reduces, with bytes = weights + KV read + KV written.
- ``LinearCost`` (the ``cpu`` kind): a least-squares fit of the step times a local cluster's
  engines reported on this machine (``bench/fit_sim_cpu.py`` writes ``cpu_fit.json``). A step
  with prompt tokens runs the engine's per-layer path and pays a fixed cost a decode-only step
  (one native call for all layers) does not (``c_mixed``). Engines of one node share its cores:
  a step is slowed by ``contention`` of the other engines of the node stepping at its start and
  of other processes' work. It also carries the frontend's latencies (client -> engine, engine
  -> client), which the simulator adds.

Runs of identical decode steps are priced in closed form: with ``n`` sequences decoding, step
``j`` of a run attends to ``ctx0 + j*n`` cached tokens, so every term is affine in ``j`` and the
run's time is a sum of arithmetic series (``DecodeRun``); the simulator never loops per token.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import IntEnum
from functools import lru_cache
from pathlib import Path

from .hardware import (FLOPS_EFFICIENCY, GPU_MEMORY_UTILIZATION, GPU_STEP_OVERHEAD_S,
                       GPU_TRANSFER_LATENCY_S, HBM_EFFICIENCY, GpuKind, ModelShape)

CPU_FIT_PATH = Path(__file__).with_name("cpu_fit.json")


@dataclass(frozen=True)
class BatchShape:
    prefill_tokens: int = 0   # prompt (or recomputed) tokens computed this step
    prefill_ctx: int = 0      # sum over those tokens of the positions each attends to
    num_decode: int = 0       # sequences computing one token each
    decode_ctx: int = 0       # sum over decoding sequences of their attended positions


@dataclass(frozen=True)
class DecodeRun:
    """Step ``j`` (0-based) of a run of decode steps takes ``const + max(a + b*j for a, b in lines)``."""

    const: float
    lines: tuple[tuple[float, float], ...]

    def scaled(self, m: float) -> "DecodeRun":
        """The same run with every step ``m`` times as long."""
        return DecodeRun(self.const * m, tuple((a * m, b * m) for a, b in self.lines))

    def time(self, k: int) -> float:
        """Total time of the first ``k`` steps."""
        if k <= 0:
            return 0.0
        return k * self.const + _sum_max(self.lines, k)

    def steps_within(self, dt: float, k: int) -> int:
        """The fewest steps (1..k) whose total time reaches ``dt``: the step running at ``dt``
        completes before anything else can happen on the instance.

        ``time`` increases with the steps, so this is a bisection; it starts from where the
        series' closed form puts ``dt`` (``_guess``) and gallops out from there to bracket it, so
        a typical call prices two step counts instead of ~log2(k) (an instance's reports and
        interruptions ask this of every decode run in flight). The answer is the bisection's."""
        if k <= 1:
            return 1
        time = self.time
        g = self._guess(dt, k)
        step = 1
        if time(g) >= dt:               # the answer is g or fewer
            lo, hi = 1, g
            while True:
                m = hi - step
                if m < 1:
                    break
                if time(m) < dt:
                    lo = m + 1
                    break
                hi, step = m, step * 2
        elif g == k:                    # none reaches dt: the whole run
            return k
        else:                           # more than g
            lo, hi = g + 1, k
            while lo < k:
                m = lo + step - 1
                if m >= k:
                    break
                if time(m) >= dt:
                    hi = m
                    break
                lo, step = m + 1, step * 2
        while lo < hi:
            mid = (lo + hi) // 2
            if self.time(mid) >= dt:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _guess(self, dt: float, k: int) -> int:
        """About the fewest steps (1..k) whose time reaches ``dt``, from the closed form: the run's
        per-step time follows one line up to where the other overtakes it, and within a line the
        time of ``s + n`` steps is quadratic in ``n``."""
        const, lines = self.const, self.lines
        if len(lines) == 1:
            (a, b), start = lines[0], 0
        else:
            (a1, b1), (a2, b2) = lines
            d, e = a1 - a2, b1 - b2
            if e == 0:
                (a, b), start = (lines[0] if d >= 0 else lines[1]), 0
            else:
                if e > 0:
                    switch, first, then = min(k, max(0, math.ceil(-d / e))), lines[1], lines[0]
                else:
                    switch, first, then = min(k, max(0, math.floor(d / -e) + 1)), lines[0], lines[1]
                if switch > 0 and self.time(switch) >= dt:
                    (a, b), start = first, 0
                else:
                    (a, b), start = then, switch
        rest = dt - self.time(start)
        # n steps from ``start``: n * (const + a + b * (start - 1/2)) + b/2 * n^2 = rest
        c1 = const + a + b * (start - 0.5)
        if b > 0:
            disc = c1 * c1 + 2.0 * b * rest
            n = (math.sqrt(disc) - c1) / b if disc >= 0.0 else 0.0
        else:
            n = rest / c1 if c1 > 0 else 0.0
        if not n == n or n > k:                 # NaN or beyond the run
            return k
        return min(k, max(1, start + math.ceil(n)))


def _series(a: float, b: float, lo: int, hi: int) -> float:
    """sum of a + b*j for j in [lo, hi)."""
    n = hi - lo
    return a * n + b * n * (lo + hi - 1) / 2.0 if n > 0 else 0.0


def _sum_max(lines: tuple[tuple[float, float], ...], k: int) -> float:
    if len(lines) == 1:
        a, b = lines[0]
        return _series(a, b, 0, k)
    (a1, b1), (a2, b2) = lines
    d, e = a1 - a2, b1 - b2
    if e == 0:
        return _series(a1, b1, 0, k) if d >= 0 else _series(a2, b2, 0, k)
    if e > 0:  # line 1 wins from j0 on
        j0 = min(k, max(0, math.ceil(-d / e)))
        return _series(a2, b2, 0, j0) + _series(a1, b1, j0, k)
    j1 = min(k, max(0, math.floor(d / -e) + 1))  # line 1 wins up to j1
    return _series(a1, b1, 0, j1) + _series(a2, b2, j1, k)


class RooflineCost:
    def __init__(self, gpu: GpuKind, model: ModelShape):
        self.gpu, self.model = gpu, model
        tp = model.tensor_parallel
        self._flops_rate = gpu.bf16_flops * FLOPS_EFFICIENCY * tp
        self._byte_rate = gpu.hbm_bw * HBM_EFFICIENCY * tp
        self._kv_tok = model.kv_bytes_per_token
        self._attn = model.attn_flops_per_ctx_token
        self._lin = 2.0 * model.num_params

    def num_gpus(self) -> int:
        return self.model.tensor_parallel

    def kv_capacity_tokens(self) -> int:
        m, tp = self.model, self.model.tensor_parallel
        free = self.gpu.hbm_bytes * GPU_MEMORY_UTILIZATION * tp - m.weight_bytes
        if free <= 0:
            raise ValueError(f"{m.name} with tensor parallel {tp} does not fit {tp} {self.gpu.name} GPUs")
        return int(free // self._kv_tok)

    def _allreduce(self, tokens: int) -> float:
        tp = self.model.tensor_parallel
        if tp == 1:
            return 0.0
        nbytes = 2 * self.model.num_layers * tokens * self.model.hidden_size * self.model.dtype_bytes
        return 2 * (tp - 1) / tp * nbytes / self.gpu.nvlink_bw  # ring all-reduce

    shares_cores = False   # a GPU's engine has it to itself

    def step_time(self, b: BatchShape, others: float = 0, external: float = 0.0, background: float = 0.0) -> float:
        tokens = b.prefill_tokens + b.num_decode
        flops = self._lin * tokens + self._attn * (b.prefill_ctx + b.decode_ctx)
        # Prefill reads its prefix's KV once per step (flash attention keeps the chunk in SRAM).
        prefix = b.prefill_ctx // max(1, b.prefill_tokens) if b.prefill_tokens else 0
        nbytes = self.model.weight_bytes + self._kv_tok * (b.decode_ctx + prefix + tokens)
        return (GPU_STEP_OVERHEAD_S + max(flops / self._flops_rate, nbytes / self._byte_rate)
                + self._allreduce(tokens))

    def decode_run(self, n: int, ctx0: int, others: float = 0, external: float = 0.0,
                   background: float = 0.0) -> DecodeRun:
        fr, br = self._flops_rate, self._byte_rate
        compute = ((self._lin * n + self._attn * ctx0) / fr, self._attn * n / fr)
        memory = ((self.model.weight_bytes + self._kv_tok * (ctx0 + n)) / br, self._kv_tok * n / br)
        return DecodeRun(GPU_STEP_OVERHEAD_S + self._allreduce(n), (compute, memory))

    def transfer_time(self, nbytes: int, same_node: bool) -> float:
        bw = self.gpu.nvlink_bw if same_node else self.gpu.network_bw
        return GPU_TRANSFER_LATENCY_S + nbytes / bw


class LatencyState(IntEnum):
    """The state a frontend latency met, each with its own distribution (``FrontendLatency``; the
    fit files its samples by the same numbers, ``bench/fit_sim_cpu.py``): ``FREE`` a core free and
    the node's engines idle; ``TAKEN`` the node's engines stepping on all of its cores; ``BUSY`` a
    core free and the engine the latency waits on stepping; ``SHARED`` a core free, that engine
    idle and another engine of the node stepping; ``CROWDED`` (a first token only, whatever the
    cores) the step that computed it also decoded other requests' sequences."""

    FREE = 0
    TAKEN = 1
    BUSY = 2
    SHARED = 3
    CROWDED = 4


@dataclass(frozen=True)
class FrontendLatency:
    """The cluster's own latencies around an engine, each an empirical distribution: quantiles at
    evenly spaced probabilities (one value: a constant). ``dispatch``: client send -> the part
    reaches its engine; ``first_token`` / ``finish``: the engine publishes -> the client has it.

    ``saturated``: the same three, measured while the node's engines were stepping on all of its
    cores — at the client's send; just after the publishing step, the publishing engine counted
    if it stepped again at once (the frontend, Ray and the client then wait for a core: on this
    machine dispatch took about twice as long, ``bench/fit_sim_cpu.py``); the top-level ones are
    then those measured with a core free. None: one distribution whatever the load. The first-
    and last-token latencies run from the end of the step that computed the token (what the
    simulator has), not from its publish inside the step. ``dispatch_per_token_s``: what the
    dispatch adds per prompt token on top of its draw (the frontend's and the engine's per-token
    work on the way in: 300-token prompts took ~5 ms more than 5-17-token ones).
    ``external_scale``: (dispatch, first token, finish), how much a draw grows per core of other
    processes' work at the time (the cost's ``external_series``, what the simulator replays): a
    draw is ``q * (1 + k * external)``, the quantiles being those of no such work (with a busy
    loop at nice 0 beside the cluster, a dispatch with a core free took 5.2 ms, median, against
    3.5 ms on a quiet machine; ``bench/fit_sim_cpu.py``). Each state (a core free, ``saturated``)
    has its own.

    ``busy``: the same three with a core free while the engine the latency waits on is stepping
    (the publishing engine went straight on to its next step; the engine a dispatch goes to was
    inside one): the frontend's calls into its process wait for the step loop (on quiet runs a
    first token took 3.0-3.9 ms, median, when its engine went on decoding, 1.6-2.3 ms when it
    went idle). None: the free ones.

    ``shared``: the same three with a core free and that engine idle while another engine of
    the node is stepping (the frontend, Ray and the client have the cores left: on 2026-12-05 a
    dispatch to an idle engine took 4.4-4.5 ms, median, beside the other engine's steps, 3.0 ms
    with both idle). The top-level ones are then those with the node's engines all idle. None:
    the free ones. A request's dispatch, its prefill step and its first token's delivery are all
    slower beside another engine's steps: drawing them in their states is what gives the TTFT
    its tail (on 2026-12-05's mixed runs the TTFT's P90 from the parts measured, each shuffled
    among the requests of its state, 21.5-23.1 ms against 21.7-23.3 measured; shuffled among all
    requests 19.3-20.7).

    ``crowded``: the first token's latency when the step that computed it also decoded other
    requests' sequences (a prompt joining a running batch), whatever the state of the cores;
    None: the state's. With both engines of a mixed node stepping on, such a first token took
    3.7-5.9 ms (median) against 2.4-3.8 ms for one whose step computed prompts only, on every
    run of 2026-12-02 to 12-05 (``bench/fit_sim_cpu.py`` crowded_first_token). A part reaches
    a busy engine when the node is busy, so its dispatch, its wait and its first token's
    delivery run long together: on the eighteen mixed runs of 2026-12-05, shuffling the first
    tokens' latencies among the requests of their state took the TTFT's P90 down 3.0% on
    average (up to 7.3%), among those of their state and crowding 0.1%. Its ``dispatch_s`` and
    ``finish_s`` are not drawn.

    A draw, its mean and its deviation take the ``LatencyState`` the latency met, as ``state``
    resolves it (the simulator's ``_latency_state``; the fit files its samples by the same).

    ``niced``: (dispatch, first token, finish), how each quantile grows per core of niced outside
    work (the contention's ``background``), up to ``niced_max`` cores (the most the fit saw; more
    is taken as that): a draw at probability ``u`` is ``q(u) + niced * n(u)`` before the
    un-niced scale, so niced jobs can widen a latency's tail without moving its middle (beside
    0.5-1.0 cores of nice-10..19 jobs the first-token latency's P90 was 7-9 ms against 5 ms on a
    quiet machine, its median 3-3.5 ms in both; ``bench/fit_sim_cpu.py`` conditional_quantiles).
    ``unniced``: the same per core of un-niced outside work (up to ``unniced_max``), inside the
    ``external_scale`` (which moves the whole draw, the middle too).

    ``speed``: (dispatch, first token, finish), every draw of that latency (the dispatch's
    per-token part too) times this: the calibration's factors, the machine's frontend now over
    the fit's (``bench/fit_sim_cpu.py`` calibrate; 1.0 uncalibrated).

    ``spread``: (dispatch, first token, finish), how far a draw lies from its distribution's mean
    in its state, times this (the mean stays; a dispatch stays >= 0): the calibration's, the
    machine's spread now over the fit's (a quiet hour's pd first tokens ranged 3.7 ms, q10-q90,
    where the fit's runs of a busier day gave 5.1 ms; 1.0 uncalibrated).

    ``state_speed``: (dispatch, first token, finish), each a factor per ``LatencyState`` on top
    of ``speed``: the calibration's, how much faster or slower each state runs now than the
    others against the fit (the states' contrast moves by day: on 2026-12-03's quiet runs a
    dispatch with the node's engines all idle ran 0.98-1.10x the calibrated level and one with
    every core taken 0.87-0.95x, on 2026-12-05's 0.72-0.86x and 1.00-1.13x). Empty: 1 for all."""

    dispatch_s: tuple[float, ...] = (0.0,)
    first_token_s: tuple[float, ...] = (0.0,)
    finish_s: tuple[float, ...] = (0.0,)
    saturated: "FrontendLatency | None" = None
    busy: "FrontendLatency | None" = None
    shared: "FrontendLatency | None" = None
    crowded: "FrontendLatency | None" = None
    dispatch_per_token_s: float = 0.0
    external_scale: tuple[float, float, float] = (0.0, 0.0, 0.0)
    niced: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None
    niced_max: float = 0.0
    unniced: tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]] | None = None
    unniced_max: float = 0.0
    speed: tuple[float, float, float] = (1.0, 1.0, 1.0)
    spread: tuple[float, float, float] = (1.0, 1.0, 1.0)
    state_speed: tuple[tuple[float, ...], ...] = ()

    def state(self, taken: bool = False, busy: bool = False, shared: bool = False,
              crowded: bool = False) -> LatencyState:
        """The state whose distribution a latency draws that met these: every core of the node
        ``taken``, the engine it waits on ``busy``, another engine of the node stepping
        (``shared``), a first token's step ``crowded``. A crowded first token takes precedence
        over the cores, then every core taken, then the engine stepping, then another one; a
        state this latency has no distribution for falls back to the next (a busy engine's to
        the free one)."""
        if crowded and self.crowded is not None:
            return LatencyState.CROWDED
        if taken and self.saturated is not None:
            return LatencyState.TAKEN
        if busy:
            return LatencyState.BUSY
        return LatencyState.SHARED if shared else LatencyState.FREE

    def _at(self, state: LatencyState) -> "FrontendLatency":
        at = (None, self.saturated, self.busy, self.shared, self.crowded)[state]
        return self if at is None else at

    def _terms(self, which: int, state: LatencyState, external: float, niced: float):
        """(the state's quantiles of gap ``which``, the outside work's slope terms, the un-niced
        work's scale)."""
        at = self._at(state)
        terms = []
        if at.niced is not None and niced:
            terms.append((at.niced[which], min(niced, at.niced_max)))
        if at.unniced is not None and external:
            terms.append((at.unniced[which], min(external, at.unniced_max)))
        return (at.dispatch_s, at.first_token_s, at.finish_s)[which], terms, 1.0 + at.external_scale[which] * external

    def _speed(self, which: int, state: LatencyState) -> float:
        """Gap ``which``'s calibrated level in ``state``: ``speed`` times ``state_speed``."""
        return self.speed[which] * self.state_speed[which][state] if self.state_speed else self.speed[which]

    def _gap(self, which: int, rng, state: LatencyState, external: float, niced: float) -> float:
        q, terms, scale = self._terms(which, state, external, niced)
        x = quantile_at(q, rng.random(), terms) * scale
        if self.spread[which] == 1.0:
            return x
        x = _spread_about(x, _mean_at(q, terms) * scale, self.spread[which])
        return max(x, 0.0) if which == 0 else x

    def deviation(self, which: int, state: LatencyState = LatencyState.FREE, external: float = 0.0,
                  niced: float = 0.0) -> float:
        """The mean absolute deviation of gap ``which``'s draws from their mean in ``state``,
        before ``speed`` and ``spread``, exactly (what the calibration measures ``spread`` by)."""
        q, terms, scale = self._terms(which, state, external, niced)
        if len(q) == 1:
            return 0.0
        return _draw_deviation(_values(q, terms), _mean_at(q, terms)) * scale

    def mean(self, which: int, state: LatencyState = LatencyState.FREE, external: float = 0.0,
             niced: float = 0.0, prompt_tokens: int = 0) -> float:
        """The mean of gap ``which``'s draws (0 dispatch, 1 first token, 2 finish) in ``state``,
        exactly (the draws are linear between the quantiles)."""
        q, terms, scale = self._terms(which, state, external, niced)
        m = _mean_at(q, terms)
        return self._speed(which, state) * (m * scale + (self.dispatch_per_token_s * prompt_tokens if which == 0 else 0.0))

    def dispatch(self, rng, state: LatencyState = LatencyState.FREE, prompt_tokens: int = 0,
                 external: float = 0.0, niced: float = 0.0) -> float:
        return self._speed(0, state) * (self._gap(0, rng, state, external, niced) + self.dispatch_per_token_s * prompt_tokens)

    def first_token(self, rng, state: LatencyState = LatencyState.FREE, external: float = 0.0,
                    niced: float = 0.0) -> float:
        return self._speed(1, state) * self._gap(1, rng, state, external, niced)

    def finish(self, rng, state: LatencyState = LatencyState.FREE, external: float = 0.0,
               niced: float = 0.0) -> float:
        return self._speed(2, state) * self._gap(2, rng, state, external, niced)

    @classmethod
    def from_fit(cls, d: dict | None, speed=(1.0, 1.0, 1.0), spread=(1.0, 1.0, 1.0),
                 state_speed=()) -> "FrontendLatency | None":
        if not d:
            return None
        keys = ("dispatch_s", "first_token_s", "finish_s")

        def scale(part: dict) -> tuple[float, float, float]:
            k = tuple(float(v) for v in part.get("external_scale", (0.0, 0.0, 0.0)))
            if len(k) != 3 or not all(v >= 0.0 for v in k):
                raise ValueError(f"frontend latency external_scale = {k!r}: three values >= 0 "
                                 "(dispatch, first token, finish)")
            return k

        def slopes(part: dict) -> dict:
            """The niced and un-niced work's slopes of a state, checked."""
            out = {}
            for name in ("niced", "unniced"):
                n = part.get(name)
                if not n:
                    continue
                slopes = tuple(tuple(float(v) for v in n[k]) for k in keys)
                if not (float(n["max"]) >= 0.0 and all(len(s) == len(part[k]) for s, k in zip(slopes, keys))):
                    raise ValueError(f"frontend latency {name} = {n!r}: max >= 0 and one slope per quantile of "
                                     f"{', '.join(keys)}")
                out.update({name: slopes, f"{name}_max": float(n["max"])})
            return out

        def state(name: str) -> "FrontendLatency | None":
            part = d.get(name)
            return cls(*(tuple(float(v) for v in part[k]) for k in keys), external_scale=scale(part),
                       **slopes(part)) if part else None
        return cls(*(tuple(float(v) for v in d[k]) for k in keys),
                   saturated=state("saturated"), busy=state("busy"), shared=state("shared"),
                   crowded=state("crowded"),
                   dispatch_per_token_s=float(d.get("dispatch_per_token_s", 0.0)), external_scale=scale(d),
                   speed=tuple(float(v) for v in speed), spread=tuple(float(v) for v in spread),
                   state_speed=tuple(tuple(float(v) for v in f) for f in state_speed), **slopes(d))


def _spread_about(x: float, m: float, spread: float) -> float:
    """A draw ``x`` of a distribution with mean ``m``, its distance from the mean times ``spread``
    (a calibration's spread factor: the mean kept)."""
    return m + spread * (x - m)


def _values(q: tuple[float, ...], terms=()) -> list[float]:
    """The quantiles ``q`` with ``terms`` added (``quantile_at``)."""
    return [x + sum(amount * slope[i] for slope, amount in terms) for i, x in enumerate(q)]


@lru_cache(maxsize=None)
def draw_mean(v: tuple[float, ...]) -> float:
    """The mean of a draw linear between the quantiles ``v`` (evenly spaced probabilities; a
    fit's few distributions, each computed once; ``bench/fit_sim_cpu.py`` scales its noise
    quantiles to mean 1 by it)."""
    return v[0] if len(v) == 1 else sum(a + b for a, b in zip(v, v[1:])) / (2 * (len(v) - 1))


def _draw_inverse_mean(v) -> float:
    """The mean of ``1 / x`` for a draw ``x`` linear between the quantiles ``v`` (evenly spaced
    probabilities; all > 0), exactly: over each interval between two quantiles, equally likely,
    the mean of 1 / x for x uniform on it."""
    if len(v) == 1:
        return 1.0 / v[0]
    return sum((math.log(b) - math.log(a)) / (b - a) if abs(b - a) > 1e-12 * a else 2.0 / (a + b)
               for a, b in zip(v, v[1:])) / (len(v) - 1)


def _draw_deviation(v, m: float) -> float:
    """The mean absolute deviation from ``m`` of a draw linear between the quantiles ``v``
    (evenly spaced probabilities; more than one), exactly."""
    dev = 0.0
    for a, b in zip(v, v[1:]):      # each interval between two quantiles equally likely
        lo, hi = min(a, b), max(a, b)
        dev += abs((a + b) / 2 - m) if not lo < m < hi else ((lo - m) ** 2 + (hi - m) ** 2) / (2 * (hi - lo))
    return dev / (len(v) - 1)


def _mean_at(q: tuple[float, ...], terms=()) -> float:
    """The mean of ``quantile_at(q, u, terms)`` over ``u``: linear in the quantiles, so the mean
    of ``q``'s draws plus each term's amount times its slope's (no per-draw walk of the quantiles)."""
    return draw_mean(q) + sum(amount * draw_mean(slope) for slope, amount in terms)


def quantile_at(q: tuple[float, ...], u: float, terms=()) -> float:
    """The value at probability ``u`` of the distribution with quantiles ``q`` at evenly spaced
    probabilities (linear between them; one value: a constant), plus, for each (``slope``,
    ``amount``) of ``terms``, ``amount`` times ``slope``'s value there: ``slope`` (as long as
    ``q``) is how each quantile grows per core of some outside work (``bench/fit_sim_cpu.py``
    conditional_quantiles, which keeps the sum increasing up to the most work it saw)."""
    if len(q) == 1:
        return q[0] + sum(amount * slope[0] for slope, amount in terms)
    x = u * (len(q) - 1)
    i = min(int(x), len(q) - 2)
    f = x - i
    v = q[i] + (q[i + 1] - q[i]) * f
    for slope, amount in terms:
        v += amount * (slope[i] + (slope[i + 1] - slope[i]) * f)
    return v


def contention(others, external, cores: int, co_step: float, external_weight: float, minimum=min, maximum=max,
               background=0.0, background_weight: float = 0.0):
    """How much slower an engine's step runs than alone on its node (the ``cpu`` kind), with
    ``others`` of the node's engines stepping at the same time and ``external`` cores of other
    processes' work (a recorded run's, replayed):

        (1 + co_step * min(others, cores - 1)) * max(1, (1 + others + external_weight * external) / cores)
        * (1 + background_weight * background)

    Up to ``cores`` engines step in parallel but slow each other (``co_step`` per co-stepping
    engine: on this 2-core machine two engines stepping together each take 1.6x as long, not the
    1x a core each would give, ``bench/fit_sim_cpu.py``); beyond the cores they time-share.
    ``background``: cores of niced work beside them (lower priority: it takes no core from the
    engines, but its share of the caches and the cores' time still slows them a little, 1 +
    ``background_weight`` per core, whatever the cores' state: on a quiet machine the steps ran
    ~12% faster than beside 0.3-0.8 cores of other sessions' nice-10..19 jobs). The
    one formula prices the simulator's steps and is what the fit searches; ``minimum`` /
    ``maximum``: ``np.minimum`` / ``np.maximum`` for arrays (the fit's)."""
    return ((1.0 + co_step * minimum(others, cores - 1))
            * maximum(1.0, (1.0 + others + external_weight * external) / cores)
            * (1.0 + background_weight * background))


# A cpu fit's calibration factors (``LinearCost``; ``bench/fit_sim_cpu.py`` calibrate).
CALIBRATION_FACTORS = ("decode_steps", "woken_steps", "waking_steps", "waking_co_steps", "prompt_steps",
                       "decode_co_steps", "prompt_co_steps", "dispatch", "first_token", "finish", "dispatch_spread",
                       "first_token_spread", "finish_spread", "handoff", "handoff_busy", "handoff_spread",
                       "slow_spread")
# A step "beside" the node's other engines' steps: with them stepping for this much of it or more
# (the fit's telemetry, an overlap; the simulator's count of them stepping when it starts, >= 1).
# Such steps are calibrated apart from those alone (``decode_co_steps``, ``prompt_co_steps``,
# ``waking_co_steps``): on 2026-12-04/05 a prompt step beside the other engine's steps cost
# 1.07-1.33x more over its price than one alone, a mixed engine's decode step 1.03-1.12x, where
# on 2026-12-03's quiet runs 0.82-0.99x and 0.90-0.93x (bench/fit_sim_cpu.py ``co_stepping``):
# the machine ran one engine faster and two together relatively slower than when it was fitted.
CO_STEPPING = 0.5
# The machine's own slowness (a calibration's ``machine_sd``; ``LinearCost.machine``): on slow,
# changing hours this machine's engines and its frontend slowed down and sped up together for
# seconds at a time. Over windows of this length, an engine's decode steps' measured over priced
# time and the frontend's latencies over their means moved together (correlation 0.56-0.83 on the
# three-minute runs of 2026-12-04 and the runs of that evening; -0.6 to 0.4 on the quiet runs of
# 2026-12-03), which widened the TTFT's tail: its parts (dispatch, the engine's wait and prefill,
# the first token's delivery) ran slow together (bench/fit_sim_cpu.py ``machine_sd``).
MACHINE_WINDOW_S = 2.0
# The warm-up's first steps (its buckets up to this many steps since a wake: a short request's
# decode steps), calibrated apart alone and beside another engine's steps (``waking_steps``,
# ``waking_co_steps``; the rest of the warm-up: ``woken_steps``): on slower hours a mixed engine's
# first 20 decode steps after a prefill ran 1.2-1.4x the fit beside the other engine's steps and
# ~1.0x alone, the next 80 ~1.05x.
WAKING_STEPS = 20


def waking_buckets(edges) -> int:
    """How many of the warm-up's buckets (ending at ``edges``) lie within ``WAKING_STEPS``."""
    return sum(e <= WAKING_STEPS for e in edges)


def warmup_table(warm: dict, kind: str) -> list:
    """A fit's ``warmup`` factors for ``kind`` (``decode``, ``decode_co``, ``decode_wake``,
    ``decode_wake_co``, ``prompt``): a kind it lacks takes those of the kind it was split from
    (``decode_wake_co``: ``decode_wake``, then ``decode``)."""
    while kind not in warm:
        kind = kind[:-3] if kind.endswith("_co") else "decode"
    return warm[kind]


class LinearCost:
    """step = (c0 + c_prefill*prefill_tokens + c_decode*num_decode + c_ctx*(attended positions)
    + c_mixed*[any prefill tokens]) * ``contention(others, external)``; no contention when
    ``cores`` is None."""

    TERMS = ("c0", "c_prefill", "c_decode", "c_ctx", "c_mixed")

    def __init__(self, model: ModelShape, coeffs: dict, *, kv_capacity_tokens: int,
                 transfer_bw: float, transfer_latency_s: float, source: str = "",
                 cores: int | None = None, co_step: float = 0.0, external_weight: float = 0.0,
                 external_series: str = "external_load", latency: dict | None = None,
                 background_weight: float = 0.0,
                 step_noise: list[float] | None = None, slow: dict | None = None,
                 post_prompt: list[float] | None = None, calibration: dict | None = None,
                 prompt_noise: list[float] | None = None, warmup: dict | None = None,
                 handoff_noise: list[float] | None = None, handoff_busy_noise: list[float] | None = None,
                 post_landing: list[float] | None = None,
                 landing_hold: dict | None = None, engine_wake: list[float] | None = None):
        missing = [k for k in self.TERMS if k not in coeffs]
        if missing:
            raise ValueError(f"cpu step-cost coefficients {missing} missing (terms: {', '.join(self.TERMS)}); "
                             "refit with bench/fit_sim_cpu.py")
        for k in self.TERMS:
            if not float(coeffs[k]) >= 0.0:
                raise ValueError(f"cpu step-cost coefficient {k} = {coeffs[k]!r}: must be >= 0")
        if cores is not None and int(cores) < 1:
            raise ValueError(f"contention cores = {cores!r}: must be >= 1")
        if not (co_step >= 0.0 and external_weight >= 0.0 and background_weight >= 0.0):
            raise ValueError(f"contention co_step = {co_step!r}, external = {external_weight!r}, "
                             f"background = {background_weight!r}: must be >= 0")
        # The machine now against the fit's runs (``bench/fit_sim_cpu.py`` calibrate, from a
        # calibration run's telemetry): decode-only steps priced ``decode_steps`` times the model,
        # steps with prompt tokens ``prompt_steps`` times, each frontend latency drawn
        # ``dispatch`` / ``first_token`` / ``finish`` times its distribution. On this machine a
        # quiet cluster's decode steps ran 0.96-1.09x the fit from one session to the next, the
        # pd layout's prompt steps 1.13-1.40x, its frontend's latencies 0.82-1.22x, at the same
        # outside work (docs/simulator.md, "Calibration").
        calibration = calibration or {}
        factors = {k: calibration.get(k, 1.0) for k in CALIBRATION_FACTORS}
        factors["woken_steps"] = calibration.get("woken_steps", factors["decode_steps"])
        factors["waking_steps"] = calibration.get("waking_steps", factors["woken_steps"])
        factors["waking_co_steps"] = calibration.get("waking_co_steps", factors["waking_steps"])
        factors["decode_co_steps"] = calibration.get("decode_co_steps", factors["decode_steps"])
        factors["prompt_co_steps"] = calibration.get("prompt_co_steps", factors["prompt_steps"])
        factors["handoff_busy"] = calibration.get("handoff_busy", factors["handoff"])
        for k, v in factors.items():
            if not (isinstance(v, (int, float)) and v > 0.0):
                raise ValueError(f"cpu fit calibration {k} = {v!r}: must be a number > 0")
        self.decode_speed, self.prompt_speed = float(factors["decode_steps"]), float(factors["prompt_steps"])
        # ... and beside the node's other engines' steps (``CO_STEPPING``; a decode step's inside
        # the warm-up: ``waking_co_steps`` / ``woken_steps``, through the warm-up's tables)
        self.decode_co_speed, self.prompt_co_speed = (float(factors["decode_co_steps"]),
                                                      float(factors["prompt_co_steps"]))
        self.handoff_speed, self.handoff_spread = float(factors["handoff"]), float(factors["handoff_spread"])
        # ... a hand-off that leaves while its decode engine steps (with ``handoff_busy_noise``)
        self.handoff_busy_speed = float(factors["handoff_busy"])
        # The slow stretches' spread now over the fit's: a draw's distance from 1 (the mean) is
        # multiplied by it (on the hours whose short requests' TPOT tails ran wide, the 0.1 s
        # windows' slowness spread 1.3-1.9x the fit's; in the quietest session 0.9-1.05x).
        self.slow_spread = float(factors["slow_spread"])
        # The machine's own slowness (``machine``): the standard deviation of its log over windows
        # of MACHINE_WINDOW_S, shared by the node's engines and its frontend; 0: none.
        self.machine_sd = calibration.get("machine_sd", 0.0)
        if not (isinstance(self.machine_sd, (int, float)) and 0.0 <= self.machine_sd <= 1.0):
            raise ValueError(f"cpu fit calibration machine_sd = {self.machine_sd!r}: must be a number in [0, 1]")
        self.machine_sd = float(self.machine_sd)
        # How draws persist over time (``Simulator``'s ``_Persistent``): a draw shares ``*_rho`` of
        # its variance (on normal scores) with a process whose correlation decays as
        # exp(-gap / ``*_tau_s``); 0: independent draws. ``latency_``: the frontend's latencies
        # (and the steps with prompt tokens) of a node running slow together for fractions of a
        # second; ``slow_``: an engine's slow stretches lasting longer than a window.
        for name in ("latency", "slow"):
            rho, tau = calibration.get(f"{name}_rho", 0.0), calibration.get(f"{name}_tau_s", 0.0)
            if not (isinstance(rho, (int, float)) and 0.0 <= rho < 1.0 and isinstance(tau, (int, float))
                    and (tau > 0.0 or rho == 0.0)):
                raise ValueError(f"cpu fit calibration {name}_rho = {rho!r}, {name}_tau_s = {tau!r}: "
                                 "rho in [0, 1), tau > 0 when rho > 0")
            setattr(self, f"{name}_rho", float(rho))
            setattr(self, f"{name}_tau_s", float(tau))
        # How a first token's latency runs against the noise of the prompt step that published it
        # (the calibration's ``first_token_rho``: their normal scores' correlation; 0: apart). The
        # engine publishes a step's tokens before the step ends, and the frontend's calls into its
        # process (the GIL, the engine lock) then hold the step's end back: a step that ran long
        # after the publish had its first token reach the client soon after its end. On 2026-12-03's
        # runs the first tokens' latencies ran -0.24 to -0.46 against their steps' length (pd).
        rho = calibration.get("first_token_rho", 0.0)
        if not (isinstance(rho, (int, float)) and -1.0 < rho < 1.0):
            raise ValueError(f"cpu fit calibration first_token_rho = {rho!r}: must be a number in (-1, 1)")
        self.first_token_rho = float(rho)
        # Each engine's decode steps by its place on its node (the calibration's ``engines``: an
        # engine's measured over priced decode time over all engines'; on slower hours the
        # second engine of a 2-core node ran up to 13% slower than the first, in the quietest
        # session within 2%).
        self.engine_speeds = tuple(float(v) for v in calibration.get("engines") or ())
        if not all(v > 0 for v in self.engine_speeds):
            raise ValueError(f"cpu fit calibration engines = {calibration.get('engines')!r}: factors > 0")
        self.calibration = dict(calibration)
        self.model = model
        self.c0, self.c_prefill, self.c_decode, self.c_ctx, self.c_mixed = (float(coeffs[k]) for k in self.TERMS)
        # The per-sequence decode work (``c_decode``, ``c_ctx``) now over the fit's (the
        # calibration's ``decode_per_seq``; the other factors are measured at it): on 2026-12-04 a
        # decode step of 3-4 sequences ran 1.1-1.25x its price where a step of one ran 0.94-0.97x.
        per_seq = calibration.get("decode_per_seq", 1.0)
        if not (isinstance(per_seq, (int, float)) and per_seq > 0.0):
            raise ValueError(f"cpu fit calibration decode_per_seq = {per_seq!r}: must be a number > 0")
        self.c_decode, self.c_ctx = self.c_decode * per_seq, self.c_ctx * per_seq
        self._capacity = kv_capacity_tokens
        # A hand-off: ``transfer_latency_s`` + bytes / ``transfer_bw`` (fitted from a pd run's
        # hand-offs), times the calibration's ``handoff``, from when the exporting engine is
        # between steps: the frontend's export call waits for the engine's step loop, so a
        # prefill engine that went on to its next step at once holds the page set until that
        # step ends (``export_waits_for_step``; ``Simulator._deliver``). On this machine 2-16% of
        # hand-offs waited so (a 300-token prefill step: ~54 ms).
        self.transfer_bw, self.transfer_latency_s = transfer_bw, transfer_latency_s
        if not (transfer_bw > 0 and transfer_latency_s >= 0):
            raise ValueError(f"cpu fit transfer_bw = {transfer_bw!r}, transfer_latency_s = {transfer_latency_s!r}: "
                             "must be > 0 and >= 0")
        self.export_waits_for_step = True
        # A measured hand-off's time over the model's, as quantiles (mean 1): the simulator draws
        # one per hand-off when asked to (``Simulator(step_noise=True)``), its distance from 1
        # times the calibration's ``handoff_spread`` (on quiet hours the hand-offs were narrower
        # than the fit's, which pools runs beside 300-token prefills).
        self.handoff_noise = tuple(float(v) for v in handoff_noise) if handoff_noise else None
        if self.handoff_noise is not None and not all(v >= 0 for v in self.handoff_noise):
            raise ValueError(f"cpu fit handoff_noise = {handoff_noise!r}: quantiles >= 0")
        # Those of the hand-offs that left while their decode engine was stepping, where the fit
        # has them apart (``handoff_noise`` then holds those to an idle engine; each state's mean is
        # its level against the model's line, the two averaging 1 over the fit's hand-offs): the
        # import call waits for the engine's step loop, so on 2026-12-04/05 such hand-offs took
        # 1.9-3.7x as long on average as those to an idle engine, 1.35-1.9x on the fit's runs
        # (``bench/fit_sim_cpu.py`` decode_busy_at). None: one distribution whatever the engine.
        self.handoff_busy_noise = tuple(float(v) for v in handoff_busy_noise) if handoff_busy_noise else None
        if self.handoff_busy_noise is not None and not (self.handoff_noise is not None
                                                        and all(v >= 0 for v in self.handoff_busy_noise)):
            raise ValueError(f"cpu fit handoff_busy_noise = {handoff_busy_noise!r}: quantiles >= 0, "
                             "beside a handoff_noise")
        self.source = source
        self.cores = None if cores is None else int(cores)
        self.co_step, self.external_weight = float(co_step), float(external_weight)
        # Niced outside work's weight (``contention``): the run's total outside work less the
        # ``external_series`` (``bench/fit_sim_cpu.py`` background_at), replayed beside it.
        self.background_weight = float(background_weight)
        # Which recorded measure of other processes' work ``external`` is (a run's series that
        # ``bench/sim_fidelity.py`` records and replays; ``bench/fit_sim_cpu.py`` EXTERNAL_SERIES).
        self.external_series = external_series
        self.shares_cores = cores is not None
        gaps = ("dispatch", "first_token", "finish")
        # Each latency's level per state over its calibrated level (the calibration's
        # ``latency_states``; ``FrontendLatency.state_speed``): the states' contrast now.
        states = calibration.get("latency_states")
        if states is not None and not (isinstance(states, dict) and set(states) == set(gaps) and all(
                isinstance(f, (list, tuple)) and len(f) == len(LatencyState)
                and all(isinstance(v, (int, float)) and v > 0.0 for v in f) for f in states.values())):
            raise ValueError(f"cpu fit calibration latency_states = {states!r}: for each of {', '.join(gaps)}, "
                             f"{len(LatencyState)} factors > 0 (one per LatencyState)")
        self.frontend = FrontendLatency.from_fit(latency, tuple(float(factors[k]) for k in gaps),
                                                 tuple(float(factors[f"{k}_spread"]) for k in gaps),
                                                 tuple(states[k] for k in gaps) if states else ())
        # A measured step's duration over the model's, as quantiles (mean 1): the simulator draws
        # one per step it prices alone when asked to (``Simulator(step_noise=True)``).
        self.step_noise = tuple(float(v) for v in step_noise) if step_noise else None
        # The same for steps with prompt tokens (narrower: a 5 ms prompt step varied by 0.65-1.37x
        # around the model, q10-q90, against 0.56-1.54x for steps in all; ``step_noise`` without).
        self.prompt_noise = tuple(float(v) for v in prompt_noise) if prompt_noise else self.step_noise
        # The first decode steps after a step with prompt tokens, each this many times its price
        # (the engine's per-layer prompt path leaves the decode path's caches cold: on this
        # machine the first decode step after a prefill ran ~1.2x the model, the second ~1.1x,
        # on top of the warm-up below; ``bench/fit_sim_cpu.py`` post_prompt_factors). The simulator prices them
        # one at a time (``SimInstance._after_prompt``).
        self.post_prompt = tuple(float(v) for v in post_prompt) if post_prompt else ()
        # The first steps a decode engine starts after a page set landed on it mid-step, each
        # this many times its price (the receiving side's copy and commit run beside them: on
        # quiet runs the first ran 1.11-1.22x the model, the second 1.00-1.07x;
        # ``bench/fit_sim_cpu.py`` post_landing_factors). Priced one at a time
        # (``SimInstance._after_landing``).
        self.post_landing = tuple(float(v) for v in post_landing) if post_landing else ()
        # An idle engine's loop takes a moment to wake up to a new request: from when the request
        # reached it (the end of the dispatch latency) to the start of its step, quantiles (on
        # this machine 0.30-0.37 ms on average, q90 0.54-0.76 ms, on every run;
        # ``bench/fit_sim_cpu.py`` engine_wake). The simulator draws one per request that reaches
        # an idle engine (``SimInstance.submit``; without noise, their mean); None: it starts at once.
        self.engine_wake = tuple(float(v) for v in engine_wake) if engine_wake else None
        if self.engine_wake is not None and not all(v >= 0 for v in self.engine_wake):
            raise ValueError(f"cpu fit engine_wake = {engine_wake!r}: quantiles >= 0")
        self._wake_mean = draw_mean(self.engine_wake) if self.engine_wake else 0.0
        # A page set reaching an engine is written into its cache under the engine's lock, which
        # holds the engine's next step up by ``latency_s`` + bytes / ``bw`` (at its decode speed;
        # on quiet runs ~0.9 ms for 0.1 MB, ~2.7 ms for 2.2 MB; ``bench/fit_sim_cpu.py``
        # landing_hold; ``SimInstance.submit_import``); None: imports are free.
        self.landing_hold = dict(landing_hold) if landing_hold else None
        if self.landing_hold is not None and not (self.landing_hold["latency_s"] >= 0 and self.landing_hold["bw"] > 0):
            raise ValueError(f"cpu fit landing_hold = {landing_hold!r}: latency_s >= 0, bw > 0")
        # Warm-up after idling: a step that starts ``idle_s`` or more after its engine's previous
        # step ended wakes the engine; the steps since a wake, in buckets ending at ``edges``, are
        # priced ``decode`` / ``prompt`` times (bucket by bucket; 1 past the last edge). On this
        # machine the first prompt step after a wake ran ~1.2-1.3x the model, the decode steps of
        # the next ~0.2 s 1.06-1.36x, a pd decode engine's first three up to 1.8x
        # (``bench/fit_sim_cpu.py`` warmup_factors). The simulator prices them bucket by bucket
        # (``SimInstance._warmup``).
        self.warm_idle_s = float(warmup["idle_s"]) if warmup else 0.0
        self.warm_edges = tuple(int(v) for v in warmup["edges"]) if warmup else ()
        # The calibration's ``waking_steps`` / ``waking_co_steps`` (the buckets of the first
        # WAKING_STEPS) and ``woken_steps`` (the rest) price the decode steps inside the warm-up in
        # place of ``decode_steps`` (how much the engines' warm-up weighs on this machine now: a
        # quiet machine's cores sleep deeper than a busy one's). The decode steps after a wake by
        # a decode step (a pd decode engine's, by a hand-off: ``decode_wake``) and each beside the
        # node's other engines' steps (``_co``: the engine's first decode steps after a prefill ran
        # 1.3-1.9x the model beside them, 1.1-1.3x alone; on slower hours the warm-up beside grew
        # most: 1.6-1.9x, which ``waking_co_steps`` prices) have their own tables; a fit without
        # one prices those steps as the kind it was split from (``warmup_table``).
        def calibrated(kind: str) -> tuple[float, ...]:
            co = kind.endswith("_co")   # (priced at decode_co_speed by step_time, decode_speed alone)
            first = factors["waking_co_steps" if co else "waking_steps"]
            speed = self.decode_co_speed if co else self.decode_speed
            return tuple(float(v) * float(first if i < waking else factors["woken_steps"]) / speed
                         for i, v in enumerate(warmup_table(warmup, kind)))
        waking = waking_buckets(self.warm_edges)
        (self.warm_decode, self.warm_decode_wake, self.warm_decode_co,
         self.warm_decode_wake_co) = ((calibrated(k) for k in ("decode", "decode_wake", "decode_co", "decode_wake_co"))
                                      if warmup else ((),) * 4)
        self.warm_prompt = tuple(float(v) for v in warmup["prompt"]) if warmup else ()
        tables = (self.warm_decode, self.warm_decode_wake, self.warm_decode_co, self.warm_decode_wake_co,
                  self.warm_prompt)
        if warmup and not (self.warm_idle_s > 0 and all(b > a for a, b in zip((0,) + self.warm_edges, self.warm_edges))
                           and all(len(t) == len(self.warm_edges) and all(v > 0 for v in t) for t in tables)):
            raise ValueError(f"cpu fit warmup = {warmup!r}: idle_s > 0, increasing edges from 1, "
                             "one decode, decode_wake (and their _co) and prompt factor > 0 per edge")
        if not all(v > 0 for v in self.post_prompt):
            raise ValueError(f"cpu fit post_prompt = {post_prompt!r}: factors > 0")
        if not all(v > 0 for v in self.post_landing):
            raise ValueError(f"cpu fit post_landing = {post_landing!r}: factors > 0")
        # Slow stretches: an engine's decode steps over the model's, averaged over windows of
        # ``window_s`` (quantiles, mean 1; ``bench/fit_sim_cpu.py``): steps on this machine are
        # slow or fast together for a tenth of a second or so, so a decode run of a few dozen
        # steps does not average its steps' noise out. The simulator draws one per engine per
        # window for its decode runs when asked to (``Simulator(step_noise=True)``).
        # Niced outside work widens them (``niced``: per quantile, per core, up to ``niced_max``
        # cores; mean 0, so the niced work's mean effect stays the contention's ``background``).
        self.slow_s = tuple(float(v) for v in slow["quantiles"]) if slow else None
        self.slow_window_s = float(slow["window_s"]) if slow else None
        self.slow_niced = tuple(float(v) for v in slow["niced"]) if slow and slow.get("niced") else None
        self.slow_niced_max = float(slow.get("niced_max", 0.0)) if slow else 0.0
        self._slow_scales: dict[float, float] = {}     # by niced work (``_slow_scale``)
        if slow and not (self.slow_window_s > 0 and all(v >= 0 for v in self.slow_s)):
            raise ValueError(f"cpu fit slow = {slow!r}: window_s > 0 and quantiles >= 0")
        if self.slow_niced is not None and not (len(self.slow_niced) == len(self.slow_s) and self.slow_niced_max >= 0
                                                and all(a + self.slow_niced_max * b >= 0
                                                        for a, b in zip(self.slow_s, self.slow_niced))):
            raise ValueError(f"cpu fit slow niced = {slow.get('niced')!r}: one slope per quantile, niced_max >= 0, "
                             "and no quantile below 0 at niced_max")

    @classmethod
    def from_fit(cls, model: ModelShape, path: str | Path = CPU_FIT_PATH) -> "LinearCost":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run bench/fit_sim_cpu.py to measure the cpu kind")
        return cls.from_dict(model, json.loads(path.read_text()), source=str(path))

    @classmethod
    def from_dict(cls, model: ModelShape, fit: dict, source: str = "") -> "LinearCost":
        """The cost of a ``cpu_fit.json``'s content (``source``: where it was read from)."""
        path = source or "the cpu fit"
        if fit["model"] != model.name:
            raise ValueError(f"the cpu fit in {path} is for {fit['model']!r}, not {model.name!r}")
        shared = fit.get("contention") or {}
        if shared and "co_step" not in shared:
            raise ValueError(f"the cpu fit in {path} has the old contention model ({sorted(shared)}; "
                             "no co_step): refit with bench/fit_sim_cpu.py")
        return cls(model, fit["coeffs"], kv_capacity_tokens=fit["kv_capacity_tokens"],
                   transfer_bw=fit["transfer_bw"], transfer_latency_s=fit["transfer_latency_s"], source=str(source),
                   cores=shared.get("cores"), co_step=shared.get("co_step", 0.0),
                   external_weight=shared.get("external", 0.0),
                   external_series=shared.get("series", "external_load"), latency=fit.get("latency"),
                   background_weight=shared.get("background", 0.0),
                   step_noise=fit.get("step_noise"), slow=fit.get("slow"), post_prompt=fit.get("post_prompt"),
                   calibration=fit.get("calibration"), prompt_noise=fit.get("prompt_noise"),
                   warmup=fit.get("warmup"), handoff_noise=fit.get("handoff_noise"),
                   handoff_busy_noise=fit.get("handoff_busy_noise"),
                   post_landing=fit.get("post_landing"), landing_hold=fit.get("landing_hold"),
                   engine_wake=fit.get("engine_wake"))

    def num_gpus(self) -> int:
        return 1

    def kv_capacity_tokens(self) -> int:
        return self._capacity

    def contention(self, others: float, external: float = 0.0, background: float = 0.0) -> float:
        """How much slower a step runs with ``others`` engines of its node stepping and
        ``external`` cores of other processes' work (``contention``)."""
        if self.cores is None:
            return 1.0
        return contention(others, external, self.cores, self.co_step, self.external_weight,
                          background=background, background_weight=self.background_weight)

    def step_time(self, b: BatchShape, others: float = 0, external: float = 0.0, background: float = 0.0) -> float:
        return ((self.c0 + self.c_prefill * b.prefill_tokens + self.c_decode * b.num_decode
                 + self.c_ctx * (b.prefill_ctx + b.decode_ctx) + (self.c_mixed if b.prefill_tokens else 0.0))
                * self.contention(others, external, background) * self.speed(b.prefill_tokens > 0, others))

    def speed(self, prompt: bool, others: float = 0) -> float:
        """The calibration's factor for a step with prompt tokens (``prompt``) or a decode-only
        one, alone or beside ``others`` of the node's engines' steps (``CO_STEPPING``)."""
        if others >= CO_STEPPING:
            return self.prompt_co_speed if prompt else self.decode_co_speed
        return self.prompt_speed if prompt else self.decode_speed

    def noise(self, rng, prompt: bool = False) -> float:
        """A draw of a step's measured / modelled duration (1.0 without ``step_noise``); of a step
        with prompt tokens (``prompt``), from ``prompt_noise``."""
        q = self.prompt_noise if prompt else self.step_noise
        return quantile_at(q, rng.random()) if q else 1.0

    def wake_delay(self, rng) -> float:
        """A draw of ``engine_wake`` (with ``rng``; its mean without); 0 without it."""
        q = self.engine_wake
        if not q or rng is None:
            return self._wake_mean
        return quantile_at(q, rng.random())

    def engine_speed(self, slot: int) -> float:
        """How much longer than priced the decode steps of the engine at place ``slot`` of its
        node take (the calibration's ``engines``; 1 beyond them)."""
        return self.engine_speeds[slot] if slot < len(self.engine_speeds) else 1.0

    def slow_deviation(self, niced: float = 0.0) -> float:
        """The mean absolute deviation from 1 (their mean) of the slowness draws of a window with
        ``niced`` cores of niced outside work, before ``slow_spread``, exactly (what the
        calibration measures it by); 0 without ``slow``."""
        if not self.slow_s or len(self.slow_s) < 2:
            return 0.0
        return _draw_deviation(_values(self.slow_s, self._slow_terms(niced)), 1.0)

    def _slow_terms(self, niced: float) -> tuple:
        """``quantile_at``'s terms of the slowness with ``niced`` cores of niced outside work."""
        return ((self.slow_niced, min(niced, self.slow_niced_max)),) if self.slow_niced is not None else ()

    def machine(self, z: float) -> float:
        """How much longer than priced the node's steps and its frontend's latencies take over a
        window of MACHINE_WINDOW_S whose standard normal draw is ``z``: lognormal with
        ``machine_sd``, scaled to a mean of 1 over the draws (1 without). A mean, not a harmonic
        mean as for ``slowness``: the engines of a replayed run are seldom saturated, so a slow
        window holds as many steps as a fast one (the work that arrived), and the calibration's
        ``decode_steps`` averages the windows alike."""
        s = self.machine_sd
        return math.exp(s * z - s * s / 2) if s else 1.0

    def slowness(self, u: float, niced: float = 0.0) -> float:
        """An engine's decode steps' measured / modelled duration over one window of
        ``slow_window_s`` at probability ``u`` (a uniform draw) with ``niced`` cores of niced
        outside work (1.0 without ``slow``), scaled so that the steps average 1 over the draws
        (``_slow_scale``)."""
        if not self.slow_s:
            return 1.0
        draw = _spread_about(quantile_at(self.slow_s, u, self._slow_terms(niced)), 1.0, self.slow_spread)
        return max(0.0, draw) * self._slow_scale(niced)

    def _slow_scale(self, niced: float) -> float:
        """What the slowness draws are multiplied by so that the decode steps, not the windows,
        average the model's price: a window lasts ``slow_window_s`` whatever its slowness, so a
        slow window holds fewer steps than a fast one and the steps' mean slowness is the draws'
        harmonic mean, under their mean of 1 by their spread (the fit's spread: 0.98; calibrated
        1.3-1.6x as wide, as on the hours whose mixed TPOT ran under: 0.95-0.97). The measured
        decode time over its price (``decode_steps``) is the same harmonic mean over the
        calibration run's windows, so the draws are scaled to a harmonic mean of 1: by the mean
        of 1 / slowness."""
        key = min(niced, self.slow_niced_max) if self.slow_niced is not None else 0.0
        scale = self._slow_scales.get(key)
        if scale is None:
            values = [max(1e-3, _spread_about(v, 1.0, self.slow_spread))
                      for v in _values(self.slow_s, self._slow_terms(niced))]
            if len(self._slow_scales) > 4096:
                self._slow_scales.clear()
            scale = self._slow_scales[key] = _draw_inverse_mean(values)
        return scale

    def decode_run(self, n: int, ctx0: int, others: float = 0, external: float = 0.0,
                   background: float = 0.0) -> DecodeRun:
        f = self.contention(others, external, background) * self.speed(False, others)
        return DecodeRun(0.0, ((f * (self.c0 + self.c_decode * n + self.c_ctx * ctx0), f * self.c_ctx * n),))

    def transfer_time(self, nbytes: int, same_node: bool, rng=None, busy: bool = False) -> float:
        """A hand-off's time: its mean, or with a generator ``rng``, a draw of ``handoff_noise``;
        ``busy``: it leaves while its decode engine is stepping (``handoff_busy_noise``, at the
        calibration's ``handoff_busy``, where the fit has it)."""
        noise, speed, level = self._handoff_state(busy)
        t = (self.transfer_latency_s + nbytes / self.transfer_bw) * speed
        if rng is None or not noise:
            return t * level
        return t * max(0.0, _spread_about(quantile_at(noise, rng.random()), level, self.handoff_spread))

    def _handoff_state(self, busy: bool):
        """(the noise's quantiles, the calibration's factor, the draws' mean) of a hand-off that
        leaves while its decode engine is stepping (``busy``) or not; without the two apart, the
        one distribution of mean 1."""
        if self.handoff_busy_noise is None:
            return self.handoff_noise, self.handoff_speed, 1.0
        noise, speed = ((self.handoff_busy_noise, self.handoff_busy_speed) if busy
                        else (self.handoff_noise, self.handoff_speed))
        return noise, speed, draw_mean(noise)

    def hold_time(self, nbytes: int) -> float:
        """How long writing a page set of ``nbytes`` into an engine's cache holds its step up
        (``landing_hold``; 0 without)."""
        h = self.landing_hold
        return 0.0 if h is None else (h["latency_s"] + nbytes / h["bw"]) * self.decode_speed

    def handoff_deviation(self, busy: bool = False) -> float:
        """The mean absolute deviation of ``handoff_noise``'s draws from 1 (their mean), before
        ``handoff_spread``, exactly (what the calibration measures it by); 0 without. ``busy``: of
        the draws of a hand-off that leaves while its decode engine steps, where the fit has them
        apart; each state's over its mean (a hand-off's relative deviation)."""
        noise, _, level = self._handoff_state(busy)
        return _draw_deviation(noise, level) / level if noise and len(noise) > 1 else 0.0
