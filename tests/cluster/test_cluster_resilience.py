"""Resizing and failures under load on a real local deployment: nothing is lost, nothing is
duplicated, outputs stay equal to the offline engine's, and every KV block is free at the end."""
from __future__ import annotations

import time

import pytest
import ray
from cluster_helpers import Load, cluster_config, start_deployment, stop_deployment, wait_kv_free

from thinkserve.protos.thinkserve.v1 import admin_pb2

PROMPTS = [f"question {i}: what is {i}+{2 * i}?" for i in range(10)]


@pytest.fixture(scope="module")
def dep(ray_session, tiny_model):
    d = start_deployment(cluster_config(tiny_model))
    yield d
    stop_deployment(d)


def test_100_requests_while_decode_pool_scales_up_then_down(dep, reference):
    kw = dict(max_tokens=60, ignore_eos=True)
    want = {p: reference(p, 60, ignore_eos=True)[0] for p in PROMPTS}
    first = Load(dep, [(PROMPTS[i % 10], kw) for i in range(50)]).start()
    first.wait_progress(1, 10)
    up = dep.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=2), timeout=120)
    assert up.added == 1 and up.pool.serving_replicas == 2, ray.get(dep.controller.recent_events.remote(0))
    second = Load(dep, [(PROMPTS[i % 10], kw) for i in range(50)]).start()
    second.wait_progress(1, 10)
    down = dep.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=1), timeout=120)
    assert down.removed == 1 and down.pool.serving_replicas == 1
    results = list(first.join().values()) + list(second.join().values())
    assert len(results) == 100
    for (tokens, final), (prompt, _) in zip(results, first.jobs + second.jobs):
        assert tokens[0] == want[prompt], final.timings          # no token lost or repeated
        assert list(final.final.branches[0].token_ids) == want[prompt]
    st = wait_kv_free(dep.client)
    assert st.frontend.failed_requests == 0
    assert [p.target_replicas for p in st.pools if p.name == "short_decode"] == [1]
    dep.check_integrity()
    assert dict(dep.frontend_state().parts) == {}


def test_best_of_n_fans_out_across_decode_instances(dep, reference):
    """One prefill, its KV sent once to each decode instance that hosts branches (fan-out)."""
    admin = dep.client.admin
    admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=2), timeout=120)
    tokens, final = dep.client.generate("fan out", max_tokens=40, n=4, temperature=0.8, seed=42, ignore_eos=True)
    assert tokens == reference("fan out", 40, n=4, temperature=0.8, seed=42, ignore_eos=True)
    assert len(final.timings.decode_instances) == 2
    assert all(i.startswith("short_decode") for i in final.timings.decode_instances)
    down = admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=1), timeout=120)
    assert down.pool.serving_replicas == 1
    wait_kv_free(dep.client)
    dep.check_integrity()


def test_drain_instance_migrates_running_requests(dep, reference):
    dep.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="long_decode", replicas=2), timeout=120)
    kw = dict(max_tokens=450, ignore_eos=True)                # long pool
    load = Load(dep, [(PROMPTS[i], kw) for i in range(4)]).start()
    load.wait_progress(10, 4)
    res = dep.client.admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="long_decode-0"), timeout=120)
    assert res.migrated_requests >= 1
    moved = 0
    for i, (tokens, final) in load.join().items():
        assert tokens[0] == reference(PROMPTS[i], 450, ignore_eos=True)[0]
        if final.timings.migrations:
            moved += 1
            assert list(final.timings.decode_instances) == ["long_decode-0", "long_decode-1"]
    assert moved == res.migrated_requests
    st = wait_kv_free(dep.client)
    long_pool = next(p for p in st.pools if p.name == "long_decode")
    assert [i.instance_id for i in long_pool.instances] == ["long_decode-1"] and long_pool.target_replicas == 1
    dep.check_integrity()


