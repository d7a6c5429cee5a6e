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


def test_early_consensus_waves_fork_the_reserve_on_the_mixed_instance(dep, reference):
    """Best-of-8 under an early-stop rule on the Ray cluster's mixed pool: the first wave (4, the
    configured wave) is added with a reserve for branches 4..7 that the actor's engine forks off
    it; later waves are forked off the reserve and run on the same actor. The tiny model's text
    holds no answer, so every branch abstains and all 8 run: each equals branch i of the offline
    Best-of-8, and every block (the reserve's too) comes back. (The in-process
    ``test_waves.py`` counts the prompt tokens this saves.)"""
    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    tokens, final = dep.client.generate("waves", max_tokens=20, n=8, temperature=0.9, seed=5, ignore_eos=True,
                                        early_stop=pb.EARLY_STOP_UNBEATABLE)
    assert tokens == reference("waves", 20, n=8, temperature=0.9, seed=5, ignore_eos=True)
    assert final.final.cancelled_branches == 0 and not final.final.early_stop_rule     # nothing stopped early
    assert final.timings.prefill_instance == "mixed-0" and list(final.timings.decode_instances) == ["mixed-0"]
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
