"""Block manager: exact block ids, prefix hits, copy-on-write, eviction order, swapping."""
import subprocess
import sys

import pytest

from thinkserve.workers.block_manager import BlockManager, BlockManagerError
from thinkserve.workers.sequence import Sequence

BS = 4


def seq(tokens, seq_id=0):
    return Sequence(seq_id, 0, list(tokens), len(tokens), seed=0)


def computed(s: Sequence, bm: BlockManager, n=None):
    """Pretend the model computed ``n`` more tokens (all by default) and cache full blocks."""
    s.num_computed_tokens = s.num_tokens if n is None else s.num_computed_tokens + n
    bm.register_computed_blocks(s)


def check(bm, *seqs):
    bm.check_integrity([s.block_table for s in seqs], [s.host_block_table for s in seqs])


def test_policy_modules_do_not_import_torch():
    code = ("import sys; import thinkserve.workers.block_manager, thinkserve.workers.scheduler, "
            "thinkserve.workers.migration, thinkserve.workers.outputs; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_allocate_exact_ids_and_free_returns_everything():
    bm = BlockManager(8, BS)
    a, b = seq(range(10), 0), seq(range(100, 105), 1)
    assert bm.allocate(a) == 0
    assert a.block_table == [0, 1, 2]
    assert bm.allocate(b) == 0
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    check(bm, a, b)
    bm.free(a)
    bm.free(b)
    assert a.block_table == [] and bm.num_free_blocks == 8
    check(bm)


def test_capacity_is_a_return_value():
    bm = BlockManager(2, BS)
    big = seq(range(9))  # 3 blocks
    assert bm.allocate(big) is None
    assert big.block_table == [] and bm.num_free_blocks == 2
    check(bm)


def test_prefix_hit_reuses_full_computed_blocks_only():
    bm = BlockManager(10, BS)
    a = seq(list(range(10)))  # blocks [0..3][4..7][8 9]
    bm.allocate(a)
    computed(a, bm)
    b = seq(list(range(8)) + [77, 78, 79])
    assert bm.allocate(b) == 8  # two full blocks hit
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] not in a.block_table
    assert bm.ref_count[a.block_table[0]] == 2
    check(bm, a, b)


def test_prefix_hit_leaves_last_token_to_compute():
    bm = BlockManager(10, BS)
    a = seq(range(8))
    bm.allocate(a)
    computed(a, bm)
    b = seq(range(8))  # identical prompt: the last block must be computed again for its logits
    assert bm.allocate(b) == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]


def test_uncomputed_blocks_are_not_cached():
    bm = BlockManager(10, BS)
    a = seq(range(12))
    bm.allocate(a)
    computed(a, bm, 5)  # chunked prefill: only block 0 is full and computed
    b = seq(range(12))
    assert bm.allocate(b) == 4


def test_freed_cached_blocks_are_reused_lru_tail_first():
    bm = BlockManager(6, BS)
    a = seq(range(8), 0)  # 2 blocks, both full
    bm.allocate(a)
    computed(a, bm)
    assert a.block_table == [0, 1]
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_free_blocks == 2
    # New unrelated blocks come from never-cached free blocks first.
    c = seq(range(100, 116), 1)  # 4 blocks
    bm.allocate(c)
    assert c.block_table == [2, 3, 4, 5]
    # Then the least recently freed cached block goes: a's tail (block 1) before its head (block 0).
    d = seq([200], 2)
    bm.allocate(d)
    assert d.block_table == [1]
    # The head is still cached and still hits.
    bm.free(d)
    e = seq(list(range(4)) + [9], 3)
    assert bm.allocate(e) == 4 and e.block_table == [0, 1]
    check(bm, c, e)


def test_eviction_invalidates_the_hash():
    bm = BlockManager(2, BS)
    a = seq(range(5), 0)
    bm.allocate(a)
    computed(a, bm)
    bm.free(a)
    filler = seq(range(100, 108), 1)
    bm.allocate(filler)  # takes both blocks, evicting a's cached block
    bm.free(filler)
    again = seq(range(5), 2)
    assert bm.allocate(again) == 0
    check(bm, again)


