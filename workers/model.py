"""Llama-family decoder (Llama, Qwen2, Mistral) over a paged KV cache.

Weights are plain tensors, not ``nn.Module``s: the forward pass is a straight line of torch ops
with nothing per call but the ops themselves. Projections are fused at load time so each layer
runs three matmuls plus the output projection::

    x ─norm─▶ [q|k|v] = x·W_qkv (+b) ─rope(q,k)─▶ paged attention ─▶ ·W_o ─(+x)─▶ h
    h ─norm─▶ [gate|up] = h·W_gate_up ─▶ silu(gate)·up ─▶ ·W_down ─(+h)─▶ next layer

Logits are computed only for the rows that sample (the last token of each sampling sequence),
which for a long prefill chunk is one row instead of thousands.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, paged_attention
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
            yield from (t for t in vars(layer).values() if t is not None)
        yield self.norm
        if self.lm_head is not self.embed:
            yield self.lm_head


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
    def __init__(self, config: ModelConfig, weights: ModelWeights):
        self.config = config
        self.weights = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.scale = config.head_dim**-0.5
        self._qk_heads = config.num_heads + config.num_kv_heads
        self.linear = pick_linear(self.device, self.dtype)

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
        if logits_index.shape[0] != t:
            h = h.index_select(0, logits_index)
        h = F.rms_norm(h, (c.hidden_size,), w.norm, c.rms_norm_eps)
        logits = linear(h, w.lm_head).float()
        return (logits, h) if return_hidden else logits


def pick_linear(device: torch.device, dtype: torch.dtype):
    """``F.linear``, except for fp32 on CPU: there torch calls MKL's sgemv/sgemm, which at the
    small batch sizes of decoding runs on one core and reaches about half the memory bandwidth;
    oneDNN's inner product (what torch already uses for bf16) streams the weights on every core."""
    if device.type != "cpu" or dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return F.linear
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.ones(2, 3), torch.ones(4, 3)
        if not torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w)):
            return F.linear
    except (AttributeError, RuntimeError):
        return F.linear

    def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return op(x, weight, bias, "none", [], "")

    return onednn_linear


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    #  x = [x1 | x2] (halves of head_dim);  rot(x) = [-x2 | x1];  out = x·cos + rot(x)·sin
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
