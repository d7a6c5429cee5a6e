"""The machine's speed as a fixed piece of work measures it: what ``bench/sim_fidelity.py`` runs
beside the cluster it records, so that a simulation can replay how fast the machine was.

Every ``INTERVAL_S`` the probe runs its unit (a tiny-reasoner-sized decode step's matrix work, on
one thread: 12 layers of an 8 x 192 batch through a 192 x 768 x 192 MLP) and writes one line,
``<monotonic time> <the unit's CPU time in ms>``: the thread's own CPU time, not the wall time,
so that waiting for a core (the engines' stepping, which the simulator prices itself) does not
count, while a slower host (other tenants of the machine, its clock) does.

``UNIT`` names the unit, and a recorded run carries it (``machine_probe_unit``; a run recorded
before it has the ``narrow`` one): a run's probe is only compared with a probe of the same unit.

- ``wide`` (the default since 2026-12-06): each layer its own weights, 14 MB in all, so that
  every call reads them from beyond the core's caches as the engine reads its ~10 MB of weights
  each step. ~2.7 ms a unit here. Between the runs of a recorded session its level followed the
  engines' decode steps' level more closely than the narrow unit's (docs/simulator.md, "A probe
  with the engine's working set").
- ``narrow``: one pair of weights for every layer (1.2 MB, held in the caches). ~1.7-2 ms;
  over 2 s windows its median moved with the engines' decode steps' speed (correlation 0.5-0.8,
  docs/simulator.md "The machine's own slowness").

    python bench/machine_probe.py OUT [--unit wide|narrow]     # until killed
"""
from __future__ import annotations

import sys
import time

INTERVAL_S = 0.125
LAYERS, BATCH, HIDDEN, INTERMEDIATE = 12, 8, 192, 768
# the units: how many (w1, w2) weight pairs the layers cycle through
UNITS = {"wide": LAYERS, "narrow": 1}
UNIT = "wide"
LEGACY_UNIT = "narrow"          # a recorded run without ``machine_probe_unit``


def main(out_path: str, unit_name: str = UNIT) -> None:
    import torch
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(HIDDEN, INTERMEDIATE, generator=gen), torch.randn(INTERMEDIATE, HIDDEN, generator=gen))
             for _ in range(UNITS[unit_name])]
    x0 = torch.randn(BATCH, HIDDEN, generator=gen)

    def unit():
        x = x0
        for i in range(LAYERS):
            w1, w2 = pairs[i % len(pairs)]
            x = torch.nn.functional.silu(x @ w1) @ w2
            x = x / (x.norm() + 1)
        return x
    for _ in range(50):             # warm the allocator and the kernels' caches
        unit()
    with open(out_path, "w") as out:
        while True:
            t, c0 = time.monotonic(), time.thread_time_ns()
            unit()
            out.write(f"{t:.4f} {(time.thread_time_ns() - c0) / 1e6:.4f}\n")
            out.flush()
            time.sleep(INTERVAL_S)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--unit", choices=sorted(UNITS), default=UNIT)
    args = ap.parse_args()
    main(args.out, args.unit)
