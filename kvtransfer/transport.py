"""The transport interface: send a page set to a peer; receive one into blocks a sink allocates.

Every transport speaks the same three-step conversation, whatever carries the bytes::

    sender                                   receiver (PageSink = the engine's block pool)
      OFFER(header) ───────────────────────▶  fingerprint check, sink.allocate(header)
                    ◀─────────────────────── ACCEPT | REFUSE(FingerprintMismatch | NoRoom)
      bytes (zmq frames / shm / gloo) ─────▶  sink.write_layers per chunk, or staged + sink.write
                    ◀─────────────────────── DONE (sink.commit) | FAIL (sink.abort)

The offer comes first so a refused page set costs one round trip, not its bytes, and so the
receiver owns its blocks before a byte lands. A transfer that stalls or whose peer dies is
aborted on both sides within ``TransferConfig.timeout_s``; the receiver frees what it allocated
(``sink.abort``) and the sender keeps its source blocks, so the caller can retry or recompute.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from thinkserve.workers.kv_cache import KVFingerprint

from .page_set import PageSet, PageSetHeader, fingerprint_diff
from .telemetry import TransferRecord


# ----------------------------------------------------------------------------- errors
class TransferError(RuntimeError):
    """A page set did not arrive. The sender still holds its blocks; the receiver freed its own."""

    def __init__(self, message: str, *, peer: str = "", request_id: str | None = None):
        super().__init__(message)
        self.peer = peer
        self.request_id = request_id


class TransferTimeout(TransferError):
    """No progress within ``TransferConfig.timeout_s`` (peer hung, partitioned or too slow)."""


class PeerGone(TransferError):
    """The peer's connection closed mid-transfer (its process died or it shut down)."""


class TransferRefused(TransferError):
    """The receiver refused the offer before any byte moved."""


class FingerprintMismatch(TransferRefused):
    """The page set was produced by a model / KV layout the receiving engine does not run."""


class NoRoom(TransferRefused):
    """The receiving engine had no free blocks for the page set (capacity, not a fault)."""


class PairLost(TransferRefused):
    """The receiver no longer has the collective pair group the sender used; re-form it."""


_ERRORS = {cls.__name__: cls for cls in
           (TransferError, TransferTimeout, PeerGone, TransferRefused, FingerprintMismatch, NoRoom, PairLost)}


def error_to_wire(err: BaseException) -> dict:
    name = type(err).__name__ if type(err).__name__ in _ERRORS else "TransferError"
    return {"type": name, "message": str(err)}


def error_from_wire(d: dict, *, peer: str, request_id: str | None) -> TransferError:
    cls = _ERRORS.get(str(d.get("type")), TransferError)
    return cls(f"peer {peer} refused or failed: {d.get('message', '')}", peer=peer, request_id=request_id)


