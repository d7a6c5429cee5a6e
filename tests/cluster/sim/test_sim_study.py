"""``bench/sim_study.py``'s steady-state verdict: the pool state it samples during a run, and the
drift it fits over the run's last seconds, tell a run that has settled from one that queues."""
from __future__ import annotations

import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

from thinkserve.cluster.sim.metrics import summarize
from thinkserve.cluster.sim.setup import Deployment, build, default_slo, make_cost
from thinkserve.cluster.sim.workload import ReasoningMix

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import sim_study  # noqa: E402


def _run(rate: float, max_num_seqs: int, horizon: float = 240.0, long_share: float = 0.0, policy: str = "colocated"):
    cost = make_cost("h200", "qwen2.5-7b")
    # Chat requests only by default (at most 2,048 tokens, ~20 s at these steps): the population
    # settles in well under the horizon unless the batch cap makes arrivals queue.
    reqs = ReasoningMix(long_share=long_share).generate(rate, int(rate * horizon) + 1, seed=3,
                                                 max_model_len=cost.model.max_model_len)
    gpus, dep = (1, Deployment("colocated")) if policy == "colocated" else (2, Deployment("pd", prefill_share=0.5))
    sim = build(reqs, dep, cost, gpus, block_size=64, max_num_seqs=max_num_seqs)
    sampler = sim_study.PoolSampler(sim, 10.0)
    sim.run(horizon)
    return sim_study.drift(sampler.rows, span=100.0)


def test_a_run_under_capacity_is_steady():
    d = _run(rate=4.0, max_num_seqs=256)
    mixed = d["pools"]["mixed"]
    assert d["steady"] and mixed["state"] == "steady", sim_study.describe_drift(d)
    assert mixed["waiting"] < 1 and mixed["running_seqs"] > 10
    assert 0 < d["from_s"] < d["to_s"] <= 240.0


def test_a_run_held_to_a_small_batch_cap_queues():
    d = _run(rate=4.0, max_num_seqs=8)
    mixed = d["pools"]["mixed"]
    assert not d["steady"] and mixed["state"] == "queueing", sim_study.describe_drift(d)
    assert mixed["running_seqs"] == 8 and mixed["waiting_per_100s"] > 1.0


def test_a_run_whose_long_chains_are_still_accumulating_is_filling():
    # Chains of a median 3,000 and up to 32,768 tokens live minutes: 240 s in, they still pile up.
    d = _run(rate=2.0, max_num_seqs=1024, long_share=1.0)
    mixed = d["pools"]["mixed"]
    assert not d["steady"] and mixed["state"] == "filling", sim_study.describe_drift(d)
    assert mixed["kv_use_per_100s"] > 0.01 and mixed["running_per_100s"] > 0 and mixed["waiting"] < 1


def test_prefill_and_decode_pools_under_capacity_are_steady():
    d = _run(rate=4.0, max_num_seqs=256, policy="pd")
    assert d["steady"] and {p: v["state"] for p, v in d["pools"].items()} == \
        {"prefill": "steady", "short_decode": "steady"}, sim_study.describe_drift(d)
    assert d["pools"]["prefill"]["mean_kv_use"] < 0.01


def test_hand_offs_piling_up_on_the_prefill_instance_are_not_steady():
    # The decoding instance at a batch cap of 8 takes hand-offs only as its branches finish; the
    # others wait with their KV on the prefill instance. The decoding pool alone looks settled
    # (at its cap, its own KV and queue flat): the prefill pool's rising KV says otherwise.
    d = _run(rate=4.0, max_num_seqs=8, policy="pd")
    decode, prefill = d["pools"]["short_decode"], d["pools"]["prefill"]
    assert decode["state"] == "steady" and decode["running_seqs"] == 8, sim_study.describe_drift(d)
    assert not d["steady"] and prefill["state"] in ("filling", "backed up", "queueing"), sim_study.describe_drift(d)
    assert prefill["kv_use_per_100s"] > 0.01 or prefill["mean_kv_use"] >= sim_study.PREFILL_BACKED_UP_KV


def test_a_prefill_pool_holding_half_its_cache_is_backed_up():
    # Pool state as sampled (flat, no queue growth): the prefill instance's cache full of
    # hand-offs and the decoding pool at its cap, as in the 1 + 1 + 14 run of docs/simulator.md.
    def row(t):
        return {"t": t, "prefill": {"kv_use": 0.98, "running_seqs": 0.0, "waiting": 3.0, "step_ms": None},
                "short_decode": {"kv_use": 0.17, "running_seqs": 256.0, "waiting": 0.0, "step_ms": 30.0}}
    d = sim_study.drift([row(10.0 * k) for k in range(40)], span=300.0)
    assert not d["steady"] and d["pools"]["prefill"]["state"] == "backed up", sim_study.describe_drift(d)
    assert d["pools"]["short_decode"]["state"] == "steady"


