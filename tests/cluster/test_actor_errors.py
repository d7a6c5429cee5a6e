"""``ActorInstance`` over a real Ray actor: an error the method raises by contract (ValueError,
KeyError) reaches the orchestrator as itself, as in process; a dead actor is ``InstanceGone``.
(Every actor error used to become ``InstanceGone``, so a refused call marked a live instance lost.)"""
from __future__ import annotations

import asyncio

import pytest
import ray

from thinkserve.cluster.instance_handle import ActorInstance, InstanceGone


@ray.remote(num_cpus=0)
class Refusing:
    def abort_branches(self, part_id, indices):
        raise ValueError(f"branches {list(indices)} of {part_id} are held for a handoff")

    def abort(self, part_id):
        raise KeyError(part_id)

    def ping(self):
        return "pong"


def test_contract_errors_pass_through_and_a_dead_actor_is_gone(ray_session):
    actor = Refusing.remote()
    handle = ActorInstance(actor)

    async def main():
        assert await handle.ping() == "pong"
        with pytest.raises(ValueError, match=r"branches \[1, 2\] of p0 are held"):
            await handle.abort_branches("p0", (1, 2))
        with pytest.raises(KeyError):
            await handle.abort("p9")
        assert await handle.ping() == "pong"            # still there: nobody declared it lost
        ray.kill(actor)                                 # takes effect asynchronously
        with pytest.raises(InstanceGone):
            for _ in range(100):
                await handle.ping()
                await asyncio.sleep(0.1)
    asyncio.run(main())
