"""Best-of-N waves on a prefill engine (early consensus): held branches are cancelled one by one,
and later branches start from the prompt KV the prefill engine holds, without computing the
prompt again. Outputs must equal the offline engine's, every block must come back."""
from __future__ import annotations

import pytest

from test_engine import PROMPTS, assert_all_free, engine, run, transfer
from thinkserve.workers.sampling_params import SamplingParams, branch_seed


def prefilled(eng, rid, prompt, params):
    eng.add_request(rid, prompt, params)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.requests[rid].status.value == "held"


def test_held_branches_are_cancelled_one_by_one_and_the_rest_hand_off(tiny_llama_dir):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    offline = {c.index: c.token_ids for c in engine(tiny_llama_dir).generate([PROMPTS[0]], params)[0].outputs}
    pre, dec = engine(tiny_llama_dir, role="prefill"), engine(tiny_llama_dir, role="decode")
    prefilled(pre, "bon", PROMPTS[0], params)
    free = pre.stats().num_free_blocks
    assert pre.abort_branches("bon", [1, 3]) == (1, 3)
    # the branches sampled from one computation of the prompt (fan-out) and share every prompt
    # block: aborting two of them frees no block while the others hold them
    assert pre.stats().num_free_blocks == free
    pre.check_integrity()
    seqs = pre.scheduler.requests["bon"].seqs
    assert [s.finish_reason for s in seqs] == [None, "abort", None, "abort"]
    transfer(pre, dec, "bon")                       # the handoff exports only the survivors
    pre.release_request("bon")
    assert_all_free(pre)
    out = {c.index: c for c in run(dec)["bon"].outputs}
    assert sorted(out) == [0, 2] and all(out[i].token_ids == offline[i] for i in (0, 2))
    assert_all_free(dec)
    # naming every held branch aborts the request whole
    prefilled(pre, "bon2", PROMPTS[1], params)
    assert pre.abort_branches("bon2", range(4)) == (0, 1, 2, 3) and "bon2" not in pre.scheduler.requests
    assert_all_free(pre)


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["last-block-partial", "blocks-aligned"])
def test_fork_held_starts_later_branches_from_the_held_prompt_kv(tiny_llama_dir, prompt):
    """Wave 1 (branches 0, 1) is prefilled; branches 2..5 are forked off it into a reserve that
    holds only the prompt's KV; later waves fork from the reserve. A later branch computes exactly
    one prompt token (its last) where it runs, and samples what branch i of
    one Best-of-6 request samples offline."""
    full = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    offline = {c.index: c.token_ids for c in engine(tiny_llama_dir).generate([prompt], full)[0].outputs}
    pre = engine(tiny_llama_dir, role="prefill")
    a, b = engine(tiny_llama_dir, role="decode"), engine(tiny_llama_dir, role="decode")
    prefilled(pre, "bon", prompt, full.replace(n=2))
    computed = pre.stats().num_computed_prompt_tokens
    assert computed == len(prompt)                  # once: both first tokens sample its last position
    pre.fork_held("bon", "reserve", [2, 3, 4, 5])
    transfer(pre, a, "bon")                         # wave 1's handoff
    pre.release_request("bon")
    pre.check_integrity()
    # wave 2 = branches 2 and 3: forked out of the reserve, which keeps 4 and 5
    pre.fork_held("reserve", "wave2", [2, 3])
    assert pre.abort_branches("reserve", [2, 3]) == (2, 3)
    transfer(pre, b, "wave2")
    pre.release_request("wave2")
    assert pre.stats().num_computed_prompt_tokens == computed      # nothing recomputed on the prefill side
    got = {c.index: c.token_ids for eng in (a, b) for o in run(eng).values() for c in o.outputs}
    assert got == {i: offline[i] for i in range(4)}
    assert a.stats().num_computed_prompt_tokens == 0                # wave 1 arrived with its last token computed
    assert b.stats().num_computed_prompt_tokens == 2                # one token per later branch, not the prompt
    # the rule stopped: the reserve's branches are cancelled one by one, then it is gone
    assert pre.abort_branches("reserve", [4]) == (4,)
    pre.check_integrity()
    assert pre.abort_branches("reserve", [5]) == (5,) and "reserve" not in pre.scheduler.requests
    for eng in (pre, a, b):
        assert_all_free(eng)
    with pytest.raises(KeyError, match="no held request"):
        pre.fork_held("reserve", "x", [1])
    # a recompute of the same branches (the path a later wave took before) computes the prompt
    c = engine(tiny_llama_dir, role="decode")
    c.add_request("w", prompt, SamplingParams(n=1, temperature=1.0, seed=branch_seed(11, 2), max_tokens=10,
                                              ignore_eos=True))
    assert run(c)["w"].outputs[0].token_ids == offline[2]
    assert c.stats().num_computed_prompt_tokens == len(prompt)


