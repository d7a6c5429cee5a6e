"""An instance: one engine in a pool with a role. ``InstanceCore`` is the logic; ``Instance`` is
the Ray actor that runs it (and, in tests, the orchestrator drives ``InstanceCore`` in process).

    frontend ── add_part / abort / poll / send_part / resume_part ──▶ Instance (asyncio actor)
                                                                      ├─ EngineHost thread: step loop
                                                                      ├─ KVEndpoint: page sets in/out
                                                                      │  (TCP, same-node shm), its
                                                                      │  node's CPU KV store
                                                                      └─ preemption swap space: the
                                                                         same store (StoreSwapSpace)

Control methods run on the actor's event loop and hand engine work to a worker thread under
the engine lock, so ``stats``/``ping``/``abort`` answer within one engine step even while it
decodes. Outputs are pulled: the frontend awaits ``poll()``, which returns every delta since
the previous call (or waits up to ``timeout_s`` for one).

Preemption under KV pressure swaps to the node's CPU KV store when the instance has one and its
engine's ``preemption_mode`` is ``swap`` (the default) and ``store.swap_preemption`` is on (the
default) — decode and mixed roles; a full or unreachable store makes the engine recompute.
"""
from __future__ import annotations

import asyncio
import logging
import os

import ray

from thinkserve.kvtransfer.page_set import fingerprint_namespace
from thinkserve.router.snapshot import POOL_ROLES
from thinkserve.workers import host_memory
from thinkserve.workers.config import EngineConfig
from thinkserve.workers.prefix_journal import PrefixCursor
from thinkserve.workers.sampling_params import SamplingParams

from .engine_host import EngineHost
from .messages import (Admission, InstanceInfo, ParkedPart, PollResult, Refusal, SendOutcome, SendTarget,
                       StepTrace)

log = logging.getLogger(__name__)

SWAP_ROLES = ("decode", "mixed")


def check_cores(pool: str, cpus: tuple[int, ...]) -> tuple[int, ...]:
    """``cpus`` (the instance's core set from ``pools.<pool>.cpus``) if this process may run on
    every one of them; ValueError naming the field otherwise."""
    cpus = tuple(int(c) for c in cpus)
    if not cpus:
        return ()
    if not hasattr(os, "sched_getaffinity"):
        raise ValueError(f"pools.{pool}.cpus: this platform cannot bind threads to cores (no sched_setaffinity)")
    allowed = os.sched_getaffinity(0)
    missing = sorted(set(cpus) - allowed)
    if missing:
        raise ValueError(f"pools.{pool}.cpus: core(s) {', '.join(map(str, missing))} not available on this node "
                         f"(this process may run on {', '.join(map(str, sorted(allowed)))})")
    return cpus


