"""External swap space (workers/swap_space.py): preemption swaps into it when host blocks run
out; a full space makes the victim recompute; keys never collide; nothing leaks. The space is
the one deployments use, ``StoreSwapSpace``, over an in-process ``KVStore`` (the store server
path is in tests/kvtransfer/test_swap_store.py)."""
from __future__ import annotations

import pytest

from engine_helpers import run_checked
from thinkserve.workers.block_manager import BlockManager
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.plan import SwapKey
from thinkserve.workers.sampling_params import SamplingParams
from thinkserve.workers.scheduler import Scheduler
from thinkserve.workers.sequence import Request, RequestStatus, Sequence
from thinkserve.kvtransfer.store import KVStore
from thinkserve.kvtransfer.swap import StoreSwapSpace, swap_block_keys

BS = 4
PROMPTS = [list(range(10, 30)), [7, 99, 3, 250, 41, 41, 8], list(range(100, 113))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
BON = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)


def store_space(capacity_bytes: int = 1 << 20) -> StoreSwapSpace:
    return StoreSwapSpace(KVStore(capacity_bytes))


def stored_entries(space: StoreSwapSpace) -> int:
    return space.store.stats().entries


def engine(path, swap_space=None, **cfg) -> LLMEngine:
    cfg.setdefault("block_size", BS)
    cfg.setdefault("num_device_blocks", 64)
    return LLMEngine.from_pretrained(str(path), swap_space=swap_space, **cfg)


def run(eng: LLMEngine, prompts, params) -> tuple[list, int]:
    """Every request to completion, checking integrity each step; (token ids, max swapped)."""
    r = run_checked(eng, prompts, params)
    return r.token_ids, r.peak_swapped


def assert_all_free(eng: LLMEngine):
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_free_host_blocks == s.num_total_host_blocks


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    eng = engine(tiny_llama_dir)
    return run(eng, PROMPTS, GREEDY)[0], run(eng, PROMPTS[:2], BON)[0]


def test_preemption_swaps_into_the_external_space_and_output_is_unchanged(tiny_llama_dir, reference):
    space = store_space()
    eng = engine(tiny_llama_dir, space, num_device_blocks=16)  # no host blocks: the space is the tier
    got, swapped = run(eng, PROMPTS, GREEDY)
    assert got == reference[0]
    assert swapped > 0 and eng.stats().num_preemptions > 0 and eng.stats().num_recompute_preemptions == 0
    assert space.num_puts > 0 and space.num_gets == space.num_puts  # every swap-out came back once
    assert stored_entries(space) == 0 and space.store.stats().bytes_used == 0
    assert_all_free(eng)


def test_best_of_n_branches_share_their_stored_blocks(tiny_llama_dir, reference):
    space = store_space()
    eng = engine(tiny_llama_dir, space, num_device_blocks=16)
    got, swapped = run(eng, PROMPTS[:2], BON)
    assert got == reference[1] and swapped > 0 and space.num_puts > 0
    assert stored_entries(space) == 0
    assert_all_free(eng)


def test_a_full_space_makes_the_victim_recompute(tiny_llama_dir, reference):
    space = store_space(0)  # refuses everything
    eng = engine(tiny_llama_dir, space, num_device_blocks=16)
    got, swapped = run(eng, PROMPTS, GREEDY)
    assert got == reference[0]
    assert space.num_refused > 0 and space.num_puts == 0 and eng.stats().num_preemptions > 0
    # each refused swap-out turned into a recompute, and is counted as one
    assert eng.stats().num_recompute_preemptions == space.num_refused
    assert_all_free(eng)


def test_host_blocks_first_then_the_external_space(tiny_llama_dir, reference):
    space = store_space()
    eng = engine(tiny_llama_dir, space, num_device_blocks=16, num_host_blocks=5)
    host_used = 0
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_integrity()
        host_used = max(host_used, 5 - eng.stats().num_free_host_blocks)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == [r[0] for r in reference[0]]
    assert host_used > 0 and space.num_puts > 0
    assert_all_free(eng)


