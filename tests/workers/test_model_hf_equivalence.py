"""The paged engine computes what Hugging Face computes.

Small random checkpoints are written by transformers itself (``save_pretrained``), loaded by our
loader, and driven through ``ModelRunner`` with hand-built step plans: whole and chunked
prefills, batches of different lengths, pages scattered over non-contiguous block ids. Greedy
tokens must equal ``generate(do_sample=False)`` and final logits must match to fp32 tolerance.
"""
from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from thinkserve.workers.model_config import ModelConfig
from thinkserve.workers.model_runner import ModelRunner
from thinkserve.workers.plan import ScheduledSeq, SeqSampling, StepPlan

NEW_TOKENS = 40
GREEDY = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, seed=0, output_index=0)
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=512, initializer_range=0.08)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llama3(**kw):
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    return LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=2, rope_parameters=rope, **kw))


def _qwen2(**kw):
    model = Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=1, tie_word_embeddings=True, **kw))
    with torch.no_grad():  # HF initialises biases to zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


def _mistral(**kw):
    # head_dim deliberately != hidden / heads; a window longer than any test sequence
    return MistralForCausalLM(MistralConfig(**SMALL, num_key_value_heads=2, head_dim=24, sliding_window=256, **kw))


BUILDERS = {"llama3-gqa-untied": _llama3, "qwen2-bias-tied": _qwen2, "mistral-headdim": _mistral}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(1234)
    model = BUILDERS[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return model, path


def _runner(path, block_size, num_blocks=128, device="cpu"):
    config = ModelConfig.from_pretrained(path)
    return ModelRunner(config, path, device=device, dtype=torch.float32, block_size=block_size,
                       num_device_blocks=num_blocks, num_host_blocks=4)


class PagedDriver:
    """A minimal stand-in for the scheduler: feeds prompts in chunks, decodes, hands out blocks
    from a shuffled free list so every sequence's pages are scattered and interleaved."""

    def __init__(self, runner: ModelRunner, prompts, *, chunk: int, seed: int = 0):
        self.runner, self.chunk, self.bs = runner, chunk, runner.block_size
        self.free = list(range(runner.num_device_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens = [list(p) for p in prompts]
        self.prompt_lens = [len(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.tables: list[list[int]] = [[] for _ in prompts]

    def _scheduled(self, i: int) -> ScheduledSeq:
        todo = self.tokens[i][self.computed[i]:]
        n = min(self.chunk, len(todo))
        end = self.computed[i] + n
        while len(self.tables[i]) * self.bs < end:
            self.tables[i].append(self.free.pop())
        done_prefill = end >= self.prompt_lens[i]
        sampling = GREEDY if done_prefill else None
        if sampling is not None:
            sampling = SeqSampling(0.0, 1.0, -1, 0, len(self.tokens[i]) - self.prompt_lens[i])
        return ScheduledSeq(i, tuple(todo[:n]), self.computed[i], tuple(self.tables[i]), sampling)

    def step(self, active) -> None:
        plan = StepPlan(tuple(self._scheduled(i) for i in active))
        result = self.runner.execute(plan)
        for s in plan.seqs:
            self.computed[s.seq_id] += len(s.token_ids)
        for tok in result.sampled:
            self.tokens[tok.seq_id].append(tok.token_id)

    def generate(self, new_tokens: int) -> list[list[int]]:
        want = [p + new_tokens for p in self.prompt_lens]
        while True:
            active = [i for i in range(len(self.tokens)) if len(self.tokens[i]) < want[i]]
            if not active:
                return [t[p:] for t, p in zip(self.tokens, self.prompt_lens)]
            self.step(active)

    def final_logits(self) -> dict[int, torch.Tensor]:
        """Logits after feeding each sequence's last generated token (not sampled, just computed)."""
        return self.runner.compute_logits(StepPlan(tuple(self._scheduled(i) for i in range(len(self.tokens)))))


def _hf_greedy(model, prompt, new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _hf_last_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 200], [42] * 5 + list(range(100, 123))]


@pytest.mark.parametrize("block_size,chunk", [(4, 10_000), (16, 10_000), (4, 5)],
                         ids=["bs4-whole", "bs16-whole", "bs4-chunk5"])
def test_batched_greedy_matches_hf_generate(checkpoint, block_size, chunk):
    model, path = checkpoint
    driver = PagedDriver(_runner(path, block_size), PROMPTS, chunk=chunk, seed=block_size + chunk)
    ours = driver.generate(NEW_TOKENS)
    for prompt, got in zip(PROMPTS, ours):
        assert got == _hf_greedy(model, prompt, NEW_TOKENS)
    logits = driver.final_logits()
    for i, ids in enumerate(driver.tokens):
        torch.testing.assert_close(logits[i], _hf_last_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_shares_steps_with_decodes(checkpoint):
    """A long prompt arrives while two sequences decode: its 6-token chunks ride along in the
    same steps as their decodes (one mixed batch per step)."""
    model, path = checkpoint
    runner = _runner(path, 4)
    long_prompt = list(range(1, 60))
    driver = PagedDriver(runner, [PROMPTS[0], PROMPTS[1], long_prompt], chunk=6, seed=7)
    for _ in range(3):  # the first two sequences prefill and start decoding alone
        driver.step([0, 1])
    mixed_steps = 0
    while len(driver.tokens[2]) < len(long_prompt) + NEW_TOKENS:
        active = [i for i in range(3) if len(driver.tokens[i]) < driver.prompt_lens[i] + NEW_TOKENS]
        if driver.computed[2] < len(long_prompt) and 0 in active:
            mixed_steps += 1
        driver.step(active)
    assert mixed_steps >= 5
    for i, prompt in enumerate([PROMPTS[0], PROMPTS[1], long_prompt]):
        assert driver.tokens[i][len(prompt):][:NEW_TOKENS] == _hf_greedy(model, prompt, NEW_TOKENS)


def test_logits_only_for_sampling_rows(checkpoint):
    """A non-final prefill chunk yields no logits and no sample; the final chunk yields one row."""
    _, path = checkpoint
    runner = _runner(path, 4)
    prompt = PROMPTS[2]
    first = StepPlan((ScheduledSeq(0, tuple(prompt[:20]), 0, tuple(range(5)), None),))
    assert runner.execute(first).sampled == ()
    last = StepPlan((ScheduledSeq(0, tuple(prompt[20:]), 20, tuple(range(9)), GREEDY),))
    logits = runner.compute_logits(last)
    assert list(logits) == [0] and logits[0].shape == (256,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runner_matches_hf_on_cpu(checkpoint):
    """The same torch path on CUDA (fp32, TF32 off): tokens equal HF's CPU greedy output."""
    model, path = checkpoint
    torch.backends.cuda.matmul.allow_tf32 = False
    driver = PagedDriver(_runner(path, 16, device="cuda"), PROMPTS, chunk=7, seed=3)
    ours = driver.generate(NEW_TOKENS)
    for prompt, got in zip(PROMPTS, ours):
        assert got == _hf_greedy(model, prompt, NEW_TOKENS)
    logits = driver.final_logits()
    for i, ids in enumerate(driver.tokens):
        torch.testing.assert_close(logits[i].cpu(), _hf_last_logits(model, ids), atol=1e-3, rtol=1e-3)
