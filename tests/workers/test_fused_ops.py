"""The fused CPU ops (csrc/fused_ops.cpp), the native GEMM (csrc/gemm.cpp), the layer blocks
(csrc/layer_blocks.cpp) and prepacked oneDNN weights against the plain-torch reference: each op
alone (fp32 and bf16, decode- and prefill-sized batches), the KV writes exactly, a bad slot
rejected before anything is written, whole generations through the engine, and which path is
selected. The failed build's fallback is checked in test_attention_decode.py (one build
serves both), and the fused logits against Hugging Face in test_model_hf_equivalence.py, which
runs the default, fused, model."""
from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from thinkserve.workers.decode_kernels import native_module, select_fused_ops
from thinkserve.workers.model import PackedWeight, _rope, pick_linear

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


def test_fused_ops_bring_the_native_gemm(ops):
    linear, pack = pick_linear(CPU, torch.float32, ops)
    w, x = torch.randn(70, 24), torch.randn(3, 24)
    packed = pack(w)
    assert type(packed) is PackedWeight and packed.out_features == 70
    torch.testing.assert_close(linear(x, packed), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert torch.equal(linear(x, w), F.linear(x, w))  # a tied lm_head stays a plain tensor
    assert pick_linear(CPU, torch.bfloat16, ops) == (F.linear, None)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 97, 300])
