"""The CPU KV store as a Ray actor: ``kvtransfer.store.StoreServer`` over a ``KVStore``.

Instances reach it over TCP (zmq, msgpack + raw frames) with ``StoreClient``; Ray only places it
and keeps it alive. Prefill instances publish prompt blocks here after a handoff; a request
resumed after losing its instance loads them back instead of recomputing the prompt; a drained
request with no peer to move to parks its KV here until an instance can take it.
"""
from __future__ import annotations

import ray


@ray.remote(max_restarts=0)
class KVStoreActor:
    def __init__(self, capacity_bytes: int, host: str = "127.0.0.1"):
        from thinkserve.kvtransfer.store import KVStore, StoreServer

        self.server = StoreServer(KVStore(capacity_bytes), bind=f"tcp://{host}:0").start()

    def address(self) -> str:
        return self.server.address

    def stats(self) -> dict:
        return self.server.store.stats().to_dict()

    def check_integrity(self) -> None:
        self.server.store.check_integrity()

    def stop(self) -> None:
        self.server.stop()
