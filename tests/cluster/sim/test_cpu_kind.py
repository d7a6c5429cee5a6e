"""The ``cpu`` kind: engines sharing a node's cores, the frontend's latencies, and the fit that
recovers them from a cluster run's telemetry (``bench/fit_sim_cpu.py``)."""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from thinkserve.cluster.sim.cost import CALIBRATION_FACTORS, CPU_FIT_PATH, BatchShape, LatencyState, LinearCost
from thinkserve.cluster.sim.hardware import TINY_REASONER
from thinkserve.cluster.sim.setup import Deployment, build
from thinkserve.cluster.sim.workload import SimRequest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "bench"))
import fit_sim_cpu  # noqa: E402

# The runs cluster/sim/cpu_fit.json was fitted from (its runs A: docs/simulator.md, "Fidelity").
DATA = ROOT / "bench" / "data" / "sim_fidelity"
# In the order the fit was run in (the latencies' median regression converges to 1e-9 or so,
# which the order of the samples moves).
FIT_RUNS = ([f"contention-20261202/{layout}-seed{run}.json.gz" for layout in ("mixed", "pd")
             for run in ("14-load1n0", "20-prompt300", "30")]
            + [f"quiet-20261203/{layout}-seed40.json.gz" for layout in ("mixed", "pd")])


def cpu(c0=1.0, c_prefill=0.0, c_decode=0.0, c_ctx=0.0, c_mixed=0.0, *, cores=2, co_step=0.5, external=0.0,
        latency=None, step_noise=None, slow=None, background=0.0, post_prompt=None, prompt_noise=None,
        warmup=None, calibration=None, engine_wake=None) -> LinearCost:
    return LinearCost(TINY_REASONER, {"c0": c0, "c_prefill": c_prefill, "c_decode": c_decode, "c_ctx": c_ctx,
                                      "c_mixed": c_mixed},
                      kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, cores=cores,
                      co_step=co_step, external_weight=external, latency=latency, step_noise=step_noise,
                      slow=slow, background_weight=background, post_prompt=post_prompt, prompt_noise=prompt_noise,
                      warmup=warmup, calibration=calibration, engine_wake=engine_wake)


def test_step_time_with_contention_is_the_hand_computed_value():
    cost = cpu(0.002, 0.0005, 0.001, 1e-6, 0.003, cores=2, co_step=0.5, external=0.5)
    shape = BatchShape(prefill_tokens=20, prefill_ctx=210, num_decode=8, decode_ctx=1000)
    base = 0.002 + 0.0005 * 20 + 0.001 * 8 + 1e-6 * (210 + 1000) + 0.003   # 0.02421 s: prompt tokens, c_mixed
    assert cost.step_time(shape) == pytest.approx(base)                             # alone: (1 + 0) * max(1, 1/2)
    assert cost.step_time(shape, 1) == pytest.approx(base * 1.5)                    # (1 + 0.5) * max(1, 2/2)
    assert cost.step_time(shape, 0, 1.5) == pytest.approx(base)                     # max(1, (1 + 0.75) / 2)
    assert cost.step_time(shape, 0, 3.0) == pytest.approx(base * 1.25)              # max(1, (1 + 1.5) / 2)
    assert cost.step_time(shape, 1, 1.0) == pytest.approx(base * 1.5 * 1.25)        # 1.5 * (2 + 0.5) / 2
    assert cost.step_time(shape, 3) == pytest.approx(base * 1.5 * 2.0)              # 4 engines on 2 cores: time-shared
    # A decode-only step (one native call for all layers) does not pay c_mixed.
    decode = BatchShape(num_decode=8, decode_ctx=1000)
    assert cost.step_time(decode, 1) == pytest.approx((0.002 + 0.008 + 0.001) * 1.5)
    # A decode run is the sum of its steps at the same contention.
    run = cost.decode_run(8, 1000, 1, 1.0)
    steps = sum(cost.step_time(BatchShape(num_decode=8, decode_ctx=1000 + 8 * j), 1, 1.0) for j in range(5))
    assert run.time(5) == pytest.approx(steps)
    # Niced work beside the engines: 1 + 0.2 per core, whatever the cores' state.
    niced = cpu(0.002, 0.0005, 0.001, 1e-6, 0.003, cores=2, co_step=0.5, external=0.5, background=0.2)
    assert niced.step_time(shape, 0, 0.0, 0.5) == pytest.approx(base * 1.1)           # 1 * 1 * (1 + 0.1)
    assert niced.step_time(shape, 1, 3.0, 0.5) == pytest.approx(base * 1.5 * 1.75 * 1.1)   # (1 + 1 + 1.5) / 2 = 1.75
    assert niced.decode_run(8, 1000, 1, 1.0, 0.5).time(5) == pytest.approx(steps * 1.1)
    with pytest.raises(ValueError, match="background"):
        cpu(background=-0.1)
    # Without a core count there is no contention.
    assert cpu(0.002, cores=None).step_time(BatchShape(num_decode=1, decode_ctx=5), 3, 2.0) == pytest.approx(0.002)


def test_cpu_cost_rejects_bad_coefficients_and_old_fits(tmp_path):
    with pytest.raises(ValueError, match="c_mixed"):
        LinearCost(TINY_REASONER, {"c0": 1.0, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0},
                   kv_capacity_tokens=1024, transfer_bw=1e9, transfer_latency_s=0.0)
    with pytest.raises(ValueError, match="c_decode = -0.1"):
        cpu(c_decode=-0.1)
    with pytest.raises(ValueError, match="co_step"):
        cpu(co_step=-1.0)
    old = json.loads(CPU_FIT_PATH.read_text())
    old["contention"] = {"cores": 2, "background": 0.45}
    path = tmp_path / "cpu_fit.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="old contention model"):
        LinearCost.from_fit(TINY_REASONER, path)


def test_simulated_engines_share_the_cores():
    # 1 s per step; 2 cores, co_step 0.5: one engine stepping runs at full speed, two at 1/1.5.
    # a (5 tokens) on mixed-0 from t=0: prefill [0, 1], a decode run of 4 steps from 1.
    # b (2 tokens) on mixed-1 at 2.5: prefill with a stepping: [2.5, 4.0]; a's run ends at the
    # step in progress (3.0) and goes on at 1.5 s per step: tokens 4, 5 at 4.5, 6.0. b's decode
    # step [4.0, 5.5]: b is done; a's last step had started with b stepping: 6.0.
    reqs = [SimRequest("a", 0.0, 4, (5,), salt=1), SimRequest("b", 2.5, 4, (2,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(), 2).run()
    got = {rid: (rec.first_token, rec.finish) for rid, rec in sim.records.items()}
    assert got["a"] == pytest.approx((1.0, 6.0), abs=1e-12)
    assert got["b"] == pytest.approx((4.0, 5.5), abs=1e-12)
    alone = build(reqs, Deployment("colocated"), cpu(cores=None), 2).run()
    assert {r: (x.first_token, x.finish) for r, x in alone.records.items()} == \
        {"a": pytest.approx((1.0, 5.0)), "b": pytest.approx((3.5, 4.5))}


def test_simulated_steps_follow_the_replayed_niced_work():
    # 1 s per step alone; niced work 1 core until 2.05 s, none after; weight 0.5: 1.5 s per step,
    # then 1. a (4 tokens), sent at 0.05 s: prefill [0.05, 1.55]; its decode run is repriced at
    # 2.05 and ends at the step in progress [1.55, 3.05]; then 1 s steps: 4.05, 5.05.
    reqs = [SimRequest("a", 0.05, 4, (4,), salt=1)]
    load = [(0.0, 0.0, 1.0), (2.05, 0.0, 0.0)]
    sim = build(reqs, Deployment("colocated"), cpu(background=0.5), 1, external_load=load).run()
    assert (sim.records["a"].first_token, sim.records["a"].finish) == pytest.approx((1.55, 5.05), abs=1e-12)
    # A (time, load) replay has no niced work.
    flat = build(reqs, Deployment("colocated"), cpu(background=0.5), 1, external_load=[(0.0, 0.0)]).run()
    assert (flat.records["a"].first_token, flat.records["a"].finish) == pytest.approx((1.05, 4.05), abs=1e-12)


def test_frontend_latencies_are_added():
    # The request reaches the engine 0.25 s after it is sent; the first token reaches the client
    # 0.1 s after the engine has it, the end 0.2 s after.
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.2]}
    sim = build([SimRequest("a", 0.0, 4, (3,), salt=1)], Deployment("colocated"), cpu(latency=lat), 1).run()
    rec = sim.records["a"]
    assert (rec.first_token, rec.finish) == pytest.approx((0.25 + 1.0 + 0.1, 0.25 + 3.0 + 0.2), abs=1e-12)


def test_dispatch_per_prompt_token_in_the_simulator_and_the_fit():
    # 1 s per step; dispatch 0.25 s + 0.01 s per prompt token: a 4-token prompt lands at 0.29.
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.2], "dispatch_per_token_s": 0.01}
    sim = build([SimRequest("a", 0.0, 4, (3,), salt=1)], Deployment("colocated"), cpu(latency=lat), 1).run()
    assert (sim.records["a"].first_token, sim.records["a"].finish) == \
        pytest.approx((0.29 + 1.0 + 0.1, 0.29 + 3.0 + 0.2), abs=1e-12)
    # Dispatch samples of 3 ms + 20 us per prompt token: the fit finds the 20 us and 3 ms left.
    reqs = [{"sent": t, "first": t + 0.5, "end": t + 1.0, "prompt_len": n,
             "parts": [{"added": t + 0.003 + 2e-5 * n, "first_token": t + 0.4, "finished": t + 0.9}]}
            for t, n in zip(range(8), (5, 300, 17, 420, 9, 350, 12, 310))]
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16)
    assert lat["dispatch_per_token_s"] == pytest.approx(2e-5)
    assert lat["dispatch_s"] == pytest.approx([0.003] * len(fit_sim_cpu.QUANTILES))
    one = [dict(r, prompt_len=5, parts=[dict(r["parts"][0], added=r["sent"] + 0.004)]) for r in reqs]
    assert fit_sim_cpu.fit_latencies(one, 6144, 16)["dispatch_per_token_s"] == 0.0   # one length: none


def test_frontend_latencies_follow_whether_the_engines_take_every_core():
    # 1 s per step. A core free: dispatch 0.25 s, first token / end 0.1 s; the node's engines
    # stepping on every core: 0.5 s and 0.2 s. A token's latency follows the cores' state just
    # after the step that computed it, its engine counted if it steps again at once.
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.1],
           "saturated": {"dispatch_s": [0.5], "first_token_s": [0.2], "finish_s": [0.2]}}
    reqs = [SimRequest("a", 0.0, 4, (1,), salt=1), SimRequest("b", 0.5, 4, (1,), salt=2)]

    def times(cores):
        sim = build(reqs, Deployment("colocated"), cpu(cores=cores, co_step=0.0, latency=lat), 1).run()
        return {rid: (rec.first_token, rec.finish) for rid, rec in sim.records.items()}
    # One core: a is sent to an idle node (0.25 s) and prefills in [0.25, 1.25]; b is sent during
    # that step (0.5 s) and lands at 1.0, so the engine steps again at once at 1.25 (b's prefill):
    # a's token goes out with the core taken (0.2 s). b's step [1.25, 2.25] leaves the engine
    # idle: its token goes out with the core free (0.1 s).
    assert times(1) == {"a": pytest.approx((1.45, 1.45), abs=1e-12), "b": pytest.approx((2.35, 2.35), abs=1e-12)}
    # Two cores, one engine: a core is always free. b lands at 0.75, waits for a's step to end.
    assert times(2) == {"a": pytest.approx((1.35, 1.35), abs=1e-12), "b": pytest.approx((2.35, 2.35), abs=1e-12)}
    # b sent after a's step: the engine is idle after a's (core free), and b's dispatch too.
    late = [reqs[0], SimRequest("b", 1.3, 4, (1,), salt=2)]
    sim = build(late, Deployment("colocated"), cpu(cores=1, co_step=0.0, latency=lat), 1).run()
    assert sim.records["a"].first_token == pytest.approx(1.35) and sim.records["b"].first_token == pytest.approx(2.65)


def test_step_noise_scales_the_steps_priced_alone_only_when_asked():
    reqs = [SimRequest("a", 0.0, 4, (1,), salt=1)]
    cost = cpu(cores=None, step_noise=[1.5, 1.5])
    assert build(reqs, Deployment("colocated"), cost, 1).run().records["a"].first_token == pytest.approx(1.0)
    assert build(reqs, Deployment("colocated"), cost, 1, step_noise=True).run().records["a"].first_token == \
        pytest.approx(1.5)
    # The fitted ratios have mean 1 (the model gives a step's mean, the noise its spread).
    for key in ("step_noise", "prompt_noise"):
        noise = json.loads(CPU_FIT_PATH.read_text())[key]
        assert sum((a + b) / 2 for a, b in zip(noise, noise[1:])) / (len(noise) - 1) == pytest.approx(1.0)
        assert noise[0] < 0.7 and noise[-1] > 1.5
    # A step with prompt tokens draws from its own spread, the decode steps from the other: the
    # prefill (1 s) is 1.2x, the one decode step after it (1 s) 1.5x.
    two = [SimRequest("b", 0.0, 4, (2,), salt=1)]
    rec = build(two, Deployment("colocated"), cpu(cores=None, step_noise=[1.5, 1.5], prompt_noise=[1.2, 1.2]), 1,
                step_noise=True).run().records["b"]
    assert (rec.first_token, rec.finish) == pytest.approx((1.2, 2.7))


def _synthetic_trace(coeffs, co_step, external, cores, lat, seed=0, background=0.0) -> dict:
    """Two engines: alone in the first half (no other engine stepping), stepping in lockstep on
    equal batches in the second (one other); other processes' un-niced work 0, then 3 cores, in
    each half, and niced work 0 or 0.5 cores by turns of 25 steps (weight ``background``). Step
    durations from the model (written out here), exactly."""
    rng = random.Random(seed)

    def base(pt, pc, nd, dc):
        return (coeffs["c0"] + coeffs["c_prefill"] * pt + coeffs["c_decode"] * nd + coeffs["c_ctx"] * (pc + dc)
                + (coeffs["c_mixed"] if pt else 0.0))
    a, b, load, total, t = [], [], [], [], 0.0
    for k in range(400):
        pt = rng.choice((0, 0, 0, 16, 40, 120))
        nd = rng.randint(0 if pt else 1, 48)
        pc, dc = pt * (pt + 1) // 2, nd * rng.randint(20, 900)
        others, ext = (0 if k < 200 else 1), (3.0 if k % 200 >= 100 else 0.0)
        niced = 0.5 if k % 50 >= 25 else 0.0
        if k % 25 == 0:
            load.append([t, ext])
            total.append([t, ext + niced])
        d = (base(pt, pc, nd, dc) * (1 + co_step * min(others, cores - 1))
             * max(1.0, (1 + others + external * ext) / cores) * (1 + background * niced))
        row = [t, d, pt, pc, nd, dc]
        a.append(row)
        if others:
            b.append(list(row))
        t += d + 0.0005
    # Each request prefills on one instance and hands off (20 prompt tokens + the first: 2
    # blocks of 16 x 6144 B) to another, which lands handoff + bytes / bandwidth after; after
    # the steps above (no step spans a publish: the latencies run from the publish itself).
    landing = lat[3] + 2 * 16 * 6144 / fit_sim_cpu.LOOPBACK_BW
    requests = [{"sent": s, "first": s + 0.3, "end": s + 1.0, "prompt_len": 20,
                 "parts": [{"added": s + lat[0], "first_token": s + 0.3 - lat[1], "finished": None},
                           {"added": s + 0.3 - lat[1] + landing, "first_token": None, "finished": s + 1.0 - lat[2]}]}
                for s in (t + 1.0, t + 2.0, t + 3.5)]
    engine = {"block_size": 16, "max_num_seqs": 64, "max_num_batched_tokens": 2048, "num_device_blocks": 1024}
    return {"cores": cores, "engine": engine, "instances": {"mixed-0": {"steps": a}, "mixed-1": {"steps": b}},
            fit_sim_cpu.EXTERNAL_SERIES: load, fit_sim_cpu.TOTAL_SERIES: total, "requests": requests}


def test_fit_recovers_known_coefficients():
    coeffs = {"c0": 0.0021, "c_prefill": 0.00045, "c_decode": 0.0009, "c_ctx": 3e-7, "c_mixed": 0.0013}
    fit = fit_sim_cpu.fit_trace(_synthetic_trace(coeffs, 0.66, 0.4, 2, (0.006, 0.004, 0.005, 0.0042)))
    assert fit["coeffs"] == pytest.approx(coeffs, rel=1e-6)
    assert fit["contention"] == {"cores": 2, "co_step": pytest.approx(0.66), "external": pytest.approx(0.4),
                                 "background": 0.0, "series": fit_sim_cpu.EXTERNAL_SERIES}
    n = len(fit_sim_cpu.QUANTILES)
    assert fit["latency"] == {"dispatch_s": pytest.approx([0.006] * n), "first_token_s": pytest.approx([0.004] * n),
                              "finish_s": pytest.approx([0.005] * n), "dispatch_per_token_s": 0.0,
                              "external_scale": [0.0, 0.0, 0.0]}   # the latencies do not follow the load
    assert fit["transfer_latency_s"] == pytest.approx(0.0042)
    assert fit["fit_quality"]["median_rel_error"] < 1e-9
    assert fit["step_noise"] == pytest.approx([1.0] * fit_sim_cpu.NOISE_POINTS)   # exact steps: none
    assert fit["slow"] == {"window_s": fit_sim_cpu.SLOW_WINDOW_S, "quantiles": pytest.approx([1.0] * fit_sim_cpu.NOISE_POINTS)}
    assert fit["kv_capacity_tokens"] == 1024 * 16
    # The committed fit's contention is reproduced by the same search on the same kind of data:
    # with no co-stepping cost and no external load, the fit says so.
    flat = fit_sim_cpu.fit_trace(_synthetic_trace(coeffs, 0.0, 0.0, 2, (0.006, 0.004, 0.005, 0.0042)))
    assert flat["contention"] == {"cores": 2, "co_step": 0.0, "external": 0.0, "background": 0.0,
                                  "series": fit_sim_cpu.EXTERNAL_SERIES}
    assert flat["coeffs"] == pytest.approx(coeffs, rel=1e-6)
    # Steps slowed by the niced work: its weight comes back, and the rest as before.
    niced = fit_sim_cpu.fit_trace(_synthetic_trace(coeffs, 0.66, 0.4, 2, (0.006, 0.004, 0.005, 0.0042), background=0.3))
    assert niced["contention"] == {"cores": 2, "co_step": pytest.approx(0.66), "external": pytest.approx(0.4),
                                   "background": pytest.approx(0.3), "series": fit_sim_cpu.EXTERNAL_SERIES}
    assert niced["coeffs"] == pytest.approx(coeffs, rel=1e-6)


