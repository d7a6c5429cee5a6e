"""The cluster configuration: one YAML file, validated where the user hands it over.

    model: tiny-reasoner
    engine: {block_size: 16, num_device_blocks: 256}      # defaults for every pool
    pools:
      prefill:      {replicas: 1, num_cpus: 1}
      short_decode: {replicas: 1, num_cpus: 1}
      long_decode:  {replicas: 1, num_cpus: 1, engine: {num_device_blocks: 1024}}
      mixed:        {replicas: 0}
    frontend: {host: 127.0.0.1, port: 50051, http_port: 8000}   # + admin_port, tls, auth (below)
    kv_transport: auto                                    # auto | tcp | shm | collective
    limits: {max_queued_requests: 256, max_message_bytes: 4194304}
    ray: {loopback_only: true, token_auth: true, include_dashboard: false}   # a Ray thinkserve starts

Every error names the offending field as a dotted path (``pools.prefill.replicas: ...``).
Pydantic stays at this boundary; the rest of the cluster reads the frozen ``ClusterConfig``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from thinkserve.router.snapshot import POOL_NAMES, POOL_ROLES
from thinkserve.workers.config import EngineConfig


class ConfigError(ValueError):
    """A cluster config that cannot be used; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineSettings(_Strict):
    """Engine knobs (``thinkserve.workers.config.EngineConfig`` minus model and role, which the
    cluster sets). Unset fields keep the engine's defaults."""

    device: str | None = None
    dtype: str | None = None
    block_size: int | None = Field(None, description="tokens per KV block; equal in every pool")
    num_device_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    num_host_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None
    preemption_mode: str | None = None
    seed: int | None = None
    enforce_eager: bool | None = Field(None, description="CUDA engines: no CUDA graphs for decode steps")

    def merged(self, override: "EngineSettings | None") -> dict[str, Any]:
        base = self.model_dump(exclude_none=True)
        if override is not None:
            base.update(override.model_dump(exclude_none=True))
        return base


class PoolConfig(_Strict):
    replicas: int = Field(1, ge=0, le=64, description="instances started by `thinkserve up`")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per instance")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per instance")
    nice: int = Field(0, ge=0, le=19, description="CPU engines: raise the niceness of this pool's engine "
                                                   "threads, so that where pools share a node's cores a "
                                                   "throughput pool (long_decode) yields them to latency-critical "
                                                   "ones (prefill, short_decode); GPU engines need not")
    cpus: list[list[int]] | None = Field(
        None, description="CPU engines: the cores this pool's engine threads run on, one core set per entry "
                          "([[0], [1]]: one instance on core 0, the next on core 1); each new instance takes "
                          "the set the fewest of the pool's instances hold (Linux sched_setaffinity, like "
                          "vLLM's VLLM_CPU_OMP_THREADS_BIND); default: any core")
    engine: EngineSettings | None = Field(None, description="overrides of the top-level engine settings")

    @field_validator("cpus")
    @classmethod
    def _check_cpus(cls, cpus: list[list[int]] | None) -> list[list[int]] | None:
        if cpus is not None and not cpus:
            raise ValueError("empty: leave it out to run on any core")
        for i, cores in enumerate(cpus or ()):
            if not cores:
                raise ValueError(f"entry {i} is empty: a core set names at least one core")
            if min(cores) < 0 or len(set(cores)) != len(cores):
                raise ValueError(f"entry {i} {cores}: core ids are distinct and >= 0")
        return cpus


class TLSConfig(_Strict):
    """Server certificate for gRPC and HTTP (PEM files, read on the frontend's node)."""

    cert_file: str = Field(description="PEM certificate chain")
    key_file: str = Field(description="PEM private key")


class AuthConfig(_Strict):
    """A bearer token. Usually left out of the file: `thinkserve up` takes it from the environment
    variable THINKSERVE_API_TOKEN, and the CLI sends it from the same variable."""

    token: SecretStr | None = Field(None, description="bearer token; when set, Admin requires it")
    inference: bool = Field(False, description="require the token on Inference and the HTTP /v1 API too")


