"""Paged KV cache: its layout, its fingerprint, and allocation.

One tensor per engine holds every layer's K and V pages::

    kv_cache[layer, 0|1 (K|V), block, slot_in_block, kv_head, head_dim]

A request's pages are ``kv_cache[:, :, block_ids]``; the host swap space has the same layout with
its own block count, so swapping and exporting a page is a slice copy with no re-layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import host_memory
from .model_config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} is not supported; use one of {list(_DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"KV dtype {name!r} is not supported; use one of {list(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # validates the name
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def for_model(cls, config: ModelConfig, block_size: int, dtype: torch.dtype) -> "KVLayout":
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size, dtype_name(dtype))

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` (0 when not even one does)."""
        return max(0, int(budget_bytes) // self.bytes_per_block)


@dataclass(frozen=True)
class KVFingerprint:
    """Two engines can exchange KV pages iff their fingerprints are equal."""

    layout: KVLayout
    architecture: str
    model_id: str


def allocate_kv_cache(layout: KVLayout, num_blocks: int, device: str | torch.device, *,
                      huge_pages: bool = False) -> torch.Tensor:
    """Zeroed cache (zeros, not garbage: attention masks unused slots, but a NaN left in a
    masked slot would still poison ``softmax(-inf)·V`` products on some kernels). ``huge_pages``:
    on CPU, a cache every decode step streams (the runner's) goes on transparent huge pages
    (``host_memory.py``), resident only as its blocks are written."""
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    if huge_pages and torch.device(device).type == "cpu":
        return host_memory.zeros(layout.shape(num_blocks), layout.torch_dtype)
    return torch.zeros(layout.shape(num_blocks), dtype=layout.torch_dtype, device=device)


def allocate_host_cache(layout: KVLayout, num_blocks: int, *, pin: bool) -> torch.Tensor:
    """Swap space in host memory; pinned when the device is a GPU so copies can be async."""
    cache = torch.zeros(layout.shape(num_blocks), dtype=layout.torch_dtype)
    return cache.pin_memory() if pin and num_blocks > 0 else cache


# ----------------------------------------------------------------------------- block copies
def block_runs(block_ids) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids as ``(position, first_block, length)``::

        block_ids  [7, 8, 9, 3, 4, 12]  ->  [(0, 7, 3), (3, 3, 2), (5, 12, 1)]

    A run is one slice of the cache, so it copies as a plain strided copy (memcpy speed), while
    ``index_copy_`` / ``index_select`` go element-row by row (measured 3x slower on CPU)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        b = int(b)
        if runs and runs[-1][1] + runs[-1][2] == b:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, b, 1))
    return runs


def _few_runs(runs: list, n: int, block_bytes: int = 0) -> bool:
    """Slice copies win unless the ids are so scattered that per-run call overhead dominates:
    few runs, long runs, or runs of >= 256 KiB (a 7B model's 896 KiB block alone: 73 scattered
    blocks scatter in 5.9 ms by slices vs 10.8 ms by ``index_copy_``; 32 KiB blocks: 13.5 vs 8.5)."""
    return len(runs) <= 4 or 8 * len(runs) <= n or n * block_bytes >= len(runs) * (256 << 10)


def _block_bytes(cache: torch.Tensor) -> int:
    return cache[:, :, :1].numel() * cache.element_size()


def scatter_blocks(cache: torch.Tensor, block_ids, data: torch.Tensor) -> None:
    """``cache[:, :, block_ids] = data`` (dim 2 is the block dim of both)."""
    runs = block_runs(block_ids)
    if _few_runs(runs, len(block_ids), _block_bytes(cache)):
        for pos, first, n in runs:
            cache[:, :, first:first + n].copy_(data[:, :, pos:pos + n])
    else:
        idx = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=cache.device)
        cache.index_copy_(2, idx, data.to(cache.device))


def gather_blocks(cache: torch.Tensor, block_ids, out: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of ``cache[:, :, block_ids]`` on ``cache``'s device, or written into
    ``out`` (a contiguous tensor of that shape and dtype, any device) and returned."""
    runs = block_runs(block_ids)
    if out is not None:
        if out.device != cache.device and runs:
            out.copy_(gather_blocks(cache, block_ids))
        elif _few_runs(runs, len(block_ids), _block_bytes(cache)):
            for pos, first, n in runs:
                out[:, :, pos:pos + n].copy_(cache[:, :, first:first + n])
        else:
            idx = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=cache.device)
            torch.index_select(cache, 2, idx, out=out)
        return out
    if not runs:
        return cache[:, :, :0].contiguous()
    if len(runs) == 1:
        _, first, n = runs[0]
        return cache[:, :, first:first + n].clone(memory_format=torch.contiguous_format)
    if _few_runs(runs, len(block_ids), _block_bytes(cache)):
        return torch.cat([cache[:, :, first:first + n] for _, first, n in runs], dim=2)
    idx = torch.as_tensor([int(b) for b in block_ids], dtype=torch.long, device=cache.device)
    return cache.index_select(2, idx)