def first_tokens(eng, rid):
    """Step until request ``rid`` has its first tokens: its prompt is computed and forked."""
    for _ in range(64):
        if any(o.request_id == rid and any(c.token_ids for c in o.outputs) for o in eng.step()):
            return
    raise AssertionError(f"{rid} produced no token")


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]], ids=["last-block-partial", "blocks-aligned"])
def test_a_colocated_request_forks_later_waves_off_its_running_first_wave(tiny_llama_dir, prompt):
    """Colocated pools: one mixed engine runs wave 1 (branches 0, 1), added with a reserve for
    branches 2..5, which the engine forks off the *running* request in the step its prompt is
    computed; wave 2 is forked off the reserve and started right there. Wave 2 computes one
    prompt token per branch and samples what branches 2, 3 of one Best-of-6 request sample
    offline."""
    full = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    offline = {c.index: c.token_ids for c in engine(tiny_llama_dir).generate([prompt], full)[0].outputs}
    eng = engine(tiny_llama_dir)
    eng.add_request("bon", prompt, full.replace(n=2), reserve=("reserve", [2, 3, 4, 5, 6]))
    assert eng.abort_branches("reserve", [6]) == (6,)      # before the fork: fewer branches to fork
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("reserve", prompt, full)
    first_tokens(eng, "bon")
    computed = eng.stats().num_computed_prompt_tokens
    assert computed == len(prompt)                  # once, for both branches of wave 1 (fan-out)
    assert [s.index for s in eng.scheduler.requests["reserve"].seqs] == [2, 3, 4, 5]
    for _ in range(3):                              # wave 1 decodes on; the reserve is never scheduled
        eng.step()
    eng.fork_held("reserve", "wave2", [2, 3], start=True)
    assert eng.abort_branches("reserve", [2, 3]) == (2, 3)
    eng.check_integrity()
    done = run(eng)
    assert sorted(done) == ["bon", "wave2"] and eng.scheduler.requests["reserve"].status.value == "held"
    got = {c.index: c.token_ids for o in done.values() for c in o.outputs}
    assert got == {i: offline[i] for i in range(4)}
    assert eng.stats().num_computed_prompt_tokens == computed + 2     # one per wave-2 branch, not the prompt
    assert eng.abort_branches("reserve", [4, 5]) == (4, 5)
    assert_all_free(eng)
    # a reserve whose source is aborted before its prompt is computed is never forked
    eng.add_request("gone", prompt, full.replace(n=2), reserve=("r2", [2]))
    assert eng.abort("gone") and eng.has_request("r2")
    eng.step()
    assert not eng.has_request("r2")
    assert_all_free(eng)


