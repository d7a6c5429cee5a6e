"""Same-node shortcut: page-set bytes through a shared-memory ring instead of loopback TCP.

The conversation (offer / accept / done / fail, probes, deadlines) is ``ZmqTransport``'s; only
the bytes take another road. Loopback TCP costs two kernel copies plus libzmq's; here each side
does one memcpy, and the two overlap::

    sender                                   ring in /dev/shm (per sender→receiver pair)
    copy layers i into slot i % k  ────────▶ [slot 0][slot 1][slot 2][slot 3]
    DATA(xfer, offset, slot, nbytes) ──zmq──▶ receiver: slot → sink.write_layers (straight into
                                  ◀──zmq─── FREED(count)        the blocks), then frees the slot
    (waits for FREED before reusing a slot)

The sender creates the ring file and offers its path with ``join``; once the receiver accepted
(it has mapped the file) the sender unlinks the path; from then on a crash on either side leaks nothing (a sender
that dies between creating the ring and the accept leaves one file behind).
A receiver that does not know an offered ring (it restarted) answers ``PairLost``; the sender
then forms a new ring and retries once. A receiver on another node cannot open the path and
refuses the offer, so the caller falls back to ``TcpTransport``. Every wait is the
conversation's: bounded by ``TransferConfig.timeout_s``.
"""
from __future__ import annotations

import mmap
import os
import struct
import uuid
import warnings

import torch

from .page_set import PageSet
from .tcp import DATA, Incoming, PeerConnection, ZmqTransport, _U64, layer_bytes, layer_frames, write_layer_chunk
from .transport import PageSink, PairLost, TransferConfig, TransferError, TransferRefused, error_from_wire

FREED = b"S"
_SLOT = struct.Struct("<QQ")  # slot index, bytes in it
SHM_DIR = "/dev/shm"


class _Ring:
    """A file-backed shared mapping of ``slots`` × ``slot_bytes``."""

    def __init__(self, path: str, slots: int, slot_bytes: int, *, create: bool):
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, slots * slot_bytes)
            elif os.fstat(fd).st_size != slots * slot_bytes:
                raise ValueError(f"ring {path} has {os.fstat(fd).st_size} bytes, offer says {slots * slot_bytes}")
            self.map = mmap.mmap(fd, slots * slot_bytes)
        finally:
            os.close(fd)
        self.path, self.slots, self.slot_bytes = path, slots, slot_bytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.bytes = torch.frombuffer(self.map, dtype=torch.uint8)
        if create:
            self.bytes.fill_(0)  # fault every page in now, not during the first transfer

    def slot(self, i: int, n: int) -> torch.Tensor:
        return self.bytes[i * self.slot_bytes:i * self.slot_bytes + n]

    def close(self) -> None:
        self.bytes = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass


