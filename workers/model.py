"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Weights are plain tensors, not ``nn.Module``s: the forward pass is a straight line of torch ops
with nothing per call but the ops themselves. Projections are fused at load time so each layer
runs three matmuls plus the output projection::

    x ─norm─▶ [q|k|v] = x·W_qkv (+b) ─rope(q,k)─▶ paged attention ─▶ ·W_o ─(+x)─▶ h
    h ─norm─▶ [gate|up] = h·W_gate_up ─▶ silu(gate)·up ─▶ ·W_down ─(+h)─▶ next layer

Logits are computed only for the rows that sample (the last token of each sampling sequence),
which for a long prefill chunk is one row instead of thousands.

On CPU a layer is two native calls around attention (``csrc/layer_blocks.cpp``): projections on
the native fp32 GEMM over weights packed at load (``csrc/gemm.cpp``), and between them the fused
residual add + RMSNorm, rope + KV cache write and silu·mul (``csrc/fused_ops.cpp``), instead of
about twenty torch ops. The plain-torch ops stay as the reference (``fused=False``,
``THINKSERVE_FUSED_OPS=0``, or when the extension cannot build) and the fused path is tested
against them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import host_memory
from .attention import NATIVE_PARTITION, AttentionMetadata, paged_attention
from .decode_kernels import select_fused_ops
from .model_config import ModelConfig, RopeScaling


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2*kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2*kv_size] (Qwen2)
    o: torch.Tensor  # [hidden, q_size]
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2*intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same tensor as embed when tied

    def tensors(self):
        yield self.embed
        for layer in self.layers:
            yield from (getattr(t, "data", t) for t in vars(layer).values() if t is not None)
        yield self.norm
        if self.lm_head is not self.embed:
            yield getattr(self.lm_head, "data", self.lm_head)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Rotary inverse frequencies [head_dim/2] (float32), with linear or Llama-3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s: RopeScaling | None = config.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "linear":
        return inv_freq / s.factor
    # Llama 3: keep high frequencies (short wavelengths), divide low ones by `factor`, and blend
    # linearly in between:
    #   wavelen < orig/high_ff      ──▶ unchanged
    #   wavelen > orig/low_ff       ──▶ inv_freq / factor
    #   otherwise                   ──▶ (1-a)·inv_freq/factor + a·inv_freq,
    #                                   a = (orig/wavelen - low_ff) / (high_ff - low_ff)
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    a = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - a) * scaled / s.factor + a * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: ModelWeights, fused: bool | None = None):
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.scale = config.head_dim**-0.5
        self._qk_heads = config.num_heads + config.num_kv_heads
        self.fused_ops = select_fused_ops(self.device, fused)  # None: the plain-torch reference
        self.linear, pack = pick_linear(self.device, self.dtype, self.fused_ops)
        if pack is not None:
            _pack_weights(weights, pack)
        self._layer_args = self._fused_layer_args() if self.fused_ops is not None else None
        self._views_of, self._views, self._k_caches, self._v_caches = None, [], [], []

    def rope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] for the half-split rotation, computed once per step in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        logits_index: torch.Tensor,  # [S] rows of the batch whose logits are wanted
        return_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [S, vocab] float32 (and [S, hidden] after the final norm)
        if self.fused_ops is not None:
            return self._forward_fused(input_ids, meta, kv_cache, logits_index, return_hidden)
        c, w = self.config, self.weights
        t = input_ids.shape[0]
        q_size, kv_size, d = c.q_size, c.kv_size, c.head_dim
        cos, sin = self.rope_cos_sin(meta.positions)
        linear = self.linear
        h = F.embedding(input_ids, w.embed)
        for i, layer in enumerate(w.layers):
            x = F.rms_norm(h, (c.hidden_size,), layer.input_norm, c.rms_norm_eps)
            qkv = linear(x, layer.qkv, layer.qkv_bias)
            # q and k rotate together: one rope over [T, Hq+Hkv, D]
            qk = _rope(qkv[:, : q_size + kv_size].view(t, self._qk_heads, d), cos, sin)
            v = qkv[:, q_size + kv_size :].view(t, c.num_kv_heads, d)
            attn = paged_attention(qk[:, : c.num_heads], qk[:, c.num_heads :], v, kv_cache[i], meta, self.scale)
            h = h + linear(attn, layer.o)
            x = F.rms_norm(h, (c.hidden_size,), layer.post_attention_norm, c.rms_norm_eps)
            gate, up = linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + linear(F.silu(gate) * up, layer.down)
        return self._logits(h, logits_index, return_hidden)

    def _forward_fused(self, input_ids, meta, kv_cache, logits_index, return_hidden):
        # The same layer as ``forward``, as two native calls around attention (csrc/layer_blocks.cpp),
        # with the residual stream ``h`` updated in place:
        #   x = attention_in_(...)   qkv projection, rope, K/V into the cache
        #   x = attention_out(...)   h += attn·W_o; MLP of norm(h); h += it; x = next layer's norm(h)
        # (a decode-only step on the native kernel: every layer's three in one call, decode_layers)
        c, w, ops = self.config, self.weights, self.fused_ops
        t, d, eps, hq, hkv = input_ids.shape[0], c.head_dim, c.rms_norm_eps, c.num_heads, c.num_kv_heads
        q_size, kv_size = c.q_size, c.kv_size
        freqs = meta.positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()  # [T, D/2] fp32, once per step
        h = F.embedding(input_ids, w.embed)
        x = F.rms_norm(h, (c.hidden_size,), w.layers[0].input_norm, eps)
        attention_in, attention_out, slots = ops.attention_in_, ops.attention_out, meta.slot_mapping
        g = meta.decode
        if meta.prefill is None and g is not None and g.backend == "native":
            # every sequence decodes one token: one native call for all layers (decode_layers), the
            # same three ops per layer as the loop below without the Python between them, and on
            # several threads one parallel region for the step (csrc/team.h)
            self._cache_views(kv_cache)
            x = ops.decode_layers(x, h, self._layer_args, self._k_caches, self._v_caches, cos, sin, slots, hq, hkv,
                                  g.block_tables, g.context_lens, self.scale, NATIVE_PARTITION, eps)
            return self._logits(h.add_(x), logits_index, return_hidden)
        for (qkv_w, qkv_n, qkv_b, o_w, o_n, post_norm, gu_w, gu_n, down_w, down_n, next_norm), (layer_cache, k_cache,
                v_cache) in zip(self._layer_args, self._cache_views(kv_cache)):
            qkv = attention_in(x, qkv_w, qkv_n, qkv_b, cos, sin, slots, k_cache, v_cache, hq, hkv)
            q = qkv[:, :q_size].view(t, hq, d)
            k = qkv[:, q_size : q_size + kv_size].view(t, hkv, d)
            v = qkv[:, q_size + kv_size :].view(t, hkv, d)
            attn = paged_attention(q, k, v, layer_cache, meta, self.scale, write_cache=False)
            x = attention_out(attn, h, o_w, o_n, post_norm, gu_w, gu_n, down_w, down_n, next_norm, eps)
        return self._logits(h.add_(x), logits_index, return_hidden)

    def _fused_layer_args(self) -> list[tuple]:
        # Each layer's arguments to the native calls, built once: a weight is passed as (tensor,
        # out_features), the tensor packed (PackedWeight.data) or plain.
        def weight(t):
            return (t.data, t.out_features) if type(t) is PackedWeight else (t, t.shape[0])

        layers = self.weights.layers
        return [(*weight(layer.qkv), layer.qkv_bias, *weight(layer.o), layer.post_attention_norm, *weight(layer.gate_up),
                 *weight(layer.down), layers[i + 1].input_norm if i + 1 < len(layers) else None)
                for i, layer in enumerate(layers)]

    def _cache_views(self, kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        # (layer, K, V) views of the runner's cache, made once: indexing a tensor from Python
        # costs microseconds, three times per layer and step.
        if self._views_of is not kv_cache:
            self._views = [(layer, layer[0], layer[1]) for layer in kv_cache]
            self._k_caches, self._v_caches = [k for _, k, _ in self._views], [v for _, _, v in self._views]
            self._views_of = kv_cache
        return self._views

    def _logits(self, h, logits_index, return_hidden):
        c, w = self.config, self.weights
        if logits_index.shape[0] != h.shape[0]:
            h = h.index_select(0, logits_index)
        h = F.rms_norm(h, (c.hidden_size,), w.norm, c.rms_norm_eps)
        logits = self.linear(h, w.lm_head).float()
        return (logits, h) if return_hidden else logits


@dataclass(frozen=True)
class PackedWeight:
    """A [out_features, in_features] weight in the native GEMM's panel layout (``csrc/gemm.cpp``)."""
    data: torch.Tensor  # [ceil(out_features / 16), in_features, 16]
    out_features: int


def pick_linear(device: torch.device, dtype: torch.dtype, fused_ops=None):
    """``(linear, pack)``: ``F.linear`` and no packing, except for fp32 on CPU.

    With the fused native ops (``fused_ops``), fp32 projections run ``csrc/gemm.cpp`` on weights
    packed once at load: at decoding's 1-256 rows a projection of a small model is microseconds
    of arithmetic that oneDNN wraps in 15-40 µs of per-call set-up. Without them (the reference,
    ``THINKSERVE_FUSED_OPS=0``) torch's own: MKL's sgemv/sgemm runs small batches on one core at
    about half the memory bandwidth, so oneDNN's inner product is used, its weights reordered
    once at load into its blocked layout (``pack``), which skips a per-call reorder that costs
    1.4-2x at 4-64 rows."""
    if device.type != "cpu" or dtype != torch.float32:
        return F.linear, None
    if fused_ops is not None:
        packed_linear, pack_weight = fused_ops.packed_linear, fused_ops.pack_linear_weight

        def native_linear(x: torch.Tensor, weight: PackedWeight | torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
            if type(weight) is not PackedWeight:  # a tied lm_head stays the plain embedding
                return F.linear(x, weight, bias)
            return packed_linear(x, weight.data, weight.out_features, bias)

        return native_linear, _NativePack(pack_weight)
    if not torch.backends.mkldnn.is_available():
        return F.linear, None
    try:
        op, pack = torch.ops.mkldnn._linear_pointwise, torch.ops.mkldnn._reorder_linear_weight
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        if not (torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w))
                and torch.equal(op(x, pack(w, None), None, "none", [], ""), F.linear(x, w))):
            return F.linear, None
    except (AttributeError, RuntimeError):
        return F.linear, None

    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return op(x, weight, bias, "none", [], "")

    return onednn_linear, lambda w: pack(w, None)


