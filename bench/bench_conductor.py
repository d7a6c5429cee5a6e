"""Three pools with the Conductor vs one mixed pool, same instance count, same open-loop stream.

    python bench/bench_conductor.py [--rate 2] [--duration 60] [--instances 3] [--out DIR]

The stream is the tiny-reasoner realistic mix (mostly short additions, some long Collatz
chains), Poisson arrivals, every request asking for ``--max-tokens`` (a client cannot know the
length), ``--best-of-share`` of them Best-of-``--best-of`` at temperature 0.8; additions are
INTERACTIVE, Collatz chains STANDARD. The very same requests at the very same times go to

    (a) ``mixed``: ``--instances`` colocated instances, least-loaded FCFS placement, no prediction
    (b) ``pools``: 1 prefill + short_decode + long_decode (the rest of the instances: a third
        short_decode, at least one, the others long_decode), the Conductor (length prediction, placement by predicted cost,
        admission, promotion, SLO priorities)

each on a fresh local Ray instance of its own, one after the other, through gRPC with the load
generator of ``thinkserve bench``. Printed: P50/P99 TTFT and TPOT of the short requests, end-to-end
P99 of the long ones, throughput, refusals, promotions; ratios (b)/(a). Written: ``DIR/results.json``
and a latency CDF PNG per setup. Early consensus is off in both, and every request carries its own
sampling seed, so both setups sample the same branches (equal work).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import random
import sys
import time
from pathlib import Path


def setup_config(kind: str, instances: int, namespace: str, long_nice: int = 0, stream_interval_ms: float = 0.0,
                 short_nice: int = 0, conditional_disagg: bool = False):
    from thinkserve.cluster.config import parse_config
    if kind == "mixed":
        pools = {"prefill": {"replicas": 0}, "short_decode": {"replicas": 0}, "long_decode": {"replicas": 0},
                 "mixed": {"replicas": instances, "num_cpus": 0.5}}
        router = {"policy": "least_loaded"}
    else:
        # Long chains carry most of the decode tokens, so the long pool gets most decode instances.
        decode = instances - 1
        short = max(1, decode // 3)
        pools = {"prefill": {"replicas": 1, "num_cpus": 0.5},
                 "short_decode": {"replicas": short, "num_cpus": 0.5, "nice": short_nice},
                 "long_decode": {"replicas": max(1, decode - short), "num_cpus": 0.5, "nice": long_nice},
                 "mixed": {"replicas": 0}}
        router = {"policy": "conductor", "long_threshold": 256, "conditional_disagg": conditional_disagg}
    return parse_config({
        "model": "tiny-reasoner", "namespace": namespace,
        "engine": {"num_device_blocks": 1024, "max_num_seqs": 64},
        "pools": pools, "router": router,
        "frontend": {"port": 0, "http_port": None, "stream_interval_ms": stream_interval_ms},
        "limits": {"max_queued_requests": 1024, "max_n": 16},
        "store": {"capacity_bytes": 64 * 2**20},
    })


def make_jobs(args):
    from thinkserve.cluster.bench_cli import Job, poisson_times
    from thinkserve.workers.tiny_reasoner import REALISTIC_MIX, prompt_for
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix
    rng = random.Random(args.seed)
    seeds = random.Random(f"sampling-{args.seed}")     # apart: the stream is the same with or without them
    times = poisson_times(args.rate, args.duration, rng)
    jobs = []
    for t, p in zip(times, sample_mix(REALISTIC_MIX, len(times), args.seed)):
        short = p.kind == "add"
        best_of = rng.random() < args.best_of_share
        # A seed per job: a Best-of-N request samples the same branches in both setups (the same work).
        jobs.append(Job(t, "interactive" if short else "standard", prompt_for(p), args.max_tokens,
                        n=args.best_of if best_of else 1, temperature=0.8 if best_of else 0.0,
                        seed=seeds.randrange(2**32)))
    return jobs


def run_setup(kind: str, jobs, args) -> dict:
    import grpc
    import ray

    from thinkserve.cluster.bench_cli import plot_cdf, run_load
    from thinkserve.cluster.deploy import connect, deploy, ray_cpus_needed, teardown
    from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
    from sim_fidelity import debug_state, step_traces, take_traces

    cfg = setup_config(kind, args.instances, f"bench-conductor-{kind}-{os.getpid()}", args.long_decode_nice,
                       args.stream_interval_ms, args.short_decode_nice, args.conditional_disagg)
    say = lambda m: print(f"[{kind}] {m}", flush=True)          # noqa: E731
    connect(None, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), join_running=False,
            settings=cfg.ray, log_to_driver=False)
    deployed = False
    try:
        controller, address = deploy(cfg, progress=say)
        deployed = True
        load_args = argparse.Namespace(temperature=0.0, n=1, timeout=args.timeout)
        done = []

        async def main():
            channel = grpc.aio.insecure_channel(address)
            stub = inference_pb2_grpc.InferenceStub(channel)
            # warm-up: one short and one long request, not measured
            await run_load(stub, jobs[:2], load_args, ())
            if args.trace:
                take_traces(address)            # drop the warm-up's
            t0 = time.monotonic()

            def on_done(rec):
                done.append(rec)
                if len(done) % 20 == 0 or len(done) == len(jobs):
                    say(f"{len(done)}/{len(jobs)} answered after {time.monotonic() - t0:.0f}s")
            records = await run_load(stub, jobs, load_args, (), on_done)
            wall = time.monotonic() - t0
            await channel.close()
            return records, wall, t0
        load_before = os.getloadavg()[0]
        records, wall, t0 = asyncio.run(main())
        say(f"load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
        if args.trace:
            st = debug_state(address, stalls_since_s=t0, step_traces=True)   # one read: stalls and steps
            stalls = [(s.woke_at_s, s.lag_s) for s in st.loop_stalls]
            trace = short_request_trace(jobs, records, step_traces(st), t0, stalls)
            (Path(args.out or ".") / f"conductor-{kind}-trace.json").write_text(json.dumps(trace, indent=1))
            print_trace(kind, trace)
        channel = grpc.insecure_channel(address)
        st = admin_pb2_grpc.AdminStub(channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=30)
        channel.close()
        if args.out:
            plot_cdf(records, str(Path(args.out) / f"conductor-{kind}.png"), f"{kind}: latency CDF")
    finally:
        if deployed:
            teardown(cfg.namespace)
        ray.shutdown()
    return summarize(kind, records, wall, st)


def short_request_trace(jobs, records, traces, t0, stalls=()) -> dict:
    """Where each short request's client-side TTFT went, on the machine's one monotonic clock:
    ``to_engine`` the client's send to its arrival at the engine that made its first token (gRPC,
    the frontend's admission and placement, the Ray call), ``engine`` that arrival to the first
    token's publication (the wait for the step in flight, the queue, the steps), ``back`` the
    publication to the client's receipt (the poll's return, the frontend's stream, gRPC, the load
    generator's loop); ``server`` the frontend's admission to its first message. Per step of the
    engine that made it: how many first tokens that step published (prompts sharing a step).
    ``stalls``: the frontend event loop's stalls (woke at, lag s; ``DebugState.loop_stalls``);
    ``stalled_ms``: how much of the request's way to its first token the loop spent in them."""
    spans = [(at - lag, at) for at, lag in stalls]
    first_steps: dict[tuple[str, int], int] = {}     # (instance, step index) -> first tokens published
    where: dict[str, tuple[str, float, float, int]] = {}    # request id -> (instance, added, first token, step)
    for iid, tr in traces.items():
        starts = [s.start for s in tr.steps]
        for p in tr.parts:
            rid = p.part_id.split("#", 1)[0]
            if p.first_token is None or (rid in where and where[rid][2] <= p.first_token):
                continue
            k = max(0, bisect.bisect_right(starts, p.first_token) - 1)
            where[rid] = (iid, p.added, p.first_token, k)
    for iid, _, _, k in where.values():
        first_steps[iid, k] = first_steps.get((iid, k), 0) + 1
    rows = []
    for job, rec in zip(jobs, records):
        if rec.klass != "interactive" or rec.error or rec.first is None or rec.request_id not in where:
            continue
        iid, added, first_token, k = where[rec.request_id]
        tr = traces[iid]
        waited = sum(1 for s in tr.steps if added <= s.start < first_token)    # steps begun while it waited
        rows.append({"at": round(rec.sent - t0, 4), "n": job.n, "instance": iid,
                     "ttft_ms": round((rec.first - rec.sent) * 1e3, 2),
                     "server_ms": round(rec.server_ms["ttft"], 2) if rec.server_ms else None,
                     "to_engine_ms": round((added - rec.sent) * 1e3, 2),
                     "engine_ms": round((first_token - added) * 1e3, 2),
                     "back_ms": round((rec.first - first_token) * 1e3, 2),
                     "stalled_ms": round(sum(max(0.0, min(b, rec.first) - max(a, rec.sent)) for a, b in spans) * 1e3, 2),
                     "steps_begun": waited, "step_ms": round(tr.steps[k].duration * 1e3, 2) if tr.steps else None,
                     "shared_step": first_steps[iid, k]})
    makers = {r["instance"] for r in rows}
    steps = {iid: [[round(s.start - t0, 5), round(s.duration * 1e3, 3), s.prefill_tokens, s.num_decode]
                   for s in traces[iid].steps if s.start >= t0] for iid in sorted(makers)}
    return {"t0": t0, "short": rows, "steps": steps,        # steps: [start s, ms, prompt tokens, decodes]
            "loop_stalls": [[round(at - lag - t0, 4), round(lag * 1e3, 2)] for at, lag in stalls]}  # [began s, ms]


