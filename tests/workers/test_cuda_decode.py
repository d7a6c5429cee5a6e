"""The CUDA decode path's host-side parts, on CPU: FlashInfer's page list from our block tables,
backend selection, and the CUDA-graph buckets, padding and static buffers (the model run eagerly
on the filled buffers gives the eager step's logits). The kernel and graph replay itself:
``test_cuda_decode_gpu.py``."""
from __future__ import annotations

import random

import pytest
import torch

from thinkserve.workers.attention import build_attention_metadata, paged_attention
from thinkserve.workers.cuda_decode import paged_kv_index
from thinkserve.workers.cuda_graphs import (StaticDecodeInputs, bucket_for, capture_sizes, pad_decode_batch,
                                            padded_capture_sizes)
from thinkserve.workers.decode_kernels import select_decode_backend
from thinkserve.workers.model_config import ModelConfig
from thinkserve.workers.model_runner import ModelRunner
from thinkserve.workers.plan import ScheduledSeq, SeqSampling, StepPlan

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BS = 4


def greedy() -> SeqSampling:
    return SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, seed=0, output_index=0)


# ---- FlashInfer's page list ---------------------------------------------------------------------

def test_page_list_of_the_docstring_example():
    idx = paged_kv_index(torch.tensor([[7, 2, 9], [4, 0, 0], [5, 6, 0]]), torch.tensor([10, 3, 8]), 4)
    assert idx.indptr.tolist() == [0, 3, 4, 6]
    assert idx.indices.tolist() == [7, 2, 9, 4, 5, 6]
    assert idx.last_page_len.tolist() == [2, 3, 4]
    assert {t.dtype for t in (idx.indptr, idx.indices, idx.last_page_len)} == {torch.int32}


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_page_list_names_exactly_each_sequences_pages(block_size):
    """Random ragged batches: sequence b reads its first ceil(ctx/bs) table entries, in order, and
    its last page holds 1..block_size valid slots (a full last page is block_size, never 0)."""
    rng = random.Random(block_size)
    for _ in range(50):
        ctx = [rng.choice([1, block_size, block_size + 1, rng.randint(1, 300)]) for _ in range(rng.randint(1, 9))]
        pages = [-(-c // block_size) for c in ctx]
        width = max(pages) + rng.randint(0, 3)
        tables = [rng.sample(range(1000), p) + [rng.randint(0, 999) for _ in range(width - p)] for p in pages]
        idx = paged_kv_index(torch.tensor(tables), torch.tensor(ctx), block_size)
        ptr, ind = idx.indptr.tolist(), idx.indices.tolist()
        assert ptr[0] == 0 and len(ptr) == len(ctx) + 1
        for b, (c, p) in enumerate(zip(ctx, pages)):
            assert ind[ptr[b]:ptr[b + 1]] == tables[b][:p]
            assert idx.last_page_len[b] == c - (p - 1) * block_size and 1 <= idx.last_page_len[b] <= block_size
        assert ptr[-1] == len(ind) == sum(pages)


def test_page_list_rejects_empty_contexts_and_short_tables():
    with pytest.raises(ValueError, match="at least its own token"):
        paged_kv_index(torch.tensor([[3]]), torch.tensor([0]), 4)
    with pytest.raises(ValueError, match="needs 3 pages"):
        paged_kv_index(torch.tensor([[3, 4]]), torch.tensor([9]), 4)


def test_step_metadata_carries_the_decode_groups_page_list():
    """A mixed step: the prefill chunk keeps the reference's tensors, the decodes (only they) get
    the page list, and no mask is built for them."""
    tables = [[3, 8, 1], [5, 6], [9], [2, 0, 4, 7]]
    meta = build_attention_metadata([0, 6, 2, 13], [9, 1, 1, 1], tables, BS, CPU, torch.float32, "flashinfer")
    d = meta.decode
    assert meta.prefill.num_seqs == 1 and d.num_seqs == 3 and d.backend == "flashinfer" and d.mask is None
    assert d.paged_kv.indptr.tolist() == [0, 2, 3, 7]
    assert d.paged_kv.indices.tolist() == [5, 6, 9, 2, 0, 4, 7]
    assert d.paged_kv.last_page_len.tolist() == [3, 3, 2]
    assert d.kernel is None  # planned by the runner, not here
    q = torch.zeros(12, 2, 8)
    with pytest.raises(ValueError, match="not planned"):
        paged_attention(q, q[:, :1], q[:, :1], torch.zeros(2, 10, BS, 1, 8), meta, 1.0)


# ---- backend selection --------------------------------------------------------------------------

def test_cuda_backend_selection(monkeypatch):
    """Without flashinfer (as on this CPU machine) a CUDA runner keeps the padded reference; fp32
    and unusual head sizes keep it regardless; asking for flashinfer where it cannot run says why."""
    monkeypatch.delenv("THINKSERVE_DECODE_ATTENTION", raising=False)
    from thinkserve.workers import cuda_decode
    assert select_decode_backend(CUDA, None, torch.float32, 128) == "padded"
    assert select_decode_backend(CUDA, None, torch.bfloat16, 32) == "padded"
    expected = "flashinfer" if cuda_decode.flashinfer_module() is not None else "padded"
    assert select_decode_backend(CUDA, None, torch.bfloat16, 128) == expected
    assert select_decode_backend(CUDA, "padded", torch.bfloat16, 128) == "padded"
    with pytest.raises(ValueError, match="CUDA-only"):
        select_decode_backend(CPU, "flashinfer")
    # forced onto a model its kernels do not take: refused when the runner is made, not mid-step
    for dtype, head_dim in ((torch.float16, 32), (torch.float32, 128)):
        monkeypatch.setenv("THINKSERVE_DECODE_ATTENTION", "flashinfer")
        with pytest.raises(ValueError, match=rf"head_dim in \[64, 128, 256\]; this model has dtype {dtype}, "
                                             rf"head_dim {head_dim}"):
            select_decode_backend(CUDA, None, dtype, head_dim)
    monkeypatch.delenv("THINKSERVE_DECODE_ATTENTION")
    if cuda_decode.flashinfer_module() is None:
        with pytest.raises(ValueError, match="flashinfer does not import"):
            select_decode_backend(CUDA, "flashinfer", torch.bfloat16, 128)


# ---- CUDA graph buckets and padding -------------------------------------------------------------

def test_capture_sizes_and_buckets():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3) and capture_sizes(1) == (1,)
    with pytest.raises(ValueError):
        capture_sizes(0)
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 63, 64)] == [1, 2, 4, 4, 8, 8, 16, 24, 64, 64]
    assert bucket_for(65, sizes) is None and bucket_for(0, sizes) is None
    for n in range(8, 65):  # beyond batch 8 a step pads by fewer than 8 rows
        assert 0 <= bucket_for(n, sizes) - n < 8


