"""Local cluster vs one in-process engine, on the same requests, in one run.

    python bench/bench_cluster.py [--model tiny-reasoner|PATH] [--requests 48] [--low-load 8]

Prints, for the disaggregated local cluster (1 prefill, 1 short-decode, 1 long-decode instance,
gRPC frontend) and for one in-process ``LLMEngine`` (role mixed) given the same prompts:

* throughput (generated tokens / s) with every request submitted at once,
* TTFT and TPOT, P50 and P99, under that load,
* at low load (one request at a time): TTFT of both, the difference, and the server-side
  split (prefill, prefill → decode KV handoff), i.e. what disaggregation adds to TTFT.

Ratios are against the in-process engine measured in the same run. On a two-core machine the
cluster's four processes share the cores the single engine has to itself, so expect ratios
below 1 there; the point of the run is the shape (where the time goes), not the absolute numbers.
Results also land in bench/results/cluster.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Req:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ttft: float
    tpot: float | None
    tokens: int
    total: float
    server: dict = field(default_factory=dict)
    tt2t: float | None = None        # time to the second token


def pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


def workload(n: int, max_model_len: int) -> list[Req]:
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix, prompt_for
    mix = {1: 0.3, 2: 0.2, 3: 0.2, 4: 0.15, 5: 0.1, 6: 0.05}
    reqs = []
    for p in sample_mix(mix, n, seed=7):
        budget = 96 if p.kind == "add" else min(1600, max_model_len - 32)
        reqs.append(Req(prompt_for(p), budget))
    return reqs


# ----------------------------------------------------------------------------- in-process engine
def run_engine(model: str, reqs: list[Req], engine_kw: dict) -> tuple[list[Result], float]:
    import torch

    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(model, role="mixed", **engine_kw)
    engine.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0))
    t0 = time.perf_counter()
    first, last, count = {}, {}, {}
    for i, r in enumerate(reqs):
        engine.add_request(f"r{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            new = sum(len(c.new_token_ids) for c in o.outputs)
            if new:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
                count[o.request_id] = count.get(o.request_id, 0) + new
    wall = time.perf_counter() - t0
    out = []
    for i in range(len(reqs)):
        rid = f"r{i}"
        n = count.get(rid, 0)
        out.append(Result(first[rid] - t0, (last[rid] - first[rid]) / (n - 1) if n > 1 else None, n, last[rid] - t0))
    return out, wall


def engine_low_load(model: str, reqs: list[Req], engine_kw: dict) -> list[tuple[float, float | None]]:
    import torch

    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(model, role="mixed", **engine_kw)
    engine.generate("warm up", SamplingParams(max_tokens=4, temperature=0.0))
    out = []
    for i, r in enumerate(reqs):
        t0 = time.perf_counter()
        engine.add_request(f"low{i}", r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
        n, first, second = 0, None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                k = sum(len(c.new_token_ids) for c in o.outputs)
                if k:
                    now = time.perf_counter() - t0
                    first = first if first is not None else now
                    if second is None and n + k >= 2:
                        second = now
                    n += k
        out.append((first, second))
    return out


# ----------------------------------------------------------------------------- cluster
def cluster_request(stub, r: Req) -> Result:
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    req = pb.GenerateRequest(text=r.prompt, sampling=pb.SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
    t0 = time.perf_counter()
    first = last = second = None
    n = 0
    final = None
    for msg in stub.Generate(req, timeout=900):
        k = sum(len(d.token_ids) for d in msg.deltas)
        if k:
            now = time.perf_counter()
            first = first or now
            if second is None and n + k >= 2:
                second = now
            last = now
            n += k
        if msg.HasField("final"):
            final = msg
    t = final.timings
    return Result(first - t0, (last - first) / (n - 1) if n > 1 else None, n, last - t0,
                  {"prefill_ms": t.prefill_ms, "handoff_ms": t.handoff_ms, "ttft_ms": t.ttft_ms},
                  tt2t=None if second is None else second - t0)


def run_cluster(model: str, reqs: list[Req], low: list[Req], engine_kw: dict):
    import grpc
    import ray

    from thinkserve.cluster.config import parse_config
    from thinkserve.cluster.deploy import connect, deploy, ray_cpus_needed, teardown
    from thinkserve.protos.thinkserve.v1 import inference_pb2_grpc

    cfg = parse_config({
        "model": model, "namespace": "thinkserve-bench", "engine": engine_kw,
        "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "short_decode": {"replicas": 1, "num_cpus": 0.5},
                  "long_decode": {"replicas": 1, "num_cpus": 0.5}, "mixed": {"replicas": 0}},
        "frontend": {"port": 0, "http_port": None}, "router": {"long_threshold": 512},
        "limits": {"max_queued_requests": 1024}})
    connect(None, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), log_to_driver=False)
    try:
        print("  deploying the local cluster ...", flush=True)
        _, address = deploy(cfg)
        channel = grpc.insecure_channel(address, options=[("grpc.max_concurrent_streams", 4096)])
        stub = inference_pb2_grpc.InferenceStub(channel)
        cluster_request(stub, Req("warm up", 4))
        print(f"  low load: {len(low)} requests one at a time", flush=True)
        low_results = [cluster_request(stub, r) for r in low]
        print(f"  loaded: {len(reqs)} requests at once", flush=True)
        results: list[Result | None] = [None] * len(reqs)

        def one(i):
            results[i] = cluster_request(stub, reqs[i])
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(reqs))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        channel.close()
        return results, wall, low_results
    finally:
        teardown(cfg.namespace)
        ray.shutdown()


# ----------------------------------------------------------------------------- report
def summarize(results: list[Result], wall: float) -> dict:
    tokens = sum(r.tokens for r in results)
    return {"requests": len(results), "tokens": tokens, "wall_s": wall, "throughput_tok_s": tokens / wall,
            "ttft_p50_ms": 1000 * pct([r.ttft for r in results], 50),
            "ttft_p99_ms": 1000 * pct([r.ttft for r in results], 99),
            "tpot_p50_ms": 1000 * pct([r.tpot for r in results], 50),
            "tpot_p99_ms": 1000 * pct([r.tpot for r in results], 99)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-reasoner")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--low-load", type=int, default=8, help="requests sent one at a time")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "cluster.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.model_config import ModelConfig
    max_len = ModelConfig.from_pretrained(resolve_model_path(args.model)).max_model_len
    reqs = workload(args.requests, max_len)
    low = [r for r in workload(args.low_load * 4, max_len) if r.max_tokens <= 96][:args.low_load] or reqs[:args.low_load]
    engine_kw = {"num_device_blocks": 2048, "max_num_seqs": 64}

    print(f"benchmark: {len(reqs)} requests ({sum(r.max_tokens for r in reqs)} max tokens) on {args.model}", flush=True)
    print("in-process engine ...", flush=True)
    eng, eng_wall = run_engine(args.model, reqs, engine_kw)
    eng_low = engine_low_load(args.model, low, engine_kw)
    print("local cluster ...", flush=True)
    cl, cl_wall, cl_low = run_cluster(args.model, reqs, low, engine_kw)

    e, c = summarize(eng, eng_wall), summarize(cl, cl_wall)
    med = statistics.median
    low_e, low_c = [1000 * f for f, _ in eng_low], [1000 * r.ttft for r in cl_low]
    low_e2 = [1000 * s for _, s in eng_low if s is not None]
    low_c2 = [1000 * r.tt2t for r in cl_low if r.tt2t is not None]
    handoff = [r.server["handoff_ms"] for r in cl_low]
    prefill = [r.server["prefill_ms"] for r in cl_low]
    report = {"engine": e, "cluster": c, "low_load": {
        "requests": len(low),
        "engine_ttft_p50_ms": med(low_e), "cluster_ttft_p50_ms": med(low_c),
        "added_ttft_p50_ms": med(low_c) - med(low_e),
        "engine_second_token_p50_ms": med(low_e2) if low_e2 else None,
        "cluster_second_token_p50_ms": med(low_c2) if low_c2 else None,
        "cluster_prefill_p50_ms": med(prefill), "cluster_handoff_p50_ms": med(handoff)}}
    print()
    print(f"{'':<22}{'in-process engine':>20}{'local cluster':>18}{'cluster / engine':>18}")
    rows = [("throughput (tok/s)", "throughput_tok_s"), ("TTFT P50 (ms)", "ttft_p50_ms"), ("TTFT P99 (ms)", "ttft_p99_ms"),
            ("TPOT P50 (ms)", "tpot_p50_ms"), ("TPOT P99 (ms)", "tpot_p99_ms"), ("wall (s)", "wall_s")]
    for label, key in rows:
        print(f"{label:<22}{e[key]:>20.1f}{c[key]:>18.1f}{c[key] / e[key]:>17.2f}x")
    lo = report["low_load"]
    print()
    print(f"low load, {len(low)} requests one at a time (P50):")
    print(f"  TTFT: in-process engine {lo['engine_ttft_p50_ms']:.1f} ms, cluster {lo['cluster_ttft_p50_ms']:.1f} ms "
          f"(+{lo['added_ttft_p50_ms']:.1f} ms: gRPC, placement, actor calls; the first token streams from the "
          f"prefill instance)")
    if lo["cluster_second_token_p50_ms"] is not None:
        print(f"  second token: engine {lo['engine_second_token_p50_ms']:.1f} ms, cluster "
              f"{lo['cluster_second_token_p50_ms']:.1f} ms; the prefill → decode KV handoff between them takes "
              f"{lo['cluster_handoff_p50_ms']:.1f} ms (server-side; prefill {lo['cluster_prefill_p50_ms']:.1f} ms)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