def test_fit_and_simulation_read_the_named_external_series(tmp_path):
    # The steps were made slower by the load recorded as ``external_load_weighted``; the run's
    # default series says nothing (0). Fitted on the named series, the weights come back
    # exactly; the fit names its series, the cost model built from it replays that one.
    coeffs = {"c0": 0.0021, "c_prefill": 0.00045, "c_decode": 0.0009, "c_ctx": 3e-7, "c_mixed": 0.0013}
    lat = (0.006, 0.004, 0.005, 0.0042)
    trace = _synthetic_trace(coeffs, 0.66, 0.4, 2, lat)
    default = fit_sim_cpu.EXTERNAL_SERIES
    moved = {**trace, "external_load_weighted": trace[default], default: [[0.0, 0.0]]}
    fit = fit_sim_cpu.fit_trace(moved, series="external_load_weighted")
    assert fit["contention"] == {"cores": 2, "co_step": pytest.approx(0.66), "external": pytest.approx(0.4),
                                 "background": 0.0, "series": "external_load_weighted"}
    assert fit["coeffs"] == pytest.approx(coeffs, rel=1e-6)
    # The other series cannot explain the steps: the fit is not exact on it.
    assert fit_sim_cpu.fit_trace(moved)["fit_quality"]["median_rel_error"] > 0.01
    with pytest.raises(ValueError, match="no 'external_load'"):
        fit_sim_cpu.fit_trace({k: v for k, v in moved.items() if k != fit_sim_cpu.TOTAL_SERIES}, series="external_load")
    path = tmp_path / "cpu_fit.json"
    path.write_text(json.dumps(fit))
    assert LinearCost.from_fit(TINY_REASONER, path).external_series == "external_load_weighted"


def test_latencies_run_from_the_end_of_the_publishing_step():
    # One engine: a prefill step [0, 10 ms] that publishes the first token at 8 ms, a decode step
    # [10.1, 12.1 ms] that publishes the last at 11.5 ms; the client has them at 13 and 15.1 ms.
    trace = {"cores": 2, "instances": {"mixed-0": {"steps": [[0.0, 0.010, 5, 15, 0, 0], [0.0101, 0.002, 0, 0, 1, 6]]}}}
    end = fit_sim_cpu.publishing_step_end(trace)
    assert end(0.008, True) == pytest.approx(0.010) and end(0.0115, False) == pytest.approx(0.0121)
    assert end(0.0115, True) == 0.0115          # no step with prompt tokens spans it: the publish itself
    req = {"sent": -0.004, "first": 0.013, "end": 0.0151, "prompt_len": 5,
           "parts": [{"added": 0.0, "first_token": 0.008, "finished": 0.0115}]}
    lat = fit_sim_cpu.fit_latencies([req], 6144, 16, step_end=lambda r, t, prompt: end(t, prompt))
    assert (lat["dispatch_s"], lat["first_token_s"], lat["finish_s"]) == \
        tuple(pytest.approx([v] * len(fit_sim_cpu.QUANTILES)) for v in (0.004, 0.003, 0.003))


def test_a_dispatch_that_waited_for_a_prefill_step_is_left_out():
    # One engine: a prefill step [0, 40 ms] (the per-layer path holds the GIL the engine's add
    # thread needs) and a decode step [50, 52 ms]. Request a, sent at 5 ms, reached the engine at
    # 41 ms, after the prefill: its 36 ms contain the wait the simulator charges itself. b, sent
    # at 49 ms, reached it at 53 ms, after the decode step (no prompt tokens: kept); c, sent at 60
    # ms with nothing in flight, at 63 ms.
    trace = {"cores": 2, "instances": {"mixed-0": {"steps": [[0.0, 0.040, 300, 45150, 0, 0],
                                                             [0.050, 0.002, 0, 0, 1, 301]]}}}
    waited = fit_sim_cpu.waited_for_prefill(trace)
    assert waited(0.005, 0.041) and not waited(0.005, 0.039)      # the step had not ended: no wait seen
    assert not waited(0.049, 0.053) and not waited(0.060, 0.063)

    def req(sent, added):
        return {"sent": sent, "first": added + 0.01, "end": added + 0.02, "prompt_len": 5,
                "parts": [{"added": added, "first_token": added + 0.005, "finished": added + 0.015}]}
    reqs = [req(0.005, 0.041), req(0.049, 0.053), req(0.060, 0.063)]
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, waited=lambda r, added: waited(r["sent"], added))
    assert (lat["dispatch_waited"], lat["latency_samples"]) == (1, 2)
    assert lat["dispatch_s"] == pytest.approx([0.003 + 0.001 * q for q in fit_sim_cpu.QUANTILES])
    assert fit_sim_cpu.fit_latencies(reqs, 6144, 16)["dispatch_waited"] == 0


def test_a_page_set_leaves_its_prefill_engine_between_steps():
    # One prefill and one decode engine; a step 0.1 s + 12.5 ms per prompt token, a hand-off 0.05 s
    # (its bytes free). a (4 prompt tokens, 3 output tokens) prefills in [0, 0.15]; b arrives at
    # 0.05 and prefills in [0.15, 0.3], the prefill engine going on to it at once. a's page set
    # leaves when that step ends: it lands at 0.35, beside b's (b's engine went idle: it left at
    # 0.3), and the two decode together in [0.35, 0.45] and [0.45, 0.55].
    def cost():
        return LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0125, "c_decode": 0.0, "c_ctx": 0.0,
                                          "c_mixed": 0.0},
                          kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05)
    reqs = [SimRequest("a", 0.0, 4, (3,), salt=1), SimRequest("b", 0.05, 4, (3,), salt=2)]
    for bulk in (True, False):
        sim = build(reqs, Deployment("pd", prefill_share=0.5), cost(), 2, bulk_decode=bulk).run()
        rec = sim.records
        assert (rec["a"].first_token, rec["a"].finish) == pytest.approx((0.15, 0.55))
        assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((0.3, 0.55))
        sim.check_integrity()
    # An export that does not wait (the GPU kinds'): a lands at 0.2 and decodes in [0.2, 0.4]; b
    # lands at 0.35, inside a's second step, and decodes in [0.4, 0.6].
    free = cost()
    free.export_waits_for_step = False
    rec = build(reqs, Deployment("pd", prefill_share=0.5), free, 2).run().records
    assert (rec["a"].finish, rec["b"].finish) == pytest.approx((0.4, 0.6))
    with pytest.raises(ValueError, match="transfer_bw"):
        LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=0.0, transfer_latency_s=0.05)


def test_a_page_set_written_mid_step_holds_the_next_step_and_joins_after_it():
    # One prefill and one decode engine; a step 0.1 s + 12.5 ms per prompt token; a hand-off
    # 0.05 s; a page set's write holds a step 0.02 s; the two steps after an import that reached
    # the engine mid-step run 1.5x and 1.2x. a (4 prompt tokens, 10 output tokens) prefills in
    # [0, 0.15] and reaches the idle decode engine at 0.2: written by 0.22, it decodes from there.
    # b (3 output tokens) arrives at 0.2, prefills in [0.2, 0.35] and reaches the decode engine
    # at 0.4, inside [0.32, 0.42]: written at 0.42, the step [0.42, 0.54] waits for the write, b
    # joins at 0.54: [0.54, 0.69] (x1.5), [0.69, 0.81] (x1.2), where b is done; a's last four
    # steps end at 1.21.
    cost = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0125, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                      kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05,
                      landing_hold={"latency_s": 0.02, "bw": 1e15}, post_landing=[1.5, 1.2])
    assert cost.hold_time(98_304) == pytest.approx(0.02)
    reqs = [SimRequest("a", 0.0, 4, (10,), salt=1), SimRequest("b", 0.2, 4, (3,), salt=2)]
    for bulk in (True, False):
        sim = build(reqs, Deployment("pd", prefill_share=0.5), cost, 2, bulk_decode=bulk).run()
        rec = sim.records
        assert (rec["a"].first_token, rec["a"].finish) == pytest.approx((0.15, 1.21))
        assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((0.35, 0.81))
        sim.check_integrity()
        decode = sim.pools["short_decode"][0]
        assert decode.busy_time == pytest.approx(1.21 - 0.22) and not decode._arriving
    with pytest.raises(ValueError, match="landing_hold"):
        LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                   landing_hold={"latency_s": 0.001, "bw": 0.0})


def test_fit_reads_where_page_sets_were_written_and_when_they_arrived():
    # A decode engine stepping back to back, 2 ms a step from 1.000 s, but the steps starting at
    # 1.010 and 1.030 s took 3 ms: page sets of 1 and 19 blocks were written at their starts
    # (landing, the write done, at 1.0105 and 1.031). Then idle until 2.0; a third page set
    # landed at 1.5 on the idle engine.
    starts, dur, t = [], [], 1.0
    while t < 1.06 - 1e-9:
        d = 0.003 if abs(t - 1.010) < 1e-9 or abs(t - 1.031) < 1e-9 else 0.002
        starts.append(t)
        dur.append(d)
        t = round(t + d, 9)
    steps = [[a, d, 0, 0, 4, 400] for a, d in zip(starts, dur)] + [[2.0, 0.002, 0, 0, 1, 20]]
    trace = {"cores": 2, "engine": {"block_size": 16},
             "instances": {"prefill-0": {"steps": [[0.5, 0.01, 10, 55, 0, 0]]}, "short_decode-0": {"steps": steps}},
             fit_sim_cpu.EXTERNAL_SERIES: [[0.0, 0.0]], fit_sim_cpu.TOTAL_SERIES: [[0.0, 0.0]]}

    def req(prompt_len, landed):
        return {"prompt_len": prompt_len, "parts": [{"added": 0.5, "first_token": 0.509, "finished": None},
                                                    {"added": landed, "first_token": None, "finished": 2.0}]}
    trace["requests"] = [req(10, 1.0105), req(300, 1.031), req(10, 1.5)]
    feats, d, others, ext, bg, a, engines = fit_sim_cpu.step_rows(trace)
    since, held = fit_sim_cpu.landings(trace, a, d, engines)
    rows = np.flatnonzero(engines == 1)
    at = {round(float(a[i]), 4): i for i in rows}
    assert held[at[1.010]] == 16 * 6144 and held[at[1.031]] == 19 * 16 * 6144 and held.sum() == 20 * 16 * 6144
    # the step after each written one is the request's first (0), the next 1
    assert (since[at[1.013]], since[at[1.015]], since[at[1.034]], since[at[1.036]]) == (0, 1, 0, 1)
    assert (since < (1 << 30)).sum() == 4
    # the hold: 1 ms over the model for 0.1 MB and for 1.9 MB: the bytes cost nothing
    flat = fit_sim_cpu.landing_hold(np.where(held > 0, 0.001, 0.0), held)
    assert fit_sim_cpu.hold_time(flat, held)[held > 0] == pytest.approx([0.001, 0.001])
    # 1 ms + the bytes at 2 GB/s
    two = fit_sim_cpu.landing_hold(np.where(held > 0, 0.001 + held / 2e9, 0.0), held)
    assert (two["latency_s"], two["bw"]) == pytest.approx((0.001, 2e9))
    assert fit_sim_cpu.landing_hold(np.zeros(len(held)), np.zeros(len(held))) is None
    assert fit_sim_cpu.hold_time(two, held)[at[1.031]] == pytest.approx(0.001 + 19 * 16 * 6144 / 2e9)
    # Arrivals: written at 1.010, the page set arrived inside the step before ([1.008, 1.010])
    # after it left its prefill engine: the middle of that; landing on an idle engine, before its
    # write (the hold for its bytes); never before it left.
    arrival = fit_sim_cpu.page_set_arrival(trace, two)
    assert arrival(trace["requests"][0], 1.0105, 0.9) == pytest.approx(1.009)
    assert arrival(trace["requests"][0], 1.0105, 1.0095) == pytest.approx(1.00975)    # left late in that step
    assert arrival(trace["requests"][0], 1.0105, 1.0102) == pytest.approx(1.0102)     # left after it began
    assert arrival(trace["requests"][1], 1.031, 1.0) == pytest.approx(1.030)
    assert arrival(trace["requests"][2], 1.5, 1.4) == pytest.approx(1.5 - 0.001 - 16 * 6144 / 2e9)
    assert arrival(trace["requests"][2], 1.5, 1.4995) == 1.4995
    # A run whose decode instances cannot be told apart: none read.
    two_decoders = {**trace, "instances": {**trace["instances"], "long_decode-0": {"steps": []}}}
    assert (fit_sim_cpu.landings(two_decoders, a, d, engines)[1] == 0).all()
    assert fit_sim_cpu.page_set_arrival(two_decoders, two)(trace["requests"][0], 1.0105, 0.9) == 1.0105


def test_fit_times_a_hand_off_from_when_its_page_set_could_leave():
    # A prefill engine: a's prompt step [0, 50 ms] publishes at 45 ms and the engine goes on to
    # b's prompt step at 50.5 ms (within AFTER_STEP_S), to 104.5 ms; b's page set could leave at
    # once. a landed 10 ms after b's step ended, b 10 ms after its own.
    steps = [[0.0, 0.050, 300, 45150, 0, 0], [0.0505, 0.054, 300, 45150, 0, 0], [0.5, 0.05, 300, 45150, 0, 0]]
    trace = {"cores": 2, "instances": {"prefill-0": {"steps": steps}, "short_decode-0": {"steps": []}}}
    start = fit_sim_cpu.export_start(trace)
    assert start(0.045) == pytest.approx(0.1045) and start(0.1) == pytest.approx(0.1045)
    assert start(0.52) == pytest.approx(0.55) and start(0.7) == 0.7      # no step spans it: the publish
    assert start(0.045, 0.09) == pytest.approx(0.05)     # landed before b's step ended: it got in before it
    nbytes = 19 * 16 * 6144     # 300 prompt tokens + the first: 19 blocks

    def req(first, landed):
        return {"sent": first - 0.03, "first": first + 0.003, "end": landed + 0.2, "prompt_len": 300,
                "parts": [{"added": first - 0.02, "first_token": first, "finished": None},
                          {"added": landed, "first_token": None, "finished": landed + 0.19}]}
    reqs = [req(0.045, 0.1145), req(0.1, 0.1145), req(0.52, 0.56)]
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, export_start=lambda r, t, landed: start(t, landed))
    assert lat["handoffs"] == 3 and lat["transfer_bw"] == fit_sim_cpu.LOOPBACK_BW    # one size: no bandwidth to tell
    assert lat["transfer_latency_s"] == pytest.approx(0.010 - nbytes / fit_sim_cpu.LOOPBACK_BW)
    # Two sizes: the line through them (9 ms + bytes at 0.33 GB/s), exactly.
    samples = [(0.009 + b / 0.33e9, b) for b in (98_304, 98_304, 2_162_688, 2_162_688, 2_162_688)]
    assert fit_sim_cpu.fit_handoff(samples) == pytest.approx((0.009, 0.33e9))
    # A line that falls with the bytes is no bandwidth: the mean of the rest at LOOPBACK_BW.
    assert fit_sim_cpu.fit_handoff([(0.02, 100_000), (0.01, 1_000_000)]) == \
        pytest.approx((0.015 - 550_000 / fit_sim_cpu.LOOPBACK_BW, fit_sim_cpu.LOOPBACK_BW))


