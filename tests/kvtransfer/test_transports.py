"""TCP (zmq) and gloo pair-group transports between real processes over real sockets."""
from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import zmq

from kvt_helpers import Proc
from kvt_peer import LAYOUT, fingerprint, make_page_set, sha
from thinkserve.kvtransfer.block_pool import BlockPool
from thinkserve.kvtransfer.collective import PairGroupTransport, collective_available
from thinkserve.kvtransfer.tcp import TcpTransport
from thinkserve.kvtransfer.transport import (FingerprintMismatch, NoRoom, PeerGone, TransferConfig,
                                             TransferError, TransferTimeout)

TRANSPORTS = ["tcp", "gloo"]
POOL_BLOCKS = 512
FAULT_TIMEOUT_S = 2.0


def make(name: str, config: TransferConfig, bind: str | None = None):
    return TcpTransport(config, bind=bind) if name == "tcp" else PairGroupTransport(config, backend=name, bind=bind)


@pytest.fixture(scope="module", params=TRANSPORTS)
def receiver(request):
    """A receiver process with a 512-block pool, serving every test of one transport."""
    proc = Proc("recv", "--transport", request.param, "--blocks", str(POOL_BLOCKS))
    addr = proc.read()["address"]
    sender = make(request.param, TransferConfig(timeout_s=20, chunk_bytes=1 << 20))
    yield request.param, proc, addr, sender
    sender.close()
    proc.kill()


def test_page_sets_arrive_byte_exact_in_another_process(receiver):
    name, proc, addr, sender = receiver
    for blocks, seed in [(1, 11), (64, 12), (320, 13), (64, 14)]:  # 32 KiB .. 10 MiB; the last reuses the pair
        ps = make_page_set(blocks, seed)
        rec = sender.send(addr, ps)
        got = proc.read()
        assert got["request_id"] == f"req-{seed}"
        assert got["sha"] == sha(ps.kv), f"{name}: bytes differ after the transfer"
        assert got["blocks"] == blocks and got["free"] == POOL_BLOCKS - blocks
        assert rec.bytes == blocks * LAYOUT.bytes_per_block and rec.transport == name and rec.seconds > 0


def test_fingerprint_mismatch_is_refused_on_both_sides(receiver):
    name, proc, addr, sender = receiver
    with pytest.raises(FingerprintMismatch, match=r"model_id: page set has 'other-model', receiver has 'test-model'"):
        sender.send(addr, make_page_set(4, 21, model_id="other-model"))
    got = proc.read()
    assert got["error"] == "FingerprintMismatch" and got["free"] == POOL_BLOCKS
    # the connection stays usable
    ps = make_page_set(2, 22)
    sender.send(addr, ps)
    assert proc.read()["sha"] == sha(ps.kv)


def test_no_room_is_refused_before_bytes_move(receiver):
    name, proc, addr, sender = receiver
    with pytest.raises(NoRoom):
        sender.send(addr, make_page_set(POOL_BLOCKS + 1, 31))
    got = proc.read()
    assert got["error"] == "NoRoom" and got["free"] == POOL_BLOCKS


