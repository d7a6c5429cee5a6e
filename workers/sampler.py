"""Batched sampling: greedy, temperature, top-k, top-p, vectorised over rows.

Randomness is counter-based: the noise a row adds to vocabulary entry ``v`` is a pure function of
``(seed, output_index, v)``::

    u = hash(seed, output_index, v) ∈ (0, 1)        gumbel = -log(-log u)
    token = argmax_v( logits[v] / temperature + gumbel )   over the entries top-k/top-p keep

Gumbel-max draws exactly from softmax(logits / temperature), and since no generator state is
consumed, a seeded sequence samples the same tokens whatever else is in its batch, and after
preemption or migration to another instance.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .plan import SeqSampling

# 64-bit constants as signed int64 (torch has no uint64 arithmetic; int64 multiply wraps mod 2^64).
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_M1 = 0xFF51AFD7ED558CCD - 2**64
_M2 = 0xC4CEB9FE1A85EC53 - 2**64


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic: it would smear the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _fmix64(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 64-bit finaliser: every input bit flips each output bit with p ~ 1/2."""
    x = x ^ _lsr(x, 33)
    x = x * _M1
    x = x ^ _lsr(x, 33)
    x = x * _M2
    return x ^ _lsr(x, 33)


def gumbel_noise(seed: torch.Tensor, output_index: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Gumbel(0,1) noise [N, V] float32 from seed [N], output_index [N] and vocab_ids [N, V] or [V]."""
    row = _fmix64(_fmix64(seed) ^ (output_index * _GOLDEN))
    x = _fmix64(row[:, None] + vocab_ids * _GOLDEN)
    # top 24 bits -> u in (0, 1), exact in float32
    u = (_lsr(x, 40).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors (built once per step)."""

    temperature: torch.Tensor  # [N] float32; 0 rows are greedy
    top_k: torch.Tensor  # [N] int64; vocab size when disabled
    top_p: torch.Tensor  # [N] float32
    seed: torch.Tensor  # [N] int64
    output_index: torch.Tensor  # [N] int64
    all_greedy: bool
    any_filter: bool  # some row uses top-k or top-p
    max_logprobs: int | None  # most top logprobs any row asked for; None: no row wants logprobs

    @classmethod
    def from_params(cls, params: Sequence[SeqSampling], vocab_size: int, device: torch.device) -> "SamplingBatch":
        top_k = [vocab_size if p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        lps = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seed=torch.tensor([p.seed % 2**63 for p in params], dtype=torch.int64, device=device),
            output_index=torch.tensor([p.output_index for p in params], dtype=torch.int64, device=device),
            all_greedy=all(p.temperature == 0.0 for p in params),
            any_filter=any((p.temperature > 0.0) and (k < vocab_size or p.top_p < 1.0) for p, k in zip(params, top_k)),
            max_logprobs=max(lps) if lps else None,
        )


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None = None  # [N] log p(sampled token) under the model's raw distribution
    top_ids: torch.Tensor | None = None  # [N, max_logprobs]
    top_logprobs: torch.Tensor | None = None  # [N, max_logprobs]


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Draws one token per row of ``logits`` [N, V] (float32)."""
    greedy_ids = logits.argmax(dim=-1)
    if batch.all_greedy:
        token_ids = greedy_ids
    else:
        greedy = batch.temperature == 0.0
        temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        scaled = logits / temperature[:, None]
        if batch.any_filter:
            token_ids = _sample_filtered(scaled, batch)
        else:
            vocab = torch.arange(logits.shape[1], device=logits.device)
            token_ids = (scaled + gumbel_noise(batch.seed, batch.output_index, vocab)).argmax(dim=-1)
        token_ids = torch.where(greedy, greedy_ids, token_ids)
    out = SampleOutput(token_ids)
    if batch.max_logprobs is not None:
        # Reported logprobs are the model's (temperature 1, unfiltered), as in the OpenAI API.
        logprobs = torch.log_softmax(logits, dim=-1)
        out.logprobs = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        if batch.max_logprobs > 0:
            out.top_logprobs, out.top_ids = logprobs.topk(batch.max_logprobs, dim=-1)
    return out


def _sample_filtered(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    #  sorted descending:  rank  0    1    2    3  ...
    #                      prob .50  .30  .15  .05
    #  top_k=3 drops rank >= 3; top_p=0.7 drops a rank once the mass *before* it reaches 0.7
    #  (rank 2: .80 >= .7), so the highest-probability token always survives.
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[1], device=scaled.device)
    drop = ranks[None, :] >= batch.top_k[:, None]
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop |= (mass_before >= batch.top_p[:, None]) & (batch.top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    noise = gumbel_noise(batch.seed, batch.output_index, sorted_ids)
    choice = (sorted_logits + noise).argmax(dim=-1, keepdim=True)
    return sorted_ids.gather(1, choice).squeeze(1)
