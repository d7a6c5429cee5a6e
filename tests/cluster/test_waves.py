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
            # The vote can be decided while a launch is under way (it took the request's lock
            # first): that wave is still forked and sent, computes its last prompt token, and is
            # cancelled after. So the count is read once every background task is done, not when
            # the request finishes (read before, it missed such a wave: 2 forked, 3 computed).
            await cl.check_free()       # the reserve and every cancelled branch freed their blocks
            forked = cl.orch.counters.wave_branches_forked
            assert forked >= 2 and set(ran) - {0, 1} <= set(range(2, 2 + forked))
            pre = await engine_stats(cl.cores["prefill-0"])
            decode = [await engine_stats(cl.cores[i]) for i in ("short_decode-0", "short_decode-1")]
            # prefill: the prompt once (wave 1's two first tokens sample its last position); nothing after
            assert pre.num_computed_prompt_tokens == len(prompt)
            # decode: one prompt token per later branch (a recompute would be 40 each)
            assert sum(s.num_computed_prompt_tokens for s in decode) == forked
        finally:
            await cl.stop()
    asyncio.run(main())


def best_of_8(cl, prompt, rid):
    """Best-of-8 greedy, waves of 2, ``unbeatable``, every branch answering the same."""
    sp = SamplingParams(n=8, max_tokens=24, temperature=0.0, ignore_eos=True, seed=3)
    return sp, cl.generate(prompt, sp, rid, consensus=Consensus(8, make_rule("unbeatable"), WavePlan(2, 2)),
                           extractor=lambda text: "42")


def test_colocated_later_waves_fork_the_reserve_where_the_first_wave_ran(tiny_model, offline):
    """Colocated pools (one mixed instance): the first wave is added with a reserve the engine
    forks off it once the prompt is computed; each later wave is forked off the reserve and runs
    on the same instance, computing one prompt token per branch instead of the 40-token prompt.
    The rest is as in the pools deployment: four branches run, the others are cancelled."""
    async def main():
        cl = await Cluster(tiny_model, ids=("mixed-0",)).start()
        try:
            prompt = _prompt(5)
            sp, pending = best_of_8(cl, prompt, "c")
            req = await pending
            ran = [b.index for b in req.branches if b.finish_reason != "abort"]
            assert len(ran) == 4 and {0, 1} <= set(ran) and tuple(b.index for b in req.branches
                                                                  if b.finish_reason == "abort") == req.consensus.cancelled
            want = offline(prompt, sp)
            assert all(list(req.branches[i].token_ids) == want[i] for i in ran)
            await cl.check_free()       # also waits for a launch still in flight (see the test above)
            forked = cl.orch.counters.wave_branches_forked
            assert forked >= 2 and set(ran) - {0, 1} <= set(range(2, 2 + forked))
            mixed = await engine_stats(cl.cores["mixed-0"])
            # the prompt once for wave 1 (fan-out), then one token per later branch (a recompute
            # would be 40 each). A wave the vote made moot while its launch held the lock was
            # started by its fork (counted) and is aborted: it computes its token or not, by timing.
            later = len(set(ran) - {0, 1})
            assert len(prompt) + later <= mixed.num_computed_prompt_tokens <= len(prompt) + forked
            assert (mixed.num_reclaimed_reserves, cl.orch.counters.reserves_reclaimed) == (0, 0)
        finally:
            await cl.stop()
    asyncio.run(main())


def test_a_reserve_is_freed_under_kv_pressure_and_later_waves_recompute(tiny_model, offline):
    """A mixed instance with 6 blocks of 16: wave 1's two branches (40-token prompt, 24 tokens
    each) need all 6 once they pass 48 tokens, and the reserve holds one block of its own (the
    prompt's partial last block, which both branches copied on write). The engine frees the
    reserve instead of preempting a branch; later waves then recompute the prompt (its two full
    blocks hit the prefix cache); outputs equal offline and every block comes back."""
    async def main():
        cl = await Cluster(tiny_model, ids=("mixed-0",), blocks=6).start()
        try:
            prompt = _prompt(5)
            sp, pending = best_of_8(cl, prompt, "p")
            req = await pending
            ran = [b.index for b in req.branches if b.finish_reason != "abort"]
            assert len(ran) == 4 and {0, 1} <= set(ran)
            want = offline(prompt, sp)
            assert all(list(req.branches[i].token_ids) == want[i] for i in ran)
            await cl.check_free()
            mixed = await engine_stats(cl.cores["mixed-0"])
            assert (mixed.num_reclaimed_reserves, cl.orch.counters.reserves_reclaimed) == (1, 1)
            assert mixed.num_preemptions == 0 and cl.orch.counters.wave_branches_forked == 0
            # later waves recomputed what the prefix cache did not hold: more than one token each
            # later waves (two or more parts) recomputed the prompt past its two cached full blocks
            assert mixed.num_computed_prompt_tokens >= len(prompt) + 2 * (len(prompt) - 32)
        finally:
            await cl.stop()
    asyncio.run(main())
