"""Page-set buffers in shared memory, so a receiver on the same node can map and copy them.

A sender gathers a request's blocks into a contiguous page set before any transport sends it;
``SharedBuffers.take`` makes that gather land in a memfd segment instead of private memory. The
gather costs the same, and ``ShmTransport`` can then offer the segment instead of the bytes: the
receiver maps it read-only (``/proc/<pid>/fd/<fd>``, checked by inode) and copies the page set
into its blocks with one memcpy. Segments are reused (fresh memory costs a page fault per 4 KiB),
so the owner gives a buffer back explicitly once its transfers are over (``give``); a buffer that
is never given back is only never reused.

Only the gather buffers live here, not the engine's KV cache: shared memory does not get
transparent huge pages (``shmem_enabled`` is ``never`` by default), and the cache's attention
reads would pay for that on every step.
"""
from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch

ALIGN = 2 << 20  # segment sizes are multiples of this


@dataclass(frozen=True)
class SegmentRef:
    """Where a buffer lives, as a peer on this node can find it."""

    pid: int
    fd: int
    inode: int
    size: int  # bytes of the whole segment
    offset: int  # of the buffer inside it


class _Segment:
    def __init__(self, size: int):
        self.fd = os.memfd_create("thinkserve-kv-pageset", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except OSError:
            os.close(self.fd)
            raise
        self.size, self.inode = size, os.fstat(self.fd).st_ino
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.flat = torch.frombuffer(self.map, dtype=torch.uint8)
        self.flat.fill_(0)  # fault the pages in once, not in the first gather
        self.base = self.flat.data_ptr()

    def close(self) -> None:
        self.flat = None
        try:
            self.map.close()
        except BufferError:  # a tensor over it is still alive: the mapping goes with it
            pass
        os.close(self.fd)


class SharedBuffers:
    """A pool of memfd segments handing out flat uint8 buffers (thread-safe)."""

    def __init__(self, max_cached_bytes: int = 1 << 30):
        self._lock = threading.Lock()
        self._free: list[_Segment] = []
        self._used: dict[int, _Segment] = {}  # segment base address -> segment
        self._max = max_cached_bytes

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of ``nbytes`` in a shared segment (``give`` it back when done)."""
        with self._lock:
            seg = next((s for s in self._free if nbytes <= s.size <= 2 * nbytes + ALIGN), None)
            if seg is not None:
                self._free.remove(seg)
        if seg is None:
            seg = _Segment(max(ALIGN, -(-nbytes // ALIGN) * ALIGN))
        with self._lock:
            self._used[seg.base] = seg
        return seg.flat[:nbytes]

    def give(self, buf: torch.Tensor) -> None:
        """Return the buffer ``take`` handed out (any view of it); the caller stops using it."""
        with self._lock:
            seg = self._used.pop(buf.data_ptr(), None)
            if seg is None:
                raise ValueError("not a buffer of this pool (or given back twice)")
            self._free.append(seg)
            evict = []
            while sum(s.size for s in self._free) > self._max:
                evict.append(self._free.pop(0))
        for s in evict:
            s.close()

    def locate(self, t: torch.Tensor) -> SegmentRef | None:
        """The segment holding ``t``'s bytes when ``t`` is a contiguous CPU view into a buffer
        this pool handed out (and not given back), else ``None``."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        ptr, n = t.data_ptr(), t.numel() * t.element_size()
        with self._lock:
            for seg in self._used.values():
                if seg.base <= ptr and ptr + n <= seg.base + seg.size:
                    return SegmentRef(os.getpid(), seg.fd, seg.inode, seg.size, ptr - seg.base)
        return None


SHARED = SharedBuffers()  # one pool per process: what ShmTransport looks page sets up in


# ----------------------------------------------------------------------------- the other side
class ProcessGone(OSError):
    """The process that offered a segment has exited (or its pid now names another process)."""


class MapDenied(OSError):
    """This process may not open or map the offered segment (permissions, another node, bad offer)."""


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid it
    names one process, so a pid reused after its process died is not mistaken for it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


BOOT_ID = _boot_id()  # names this machine (this boot): a pid and an inode only mean something on it


def process_identity() -> dict:
    """This process as a peer on the same machine can check it: boot id, pid, start time."""
    return {"boot": BOOT_ID, "pid": os.getpid(), "start": start_time(os.getpid())}


def check_process(offer: dict) -> int:
    """The pid of the process an offer came from, if it runs on this machine and still lives.
    Raises ``MapDenied`` (another machine), ``ProcessGone`` (exited, or its pid reused)."""
    if not BOOT_ID or offer.get("boot") != BOOT_ID:
        raise MapDenied("the offer comes from another machine")
    try:
        pid = int(offer["pid"])
    except (KeyError, TypeError, ValueError):
        raise MapDenied(f"bad offer {offer!r}") from None
    if start_time(pid) != offer.get("start"):
        raise ProcessGone(f"process {pid} is gone")
    return pid


def segment_offer(ref: SegmentRef, nbytes: int) -> dict:
    """What a peer on this machine needs to map ``nbytes`` at ``ref`` (msgpack-able); ``ref`` is
    this process's (``SHARED.locate``)."""
    return {**process_identity(), "fd": ref.fd, "inode": ref.inode, "size": ref.size, "offset": ref.offset,
            "nbytes": nbytes}


class SegmentMaps:
    """Another process's segments, mapped here and cached by (pid, start time, fd, inode), so a
    reused segment is not re-faulted and a reused fd number is not mistaken for the old segment.
    Cached maps keep their segments alive after the owner lets go, so they are bounded in bytes,
    and a dead owner's maps are dropped whenever a new one is made."""

    def __init__(self, *, writable: bool, max_bytes: int = 2 << 30):
        self.writable = writable
        self.max_bytes = max_bytes
        self._maps: OrderedDict[tuple, mmap.mmap] = OrderedDict()

    def __len__(self) -> int:
        return len(self._maps)

    def view(self, offer: dict) -> torch.Tensor:
        """The offered bytes as a flat uint8 tensor over the mapping (read-only unless
        ``writable``; the caller must not keep it past the next ``view`` or ``close``).
        Raises ``ProcessGone``, ``MapDenied``."""
        try:
            fd, inode, size = int(offer["fd"]), int(offer["inode"]), int(offer["size"])
            off, nbytes = int(offer["offset"]), int(offer["nbytes"])
        except (KeyError, TypeError, ValueError):
            raise MapDenied(f"bad segment offer {offer!r}") from None
        if off < 0 or nbytes < 0 or off + nbytes > size:
            raise MapDenied(f"segment offer of {nbytes} bytes at {off} in a {size}-byte segment")
        pid = check_process(offer)
        key = (pid, offer.get("start"), fd, inode)
        mp = self._maps.get(key)
        if mp is not None:
            self._maps.move_to_end(key)
        else:
            mp = self._map(key, pid, fd, inode, size)
        with warnings.catch_warnings():  # a read-only mapping: the callers only read from it
            warnings.simplefilter("ignore")
            return torch.frombuffer(mp, dtype=torch.uint8, count=nbytes, offset=off) if nbytes else \
                torch.empty(0, dtype=torch.uint8)

    def _map(self, key: tuple, pid: int, fd: int, inode: int, size: int) -> mmap.mmap:
        for k in [k for k in self._maps if start_time(k[0]) != k[1]]:
            _close_map(self._maps.pop(k))
        try:
            f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR if self.writable else os.O_RDONLY)
        except OSError as e:
            raise MapDenied(f"cannot open the segment of process {pid}: {e}") from None
        try:
            st = os.fstat(f)
            if st.st_ino != inode or st.st_size != size:
                raise MapDenied(f"fd {fd} of process {pid} is not the offered segment "
                                f"(inode {st.st_ino}, {st.st_size} bytes)")
            mp = mmap.mmap(f, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0))
        except OSError as e:
            if isinstance(e, MapDenied):
                raise
            raise MapDenied(f"cannot map the segment of process {pid}: {e}") from None
        finally:
            os.close(f)
        self._maps[key] = mp
        while len(self._maps) > 1 and sum(len(m) for m in self._maps.values()) > self.max_bytes:
            _close_map(self._maps.popitem(last=False)[1])
        return mp

    def close(self) -> None:
        for mp in self._maps.values():
            _close_map(mp)
        self._maps.clear()


def _close_map(mp: mmap.mmap) -> None:
    try:
        mp.close()
    except BufferError:  # a tensor over it is still alive: the mapping goes with it
        pass
