"""Where a calibrated prediction's error comes from: each held-out run of the recorded sessions
simulated with the committed fit calibrated by the session's other run (what ``sim_fidelity.py
--replay`` predicts), by the run itself, and by the other run with one group of calibration
factors replaced by the run's own (``GROUPS``). The group whose own values take the most error
away is where the machine changed between the two runs in a way the calibration run could not
tell.

A level factor measured with the probe of the machine's speed (``probe_ms``) is relative to its
own run's probe level; the simulation of a run prices it at that run's probe over the calibration's
level, so an own level factor is rescaled by the other run's probe level over its own before it
replaces the other's.

    python bench/sim_fidelity_attribution.py --layout pd --noise-seeds 3 bench/data/sim_fidelity/fresh-*2026120[45]

Prints each run's errors (TPOT P90 / TPOT mean / TTFT P90, mean over the draws) per variant, then
per figure and variant the mean error size and how many runs fall outside 15%; ``--out`` writes them
as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fit_sim_cpu                          # noqa: E402
import sim_fidelity                         # noqa: E402
from thinkserve.cluster.sim.cost import CALIBRATION_FACTORS, CPU_FIT_PATH   # noqa: E402

# The calibration's keys, grouped by what they price (fit_sim_cpu.calibrate).
GROUPS = {
    "decode": ("decode_steps", "decode_co_steps", "decode_per_seq", "engines"),
    "warm": ("woken_steps", "waking_steps", "waking_co_steps"),
    "prompt": ("prompt_steps", "prompt_co_steps"),
    "handoff": ("handoff", "handoff_busy", "handoff_spread"),
    "latency": ("dispatch", "first_token", "finish", "dispatch_spread", "first_token_spread", "finish_spread",
                "latency_states", "first_token_rho", "latency_rho", "latency_tau_s"),
    "slow": ("slow_spread", "slow_rho", "slow_tau_s", "machine_sd"),
}
# The factors that are levels (a time over its price), which the probe's level scales; the
# spreads, correlations and time constants are not.
LEVELS = frozenset(k for k in CALIBRATION_FACTORS if not k.endswith("_spread"))


def variants(other: dict, own: dict) -> dict[str, dict]:
    """The calibrations a run is simulated with: ``other`` (the prediction), ``own`` (the run's
    own, not a prediction), and per group the other's with that group's keys taken from ``own``."""
    scale = other["probe_ms"] / own["probe_ms"] if other.get("probe_ms") and own.get("probe_ms") else 1.0
    out = {"other": other, "own": own}
    for group, keys in GROUPS.items():
        out[group] = {**other, **{k: own[k] * scale if k in LEVELS else own[k] for k in keys if k in own}}
    return out


def attribute(dirs: list[str], layout: str, noise_seeds: int, fit_path: Path, progress=print) -> list[dict]:
    fit = json.loads(fit_path.read_text())
    tmp = Path(tempfile.mkdtemp())
    rows = []
    for a, b, again in sim_fidelity.sessions(dirs):
        first = fit_sim_cpu.load_trace(a)
        if first["layout"] != layout:        # the session's other runs are not read
            continue
        traces = {a: first, **{p: fit_sim_cpu.load_trace(p) for p in (b, *again)}}
        cals = {p: fit_sim_cpu.calibrate(fit, t) for p, t in traces.items()}
        # run A predicted by run B, run B and its repeats by run A (as --replay does)
        for path, other in ((a, b), *((p, a) for p in (b, *again))):
            real = sim_fidelity.stats(traces[path])
            errors = {}
            for name, cal in variants(cals[other], cals[path]).items():
                fp = fit_sim_cpu.write_calibrated(fit, cal, tmp / "calibrated.json")
                draws = [sim_fidelity.stats(traces[path], sim_fidelity.simulate(traces[path], fp, noise_seed=s))
                         for s in range(noise_seeds)]
                errors[name] = {m: statistics.mean((x[m] - real[m]) / real[m] for x in draws)
                                for m in sim_fidelity.METRICS}
            rows.append({"run": f"{path.parent.name}/{path.name}", "errors": errors})
            progress(rows[-1]["run"] + " " + " ".join(
                f"{n}:{100 * e['tpot_p90']:+.0f}/{100 * e['tpot_mean']:+.0f}/{100 * e['ttft_p90']:+.0f}"
                for n, e in errors.items()))
    return rows


def summary(rows: list[dict]) -> dict:
    names = list(rows[0]["errors"]) if rows else []
    return {m: {n: {"mean_abs": statistics.mean(abs(r["errors"][n][m]) for r in rows),
                    "outside_15pct": sum(abs(r["errors"][n][m]) > 0.15 for r in rows)} for n in names}
            for m in sim_fidelity.METRICS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", help="folders of recorded sessions (sim_fidelity.py --trace-out)")
    p.add_argument("--layout", choices=("mixed", "pd"), required=True)
    p.add_argument("--noise-seeds", type=int, default=3)
    p.add_argument("--fit", type=Path, default=CPU_FIT_PATH)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = attribute(args.dirs, args.layout, args.noise_seeds, args.fit)
    if not rows:
        sys.exit("no recorded session with a run A and a run B of that layout in those folders")
    table = summary(rows)
    print(f"{len(rows)} runs; per figure, per variant: mean error size / runs outside 15%")
    for m, by in table.items():
        print(f"{m:10s} " + "  ".join(f"{n} {100 * v['mean_abs']:.1f}%/{v['outside_15pct']}" for n, v in by.items()))
    if args.out:
        args.out.write_text(json.dumps({"runs": rows, "summary": table}, indent=1))


if __name__ == "__main__":
    main()
