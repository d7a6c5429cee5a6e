"""The four flows between real engines in different processes, over real sockets.

Every correctness test compares against the same request run start to finish on one engine:
greedy (or seeded) token ids must be identical after a handoff, a fan-out, a live migration and
a swap through the store.
"""
from __future__ import annotations

import time

import msgpack
import pytest
import torch

from kvt_flows import send_whole
from kvt_helpers import ENGINE_PEER, PEER, Proc
from tiny_llama import build_tiny_llama
from thinkserve.kvtransfer import flows
from thinkserve.kvtransfer.collective import PairGroupTransport
from thinkserve.kvtransfer.store import StoreClient
from thinkserve.kvtransfer.shared_buffers import SHARED
from thinkserve.kvtransfer.shm import ShmTransport
from thinkserve.kvtransfer.tcp import TcpTransport
from thinkserve.kvtransfer.telemetry import TELEMETRY
from thinkserve.kvtransfer.transport import FingerprintMismatch, PeerGone, TransferConfig, TransferTimeout
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(40, 62))  # 22 tokens: 5 full blocks and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
BEST_OF_4 = SamplingParams(n=4, temperature=0.9, top_k=40, seed=7, max_tokens=12, ignore_eos=True)


def engine(path, role="mixed", **cfg) -> LLMEngine:
    return LLMEngine.from_pretrained(str(path), role=role, block_size=BS, num_device_blocks=cfg.pop("blocks", 64), **cfg)


def run(eng: LLMEngine, rid: str) -> dict[int, list[int]]:
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == rid and o.finished:
                final = {c.index: c.token_ids for c in o.outputs}
    return final


def prefilled(eng: LLMEngine, rid: str, prompt, params) -> None:
    eng.add_request(rid, prompt, params)
    while not any(o.prefilled and o.request_id == rid for o in eng.step()):
        pass


def assert_all_free(eng: LLMEngine) -> None:
    eng.check_integrity()
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks, s


def decoded(proc: Proc) -> dict[int, list[int]]:
    msg = proc.read(timeout=120)
    assert "outputs" in msg, msg
    assert msg["free"] == msg["total"], "the decode instance leaked blocks"
    return {int(k): v for k, v in msg["outputs"].items()}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("kvt_llama")
    build_tiny_llama(path)
    return path


@pytest.fixture(scope="module")
def reference(model_dir):
    eng = engine(model_dir)
    eng.add_request("ref", PROMPT, GREEDY)
    eng.add_request("ref-n", PROMPT, BEST_OF_4)
    out = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = {c.index: c.token_ids for c in o.outputs}
    return out


class Decoder:
    def __init__(self, model_dir, transport: str, *extra: str):
        self.proc = Proc("decode", "--model", str(model_dir), "--transport", transport, *extra, script=ENGINE_PEER)
        self._address = None

    @property
    def address(self) -> str:
        if self._address is None:
            self._address = self.proc.read(timeout=120)["address"]
        return self._address


@pytest.fixture(scope="module")
def decoders(model_dir, tmp_path_factory):
    """Decode instances in their own processes, started together (startup dominates)."""
    other = tmp_path_factory.mktemp("kvt_llama3")
    build_tiny_llama(other, num_layers=3)
    d = {"tcp": Decoder(model_dir, "tcp"), "gloo": Decoder(model_dir, "gloo"), "tcp2": Decoder(model_dir, "tcp"),
         "shm": Decoder(model_dir, "shm"),
         "other": Decoder(other, "tcp"),
         "dying": Decoder(model_dir, "tcp", "--die-after-allocate", "0.0", "--timeout", "30")}
    yield d
    for dec in d.values():
        dec.proc.kill()


@pytest.fixture(scope="module")
def store_client():
    proc = Proc("store", "--capacity-bytes", str(8 << 20), script=PEER)
    client = StoreClient(proc.read(timeout=120)["address"], TransferConfig(timeout_s=10))
    yield client
    client.close()
    proc.kill()


@pytest.fixture(scope="module")
def tcp():
    with TcpTransport(TransferConfig(timeout_s=10)) as t:
        yield t


