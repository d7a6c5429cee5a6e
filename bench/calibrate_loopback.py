"""Loopback calibration: how fast can bytes move between two processes on this machine at all?

    .venv/bin/python bench/calibrate_loopback.py [--mib 16,64] [--reps 5]

Same run, same sizes, one receiver process per method, receive buffer pre-faulted and reused:
  memcpy-warm   dst.copy_(src), same buffers every rep (cache-resident up to ~L3/2)
  memcpy-cold   the same copy after streaming a scrub buffer twice the L3 size (neither src nor
                dst in cache): the bound a transfer of bytes not just touched can hope for
  two-copy      two processes copying at once, each its own buffers: half their summed rate is
                the bound for any path that copies the bytes twice with both copies overlapped
                (loopback TCP: into the kernel and out; a shared-memory ring: in and out)
  cma           process_vm_readv of the bytes out of another process (one copy, no protocol):
                what ShmTransport's direct reads can reach
  zmq           bare pyzmq PUSH/PULL, 4 MiB frames sent copy=False, recv_into one buffer, 1-byte ack
                (libzmq reads into its own message, then memcpy's it out: two receive copies)
  socket        raw TCP socket, sendall / recv_into the destination (one receive copy), then a
                1-byte ack, as a transfer protocol needs: what TcpTransport's data plane does

What this separates: the cost of loopback TCP itself (socket) from what zmq adds on top (zmq),
and both from what our protocol adds (bench_kvtransfer.py's tcp column).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

import torch

# Same cache scrub as the transfer benchmark, so the two memcpy baselines are comparable.
from bench_kvtransfer import scrub_cache

MiB = 1 << 20
FRAME = 4 * MiB
SOCKBUF = 0  # 0: leave the kernel's autotuning alone (setting a size disables it)


def memcpy(nbytes: int, reps: int, cold: bool) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pre-fault both
    times = []
    for _ in range(reps):
        if cold:
            scrub_cache()
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- receivers
def _zmq_receiver(nbytes: int, q, sockbuf: int) -> None:
    global SOCKBUF
    SOCKBUF = sockbuf
    import zmq
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    if SOCKBUF:
        pull.setsockopt(zmq.RCVBUF, SOCKBUF)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack = ctx.socket(zmq.PUSH)
    q.put(port)
    ack.connect(q.get())
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    while True:
        off = 0
        while off < nbytes:
            off += pull.recv_into(mv[off:off + FRAME])
        ack.send(b"k")


def _socket_receiver(nbytes: int, q, sockbuf: int) -> None:
    global SOCKBUF
    SOCKBUF = sockbuf
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    if SOCKBUF:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKBUF)
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    mv = memoryview(buf.numpy())
    while True:
        off = 0
        while off < nbytes:
            n = conn.recv_into(mv[off:], nbytes - off)
            if n == 0:
                return
            off += n
        conn.sendall(b"k")


def _copier(nbytes: int, reps: int, start, q) -> None:
    torch.set_num_threads(1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    q.put((time.perf_counter() - t0) / reps)


def two_copy(nbytes: int, reps: int) -> float:
    """Seconds per byte-moving of the bound above: 2 copies share the memory system, so the
    transfer time is at least nbytes / (summed rate / 2) = 2 * nbytes / summed rate."""
    mctx = mp.get_context("spawn")
    q, start = mctx.Queue(), mctx.Barrier(2)
    procs = [mctx.Process(target=_copier, args=(nbytes, 4 * reps, start, q), daemon=True) for _ in range(2)]
    for p in procs:
        p.start()
    per = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    summed = sum(nbytes / t for t in per)
    return 2 * nbytes / summed


def _holder(nbytes: int, q, done) -> None:
    import os
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    q.put((os.getpid(), src.data_ptr()))
    done.get()


def bench_cma(nbytes: int, reps: int) -> float:
    from thinkserve.kvtransfer import cma
    if not cma.available():
        return float("nan")
    mctx = mp.get_context("spawn")
    q, done = mctx.Queue(), mctx.Queue()
    p = mctx.Process(target=_holder, args=(nbytes, q, done), daemon=True)
    p.start()
    pid, addr = q.get(timeout=60)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    try:
        return timed_median(lambda: cma.read(pid, addr, [(dst.data_ptr(), nbytes)]), reps)
    except OSError as e:
        print(f"# cma: {e}")
        return float("nan")
    finally:
        done.put(1)
        p.join(10)


def timed_median(once, reps: int) -> float:
    """Median seconds of ``once()`` over ``reps`` runs after one warm-up, caches scrubbed before each."""
    once()
    times = []
    for _ in range(reps):
        scrub_cache()
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_zmq(nbytes: int, reps: int) -> float:
    import zmq
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    if SOCKBUF:
        push.setsockopt(zmq.SNDBUF, SOCKBUF)
    ack = ctx.socket(zmq.PULL)
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    p = mctx.Process(target=_zmq_receiver, args=(nbytes, q, SOCKBUF), daemon=True)
    p.start()
    port = q.get(timeout=60)
    q.put(f"tcp://127.0.0.1:{ack_port}")
    push.connect(f"tcp://127.0.0.1:{port}")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    mv = memoryview(src.numpy())

    def once():
        for off in range(0, nbytes, FRAME):
            push.send(mv[off:off + FRAME], copy=False)
        ack.recv()
    try:
        return timed_median(once, reps)
    finally:
        p.kill()
        ctx.destroy(linger=0)


def bench_socket(nbytes: int, reps: int) -> float:
    mctx = mp.get_context("spawn")
    q = mctx.Queue()
    p = mctx.Process(target=_socket_receiver, args=(nbytes, q, SOCKBUF), daemon=True)
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get(timeout=60)))
    if SOCKBUF:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKBUF)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    mv = memoryview(src.numpy())

    def once():
        s.sendall(mv)
        s.recv(1)
    try:
        return timed_median(once, reps)
    finally:
        s.close()
        p.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", default="16,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sockbuf-kib", type=int, default=0, help="SO_SNDBUF/SO_RCVBUF; 0 = kernel autotuning")
    a = ap.parse_args()
    global SOCKBUF
    SOCKBUF = a.sockbuf_kib * 1024
    torch.set_num_threads(1)
    print(f"# loopback calibration; socket buffers {a.sockbuf_kib or 'autotuned'} KiB; median of {a.reps}; GB/s (ratio to memcpy-cold)")
    for mib in [int(m) for m in a.mib.split(",")]:
        n = mib * MiB
        r = {"memcpy-warm": memcpy(n, a.reps, False), "memcpy-cold": memcpy(n, a.reps, True),
             "two-copy": two_copy(n, a.reps), "cma": bench_cma(n, a.reps),
             "zmq": bench_zmq(n, a.reps), "socket": bench_socket(n, a.reps)}
        base = n / r["memcpy-cold"]
        print(f"{mib:5d} MiB | " + " | ".join(f"{k} {n / t / 1e9:6.2f} ({n / t / base:4.0%})" for k, t in r.items()))


if __name__ == "__main__":
    main()
