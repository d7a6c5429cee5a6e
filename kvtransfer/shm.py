"""Same-node transport: the receiver copies page-set bytes out of the sender's memory (a mapped
shared segment, or ``process_vm_readv``), or, where neither is allowed, through a shared-memory
ring; never over loopback TCP. The three modes are listed in ``ShmTransport``'s docstring.

The conversation (offer / accept / done / fail, probes, deadlines) is ``conversation.ZmqTransport``'s;
only the bytes take another road. The ring, the fallback: loopback TCP costs two kernel copies;
here each side does one memcpy, and the two overlap::

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

import errno
import logging
import mmap
import os
import struct
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from . import cma
from .conversation import _U64, DATA, Incoming, PeerConnection, ZmqTransport
from .page_set import PageSet, PageSetHeader, block_ranges, layer_bytes
from .shared_buffers import (SHARED, MapDenied, ProcessGone, SegmentMaps, check_process, process_identity,
                             segment_offer)
from .transport import (PageSink, PairLost, PeerGone, Received, TransferConfig, TransferError, TransferRefused,
                        error_from_wire)

log = logging.getLogger(__name__)

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
    """The zmq conversation (``ZmqTransport``) with the bytes moved in memory (same node only).

    Three ways, the first that applies, per transfer:

    * **map** — the page set lives in a shared segment (``shared_buffers.SHARED``; the flows
      gather into one when they send over shm): the receiver maps the segment read-only and
      copies the page set into its blocks. One memcpy; the sender does nothing but wait.
    * **read** — any other host page set: the receiver copies it straight out of the sender's
      memory with ``process_vm_readv`` (``cma.py``). One copy, slower than a memcpy (the kernel
      pins the pages as it goes).
    * **ring** — the two-copy shared-memory ring described above: device page sets,
      ``direct_read=False``, and receivers that may not map or read the sender (EPERM: Yama
      ptrace restrictions, containers without the permission).

    A receiver that cannot do map or read answers ``PairLost``; the sender stops offering that
    mode to it and retries with the next one (tested). ``last_mode`` says what the last send used.
    """

    name = "shm"
    MODES = ("map", "read", "ring")
    maps_shared_buffers = True  # flows gather page sets into shared_buffers.SHARED for it

    def __init__(self, config: TransferConfig = TransferConfig(), *, bind: str | None = None, slots: int = 4,
                 direct_read: bool = True, read_threads: int = 2, max_mapped_bytes: int = 2 << 30):
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (one filling while one drains), got {slots}")
        if read_threads < 1:
            raise ValueError(f"read_threads must be >= 1, got {read_threads}")
        super().__init__(config, bind=bind)
        self.slots = slots
        self.direct_read = direct_read
        self.read_threads = read_threads
        self._send_rings: dict[str, tuple[_Ring, str, bool]] = {}  # peer -> (ring, id, receiver joined)
        self._recv_rings: dict[str, _Ring] = {}  # ring id -> ring
        self._refused: dict[str, set[str]] = {}  # peer -> modes it refused
        self._maps = SegmentMaps(writable=False, max_bytes=max_mapped_bytes)  # senders' segments
        self._sending: PageSet | None = None
        self._segment = None
        self._mode = "ring"
        self.last_mode: str | None = None
        self._pool: ThreadPoolExecutor | None = None

    # ---------------------------------------------------------------- sender
    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set"):
        self._sending = page_set
        try:
            for _ in self.MODES:
                self._mode = self._choose(peer, page_set)
                if self._mode == "ring":
                    self._ring_for(peer, page_set)
                try:
                    rec = super().send(peer, page_set, kind=kind)
                    self.last_mode = self._mode
                    return rec
                except PairLost as e:
                    if self._mode == "ring":  # the receiver restarted: it no longer maps our ring
                        self._drop_send_ring(peer)
                    else:  # it may not map / read our memory: the next mode, from now on
                        log.info("shm: %s refused %s mode (%s)", peer, self._mode, e)
                        self._refused.setdefault(peer, set()).add(self._mode)
            raise PairLost(f"{peer} refused every shm mode", peer=peer, request_id=page_set.header.request_id)
        finally:
            self._sending, self._segment = None, None

    def _choose(self, peer: str, page_set: PageSet) -> str:
        refused = self._refused.get(peer, set())
        if not self.direct_read or page_set.nbytes == 0 or page_set.kv.device.type != "cpu":
            return "ring"
        if "map" not in refused:
            self._segment = SHARED.locate(page_set.kv)
            if self._segment is not None:
                return "map"
        if "read" not in refused and cma.available() and page_set.kv.is_contiguous():
            return "read"
        return "ring"

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
        if self._mode == "map":
            return {"map": segment_offer(self._segment, self._sending.nbytes)}
        if self._mode == "read":
            return {"read": {**process_identity(), "addr": self._sending.kv.data_ptr(),
                             "nbytes": self._sending.nbytes}}
        ring, ring_id, joined = self._send_rings[peer]
        return {"ring": ring_id, "path": ring.path, "join": not joined, "slots": ring.slots,
                "slot_bytes": ring.slot_bytes}

    def _send_data(self, peer, conn: PeerConnection, xfer, page_set: PageSet, extra: dict, accept: dict) -> None:
        if "read" in extra or "map" in extra:  # the receiver copies from our memory; we wait for DONE
            return
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
        if "map" in ex:
            inc.extra["_mapped"] = self._map_for(inc)
            return {}
        if "read" in ex:
            self._check_read(inc)
            return {}
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

    # ---------------------------------------------------------------- receiver: direct read
    def _check_read(self, inc: Incoming) -> None:
        """Before accepting a read-mode offer: may we read the sender's memory at all? One
        byte tells (EPERM -> PairLost, the sender retries with the ring; ESRCH -> PeerGone)."""
        rd = inc.extra["read"]
        try:
            addr, nbytes = int(rd["addr"]), int(rd["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise TransferRefused(f"bad read-mode offer {rd!r}") from None
        if nbytes != inc.header.nbytes:
            raise TransferRefused(f"read-mode offer of {nbytes} bytes for a {inc.header.nbytes}-byte page set")
        if not self.direct_read:
            raise PairLost("this receiver does not read other processes' memory")
        try:
            pid = check_process(rd)
        except ProcessGone:
            raise PeerGone(f"the sender (pid {rd.get('pid')}) is gone", request_id=inc.header.request_id) from None
        except MapDenied as e:  # another machine
            raise PairLost(str(e)) from None
        probe = torch.empty(1, dtype=torch.uint8)
        try:
            cma.read(pid, addr, [(probe.data_ptr(), 1)])
        except OSError as e:
            if e.errno == errno.ESRCH:
                raise PeerGone(f"the sender (pid {pid}) is gone", request_id=inc.header.request_id) from None
            raise PairLost(f"cannot read the sender's memory: {e}") from None

    # ---------------------------------------------------------------- receiver: mapped segment
    def _map_for(self, inc: Incoming) -> torch.Tensor:
        """The offered page set, a read-only view of the sender's mapped segment. PeerGone when
        the sender is gone; PairLost when we may not map it."""
        m = inc.extra["map"]
        if m.get("nbytes") != inc.header.nbytes:
            raise TransferRefused(f"map-mode offer of {m.get('nbytes')} bytes for a {inc.header.nbytes}-byte page set")
        if not self.direct_read:
            raise PairLost("this receiver does not map other processes' memory")
        try:
            return self._maps.view(m)
        except ProcessGone:
            raise PeerGone(f"the sender (pid {m.get('pid')}) is gone", request_id=inc.header.request_id) from None
        except MapDenied as e:
            raise PairLost(str(e)) from None

    def _copy_mapped(self, sink: PageSink, inc: Incoming) -> None:
        h, src = inc.header, inc.extra.pop("_mapped")
        sink.write(h, inc.block_ids, src.view(h.dtype).view(h.shape))

    def _receive_data(self, sink: PageSink, key) -> Received | None:
        inc = self._incoming[key]
        if "map" in inc.extra:
            try:
                self._copy_mapped(sink, inc)
            except TransferError as e:
                self._fail(sink, key, e)
            except Exception as e:
                self._fail(sink, key, TransferError(f"copying from the sender's segment failed: {e!r}"))
            inc.received, inc.direct = inc.header.nbytes, True  # written: nothing left to stage
            return self._complete(sink, key)
        if "read" not in inc.extra:
            return None  # ring: the bytes arrive as DATA messages
        h, rd = inc.header, inc.extra["read"]
        pid, addr = int(rd["pid"]), int(rd["addr"])
        cache = sink.host_cache()
        staging = None
        if cache is not None and cache.device.type == "cpu" and cache.is_contiguous():
            base = cache.data_ptr()
            local = [(base + off, n) for off, n in block_ranges(cache, h, inc.block_ids, (0, h.layout.num_layers))]
        else:  # the offer's staging buffer when the transfer has one (a sink without layer_writes)
            staging = inc.staging if inc.staging.numel() >= h.nbytes else self._staging.take(h.nbytes)
            local = [(staging.data_ptr(), h.nbytes)]
        try:
            self._read(pid, addr, local)
            if staging is not None:
                sink.write(h, inc.block_ids, staging.view(h.dtype).view(h.shape))
        except OSError as e:
            err = (PeerGone(f"the sender (pid {pid}) is gone", request_id=h.request_id) if e.errno == errno.ESRCH
                   else TransferError(f"reading the sender's memory failed: {e}", request_id=h.request_id))
            self._fail(sink, key, err)
        except Exception as e:
            self._fail(sink, key, TransferError(f"the sink failed to write: {e!r}"))
        finally:
            if staging is not None and staging is not inc.staging:
                self._staging.give(staging)
        inc.received, inc.direct = h.nbytes, True  # written: nothing left to stage
        return self._complete(sink, key)

    def _read(self, pid: int, addr: int, local: list[tuple[int, int]]) -> None:
        """One ``process_vm_readv`` stream, or ``read_threads`` in parallel over byte-balanced
        parts of ``local`` (each its own remote range)."""
        parts = _split(local, self.read_threads)
        if len(parts) == 1:
            cma.read(pid, addr, local)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.read_threads, thread_name_prefix="kv-shm")
        futures, off = [], 0
        for part in parts:
            futures.append(self._pool.submit(cma.read, pid, addr + off, part))
            off += sum(n for _, n in part)
        for f in futures:
            f.result()

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
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        self._maps.close()
        for peer in list(self._send_rings):
            self._drop_send_ring(peer)
        for ring in self._recv_rings.values():
            ring.close()
        self._recv_rings.clear()
        super().close()


def layer_frames(page_set: PageSet, chunk_bytes: int) -> list[tuple[int, memoryview]]:
    """``(offset, view)`` frames of whole layers, about ``chunk_bytes`` each (at least one
    layer), zero-copy over the page set's tensor."""
    if page_set.nbytes == 0:
        return []
    per = max(1, chunk_bytes // layer_bytes(page_set.header)) * layer_bytes(page_set.header)
    frames = page_set.data_frames(per)
    return [(i * per, f) for i, f in enumerate(frames)]


def write_layer_chunk(sink: PageSink, header: PageSetHeader, block_ids: Sequence[int], off: int, buf) -> None:
    """Hand the bytes ``[off, off + len(buf))`` of the page set, whole layers, to the sink."""
    lb = layer_bytes(header)
    n = len(buf)
    if off % lb or n % lb or off + n > header.nbytes or n == 0:
        raise TransferError(f"chunk [{off}, {off + n}) is not layer-aligned or overruns the page set "
                            f"({header.nbytes} bytes, layers of {lb})", request_id=header.request_id)
    with warnings.catch_warnings():  # read-only frame memory; we only read from it
        warnings.simplefilter("ignore")
        data = torch.frombuffer(buf, dtype=torch.uint8)
    first = off // lb
    kv = data.view(header.dtype).view(n // lb, *header.shape[1:])
    sink.write_layers(header, block_ids, slice(first, first + n // lb), kv)


def _split(ranges: list[tuple[int, int]], parts: int) -> list[list[tuple[int, int]]]:
    """``ranges`` cut into at most ``parts`` consecutive groups of about equal bytes (a range
    may be split in two)."""
    total = sum(n for _, n in ranges)
    if parts <= 1 or total < parts * (1 << 20):
        return [list(ranges)]
    out, cur, cur_bytes, target = [], [], 0, -(-total // parts)
    for addr, n in ranges:
        while n:
            take = min(n, target - cur_bytes)
            cur.append((addr, take))
            cur_bytes, addr, n = cur_bytes + take, addr + take, n - take
            if cur_bytes == target:
                out.append(cur)
                cur, cur_bytes = [], 0
    if cur:
        out.append(cur)
    return out


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
