"""The OpenAI-compatible HTTP API, /metrics, the bearer token and TLS, on one real local
deployment of the shipped tiny-reasoner (prefill -> short_decode, KV handed over between them).

Everything is switched on at once, as an operator would: TLS on gRPC and HTTP (a self-signed
certificate made here), a token required on Admin and Inference, Admin on its own port. The
official ``openai`` client is the HTTP client; gRPC answers to the same greedy request are the
reference its token ids and texts must equal.
"""
from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import subprocess
import sys
import time

import grpc
import openai
import pytest
from cluster_helpers import cluster_config, collect, generate_request, start_deployment, stop_deployment
from prometheus_client.parser import text_string_to_metric_families

from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc

try:                        # the HTTP client the installed openai package is built on
    import httpx2 as httpx
except ImportError:         # pragma: no cover - older openai releases use httpx
    import httpx

TOKEN = "s3cret-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
PROBLEM = "37+48="


def make_cert(directory):
    """A self-signed certificate for 127.0.0.1 / localhost (cryptography), as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def dep(ray_session, tmp_path_factory):
    from thinkserve.cluster.deploy import frontend_addresses
    cert, key = make_cert(tmp_path_factory.mktemp("tls"))
    cfg = cluster_config("tiny-reasoner",
                         engine={"num_device_blocks": 256, "max_num_seqs": 16, "block_size": 16},
                         pools={"prefill": {"replicas": 1, "num_cpus": 0.5},
                                "short_decode": {"replicas": 1, "num_cpus": 0.5},
                                "long_decode": {"replicas": 0}, "mixed": {"replicas": 0}},
                         # every prompt through the prefill instance: the metrics test counts its hand-off
                         # (with conditional disaggregation the idle short_decode instance may take it)
                         router={"long_threshold": 4096, "conditional_disagg": False},
                         frontend={"port": 0, "http_port": 0, "admin_port": 0,
                                   "tls": {"cert_file": cert, "key_file": key},
                                   "auth": {"token": TOKEN, "inference": True}},
                         limits={"max_message_bytes": 64 * 1024, "max_n": 8, "max_queued_requests": 10})
    d = start_deployment(cfg)
    d.where = frontend_addresses(cfg.namespace)
    d.cert = cert
    creds = grpc.ssl_channel_credentials(open(cert, "rb").read())
    d.channel = grpc.secure_channel(d.where["grpc"], creds)
    d.admin_channel = grpc.secure_channel(d.where["admin"], creds)
    d.inference = inference_pb2_grpc.InferenceStub(d.channel)
    d.admin = admin_pb2_grpc.AdminStub(d.admin_channel)
    d.base = f"https://{d.where['http']}"
    d.oai = openai.OpenAI(base_url=d.base + "/v1", api_key=TOKEN, max_retries=0, timeout=120,
                          http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert)))
    d.http = httpx.Client(base_url=d.base, verify=ssl.create_default_context(cafile=cert), timeout=60)
    yield d
    d.http.close()
    d.channel.close()
    d.admin_channel.close()
    stop_deployment(d)


def grpc_generate(dep, prompt, **kw):
    return collect(dep.inference.Generate(generate_request(prompt, **kw), timeout=120, metadata=AUTH))


def scrape(dep) -> dict[tuple[str, tuple], float]:
    r = dep.http.get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples, name, **labels) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == want for k, want in labels.items()))


def split(text):
    head, _, tail = text.partition("</think>")
    assert head.startswith("<think>"), text
    return head[len("<think>"):], tail


# ----------------------------------------------------------------- OpenAI API
def test_models_health_and_status_address(dep, capsys, monkeypatch):
    assert dep.http.get("/health").json() == {"status": "ok"}        # no token needed
    assert [m.id for m in dep.oai.models.list().data] == ["tiny-reasoner"]
    st = dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH)
    assert st.frontend.http_address == dep.where["http"] and st.frontend.admin_address == dep.where["admin"]
    # `thinkserve status --json` reports it too (token and CA from the environment, as documented)
    from thinkserve.cluster.cli import main
    monkeypatch.setenv("THINKSERVE_API_TOKEN", TOKEN)
    monkeypatch.setenv("THINKSERVE_TLS_CA", dep.cert)
    assert main(["status", "--json", "--admin-server", dep.where["admin"]]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["frontend"]["http_address"] == dep.where["http"]


def test_completion_equals_grpc(dep):
    tokens, final = grpc_generate(dep, PROBLEM, max_tokens=200)
    want = final.final.branches[0]
    res = dep.oai.completions.create(model="tiny-reasoner", prompt=PROBLEM, max_tokens=200, temperature=0)
    c = res.choices[0]
    assert c.token_ids == list(want.token_ids) == tokens[0]
    assert c.text == want.text and "</think>" in c.text
    assert c.finish_reason == "stop"
    assert res.usage.prompt_tokens == final.usage.prompt_tokens
    assert res.usage.completion_tokens == len(want.token_ids)
    assert res.thinkserve["answer"] == want.answer == "85"
    # token-id prompts too
    ids = dep.oai.completions.create(model="tiny-reasoner", prompt=[1, 7, 11], max_tokens=8, temperature=0)
    t2, _ = grpc_generate(dep, [1, 7, 11], max_tokens=8)
    assert ids.choices[0].token_ids == t2[0]


def test_chat_returns_reasoning_apart(dep):
    _, final = grpc_generate(dep, PROBLEM, max_tokens=200)
    reasoning, content = split(final.final.branches[0].text)
    res = dep.oai.chat.completions.create(model="tiny-reasoner", messages=[{"role": "user", "content": PROBLEM}],
                                          max_completion_tokens=200, temperature=0)
    msg = res.choices[0].message
    assert msg.reasoning_content == reasoning and reasoning
    assert msg.content == content == "answer: 85"
    assert res.choices[0].token_ids == list(final.final.branches[0].token_ids)
    details = res.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < res.usage.completion_tokens


def test_streaming_n3_equals_grpc(dep):
    _, final = grpc_generate(dep, PROBLEM, max_tokens=120, n=3, temperature=1.0, seed=7)
    stream = dep.oai.chat.completions.create(
        model="tiny-reasoner", messages=[{"role": "user", "content": PROBLEM}], max_tokens=120, n=3,
        temperature=1.0, seed=7, stream=True, stream_options={"include_usage": True})
    reasoning, content, finish, usage, extra = {}, {}, {}, None, None
    chunks = 0
    for chunk in stream:
        chunks += 1
        for ch in chunk.choices:
            reasoning[ch.index] = reasoning.get(ch.index, "") + (getattr(ch.delta, "reasoning_content", None) or "")
            content[ch.index] = content.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
        if chunk.usage is not None:
            usage, extra = chunk.usage, chunk.thinkserve
    assert chunks > 6                                 # streamed, not one blob
    for b in final.final.branches:
        if "</think>" in b.text:
            r, c = split(b.text)
        else:
            r, c = b.text.removeprefix("<think>"), ""
        assert (reasoning[b.index], content[b.index]) == (r, c), b.index
    assert set(finish) == {0, 1, 2}
    assert usage.completion_tokens == final.usage.completion_tokens
    assert extra["answer"] == final.final.answer
    # completions streaming: the deltas concatenate to the gRPC text
    _, one = grpc_generate(dep, "12+9=", max_tokens=60)
    text = "".join(c.choices[0].text for c in dep.oai.completions.create(
        model="tiny-reasoner", prompt="12+9=", max_tokens=60, temperature=0, stream=True) if c.choices)
    assert text == one.final.branches[0].text


# ----------------------------------------------------------------- metrics
def test_metrics_move_with_requests(dep):
    before = scrape(dep)
    dep.oai.completions.create(model="tiny-reasoner", prompt="55+66=", max_tokens=100, temperature=0,
                               extra_body={"priority": "interactive"})
    after = scrape(dep)
    inter = dict(pool="short_decode", priority="interactive")
    assert total(after, "thinkserve_requests_finished_total", **inter) == \
        total(before, "thinkserve_requests_finished_total", **inter) + 1
    assert total(after, "thinkserve_request_ttft_seconds_count", **inter) == \
        total(before, "thinkserve_request_ttft_seconds_count", **inter) + 1
    assert total(after, "thinkserve_request_e2e_seconds_sum") > total(before, "thinkserve_request_e2e_seconds_sum")
    assert total(after, "thinkserve_handoffs_total") == total(before, "thinkserve_handoffs_total") + 1
    moved = total(after, "thinkserve_kv_transfer_bytes_total") - total(before, "thinkserve_kv_transfer_bytes_total")
    assert moved > 0
    assert total(after, "thinkserve_kv_transfers_total") == total(before, "thinkserve_kv_transfers_total") + 1
    assert total(after, "thinkserve_requests_total", outcome="completed") == \
        total(before, "thinkserve_requests_total", outcome="completed") + 1
    gen = total(after, "thinkserve_instance_generated_tokens_total", pool="short_decode") - \
        total(before, "thinkserve_instance_generated_tokens_total", pool="short_decode")
    assert gen > 0
    # per-instance and store series exist, labelled by pool / instance / node
    assert total(after, "thinkserve_instance_kv_total_blocks", instance="prefill-0") == 256
    assert any(n == "thinkserve_store_capacity_bytes" and v == 32 * 2**20 for (n, _), v in after.items())
    assert any(n == "thinkserve_instance_preemptions_total" for (n, _) in after)
    # the instances' own KV transfer totals: the decode instance received the one page set ...
    got = dict(pool="short_decode", kind="page_set")
    assert total(after, "thinkserve_instance_kv_transfers_total", **got) == \
        total(before, "thinkserve_instance_kv_transfers_total", **got) + 1
    assert total(after, "thinkserve_instance_kv_transfer_bytes_total", **got) - \
        total(before, "thinkserve_instance_kv_transfer_bytes_total", **got) >= moved
    # ... and the prefill instance counted its send (its stats reach the frontend with its next poll)
    sent = dict(pool="prefill", kind="handoff")
    deadline = time.monotonic() + 10
    now = after
    while total(now, "thinkserve_instance_kv_transfers_total", **sent) == \
            total(before, "thinkserve_instance_kv_transfers_total", **sent) and time.monotonic() < deadline:
        time.sleep(0.1)
        now = scrape(dep)
    assert total(now, "thinkserve_instance_kv_transfers_total", **sent) == \
        total(before, "thinkserve_instance_kv_transfers_total", **sent) + 1
    assert total(now, "thinkserve_instance_kv_transfer_failures_total", **sent) == \
        total(before, "thinkserve_instance_kv_transfer_failures_total", **sent)
    assert total(after, "thinkserve_pool_instances", pool="short_decode") == 1


# ----------------------------------------------------------------- auth and TLS
def test_token_refused_missing_or_wrong_accepted_right(dep):
    for md in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as e:
            dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            list(dep.inference.Generate(generate_request("1+1=", max_tokens=2), timeout=30, metadata=md))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            dep.admin.ScalePool(admin_pb2.ScalePoolRequest(pool="short_decode", replicas=3), timeout=30, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH).model == "tiny-reasoner"
    # Admin lives on its own port only
    with pytest.raises(grpc.RpcError) as e:
        admin_pb2_grpc.AdminStub(dep.channel).GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # HTTP: 401 in OpenAI's shape, through the official client too
    for headers in ({}, {"authorization": "Bearer nope"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")):
            r = dep.http.request(method, path, headers=headers, json={"model": "tiny-reasoner", "prompt": "1"})
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["type"] == "authentication_error"
    # the token is checked before the body: no token and a malformed body is still 401
    r = dep.http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=dep.base + "/v1", api_key="wrong", max_retries=0,
                        http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=dep.cert)))
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_tls_is_required(dep):
    plain = grpc.insecure_channel(dep.where["grpc"])
    with pytest.raises(grpc.RpcError) as e:
        list(inference_pb2_grpc.InferenceStub(plain).Generate(generate_request("1+1=", max_tokens=2), timeout=5,
                                                                metadata=AUTH))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    plain.close()
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{dep.where['http']}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):            # an unknown certificate is not trusted
        httpx.get(f"{dep.base}/health", timeout=5)


# ----------------------------------------------------------------- bad input
def test_bad_http_input_gets_openai_errors(dep):
    h = {"authorization": f"Bearer {TOKEN}"}
    ok = {"model": "tiny-reasoner", "prompt": "1+2=", "max_tokens": 4}
    cases = [
        ({**ok, "temperature": -1}, 400, "temperature"),
        ({**ok, "n": 9}, 400, "n"),
        ({**ok, "top_p": 1.5}, 400, "top_p"),
        ({**ok, "max_tokens": 100000}, 400, "max_tokens"),
        ({**ok, "prompt": ""}, 400, "prompt"),
        ({**ok, "prompt": [1, 9999]}, 400, "prompt"),
        ({**ok, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
        ({**ok, "bogus": 1}, 400, "bogus"),
        ({**ok, "model": "gpt-4"}, 404, "model"),
        ({"model": "tiny-reasoner"}, 400, "prompt"),
    ]
    for body, status, param in cases:
        r = dep.http.post("/v1/completions", json=body, headers=h)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)
    r = dep.http.post("/v1/chat/completions", json={"model": "tiny-reasoner", "messages": []}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = dep.http.post("/v1/completions", content=b"{not json", headers={**h, "content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = dep.http.post("/v1/completions", json={**ok, "prompt": "x" * 70000}, headers=h)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    chunked = (b'{"model": "tiny-reasoner", "prompt": "' + b"x" * 40000, b"y" * 40000 + b'"}')
    r = dep.http.post("/v1/completions", content=iter(chunked), headers={**h, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"      # no Content-Length: counted
    assert dep.http.get("/v1/nothing", headers=h).status_code == 404
    with pytest.raises(openai.BadRequestError):
        dep.oai.completions.create(model="tiny-reasoner", prompt="1+1=", max_tokens=4, temperature=-2)
    # still serving, nothing leaked
    res = dep.oai.completions.create(model="tiny-reasoner", prompt="1+2=", max_tokens=40, temperature=0)
    assert res.choices[0].text
    assert list(dep.admin.GetDebugState(admin_pb2.GetDebugStateRequest(), timeout=30, metadata=AUTH).requests) == []


def test_deploy_state_has_no_token_in_logs(dep):
    """The token never appears in the controller's events or the config the frontend reports."""
    import ray
    events = ray.get(dep.controller.recent_events.remote(0))[1]
    assert not any(TOKEN in e for e in events)
    assert TOKEN not in repr(dep.cfg) and TOKEN not in str(dep.cfg.model_dump())


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))


