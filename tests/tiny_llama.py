"""A tiny random HF-format Llama with a real byte-level tokenizer, shared by every test tree.

The tokenizer is byte-level BPE without merges: every byte is one token (ids 0-255), so any
text round-trips exactly; special tokens follow: 256 <|eos|>, 257 <think>, 258 </think>.
"""
from __future__ import annotations

import torch

EOS_ID, THINK_START_ID, THINK_END_ID = 256, 257, 258
TINY_VOCAB = 272  # a few unused ids past the tokenizer: the model's vocabulary may be larger


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest are shifted
    past 255, so that token id == byte value in the tokenizer below."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, shift = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def write_byte_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={c: b for b, c in _byte_to_unicode().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>", "<think>", "</think>"])
    assert tok.token_to_id("<|eos|>") == EOS_ID and tok.token_to_id("</think>") == THINK_END_ID
    tok.save(str(path / "tokenizer.json"))


def build_tiny_llama(path, *, seed: int = 0, num_layers: int = 2, max_position_embeddings: int = 512):
    """A random HF-format Llama (safetensors) plus tokenizer in ``path``; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=EOS_ID, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return model
