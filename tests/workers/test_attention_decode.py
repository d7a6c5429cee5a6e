"""Decode attention backends against the plain-torch padded reference: ragged batches, prefix-shared
blocks, block-size and partition edges, GQA, bf16, mixed prefill+decode steps, the logged build
fallback, and whole generations through the runner with each backend."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from thinkserve.workers.attention import NATIVE_PARTITION, build_attention_metadata, paged_attention
from thinkserve.workers.decode_kernels import native_module, select_decode_backend

CPU = torch.device("cpu")
FAST = ("grouped", "native")


def _ragged_case(contexts, block_size, hq=6, hkv=6, d=32, shared_prefix_blocks=0, seed=0, dtype=torch.float32):
    """A shuffled cache, one table per sequence (optionally all starting with the same blocks), and
    this step's q/k/v for one decode token per sequence."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-c // block_size) for c in contexts) + shared_prefix_blocks + 1
    ids = list(range(need))
    rng.shuffle(ids)
    shared, free = ids[:shared_prefix_blocks], ids[shared_prefix_blocks:]
    tables = []
    for c in contexts:
        own = -(-c // block_size) - len(shared)
        assert own >= 1, "test bug: each sequence must own the block its new token lands in"
        tables.append(shared + free[:own])
        free = free[own:]
    cache = torch.randn(2, need, block_size, hkv, d, generator=g).to(dtype)
    q = torch.randn(len(contexts), hq, d, generator=g).to(dtype)
    k = torch.randn(len(contexts), hkv, d, generator=g).to(dtype)
    v = torch.randn(len(contexts), hkv, d, generator=g).to(dtype)
    return cache, tables, q, k, v


def _attend(backend, contexts, tables, cache, q, k, v, block_size, query_lens=None):
    query_lens = query_lens or [1] * len(contexts)
    starts = [c - n for c, n in zip(contexts, query_lens)]
    meta = build_attention_metadata(starts, query_lens, tables, block_size, CPU, q.dtype, backend)
    cache = cache.clone()
    out = paged_attention(q, k, v, cache, meta, q.shape[-1] ** -0.5)
    return out, cache


def _check(contexts, block_size, tol=2e-6, **kw):
    cache, tables, q, k, v = _ragged_case(contexts, block_size, **kw)
    want, want_cache = _attend("padded", contexts, tables, cache, q, k, v, block_size)
    for backend in FAST:
        got, got_cache = _attend(backend, contexts, tables, cache, q, k, v, block_size)
        assert torch.equal(got_cache, want_cache), backend  # the same KV writes
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: f"{backend}: {m}")


@pytest.fixture(scope="module", autouse=True)
def built():
    if native_module() is None:
        pytest.fail("the native kernel did not build here (g++ and ninja are expected on CPU machines)")


def test_ragged_heavy_tailed_batch():
    rng = random.Random(1)
    contexts = [rng.choice([1, 7, 30, 31, 33, 64, 100]) for _ in range(40)] + [1400, 900]
    _check(contexts, 16)


def test_large_batch_of_long_tables():
    # > 512 table entries in all: the block tables are padded by the flat scatter, not the nested list
    rng = random.Random(2)
    _check([rng.randint(150, 260) for _ in range(48)] + [1], 16)


def test_prefix_shared_blocks():
    # 12 sequences read the same 3 leading blocks (a shared prompt), then their own.
    _check([3 * 16 + n for n in (1, 5, 16, 17, 40, 100, 2, 3, 9, 60, 300, 600)], 16, shared_prefix_blocks=3)


@pytest.mark.parametrize("block_size", [1, 2, 16, 32])
def test_block_size_edges(block_size):
    # contexts ending exactly on a block boundary, one past it, one token, and long ones
    contexts = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 1, 257]
    _check(contexts, block_size)


def test_partition_edges():
    p = NATIVE_PARTITION
    _check([p - 1, p, p + 1, 2 * p, 2 * p + 1, 5 * p + 3], 16)


