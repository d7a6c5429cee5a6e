"""The engine's KV access for transfers: per-layer writes, cache views, device-aware reads,
and resuming a request whose export was cancelled (failed migration / refused swap-out)."""
from __future__ import annotations

import pytest
import torch

from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.kv_cache import block_runs
from thinkserve.workers.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(10, 30))  # 20 tokens = 5 blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def engine(path, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", BS)
    cfg.setdefault("num_device_blocks", 64)
    return LLMEngine.from_pretrained(str(path), **cfg)


def run(eng: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return done


def assert_all_free(eng: LLMEngine) -> None:
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[int]:
    return engine(tiny_llama_dir).generate([PROMPT], GREEDY)[0].outputs[0].token_ids


def random_kv(eng: LLMEngine, n: int, num_layers: int | None = None, seed: int = 0) -> torch.Tensor:
    shape = list(eng.runner.kv_layout.shape(n))
    if num_layers is not None:
        shape[0] = num_layers
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(eng.runner.dtype)


# ----------------------------------------------------------------------------- block runs
def test_block_runs_are_maximal_consecutive_runs():
    assert block_runs([7, 8, 9, 3, 4, 12]) == [(0, 7, 3), (3, 3, 2), (5, 12, 1)]
    assert block_runs([5, 4, 3]) == [(0, 5, 1), (1, 4, 1), (2, 3, 1)]  # descending is not a run
    assert block_runs([]) == []


# ----------------------------------------------------------------------------- writes and views
@pytest.mark.parametrize("ids", [[5, 6, 7, 20], list(range(0, 36, 3))],  # few runs; 12 scattered ids
                         ids=["runs", "scattered"])
def test_write_blocks_layers_writes_only_those_layers(tiny_llama_dir, ids):
    eng = engine(tiny_llama_dir)
    num_layers = eng.runner.kv_layout.num_layers
    assert num_layers == 2
    full = random_kv(eng, len(ids), seed=1)
    eng.write_blocks(ids, full)
    torch.testing.assert_close(eng.read_blocks(ids), full, rtol=0, atol=0)
    layer1 = random_kv(eng, len(ids), num_layers=1, seed=2)
    eng.write_blocks(ids, layer1, layers=slice(1, 2))
    got = eng.read_blocks(ids)
    torch.testing.assert_close(got[0], full[0], rtol=0, atol=0)  # layer 0 untouched
    torch.testing.assert_close(got[1], layer1[0], rtol=0, atol=0)
    other = [b for b in range(64) if b not in ids]
    assert eng.read_blocks(other).abs().sum() == 0  # nothing else written


def test_write_blocks_layers_rejects_bad_slices_and_shapes(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    one = random_kv(eng, 2, num_layers=1)
    with pytest.raises(ValueError, match=r"KV data has shape \(1, 2, 2, 4, 2, 16\), expected \(2, 2, 2, 4, 2, 16\)"):
        eng.write_blocks([0, 1], one)
    with pytest.raises(ValueError, match="step-1 slice"):
        eng.write_blocks([0, 1], one, layers=slice(0, 2, 2))
    with pytest.raises(ValueError, match="step-1 slice"):
        eng.write_blocks([0, 1], one, layers=slice(1, 1))
    with pytest.raises(ValueError, match="must be a slice"):
        eng.write_blocks([0, 1], one, layers=1)
    with pytest.raises(ValueError, match=r"device block ids must be in \[0, 64\)"):
        eng.write_blocks([0, 64], one, layers=slice(0, 1))
    assert eng.read_blocks(range(64)).abs().sum() == 0  # every refusal came before any write


def test_kv_views_alias_the_cache_one_per_run(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    ids = [9, 10, 11, 2, 3]
    views = eng.kv_views(ids)
    assert [(pos, v.shape[2]) for pos, v in views] == [(0, 3), (3, 2)]
    data = random_kv(eng, len(ids), seed=3)
    for pos, view in views:  # what a receiver does with an arriving page set
        view.copy_(data[:, :, pos:pos + view.shape[2]])
    torch.testing.assert_close(eng.read_blocks(ids), data, rtol=0, atol=0)
    with pytest.raises(ValueError, match="device block ids"):
        eng.kv_views([63, 64])


@pytest.mark.parametrize("ids", [[4, 5, 6], [9, 2, 30, 31, 7], [9, 2, 30, 7, 15, 11]],
                         ids=["one-run", "few-runs", "index-select"])
def test_read_blocks_into_a_given_buffer(tiny_llama_dir, ids):
    eng = engine(tiny_llama_dir)
    data = random_kv(eng, len(ids), seed=5)
    eng.write_blocks(ids, data)
    out = torch.full_like(data, 7.0)
    assert eng.read_blocks(ids, out=out) is out
    torch.testing.assert_close(out, data, rtol=0, atol=0)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        eng.read_blocks(ids, out=torch.empty_like(data)[:, :, :1])


def test_read_blocks_device_default_cpu_and_a_copy(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    data = random_kv(eng, 3, seed=4)
    eng.write_blocks([4, 1, 8], data)
    cpu = eng.read_blocks([4, 1, 8])
    same = eng.read_blocks([4, 1, 8], device=eng.runner.device)
    assert cpu.device.type == "cpu" and same.device == eng.runner.kv_cache.device and same.is_contiguous()
    torch.testing.assert_close(same.cpu(), data, rtol=0, atol=0)
    same.zero_()  # a copy, not a view of the cache
    torch.testing.assert_close(eng.read_blocks([4, 1, 8]), data, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_read_blocks_stays_on_the_gpu(tiny_llama_dir):
    eng = engine(tiny_llama_dir, device="cuda", dtype="float32")
    data = random_kv(eng, 2, seed=5)
    eng.write_blocks([3, 7], data)
    on_gpu = eng.read_blocks([3, 7], device="cuda")
    assert on_gpu.is_cuda and eng.read_blocks([3, 7]).device.type == "cpu"
    torch.testing.assert_close(on_gpu.cpu(), data, rtol=0, atol=0)


# ----------------------------------------------------------------------------- resume_request
def test_resume_running_request_continues_in_place(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir)
    eng.add_request("r", PROMPT, GREEDY)
    for _ in range(4):
        eng.step()
    free_before = eng.stats().num_free_blocks
    exported = eng.export_request("r")  # e.g. a migration that is about to fail
    assert exported.has_kv and not eng.has_unfinished_requests()
    eng.resume_request("r")
    assert eng.stats().num_running == 1 and eng.stats().num_free_blocks == free_before
    assert run(eng) == {"r": reference}  # identical to never having been exported
    assert_all_free(eng)


def test_a_resumed_request_waits_for_batch_slots_taken_while_it_was_exported(tiny_llama_dir, reference):
    """Exported, its slots went back: a Best-of-2 took them, so at a cap of 2 the resumed request
    is held with its KV until they free; the batch never holds more than 2 branches and its
    output is as if never exported."""
    eng = engine(tiny_llama_dir, max_num_seqs=2)
    eng.add_request("r", PROMPT, GREEDY)
    for _ in range(4):
        eng.step()
    eng.export_request("r")
    eng.add_request("q", list(range(40, 52)), SamplingParams(n=2, temperature=0.0, max_tokens=4, ignore_eos=True))
    eng.step()
    assert eng.scheduler.num_running_seqs() == 2
    eng.resume_request("r")
    s = eng.stats()
    assert (s.num_running_seqs, s.num_waiting, s.num_held) == (2, 1, 0)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        assert eng.scheduler.num_running_seqs() <= 2
    assert done["r"] == reference
    assert_all_free(eng)


def test_resume_request_exported_without_kv_recomputes(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir)
    eng.add_request("r", PROMPT, GREEDY)
    assert not eng.export_request("r").has_kv  # still queued: nothing computed yet
    eng.resume_request("r")
    assert eng.stats().num_waiting == 1
    assert run(eng) == {"r": reference}
    assert_all_free(eng)


def test_resume_on_prefill_engine_holds_it_again(tiny_llama_dir):
    eng = engine(tiny_llama_dir, role="prefill")
    [out] = eng.generate([PROMPT], GREEDY)
    assert out.prefilled
    rid = out.request_id
    first = eng.export_request(rid)
    eng.resume_request(rid)
    s = eng.stats()
    assert s.num_held == 1 and s.num_running == 0 and not eng.has_unfinished_requests()
    assert eng.export_request(rid) == first  # the handoff can be retried elsewhere
    eng.release_request(rid)
    assert_all_free(eng)


def test_resume_request_unknown_or_not_exported_raises(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    with pytest.raises(KeyError, match="no exported request 'nope'"):
        eng.resume_request("nope")
    eng.add_request("r", PROMPT, GREEDY)
    with pytest.raises(KeyError, match="no exported request 'r'"):
        eng.resume_request("r")  # queued, never exported
    eng.export_request("r")
    eng.resume_request("r")
    with pytest.raises(KeyError):
        eng.resume_request("r")  # already resumed
    assert eng.abort("r")
    assert_all_free(eng)
