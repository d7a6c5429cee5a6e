"""Building a simulation from names: GPU kind, model, deployment (policy), workload, SLOs."""
from __future__ import annotations

from dataclasses import dataclass, replace

from thinkserve.router import LeastLoadedPolicy
from thinkserve.router.snapshot import LONG_DECODE, MIXED, PREFILL, SHORT_DECODE

from .cost import CPU_FIT_PATH, LinearCost, RooflineCost
from .hardware import GPU_KINDS, MODELS
from .metrics import Slo
from .simulator import PoolSpec, Simulator
from .workload import LONG, SHORT, ReasoningMix, load_trace

POLICIES = ("colocated", "pd", "conductor")
GPU_CHOICES = tuple(GPU_KINDS) + ("cpu",)


@dataclass(frozen=True)
class Deployment:
    """Which policy, and the switches of the three-pool one."""

    policy: str
    prefill_share: float = 0.25          # pd and conductor: share of instances that prefill
    long_share: float = 0.5              # conductor: share of the decode instances in the long pool
    long_threshold: int = 2048           # router: predicted lengths above it go to the long pool
    prediction: bool = True              # False: the router sees only the model's length cap
    learn_lengths: bool = True           # conductor: the predictor learns online (False: keeps its start)
    slo_classes: bool = True             # False: one priority class (FCFS), as colocated
    promotion: bool = True               # conductor: short -> long moves
    router: str = "conductor"            # conductor policy: "conductor" or "least-loaded"
    early_stop: str = "none"             # conductor: Best-of-N stopping rule (router.consensus RULES)
    prefix_affinity: bool = True         # conductor: prompts' block hashes + the prefix index
    fit_prefill: bool = True             # conductor: refit the TTFT cost model from measured prefills
    conditional_disagg: bool = False     # conductor: a short_decode instance may prefill its request itself
    max_promotions: int | None = None    # conductor: promotions per round, at least (None: ConductorConfig's, 8)
    promotions_per_long_instance: float | None = None   # conductor: and per long_decode instance (None: 0.5)

    def pools(self, instances: int) -> list[PoolSpec]:
        if self.policy == "colocated":
            return [PoolSpec(MIXED, "mixed", instances)]
        if instances < 2 or (self.policy == "conductor" and instances < 3):
            raise ValueError(f"--policy {self.policy} needs at least {2 if self.policy == 'pd' else 3} instances, "
                             f"got {instances}")
        p = min(instances - (1 if self.policy == "pd" else 2), max(1, round(instances * self.prefill_share)))
        if self.policy == "pd":
            return [PoolSpec(PREFILL, "prefill", p), PoolSpec(SHORT_DECODE, "decode", instances - p)]
        d = instances - p
        lng = min(d - 1, max(1, round(d * self.long_share)))
        return [PoolSpec(PREFILL, "prefill", p), PoolSpec(SHORT_DECODE, "decode", d - lng),
                PoolSpec(LONG_DECODE, "decode", lng)]


def make_cost(gpu: str, model: str, cpu_fit: str | None = None):
    if model not in MODELS:
        raise ValueError(f"--model must be one of {sorted(MODELS)}, got {model!r}")
    shape = MODELS[model]
    if gpu == "cpu":
        return LinearCost.from_fit(shape, cpu_fit or CPU_FIT_PATH)
    if cpu_fit:
        raise ValueError(f"--cpu-fit is for --gpu cpu, not --gpu {gpu}")
    if gpu not in GPU_KINDS:
        raise ValueError(f"--gpu must be one of {GPU_CHOICES}, got {gpu!r}")
    return RooflineCost(GPU_KINDS[gpu], shape)


def make_workload(workload: str, *, rate: float | None, requests: int, seed: int, max_model_len: int,
                  mix: ReasoningMix | None = None):
    if workload == "reasoning":
        if rate is None:
            raise ValueError("--rate is required with --workload reasoning")
        return (mix or ReasoningMix()).generate(rate, requests, seed, max_model_len=max_model_len)
    return load_trace(workload, requests, rate, max_model_len=max_model_len)


