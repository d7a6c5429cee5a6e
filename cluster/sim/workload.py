"""Workloads the simulator replays: a reasoning mix generator and Mooncake-format traces.

Prompts are not stored as token lists (100k requests would not fit): a request carries the recipe
of its prompt, and ``prompt_tokens`` builds the ids when the request reaches an engine. Tokens of
a trace's ``hash_ids`` block ``h`` are all ``h + 1``, so equal hash ids at equal positions give
equal prefixes and the real block manager's prefix cache finds them; the rest of a prompt is
made of a token unique to the request (negative ids: never equal to a shared block's).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHORT, LONG = "short", "long"
CLASSES = (SHORT, LONG)
TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids name 512-token blocks
TRACE_MAX_TOKENS = 2048   # the conversation trace's outputs are all <= 2,000 tokens
# A generated prompt opens with a few tokens saying what kind of request it is (a chat turn, a
# competition problem), as real prompts' system prompts and wording do: what a length predictor
# reading the prompt has to go on. Two topics; real traffic has many more.
TOPIC_TOKENS = 16
TOPIC_OF = {"short": 1_000_001, "long": 1_000_002}


@dataclass(frozen=True)
class SimRequest:
    request_id: str
    arrival: float                   # seconds from the start
    prompt_len: int
    output_lens: tuple[int, ...]     # one per Best-of-N branch (n = len)
    cls: str = SHORT                 # request class: SHORT (chat) or LONG (chain of thought)
    max_tokens: int = 2048           # what the client asks for (the router sees this)
    hash_ids: tuple[int, ...] = ()   # shared prefix blocks (TRACE_BLOCK_TOKENS tokens each)
    salt: int = 0                    # makes the unshared part of the prompt unique
    answers: tuple[str, ...] = ()    # Best-of-N: each branch's final answer
    correct_answer: str | None = None
    topic: int | None = None         # generated prompts open with TOPIC_TOKENS tokens of their kind

    @property
    def n(self) -> int:
        return len(self.output_lens)

    def may_share_prefix(self, block_size: int) -> bool:
        """Whether this prompt's first full KV block can equal another request's (the prefix
        cache can only hit through the first block): a trace's shared blocks, or topic tokens
        filling a whole block. Every other token of a prompt is unique to the request."""
        if self.prompt_len <= block_size:
            return False
        topic = 0 if self.topic is None else min(TOPIC_TOKENS, self.prompt_len - 1)
        return bool(self.hash_ids) or topic >= block_size

    def prompt_tokens(self) -> list[int]:
        tokens: list[int] = [] if self.topic is None else [self.topic] * min(TOPIC_TOKENS, self.prompt_len - 1)
        for h in self.hash_ids:
            tokens.extend([h + 1] * TRACE_BLOCK_TOKENS)
        del tokens[self.prompt_len:]
        tokens.extend([-(self.salt + 1)] * (self.prompt_len - len(tokens)))
        return tokens


@dataclass(frozen=True)
class ReasoningMix:
    """Short chat requests plus long chain-of-thought ones with heavy-tailed output lengths.

    Long outputs are lognormal with median ``long_median`` and sigma chosen so that the p99 lands
    on ``max_output`` (32,768, what DeepSeek-R1 evaluates with); they are capped there."""

    long_share: float = 0.4
    short_median: int = 300
    short_sigma: float = 0.8
    short_max: int = 2048
    long_median: int = 3000
    max_output: int = 32768
    prompt_median_short: int = 600
    prompt_median_long: int = 300
    prompt_sigma: float = 0.7
    prompt_max: int = 8192
    best_of_n_share: float = 0.1     # share of long requests asking for Best-of-N
    best_of_n: int = 4
    burstiness: float = 1.0          # coefficient of variation of inter-arrival gaps (1: Poisson)

    @property
    def long_sigma(self) -> float:
        return math.log(self.max_output / self.long_median) / 2.3263  # z of the 99th percentile

    def generate(self, rate: float, num_requests: int, seed: int, max_model_len: int = 32768) -> list[SimRequest]:
        if rate <= 0 or num_requests < 1:
            raise ValueError(f"rate must be > 0 and requests >= 1, got {rate} and {num_requests}")
        rng = np.random.default_rng(seed)
        gaps = _gaps(rng, rate, num_requests, self.burstiness)
        arrivals = np.cumsum(gaps) - gaps[0]
        is_long = rng.random(num_requests) < self.long_share
        out = []
        for i in range(num_requests):
            long = bool(is_long[i])
            median = self.prompt_median_long if long else self.prompt_median_short
            prompt = int(min(self.prompt_max, max(16, rng.lognormal(math.log(median), self.prompt_sigma))))
            prompt = min(prompt, max_model_len // 4)
            cap = min(self.max_output if long else self.short_max, max_model_len - prompt)
            n = self.best_of_n if long and rng.random() < self.best_of_n_share else 1
            mu, sigma = (math.log(self.long_median), self.long_sigma) if long else (math.log(self.short_median), self.short_sigma)
            lens = tuple(int(min(cap, max(1, x))) for x in rng.lognormal(mu, sigma, n))
            answers, correct = (), None
            if n > 1:
                # Each branch is right with a per-question probability; wrong ones scatter over a
                # few distractors, so a vote (and an early stop) has something to decide.
                p = rng.uniform(0.3, 0.95)
                correct = "A"
                answers = tuple(correct if rng.random() < p else f"W{int(rng.integers(1, 4))}" for _ in range(n))
            cls = LONG if long else SHORT
            out.append(SimRequest(f"r{i}", float(arrivals[i]), prompt, lens, cls, cap, salt=i, answers=answers,
                                  correct_answer=correct, topic=TOPIC_OF[cls]))
        return out


def _gaps(rng: np.random.Generator, rate: float, k: int, cv: float) -> np.ndarray:
    if cv == 1.0:
        return rng.exponential(1.0 / rate, k)
    shape = 1.0 / (cv * cv)  # gamma gaps: mean 1/rate, coefficient of variation cv
    return rng.gamma(shape, 1.0 / (rate * shape), k)


def load_trace(path: str | Path, num_requests: int | None = None, rate: float | None = None,
               short_threshold: int = 1024, max_model_len: int = 32768) -> list[SimRequest]:
    """A Mooncake-format JSONL trace. ``rate`` rescales time to that mean arrival rate (None:
    replay the timestamps as they are). Requests whose prompt does not fit are clipped to fit."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if num_requests is not None and len(out) >= num_requests:
                break
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                ts, prompt, output = float(d["timestamp"]), int(d["input_length"]), int(d["output_length"])
                hash_ids = tuple(int(h) for h in d.get("hash_ids", ()))
            except (KeyError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trace record (timestamp, input_length, "
                                 f"output_length, hash_ids): {e}") from None
            prompt = max(1, min(prompt, max_model_len - 2))
            output = max(1, min(output, max_model_len - prompt))
            # The client's limit is the trace's cap, not the request's own length (that would
            # hand the router an oracle).
            cap = max(output, min(TRACE_MAX_TOKENS, max_model_len - prompt))
            out.append(SimRequest(f"t{lineno}", ts / 1000.0, prompt, (output,),
                                  SHORT if output <= short_threshold else LONG, max_tokens=cap,
                                  hash_ids=hash_ids, salt=10_000_000 + lineno))
    if not out:
        raise ValueError(f"{path}: no requests")
    t0 = out[0].arrival
    span = out[-1].arrival - t0
    scale = 1.0 if rate is None or span <= 0 else (len(out) - 1) / rate / span
    return [SimRequest(r.request_id, (r.arrival - t0) * scale, r.prompt_len, r.output_lens, r.cls,
                       r.max_tokens, r.hash_ids, r.salt) for r in out]
