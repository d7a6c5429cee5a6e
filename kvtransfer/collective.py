"""Collective transport: page-set bytes over a torch.distributed pair group (gloo on CPU, NCCL
between GPUs), formed per (sender, receiver) pair at run time — no global world.

    sender (rank 0)                                     receiver (rank 1)
    TCPStore(host, port=0, master)  ── OFFER{pair_id, store host:port, join} ──▶  (zmq control)
                                    ◀── ACCEPT ──────────  TCPStore client, ProcessGroup(rank 1)
    ProcessGroup(rank 0)  ◀════ rendezvous over the pair's own store ════▶
    pg.send(chunk_i, dst=1, tag)    ════ gloo / NCCL ════▶  pg.recv(staging[chunk_i], src=0, tag)
                                    ◀── DONE ────────────  sink.write / commit

Each pair owns its store (on the sender, ephemeral port) and its ``ProcessGroupGloo`` /
``ProcessGroupNCCL`` object, built directly — ``init_process_group`` is never called — so
instances join and leave while the cluster runs: a new peer is a new pair, a dead peer's pair
is dropped on the first error, and the next send to that address forms a fresh pair. Every
collective op waits with the configured timeout; a peer that dies closes the gloo TCP pair,
which fails the op on the survivor in milliseconds.

Why not Ray Direct Transport (``@ray.method(tensor_transport=...)``): see docs/kvtransfer.md —
in Ray 2.60 an actor can be in only one collective group per backend (so a prefill instance
cannot hold pairs with several decode instances), groups are created by the driver, collective
transfers cannot be aborted, and it measured slower than this pair group on the same box.
"""
from __future__ import annotations

import datetime
import os
import socket
import uuid

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, TCPStore

from .page_set import PageSet
from .conversation import Incoming, PeerConnection, ZmqTransport
from .transport import PairLost, PeerGone, Received, TransferConfig, TransferError, TransferTimeout

BACKENDS = ("gloo", "nccl")
_TAG_SPACE = 1 << 30


def _timeout(config: TransferConfig) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.timeout_s)


def _make_group(backend: str, store, rank: int, config: TransferConfig):
    """A two-member process group on ``store``; blocks until the other member joins."""
    if backend == "gloo":
        opts = ProcessGroupGloo._Options()
        opts._timeout = _timeout(config)
        opts._devices = [ProcessGroupGloo.create_device(hostname=config.host)]
        return ProcessGroupGloo(store, rank, 2, opts)
    from torch.distributed import ProcessGroupNCCL  # only in CUDA builds
    # Without blocking wait, a NCCL op on a dead peer is only noticed by the watchdog; with it,
    # ``work.wait`` raises after the group's timeout.
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
    opts = ProcessGroupNCCL.Options()
    opts._timeout = _timeout(config)
    return ProcessGroupNCCL(store, rank, 2, opts)


class _Pair:
    """One end of a pair group."""

    def __init__(self, pair_id: str, group, store, master_store=None):
        self.pair_id = pair_id
        self.group = group
        self.store = store
        self.master_store = master_store  # the sender keeps its TCPStore alive for the pair's life
        self.next_tag = 0

    def take_tags(self, n: int) -> int:
        tag = self.next_tag
        self.next_tag = (self.next_tag + n) % _TAG_SPACE
        return tag

    def close(self) -> None:
        for fn in ("abort", "shutdown"):
            try:
                getattr(self.group, fn)()
                break
            except Exception:  # a backend may not implement abort, or the group is already broken
                continue
        self.group = None


