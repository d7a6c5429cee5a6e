"""Transfer telemetry: what each KV move cost, and the running totals an instance reports.

A ``TransferRecord`` says what moved (bytes, blocks), how (transport, kind), to whom and how
long it took; every flow adds its records to the process's ``TELEMETRY``, whose totals per
(kind, transport) an instance reports in its stats and the frontend exports as metrics.
"""
from __future__ import annotations

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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gbps"] = self.gbps
        return d


@dataclass(frozen=True)
class TransferTotals:
    """Running totals of one (kind, transport) in one process since it started."""

    kind: str
    transport: str
    count: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0


class TelemetryLog:
    """Thread-safe running totals per (kind, transport) of the records added."""

    def __init__(self):
        self._totals: dict[tuple[str, str], list] = {}  # -> [count, failures, bytes, seconds]
        self._lock = threading.Lock()

    def add(self, record: TransferRecord) -> TransferRecord:
        with self._lock:
            t = self._totals.get((record.kind, record.transport))
            if t is None:
                t = self._totals[(record.kind, record.transport)] = [0, 0, 0, 0.0]
            t[0] += 1
            t[1] += 0 if record.ok else 1
            t[2] += record.bytes
            t[3] += record.seconds
        return record

    def totals(self) -> tuple[TransferTotals, ...]:
        """Every (kind, transport) seen, in that order."""
        with self._lock:
            return tuple(TransferTotals(k, tr, c, f, b, s) for (k, tr), (c, f, b, s) in sorted(self._totals.items()))


#: Process-wide totals the flows add to. An instance actor (one engine per process) reports them
#: in its ``InstanceStats.kv_transfers``; the frontend exports them per instance
#: (``thinkserve_instance_kv_transfer*``; docs/interfaces.md).
TELEMETRY = TelemetryLog()
