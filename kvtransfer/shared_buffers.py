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

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self._free) + sum(s.size for s in self._used.values())


SHARED = SharedBuffers()  # one pool per process: what ShmTransport looks page sets up in
