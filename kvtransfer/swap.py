"""The CPU KV store as an engine's swap space for preemption (``workers/swap_space.py``).

    engine step: preempt ──SwapTransfer(key, device blocks)──▶ StoreSwapSpace.put
                   put_blocks(ns, block keys, kv) + pin  ──▶  store (pinned: never evicted)
    later step:  swap in ──▶ borrow_blocks ──▶ write_blocks; discard: unpin + delete (+ the buffer back)

Each stored block gets its own 64-bit store key, the hash of ``(SwapKey, block position)``, so
two engines sharing one store (each ``SwapKey`` names its engine instance) and one request's
successive swap-outs (the epoch) never collide. The namespace is ``"swap-" +`` the model/layout
namespace, apart from the prefix-reuse entries (those are keyed by token chain hashes).

Capacity and failures are return values, as the interface asks: a store that is full (or that
cannot pin every block) or unreachable makes ``put`` return False, and the engine recomputes
the victim; lost blocks make ``get`` return None, with the same result.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging

import torch

from thinkserve.workers.kv_cache import KVFingerprint, KVLayout
from thinkserve.workers.plan import SwapKey
from thinkserve.workers.swap_space import SwapSpace

from .page_set import fingerprint_namespace
from .store import BlockStoreAPI
from .transport import TransferError

log = logging.getLogger(__name__)


def swap_block_keys(key: SwapKey, num_blocks: int) -> list[int]:
    """The store keys of the ``num_blocks`` blocks swapped out under ``key``."""
    base = hashlib.blake2b(str(key).encode(), digest_size=16).digest()
    return [int.from_bytes(hashlib.blake2b(base + i.to_bytes(4, "little"), digest_size=8).digest(), "little")
            for i in range(num_blocks)]


class StoreSwapSpace(SwapSpace):
    """Swap into a ``KVStore`` through any ``BlockStoreAPI``: a ``StoreClient`` (the node's store
    server) or, in process, the ``KVStore`` itself. Entries are pinned while swapped out, and
    unpinned and deleted on swap-in or when their request is aborted or exported."""

    def __init__(self, store: BlockStoreAPI):
        self.store = store
        self.layout: KVLayout | None = None
        self.namespace = ""
        self._lent: dict[SwapKey, contextlib.ExitStack] = {}  # key -> its borrowed buffer, until discard
        self.num_puts = 0          # swap-outs the store took
        self.num_refused = 0       # swap-outs it refused (full, or unreachable): the engine recomputed them
        self.num_gets = 0          # swap-ins asked for (found or lost)

    def bind(self, fingerprint: KVFingerprint) -> None:
        self.layout = fingerprint.layout
        self.namespace = "swap-" + fingerprint_namespace(fingerprint)

    def put(self, key: SwapKey, kv: torch.Tensor) -> bool:
        keys = swap_block_keys(key, int(kv.shape[2]))
        try:
            stored = self.store.put_blocks(self.namespace, keys, kv)
            # Pinned right after the put; an entry evicted in between (another engine's put) shows
            # up here as a failed pin, and the whole swap-out is refused.
            pinned = self.store.pin(self.namespace, keys) if all(stored) else []
            if all(stored) and all(pinned):
                self.num_puts += 1
                return True
            if any(pinned):
                self.store.unpin(self.namespace, [k for k, p in zip(keys, pinned) if p])
            self.store.delete(self.namespace, [k for k, s in zip(keys, stored) if s])
        except TransferError as e:
            log.warning("swap-out of %s to the KV store failed (%s); recomputing instead", key, e)
        self.num_refused += 1
        return False

    def get(self, key: SwapKey, num_blocks: int) -> torch.Tensor | None:
        """Lent until ``discard(key)``: a store on this node fills a shared buffer of ours
        (``borrow_blocks``), which goes back to the pool then."""
        if self.layout is None:
            raise RuntimeError("StoreSwapSpace.get before bind(): the engine binds it at start")
        self.num_gets += 1
        self._give_back(key)
        lent = contextlib.ExitStack()
        try:
            kv = lent.enter_context(self.store.borrow_blocks(self.namespace, swap_block_keys(key, num_blocks),
                                                             self.layout))
        except TransferError as e:
            lent.close()
            log.warning("swap-in of %s from the KV store failed (%s); recomputing instead", key, e)
            return None
        if kv.shape[2] != num_blocks:
            lent.close()
            return None
        self._lent[key] = lent
        return kv

    def _give_back(self, key: SwapKey) -> None:
        lent = self._lent.pop(key, None)
        if lent is not None:
            lent.close()

    def discard(self, key: SwapKey, num_blocks: int) -> None:
        self._give_back(key)
        keys = swap_block_keys(key, num_blocks)
        try:
            try:
                self.store.unpin(self.namespace, keys)
            except ValueError:
                pass  # not pinned: never stored (refused), or the store restarted and lost its pins
            self.store.delete(self.namespace, keys)
        except TransferError as e:  # an unreachable store keeps nothing we could free
            log.warning("discarding %s from the KV store failed: %s", key, e)
