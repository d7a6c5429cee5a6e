"""Prefix affinity from reported blocks: the frontend's prefix index equals what the engines'
prefix caches and the nodes' CPU stores hold (evictions, removals and restarts included), and
the Conductor places a shared-prefix prompt where it is really cached. In process (no Ray): real
engines behind ``InstanceCore``, two nodes each with its own ``StoreHost``."""
from __future__ import annotations

import asyncio

from test_orchestrator import Cluster, _prompt
from thinkserve.cluster.instance import InstanceCore
from thinkserve.cluster.messages import Member, Membership, StoreInfo
from thinkserve.cluster.orchestrator import Orchestrator
from thinkserve.cluster.prefix_tracker import PrefixTracker
from thinkserve.cluster.request_state import RequestState
from thinkserve.cluster.store_actor import StoreHost
from thinkserve.router import Conductor, ConductorConfig
from thinkserve.router.snapshot import SERVING
from thinkserve.workers.block_hash import hash_blocks
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.prefix_journal import PrefixDelta
from thinkserve.workers.sampling_params import SamplingParams

NODES = {"prefill-0": "node-0", "prefill-1": "node-1", "short_decode-0": "node-0"}
SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=7)


# ----------------------------------------------------------------------------- the index alone
def test_tracker_follows_reports_keeps_in_flight_until_settled_and_forgets_holders():
    t = PrefixTracker()
    t.instance_reported("p0", PrefixDelta("e0", 2, True, (1, 2)))
    t.in_flight("part-a", "p1", (1, 2, 3))      # placed on p1, not yet reported
    assert t.index().hits((1, 2, 3))[0] == {"p0": 2, "p1": 3}
    t.instance_reported("p1", PrefixDelta("e1", 1, True, (1,)))
    assert t.index().hits((1, 2, 3))[0] == {"p0": 2, "p1": 3}     # in flight still counts
    t.settled("part-a")                          # p1's report now says alone: only block 1
    assert t.index().hits((1, 2, 3))[0] == {"p0": 2, "p1": 1}
    t.instance_reported("p0", PrefixDelta("e0", 3, False, (), (2,)))    # p0 evicted block 2
    assert t.index().hits((1, 2))[0] == {"p0": 1, "p1": 1}
    assert t.instance_cursor("p0").version == 3 and t.instance_cursor("p9").epoch == ""
    t.store_reported("n0", PrefixDelta("s", 1, True, (1, 2)))
    t.in_flight("part-b", "p0", (1, 2))
    t.forget_instance("p0")                      # removed: reported and in-flight entries go
    t.forget_node("n0")
    assert t.index().hits((1, 2))[0] == {"p1": 1} and t.index().hits((1, 2))[1] == {}
    assert t.blocks == {1: (frozenset({"p1"}), frozenset())}


# ----------------------------------------------------------------------------- the cluster
class TwoNodes(Cluster):
    """Prefill instances on two nodes, each node with its own CPU store; the Conductor places."""

    def __init__(self, model, ids, prefill_blocks=12):
        super().__init__(model, ids=ids, blocks=prefill_blocks)
        self.store.server.stop()                 # Cluster's single store: replaced by one per node
        self.stores = {n: StoreHost(16 * 2**20) for n in ("node-0", "node-1")}
        self.store = self.stores["node-0"]        # Cluster.check_free checks this one
        # Prefix affinity between the prefill instances: no prompt prefills on the decode instance
        # (conditional disaggregation would put some there while its batch is small).
        self.orch = Orchestrator(Conductor(ConductorConfig(conditional_disagg=False)), kv_transport="tcp",
                                 drain_timeout_s=30)
        self.version = 0
        self.pollers: dict[str, asyncio.Task] = {}

    async def _store_infos(self):
        return tuple([StoreInfo(n, await s.address(), s) for n, s in self.stores.items()])

    async def publish(self):
        self.version += 1
        self.orch.view.apply_membership(Membership(self.version, tuple(self.members), (), await self._store_infos()))

    async def start(self):
        for iid in self.ids:
            await self.add(iid)
        for info in await self._store_infos():
            self.followers.append(asyncio.get_running_loop().create_task(
                self.orch.follow_store(info.address, interval_s=0.05)))
        return self

    async def add(self, iid: str):
        role = "prefill" if iid.startswith("prefill") else "decode"
        pool = "prefill" if role == "prefill" else "short_decode"
        node = NODES[iid]
        cfg = EngineConfig(model=self.model, role=role, num_device_blocks=self.blocks if role == "prefill" else 64,
                           block_size=16, max_num_seqs=16)
        core = InstanceCore(iid, pool, cfg, node_id=node, store_address=await self.stores[node].address(),
                            kv_transport="tcp")
        self.cores[iid] = core
        self.members.append(Member(iid, pool, SERVING, core, await core.ready()))
        await self.publish()
        self.pollers[iid] = asyncio.get_running_loop().create_task(self.orch.follow(iid))
        self.followers.append(self.pollers[iid])

    async def remove(self, iid: str):
        """The controller removed it (as after a drain): membership without it."""
        self.members = [m for m in self.members if m.instance_id != iid]
        await self.publish()
        self.orch.instance_left(iid)
        # As the frontend does: the removed incarnation's poller stops with it. Left running, it
        # would keep polling the shut-down engine under the same id, whose reports could then be
        # applied after the id rejoins (below).
        self.pollers.pop(iid).cancel()
        await self.cores.pop(iid).shutdown()

    async def submit(self, prompt, rid) -> RequestState:
        return await self.generate(prompt, SP, rid)

    def cached(self, iid: str) -> set[int]:
        """The truth: the block hashes the engine's prefix cache holds now."""
        return set(self.cores[iid].engine.block_manager._hash_to_block)

    async def reported_equals_truth(self, iid: str):
        for _ in range(200):
            if self.orch.prefixes.reported(iid) == self.cached(iid):
                return
            await asyncio.sleep(0.02)
        assert self.orch.prefixes.reported(iid) == self.cached(iid)

    async def until(self, cond):
        for _ in range(200):
            if cond():
                return
            await asyncio.sleep(0.02)
        assert cond()

    async def stop(self):
        await super().stop()
        await self.stores["node-1"].stop()