class FrontendConfig(_Strict):
    host: str = Field("127.0.0.1", description="gRPC and HTTP bind address (loopback unless told otherwise)")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    http_port: int | None = Field(8000, ge=0, le=65535,
                                  description="OpenAI-compatible HTTP API and /metrics; 0 picks a free one, null turns it off")
    admin_port: int | None = Field(None, ge=0, le=65535,
                                   description="serve the Admin service on its own port (0 picks); null: beside Inference")
    admin_host: str | None = Field(None, description="bind address of that Admin port (e.g. 127.0.0.1 while host "
                                                     "is 0.0.0.0); null: host")
    tls: TLSConfig | None = Field(None, description="TLS for gRPC and HTTP; null: plaintext")
    auth: AuthConfig = AuthConfig()
    num_cpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict,
                                        description="custom Ray resources, e.g. {frontend: 1} to pin it to the head node")
    stream_interval_ms: float = Field(0.0, ge=0, le=1000,
                                      description="after a streamed message, tokens arriving within this interval "
                                                  "go out together in the next one (the first token never waits; "
                                                  "a final response waits at most this long); 0: every engine "
                                                  "step's tokens as they come. Long reasoning streams cost the "
                                                  "frontend and client per message, not per token. Instances "
                                                  "that only decode (never a first token) are polled at most "
                                                  "this often too")


class LimitsConfig(_Strict):
    max_queued_requests: int = Field(256, ge=1, description="requests held (running or waiting); beyond: RESOURCE_EXHAUSTED")
    max_message_bytes: int = Field(4 * 2**20, ge=1024, description="largest gRPC message accepted")
    max_prompt_tokens: int = Field(8192, ge=1)
    max_prompt_bytes: int = Field(128 * 1024, ge=1,
                                  description="largest text prompt in UTF-8 bytes, checked before tokenizing "
                                              "(a token rarely spans 16 bytes: 16 x max_prompt_tokens refuses "
                                              "nothing the token limit would admit)")
    max_tokens: int = Field(32768, ge=1, description="largest max_tokens a request may ask for")
    max_n: int = Field(16, ge=1, description="largest number of Best-of-N branches")
    max_request_id_len: int = Field(128, ge=8)


class SLOClassConfig(_Strict):
    ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token target; null: none")
    tpot_ms: float | None = Field(None, gt=0, description="time-per-output-token target; null: none")
    admission: bool = Field(False, description="refuse at once (RESOURCE_EXHAUSTED) when a target cannot be met")


class ReasoningEffortConfig(_Strict):
    low: int | None = Field(256, ge=0, description="thinking budget (tokens inside <think>); null: unlimited")
    medium: int | None = Field(1024, ge=0)
    high: int | None = Field(None, ge=0)


