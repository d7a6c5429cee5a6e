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
    finally:
        host.stop()     # joins the loop: its last iteration has recorded the last step
    trace = host.telemetry.take("mixed-0")
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
    # The stats count the decode-only steps (the Conductor's TPOT fit): the 5 decode steps, their
    # durations and branches exactly; the prefill step is not one.
    st = host.stats()
    assert (st.decode_steps, st.decode_step_seqs) == (5, 5)
    assert st.decode_step_seconds == sum(s.duration for s in steps[1:])


def test_a_poll_does_not_wait_for_the_engine_step_in_flight(tiny_model):
    """Tokens an engine step published go back with the next poll at once: the poll's stats and
    prefix report are read without the engine lock, which the next step holds (it used to wait
    for that step to end, delaying every token by up to a step)."""
    import asyncio
    import threading

    from thinkserve.cluster.instance import InstanceCore
    from thinkserve.workers.prefix_journal import START

    async def main():
        core = InstanceCore("prefill-0", "prefill", EngineConfig(model=tiny_model, role="prefill", num_device_blocks=64,
                                                                 block_size=16, max_num_seqs=8), kv_transport="tcp")
        await core.ready()
        try:
            await core.poll(0.01, START)                       # starts the prefix journal
            await core.add_part("p1", tuple(range(3, 40)), SamplingParams(max_tokens=4, ignore_eos=True), 0)
            while not core.host.has_outputs():
                await asyncio.sleep(0.005)
            held, release = threading.Event(), threading.Event()

            def long_step():                                   # the next step holds the engine lock
                with core.host.lock:
                    held.set()
                    release.wait(5)
            threading.Thread(target=long_step, daemon=True).start()
            held.wait(5)
            t0 = time.monotonic()
            res = await core.poll(0.01, START)
            waited = time.monotonic() - t0
            release.set()
            assert waited < 1.0
            assert any(d.part_id == "p1" and d.prefilled for d in res.deltas)
            assert res.prefix is not None and len(res.prefix.added) == 2    # the prompt's 2 full blocks
            assert res.stats.instance_id == "prefill-0"
        finally:
            release.set()
            await core.shutdown()
    asyncio.run(main())


