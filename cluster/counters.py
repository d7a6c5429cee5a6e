"""The frontend's running totals of what happened to requests and KV moves (read by ``status``,
``thinkserve debug`` (Admin.GetDebugState) and the metrics). Plain ints with names; the orchestrator increments them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVSendCounts:
    """Page sets sent between instances over one transport, and their bytes."""

    sends: int = 0
    bytes: int = 0
    seconds: float = 0.0        # time the sends took (bytes / seconds: the transport's GB/s)


TRANSPORTS = ("tcp", "shm", "collective")     # the instance-to-instance KV transports counted


@dataclass
class Counters:
    completed: int = 0          # requests that finished and were answered
    failed: int = 0             # requests that ended with an error
    aborted: int = 0            # cancelled, past their deadline, or aborted by the client
    rejected: int = 0           # refused at the door (bad field, queue full)
    resumed: int = 0            # parts resumed elsewhere (recompute or swap-in of parked KV)
    migrated: int = 0           # parts moved to a peer with their KV (drain or rebalancing)
    rebalanced: dict[str, int] = field(default_factory=dict)   # pool -> parts moved by rebalancing
    admission_refused: int = 0  # refused at admission by the Conductor (an SLO target cannot be met)
    promotions_out: dict[str, int] = field(default_factory=dict)   # pool -> parts promoted out (short -> long)
    promotions_in: dict[str, int] = field(default_factory=dict)    # pool -> parts promoted in
    local_prefills: dict[str, int] = field(default_factory=dict)   # pool -> prompts its decode instances prefilled
    parked_released: int = 0    # parked KV unpinned because it will not come back
    promoted: int = 0           # requests with a branch promoted short_decode -> long_decode
    cancelled_branches: int = 0  # Best-of-N branches stopped (or never started) because the vote was decided
    wave_branches_forked: int = 0  # later-wave branches started from a reserve (prompt KV held where wave 1 ran)
    reserves_reclaimed: int = 0    # reserves an engine freed because it needed the blocks
    kv_tcp: KVSendCounts = field(default_factory=KVSendCounts)
    kv_shm: KVSendCounts = field(default_factory=KVSendCounts)
    kv_collective: KVSendCounts = field(default_factory=KVSendCounts)

    def transport(self, name: str) -> KVSendCounts:
        """The send counts of transport ``name`` ("tcp" | "shm" | "collective")."""
        counts = {"tcp": self.kv_tcp, "shm": self.kv_shm, "collective": self.kv_collective}.get(name)
        if counts is None:
            raise ValueError(f"unknown KV transport {name!r}")
        return counts

    def count_send(self, transport: str, nbytes: int, seconds: float = 0.0) -> None:
        c = self.transport(transport)
        c.sends += 1
        c.bytes += nbytes
        c.seconds += seconds
