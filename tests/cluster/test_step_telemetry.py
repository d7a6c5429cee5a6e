"""An instance's step telemetry (what the simulator's cpu kind is fitted from): every engine step
with its batch shape, every part's add / first-token / finish times, in order."""
from __future__ import annotations

import time

from thinkserve.cluster.engine_host import EngineHost
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams


def test_engine_host_reports_each_step_and_part(tiny_model):
    engine = LLMEngine(EngineConfig(model=tiny_model, num_device_blocks=64, block_size=16, max_num_seqs=8))
    host = EngineHost("mixed-0", engine)
    host.start()
    try:
        t0 = time.monotonic()
        host.add("p1", list(range(3, 23)), SamplingParams(max_tokens=6, ignore_eos=True), 0)
        deadline = time.monotonic() + 60
        while host.parts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.parts
        trace = host.telemetry.take("mixed-0")
    finally:
        host.stop()
    steps = trace.steps
    # One prefill step of 20 prompt tokens (it samples the first token), then 5 decode steps.
    assert len(steps) == engine.num_steps == 6
    assert (steps[0].prefill_tokens, steps[0].prefill_ctx, steps[0].num_decode) == (20, 20 * 21 // 2, 0)
    assert [(s.prefill_tokens, s.num_decode, s.decode_ctx) for s in steps[1:]] == [(0, 1, 21 + k) for k in range(5)]
    assert all(s.duration > 0 for s in steps)
    assert all(a.start + a.duration <= b.start for a, b in zip(steps, steps[1:]))
    (part,) = trace.parts
    assert part.part_id == "p1"
    # A step counts from its loop iteration's start (its wait for the engine lock included).
    assert t0 <= part.added < part.first_token
    assert steps[0].start < part.first_token <= steps[0].start + steps[0].duration
    assert steps[-1].start < part.finished <= steps[-1].start + steps[-1].duration
    # take() hands over and starts afresh.
    assert host.telemetry.take("mixed-0").steps == ()
