"""The fused CPU ops (csrc/fused_ops.cpp) and prepacked oneDNN weights against the plain-torch
reference: each op alone (fp32 and bf16, decode- and prefill-sized batches), the KV writes exactly,
a bad slot rejected before anything is written, whole generations through the engine, and which
path is selected. The failed build's fallback is checked in test_attention_decode.py (one build
serves both), and the fused logits against Hugging Face in test_model_hf_equivalence.py, which
runs the default, fused, model."""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from thinkserve.workers.decode_kernels import native_module, select_fused_ops
from thinkserve.workers.model import _rope, pick_linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    module = native_module()
    if module is None:
        pytest.fail("the native extension did not build here (g++ and ninja are expected on CPU machines)")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_add_rms_norm_matches_torch(ops, dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    x, h = (torch.randn(tokens, 192, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(192, generator=g).to(dtype) + 0.5
    want_h = h + x
    want_x = F.rms_norm(want_h, (192,), w, 1e-6)
    ops.add_rms_norm_(x, h, w, 1e-6)
    assert torch.equal(h, want_h)  # the residual stream is exactly h + x
    torch.testing.assert_close(x, want_x, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,d", [(6, 6, 32), (6, 2, 64), (4, 1, 24)])
def test_rope_and_cache_matches_rope_then_index_copy(ops, dtype, hq, hkv, d):
    g = torch.Generator().manual_seed(hq * d)
    t, num_blocks, bs = 9, 12, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    positions = torch.randint(0, 500, (t,), generator=g)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cache = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype)

    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    want_qk = _rope(qkv[:, : (hq + hkv) * d].float().view(t, hq + hkv, d), emb.cos(), emb.sin())
    want_cache = cache.clone()
    want_cache[0].view(-1, hkv, d)[slots] = want_qk[:, hq:].to(dtype)
    want_cache[1].view(-1, hkv, d)[slots] = qkv[:, (hq + hkv) * d :].view(t, hkv, d)

    ops.rope_and_cache_(qkv, freqs.cos(), freqs.sin(), slots, cache[0], cache[1], hq, hkv)
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d].float().view(t, hq + hkv, d), want_qk,
                               atol=TOL[dtype] * 4, rtol=TOL[dtype])
    # the cache holds exactly the rotated k this step left in qkv, and v unchanged
    assert torch.equal(cache[0].view(-1, hkv, d)[slots], qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d))
    assert torch.equal(cache[1], want_cache[1])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(cache[0].view(-1, hkv, d)[untouched], want_cache[0].view(-1, hkv, d)[untouched])


def test_rope_and_cache_rejects_a_slot_outside_the_cache_before_writing(ops):
    qkv = torch.randn(2, 3 * 32)
    cache = torch.zeros(2, 4, 4, 1, 32)
    cos = sin = torch.zeros(2, 16)
    before = qkv.clone()
    with pytest.raises(RuntimeError, match="slot 16 of token 1 is outside the cache"):
        ops.rope_and_cache_(qkv, cos, sin, torch.tensor([3, 16]), cache[0], cache[1], 1, 1)
    assert torch.equal(qkv, before) and not cache.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 200])
def test_silu_mul_matches_torch(ops, dtype, tokens):
    gate_up = torch.randn(tokens, 2 * 768, generator=torch.Generator().manual_seed(tokens)).to(dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, atol=TOL[dtype] * 4, rtol=TOL[dtype])


@pytest.mark.parametrize("rows", [1, 3, 24, 257])
def test_packed_onednn_linear_matches_f_linear(rows):
    linear, pack = pick_linear(CPU, torch.float32)
    assert pack is not None, "fp32 on a CPU with oneDNN packs its weights"
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(640, 384, generator=g), torch.randn(640, generator=g), torch.randn(rows, 384, generator=g)
    torch.testing.assert_close(linear(x, pack(w), b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert pick_linear(CPU, torch.bfloat16) == (F.linear, None)


def test_engine_fused_and_packed_generations_match_the_reference(tiny_llama_dir):
    """Greedy generations of a ragged batch (chunked prefills mixed with decodes): fused ops with
    packed weights against the plain-torch model."""
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams
    from thinkserve.workers import model as model_module

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(2, 60))] for _ in range(12)]
    params = [SamplingParams(max_tokens=rng.choice([3, 10, 60, 150]), temperature=0.0, ignore_eos=True)
              for _ in prompts]
    tokens, fused = {}, {}
    for name, env in (("reference", "0"), ("fused", "1")):
        os.environ["THINKSERVE_FUSED_OPS"] = env
        saved = model_module.pick_linear
        if name == "reference":  # plain weights and F.linear: the model as before any fast path
            model_module.pick_linear = lambda device, dtype: (F.linear, None)
        try:
            engine = LLMEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8, block_size=4,
                                               max_num_batched_tokens=32, kv_cache_memory_bytes=8 * 2**20,
                                               dtype="float32")
        finally:
            del os.environ["THINKSERVE_FUSED_OPS"]
            model_module.pick_linear = saved
        fused[name] = engine.runner.model.fused_ops is not None
        tokens[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert fused == {"reference": False, "fused": True}
    assert tokens["fused"] == tokens["reference"]


def test_fused_ops_selection():
    assert select_fused_ops(CPU) is native_module()
    assert select_fused_ops(CPU, False) is None
    assert select_fused_ops(torch.device("cuda")) is None