def build(requests, dep: Deployment, cost, gpus: int, *, block_size: int = 16, max_num_seqs: int = 256,
          max_num_batched_tokens: int = 8192, bulk_decode: bool = True, progress=None, slo: Slo | None = None,
          prefix_caching: bool | None = None, external_load=(), length_predictor: dict | None = None,
          step_noise: bool = False, pool_max_num_seqs: dict[str, int] | None = None, noise_seed: int = 0,
          machine=()) -> Simulator:
    """``prefix_caching`` None: on when some prompts can share a first block (a trace's
    ``hash_ids``, or topic tokens filling a small block). Otherwise the cache could never hit and
    would only cost the hashing of every block (a test checks the results are equal either way).
    ``length_predictor``: the Conductor's predictor starts from this fitted state
    (``LengthPredictor.state()``, e.g. ``fit_length_predictor`` on a warm-up trace), as a
    deployment does from its ``router.length_predictor`` file; None: it starts uninformed (cold).
    ``pool_max_num_seqs``: pool name -> batch cap of that pool's engines (the others take
    ``max_num_seqs``), as the cluster's per-pool engine config. ``noise_seed``: another draw of
    the cpu kind's random parts (``Simulator``); ``machine``: the machine's speed during a replayed
    run (``Simulator``)."""
    if prefix_caching is None:
        prefix_caching = any(r.may_share_prefix(block_size) for r in requests)
    instances = gpus // cost.num_gpus()
    if instances < 1:
        raise ValueError(f"--gpus {gpus} is fewer than the {cost.num_gpus()} GPUs one instance of "
                         f"{cost.model.name} spans")
    driver = None
    if dep.policy == "conductor" and dep.router == "conductor":
        from thinkserve.router.conductor import Conductor

        from .conductor_driver import ConductorDriver, conductor_config
        slo = slo or default_slo("cpu" if isinstance(cost, LinearCost) else "gpu")
        config = conductor_config(cost, slo, dep.long_threshold, dep.conditional_disagg, dep.max_promotions,
                                  dep.promotions_per_long_instance)
        policy = Conductor(config)
        if length_predictor is not None:
            policy.predictor.load_state(length_predictor)
        driver = ConductorDriver(prediction=dep.prediction, learn=dep.learn_lengths, slo_classes=dep.slo_classes,
                                 promotion_interval_s=0.5 if dep.promotion else 0.0, config=config,
                                 prefix_affinity=dep.prefix_affinity and prefix_caching, block_size=block_size,
                                 fit_prefill=dep.fit_prefill)
        return Simulator(requests, dep.pools(instances), policy, cost, block_size=block_size,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                         enable_prefix_caching=prefix_caching, bulk_decode=bulk_decode, progress=progress,
                         conductor=driver, early_stop=dep.early_stop, external_load=external_load,
                         step_noise=step_noise, pool_max_num_seqs=pool_max_num_seqs, noise_seed=noise_seed,
                         machine=machine)
    policy = LeastLoadedPolicy(long_threshold=dep.long_threshold)
    if not dep.prediction:
        cap = cost.model.max_model_len
        requests = [_without_length_hint(r, cap) for r in requests]
    return Simulator(requests, dep.pools(instances), policy, cost, block_size=block_size,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                     enable_prefix_caching=prefix_caching,
                     slo_classes=dep.slo_classes and dep.policy != "colocated", bulk_decode=bulk_decode,
                     progress=progress, early_stop=dep.early_stop if dep.policy == "conductor" else "none",
                     external_load=external_load, step_noise=step_noise, pool_max_num_seqs=pool_max_num_seqs,
                     noise_seed=noise_seed, machine=machine)


def parse_pool_caps(items: list[str] | None) -> dict[str, int]:
    """``POOL=N`` items (``--pool-max-num-seqs short_decode=1024 long_decode=256``) as a pool
    name -> batch cap mapping; ValueError on a malformed item or an unknown pool name."""
    caps: dict[str, int] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or name not in (PREFILL, SHORT_DECODE, LONG_DECODE, MIXED) or not value.strip().isdigit():
            raise ValueError(f"expected POOL=N with POOL one of {PREFILL}, {SHORT_DECODE}, {LONG_DECODE}, {MIXED} "
                             f"and N a positive integer, got {item!r}")
        caps[name] = int(value)
        if caps[name] < 1:
            raise ValueError(f"the batch cap of {name} must be >= 1, got {item!r}")
    return caps


WARM_UP_SEED_OFFSET = 1_000_003   # a warm-up trace's seed: the study's seed plus this
WARM_UP_SALT = 1 << 40            # and its prompts' salts


def warm_up_workload(workload: str, *, rate: float | None, requests: int, skip: int, seed: int,
                     max_model_len: int, mix: ReasoningMix | None = None):
    """Requests to fit a starting length predictor on, never the simulated ones: the reasoning
    mix from the same generator with seed ``seed + WARM_UP_SEED_OFFSET``; a trace's ``requests``
    after the ``skip`` that are replayed."""
    if requests < 1:
        raise ValueError(f"warm-up requests must be >= 1, got {requests}")
    if workload == "reasoning":
        # Salts moved past any simulated request's: no warm-up prompt equals a simulated one.
        return [replace(r, request_id=f"warm-{r.request_id}", salt=r.salt + WARM_UP_SALT)
                for r in make_workload(workload, rate=rate or 1.0, requests=requests,
                                       seed=seed + WARM_UP_SEED_OFFSET, max_model_len=max_model_len, mix=mix)]
    out = load_trace(workload, skip + requests, rate, max_model_len=max_model_len)[skip:]
    if not out:
        raise ValueError(f"the trace {workload} has no requests after the {skip} replayed to warm up on")
    return out


def _without_length_hint(r, cap: int):
    return replace(r, max_tokens=cap)


def default_slo(gpu: str, ttft: tuple[float, float] | None = None, tpot: tuple[float, float] | None = None) -> Slo:
    """Short requests: 1 s to the first token, 50 ms per token; long chains: 5 s and 80 ms
    (on the cpu kind, tiny-reasoner: 0.5 s / 2 s and 20 ms / 40 ms)."""
    if gpu == "cpu":
        base_ttft, base_tpot = (0.5, 2.0), (0.02, 0.04)
    else:
        base_ttft, base_tpot = (1.0, 5.0), (0.05, 0.08)
    t, p = ttft or base_ttft, tpot or base_tpot
    return Slo({SHORT: t[0], LONG: t[1]}, {SHORT: p[0], LONG: p[1]})
