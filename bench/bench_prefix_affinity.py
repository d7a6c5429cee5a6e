"""Prefix affinity from reported blocks vs least-queued prefill placement, same run, same requests.

    python bench/bench_prefix_affinity.py [--workload multiturn|mooncake] [--out DIR]

Two prefill instances on two nodes (each node with its own CPU KV store) and one decode instance,
in process (the ``InstanceCore`` / ``StoreHost`` / ``Orchestrator`` / ``Conductor`` the cluster
runs; no Ray, no gRPC: what differs between the arms is only where prompts are prefilled). The
same open-loop stream at the same times goes to

    (a) ``affinity``: the Conductor with its prefix index fed by the instances' and stores' reports
    (b) ``least_queued``: the same Conductor with ``router.prefix_affinity: false`` (the prefill
        instance with the fewest queued prompt tokens; no prefix hits weighed)

each on fresh instances (cold caches). Workloads (tiny-reasoner, greedy, 8 output tokens):

    multiturn  --sessions chats, --turns turns each, every chat opening with one of --systems
               shared system prompts; turn t+1's prompt is turn t's plus an answer and a new user
               message (the history a chat client resends), turns --interval s apart
    mooncake   a window of the Mooncake conversation trace (../shared/traces), its hash_ids
               mapped to --tokens-per-hash tokens each (equal ids at equal positions = equal
               tokens), arrivals replayed --speedup x faster

Printed: prompt tokens computed on the prefill instances (the rest came from a prefix cache or a
node store), store-loaded tokens, TTFT P50/P99, and the ratio (a)/(b). Written: DIR/results.json
and DIR/prefix-affinity-ttft.png (TTFT CDF of both arms).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

NODES = {"prefill-0": "node-0", "prefill-1": "node-1", "short_decode-0": "node-0"}
MODEL = "tiny-reasoner"
VOCAB = (3, 60)             # tiny-reasoner has 64 ids; leave the special ones alone


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*VOCAB) for _ in range(n)]


def multiturn_jobs(args) -> list[tuple[float, list[int]]]:
    systems = [_tokens(10_000 + g, args.system_tokens) for g in range(args.systems)]
    rng = random.Random(args.seed)
    jobs = []
    for s in range(args.sessions):
        history = list(systems[s % args.systems])
        t = rng.uniform(0, args.interval)
        for turn in range(args.turns):
            history += _tokens(1_000_000 + s * 100 + turn, args.user_tokens)
            jobs.append((t, list(history)))
            history += _tokens(2_000_000 + s * 100 + turn, args.answer_tokens)
            t += args.interval * rng.uniform(0.8, 1.2)
    return sorted(jobs, key=lambda j: j[0])


def mooncake_jobs(args) -> list[tuple[float, list[int]]]:
    path = Path(args.trace)
    rows = [json.loads(line) for line in path.read_text().splitlines()[args.trace_start:args.trace_start + args.requests]]
    t0 = rows[0]["timestamp"]
    cap = args.max_prompt // args.tokens_per_hash
    return [((r["timestamp"] - t0) / 1000.0 / args.speedup,
             [t for h in r["hash_ids"][:cap] for t in _tokens(h, args.tokens_per_hash)]) for r in rows]


async def run_arm(affinity: bool, jobs, args) -> dict:
    import torch

    from thinkserve.cluster.instance import InstanceCore
    from thinkserve.cluster.messages import Member, Membership, StoreInfo
    from thinkserve.cluster.orchestrator import Orchestrator
    from thinkserve.cluster.request_state import RequestState
    from thinkserve.cluster.store_actor import StoreHost
    from thinkserve.router import Conductor, ConductorConfig
    from thinkserve.router.snapshot import SERVING
    from thinkserve.workers.config import EngineConfig
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.sampling_params import SamplingParams
    from thinkserve.workers.tokenizer import Tokenizer

    torch.set_num_threads(1)
    tokenizer = Tokenizer.from_pretrained(resolve_model_path(MODEL))
    stores = {n: StoreHost(args.store_mib * 2**20) for n in ("node-0", "node-1")}
    orch = Orchestrator(Conductor(ConductorConfig(long_threshold=4096)), kv_transport="tcp",
                        prefix_affinity=affinity)
    cores, members, tasks = {}, [], []
    store_infos = tuple([StoreInfo(n, await s.address(), s) for n, s in stores.items()])
    try:
        for iid, node in NODES.items():
            prefill = iid.startswith("prefill")
            cfg = EngineConfig(model=MODEL, role="prefill" if prefill else "decode", block_size=16, max_num_seqs=32,
                               num_device_blocks=args.prefill_blocks if prefill else 512)
            core = cores[iid] = InstanceCore(iid, "prefill" if prefill else "short_decode", cfg, node_id=node,
                                             store_address=await stores[node].address(), kv_transport="tcp")
            members.append(Member(iid, core.pool, SERVING, core, await core.ready()))
        orch.view.apply_membership(Membership(1, tuple(members), (), store_infos))
        loop = asyncio.get_running_loop()
        tasks += [loop.create_task(orch.follow(iid)) for iid in cores]
        tasks += [loop.create_task(orch.follow_store(s.address, interval_s=0.1)) for s in store_infos]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

        async def one(i, at, prompt, start):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            req = RequestState(f"r{i}", tuple(prompt), sp, 0, tokenizer)
            orch.admit(req, None)
            while not req.finished and req.error is None:
                req.changed.clear()
                await asyncio.wait_for(req.changed.wait(), 300)
                req.take_response()         # what the frontend streams (and when: the TTFT)
            return req

        start = time.monotonic() + 0.2
        reqs = await asyncio.gather(*(one(i, at, p, start) for i, (at, p) in enumerate(jobs)))
        wall = time.monotonic() - start
        errors = [r.error for r in reqs if r.error is not None]
        prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
        hit_tokens = sum(cores[i].engine.block_manager.num_prefix_hit_blocks * 16 for i in cores if "prefill" in i)
        store_tokens = sum(cores[i].host.store_prefix_blocks * 16 for i in cores if "prefill" in i)
        ttft = [(r.t_first_token - r.t_admitted) for r in reqs if r.t_first_token is not None]
        return {"requests": len(reqs), "errors": [str(e) for e in errors], "wall_s": wall,
                "prompt_tokens": prompt_tokens, "computed_tokens": prompt_tokens - hit_tokens,
                "device_hit_tokens": hit_tokens - store_tokens, "store_loaded_tokens": store_tokens,
                "per_instance": {i: sum(r.prefill_instance == i for r in reqs) for i in cores if "prefill" in i},
                "ttft_s": ttft}
    finally:
        for t in tasks:
            t.cancel()
        for c in cores.values():
            await c.shutdown()
        for s in stores.values():
            await s.stop()


def _pct(vals, q):
    from thinkserve.cluster.bench_cli import percentile
    return percentile(vals, q)


def plot(results: dict, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm, r in results.items():
        v = sorted(x * 1000 for x in r["ttft_s"])
        ax.plot(v, [(i + 1) / len(v) for i in range(len(v))], label=f"{arm} ({len(v)})")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=("multiturn", "mooncake"), default="multiturn")
    ap.add_argument("--sessions", type=int, default=24)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--systems", type=int, default=3, help="distinct system prompts the sessions share")
    ap.add_argument("--system-tokens", type=int, default=192)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--interval", type=float, default=3.0, help="seconds between a session's turns")
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[1].parent / "shared" / "traces"
                                           / "mooncake_conversation.jsonl"))
    ap.add_argument("--trace-start", type=int, default=0)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens-per-hash", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--speedup", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-blocks", type=int, default=320, help="KV blocks of each prefill instance (16 tokens)")
    ap.add_argument("--store-mib", type=int, default=16, help="CPU KV store per node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of both arms, alternating which goes first")
    ap.add_argument("--out", default="bench_prefix_affinity_out")
    args = ap.parse_args(argv)
    jobs = multiturn_jobs(args) if args.workload == "multiturn" else mooncake_jobs(args)
    print(f"{args.workload}: {len(jobs)} requests over {jobs[-1][0]:.1f}s, "
          f"{sum(len(p) for _, p in jobs)} prompt tokens", flush=True)
    # Warm the process up first (allocator, kernels' first calls, thread pools) on a few requests,
    # so neither measured arm pays for it.
    asyncio.run(run_arm(True, [(0.0, p) for _, p in jobs[:4]], args))
    # Rounds alternate which arm runs first; their samples are pooled per arm.
    results: dict[str, dict] = {}
    arms = [("affinity", True), ("least_queued", False)]
    for rnd in range(args.rounds):
        for arm, affinity in (arms if rnd % 2 == 0 else arms[::-1]):
            print(f"[round {rnd + 1} {arm}] running ...", flush=True)
            r = asyncio.run(run_arm(affinity, jobs, args))
            print(f"[round {rnd + 1} {arm}] {r['requests']} requests, {len(r['errors'])} errors, {r['wall_s']:.1f}s, "
                  f"computed {r['computed_tokens']}, TTFT P50 {_pct(r['ttft_s'], 50) * 1000:.0f} ms "
                  f"P99 {_pct(r['ttft_s'], 99) * 1000:.0f} ms, placed {r['per_instance']}", flush=True)
            if arm not in results:
                results[arm] = r
                continue
            acc = results[arm]
            for k in ("requests", "wall_s", "prompt_tokens", "computed_tokens", "device_hit_tokens",
                      "store_loaded_tokens"):
                acc[k] += r[k]
            acc["errors"] += r["errors"]
            acc["ttft_s"] += r["ttft_s"]
            for i, n in r["per_instance"].items():
                acc["per_instance"][i] += n
    a, b = results["affinity"], results["least_queued"]
    print(f"\n{'':<14}{'computed':>10}{'store':>8}{'TTFT P50':>10}{'TTFT P99':>10}   (prompt tokens; ms)")
    for arm, r in results.items():
        print(f"{arm:<14}{r['computed_tokens']:>10}{r['store_loaded_tokens']:>8}"
              f"{_pct(r['ttft_s'], 50) * 1000:>10.0f}{_pct(r['ttft_s'], 99) * 1000:>10.0f}")
    ratio = lambda k, q=None: (a[k] / b[k]) if q is None else _pct(a["ttft_s"], q) / _pct(b["ttft_s"], q)  # noqa
    print(f"{'ratio a/b':<14}{ratio('computed_tokens'):>10.2f}{'':>8}{ratio('ttft_s', 50):>10.2f}"
          f"{ratio('ttft_s', 99):>10.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    plot(results, str(out / "prefix-affinity-ttft.png"), f"{args.workload}: TTFT, 2 prefill instances")
    print(f"wrote {out}/results.json and prefix-affinity-ttft.png")
    return 1 if a["errors"] or b["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
