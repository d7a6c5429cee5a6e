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
  Also checked: the committed fit as it is, and calibrated by run A (``fit_sim_cpu.calibrate``:
  the engines' and the frontend's speed in this session against the fit's; run B is not read).

Both runs happen inside one cluster, one after the other, so the fit and the check see the same
machine; the other processes' CPU work during each run (``CpuMonitor``) is replayed in the
simulation as the node's external load (also shown without it), and a probe of the machine's
speed runs beside the cluster (``MachineProbe``, ``bench/machine_probe.py``: a fixed piece of
work's CPU time every 0.125 s, ``machine_probe`` in the trace), which a calibrated simulation
replays over the calibration run's level (``fit_sim_cpu.machine_series``). ``--probe U1 U2 ...``
runs several probe units beside the cluster (the first is the trace's ``machine_probe``, the
others ``machine_probe_<unit>``) and ``--replay-probe U`` replays with one of them, so that two
probes can be compared on the same runs. Printed: mean and P90 TTFT and
TPOT, real vs simulated, relative error (target <= 15%), for run B and (in-sample) run A; the load
average. Written: ``--out`` JSON, ``--trace-out`` the runs' telemetry, ``--fit-out`` the fit.

Repeats (``--repeats N``): after run B, run B's requests are sent again N times in the same
cluster (runs B2, B3, ...: the same prompts, limits and send times; greedy, so the same outputs),
each written beside run B (``NAME.B2.json[.gz]``, ...). Their figures against run B's tell how far
the real cluster repeats itself, the floor under any simulator's error; each is also simulated
calibrated by run A.

Replays (``--replay DIR ...``, no cluster): every recorded session in the folders, each run
simulated with the fit as it is and calibrated by the session's other run; counted by figure
within 15%. A P90 of ~170 requests moves by a few percent with the simulation's own random draws
(frontend latencies, step noise, slow stretches): ``--noise-seeds N`` replays each run with N
draws and reports each draw's count and the errors' mean over them, which tells a model change
from a reshuffle. A session's repeats are simulated like run B and counted apart: every two real
runs of the workload against each other, beside the simulator against each (``repeatability``),
and run B is also simulated calibrated by its first repeat (``repeat``: the same requests, a
minute later), which tells a calibration's error from the other run's requests from the
machine's change between the two runs.

Controlled conditions: ``--load N`` runs N background processes of a known kind beside the
cluster for both runs (``LOAD_LOOP``, at ``--load-nice``; counted as other processes' work like
anyone else's), so that the fit can see the engines at several machine loads;
``--prompt-tokens N`` prefixes each problem with worked examples of other problems up to N
tokens (the realistic mix's prompts are 5-17 tokens, too short to tell a prompt token's cost
from a prefill step's fixed cost). ``--after`` records a run C of new requests (``--seed`` + 2)
after run B and its repeats, so that run B can be predicted calibrated by the runs before and
after it (``replay``'s ``bracketed``). ``--pin`` binds each engine thread to a core of its own
(``pools.<name>.cpus``, ``setup_config``).

    python bench/sim_fidelity.py [--layout mixed|pd] [--instances 2] [--rate 3] [--duration 60]
                                 [--load N --load-nice K] [--prompt-tokens N] [--repeats N] [--after] [--pin]
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fit_sim_cpu  # noqa: E402
import machine_probe  # noqa: E402

METRICS = ("ttft_mean", "ttft_p90", "tpot_mean", "tpot_p90")
MAX_REPEATS = 5         # ``--repeats``: run B's requests sent again at most this many times
# ``--load``'s background process: sums a list of 2M Python ints over and over (~70 MiB of objects
# walked per pass, past a core's L2): one core's worth of the kind of work the other jobs on this
# machine do (simulations, tests), whenever the scheduler gives it a core.
LOAD_LOOP = "x = list(range(1 << 21))\nwhile True:\n    sum(x)\n"


def run_path(run_a: Path, run: str) -> Path:
    """Where ``--trace-out`` writes ``run`` ("B"; its repeats "B2", "B3", ...; "C", ``--after``)
    of the session whose run A's telemetry is at ``run_a``: ``NAME.<run>.json[.gz]`` beside it."""
    return run_a.with_name(run_a.name.replace(".json", f".{run}.json"))


def sessions(dirs) -> list[tuple[Path, Path, list[Path]]]:
    """The recorded sessions in the folders ``dirs`` (``--trace-out``'s files), by run A's path:
    (run A, run B, run B's repeats B2, B3, ... that were recorded); a run A without its run B is
    left out."""
    out = []
    for a in sorted(a for d in dirs for a in Path(d).glob("*.json*")):
        if (re.search(r"\.(B\d*|C)\.json", a.name) or not a.name.endswith((".json", ".json.gz"))
                or not run_path(a, "B").exists()):
            continue
        again = [path for r in range(2, 2 + MAX_REPEATS) if (path := run_path(a, f"B{r}")).exists()]
        out.append((a, run_path(a, "B"), again))
    return out


def _pct_cell(e: float) -> str:
    """A relative error as a markdown table cell, bold within 15%."""
    return ("**%+.1f%%**" if abs(e) <= 0.15 else "%+.1f%%") % (100 * e)


def start_load(count: int, nice: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", LOAD_LOOP], preexec_fn=lambda: os.nice(nice))
            for _ in range(count)]


def stop_load(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


class CpuMonitor(threading.Thread):
    """Every ``interval`` s, the work (in cores) that processes other than this one and its
    descendants (the local Ray cluster it started) did: the shared machine's load on the cluster,
    an input of the replay like the arrival times. Read from /proc (Linux). Not weighted by nice:
    with the scheduler's autogroups (``/proc/sys/kernel/sched_autogroup_enabled``) a niced job of
    another session takes as large a share as a nice-0 one. ``outside``: pids of this process's
    children that count as other processes' work (``--load``'s)."""

    def __init__(self, interval: float = 0.5, outside=()):
        super().__init__(daemon=True)
        self.interval, self.samples, self._done = interval, [], threading.Event()
        # The same, of the processes at nice 0 or below only; and each process's work times its
        # scheduler weight relative to nice 0 (CFS: 1.25x per nice level; autogroups off).
        self.unniced, self.weighted = [], []
        self.outside = frozenset(outside)
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
                    if c in self.outside:
                        continue
                    ours.add(c)
                    todo.append(c)
            dt = self._tick * (t - t_prev)
            work = [(ticks - prev[pid][2], nice) for pid, (_, nice, ticks) in cur.items() if pid not in ours and pid in prev]
            self.samples.append((t_prev, max(0.0, sum(w for w, _ in work) / dt)))
            self.unniced.append((t_prev, max(0.0, sum(w for w, nice in work if nice <= 0) / dt)))
            self.weighted.append((t_prev, max(0.0, sum(w * 1.25 ** -nice for w, nice in work) / dt)))
            prev, t_prev = cur, t

    def stop(self) -> list[tuple[float, float]]:
        self._done.set()
        self.join()
        return self.samples


class MachineProbe:
    """``bench/machine_probe.py`` running beside the cluster (a child of this process, so that
    ``CpuMonitor`` counts it as the cluster's own work, not outside work) with its ``unit``:
    ``samples(t0, t1)``, the (time - ``t0``, the unit's CPU ms) it measured between ``t0`` - 1 s
    and ``t1``."""

    def __init__(self, unit: str = machine_probe.UNIT):
        self.unit = unit
        self._file = tempfile.NamedTemporaryFile("r", suffix=".probe", delete=False)
        self._proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("machine_probe.py")),
                                       self._file.name, "--unit", unit])

    def samples(self, t0: float, t1: float) -> list[list[float]]:
        out = []
        self._file.seek(0)
        for line in self._file.read().splitlines():
            parts = line.split()
            if len(parts) == 2 and t0 - 1.0 <= float(parts[0]) <= t1:
                out.append([round(float(parts[0]) - t0, 4), float(parts[1])])
        return out

    def stop(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._file.close()
        os.unlink(self._file.name)


def setup_config(layout: str, instances: int, namespace: str, pin: bool = False):
    """``mixed``: every instance colocated (the simulator's ``--policy colocated``); ``pd``: one
    prefill instance, the rest decoding (``--policy pd``, KV hand-offs over the
    cluster's default transport between instances of one node, shared memory). ``pin``: each
    engine thread bound to a core of its own where there are enough (``pools.<name>.cpus``: the
    mixed instances one core each in turn; pd's prefill instance the first core, its decode
    instances the others)."""
    from thinkserve.cluster.config import parse_config
    mixed, prefill = (instances, 0) if layout == "mixed" else (0, 1)
    pools = {"prefill": {"replicas": prefill, "num_cpus": 0.5},
             "short_decode": {"replicas": instances - mixed - prefill, "num_cpus": 0.5},
             "long_decode": {"replicas": 0}, "mixed": {"replicas": mixed, "num_cpus": 0.5}}
    if pin:
        cores = [[c] for c in sorted(os.sched_getaffinity(0))]
        if layout == "mixed":
            pools["mixed"]["cpus"] = cores
        else:
            pools["prefill"]["cpus"], pools["short_decode"]["cpus"] = cores[:1], cores[1:] or cores
    return parse_config({
        "model": "tiny-reasoner", "namespace": namespace,
        "engine": {"num_device_blocks": 1024, "max_num_seqs": 64},
        "pools": pools,
        "router": {"policy": "least_loaded", "long_threshold": 1 << 20},
        "frontend": {"port": 0, "http_port": None},
        "limits": {"max_queued_requests": 1024},
        "store": {"capacity_bytes": 64 * 2**20},
    })


def make_jobs(rate: float, duration: float, seed: int, max_tokens: int, tokenizer, prompt_tokens: int = 0,
              max_model_len: int = 1 << 30) -> list[dict]:
    """The stream's requests: tiny-reasoner problems of the realistic mix at Poisson times. With
    ``prompt_tokens``, each problem comes after worked examples (other problems of the mix with
    their solutions, one a line; no two prompts start with the same example, so none shares a
    cached block with another) until its prompt
    has ``prompt_tokens`` to 1.5x that many tokens; ``max_tokens`` is cut to what the model's
    context leaves."""
    from thinkserve.cluster.bench_cli import poisson_times
    from thinkserve.workers.tiny_reasoner import REALISTIC_MIX, prompt_for, solution_for
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix
    times = poisson_times(rate, duration, random.Random(seed))
    examples = iter(sample_mix(REALISTIC_MIX, 1 << 16, seed, split="train")) if prompt_tokens else None
    firsts, jobs = set(), []
    for i, (t, p) in enumerate(zip(times, sample_mix(REALISTIC_MIX, len(times), seed))):
        text, head = prompt_for(p), ""
        while prompt_tokens and len(tokenizer.encode(head + text)) < prompt_tokens:
            q = next(examples)
            line = f"{prompt_for(q)}{solution_for(q)}\n"
            if (not head and line in firsts) or len(tokenizer.encode(head + line + text)) > prompt_tokens * 3 // 2:
                continue            # another prompt's first example (a shared first block), or a long chain
            if not head:
                firsts.add(line)
            head += line
        text = head + text
        n = len(tokenizer.encode(text))
        jobs.append({"id": f"fid{seed}-{i}", "at": t, "text": text, "prompt_len": n,
                     "max_tokens": min(max_tokens, max_model_len - n)})
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


def debug_state(address: str, **request):
    """The router's state (Admin.GetDebugState, what ``thinkserve debug`` prints) of the frontend
    at ``address``; ``request``: GetDebugStateRequest's fields."""
    import grpc

    from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc
    channel = grpc.insecure_channel(address)
    try:
        return admin_pb2_grpc.AdminStub(channel).GetDebugState(admin_pb2.GetDebugStateRequest(**request), timeout=60)
    finally:
        channel.close()


def step_traces(state) -> dict:
    """A DebugState's engine step traces, by instance id, as the typed ``StepTrace`` messages."""
    from thinkserve.cluster.messages import PartTiming, StepSample, StepTrace
    opt = lambda msg, f: getattr(msg, f) if msg.HasField(f) else None  # noqa: E731
    return {t.instance_id: StepTrace(
        t.instance_id,
        tuple(StepSample(s.start, s.duration, s.prefill_tokens, s.prefill_ctx, s.num_decode, s.decode_ctx)
              for s in t.steps),
        tuple(PartTiming(p.part_id, p.added, opt(p, "first_token"), opt(p, "finished")) for p in t.parts))
        for t in state.step_traces}


def take_traces(address: str) -> dict:
    """Every serving instance's engine steps and part timings since the last read, by instance id,
    as ``thinkserve debug --step-traces`` reads them."""
    return step_traces(debug_state(address, step_traces=True))


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


def simulate(trace: dict, fit_path: Path, external: bool = True, noise_seed: int = 0) -> dict[str, tuple[float, float]]:
    from thinkserve.cluster.sim.cost import LinearCost
    from thinkserve.cluster.sim.hardware import TINY_REASONER
    from thinkserve.cluster.sim.setup import Deployment, build
    cost = LinearCost.from_fit(TINY_REASONER, fit_path)
    eng, instances = trace["engine"], len(trace["instances"])
    if eng["num_device_blocks"] * eng["block_size"] != cost.kv_capacity_tokens():
        raise ValueError("the fit's KV capacity is not this cluster's")
    dep = Deployment("colocated") if trace["layout"] == "mixed" else Deployment("pd", prefill_share=1 / instances)
    if not external:
        load = ()
    elif cost.background_weight:        # the niced work beside the un-niced (fit_sim_cpu.background_series)
        load = fit_sim_cpu.background_series(trace, cost.external_series)
    else:
        load = fit_sim_cpu.external_series(trace, cost.external_series)
    machine = fit_sim_cpu.machine_series_for(trace, cost.calibration)
    sim = build(sim_requests(trace), dep, cost, instances, block_size=eng["block_size"],
                max_num_seqs=eng["max_num_seqs"], max_num_batched_tokens=eng["max_num_batched_tokens"],
                external_load=[tuple(x) for x in load],
                step_noise=True, noise_seed=noise_seed, machine=machine).run()
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
    from thinkserve.cluster.sim.cost import LinearCost
    from thinkserve.cluster.sim.hardware import TINY_REASONER
    series = LinearCost.from_fit(TINY_REASONER, fit_path).external_series
    ext = np.asarray(fit_sim_cpu.external_series(trace, series) or [[0, 0]], dtype=float)[:, 1]
    return {"real": real, "sim": sim, "rel_error": {k: (sim[k] - real[k]) / real[k] for k in METRICS},
            "sim_wall_s": wall, "external_series": series,
            "external_load_mean": float(ext.mean()), "external_load_max": float(ext.max()),
            "sim_without_external_load": quiet,
            "rel_error_without_external_load": {k: (quiet[k] - real[k]) / real[k] for k in METRICS},
            "requests": len(trace["requests"]), "errors": sum(1 for r in trace["requests"] if r["error"]),
            "output_tokens": sum(r["tokens"] for r in trace["requests"])}


# A replay's calibration columns: the factors, the drawn machine slowness's spread and how the
# latencies and the slow stretches persist (JSON also keeps the probe's level, where the
# calibration run had the probe).
CALIBRATION_COLUMNS = (*fit_sim_cpu.CALIBRATION_FACTORS, "machine_sd", "latency_rho", "latency_tau_s", "slow_rho",
                       "slow_tau_s")


def held_out(runs: dict) -> dict:
    """The replayed runs that count (``replay``'s summary and plot): neither in the fit nor a
    repeat of another run (the repeats are counted apart, so that the counts stay comparable
    with sessions without)."""
    return {k: v for k, v in runs.items() if not v["in_fit"] and "repeat_of" not in v}


def replay(dirs: list[str], fit_path: Path, out: Path | None = None, progress=print, noise_seeds: int = 1,
           self_calibrated: bool = False, probe: str | None = None) -> dict:
    """Every recorded session in ``dirs`` (a run A ``NAME.json[.gz]`` beside its run B
    ``NAME.B.json[.gz]``, as ``--trace-out`` writes them) replayed: each of its two runs simulated
    with the fit at ``fit_path`` as it is, and calibrated by the session's other run
    (``fit_sim_cpu.calibrate``); the runs the fit was made from (its ``source``) counted apart.
    Each simulated with ``noise_seeds`` draws of its random parts (``Simulator(noise_seed=)``
    0, 1, ...): a run's ``as_is`` / ``calibrated`` errors are the first draw's (the default's),
    ``..._by_seed`` every draw's; the summary counts each draw's figures within 15% and gives the
    errors' mean and mean size per layout and figure over all draws. ``self_calibrated``: each run
    also calibrated by itself (``self`` / ``self_by_seed``, counted as ``within_15pct_self``): not a
    prediction, but what is left of the error when the machine's speed during the run is known,
    i.e. the model's own part beside the part the machine's change between two runs adds.
    ``probe``: replay every run with that unit's probe (``fit_sim_cpu.with_probe``: runs recorded
    with several probes beside the cluster), so that two probes can be compared on the same runs.
    A run B with repeats is also simulated calibrated by its first repeat (``repeat``: the same
    requests, after it; summary ``repeat``, beside the repeat's real figures against run B's).
    Written to ``out`` (.json, and a markdown table beside it, .md)."""
    fit = json.loads(fit_path.read_text())
    fitted = set(fit.get("source", "").split("; "))
    runs, tmp = {}, Path(tempfile.mkdtemp())
    pairs = sessions(dirs)
    groups = {}         # run B's name: it and its repeats' (runs B2, B3, ...: the same requests sent again)
    load = lambda p: fit_sim_cpu.with_probe(fit_sim_cpu.load_trace(p), probe)  # noqa: E731
    for i, (a, b, again) in enumerate(pairs):
        try:
            traces = {a: load(a), b: load(b)}
        except ValueError as e:
            progress(f"  {a.name}: session left out ({e})")
            continue
        cals = {}       # each run's calibration, made once: run A's serves run B and every repeat

        def calibration(path: Path) -> dict:
            if path not in cals:
                cals[path] = fit_sim_cpu.calibrate(fit, traces[path])
            return cals[path]
        after = run_path(a, "C")
        for path, other in ((a, b), (b, a), *((r, a) for r in again)):
            try:
                if path not in traces:
                    traces[path] = load(path)
                trace = traces[path]
                cal = calibration(other)
                own = calibration(path) if self_calibrated else None
                around = {}
                if path == b and after.exists():     # run B between run A and run C (--after)
                    traces[after] = load(after)
                    around = {"after": calibration(after),
                              "bracketed": fit_sim_cpu.calibrate(fit, traces[a], traces[after])}
                if path == b and again:              # run B by its repeat B2: the same requests, after it
                    if again[0] not in traces:
                        traces[again[0]] = load(again[0])
                    around["repeat"] = calibration(again[0])
                fit_sim_cpu.external_series(trace, fit["contention"]["series"])
            except (ValueError, KeyError) as e:
                progress(f"  {path.name}: left out ({e})")
                continue
            fits = [("as_is", fit_path)]
            for label, c in (("calibrated", cal), ("self", own), *around.items()):
                if c is not None:
                    fits.append((label, fit_sim_cpu.write_calibrated(fit, c, tmp / f"{label}.json")))
            real = stats(trace)
            errors = {}
            for label, fp in fits:
                by_seed = []
                for seed in range(noise_seeds):
                    sim = stats(trace, simulate(trace, fp, noise_seed=seed))
                    by_seed.append({k: (sim[k] - real[k]) / real[k] for k in METRICS})
                errors[label], errors[f"{label}_by_seed"] = by_seed[0], by_seed
            name = f"{path.parent.name}/{path.name}"
            runs[name] = {"in_fit": trace.get("source") in fitted, "layout": trace["layout"], "real": real, **errors,
                          "calibration": {k: cal[k] for k in (*CALIBRATION_COLUMNS, "probe_ms") if k in cal}}
            if path in again:
                runs[name]["repeat_of"] = f"{b.parent.name}/{b.name}"
                groups.setdefault(runs[name]["repeat_of"], [runs[name]["repeat_of"]]).append(name)
        progress(f"[{i + 1}/{len(pairs)}] {a.parent.name}/{a.name}")
    held = held_out(runs)      # the repeats are counted apart (below)
    labels = ("as_is", "calibrated") + (("self",) if self_calibrated else ())
    within = {label: {m: sum(abs(v[label][m]) <= 0.15 for v in held.values()) for m in METRICS}
              for label in labels}
    summary = {"held_out_runs": len(held), "figures": 4 * len(held),
               **{f"within_15pct_{label}": sum(w.values()) for label, w in within.items()},
               "by_figure": within, "fit": str(fit_path), "noise_seeds": noise_seeds,
               **({"probe": probe} if probe else {})}
    if noise_seeds > 1:
        for label in labels:
            summary[f"within_15pct_{label}_by_seed"] = [
                sum(abs(v[f"{label}_by_seed"][s][m]) <= 0.15 for v in held.values() for m in METRICS)
                for s in range(noise_seeds)]
        summary["calibrated_errors"] = {
            layout: {m: {"mean": float(np.mean(e)), "mean_abs": float(np.mean(np.abs(e))),
                         "outside_15pct_per_draw": float(np.sum(np.abs(e) > 0.15) / noise_seeds)}
                     for m in METRICS
                     for e in [[d[m] for v in held.values() if v["layout"] == layout for d in v["calibrated_by_seed"]]]}
            for layout in sorted({v["layout"] for v in held.values()})}
    if groups:
        summary["repeatability"] = repeatability(runs, groups, noise_seeds)
    for key, labels_around in (("bracketed", ("after", "bracketed")), ("repeat", ("repeat",))):
        chosen = [v for v in held.values() if key in v]
        compared = ("calibrated", *labels_around, *(("self",) if self_calibrated else ()))
        if chosen:
            summary[key] = {
                "runs": len(chosen), "figures": 4 * len(chosen),
                **{f"within_15pct_{label}_by_seed": [sum(abs(v[f"{label}_by_seed"][s][m]) <= 0.15
                                                         for v in chosen for m in METRICS) for s in range(noise_seeds)]
                   for label in compared},
                **{f"mean_abs_{label}": float(np.mean([abs(d[m]) for v in chosen for d in v[f"{label}_by_seed"]
                                                       for m in METRICS]))
                   for label in compared}}
    if "repeat" in summary:         # the same runs B against their repeats B2, real against real
        real = [runs[groups[name][1]]["real"][m] / v["real"][m] - 1 for name, v in held.items() if "repeat" in v
                for m in METRICS]
        summary["repeat"].update(real_within_15pct=sum(abs(e) <= 0.15 for e in real),
                                 real_mean_abs=float(np.mean(np.abs(real))))
    if out:
        out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1) + "\n")
        plot_replay(runs, out.with_suffix(".png"))
        rows = [f"| {k} | {'yes' if v['in_fit'] else ''} | " + " | ".join(_pct_cell(v["as_is"][m]) for m in METRICS) + " | "
                + " | ".join(_pct_cell(v["calibrated"][m]) for m in METRICS) + " | "
                + " ".join(f"{v['calibration'].get(f, 0.0):.2f}" for f in CALIBRATION_COLUMNS) + " |"
                for k, v in runs.items()]
        out.with_suffix(".md").write_text(
            "| run | in fit | TTFT mean | TTFT P90 | TPOT mean | TPOT P90 | calibrated: TTFT mean | TTFT P90 | TPOT mean "
            "| TPOT P90 | calibration (" + ", ".join(CALIBRATION_COLUMNS) + ") |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            + f"held-out runs: {len(held)}; within 15%: as is {summary['within_15pct_as_is']}, calibrated by the "
              f"session's other run {summary['within_15pct_calibrated']}, of {4 * len(held)} (the first of "
              f"{noise_seeds} noise draws)"
            + (f"; calibrated by the run itself (not a prediction) {summary['within_15pct_self']}" if self_calibrated
               else "") + "\n" + _draws_table(summary)
            + (_repeats_table(runs, groups, summary["repeatability"]) if groups else "")
            + _calibrations_table(summary, "bracketed", "runs B between a run A and a run C", "calibrated by",
                                  BRACKETED_ROWS)
            + _calibrations_table(summary, "repeat", "runs B with a repeat B2", "against run B", REPEAT_ROWS))
    return summary


def _calibrations_table(summary: dict, key: str, title: str, column: str, rows) -> str:
    """The markdown of a replay summary's section ``key`` (``bracketed``: the runs B recorded
    between their session's run A and a run C, ``--after``; ``repeat``: those recorded with a repeat
    B2, ``--repeats``): for each of ``rows`` (its name, its calibration's label) that was simulated,
    run B's figures within 15% per noise draw, their mean and the errors' mean size; below them the
    repeat's real figures against run B's, where the section has them."""
    r = summary.get(key)
    if not r:
        return ""
    lines = [f"\n{title} ({r['runs']} runs, {r['figures']} figures)", "",
             f"| {column} | within 15% per draw | mean | error: mean size |", "|---|---|---|---|"]
    for name, label in rows:
        if (draws := r.get(f"within_15pct_{label}_by_seed")) is not None:
            lines.append(f"| {name} | {draws} | {np.mean(draws):.2f} | {100 * r[f'mean_abs_{label}']:.1f}% |")
    if "real_within_15pct" in r:
        lines.append(f"| the real repeat B2 | {r['real_within_15pct']} | | {100 * r['real_mean_abs']:.1f}% |")
    return "\n".join(lines) + "\n"


# The rows of the replay's two tables of run B calibrated by other runs (``_calibrations_table``):
# by the runs before and after it (the machine's change between runs) and by its repeat (the same
# requests: the other run's requests).
BRACKETED_ROWS = (("run A, before it", "calibrated"), ("run C, after it", "after"),
                  ("runs A and C, around it", "bracketed"), ("the run itself (not a prediction)", "self"))
REPEAT_ROWS = (("simulated, calibrated by run A (other requests, before it)", "calibrated"),
               ("simulated, calibrated by B2 (the same requests, after it)", "repeat"),
               ("simulated, calibrated by the run itself (not a prediction)", "self"))


def repeatability(runs: dict, groups: dict, noise_seeds: int) -> dict:
    """How far the real cluster repeats its own figures, beside the simulator's errors on the same
    runs. ``groups``: by run B's name, the names of it and its repeats in order (the same requests
    sent again in the same cluster). Every two real runs of one workload are compared, the
    later's figure against the earlier's; the simulator (calibrated by the session's run A, each
    noise draw) against each of them. Counted per figure (``METRICS``): within 15%, and the
    differences' sizes."""
    real_pairs, sim_runs = [], []
    for group in groups.values():
        real_pairs += [(x, y) for i, x in enumerate(group) for y in group[i + 1:]]
        sim_runs += group
    by_figure = {}
    for m in METRICS:
        real = [runs[y]["real"][m] / runs[x]["real"][m] - 1 for x, y in real_pairs]
        sim = [d[m] for name in sim_runs for d in runs[name]["calibrated_by_seed"]]
        by_figure[m] = {"real_within_15pct": sum(abs(e) <= 0.15 for e in real), "real_pairs": len(real),
                        "real_mean_abs": float(np.mean(np.abs(real))), "real_max_abs": float(np.max(np.abs(real))),
                        "sim_within_15pct_per_draw": sum(abs(e) <= 0.15 for e in sim) / noise_seeds,
                        "sim_runs": len(sim_runs), "sim_mean_abs": float(np.mean(np.abs(sim))),
                        "sim_max_abs": float(np.max(np.abs(sim)))}
    return {"workloads": len(groups), "real_runs": len(sim_runs), "real_pairs": len(real_pairs),
            "real_within_15pct": sum(f["real_within_15pct"] for f in by_figure.values()),
            "real_figures": 4 * len(real_pairs),
            "sim_within_15pct_per_draw": sum(f["sim_within_15pct_per_draw"] for f in by_figure.values()),
            "sim_figures": 4 * len(sim_runs), "by_figure": by_figure}


def _repeats_table(runs: dict, groups: dict, rep: dict) -> str:
    """The markdown of ``repeatability`` (of ``groups``): each workload's real figures run after
    run, and the simulator's mean error against each run over the draws; then the counts."""
    lines = ["\nthe real cluster against itself (run B's requests sent again: runs B2, ...) and the simulator "
             "(calibrated by run A, mean over the noise draws) against each run\n",
             "| run B | " + " | ".join(f"{m}: real runs (ms) | sim error" for m in METRICS) + " |",
             "|---|" + "---|---|" * len(METRICS)]
    for first, group in sorted(groups.items()):
        cells = []
        for m in METRICS:
            cells.append(" / ".join(f"{runs[g]['real'][m] * 1e3:.2f}" for g in group))
            cells.append(" / ".join(_pct_cell(float(np.mean([d[m] for d in runs[g]["calibrated_by_seed"]]))) for g in group))
        lines.append(f"| {first} | " + " | ".join(cells) + " |")
    lines += ["", "| figure | real pairs within 15% | real difference: mean size, largest | simulator within 15% "
                  "per draw | simulator error: mean size, largest |", "|---|---|---|---|---|"]
    for m, f in rep["by_figure"].items():
        lines.append(f"| {m} | {f['real_within_15pct']} of {f['real_pairs']} | {100 * f['real_mean_abs']:.1f}%, "
                     f"{100 * f['real_max_abs']:.1f}% | {f['sim_within_15pct_per_draw']:.2f} of {f['sim_runs']} | "
                     f"{100 * f['sim_mean_abs']:.1f}%, {100 * f['sim_max_abs']:.1f}% |")
    lines.append(f"| all | {rep['real_within_15pct']} of {rep['real_figures']} | | "
                 f"{rep['sim_within_15pct_per_draw']:.2f} of {rep['sim_figures']} | |")
    return "\n".join(lines) + "\n"


def _draws_table(summary: dict) -> str:
    """The markdown of a replay's noise draws (``replay``): each draw's counts, and per layout and
    figure the calibrated errors' mean, mean size and figures outside 15% per draw."""
    if summary["noise_seeds"] < 2:
        return ""
    lines = [f"\nper noise draw, within 15%: as is {summary['within_15pct_as_is_by_seed']}, calibrated "
             f"{summary['within_15pct_calibrated_by_seed']}"
             + (f", calibrated by the run itself {summary['within_15pct_self_by_seed']}"
                if "within_15pct_self_by_seed" in summary else "") + "\n",
             "| layout | figure | calibrated error, mean | mean size | outside 15% per draw |", "|---|---|---|---|---|"]
    for layout, figures in summary["calibrated_errors"].items():
        for m, e in figures.items():
            lines.append(f"| {layout} | {m} | {100 * e['mean']:+.1f}% | {100 * e['mean_abs']:.1f}% "
                         f"| {e['outside_15pct_per_draw']:.2f} |")
    return "\n".join(lines) + "\n"


def print_table(label: str, c: dict) -> None:
    print(f"\n{label}: {c['requests']} requests ({c['errors']} errors), {c['output_tokens']} output tokens; "
          f"other processes' work ({c['external_series']}) {c['external_load_mean']:.2f} cores "
          f"(max {c['external_load_max']:.2f})")
    print(f"{'metric':<10} {'real (ms)':>10} {'sim (ms)':>10} {'error':>8}   {'sim, no other load':>19} {'error':>8}")
    q, qe = c["sim_without_external_load"], c["rel_error_without_external_load"]
    for k in METRICS:
        print(f"{k:<10} {c['real'][k] * 1e3:10.2f} {c['sim'][k] * 1e3:10.2f} {c['rel_error'][k]:+8.1%}   "
              f"{q[k] * 1e3:19.2f} {qe[k]:+8.1%}")


def repeat_jobs(jobs: list[dict], r: int) -> list[dict]:
    """Run B's requests again as run ``B<r>``: the same prompts, limits and send times, new ids."""
    return [dict(j, id=f"{j['id']}-r{r}") for j in jobs]


def run_cluster(args, jobs_a, jobs_b, jobs_c=None) -> tuple[list[dict], list]:
    import ray

    from thinkserve.cluster.deploy import connect, deploy, ray_cpus_needed, teardown
    cfg = setup_config(args.layout, args.instances, f"sim-fidelity-{os.getpid()}", args.pin)
    say = lambda m: print(f"[cluster] {m}", flush=True)  # noqa: E731
    connect(None, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg), join_running=False,
            settings=cfg.ray, log_to_driver=False)
    loads, background, probes = [], [], []
    try:
        controller, address = deploy(cfg, progress=say)
        for unit in dict.fromkeys(args.probe):     # one by one: a failed start still stops the others
            probes.append(MachineProbe(unit))
        if args.load:
            background = start_load(args.load, args.load_nice)
            say(f"background load: {args.load} x LOAD_LOOP at nice {args.load_nice} (pids "
                f"{', '.join(str(p.pid) for p in background)})")
            time.sleep(2.0)
        warm = [dict(j, id=f"warm-{i}", at=0.2 * i) for i, j in enumerate(jobs_b[:4])]
        asyncio.run(drive(address, warm))
        take_traces(address)             # drop the warm-up's
        out = []
        runs = [("A", jobs_a), ("B", jobs_b)] + [(f"B{r}", repeat_jobs(jobs_b, r))
                                                for r in range(2, 2 + args.repeats)] + ([("C", jobs_c)] if jobs_c else [])
        for name, jobs in runs:
            say(f"run {name}: {len(jobs)} requests over {args.duration:.0f} s")
            loads.append(os.getloadavg())
            monitor = CpuMonitor(outside=[p.pid for p in background])
            monitor.start()
            records, t0 = asyncio.run(drive(address, jobs))
            external = monitor.stop()
            loads.append(os.getloadavg())
            out.append(to_trace(cfg, jobs, records, t0, take_traces(address), f"run {name} ({jobs[0]['id']}...)",
                                external))
            for key, series in (("external_load_unniced", monitor.unniced), ("external_load_weighted", monitor.weighted)):
                out[-1][key] = [[round(t - t0, 4), round(w, 4)] for t, w in series]
            t1 = time.monotonic()
            out[-1]["machine_probe"] = probes[0].samples(t0, t1)
            out[-1]["machine_probe_unit"] = probes[0].unit
            for other in probes[1:]:
                out[-1][f"machine_probe_{other.unit}"] = other.samples(t0, t1)
            out[-1]["conditions"] = {"load": args.load, "load_nice": args.load_nice, "pinned": args.pin,
                                     "prompt_tokens": args.prompt_tokens, "loadavg": loads[-2:]}
    finally:
        stop_load(background)
        for probe in probes:
            probe.stop()
        teardown(cfg.namespace)
        ray.shutdown()
    return out, loads


PLOT_LABELS = {"ttft_mean": "TTFT mean", "ttft_p90": "TTFT P90", "tpot_mean": "TPOT mean", "tpot_p90": "TPOT P90"}


def plot_replay(runs: dict, path: Path) -> None:
    """Each held-out run's simulated figures against the real ones (``replay``'s ``runs``; repeats
    of a run are left out, as in its counts): per figure, the error against the real value, the
    mean over the noise draws with their range, calibrated by the session's other run (and by
    the run itself where the replay did that), the ±15% band, and in each panel's title how many
    of its runs are outside it per draw."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    held = held_out(runs)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.6))
    kinds = [("calibrated_by_seed", "calibrated by the session's other run", "tab:blue", "other run")]
    if any("self_by_seed" in v for v in held.values()):
        kinds.append(("self_by_seed", "calibrated by the run itself (not a prediction)", "tab:orange", "itself"))
    for ax, m in zip(axes.flat, METRICS):
        counts = []
        for key, label, color, short in kinds:
            for layout, marker in (("mixed", "o"), ("pd", "s")):
                pts = [(1e3 * v["real"][m], [d[m] for d in v[key]]) for v in held.values()
                       if v["layout"] == layout and key in v]
                if not pts:
                    continue
                mean = np.array([100 * np.mean(e) for _, e in pts])
                lo = mean - np.array([100 * min(e) for _, e in pts])
                hi = np.array([100 * max(e) for _, e in pts]) - mean
                ax.errorbar([x for x, _ in pts], mean, yerr=[lo, hi], fmt=marker, ms=3.5, color=color, alpha=0.65,
                            lw=0.7, mfc="none" if layout == "pd" else color, label=f"{layout}, {label}")
                outside = sum(abs(e) > 0.15 for _, es in pts for e in es) / len(pts[0][1])
                counts.append(f"{layout} / {short} {outside:.2f}")
        ax.axhspan(-15, 15, color="green", alpha=0.07)
        for y in (-15, 15):
            ax.axhline(y, color="green", lw=0.8, ls="--")
        ax.axhline(0, color="grey", lw=0.6)
        n = sum(v["layout"] == "mixed" for v in held.values()), sum(v["layout"] == "pd" for v in held.values())
        ax.set_title(f"{PLOT_LABELS[m]} — outside 15% per draw (of {n[0]} mixed, {n[1]} pd):\n" + ", ".join(counts),
                     fontsize=8.5)
        ax.set_xlabel("real run (ms)")
        ax.set_ylabel("simulated / real - 1 (%)")
        ax.grid(True, alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.suptitle(f"thinkserve sim --gpu cpu against {len(held)} held-out real runs (tiny-reasoner, 2 instances): "
                 f"mean over the noise draws, bars their range", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layout", choices=("mixed", "pd"), default="mixed")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--rate", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=50.0, help="seconds of arrivals per run")
    ap.add_argument("--max-tokens", type=int, default=1400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load", type=int, default=0, help="background processes (LOAD_LOOP) beside the cluster")
    ap.add_argument("--load-nice", type=int, default=0, help="their nice value")
    ap.add_argument("--after", action="store_true",
                    help="a run C of new requests (--seed + 2) after run B and its repeats: run B is also "
                         "simulated calibrated by runs A and C, before and after it (NAME.C.json[.gz])")
    ap.add_argument("--pin", action="store_true",
                    help="bind each engine thread to a core of its own (pools.<name>.cpus; setup_config)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="prefix each problem with worked examples up to this many prompt tokens")
    ap.add_argument("--out", default=None, help="JSON with both comparisons")
    ap.add_argument("--trace-out", default=None, help="run A's telemetry (the fit's input; .json.gz: gzipped); "
                                                     "run B's goes beside it as *.B.json[.gz]")
    ap.add_argument("--fit-out", default=None, help="write run A's own fit here (the committed fit calibrated by run A beside it: *.calibrated.json)")
    ap.add_argument("--fit", default=None, help="check with this fit (default: the committed cluster/sim/cpu_fit.json); "
                                             "run A's own fit is checked beside it")
    ap.add_argument("--from-traces", nargs=2, metavar=("A", "B"), default=None,
                    help="no cluster: fit and check from two recorded traces")
    ap.add_argument("--replay", nargs="+", metavar="DIR", default=None,
                    help="no cluster: replay every recorded session in these folders with --fit as it is and "
                         "calibrated by the session's other run; --out: the JSON (a markdown table beside it)")
    ap.add_argument("--repeats", type=int, default=0,
                    help="after run B, send run B's requests again this many times (runs B2, B3, ...: the same "
                         "prompts and send times) to measure how far the real cluster repeats its own figures")
    ap.add_argument("--self-calibrated", action="store_true",
                    help="--replay: also calibrate each run by itself (the error left when the machine's speed "
                         "during the run is known; not a prediction)")
    ap.add_argument("--plot-replay", nargs=2, metavar=("JSON", "PNG"), default=None,
                    help="no cluster: plot a replay's JSON (what --replay --out wrote) to PNG")
    ap.add_argument("--probe", nargs="+", choices=machine_probe.UNITS, default=[machine_probe.UNIT],
                    help="the machine probe's units, each run beside the cluster: the first is the traces' "
                         "machine_probe, the others' samples go beside it as machine_probe_<unit>")
    ap.add_argument("--replay-probe", choices=machine_probe.UNITS, default=None,
                    help="--replay: replay with this unit's probe (runs recorded with it in --probe)")
    ap.add_argument("--noise-seeds", type=int, default=1,
                    help="--replay: simulate each run with this many draws of the simulation's random parts")
    args = ap.parse_args(argv)
    if args.plot_replay:
        plot_replay(json.loads(Path(args.plot_replay[0]).read_text())["runs"], Path(args.plot_replay[1]))
        print(f"wrote {args.plot_replay[1]}")
        return 0
    if args.replay:
        from thinkserve.cluster.sim.cost import CPU_FIT_PATH
        if args.noise_seeds < 1:
            ap.error(f"--noise-seeds {args.noise_seeds}: at least 1")
        summary = replay(args.replay, Path(args.fit) if args.fit else CPU_FIT_PATH,
                         Path(args.out) if args.out else None, noise_seeds=args.noise_seeds,
                         self_calibrated=args.self_calibrated, probe=args.replay_probe)
        print(json.dumps(summary, indent=1))
        return 0
    if not 0 <= args.repeats <= MAX_REPEATS:
        ap.error(f"--repeats {args.repeats}: must be in [0, {MAX_REPEATS}]")
    loads, repeats, trace_c = [], [], None
    if args.from_traces:
        trace_a, trace_b = (fit_sim_cpu.load_trace(p) for p in args.from_traces)
    else:
        from thinkserve.workers.loader import resolve_model_path
        from thinkserve.workers.tokenizer import Tokenizer
        model_dir = Path(resolve_model_path("tiny-reasoner"))
        tok = Tokenizer.from_pretrained(model_dir)
        context = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
        jobs = lambda seed: make_jobs(args.rate, args.duration, seed, args.max_tokens, tok,  # noqa: E731
                                      args.prompt_tokens, context)
        (trace_a, trace_b, *repeats), loads = run_cluster(args, jobs(args.seed), jobs(args.seed + 1),
                                                          jobs(args.seed + 2) if args.after else None)
        trace_c = repeats.pop() if args.after else None
        if args.trace_out:
            out = Path(args.trace_out)
            out.parent.mkdir(parents=True, exist_ok=True)
            for trace, path in ((trace_a, out), (trace_b, run_path(out, "B")),
                                *((t, run_path(out, f"B{r}")) for r, t in enumerate(repeats, 2)),
                                *(((trace_c, run_path(out, "C")),) if trace_c else ())):
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
    # The committed fit calibrated by run A (fit_sim_cpu.calibrate: this machine's speed now).
    committed_fit = json.loads(committed.read_text())
    cal = fit_sim_cpu.calibrate(committed_fit, trace_a)
    cal_path = fit_sim_cpu.write_calibrated(committed_fit, cal, fit_path.with_name(fit_path.stem + ".calibrated.json"))
    calibrated = compare(trace_b, cal_path)
    print(f"\nchecked with {committed}")
    print_table("run B (validation: not in the fit)", check)
    print_table("run A (in-sample when the checked fit was made from it)", insample)
    print_table("run B with run A's own fit", own)
    print_table(f"run B with the fit calibrated by run A ({fit_sim_cpu.describe_calibration(cal)})", calibrated)
    bracketed = None
    if trace_c is not None:
        around = fit_sim_cpu.calibrate(committed_fit, trace_a, trace_c)
        bracketed = compare(trace_b, fit_sim_cpu.write_calibrated(committed_fit, around,
                                                                  fit_path.with_name(fit_path.stem + ".bracketed.json")))
        print_table(f"run B with the fit calibrated by runs A and C, before and after it "
                    f"({fit_sim_cpu.describe_calibration(around)})", bracketed)
    repeated = []
    for r, trace in enumerate(repeats, 2):
        real = stats(trace)
        rep = {"real": real, "vs_run_b": {k: (real[k] - check["real"][k]) / check["real"][k] for k in METRICS},
               "calibrated": compare(trace, cal_path)}
        repeated.append(rep)
        print(f"\nrun B{r}, run B's requests again (the real cluster against itself; target <= 15%)")
        print(f"{'metric':<10} {'run B (ms)':>10} {f'run B{r} (ms)':>12} {'difference':>11}   "
              f"{'sim, calibrated':>15} {'error':>8}")
        for k in METRICS:
            c = rep["calibrated"]
            print(f"{k:<10} {check['real'][k] * 1e3:10.2f} {real[k] * 1e3:12.2f} {rep['vs_run_b'][k]:+11.1%}   "
                  f"{c['sim'][k] * 1e3:15.2f} {c['rel_error'][k]:+8.1%}")
    if loads:
        print("\nload average (1/5/15 min) before/after each run (A, B, repeats): "
              + ", ".join("/".join(f"{x:.2f}" for x in la) for la in loads))
    if args.out:
        Path(args.out).write_text(json.dumps({"fit_checked": committed_fit, "run_b": check,
                                              "run_a": insample, "own_fit": fit, "run_b_own_fit": own,
                                              "calibration": cal, "run_b_calibrated": calibrated,
                                              "repeats": repeated, "run_b_bracketed": bracketed,
                                              "loadavg": loads, "args": vars(args)},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
