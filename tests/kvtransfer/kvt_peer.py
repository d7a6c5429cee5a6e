"""A peer process for the transport tests: run as a script, speaks JSON lines on stdout.

    python kvt_peer.py recv  --transport tcp|shm|gloo [--blocks N] [--model-id M] [--die-after-allocate S]
                             [--no-direct-read] [--staging | --write-only]
        prints {"address": ...}, then one line per page set received or failed, forever
    python kvt_peer.py send  --transport tcp|shm|gloo --peer ADDR --blocks N --seed S [--die-after S] [--shared]
        prints one line: the transfer's record or its error
    python kvt_peer.py store --capacity-bytes N
        prints {"address": ...} and serves a KV store until killed

Page-set contents are a pure function of (blocks, seed), so both sides can check the bytes by
their sha256 without shipping them anywhere but over the transport under test.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time

import torch

from thinkserve.kvtransfer.block_pool import BlockPool
from thinkserve.kvtransfer.page_set import PageSet
from thinkserve.kvtransfer.transport import TransferConfig, TransferError
from thinkserve.workers.kv_cache import KVFingerprint, KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32")  # 32 KiB/block


def fingerprint(model_id: str = "test-model") -> KVFingerprint:
    return KVFingerprint(LAYOUT, "LlamaForCausalLM", model_id)


def make_page_set(num_blocks: int, seed: int, model_id: str = "test-model") -> PageSet:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(LAYOUT.shape(num_blocks), generator=g)
    return PageSet.build(fingerprint(model_id), kv, request_id=f"req-{seed}", token_ids=range(num_blocks * 16),
                         num_computed_tokens=num_blocks * 16)


def shared_copy(ps: PageSet) -> PageSet:
    """The page set with its bytes in a ``SHARED`` buffer (never given back: test processes)."""
    from thinkserve.kvtransfer.shared_buffers import SHARED
    buf = SHARED.take(ps.nbytes).view(ps.kv.dtype).view(ps.kv.shape)
    buf.copy_(ps.kv)
    return PageSet(ps.header, buf)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def make_transport(name: str, config: TransferConfig, bind: str | None = None, direct_read: bool = True):
    if name == "tcp":
        from thinkserve.kvtransfer.tcp import TcpTransport
        return TcpTransport(config, bind=bind)
    if name == "shm":
        from thinkserve.kvtransfer.shm import ShmTransport
        return ShmTransport(config, bind=bind, direct_read=direct_read)
    from thinkserve.kvtransfer.collective import PairGroupTransport
    return PairGroupTransport(config, backend=name, bind=bind)


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def cmd_recv(a) -> None:
    cfg = TransferConfig(timeout_s=a.timeout, chunk_bytes=a.chunk_bytes)
    tr = make_transport(a.transport, cfg, a.bind, direct_read=not a.no_direct_read)
    pool = BlockPool(fingerprint(a.model_id), a.blocks)
    if a.staging or a.write_only:  # a sink without a host cache: transports stage the bytes
        pool.host_cache = lambda: None
    if a.write_only:  # ... and without write_layers: one write of the whole page set
        pool.layer_writes = False
    if a.die_after_allocate is not None:
        plain_allocate = pool.allocate

        def allocate(header):  # this process dies while the transfer is in flight ...
            threading.Timer(a.die_after_allocate, lambda: os._exit(3)).start()
            return plain_allocate(header)

        def write(header, block_ids, kv):  # ... at the latest once the bytes are in, before the ack
            os._exit(3)
        pool.allocate, pool.write = allocate, write
    emit(address=tr.address)
    while True:
        t0 = time.monotonic()
        try:
            got = tr.recv(pool, timeout_s=3600)
        except TransferError as e:
            emit(error=type(e).__name__, message=str(e), request_id=e.request_id,
                 elapsed=time.monotonic() - t0, free=pool.num_free)
            continue
        emit(request_id=got.header.request_id, sha=sha(pool.read(got.block_ids)), blocks=len(got.block_ids),
             free=pool.num_free, gbps=got.record.gbps)
        pool.free(got.block_ids)


def cmd_send(a) -> None:
    cfg = TransferConfig(timeout_s=a.timeout, chunk_bytes=a.chunk_bytes)
    tr = make_transport(a.transport, cfg, direct_read=not a.no_direct_read)
    for seed in range(a.seed, a.seed + a.count):
        ps = make_page_set(a.blocks, seed, a.model_id)
        if a.shared:  # in a shared segment, as the flows gather for shm: map mode
            ps = shared_copy(ps)
        if a.die_after is not None:
            threading.Timer(a.die_after, lambda: os._exit(3)).start()
        t0 = time.monotonic()
        try:
            rec = tr.send(a.peer, ps)
            emit(ok=True, sha=sha(ps.kv), seconds=rec.seconds)
        except TransferError as e:
            emit(ok=False, error=type(e).__name__, message=str(e), elapsed=time.monotonic() - t0)
    tr.close()


def cmd_store(a) -> None:
    from thinkserve.kvtransfer.store import KVStore, StoreServer
    server = StoreServer(KVStore(a.capacity_bytes))
    emit(address=server.address)
    server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["recv", "send", "store"])
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--peer")
    ap.add_argument("--bind")
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--model-id", default="test-model")
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--chunk-bytes", type=int, default=1 << 20)
    ap.add_argument("--die-after", type=float)
    ap.add_argument("--die-after-allocate", type=float)
    ap.add_argument("--capacity-bytes", type=int, default=64 << 20)
    ap.add_argument("--no-direct-read", action="store_true", help="shm: ring only (no process_vm_readv)")
    ap.add_argument("--staging", action="store_true", help="recv: the pool exposes no host cache")
    ap.add_argument("--write-only", action="store_true", help="recv: no host cache and no write_layers")
    ap.add_argument("--shared", action="store_true", help="send: page sets in shared segments (shm map mode)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    {"recv": cmd_recv, "send": cmd_send, "store": cmd_store}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
