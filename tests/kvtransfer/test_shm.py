"""The same-node transport between real processes, both ways it moves bytes: the receiver reading
the sender's memory (process_vm_readv) and the shared-memory ring. Bytes, flow control,
refusals, the fallback from reads to the ring, senders that die, no ring file left in /dev/shm."""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

from kvt_helpers import Proc
from kvt_peer import LAYOUT, make_page_set, sha, shared_copy
from thinkserve.kvtransfer import cma
from thinkserve.kvtransfer.shared_buffers import SHARED
from thinkserve.kvtransfer.shm import SHM_DIR, ShmTransport
from thinkserve.kvtransfer.transport import FingerprintMismatch, NoRoom, PeerGone, TransferConfig

POOL_BLOCKS = 512


def rings() -> set[str]:
    return set(glob.glob(os.path.join(SHM_DIR, "thinkserve-kv-*")))


@pytest.fixture(scope="module")
def receiver():
    proc = Proc("recv", "--transport", "shm", "--blocks", str(POOL_BLOCKS))
    addr = proc.read()["address"]
    yield proc, addr
    proc.kill()


def test_page_sets_arrive_byte_exact_through_a_small_ring(receiver):
    proc, addr = receiver
    before = rings()
    # 64 KiB chunks and 2 slots: a 10 MiB page set is 160 chunks, so the sender waits for
    # freed slots ~158 times (the flow control is exercised, not just the happy first lap).
    with ShmTransport(TransferConfig(timeout_s=20, chunk_bytes=64 << 10), slots=2, direct_read=False) as tr:
        for blocks, seed in [(1, 11), (320, 12), (64, 13)]:
            ps = make_page_set(blocks, seed)
            rec = tr.send(addr, ps)
            got = proc.read()
            assert got["sha"] == sha(ps.kv) and got["blocks"] == blocks and got["free"] == POOL_BLOCKS - blocks
            assert rec.transport == "shm" and rec.bytes == blocks * LAYOUT.bytes_per_block
            assert rings() == before  # unlinked once the receiver mapped it
    assert rings() == before


@pytest.mark.parametrize("direct_read", [True, False])
def test_refusals_leave_the_transport_usable(receiver, direct_read):
    proc, addr = receiver
    with ShmTransport(TransferConfig(timeout_s=20), direct_read=direct_read) as tr:
        with pytest.raises(FingerprintMismatch):
            tr.send(addr, make_page_set(4, 21, model_id="other-model"))
        assert proc.read()["error"] == "FingerprintMismatch"
        with pytest.raises(NoRoom):
            tr.send(addr, make_page_set(POOL_BLOCKS + 1, 22))
        assert proc.read()["free"] == POOL_BLOCKS
        ps = make_page_set(8, 23)
        tr.send(addr, ps)
        assert proc.read()["sha"] == sha(ps.kv)


def test_receiver_restart_forms_a_new_ring(tmp_path):
    first = Proc("recv", "--transport", "shm", "--blocks", "64")
    addr = first.read()["address"]
    with ShmTransport(TransferConfig(timeout_s=10), direct_read=False) as tr:
        tr.send(addr, make_page_set(2, 31))
        assert first.read()["blocks"] == 2
        first.kill()
        second = Proc("recv", "--transport", "shm", "--blocks", "64", "--bind", addr)
        try:
            assert second.read()["address"] == addr
            ps = make_page_set(3, 32)
            tr.send(addr, ps)  # PairLost from the new receiver, then a fresh ring, once
            assert second.read()["sha"] == sha(ps.kv)
        finally:
            second.kill()


class VanishesAfterFirstChunk(ShmTransport):
    """Sends one chunk, then drops its connection as a dying process would (the slot stays full)."""

    def _send_data(self, peer, conn, xfer, page_set, extra, accept):
        real, sent = conn.send, []

        def send(parts, copy=True):
            if sent:
                raise PeerGone("simulated sender death")
            sent.append(1)
            real(parts, copy=copy)
        conn.send = send
        super()._send_data(peer, conn, xfer, page_set, extra, accept)