class _NativePack:
    """Packs an fp32 [N, K] weight for ``csrc/gemm.cpp``, into ``out`` (a slice of the arena
    ``_pack_weights`` allocates) when given."""

    def __init__(self, pack_weight):
        self.pack_weight = pack_weight

    @staticmethod
    def numel(w: torch.Tensor) -> int:  # [ceil(N/16), K, 16]: a multiple of 16 floats (64 bytes)
        return -(-w.shape[0] // 16) * w.shape[1] * 16

    def __call__(self, w: torch.Tensor, out: torch.Tensor | None = None) -> PackedWeight:
        return PackedWeight(self.pack_weight(w, out), w.shape[0])


def _pack_weights(weights: ModelWeights, pack) -> None:
    # In place: the packed copy replaces the plain one (no second copy of the weights in memory).
    # A tied lm_head stays plain: the embedding lookup needs the plain layout.
    # The native GEMM's weights go into one arena on transparent huge pages (host_memory.py), one
    # matrix after another: a batch-1 step streams them all, and on 4 KiB pages (torch's allocator)
    # that stream ran at 18 GB/s against 26 GB/s on huge pages (512 MiB, 1 thread, same process).
    slots = [(layer, name) for layer in weights.layers for name in ("qkv", "o", "gate_up", "down")]
    if weights.lm_head is not weights.embed:
        slots.append((weights, "lm_head"))
    if not isinstance(pack, _NativePack):
        for owner, name in slots:
            setattr(owner, name, pack(getattr(owner, name)))
        return
    sizes = [pack.numel(getattr(owner, name)) for owner, name in slots]
    arena = host_memory.zeros((sum(sizes),), torch.float32)
    offset = 0
    for (owner, name), size in zip(slots, sizes):
        setattr(owner, name, pack(getattr(owner, name), arena[offset:offset + size]))
        offset += size


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    #  x = [x1 | x2] (halves of head_dim);  rot(x) = [-x2 | x1];  out = x·cos + rot(x)·sin
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
