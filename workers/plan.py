"""The step plan: what the scheduler hands the model runner each step.

Plain data, no torch. Only the model runner turns a plan into tensors (input ids, positions,
slot mapping, block tables). The scheduler and block manager never see a tensor.

One step computes a flat batch of tokens from several sequences::

    seq A (prefill chunk, 5 tokens)   seq B (decode, 1 token)   seq C (decode, 1 token)
    [a0 a1 a2 a3 a4]                  [b9]                      [c3]
     ^ positions start_pos..start_pos+len-1 for each sequence

Each token's K/V is written to slot ``block_table[pos // block_size] * block_size + pos % block_size``
and attends to all tokens of its own sequence at positions <= its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


# SeqSampling and ScheduledSeq are built for every scheduled sequence of every step (up to
# max_num_seqs per step): named tuples, immutable like the frozen dataclasses they were and
# several times cheaper to build.
class SeqSampling(NamedTuple):
    """Sampling settings the runner needs for one sampled sequence."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    output_index: int  # number of output tokens this sequence had before this sample
    logprobs: int | None = None


class ScheduledSeq(NamedTuple):
    seq_id: int
    token_ids: tuple[int, ...]  # tokens whose KV is computed this step (a prefill chunk or 1 decode token)
    start_pos: int  # number of tokens of this sequence already in the KV cache
    block_table: tuple[int, ...]  # device block ids covering positions [0, start_pos + len(token_ids))
    sampling: SeqSampling | None  # None: no sample this step (a prefill chunk that is not the last)
    # Best-of-N fan-out: (seq id, sampling) of the other branches, which sample their first token
    # from this same last position in this same step (a root computing the end of its prompt).
    fanout: tuple[tuple[int, SeqSampling], ...] = ()


@dataclass(frozen=True)
class SwapKey:
    """Names one swap-out of one request in an external swap space (``workers/swap_space.py``).
    Unique per (engine instance, request, swap epoch): two engines sharing one CPU KV store, or
    one request swapped out twice, never collide. The blocks under a key are the request's
    unique device blocks; each branch refers to them by position (shared blocks travel once)."""

    instance_id: str
    request_id: str
    epoch: int  # 1 for a request's first swap-out, 2 for its second, ...

    def __str__(self) -> str:
        return f"{self.instance_id}/{self.request_id}/{self.epoch}"


@dataclass(frozen=True)
class SwapTransfer:
    """Move one request's KV between device blocks and an external swap space."""

    request_id: str
    key: SwapKey
    block_ids: tuple[int, ...]  # device blocks, in the order stored under ``key``


@dataclass(frozen=True)
class StepPlan:
    seqs: tuple[ScheduledSeq, ...]
    # (src_device_block, dst_device_block): copy-on-write copies, done before the forward pass
    blocks_to_copy: tuple[tuple[int, int], ...] = ()
    # (device_block, host_block): preemption by swapping, done before the forward pass
    blocks_to_swap_out: tuple[tuple[int, int], ...] = ()
    # (host_block, device_block): resuming swapped sequences, done before the forward pass
    blocks_to_swap_in: tuple[tuple[int, int], ...] = ()
    # External swap space (not the host block pool): executed by the engine before the model
    # runner's moves. A refused swap-out turns its request into a recompute.
    swap_outs: tuple[SwapTransfer, ...] = ()
    # Swap-ins from the external space; their requests compute from the next step on.
    swap_ins: tuple[SwapTransfer, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    def batch_shape(self) -> tuple[int, int, int, int]:
        """(prompt tokens computed, positions they attend to, decoding branches, positions those
        attend to): what a step's cost follows (the simulator's ``BatchShape``; step telemetry)."""
        pt = pc = nd = dc = 0
        for s in self.seqs:
            n, start = len(s.token_ids), s.start_pos
            if n == 1:
                nd += 1
                dc += start + 1
            else:
                pt += n
                pc += n * start + n * (n + 1) // 2
        return pt, pc, nd, dc

    @property
    def is_empty(self) -> bool:
        return not (self.seqs or self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.swap_outs or self.swap_ins)


@dataclass(frozen=True)
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None


@dataclass(frozen=True)
class StepResult:
    sampled: tuple[SampledToken, ...] = field(default_factory=tuple)
    # (seq_id, final-norm hidden state of its sampled position) for the seqs the engine asked for
    hidden: tuple[tuple[int, tuple[float, ...]], ...] = ()


@dataclass(frozen=True)
class ExternalMoves:
    """What became of a step's external swap moves: the scheduler recomputes these requests."""

    refused_swap_outs: tuple[str, ...] = ()   # the space was full or unreachable
    lost_swap_ins: tuple[str, ...] = ()       # the space no longer held the KV
