"""The colocated baseline: only a `mixed` pool, every request prefilled and decoded in one engine."""
from __future__ import annotations

import pytest
from cluster_helpers import cluster_config, start_deployment, stop_deployment, wait_kv_free

from thinkserve.protos.thinkserve.v1 import admin_pb2


@pytest.fixture(scope="module")
def dep(ray_session, tiny_model):
    cfg = cluster_config(tiny_model, pools={"prefill": {"replicas": 0}, "short_decode": {"replicas": 0},
                                            "long_decode": {"replicas": 0}, "mixed": {"replicas": 1, "num_cpus": 0.5}})
    d = start_deployment(cfg)
    yield d
    stop_deployment(d)


def test_mixed_pool_serves_alone_with_offline_outputs(dep, reference):
    tokens, final = dep.client.generate("colocated", max_tokens=40, ignore_eos=True)
    assert tokens[0] == reference("colocated", 40, ignore_eos=True)[0]
    assert final.timings.prefill_instance == "mixed-0" and list(final.timings.decode_instances) == ["mixed-0"]
    assert final.timings.handoff_ms == 0
    tokens, _ = dep.client.generate("vote", max_tokens=30, n=3, temperature=0.9, seed=3)
    assert tokens == reference("vote", 30, n=3, temperature=0.9, seed=3)
    wait_kv_free(dep.client)


def test_prefill_and_decode_pools_can_be_added_live(dep, reference):
    admin = dep.client.admin
    admin.ScalePool(admin_pb2.ScalePoolRequest(pool="prefill", replicas=1), timeout=120)
    admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=1), timeout=120)
    tokens, final = dep.client.generate("now split", max_tokens=20, ignore_eos=True)
    assert tokens[0] == reference("now split", 20, ignore_eos=True)[0]
    assert final.timings.prefill_instance == "prefill-0"
    assert list(final.timings.decode_instances) == ["short_decode-0"]
    wait_kv_free(dep.client)
    dep.check_integrity()