@pytest.mark.parametrize("shape", [(576, 192), (100, 37), (2048, 384), (16, 1024)])
def test_native_gemm_matches_f_linear(ops, rows, shape):
    n, k = shape
    g = torch.Generator().manual_seed(rows * n)
    w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
    packed = ops.pack_linear_weight(w)
    assert tuple(packed.shape) == (-(-n // 16), k, 16)
    want = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(ops.packed_linear(x, packed, n, b).double(), want, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(ops.packed_linear(x, packed, n, None).double(), want - b.double(), atol=2e-4, rtol=1e-5)
    # rows with a stride (a slice of a wider tensor) read the same values
    wide = torch.cat([x, torch.randn(rows, 3, generator=g)], dim=1)[:, :k]
    assert torch.equal(ops.packed_linear(wide, packed, n, b), ops.packed_linear(x, packed, n, b))


def test_native_gemm_is_batch_and_thread_invariant(ops):
    """A row gets the same bits whatever rows run beside it and however many threads split the
    work: every output sums its products in one fixed order."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 192, generator=g), torch.randn(257, 192, generator=g)
    packed = ops.pack_linear_weight(w)
    full = ops.packed_linear(x, packed, 1536, None)
    for lo, hi in ((0, 1), (5, 6), (100, 107), (200, 257)):
        assert torch.equal(ops.packed_linear(x[lo:hi], packed, 1536, None), full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(ops.packed_linear(x, packed, 1536, None), full)
        # a lone row: its panels split between the threads in claims that shrink (team.h), each
        # read as one prefetched stream
        for lo in (0, 5, 256):
            assert torch.equal(ops.packed_linear(x[lo:lo + 1], packed, 1536, None), full[lo:lo + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", [(384, 1024), (192, 768), (640, 384)])
def test_native_gemm_sums_in_onednns_order(ops, shape):
    """Bit for bit what the reference path's oneDNN inner product gives on these shapes (K in
    blocks of 512): a different order flips near-tied greedy tokens now and then."""
    linear, pack = pick_linear(CPU, torch.float32)
    n, k = shape
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g)
    packed, onednn = ops.pack_linear_weight(w), pack(w)
    for rows in (1, 7, 64):
        x = torch.randn(rows, k, generator=g)
        assert torch.equal(ops.packed_linear(x, packed, n, None), linear(x, onednn))


def test_native_gemm_packs_into_a_given_tensor(ops):
    """``out`` (an arena slice) gets exactly the packed weight, its padding rows zeroed whatever it
    held, and one of the wrong size is refused."""
    w = torch.randn(40, 8)
    arena = torch.full((3 * 8 * 16 + 5,), float("nan"))
    packed = ops.pack_linear_weight(w, arena[5:])
    assert packed.data_ptr() == arena[5:].data_ptr() and torch.equal(packed, ops.pack_linear_weight(w))
    with pytest.raises(RuntimeError, match="out must be"):
        ops.pack_linear_weight(w, torch.empty(3 * 8 * 16 - 1))


def test_model_packs_every_projection_into_one_arena(tiny_llama_dir):
    """The fused model's projections and LM head lie one after another in one buffer (on huge
    pages where granted), each equal to packing that weight alone."""
    from thinkserve.workers.loader import load_weights
    from thinkserve.workers.model import LlamaModel
    from thinkserve.workers.model_config import ModelConfig

    config = ModelConfig.from_pretrained(str(tiny_llama_dir))
    plain = load_weights(config, tiny_llama_dir, device="cpu", dtype=torch.float32)
    originals = [getattr(layer, n).clone() for layer in plain.layers for n in ("qkv", "o", "gate_up", "down")]
    assert plain.lm_head is not plain.embed  # untied: the LM head is packed too
    originals.append(plain.lm_head.clone())
    model = LlamaModel(config, plain, fused=True)
    packed = [getattr(layer, n) for layer in model.weights.layers for n in ("qkv", "o", "gate_up", "down")]
    packed.append(model.weights.lm_head)
    assert all(type(p) is PackedWeight for p in packed)
    assert len({p.data.untyped_storage().data_ptr() for p in packed}) == 1
    for before, after in zip(packed, packed[1:]):  # back to back, in order
        assert after.data.data_ptr() == before.data.data_ptr() + before.data.numel() * 4
    for w, p in zip(originals, packed):
        assert p.out_features == w.shape[0] and torch.equal(p.data, model.fused_ops.pack_linear_weight(w))


def test_native_gemm_rejects_bad_inputs(ops):
    packed = ops.pack_linear_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="x has 9 features"):
        ops.packed_linear(torch.randn(2, 9), packed, 40, None)
    with pytest.raises(RuntimeError, match="out_features 50"):
        ops.packed_linear(torch.randn(2, 8), packed, 50, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        ops.packed_linear(torch.randn(2, 8), packed, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="float32"):
        ops.packed_linear(torch.randn(2, 8, dtype=torch.float64), packed, 40, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9])
def test_layer_blocks_match_the_torch_layer(ops, dtype, tokens):
    """attention_in_ / attention_out (packed fp32 weights, or plain bf16 ones) against the same
    layer in plain torch: the qkv after rope, the cache writes, the residual and the next input."""
    g = torch.Generator().manual_seed(tokens)
    hidden, inter, hq, hkv, d = 64, 96, 4, 2, 16
    qkv_n = (hq + 2 * hkv) * d

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    w_qkv, b_qkv, w_o, w_gu, w_down = rnd(qkv_n, hidden), rnd(qkv_n), rnd(hidden, hq * d), rnd(2 * inter, hidden), \
        rnd(hidden, inter)
    post, nxt = rnd(hidden) + 1, rnd(hidden) + 1
    x, h, attn = rnd(tokens, hidden), rnd(tokens, hidden), rnd(tokens, hq * d)
    pos = torch.arange(tokens) + 3
    freqs = pos.float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(32, generator=g)[:tokens]
    k_cache, v_cache = torch.zeros(8, 4, hkv, d, dtype=dtype), torch.zeros(8, 4, hkv, d, dtype=dtype)
    packed = dtype == torch.float32

    def weight(w):
        return (ops.pack_linear_weight(w) if packed else w), w.shape[0]

    qkv = ops.attention_in_(x, *weight(w_qkv), b_qkv, cos, sin, slots, k_cache, v_cache, hq, hkv)
    want = F.linear(x, w_qkv, b_qkv)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    qk = _rope(want[:, : (hq + hkv) * d].float().view(tokens, hq + hkv, d), emb.cos(), emb.sin())
    tol = dict(atol=TOL[dtype] * 20, rtol=TOL[dtype] * 5)
    torch.testing.assert_close(qkv[:, : (hq + hkv) * d].float(), qk.reshape(tokens, -1), **tol)
    assert torch.equal(k_cache.view(-1, hkv * d)[slots], qkv[:, hq * d : (hq + hkv) * d])
    assert torch.equal(v_cache.view(-1, hkv * d)[slots], qkv[:, (hq + hkv) * d :])

    h_ref = h.clone()
    out = ops.attention_out(attn, h, *weight(w_o), post, *weight(w_gu), *weight(w_down), nxt, 1e-6)
    h_ref = h_ref + F.linear(attn, w_o)
    gate, up = F.linear(F.rms_norm(h_ref, (hidden,), post, 1e-6), w_gu).chunk(2, dim=-1)
    h_ref = h_ref + F.linear(F.silu(gate) * up, w_down)
    torch.testing.assert_close(h.float(), h_ref.float(), **tol)
    torch.testing.assert_close(out.float(), F.rms_norm(h_ref, (hidden,), nxt, 1e-6).float(), atol=TOL[dtype] * 100,
                               rtol=TOL[dtype] * 10)


def _decode_step_inputs(ops, dtype, g, hidden, inter, hq, hkv, d, bs, ctx, blocks):
    """Two layers' weight tuples (the model's order; the last without a next norm), a two-layer
    cache [L, 2, blocks, bs, hkv, d], tables, slots, cos/sin, x and h for a decode step at ``ctx``."""
    batch, qkv_n = ctx.shape[0], (hq + 2 * hkv) * d

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.3).to(dtype)

    def weight(w):
        return (ops.pack_linear_weight(w) if dtype == torch.float32 else w), w.shape[0]

    layers = [(*weight(rnd(qkv_n, hidden)), rnd(qkv_n), *weight(rnd(hidden, hq * d)), rnd(hidden) + 1,
               *weight(rnd(2 * inter, hidden)), *weight(rnd(hidden, inter)), next_norm)
              for next_norm in (rnd(hidden) + 1, None)]
    tables = torch.randperm(batch * blocks, generator=g).view(batch, blocks)
    slots = tables[torch.arange(batch), (ctx - 1) // bs] * bs + (ctx - 1) % bs
    freqs = (ctx - 1).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cache = rnd(2, 2, batch * blocks, bs, hkv, d)
    return layers, cache, tables, slots, freqs.cos(), freqs.sin(), rnd(batch, hidden), rnd(batch, hidden)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_layers_are_the_three_calls_bit_for_bit(ops, dtype):
    """decode_layers (every layer of a decode-only step in one call) against attention_in_,
    paged_decode on qkv's q columns and attention_out called one by one, layer after layer: the
    output, the residual stream and the cache writes identical, on ragged contexts (1 to 70 keys,
    grouped-query heads)."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d = 4, 2, 16
    ctx = torch.tensor([1, 9, 70, 33, 4])
    layers, cache, tables, slots, cos, sin, x, h = _decode_step_inputs(ops, dtype, g, 64, 96, hq, hkv, d, 4, ctx, 18)
    ref_cache, ref_h, want = cache.clone(), h.clone(), x
    for args, (k_cache, v_cache) in zip(layers, ref_cache):
        qkv = ops.attention_in_(want, *args[:3], cos, sin, slots, k_cache, v_cache, hq, hkv)
        attn = ops.paged_decode(qkv[:, : hq * d].view(len(ctx), hq, d), k_cache, v_cache, tables, ctx, 0.25, 32)
        want = ops.attention_out(attn, ref_h, *args[3:], 1e-6)
    out = ops.decode_layers(x, h, layers, [c[0] for c in cache], [c[1] for c in cache], cos, sin, slots, hq, hkv,
                            tables, ctx, 0.25, 32, 1e-6)
    assert torch.equal(out, want)
    assert torch.equal(h, ref_h)
    assert torch.equal(cache, ref_cache)