def test_the_bound_ranks_splits_that_scale_with_the_cluster():
    # At 32 GPUs the Conductor's splits run up to 6 prefill and 8 short instances (3/16 and a
    # quarter of the GPUs), so a larger cluster can balance its three pools more finely than 16 can.
    args = SimpleNamespace(gpus=32, seed=0, bound_requests=2000, max_num_seqs=256, prefill_share=0.125)
    rows = sim_study.capacity_bound(args)
    splits = [r for r in rows if r["layout"].startswith("conductor")]
    assert {(r["prefill"], r["short"]) for r in splits} == {(p, s) for p in range(1, 7) for s in range(1, 9)}
    assert all(r["prefill"] + r["short"] + r["long"] == 32 for r in splits)
    best = splits[0]
    assert best["max_rate"] == max(r["max_rate"] for r in splits)
    assert best["max_rate"] == min(best["prefill_max_rate"], best["short_pool"]["max_rate"], best["long_pool"]["max_rate"])


def _stopped_run(max_num_seqs: int, start: float):
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix(long_share=0.0).generate(4.0, 4 * 240 + 1, seed=3, max_model_len=cost.model.max_model_len)
    sim = build(reqs, Deployment("colocated"), cost, 1, block_size=64, max_num_seqs=max_num_seqs)
    slo = default_slo("h200")
    sim_study.PoolSampler(sim, 10.0, stop=sim_study.FailingStop(sim, slo, window=30.0, start=start))
    return sim, slo


def test_a_clearly_failing_point_is_stopped_and_its_windows_do_fail():
    # Held to 8 branches the instance queues (the run above): TTFT misses pile up and the run
    # stops once two adjacent windows are certain to be under 90%. Run to its horizon without
    # the stop, the same stream judges both windows at or under the bound the stop read.
    sim, slo = _stopped_run(8, start=60.0)
    with pytest.raises(sim_study.Failing) as failing:
        sim.run(240.0)
    v = failing.value.verdict
    assert 60.0 <= v["stopped_at_s"] < 240.0 and len(v["windows"]) == 2
    (a0, a1), (b0, b1) = v["windows"][0]["window"], v["windows"][1]["window"]
    assert a1 == b0 and b1 == pytest.approx(v["stopped_at_s"] - 10.0)
    full, _ = _stopped_run(8, start=1e9)
    full.run(240.0)
    for w in v["windows"]:
        assert w["slo_attainment_at_most"] < 0.9
        assert summarize(full, slo, tuple(w["window"]))["slo_attainment"] <= w["slo_attainment_at_most"] + 1e-12


def test_the_failing_stop_only_reads_a_holding_point():
    # Under capacity nothing is stopped, and the run decides exactly what it decides without the check.
    sim, _ = _stopped_run(256, start=0.0)
    sim.run(240.0)
    plain = build(ReasoningMix(long_share=0.0).generate(4.0, 4 * 240 + 1, seed=3,
                                                        max_model_len=make_cost("h200", "qwen2.5-7b").model.max_model_len),
                  Deployment("colocated"), make_cost("h200", "qwen2.5-7b"), 1, block_size=64, max_num_seqs=256).run(240.0)
    assert {k: (r.first_token, r.finish, r.tokens_out) for k, r in sim.records.items()} == \
        {k: (r.first_token, r.finish, r.tokens_out) for k, r in plain.records.items()}
    assert sim.instances[0].num_steps == plain.instances[0].num_steps


def test_a_tighter_short_tpot_slo_holds_the_shared_batches_but_not_the_long_pool():
    # Colocated and pd decode short requests in the long chains' batches, so under a 10 ms short
    # TPOT SLO their batches are held to a 10 ms step; the Conductor's long pool is judged by the
    # long chains' own SLO (80 ms), so its bound does not move.
    base = dict(gpus=16, seed=0, bound_requests=2000, max_num_seqs=256, prefill_share=0.125)
    default = sim_study.capacity_bound(SimpleNamespace(**base))
    tight = sim_study.capacity_bound(SimpleNamespace(**base, slo_tpot=(0.01, 0.08)))
    for d, t in zip(default[:2], tight[:2]):
        assert not d["held_to_tpot"] and d["step_ms"] > 20
        assert t["held_to_tpot"] and t["step_ms"] <= 10.0 and t["batch"] < d["batch"]
        assert t["max_rate"] < 0.6 * d["max_rate"]
    best = lambda rows: max(r["max_rate"] for r in rows if r["layout"].startswith("conductor"))  # noqa: E731
    assert best(tight) > 0.9 * best(default)
    assert all(r["short_pool"]["step_ms"] <= 10.0 for r in tight if r["layout"].startswith("conductor"))


def _point(rate, attainment, steady=True, variant="colocated"):
    return {"rate": rate, "slo_attainment": attainment, "drift": {"steady": steady}, "variant": variant,
            "goodput_per_gpu": rate / 16, "classes": {"short": {"ttft": {"p99": 0.1}, "tpot": {"p99": 0.01}}}}


