"""``thinkserve sim``: replay a workload on simulated GPUs under several policies.

    thinkserve sim --workload reasoning --policy colocated pd conductor --gpus 16 --gpu h200 \
        --model qwen2.5-7b --rate 20 40 80 --requests 5000 --seed 0 --out results/

Each (policy, rate) pair is one simulation of the same request stream; DIR/results.json holds
their summaries, DIR/latency_cdf.png the latency CDFs, DIR/goodput_vs_rate.png the goodput and SLO
attainment curves when several rates are given.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def add_arguments(p) -> None:
    from .sim.setup import GPU_CHOICES, POLICIES
    from .sim.hardware import MODELS
    p.add_argument("--workload", required=True, help="'reasoning' (generated mix) or a Mooncake-format TRACE.jsonl")
    p.add_argument("--policy", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="deployments to compare on the same requests")
    p.add_argument("--gpus", type=int, required=True, help="GPUs per deployment (equal for every policy)")
    p.add_argument("--gpu", choices=GPU_CHOICES, default="h200")
    p.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b")
    p.add_argument("--cpu-fit", default=None,
                   help="--gpu cpu: the fit to price with (default: the committed cluster/sim/cpu_fit.json; "
                        "bench/fit_sim_cpu.py writes one, --calibrate one calibrated to this machine now)")
    p.add_argument("--rate", type=float, nargs="*", default=None,
                   help="requests/s (reasoning: required; trace: rescales its timestamps; several: a sweep)")
    p.add_argument("--requests", type=int, default=1000, help="requests to simulate (trace: the first K)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for results.json and plots")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: 16 on cpu, 64 on GPUs)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="each engine's batch cap (vLLM's default 256)")
    p.add_argument("--pool-max-num-seqs", nargs="+", metavar="POOL=N", default=None,
                   help="a pool's engines' batch cap instead of --max-num-seqs, e.g. short_decode=1024 "
                        "(the cluster's pools.<name>.engine.max_num_seqs)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefill-share", type=float, default=0.25, help="pd/conductor: share of prefill instances")
    p.add_argument("--long-share", type=float, default=0.5, help="conductor: share of decode instances in the long pool")
    p.add_argument("--long-threshold", type=int, default=2048, help="router: predicted length above it goes long")
    p.add_argument("--no-prediction", action="store_true", help="conductor: the router sees only the length cap")
    p.add_argument("--no-slo-classes", action="store_true", help="conductor: one priority class for all")
    p.add_argument("--no-promotion", action="store_true", help="conductor: no promotion to the long pool")
    p.add_argument("--router", choices=("conductor", "least-loaded"), default="conductor",
                   help="conductor policy: the Conductor, or LeastLoadedPolicy's length threshold on three pools")
    p.add_argument("--no-early-consensus", action="store_true", help="conductor: Best-of-N branches all run out")
    p.add_argument("--no-prefix-affinity", action="store_true",
                   help="conductor: no prefix index (placement ignores which prefill instance caches the prompt)")
    p.add_argument("--conditional-disagg", action="store_true",
                   help="conductor: a short prompt may prefill on its short_decode instance when that is "
                        "estimated faster than the prefill pool plus the hand-off (router.conditional_disagg)")
    p.add_argument("--length-predictor", default="cold", metavar="cold|warm|PATH",
                   help="conductor: the length predictor's starting state: cold (uninformed, learns online), "
                        "warm (fitted on --warm-up-requests of a warm-up trace: the reasoning mix with another "
                        "seed, or a trace's requests after the replayed ones), or a state file "
                        "(LengthPredictor.state() JSON, as router.length_predictor)")
    p.add_argument("--warm-up-requests", type=int, default=2000, help="--length-predictor warm: requests fitted on")
    p.add_argument("--early-stop", default="adaptive",
                   help="conductor: the router.consensus stopping rule (none, unbeatable, adaptive, dirichlet, esc)")
    p.add_argument("--slo-ttft", type=float, nargs=2, metavar=("SHORT", "LONG"), default=None)
    p.add_argument("--slo-tpot", type=float, nargs=2, metavar=("SHORT", "LONG"), default=None)
    p.add_argument("--warmup", type=float, default=0.0,
                   help="steady-state measurement: seconds of arrivals before the measured window")
    p.add_argument("--window", type=float, default=None,
                   help="measure only the requests arriving in [warmup, warmup+window); arrivals go on, and the "
                        "run stops --cooldown s after the window (reasoning: --requests is then rate x that time)")
    p.add_argument("--cooldown", type=float, default=30.0,
                   help="with --window: seconds simulated after it; requests still running then are judged on "
                        "their TTFT and on their TPOT so far (must be >= the TTFT SLOs)")
    p.add_argument("--step-by-step", action="store_true", help="no bulk decode runs (slow; for checking)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _missing_conductor_features(args) -> list[str]:
    """Promotion and early consensus belong to the Conductor and router.consensus; until those
    modules exist, the simulator has nothing real to run for them."""
    import importlib.util
    missing = []
    if (not args.no_promotion and args.router == "conductor"
            and importlib.util.find_spec("thinkserve.router.conductor") is None):
        missing.append("promotion (thinkserve.router.conductor)")
    if not args.no_early_consensus and importlib.util.find_spec("thinkserve.router.consensus") is None:
        missing.append("early consensus (thinkserve.router.consensus)")
    return missing


class Progress:
    def __init__(self, label: str, quiet: bool, horizon: float | None = None):
        self.label, self.quiet, self.t0, self.last = label, quiet, time.monotonic(), 0.0
        self.horizon = horizon
        self.ended = False

    def __call__(self, done: int, total: int, sim_time: float) -> None:
        now = time.monotonic()
        if self.quiet or (now - self.last < 0.25 and done < total):
            return
        self.last = now
        width = 30
        share = done / max(1, total) if self.horizon is None else min(1.0, sim_time / self.horizon)
        fill = int(width * share)
        sys.stderr.write(f"\r{self.label:<28} [{'#' * fill}{'.' * (width - fill)}] {done}/{total} requests, "
                         f"simulated {sim_time:8.1f} s, wall {now - self.t0:6.1f} s")
        if done >= total:
            self.end()
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet and self.last and not self.ended:
            self.ended = True
            sys.stderr.write("\n")


def run(args) -> int:
    from .sim.metrics import summarize
    from .sim.plots import plot_all
    from .sim.setup import Deployment, build, default_slo, make_cost, make_workload, parse_pool_caps

    try:
        pool_caps = parse_pool_caps(args.pool_max_num_seqs)
    except ValueError as e:
        print(f"thinkserve sim: --pool-max-num-seqs: {e}", file=sys.stderr)
        return 2
    for name in ("gpus", "requests"):
        if getattr(args, name) < 1:
            print(f"thinkserve sim: --{name} must be >= 1", file=sys.stderr)
            return 2
    rates = args.rate or [None]
    if any(r is not None and r <= 0 for r in rates):
        print("thinkserve sim: --rate must be > 0", file=sys.stderr)
        return 2
    if "conductor" in args.policy:
        from thinkserve.router.consensus import RULES
        if args.early_stop not in RULES:
            print(f"thinkserve sim: --early-stop must be one of {list(RULES)}, got {args.early_stop!r}",
                  file=sys.stderr)
            return 2
        missing = _missing_conductor_features(args)
        if missing:
            print("thinkserve sim: the conductor policy's " + " and ".join(missing) + " are not in this build; "
                  "pass --no-promotion / --no-early-consensus to simulate three pools without them",
                  file=sys.stderr)
            return 2
    try:
        cost = make_cost(args.gpu, args.model, cpu_fit=args.cpu_fit)
    except (ValueError, FileNotFoundError) as e:
        print(f"thinkserve sim: {e}", file=sys.stderr)
        return 2
    block_size = args.block_size or (16 if args.gpu == "cpu" else 64)
    slo = default_slo(args.gpu, args.slo_ttft, args.slo_tpot)
    window = horizon = None
    if args.window is not None:
        if args.window <= 0 or args.warmup < 0 or args.cooldown < max(slo.ttft.values()):
            print(f"thinkserve sim: --window must be > 0, --warmup >= 0 and --cooldown >= the largest TTFT SLO "
                  f"({max(slo.ttft.values())} s)", file=sys.stderr)
            return 2
        window = (args.warmup, args.warmup + args.window)
        horizon = window[1] + args.cooldown
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for rate in rates:
        try:
            count = args.requests
            if horizon is not None and args.workload == "reasoning":
                count = int(rate * horizon) + 1  # arrivals up to the horizon: the load stays steady
            requests = make_workload(args.workload, rate=rate, requests=count, seed=args.seed,
                                     max_model_len=cost.model.max_model_len)
        except (ValueError, OSError) as e:
            print(f"thinkserve sim: --workload: {e}", file=sys.stderr)
            return 2
        try:
            predictor_state = _length_predictor(args, rate, count, cost) if "conductor" in args.policy else None
        except (ValueError, OSError) as e:
            print(f"thinkserve sim: --length-predictor: {e}", file=sys.stderr)
            return 2
        for policy in args.policy:
            dep = Deployment(policy, prefill_share=args.prefill_share, long_share=args.long_share,
                             long_threshold=args.long_threshold, prediction=not args.no_prediction,
                             slo_classes=not args.no_slo_classes, promotion=not args.no_promotion,
                             router=args.router, early_stop="none" if args.no_early_consensus else args.early_stop,
                             prefix_affinity=not args.no_prefix_affinity,
                             conditional_disagg=args.conditional_disagg)
            label = f"{policy} @ {rate if rate is not None else 'trace'}"
            t0 = time.perf_counter()
            progress = Progress(label, args.quiet, horizon)
            try:
                sim = build(requests, dep, cost, args.gpus, block_size=block_size, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, bulk_decode=not args.step_by_step,
                            progress=progress, slo=slo, length_predictor=predictor_state,
                            pool_max_num_seqs=pool_caps).run(horizon)
            except ValueError as e:
                print(f"thinkserve sim: {e}", file=sys.stderr)
                return 2
            wall = time.perf_counter() - t0
            progress.end()
            summary = summarize(sim, slo, window)
            summary.update(policy=policy, rate=rate, wall_s=wall,
                           pools={name: len(m) for name, m in sim.pools.items()},
                           router=type(sim.policy).__module__ + "." + type(sim.policy).__name__)
            runs.append((summary, sim))
            a = summary["classes"].get("short", summary["classes"].get("all", {}))
            print(f"{label:<28} SLO {summary['slo_attainment']:6.1%}  goodput {summary['goodput_per_gpu']:.3f} req/s/GPU  "
                  f"short TTFT p99 {a.get('ttft', {}).get('p99', float('nan')):.3f} s  wall {wall:.1f} s")
    results = {
        "workload": args.workload, "gpus": args.gpus, "gpu": args.gpu, "model": args.model, "seed": args.seed,
        **({"cpu_fit": getattr(cost, "source", None), "cpu_calibration": getattr(cost, "calibration", None) or None}
           if args.gpu == "cpu" else {}),
        "requests": args.requests, "block_size": block_size,
        "slo": {"ttft": slo.ttft, "tpot": slo.tpot},
        "runs": [s for s, _ in runs],
        "max_rate_at_90pct_slo": _max_rate(runs),
    }
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    plots = plot_all(runs, out_dir)
    print(f"wrote {out_dir / 'results.json'}" + "".join(f", {p}" for p in plots))
    return 0


def _length_predictor(args, rate, count: int, cost) -> dict | None:
    """The Conductor predictor's starting state for ``--length-predictor`` (None: cold)."""
    choice = args.length_predictor
    if choice == "cold":
        return None
    if choice == "warm":
        from .sim.conductor_driver import fit_length_predictor
        from .sim.setup import warm_up_workload
        return fit_length_predictor(warm_up_workload(args.workload, rate=rate, requests=args.warm_up_requests,
                                                     skip=count, seed=args.seed,
                                                     max_model_len=cost.model.max_model_len))
    from thinkserve.router.predictor import LengthPredictor
    state = json.loads(Path(choice).expanduser().read_text())
    LengthPredictor().load_state(state)   # raises ValueError naming what does not match, before any run
    return state


def _max_rate(runs) -> dict:
    best: dict[str, float | None] = {}
    for s, _ in runs:
        if s["rate"] is None:
            continue
        ok = s["slo_attainment"] >= 0.9
        best.setdefault(s["policy"], None)
        if ok and (best[s["policy"]] is None or s["rate"] > best[s["policy"]]):
            best[s["policy"]] = s["rate"]
    return best
