"""``thinkserve bench --rate R --duration S --workload reasoning|PATH.jsonl``: load a running cluster.

Open loop: requests are sent at their arrival times whether or not earlier ones have answered
(Poisson arrivals at ``--rate`` per second for ``reasoning``; a trace's own timestamps, rescaled
to ``--rate`` if given, for a JSONL trace), so queueing shows up as latency instead of slowing the
sender. Every request streams over gRPC (the same path as ``thinkserve submit``).

    reasoning    tiny-reasoner problems of its realistic level mix (workers/tiny_reasoner/tasks.py)
    PATH.jsonl   a Mooncake-format trace ({"timestamp" ms, "input_length", "output_length",
                 "hash_ids"}): synthetic token ids, equal for equal hash ids (so shared prefixes
                 stay shared), lengths clipped to the model's context; output lengths are forced
                 (ignore_eos) so the trace's decode work is replayed

Each request gets a priority class drawn from ``--mix``; the summary gives TTFT, TPOT (time per
output token after the first) and end-to-end latency percentiles per class, and ``--out`` a PNG of
their CDFs (matplotlib, the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass

from .admin_cli import _server_arg, resolve_admin, server_or_exit

CLASSES = ("interactive", "standard", "batch")
_HASH_BLOCK = 512        # tokens per hash id in Mooncake traces
# Refusals that will not go away by themselves: after this many, and nothing else, stop sending.
_SYSTEMATIC = frozenset({"INVALID_ARGUMENT", "UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED"})
_GIVE_UP_AFTER = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    p.add_argument("--duration", type=float, required=True, help="seconds of arrivals to send")
    p.add_argument("--workload", default="reasoning", help="'reasoning' or a Mooncake-format .jsonl trace")
    p.add_argument("--mix", default="interactive=0.25,standard=0.5,batch=0.25",
                   help="priority classes and their shares")
    p.add_argument("--n", type=int, default=1, help="Best-of-N branches per request")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="reasoning: output cap per request (clipped to the model's context)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, seconds")
    p.add_argument("--out", default="bench-latency.png", help="latency CDF PNG ('' for none)")
    p.add_argument("--json", metavar="FILE", help="also write every request's record and the summary here")
    _server_arg(p)


@dataclass
class Job:
    at: float                         # seconds after the start
    klass: str
    prompt: str | tuple[int, ...]
    max_tokens: int
    ignore_eos: bool = False
    n: int = 0                        # Best-of-N branches; 0: --n
    temperature: float | None = None  # None: --temperature
    seed: int | None = None           # sampling seed: the same samples wherever the job runs


@dataclass
class Record:
    klass: str
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    tokens: int = 0                   # output tokens of the longest branch
    error: str = ""                   # the gRPC status code's name
    detail: str = ""
    server_ms: dict | None = None     # the server's Timings (queued, prefill, handoff, ttft ms), if sent
    request_id: str = ""              # the server's id (its parts are "ID#..." in the step telemetry)

    def ttft(self):
        return None if self.first is None else self.first - self.sent

    def tpot(self):
        if self.first is None or self.end is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)

    def e2e(self):
        return None if self.end is None or self.error else self.end - self.sent


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        name, _, w = part.partition("=")
        if name not in CLASSES:
            raise ValueError(f"--mix: unknown class {name!r}; classes are {', '.join(CLASSES)}")
        mix[name] = float(w or 1)
    if sum(mix.values()) <= 0:
        raise ValueError("--mix: the shares add up to 0")
    return mix


def poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    out, t = [], rng.expovariate(rate)
    while t < duration:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def reasoning_jobs(rate, duration, mix, max_tokens, rng, seed, prompt_len=len, max_model_len=1 << 30) -> list[Job]:
    """Poisson arrivals of tiny-reasoner problems; ``max_tokens`` is clipped so the prompt
    (``prompt_len(text)`` tokens) and the output fit the model's context."""
    from thinkserve.workers.tiny_reasoner import REALISTIC_MIX, prompt_for
    from thinkserve.workers.tiny_reasoner.tasks import sample_mix
    times = poisson_times(rate, duration, rng)
    problems = sample_mix(REALISTIC_MIX, len(times), seed)
    classes, weights = zip(*mix.items())
    jobs = []
    for t, p in zip(times, problems):
        text = prompt_for(p)
        jobs.append(Job(t, rng.choices(classes, weights)[0], text, min(max_tokens, max_model_len - prompt_len(text))))
    return jobs