@pytest.mark.parametrize("when", ["before_data", "during_data"])
@pytest.mark.parametrize("name", TRANSPORTS)
def test_sender_dies_mid_transfer_receiver_frees_blocks(name, when):
    cfg = TransferConfig(timeout_s=FAULT_TIMEOUT_S, chunk_bytes=256 << 10)
    killed_at = []

    class KillAfterFirstChunk(TcpTransport):
        """The real TCP receiver; the sender is killed once part of its bytes have landed."""

        def _on_progress(self, inc, received):
            if not killed_at:
                killed_at.append(time.monotonic())
                sender.kill()

    rx = KillAfterFirstChunk(cfg) if (name, when) == ("tcp", "during_data") else make(name, cfg)
    with rx:
        pool = BlockPool(fingerprint(), 4096)
        sender = Proc("send", "--transport", name, "--peer", rx.address, "--blocks", "2048", "--timeout", "30",
                      "--chunk-bytes", str(256 << 10))
        plain_allocate = pool.allocate

        def allocate(header):  # blocks are reserved: now the sender's process dies
            ids = plain_allocate(header)
            if when == "before_data":
                killed_at.append(time.monotonic())
                sender.kill()  # SIGKILL, and reaped, before the offer is answered
            elif name != "tcp":  # gloo: lands while the pair forms or the bytes stream in
                killed_at.append(time.monotonic())
                threading.Timer(0.005, sender.kill).start()
            return ids
        pool.allocate = allocate
        with pytest.raises((PeerGone, TransferTimeout)) as err:
            rx.recv(pool, timeout_s=60)
        detected_s = time.monotonic() - killed_at[0]
        print(f"{name}/{when}: sender death detected by the receiver in {detected_s:.3f}s: {err.value}")
        # gloo: joining a dead sender's pair store may wait out part of the timeout
        assert detected_s < 1.5 * FAULT_TIMEOUT_S + 0.5
        assert err.value.request_id == "req-0"
        assert pool.num_free == 4096 and pool.aborted == 1 and not pool.committed
        if (name, when) == ("tcp", "during_data"):
            received = int(re.search(r"\((\d+)/67108864 bytes", str(err.value)).group(1))
            assert 0 < received < 67108864
        sender.kill()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_receiver_dies_mid_transfer_sender_errors_in_bounded_time(name):
    rx = Proc("recv", "--transport", name, "--blocks", "4096", "--die-after-allocate", "0.0", "--timeout", "30")
    addr = rx.read()["address"]
    cfg = TransferConfig(timeout_s=FAULT_TIMEOUT_S, chunk_bytes=256 << 10)
    with make(name, cfg) as tx:
        ps = make_page_set(2048, 41)  # 64 MiB
        t0 = time.monotonic()
        with pytest.raises((PeerGone, TransferTimeout)) as err:
            tx.send(addr, ps)
        elapsed = time.monotonic() - t0
        print(f"{name}: receiver death detected by the sender in {elapsed:.3f}s ({type(err.value).__name__})")
    assert elapsed < FAULT_TIMEOUT_S + 1.0, elapsed
    assert rx.wait() == 3  # it really died


@pytest.mark.parametrize("name", TRANSPORTS)
def test_silent_peer_times_out_within_configured_bound(name):
    ctx = zmq.Context()
    mute = ctx.socket(zmq.ROUTER)  # accepts connections, never answers
    mute.bind("tcp://127.0.0.1:0")
    addr = mute.getsockopt(zmq.LAST_ENDPOINT).decode()
    try:
        with make(name, TransferConfig(timeout_s=0.5)) as tx:
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout, match="within 0.5s"):
                tx.send(addr, make_page_set(2, 51))
            assert 0.45 < time.monotonic() - t0 < 2.0
    finally:
        mute.close(linger=0)
        ctx.term()


def test_gloo_pairs_form_per_peer_and_reform_after_a_peer_restarts():
    """Instances join and leave while running: one sender, two receivers, then one of them is
    replaced by a new process on the same address; the stale pair is detected and re-formed."""
    cfg = TransferConfig(timeout_s=10)
    a = Proc("recv", "--transport", "gloo", "--blocks", "64")
    b = Proc("recv", "--transport", "gloo", "--blocks", "64")
    addr_a, addr_b = a.read()["address"], b.read()["address"]
    try:
        with PairGroupTransport(cfg) as tx:
            for i, (proc, addr) in enumerate([(a, addr_a), (b, addr_b), (a, addr_a)]):
                ps = make_page_set(8, 60 + i)
                tx.send(addr, ps)
                assert proc.read()["sha"] == sha(ps.kv)
            assert len(tx._send_pairs) == 2
            a.kill()
            a = Proc("recv", "--transport", "gloo", "--blocks", "64", "--bind", addr_a)
            assert a.read()["address"] == addr_a
            ps = make_page_set(8, 70)
            tx.send(addr_a, ps)  # PairLost -> new pair, transparently
            assert a.read()["sha"] == sha(ps.kv)
    finally:
        a.kill()
        b.kill()


@pytest.mark.gpu
@pytest.mark.skipif(not collective_available("nccl") or torch.cuda.device_count() < 2,
                    reason="needs CUDA, NCCL and two GPUs (NCCL refuses two ranks on one device)")
def test_nccl_pair_moves_device_page_sets_byte_exact():
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_nccl_receiver, args=(q,))
    p.start()
    try:
        addr = q.get(timeout=120)
        with PairGroupTransport(TransferConfig(timeout_s=30), backend="nccl") as tx:
            ps = make_page_set(256, 81)
            ps = type(ps)(ps.header, ps.kv.cuda())
            tx.send(addr, ps)
            assert q.get(timeout=120) == sha(ps.kv.cpu())
    finally:
        p.kill()


def _nccl_receiver(q):
    torch.cuda.set_device(1)  # the sender is on GPU 0
    with PairGroupTransport(TransferConfig(timeout_s=30), backend="nccl") as rx:
        pool = BlockPool(fingerprint(), 512, device="cuda:1")
        q.put(rx.address)
        got = rx.recv(pool, timeout_s=120)
        q.put(sha(pool.read(got.block_ids).cpu()))


