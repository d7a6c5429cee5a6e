"""Simulator fidelity: ``thinkserve sim``'s ``cpu`` kind against a real local cluster.

One local cluster (Ray, the gRPC frontend, ``--instances`` tiny-reasoner instances: all mixed, or
1 prefill + the rest decoding with KV hand-offs (``--layout``); least-loaded placement: what
``thinkserve up`` deploys with that config) serves two open-loop streams of tiny-reasoner problems
of its realistic mix, greedy, real EOS, Poisson arrivals, streamed over gRPC:

- run A (``--seed``): its telemetry (every engine step: start, duration, batch shape; every
  request: client send / first token / end, and its parts' engine-side add / first / finish;
  ``cluster/step_telemetry.py``) is what ``bench/fit_sim_cpu.py`` fits the ``cpu`` kind from;
- run B (``--seed + 1``): the check. Its requests, with their actual send times, prompt lengths
  and actual output lengths, are simulated by the simulator the CLI runs (``sim.setup.build``,
  ``--policy colocated`` or ``pd``, the same instance count, block size, batch limits and KV
  blocks) with the fit of run A, and the simulated TTFT / TPOT are compared with the measured ones.

Both runs happen inside one cluster, one after the other, so the fit and the check see the same
machine; the other processes' CPU work during each run (``CpuMonitor``) is replayed in the
simulation as the node's external load (also shown without it). Printed: mean and P90 TTFT and
TPOT, real vs simulated, relative error (target <= 15%), for run B and (in-sample) run A; the load
average. Written: ``--out`` JSON, ``--trace-out`` the runs' telemetry, ``--fit-out`` the fit.

    python bench/sim_fidelity.py [--layout mixed|pd] [--instances 2] [--rate 3] [--duration 60]
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_sim_cpu  # noqa: E402

METRICS = ("ttft_mean", "ttft_p90", "tpot_mean", "tpot_p90")
class CpuMonitor(threading.Thread):
    """Every ``interval`` s, the work (in cores) that processes other than this one and its
    descendants (the local Ray cluster it started) did: the shared machine's load on the cluster,
    an input of the replay like the arrival times. Read from /proc (Linux). Not weighted by nice:
    with the scheduler's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) a niced job of
    another session takes as large a share as a nice-0 one."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.samples, self._done = interval, [], threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _procs() -> dict[int, tuple[int, int, int]]:
        out = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        rest = f.read().rsplit(")", 1)[1].split()
                except (OSError, IndexError):
                    continue
                out[int(d)] = (int(rest[1]), int(rest[16]), int(rest[11]) + int(rest[12]))  # ppid, nice, ticks
        return out

    def run(self) -> None:
        prev, t_prev = self._procs(), time.monotonic()
        while not self._done.wait(self.interval):
            cur, t = self._procs(), time.monotonic()
            ours, children = {os.getpid()}, {}
            for pid, (ppid, _, _) in cur.items():
                children.setdefault(ppid, []).append(pid)
            todo = [os.getpid()]
            while todo:
                for c in children.get(todo.pop(), ()):
                    ours.add(c)
                    todo.append(c)
            work = sum(ticks - prev[pid][2] for pid, (_, _, ticks) in cur.items() if pid not in ours and pid in prev)
            self.samples.append((t_prev, max(0.0, work / self._tick / (t - t_prev))))
            prev, t_prev = cur, t

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self.join()
        return self.samples


def setup_config(layout: str, instances: int, namespace: str):
    """``mixed``: every instance colocated (the simulator's ``--policy colocated``); ``pd``: one
    prefill instance, the rest decoding (``--policy pd``, KV hand-offs over the
    cluster's default transport between instances of one node, shared memory)."""
    from thinkserve.cluster.config import parse_config
    mixed, prefill = (instances, 0) if layout == "mixed" else (0, 1)
    return parse_config({
        "model": "tiny-reasoner", "namespace": namespace,
        "engine": {"num_device_blocks": 1024, "max_num_seqs": 64},
        "pools": {"prefill": {"replicas": prefill, "num_cpus": 0.5},
                  "short_decode": {"replicas": instances - mixed - prefill, "num_cpus": 0.5},
                  "long_decode": {"replicas": 0}, "mixed": {"replicas": mixed, "num_cpus": 0.5}},
        "router": {"policy": "least_loaded", "long_threshold": 1 << 20},
        "frontend": {"port": 0, "http_port": None},
        "limits": {"max_queued_requests": 1024},
        "store": {"capacity_bytes": 64 * 2**20},
    })


