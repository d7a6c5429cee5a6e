"""``thinkserve status [--json]``, ``thinkserve scale POOL N``, ``thinkserve debug``, ``thinkserve down``.

``status``, ``scale`` and ``debug`` speak gRPC to the frontend (Admin service); ``down`` goes through Ray to
the controller, and stops the local Ray cluster if ``up --detach`` started it. Each finds the
deployment `up` recorded for ``--namespace`` (or the only one recorded); ``down`` without any
record looks for thinkserve controllers in every namespace of the Ray cluster it reaches, and a
record is removed only once its deployment is gone.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

from thinkserve.router.snapshot import POOL_NAMES

DEFAULT_SERVER = "127.0.0.1:50051"


def _server_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", metavar="HOST:PORT",
                   help=f"frontend address (default: the one `up` recorded, else {DEFAULT_SERVER})")
    p.add_argument("--namespace", help="the recorded deployment to talk to (default: the only one recorded)")
    p.add_argument("--admin-server", metavar="HOST:PORT",
                   help="the Admin service's own address, when frontend.admin_port gives it one "
                        "(default: the one `up` recorded, else --server)")
    p.add_argument("--tls-ca", metavar="PEM", help="trust this CA / certificate and speak TLS "
                                                  "(default: $THINKSERVE_TLS_CA; plaintext if unset)")


class NoServer(Exception):
    """Which frontend to talk to cannot be told; the message says why."""


def _recorded(namespace: str | None):
    from .deploy import AmbiguousDeployment, load_state
    try:
        st = load_state(namespace)
    except AmbiguousDeployment as e:
        raise NoServer(str(e)) from None
    if st is None and namespace is not None:
        raise NoServer(f"no deployment is recorded for namespace {namespace!r}; give --server HOST:PORT")
    return st


def resolve_server(arg: str | None, namespace: str | None = None) -> str:
    """``--server``, else the address `up` recorded."""
    if arg:
        return arg
    st = _recorded(namespace)
    return st.grpc_address if st else DEFAULT_SERVER


def server_or_exit(what: str, args) -> str | None:
    try:
        return resolve_server(args.server, args.namespace)
    except NoServer as e:
        print(f"thinkserve {what}: {e}", file=sys.stderr)
        return None


def resolve_admin(args) -> str:
    """``--admin-server``, else Admin's own address as `up` recorded it, else the gRPC server's."""
    if args.admin_server:
        return args.admin_server
    if not args.server:
        st = _recorded(args.namespace)
        if st is not None and st.admin_address:
            return st.admin_address
    return resolve_server(args.server, args.namespace)


def admin_or_exit(what: str, args) -> str | None:
    try:
        return resolve_admin(args)
    except NoServer as e:
        print(f"thinkserve {what}: {e}", file=sys.stderr)
        return None


def add_status_arguments(p):
    _server_arg(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def add_scale_arguments(p):
    _server_arg(p)
    p.add_argument("pool", choices=POOL_NAMES, metavar="POOL", help=" | ".join(POOL_NAMES))
    p.add_argument("replicas", type=int, metavar="N", help="target number of instances")


def add_debug_arguments(p):
    _server_arg(p)
    p.add_argument("--prefix-of", metavar="IDS", type=_token_ids,
                   help="a prompt's token ids, comma-separated: also say where its cached prefix blocks are")
    p.add_argument("--step-traces", action="store_true",
                   help="also take every serving instance's engine steps and part timings since the last read")


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated token ids: {text[:40]!r}") from None
    if any(not 0 <= i < 2**32 for i in ids):
        raise argparse.ArgumentTypeError("token ids must be in [0, 2**32)")
    return ids


def add_down_arguments(p):
    p.add_argument("--address", metavar="ADDR", help="Ray cluster (default: the one `up` recorded)")
    p.add_argument("--namespace", default=None, help="Ray namespace of the deployment")
    p.add_argument("--keep-ray", action="store_true", help="leave a Ray cluster that `up` started running")


def _stubs(server: str, tls_ca: str | None):
    from thinkserve.protos.thinkserve.v1 import admin_pb2_grpc

    from .auth import open_channel
    channel = open_channel(server, tls_ca)
    return channel, admin_pb2_grpc.AdminStub(channel)


def _fail(what: str, e) -> int:
    import grpc
    if isinstance(e, grpc.RpcError):
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED:
            print(f"thinkserve {what}: refused: set THINKSERVE_API_TOKEN to the deployment's token", file=sys.stderr)
        elif code == grpc.StatusCode.UNAVAILABLE:
            print(f"thinkserve {what}: no thinkserve frontend answers ({e.details()}); is it up?", file=sys.stderr)
        else:
            print(f"thinkserve {what}: {code.name}: {e.details()}", file=sys.stderr)
        return 1
    raise e


def format_status(st) -> str:
    from thinkserve.protos.thinkserve.v1 import admin_pb2
    http = f"   http {st.frontend.http_address}" if st.frontend.http_address else ""
    lines = [f"model {st.model}   frontend {st.frontend.address}{http}   requests active {st.frontend.active_requests}"
             f"/{st.frontend.max_active_requests}  completed {st.frontend.completed_requests}"
             f"  failed {st.frontend.failed_requests}  migrated {st.frontend.migrated_requests}"
             f"  resumed {st.frontend.resumed_requests}"]
    lines.append(f"{'POOL':<13} {'INSTANCE':<17} {'STATE':<9} {'WAIT':>5} {'RUN':>5} {'ASSIGNED':>8} {'KV USED':>13} {'TOKENS':>8}")
    for p in st.pools:
        if not p.instances and not p.target_replicas:
            continue
        lines.append(f"{p.name:<13} {'(' + str(p.serving_replicas) + '/' + str(p.target_replicas) + ' serving)':<17} "
                     f"{'':<9} {p.queue_depth:>5} {'':>5} {'':>8} {p.kv_usage:>12.0%}")
        for i in p.instances:
            state = admin_pb2.InstanceState.Name(i.state).removeprefix("INSTANCE_STATE_").lower()
            used = i.num_total_blocks - i.num_free_blocks
            lines.append(f"{'':<13} {i.instance_id:<17} {state:<9} {i.num_waiting:>5} {i.num_running:>5} "
                         f"{i.assigned_requests:>8} {f'{used}/{i.num_total_blocks}':>13} {i.generated_tokens:>8}"
                         + (f"   cores {','.join(map(str, i.cpus))}" if i.cpus else ""))
    for s in st.stores:
        lookups = s.hits + s.misses
        hit_rate = f"{s.hits / lookups:.0%}" if lookups else "-"
        lines.append(f"CPU KV store {s.node_id[:12]} {s.address}: {_mib(s.bytes_used)}/{_mib(s.capacity_bytes)} MiB, "
                     f"{s.entries} blocks ({s.pinned_entries} pinned), hit rate {hit_rate} of {lookups}, "
                     f"{s.evictions} evicted, {s.refused} refused")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _unary(what: str, args, method: str, request):
    """One Admin call for subcommand ``what``: its reply, or the exit code after saying why not."""
    from .auth import client_metadata
    server = admin_or_exit(what, args)
    if server is None:
        return 2
    channel, admin = _stubs(server, args.tls_ca)
    try:
        return getattr(admin, method)(request, timeout=30, metadata=client_metadata())
    except Exception as e:
        return _fail(what, e)
    finally:
        channel.close()


def _print_json(msg) -> None:
    from google.protobuf.json_format import MessageToDict
    print(json.dumps(MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
                     indent=2))


def run_status(args) -> int:
    from thinkserve.protos.thinkserve.v1 import admin_pb2
    st = _unary("status", args, "GetStatus", admin_pb2.GetStatusRequest())
    if isinstance(st, int):
        return st
    if args.json:
        _print_json(st)
    else:
        print(format_status(st))
    return 0


def run_debug(args) -> int:
    """Print the router's state (``Admin.GetDebugState``) as JSON."""
    from thinkserve.protos.thinkserve.v1 import admin_pb2
    st = _unary("debug", args, "GetDebugState",
                admin_pb2.GetDebugStateRequest(prefix_of=args.prefix_of or [], step_traces=args.step_traces))
    if isinstance(st, int):
        return st
    _print_json(st)
    return 0


