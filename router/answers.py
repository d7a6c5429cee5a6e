"""Answer extraction and majority voting over Best-of-N branches.

A branch's answer is the value on its last ``answer: ...`` line (case-insensitive, also
``answer = ...``), after the reasoning. Values are normalised so that ``42``, ``42.0`` and
``42.`` vote together; anything that is not a number is compared as lower-cased text.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

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


@dataclass(frozen=True)
class VoteResult:
    answer: str | None              # the majority answer; None when no branch answered
    votes: tuple[Vote, ...]         # every distinct answer, most votes first
    best_branch: int | None         # the first branch that gave the winning answer


def majority_vote(answers: Sequence[str | None]) -> VoteResult:
    """Count each distinct answer (``answers[i]`` is branch ``i``'s, ``None`` abstains).
    Ties go to the answer that appeared first, so the result is deterministic."""
    groups: dict[str, list[int]] = {}
    for i, a in enumerate(answers):
        if a is not None:
            groups.setdefault(a, []).append(i)
    votes = sorted((Vote(a, len(ix), tuple(ix)) for a, ix in groups.items()),
                   key=lambda v: (-v.count, v.branch_indices[0]))
    if not votes:
        return VoteResult(None, (), None)
    return VoteResult(votes[0].answer, tuple(votes), votes[0].branch_indices[0])