def test_a_hand_off_to_a_stepping_decode_engine_is_its_own_state():
    # The fit: whether the run's one decode engine was inside a step (or between two run back to
    # back, within AFTER_STEP_S) at a time; a run without one decode instance: never.
    steps = [[0.0, 0.010, 0, 0, 1, 20], [0.0105, 0.010, 0, 0, 1, 21], [0.1, 0.010, 0, 0, 1, 22]]
    trace = {"instances": {"prefill-0": {"steps": [[0.0, 0.05, 10, 55, 0, 0]]}, "short_decode-0": {"steps": steps}}}
    at = fit_sim_cpu.decode_busy_at(trace)
    assert [at(t) for t in (0.005, 0.0102, 0.05, 0.105, 0.2)] == [True, True, False, True, False]
    assert not fit_sim_cpu.decode_busy_at({"instances": {"mixed-0": {"steps": steps}}})(0.005)
    # Hand-offs of one size at 2 ms + bytes at LOOPBACK_BW: 30 to an idle engine took 0.5x and
    # 0.7x that (alternately), 30 to a stepping one 1.5x and 1.9x: each state's quantiles, both
    # over one factor so that the draws average 1 over the samples (0.6 and 1.7 over 1.15).
    nbytes = 2 * 16 * 6144
    line = 0.002 + nbytes / fit_sim_cpu.LOOPBACK_BW
    samples = [(line * f, nbytes, busy) for busy, pair in ((False, (0.5, 0.7)), (True, (1.5, 1.9)))
               for i in range(30) for f in (pair[i % 2],)]
    idle, stepping = fit_sim_cpu.handoff_noise(samples, 0.002, fit_sim_cpu.LOOPBACK_BW)
    draw_mean = lambda q: float(np.mean([(a + b) / 2 for a, b in zip(q, q[1:])]))  # noqa: E731
    assert (draw_mean(idle), draw_mean(stepping)) == pytest.approx((0.6 / 1.15, 1.7 / 1.15), rel=0.01)
    assert (min(idle), max(idle), min(stepping), max(stepping)) == pytest.approx(
        (0.5 / 1.15, 0.7 / 1.15, 1.5 / 1.15, 1.9 / 1.15), rel=0.02)
    # Fewer than MIN_SPLIT one way: one distribution of mean 1, as before.
    one, none = fit_sim_cpu.handoff_noise(samples[:40], 0.002, fit_sim_cpu.LOOPBACK_BW)
    assert none is None and draw_mean(one) == pytest.approx(1.0)
    # The cost: each state's draws at its level against the line (the mean's too), each state's
    # calibration factor; a hand-off's deviation relative to its state's mean.
    c = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05,
                   handoff_noise=[0.4, 0.6], handoff_busy_noise=[1.2, 1.8])
    assert [c.transfer_time(0, True, busy=b) for b in (False, True)] == pytest.approx([0.025, 0.075])
    assert [c.transfer_time(0, True, _Fixed(0.25), busy=b) for b in (False, True)] == pytest.approx([0.0225, 0.0675])
    assert [c.handoff_deviation(b) for b in (False, True)] == pytest.approx([0.1, 0.1])
    calibrated = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                            kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05,
                            handoff_noise=[0.4, 0.6], handoff_busy_noise=[1.2, 1.8],
                            calibration={"handoff": 1.2, "handoff_busy": 2.0})
    assert [calibrated.transfer_time(0, True, busy=b) for b in (False, True)] == pytest.approx([0.03, 0.15])
    one = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                     kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05, handoff_noise=[0.5, 1.5],
                     calibration={"handoff": 1.2})
    assert [one.transfer_time(0, True, _Fixed(0.25), busy=b) for b in (False, True)] == pytest.approx([0.045, 0.045])
    with pytest.raises(ValueError, match="handoff_busy_noise"):
        LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=1e15, transfer_latency_s=0.05, handoff_busy_noise=[1.0])
    # The simulator: one prefill and one decode engine, a step 0.1 s + 12.5 ms per prompt token,
    # a hand-off's line 0.05 s, 0.7x to an idle decode engine, 3x to a stepping one. a (4 prompt
    # tokens, 10 output tokens) prefills in [0, 0.15]; its page set reaches the idle decode engine
    # at 0.185, which decodes a's nine tokens to 1.085. b (3 output tokens) prefills in [0.23,
    # 0.38]; its page set leaves while the decode engine steps and arrives at 0.53, inside
    # [0.485, 0.585]: b joins at 0.585 and is done at 0.785. Without the split (one noise: its
    # mean is the line's, 0.05 s, without a draw) a lands at 0.2 and is done at 1.1, b arrives
    # at 0.43, inside [0.4, 0.5], and is done at 0.7.
    reqs = [SimRequest("a", 0.0, 4, (10,), salt=1), SimRequest("b", 0.23, 4, (3,), salt=2)]
    for busy, a_done, b_done in (([3.0], 1.085, 0.785), (None, 1.1, 0.7)):
        cost = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0125, "c_decode": 0.0, "c_ctx": 0.0,
                                          "c_mixed": 0.0}, kv_capacity_tokens=16 * 64, transfer_bw=1e15,
                          transfer_latency_s=0.05, handoff_noise=[0.7], handoff_busy_noise=busy)
        for bulk in (True, False):
            sim = build(reqs, Deployment("pd", prefill_share=0.5), cost, 2, bulk_decode=bulk).run()
            rec = sim.records
            assert (rec["a"].first_token, rec["a"].finish) == pytest.approx((0.15, a_done))
            assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((0.38, b_done))
            sim.check_integrity()


def test_fit_and_calibration_file_hand_offs_by_the_decode_engines_state():
    # The committed fit's runs: a hand-off that left while its decode engine stepped took longer
    # (1.7x on average when written; 1.9-3.7x on 2026-12-04/05's runs).
    committed = LinearCost.from_fit(TINY_REASONER)
    assert committed.transfer_time(100_000, True, busy=True) > 1.4 * committed.transfer_time(100_000, True)
    fit = json.loads(CPU_FIT_PATH.read_text())
    assert fit["fit_quality"]["handoffs_busy"] > 200
    # A fresh pd session of 2026-12-05 against the fit: its hand-offs to a stepping engine ran
    # 1.4-1.8x the fit's level there, those to an idle one 0.6-0.9x (the contrast was stronger
    # that day); both factors are measured on 60 or more hand-offs each.
    session = fit_sim_cpu.load_trace(DATA / "fresh-51d2d5b-20261205/pd226.json.gz")
    cal = fit_sim_cpu.calibrate(fit, session)
    assert cal["handoff_busy"] > 1.3 * cal["handoff"]
    assert min(cal["counts"]["handoff"], cal["counts"]["handoff_busy"]) >= 60
    # ``--handoffs-from``: the hand-offs of that run in place of the fit's, by state too; there
    # the stepping engine's took 2.5x the idle one's.
    taken = fit_sim_cpu.with_handoff_from(fit, session)
    level = [float(np.mean([(a + b) / 2 for a, b in zip(q, q[1:])]))
             for q in (taken["handoff_noise"], taken["handoff_busy_noise"])]
    assert level[1] > 2.0 * level[0] and taken["fit_quality"]["handoffs_busy"] == 110


def test_committed_fit_is_reproducible_from_its_saved_telemetry():
    fit = fit_sim_cpu.fit_trace(*(fit_sim_cpu.load_trace(DATA / name) for name in FIT_RUNS))
    committed = json.loads(CPU_FIT_PATH.read_text())
    assert fit["coeffs"] == pytest.approx(committed["coeffs"], rel=1e-9, abs=1e-15)
    assert fit["contention"] == committed["contention"]
    assert fit["step_noise"] == pytest.approx(committed["step_noise"], rel=1e-9)
    assert fit["prompt_noise"] == pytest.approx(committed["prompt_noise"], rel=1e-9)
    # A prompt step varies less around the model than the steps in all (q10-q90 0.65-1.37x
    # against 0.56-1.54x when written).
    spread = lambda q: float(np.interp(0.9, np.linspace(0, fit_sim_cpu.NOISE_TOP, len(q)), q)
                             - np.interp(0.1, np.linspace(0, fit_sim_cpu.NOISE_TOP, len(q)), q))  # noqa: E731
    assert spread(committed["prompt_noise"]) < 0.85 * spread(committed["step_noise"])
    assert fit["post_prompt"] == pytest.approx(committed["post_prompt"], rel=1e-9)
    assert committed["post_prompt"][0] > 1.1        # the first decode step after a prefill: ~1.17x
    # The steps after a wake: a pd decode engine's first decode step after a hand-off woke it
    # ~1.7x, a mixed engine's first after a new request's prefill woke it ~1.3x alone and ~1.5x
    # beside the other engine's steps (``_co``), the decode steps 50-100 after still ~1.05x; the
    # first prompt step ~1.2x (each over the warm steps of its kind).
    warm = committed["warmup"]
    kinds = ("decode", "decode_co", "decode_wake", "decode_wake_co", "prompt")
    assert fit["warmup"] == {"idle_s": warm["idle_s"], "edges": warm["edges"],
                             **{k: pytest.approx(warm[k], rel=1e-9) for k in kinds}}
    assert warm["decode_wake"][0] > 1.4 and warm["decode"][1] > 1.2 and warm["prompt"][0] > 1.1
    assert min(warm["decode"][1:] + warm["decode_wake"]) > 1.0
    assert all(co > alone + 0.1 for co, alone in zip(warm["decode_co"][1:4], warm["decode"][1:4]))
    assert fit["slow"] == {"window_s": committed["slow"]["window_s"],
                           "quantiles": pytest.approx(committed["slow"]["quantiles"], rel=1e-9),
                           "niced": pytest.approx(committed["slow"]["niced"], rel=1e-6, abs=1e-9),
                           "niced_max": pytest.approx(committed["slow"]["niced_max"], rel=1e-9)}
    states = ((fit["latency"], committed["latency"]),) + tuple(
        (fit["latency"][state], committed["latency"][state]) for state in ("saturated", "busy"))
    for fitted, part in states:
        for k in ("dispatch_s", "first_token_s", "finish_s"):
            assert fitted[k] == pytest.approx(part[k], rel=1e-6, abs=1e-9)
            for work in ("niced", "unniced"):
                assert fitted[work][k] == pytest.approx(part[work][k], rel=1e-6, abs=1e-9)
        for work in ("niced", "unniced"):
            assert fitted[work]["max"] == pytest.approx(part[work]["max"], rel=1e-9)
        assert fitted["external_scale"] == pytest.approx(part["external_scale"], rel=1e-6)
    assert fit["latency"]["busy_samples"] == committed["latency"]["busy_samples"]
    # A first token from an engine that goes on stepping reaches the client later than one from
    # an engine that went idle (the committed runs: 3.6 against 2.1 ms, median, a core free).
    assert np.median(committed["latency"]["busy"]["first_token_s"]) > 1.3 * np.median(committed["latency"]["first_token_s"])
    # A dispatch with a core free grows with the un-niced outside work (the committed runs: 3.5
    # ms median on quiet runs, 5.2 ms beside a busy loop at nice 0, 0.6-0.7 cores).
    assert 0.3 < committed["latency"]["external_scale"][0] < 2.0
    assert fit["latency"]["dispatch_per_token_s"] == pytest.approx(committed["latency"]["dispatch_per_token_s"], rel=1e-6)
    assert fit["kv_capacity_tokens"] == committed["kv_capacity_tokens"]
    assert fit["transfer_latency_s"] == pytest.approx(committed["transfer_latency_s"], rel=1e-9)
    assert committed["fit_quality"]["handoffs"] > 100       # the pd run's, pooled


class _Fixed:
    """A generator whose ``random()`` is always ``u``."""

    def __init__(self, u):
        self.u = u

    def random(self):
        return self.u


def test_frontend_latency_is_drawn_from_its_quantiles():
    from thinkserve.cluster.sim.cost import FrontendLatency
    f = FrontendLatency(dispatch_s=(0.0, 0.010, 0.030))   # quantiles at p = 0, 0.5, 1
    assert [f.dispatch(_Fixed(u)) for u in (0.0, 0.25, 0.5, 0.75, 0.999999)] == \
        pytest.approx([0.0, 0.005, 0.010, 0.020, 0.030], abs=1e-6)
    assert f.first_token(_Fixed(0.7)) == 0.0
    # The dispatch grows with the prompt, on top of the draw, in either cores' state.
    grows = FrontendLatency(dispatch_s=(0.0, 0.010), saturated=FrontendLatency(dispatch_s=(0.1, 0.3)),
                            dispatch_per_token_s=1e-4)
    assert (grows.dispatch(_Fixed(0.5), prompt_tokens=30), grows.dispatch(_Fixed(0.5), LatencyState.TAKEN, 30)) == \
        pytest.approx((0.005 + 0.003, 0.2 + 0.003))
    assert grows.dispatch(_Fixed(0.5)) == pytest.approx(0.005)
    both = FrontendLatency(dispatch_s=(0.0, 0.010), saturated=FrontendLatency(dispatch_s=(0.1, 0.3)))
    assert (both.dispatch(_Fixed(0.5)), both.dispatch(_Fixed(0.5), LatencyState.TAKEN)) == pytest.approx((0.005, 0.2))
    assert f.dispatch(_Fixed(0.5), LatencyState.TAKEN) == pytest.approx(0.010)   # no split: one distribution
    assert (f.state(taken=True), both.state(taken=True)) == (LatencyState.FREE, LatencyState.TAKEN)


def test_frontend_latency_grows_with_the_outside_work():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Quantiles at p = 0, 1; a core free: dispatch x (1 + 0.5 per core of outside work), first
    # token unscaled, finish x (1 + 2 x); the cores taken: its own scales.
    lat = FrontendLatency(dispatch_s=(0.0, 0.010), first_token_s=(0.004,), finish_s=(0.002, 0.006),
                          external_scale=(0.5, 0.0, 2.0), dispatch_per_token_s=1e-4,
                          saturated=FrontendLatency(dispatch_s=(0.020,), first_token_s=(0.006,), finish_s=(0.008,),
                                                    external_scale=(1.0, 0.25, 0.0)))
    assert lat.dispatch(_Fixed(0.5), external=0.8) == pytest.approx(0.005 * 1.4)
    assert lat.dispatch(_Fixed(0.5), prompt_tokens=30, external=0.8) == pytest.approx(0.005 * 1.4 + 0.003)  # per token: not scaled
    assert lat.dispatch(_Fixed(0.5), LatencyState.TAKEN, 30, 0.8) == pytest.approx(0.020 * 1.8 + 0.003)
    assert (lat.first_token(_Fixed(0.3), external=2.0), lat.first_token(_Fixed(0.3), LatencyState.TAKEN, 2.0)) == \
        pytest.approx((0.004, 0.006 * 1.5))
    assert (lat.finish(_Fixed(0.25), external=0.5), lat.finish(_Fixed(0.25), LatencyState.TAKEN, 0.5)) == pytest.approx((0.003 * 2.0, 0.008))
    assert lat.dispatch(_Fixed(0.5)) == pytest.approx(0.005)      # no outside work: the quantiles
    with pytest.raises(ValueError, match="external_scale"):
        FrontendLatency.from_fit({"dispatch_s": [0.0], "first_token_s": [0.0], "finish_s": [0.0],
                                  "external_scale": [0.5, -1.0, 0.0]})


def test_simulated_latencies_follow_the_replayed_outside_work():
    # 1 s per step, four cores, no contention from the load (weight 0); dispatch 0.25 s x (1 +
    # 0.5 x), first token 0.1 s x (1 + 1.0 x), end 0.2 s. Outside work 2 cores from 0 s, none
    # from 1.2 s: a is sent at 0.05 s (0.25 x 2 = 0.5 s), prefills in [0.55, 1.55] and its token
    # goes out after 1.2 s (0.1 s); b is sent at 0.9 s to the other, idle instance (0.5 s again):
    # prefill [1.4, 2.4], token 0.1 s.
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.2], "external_scale": [0.5, 1.0, 0.0]}
    reqs = [SimRequest("a", 0.05, 4, (1,), salt=1), SimRequest("b", 0.9, 4, (1,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency=lat), 2,
                external_load=[(0.0, 2.0), (1.2, 0.0)]).run()
    assert sim.records["a"].first_token == pytest.approx(0.55 + 1.0 + 0.1)
    assert sim.records["b"].first_token == pytest.approx(1.4 + 1.0 + 0.1)
    # Before the load drops, a token goes out slower: a request sent at 0.05 s, a 0.2 s step.
    quick = build([SimRequest("a", 0.05, 4, (1,), salt=1)], Deployment("colocated"),
                  cpu(c0=0.2, cores=4, co_step=0.0, latency=lat), 1, external_load=[(0.0, 2.0), (1.2, 0.0)]).run()
    assert quick.records["a"].first_token == pytest.approx(0.55 + 0.2 + 0.1 * 3.0)


def test_fit_scales_the_latencies_by_the_outside_work():
    # Dispatch 3 ms x (1 + 0.5 per core of outside work) (+ 1 ms on every tenth: the spread),
    # first token 2 ms whatever the load; one 80 ms dispatch the median's regression ignores.
    reqs, loads = [], {}
    for i in range(60):
        x = (0.0, 0.4, 0.8)[i % 3]
        d = 0.003 * (1 + 0.5 * x) + (0.001 if i % 10 == 0 else 0.0) + (0.08 if i == 7 else 0.0)
        loads[i] = x
        reqs.append({"id": i, "sent": float(i), "first": i + 0.5, "end": i + 1.0, "prompt_len": 5,
                     "parts": [{"added": i + d, "first_token": i + 0.498, "finished": i + 0.999}]})
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, external=lambda r, t: loads[r["id"]])
    assert lat["external_scale"] == pytest.approx([0.5, 0.0, 0.0], rel=1e-3, abs=1e-9)
    assert lat["dispatch_s"][50] == pytest.approx(0.003, rel=1e-3)         # the median, at no load
    assert lat["first_token_s"] == pytest.approx([0.002] * len(fit_sim_cpu.QUANTILES))
    assert fit_sim_cpu.load_scale([1.0, 1.0, 1.0], [0.0, 0.0, 0.0]) == 0.0   # one load: no scale
    assert fit_sim_cpu.load_scale([3.0, 2.0, 1.0], [0.0, 1.0, 2.0]) == 0.0   # shrinking: none


