"""The Conductor driving the orchestrator over real in-process engines (no Ray): a branch that
outgrows its prediction is promoted short_decode -> long_decode with its KV and its greedy
output equals the offline engine's; a prompt prefilled on its short_decode instance (conditional
disaggregation) too; an interactive request whose TTFT target cannot be met is
refused with the reason; finished requests train the predictor."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from test_orchestrator import Cluster, _prompt, _tokens, offline  # noqa: F401  (fixture)
from test_request_state import ByteTokenizer
from thinkserve.cluster.config import ConfigError, parse_config
from thinkserve.cluster.instance import InstanceCore
from thinkserve.cluster.messages import ErrorKind, InstanceInfo, InstanceStats, Member, Membership, StoreInfo
from thinkserve.cluster.orchestrator import Orchestrator
from thinkserve.cluster.request_state import RequestState
from thinkserve.router import Conductor, ConductorConfig, PredictorConfig, SLOClass
from thinkserve.router.snapshot import LONG_DECODE, SERVING, SHORT_DECODE
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.sampling_params import SamplingParams

IDS = ("prefill-0", "short_decode-0", "long_decode-0")
SHORT_PRIOR = tuple(1000.0 if k == 0 else 1.0 for k in range(13))   # "under 16 tokens": P90 = 14


class ConductorCluster(Cluster):
    def __init__(self, model, conductor: Conductor, max_num_seqs: dict[str, int] | None = None, **kw):
        super().__init__(model, ids=IDS, **kw)
        self.orch = Orchestrator(conductor, kv_transport="tcp", drain_timeout_s=30)
        self.max_num_seqs = max_num_seqs or {}      # instance id -> its engine's batch cap (default 16)

    async def add(self, iid):
        # As Cluster.add, with the engines returning hidden states as the cluster config makes them
        # do under the Conductor (prefill: with its result; decode: every 8 tokens).
        pool, role = {"prefill-0": ("prefill", "prefill"), "short_decode-0": ("short_decode", "decode"),
                      "long_decode-0": ("long_decode", "decode")}[iid]
        cfg = EngineConfig(model=self.model, role=role, num_device_blocks=self.blocks, block_size=16,
                           max_num_seqs=self.max_num_seqs.get(iid, 16),
                           hidden_state_interval=0 if role == "prefill" else 8)
        address = await self.store.address()
        core = InstanceCore(iid, pool, cfg, node_id="node", store_address=address, kv_transport="tcp")
        self.cores[iid] = core
        self.members.append(Member(iid, pool, SERVING, core, await core.ready()))
        self.orch.view.apply_membership(Membership(len(self.members), tuple(self.members), (),
                                                   (StoreInfo("node", address, self.store),)))
        self.followers.append(asyncio.get_running_loop().create_task(self.orch.follow(iid)))

    async def submit(self, prompt, params, rid, slo_class="standard") -> RequestState:
        req = RequestState(rid, tuple(prompt), params, 0, self.tokenizer, slo_class=slo_class)
        self.orch.admit(req, None)
        while not req.finished and req.error is None:
            req.changed.clear()
            await asyncio.wait_for(req.changed.wait(), 60)
        await self.orch.learner.idle()      # what it taught the predictor is learned (learner.py)
        return req


def test_promoted_branch_keeps_its_greedy_output_and_frees_every_block(tiny_model, offline):
    conductor = Conductor(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=4096,
                                          promotion_margin=1.0, max_learning_delay_s=0.5))

    async def main():
        cl = await ConductorCluster(tiny_model, conductor, blocks=96).start()
        loop = asyncio.create_task(cl.orch.run_promotions(0.01))
        try:
            sp = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, seed=7)
            req = await cl.submit(_prompt(3), sp, "p0")
            assert req.error is None, req.error
            assert _tokens(req) == offline(_prompt(3), sp)
            assert req.promotions == 1 and req.migrations == 1
            assert req.decode_instances == ["short_decode-0", "long_decode-0"]
            t = req.timings()
            assert (t.promotions, t.migrations) == (1, 1) and 0 < t.predicted_tokens < 16
            c = cl.orch.counters
            assert c.promotions_out == {"short_decode": 1} and c.promotions_in == {"long_decode": 1}
            # its length went back to the predictor, held (80 tokens, under long_threshold 4,096):
            # learned when it would have passed the threshold (ConductorConfig.survivorship_delay)
            assert conductor.held == 1 and conductor.predictor.observed == 0
            # its prefill was measured: the TTFT cost model is refitted from it (40 prompt tokens)
            assert conductor.prefill_fit.measurements == 1 and conductor.prefill_cost != conductor.config.prefill_cost
            # its decode steps were measured on both decode instances (their stats count them) and
            # refitted the TPOT model admission checks against
            for iid in ("short_decode-0", "long_decode-0"):
                st = cl.orch.view.stats[iid]
                assert st.decode_steps > 0 and st.decode_step_seqs >= st.decode_steps and st.decode_step_seconds > 0
            for pool in (SHORT_DECODE, LONG_DECODE):
                assert conductor.decode_fit_of(pool).measurements >= 1
                assert conductor.decode_cost_of(pool) != conductor.config.decode_cost
            # the prefill's hidden state came with the prefilled delta and fed the prediction;
            # decode states came every 8 tokens (on both instances) and trained the decode probe
            hidden = len(req.prefill_hidden)
            assert hidden == 64 and len(req.features.hidden) == hidden      # the tiny Llama's hidden size
            assert [p.tokens for p in req.progress[0]][:3] == [8, 16, 24] and len(req.progress[0]) == 10
            assert conductor.predictor.probe.dense is None and 0 in req.refined     # held: not learned yet
            # its prompt (40 tokens: 2 full blocks) is reported held by its prefill instance and node
            # store; the decode instances it ran on hold it too, but report nothing: placement reads
            # only the caches a prompt can prefill on (Conductor.prefix_pools)
            held = {"prefill-0": 2}, {"node": 2}
            for _ in range(100):
                if cl.orch.prefixes.index().hits(req.block_hashes) == held:
                    break
                await asyncio.sleep(0.02)
            assert cl.orch.prefixes.index().hits(req.block_hashes) == held
            # past its hold (at most max_learning_delay_s), the next finish learns it first: its
            # length and decode states (which train the decode probe); the new one is held
            await asyncio.sleep(0.6)
            second = await cl.submit(_prompt(4), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), "p1")
            assert second.error is None, second.error
            assert conductor.held == 1 and conductor.predictor.observed == 1
            assert conductor.predictor.probe.dense is not None
            await cl.check_free()
        finally:
            loop.cancel()
            await cl.stop()
    asyncio.run(main())


def test_a_locally_prefilled_request_keeps_its_greedy_output_and_frees_every_block(tiny_model, offline):
    """Conditional disaggregation: with a hand-off priced at 1 s the short_decode instance
    prefills the prompts itself (no prefill part, no hand-off); the outputs equal the offline
    engine's, a local part is promoted like a handed-off one, and every block is freed."""
    conductor = Conductor(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=4096,
                                          promotion_margin=1.0, handoff_s=1.0, conditional_disagg=True))

    async def main():
        cl = await ConductorCluster(tiny_model, conductor, blocks=96).start()
        loop = asyncio.create_task(cl.orch.run_promotions(0.01))
        try:
            greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, seed=7)
            best_of = SamplingParams(n=3, max_tokens=12, temperature=0.8, ignore_eos=True, seed=11)
            one, three = await asyncio.gather(cl.submit(_prompt(4), greedy, "l0"), cl.submit(_prompt(5), best_of, "l1"))
            for req, prompt, sp in ((one, _prompt(4), greedy), (three, _prompt(5), best_of)):
                assert req.error is None, req.error
                assert _tokens(req) == offline(prompt, sp)
                assert req.prefill_instance == "short_decode-0"
                t = req.timings()
                assert (t.prefill_instance, t.handoff_ms) == ("short_decode-0", 0.0)
            # 40 tokens against a predicted P90 of 14: the local part was promoted with its KV
            assert one.promotions == 1 and one.decode_instances == ["short_decode-0", "long_decode-0"]
            assert three.decode_instances[0] == "short_decode-0"
            c = cl.orch.counters
            assert c.local_prefills == {"short_decode": 2}
            assert c.promotions_in == {"long_decode": one.promotions + three.promotions}
            # nothing ran on the prefill instance, no hand-off or prefill was measured
            for _ in range(100):        # the first poll lands once the poller starts
                if "prefill-0" in cl.orch.view.stats:
                    break
                await asyncio.sleep(0.02)
            assert cl.orch.view.stats["prefill-0"].generated_tokens == 0
            assert conductor.handoff_fit.measurements == 0 and conductor.prefill_fit.measurements == 0
            # each local prefill's placement-to-first-token time refitted the decode instances' model
            assert conductor.local_prefill_fit.measurements == 2 and cl.orch._local_pending == {}
            await cl.check_free()
        finally:
            loop.cancel()
            await cl.stop()
    asyncio.run(main())


