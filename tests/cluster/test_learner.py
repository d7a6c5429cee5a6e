"""The frontend's learner: queued steps run one per event-loop turn, in order, after what is
ready, and none while a request waits for its first token (unless it waits past max_hold_s)."""
import asyncio

from thinkserve.cluster.learner import Learner, one_step


def _spawn(coro):
    return asyncio.get_running_loop().create_task(coro)


def test_steps_run_in_submission_order_one_per_loop_turn():
    log = []

    def steps(name, k):
        for i in range(k):
            log.append((name, i))
            yield

    async def ticker():
        for i in range(4):
            log.append(("tick", i))
            await asyncio.sleep(0)

    async def main():
        learner = Learner(_spawn)
        learner.submit(steps("a", 3))
        learner.submit(one_step(lambda: log.append(("b", 0))))
        assert log == [] and learner.pending == 2          # submit returns before any step
        await asyncio.gather(ticker(), learner.idle())
        return learner

    learner = asyncio.run(main())
    assert [x for x in log if x[0] != "tick"] == [("a", 0), ("a", 1), ("a", 2), ("b", 0)]
    # interleaved with the other task's turns: no two learning steps back to back while it ran
    last_tick = max(i for i, x in enumerate(log) if x[0] == "tick")
    assert log[0] == ("tick", 0)
    assert all(log[i][0] == "tick" or log[i + 1][0] == "tick" for i in range(last_tick))
    assert learner.steps == 4 and learner.pending == 0


def test_nothing_runs_while_a_placement_is_held_and_a_failing_step_skips_only_its_item():
    log = []

    def broken():
        log.append("broken")
        raise RuntimeError("bad update")
        yield

    async def main():
        learner = Learner(_spawn)
        learner.hold()
        learner.submit(broken())
        learner.submit(one_step(lambda: log.append("after")))
        for _ in range(20):
            await asyncio.sleep(0)
        assert log == []                                    # held: a request is being placed
        learner.release()
        await learner.idle()
        return learner

    learner = asyncio.run(main())
    assert log == ["broken", "after"] and learner.pending == 0


def test_a_hold_never_released_delays_each_step_by_max_hold_s_not_forever():
    log = []

    async def main():
        learner = Learner(_spawn, max_hold_s=0.02)
        learner.hold()                                      # a request that never gets a token
        learner.submit(one_step(lambda: log.append("a")))
        learner.submit(one_step(lambda: log.append("b")))
        await asyncio.sleep(0.005)
        assert log == []
        await asyncio.wait_for(learner.idle(), 5)
        return learner

    learner = asyncio.run(main())
    assert log == ["a", "b"] and learner.pending == 0
