"""Joining (or starting) a Ray cluster and deploying thinkserve on it; shared by the CLI, the demo
and the tests.

    connect()  ── RAY_ADDRESS / --address / a running local cluster ──▶ join it
               └─ none: start one (in this process, or `ray start --head` when detached)
    deploy()   ── detached Controller ──▶ pools' Instance actors, CPU KV store, Frontend (gRPC)
    teardown() ── Controller.shutdown() (frontend, instances, store), then the controller

What `up --detach` started is recorded in a small state file so `down`, `status`, `scale` and
`submit` find the deployment without being told where it is.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import ray

from .config import ClusterConfig
from .controller import CONTROLLER_NAME, NAMESPACE, Controller

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


@dataclass
class DeploymentState:
    grpc_address: str
    ray_address: str
    namespace: str = NAMESPACE
    started_ray_head: bool = False     # `down` stops the Ray cluster only if `up` started it
    admin_address: str = ""            # the Admin service's own listener ("" = on grpc_address)
    http_address: str = ""             # OpenAI-compatible HTTP and /metrics ("" = off)


def state_path() -> Path:
    return Path(os.environ.get("THINKSERVE_STATE_DIR", Path.home() / ".thinkserve")) / "deployment.json"


def save_state(state: DeploymentState) -> None:
    p = state_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(asdict(state), indent=2))


def load_state() -> DeploymentState | None:
    try:
        return DeploymentState(**json.loads(state_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def clear_state() -> None:
    try:
        state_path().unlink()
    except OSError:
        pass


def ray_cpus_needed(cfg: ClusterConfig, headroom: float = 4.0) -> int:
    need = sum(cfg.pool(p).replicas * cfg.pool(p).num_cpus for p in ("prefill", "short_decode", "long_decode", "mixed"))
    return int(max(os.cpu_count() or 1, need + cfg.frontend.num_cpus + headroom))


def connect(address: str | None = None, *, namespace: str = NAMESPACE, num_cpus: int | None = None,
            start_head: bool = False, progress: Progress = _quiet, log_to_driver: bool = True) -> tuple[str, bool]:
    """Join the Ray cluster at ``address`` (or ``RAY_ADDRESS``, or one running on this machine);
    with none, start one: inside this process, or as a `ray start --head` daemon that outlives it
    (``start_head``). Returns (address, whether this call started a head daemon)."""
    if ray.is_initialized():
        return ray.get_runtime_context().gcs_address, False
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    target = address or os.environ.get("RAY_ADDRESS")
    if target:
        progress(f"joining the Ray cluster at {target}")
        ray.init(address=target, namespace=namespace, log_to_driver=log_to_driver)
        return ray.get_runtime_context().gcs_address, False
    try:
        ray.init(address="auto", namespace=namespace, log_to_driver=log_to_driver)
        progress(f"joined the running Ray cluster at {ray.get_runtime_context().gcs_address}")
        return ray.get_runtime_context().gcs_address, False
    except (ConnectionError, RuntimeError):
        pass
    if start_head:
        ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
        cmd = [ray_bin, "start", "--head", "--disable-usage-stats", "--include-dashboard=false",
               f"--num-cpus={num_cpus or os.cpu_count()}"]
        progress("starting a local Ray cluster (ray start --head)")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        ray.init(address="auto", namespace=namespace, log_to_driver=log_to_driver)
        return ray.get_runtime_context().gcs_address, True
    progress("starting a local Ray cluster in this process")
    ray.init(num_cpus=num_cpus, namespace=namespace, include_dashboard=False, log_to_driver=log_to_driver)
    return ray.get_runtime_context().gcs_address, False


def find_controller(namespace: str = NAMESPACE):
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


class AlreadyDeployed(RuntimeError):
    pass


def deploy(cfg: ClusterConfig, *, progress: Progress = _quiet, timeout_s: float = 600.0) -> tuple[object, str]:
    """Start the controller and through it every pool, the KV store and the frontend; returns
    (controller handle, gRPC address) once every instance serves. Prints progress as it goes."""
    if find_controller(cfg.namespace) is not None:
        raise AlreadyDeployed(f"thinkserve is already deployed in namespace {cfg.namespace!r}; "
                              "run `thinkserve down` first")
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
    return True


def frontend_addresses(namespace: str = NAMESPACE) -> dict[str, str]:
    """``{"grpc", "admin", "http"}`` host:port of the running frontend ("" where not served)."""
    from .controller import FRONTEND_NAME
    return ray.get(ray.get_actor(FRONTEND_NAME, namespace=namespace).addresses.remote(), timeout=30)


def stop_ray_head(progress: Progress = _quiet) -> None:
    ray_bin = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    progress("stopping the local Ray cluster (ray stop)")
    subprocess.run([ray_bin, "stop"], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