def test_a_request_that_finds_short_decode_full_decodes_in_long_decode(tiny_model, offline):
    """short_decode's engine takes 2 branches (``max_num_seqs``), which the cluster reports with
    the instance (``InstanceInfo``) and placement reads from the snapshot: with one greedy
    request decoding there, a Best-of-2 predicted short does not fit its one free slot and
    decodes in long_decode instead, where a greedy one next to it still fits; outputs equal the
    offline engine's and every block is freed."""
    conductor = Conductor(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=4096))

    async def main():
        cl = await ConductorCluster(tiny_model, conductor, blocks=96, max_num_seqs={"short_decode-0": 2}).start()
        try:
            snap = cl.orch.view.snapshot()
            assert [(i.instance_id, i.max_num_seqs) for i in snap.instances()] == [
                ("prefill-0", 16), ("short_decode-0", 2), ("long_decode-0", 16)]
            long_run = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, seed=7)
            first = asyncio.create_task(cl.submit(_prompt(3), long_run, "g0"))
            for _ in range(500):            # placed: short_decode has 1 of its 2 slots left
                if cl.orch.view.snapshot().instance("short_decode-0").free_slots == 1:
                    break
                await asyncio.sleep(0.01)
            assert cl.orch.view.snapshot().instance("short_decode-0").free_slots == 1
            pair = SamplingParams(n=2, max_tokens=12, temperature=0.8, ignore_eos=True, seed=11)
            greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=5)
            two, one = await asyncio.gather(cl.submit(_prompt(5), pair, "b2"), cl.submit(_prompt(4), greedy, "g1"))
            g0 = await first
            for req, prompt, sp in ((g0, _prompt(3), long_run), (two, _prompt(5), pair), (one, _prompt(4), greedy)):
                assert req.error is None, req.error
                assert _tokens(req) == offline(prompt, sp)
            assert g0.decode_instances == ["short_decode-0"] and two.decode_instances == ["long_decode-0"]
            # placed there (not moved there after short_decode refused the import for room)
            assert (two.decode_pool, one.decode_pool) == ("long_decode", "short_decode")
            assert one.decode_instances == ["short_decode-0"]            # one branch: the free slot
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_a_burst_placed_before_any_hand_off_does_not_oversubscribe_a_decode_batch():
    """Placement counts the decode branches it placed whose hand-off has not happened yet
    (``RequestTable.plan_decode``): with short_decode capped at 2 branches and no decode part
    anywhere yet, a burst of three greedy requests puts two there and spills the third to
    long_decode, a Best-of-2 after them goes to long_decode too; placing a request again takes
    back its own branches first; its hand-off (or its end) releases them. The orchestrator's own
    ``_place`` (what ``drive`` calls), over a ``ClusterView`` fed as polls feed it."""
    conductor = Conductor(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=4096))
    caps = {"prefill-0": 16, "short_decode-0": 2, "long_decode-0": 16}

    async def main():
        orch = Orchestrator(conductor)
        members = tuple(Member(iid, iid.split("-")[0], SERVING, None,
                               InstanceInfo(iid, iid.split("-")[0], "prefill" if iid == "prefill-0" else "decode",
                                            "node", "", 96, 16, 4096, max_num_seqs=caps[iid])) for iid in IDS)
        orch.view.apply_membership(Membership(1, members, ()))
        for iid in IDS:
            orch.view.record_stats(iid, InstanceStats(iid, num_free_blocks=96, num_total_blocks=96))

        def request(rid, n=1):
            req = RequestState(rid, tuple(range(3, 40)), SamplingParams(n=n, max_tokens=12, temperature=0.8 if n > 1
                                                                        else 0.0), 0, ByteTokenizer())
            orch.table.requests[rid] = req
            return req

        def slots():
            snap = orch.view.snapshot()
            return {iid: snap.instance(iid).free_slots for iid in ("short_decode-0", "long_decode-0")}

        burst = [request(f"g{k}") for k in range(3)]
        placed = [orch._place(r) for r in burst]
        assert [(p.decode_pool, [(a.instance_id, a.branch_indices) for a in p.decode]) for p in placed] == [
            ("short_decode", [("short_decode-0", (0,))]), ("short_decode", [("short_decode-0", (0,))]),
            ("long_decode", [("long_decode-0", (0,))])]
        assert slots() == {"short_decode-0": 0, "long_decode-0": 15}
        pair = orch._place(request("b2", n=2))
        assert [(a.instance_id, a.branch_indices) for a in pair.decode] == [("long_decode-0", (0, 1))]
        assert slots() == {"short_decode-0": 0, "long_decode-0": 13}
        # placed again (its prefill instance refused it): its own slot is free to it again
        assert orch._place(burst[1]).decode[0].instance_id == "short_decode-0"
        assert slots() == {"short_decode-0": 0, "long_decode-0": 13}
        # a hand-off releases the plan (its decode part counts instead); a branch that finished
        # on its prefill instance counts nowhere
        orch.table.unplan_decode(burst[0])
        burst[1].branches[0].finish_reason = "length"
        assert slots() == {"short_decode-0": 2, "long_decode-0": 13}
        assert orch._place(request("g3")).decode[0].instance_id == "short_decode-0"
    asyncio.run(main())


