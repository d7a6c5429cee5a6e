"""Early-consensus waves through the orchestrator, in process (real engines, real KV transfers):
later waves start from the prompt KV the prefill instance holds (a reserve), the branches it
still holds when the rule stops are cancelled there, and every block comes back."""
from __future__ import annotations

import asyncio

from test_orchestrator import Cluster, _prompt, offline  # noqa: F401  (offline is a fixture)
from thinkserve.router.consensus import Consensus, WavePlan, make_rule
from thinkserve.workers.sampling_params import SamplingParams


async def engine_stats(core):
    def read():
        with core.host.lock:
            return core.engine.stats()
    return await asyncio.to_thread(read)


def test_later_waves_fork_the_held_prompt_kv_and_the_reserve_is_cancelled_on_stop(tiny_model, offline):
    """Best-of-8 greedy, waves of 2, ``unbeatable``, every branch answering the same: branches
    0, 1 are prefilled and handed off; 2.. start one by one as branches finish, each forked off
    the reserve on the prefill instance and sent to a decode instance, where it computes one
    prompt token (its last) instead of the 40-token prompt; after four agree the vote cannot
    change, so the branch still running is aborted on its decode instance and the ones never
    launched are aborted in the reserve on the prefill instance."""
    async def main():
        cl = await Cluster(tiny_model).start()
        try:
            prompt = _prompt(5)
            sp = SamplingParams(n=8, max_tokens=24, temperature=0.0, ignore_eos=True, seed=3)
            rule = make_rule("unbeatable")
            req = await cl.generate(prompt, sp, "w", consensus=Consensus(8, rule, WavePlan(2, 2)),
                                    extractor=lambda text: "42")
            ran = [b.index for b in req.branches if b.finish_reason != "abort"]
            cut = [b.index for b in req.branches if b.finish_reason == "abort"]
            assert len(ran) == 4 and {0, 1} <= set(ran) and tuple(cut) == req.consensus.cancelled
            want = offline(prompt, sp)
            assert all(list(req.branches[i].token_ids) == want[i] for i in ran)
            final = req.final_response().final
            assert (final.answer, final.cancelled_branches, final.early_stop_rule) == ("42", 4, "unbeatable")
            forked = cl.orch.counters.wave_branches_forked
            assert forked >= 2 and set(ran) - {0, 1} <= set(range(2, 2 + forked))
            await cl.check_free()       # the reserve and every cancelled branch freed their blocks
            pre = await engine_stats(cl.cores["prefill-0"])
            decode = [await engine_stats(cl.cores[i]) for i in ("short_decode-0", "short_decode-1")]
            # prefill: the root up to the last prompt token, then wave 1's two last tokens; nothing after
            assert pre.num_computed_prompt_tokens == len(prompt) - 1 + 2
            # decode: one prompt token per later branch (a recompute would be 40 each)
            assert sum(s.num_computed_prompt_tokens for s in decode) == forked
        finally:
            await cl.stop()
    asyncio.run(main())
