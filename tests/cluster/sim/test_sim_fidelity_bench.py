"""``bench/sim_fidelity.py``'s controlled conditions: the long-prompt workload and the measure of
other processes' work (``CpuMonitor``) with its background load counted as outside work."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import sim_fidelity  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.tokenizer import Tokenizer
    return Tokenizer.from_pretrained(resolve_model_path("tiny-reasoner"))


def test_long_prompts_are_worked_examples_before_the_problem(tokenizer):
    short = sim_fidelity.make_jobs(3.0, 20.0, 7, 1400, tokenizer)
    long = sim_fidelity.make_jobs(3.0, 20.0, 7, 1400, tokenizer, prompt_tokens=300, max_model_len=1536)
    assert [j["at"] for j in long] == [j["at"] for j in short] and len(long) > 20
    for s, j in zip(short, long):
        assert j["text"].endswith("\n" + s["text"])                  # the same problem, last
        assert j["prompt_len"] == len(tokenizer.encode(j["text"]))
        assert 300 <= j["prompt_len"] <= 450
        assert j["max_tokens"] == min(1400, 1536 - j["prompt_len"])
        assert s["max_tokens"] == 1400 and s["prompt_len"] < 30
    # Each request its own examples: no two prompts share their first line (no prefix reuse).
    firsts = [j["text"].split("\n", 1)[0] for j in long]
    assert len(set(firsts)) == len(firsts)


def _nice(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def test_cpu_monitor_counts_the_background_load_as_outside_work_by_nice():
    procs = sim_fidelity.start_load(1, 5)
    try:
        nice = _nice(procs[0].pid)
        assert nice == min(19, _nice(os.getpid()) + 5)
        monitor = sim_fidelity.CpuMonitor(interval=0.25, outside=[p.pid for p in procs])
        monitor.start()
        time.sleep(2.0)
        total = monitor.stop()
    finally:
        sim_fidelity.stop_load(procs)
    assert all(p.poll() is not None for p in procs)
    # The loop is a child of this process, which the monitor leaves out with its descendants
    # (the cluster it starts) unless named outside: it is busy, so it counts.
    assert sum(w for _, w in total) / len(total) > 0.3
    for (_, w), (_, u) in zip(total, monitor.unniced):
        assert 0.0 <= u <= w + 1e-9
    # Its work counts among the niced (it is at nice >= 5), weighted by 1.25 ** -nice: the
    # un-niced and the weighted series differ by at most its share (other jobs' work blurs it).
    mean = lambda s: sum(v for _, v in s) / len(s)  # noqa: E731
    assert mean(total) - mean(monitor.unniced) > 0.3
    assert mean(monitor.weighted) - mean(monitor.unniced) <= (mean(total) - mean(monitor.unniced)) * 1.25 ** -5 + 1e-9
