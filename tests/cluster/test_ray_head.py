"""The Ray head that `thinkserve up --detach` starts (`ray start --head` through deploy.connect):
it listens on 127.0.0.1 only, and `down` stops that head and nothing else (``ray stop`` would
stop every Ray instance on the machine, the test session's own cluster included)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cluster_helpers import is_loopback, listening_sockets

START = """
import json, ray
from thinkserve.cluster.deploy import connect, session_dir
address, started = connect(start_head=True, join_running=False, num_cpus=1)
@ray.remote
def worker_pid():
    import os
    return os.getpid()
pid = ray.get(worker_pid.remote())
print(json.dumps({"address": address, "started": started, "session": session_dir(), "worker": pid}))
ray.shutdown()
"""


def test_started_head_binds_loopback_and_down_stops_only_it(ray_session):
    from thinkserve.cluster.deploy import ray_processes, stop_ray_head
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    r = subprocess.run([sys.executable, "-c", START], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    head = json.loads(r.stdout.strip().splitlines()[-1])
    assert head["started"] and head["address"].startswith("127.0.0.1:")
    pids = ray_processes(head["session"], head["address"])
    try:
        socks = listening_sockets(pids)
        names = {n for n, _, _ in socks}
        assert {"gcs_server", "raylet"} <= names, socks
        assert not [s for s in socks if not is_loopback(s[1])], socks
        assert stop_ray_head(head["session"], head["address"])
        left = [p for p in pids + [head["worker"]] if os.path.exists(f"/proc/{p}")
                and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not left, left
        current = Path(head["session"]).parent / "ray_current_cluster"   # a later ray.init() must not look for it
        assert not (current.exists() and current.read_text().strip() == head["address"])
    finally:
        for p in pids:
            try:
                os.kill(p, 9)
            except OSError:
                pass
    # The test session's own Ray cluster is untouched.
    assert ray_session.get(ray_session.remote(lambda: 41 + 1).remote(), timeout=60) == 42


NICENESS = """
import json, os, sys, ray
from thinkserve.cluster.config import RayConfig
from thinkserve.cluster.deploy import connect
connect(join_running=False, num_cpus=1, settings=RayConfig(worker_niceness=int(sys.argv[1])), log_to_driver=False)
@ray.remote
class Probe:
    def niceness(self):
        # every thread of the worker: nice is per thread on Linux (Ray renices the main one)
        out = set()
        for tid in os.listdir("/proc/self/task"):
            out.add(int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16]))
        return os.getpriority(os.PRIO_PROCESS, 0), sorted(out)
here, threads = ray.get(Probe.remote().niceness.remote())
print(json.dumps({"driver": os.getpriority(os.PRIO_PROCESS, 0), "worker": here, "threads": threads}))
ray.shutdown()
"""


def test_started_ray_runs_its_workers_at_the_configured_niceness():
    """Ray renices its workers by 15 unless told otherwise; thinkserve's engines are the server's
    work, so a Ray that thinkserve starts runs them as nice as the process that started it."""
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_worker_niceness", None)
    seen = {}
    for niceness in (0, 3):
        r = subprocess.run([sys.executable, "-c", NICENESS, str(niceness)], env=env, capture_output=True, text=True,
                           timeout=240)
        assert r.returncode == 0, r.stderr[-3000:]
        seen[niceness] = json.loads(r.stdout.strip().splitlines()[-1])
    driver = seen[0]["driver"]
    assert seen[0]["worker"] == driver and seen[0]["threads"] == [driver]    # Ray's default would add 15
    # The thread that runs the actor's methods (and every thread it starts, the engine's too).
    assert seen[3]["worker"] == min(19, driver + 3)
