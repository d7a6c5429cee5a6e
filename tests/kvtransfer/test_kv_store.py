"""The CPU KV store: byte-exact round trips, LRU order, hard capacity, pins, stats; in process
and through its zmq server in another process."""
from __future__ import annotations

import os
import random
import time

import pytest
import torch

from kvt_helpers import Proc
from thinkserve.kvtransfer.store import KVStore, StoreClient, StoreServer
from thinkserve.kvtransfer.transport import PeerGone, TransferConfig, TransferTimeout
from thinkserve.workers.kv_cache import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")  # 512 B/block
BPB = LAYOUT.bytes_per_block


def blob(i: int, n: int = 100) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(n))


def test_round_trip_is_byte_exact_and_counts_hits_and_misses():
    s = KVStore(10_000)
    assert s.put("m", [1, 2, 3], [blob(1), blob(2), blob(3)]) == [True] * 3
    got = s.get("m", [3, 9, 1])
    assert bytes(got[0]) == blob(3) and got[1] is None and bytes(got[2]) == blob(1)
    assert s.get("other-model", [1]) == [None]  # namespaces do not mix
    st = s.stats()
    assert (st.hits, st.misses, st.puts, st.bytes_used, st.entries) == (2, 2, 3, 300, 3)
    s.check_integrity()


def test_put_copies_caller_buffers_by_default():
    s = KVStore(1000)
    buf = bytearray(blob(5))
    s.put("m", [5], [buf])
    buf[0] ^= 0xFF
    assert bytes(s.get("m", [5])[0]) == blob(5)


def test_lru_eviction_order_and_get_refreshes():
    s = KVStore(300)  # three 100-byte entries
    s.put("m", [1, 2, 3], [blob(1), blob(2), blob(3)])
    s.get("m", [1])  # 1 becomes most recently used: order 2, 3, 1
    assert s.contains("m", [2]) == [True]  # contains does not touch the order
    assert s.put("m", [4], [blob(4)]) == [True]  # evicts 2
    assert s.contains("m", [1, 2, 3, 4]) == [True, False, True, True]
    assert s.put("m", [5], [blob(5)]) == [True]  # evicts 3 (order was 3, 1, 4)
    assert s.contains("m", [1, 3, 4, 5]) == [True, False, True, True]
    assert s.put("m", [6, 7], [blob(6), blob(7)]) == [True, True]  # evicts 1, then 4
    assert s.contains("m", [1, 4, 5, 6, 7]) == [False, False, True, True, True]
    st = s.stats()
    assert (st.evictions, st.evicted_bytes, st.bytes_used) == (4, 400, 300)


def test_a_put_never_evicts_its_own_batch_and_refuses_the_rest():
    s = KVStore(300)
    s.put("m", [1], [blob(1)])
    # a 4-block chain into 3 slots: the old entry goes, the chain's head stays, its tail is refused
    assert s.put("m", [10, 11, 12, 13], [blob(i) for i in range(4)]) == [True, True, True, False]
    assert s.match_prefix("m", [10, 11, 12, 13]) == 3
    assert s.stats().refused == 1
    assert s.put("m", [99], [bytes(301)]) == [False]  # larger than the whole store


def test_pins_protect_entries_from_eviction_until_unpinned():
    s = KVStore(300)
    s.put("m", [1, 2, 3], [blob(1), blob(2), blob(3)])
    assert s.pin("m", [1, 2, 42]) == [True, True, False]
    assert s.put("m", [4], [blob(4)]) == [True]  # only 3 was evictable
    assert s.put("m", [5], [blob(5)]) == [True]  # evicts 4
    assert s.contains("m", [1, 2, 3, 4, 5]) == [True, True, False, False, True]
    s.pin("m", [5])
    assert s.put("m", [6], [blob(6)]) == [False]  # full of pinned entries: refused, not grown
    assert s.stats().bytes_used == 300
    s.unpin("m", [1])
    assert s.put("m", [6], [blob(6)]) == [True]  # 1 was evictable again
    assert s.contains("m", [1]) == [False]
    with pytest.raises(ValueError, match="not pinned"):
        s.unpin("m", [1])
    s.check_integrity()


