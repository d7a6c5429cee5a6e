"""Where thinkserve and a peer disagree on the heavy peers workload: a near-tie or a wrong token?

``bench_engine_peers.py --resume DIR`` saves every engine's tokens. For each request where a peer's
tokens differ from thinkserve's, this recreates the workload's random Qwen2 (same seed, so the same
weights and prompts), runs Hugging Face's eager model teacher-forced over the prompt and
thinkserve's output in float64 and in float32, and prints at the first differing position:

  - the two tokens, and which one the float64 model ranks first;
  - the float64 gap between them (logit units);
  - the float32 model's logit error against float64 at that position (its rounding noise).

A gap of the size of the float32 error is a near-tie that correct float32 implementations may
break either way; a gap far above it means one engine computed a wrong token.

    python bench/peers_divergence.py --resume /tmp/peers                # 1-thread results
    python bench/peers_divergence.py --resume /tmp/peers --threads 2 --peer vllm
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_engine_peers as peers  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resume", required=True, metavar="DIR", help="the directory bench_engine_peers.py saved into")
    ap.add_argument("--threads", type=int, default=1, help="which saved run (the thread count it ran with)")
    ap.add_argument("--peer", default="vllm", choices=peers.ENGINES[1:])
    ap.add_argument("--heavy-requests", type=int, default=24)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        w = peers.heavy_workload(args.heavy_requests, Path(tmp))
        mine = peers._saved_result(args.resume, w, "thinkserve", args.threads)
        theirs = peers._saved_result(args.resume, w, args.peer, args.threads)
        if mine is None or theirs is None:
            sys.exit(f"no saved thinkserve and {args.peer} results for this workload and {args.threads} threads "
                     f"in {args.resume}")
        differ = [i for i, (a, b) in enumerate(zip(mine["tokens"], theirs["tokens"])) if a != b]
        print(f"{len(differ)} of {len(w['prompts'])} requests differ: {differ}")
        models = {dt: AutoModelForCausalLM.from_pretrained(tmp, dtype=dt, attn_implementation="eager").eval()
                  for dt in (torch.float64, torch.float32)}
        for i in differ:
            a, b = mine["tokens"][i], theirs["tokens"][i]
            k = peers._first_difference(a, b)
            prompt = w["prompts"][i]
            ids = torch.tensor([prompt + a[:k]])
            with torch.no_grad():
                row = {dt: m(ids).logits[0, -1].double() for dt, m in models.items()}
            l64, l32 = row[torch.float64], row[torch.float32]
            first = int(l64.argmax())
            gap = float(l64[a[k]] - l64[b[k]])
            err = float((l32 - l64).abs().max())
            print(f"request {i}, output token {k}: thinkserve {a[k]}, {args.peer} {b[k]}; float64 ranks first {first} "
                  f"({'thinkserve' if first == a[k] else args.peer if first == b[k] else 'neither'}'s); float64 gap "
                  f"thinkserve - {args.peer} = {gap:+.3e}; float32 logit error there {err:.2e} "
                  f"(|gap| / error = {abs(gap) / err:.1f})")


if __name__ == "__main__":
    main()
