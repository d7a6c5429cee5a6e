"""The CUDA decode path on a GPU: FlashInfer's paged decode kernel and CUDA-graph decode steps
against the plain-torch reference (padded decode attention, every step eager) on the same device
and dtype; every block must come back, and the graphs must have been replayed.

Greedy tokens must be identical in fp32. FlashInfer has only half-precision kernels, and in fp16 two
correct kernels may round a near-tie differently: a random model's top two logits are often within
0.001-0.01 of each other (measured on CPU for the Qwen2 below). So in fp16 tokens must be identical
up to the first step where the reference's top two log-probabilities are within ``TIE``; there
either token passes and the rest of that sequence is not compared (vLLM's tests compare half-precision
kernels the same way); and most tokens must have been compared. Run by ``bench/gpu_check.sh``;
skipped without CUDA (and the FlashInfer cases without ``flashinfer``)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_cuda_decode import TIE, first_differences  # noqa: E402  (the benchmark's near-tie rule)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (decode attention backend, CUDA graphs); the reference is ("padded", no graphs)
VARIANTS = [("padded", True), ("flashinfer", False), ("flashinfer", True)]


def _workload(vocab: int):
    """Ragged prompts and ragged output lengths, so batches shrink through several graph buckets,
    and a small step budget, so prefill chunks share steps with decodes (those steps run eagerly)."""
    prompts = [[(7 * i + 3 * j) % (vocab - 8) + 4 for j in range(5 + 11 * i % 37)] for i in range(13)]
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 9 * i, ignore_eos=True, logprobs=2) for i in range(13)]
    return prompts, params


def _engine(model: str, monkeypatch, backend: str, graphs: bool, **cfg) -> LLMEngine:
    monkeypatch.setenv("THINKSERVE_DECODE_ATTENTION", backend)
    cfg = dict(device="cuda", dtype="float16", block_size=16, num_device_blocks=256, max_num_seqs=16,
               max_num_batched_tokens=64, enforce_eager=not graphs) | cfg
    return LLMEngine.from_pretrained(model, **cfg)


def _assert_greedy_agrees(got, reference, strict: bool):
    """Identical tokens; unless ``strict``, up to each sequence's first reference near-tie (module
    docstring; the rule is ``bench_cuda_decode.first_differences``'s, which the benchmark reports
    by), with at least 80% of all tokens compared."""
    tokens, ref = [t for t, _ in got], [t for t, _ in reference]
    assert [len(t) for t in tokens] == [len(t) for t in ref]
    if strict:
        assert tokens == ref, "tokens differ from the reference"
        return
    parted = first_differences(tokens, {"token_ids": ref, "logprobs": [lp for _, lp in reference]})
    for i, j, margin in parted:
        assert margin < TIE, f"sequence {i} token {j}: {tokens[i][j]} != {ref[i][j]} where the reference's margin is {margin:.4f}"
    total = sum(len(t) for t in ref)
    compared = total - sum(len(ref[i]) - j for i, j, _ in parted)
    assert compared >= 0.8 * total, f"only {compared} of {total} tokens before a near-tie"


def _check_variant(model: str, monkeypatch, backend: str, graphs: bool, **cfg):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    prompts, params = _workload(cfg.pop("vocab"))
    ref_engine = _engine(model, monkeypatch, "padded", False, **cfg)
    assert ref_engine.runner.graphs is None and ref_engine.runner.decode_attention == "padded"
    reference = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in ref_engine.generate(prompts, params)]
    del ref_engine
    eng = _engine(model, monkeypatch, backend, graphs, **cfg)
    assert eng.runner.decode_attention == backend and (eng.runner.graphs is not None) == graphs
    got = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in eng.generate(prompts, params)]
    assert [len(t) for t, _ in got] == [p.max_tokens for p in params]
    _assert_greedy_agrees(got, reference, strict=cfg.get("dtype") == "float32")
    if graphs:
        assert eng.runner.graphs.num_replays > 0
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_tiny_reasoner_greedy_tokens_match_the_reference(monkeypatch):
    """The shipped model (head_dim 32) on its CUDA default: the padded kernel, with graphs."""
    _check_variant("tiny-reasoner", monkeypatch, "padded", True, vocab=64)


@pytest.mark.parametrize("graphs", [False, True])
def test_flashinfer_forced_on_tiny_reasoner_is_refused_when_the_engine_is_made(monkeypatch, graphs):
    """FlashInfer's decode kernels do not take head_dim 32 (forced, they failed mid-step on an
    H200: "VariableLengthMergeStates: Unsupported head_dim: 32"), so asking for them is refused
    with the model's head size and the supported ones before the engine takes a request."""
    with pytest.raises(ValueError, match=r"head_dim in \[64, 128, 256\]; this model has dtype torch.float16, head_dim 32"):
        _engine("tiny-reasoner", monkeypatch, "flashinfer", graphs)