def test_fork_shares_then_copy_on_write():
    bm = BlockManager(10, BS)
    root = seq(range(6))  # blocks: [0..3] full, [4 5 _ _] partial
    bm.allocate(root)
    computed(root, bm)
    child = Sequence(1, 1, list(root.token_ids), 6, seed=1)
    bm.fork(root, child)
    assert child.block_table == root.block_table == [0, 1]
    assert bm.ref_count[0] == 2 and bm.ref_count[1] == 2
    root.token_ids.append(50)
    child.token_ids.append(60)
    assert bm.num_blocks_to_append([root, child]) == 1  # the last writer keeps the original
    copies = bm.append_slots(root)
    assert copies == [(1, 2)] and root.block_table == [0, 2]
    assert bm.append_slots(child) == [] and child.block_table == [0, 1]
    assert bm.ref_count[1] == 1 and bm.ref_count[0] == 2
    check(bm, root, child)
    bm.free(root)
    bm.free(child)
    check(bm)


def test_cow_of_an_uncomputed_block_needs_no_copy():
    bm = BlockManager(10, BS)
    root = seq(range(5))  # position 4 (the last prompt token) opens block 1
    bm.allocate(root)
    computed(root, bm, 4)
    child = Sequence(1, 1, list(root.token_ids), 5, seed=1)
    bm.fork(root, child)
    assert bm.append_slots(root) == []  # block 1 held nothing computed: a fresh block suffices
    assert root.block_table == [0, 2] and child.block_table == [0, 1]
    check(bm, root, child)


def test_append_slot_opens_a_new_block_at_the_boundary():
    bm = BlockManager(3, BS)
    s = seq(range(4))
    bm.allocate(s)
    computed(s, bm)
    s.token_ids.append(9)
    assert bm.can_append([s])
    assert bm.append_slots(s) == [] and s.block_table == [0, 1]
    s.num_computed_tokens += 1
    s.token_ids.append(10)
    assert bm.append_slots(s) == [] and s.block_table == [0, 1]  # still room in block 1


def test_append_returns_none_when_full():
    bm = BlockManager(1, BS)
    s = seq(range(4))
    bm.allocate(s)
    computed(s, bm)
    s.token_ids.append(1)
    assert not bm.can_append([s])
    assert bm.append_slots(s) is None and s.block_table == [0]


def test_swap_out_and_in_keeps_sharing():
    bm = BlockManager(6, BS, num_host_blocks=4)
    root = seq(range(6))
    bm.allocate(root)
    computed(root, bm)
    child = Sequence(1, 1, list(root.token_ids), 6, seed=1)
    bm.fork(root, child)
    out = bm.swap_out([root, child])
    assert out == [(0, 0), (1, 1)]
    assert root.host_block_table == child.host_block_table == [0, 1]
    assert root.block_table == [] and bm.host.ref_count[:2] == [2, 2]
    check(bm, root, child)
    back = bm.swap_in([root, child])
    assert [h for h, _ in back] == [0, 1]
    assert root.block_table == child.block_table
    assert bm.ref_count[root.block_table[0]] == 2 and bm.host.num_free_blocks == 4
    check(bm, root, child)


def test_swap_out_without_host_room_returns_none():
    bm = BlockManager(4, BS, num_host_blocks=1)
    s = seq(range(8))
    bm.allocate(s)
    assert bm.swap_out([s]) is None and s.block_table == [0, 1]
    check(bm, s)


def test_check_integrity_catches_a_leak_and_a_double_free():
    bm = BlockManager(4, BS)
    s = seq(range(5))
    bm.allocate(s)
    with pytest.raises(BlockManagerError, match="leak"):
        bm.check_integrity([])  # the caller lost track of s
    bm.free(s)
    with pytest.raises(BlockManagerError, match="freed more often"):
        bm.free_blocks([0])


def test_cache_blocks_for_an_imported_prefix():
    bm = BlockManager(4, BS)
    tokens = list(range(8))
    a = seq(tokens)
    bm.allocate(a)
    computed(a, bm)
    hashes, blocks = bm.cached_prefix(tokens)
    assert blocks == [0, 1] and len(hashes) == 2
    other = BlockManager(4, BS)
    filled = other.cache_blocks(hashes)
    assert filled == [(0, True), (1, True)]
    other.free_blocks([b for b, _ in filled])
    assert other.cached_prefix(tokens)[1] == [0, 1]
    assert other.cache_blocks(hashes) == [(0, False), (1, False)]  # already cached
    other.free_blocks([0, 1])
    probe = seq(tokens + [5])
    assert other.allocate(probe) == 8
    other.check_integrity([probe.block_table])


def test_prefix_caching_disabled_never_hits():
    bm = BlockManager(6, BS, enable_prefix_caching=False)
    a = seq(range(8))
    bm.allocate(a)
    computed(a, bm)
    b = seq(range(9), 1)
    assert bm.allocate(b) == 0
    bm.free(a)
    assert bm.num_cached_free_blocks == 0
    check(bm, b)