class RouterConfig(_Strict):
    policy: Literal["auto", "conductor", "least_loaded"] = Field(
        "auto", description="auto: the Conductor when prefill and decode pools have replicas, else least_loaded")
    long_threshold: int = Field(1024, ge=1, description="predicted output tokens above this decode in long_decode")
    answer_margin: int = Field(64, ge=0)
    long_probability: float = Field(0.5, ge=0, lt=1, description="conductor: long_decode when P(len > long_threshold) > this")
    promotion_margin: float = Field(1.5, ge=1, description="conductor: promote once tokens > margin x predicted quantile")
    promotion_quantile: float = Field(0.9, gt=0, le=1)
    promotion_interval_s: float = Field(0.1, gt=0, description="conductor: how often decoding branches are checked")
    max_promotions: int = Field(8, ge=0, description="conductor: branches promoted per check, at least")
    promotions_per_long_instance: float = Field(0.5, ge=0, description="conductor: and per serving long_decode "
                                                "instance above that (rounded up): the cap grows with the long pool")
    predictor_steps_per_s: float = Field(1.0, gt=0, description="conductor: the length predictor learns about this "
                                         "many full SGD steps per second, shared by the branches finishing in it "
                                         "(as fast per second at any arrival rate)")
    hidden_state_interval: int = Field(64, ge=0, description="conductor: decode engines return a hidden state every "
                                                               "k tokens to refine the prediction (0: prefill only)")
    prefill_s_per_token: float = Field(2e-4, gt=0, description="conductor: TTFT cost model, prefill seconds per token")
    length_predictor: str = Field(
        "auto", description="conductor: the length predictor's starting state (JSON, LengthPredictor.state). "
                            "auto: the model directory's length_predictor.json when it has one (the shipped "
                            "tiny-reasoner does; bench/bench_predictor.py --fit writes one); none: start "
                            "uninformed (requests decode in short_decode until cold_start_requests finished); "
                            "else a file path")
    cold_start_requests: int = Field(16, ge=0, description="conductor: finished requests an uninformed predictor "
                                                            "needs before it may send a request to long_decode")
    prefix_affinity: bool = Field(True, description="conductor: weigh the prefix-cache hits instances and node "
                                                    "stores report when placing a prefill (off: least queued)")
    conditional_disagg: bool = Field(False, description="conductor: conditional disaggregation (as in NVIDIA Dynamo): "
                                                       "a short_decode request may prefill on its decode instance when "
                                                       "that is estimated faster than the prefill pool plus the hand-off")
    max_local_prefill_length: int = Field(512, ge=0, description="conductor: prompts longer than this always prefill "
                                                                  "in the prefill pool")
    local_max_long_probability: float = Field(0.1, ge=0, le=1, description="conductor: only a request with "
                                              "P(len > long_threshold) at most this may prefill on its decode "
                                              "instance (it forgoes the re-prediction at hand-off)")
    spill_long_max_probability: float = Field(0.5, ge=0, le=1, description="conductor: when every long_decode "
                                              "batch is full, a request predicted long spills to a free "
                                              "short_decode slot only if P(len > long_threshold) is at most this "
                                              "(a full short_decode spills to long_decode always)")
    interactive: SLOClassConfig = SLOClassConfig(ttft_ms=1000, tpot_ms=100, admission=True)
    standard: SLOClassConfig = SLOClassConfig(ttft_ms=10000, tpot_ms=250)
    batch: SLOClassConfig = SLOClassConfig()
    reasoning_effort_budgets: ReasoningEffortConfig = ReasoningEffortConfig()
    early_stop: Literal["none", "unbeatable", "adaptive", "dirichlet", "esc"] = Field(
        "none", description="Best-of-N early consensus when a request does not choose one (router/consensus.py)")
    consensus_wave: int = Field(4, ge=1, description="Best-of-N branches running at once under an early-stop rule")
    answer_extractor: Literal["answer", "boxed", "last_number"] = Field(
        "answer", description="how a branch's answer is read for the vote: 'answer: N', \\boxed{...}, last number")


class HealthConfig(_Strict):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(10.0, gt=0)
    replace_dead: bool = Field(True, description="start a new instance when one dies")


class StoreConfig(_Strict):
    capacity_bytes: int = Field(256 * 2**20, ge=0,
                                description="CPU KV store size per node (one store per Ray node); 0 disables the stores")
    swap_preemption: bool = Field(True, description="decode and mixed instances swap the KV of requests they "
                                                     "preempt under KV pressure into their node's store (the engine's "
                                                     "preemption_mode must be swap, its default); off: they recompute")


