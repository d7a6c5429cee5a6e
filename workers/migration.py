"""Requests in flight ↔ ``ExportedRequest``: the pure half of export/import (no torch).

Export lists each unique device block once, in the order the branches first use it, so shared
prompt blocks of Best-of-N branches travel once. Import gives fresh blocks in the same order and
rebuilds every branch's block table from its ``block_indices``.
"""
from __future__ import annotations

from typing import Sequence as Seq

from .block_manager import BlockManager
from .outputs import ExportedBranch, ExportedRequest
from .sampling_params import branch_seed
from .sequence import Request, Sequence


def export(req: Request, block_size: int) -> ExportedRequest:
    """The unfinished branches of ``req`` and the blocks holding their computed KV."""
    block_ids: list[int] = []
    position: dict[int, int] = {}
    branches = []
    for seq in req.unfinished_seqs:
        used = seq.block_table[:-(-seq.num_computed_tokens // block_size)]  # only computed KV travels
        for b in used:
            if b not in position:
                position[b] = len(block_ids)
                block_ids.append(b)
        branches.append(ExportedBranch(
            index=seq.index,
            output_token_ids=tuple(seq.output_token_ids),
            num_computed_tokens=seq.num_computed_tokens if used else 0,
            block_indices=tuple(position[b] for b in used),
        ))
    return ExportedRequest(req.request_id, req.prompt_token_ids, req.params, req.priority,
                           tuple(block_ids), tuple(branches))


def validate(exported: ExportedRequest, *, vocab_size: int, max_model_len: int, block_size: int) -> None:
    """Raises ValueError naming the field when ``exported`` cannot be continued here."""
    if not exported.branches:
        raise ValueError(f"exported request {exported.request_id!r} has no branches")
    if not exported.prompt_token_ids:
        raise ValueError("prompt_token_ids must not be empty")
    indices = [b.index for b in exported.branches]
    if len(set(indices)) != len(indices) or not all(0 <= i < exported.params.n for i in indices):
        raise ValueError(f"branch indices {indices} must be distinct and in [0, n={exported.params.n})")
    for b in exported.branches:
        tokens = exported.prompt_token_ids + b.output_token_ids
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"branch {b.index}: token id {bad} is outside the vocabulary [0, {vocab_size})")
        if len(tokens) > max_model_len:
            raise ValueError(f"branch {b.index}: {len(tokens)} tokens exceed max_model_len {max_model_len}")
        if not 0 <= b.num_computed_tokens < len(tokens):
            raise ValueError(f"branch {b.index}: num_computed_tokens {b.num_computed_tokens} must be in "
                             f"[0, {len(tokens)}) (a branch continues from an uncomputed token)")
        needed = -(-b.num_computed_tokens // block_size)
        if len(b.block_indices) != needed:
            raise ValueError(f"branch {b.index}: {len(b.block_indices)} block_indices for {b.num_computed_tokens} "
                             f"computed tokens; block_size {block_size} needs {needed}")
        if any(not 0 <= i < len(exported.block_ids) for i in b.block_indices):
            raise ValueError(f"branch {b.index}: block_indices must be in [0, {len(exported.block_ids)})")


def build_request(exported: ExportedRequest, block_ids: Seq[int], bm: BlockManager, new_seq_id, arrival: int) -> Request:
    """The request continuing ``exported`` on blocks ``block_ids`` (one reference each, from
    ``BlockManager.allocate_blocks``). References are adjusted to the branches sharing them."""
    refs = [0] * len(block_ids)
    for b in exported.branches:
        for i in b.block_indices:
            refs[i] += 1
    bm.free_blocks([block_ids[i] for i, r in enumerate(refs) if r == 0])
    bm.incref_blocks([block_ids[i] for i, r in enumerate(refs) for _ in range(r - 1)])
    seqs = []
    prompt = list(exported.prompt_token_ids)
    for b in exported.branches:
        seq = Sequence(new_seq_id(), b.index, prompt + list(b.output_token_ids), len(prompt),
                       branch_seed(exported.params.seed, b.index))
        seq.block_table = [block_ids[i] for i in b.block_indices]
        seq.num_computed_tokens = b.num_computed_tokens
        bm.register_computed_blocks(seq)  # imported full blocks serve prefix hits here too
        seqs.append(seq)
    return Request(exported.request_id, prompt, exported.params, exported.priority, arrival, seqs,
                   forked=not _unsplit_root(exported))


def _unsplit_root(exported: ExportedRequest) -> bool:
    """A lone branch 0 without outputs of a Best-of-N request is a root that was never split."""
    b = exported.branches
    return exported.params.n > 1 and len(b) == 1 and b[0].index == 0 and not b[0].output_token_ids


def import_seqs(exported: ExportedRequest) -> int:
    """Batch slots the request ``build_request`` makes of ``exported`` takes once running
    (``Request.num_seqs_reserved``): an unsplit root reserves all ``n`` of its branches."""
    return exported.params.n if _unsplit_root(exported) else len(exported.branches)

