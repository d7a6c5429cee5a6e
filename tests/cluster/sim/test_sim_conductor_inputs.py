"""What the simulator hands the Conductor, as the cluster's frontend does: the prefix index from
the prefill instances' real block managers, measured prefills (``observe_prefill``), and branches
passing the long threshold (``observe_running``)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from thinkserve.cluster.sim.setup import Deployment, build, make_cost
from thinkserve.cluster.sim.workload import ReasoningMix, SimRequest, load_trace

TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "mooncake_conversation.jsonl"


def _shared_prefix_run(affinity: bool):
    # 2 prefill + 1 short + 1 long decode instance. X (unique 4,000-token prompt) takes prefill-0,
    # so A (3 shared 512-token blocks + 100 of its own) goes to the idle prefill-1. When B (A's
    # three blocks + one more) arrives, both prefill instances are idle: least-queued placement
    # takes the first listed (prefill-0); with the prefix index it goes where A's blocks are.
    reqs = [SimRequest("X", 0.0, 4000, (20,), salt=1), SimRequest("A", 0.001, 1636, (20,), hash_ids=(1, 2, 3), salt=2),
            SimRequest("B", 2.0, 2148, (20,), hash_ids=(1, 2, 3, 4), salt=3)]
    return build(reqs, Deployment("conductor", prefill_share=0.5, prefix_affinity=affinity),
                 make_cost("h200", "qwen2.5-7b"), 4, prefix_caching=True).run()


def test_a_shared_prefix_goes_to_the_prefill_instance_that_holds_it():
    on, off = _shared_prefix_run(True), _shared_prefix_run(False)
    for sim in (on, off):
        assert sim.records["X"].placement.prefill_instance == "prefill-0"
        assert sim.records["A"].placement.prefill_instance == "prefill-1"
    assert off.records["B"].placement.prefill_instance == "prefill-0"
    assert on.records["B"].placement.prefill_instance == "prefill-1"
    # B's first 3 x 512 tokens came from A's cached blocks (16-token blocks): fewer computed, sooner.
    hits = {i.instance_id: i.bm.num_prefix_hit_blocks for i in on.pools["prefill"]}
    assert hits == {"prefill-0": 0, "prefill-1": 3 * 512 // 16}
    assert sum(i.bm.num_prefix_hit_blocks for i in off.instances) == 0
    ttft = {name: sim.records["B"].first_token - 2.0 for name, sim in (("on", on), ("off", off))}
    assert ttft["on"] < ttft["off"]
    # The estimate the Conductor placed by counted the hit, and measured its prefill.
    assert on.records["B"].placement.prefill_tokens == 2148 - 3 * 512
    assert off.records["B"].placement.prefill_tokens == 2148
    driver = on.conductor
    assert driver.prefixes.num_in_flight == 0 and not driver.placed_at       # every placement settled
    assert on.policy.prefill_fit.measurements == 3 and off.policy.prefill_fit.measurements == 3
    # The index is what the prefill instances' caches hold (their journals followed to the end).
    driver.snapshot(on)
    for inst in on.pools["prefill"]:
        assert driver.prefixes.reported(inst.instance_id) == frozenset(inst.bm._hash_to_block)


@pytest.mark.skipif(not TRACE.exists(), reason="the Mooncake trace is not in ../shared/traces")
def test_mooncake_replay_computes_fewer_prompt_tokens_with_prefix_affinity():
    reqs = load_trace(TRACE, 300, rate=10.0)
    cost = make_cost("h200", "qwen2.5-7b")
    runs = {aff: build(reqs, Deployment("conductor", prefill_share=0.5, prefix_affinity=aff), cost, 8).run()
            for aff in (True, False)}
    hit_tokens = {aff: sum(i.bm.num_prefix_hit_blocks for i in sim.instances) * sim.block_size
                  for aff, sim in runs.items()}
    total = sum(r.prompt_len for r in reqs)
    assert total - hit_tokens[True] < total - hit_tokens[False]
    assert hit_tokens[True] > 1.5 * hit_tokens[False]
    for sim in runs.values():
        placed = sum(r.refused is None for r in sim.records.values())
        assert all(r.finish is not None or r.refused is not None for r in sim.records.values())
        assert sim.policy.prefill_fit.measurements == placed > 0.8 * len(reqs)
        for inst in sim.instances:
            inst.check_integrity()
            assert not inst.scheduler.requests and inst.assigned_branches == 0


def test_branches_past_the_long_threshold_are_learned_before_they_finish():
    """Every branch that passed the Conductor's long threshold was reported once, while running,
    and nothing is left in the driver's table once all have finished."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(10.0, 200, 5)
    sim = build(reqs, Deployment("conductor", long_threshold=512), cost, 8, max_num_seqs=64)
    learned = []
    observe = sim.policy.observe_running
    sim.policy.observe_running = lambda f, tokens, now: learned.append((tokens, now)) or observe(f, tokens, now)
    sim.run()
    longer = sum(1 for r in reqs for n in r.output_lens if n > 512 + 256)
    assert longer > 20 and len(learned) >= longer        # each passed 512 at a promotion check
    assert all(t > 512 for t, _ in learned)
    # at a promotion round's simulated time (every 0.5 s), in order: the predictor's pace
    assert all(now % 0.5 == 0 for _, now in learned) and [n for _, n in learned] == sorted(n for _, n in learned)
    assert not sim.conductor.reported