def test_lost_kv_is_recomputed(tiny_llama_dir, reference):
    class Forgetful(StoreSwapSpace):  # a store that lost its entries (e.g. restarted)
        def get(self, key, num_blocks):
            lost = swap_block_keys(key, num_blocks)
            self.store.unpin(self.namespace, lost)
            self.store.delete(self.namespace, lost)
            return super().get(key, num_blocks)

    space = Forgetful(KVStore(1 << 20))
    eng = engine(tiny_llama_dir, space, num_device_blocks=16)
    got, _ = run(eng, PROMPTS, GREEDY)
    assert got == reference[0] and space.num_gets > 0 and stored_entries(space) == 0
    assert_all_free(eng)


def test_abort_and_export_while_swapped_discard_the_entry(tiny_llama_dir):
    space = store_space()
    eng = engine(tiny_llama_dir, space, num_device_blocks=16)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY.replace(max_tokens=40))
    swapped = []
    while len(swapped) < 1:
        eng.step()
        swapped = [r for r in eng.scheduler.swapped if r.swap_key is not None]
    victim = swapped[0].request_id
    assert stored_entries(space) > 0
    if victim == "r0":
        exported = eng.export_request(victim)
        assert not exported.has_kv and stored_entries(space) == 0
        eng.release_request(victim)
    else:
        assert eng.abort(victim) and stored_entries(space) == 0
    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    assert stored_entries(space) == 0
    assert_all_free(eng)


def test_two_engines_sharing_a_space_never_collide(tiny_llama_dir, reference):
    space = store_space()
    a = engine(tiny_llama_dir, space, num_device_blocks=16)
    b = engine(tiny_llama_dir, space, num_device_blocks=16)
    assert a.instance_id != b.instance_id
    for eng in (a, b):
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, GREEDY)  # the same request ids on both engines
    done = {a: {}, b: {}}
    while a.has_unfinished_requests() or b.has_unfinished_requests():
        for eng in (a, b):
            done[eng].update((o.request_id, o) for o in eng.step() if o.finished)
    for eng in (a, b):
        assert [done[eng][f"r{i}"].outputs[0].token_ids for i in range(3)] == [r[0] for r in reference[0]]
        assert_all_free(eng)
    assert space.num_puts > 1 and stored_entries(space) == 0


# ---- the scheduler's side: plain data, exact expectations ---------------------------------------
def test_scheduler_plans_external_swaps_and_recomputes_on_refusal():
    config = EngineConfig(block_size=BS, num_device_blocks=4, num_host_blocks=0)
    sched = Scheduler(config, BlockManager(4, BS), external_swap=True, instance_id="eng-a")
    reqs = []
    for i, prompt in enumerate([list(range(7)), list(range(20, 27))]):  # 2 blocks each
        seq = Sequence(sched.new_seq_id(), 0, prompt, len(prompt), seed=i)
        reqs.append(Request(f"q{i}", prompt, SamplingParams(seed=i), 0, i, [seq], forked=True))
        sched.add(reqs[-1])
    out = sched.schedule()
    sched.on_computed(out)
    a, b = reqs
    blocks_b = list(b.seqs[0].block_table)
    for r in reqs:  # both sampled a token; a's next one opens a third block: b must go
        r.seqs[0].token_ids.append(1)
    a.seqs[0].token_ids.append(2)
    out = sched.schedule()
    assert out.preempted == [b] and b.status is RequestStatus.SWAPPED
    (t,) = out.plan.swap_outs
    assert (t.request_id, t.key, list(t.block_ids)) == ("q1", SwapKey("eng-a", "q1", 1), blocks_b)
    assert b.seqs[0].swap_indices == [0, 1] and b.seqs[0].block_table == []
    sched.swap_out_refused("q1")  # the space was full
    assert b.status is RequestStatus.WAITING and b.swap_key is None and b.seqs[0].num_computed_tokens == 0
    assert b.num_swap_outs == 1  # the next swap-out of q1 gets epoch 2
    sched.bm.check_integrity(sched.block_tables(), sched.host_block_tables())
