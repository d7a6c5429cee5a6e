"""The zmq conversation every transport speaks, and the TCP transport: works on every machine
and across nodes.

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

``TcpTransport`` moves the bytes themselves over plain TCP connections beside the conversation
(see its docstring): zmq would add a receive copy and an I/O thread to every byte.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor
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
    travel (``TcpTransport``: zmq frames; ``PairGroupTransport``: a gloo / NCCL pair group)."""

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


def layer_bytes(header: PageSetHeader) -> int:
    """Bytes of one layer (K and V of every block) of a page set: the framing unit."""
    return header.nbytes // header.layout.num_layers


# ----------------------------------------------------------------------------- TCP data plane
_HELLO = struct.Struct("<8sI")  # sender token, stream index: first bytes of a data connection
_PREFIX = struct.Struct("<8sQ")  # xfer id, bytes on this stream: first bytes of each transfer
_IOV_MAX = 1024  # iovecs per recvmsg_into call (Linux IOV_MAX)
MIN_STREAM_BYTES = 4 << 20  # below this per stream, one more connection costs more than it gives


def stream_layers(num_layers: int, streams: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``streams`` contiguous ``[first, last)`` layer ranges."""
    return [(num_layers * i // streams, num_layers * (i + 1) // streams) for i in range(streams)]


def block_ranges(cache: torch.Tensor, header: PageSetHeader, block_ids: Sequence[int],
                 layers: tuple[int, int]) -> list[tuple[int, int]]:
    """``(byte offset in cache, length)`` of the cache regions that the page-set bytes of
    ``layers`` land in, in wire order ([L, 2, n, ...]: per layer, K then V, blocks in page-set
    order). Consecutive block ids are one range, so an engine's usual allocation needs two
    ranges a layer. ``cache`` is a contiguous [L, 2, N, bs, H, D] host cache."""
    from thinkserve.workers.kv_cache import block_runs
    num_cache_blocks = cache.shape[2]
    unit = header.layout.bytes_per_block // (2 * header.layout.num_layers)  # one block, one layer, K or V
    runs = block_runs(block_ids)
    return [((lk * num_cache_blocks + first) * unit, n * unit)
            for lk in range(2 * layers[0], 2 * layers[1]) for _, first, n in runs]


def block_views(cache: torch.Tensor, header: PageSetHeader, block_ids: Sequence[int],
                layers: tuple[int, int]) -> list[memoryview]:
    """Writable memoryviews over ``block_ranges``: what ``recvmsg_into`` scatters into."""
    mv = memoryview(cache.view(-1).view(torch.uint8).numpy())
    return [mv[off:off + n] for off, n in block_ranges(cache, header, block_ids, layers)]


class TcpTransport(ZmqTransport):
    """Page-set bytes over plain TCP connections beside the zmq conversation.

    The offer / accept / done conversation stays on zmq (its failure detection is described
    above); the bytes go over ``config.tcp_streams`` persistent TCP connections per
    sender→receiver pair, each carrying a contiguous range of layers. Nothing in user space
    touches the bytes: the sender hands the kernel memoryviews over the page set's tensor, and
    a sink that exposes its host cache (``PageSink.host_cache``: the engine's CPU cache, a
    ``BlockPool``) gets them read straight into the allocated blocks with ``recvmsg_into``
    (one iovec per layer, K/V and run of consecutive blocks). The kernel's two loopback copies are the only
    copies, as with a bare socket (bench/calibrate_loopback.py). Other sinks (a GPU cache)
    receive into a reused staging buffer and get one ``write``.

    Data connections: the receiver listens on ``config.host``, port in every ACCEPT. A sender
    opens its connections on the first transfer to a receiver, each starting with a hello
    (sender token, stream index), and reuses them; each transfer starts every stream it uses
    with (xfer id, byte count), so a stray byte is caught, not written. Any failure closes the
    pair's connections on the side that saw it; the next offer says ``fresh`` (reconnected) or
    is refused with ``PairLost`` and retried once with new connections.

    Failures: a peer process that dies closes its connections (EOF / ECONNRESET at once); a
    silent one trips the socket timeout (``timeout_s`` without progress for the receiver,
    ``completion_timeout`` of the stream's bytes for the sender); while the receiver waits for
    a new connection it watches the zmq monitor as before.
    """

    name = "tcp"

    def __init__(self, config: TransferConfig = TransferConfig(), *, bind: str | None = None,
                 staging_device: str = "cpu"):
        super().__init__(config, bind=bind, staging_device=staging_device)
        self._listener = socket.create_server((config.host, 0), backlog=64)
        self._listener.setblocking(False)
        self.data_port: int = self._listener.getsockname()[1]
        self._token = os.urandom(8)
        self._out: dict[str, list[socket.socket]] = {}  # peer -> data connections (sender side)
        self._fresh: set[str] = set()  # peers whose connections the receiver has not seen yet
        self._in: dict[bytes, dict[int, socket.socket]] = {}  # sender token -> stream -> conn
        self._pool: ThreadPoolExecutor | None = None

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(1, self.config.tcp_streams), thread_name_prefix="kv-tcp")
        return self._pool

    def _run_streams(self, fns: list) -> None:
        """Run one callable per stream (in threads when there are several) and wait for all of
        them; then re-raise the first error (a failing stream shuts the others' sockets down)."""
        if len(fns) == 1:
            fns[0]()
            return
        futures = [self._threads().submit(fn) for fn in fns]
        errors = [f.exception() for f in futures]
        errors = [e for e in errors if e is not None]
        if errors:
            raise next((e for e in errors if isinstance(e, TransferError)), errors[0])

    # ---------------------------------------------------------------- sender
    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set") -> TransferRecord:
        try:
            return super().send(peer, page_set, kind=kind)
        except PairLost:  # the receiver dropped our data connections (it restarted or failed one)
            self._drop_out(peer)
            return super().send(peer, page_set, kind=kind)

    def _offer_extra(self, peer: str) -> dict:
        fresh = peer not in self._out or peer in self._fresh
        if peer not in self._out:
            self._fresh.add(peer)
        return {"token": self._token, "pool": self.config.tcp_streams, "fresh": fresh}

    def _connect(self, peer: str, port: int) -> list[socket.socket]:
        host = peer.rsplit("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
        socks = []
        try:
            for i in range(self.config.tcp_streams):
                s = socket.create_connection((host, port), timeout=self.config.timeout_s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(_HELLO.pack(self._token, i))
                socks.append(s)
        except OSError as e:
            for s in socks:
                s.close()
            raise PeerGone(f"cannot open a data connection to {host}:{port}: {e}", peer=peer) from None
        return socks

    def _send_data(self, peer, conn, xfer, page_set, extra, accept) -> None:
        header = page_set.header
        if header.nbytes == 0:  # the receiver completes on the offer alone
            return
        if peer not in self._out:
            self._out[peer] = self._connect(peer, int(accept["data_port"]))
        self._fresh.discard(peer)
        socks = self._out[peer]
        kv = page_set.kv if page_set.kv.device.type == "cpu" else page_set.kv.cpu()
        mv = memoryview(kv.reshape(-1).view(torch.uint8).numpy())
        per_layer = layer_bytes(header)
        streams = int(accept.get("streams", 0))
        if not 1 <= streams <= len(socks):
            raise TransferError(f"{peer} asked for {streams} data streams; this pair has {len(socks)}",
                                peer=peer, request_id=header.request_id)
        ranges = stream_layers(header.layout.num_layers, streams)

        def stream(i: int, first: int, last: int):
            def run():
                s, data = socks[i], mv[first * per_layer:last * per_layer]
                try:
                    s.settimeout(self.config.completion_timeout(len(data)))
                    s.sendall(_PREFIX.pack(xfer, len(data)))
                    s.sendall(data)
                except socket.timeout:
                    raise TransferTimeout(f"sending {len(data)} bytes to {peer} did not finish within "
                                          f"{self.config.completion_timeout(len(data)):.3g}s", peer=peer,
                                          request_id=header.request_id) from None
                except OSError as e:
                    self._shutdown(socks)  # stop the other streams too
                    raise PeerGone(f"{peer} closed the data connection mid-transfer: {e}", peer=peer,
                                   request_id=header.request_id) from None
            return run
        try:
            self._run_streams([stream(i, a, b) for i, (a, b) in enumerate(ranges)])
        except TransferTimeout:
            self._shutdown(socks)
            raise

    @staticmethod
    def _shutdown(socks) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _on_send_failure(self, peer: str) -> None:
        self._drop_out(peer)

    def _drop_out(self, peer: str) -> None:
        for s in self._out.pop(peer, []):
            s.close()
        self._fresh.discard(peer)

    # ---------------------------------------------------------------- receiver
    def _accept_extra(self, inc: Incoming) -> dict:
        ex = inc.extra
        token, pool = bytes(ex.get("token", b"")), int(ex.get("pool", 1))
        if len(token) != 8 or not 1 <= pool <= 64:
            raise TransferRefused(f"bad data-connection offer (token {token!r}, pool {pool})")
        if ex.get("fresh"):
            self._drop_in(token)
            self._reap_closed()
        elif len(self._in.get(token, {})) < pool:
            raise PairLost("this receiver has no data connections from the sender (it restarted or failed one)")
        # The receiver decides how many of the pair's connections this transfer uses.
        streams = max(1, min(pool, inc.header.layout.num_layers, inc.header.nbytes // MIN_STREAM_BYTES))
        inc.extra["streams"] = streams
        return {"data_port": self.data_port, "streams": streams}

    def _direct_ok(self, sink: PageSink) -> bool:
        cache = sink.host_cache()
        return cache is not None and cache.device.type == "cpu" and cache.is_contiguous()

    def _await_connections(self, sink: PageSink, key, token: bytes, pool: int) -> dict[int, socket.socket]:
        """Accept data connections until ``pool`` of them from ``token`` are here (others'
        are kept for their own transfers); give up if the sender leaves or ``timeout_s`` passes."""
        deadline = time.monotonic() + self.config.timeout_s
        poller = zmq.Poller()
        poller.register(self._listener.fileno(), zmq.POLLIN)
        poller.register(self._router_mon, zmq.POLLIN)
        while len(self._in.get(token, {})) < pool:
            left = deadline - time.monotonic()
            if left <= 0:
                inc = self._incoming[key]
                self._fail(sink, key, TransferTimeout(
                    f"the sender opened no data connection within {self.config.timeout_s:.3g}s",
                    request_id=inc.header.request_id))
            events = dict(poller.poll(min(left, PROBE_S) * 1000))
            if self._router_mon in events:
                while self._router_mon.poll(0):
                    recv_monitor_message(self._router_mon)
            self._probe(sink, idle_s=0.0)  # raises PeerGone when the sender is gone
            if self._listener.fileno() in events:
                self._accept_one()
        return self._in[token]

    def _accept_one(self) -> None:
        try:
            s, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            s.setblocking(True)
            s.settimeout(self.config.timeout_s)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token, idx = _HELLO.unpack(_recv_exact(s, _HELLO.size))
        except (OSError, EOFError, struct.error) as e:
            log.warning("dropped a data connection without a valid hello: %s", e)
            s.close()
            return
        old = self._in.setdefault(token, {}).pop(idx, None)
        if old is not None:
            old.close()
        self._in[token][idx] = s

    def _receive_data(self, sink: PageSink, key: tuple[bytes, bytes]) -> Received | None:
        inc = self._incoming[key]
        h, token = inc.header, bytes(inc.extra["token"])
        conns = self._await_connections(sink, key, token, int(inc.extra.get("pool", 1)))
        ranges = stream_layers(h.layout.num_layers, int(inc.extra["streams"]))
        per_layer = layer_bytes(h)
        if inc.direct:
            cache = sink.host_cache()
            views = [block_views(cache, h, inc.block_ids, r) for r in ranges]
        else:
            mv = memoryview(inc.staging.numpy())
            views = [[mv[a * per_layer:b * per_layer]] for a, b in ranges]
        progress = [0] * len(ranges)

        def stream(i: int):
            def run():
                s = conns[i]
                try:
                    s.settimeout(self.config.timeout_s)
                    xfer, n = _PREFIX.unpack(_recv_exact(s, _PREFIX.size))
                    want = (ranges[i][1] - ranges[i][0]) * per_layer
                    if xfer != inc.xfer or n != want:
                        raise TransferError(f"data stream {i} carries {n} bytes of transfer {xfer.hex()}, "
                                            f"expected {want} of {inc.xfer.hex()}")
                    _recv_into_views(s, views[i], progress, i, lambda: self._on_progress(inc, sum(progress)))
                except socket.timeout:
                    raise TransferTimeout(f"no data from the sender for {self.config.timeout_s:.3g}s "
                                          f"({sum(progress)}/{h.nbytes} bytes received)", request_id=h.request_id) from None
                except (OSError, EOFError) as e:
                    self._shutdown(conns.values())
                    raise PeerGone(f"the sender disconnected mid-transfer ({sum(progress)}/{h.nbytes} bytes "
                                   f"received): {e or 'EOF'}", request_id=h.request_id) from None
            return run
        try:
            self._run_streams([stream(i) for i in range(len(ranges))])
        except TransferError as e:
            inc.received = sum(progress)
            self._fail(sink, key, e)
        inc.received = h.nbytes
        return self._complete(sink, key)

    def _on_progress(self, inc: Incoming, received: int) -> None:
        """Called after every receive call with the bytes received so far (tests hook it)."""

    def _on_recv_failure(self, inc: Incoming) -> None:
        self._drop_in(bytes(inc.extra.get("token", b"")))

    def _drop_in(self, token: bytes) -> None:
        for s in self._in.pop(token, {}).values():
            s.close()

    def _reap_closed(self) -> None:
        """Close data connections whose sender went away between transfers (EOF waiting)."""
        for token, conns in list(self._in.items()):
            for s in conns.values():
                try:
                    # A socket with a timeout waits for it inside recv whatever MSG_DONTWAIT says
                    # (CPython polls first): ask select, without waiting, whether there is an EOF to read.
                    if not select.select([s], [], [], 0)[0]:
                        continue
                    if s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        self._drop_in(token)
                        break
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    self._drop_in(token)
                    break

    def close(self) -> None:
        if self._closed:
            return
        for peer in list(self._out):
            self._drop_out(peer)
        for token in list(self._in):
            self._drop_in(token)
        self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise EOFError("the connection closed")
        got += k
    return bytes(buf)


def _recv_into_views(s: socket.socket, views: list[memoryview], progress: list[int], slot: int,
                     on_progress) -> None:
    """Fill ``views`` in order from ``s`` (scatter receive, ``_IOV_MAX`` views per call)."""
    views = [v for v in views if len(v)]
    i = 0
    while i < len(views):
        n = s.recvmsg_into(views[i:i + _IOV_MAX])[0]
        if n == 0:
            raise EOFError("the connection closed")
        progress[slot] += n
        on_progress()
        while n:
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0
