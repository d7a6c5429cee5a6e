"""The CPU KV store as a Ray actor: ``kvtransfer.store.StoreServer`` over a ``KVStore``.

One per Ray node (the controller pins each to its node with node-affinity scheduling); the
instances of a node reach theirs over TCP (zmq, msgpack + raw frames) with ``StoreClient``; Ray
only places it and keeps it alive. Prefill instances publish prompt blocks here after a handoff,
and a prefill of the same prompt on another instance of the node loads them instead of computing
them; a request resumed after losing its instance loads them back instead of recomputing the
prompt; a drained request with no peer to move to parks its KV here (pinned) until an instance
can take it, or until it is aborted (``release``).
"""
from __future__ import annotations

import ray

from thinkserve.kvtransfer.store import StoreStats
from thinkserve.workers.prefix_journal import PrefixCursor, PrefixDelta


class StoreHost:
    """The store server and the calls the controller and frontend make on it (no Ray here: the
    actor below runs it, and tests drive it in process)."""

    def __init__(self, capacity_bytes: int, host: str = "127.0.0.1"):
        from thinkserve.kvtransfer.store import KVStore, StoreServer

        self.server = StoreServer(KVStore(capacity_bytes), bind=f"tcp://{host}:0").start()

    async def address(self) -> str:
        return self.server.address

    async def stats(self) -> StoreStats:
        return self.server.store.stats()

    async def prefix_blocks(self, namespace: str, since: PrefixCursor) -> PrefixDelta:
        """Prompt-prefix blocks of ``namespace`` (the model's, ``InstanceInfo.prefix_namespace``) this
        store gained and lost since ``since``: the frontend polls it to keep its prefix index true."""
        return self.server.store.prefix_delta(namespace, since)

    async def release(self, namespace: str, keys: list[int], discard_keys: list[int]) -> int:
        """A parked request will not be swapped in (aborted, cancelled, past its deadline, or
        recomputed instead): drop its pins, then the blocks of ``discard_keys`` nobody else pins.
        Returns how many entries were deleted."""
        store = self.server.store
        for k in keys:          # one by one: a pin the store lost (it restarted) must not stop the rest
            try:
                store.unpin(namespace, [k])
            except ValueError:
                pass
        return store.delete(namespace, discard_keys)

    async def check_integrity(self) -> None:
        self.server.store.check_integrity()

    async def stop(self) -> None:
        self.server.stop()


@ray.remote(max_restarts=0)
class KVStoreActor(StoreHost):
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()