class ShmTransport(ZmqTransport):
    """``TcpTransport``'s conversation with the bytes in a shared-memory ring (same node only)."""

    name = "shm"

    def __init__(self, config: TransferConfig = TransferConfig(), *, bind: str | None = None, slots: int = 4):
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (one filling while one drains), got {slots}")
        super().__init__(config, bind=bind)
        self.slots = slots
        self._send_rings: dict[str, tuple[_Ring, str, bool]] = {}  # peer -> (ring, id, receiver joined)
        self._recv_rings: dict[str, _Ring] = {}  # ring id -> ring

    # ---------------------------------------------------------------- sender
    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set"):
        self._ring_for(peer, page_set)
        try:
            return super().send(peer, page_set, kind=kind)
        except PairLost:  # the receiver restarted: it no longer maps our ring
            self._drop_send_ring(peer)
            self._ring_for(peer, page_set)
            return super().send(peer, page_set, kind=kind)

    def _ring_for(self, peer: str, page_set: PageSet) -> None:
        need = _frame_bytes(page_set, self.config.chunk_bytes)
        entry = self._send_rings.get(peer)
        if entry is not None and entry[0].slot_bytes >= need:
            return
        self._drop_send_ring(peer)
        ring_id = uuid.uuid4().hex
        path = os.path.join(SHM_DIR, f"thinkserve-kv-{ring_id}")
        ring = _Ring(path, self.slots, max(need, self.config.chunk_bytes), create=True)
        self._send_rings[peer] = (ring, ring_id, False)

    def _offer_extra(self, peer: str) -> dict:
        ring, ring_id, joined = self._send_rings[peer]
        return {"ring": ring_id, "path": ring.path, "join": not joined, "slots": ring.slots,
                "slot_bytes": ring.slot_bytes}

    def _send_data(self, peer, conn: PeerConnection, xfer, page_set: PageSet, extra: dict, accept: dict) -> None:
        ring, ring_id, joined = self._send_rings[peer]
        if not joined:  # the receiver has it mapped now: drop the name, nothing can leak
            _unlink(ring.path)
            self._send_rings[peer] = (ring, ring_id, True)
        flat = page_set.byte_view()
        frames = layer_frames(page_set, self.config.chunk_bytes)
        freed = 0
        for i, (off, frame) in enumerate(frames):
            while i - freed >= ring.slots:  # every slot is in use: wait for the receiver
                freed = self._wait_freed(conn, xfer, freed, page_set)
            n = len(frame)
            ring.slot(i % ring.slots, n).copy_(flat[off:off + n])
            conn.send([DATA, xfer, _U64.pack(off), _SLOT.pack(i % ring.slots, n)])
        while freed < len(frames):  # the receiver frees the last slot before it says DONE
            freed = self._wait_freed(conn, xfer, freed, page_set)

    def _wait_freed(self, conn: PeerConnection, xfer: bytes, freed: int, page_set: PageSet) -> int:
        rid = page_set.header.request_id
        status, reply = conn.wait(xfer, self.config.timeout_s, "waiting for a free shm slot", rid)
        if status != FREED:
            raise error_from_wire(reply, peer=conn.peer, request_id=rid)
        return max(freed, int(reply.get("n", 0)))

    def _on_send_failure(self, peer: str) -> None:
        self._drop_send_ring(peer)

    def _drop_send_ring(self, peer: str) -> None:
        entry = self._send_rings.pop(peer, None)
        if entry is not None:
            if not entry[2]:
                _unlink(entry[0].path)
            entry[0].close()

    # ---------------------------------------------------------------- receiver
    def _accept_extra(self, inc: Incoming) -> dict:
        ex = inc.extra
        ring_id = str(ex.get("ring"))
        if ex.get("join"):
            old = self._recv_rings.pop(ring_id, None)
            if old is not None:
                old.close()
            try:
                self._recv_rings[ring_id] = _Ring(str(ex["path"]), int(ex["slots"]), int(ex["slot_bytes"]),
                                                  create=False)
            except (OSError, ValueError, KeyError) as e:
                raise TransferRefused(f"cannot map the sender's shm ring (another node?): {e}") from None
        elif ring_id not in self._recv_rings:
            raise PairLost(f"no shm ring {ring_id} here")
        inc.extra["chunks"] = 0
        return {}

    def _direct_ok(self, sink: PageSink) -> bool:
        return sink.layer_writes

    def _recv_chunk(self, sink: PageSink, key, inc: Incoming, off: int) -> int:
        slot, n = _SLOT.unpack(self._router.recv())
        ring = self._recv_rings.get(str(inc.extra.get("ring")))
        if ring is None or slot >= ring.slots or n > ring.slot_bytes or off + n > inc.header.nbytes:
            self._fail(sink, key, TransferError(f"bad shm chunk: slot {slot}, {n} bytes at offset {off}"))
        data = ring.slot(slot, n)
        try:
            if inc.direct:
                write_layer_chunk(sink, inc.header, inc.block_ids, off, memoryview(data.numpy()))
            else:
                inc.staging[off:off + n].copy_(data)
        except TransferError as e:
            self._fail(sink, key, e)
        except Exception as e:
            self._fail(sink, key, TransferError(f"the sink failed to write: {e!r}"))
        inc.extra["chunks"] += 1
        self._reply(inc.identity, inc.xfer, FREED, {"n": inc.extra["chunks"]})
        return n

    def _on_recv_failure(self, inc: Incoming) -> None:
        ring = self._recv_rings.pop(str(inc.extra.get("ring")), None)
        if ring is not None:
            ring.close()

    def close(self) -> None:
        for peer in list(self._send_rings):
            self._drop_send_ring(peer)
        for ring in self._recv_rings.values():
            ring.close()
        self._recv_rings.clear()
        super().close()


def _frame_bytes(page_set: PageSet, chunk_bytes: int) -> int:
    if page_set.nbytes == 0:
        return 0
    lb = layer_bytes(page_set.header)
    return max(1, chunk_bytes // lb) * lb


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
