"""Swap spaces: where preemption puts a request's KV when device blocks run out.

Two tiers, tried in this order by the scheduler::

    device blocks ──preempt──▶ 1. host block pool   (``num_host_blocks``: built in; the plan names
                               │                      host block ids, the model runner copies them)
                               ├─▶ 2. external swap space (``LLMEngine(swap_space=...)``: this
                               │                      interface; the plan names request, key and
                               │                      device blocks, the engine moves the KV)
                               └─▶ 3. recompute      (drop the KV; also when tier 2 refuses)

An external swap space stores the KV of a request's unique device blocks under one ``SwapKey``
(``plan.py``; unique per engine instance, request and swap epoch). It is handed whole tensors, so
an implementation may keep them anywhere; deployments use the node's CPU KV store
(``thinkserve.kvtransfer.swap.StoreSwapSpace``, over the store server or an in-process
``KVStore``). Capacity is a return value: ``put`` returns False when the space cannot take the blocks, never raises for "full".
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from .kv_cache import KVFingerprint
from .plan import ExternalMoves, StepPlan, SwapKey

log = logging.getLogger(__name__)


class SwapSpace(ABC):
    """Holds the KV of swapped-out requests, keyed by ``SwapKey``. Used by one engine's step
    loop (one thread); implementations shared between engines must be safe across them."""

    def bind(self, fingerprint: KVFingerprint) -> None:
        """Called once by the engine that uses this space, before any other call: the KV layout
        (and model) of the blocks it will be handed. This default does nothing."""

    @abstractmethod
    def put(self, key: SwapKey, kv: torch.Tensor) -> bool:
        """Store ``kv`` ([L, 2, n, bs, H, D], any device) under ``key``, keeping it until
        ``discard``. False when there is no room (or the space is unreachable): nothing is then
        stored. The caller may reuse ``kv``'s memory once this returns."""

    @abstractmethod
    def get(self, key: SwapKey, num_blocks: int) -> torch.Tensor | None:
        """The ``num_blocks`` blocks stored under ``key`` ([L, 2, n, bs, H, D] on the CPU), or None
        when they are gone (the caller then recomputes). This operation does not remove them.
        The tensor may be lent from the space's own memory: it is valid until ``discard(key)``
        (the engine copies it into its cache before that)."""

    @abstractmethod
    def discard(self, key: SwapKey, num_blocks: int) -> None:
        """Forget ``key`` (after a swap-in, or when its request was aborted or exported).
        Discarding a key that is not stored does nothing."""


class ExternalSwap:
    """Carries out a plan's moves to and from an external swap space, before the model runner's
    own moves and forward pass: swap-outs read blocks that this step may reuse. A swap-in's KV
    is written into the blocks the scheduler claimed for it and then discarded from the space.
    ``kv_cache`` is anything with ``read_blocks`` / ``write_blocks`` / ``dtype`` (the runner)."""

    def __init__(self, space: SwapSpace, kv_cache):
        self.space = space
        self.kv_cache = kv_cache

    def move(self, plan: StepPlan) -> ExternalMoves:
        refused, lost = [], []
        for t in plan.swap_outs:
            if not self.space.put(t.key, self.kv_cache.read_blocks(t.block_ids)):
                refused.append(t.request_id)
        for t in plan.swap_ins:
            kv = self.space.get(t.key, len(t.block_ids))
            if kv is None:
                log.warning("swap space lost the KV of %s; recomputing it", t.key)
                lost.append(t.request_id)
            else:
                self.kv_cache.write_blocks(t.block_ids, kv.to(self.kv_cache.dtype))
            self.space.discard(t.key, len(t.block_ids))
        return ExternalMoves(tuple(refused), tuple(lost))
