"""A request and its branches (sequences), the state the scheduler and block manager share.

Pure Python. A ``Request`` is what a user submitted; its ``Sequence`` objects are the branches
(Best-of-N). Before the prompt is computed a request with ``n > 1`` has a single root sequence;
the step that computes the prompt's last token samples all ``n`` first tokens from that one
position, each with its branch's seed (fan-out), and the root is then forked ``n`` ways, the
branches sharing the prompt blocks copy-on-write::

    root: [p0 .. p(L-1)] computed once → n samples ──fork──▶ branch 0: [.. p(L-1) o0] (seed b0)
                                                             branch 1: [.. p(L-1) o0'] (seed b1) ...

Token bookkeeping of one sequence (``token_ids`` = prompt + outputs)::

    |<------------ num_computed_tokens ----------->|<- computed next ->|
    [ prompt ....................... | outputs ...                     ]
                                                                      ^ len(token_ids)

The scheduler computes ``token_ids[num_computed_tokens:]`` and samples when it reaches the end.
"""
from __future__ import annotations

import enum

from .sampling_params import SamplingParams, branch_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # no device blocks (new, or preempted by recompute)
    RUNNING = "running"  # holds device blocks, scheduled every step
    SWAPPED = "swapped"  # preempted: its KV sits in host blocks or in the external swap space
    HELD = "held"  # prefill role: prompt computed, first tokens sampled, waiting for export
    EXPORTED = "exported"  # handed to another instance; blocks held until release_request
    FINISHED = "finished"


class Sequence:
    """One branch: its tokens, how many of them are in the KV cache, and where."""

    def __init__(self, seq_id: int, index: int, token_ids: list[int], num_prompt_tokens: int, seed: int):
        self.seq_id = seq_id
        self.index = index  # branch index within the request (Best-of-N)
        self.token_ids = token_ids
        self.num_prompt_tokens = num_prompt_tokens
        self.seed = seed  # branch_seed(request seed, index)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []  # device block ids, position p lives in block_table[p // block_size]
        self.host_block_table: list[int] = []  # while swapped out to the host block pool
        # While swapped out to an external swap space: positions into the request's stored blocks.
        self.swap_indices: list[int] = []
        # Chain hashes of this sequence's full blocks, filled lazily by the block manager; the
        # first ``num_registered_blocks`` of them are (or were offered to) the prefix cache.
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] | None = None
        # Thinking budget bookkeeping: inside <think>, and how many tokens spent there so far.
        self.in_thinking = False
        self.num_thinking_tokens = 0
        # Filled by the engine: incremental detokenizer of the outputs.
        self.detokenizer = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, branch={self.index}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


class Request:
    """A submitted prompt with its sampling parameters and its branches."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                 arrival: int, seqs: list[Sequence], *, forked: bool):
        assert params.seed is not None, "the engine fixes a seed at admission"
        self.request_id = request_id
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.params = params
        self.priority = priority  # lower = more urgent
        self.arrival = arrival  # FCFS order within a priority class
        self.seqs = seqs
        self.forked = forked  # False while a Best-of-N root still has to be split into branches
        self.status = RequestStatus.WAITING
        # External swap space: the key its KV sits under while swapped out there (None otherwise),
        # how many unique blocks that is, and how many times it was swapped out (the key's epoch).
        self.swap_key = None  # plan.SwapKey | None
        self.num_swapped_blocks = 0
        self.num_swap_outs = 0
        # Early consensus: held prompt KV kept for a Best-of-N request's later waves, which the
        # scheduler frees when it needs the blocks (``LLMEngine.fork_held(reserve=True)``).
        self.reserve = False

    @property
    def sort_key(self) -> tuple[int, int]:
        """Most urgent first: priority class, then arrival."""
        return (self.priority, self.arrival)

    @property
    def needs_fork(self) -> bool:
        return not self.forked and self.params.n > 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.finish_reason is None]

    @property
    def is_finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    @property
    def num_seqs_reserved(self) -> int:
        """Batch slots the request needs once running: all its branches, even before the fork."""
        seqs = self.seqs
        if len(seqs) == 1 and (self.forked or self.params.n <= 1):
            # one branch (most requests; summed over a whole batch per engine report)
            return 1 if seqs[0].finish_reason is None else 0
        if not self.forked and self.params.n > 1:
            return self.params.n
        n = 0
        for s in seqs:
            if s.finish_reason is None:
                n += 1
        return n

    def branch_seed(self, index: int) -> int:
        return branch_seed(self.params.seed, index)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, {self.status.value}, prio={self.priority}, seqs={self.seqs})"
