"""Joining (or starting) a Ray cluster and deploying thinkserve on it; shared by the CLI, the demo
and the tests.

    connect()  ── RAY_ADDRESS / --address / a running local cluster ──▶ join it
               └─ none (or the demo): start one (in this process, or `ray start --head` when
                  detached), on 127.0.0.1 only, token auth on, no dashboard (``ray:`` config)
    deploy()   ── detached Controller ──▶ pools' Instance actors, CPU KV store, Frontend (gRPC)
    teardown() ── Controller.shutdown() (frontend, instances, store), then the controller

What `up` started is recorded, one file per namespace, so `down`, `status`, `scale` and `submit`
find the deployment without being told where it is; a record goes only once its deployment is.

Loopback: Ray's gRPC servers (GCS, raylet, object manager, each worker) listen on every interface
unless the node IP is 127.0.0.1, and ``ray start`` / ``ray.init`` replace 127.0.0.1 with the
routable address unless Ray runs in its single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
the default on macOS and Windows). That mode is what ``ray.loopback_only`` turns on; it is read
by every Ray process, so it goes into the environment of this process and of what it starts.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import ray

from .config import ClusterConfig, RayConfig
from .controller import CONTROLLER_NAME, NAMESPACE, Controller

SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # "0": node IP 127.0.0.1, no other node

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class DeploymentState:
    grpc_address: str
    ray_address: str
    namespace: str = NAMESPACE
    started_ray_head: bool = False     # `down` stops the Ray cluster only if `up` started it
    loopback_only: bool = False        # that Ray runs in single-machine mode: its clients must too
    session_dir: str = ""              # the Ray session `up` started (what `down` stops), if it did
    admin_address: str = ""            # the Admin service's own listener ("" = on grpc_address)
    http_address: str = ""             # OpenAI-compatible HTTP and /metrics ("" = off)


class AmbiguousDeployment(LookupError):
    """Several deployments are recorded and none was named."""


def state_dir() -> Path:
    return Path(os.environ.get("THINKSERVE_STATE_DIR", Path.home() / ".thinkserve")) / "deployments"


def state_path(namespace: str) -> Path:
    return state_dir() / f"{namespace}.json"


def save_state(state: DeploymentState) -> None:
    p = state_path(state.namespace)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(p)      # never a half-written record


def load_states() -> dict[str, DeploymentState]:
    """Every recorded deployment, by namespace."""
    out = {}
    for p in sorted(state_dir().glob("*.json")):
        try:
            st = DeploymentState(**json.loads(p.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[st.namespace] = st
    return out


def load_state(namespace: str | None = None) -> DeploymentState | None:
    """The deployment recorded for ``namespace``; with none named, the only one recorded
    (``AmbiguousDeployment`` when there are several)."""
    states = load_states()
    if namespace is not None:
        return states.get(namespace)
    if len(states) > 1:
        raise AmbiguousDeployment("deployments are recorded in namespaces " + ", ".join(sorted(states))
                                  + "; say which with --namespace")
    return next(iter(states.values()), None)


def clear_state(namespace: str) -> None:
    try:
        state_path(namespace).unlink()
    except OSError:
        pass


def ray_cpus_needed(cfg: ClusterConfig, headroom: float = 4.0) -> int:
    need = sum(cfg.pool(p).replicas * cfg.pool(p).num_cpus for p in ("prefill", "short_decode", "long_decode", "mixed"))
    return int(max(os.cpu_count() or 1, need + cfg.frontend.num_cpus + headroom))


def use_single_machine_ray() -> None:
    """Ray's single-machine mode for this process and every process it starts (module doc)."""
    os.environ[SINGLE_MACHINE_ENV] = "0"
    from ray._private import ray_constants
    ray_constants.ENABLE_RAY_CLUSTER = False    # read once, when ray was imported


def _set_auth_mode(mode: str) -> None:
    """Ray's token authentication on or off, for this process and what it starts."""
    os.environ["RAY_AUTH_MODE"] = mode
    from ray._raylet import Config
    Config.initialize("")           # Ray caches its config at import; this is how it refreshes it


def _ray_bin() -> str:
    return shutil.which("ray") or str(Path(sys.executable).with_name("ray"))