def test_a_branch_past_the_long_threshold_is_learned_while_it_decodes(tiny_model):
    """The frontend tells the Conductor once, on the delta that carries a branch past the long
    threshold, and hands what it learned to ``observing_finished`` when the branch ends; the
    learner runs both, in that order, with the frontend's clock (the predictor's pace) and the
    branch's seconds from first token to finish."""
    calls, clocks, decode = [], [], []

    class Recording(Conductor):
        def observe_running(self, features, tokens, now=None):
            learned = super().observe_running(features, tokens, now)
            calls.append(("running", tokens, learned))
            clocks.append(now)
            return learned

        def observing_finished(self, features, output_len, progress=(), at_least=0, now=None, decode_s=None):
            calls.append(("finished", output_len, at_least))
            clocks.append(now)
            decode.append(decode_s)
            return super().observing_finished(features, output_len, progress, at_least, now, decode_s)

    conductor = Recording(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=32))

    async def main():
        cl = await ConductorCluster(tiny_model, conductor, blocks=96).start()
        try:
            sp = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, seed=7)
            req = await cl.submit(_prompt(3), sp, "r0")
            assert req.error is None, req.error
            running = [c for c in calls if c[0] == "running"]
            assert len(running) == 1 and running[0][2] == 33 and 32 < running[0][1] < 80   # passed 32, decoding
            assert req.learned_running == {0: 33}
            assert ("finished", 80, 33) in calls and len(calls) == 2
            assert conductor.predictor.observed == 1
            assert None not in clocks and clocks[0] <= clocks[1] <= time.monotonic()
            assert decode[0] is not None and 0.0 < decode[0] < clocks[1] - clocks[0] + 60.0
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