# the AVX-512 fp32 loops hold 256/d heads' accumulators at once: (24, 8, 32) and (6, 2, 64) take
# several head chunks; d 16 and 48 take the generic loops
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (4, 1, 16), (12, 4, 128), (24, 8, 32), (6, 2, 64), (6, 3, 48)])
def test_grouped_query_heads(hq, hkv, d):
    _check([5, 80, 333, 17], 16, hq=hq, hkv=hkv, d=d)


def test_bf16_matches_reference_within_bf16_rounding():
    _check([5, 80, 333, 1000], 16, dtype=torch.bfloat16, tol=2e-2)


def test_mixed_prefill_and_decode_step():
    bs = 16
    contexts, query_lens = [40, 70, 9, 300, 1], [12, 70, 1, 1, 1]
    cache, tables, _, _, _ = _ragged_case(contexts, bs, hq=8, hkv=2, d=64)
    g = torch.Generator().manual_seed(3)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, 64, generator=g) for h in (8, 2, 2))
    want, want_cache = _attend("padded", contexts, tables, cache, q, k, v, bs, query_lens)
    for backend in FAST:
        got, got_cache = _attend(backend, contexts, tables, cache, q, k, v, bs, query_lens)
        assert torch.equal(got_cache, want_cache)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_native_rejects_a_context_longer_than_its_table():
    cache, tables, q, k, v = _ragged_case([20], 16)
    bad = torch.tensor([[tables[0][0], tables[0][1]]])
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        native_module().paged_decode(q, cache[0], cache[1], bad, torch.tensor([33]), 1.0, NATIVE_PARTITION)


def test_backend_selection():
    assert select_decode_backend(CPU) in ("native", os.environ.get("THINKSERVE_DECODE_ATTENTION", "native"))
    assert select_decode_backend(CPU, "grouped") == "grouped"
    with pytest.raises(ValueError, match="decode attention backend must be one of"):
        select_decode_backend(CPU, "flash")
    with pytest.raises(ValueError, match="CPU-only"):
        select_decode_backend(torch.device("cuda"), "native")


def test_failed_build_falls_back_to_grouped_with_a_warning(tmp_path):
    # A fresh cache directory and a compiler that does not exist: the build must fail, be logged,
    # and leave the runner on the grouped path and the model on its plain-torch ops.
    code = ("import logging, torch; logging.basicConfig(level=logging.WARNING)\n"
            "from thinkserve.workers.decode_kernels import select_decode_backend, select_fused_ops\n"
            "print('BACKEND', select_decode_backend(torch.device('cpu')))\n"
            "print('FUSED', select_fused_ops(torch.device('cpu')))\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), THINKSERVE_KERNEL_CACHE=str(tmp_path / "cache"))
    env.pop("THINKSERVE_DECODE_ATTENTION", None)
    env.pop("THINKSERVE_FUSED_OPS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "BACKEND grouped" in out.stdout
    assert "native kernel unavailable" in out.stderr and "using the grouped pure-torch path" in out.stderr
    assert "FUSED None" in out.stdout
    assert "fused CPU ops unavailable" in out.stderr and "plain-torch ops" in out.stderr


def test_runner_generations_identical_across_backends(tiny_llama_dir):
    """Whole greedy generations of a ragged batch through the engine, one per backend."""
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 40))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.choice([3, 10, 60, 150]), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    tokens = {}
    for backend in ("padded", *FAST):
        os.environ["THINKSERVE_DECODE_ATTENTION"] = backend
        try:
            engine = LLMEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8, block_size=4,
                                               kv_cache_memory_bytes=8 * 2**20, dtype="float32")
        finally:
            del os.environ["THINKSERVE_DECODE_ATTENTION"]
        assert engine.runner.decode_attention == backend
        tokens[backend] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert tokens["grouped"] == tokens["padded"]
    assert tokens["native"] == tokens["padded"]
