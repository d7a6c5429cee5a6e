"""The CPU-memory KV store: one per node, bytes of KV blocks in host memory, keyed by the
prefix-chain block hash (the role Mooncake Store plays for Mooncake).

Keys are ``(namespace, block_hash)``: the hash names tokens (workers/block_hash.py), the
namespace names the model and KV layout that computed them (``fingerprint_namespace``). A value
is one block of every layer, ``[L, 2, block_size, H, D]`` bytes, contiguous.

    LRU order (oldest first)          pinned (never evicted, not in the LRU)
    [k3] [k7] [k1] ... [k9] ◀─ MRU    {k4: 2 pins, k5: 1 pin}
      ▲ evicted first when a put needs room; a put never evicts keys of its own batch (a prefix
        chain is only useful from its first block, so evicting its head to store its tail
        would be self-defeating): the rest of the batch is refused instead.

Three ways to reach it, all with the same tensor-level verbs (``put_blocks`` / ``get_blocks`` /
``contains`` / ``match_prefix`` / ``pin`` / ``unpin`` / ``stats``):
``KVStore`` (in process), ``StoreServer`` + ``StoreClient`` (zmq, msgpack + raw frames, from
other processes and nodes). The Ray actor that hosts a node's store belongs to cluster/.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import threading
import warnings
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

import torch
import zmq

from thinkserve.workers.kv_cache import KVLayout
from thinkserve.workers.prefix_journal import PrefixCursor, PrefixDelta, PrefixJournal

from .shared_buffers import SHARED, SegmentMaps, segment_offer
from .conversation import PeerConnection, _pack, _unpack
from .transport import TransferConfig, TransferError

log = logging.getLogger(__name__)
Key = tuple[str, int]


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    bytes_used: int
    entries: int
    pinned_entries: int
    hits: int
    misses: int
    puts: int  # entries stored (not counting re-puts of present keys)
    refused: int  # entries a put could not store
    evictions: int
    evicted_bytes: int
    spare_bytes: int = 0  # freed block buffers kept for reuse (counted against the capacity)

    def to_dict(self) -> dict:
        return asdict(self)


# ----------------------------------------------------------------------------- tensor <-> blocks
def block_buffers(kv: torch.Tensor) -> list[memoryview]:
    """One contiguous byte buffer per block of ``kv`` ([L, 2, n, bs, H, D]); one copy."""
    kv = kv.cpu()
    return [memoryview(kv[:, :, i].contiguous().reshape(-1).view(torch.uint8).numpy()) for i in range(kv.shape[2])]


def assemble_blocks(buffers: Sequence, layout: KVLayout) -> torch.Tensor:
    """Inverse of ``block_buffers``: [L, 2, n, bs, H, D] (a permuted view, not contiguous)."""
    n, bpb = len(buffers), layout.bytes_per_block
    staging = torch.empty(n * bpb, dtype=torch.uint8)
    out = memoryview(staging.numpy())
    for i, buf in enumerate(buffers):
        b = memoryview(buf).cast("B")
        if len(b) != bpb:
            raise ValueError(f"stored block {i} has {len(b)} bytes, the layout says {bpb}")
        out[i * bpb:(i + 1) * bpb] = b
    return blocks_view(staging, n, layout)


def blocks_view(flat: torch.Tensor, n: int, layout: KVLayout) -> torch.Tensor:
    """``n`` blocks stored one after another (the store's layout, [L, 2, bs, H, D] each) in the
    uint8 tensor ``flat``, seen as [L, 2, n, bs, H, D] (a permuted view, no copy)."""
    blocks = flat[:n * layout.bytes_per_block].view(layout.torch_dtype).view(
        n, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return blocks.permute(1, 2, 0, 3, 4, 5)


class BlockStoreAPI:
    """Tensor-level verbs shared by the in-process store and the remote client."""

    def put_blocks(self, namespace: str, hashes: Sequence[int], kv: torch.Tensor) -> list[bool]:
        if kv.shape[2] != len(hashes):
            raise ValueError(f"{len(hashes)} hashes for {kv.shape[2]} blocks")
        return self.put(namespace, hashes, block_buffers(kv), copy=False)  # fresh buffers: ours

    def get_blocks(self, namespace: str, hashes: Sequence[int], layout: KVLayout) -> torch.Tensor:
        """KV of the longest leading run of ``hashes`` present: [L, 2, k, bs, H, D], k <= len."""
        found = self.get(namespace, hashes)
        k = next((i for i, b in enumerate(found) if b is None), len(found))
        return assemble_blocks(found[:k], layout)

    @contextlib.contextmanager
    def borrow_blocks(self, namespace: str, hashes: Sequence[int], layout: KVLayout):
        """Like ``get_blocks``, but the tensor is only lent for the ``with`` body (a remote
        store on the same node fills one of our reusable shared buffers instead of sockets)."""
        yield self.get_blocks(namespace, hashes, layout)

    # raw verbs, implemented by subclasses
    def put(self, namespace: str, hashes: Sequence[int], buffers: Sequence, *, copy: bool = True) -> list[bool]: ...
    def get(self, namespace: str, hashes: Sequence[int]) -> list: ...


# ----------------------------------------------------------------------------- the store
class KVStore(BlockStoreAPI):
    """Bytes in host memory with a hard capacity, LRU eviction and pins. Thread-safe."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = int(capacity_bytes)
        self._lru: collections.OrderedDict[Hashable, memoryview] = collections.OrderedDict()
        self._pinned: dict[Hashable, memoryview] = {}
        self._pins: dict[Hashable, int] = {}
        self._used = 0
        # Buffers of deleted blocks, by size, for the next puts: fresh memory costs a page fault
        # per 4 KiB, ~8x the copy into it. used + spare never exceeds the capacity.
        self._spare: dict[int, list[bytearray]] = {}
        self._spare_bytes = 0
        self._lock = threading.Lock()
        self._c = collections.Counter()
        # Per namespace somebody follows (``prefix_delta``): the keys it gains and loses.
        self._journals: dict[str, PrefixJournal] = {}

    def _lookup(self, key) -> memoryview | bytearray | None:
        return self._lru.get(key) if key in self._lru else self._pinned.get(key)

    def put(self, namespace: str, hashes: Sequence[int], buffers: Sequence, *, copy: bool = True) -> list[bool]:
        """Store each block; ``False`` for a block refused because it cannot fit without
        evicting pinned entries or entries of this same batch. Present keys are refreshed.
        ``copy=False`` keeps the caller's buffers (the caller promises not to change them)."""
        if len(hashes) != len(buffers):
            raise ValueError(f"{len(hashes)} hashes for {len(buffers)} buffers")
        keys = [(namespace, int(h)) for h in hashes]
        batch = set(keys)
        out: list[bool] = []
        with self._lock:
            refusing = False
            for key, buf in zip(keys, buffers):
                if key in self._lru:
                    self._lru.move_to_end(key)
                    out.append(True)
                    continue
                if key in self._pinned:
                    out.append(True)
                    continue
                buf = memoryview(buf).cast("B")
                reuse = self._room_for(len(buf), batch, want_buffer=copy) if not refusing else False
                if reuse is False:
                    refusing = True
                    self._c["refused"] += 1
                    out.append(False)
                    continue
                if copy:
                    if reuse is None:
                        value = bytearray(buf)
                    else:
                        reuse[:] = buf  # same length: one memcpy into warm memory
                        value = reuse
                else:
                    value = buf
                self._lru[key] = value
                self._used += len(buf)
                self._c["puts"] += 1
                self._journal(key, True)
                out.append(True)
        return out

    def _room_for(self, nbytes: int, batch: set, *, want_buffer: bool) -> bytearray | None | bool:
        """Make room for ``nbytes`` (under the lock). Returns a free buffer of that size to reuse
        (a spare, or the evicted LRU victim's when no one reads it any more), ``None`` when
        there is room but no buffer to reuse, or ``False`` when there is no room (the capacity
        is smaller, or only pinned entries and this batch's own are left)."""
        if nbytes > self.capacity_bytes:
            return False
        if want_buffer and self._spare.get(nbytes):
            self._spare_bytes -= nbytes
            return self._spare[nbytes].pop()  # spare -> used: the total does not change
        while self._used + self._spare_bytes + nbytes > self.capacity_bytes:
            if self._spare_bytes:  # free memory first
                size = max(k for k, v in self._spare.items() if v)
                self._spare[size].pop()
                self._spare_bytes -= size
                continue
            if not self._lru:
                return False
            key, buf = next(iter(self._lru.items()))
            if key in batch:
                return False
            del self._lru[key]
            self._used -= len(buf)
            self._journal(key, False)
            self._c["evictions"] += 1
            self._c["evicted_bytes"] += len(buf)
            if want_buffer and len(buf) == nbytes and self._self_owned(buf):
                return buf
        return None

    @staticmethod
    def _self_owned(value) -> bool:
        """A buffer the store copied into (a bytearray) that no reader holds any more: every
        reader got its own memoryview export, and a bytearray with exports cannot be resized."""
        if not isinstance(value, bytearray) or not value:
            return False
        try:
            last = value.pop()
        except BufferError:
            return False
        value.append(last)  # back to its size, within its allocation: no realloc
        return True

    def get(self, namespace: str, hashes: Sequence[int]) -> list[memoryview | None]:
        """Buffers of the blocks (``None`` for misses); hits become most recently used."""
        out = []
        with self._lock:
            for h in hashes:
                key = (namespace, int(h))
                buf = self._lookup(key)
                if buf is None:
                    self._c["misses"] += 1
                else:
                    self._c["hits"] += 1
                    if key in self._lru:
                        self._lru.move_to_end(key)
                    if isinstance(buf, bytearray):  # the reader's own export: no reuse while it lives
                        buf = memoryview(buf)
                out.append(buf)
        return out

    def contains(self, namespace: str, hashes: Sequence[int]) -> list[bool]:
        """Presence of each key. This operation does not change the LRU order or the stats."""
        with self._lock:
            return [self._lookup((namespace, int(h))) is not None for h in hashes]

    def match_prefix(self, namespace: str, hashes: Sequence[int]) -> int:
        """How many leading keys are present (a chain is only usable up to its first miss)."""
        present = self.contains(namespace, hashes)
        return next((i for i, p in enumerate(present) if not p), len(present))

    def pin(self, namespace: str, hashes: Sequence[int]) -> list[bool]:
        """Protect present entries from eviction (counted: pin twice, unpin twice)."""
        out = []
        with self._lock:
            for h in hashes:
                key = (namespace, int(h))
                if key in self._lru:
                    self._pinned[key] = self._lru.pop(key)
                if key in self._pinned:
                    self._pins[key] = self._pins.get(key, 0) + 1
                    out.append(True)
                else:
                    out.append(False)
        return out

    def unpin(self, namespace: str, hashes: Sequence[int]) -> None:
        with self._lock:
            for h in hashes:
                key = (namespace, int(h))
                if key not in self._pins:
                    raise ValueError(f"unpin of block {key} that is not pinned")
                self._pins[key] -= 1
                if self._pins[key] == 0:
                    del self._pins[key]
                    self._lru[key] = self._pinned.pop(key)  # most recently used again

    def delete(self, namespace: str, hashes: Sequence[int]) -> int:
        """Drop unpinned entries (e.g. a swapped-out request that finished elsewhere)."""
        n = 0
        with self._lock:
            for h in hashes:
                buf = self._lru.pop((namespace, int(h)), None)
                if buf is not None:
                    self._used -= len(buf)
                    self._journal((namespace, int(h)), False)
                    n += 1
                    if self._self_owned(buf):  # kept for the next put of that size
                        self._spare.setdefault(len(buf), []).append(buf)
                        self._spare_bytes += len(buf)
        return n

    def _journal(self, key, added: bool) -> None:
        j = self._journals.get(key[0]) if self._journals else None
        if j is not None:
            (j.added if added else j.evicted)(key[1])

    def prefix_delta(self, namespace: str, since: PrefixCursor) -> PrefixDelta:
        """The block hashes of ``namespace`` this store gained and lost since ``since`` (the router's
        prefix index follows them). The first call for a namespace starts its journal (a full
        resync); later stores and evictions in it are recorded."""
        with self._lock:
            j = self._journals.get(namespace)
            if j is None:
                j = self._journals[namespace] = PrefixJournal()
                j.held.update(h for ns, h in (*self._lru, *self._pinned) if ns == namespace)
            return j.since(since)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self.capacity_bytes, self._used, len(self._lru) + len(self._pinned), len(self._pinned),
                              self._c["hits"], self._c["misses"], self._c["puts"], self._c["refused"],
                              self._c["evictions"], self._c["evicted_bytes"], self._spare_bytes)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(len(b) for b in self._lru.values()) + sum(len(b) for b in self._pinned.values())
            if total != self._used:
                raise AssertionError(f"store accounts {self._used} bytes but holds {total}")
            spare = sum(len(b) for bufs in self._spare.values() for b in bufs)
            if spare != self._spare_bytes or any(len(b) != n for n, bufs in self._spare.items() for b in bufs):
                raise AssertionError(f"store accounts {self._spare_bytes} spare bytes but keeps {spare}")
            if self._used + self._spare_bytes > self.capacity_bytes:
                raise AssertionError(f"store holds {self._used} + {self._spare_bytes} spare bytes over its "
                                     f"capacity {self.capacity_bytes}")
            if set(self._pins) != set(self._pinned) or set(self._lru) & set(self._pinned):
                raise AssertionError("pin counts and pinned entries disagree")


