"""``frontend.stream_interval_ms``: the frontend's stream sends the first token at once and
coalesces what arrives within the interval after each message into the next one."""
from __future__ import annotations

import asyncio

from thinkserve.cluster.config import parse_config
from thinkserve.cluster.frontend import FrontendCore
from thinkserve.cluster.messages import BranchDelta
from thinkserve.cluster.request_state import RequestState
from thinkserve.workers.sampling_params import SamplingParams


def stream_messages(model: str, interval_ms: float) -> list[list[int]]:
    """Stream one request whose 11 tokens come 20 ms apart (the last finishes it); per message
    sent, the number of tokens of each branch delta it carried."""
    cfg = parse_config({"model": model, "frontend": {"port": 0, "http_port": None, "stream_interval_ms": interval_ms}})

    async def main():
        core = FrontendCore(cfg, controller=None)
        req = RequestState("r1", (3, 4, 5), SamplingParams(max_tokens=11), 0, core.tokenizer)
        core.orch.table.requests[req.request_id] = req

        async def engine():
            for k in range(11):
                req.apply((BranchDelta(0, k, (7,), "length" if k == 10 else None),))
                await asyncio.sleep(0.02)
        produce = asyncio.get_running_loop().create_task(engine())
        sizes = []
        async for msg in core.stream(req):
            sizes.append([len(d.token_ids) for d in msg.deltas])
            if len(sizes) == 1:
                assert not produce.done() and req.branches[0].token_ids == [7]   # the first token went at once
        await produce
        assert req.request_id not in core.orch.requests     # the stream closed it
        return sizes
    return asyncio.run(main())


def test_every_step_streams_on_its_own_without_an_interval(tiny_model):
    assert stream_messages(tiny_model, 0) == [[1]] * 11


def test_tokens_within_the_interval_go_out_together_after_the_first(tiny_model):
    # 1 s interval: the first token alone, then the other 10 with the final response.
    assert stream_messages(tiny_model, 1000) == [[1], [10]]