def test_a_reserve_is_freed_when_the_engine_needs_its_blocks(tiny_llama_dir):
    """KV pressure: a reserve (held prompt KV for later waves) is freed before any running request
    is preempted. It ends with reason ``reclaimed`` (reported like a finish), the request that
    needed the blocks runs without a preemption and gives the offline output, every block comes
    back, and a fork off the reclaimed reserve is refused (later waves recompute)."""
    bon = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    big = SamplingParams(temperature=0.0, max_tokens=42, ignore_eos=True)
    want = engine(tiny_llama_dir).generate([PROMPTS[1]], big)[0].outputs[0].token_ids
    eng = engine(tiny_llama_dir, num_device_blocks=16)
    eng.add_request("bon", PROMPTS[0], bon, reserve=("reserve", [2, 3, 4, 5]))   # 20 prompt tokens: 5 blocks of 4
    run(eng)                                        # wave 1 ends: the reserve alone holds the prompt's blocks
    held = eng.stats()
    assert held.num_free_blocks == 16 - 5 and held.num_reclaimed_reserves == 0
    eng.add_request("big", PROMPTS[1], big)         # 7 + 42 tokens (the last one never computed): 12 blocks, 11 free
    ended = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                ended[o.request_id] = o
    assert [c.finish_reason for c in ended["reserve"].outputs] == ["reclaimed"] * 4
    assert ended["big"].outputs[0].token_ids == want
    s = eng.stats()
    assert (s.num_reclaimed_reserves, s.num_preemptions) == (1, 0)
    assert "reserve" not in eng.scheduler.requests
    with pytest.raises(KeyError, match="no held request"):
        eng.fork_held("reserve", "wave2", [2])
    assert_all_free(eng)


def test_a_colocated_later_wave_waits_for_batch_slots(tiny_llama_dir):
    """A later wave started on a mixed engine whose batch is at ``max_num_seqs`` (4: wave 1's two
    branches and a greedy Best-of-2 beside it) is held with its KV, not added past the cap; it
    runs once a slot pair frees (the other request ends first: fewer tokens), the batch never
    holds more than 4 branches, it computes no prompt again, and every output equals the
    offline engine's."""
    bon = SamplingParams(n=6, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    other = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, ignore_eos=True)
    ref = engine(tiny_llama_dir)
    offline = {c.index: c.token_ids for c in ref.generate([PROMPTS[0]], bon)[0].outputs}
    want_other = [c.token_ids for c in ref.generate([PROMPTS[1]], other)[0].outputs]
    eng = engine(tiny_llama_dir, max_num_seqs=4)
    eng.add_request("bon", PROMPTS[0], bon.replace(n=2), reserve=("reserve", [2, 3, 4, 5]))
    eng.add_request("other", PROMPTS[1], other)
    first_tokens(eng, "bon")
    assert eng.scheduler.num_running_seqs() == 4            # the cap: wave 1 and "other"
    computed = eng.stats().num_computed_prompt_tokens
    eng.fork_held("reserve", "wave2", [2, 3], start=True)
    assert eng.abort_branches("reserve", [2, 3]) == (2, 3)
    wave2 = eng.scheduler.requests["wave2"]
    assert wave2.status.value == "held" and wave2 in eng.scheduler.starting
    s = eng.stats()
    assert (s.num_running_seqs, s.num_waiting) == (4, 1)
    eng.check_integrity()
    done, started_at = {}, None
    step = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
        assert eng.scheduler.num_running_seqs() <= 4, step
        assert len(eng.last_plan.seqs) <= 4, step
        if started_at is None and wave2.status.value == "running":
            started_at = step
            assert "other" in done                           # it ran once "other" freed its slots
    assert started_at is not None and sorted(done) == ["bon", "other", "wave2"]
    got = {c.index: c.token_ids for o in (done["bon"], done["wave2"]) for c in o.outputs}
    assert got == {i: offline[i] for i in range(4)}
    assert [c.token_ids for c in done["other"].outputs] == want_other
    assert eng.stats().num_computed_prompt_tokens == computed + 2      # one per wave-2 branch
    assert eng.abort_branches("reserve", [4, 5]) == (4, 5)
    assert_all_free(eng)