def test_a_short_prompt_is_added_and_polled_without_a_worker_thread(tiny_model):
    """On the instance's event loop, a poll (deltas, stats, prefix report) and the admission of a
    prompt with nothing to load from a store need no worker thread while no step is in flight:
    with the loop's only worker thread blocked, both still answer, and the prefill's first token
    comes back. With the engine lock busy, the admission falls back to a thread and waits."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from thinkserve.cluster.instance import InstanceCore
    from thinkserve.workers.prefix_journal import START

    async def main():
        core = InstanceCore("prefill-0", "prefill", EngineConfig(model=tiny_model, role="prefill", num_device_blocks=64,
                                                                 block_size=16, max_num_seqs=8), kv_transport="tcp")
        await core.ready()
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        unblock = threading.Event()
        try:
            await core.poll(0.01, START)                       # starts the prefix journal (on a thread)
            time.sleep(0.2)                                    # the engine loop has published its stats
            blocked = loop.run_in_executor(None, unblock.wait, 30)   # the only worker thread, busy
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            adm = await asyncio.wait_for(core.add_part("p1", tuple(range(3, 12)), params, 0), 5)
            assert adm.ok and "p1" in core.host.parts
            first = None
            for _ in range(100):
                res = await asyncio.wait_for(core.poll(0.1, START), 5)
                assert res.stats.instance_id == "prefill-0" and res.prefix is not None
                first = next((d for d in res.deltas if d.part_id == "p1" and d.branches), None)
                if first is not None:
                    break
            assert first is not None and first.prefilled and len(first.branches[0].token_ids) == 1
            unblock.set()
            await blocked
            # A step in flight (the engine lock held): the admission waits for it on a thread.
            held, release = threading.Event(), threading.Event()

            def long_step():
                with core.host.lock:
                    held.set()
                    release.wait(5)
            threading.Thread(target=long_step, daemon=True).start()
            held.wait(5)
            adding = asyncio.ensure_future(core.add_part("p2", tuple(range(3, 12)), params, 0))
            await asyncio.sleep(0.2)
            assert not adding.done() and "p2" not in core.host.parts
            release.set()
            assert (await asyncio.wait_for(adding, 5)).ok and "p2" in core.host.parts
        finally:
            unblock.set()
            await core.shutdown()
    asyncio.run(main())


def test_a_pool_nice_raises_the_engine_threads_niceness_only(tiny_model):
    """``pools.<name>.nice``: the engine thread of such an instance runs that much nicer than the
    process (a throughput pool yields shared cores to latency-critical ones); the caller's thread
    is untouched."""
    import os

    engine = LLMEngine(EngineConfig(model=tiny_model, num_device_blocks=16, block_size=16, max_num_seqs=2))
    host = EngineHost("long_decode-0", engine, nice=7)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    host.start()
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with open(f"/proc/self/task/{host._thread.native_id}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])   # field 19: nice
            if nice == min(19, base + 7):
                break
            time.sleep(0.01)
        assert nice == min(19, base + 7)
        assert os.getpriority(os.PRIO_PROCESS, 0) == base
    finally:
        host.stop()


def test_pool_cpus_bind_the_engine_thread_only_and_an_unavailable_core_is_refused(tiny_model):
    """``pools.<name>.cpus``: the instance's engine thread runs on its core set, and still serves;
    the caller's thread keeps its cores. A core this process may not run on is refused before the
    engine starts, naming the field."""
    import os

    import pytest

    from thinkserve.cluster.instance import check_cores

    allowed = os.sched_getaffinity(0)
    core = max(allowed)
    engine = LLMEngine(EngineConfig(model=tiny_model, num_device_blocks=16, block_size=16, max_num_seqs=2))
    host = EngineHost("short_decode-0", engine, cpus=check_cores("short_decode", (core,)))
    host.start()
    try:
        host.add("p1", list(range(3, 13)), SamplingParams(max_tokens=3, ignore_eos=True), 0)
        deadline = time.monotonic() + 30
        while host.parts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not host.parts and host.error is None
        assert os.sched_getaffinity(host._thread.native_id) == {core}
        assert os.sched_getaffinity(0) == allowed
    finally:
        host.stop()
    assert check_cores("prefill", ()) == ()
    with pytest.raises(ValueError, match=r"pools\.prefill\.cpus: core\(s\) 4096 not available on this node"):
        check_cores("prefill", (core, 4096))


def test_steps_that_compute_without_a_sample_follow_each_other_at_once(tiny_model):
    """A prompt in chunks (a Best-of-N root's too, until its last chunk) computes without sampling: the
    loop steps again at once. It used to wait as if only held requests were left (the held-poll
    interval, 2 ms) after each such step; here that interval is 5 s, so it would show."""
    engine = LLMEngine(EngineConfig(model=tiny_model, role="prefill", num_device_blocks=64, block_size=16,
                                    max_num_seqs=8, max_num_batched_tokens=16))
    host = EngineHost("prefill-0", engine)
    host.held_poll_s = 5.0
    host.start()
    try:
        t0 = time.monotonic()
        host.add("p1", list(range(3, 67)), SamplingParams(max_tokens=4, n=2, temperature=0.8), 0)
        while not host.has_outputs() and time.monotonic() - t0 < 30:
            time.sleep(0.002)
        waited = time.monotonic() - t0
        (delta,) = host.take_outputs()
    finally:
        host.stop()
    assert delta.part_id == "p1" and delta.prefilled and sorted(b.index for b in delta.branches) == [0, 1]
    steps = host.telemetry.take("prefill-0").steps
    # 64 prompt tokens in chunks of 16; the last samples both branches' first tokens (fan-out)
    assert [(s.prefill_tokens, s.num_decode) for s in steps] == [(16, 0), (16, 0), (16, 0), (16, 0)]
    assert waited < 4.0, waited
