"""Stable content hashes for full KV blocks, chained so a hash names a whole prefix.

    block 0 tokens ──▶ h0 = H(None, t[0:bs])
    block 1 tokens ──▶ h1 = H(h0,   t[bs:2bs])      equal h1  <=>  equal first 2*bs tokens
    ...

The same function keys the engine's prefix cache and the CPU KV store, so it must not depend on
the process (Python's ``hash`` of str is salted per process; blake2b is not).
"""
from __future__ import annotations

import hashlib
import struct
from typing import Sequence

_NO_PARENT = 0xFFFF_FFFF_FFFF_FFFF


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", _NO_PARENT if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return int.from_bytes(h.digest(), "little")


def hash_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