def test_sender_vanishes_mid_transfer_receiver_frees_blocks(receiver):
    proc, addr = receiver
    before = rings()
    with VanishesAfterFirstChunk(TransferConfig(timeout_s=2, chunk_bytes=64 << 10), direct_read=False) as tr:
        with pytest.raises(PeerGone):
            tr.send(addr, make_page_set(400, 41))  # 4 layers = 4 chunks; only the first is sent
        gone = time.monotonic()
    got = proc.read(30)
    assert got["error"] in ("PeerGone", "TransferTimeout") and got["free"] == POOL_BLOCKS
    assert time.monotonic() - gone < 2.5  # noticed within the 2 s timeout (a disconnect: ~0.1 s)
    assert rings() == before
    ps = make_page_set(8, 42)  # the receiver carries on with the next sender
    with ShmTransport(TransferConfig(timeout_s=10)) as tr:
        tr.send(addr, ps)
    assert proc.read()["sha"] == sha(ps.kv)


# ----------------------------------------------------------------------------- map and read modes
@pytest.mark.skipif(not cma.available(), reason="process_vm_readv is Linux-only")
@pytest.mark.parametrize("shared", [True, False], ids=["map", "read"])
@pytest.mark.parametrize("sink", ["", "--staging", "--write-only"], ids=["into-blocks", "staged", "write-only"])
def test_receiver_copies_from_the_senders_memory_byte_exact(shared, sink):
    """Page sets in a shared segment go by map mode (the receiver maps it and copies once), others
    by read mode (process_vm_readv); either lands in the pool's blocks (or, for a sink without
    a host cache, through a staging buffer or one write). No ring is made."""
    args = [sink] if sink else []
    proc = Proc("recv", "--transport", "shm", "--blocks", str(POOL_BLOCKS), *args)
    addr = proc.read()["address"]
    before = rings()
    try:
        with ShmTransport(TransferConfig(timeout_s=20), read_threads=2) as tr:
            for blocks, seed in [(1, 61), (320, 62), (64, 63), (320, 64)]:  # 32 KiB .. 10 MiB; reuses
                ps = make_page_set(blocks, seed)
                ps = shared_copy(ps) if shared else ps
                rec = tr.send(addr, ps)
                got = proc.read()
                assert got["sha"] == sha(ps.kv) and got["free"] == POOL_BLOCKS - blocks
                assert rec.transport == "shm" and rec.bytes == blocks * LAYOUT.bytes_per_block
                assert tr.last_mode == ("map" if shared else "read")
                if shared:
                    SHARED.give(ps.kv)  # the next page set reuses the segment: the receiver's map too
            assert not tr._send_rings and not tr._refused
        assert rings() == before
    finally:
        proc.kill()


@pytest.mark.skipif(not cma.available(), reason="process_vm_readv is Linux-only")
@pytest.mark.parametrize("shared", [True, False], ids=["map", "read"])
def test_receiver_that_may_not_map_or_read_gets_the_ring(shared):
    """A receiver that refuses maps and reads (as one without ptrace permission does: EPERM)
    makes the sender fall back mode by mode to the ring, once, and use it from then on."""
    proc = Proc("recv", "--transport", "shm", "--blocks", "64", "--no-direct-read")
    addr = proc.read()["address"]
    try:
        with ShmTransport(TransferConfig(timeout_s=10)) as tr:
            for blocks, seed in [(4, 71), (8, 72)]:
                ps = make_page_set(blocks, seed)
                ps = shared_copy(ps) if shared else ps
                tr.send(addr, ps)
                assert proc.read()["sha"] == sha(ps.kv) and tr.last_mode == "ring"
            assert tr._refused == {addr: {"map", "read"} if shared else {"read"}} and addr in tr._send_rings
    finally:
        proc.kill()


@pytest.mark.skipif(not cma.available(), reason="process_vm_readv is Linux-only")
@pytest.mark.parametrize("shared", [True, False], ids=["map", "read"])
def test_sender_dead_before_the_copy_receiver_frees_blocks(shared):
    from thinkserve.kvtransfer.block_pool import BlockPool
    from kvt_peer import fingerprint
    with ShmTransport(TransferConfig(timeout_s=2)) as rx:
        pool = BlockPool(fingerprint(), 256)
        sender = Proc("send", "--transport", "shm", "--peer", rx.address, "--blocks", "128", "--timeout", "30",
                      *(["--shared"] if shared else []))
        plain_allocate = pool.allocate

        killed = []

        def allocate(header):  # blocks reserved; the sender is killed (and reaped) before the copy
            ids = plain_allocate(header)
            sender.kill()
            killed.append(time.monotonic())
            return ids
        pool.allocate = allocate
        with pytest.raises(PeerGone, match="is gone"):
            rx.recv(pool, timeout_s=30)
        # Timed from the kill: the sender's start-up (a Python process importing torch) is not
        # what this measures, and under load it alone can take seconds.
        assert time.monotonic() - killed[0] < 5
        assert pool.num_free == 256 and pool.aborted == 1 and not pool.committed
        assert len(rx._maps) == 0  # nothing of the dead sender is mapped


