"""The simulator: exact latencies of a hand-computed case, determinism, conservation, bulk decode
runs equal to step-by-step simulation, and the policies being the router's and workers' own."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from thinkserve.cluster.sim.cost import LinearCost
from thinkserve.cluster.sim.hardware import TINY_REASONER
from thinkserve.cluster.sim.metrics import request_latencies, summarize
from thinkserve.cluster.sim.setup import Deployment, build, default_slo, make_cost
from thinkserve.cluster.sim.workload import ReasoningMix, SimRequest, load_trace

TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation.jsonl"
SMALL_MIX = ReasoningMix(long_median=300, max_output=2048, short_median=60, short_max=512, best_of_n_share=0.3)


def linear(c0=0.01, c_prefill=0.001, *, bw=98304 / 0.001, latency=0.004) -> LinearCost:
    return LinearCost(TINY_REASONER, {"c0": c0, "c_prefill": c_prefill, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                      kv_capacity_tokens=16 * 64, transfer_bw=bw, transfer_latency_s=latency)


def latencies(sim) -> dict:
    return {rid: (rec.first_token, rec.finish) for rid, rec in sim.records.items()}


def test_hand_computed_colocated():
    # One instance; step = 10 ms + 1 ms per prompt token (decode tokens are free).
    reqs = [SimRequest("a", 0.0, 10, (5,), salt=1), SimRequest("b", 0.015, 20, (3,), salt=2)]
    sim = build(reqs, Deployment("colocated"), linear(), 1).run()
    got = latencies(sim)
    # a: prefill 10 -> first token at 0.020. b arrives during it, joins the next step:
    # a decodes + b prefills 20 tokens = 0.010 + 0.020 -> 0.050 (a: 2 tokens, b: 1);
    # then 10 ms decode steps: 0.060 (a 3, b 2), 0.070 (a 4, b 3: b done), 0.080 (a 5: done).
    assert got["a"] == pytest.approx((0.020, 0.080), abs=1e-12)
    assert got["b"] == pytest.approx((0.050, 0.070), abs=1e-12)
    ttft, tpot, e2e = request_latencies(sim.records["b"])
    assert (ttft, tpot, e2e) == pytest.approx((0.035, 0.010, 0.055), abs=1e-12)


def test_hand_computed_disaggregated():
    # Prefill on one instance, KV (1 block of 16 tokens x 6144 B = 98304 B) moves at 98304 B per
    # ms plus 4 ms, decode continues on the other instance.
    reqs = [SimRequest("a", 0.0, 10, (5,), salt=1)]
    sim = build(reqs, Deployment("pd", prefill_share=0.5), linear(), 2).run()
    first, finish = latencies(sim)["a"]
    assert first == pytest.approx(0.020, abs=1e-12)
    assert finish == pytest.approx(0.020 + 0.005 + 4 * 0.010, abs=1e-12)
    assert sim.bytes_moved == 98304 and sim.num_transfers == 1


def _run(policy, *, seed=3, bulk=True, gpus=4, n=120, rate=6.0, prefill_share=0.25):
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = SMALL_MIX.generate(rate, n, seed)
    return build(reqs, Deployment(policy, prefill_share=prefill_share), cost, gpus, block_size=16, max_num_seqs=32,
                 bulk_decode=bulk).run()


@pytest.mark.parametrize("policy", ["colocated", "pd", "conductor"])
def test_deterministic_and_conserving(policy):
    a, b = _run(policy), _run(policy)
    assert latencies(a) == latencies(b)
    slo = default_slo("h200")
    assert summarize(a, slo) == summarize(b, slo)
    # Conservation: every request finished (none refused here), every block is back.
    assert all(r.finish is not None and r.refused is None for r in a.records.values())
    assert len(a.records) == 120
    for inst in a.instances:
        assert not inst.scheduler.requests and not inst.pending_imports and not inst.inbox
        inst.check_integrity()
        assert inst.bm.num_free_blocks == inst.bm.num_blocks
        assert inst.assigned_branches == 0 and inst.assigned_requests == 0
    assert summarize(a, slo)["finished"] == 120
    if policy != "colocated":
        # every prompt handed off, but those a short_decode instance prefilled itself
        assert a.num_transfers + a.num_local_prefills >= 120 and a.bytes_moved > 0
    if policy == "pd":
        assert a.num_local_prefills == 0
    if policy == "conductor":
        assert a.num_migrations == a.num_promotions  # every promotion decided was carried out


def test_conditional_disaggregation_prefills_on_short_decode_and_conserves():
    """The Conductor's local prefills run on the short_decode instance it names, which decodes
    them on (no page set); off, every prompt goes through the prefill pool."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = SMALL_MIX.generate(6.0, 120, 3)
    on = build(reqs, Deployment("conductor", conditional_disagg=True), cost, 4, block_size=16, max_num_seqs=32).run()
    off = build(reqs, Deployment("conductor", conditional_disagg=False), cost, 4, block_size=16, max_num_seqs=32).run()
    local = [r for r in on.records.values() if r.placement.mode == "local_prefill"]
    assert len(local) == on.num_local_prefills > 0 and off.num_local_prefills == 0
    for r in local:
        assert r.placement.decode_pool == "short_decode" and r.finish is not None
        assert [a.instance_id for a in r.placement.decode] == [r.placement.prefill_instance]
    assert on.num_transfers < off.num_transfers
    # every local prefill's first token refitted the decode instances' TTFT model, none the prefill pool's
    assert on.policy.local_prefill_fit.measurements == on.num_local_prefills
    assert off.policy.local_prefill_fit.measurements == 0
    for sim in (on, off):
        assert all(r.finish is not None and r.refused is None for r in sim.records.values())
        for inst in sim.instances:
            inst.check_integrity()
            assert inst.bm.num_free_blocks == inst.bm.num_blocks
            assert inst.assigned_branches == 0 and inst.assigned_requests == 0


