"""Fit the simulator's ``cpu`` kind from a local cluster run's own telemetry.

Input: a trace that ``bench/sim_fidelity.py`` records from a real local cluster (Ray, gRPC
frontend, tiny-reasoner engines sharing this machine's cores): every engine step of every instance
(start, duration, batch shape; ``cluster/step_telemetry.py``) and every request's client-side
timestamps with its parts' engine-side ones. Fitted, each from measured times:

- step time: ``(c0 + c_prefill*prompt tokens + c_decode*decoding branches + c_ctx*attended
  positions + c_mixed*[the step has prompt tokens]) * contention(others, external)``
  (``cluster/sim/cost.py``): ``others`` is how many of the node's other engines were stepping
  during the step (averaged over it), ``external`` the other processes' work measured during the
  run (not the cluster's; see ``sim_fidelity.CpuMonitor``). ``c_mixed`` is the per-layer path a
  step with prompt tokens runs (a decode-only step makes one native call for all layers). The
  contention's two weights (``co_step`` per co-stepping engine, ``external``) are chosen by a
  grid search (coarse, then fine around the best), the five coefficients by non-negative least
  squares at each point. Fitted on several runs at once (``--layout mixed`` and ``pd``: the
  mixed layout's engines step together, the pd layout's decode engine mostly alone), the two
  separate what a branch costs from what a co-stepping engine costs;
- dispatch latency: client send -> the part reaches its engine (gRPC, frontend, Ray actor call);
- stream latency: the engine publishes a token -> the client has it (poll, frontend, gRPC stream),
  for the first token and for the last. These three are kept as distributions (quantiles every
  1%), which the simulator draws from per request, each scaled by the other processes' un-niced
  work at the time (``external_scale``: ``1 + k * external``, ``k`` by the median's regression),
  with tails that follow the niced and un-niced work (each quantile's regression on both,
  ``conditional_quantiles``), and by state: every core taken (``saturated``), a core free while
  the engine waited on steps (``busy``), a core free and the engine idle;
- a KV hand-off's fixed cost (prefill's first token published -> the page set committed on the
  decode instance: the frontend's poll and send call, export, the transfer — same-node shared
  memory here —, import), when the run had hand-offs.

Calibration (``calibrate``): the same machine runs its engines and its frontend at a speed that
moves from one session to the next (docs/simulator.md, "Calibration"); a calibration run's
telemetry measures both against a fit, and the fit with that ``calibration`` is what the
simulator then prices with (``thinkserve sim --gpu cpu --cpu-fit``).

    python bench/fit_sim_cpu.py MIXED_TRACE PD_TRACE [TRACE ...] [--handoffs-from PD_TRACE] [--out cluster/sim/cpu_fit.json]
    python bench/fit_sim_cpu.py --calibrate TRACE [TRACE ...] [--fit cluster/sim/cpu_fit.json] --out CALIBRATED.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import time
from pathlib import Path
from statistics import NormalDist

import machine_probe
import numpy as np

from thinkserve.cluster.sim.cost import (CALIBRATION_FACTORS, CO_STEPPING, MACHINE_WINDOW_S, LatencyState, LinearCost,
                                         contention, draw_mean, waking_buckets, warmup_table)
from thinkserve.cluster.sim.hardware import TINY_REASONER

ROOT = Path(__file__).resolve().parents[1]
# Page-set bandwidth between two processes on this machine (docs/kvtransfer.md: TCP ~3.5 GB/s at
# 64 MiB, less for small page sets); tiny-reasoner page sets are small, so the fixed cost dominates.
# The bandwidth is not fitted (tiny page sets: the fixed cost dominates); the fixed cost is, from a
# run with hand-offs (``--layout pd``), else it stays at this default.
LOOPBACK_BW = 1.0e9
LOOPBACK_LATENCY_S = 0.003
# The contention's weights: a coarse grid, then a fine one around its best point. The external
# weight can pass 1: the series is the work other processes got, less than they asked for when
# the engines held the cores (a busy loop at nice 0 beside two engines got 0.6 of a core).
CO_STEP_GRID, EXTERNAL_GRID = (0.0, 3.0, 0.1), (0.0, 4.0, 0.2)   # (from, to, step)
# The niced work's weight (``background``), searched at the best (co_step, external) of the grid
# above, which is then searched again finely at the best background weight.
BACKGROUND_GRID = (0.0, 1.0, 0.01)
# The run's series of all other processes' work: the niced work is it less ``EXTERNAL_SERIES``.
TOTAL_SERIES = "external_load"
FINE_STEP = 0.01
TERMS = LinearCost.TERMS
# The latencies' empirical distributions, every 1%: drawn linearly between quantiles, so the last
# interval spreads its draws evenly up to the largest sample (every 5%, the top 5% of draws ran
# evenly from the 95th percentile, 12 ms, to a single 84 ms dispatch: 2 ms on the mean).
QUANTILES = np.linspace(0.0, 1.0, 101)
NOISE_POINTS, NOISE_TOP = 101, 0.99   # step-time ratio quantiles (step_noise)
# Slow stretches: an engine's decode steps over the model's, per window of this length (``slow``).
# On a quiet machine the steps' log ratio correlates over ~30 steps (0.25 at 1-3 steps, 0.1 at
# 30-100: ~0.1-0.3 s), and its mean over 0.1 s windows varies by 20% (sd), which a request of a
# few dozen tokens feels whole; with a busy loop beside the engines, by 15%. Windows with fewer
# decode steps than SLOW_MIN_STEPS are left out.
SLOW_WINDOW_S, SLOW_MIN_STEPS = 0.1, 3
# The decode steps after a step with prompt tokens priced apart (``post_prompt_factors``): on
# quiet runs the first ran 1.25-1.43x the model (median), the second 1.12-1.32x, the rest ~1 —
# of which the warm-up after idling (below) is part: with it priced apart, 1.22x and 1.10x.
POST_PROMPT_STEPS = 2
# A page set reaching a decode engine that is stepping is written into its cache under the
# engine's lock once the step in flight ends, and committed once the next step (which waits for
# the write: ``landing_hold``) ends; the request joins the step after. The steps it joins and
# the one after are priced apart (``post_landing_factors``). On quiet runs the step a write held
# up ran +0.8-1.2 ms over the model (+2.6-2.8 ms with 300-token prompts' 2.2 MB page sets), the
# one the request joined 1.11-1.22x, the next 1.00-1.07x.
POST_LANDING_STEPS = 2
# Warm-up after idling (``warmup_factors``): a step that starts WAKE_IDLE_S or more after its
# engine's previous step ended is the first after a wake; the steps since one, in buckets ending at
# WARMUP_EDGES, are priced apart (fewer than WARMUP_MIN_STEPS of a kind in a bucket: 1). On quiet
# runs the first prompt step after a wake ran 1.20x (mixed) and 1.28x (pd) the model, the decode
# steps 3-100 after it 1.06-1.36x, a pd decode engine's first three 1.83x, 1.66x and 1.36x: the
# cores' clocks and caches warm up over ~0.2 s of work.
WAKE_IDLE_S = 0.02
WARMUP_EDGES = (1, 2, 3, 5, 10, 20, 50, 100)
WARMUP_MIN_STEPS = 20
# The warm-up beside another engine's steps is priced apart (``decode_co``, ``decode_wake_co``): a
# decode step with the node's other engines stepping for CO_STEPPING (cost.py) of it or more. On quiet runs
# a mixed engine's first decode steps after a new request's prefill ran 1.1-1.3x the model alone
# and 1.3-1.5x beside the other engine's steps (on slower hours 1.2-1.3x and 1.6-1.9x), where one
# factor for both gave 1.40x: short requests alone ran faster and beside a busy engine slower
# than simulated.
# The calibration's warm-up factors from fewer steps than this take the coarser factor's (a pd
# calibration run had 10-14 decode steps woken beside the prefill engine's steps).
CALIBRATION_MIN_STEPS = 50
# The steps beside the node's other engines' steps are calibrated apart from those alone
# (``co_stepping``) where each side has this many (a one-minute run has 40-130 prompt steps each way).
CO_MIN_STEPS = 20
FACTOR_ROUNDS = 4   # post-prompt and warm-up factors, then the coefficients, this many times (fit_steps)
MIN_SPLIT = 20                          # samples each, to keep a latency's saturated / free split
# A calibration's level of a latency in one state (``latency_states``), measured on n samples,
# keeps n / (n + STATE_PRIOR_SAMPLES) of its distance from the latency's level in all: a state
# has ~50 samples in a one-minute run where the latency has ~170, and a level measured in full
# carried more of the calibration run's noise into another run's prediction (2026-12-04/05's
# sessions: 540.9 of 600 figures within 15% per draw in full, 544.6 shrunk by 50 or by 100, 544.5
# with one level per latency; docs/simulator.md "Each latency state at its own level").
STATE_PRIOR_SAMPLES = 50
GAPS = ("dispatch_s", "first_token_s", "finish_s")   # the frontend's latencies (FrontendLatency)
# A latency's states (``LatencyState``, the simulator's): a core free, the node's engines idle / every
# core taken / a core free, the engine it waits on stepping / a core free, that engine idle, another
# engine of the node stepping / (a first token only, whatever the cores) its step also decoded other
# requests' sequences.
FREE, TAKEN, BUSY, SHARED, CROWDED = STATES = tuple(LatencyState)
# The latencies' and slow stretches' distributions given the outside work (``conditional_quantiles``):
# only for a kind of work that varies by this much among the samples, and where there are this
# many. Niced jobs beside the cluster (other sessions' nice-10..19 work, 0.5-1.0 cores) left the
# latencies' medians where they were on a quiet machine and widened their tails; so did un-niced
# work, beyond what it moved the middle by (``load_scale``).
LOAD_MIN_SPREAD, LOAD_MIN_SAMPLES = 0.1, 50
# After a publishing step's end, when the node's engines that step next have started (an engine
# steps again after releasing its lock and yielding the GIL: well under a millisecond).
AFTER_STEP_S = 0.001
# The machine's own slowness (``machine_sd``) is measured on the windows with at least this many
# decode steps and frontend latencies.
MACHINE_MIN_STEPS, MACHINE_MIN_LATENCIES = 20, 6
# A probe window (``probe_windows``) with fewer samples than this takes the run's mean (the probe
# measures every 0.125 s: 16 a window).
PROBE_MIN_SAMPLES = 3
# The per-sequence terms of a decode step's price (``decode_per_seq``), the windows its steps are
# compared within and the steps a window needs.
PER_SEQ_TERMS = ("c_decode", "c_ctx")
PER_SEQ_WINDOW_S, PER_SEQ_MIN_STEPS = 1.0, 5
# The most (and 1 / the least) a factor measured against the fit's prices is taken as
# (``decode_per_seq``, ``co_stepping``).
FACTOR_MOST = 4.0
# How draws persist over time (``persistence``: the frontend's latencies and the prompt steps,
# ``latency_pairs``; an engine's slow stretches, ``slow_pairs``): latencies at least this far
# apart (closer ones are a step's tokens delivered together, a handful a run), pairs up to this
# far apart, groups of at least this many samples, the correlation times tried, the pairs needed
# and the largest shared share kept.
LATENT_MIN_GAP_S = 0.003
LATENT_MAX_GAP_S = 4.0
LATENT_MIN_GROUP = 10
LATENT_TAUS = tuple(float(v) for v in np.geomspace(0.01, 4.0, 53))
LATENT_MIN_PAIRS = 200
LATENT_MAX_RHO = 0.95
_NORMAL = NormalDist()
# Which of the run's measures of other processes' work (``sim_fidelity.CpuMonitor``) the
# contention's external term reads: ``external_load`` (their CPU time, in cores),
# ``external_load_unniced`` (that of the processes at nice 0 or below, the engines' priority) or
# ``external_load_weighted`` (each process's CPU time times its scheduler weight relative to nice 0).
# The fit records it (``contention.series``) and the simulation replays the same series. The
# un-niced work: the engines run at nice 0, and with the scheduler's autogroups off a niced job
# takes little from them (two busy loops at nice 10 beside the cluster left its step times
# as they were), while a nice-0 one time-shares a core with them (docs/simulator.md, "Fidelity").
EXTERNAL_SERIES = "external_load_unniced"


def external_series(trace: dict, series: str = EXTERNAL_SERIES) -> list:
    """The run's samples of ``series`` ((from time, load), ...); a run recorded before the
    series existed is refused rather than read as no load."""
    if series not in trace:
        raise ValueError(f"the trace ({trace.get('source', '?')}) has no {series!r}: record it again with "
                         "bench/sim_fidelity.py, or fit with another --external-series")
    return trace[series]


def external_at(trace: dict, t: np.ndarray, series: str = EXTERNAL_SERIES) -> np.ndarray:
    """Other processes' work (cores) at times ``t``, from the run's ``series`` samples
    ((from time, load), ...: piecewise constant); 0 before the first sample."""
    samples = np.asarray(external_series(trace, series) or [], dtype=float).reshape(-1, 2)
    if not len(samples):
        return np.zeros(len(t))
    i = np.searchsorted(samples[:, 0], t, side="right") - 1
    return np.where(i >= 0, samples[np.clip(i, 0, None), 1], 0.0)


def external_load_at(trace: dict, series: str = EXTERNAL_SERIES):
    """A function: the run's ``series`` (other processes' work, cores) at time ``t``."""
    return lambda t: float(external_at(trace, np.array([t]), series)[0])


def niced_load_at(trace: dict, series: str = EXTERNAL_SERIES):
    """A function: the run's niced outside work (``background_at``) at time ``t``."""
    return lambda t: float(background_at(trace, np.array([t]), series)[0])


def background_at(trace: dict, t: np.ndarray, series: str = EXTERNAL_SERIES) -> np.ndarray:
    """The niced outside work (cores) at times ``t``: the run's ``TOTAL_SERIES`` less its
    ``series`` (the un-niced; both sampled at the same times), at least 0."""
    return np.maximum(0.0, external_at(trace, t, TOTAL_SERIES) - external_at(trace, t, series))


