"""The CPU KV store (a server in another process) as an engine's preemption swap space:
same greedy output as an unconstrained run, store puts/gets, no pins or blocks left behind,
and a full store makes the scheduler recompute instead."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import run_checked
from kvt_helpers import Proc
from tiny_llama import build_tiny_llama
from thinkserve.kvtransfer.store import KVStore, StoreClient
from thinkserve.kvtransfer.swap import StoreSwapSpace, swap_block_keys
from thinkserve.kvtransfer.transport import TransferConfig
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.kv_cache import KVFingerprint, KVLayout
from thinkserve.workers.plan import SwapKey
from thinkserve.workers.sampling_params import SamplingParams

BS = 4
PROMPTS = [list(range(10, 30)), [7, 99, 3, 250, 41, 41, 8], list(range(100, 113))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("swap_llama")
    build_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def reference(model_path):
    eng = LLMEngine.from_pretrained(str(model_path), block_size=BS, num_device_blocks=64)
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS, GREEDY)]


def start_store(capacity_bytes: int):
    proc = Proc("store", "--capacity-bytes", str(capacity_bytes))
    return proc, StoreClient(proc.read()["address"], TransferConfig(timeout_s=5))


def run(eng: LLMEngine) -> tuple[list[list[int]], int, int]:
    """Greedy outputs, most requests swapped out at once, most requeued to recompute at once."""
    r = run_checked(eng, PROMPTS, GREEDY)
    return [branches[0] for branches in r.token_ids], r.peak_swapped, r.peak_waiting


def assert_all_free(eng: LLMEngine) -> None:
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_preemption_swaps_through_the_store_server(model_path, reference):
    from thinkserve.kvtransfer.shared_buffers import SHARED
    proc, client = start_store(1 << 20)
    try:
        used = len(SHARED._used)
        space = StoreSwapSpace(client)
        eng = LLMEngine.from_pretrained(str(model_path), swap_space=space, block_size=BS,
                                        num_device_blocks=16)  # 3 requests of up to 11 blocks: preemption
        got, swapped, requeued = run(eng)
        assert got == reference
        assert client.same_node and not space._lent and len(SHARED._used) == used  # lent buffers came back
        assert swapped > 0 and requeued == 0 and eng.stats().num_preemptions > 0
        st = client.stats()
        assert st.puts > 0 and st.hits >= st.puts  # every stored block was read back
        assert st.pinned_entries == 0 and st.entries == 0 and st.bytes_used == 0  # unpinned and deleted
        assert_all_free(eng)
    finally:
        client.close()
        proc.kill()


def test_a_full_store_makes_the_scheduler_recompute(model_path, reference):
    proc, client = start_store(2 * 2048)  # two blocks of the tiny model: no victim fits whole
    try:
        space = StoreSwapSpace(client)
        eng = LLMEngine.from_pretrained(str(model_path), swap_space=space, block_size=BS, num_device_blocks=16)
        assert eng.runner.kv_layout.bytes_per_block == 2048
        got, swapped, requeued = run(eng)
        assert got == reference and eng.stats().num_preemptions > 0 and requeued > 0
        st = client.stats()
        # each refused swap-out stored its head blocks, then deleted them again
        assert st.puts > 0 and st.refused > 0 and st.pinned_entries == 0 and st.entries == 0
        assert_all_free(eng)
    finally:
        client.close()
        proc.kill()


def test_swap_keys_are_unique_per_engine_request_and_epoch():
    keys = [swap_block_keys(SwapKey(e, r, n), 3) for e in ("a", "b") for r in ("r0", "r1") for n in (1, 2)]
    flat = [k for ks in keys for k in ks]
    assert len(set(flat)) == len(flat) and all(0 <= k < 2**64 for k in flat)
    assert swap_block_keys(SwapKey("a", "r0", 1), 3) == keys[0]  # stable


def test_in_process_store_round_trip_and_discard():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
    store = KVStore(4 * layout.bytes_per_block)
    space = StoreSwapSpace(store)
    space.bind(KVFingerprint(layout, "LlamaForCausalLM", "m"))
    kv = torch.randn(layout.shape(3))
    key = SwapKey("eng", "r", 1)
    assert space.put(key, kv)
    assert store.stats().pinned_entries == 3
    assert not space.put(SwapKey("eng", "r2", 1), kv)  # one slot left, everything else pinned
    assert store.stats().entries == 3  # the refused put left nothing behind
    assert torch.equal(space.get(key, 3), kv)
    space.discard(key, 3)
    assert store.stats().entries == 0
    assert space.get(key, 3) is None
    space.discard(key, 3)  # discarding twice does nothing
    store.check_integrity()