def test_conductor_promotes_and_conserves():
    """The Conductor's promotions move KV short -> long mid-decode; nothing is lost."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(10.0, 300, 5)
    sim = build(reqs, Deployment("conductor"), cost, 8, max_num_seqs=64).run()
    assert sim.num_promotions > 0 and sim.num_migrations == sim.num_promotions
    assert all(r.finish is not None or r.refused is not None for r in sim.records.values())
    for inst in sim.instances:
        inst.check_integrity()
        assert not inst.scheduler.requests and inst.bm.num_free_blocks == inst.bm.num_blocks
        assert inst.assigned_branches == 0


def test_a_promotion_round_moves_at_most_its_cap():
    """A promotion round (every 0.5 s) moves at most ``Conductor.promotion_cap`` of the long pool:
    ``Deployment.max_promotions`` alone with ``promotions_per_long_instance`` 0, else that many
    per long_decode instance (8 GPUs: 3 long instances), the floor ``max_promotions``. A cold
    predictor sends every chain to short_decode first, so many are due. Batches of 128, so that
    long_decode has slots for them (a promotion waits for a free slot: at 64 long_decode's batches
    fill and the runs promote about as many)."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(40.0, 1200, 5)
    horizon, rounds = 60.0, 60.0 / 0.5 + 1
    one = build(reqs, Deployment("conductor", max_promotions=1, promotions_per_long_instance=0.0), cost, 8,
                max_num_seqs=128).run(horizon)
    per_long = build(reqs, Deployment("conductor", max_promotions=1, promotions_per_long_instance=1.0), cost, 8,
                     max_num_seqs=128).run(horizon)
    free = build(reqs, Deployment("conductor"), cost, 8, max_num_seqs=128).run(horizon)
    assert [len(s.pools["long_decode"]) for s in (one, per_long, free)] == [3, 3, 3]
    assert [s.policy.promotion_cap(3) for s in (one, per_long, free)] == [1, 3, 8]
    assert 0 < one.num_promotions <= rounds < per_long.num_promotions <= 3 * rounds
    assert per_long.num_promotions < free.num_promotions