def test_tcp_receiver_restart_reconnects_the_data_connections():
    """The sender keeps its data connections between transfers. A receiver that restarted (same
    address) has none of them: it answers PairLost, and the sender reconnects and resends once."""
    first = Proc("recv", "--transport", "tcp", "--blocks", "256")
    addr = first.read()["address"]
    with TcpTransport(TransferConfig(timeout_s=10)) as tx:
        ps = make_page_set(160, 61)  # 5 MiB: one stream
        tx.send(addr, ps)
        assert first.read()["sha"] == sha(ps.kv)
        old_conns = list(tx._out[addr])
        first.kill()
        second = Proc("recv", "--transport", "tcp", "--blocks", "256", "--bind", addr)
        try:
            assert second.read()["address"] == addr
            for blocks, seed in [(200, 62), (3, 63)]:
                ps = make_page_set(blocks, seed)
                tx.send(addr, ps)
                got = second.read()
                assert got["sha"] == sha(ps.kv) and got["free"] == 256 - blocks
            assert not set(tx._out[addr]) & set(old_conns)  # new connections, made once
        finally:
            second.kill()


def test_tcp_stray_bytes_fail_the_transfer_and_free_its_blocks():
    """Every data stream starts with (xfer id, byte count): bytes that belong to no accepted
    transfer are refused, never written into blocks, and the pair reconnects afterwards."""
    import struct

    class WrongPrefix(TcpTransport):
        def _send_data(self, peer, conn, xfer, page_set, extra, accept):
            if peer not in self._out:
                self._out[peer] = self._connect(peer, int(accept["data_port"]))
            self._fresh.discard(peer)
            self._out[peer][0].sendall(struct.pack("<8sQ", b"stranger", page_set.nbytes))

    proc = Proc("recv", "--transport", "tcp", "--blocks", "64")
    addr = proc.read()["address"]
    try:
        with WrongPrefix(TransferConfig(timeout_s=5)) as bad:
            with pytest.raises(TransferError, match="carries .* of transfer 7374"):
                bad.send(addr, make_page_set(8, 91))
        got = proc.read()
        assert got["error"] == "TransferError" and got["free"] == 64
        ps = make_page_set(8, 92)  # the receiver carries on
        with TcpTransport(TransferConfig(timeout_s=5)) as good:
            good.send(addr, ps)
        assert proc.read()["sha"] == sha(ps.kv)
    finally:
        proc.kill()


@pytest.mark.parametrize("sink", ["--staging", "--write-only"])
def test_tcp_into_a_sink_without_a_host_cache(sink):
    """A sink that cannot take bytes in place (a GPU engine) gets them staged, then written."""
    proc = Proc("recv", "--transport", "tcp", "--blocks", "512", sink)
    addr = proc.read()["address"]
    try:
        with TcpTransport(TransferConfig(timeout_s=10)) as tx:
            for blocks, seed in [(3, 93), (320, 94)]:  # one stream, then two
                ps = make_page_set(blocks, seed)
                tx.send(addr, ps)
                got = proc.read()
                assert got["sha"] == sha(ps.kv) and got["free"] == 512 - blocks
    finally:
        proc.kill()


def test_tcp_second_sender_is_answered_at_once_while_another_senders_connections_idle():
    """A fresh sender makes the receiver reap data connections whose sender left; an idle but
    live connection of another sender must not stall it (a socket with a timeout once made the
    peek wait that timeout: every second sender's first transfer took 10 s and timed out)."""
    proc = Proc("recv", "--transport", "tcp", "--blocks", "256")
    addr = proc.read()["address"]
    try:
        with TcpTransport(TransferConfig(timeout_s=30)) as a, TcpTransport(TransferConfig(timeout_s=30)) as b:
            ps = make_page_set(8, 71)
            a.send(addr, ps)
            assert proc.read()["sha"] == sha(ps.kv)             # a's data connections now idle, open
            ps = make_page_set(8, 72)
            t0 = time.monotonic()
            b.send(addr, ps)
            assert proc.read()["sha"] == sha(ps.kv)
            assert time.monotonic() - t0 < 3.0
    finally:
        proc.kill()


@pytest.mark.skipif(collective_available("nccl"), reason="NCCL is available here")
def test_nccl_pair_group_refuses_to_start_where_nccl_cannot_run():
    with pytest.raises(RuntimeError, match="the nccl backend is not available here"):
        PairGroupTransport(TransferConfig(timeout_s=1), backend="nccl")
