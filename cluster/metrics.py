"""Prometheus metrics of a deployment, served as ``/metrics`` by the frontend's HTTP server.

Every value is read from state the frontend already keeps, nothing is estimated:

    request histograms  ← each finished request's RequestState timings (observed in FrontendCore.stream)
    instance gauges     ← the InstanceStats each instance poller last received (with the instance
                          process's KV transfer totals, kvtransfer.telemetry)
    frontend counters   ← Orchestrator.counters (requests, migrations, KV sends, bytes and seconds)
    KV store counters   ← each node's KVStoreActor.stats(), fetched when /metrics is scraped

Names follow Prometheus conventions (``_total`` counters, base units: seconds, bytes) under the
``thinkserve_`` prefix; ``deploy/grafana-dashboard.json`` plots them. The registry is the
frontend's own (not the process-global one), so nothing else in the actor leaks in.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from thinkserve.router.snapshot import POOL_NAMES

from .counters import TRANSPORTS
from .loop_lag import LAG_BUCKETS

PRIORITY_NAMES = {0: "interactive", 1: "standard", 2: "batch"}
# Reasoning requests run from milliseconds (prefill-only) to minutes (long chains).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class FrontendMetrics:
    def __init__(self, core):
        self.core = core
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("pool", "priority")
        r = self.registry
        self.ttft = Histogram("thinkserve_request_ttft_seconds", "Admission to first token sent",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("thinkserve_request_tpot_seconds", "Mean time per output token after the first "
                              "(the longest branch)", labels, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("thinkserve_request_e2e_seconds", "Admission to final response",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("thinkserve_request_queue_seconds", "Admission to start of prefill",
                               labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("thinkserve_handoff_seconds", "Prefill -> decode KV handoff of a request",
                                 ("pool",), buckets=_LATENCY_BUCKETS, registry=r)
        self.finished = Counter("thinkserve_requests_finished_total", "Requests that got their final response",
                                labels, registry=r)
        self.prompt_tokens = Counter("thinkserve_prompt_tokens_total", "Prompt tokens of finished requests",
                                     ("pool",), registry=r)
        self.completion_tokens = Counter("thinkserve_completion_tokens_total",
                                         "Output tokens of finished requests (every branch)", ("pool",), registry=r)
        self.handoffs = Counter("thinkserve_handoffs_total", "Requests handed from a prefill to a decode instance",
                                ("pool",), registry=r)
        self.cancelled = Counter("thinkserve_bestofn_branches_cancelled_total",
                                 "Best-of-N branches stopped early because the vote was decided", registry=r)
        r.register(_StateCollector(self))

    # ----------------------------------------------------------------- per request
    def request_finished(self, req, final) -> None:
        """Called once per request with its final response (``FrontendCore.stream``)."""
        t = final.timings
        pool = req.decode_pool or "none"
        labels = (pool, PRIORITY_NAMES.get(req.priority, str(req.priority)))
        self.finished.labels(*labels).inc()
        if req.t_first_token is not None:
            self.ttft.labels(*labels).observe(t.ttft_ms / 1000)
            longest = max(len(b.token_ids) for b in req.branches)
            if longest > 1 and req.t_finished is not None:
                self.tpot.labels(*labels).observe((req.t_finished - req.t_first_token) / (longest - 1))
        self.e2e.labels(*labels).observe(t.total_ms / 1000)
        if req.t_prefill_start is not None:
            self.queue.labels(*labels).observe(t.queued_ms / 1000)
        if req.t_handoff_done is not None:
            self.handoffs.labels(pool).inc()
            self.handoff.labels(pool).observe(t.handoff_ms / 1000)
        self.prompt_tokens.labels(pool).inc(final.usage.prompt_tokens)
        self.completion_tokens.labels(pool).inc(final.usage.completion_tokens)
        if final.final.cancelled_branches:
            self.cancelled.inc(final.final.cancelled_branches)

    # ----------------------------------------------------------------- scrape
    async def exposition(self) -> bytes:
        await self.core.refresh_stores()        # the same fetch as GetStatus
        return generate_latest(self.registry)


class _StateCollector:
    """Gauges and counters read from the frontend's live state at scrape time."""

    def __init__(self, metrics: FrontendMetrics):
        self.m = metrics

    def describe(self):
        return []

    def collect(self):
        orch = self.m.core.orch
        c = orch.counters
        yield from self._instances(orch)

        req = CounterMetricFamily("thinkserve_requests_total", "Requests by outcome", labels=("outcome",))
        for outcome in ("completed", "failed", "aborted", "rejected"):
            req.add_metric((outcome,), getattr(c, outcome))
        yield req
        active = GaugeMetricFamily("thinkserve_requests_active", "Requests admitted and not yet answered")
        active.add_metric((), len(orch.requests))
        yield active
        for name, key, text in (
                ("thinkserve_migrations_total", "migrated", "Decode parts moved to another instance (drain, rebalance)"),
                ("thinkserve_promotions_total", "promoted", "Requests moved short_decode -> long_decode"),
                ("thinkserve_resumes_total", "resumed", "Requests resumed after losing their instance"),
                ("thinkserve_admission_refused_total", "admission_refused",
                 "Requests refused at admission (TTFT target out of reach)")):
            fam = CounterMetricFamily(name, text)
            fam.add_metric((), getattr(c, key))
            yield fam
        local = CounterMetricFamily("thinkserve_local_prefills_total", "Prompts a decode instance prefilled in place "
                                    "(the Conductor's conditional disaggregation)", labels=("pool",))
        for pool, count in sorted(c.local_prefills.items()):
            local.add_metric((pool,), count)
        yield local
        sends = CounterMetricFamily("thinkserve_kv_transfers_total", "KV page-set sends between instances",
                                    labels=("transport",))
        moved = CounterMetricFamily("thinkserve_kv_transfer_bytes_total", "KV bytes moved between instances",
                                    labels=("transport",))
        secs = CounterMetricFamily("thinkserve_kv_transfer_seconds_total", "Time spent sending those bytes",
                                   labels=("transport",))
        rate = GaugeMetricFamily("thinkserve_kv_transfer_gbps", "Mean KV transfer rate since start, GB/s "
                                 "(rate(bytes)/rate(seconds) for a window)", labels=("transport",))
        for t in TRANSPORTS:
            kv = c.transport(t)
            b, s = kv.bytes, kv.seconds
            sends.add_metric((t,), kv.sends)
            moved.add_metric((t,), b)
            secs.add_metric((t,), s)
            rate.add_metric((t,), b / s / 1e9 if s > 0 else 0.0)
        yield from (sends, moved, secs, rate)
        yield from self._stores()
        yield self._loop_lag()

    def _loop_lag(self):
        """How late the frontend's event loop woke a 10 ms timer (``loop_lag.LoopLag``)."""
        gauge = self.m.core.loop_lag
        fam = HistogramMetricFamily("thinkserve_frontend_loop_lag_seconds", "Lateness of the frontend event loop's "
                                    "10 ms timer: how long every callback waited behind the one running")
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, LAG_BUCKETS), "+Inf"), gauge.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        fam.add_metric((), buckets, gauge.total_s)
        return fam

    def _instances(self, orch):
        g = {k: GaugeMetricFamily(f"thinkserve_instance_{k}", text, labels=("pool", "instance")) for k, text in (
            ("running_requests", "Requests in the engine's running batch"),
            ("waiting_requests", "Requests queued in the engine"),
            ("swapped_requests", "Requests preempted and swapped out"),
            ("kv_usage_ratio", "Fraction of device KV blocks in use"),
            ("kv_free_blocks", "Free device KV blocks"),
            ("kv_total_blocks", "Device KV blocks"),
            ("prefix_cache_hit_ratio", "Prefix cache hit blocks / looked-up full prompt blocks"))}
        ctr = {k: CounterMetricFamily(f"thinkserve_instance_{k}", text, labels=("pool", "instance")) for k, text in (
            ("generated_tokens", "Tokens generated by the instance"),
            ("steps", "Engine steps"),
            ("store_prefix_blocks", "Prefix blocks loaded from the CPU KV store"))}
        pre = CounterMetricFamily("thinkserve_instance_preemptions_total", "Engine preemptions by mode",
                                  labels=("pool", "instance", "mode"))
        kv_labels = ("pool", "instance", "kind", "transport")
        kv = {k: CounterMetricFamily(f"thinkserve_instance_kv_{k}", text, labels=kv_labels) for k, text in (
            ("transfers", "KV moves the instance made: sends (handoff, fanout, migrate), page sets received "
                          "(page_set), store swaps (swap_out, swap_in) and prefixes (prefix_put, prefix_get)"),
            ("transfer_failures", "Those KV moves that failed"),
            ("transfer_bytes", "Bytes of those KV moves"),
            ("transfer_seconds", "Time those KV moves took"))}
        pools = {p: [0, 0, 0, 0, 0] for p in POOL_NAMES}   # running, waiting, used blocks, total blocks, instances
        view = orch.view
        for iid, member in list(view.members.items()):
            s = view.stats.get(iid)
            if s is None:
                continue
            lab = (member.pool, iid)
            used = s.num_total_blocks - s.num_free_blocks
            for k, v in (("running_requests", s.num_running), ("waiting_requests", s.num_waiting),
                         ("swapped_requests", s.num_swapped),
                         ("kv_usage_ratio", used / s.num_total_blocks if s.num_total_blocks else 0.0),
                         ("kv_free_blocks", s.num_free_blocks), ("kv_total_blocks", s.num_total_blocks),
                         ("prefix_cache_hit_ratio", s.prefix_cache_hit_rate)):
                g[k].add_metric(lab, v)
            for k, v in (("generated_tokens", s.generated_tokens), ("steps", s.steps),
                         ("store_prefix_blocks", s.store_prefix_blocks)):
                ctr[k].add_metric(lab, v)
            for t in s.kv_transfers:
                kl = lab + (t.kind, t.transport)
                kv["transfers"].add_metric(kl, t.count)
                kv["transfer_failures"].add_metric(kl, t.failures)
                kv["transfer_bytes"].add_metric(kl, t.bytes)
                kv["transfer_seconds"].add_metric(kl, t.seconds)
            pre.add_metric(lab + ("recompute",), s.num_recompute_preemptions)
            pre.add_metric(lab + ("swap",), s.num_preemptions - s.num_recompute_preemptions)
            agg = pools.setdefault(member.pool, [0, 0, 0, 0, 0])
            for i, v in enumerate((s.num_running, s.num_waiting, used, s.num_total_blocks, 1)):
                agg[i] += v
        yield from g.values()
        yield from ctr.values()
        yield from kv.values()
        yield pre
        pg = {k: GaugeMetricFamily(f"thinkserve_pool_{k}", text, labels=("pool",)) for k, text in (
            ("running_requests", "Requests running in the pool's engines"),
            ("waiting_requests", "Requests queued in the pool's engines"),
            ("kv_usage_ratio", "Fraction of the pool's device KV blocks in use"),
            ("instances", "Instances reporting stats"))}
        for pool, (run, wait, used, total, n) in pools.items():
            pg["running_requests"].add_metric((pool,), run)
            pg["waiting_requests"].add_metric((pool,), wait)
            pg["kv_usage_ratio"].add_metric((pool,), used / total if total else 0.0)
            pg["instances"].add_metric((pool,), n)
        yield from pg.values()

    def _stores(self):
        fams = {k: CounterMetricFamily(f"thinkserve_store_{k}", text, labels=("node",)) for k, text in (
            ("hits", "CPU KV store block hits"), ("misses", "CPU KV store block misses"),
            ("puts", "Blocks stored"), ("refused", "Blocks a put could not store"),
            ("evictions", "Blocks evicted (LRU)"), ("evicted_bytes", "Bytes evicted"))}
        used = GaugeMetricFamily("thinkserve_store_used_bytes", "CPU KV store bytes in use", labels=("node",))
        cap = GaugeMetricFamily("thinkserve_store_capacity_bytes", "CPU KV store capacity", labels=("node",))
        stores = self.m.core.orch.view.stores
        for address, st in self.m.core.store_stats.items():
            if address not in stores:
                continue
            node = stores[address].node_id
            for k, fam in fams.items():
                fam.add_metric((node,), getattr(st, k))
            used.add_metric((node,), st.bytes_used)
            cap.add_metric((node,), st.capacity_bytes)
        yield from fams.values()
        yield from (used, cap)
