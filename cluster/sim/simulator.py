"""The discrete-event loop: arrivals, engine steps, KV hand-offs, on simulated instances.

Placement is the router's (``thinkserve.router``): each arrival hands the policy a
``ClusterSnapshot`` built from the instances, exactly the frozen snapshot types the cluster
builds, and executes the ``Placement`` it returns:

- colocated: the request runs on one ``mixed`` instance;
- local prefill (the Conductor's conditional disaggregation): it runs on the one short_decode
  instance the placement names, which computes the prompt in place;
- disaggregated: it prefills on a ``prefill`` instance; when its first token is sampled the
  instance holds it, its page set is exported (``workers.migration.export``), each decode
  instance the placement names receives its branches after ``bytes / link bandwidth`` and imports
  them with ``workers.migration.build_request``; then the prefill instance releases its blocks.
"""
from __future__ import annotations

import gc
import heapq
import itertools
import math
import random
from bisect import bisect_right
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Mapping

from thinkserve.router.placement import COLOCATED, LOCAL_PREFILL, Placement, PlacementRequest
from thinkserve.router.snapshot import LONG_DECODE, SHORT_DECODE, ClusterSnapshot, PoolSnapshot
from thinkserve.workers.migration import export
from thinkserve.workers.outputs import ExportedRequest
from thinkserve.workers.sampling_params import SamplingParams
from thinkserve.workers.sequence import Request, RequestStatus, Sequence

from thinkserve.router.consensus import Finished, Tally, make_rule

from .cost import MACHINE_WINDOW_S, LatencyState
from .instance import SimInstance
from .workload import SimRequest

_WAKE, _KV_DONE, _RETRY, _PROMOTE, _SUBMIT, _LOAD, _REPORT = 1, 2, 3, 4, 5, 6, 7
RETRY_S = 0.01           # a request nothing can take now asks the router again after this


@dataclass
class RequestRecord:
    req: SimRequest
    first_token: float | None = None
    finish: float | None = None
    refused: str | None = None
    truncated: bool = False
    branches_left: int = 0
    parts_left: int = 0            # page sets still travelling to decode instances
    parts_from: dict = field(default_factory=dict)  # source instance -> its page sets still travelling
    decode_instances: dict = field(default_factory=dict)  # branch index -> SimInstance
    placement: object = None       # the router's Placement
    finished_branches: list = field(default_factory=list)  # consensus.Finished, in finishing order
    decided: bool = False          # early consensus stopped it; its answer is known
    tokens_out: int = 0            # most output tokens any branch produced
    tokens_saved: int = 0          # output tokens cancelled branches did not produce
    preq: object = None            # the PlacementRequest it was made for
    promotion_due_at: int | None = None  # Conductor.promotion_due_at(placement.length), once asked
    prompt_draw: float | None = None  # its first token's step's noise draw (``Simulator._first_token_rho``)


@dataclass(frozen=True)
class PoolSpec:
    name: str        # router pool name (prefill, short_decode, long_decode, mixed)
    role: str        # engine role
    count: int


class _Persistent:
    """Uniform draws (``random()``, as a generator's) that persist over time: draw ``i`` at time
    ``t_i`` is Phi(sqrt(rho) Z(t_i) + sqrt(1 - rho) e_i), with Z a standard Ornstein-Uhlenbeck
    process of correlation time ``tau`` (advanced exactly between draws, from ``latent``) and e_i
    independent (from ``own``): two draws ``gap`` seconds apart have normal scores correlated
    rho * exp(-gap / tau), each draw's distribution unchanged. ``clock``: the time of the next
    draw. For a node's frontend latencies (the cost's ``latency_rho``; on the changing hours of
    2026-12-04 a request's dispatch and its prefill step had rank correlation 0.4-0.6) and an
    engine's slow stretches (``slow_rho``; an engine's 0.1 s windows' slowness had
    autocorrelation 0.2-0.7 at one window, 0-0.4 at ten) (``bench/fit_sim_cpu.py``
    ``persistence``)."""

    _PHI = NormalDist()

    def __init__(self, latent: random.Random, own: random.Random, rho: float, tau: float, clock):
        self.latent, self.own, self.clock = latent, own, clock
        self.a, self.b, self.tau = math.sqrt(rho), math.sqrt(1.0 - rho), tau
        self.z = latent.gauss(0.0, 1.0)
        self.t = None

    def random(self) -> float:
        now = self.clock()
        if self.t is not None and now > self.t:
            keep = math.exp(-(now - self.t) / self.tau)
            self.z = keep * self.z + math.sqrt(1.0 - keep * keep) * self.latent.gauss(0.0, 1.0)
        self.t = now if self.t is None else max(self.t, now)
        return self._PHI.cdf(self.a * self.z + self.b * self.own.gauss(0.0, 1.0))


