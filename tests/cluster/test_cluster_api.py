"""The gRPC API of a real local deployment (Ray actors, gRPC server, KV over TCP): outputs equal
the offline engine's, bad input and overload map to status codes, cancellation frees KV."""
from __future__ import annotations

import os

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from cluster_helpers import cluster_config, start_deployment, stop_deployment, generate_request, wait_kv_free

from thinkserve.protos.thinkserve.v1 import admin_pb2, inference_pb2

PROMPTS = ["hello world", "12+34=", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], "<think>x"]


# The whole module runs once per instance-to-instance KV transport the cluster offers ("auto":
# same-node shared memory here; THINKSERVE_TEST_KV_TRANSPORT=tcp forces TCP); "collective" moves
# page sets over gloo pair groups (NCCL needs GPUs: tests/cluster/test_collective_gpu.py).
@pytest.fixture(scope="module", params=["auto", "collective"])
def dep(request, ray_session, tiny_model):
    transport = request.param if request.param != "auto" else os.environ.get("THINKSERVE_TEST_KV_TRANSPORT", "auto")
    cfg = cluster_config(tiny_model, limits={"max_queued_requests": 12, "max_message_bytes": 64 * 1024,
                                             "max_n": 8},
                         # The prefix-index and Best-of-N tests check the hand-off path (the prefill
                         # instance's reports, the store published at hand-off): no prompt prefills on
                         # short_decode (conditional disaggregation: test_conductor_cluster.py).
                         router={"policy": "conductor", "conditional_disagg": False}, kv_transport=transport)
    d = start_deployment(cfg)
    yield d
    stop_deployment(d)


def test_greedy_output_equals_offline_engine(dep, reference):
    for prompt in PROMPTS:
        for max_tokens in (1, 24):
            tokens, final = dep.client.generate(prompt, max_tokens=max_tokens)
            ids = prompt if not isinstance(prompt, str) else None
            want = reference(ids if ids is not None else prompt, max_tokens)
            assert tokens[0] == want[0], (prompt, max_tokens)
            b = final.final.branches[0]
            assert list(b.token_ids) == want[0]
            assert final.usage.completion_tokens == len(want[0])
    # long enough for the long pool
    tokens, final = dep.client.generate(PROMPTS[0], max_tokens=300, ignore_eos=True)
    assert tokens[0] == reference(PROMPTS[0], 300, ignore_eos=True)[0] and len(tokens[0]) == 300
    # The Conductor (the default for three pools) learned from the short requests above that this
    # prompt is short: it may start in short_decode, and is then promoted (KV and all) to
    # long_decode once it outgrows its prediction; the output is the offline one either way.
    assert final.timings.decode_instances[-1] == "long_decode-0"
    assert final.timings.promotions == len(final.timings.decode_instances) - 1
    wait_kv_free(dep.client)
    dep.check_integrity()


def test_prefix_index_is_fed_by_the_instances_and_the_store_over_ray(dep):
    # The prefill instance reports the prompt's blocks with its poll; the node's store (published
    # after the handoff) with the store poll: all typed PrefixDelta messages through Ray. The
    # decode instance that imported them holds them too, but reports nothing: placement reads only
    # the holders a prompt can prefill on.
    import time
    prompt = list(range(30, 80))            # 50 tokens: 3 full blocks
    dep.client.generate(prompt, max_tokens=2)
    (node,) = dep.frontend_state().stores
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        got = dep.frontend_state(prefix_of=prompt).prefix
        if got.stores and got.instances:
            break
        time.sleep(0.1)
    time.sleep(1.0)                         # a few more polls of every instance
    got = dep.frontend_state(prefix_of=prompt).prefix
    assert (got.blocks, dict(got.instances), dict(got.stores)) == (3, {"prefill-0": 3}, {node: 3})
    state = dep.frontend_state()
    assert state.prefix_blocks["prefill-0"] >= 3
    assert not any(iid.startswith(("short_decode", "long_decode")) for iid in state.prefix_blocks)