def test_padded_reference_captures_only_buckets_whose_gather_fits():
    sizes = capture_sizes(64)
    # tiny-reasoner in fp32: 1536 keys x 6 heads x 32 x 4 B x (K, V) = 2.25 MiB a row: all fit
    assert padded_capture_sizes(sizes, 2 * 1536 * 6 * 32 * 4) == sizes
    # a 7B-like model with a 32k context in bf16 (8 KV heads x 128): 128 MiB a row
    assert padded_capture_sizes(sizes, 2 * 32768 * 8 * 128 * 2) == (1, 2)
    assert padded_capture_sizes(sizes, 1 << 30) == ()


def test_padding_rows_decode_one_token_in_the_pad_block():
    ids, pos, tables = pad_decode_batch([11, 12], [5, 9], [(1, 2), (3, 4, 5)], 4, pad_block=31)
    assert ids == [11, 12, 0, 0] and pos == [5, 9, 0, 0] and tables == [(1, 2), (3, 4, 5), (31,), (31,)]
    assert pad_decode_batch([], [], [], 2, 7) == ([0, 0], [0, 0], [(7,), (7,)])
    with pytest.raises(ValueError, match="cannot pad"):
        pad_decode_batch([1, 2, 3], [0, 0, 0], [(0,)] * 3, 2, 7)


@pytest.fixture(scope="module")
def plain_runner(tiny_llama_dir):
    """A CPU runner on the plain-torch model (the ops CUDA runs) with the padded reference decode;
    its last block is left to the padding rows, as the CUDA runner's extra block is."""
    mp = pytest.MonkeyPatch()
    mp.setenv("THINKSERVE_FUSED_OPS", "0")
    try:
        runner = ModelRunner(ModelConfig.from_pretrained(tiny_llama_dir), tiny_llama_dir, device="cpu",
                             dtype=torch.float32, block_size=BS, num_device_blocks=40, num_host_blocks=0,
                             decode_attention="padded")
    finally:
        mp.undo()
    assert runner.model.fused_ops is None and runner.graphs is None
    return runner


