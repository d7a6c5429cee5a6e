"""Turn a ``GenerateRequest`` proto into a validated spec, or say which field is wrong.

Every rejection is an ``InvalidField`` naming the proto field (``sampling.top_p``, ``n``,
``prompt.token_ids``...), which the frontend returns as ``INVALID_ARGUMENT``.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
from thinkserve.router.conductor import ReasoningEfforts
from thinkserve.workers.sampling_params import SamplingParams

from .config import LimitsConfig

# Engine priority: smaller runs first.
PRIORITY_OF_CLASS = {pb.PRIORITY_CLASS_UNSPECIFIED: 1, pb.PRIORITY_CLASS_INTERACTIVE: 0,
                     pb.PRIORITY_CLASS_STANDARD: 1, pb.PRIORITY_CLASS_BATCH: 2}
SLO_CLASS_OF = {pb.PRIORITY_CLASS_UNSPECIFIED: "standard", pb.PRIORITY_CLASS_INTERACTIVE: "interactive",
                pb.PRIORITY_CLASS_STANDARD: "standard", pb.PRIORITY_CLASS_BATCH: "batch"}
EFFORT_OF = {pb.REASONING_EFFORT_UNSPECIFIED: None, pb.REASONING_EFFORT_LOW: "low",
             pb.REASONING_EFFORT_MEDIUM: "medium", pb.REASONING_EFFORT_HIGH: "high"}
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:@/+=-]+$")


class InvalidField(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class GenerateSpec:
    request_id: str | None
    prompt_token_ids: tuple[int, ...]
    prompt_text: str | None
    params: SamplingParams          # n and a fixed seed included
    priority: int
    slo_class: str = "standard"     # interactive | standard | batch (the router's SLO class)
    early_stop: str | None = None   # a rule of router/consensus.py; None: the config's router.early_stop


# GenerateRequest.early_stop -> rule name (UNSPECIFIED: the cluster config decides)
EARLY_STOP_RULES = {pb.EARLY_STOP_UNSPECIFIED: None, pb.EARLY_STOP_NONE: "none",
                    pb.EARLY_STOP_UNBEATABLE: "unbeatable", pb.EARLY_STOP_ADAPTIVE: "adaptive"}


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int
    has_thinking: bool = True          # the vocabulary has <think> and </think>
    max_num_seqs: int = 1 << 30        # the smallest engine batch: n branches must fit one engine


def validate_generate(req: pb.GenerateRequest, limits: LimitsConfig, model: ModelLimits,
                      encode, efforts: ReasoningEfforts = ReasoningEfforts()) -> GenerateSpec:
    """``encode(text) -> list[int]`` tokenizes a text prompt; ``efforts`` (the router's) maps
    ``reasoning_effort`` (low / medium / high) to a thinking budget (None: unlimited)."""
    rid = req.request_id or None
    if rid is not None:
        if len(rid) > limits.max_request_id_len:
            raise InvalidField("request_id", f"longer than {limits.max_request_id_len} characters")
        if not _REQUEST_ID_RE.match(rid):
            raise InvalidField("request_id", "may contain only letters, digits and ._:@/+=-")
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidField("prompt", "give prompt text or token_ids")
    if which == "text":
        if not req.text:
            raise InvalidField("prompt.text", "is empty")
        # Before tokenizing: a megabyte of text costs seconds of tokenizer time on the event loop.
        size = len(req.text.encode())
        if size > limits.max_prompt_bytes:
            raise InvalidField("prompt.text", f"{size} bytes exceeds the limit of {limits.max_prompt_bytes} "
                                              "(limits.max_prompt_bytes)")
        ids = tuple(encode(req.text))
        text = req.text
    else:
        ids = tuple(req.token_ids.ids)
        text = None
        if not ids:
            raise InvalidField("prompt.token_ids", "is empty")
        bad = next((t for t in ids if t >= model.vocab_size), None)
        if bad is not None:
            raise InvalidField("prompt.token_ids", f"token id {bad} is outside the vocabulary (size {model.vocab_size})")
    if not ids:
        raise InvalidField("prompt.text", "encodes to no tokens")
    max_prompt = min(limits.max_prompt_tokens, model.max_model_len - 1)
    if len(ids) > max_prompt:
        raise InvalidField("prompt", f"{len(ids)} tokens exceeds the limit of {max_prompt}")

    if req.priority not in PRIORITY_OF_CLASS:
        raise InvalidField("priority", f"unknown priority class {req.priority}")
    n = req.n or 1
    max_n = min(limits.max_n, model.max_num_seqs)
    if n > max_n:
        raise InvalidField("n", f"must be <= {max_n}, got {n}")

    s = req.sampling
    fields = {"n": n}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if s.HasField(name):
            fields[name] = getattr(s, name)
    if s.stop_token_ids:
        bad = next((t for t in s.stop_token_ids if t >= model.vocab_size), None)
        if bad is not None:
            raise InvalidField("sampling.stop_token_ids", f"token id {bad} is outside the vocabulary")
        fields["stop_token_ids"] = tuple(s.stop_token_ids)
    if s.stop:
        if any(not x for x in s.stop):
            raise InvalidField("sampling.stop", "stop strings must be non-empty")
        fields["stop"] = tuple(s.stop)
    fields["ignore_eos"] = s.ignore_eos
    if req.reasoning_effort not in EFFORT_OF:
        raise InvalidField("reasoning_effort", f"unknown reasoning effort {req.reasoning_effort}")
    effort = EFFORT_OF[req.reasoning_effort]
    budget = efforts.budget(effort)
    if budget is not None and not req.HasField("thinking_budget"):     # an explicit budget wins
        if not model.has_thinking:
            raise InvalidField("reasoning_effort", "the model's vocabulary has no <think> / </think> tokens")
        fields["thinking_budget"] = budget
    if req.HasField("thinking_budget"):
        if not model.has_thinking:
            raise InvalidField("thinking_budget", "the model's vocabulary has no <think> / </think> tokens")
        fields["thinking_budget"] = req.thinking_budget
    if fields.get("max_tokens", 1) > limits.max_tokens:
        raise InvalidField("sampling.max_tokens", f"must be <= {limits.max_tokens}, got {fields['max_tokens']}")
    if "seed" not in fields:
        # Fixed at admission: a request that resumes on another instance draws the same tokens.
        fields["seed"] = random.getrandbits(62)
    try:
        params = SamplingParams(**fields)
    except ValueError as e:
        msg = str(e)
        name = msg.split(" ", 1)[0]
        field = "n" if name == "n" else "thinking_budget" if name == "thinking_budget" else f"sampling.{name}"
        raise InvalidField(field, msg.split(" ", 1)[1] if " " in msg else msg) from None
    if len(ids) + params.max_tokens > model.max_model_len:
        raise InvalidField("sampling.max_tokens", f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                                                  f"exceeds the model's context of {model.max_model_len}")
    if req.early_stop not in EARLY_STOP_RULES:
        raise InvalidField("early_stop", f"unknown early-stop rule {req.early_stop}")
    return GenerateSpec(rid, ids, text, params, PRIORITY_OF_CLASS[req.priority], SLO_CLASS_OF[req.priority],
                        EARLY_STOP_RULES[req.early_stop])