# ----------------------------------------------------------------------------- config
@dataclass(frozen=True)
class TransferConfig:
    """Knobs every transport shares. Timeouts are seconds, and they bound every wait."""

    timeout_s: float = 10.0  # no progress for this long = failure (both sides)
    # The sender's wait for DONE also allows nbytes / min_bandwidth, so a large page set over a
    # slow link is not declared dead while bytes still flow.
    min_bandwidth_bytes_per_s: float = 100e6
    chunk_bytes: int = 8 << 20  # bytes per shm ring slot or per collective op
    tcp_streams: int = 2  # TCP connections per sender->receiver pair, each a range of layers
    host: str = "127.0.0.1"  # interface the receiver (and collective pair stores) bind to

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if not self.min_bandwidth_bytes_per_s > 0:
            raise ValueError(f"min_bandwidth_bytes_per_s must be > 0, got {self.min_bandwidth_bytes_per_s}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if not 1 <= self.tcp_streams <= 16:
            raise ValueError(f"tcp_streams must be in [1, 16], got {self.tcp_streams}")

    def completion_timeout(self, nbytes: int) -> float:
        return self.timeout_s + nbytes / self.min_bandwidth_bytes_per_s


# ----------------------------------------------------------------------------- sink
class PageSink(ABC):
    """Where a received page set lands: a pool of KV blocks (an engine, or a plain tensor pool).

    The transport calls ``allocate`` once per offer, then either ``write`` (or, when
    ``layer_writes``, ``write_layers`` once per arriving chunk) and ``commit``, or ``abort``. ``abort`` must free everything ``allocate`` reserved.
    """

    fingerprint: KVFingerprint
    #: True when the sink implements ``write_layers``: a transport then copies each arriving
    #: chunk (whole layers) straight into the blocks, with no whole-page-set staging buffer.
    layer_writes: bool = False

    @abstractmethod
    def allocate(self, header: PageSetHeader) -> Sequence[int] | None:
        """Reserve ``header.num_blocks`` blocks; ``None`` when there is no room."""

    @abstractmethod
    def write(self, header: PageSetHeader, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Copy ``kv`` ([L, 2, n, bs, H, D]) into the reserved blocks. ``kv`` is only valid
        during the call (it may be a staging buffer the transport reuses)."""

    def host_cache(self) -> torch.Tensor | None:
        """The sink's whole KV cache when it is one C-contiguous CPU tensor in the page-set
        layout [L, 2, N, bs, H, D] and ``allocate``'s ids index its dim 2: the TCP transport
        then receives the bytes straight into the allocated blocks (no staging, no ``write``).
        ``None`` (the default, and any device cache): the transport calls ``write`` /
        ``write_layers``. Writes land only in blocks ``allocate`` reserved."""
        return None

    def write_layers(self, header: PageSetHeader, block_ids: Sequence[int], layers: slice,
                     kv: torch.Tensor) -> None:
        """Copy part of the page set: ``kv`` is [len(layers), 2, n, bs, H, D], the layers
        ``layers`` (step 1) of every block. Only called when ``layer_writes`` is True; then
        ``write`` is not called. ``kv`` is only valid during the call."""
        raise NotImplementedError

    @abstractmethod
    def commit(self, header: PageSetHeader, block_ids: Sequence[int]) -> None:
        """The page set is complete (e.g. the imported request starts decoding)."""

    @abstractmethod
    def abort(self, header: PageSetHeader, block_ids: Sequence[int]) -> None:
        """Free the reserved blocks; the transfer failed part-way."""

    def check(self, header: PageSetHeader) -> None:
        """Refuse a page set from another model or KV layout, naming the differing fields."""
        diff = fingerprint_diff(header.fingerprint, self.fingerprint)
        if diff:
            raise FingerprintMismatch(
                "page set fingerprint does not match the receiving engine: " + "; ".join(diff),
                request_id=header.request_id)


@dataclass(frozen=True)
class Received:
    """What ``Transport.recv`` returns: the header, where its pages went, and telemetry."""

    header: PageSetHeader
    block_ids: tuple[int, ...]
    record: TransferRecord


# ----------------------------------------------------------------------------- transport
class Transport(ABC):
    """One endpoint: it can send page sets to peers and receive page sets from them.

    ``address`` is what peers pass to ``send``. Not thread-safe: one thread per endpoint.
    """

    name: str
    address: str

    @abstractmethod
    def send(self, peer: str, page_set: PageSet, *, kind: str = "page_set") -> TransferRecord:
        """Deliver ``page_set`` to the endpoint at ``peer`` and wait until the receiver wrote
        and committed every block. Raises a ``TransferError`` subclass; never hangs longer than
        ``config.completion_timeout(nbytes)`` plus connection setup bounded by ``timeout_s``."""

    @abstractmethod
    def recv(self, sink: PageSink, *, timeout_s: float | None = None) -> Received:
        """Receive the next complete page set into blocks ``sink`` allocates.

        Raises ``TransferTimeout`` when nothing completes within ``timeout_s`` (default: the
        config's), and the typed error of a transfer that failed or was refused (its blocks
        already freed through ``sink.abort``)."""

    @abstractmethod
    def close(self) -> None:
        """Release sockets and pair groups. In-flight receives are aborted through their sink."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
