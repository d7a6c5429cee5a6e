"""What the engine hands back: per-step request outputs, stats, and exported requests.

Pure Python. ``ExportedRequest`` crosses process boundaries (prefill → decode instance, live
migration), so it is frozen plain data with ``to_dict``/``from_dict`` for msgpack; the KV pages
themselves travel separately (``LLMEngine.read_blocks`` of ``block_ids``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from .sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int  # branch index (Best-of-N)
    token_ids: list[int]  # every output token so far
    new_token_ids: list[int]  # tokens added by this step
    text: str  # detokenized output, a matched stop string trimmed
    finish_reason: str | None = None  # None | "stop" | "length" | "abort"
    # Per output token: {token_id: logprob} with the sampled token and the top alternatives.
    logprobs: list[dict[int, float]] | None = None
    # Final-norm hidden state at the position that sampled this step's token (the router's length
    # probe), on the steps ``EngineConfig.hidden_state_interval`` selects; else None.
    hidden_state: tuple[float, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Role prefill: the prompt is computed and every branch has its first token; the request now
    # holds its blocks until export_request/release_request.
    prefilled: bool = False


@dataclass(frozen=True)
class EngineStats:
    role: str
    num_waiting: int  # requests
    num_running: int
    num_swapped: int
    num_held: int  # prefill role: computed, waiting for export (or exported, waiting for release)
    num_running_seqs: int  # branches in the batch
    num_free_blocks: int  # device blocks an allocation may take (cached-but-idle included)
    num_cached_blocks: int  # idle blocks still holding a reusable prefix
    num_total_blocks: int
    num_free_host_blocks: int
    num_total_host_blocks: int
    num_preemptions: int
    prefix_cache_hit_rate: float  # hit blocks / looked-up full prompt blocks
    num_steps: int
    num_generated_tokens: int
    num_queued_prefill_tokens: int = 0  # prompt tokens of waiting and running requests not yet computed
    num_recomputed_tokens: int = 0  # KV tokens preemption dropped to recompute (no swap space could take them)
    num_recompute_preemptions: int = 0  # of num_preemptions, those that dropped the KV (the rest swapped)
    num_computed_prompt_tokens: int = 0  # prompt positions computed here (prefix hits and imported KV excluded)
    num_reclaimed_reserves: int = 0  # early-consensus reserves freed because the blocks were needed

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ExportedBranch:
    index: int
    output_token_ids: tuple[int, ...]
    num_computed_tokens: int  # tokens of prompt + outputs whose KV the pages hold
    block_indices: tuple[int, ...]  # positions into ExportedRequest.block_ids, in block-table order

    def to_dict(self) -> dict:
        return {
            "index": self.index,
            "output_token_ids": list(self.output_token_ids),
            "num_computed_tokens": self.num_computed_tokens,
            "block_indices": list(self.block_indices),
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ExportedBranch":
        return cls(int(d["index"]), tuple(int(t) for t in d["output_token_ids"]), int(d["num_computed_tokens"]),
                   tuple(int(i) for i in d["block_indices"]))


@dataclass(frozen=True)
class ExportedRequest:
    """A request in flight, as another instance needs it to continue::

        block_ids:   (b7, b3, b9, b4)            unique device blocks of the exporting engine
        branch 0:    block_indices (0, 1, 2)  →  b7 b3 b9
        branch 1:    block_indices (0, 1, 3)  →  b7 b3 b4   (prompt blocks shared, sent once)
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # with its seed fixed
    priority: int
    block_ids: tuple[int, ...]
    branches: tuple[ExportedBranch, ...]

    @property
    def has_kv(self) -> bool:
        return any(b.num_computed_tokens > 0 for b in self.branches)

    def subset(self, branch_indices: Iterable[int]) -> "ExportedRequest":
        """Only the named branches and the blocks they use (renumbered, order kept)."""
        wanted = set(branch_indices)
        unknown = wanted - {b.index for b in self.branches}
        if unknown:
            raise ValueError(f"branch_indices {sorted(unknown)} are not in request {self.request_id!r}")
        branches = [b for b in self.branches if b.index in wanted]
        used = sorted({i for b in branches for i in b.block_indices})
        renumber = {old: new for new, old in enumerate(used)}
        return dataclasses.replace(
            self,
            block_ids=tuple(self.block_ids[i] for i in used),
            branches=tuple(dataclasses.replace(b, block_indices=tuple(renumber[i] for i in b.block_indices))
                           for b in branches),
        )

    def without_kv(self) -> "ExportedRequest":
        """The same request to be recomputed from its tokens (no pages travel)."""
        return dataclasses.replace(self, block_ids=(), branches=tuple(
            dataclasses.replace(b, num_computed_tokens=0, block_indices=()) for b in self.branches))

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": self.params.to_dict(),
            "priority": self.priority,
            "block_ids": list(self.block_ids),
            "branches": [b.to_dict() for b in self.branches],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ExportedRequest":
        return cls(
            request_id=str(d["request_id"]),
            prompt_token_ids=tuple(int(t) for t in d["prompt_token_ids"]),
            params=SamplingParams.from_dict(d["params"]),
            priority=int(d["priority"]),
            block_ids=tuple(int(b) for b in d["block_ids"]),
            branches=tuple(ExportedBranch.from_dict(b) for b in d["branches"]),
        )