def print_trace(kind: str, trace: dict) -> None:
    from thinkserve.cluster.bench_cli import percentile
    rows = trace["short"]
    if not rows:
        return
    parts = ("ttft_ms", "server_ms", "to_engine_ms", "engine_ms", "back_ms", "stalled_ms")
    print(f"[{kind}] short requests' TTFT, P50 / P99 (ms): " + ", ".join(
        f"{p[:-3]} {percentile([r[p] for r in rows if r[p] is not None], 50):.1f} / "
        f"{percentile([r[p] for r in rows if r[p] is not None], 99):.1f}" for p in parts))
    lags = [ms for _, ms in trace["loop_stalls"]]
    print(f"[{kind}] frontend loop stalls >= 20 ms during the stream: {len(lags)}, "
          f"{sum(lags):.0f} ms in all, the longest {max(lags, default=0.0):.0f} ms; short requests that "
          f"waited in one: {sum(1 for r in rows if r['stalled_ms'] > 0)} of {len(rows)}")
    shared = [r["shared_step"] for r in rows]
    print(f"[{kind}] first tokens per step that made one: mean {sum(shared) / len(shared):.2f}, max {max(shared)}")
    print(f"[{kind}] the 8 slowest: " + "; ".join(
        f"t={r['at']:.1f}s n={r['n']} {r['ttft_ms']:.0f} = {r['to_engine_ms']:.0f} + {r['engine_ms']:.0f} "
        f"({r['steps_begun']} steps, {r['shared_step']} sharing) + {r['back_ms']:.0f} (stalled {r['stalled_ms']:.0f})"
        for r in sorted(rows, key=lambda r: -r["ttft_ms"])[:8]))


