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
