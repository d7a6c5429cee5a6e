"""The ``thinkserve`` command line.

Each subcommand lives in the module that owns it; this file only wires them up, importing a
subcommand's module when that subcommand runs (``thinkserve generate`` must not pay for Ray).

    subcommand   module                                    function
    generate     thinkserve.workers.generate_cli           add_arguments(parser), run(args) -> int
    up/down/...  thinkserve.cluster.<name>_cli             add_arguments(parser), run(args) -> int
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("thinkserve.workers.generate_cli", "offline generation with an in-process engine"),
    "up": ("thinkserve.cluster.up_cli", "start (or join) a Ray cluster and deploy pools and servers"),
    "status": ("thinkserve.cluster.admin_cli", "show pools, instances, queue depths and KV use"),
    "scale": ("thinkserve.cluster.admin_cli", "resize a pool: thinkserve scale POOL N"),
    "submit": ("thinkserve.cluster.submit_cli", "send a request to a running cluster over gRPC"),
    "down": ("thinkserve.cluster.admin_cli", "stop the deployment (and the local Ray cluster it started)"),
    "sim": ("thinkserve.cluster.sim_cli", "simulate policies on many GPUs with the real router and scheduler"),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, object]:
    parser = argparse.ArgumentParser(prog="thinkserve", description="Serve reasoning models on a cluster.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = argv[0] if argv else None
    module = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            adder = getattr(module, f"add_{name}_arguments", None) or module.add_arguments
            adder(p)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser, module = build_parser(argv)
    except ModuleNotFoundError as e:
        print(f"thinkserve: subcommand {argv[0]!r} is not available: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    runner = getattr(module, f"run_{args.command}", None) or module.run
    try:
        return int(runner(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
