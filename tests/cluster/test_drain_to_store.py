"""Draining the last decode instance: in-flight KV parks in the CPU store, then comes back."""
from __future__ import annotations

import time

import pytest
from cluster_helpers import Load, cluster_config, start_deployment, stop_deployment, wait_kv_free

from thinkserve.protos.thinkserve.v1 import admin_pb2


@pytest.fixture(scope="module")
def dep(ray_session, tiny_model):
    d = start_deployment(cluster_config(tiny_model, pools={"long_decode": {"replicas": 0}}))
    yield d
    stop_deployment(d)


def test_drained_requests_wait_in_the_store_and_resume(dep, reference):
    prompts = ["park me", "and me"]
    load = Load(dep, [(p, dict(max_tokens=200, ignore_eos=True)) for p in prompts]).start()
    load.wait_progress(10, 2)
    res = dep.client.admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="short_decode-0"), timeout=120)
    assert res.migrated_requests == 2
    time.sleep(0.5)
    assert all(t.is_alive() for t in load.threads)           # parked, not failed
    dep.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=1), timeout=120)
    for i, (tokens, final) in load.join().items():
        assert tokens[0] == reference(prompts[i], 200, ignore_eos=True)[0]
        assert final.timings.resumes == 1
        assert final.usage.recomputed_tokens == 0             # swapped back in, not recomputed
        assert list(final.timings.decode_instances) == ["short_decode-0", "short_decode-1"]
    wait_kv_free(dep.client)
    dep.check_integrity()