class InstanceCore:
    """An engine on its own thread, its KV endpoint and, when the node has a CPU KV store, that
    store as the engine's swap space. Every method an ``InstanceHandle`` names is here."""

    def __init__(self, instance_id: str, pool: str, engine_config: EngineConfig, *, node_id: str = "",
                 kv_host: str = "127.0.0.1", store_address: str | None = None, kv_transport: str = "auto",
                 swap_to_store: bool = True, nice: int = 0, cpus: tuple[int, ...] = ()):
        from thinkserve.workers.engine import LLMEngine

        from .kv_endpoint import KVEndpoint

        self.instance_id = instance_id
        self.pool = pool
        self.node_id = node_id
        self.cpus = check_cores(pool, cpus)
        self.swap_space = None
        if store_address and swap_to_store and engine_config.role in SWAP_ROLES \
                and engine_config.preemption_mode == "swap":
            from thinkserve.kvtransfer.store import StoreClient
            from thinkserve.kvtransfer.swap import StoreSwapSpace
            from thinkserve.kvtransfer.transport import TransferConfig

            # Its own client: the engine thread swaps under the engine lock, apart from the endpoint's.
            self.swap_space = StoreSwapSpace(StoreClient(store_address, TransferConfig(host=kv_host, timeout_s=10.0)))
        self.engine = LLMEngine(engine_config, swap_space=self.swap_space, instance_id=instance_id)
        self.host = EngineHost(instance_id, self.engine, nice=nice, cpus=self.cpus)
        self.kv = KVEndpoint(self.host, kv_host, store_address, kv_transport=kv_transport)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._new_output: asyncio.Event | None = None
        self.host.start(self._notify)
        self.kv.start()

    def _notify(self) -> None:
        loop, ev = self._loop, self._new_output
        if loop is not None and ev is not None:
            loop.call_soon_threadsafe(ev.set)

    async def ready(self) -> InstanceInfo:
        self._loop = asyncio.get_running_loop()
        self._new_output = asyncio.Event()
        cfg = self.engine.config
        s = self.host.stats()
        return InstanceInfo(
            self.instance_id, self.pool, POOL_ROLES[self.pool], self.node_id,
            self.kv.address, s.num_total_blocks, cfg.block_size, int(cfg.max_model_len),
            tuple(self.engine.tokenizer.eos_token_ids), shm_address=self.kv.shm_address,
            store_address=self.kv.store_address, collective_address=self.kv.collective_address,
            prefix_namespace=fingerprint_namespace(self.engine.fingerprint()), max_num_seqs=cfg.max_num_seqs,
            cpus=self.cpus)

    # ----------------------------------------------------------------- health and stats
    async def ping(self) -> str | None:
        """``None`` when healthy, else why not (the engine loop raised)."""
        return self.host.error

    async def stats(self):
        return await asyncio.to_thread(self.host.stats)

    async def check_integrity(self) -> None:
        await asyncio.to_thread(self._check_integrity)

    def _check_integrity(self) -> None:
        with self.host.lock:
            self.engine.check_integrity()

    async def poll(self, timeout_s: float = 0.2, prefix_since: PrefixCursor | None = None) -> PollResult:
        """Deltas since the last poll, stats, and with ``prefix_since`` the prefix blocks cached
        and evicted since that cursor (read after the deltas: a prefill a delta reports is in it)."""
        ev = self._new_output
        if ev is not None and not self.host.has_outputs():
            ev.clear()
            if not self.host.has_outputs():
                try:
                    await asyncio.wait_for(ev.wait(), timeout_s)
                except asyncio.TimeoutError:
                    pass
        deltas = self.host.take_outputs()
        # Read on this loop when nothing can block: a hop to a worker thread waits for the GIL
        # the engine thread holds through its step, which delayed every delta under load.
        ready = self.host.published(prefix_since)
        if ready is None:
            ready = await asyncio.to_thread(self._stats_and_prefix, prefix_since)
        return PollResult(deltas, *ready)

    def _stats_and_prefix(self, since: PrefixCursor | None):
        # Neither waits for the engine step in flight: the deltas just taken must not sit here
        # for another step (that delayed every token by up to one step).
        return self.host.latest_stats(), None if since is None else self.host.prefix_delta(since)

    async def step_trace(self) -> StepTrace:
        """The engine steps and part timings since the last call (``step_telemetry``)."""
        return self.host.telemetry.take(self.instance_id)

    async def has_part(self, part_id: str) -> bool:
        return part_id in self.host.parts

    # ----------------------------------------------------------------- requests
    async def add_part(self, part_id: str, prompt_token_ids, params: SamplingParams, priority: int,
                       reserve: tuple[str, tuple[int, ...]] | None = None) -> Admission:
        """``reserve``: (part id, branches) held here once the prompt is computed, for the later
        waves of a colocated Best-of-N request (``LLMEngine.add_request``)."""
        if not self.host.admitting:
            return Admission.refused(Refusal.DRAINING)
        # A prompt another instance prefilled may sit in the node's CPU store: load it into the
        # prefix cache first, so this prefill computes only the rest.
        if self.kv.may_load_prefix(prompt_token_ids):
            await asyncio.to_thread(self.kv.load_prompt_prefix, prompt_token_ids)
        try:
            # With no step in flight, added right here: the hop to a worker thread (which waits
            # for the GIL the engine thread holds through a step) was most of a short prompt's
            # time to its prefill under load. Else on a thread, waiting for the step to end.
            if not self.host.try_add(part_id, prompt_token_ids, params, priority, reserve):
                await asyncio.to_thread(self.host.add, part_id, prompt_token_ids, params, priority, reserve)
        except KeyError as e:
            return Admission.refused(Refusal.DUPLICATE, str(e))
        except ValueError as e:
            return Admission.refused(Refusal.INVALID, str(e))
        return Admission(True)

    async def abort(self, part_id: str) -> bool:
        return await asyncio.to_thread(self.kv.abort, part_id)

    async def abort_branches(self, part_id: str, indices: tuple[int, ...]) -> tuple[int, ...]:
        """End some of a part's branches now, freeing their KV (early consensus); ``()`` if the
        part is not here. ValueError when its branches cannot part (e.g. held for a handoff)."""
        return await asyncio.to_thread(self.host.abort_branches, part_id, tuple(indices))

    async def fork_part(self, part_id: str, new_part_id: str, indices: tuple[int, ...], reserve: bool = False,
                        start: bool = False) -> bool:
        """Branches ``indices`` of a part's prompt (held after its prefill, or running here) as a
        new part sharing its prompt KV: held, to be sent like a prefilled part, or running here
        when ``start``; ``reserve``: freed when the engine needs the blocks. False if ``part_id``
        holds no prompt KV here."""
        return await asyncio.to_thread(self.host.fork_held, part_id, new_part_id, tuple(indices), reserve=reserve,
                                       start=start)

    async def resume_part(self, part_id: str, prompt_token_ids, params: SamplingParams, priority: int,
                          branches) -> Admission:
        """Continue ``branches`` ((index, output tokens so far), ...) here by recompute, using
        whatever prefix of them the CPU KV store holds."""
        if not self.host.admitting:
            return Admission.refused(Refusal.DRAINING)
        return await asyncio.to_thread(self.kv.resume, part_id, tuple(prompt_token_ids), params, priority,
                                       tuple(branches))

    # ----------------------------------------------------------------- KV movement
    async def send_part(self, part_id: str, targets: tuple[SendTarget, ...], kind: str = "handoff",
                        publish_prefix: bool = False) -> SendOutcome:
        """Export ``part_id`` (it stops running here; its blocks stay held) and send each target
        its branches' page set. Call ``release_part`` when done."""
        return await asyncio.to_thread(self.kv.send, part_id, tuple(targets), kind, publish_prefix)

    async def release_part(self, part_id: str) -> None:
        await asyncio.to_thread(self.kv.release, part_id)

    async def swap_out_part(self, part_id: str) -> ParkedPart | None:
        """Park a part's KV in the CPU store; ``None``: it could not, and the part is gone from
        here (recompute it)."""
        return await asyncio.to_thread(self.kv.swap_out, part_id)

    async def swap_in_part(self, part_id: str, parked: ParkedPart) -> Admission:
        if not self.host.admitting:
            return Admission.refused(Refusal.DRAINING)
        return await asyncio.to_thread(self.kv.swap_in, part_id, parked)

    # ----------------------------------------------------------------- lifecycle
    async def drain(self) -> tuple[str, ...]:
        """Stop admitting new requests and incoming page sets; return the parts still here."""
        self.host.admitting = False
        return tuple(sorted(self.host.parts))

    async def shutdown(self) -> None:
        self.host.admitting = False
        await asyncio.to_thread(self.kv.close)
        await asyncio.to_thread(self.host.stop)
        if self.swap_space is not None:
            self.swap_space.store.close()

    async def pid(self) -> int:
        return os.getpid()