def background_series(trace: dict, series: str = EXTERNAL_SERIES) -> list:
    """((from time, un-niced work, niced work), ...) of the run, what the simulation replays
    (``Simulator(external_load=...)``) for a fit with a background weight."""
    samples = np.asarray(external_series(trace, series) or [], dtype=float).reshape(-1, 2)
    niced = background_at(trace, samples[:, 0], series) if len(samples) else []
    return [(float(t), float(x), float(b)) for (t, x), b in zip(samples, niced)]


def step_rows(trace: dict, series: str = EXTERNAL_SERIES) -> tuple[np.ndarray, ...]:
    """(shape features [1, prompt tokens, decoding branches, attended positions, has prompt
    tokens], duration, others, external, background, start, engine) of every step of every
    instance: ``others`` the mean number of the node's other engines stepping during it,
    ``external`` other processes' work then (``external_at`` of ``series``), ``background`` the
    niced work then (``background_at``), ``engine`` its instance's number in the trace."""
    per = {iid: np.asarray(inst["steps"], dtype=float).reshape(-1, 6) for iid, inst in trace["instances"].items()}
    feats, dur, others, ext, bg, starts, engines = [], [], [], [], [], [], []
    for number, (iid, s) in enumerate(per.items()):
        if not len(s):
            continue
        a, d = s[:, 0], s[:, 1]
        o = np.zeros(len(s))
        for jid, other in per.items():
            if jid == iid or not len(other):
                continue
            o += _overlap(other[:, 0], other[:, 0] + other[:, 1], a, a + d) / np.maximum(d, 1e-9)
        feats.append(np.column_stack([np.ones(len(s)), s[:, 2], s[:, 4], s[:, 3] + s[:, 5], s[:, 2] > 0]))
        dur.append(d)
        others.append(o)
        ext.append(external_at(trace, a, series))
        bg.append(background_at(trace, a, series))
        starts.append(a)
        engines.append(np.full(len(s), number))
    return (np.vstack(feats), np.concatenate(dur), np.concatenate(others), np.concatenate(ext), np.concatenate(bg),
            np.concatenate(starts), np.concatenate(engines))


