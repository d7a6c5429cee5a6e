"""Cross-memory attach: copy bytes straight out of another process's memory.

``process_vm_readv(2)`` moves bytes from a peer process's address space into ours in one
kernel copy, with no shared segment and no copy on the peer's side: the same-node path MPI
libraries (Open MPI's CMA, UCX's ``cma`` transport) use. The kernel allows it when the
caller may ptrace the peer: same user and no Yama restriction (``kernel.yama.ptrace_scope``
0), or root. Where it is not allowed the call fails with EPERM and ``ShmTransport`` uses its
shared-memory ring instead.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import Sequence

IOV_MAX = 1024


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


try:
    _readv = ctypes.CDLL(None, use_errno=True).process_vm_readv  # CDLL calls release the GIL
    _readv.restype = ctypes.c_ssize_t
    _readv.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.POINTER(_Iovec),
                       ctypes.c_ulong, ctypes.c_ulong]
except (OSError, AttributeError):  # not Linux / no libc symbol
    _readv = None


def available() -> bool:
    return _readv is not None


def read(pid: int, remote_addr: int, local: Sequence[tuple[int, int]]) -> int:
    """Fill the local ``(address, length)`` ranges, in order, from the peer's bytes starting at
    ``remote_addr``. Returns the bytes read; raises ``OSError`` (EPERM: not allowed here;
    ESRCH: the peer is gone; EFAULT: an address is not mapped) on any failure or short read."""
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    done = 0
    for i in range(0, len(local), IOV_MAX):
        batch = local[i:i + IOV_MAX]
        n = sum(length for _, length in batch)
        liov = (_Iovec * len(batch))(*[_Iovec(addr, length) for addr, length in batch])
        riov = _Iovec(remote_addr + done, n)
        got = _readv(pid, liov, len(batch), ctypes.byref(riov), 1, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"process_vm_readv from pid {pid}: {os.strerror(e)}")
        if got != n:
            raise OSError(errno.EFAULT, f"process_vm_readv from pid {pid} read {got} of {n} bytes")
        done += n
    return done