def test_killed_decode_instance_requests_complete_correctly(dep, reference):
    jobs = [(PROMPTS[i], dict(max_tokens=250, ignore_eos=True)) for i in range(4)]
    jobs.append(("vote", dict(max_tokens=120, n=3, temperature=1.0, seed=5, ignore_eos=True)))
    load = Load(dep, jobs).start()
    load.wait_progress(15, len(jobs))
    victim = next(m for m in dep.members() if m.instance_id.startswith("short_decode"))
    ray.kill(victim.handle, no_restart=True)
    results = load.join()
    for i in range(4):
        tokens, final = results[i]
        assert tokens[0] == reference(PROMPTS[i], 250, ignore_eos=True)[0]
        assert final.timings.resumes >= 1
    tokens, final = results[4]
    assert tokens == reference("vote", 120, n=3, temperature=1.0, seed=5, ignore_eos=True)
    # the controller replaces the dead instance
    deadline = time.monotonic() + 60
    while True:
        pool = next(p for p in dep.client.status().pools if p.name == "short_decode")
        if pool.serving_replicas == 1 and pool.instances[0].instance_id != victim.instance_id:
            break
        assert time.monotonic() < deadline, pool
        time.sleep(0.2)
    wait_kv_free(dep.client)
    dep.check_integrity()


def test_killed_prefill_instance_is_replaced_and_requests_complete(dep, reference):
    victim = next(m for m in dep.members() if m.pool == "prefill")
    ray.kill(victim.handle, no_restart=True)
    tokens, final = dep.client.generate(PROMPTS[1], max_tokens=30, ignore_eos=True, timeout=120)
    assert tokens[0] == reference(PROMPTS[1], 30, ignore_eos=True)[0]
    wait_kv_free(dep.client)


@pytest.fixture
def slow_decode(ray_session, tiny_model):
    """One decode instance (no long_decode pool a refused hand-off could go to instead) that runs
    2 branches at a time, so a load outlasts a new instance's start."""
    d = start_deployment(cluster_config(tiny_model, router={"long_threshold": 4096}, pools={
        "short_decode": {"replicas": 1, "num_cpus": 0.5, "engine": {"max_num_seqs": 2}},
        "long_decode": {"replicas": 0}}))
    yield d
    stop_deployment(d)


def test_scaling_up_under_load_puts_work_on_the_new_instance(slow_decode, reference):
    """The new instance joins while the old one is full and hand-offs wait for its batch slots
    (``Scheduler.reserve_import``: the prefill instance keeps their KV): the waiting hand-offs,
    and any part rebalancing moves, run on the new instance; outputs stay equal, no block is left
    behind. (Rebalancing running parts onto a joining instance with no queue in front of it:
    ``test_orchestrator.py::test_a_joining_instance_takes_running_parts_through_rebalancing``,
    through the same ``Orchestrator.rebalance_loop`` the frontend runs.)"""
    kw = dict(max_tokens=450, ignore_eos=True)
    want = {p: reference(p, 450, ignore_eos=True)[0] for p in PROMPTS}
    # 24 requests two at a time: on a quiet machine 8 finished before the new instance served.
    load = Load(slow_decode, [(PROMPTS[i % 10], kw) for i in range(24)]).start()
    load.wait_progress(5, 2)
    up_started = time.time()
    up = slow_decode.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=2), timeout=120)
    assert up.added == 1
    (new,) = {i.instance_id for i in up.pool.instances} - {m.instance_id for m in slow_decode.members()
                                                          if m.created_at < up_started}
    unfinished_at_join = sum(1 for v in load.progress.values() if v < 450)
    results = load.join()
    on_new = 0
    for (tokens, final), (prompt, _) in zip(results.values(), load.jobs):
        assert tokens[0] == want[prompt], final.timings
        on_new += new in final.timings.decode_instances
    assert on_new >= 1, (on_new, unfinished_at_join, new, [f.timings.decode_instances for _, f in results.values()])
    slow_decode.client.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=1), timeout=120)
    wait_kv_free(slow_decode.client)
    slow_decode.check_integrity()