class _PollTimes:
    """An in-process instance that notes when each of its polls began."""

    def __init__(self, core, times: dict):
        self.core, self.times = core, times

    def __getattr__(self, name):
        return getattr(self.core, name)

    async def poll(self, *args, **kwargs):
        self.times.setdefault(self.core.instance_id, []).append(time.monotonic())
        return await self.core.poll(*args, **kwargs)


def test_instances_that_only_decode_are_polled_at_most_every_decode_poll_interval(tiny_model, offline):
    conductor = Conductor(ConductorConfig(predictor=PredictorConfig(prior=SHORT_PRIOR), long_threshold=4096))
    times: dict[str, list[float]] = {}

    async def main():
        cl = ConductorCluster(tiny_model, conductor, blocks=96)
        cl.orch = Orchestrator(conductor, kv_transport="tcp", drain_timeout_s=30, decode_poll_interval_s=0.05,
                               wrap_instance=lambda core: _PollTimes(core, times))
        await cl.start()
        try:
            # long enough to span several 50 ms intervals however fast the machine decodes
            sp = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True, seed=7)
            req = await cl.submit(_prompt(3), sp, "d0")
            assert req.error is None, req.error
            assert _tokens(req) == offline(_prompt(3), sp)        # every token arrives, in order
            assert req.decode_instances == ["short_decode-0"]
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())
    gaps = {iid: [b - a for a, b in zip(t, t[1:])] for iid, t in times.items()}
    assert len(gaps["short_decode-0"]) >= 3                      # it decoded 299 tokens over several polls
    for iid in ("short_decode-0", "long_decode-0"):              # decode only: 50 ms apart at least
        assert all(g >= 0.05 - 1e-3 for g in gaps[iid]), (iid, gaps[iid])
    # the prefill instance makes first tokens: polled again as soon as a poll returns
    assert len(times["prefill-0"]) >= 2