# ----------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("kind", ["tcp", "gloo", "shm"])
def test_handoff_prefill_to_decode_process_matches_single_engine(model_dir, reference, decoders, kind):
    pre = engine(model_dir, role="prefill")
    prefilled(pre, f"h-{kind}", PROMPT, GREEDY)
    cfg = TransferConfig(timeout_s=10)
    make = {"tcp": TcpTransport, "gloo": PairGroupTransport, "shm": ShmTransport}[kind]
    used_before = len(SHARED._used)
    # the process's totals: other tests' sends (refusals for room among them) count there too
    sent_before = {(t.kind, t.transport): (t.count, t.failures) for t in TELEMETRY.totals()}
    with make(cfg) as tr:
        rec = send_whole(pre, f"h-{kind}", tr, decoders[kind].address)
        if kind == "shm":  # gathered into a shared segment, mapped by the decoder, given back
            assert tr.last_mode == "map" and len(SHARED._used) == used_before
    assert decoded(decoders[kind].proc) == reference["ref"]
    # 22 computed prompt tokens -> 6 blocks of [2 layers, K|V, 4 slots, 2 heads, 16 dims] float32
    assert rec.bytes == 6 * pre.fingerprint().layout.bytes_per_block and rec.kind == "handoff"
    assert_all_free(pre)
    sent = {(t.kind, t.transport): t for t in TELEMETRY.totals()}[("handoff", tr.name)]
    count, failures = sent_before.get(("handoff", tr.name), (0, 0))
    assert sent.count == count + 1 and sent.failures == failures


def test_live_migration_mid_decode_matches_single_engine(model_dir, reference, decoders, tcp):
    src = engine(model_dir)
    src.add_request("m", PROMPT, GREEDY)
    produced = []
    while len(produced) < 6:
        for o in src.step():
            produced = o.outputs[0].token_ids
    rec = send_whole(src, "m", tcp, decoders["tcp"].address, kind="migrate")
    out = decoded(decoders["tcp"].proc)
    assert out == reference["ref"] and out[0][:6] == produced and rec.kind == "migrate"
    assert_all_free(src)


def test_best_of_n_fan_out_sends_shared_prefix_once_per_instance(model_dir, reference, decoders, tcp):
    pre = engine(model_dir, role="prefill")
    prefilled(pre, "bon", PROMPT, BEST_OF_4)
    a, b = decoders["tcp"], decoders["tcp2"]
    placement = {a.address: (0, 1), b.address: (2, 3)}
    export = flows.export_for(pre, "bon")       # read once, one share per instance (KVEndpoint.send)
    records = {peer: flows.send_share(pre.fingerprint(), export, flows.Share(tcp, peer, branches))
               for peer, branches in placement.items()}
    pre.release_request("bon")
    out = {**decoded(a.proc), **decoded(b.proc)}
    assert out == reference["ref-n"]
    bpb = pre.fingerprint().layout.bytes_per_block
    for peer, branches in placement.items():
        sub = export.exported.subset(branches)
        per_branch = sum(len(br.block_indices) for br in sub.branches)
        assert records[peer].bytes == len(sub.block_ids) * bpb and records[peer].kind == "fanout"
        assert len(sub.block_ids) < per_branch  # the 5 full prompt blocks travel once, not twice
    assert_all_free(pre)


def test_swap_out_to_store_process_and_back_on_another_engine(model_dir, reference, store_client):
    a, b = engine(model_dir), engine(model_dir)
    a.add_request("s", PROMPT, GREEDY)
    for _ in range(8):
        a.step()
    swapped = flows.swap_out(a, "s", store_client)
    assert_all_free(a)
    st = store_client.stats()
    assert st.pinned_entries == len(set(swapped.block_keys)) > 0
    # the handle is small plain data: it can travel to whichever instance resumes the request
    swapped = flows.SwappedRequest.from_dict(msgpack.unpackb(msgpack.packb(swapped.to_dict())))
    rec = flows.swap_in(b, swapped, store_client)
    assert rec.ok and rec.num_blocks == len(swapped.block_keys)
    assert run(b, "s") == reference["ref"]
    assert store_client.stats().pinned_entries == 0
    assert_all_free(b)


