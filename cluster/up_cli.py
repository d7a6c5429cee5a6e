"""``thinkserve up [--config FILE] [--address ADDR] [--detach]``: deploy pools and servers.

Joins the Ray cluster at ``--address`` (or ``RAY_ADDRESS``, or one already running here), else
starts a local one (127.0.0.1 only, token auth, no dashboard unless the ``ray:`` config says
otherwise). In the foreground it serves until Ctrl-C, then shuts everything down; with
``--detach`` it leaves the deployment running (`thinkserve down` stops it). Either way the
deployment is recorded under its namespace for `down`, `status`, `scale` and `submit`.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from pydantic import SecretStr

from .config import ConfigError, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="cluster YAML (default: built-in defaults, tiny-reasoner)")
    p.add_argument("--address", metavar="ADDR", help="Ray cluster to join (default: RAY_ADDRESS or a local one)")
    p.add_argument("--detach", action="store_true", help="return once serving; stop later with `thinkserve down`")
    p.add_argument("--port", type=int, help="override frontend.port")
    p.add_argument("--host", help="override frontend.host (default 127.0.0.1)")


def _say(msg: str) -> None:
    print(f"[thinkserve] {msg}", flush=True)


def run(args) -> int:
    try:
        cfg = load_config(args.config)
        overrides = {k: v for k, v in (("port", args.port), ("host", args.host)) if v is not None}
        if overrides:
            cfg = cfg.model_copy(update={"frontend": cfg.frontend.model_copy(update=overrides)})
    except ConfigError as e:
        print(f"thinkserve up: invalid config: {e}", file=sys.stderr)
        return 2
    from .auth import token_from_env
    if cfg.frontend.auth.token is None and token_from_env():
        # The frontend may run on another node: the token travels in its config, not its environment.
        auth = cfg.frontend.auth.model_copy(update={"token": SecretStr(token_from_env())})
        cfg = cfg.model_copy(update={"frontend": cfg.frontend.model_copy(update={"auth": auth})})
    if not (args.address or os.environ.get("RAY_ADDRESS")):
        # A local deployment reads the model from this machine: say so now, not from every actor.
        from thinkserve.workers.loader import resolve_model_path
        try:
            resolve_model_path(cfg.model)
        except FileNotFoundError as e:
            print(f"thinkserve up: model: {e}", file=sys.stderr)
            return 2
    import ray

    from .deploy import (SINGLE_MACHINE_ENV, AlreadyDeployed, DeploymentState, clear_state, connect, deploy,
                         frontend_addresses, ray_cpus_needed, save_state, session_dir, stop_ray_head, teardown)

    ray_address, started_head = connect(args.address, namespace=cfg.namespace, num_cpus=ray_cpus_needed(cfg),
                                        start_head=args.detach, settings=cfg.ray, progress=_say,
                                        log_to_driver=not args.detach)
    t0 = time.monotonic()
    try:
        _, address = deploy(cfg, progress=_say)
    except AlreadyDeployed as e:
        print(f"thinkserve up: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from .errors import root_cause
        print(f"thinkserve up: deployment failed: {root_cause(e)}", file=sys.stderr)
        if started_head:
            stop_ray_head(session_dir(), ray_address, _say)
        return 1
    where = frontend_addresses(cfg.namespace)
    save_state(DeploymentState(address, ray_address, cfg.namespace, started_head,
                               loopback_only=os.environ.get(SINGLE_MACHINE_ENV) == "0",
                               session_dir=session_dir() if started_head else "",
                               admin_address=where["admin"], http_address=where["http"]))
    extra = (f", {where['http']} (HTTP, OpenAI API and /metrics)" if where["http"] else "") + \
        (f", {where['admin']} (Admin)" if where["admin"] else "")
    _say(f"serving {cfg.model} on {address} (gRPC){extra} after {time.monotonic() - t0:.1f}s"
         + ("; a token is required" if cfg.frontend.auth.token is not None else ""))
    if args.detach:
        _say("detached; `thinkserve status`, `thinkserve submit TEXT`, `thinkserve down`")
        return 0
    _say("Ctrl-C to stop")
    stop = threading.Event()
    # Ctrl-C / SIGTERM start a clean shutdown (no KeyboardInterrupt in the middle of teardown).
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass
    _say("shutting down")
    teardown(cfg.namespace, progress=_say)
    clear_state(cfg.namespace)
    ray.shutdown()
    _say("stopped")
    return 0
