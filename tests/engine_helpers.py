"""Driving an engine in tests: run requests to completion with an integrity check every step."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckedRun:
    token_ids: list[list[list[int]]]  # [request][branch] -> token ids
    peak_swapped: int  # most requests swapped out at once
    peak_waiting: int  # most requests waiting at once (preempted by recompute, or never started)


def run_checked(eng, prompts, params) -> CheckedRun:
    """Add ``prompts`` as requests r0, r1, ... and step until all finish, calling
    ``check_integrity`` after every step (a leaked or double-owned block fails at once)."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done, swapped, waiting = {}, 0, 0
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        eng.check_integrity()
        stats = eng.stats()
        swapped, waiting = max(swapped, stats.num_swapped), max(waiting, stats.num_waiting)
    outputs = [[c.token_ids for c in done[f"r{i}"].outputs] for i in range(len(prompts))]
    return CheckedRun(outputs, swapped, waiting)