def _first_placements(sim, until: float) -> dict[tuple[str, str], int]:
    """(class, decode pool) -> requests arriving before ``until`` placed there."""
    out: dict[tuple[str, str], int] = {}
    for rec in sim.records.values():
        if rec.req.arrival < until:
            key = (rec.req.cls, "refused" if rec.refused is not None else rec.placement.decode_pool)
            out[key] = out.get(key, 0) + 1
    return out


def test_a_warm_predictor_places_long_chains_in_long_decode_from_the_start(tmp_path):
    """A Conductor started from a state fitted on a warm-up trace (same generator, another seed;
    saved and loaded through the predictor's own ``state``/``load_state``) sends long chains to
    long_decode from the first request; a cold one sends everything to short_decode until it has
    seen ``cold_start_requests`` finish."""
    from thinkserve.cluster.sim.conductor_driver import fit_length_predictor
    from thinkserve.cluster.sim.setup import warm_up_workload
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(20.0, 150, 7)
    warm_up = warm_up_workload("reasoning", rate=20.0, requests=1500, skip=0, seed=7, max_model_len=32768)
    simulated = {tuple(r.prompt_tokens()) for r in reqs}
    assert not any(tuple(r.prompt_tokens()) in simulated for r in warm_up)       # disjoint prompts
    path = tmp_path / "length_predictor.json"
    path.write_text(json.dumps(fit_length_predictor(warm_up)))
    state = json.loads(path.read_text())
    dep = Deployment("conductor", long_threshold=2048)
    warm = build(reqs, dep, cost, 8, length_predictor=state)
    assert warm.policy.predictor.state() == state and not warm.policy.cold
    assert warm.policy.predictor.observed == sum(r.n for r in warm_up)
    cold = build(reqs, dep, cost, 8)
    assert cold.policy.cold
    warm.run(), cold.run()
    # Before the first request finishes (short chats take seconds), the cold Conductor has seen
    # no lengths at all.
    first_finish = min(r.finish for r in cold.records.values() if r.finish is not None)
    assert first_finish > 1.0
    early_cold, early_warm = _first_placements(cold, first_finish), _first_placements(warm, first_finish)
    assert set(early_cold) == {("short", "short_decode"), ("long", "short_decode")}
    # The warm one: shorts to short_decode; of the long chains (69% of which pass 2,048 tokens,
    # near the Conductor's 0.5 probability cut) most go to long_decode at once, the rest are
    # left to promotion.
    assert set(early_warm) == {("short", "short_decode"), ("long", "short_decode"), ("long", "long_decode")}
    longs = early_warm[("long", "short_decode")] + early_warm[("long", "long_decode")]
    assert longs == early_cold[("long", "short_decode")] >= 5
    assert early_warm[("long", "long_decode")] > longs / 2
    for sim in (warm, cold):
        assert all(r.finish is not None for r in sim.records.values())
        for inst in sim.instances:
            inst.check_integrity()
            assert not inst.scheduler.requests and inst.assigned_branches == 0


def test_cli_length_predictor_warm_and_a_bad_state_file(tmp_path, capsys):
    from thinkserve.cluster.cli import main
    args = ["sim", "--workload", "reasoning", "--policy", "conductor", "--gpus", "4", "--rate", "4",
            "--requests", "30", "--quiet", "--out", str(tmp_path)]
    assert main(args + ["--length-predictor", "warm", "--warm-up-requests", "200"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["runs"][0]["finished"] == 30
    bad = tmp_path / "state.json"
    bad.write_text('{"format": "something else"}')
    assert main(args + ["--length-predictor", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "--length-predictor" in err and "format must be" in err
    assert main(args + ["--length-predictor", "warm", "--warm-up-requests", "0"]) == 2
    assert "warm-up requests must be >= 1" in capsys.readouterr().err


def test_decode_steps_fit_the_tpot_model_as_the_cluster_does():
    """Every report interval, each instance's decode-only steps since its last report (count,
    seconds, branches; a decode run's steps as each completes) reach ``observe_decode``, as the
    cluster's instance polls do: all the steps the instances ran are reported, and the fitted TPOT
    model gives the measured mean step time at the measured mean batch."""
    cost = make_cost("h200", "qwen2.5-7b")
    reqs = ReasoningMix().generate(10.0, 150, 5)
    sim = build(reqs, Deployment("conductor"), cost, 4, max_num_seqs=64)
    fed, observe = [], sim.policy.observe_decode

    def spy(pool, steps, seconds, seqs):
        fed.append((pool, steps, seconds, seqs))
        return observe(pool, steps, seconds, seqs)
    sim.policy.observe_decode = spy
    prior = sim.policy.config.decode_cost
    sim.run()
    assert all(r.finish is not None or r.refused is not None for r in sim.records.values())
    for pool in ("short_decode", "long_decode"):
        mine = [f[1:] for f in fed if f[0] == pool]
        steps, seconds, seqs = (sum(x) for x in zip(*mine))
        counted = [i.decode_step_totals for i in sim.instances if i.pool == pool]
        assert steps == sum(c[0] for c in counted) > 500
        assert seqs == sum(c[2] for c in counted)
        assert seconds == pytest.approx(sum(c[1] for c in counted), rel=1e-9)
        assert sim.policy.decode_fit_of(pool).measurements == len(mine) > 50
        model = sim.policy.decode_cost_of(pool)
        assert model != prior
        assert model.tpot(seqs / steps) == pytest.approx(seconds / steps, rel=0.1)
    assert {f[0] for f in fed} <= {"short_decode", "long_decode"}    # prefill instances run no decode-only steps