def test_best_of_n_seeded_equals_offline_and_votes(dep, reference):
    tokens, final = dep.client.generate("3+4=", max_tokens=20, n=4, temperature=1.0, seed=99)
    want = reference("3+4=", 20, n=4, temperature=1.0, seed=99)
    assert tokens == want
    f = final.final
    assert [b.index for b in f.branches] == [0, 1, 2, 3]
    assert sum(v.count for v in f.votes) == sum(1 for b in f.branches if b.answer)
    assert final.timings.prefill_instance.startswith("prefill")
    wait_kv_free(dep.client)


def test_invalid_arguments_name_the_field(dep):
    stub = dep.client.inference
    cases = [
        (generate_request("x", temperature=-1.0), "sampling.temperature"),
        (generate_request("x", n=9), "n"),
        (generate_request("", max_tokens=4), "prompt"),
        (generate_request([1, 99999]), "prompt.token_ids"),
        (generate_request("x", max_tokens=100000), "sampling.max_tokens"),
        (generate_request("x", request_id="bad id!"), "request_id"),
        (inference_pb2.GenerateRequest(), "prompt"),
    ]
    sp = generate_request("x")
    sp.sampling.top_p = 1.5
    cases.append((sp, "sampling.top_p"))
    for req, field in cases:
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(req, timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
        assert e.value.details().startswith(field), (field, e.value.details())
    limit = dep.cfg.limits.max_prompt_tokens            # Admin.GetDebugState's prompt, too
    with pytest.raises(grpc.RpcError) as e:
        dep.client.debug_state(prefix_of=[1] * (limit + 1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == f"prefix_of: {limit + 1} token ids, more than limits.max_prompt_tokens {limit}"
    # the server is still fine
    tokens, _ = dep.client.generate("ok", max_tokens=3)
    assert len(tokens[0]) == 3 or tokens[0][-1] == 256


def test_not_found_for_unknown_pool_request_and_instance(dep):
    admin, inf = dep.client.admin, dep.client.inference
    with pytest.raises(grpc.RpcError) as e:
        admin.ScalePool(admin_pb2.ScalePoolRequest(pool="medium_decode", replicas=1), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "medium_decode" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        inf.Abort(inference_pb2.AbortRequest(request_id="nope"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        admin.DrainInstance(admin_pb2.DrainInstanceRequest(instance_id="short_decode-99"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_oversized_message_is_refused_and_server_stays_up(dep):
    with pytest.raises(grpc.RpcError) as e:
        list(dep.client.inference.Generate(generate_request("x" * 100_000), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    tokens, _ = dep.client.generate("still up", max_tokens=2)
    assert tokens[0]


def test_overload_is_resource_exhausted_and_others_complete(dep, reference):
    results, errors = [], []

    def one(i):
        try:
            results.append(dep.client.generate(PROMPTS[0], max_tokens=120, timeout=120))
        except grpc.RpcError as e:
            errors.append(e.code())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors and set(errors) == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert len(results) + len(errors) == 20 and len(results) >= 12
    want = reference(PROMPTS[0], 120)[0]
    assert all(tokens[0] == want for tokens, _ in results)
    wait_kv_free(dep.client)


def test_cancelled_stream_frees_kv_everywhere(dep):
    stream = dep.client.inference.Generate(generate_request("cancel me", max_tokens=400, ignore_eos=True), timeout=60)
    got = 0
    for msg in stream:
        got += sum(len(d.token_ids) for d in msg.deltas)
        if got >= 5:
            break
    busy = dep.client.status()
    assert any(i.num_free_blocks < i.num_total_blocks for p in busy.pools for i in p.instances)
    stream.cancel()
    wait_kv_free(dep.client)
    dep.check_integrity()
    assert list(dep.frontend_state().requests) == []


def test_deadline_aborts_and_frees_kv(dep):
    # 450 tokens cannot stream in 0.1 s (that is 0.2 ms a token through gRPC and two instances);
    # with 0.5 s an idle machine sometimes finished the request before its deadline.
    with pytest.raises(grpc.RpcError) as e:
        list(dep.client.inference.Generate(generate_request("slow", max_tokens=450, ignore_eos=True), timeout=0.1))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_kv_free(dep.client)
    dep.check_integrity()


def test_abort_rpc_ends_the_stream(dep):
    stream = dep.client.inference.Generate(
        generate_request("abort me", max_tokens=450, ignore_eos=True, request_id="abort-1"), timeout=60)
    first = next(stream)
    assert first.request_id == "abort-1"
    assert dep.client.inference.Abort(inference_pb2.AbortRequest(request_id="abort-1"), timeout=30).aborted
    rest = list(stream)
    final = rest[-1].final
    assert all(b.finish_reason == inference_pb2.FINISH_REASON_ABORT for b in final.branches)
    wait_kv_free(dep.client)


def test_health_reflection_and_status(dep):
    health = health_pb2_grpc.HealthStub(dep.client.channel)
    for service in ("", "thinkserve.v1.Inference", "thinkserve.v1.Admin"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
    services = set(ProtoReflectionDescriptorDatabase(dep.client.channel).get_services())
    assert {"thinkserve.v1.Inference", "thinkserve.v1.Admin", "grpc.health.v1.Health"} <= services
    st = dep.client.status()
    assert [p.name for p in st.pools] == ["prefill", "short_decode", "long_decode", "mixed"]
    assert [p.serving_replicas for p in st.pools] == [1, 1, 1, 0]
    assert st.frontend.completed_requests >= 1


def test_malformed_protobuf_bytes_are_invalid_argument(dep):
    """Raw bytes that do not parse as the request message: INVALID_ARGUMENT on every method (it
    was UNKNOWN "Unexpected DecodeError"), and the server keeps serving."""
    channel = dep.client.channel
    methods = {"/thinkserve.v1.Inference/Generate": channel.unary_stream,
               "/thinkserve.v1.Inference/Abort": channel.unary_unary,
               "/thinkserve.v1.Admin/GetStatus": channel.unary_unary,
               "/thinkserve.v1.Admin/ScalePool": channel.unary_unary,
               "/thinkserve.v1.Admin/DrainInstance": channel.unary_unary}
    for path, kind in methods.items():
        call = kind(path, request_serializer=None, response_deserializer=None)   # bytes in, bytes out
        for garbage in (b"\xff\xff\xff\xff", b"\x12\x05ab"):    # a bad tag; a field longer than the message
            with pytest.raises(grpc.RpcError) as e:
                res = call(garbage, timeout=30)
                if kind == channel.unary_stream:
                    list(res)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, e.value.code(), e.value.details())
            assert e.value.details().startswith("request: not a valid"), e.value.details()
    # Well-formed bytes through the same untyped call still work.
    raw = channel.unary_unary("/thinkserve.v1.Admin/GetStatus", request_serializer=None, response_deserializer=None)
    assert admin_pb2.ClusterStatus.FromString(raw(b"", timeout=30)).pools
    tokens, _ = dep.client.generate("still up", max_tokens=2)
    assert tokens[0]


def test_page_sets_moved_over_the_configured_transport(dep):
    counters = dep.frontend_state().counters
    used = {"auto": "shm", "tcp": "tcp", "shm": "shm", "collective": "collective"}[dep.cfg.kv_transport]
    sent = getattr(counters, "kv_" + used)
    assert sent.sends >= 3 and sent.bytes > 0
    assert all(getattr(counters, "kv_" + t).sends == 0 for t in ("tcp", "shm", "collective") if t != used)


def test_instances_report_step_telemetry(dep):
    """Each Ray instance hands over its engine steps and its parts' timings through the frontend
    (``thinkserve debug --step-traces``; the simulator's cpu fit reads them): a request's prefill
    lands on one instance's trace with its part id, and a read takes what it returns."""
    dep.frontend_state(step_traces=True)                        # start afresh
    tokens, _ = dep.client.generate("telemetry", max_tokens=8, ignore_eos=True, request_id="telemetry-1")
    assert len(tokens[0]) == 8
    traces = dep.frontend_state(step_traces=True).step_traces
    assert sorted(t.instance_id for t in traces) == sorted(m.instance_id for m in dep.members())
    parts = [p for t in traces for p in t.parts if p.part_id.startswith("telemetry-1#")]
    assert parts and all(p.added <= p.first_token for p in parts if p.HasField("first_token"))
    steps = [s for t in traces for s in t.steps]
    assert any(s.prefill_tokens > 0 for s in steps)
    assert sum(s.num_decode for s in steps) >= 7                # every token after the first is a decode
    assert all(s.duration > 0 for s in steps)
