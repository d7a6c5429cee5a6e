"""The `thinkserve` CLI against a real deployment: up --detach, status, submit, scale, down."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml


def thinkserve(*args, env, timeout=240):
    return subprocess.run([sys.executable, "-m", "thinkserve.cluster.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def env(tmp_path_factory, ray_session):
    # Copied after ray.init: it sets RAY_AUTH_MODE, which a CLI joining the cluster needs too.
    d = tmp_path_factory.mktemp("cli_state")
    return dict(os.environ, THINKSERVE_STATE_DIR=str(d), RAY_USAGE_STATS_ENABLED="0")


def test_bad_config_names_the_field(tmp_path, env):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  prefill: {replicas: -2}\n")
    r = thinkserve("up", "--config", str(bad), env=env)
    assert r.returncode == 2
    assert "pools.prefill.replicas" in r.stderr


def test_status_without_a_deployment_says_so(env):
    r = thinkserve("status", "--server", "127.0.0.1:1", env=env, timeout=60)
    assert r.returncode == 1 and "no thinkserve frontend answers" in r.stderr


def test_up_status_submit_scale_down(ray_session, tiny_model, tmp_path, env):
    """With THINKSERVE_API_TOKEN where `up` runs (Admin on its own port): the CLI sends it."""
    plain, env = env, dict(env, THINKSERVE_API_TOKEN="cli-test-token")
    cfg = {"model": tiny_model, "namespace": "thinkserve-cli-test",
           "engine": {"num_device_blocks": 64, "max_num_seqs": 16},
           "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "short_decode": {"replicas": 1, "num_cpus": 0.5},
                     "long_decode": {"replicas": 0}},
           "frontend": {"port": 0, "http_port": 0, "admin_port": 0}, "store": {"capacity_bytes": 0}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(cfg))
    address = ray_session.get_runtime_context().gcs_address
    up = thinkserve("up", "--config", str(path), "--address", address, "--detach", env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert "prefill-0: serving" in up.stdout and "detached" in up.stdout
        assert "(HTTP, OpenAI API and /metrics)" in up.stdout and "a token is required" in up.stdout
        refused = thinkserve("status", env=plain)
        assert refused.returncode == 1 and "set THINKSERVE_API_TOKEN" in refused.stderr

        st = thinkserve("status", "--json", env=env)
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["frontend"]["http_address"].startswith("127.0.0.1:")
        assert status["frontend"]["admin_address"] not in ("", status["frontend"]["address"])
        assert [(p["name"], p["serving_replicas"]) for p in status["pools"]] == [
            ("prefill", 1), ("short_decode", 1), ("long_decode", 0), ("mixed", 0)]
        table = thinkserve("status", env=env)
        assert "short_decode-0" in table.stdout and "KV USED" in table.stdout

        sub = thinkserve("submit", "12+34=", "--max-tokens", "6", "--json", env=env)
        assert sub.returncode == 0, sub.stderr
        final = json.loads(sub.stdout)
        assert len(final["final"]["branches"][0]["token_ids"]) <= 6
        streamed = thinkserve("submit", "hi", "--n", "2", "--max-tokens", "4", "--stream", "--seed", "1", env=env)
        assert streamed.returncode == 0 and "tokens:" in streamed.stdout

        bad = thinkserve("submit", "hi", "--temperature", "-1", env=env)
        assert bad.returncode == 1 and "INVALID_ARGUMENT: sampling.temperature" in bad.stderr

        dbg = thinkserve("debug", "--step-traces", env=env)     # the router's state, as JSON
        assert dbg.returncode == 0, dbg.stderr
        state = json.loads(dbg.stdout)
        assert state["requests"] == [] and state["parts"] == {}
        assert int(state["counters"]["completed"]) == 2 and int(state["counters"]["rejected"]) == 1
        assert sorted(t["instance_id"] for t in state["step_traces"]) == ["prefill-0", "short_decode-0"]
        assert sum(s["prefill_tokens"] for t in state["step_traces"] for s in t["steps"]) > 0
        bad = thinkserve("debug", "--prefix-of", "1,x", env=env)
        assert bad.returncode == 2 and "not comma-separated token ids" in bad.stderr

        sc = thinkserve("scale", "short_decode", "2", env=env)
        assert sc.returncode == 0, sc.stderr
        assert "short_decode: 2 serving (added 1" in sc.stdout
        sc = thinkserve("scale", "short_decode", "1", env=env)
        assert sc.returncode == 0 and "short_decode: 1 serving" in sc.stdout
    finally:
        down = thinkserve("down", env=env)
    assert down.returncode == 0, down.stderr
    assert "deployment stopped" in down.stdout
    with pytest.raises(ValueError):
        ray_session.get_actor("thinkserve-controller", namespace="thinkserve-cli-test")


def test_down_and_status_find_a_deployment_in_any_namespace(ray_session, tiny_model, tmp_path, env):
    """`up --config` in a namespace of its own: status and down find it from the record; with the
    record lost, down finds it on the Ray cluster; a record is kept while its deployment may live."""
    ns = "thinkserve-cli-elsewhere"
    cfg = {"model": tiny_model, "namespace": ns, "engine": {"num_device_blocks": 64, "max_num_seqs": 8},
           "pools": {"prefill": {"replicas": 0}, "short_decode": {"replicas": 0}, "long_decode": {"replicas": 0},
                     "mixed": {"replicas": 1, "num_cpus": 0.5}},
           "frontend": {"port": 0}, "store": {"capacity_bytes": 0}}
    path = tmp_path / "elsewhere.yaml"
    path.write_text(yaml.safe_dump(cfg))
    address = ray_session.get_runtime_context().gcs_address
    state_dir = tmp_path / "state"
    env = dict(env, THINKSERVE_STATE_DIR=str(state_dir))
    record = state_dir / "deployments" / f"{ns}.json"

    def controller_alive():
        try:
            ray_session.get_actor("thinkserve-controller", namespace=ns)
            return True
        except ValueError:
            return False

    up = thinkserve("up", "--config", str(path), "--address", address, "--detach", env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert json.loads(record.read_text())["namespace"] == ns
        st = thinkserve("status", "--json", env=env)          # the only record: no flag needed
        assert st.returncode == 0, st.stderr
        assert [p["serving_replicas"] for p in json.loads(st.stdout)["pools"] if p["name"] == "mixed"] == [1]

        # A second record whose Ray cluster is gone: status must be told which, down keeps that record.
        (state_dir / "deployments" / "thinkserve-gone.json").write_text(json.dumps(
            {"grpc_address": "127.0.0.1:1", "ray_address": "127.0.0.1:1", "namespace": "thinkserve-gone"}))
        amb = thinkserve("status", env=env, timeout=60)
        assert amb.returncode == 2 and "thinkserve-cli-elsewhere" in amb.stderr and "--namespace" in amb.stderr
        assert thinkserve("status", "--namespace", ns, env=env).returncode == 0
        gone = thinkserve("down", "--namespace", "thinkserve-gone", env=env, timeout=120)
        assert gone.returncode == 1 and "record is kept" in gone.stderr, (gone.stdout, gone.stderr)
        assert (state_dir / "deployments" / "thinkserve-gone.json").exists()
        (state_dir / "deployments" / "thinkserve-gone.json").unlink()

        # The record lost (another state dir): down finds the namespace on the Ray cluster.
        lost = dict(env, THINKSERVE_STATE_DIR=str(tmp_path / "empty"))
        down = thinkserve("down", "--address", address, env=lost)
        assert down.returncode == 0, down.stderr
        assert f"deployment stopped (namespace '{ns}')" in down.stdout
        assert not controller_alive()
        # The stale record: down finds nothing to stop and only then forgets it.
        stale = thinkserve("down", env=env)
        assert stale.returncode == 0 and "nothing to stop" in stale.stdout and not record.exists()
    finally:
        if controller_alive():
            thinkserve("down", "--namespace", ns, "--address", address, env=env)