class PairGroupTransport(ZmqTransport):
    """zmq for the conversation, a torch.distributed pair group for the bytes."""

    def __init__(self, config: TransferConfig = TransferConfig(), *, backend: str = "gloo",
                 bind: str | None = None, device: str | None = None):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not collective_available(backend):
            raise RuntimeError(f"the {backend} backend is not available here: it needs torch.distributed"
                               + (" built with NCCL and a CUDA device" if backend == "nccl" else ""))
        self.backend = backend
        self.name = backend
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        super().__init__(config, bind=bind, staging_device=self.device)
        self._send_pairs: dict[str, tuple[_Pair | None, TCPStore, str]] = {}  # peer -> (pair, store, id)
        self._recv_pairs: dict[str, _Pair] = {}  # pair_id -> pair

    # ---------------------------------------------------------------- sender
    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set"):
        try:
            return super().send(peer, page_set, kind=kind)
        except PairLost:  # the receiver restarted or dropped the pair: form a new one, once
            self._drop_send_pair(peer)
            return super().send(peer, page_set, kind=kind)

    def _offer_extra(self, peer: str) -> dict:
        if peer not in self._send_pairs:
            store = TCPStore(self.config.host, 0, 2, True, timeout=_timeout(self.config), wait_for_workers=False)
            self._send_pairs[peer] = (None, store, uuid.uuid4().hex)
        pair, store, pair_id = self._send_pairs[peer]
        tag = pair.next_tag if pair is not None else 0
        return {"pair_id": pair_id, "store_host": self.config.host, "store_port": store.port,
                "join": pair is None, "tag": tag, "backend": self.backend}

    def _send_data(self, peer, conn: PeerConnection, xfer, page_set: PageSet, extra: dict, accept: dict) -> None:
        pair, store, pair_id = self._send_pairs[peer]
        if pair is None:
            try:
                group = _make_group(self.backend, PrefixStore(pair_id, store), 0, self.config)
            except Exception as e:
                raise TransferTimeout(f"forming a {self.backend} pair with {peer} failed: {e}", peer=peer) from None
            pair = _Pair(pair_id, group, None, store)
            self._send_pairs[peer] = (pair, store, pair_id)
        flat = page_set.byte_view()
        if flat.device.type != self.device.split(":")[0]:
            flat = flat.to(self.device)
        chunks = range(0, page_set.nbytes, self.config.chunk_bytes)
        tag = pair.take_tags(len(chunks))
        for i, off in enumerate(chunks):
            work = pair.group.send([flat[off:off + self.config.chunk_bytes]], 1, (tag + i) % _TAG_SPACE)
            _wait(work, self.config, peer, page_set.header.request_id)

    def _on_send_failure(self, peer: str) -> None:
        self._drop_send_pair(peer)

    def _drop_send_pair(self, peer: str) -> None:
        entry = self._send_pairs.pop(peer, None)
        if entry is not None and entry[0] is not None:
            entry[0].close()

    # ---------------------------------------------------------------- receiver
    def _accept_extra(self, inc: Incoming) -> dict:
        ex = inc.extra
        if ex.get("backend") != self.backend:
            raise TransferError(f"sender uses backend {ex.get('backend')!r}, this endpoint {self.backend!r}")
        if not ex.get("join") and ex.get("pair_id") not in self._recv_pairs:
            raise PairLost(f"no pair group {ex.get('pair_id')} here")
        return {}

    def _receive_data(self, sink, key) -> Received | None:
        inc = self._incoming[key]
        ex = inc.extra
        rid = inc.header.request_id
        try:
            pair = self._recv_pairs.get(ex["pair_id"])
            if ex["join"] or pair is None:
                if pair is not None:
                    pair.close()
                host, port = str(ex["store_host"]), int(ex["store_port"])
                _probe_store(host, port, self.config, rid)
                # Half the budget: TCPStore's client retries with backoff and can overshoot its timeout.
                store = TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=self.config.timeout_s / 2))
                group = _make_group(self.backend, PrefixStore(ex["pair_id"], store), 1, self.config)
                pair = self._recv_pairs[ex["pair_id"]] = _Pair(ex["pair_id"], group, store)
            chunks = range(0, inc.header.nbytes, self.config.chunk_bytes)
            tag = int(ex["tag"])
            pair.next_tag = (tag + len(chunks)) % _TAG_SPACE
            for i, off in enumerate(chunks):
                work = pair.group.recv([inc.staging[off:off + self.config.chunk_bytes]], 0, (tag + i) % _TAG_SPACE)
                _wait(work, self.config, inc.identity.hex(), rid)
                inc.received = min(inc.header.nbytes, off + self.config.chunk_bytes)
        except TransferError as e:
            self._fail(sink, key, e)
        except Exception as e:  # TCPStore / group construction errors
            self._fail(sink, key, TransferTimeout(f"joining the {self.backend} pair failed: {e}", request_id=rid))
        if self.device != "cpu":
            torch.cuda.current_stream().synchronize()
        return self._complete(sink, key)

    def _on_recv_failure(self, inc: Incoming) -> None:
        pair = self._recv_pairs.pop(str(inc.extra.get("pair_id")), None)
        if pair is not None:
            pair.close()

    def close(self) -> None:
        for peer in list(self._send_pairs):
            self._drop_send_pair(peer)
        for pair in self._recv_pairs.values():
            pair.close()
        self._recv_pairs.clear()
        super().close()


def _probe_store(host: str, port: int, config: TransferConfig, request_id: str | None) -> None:
    """Fail fast if the sender's pair store is gone: TCPStore's own client would retry with
    backoff for the whole timeout and overshoot it."""
    try:
        socket.create_connection((host, port), timeout=config.timeout_s).close()
    except OSError as e:
        raise PeerGone(f"the sender's pair store {host}:{port} is unreachable: {e}", request_id=request_id) from None


def _wait(work, config: TransferConfig, peer: str, request_id: str | None) -> None:
    """Wait for one collective op; classify its failure (a closed gloo pair = the peer died)."""
    try:
        work.wait(datetime.timedelta(seconds=config.timeout_s))
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else repr(e)
        if "closed" in msg.lower() or "reset" in msg.lower() or "broken pipe" in msg.lower():
            raise PeerGone(f"{peer} left the pair group: {msg}", peer=peer, request_id=request_id) from None
        raise TransferTimeout(f"collective op with {peer} failed or timed out: {msg}", peer=peer,
                              request_id=request_id) from None


def collective_available(backend: str) -> bool:
    """Whether a ``PairGroupTransport`` with ``backend`` can start in this process."""
    if backend == "gloo":
        return dist.is_available()
    return dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()