def connect(address: str | None = None, *, namespace: str = NAMESPACE, num_cpus: int | None = None,
            start_head: bool = False, join_running: bool = True, settings: RayConfig = RayConfig(),
            progress: Progress = _quiet, log_to_driver: bool = True) -> tuple[str, bool]:
    """Join the Ray cluster at ``address`` (or, with ``join_running``, ``RAY_ADDRESS`` or one
    running on this machine); else start one as ``settings`` say: inside this process, or as a
    `ray start --head` daemon that outlives it (``start_head``). Returns (address, whether this
    call started a head daemon)."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address, False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    target = address or (os.environ.get("RAY_ADDRESS") if join_running else None)
    if target:
        progress(f"joining the Ray cluster at {target}")
        ray.init(address=target, namespace=namespace, log_to_driver=log_to_driver)
        return ray.get_runtime_context().gcs_address, False
    if join_running:
        try:
            ray.init(address="auto", namespace=namespace, log_to_driver=log_to_driver)
            progress(f"joined the running Ray cluster at {ray.get_runtime_context().gcs_address}")
            return ray.get_runtime_context().gcs_address, False
        except (ConnectionError, RuntimeError):
            pass
    if settings.loopback_only:
        use_single_machine_ray()
    _set_auth_mode("token" if settings.token_auth else "disabled")
    where = "127.0.0.1 only" if settings.loopback_only else "every interface"
    if start_head:
        if settings.token_auth:   # `ray start` turns token auth on only when a token exists
            subprocess.run([_ray_bin(), "get-auth-token", "--generate"], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
        cmd = [_ray_bin(), "start", "--head", "--disable-usage-stats",
               f"--include-dashboard={'true' if settings.include_dashboard else 'false'}",
               f"--dashboard-host={settings.dashboard_host}", f"--num-cpus={num_cpus or os.cpu_count()}"]
        progress(f"starting a local Ray cluster (ray start --head; listening on {where})")
        subprocess.run(cmd, check=True, env=dict(os.environ, RAY_worker_niceness=str(settings.worker_niceness)),
                       stdout=subprocess.DEVNULL)
        ray.init(address="auto", namespace=namespace, log_to_driver=log_to_driver)
        return ray.get_runtime_context().gcs_address, True
    progress(f"starting a local Ray cluster in this process (listening on {where})")
    os.environ.pop("RAY_ADDRESS", None)    # ours, not the one the environment names (and our workers too)
    ray.init(address="local", num_cpus=num_cpus, namespace=namespace, include_dashboard=settings.include_dashboard,
             dashboard_host=settings.dashboard_host, log_to_driver=log_to_driver,
             _system_config={"worker_niceness": settings.worker_niceness})
    return ray.get_runtime_context().gcs_address, False


def find_controller(namespace: str = NAMESPACE):
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


def deployed_namespaces() -> list[str]:
    """Namespaces of the connected Ray cluster that hold a thinkserve controller."""
    from ray.util import list_named_actors
    return sorted({a["namespace"] for a in list_named_actors(all_namespaces=True) if a["name"] == CONTROLLER_NAME})


class AlreadyDeployed(RuntimeError):
    pass


def deploy(cfg: ClusterConfig, *, progress: Progress = _quiet, timeout_s: float = 600.0) -> tuple[object, str]:
    """Start the controller and through it every pool, the KV store and the frontend; returns
    (controller handle, gRPC address) once every instance serves. Prints progress as it goes."""
    if find_controller(cfg.namespace) is not None:
        raise AlreadyDeployed(f"thinkserve is already deployed in namespace {cfg.namespace!r} of this Ray "
                              f"cluster; stop it with `thinkserve down --namespace {cfg.namespace}`, or deploy "
                              "in another namespace")
    controller = Controller.options(name=CONTROLLER_NAME, namespace=cfg.namespace, lifetime="detached",
                                    num_cpus=0, max_concurrency=10_000).remote(cfg.model_dump())
    started = controller.start.remote()
    seen = 0
    t0 = time.monotonic()
    while True:
        ready, _ = ray.wait([started], timeout=0.5)
        try:
            seen, events = ray.get(controller.recent_events.remote(seen), timeout=10)
            for e in events:
                progress(e)
        except Exception:
            pass
        if ready:
            break
        if time.monotonic() - t0 > timeout_s:
            teardown(cfg.namespace)
            raise TimeoutError(f"deployment did not start within {timeout_s:.0f}s")
    try:
        address = ray.get(started)
    except Exception:
        teardown(cfg.namespace)
        raise
    return controller, address


def teardown(namespace: str = NAMESPACE, *, progress: Progress = _quiet) -> bool:
    """Stop the deployment in ``namespace``; False if there was none."""
    controller = find_controller(namespace)
    if controller is None:
        return False
    progress("stopping the frontend, the instances and the KV store")
    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    except Exception as e:
        progress(f"controller shutdown did not finish cleanly ({type(e).__name__}); killing it")
    ray.kill(controller, no_restart=True)
    deadline = time.monotonic() + 10.0     # the name is released shortly after the kill
    while find_controller(namespace) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    return True


def session_dir() -> str:
    """The session directory of the Ray cluster this process is connected to."""
    return ray._private.worker._global_node.get_session_dir_path()


def ray_processes(session: str, gcs_address: str) -> list[int]:
    """Processes of the Ray cluster whose session directory is ``session`` (GCS, raylet, agents,
    monitors name it on their command lines; the Ray client server names ``gcs_address``; its
    workers exit with their raylet)."""
    mine = ("--address=" + gcs_address) if gcs_address else None
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if any(a.endswith(session) or session + "/" in a or a == mine for a in cmdline.split("\0")):
            pids.append(int(d))
    return pids


def stop_ray_head(session: str, gcs_address: str, progress: Progress = _quiet, timeout_s: float = 15.0) -> bool:
    """Stop the Ray cluster that `up` started, and only it (``ray stop`` would stop every Ray
    instance of this user on the machine). False when none of its processes was found."""
    if not session:
        progress("this record does not say which Ray session `up` started; leaving Ray running "
                 "(`ray stop` stops every Ray instance on this machine)")
        return False
    pids = ray_processes(session, gcs_address)
    if not pids:
        return False
    progress(f"stopping the local Ray cluster that `up` started ({len(pids)} processes of {session})")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids):
            time.sleep(0.2)
        pids = [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)]
        if not pids:
            break
    # As `ray stop` does: a later ray.init() must not look for this cluster any more.
    current = Path(session).parent / "ray_current_cluster"
    try:
        if current.read_text().strip() == gcs_address:
            current.unlink()
    except OSError:
        pass
    return True


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def frontend_addresses(namespace: str = NAMESPACE) -> dict[str, str]:
    """``{"grpc", "admin", "http"}`` host:port of the running frontend ("" where not served)."""
    from .controller import FRONTEND_NAME
    return ray.get(ray.get_actor(FRONTEND_NAME, namespace=namespace).addresses.remote(), timeout=30)