def test_index_follows_prefill_eviction_store_and_restart_and_placement_uses_it(tiny_model):
    a, b, c, d = (_prompt(40 + i, 80) for i in range(4))     # 80 tokens: 5 full blocks each
    ha, hd = tuple(hash_blocks(a, 16)), tuple(hash_blocks(d, 16))

    async def main():
        cl = await TwoNodes(tiny_model, ids=("prefill-1", "short_decode-0")).start()
        try:
            idx = lambda: cl.orch.prefixes.index()          # noqa: E731
            # prefilled on prefill-1: its 5 blocks show there, exactly what its engine holds
            assert (await cl.submit(a, "a")).prefill_instance == "prefill-1"
            await cl.reported_equals_truth("prefill-1")
            # the decode instance holds the imported prompt too, but is not asked for reports: no
            # placement reads a holder a prompt cannot prefill on
            assert set(ha) <= cl.cached("short_decode-0")
            assert cl.orch.prefixes.reported("short_decode-0") is None
            assert idx().hits(ha)[0] == {"prefill-1": 5}
            assert cl.orch.prefixes.num_in_flight == 0
            await cl.until(lambda: idx().hits(ha)[1] == {"node-1": 5})      # published after the handoff
            # three more prompts through its 12-block cache evict a's blocks: they stop counting
            for rid, p in (("b", b), ("c", c), ("d", d)):
                await cl.submit(p, rid)
            await cl.reported_equals_truth("prefill-1")
            # only the decode instance (a 64-block cache, unreported) still holds a's prefix
            assert set(ha) <= cl.cached("short_decode-0")
            assert set(ha).isdisjoint(cl.cached("prefill-1")) and idx().hits(ha)[0] == {}
            assert idx().hits(hd)[0] == {"prefill-1": 5}
            assert cl.orch.prefixes.reported("short_decode-0") is None
            await cl.until(lambda: idx().hits(ha)[1] == {"node-1": 5})     # node-1's store still has a
            # a second, idle prefill instance on the other node joins (listed first: ties go to it)
            await cl.add("prefill-0")
            await cl.reported_equals_truth("prefill-0")
            # d's prefix is in prefill-1's device cache: placed there, computed only the new block
            hits_before = cl.cores["prefill-1"].engine.block_manager.num_prefix_hit_blocks
            d2 = await cl.submit(d + _prompt(99, 16), "d2")
            assert d2.prefill_instance == "prefill-1"
            assert cl.cores["prefill-1"].engine.block_manager.num_prefix_hit_blocks - hits_before == 5
            # a's prefix only in node-1's store among the prefill instances (the decode instance's
            # copy cannot take a prefill): placed on prefill-1, which loads it from there
            loaded_before = cl.cores["prefill-1"].host.store_prefix_blocks
            a2 = await cl.submit(a + _prompt(98, 16), "a2")
            assert a2.prefill_instance == "prefill-1"
            assert cl.cores["prefill-1"].host.store_prefix_blocks - loaded_before == 5
            # without a holder the tie goes to prefill-0, the first listed
            assert (await cl.submit(_prompt(97, 80), "x")).prefill_instance == "prefill-0"
            # two new prompts at once: the second sees the first's prompt queued on prefill-0 (the
            # frontend counts it from placement on, the engine's count is a poll behind)
            burst = await asyncio.gather(cl.submit(_prompt(95, 80), "y0"), cl.submit(_prompt(96, 80), "y1"))
            assert [r.prefill_instance for r in burst] == ["prefill-0", "prefill-1"]
            # prefill-1 removed: none of its entries count; back with a fresh engine: full resync
            old_cursor = cl.orch.prefixes.instance_cursor("prefill-1")
            await cl.remove("prefill-1")
            assert idx().hits(hd)[0] == {} and cl.orch.prefixes.reported("prefill-1") is None
            await cl.add("prefill-1")
            await cl.reported_equals_truth("prefill-1")
            assert cl.orch.prefixes.reported("prefill-1") == frozenset()
            # a poller still holding the old incarnation's cursor gets a full resync, not a delta
            res = await cl.cores["prefill-1"].poll(0.01, old_cursor)
            assert res.prefix.full and res.prefix.epoch != old_cursor.epoch
            assert set(res.prefix.added) == cl.cached("prefill-1")
            # node-1's store leaves the membership: its entries go too
            cl.stores_gone = cl.stores.pop("node-1")
            await cl.publish()
            await cl.until(lambda: idx().hits(ha)[1] == {})
            cl.stores["node-1"] = cl.stores_gone
            await cl.check_free()
        finally:
            await cl.stop()
    asyncio.run(main())