def wait_idle(dep, timeout_s=30.0):
    """Until no request is held and every instance has every KV block free."""
    import time
    deadline = time.monotonic() + timeout_s
    while True:
        st = dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH)
        insts = [i for p in st.pools for i in p.instances]
        if st.frontend.active_requests == 0 and all(i.num_free_blocks == i.num_total_blocks for i in insts):
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.2)


def test_client_disconnect_aborts_and_frees_kv(dep):
    before = dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH).frontend.aborted_requests
    body = {"model": "tiny-reasoner", "prompt": "collatz(27)=", "max_tokens": 1200, "ignore_eos": True,
            "stream": True}
    with dep.http.stream("POST", "/v1/completions", json=body, headers={"authorization": f"Bearer {TOKEN}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]           # tokens are flowing
        assert any(x.startswith("data: ") for x in got)
    # not streamed: the client gives up after 1 s
    with pytest.raises(httpx.TimeoutException):
        dep.http.post("/v1/completions", json={**body, "stream": False}, timeout=1.0,
                      headers={"authorization": f"Bearer {TOKEN}"})
    st = wait_idle(dep)
    assert st.frontend.aborted_requests == before + 2
    dep.check_integrity()


def test_queue_full_is_429_then_serves_again(dep):
    import time
    calls = [dep.inference.Generate(generate_request("collatz(27)=", max_tokens=1400, ignore_eos=True),
                                    timeout=120, metadata=AUTH) for _ in range(10)]
    try:
        deadline = time.monotonic() + 30
        while dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30,
                                  metadata=AUTH).frontend.active_requests < 10:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        r = dep.http.post("/v1/completions", json={"model": "tiny-reasoner", "prompt": "1+1=", "max_tokens": 4},
                          headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "limits.max_queued_requests" in err["message"]
        with pytest.raises(openai.RateLimitError):
            dep.oai.chat.completions.create(model="tiny-reasoner", messages=[{"role": "user", "content": "1+1="}])
    finally:
        for c in calls:
            c.cancel()
    wait_idle(dep)
    assert dep.oai.completions.create(model="tiny-reasoner", prompt="1+1=", max_tokens=4).choices


# ----------------------------------------------------------------- load generator
def test_bench_reasoning_and_trace(dep, tmp_path, monkeypatch, capsys):
    import random

    from thinkserve.cluster.bench_cli import poisson_times
    from thinkserve.cluster.cli import main
    monkeypatch.setenv("THINKSERVE_API_TOKEN", TOKEN)
    monkeypatch.setenv("THINKSERVE_TLS_CA", dep.cert)
    png, out = tmp_path / "cdf.png", tmp_path / "bench.json"
    rc = main(["bench", "--rate", "4", "--duration", "2", "--workload", "reasoning", "--max-tokens", "48",
               "--server", dep.where["grpc"], "--admin-server", dep.where["admin"], "--out", str(png),
               "--json", str(out), "--seed", "3"])
    assert rc == 0
    got = json.loads(out.read_text())
    want = len(poisson_times(4.0, 2.0, random.Random(3)))
    assert got["summary"]["all"]["requests"] == want and got["summary"]["all"]["errors"] == 0
    assert all(r["first"] is not None and 0 < r["tokens"] <= 48 for r in got["records"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "TTFT p50/p90/p99" in text and "tok/s" in text
    # a Mooncake-format trace: replayed lengths (outputs forced), shared prefixes
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 40 + 10 * i, "output_length": 6 + i, "hash_ids": [0, i]}
            for i in range(5)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["bench", "--rate", "10", "--duration", "5", "--workload", str(trace), "--server", dep.where["grpc"],
               "--admin-server", dep.where["admin"], "--out", "", "--json", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())["records"]
    assert [r["tokens"] for r in recs] == [6 + i for i in range(5)] and not any(r["error"] for r in recs)
    # every request refused the same way: it stops sending instead of refusing for the whole duration
    rc = main(["bench", "--rate", "20", "--duration", "3", "--n", "9", "--server", dep.where["grpc"],
               "--admin-server", dep.where["admin"], "--out", "", "--json", str(out)])
    recs = json.loads(out.read_text())["records"]
    assert rc == 1 and {r["error"] for r in recs} == {"INVALID_ARGUMENT", "NOT_SENT"}
    assert sum(r["error"] == "NOT_SENT" for r in recs) > len(recs) // 2


# ----------------------------------------------------------------- early consensus, end to end
def test_early_consensus_over_grpc_cancels_branches_and_frees_their_kv(dep):
    """Best-of-8 with early_stop=ADAPTIVE through gRPC and the Ray cluster (router.consensus_wave
    is 4): the first wave of four agrees, Adaptive-Consistency's Beta rule stops there
    (P(p1 > p2) = 1 - I_0.5(5, 1) = 31/32 >= 0.95), the four branches never launched end with
    abort, the vote counts only the branches that ran, and every KV block comes back."""
    import time

    from thinkserve.protos.thinkserve.v1 import inference_pb2 as pb
    before = dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH).frontend.cancelled_branches
    tokens, final = grpc_generate(dep, PROBLEM, n=8, temperature=0.6, seed=3, max_tokens=64,
                                  early_stop=pb.EARLY_STOP_ADAPTIVE)
    f = final.final
    ran = [b for b in f.branches if b.finish_reason != pb.FINISH_REASON_ABORT]
    cut = [b for b in f.branches if b.finish_reason == pb.FINISH_REASON_ABORT]
    assert (f.early_stop_rule, f.cancelled_branches) == ("adaptive", 4)
    assert [b.index for b in ran] == [0, 1, 2, 3] and all(not b.token_ids for b in cut)
    assert {b.answer for b in ran} == {"85"} and f.answer == "85"
    assert [(v.answer, v.count) for v in f.votes] == [("85", 4)]
    assert final.usage.completion_tokens == sum(len(t) for t in tokens.values())
    deadline = time.monotonic() + 30
    while True:
        st = dep.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30, metadata=AUTH)
        insts = [i for p in st.pools for i in p.instances]
        if all(i.num_free_blocks == i.num_total_blocks and i.num_running == 0 for i in insts):
            break
        assert time.monotonic() < deadline, [(i.instance_id, i.num_free_blocks, i.num_total_blocks) for i in insts]
        time.sleep(0.2)
    assert st.frontend.cancelled_branches == before + 4