def run_scale(args) -> int:
    from thinkserve.protos.thinkserve.v1 import admin_pb2
    if args.replicas < 0:
        print("thinkserve scale: N must be >= 0", file=sys.stderr)
        return 2
    from .auth import client_metadata
    server = admin_or_exit("scale", args)
    if server is None:
        return 2
    channel, admin = _stubs(server, args.tls_ca)
    md = client_metadata()
    done = threading.Event()

    def progress():      # resizing waits for weights to load or for requests to drain: show it
        while not done.wait(2.0):
            try:
                st = admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=5, metadata=md)
                p = next(p for p in st.pools if p.name == args.pool)
                states = ", ".join(f"{i.instance_id} {admin_pb2.InstanceState.Name(i.state)[15:].lower()}"
                                   for i in p.instances)
                print(f"  {args.pool}: {states or 'no instances'}", flush=True)
            except Exception:
                pass

    print(f"scaling {args.pool} to {args.replicas} ...", flush=True)
    t = threading.Thread(target=progress, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        res = admin.ScalePool(admin_pb2.ScalePoolRequest(pool=args.pool, replicas=args.replicas), timeout=900, metadata=md)
    except Exception as e:
        return _fail("scale", e)
    finally:
        done.set()
        channel.close()
    print(f"{args.pool}: {res.pool.serving_replicas} serving (added {res.added}, removed {res.removed}, "
          f"{res.migrated_requests} requests migrated) in {time.monotonic() - t0:.1f}s")
    return 0


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    import socket
    host, _, port = address.removeprefix("ray://").rpartition(":")
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()


def run_down(args) -> int:
    import ray

    from .deploy import (AmbiguousDeployment, clear_state, deployed_namespaces, find_controller, load_state,
                         stop_ray_head, teardown, use_single_machine_ray)

    def say(m):
        print(f"[thinkserve] {m}", flush=True)
    try:
        state = load_state(args.namespace)
    except AmbiguousDeployment as e:
        print(f"thinkserve down: {e}", file=sys.stderr)
        return 2
    namespace = args.namespace or (state.namespace if state else None)
    address = args.address or (state.ray_address if state else None)
    if state is not None and state.loopback_only:
        use_single_machine_ray()     # that Ray runs in single-machine mode; so must its clients
    try:
        if address and address != "auto":
            _check_reachable(address)      # ray.init retries an unreachable GCS for minutes
        ray.init(address=address or "auto", namespace=namespace, log_to_driver=False)
    except (ConnectionError, RuntimeError, OSError) as e:
        if state is None:
            say("no Ray cluster is running and no deployment is recorded; nothing to stop")
            return 0
        # Keep the record: the deployment may well be alive behind an address we cannot reach.
        print(f"thinkserve down: cannot reach the Ray cluster at {address} where namespace {namespace!r} was "
              f"deployed ({type(e).__name__}: {e}); the record is kept. Give --address ADDR to stop it there.",
              file=sys.stderr)
        return 1
    try:
        if namespace is None:
            found = deployed_namespaces()
            if len(found) != 1:
                ray.shutdown()
                if not found:
                    say(f"no thinkserve deployment on the Ray cluster at {address or 'auto'}; nothing to stop")
                    return 0
                print("thinkserve down: thinkserve is deployed in namespaces " + ", ".join(found)
                      + "; say which with --namespace", file=sys.stderr)
                return 2
            namespace = found[0]
        stopped = teardown(namespace, progress=say)
        gone = find_controller(namespace) is None
    finally:
        ray.shutdown()
    if not gone:
        print(f"thinkserve down: the controller of namespace {namespace!r} is still alive; the record is kept",
              file=sys.stderr)
        return 1
    say(f"deployment stopped (namespace {namespace!r})" if stopped
        else f"no thinkserve deployment in namespace {namespace!r}; nothing to stop")
    if state is not None and state.started_ray_head and not args.keep_ray:
        stop_ray_head(state.session_dir, state.ray_address, say)
    clear_state(namespace)
    return 0
