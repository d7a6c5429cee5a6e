"""Answer extraction and majority voting over Best-of-N branches.

A branch's answer is the value on its last ``answer: ...`` line (case-insensitive, also
``answer = ...``), after the reasoning. Values are normalised so that ``42``, ``42.0`` and
``42.`` vote together; anything that is not a number is compared as lower-cased text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

_ANSWER_RE = re.compile(r"answer\s*[:=]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_NUMBER_RE = re.compile(r"^[-+]?(\d+(\.\d*)?|\.\d+)$")


def extract_answer(text: str) -> str | None:
    """The normalised value of the last ``answer: X`` line of ``text``; ``None`` if there is none.

    Text inside an unfinished ``<think>`` block is ignored; a closed one is not (models restate
    the answer after ``</think>``, and the last occurrence wins)."""
    if "<think>" in text and "</think>" not in text.split("<think>")[-1]:
        text = text.rsplit("<think>", 1)[0]
    matches = _ANSWER_RE.findall(text)
    if not matches:
        return None
    return normalize_answer(matches[-1])


def extract_boxed(text: str) -> str | None:
    """The normalised content of the last ``\\boxed{...}`` (braces inside it may nest, as in
    ``\\boxed{\\frac{1}{2}}``); ``None`` if there is none or it is never closed."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth, i = 0, start + len("\\boxed")
        for j in range(i, len(text)):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return normalize_answer(text[i + 1:j])
        start = text.rfind("\\boxed{", 0, start)     # unclosed: an earlier complete one still counts
    return None


_LAST_NUMBER_RE = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def extract_last_number(text: str) -> str | None:
    """The normalised last number anywhere in ``text`` (after any reasoning); ``None`` if none."""
    if "<think>" in text and "</think>" not in text.split("<think>")[-1]:
        text = text.rsplit("<think>", 1)[0]
    matches = _LAST_NUMBER_RE.findall(text)
    return normalize_answer(matches[-1]) if matches else None


# Answer extractors by name, chosen in the cluster config (``router.answer_extractor``) or per
# benchmark run: ``answer`` (``answer: N``, what the tiny-reasoner writes), ``boxed``
# (``\\boxed{...}``, the math-benchmark convention), ``last_number``.
EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "answer": extract_answer, "boxed": extract_boxed, "last_number": extract_last_number}


def get_extractor(name: str) -> Callable[[str], str | None]:
    try:
        return EXTRACTORS[name]
    except KeyError:
        raise ValueError(f"answer_extractor must be one of {sorted(EXTRACTORS)}, got {name!r}") from None


def normalize_answer(value: str) -> str | None:
    v = value.split("<", 1)[0]          # a trailing tag (an end-of-sequence marker, </answer>) is not the value
    v = v.strip().rstrip(".").strip()
    v = v.replace(",", "") if _NUMBER_RE.match(v.replace(",", "")) else v
    if not v:
        return None
    if _NUMBER_RE.match(v):
        num = float(v)
        return str(int(num)) if num.is_integer() else repr(num)
    return v.lower()


@dataclass(frozen=True)
class Vote:
    answer: str
    count: int
    branch_indices: tuple[int, ...]
    weight: float = 0.0             # the summed vote weight (== count for an unweighted vote)


@dataclass(frozen=True)
class VoteResult:
    answer: str | None              # the majority answer; None when no branch answered
    votes: tuple[Vote, ...]         # every distinct answer, most votes first
    best_branch: int | None         # the first branch that gave the winning answer


def majority_vote(answers: Sequence[str | None], weights: Sequence[float] | None = None) -> VoteResult:
    """Count each distinct answer (``answers[i]`` is branch ``i``'s, ``None`` abstains).
    Ties go to the answer whose first branch has the lowest index, so the result is deterministic
    and does not depend on the order branches finished in. With ``weights`` (one per branch, e.g.
    a branch's mean token probability) each branch votes with its weight instead of 1."""
    if weights is not None and len(weights) != len(answers):
        raise ValueError(f"got {len(weights)} weights for {len(answers)} answers")
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(answers):
        if a is not None:
            groups.setdefault(a, []).append(i)
    votes = [Vote(a, len(ix), tuple(ix), float(len(ix)) if weights is None else float(sum(weights[i] for i in ix)))
             for a, ix in groups.items()]
    votes.sort(key=lambda v: (-v.weight, v.branch_indices[0]))
    if not votes:
        return VoteResult(None, (), None)
    return VoteResult(votes[0].answer, tuple(votes), votes[0].branch_indices[0])
