"""The page set: the unit of KV that moves between engines and the CPU KV store.

A page set is a request's (or a prefix's) KV blocks in the engine's native layout plus typed
metadata. On the wire it is one msgpack header and the raw bytes of the blocks, never pickle::

    frame 0: msgpack {v, fingerprint{arch, model_id, layers, kv_heads, head_dim, block_size,
                      dtype}, num_blocks, token_ids, block_hashes, num_computed_tokens,
                      request_id, request}
    frame 1..k: kv bytes, chunk_bytes each (the last shorter)

    kv: [num_layers, 2 (K|V), num_blocks, block_size, num_kv_heads, head_dim], C-contiguous,
        so the bytes are just ``kv.view(uint8)``: no re-layout on either side.

Data frames are memoryviews over the tensor (``PageSet.data_frames``: zero-copy on send); the
receiving transport reads them straight into the blocks its sink allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import msgpack
import torch

from thinkserve.workers.kv_cache import KVFingerprint, KVLayout, block_runs, torch_dtype

WIRE_VERSION = 1


# ----------------------------------------------------------------------------- fingerprint
def fingerprint_to_dict(fp: KVFingerprint) -> dict:
    lay = fp.layout
    return {"architecture": fp.architecture, "model_id": fp.model_id, "num_layers": lay.num_layers,
            "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim, "block_size": lay.block_size,
            "dtype": lay.dtype}


def fingerprint_from_dict(d: dict) -> KVFingerprint:
    try:
        layout = KVLayout(int(d["num_layers"]), int(d["num_kv_heads"]), int(d["head_dim"]),
                          int(d["block_size"]), str(d["dtype"]))
        return KVFingerprint(layout, str(d["architecture"]), str(d["model_id"]))
    except KeyError as e:
        raise ValueError(f"page set fingerprint lacks field {e.args[0]!r}") from None


def fingerprint_diff(got: KVFingerprint, want: KVFingerprint) -> list[str]:
    """Human-readable differences, ``[]`` when the two engines can exchange pages."""
    a, b = fingerprint_to_dict(got), fingerprint_to_dict(want)
    return [f"{k}: page set has {a[k]!r}, receiver has {b[k]!r}" for k in a if a[k] != b[k]]


def fingerprint_namespace(fp: KVFingerprint) -> str:
    """Short stable name of a fingerprint: the CPU KV store keys blocks by (namespace, hash),
    since a block hash names tokens, not the model that computed their KV."""
    import hashlib
    packed = msgpack.packb(sorted(fingerprint_to_dict(fp).items()))
    return hashlib.blake2b(packed, digest_size=8).hexdigest()


# ----------------------------------------------------------------------------- header
@dataclass(frozen=True)
class PageSetHeader:
    """Everything about a page set except its bytes; travels first so the receiver can refuse
    or allocate before the bytes move."""

    fingerprint: KVFingerprint
    num_blocks: int
    token_ids: tuple[int, ...] = ()  # tokens whose KV the blocks hold (prompt + computed outputs)
    block_hashes: tuple[int, ...] = ()  # chain hashes of the full blocks (workers/block_hash.py)
    num_computed_tokens: int = 0
    request_id: str | None = None
    request: dict | None = field(default=None, compare=False)  # ExportedRequest.to_dict(), if any

    def __post_init__(self) -> None:
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        object.__setattr__(self, "block_hashes", tuple(int(h) for h in self.block_hashes))

    @property
    def layout(self) -> KVLayout:
        return self.fingerprint.layout

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape(self.num_blocks)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.layout.dtype)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def to_wire(self) -> bytes:
        return msgpack.packb({
            "v": WIRE_VERSION, "fingerprint": fingerprint_to_dict(self.fingerprint),
            "num_blocks": self.num_blocks, "token_ids": list(self.token_ids),
            "block_hashes": list(self.block_hashes), "num_computed_tokens": self.num_computed_tokens,
            "request_id": self.request_id, "request": self.request,
        })

    @classmethod
    def from_wire(cls, data: bytes | memoryview) -> "PageSetHeader":
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ValueError(f"page set header is not valid msgpack: {e}") from None
        if not isinstance(d, dict) or d.get("v") != WIRE_VERSION:
            raise ValueError(f"page set header version {d.get('v') if isinstance(d, dict) else None!r} "
                             f"is not {WIRE_VERSION}")
        return cls(fingerprint_from_dict(d["fingerprint"]), int(d["num_blocks"]), tuple(d["token_ids"]),
                   tuple(d["block_hashes"]), int(d["num_computed_tokens"]), d.get("request_id"),
                   d.get("request"))


# ----------------------------------------------------------------------------- page set
@dataclass(frozen=True)
class PageSet:
    header: PageSetHeader
    kv: torch.Tensor  # header.shape, header.dtype, contiguous, on CPU (or CUDA for NCCL)

    def __post_init__(self) -> None:
        if tuple(self.kv.shape) != self.header.shape:
            raise ValueError(f"page set kv has shape {tuple(self.kv.shape)}, header says {self.header.shape}")
        if self.kv.dtype != self.header.dtype:
            raise ValueError(f"page set kv has dtype {self.kv.dtype}, header says {self.header.dtype}")
        if not self.kv.is_contiguous():
            object.__setattr__(self, "kv", self.kv.contiguous())

    @classmethod
    def build(cls, fingerprint: KVFingerprint, kv: torch.Tensor, **header_fields) -> "PageSet":
        return cls(PageSetHeader(fingerprint, int(kv.shape[2]), **header_fields), kv)

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    def byte_view(self) -> torch.Tensor:
        """The kv bytes as a flat uint8 tensor sharing memory with ``kv``."""
        return self.kv.reshape(-1).view(torch.uint8)

    def data_frames(self, chunk_bytes: int) -> list[memoryview]:
        """Zero-copy memoryviews over the kv bytes, ``chunk_bytes`` each (CPU tensors only)."""
        if self.kv.device.type != "cpu":
            raise ValueError("data_frames needs a CPU tensor; collective transports send device tensors")
        if self.nbytes == 0:
            return []
        mv = memoryview(self.byte_view().numpy())
        return [mv[i:i + chunk_bytes] for i in range(0, self.nbytes, chunk_bytes)]

    def select_blocks(self, indices: Sequence[int], **header_changes) -> "PageSet":
        """A page set with only the blocks at ``indices`` (positions in this page set)."""
        import dataclasses
        idx = torch.as_tensor(list(indices), dtype=torch.long, device=self.kv.device)
        header = dataclasses.replace(self.header, num_blocks=len(indices), **header_changes)
        return PageSet(header, self.kv.index_select(2, idx).contiguous())


# ----------------------------------------------------------------------------- wire bytes in a cache
def layer_bytes(header: PageSetHeader) -> int:
    """Bytes of one layer (K and V of every block) of a page set: the framing unit."""
    return header.nbytes // header.layout.num_layers


def block_ranges(cache: torch.Tensor, header: PageSetHeader, block_ids: Sequence[int],
                 layers: tuple[int, int]) -> list[tuple[int, int]]:
    """``(byte offset in cache, length)`` of the cache regions that the page-set bytes of
    ``layers`` land in, in wire order ([L, 2, n, ...]: per layer, K then V, blocks in page-set
    order). Consecutive block ids are one range, so an engine's usual allocation needs two
    ranges a layer. ``cache`` is a contiguous [L, 2, N, bs, H, D] host cache."""
    num_cache_blocks = cache.shape[2]
    unit = header.layout.bytes_per_block // (2 * header.layout.num_layers)  # one block, one layer, K or V
    runs = block_runs(block_ids)
    return [((lk * num_cache_blocks + first) * unit, n * unit)
            for lk in range(2 * layers[0], 2 * layers[1]) for _, first, n in runs]


def block_views(cache: torch.Tensor, header: PageSetHeader, block_ids: Sequence[int],
                layers: tuple[int, int]) -> list[memoryview]:
    """Writable memoryviews over ``block_ranges``: what ``recvmsg_into`` scatters into."""
    mv = memoryview(cache.view(-1).view(torch.uint8).numpy())
    return [mv[off:off + n] for off, n in block_ranges(cache, header, block_ids, layers)]
