"""The frontend: the gRPC server (Inference, Admin, health, reflection) as a Ray actor.

It owns every request's state (``request_state.py``) and drives it through the cluster
(``orchestrator.py``); this file maps RPCs onto that and errors onto status codes:

    bad field            → INVALID_ARGUMENT "field: why"      unknown pool / request → NOT_FOUND
    queue full           → RESOURCE_EXHAUSTED                 request id in use      → ALREADY_EXISTS
    nothing can serve    → UNAVAILABLE                        oversized message      → RESOURCE_EXHAUSTED (gRPC)
    deadline / cancel    → the request is aborted on every instance and its KV freed
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

import grpc
import ray
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ray.exceptions import RayActorError, RayError

from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from thinkserve.router import Conductor
from thinkserve.router.snapshot import DEAD, DRAINING, POOL_NAMES, POOL_ROLES, SERVING, STARTING, STOPPED

from .config import ClusterConfig, parse_config
from .instance_handle import ActorInstance, ActorStore
from .messages import ErrorKind, Membership
from .orchestrator import Orchestrator
from .request_state import RequestState
from .validation import InvalidField, ModelLimits, validate_generate

log = logging.getLogger(__name__)

_STATE = {STARTING: admin_pb2.INSTANCE_STATE_STARTING, SERVING: admin_pb2.INSTANCE_STATE_SERVING,
          DRAINING: admin_pb2.INSTANCE_STATE_DRAINING, STOPPED: admin_pb2.INSTANCE_STATE_STOPPED,
          DEAD: admin_pb2.INSTANCE_STATE_DEAD}


class FrontendCore:
    """Everything but the actor shell: membership tracking, instance pollers, the servicers."""

    def __init__(self, cfg: ClusterConfig, controller):
        from thinkserve.workers.loader import resolve_model_path
        from thinkserve.workers.model_config import ModelConfig
        from thinkserve.workers.tokenizer import Tokenizer

        self.cfg = cfg
        self.controller = controller
        path = resolve_model_path(cfg.model)
        self.tokenizer = Tokenizer.from_pretrained(path)
        mc = ModelConfig.from_pretrained(path)
        max_len = cfg.engine_config("prefill").max_model_len or mc.max_model_len
        from thinkserve.router.snapshot import POOL_NAMES as _pools
        seqs = min(cfg.engine_config(p).max_num_seqs for p in _pools)
        self.model_limits = ModelLimits(self.tokenizer.vocab_size, int(max_len),
                                        self.tokenizer.think_start_id is not None
                                        and self.tokenizer.think_end_id is not None, seqs)
        self.orch = Orchestrator(cfg.make_policy(),
                                 kv_transport=cfg.kv_transport, wrap_instance=ActorInstance, wrap_store=ActorStore)
        self.orch.on_lost = self._report_lost
        self.version = 0
        self.pollers: dict[str, asyncio.Task] = {}
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._stopping = False
        self._watch_task: asyncio.Task | None = None
        self._promotion_task: asyncio.Task | None = None
        self._rebalance_task: asyncio.Task | None = None

    # ----------------------------------------------------------------- membership
    async def start(self) -> str:
        m = await self.controller.membership.remote()
        self._apply_membership(m)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        if isinstance(self.orch.policy, Conductor):     # short -> long promotions while decoding
            self._promotion_task = asyncio.get_running_loop().create_task(
                self.orch.run_promotions(self.cfg.router.promotion_interval_s, lambda: self._stopping))
        rb = self.cfg.rebalance
        if rb.enabled:
            self._rebalance_task = asyncio.get_running_loop().create_task(
                self.orch.rebalance_loop(rb.interval_s, rb.kv_margin, lambda: self._stopping, rb.max_moves))
        lim = self.cfg.limits
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", lim.max_message_bytes),
            ("grpc.max_send_message_length", max(lim.max_message_bytes, 16 * 2**20)),
            ("grpc.so_reuseport", 0),
        ])
        inference_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(self), self.server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminServicer(self), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name,
                 admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        host, port = self.cfg.frontend.host, self.cfg.frontend.port
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"frontend: cannot bind {host}:{port} (in use?)")
        await self.server.start()
        for name in ("", *names[:2]):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.address = f"{host}:{bound}"
        return self.address

    async def stop(self) -> None:
        self._stopping = True
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.orch.abort_all()
            await self.server.stop(grace=2.0)
        for t in list(self.pollers.values()):
            t.cancel()
        for t in (self._watch_task, self._rebalance_task, self._promotion_task):
            if t is not None:
                t.cancel()

    async def _watch(self) -> None:
        while not self._stopping:
            try:
                m = await self.controller.wait_membership.remote(self.version, 5.0)
            except (RayActorError, RayError):
                await asyncio.sleep(1.0)
                continue
            self._apply_membership(m)

    def _apply_membership(self, m: Membership) -> None:
        change = self.orch.view.apply_membership(m)
        if change is None:
            return
        self.version = m.version
        for iid in change.joined:
            if iid not in self.pollers:
                self.pollers[iid] = asyncio.get_running_loop().create_task(
                    self.orch.follow(iid, lambda: self._stopping))
        for iid in change.left:
            # Removed: drained (its parts moved away) or declared dead by the controller.
            self.orch.instance_left(iid)
            t = self.pollers.pop(iid, None)
            if t is not None:
                t.cancel()

    def _report_lost(self, iid: str) -> None:
        self.orch.spawn(self._tell_controller_lost(iid))

    async def _tell_controller_lost(self, iid: str) -> None:
        try:
            await self.controller.report_lost.remote(iid)
        except (RayActorError, RayError):
            pass

    # ----------------------------------------------------------------- status
    def status(self) -> admin_pb2.ClusterStatus:
        view = self.orch.view
        snap = view.snapshot()
        pools = []
        for name in POOL_NAMES:
            ps = snap.pool(name)
            insts = []
            for i in ps.instances:
                st = view.stats.get(i.instance_id)
                m = view.members.get(i.instance_id)
                state = view.state(i.instance_id)
                insts.append(admin_pb2.InstanceStatus(
                    instance_id=i.instance_id, pool=name, role=POOL_ROLES[name], state=_STATE.get(state, 0),
                    num_waiting=i.num_waiting, num_running=i.num_running, num_swapped=st.num_swapped if st else 0,
                    num_free_blocks=i.num_free_blocks, num_total_blocks=i.num_total_blocks, kv_usage=i.kv_usage,
                    generated_tokens=st.generated_tokens if st else 0, assigned_requests=i.assigned_requests,
                    node_id=m.info.node_id if m is not None and m.info else ""))
            total = sum(i.num_total_blocks for i in ps.instances)
            used = sum(i.num_total_blocks - i.num_free_blocks for i in ps.instances)
            pools.append(admin_pb2.PoolStatus(
                name=name, role=POOL_ROLES[name], target_replicas=self._targets.get(name, 0),
                serving_replicas=sum(1 for i in ps.instances if i.state == SERVING), instances=insts,
                queue_depth=sum(i.num_waiting for i in ps.instances), kv_usage=used / total if total else 0.0,
                rebalanced=self.orch.counters.rebalanced.get(name, 0),
                promotions_out=self.orch.counters.promotions_out.get(name, 0),
                promotions_in=self.orch.counters.promotions_in.get(name, 0)))
        c = self.orch.counters
        fe = admin_pb2.FrontendStatus(
            address=self.address, active_requests=len(self.orch.requests),
            max_active_requests=self.cfg.limits.max_queued_requests, completed_requests=c.completed,
            failed_requests=c.failed, aborted_requests=c.aborted, rejected_requests=c.rejected,
            resumed_requests=c.resumed, migrated_requests=c.migrated, admission_refused=c.admission_refused)
        return admin_pb2.ClusterStatus(model=self.cfg.model, pools=pools, frontend=fe)

    async def wait_version(self, version: int, timeout_s: float = 10.0) -> None:
        """Until this frontend has seen membership ``version`` (so a reply reflects the change)."""
        deadline = time.monotonic() + timeout_s
        changed = self.orch.view.membership_changed
        while self.version < version and time.monotonic() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    @property
    def _targets(self) -> dict[str, int]:
        return getattr(self, "_target_cache", {})

    async def refresh_targets(self) -> None:
        try:
            m = await self.controller.membership.remote()
            self._target_cache = dict(m.targets)
        except (RayActorError, RayError):
            pass


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, core: FrontendCore):
        self.core = core

    async def Generate(self, request, context):
        core, orch = self.core, self.core.orch
        try:
            spec = validate_generate(request, core.cfg.limits, core.model_limits, core.tokenizer.encode,
                                     core.cfg.router.reasoning_effort_budgets.model_dump())
        except InvalidField as e:
            orch.counters.rejected += 1
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if core._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if len(orch.requests) >= core.cfg.limits.max_queued_requests:
            orch.counters.rejected += 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{len(orch.requests)} requests in flight, the limit "
                                f"(limits.max_queued_requests) is {core.cfg.limits.max_queued_requests}; retry later")
        rid = spec.request_id or uuid.uuid4().hex
        if rid in orch.requests:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: {rid!r} is already running")
        req = RequestState(rid, spec.prompt_token_ids, spec.params, spec.priority, core.tokenizer,
                           slo_class=spec.slo_class)
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        orch.admit(req, deadline)
        ok = False
        try:
            while True:
                req.changed.clear()
                msg = req.take_response()
                if req.finished:
                    # The last deltas travel with the final aggregate: nothing can slip in between.
                    final = req.final_response()
                    if msg is not None:
                        final.deltas.extend(msg.deltas)
                    yield final
                    ok = True
                    break
                if msg is not None:
                    yield msg
                if req.error is not None:
                    break
                await req.changed.wait()
        finally:
            if not ok and not req.finished:
                # Cancelled, past its deadline, or failed: free its KV on every instance.
                orch.spawn(orch.abort(req))
            orch.forget(rid)
            c = orch.counters
            if ok and req.aborted:
                c.aborted += 1
            elif ok:
                c.completed += 1
            elif req.error is not None:
                c.failed += 1
            else:
                c.aborted += 1
        if req.error is not None and not ok:
            await context.abort(_REQUEST_CODES[req.error.kind], req.error.message)

    async def Abort(self, request, context):
        req = self.core.orch.requests.get(request.request_id)
        if req is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request_id: no running request {request.request_id!r}")
        await self.core.orch.abort(req)
        return inference_pb2.AbortResponse(aborted=True)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self, core: FrontendCore):
        self.core = core

    async def GetStatus(self, request, context):
        await self.core.refresh_targets()
        return self.core.status()

    async def ScalePool(self, request, context):
        if request.pool not in POOL_NAMES:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"pool: unknown pool {request.pool!r}; pools are {', '.join(POOL_NAMES)}")
        if request.replicas > 64:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"replicas: must be <= 64, got {request.replicas}")
        res = await self.core.controller.scale_pool.remote(request.pool, request.replicas)
        if not res.ok:
            await context.abort(_ADMIN_CODES[res.error.kind], res.error.message)
        await self.core.wait_version(res.version)
        await self.core.refresh_targets()
        status = self.core.status()
        pool = next(p for p in status.pools if p.name == request.pool)
        return admin_pb2.ScalePoolResponse(pool=pool, added=res.added, removed=res.removed,
                                           migrated_requests=res.migrated)

    async def DrainInstance(self, request, context):
        res = await self.core.controller.drain_instance.remote(request.instance_id)
        if not res.ok:
            await context.abort(_ADMIN_CODES[res.error.kind], res.error.message)
        return admin_pb2.DrainInstanceResponse(instance_id=request.instance_id, migrated_requests=res.migrated)


_ADMIN_CODES = {ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND, ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
                ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, ErrorKind.FAILED: grpc.StatusCode.INTERNAL}
# A request that failed after admission: the client's fault (INVALID) or the cluster could not serve it.
_REQUEST_CODES = {**_ADMIN_CODES, ErrorKind.FAILED: grpc.StatusCode.UNAVAILABLE,
                  ErrorKind.EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED}


@ray.remote(max_restarts=0)
class Frontend:
    def __init__(self, config: dict, controller):
        self.core = FrontendCore(parse_config(config), controller)

    async def start(self) -> str:
        return await self.core.start()

    async def stop(self) -> None:
        await self.core.stop()

    async def evacuate(self, instance_id: str) -> int:
        return await self.core.orch.evacuate(instance_id)

    async def debug_state(self) -> dict:
        """For tests and `thinkserve status --json`: what the frontend holds right now."""
        o = self.core.orch
        v = o.view
        return {"requests": sorted(o.requests), "parts": {pid: p.instance_id for pid, (_, p) in o.table.parts.items()},
                "draining": sorted(v.draining), "lost": sorted(v.lost), "counters": o.counters.to_dict(),
                "kv_transport": v.kv_transport, "stores": {s.node_id: s.address for s in v.stores.values()},
                "parked": {rid: len(r.parked) for rid, r in o.requests.items() if r.parked}}