def test_interactive_request_refused_with_its_reason(tiny_model):
    classes = (SLOClass("interactive", 1e-6, None, 0, admission=True), SLOClass("standard", None, None, 1))
    conductor = Conductor(ConductorConfig(slo_classes=classes))

    async def main():
        cl = await ConductorCluster(tiny_model, conductor).start()
        try:
            sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=7)
            refused = await cl.submit(_prompt(4), sp, "i0", slo_class="interactive")
            assert refused.error is not None and refused.error.kind is ErrorKind.EXHAUSTED
            assert refused.error.message.startswith("interactive TTFT target 0 ms cannot be met: the best prefill "
                                                    "instance (prefill-0, 0 prompt tokens queued) gives ")
            assert cl.orch.counters.admission_refused == 1
            ok = await cl.submit(_prompt(4), sp, "s0", slo_class="standard")
            assert ok.error is None and len(ok.branches[0].token_ids) == 8
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_config_picks_the_conductor_for_three_pools_and_maps_efforts():
    cfg = parse_config({})
    assert isinstance(cfg.make_policy(), Conductor)
    assert type(parse_config({"router": {"policy": "least_loaded"}}).make_policy()).__name__ == "LeastLoadedPolicy"
    mixed = parse_config({"pools": {"prefill": {"replicas": 0}, "short_decode": {"replicas": 0},
                                    "long_decode": {"replicas": 0}, "mixed": {"replicas": 2}}})
    assert type(mixed.make_policy()).__name__ == "LeastLoadedPolicy"
    c = parse_config({"router": {"reasoning_effort_budgets": {"low": 64}, "interactive": {"ttft_ms": 250}}}).make_policy()
    assert c.config.efforts.budget("low") == 64 and c.slo("interactive").ttft_s == 0.25
    assert (c.config.max_promotions, c.config.promotions_per_long_instance, c.predictor.config.steps_per_s) == \
        (8, 0.5, 1.0)
    c = parse_config({"router": {"max_promotions": 2, "promotions_per_long_instance": 1.0,
                                 "predictor_steps_per_s": 4.0}}).make_policy()
    assert [c.promotion_cap(n) for n in (1, 3)] == [2, 3] and c.predictor.config.steps_per_s == 4.0
    with pytest.raises(ConfigError, match="router.promotions_per_long_instance"):
        parse_config({"router": {"promotions_per_long_instance": -1}})
    torch.manual_seed(0)


def test_fresh_deployment_places_the_demo_by_the_shipped_length_predictor(tmp_path):
    """``router.length_predictor: auto`` loads the tiny-reasoner's fitted state (the frontend's
    ``make_policy(model dir)``): the demo's additions and ``collatz(256)=`` (104 tokens) decode in
    short_decode, the long Collatz chain in long_decode. Uninformed (``none``), all start in
    short_decode (cold start); a broken state file is a config error naming the field."""
    import pytest

    from thinkserve.cluster.config import ConfigError
    from thinkserve.cluster.demo import default_jobs, demo_config
    from thinkserve.router import PlacementRequest, features_for
    from thinkserve.router.snapshot import (LONG_DECODE, PREFILL, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot,
                                            PoolSnapshot)
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.tokenizer import Tokenizer

    path = resolve_model_path("tiny-reasoner")
    tok = Tokenizer.from_pretrained(path)
    snap = ClusterSnapshot(tuple(PoolSnapshot(p, (InstanceSnapshot(f"{p}-0", p, num_free_blocks=1000,
                                                                   num_total_blocks=1000),))
                                 for p in (PREFILL, SHORT_DECODE, LONG_DECODE)))
    base = demo_config("tiny-reasoner", 0, "ns")

    def pools(choice: str) -> dict[str, str]:
        cfg = base.model_copy(update={"router": base.router.model_copy(update={"length_predictor": choice})})
        policy = cfg.make_policy(path)
        out = {}
        for job in default_jobs(2048):
            ids = tok.encode(job.prompt)
            f = features_for(ids, policy.config.predictor, max_tokens=job.max_tokens)
            out[job.prompt] = policy.place(PlacementRequest("r", len(ids), job.n, job.max_tokens, features=f),
                                           snap, 0.0).decode_pool
        return out

    fitted = pools("auto")
    assert fitted.pop("collatz(79440)=") == LONG_DECODE          # level 6: a long chain
    assert fitted == {"1+6=": SHORT_DECODE, "610+991=": SHORT_DECODE, "collatz(256)=": SHORT_DECODE,
                      "collatz(128)=": SHORT_DECODE}
    assert set(pools("none").values()) == {SHORT_DECODE}
    (tmp_path / "bad.json").write_text('{"format": "thinkserve-length-predictor/1", "edges": [1]}')
    bad = base.model_copy(update={"router": base.router.model_copy(update={"length_predictor": str(tmp_path / "bad.json")})})
    with pytest.raises(ConfigError, match="router.length_predictor: .*bad.json: length predictor state: edges is"):
        bad.make_policy(path)
