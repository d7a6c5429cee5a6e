"""What the OpenAI-compatible HTTP API costs over gRPC, on the same requests and the same cluster.

    python bench/bench_http_overhead.py [--requests 30] [--max-tokens 64]

Deploys the tiny-reasoner locally (prefill -> short_decode), then sends the same greedy problems,
interleaved, over gRPC (baseline), HTTP non-streamed and HTTP streamed (SSE, the official
``openai`` client), one at a time. Prints median and p90 end-to-end latency per API and the ratio
to gRPC, and checks the three produced the same tokens. Run on a shared machine: the ratios are
the figure, not the absolute times.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    import grpc
    import openai

    from thinkserve.cluster.config import parse_config
    from thinkserve.cluster.deploy import connect, deploy, frontend_addresses, ray_cpus_needed, teardown
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    from thinkserve.protos.thinkserve.v1 import inference_pb2_grpc
    from thinkserve.workers.tiny_reasoner import REALISTIC_MIX, prompt_for
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix

    cfg = parse_config({
        "model": "tiny-reasoner", "namespace": "thinkserve-bench-http",
        "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "short_decode": {"replicas": 1, "num_cpus": 0.5},
                  "long_decode": {"replicas": 0}, "mixed": {"replicas": 0}},
        "router": {"long_threshold": 4096}, "frontend": {"port": 0, "http_port": 0}})
    connect(None, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), log_to_driver=False)
    print("deploying tiny-reasoner (prefill -> short_decode) ...", flush=True)
    deploy(cfg)
    try:
        where = frontend_addresses(cfg.namespace)
        channel = grpc.insecure_channel(where["grpc"])
        stub = inference_pb2_grpc.InferenceStub(channel)
        client = openai.OpenAI(base_url=f"http://{where['http']}/v1", api_key="-", max_retries=0)
        prompts = [prompt_for(p) for p in sample_mix(REALISTIC_MIX, args.requests, seed=5)]

        def via_grpc(p):
            req = pb.GenerateRequest(text=p, sampling=pb.SamplingParams(max_tokens=args.max_tokens, temperature=0))
            return [list(m.final.branches[0].token_ids) for m in stub.Generate(req, timeout=120)
                    if m.HasField("final")][0]

        def via_http(p):
            return client.completions.create(model="tiny-reasoner", prompt=p, max_tokens=args.max_tokens,
                                             temperature=0).choices[0].token_ids

        def via_sse(p):
            text = "".join(c.choices[0].text for c in client.completions.create(
                model="tiny-reasoner", prompt=p, max_tokens=args.max_tokens, temperature=0, stream=True) if c.choices)
            return text

        apis = {"gRPC (baseline)": via_grpc, "HTTP": via_http, "HTTP SSE": via_sse}
        for f in apis.values():         # warm up every path
            f(prompts[0])
        times = {k: [] for k in apis}
        mismatches = 0
        for i, p in enumerate(prompts):
            outs = {}
            for name, f in apis.items():
                t0 = time.perf_counter()
                outs[name] = f(p)
                times[name].append(time.perf_counter() - t0)
            mismatches += outs["gRPC (baseline)"] != outs["HTTP"]
            print(f"\r  {i + 1}/{len(prompts)} requests", end="", flush=True)
        print()
        base = statistics.median(times["gRPC (baseline)"])
        print(f"{'API':<16} {'median ms':>10} {'p90 ms':>8} {'median / gRPC':>14}")
        for name, ts in times.items():
            ts = sorted(ts)
            med = statistics.median(ts)
            print(f"{name:<16} {med * 1000:>10.1f} {ts[int(0.9 * (len(ts) - 1))] * 1000:>8.1f} {med / base:>13.2f}x")
        print(f"token mismatches gRPC vs HTTP: {mismatches} of {len(prompts)} (machine shared with other work)")
        channel.close()
        return 1 if mismatches else 0
    finally:
        teardown(cfg.namespace)


if __name__ == "__main__":
    raise SystemExit(main())