def make_jobs(rate: float, duration: float, seed: int, max_tokens: int, tokenizer) -> list[dict]:
    from thinkserve.cluster.bench_cli import poisson_times
    from thinkserve.workers.tiny_reasoner import REALISTIC_MIX, prompt_for
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix
    times = poisson_times(rate, duration, random.Random(seed))
    jobs = []
    for i, (t, p) in enumerate(zip(times, sample_mix(REALISTIC_MIX, len(times), seed))):
        text = prompt_for(p)
        jobs.append({"id": f"fid{seed}-{i}", "at": t, "text": text, "prompt_len": len(tokenizer.encode(text)),
                     "max_tokens": max_tokens})
    return jobs


async def drive(address: str, jobs: list[dict]) -> tuple[list[dict], float]:
    """Send every job at its time (open loop), greedy, streaming; client-side timestamps."""
    import grpc

    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    from thinkserve.protos.thinkserve.v1 import inference_pb2_grpc
    channel = grpc.aio.insecure_channel(address)
    stub = inference_pb2_grpc.InferenceStub(channel)
    t0 = time.monotonic() + 0.5

    async def one(job):
        await asyncio.sleep(max(0.0, t0 + job["at"] - time.monotonic()))
        rec = {"id": job["id"], "sent": time.monotonic(), "first": None, "end": None, "tokens": 0, "error": ""}
        req = pb.GenerateRequest(request_id=job["id"], text=job["text"],
                                 sampling=pb.SamplingParams(max_tokens=job["max_tokens"], temperature=0.0))
        try:
            async for msg in stub.Generate(req, timeout=600):
                for d in msg.deltas:
                    if d.token_ids and rec["first"] is None:
                        rec["first"] = time.monotonic()
                    rec["tokens"] = max(rec["tokens"], d.num_tokens)
            rec["end"] = time.monotonic()
        except grpc.RpcError as e:
            rec["error"] = e.code().name
        return rec
    records = await asyncio.gather(*(one(j) for j in jobs))
    await channel.close()
    return list(records), t0


def take_traces(controller) -> dict:
    import ray
    members = ray.get(controller.membership.remote()).members
    return {m.instance_id: ray.get(m.handle.step_trace.remote()) for m in members if m.handle is not None}


def to_trace(cfg, jobs, records, t0, traces, note: str, external) -> dict:
    """Run telemetry as plain JSON, times relative to the stream's start."""
    layout = "mixed" if cfg.pools.get("mixed").replicas else "pd"
    eng = cfg.engine_config("mixed" if layout == "mixed" else "short_decode")
    parts: dict[str, list] = {}
    for tr in traces.values():
        for p in tr.parts:
            parts.setdefault(p.part_id.split("#", 1)[0], []).append(
                {"added": p.added - t0, "first_token": None if p.first_token is None else p.first_token - t0,
                 "finished": None if p.finished is None else p.finished - t0})
    rel = lambda v: None if v is None else v - t0  # noqa: E731
    return {
        "model": "tiny-reasoner", "cores": os.cpu_count(), "source": note, "layout": layout,
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "engine": {"block_size": eng.block_size, "max_num_seqs": eng.max_num_seqs,
                   "max_num_batched_tokens": eng.max_num_batched_tokens,
                   "num_device_blocks": eng.num_device_blocks},
        "instances": {iid: {"steps": [[round(s.start - t0, 6), round(s.duration, 7), s.prefill_tokens, s.prefill_ctx,
                                       s.num_decode, s.decode_ctx] for s in tr.steps if s.start >= t0]}
                      for iid, tr in traces.items()},
        "external_load": [[round(t - t0, 4), round(w, 4)] for t, w in external],
        "requests": [{"id": r["id"], "prompt_len": j["prompt_len"], "max_tokens": j["max_tokens"],
                      "sent": rel(r["sent"]), "first": rel(r["first"]), "end": rel(r["end"]), "tokens": r["tokens"],
                      "error": r["error"], "parts": parts.get(r["id"], [])} for j, r in zip(jobs, records)],
    }


