"""The model's shape, read from a Hugging Face ``config.json``.

Only the Llama family is served (Llama, Qwen2, Mistral share one decoder: RMSNorm, RoPE,
SwiGLU MLP, grouped-query attention). Anything this engine would silently compute wrong
(another activation, an unknown RoPE scaling, an MLP bias) is refused with a
``ModelConfigError`` naming the field, instead of producing plausible garbage.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = ("float32", "float16", "bfloat16")


class ModelConfigError(ValueError):
    """A config.json value is missing or unsupported; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """How rotary frequencies are rescaled for long context (``rope_type`` "linear" or "llama3")."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    attention_bias: bool  # q/k/v projections carry a bias (always for Qwen2)
    tie_word_embeddings: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mistral-style sliding window. The engine attends to the full context, which equals windowed
    # attention only while a sequence fits the window, so max_model_len is capped at it.
    sliding_window: int | None = None
    model_id: str = ""  # blake2b of config.json: part of the KV fingerprint

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.q_size + 2 * self.kv_size) + (self.q_size + 2 * self.kv_size if self.attention_bias else 0)
        per_layer = qkv + self.q_size * h + 3 * h * i + 2 * h
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * per_layer + h

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model directory {str(path)!r} has no config.json")
        raw = config_file.read_bytes()
        try:
            d = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{config_file} is not valid JSON: {e}") from e
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
        return cls.from_dict(d, generation_config=gen, model_id=hashlib.blake2b(raw, digest_size=16).hexdigest())

    @classmethod
    def from_dict(
        cls, d: dict[str, Any], *, generation_config: dict | None = None, model_id: str = ""
    ) -> "ModelConfig":
        archs = d.get("architectures")
        if not archs:
            raise ModelConfigError("config field 'architectures' is missing")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelConfigError(
                f"config field 'architectures' = {arch!r} is not supported; use one of {SUPPORTED_ARCHITECTURES}"
            )

        hidden = _int(d, "hidden_size")
        heads = _int(d, "num_attention_heads")
        kv_heads = _int(d, "num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"config field 'num_key_value_heads' = {kv_heads} must divide num_attention_heads = {heads}"
            )
        head_dim = d.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ModelConfigError(
                    f"config field 'hidden_size' = {hidden} is not divisible by num_attention_heads = {heads}"
                )
            head_dim = hidden // heads
        head_dim = _int({"head_dim": head_dim}, "head_dim")
        if head_dim % 2:
            raise ModelConfigError(f"config field 'head_dim' = {head_dim} must be even for rotary embeddings")

        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"config field 'hidden_act' = {act!r} is not supported (only 'silu')")
        if d.get("mlp_bias", False):
            raise ModelConfigError("config field 'mlp_bias' = true is not supported")
        if d.get("pretraining_tp", 1) not in (1, None):
            raise ModelConfigError(f"config field 'pretraining_tp' = {d['pretraining_tp']} is not supported (only 1)")

        rope_theta, rope_scaling = _rope(d)
        dtype = d.get("torch_dtype", d.get("dtype")) or "float32"
        if dtype not in _DTYPES:
            raise ModelConfigError(f"config field 'torch_dtype' = {dtype!r} is not supported; use one of {_DTYPES}")

        # Qwen2 checkpoints have q/k/v biases without declaring them.
        attention_bias = bool(d.get("attention_bias", arch == "Qwen2ForCausalLM"))
        sliding_window = d.get("sliding_window")
        if arch == "Qwen2ForCausalLM" and not d.get("use_sliding_window", False):
            sliding_window = None
        if sliding_window is not None:
            sliding_window = _int({"sliding_window": sliding_window}, "sliding_window")

        eos = (generation_config or {}).get("eos_token_id", d.get("eos_token_id"))
        eos_ids = () if eos is None else (tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),))

        return cls(
            architecture=arch,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(d, "intermediate_size"),
            num_layers=_int(d, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", default=1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(d, "max_position_embeddings"),
            attention_bias=attention_bias,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=dtype,
            eos_token_ids=eos_ids,
            bos_token_id=d.get("bos_token_id"),
            sliding_window=sliding_window,
            model_id=model_id,
        )


def _rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling from either layout: transformers>=5 nests both in ``rope_parameters``;
    older configs have top-level ``rope_theta`` and ``rope_scaling``."""
    params = d.get("rope_parameters")
    field = "rope_parameters" if params is not None else "rope_scaling"
    if params is None:
        params = d.get("rope_scaling") or {}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    theta = _float({"rope_theta": theta}, "rope_theta")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ModelConfigError(
            f"config field '{field}.rope_type' = {rope_type!r} is not supported; use one of {_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    factor = params.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 0:
        raise ModelConfigError(f"config field '{field}.factor' must be a positive number, got {factor!r}")
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(factor))
    try:
        scaling = RopeScaling(
            "llama3",
            float(factor),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelConfigError(
            f"config field '{field}.{e.args[0]}' is missing (required by rope_type 'llama3')"
        ) from None
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        raise ModelConfigError(f"config field '{field}.high_freq_factor' must exceed low_freq_factor")
    return theta, scaling


def _int(d: dict[str, Any], name: str, default: int | None = None) -> int:
    v = d.get(name, default)
    if v is None:
        raise ModelConfigError(f"config field {name!r} is missing")
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ModelConfigError(f"config field {name!r} must be a positive integer, got {v!r}")
    return v


def _float(d: dict[str, Any], name: str, default: float | None = None) -> float:
    v = d.get(name, default)
    if v is None:
        raise ModelConfigError(f"config field {name!r} is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ModelConfigError(f"config field {name!r} must be a positive number, got {v!r}")
    return float(v)
