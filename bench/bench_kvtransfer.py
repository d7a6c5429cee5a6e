"""KV transfer benchmark: latency and GB/s of page sets from one block to 256 MiB on each
transport and for the CPU KV store, printed beside a memcpy of the same bytes in the same run.

    .venv/bin/python bench/bench_kvtransfer.py [--quick] [--json OUT] [--rdt]

What is timed (sender side, wall clock, median of the reps). Before every timed rep of every
column the CPU caches are scrubbed (a buffer twice the L3 size is streamed, untimed), so no
column gets cache-resident bytes and the ratios compare like with like:
  memcpy       dst.copy_(src), pre-faulted buffers, caches scrubbed: the honest local bound for
               moving the bytes once, and the ratios' denominator
  memcpy-warm  the same copy repeated on hot buffers, for reference only (up to ~16 MiB it runs
               from cache, which is why it reads 20-50 GB/s there); not used in any ratio
  tcp          TcpTransport.send to a receiver *process*: offer, bytes over loopback TCP
               (--tcp-streams connections) received straight into its block pool, and its ack;
               with several --tcp-streams values, one column tcp-xN each
  shm          the same conversation, same node: the page set sits in a shared segment (where
               the flows gather it for shm) and the receiver maps it and copies it into its
               pool (map mode, one memcpy)
  shm-read     (--transports shm-read) a page set in private memory: the receiver copies it out
               with process_vm_readv (read mode, --shm-read-threads)
  shm-ring     (--transports shm-ring) the two-copy shared-memory ring
  gloo         the same over a gloo pair group (zmq for the offer/ack)
  store-put    StoreClient.put_blocks to a KVStore server process (per-block split + wire)
  store-get    StoreClient.get_blocks back over the socket (wire + assembly into [L, 2, n, bs, H, D])
  store-get-shm  StoreClient.borrow_blocks, same node: the server copies the blocks into a
               shared buffer of the client's (one memcpy), lent as [L, 2, n, bs, H, D]
  rdt-gloo     (--rdt) Ray Direct Transport: an actor returns the tensor with
               tensor_transport="gloo", another actor receives it (Ray 2.60, alpha)

Layout: Qwen2.5-7B's KV (28 layers, 4 KV heads, head_dim 128, bf16, block 16) = 896 KiB/block.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

from thinkserve.kvtransfer.block_pool import BlockPool
from thinkserve.kvtransfer.page_set import PageSet
from thinkserve.kvtransfer.telemetry import TELEMETRY
from thinkserve.kvtransfer.transport import TransferConfig
from thinkserve.workers.kv_cache import KVFingerprint, KVLayout

LAYOUT = KVLayout(num_layers=28, num_kv_heads=4, head_dim=128, block_size=16, dtype="bfloat16")
FP = KVFingerprint(LAYOUT, "Qwen2ForCausalLM", "bench")
MiB = 1 << 20
READ_THREADS = 2


def blocks_for(size_mib: float) -> int:
    return max(1, round(size_mib * MiB / LAYOUT.bytes_per_block))


def page_set(nblocks: int) -> PageSet:
    kv = torch.randint(-100, 100, LAYOUT.shape(nblocks), dtype=torch.int16).view(torch.bfloat16)
    return PageSet.build(FP, kv, request_id=f"bench-{nblocks}")


_SCRUB = torch.empty(0)


def _l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            s = f.read().strip()
        return int(s[:-1]) * {"K": 1024, "M": MiB}[s[-1]] if s[-1] in "KM" else int(s)
    except (OSError, ValueError):
        return 32 * MiB


def scrub_cache() -> None:
    """Evict whatever the last rep left in the caches: read and write 2x L3 bytes."""
    global _SCRUB
    if _SCRUB.numel() == 0:
        _SCRUB = torch.ones(2 * _l3_bytes(), dtype=torch.uint8)
    _SCRUB.add_(1)


def timed(fn, reps: int, *, cold: bool = True) -> float:
    fn()  # warm-up: connections, pair groups, receive buffers
    times = []
    for _ in range(reps):
        if cold:
            scrub_cache()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- peers
def _receiver(kind: str, max_blocks: int, tcp_streams: int, read_threads: int, q) -> None:
    global READ_THREADS
    READ_THREADS = read_threads
    torch.set_num_threads(1)
    cfg = TransferConfig(timeout_s=60, tcp_streams=tcp_streams)
    if kind == "tcp" or kind.startswith("shm"):
        tr = _transport(kind, cfg)
    else:
        from thinkserve.kvtransfer.collective import PairGroupTransport
        tr = PairGroupTransport(cfg, backend=kind)
    pool = BlockPool(FP, max_blocks)
    pool.kv.fill_(0)  # touch the pool's pages once, as a running engine's cache would be
    q.put(tr.address)
    while True:
        got = tr.recv(pool, timeout_s=3600)
        pool.free(got.block_ids)


def _store_server(capacity: int, q) -> None:
    from thinkserve.kvtransfer.store import KVStore, StoreServer
    server = StoreServer(KVStore(capacity))
    q.put(server.address)
    server.serve_forever()


def start(target, *args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q), daemon=True)
    p.start()
    return p, q.get(timeout=120)


def _transport(kind: str, cfg: TransferConfig):
    if kind == "tcp":
        from thinkserve.kvtransfer.tcp import TcpTransport
        return TcpTransport(cfg)
    if kind.startswith("shm"):
        from thinkserve.kvtransfer.shm import ShmTransport
        return ShmTransport(cfg, direct_read=kind != "shm-ring", read_threads=READ_THREADS)
    from thinkserve.kvtransfer.collective import PairGroupTransport
    return PairGroupTransport(cfg, backend=kind)


# ----------------------------------------------------------------------------- runs
def bench_transport(kind: str, sizes: list[int], reps: int, chunk_bytes: int,
                    tcp_streams: int = TransferConfig.tcp_streams) -> dict[int, float]:
    proc, addr = start(_receiver, kind, max(sizes) + 1, tcp_streams, READ_THREADS)
    cfg = TransferConfig(timeout_s=60, chunk_bytes=chunk_bytes, tcp_streams=tcp_streams)
    tr = _transport(kind, cfg)
    out = {}
    try:
        for n in sizes:
            ps = page_set(n)
            if kind == "shm":  # gathered into a shared segment, as flows.page_buffer does for shm
                from thinkserve.kvtransfer.shared_buffers import SHARED
                buf = SHARED.take(ps.nbytes).view(ps.kv.dtype).view(ps.kv.shape)
                buf.copy_(ps.kv)
                ps = PageSet(ps.header, buf)
            out[n] = timed(lambda: TELEMETRY.add(tr.send(addr, ps, kind="page_set")), reps)
            if kind.startswith("shm"):
                assert tr.last_mode == {"shm": "map", "shm-read": "read", "shm-ring": "ring"}[kind], tr.last_mode
    finally:
        tr.close()
        proc.kill()
    return out


def bench_store(sizes: list[int], reps: int) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    from thinkserve.kvtransfer.store import StoreClient
    proc, addr = start(_store_server, 4 * max(sizes) * LAYOUT.bytes_per_block)
    client = StoreClient(addr, TransferConfig(timeout_s=60))
    put, get, borrow = {}, {}, {}
    try:
        for n in sizes:
            ps = page_set(n)
            hashes = list(range(n))

            def do_put():
                client.delete("bench", hashes)
                client.put_blocks("bench", hashes, ps.kv)
            put[n] = timed(do_put, reps)
            client.same_node = False
            get[n] = timed(lambda: client.get_blocks("bench", hashes, LAYOUT), reps)
            client.same_node = True

            def do_borrow():
                with client.borrow_blocks("bench", hashes, LAYOUT) as kv:
                    assert kv.shape[2] == n
            borrow[n] = timed(do_borrow, reps)
            assert client.same_node, "the store server could not map this process's buffers"
            client.delete("bench", hashes)
    finally:
        client.close()
        proc.kill()
    return put, get, borrow


def bench_memcpy(sizes: list[int], reps: int, *, cold: bool) -> dict[int, float]:
    out = {}
    for n in sizes:
        src = page_set(n).kv
        dst = torch.empty_like(src)
        dst.copy_(src)  # pre-fault: page faults are not part of moving bytes into a live cache
        out[n] = timed(lambda: dst.copy_(src), reps, cold=cold)
    return out


def bench_rdt(sizes: list[int], reps: int) -> dict[int, float]:
    """Ray Direct Transport over gloo between two actors (measured for the design decision)."""
    import ray
    from ray.experimental.collective import create_collective_group

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(enable_tensor_transport=True)
        class Src:
            def __init__(self, nbytes):
                self.t = torch.ones(nbytes, dtype=torch.uint8)

            @ray.method(tensor_transport="gloo")
            def get(self, nbytes):
                return self.t[:nbytes]

        @ray.remote(enable_tensor_transport=True)
        class Dst:
            def take(self, t):
                return int(t.numel())

        nbytes = [n * LAYOUT.bytes_per_block for n in sizes]
        src, dst = Src.remote(max(nbytes)), Dst.remote()
        create_collective_group([src, dst], backend="torch_gloo")
        out = {}
        for n, b in zip(sizes, nbytes):
            out[n] = timed(lambda: ray.get(dst.take.remote(src.get.remote(b)), timeout=120), reps)
        return out
    finally:
        ray.shutdown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="up to 64 MiB, 3 reps")
    ap.add_argument("--reps", type=int)
    ap.add_argument("--transports", default="tcp,shm,gloo,store",
                    help="any of tcp, shm, shm-read, shm-ring, gloo, store")
    ap.add_argument("--rdt", action="store_true", help="also measure Ray Direct Transport (gloo)")
    ap.add_argument("--chunk-mib", type=float, default=TransferConfig.chunk_bytes / MiB,
                    help="sender frame size (whole layers, at least one)")
    ap.add_argument("--tcp-streams", default=str(TransferConfig.tcp_streams),
                    help="TCP connections per pair; a comma list measures each (columns tcp-xN)")
    ap.add_argument("--shm-read-threads", type=int, default=2, help="shm direct reads: parallel readers")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    mibs = [0, 4, 16, 64] if a.quick else [0, 4, 16, 64, 256]
    sizes = [1 if m == 0 else blocks_for(m) for m in mibs]
    reps = a.reps or (3 if a.quick else 5)
    results = {"memcpy": bench_memcpy(sizes, reps, cold=True),
               "memcpy-warm": bench_memcpy(sizes, reps, cold=False)}
    kinds = a.transports.split(",")
    streams = [int(x) for x in a.tcp_streams.split(",")]
    global READ_THREADS
    READ_THREADS = a.shm_read_threads
    for kind in ("tcp", "shm", "shm-read", "shm-ring", "gloo"):
        if kind not in kinds:
            continue
        if kind == "tcp" and len(streams) > 1:
            for k in streams:
                results[f"tcp-x{k}"] = bench_transport(kind, sizes, reps, int(a.chunk_mib * MiB), k)
        else:
            results[kind] = bench_transport(kind, sizes, reps, int(a.chunk_mib * MiB), streams[0])
    if "store" in kinds:
        results["store-put"], results["store-get"], results["store-get-shm"] = bench_store(sizes, reps)
    if a.rdt:
        results["rdt-gloo"] = bench_rdt(sizes, reps)

    print(f"# KV page sets, {LAYOUT.bytes_per_block // 1024} KiB/block (Qwen2.5-7B bf16, block 16); "
          f"median of {reps}; {os.cpu_count()} CPUs; caches scrubbed before every rep")
    print("# ratio = GB/s / memcpy GB/s (memcpy: same bytes, pre-faulted, not cache-resident); "
          "memcpy-warm is hot-cache, for reference only")
    print(f"{'size':>10} {'blocks':>6} | " + " | ".join(f"{k:>24}" for k in results))
    rows = []
    for n in sizes:
        nbytes = n * LAYOUT.bytes_per_block
        base = nbytes / results["memcpy"][n] / 1e9
        cells = []
        for k, r in results.items():
            gbps = nbytes / r[n] / 1e9
            cells.append(f"{r[n] * 1e3:8.2f}ms {gbps:6.2f}GB/s {gbps / base:4.0%}")
            rows.append({"transport": k, "blocks": n, "bytes": nbytes, "seconds": r[n], "gbps": gbps,
                         "ratio_vs_memcpy": gbps / base})
        print(f"{nbytes / MiB:8.2f}Mi {n:>6} | " + " | ".join(f"{c:>24}" for c in cells))
    print("# telemetry totals (what the router / metrics read):", json.dumps(TELEMETRY.totals()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layout": LAYOUT.__dict__, "reps": reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
