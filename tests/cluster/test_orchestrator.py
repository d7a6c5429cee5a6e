"""The orchestrator without Ray: real engines behind in-process instances (``InstanceCore``, the
same class the ``Instance`` actor runs), real KV transfers between them over TCP, a real CPU KV
store. Greedy outputs must equal the offline engine's and every KV block must be free after."""
from __future__ import annotations

import asyncio

import pytest
import torch

from thinkserve.cluster.instance import InstanceCore
from thinkserve.cluster.messages import Member, Membership, StoreInfo
from thinkserve.cluster.orchestrator import Orchestrator
from thinkserve.cluster.request_state import RequestState
from thinkserve.cluster.store_actor import StoreHost
from thinkserve.router import LeastLoadedPolicy
from thinkserve.router.snapshot import SERVING
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.sampling_params import SamplingParams
from thinkserve.workers.tokenizer import Tokenizer

POOLS = {"prefill-0": ("prefill", "prefill"), "short_decode-0": ("short_decode", "decode"),
         "short_decode-1": ("short_decode", "decode"), "mixed-0": ("mixed", "mixed")}
DISAGGREGATED = ("prefill-0", "short_decode-0", "short_decode-1")


class Cluster:
    """An orchestrator over in-process instances and one store; ``stop()`` frees everything."""

    def __init__(self, model: str, blocks: int = 64, ids=DISAGGREGATED, decode_blocks: int | None = None,
                 store_bytes: int = 16 * 2**20, max_num_seqs: int = 16):
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.store = StoreHost(store_bytes)
        self.decode_blocks = decode_blocks
        self.orch = Orchestrator(LeastLoadedPolicy(long_threshold=4096), kv_transport="tcp", drain_timeout_s=30)
        self.tokenizer = Tokenizer.from_pretrained(model)
        self.cores: dict[str, InstanceCore] = {}
        self.blocks = blocks
        self.followers = []
        self.members: list[Member] = []
        self.ids = ids

    async def start(self):
        for iid in self.ids:
            await self.add(iid)
        # as the frontend does: one poller per store feeds the prefix index (Conductor only)
        self.followers.append(asyncio.get_running_loop().create_task(
            self.orch.follow_store(await self.store.address(), interval_s=0.05)))
        return self

    async def add(self, iid: str):
        await self.join(await self.build(iid))

    async def build(self, iid: str) -> Member:
        """An instance started and ready, not yet a member (the controller publishes it only then)."""
        pool, role = POOLS.get(iid, ("short_decode", "decode"))
        blocks = self.decode_blocks if role == "decode" and self.decode_blocks else self.blocks
        cfg = EngineConfig(model=self.model, role=role, num_device_blocks=blocks, block_size=16,
                           max_num_seqs=self.max_num_seqs)
        core = InstanceCore(iid, pool, cfg, node_id="node", store_address=await self.store.address(),
                            kv_transport="tcp")
        return Member(iid, pool, SERVING, core, await core.ready())

    async def join(self, member: Member):
        iid = member.instance_id
        self.cores[iid] = member.handle
        self.members.append(member)
        # What the controller would publish: the frontend applies it the same way.
        address = await self.store.address()
        self.orch.view.apply_membership(Membership(len(self.members), tuple(self.members), (),
                                                   (StoreInfo("node", address, self.store),)))
        self.followers.append(asyncio.get_running_loop().create_task(self.orch.follow(iid)))

    async def generate(self, prompt, params: SamplingParams, rid: str, **request_kwargs) -> RequestState:
        req = RequestState(rid, tuple(prompt), params, 0, self.tokenizer, **request_kwargs)
        self.orch.admit(req, None)
        while not req.finished and req.error is None:
            req.changed.clear()
            await asyncio.wait_for(req.changed.wait(), 60)
        assert req.error is None, req.error
        return req

    async def check_free(self):
        await self.orch.idle()
        for _ in range(200):        # the last releases land one poll after the final tokens
            stats = [await c.stats() for c in self.cores.values()]
            if all(s.num_free_blocks == s.num_total_blocks and s.num_parts == 0 for s in stats):
                break
            await asyncio.sleep(0.02)
        for c in self.cores.values():
            await c.check_integrity()
            s = await c.stats()
            assert s.num_free_blocks == s.num_total_blocks and s.num_parts == 0, (c.instance_id, s)
        assert self.orch.table.parts == {} and self.orch.table.planned == {}   # no part, no decode plan left
        await self.store.check_integrity()
        assert (await self.store.stats()).pinned_entries == 0     # no swapped or parked KV left behind

    async def stop(self):
        for t in self.followers:
            t.cancel()
        for c in self.cores.values():
            await c.shutdown()
        await self.store.stop()


