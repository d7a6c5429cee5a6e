"""The frontend's event-loop lag gauge: a callback that blocks the loop shows up as a stall of
its length, at its time; a free loop shows none."""
import asyncio
import time

from thinkserve.cluster.loop_lag import LAG_BUCKETS, LoopLag


def test_a_callback_that_blocks_the_loop_is_one_stall_of_its_length():
    async def main():
        gauge = LoopLag(interval_s=0.005, stall_s=0.02)
        gauge.start()
        await asyncio.sleep(0.05)                   # settle: ticks with no blocking
        before = time.monotonic()
        time.sleep(0.08)                            # a callback holding the loop for 80 ms
        blocked_until = time.monotonic()
        await asyncio.sleep(0.05)
        gauge.stop()
        return gauge, before, blocked_until

    gauge, before, blocked_until = asyncio.run(main())
    s = gauge.summary()
    stalls = gauge.stalls_since(before)
    # The block is one stall (other processes on a loaded machine may add more, never fewer).
    at, lag = max(stalls, key=lambda x: x[1])
    assert lag >= 0.08 - 0.006                      # the block, less what the tick had already slept
    assert at - lag <= before + 0.006 and at >= blocked_until
    assert s.stalls == len(gauge.stalls_since(0.0)) >= 1
    assert s.max_ms >= lag * 1e3 and s.ticks == sum(s.buckets) and len(s.buckets) == len(LAG_BUCKETS) + 1
    assert gauge.stalls_since(at + 1e-6) == [x for x in stalls if x[0] > at]


def test_records_land_in_their_buckets_and_only_stalls_are_kept():
    g = LoopLag(stall_s=0.02)
    for at, lag in ((1.0, 0.0), (2.0, 0.0015), (3.0, 0.019), (4.0, 0.02), (5.0, 2.0)):
        g.record(at, lag)
    s = g.summary()
    assert s.ticks == 5 and s.stalls == 2 and s.max_ms == 2000.0
    assert s.mean_ms == (0.0015 + 0.019 + 0.02 + 2.0) / 5 * 1e3
    assert s.buckets == (1, 1, 0, 0, 2, 0, 0, 0, 0, 0, 1)       # 0 → ≤1 ms, 1.5 → ≤2, 19 and 20 → ≤20, 2 s → +Inf
    assert g.stalls_since(0.0) == [(4.0, 0.02), (5.0, 2.0)]
    assert g.stalls_since(4.5) == [(5.0, 2.0)]


def test_metrics_export_the_gauge_as_a_cumulative_histogram():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from thinkserve.cluster.metrics import _StateCollector

    g = LoopLag()
    for lag in (0.0, 0.003, 0.03, 2.0):
        g.record(1.0, lag)
    fam = _StateCollector(SimpleNamespace(core=SimpleNamespace(loop_lag=g)))._loop_lag()

    class One:
        def collect(self):
            yield fam
    registry = CollectorRegistry()
    registry.register(One())
    text = generate_latest(registry).decode()
    for line in ('thinkserve_frontend_loop_lag_seconds_bucket{le="0.001"} 1.0',
                 'thinkserve_frontend_loop_lag_seconds_bucket{le="0.005"} 2.0',
                 'thinkserve_frontend_loop_lag_seconds_bucket{le="0.05"} 3.0',
                 'thinkserve_frontend_loop_lag_seconds_bucket{le="+Inf"} 4.0',
                 'thinkserve_frontend_loop_lag_seconds_count 4.0',
                 'thinkserve_frontend_loop_lag_seconds_sum 2.033'):
        assert line in text, line