def trace_jobs(path, rate, duration, mix, rng, vocab_size: int, max_model_len: int) -> list[Job]:
    """Replay a Mooncake trace: arrival times (rescaled to ``rate`` if given) and lengths."""
    rows = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    raise ValueError(f"{path}:{i}: not JSON") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = rows[0]["timestamp"]
    span = max((rows[-1]["timestamp"] - t0) / 1000.0, 1e-9)
    scale = (len(rows) / span) / rate if rate else 1.0      # trace rate / wanted rate: <1 compresses time
    classes, weights = zip(*mix.items())
    blocks: dict[int, tuple[int, ...]] = {}
    lo = min(3, vocab_size - 1)                  # keep clear of the usual pad / bos / eos ids

    def block(h):
        if h not in blocks:
            r = random.Random(h)
            blocks[h] = tuple(r.randrange(lo, vocab_size) for _ in range(_HASH_BLOCK))
        return blocks[h]
    jobs = []
    for row in rows:
        at = (row["timestamp"] - t0) / 1000.0 * scale
        if at >= duration:
            break
        n_in = max(1, min(int(row["input_length"]), max_model_len // 2))
        n_out = max(1, min(int(row["output_length"]), max_model_len - n_in - 1))
        ids = [t for h in row.get("hash_ids", ()) for t in block(h)][:n_in]
        if len(ids) < n_in:                      # no hash ids for the tail: private tokens
            r = random.Random(f"{row['timestamp']}/{len(jobs)}")
            ids += [r.randrange(lo, vocab_size) for _ in range(n_in - len(ids))]
        jobs.append(Job(at, rng.choices(classes, weights)[0], tuple(ids), n_out, ignore_eos=True))
    return jobs


def _request(job: Job, args):
    from thinkserve.protos.thinkserve.v1 import common_pb2
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    temperature = args.temperature if job.temperature is None else job.temperature
    sp = pb.SamplingParams(max_tokens=job.max_tokens, temperature=temperature, ignore_eos=job.ignore_eos)
    if job.seed is not None:
        sp.seed = job.seed
    req = pb.GenerateRequest(sampling=sp, n=job.n or args.n,
                             priority=pb.PriorityClass.Value(f"PRIORITY_CLASS_{job.klass.upper()}"))
    if isinstance(job.prompt, str):
        req.text = job.prompt
    else:
        req.token_ids.CopyFrom(common_pb2.TokenIds(ids=job.prompt))
    return req


async def run_load(stub, jobs: list[Job], args, metadata, on_done=None) -> list[Record]:
    import grpc
    records = [Record(j.klass) for j in jobs]
    start = time.monotonic()

    failed: list[str] = []

    async def one(job: Job, rec: Record):
        await asyncio.sleep(max(0.0, start + job.at - time.monotonic()))
        if len(failed) >= _GIVE_UP_AFTER and len(set(failed)) == 1 and failed[0] in _SYSTEMATIC:
            rec.error, rec.detail = "NOT_SENT", f"the first requests all failed with {failed[0]}"
            if on_done is not None:
                on_done(rec)
            return
        rec.sent = time.monotonic()
        lengths: dict[int, int] = {}
        try:
            async for msg in stub.Generate(_request(job, args), timeout=args.timeout, metadata=metadata):
                if not rec.request_id:
                    rec.request_id = msg.request_id
                if msg.deltas and rec.first is None and any(d.token_ids for d in msg.deltas):
                    rec.first = time.monotonic()
                for d in msg.deltas:
                    lengths[d.index] = d.num_tokens
                if msg.HasField("timings"):
                    t = msg.timings
                    rec.server_ms = {"queued": t.queued_ms, "prefill": t.prefill_ms, "handoff": t.handoff_ms,
                                     "ttft": t.ttft_ms}
            rec.end = time.monotonic()
            rec.tokens = max(lengths.values(), default=0)
        except grpc.RpcError as e:
            rec.end, rec.error, rec.detail = time.monotonic(), e.code().name, e.details() or ""
            if rec.error in _SYSTEMATIC and all(r.error for r in records if r.end is not None):
                failed.append(rec.error)            # every answer so far refused: likely every next one too
        if on_done is not None:
            on_done(rec)
    await asyncio.gather(*(one(j, r) for j, r in zip(jobs, records)))
    return records


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else float("nan")


def summarize(records: list[Record], wall_s: float) -> dict:
    out = {}
    for klass in (*CLASSES, "all"):
        rs = [r for r in records if klass in ("all", r.klass)]
        if not rs:
            continue
        row = {"requests": len(rs), "errors": sum(1 for r in rs if r.error),
               "output_tokens": sum(r.tokens for r in rs if not r.error)}
        for metric in ("ttft", "tpot", "e2e"):
            vals = [v for r in rs if not r.error and (v := getattr(r, metric)()) is not None]
            row[metric] = {f"p{q}": percentile(vals, q) for q in (50, 90, 99)} | {"mean": sum(vals) / len(vals) if vals else float("nan")}
        out[klass] = row
    out["all"]["wall_s"] = wall_s
    out["all"]["output_tokens_per_s"] = out["all"]["output_tokens"] / wall_s if wall_s > 0 else 0.0
    return out


def format_summary(summary: dict) -> str:
    lines = [f"{'class':<12} {'reqs':>5} {'err':>4}   {'TTFT p50/p90/p99 (ms)':>24}   {'TPOT p50/p90/p99 (ms)':>22}"
             f"   {'e2e p50/p90/p99 (s)':>22}"]
    for klass, row in summary.items():
        def trio(metric, scale, fmt):
            return "/".join(fmt.format(row[metric][f"p{q}"] * scale) for q in (50, 90, 99))
        lines.append(f"{klass:<12} {row['requests']:>5} {row['errors']:>4}   {trio('ttft', 1000, '{:.0f}'):>24}   "
                     f"{trio('tpot', 1000, '{:.1f}'):>22}   {trio('e2e', 1, '{:.2f}'):>22}")
    a = summary["all"]
    lines.append(f"{a['output_tokens']} output tokens in {a['wall_s']:.1f}s: {a['output_tokens_per_s']:.0f} tok/s")
    return "\n".join(lines)


def plot_cdf(records: list[Record], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (metric, unit, scale) in zip(axes, (("ttft", "TTFT (ms)", 1000), ("tpot", "TPOT (ms)", 1000),
                                                ("e2e", "end to end (s)", 1))):
        for klass in CLASSES:
            vals = sorted(v * scale for r in records if r.klass == klass and not r.error
                          and (v := getattr(r, metric)()) is not None)
            if vals:
                ax.plot(vals, [(i + 1) / len(vals) for i in range(len(vals))], label=f"{klass} ({len(vals)})")
        ax.set_xlabel(unit)
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_limits(model: str):
    """(tokenizer, context length) of the served model, read from its directory here (the
    frontend accepts token ids below the tokenizer's size, which may be under the model's)."""
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.model_config import ModelConfig
    from thinkserve.workers.tokenizer import Tokenizer
    path = resolve_model_path(model)
    return Tokenizer.from_pretrained(path), ModelConfig.from_pretrained(path).max_model_len


def run(args) -> int:
    try:
        from tqdm import tqdm
    except ImportError:
        print("thinkserve bench: needs the bench extra (pip install 'thinkserve[bench]')", file=sys.stderr)
        return 2
    try:
        mix = parse_mix(args.mix)
    except ValueError as e:
        print(f"thinkserve bench: {e}", file=sys.stderr)
        return 2
    if args.rate <= 0 or args.duration <= 0:
        print("thinkserve bench: --rate and --duration must be > 0", file=sys.stderr)
        return 2
    return asyncio.run(_run(args, mix, tqdm))


async def _run(args, mix, tqdm) -> int:
    import grpc

    from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc

    from .admin_cli import _fail
    from .auth import client_metadata, open_channel
    md = client_metadata()
    rng = random.Random(args.seed)
    try:
        admin_ch = open_channel(resolve_admin(args), args.tls_ca, aio=True)
        try:
            st = await admin_pb2_grpc.AdminStub(admin_ch).GetStatus(admin_pb2.GetStatusRequest(), timeout=15,
                                                                    metadata=md)
        finally:
            await admin_ch.close()
        tok, ctx = _model_limits(st.model)
        if args.workload == "reasoning":
            jobs = reasoning_jobs(args.rate, args.duration, mix, args.max_tokens, rng, args.seed,
                                  lambda text: len(tok.encode(text)), ctx)
        else:
            jobs = trace_jobs(args.workload, args.rate, args.duration, mix, rng, tok.vocab_size, ctx)
    except grpc.RpcError as e:
        return _fail("bench", e)
    except (OSError, ValueError, KeyError) as e:
        print(f"thinkserve bench: workload: {e}", file=sys.stderr)
        return 2
    if not jobs:
        print("thinkserve bench: no arrivals in that duration; raise --rate or --duration", file=sys.stderr)
        return 2
    server = server_or_exit("bench", args)
    if server is None:
        return 2
    channel = open_channel(server, args.tls_ca, aio=True)
    try:
        await asyncio.wait_for(channel.channel_ready(), 10)
    except asyncio.TimeoutError:
        await channel.close()
        print(f"thinkserve bench: no thinkserve frontend answers at {server}; is it up?", file=sys.stderr)
        return 1
    stub = inference_pb2_grpc.InferenceStub(channel)
    print(f"bench: {len(jobs)} requests over {args.duration:.0f}s ({args.workload}, open loop)", flush=True)
    bar = tqdm(total=len(jobs), unit="req", dynamic_ncols=True)
    errors = 0

    def done(rec: Record):
        nonlocal errors
        errors += bool(rec.error)
        bar.update(1)
        bar.set_postfix(errors=errors, refresh=False)
    t0 = time.monotonic()
    try:
        records = await run_load(stub, jobs, args, md, done)
    finally:
        bar.close()
        await channel.close()
    wall = time.monotonic() - t0
    summary = summarize(records, wall)
    print(format_summary(summary))
    codes = sorted({r.error for r in records if r.error})
    if codes:
        for c in codes:
            first = next(r for r in records if r.error == c)
            print(f"errors: {c} x{sum(1 for r in records if r.error == c)} (e.g. {first.detail})")
    if args.out:
        plot_cdf(records, args.out, f"thinkserve bench: {args.workload}, {args.rate:g} req/s for {args.duration:g}s")
        print(f"latency CDF: {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "records": [asdict(r) for r in records]}, f, indent=1)
    return 1 if all(r.error for r in records) else 0