@pytest.fixture(scope="module")
def offline(tiny_model):
    from thinkserve.workers.engine import LLMEngine
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(tiny_model, num_device_blocks=256)

    def run(prompt, params):
        return {o.index: list(o.token_ids) for o in engine.generate(list(prompt), params)[0].outputs}
    return run


def _prompt(seed: int, n: int = 40) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 250, (n,), generator=g).tolist()


def _tokens(req: RequestState) -> dict[int, list[int]]:
    return {b.index: list(b.token_ids) for b in req.branches}


def test_handoff_and_fan_out_equal_offline_and_free_every_block(tiny_model, offline):
    async def main():
        cl = await Cluster(tiny_model).start()
        try:
            jobs = [(_prompt(i), SamplingParams(n=n, max_tokens=24, temperature=0.0, ignore_eos=True, seed=7))
                    for i, n in enumerate((1, 3, 2, 1))]
            reqs = await asyncio.gather(*(cl.generate(p, sp, f"r{i}") for i, (p, sp) in enumerate(jobs)))
            for (p, sp), req in zip(jobs, reqs):
                assert _tokens(req) == offline(p, sp)
            # Best-of-3 spread its branches over both decode instances (one page set each).
            assert len(reqs[1].decode_instances) == 2
            assert cl.orch.counters.kv_tcp.sends >= 5 and cl.orch.counters.kv_shm.sends == 0
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_a_hand_off_to_a_full_decode_instance_waits_with_its_kv(tiny_model, offline):
    """One decode instance with one batch slot: the second and third hand-offs are refused for
    room while the first decodes; the prefill instance keeps their KV and offers it again, so
    they land once the slot frees, with nothing recomputed and greedy outputs as offline."""
    async def main():
        cl = await Cluster(tiny_model, ids=("prefill-0", "short_decode-0"), max_num_seqs=1).start()
        try:
            sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, seed=7)
            reqs = await asyncio.gather(*(cl.generate(_prompt(i), sp, f"r{i}") for i in range(3)))
            for i, req in enumerate(reqs):
                assert _tokens(req) == offline(_prompt(i), sp)
                assert req.resumes == 0 and req.recomputed_tokens == 0
            assert cl.orch.counters.resumed == 0 and cl.orch.counters.kv_tcp.sends == 3
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_drain_migrates_running_parts_to_the_peer(tiny_model, offline):
    async def main():
        cl = await Cluster(tiny_model, blocks=160).start()     # room on the peer for every part
        try:
            sp = SamplingParams(n=2, max_tokens=96, temperature=0.0, ignore_eos=True, seed=7)
            prompts = [_prompt(10 + i) for i in range(3)]
            tasks = [asyncio.create_task(cl.generate(p, sp, f"d{i}")) for i, p in enumerate(prompts)]
            victim = "short_decode-0"
            while sum(p.instance_id == victim and len(r.branches[p.branches[0]].token_ids) > 4
                      for r, p in cl.orch.table.parts.values()) < 3:
                await asyncio.sleep(0.01)
            moved = await cl.orch.evacuate(victim)
            assert moved == 3 and cl.orch.counters.migrated == moved     # each request had a part there
            assert not cl.orch.table.parts_on(victim)
            reqs = await asyncio.gather(*tasks)
            for p, req in zip(prompts, reqs):
                assert _tokens(req) == offline(p, sp)
            assert any(r.migrations for r in reqs) and cl.orch.counters.resumed == 0   # moved with their KV
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_drain_without_a_peer_parks_in_the_store_and_resumes_on_a_new_instance(tiny_model, offline):
    async def main():
        cl = await Cluster(tiny_model, ids=("prefill-0", "short_decode-0")).start()
        try:
            sp = SamplingParams(n=1, max_tokens=80, temperature=0.0, ignore_eos=True, seed=7)
            prompt = _prompt(33)
            task = asyncio.create_task(cl.generate(prompt, sp, "p0"))
            while not any(p.instance_id == "short_decode-0" and len(r.branches[0].token_ids) > 4
                          for r, p in cl.orch.table.parts.values()):
                await asyncio.sleep(0.01)
            assert await cl.orch.evacuate("short_decode-0") == 1
            req = cl.orch.requests["p0"]
            assert len(req.parked) == 1 and not req.parts
            await cl.add("short_decode-1")                 # capacity returns: the parked KV swaps in
            req = await task
            assert _tokens(req) == offline(prompt, sp)
            assert req.recomputed_tokens == 0 and req.resumes == 1 and not req.parked
            assert req.decode_instances[-1] == "short_decode-1"
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def _preempting_run(tiny_model, offline, store_bytes):
    """Two requests that cannot both fit one decode instance's 12 blocks: one is preempted."""
    async def main():
        cl = await Cluster(tiny_model, ids=("prefill-0", "short_decode-0"), decode_blocks=12,
                           store_bytes=store_bytes).start()
        try:
            sp = SamplingParams(n=1, max_tokens=100, temperature=0.0, ignore_eos=True, seed=3)
            prompts = [_prompt(50 + i) for i in range(2)]
            reqs = await asyncio.gather(*(cl.generate(p, sp, f"k{i}") for i, p in enumerate(prompts)))
            for p, req in zip(prompts, reqs):
                assert _tokens(req) == offline(p, sp)
            stats = await cl.cores["short_decode-0"].stats()
            await cl.check_free()
            return stats, reqs
        finally:
            await cl.stop()
    return asyncio.run(main())


