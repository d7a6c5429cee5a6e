"""Simulator identity: a hash of everything a simulation decided, to compare two versions of the code.

A speed change to the simulator or the router must not change a single result. This runs a set
of cases (policy x prefix cache x load, and a KV cache small enough to preempt) and prints, per
case, a SHA-256 over every request's first-token and finish times (exact float reprs), refusal,
truncation and tokens out; every instance's engine steps, decode runs and preemptions; the
promotions, migrations and bytes moved; and the ``summarize`` dict. Run it under two checkouts'
interpreters and compare::

    .venv/bin/python bench/sim_identity.py --out /tmp/new.json
    (cd /work/main && .venv/bin/python /path/to/bench/sim_identity.py --out /tmp/main.json)
    .venv/bin/python bench/sim_identity.py --compare /tmp/main.json /tmp/new.json

The script imports ``thinkserve`` from whichever checkout the interpreter installs, so the same
file measures both.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import replace

from thinkserve.cluster.sim.cost import RooflineCost
from thinkserve.cluster.sim.hardware import GB, GPU_KINDS, MODELS
from thinkserve.cluster.sim.metrics import summarize
from thinkserve.cluster.sim.setup import Deployment, build, default_slo, make_workload

# (name, requests, rate, gpus, KV block size, device memory per GPU in GB or None for the datasheet's).
# Block 16: the reasoning mix's topic tokens fill a first block, so the prefix cache hits; block 64
# is what bench/sim_speed.py runs.
LOADS = (("3k@100-b16", 3000, 100.0, 32, 16, None), ("6k@250-b64", 6000, 250.0, 32, 64, None),
         # 20 GB per GPU leaves ~2.8 GB of KV cache per 7B instance: long chains preempt
         ("3k@100-b16-smallkv", 3000, 100.0, 32, 16, 20))
POLICIES = ("colocated", "pd", "conductor")


def fingerprint(sim, slo) -> dict:
    h = hashlib.sha256()
    for rid in sorted(sim.records):
        r = sim.records[rid]
        h.update(repr((rid, r.first_token, r.finish, r.refused, r.truncated, r.tokens_out, r.decided,
                       getattr(r.placement, "prefill_instance", None))).encode())
    for inst in sim.instances:
        h.update(repr((inst.instance_id, inst.num_steps, inst.num_runs, inst.scheduler.num_preemptions)).encode())
    moved = (sim.num_promotions, sim.num_promotions_skipped, sim.num_migrations, sim.num_transfers, sim.bytes_moved)
    h.update(repr(moved).encode())
    summary = summarize(sim, slo)
    h.update(json.dumps(summary, sort_keys=True).encode())
    return {"hash": h.hexdigest(), "engine_steps": summary["engine_steps"], "preemptions": summary["preemptions"],
            "promotions": sim.num_promotions, "bytes_moved": sim.bytes_moved, "finished": summary["finished"],
            "refused": summary["refused"]}


def run_case(load, policy: str, prefix: bool, model: str = "qwen2.5-7b") -> dict:
    name, requests, rate, gpus, block_size, mem_gb = load
    gpu = GPU_KINDS["h200"] if mem_gb is None else replace(GPU_KINDS["h200"], hbm_bytes=mem_gb * GB)
    cost = RooflineCost(gpu, MODELS[model])
    reqs = make_workload("reasoning", rate=rate, requests=requests, seed=0, max_model_len=cost.model.max_model_len)
    sim = build(reqs, Deployment(policy), cost, gpus, block_size=block_size, prefix_caching=prefix).run()
    sim.check_integrity()
    return fingerprint(sim, default_slo("gpu"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the fingerprints as JSON here")
    p.add_argument("--policy", nargs="+", default=list(POLICIES))
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files and exit")
    args = p.parse_args()
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        bad = [k for k in sorted(set(a) | set(b)) if a.get(k, {}).get("hash") != b.get(k, {}).get("hash")]
        for k in sorted(set(a) | set(b)):
            print(f"{'DIFFERS' if k in bad else 'same   '} {k}: {a.get(k)} | {b.get(k)}" if k in bad
                  else f"same    {k}: {a[k]['hash'][:16]} steps {a[k]['engine_steps']}")
        print(f"{len(bad)} of {len(set(a) | set(b))} cases differ")
        sys.exit(1 if bad else 0)
    import thinkserve.cluster.sim.simulator as simmod
    print(f"code: {os.path.dirname(os.path.dirname(simmod.__file__))}; load average {os.getloadavg()}", flush=True)
    out = {}
    for load in LOADS:
        for policy in args.policy:
            for prefix in (True, False):
                key = f"{load[0]}/{policy}/prefix-{'on' if prefix else 'off'}"
                t0 = time.process_time()
                out[key] = run_case(load, policy, prefix)
                print(f"{key}: {out[key]} ({time.process_time() - t0:.1f} cpu s)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