def test_slow_stretches_stretch_decode_runs_per_engine_and_window():
    # 0.1 s per step (no contention), one request of 4 prompt tokens and 30 output tokens: the
    # prefill step is priced alone (noise 1), the 29 decode steps in runs. The same slowness in
    # every window is none: the draws are scaled so that the steps average the price.
    reqs = [SimRequest("a", 0.0, 4, (30,), salt=1)]
    flat = cpu(c0=0.1, cores=None, step_noise=[1.0, 1.0], slow={"window_s": 1.0, "quantiles": [2.0]})
    assert build(reqs, Deployment("colocated"), flat, 1).run().records["a"].finish == pytest.approx(0.1 + 29 * 0.1)
    sim = build(reqs, Deployment("colocated"), flat, 1, step_noise=True).run()
    assert sim.records["a"].finish == pytest.approx(0.1 + 29 * 0.1)
    assert sim.instances[0].num_runs >= 3          # a run ends at each of the 1 s windows' ends
    # Slowness drawn 1-3 per window from the engine's own generator, in window order, times the
    # mean of 1 / slowness (ln 3 / 2: a window lasts 1 s however slow, so the slow ones hold fewer
    # steps): a step starting in window k takes 0.1 x m_k (written out here).
    spread = cpu(c0=0.1, cores=None, step_noise=[1.0, 1.0], slow={"window_s": 1.0, "quantiles": [1.0, 3.0]})
    rng, m = random.Random("slow-mixed-0"), []
    t = 0.1
    for _ in range(29):
        k = int(t // 1.0)
        while len(m) <= k:
            m.append((1.0 + 2.0 * rng.random()) * math.log(3.0) / 2.0)
        t += 0.1 * m[k]
    once = build(reqs, Deployment("colocated"), spread, 1, step_noise=True).run().records["a"].finish
    assert once == pytest.approx(t) and len(set(m)) > 1
    with pytest.raises(ValueError, match="slow"):
        cpu(slow={"window_s": 0.0, "quantiles": [1.0]})


def test_calibrated_slow_spread_and_engine_speeds_price_the_decode_steps():
    # Slowness 0.5-1.5 per window (mean 1, as fitted); calibrated slow_spread 0.5: 0.75-1.25,
    # times the mean of 1 / slowness over those (ln(1.25 / 0.75) / 0.5: the steps average 1).
    cost = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                      kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                      step_noise=[1.0, 1.0], slow={"window_s": 1.0, "quantiles": [0.5, 1.5]},
                      calibration={"slow_spread": 0.5, "engines": [1.0, 1.5]})
    scale = math.log(1.25 / 0.75) / 0.5
    assert [cost.slowness(u) for u in (0.0, 0.5, 1.0)] == pytest.approx([0.75 * scale, scale, 1.25 * scale])
    assert cost.slow_deviation() == pytest.approx(0.25)      # |0.5 + u - 1| over u, before the spread
    # Two engines, 0.1 s a step, no contention; a and b arrive together (4 prompt tokens, 5
    # output tokens), one on each: the prefills take 0.1 s on both, the decode steps 0.1 s on the
    # first engine, 0.15 s on the second (its place on the node: engines[1] = 1.5).
    plain = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                       kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                       calibration={"engines": [1.0, 1.5]})
    assert (plain.engine_speed(0), plain.engine_speed(1), plain.engine_speed(2)) == (1.0, 1.5, 1.0)
    reqs = [SimRequest("a", 0.0, 4, (5,), salt=1), SimRequest("b", 0.0, 4, (5,), salt=2)]
    for bulk in (True, False):
        rec = build(reqs, Deployment("colocated"), plain, 2, bulk_decode=bulk).run().records
        assert [r.first_token for r in rec.values()] == pytest.approx([0.1, 0.1])
        assert sorted(r.finish for r in rec.values()) == pytest.approx([0.5, 0.7])
    with pytest.raises(ValueError, match="engines"):
        LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, calibration={"engines": [0.0]})


def test_calibration_reads_each_engines_speed_and_the_slow_stretches_spread():
    # A slower hour on record (2026-12-03 11:5x, seed 66 run B): the node's second engine ran its
    # decode steps 1.148x the fit, the first 1.045x; the 0.1 s windows spread 1.4x as wide as
    # the fit's. A quiet hour's (seed 46 run B): the engines alike, the windows 0.9-1.1x.
    fit = json.loads(CPU_FIT_PATH.read_text())
    slow = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "warm-20261203/mixed-seed66.B.json.gz"))
    assert slow["engines"][1] / slow["engines"][0] == pytest.approx(1.148 / 1.045, rel=0.01)
    assert slow["slow_spread"] > 1.25 and slow["counts"]["slow_spread"] > 500
    quiet = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "quiet-20261203/mixed-seed46.B.json.gz"))
    assert quiet["engines"] == pytest.approx([1.0, 1.0], abs=0.02) and 0.8 < quiet["slow_spread"] < 1.15
    # a pd run: one engine decodes, the other's (too few decode steps) stays 1
    pd = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "quiet-20261203/pd-seed46.B.json.gz"))
    assert pd["engines"] == [1.0, 1.0]


def test_fit_finds_the_slow_stretches():
    # One engine, decode steps of 2 ms modelled; in every other 0.1 s window they take 1.5x, in
    # the rest 0.5x (measured over modelled per window, mean 1: quantiles 0.5 ... 1.5).
    feats = np.column_stack([np.ones(400), np.zeros(400), np.ones(400), np.zeros(400), np.zeros(400)])
    starts = np.arange(400) * 0.0025
    factor = np.where(np.floor(starts / fit_sim_cpu.SLOW_WINDOW_S) % 2 == 0, 1.5, 0.5)
    pred = np.full(400, 0.002)
    ratios, niced = fit_sim_cpu.slow_windows(feats, pred * factor, pred, starts, np.zeros(400))
    assert sorted(set(np.round(ratios, 9))) == [0.5, 1.5] and len(ratios) == 10 and not niced.any()
    # Steps with prompt tokens are not counted, nor windows with fewer than SLOW_MIN_STEPS.
    prompt = feats.copy()
    prompt[:, 4] = 1
    assert len(fit_sim_cpu.slow_windows(prompt, pred, pred, starts, np.zeros(400))[0]) == 0


def test_frontend_latency_widens_with_the_niced_work():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Quantiles at p = 0, 0.5, 1: 2, 3, 4 ms with no niced work; per niced core the top grows
    # by 6 ms, the middle not at all; at most 1 core (the fit's most); the un-niced scale on top.
    lat = FrontendLatency(dispatch_s=(0.002, 0.003, 0.004), first_token_s=(0.001,), finish_s=(0.001,),
                          external_scale=(0.5, 0.0, 0.0), niced=((0.0, 0.0, 0.006), (0.0,), (0.002,)), niced_max=1.0)
    assert lat.dispatch(_Fixed(0.5), niced=0.8) == pytest.approx(0.003)                 # the middle stays
    assert lat.dispatch(_Fixed(0.75), niced=0.5) == pytest.approx(0.0035 + 0.5 * 0.003)
    assert lat.dispatch(_Fixed(0.75), niced=3.0) == lat.dispatch(_Fixed(0.75), niced=1.0)  # held at niced_max
    assert lat.dispatch(_Fixed(0.75), niced=0.5, external=2.0) == pytest.approx((0.0035 + 0.0015) * 2.0)
    assert lat.finish(_Fixed(0.3), niced=0.5) == pytest.approx(0.002)
    # From a fit's JSON: one slope per quantile, else an error naming the field.
    fit = {"dispatch_s": [0.002, 0.004], "first_token_s": [0.001], "finish_s": [0.001],
           "niced": {"max": 0.9, "dispatch_s": [0.0, 0.01], "first_token_s": [0.0], "finish_s": [0.0]}}
    assert FrontendLatency.from_fit(fit).dispatch(_Fixed(0.999999), niced=2.0) == pytest.approx(0.004 + 0.009, abs=1e-7)
    with pytest.raises(ValueError, match="niced"):
        FrontendLatency.from_fit({**fit, "niced": {**fit["niced"], "dispatch_s": [0.0]}})


def test_simulated_latencies_follow_the_replayed_niced_work():
    # 1 s per step on four cores, no contention; first token 0.1 s + 0.05 s per niced core (up to
    # 2). Niced work 1 core from 0 s, 4 from 1.1 s: a's token (step ends at 1.0 s) takes 0.15 s,
    # b's (sent at 1.05 s, step ends at 2.05 s) 0.2 s (held at 2 cores).
    lat = {"dispatch_s": [0.0], "first_token_s": [0.1], "finish_s": [0.0],
           "niced": {"max": 2.0, "dispatch_s": [0.0], "first_token_s": [0.05], "finish_s": [0.0]}}
    reqs = [SimRequest("a", 0.0, 4, (1,), salt=1), SimRequest("b", 1.05, 4, (1,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency=lat), 1,
                external_load=[(0.0, 0.0, 1.0), (1.1, 0.0, 4.0)]).run()
    assert sim.records["a"].first_token == pytest.approx(1.0 + 0.15)
    assert sim.records["b"].first_token == pytest.approx(2.05 + 0.2)


def test_fit_widens_the_latency_tails_with_the_niced_work():
    # First-token gaps 2-4 ms (evenly) with no niced work; beside 1 core of niced work the same
    # below the median and the upper half stretched 3x (3-9 ms); 0.5 cores: halfway. The fit's
    # quantiles with no niced work are the quiet ones, its slopes 0 below the median and the
    # stretch above, so at 1 core it draws the stretched distribution.
    base = 0.002 + 0.002 * np.arange(101) / 100
    reqs, niced = [], {}
    for level in (0.0, 0.5, 1.0):
        for v in base:
            gap = v if v <= 0.003 else 0.003 + (v - 0.003) * (1.0 + 2.0 * level)
            i = len(reqs)
            niced[i] = level
            reqs.append({"id": i, "sent": float(i), "first": i + 0.5 + gap, "end": i + 1.0, "prompt_len": 5,
                         "parts": [{"added": i + 0.001, "first_token": i + 0.5, "finished": i + 0.999}]})
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, niced=lambda r, t: niced[r["id"]])
    q, slope = np.asarray(lat["first_token_s"]), np.asarray(lat["niced"]["first_token_s"])
    assert lat["niced"]["max"] == 1.0
    assert q == pytest.approx(base, abs=1e-4)
    assert slope[:50] == pytest.approx(np.zeros(50), abs=1e-4)
    assert (q + slope)[90] == pytest.approx(0.003 + 3 * (base[90] - 0.003), abs=2e-4)
    assert lat["niced"]["dispatch_s"] == pytest.approx([0.0] * 101, abs=1e-9)   # the same at every level
    # Without the niced work's spread (or the samples), plain quantiles and no slopes.
    assert fit_sim_cpu.conditional_quantiles([1.0, 2.0, 3.0] * 20, [[0.3] * 60])[1] == [None]
    assert fit_sim_cpu.conditional_quantiles([1.0, 2.0, 3.0], [[0.0, 0.5, 1.0]])[1] == [None]


def test_slow_stretches_widen_with_the_niced_work():
    # Windows' ratios 0.9-1.1 with no niced work, 0.6-1.4 beside 1 core (both mean 1): the fit
    # keeps the quiet spread and a slope of mean 0 that widens it; the cost draws by both.
    quiet = np.linspace(0.9, 1.1, 201)
    ratio = np.concatenate([quiet, 1.0 + (quiet - 1.0) * 4.0])
    niced = np.concatenate([np.zeros(201), np.ones(201)])
    slow = fit_sim_cpu.slow_stretches(ratio, niced)
    q, s = np.asarray(slow["quantiles"]), np.asarray(slow["niced"])
    assert slow["niced_max"] == 1.0 and fit_sim_cpu._draw_mean(s) == pytest.approx(0.0, abs=1e-9)
    assert q[0] == pytest.approx(0.9, abs=0.01) and q[-1] == pytest.approx(1.1, abs=0.01)
    assert (q + s)[0] == pytest.approx(0.6, abs=0.03) and (q + s)[-1] == pytest.approx(1.4, abs=0.03)
    cost = cpu(slow=slow)

    def inverse_mean(v):    # the mean of 1 / x, x linear between the quantiles v
        return np.mean([(math.log(b) - math.log(a)) / (b - a) if b > a else 1.0 / a for a, b in zip(v, v[1:])])
    assert cost.slowness(0.0) == pytest.approx(q[0] * inverse_mean(q))
    assert cost.slowness(0.0, 0.5) == pytest.approx((q[0] + 0.5 * s[0]) * inverse_mean(q + 0.5 * s))
    assert cost.slowness(0.0, 5.0) == cost.slowness(0.0, 1.0)
    # The steps average 1 at any niced work: a window's steps are fewer by its slowness.
    for niced in (0.0, 0.5, 1.0):
        draws = [cost.slowness(u, niced) for u in np.linspace(0.0, 1.0, 20001)]
        assert np.mean(1.0 / np.asarray(draws)) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ValueError, match="niced"):
        cpu(slow={**slow, "niced": s[:-1].tolist()})


def test_latencies_while_the_engine_steps_on_are_their_own_state():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # A core free: 2 ms when the engine the latency waits on is idle, 4 ms when it is stepping;
    # every core taken: 8 ms whatever the engine does; no busy state: the free one.
    lat = FrontendLatency(first_token_s=(0.002,), saturated=FrontendLatency(first_token_s=(0.008,)),
                          busy=FrontendLatency(first_token_s=(0.004,)))
    assert [lat.first_token(_Fixed(0.5), lat.state(taken, busy)) for taken, busy in
            ((False, False), (False, True), (True, False), (True, True))] == pytest.approx([0.002, 0.004, 0.008, 0.008])
    free = FrontendLatency(first_token_s=(0.002,))
    assert free.first_token(_Fixed(0.5), free.state(busy=True)) == free.first_token(_Fixed(0.5), LatencyState.BUSY) == 0.002
    # In the simulator: 1 s steps on four cores, first token 0.1 s from an idle engine, 0.3 s
    # from one that steps on. a (1 output token) finishes in its prefill step and its engine goes
    # idle; b (3 tokens) decodes on after its first token.
    fit = {"dispatch_s": [0.0], "first_token_s": [0.1], "finish_s": [0.0],
           "busy": {"dispatch_s": [0.0], "first_token_s": [0.3], "finish_s": [0.0]}}
    reqs = [SimRequest("a", 0.0, 4, (1,), salt=1), SimRequest("b", 0.0, 4, (3,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency=fit), 2).run()
    assert (sim.records["a"].first_token, sim.records["b"].first_token) == pytest.approx((1.1, 1.3))


def test_fit_files_a_latency_by_whether_its_engine_stepped_on():
    # First-token gaps 2 ms (+0.1 ms on every fifth) from idle engines, 4 ms (+0.1) from busy
    # ones, 40 of each; dispatches all alike (3 ms), the busy ones too few to split (10): the
    # busy state draws the free dispatch.
    reqs, busy = [], {}
    for i in range(80):
        engine_busy = i % 2 == 1
        gap = (0.004 if engine_busy else 0.002) + (0.0001 if i % 5 == 0 else 0.0)
        busy[i] = engine_busy
        reqs.append({"id": i, "sent": float(i), "first": i + 0.5 + gap, "end": i + 1.0, "prompt_len": 5,
                     "parts": [{"added": i + 0.003, "first_token": i + 0.5, "finished": i + 0.999}]})
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, busy=lambda r, gap: busy[r["id"]] and (gap != "dispatch_s" or r["id"] < 20))
    assert np.median(lat["first_token_s"]) == pytest.approx(0.002) and np.median(lat["busy"]["first_token_s"]) == pytest.approx(0.004)
    assert lat["busy_samples"] == {"dispatch_s": 0, "first_token_s": 40, "finish_s": 40}
    assert lat["busy"]["dispatch_s"] == lat["dispatch_s"] == pytest.approx([0.003] * len(fit_sim_cpu.QUANTILES))


def test_latencies_beside_another_engines_step_are_their_own_state():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # A core free: 2 ms with the node's engines idle, 3 ms with the engine idle beside another
    # engine's step, 4 ms when the engine itself steps; every core taken: 8 ms.
    lat = FrontendLatency(first_token_s=(0.002,), saturated=FrontendLatency(first_token_s=(0.008,)),
                          busy=FrontendLatency(first_token_s=(0.004,)), shared=FrontendLatency(first_token_s=(0.003,)))
    assert [lat.first_token(_Fixed(0.5), lat.state(taken, busy, shared)) for taken, busy, shared in
            ((False, False, False), (False, False, True), (False, True, True), (True, True, True))] == \
        pytest.approx([0.002, 0.003, 0.004, 0.008])
    assert FrontendLatency(first_token_s=(0.002,)).first_token(_Fixed(0.5), LatencyState.SHARED) == 0.002
    assert (lat.mean(1, lat.state(shared=True)), lat.mean(1, lat.state(busy=True, shared=True))) == \
        pytest.approx((0.003, 0.004))
    fit = {"dispatch_s": [0.1], "first_token_s": [0.0], "finish_s": [0.0],
           "shared": {"dispatch_s": [0.2], "first_token_s": [0.05], "finish_s": [0.0]}}
    # In the simulator: 1 s steps on four cores (never all taken), two engines. a (3 tokens) is
    # dispatched with both idle (0.1 s), prefills over [0.1, 1.1] and decodes on: its first
    # token is its engine's, stepping on (the free one's, 0). b (1 token), sent at 0.5 s to the
    # idle engine beside a's step: dispatch 0.2 s, prefill [0.7, 1.7]; its engine goes idle
    # while a's decodes: first token 0.05 s after.
    reqs = [SimRequest("a", 0.0, 4, (3,), salt=1), SimRequest("b", 0.5, 4, (1,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency=fit), 2).run()
    assert sim.records["a"].placement.prefill_instance != sim.records["b"].placement.prefill_instance
    assert (sim.records["a"].first_token, sim.records["b"].first_token) == pytest.approx((1.1, 1.75))


def test_a_calibration_prices_each_latency_state_at_its_own_level():
    # latency_states: each state's draws at its own level on top of the latency's factor. The
    # dispatch at 2x, with the node idle at 2x more and beside another engine's step at 0.5x.
    from thinkserve.cluster.sim.cost import FrontendLatency
    fit = {"dispatch_s": [0.1], "first_token_s": [0.0], "finish_s": [0.0],
           "shared": {"dispatch_s": [0.2, 0.4], "first_token_s": [0.05], "finish_s": [0.0]}}
    ones = [1.0] * len(LatencyState)
    states = {"dispatch": [2.0, 1.0, 1.0, 0.5, 1.0], "first_token": ones, "finish": ones}
    cost = cpu(cores=4, co_step=0.0, latency=fit, calibration={"dispatch": 2.0, "latency_states": states})
    lat = cost.frontend
    assert (lat.mean(0, LatencyState.FREE), lat.mean(0, LatencyState.SHARED)) == pytest.approx((0.4, 0.3))
    assert lat.dispatch(_Fixed(0.25), LatencyState.SHARED) == pytest.approx(2.0 * 0.5 * 0.25)
    assert FrontendLatency.from_fit(fit).state_speed == ()         # uncalibrated: every state at 1
    # test_latencies_beside_another_engines_step_are_their_own_state's case at these levels:
    # a is dispatched with both engines idle (0.1 s at 2x, 2x: 0.4 s), prefills over [0.4, 1.4];
    # b, sent at 0.5 s beside a's step, 0.3 s at 2x, 0.5x (0.3 s), prefills over [0.8, 1.8] and
    # its first token takes the shared 0.05 s after.
    reqs = [SimRequest("a", 0.0, 4, (3,), salt=1), SimRequest("b", 0.5, 4, (1,), salt=2)]
    sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency={
        **fit, "shared": {**fit["shared"], "dispatch_s": [0.3]}}, calibration={"dispatch": 2.0, "latency_states": states}),
        2).run()
    assert (sim.records["a"].first_token, sim.records["b"].first_token) == pytest.approx((1.4, 1.85))
    for bad in ({"dispatch": ones, "first_token": ones}, {**states, "finish": [1.0] * 4},
                {**states, "finish": [1.0, 1.0, 0.0, 1.0, 1.0]}):
        with pytest.raises(ValueError, match="latency_states"):
            cpu(latency=fit, calibration={"latency_states": bad})
    with pytest.raises(ValueError, match="first_token_rho"):
        cpu(latency=fit, calibration={"first_token_rho": 1.0})