class _Noted:
    """Uniform draws (``random()``) from ``draws``, the last one kept (``last``; None before any):
    a step with prompt tokens' noise draw, which the latency of the first token it publishes is
    drawn against (``_Against``)."""

    def __init__(self, draws):
        self.draws, self.last = draws, None

    def random(self) -> float:
        self.last = self.draws.random()
        return self.last


class _Against:
    """Uniform draws from ``draws`` whose normal scores correlate ``rho`` with that of ``u`` (a
    Gaussian copula; each draw's distribution unchanged): Phi(rho Phi^-1(u) + sqrt(1 - rho^2) e),
    e standard normal from ``draws``. A first token's latency against its prompt step's noise
    draw (the cost's ``first_token_rho``)."""

    _PHI = NormalDist()

    def __init__(self, draws, u: float, rho: float):
        self.draws, self.rho = draws, rho
        self.z = self._score(u)

    def random(self) -> float:
        own = self._score(self.draws.random())
        return self._PHI.cdf(self.rho * self.z + math.sqrt(1.0 - self.rho * self.rho) * own)

    @classmethod
    def _score(cls, u: float) -> float:
        """``u``'s standard normal score (``u`` kept off 0 and 1)."""
        return cls._PHI.inv_cdf(min(max(u, 1e-12), 1.0 - 1e-12))


