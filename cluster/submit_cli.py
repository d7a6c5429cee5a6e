"""``thinkserve submit TEXT [--n N] [--stream] [--json]``: one request to a running cluster."""
from __future__ import annotations

import json
import sys

from .admin_cli import _fail, _server_arg, server_or_exit


def add_arguments(p):
    p.add_argument("text", metavar="TEXT", help="the prompt")
    p.add_argument("--n", type=int, default=1, help="branches (Best-of-N, majority vote)")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="print the final result as JSON")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="default 0 (greedy) for n=1, 0.8 for n>1")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--thinking-budget", type=int)
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"],
                   help="mapped to a thinking budget by the cluster config (router.reasoning_effort_budgets); "
                        "--thinking-budget wins over it")
    p.add_argument("--priority", choices=["interactive", "standard", "batch"], default="standard")
    p.add_argument("--early-stop", choices=["none", "unbeatable", "adaptive"],
                   help="Best-of-N: cancel the remaining branches once the vote is decided (unbeatable: the "
                        "leader cannot be overtaken; adaptive: Adaptive-Consistency's Beta rule); default: the "
                        "cluster config's router.early_stop")
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")
    _server_arg(p)


def build_request(args):
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n == 1 else 0.8)
    sp = pb.SamplingParams(max_tokens=args.max_tokens, temperature=temperature)
    for name in ("top_p", "top_k", "seed"):
        if getattr(args, name) is not None:
            setattr(sp, name, getattr(args, name))
    req = pb.GenerateRequest(request_id=args.request_id, text=args.text, sampling=sp, n=args.n,
                             priority=pb.PriorityClass.Value(f"PRIORITY_CLASS_{args.priority.upper()}"))
    if args.thinking_budget is not None:
        req.thinking_budget = args.thinking_budget
    if args.reasoning_effort is not None:
        req.reasoning_effort = pb.ReasoningEffort.Value(f"REASONING_EFFORT_{args.reasoning_effort.upper()}")
    if args.early_stop is not None:
        req.early_stop = pb.EarlyStop.Value(f"EARLY_STOP_{args.early_stop.upper()}")
    return req


def run(args) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from .auth import client_metadata, open_channel

    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    from thinkserve.protos.thinkserve.v1 import inference_pb2_grpc
    server = server_or_exit("submit", args)
    if server is None:
        return 2
    channel = open_channel(server, args.tls_ca)
    stub = inference_pb2_grpc.InferenceStub(channel)
    final = None
    try:
        for msg in stub.Generate(build_request(args), timeout=args.timeout, metadata=client_metadata()):
            if args.stream:
                for d in msg.deltas:
                    prefix = f"[{d.index}] " if args.n > 1 else ""
                    sys.stdout.write(prefix + d.text + ("\n" if args.n > 1 else ""))
                sys.stdout.flush()
            if msg.HasField("final"):
                final = msg
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130
    except grpc.RpcError as e:
        return _fail("submit", e)
    finally:
        channel.close()
    if args.stream:
        print()
    if args.json:
        print(json.dumps(MessageToDict(final, preserving_proto_field_name=True), indent=2))
        return 0
    f = final.final
    if not args.stream:
        for b in f.branches:
            head = f"--- branch {b.index} ({pb.FinishReason.Name(b.finish_reason)[14:].lower()}"
            print(head + (f", answer {b.answer})" if b.answer else ")"))
            print(b.text)
    votes = ", ".join(f"{v.answer}×{v.count}" for v in f.votes)
    print(f"answer: {f.answer or '(none)'}" + (f"   votes: {votes}" if len(f.branches) > 1 else "")
          + (f"   ({f.cancelled_branches} branches cancelled: {f.early_stop_rule})" if f.cancelled_branches else ""))
    t, u = final.timings, final.usage
    print(f"tokens: {u.prompt_tokens} prompt, {u.completion_tokens} generated   ttft {t.ttft_ms:.0f} ms, "
          f"total {t.total_ms:.0f} ms   prefill {t.prefill_instance or '-'} → decode {', '.join(t.decode_instances) or '-'}")
    return 0