def test_calibration_measures_each_latency_states_level_and_the_first_tokens_against_their_steps():
    # The states' contrast moves by day: a dispatch with the node's engines all idle ran about its
    # calibrated level on 2026-12-03's quiet runs and 0.84x it on 2026-12-05's, one with every
    # core taken 0.95x and 1.05x. Each level keeps n / (n + STATE_PRIOR_SAMPLES) of its distance
    # from 1 (0.99 / 0.97 and 0.91 / 1.03 when written); a state with fewer than MIN_SPLIT
    # samples stays at 1.
    fit = json.loads(CPU_FIT_PATH.read_text())
    quiet = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "quiet-20261203/mixed-seed42.json.gz"))
    fresh = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "fresh-7bda6d6-20261205/mixed236.json.gz"))
    free, taken = LatencyState.FREE, LatencyState.TAKEN
    assert quiet["latency_states"]["dispatch"][free] > 0.98 > quiet["latency_states"]["dispatch"][taken]
    assert fresh["latency_states"]["dispatch"][free] < 0.92 and fresh["latency_states"]["dispatch"][taken] > 1.02
    assert fresh["latency_states"]["dispatch"][LatencyState.BUSY] == 1.0       # none or few: as the rest
    # the shrinking: a state 0.5x the latency's level on 50 samples counts half (0.75), on 150
    # three quarters (0.625); under MIN_SPLIT samples not at all
    assert fit_sim_cpu.state_level(0.5, 50) == pytest.approx(0.75)
    assert fit_sim_cpu.state_level(0.5, 150) == pytest.approx(0.625)
    assert fit_sim_cpu.state_level(2.0, fit_sim_cpu.MIN_SPLIT - 1) == 1.0
    # A first token's latency runs against its step's length (the step's end held back by the
    # frontend's calls after the publish): -0.37 on a quiet pd run of 2026-12-03, -0.24 on a
    # mixed run of 2026-12-05, each over all of the run's first tokens.
    pd = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "quiet-20261203/pd-seed42.json.gz"))
    assert pd["first_token_rho"] < -0.3 and fresh["first_token_rho"] < -0.15
    assert pd["counts"]["first_token_rho"] >= 175
    # first_token_pairs: a sample is paired with the prompt step that ended AFTER_STEP_S before
    # it; the longer the step over its price, the shorter the latency here: correlation -1,
    # clipped to -0.9. Decode steps and unmatched samples are left out.
    n = 12
    starts = np.arange(n + 1, dtype=float)
    dur = np.array([0.5 + 0.01 * i for i in range(n)] + [0.9])
    price = np.full(n + 1, 0.5)
    prompt = np.array([True] * n + [False])
    rows = [(float(starts[i] + dur[i]) + fit_sim_cpu.AFTER_STEP_S, 1.0 - 0.01 * i) for i in range(n)]
    grouped = {("first_token_s", 0): rows + [(99.0, 5.0)], ("dispatch_s", 0): rows}
    steps, lat = fit_sim_cpu.first_token_pairs(grouped, starts, dur, price, prompt)
    assert len(steps) == len(lat) == n and np.corrcoef(steps, lat)[0, 1] == pytest.approx(-1.0)
    assert fit_sim_cpu.pair_correlation([(steps, lat)]) == (-0.9, n)
    assert fit_sim_cpu.pair_correlation([(steps[:5], lat[:5])]) == (0.0, 5)


def test_a_first_tokens_latency_is_drawn_against_its_prompt_steps_noise():
    from statistics import NormalDist
    from thinkserve.cluster.sim.simulator import _Against
    phi = NormalDist()
    # The copula keeps each draw uniform and correlates its normal score rho with the step's.
    rng, own = np.random.default_rng(5), random.Random(7)
    u = rng.random(20_000)
    v = np.array([_Against(own, x, -0.5).random() for x in u])
    z = lambda a: np.array([phi.inv_cdf(x) for x in a])      # noqa: E731
    assert np.corrcoef(z(u), z(v))[0, 1] == pytest.approx(-0.5, abs=0.02)
    assert np.quantile(v, [0.1, 0.5, 0.9]) == pytest.approx([0.1, 0.5, 0.9], abs=0.01)
    # A simulation: 1 s prompt steps with noise uniform on 0.5-1.5x, first-token latencies
    # uniform on 0-1 s, requests far apart. Drawn apart, the TTFT's spread is both parts'; at
    # first_token_rho -0.9 a long step mostly meets a short latency: the mean stays, the
    # spread narrows (sd of a uniform on 1 s: 0.29; of two apart 0.41).
    lat = {"dispatch_s": [0.0], "first_token_s": [0.0, 1.0], "finish_s": [0.0]}
    reqs = [SimRequest(f"r{i}", 10.0 * i, 4, (1,), salt=i + 1) for i in range(400)]

    def ttft(rho, latency_rho=0.0):
        cal = {"first_token_rho": rho, "latency_rho": latency_rho, "latency_tau_s": 1.0 if latency_rho else 0.0}
        sim = build(reqs, Deployment("colocated"), cpu(cores=None, latency=lat, prompt_noise=[0.5, 1.5],
                                                       step_noise=[1.0, 1.0], calibration=cal), 1,
                    step_noise=True).run()
        return sim, np.array([sim.records[r.request_id].first_token - r.arrival for r in reqs])
    sim, apart = ttft(0.0)
    assert sim._first_token_rho == 0.0 and all(rec.prompt_draw is None for rec in sim.records.values())
    _, against = ttft(-0.9)
    assert apart.mean() == pytest.approx(1.5, abs=0.04) and against.mean() == pytest.approx(1.5, abs=0.04)
    assert apart.std() == pytest.approx(0.41, abs=0.03) and against.std() < 0.6 * apart.std()
    # With the node's latencies persistent (latency_rho 0.3), the step's draw and the latency's
    # own are correlated 0.3 already; the copula's rho is what adds up to first_token_rho.
    sim, _ = ttft(-0.4, 0.3)
    c = sim._first_token_rho
    assert c + math.sqrt(1 - c * c) * 0.3 == pytest.approx(-0.4) and c < -0.6


def test_fit_files_a_latency_beside_another_engines_step_apart():
    # Dispatches of 3 ms (+0.1 ms on every fifth) to an idle node, 5 ms (+0.1) to an idle engine
    # beside another's step, 40 of each; first tokens all alike (2 ms), the shared ones too few
    # to split (10): the shared state draws the free first token.
    reqs, beside = [], {}
    for i in range(80):
        beside[i] = i % 2 == 1
        gap = (0.005 if beside[i] else 0.003) + (0.0001 if i % 5 == 0 else 0.0)
        reqs.append({"id": i, "sent": float(i), "first": i + 0.502, "end": i + 1.0, "prompt_len": 5,
                     "parts": [{"added": i + gap, "first_token": i + 0.5, "finished": i + 0.999}]})

    def stepping(r, t):     # another engine steps at the send; at the first token only for ids < 20
        return int(beside[r["id"]] and (t == r["sent"] or r["id"] < 20))
    lat = fit_sim_cpu.fit_latencies(reqs, 6144, 16, stepping=stepping, cores=2)
    assert np.median(lat["dispatch_s"]) == pytest.approx(0.003) and np.median(lat["shared"]["dispatch_s"]) == pytest.approx(0.005)
    assert lat["shared_samples"] == {"dispatch_s": 40, "first_token_s": 0, "finish_s": 0}
    assert lat["shared"]["first_token_s"] == lat["first_token_s"] == pytest.approx([0.002] * len(fit_sim_cpu.QUANTILES))
    assert "saturated" not in lat and "busy" not in lat
    # The committed fit: a dispatch beside the other engine's step takes longer than with the
    # node idle (its runs: 4.0 against 3.5 ms on average), the last token too (4.4 against 2.6).
    committed = LinearCost.from_fit(TINY_REASONER).frontend
    assert committed.mean(0, LatencyState.SHARED) > 1.1 * committed.mean(0)
    assert committed.mean(2, LatencyState.SHARED) > 1.5 * committed.mean(2)