def sim_requests(trace: dict):
    from thinkserve.cluster.sim.workload import SHORT, SimRequest
    return [SimRequest(r["id"], r["sent"], r["prompt_len"], (r["tokens"],), SHORT, r["max_tokens"], salt=i)
            for i, r in enumerate(trace["requests"]) if not r["error"] and r["tokens"] >= 1]


def simulate(trace: dict, fit_path: Path, external: bool = True) -> dict[str, tuple[float, float]]:
    from thinkserve.cluster.sim.cost import LinearCost
    from thinkserve.cluster.sim.hardware import TINY_REASONER
    from thinkserve.cluster.sim.setup import Deployment, build
    cost = LinearCost.from_fit(TINY_REASONER, fit_path)
    eng, instances = trace["engine"], len(trace["instances"])
    if eng["num_device_blocks"] * eng["block_size"] != cost.kv_capacity_tokens():
        raise ValueError("the fit's KV capacity is not this cluster's")
    dep = Deployment("colocated") if trace["layout"] == "mixed" else Deployment("pd", prefill_share=1 / instances)
    sim = build(sim_requests(trace), dep, cost, instances, block_size=eng["block_size"],
                max_num_seqs=eng["max_num_seqs"], max_num_batched_tokens=eng["max_num_batched_tokens"],
                external_load=[tuple(x) for x in trace.get("external_load", ())] if external else (),
                step_noise=True).run()
    return {rid: (rec.first_token, rec.finish) for rid, rec in sim.records.items()}


def stats(trace: dict, times: dict | None = None) -> dict:
    ttft, tpot = [], []
    for r in trace["requests"]:
        if r["error"] or r["tokens"] < 1:
            continue
        first, end = times[r["id"]] if times is not None else (r["first"], r["end"])
        ttft.append(first - r["sent"])
        if r["tokens"] > 1:
            tpot.append((end - first) / (r["tokens"] - 1))
    return {"ttft_mean": float(np.mean(ttft)), "ttft_p90": float(np.percentile(ttft, 90)),
            "tpot_mean": float(np.mean(tpot)), "tpot_p90": float(np.percentile(tpot, 90))}


def compare(trace: dict, fit_path: Path) -> dict:
    real = stats(trace)
    t = time.perf_counter()
    sim = stats(trace, simulate(trace, fit_path))
    wall = time.perf_counter() - t
    quiet = stats(trace, simulate(trace, fit_path, external=False))
    ext = np.asarray(trace.get("external_load") or [[0, 0]], dtype=float)[:, 1]
    return {"real": real, "sim": sim, "rel_error": {k: (sim[k] - real[k]) / real[k] for k in METRICS},
            "sim_wall_s": wall, "external_load_mean": float(ext.mean()), "external_load_max": float(ext.max()),
            "sim_without_external_load": quiet,
            "rel_error_without_external_load": {k: (quiet[k] - real[k]) / real[k] for k in METRICS},
            "requests": len(trace["requests"]), "errors": sum(1 for r in trace["requests"] if r["error"]),
            "output_tokens": sum(r["tokens"] for r in trace["requests"])}


def print_table(label: str, c: dict) -> None:
    print(f"\n{label}: {c['requests']} requests ({c['errors']} errors), {c['output_tokens']} output tokens; "
          f"other processes' work {c['external_load_mean']:.2f} cores (max {c['external_load_max']:.2f})")
    print(f"{'metric':<10} {'real (ms)':>10} {'sim (ms)':>10} {'error':>8}   {'sim, no other load':>19} {'error':>8}")
    q, qe = c["sim_without_external_load"], c["rel_error_without_external_load"]
    for k in METRICS:
        print(f"{k:<10} {c['real'][k] * 1e3:10.2f} {c['sim'][k] * 1e3:10.2f} {c['rel_error'][k]:+8.1%}   "
              f"{q[k] * 1e3:19.2f} {qe[k]:+8.1%}")