@ray.remote(max_restarts=0, max_task_retries=0)
class Instance(InstanceCore):
    """``InstanceCore`` as a Ray actor on its node, with the store of that node."""

    def __init__(self, instance_id: str, pool: str, engine_config: EngineConfig, kv_host: str = "127.0.0.1",
                 store_addresses: dict[str, str] | None = None, kv_transport: str = "auto",
                 swap_to_store: bool = True, nice: int = 0, cpus: tuple[int, ...] = ()):
        # Engines share the node's cores with their peers: one intra-op thread each.
        import torch

        torch.set_num_threads(1)
        node_id = ray.get_runtime_context().get_node_id()
        store_address = (store_addresses or {}).get(node_id)
        if store_addresses and store_address is None:
            log.warning("%s: no CPU KV store on node %s; running without one", instance_id, node_id)
        super().__init__(instance_id, pool, engine_config, node_id=node_id, kv_host=kv_host,
                         store_address=store_address, kv_transport=kv_transport, swap_to_store=swap_to_store,
                         nice=nice, cpus=cpus)
        # Every KV cache page resident before the first request (nothing is running yet): a page
        # first written by a step, on huge pages, can cost that step the kernel's compaction.
        if self.engine.runner.kv_cache.device.type == "cpu":
            host_memory.prefault(self.engine.runner.kv_cache)
