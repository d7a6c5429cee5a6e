"""The lazy steady batch (``cluster/sim/steady_batch.py``) changes no result: against one real
scheduler step at a time, with and without KV pressure (recompute preemptions), and against the
eager bulk path the instance takes with the prefix cache on (where laziness is off)."""
from __future__ import annotations

import pytest

from thinkserve.cluster.sim import steady_batch
from thinkserve.cluster.sim.metrics import summarize
from thinkserve.cluster.sim.setup import Deployment, build, default_slo, make_cost
from thinkserve.cluster.sim.workload import ReasoningMix
from thinkserve.workers.scheduler import Scheduler

SMALL_MIX = ReasoningMix(long_median=300, max_output=2048, short_median=60, short_max=512, best_of_n_share=0.3)


@pytest.fixture
def run_ends(monkeypatch):
    """The lazy batch's run ends: (steps, branches), a spy around the real method."""
    calls = []
    real = steady_batch.SteadyBatch.run_end

    def spy(self, k):
        calls.append((k, len(self.members)))
        return real(self, k)

    monkeypatch.setattr(steady_batch.SteadyBatch, "run_end", spy)
    return calls


def latencies(sim) -> dict:
    # -1: never (a request refused because its prompt does not fit the cache)
    return {rid: tuple(-1.0 if t is None else t for t in (rec.first_token, rec.finish)) + (rec.truncated,)
            for rid, rec in sim.records.items()}


def _conserved(sim) -> None:
    for inst in sim.instances:
        inst.check_integrity()
        assert inst.batch is None or not inst.batch.members
        assert not inst.scheduler.requests and inst.bm.num_free_blocks == inst.bm.num_blocks


@pytest.mark.parametrize("policy,rate,kv_blocks,slots", [("colocated", 12.0, None, 64), ("pd", 8.0, None, 64),
                                                         ("colocated", 40.0, 300, 64), ("pd", 40.0, 300, 64),
                                                         ("colocated", 12.0, None, 12), ("pd", 12.0, None, 12)])
def test_lazy_batch_equals_step_by_step(policy, rate, kv_blocks, slots, run_ends, monkeypatch):
    """One instance per pool (the router has no choice, see test_sim's bulk test), the prefix
    cache off (the lazy batch's condition); with 300 blocks the scheduler preempts; with 12
    batch slots a queue waits behind a full batch, and the batch admits from it lazily
    (``Scheduler.admit``); under pd, imports fill a decode instance's 12 slots and then wait
    for one (``Scheduler.reserve_import``) while the batch runs on steady."""
    admits = []
    real_admit = Scheduler.admit

    def admit(self, num_steady):
        out = real_admit(self, num_steady)
        admits.append(len(out.work))
        return out

    monkeypatch.setattr(Scheduler, "admit", admit)

    def run(bulk):
        cost = make_cost("h200", "qwen2.5-7b")
        if kv_blocks:
            cost.kv_capacity_tokens = lambda: 16 * kv_blocks
        return build(SMALL_MIX.generate(rate, 150, 1), Deployment(policy, prefill_share=0.5), cost,
                     1 if policy == "colocated" else 2, block_size=16, max_num_seqs=slots, bulk_decode=bulk,
                     prefix_caching=False).run()

    fast = run(True)
    lazy_runs = len(run_ends)
    slow = run(False)
    assert lazy_runs > 0 and len(run_ends) == lazy_runs  # the step-by-step run never goes lazy
    if slots < 64 and policy == "pd":
        assert max(size for _, size in run_ends) == slots
    if slots < 64 and policy == "colocated":
        assert sum(admits) > 0 and admits.count(0) > 0  # admitted from the queue, or found it blocked
    lf, ls = latencies(fast), latencies(slow)
    assert lf.keys() == ls.keys()
    for rid in ls:
        assert lf[rid] == pytest.approx(ls[rid], rel=1e-9, abs=1e-9), rid
    assert sum(i.num_steps for i in fast.instances) == sum(i.num_steps for i in slow.instances)
    preempted = [i.scheduler.num_preemptions for i in fast.instances]
    assert preempted == [i.scheduler.num_preemptions for i in slow.instances]
    assert (sum(preempted) > 0) == bool(kv_blocks)
    _conserved(fast)
    _conserved(slow)
    # Every request finished: under pd a prefill instance whose queue waited for room was left
    # idle when its held requests' blocks came back (nothing woke it; 30 of 150 never ran).
    assert all(r.finish is not None for r in fast.records.values())


@pytest.mark.parametrize("policy", ["colocated", "pd", "conductor"])
def test_lazy_batch_equals_the_eager_bulk_path(policy, run_ends):
    """With 32-token blocks no two prompts share a block, so the prefix cache changes nothing
    but whether the instances run lazily: every result is equal, promotions (KV moved out of a
    lazy batch mid-decode) and bytes moved included."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(12.0, 300, 5)
    sims = []
    for caching in (False, True):
        before = len(run_ends)
        sims.append(build(reqs, Deployment(policy), cost, 8, block_size=32, max_num_seqs=64,
                          prefix_caching=caching).run())
        assert (len(run_ends) > before) == (not caching)
    lazy, eager = sims
    assert latencies(lazy) == latencies(eager)
    for attr in ("num_promotions", "num_migrations", "bytes_moved", "num_transfers"):
        assert getattr(lazy, attr) == getattr(eager, attr), attr
    if policy == "conductor":
        assert lazy.num_promotions > 0
    assert [i.num_steps for i in lazy.instances] == [i.num_steps for i in eager.instances]
    slo = default_slo("h200")
    assert summarize(lazy, slo) == summarize(eager, slo)
    _conserved(lazy)


def test_need_is_the_per_phase_sum():
    """``SteadyBatch.need`` (one slice sum over the phase histogram) against the blocks each phase
    takes, summed phase by phase: every block size, clock and run length here."""
    import random

    rng = random.Random(0)
    for bs in (1, 2, 16, 64):
        bm = type("BM", (), {"block_size": bs})()
        for _ in range(300):
            b = steady_batch.SteadyBatch(bm)
            b.clock = rng.randint(0, 10 ** 6)
            b._hist = [rng.choice((0, 0, rng.randint(1, 40))) for _ in range(bs)]
            b.members = dict.fromkeys(range(sum(b._hist)))
            for k in (1, 2, 3, bs, bs + 1, rng.randint(1, 500), rng.randint(1, 10 ** 6)):
                by_phase = sum(count * (((phase + b.clock) % bs + k - 1) // bs) for phase, count in enumerate(b._hist))
                assert b.need(k) == by_phase, (bs, b.clock, k)