def test_random_workload_never_exceeds_capacity():
    rng = random.Random(0)
    s = KVStore(5_000)
    pinned: list[int] = []
    for step in range(2_000):
        op = rng.random()
        keys = [rng.randrange(200) for _ in range(rng.randint(1, 6))]
        if op < 0.45:  # a few sizes recur, so freed buffers get reused
            s.put("m", keys, [bytes([step % 256]) * rng.choice([100, 300, 900, rng.randint(1, 900)]) for _ in keys])
        elif op < 0.7:
            s.get("m", keys)
        elif op < 0.8:
            s.delete("m", keys)
        elif op < 0.9:
            pinned += [k for k, ok in zip(keys, s.pin("m", keys)) if ok]
        elif pinned:
            s.unpin("m", [pinned.pop(rng.randrange(len(pinned)))])
        st = s.stats()
        assert st.bytes_used + st.spare_bytes <= 5_000
        if step % 50 == 0:
            s.check_integrity()
    s.check_integrity()


def test_freed_buffers_are_reused_but_never_under_a_reader():
    """A deleted or evicted block's buffer is reused for the next put of that size (warm memory),
    unless someone still reads it: a reader's view keeps its bytes."""
    s = KVStore(4 * 1000)
    s.put("m", [1, 2], [b"a" * 1000, b"b" * 1000])
    held = s.get("m", [1])[0]  # a reader keeps block 1's buffer
    s.delete("m", [1, 2])
    assert s.stats().spare_bytes == 1000  # block 2's buffer is spare; block 1's is the reader's
    spare = s._spare[1000][0]
    s.put("m", [3], [b"c" * 1000])
    assert s.stats().spare_bytes == 0 and bytes(s.get("m", [3])[0]) == b"c" * 1000
    assert s._lru[("m", 3)] is spare  # the spare buffer took block 3
    assert bytes(held) == b"a" * 1000  # untouched
    s.put("m", [4, 5, 6, 7], [bytes([i]) * 1000 for i in range(4)])  # evicts 3 (no reader): reused for 7
    assert s._lru[("m", 7)] is spare
    assert [bytes(b[:1]) if b is not None else None for b in s.get("m", [3, 4, 5, 6, 7])] == \
        [None, b"\x00", b"\x01", b"\x02", b"\x03"]
    assert bytes(held) == b"a" * 1000
    s.check_integrity()


def test_tensor_blocks_round_trip_in_any_dtype():
    s = KVStore(1 << 20)
    kv = torch.randn(LAYOUT.shape(5)).to(torch.bfloat16)
    assert all(s.put_blocks("m", [10, 11, 12, 13, 14], kv))
    got = s.get_blocks("m", [10, 11, 12, 99, 14], LAYOUT)  # stops at the first miss
    assert got.shape == LAYOUT.shape(3) and torch.equal(got, kv[:, :, :3])


@pytest.fixture(scope="module")
def remote():
    proc = Proc("store", "--capacity-bytes", str(64 * BPB))
    client = StoreClient(proc.read()["address"], TransferConfig(timeout_s=5))
    yield proc, client
    client.close()
    proc.kill()


def test_remote_store_round_trip_is_byte_exact(remote):
    _, c = remote
    kv = torch.randn(LAYOUT.shape(16)).to(torch.bfloat16)
    hashes = [2**64 - 1 - i for i in range(16)]  # full 64-bit keys survive msgpack
    assert c.put_blocks("ns", hashes, kv) == [True] * 16
    got = c.get_blocks("ns", hashes, LAYOUT)
    assert got.contiguous().view(torch.uint8).numpy().tobytes() == kv.contiguous().view(torch.uint8).numpy().tobytes()
    assert c.match_prefix("ns", hashes + [5]) == 16
    raw = os.urandom(777)
    c.put("raw", [1], [raw])
    assert bytes(c.get("raw", [1])[0]) == raw and c.get("raw", [2]) == [None]


def test_remote_store_respects_capacity_and_lru(remote):
    _, c = remote
    kv = torch.randn(LAYOUT.shape(64)).to(torch.bfloat16)
    c.put_blocks("cap", list(range(1000, 1064)), kv)  # fills the store, evicting older entries
    st = c.stats()
    assert st.bytes_used <= st.capacity_bytes == 64 * BPB and st.evictions > 0
    assert c.contains("cap", [1000, 1063]) == [True, True]
    c.get("cap", [1000])  # refresh the oldest
    c.put_blocks("cap", [2000], kv[:, :, :1])
    assert c.contains("cap", [1000, 1001]) == [True, False]  # LRU evicted 1001, not 1000
    with pytest.raises(ValueError, match="not pinned"):
        c.unpin("cap", [1000])  # the server's ValueError travels back typed


