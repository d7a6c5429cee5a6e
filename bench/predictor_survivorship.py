"""How the Conductor's online length predictor moves in a start-up under load, at one arrival rate
and at a multiple of it: fed finished lengths only, also told when a running branch passes the
long threshold (``Conductor.observe_running``), and with the clock (``now``: the predictor's
pace, ``PredictorConfig.steps_per_s``; ``decode_s``: short finishes held until they would have
passed the threshold, ``ConductorConfig.survivorship_delay``), as the simulator and the cluster
now drive it.

The reasoning mix's requests arrive at each of ``--rates``; every branch decodes at a fixed
``--tpot`` after a fixed ``--ttft``, so it finishes ``ttft + length x tpot`` after arrival and
passes the threshold ``ttft + (threshold + 1) x tpot`` after it (no queueing, no placement: only
the order and the times at which the predictor hears things). The predictor starts from a
fitted state (``--start warm``, as the study's Conductor: ``fit_length_predictor`` on a warm-up
trace of another seed) or uninformed (``--start cold``). Printed every ``--every`` seconds: the
mean predicted P(len > threshold) over the first 50 long-kind and 50 short-kind prompts, against
the truth (the share of that kind's branches above it). ``--out DIR`` writes
``DIR/survivorship.json`` and ``DIR/survivorship.png``.

    python bench/predictor_survivorship.py --rates 55 440 --seconds 300 --out bench/data/predictor_survivorship
"""
from __future__ import annotations

import argparse
import heapq
import json
import time
from pathlib import Path

from thinkserve.cluster.sim.conductor_driver import fit_length_predictor
from thinkserve.cluster.sim.setup import warm_up_workload
from thinkserve.cluster.sim.workload import LONG, SHORT, ReasoningMix
from thinkserve.router.conductor import Conductor, ConductorConfig
from thinkserve.router.predictor import features_for

MAX_MODEL_LEN = 32768 + 4096
# name: (observe_running, with the clock)
MODES = {"finished only": (False, False), "+ observe_running": (True, False),
         "+ observe_running, paced + held": (True, True)}


def replay(reqs, features, state, threshold: int, ttft: float, tpot: float, running: bool, clock: bool,
           probes: dict, every: float, until: float) -> dict:
    """The mean predicted P(len > threshold) of each probe set every ``every`` seconds to ``until``."""
    c = Conductor(ConductorConfig(long_threshold=threshold))
    if state is not None:
        c.predictor.load_state(state)
    events = []
    for r, f in zip(reqs, features):
        if r.arrival > until:
            break
        for b, length in enumerate(r.output_lens):
            heapq.heappush(events, (r.arrival + ttft + length * tpot, len(events), f, length, b, True))
            if running and length > threshold:
                heapq.heappush(events, (r.arrival + ttft + (threshold + 1) * tpot, len(events), f, length, b, False))
    out = {name: [] for name in probes}
    learned, t_next = {}, every

    def sample():
        for name, fs in probes.items():
            out[name].append(sum(c.predictor.predict(x).prob_greater(threshold) for x in fs) / len(fs))

    while t_next <= until:
        if events and events[0][0] <= t_next:
            t, _, f, length, b, finish = heapq.heappop(events)
            now = t if clock else None
            if finish:
                c.observe_finished(f, length, at_least=learned.pop((id(f), b), 0), now=now,
                                   decode_s=length * tpot if clock else None)
            else:
                learned[(id(f), b)] = c.observe_running(f, threshold + 1, now)
        else:
            sample()
            t_next += every
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[55.0, 440.0])
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--threshold", type=int, default=2048)
    p.add_argument("--ttft", type=float, default=0.1)
    p.add_argument("--tpot", type=float, default=0.03)
    p.add_argument("--every", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", choices=("warm", "cold"), default="warm")
    p.add_argument("--warm-up-requests", type=int, default=2000)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    t0 = time.process_time()
    runs = {}
    for rate in args.rates:
        reqs = ReasoningMix().generate(rate, int(rate * args.seconds) + 1, args.seed, max_model_len=MAX_MODEL_LEN)
        cfg = ConductorConfig(long_threshold=args.threshold).predictor
        features = [features_for(r.prompt_tokens(), cfg, max_tokens=r.max_tokens) for r in reqs]
        state = None if args.start == "cold" else fit_length_predictor(warm_up_workload(
            "reasoning", rate=rate, requests=args.warm_up_requests, skip=0, seed=args.seed,
            max_model_len=MAX_MODEL_LEN))
        probes = {cls: [f for r, f in zip(reqs, features) if r.cls == cls][:50] for cls in (LONG, SHORT)}
        truth = {}
        for cls in (LONG, SHORT):
            lens = [n for r in reqs if r.cls == cls for n in r.output_lens]
            truth[cls] = sum(n > args.threshold for n in lens) / len(lens)
        runs[rate] = {"truth": truth, "modes": {
            name: replay(reqs, features, state, args.threshold, args.ttft, args.tpot, running, clock, probes,
                         args.every, args.seconds) for name, (running, clock) in MODES.items()}}
    times = [(i + 1) * args.every for i in range(int(args.seconds / args.every))]
    for cls in (LONG, SHORT):
        print(f"P(len > {args.threshold}) of {cls}-kind prompts, predicted ({args.start} start; truth "
              + ", ".join(f"{runs[r]['truth'][cls]:.3f} at {r:g} req/s" for r in args.rates) + ")")
        cols = [(r, m) for m in MODES for r in args.rates]
        print(f"{'t (s)':>6} " + " ".join(f"{m[:22] + ' @' + format(r, 'g'):>28}" for r, m in cols))
        for i, t in enumerate(times):
            if t % max(args.every, 20.0) == 0 or t <= 60:
                print(f"{t:6.0f} " + " ".join(f"{runs[r]['modes'][m][cls][i]:28.3f}" for r, m in cols))
    print(f"cpu {time.process_time() - t0:.0f} s")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"survivorship-{args.start}.json").write_text(json.dumps(
            {"args": vars(args), "t": times, "runs": {str(r): v for r, v in runs.items()}}, indent=1))
        plot(out / f"survivorship-{args.start}.png", times, runs, args)


def plot(path: Path, times, runs, args) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = dict(zip(MODES, ("tab:red", "tab:orange", "tab:blue")))
    for ax, cls in zip(axes, (LONG, SHORT)):
        for i, rate in enumerate(args.rates):
            for m in MODES:
                ax.plot(times, runs[rate]["modes"][m][cls], color=colors[m], linestyle=("-", "--", ":")[i % 3],
                        label=f"{m} @ {rate:g} req/s")
            ax.axhline(runs[rate]["truth"][cls], color="grey", linestyle=("-", "--", ":")[i % 3], linewidth=0.8)
        ax.set_title(f"{cls}-kind prompts ({args.start} start)")
        ax.set_xlabel("simulated s")
        ax.set_ylim(0, 1)
    axes[0].set_ylabel(f"mean predicted P(len > {args.threshold})")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
