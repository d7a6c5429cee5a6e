"""A plain pool of KV blocks in host (or device) memory that can receive page sets.

It is the receiving side of a transfer without an engine: ``bench/bench_kvtransfer.py`` and the
transport tests receive into it, so that a transport's speed and correctness are measured apart from
an engine's scheduling. Serving never uses it: instances receive through ``flows.EngineSink`` (the
engine's own cache), which the flow and cluster tests cover over every transport. Same layout as
the engine's cache, a free list, and nothing else.
"""
from __future__ import annotations

from typing import Sequence

import torch

from thinkserve.workers.kv_cache import KVFingerprint, allocate_kv_cache, gather_blocks, scatter_blocks

from .page_set import PageSetHeader
from .transport import PageSink


class BlockPool(PageSink):
    def __init__(self, fingerprint: KVFingerprint, num_blocks: int, device: str = "cpu"):
        self.fingerprint = fingerprint
        self.kv = allocate_kv_cache(fingerprint.layout, num_blocks, device)
        self._free = list(range(num_blocks - 1, -1, -1))
        self.committed: dict[str | None, tuple[int, ...]] = {}  # request_id -> its blocks
        self.aborted = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, header: PageSetHeader) -> list[int] | None:
        if header.num_blocks > len(self._free):
            return None
        return [self._free.pop() for _ in range(header.num_blocks)]

    def write(self, header: PageSetHeader, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        scatter_blocks(self.kv, block_ids, kv.to(self.kv.device, non_blocking=True))

    layer_writes = True

    def host_cache(self) -> torch.Tensor | None:
        return self.kv if self.kv.device.type == "cpu" else None

    def write_layers(self, header: PageSetHeader, block_ids: Sequence[int], layers: slice,
                     kv: torch.Tensor) -> None:
        scatter_blocks(self.kv[layers], block_ids, kv.to(self.kv.device))

    def commit(self, header: PageSetHeader, block_ids: Sequence[int]) -> None:
        self.committed[header.request_id] = tuple(block_ids)

    def abort(self, header: PageSetHeader, block_ids: Sequence[int]) -> None:
        self.aborted += 1
        self.free(block_ids)

    def free(self, block_ids: Sequence[int]) -> None:
        if set(block_ids) & set(self._free):
            raise RuntimeError(f"double free of blocks {sorted(set(block_ids) & set(self._free))}")
        self._free.extend(block_ids)
        self._free.sort(reverse=True)  # lowest ids first: a fresh allocation is one run, as in a new engine

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        return gather_blocks(self.kv, block_ids)
