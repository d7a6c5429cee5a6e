"""Shared fixtures for workers tests: a tiny random Llama checkpoint with a real tokenizer
(built by tests/tiny_llama.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tiny_llama import EOS_ID, THINK_END_ID, THINK_START_ID, TINY_VOCAB, build_tiny_llama  # noqa: F401


@dataclass(frozen=True)
class TinyLlama:
    path: Path
    hf_model: object  # transformers LlamaForCausalLM with the same weights, for reference runs
    vocab_size: int = TINY_VOCAB
    eos_id: int = EOS_ID
    think_start_id: int = THINK_START_ID
    think_end_id: int = THINK_END_ID


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> TinyLlama:
    """A random tiny Llama checkpoint with the byte tokenizer (built once per test session)."""
    torch.set_num_threads(1)  # the test machines are small and shared
    path = tmp_path_factory.mktemp("tiny_llama")
    return TinyLlama(path, build_tiny_llama(path))


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_llama) -> Path:
    return tiny_llama.path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared machine an OpenMP region
    stalls whenever one of its threads is descheduled (10x slower under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
