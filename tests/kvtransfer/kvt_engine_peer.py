"""An engine in its own process for the flow tests; JSON lines on stdout.

    python kvt_engine_peer.py decode  --model DIR --transport tcp|shm|gloo [--die-after-allocate S]
        a decode instance: prints {"address"}, then for each request it receives, runs it to the
        end and prints {"request_id", "outputs": {branch: token_ids}, "free", "total"}; a failed
        transfer prints {"error", "free", "total"} (the engine's blocks must all be free again)
    python kvt_engine_peer.py prefill --model DIR --transport T --peer ADDR --prompt 1,2,3
        a prefill instance: prefills the prompt and hands it off to ADDR, prints the outcome
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

from kvt_flows import send_whole
from thinkserve.kvtransfer import flows
from thinkserve.kvtransfer.transport import TransferConfig, TransferError
from thinkserve.workers.engine import LLMEngine
from thinkserve.workers.sampling_params import SamplingParams

BLOCK_SIZE = 4


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def make_transport(name: str, timeout_s: float):
    cfg = TransferConfig(timeout_s=timeout_s)
    if name == "tcp":
        from thinkserve.kvtransfer.tcp import TcpTransport
        return TcpTransport(cfg)
    if name == "shm":
        from thinkserve.kvtransfer.shm import ShmTransport
        return ShmTransport(cfg)
    from thinkserve.kvtransfer.collective import PairGroupTransport
    return PairGroupTransport(cfg, backend=name)


def run_to_end(engine: LLMEngine, request_id: str) -> dict[int, list[int]]:
    final = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                final = {c.index: c.token_ids for c in o.outputs}
    return final


def cmd_decode(a) -> None:
    engine = LLMEngine.from_pretrained(a.model, role="decode", block_size=BLOCK_SIZE, num_device_blocks=a.blocks)
    tr = make_transport(a.transport, a.timeout)
    if a.die_after_allocate is not None:
        plain = engine.import_request

        def import_request(exported):  # this instance dies with the transfer in flight ...
            threading.Timer(a.die_after_allocate, lambda: os._exit(3)).start()
            return plain(exported)

        def write_blocks(block_ids, data, **_):  # ... at the latest once the bytes are in, before the ack
            os._exit(3)
        engine.import_request, engine.write_blocks = import_request, write_blocks
    emit(address=tr.address)
    while True:
        try:
            got = flows.receive(flows.EngineSink(engine), tr, timeout_s=3600)
        except TransferError as e:
            engine.check_integrity()
            s = engine.stats()
            emit(error=type(e).__name__, message=str(e), free=s.num_free_blocks, total=s.num_total_blocks)
            continue
        outputs = run_to_end(engine, got.header.request_id)
        engine.check_integrity()
        s = engine.stats()
        emit(request_id=got.header.request_id, outputs={str(k): v for k, v in outputs.items()},
             bytes=got.record.bytes, free=s.num_free_blocks, total=s.num_total_blocks)


def cmd_prefill(a) -> None:
    engine = LLMEngine.from_pretrained(a.model, role="prefill", block_size=BLOCK_SIZE, num_device_blocks=a.blocks)
    tr = make_transport(a.transport, a.timeout)
    prompt = [int(t) for t in a.prompt.split(",")]
    engine.add_request("r-prefill", prompt, SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True))
    while not any(o.prefilled for o in engine.step()):
        pass
    emit(prefilled=True)
    try:
        rec = send_whole(engine, "r-prefill", tr, a.peer)
        emit(ok=True, bytes=rec.bytes)
    except TransferError as e:
        emit(ok=False, error=type(e).__name__)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["decode", "prefill"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--peer")
    ap.add_argument("--prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--die-after-allocate", type=float)
    a = ap.parse_args()
    torch.set_num_threads(1)
    {"decode": cmd_decode, "prefill": cmd_prefill}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
