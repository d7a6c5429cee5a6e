"""Paged attention in plain torch (CPU and CUDA), batched with no per-sequence Python loop.

A step's flat token batch is ordered prefill group first, decode group second::

    tokens:  [ p0 p0 p0 p0 | p1 p1 | d0 | d1 | d2 ]
               prefill group (query len > 1)  decode group (query len 1)

Each layer first writes the new K/V of every token to its slot (``slot_mapping``), then each
group attends over its sequences' pages, gathered through a padded block table::

    block_table[b] = [7, 2, 9]      (block_size 4, context 10)
    k_cache[block_table[b]] ──▶ [7:0..3 | 2:0..3 | 9:0..3]  = 12 keys, mask hides keys >= 10

The metadata (block tables, masks, padding indices) is built once per step and shared by all
layers; a layer only gathers, runs one SDPA per group and scatters back.

Decode has four backends (``decode_kernels.py``): the padded gather above is the reference;
``grouped`` pads per context-length bucket; ``native`` (CPU) and ``flashinfer`` (CUDA,
``cuda_decode.py``) read K/V in place through the table, so a 30-token sequence in a batch with
a 1,400-token chain reads 30 keys, not 1,400.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .cuda_decode import PagedKVIndex, paged_kv_index

# Keys per work item of the native kernel: long enough to amortise an item's setup, short enough
# that one long chain splits over every thread (see csrc/paged_decode.cpp).
NATIVE_PARTITION = 256


@dataclass
class PrefillGroup:
    """Sequences computing several tokens this step (prefill chunks), padded to ``max_query_len``."""

    num_tokens: int
    num_seqs: int
    max_query_len: int
    block_tables: torch.Tensor  # [B, max_blocks] int64
    mask: torch.Tensor | None  # [B, 1, max_query_len, max_blocks*block_size] additive; None: causal over fresh K/V
    seq_index: torch.Tensor | None  # [num_tokens]: padded row of each flat token (None when B == 1)
    query_offset: torch.Tensor | None  # [num_tokens]: padded column of each flat token


@dataclass
class DecodeBucket:
    """Decodes of one context-length bucket (``grouped`` backend), padded only to their own longest."""

    rows: torch.Tensor  # [b] int64: rows of the decode group in this bucket
    block_tables: torch.Tensor  # [b, bucket_blocks] int64
    mask: torch.Tensor  # [b, 1, 1, bucket_blocks*block_size] additive


@dataclass
class DecodeGroup:
    """Sequences computing one token each. ``backend`` (see ``decode_kernels``) says which of the
    optional fields is set: ``padded`` a mask over the padded table, ``grouped`` buckets,
    ``native`` neither (the kernel reads ``context_lens`` and the table in place), ``flashinfer``
    the CSR page list, and ``kernel`` once the runner has planned its FlashInfer wrapper on it."""

    num_seqs: int
    block_tables: torch.Tensor  # [B, max_blocks] int64
    context_lens: torch.Tensor  # [B] int64, this step's token included
    backend: str = "padded"
    mask: torch.Tensor | None = None  # [B, 1, 1, max_blocks*block_size] additive: -inf where key position >= context
    buckets: tuple[DecodeBucket, ...] = ()
    paged_kv: PagedKVIndex | None = None  # flashinfer: the pages of each sequence (cuda_decode.py)
    kernel: object | None = None  # flashinfer: the planned cuda_decode.FlashInferDecode


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    positions: torch.Tensor  # [num_tokens] int64
    prefill: PrefillGroup | None
    decode: DecodeGroup | None


def build_attention_metadata(
    start_pos: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    decode_backend: str = "padded",
) -> AttentionMetadata:
    """Tensors for one step. Sequences must be ordered prefill (query len > 1) before decode.
    Masks are additive (0 / -inf) in the model dtype: SDPA's CPU kernel converts a boolean mask
    on every call, i.e. once per layer, which costs more than the attention at small batch."""
    num_prefill = sum(1 for n in query_lens if n > 1)
    if any(n > 1 for n in query_lens[num_prefill:]) or any(n < 1 for n in query_lens):
        raise ValueError("sequences must be ordered prefill chunks first, then single-token decodes")

    tables = _pad_tables(block_tables)
    if not num_prefill:
        # Every sequence decodes one token (most steps): its position is its start and its slot is
        # read off its own table, a few list operations instead of the dozen tensor ops below.
        slots = [t[p // block_size] * block_size + p % block_size for p, t in zip(start_pos, block_tables)]
        positions = torch.tensor(start_pos, dtype=torch.int64)
        decode = _decode_group(positions + 1, tables, block_size, device, dtype, decode_backend)
        return AttentionMetadata(torch.tensor(slots, dtype=torch.int64).to(device), positions.to(device), None, decode)
    starts = torch.tensor(start_pos, dtype=torch.int64)
    qlens = torch.tensor(query_lens, dtype=torch.int64)
    num_seqs, num_tokens = len(query_lens), int(qlens.sum())

    #  token t belongs to seq s(t); its position is start[s] + (t - first_token[s])
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), qlens)
    first_token = torch.cumsum(qlens, 0) - qlens
    offset = torch.arange(num_tokens) - first_token[seq_of_token]
    positions = starts[seq_of_token] + offset
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    prefill = decode = None
    if num_prefill:
        p_starts, p_lens = starts[:num_prefill], qlens[:num_prefill]
        p_ctx = p_starts + p_lens
        n_blocks = -(-int(p_ctx.max()) // block_size)
        p_tables = tables[:num_prefill, :n_blocks]
        qmax = int(p_lens.max())
        n_p_tokens = int(p_lens.sum())
        fresh = num_prefill == 1 and int(p_starts[0]) == 0
        mask = None
        if not fresh:
            #  key j visible to query i of seq b  <=>  j <= start[b] + i  and  j < ctx[b]
            key = torch.arange(n_blocks * block_size)
            q_pos = p_starts[:, None] + torch.arange(qmax)[None, :]
            visible = (key[None, None, :] <= q_pos[:, :, None]) & (key[None, None, :] < p_ctx[:, None, None])
            mask = _additive(visible.unsqueeze(1), device, dtype)
        seq_index = query_offset = None
        if num_prefill > 1:
            seq_index = seq_of_token[:n_p_tokens].to(device)
            query_offset = offset[:n_p_tokens].to(device)
        prefill = PrefillGroup(n_p_tokens, num_prefill, qmax, p_tables.to(device), mask, seq_index, query_offset)
    if num_seqs > num_prefill:
        decode = _decode_group(starts[num_prefill:] + 1, tables[num_prefill:], block_size, device, dtype,
                               decode_backend)
    return AttentionMetadata(slots.to(device), positions.to(device), prefill, decode)


def _decode_group(ctx: torch.Tensor, tables: torch.Tensor, block_size: int, device: torch.device,
                  dtype: torch.dtype, backend: str) -> DecodeGroup:
    n_blocks = -(-int(ctx.max()) // block_size)
    group = DecodeGroup(int(ctx.shape[0]), tables[:, :n_blocks].to(device), ctx.to(device), backend)
    if backend == "padded":
        group.mask = _decode_mask(ctx, n_blocks, block_size, device, dtype)
    elif backend == "grouped":
        group.buckets = tuple(_buckets(ctx, tables, block_size, device, dtype))
    elif backend == "flashinfer":
        group.paged_kv = paged_kv_index(tables[:, :n_blocks], ctx, block_size).to(device)
    elif backend != "native":
        raise ValueError(f"unknown decode attention backend {backend!r}")
    return group


def _buckets(ctx, tables, block_size, device, dtype):
    #  bucket k holds the sequences needing (2^(k-1), 2^k] blocks, padded to the bucket's longest:
    #  at most 2x the keys each one owns, instead of up to max_context / own_context.
    blocks = -(-ctx // block_size)
    bucket_of = torch.ceil(torch.log2(blocks.double())).long()
    for k in torch.unique(bucket_of).tolist():
        rows = torch.nonzero(bucket_of == k).flatten()
        n_blocks = int(blocks[rows].max())
        yield DecodeBucket(rows.to(device), tables[rows, :n_blocks].to(device),
                           _decode_mask(ctx[rows], n_blocks, block_size, device, dtype))


def _decode_mask(ctx, n_blocks, block_size, device, dtype):
    key = torch.arange(n_blocks * block_size)
    return _additive((key[None, :] < ctx[:, None])[:, None, None, :], device, dtype)


def _additive(visible: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    mask = torch.zeros(visible.shape, dtype=dtype)
    return mask.masked_fill_(~visible, float("-inf")).to(device)


def _pad_tables(block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
    # Padding with block 0 is safe: padded keys sit beyond every context length and are masked.
    # Each table is copied as one slice into a zeroed int64 array the tensor then wraps (no copy):
    # 192 tables of ~50 blocks cost a third of a flat torch.tensor plus a masked scatter, and
    # under 512 entries a fifth to a half of torch.tensor of the padded nested list.
    width = max(len(t) for t in block_tables)
    if not width:
        return torch.zeros(len(block_tables), 0, dtype=torch.int64)
    flat = array("q", bytes(8 * width * len(block_tables)))
    for i, t in enumerate(block_tables):
        flat[i * width : i * width + len(t)] = array("q", t)
    return torch.frombuffer(flat, dtype=torch.int64).view(len(block_tables), width)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    write_cache: bool = True,
) -> torch.Tensor:
    """Writes this step's K/V into the cache (unless the caller already has: ``write_cache=False``),
    then attends. Returns [T, Hq * D]."""
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if write_cache:
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    outs = []
    if meta.prefill is not None:
        n = meta.prefill.num_tokens
        outs.append(_prefill(q[:n], k[:n], v[:n], k_cache, v_cache, meta.prefill, scale))
    if meta.decode is not None:
        n = meta.decode.num_seqs
        outs.append(_decode(q[q.shape[0] - n :], k_cache, v_cache, meta.decode, scale))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, Hkv, max_blocks*block_size, D] keys or values."""
    b, n = block_tables.shape
    num_blocks, block_size, heads, dim = cache.shape
    # index_select over whole blocks (rows of block_size*heads*dim) runs at memcpy speed;
    # advanced indexing on the 4-d view is several times slower.
    rows = cache.view(num_blocks, -1).index_select(0, block_tables.reshape(-1))
    return rows.view(b, n * block_size, heads, dim).transpose(1, 2)


