"""Typed messages between the cluster's actors (instances, controller, frontend): all of them.

Frozen dataclasses of ints, strings, tuples and the engine's own frozen types (``SamplingParams``,
``EngineConfig``, ``SwappedRequest``). They cross process boundaries only through Ray's own object
transport inside the cluster; nothing here is read from a network port.

Refusals and errors carry an enum kind (``Refusal``, ``ErrorKind``) and a human message; nobody
parses a message to learn what happened.

    frontend ──add_part / resume_part──▶ instance      ◀── Admission / ResumeAdmission
    frontend ──send_part(SendTarget…)──▶ instance      ◀── SendOutcome(SendResult…)
    frontend ──swap_out_part──▶ instance               ◀── ParkedPart | None
    frontend ──swap_in_part(ParkedPart)──▶ instance    ◀── Admission
    frontend ──poll(timeout, PrefixCursor)──▶ instance ◀── PollResult(PartDelta…, InstanceStats, PrefixDelta)
    frontend ──prefix_blocks(namespace, PrefixCursor)──▶ node store ◀── PrefixDelta
    admin RPC ──scale_pool / drain_instance──▶ controller ◀── ScaleResult / DrainResult
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from thinkserve.kvtransfer.flows import SwappedRequest
from thinkserve.kvtransfer.telemetry import TransferTotals
from thinkserve.router.snapshot import DRAINING as DRAINING_STATE
from thinkserve.router.snapshot import SERVING as SERVING_STATE
from thinkserve.router.snapshot import InstanceSnapshot
from thinkserve.workers.prefix_journal import PrefixDelta


@dataclass(frozen=True)
class BranchDelta:
    """New output tokens of one branch. ``start`` is the branch's output length before them, so a
    receiver can place them exactly (and drop a repeat after a move)."""

    index: int
    start: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None   # "stop" | "length" | "abort" once finished
    # The engine's final hidden state at the position that sampled the last of ``token_ids``
    # (the Conductor's length probe), when the engine's hidden_state_interval selected this step.
    hidden_state: tuple[float, ...] | None = None


@dataclass(frozen=True)
class PartDelta:
    """What one engine step did for one *part* (an engine-level request: the branches of a user
    request that live on this instance)."""

    part_id: str
    branches: tuple[BranchDelta, ...]
    prefilled: bool = False           # prefill role: prompt computed, waiting to be exported
    finished: bool = False            # every branch of the part finished; the engine freed it


@dataclass(frozen=True)
class InstanceStats:
    instance_id: str
    num_waiting: int = 0
    num_running: int = 0
    num_swapped: int = 0
    num_held: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    generated_tokens: int = 0
    num_parts: int = 0
    admitting: bool = True
    steps: int = 0
    prefix_cache_hit_rate: float = 0.0   # the engine's: hit blocks / looked-up full prompt blocks
    store_prefix_blocks: int = 0      # blocks loaded from the CPU store into the prefix cache before a prefill
    recomputed_tokens: int = 0        # KV tokens preemption dropped to recompute (cumulative)
    num_preemptions: int = 0          # the engine's, since it started: swapped out + recomputed
    store_swap_outs: int = 0          # preemptions swapped to the node's CPU store (cumulative)
    store_swap_refused: int = 0       # ... that the store refused (full or unreachable): recomputed instead
    num_recompute_preemptions: int = 0  # of num_preemptions, those that dropped the KV (the rest swapped)
    queued_prefill_tokens: int = 0    # prompt tokens waiting to be computed (the Conductor's TTFT estimate)
    num_running_seqs: int = 0         # branches in the batch
    # KV moves this instance's process made since it started, per (kind, transport): sends
    # (handoff / fanout / migrate), page sets received ("page_set"), store swaps and prefixes
    kv_transfers: tuple[TransferTotals, ...] = ()
    # Decode-only engine steps since it started (the Conductor's TPOT fit): how many, their
    # seconds together (lock wait and publishing included, as a client sees them), and the
    # branches they carried together.
    decode_steps: int = 0
    decode_step_seconds: float = 0.0
    decode_step_seqs: int = 0


@dataclass(frozen=True)
class StepSample:
    """One engine step (``step_telemetry``): start (``time.monotonic()``), duration including
    publishing its outputs, and its batch shape (``StepPlan.batch_shape``)."""

    start: float
    duration: float
    prefill_tokens: int
    prefill_ctx: int
    num_decode: int
    decode_ctx: int


@dataclass(frozen=True)
class PartTiming:
    """When a part reached the engine, and when its first token and its end were published."""

    part_id: str
    added: float
    first_token: float | None
    finished: float | None


@dataclass(frozen=True)
class StepTrace:
    instance_id: str
    steps: tuple[StepSample, ...]
    parts: tuple[PartTiming, ...]


@dataclass(frozen=True)
class PollResult:
    deltas: tuple[PartDelta, ...]
    stats: InstanceStats
    # The prefix blocks its engine cached and evicted since the poller's ``PrefixCursor`` (taken
    # after ``deltas``: a prompt whose prefill a delta reports is in it); None when not asked.
    prefix: PrefixDelta | None = None


@dataclass(frozen=True)
class InstanceInfo:
    """What an instance reports once its weights are loaded."""

    instance_id: str
    pool: str
    role: str
    node_id: str
    kv_address: str                   # where peers send it page sets (kvtransfer TCP endpoint)
    num_total_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    shm_address: str = ""             # its same-node shared-memory endpoint ("" when kv_transport is tcp)
    store_address: str = ""           # the CPU KV store of its node ("" when it has none)
    collective_address: str = ""      # its pair-group endpoint ("" unless kv_transport is collective)
    prefix_namespace: str = ""        # its model/KV layout's namespace in the CPU store (prefix blocks)
    max_num_seqs: int = 0             # its engine's batch cap (the Conductor's free batch slots)
    cpus: tuple[int, ...] = ()        # the cores its engine thread runs on (() any)

    def kv_endpoint(self, transport: str) -> str:
        return {"shm": self.shm_address, "collective": self.collective_address}.get(transport, self.kv_address)


class Refusal(enum.Enum):
    """Why an instance did not take a part."""

    NONE = "none"
    DRAINING = "draining"             # not admitting (draining or shutting down): go elsewhere
    DUPLICATE = "duplicate"           # the part id is already there
    INVALID = "invalid"               # the engine refused the request's parameters: the client's error
    NO_ROOM = "no_room"               # not enough free KV blocks now
    NO_STORE = "no_store"             # parked KV names a store this instance cannot reach
    STORE_FAILED = "store_failed"     # the store did not give the parked blocks back


@dataclass(frozen=True)
class Admission:
    ok: bool
    refusal: Refusal = Refusal.NONE
    detail: str = ""                  # human-readable, for logs and the client (INVALID)

    @classmethod
    def refused(cls, refusal: Refusal, detail: str = "") -> "Admission":
        return cls(False, refusal, detail)


@dataclass(frozen=True)
class ResumeAdmission(Admission):
    recomputed_tokens: int = 0        # tokens the instance recomputes (prompt + outputs − store prefix)


class ErrorKind(enum.Enum):
    """What went wrong with an admin call or a request, mapped onto a status code by the frontend."""

    NOT_FOUND = "not_found"
    INVALID = "invalid"               # the caller's input
    UNAVAILABLE = "unavailable"       # nothing can serve it now
    EXHAUSTED = "exhausted"           # refused at admission: its SLO target cannot be met now
    FAILED = "failed"                 # the cluster tried and failed (instances did not start, a crash)


@dataclass(frozen=True)
class Failure:
    kind: ErrorKind
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ScaleResult:
    ok: bool
    error: Failure | None = None
    added: int = 0
    removed: int = 0
    migrated: int = 0
    serving: int = 0
    version: int = 0             # membership version that includes the change


@dataclass(frozen=True)
class DrainResult:
    ok: bool
    error: Failure | None = None
    migrated: int = 0


# ----------------------------------------------------------------------------- KV moves
@dataclass(frozen=True)
class SendTarget:
    """One receiver of a part's KV: its endpoint, the part id it will know the branches by, and
    which of the sender's transports carries them."""

    kv_address: str
    part_id: str
    branch_indices: tuple[int, ...]
    transport: str = "tcp"          # "tcp" | "shm" | "collective"