class RayConfig(_Strict):
    """How thinkserve starts Ray when no cluster is given (``thinkserve up`` with nothing to join,
    the demo). A Ray cluster thinkserve joins is configured by whoever started it."""

    loopback_only: bool = Field(True, description="start Ray in its single-machine mode: node IP 127.0.0.1, so the "
                                                  "GCS, raylet, object manager, every worker and Ray's agents listen "
                                                  "on 127.0.0.1 only, and no other node can join. false: Ray listens "
                                                  "on every interface (a head other nodes join; secure it: README)")
    token_auth: bool = Field(True, description="Ray's token authentication (RAY_AUTH_MODE=token); the token is "
                                               "~/.ray/auth_token, generated if missing")
    include_dashboard: bool = Field(False, description="start Ray's dashboard")
    dashboard_host: str = Field("127.0.0.1", description="the dashboard's bind address (when included)")
    worker_niceness: int = Field(0, ge=0, le=19, description="how much nicer than the process that starts Ray its "
                                                             "workers run (the engines, the frontend). Ray's own "
                                                             "default is 15, which makes the server yield the cores "
                                                             "to Ray's daemons and to any other process at default "
                                                             "priority, and caps pools.<name>.nice at 4 more")
class RebalanceConfig(_Strict):
    enabled: bool = Field(True, description="migrate decoding branches from a pool's busiest instance to its "
                                            "freest while their KV use differs by more than kv_margin")
    interval_s: float = Field(1.0, gt=0, description="how often the frontend checks the pools")
    kv_margin: float = Field(0.25, gt=0, le=1, description="KV-use difference (fraction of a cache) that triggers a move")
    max_moves: int = Field(2, ge=1, le=64, description="parts moved per pool per check")


class PoolsConfig(_Strict):
    prefill: PoolConfig = PoolConfig()
    short_decode: PoolConfig = PoolConfig()
    long_decode: PoolConfig = PoolConfig()
    mixed: PoolConfig = PoolConfig(replicas=0)

    def get(self, name: str) -> PoolConfig:
        return getattr(self, name)


