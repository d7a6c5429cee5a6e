"""The TCP transport: page-set bytes over plain TCP connections, on every machine and across
nodes. The offer / accept / done conversation around them is ``conversation.ZmqTransport``'s;
zmq would add a receive copy and an I/O thread to every byte, so the bytes go beside it.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import struct
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from .conversation import PROBE_S, Incoming, ZmqTransport
from .page_set import PageSet, block_views, layer_bytes
from .telemetry import TransferRecord
from .transport import PageSink, PairLost, PeerGone, Received, TransferConfig, TransferError, TransferRefused, TransferTimeout

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<8sI")  # sender token, stream index: first bytes of a data connection
_PREFIX = struct.Struct("<8sQ")  # xfer id, bytes on this stream: first bytes of each transfer
_IOV_MAX = 1024  # iovecs per recvmsg_into call (Linux IOV_MAX)
MIN_STREAM_BYTES = 4 << 20  # below this per stream, one more connection costs more than it gives


def stream_layers(num_layers: int, streams: int) -> list[tuple[int, int]]:
    """Split ``num_layers`` into ``streams`` contiguous ``[first, last)`` layer ranges."""
    return [(num_layers * i // streams, num_layers * (i + 1) // streams) for i in range(streams)]



class TcpTransport(ZmqTransport):
    """Page-set bytes over plain TCP connections beside the zmq conversation.

    The offer / accept / done conversation stays on zmq (its failure detection is described
    in conversation.py); the bytes go over ``config.tcp_streams`` persistent TCP connections per
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