def test_steps_beside_other_engines_are_calibrated_apart():
    # co_stepping: decode steps past the warm-up (bucket 8 of 8) alone at 1.0x their price,
    # beside another engine's at 1.3x; prompt steps alone 0.9x, beside 1.2x (1.33x those alone).
    # The decode steps beside carry 1 ms of held time each (a page set's write), which keeps its
    # factor: 1.0 * (1.3 * price + hold).
    n = 200
    feats = np.zeros((n, 5))
    feats[:, 0] = 1.0
    feats[n // 2:, 4] = 1.0                         # the second half: steps with prompt tokens
    others = np.tile([0.0, 1.0], n // 2)            # every other step beside another's
    price = np.full(n, 0.002)
    hold = np.where((feats[:, 4] == 0) & (others > 0), 0.001, 0.0)
    factor = np.where(feats[:, 4] == 0, np.where(others > 0, 1.3, 1.0), np.where(others > 0, 1.2, 0.9))
    dur = factor * price + np.where(feats[:, 4] == 0, 1.0, 0.9) * hold
    coef = np.array([0.002, 0.0, 0.0, 0.0, 0.0])
    run = (feats, dur, np.full(n, 8), np.ones(n), hold, np.arange(n) * 0.01, np.zeros(n), others)
    got = fit_sim_cpu.co_stepping(coef, [run], warm_buckets=8)
    assert got["decode"] == (pytest.approx(1.3), 50) and got["prompt"] == (pytest.approx(1.2 / 0.9), 50)
    # Too few steps beside others (fewer than CO_MIN_STEPS) or all in the warm-up: 1.
    few = tuple(x[: n // 2 + 2 * fit_sim_cpu.CO_MIN_STEPS - 2] for x in run)
    assert fit_sim_cpu.co_stepping(coef, [few], warm_buckets=8)["prompt"] == (1.0, 0)
    assert fit_sim_cpu.co_stepping(coef, [run], warm_buckets=9)["decode"] == (1.0, 0)
    # LinearCost prices a step beside the node's other engines' (one or more stepping) at the
    # calibration's *_co_steps, alone at decode_steps / prompt_steps; a decode run too; the
    # warm-up's steps beside at waking_co_steps whatever decode_co_steps is.
    cal = {"decode_steps": 0.8, "decode_co_steps": 1.2, "prompt_steps": 0.9, "prompt_co_steps": 1.5,
           "waking_co_steps": 2.0}
    cost = cpu(0.001, co_step=0.0, cores=4, calibration=cal,
               warmup={"idle_s": 0.02, "edges": [1, 2], "decode": [1.5, 1.2], "decode_co": [1.5, 1.2],
                       "prompt": [1.0, 1.0]})
    decode, prompt = BatchShape(num_decode=1, decode_ctx=10), BatchShape(prefill_tokens=5, prefill_ctx=15)
    assert [cost.step_time(decode), cost.step_time(decode, 1), cost.step_time(prompt), cost.step_time(prompt, 2)] == \
        pytest.approx([0.0008, 0.0012, 0.0009, 0.0015])
    assert (cost.decode_run(1, 10).time(1), cost.decode_run(1, 10, 1).time(1)) == pytest.approx((0.0008, 0.0012))
    assert cost.step_time(decode, 1) * cost.warm_decode_co[0] == pytest.approx(0.001 * 1.5 * 2.0)
    # Uncalibrated, or calibrated without them: as the steps alone.
    assert cpu(0.001, co_step=0.0, calibration={"decode_steps": 0.8}).step_time(decode, 1) == pytest.approx(0.0008)
    # On 2026-12-05 (mixed seed 184, run A) the prompt steps beside the other engine's decode
    # steps ran 1.15x more over their price than those alone.
    committed = json.loads(CPU_FIT_PATH.read_text())
    real = fit_sim_cpu.calibrate(committed, fit_sim_cpu.load_trace(DATA / "fresh-514f57e-20261205/mixed184.json.gz"))
    assert real["prompt_co_steps"] > 1.1 * real["prompt_steps"] and real["counts"]["prompt_co_steps"] > 50


def test_an_idle_engine_wakes_up_to_a_new_request():
    # One engine: its first step [0, 2 ms] (request x, added 1 ms before), idle, then a request
    # added at 10 ms whose prompt step starts at 10.3 ms, and one added at 11 ms, inside that
    # step, which waits for it (not a wake-up: left out).
    steps = [[0.0, 0.002, 5, 15, 0, 0], [0.0103, 0.002, 5, 15, 0, 0], [0.0124, 0.002, 5, 15, 0, 0]]
    trace = {"instances": {"mixed-0": {"steps": steps}}, "requests": [
        {"id": "x", "error": "", "parts": [{"added": -0.001, "first_token": 0.0015, "finished": None}]},
        {"id": "y", "error": "", "parts": [{"added": 0.010, "first_token": 0.012, "finished": None}]},
        {"id": "z", "error": "", "parts": [{"added": 0.011, "first_token": 0.014, "finished": None}]}]}
    assert fit_sim_cpu.engine_wake(trace) == pytest.approx([0.001, 0.0003])
    # In the simulator: 1 s steps, an engine wake-up of 0.25 s. a reaches the idle engine at 0,
    # its step starts at 0.25; b, at 0.1, is taken by the same wake-up (one step for both); c, at
    # 0.5, waits for that step (ends 1.25): no wake-up. The fit's, drawn: 0.43 ms on average.
    reqs = [SimRequest("a", 0.0, 4, (1,), salt=1), SimRequest("b", 0.1, 4, (1,), salt=2),
            SimRequest("c", 0.5, 4, (1,), salt=3)]
    sim = build(reqs, Deployment("colocated"), cpu(co_step=0.0, engine_wake=[0.25]), 1).run()
    assert [sim.records[k].first_token for k in "abc"] == pytest.approx([1.25, 1.25, 2.25])
    with pytest.raises(ValueError, match="engine_wake"):
        cpu(engine_wake=[-0.001, 0.0])
    committed = LinearCost.from_fit(TINY_REASONER)
    assert 0.0002 < committed.wake_delay(None) < 0.0006


def test_a_first_token_from_a_step_beside_others_decodes_is_its_own_state():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Crowded (the step also decoded other requests' sequences) takes precedence over the cores'
    # state; dispatches and last tokens have no crowded state; without one, the state's.
    lat = FrontendLatency(first_token_s=(0.002,), finish_s=(0.001,), saturated=FrontendLatency(first_token_s=(0.008,)),
                          crowded=FrontendLatency(first_token_s=(0.005,), finish_s=(0.009,)))
    assert [lat.first_token(_Fixed(0.5), lat.state(taken, crowded=crowded)) for taken, crowded in
            ((False, False), (True, False), (False, True), (True, True))] == pytest.approx([0.002, 0.008, 0.005, 0.005])
    assert lat.finish(_Fixed(0.5)) == 0.001 and lat.mean(1, lat.state(True, crowded=True)) == pytest.approx(0.005)
    free = FrontendLatency(first_token_s=(0.002,), busy=FrontendLatency(first_token_s=(0.004,)))
    assert [free.state(busy=busy, crowded=True) for busy in (False, True)] == [LatencyState.FREE, LatencyState.BUSY]
    assert free.first_token(_Fixed(0.5), free.state(crowded=True)) == 0.002
    # In the simulator: one engine, 1 s steps on four cores; first tokens 0.1 s from an idle
    # engine, 0.3 s from one stepping on, 0.7 s from a step that decoded other requests'
    # sequences. a (10 tokens) prefills alone over [0, 1] and decodes on: 1.3. b, sent at 2.5
    # into a's decode steps, joins them at 3: its prompt step [3, 4] decodes a's next token, 4.7.
    # The same with the prefix cache on (the scheduler's batch) or off (a lazy batch's step that
    # admits b).
    fit = {"dispatch_s": [0.0], "first_token_s": [0.1], "finish_s": [0.0],
           "busy": {"dispatch_s": [0.0], "first_token_s": [0.3], "finish_s": [0.0]},
           "crowded": {"dispatch_s": [0.0], "first_token_s": [0.7], "finish_s": [0.0]}}
    reqs = [SimRequest("a", 0.0, 4, (10,), salt=1), SimRequest("b", 2.5, 4, (3,), salt=2)]
    for caching in (True, False):
        sim = build(reqs, Deployment("colocated"), cpu(cores=4, co_step=0.0, latency=fit), 1,
                    prefix_caching=caching).run()
        assert (sim.records["a"].first_token, sim.records["b"].first_token) == pytest.approx((1.3, 4.7))
    # The fit: first tokens 2 ms (+0.1 ms on every fifth) from prompt-only steps, 4 ms (+0.1)
    # from crowded ones, 40 each; with 10 crowded, too few: each filed by its state.
    reqs = []
    for i in range(80):
        gap = (0.004 if i % 2 else 0.002) + (0.0001 if i % 5 == 0 else 0.0)
        reqs.append({"id": i, "sent": float(i), "first": i + 0.5 + gap, "end": i + 1.0, "prompt_len": 5,
                     "parts": [{"added": i + 0.003, "first_token": i + 0.5, "finished": i + 0.999}]})
    got = fit_sim_cpu.fit_latencies(reqs, 6144, 16, crowded=lambda r: r["id"] % 2 == 1)
    assert np.median(got["first_token_s"]) == pytest.approx(0.002) and np.median(got["crowded"]["first_token_s"]) == pytest.approx(0.004)
    assert got["crowded_samples"] == {"dispatch_s": 0, "first_token_s": 40, "finish_s": 0}
    assert got["crowded"]["dispatch_s"] == got["dispatch_s"]
    few = fit_sim_cpu.fit_latencies(reqs, 6144, 16, crowded=lambda r: r["id"] % 8 == 1)
    assert "crowded" not in few and few["first_token_s"] == fit_sim_cpu.fit_latencies(reqs, 6144, 16)["first_token_s"]
    # crowded_first_token reads the step that published the first token: x's prompt step ran
    # alone, y's beside a decoding sequence.
    steps = [[0.0, 0.002, 5, 15, 0, 0], [0.0021, 0.001, 0, 0, 1, 6], [0.0032, 0.003, 5, 15, 1, 7]]
    trace = {"instances": {"mixed-0": {"steps": steps}}}
    crowded = fit_sim_cpu.crowded_first_token(trace)
    assert [crowded({"parts": [{"added": t - 0.001, "first_token": t, "finished": None}]}) for t in (0.0015, 0.005)] == \
        [False, True]
    # The committed fit: on its runs a crowded first token took 4.7 ms on average, one from a
    # prompt-only step with the cores taken 2.8 ms.
    committed = LinearCost.from_fit(TINY_REASONER).frontend
    assert committed.mean(1, LatencyState.CROWDED) > 1.5 * committed.mean(1, LatencyState.TAKEN)


def test_engine_busy_reads_the_steps_of_the_run():
    # One engine: a prompt step [0, 0.010), decode steps [0.0101, 0.012) and [0.0122, 0.014),
    # then idle. A request sent at 0.005 (inside the prompt step) whose first token came out of it
    # and whose last came out of the second decode step (after which the engine went idle).
    steps = [[0.0, 0.010, 5, 0, 0, 0], [0.0101, 0.0019, 0, 0, 1, 6], [0.0122, 0.0018, 0, 0, 1, 7]]
    trace = {"instances": {"mixed-0": {"steps": steps}}}
    r = {"sent": 0.005, "parts": [{"added": 0.006, "first_token": 0.009, "finished": 0.0135}]}
    busy = fit_sim_cpu.engine_busy(trace)
    assert (busy(r, "dispatch_s"), busy(r, "first_token_s"), busy(r, "finish_s")) == (True, True, False)
    assert not busy({**r, "sent": -0.001}, "dispatch_s")


def test_latency_tails_follow_the_unniced_work_too():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Per un-niced core the top quantile grows by 4 ms inside the x (1 + 0.5 x) scale; up to 1 core.
    lat = FrontendLatency(dispatch_s=(0.002, 0.004), external_scale=(0.5, 0.0, 0.0),
                          unniced=((0.0, 0.004), (0.0,), (0.0,)), unniced_max=1.0,
                          niced=((0.0, 0.002), (0.0,), (0.0,)), niced_max=2.0)
    assert lat.dispatch(_Fixed(0.5), external=0.5) == pytest.approx((0.003 + 0.5 * 0.002) * 1.25)
    assert lat.dispatch(_Fixed(0.5), external=3.0, niced=1.0) == pytest.approx((0.003 + 0.002 + 0.001) * 2.5)
    # The fit: gaps 2-4 ms quiet; beside 1 un-niced core the upper half stretched 3x.
    base = 0.002 + 0.002 * np.arange(101) / 100
    reqs, load = [], {}
    for level in (0.0, 1.0):
        for v in base:
            i = len(reqs)
            load[i] = level
            gap = v if v <= 0.003 else 0.003 + (v - 0.003) * (1.0 + 2.0 * level)
            reqs.append({"id": i, "sent": float(i), "first": i + 0.5 + gap, "end": i + 1.0, "prompt_len": 5,
                         "parts": [{"added": i + 0.001, "first_token": i + 0.5, "finished": i + 0.999}]})
    fit = fit_sim_cpu.fit_latencies(reqs, 6144, 16, external=lambda r, t: load[r["id"]], niced=lambda r, t: 0.0)
    assert fit["external_scale"][1] == pytest.approx(0.0, abs=1e-6) and "niced" not in fit   # the median stays
    q, s = np.asarray(fit["first_token_s"]), np.asarray(fit["unniced"]["first_token_s"])
    assert q == pytest.approx(base, abs=1e-4) and (q + s)[90] == pytest.approx(0.003 + 3 * (base[90] - 0.003), abs=2e-4)


def test_decode_steps_just_after_a_prompt_step_are_priced_dearer():
    # 0.1 s per step, one request of 4 prompt tokens and 6 output tokens: the prefill step (its
    # first token), then 5 decode steps, the first two x 1.5 and x 1.2 (post_prompt), the rest in
    # a run at the plain price; the same step by step.
    reqs = [SimRequest("a", 0.0, 4, (6,), salt=1)]
    post = cpu(c0=0.1, cores=None, post_prompt=[1.5, 1.2])
    for bulk in (True, False):
        sim = build(reqs, Deployment("colocated"), post, 1, bulk_decode=bulk).run()
        assert sim.records["a"].finish == pytest.approx(0.1 + 0.15 + 0.12 + 3 * 0.1)
    assert build(reqs, Deployment("colocated"), cpu(c0=0.1, cores=None), 1).run().records["a"].finish == \
        pytest.approx(0.6)
    with pytest.raises(ValueError, match="post_prompt"):
        cpu(post_prompt=[0.0])


def test_fit_finds_the_decode_steps_after_a_prompt_step():
    # One engine: a prompt step, then decode steps of 2 ms modelled; the first after each prompt
    # step takes 3 ms, the second 2.5 ms, the rest 2 ms.
    feats, dur = [], []
    for _ in range(20):
        feats.append([1, 5, 0, 5, 1]); dur.append(0.004)
        for j in range(10):
            feats.append([1, 0, 1, 10, 0]); dur.append((0.003, 0.0025)[j] if j < 2 else 0.002)
    feats, dur = np.asarray(feats, dtype=float), np.asarray(dur)
    pred = np.where(feats[:, 4] > 0, 0.004, 0.002)
    since = fit_sim_cpu.since_prompt(feats, np.zeros(len(dur)))
    assert fit_sim_cpu.post_prompt_factors(feats, dur, pred, since) == pytest.approx([1.5, 1.25])


def test_frontend_latency_mean_is_the_mean_of_its_draws():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Quantiles at p = 0, 0.5, 1: draws linear between them, so the mean is the mean of the two
    # intervals' midpoints: ((1 + 2) / 2 + (2 + 4) / 2) / 2 = 2.25 ms.
    f = FrontendLatency(dispatch_s=(0.001, 0.002, 0.004), first_token_s=(0.003,), dispatch_per_token_s=1e-5,
                        niced=((0.0, 0.001, 0.002), (0.0,), (0.0,)), niced_max=1.0,
                        external_scale=(0.5, 0.0, 0.0), busy=FrontendLatency(first_token_s=(0.007,)))
    assert f.mean(0) == pytest.approx(0.00225)
    assert f.mean(0, prompt_tokens=100) == pytest.approx(0.00225 + 0.001)
    # 2 cores of niced work, taken as its most (1): + (0 + 1 + 2) / 4 ms per core; 1 core of un-niced: x1.5.
    assert f.mean(0, niced=2.0, external=1.0) == pytest.approx((0.00225 + 0.001) * 1.5)
    assert (f.mean(1), f.mean(1, LatencyState.BUSY)) == pytest.approx((0.003, 0.007))
    draws = [f.dispatch(_Fixed(u), niced=0.5, external=0.4) for u in np.linspace(0, 1, 200001)]
    assert f.mean(0, niced=0.5, external=0.4) == pytest.approx(np.mean(draws), rel=1e-4)


def test_frontend_latency_spread_keeps_the_mean():
    from thinkserve.cluster.sim.cost import FrontendLatency
    # Draws uniform on [1, 2] ms, then on [2, 4] ms, each half the time: mean 2.25 ms; mean
    # absolute deviation from it: the first interval lies below (|1.5 - 2.25| = 0.75), the second
    # straddles it ((0.25^2 + 1.75^2) / (2 x 2) = 0.78125): (0.75 + 0.78125) / 2 ms.
    f = FrontendLatency(dispatch_s=(0.001, 0.002, 0.004), first_token_s=(0.003,), finish_s=(-0.002, 0.002))
    assert f.deviation(0) == pytest.approx(0.000765625)
    assert (f.deviation(1), f.deviation(2)) == pytest.approx((0.0, 0.001))
    u = np.linspace(0, 1, 200001)
    for spread in (0.5, 1.5):
        g = FrontendLatency(dispatch_s=f.dispatch_s, first_token_s=f.first_token_s, finish_s=f.finish_s,
                            speed=(2.0, 1.0, 1.0), spread=(spread, 1.0, spread))
        draws = np.array([g.dispatch(_Fixed(x)) for x in u])
        # Each draw moved towards (or away from) the mean in its state, then the speed: the same mean.
        assert draws == pytest.approx([2.0 * (0.00225 + spread * (f.dispatch(_Fixed(x)) - 0.00225)) for x in u])
        assert draws.mean() == pytest.approx(2.0 * 0.00225, rel=1e-4)
        assert np.abs(draws / 2.0 - 0.00225).mean() == pytest.approx(spread * 0.000765625, rel=1e-3)
        assert g.mean(0) == f.mean(0) * 2.0
        finish = [g.finish(_Fixed(x)) for x in (0.0, 1.0)]
        assert finish == pytest.approx([-0.002 * spread, 0.002 * spread])    # a finish may lie before the step's end
    # Widened, a dispatch does not go below 0: [0, 2] ms at spread 2 would reach -1 ms.
    wide = FrontendLatency(dispatch_s=(0.0, 0.002), spread=(2.0, 1.0, 1.0))
    assert wide.dispatch(_Fixed(0.0)) == 0.0 and wide.dispatch(_Fixed(1.0)) == pytest.approx(0.003)


def test_calibration_scales_the_steps_and_the_frontend_latencies(tmp_path):
    latency = {"dispatch_s": [0.002, 0.004], "first_token_s": [0.003], "finish_s": [0.001, 0.003],
               "dispatch_per_token_s": 1e-5}
    plain = cpu(c0=0.002, c_prefill=1e-4, c_decode=0.001, c_ctx=1e-6, latency=latency)
    cal = {"decode_steps": 1.25, "prompt_steps": 1.5, "dispatch": 0.8, "first_token": 1.1, "finish": 0.9}
    fast = LinearCost(TINY_REASONER, {"c0": 0.002, "c_prefill": 1e-4, "c_decode": 0.001, "c_ctx": 1e-6, "c_mixed": 0.0},
                      kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, cores=2, co_step=0.5,
                      latency=latency, calibration=cal)
    decode = BatchShape(prefill_tokens=0, prefill_ctx=0, num_decode=4, decode_ctx=400)
    mixed = BatchShape(prefill_tokens=30, prefill_ctx=465, num_decode=4, decode_ctx=400)
    assert fast.step_time(decode, others=1, external=0.5) == pytest.approx(1.25 * plain.step_time(decode, others=1, external=0.5))
    assert fast.step_time(mixed, others=1) == pytest.approx(1.5 * plain.step_time(mixed, others=1))
    assert fast.decode_run(4, 400, others=1).time(10) == pytest.approx(1.25 * plain.decode_run(4, 400, others=1).time(10))
    for u in (0.0, 0.3, 0.9):
        assert fast.frontend.dispatch(_Fixed(u), prompt_tokens=50) == \
            pytest.approx(0.8 * plain.frontend.dispatch(_Fixed(u), prompt_tokens=50))
        assert fast.frontend.finish(_Fixed(u)) == pytest.approx(0.9 * plain.frontend.finish(_Fixed(u)))
    assert fast.frontend.mean(1) == pytest.approx(1.1 * 0.003)
    # Read from a fit file; a missing factor is 1; bad factors named.
    fit = json.loads(CPU_FIT_PATH.read_text())
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps({**fit, "calibration": {"decode_steps": 1.1, "dispatch": 1.3}}))
    calibrated, committed = LinearCost.from_fit(TINY_REASONER, path), LinearCost.from_fit(TINY_REASONER)
    assert calibrated.step_time(decode) == pytest.approx(1.1 * committed.step_time(decode))
    assert calibrated.step_time(mixed) == pytest.approx(committed.step_time(mixed))
    assert calibrated.frontend.mean(0, prompt_tokens=10) == pytest.approx(1.3 * committed.frontend.mean(0, prompt_tokens=10))
    assert calibrated.frontend.mean(2, LatencyState.BUSY) == pytest.approx(committed.frontend.mean(2, LatencyState.BUSY))
    # The warm-up's tables: their buckets up to WAKING_STEPS at waking_steps (beside another
    # engine's steps: waking_co_steps), the rest at woken_steps, each in place of decode_steps;
    # a calibration without the waking factors prices the whole warm-up at woken_steps.
    warmup = {"idle_s": 0.5, "edges": [1, 3, 20, 30], "decode": [2.0, 1.5, 1.3, 1.2], "decode_co": [3.0, 2.0, 1.6, 1.4],
              "prompt": [1.2, 1.0, 1.0, 1.0]}
    woken = {"decode_steps": 1.1, "woken_steps": 1.2, "waking_steps": 1.3, "waking_co_steps": 1.5}
    coeffs = {"c0": 0.002, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0}
    for given, (early, early_co) in ((woken, (1.3, 1.5)), ({"decode_steps": 1.1, "woken_steps": 1.2}, (1.2, 1.2))):
        c = LinearCost(TINY_REASONER, coeffs, kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                       cores=2, warmup=warmup, calibration=given)
        assert c.warm_decode == pytest.approx((2.0 * early / 1.1, 1.5 * early / 1.1, 1.3 * early / 1.1, 1.2 * 1.2 / 1.1))
        assert c.warm_decode_co == pytest.approx((3.0 * early_co / 1.1, 2.0 * early_co / 1.1, 1.6 * early_co / 1.1,
                                                  1.4 * 1.2 / 1.1))
        # no decode_wake tables: the decode table's, calibrated as the kind it stands for
        assert c.warm_decode_wake == c.warm_decode
        assert c.warm_decode_wake_co == pytest.approx((2.0 * early_co / 1.1, 1.5 * early_co / 1.1, 1.3 * early_co / 1.1,
                                                       1.2 * 1.2 / 1.1))
    for bad in ({"decode_steps": 0.0}, {"finish": -1.0}, {"prompt_steps": "fast"}):
        path.write_text(json.dumps({**fit, "calibration": bad}))
        with pytest.raises(ValueError, match="calibration (decode_steps|finish|prompt_steps) = "):
            LinearCost.from_fit(TINY_REASONER, path)


def _dilated(trace: dict, k: float) -> dict:
    """``trace`` with every time ``k`` times as long: each step's start and duration, each
    request's times, the outside work's sample times (a machine ``k`` times as slow at all of it)."""
    out = json.loads(json.dumps(trace))
    for inst in out["instances"].values():
        for row in inst["steps"]:
            row[0], row[1] = row[0] * k, row[1] * k
    for r in out["requests"]:
        for key in ("sent", "first", "end"):
            r[key] *= k
        for part in r["parts"]:
            for key in ("added", "first_token", "finished"):
                if part[key] is not None:
                    part[key] *= k
    for series in (fit_sim_cpu.EXTERNAL_SERIES, fit_sim_cpu.TOTAL_SERIES):
        out[series] = [[t * k, x] for t, x in out[series]]
    return out


def test_calibration_measures_a_slower_machine_against_the_fit():
    coeffs = {"c0": 0.0021, "c_prefill": 0.00045, "c_decode": 0.0009, "c_ctx": 3e-7, "c_mixed": 0.0013}
    trace = _synthetic_trace(coeffs, 0.66, 0.4, 2, (0.006, 0.004, 0.005, 0.0042))
    fit = fit_sim_cpu.fit_trace(trace)
    same = fit_sim_cpu.calibrate(fit, trace)
    assert [same[k] for k in CALIBRATION_FACTORS] == pytest.approx([1.0] * len(CALIBRATION_FACTORS), rel=1e-6)
    assert same["counts"]["dispatch"] == same["counts"]["finish"] == same["counts"]["handoff"] == 3
    assert same["counts"]["decode_steps"] > 100
    # A run without hand-offs (the mixed layout's) leaves the hand-off as fitted.
    single = json.loads(json.dumps(trace))
    for r in single["requests"]:    # each request's two parts as one engine's
        head, tail = r["parts"]
        r["parts"] = [{**head, "finished": tail["finished"]}]
    alone = fit_sim_cpu.calibrate(fit, single)
    assert (alone["handoff"], alone["counts"]["handoff"]) == (1.0, 0)
    # Each engine's first 100 steps after its wake (104 decode-only); of them the first
    # WAKING_STEPS (20; 7 decode-only each, the first engine's alone, the second's beside the
    # first's) are too few to calibrate apart (CALIBRATION_MIN_STEPS): they take the other 90's.
    assert (same["counts"]["woken_steps"], same["counts"]["waking_steps"], same["counts"]["waking_co_steps"]) == (90, 90, 90)
    # The same run on a machine 1.3x as slow at everything: every factor is 1.3.
    slow = fit_sim_cpu.calibrate(fit, _dilated(trace, 1.3))
    assert "decode steps x1.000 (200)" in fit_sim_cpu.describe_calibration(same)
    assert "finish spread x1.000 (3)" in fit_sim_cpu.describe_calibration(same)
    # (the spreads: the deviations grew with the latencies, 1.0)
    assert [slow[k] for k in CALIBRATION_FACTORS] == pytest.approx(
        [1.0 if k.endswith("_spread") else 1.3 for k in CALIBRATION_FACTORS], rel=1e-6)
    # Only the prompt steps 1.2x as slow (every later time moved by what they added, so the
    # engines still step in lockstep and the requests keep their gaps): only their factor moves.
    prompt = json.loads(json.dumps(trace))
    first = prompt["instances"]["mixed-0"]["steps"]
    starts = np.array([row[0] for row in first])
    added = np.cumsum([0.2 * row[1] if row[2] else 0.0 for row in first])

    def shift(t):   # what the prompt steps before ``t`` added
        i = int(np.searchsorted(starts, t, side="left")) - 1
        return float(added[i]) if i >= 0 else 0.0
    for inst in prompt["instances"].values():
        for row in inst["steps"]:
            row[0], row[1] = row[0] + shift(row[0]), row[1] * (1.2 if row[2] else 1.0)
    for r in prompt["requests"]:
        for key in ("sent", "first", "end"):
            r[key] += added[-1]
        for part in r["parts"]:
            for key in ("added", "first_token", "finished"):
                if part[key] is not None:
                    part[key] += added[-1]
    for series in (fit_sim_cpu.EXTERNAL_SERIES, fit_sim_cpu.TOTAL_SERIES):
        prompt[series] = [[t + shift(t), x] for t, x in prompt[series]]
    moved = fit_sim_cpu.calibrate(fit, prompt)
    assert (moved["prompt_steps"], moved["decode_steps"], moved["woken_steps"]) == pytest.approx((1.2, 1.0, 1.0), rel=1e-6)
    # A calibration the fit carries already is not compounded.
    assert fit_sim_cpu.calibrate({**fit, "calibration": {"decode_steps": 2.0}}, trace)["decode_steps"] == \
        pytest.approx(1.0, rel=1e-6)
    other = json.loads(json.dumps(trace))
    other["engine"]["max_num_seqs"] = 8
    with pytest.raises(ValueError, match="another machine or engine settings"):
        fit_sim_cpu.calibrate(fit, other)


def test_calibration_on_the_committed_fits_own_runs_is_one():
    # Against the telemetry it was fitted from, the committed fit is calibrated already: each
    # factor's sums come back within 1.5% (0.995-1.008 when written), but for the steps alone
    # and beside the node's other engines' (below), so a calibration run's factors measure the
    # machine, not the fit's bias.
    committed = json.loads(CPU_FIT_PATH.read_text())
    cal = fit_sim_cpu.calibrate(committed, *(fit_sim_cpu.load_trace(DATA / name) for name in FIT_RUNS))
    split = ("decode_steps", "decode_co_steps", "prompt_steps", "prompt_co_steps")
    means = [k for k in CALIBRATION_FACTORS if not k.endswith("_spread") and k not in split]
    # (the hand-offs' by their decode engine's state within 2%: each state's level is its mean
    # ratio to the line, the calibration a ratio of sums over hand-offs of 0.1-2.2 MB; 0.984 for
    # those to a stepping engine when written)
    assert [cal[k] for k in means] == pytest.approx([1.0] * len(means), abs=0.02)
    assert [cal[k] for k in means if not k.startswith("handoff")] == pytest.approx([1.0] * (len(means) - 2), abs=0.015)
    assert cal["decode_per_seq"] == pytest.approx(1.0, abs=0.03)
    # The fit's one co_step prices every step beside the node's other engines' alike; its own
    # runs' prompt steps ran 13% slower beside them than that against those alone, and their
    # decode steps 5% faster (the pd decode engine's few steps beside a prefill: 0.7x), so the
    # steps alone and beside come back on either side of 1 (when written: decode 1.034 / 0.985,
    # prompt 0.911 / 1.031); a calibration run measures both sides as they are now.
    assert cal["decode_steps"] > 1.0 > cal["decode_co_steps"] and cal["prompt_steps"] < 1.0 < cal["prompt_co_steps"]
    assert [cal[k] for k in split] == pytest.approx([1.034, 0.985, 0.911, 1.031], abs=0.005)
    assert cal["counts"]["decode_co_steps"] > 50_000 and cal["counts"]["prompt_co_steps"] > 1000
    # the latencies' and the hand-offs' spreads within 3.5% (the dispatch's: 0.98); the slow
    # stretches' 1.07 (their quantiles are given the niced work, a fit of it; 1.06 with the steps
    # beside others priced as those alone)
    assert [cal[f"{k}_spread"] for k in ("dispatch", "first_token", "finish", "handoff")] == \
        pytest.approx([1.0] * 4, abs=0.035)
    assert cal["slow_spread"] == pytest.approx(1.0, abs=0.08)
    assert cal["counts"]["decode_steps"] > 100_000 and cal["counts"]["dispatch"] > 1000
    # each latency's states at their fitted levels within 2.5% (the dispatch with the node idle
    # 0.981 when written)
    assert [v for k in ("dispatch", "first_token", "finish") for v in cal["latency_states"][k]] == \
        pytest.approx([1.0] * 3 * len(LatencyState), abs=0.025)


def test_cli_prices_with_a_calibrated_fit(tmp_path, capsys):
    from thinkserve.cluster.cli import main
    fit = json.loads(CPU_FIT_PATH.read_text())
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps({**fit, "calibration": {"decode_steps": 2.0, "prompt_steps": 2.0, "dispatch": 1.0,
                                                       "first_token": 1.0, "finish": 1.0}}))
    tpot = {}
    for name, extra in (("committed", []), ("calibrated", ["--cpu-fit", str(path)])):
        out = tmp_path / name
        assert main(["sim", "--workload", "reasoning", "--policy", "colocated", "--gpus", "2", "--gpu", "cpu",
                     "--model", "tiny-reasoner", "--rate", "2", "--requests", "30", "--seed", "3", "--out", str(out),
                     "--quiet", *extra]) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["runs"][0]["finished"] == 30
        assert res["cpu_fit"] == (str(path) if extra else str(CPU_FIT_PATH))
        tpot[name] = (res["runs"][0]["classes"]["all"]["tpot"]["mean"], res.get("cpu_calibration"))
    # Steps priced twice as dear: each token takes twice as long or more (the same requests; the
    # two engines' steps overlap more, and slow each other).
    assert tpot["calibrated"][0] > 1.9 * tpot["committed"][0]
    assert tpot["committed"][1] is None and tpot["calibrated"][1]["decode_steps"] == 2.0
    assert main(["sim", "--workload", "reasoning", "--gpus", "2", "--gpu", "h200", "--rate", "1",
                 "--cpu-fit", str(path), "--out", str(tmp_path / "x")]) == 2
    assert "--cpu-fit is for --gpu cpu" in capsys.readouterr().err


WARMUP = {"idle_s": 0.5, "edges": [1, 3], "decode": [2.0, 1.5], "prompt": [3.0, 1.2]}


def test_steps_after_a_wake_are_priced_dearer_bucket_by_bucket():
    # 0.1 s per step. Request a at 0 (4 prompt tokens, 6 output tokens) wakes the engine: its
    # prefill is the first step after the wake (x3.0, prompt), decode steps 1 and 2 are in the
    # second bucket (x1.5), steps 3-5 warm (x1): 0.3 + 2 * 0.15 + 3 * 0.1. Request b at 2.0, the
    # engine idle for 1.1 s (over idle_s): woken again, 0.3 then one decode step at x1.5.
    reqs = [SimRequest("a", 0.0, 4, (6,), salt=1), SimRequest("b", 2.0, 4, (2,), salt=2)]
    for bulk in (True, False):
        rec = build(reqs, Deployment("colocated"), cpu(c0=0.1, cores=None, warmup=WARMUP), 1, bulk_decode=bulk).run().records
        assert (rec["a"].first_token, rec["a"].finish) == pytest.approx((0.3, 0.3 + 0.3 + 0.3))
        assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((2.3, 2.45))
    # Idle for less than idle_s: no wake, b's steps are warm.
    close = [SimRequest("a", 0.0, 4, (6,), salt=1), SimRequest("b", 1.2, 4, (2,), salt=2)]
    rec = build(close, Deployment("colocated"), cpu(c0=0.1, cores=None, warmup=WARMUP), 1).run().records
    assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((1.3, 1.4))
    # pd: the decode instance is woken by the hand-off's first decode step, which takes the
    # decode_wake factors (x2.0, then x1.5 for steps 1-2), not the prompt-woken ones (x5).
    pd = {**WARMUP, "decode": [5.0, 5.0], "decode_wake": [2.0, 1.5]}
    rec = build([SimRequest("c", 0.0, 4, (5,), salt=3)], Deployment("pd", prefill_share=0.5),
                cpu(c0=0.1, cores=None, warmup=pd), 2).run().records["c"]
    assert rec.first_token == pytest.approx(0.3)
    assert rec.finish - rec.first_token == pytest.approx(0.2 + 0.15 + 0.15 + 0.1, abs=0.002)   # + the hand-off
    # Two engines on two cores (no contention: co_step 0). Request b at 1.03 s wakes the second
    # engine while the first decodes a: b's decode steps 1-2 run beside the first engine's steps,
    # at the decode_co factor (x2.5, not x1.5), its third warm: 1.03 + 0.3 + 2 * 0.25 + 0.1.
    beside = {**WARMUP, "decode_co": [4.0, 2.5]}
    two = [SimRequest("a", 0.0, 4, (30,), salt=1), SimRequest("b", 1.03, 4, (4,), salt=2)]
    for bulk in (True, False):
        rec = build(two, Deployment("colocated"), cpu(c0=0.1, co_step=0.0, warmup=beside), 2, bulk_decode=bulk).run().records
        assert (rec["b"].first_token, rec["b"].finish) == pytest.approx((1.33, 1.93))
        alone = build(two[1:], Deployment("colocated"), cpu(c0=0.1, co_step=0.0, warmup=beside), 2,
                      bulk_decode=bulk).run().records["b"]
        assert (alone.first_token, alone.finish) == pytest.approx((1.33, 1.73))
    for bad in ({**WARMUP, "edges": [3, 1]}, {**WARMUP, "decode": [2.0]}, {**WARMUP, "idle_s": 0.0},
                {**WARMUP, "decode_wake": [1.0, -1.0]}, {**WARMUP, "decode_co": [1.0]}):
        with pytest.raises(ValueError, match="warmup"):
            cpu(warmup=bad)


def test_fit_finds_the_steps_after_a_wake():
    # One engine: bursts of 150 decode steps (1-8 branches) 0.1 s apart; the k-th step after a
    # wake takes its model's time times the warm-up factor of its bucket. The fit recovers the
    # factors and the coefficients.
    # Every other burst runs beside another engine's steps (others 1): 1.3x (co_step 0.3) and its
    # own warm-up factors.
    rng = random.Random(4)
    truth = [1.8, 1.5, 1.3, 1.2, 1.15, 1.1, 1.05, 1.02]
    truth_co = [2.4, 2.0, 1.6, 1.4, 1.2, 1.1, 1.0, 0.98]
    feats, dur, starts, others, t = [], [], [], [], 0.0
    for burst in range(40):
        co = burst % 2
        for k in range(150):
            nd = rng.randint(1, 8)
            b = int(np.searchsorted(fit_sim_cpu.WARMUP_EDGES, k, side="right"))
            d = (0.002 + 0.0003 * nd) * ((truth_co if co else truth)[b] if b < len(truth) else 1.0) * (1.3 if co else 1.0)
            feats.append([1.0, 0, nd, 0, 0])
            dur.append(d)
            starts.append(t)
            others.append(float(co))
            t += d + 0.0002
        t += 0.1
    feats, dur, starts, others = np.asarray(feats), np.asarray(dur), np.asarray(starts), np.asarray(others)
    zeros = np.zeros(len(dur))
    coeffs, weights, _, _, _, post, _, warm, land, hold = fit_sim_cpu.fit_steps(feats, dur, others, zeros, 2, starts,
                                                                                np.zeros(len(dur), dtype=int), zeros)
    # (the contention is searched before the warm-up is priced: within a step of its grid, and
    # the factors within 1%)
    assert weights["co_step"] == pytest.approx(0.3, abs=0.011)
    assert warm["decode_wake"] == pytest.approx(truth, rel=0.01)    # each burst woken by a decode step
    assert warm["decode_wake_co"] == pytest.approx(truth_co, rel=0.01)
    assert warm["decode"] == warm["decode_co"] == warm["prompt"] == [1.0] * len(truth)    # no prompt steps: none
    assert (coeffs["c0"], coeffs["c_decode"]) == pytest.approx((0.002, 0.0003), rel=0.01)
    assert post == land == [1.0, 1.0] and hold is None     # no prompt steps, no landings


def _machine_cost(sd: float, latency=None) -> LinearCost:
    return LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                      kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, latency=latency,
                      step_noise=[1.0, 1.0], calibration={"machine_sd": sd})


def test_the_machines_own_slowness_slows_a_nodes_steps_and_latencies_together():
    # 0.1 s a step, no contention, no step noise (draws of 1.0); the request is dispatched in
    # 0.25 s, its first and last tokens reach the client 0.1 s and 0.2 s after their steps. With
    # machine_sd 0.3 every step starting in window k of MACHINE_WINDOW_S and every latency drawn
    # then takes m_k times its price: m_k = exp(0.3 z_k - 0.045), z_k the node's standard normal
    # draws in window order (mean 1; written out here).
    from thinkserve.cluster.sim.cost import MACHINE_WINDOW_S
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.2]}
    reqs = [SimRequest("a", 0.0, 4, (60,), salt=1)]
    rng, m = random.Random("machine-0"), []

    def at(t):
        k = int(t // MACHINE_WINDOW_S)
        while len(m) <= k:
            m.append(math.exp(0.3 * rng.gauss(0.0, 1.0) - 0.045))
        return m[k]
    added = 0.25 * at(0.0)
    t = added + 0.1 * at(added)                 # the prefill, priced alone
    first = t + 0.1 * at(t)
    for _ in range(59):
        t += 0.1 * at(t)
    finish = t + 0.2 * at(t)
    sim = build(reqs, Deployment("colocated"), _machine_cost(0.3, lat), 1, step_noise=True).run()
    rec = sim.records["a"]
    assert (rec.first_token, rec.finish) == pytest.approx((first, finish)) and len(set(m)) > 2
    assert sim.instances[0].num_runs >= len(m) - 1      # a run ends at each window's end
    # Without step noise, or with machine_sd 0, nothing is slowed.
    plain = (0.25 + 0.1 + 0.1, 0.25 + 60 * 0.1 + 0.2)
    for sim in (build(reqs, Deployment("colocated"), _machine_cost(0.3, lat), 1).run(),
                build(reqs, Deployment("colocated"), _machine_cost(0.0, lat), 1, step_noise=True).run()):
        assert (sim.records["a"].first_token, sim.records["a"].finish) == pytest.approx(plain)
    # The factor's mean over the draws is 1 (the calibration's speeds stay the mean).
    cost = _machine_cost(0.4)
    z = np.linspace(-8, 8, 20001)
    w = np.exp(-z * z / 2) / math.sqrt(2 * math.pi) * (z[1] - z[0])
    assert sum(cost.machine(v) * p for v, p in zip(z, w)) == pytest.approx(1.0, abs=1e-6)
    assert _machine_cost(0.0).machine(2.0) == 1.0
    for bad in (-0.1, 1.5, "0.2"):
        with pytest.raises(ValueError, match="machine_sd"):
            _machine_cost(bad)


def test_calibration_measures_the_machines_own_slowness():
    # Windows whose decode steps and frontend latencies share a lognormal slowness (sd 0.2, mean
    # 1) beside their own independent noise (sd 0.1 each): the covariance of the two recovers
    # it; with nothing shared, about 0. Each run is taken against its own mean.
    rng = np.random.default_rng(0)

    def runs(shared):
        out = []
        for _ in range(4):
            m = np.exp(shared * rng.standard_normal(150) - shared ** 2 / 2)
            out.append(np.column_stack([m * np.exp(0.1 * rng.standard_normal(150)) * 1.3,
                                        m * np.exp(0.1 * rng.standard_normal(150))]))
        return out
    sd, windows = fit_sim_cpu.machine_sd(runs(0.2))
    assert sd == pytest.approx(0.2, abs=0.03) and windows == 600
    assert fit_sim_cpu.machine_sd(runs(0.0))[0] < 0.04
    assert fit_sim_cpu.machine_sd([]) == (0.0, 0)
    # machine_windows: two windows of 2 s; decode steps of 1 ms priced 1 ms in the first, 2 ms
    # in the second (each over the run's 1.5); latencies at their fit's mean, then at 3x (each
    # over the windows' mean, 2); the window with too few steps and latencies is left out.
    w = fit_sim_cpu.MACHINE_WINDOW_S
    starts = np.concatenate([np.linspace(0.0, w * 0.9, 30), np.linspace(w, w * 1.9, 30), [w * 2.5]])
    dur = np.concatenate([np.full(30, 1e-3), np.full(30, 2e-3), [1e-3]])
    price = np.full(61, 1e-3)
    lat = {"dispatch_s": [(0.1 * i, 1.0) for i in range(6)] + [(w + 0.1 * i, 3.0) for i in range(6)] + [(w * 2.5, 1.0)]}
    rows = fit_sim_cpu.machine_windows(starts, dur, price, lat)
    ratio = dur.sum() / price.sum()
    assert rows == pytest.approx(np.array([[1.0 / ratio, 0.5], [2.0 / ratio, 1.5]]))
    # On record: the slow, changing hour of 2026-12-04 against a quiet hour of 2026-12-03.
    fit = json.loads(CPU_FIT_PATH.read_text())
    slow = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "long-20261204/mixed-seed122.json.gz"))
    quiet = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "repeat-20261203/mixed-seed100.B.json.gz"))
    assert slow["machine_sd"] > 0.15 and quiet["machine_sd"] < 0.05 and slow["counts"]["machine_sd"] > 80


