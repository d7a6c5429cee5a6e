"""The ``thinkserve`` command line.

Each subcommand lives in the module that owns it; this file only wires them up, importing a
subcommand's module when that subcommand runs (``thinkserve generate`` must not pay for Ray).

    subcommand   module                                    functions (named in SUBCOMMANDS)
    generate     thinkserve.workers.generate_cli           add_arguments(parser), run(args) -> int
    status/...   thinkserve.cluster.admin_cli              add_status_arguments, run_status, ...
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, its argument adder, its runner, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str, str]] = {
    "generate": ("thinkserve.workers.generate_cli", "add_arguments", "run",
                 "offline generation with an in-process engine"),
    "up": ("thinkserve.cluster.up_cli", "add_arguments", "run",
           "start (or join) a Ray cluster and deploy pools and servers"),
    "status": ("thinkserve.cluster.admin_cli", "add_status_arguments", "run_status",
               "show pools, instances, queue depths and KV use"),
    "scale": ("thinkserve.cluster.admin_cli", "add_scale_arguments", "run_scale",
              "resize a pool: thinkserve scale POOL N"),
    "submit": ("thinkserve.cluster.submit_cli", "add_arguments", "run",
               "send a request to a running cluster over gRPC"),
    "bench": ("thinkserve.cluster.bench_cli", "add_arguments", "run",
              "load a running cluster: open-loop arrivals, latency per class, CDF PNG"),
    "debug": ("thinkserve.cluster.admin_cli", "add_debug_arguments", "run_debug",
              "print the router's state as JSON: parts, counters, prefix index, loop stalls, step traces"),
    "down": ("thinkserve.cluster.admin_cli", "add_down_arguments", "run_down",
             "stop the deployment (and the local Ray cluster it started)"),
    "sim": ("thinkserve.cluster.sim_cli", "add_arguments", "run",
            "simulate policies on many GPUs with the real router and scheduler"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    parser = argparse.ArgumentParser(prog="thinkserve", description="Serve reasoning models on a cluster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    runner = None
    for name, (module_name, adder, run, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            getattr(module, adder)(p)
            runner = getattr(module, run)
    return parser, runner


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, runner = build_parser(argv)
    except ModuleNotFoundError as e:
        print(f"thinkserve: subcommand {argv[0]!r} is not available: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
