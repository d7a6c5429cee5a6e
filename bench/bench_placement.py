"""Placement microbenchmark: Conductor decisions per second over a 256-instance cluster, beside
LeastLoadedPolicy in the same run.

Cluster: 64 prefill, 96 short_decode, 96 long_decode instances on 32 nodes, random load (queued
prefill tokens, free blocks, batch sizes) and a prefix index over 2,000 cached prompts.
Requests: prompts of 32-2,048 tokens, 30% sharing a cached prefix, 20% Best-of-8, a third
interactive; each decision predicts the length distribution from hashed n-grams (prepared at
admission, as the frontend does), estimates TTFT on every prefill instance, may refuse, and
places every branch by freeness. Snapshots rotate over 16 different ones (each with its own
prefix index of 256k blocks, so lookups miss the CPU caches as a big index does).
``Conductor.place`` is the decision with the length predicted at admission (as the cluster does
it: once per request); ``predict + place`` includes the prediction. A snapshot is immutable, so
what placement reads of a pool (serving instances as flat columns, ``PoolSnapshot.index``) is
built once per snapshot and shared by the decisions made on it; ``place, fresh snapshot`` builds
a new snapshot object for every decision, so that cost is in every decision. ``place, ClusterView`` is the frontend's path: the snapshot comes from
its ``ClusterView`` each decision, after one instance's stats changed (the view re-makes only
that instance's snapshot and patches its pool's tuple and placement index). Also: ``promotions`` over 512 decoding branches.

    python bench/bench_placement.py            # ~15 s
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time

from thinkserve.router import (BranchProgress, Conductor, ConductorConfig, LeastLoadedPolicy, PlacementRequest,
                               features_for)
from thinkserve.router.lengths import LengthDistribution
from thinkserve.router.snapshot import (LONG_DECODE, PREFILL, SHORT_DECODE, ClusterSnapshot, InstanceSnapshot,
                                        PoolSnapshot, PrefixIndex)

POOLS = ((PREFILL, 64), (SHORT_DECODE, 96), (LONG_DECODE, 96))
MAX_NUM_SEQS = 256      # every engine's batch cap, as the instances report it (batches here: at most 64)


def snapshot(rng: random.Random, cached: list[tuple[int, ...]]) -> ClusterSnapshot:
    pools, k = [], 0
    for name, count in POOLS:
        insts = []
        for _ in range(count):
            insts.append(InstanceSnapshot(
                f"{name}-{k:03d}", name, num_waiting=rng.randint(0, 8), num_running=rng.randint(0, 32),
                num_free_blocks=rng.randint(100, 4000), num_total_blocks=4096,
                assigned_requests=rng.randint(0, 16), assigned_branches=rng.randint(0, 64),
                queued_prefill_tokens=rng.randint(0, 6000), node_id=f"node{k % 32}",
                reserved_blocks=rng.randint(0, 500), num_running_seqs=rng.randint(0, 64),
                max_num_seqs=MAX_NUM_SEQS))
            k += 1
        pools.append(PoolSnapshot(name, tuple(insts)))
    prefills = [i.instance_id for i in pools[0].instances]
    on_inst: dict[int, frozenset[str]] = {}
    in_store: dict[int, frozenset[str]] = {}
    for hashes in cached:
        holders = frozenset(rng.sample(prefills, 2))
        nodes = frozenset({f"node{rng.randrange(32)}"})
        for h in hashes:
            on_inst[h] = holders
            in_store[h] = nodes
    return ClusterSnapshot(tuple(pools), PrefixIndex.merged(on_inst, in_store))


def requests(rng: random.Random, conductor: Conductor, cached, count: int) -> list[PlacementRequest]:
    out = []
    for i in range(count):
        plen = rng.randint(32, 2048)
        tokens = [rng.randrange(32000) for _ in range(min(plen, 256))]
        hashes = ()
        if rng.random() < 0.3:
            hashes = rng.choice(cached)[:plen // 16]
        f = features_for(tokens, conductor.config.predictor, max_tokens=4096)
        f = type(f)(plen, f.ngrams, f.max_tokens, None, None)
        out.append(PlacementRequest(f"r{i}", plen, n=8 if rng.random() < 0.2 else 1, max_tokens=4096,
                                    slo_class=rng.choice(("interactive", "standard", "batch")),
                                    prompt_block_hashes=hashes, features=f))
    return out


def through_view(conductor: Conductor, snap: ClusterSnapshot):
    """The frontend's path: every decision asks the frontend's ``ClusterView`` for the snapshot
    (as ``Orchestrator`` does), after one instance's stats changed (a poll landed: the pool it is
    in gets a new snapshot, the others are reused with their placement indexes)."""
    from thinkserve.cluster.cluster_view import ClusterView
    from thinkserve.cluster.messages import InstanceInfo, InstanceStats, Member, Membership
    from thinkserve.cluster.request_state import RequestTable
    from thinkserve.router.snapshot import POOL_ROLES, SERVING

    view = ClusterView(RequestTable())
    insts = [i for p in snap.pools for i in p.instances]
    view.apply_membership(Membership(1, tuple(
        Member(i.instance_id, i.pool, SERVING, None, InstanceInfo(i.instance_id, i.pool, POOL_ROLES[i.pool], i.node_id,
                                                                  "", i.num_total_blocks, i.block_size, 32768,
                                                                  max_num_seqs=i.max_num_seqs))
        for i in insts), ()))
    for i in insts:
        view.stats[i.instance_id] = InstanceStats(i.instance_id, num_waiting=i.num_waiting, num_running=i.num_running,
                                                  num_free_blocks=i.num_free_blocks,
                                                  num_total_blocks=i.num_total_blocks,
                                                  queued_prefill_tokens=i.queued_prefill_tokens,
                                                  num_running_seqs=i.num_running_seqs)
    # A poll hands the view a new stats record (unpickled off the wire); two per instance,
    # alternated, so the loop times the view and not the building of 24-field records.
    polls = [(iid, (view.stats[iid], dataclasses.replace(view.stats[iid], num_waiting=view.stats[iid].num_waiting ^ 1)))
             for iid in (i.instance_id for i in insts)]
    turn = [0]

    def place(rs):
        k = turn[0]
        turn[0] = k + 1
        iid, pair = polls[k % len(polls)]
        view.record_stats(iid, pair[(k // len(polls) + 1) & 1])     # num_waiting flips every time
        return conductor.place(rs[0], view.snapshot(snap.prefix), 0.0)
    return place


def rate(fn, items, seconds: float) -> float:
    n, t0 = 0, time.perf_counter()
    while True:
        for x in items:
            fn(x)
        n += len(items)
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="per method, over all rounds")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    rng = random.Random(0)
    conductor = Conductor(ConductorConfig())
    cached = [tuple(rng.randrange(1 << 62) for _ in range(128)) for _ in range(2000)]
    snaps = [snapshot(rng, cached) for _ in range(16)]
    reqs = requests(rng, conductor, cached, 1024)
    # Train the predictor a little, so predictions are not the flat prior.
    for r in reqs[:512]:
        conductor.observe_finished(r.features, rng.choice((40, 300, 1500)))
    pairs = [(r, snaps[i % len(snaps)]) for i, r in enumerate(reqs)]
    # The cluster predicts once at admission (Conductor.predict) and hands the distribution in
    # (PlacementRequest.length), so a request re-placed while it waits is not predicted again.
    predicted = [(dataclasses.replace(r, length=conductor.predict(r)), s) for r, s in pairs]
    least = LeastLoadedPolicy()

    view_place = through_view(conductor, snaps[0])

    def fresh(rs):          # the same load in new snapshot objects: no index built yet
        r, snap = rs
        return conductor.place(r, ClusterSnapshot(tuple(PoolSnapshot(p.name, p.instances) for p in snap.pools),
                                                  snap.prefix), 0.0)
    # Interleaved rounds, best round per method: on a shared machine the load changes from one
    # second to the next, and a method measured only in a bad second would look slow.
    methods = (("LeastLoadedPolicy.place", lambda rs: least.place(rs[0], rs[1]), pairs),
               ("Conductor.place", lambda rs: conductor.place(rs[0], rs[1], 0.0), predicted),
               ("Conductor.predict + place", lambda rs: conductor.place(rs[0], rs[1], 0.0), pairs),
               ("Conductor.place, fresh snapshot", fresh, predicted),
               ("Conductor.place, ClusterView", view_place, predicted),
               ("predict", conductor.predict, reqs))
    results: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, fn, items in methods:
            results[name] = max(results.get(name, 0.0), rate(fn, items, args.seconds / args.rounds))
    predict_rate = results.pop("predict")
    outcomes = [conductor.place(r, s, 0.0) for r, s in pairs]
    refused = sum(1 for o in outcomes if o is not None and not hasattr(o, "decode"))
    # promotions over 512 decoding branches in short_decode (a quarter of them overdue)
    edges = conductor.config.predictor.edges
    dists = [LengthDistribution(edges, tuple(1.0 if k == b else 0.0 for k in range(len(edges) + 1)))
             for b in (2, 3, 4, 5)]
    shorts = snaps[0].pool(SHORT_DECODE).instances
    progress = tuple(BranchProgress(f"q{i}", 0, SHORT_DECODE, shorts[i % len(shorts)].instance_id,
                                    rng.randint(10, 600), dists[i % 4], prompt_len=100) for i in range(512))
    promo = rate(lambda s: conductor.promotions(s, progress), snaps, args.seconds)
    base = results["LeastLoadedPolicy.place"]
    print("placement decisions over 256 instances (64 prefill, 96 short, 96 long); shared 2-core machine, "
          f"best of {args.rounds} interleaved rounds")
    for name, r in results.items():
        print(f"  {name:32s} {r:10,.0f} decisions/s   ({r / base:.2f}x LeastLoadedPolicy)")
    print(f"  Conductor.predict alone: {predict_rate:,.0f} predictions/s (once per request, at admission)")
    print(f"  Conductor refusals in the mix: {refused} of {len(outcomes)} (interactive requests over 1 s TTFT)")
    print(f"  Conductor.promotions over 512 branches: {promo:,.0f} calls/s ({promo * 512:,.0f} branches/s)")


if __name__ == "__main__":
    main()