def summarize(kind, records, wall, st) -> dict:
    from thinkserve.cluster.bench_cli import percentile

    def vals(klass, metric):
        return [v for r in records if r.klass == klass and not r.error and (v := getattr(r, metric)()) is not None]
    short, long_ = "interactive", "standard"
    tokens = sum(r.tokens for r in records if not r.error)
    return {
        "setup": kind, "requests": len(records), "errors": sum(1 for r in records if r.error),
        "refused": sum(1 for r in records if r.error == "RESOURCE_EXHAUSTED"),
        "short_ttft_p50_ms": percentile(vals(short, "ttft"), 50) * 1e3,
        "short_ttft_p99_ms": percentile(vals(short, "ttft"), 99) * 1e3,
        "short_tpot_p50_ms": percentile(vals(short, "tpot"), 50) * 1e3,
        "short_tpot_p99_ms": percentile(vals(short, "tpot"), 99) * 1e3,
        "long_e2e_p99_s": percentile(vals(long_, "e2e"), 99),
        "throughput_tok_s": tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "promotions": sum(p.promotions_out for p in st.pools),
        # prompts a short_decode instance prefilled itself (conditional disaggregation)
        "local_prefills": sum(p.local_prefills for p in st.pools),
        # Output tokens each pool generated (prefill instances sample each branch's first token):
        # how the decode work split between the pools.
        "pool_tokens": {p.name: sum(i.generated_tokens for i in p.instances) for p in st.pools if p.instances},
        # Where the short requests' TTFT goes (server Timings, P50 / P99 ms): admission to the
        # prefill's start (placement, queue), the prefill until its result, the server's TTFT;
        # the client's TTFT minus the server's is the gRPC stream and the load generator. The
        # prefill stage and the hand-off are those of the prompts a prefill instance computed (0
        # for the others).
        **{f"short_server_{part}_p{q}_ms": percentile(
            [r.server_ms[part] for r in records if r.klass == short and not r.error and r.server_ms
             and (part not in ("prefill", "handoff") or r.server_ms[part] > 0)], q)
           for part in ("queued", "prefill", "handoff", "ttft") for q in (50, 99)},
        "migrated": st.frontend.migrated_requests,
        # the frontend's event loop over the deployment's life (warm-up included): ``loop_lag.LoopLag``
        "frontend_loop_stalls": st.frontend.loop_stalls, "frontend_loop_lag_max_ms": st.frontend.loop_lag_max_ms,
        "frontend_loop_lag_mean_ms": st.frontend.loop_lag_mean_ms,
    }


