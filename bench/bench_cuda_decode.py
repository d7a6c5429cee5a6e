"""The engine's CUDA decode path on a GPU: tokens/s of the plain-torch reference (padded decode
attention, every step eager) against CUDA graphs, FlashInfer's paged decode kernel, and both, on
the same requests in one process, and Hugging Face continuous batching (``transformers``' paged
manager, ``bench_engine_peers.run_hf``) on them beside; ratios against the reference measured in
the same run, and each variant's tokens compared with the reference's.

Workload: ``bench_throughput.py``'s (its ~26M-parameter random Llama, head_dim 64, and its
heavy-tailed ``ignore_eos`` output lengths), in fp16 (FlashInfer has no fp32 kernels).

    python bench/bench_cuda_decode.py [--quick] [--json OUT]     # run by bench/gpu_check.sh
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import workload, write_model  # noqa: E402

# (name, THINKSERVE_DECODE_ATTENTION, CUDA graphs); the first is the reference
VARIANTS = [("reference", "padded", False), ("graphs", "padded", True), ("flashinfer", "flashinfer", False),
            ("flashinfer+graphs", "flashinfer", True)]


TIE = 0.02  # fp16: a log-probability margin under which two correct kernels may pick either token


def run_variant(path: Path, backend: str, graphs: bool, quick: bool, logprobs: int | None = None) -> dict:
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams

    os.environ["THINKSERVE_DECODE_ATTENTION"] = backend
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = LLMEngine.from_pretrained(str(path), device="cuda", dtype="float16", block_size=16, max_num_seqs=128,
                                       max_num_batched_tokens=2048, kv_cache_memory_bytes=2 << 30,
                                       enforce_eager=not graphs)
    # warm-up outside the timing: FlashInfer compiles its kernels (JIT) on first use
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    startup = time.perf_counter() - t0
    prompts, lengths = workload(quick)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs) for n in lengths]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    tokens = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in tokens] == lengths
    graphs_obj = engine.runner.graphs
    result = {"backend": engine.runner.decode_attention, "graphs": graphs_obj is not None, "startup_s": startup,
              "elapsed_s": elapsed, "tokens": sum(lengths), "tok_per_s": sum(lengths) / elapsed,
              "steps": engine.stats().num_steps, "graph_replays": graphs_obj.num_replays if graphs_obj else 0,
              "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20, "token_ids": tokens}
    if logprobs:
        result["logprobs"] = [o.outputs[0].logprobs for o in outputs]
    del engine
    return result


def run_hf_baseline(path: Path, quick: bool) -> dict:
    """Hugging Face continuous batching (``generate_batch``'s manager, its paged attention) on the
    GPU, fp16, the same requests and the same 2 GiB of KV (``bench_engine_peers.run_hf``)."""
    from bench_engine_peers import MAX_BATCHED_TOKENS, run_hf
    prompts, lengths = workload(quick)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    tokens, elapsed, _ = run_hf({"model": str(path), "prompts": prompts, "max_tokens": lengths, "eos": None,
                                 "kv_mib": 2048, "device": "cuda", "dtype": "float16"})
    assert [len(t) for t in tokens] == lengths
    # its steps, graph replays and start-up are not counted here: None, printed as "-"
    return {"backend": f"transformers (max_batch_tokens {MAX_BATCHED_TOKENS}, 256 requests a batch)",
            "graphs": None, "startup_s": None, "elapsed_s": elapsed, "tokens": sum(lengths),
            "tok_per_s": sum(lengths) / elapsed, "steps": None, "graph_replays": None,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20, "token_ids": tokens}


def first_differences(tokens: list, reference: dict) -> list[tuple[int, int, float]]:
    """(request, position, the reference's top-two log-probability margin there) of each
    request's first token that differs from the reference's (``reference``: its ``token_ids``
    and, per token, its ``logprobs`` as {token: log-probability}). Two correct half-precision
    kernels may part only where that margin is under ``TIE``; what follows is not compared.
    ``tests/workers/test_cuda_decode_gpu.py`` judges the engine's kernels by it too."""
    out = []
    for i, (got, ref, lps) in enumerate(zip(tokens, reference["token_ids"], reference["logprobs"])):
        j = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if j is not None:
            top = sorted(lps[j].values(), reverse=True)
            out.append((i, j, float(top[0] - top[1])))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 requests, outputs clipped to [16, 256]")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-hf", action="store_true", help="without the Hugging Face continuous batching baseline")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda_decode: needs a CUDA GPU")
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        for name, backend, graphs in VARIANTS:
            try:
                results[name] = run_variant(Path(tmp), backend, graphs, args.quick)
            except Exception as e:  # noqa: BLE001 — e.g. flashinfer missing: report it, measure the rest
                results[name] = {"error": f"{type(e).__name__}: {e}"}
        if not args.skip_hf:
            try:
                results["hf cont. batching"] = run_hf_baseline(Path(tmp), args.quick)
            except Exception as e:  # noqa: BLE001 — an older transformers: report it, keep the rest
                results["hf cont. batching"] = {"error": f"{type(e).__name__}: {e}"}
        ref = results["reference"]
        if "error" in ref:
            sys.exit(f"bench_cuda_decode: the reference failed: {ref['error']}")
        if any("error" not in r and r["token_ids"] != ref["token_ids"] for r in results.values()):
            # Where a variant's tokens part from the reference's: the reference's margin between its
            # top two tokens there, from an untimed rerun of the reference with log-probabilities.
            again = run_variant(Path(tmp), "padded", False, args.quick, logprobs=2)
            if again["token_ids"] != ref["token_ids"]:
                sys.exit("bench_cuda_decode: the reference did not repeat its own tokens")
            for r in results.values():
                if "error" not in r:
                    r["first_differences"] = first_differences(r["token_ids"], again)
    print(f"{'variant':<18} {'tok/s':>9} {'vs ref':>7} {'start s':>8} {'steps':>6} {'replays':>8} "
          f"{'peak MiB':>9}  tokens = ref  (differing: parted at a near tie, margin < {TIE})")
    cell = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731 — what a baseline does not count
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<18} {r['error']}")
            continue
        same = sum(a == b for a, b in zip(r["token_ids"], ref.get("token_ids", [])))
        r["identical_requests"] = same
        print(f"{name:<18} {r['tok_per_s']:>9.0f} {r['tok_per_s'] / ref['tok_per_s']:>6.2f}x "
              f"{cell(r['startup_s'], '.1f'):>8} {cell(r['steps'], 'd'):>6} {cell(r['graph_replays'], 'd'):>8} "
              f"{r['peak_gpu_mib']:>9.0f}  {same}/{len(r['token_ids'])}"
              + (f"  ({sum(m < TIE for *_, m in r['first_differences'])}/{len(r['first_differences'])}, largest margin "
                 f"{max(m for *_, m in r['first_differences']):.4f})" if r.get("first_differences") else ""))
    if args.json:
        for r in results.values():
            r.pop("token_ids", None)
            r.pop("logprobs", None)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
