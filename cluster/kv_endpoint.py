"""An instance's KV endpoint: the kvtransfer flows, run against an engine another thread steps.

    sender instance                                     receiver instance
      flows.export_for(part) ─ blocks held, not run     receiver threads (one per transport:
      per target: flows.send_share (its branches'         tcp, and shm unless kv_transport is tcp):
      blocks, under the target's part id) ──page set──▶   allocate: import_request (None → NoRoom)
      over the transport the frontend chose for the        write_blocks, commit_import → decoding
      pair (shm on one node, else TCP)                     (a failed transfer: abort_import)
      (failures reported per target, never raised)
      publish the prompt's blocks to the node's CPU store
      release_request(part) when the frontend says so

    new prompt: load_prefix(store) before add_request → the prefill skips the stored blocks
    resume:   load_prefix(store) then import_request(without KV) → recompute the rest
    swap:     swap_out(part) → node's CPU store (pinned) ... swap_in(part) on any instance,
              reading the store it was parked in

The flows (``thinkserve.kvtransfer.flows``) call the engine directly; ``LockedEngine`` makes
each of those calls take the engine lock, so a transfer interleaves with decode steps.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

from thinkserve.kvtransfer import flows
from thinkserve.kvtransfer.collective import PairGroupTransport
from thinkserve.kvtransfer.shm import ShmTransport
from thinkserve.kvtransfer.store import StoreClient
from thinkserve.kvtransfer.tcp import TcpTransport
from thinkserve.kvtransfer.transport import (NoRoom, PeerGone, TransferConfig, TransferError, TransferRefused,
                                             TransferTimeout)
from thinkserve.workers.outputs import ExportedBranch, ExportedRequest
from thinkserve.workers.sampling_params import SamplingParams

from .engine_host import EngineHost
from .messages import (Admission, ParkedPart, Refusal, ResumeAdmission, SendOutcome, SendResult, SendTarget)
from .transport_choice import COLLECTIVE, SHM, TCP

log = logging.getLogger(__name__)


class LockedEngine:
    """The engine methods the flows use, each under the engine lock."""

    _METHODS = ("fingerprint", "export_request", "read_blocks", "release_request", "import_request",
                "write_blocks", "commit_import", "abort_import", "export_prefix", "import_prefix",
                "host_kv_cache")

    def __init__(self, host: EngineHost):
        self._host = host

    def __getattr__(self, name):
        if name not in self._METHODS:
            raise AttributeError(name)
        fn = getattr(self._host.engine, name)

        def locked(*args, **kwargs):
            with self._host.lock:
                return fn(*args, **kwargs)
        return locked


class InstanceSink(flows.EngineSink):
    """``flows.EngineSink`` plus the instance's admission state and part registry."""

    def __init__(self, host: EngineHost):
        super().__init__(LockedEngine(host))
        self.host = host

    def allocate(self, header):
        if not self.host.admitting:
            return None                                   # draining: NoRoom, the sender goes elsewhere
        if header.request_id in self.host.parts:
            raise TransferRefused(f"request {header.request_id!r} already on {self.host.instance_id}")
        return super().allocate(header)

    def commit(self, header, block_ids) -> None:
        landed = time.monotonic()   # a hand-off's landing, before waiting for the step in flight
        with self.host.lock:
            super().commit(header, block_ids)
            self.host.parts.add(header.request_id)
            self.host.telemetry.added(header.request_id, landed)
        self.host.wake()