def test_without_online_learning_the_predictor_keeps_its_starting_state():
    """``Deployment.learn_lengths=False``: the Conductor places by its starting predictor for the
    whole run (finished and running branches teach it nothing); by default it learns from both."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(10.0, 300, 5)
    frozen = build(reqs, Deployment("conductor", learn_lengths=False), cost, 8, max_num_seqs=64)
    start = frozen.policy.predictor.state()
    frozen.run()
    learning = build(reqs, Deployment("conductor"), cost, 8, max_num_seqs=64).run()
    assert frozen.policy.predictor.state() == start and frozen.policy.predictor.observed == 0
    assert learning.policy.predictor.observed > 0
    assert all(r.finish is not None or r.refused is not None for r in frozen.records.values())


@pytest.mark.parametrize("policy,rate", [("colocated", 2.0), ("pd", 2.0), ("colocated", 12.0)])
def test_bulk_decode_runs_equal_step_by_step(policy, rate):
    """The fast path changes nothing: the same first-token and finish times as one real
    scheduler step at a time (up to float rounding of the closed-form sums). One instance per
    pool, so that the router has no choice to make: the engine-reported fields of a snapshot
    (free blocks) are as of the last step boundary or decode-run start, which differ. At 12
    req/s the batch is full (32 sequences, Best-of-N forks, a queue): runs continue past
    finishes without a schedule() pass only when the scheduler would have had no choice."""
    kw = dict(n=60, gpus=1 if policy == "colocated" else 2, prefill_share=0.5, rate=rate)
    fast, slow = _run(policy, bulk=True, **kw), _run(policy, bulk=False, **kw)
    assert sum(i.num_runs for i in fast.instances) > 0
    lf, ls = latencies(fast), latencies(slow)
    assert lf.keys() == ls.keys()
    for rid in lf:
        assert lf[rid] == pytest.approx(ls[rid], rel=1e-9, abs=1e-9), rid
    assert sum(i.num_steps for i in fast.instances) == sum(i.num_steps for i in slow.instances)
    assert [i.scheduler.num_preemptions for i in fast.instances] == [i.scheduler.num_preemptions
                                                                   for i in slow.instances]


def test_bulk_decode_equals_step_by_step_under_recompute_preemption():
    """A tiny KV cache with the prefix cache on: recompute preemptions, re-admissions that hit
    the cached blocks of their own earlier run. A run's branches must take their blocks before
    any of them finishes (as the engine's steps do), or a finished branch's freed block is taken
    where the engine evicts a cached one, and later prefix hits (and timings) differ."""
    def run(bulk):
        cost = make_cost("h200", "qwen2.5-7b")
        cost.kv_capacity_tokens = lambda: 16 * 300
        return build(SMALL_MIX.generate(40.0, 150, 1), Deployment("colocated"), cost, 1, block_size=16,
                     max_num_seqs=64, bulk_decode=bulk).run()

    fast, slow = run(True), run(False)
    assert fast.instances[0].num_runs > 0 and fast.instances[0].bm.enable_prefix_caching
    assert fast.instances[0].scheduler.num_preemptions == slow.instances[0].scheduler.num_preemptions > 0
    # (hit counts themselves differ: a Best-of-N request whose admission fails half-way counts
    # its first branch's hits, and step by step it is tried at every step)
    assert fast.instances[0].bm.num_prefix_hit_blocks > 0
    lf, ls = latencies(fast), latencies(slow)
    for rid in ls:
        assert lf[rid] == pytest.approx(ls[rid], rel=1e-9, abs=1e-9), rid
    assert fast.instances[0].num_steps == slow.instances[0].num_steps


def test_kv_pressure_preempts_and_still_conserves():
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = SMALL_MIX.generate(40.0, 150, 1)
    # A tiny KV cache: the real scheduler must preempt (recompute) and still finish everything.
    cost.kv_capacity_tokens = lambda: 16 * 300
    sim = build(reqs, Deployment("colocated"), cost, 1, block_size=16, max_num_seqs=64).run()
    assert sum(i.scheduler.num_preemptions for i in sim.instances) > 0
    assert all(r.finish is not None for r in sim.records.values())
    for inst in sim.instances:
        inst.check_integrity()
        assert inst.bm.num_free_blocks == inst.bm.num_blocks


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not in ../shared/traces")
def test_trace_prefix_reuse():
    reqs = load_trace(TRACE, 150, rate=5.0)
    assert reqs[0].hash_ids and all(r.prompt_tokens()[:512] == [r.hash_ids[0] + 1] * 512 for r in reqs[:5])
    # The router sees the trace's cap (less where a huge prompt leaves less room), never each
    # request's own output length.
    assert sum(r.max_tokens == 2048 for r in reqs) > 0.9 * len(reqs)
    assert all(r.output_lens[0] <= r.max_tokens for r in reqs)
    sim = build(reqs, Deployment("colocated"), make_cost("h200", "qwen2.5-7b"), 2).run()
    hits = sum(i.bm.num_prefix_hit_blocks for i in sim.instances)
    assert hits > 0
    assert all(r.finish is not None for r in sim.records.values())


def test_policies_are_the_router_and_workers_own():
    """A copied policy fails this: the objects the simulator runs are the ones imported from
    thinkserve.router and thinkserve.workers, and nothing in the sim package re-defines them."""
    from thinkserve.router import LeastLoadedPolicy
    from thinkserve.router import placement
    from thinkserve.workers.block_manager import BlockManager
    from thinkserve.workers.scheduler import Scheduler

    from thinkserve.router import conductor

    sim = _run("pd", n=5)
    assert type(sim.policy) is LeastLoadedPolicy and type(sim.policy).__module__ == "thinkserve.router.placement"
    assert type(sim.policy).place is placement.LeastLoadedPolicy.place
    three = _run("conductor", n=5)
    assert type(three.policy) is conductor.Conductor
    assert type(three.policy).place is conductor.Conductor.place
    assert type(three.policy).promotions is conductor.Conductor.promotions
    for inst in sim.instances + three.instances:
        assert type(inst.scheduler) is Scheduler and type(inst.bm) is BlockManager
    pkg = Path(__import__("thinkserve.cluster.sim", fromlist=["x"]).__file__).parent
    sources = [pkg.parent / "sim_cli.py", *pkg.glob("*.py")]
    banned = re.compile(r"^\s*(def (place|schedule|spread_branches|predict_len|decode_pool_for|majority_vote|"
                        r"allocate|append_slots|can_append|_admit|_preempt\w*|pick_target)\b|"
                        r"class \w*(Policy|Scheduler|BlockManager|Conductor)\b)", re.M)
    for src in sources:
        found = banned.findall(src.read_text())
        assert not found, f"{src.name} re-defines policy code: {found}"


def test_cli_writes_results_and_plots(tmp_path, capsys):
    from thinkserve.cluster.cli import main
    rc = main(["sim", "--workload", "reasoning", "--policy", "colocated", "pd", "--gpus", "4", "--gpu", "h200",
               "--model", "qwen2.5-7b", "--rate", "2", "4", "--requests", "40", "--seed", "1",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["policy"], r["rate"]) for r in res["runs"]] == [("colocated", 2.0), ("pd", 2.0),
                                                             ("colocated", 4.0), ("pd", 4.0)]
    run = res["runs"][0]
    assert run["finished"] == 40 and set(run["classes"]["all"]["ttft"]) == {"p50", "p90", "p99", "p99.9", "mean"}
    assert math.isfinite(run["goodput_per_gpu"])
    assert set(res["max_rate_at_90pct_slo"]) == {"colocated", "pd"}
    assert (tmp_path / "latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "goodput_vs_rate.png").stat().st_size > 1000


def test_cli_bad_input(tmp_path, capsys):
    from thinkserve.cluster.cli import main
    assert main(["sim", "--workload", "reasoning", "--gpus", "0", "--rate", "1", "--out", str(tmp_path)]) == 2
    assert "--gpus" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    assert main(["sim", "--workload", str(bad), "--policy", "colocated", "--gpus", "1", "--out", str(tmp_path)]) == 2
    assert "output_length" in capsys.readouterr().err
    assert main(["sim", "--workload", "reasoning", "--policy", "conductor", "--gpus", "4", "--rate", "1",
                 "--early-stop", "sometimes", "--out", str(tmp_path)]) == 2
    assert "--early-stop" in capsys.readouterr().err
    assert main(["sim", "--workload", "reasoning", "--policy", "pd", "--gpus", "1", "--rate", "1",
                 "--out", str(tmp_path)]) == 2
    assert "at least 2 instances" in capsys.readouterr().err
    assert main(["sim", "--workload", "reasoning", "--policy", "pd", "--gpus", "2", "--rate", "1",
                 "--pool-max-num-seqs", "decode=8", "--out", str(tmp_path)]) == 2
    assert "--pool-max-num-seqs" in capsys.readouterr().err


def test_a_pool_takes_its_own_batch_cap(tmp_path):
    """``pool_max_num_seqs`` caps one pool's engines (the cluster's per-pool engine config): the
    decode instance holds at most its 4 branches while the prefill instance keeps the default, the
    router sees each instance's own cap, and everything finishes with every block back."""
    from thinkserve.cluster.cli import main
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = SMALL_MIX.generate(20.0, 200, 5)
    peaks = {}

    def run(caps):
        sim = build(reqs, Deployment("pd", prefill_share=0.5), cost, 2, block_size=16, max_num_seqs=64,
                    pool_max_num_seqs=caps)
        decode = sim.pools["short_decode"][0]
        peak, wake = [0], decode.wake

        def wake_and_count(now):                         # the batch as each step starts
            t = wake(now)
            peak[0] = max(peak[0], decode.scheduler.num_running_seqs())
            return t
        decode.wake = wake_and_count
        sim.run()
        peaks[str(caps)] = peak[0]
        return sim

    capped = run({"short_decode": 4, "mixed": 2})       # a pool pd does not have: ignored
    prefill, decode = capped.pools["prefill"][0], capped.pools["short_decode"][0]
    assert prefill.config.max_num_seqs == 64 and decode.config.max_num_seqs == 4
    snap = capped.snapshot()
    assert snap.pool("prefill").instances[0].max_num_seqs == 64
    assert snap.pool("short_decode").instances[0].max_num_seqs == 4
    assert peaks[str({"short_decode": 4, "mixed": 2})] == 4
    assert all(r.finish is not None and r.refused is None for r in capped.records.values())
    for inst in capped.instances:
        inst.check_integrity()
        assert inst.bm.num_free_blocks == inst.bm.num_blocks
    run(None)
    assert peaks["None"] > 4                             # the cap changed the run
    # the CLI passes it through
    assert main(["sim", "--workload", "reasoning", "--policy", "pd", "--gpus", "2", "--rate", "4",
                 "--requests", "30", "--pool-max-num-seqs", "short_decode=4", "--out", str(tmp_path), "--quiet"]) == 0


