"""Per-request transfer telemetry: plain data the router and the metrics exporter consume.

A ``TransferRecord`` says what moved (bytes, blocks), how (transport, kind), to whom and how
long it took; ``share_of_ttft`` puts it against the request's time to first token, the figure
that says whether disaggregation paid for this request.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import asdict, dataclass

KINDS = ("page_set", "handoff", "fanout", "migrate", "swap_out", "swap_in", "prefix_put", "prefix_get",
         "store_put", "store_get")


@dataclass(frozen=True)
class TransferRecord:
    kind: str  # one of KINDS
    transport: str  # "tcp" | "gloo" | "nccl" | "store"
    peer: str  # address of the other side
    request_id: str | None
    num_blocks: int
    bytes: int
    seconds: float  # wall time of the whole transfer, handshake to acknowledgement
    started_at: float  # time.time() when it began
    ok: bool = True
    error: str | None = None  # the TransferError subclass name when not ok

    @property
    def gbps(self) -> float:
        """Goodput in GB/s (10^9 bytes)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def share_of_ttft(self, ttft_s: float) -> float:
        """Fraction of the request's time to first token spent moving this KV."""
        if ttft_s <= 0:
            raise ValueError(f"ttft_s must be > 0, got {ttft_s}")
        return self.seconds / ttft_s

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d


class TelemetryLog:
    """Bounded, thread-safe ring of recent records plus running totals per (kind, transport)."""

    def __init__(self, maxlen: int = 4096):
        self._records: collections.deque[TransferRecord] = collections.deque(maxlen=maxlen)
        self._totals: dict[tuple[str, str], list[float]] = {}  # -> [count, failures, bytes, seconds]
        self._lock = threading.Lock()

    def add(self, record: TransferRecord) -> TransferRecord:
        with self._lock:
            self._records.append(record)
            t = self._totals.setdefault((record.kind, record.transport), [0, 0, 0, 0.0])
            t[0] += 1
            t[1] += 0 if record.ok else 1
            t[2] += record.bytes
            t[3] += record.seconds
        return record

    def recent(self, request_id: str | None = None) -> list[TransferRecord]:
        with self._lock:
            return [r for r in self._records if request_id is None or r.request_id == request_id]

    def totals(self) -> dict[str, dict]:
        with self._lock:
            return {f"{k}/{tr}": {"count": int(c), "failures": int(f), "bytes": int(b), "seconds": s}
                    for (k, tr), (c, f, b, s) in self._totals.items()}


#: Process-wide log the flows append to; the cluster layer reads and exports it.
TELEMETRY = TelemetryLog()
