"""What happens to a sampled token before the user sees it: the thinking budget may replace it,
it is appended and detokenized, and stop conditions decide whether its branch is done.

Pure Python (the tokenizer is the only dependency). The scheduler frees blocks; this module only
decides, so the order of checks is in one place::

    sampled ─▶ thinking budget spent? → </think> ─▶ append ─▶ stop token? ─▶ stop string? ─▶ length?
"""
from __future__ import annotations

from typing import Sequence as Seq

from .outputs import CompletionOutput, RequestOutput
from .plan import SampledToken
from .sequence import Request, Sequence
from .tokenizer import find_stop


class OutputProcessor:
    def __init__(self, tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.think_start = tokenizer.think_start_id
        self.think_end = tokenizer.think_end_id

    # ---- thinking state -------------------------------------------------------------------
    def init_thinking(self, seq: Sequence) -> None:
        """Derive the thinking state from the tokens so far (new, imported or recomputed
        sequences): prompt tokens set whether we are inside <think>, only outputs count."""
        seq.in_thinking, seq.num_thinking_tokens = False, 0
        for pos, t in enumerate(seq.token_ids):
            self._track_thinking(seq, t, counts=pos >= seq.num_prompt_tokens)

    def _track_thinking(self, seq: Sequence, token: int, *, counts: bool = True) -> None:
        if self.think_start is None or self.think_end is None:
            return
        if seq.in_thinking:
            if token == self.think_end:
                seq.in_thinking = False
            elif counts:
                seq.num_thinking_tokens += 1
        elif token == self.think_start:
            seq.in_thinking = True

    def init_text(self, seq: Sequence) -> None:
        """Detokenizer state for outputs that already exist (imports)."""
        seq.detokenizer = self.tokenizer.incremental_decoder()
        if seq.output_token_ids:
            seq.detokenizer.add(seq.output_token_ids)

    # ---- one sampled token ----------------------------------------------------------------
    def append(self, req: Request, seq: Sequence, sampled: SampledToken) -> str | None:
        """Append ``sampled`` to ``seq``; returns the finish reason when the branch is done."""
        p = req.params
        token, forced = sampled.token_id, False
        if (p.thinking_budget is not None and seq.in_thinking and seq.num_thinking_tokens >= p.thinking_budget
                and token != self.think_end):
            token, forced = self.think_end, True  # the budget is spent: make the model answer
        self._track_thinking(seq, token)
        seq.token_ids.append(token)
        if p.logprobs is not None:
            entry = dict(sampled.top_logprobs or ())
            if not forced and sampled.logprob is not None:
                entry[token] = sampled.logprob
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(entry)
        if seq.detokenizer is None:
            seq.detokenizer = self.tokenizer.incremental_decoder()

        if token in p.stop_token_ids or (not p.ignore_eos and token in self.tokenizer.eos_token_ids):
            return "stop"  # the stop token stays in token_ids but adds no text
        delta = seq.detokenizer.add([token])
        if p.stop and delta:
            cut = find_stop(seq.detokenizer.text, p.stop, len(delta))
            if cut is not None:
                seq.detokenizer.text = seq.detokenizer.text[:cut]
                return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    # ---- outputs --------------------------------------------------------------------------
    def step_outputs(self, out_of_capacity: Seq[Request], progress,
                     hidden: dict[int, tuple[float, ...]] | None = None) -> list[RequestOutput]:
        """One step's outputs: requests ended for lack of capacity, then every request that got
        a token (``progress``: the scheduler's ``StepProgress``; ``hidden``: the hidden states the
        runner returned, by seq id)."""
        outputs = [self.request_output(req, {}) for req in out_of_capacity]
        outputs += [self.request_output(req, progress.new_tokens, prefilled=req.request_id in progress.prefilled,
                                        hidden=hidden) for req in progress.requests]
        return outputs

    @staticmethod
    def request_output(req: Request, new_tokens: dict[int, list[int]], *, prefilled: bool = False,
                       hidden: dict[int, tuple[float, ...]] | None = None) -> RequestOutput:
        outputs = []
        for seq in sorted(req.seqs, key=lambda s: s.index):
            outputs.append(CompletionOutput(
                index=seq.index,
                token_ids=seq.output_token_ids,  # a fresh list (a slice): no second copy per step
                new_token_ids=new_tokens.get(seq.seq_id, []),
                text=seq.detokenizer.text if seq.detokenizer is not None else "",
                finish_reason=seq.finish_reason,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                hidden_state=hidden.get(seq.seq_id) if hidden else None,
            ))
        return RequestOutput(req.request_id, list(req.prompt_token_ids), outputs, req.is_finished, prefilled)


def check_token_ids(field: str, token_ids: Seq[int], vocab_size: int) -> list[int]:
    """ints in [0, vocab_size), else ValueError naming the field, the position and the limit."""
    out = []
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ValueError(f"{field}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")
        out.append(int(t))
    return out
