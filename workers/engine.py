"""One inference engine: schedule → run → postprocess, plus KV export/import for disaggregation.

    step() = schedule → run → postprocess:
    add_request ─▶ Scheduler.waiting ─▶ Scheduler.schedule() ─▶ StepPlan ─▶ ExternalSwap.move (if any)
                    (requests that can never fit end here)           └──▶ ModelRunner.execute()
                                                                                │ sampled tokens
    RequestOutput ◀── OutputProcessor.step_outputs ◀── Scheduler.postprocess ◀──┘
                                                       (tokens appended via OutputProcessor.append:
                                                        budget, stops, text; branches freed; held)

Roles: ``mixed`` runs requests to completion; ``prefill`` stops each request once its prompt is
computed and every branch has its first token (it is then *held*, blocks and all, until
``export_request`` + ``release_request``); ``decode`` continues imported requests (and accepts
``add_request`` too).
"""
from __future__ import annotations

import logging
import random
import uuid
from typing import Sequence as Seq

import torch

from .block_hash import hash_blocks
from .block_manager import BlockManager, BlockManagerError
from .config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from .kv_cache import KVFingerprint, KVLayout, torch_dtype
from .loader import resolve_model_path
from .migration import build_request, export, import_seqs, validate
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .outputs import EngineStats, ExportedRequest, RequestOutput
from .plan import StepPlan, StepResult
from .postprocess import OutputProcessor, check_token_ids
from .sampling_params import SamplingParams, branch_seed
from .scheduler import ScheduleOutput, Scheduler
from .sequence import Request, RequestStatus, Sequence
from .swap_space import ExternalSwap, SwapSpace
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, swap_space: SwapSpace | None = None, instance_id: str | None = None):
        """``swap_space``: where preemption swaps once the host block pool (``num_host_blocks``)
        is full, e.g. the node's CPU KV store (``kvtransfer.swap.StoreSwapSpace``); only with
        ``preemption_mode="swap"``. ``instance_id`` names this engine in swap keys (default: a
        random id), so engines sharing one swap space never collide."""
        path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_pretrained(path)
        self.tokenizer = Tokenizer.from_pretrained(path)
        config = self._resolve(config, self.model_config)
        self.config = config
        self.role = config.role
        dtype = torch_dtype(config.dtype)
        self.runner = ModelRunner(self.model_config, path, device=config.device, dtype=dtype,
                                  block_size=config.block_size, num_device_blocks=config.num_device_blocks,
                                  num_host_blocks=config.num_host_blocks, max_num_seqs=config.max_num_seqs,
                                  # a prefill instance's steps all carry prompt tokens: no graphs to capture
                                  enforce_eager=config.enforce_eager or config.role == "prefill")
        self.block_manager = BlockManager(config.num_device_blocks, config.block_size,
                                          num_host_blocks=config.num_host_blocks,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        kv_bytes = self.runner.kv_layout.bytes_per_block * config.num_device_blocks
        log.info("engine %s (%s) loaded %s: %s parameters in %s on %s; KV cache %d blocks of %d tokens (%.1f MiB, "
                 "%d tokens); up to %d sequences a step", self.instance_id, self.role, config.model,
                 f"{self.model_config.num_parameters():,}", config.dtype, config.device, config.num_device_blocks,
                 config.block_size, kv_bytes / 2**20, config.num_device_blocks * config.block_size,
                 config.max_num_seqs)
        self.swap_space = swap_space if config.preemption_mode == "swap" else None
        if self.swap_space is not None:
            self.swap_space.bind(self.runner.fingerprint())
        self.scheduler = Scheduler(config, self.block_manager, external_swap=self.swap_space is not None,
                                   instance_id=self.instance_id)
        self.external_swap = ExternalSwap(self.swap_space, self.runner) if self.swap_space is not None else None
        self.processor = OutputProcessor(self.tokenizer, config.max_model_len)
        self.vocab_size = self.model_config.vocab_size
        # Seeds for unseeded requests: reproducible when the engine is seeded, random otherwise.
        self._seed_rng = random.Random(config.seed) if config.seed is not None else random.SystemRandom()
        self._arrivals = 0
        self._pending_imports: dict[str, tuple[ExportedRequest, list[int]]] = {}
        self._pending_reserves: dict[str, tuple[str, tuple[int, ...]]] = {}   # reserve id -> (source, branches)
        self.num_steps = 0
        self.last_plan: StepPlan | None = None
        self.num_generated_tokens = 0
        self._idle_steps = 0  # consecutive steps that had work queued but scheduled none of it

    @classmethod
    def from_pretrained(cls, model: str = "tiny-reasoner", *, swap_space: SwapSpace | None = None,
                        instance_id: str | None = None, **engine_config_fields) -> "LLMEngine":
        return cls(EngineConfig(model=model, **engine_config_fields), swap_space=swap_space, instance_id=instance_id)

    @staticmethod
    def _resolve(config: EngineConfig, mc: ModelConfig) -> EngineConfig:
        """Fill in what depends on the model: dtype, max_model_len, the number of KV blocks."""
        dtype = config.dtype
        if dtype == "auto":
            # Half precision on CPU is slow and, for bf16 matmuls, not even supported everywhere.
            dtype = mc.torch_dtype if config.device.startswith("cuda") else "float32"
        max_len = config.max_model_len or mc.max_model_len
        if max_len > mc.max_model_len:
            raise ValueError(f"max_model_len {max_len} exceeds the model's limit {mc.max_model_len}")
        blocks = config.num_device_blocks
        if blocks is None:
            layout = KVLayout.for_model(mc, config.block_size, torch_dtype(dtype))
            budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            blocks = layout.num_blocks_for_budget(budget)
            if blocks < 1:
                raise ValueError(f"kv_cache_memory_bytes {budget} holds no KV block "
                                 f"({layout.bytes_per_block} bytes each)")
        return config.replace(dtype=dtype, max_model_len=max_len, num_device_blocks=blocks, kv_cache_memory_bytes=None)

    # ---- requests -------------------------------------------------------------------------
    def _check_request_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.scheduler.requests or request_id in self._pending_imports \
                or request_id in self._pending_reserves:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    *, priority: int = 0, reserve: tuple[str, Seq[int]] | None = None) -> None:
        """Queue a request. Bad input raises ValueError naming the field; nothing else changes.

        ``reserve = (reserve_id, indices)``: as soon as the prompt is computed, branches
        ``indices`` of it are forked off into the held request ``reserve_id``
        (``fork_held(reserve=True)``), so a colocated Best-of-N request keeps its prompt's KV for
        its later waves however soon its first wave ends. Until then ``abort`` and
        ``abort_branches`` on ``reserve_id`` act on the pending reserve."""
        params = SamplingParams() if params is None else params
        self._check_request_id(request_id)
        if reserve is not None:
            self._check_request_id(reserve[0])
            if reserve[0] == request_id or not reserve[1]:
                raise ValueError(f"reserve must name a new request id and branches, got {reserve!r}")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = check_token_ids("prompt_token_ids", list(prompt), self.vocab_size)
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        limit = self.config.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {limit} "
                             f"(at most {limit - 1} leaves room for an output token)")
        need = self.block_manager.num_blocks_for(len(prompt_ids) + 1)
        if need > self.config.num_device_blocks:
            raise ValueError(f"prompt needs {need} KV blocks; num_device_blocks is {self.config.num_device_blocks}")
        check_token_ids("stop_token_ids", params.stop_token_ids, self.vocab_size)
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n = {params.n} exceeds max_num_seqs = {self.config.max_num_seqs}")
        if params.thinking_budget is not None and (self.tokenizer.think_start_id is None
                                                   or self.tokenizer.think_end_id is None):
            raise ValueError("thinking_budget needs a vocabulary with <think> and </think> tokens")
        if params.seed is None:
            params = params.replace(seed=self._seed_rng.randrange(2**63))
        root = Sequence(self.scheduler.new_seq_id(), 0, list(prompt_ids), len(prompt_ids), branch_seed(params.seed, 0))
        self.processor.init_thinking(root)
        req = Request(request_id, prompt_ids, params, priority, self._next_arrival(), [root], forked=params.n == 1)
        self.scheduler.add(req)
        if reserve is not None:
            self._pending_reserves[reserve[0]] = (request_id, tuple(reserve[1]))

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is known here in any state (a pending import or reserve too)."""
        return (request_id in self.scheduler.requests or request_id in self._pending_imports
                or request_id in self._pending_reserves)

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def abort(self, request_id: str) -> bool:
        """Stop a request in any state (queued, running, swapped, held, exported, importing)."""
        if request_id in self._pending_imports:
            self.abort_import(request_id)
            return True
        if self._pending_reserves.pop(request_id, None) is not None:
            return True
        found = self.scheduler.abort(request_id) is not None
        self._discard_dropped_swaps()
        return found

    def abort_branches(self, request_id: str, indices: Seq[int]) -> tuple[int, ...]:
        """Cancel some branches of a Best-of-N request (early consensus): they finish with reason
        ``abort`` and their blocks are freed now (blocks shared with a sibling stay with it); the
        other branches go on. Returns the branch indices aborted (unfinished ones named). Naming
        every unfinished branch aborts the whole request. KeyError: no such request; ValueError:
        the request is in a state whose branches cannot part (not yet forked, swapped, held,
        exported, importing) unless every unfinished branch is named."""
        req = self.scheduler.requests.get(request_id)
        if req is None and request_id in self._pending_reserves:    # not forked yet: fewer branches to fork
            src, branches = self._pending_reserves[request_id]
            named = tuple(i for i in branches if i in set(indices))
            rest = tuple(i for i in branches if i not in named)
            if rest:
                self._pending_reserves[request_id] = (src, rest)
            else:
                del self._pending_reserves[request_id]
            return named
        if req is None:
            if request_id in self._pending_imports:
                raise ValueError(f"request {request_id!r} is still importing; abort it whole")
            raise KeyError(f"no request {request_id!r}")
        wanted = set(indices)
        if req.needs_fork:      # one root stands for all n branches until the fork
            named = tuple(i for i in range(req.params.n) if i in wanted)
            if len(named) == req.params.n:
                self.abort(request_id)
                return named
            if named:
                raise ValueError(f"request {request_id!r} is not yet forked: its branches cannot be "
                                 "aborted one by one; abort it whole")
            return ()
        targets = [s for s in req.unfinished_seqs if s.index in wanted]
        if not targets:
            return ()
        if len(targets) == len(req.unfinished_seqs):
            self.abort(request_id)
            return tuple(sorted(s.index for s in targets))
        if req.status not in (RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.HELD):
            raise ValueError(f"request {request_id!r} is {req.status.value}: its branches cannot be "
                             "aborted one by one; abort it whole")
        for seq in targets:
            self.scheduler.finish_seq(req, seq, "abort")
        return tuple(sorted(s.index for s in targets))

    def fork_held(self, request_id: str, new_request_id: str, indices: Seq[int], *, reserve: bool = False,
                  start: bool = False) -> None:
        """Branches ``indices`` of a request's prompt, as the new request ``new_request_id``,
        without computing the prompt again. The source is held (prefill role, prefill done) or
        running with its prompt computed (mixed role: a colocated first wave). Each new branch
        shares the blocks holding the prompt's KV but its last token's: wherever it runs, it
        computes that one token and samples its first output from it with its own seed
        (``branch_seed(seed, index)``), so it samples what branch ``index`` of the whole request
        samples offline (there from the root's last position, in the fan-out step). Early consensus keeps a
        request's later waves this way (``n`` grows to cover ``indices``).

            source request [p0 p1 .. p14 | p15 .. p38 p39 o0]     branches 0..w-1 (computed p39)
            new request    [p0 p1 .. p14 | p15 .. p38]  (p39)     branches indices, blocks shared

        The new request is held (exported from here like a prefilled one) unless ``start``: it
        then runs here (a later wave of a colocated request) as soon as its branches fit the
        free batch slots, holding its KV until then (``Scheduler.add_starting``: the batch never
        passes ``max_num_seqs``). ``reserve``: held only to save the
        prompt's recompute, so the scheduler frees it when it needs the blocks (it then ends
        with reason ``reclaimed``).

        KeyError: no such held or running request with its prompt computed; ValueError: bad
        ``new_request_id`` or indices."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status not in (RequestStatus.HELD, RequestStatus.RUNNING):
            raise KeyError(f"no held request {request_id!r}")
        self._check_request_id(new_request_id)
        wanted = sorted(set(indices))
        if not wanted or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in wanted):
            raise ValueError(f"indices must be non-empty non-negative ints, got {list(indices)!r}")
        if len(wanted) > self.config.max_num_seqs:
            raise ValueError(f"{len(wanted)} branches exceed max_num_seqs = {self.config.max_num_seqs}")
        prompt = list(req.prompt_token_ids)
        computed = len(prompt) - 1
        src = next((s for s in req.seqs if not s.is_finished and s.num_computed_tokens >= computed
                    and len(s.block_table) * self.config.block_size >= computed), None)
        if src is None:
            raise KeyError(f"request {request_id!r} has no branch holding its prompt's KV")
        blocks = src.block_table[:self.block_manager.num_blocks_for(computed)]
        params = req.params.replace(n=max(req.params.n, wanted[-1] + 1))
        seqs = []
        for i in wanted:
            seq = Sequence(self.scheduler.new_seq_id(), i, list(prompt), len(prompt), branch_seed(params.seed, i))
            self.block_manager.incref_blocks(blocks)
            seq.block_table, seq.num_computed_tokens = list(blocks), computed
            self.block_manager.register_computed_blocks(seq)
            self.processor.init_thinking(seq)
            seqs.append(seq)
        new = Request(new_request_id, prompt, params, req.priority, self._next_arrival(), seqs, forked=True)
        new.reserve = reserve and not start
        if start:
            self.scheduler.add_starting(new)        # runs when its branches fit the batch slots
        else:
            self.scheduler.add_held(new)

    def has_unfinished_requests(self) -> bool:
        """Requests this engine will still make progress on (held prefill results are parked)."""
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()   # the plan; a request that can never fit ends here
        self.last_plan = scheduled.plan         # what the step computed (step telemetry reads it)
        result = self._run(scheduled)           # external swap moves, the runner's moves, forward, sample
        return self._postprocess(scheduled, result)

    def _run(self, scheduled: ScheduleOutput) -> StepResult:
        plan = scheduled.plan
        if plan.is_empty:
            return StepResult()
        if self.external_swap is not None:   # first: swap-outs read blocks this step may reuse
            self.scheduler.on_external_moves(self.external_swap.move(plan))
        self.num_steps += 1
        return self.runner.execute(plan, self._hidden_wanted(scheduled.work))

    def _postprocess(self, scheduled: ScheduleOutput, result: StepResult) -> list[RequestOutput]:
        progress = self.scheduler.postprocess(scheduled, result.sampled, self.processor)
        if self._pending_reserves:
            self._fork_pending_reserves()
        # Requests the step ended without computing them: out of capacity, reserves reclaimed.
        ended = scheduled.out_of_capacity + scheduled.reclaimed
        outputs = self.processor.step_outputs(ended, progress, dict(result.hidden))
        self.num_generated_tokens += len(progress.new_tokens)
        stalled = scheduled.plan.is_empty and not outputs and self.scheduler.has_unfinished()
        self._idle_steps = self._idle_steps + 1 if stalled else 0
        return outputs

    def _fork_pending_reserves(self) -> None:
        """Fork each pending reserve whose source has computed its prompt (``add_request``);
        forget those whose source ended without it."""
        for rid, (src, branches) in list(self._pending_reserves.items()):
            req = self.scheduler.requests.get(src)
            if req is None:
                del self._pending_reserves[rid]
            elif req.status in (RequestStatus.RUNNING, RequestStatus.HELD) and any(
                    s.num_computed_tokens >= req.num_prompt_tokens - 1 for s in req.unfinished_seqs):
                del self._pending_reserves[rid]
                self.fork_held(src, rid, branches, reserve=True)

    def _hidden_wanted(self, work) -> frozenset[int]:
        """Seqs whose hidden state this step returns: each branch's first sampled token, and
        every ``hidden_state_interval``-th after it (counting output tokens)."""
        k = self.config.hidden_state_interval
        if k is None:
            return frozenset()
        wanted = {w.seq.seq_id for w in work if w.samples and (
            w.seq.num_output_tokens == 0 or (k > 0 and (w.seq.num_output_tokens + 1) % k == 0))}
        wanted.update(sid for w in work if w.fanout for sid in w.fanout)    # first tokens too
        return frozenset(wanted)

    def _discard_dropped_swaps(self) -> None:
        for key, num_blocks in self.scheduler.take_dropped_swaps():
            self.swap_space.discard(key, num_blocks)

    def generate(self, prompts: str | Seq[int] | Seq[str | Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Offline convenience: run the given prompts to completion (role prefill: until prefilled)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} params for {len(prompts)} prompts")
        ids = []
        for prompt, p in zip(prompts, params_list):
            rid = f"generate-{self._next_arrival()}"
            self.add_request(rid, prompt, p)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            step_outputs = self.step()
            for o in step_outputs:
                if o.finished or o.prefilled:
                    final[o.request_id] = o
            if not step_outputs and (self._idle_steps > 1 or not self.has_unfinished_requests()):
                # Only blocks held for export (role prefill) or pending imports can cause this.
                raise RuntimeError(f"engine cannot make progress: {self.stats()}")
        return [final[r] for r in ids]

    # ---- observability --------------------------------------------------------------------
    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        held = sum(1 for r in s.requests.values()
                   if r.status in (RequestStatus.HELD, RequestStatus.EXPORTED)) - len(s.starting)
        queried = bm.num_prefix_queried_blocks
        return EngineStats(
            role=self.role,
            num_waiting=len(s.waiting) + len(s.starting),     # forked waves waiting for slots too
            num_running=len(s.running),
            num_swapped=len(s.swapped),
            num_held=held,
            num_running_seqs=s.num_running_seqs(),
            num_free_blocks=bm.num_free_blocks,
            num_cached_blocks=bm.num_cached_free_blocks,
            num_total_blocks=bm.num_blocks,
            num_free_host_blocks=bm.host.num_free_blocks,
            num_total_host_blocks=bm.host.num_blocks,
            num_preemptions=s.num_preemptions,
            num_reclaimed_reserves=s.num_reclaimed_reserves,
            num_recompute_preemptions=s.num_recompute_preemptions,
            num_computed_prompt_tokens=s.num_computed_prompt_tokens,
            prefix_cache_hit_rate=bm.num_prefix_hit_blocks / queried if queried else 0.0,
            num_steps=self.num_steps,
            num_generated_tokens=self.num_generated_tokens,
            num_recomputed_tokens=s.num_recomputed_tokens,
            # the router's TTFT estimate: prompt work queued ahead of a new request
            num_queued_prefill_tokens=sum(max(0, r.seqs[0].num_prompt_tokens - r.seqs[0].num_computed_tokens)
                                          for r in (*s.waiting, *s.running) if r.seqs),
        )

    def check_integrity(self) -> None:
        """Every block accounted for (requests in any state, pending imports), and the running
        branches counted as the running requests hold them, else raises."""
        s = self.scheduler
        if s.num_running_seqs() != s.recount_running_seqs():
            raise BlockManagerError(f"the scheduler counts {s.num_running_seqs()} running branches, its running "
                                    f"requests hold {s.recount_running_seqs()}")
        tables = list(self.scheduler.block_tables())
        tables += [ids for _, ids in self._pending_imports.values()]
        self.block_manager.check_integrity(tables, list(self.scheduler.host_block_tables()))
        for req in self.scheduler.requests.values():  # KV in the external swap space
            indices = sorted({i for s in req.seqs for i in s.swap_indices})
            if req.swap_key is None and indices:
                raise BlockManagerError(f"request {req.request_id!r} has swap indices but no swap key")
            if req.swap_key is not None and (req.status is not RequestStatus.SWAPPED
                                             or indices != list(range(req.num_swapped_blocks))
                                             or any(s.block_table for s in req.seqs)):
                raise BlockManagerError(f"request {req.request_id!r} ({req.status.value}) is swapped out under "
                                        f"{req.swap_key} with {req.num_swapped_blocks} blocks, but its branches "
                                        f"refer to {indices} and hold device blocks "
                                        f"{[s.block_table for s in req.seqs]}")

    # ---- KV export / import (disaggregation, migration) -----------------------------------
    def fingerprint(self) -> KVFingerprint:
        return self.runner.fingerprint()

    def export_request(self, request_id: str) -> ExportedRequest:
        """Stop scheduling a request and describe it for another instance; its blocks stay held
        (read them with ``read_blocks``) until ``release_request``. A request without device KV
        (queued, or swapped to host) exports for recompute."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is RequestStatus.EXPORTED:
            raise KeyError(f"no exportable request {request_id!r}")
        if req.status is RequestStatus.SWAPPED:
            self.scheduler.drop_swapped_kv(req)  # swapped pages are not part of a page set
            self._discard_dropped_swaps()
            for seq in req.unfinished_seqs:
                seq.num_computed_tokens = 0
        self.scheduler.detach(req)
        req.status = RequestStatus.EXPORTED
        return export(req, self.config.block_size)

    def read_blocks(self, block_ids: Seq[int], device: str | torch.device | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Contiguous copy [L, 2, n, bs, H, D] of the blocks, on ``device`` (default CPU; the
        engine's own device keeps it there for the NCCL path), or into ``out`` (that shape)."""
        return self.runner.read_blocks(block_ids, device, out=out)

    def write_blocks(self, block_ids: Seq[int], data: torch.Tensor, *, layers: slice | None = None) -> None:
        """Copy KV into blocks; with ``layers`` only those layers (``data`` holds just them)."""
        self.runner.write_blocks(block_ids, data, layers)

    def kv_views(self, block_ids: Seq[int]) -> list[tuple[int, torch.Tensor]]:
        """Writable cache views over ``block_ids``, one ``(position, view)`` per run of consecutive
        ids (see ``ModelRunner.kv_views``): a receiver copies arriving bytes straight into them."""
        return self.runner.kv_views(block_ids)

    def host_kv_cache(self) -> torch.Tensor | None:
        """The whole KV cache [L, 2, num_blocks, bs, H, D] when it lives in host memory (CPU
        engines), else ``None``. A transport receives imported blocks' bytes straight into it;
        like ``kv_views``, only blocks the caller owns (imported, not yet committed) may be
        written."""
        kv = self.runner.kv_cache
        return kv if kv.device.type == "cpu" and kv.is_contiguous() else None

    def resume_request(self, request_id: str) -> None:
        """Cancel an export (a failed migration or handoff, a refused swap-out): the request is
        scheduled again here, in place: held (role prefill, prefill done), running (it has
        device KV) or waiting (exported without KV, e.g. from swapped: it recomputes).
        KeyError when ``request_id`` is not an exported request."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status is not RequestStatus.EXPORTED:
            raise KeyError(f"no exported request {request_id!r}")
        has_kv = any(s.block_table for s in req.unfinished_seqs)
        held = (self.role == "prefill" and has_kv and not req.needs_fork
                and all(s.num_output_tokens >= 1 for s in req.unfinished_seqs))
        self.scheduler.reattach(req, held=held)

    def release_request(self, request_id: str) -> None:
        """Free the blocks of an exported (or held) request: it lives on elsewhere now."""
        req = self.scheduler.requests.get(request_id)
        if req is None or req.status not in (RequestStatus.EXPORTED, RequestStatus.HELD):
            raise KeyError(f"no exported request {request_id!r}")
        self.scheduler.abort(request_id)

    def import_request(self, exported: ExportedRequest) -> list[int] | None:
        """Allocate blocks for ``exported``'s page set (same order as its ``block_ids``); the caller
        writes the KV there, then ``commit_import``. None: it cannot run here now (its branches
        do not fit the free batch slots or blocks, or a queued request of equal or higher priority
        needs them: ``Scheduler.reserve_import``); nothing was taken. ValueError: bad request."""
        if self.role == "prefill":
            raise ValueError("role 'prefill' does not import requests; use a 'decode' or 'mixed' engine")
        self._check_request_id(exported.request_id)
        if exported.params.seed is None:
            raise ValueError("params.seed must be fixed in an exported request")
        validate(exported, vocab_size=self.vocab_size, max_model_len=self.config.max_model_len,
                 block_size=self.config.block_size)
        # Admitted like a queued request (``Scheduler.reserve_import``): None when its branches
        # cannot run here now; the sender keeps the KV and tries again later or elsewhere.
        ids = self.scheduler.reserve_import(exported.request_id, import_seqs(exported),
                                            len(exported.block_ids), exported.priority)
        if ids is None:
            return None
        self._pending_imports[exported.request_id] = (exported, ids)
        return list(ids)

    def commit_import(self, request_id: str) -> None:
        """The imported KV is written: the request starts (or, without KV, queues to recompute)."""
        exported, ids = self._pending_imports.pop(request_id)
        req = build_request(exported, ids, self.block_manager, self.scheduler.new_seq_id, self._next_arrival())
        for seq in req.seqs:
            self.processor.init_thinking(seq)
            self.processor.init_text(seq)
        self.scheduler.start_import(req)

    def abort_import(self, request_id: str) -> None:
        _, ids = self._pending_imports.pop(request_id)
        self.scheduler.cancel_import(request_id, ids)

    def export_prefix(self, token_ids: Seq[int]) -> tuple[list[int], torch.Tensor]:
        """Hashes and KV of the cached full blocks that start ``token_ids`` (for the CPU KV store)."""
        hashes, blocks = self.block_manager.cached_prefix(list(token_ids))
        return hashes, self.runner.read_blocks(blocks)

    def import_prefix(self, token_ids: Seq[int], hashes: list[int], data: torch.Tensor) -> int:
        """Put prefix blocks fetched elsewhere into the prefix cache; returns blocks added."""
        expected = hash_blocks(list(token_ids), self.config.block_size)
        if list(hashes) != expected[:len(hashes)]:
            raise ValueError("hashes do not match the block hash chain of token_ids")
        layout = self.runner.kv_layout
        # Checked before any block is hashed: a failed write must not leave garbage in the cache.
        if tuple(data.shape) != layout.shape(len(hashes)) or data.dtype != layout.torch_dtype:
            raise ValueError(f"data has shape {tuple(data.shape)} and dtype {data.dtype}; expected "
                             f"{layout.shape(len(hashes))} and {layout.torch_dtype}")
        slots = self.block_manager.cache_blocks(hashes)
        if slots is None:
            return 0
        fill = [i for i, (_, needs) in enumerate(slots) if needs]
        if fill:
            self.runner.write_blocks([slots[i][0] for i in fill], data[:, :, fill].contiguous())
        self.block_manager.free_blocks([b for b, _ in slots])
        return len(fill)