def test_swap_in_after_store_lost_the_blocks_recomputes(model_dir, reference, store_client):
    a = engine(model_dir)
    a.add_request("s2", PROMPT, GREEDY)
    for _ in range(5):
        a.step()
    swapped = flows.swap_out(a, "s2", store_client)
    store_client.unpin(swapped.namespace, swapped.block_keys)
    store_client.delete(swapped.namespace, swapped.block_keys[-2:])
    store_client.pin(swapped.namespace, swapped.block_keys[:-2])
    rec = flows.swap_in(a, swapped, store_client)
    assert not rec.ok and rec.error == "recompute"
    assert run(a, "s2") == reference["ref"]
    assert_all_free(a)


def test_prefix_reuse_through_the_store_skips_compute(model_dir, reference, store_client):
    a, b = engine(model_dir), engine(model_dir)
    assert run_generate(a) == reference["ref"]
    stored = flows.store_prefix(a, PROMPT, store_client)
    assert stored == len(PROMPT) // BS  # the full blocks
    added = flows.load_prefix(b, PROMPT, store_client)
    assert added == stored
    assert run_generate(b) == reference["ref"]
    assert b.stats().prefix_cache_hit_rate > 0


def run_generate(eng):
    eng.add_request("g", PROMPT, GREEDY)
    return run(eng, "g")


# ----------------------------------------------------------------------------- faults
def test_fingerprint_mismatch_is_refused_and_the_request_survives(model_dir, reference, decoders, tcp):
    pre = engine(model_dir, role="prefill")
    prefilled(pre, "fp", PROMPT, GREEDY)
    with pytest.raises(FingerprintMismatch, match="num_layers: page set has 2, receiver has 3") as err:
        send_whole(pre, "fp", tcp, decoders["other"].address)
    assert decoders["other"].proc.read()["error"] == "FingerprintMismatch"
    # fall back to recompute on a compatible instance
    flows.send_exported(tcp, decoders["tcp"].address, pre.fingerprint(), err.value.exported.without_kv())
    assert decoded(decoders["tcp"].proc) == reference["ref"]
    pre.release_request("fp")
    assert_all_free(pre)


def test_decode_instance_dies_mid_handoff_sender_errors_and_retries_elsewhere(model_dir, reference, decoders, tcp):
    pre = engine(model_dir, role="prefill")
    prefilled(pre, "die", PROMPT, GREEDY)
    t0 = time.monotonic()
    with pytest.raises((PeerGone, TransferTimeout)) as err:
        send_whole(pre, "die", tcp, decoders["dying"].address)
    assert time.monotonic() - t0 < tcp.config.timeout_s + 1
    assert decoders["dying"].proc.wait() == 3
    exported = err.value.exported  # the source still holds the KV: retry with it, no recompute
    flows.send_exported(tcp, decoders["tcp"].address, pre.fingerprint(), exported, pre.read_blocks(exported.block_ids))
    assert decoded(decoders["tcp"].proc) == reference["ref"]
    pre.release_request("die")
    assert_all_free(pre)


def test_prefill_instance_dies_mid_handoff_decode_frees_its_blocks(model_dir):
    dec = engine(model_dir, role="decode")
    with TcpTransport(TransferConfig(timeout_s=2.0)) as tr:
        sender = Proc("prefill", "--model", str(model_dir), "--peer", tr.address, "--prompt",
                      ",".join(map(str, PROMPT)), "--timeout", "30", script=ENGINE_PEER)
        plain = dec.import_request
        killed_at = []

        def import_request(exported):  # blocks are reserved; now the prefill process dies
            ids = plain(exported)
            killed_at.append(time.monotonic())
            sender.kill()  # SIGKILL, and reaped, before the offer is answered
            return ids
        dec.import_request = import_request
        with pytest.raises((PeerGone, TransferTimeout)) as err:
            flows.receive(flows.EngineSink(dec), tr, timeout_s=120)
        assert time.monotonic() - killed_at[0] < 3.0
        assert err.value.request_id == "r-prefill"
    assert_all_free(dec)
    assert not dec.has_unfinished_requests()