def _decode(q, k_cache, v_cache, g: DecodeGroup, scale: float) -> torch.Tensor:
    if g.backend == "flashinfer":
        if g.kernel is None:
            raise ValueError("flashinfer decode: the step's metadata was not planned (ModelRunner plans it)")
        return g.kernel.run(q, k_cache, v_cache)
    if g.backend == "native":
        return _native_paged_decode()(q, k_cache, v_cache, g.block_tables, g.context_lens, scale, NATIVE_PARTITION)
    if g.backend == "grouped":
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for bucket in g.buckets:
            out[bucket.rows] = _decode_padded(q[bucket.rows], k_cache, v_cache, bucket.block_tables, bucket.mask, scale)
        return out
    return _decode_padded(q, k_cache, v_cache, g.block_tables, g.mask, scale)


def _native_paged_decode():
    # Looked up once, not per layer call: an import statement and the build lock on every call
    # were 2-3% of a small-batch decode step.
    global _PAGED_DECODE
    if _PAGED_DECODE is None:
        from .decode_kernels import native_module

        _PAGED_DECODE = native_module().paged_decode
    return _PAGED_DECODE


_PAGED_DECODE = None


def _decode_padded(q, k_cache, v_cache, block_tables, mask, scale: float) -> torch.Tensor:
    # One query per sequence: the G query heads sharing a KV head become SDPA's "query length",
    # so grouped-query attention needs no repeated K/V:  q [B, Hq, D] -> [B, Hkv, G, D].
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    out = F.scaled_dot_product_attention(
        q.reshape(b, hkv, hq // hkv, d), _gather(k_cache, block_tables), _gather(v_cache, block_tables),
        attn_mask=mask, scale=scale,
    )
    return out.reshape(b, hq * d)


def _prefill(q, k, v, k_cache, v_cache, g: PrefillGroup, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    if g.mask is None:
        # One sequence starting at position 0: its whole context is this step's K/V.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(0, 1).reshape(t, hq * d)
    if g.seq_index is None:
        qp = q.unsqueeze(0)
    else:
        qp = q.new_zeros(g.num_seqs, g.max_query_len, hq, d)
        qp[g.seq_index, g.query_offset] = q
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), _gather(k_cache, g.block_tables), _gather(v_cache, g.block_tables),
        attn_mask=g.mask, scale=scale, enable_gqa=True,
    ).transpose(1, 2)  # [B, Qmax, Hq, D]
    out = out[0] if g.seq_index is None else out[g.seq_index, g.query_offset]
    return out.reshape(t, hq * d)
