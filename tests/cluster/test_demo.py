"""`python3 dev.py demo` (``thinkserve.cluster.demo``) beside a deployment that is already running:
the demo starts a Ray of its own, listening on 127.0.0.1 only, and stops only what it started.

Before: the demo joined the running Ray cluster (RAY_ADDRESS or the one found on this machine),
met a deployment in the default namespace, raised AlreadyDeployed, and its ``finally`` tore that
deployment down."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from cluster_helpers import (cluster_config, is_loopback, listening_sockets, process_tree, start_deployment,
                             stop_deployment, wait_kv_free)

from thinkserve.protos.thinkserve.v1 import admin_pb2


def test_proc_parsing_sees_a_wildcard_listener():
    """The parser itself: a socket bound to 0.0.0.0 is seen, and seen as not loopback."""
    s = socket.create_server(("0.0.0.0", 0))
    try:
        port = s.getsockname()[1]
        mine = [x for x in listening_sockets([os.getpid()]) if x[2] == port]
        assert mine and mine[0][1] == "0.0.0.0" and not is_loopback(mine[0][1])
    finally:
        s.close()
    assert is_loopback("::ffff:127.0.0.1") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("::")


# ----------------------------------------------------------------------------- the demo
@pytest.fixture(scope="module")
def other(ray_session, tiny_model):
    """A deployment in the default namespace, where the demo used to deploy too."""
    d = start_deployment(cluster_config(tiny_model, namespace="thinkserve"))
    yield d
    stop_deployment(d)


def test_demo_leaves_a_running_deployment_alone_and_its_ray_binds_loopback(other, tiny_model, reference,
                                                                           ray_session):
    gcs = ray_session.get_runtime_context().gcs_address
    env = dict(os.environ, RAY_ADDRESS=gcs, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
    demo = subprocess.Popen([sys.executable, "-m", "thinkserve.cluster.demo", "--model", tiny_model, "--keep-running"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 420
        for line in demo.stdout:
            lines.append(line)
            if "Ctrl-C to stop" in line:
                break
            assert time.monotonic() < deadline, "".join(lines[-30:])
        assert any("Ctrl-C to stop" in ln for ln in lines), "".join(lines[-30:])
        assert any("starting a local Ray cluster in this process" in ln for ln in lines), "".join(lines)

        # Everything the demo's Ray listens on is loopback (GCS, raylet, agents, every worker).
        socks = listening_sockets(process_tree(demo.pid))
        names = {n for n, _, _ in socks}
        assert {"gcs_server", "raylet"} <= names and any(n.startswith("ray::") for n in names), socks
        wild = [s for s in socks if not is_loopback(s[1])]
        assert not wild, f"listening beyond loopback: {wild}"

        # The demo deployed nothing on the running cluster.
        from ray.util import list_named_actors
        spaces = {a["namespace"] for a in list_named_actors(all_namespaces=True)}
        assert not any(s.startswith("thinkserve-demo") for s in spaces), spaces
    finally:
        if demo.poll() is None:
            demo.send_signal(signal.SIGINT)
        rest, _ = demo.communicate(timeout=180)
        lines.append(rest)
    assert demo.returncode == 0, "".join(lines[-40:])
    out = "".join(lines)
    assert "answers correct" in out and "shutting down" in out

    # The other deployment: every actor alive and serving, output still equal to the offline engine.
    members = other.members()
    assert sorted(m.instance_id for m in members) == ["long_decode-0", "prefill-0", "short_decode-0"]
    st = other.client.status()
    assert all(i.state == admin_pb2.INSTANCE_STATE_SERVING for p in st.pools for i in p.instances)
    tokens, _ = other.client.generate("still here", max_tokens=12)
    assert tokens[0] == reference("still here", 12)[0]
    wait_kv_free(other.client)
    other.check_integrity()