def test_static_buffers_reproduce_the_eager_decode_step(plain_runner):
    """Five ragged decodes padded to an 8-row graph's buffers: the model run on them (what the graph
    captures) gives the eager step's logits and writes the same KV; the padding rows write only
    into the pad block."""
    runner, pad_block = plain_runner, 39
    prompts = [list(range(20, 20 + n)) for n in (3, 17, 9, 30, 1)]
    tables, nxt, free = [], [], iter(range(39))
    for i, p in enumerate(prompts):
        table = tuple(next(free) for _ in range(-(-(len(p) + 4) // BS)))
        out = runner.execute(StepPlan((ScheduledSeq(i, tuple(p), 0, table, greedy()),)))
        tables.append(table)
        nxt.append(out.sampled[0].token_id)
    starts = [len(p) for p in prompts]
    plan = StepPlan(tuple(ScheduledSeq(i, (t,), s, tb, greedy()) for i, (t, s, tb) in enumerate(zip(nxt, starts, tables))))
    eager = runner.compute_logits(plan)
    cache_after_eager = runner.kv_cache.clone()

    max_blocks = -(-runner.config.max_model_len // BS)
    inputs = StaticDecodeInputs(8, max_blocks, BS, CPU, torch.float32, "padded")
    inputs.fill(*pad_decode_batch([0] * 8, [0] * 8, [(pad_block,)] * 8, 8, pad_block))  # as at capture
    inputs.fill(*pad_decode_batch(nxt, starts, tables, 8, pad_block))
    assert inputs.meta.decode.block_tables.shape == (8, max_blocks)
    with torch.inference_mode():
        logits, hidden = runner.model.forward(inputs.input_ids, inputs.meta, runner.kv_cache, inputs.logits_index,
                                              return_hidden=True)
    assert logits.shape[0] == hidden.shape[0] == 8
    for i in range(5):
        torch.testing.assert_close(logits[i], eager[i], rtol=1e-5, atol=1e-5)
        assert int(logits[i].argmax()) == int(eager[i].argmax())
    torch.testing.assert_close(runner.kv_cache[:, :, :pad_block], cache_after_eager[:, :, :pad_block], rtol=0, atol=0)
    assert runner.kv_cache[:, :, pad_block, 1:].abs().sum() == 0  # padding wrote slot 0 only
    assert torch.isfinite(logits).all()  # padding rows too: they attend over their one key


def test_filling_a_batch_of_the_wrong_size_or_context_raises():
    inputs = StaticDecodeInputs(2, 3, BS, CPU, torch.float32, "padded")
    with pytest.raises(ValueError, match="does not fill"):
        inputs.fill([1], [0], [(0,)])
    with pytest.raises(ValueError, match="exceeds the graphs' 3"):
        inputs.fill([1, 1], [12, 0], [(0, 1, 2, 3), (5,)])
    with pytest.raises(ValueError, match="padded or flashinfer"):
        StaticDecodeInputs(2, 3, BS, CPU, torch.float32, "native")


# ---- the near-tie rule the GPU test and bench_cuda_decode.py judge kernels by --------------------

def test_first_differences_names_each_sequences_first_parting_and_its_margin():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from bench_cuda_decode import TIE, first_differences

    ref = [[5, 6, 7], [5, 6, 7, 8], [1, 2]]
    logprobs = [[{5: -0.1, 9: -3.0}, {6: -0.2, 3: -2.0}, {7: -0.5, 2: -0.9}],
                [{5: -0.1, 9: -3.0}, {6: -0.690, 4: -0.691}, {7: -0.1, 1: -4.0}, {8: -0.1, 0: -4.0}],
                [{1: -0.1, 2: -2.4}, {2: -0.3, 1: -1.6}]]
    got = [[5, 6, 7], [5, 4, 9, 9], [3, 2]]   # the same; parts at a near tie; parts where the margin is 2.3
    parted = first_differences(got, {"token_ids": ref, "logprobs": logprobs})
    assert [(i, j) for i, j, _ in parted] == [(1, 1), (2, 0)]
    assert parted[0][2] == pytest.approx(0.001) and parted[0][2] < TIE
    assert parted[1][2] == pytest.approx(2.3) and parted[1][2] >= TIE