def test_a_replayed_machine_series_prices_every_step_and_latency_at_its_factor():
    # The machine's speed as a probe measured it during a run (``Simulator(machine=...)``): 1.0
    # until 1 s, 2.0 until 2 s, then 0.5 to the end; an input like the outside work, with or
    # without step noise (none drawn here), in place of the drawn machine_sd. Written out: each
    # step and each latency takes the factor at its start.
    lat = {"dispatch_s": [0.25], "first_token_s": [0.1], "finish_s": [0.2]}
    series = [(0.0, 1.0), (1.0, 2.0), (2.0, 0.5)]

    def at(t):
        return 0.5 if t >= 2.0 else 2.0 if t >= 1.0 else 1.0
    added = 0.25
    t = added + 0.1                             # the prefill
    first = t + 0.1 * at(t)
    for _ in range(29):
        t += 0.1 * at(t)
    finish = t + 0.2 * at(t)
    reqs = [SimRequest("a", 0.0, 4, (30,), salt=1)]
    for noise, sd in ((False, 0.0), (True, 0.3)):
        sim = build(reqs, Deployment("colocated"), _machine_cost(sd, lat), 1, step_noise=noise, machine=series).run()
        assert (sim.records["a"].first_token, sim.records["a"].finish) == pytest.approx((first, finish))
    for bad in ([(0.0, 0.0)], [(1.0, 1.0), (0.5, 1.0)]):
        with pytest.raises(ValueError, match="machine"):
            build(reqs, Deployment("colocated"), _machine_cost(0.0, lat), 1, machine=bad)