def test_preemption_swaps_to_the_cpu_store_and_recomputes_nothing(tiny_model, offline):
    stats, reqs = _preempting_run(tiny_model, offline, 16 * 2**20)
    assert stats.num_preemptions >= 1
    assert stats.store_swap_outs == stats.num_preemptions and stats.store_swap_refused == 0
    assert stats.recomputed_tokens == 0
    assert all(r.recomputed_tokens == 0 and r.resumes == 0 for r in reqs)


def test_a_full_store_makes_preemption_recompute_with_the_same_output(tiny_model, offline):
    stats, _ = _preempting_run(tiny_model, offline, 4096)     # smaller than one preempted request's KV
    assert stats.num_preemptions >= 1
    assert stats.store_swap_outs == 0 and stats.store_swap_refused == stats.num_preemptions
    assert stats.recomputed_tokens > 0


def test_early_consensus_cancels_branches_frees_their_blocks_and_votes_the_finished(tiny_model, offline):
    """Best-of-8 in waves of 4 under the adaptive rule, every branch answering the same: the vote
    is decided after the first four finish; the rest end with abort (the running ones aborted on
    their instances, the others never started), every block comes back, and the branches that
    ran sampled exactly what one Best-of-8 request samples offline (waves do not change them)."""
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    from thinkserve.router.consensus import Consensus, WavePlan, make_rule
    from thinkserve.workers.sampling_params import branch_seed

    async def main():
        cl = await Cluster(tiny_model).start()
        try:
            prompt = _prompt(21)
            sp = SamplingParams(n=8, max_tokens=24, temperature=1.0, ignore_eos=True, seed=11)
            rule = make_rule("adaptive")
            req = await cl.generate(prompt, sp, "es", consensus=Consensus(8, rule, WavePlan.for_rule(8, rule, 4)),
                                    extractor=lambda text: "42")
            ran = [b.index for b in req.branches if b.finish_reason != "abort"]
            cut = [b.index for b in req.branches if b.finish_reason == "abort"]
            assert len(ran) == 4 and len(cut) == 4 and tuple(cut) == req.consensus.cancelled
            want = offline(prompt, sp)
            for i in ran:
                assert list(req.branches[i].token_ids) == want[i]
                assert want[i] == offline(prompt, sp.replace(n=1, seed=branch_seed(11, i)))[0]
            final = req.final_response().final
            assert (final.answer, final.cancelled_branches, final.early_stop_rule) == ("42", 4, "adaptive")
            assert [(v.answer, tuple(v.branch_indices)) for v in final.votes] == [("42", tuple(ran))]
            assert all(b.finish_reason == pb.FINISH_REASON_ABORT for b in final.branches if b.index in cut)
            assert cl.orch.counters.cancelled_branches == 4
            await cl.check_free()

            # unbeatable with split answers: the result equals the full vote of all 8, and the
            # vote counts only branches that finished
            texts = {i: cl.tokenizer.decode(t) for i, t in want.items()}
            answer_of = {texts[i]: ("b" if i in (1, 4) else "a") for i in range(8)}
            rule = make_rule("unbeatable")
            req = await cl.generate(prompt, sp, "es2", consensus=Consensus(8, rule, WavePlan.for_rule(8, rule, 4)),
                                    extractor=answer_of.get)
            final = req.final_response().final
            ran = [b.index for b in req.branches if b.finish_reason != "abort"]
            assert final.answer == "a" and final.cancelled_branches == 8 - len(ran) >= 1
            assert sum(v.count for v in final.votes) == len(ran)
            assert cl.orch.counters.cancelled_branches == 4 + final.cancelled_branches
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_a_joining_instance_takes_running_parts_through_rebalancing(tiny_model, offline):
    async def main():
        cl = await Cluster(tiny_model, ids=("prefill-0", "short_decode-0"), blocks=128).start()
        try:
            sp = SamplingParams(n=1, max_tokens=400, temperature=0.0, ignore_eos=True, seed=5)
            prompts = [_prompt(70 + i, 60) for i in range(4)]
            # Built before the requests start, so the window rebalancing has (the four decodes) does
            # not depend on how long an engine takes to start on a loaded machine.
            joiner = await cl.build("short_decode-1")
            tasks = [asyncio.create_task(cl.generate(p, sp, f"b{i}")) for i, p in enumerate(prompts)]
            while sum(len(r.branches[0].token_ids) > 4 for r, p in cl.orch.table.parts.values()
                      if p.instance_id == "short_decode-0") < 4:
                await asyncio.sleep(0.01)
            await cl.join(joiner)                            # joins empty while -0 holds every part
            loop = asyncio.create_task(cl.orch.rebalance_loop(0.1, 0.2, max_moves=2))
            reqs = await asyncio.gather(*tasks)
            loop.cancel()
            for p, req in zip(prompts, reqs):
                assert _tokens(req) == offline(p, sp)
            moved = cl.orch.counters.rebalanced.get("short_decode", 0)
            assert moved >= 1 and cl.orch.counters.migrated == moved and cl.orch.counters.resumed == 0
            # every move shows in its request's instances; the joiner took at least one part (a
            # part may also move back once -0's own parts finish and -1 is the fuller one)
            assert sum(r.migrations for r in reqs) == moved
            assert 1 <= sum("short_decode-1" in r.decode_instances for r in reqs) <= moved
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())