def _overlap(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Time inside [a_k, b_k] covered by the disjoint intervals [starts, ends) (sorted)."""
    order = np.argsort(starts)
    starts, ends = starts[order], ends[order]
    cum = np.concatenate([[0.0], np.cumsum(ends - starts)])

    def covered(t):  # busy time of the intervals before t
        i = np.searchsorted(starts, t, side="right")  # intervals started by t
        full = cum[i]
        last = np.clip(i - 1, 0, None)
        over = np.where(i > 0, np.clip(ends[last] - t, 0.0, None), 0.0)  # the part after t
        return full - over
    return covered(b) - covered(a)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares by elimination: a term fitted negative is dropped and the rest
    refitted (a step never gets faster with more work). Solved on the normal equations, their
    columns scaled to unit norm (the grid search solves it ~1,000 times on ~40,000 steps); a term
    no step has (all zero) stays 0."""
    gram, xty = x.T @ x, x.T @ y
    norm = np.sqrt(np.diag(gram))
    keep = [i for i in range(x.shape[1]) if norm[i] > 0]
    sol = np.zeros(0)
    while keep:
        k = np.asarray(keep)
        scaled = gram[np.ix_(k, k)] / np.outer(norm[k], norm[k])
        sol = np.linalg.lstsq(scaled, xty[k] / norm[k], rcond=None)[0] / norm[k]
        if (sol >= 0).all():
            break
        keep.pop(int(np.argmin(sol)))
    coef = np.zeros(x.shape[1])
    coef[keep] = sol
    return coef


def fit_steps(feats: np.ndarray, dur: np.ndarray, others: np.ndarray, external: np.ndarray,
              cores: int, starts: np.ndarray, engines: np.ndarray,
              background: np.ndarray | None = None, landed: np.ndarray | None = None,
              held: np.ndarray | None = None) -> tuple[dict, dict, dict, list, dict, list, list, dict, list, dict | None]:
    """Coefficients (``TERMS``), contention weights (``co_step``, ``external``, ``background``),
    the fit's quality on its steps, the steps' spread around it (``step_noise``; that of the
    steps with prompt tokens apart, ``prompt_noise``) and their slow
    stretches (``slow``: ``slow_windows`` of the steps' ``starts`` on their ``engines``) and the
    decode steps just after a prompt step (``post_prompt_factors``), and, with those priced in, the
    steps after a wake (``warmup_factors``), the steps after a landing (``post_landing_factors``
    of ``landed``) and the time a page set's write holds a step up (``landing_hold`` of ``held``;
    ``landed``, ``held``: ``landings`` of the steps; none without)."""
    if background is None:
        background = np.zeros(len(dur))
    if landed is None:
        landed = np.full(len(dur), 1 << 30)
    if held is None:
        held = np.zeros(len(dur))
    bg_w = 0.0

    def factor(co_step, ext_w, b_w):
        return contention(others, external, cores, co_step, ext_w, np.minimum, np.maximum, background, b_w)

    def solve(co_step, ext_w, b_w=None):
        f = factor(co_step, ext_w, bg_w if b_w is None else b_w)
        coef = _nnls(feats * f[:, None], dur)
        r = (feats @ coef) * f - dur
        return float(r @ r), coef

    def grid(lo, hi, step):
        return np.round(np.arange(max(0.0, lo), hi + step / 2, step), 4)

    def search(co_grid, ext_grid, best=None):
        for co_step in co_grid:
            for ext_w in ext_grid:
                sse, coef = solve(float(co_step), float(ext_w))
                if best is None or sse < best[0] - 1e-15:
                    best = (sse, float(co_step), float(ext_w), coef)
        return best
    best = search(grid(*CO_STEP_GRID), grid(*EXTERNAL_GRID))
    _, co, ex, _ = best
    dc, de = CO_STEP_GRID[2], EXTERNAL_GRID[2]
    if np.ptp(background) > 0:
        top = None
        for b_w in grid(*BACKGROUND_GRID):
            sse, _ = solve(co, ex, float(b_w))
            if top is None or sse < top[0] - 1e-15:
                top = (sse, float(b_w))
        bg_w = top[1]
        best = search([co], [ex])     # at the background weight found
    best = search(grid(co - dc, co + dc, FINE_STEP), grid(ex - de, ex + de, FINE_STEP), best)
    _, co, ex, coef = best
    # The steps just after a prompt step and after a wake, priced apart: each kind's factors with
    # the other's priced in, then the coefficients again with both, until they settle (the
    # coefficients first took the slower steps in with the rest).
    f = factor(co, ex, bg_w)
    since = since_prompt(feats, engines)
    bucket, kinds = warmup_kinds(feats, starts, dur, engines, others=others)
    post, warm_scale, scale = [1.0] * POST_PROMPT_STEPS, np.ones(len(dur)), np.ones(len(dur))
    land_scale, hold, holding = np.ones(len(dur)), None, np.zeros(len(dur))
    for _ in range(FACTOR_ROUNDS):
        base = (feats @ coef) * f
        # a write's hold: the steps it held up, over their price, on their bytes
        hold = landing_hold(dur - base * scale, held)
        holding = hold_time(hold, held)
        net = dur - holding
        post = post_prompt_factors(feats, net, base * warm_scale * land_scale, since)
        post_scale = post_prompt_scale(post, since)
        warm = warmup_factors(feats, net, base * post_scale * land_scale, bucket, kinds)
        warm_scale = warmup_scale(warm, bucket, kinds)
        land = post_landing_factors(feats, net, base * post_scale * warm_scale, landed)
        land_scale = post_prompt_scale(land, landed)
        scale = post_scale * warm_scale * land_scale
        coef = _nnls(feats * (f * scale)[:, None], net)
    pred = (feats @ coef) * f * scale + holding
    rel = np.abs(pred - dur) / dur
    noise = step_noise(dur / pred)
    prompt = feats[:, 4] > 0
    prompt_noise = step_noise(dur[prompt] / pred[prompt]) if prompt.any() else noise
    slow = slow_stretches(*slow_windows(feats, dur, pred, starts, engines, background))
    quality = {"samples": int(len(dur)), "median_rel_error": float(np.median(rel)),
               "p90_rel_error": float(np.percentile(rel, 90)),
               "total_time_error": float(abs(pred.sum() - dur.sum()) / dur.sum()),
               "mean_others": float(others.mean()), "mean_external": float(external.mean()),
               "mean_background": float(background.mean())}
    return (dict(zip(TERMS, map(float, coef))), {"co_step": co, "external": ex, "background": bg_w}, quality,
            noise, slow, post, prompt_noise, warm, land, hold)


def post_prompt_factors(feats: np.ndarray, dur: np.ndarray, pred: np.ndarray, since: np.ndarray) -> list[float]:
    """For the 1st .. ``POST_PROMPT_STEPS``-th decode-only step after a step with prompt tokens on
    the same engine (``since``: ``since_prompt`` of the steps): their measured over modelled time
    (sums) over that of the other decode-only steps (``LinearCost.post_prompt``)."""
    decode = feats[:, 4] == 0
    rest = decode & (since >= POST_PROMPT_STEPS)
    base = dur[rest].sum() / pred[rest].sum()
    out = []
    for j in range(POST_PROMPT_STEPS):
        m = decode & (since == j)
        out.append(float(dur[m].sum() / pred[m].sum() / base) if m.any() else 1.0)
    return out


def post_landing_factors(feats: np.ndarray, dur: np.ndarray, pred: np.ndarray, landed: np.ndarray) -> list[float]:
    """For the 1st .. ``POST_LANDING_STEPS``-th step a decode engine started after a page set
    landed on it mid-step (``landed``: ``landings`` of the steps): their measured over
    modelled time (sums) over that of the other decode-only steps (``LinearCost.post_landing``;
    1 where there were none)."""
    decode = feats[:, 4] == 0
    rest = decode & (landed >= POST_LANDING_STEPS)
    base = dur[rest].sum() / pred[rest].sum() if rest.any() else 1.0
    out = []
    for j in range(POST_LANDING_STEPS):
        m = decode & (landed == j)
        out.append(float(dur[m].sum() / pred[m].sum() / base) if m.any() else 1.0)
    return out


def landings(trace: dict, starts: np.ndarray, dur: np.ndarray, engines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step (``step_rows``' ``starts``, ``dur``, ``engines``): (``since``: how many steps its
    engine started since the step a page set's write held up — 0 for the one after it, which
    the request joined; huge for the others —, ``held``: the bytes of the page sets written at
    its start, 0 for the others). A page set landing (its request's ``added``: the write done)
    inside a step or between two steps run back to back was written at that step's start
    (``Simulator`` / ``SimInstance.submit_import``: a page set reaching a stepping engine waits
    for the step in flight). Landings are read only where the run has one decode instance (the
    trace does not say which decode instance a part went to)."""
    since, held = np.full(len(starts), 1 << 30), np.zeros(len(starts))
    rows, a, e = _decode_steps(trace, starts, dur, engines)
    if rows is None:
        return since, held
    for r in trace["requests"]:
        parts = r.get("parts") or []
        if len(parts) != 2:
            continue
        i = _landing_step(a, e, max(parts, key=lambda p: p["added"])["added"])
        if i is None:
            continue
        held[rows[i]] += page_set_bytes(r, trace["engine"]["block_size"])
        for k in range(POST_LANDING_STEPS):
            if i + 1 + k < len(rows):
                since[rows[i + 1 + k]] = min(since[rows[i + 1 + k]], k)
    return since, held


def _decode_instance(trace: dict) -> int | None:
    """The number (in the trace's order) of the run's one decode instance; None with none or
    several (the trace does not say which decode instance a part went to)."""
    decode = [i for i, name in enumerate(trace["instances"]) if name.rsplit("-", 1)[0].endswith("decode")]
    return decode[0] if len(decode) == 1 else None


def _decode_steps(trace: dict, starts: np.ndarray, dur: np.ndarray, engines: np.ndarray):
    """(rows, starts, ends) of the steps of the run's one decode instance (``_decode_instance``);
    (None, None, None) with none or several, or without steps."""
    number = _decode_instance(trace)
    rows = np.flatnonzero(engines == number) if number is not None else ()
    if not len(rows):
        return None, None, None
    return rows, starts[rows], starts[rows] + dur[rows]


def _landing_step(a: np.ndarray, e: np.ndarray, t: float) -> int | None:
    """Of an engine's steps (starts ``a``, ends ``e``), the one a page set landing at ``t`` was
    written at the start of: the step spanning ``t``, or the next when ``t`` falls between two
    steps run back to back; None when the engine was idle."""
    i = int(np.searchsorted(a, t, side="right")) - 1
    if i >= 0 and t < e[i]:
        return i
    if i >= 0 and i + 1 < len(a) and a[i + 1] - e[i] < AFTER_STEP_S:
        return i + 1
    return None


def decode_busy_at(trace: dict):
    """A function ``t -> bool``: whether the run's one decode engine (``_decode_instance``) was
    inside a step at ``t``, or between two steps run back to back (``_landing_step``); False
    without a single decode instance to read. A hand-off that leaves while its decode engine
    steps takes longer: on the 84 pd runs of 2026-12-04/05 on record such hand-offs took 1.9-3.7x
    as long on average (2.35x or more on 81; 5.8-11 ms, median) as those to an idle engine
    (1.7-4.5 ms); on the fit's runs of 2026-12-02/03 1.35-1.9x. The import call waits for the
    engine's step loop, as the frontend's calls do (``engine_busy``)."""
    number = _decode_instance(trace)
    steps = (np.asarray(list(trace["instances"].values())[number]["steps"], dtype=float).reshape(-1, 6)
             if number is not None else ())
    if not len(steps):
        return lambda t: False
    a, e = steps[:, 0], steps[:, 0] + steps[:, 1]
    return lambda t: _landing_step(a, e, t) is not None


def page_set_bytes(r: dict, block_size: int, kv_bytes_per_token: int = TINY_REASONER.kv_bytes_per_token) -> int:
    """The KV bytes of a request's prompt and first token, in whole blocks (a hand-off's page set)."""
    return -(-(r["prompt_len"] + 1) // block_size) * block_size * kv_bytes_per_token


def landing_hold(excess: np.ndarray, held: np.ndarray) -> dict | None:
    """A page set's write's hold on the step it delays, ``{"latency_s", "bw"}`` (``latency_s`` +
    bytes / ``bw``; ``LinearCost.landing_hold``): the line (``fit_handoff``) of the excess
    (measured less modelled time) of the steps writes held up on their bytes; None without any."""
    m = held > 0
    if not m.any():
        return None
    latency_s, bw = fit_handoff(list(zip(excess[m], held[m])))
    return {"latency_s": latency_s, "bw": bw}


def hold_time(hold: dict | None, held: np.ndarray) -> np.ndarray:
    """Per step, the time writes of ``held`` bytes held it up (0 where none were)."""
    if hold is None:
        return np.zeros(len(held))
    return np.where(held > 0, hold["latency_s"] + held / hold["bw"], 0.0)


def post_prompt_scale(post, since: np.ndarray) -> np.ndarray:
    """Per step (``since``: ``since_prompt`` of the steps), its ``post_prompt`` price factor (1
    for the others; the same for ``post_landing`` by ``landings``)."""
    post = np.asarray(post or [], dtype=float)
    out = np.ones(len(since))
    after = since < len(post)
    out[after] = post[since[after]]
    return out


def since_wake(starts: np.ndarray, dur: np.ndarray, engines: np.ndarray, idle_s: float,
               prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per step, how many steps its engine ran since it last woke — since a step that started
    ``idle_s`` or more after the engine's previous step ended (an engine's first step woke it)
    —, and whether that waking step had prompt tokens (``prompt``: per step)."""
    since = np.zeros(len(starts), dtype=np.int64)
    by_prompt = np.zeros(len(starts), dtype=bool)
    for e in np.unique(engines):
        idx = np.flatnonzero(engines == e)
        idx = idx[np.argsort(starts[idx], kind="stable")]
        gap = np.concatenate([[np.inf], starts[idx][1:] - (starts[idx][:-1] + dur[idx][:-1])])
        woke = np.flatnonzero(gap >= idle_s)
        last = woke[np.searchsorted(woke, np.arange(len(idx)), side="right") - 1]
        since[idx] = np.arange(len(idx)) - last
        by_prompt[idx] = prompt[idx[last]]
    return since, by_prompt


def warmup_buckets(since: np.ndarray, edges=WARMUP_EDGES) -> np.ndarray:
    """Per step, its warm-up bucket (``WARMUP_EDGES``: 0 for the first step after a wake, ...;
    ``len(edges)`` past the last edge, warm)."""
    return np.searchsorted(np.asarray(edges), since, side="right")


def warmup_kinds(feats: np.ndarray, starts: np.ndarray, dur: np.ndarray, engines: np.ndarray,
                 idle_s: float = WAKE_IDLE_S, edges=WARMUP_EDGES, others: np.ndarray | None = None
                 ) -> tuple[np.ndarray, tuple]:
    """(per step its warm-up bucket, ((kind, its steps), ...)): ``decode``: decode-only steps
    after a wake by a step with prompt tokens (a mixed engine's, woken by a new request's
    prefill); ``decode_wake``: decode-only steps after a wake by a decode step (a pd decode
    engine's, woken by a hand-off); ``prompt``: steps with prompt tokens. With ``others`` (per
    step, the node's other engines stepping during it: ``step_rows``), the decode steps beside
    them (``CO_STEPPING`` or more) are ``decode_co`` and ``decode_wake_co`` instead."""
    has_prompt = feats[:, 4] > 0
    since, by_prompt = since_wake(starts, dur, engines, idle_s, has_prompt)
    decode, wake = ~has_prompt & by_prompt, ~has_prompt & ~by_prompt
    if others is None:
        kinds = (("decode", decode), ("decode_wake", wake))
    else:
        co = others >= CO_STEPPING
        kinds = (("decode", decode & ~co), ("decode_co", decode & co), ("decode_wake", wake & ~co),
                 ("decode_wake_co", wake & co))
    return warmup_buckets(since, edges), (*kinds, ("prompt", has_prompt))


def warmup_factors(feats: np.ndarray, dur: np.ndarray, pred: np.ndarray, bucket: np.ndarray, kinds) -> dict:
    """``LinearCost.warmup``: per bucket of steps since a wake and kind of step (``warmup_kinds``
    with ``WAKE_IDLE_S`` and ``WARMUP_EDGES``), its measured over modelled time (sums) over that
    of the warm steps (past the last edge) of its kind (both decode kinds: the warm decode steps)."""
    out = {"idle_s": WAKE_IDLE_S, "edges": list(WARMUP_EDGES)}
    for kind, m in kinds:
        ref = (feats[:, 4] == 0) if kind.startswith("decode") else m
        warm = ref & (bucket == len(WARMUP_EDGES))
        base = dur[warm].sum() / pred[warm].sum() if warm.sum() >= WARMUP_MIN_STEPS else None
        # too few steps in a bucket: 1, or a split kind's (``_co``) the factor of the kind split
        fallback = warmup_table(out, kind[:-3]) if kind.endswith("_co") else [1.0] * len(WARMUP_EDGES)
        factors = []
        for b in range(len(WARMUP_EDGES)):
            sel = m & (bucket == b)
            factors.append(float(dur[sel].sum() / pred[sel].sum() / base)
                           if base is not None and sel.sum() >= WARMUP_MIN_STEPS else fallback[b])
        out[kind] = factors
    return out


def warmup_scale(warm: dict | None, bucket: np.ndarray, kinds) -> np.ndarray:
    """Per step (``warmup_kinds`` of the steps, with ``warm``'s ``idle_s`` and ``edges``), its
    ``warmup`` price factor (1 without)."""
    out = np.ones(len(bucket))
    if not warm:
        return out
    for kind, m in kinds:
        f = np.concatenate([np.asarray(warmup_table(warm, kind), dtype=float), [1.0]])
        out[m] = f[bucket[m]]
    return out


def since_prompt(feats: np.ndarray, engines: np.ndarray) -> np.ndarray:
    """Per step: how many decode-only steps its engine ran between the last step with prompt
    tokens and it (0: the first after one; huge before any, and for the prompt steps)."""
    since = np.full(len(feats), 1 << 30)
    for e in np.unique(engines):
        k = 1 << 30
        for i in np.flatnonzero(engines == e):
            if feats[i, 4] > 0:
                k = 0
            else:
                since[i], k = k, k + 1
    return since


def slow_windows(feats: np.ndarray, dur: np.ndarray, pred: np.ndarray, starts: np.ndarray,
                 engines: np.ndarray, background: np.ndarray | None = None, with_keys: bool = False) -> tuple:
    """Per engine and window of ``SLOW_WINDOW_S`` (by the steps' ``starts``), its decode-only
    steps' measured time over their modelled time (windows with ``SLOW_MIN_STEPS`` or more such
    steps), and the niced outside work then (the mean of its steps' ``background``; zeros
    without); ``engines``: each step's engine, a number unique over the runs. ``with_keys``: also
    each window's key, its engine times 2**32 plus its number (``slow_pairs``)."""
    decode = feats[:, 4] == 0
    key = engines[decode].astype(np.int64) * (1 << 32) + np.floor(starts[decode] / SLOW_WINDOW_S).astype(np.int64)
    _, inv = np.unique(key, return_inverse=True)
    measured, modelled = np.bincount(inv, weights=dur[decode]), np.bincount(inv, weights=pred[decode])
    count = np.bincount(inv)
    niced = (np.bincount(inv, weights=background[decode]) / count if background is not None
             else np.zeros(len(count)))
    keep = count >= SLOW_MIN_STEPS
    if with_keys:
        return measured[keep] / modelled[keep], niced[keep], np.unique(key)[keep]
    return measured[keep] / modelled[keep], niced[keep]


def slow_stretches(ratio: np.ndarray, niced: np.ndarray) -> dict:
    """The ``slow`` part of the fit: the windows' ``ratio`` (``slow_windows``) as ``step_noise``
    quantiles (mean 1), given the niced work (``conditional_quantiles``): ``niced`` the slopes per
    core, shifted to mean 0 so that the niced work's mean effect stays the contention's
    ``background`` weight and it only widens (or narrows) the spread, up to ``niced_max`` cores."""
    levels = np.linspace(0.0, NOISE_TOP, NOISE_POINTS)
    q, (slope,), (most,) = conditional_quantiles(ratio, [niced], levels)
    scale = _draw_mean(np.asarray(q))
    out = {"window_s": SLOW_WINDOW_S, "quantiles": [v / scale for v in q]}
    if slope is not None:
        s = np.asarray(slope) / scale
        s -= _draw_mean(s)
        out.update(niced=[float(v) for v in s], niced_max=most)
    return out


def step_noise(ratio: np.ndarray) -> list[float]:
    """Measured / modelled step duration as ``NOISE_POINTS`` quantiles from 0 to ``NOISE_TOP``,
    scaled so that a draw (linear between quantiles) has mean 1: the model gives a step's mean,
    this its spread (steps on a shared 2-core machine vary by 40% around it). The top
    ``1 - NOISE_TOP`` (steps descheduled for tens of milliseconds, up to 50x) is left out."""
    q = np.quantile(ratio, np.linspace(0.0, NOISE_TOP, NOISE_POINTS))
    return [float(v) for v in q / _draw_mean(q)]


def _draw_mean(q) -> float:
    """``draw_mean`` of quantiles held in an array."""
    return draw_mean(tuple(float(v) for v in q))


def stepping_at(trace: dict):
    """A function: how many of the trace's engines were inside a step at time ``t``."""
    per = _steps(trace)

    def count(t: float) -> int:
        n = 0
        for s in per:
            i = np.searchsorted(s[:, 0], t, side="right") - 1
            n += bool(i >= 0 and s[i, 0] + s[i, 1] > t)
        return n
    return count


def _steps(trace: dict) -> list[np.ndarray]:
    """Each engine's steps (rows of start, duration, prompt tokens, ...), engines without any left out."""
    per = [np.asarray(inst["steps"], dtype=float).reshape(-1, 6) for inst in trace["instances"].values()]
    return [s for s in per if len(s)]


class PublishingSteps:
    """A run's engines' steps (``_steps``) and, for a token published at ``t``, the step that
    published it (``find``): the step of any engine spanning ``t`` (with prompt tokens for a first
    token, ``prompt``) that ends first; None if none does (the trace does not say which engine a
    part ran on). Each (``t``, ``prompt``) is looked up once: the latency fit asks for a request's
    publishing step for its end, its engine's state and its batch (``latency_inputs``)."""

    def __init__(self, trace: dict):
        self.per = _steps(trace)
        self._found: dict[tuple[float, bool], tuple[np.ndarray, int] | None] = {}

    def find(self, t: float, prompt: bool) -> tuple[np.ndarray, int] | None:
        """(the engine's steps, the step's row) of the step that published a token at ``t``."""
        key = (t, prompt)
        if key not in self._found:
            best = None
            for s in self.per:
                i = int(np.searchsorted(s[:, 0], t, side="right")) - 1
                if i >= 0 and s[i, 0] + s[i, 1] >= t and (not prompt or s[i, 2] > 0):
                    if best is None or s[i, 0] + s[i, 1] < best[0][best[1], 0] + best[0][best[1], 1]:
                        best = (s, i)
            self._found[key] = best
        return self._found[key]


def publishing_step_end(trace: dict, published: PublishingSteps | None = None):
    """A function ``(t, prompt)``: the end of the engine step that published a token at ``t``
    (its first token: ``prompt``, a step that computed prompt tokens; ``PublishingSteps``), the
    time the simulator has for it; ``t`` itself if no step spans it. A step's telemetry goes on
    after its tokens are published (the frontend's poll and export calls take the GIL and the
    engine lock: ~1.8 ms on average after a prefill, of a 6 ms step), so the frontend's latencies
    are measured from there, not from the publish. ``published``: the run's lookup, if shared."""
    published = published or PublishingSteps(trace)

    def end(t: float, prompt: bool) -> float:
        found = published.find(t, prompt)
        return t if found is None else float(found[0][found[1], 0] + found[0][found[1], 1])
    return end


def export_start(trace: dict, published: PublishingSteps | None = None):
    """A function ``(t, landed)``: when the page set of a first token published at ``t`` could
    leave its engine (the simulator's ``Simulator._send``): the end of the step that published
    it, or, if that engine began its next step within ``AFTER_STEP_S`` of it, that step's end —
    unless the page set landed (``landed``) before that. The frontend's export call waits for
    the engine's step loop: on this machine a hand-off whose prefill engine went on to a
    300-token prompt step landed ~5 ms after that ~54 ms step ended; 32 of 224 hand-offs whose
    engine stepped on at once got in before the step (the simulator has them wait).
    ``published``: the run's lookup, if shared."""
    published = published or PublishingSteps(trace)

    def start(t: float, landed: float = math.inf) -> float:
        found = published.find(t, True)
        if found is None:
            return t
        s, i = found
        end = float(s[i, 0] + s[i, 1])
        if i + 1 < len(s) and s[i + 1, 0] - end < AFTER_STEP_S and landed >= s[i + 1, 0] + s[i + 1, 1]:
            return float(s[i + 1, 0] + s[i + 1, 1])
        return end
    return start


def page_set_arrival(trace: dict, hold: dict | None):
    """A function ``(request, t, left)``: when the page set that left its prefill engine at
    ``left`` and landed (was written) at ``t`` reached its decode engine, as the simulator has
    it: written at the start of the step it landed in (``landings``), it had waited for the step
    before, inside which (and after ``left``) it arrived at a uniform time: the middle of that
    stretch; landing on an idle engine, it arrived before its write (``hold``'s time for its
    bytes). Without a single decode instance to read: ``t``."""
    number = _decode_instance(trace)
    steps = (np.asarray(list(trace["instances"].values())[number]["steps"], dtype=float).reshape(-1, 6)
             if number is not None else ())
    if not len(steps):
        return lambda r, t, left: t
    a, d = steps[:, 0], steps[:, 1]
    e = a + d

    def arrival(r: dict, t: float, left: float) -> float:
        i = _landing_step(a, e, t)
        if i is None:
            return max(left, t - float(hold_time(hold, np.array([page_set_bytes(r, trace["engine"]["block_size"])]))[0]))
        if i > 0 and a[i] - e[i - 1] < AFTER_STEP_S and left < a[i]:
            return float((max(left, a[i - 1]) + a[i]) / 2)
        return float(max(a[i], left))     # (not before it left: a step that began earlier took it in)
    return arrival


def engine_busy(trace: dict, published: PublishingSteps | None = None):
    """A function ``(request, gap)``: whether the engine a frontend latency waits on was busy with
    a step of its own. ``first_token_s`` / ``finish_s``: the publishing engine (``PublishingSteps``)
    started its next step within ``AFTER_STEP_S`` of the publishing step's end; ``dispatch_s``: the
    engine that computed the request's prompt (whose step published its first token) was inside
    a step at the send. The frontend's calls into an engine's process wait for its step loop
    (the GIL, the engine lock): on quiet runs a first token reached the client 3.0-3.9 ms
    (median) after its step when the engine went on decoding, 1.6-2.3 ms when it went idle, the
    last token 3.1-3.6 against 2.1-2.9 ms, whether or not the node's cores were all taken.
    ``published``: the run's lookup, if shared."""
    published = published or PublishingSteps(trace)

    def busy(r: dict, gap: str) -> bool:
        parts = r.get("parts") or []
        if gap == "finish_s":
            times, prompt = [p["finished"] for p in parts if p["finished"] is not None], False
        else:
            times, prompt = [p["first_token"] for p in parts if p["first_token"] is not None], True
        found = published.find(max(times) if gap == "finish_s" else min(times), prompt) if times else None
        if found is None:
            return False
        s, i = found
        if gap == "dispatch_s":
            j = int(np.searchsorted(s[:, 0], r["sent"], side="right")) - 1
            return bool(j >= 0 and s[j, 0] + s[j, 1] > r["sent"])
        return bool(i + 1 < len(s) and s[i + 1, 0] <= s[i, 0] + s[i, 1] + AFTER_STEP_S)
    return busy


def crowded_first_token(trace: dict, published: PublishingSteps | None = None):
    """A function ``(request)``: whether the step that published the request's first token
    (``PublishingSteps``) also decoded other sequences (its ``num_decode``): the prompt joined a
    running batch, and the step published other requests' tokens with it. With both engines of a
    mixed node stepping on, such a first token reached the client 3.7-5.9 ms (median) after its
    step, one from a step of prompts only 2.4-3.8 ms, on every run of 2026-12-02 to 12-05
    (``FrontendLatency.crowded``). ``published``: the run's lookup, if shared."""
    published = published or PublishingSteps(trace)

    def crowded(r: dict) -> bool:
        firsts = [p["first_token"] for p in (r.get("parts") or ()) if p["first_token"] is not None]
        found = published.find(min(firsts), True) if firsts else None
        return found is not None and bool(found[0][found[1], 4] > 0)
    return crowded


def waited_for_prefill(trace: dict):
    """A function ``(sent, added)``: whether a step with prompt tokens of one of the trace's
    engines was in flight at ``sent`` and had ended by ``added``. Such a step runs the model layer
    by layer in Python, holding the GIL that the engine's ``add`` thread needs, so a part sent to
    that engine during it reaches it only after the step (42-45 ms with 300-token prompts): its
    measured dispatch latency contains the wait for the step in flight, which the simulator
    charges itself. The trace does not say which engine a part went to: any engine's step counts."""
    per = _steps(trace)

    def waited(sent: float, added: float) -> bool:
        for s in per:
            i = int(np.searchsorted(s[:, 0], sent, side="right")) - 1
            if i >= 0 and s[i, 2] > 0 and sent < s[i, 0] + s[i, 1] <= added:
                return True
        return False
    return waited


def engine_wake(trace: dict) -> list[float]:
    """How long each of the run's requests that reached an idle engine waited there before that
    engine's step with its prompt began (the part's ``added`` to the start of the step that
    published its first token, where the engine's step before ended before ``added``): the
    engine's loop waking up to the new work. The dispatch latency ends at ``added``, so the
    simulator draws this apart (``LinearCost.engine_wake``). On every run from 2026-12-02 to
    2026-12-05, both layouts: 0.30-0.37 ms on average, q10 0.08-0.10, median 0.11-0.27, q90
    0.54-0.76."""
    published = PublishingSteps(trace)
    waits = []
    for r in trace["requests"]:
        parts = [p for p in (r.get("parts") or ()) if p["first_token"] is not None]
        if r.get("error") or not parts:
            continue
        head = min(parts, key=lambda p: p["added"])
        found = published.find(head["first_token"], True)
        if found is None:
            continue
        s, i = found
        if s[i, 0] >= head["added"] and (i == 0 or s[i - 1, 0] + s[i - 1, 1] < head["added"]):
            waits.append(float(s[i, 0] - head["added"]))
    return waits


def fit_latencies(requests: list[dict], kv_bytes_per_token: int, block_size: int, stepping=None,
                  cores: int | None = None, step_end=None, waited=None, external=None, niced=None,
                  busy=None, export_start=None, arrival=None, crowded=None, target_busy=None) -> dict:
    """Client-vs-engine gaps (quantiles) over the requests whose parts all reported; the hand-off's
    cost (the page set could leave the prefill engine -> committed on the decode instance: a
    fixed part and a bandwidth, ``fit_handoff``) where there were hand-offs. With
    ``step_end(request, t, prompt)`` (``publishing_step_end`` of the request's run), the first-
    and last-token gaps and the hand-off start at the end of the step that published (the
    simulator's event), not at the publish; with ``export_start(request, t, landed)`` (``export_start``
    of the request's run) the hand-off starts once the prefill engine is between steps, and
    with ``arrival(request, t, left)`` (``page_set_arrival``) it ends when the page set reached
    the decode engine, not at its landing. With ``target_busy(request, t)`` (``decode_busy_at``
    of the request's run) each hand-off is also filed by whether its decode engine was stepping
    at the end of the step that published the first token (when the simulator draws it): with
    ``MIN_SPLIT`` or more each way, ``handoff_noise`` holds those to an idle engine and
    ``handoff_busy_noise`` the others (``handoff_noise``).

    With ``stepping(request, t)`` (``stepping_at`` of the request's run) and ``cores``, each gap
    is also filed by whether the node's engines were stepping on all its cores when it began: at
    the client's send; ``AFTER_STEP_S`` after the publishing step's end, so that the publishing
    engine counts if it stepped again at once (the simulator's ``_deliver``). When both sets
    have ``MIN_SPLIT`` samples or more, the top-level quantiles are those with a core free and
    ``saturated`` holds the others (``FrontendLatency``); the frontend, Ray and the client then
    wait for a core.

    With ``waited(request, added)`` (``waited_for_prefill`` of the request's run), a dispatch
    that waited for a prefill step in flight is left out of the dispatch distribution (counted
    in ``dispatch_waited``): the simulator makes a part wait for the step in flight itself.

    With ``external(request, t)`` (the other processes' work at ``t`` in the request's run, the
    series the contention reads), each gap is also scaled by that work: per gap and cores' state,
    ``k`` of ``gap = a * (1 + k * external)`` (``load_scale``), the quantiles are of ``gap / (1 +
    k * external)`` and ``external_scale`` holds the ``k``s (``FrontendLatency``: the simulator
    scales its draws back by the load it replays).

    With ``niced(request, t)`` (the niced outside work at ``t``), those quantiles are the ones
    given the niced and the un-niced work (``conditional_quantiles``; without it, plain quantiles),
    and ``niced`` / ``unniced`` hold each gap's slopes per quantile and the most of that work seen
    (``FrontendLatency.niced``, ``unniced``).

    With ``crowded(request)`` (``crowded_first_token`` of the request's run), a first token whose
    step also decoded other sequences is filed apart, whatever the cores' state, and gets its own
    ``crowded`` quantiles when there are ``MIN_SPLIT`` of them (else each is filed by its state).

    With ``busy(request, gap)`` (``engine_busy`` of the request's run), a gap that began with a
    core free is filed as ``busy`` when the engine it waited on was stepping; a gap with
    ``MIN_SPLIT`` samples or more both ways gets its own ``busy`` quantiles, the others draw the
    free ones there (``FrontendLatency.busy``). Likewise ``shared``: a gap that began with a core
    free and its engine idle while another engine of the node was stepping (``stepping``; the
    frontend and the engine share the cores left: on 2026-12-05 a dispatch to an idle engine
    took 4.4-4.5 ms, median, beside the other engine's steps, 3.0 ms with both idle; on the fit's
    runs 3.5-7.3 against 3.3-6.3 ms), against the engines all idle (the top-level quantiles then
    hold those)."""
    inputs = dict(stepping=stepping, cores=cores, step_end=step_end, waited=waited, external=external, niced=niced,
                  busy=busy, export_start=export_start, arrival=arrival, target_busy=target_busy)
    sample, loads, niced_at, lengths, handoff, dropped = gap_samples(requests, kv_bytes_per_token, block_size,
                                                                     crowded=crowded, **inputs)
    if 0 < len(sample["first_token_s"][CROWDED]) < MIN_SPLIT:     # too few to tell: each filed by its state
        sample, loads, niced_at, lengths, handoff, dropped = gap_samples(requests, kv_bytes_per_token, block_size,
                                                                         **inputs)
    n = sum(len(v) for v in sample["dispatch_s"])
    if not n:
        raise ValueError("the trace has no request with engine-side part timings")
    # The dispatch's growth with the prompt, taken off each sample (the simulator adds it back).
    per_token = _per_token(sample["dispatch_s"], lengths, loads["dispatch_s"])
    for values, lens in zip(sample["dispatch_s"], lengths):
        values[:] = [v - per_token * k for v, k in zip(values, lens)]

    def quantiles(x):
        return [float(v) for v in np.quantile(x, QUANTILES)] if x else [0.0]

    def distributions(states: dict) -> dict:
        """Each gap's quantiles (given the niced work), load scale and niced slopes over its
        samples of the states ``states[gap]`` names."""
        def pick(key, by):
            return [v for i in states[key] for v in by[key][i]]
        out, scale, slopes = {}, [], ({}, {})
        most = [max((max(pick(key, by), default=0.0) for key in GAPS), default=0.0) for by in (niced_at, loads)]
        for key in GAPS:
            values, x = pick(key, sample), pick(key, loads)
            k = load_scale(values, x)
            scaled = [v / (1.0 + k * e) for v, e in zip(values, x)]
            q, by_kind, _ = (conditional_quantiles(scaled, [pick(key, niced_at), x], most=most)
                             if scaled and niced is not None else (quantiles(scaled), [None, None], most))
            out[key] = q
            scale.append(k)
            for kind, slope in zip(slopes, by_kind):
                if slope is not None:
                    kind[key] = slope
        # each kind of work with a slope somewhere: every gap gets slopes (zeros where it did not
        # vary), one ``max``
        for name, kind, m in zip(("niced", "unniced"), slopes, most):
            if kind:
                out[name] = {"max": m, **{key: kind.get(key, [0.0] * len(out[key])) for key in GAPS}}
        return {**out, "external_scale": scale}
    # The cores taken: their own distributions when every gap has enough samples each way.
    split = all(len(v[FREE]) + len(v[BUSY]) + len(v[SHARED]) >= MIN_SPLIT and len(v[TAKEN]) >= MIN_SPLIT
                for v in sample.values())
    # A core free, the engine busy / idle beside another engine's step: per gap, where it has
    # enough samples both ways (against the engines all idle).
    busy_split = {k: len(v[FREE]) >= MIN_SPLIT and len(v[BUSY]) >= MIN_SPLIT for k, v in sample.items()}
    shared_split = {k: len(v[FREE]) >= MIN_SPLIT and len(v[SHARED]) >= MIN_SPLIT for k, v in sample.items()}
    free = {k: (FREE,) + (() if busy_split[k] else (BUSY,)) + (() if shared_split[k] else (SHARED,)) for k in GAPS}
    out = distributions(free if split else {k: free[k] + (TAKEN,) for k in GAPS})
    if split:
        out["saturated"] = distributions({k: (TAKEN,) for k in GAPS})
        out["saturated_samples"] = {k: len(v[TAKEN]) for k, v in sample.items()}
    if any(busy_split.values()):
        out["busy"] = distributions({k: (BUSY,) if busy_split[k] else free[k] for k in GAPS})
        out["busy_samples"] = {k: len(v[BUSY]) if busy_split[k] else 0 for k, v in sample.items()}
    if any(shared_split.values()):
        out["shared"] = distributions({k: (SHARED,) if shared_split[k] else free[k] for k in GAPS})
        out["shared_samples"] = {k: len(v[SHARED]) if shared_split[k] else 0 for k, v in sample.items()}
    if sample["first_token_s"][CROWDED]:      # (only first tokens are crowded: the others draw the free ones)
        out["crowded"] = distributions({k: (CROWDED,) if k == "first_token_s" else free[k] for k in GAPS})
        out["crowded_samples"] = {k: len(v[CROWDED]) for k, v in sample.items()}
    latency_s, bw = fit_handoff(handoff) if handoff else (None, None)
    noise, busy_noise = handoff_noise(handoff, latency_s, bw) if handoff else (None, None)
    return {**out, "dispatch_per_token_s": per_token, "latency_samples": n, "dispatch_waited": dropped,
            "transfer_latency_s": latency_s, "transfer_bw": bw, "handoffs": len(handoff),
            "handoff_noise": noise, "handoff_busy_noise": busy_noise,
            "handoffs_busy": sum(b for *_, b in handoff) if busy_noise is not None else 0}


def handoff_noise(samples: list[tuple[float, int, bool]], latency_s: float,
                  bw: float) -> tuple[list[float], list[float] | None]:
    """A hand-off's measured / modelled time (``latency_s`` + bytes / ``bw``) as ``NOISE_POINTS``
    quantiles from 0 to 1 (none below 0), scaled so that a draw has mean 1: the model gives a
    hand-off's mean, this its spread (on quiet runs 0.6-1.6x, q10-q90; beside 300-token
    prefills 0.1-2.4x). With ``MIN_SPLIT`` samples or more each way of those that left while
    their decode engine stepped (each sample's third item) and the others: (the others', theirs),
    each scaled so that its draws' mean is its samples' mean over all the samples' (its level
    against the line); else (all of them, None)."""
    ratio = np.maximum(0.0, np.array([t / (latency_s + b / bw) for t, b, _ in samples]))
    busy = np.array([bool(x) for *_, x in samples])
    points = np.linspace(0.0, 1.0, NOISE_POINTS)
    if min(busy.sum(), (~busy).sum()) < MIN_SPLIT:
        q = np.quantile(ratio, points)
        return [float(v) for v in q / _draw_mean(q)], None
    out = []
    for m in (~busy, busy):
        q = np.quantile(ratio[m], points)
        out.append([float(v) for v in q * (ratio[m].mean() / ratio.mean() / _draw_mean(q))])
    return out[0], out[1]


def fit_handoff(samples: list[tuple[float, int]]) -> tuple[float, float]:
    """(fixed seconds, bytes per second) of a hand-off (``LinearCost.transfer_time``) from
    ``(seconds, bytes)`` samples: the least-squares line of the seconds on the bytes. With too
    little spread in the bytes to tell a bandwidth (the largest under twice the smallest) or a
    line that does not rise from >= 0, the bandwidth is ``LOOPBACK_BW`` and the fixed part the
    mean of the rest. On this machine a 0.1 MB page set took 7-10 ms from one session to the
    next, a 2.2 MB one (300-token prompts) 15-19 ms."""
    t = np.array([x[0] for x in samples], dtype=float)
    b = np.array([x[1] for x in samples], dtype=float)
    if b.min() > 0 and b.max() >= 2 * b.min():
        slope, intercept = np.polyfit(b, t, 1)
        if slope > 0 and intercept >= 0:
            return float(intercept), float(1.0 / slope)
    return float(max(0.0, np.mean(t - b / LOOPBACK_BW))), LOOPBACK_BW


def gap_samples(requests: list[dict], kv_bytes_per_token: int, block_size: int, stepping=None,
                cores: int | None = None, step_end=None, waited=None, external=None, niced=None, busy=None,
                export_start=None, arrival=None, times=None, crowded=None, target_busy=None):
    """``fit_latencies``' samples (its arguments): per gap (``GAPS``) and state (``STATES``) the
    measured gaps, the un-niced and the niced outside work at each; per state the dispatch
    samples' prompt tokens; the hand-offs, each (seconds from when its
    page set could leave — ``export_start(request, t, landed)`` of its first token's publish, else the
    step's end — to when it reached the decode engine — ``arrival(request, t, left)`` of its
    landing, else the landing —, its bytes, whether its decode engine was stepping at the end of
    the step that published its first token — ``target_busy(request, t)``, else False); how many
    dispatches waited for a prefill step (left out). ``times``: a dict to fill like the samples with each sample's time (the client's send for a
    dispatch, the step's end for a first or last token)."""
    # per gap, by state (STATES): the samples, the other processes' work at each, of it the niced
    sample, loads, niced_at = ({k: tuple([] for _ in STATES) for k in GAPS} for _ in range(3))
    handoff, dropped, lengths = [], 0, tuple([] for _ in STATES)   # lengths: each dispatch sample's prompt tokens
    for r in requests:
        def state_of(key, t) -> int:
            n = stepping(r, t) if stepping is not None else 0
            if cores and n >= cores:
                return TAKEN
            if busy is not None and busy(r, key):
                return BUSY
            return SHARED if n else FREE

        def put(key, value, t):
            state = CROWDED if key == "first_token_s" and crowded is not None and crowded(r) else state_of(key, t)
            sample[key][state].append(value)
            loads[key][state].append(external(r, t) if external is not None else 0.0)
            niced_at[key][state].append(niced(r, t) if niced is not None else 0.0)
            if times is not None:
                times.setdefault(key, tuple([] for _ in STATES))[state].append(t)
            return state

        def ended(t, prompt):
            return step_end(r, t, prompt) if step_end is not None else t
        parts = r.get("parts") or []
        if r.get("first") is None or r.get("end") is None or not parts:
            continue
        head = min(parts, key=lambda p: p["added"])
        if waited is not None and waited(r, head["added"]):
            dropped += 1
        else:
            lengths[put("dispatch_s", head["added"] - r["sent"], r["sent"])].append(r["prompt_len"])
        if len(parts) == 2 and head["first_token"] is not None:
            landed = max(parts, key=lambda p: p["added"])["added"]
            nbytes = page_set_bytes(r, block_size, kv_bytes_per_token)
            published = ended(head["first_token"], True)
            left = export_start(r, head["first_token"], landed) if export_start is not None else published
            handoff.append(((arrival(r, landed, left) if arrival is not None else landed) - left, nbytes,
                            target_busy is not None and bool(target_busy(r, published))))
        firsts = [p["first_token"] for p in parts if p["first_token"] is not None]
        ends = [p["finished"] for p in parts if p["finished"] is not None]
        if firsts:
            end = ended(min(firsts), True)
            put("first_token_s", r["first"] - end, end + AFTER_STEP_S)
        if ends:
            end = ended(max(ends), False)
            put("finish_s", r["end"] - end, end + AFTER_STEP_S)
    return sample, loads, niced_at, lengths, handoff, dropped


def _quantile_fit(x: np.ndarray, y: np.ndarray, tau: float = 0.5, iterations: int = 100) -> np.ndarray:
    """The ``tau`` quantile's linear regression of ``y`` on the columns of ``x`` (least asymmetric
    absolute deviations, by iteratively reweighted least squares; ``tau`` 0.5: the median's): the
    latencies' tails (a dispatch of 84 ms among ones of 3-10) do not pull the median's line, and
    the line is the distribution's middle, which the quantiles then keep."""
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    for _ in range(iterations):
        r = y - x @ coef
        w = np.sqrt(np.where(r >= 0, tau, 1.0 - tau) / np.maximum(np.abs(r), 1e-6))
        new = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
        if np.allclose(new, coef, rtol=1e-9, atol=1e-12):
            return new
        coef = new
    return coef


def conditional_quantiles(values, loads, levels=QUANTILES, most=None
                          ) -> tuple[list[float], list[list[float] | None], list[float]]:
    """(``q``, ``slopes``, ``most``): the distribution of ``values`` given outside work, ``loads``
    (one sequence per kind of work, cores, one per value) at ``levels``: ``q + sum(n_j *
    slopes[j])`` at ``n_j`` cores of each kind, for ``n_j`` up to ``most[j]`` (by default the most
    of it among the samples; ``cost.quantile_at``). Each level's quantile regression on [1,
    loads...] (``_quantile_fit``; the outermost levels kept half a sample inside the data), then
    rearranged (sorted) at no outside work and at each kind's ``most`` alone, so that the
    quantiles increase along each kind's range. A kind whose work does not vary by
    ``LOAD_MIN_SPREAD`` cores gets no slope (None), as do all with under ``LOAD_MIN_SAMPLES``."""
    y = np.asarray(values, dtype=float)
    z = [np.asarray(b, dtype=float) for b in loads]
    most = [float(b.max()) if len(b) else 0.0 for b in z] if most is None else [float(m) for m in most]
    used = [j for j, b in enumerate(z) if len(y) >= LOAD_MIN_SAMPLES and np.ptp(b) >= LOAD_MIN_SPREAD
            and most[j] > 0]
    if not used:
        return [float(v) for v in np.quantile(y, levels)], [None] * len(z), most
    x = np.column_stack([np.ones(len(y))] + [z[j] for j in used])
    taus = np.clip(levels, 0.5 / len(y), 1.0 - 0.5 / len(y))
    coef = np.array([_quantile_fit(x, y, float(t)) for t in taus])
    at0 = np.sort(coef[:, 0])
    slopes: list[list[float] | None] = [None] * len(z)
    for col, j in enumerate(used, start=1):
        slopes[j] = [float(v) for v in (np.sort(coef[:, 0] + coef[:, col] * most[j]) - at0) / most[j]]
    return [float(v) for v in at0], slopes, most


def load_scale(values: list, external: list) -> float:
    """``k`` of ``value = a * (1 + k * external)``: the median's regression of the values on [1,
    external] (``_quantile_fit``), slope over intercept; 0 when the loads do not vary, the
    intercept is not positive or the slope is negative (latencies do not shrink with load)."""
    x = np.asarray(external, dtype=float)
    if len(x) < 3 or np.ptp(x) == 0:
        return 0.0
    a, b = _quantile_fit(np.column_stack([np.ones(len(x)), x]), np.asarray(values, dtype=float))
    return float(b / a) if a > 0 and b > 0 else 0.0


def _per_token(samples: tuple[list, ...], lengths: tuple[list, ...], loads: tuple[list, ...]) -> float:
    """The dispatch latency's growth per prompt token: the median's regression (``_quantile_fit``)
    of the samples on their prompt lengths with one intercept and one slope on the other
    processes' work (``loads``) per state (``STATES``), at least 0; 0 when the
    prompts are all of one length."""
    d = np.asarray([v for part in samples for v in part], dtype=float)
    lens = np.asarray([v for part in lengths for v in part], dtype=float)
    if len(d) < 3 or np.ptp(lens) == 0:
        return 0.0
    state = np.concatenate([np.full(len(part), i) for i, part in enumerate(samples)])
    x = np.asarray([v for part in loads for v in part], dtype=float)
    onehot = [(state == i).astype(float) for i in range(len(samples))]
    cols = np.column_stack(onehot + [o * x for o in onehot] + [lens])
    cols = cols[:, np.abs(cols).sum(axis=0) > 0]       # a state or a load no sample has
    return max(0.0, float(_quantile_fit(cols, d)[-1]))


def fit_trace(*traces: dict, series: str = EXTERNAL_SERIES) -> dict:
    """The ``cpu_fit.json`` content for one or more recorded cluster runs (same machine, same
    engine settings): their steps and requests pooled; the contention's external term reads
    each run's ``series``."""
    first = traces[0]
    if any(t["cores"] != first["cores"] or t["engine"] != first["engine"] for t in traces):
        raise ValueError("the traces are of different machines or engine settings")
    rows = [step_rows(t, series) for t in traces]
    feats, dur, others, external, background, starts = (np.concatenate([r[i] for r in rows]) for i in range(6))
    # each engine a number unique over the traces
    offsets = np.cumsum([0] + [len(t["instances"]) for t in traces[:-1]])
    engines = np.concatenate([r[6] + offset for r, offset in zip(rows, offsets)])
    cores = int(first["cores"])
    marks = [landings(t, r[5], r[1], r[6]) for t, r in zip(traces, rows)]
    coeffs, weights, quality, noise, slow, post, prompt_noise, warm, land, hold = fit_steps(
        feats, dur, others, external, cores, starts, engines, background,
        np.concatenate([m[0] for m in marks]), np.concatenate([m[1] for m in marks]))
    eng = first["engine"]
    waits = [w for t in traces for w in engine_wake(t)]
    lat = fit_latencies([r for t in traces for r in t["requests"]], TINY_REASONER.kv_bytes_per_token,
                        eng["block_size"], **latency_inputs(traces, series, hold))
    return {
        "model": first.get("model", "tiny-reasoner"),
        "coeffs": coeffs,
        "contention": {"cores": cores, **weights, "series": series},
        "step_noise": noise,
        "prompt_noise": prompt_noise,
        "slow": slow,
        "post_prompt": post,
        "post_landing": land,
        "landing_hold": hold,
        "warmup": warm,
        "engine_wake": [float(v) for v in np.quantile(waits, QUANTILES)] if waits else None,
        "latency": {k: lat[k] for k in ("dispatch_s", "first_token_s", "finish_s", "saturated", "saturated_samples",
                                        "dispatch_per_token_s", "external_scale", "niced", "unniced", "busy", "busy_samples",
                                        "shared", "shared_samples", "crowded", "crowded_samples")
                    if k in lat},
        "fit_quality": {**quality, "latency_samples": lat["latency_samples"],
                        "dispatch_waited": lat["dispatch_waited"], "handoffs": lat["handoffs"],
                        "handoffs_busy": lat["handoffs_busy"]},
        "kv_capacity_tokens": eng["num_device_blocks"] * eng["block_size"],
        "engine": {k: eng[k] for k in ("block_size", "max_num_seqs", "max_num_batched_tokens")},
        "handoff_noise": lat["handoff_noise"],
        "handoff_busy_noise": lat["handoff_busy_noise"],
        "transfer_bw": lat["transfer_bw"] if lat["handoffs"] else LOOPBACK_BW,
        "transfer_latency_s": lat["transfer_latency_s"] if lat["handoffs"] else LOOPBACK_LATENCY_S,
        "measured": max(t.get("measured", "") for t in traces) or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "source": "; ".join(t.get("source", "") for t in traces),
    }


def latency_inputs(traces, series: str = EXTERNAL_SERIES, hold: dict | None = None) -> dict:
    """``fit_latencies``' (and ``gap_samples``') keyword arguments for the requests of
    ``traces``: each request read against its own run (the engines' steps, the outside work of
    ``series``; a page set's arrival by ``page_set_arrival`` with the write's ``hold``)."""
    runs = {id(r): fns for t in traces for p in (PublishingSteps(t),)
            for fns in ((stepping_at(t), publishing_step_end(t, p), waited_for_prefill(t), external_load_at(t, series),
                         niced_load_at(t, series), engine_busy(t, p), export_start(t, p), page_set_arrival(t, hold),
                         crowded_first_token(t, p), decode_busy_at(t)),)
            for r in t["requests"]}
    return {"stepping": lambda r, t: runs[id(r)][0](t), "cores": int(traces[0]["cores"]),
            "step_end": lambda r, t, prompt: runs[id(r)][1](t, prompt),
            "waited": lambda r, added: runs[id(r)][2](r["sent"], added),
            "external": lambda r, t: runs[id(r)][3](t), "niced": lambda r, t: runs[id(r)][4](t),
            "busy": lambda r, gap: runs[id(r)][5](r, gap), "export_start": lambda r, t, landed: runs[id(r)][6](t, landed),
            "arrival": lambda r, t, left: runs[id(r)][7](r, t, left), "crowded": lambda r: runs[id(r)][8](r),
            "target_busy": lambda r, t: runs[id(r)][9](t)}


def calibrate(fit: dict, *traces: dict) -> dict:
    """How this machine runs now against ``fit`` (a ``cpu_fit.json``'s content; a calibration it
    carries is ignored), from calibration runs' telemetry (``sim_fidelity.py --trace-out``, the
    same engine settings), as ``LinearCost``'s ``CALIBRATION_FACTORS``, each a ratio of sums:

    - ``decode_steps`` / ``woken_steps`` / ``waking_steps`` / ``waking_co_steps`` /
      ``prompt_steps``: the decode-only steps past the warm-up / inside it (``warmup``'s buckets
      since a wake) past its first ``WAKING_STEPS`` / among those, alone / beside the node's
      other engines' steps (``CO_STEPPING``) / the steps with prompt tokens' measured time over
      their price at the contention they ran under (the decode steps after a prompt step at their
      ``post_prompt`` factors, the steps after a wake at their ``warmup`` factors); a waking
      factor measured on fewer than ``CALIBRATION_MIN_STEPS`` steps takes the coarser one's;
      ``decode_steps`` and ``prompt_steps`` are those of the steps alone, and
      ``decode_co_steps`` / ``prompt_co_steps`` those of the steps beside the node's other
      engines' steps (``CO_STEPPING``; the decode steps past the warm-up), times how much more
      they cost now (``co_stepping``), at which every step beside is priced for the rest;
    - ``dispatch`` / ``first_token`` / ``finish``: the frontend's latencies (``GAPS``), each in
      its state and outside work as ``fit_latencies`` files them, over the means of the fit's
      distributions there (``FrontendLatency.mean``);
    - ``dispatch_spread`` / ``first_token_spread`` / ``finish_spread``: the same samples' mean
      absolute deviation from those means (each scaled by its latency's factor) over the fit's
      mean absolute deviation there (``FrontendLatency.deviation``);
    - ``handoff``: the hand-offs' time from when the page set could leave the prefill engine
      (``export_start``) to its landing over the fit's (``LinearCost.transfer_time``); 1 for
      runs without hand-offs (the mixed layout); where the fit has the hand-offs that left while
      their decode engine stepped apart (``handoff_busy_noise``), those to an idle engine, and
      ``handoff_busy`` the others, each over the fit's mean in its state (both pooled when
      either has fewer than ``MIN_SPLIT``; ``handoff_busy`` is ``handoff`` without the split);
    - ``handoff_spread``: the mean absolute deviation of each hand-off's time over the fit's
      (over its state's factor) from 1, over that of the fit's noise (in its state, over its
      mean); 1 without hand-offs;
    - ``slow_spread``: the same for the ``SLOW_WINDOW_S`` windows' measured over priced decode
      time (``slow_windows``, over their mean) against ``slow`` at each window's niced work;
    - ``latency_states`` (lists, not factors): for each latency, its level in each state
      (``STATES``) over its level in all (``dispatch`` / ``first_token`` / ``finish``), its
      distance from 1 shrunk by n / (n + ``STATE_PRIOR_SAMPLES``) for a state of n samples, 1 for
      one with fewer than ``MIN_SPLIT``: the states' contrast now against the fit's
      (``FrontendLatency.state_speed``); the spreads are measured about these levels;
    - ``first_token_rho`` (not a factor): the correlation of the run's first tokens' latencies
      (normal scores within their state) with the measured over priced time of the steps with
      prompt tokens that published them (``first_token_pairs``): the engine publishes before the
      step ends and the frontend's calls hold the end back, so a long step meets a short latency
      (-0.12 to -0.37 on the runs of 2026-12-03 and 12-05);
    - ``engines`` (a list, not a factor): each engine's measured over priced decode time (by its
      place in the run) over all engines'; 1 for one with fewer than ``CALIBRATION_MIN_STEPS``
      decode steps;
    - ``machine_sd`` (not a factor): the machine's own slowness, what slows the engines' decode
      steps and the frontend's latencies together over windows of MACHINE_WINDOW_S
      (``machine_windows``, ``machine_sd``; ``LinearCost.machine``); 0 when they do not move
      together;
    - ``probe_ms`` (runs recorded with ``bench/machine_probe.py`` beside them, all of them): the
      probe's mean level over the runs' windows (``probe_windows``), which a simulation of
      another run divides that run's probe by (``machine_series``): how much slower the machine
      is then than when it was calibrated.

    On this machine a quiet cluster's decode steps ran 0.96-1.09x the committed fit from one
    session to the next, and its frontend's latencies 0.82-1.22x, with no outside work to tell
    the sessions apart; the pd layout's prompt steps (a prefill engine's, alone) ran 1.13-1.40x,
    the mixed layout's 0.93-1.21x (docs/simulator.md, "Calibration"). A calibration run of the
    layout to be simulated measures all of it; what is simulated afterwards is not read."""
    base = {k: v for k, v in fit.items() if k != "calibration"}
    cost = LinearCost.from_dict(TINY_REASONER, base)
    if cost.cores is None or cost.frontend is None:
        raise ValueError("the fit has no contention or no frontend latencies: refit with bench/fit_sim_cpu.py")
    for t in traces:
        if int(t["cores"]) != cost.cores or any(t["engine"][k] != v for k, v in base["engine"].items()):
            raise ValueError(f"the calibration run ({t.get('source', '?')}) is of another machine or engine "
                             f"settings than the fit ({cost.cores} cores, {base['engine']})")
    coef = np.array([base["coeffs"][k] for k in TERMS])
    # per factor: measured, modelled, count
    sums = {k: [0.0, 0.0, 0] for k in ("decode_steps", "woken_steps", "waking_steps", "waking_co_steps", "prompt_steps",
                                       *GAPS, "handoff", "handoff_busy")}

    spreads = {k: [] for k in GAPS}     # per latency: (sample, the fit's mean and mean deviation there, state)
    by_state = {(k, st): [0.0, 0.0, 0] for k in GAPS for st in STATES}     # per latency and state: as ``sums``
    handoffs = []                       # each hand-off's time over the fit's, whether its decode engine stepped
    windows = []                        # each window's measured over priced time, its niced work
    machine = []                        # per run: its MACHINE_WINDOW_S windows' decode and latency ratios
    latent_pairs = []                   # per run: its latencies' pairs (``latency_pairs``)
    first_pairs = []                    # per run: its first tokens' latencies against their steps' (``first_token_pairs``)
    slow_persist = []                   # per run: its slow windows' pairs (``slow_pairs``)
    engine_sums = {}                    # per engine (its place in the run): decode time measured, priced

    def add(key, measured, modelled, n, into=sums):
        into[key][0] += measured
        into[key][1] += modelled
        into[key][2] += n
    # The runs' probe of the machine's speed, where every run has one: each step and latency is
    # priced at the probe's factor then (``machine_factor_at``), as the simulation of another run
    # prices them at that run's, so that the factors and spreads measure the machine beyond what
    # the probe tells (pd seed 172's run A ran its decode steps ~2.5x slower for 20 s, and so did
    # the probe; counted as the slow stretches' spread, it made it 4.4x the fit's).
    # A level is only comparable with a probe of the same unit (``machine_probe.UNIT``).
    probes = [probe_windows(t) for t in traces]
    probe_ms = (float(np.concatenate(probes).mean())
                if all(x is not None for x in probes) and len({probe_unit(t) for t in traces}) == 1 else None)
    warm = base.get("warmup")
    runs = []                           # per run: its steps, their price's factors and held time
    for t in traces:
        feats, dur, others, ext, bg, starts, engines = step_rows(t, cost.external_series)
        speed_at = machine_factor_at(t, probe_ms) if probe_ms else (lambda when: np.ones(np.shape(when)))
        bucket, kinds = (warmup_kinds(feats, starts, dur, engines, warm["idle_s"], warm["edges"], others) if warm
                         else (np.zeros(len(dur), dtype=np.int64), ()))
        landed, held = landings(t, starts, dur, engines)
        scale = (contention(others, ext, cost.cores, cost.co_step, cost.external_weight,
                            np.minimum, np.maximum, bg, cost.background_weight)
                 * post_prompt_scale(base.get("post_prompt"), since_prompt(feats, engines))
                 * post_prompt_scale(base.get("post_landing"), landed)
                 * warmup_scale(warm, bucket, kinds) * speed_at(starts))
        # (the first seven: what decode_per_seq reads; with the eighth, co_stepping)
        runs.append((feats, dur, bucket, scale, hold_time(base.get("landing_hold"), held), starts, engines,
                     others, t, bg, speed_at))
    warm_buckets = len(warm["edges"]) if warm else 0
    per_seq, per_seq_steps = decode_per_seq(coef, [r[:7] for r in runs], warm_buckets)
    coef = coef * np.array([per_seq if k in PER_SEQ_TERMS else 1.0 for k in TERMS])
    beside = co_stepping(coef, [r[:8] for r in runs], warm_buckets)
    for feats, dur, bucket, scale, hold, starts, engines, others, t, bg, speed_at in runs:
        woken = bucket < len(warm["edges"]) if warm else np.zeros(len(dur), dtype=bool)
        decode = feats[:, 4] == 0
        co = others >= CO_STEPPING
        # (the steps beside others' past the warm-up at what they cost beside them now: co_stepping)
        price = (feats @ coef) * scale * np.where(co & ~decode, beside["prompt"][0],
                                                  np.where(co & decode & ~woken, beside["decode"][0], 1.0)) + hold
        waking = bucket < waking_buckets(warm["edges"]) if warm else woken
        for e in np.unique(engines):
            m = decode & (engines == e)
            if m.sum() >= CALIBRATION_MIN_STEPS:
                a = engine_sums.setdefault(int(e), [0.0, 0.0])
                a[0] += dur[m].sum()
                a[1] += price[m].sum()
        ratio, niced, keys = slow_windows(feats, dur, price, starts, engines, bg, with_keys=True)
        windows.append((ratio, niced))
        slow_persist.append(slow_pairs(ratio, keys))
        for key, m in (("decode_steps", decode & ~woken), ("woken_steps", decode & woken & ~waking),
                       ("waking_steps", decode & waking & ~co), ("waking_co_steps", decode & waking & co),
                       ("prompt_steps", ~decode)):
            add(key, dur[m].sum(), price[m].sum(), int(m.sum()))
        at_time = {}
        inputs = latency_inputs([t], cost.external_series, base.get("landing_hold"))
        if cost.frontend.crowded is None:       # (a fit without: its first tokens filed by their state)
            del inputs["crowded"]
        sample, loads, niced_at, lengths, handoff, _ = gap_samples(t["requests"], TINY_REASONER.kv_bytes_per_token,
                                                                   t["engine"]["block_size"], **inputs, times=at_time)
        # per latency and state, (time, measured over the fit's mean) of each sample, and the
        # prompt steps' measured over priced time at their starts (``latency_pairs``)
        grouped = {("prompt_steps", 0): list(zip(starts[~decode], dur[~decode] / price[~decode]))}
        for seconds, nbytes, busy in handoff:
            busy = busy and cost.handoff_busy_noise is not None     # (a fit without the two apart: one)
            modelled = cost.transfer_time(nbytes, same_node=True, busy=busy)  # the fit's mean there (no calibration)
            add("handoff_busy" if busy else "handoff", seconds, modelled, 1)
            handoffs.append((seconds / modelled, busy))
        for which, key in enumerate(GAPS):
            for state in STATES:
                lens = lengths[state] if which == 0 else [0] * len(sample[key][state])
                when_all = at_time.get(key, ((),) * len(STATES))[state]
                for value, e, nc, k, when, speed in zip(sample[key][state], loads[key][state], niced_at[key][state],
                                                        lens, when_all, speed_at(np.asarray(when_all, dtype=float))):
                    at = {"state": state, "external": e, "niced": nc}
                    speed = float(speed)
                    mean = cost.frontend.mean(which, prompt_tokens=k, **at) * speed
                    add(key, value, mean, 1)
                    add((key, state), value, mean, 1, into=by_state)
                    spreads[key].append((value, mean, cost.frontend.deviation(which, **at) * speed, state))
                    grouped.setdefault((key, state), []).append((when, value / mean))
        # (each latency in each state over its own mean in the run: the states' levels differ)
        machine.append(machine_windows(starts[decode], dur[decode], price[decode],
                                       {k: rows for k, rows in grouped.items() if k[0] in GAPS}))
        latent_pairs.append(latency_pairs(grouped))
        first_pairs.append(first_token_pairs(grouped, starts, dur, price, ~decode))
    if not sums["woken_steps"][2] and sums["decode_steps"][2]:   # no warm-up in the fit (or none seen): as the rest
        sums["woken_steps"] = list(sums["decode_steps"])
    for key, like in (("waking_steps", "woken_steps"), ("waking_co_steps", "waking_steps")):
        if sums[key][2] < CALIBRATION_MIN_STEPS:    # too few to tell (a pd decode engine seldom wakes beside the prefill's)
            sums[key] = list(sums[like])
    idle, busy = sums["handoff"], sums["handoff_busy"]
    if busy[2] and min(idle[2], busy[2]) < MIN_SPLIT:   # too few one way to tell them apart: both pooled
        sums["handoff"] = [a + b for a, b in zip(idle, busy)]
        sums["handoff_busy"] = list(sums["handoff"])
    if not sums["handoff"][2]:  # no hand-off to measure (a mixed layout's run): as fitted
        sums["handoff"] = [1.0, 1.0, 0]
    if not sums["handoff_busy"][2]:     # (a fit without the two apart: the one)
        sums["handoff_busy"] = list(sums["handoff"])
    empty = [k for k, (_, modelled, n) in sums.items() if (not n or modelled <= 0) and not k.startswith("handoff")]
    if empty:
        raise ValueError(f"the calibration runs have no {', '.join(empty)} to measure")
    names = {"dispatch_s": "dispatch", "first_token_s": "first_token", "finish_s": "finish"}
    # Each latency's level per state over its level in all, shrunk towards it by the state's
    # samples (STATE_PRIOR_SAMPLES; 1 for a state with fewer than MIN_SPLIT): the states'
    # contrast now against the fit's.
    states = {names[key]: [state_level(m / e / (sums[key][0] / sums[key][1]) if e > 0 else 1.0, n)
                           for m, e, n in (by_state[key, st] for st in STATES)] for key in GAPS}
    spread = {}
    for key, rows in spreads.items():   # the samples' deviations from the calibrated means over the fit's
        speed = sums[key][0] / sums[key][1]
        level = states[names[key]]
        dev = sum(d for _, _, d, _ in rows)
        spread[f"{names[key]}_spread"] = (float(sum(abs(v / (speed * level[st]) - m) for v, m, _, st in rows) / dev)
                                          if dev > 0 else 1.0)
    w, niced = (np.concatenate([x[i] for x in windows]) for i in (0, 1))
    dev = float(np.mean([cost.slow_deviation(n) for n in niced])) if len(w) else 0.0
    # (a fit without slow stretches to speak of — exact synthetic steps — has none to scale)
    spread["slow_spread"] = float(np.mean(np.abs(w / w.mean() - 1.0)) / dev) if dev > 1e-6 else 1.0
    # each engine's decode time over all engines' (1 for one with too few decode steps)
    pooled = sum(a[0] for a in engine_sums.values()) / sum(a[1] for a in engine_sums.values())
    engines_speed = [engine_sums[e][0] / engine_sums[e][1] / pooled if e in engine_sums else 1.0
                     for e in range(max(engine_sums, default=-1) + 1)]
    speed = {b: sums[k][0] / sums[k][1] for b, k in ((False, "handoff"), (True, "handoff_busy"))}
    dev = (float(np.mean([cost.handoff_deviation(b) for _, b in handoffs])) if handoffs and cost.handoff_busy_noise
           else cost.handoff_deviation())
    spread["handoff_spread"] = (float(np.mean([abs(r / speed[b] - 1.0) for r, b in handoffs]) / dev)
                                if handoffs and dev > 0 else 1.0)
    sd, used = machine_sd(machine)
    rho, tau, pairs_used = persistence(latent_pairs)
    first_rho, first_used = pair_correlation(first_pairs)
    slow_rho, slow_tau, slow_used = persistence(slow_persist)
    probe = {"probe_ms": probe_ms, "probe_unit": probe_unit(traces[0])} if probe_ms else {}
    factors = {names.get(k, k): float(m / e) for k, (m, e, _) in sums.items()}
    co_factors = {f"{kind}_co_steps": factors[f"{kind}_steps"] * beside[kind][0] for kind in ("decode", "prompt")}
    return {**factors, **co_factors, **spread,
            "engines": [float(v) for v in engines_speed], "latency_states": states, "machine_sd": sd, **probe,
            "latency_rho": rho, "latency_tau_s": tau, "slow_rho": slow_rho, "slow_tau_s": slow_tau,
            "first_token_rho": first_rho,
            "decode_per_seq": per_seq,
            "counts": {**{names.get(k, k): n for k, (_, _, n) in sums.items()},
                       **{f"{names[k]}_spread": len(rows) for k, rows in spreads.items()},
                       "handoff_spread": len(handoffs), "slow_spread": len(w), "machine_sd": used,
                       "latency_rho": pairs_used, "slow_rho": slow_used, "first_token_rho": first_used,
                       "decode_per_seq": per_seq_steps,
                       **{f"{kind}_co_steps": beside[kind][1] for kind in ("decode", "prompt")},
                       "probe_ms": sum(len(p) for p in probes if p is not None)},
            "source": "; ".join(t.get("source", "") for t in traces),
            "measured": max((t.get("measured", "") for t in traces), default="")}


def machine_windows(starts: np.ndarray, dur: np.ndarray, price: np.ndarray, latencies: dict) -> np.ndarray:
    """One run's windows of MACHINE_WINDOW_S (rows: decode steps' measured over priced time, the
    frontend's latencies' mean measured over the fit's mean), each over the run's own (so that
    only the change within the run is left), of the windows with at least MACHINE_MIN_STEPS
    decode steps (``starts``, ``dur``, ``price``) and MACHINE_MIN_LATENCIES latencies
    (``latencies``: per latency, (time, measured over the fit's mean) of each sample)."""
    if not len(starts):
        return np.zeros((0, 2))
    n = int(max(starts.max(), max((t for rows in latencies.values() for t, _ in rows), default=0.0))
            // MACHINE_WINDOW_S) + 1
    k = np.clip((starts // MACHINE_WINDOW_S).astype(np.int64), 0, n - 1)
    d, p, c = (np.bincount(k, v, n) for v in (dur, price, None))
    lat_sum, lat_n = np.zeros(n), np.zeros(n)
    for rows in latencies.values():
        if not rows:
            continue
        t, r = np.asarray(rows, dtype=float).T
        r = r / r.mean() if r.mean() > 0 else r     # each latency over its own mean in the run
        j = np.clip((t // MACHINE_WINDOW_S).astype(np.int64), 0, n - 1)
        lat_sum += np.bincount(j, r, n)
        lat_n += np.bincount(j, None, n)
    ok = (c >= MACHINE_MIN_STEPS) & (lat_n >= MACHINE_MIN_LATENCIES) & (p > 0)
    if ok.sum() < 2:
        return np.zeros((0, 2))
    dec, lat = d[ok] / p[ok], lat_sum[ok] / lat_n[ok]
    return np.column_stack([dec / (dur.sum() / price.sum()), lat / lat.mean()])


def probe_windows(trace: dict) -> np.ndarray | None:
    """The run's ``machine_probe`` (``bench/machine_probe.py``: the unit's CPU ms beside the
    cluster) as the median per window of MACHINE_WINDOW_S from 0 to the run's last engine step's
    end; a window with fewer than PROBE_MIN_SAMPLES takes the mean of the others. None for a run
    recorded without the probe."""
    samples = trace.get("machine_probe")
    if not samples:
        return None
    end = max((s[0] + s[1] for inst in trace["instances"].values() for s in inst["steps"]), default=0.0)
    t, ms = np.asarray(samples, dtype=float).T
    k = np.floor(t / MACHINE_WINDOW_S).astype(np.int64)
    out = np.array([np.median(ms[k == j]) if (k == j).sum() >= PROBE_MIN_SAMPLES else np.nan
                    for j in range(int(end // MACHINE_WINDOW_S) + 1)])
    if np.isnan(out).all():
        return None
    out[np.isnan(out)] = np.nanmean(out)
    return out


def probe_unit(trace: dict) -> str:
    """The unit of the run's probe (``machine_probe.UNITS``; a run recorded before the unit was
    written down had ``machine_probe.LEGACY_UNIT``)."""
    return trace.get("machine_probe_unit", machine_probe.LEGACY_UNIT)


def with_probe(trace: dict, unit: str | None) -> dict:
    """The run as recorded with ``unit``'s probe as its ``machine_probe``: a run recorded with
    several probes beside the cluster (``bench/sim_fidelity.py --probe``) carries each other unit's
    samples as ``machine_probe_<unit>``. None or the run's own unit: the run as it is; a unit the
    run was not recorded with raises ValueError."""
    if unit is None or unit == probe_unit(trace):
        return trace
    samples = trace.get(f"machine_probe_{unit}")
    if samples is None:
        raise ValueError(f"no {unit} probe recorded (the run's probe: {probe_unit(trace)})")
    return {**trace, "machine_probe": samples, "machine_probe_unit": unit}


def machine_series_for(trace: dict, calibration: dict) -> list[tuple[float, float]]:
    """What a simulation of the run calibrated by ``calibration`` replays as the machine's speed:
    the run's ``machine_series`` over the calibration run's probe level where both were measured
    with the same probe unit; [] otherwise (the simulation draws the machine's slowness)."""
    probe_ms = calibration.get("probe_ms")
    if not probe_ms or probe_unit(trace) != calibration.get("probe_unit", machine_probe.LEGACY_UNIT):
        return []
    return machine_series(trace, probe_ms)


def machine_series(trace: dict, probe_ms: float) -> list[tuple[float, float]]:
    """The machine's speed during a run as the simulator replays it (``Simulator(machine=...)``):
    per window of MACHINE_WINDOW_S, (its start, the probe's median there over ``probe_ms``, the
    calibration run's level); [] for a run recorded without the probe."""
    w = probe_windows(trace)
    return [] if w is None else [(k * MACHINE_WINDOW_S, float(v / probe_ms)) for k, v in enumerate(w)]


def decode_per_seq(coef: np.ndarray, runs: list, warm_buckets: int) -> tuple[float, int]:
    """(how much the per-sequence decode work — ``PER_SEQ_TERMS`` — costs now over the fit's, the
    steps it was measured on) from the runs' decode-only steps past the warm-up (each run: its
    ``feats``, measured ``dur``, warm-up ``bucket``, price ``scale``, held time, ``starts`` and
    ``engines``), compared with the steps of the same engine in the same window of
    ``PER_SEQ_WINDOW_S`` (at least PER_SEQ_MIN_STEPS of them), so that what slows the machine for
    longer (and grows the batches with it) is left out: a step whose price is a share x of
    per-sequence work, in a window whose steps' mean share is m, runs 1 + (g - 1) (x - m) /
    (1 + (g - 1) m) times the window's mean over its price; the slope b of that over all windows'
    steps gives g = 1 + b / (1 - b m), m the steps' mean share (clamped to 1 / FACTOR_MOST ..
    FACTOR_MOST). Steps more than 3x their window's mean (descheduled) are left out. 1 with fewer
    than CALIBRATION_MIN_STEPS steps. On 2026-12-04 it was 1.1-2.0 (a decode step of 3-4
    sequences ran 1.1-1.25x its price, of one 0.94-0.97x); on single runs of the fit's 0.7-1.03,
    on all of them together 0.98."""
    seq = np.array([k in PER_SEQ_TERMS for k in TERMS])
    rt, xt, share = [], [], []
    for feats, dur, bucket, scale, hold, starts, engines in runs:
        m = (feats[:, 4] == 0) & (bucket >= warm_buckets)
        fixed = (feats[m][:, ~seq] @ coef[~seq]) * scale[m] + hold[m]
        per = (feats[m][:, seq] @ coef[seq]) * scale[m]
        r, x = dur[m] / (fixed + per), per / (fixed + per)
        key = engines[m].astype(np.int64) * (1 << 32) + np.floor(starts[m] / PER_SEQ_WINDOW_S).astype(np.int64)
        _, inv = np.unique(key, return_inverse=True)
        count = np.bincount(inv)
        ok = count[inv] >= PER_SEQ_MIN_STEPS
        r_rel = r / (np.bincount(inv, r) / count)[inv] - 1.0
        ok &= r_rel < 2.0
        rt.append(r_rel[ok])
        xt.append((x - (np.bincount(inv, x) / count)[inv])[ok])
        share.append(x[ok])
    rt, xt, share = (np.concatenate(v) if v else np.zeros(0) for v in (rt, xt, share))
    if len(rt) < CALIBRATION_MIN_STEPS or not (xt ** 2).sum() > 0:
        return 1.0, int(len(rt))
    beta = float((rt * xt).sum() / (xt ** 2).sum())
    g = 1.0 + beta / (1.0 - beta * float(share.mean())) if beta * share.mean() < 1.0 else FACTOR_MOST
    return float(min(max(g, 1.0 / FACTOR_MOST), FACTOR_MOST)), int(len(rt))


def co_stepping(coef: np.ndarray, runs: list, warm_buckets: int) -> dict:
    """``{"decode": (k, steps), "prompt": (k, steps)}``: how much more the steps beside the node's
    other engines' steps (``CO_STEPPING``) cost now than those alone, over the fit's prices — the
    decode-only steps past the warm-up (its buckets have their own factors) and the steps with
    prompt tokens —, and how many steps beside others it was measured on. From the runs (each:
    its ``feats``, measured ``dur``, warm-up ``bucket``, price ``scale``, held time, ``starts``,
    ``engines``, ``others`` stepping), with every run's sums pooled: the steps alone ran
    ``r = dur / (price + held)``; the ones beside run ``k`` times their price, their hold (what a
    page set's write adds, at the decode steps' factor in the simulator) as is, so that ``r (k
    price + held)`` is their measured time. 1 (and 0 steps) where either side has fewer than
    CO_MIN_STEPS; clamped to 1 / FACTOR_MOST .. FACTOR_MOST. On the fit's own runs, all
    together: decode 0.95, prompt 1.13 (its one ``co_step`` prices both kinds alike); on
    2026-12-03's quiet runs 0.90-0.93 and 0.82-0.99; on 2026-12-04/05 a mixed engine's decode
    steps 1.03-1.12, its prompt steps 1.10-1.19; the pd prefill engine's prompt steps beside the
    decode engine's 1.07-1.33, and the decode engine's few steps beside a prefill (1-2% of them)
    0.63-0.80 on every day (a decode step beside a prefill runs nearly as alone).
    """
    # per kind, rows alone and beside: measured, price, held, steps
    sums = {kind: np.zeros((2, 4)) for kind in ("decode", "prompt")}
    for feats, dur, bucket, scale, hold, starts, engines, others in runs:
        decode = feats[:, 4] == 0
        co = others >= CO_STEPPING
        base = (feats @ coef) * scale
        for kind, m in (("decode", decode & (bucket >= warm_buckets)), ("prompt", ~decode)):
            for row, side in enumerate((m & ~co, m & co)):
                sums[kind][row] += (dur[side].sum(), base[side].sum(), hold[side].sum(), side.sum())
    out = {}
    for kind, (alone, co) in sums.items():
        if min(alone[3], co[3]) < CO_MIN_STEPS or not (alone[0] > 0 and co[1] > 0):
            out[kind] = (1.0, 0)
            continue
        r = alone[0] / (alone[1] + alone[2])
        k = (co[0] / r - co[2]) / co[1]
        out[kind] = (float(min(max(k, 1.0 / FACTOR_MOST), FACTOR_MOST)), int(co[3]))
    return out


def machine_factor_at(trace: dict, probe_ms: float):
    """A function (times -> factors): the run's ``machine_series`` over ``probe_ms`` at each time,
    as the simulator's ``machine_at`` gives it (1 before the first window, the last one's after
    it); 1 everywhere for a run recorded without the probe."""
    series = machine_series(trace, probe_ms)
    if not series:
        return lambda when: np.ones(np.shape(when))
    starts, factors = (np.array(v, dtype=float) for v in zip(*series))

    def at(when):
        i = np.searchsorted(starts, np.asarray(when, dtype=float), side="right") - 1
        return np.where(i >= 0, factors[np.clip(i, 0, len(factors) - 1)], 1.0)
    return at


def machine_sd(runs: list) -> tuple[float, int]:
    """(the machine's own slowness, ``LinearCost.machine``'s ``machine_sd``; the windows it was
    measured on) from the runs' ``machine_windows``: the covariance, over the windows, of the
    decode steps' and the latencies' ratio is the variance of what slows both (each one's own
    noise is independent of the other's), taken as a lognormal's with mean 1; 0 when they do not
    move together (on quiet runs their covariance is about 0 or below: the engines' slow
    stretches are their own, ``slow``)."""
    rows = [r - r.mean(axis=0) for r in runs if len(r) >= 2]
    if not rows:
        return 0.0, 0
    x = np.vstack(rows)
    cov = float((x[:, 0] * x[:, 1]).sum() / max(1, len(x) - len(rows)))
    return float(min(1.0, np.sqrt(np.log1p(max(0.0, cov))))), len(x)


def latency_pairs(grouped: dict) -> tuple[np.ndarray, np.ndarray]:
    """(gap, product) of every pair of one run's frontend latencies at most LATENT_MAX_GAP_S apart:
    ``grouped`` maps (latency, state) to its samples (time, measured over the fit's mean), each
    turned into its normal score within its group (of at least LATENT_MIN_GROUP samples), so
    that a state's level and a latency's distribution are left out and only how the draws move
    together over time stays."""
    t, z = [], []
    for rows in grouped.values():
        if len(rows) < LATENT_MIN_GROUP:
            continue
        when, ratio = np.asarray(rows, dtype=float).T
        t.append(when)
        z.append(normal_scores(ratio))
    if not t:
        return np.zeros(0), np.zeros(0)
    t, z = np.concatenate(t), np.concatenate(z)
    order = np.argsort(t, kind="stable")
    t, z = t[order], z[order]
    gaps, products = [], []
    for i in range(len(t)):
        k = np.searchsorted(t, t[i] + LATENT_MIN_GAP_S, side="left")
        j = np.searchsorted(t, t[i] + LATENT_MAX_GAP_S, side="right")
        gaps.append(t[k:j] - t[i])
        products.append(z[i] * z[k:j])
    return np.concatenate(gaps), np.concatenate(products)


def state_level(ratio: float, n: int) -> float:
    """A latency's calibrated level in one state (``latency_states``) from the state's measured
    over modelled time over the latency's in all (``ratio``) on ``n`` samples: ``ratio``'s
    distance from 1 times n / (n + STATE_PRIOR_SAMPLES); 1 with fewer than MIN_SPLIT samples."""
    return float(1.0 + (ratio - 1.0) * n / (n + STATE_PRIOR_SAMPLES)) if n >= MIN_SPLIT else 1.0


def first_token_pairs(grouped: dict, starts: np.ndarray, dur: np.ndarray, price: np.ndarray,
                      prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the step's, the latency's) normal scores of each of one run's first tokens: its latency's
    measured over the fit's mean within its state (``grouped``, as ``latency_pairs`` reads it; a
    state of at least LATENT_MIN_GROUP samples), and the measured over priced time of the step with
    prompt tokens that published it (``prompt``; found by its end, the sample's time less
    ``AFTER_STEP_S``) among the run's such steps: how a first token's latency runs against its
    step's noise (``LinearCost.first_token_rho``)."""
    ends = {float(starts[j] + dur[j]) + AFTER_STEP_S: j for j in np.flatnonzero(prompt)}
    steps, lat = [], []
    for (key, _), rows in grouped.items():
        if key != "first_token_s" or len(rows) < LATENT_MIN_GROUP:
            continue
        when, ratio = np.asarray(rows, dtype=float).T
        found = [ends.get(float(t)) for t in when]
        keep = np.array([j is not None for j in found])
        if keep.sum() < LATENT_MIN_GROUP:
            continue
        lat.append(normal_scores(ratio[keep]))
        steps.extend(dur[j] / price[j] for j in found if j is not None)
    if not lat:
        return np.zeros(0), np.zeros(0)
    return normal_scores(np.asarray(steps)), np.concatenate(lat)


def pair_correlation(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[float, int]:
    """(the correlation of the runs' paired normal scores, clipped to [-0.9, 0.9]; how many pairs):
    0 with fewer than LATENT_MIN_GROUP pairs."""
    a, b = (np.concatenate([p[i] for p in pairs]) if pairs else np.zeros(0) for i in (0, 1))
    if len(a) < LATENT_MIN_GROUP:
        return 0.0, int(len(a))
    return float(np.clip(np.mean(a * b) / np.sqrt(np.mean(a * a) * np.mean(b * b)), -0.9, 0.9)), int(len(a))


def normal_scores(x: np.ndarray) -> np.ndarray:
    """Each value's standard normal quantile at its rank's midpoint among ``x``."""
    rank = np.argsort(np.argsort(x, kind="stable"), kind="stable")
    return np.array([_NORMAL.inv_cdf((k + 0.5) / len(rank)) for k in rank])


def slow_pairs(ratio: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gap, product) of every pair of one run's slow windows of one engine (``slow_windows``'
    ratios and keys) at most LATENT_MAX_GAP_S apart: each window's normal score among its
    engine's windows, so that only how an engine's slowness persists from one window to the next
    stays."""
    gaps, products = [], []
    for e in np.unique(keys >> 32):
        m = (keys >> 32) == e
        if m.sum() < LATENT_MIN_GROUP:
            continue
        k, z = (keys[m] & ((1 << 32) - 1)).astype(np.int64), normal_scores(ratio[m])
        most = int(round(LATENT_MAX_GAP_S / SLOW_WINDOW_S))
        for lag in range(1, most + 1):
            j = np.searchsorted(k, k + lag)
            ok = j < len(k)
            ok[ok] &= k[j[ok]] == k[ok] + lag
            gaps.append(np.full(int(ok.sum()), lag * SLOW_WINDOW_S))
            products.append(z[ok] * z[j[ok]])
    if not gaps:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(gaps), np.concatenate(products)


def persistence(runs: list) -> tuple[float, float, int]:
    """(rho, tau, pairs used) from the runs' (gap, product) pairs (``latency_pairs``,
    ``slow_pairs``): the least-squares fit of the pairs' products (their normal scores'
    correlation) by rho * exp(-gap / tau) + c over LATENT_TAUS, with c >= 0 the slower change
    the machine's slowness and its probe carry (``machine_sd``, ``machine_series``); (0, 0, n)
    when rho comes out at or below 0 or with fewer than LATENT_MIN_PAIRS pairs."""
    gaps = np.concatenate([g for g, _ in runs]) if runs else np.zeros(0)
    prod = np.concatenate([p for _, p in runs]) if runs else np.zeros(0)
    if len(gaps) < LATENT_MIN_PAIRS:
        return 0.0, 0.0, int(len(gaps))
    best = None
    for tau in LATENT_TAUS:
        e = np.exp(-gaps / tau)
        x = np.column_stack([e, np.ones(len(e))])
        rho, c = np.linalg.lstsq(x, prod, rcond=None)[0]
        if c < 0:
            rho, c = float(e @ prod / (e @ e)), 0.0
        sse = float(((prod - rho * e - c) ** 2).sum())
        if best is None or sse < best[0]:
            best = (sse, rho, tau)
    _, rho, tau = best
    if rho <= 0:
        return 0.0, 0.0, int(len(gaps))
    return float(min(rho, LATENT_MAX_RHO)), float(tau), int(len(gaps))


def write_calibrated(fit: dict, calibration: dict, path) -> Path:
    """``fit`` (a ``cpu_fit.json``'s content) with ``calibration`` (``calibrate``'s; one ``fit``
    carries is replaced) written to ``path``: the fit file ``thinkserve sim --gpu cpu --cpu-fit``
    and ``LinearCost.from_fit`` read."""
    path = Path(path)
    path.write_text(json.dumps({**fit, "calibration": calibration}, indent=1) + "\n")
    return path


def describe_calibration(cal: dict) -> str:
    """``decode steps x1.03 (30087), prompt steps ...``: each factor and what it was measured on."""
    return (", ".join(f"{k.replace('_', ' ')} x{cal[k]:.3f} ({cal['counts'][k]})" for k in CALIBRATION_FACTORS)
            + (f", machine sd {cal['machine_sd']:.3f} ({cal['counts']['machine_sd']})" if "machine_sd" in cal else "")
            + (f", decode per seq x{cal['decode_per_seq']:.3f} ({cal['counts']['decode_per_seq']})"
               if "decode_per_seq" in cal else "")
            + "".join(f", {name} persisting rho {cal[f'{name}_rho']:.2f} tau {cal[f'{name}_tau_s']:.2f} s "
                      f"({cal['counts'][f'{name}_rho']} pairs)" for name in ("latency", "slow") if f"{name}_rho" in cal))


def with_handoff_from(fit: dict, trace: dict) -> dict:
    """``fit`` with the hand-off cost measured in ``trace`` (a run with hand-offs), for a fit of
    runs without any (the hand-off cost is a property of the frontend and the transport; a fit
    that pools a ``pd`` run has it already)."""
    published = PublishingSteps(trace)
    end, start = publishing_step_end(trace, published), export_start(trace, published)
    arrival = page_set_arrival(trace, fit.get("landing_hold"))
    stepping = decode_busy_at(trace)
    lat = fit_latencies(trace["requests"], TINY_REASONER.kv_bytes_per_token, trace["engine"]["block_size"],
                        step_end=lambda r, t, prompt: end(t, prompt), export_start=lambda r, t, landed: start(t, landed),
                        arrival=arrival, target_busy=lambda r, t: stepping(t))
    if not lat["handoffs"]:
        raise ValueError("the hand-off trace has no hand-offs")
    return {**fit, "transfer_latency_s": lat["transfer_latency_s"], "transfer_bw": lat["transfer_bw"],
            "handoff_noise": lat["handoff_noise"], "handoff_busy_noise": lat["handoff_busy_noise"],
            "fit_quality": {**fit["fit_quality"], "handoffs": lat["handoffs"], "handoffs_busy": lat["handoffs_busy"]},
            "source": f"{fit['source']}; hand-offs: {trace.get('source', '')}"}


def _latency_medians(latency: dict) -> str:
    """``dispatch_s 5.3 ms, ...`` (with a core free / with the cores taken, when split)."""
    sat = latency.get("saturated") or {}
    return ", ".join(f"{k} {np.median(v) * 1e3:.1f}" + (f" / {np.median(sat[k]) * 1e3:.1f}" if k in sat else "") + " ms"
                     for k, v in latency.items() if k in ("dispatch_s", "first_token_s", "finish_s"))


def load_trace(path: str | Path) -> dict:
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="runs' telemetry (.json or .json.gz), as bench/sim_fidelity.py "
                                               "--trace-out writes it")
    ap.add_argument("--handoffs-from", default=None, help="take the hand-off cost from this run (--layout pd)")
    ap.add_argument("--external-series", default=EXTERNAL_SERIES,
                    help="the runs' measure of other processes' work the contention reads (EXTERNAL_SERIES)")
    ap.add_argument("--out", default=None, help="where to write the fit (default: cluster/sim/cpu_fit.json; "
                                                "--calibrate: required)")
    ap.add_argument("--calibrate", action="store_true",
                    help="do not fit: write --fit calibrated by the traces (calibration runs of this machine now)")
    ap.add_argument("--fit", default=str(ROOT / "cluster" / "sim" / "cpu_fit.json"),
                    help="--calibrate: the fit to calibrate")
    args = ap.parse_args()
    if args.calibrate:
        if not args.out:
            ap.error("--calibrate needs --out (the committed fit stays as fitted)")
        base = json.loads(Path(args.fit).read_text())
        cal = calibrate(base, *(load_trace(p) for p in args.traces))
        write_calibrated(base, cal, args.out)
        print(f"calibrated {args.fit}: " + describe_calibration(cal) + f"; wrote {args.out} "
              f"(thinkserve sim --gpu cpu --cpu-fit {args.out})")
        return 0
    args.out = args.out or str(ROOT / "cluster" / "sim" / "cpu_fit.json")
    fit = fit_trace(*(load_trace(p) for p in args.traces), series=args.external_series)
    if args.handoffs_from:
        fit = with_handoff_from(fit, load_trace(args.handoffs_from))
    Path(args.out).write_text(json.dumps(fit, indent=1) + "\n")
    q = fit["fit_quality"]
    lat = _latency_medians(fit["latency"])
    print(f"fit {fit['coeffs']}, contention {fit['contention']}, frontend latency medians: {lat}, "
          f"hand-off {fit['transfer_latency_s'] * 1e3:.1f} ms ({q['handoffs']} hand-offs"
          + (f", {q['handoffs_busy']} of them to a stepping decode engine at {draw_mean(tuple(busy)):.2f}x the line, "
             f"the others at {draw_mean(tuple(fit['handoff_noise'])):.2f}x" if (busy := fit.get("handoff_busy_noise")) else "")
          + ")")
    print(f"step-time error on its {q['samples']} samples: median {q['median_rel_error']:.1%}, "
          f"p90 {q['p90_rel_error']:.1%}, total {q['total_time_error']:.1%}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