def test_early_consensus_cancels_branches_and_keeps_the_vote():
    """router.consensus's ``unbeatable`` rule stops Best-of-N requests early; its answer is always
    the full vote's, the cancelled branches give their blocks back."""
    from thinkserve.router.answers import majority_vote

    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix(best_of_n_share=1.0, long_share=0.5).generate(4.0, 80, 2)
    sim = build(reqs, Deployment("conductor", early_stop="unbeatable", promotion=False), cost, 4).run()
    decided = [r for r in sim.records.values() if r.decided]
    assert decided and sim.num_cancelled_branches > 0
    for rec in sim.records.values():
        if rec.req.n > 1 and rec.refused is None:
            answers = [None] * rec.req.n
            for f in rec.finished_branches:
                answers[f.index] = f.answer
            assert majority_vote(answers).answer == majority_vote(list(rec.req.answers)).answer
    assert sum(r.tokens_saved for r in decided) > 0
    for inst in sim.instances:
        inst.check_integrity()
        assert not inst.scheduler.requests and inst.bm.num_free_blocks == inst.bm.num_blocks
        assert inst.assigned_branches == 0 and inst.assigned_requests == 0


def test_prefix_caching_off_changes_nothing_on_unique_prompts():
    """With 32-token blocks the generated mix's prompts share no full block, so ``build`` turns
    the prefix cache off (it would only hash): the results equal a run with it on."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = SMALL_MIX.generate(6.0, 120, 3)
    assert build(reqs, Deployment("colocated"), cost, 1, block_size=16).instances[0].bm.enable_prefix_caching
    runs = [build(reqs, Deployment("conductor"), cost, 4, block_size=32, max_num_seqs=32, prefix_caching=on).run()
            for on in (None, True)]
    assert not runs[0].instances[0].bm.enable_prefix_caching and runs[1].instances[0].bm.enable_prefix_caching
    assert latencies(runs[0]) == latencies(runs[1])
    assert sum(i.bm.num_prefix_hit_blocks for i in runs[1].instances) == 0
    slo = default_slo("h200")
    assert summarize(runs[0], slo) == summarize(runs[1], slo)


def test_horizon_judges_running_requests_on_what_they_did():
    """The hand-computed case stopped at 65 ms, inside the decode run from 50 ms to 70 ms: the
    run gives the tokens of its completed step (60 ms) and none of the one in progress."""
    reqs = [SimRequest("a", 0.0, 10, (5,), salt=1), SimRequest("b", 0.015, 20, (3,), salt=2)]
    sim = build(reqs, Deployment("colocated"), linear(), 1).run(horizon=0.065)
    a, b = sim.records["a"], sim.records["b"]
    assert a.finish is None and b.finish is None
    assert (a.tokens_out, b.tokens_out) == (3, 2)  # a: 20, 50, 60 ms; b: 50, 60 ms
    assert request_latencies(a, 0.065) == pytest.approx((0.020, (0.065 - 0.020) / 2, None))
    assert request_latencies(b, 0.065) == pytest.approx((0.035, 0.015, None))
    s = summarize(sim, default_slo("cpu"), window=(0.0, 0.010))
    assert s["requests"] == 1 and s["unfinished_at_horizon"] == 1 and s["offered_rate"] == pytest.approx(100.0)
    assert s["slo_attainment"] == 0.0  # TPOT so far 22.5 ms > the cpu kind's 20 ms for short requests
    # A horizon past the end changes nothing.
    full = build(reqs, Deployment("colocated"), linear(), 1).run(horizon=1.0)
    assert latencies(full) == latencies(build(reqs, Deployment("colocated"), linear(), 1).run())


@pytest.mark.parametrize("kind", ["h200", "cpu"])
def test_steps_within_is_the_bisection(kind):
    """``DecodeRun.steps_within`` starts from the closed form and gallops; its answer is the
    plain bisection's (the fewest steps whose time reaches dt, else all k), on both cost models'
    runs, at step boundaries, just past them, before the run and past its end."""
    import random

    rng = random.Random(1)
    cost = make_cost(kind, "qwen2.5-7b" if kind == "h200" else "tiny-reasoner")

    def bisection(run, dt, k):
        lo, hi = 1, k
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if run.time(mid) >= dt else (mid + 1, hi)
        return lo

    for _ in range(3000):
        run = cost.decode_run(rng.randint(1, 400), rng.randint(1, 3_000_000))
        k = rng.choice([1, 2, 3, 17, 1000, 1 << 20, rng.randint(2, 100_000)])
        j = rng.randint(1, k)
        for dt in (rng.uniform(0, 1.2 * run.time(k)), run.time(j), run.time(j) + 1e-12, -1.0, 0.0, 2 * run.time(k)):
            assert run.steps_within(dt, k) == bisection(run, dt, k), (run, dt, k)


def test_hand_offs_do_not_starve_preempted_requests(monkeypatch):
    """One prefill and one decode instance, a small KV cache and a batch cap of 8: the decode
    instance preempts (recompute) while hand-offs keep arriving. Imports are admitted like queued
    requests, so the batch never exceeds its cap and a preempted request is re-admitted within
    seconds, not after the stream of hand-offs ends; every request finishes, every block is back.
    (Before, imports joined the batch whatever its size: 15 branches at the peak, and preempted
    requests waited up to 19 s.)"""
    from thinkserve.workers.scheduler import Scheduler

    cost = make_cost("h200", "qwen2.5-7b")
    cost.kv_capacity_tokens = lambda: 16 * 400
    mix = ReasoningMix(long_median=300, max_output=2048, short_median=60, short_max=512, best_of_n_share=0.0)
    reqs = mix.generate(10.0, 400, 1)
    sim = build(reqs, Deployment("pd", prefill_share=0.5), cost, 2, block_size=16, max_num_seqs=8)
    decode = sim.pools["short_decode"][0].scheduler
    preempted_at, waits, peak = {}, [], [0]

    def observed(method):
        def call(self, *args):
            out = method(self, *args)
            if self is decode:
                for req in out.preempted:
                    preempted_at.setdefault(req.request_id, sim.now)
                for rid in [r for r in preempted_at if r in self.requests and self.requests[r] in self.running]:
                    waits.append(sim.now - preempted_at.pop(rid))
                peak[0] = max(peak[0], self.num_running_seqs())
            return out
        return call

    monkeypatch.setattr(Scheduler, "schedule", observed(Scheduler.schedule))
    monkeypatch.setattr(Scheduler, "admit", observed(Scheduler.admit))
    sim.run()
    assert decode.num_preemptions > 50 and len(waits) == decode.num_preemptions and not preempted_at
    assert peak[0] == 8
    assert max(waits) < 5.0
    assert all(r.finish is not None and r.refused is None for r in sim.records.values())
    for inst in sim.instances:
        inst.check_integrity()
        assert not inst.scheduler.requests and not inst.pending_imports
        assert inst.bm.num_free_blocks == inst.bm.num_blocks