@pytest.fixture(scope="module")
def random_qwen2(tmp_path_factory):
    """A random Qwen2 (GQA 8:2, head_dim 64, q/k/v biases) with the byte tokenizer."""
    from tiny_llama import TINY_VOCAB, write_byte_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(7)
    cfg = Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=3,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.05, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path, safe_serialization=True)
    write_byte_tokenizer(path)
    return path


@pytest.mark.parametrize("backend,graphs", VARIANTS)
def test_random_qwen2_greedy_tokens_match_the_reference(random_qwen2, monkeypatch, backend, graphs):
    _check_variant(str(random_qwen2), monkeypatch, backend, graphs, vocab=256)


@pytest.mark.parametrize("model", ["tiny-reasoner", "qwen2"])
def test_fp32_graphs_give_exactly_the_eager_tokens(random_qwen2, monkeypatch, model):
    """fp32 (padded attention: FlashInfer has no fp32 kernels): no near-ties at this precision,
    so replayed graphs must give exactly the eager reference's tokens."""
    name, vocab = ("tiny-reasoner", 64) if model == "tiny-reasoner" else (str(random_qwen2), 256)
    torch.backends.cuda.matmul.allow_tf32 = False
    _check_variant(name, monkeypatch, "padded", True, vocab=vocab, dtype="float32")


def test_flashinfer_is_the_default_where_it_fits(random_qwen2, monkeypatch):
    pytest.importorskip("flashinfer")
    monkeypatch.delenv("THINKSERVE_DECODE_ATTENTION", raising=False)
    # float16, as the other cases: FlashInfer compiles one kernel per dtype and head size (JIT)
    eng = LLMEngine.from_pretrained(str(random_qwen2), device="cuda", dtype="float16", num_device_blocks=64,
                                    max_num_seqs=4)
    assert eng.runner.decode_attention == "flashinfer" and eng.runner.graphs.sizes == (1, 2, 4)
    fp32 = LLMEngine.from_pretrained(str(random_qwen2), device="cuda", dtype="float32", num_device_blocks=64,
                                     max_num_seqs=4)
    assert fp32.runner.decode_attention == "padded"


def test_flashinfer_decode_logits_match_the_padded_reference(random_qwen2):
    """One ragged decode step over identical caches (the prefills are the same plain-torch code in
    both runners): FlashInfer's logits equal the padded reference's within fp16 rounding. The
    kernel-level check behind the token comparisons above."""
    pytest.importorskip("flashinfer")
    from thinkserve.workers.model_config import ModelConfig
    from thinkserve.workers.model_runner import ModelRunner
    from thinkserve.workers.plan import ScheduledSeq, SeqSampling, StepPlan

    greedy = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, seed=0, output_index=0)
    config = ModelConfig.from_pretrained(random_qwen2)
    lengths, bs = (5, 40, 17, 90, 16), 16
    tables, first = [], 0
    for n in lengths:  # interleaved, non-contiguous blocks: seq i owns every len(lengths)-th block
        tables.append(tuple(range(first, first + len(lengths) * (-(-(n + 1) // bs)), len(lengths))))
        first += 1
    logits = {}
    for backend in ("padded", "flashinfer"):
        runner = ModelRunner(config, random_qwen2, device="cuda", dtype=torch.float16, block_size=bs,
                             num_device_blocks=64, num_host_blocks=0, decode_attention=backend, enforce_eager=True)
        for i, (n, table) in enumerate(zip(lengths, tables)):
            runner.execute(StepPlan((ScheduledSeq(i, tuple(range(3, 3 + n)), 0, table, greedy),)))
        step = StepPlan(tuple(ScheduledSeq(i, (7,), n, table, greedy)
                              for i, (n, table) in enumerate(zip(lengths, tables))))
        logits[backend] = runner.compute_logits(step)
    for i in range(len(lengths)):
        torch.testing.assert_close(logits["flashinfer"][i], logits["padded"][i], atol=2e-2, rtol=2e-2)