def test_moving_a_part_that_just_finished_unpolled_moves_nothing_and_loses_nothing(tiny_model, offline):
    """Rebalancing or a drain may pick a part whose branches finished on its instance since the
    last poll: the instance can no longer export it. The move must leave the part where it is
    (not drop it from the table, which would lose the finish its next poll brings)."""
    async def main():
        cl = await Cluster(tiny_model).start()
        try:
            sp = SamplingParams(n=1, max_tokens=48, temperature=0.0, ignore_eos=True, seed=3)
            prompt = _prompt(91)
            task = asyncio.create_task(cl.generate(prompt, sp, "f0"))
            while True:                 # decoding on a short_decode instance, the handoff over
                found = [(r, p) for r, p in cl.orch.table.parts.values() if p.instance_id.startswith("short_decode")]
                if found and not found[0][0].lock.locked() and len(found[0][0].branches[0].token_ids) >= 2:
                    break
                await asyncio.sleep(0.005)
            req, part = found[0]
            core = cl.cores[part.instance_id]
            gate, real_poll = asyncio.Event(), core.poll

            async def held_poll(*args, **kwargs):   # the frontend's next poll of it waits ...
                await gate.wait()
                return await real_poll(*args, **kwargs)
            core.poll = held_poll
            while core.engine.has_unfinished_requests():    # ... while the engine finishes the part
                await asyncio.sleep(0.01)
            other = next(i for i in cl.cores if i.startswith("short_decode") and i != part.instance_id)
            assert await cl.orch.moves.migrate(req, part, ("short_decode",), target=other) is False
            assert cl.orch.table.parts[part.part_id] == (req, part) and cl.orch.counters.migrated == 0
            gate.set()
            done = await asyncio.wait_for(task, 60)
            assert _tokens(done) == offline(prompt, sp)
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())
