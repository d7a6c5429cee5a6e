"""The controller: a named, detached actor that owns pools, membership and health.

    thinkserve up ──▶ Controller("thinkserve-controller", namespace "thinkserve", detached)
                        ├─ pools: prefill / short_decode / long_decode / mixed → Instance actors
                        ├─ KVStoreActor per alive Ray node (node affinity): the node's CPU KV store
                        ├─ Frontend actor (gRPC server)
                        └─ health loop: ping every instance; a dead one is replaced

Membership is versioned; the frontend long-polls ``wait_membership(version)`` and sees every
change (an instance serving, draining, gone). Scaling up returns once the new instances have
loaded their weights (they serve only then); scaling down drains first: the frontend moves the
victims' requests (KV included) to peers, then the actors stop. Instance and frontend actors are
owned by the controller, so killing it takes the whole deployment down.
"""
from __future__ import annotations

import asyncio
import logging
import time
import ray
from ray.exceptions import RayActorError, RayError

from thinkserve.router.moves import VictimCandidate, victim_order
from thinkserve.router.snapshot import DEAD, DRAINING, POOL_NAMES, SERVING, STARTING

from .config import ClusterConfig, parse_config
from .errors import root_cause
from .instance import Instance
from .messages import DrainResult, ErrorKind, Failure, Member, Membership, ScaleResult, StoreInfo

log = logging.getLogger(__name__)

CONTROLLER_NAME = "thinkserve-controller"
FRONTEND_NAME = "thinkserve-frontend"
NAMESPACE = "thinkserve"


