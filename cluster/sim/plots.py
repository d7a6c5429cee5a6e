"""PNG plots of a sweep: latency CDFs per policy, goodput and SLO attainment against rate."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .metrics import request_latencies


def plot_all(runs, out_dir: Path) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'thinkserve[sim]'): no plots written")
        return []
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for summary, sim in runs:
        lat = [request_latencies(r) for r in sim.records.values()]
        lat = [x for x in lat if x is not None]
        label = f"{summary['policy']} @ {summary['rate']}"
        for ax, i, name in zip(axes, range(3), ("TTFT (s)", "TPOT (s)", "end-to-end (s)")):
            v = np.sort([x[i] for x in lat])
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)
            ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("share of requests")
            ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    p = out_dir / "latency_cdf.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    written.append(p)
    rates = sorted({s["rate"] for s, _ in runs if s["rate"] is not None})
    if len(rates) > 1:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for policy in dict.fromkeys(s["policy"] for s, _ in runs):
            pts = sorted((s["rate"], s["goodput_per_gpu"], s["slo_attainment"]) for s, _ in runs
                         if s["policy"] == policy and s["rate"] is not None)
            a1.plot([x[0] for x in pts], [x[1] for x in pts], "o-", label=policy)
            a2.plot([x[0] for x in pts], [x[2] for x in pts], "o-", label=policy)
        a1.set_xlabel("offered rate (requests/s)")
        a1.set_ylabel("goodput (requests/s per GPU meeting the SLO)")
        a2.set_xlabel("offered rate (requests/s)")
        a2.set_ylabel("SLO attainment")
        a2.axhline(0.9, color="grey", ls="--", lw=0.8)
        for a in (a1, a2):
            a.grid(True, alpha=0.3)
            a.legend()
        fig.tight_layout()
        p = out_dir / "goodput_vs_rate.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written