def test_the_knee_is_the_highest_steady_rate_meeting_90_percent_and_the_first_failure_above():
    runs = [_point(20, 1.0), _point(22.5, 0.919), _point(25, None), _point(27.5, 0.95, steady=False)]
    k = sim_study.knee(runs)
    assert (k["holds"], k["fails"]) == (22.5, 25)
    k = sim_study.knee([_point(40, 0.99, variant="conductor-1+1+14"), _point(45, 0.995, variant="conductor-1+2+13"),
                        _point(50, 0.89, variant="conductor-1+2+13")])
    assert (k["holds"], k["fails"], k["variant"]) == (45, 50, "conductor-1+2+13")
    k = sim_study.knee([_point(20, 0.5)])
    assert (k["holds"], k["fails"]) == (None, 20)


def test_same_max_tokens_hides_the_class_from_max_tokens_and_changes_nothing_else():
    # --same-max-tokens: every request asks for 32,768 tokens, so only a length prediction can
    # tell a chat turn from a chain; the requests are otherwise those of the default mix.
    default = sim_study.make_workload("reasoning", rate=10.0, requests=400, seed=3, max_model_len=10**6,
                                      mix=sim_study.study_mix(SimpleNamespace()))
    same = sim_study.make_workload("reasoning", rate=10.0, requests=400, seed=3, max_model_len=10**6,
                                   mix=sim_study.study_mix(SimpleNamespace(same_max_tokens=True)))
    assert {r.max_tokens for r in default} == {2048, 32768} and {r.max_tokens for r in same} == {32768}
    assert [(r.arrival, r.prompt_len, r.cls) for r in default] == [(r.arrival, r.prompt_len, r.cls) for r in same]
    assert all(a.output_lens == b.output_lens for a, b in zip(default, same) if max(b.output_lens) < 2048)


def test_the_sweep_reads_one_directory_per_slo_and_pairs_each_with_its_bound(tmp_path):
    import json
    for tpot, col, cond in ((0.05, (50, 55), (55, 60)), (0.01, (20, 25), (55, 60))):
        d = tmp_path / f"tpot{tpot}"
        d.mkdir()
        slo = {"ttft": {"short": 1.0, "long": 5.0}, "tpot": {"short": tpot, "long": 0.08}}
        for name, policy, (hold, fail) in (("colocated", "colocated", col), ("conductor-1+1+14", "conductor", cond)):
            runs = [_point(hold, 0.99, variant=name) | {"policy": policy, "slo": slo, "gpus": 16},
                    _point(fail, 0.5, variant=name) | {"policy": policy, "slo": slo, "gpus": 16}]
            (d / f"{name}.json").write_text(json.dumps(runs))
    args = SimpleNamespace(gpus=16, seed=0, bound_requests=2000, max_num_seqs=256, prefill_share=0.125, drift_span=300.0)
    rows = sim_study.slo_sweep(tmp_path, [str(tmp_path / "tpot0.01"), str(tmp_path / "tpot0.05")], args)
    assert [r["slo_tpot"][0] for r in rows] == [0.05, 0.01]                 # loosest first
    assert [(r["colocated"]["holds"], r["conductor"]["holds"]) for r in rows] == [(50, 55), (20, 55)]
    assert rows[1]["bound"]["colocated"] < 0.6 * rows[0]["bound"]["colocated"]   # held to a 10 ms step
    assert (tmp_path / "slo_sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "slo_sweep.json").read_text()) == json.loads(json.dumps(rows))
    one = tmp_path / "tpot0.05"                    # a sweep written into a directory it reads, read again
    assert sim_study.slo_sweep(one, [str(one)], args) == sim_study.slo_sweep(one, [str(one)], args) == rows[:1]
    mixed = tmp_path / "tpot0.01" / "pd.json"                                # another SLO in the same directory
    mixed.write_text(json.dumps([_point(20, 0.5) | {"policy": "pd", "slo": {"ttft": {"short": 1.0, "long": 5.0},
                                                                             "tpot": {"short": 0.02, "long": 0.08}},
                                                   "gpus": 16}]))
    with pytest.raises(SystemExit, match="one directory per SLO"):
        sim_study.slo_sweep(tmp_path, [str(tmp_path / "tpot0.01")], args)


def test_the_bound_prices_the_mix_the_study_runs():
    # --same-max-tokens lets a chat turn run past 2,048 tokens (its cap is 32,768 then), so its
    # bound is over those requests, not the default mix's
    base = dict(gpus=16, seed=0, bound_requests=2000, max_num_seqs=256, prefill_share=0.125)
    for same in (False, True):
        reqs = sim_study.make_workload("reasoning", rate=100.0, requests=2000, seed=0, max_model_len=32768,
                                       mix=sim_study.study_mix(SimpleNamespace(same_max_tokens=same)))
        row = sim_study.capacity_bound(SimpleNamespace(**base, same_max_tokens=same))[0]
        assert row["output_tokens_per_request"] == pytest.approx(sum(sum(r.output_lens) for r in reqs) / len(reqs))
