"""What the simulator hands the Conductor, as the cluster's frontend does: the prefix index from
the prefill instances' real block managers, measured prefills (``observe_prefill``), and branches
passing the long threshold (``observe_running``)."""
from __future__ import annotations

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
    sim.policy.observe_running = lambda f, tokens: learned.append(tokens) or observe(f, tokens)
    sim.run()
    longer = sum(1 for r in reqs for n in r.output_lens if n > 512 + 256)
    assert longer > 20 and len(learned) >= longer        # each passed 512 at a promotion check
    assert all(t > 512 for t in learned)
    assert not sim.conductor.reported
