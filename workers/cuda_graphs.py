"""CUDA graphs for decode steps: capture once per batch-size bucket, replay every step.

A decode step of a small model is a few hundred tiny kernel launches; on a GPU the launches,
not the arithmetic, set its time. A captured graph replays them all as one launch. Like vLLM
and SGLang, the runner captures at start-up one graph per bucket of batch sizes (1, 2, 4, then
every 8 up to ``max_num_seqs``), each reading fixed-address input buffers; a step of ``n``
decodes pads to the smallest bucket ``>= n`` and replays it::

    step: 5 decodes          bucket 8
    input_ids   [t0 t1 t2 t3 t4 | 0  0  0 ]   rows 5-7 are padding: token 0 at position 0,
    positions   [p0 p1 p2 p3 p4 | 0  0  0 ]   writing its K/V into slot 0 of the pad block (one
    tables      [T0 T1 T2 T3 T4 |[P][P][P]]   block past those the block manager owns) and
                                              attending over that one key; their logits are dropped

Steps with prefill tokens, or more decodes than the largest bucket, run eagerly. The tables
are padded to the model's longest context (``max_blocks``), so one graph serves every length;
the padded reference then gathers that whole width, so it captures only the buckets whose gather
fits ``PADDED_GATHER_BYTES`` (FlashInfer reads in place and captures them all).
``enforce_eager`` (``EngineConfig``) turns graphs off.

The bucket choice, the padding and the buffer filling are plain Python/torch and are tested on
CPU (``tests/workers/test_cuda_decode.py``) by running the model on the filled buffers without
capture; capture and replay need a GPU (``tests/workers/test_cuda_decode_gpu.py``).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .attention import AttentionMetadata, DecodeGroup, build_attention_metadata


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, then multiples of 8, and ``max_num_seqs`` itself,
    none above it. A step pads by fewer than 8 rows beyond batch 8."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs} | set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


# The padded reference gathers every row's K and V at the graphs' full width (the model's longest
# context) in each layer: capture only the buckets whose gather stays under this.
PADDED_GATHER_BYTES = 256 << 20


def padded_capture_sizes(sizes: Sequence[int], gather_bytes_per_seq: int,
                         budget: int = PADDED_GATHER_BYTES) -> tuple[int, ...]:
    """The buckets of ``sizes`` the padded backend captures: those whose per-layer K+V gather
    (``gather_bytes_per_seq`` per row) fits ``budget``; larger batches run eagerly, padded only
    to their own longest context. FlashInfer reads in place and captures every bucket."""
    return tuple(s for s in sizes if s * gather_bytes_per_seq <= budget)


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding ``num_seqs`` decodes (``sizes`` ascending), or None:
    the step runs eagerly."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if num_seqs >= 1 and i < len(sizes) else None


def pad_decode_batch(token_ids: Sequence[int], start_pos: Sequence[int], block_tables: Sequence[Sequence[int]],
                     size: int, pad_block: int) -> tuple[list[int], list[int], list[Sequence[int]]]:
    """A decode batch padded to ``size`` rows: each padding row decodes token 0 at position 0 in
    ``pad_block`` (so it writes only there and reads one key there)."""
    n = len(token_ids)
    if not len(start_pos) == len(block_tables) == n or n > size:
        raise ValueError(f"{n} token ids, {len(start_pos)} positions and {len(block_tables)} tables "
                         f"cannot pad to {size} rows")
    pad = size - n
    return [*token_ids, *[0] * pad], [*start_pos, *[0] * pad], [*block_tables, *[(pad_block,)] * pad]


class StaticDecodeInputs:
    """The fixed-address inputs of one captured decode step of ``size`` rows.

    ``fill`` writes a padded batch into them: the metadata is built by the same
    ``build_attention_metadata`` as an eager step, on the host, then copied in (the block tables
    and the padded backend's mask at their full width ``max_blocks``); a ``flashinfer`` kernel
    is planned on the batch's page list into its own fixed buffers."""

    def __init__(self, size: int, max_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 backend: str, kernel=None):
        if backend not in ("padded", "flashinfer"):
            raise ValueError(f"decode graphs capture the padded or flashinfer backend, not {backend!r}")
        self.size, self.max_blocks, self.block_size, self.dtype, self.backend = size, max_blocks, block_size, dtype, backend
        self.device, self.kernel = device, kernel
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.logits_index = torch.arange(size, device=device)
        tables = torch.zeros(size, max_blocks, dtype=torch.int64, device=device)
        context_lens = torch.ones(size, dtype=torch.int64, device=device)
        mask = None
        if backend == "padded":
            mask = torch.zeros(size, 1, 1, max_blocks * block_size, dtype=dtype, device=device)
        decode = DecodeGroup(size, tables, context_lens, backend, mask=mask, kernel=kernel)
        self.meta = AttentionMetadata(torch.zeros(size, dtype=torch.int64, device=device),
                                      torch.zeros(size, dtype=torch.int64, device=device), None, decode)

    def fill(self, token_ids: Sequence[int], start_pos: Sequence[int], block_tables: Sequence[Sequence[int]]) -> None:
        """Copies one padded batch (``size`` rows, see ``pad_decode_batch``) into the buffers."""
        if len(token_ids) != self.size:
            raise ValueError(f"a batch of {len(token_ids)} rows does not fill a {self.size}-row graph")
        step = build_attention_metadata(start_pos, [1] * self.size, block_tables, self.block_size,
                                        torch.device("cpu"), self.dtype, self.backend)
        d, g = step.decode, self.meta.decode
        width = d.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a context of {width} blocks exceeds the graphs' {self.max_blocks}")
        self.input_ids.copy_(torch.tensor(token_ids, dtype=torch.int64))
        self.meta.positions.copy_(step.positions)
        self.meta.slot_mapping.copy_(step.slot_mapping)
        g.context_lens.copy_(d.context_lens)
        g.block_tables[:, :width].copy_(d.block_tables)
        g.block_tables[:, width:].zero_()  # any valid id: the columns past a context are never read
        if g.mask is not None:
            g.mask[..., : width * self.block_size].copy_(d.mask)
            g.mask[..., width * self.block_size :].fill_(float("-inf"))
        if self.kernel is not None:
            self.kernel.plan(d.paged_kv.to(self.device))


@dataclass
class _Captured:
    graph: "torch.cuda.CUDAGraph"
    inputs: StaticDecodeInputs
    logits: torch.Tensor  # [size, vocab]: the graph's output buffer, rewritten by each replay
    hidden: torch.Tensor  # [size, hidden]


class DecodeGraphs:
    """One captured decode step per bucket size of ``sizes``, on ``model`` over ``kv_cache``.

    ``make_kernel(size)`` gives the flashinfer backend's graph-mode kernel for a bucket (None for
    ``padded``). ``pad_block`` is a cache block no sequence owns (the runner allocates it)."""

    def __init__(self, model, kv_cache: torch.Tensor, *, sizes: Sequence[int], max_blocks: int, block_size: int,
                 backend: str, pad_block: int, make_kernel: Callable[[int], object] | None = None):
        self.sizes = tuple(sorted(sizes))
        self.pad_block = pad_block
        self.device = kv_cache.device
        self.num_replays = 0
        self._graphs: dict[int, _Captured] = {}
        with torch.cuda.device(self.device):  # streams and the pool on the cache's GPU, not the current one
            self._capture(model, kv_cache, max_blocks, block_size, backend, make_kernel)

    def _capture(self, model, kv_cache, max_blocks, block_size, backend, make_kernel) -> None:
        pad_block = self.pad_block
        pool = torch.cuda.graph_pool_handle()
        forward = model.forward
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            kernel = make_kernel(size) if make_kernel is not None else None
            inputs = StaticDecodeInputs(size, max_blocks, block_size, kv_cache.device, kv_cache.dtype, backend, kernel)
            inputs.fill(*pad_decode_batch([], [], [], size, pad_block))
            args = (inputs.input_ids, inputs.meta, kv_cache, inputs.logits_index)
            # One eager run first, on a side stream as capture needs: lazy initialisation (cuBLAS
            # handles, FlashInfer's JIT kernels) must not happen inside the capture.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(*args, return_hidden=True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits, hidden = forward(*args, return_hidden=True)
            self._graphs[size] = _Captured(graph, inputs, logits, hidden)
        torch.cuda.synchronize()

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def run(self, token_ids: Sequence[int], start_pos: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [n, vocab] and final-norm hidden states [n, hidden] of a decode-only batch of
        ``n <= max(sizes)`` (copies: the graph's own buffers are rewritten by its next replay)."""
        n = len(token_ids)
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"no captured decode graph holds {n} sequences (sizes {self.sizes})")
        c = self._graphs[size]
        c.inputs.fill(*pad_decode_batch(token_ids, start_pos, block_tables, size, self.pad_block))
        with torch.cuda.device(self.device):
            c.graph.replay()
        self.num_replays += 1
        return c.logits[:n].clone(), c.hidden[:n].clone()