def test_client_errors_within_timeout_when_the_store_dies():
    proc = Proc("store", "--capacity-bytes", str(1 << 20))
    c = StoreClient(proc.read()["address"], TransferConfig(timeout_s=1.0))
    try:
        assert c.contains("m", [1]) == [False]
        proc.kill()
        t0 = time.monotonic()
        with pytest.raises((PeerGone, TransferTimeout)):
            c.get("m", [1])
        assert time.monotonic() - t0 < 2.0
    finally:
        c.close()
        proc.kill()


def test_in_process_server_thread():
    server = StoreServer(KVStore(1 << 20)).start()
    c = StoreClient(server.address)
    try:
        c.put("m", [7], [b"x" * 64])
        assert c.stats().entries == 1
    finally:
        c.close()
        server.stop()


def test_same_node_borrow_fills_our_shared_buffer_byte_exact(remote):
    """On one node the store server copies the blocks straight into a shared buffer of the
    client's (no socket carries them); the buffer is lent for the with-body and then reused."""
    from thinkserve.kvtransfer.shared_buffers import SHARED
    _, c = remote
    kv = torch.randn(LAYOUT.shape(12)).to(torch.bfloat16)
    hashes = list(range(5000, 5012))
    c.put_blocks("borrow", hashes, kv)
    assert c.same_node
    used = len(SHARED._used)
    with c.borrow_blocks("borrow", hashes[:10] + [1] + hashes[10:], LAYOUT) as got:  # stops at the miss
        assert got.shape == LAYOUT.shape(10) and torch.equal(got, kv[:, :, :10])
        assert SHARED.locate(got.permute(2, 0, 1, 3, 4, 5)) is not None  # in our shared buffer
        assert len(SHARED._used) == used + 1
    assert len(SHARED._used) == used and c.same_node  # given back; the same-node path stayed on
    with c.borrow_blocks("borrow", [42], LAYOUT) as none:
        assert none.shape == LAYOUT.shape(0)


def test_put_and_borrow_fall_back_to_sockets_when_the_server_may_not_map():
    from thinkserve.kvtransfer.shared_buffers import MapDenied
    server = StoreServer(KVStore(1 << 20))

    def deny(offer):
        raise MapDenied("not permitted here")
    server._maps.view = deny
    server.start()
    c = StoreClient(server.address, TransferConfig(timeout_s=5))
    try:
        kv = torch.randn(LAYOUT.shape(3)).to(torch.bfloat16)
        assert c.put_blocks("m", [1, 2, 3], kv) == [True] * 3  # refused the map: sent over the socket
        assert not c.same_node
        c.same_node = True
        with c.borrow_blocks("m", [1, 2, 3], LAYOUT) as got:
            assert torch.equal(got, kv)
        assert not c.same_node  # refused once: sockets from now on
        with c.borrow_blocks("m", [1, 2], LAYOUT) as got:
            assert torch.equal(got, kv[:, :, :2])
    finally:
        c.close()
        server.stop()


def test_prefix_delta_reports_stored_evicted_and_deleted_keys_of_one_namespace():
    from thinkserve.workers.prefix_journal import START
    s = KVStore(300)                             # three 100-byte entries
    s.put("m", [1, 2], [blob(1), blob(2)])
    s.put("swap-m", [7], [blob(7)])               # another namespace: never in m's report
    first = s.prefix_delta("m", START)           # the first call starts m's journal: a full resync
    assert first.full and sorted(first.added) == [1, 2]
    s.put("m", [3], [blob(3)])                   # evicts m/1 (the oldest)
    s.pin("m", [2])                              # pinned is still held: no event
    s.delete("m", [3])
    d = s.prefix_delta("m", first.cursor)
    assert (d.full, d.added, sorted(d.evicted)) == (False, (), [1, 3])
    held = set()
    first.apply_to(held)
    d.apply_to(held)
    assert held == {2} and s.contains("m", [1, 2, 3]) == [False, True, False]
