"""Page sets: msgpack header + raw frames, zero-copy, typed fingerprint, telemetry records."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from thinkserve.kvtransfer.page_set import (PageSet, PageSetHeader, fingerprint_diff, fingerprint_from_dict,
                                            fingerprint_namespace, fingerprint_to_dict)
from thinkserve.kvtransfer.telemetry import TelemetryLog, TransferRecord, TransferTotals
from thinkserve.workers.block_hash import hash_blocks
from thinkserve.workers.kv_cache import KVFingerprint, KVLayout


def fp(dtype="float32", **changes) -> KVFingerprint:
    layout = dataclasses.replace(KVLayout(3, 2, 16, 4, dtype), **changes)
    return KVFingerprint(layout, "LlamaForCausalLM", "cfg-1")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_frames_round_trip_byte_exact(dtype, chunk):
    f = fp(dtype)
    kv = torch.randn(f.layout.shape(7)).to(f.layout.torch_dtype)
    tokens = list(range(30))
    ps = PageSet.build(f, kv, token_ids=tokens, block_hashes=hash_blocks(tokens, 4), num_computed_tokens=28,
                       request_id="r", request={"request_id": "r", "x": [1, 2]})
    frames = [ps.header.to_wire(), *ps.data_frames(chunk)]      # what a transport sends
    assert len(frames) == 1 + -(-ps.nbytes // chunk)
    header = PageSetHeader.from_wire(bytes(frames[0]))
    assert header == ps.header and header.request == ps.header.request and header.nbytes == ps.nbytes
    data = bytearray(b"".join(bytes(f) for f in frames[1:]))
    back = torch.frombuffer(data, dtype=torch.uint8).view(header.dtype).view(header.shape)
    assert back.dtype == kv.dtype and torch.equal(back.view(torch.uint8), kv.view(torch.uint8))


def test_send_frames_are_views_of_the_tensor():
    ps = PageSet.build(fp(), torch.zeros(fp().layout.shape(2)))
    (frame,) = ps.data_frames(1 << 20)
    ps.kv[0, 0, 0, 0, 0, 0] = 1.0  # a write through the tensor shows in the frame: no copy was made
    assert bytes(frame[:4]) == torch.tensor([1.0]).numpy().tobytes()


def test_header_is_plain_msgpack_with_the_typed_fingerprint():
    ps = PageSet.build(fp(), torch.zeros(fp().layout.shape(1)), request_id="r")
    d = msgpack.unpackb(ps.header.to_wire())
    assert d["fingerprint"] == {"architecture": "LlamaForCausalLM", "model_id": "cfg-1", "num_layers": 3,
                                "num_kv_heads": 2, "head_dim": 16, "block_size": 4, "dtype": "float32"}
    assert fingerprint_from_dict(fingerprint_to_dict(fp())) == fp()


def test_bad_input_is_rejected_with_a_clear_error():
    f = fp()
    with pytest.raises(ValueError, match="shape"):
        PageSet(PageSetHeader(f, 3), torch.zeros(f.layout.shape(2)))
    with pytest.raises(ValueError, match="dtype"):
        PageSet(PageSetHeader(f, 2), torch.zeros(f.layout.shape(2), dtype=torch.float16))
    with pytest.raises(ValueError, match="not valid msgpack|version"):
        PageSetHeader.from_wire(b"\xc1garbage")
    with pytest.raises(ValueError, match="version"):
        PageSetHeader.from_wire(msgpack.packb({"v": 99}))


def test_fingerprint_diff_names_every_differing_field():
    assert fingerprint_diff(fp(), fp()) == []
    diff = fingerprint_diff(fp("bfloat16", num_layers=4), fp())
    assert diff == ["num_layers: page set has 4, receiver has 3", "dtype: page set has 'bfloat16', receiver has 'float32'"]
    assert fingerprint_namespace(fp()) == fingerprint_namespace(fp()) != fingerprint_namespace(fp(block_size=8))


def test_non_contiguous_kv_is_made_contiguous_and_blocks_can_be_selected():
    f = fp()
    kv = torch.randn(f.layout.shape(5))
    ps = PageSet.build(f, kv.index_select(2, torch.tensor([4, 0, 2])))
    sub = ps.select_blocks([2, 0], request_id="sub")
    assert torch.equal(sub.kv, kv[:, :, [2, 4]]) and sub.header.num_blocks == 2 and sub.header.request_id == "sub"


def test_transfer_record_telemetry():
    rec = TransferRecord("handoff", "tcp", "tcp://x", "r", 4, 2_000_000_000, 0.5, 0.0)
    assert rec.gbps == pytest.approx(4.0)
    log = TelemetryLog()
    for i in range(3):
        log.add(dataclasses.replace(rec, request_id=f"r{i}", ok=i != 1))
    log.add(dataclasses.replace(rec, kind="fanout", transport="shm", bytes=7, seconds=0.25))
    assert log.totals() == (TransferTotals("fanout", "shm", 1, 0, 7, 0.25),
                            TransferTotals("handoff", "tcp", 3, 1, 6_000_000_000, 1.5))
    assert rec.to_dict()["gbps"] == pytest.approx(4.0)
