"""Paged-KV block accounting: which device (and host) blocks each sequence owns.

Pure Python, no torch: it hands out block *ids*; the model runner owns the tensors. Running out of
blocks is a normal outcome (``None`` / ``False``), a broken invariant raises ``BlockManagerError``.

Device blocks are in exactly one of three places::

    free (never cached)  ──allocate──▶  in use (ref_count >= 1)  ──last free──▶  free (uncached)
    deque, FIFO                          │        ▲                              or, when the block
                                         │        └────── prefix hit ─────────── holds a full hashed
                                         ▼                                       block, *evictable*
                                  evictable (ref 0, hashed, LRU order) ──allocate when no free──▶

A full block whose KV is computed gets a content hash (``block_hash.py``: a chain, so a hash
names the whole prefix up to that block). A later sequence whose prompt starts with the same
tokens reuses it (refcount + 1) instead of recomputing. Freed hashed blocks stay reusable until an
allocation needs the space; the least recently freed goes first, and a sequence frees its blocks
tail first so a prefix's head outlives its tail.

Forking (Best-of-N) shares every block; the first write into a shared block copies it
(copy-on-write: ``append_slots`` returns ``(src, dst)`` pairs for the model runner).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable, Sequence as Seq

from .block_hash import hash_block
from .prefix_journal import PrefixCursor, PrefixDelta, PrefixJournal
from .sequence import Sequence


class BlockManagerError(RuntimeError):
    """A block-accounting invariant is broken (a bug, never a capacity problem)."""


class HostBlockPool:
    """Swap space in host memory: refcounted ids, no prefix cache (swapped KV is private)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise BlockManagerError("host block pool is empty; callers must check capacity first")
        block = self._free.popleft()
        self.ref_count[block] = 1
        return block

    def decref(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise BlockManagerError(f"host block {block} freed more often than allocated")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            self._free.append(block)

    def check_integrity(self, host_block_tables: Iterable[Seq[int]]) -> None:
        refs = [0] * self.num_blocks
        for table in host_block_tables:
            for b in table:
                refs[b] += 1
        if refs != self.ref_count:
            bad = [b for b in range(self.num_blocks) if refs[b] != self.ref_count[b]]
            raise BlockManagerError(f"host blocks {bad[:8]}: ref_count {[self.ref_count[b] for b in bad[:8]]} "
                                    f"!= references {[refs[b] for b in bad[:8]]}")
        free = set(self._free)
        if len(free) != len(self._free) or free != {b for b in range(self.num_blocks) if refs[b] == 0}:
            raise BlockManagerError("host free list differs from the set of unreferenced host blocks")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._hash_to_block: dict[int, int] = {}
        # Every hash entering or leaving the prefix cache, for the router's prefix index; started
        # by the first ``prefix_delta`` (nothing is recorded while nobody follows it).
        self.prefix_journal: PrefixJournal | None = None
        self.host = HostBlockPool(num_host_blocks)
        self.num_prefix_hit_blocks = 0  # counters for stats
        self.num_prefix_queried_blocks = 0

    # ---- capacity -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- low-level block verbs ------------------------------------------------------------
    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            h = self.block_hash[block]
            if self._hash_to_block.get(h) == block:
                del self._hash_to_block[h]
                if self.prefix_journal is not None:
                    self.prefix_journal.evicted(h)
            self.block_hash[block] = None
        else:
            raise BlockManagerError("no free device block; callers must check capacity first")
        if self.ref_count[block] != 0:
            raise BlockManagerError(f"block {block} was free with ref_count {self.ref_count[block]}")
        self.ref_count[block] = 1
        return block

    def _incref(self, block: int) -> None:
        if self.ref_count[block] == 0:
            # A prefix hit on a freed cached block revives it.
            if block not in self._evictable:
                raise BlockManagerError(f"block {block} has ref_count 0 but is not evictable")
            del self._evictable[block]
        self.ref_count[block] += 1

    def _decref(self, block: int) -> None:
        if self.ref_count[block] <= 0:
            raise BlockManagerError(f"block {block} freed more often than allocated")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.enable_prefix_caching and self.block_hash[block] is not None:
                self._evictable[block] = None  # most recently freed goes last
            else:
                self.block_hash[block] = None
                self._free.append(block)

    def allocate_blocks(self, num_blocks: int) -> list[int] | None:
        """Fresh private blocks (ref_count 1), e.g. for an imported page set; None when short."""
        if num_blocks > self.num_free_blocks:
            return None
        return [self._take_block() for _ in range(num_blocks)]

    def incref_blocks(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self.ref_count[b] == 0:
                raise BlockManagerError(f"incref of free block {b}")
            self._incref(b)

    def free_blocks(self, block_ids: Seq[int]) -> None:
        """Drop one reference to each block, tail first (so a prefix's head stays cached longest)."""
        for b in reversed(block_ids):
            self._decref(b)

    # ---- prefix cache ---------------------------------------------------------------------
    def _ensure_hashes(self, seq: Sequence, num_full_blocks: int) -> None:
        bs = self.block_size
        while len(seq.block_hashes) < num_full_blocks:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs]))

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the leading full blocks of ``seq`` (no side effects on blocks).
        At least one token is left to compute: its logits are what the sequence samples from."""
        if not self.enable_prefix_caching:
            return []
        max_hits = (seq.num_tokens - 1) // self.block_size
        self._ensure_hashes(seq, max_hits)
        hits = []
        for h in seq.block_hashes[:max_hits]:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def prefix_delta(self, since: PrefixCursor) -> PrefixDelta:
        """The block hashes that entered and left the prefix cache since ``since`` (the first call
        starts the journal: a full resync)."""
        if self.prefix_journal is None:
            self.prefix_journal = PrefixJournal(max_events=max(1024, 4 * self.num_blocks))
            self.prefix_journal.held.update(self._hash_to_block)
        return self.prefix_journal.since(since)

    def cached_prefix(self, token_ids: Seq[int]) -> tuple[list[int], list[int]]:
        """(hashes, block ids) of the cached full blocks that start ``token_ids``. Read-only."""
        hashes, blocks, parent = [], [], None
        bs = self.block_size
        for start in range(0, len(token_ids) - bs + 1, bs):
            parent = hash_block(parent, token_ids[start:start + bs])
            block = self._hash_to_block.get(parent) if self.enable_prefix_caching else None
            if block is None:
                break
            hashes.append(parent)
            blocks.append(block)
        return hashes, blocks

    def cache_blocks(self, hashes: Seq[int]) -> list[tuple[int, bool]] | None:
        """Make room for prefix blocks named by ``hashes`` (a chain, from the first block on).
        Returns one ``(block_id, needs_fill)`` per hash, each holding one reference: a fresh
        block to write the KV into, or the block already caching that hash (pinned, so filling
        one block cannot evict its own parent). The caller writes the KV, then ``free_blocks``
        every id, which leaves them cached and evictable. None when there is no room."""
        if not self.enable_prefix_caching:
            return None
        cached = [self._hash_to_block.get(h) for h in hashes]
        num_new = sum(b is None for b in cached)
        pinned_idle = sum(1 for b in cached if b is not None and self.ref_count[b] == 0)
        if num_new > self.num_free_blocks - pinned_idle:
            return None
        for b in cached:
            if b is not None:
                self._incref(b)
        out = []
        for h, b in zip(hashes, cached):
            if b is None:
                b = self._take_block()
                self.block_hash[b] = h
                self._hash_to_block[h] = b
                if self.prefix_journal is not None:
                    self.prefix_journal.added(h)
                out.append((b, True))
            else:
                out.append((b, False))
        return out

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer the full blocks ``seq`` has computed to the prefix cache (after each step)."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_registered_blocks:
            return
        self._ensure_hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block, h = seq.block_table[i], seq.block_hashes[i]
            if self.block_hash[block] is None and h not in self._hash_to_block:
                self.block_hash[block] = h
                self._hash_to_block[h] = block
                if self.prefix_journal is not None:
                    self.prefix_journal.added(h)
            # else: already this block (a prefix hit) or a duplicate computed concurrently by
            # another sequence; the first copy stays the cached one.
        seq.num_registered_blocks = num_full

    # ---- sequence verbs -------------------------------------------------------------------
    def _allocation_need(self, seq: Sequence) -> tuple[list[int], int]:
        hits = self._match_prefix(seq)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        # Hits on evictable blocks take them out of the pool the new blocks come from.
        revived = sum(1 for b in hits if self.ref_count[b] == 0)
        return hits, num_new + revived

    def allocate(self, seq: Sequence) -> int | None:
        """Blocks for every token of ``seq`` (a new or recomputed sequence), reusing cached prefix
        blocks. Returns the number of tokens found in the cache (now ``num_computed_tokens``), or
        None when there is not enough room (nothing changes)."""
        if seq.block_table:
            raise BlockManagerError(f"seq {seq.seq_id} already has blocks {seq.block_table}")
        hits, need = self._allocation_need(seq)
        if need > self.num_free_blocks:
            return None
        for b in hits:
            self._incref(b)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        seq.block_table = hits + [self._take_block() for _ in range(num_new)]
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        if self.enable_prefix_caching:
            self.num_prefix_queried_blocks += (seq.num_tokens - 1) // self.block_size
            self.num_prefix_hit_blocks += len(hits)
        return seq.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        self.free_blocks(seq.block_table)
        seq.block_table = []

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (copy-on-write)."""
        if child.block_table:
            raise BlockManagerError(f"fork target seq {child.seq_id} already has blocks")
        for b in parent.block_table:
            self._incref(b)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def _write_range(self, seq: Sequence) -> range:
        """Indices into the block table of the blocks the next computation writes."""
        if seq.num_uncomputed_tokens <= 0:
            return range(0)
        return range(seq.num_computed_tokens // self.block_size, (seq.num_tokens - 1) // self.block_size + 1)

    def num_blocks_to_append(self, seqs: Seq[Sequence]) -> int:
        """Fresh blocks ``append_slots`` would take for ``seqs``, called in this order. A block
        shared k ways among them needs only k-1 copies: the last writer owns it by then."""
        if len(seqs) == 1:
            return self._own_need(seqs[0])
        need, released = 0, {}
        for seq in seqs:
            for i in self._write_range(seq):
                if i >= len(seq.block_table):
                    need += 1
                    continue
                b = seq.block_table[i]
                if self.ref_count[b] - released.get(b, 0) > 1:
                    need += 1
                    released[b] = released.get(b, 0) + 1
        return need

    def _own_need(self, seq: Sequence) -> int:
        """``num_blocks_to_append([seq])``, without the bookkeeping of blocks shared among several
        of the given sequences (one sequence's table never names a block twice). It runs for
        every sequence of every step, so it is written for speed."""
        computed, total = seq.num_computed_tokens, len(seq.token_ids)
        if total <= computed:
            return 0
        bs, table, rc = self.block_size, seq.block_table, self.ref_count
        lo, hi, have = computed // bs, (total - 1) // bs + 1, len(table)
        need = hi - have if hi > have else 0
        for i in range(lo, hi if hi < have else have):
            if rc[table[i]] > 1:
                need += 1
        return need

    def can_append(self, seqs: Seq[Sequence]) -> bool:
        need = self._own_need(seqs[0]) if len(seqs) == 1 else self.num_blocks_to_append(seqs)
        return need <= len(self._free) + len(self._evictable)

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Make every block that the uncomputed tokens of ``seq`` go into exist and belong to
        ``seq`` alone. Returns the copy-on-write ``(src, dst)`` pairs (often empty), or None when
        there are not enough free blocks (nothing changes)."""
        need = self._own_need(seq)
        if need == 0:  # the common decode step: its slot is in a block the sequence owns
            return []
        if need > self.num_free_blocks:
            return None
        copies = []
        bs = self.block_size
        for i in self._write_range(seq):
            if i >= len(seq.block_table):
                seq.block_table.append(self._take_block())
                continue
            b = seq.block_table[i]
            if self.ref_count[b] > 1:
                if self.block_hash[b] is not None and (i + 1) * bs <= seq.num_computed_tokens:
                    raise BlockManagerError(f"seq {seq.seq_id} would write into full cached block {b}")
                new = self._take_block()
                self._decref(b)
                seq.block_table[i] = new
                if i * bs < seq.num_computed_tokens:  # only computed slots need their KV carried over
                    copies.append((b, new))
        return copies

    # ---- swapping -------------------------------------------------------------------------
    @staticmethod
    def unique_blocks(tables: Iterable[Seq[int]]) -> list[int]:
        seen: dict[int, None] = {}
        for table in tables:
            for b in table:
                seen.setdefault(b, None)
        return list(seen)

    def swap_out(self, seqs: Seq[Sequence]) -> list[tuple[int, int]] | None:
        """Move the blocks of ``seqs`` (one request's branches) to host blocks, keeping the sharing
        between them. Returns ``(device, host)`` copies, or None when the host pool is short."""
        unique = self.unique_blocks(s.block_table for s in seqs)
        if len(unique) > self.host.num_free_blocks:
            return None
        to_host = {b: self.host.allocate() for b in unique}
        for seq in seqs:
            seq.host_block_table = [to_host[b] for b in seq.block_table]
        # A host block is referenced once per table entry, like its device block was.
        counts: dict[int, int] = {}
        for seq in seqs:
            for b in seq.block_table:
                counts[b] = counts.get(b, 0) + 1
        for b, c in counts.items():
            self.host.ref_count[to_host[b]] = c
        for seq in seqs:
            self.free(seq)
        return [(b, to_host[b]) for b in unique]

    def swap_in(self, seqs: Seq[Sequence]) -> list[tuple[int, int]] | None:
        """Back from host blocks to fresh device blocks. Returns ``(host, device)`` copies, or None."""
        unique = self.unique_blocks(s.host_block_table for s in seqs)
        if len(unique) > self.num_free_blocks:
            return None
        to_dev = {h: self._take_block() for h in unique}
        counts: dict[int, int] = {}
        for seq in seqs:
            for h in seq.host_block_table:
                counts[h] = counts.get(h, 0) + 1
        for h, c in counts.items():
            self.ref_count[to_dev[h]] = c
        for seq in seqs:
            seq.block_table = [to_dev[h] for h in seq.host_block_table]
            for h in seq.host_block_table:
                self.host.decref(h)
            seq.host_block_table = []
            seq.num_registered_blocks = 0  # fresh blocks: offer them to the prefix cache again
        return [(h, to_dev[h]) for h in unique]

    # ---- swapping to an external swap space (keys, not host block ids) ----------------------
    def release_for_swap(self, seqs: Seq[Sequence]) -> list[int]:
        """Free the device blocks of ``seqs`` (one request's branches) for a swap-out to an
        external swap space. Returns the unique blocks in storing order; each branch keeps
        ``swap_indices``, its blocks' positions in that order (shared blocks are stored once).
        The caller reads their KV before anything else writes the freed blocks."""
        unique = self.unique_blocks(s.block_table for s in seqs)
        pos = {b: i for i, b in enumerate(unique)}
        for seq in seqs:
            seq.swap_indices = [pos[b] for b in seq.block_table]
            self.free(seq)
        return unique

    def claim_for_swap_in(self, seqs: Seq[Sequence], num_blocks: int) -> list[int] | None:
        """Fresh device blocks for a swap-in from an external swap space (``release_for_swap``
        in reverse). Returns the blocks in storing order, or None when short (nothing changes)."""
        if num_blocks > self.num_free_blocks:
            return None
        fresh = [self._take_block() for _ in range(num_blocks)]
        counts: dict[int, int] = {}
        for seq in seqs:
            for i in seq.swap_indices:
                counts[i] = counts.get(i, 0) + 1
        if set(counts) != set(range(num_blocks)):
            raise BlockManagerError(f"swap indices {sorted(counts)} do not cover the {num_blocks} stored blocks")
        for i, c in counts.items():
            self.ref_count[fresh[i]] = c
        for seq in seqs:
            seq.block_table = [fresh[i] for i in seq.swap_indices]
            seq.swap_indices = []
            seq.num_registered_blocks = 0  # fresh blocks: offer them to the prefix cache again
        return fresh

    # ---- integrity ------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[Seq[int]], host_block_tables: Iterable[Seq[int]] = ()) -> None:
        """Every block accounted for: ref_count equals the references the caller knows of, and
        every unreferenced block is free or evictable, exactly once."""
        refs = [0] * self.num_blocks
        for table in block_tables:
            for b in table:
                refs[b] += 1
        if refs != self.ref_count:
            bad = [b for b in range(self.num_blocks) if refs[b] != self.ref_count[b]]
            raise BlockManagerError(f"device blocks {bad[:8]}: ref_count {[self.ref_count[b] for b in bad[:8]]} "
                                    f"!= references {[refs[b] for b in bad[:8]]} (a leak or a double free)")
        free, evictable = list(self._free), list(self._evictable)
        idle = free + evictable
        if len(set(idle)) != len(idle):
            raise BlockManagerError("a block is listed twice among free/evictable blocks")
        if set(idle) != {b for b in range(self.num_blocks) if refs[b] == 0}:
            raise BlockManagerError("free + evictable blocks differ from the set of unreferenced blocks")
        for b in evictable:
            if self.block_hash[b] is None:
                raise BlockManagerError(f"evictable block {b} has no hash")
        for h, b in self._hash_to_block.items():
            if self.block_hash[b] != h:
                raise BlockManagerError(f"prefix cache maps hash {h:#x} to block {b}, which holds {self.block_hash[b]}")
        if self.prefix_journal is not None and self.prefix_journal.held != self._hash_to_block.keys():
            raise BlockManagerError("the prefix journal's blocks differ from the prefix cache's")
        self.host.check_integrity(host_block_tables)
