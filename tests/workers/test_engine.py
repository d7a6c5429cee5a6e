"""LLMEngine end to end on a random tiny Llama (CPU): HF equivalence, preemption, seeded
sampling, Best-of-N sharing, export/import between engines, thinking budget, input errors."""
from __future__ import annotations

import msgpack
import pytest
import torch

from engine_helpers import run_checked
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.outputs import ExportedRequest
from thinkserve.workers.sampling_params import SamplingParams, branch_seed

BS = 4
# The tiny test vocabulary (tests/workers/conftest.py): byte tokens 0-255, then specials.
EOS_ID, THINK_START_ID, THINK_END_ID, TINY_VOCAB = 256, 257, 258, 272
PROMPTS = [list(range(10, 30)), [7, 99, 3, 250, 41, 41, 8], list(range(100, 113))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def engine(path, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", BS)
    cfg.setdefault("num_device_blocks", 64)
    return LLMEngine.from_pretrained(str(path), **cfg)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_all_free(eng: LLMEngine):
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_free_host_blocks == s.num_total_host_blocks


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """Greedy outputs of PROMPTS from an unconstrained engine."""
    return tokens(engine(tiny_llama_dir).generate(PROMPTS, GREEDY))


def test_greedy_matches_hf_generate(tiny_llama):
    path, model = tiny_llama.path, tiny_llama.hf_model
    assert (tiny_llama.eos_id, tiny_llama.think_start_id, tiny_llama.think_end_id, tiny_llama.vocab_size) == \
        (EOS_ID, THINK_START_ID, THINK_END_ID, TINY_VOCAB)
    # A small step budget forces chunked prefill next to decodes.
    eng = engine(path, max_num_batched_tokens=8)
    params = GREEDY.replace(max_tokens=32)
    outs = eng.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 32)
    assert_all_free(eng)


def test_engine_logs_its_parameter_count_and_kv_cache_at_load(tiny_llama, caplog):
    """What vLLM prints at start-up: the model's size (equal to the HF model's parameter count) and
    the KV cache it got."""
    with caplog.at_level("INFO", logger="thinkserve.workers.engine"):
        eng = engine(tiny_llama.path, num_device_blocks=40, block_size=16)
    hf_count = sum(p.numel() for p in tiny_llama.hf_model.parameters())   # tied weights counted once
    (line,) = [r.getMessage() for r in caplog.records if r.name == "thinkserve.workers.engine"]
    assert f" {hf_count:,} parameters in float32 on cpu" in line
    kv_mib = eng.runner.kv_layout.bytes_per_block * 40 / 2**20
    assert f"KV cache 40 blocks of 16 tokens ({kv_mib:.1f} MiB, 640 tokens)" in line


@pytest.mark.parametrize("mode,host", [("swap", 32), ("recompute", 0)])
def test_preemption_gives_the_same_greedy_output(tiny_llama_dir, reference, mode, host):
    # Three requests need up to 11 blocks each; 16 blocks force preemption while they decode.
    eng = engine(tiny_llama_dir, num_device_blocks=16, num_host_blocks=host, preemption_mode=mode)
    r = run_checked(eng, PROMPTS, GREEDY)
    assert [branches[0] for branches in r.token_ids] == [ref[0] for ref in reference]
    st = eng.stats()
    assert st.num_preemptions > 0
    # every preemption is counted by its mode: recompute drops the KV, swap (with host room) keeps it
    assert st.num_recompute_preemptions == (st.num_preemptions if mode == "recompute" else 0)
    assert (r.peak_swapped > 0) == (mode == "swap") and (r.peak_waiting > 0) == (mode == "recompute")
    assert_all_free(eng)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = tokens(engine(tiny_llama_dir).generate([PROMPTS[0]], params))[0]
    eng = engine(tiny_llama_dir)
    crowd = eng.generate(PROMPTS, [params, params.replace(seed=1), SamplingParams(temperature=0.0, max_tokens=5)])
    assert tokens(crowd)[0] == alone
    assert tokens(crowd)[1] != alone  # another seed, another sample
    assert_all_free(eng)


def test_unseeded_requests_get_a_seed_from_a_seeded_engine(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = tokens(engine(tiny_llama_dir, seed=5).generate([PROMPTS[1]], params))
    b = tokens(engine(tiny_llama_dir, seed=5).generate([PROMPTS[1]], params))
    assert a == b


def test_best_of_n_shares_prompt_blocks_and_matches_single_branches(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    params = SamplingParams(n=3, temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    prompt = PROMPTS[0]  # 20 tokens: 4 full blocks + the last prompt token opening block 5
    eng.add_request("bon", prompt, params)
    eng.step()  # the prompt once, sampling all three first tokens (fan-out), then the fork
    req = eng.scheduler.requests["bon"]
    assert len(req.seqs) == 3
    shared = req.seqs[0].block_table
    assert all(s.block_table == shared for s in req.seqs)
    assert all(eng.block_manager.ref_count[b] == 3 for b in shared)
    eng.step()  # each branch writes its first token: the partial last block is copied on write
    assert all(s.block_table[:4] == shared[:4] for s in req.seqs)
    assert all(eng.block_manager.ref_count[b] == 3 for b in shared[:4])
    eng.check_integrity()
    final = None
    while eng.has_unfinished_requests():
        final = [o for o in eng.step() if o.finished] or final
    got = [c.token_ids for c in final[0].outputs]
    assert len(set(map(tuple, got))) > 1
    # Branch i samples exactly like a lone request seeded with branch_seed(seed, i).
    single = engine(tiny_llama_dir)
    for i in range(3):
        alone = single.generate([prompt], params.replace(n=1, seed=branch_seed(99, i)))
        assert alone[0].outputs[0].token_ids == got[i]
    assert_all_free(eng)


def test_abort_and_finish_free_every_block(tiny_llama_dir):
    eng = engine(tiny_llama_dir, num_device_blocks=12, num_host_blocks=16, max_num_batched_tokens=8)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY.replace(max_tokens=40))
    eng.add_request("bon", PROMPTS[1], SamplingParams(n=2, max_tokens=40, seed=1, ignore_eos=True))
    for _ in range(12):
        eng.step()
        eng.check_integrity()
    states = {r.status.value for r in eng.scheduler.requests.values()}
    assert len(states) > 1  # a mix of running / waiting / swapped
    for rid in ["r0", "r1", "r2", "bon"]:
        assert eng.abort(rid)
    assert not eng.abort("r0") and not eng.has_unfinished_requests()
    assert_all_free(eng)
    eng.generate([PROMPTS[2]], GREEDY)
    assert_all_free(eng)


def test_stop_token_stop_string_and_max_tokens(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir)
    ref = reference[0][0]
    stop_tok = ref[5]
    out = eng.generate([PROMPTS[0]], GREEDY.replace(stop_token_ids=(stop_tok,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == ref[:ref.index(stop_tok) + 1]
    # A stop string made of bytes the model emits (the byte tokenizer: id == byte value).
    ascii_at = [i for i, t in enumerate(ref) if 32 <= t < 127]
    if ascii_at:
        i = ascii_at[0]
        stop = chr(ref[i])
        out = eng.generate([PROMPTS[0]], GREEDY.replace(stop=(stop,)))[0].outputs[0]
        assert out.finish_reason == "stop" and stop not in out.text
        assert out.token_ids == ref[:i + 1]
    out = eng.generate([PROMPTS[0]], GREEDY.replace(max_tokens=3))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == ref[:3]
    assert_all_free(eng)


def test_eos_stops_unless_ignored(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    # Make EOS the argmax by asking for it as the "stop": instead, check the rule directly with
    # a prompt whose greedy continuation we know and treat its first token as an extra stop id.
    assert EOS_ID in eng.tokenizer.eos_token_ids
    out = eng.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    assert out.finish_reason in ("stop", "length")
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == EOS_ID and out.token_ids.count(EOS_ID) == 1
    else:
        assert EOS_ID not in out.token_ids


def test_logprobs_passthrough(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir)
    out = eng.generate([PROMPTS[0]], GREEDY.replace(max_tokens=4, logprobs=2))[0].outputs[0]
    assert out.token_ids == reference[0][0][:4]
    assert len(out.logprobs) == 4
    for tok, entry in zip(out.token_ids, out.logprobs):
        assert tok in entry and entry[tok] <= 0.0
        assert entry[tok] == max(entry.values())  # greedy picks the most likely token


def test_thinking_budget_forces_end_of_thinking(tiny_llama_dir):
    prompt = [5, 6, 7, THINK_START_ID]
    eng = engine(tiny_llama_dir)
    free = eng.generate([prompt], GREEDY.replace(max_tokens=12))[0].outputs[0].token_ids
    budget = 3
    forced = eng.generate([prompt], GREEDY.replace(max_tokens=12, thinking_budget=budget))[0].outputs[0].token_ids
    if THINK_END_ID in free[:budget]:
        pytest.skip("the random model ends thinking by itself")
    assert forced[:budget] == free[:budget]
    assert forced[budget] == THINK_END_ID
    assert forced.count(THINK_END_ID) == 1 or forced[budget + 1:].count(THINK_START_ID) > 0
    zero = eng.generate([prompt], GREEDY.replace(max_tokens=2, thinking_budget=0))[0].outputs[0].token_ids
    assert zero[0] == THINK_END_ID
    assert_all_free(eng)


def test_prefix_cache_hits_give_the_same_output(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir)
    first = eng.generate([PROMPTS[0]], GREEDY)
    second = eng.generate([PROMPTS[0]], GREEDY)
    assert tokens(first) == tokens(second) == [reference[0]]
    assert eng.stats().prefix_cache_hit_rate > 0
    assert_all_free(eng)


def wire(exported: ExportedRequest) -> ExportedRequest:
    """What crosses the network: msgpack of plain data."""
    return ExportedRequest.from_dict(msgpack.unpackb(msgpack.packb(exported.to_dict())))


def transfer(src: LLMEngine, dst: LLMEngine, request_id: str, branches=None) -> None:
    exported = src.export_request(request_id)
    if branches is not None:
        exported = exported.subset(branches)
    data = src.read_blocks(exported.block_ids)
    exported = wire(exported)
    ids = dst.import_request(exported)
    assert ids is not None and len(ids) == len(exported.block_ids)
    dst.write_blocks(ids, data)
    dst.commit_import(request_id)


def run(eng: LLMEngine) -> dict:
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done


def test_prefill_then_decode_on_another_engine(tiny_llama_dir, reference):
    pre = engine(tiny_llama_dir, role="prefill")
    dec = engine(tiny_llama_dir, role="decode", num_device_blocks=40)
    assert pre.fingerprint() == dec.fingerprint()
    for i, p in enumerate(PROMPTS):
        pre.add_request(f"r{i}", p, GREEDY)
    prefilled = {}
    while pre.has_unfinished_requests():
        for o in pre.step():
            assert o.prefilled and not o.finished and len(o.outputs[0].token_ids) == 1
            prefilled[o.request_id] = o
    assert pre.stats().num_held == 3
    for rid in prefilled:
        transfer(pre, dec, rid)
        pre.release_request(rid)
    assert_all_free(pre)
    done = run(dec)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == [r[0] for r in reference]
    assert_all_free(dec)


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["last-block-partial", "last-block-full"])
def test_best_of_n_samples_every_first_token_in_the_step_that_computes_the_prompt(tiny_llama_dir, prompt):
    """Fan-out: a Best-of-4 request on a prefill engine is held after ONE step that computes the
    prompt once and samples all four first tokens from its last position; handed off, each
    branch decodes what an independent request seeded like that branch decodes alone."""
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    pre, dec = engine(tiny_llama_dir, role="prefill"), engine(tiny_llama_dir, role="decode")
    pre.add_request("bon", prompt, params)
    (out,) = pre.step()
    assert out.prefilled and [len(c.token_ids) for c in out.outputs] == [1] * 4
    assert pre.num_steps == 1 and not pre.has_unfinished_requests()
    assert pre.stats().num_computed_prompt_tokens == len(prompt)
    held = pre.scheduler.requests["bon"].seqs
    assert len({tuple(s.block_table) for s in held}) == 1      # every prompt block shared
    transfer(pre, dec, "bon")
    pre.release_request("bon")
    assert_all_free(pre)
    got = {c.index: c.token_ids for c in run(dec)["bon"].outputs}
    alone = engine(tiny_llama_dir)
    for i in range(4):
        alone.add_request(f"b{i}", prompt, params.replace(n=1, seed=branch_seed(5, i)))
    done = run(alone)
    assert got == {i: done[f"b{i}"].outputs[0].token_ids for i in range(4)}
    assert dec.stats().num_computed_prompt_tokens == 0
    for eng in (dec, alone):
        assert_all_free(eng)


def test_best_of_n_export_subsets_to_two_engines(tiny_llama_dir):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    local = engine(tiny_llama_dir).generate([PROMPTS[0]], params)[0]
    pre = engine(tiny_llama_dir, role="prefill")
    pre.add_request("bon", PROMPTS[0], params)
    while pre.has_unfinished_requests():
        pre.step()
    exported = pre.export_request("bon")
    assert len(exported.branches) == 3
    # The branches sampled their first tokens from one computation of the last prompt token
    # (fan-out), so every prompt page, the partial last one included, is shared and listed once.
    shared = exported.branches[0].block_indices
    assert all(b.block_indices == shared for b in exported.branches)
    assert len(exported.block_ids) == 5
    a, b = engine(tiny_llama_dir, role="decode"), engine(tiny_llama_dir, role="decode")
    for dst, branches in ((a, [0, 2]), (b, [1])):
        part = exported.subset(branches)
        ids = dst.import_request(wire(part))
        dst.write_blocks(ids, pre.read_blocks(part.block_ids))
        dst.commit_import("bon")
    pre.release_request("bon")
    got = {c.index: c.token_ids for eng in (a, b) for c in run(eng)["bon"].outputs}
    assert got == {c.index: c.token_ids for c in local.outputs}
    for eng in (pre, a, b):
        assert_all_free(eng)


def test_import_without_kv_recomputes(tiny_llama_dir, reference):
    src = engine(tiny_llama_dir)
    src.add_request("r", PROMPTS[2], GREEDY)
    for _ in range(5):
        src.step()
    exported = src.export_request("r").without_kv()
    src.release_request("r")
    assert_all_free(src)
    dst = engine(tiny_llama_dir, role="decode")
    assert dst.import_request(wire(exported)) == []
    dst.commit_import("r")
    assert run(dst)["r"].outputs[0].token_ids == reference[2][0]
    assert_all_free(dst)


def test_import_with_no_room_and_abort_import(tiny_llama_dir):
    pre = engine(tiny_llama_dir, role="prefill")
    pre.add_request("r", PROMPTS[0], GREEDY)
    while pre.has_unfinished_requests():
        pre.step()
    exported = pre.export_request("r")
    small = engine(tiny_llama_dir, role="decode", num_device_blocks=3)
    assert small.import_request(exported) is None
    assert_all_free(small)
    dst = engine(tiny_llama_dir, role="decode")
    assert dst.import_request(exported) is not None
    dst.check_integrity()
    dst.abort_import("r")
    assert_all_free(dst)
    with pytest.raises(ValueError, match="role 'prefill'"):
        pre.import_request(exported)


def test_prefix_export_import_between_engines(tiny_llama_dir, reference):
    a = engine(tiny_llama_dir)
    a.generate([PROMPTS[0]], GREEDY)
    hashes, data = a.export_prefix(PROMPTS[0])
    assert len(hashes) == 5  # 20 prompt tokens = 5 full blocks, all cached
    b = engine(tiny_llama_dir)
    assert b.import_prefix(PROMPTS[0], hashes, data) == 5
    assert b.import_prefix(PROMPTS[0], hashes, data) == 0  # already there
    out = b.generate([PROMPTS[0]], GREEDY)
    assert tokens(out) == [reference[0]]
    assert b.stats().prefix_cache_hit_rate == 1.0
    with pytest.raises(ValueError, match="hash chain"):
        b.import_prefix(PROMPTS[1], hashes, data)
    assert_all_free(b)


def test_bad_inputs_raise_naming_the_field_and_change_nothing(tiny_llama_dir):
    eng = engine(tiny_llama_dir, max_model_len=64, max_num_seqs=4)
    eng.add_request("ok", PROMPTS[1], GREEDY.replace(max_tokens=4))
    cases = [
        (("long", list(range(64)), GREEDY), "max_model_len is 64"),
        (("vocab", [1, 2, TINY_VOCAB], GREEDY), r"prompt_token_ids\[2\] = 272 is outside the vocabulary \[0, 272\)"),
        (("neg", [1, -1], GREEDY), r"prompt_token_ids\[1\]"),
        (("empty", [], GREEDY), "prompt must not be empty"),
        (("stop", [1, 2], GREEDY.replace(stop_token_ids=(9999,))), r"stop_token_ids\[0\]"),
        (("n", [1, 2], GREEDY.replace(n=5)), "max_num_seqs = 4"),
        (("ok", [1, 2], GREEDY), "already in use"),
    ]
    for (rid, prompt, params), message in cases:
        with pytest.raises(ValueError, match=message):
            eng.add_request(rid, prompt, params)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="max_model_len 100000 exceeds"):
        engine(tiny_llama_dir, max_model_len=100000)
    assert list(eng.scheduler.requests) == ["ok"]
    done = run(eng)
    assert len(done["ok"].outputs[0].token_ids) == 4
    assert_all_free(eng)


def test_max_model_len_finishes_with_length(tiny_llama_dir):
    eng = engine(tiny_llama_dir, max_model_len=24)
    out = eng.generate([PROMPTS[0]], GREEDY.replace(max_tokens=100))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 24 - len(PROMPTS[0])


def test_text_prompt_and_detokenized_output(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    out = eng.generate("hello", GREEDY.replace(max_tokens=6))[0]
    assert out.prompt_token_ids == list(b"hello")
    c = out.outputs[0]
    assert c.text == eng.tokenizer.decode(c.token_ids)


def test_prefill_role_generate_reports_a_stall_instead_of_spinning(tiny_llama_dir):
    pre = engine(tiny_llama_dir, role="prefill", num_device_blocks=8)
    first = pre.generate([PROMPTS[0]], GREEDY)[0]  # its 5 blocks stay held for export
    assert first.prefilled and pre.stats().num_held == 1
    with pytest.raises(RuntimeError, match="cannot make progress"):
        pre.generate([PROMPTS[2]], GREEDY)
    pre.release_request(first.request_id)
    for rid in list(pre.scheduler.requests):
        pre.abort(rid)
    assert_all_free(pre)


def test_urgent_request_preempts_and_finishes_first(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir, num_device_blocks=10, num_host_blocks=16)
    eng.add_request("background", PROMPTS[0], GREEDY, priority=5)
    eng.step()
    eng.add_request("urgent", PROMPTS[2], GREEDY, priority=0)
    finished = []
    while eng.has_unfinished_requests():
        finished += [o.request_id for o in eng.step() if o.finished]
        eng.check_integrity()
    assert finished == ["urgent", "background"]
    assert eng.stats().num_preemptions >= 1
    assert_all_free(eng)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_matches_cpu_and_survives_swapping(tiny_llama_dir, reference):
    eng = engine(tiny_llama_dir, device="cuda", dtype="float32", num_device_blocks=16, num_host_blocks=32)
    assert tokens(eng.generate(PROMPTS, GREEDY)) == reference
    assert eng.stats().num_preemptions > 0
    assert_all_free(eng)


def test_abort_branches_frees_their_blocks_and_the_rest_go_on_unchanged(tiny_llama_dir):
    """Early consensus cancels some branches of a Best-of-N request: they end with "abort",
    their own blocks come back at once, shared prompt blocks stay with the survivors, and the
    surviving branches sample exactly what they would have alone."""
    eng = engine(tiny_llama_dir)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    eng.add_request("bon", PROMPTS[0], params)
    with pytest.raises(ValueError, match="not yet forked"):
        eng.abort_branches("bon", [1])                  # still the root: branches do not exist yet
    for _ in range(6):
        eng.step()
    free_before = eng.stats().num_free_blocks
    assert eng.abort_branches("bon", [1, 3, 9]) == (1, 3)
    assert eng.stats().num_free_blocks > free_before    # their private blocks came back now
    eng.check_integrity()
    req = eng.scheduler.requests["bon"]
    assert [s.finish_reason for s in req.seqs] == [None, "abort", None, "abort"]
    assert eng.abort_branches("bon", [1]) == ()         # already finished: nothing to do
    final = None
    while eng.has_unfinished_requests():
        final = [o for o in eng.step() if o.finished] or final
    outs = {c.index: c for c in final[0].outputs}
    assert outs[1].finish_reason == outs[3].finish_reason == "abort"
    single = engine(tiny_llama_dir)
    for i in (0, 2):
        alone = single.generate([PROMPTS[0]], params.replace(n=1, seed=branch_seed(7, i)))
        assert outs[i].token_ids == alone[0].outputs[0].token_ids and len(outs[i].token_ids) == 16
    assert_all_free(eng)
    # naming every unfinished branch aborts the request whole
    eng.add_request("bon2", PROMPTS[1], params)
    for _ in range(4):
        eng.step()
    assert eng.abort_branches("bon2", range(4)) == (0, 1, 2, 3)
    assert "bon2" not in eng.scheduler.requests and not eng.has_unfinished_requests()
    assert_all_free(eng)
    with pytest.raises(KeyError):
        eng.abort_branches("nope", [0])


def test_hand_offs_do_not_starve_a_queued_request(tiny_llama_dir):
    """A decode engine kept at max_num_seqs by a stream of hand-offs, each offered again until it
    is taken (the sender keeps its KV meanwhile): a request queued there, as a preempted one is,
    starts at the first free slot instead of after every hand-off, and the batch never grows
    past its cap. (Before imports were admitted, they joined the batch whatever its size.)"""
    pre = engine(tiny_llama_dir, role="prefill")
    params = GREEDY.replace(max_tokens=3)
    for i in range(6):
        pre.add_request(f"h{i}", PROMPTS[i % 3], params)
    while pre.has_unfinished_requests():
        pre.step()
    exported = [pre.export_request(f"h{i}") for i in range(6)]
    dec = engine(tiny_llama_dir, role="decode", max_num_seqs=2)
    refused = 0

    def offer():
        nonlocal refused
        if not exported:
            return
        ids = dec.import_request(wire(exported[0]))
        if ids is None:
            refused += 1
            return
        e = exported.pop(0)
        dec.write_blocks(ids, pre.read_blocks(e.block_ids))
        dec.commit_import(e.request_id)
        pre.release_request(e.request_id)

    offer()
    offer()
    dec.add_request("w", PROMPTS[1], params)
    order, peak = [], 0
    while dec.has_unfinished_requests() or exported:
        offer()
        order += [o.request_id for o in dec.step() if o.finished]
        peak = max(peak, dec.stats().num_running_seqs)
    assert peak == 2 and refused > 0
    assert order[:3] == ["h0", "h1", "h2"] and order.index("w") < order.index("h3")
    for eng in (pre, dec):
        assert_all_free(eng)
