"""Finding a model and loading its safetensors weights into the fused layout of ``model.py``.

Hugging Face parameter names map onto fused tensors::

    model.layers.{i}.self_attn.{q,k,v}_proj.weight ──cat──▶ layers[i].qkv       (+ .bias for Qwen2)
    model.layers.{i}.mlp.{gate,up}_proj.weight     ──cat──▶ layers[i].gate_up
    lm_head.weight (absent when tied)              ──────▶ lm_head = embed

Only safetensors are read (never pickle): a single ``model.safetensors`` or shards listed in
``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from .model import LayerWeights, ModelWeights
from .model_config import ModelConfig

TINY_REASONER = "tiny-reasoner"
_PACKAGE_MODELS = Path(__file__).resolve().parent / "models"


def resolve_model_path(name_or_path: str | Path) -> Path:
    """``"tiny-reasoner"`` is the model shipped in the package; anything else is a directory."""
    if str(name_or_path) == TINY_REASONER:
        path = _PACKAGE_MODELS / "tiny_reasoner"
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the shipped model {TINY_REASONER!r} is not installed: {path} has no config.json "
                "(it is produced by the tiny-reasoner training script)"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model {str(name_or_path)!r} is neither {TINY_REASONER!r} nor an existing directory")
    return path


def load_generation_eos_ids(path: Path) -> tuple[int, ...]:
    """EOS ids, preferring generation_config.json over config.json (as HF generate does)."""
    for name in ("generation_config.json", "config.json"):
        f = path / name
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)
    return ()


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shard(s) that do not exist: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"model directory {str(path)!r} has no model.safetensors or model.safetensors.index.json")


class _Checkpoint:
    """Tensors read on demand, so loading holds one layer's worth of unfused tensors at a time
    rather than a second copy of the whole model."""

    def __init__(self, path: Path):
        self._handles = [safe_open(str(f), framework="pt", device="cpu") for f in safetensors_files(path)]
        self.where = {name: h for h in self._handles for name in h.keys()}

    def get(self, name: str) -> torch.Tensor | None:
        h = self.where.get(name)
        return None if h is None else h.get_tensor(name)


def load_weights(config: ModelConfig, path: Path, *, device: str | torch.device, dtype: torch.dtype) -> ModelWeights:
    ckpt = _Checkpoint(path)
    used: set[str] = set()

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = ckpt.get(name)
        if t is None:
            raise ValueError(f"checkpoint {path} is missing tensor {name!r}")
        if tuple(t.shape) != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(t.shape)}, config implies {shape}")
        used.add(name)
        return t

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    c = config
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    layers = []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + "self_attn.q_proj.weight", (q, h)), take(p + "self_attn.k_proj.weight", (kv, h)),
                         take(p + "self_attn.v_proj.weight", (kv, h))])
        bias = None
        if c.attention_bias:
            bias = put(torch.cat([take(p + "self_attn.q_proj.bias", (q,)), take(p + "self_attn.k_proj.bias", (kv,)),
                                  take(p + "self_attn.v_proj.bias", (kv,))]))
        gate_up = torch.cat([take(p + "mlp.gate_proj.weight", (inter, h)), take(p + "mlp.up_proj.weight", (inter, h))])
        layers.append(LayerWeights(
            input_norm=put(take(p + "input_layernorm.weight", (h,))),
            qkv=put(qkv),
            qkv_bias=bias,
            o=put(take(p + "self_attn.o_proj.weight", (h, q))),
            post_attention_norm=put(take(p + "post_attention_layernorm.weight", (h,))),
            gate_up=put(gate_up),
            down=put(take(p + "mlp.down_proj.weight", (h, inter))),
        ))
    embed = put(take("model.embed_tokens.weight", (c.vocab_size, h)))
    if c.tie_word_embeddings or "lm_head.weight" not in ckpt.where:
        if not c.tie_word_embeddings:
            raise ValueError(f"checkpoint {path} has no 'lm_head.weight' and config does not tie word embeddings")
        lm_head = embed
        used.discard("lm_head.weight")
    else:
        lm_head = put(take("lm_head.weight", (c.vocab_size, h)))
    norm = put(take("model.norm.weight", (h,)))
    # Old checkpoints store rotary buffers; they are recomputed from the config.
    ignorable = ("rotary_emb.inv_freq", "lm_head.weight")
    unused = sorted(n for n in ckpt.where if n not in used and not n.endswith(ignorable))
    if unused:
        raise ValueError(f"checkpoint {path} has tensors this architecture does not use: {unused[:5]}")
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