# ----------------------------------------------------------------------------- server / client
_OPS = ("put", "put_from", "get", "get_into", "contains", "match_prefix", "pin", "unpin", "delete", "stats")


class StoreServer:
    """Serves a ``KVStore`` on a zmq ROUTER: [req_id, op, msgpack args, *block frames] in,
    [req_id, b"ok" | b"err", msgpack result, *block frames] out. Blocks stay zero-copy both ways:
    a put stores the received frames, a get sends the stored buffers."""

    def __init__(self, store: KVStore, *, bind: str = "tcp://127.0.0.1:0"):
        self.store = store
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(bind)
        self.address: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._maps = SegmentMaps(writable=True)  # same-node clients' receive segments (get_into)

    def start(self) -> "StoreServer":
        self._thread = threading.Thread(target=self.serve_forever, name="kv-store", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(100):
                self.serve_one()
        self._maps.close()
        self._sock.close(linger=0)
        self._ctx.term()

    def serve_one(self) -> None:
        parts = self._sock.recv_multipart(copy=False)
        if len(parts) < 4:
            return
        identity, req_id, op = parts[0].bytes, parts[1].bytes, parts[2].bytes.decode(errors="replace")
        frames: list = []
        try:
            args = _unpack(parts[3].buffer)
            result, frames = self._dispatch(op, args, parts[4:])
            reply = [identity, req_id, b"ok", _pack({"r": result}), *frames]
        except Exception as e:  # every failure travels back as a typed value
            reply = [identity, req_id, b"err", _pack({"type": type(e).__name__, "message": str(e)})]
        try:
            self._sock.send_multipart(reply, copy=False, flags=zmq.DONTWAIT)
        except zmq.ZMQError:
            pass

    def _dispatch(self, op: str, args: dict, frames: list) -> tuple[object, list]:
        s = self.store
        ns, hashes = str(args.get("ns", "")), [int(h) for h in args.get("hashes", [])]
        if op == "put":
            return s.put(ns, hashes, [f.buffer for f in frames], copy=False), []
        if op == "get":
            found = s.get(ns, hashes)
            return [b is not None for b in found], [b for b in found if b is not None]
        if op == "get_into":
            return self._get_into(ns, hashes, args.get("seg") or {}), []
        if op == "put_from":
            return self._put_from(ns, hashes, args.get("seg") or {}, int(args.get("block_bytes", 0))), []
        if op in ("contains", "match_prefix", "pin", "unpin", "delete"):
            return getattr(s, op)(ns, hashes), []
        if op == "stats":
            return s.stats().to_dict(), []
        raise ValueError(f"unknown store op {op!r}; expected one of {_OPS}")

    def _get_into(self, ns: str, hashes: list[int], seg: dict) -> dict:
        """Same node: copy the leading run of found blocks straight into the client's shared
        segment (one memcpy each) instead of sending them. ``{"n": 0, "denied": why}`` when this
        process may not map it; the client then uses ``get``."""
        try:
            dst = self._maps.view(seg)
        except OSError as e:  # ProcessGone / MapDenied
            return {"n": 0, "denied": str(e)}
        found = self.store.get(ns, hashes)
        k = next((i for i, b in enumerate(found) if b is None), len(found))
        off = 0
        with warnings.catch_warnings():  # stored blocks are read-only buffers; we only read them
            warnings.simplefilter("ignore")
            for b in found[:k]:
                b = memoryview(b).cast("B")
                if off + len(b) > dst.numel():
                    raise ValueError(f"the client's segment ({dst.numel()} bytes) is too small for {k} blocks")
                dst[off:off + len(b)].copy_(torch.frombuffer(b, dtype=torch.uint8))
                off += len(b)
        del dst
        return {"n": k, "bytes": off}

    def _put_from(self, ns: str, hashes: list[int], seg: dict, block_bytes: int) -> dict:
        """Same node: store blocks read straight out of the client's shared segment (the store's
        own copy is the only one). ``{"denied": why}`` when this process may not map it."""
        try:
            src = self._maps.view(seg)
        except OSError as e:  # ProcessGone / MapDenied
            return {"denied": str(e)}
        if block_bytes <= 0 or block_bytes * len(hashes) != src.numel():
            raise ValueError(f"{len(hashes)} blocks of {block_bytes} bytes do not fill the {src.numel()}-byte segment")
        mv = memoryview(src.numpy())
        stored = self.store.put(ns, hashes, [mv[i * block_bytes:(i + 1) * block_bytes] for i in range(len(hashes))],
                                copy=True)
        del mv, src
        return {"stored": stored}

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class StoreClient(BlockStoreAPI):
    """A remote ``KVStore``. Every call is bounded by ``config.timeout_s`` (plus the payload at
    ``min_bandwidth``); a dead server raises ``PeerGone`` / ``TransferTimeout``."""

    def __init__(self, address: str, config: TransferConfig = TransferConfig(), *, same_node: bool = True):
        self.address = address
        self.config = config
        self.same_node = same_node  # try get_into (the server maps our buffers); off after a refusal
        self._ctx = zmq.Context(io_threads=1)
        self._conn: PeerConnection | None = None

    def _call(self, op: str, args: dict, frames: Sequence = ()) -> tuple[object, list]:
        if self._conn is None:
            self._conn = PeerConnection(self._ctx, self.address, self.config)
        req = os.urandom(8)
        nbytes = sum(len(memoryview(f)) for f in frames)
        try:
            self._conn.begin()
            self._conn.send([req, op.encode(), _pack(args), *frames], copy=False)
            status, result, out = self._conn.wait_frames(req, self.config.completion_timeout(nbytes), f"store {op}")
        except TransferError:
            self._conn.close()
            self._conn = None
            raise
        if status != b"ok":
            if result.get("type") == "ValueError":
                raise ValueError(f"store {op}: {result.get('message')}")
            raise TransferError(f"store {op} failed: {result.get('type')}: {result.get('message')}", peer=self.address)
        return result.get("r"), out

    def put(self, namespace, hashes, buffers, *, copy: bool = True) -> list[bool]:
        return self._wrap("put", namespace, hashes, buffers)  # the bytes are copied onto the wire

    def get(self, namespace, hashes) -> list[memoryview | None]:
        mask, frames = self._call_r("get", namespace, hashes)
        it = iter(frames)
        return [next(it).buffer if hit else None for hit in mask]

    def put_blocks(self, namespace: str, hashes: Sequence[int], kv: torch.Tensor) -> list[bool]:
        """Same node: the blocks go into a shared buffer of ours in the store's per-block layout
        (one copy) and the server copies them out of it; no socket carries them."""
        n = len(hashes)
        if kv.shape[2] != n:
            raise ValueError(f"{n} hashes for {kv.shape[2]} blocks")
        if not self.same_node or n == 0 or kv.device.type != "cpu":
            return super().put_blocks(namespace, hashes, kv)
        block_bytes = kv[:, :, :1].numel() * kv.element_size()
        buf = SHARED.take(n * block_bytes)
        try:
            buf.view(kv.dtype).view(n, *kv.shape[:2], *kv.shape[3:]).copy_(kv.permute(2, 0, 1, 3, 4, 5))
            r = self._call_mapped("put_from", namespace, hashes, buf, block_bytes=block_bytes)
        finally:
            SHARED.give(buf)
        return super().put_blocks(namespace, hashes, kv) if r is None else list(r["stored"])

    def _call_mapped(self, op: str, namespace: str, hashes: Sequence[int], buf: torch.Tensor, **args) -> dict | None:
        """``op`` with ``buf`` (ours, from ``SHARED``) offered to the server to map; ``None`` when it
        may not (another machine, permissions): then this client uses the socket verbs for good."""
        r = self._call(op, {"ns": namespace, "hashes": [int(h) for h in hashes],
                            "seg": segment_offer(SHARED.locate(buf), buf.numel()), **args})[0]
        if r.get("denied"):
            log.info("store %s cannot map this process's buffers (%s); using sockets", self.address, r["denied"])
            self.same_node = False
            return None
        return r

    @contextlib.contextmanager
    def borrow_blocks(self, namespace: str, hashes: Sequence[int], layout: KVLayout):
        """Same node: the server copies the blocks straight into a shared buffer of ours (one
        memcpy, no socket), lent for the ``with`` body. Elsewhere (the server cannot map it): once
        refused, every call is ``get_blocks``."""
        if not self.same_node or not hashes:
            yield self.get_blocks(namespace, hashes, layout)
            return
        buf = SHARED.take(len(hashes) * layout.bytes_per_block)
        try:
            r = self._call_mapped("get_into", namespace, hashes, buf)
            yield self.get_blocks(namespace, hashes, layout) if r is None else blocks_view(buf, int(r["n"]), layout)
        finally:
            SHARED.give(buf)

    def contains(self, namespace, hashes) -> list[bool]:
        return self._wrap("contains", namespace, hashes)

    def match_prefix(self, namespace, hashes) -> int:
        return self._wrap("match_prefix", namespace, hashes)

    def pin(self, namespace, hashes) -> list[bool]:
        return self._wrap("pin", namespace, hashes)

    def unpin(self, namespace, hashes) -> None:
        self._wrap("unpin", namespace, hashes)

    def delete(self, namespace, hashes) -> int:
        return self._wrap("delete", namespace, hashes)

    def stats(self) -> StoreStats:
        return StoreStats(**self._call_r("stats", "", [])[0])

    def _call_r(self, op, namespace, hashes, frames=()):
        return self._call(op, {"ns": namespace, "hashes": [int(h) for h in hashes]}, frames)

    def _wrap(self, op, namespace, hashes, frames=()):
        return self._call_r(op, namespace, hashes, frames)[0]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        self._ctx.term()


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m thinkserve.kvtransfer.store --capacity-bytes N [--bind tcp://127.0.0.1:PORT]``"""
    ap = argparse.ArgumentParser(description="thinkserve CPU KV store (one per node)")
    ap.add_argument("--capacity-bytes", type=int, required=True)
    ap.add_argument("--bind", default="tcp://127.0.0.1:0")
    a = ap.parse_args(argv)
    server = StoreServer(KVStore(a.capacity_bytes), bind=a.bind)
    print(f"kv store listening on {server.address}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
