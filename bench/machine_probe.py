"""The machine's speed as a fixed piece of work measures it: what ``bench/sim_fidelity.py`` runs
beside the cluster it records, so that a simulation can replay how fast the machine was.

Every ``INTERVAL_S`` the probe runs ``UNIT`` (a tiny-reasoner-sized decode step's matrix work, on
one thread: 12 layers of an 8 x 192 batch through a 192 x 768 x 192 MLP) and writes one line,
``<monotonic time> <the unit's CPU time in ms>``: the thread's own CPU time, not the wall time,
so that waiting for a core (the engines' stepping, which the simulator prices itself) does not
count, while a slower host (other tenants of the machine, its clock) does. On this machine the
unit takes ~2 ms (~1.6% of a core); over 2 s windows its median moved with the engines' decode
steps' speed (correlation 0.5-0.8, docs/simulator.md "The machine's own slowness").

    python bench/machine_probe.py OUT     # until killed
"""
from __future__ import annotations

import sys
import time

INTERVAL_S = 0.125
LAYERS, BATCH, HIDDEN, INTERMEDIATE = 12, 8, 192, 768


def main(out_path: str) -> None:
    import torch
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    w1 = torch.randn(HIDDEN, INTERMEDIATE, generator=gen)
    w2 = torch.randn(INTERMEDIATE, HIDDEN, generator=gen)
    x0 = torch.randn(BATCH, HIDDEN, generator=gen)

    def unit():
        x = x0
        for _ in range(LAYERS):
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
    main(sys.argv[1])
