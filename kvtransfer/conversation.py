"""The conversation every kvtransfer transport speaks: offer, accept or refuse, the bytes, done
or fail, over zmq. How the bytes travel is each subclass's business (``tcp.TcpTransport``: plain
TCP connections; ``shm.ShmTransport``: a shared-memory ring; ``collective.PairGroupTransport``:
a gloo / NCCL pair group); the store's request / reply client reuses ``PeerConnection``.

Sockets: each endpoint binds one ROUTER (``address``) and opens one DEALER per peer it sends to.
Messages (raw frames, msgpack for anything structured, never pickle)::

    DEALER → ROUTER   [b"O", xfer_id, header(msgpack), extra(msgpack)]      offer
                      [b"D", xfer_id, offset(u64 le), ...]                   data notice (shm ring)
    ROUTER → DEALER   [xfer_id, b"A" | b"R" | b"K" | b"F", msgpack]          accept / refuse /
                                                                             done / fail
    ROUTER → DEALER   [xfer_id, b"P", b""]                                   probe (ignored)

Failure detection, fastest first: a peer process that dies closes its TCP connection. The sender
sees a monitor DISCONNECTED event (milliseconds). The receiver's ROUTER monitor reports that
*some* peer left (libzmq's per-identity ROUTER_NOTIFY is a draft API, absent from stock builds),
so it probes each in-flight sender: with ROUTER_MANDATORY a send to a vanished identity fails
with EHOSTUNREACH, naming the dead peer. Idle transfers are probed every ``PROBE_S`` too. A silent
peer (node down, partition) trips zmq heartbeats; anything else trips ``TransferConfig.timeout_s``.
Every wait polls with a deadline; nothing blocks unbounded.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .page_set import PageSet, PageSetHeader
from .telemetry import TransferRecord
from .transport import (NoRoom, PageSink, PairLost, PeerGone, Received, Transport, TransferConfig, TransferError,
                        TransferRefused, TransferTimeout, error_from_wire, error_to_wire)

log = logging.getLogger(__name__)

OFFER, DATA, CANCEL = b"O", b"D", b"C"
ACCEPT, REFUSE, DONE, FAIL, PROBE = b"A", b"R", b"K", b"F", b"P"
PROBE_S = 0.2  # the receiver probes senders of transfers idle this long
_U64 = struct.Struct("<Q")


def _pack(obj) -> bytes:
    return msgpack.packb(obj)


def _unpack(data) -> dict:
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:
        raise ValueError(f"control message is not valid msgpack: {e}") from None
    if not isinstance(d, dict):
        raise ValueError("control message is not a msgpack map")
    return d


# ----------------------------------------------------------------------------- sender side
class PeerConnection:
    """The sender's DEALER to one receiver, with a monitor that reports disconnects."""

    def __init__(self, ctx: zmq.Context, peer: str, config: TransferConfig):
        self.peer = peer
        self.config = config
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, os.urandom(8))
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, int(config.timeout_s * 1000))
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        _set_heartbeat(self.sock, config)
        self.mon = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(peer)
        self.connected = False
        self.lost = False  # was connected, then disconnected
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self.mon, zmq.POLLIN)

    def _drain_monitor(self) -> None:
        while self.mon.poll(0):
            ev = recv_monitor_message(self.mon)["event"]
            if ev == zmq.EVENT_CONNECTED:
                self.connected, self.lost = True, False
            elif ev == zmq.EVENT_DISCONNECTED:
                self.lost = self.lost or self.connected
                self.connected = False

    def begin(self) -> None:
        """Start a new exchange: only a disconnect from now on means this exchange's peer left."""
        self._drain_monitor()
        self.lost = False

    def send(self, parts: Sequence, *, copy: bool = True) -> None:
        try:
            self.sock.send_multipart(parts, copy=copy)
        except zmq.Again:
            raise TransferTimeout(f"sending to {self.peer} blocked for {self.config.timeout_s}s",
                                  peer=self.peer) from None

    def wait(self, xfer: bytes, timeout_s: float, what: str, request_id: str | None) -> tuple[bytes, dict]:
        """The next reply for ``xfer`` (stale replies of aborted transfers are skipped)."""
        status, payload, _ = self.wait_frames(xfer, timeout_s, what, request_id)
        return status, payload

    def wait_frames(self, xfer: bytes, timeout_s: float, what: str,
                    request_id: str | None = None) -> tuple[bytes, dict, list[zmq.Frame]]:
        """Like ``wait``, also returning the raw frames after the payload (not copied)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._drain_monitor()
            if self.lost:
                raise PeerGone(f"{self.peer} closed the connection while {what}", peer=self.peer,
                               request_id=request_id)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"no answer from {self.peer} within {timeout_s:.3g}s while {what}",
                                      peer=self.peer, request_id=request_id)
            events = dict(self._poller.poll(min(left, 0.5) * 1000))
            if self.sock in events:
                parts = self.sock.recv_multipart(copy=False)
                if len(parts) >= 3 and parts[0].bytes == xfer and parts[1].bytes != PROBE:
                    return parts[1].bytes, _unpack(parts[2].buffer), parts[3:]

    def close(self) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)
        self.sock.close(linger=0)


def _set_heartbeat(sock: zmq.Socket, config: TransferConfig) -> None:
    """zmq heartbeats drop a connection whose peer went silent (not just one that closed)."""
    ivl = max(100, int(min(1.0, config.timeout_s / 3) * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(config.timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(config.timeout_s * 1000))


# ----------------------------------------------------------------------------- receiver side
@dataclass
class Incoming:
    """One accepted, not yet complete transfer on the receiver."""

    identity: bytes
    xfer: bytes
    header: PageSetHeader
    block_ids: tuple[int, ...]
    staging: torch.Tensor  # flat uint8, header.nbytes
    started: float
    started_wall: float
    deadline: float
    received: int = 0
    extra: dict = field(default_factory=dict)
    direct: bool = False  # chunks go straight into the sink (write_layers), no staging buffer


class StagingPool:
    """Reuses flat receive buffers: fresh memory costs a page fault per 4 KiB, about as much as
    the copy into it, so a warm receiver keeps its buffers."""

    def __init__(self, max_cached_bytes: int = 512 << 20, device: str = "cpu"):
        self._free: list[torch.Tensor] = []
        self._max = max_cached_bytes
        self.device = device

    def take(self, nbytes: int) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.numel() >= nbytes:
                return self._free.pop(i)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        self._free.append(base)
        self._free.sort(key=lambda b: b.numel())
        while sum(b.numel() for b in self._free) > self._max:
            self._free.pop(0)


class ZmqTransport(Transport):
    """The OFFER / ACCEPT / bytes / DONE conversation over zmq; subclasses choose how the bytes
    travel (``_send_data`` / ``_receive_data`` or DATA notices through ``_recv_chunk``)."""

    name = "zmq"

    def __init__(self, config: TransferConfig = TransferConfig(), *, bind: str | None = None,
                 staging_device: str = "cpu"):
        self.config = config
        self._ctx = zmq.Context(io_threads=1)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _set_heartbeat(self._router, config)
        self._router.bind(bind or f"tcp://{config.host}:0")
        self.address: str = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._router_mon = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._router_mon, zmq.POLLIN)
        self._peers: dict[str, PeerConnection] = {}
        self._incoming: dict[tuple[bytes, bytes], Incoming] = {}
        self._staging = StagingPool(device=staging_device)
        self._closed = False

    # ---------------------------------------------------------------- sender
    def _conn(self, peer: str) -> PeerConnection:
        if peer not in self._peers:
            self._peers[peer] = PeerConnection(self._ctx, peer, self.config)
        return self._peers[peer]

    def _drop_peer(self, peer: str) -> None:
        """Forget a connection after a failure: closing it discards frames still queued for a
        dead peer, and the receiver (if alive) sees the disconnect and frees its blocks."""
        conn = self._peers.pop(peer, None)
        if conn is not None:
            conn.close()

    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set") -> TransferRecord:
        header = page_set.header
        rid = header.request_id
        t0, wall0 = time.perf_counter(), time.time()
        xfer = os.urandom(8)
        conn = self._conn(peer)
        try:
            extra = self._offer_extra(peer)
            conn.begin()
            conn.send([OFFER, xfer, header.to_wire(), _pack(extra)])
            status, reply = conn.wait(xfer, self.config.timeout_s, "waiting for the offer's answer", rid)
            if status in (REFUSE, FAIL):
                raise error_from_wire(reply, peer=peer, request_id=rid)
            if status != ACCEPT:
                raise TransferError(f"{peer} answered the offer with {status!r}", peer=peer, request_id=rid)
            self._send_data(peer, conn, xfer, page_set, extra, reply)
            status, reply = conn.wait(xfer, self.config.completion_timeout(page_set.nbytes),
                                      f"sending {page_set.nbytes} bytes", rid)
            if status != DONE:
                raise error_from_wire(reply, peer=peer, request_id=rid)
        except TransferRefused:
            raise  # the connection is healthy; the receiver just said no
        except TransferError:
            self._drop_peer(peer)
            self._on_send_failure(peer)
            raise
        return TransferRecord(kind, self.name, peer, rid, header.num_blocks, page_set.nbytes,
                              time.perf_counter() - t0, wall0)

    def _offer_extra(self, peer: str) -> dict:
        return {}

    def _send_data(self, peer: str, conn: PeerConnection, xfer: bytes, page_set: PageSet,
                   extra: dict, accept: dict) -> None:
        raise NotImplementedError

    def _on_send_failure(self, peer: str) -> None:
        pass

    # ---------------------------------------------------------------- receiver
    def recv(self, sink: PageSink, *, timeout_s: float | None = None) -> Received:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            for key, inc in list(self._incoming.items()):
                if inc.deadline <= now:
                    self._fail(sink, key, TransferTimeout(
                        f"no data from the sender for {self.config.timeout_s:.3g}s "
                        f"({inc.received}/{inc.header.nbytes} bytes received)", request_id=inc.header.request_id))
            wake = min([deadline] + [i.deadline for i in self._incoming.values()])
            if now >= deadline and not self._incoming:
                raise TransferTimeout(f"no page set arrived at {self.address} within {timeout_s:.3g}s")
            events = dict(self._poller.poll(max(0.0, min(wake - now, PROBE_S)) * 1000))
            if self._router_mon in events:
                while self._router_mon.poll(0):
                    recv_monitor_message(self._router_mon)
                self._probe(sink, idle_s=0.0)
            if self._router not in events:
                self._probe(sink, idle_s=PROBE_S)
                continue
            try:
                done = self._handle_one(sink)
            except PairLost:  # the sender re-forms its pair and offers again; not the caller's business
                continue
            if done is not None:
                return done

    def _probe(self, sink: PageSink, idle_s: float) -> None:
        """Fail in-flight transfers whose sender's connection is gone (see the module doc)."""
        now = time.monotonic()
        for key, inc in list(self._incoming.items()):
            if now - (inc.deadline - self.config.timeout_s) < idle_s:
                continue
            try:
                self._router.send_multipart([inc.identity, inc.xfer, PROBE, b""], flags=zmq.DONTWAIT)
            except zmq.Again:
                continue  # alive but not reading fast enough: the deadline decides
            except zmq.ZMQError:
                self._fail(sink, key, PeerGone(
                    f"the sender disconnected mid-transfer ({inc.received}/{inc.header.nbytes} bytes received)",
                    request_id=inc.header.request_id), reply=False)

    def _handle_one(self, sink: PageSink) -> Received | None:
        identity = self._router.recv()
        op = self._router.recv() if self._router.getsockopt(zmq.RCVMORE) else b""
        if op == DATA:
            return self._on_data(sink, identity)
        rest = self._router.recv_multipart() if self._router.getsockopt(zmq.RCVMORE) else []
        if op == OFFER and len(rest) == 3:
            return self._on_offer(sink, identity, rest[0], rest[1], _unpack(rest[2]))
        if op == CANCEL and rest:
            key = (identity, rest[0])
            if key in self._incoming:
                self._fail(sink, key, TransferError("the sender cancelled the transfer"), reply=False)
        return None

    def _on_offer(self, sink: PageSink, identity: bytes, xfer: bytes, header_wire: bytes,
                  extra: dict) -> Received | None:
        t0, wall0 = time.perf_counter(), time.time()
        try:
            header = PageSetHeader.from_wire(header_wire)
        except ValueError as e:
            self._reply(identity, xfer, REFUSE, error_to_wire(TransferRefused(str(e))))
            raise TransferRefused(f"refused a malformed offer: {e}") from None
        try:
            sink.check(header)
            block_ids = sink.allocate(header)
            if block_ids is None:
                raise NoRoom(f"no room for {header.num_blocks} blocks", request_id=header.request_id)
            if len(block_ids) != header.num_blocks:
                sink.abort(header, block_ids)
                raise TransferError(f"sink allocated {len(block_ids)} blocks for {header.num_blocks}")
        except TransferError as e:
            self._reply(identity, xfer, REFUSE, error_to_wire(e))
            e.request_id = header.request_id
            raise
        try:
            direct = self._direct_ok(sink)
        except Exception as e:  # a sink that cannot say: the slower, general path
            log.warning("%s: the sink failed to describe its cache (%r); staging instead", self.name, e)
            direct = False
        inc = Incoming(identity, xfer, header, tuple(int(b) for b in block_ids),
                       self._staging.take(0 if direct else header.nbytes),
                       t0, wall0, time.monotonic() + self.config.timeout_s, extra=extra, direct=direct)
        key = (identity, xfer)
        self._incoming[key] = inc
        try:
            accept = self._accept_extra(inc)
        except TransferError as e:
            self._fail(sink, key, e)
        self._reply(identity, xfer, ACCEPT, accept)
        if inc.header.nbytes == 0:
            return self._complete(sink, key)
        try:
            return self._receive_data(sink, key)
        except TransferError:
            raise
        except Exception as e:  # a bug or a sink failure must not strand the blocks or the sender
            if key in self._incoming:
                self._fail(sink, key, TransferError(f"receiving the page set failed: {e!r}"))
            raise

    def _accept_extra(self, inc: Incoming) -> dict:
        return {}

    def _direct_ok(self, sink: PageSink) -> bool:
        return False

    def _receive_data(self, sink: PageSink, key: tuple[bytes, bytes]) -> Received | None:
        """Default: the bytes arrive as DATA messages later, handled by ``_on_data``."""
        return None

    def _on_data(self, sink: PageSink, identity: bytes) -> Received | None:
        xfer = self._router.recv()
        off = _U64.unpack(self._router.recv())[0]
        inc = self._incoming.get((identity, xfer))
        if inc is None:  # a stale chunk of an aborted transfer
            self._router.recv(copy=False)
            return None
        n = self._recv_chunk(sink, (identity, xfer), inc, off)
        inc.received += n
        inc.deadline = time.monotonic() + self.config.timeout_s
        if inc.received >= inc.header.nbytes:
            return self._complete(sink, (identity, xfer))
        return None

    def _recv_chunk(self, sink: PageSink, key: tuple[bytes, bytes], inc: Incoming, off: int) -> int:
        """The rest of a DATA message: the chunk at ``off``; returns its length in bytes. Only
        transports whose bytes arrive as DATA notices (the shm ring) expect them."""
        while self._router.getsockopt(zmq.RCVMORE):
            self._router.recv(copy=False)
        self._fail(sink, key, TransferError(f"{self.name} does not take DATA messages (chunk at offset {off})"))

    def _complete(self, sink: PageSink, key: tuple[bytes, bytes]) -> Received:
        inc = self._incoming[key]
        h = inc.header
        try:
            if not inc.direct:
                sink.write(h, inc.block_ids, inc.staging.view(h.dtype).view(h.shape))
            sink.commit(h, inc.block_ids)
        except Exception as e:
            err = e if isinstance(e, TransferError) else TransferError(f"the sink failed to write: {e!r}")
            self._fail(sink, key, err)
        del self._incoming[key]
        self._staging.give(inc.staging)
        self._reply(inc.identity, inc.xfer, DONE, {})
        rec = TransferRecord("page_set", self.name, inc.identity.hex(), h.request_id, h.num_blocks, h.nbytes,
                             time.perf_counter() - inc.started, inc.started_wall)
        return Received(h, inc.block_ids, rec)

    def _fail(self, sink: PageSink, key: tuple[bytes, bytes], err: TransferError, *, reply: bool = True):
        """Free what the transfer allocated, tell the sender (if it listens), raise ``err``."""
        inc = self._incoming.pop(key)
        try:
            sink.abort(inc.header, inc.block_ids)
        finally:
            self._staging.give(inc.staging)
            self._on_recv_failure(inc)
            if reply:
                self._reply(inc.identity, inc.xfer, FAIL, error_to_wire(err))
        err.request_id = inc.header.request_id
        raise err

    def _on_recv_failure(self, inc: Incoming) -> None:
        pass

    def _reply(self, identity: bytes, xfer: bytes, status: bytes, payload: dict) -> None:
        try:
            self._router.send_multipart([identity, xfer, status, _pack(payload)], flags=zmq.DONTWAIT)
        except zmq.ZMQError:  # the sender is gone (EHOSTUNREACH) or not reading: nothing to tell
            pass

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            self._drop_peer(peer)
        try:
            self._router.disable_monitor()
        except zmq.ZMQError:
            pass
        self._router_mon.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()
