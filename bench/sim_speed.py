"""Simulator speed: how long ``thinkserve sim`` takes for K requests on N simulated GPUs.

Runs the reasoning mix (the study's workload) once per policy in this process and prints wall
and CPU seconds, engine steps simulated and simulated seconds. The figure the issue asks for is
100,000 requests on 128 H200s in <= 2 minutes:

    flock /work/wt/bench.lock python bench/sim_speed.py --requests 100000 --gpus 128 --rate 400

Results are deterministic; only the timings depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from thinkserve.cluster.sim.setup import Deployment, build, make_cost, make_workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--rate", type=float, default=400.0)
    p.add_argument("--policy", nargs="+", default=["colocated"])
    p.add_argument("--gpu", default="h200")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args()
    cost = make_cost(args.gpu, args.model)
    t0 = time.perf_counter()
    reqs = make_workload("reasoning", rate=args.rate, requests=args.requests, seed=args.seed,
                         max_model_len=cost.model.max_model_len)
    print(f"workload: {len(reqs)} requests in {time.perf_counter() - t0:.1f} s; load average {os.getloadavg()}")
    rows = []
    for policy in args.policy:
        w0, c0 = time.perf_counter(), time.process_time()
        def progress(done, total, sim_time, _next=[0]):
            if done >= _next[0]:  # a line per tenth: a run stopped by a timeout still tells how far it got
                _next[0] += max(1, total // 10)
                print(f"  {done}/{total} requests done, simulated {sim_time:.0f} s, "
                      f"cpu {time.process_time() - c0:.1f} s, wall {time.perf_counter() - w0:.1f} s", flush=True)

        sim = build(reqs, Deployment(policy), cost, args.gpus, block_size=64, progress=progress).run()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        row = {"policy": policy, "requests": len(reqs), "gpus": args.gpus, "rate": args.rate, "wall_s": wall,
               "cpu_s": cpu, "engine_steps": sum(i.num_steps for i in sim.instances),
               "decode_runs": sum(i.num_runs for i in sim.instances), "simulated_s": sim.now,
               "finished": sum(r.finish is not None for r in sim.records.values()),
               "loadavg": os.getloadavg()}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