def test_decode_layers_on_two_threads_are_the_one_thread_step_bit_for_bit(ops):
    """With 2 threads decode_layers runs as one parallel region whose loops (the GEMMs' panel
    groups, attention's key partitions and their merge) go to whichever thread is free
    (csrc/team.h): the same bits as one thread. A failed check inside the region raises and
    leaves the ops usable."""
    g = torch.Generator().manual_seed(11)
    hq, hkv = 8, 2
    ctx = torch.randint(1, 400, (24,), generator=g)
    layers, cache, tables, slots, cos, sin, x, h = _decode_step_inputs(ops, torch.float32, g, 256, 512, hq, hkv, 32,
                                                                       8, ctx, 50)

    def step(slot_mapping):
        c, hh = cache.clone(), h.clone()
        out = ops.decode_layers(x, hh, layers, [c[i, 0] for i in range(2)], [c[i, 1] for i in range(2)], cos, sin,
                                slot_mapping, hq, hkv, tables, ctx, 0.125, 32, 1e-6)
        return out, hh, c

    runs = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            runs[n] = step(slots)
        bad = slots.clone()
        bad[3] = cache.shape[2] * cache.shape[3]  # one past the last slot: rope_and_cache_ rejects it in the region
        with pytest.raises(RuntimeError, match="outside the cache"):
            step(bad)
        again = step(slots)
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(runs[1], runs[2], again):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_decode_layers_of_a_lone_row_on_two_threads_are_the_one_thread_step_bit_for_bit(ops):
    """At batch 1 each projection of decode_layers offers the start of the next weight to a helper
    with no claim left, which reads it ahead and then runs those panels first (or the program's
    thread runs them, when the helper has not begun them: team.h, "Reading ahead"). Whoever runs
    which panels, a step on 2 threads gives the one-thread bits, step after step (each writes the
    next position's K and V), and the ops stay usable after a failed check inside the program."""
    g = torch.Generator().manual_seed(13)
    hq, hkv, d, bs, blocks = 8, 2, 32, 8, 40
    # weights of 16-64 panels: each offer holds a quarter of the next weight (4-16 panels)
    layers, cache, tables, slots, cos, sin, x, h = _decode_step_inputs(ops, torch.float32, g, 256, 512, hq, hkv, d, bs,
                                                                       torch.tensor([150]), blocks)
    freqs = (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]

    def steps(n_threads, count=12, slot_mapping=None):
        torch.set_num_threads(n_threads)
        c, outs = cache.clone(), []
        for i in range(count):
            pos = 150 + i  # 0-based position of this step's token: the context grows by one each step
            slot = (tables[0, pos // bs] * bs + pos % bs).view(1) if slot_mapping is None else slot_mapping
            hh = h.clone()
            out = ops.decode_layers(x, hh, layers, [c[j, 0] for j in range(2)], [c[j, 1] for j in range(2)],
                                    (pos * freqs).cos(), (pos * freqs).sin(), slot, hq, hkv, tables,
                                    torch.tensor([pos + 1]), 0.125, 32, 1e-6)
            outs += [out, hh]
        return outs + [c]

    threads = torch.get_num_threads()
    try:
        want = steps(1)
        runs = [steps(2) for _ in range(3)]
        with pytest.raises(RuntimeError, match="outside the cache"):
            steps(2, 1, torch.tensor([cache.shape[2] * cache.shape[3]]))
        runs.append(steps(2))
    finally:
        torch.set_num_threads(threads)
    for run in runs:
        assert len(run) == len(want) and all(torch.equal(a, b) for a, b in zip(want, run))


def _team_helpers() -> list[str]:
    """Names of this process's team helper threads (csrc/team.h names them ts-team-<i>)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if name.startswith("ts-team-"):
            names.append(name)
    return sorted(names)


def _helpers_named(at_least: int, timeout_s: float = 10.0) -> int:
    """How many team helpers have named themselves, waiting up to ``timeout_s`` for ``at_least``:
    a helper names itself when it first runs, which on a loaded machine can come after the
    program that started it has returned."""
    deadline = time.monotonic() + timeout_s
    while len(names := _team_helpers()) < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(names)


def test_team_helpers_follow_the_thread_count_and_keep_the_bits(ops):
    """The team's helpers are threads of its own, started on first use (threads - 1 of them) and
    kept: at 2, 3 and again 2 threads a GEMM gets the one-thread bits, and going back to 2 threads
    starts none."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(2048, 256, generator=g), torch.randn(9, 256, generator=g)
    packed = ops.pack_linear_weight(w)
    want = ops.packed_linear(x, packed, 2048, None)  # 1 thread (the fixture's)
    threads = torch.get_num_threads()
    started = []
    try:
        for n in (2, 3, 2):
            torch.set_num_threads(n)
            for _ in range(20):
                assert torch.equal(ops.packed_linear(x, packed, 2048, None), want)
            started.append(_helpers_named(at_least=n - 1))
    finally:
        torch.set_num_threads(threads)
    assert started[0] >= 1 and started[1] >= 2 and started[2] == started[1]


def test_team_in_a_forked_child_starts_its_own_helpers(ops):
    """Ray forks workers. A child forked after the parent's team ran has none of its helper
    threads; its first parallel call starts its own, gets the same bits, and the parent's team
    still works after the fork."""
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(2048, 256, generator=g), torch.randn(3, 256, generator=g)
    packed = ops.pack_linear_weight(w)
    want = ops.packed_linear(x, packed, 2048, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(ops.packed_linear(x, packed, 2048, None), want)
        assert _helpers_named(at_least=1) >= 1
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, never return into pytest
            status = 1
            try:
                before = _team_helpers()
                same = all(torch.equal(ops.packed_linear(x, packed, 2048, None), want) for _ in range(20))
                _helpers_named(at_least=1)  # a helper names itself when it first runs
                os.write(write, repr((before, same, _team_helpers())).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in its first parallel call")
        with os.fdopen(read) as f:
            report = f.read()
        assert os.waitstatus_to_exitcode(status) == 0, report
        assert eval(report) == ([], True, ["ts-team-0"])
        assert torch.equal(ops.packed_linear(x, packed, 2048, None), want)  # the parent's team
    finally:
        torch.set_num_threads(threads)


def test_team_helpers_do_not_hold_up_the_process_exit(ops):
    """A process whose helpers are alive (asleep, or spinning right after a call) exits at once,
    with status 0: nothing waits for them and nothing they touch is destroyed under them."""
    code = ("import torch; from thinkserve.workers.decode_kernels import native_module\n"
            "ops = native_module(); torch.set_num_threads(2)\n"
            "w = ops.pack_linear_weight(torch.randn(4096, 512)); x = torch.randn(1, 512)\n"
            "[ops.packed_linear(x, w, 4096, None) for _ in range(50)]\n")
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr


def test_team_spin_setting_is_checked_and_kept(ops):
    """THINKSERVE_TEAM_SPIN_US (how long a helper spins after a program before it sleeps) is read
    when the first team starts: 0 (sleep at once) gives the one-thread bits; a bad value is refused
    with an error naming the variable and its range, and the op works once it is fixed."""
    code = ("import os, torch; from thinkserve.workers.decode_kernels import native_module\n"
            "ops = native_module(); torch.set_num_threads(2)\n"
            "g = torch.Generator().manual_seed(1); w = torch.randn(2048, 256, generator=g)\n"
            "x = torch.randn(3, 256, generator=g); p = ops.pack_linear_weight(w)\n"
            "try:\n"
            "    out = ops.packed_linear(x, p, 2048, None)\n"
            "except RuntimeError as e:\n"
            "    print('refused:', e); os.environ['THINKSERVE_TEAM_SPIN_US'] = '0'; out = ops.packed_linear(x, p, 2048, None)\n"
            "torch.set_num_threads(1)\n"
            "assert all(torch.equal(ops.packed_linear(x, p, 2048, None), out) for _ in range(5)); print('ok')\n")
    for value, refused in (("0", False), ("5000", False), ("-1", True), ("2e3", True), ("1000001", True)):
        env = dict(os.environ, THINKSERVE_TEAM_SPIN_US=value)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip().endswith("ok")
        assert ("refused:" in run.stdout) == refused, run.stdout
        if refused:
            assert "THINKSERVE_TEAM_SPIN_US must be a whole number of microseconds in [0, 1000000]" in run.stdout


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
    tokens, fused, packed = {}, {}, {}
    for name, env in (("reference", "0"), ("fused", "1")):
        os.environ["THINKSERVE_FUSED_OPS"] = env
        saved = model_module.pick_linear
        if name == "reference":  # plain weights and F.linear: the model as before any fast path
            model_module.pick_linear = lambda device, dtype, fused_ops=None: (F.linear, None)
        try:
            engine = LLMEngine.from_pretrained(str(tiny_llama_dir), max_num_seqs=8, block_size=4,
                                               max_num_batched_tokens=32, kv_cache_memory_bytes=8 * 2**20,
                                               dtype="float32")
        finally:
            del os.environ["THINKSERVE_FUSED_OPS"]
            model_module.pick_linear = saved
        fused[name] = engine.runner.model.fused_ops is not None
        packed[name] = type(engine.runner.model.weights.layers[0].qkv) is PackedWeight
        tokens[name] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
    assert fused == {"reference": False, "fused": True}
    assert packed == {"reference": False, "fused": True}  # the fused model runs the native GEMM
    assert tokens["fused"] == tokens["reference"]


def test_fused_ops_selection():
    assert select_fused_ops(CPU) is native_module()
    assert select_fused_ops(CPU, False) is None
    assert select_fused_ops(torch.device("cuda")) is None