ROWS = [("short_ttft_p50_ms", "short TTFT P50 (ms)"), ("short_ttft_p99_ms", "short TTFT P99 (ms)"),
        ("short_tpot_p50_ms", "short TPOT P50 (ms)"), ("short_tpot_p99_ms", "short TPOT P99 (ms)"),
        ("long_e2e_p99_s", "long end-to-end P99 (s)"), ("throughput_tok_s", "throughput (output tok/s)"),
        ("errors", "errors (of which refused)"), ("promotions", "promotions short -> long"),
        ("local_prefills", "prefills on short_decode"),
        ("short_server_queued_p50_ms", "  server: queued P50 (ms)"), ("short_server_queued_p99_ms", "  server: queued P99 (ms)"),
        ("short_server_prefill_p50_ms", "  server: prefill P50 (ms)"),
        ("short_server_prefill_p99_ms", "  server: prefill P99 (ms)"),
        ("short_server_handoff_p50_ms", "  server: hand-off P50 (ms)"),
        ("short_server_handoff_p99_ms", "  server: hand-off P99 (ms)"),
        ("short_server_ttft_p50_ms", "  server: TTFT P50 (ms)"), ("short_server_ttft_p99_ms", "  server: TTFT P99 (ms)"),
        ("frontend_loop_stalls", "frontend loop stalls >= 20 ms"), ("frontend_loop_lag_max_ms", "frontend loop lag max (ms)")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--instances", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--best-of", type=int, default=8)
    ap.add_argument("--best-of-share", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--long-decode-nice", type=int, default=0,
                    help="(b): pools.long_decode.nice, so the long chains yield the shared cores to the "
                         "prefill and short_decode engines (the CPU stand-in for a device per pool)")
    ap.add_argument("--short-decode-nice", type=int, default=0,
                    help="(b): pools.short_decode.nice (below long_decode's: the prefill engine, which makes "
                         "the short requests' first tokens, then has the cores first)")
    ap.add_argument("--stream-interval-ms", type=float, default=0.0,
                    help="frontend.stream_interval_ms in both setups: tokens arriving within it after a streamed "
                         "message go out together (the first token never waits)")
    ap.add_argument("--conditional-disagg", action="store_true",
                    help="(b): router.conditional_disagg on: a short prompt may prefill on its short_decode instance")
    ap.add_argument("--setups", nargs="+", default=["mixed", "pools"], choices=["mixed", "pools"])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--trace", action="store_true",
                    help="also write DIR/conductor-SETUP-trace.json: each short request's TTFT split into client -> "
                         "engine, engine (queue and steps), engine -> client, from the instances' step telemetry")
    args = ap.parse_args(argv)
    if args.instances < 3:
        print("--instances must be >= 3 (one per pool in the three-pool setup)", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    jobs = make_jobs(args)
    print(f"{len(jobs)} requests over {args.duration:.0f}s at {args.rate}/s "
          f"({sum(j.klass == 'interactive' for j in jobs)} short, {sum(j.n > 1 for j in jobs)} Best-of-{args.best_of}); "
          f"{args.instances} instances per setup on {os.cpu_count()} cores; long_decode nice {args.long_decode_nice}, "
          f"short_decode nice {args.short_decode_nice}, conditional disaggregation "
          f"{'on' if args.conditional_disagg else 'off'}, "
          f"stream interval {args.stream_interval_ms:g} ms (both setups); load average {os.getloadavg()[0]:.1f}",
          flush=True)
    results = {kind: run_setup(kind, jobs, args) for kind in args.setups}
    if len(results) == 2:
        a, b = results["mixed"], results["pools"]
        print(f"\n{'':<28} {'(a) mixed FCFS':>16} {'(b) 3 pools + Conductor':>24} {'(b)/(a)':>9}")
        for key, label in ROWS:
            if key == "errors":
                ea, eb = f"{a[key]} ({a['refused']})", f"{b[key]} ({b['refused']})"
                print(f"{label:<28} {ea:>16} {eb:>24}")
                continue
            ratio = b[key] / a[key] if a[key] else float("nan")
            print(f"{label:<28} {a[key]:>16.1f} {b[key]:>24.1f} {ratio:>8.2f}x")
        print(f"output tokens by pool: (a) {a['pool_tokens']}  (b) {b['pool_tokens']}")
    if args.out:
        (Path(args.out) / "conductor.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
