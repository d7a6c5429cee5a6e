"""The machine's speed as a fixed piece of work measures it: what ``bench/sim_fidelity.py`` runs
beside the cluster it records, so that a simulation can replay how fast the machine was.

Every ``INTERVAL_S`` the probe runs its unit on one thread (by default a tiny-reasoner-sized decode
step's matrix work: 12 layers of an 8 x 192 batch through a 192 x 768 x 192 MLP) and writes one line,
``<monotonic time> <the unit's CPU time in ms>``: the thread's own CPU time, not the wall time,
so that waiting for a core (the engines' stepping, which the simulator prices itself) does not
count, while a slower host (other tenants of the machine, its clock) does.

``UNIT`` names the unit, and a recorded run carries it (``machine_probe_unit``; a run recorded
before it has the ``narrow`` one): a run's probe is only compared with a probe of the same unit.

- ``wide`` (the default since 2026-12-06): each layer its own weights, 14 MB in all, so that
  every call reads them from beyond the core's caches as the engine reads its ~10 MB of weights
  each step. ~2.7 ms a unit here. Replays with it scored 89.0 of 96 figures per draw against the
  narrow unit's 86.0 on the same twelve sessions (docs/simulator.md, "A probe with the engine's
  working set").
- ``engine``: the engine's own decode step: the tiny-reasoner's ``ModelRunner.execute`` (the
  model runner an instance steps, with its weights, its native matrix and paged-attention kernels
  and its sampler) on a fixed batch of ENGINE_BATCH sequences decoding one token each at position
  ENGINE_CONTEXT (the same slots rewritten every call, so every call is the same work). ~2.1 ms
  here. Not the default: its level moved less with the engines' than the wide unit's did, and
  replays with it scored 83.75 of 96 figures per draw against 89.1 on the same twelve sessions
  (docs/simulator.md, "The engine's own decode step as the probe").
- ``<unit>-warm`` (``wide-warm``, ``engine-warm``, ...): the unit run WARM_CALLS times back to
  back, the last call timed: the unit with its weights in the caches, as the engines' back-to-back
  steps run, where the units above time a call after INTERVAL_S of other work (here the engine
  unit ran 1.9 ms so and 1.0-1.2 ms warm; the wide one 3.5 and 3.0). Not the default either:
  replays with ``engine-warm`` scored 75.1 of 80 figures per draw against the wide unit's 75.4 on
  the same ten sessions (docs/simulator.md, "The engine's step timed warm").
- ``narrow``: one pair of weights for every layer (1.2 MB, held in the caches). ~1.7-2 ms;
  over 2 s windows its median moved with the engines' decode steps' speed (correlation 0.5-0.8,
  docs/simulator.md "The machine's own slowness").

    python bench/machine_probe.py OUT [--unit wide|narrow|engine|<unit>-warm]     # until killed
"""
from __future__ import annotations

import sys
import time

INTERVAL_S = 0.125
LAYERS, BATCH, HIDDEN, INTERMEDIATE = 12, 8, 192, 768
# the matrix units: how many (w1, w2) weight pairs the layers cycle through
MATRIX_PAIRS = {"wide": LAYERS, "narrow": 1}
BASE_UNITS = (*MATRIX_PAIRS, "engine")
UNITS = (*BASE_UNITS, *(f"{u}-warm" for u in BASE_UNITS))
WARM_CALLS = 3
ENGINE_BATCH, ENGINE_CONTEXT = 8, 128
UNIT = "wide"
LEGACY_UNIT = "narrow"          # a recorded run without ``machine_probe_unit``


def engine_unit():
    """The ``engine`` unit: a callable that runs one decode step of the tiny-reasoner's model runner
    (as an instance builds it: ``LLMEngine``'s config resolution, one thread) over ENGINE_BATCH
    sequences whose ENGINE_CONTEXT prompt tokens it prefilled once."""
    from thinkserve.workers.config import EngineConfig
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.plan import ScheduledSeq, SeqSampling, StepPlan

    engine = LLMEngine(EngineConfig(model="tiny-reasoner", num_device_blocks=128, max_num_seqs=ENGINE_BATCH))
    runner, bs = engine.runner, engine.config.block_size
    per_seq = ENGINE_CONTEXT // bs + 1                # blocks covering positions 0..ENGINE_CONTEXT
    tables = [tuple(range(i * per_seq, (i + 1) * per_seq)) for i in range(ENGINE_BATCH)]
    greedy = SeqSampling(0.0, 1.0, -1, 0, 0)
    vocab = engine.model_config.vocab_size
    prompt = lambda i: tuple((7 * i + 3 * k) % vocab for k in range(ENGINE_CONTEXT))  # noqa: E731
    runner.execute(StepPlan(tuple(ScheduledSeq(i, prompt(i), 0, tables[i], greedy) for i in range(ENGINE_BATCH))))
    step = StepPlan(tuple(ScheduledSeq(i, (prompt(i)[-1],), ENGINE_CONTEXT, tables[i], greedy)
                          for i in range(ENGINE_BATCH)))
    return lambda: runner.execute(step)


def main(out_path: str, unit_name: str = UNIT) -> None:
    import torch
    torch.set_num_threads(1)
    base = unit_name.removesuffix("-warm")
    calls = WARM_CALLS if base != unit_name else 1
    unit = engine_unit() if base == "engine" else matrix_unit(base)
    for _ in range(50):             # warm the allocator and the kernels' caches
        unit()
    with open(out_path, "w") as out:
        while True:
            t = time.monotonic()
            out.write(f"{t:.4f} {measure(unit, calls):.4f}\n")
            out.flush()
            time.sleep(INTERVAL_S)


def measure(unit, calls: int = 1) -> float:
    """``unit`` called ``calls`` times back to back: the last call's CPU time on this thread, ms."""
    for _ in range(calls - 1):
        unit()
    c0 = time.thread_time_ns()
    unit()
    return (time.thread_time_ns() - c0) / 1e6


def matrix_unit(unit_name: str):
    """The ``wide`` and ``narrow`` units: LAYERS layers of a BATCH x HIDDEN batch through a
    HIDDEN x INTERMEDIATE x HIDDEN MLP, cycling through MATRIX_PAIRS[unit_name] pairs of weights."""
    import torch
    gen = torch.Generator().manual_seed(0)
    pairs = [(torch.randn(HIDDEN, INTERMEDIATE, generator=gen), torch.randn(INTERMEDIATE, HIDDEN, generator=gen))
             for _ in range(MATRIX_PAIRS[unit_name])]
    x0 = torch.randn(BATCH, HIDDEN, generator=gen)

    def unit():
        x = x0
        for i in range(LAYERS):
            w1, w2 = pairs[i % len(pairs)]
            x = torch.nn.functional.silu(x @ w1) @ w2
            x = x / (x.norm() + 1)
        return x
    return unit


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--unit", choices=sorted(UNITS), default=UNIT)
    args = ap.parse_args()
    main(args.out, args.unit)