def test_the_probe_beside_a_run_gives_the_machines_speed_over_the_calibrations():
    # probe_windows: the probe's median per window of MACHINE_WINDOW_S up to the run's last
    # step's end; a window with too few samples takes the others' mean.
    w = fit_sim_cpu.MACHINE_WINDOW_S
    trace = {"instances": {"mixed-0": {"steps": [[0.0, 0.001, 0, 0, 1, 10], [3 * w - 0.5, 0.001, 0, 0, 1, 10]]}},
             "machine_probe": [[0.1, 2.0], [0.2, 2.0], [0.3, 4.0], [w + 0.1, 3.0], [w + 0.2, 3.0], [w + 0.3, 3.0],
                               [2 * w + 0.1, 9.0]]}
    assert fit_sim_cpu.probe_windows(trace) == pytest.approx([2.0, 3.0, 2.5])
    assert np.asarray(fit_sim_cpu.machine_series(trace, 2.5)) == pytest.approx(
        np.array([[0.0, 0.8], [w, 1.2], [2 * w, 1.0]]))
    assert fit_sim_cpu.probe_windows({"instances": {}}) is None
    assert fit_sim_cpu.machine_series({"instances": {}}, 1.0) == []
    # calibrate: the probe's level over a recorded run's windows; none for a run without the probe.
    fit = json.loads(CPU_FIT_PATH.read_text())
    run = fit_sim_cpu.load_trace(DATA / "machine-20261204/mixed140.json.gz")
    cal = fit_sim_cpu.calibrate(fit, run)
    assert cal["probe_ms"] == pytest.approx(float(fit_sim_cpu.probe_windows(run).mean()))
    assert 1.0 < cal["probe_ms"] < 5.0 and cal["counts"]["probe_ms"] > 25
    assert "probe_ms" not in fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "machine-20261204/pd134.json.gz"))


def test_calibration_prices_each_step_and_latency_at_the_probes_factor():
    # machine_factor_at: the factor the simulator's machine_at gives at each time (the series
    # above: 0.8, 1.2, 1.0 from 0, w, 2w; 1 before its start, its last after its end).
    w = fit_sim_cpu.MACHINE_WINDOW_S
    trace = {"instances": {"mixed-0": {"steps": [[0.0, 0.001, 0, 0, 1, 10], [3 * w - 0.5, 0.001, 0, 0, 1, 10]]}},
             "machine_probe": [[0.1, 2.0], [0.2, 2.0], [0.3, 4.0], [w + 0.1, 3.0], [w + 0.2, 3.0], [w + 0.3, 3.0],
                               [2 * w + 0.1, 9.0]]}
    at = fit_sim_cpu.machine_factor_at(trace, 2.5)
    assert at(np.array([-1.0, 0.5, w + 0.1, 2 * w + 0.1, 10 * w])) == pytest.approx([1.0, 0.8, 1.2, 1.0, 1.0])
    assert fit_sim_cpu.machine_factor_at({"instances": {}}, 2.5)(np.array([0.5, 9.0])) == pytest.approx([1.0, 1.0])
    # On record: pd seed 172's run A (2026-12-04 23:3x UTC) ran its decode steps ~2.5x slower for
    # 20 s, and so did the probe beside it. Priced at the probe's factor, as a simulation prices
    # them, the slow stretches spread 1.6x the fit's; read without the probe (a copy of the run
    # without it), that slow spell made them 4.4x, and a simulation of run B at that spread priced
    # its TPOT ~10x the real one.
    fit = json.loads(CPU_FIT_PATH.read_text())
    run = fit_sim_cpu.load_trace(DATA / "long-probe-20261204/pd172.json.gz")
    with_probe = fit_sim_cpu.calibrate(fit, run)
    without = fit_sim_cpu.calibrate(fit, {k: v for k, v in run.items() if k != "machine_probe"})
    assert with_probe["slow_spread"] < 2.0 < 4.0 < without["slow_spread"]
    assert with_probe["machine_sd"] < 0.15 < 0.4 < without["machine_sd"]


def _normal_scores_corr(u: list[float], lag: int) -> float:
    from statistics import NormalDist
    z = np.array([NormalDist().inv_cdf(v) for v in u])
    return float(np.corrcoef(z[:-lag], z[lag:])[0, 1])


def test_persistent_draws_keep_their_distribution_and_persist_over_time():
    # rho 0.6 shared with an Ornstein-Uhlenbeck process of 0.5 s, a draw every 0.1 s: uniform
    # draws whose normal scores correlate 0.6 exp(-gap / 0.5) — 0.491 one draw apart, 0.221 five
    # apart, about 0 forty apart; two draws at the same time 0.6.
    from statistics import NormalDist
    from thinkserve.cluster.sim.simulator import _Persistent
    clock = iter(np.arange(40000) * 0.1)
    draws = _Persistent(random.Random(1), random.Random(2), 0.6, 0.5, lambda: next(clock))
    u = [draws.random() for _ in range(40000)]
    assert np.quantile(u, [0.1, 0.5, 0.9]) == pytest.approx([0.1, 0.5, 0.9], abs=0.02)
    assert _normal_scores_corr(u, 1) == pytest.approx(0.6 * math.exp(-0.2), abs=0.03)
    assert _normal_scores_corr(u, 5) == pytest.approx(0.6 * math.exp(-1.0), abs=0.03)
    assert abs(_normal_scores_corr(u, 40)) < 0.03
    pairs = [_Persistent(random.Random(f"z{i}"), random.Random(f"e{i}"), 0.6, 0.5, lambda: 0.0) for i in range(4000)]
    z = np.array([[NormalDist().inv_cdf(p.random()), NormalDist().inv_cdf(p.random())] for p in pairs])
    assert np.corrcoef(z.T)[0, 1] == pytest.approx(0.6, abs=0.04)


def test_persistent_slow_stretches_are_drawn_in_window_order():
    # The slow-stretches case above (1-3 per window of 1 s, 0.1 s a step) with slow_rho 0.5 and
    # slow_tau_s 2: window k's draw is Phi(sqrt(0.5) z_k + sqrt(0.5) e_k), z_k = exp(-1 / 2) z_(k-1)
    # + sqrt(1 - exp(-1)) g_k from the engine's "-persist" generator, e_k from its own (written
    # out here); with slow_rho 0 the draws are the plain ones (the case above).
    from statistics import NormalDist
    reqs = [SimRequest("a", 0.0, 4, (60,), salt=1)]
    spread = LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                        kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                        step_noise=[1.0, 1.0], slow={"window_s": 1.0, "quantiles": [1.0, 3.0]},
                        calibration={"slow_rho": 0.5, "slow_tau_s": 2.0})
    latent, own, m, z = random.Random("slow-mixed-0-persist"), random.Random("slow-mixed-0"), [], None
    keep = math.exp(-0.5)
    t = 0.1
    for _ in range(59):
        k = int(t // 1.0)
        while len(m) <= k:
            z = latent.gauss(0.0, 1.0) if z is None else keep * z + math.sqrt(1 - keep * keep) * latent.gauss(0.0, 1.0)
            u = NormalDist().cdf(math.sqrt(0.5) * z + math.sqrt(0.5) * own.gauss(0.0, 1.0))
            m.append((1.0 + 2.0 * u) * math.log(3.0) / 2.0)
        t += 0.1 * m[k]
    sim = build(reqs, Deployment("colocated"), spread, 1, step_noise=True).run()
    assert sim.records["a"].finish == pytest.approx(t) and len(set(m)) > 3
    for bad in ({"slow_rho": 1.0, "slow_tau_s": 1.0}, {"slow_rho": 0.3, "slow_tau_s": 0.0},
                {"latency_rho": -0.1, "latency_tau_s": 1.0}):
        with pytest.raises(ValueError, match="_rho"):
            LinearCost(TINY_REASONER, {"c0": 0.1, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                       kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, calibration=bad)


def test_a_nodes_frontend_latencies_and_prompt_steps_run_slow_together():
    # latency_rho 0.9, latency_tau_s 0.1 s: one node's latencies (and its steps with prompt
    # tokens) take their draws from one persistent process, so a request's dispatch and its first
    # token's delivery ~20 ms later move together (0.9 exp(-0.2): 0.74 on normal scores), requests
    # 0.3 s apart hardly (0.04); with latency_rho 0 they are the shared generator's independent
    # draws.
    lat = {"dispatch_s": list(np.linspace(0.001, 0.021, 21)), "first_token_s": list(np.linspace(0.001, 0.021, 21)),
           "finish_s": [0.001]}
    reqs = [SimRequest(f"r{i}", 0.3 * i, 4, (2,), salt=i + 1) for i in range(400)]

    def parts(rho):
        cost = LinearCost(TINY_REASONER, {"c0": 0.01, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                          kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0, latency=lat,
                          calibration={"latency_rho": rho, "latency_tau_s": 0.1 if rho else 0.0})
        sim = build(reqs, Deployment("colocated"), cost, 1).run()
        d = np.array([sim.records[r.request_id].first_token - r.arrival - 0.01 for r in reqs])   # dispatch + delivery
        return sim, d
    sim, both = parts(0.9)
    assert type(sim._latency_draws(0)).__name__ == "_Persistent"
    plain_sim, plain = parts(0.0)
    assert plain_sim._latency_draws(0) is plain_sim._latency_rng
    # each part uniform on 1-21 ms: the sum's mean 22 ms either way, its spread wider when they move together
    assert both.mean() == pytest.approx(0.022, abs=0.0015) and plain.mean() == pytest.approx(0.022, abs=0.0015)
    assert both.std() > 1.2 * plain.std()


def test_calibration_measures_how_draws_persist():
    # persistence: pairs of normal scores from the model itself (rho 0.5, tau 0.3 s, windows of
    # 0.1 s; an engine's windows as slow_windows keys them) recover it; independent ones give
    # about none.
    from statistics import NormalDist
    rng = np.random.default_rng(3)
    w = fit_sim_cpu.SLOW_WINDOW_S

    def engine_windows(rho, tau, n=3000, engine=0):
        keep, z, out = math.exp(-w / tau), rng.standard_normal(), []
        for _ in range(n):
            z = keep * z + math.sqrt(1 - keep * keep) * rng.standard_normal()
            out.append(math.sqrt(rho) * z + math.sqrt(1 - rho) * rng.standard_normal())
        return np.exp(0.2 * np.array(out)), engine * (1 << 32) + np.arange(n)
    runs = [fit_sim_cpu.slow_pairs(*engine_windows(0.5, 0.3, engine=e)) for e in (0, 1)]
    rho, tau, used = fit_sim_cpu.persistence(runs)
    assert rho == pytest.approx(0.5, abs=0.08) and tau == pytest.approx(0.3, rel=0.3)
    assert used == 2 * sum(3000 - lag for lag in range(1, round(fit_sim_cpu.LATENT_MAX_GAP_S / w) + 1))
    assert fit_sim_cpu.persistence([fit_sim_cpu.slow_pairs(*engine_windows(0.0, 0.3))])[0] < 0.05
    assert fit_sim_cpu.persistence([]) == (0.0, 0.0, 0)
    # slow_pairs: only windows of the same engine, lags of whole windows (a missing window skipped)
    ratio, keys = np.array([1.0, 2.0, 3.0] * 4), np.array([0, 1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    gaps, products = fit_sim_cpu.slow_pairs(ratio, keys)
    z = fit_sim_cpu.normal_scores(ratio)
    most = round(fit_sim_cpu.LATENT_MAX_GAP_S / w)
    expected = [((b - a) * w, z[i] * z[j]) for i, a in enumerate(keys) for j, b in enumerate(keys) if 0 < b - a <= most]
    assert np.array(sorted(zip(gaps, products))) == pytest.approx(np.array(sorted(expected)))
    two = fit_sim_cpu.slow_pairs(np.ones(24), np.concatenate([np.arange(12), (1 << 32) + np.arange(12)]))[0]
    assert len(two) == 2 * sum(12 - lag for lag in range(1, 12))        # no pair across the two engines
    assert fit_sim_cpu.normal_scores(np.array([3.0, 1.0, 2.0])) == pytest.approx(
        [NormalDist().inv_cdf(5 / 6), NormalDist().inv_cdf(1 / 6), 0.0])
    # latency_pairs: each group's normal scores, pairs from LATENT_MIN_GAP_S to LATENT_MAX_GAP_S apart
    grouped = {("dispatch_s", 0): [(0.1 * i, float(i)) for i in range(10)],
               ("finish_s", 0): [(0.1 * i + 0.001, float(10 - i)) for i in range(10)],
               ("first_token_s", 0): [(0.0, 1.0)] * 3}                  # too few: left out
    gaps, products = fit_sim_cpu.latency_pairs(grouped)
    assert len(gaps) == 190 - 10 and gaps.min() >= fit_sim_cpu.LATENT_MIN_GAP_S   # the ten pairs 1 ms apart dropped
    # On record: 2026-12-04's fresh sessions against a quiet hour of 2026-12-03.
    fit = json.loads(CPU_FIT_PATH.read_text())
    cal = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "fresh-probe-20261204/mixed148.B.json.gz"))
    assert 0.1 < cal["latency_rho"] < 0.3 and 0.3 < cal["slow_rho"] < 0.7 and cal["counts"]["slow_rho"] > 10000
    assert cal["latency_tau_s"] > 0 and cal["slow_tau_s"] > 0


def test_calibration_measures_the_per_sequence_work_within_each_window():
    # Decode steps of 1-6 sequences priced c0 + c_decode n + c_ctx ctx; measured: the fixed part
    # as priced, the per-sequence part g times, the whole times a slowness per 1 s window that
    # grows with the window's batch sizes (a slow machine piles up requests). Compared within
    # windows, the per-sequence factor comes out at g whatever the windows' slowness; 1 for g 1.
    coef = np.array([0.001, 0.0, 0.0002, 1e-6, 0.0])
    rng = np.random.default_rng(5)

    def run(g):
        n_steps = 6000
        starts = np.arange(n_steps) * 0.002
        window = np.floor(starts / fit_sim_cpu.PER_SEQ_WINDOW_S).astype(int)
        base_n = rng.integers(1, 4, window.max() + 1)          # each window's typical batch
        n = np.clip(base_n[window] + rng.integers(0, 3, n_steps), 1, 6).astype(float)
        ctx = n * rng.uniform(100, 600, n_steps)
        feats = np.column_stack([np.ones(n_steps), np.zeros(n_steps), n, ctx, np.zeros(n_steps)])
        fixed, per = coef[0] * np.ones(n_steps), coef[2] * n + coef[3] * ctx
        slow = (1.0 + 0.25 * base_n)[window]                     # bigger batches in slower windows
        dur = (fixed + g * per) * slow * np.exp(0.05 * rng.standard_normal(n_steps))
        return feats, dur, np.full(n_steps, 99), np.ones(n_steps), np.zeros(n_steps), starts, np.zeros(n_steps)
    g, steps = fit_sim_cpu.decode_per_seq(coef, [run(1.8)], warm_buckets=8)
    assert g == pytest.approx(1.8, rel=0.05) and steps == 6000
    assert fit_sim_cpu.decode_per_seq(coef, [run(1.0)], warm_buckets=8)[0] == pytest.approx(1.0, abs=0.05)
    # (steps inside the warm-up, or too few of them: 1)
    assert fit_sim_cpu.decode_per_seq(coef, [run(1.8)], warm_buckets=100) == (1.0, 0)
    # LinearCost prices the per-sequence terms at it, before the decode steps' factor.
    plain = cpu(c0=0.001, c_decode=0.0002, c_ctx=1e-6, cores=None)
    twice = LinearCost(TINY_REASONER, {"c0": 0.001, "c_prefill": 0.0, "c_decode": 0.0002, "c_ctx": 1e-6, "c_mixed": 0.0},
                       kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                       calibration={"decode_per_seq": 2.0, "decode_steps": 0.8})
    shape = BatchShape(num_decode=4, decode_ctx=1000)
    assert plain.step_time(shape) == pytest.approx(0.001 + 0.0008 + 0.001)
    assert twice.step_time(shape) == pytest.approx(0.8 * (0.001 + 2 * (0.0008 + 0.001)))
    assert twice.decode_run(4, 1000).time(3) == pytest.approx(
        sum(0.8 * (0.001 + 2 * (0.0008 + 1e-6 * (1000 + 4 * j))) for j in range(3)))
    with pytest.raises(ValueError, match="decode_per_seq"):
        LinearCost(TINY_REASONER, {"c0": 0.001, "c_prefill": 0.0, "c_decode": 0.0, "c_ctx": 0.0, "c_mixed": 0.0},
                   kv_capacity_tokens=16 * 64, transfer_bw=1e9, transfer_latency_s=0.0,
                   calibration={"decode_per_seq": 0.0})
    # On record: 2026-12-04's fresh sessions (per-sequence work ~1.5-2x the fit's).
    fit = json.loads(CPU_FIT_PATH.read_text())
    cal = fit_sim_cpu.calibrate(fit, fit_sim_cpu.load_trace(DATA / "fresh-probe-20261204/pd154.B.json.gz"))
    assert 1.3 < cal["decode_per_seq"] < 2.0 and cal["counts"]["decode_per_seq"] > 10000
