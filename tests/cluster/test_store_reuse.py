"""The per-node CPU KV store in use: one store per node, prompt prefixes reused across prefill
instances, parked KV released when its request is aborted, and the transport chosen per pair."""
from __future__ import annotations

import os
import time

import pytest
import ray
from cluster_helpers import Load, cluster_config, start_deployment, stop_deployment, wait_kv_free

from thinkserve.cluster.admin_cli import format_status
from thinkserve.protos.thinkserve.v1 import admin_pb2, inference_pb2

BLOCK = 16
LONG_PROMPT = [(7 * i + 3) % 250 for i in range(100)]      # 6 full blocks + 4 tokens
MODE = os.environ.get("THINKSERVE_TEST_KV_TRANSPORT", "auto")
CORE_SETS = [[c] for c in sorted(os.sched_getaffinity(0))[:2]]      # pools.prefill.cpus


@pytest.fixture(scope="module")
def dep(ray_session, tiny_model):
    d = start_deployment(cluster_config(tiny_model, pools={"prefill": {"replicas": 2, "num_cpus": 0.5,
                                                                       "cpus": CORE_SETS},
                                                           "long_decode": {"replicas": 0}}))
    yield d
    stop_deployment(d)


def _stats(dep, instance_id):
    m = next(m for m in dep.members() if m.instance_id == instance_id)
    return ray.get(m.handle.stats.remote())


def test_one_store_per_node_and_instances_use_their_nodes(dep):
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    stores = ray.get(dep.controller.store_addresses.remote())
    assert set(stores) == nodes                         # the local cluster: one node, one store
    for m in dep.members():
        assert m.info.store_address == stores[m.info.node_id]
        assert bool(m.info.shm_address) == (MODE != "tcp")
    assert dict(dep.frontend_state().stores) == stores


def test_the_pools_core_sets_bind_its_engine_threads(dep):
    """``pools.prefill.cpus``: the two prefill instances' engine threads each run on one of the
    configured core sets, the sets shared out one each (where the machine has two cores)."""
    prefill = [m for m in dep.members() if m.pool == "prefill"]
    assert len(prefill) == 2
    bound = []
    for m in prefill:
        tid = ray.get(m.handle.__ray_call__.remote(lambda self: self.host._thread.native_id))
        assert os.sched_getaffinity(tid) == set(m.info.cpus) == set(m.cpus)
        bound.append(m.info.cpus)
    assert sorted(bound) == sorted(tuple(c) for c in (CORE_SETS * 2)[:2])
    for m in dep.members():
        if m.pool != "prefill":
            assert m.info.cpus == ()
    # what `thinkserve status` shows: each prefill instance's cores, none for the others
    st = dep.client.status()
    shown = {i.instance_id: tuple(i.cpus) for p in st.pools for i in p.instances}
    assert shown == {m.instance_id: m.info.cpus for m in dep.members()}
    table = format_status(st)
    for m in dep.members():
        row = next(line for line in table.splitlines() if f" {m.instance_id} " in line)
        assert row.endswith(f"   cores {','.join(map(str, m.info.cpus))}") == bool(m.info.cpus)
        assert ("cores" in row) == bool(m.info.cpus)


def test_prompt_prefilled_on_one_instance_is_reused_by_another_through_the_store(dep, reference):
    want = reference(LONG_PROMPT, 12, ignore_eos=True)[0]
    tokens, final = dep.client.generate(LONG_PROMPT, max_tokens=12, ignore_eos=True)
    assert tokens[0] == want
    first = final.timings.prefill_instance
    # The prefill instance publishes the prompt once its hand-off is sent (KVEndpoint.send), so
    # the decode instance can finish and the client hear of it first: wait for the publishing.
    deadline = time.monotonic() + 10
    while (store := next(iter(dep.store_stats().values()))).entries < len(LONG_PROMPT) // BLOCK \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(dep.store_stats()) == 1
    assert store.entries >= len(LONG_PROMPT) // BLOCK        # the handoff published the prompt
    assert store.puts == store.entries and store.bytes_used > 0 and store.capacity_bytes == 32 * 2**20
    table = format_status(dep.client.status())               # what `thinkserve status` prints
    assert f"CPU KV store {store.node_id[:12]} {store.address}: " in table
    assert f"{store.entries} blocks (0 pinned)" in table

    # Take the first prefill instance away: the same prompt now prefills on the other one, which
    # has never seen it, and loads its blocks from the node's store instead of computing them.
    dep.client.admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id=first), timeout=120)
    tokens, final = dep.client.generate(LONG_PROMPT, max_tokens=12, ignore_eos=True)
    second = final.timings.prefill_instance
    assert second != first
    assert tokens[0] == want
    s = _stats(dep, second)
    full_blocks = len(LONG_PROMPT) // BLOCK
    assert s.store_prefix_blocks == full_blocks
    assert s.prefix_cache_hit_rate == 1.0       # every full prompt block came from the cache
    computed = len(LONG_PROMPT) - s.store_prefix_blocks * BLOCK
    assert computed == 4 < len(LONG_PROMPT)

    counters = dep.frontend_state().counters
    used = "tcp" if MODE == "tcp" else "shm"    # one node: auto picks shared memory
    other = "shm" if used == "tcp" else "tcp"
    assert getattr(counters, "kv_" + used).sends >= 2 and getattr(counters, "kv_" + used).bytes > 0
    assert getattr(counters, "kv_" + other).sends == 0
    wait_kv_free(dep.client)
    dep.check_integrity()


def test_aborting_a_parked_request_releases_its_store_pins(dep):
    prompt = [(11 * i + 5) % 250 for i in range(40)]        # 2 full prompt blocks
    load = Load(dep, [(prompt, dict(max_tokens=300, ignore_eos=True, request_id="parked-1"))]).start()
    load.wait_progress(10, 1)
    (before,) = dep.store_stats().values()                  # prompt published by the handoff
    assert before.pinned_entries == 0
    res = dep.client.admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="short_decode-0"), timeout=120)
    assert res.migrated_requests == 1                       # the last decode instance: parked in the store
    assert dict(dep.frontend_state().parked) == {"parked-1": 1}
    (parked,) = dep.store_stats().values()
    assert parked.pinned_entries > 0 and parked.bytes_used > before.bytes_used

    assert dep.client.inference.Abort(inference_pb2.AbortRequest(request_id="parked-1"), timeout=30).aborted
    (tokens, final), = load.join().values()
    assert all(b.finish_reason == inference_pb2.FINISH_REASON_ABORT for b in final.final.branches)
    (after,) = dep.store_stats().values()
    assert after.pinned_entries == 0
    # The decode blocks are gone; the prompt's full blocks stay as (unpinned) prefix entries.
    assert after.bytes_used == before.bytes_used and after.entries == before.entries
    assert dep.frontend_state().counters.parked_released == 1
    ray.get([s.handle.check_integrity.remote() for s in ray.get(dep.controller.membership.remote()).stores])
    wait_kv_free(dep.client)
    dep.check_integrity()
