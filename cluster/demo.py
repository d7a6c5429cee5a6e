"""The README's main command: a local thinkserve cluster on tiny-reasoner, end to end.

    python -m thinkserve.cluster.demo [--model PATH] [--keep-running] [--address RAY_ADDRESS]

1. starts its own local Ray instance (never a running cluster unless ``--address`` names one;
   127.0.0.1 only) and deploys, in a namespace of its own (``thinkserve-demo-<pid>``) and on a
   free port, one instance per pool (prefill, short_decode, long_decode), the CPU KV store and
   the gRPC frontend;
2. submits a handful of reasoning requests concurrently over gRPC: short additions (they decode
   in the short pool), Collatz chains with long ``<think>`` traces (long pool), and one
   Best-of-N request (n = 5, sampled) whose branches vote on the answer;
3. prints each result (answer, correctness, timings, where it ran) and per-pool stats;
4. shuts down what it started, and only that: another deployment, in any namespace of any Ray
   cluster, keeps running.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass

from .config import ConfigError, parse_config


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass
class Job:
    label: str
    prompt: str
    expected: int | None
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None


def default_jobs(max_model_len: int) -> list[Job]:
    from thinkserve.workers.tiny_reasoner.tasks import generate_problems, prompt_for

    long = min(1600, max_model_len - 32)     # Collatz chains run to ~1,450 tokens
    jobs = []
    for p in generate_problems(1, 1, seed=3) + generate_problems(3, 1, seed=3):
        jobs.append(Job(f"add (level {p.level})", prompt_for(p), p.answer, max_tokens=96))
    for p in generate_problems(4, 1, seed=3) + generate_problems(6, 1, seed=3):
        jobs.append(Job(f"collatz (level {p.level})", prompt_for(p), p.answer, max_tokens=long))
    p = generate_problems(4, 1, seed=11)[0]
    jobs.append(Job(f"collatz (level {p.level}), best-of-5", prompt_for(p), p.answer, max_tokens=long, n=5,
                    temperature=0.7, seed=1234))
    return jobs


def demo_config(model: str, port: int, namespace: str):
    return parse_config({
        "model": model,
        "namespace": namespace,
        "engine": {"num_device_blocks": 1024, "max_num_seqs": 32},
        "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5},
                  "short_decode": {"replicas": 1, "num_cpus": 0.5},
                  "long_decode": {"replicas": 1, "num_cpus": 0.5},
                  "mixed": {"replicas": 0}},
        "frontend": {"port": port, "http_port": 0},      # HTTP (OpenAI API, /metrics) on a free port
        "router": {"long_threshold": 512},
        "store": {"capacity_bytes": 64 * 2**20},
    })


def run_job(stub, job: Job, results: dict, lock: threading.Lock) -> None:
    import grpc

    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    sp = pb.SamplingParams(max_tokens=job.max_tokens, temperature=job.temperature)
    if job.seed is not None:
        sp.seed = job.seed
    req = pb.GenerateRequest(text=job.prompt, sampling=sp, n=job.n)
    t0 = time.monotonic()
    tokens = 0
    final = None
    try:
        for msg in stub.Generate(req, timeout=600):
            for d in msg.deltas:
                tokens += len(d.token_ids)
            if msg.HasField("final"):
                final = msg
    except grpc.RpcError as e:  # shown in the results table
        final = RuntimeError(f"{e.code().name}: {e.details()}")
    with lock:
        results[job.label] = (final, time.monotonic() - t0, tokens)
        say(f"done: {job.label} ({tokens} tokens streamed)")


def print_results(jobs: list[Job], results: dict) -> int:
    from thinkserve.workers.tiny_reasoner.tasks import parse_answer
    correct = 0
    print()
    print("=" * 100)
    for job in jobs:
        final, secs, _ = results[job.label]
        if isinstance(final, Exception):
            print(f"{job.label:<32} FAILED: {final}")
            continue
        f, t = final.final, final.timings
        got = f.answer or "(none)"
        ok = job.expected is not None and f.answer == str(job.expected)
        correct += ok
        print(f"{job.label:<32} {job.prompt!r}")
        print(f"    answer {got:<8} expected {job.expected:<8} {'correct' if ok else 'WRONG'}   "
              f"{final.usage.completion_tokens} tokens   ttft {t.ttft_ms:.0f} ms   total {secs * 1000:.0f} ms   "
              f"{t.prefill_instance} → {', '.join(t.decode_instances)}")
        if len(f.branches) > 1:
            votes = ", ".join(f"{v.answer}×{v.count}" for v in f.votes) or "no answers"
            per = " ".join(f"[{b.index}] {parse_answer(b.text)}" for b in f.branches)
            print(f"    branches: {per}   votes: {votes}")
        else:
            text = f.branches[0].text
            print(f"    text: {text[:90]!r}{'…' if len(text) > 90 else ''}")
    print("=" * 100)
    return correct


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-reasoner")
    ap.add_argument("--port", type=int, default=0, help="gRPC port (default: a free one)")
    ap.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C after the requests")
    ap.add_argument("--address", help="a Ray cluster to deploy on (default: a Ray instance of the demo's own; "
                                      "RAY_ADDRESS and clusters running here are left alone)")
    args = ap.parse_args(argv)

    from thinkserve.workers.loader import resolve_model_path
    try:
        resolve_model_path(args.model)
        cfg = demo_config(args.model, args.port, f"thinkserve-demo-{os.getpid()}")
    except (FileNotFoundError, ConfigError) as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2

    import grpc
    import ray

    from thinkserve.protos.thinkserve.v1 import admin_pb2, inference_pb2_grpc, admin_pb2_grpc

    from .admin_cli import format_status
    from .deploy import connect, deploy, ray_cpus_needed, teardown

    t_start = time.monotonic()
    connect(args.address, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), join_running=False,
            settings=cfg.ray, progress=say, log_to_driver=False)
    deployed = False
    try:
        say(f"deploying in namespace {cfg.namespace}: 1 prefill, 1 short-decode, 1 long-decode instance "
            "+ KV store + gRPC frontend")
        _, address = deploy(cfg, progress=lambda m: say("  " + m))
        deployed = True
        say(f"cluster up in {time.monotonic() - t_start:.1f}s; gRPC on {address}")
        from thinkserve.workers.model_config import ModelConfig
        jobs = default_jobs(ModelConfig.from_pretrained(resolve_model_path(args.model)).max_model_len)
        channel = grpc.insecure_channel(address)
        stub = inference_pb2_grpc.InferenceStub(channel)
        admin = admin_pb2_grpc.AdminStub(channel)
        results: dict = {}
        lock = threading.Lock()
        say(f"submitting {len(jobs)} requests concurrently over gRPC")
        threads = [threading.Thread(target=run_job, args=(stub, j, results, lock)) for j in jobs]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=5)
            if any(t.is_alive() for t in threads):
                st = admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)
                busy = ", ".join(f"{p.name}: {sum(i.num_running for i in p.instances)} running"
                                 for p in st.pools if p.instances)
                say(f"  {len(results)}/{len(jobs)} done after {time.monotonic() - t0:.0f}s ({busy})")
        correct = print_results(jobs, results)
        say(f"{correct}/{len(jobs)} answers correct; all requests done in {time.monotonic() - t0:.1f}s")
        print()
        print(format_status(admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=10)))
        print()
        if args.keep_running:
            say(f"serving on {address}; try `thinkserve submit '12+34=' --server {address}`; Ctrl-C to stop")
            try:
                while True:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
        channel.close()
    finally:
        say("shutting down")
        if deployed:     # deploy() cleans up after itself when it fails; nothing else is ours
            teardown(cfg.namespace, progress=lambda m: say("  " + m))
        ray.shutdown()
    say(f"done in {time.monotonic() - t_start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