class ClusterConfig(_Strict):
    model: str = Field("tiny-reasoner", description="'tiny-reasoner' or a Hugging Face model directory")
    namespace: str = Field("thinkserve", description="Ray namespace of the deployment's named actors")
    engine: EngineSettings = EngineSettings()
    pools: PoolsConfig = PoolsConfig()
    frontend: FrontendConfig = FrontendConfig()
    limits: LimitsConfig = LimitsConfig()
    router: RouterConfig = RouterConfig()
    health: HealthConfig = HealthConfig()
    store: StoreConfig = StoreConfig()
    ray: RayConfig = RayConfig()
    rebalance: RebalanceConfig = RebalanceConfig()
    kv_transport: Literal["auto", "tcp", "shm", "collective"] = Field(
        "auto", description="how KV pages move between two instances: auto = shared memory when both are on "
                            "one Ray node, TCP otherwise; tcp = always TCP; shm = always shared memory "
                            "(single-node deployments only: a receiver on another node refuses the ring); "
                            "collective = a torch.distributed pair group per sender/receiver pair (gloo on "
                            "CPU, NCCL when the engines run on GPUs)")

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        p = self.pools
        disaggregated = p.prefill.replicas > 0 and (p.short_decode.replicas + p.long_decode.replicas) > 0
        if not disaggregated and p.mixed.replicas == 0:
            raise ValueError("pools: nothing can serve; give prefill and a decode pool replicas, or mixed")
        try:
            EngineConfig(model=self.model, **self.engine.merged(None))
        except ValueError as e:
            raise ValueError(f"engine: {e}") from None
        sizes = {self.engine_config(name).block_size for name in POOL_NAMES}
        if len(sizes) > 1:
            raise ValueError(f"engine.block_size: pools must share one block size (KV moves between them), got {sorted(sizes)}")
        return self

    def engine_config(self, pool: str) -> EngineConfig:
        """The engine config of an instance in ``pool`` (raises ``ValueError`` naming the field)."""
        fields = self.engine.merged(self.pools.get(pool).engine)
        if self.uses_conductor() and "hidden_state_interval" not in fields:
            # The Conductor's probe: the prefill's hidden state with its result, decode's every k tokens.
            fields["hidden_state_interval"] = 0 if POOL_ROLES[pool] == "prefill" else self.router.hidden_state_interval
        try:
            return EngineConfig(model=self.model, role=POOL_ROLES[pool], **fields)
        except ValueError as e:
            raise ValueError(f"pools.{pool}.engine: {e}") from None

    def uses_conductor(self) -> bool:
        """``router.policy``, with ``auto`` = the Conductor when prefill and decode pools have replicas."""
        if self.router.policy != "auto":
            return self.router.policy == "conductor"
        return self.pools.prefill.replicas > 0 and (self.pools.short_decode.replicas + self.pools.long_decode.replicas) > 0

    def efforts(self):
        """``router.reasoning_effort_budgets`` as the router's ``ReasoningEfforts`` (effort -> thinking budget)."""
        from thinkserve.router.conductor import ReasoningEfforts
        e = self.router.reasoning_effort_budgets
        return ReasoningEfforts(e.low, e.medium, e.high)

    def make_policy(self, model_dir: Path | None = None):
        """The router policy the frontend places with (``router.policy``); ``model_dir`` (the
        served model's directory) is where ``router.length_predictor: auto`` looks."""
        from thinkserve.router import LeastLoadedPolicy
        from thinkserve.router.conductor import (BATCH, INTERACTIVE, STANDARD, Conductor, ConductorConfig,
                                                 PrefillCostModel, SLOClass)
        from thinkserve.router.predictor import PredictorConfig
        r = self.router
        if not self.uses_conductor():
            return LeastLoadedPolicy(r.long_threshold, r.answer_margin)
        ms = lambda v: None if v is None else v / 1000.0
        classes = tuple(SLOClass(name, ms(c.ttft_ms), ms(c.tpot_ms), prio, c.admission)
                        for name, c, prio in ((INTERACTIVE, r.interactive, 0), (STANDARD, r.standard, 1),
                                              (BATCH, r.batch, 2)))
        conductor = Conductor(ConductorConfig(slo_classes=classes, efforts=self.efforts(),
                                              prefill_cost=PrefillCostModel(s_per_token=r.prefill_s_per_token),
                                              long_threshold=r.long_threshold, long_probability=r.long_probability,
                                              promotion_margin=r.promotion_margin,
                                              promotion_quantile=r.promotion_quantile,
                                              max_promotions=r.max_promotions,
                                              promotions_per_long_instance=r.promotions_per_long_instance,
                                              predictor=PredictorConfig(steps_per_s=r.predictor_steps_per_s),
                                              cold_start_requests=r.cold_start_requests,
                                              conditional_disagg=r.conditional_disagg,
                                              max_local_prefill_length=r.max_local_prefill_length,
                                              local_max_long_probability=r.local_max_long_probability,
                                              spill_long_max_probability=r.spill_long_max_probability))
        state = self.length_predictor_file(model_dir)
        if state is not None:
            try:
                conductor.predictor.load_state(json.loads(state.read_text()))
            except (OSError, ValueError) as e:
                raise ConfigError(f"router.length_predictor: {state}: {e}") from None
        return conductor

    def length_predictor_file(self, model_dir: Path | None) -> Path | None:
        """The predictor state file ``router.length_predictor`` names, or ``None`` (start uninformed)."""
        choice = self.router.length_predictor
        if choice == "none":
            return None
        if choice == "auto":
            found = None if model_dir is None else Path(model_dir) / LENGTH_PREDICTOR_FILE
            return found if found is not None and found.is_file() else None
        return Path(choice).expanduser()

    def pool(self, name: str) -> PoolConfig:
        if name not in POOL_NAMES:
            raise KeyError(name)
        return self.pools.get(name)


LENGTH_PREDICTOR_FILE = "length_predictor.json"     # beside a model's config.json


def _format(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{loc}: {msg}" if loc else msg)  # cross-field errors name their fields
    return "; ".join(lines)


def parse_config(data: Any) -> ClusterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None


def load_config(path: str | Path | None) -> ClusterConfig:
    """Read and validate a YAML cluster config; ``None`` gives the defaults."""
    if path is None:
        return parse_config({})
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"config: cannot read {p}: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {p} is not valid YAML: {e}") from None
    return parse_config(data)
