"""ModelRunner mechanics: block moves (swap, copy-on-write, export/import), seeded sampling
through the runner, logprobs, and plans that break invariants."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from thinkserve.workers.kv_cache import KVLayout
from thinkserve.workers.model_config import ModelConfig
from thinkserve.workers.model_runner import ModelRunner
from thinkserve.workers.plan import ScheduledSeq, SeqSampling, StepPlan

BS = 4
PROMPT = (5, 9, 200, 31, 7, 7, 64, 18, 3, 250)  # 10 tokens: 2 full blocks + a partial one


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(i: int = 0) -> SeqSampling:
    return SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, seed=0, output_index=i)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.08)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def make_runner(path, num_blocks=32, num_host_blocks=8) -> ModelRunner:
    return ModelRunner(ModelConfig.from_pretrained(path), path, device="cpu", dtype=torch.float32,
                       block_size=BS, num_device_blocks=num_blocks, num_host_blocks=num_host_blocks)


def decode(runner, seq_id, tokens, table, n, sampling=greedy):
    """Greedy-decodes ``n`` tokens for a sequence whose KV covers tokens[:-1]."""
    tokens = list(tokens)
    for _ in range(n):
        pos = len(tokens) - 1
        assert len(table) * BS > pos, "test bug: table too short"
        out = runner.execute(StepPlan((ScheduledSeq(seq_id, (tokens[-1],), pos, tuple(table), sampling(0)),)))
        tokens.append(out.sampled[0].token_id)
    return tokens


def prefill(runner, table, prompt=PROMPT):
    out = runner.execute(StepPlan((ScheduledSeq(0, prompt, 0, tuple(table), greedy()),)))
    return list(prompt) + [out.sampled[0].token_id]


def reference(path, n):
    runner = make_runner(path)
    table = [0, 1, 2, 3, 4, 5]
    return decode(runner, 0, prefill(runner, table), table, n)


def test_kv_layout_and_fingerprint(model_path):
    a, b = make_runner(model_path), make_runner(model_path, num_blocks=8)
    assert a.kv_layout == KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=BS, dtype="float32")
    assert a.kv_cache.shape == (2, 2, 32, BS, 2, 16) and a.host_cache.shape == (2, 2, 8, BS, 2, 16)
    assert a.kv_layout.bytes_per_block == 2 * 2 * BS * 2 * 16 * 4
    assert a.kv_layout.num_blocks_for_budget(10 * a.kv_layout.bytes_per_block + 1) == 10
    assert a.fingerprint() == b.fingerprint()


def test_read_write_blocks_round_trip(model_path):
    runner = make_runner(model_path)
    prefill(runner, [9, 3, 17])
    data = runner.read_blocks([17, 9, 3])
    assert data.shape == runner.kv_layout.shape(3) and data.is_contiguous() and data.abs().sum() > 0
    runner.write_blocks([0, 1, 2], data)
    torch.testing.assert_close(runner.read_blocks([0, 1, 2]), data, rtol=0, atol=0)
    # reading returns a copy: mutating it leaves the cache alone
    data.zero_()
    assert runner.read_blocks([17]).abs().sum() > 0
    host = torch.randn(runner.kv_layout.shape(2))
    runner.write_host_blocks([5, 1], host)
    torch.testing.assert_close(runner.read_host_blocks([1, 5]), host.flip(2), rtol=0, atol=0)


def test_write_blocks_rejects_wrong_shape_dtype_and_ids(model_path):
    runner = make_runner(model_path)
    good = torch.zeros(runner.kv_layout.shape(2))
    with pytest.raises(ValueError, match="shape"):
        runner.write_blocks([0], good)
    with pytest.raises(ValueError, match="dtype"):
        runner.write_blocks([0, 1], good.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"block ids must be in \[0, 32\)"):
        runner.write_blocks([0, 32], good)
    with pytest.raises(ValueError, match="block ids"):
        runner.read_host_blocks([8])


def test_migrating_pages_to_another_runner_continues_identically(model_path):
    """Export the pages after prefill, import them under different block ids elsewhere."""
    want = reference(model_path, 12)
    src = make_runner(model_path)
    tokens = prefill(src, [4, 8, 15])
    dst = make_runner(model_path)
    dst.write_blocks([30, 2, 11], src.read_blocks([4, 8, 15]))
    table = [30, 2, 11, 5, 6, 7]
    assert decode(dst, 0, tokens, table, 12) == want


def test_swap_out_and_back_in_to_new_blocks(model_path):
    want = reference(model_path, 12)
    runner = make_runner(model_path)
    tokens = decode(runner, 0, prefill(runner, [0, 1, 2]), [0, 1, 2], 1)  # 12 tokens, KV for 11
    swap_out = StepPlan((), blocks_to_swap_out=((0, 3), (1, 4), (2, 5)))
    assert runner.execute(swap_out).sampled == ()
    runner.kv_cache.zero_()  # the device copies are gone; only the host has the pages
    # swap back into other blocks and decode in the same step
    table = (20, 21, 22, 23)
    plan = StepPlan((ScheduledSeq(0, (tokens[-1],), 11, table, greedy()),),
                    blocks_to_swap_in=((3, 20), (4, 21), (5, 22)))
    tokens.append(runner.execute(plan).sampled[0].token_id)
    assert decode(runner, 0, tokens, list(table) + [24, 25], 10) == want


def test_copy_on_write_fork_both_branches_follow_parent(model_path):
    """Branches share the full blocks; the partial last block is copied before each writes."""
    want = reference(model_path, 6)
    runner = make_runner(model_path)
    tokens = prefill(runner, [0, 1, 2])  # positions 8, 9 live in block 2 (partial)
    pos = len(tokens) - 1
    plan = StepPlan(
        (ScheduledSeq(0, (tokens[-1],), pos, (0, 1, 2), greedy()),
         ScheduledSeq(1, (tokens[-1],), pos, (0, 1, 7), greedy())),
        blocks_to_copy=((2, 7),),
    )
    sampled = {s.seq_id: s.token_id for s in runner.execute(plan).sampled}
    assert sampled[0] == sampled[1] == want[len(tokens)]
    torch.testing.assert_close(runner.read_blocks([2]), runner.read_blocks([7]), rtol=0, atol=0)


def test_seeded_sampling_is_independent_of_batch(model_path):
    """The same seeded sequence samples the same tokens alone and inside a batch (and at a
    different batch position, next to greedy and differently seeded neighbours)."""

    def run(batch_with_others: bool):
        runner = make_runner(model_path)
        seqs = {0: (list(PROMPT), (0, 1, 2, 3, 4, 5))}
        if batch_with_others:
            seqs = {7: ([1, 2, 3], (10, 11, 12, 13, 14)), 3: ([9] * 9, (20, 21, 22, 23, 24, 25)), **seqs}
        params = {0: 42, 7: 1, 3: None}
        tokens = {k: list(v[0]) for k, v in seqs.items()}
        computed = {k: 0 for k in seqs}
        for step in range(10):
            batch = []
            for k, (_, table) in seqs.items():
                todo = tokens[k][computed[k]:]
                i = step  # output index == step: every sequence prefills in step 0
                seed = params[k]
                s = SeqSampling(0.0 if seed is None else 0.9, 0.9, 50, seed or 0, i)
                batch.append(ScheduledSeq(k, tuple(todo), computed[k], table, s))
            for s in runner.execute(StepPlan(tuple(batch))).sampled:
                computed[s.seq_id] = len(tokens[s.seq_id])
                tokens[s.seq_id].append(s.token_id)
        return tokens[0][len(PROMPT):]

    alone = run(False)
    assert alone == run(True)
    assert len(set(alone)) > 1  # it really sampled


def test_logprobs_match_log_softmax_of_logits(model_path):
    runner = make_runner(model_path)
    s = SeqSampling(temperature=0.0, top_p=1.0, top_k=-1, seed=0, output_index=0, logprobs=3)
    logits = runner.compute_logits(StepPlan((ScheduledSeq(0, PROMPT, 0, (0, 1, 2), s),)))[0]
    out = runner.execute(StepPlan((ScheduledSeq(0, PROMPT, 0, (0, 1, 2), s),))).sampled[0]
    lp = torch.log_softmax(logits, -1)
    assert out.token_id == int(lp.argmax())
    assert out.logprob == pytest.approx(float(lp.max()), abs=1e-5)
    top = lp.topk(3)
    assert [t for t, _ in out.top_logprobs] == top.indices.tolist()
    assert [v for _, v in out.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("seq,match", [
    (ScheduledSeq(0, PROMPT, 0, (0, 1), None), "cannot hold 10 tokens"),
    (ScheduledSeq(0, PROMPT, 0, (0, 1, 99), None), "outside"),
    (ScheduledSeq(0, (1,), 256, (0,), None), "max_model_len"),
    (ScheduledSeq(0, (), 0, (0,), None), "at least one token"),
])
def test_invalid_plans_raise(model_path, seq, match):
    runner = make_runner(model_path)
    with pytest.raises(ValueError, match=match):
        runner.execute(StepPlan((seq,)))


def test_out_of_range_block_moves_raise(model_path):
    runner = make_runner(model_path)
    with pytest.raises(ValueError, match="swap_out"):
        runner.execute(StepPlan((), blocks_to_swap_out=((0, 8),)))
    with pytest.raises(ValueError, match="copy"):
        runner.execute(StepPlan((), blocks_to_copy=((32, 0),)))


def test_bfloat16_runner_tracks_float32(model_path):
    """Half-precision path (cache, masks, rope tables in bf16): logits stay close to fp32."""
    config = ModelConfig.from_pretrained(model_path)
    half = ModelRunner(config, model_path, device="cpu", dtype=torch.bfloat16, block_size=BS,
                       num_device_blocks=8, num_host_blocks=0)
    assert half.kv_cache.dtype == torch.bfloat16 and half.kv_layout.dtype == "bfloat16"
    plan = StepPlan((ScheduledSeq(0, PROMPT[:6], 0, (3, 1), None), ScheduledSeq(1, PROMPT, 0, (0, 2, 4), greedy())))
    full = make_runner(model_path)
    want = full.compute_logits(plan)[1]
    got = half.compute_logits(plan)[1]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_invalid_plan_changes_nothing(model_path):
    runner = make_runner(model_path)
    prefill(runner, [0, 1, 2])
    before = runner.read_blocks(range(32))
    bad = StepPlan((ScheduledSeq(0, PROMPT, 0, (5,), None),), blocks_to_copy=((0, 9),), blocks_to_swap_out=((1, 0),))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(bad)
    torch.testing.assert_close(runner.read_blocks(range(32)), before, rtol=0, atol=0)
    assert runner.read_host_blocks([0]).abs().sum() == 0