@ray.remote(max_restarts=0)
class Controller:
    def __init__(self, config: dict):
        self.cfg: ClusterConfig = parse_config(config)
        self.members: dict[str, Member] = {}
        self.targets: dict[str, int] = {p: self.cfg.pool(p).replicas for p in POOL_NAMES}
        self.version = 0
        self._next_id = {p: 0 for p in POOL_NAMES}
        self._changed: asyncio.Event | None = None
        self._pool_locks: dict[str, asyncio.Lock] = {}
        self.frontend = None
        self.frontend_address = ""
        self._health_task = None
        self._stopping = False
        self.events: list[str] = []
        self.stores: dict[str, StoreInfo] = {}     # node id -> that node's CPU KV store
        self._stores_lock: asyncio.Lock | None = None
        self._failed: list[Member] = []

    # ----------------------------------------------------------------- membership
    def _bump(self) -> None:
        self.version += 1
        if self._changed is not None:
            self._changed.set()

    def _membership(self) -> Membership:
        return Membership(self.version, tuple(self.members.values()), tuple(self.targets.items()),
                          tuple(self.stores.values()))

    async def wait_membership(self, since_version: int, timeout_s: float = 5.0) -> Membership:
        """Long poll: returns once the version is past ``since_version`` (or after the timeout)."""
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = time.monotonic() + timeout_s
        while self.version <= since_version and time.monotonic() < deadline:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                break
        return self._membership()

    async def membership(self) -> Membership:
        return self._membership()

    async def config(self) -> dict:
        return self.cfg.model_dump()

    def _log(self, msg: str) -> None:
        log.info(msg)
        self.events.append(f"{time.strftime('%H:%M:%S')} {msg}")
        del self.events[:-200]

    async def recent_events(self, since: int = 0) -> tuple[int, list[str]]:
        return len(self.events), self.events[since:]

    # ----------------------------------------------------------------- deployment
    async def start(self) -> str:
        """Start every pool's instances and the frontend; returns the gRPC address."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self._log(f"KV transport between instances: {self.cfg.kv_transport}")
        await self._ensure_stores()
        results = await asyncio.gather(*(self._grow(p, self.targets[p]) for p in POOL_NAMES if self.targets[p] > 0))
        failed = [r.error.message for r in results if not r.ok]
        if failed:
            errors = sorted({m.error for m in self._failed})
            raise RuntimeError("; ".join(failed) + (f" ({'; '.join(errors)})" if errors else ""))
        from .frontend import Frontend
        me = ray.get_runtime_context().current_actor
        fc = self.cfg.frontend
        self.frontend = Frontend.options(name=FRONTEND_NAME, namespace=self.cfg.namespace, num_cpus=fc.num_cpus,
                                         resources=dict(fc.resources) or None,
                                         max_concurrency=10_000).remote(self.cfg.model_dump(), me)
        self.frontend_address = await self.frontend.start.remote()
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop())
        self._log(f"frontend serving gRPC on {self.frontend_address}")
        return self.frontend_address

    async def address(self) -> str:
        return self.frontend_address

    async def shutdown(self) -> None:
        """Stop the frontend (no new requests), then every instance."""
        self._stopping = True
        if self._health_task is not None:
            self._health_task.cancel()
        if self.frontend is not None:
            try:
                await asyncio.wait_for(self.frontend.stop.remote(), 15)
            except Exception:
                pass
            ray.kill(self.frontend)
            self.frontend = None
        await asyncio.gather(*(self._stop_member(m) for m in list(self.members.values())), return_exceptions=True)
        self.members.clear()
        await asyncio.gather(*(self._stop_store(s) for s in self.stores.values()), return_exceptions=True)
        self.stores.clear()
        self._bump()

    # ----------------------------------------------------------------- CPU KV stores
    async def _ensure_stores(self) -> None:
        """One store per alive Ray node, pinned there; a dead node's store is dropped. Runs at
        start and before instances are added, so a node that joined since gets its store first."""
        if self.cfg.store.capacity_bytes <= 0:
            return
        if self._stores_lock is None:
            self._stores_lock = asyncio.Lock()
        async with self._stores_lock:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            from .store_actor import KVStoreActor
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            for node_id in [n for n in self.stores if n not in alive]:
                self._log(f"CPU KV store of node {node_id[:12]} dropped (node gone)")
                asyncio.get_running_loop().create_task(self._stop_store(self.stores.pop(node_id)))
            new = {}
            for node_id in sorted(alive - set(self.stores)):
                new[node_id] = KVStoreActor.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(self.cfg.store.capacity_bytes, self.cfg.frontend.host)
            addresses = await asyncio.gather(*(h.address.remote() for h in new.values()), return_exceptions=True)
            for (node_id, handle), address in zip(new.items(), addresses):
                if isinstance(address, BaseException):
                    self._log(f"CPU KV store on node {node_id[:12]} failed to start: {root_cause(address)}")
                    ray.kill(handle)
                    continue
                self.stores[node_id] = StoreInfo(node_id, address, handle)
                self._log(f"CPU KV store of node {node_id[:12]} at {address}")
            if new:
                self._bump()

    async def _stop_store(self, store: StoreInfo) -> None:
        try:
            await asyncio.wait_for(store.handle.stop.remote(), 5)
        except Exception:
            pass
        ray.kill(store.handle)

    async def store_addresses(self) -> dict[str, str]:
        return {n: s.address for n, s in self.stores.items()}

    # ----------------------------------------------------------------- instances
    def _new_member(self, pool: str) -> Member:
        iid = f"{pool}-{self._next_id[pool]}"
        self._next_id[pool] += 1
        pc = self.cfg.pool(pool)
        cpus = core_set_for(pc.cpus, [m.cpus for m in self._pool_members(pool, (STARTING, SERVING, DRAINING))])
        handle = Instance.options(
            num_cpus=pc.num_cpus, num_gpus=pc.num_gpus, max_concurrency=1000,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}},
        ).remote(iid, pool, self.cfg.engine_config(pool), self.cfg.frontend.host,
                 {n: s.address for n, s in self.stores.items()}, self.cfg.kv_transport,
                 self.cfg.store.swap_preemption, pc.nice, cpus)
        m = Member(iid, pool, STARTING, handle, created_at=time.time(), cpus=cpus)
        self.members[iid] = m
        self._bump()
        self._log(f"{iid}: starting (loading weights)" + (f" on cores {','.join(map(str, cpus))}" if cpus else ""))
        return m

    async def _await_ready(self, m: Member) -> bool:
        try:
            m.info = await m.handle.ready.remote()
        except (RayActorError, RayError) as e:
            m.state, m.error = DEAD, root_cause(e)
            self._log(f"{m.instance_id}: failed to start: {m.error}")
            self._failed.append(m)
            del self._failed[:-20]
            self.members.pop(m.instance_id, None)
            self._bump()
            return False
        if self._stopping or m.instance_id not in self.members:
            return False
        m.state = SERVING
        self._bump()
        self._log(f"{m.instance_id}: serving")
        return True

    async def _grow(self, pool: str, n: int) -> ScaleResult:
        await self._ensure_stores()
        new = [self._new_member(pool) for _ in range(n)]
        ok = await asyncio.gather(*(self._await_ready(m) for m in new))
        added = sum(ok)
        if added < n:
            return ScaleResult(False, Failure(ErrorKind.FAILED, f"{n - added} of {n} {pool} instances did not start"),
                               added=added)
        return ScaleResult(True, added=added)

    async def _stop_member(self, m: Member) -> None:
        try:
            await asyncio.wait_for(m.handle.shutdown.remote(), 10)
        except Exception:
            pass
        ray.kill(m.handle, no_restart=True)

    def _pool_members(self, pool: str, states=(STARTING, SERVING)) -> list[Member]:
        return [m for m in self.members.values() if m.pool == pool and m.state in states]

    # ----------------------------------------------------------------- scaling
    async def scale_pool(self, pool: str, replicas: int) -> ScaleResult:
        if pool not in POOL_NAMES:
            return ScaleResult(False, Failure(ErrorKind.NOT_FOUND,
                                              f"unknown pool {pool!r}; pools are {', '.join(POOL_NAMES)}"))
        if not 0 <= replicas <= 64:
            return ScaleResult(False, Failure(ErrorKind.INVALID, f"replicas must be in [0, 64], got {replicas}"))
        lock = self._pool_locks.setdefault(pool, asyncio.Lock())
        async with lock:
            self.targets[pool] = replicas
            current = self._pool_members(pool)
            if replicas > len(current):
                self._log(f"scale {pool}: {len(current)} -> {replicas}")
                res = await self._grow(pool, replicas - len(current))
            elif replicas < len(current):
                self._log(f"scale {pool}: {len(current)} -> {replicas} (draining {len(current) - replicas})")
                victims = await self._choose_victims(current, len(current) - replicas)
                drained = await asyncio.gather(*(self._drain(m) for m in victims))
                res = ScaleResult(True, removed=len(victims), migrated=sum(drained))
            else:
                res = ScaleResult(True)
            serving = len(self._pool_members(pool, (SERVING,)))
            return ScaleResult(res.ok, res.error, res.added, res.removed, res.migrated, serving, self.version)

    async def _choose_victims(self, members: list[Member], k: int) -> list[Member]:
        """Which instances a scale-down stops (``router.moves.victim_order``)."""
        async def load(m: Member) -> int:
            if m.state != SERVING:
                return -1
            try:
                s = await asyncio.wait_for(m.handle.stats.remote(), 5)
                return s.num_parts
            except Exception:
                return -1
        loads = await asyncio.gather(*(load(m) for m in members))
        chosen = victim_order([VictimCandidate(m.instance_id, m.state == SERVING, n, m.created_at)
                               for m, n in zip(members, loads)], k)
        by_id = {m.instance_id: m for m in members}
        return [by_id[i] for i in chosen]

    async def _drain(self, m: Member) -> int:
        m.state = DRAINING
        self._bump()
        migrated = 0
        if self.frontend is not None and m.info is not None:
            try:
                migrated = await self.frontend.evacuate.remote(m.instance_id)
            except (RayActorError, RayError) as e:
                self._log(f"{m.instance_id}: evacuation failed: {e}")
        self._log(f"{m.instance_id}: drained ({migrated} requests moved), stopping")
        await self._stop_member(m)
        self.members.pop(m.instance_id, None)
        self._bump()
        return migrated

    async def drain_instance(self, instance_id: str) -> DrainResult:
        m = self.members.get(instance_id)
        if m is None or m.state not in (STARTING, SERVING):
            return DrainResult(False, Failure(ErrorKind.NOT_FOUND, f"no running instance {instance_id!r}"))
        lock = self._pool_locks.setdefault(m.pool, asyncio.Lock())
        async with lock:
            self.targets[m.pool] = max(0, self.targets[m.pool] - 1)
            return DrainResult(True, migrated=await self._drain(m))

    # ----------------------------------------------------------------- health
    async def report_lost(self, instance_id: str) -> None:
        m = self.members.get(instance_id)
        if m is not None and m.state not in (DEAD, DRAINING):   # a draining one is being stopped anyway
            await self._declare_dead(m, "reported lost by the frontend")

    async def _declare_dead(self, m: Member, why: str) -> None:
        if m.state == DEAD or m.instance_id not in self.members:
            return
        was_draining = m.state == DRAINING
        m.state, m.error = DEAD, why
        self._log(f"{m.instance_id}: dead ({why})")
        self.members.pop(m.instance_id, None)
        self._bump()
        try:
            ray.kill(m.handle, no_restart=True)
        except Exception:
            pass
        if self.cfg.health.replace_dead and not self._stopping and not was_draining:
            if len(self._pool_members(m.pool)) < self.targets[m.pool]:
                self._log(f"{m.pool}: replacing {m.instance_id}")
                asyncio.get_running_loop().create_task(self._grow(m.pool, 1))

    async def _health_loop(self) -> None:
        hc = self.cfg.health
        while not self._stopping:
            await asyncio.sleep(hc.interval_s)
            for m in [m for m in self.members.values() if m.state in (SERVING, DRAINING)]:
                try:
                    err = await asyncio.wait_for(m.handle.ping.remote(), hc.timeout_s)
                except asyncio.TimeoutError:
                    err = f"no answer to a health check within {hc.timeout_s}s"
                except (RayActorError, RayError) as e:
                    err = f"actor died: {str(e).splitlines()[0][:200]}"
                if err:
                    await self._declare_dead(m, err)


def core_set_for(core_sets: list[list[int]] | None, held: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The core set (``pools.<name>.cpus``) a new instance of a pool runs on: of the configured
    sets, the one the fewest of the pool's instances (``held``: their sets) hold, the first such;
    () where the pool names none (any core)."""
    if not core_sets:
        return ()
    sets = [tuple(c) for c in core_sets]
    return min(sets, key=lambda c: (sum(h == c for h in held), sets.index(c)))