class Simulator:
    def __init__(self, requests: list[SimRequest], pools: list[PoolSpec], policy, cost, *,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, slo_classes: bool = True, bulk_decode: bool = True,
                 progress=None, conductor=None, early_stop: str = "none", external_load=(), step_noise: bool = False,
                 pool_max_num_seqs: Mapping[str, int] | None = None, noise_seed: int = 0, machine=()):
        """``max_num_seqs``: each engine's batch cap; ``pool_max_num_seqs``: pool name -> the cap
        of that pool's engines instead (the cluster's ``pools.<name>.engine.max_num_seqs``).
        ``conductor``: how to drive a Conductor policy (``ConductorDriver``); None for
        ``LeastLoadedPolicy``-style policies (``place(req, snapshot)``). ``external_load``:
        ((from time, cores' worth of other processes' work[, cores of niced work]), ...), for a
        cost model whose engines share a node's cores (replaying a recorded run on a shared
        machine; the niced work is the contention's ``background``, 0 when not given). ``step_noise``: a step
        priced alone (a prefill, an admission, a single decode step) takes its modelled time times a
        draw of the cost's measured step-time ratio (``LinearCost.noise``, seeded); a decode run of
        many steps takes its modelled time times its engine's slowness then, one draw per engine
        per window of the cost's ``slow_window_s`` (``LinearCost.slowness``, seeded per engine;
        1 without the cost's ``slow``): the steps' own noise averages out over the run, their
        slow stretches do not (``run_scale``). ``machine``: ((from time, factor), ...), the
        machine's speed during a recorded run (``bench/fit_sim_cpu.py`` machine_series: a probe's
        measurements beside the cluster over its level when the cost was calibrated), an input
        like ``external_load``: every step and frontend latency takes that factor times its price
        (``machine_at``), in place of the cost's drawn ``machine_sd``."""
        self.requests = sorted(requests, key=lambda r: r.arrival)
        self.policy, self.cost, self.progress = policy, cost, progress
        self.slo_classes = slo_classes
        self.block_size = block_size
        tokens = cost.kv_capacity_tokens()
        num_blocks = tokens // block_size
        gpus_per_instance = cost.num_gpus()
        gpus_per_node = getattr(getattr(cost, "gpu", None), "gpus_per_node", 8)
        self.instances: list[SimInstance] = []
        self.pools: dict[str, list[SimInstance]] = {}
        caps = pool_max_num_seqs or {}      # a pool this deployment lacks is not an error (one CLI, several policies)
        gpu = 0
        for spec in pools:
            members = []
            cap = caps.get(spec.name, max_num_seqs)
            if cap < 1:
                raise ValueError(f"max_num_seqs of pool {spec.name} must be >= 1, got {cap}")
            for i in range(spec.count):
                inst = SimInstance(f"{spec.name}-{i}", spec.name, spec.role, cost, self, node=gpu // gpus_per_node,
                                   index=i, slot=gpu % gpus_per_node,
                                   num_blocks=num_blocks, block_size=block_size, max_num_seqs=cap,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching, bulk_decode=bulk_decode)
                gpu += gpus_per_instance
                members.append(inst)
            self.pools[spec.name] = members
            self.instances += members
        self.num_gpus = gpu
        # The router's view, rebuilt only where an instance changed since the last placement:
        # rebuilding every instance's snapshot per arrival was a tenth of a large run.
        self._dirty: set[SimInstance] = set()
        self._cluster_snap = ClusterSnapshot(tuple(PoolSnapshot(name, tuple(i.snapshot() for i in members))
                                                   for name, members in self.pools.items()))
        for inst in self.instances:
            inst.on_touch = self._dirty.add
        self.max_prompt_blocks = num_blocks
        self.records: dict[str, RequestRecord] = {}
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.bytes_moved = 0
        self.num_transfers = 0
        self.num_done = 0
        self.num_promotions = 0
        self.num_local_prefills = 0
        self.num_migrations = 0
        self.num_promotions_skipped = 0
        self.conductor = conductor
        # Best-of-N early consensus: the router's stopping rule, asked after every finished branch.
        self.stop_rule = None if early_stop == "none" else make_rule(early_stop)
        self.num_cancelled_branches = 0
        # The frontend's latencies (cpu kind: distributions fitted from a cluster run), drawn per
        # request: a placed request reaches its engine later; what the engine publishes reaches
        # the client later. None: none (GPU kinds).
        self.frontend = getattr(cost, "frontend", None)
        # ``noise_seed``: another draw of every random part of the cpu kind (latencies, step noise,
        # slow stretches) for the same inputs; 0 is the default's.
        self.noise_seed = noise_seed
        self._latency_rng = random.Random(0 if not noise_seed else f"latency-{noise_seed}")
        # The frontend's latencies' draws per node, correlated over time (the cost's
        # ``latency_rho`` > 0: ``_Persistent``); None: independent (``_latency_rng``).
        self._latent = {} if getattr(cost, "latency_rho", 0.0) else None
        # How a first token's latency is drawn against the noise of the prompt step that published
        # it (``_Noted``, ``_Against``), so that their normal scores correlate the cost's
        # ``first_token_rho``; 0: independent. With ``latency_rho`` the step's draw and the
        # latency's own come from the node's persistent draws, which correlate them that much
        # already: the copula's rho is what adds up to ``first_token_rho`` with it.
        measured = getattr(cost, "first_token_rho", 0.0) if step_noise else 0.0
        shared = cost.latency_rho if self._latent is not None else 0.0
        self._first_token_rho = (math.sin(math.asin(measured / math.hypot(1.0, shared)) - math.atan(shared))
                                 if measured else 0.0)
        self._noise_rng = (random.Random(1 if not noise_seed else f"noise-{noise_seed}")
                           if step_noise and getattr(cost, "step_noise", None) else None)
        # Each engine's slowness per window (``run_scale``): its own generator and the draws so far.
        self._slow = {} if self._noise_rng is not None and getattr(cost, "slow_s", None) else None
        # The machine's own slowness per node per window of MACHINE_WINDOW_S (``machine_at``): the
        # node's standard normal draws so far, from its own generator; None without (the cost's
        # ``machine_sd`` 0, or no step noise).
        self._machine = {} if self._noise_rng is not None and getattr(cost, "machine_sd", 0.0) else None
        self._machine_series = tuple((float(t), float(f)) for t, f in machine)
        if any(not f > 0 for _, f in self._machine_series) or any(
                b[0] <= a[0] for a, b in zip(self._machine_series, self._machine_series[1:])):
            raise ValueError("machine: (from time, factor) pairs in increasing time, factors > 0")
        self._machine_times = [t for t, _ in self._machine_series]
        self.external_load, self._load_now, self._background_now = tuple(external_load), 0.0, 0.0
        # Tokens published by the step just completed: (instance, record, "first_token" | "finish",
        # crowded: a first token whose step also decoded other requests' sequences), given the
        # frontend's latency once the node's engines' next steps are known (``_deliver``); and page
        # sets exported by it: (instance, (target, part, bytes), "export", False), which leave once
        # the exporting engine is between steps (``export_waits_for_step``: the cpu kind's).
        self._publishing: list[tuple[SimInstance, object, str, bool]] = []
        self._exports_wait = bool(getattr(cost, "export_waits_for_step", False))
        # Each wake-up's draw of the cost's ``engine_wake`` (with ``step_noise``): its own generator.
        self._wake_rng = (random.Random("wake" + (f"-{noise_seed}" if noise_seed else ""))
                          if step_noise and getattr(cost, "engine_wake", None) else None)
        # Each hand-off's draw of the cost's ``handoff_noise`` (with ``step_noise``): its own generator.
        self._handoff_rng = (random.Random("handoff" + (f"-{noise_seed}" if noise_seed else ""))
                             if step_noise and getattr(cost, "handoff_noise", None) else None)
        self._handoff_by_state = getattr(cost, "handoff_busy_noise", None) is not None

    # ---- events -----------------------------------------------------------------------------
    def _push(self, t: float, kind: int, obj, version: int = 0) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, obj, version))

    def _wake_at(self, inst: SimInstance, t: float | None) -> None:
        if t is not None:
            inst.version += 1
            self._push(t, _WAKE, inst, inst.version)

    def run(self, horizon: float | None = None) -> "Simulator":
        """Simulate until every request is done, or only up to ``horizon`` seconds (a steady-state
        measurement: requests still running then are judged on what they did by then)."""
        self.horizon = horizon
        if self.cost.shares_cores:
            for t, *load in self.external_load:
                self._push(t, _LOAD, (load[0], load[1] if len(load) > 1 else 0.0))
        if self.conductor is not None and self.conductor.promotion_interval_s:
            self._push(self.conductor.promotion_interval_s, _PROMOTE, None)
        if self.conductor is not None and self.conductor.fit_decode:
            self._push(self.conductor.report_interval_s, _REPORT, None)
        # The loop makes no reference cycles (a 20,000-request Conductor run leaves no cyclic
        # garbage), so the cyclic collector would only rescan the live state as it grows: a sixth
        # of a large run. Reference counting frees everything the loop drops.
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._loop(horizon)
            if self._publishing:
                self._deliver()
        finally:
            if collecting:
                gc.enable()
        for inst in self.instances:
            inst._account_kv(self.now)
        return self

    def _loop(self, horizon: float | None) -> None:
        """Events in time order. Arrivals are not queued: they are read in order from
        ``self.requests`` (sorted by arrival) and go before a queued event of the same time, as
        they would if all were queued first; so the queue holds only what is in flight, not a
        large run's 100,000 arrivals, whose depth every push and pop would pay for."""
        events, arrivals, pop = self._events, self.requests, heapq.heappop
        i, n = 0, len(arrivals)
        while True:
            if self._publishing:
                self._deliver()
            if i < n and (not events or arrivals[i].arrival <= events[0][0]):
                r = arrivals[i]
                if horizon is not None and r.arrival > horizon:
                    self._stop_at(horizon)
                    break
                i += 1
                self.now = t = r.arrival
                self._arrive(r, t)
                continue
            if not events:
                break
            if horizon is not None and events[0][0] > horizon:
                self._stop_at(horizon)
                break
            t, _, kind, obj, version = pop(events)
            self.now = t
            if kind == _WAKE:
                if version == obj.version:
                    was = obj.inflight is not None
                    self._wake_at(obj, obj.wake(t))
                    if self.cost.shares_cores and was != (obj.inflight is not None):
                        self._reprice_node(obj, t)
            elif kind == _LOAD:
                self._load_now, self._background_now = obj
                for inst in self.instances:
                    self._reprice(inst, t)
            elif kind == _SUBMIT:
                inst, req, r = obj
                self._wake_at(inst, inst.submit(req, r.output_lens, -(1 << 40) - r.salt, t))
            elif kind == _RETRY:
                self._place(obj, t)
            elif kind == _PROMOTE:
                self._promote(t)
            elif kind == _REPORT:
                self.conductor.decode_reports(self.policy, self, t)
                if self.num_done < len(self.requests):
                    self._push(t + self.conductor.report_interval_s, _REPORT, None)
            else:
                self._kv_arrived(obj, t)

    def _stop_at(self, horizon: float) -> None:
        """The horizon is reached: each decode run in flight gives the tokens of the steps it has
        completed by then (a step still running gives none), and requests still running get
        their progress recorded (``RequestRecord.tokens_out``)."""
        self.now = horizon
        for inst in self.instances:
            f = inst.inflight
            if f is not None and f.steps > 1:
                done = f.steps_by(horizon)
                if done >= 1:
                    f.steps, f.end = done, f.start + f.run.time(done)
                    inst.inflight = None
                    inst._complete(f, f.end)
            inst.settle()
            for req in inst.scheduler.requests.values():
                rec = self.records[req.request_id]
                rec.tokens_out = max([rec.tokens_out] + [s.num_output_tokens for s in req.seqs])

    def _finished(self, rec: RequestRecord, inst: SimInstance, now: float) -> None:
        """The request's last token is out of ``inst`` at ``now``; the client has it after the
        frontend's latency (``_deliver``)."""
        rec.finish = now
        if self.frontend is not None:
            self._publishing.append((inst, rec, "finish", False))

    def _deliver(self) -> None:
        """The tokens the last event's steps published reach the client: each after a draw of the
        frontend's latency, by whether the node's engines step on all of its cores now that they
        have started their next steps (the publishing engine counts if it stepped again at
        once: a prefill instance going idle frees its core for the frontend), whether the
        publishing engine did (``FrontendLatency.busy``) or else another engine of the node is
        stepping (``FrontendLatency.shared``), a first token by whether its step also decoded
        other requests' sequences (``FrontendLatency.crowded``), and the other processes' work then
        (``FrontendLatency.external_scale``, ``niced``). The page sets they exported leave their
        engine now, or at the end of the step it went on to at once: the export call waits for
        the engine's step loop (``_send``)."""
        for inst, rec, what, crowded in self._publishing:
            if what == "export":
                target, part, nbytes = rec
                start = self.now if inst.inflight is None else inst.step_end(self.now)
                self._push(start + self._transfer_time(inst, target, nbytes), _KV_DONE, (inst, target, part, nbytes))
            else:
                gap = self.frontend.finish if what == "finish" else self.frontend.first_token
                draws = self._latency_draws(inst.node)
                if what == "first_token" and rec.prompt_draw is not None:
                    draws = _Against(draws, rec.prompt_draw, self._first_token_rho)
                late = gap(draws, self._latency_state(inst, crowded), self._load_now,
                           self._background_now) * self.machine_at(inst.node, self.now)[0]
                if what == "finish":
                    rec.finish += late
                else:
                    rec.first_token += late
        self._publishing.clear()

    def wake_delay(self, inst: SimInstance) -> float:
        """How long idle ``inst``'s loop takes to wake up to a request that reached it now: a draw
        of the cost's ``engine_wake`` (its mean without noise), on its node now (``machine_at``)."""
        return self.cost.wake_delay(self._wake_rng) * self.machine_at(inst.node, self.now)[0]

    def _latency_state(self, inst: SimInstance, crowded: bool = False) -> LatencyState:
        """The state the frontend's latency into or out of ``inst`` meets now
        (``FrontendLatency.state``): whether the engines of its node are stepping on all of its
        cores, whether ``inst`` is stepping, whether another engine of its node is; ``crowded``:
        a first token whose step also decoded other requests' sequences."""
        cores = getattr(self.cost, "cores", None)
        stepping, busy = self._stepping(inst.node), inst.inflight is not None
        return self.frontend.state(cores is not None and stepping >= cores, busy, stepping > busy, crowded)

    def step_factor(self, prompt: bool = False, inst: SimInstance | None = None) -> float:
        """How much longer than modelled a step priced alone takes (``step_noise``, of a step with
        prompt tokens ``prompt_noise``; else 1), on ``inst``'s node now (``machine_at``)."""
        if self._noise_rng is None:
            f = 1.0
        else:       # a step with prompt tokens runs slow with the node's frontend (``_latency_draws``)
            together = prompt and inst is not None and self._latent is not None
            draws = self._latency_draws(inst.node) if together else self._noise_rng
            noted = _Noted(draws) if prompt and inst is not None and self._first_token_rho else None
            f = self.cost.noise(noted or draws, prompt)
            if noted is not None:
                inst.prompt_draw = noted.last
        return f * self.machine_at(inst.node, self.now)[0] if inst is not None else f

    def _latency_draws(self, node: int):
        """Where the frontend's latency drawn now on ``node`` takes its uniform draw from: the
        shared generator, or the node's ``_Persistent`` draws when the cost's latencies run slow
        together (``latency_rho``)."""
        if self._latent is None:
            return self._latency_rng
        draws = self._latent.get(node)
        if draws is None:
            draws = self._latent[node] = _Persistent(
                random.Random(f"latent-{node}" + (f"-{self.noise_seed}" if self.noise_seed else "")),
                self._latency_rng, self.cost.latency_rho, self.cost.latency_tau_s, lambda: self.now)
        return draws

    def machine_at(self, node: int, now: float) -> tuple[float, float | None]:
        """(factor, until when): the machine's own slowness on ``node`` in the window of
        MACHINE_WINDOW_S holding ``now`` (``LinearCost.machine``: the node's steps and its
        frontend's latencies take this much longer than priced) and that window's end; (1, None)
        without. The node's standard normal draws are made in window order from its own
        seeded generator, so a window's draw does not depend on when it is asked for. A replayed
        ``machine`` series instead gives its factor at ``now`` and its next change (every node)."""
        if self._machine_series:
            i = bisect_right(self._machine_times, now) - 1
            until = self._machine_times[i + 1] if i + 1 < len(self._machine_times) else None
            return (self._machine_series[i][1] if i >= 0 else 1.0), until
        if self._machine is None:
            return 1.0, None
        w = MACHINE_WINDOW_S
        k = max(0, int(now // w))
        rng, drawn = self._machine.setdefault(
            node, (random.Random(f"machine-{node}" + (f"-{self.noise_seed}" if self.noise_seed else "")), []))
        while len(drawn) <= k:
            drawn.append(rng.gauss(0.0, 1.0))
        return self.cost.machine(drawn[k]), (k + 1) * w

    def run_scale(self, inst: SimInstance, now: float) -> tuple[float, float | None]:
        """(how much longer than modelled ``inst``'s decode steps take now, until when): the
        engine's slowness in the window of ``slow_window_s`` holding ``now``, and that window's
        end (the instance ends its run at the step that crosses it); (1.0, None) without slow
        stretches. The windows' uniform draws are made in window order from the engine's own
        seeded generator, so a window's draw does not depend on when it is asked for; the
        slowness it gives depends on the niced outside work now (``LinearCost.slowness``). Times
        the machine's own slowness on its node (``machine_at``), the run ending by the end of
        whichever window ends first."""
        m, until = self.machine_at(inst.node, now)
        if self._slow is None:
            return m, until
        w = self.cost.slow_window_s
        k = int(now // w)
        entry = self._slow.get(inst)
        if entry is None:
            entry = self._slow[inst] = (self._slow_draws(inst, w), [])
        rng, drawn = entry
        while len(drawn) <= k:
            drawn.append(rng.random())
        end = (k + 1) * w
        return self.cost.slowness(drawn[k], self._background_now) * m, end if until is None else min(end, until)

    def _slow_draws(self, inst: SimInstance, w: float):
        """``inst``'s windows' uniform draws, in window order, from its own seeded generator:
        independent, or persisting from one window to the next (the cost's ``slow_rho``,
        ``_Persistent`` on the windows' count)."""
        seed = f"slow-{inst.instance_id}" + (f"-{self.noise_seed}" if self.noise_seed else "")
        rng = random.Random(seed)
        rho = getattr(self.cost, "slow_rho", 0.0)
        if not rho:
            return rng
        count = itertools.count()
        return _Persistent(random.Random(seed + "-persist"), rng, rho, self.cost.slow_tau_s, lambda: next(count) * w)

    def _stepping(self, node: int) -> int:
        """Engines of ``node`` with a step in flight."""
        return sum(1 for i in self.instances if i.node == node and i.inflight is not None)

    def node_load(self, node: int) -> tuple[int, float, float]:
        """(engines of ``node`` stepping, other processes' work then, of it the niced: a recorded
        run's, in cores), what a step starting there is priced with (``LinearCost.contention``)."""
        return self._stepping(node), self._load_now, self._background_now

    def _reprice_node(self, changed: SimInstance, now: float) -> None:
        """An engine of the node started or stopped stepping: the others' decode runs end at the
        step in progress, and what follows is priced with the new load."""
        for inst in self.instances:
            if inst is not changed and inst.node == changed.node:
                self._reprice(inst, now)

    def _reprice(self, inst: SimInstance, now: float) -> None:
        if inst.inflight is not None:
            self._wake_at(inst, inst._interrupt(now))

    def snapshot(self) -> ClusterSnapshot:
        """The cluster as the frontend's ``ClusterView`` keeps it: a pool none of whose instances
        changed is the same object (its placement index kept), and one where some did gets them
        replaced with ``PoolSnapshot.replacing`` (the index patched at those positions)."""
        if self._dirty:
            changed: dict[str, dict] = {}
            for inst in self._dirty:
                changed.setdefault(inst.pool, {})[inst.index] = inst.snapshot()
            self._dirty.clear()
            self._cluster_snap = ClusterSnapshot(tuple(p.replacing(changed[p.name]) if p.name in changed else p
                                                       for p in self._cluster_snap.pools))
        return self._cluster_snap

    # ---- a request's way through ------------------------------------------------------------
    def _arrive(self, r: SimRequest, now: float) -> None:
        rec = RequestRecord(r, branches_left=r.n)
        self.records[r.request_id] = rec
        if -(-(r.prompt_len + 1) // self.block_size) > self.max_prompt_blocks:
            return self._refuse(rec, "prompt does not fit an instance's KV cache")
        tokens = r.prompt_tokens()
        if self.conductor is not None:
            rec.preq = self.conductor.request(r, tokens)
        else:
            priority = 1 if (self.slo_classes and r.cls != "short") else 0
            rec.preq = PlacementRequest(r.request_id, r.prompt_len, n=r.n, max_tokens=r.max_tokens, priority=priority)
        rec.tokens = tokens
        self._place(rec, now)

    def _place(self, rec: RequestRecord, now: float) -> None:
        r = rec.req
        if self.conductor is not None:
            placement = self.policy.place(rec.preq, self.conductor.snapshot(self), now)
        else:
            placement = self.policy.place(rec.preq, self.snapshot())
        if placement is None:
            if self.conductor is None:
                return self._refuse(rec, "no serving instance")
            return self._push(now + RETRY_S, _RETRY, rec)  # the Conductor says: ask again later
        if not isinstance(placement, Placement):
            return self._refuse(rec, placement.reason)  # a Refusal (admission control)
        rec.placement = placement
        if self.conductor is not None:
            self.conductor.placed(rec, now)
        priority = placement.priority if self.conductor is not None else rec.preq.priority
        tokens = rec.__dict__.pop("tokens")   # the prompt _arrive built (the root sequence's from here)
        first = self._by_id(placement.prefill_instance)
        if placement.mode == LOCAL_PREFILL:
            self.num_local_prefills += 1
        else:       # a decode instance counts branches only (``_branch_gone``)
            first.assigned_requests += 1
        first.touch()
        if placement.mode in (COLOCATED, LOCAL_PREFILL):
            first.assigned_branches += r.n
            for b in range(r.n):
                rec.decode_instances[b] = first
        else:
            for a in placement.decode:
                inst = self._by_id(a.instance_id)
                inst.assigned_branches += len(a.branch_indices)
                inst.touch()
                for b in a.branch_indices:
                    rec.decode_instances[b] = inst
        params = SamplingParams(n=r.n, max_tokens=r.max_tokens, seed=r.salt)
        root = Sequence(first.scheduler.new_seq_id(), 0, tokens, len(tokens), params.seed)
        req = Request(r.request_id, tokens, params, priority, 0, [root], forked=r.n == 1)
        if self.frontend is not None:
            return self._push(now + self.machine_at(first.node, now)[0]
                              * self.frontend.dispatch(self._latency_draws(first.node), self._latency_state(first),
                                                       r.prompt_len, self._load_now, self._background_now),
                              _SUBMIT, (first, req, r))
        self._wake_at(first, first.submit(req, r.output_lens, -(1 << 40) - r.salt, now))

    def _by_id(self, instance_id: str) -> SimInstance:
        pool = instance_id.rsplit("-", 1)
        return self.pools[pool[0]][int(pool[1])]

    def _refuse(self, rec: RequestRecord, why: str) -> None:
        rec.refused = why
        self._done(rec)

    def on_first_token(self, inst: SimInstance, req: Request, seq: Sequence, now: float, beside: bool = False) -> None:
        """``seq`` of ``req`` sampled its first token in ``inst``'s step that ended ``now``;
        ``beside``: that step also decoded other requests' sequences."""
        rec = self.records[req.request_id]
        if rec.first_token is None:
            if self.conductor is not None:
                self.conductor.prefilled(self.policy, inst, rec, now)
            rec.first_token = now
            if self._first_token_rho:
                rec.prompt_draw = inst.prompt_draw
            if self.frontend is not None:
                self._publishing.append((inst, rec, "first_token", beside))

    def on_seq_finished(self, inst: SimInstance, req: Request, seq: Sequence, now: float, *,
                        truncated: bool = False) -> None:
        rec = self.records[req.request_id]
        rec.truncated |= truncated
        rec.tokens_out = max(rec.tokens_out, seq.num_output_tokens)
        if r_answers := rec.req.answers:
            rec.finished_branches.append(Finished(seq.index, None if truncated else r_answers[seq.index]))
            if (self.stop_rule is not None and not rec.decided and rec.branches_left > 1
                    and self.stop_rule.should_stop(Tally(rec.req.n, tuple(rec.finished_branches)))):
                self._decide(rec, now, inst)
        if self.conductor is not None and not truncated:
            self.conductor.finished(self.policy, rec, seq.index, seq.num_output_tokens, now)
        self._branch_gone(inst, req, seq, rec, now)

    def on_seq_cancelled(self, inst: SimInstance, req: Request, seq: Sequence, now: float) -> None:
        rec = self.records[req.request_id]
        self.num_cancelled_branches += 1
        rec.tokens_out = max(rec.tokens_out, seq.num_output_tokens)
        rec.tokens_saved += rec.req.output_lens[seq.index] - seq.num_output_tokens
        self._branch_gone(inst, req, seq, rec, now)

    def _decide(self, rec: RequestRecord, now: float, inst: SimInstance) -> None:
        """The vote is decided (at ``inst``'s finished branch): the answer goes out now, the
        other branches are cancelled."""
        rec.decided = True
        self._finished(rec, inst, now)
        self._done(rec)
        for inst in dict.fromkeys(rec.decode_instances.values()):  # in branch order: deterministic
            if rec.req.request_id in inst.scheduler.requests:
                self._wake_at(inst, inst.request_cancel(rec.req.request_id, now))

    def _branch_gone(self, inst: SimInstance, req: Request, seq: Sequence, rec: RequestRecord, now: float) -> None:
        rec.branches_left -= 1
        # The frontend counts a branch against the instance it was placed on to decode.
        placed = rec.decode_instances[seq.index]
        placed.assigned_branches -= 1
        placed.touch()
        if req.is_finished and req.request_id in inst.targets:  # once per request and instance
            inst.forget(req.request_id)
            if inst.role != "decode":
                inst.assigned_requests -= 1
        if rec.branches_left == 0 and rec.parts_left == 0 and not rec.decided:
            self._finished(rec, inst, now)
            self._done(rec)

    def on_prefilled(self, inst: SimInstance, req: Request, now: float) -> None:
        """Prefill done: export the page set and send each decode instance its branches."""
        rec = self.records[req.request_id]
        inst.scheduler.detach(req)
        req.status = RequestStatus.EXPORTED
        whole = export(req, self.block_size)
        by_target: dict[SimInstance, list] = {}
        for b in whole.branches:
            by_target.setdefault(rec.decode_instances[b.index], []).append(b)
        kv_bytes = self.block_size * self.cost.model.kv_bytes_per_token
        rec.parts_left += len(by_target)
        if by_target:
            rec.parts_from[inst] = rec.parts_from.get(inst, 0) + len(by_target)
        for target, branches in by_target.items():
            part = ExportedRequest(whole.request_id, whole.prompt_token_ids, whole.params, whole.priority,
                                   whole.block_ids, tuple(branches))
            nbytes = len({i for b in branches for i in b.block_indices}) * kv_bytes
            self.bytes_moved += nbytes
            self.num_transfers += 1
            self._send(inst, target, part, nbytes, now)
        if not by_target:  # every branch finished with its first token
            self._release(inst, req.request_id, rec, now)

    def _kv_arrived(self, item, now: float) -> None:
        src, target, part, nbytes = item
        lens, token = src.targets[part.request_id]
        rec = self.records[part.request_id]

        def committed(inst, req, t):
            if rec.decided:  # decided while this page set travelled: its branches are cancelled
                self._wake_at(inst, inst.request_cancel(part.request_id, t))
            rec.parts_left -= 1
            rec.parts_from[src] -= 1
            if rec.parts_from[src] == 0:  # every page set from src has landed: src frees its copy
                del rec.parts_from[src]
                if src.role == "decode":
                    self.num_migrations += 1
                    src.release(part.request_id)
                    self._wake_idle(src, t)
                else:
                    self._release(src, part.request_id, rec, t)

        self._wake_at(target, target.submit_import(part, lens, token, committed, now, nbytes))

    # ---- promotion (the Conductor's short -> long moves) --------------------------------------
    def _promote(self, now: float) -> None:
        self.conductor.running(self, self.policy, (SHORT_DECODE, LONG_DECODE), now)
        progress = self.conductor.progress(self.policy, self, SHORT_DECODE)
        if progress:
            moving = set()
            for p in self.policy.promotions(self.snapshot(), progress):
                src, dst = self._by_id(p.source), self._by_id(p.target)
                # An engine holds one part of a request: a Best-of-N request with branches on the
                # target already, or with a page set in flight, is not moved (the cluster's parts
                # would allow it; counted as a promotion not executed).
                if (p.request_id in moving or p.request_id not in src.scheduler.requests
                        or self.records[p.request_id].parts_left or p.request_id in dst.scheduler.requests
                        or any(e.request_id == p.request_id for e, _ in dst.pending_imports)
                        or any(e.request_id == p.request_id for e, _, _ in dst._arriving)):
                    self.num_promotions_skipped += 1
                    continue
                moving.add(p.request_id)
                self.num_promotions += 1
                self._wake_at(src, src.request_migration(p.request_id, dst, now))
        if self.num_done < len(self.requests):
            self._push(now + self.conductor.promotion_interval_s, _PROMOTE, None)

    def on_migrating(self, src: SimInstance, req: Request, target: SimInstance, now: float) -> None:
        """``src`` stopped ``req`` for a move: its unfinished branches (and their KV) go to ``target``."""
        rec = self.records[req.request_id]
        part = export(req, self.block_size)
        for b in part.branches:
            rec.decode_instances[b.index].assigned_branches -= 1
            rec.decode_instances[b.index].touch()
            rec.decode_instances[b.index] = target
            target.assigned_branches += 1
        target.touch()
        nbytes = len(part.block_ids) * self.block_size * self.cost.model.kv_bytes_per_token
        self.bytes_moved += nbytes
        self.num_transfers += 1
        rec.parts_left += 1
        rec.parts_from[src] = rec.parts_from.get(src, 0) + 1
        self._send(src, target, part, nbytes, now)

    def _send(self, src: SimInstance, target: SimInstance, part: ExportedRequest, nbytes: int, now: float) -> None:
        """``part`` (``nbytes`` of KV) leaves ``src`` for ``target``: it lands after the cost's
        ``transfer_time``, counted from now or, where exports wait for the engine's step loop
        (``export_waits_for_step``), from when ``src`` is next between steps (``_deliver``)."""
        if self._exports_wait:
            self._publishing.append((src, (target, part, nbytes), "export", False))
        else:
            self._push(now + self._transfer_time(src, target, nbytes), _KV_DONE, (src, target, part, nbytes))

    def _transfer_time(self, src: SimInstance, target: SimInstance, nbytes: int) -> float:
        """A hand-off's time (the cost's; a draw of its spread where there is one and noise was
        asked for), by whether ``target`` is stepping now where the cost tells the two apart (the
        cpu kind's ``handoff_busy_noise``: the import waits for the engine's step loop)."""
        same = target.node == src.node
        if self._handoff_rng is None and not self._handoff_by_state:    # (the GPU kinds' take neither)
            return self.cost.transfer_time(nbytes, same_node=same)
        return self.cost.transfer_time(nbytes, same_node=same, rng=self._handoff_rng, busy=target.inflight is not None)

    def _wake_idle(self, inst: SimInstance, now: float) -> None:
        """Blocks came back to an idle instance: a queue it left waiting for room may fit now (an
        engine's loop would schedule again; a simulated instance sleeps until woken)."""
        s = inst.scheduler
        if inst.inflight is None and (s.waiting or s.swapped):
            self._wake_at(inst, now)

    def _release(self, src: SimInstance, request_id: str, rec: RequestRecord, now: float) -> None:
        src.release(request_id)
        self._wake_idle(src, now)
        src.assigned_requests -= 1
        if rec.branches_left == 0 and rec.finish is None and not rec.decided:
            self._finished(rec, src, now)
            self._done(rec)

    def _done(self, rec: RequestRecord) -> None:
        self.num_done += 1
        if self.progress is not None:
            self.progress(self.num_done, len(self.requests), self.now)

    def check_integrity(self) -> None:
        for inst in self.instances:
            inst.check_integrity()
