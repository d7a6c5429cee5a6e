"""How fast the Conductor's online length predictor learns that long chains are long, from a cold
start under load: with finished lengths only, or also told when a running branch passes the long
threshold (``Conductor.observe_running``).

The reasoning mix's requests arrive at ``--rate``; every branch decodes at a fixed ``--tpot``, so
it finishes ``length x tpot`` after arrival and passes the threshold ``threshold x tpot`` after it
(no queueing, no placement: only the order in which the predictor hears things). Printed: the
mean predicted P(len > threshold) over long-kind prompts, against the truth (the share of
long-kind branches above it), every ``--every`` seconds.

    python bench/predictor_survivorship.py --rate 120 --seconds 300
"""
from __future__ import annotations

import argparse
import heapq

from thinkserve.cluster.sim.workload import LONG, ReasoningMix
from thinkserve.router.conductor import Conductor, ConductorConfig
from thinkserve.router.predictor import features_for


def replay(reqs, threshold: int, tpot: float, censored: bool, every: float, until: float) -> list[float]:
    c = Conductor(ConductorConfig(long_threshold=threshold))
    events, probe = [], []
    for r in reqs:
        f = features_for(r.prompt_tokens(), c.config.predictor, max_tokens=r.max_tokens)
        if r.cls == LONG and len(probe) < 50:
            probe.append(f)
        for length in r.output_lens:
            heapq.heappush(events, (r.arrival + length * tpot, len(events), f, length, True))
            if censored and length > threshold:
                heapq.heappush(events, (r.arrival + (threshold + 1) * tpot, len(events), f, length, False))
    out, learned, t_next = [], {}, every
    while events and t_next <= until:
        t, key, f, length, finish = heapq.heappop(events)
        while t > t_next and t_next <= until:
            out.append(sum(c.predictor.predict(x).prob_greater(threshold) for x in probe) / len(probe))
            t_next += every
        if finish:
            c.observe_finished(f, length, at_least=learned.pop(id(f), {}).pop(length, 0) if censored else 0)
        else:
            learned.setdefault(id(f), {})[length] = c.observe_running(f, threshold + 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rate", type=float, default=120.0)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--threshold", type=int, default=2048)
    p.add_argument("--tpot", type=float, default=0.03)
    p.add_argument("--every", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    reqs = ReasoningMix().generate(args.rate, int(args.rate * args.seconds), args.seed, max_model_len=32768 + 4096)
    longs = [n for r in reqs if r.cls == LONG for n in r.output_lens]
    truth = sum(n > args.threshold for n in longs) / len(longs)
    rows = {name: replay(reqs, args.threshold, args.tpot, censored, args.every, args.seconds)
            for name, censored in (("finished only", False), ("+ observe_running", True))}
    print(f"P(len > {args.threshold}) of long-kind prompts, predicted (truth {truth:.3f})")
    print(f"{'t (s)':>6} " + " ".join(f"{name:>18}" for name in rows))
    for i in range(min(map(len, rows.values()))):
        print(f"{(i + 1) * args.every:6.0f} " + " ".join(f"{v[i]:18.3f}" for v in rows.values()))


if __name__ == "__main__":
    main()
