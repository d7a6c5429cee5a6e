"""Builds the tiny-reasoner's tokenizer (``tokenizer.json``) with the ``tokenizers`` library.

One token per character (digits, operators, letters, punctuation, space, newline), plus two
words that occur on every problem (``collatz`` and ``answer: ``, trailing space included) and the
specials. ``<think>`` and ``</think>`` are single, *non*-special added tokens, so decoding keeps
them in the text (a reasoning model's output shows its chain); ``<s>``, ``</s>`` (EOS) and
``<pad>`` are special. Encoding adds ``<s>`` in front, as the model was trained.

The ids are fixed by the order below; changing it invalidates the shipped weights.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
THINK_START, THINK_END = "<think>", "</think>"
WORDS = ("answer: ", "collatz")
CHARS = tuple(string.digits) + tuple("+-*/=:,()") + (" ", "\n") + tuple(string.ascii_lowercase) + tuple(".?")

SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + (THINK_START, THINK_END) + WORDS + CHARS
VOCAB_SIZE = 64  # the embedding is padded to a multiple of 8; ids >= len(VOCAB) are never produced


def build_tokenizer() -> Tokenizer:
    assert len(VOCAB) <= VOCAB_SIZE, len(VOCAB)
    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Words first, then any single character (newline included).
    pattern = "|".join(w.replace("?", r"\?") for w in WORDS) + r"|[\s\S]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_START, THINK_END)])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return tok


def token_id(name: str) -> int:
    return VOCAB.index(name)


def write_tokenizer_files(out_dir: Path) -> None:
    """``tokenizer.json`` and the ``tokenizer_config.json`` / ``special_tokens_map.json`` that
    let ``transformers.AutoTokenizer`` load it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1536,
        "clean_up_tokenization_spaces": False,
        **specials,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
