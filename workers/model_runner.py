"""The model runner: the only place a ``StepPlan`` becomes tensors.

Per step: block moves (swap out, swap in, copy-on-write), then one forward pass over the flat
token batch of every scheduled sequence, then sampling for the sequences that sample.
It owns the device KV cache and the host swap space (layout in ``kv_cache.py``).

On CUDA a decode-only step replays a captured CUDA graph (``cuda_graphs.py``) unless
``enforce_eager``; the decode attention there is FlashInfer's kernel (``cuda_decode.py``) where
it imports and suits the model, else the plain-torch reference.
"""
from __future__ import annotations

from itertools import accumulate, chain
from pathlib import Path
from typing import Sequence

import torch

from .attention import build_attention_metadata
from .cuda_decode import FlashInferDecode
from .cuda_graphs import DecodeGraphs, capture_sizes, padded_capture_sizes
from .decode_kernels import select_decode_backend
from .kv_cache import (KVFingerprint, KVLayout, allocate_host_cache, allocate_kv_cache, block_runs, gather_blocks,
                       scatter_blocks)
from .loader import load_weights
from .model import LlamaModel
from .model_config import ModelConfig
from .plan import SampledToken, ScheduledSeq, StepPlan, StepResult
from .sampler import SamplingBatch, sample


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model_path: Path,
        *,
        device: str,
        dtype: torch.dtype,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        decode_attention: str | None = None,
        max_num_seqs: int = 64,
        enforce_eager: bool = False,
    ):
        self.config = model_config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        # "padded" | "grouped" | "native" | "flashinfer" (decode_kernels.py); None: the
        # environment's, else the fastest for this device, dtype and head size
        self.decode_attention = select_decode_backend(self.device, decode_attention, dtype, model_config.head_dim)
        weights = load_weights(model_config, Path(model_path), device=self.device, dtype=dtype)
        self.model = LlamaModel(model_config, weights)
        self.kv_layout = KVLayout.for_model(model_config, block_size, dtype)
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        sizes = self._graph_sizes(max_num_seqs) if self.device.type == "cuda" and not enforce_eager else ()
        use_graphs = bool(sizes)
        # With graphs, one block past the block manager's: the padding rows' scratch (cuda_graphs.py).
        self.kv_cache = allocate_kv_cache(self.kv_layout, num_device_blocks + (1 if use_graphs else 0), self.device,
                                          huge_pages=True)
        self.host_cache = allocate_host_cache(self.kv_layout, num_host_blocks, pin=self.device.type == "cuda")
        self.flashinfer: FlashInferDecode | None = None  # the eager steps' kernel (flashinfer backend)
        if self.decode_attention == "flashinfer":
            self.flashinfer = self._flashinfer_kernel()
        self.graphs = self._capture_graphs(sizes) if use_graphs else None

    def _graph_sizes(self, max_num_seqs: int) -> tuple[int, ...]:
        """The decode batch sizes to capture as CUDA graphs (none for the CPU-style backends)."""
        sizes = capture_sizes(max_num_seqs)
        if self.decode_attention == "flashinfer":
            return sizes
        if self.decode_attention != "padded":
            return ()
        c, elem = self.config, torch.empty((), dtype=self.dtype).element_size()
        width = -(-c.max_model_len // self.block_size) * self.block_size
        return padded_capture_sizes(sizes, 2 * width * c.num_kv_heads * c.head_dim * elem)

    def _flashinfer_kernel(self, graph_batch_size: int | None = None, max_pages: int = 0) -> FlashInferDecode:
        c = self.config
        # Graph-mode kernels share the eager kernel's workspace: one step runs at a time.
        workspace = None if self.flashinfer is None else self.flashinfer.workspace
        return FlashInferDecode(self.device, self.dtype, c.num_heads, c.num_kv_heads, c.head_dim, self.block_size,
                                self.model.scale, workspace=workspace, graph_batch_size=graph_batch_size,
                                max_pages=max_pages)

    @torch.inference_mode()
    def _capture_graphs(self, sizes: tuple[int, ...]) -> DecodeGraphs:
        max_blocks = -(-self.config.max_model_len // self.block_size)
        make_kernel = None
        if self.decode_attention == "flashinfer":
            def make_kernel(size: int) -> FlashInferDecode:
                return self._flashinfer_kernel(size, size * max_blocks)
        return DecodeGraphs(self.model, self.kv_cache, sizes=sizes, max_blocks=max_blocks,
                            block_size=self.block_size, backend=self.decode_attention,
                            pad_block=self.num_device_blocks, make_kernel=make_kernel)

    def fingerprint(self) -> KVFingerprint:
        return KVFingerprint(self.kv_layout, self.config.architecture, self.config.model_id)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.weights.tensors())

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan, hidden_for: frozenset[int] = frozenset()) -> StepResult:
        """Moves blocks, computes the KV of every scheduled token, samples where asked; for the
        sampling seqs in ``hidden_for`` also returns their final hidden state (``StepResult.hidden``).
        A plan that breaks an invariant raises ``ValueError`` before anything is changed."""
        seqs = self._order_and_check(plan.seqs)
        self._move_blocks(plan)
        if not seqs:
            return StepResult()
        logits, hidden = self._forward(seqs, return_hidden=bool(hidden_for))
        samplers = [s for s in seqs if s.sampling is not None]     # one logits row each
        if not samplers:
            return StepResult()
        # (seq id, sampling) per sample; a fan-out samples several from its one logits row
        sampled = [(s.seq_id, s.sampling) for s in samplers]
        if any(s.fanout for s in samplers):
            rows = torch.tensor([i for i, s in enumerate(samplers) for _ in range(1 + len(s.fanout))],
                                device=logits.device)
            logits = logits.index_select(0, rows)
            hidden = None if hidden is None else hidden.index_select(0, rows)
            sampled = [x for s in samplers for x in ((s.seq_id, s.sampling), *s.fanout)]
        states = _hidden_rows(sampled, hidden, hidden_for)
        params = [p for _, p in sampled]
        out = sample(logits, SamplingBatch.from_params(params, self.config.vocab_size, self.device))
        token_ids = out.token_ids.tolist()
        if out.logprobs is None:
            return StepResult(tuple(SampledToken(sid, t) for (sid, _), t in zip(sampled, token_ids)), states)
        lps = out.logprobs.tolist()
        top_ids = out.top_ids.tolist() if out.top_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        result = []
        for i, ((sid, p), t) in enumerate(zip(sampled, token_ids)):
            n = p.logprobs
            if n is None:
                result.append(SampledToken(sid, t))
                continue
            top = tuple(zip(top_ids[i][:n], top_lps[i][:n])) if n and top_ids is not None else ()
            result.append(SampledToken(sid, t, lps[i], top))
        return StepResult(tuple(result), states)

    @torch.inference_mode()
    def compute_logits(self, plan: StepPlan) -> dict[int, torch.Tensor]:
        """Forward pass only (writes KV, moves blocks): seq_id -> float32 logits of its last token,
        for every sequence that would sample. Used to check numerics against a reference."""
        seqs = self._order_and_check(plan.seqs)
        self._move_blocks(plan)
        logits, _ = self._forward(seqs)
        return {s.seq_id: row for s, row in zip((s for s in seqs if s.sampling is not None), logits)}

    def _order_and_check(self, plan_seqs: Sequence[ScheduledSeq]) -> list[ScheduledSeq]:
        # Attention wants prefill chunks before single-token decodes (see attention.py).
        seqs = [s for s in plan_seqs if len(s.token_ids) > 1] + [s for s in plan_seqs if len(s.token_ids) == 1]
        if len(seqs) != len(plan_seqs):
            raise ValueError("every scheduled sequence must compute at least one token")
        self._check_tables(seqs)
        return seqs

    def _forward(self, seqs: list[ScheduledSeq], return_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [number of sampling seqs, vocab] in the order of ``seqs``, and with
        ``return_hidden`` their final-norm hidden states [same rows, hidden] (else None)."""
        qlens = [len(s.token_ids) for s in seqs]
        starts = [s.start_pos for s in seqs]
        tables = [s.block_table for s in seqs]
        if self.graphs is not None and qlens[0] == 1 and self.graphs.bucket(len(seqs)) is not None:
            # decode only (prefill chunks come first, so qlens[0] == 1 means none) and a bucket fits
            logits, hidden = self.graphs.run([s.token_ids[0] for s in seqs], starts, tables)
            rows = [i for i, s in enumerate(seqs) if s.sampling is not None]
            if len(rows) != len(seqs):
                index = torch.tensor(rows, device=self.device)
                logits, hidden = logits.index_select(0, index), hidden.index_select(0, index)
            return logits, hidden if return_hidden else None
        meta = build_attention_metadata(starts, qlens, tables, self.block_size, self.device, self.dtype,
                                        self.decode_attention)
        if meta.decode is not None and self.flashinfer is not None:
            meta.decode.kernel = self.flashinfer.plan(meta.decode.paged_kv)
        input_ids = torch.tensor(list(chain.from_iterable(s.token_ids for s in seqs)), dtype=torch.int64)
        # logits row of a sampling sequence = its last token in the flat batch
        ends = list(accumulate(qlens))
        logits_index = torch.tensor([e - 1 for e, s in zip(ends, seqs) if s.sampling is not None], dtype=torch.int64)
        out = self.model.forward(input_ids.to(self.device), meta, self.kv_cache, logits_index.to(self.device),
                                 return_hidden=return_hidden)
        return out if return_hidden else (out, None)

    def _check_tables(self, seqs: Sequence[ScheduledSeq]) -> None:
        bs, limit = self.block_size, self.config.max_model_len
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if end > limit:
                raise ValueError(f"seq {s.seq_id}: {end} tokens exceed the model's max_model_len {limit}")
            if len(s.block_table) * bs < end:
                raise ValueError(f"seq {s.seq_id}: block_table of {len(s.block_table)} blocks cannot hold {end} tokens")
            if s.block_table and not 0 <= min(s.block_table) <= max(s.block_table) < self.num_device_blocks:
                raise ValueError(f"seq {s.seq_id}: block_table has ids outside [0, {self.num_device_blocks})")

    # ---- block moves ------------------------------------------------------------------------

    def _move_blocks(self, plan: StepPlan) -> None:
        nd, nh = self.num_device_blocks, self.num_host_blocks
        out = _pairs(plan.blocks_to_swap_out, nd, nh, "swap_out")  # all checked before any moves
        into = _pairs(plan.blocks_to_swap_in, nh, nd, "swap_in")
        copy = _pairs(plan.blocks_to_copy, nd, nd, "copy")
        # Order matters: swap-out frees device blocks that swap-in or a copy may reuse this step.
        if out is not None:
            self.host_cache.index_copy_(2, out[1], self.kv_cache.index_select(2, out[0].to(self.device)).cpu())
        if into is not None:
            data = self.host_cache.index_select(2, into[0]).to(self.device, non_blocking=True)
            self.kv_cache.index_copy_(2, into[1].to(self.device), data)
        if copy is not None:
            src, dst = copy[0].to(self.device), copy[1].to(self.device)
            self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    # ---- KV access for transfer -------------------------------------------------------------

    @torch.no_grad()
    def read_blocks(self, block_ids: Sequence[int], device: str | torch.device | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """[L, 2, n, block_size, Hkv, D] contiguous copy of device blocks, in the given order, on
        ``device`` (default CPU; the cache's own device keeps it there, e.g. for NCCL sends), or
        into ``out`` (contiguous, that shape and dtype, any device; e.g. a shared-memory buffer
        a same-node receiver maps). (``no_grad``, not ``inference_mode``: callers may modify the
        copy they receive.)"""
        block_ids = self._check_ids(block_ids, self.num_device_blocks, "device")
        if out is not None:
            shape = self.kv_layout.shape(len(block_ids))
            if tuple(out.shape) != shape or out.dtype != self.kv_cache.dtype or not out.is_contiguous():
                raise ValueError(f"out must be a contiguous {self.kv_cache.dtype} tensor of shape {shape}, "
                                 f"got {out.dtype} {tuple(out.shape)}")
            return gather_blocks(self.kv_cache, block_ids, out=out)
        data = gather_blocks(self.kv_cache, block_ids)
        return data.to("cpu" if device is None else device)

    @torch.no_grad()
    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor, layers: slice | None = None) -> None:
        """Copy ``data`` into device blocks. ``layers`` (a step-1 slice) writes only those layers:
        ``data`` is then [len(layers), 2, n, bs, Hkv, D], so a receiver can write each layer as it
        arrives instead of staging the whole page set."""
        block_ids = self._check_ids(block_ids, self.num_device_blocks, "device")
        span = self._layer_span(layers)
        data = self._check_data(data, len(block_ids), span.stop - span.start)
        scatter_blocks(self.kv_cache[span], block_ids, data.to(self.device))

    def kv_views(self, block_ids: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """Writable views of the cache over ``block_ids``: one ``(position, view)`` per run of
        consecutive ids, ``view = kv_cache[:, :, first:first + len]`` (no copy). Writing into a
        view writes the cache; a transport receives into them without any staging buffer.
        Only valid while the caller owns the blocks (between ``import_request`` and commit)."""
        block_ids = self._check_ids(block_ids, self.num_device_blocks, "device")
        return [(pos, self.kv_cache[:, :, first:first + n]) for pos, first, n in block_runs(block_ids)]

    def _layer_span(self, layers: slice | None) -> slice:
        num_layers = self.kv_layout.num_layers
        if layers is None:
            return slice(0, num_layers)
        if not isinstance(layers, slice):
            raise ValueError(f"layers must be a slice, got {layers!r}")
        start, stop, step = layers.indices(num_layers)
        if step != 1 or stop <= start:
            raise ValueError(f"layers must be a non-empty step-1 slice of range({num_layers}), got {layers}")
        return slice(start, stop)

    @torch.no_grad()
    def read_host_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.host_cache.index_select(2, self._ids(block_ids, self.num_host_blocks, "host").cpu())

    @torch.no_grad()
    def write_host_blocks(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        ids = self._ids(block_ids, self.num_host_blocks, "host").cpu()
        self.host_cache.index_copy_(2, ids, self._check_data(data, len(ids)).cpu())

    def _ids(self, block_ids: Sequence[int], limit: int, where: str) -> torch.Tensor:
        ids = torch.tensor(self._check_ids(block_ids, limit, where), dtype=torch.int64)
        return ids.to(self.device) if where == "device" else ids

    @staticmethod
    def _check_ids(block_ids: Sequence[int], limit: int, where: str) -> list[int]:
        ids = [int(b) for b in block_ids]
        if ids and not (0 <= min(ids) and max(ids) < limit):
            raise ValueError(f"{where} block ids must be in [0, {limit}), got {ids}")
        return ids

    def _check_data(self, data: torch.Tensor, n: int, num_layers: int | None = None) -> torch.Tensor:
        want = self.kv_layout.shape(n)
        if num_layers is not None:
            want = (num_layers, *want[1:])
        if tuple(data.shape) != want:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {want}")
        if data.dtype != self.dtype:
            raise ValueError(f"KV data has dtype {data.dtype}, this cache holds {self.dtype}")
        return data


def _hidden_rows(sampled: list[tuple[int, object]], hidden: torch.Tensor | None,
                 wanted: frozenset[int]) -> tuple[tuple[int, tuple[float, ...]], ...]:
    if hidden is None:
        return ()
    rows = [i for i, (sid, _) in enumerate(sampled) if sid in wanted]
    if not rows:
        return ()
    data = hidden.index_select(0, torch.tensor(rows, device=hidden.device)).float().cpu().tolist()
    return tuple((sampled[i][0], tuple(v)) for i, v in zip(rows, data))


def _pairs(pairs, src_limit: int, dst_limit: int, what: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not pairs:
        return None
    t = torch.tensor(pairs, dtype=torch.int64).view(-1, 2)
    if not (0 <= int(t[:, 0].min()) and int(t[:, 0].max()) < src_limit and 0 <= int(t[:, 1].min())
            and int(t[:, 1].max()) < dst_limit):
        raise ValueError(f"blocks_to_{what} has ids out of range: {list(pairs)}")
    return t[:, 0].contiguous(), t[:, 1].contiguous()

