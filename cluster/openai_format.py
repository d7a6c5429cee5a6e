"""OpenAI's request and response shapes, and their mapping onto thinkserve's GenerateRequest.

The HTTP API builds the same ``GenerateRequest`` proto a gRPC client would send, so validation
(``validation.py``) and everything after it are shared. Pydantic checks only the JSON's shape here.

Reasoning: text inside ``<think> ... </think>`` is returned as ``reasoning_content``, the rest as
``content`` (``ReasoningSplitter``; the same for streamed deltas and whole texts).

Chat template: a model directory whose ``tokenizer_config.json`` has a ``chat_template`` gets it
rendered (Jinja, sandboxed, ``add_generation_prompt=True``). Without one (the tiny-reasoner):
a single user message is the prompt as is; otherwise each message becomes ``"{role}: {content}\\n"``
and the prompt ends with ``"assistant: "``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from thinkserve.protos.thinkserve.v1 import common_pb2
from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb

THINK_START, THINK_END = "<think>", "</think>"
FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}
_PRIORITY = {"interactive": pb.PRIORITY_CLASS_INTERACTIVE, "standard": pb.PRIORITY_CLASS_STANDARD,
             "batch": pb.PRIORITY_CLASS_BATCH}
_EARLY_STOP = {"none": pb.EARLY_STOP_NONE, "unbeatable": pb.EARLY_STOP_UNBEATABLE, "adaptive": pb.EARLY_STOP_ADAPTIVE}
_EFFORT = {"low": pb.REASONING_EFFORT_LOW, "medium": pb.REASONING_EFFORT_MEDIUM, "high": pb.REASONING_EFFORT_HIGH}


class _Request(BaseModel):
    """Fields both endpoints share. OpenAI fields thinkserve does not implement are accepted only
    at their neutral value (a penalty of 0, no logprobs), so nothing is silently ignored."""

    model_config = ConfigDict(extra="forbid")
    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    logprobs: Literal[False] | None = None
    # thinkserve extras (documented in docs/interfaces.md)
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    thinking_budget: int | None = Field(None, ge=0)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    early_stop: Literal["none", "unbeatable", "adaptive"] | None = None
    priority: Literal["interactive", "standard", "batch"] | None = None
    request_id: str | None = None

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)       # OpenAI's default for completions
    echo: Literal[False] | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):       # [{"type": "text", "text": ...}, ...]
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise ValueError(f"messages: content part of type {p.get('type')!r} is not supported (text only)")
                parts.append(str(p.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def to_generate_request(body: _Request, prompt: str | list[int]) -> pb.GenerateRequest:
    """The gRPC request carrying the same fields (validated afterwards by ``validate_generate``)."""
    sp = pb.SamplingParams(ignore_eos=body.ignore_eos)
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    if max_tokens is not None:
        sp.max_tokens = max_tokens
    for name in ("temperature", "top_p", "top_k", "seed"):
        v = getattr(body, name)
        if v is not None:
            setattr(sp, name, v)
    if body.stop:
        sp.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        sp.stop_token_ids.extend(body.stop_token_ids)
    req = pb.GenerateRequest(request_id=body.request_id or "", sampling=sp, n=body.n,
                             priority=_PRIORITY[body.priority] if body.priority else pb.PRIORITY_CLASS_UNSPECIFIED,
                             early_stop=_EARLY_STOP[body.early_stop] if body.early_stop else pb.EARLY_STOP_UNSPECIFIED,
                             reasoning_effort=_EFFORT[body.reasoning_effort] if body.reasoning_effort
                             else pb.REASONING_EFFORT_UNSPECIFIED)
    if body.thinking_budget is not None:
        req.thinking_budget = body.thinking_budget
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
    return req


def completion_prompt(body: CompletionRequest) -> str | list[int]:
    p = body.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise ValueError("prompt: one prompt per request (use n for several completions of it)")
        p = p[0]
    return p


class ChatTemplate:
    def __init__(self, model_dir: Path, bos: str = "", eos: str = ""):
        self.template = None
        try:
            cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            cfg = {}
        source = cfg.get("chat_template")
        if isinstance(source, str):
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self.template = env.from_string(source)
        self.bos, self.eos = _token_text(cfg.get("bos_token"), bos), _token_text(cfg.get("eos_token"), eos)

    def render(self, messages: list[ChatMessage]) -> str:
        turns = [{"role": m.role, "content": m.text()} for m in messages]
        if self.template is not None:
            return self.template.render(messages=turns, add_generation_prompt=True, bos_token=self.bos,
                                        eos_token=self.eos)
        if len(turns) == 1 and turns[0]["role"] == "user":
            return turns[0]["content"]
        return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant: "


def _token_text(tok, default: str) -> str:
    if isinstance(tok, dict):
        return str(tok.get("content", default))
    return tok if isinstance(tok, str) else default


class ReasoningSplitter:
    """Splits a branch's text, fed in pieces, into reasoning (inside ``<think>...</think>``) and
    content (after it). ``starts_thinking``: the prompt ended with ``<think>`` (the model's
    output begins inside the block, as DeepSeek-R1's template has it)."""

    def __init__(self, starts_thinking: bool = False):
        self.mode = "reasoning" if starts_thinking else "start"
        self.thought = starts_thinking          # a reasoning block was opened
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while self.buf:
            if self.mode == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(THINK_START):
                    self.buf, self.mode, self.thought = stripped[len(THINK_START):], "reasoning", True
                elif THINK_START.startswith(stripped) and not final:
                    break                               # maybe the start of the tag: wait for more
                else:
                    self.mode = "content"
            elif self.mode == "reasoning":
                i = self.buf.find(THINK_END)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.mode = self.buf[i + len(THINK_END):], "content"
                    continue
                keep = 0 if final else _partial_suffix(self.buf, THINK_END)
                reasoning += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back until it resolves)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, starts_thinking: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole text; reasoning is None when no block was opened."""
    sp = ReasoningSplitter(starts_thinking)
    r, c = sp.feed(text, final=True)
    return (r if sp.thought else None), c


def usage(final: pb.GenerateResponse, reasoning_tokens: int | None = None) -> dict:
    u = final.usage
    out = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens}
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def extras(final: pb.GenerateResponse) -> dict:
    """thinkserve's additions to a response: the vote, early stop, timings."""
    f, t = final.final, final.timings
    return {"request_id": final.request_id, "answer": f.answer,
            "votes": [{"answer": v.answer, "count": v.count, "branch_indices": list(v.branch_indices)} for v in f.votes],
            "best_branch": f.best_branch, "cancelled_branches": f.cancelled_branches,
            "early_stop_rule": f.early_stop_rule,
            "timings": {"queued_ms": t.queued_ms, "prefill_ms": t.prefill_ms, "handoff_ms": t.handoff_ms,
                        "ttft_ms": t.ttft_ms, "total_ms": t.total_ms, "migrations": t.migrations,
                        "promotions": t.promotions, "prefill_instance": t.prefill_instance,
                        "decode_instances": list(t.decode_instances)}}