@dataclass(frozen=True)
class SendResult:
    part_id: str
    ok: bool
    error: str = ""
    peer_gone: bool = False      # the receiver's process is gone or silent (not merely full)
    no_room: bool = False        # the receiver cannot take the branches now (batch or KV full): not a failure
    bytes: int = 0
    seconds: float = 0.0
    transport: str = "tcp"


@dataclass(frozen=True)
class SendOutcome:
    outputs: tuple[tuple[int, tuple[int, ...]], ...]   # (branch, output tokens) at export time
    results: tuple[SendResult, ...]
    # False: the part could not be exported (it finished or was aborted there since the frontend
    # chose to move it): nothing was sent, and it stays where it is until its poll reports the end.
    exported: bool = True


@dataclass(frozen=True)
class ParkedPart:
    """A part whose KV waits, pinned, in a node's CPU store (a drain with nowhere to migrate).

    ``swapped`` brings it back on any instance of the model; ``store`` is the address of the store
    that holds it (the swap-in may run on another node); ``discard_keys`` are the blocks to delete
    if it never comes back (its prompt's full blocks stay, as prefix hits for other requests)."""

    swapped: SwappedRequest
    store: str
    discard_keys: tuple[int, ...] = ()

    @property
    def branch_indices(self) -> tuple[int, ...]:
        return tuple(b.index for b in self.swapped.exported.branches)

    def outputs(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(branch, output tokens) at swap-out time."""
        return tuple((b.index, tuple(int(t) for t in b.output_token_ids)) for b in self.swapped.exported.branches)


@dataclass
class Member:
    """The controller's record of one instance (the handle travels to the frontend)."""

    instance_id: str
    pool: str
    state: str
    handle: object = field(repr=False, default=None)
    info: InstanceInfo | None = None
    created_at: float = 0.0
    error: str = ""
    cpus: tuple[int, ...] = ()        # the cores its engine thread runs on (pools.<name>.cpus; () any)

    def snapshot(self, stats: "InstanceStats | None", assigned_requests: int = 0,
                 assigned_branches: int = 0, queued_prefill_tokens: int = 0,
                 serving: bool = True) -> InstanceSnapshot:
        """What the router sees of it: its stats, the load the frontend placed there, the prompt
        tokens the frontend knows are queued there if more than the engine reported, and its
        state (draining when the frontend no longer places there: ``serving`` False)."""
        s = stats or InstanceStats(self.instance_id)
        info = self.info
        state = DRAINING_STATE if not serving and self.state == SERVING_STATE else self.state
        # positional: the frontend builds one per poll that changed what placement reads
        return InstanceSnapshot(self.instance_id, self.pool, state, s.num_waiting, s.num_running,
                                s.num_free_blocks, s.num_total_blocks, assigned_requests, assigned_branches,
                                max(s.queued_prefill_tokens, queued_prefill_tokens),
                                info.block_size if info is not None else 16, info.node_id if info is not None else "",
                                0, s.num_running_seqs, info.max_num_seqs if info is not None else 0)


@dataclass(frozen=True)
class StoreInfo:
    """One node's CPU KV store (``KVStoreActor``)."""

    node_id: str
    address: str
    handle: object = field(repr=False, default=None, compare=False)


@dataclass(frozen=True)
class Membership:
    version: int
    members: tuple[Member, ...]
    targets: tuple[tuple[str, int], ...]   # (pool, target replicas)
    stores: tuple[StoreInfo, ...] = ()     # one per node
