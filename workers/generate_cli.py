"""``thinkserve generate``: offline generation with an in-process engine (no Ray, no server).

    thinkserve generate --prompt "12+7=" --max-tokens 64
    thinkserve generate --prompt-token-ids 1,2,3 --n 4 --temperature 0.8 --seed 1 --json

Bad input (a sampling value out of range, a prompt too long, token ids outside the vocabulary)
prints one line naming the field and its limit and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys

EXIT_BAD_INPUT = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-reasoner", help="tiny-reasoner (shipped) or a Hugging Face model directory")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument("--prompt-token-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens per branch (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=-1, help="-1 = whole vocabulary")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--n", type=int, default=1, help="branches (Best-of-N) sampled from one prefill")
    parser.add_argument("--thinking-budget", type=int, default=None,
                        help="tokens allowed inside <think> before </think> is forced")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print every output's token ids, text and finish reason as JSON")


def _parse_token_ids(text: str) -> list[int]:
    ids = []
    for i, part in enumerate(text.split(",")):
        try:
            ids.append(int(part.strip()))
        except ValueError:
            raise ValueError(f"--prompt-token-ids item {i} = {part.strip()!r} is not an integer") from None
    return ids


def run(args: argparse.Namespace) -> int:
    # Imported here so `thinkserve --help` does not pay for torch.
    from .engine import LLMEngine
    from .sampling_params import SamplingParams

    try:
        prompt = args.prompt if args.prompt is not None else _parse_token_ids(args.prompt_token_ids)
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos,
                                thinking_budget=args.thinking_budget)
        engine = LLMEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                           max_model_len=args.max_model_len, max_num_seqs=max(64, args.n))
        output = engine.generate([prompt], params)[0]
    except (ValueError, FileNotFoundError) as e:
        print(f"thinkserve generate: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    if args.json:
        print(json.dumps({
            "request_id": output.request_id,
            "prompt_token_ids": output.prompt_token_ids,
            "outputs": [{"index": c.index, "token_ids": c.token_ids, "text": c.text, "finish_reason": c.finish_reason}
                        for c in output.outputs],
        }))
        return 0
    for c in output.outputs:
        if len(output.outputs) > 1:
            print(f"--- branch {c.index} ({c.finish_reason}) ---")
        print(c.text)
    return 0
