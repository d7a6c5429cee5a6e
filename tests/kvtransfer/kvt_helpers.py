"""Test helpers: start kvt_peer.py (or any script) as a real process and read its JSON lines."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER = HERE / "kvt_peer.py"


class Proc:
    """A child process whose stdout lines are JSON objects, read by a thread with timeouts."""

    def __init__(self, *args: str, script: Path = PEER):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr), daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:
            line = line.strip()
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def read(self, timeout: float = 60.0) -> dict:
        try:
            msg = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output from {self.p.args} in {timeout}s; stderr: {''.join(self._err)[-2000:]}")
        if msg is None:
            raise AssertionError(f"{self.p.args} exited ({self.p.poll()}); stderr: {''.join(self._err)[-2000:]}")
        return msg

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=10)

    def wait(self, timeout: float = 60.0) -> int:
        return self.p.wait(timeout=timeout)


ENGINE_PEER = HERE / "kvt_engine_peer.py"
VOCAB = 272  # byte tokens 0-255, then <|eos|> 256, <think> 257, </think> 258, a few unused


def build_tiny_llama(path: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """A random HF-format Llama plus a byte-level tokenizer (every byte one token)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.1, bos_token_id=None, eos_token_id=256, pad_token_id=0)
    LlamaForCausalLM(cfg).eval().save_pretrained(path, safe_serialization=True)
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    alphabet, shift = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[b] = chr(b)
        else:
            alphabet[b], shift = chr(256 + shift), shift + 1
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in alphabet.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>", "<think>", "</think>"])
    tok.save(str(path / "tokenizer.json"))
    return path