def run_cluster(args, jobs_a, jobs_b) -> tuple[dict, dict, list]:
    import ray

    from thinkserve.cluster.deploy import connect, deploy, ray_cpus_needed, teardown
    cfg = setup_config(args.layout, args.instances, f"sim-fidelity-{os.getpid()}")
    say = lambda m: print(f"[cluster] {m}", flush=True)  # noqa: E731
    connect(None, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), join_running=False,
            settings=cfg.ray, log_to_driver=False)
    loads = []
    try:
        controller, address = deploy(cfg, progress=say)
        warm = [dict(j, id=f"warm-{i}", at=0.2 * i) for i, j in enumerate(jobs_b[:4])]
        asyncio.run(drive(address, warm))
        take_traces(controller)          # drop the warm-up's
        out = []
        for name, jobs in (("A", jobs_a), ("B", jobs_b)):
            say(f"run {name}: {len(jobs)} requests over {args.duration:.0f} s")
            loads.append(os.getloadavg())
            monitor = CpuMonitor()
            monitor.start()
            records, t0 = asyncio.run(drive(address, jobs))
            external = monitor.stop()
            loads.append(os.getloadavg())
            out.append(to_trace(cfg, jobs, records, t0, take_traces(controller), f"run {name} ({jobs[0]['id']}...)",
                                external))
    finally:
        teardown(cfg.namespace)
        ray.shutdown()
    return out[0], out[1], loads


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=("mixed", "pd"), default="mixed")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals per run")
    ap.add_argument("--max-tokens", type=int, default=1400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON with both comparisons")
    ap.add_argument("--trace-out", default=None, help="run A's telemetry (the fit's input; .json.gz: gzipped); "
                                                     "run B's goes beside it as *.B.json[.gz]")
    ap.add_argument("--fit-out", default=None, help="write run A's own fit here")
    ap.add_argument("--fit", default=None, help="check with this fit (default: the committed cluster/sim/cpu_fit.json); "
                                             "run A's own fit is checked beside it")
    ap.add_argument("--from-traces", nargs=2, metavar=("A", "B"), default=None,
                    help="no cluster: fit and check from two recorded traces")
    args = ap.parse_args(argv)
    loads = []
    if args.from_traces:
        trace_a, trace_b = (fit_sim_cpu.load_trace(p) for p in args.from_traces)
    else:
        from thinkserve.workers.loader import resolve_model_path
        from thinkserve.workers.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(resolve_model_path("tiny-reasoner"))
        jobs_a = make_jobs(args.rate, args.duration, args.seed, args.max_tokens, tok)
        jobs_b = make_jobs(args.rate, args.duration, args.seed + 1, args.max_tokens, tok)
        trace_a, trace_b, loads = run_cluster(args, jobs_a, jobs_b)
        if args.trace_out:
            out = Path(args.trace_out)
            for trace, path in ((trace_a, out), (trace_b, out.with_name(out.name.replace(".json", ".B.json")))):
                data = (json.dumps(trace) + "\n").encode()
                path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    from thinkserve.cluster.sim.cost import CPU_FIT_PATH
    committed = Path(args.fit) if args.fit else CPU_FIT_PATH
    fit = fit_sim_cpu.fit_trace(trace_a)
    fit_path = Path(args.fit_out) if args.fit_out else Path(tempfile.mkdtemp()) / "cpu_fit.json"
    fit_path.write_text(json.dumps(fit, indent=1) + "\n")
    q = fit["fit_quality"]
    lat = fit_sim_cpu._latency_medians(fit["latency"])
    print(f"run A's own fit: {fit['coeffs']}\n  contention {fit['contention']}, handoff {fit['transfer_latency_s'] * 1e3:.1f} ms, "
          f"frontend latency medians (a core free / the cores taken): {lat}\n"
          f"  step-time error on its {q['samples']} steps: median {q['median_rel_error']:.1%}, p90 "
          f"{q['p90_rel_error']:.1%}, total {q['total_time_error']:.1%}; mean other engines stepping {q['mean_others']:.2f}")
    check, insample = compare(trace_b, committed), compare(trace_a, committed)
    own = compare(trace_b, fit_path)
    print(f"\nchecked with {committed}")
    print_table("run B (validation: not in the fit)", check)
    print_table("run A (in-sample when the checked fit was made from it)", insample)
    print_table("run B with run A's own fit", own)
    if loads:
        print("\nload average (1/5/15 min) before/after run A and run B: "
              + ", ".join("/".join(f"{x:.2f}" for x in la) for la in loads))
    if args.out:
        Path(args.out).write_text(json.dumps({"fit_checked": json.loads(committed.read_text()), "run_b": check,
                                              "run_a": insample, "own_fit": fit, "run_b_own_fit": own,
                                              "loadavg": loads, "args": vars(args)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
