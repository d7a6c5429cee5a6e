"""The load generator's workloads without a cluster: Poisson arrivals, trace replay (times,
lengths clipped to the context, shared prefixes kept shared), percentiles."""
from __future__ import annotations

import json
import random

import pytest

from thinkserve.cluster.bench_cli import (Record, parse_mix, percentile, poisson_times, reasoning_jobs, summarize,
                                          trace_jobs)

MIX = {"interactive": 1.0, "standard": 1.0}


def test_poisson_rate_and_window():
    times = poisson_times(50.0, 20.0, random.Random(1))
    assert all(0 < t < 20 for t in times) and times == sorted(times)
    assert 900 < len(times) < 1100                      # 1000 expected, sd ~32
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert abs(sum(gaps) / len(gaps) - 0.02) < 0.002


def test_reasoning_jobs_are_tiny_reasoner_problems():
    jobs = reasoning_jobs(10.0, 3.0, MIX, 64, random.Random(0), seed=0)
    assert jobs and all(j.klass in MIX and j.max_tokens == 64 for j in jobs)
    assert all(j.prompt.endswith("=") for j in jobs)
    clipped = reasoning_jobs(10.0, 3.0, MIX, 5000, random.Random(0), seed=0, prompt_len=len, max_model_len=1536)
    assert [j.max_tokens for j in clipped] == [1536 - len(j.prompt) for j in clipped]


def test_trace_replay(tmp_path):
    rows = [{"timestamp": 1000, "input_length": 1200, "output_length": 30, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 700, "output_length": 2000, "hash_ids": [0, 1]},
            {"timestamp": 3000, "input_length": 10, "output_length": 5, "hash_ids": [7]},
            {"timestamp": 9000, "input_length": 10, "output_length": 5, "hash_ids": [8]}]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    jobs = trace_jobs(path, None, 5.0, MIX, random.Random(0), vocab_size=64, max_model_len=1536)
    assert [j.at for j in jobs] == [0.0, 0.5, 2.0]       # relative times; the 8 s one is past --duration
    assert [len(j.prompt) for j in jobs] == [768, 700, 10]        # clipped to half the context
    assert [j.max_tokens for j in jobs] == [30, 1536 - 700 - 1, 5]
    assert jobs[0].prompt[:700] == jobs[1].prompt[:700]  # hash ids 0, 1 shared: the same tokens
    assert jobs[2].prompt != jobs[0].prompt[:10]
    assert all(3 <= t < 64 for j in jobs for t in j.prompt) and all(j.ignore_eos for j in jobs)
    fast = trace_jobs(path, 4 / 8.0 * 2, 100.0, MIX, random.Random(0), vocab_size=64, max_model_len=1536)
    assert [j.at for j in fast] == [0.0, 0.25, 1.0, 4.0]  # --rate twice the trace's: time runs twice as fast


def test_summary_and_mix_errors():
    recs = [Record("standard", sent=0.0, first=0.1 * i + 0.1, end=1.0 + i, tokens=11) for i in range(10)]
    recs.append(Record("batch", sent=0.0, end=0.5, error="UNAVAILABLE"))
    s = summarize(recs, 10.0)
    assert s["standard"]["requests"] == 10 and s["batch"]["errors"] == 1 and s["all"]["requests"] == 11
    assert s["standard"]["ttft"]["p50"] == pytest.approx(0.5) and s["standard"]["ttft"]["p99"] == pytest.approx(1.0)
    assert s["all"]["output_tokens"] == 110
    assert percentile([3, 1, 2], 50) == 2
    with pytest.raises(ValueError, match="--mix"):
        parse_mix("urgent=1")


def test_a_job_seed_goes_into_the_request():
    import argparse

    from thinkserve.cluster.bench_cli import Job, _request
    args = argparse.Namespace(temperature=0.0, n=1)
    seeded = _request(Job(0.0, "standard", "1+2=", 16, n=8, temperature=0.8, seed=12345), args)
    assert seeded.sampling.HasField("seed") and seeded.sampling.seed == 12345 and seeded.n == 8
    assert not _request(Job(0.0, "standard", "1+2=", 16), args).sampling.HasField("seed")
