"""The KV flows, each one function over engines, transports and the store.

The cluster's KV endpoint (``cluster/kv_endpoint.py``) is built from the primitives here:
``export_for`` once per part, ``send_share`` per target (it keeps the export until the frontend
releases it, so a failed target can be retried); on the receiving side ``receive`` into an
``EngineSink`` per incoming page set; and ``swap_out`` / ``swap_in`` / ``store_prefix`` /
``load_prefix`` as they are.

    handoff     prefill ──page set──▶ decode             (sender: ``export_for`` + ``send_share`` with
                                                          every branch; receiver: ``receive``)
    fan-out     prefill ──▶ decode_1 .. decode_K          Best-of-N: one ``send_share`` per instance with
                                                          only its branches' blocks; the shared prefix once
    migrate     decode ──page set──▶ decode               a running request moves (e.g. short → long pool)
    swap_out /  decode ──blocks──▶ CPU KV store ──▶ decode (any instance of the same model)
    swap_in
    store_prefix / load_prefix                            prefix reuse across instances

Engine calls used (docs/interfaces.md): ``fingerprint, export_request, read_blocks,
release_request, import_request, write_blocks (per layer chunk on receive), commit_import,
abort_import, export_prefix, import_prefix``; ``resume_request`` is the caller's after a failure.

Failure contract: a sender-side flow that raises leaves the source request *exported* (its
blocks still held, not scheduled) and attaches ``err.exported`` so the caller can retry on
another instance, or fall back to recompute with ``send_exported(..., exported.without_kv())``;
it then calls ``engine.release_request``, or ``engine.resume_request`` to keep decoding it in
place. The receiving engine has already freed its blocks.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from thinkserve.workers.block_hash import hash_block, hash_blocks
from thinkserve.workers.kv_cache import KVFingerprint
from thinkserve.workers.outputs import ExportedRequest

from .page_set import PageSet, PageSetHeader, fingerprint_namespace
from .shared_buffers import SHARED
from .store import BlockStoreAPI
from .telemetry import TELEMETRY, TransferRecord
from .transport import NoRoom, PageSink, Received, Transport, TransferError, TransferRefused


class Engine(Protocol):  # the subset of workers.engine.LLMEngine the flows use
    def fingerprint(self) -> KVFingerprint: ...
    def export_request(self, request_id: str) -> ExportedRequest: ...
    def read_blocks(self, block_ids: Sequence[int], device=None, *, out=None) -> torch.Tensor: ...
    def release_request(self, request_id: str) -> None: ...
    def import_request(self, exported: ExportedRequest) -> list[int] | None: ...
    def write_blocks(self, block_ids: Sequence[int], data: torch.Tensor, *, layers: slice | None = None) -> None: ...
    def resume_request(self, request_id: str) -> None: ...
    def commit_import(self, request_id: str) -> None: ...
    def abort_import(self, request_id: str) -> None: ...
    def export_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], torch.Tensor]: ...
    def import_prefix(self, token_ids: Sequence[int], hashes: list[int], data: torch.Tensor) -> int: ...


# ----------------------------------------------------------------------------- page sets of requests
def request_page_set(fingerprint: KVFingerprint, exported: ExportedRequest, kv: torch.Tensor | None) -> PageSet:
    """The page set that carries ``exported`` and its blocks (``kv`` in ``exported.block_ids`` order)."""
    bs = fingerprint.layout.block_size
    if kv is None:
        kv = torch.empty(fingerprint.layout.shape(0), dtype=fingerprint.layout.torch_dtype)
    computed = max((b.num_computed_tokens for b in exported.branches), default=0)
    header = PageSetHeader(fingerprint, len(exported.block_ids), exported.prompt_token_ids,
                           hash_blocks(exported.prompt_token_ids, bs), computed, exported.request_id,
                           exported.to_dict())
    return PageSet(header, kv)


def send_exported(transport: Transport, peer: str, fingerprint: KVFingerprint, exported: ExportedRequest,
                  kv: torch.Tensor | None = None, *, kind: str = "handoff") -> TransferRecord:
    """Send an already exported request (``kv=None`` with ``exported.without_kv()``: recompute)."""
    ps = request_page_set(fingerprint, exported, kv)
    return _sent(transport, peer, ps, kind)


def _sent(transport: Transport, peer: str, ps: PageSet, kind: str) -> TransferRecord:
    t0, wall0 = time.perf_counter(), time.time()
    try:
        return TELEMETRY.add(transport.send(peer, ps, kind=kind))
    except TransferError as e:
        TELEMETRY.add(TransferRecord(kind, transport.name, peer, ps.header.request_id, ps.header.num_blocks,
                                     ps.nbytes, time.perf_counter() - t0, wall0, ok=False, error=type(e).__name__))
        raise


def _export(engine: Engine, request_id: str) -> tuple[ExportedRequest, torch.Tensor]:
    exported = engine.export_request(request_id)
    return exported, engine.read_blocks(exported.block_ids)


def page_buffer(transport: Transport | None, fingerprint: KVFingerprint, num_blocks: int) -> torch.Tensor | None:
    """A [L, 2, n, ...] tensor in a shared segment when ``transport`` can hand a same-node
    receiver the segment instead of the bytes (``ShmTransport``), else ``None``. Give it back
    with ``SHARED.give`` once its transfers are over."""
    if not getattr(transport, "maps_shared_buffers", False) or num_blocks == 0:
        return None
    lay = fingerprint.layout
    return SHARED.take(num_blocks * lay.bytes_per_block).view(lay.torch_dtype).view(lay.shape(num_blocks))


def gather_blocks(engine: Engine, transport: Transport | None, block_ids: Sequence[int]) -> tuple[torch.Tensor, bool]:
    """The blocks as a page-set tensor: gathered into a shared buffer when ``transport`` maps
    them (second value True: give it back), else a plain copy."""
    buf = page_buffer(transport, engine.fingerprint(), len(block_ids))
    if buf is None:
        return engine.read_blocks(block_ids), False
    try:
        return engine.read_blocks(block_ids, out=buf), True
    except BaseException:
        SHARED.give(buf)
        raise


def select_blocks(kv: torch.Tensor, positions: Sequence[int], transport: Transport,
                  fingerprint: KVFingerprint) -> tuple[torch.Tensor, bool]:
    """``kv[:, :, positions]`` as a page-set tensor for ``transport``: copied into a shared buffer
    when it maps them (second value True: give it back), else a plain copy."""
    idx = torch.as_tensor(list(positions), dtype=torch.long)
    buf = page_buffer(transport, fingerprint, len(idx))
    if buf is None:
        return kv.index_select(2, idx), False
    try:
        return torch.index_select(kv, 2, idx, out=buf), True
    except BaseException:
        SHARED.give(buf)
        raise


# ----------------------------------------------------------------------------- one export, many shares
@dataclass
class Export:
    """A request exported once (its blocks held, not scheduled) with its blocks gathered into
    ``kv``, in ``exported.block_ids`` order; in a shared segment when ``shared`` (give it back
    with ``release_buffer`` once every send from it is over)."""

    exported: ExportedRequest
    kv: torch.Tensor
    shared: bool = False

    def release_buffer(self) -> None:
        if self.shared:
            SHARED.give(self.kv)
            self.shared = False


def export_for(engine: Engine, request_id: str, transport: Transport | None = None) -> Export:
    """Export ``request_id`` and gather its blocks, into a shared segment when ``transport``
    maps them (a same-node receiver then maps the segment instead of copying bytes)."""
    exported = engine.export_request(request_id)
    kv, shared = gather_blocks(engine, transport, exported.block_ids)
    return Export(exported, kv, shared)


@dataclass(frozen=True)
class Share:
    """Which branches of an export go to which receiver, and under which request id there."""

    transport: Transport
    peer: str
    branches: tuple[int, ...]
    request_id: str | None = None        # the receiver's id for them (default: the source's)


def send_share(fingerprint: KVFingerprint, export: Export, share: Share, *, kind: str = "fanout") -> TransferRecord:
    """Send ``share.branches`` of ``export`` with only the blocks they use (every block: the
    export's tensor as is). Raises the transfer's typed error with ``err.exported`` set to the
    share, so the caller can re-place it; the source stays exported either way."""
    sub = export.exported.subset(share.branches)
    if share.request_id is not None:
        sub = dataclasses.replace(sub, request_id=share.request_id)
    if list(sub.block_ids) == list(export.exported.block_ids):
        sub_kv, shared = export.kv, False
    else:
        position = {b: i for i, b in enumerate(export.exported.block_ids)}
        sub_kv, shared = select_blocks(export.kv, [position[b] for b in sub.block_ids], share.transport, fingerprint)
    try:
        return send_exported(share.transport, share.peer, fingerprint, sub, sub_kv, kind=kind)
    except TransferError as e:
        e.exported = sub
        raise
    finally:
        if shared:
            SHARED.give(sub_kv)


# ----------------------------------------------------------------------------- receiving side
class EngineSink(PageSink):
    """Receives page sets that carry a request into an engine: import → write → commit."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.fingerprint = engine.fingerprint()

    def allocate(self, header: PageSetHeader) -> list[int] | None:
        if header.request is None:
            raise TransferRefused("page set carries no request to import", request_id=header.request_id)
        try:
            exported = ExportedRequest.from_dict(header.request)
        except (KeyError, TypeError, ValueError) as e:
            raise TransferRefused(f"bad exported request in page set: {e!r}", request_id=header.request_id) from None
        if len(exported.block_ids) != header.num_blocks:
            raise TransferRefused(f"request names {len(exported.block_ids)} blocks, page set has {header.num_blocks}")
        try:
            ids = self.engine.import_request(exported)
        except ValueError as e:  # e.g. a duplicate request id
            raise TransferRefused(f"engine refused the import: {e}", request_id=header.request_id) from None
        return None if ids is None else list(ids)

    def write(self, header, block_ids, kv) -> None:
        if block_ids:
            self.engine.write_blocks(block_ids, kv)

    layer_writes = True  # each arriving chunk goes straight into the cache: no staging copy

    def host_cache(self):
        return self.engine.host_kv_cache()

    def write_layers(self, header, block_ids, layers, kv) -> None:
        if block_ids:
            self.engine.write_blocks(block_ids, kv, layers=layers)

    def commit(self, header, block_ids) -> None:
        self.engine.commit_import(header.request_id)

    def abort(self, header, block_ids) -> None:
        self.engine.abort_import(header.request_id)


def receive(sink: PageSink, transport: Transport, *, timeout_s: float | None = None) -> Received:
    """Receive the next page set that carries a request (handoff, fan-out share or migration)
    into ``sink`` (an ``EngineSink``); when it returns the request is decoding there. Raises the
    transfer's typed error (the sink has freed its blocks by then)."""
    got = transport.recv(sink, timeout_s=timeout_s)
    TELEMETRY.add(got.record)  # kind "page_set": the receiver sees bytes, not why they came
    return got


# ----------------------------------------------------------------------------- 4. swap via store
@dataclass(frozen=True)
class SwappedRequest:
    """What a swapped-out request needs to come back, on this or any instance of the model.
    Plain data (``to_dict`` / ``from_dict``), small: the blocks are in the store."""

    exported: ExportedRequest
    namespace: str
    block_keys: tuple[int, ...]  # store key of each of exported.block_ids, in order

    def to_dict(self) -> dict:
        return {"exported": self.exported.to_dict(), "namespace": self.namespace, "block_keys": list(self.block_keys)}

    @classmethod
    def from_dict(cls, d: dict) -> "SwappedRequest":
        return cls(ExportedRequest.from_dict(d["exported"]), str(d["namespace"]), tuple(int(k) for k in d["block_keys"]))


def non_prompt_keys(swapped: SwappedRequest, block_size: int) -> tuple[int, ...]:
    """The store keys of ``swapped`` that are not its prompt's full blocks: what to delete if it
    never comes back (the prompt's full blocks stay, as prefix hits for other requests)."""
    prompt = set(hash_blocks(list(swapped.exported.prompt_token_ids), block_size))
    return tuple(k for k in swapped.block_keys if k not in prompt)


class StoreFull(TransferRefused):
    """The store could not take every block (the rest of its capacity is pinned)."""


def block_keys(exported: ExportedRequest, block_size: int) -> list[int]:
    """Content key of every block of ``exported``: the prefix-chain hash of the tokens the block
    holds (a partial last block hashes its partial tokens). Full blocks get exactly the prefix
    cache's keys, so a swapped-out prompt doubles as a prefix hit for other requests."""
    keys: dict[int, int] = {}
    for br in exported.branches:
        tokens = (list(exported.prompt_token_ids) + list(br.output_token_ids))[:br.num_computed_tokens]
        parent = None
        for pos, idx in enumerate(br.block_indices):
            parent = hash_block(parent, tokens[pos * block_size:(pos + 1) * block_size])
            keys.setdefault(idx, parent)
    missing = set(range(len(exported.block_ids))) - set(keys)
    if missing:
        raise ValueError(f"blocks at positions {sorted(missing)} are used by no branch")
    return [keys[i] for i in range(len(exported.block_ids))]


def swap_out(engine: Engine, request_id: str, store: BlockStoreAPI) -> SwappedRequest:
    """Move a request's KV into the store, pinned until ``swap_in``, and free its blocks.
    Raises ``StoreFull`` (request left exported, ``err.exported`` set) when the store cannot take it."""
    t0, wall0 = time.perf_counter(), time.time()
    fp = engine.fingerprint()
    exported, kv = _export(engine, request_id)
    ns = fingerprint_namespace(fp)
    keys = block_keys(exported, fp.layout.block_size)
    stored = store.put_blocks(ns, keys, kv)
    pinned = store.pin(ns, keys) if all(stored) else []
    if not all(stored) or not all(pinned):
        if any(pinned):
            store.unpin(ns, [k for k, p in zip(keys, pinned) if p])
        err = StoreFull(f"store refused {stored.count(False)} of {len(keys)} blocks of {request_id}",
                        request_id=request_id)
        err.exported = exported
        raise err
    engine.release_request(request_id)
    TELEMETRY.add(TransferRecord("swap_out", "store", getattr(store, "address", "local"), request_id, len(keys),
                                 int(kv.numel() * kv.element_size()), time.perf_counter() - t0, wall0))
    return SwappedRequest(exported, ns, tuple(keys))


def swap_in(engine: Engine, swapped: SwappedRequest, store: BlockStoreAPI) -> TransferRecord:
    """Bring a swapped-out request back into ``engine`` (which may be another instance).
    Raises ``NoRoom`` (store untouched, try later or elsewhere). If blocks went missing from the
    store the request is imported for recompute instead (record.ok is False, error "recompute")."""
    t0, wall0 = time.perf_counter(), time.time()
    fp = engine.fingerprint()
    exported, rid = swapped.exported, swapped.exported.request_id
    with store.borrow_blocks(swapped.namespace, swapped.block_keys, fp.layout) as kv:
        complete = kv.shape[2] == len(swapped.block_keys)
        nbytes = int(kv.numel() * kv.element_size())
        target = exported if complete else exported.without_kv()
        block_ids = engine.import_request(target)
        if block_ids is None:
            raise NoRoom(f"no room to swap in {rid} ({len(target.block_ids)} blocks)", request_id=rid)
        try:
            if complete and block_ids:
                engine.write_blocks(block_ids, kv)
            engine.commit_import(rid)
        except Exception:
            engine.abort_import(rid)
            raise
        num_blocks = int(kv.shape[2])
    try:
        store.unpin(swapped.namespace, swapped.block_keys)
    except ValueError:
        pass  # the store restarted and lost its pins; the blocks were read already
    return TELEMETRY.add(TransferRecord("swap_in", "store", getattr(store, "address", "local"), rid, num_blocks,
                                        nbytes, time.perf_counter() - t0, wall0, ok=complete,
                                        error=None if complete else "recompute"))


# ----------------------------------------------------------------------------- prefix reuse
def store_prefix(engine: Engine, token_ids: Sequence[int], store: BlockStoreAPI) -> int:
    """Publish the engine's cached full blocks of ``token_ids`` to the store; returns how many
    the store holds after the put."""
    t0, wall0 = time.perf_counter(), time.time()
    hashes, kv = engine.export_prefix(token_ids)
    if not hashes:
        return 0
    stored = store.put_blocks(fingerprint_namespace(engine.fingerprint()), hashes, kv)
    TELEMETRY.add(TransferRecord("prefix_put", "store", getattr(store, "address", "local"), None, len(hashes),
                                 int(kv.numel() * kv.element_size()), time.perf_counter() - t0, wall0))
    return sum(stored)


def load_prefix(engine: Engine, token_ids: Sequence[int], store: BlockStoreAPI) -> int:
    """Pull the longest stored prefix of ``token_ids`` into the engine's prefix cache, so the
    next prefill of these tokens skips that compute. Returns the number of blocks added."""
    t0, wall0 = time.perf_counter(), time.time()
    fp = engine.fingerprint()
    hashes = hash_blocks(list(token_ids), fp.layout.block_size)
    if not hashes:
        return 0
    with store.borrow_blocks(fingerprint_namespace(fp), hashes, fp.layout) as kv:
        k = int(kv.shape[2])
        if k == 0:
            return 0
        added = engine.import_prefix(list(token_ids), hashes[:k], kv)
        nbytes = int(kv.numel() * kv.element_size())
    TELEMETRY.add(TransferRecord("prefix_get", "store", getattr(store, "address", "local"), None, k,
                                 nbytes, time.perf_counter() - t0, wall0))
    return added