def test_a_reused_fd_number_is_not_mistaken_for_the_old_segment(monkeypatch):
    """The receiver caches maps by (pid, start, fd, inode): a segment closed and a new one that
    got the same fd number is mapped afresh, not read through the stale map."""
    import thinkserve.kvtransfer.shm as shm_mod
    from thinkserve.kvtransfer.shared_buffers import SharedBuffers
    pool = SharedBuffers(max_cached_bytes=0)  # every give closes its segment
    monkeypatch.setattr(shm_mod, "SHARED", pool)
    proc = Proc("recv", "--transport", "shm", "--blocks", "64")
    addr = proc.read()["address"]
    try:
        with ShmTransport(TransferConfig(timeout_s=10)) as tr:
            seen, reused = set(), 0
            for seed in range(81, 101):
                ps = make_page_set(8, seed)
                buf = pool.take(ps.nbytes).view(ps.kv.dtype).view(ps.kv.shape)
                buf.copy_(ps.kv)
                fd = pool.locate(buf).fd
                reused += fd in seen
                seen.add(fd)
                tr.send(addr, ps.__class__(ps.header, buf))
                assert proc.read()["sha"] == sha(ps.kv) and tr.last_mode == "map"
                pool.give(buf)
                if reused >= 2:
                    break
            assert reused >= 2  # fd numbers really were reused, and each time the bytes were right
    finally:
        proc.kill()


def test_shared_buffers_take_give_locate():
    from thinkserve.kvtransfer.shared_buffers import SharedBuffers
    pool = SharedBuffers(max_cached_bytes=64 << 20)
    a = pool.take(3 << 20)
    ref = pool.locate(a[1024:])
    assert ref is not None and ref.offset == 1024 and ref.size >= 3 << 20 and ref.pid == os.getpid()
    assert pool.locate(torch.empty(16)) is None
    base = a.data_ptr()
    pool.give(a)
    assert pool.locate(a) is None  # given back: no longer offered
    with pytest.raises(ValueError):
        pool.give(a)
    b = pool.take(2 << 20)  # reuses the free segment
    assert b.data_ptr() == base


def test_receiver_bounds_the_bytes_it_keeps_mapped():
    """Cached maps keep senders' segments alive, so the receiver holds at most
    ``max_mapped_bytes`` of them (the newest map always stays)."""
    from thinkserve.kvtransfer.block_pool import BlockPool
    from kvt_peer import fingerprint
    with ShmTransport(TransferConfig(timeout_s=10), max_mapped_bytes=1) as rx:
        pool = BlockPool(fingerprint(), 64)
        sender = Proc("send", "--transport", "shm", "--peer", rx.address, "--blocks", "8", "--count", "3",
                      "--shared", "--timeout", "10")
        try:
            for _ in range(3):  # three page sets, each in its own segment (the sender keeps them all)
                got = rx.recv(pool, timeout_s=30)
                assert len(rx._maps) == 1
                pool.free(got.block_ids)
            assert [sender.read()["ok"] for _ in range(3)] == [True, True, True]
        finally:
            sender.kill()


def test_an_offer_from_another_machine_is_never_mapped():
    """A pid, a start time and an inode only name a segment on the machine that made them."""
    from thinkserve.kvtransfer.shared_buffers import MapDenied, SegmentMaps, segment_offer
    buf = SHARED.take(4096)
    try:
        offer = segment_offer(SHARED.locate(buf), 4096)
        maps = SegmentMaps(writable=False)
        assert maps.view(offer).numel() == 4096  # this machine: fine
        with pytest.raises(MapDenied, match="another machine"):
            maps.view({**offer, "boot": "some-other-boot-id"})
        maps.close()
    finally:
        SHARED.give(buf)