class KVEndpoint:
    def __init__(self, host: EngineHost, bind_host: str = "127.0.0.1", store_address: str | None = None,
                 config: TransferConfig | None = None, kv_transport: str = "auto"):
        self.host = host
        self.engine = LockedEngine(host)
        self.config = config or TransferConfig(host=bind_host, timeout_s=10.0)
        # A transport is one-thread: one per side and kind. TCP always (peers on other nodes);
        # shared memory too unless the deployment forces TCP.
        # kv_transport collective: a pair group per sender→receiver pair (kvtransfer.collective),
        # NCCL when this engine runs on a GPU (device memory sent as is), else gloo.
        kinds = {TCP: (TCP,), COLLECTIVE: (TCP, COLLECTIVE)}.get(kv_transport, (TCP, SHM))
        backend = "nccl" if str(host.engine.config.device).startswith("cuda") else "gloo"
        make = {TCP: TcpTransport, SHM: ShmTransport,
                COLLECTIVE: lambda cfg: PairGroupTransport(cfg, backend=backend)}
        self.receivers = {k: make[k](self.config) for k in kinds}
        self.senders = {k: make[k](self.config) for k in kinds}
        self.address = self.receivers[TCP].address
        self.shm_address = self.receivers[SHM].address if SHM in self.receivers else ""
        self.collective_address = self.receivers[COLLECTIVE].address if COLLECTIVE in self.receivers else ""
        self.sink = InstanceSink(host)
        self.fingerprint = host.engine.fingerprint()
        self.store_address = store_address or ""
        self.store = StoreClient(store_address, self.config) if store_address else None
        self._other_stores: dict[str, StoreClient] = {}   # other nodes' stores, for parked KV
        self._store_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._exported: dict[str, flows.Export] = {}   # part id -> its export, until release
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._recv_loop, args=(r,), name=f"kv-recv-{k}-{host.instance_id}",
                                          daemon=True) for k, r in self.receivers.items()]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _recv_loop(self, receiver) -> None:
        while not self._stop.is_set():
            try:
                flows.receive(self.sink, receiver, timeout_s=0.2)
            except TransferTimeout:
                continue
            except TransferError as e:          # refused or failed: its blocks are already freed
                log.info("incoming page set failed on %s: %s", self.host.instance_id, e)
            except Exception:
                if self._stop.is_set():
                    return
                log.exception("KV receiver error on %s", self.host.instance_id)

    # ----------------------------------------------------------------- sending
    def send(self, part_id: str, targets: tuple[SendTarget, ...], kind: str = "handoff",
             publish_prefix: bool = False) -> SendOutcome:
        """Export once (a retry with new targets reuses the export), send each target its
        branches' blocks under the target's part id (``flows.send_share``). The part stays
        exported until ``release``; failures are reported per target, never raised."""
        export = self._exported.get(part_id)
        if export is None:
            with self.host.lock:
                # Gathered into a shared segment when shm may carry it: a same-node receiver maps it.
                try:
                    export = flows.export_for(self.engine, part_id, self.senders.get(SHM))
                except KeyError:        # finished (or aborted) here since the frontend's last poll
                    return SendOutcome((), tuple(SendResult(t.part_id, False, "the part is no longer exportable here",
                                                            transport=t.transport) for t in targets),
                                       exported=False)
                self._exported[part_id] = export
                self.host.parts.discard(part_id)
        outputs = tuple((b.index, tuple(b.output_token_ids)) for b in export.exported.branches)
        results = []
        for t in targets:
            sender = self.senders.get(t.transport)
            if sender is None:
                results.append(SendResult(t.part_id, False, f"no {t.transport} transport here", transport=t.transport))
                continue
            try:
                with self._send_lock:
                    rec = flows.send_share(self.fingerprint, export,
                                           flows.Share(sender, t.kv_address, t.branch_indices, t.part_id), kind=kind)
                results.append(SendResult(t.part_id, True, bytes=rec.bytes, seconds=rec.seconds,
                                          transport=t.transport))
            except TransferError as e:
                gone = isinstance(e, (PeerGone, TransferTimeout)) and not isinstance(e, NoRoom)
                results.append(SendResult(t.part_id, False, f"{type(e).__name__}: {e}", peer_gone=gone,
                                          no_room=isinstance(e, NoRoom), transport=t.transport))
        if publish_prefix and self.store is not None:
            self._publish(export.exported.prompt_token_ids)
        return SendOutcome(outputs, tuple(results))

    def _publish(self, token_ids) -> None:
        try:
            with self._store_lock:
                flows.store_prefix(self.engine, list(token_ids), self.store)
        except (TransferError, ValueError) as e:
            log.info("publishing a prefix to the KV store failed: %s", e)

    def may_load_prefix(self, prompt_token_ids) -> bool:
        """Whether ``load_prompt_prefix`` could find anything: a store, and a full block to share."""
        return self.store is not None and len(prompt_token_ids) > self.fingerprint.layout.block_size

    def load_prompt_prefix(self, prompt_token_ids) -> int:
        """Before a new prompt's prefill: pull the longest prefix of it that the node's store holds
        (another instance published it) into the prefix cache, so the prefill skips those blocks.
        Returns the blocks added (0 without a store, on a miss, or when the cache had them)."""
        if not self.may_load_prefix(prompt_token_ids):
            return 0
        try:
            with self._store_lock:
                added = flows.load_prefix(self.engine, list(prompt_token_ids), self.store)
        except (TransferError, ValueError) as e:
            log.info("loading a prompt prefix from the KV store failed: %s", e)
            return 0
        self.host.store_prefix_blocks += added
        return added

    def _forget_export(self, part_id: str) -> bool:
        export = self._exported.pop(part_id, None)
        if export is None:
            return False
        export.release_buffer()
        self.host.engine.release_request(part_id)
        return True

    def release(self, part_id: str) -> None:
        with self.host.lock:
            self._forget_export(part_id)

    def abort(self, part_id: str) -> bool:
        with self.host.lock:
            if self._forget_export(part_id):
                return True
            self.host.parts.discard(part_id)
            return bool(self.host.engine.abort(part_id))

    # ----------------------------------------------------------------- resuming
    def resume(self, part_id: str, prompt_token_ids: tuple[int, ...], params: SamplingParams, priority: int,
               branches: tuple[tuple[int, tuple[int, ...]], ...]) -> ResumeAdmission:
        """Continue branches from their tokens: the engine recomputes prompt + outputs, except
        for a prefix the CPU store holds (loaded into the prefix cache first)."""
        exported = ExportedRequest(part_id, prompt_token_ids, params, priority, (),
                                   tuple(ExportedBranch(i, tuple(toks), 0, ()) for i, toks in branches))
        cached_blocks = 0
        if self.store is not None:
            longest = max((t for _, t in branches), key=len, default=())
            try:
                with self._store_lock:
                    cached_blocks = flows.load_prefix(self.engine, list(prompt_token_ids) + list(longest), self.store)
            except (TransferError, ValueError) as e:
                log.info("loading a prefix from the KV store failed: %s", e)
        host = self.host
        with host.lock:
            if part_id in host.parts:
                return ResumeAdmission(False, Refusal.DUPLICATE, part_id)
            try:
                ids = host.engine.import_request(exported)
            except ValueError as e:
                return ResumeAdmission(False, Refusal.INVALID, str(e))
            if ids is None:
                return ResumeAdmission(False, Refusal.NO_ROOM)
            host.engine.commit_import(part_id)
            host.parts.add(part_id)
        host.wake()
        total = len(prompt_token_ids) + max((len(t) for _, t in branches), default=0)
        return ResumeAdmission(True, recomputed_tokens=max(0, total - cached_blocks * self.fingerprint.layout.block_size))

    def swap_out(self, part_id: str) -> ParkedPart | None:
        """Move a part's KV into the CPU store and free it here. ``None``: no store, or it could
        not take the blocks; the part is gone from here either way (the caller recomputes it)."""
        if self.store is not None:
            try:
                with self._store_lock:
                    swapped = flows.swap_out(self.engine, part_id, self.store)
                self.host.parts.discard(part_id)
                return ParkedPart(swapped, self.store_address,
                                  flows.non_prompt_keys(swapped, self.fingerprint.layout.block_size))
            except (TransferError, ValueError) as e:
                log.info("swap of %s to the KV store failed: %s", part_id, e)
                with self.host.lock:        # the flow left it exported: free it
                    try:
                        self.host.engine.release_request(part_id)
                    except (KeyError, ValueError):
                        self.host.engine.abort(part_id)
                    self.host.parts.discard(part_id)
                return None
        self.abort(part_id)
        return None

    def _store_at(self, address: str) -> StoreClient | None:
        if not address or address == self.store_address:
            return self.store
        client = self._other_stores.get(address)
        if client is None:
            client = self._other_stores[address] = StoreClient(address, self.config)
        return client

    def swap_in(self, part_id: str, parked: ParkedPart) -> Admission:
        store = self._store_at(parked.store)
        if store is None:
            return Admission.refused(Refusal.NO_STORE, parked.store)
        s = parked.swapped
        s = dataclasses.replace(s, exported=dataclasses.replace(s.exported, request_id=part_id))
        try:
            with self._store_lock:
                flows.swap_in(self.engine, s, store)
        except NoRoom:
            return Admission.refused(Refusal.NO_ROOM)
        except TransferError as e:
            return Admission.refused(Refusal.STORE_FAILED, str(e))
        self.host.parts.add(part_id)
        self.host.wake()
        return Admission(True)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        with self._send_lock:
            for sender in self.senders.values():
                sender.close()
        for receiver in self.receivers.values():
            receiver.close()
        for client in [self.store, *self._other_stores.values()]:
            if client is not None:
                client.close()
