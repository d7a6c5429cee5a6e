"""The frontend: the gRPC server (Inference, Admin, health, reflection) as a Ray actor, with the
OpenAI-compatible HTTP API and /metrics (``http_api.py``) on the same event loop.

It owns every request's state (``request_state.py``) and drives it through the cluster
(``orchestrator.py``). Every API goes through ``FrontendCore.validate -> admit -> stream``, which
raise ``Refused``; this file maps RPCs onto that and refusals onto status codes:

    bad field            → INVALID_ARGUMENT "field: why"      unknown pool / request → NOT_FOUND
    unparsable bytes     → INVALID_ARGUMENT "request: ..."  (rpc_decode.py)
    queue full           → RESOURCE_EXHAUSTED                 request id in use      → ALREADY_EXISTS
    nothing can serve    → UNAVAILABLE                        oversized message      → RESOURCE_EXHAUSTED (gRPC)
    deadline / cancel    → the request is aborted on every instance and its KV freed
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

import grpc
import ray
from google.protobuf import json_format
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from ray.exceptions import RayActorError, RayError

from thinkserve.kvtransfer.store import StoreStats
from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from thinkserve.router import Conductor, Consensus, WavePlan, get_extractor, make_rule
from thinkserve.router.snapshot import DEAD, DRAINING, POOL_NAMES, POOL_ROLES, SERVING, STARTING, STOPPED
from thinkserve.workers.block_hash import hash_blocks

from .config import ClusterConfig, parse_config
from .errors import Refused
from .instance_handle import ActorInstance, ActorStore, InstanceGone
from .loop_lag import LoopLag
from .messages import ErrorKind, Membership
from .orchestrator import Orchestrator
from .request_state import RequestState
from .rpc_decode import add_servicer
from .validation import GenerateSpec, InvalidField, ModelLimits, validate_generate

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
        self.orch = Orchestrator(cfg.make_policy(path),
                                 kv_transport=cfg.kv_transport, wrap_instance=ActorInstance, wrap_store=ActorStore,
                                 prefix_affinity=cfg.router.prefix_affinity,
                                 decode_poll_interval_s=cfg.frontend.stream_interval_ms / 1e3)
        self.orch.on_lost = self._report_lost
        self.version = 0
        self.pollers: dict[str, asyncio.Task] = {}
        self.store_pollers: dict[str, asyncio.Task] = {}    # store address -> its prefix-report poller
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self.admin_server: grpc.aio.Server | None = None
        self.admin_address = ""             # "" when Admin is served beside Inference
        self.http = None                    # http_api.HttpServer when frontend.http_port is set
        self.http_address = ""
        from .metrics import FrontendMetrics
        self.metrics = FrontendMetrics(self)
        self._stopping = False
        self._watch_task: asyncio.Task | None = None
        self._promotion_task: asyncio.Task | None = None
        self._rebalance_task: asyncio.Task | None = None
        self.loop_lag = LoopLag()           # how late the event loop runs (status, /metrics, bench --trace)
        self.store_stats: dict[str, StoreStats] = {}    # store address -> its last stats (refresh_stores)

    # ----------------------------------------------------------------- membership
    async def start(self) -> str:
        self.loop_lag.start()
        m = await self.controller.membership.remote()
        self._apply_membership(m)
        self._watch_task = asyncio.get_running_loop().create_task(self._watch())
        rb = self.cfg.rebalance
        if rb.enabled:
            self._rebalance_task = asyncio.get_running_loop().create_task(
                self.orch.rebalance_loop(rb.interval_s, rb.kv_margin, lambda: self._stopping, rb.max_moves))
        if isinstance(self.orch.policy, Conductor):     # short -> long promotions while decoding
            self._promotion_task = asyncio.get_running_loop().create_task(
                self.orch.run_promotions(self.cfg.router.promotion_interval_s, lambda: self._stopping))
        fc = self.cfg.frontend
        inference = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
        admin = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
        own_admin = fc.admin_port is not None
        self.server = self._grpc_server()
        add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, InferenceServicer(self), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [inference, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        if own_admin:
            self.admin_server = self._grpc_server()
            add_servicer(admin_pb2_grpc.add_AdminServicer_to_server, AdminServicer(self), self.admin_server)
            self.admin_address = await self._listen(self.admin_server, fc.admin_host or fc.host, fc.admin_port,
                                                    "frontend.admin_port")
        else:
            add_servicer(admin_pb2_grpc.add_AdminServicer_to_server, AdminServicer(self), self.server)
            names.insert(1, admin)
        reflection.enable_server_reflection(names, self.server)
        self.address = await self._listen(self.server, fc.host, fc.port, "frontend.port")
        for name in ("", inference, admin):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if fc.http_port is not None:
            from .http_api import HttpServer
            self.http = HttpServer(self)
            self.http_address = await self.http.start()
        return self.address

    def _grpc_server(self) -> grpc.aio.Server:
        """A gRPC server with the size limits and, with a token set, the auth interceptor."""
        lim, auth = self.cfg.limits, self.cfg.frontend.auth
        interceptors = []
        if auth.token is not None:
            from .auth import ADMIN_SERVICE, INFERENCE_SERVICE, BearerTokenInterceptor
            protected = (ADMIN_SERVICE, INFERENCE_SERVICE) if auth.inference else (ADMIN_SERVICE,)
            interceptors.append(BearerTokenInterceptor(auth.token.get_secret_value(), protected))
        return grpc.aio.server(interceptors=interceptors, options=[
            ("grpc.max_receive_message_length", lim.max_message_bytes),
            ("grpc.max_send_message_length", max(lim.max_message_bytes, 16 * 2**20)),
            ("grpc.so_reuseport", 0),
        ])

    async def _listen(self, server: grpc.aio.Server, host: str, port: int, field: str) -> str:
        tls = self.cfg.frontend.tls
        if tls is not None:
            from .auth import server_credentials
            bound = server.add_secure_port(f"{host}:{port}", server_credentials(tls.cert_file, tls.key_file))
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise RuntimeError(f"{field}: cannot bind {host}:{port} (in use?)")
        await server.start()
        return f"{host}:{bound}"

    async def stop(self) -> None:
        self._stopping = True
        self.loop_lag.stop()
        if self.server is not None:
            await self.health.enter_graceful_shutdown()
            await self.orch.abort_all()
            await self.server.stop(grace=2.0)
        if self.admin_server is not None:
            await self.admin_server.stop(grace=1.0)
        if self.http is not None:
            await self.http.stop()
        for t in [*self.pollers.values(), *self.store_pollers.values()]:
            t.cancel()
        for t in (self._watch_task, self._promotion_task, self._rebalance_task):
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
        for address in self.orch.view.stores if self.orch.prefix_affinity else ():  # ends when its store leaves
            t = self.store_pollers.get(address)
            if t is None or t.done():
                self.store_pollers[address] = asyncio.get_running_loop().create_task(
                    self.orch.follow_store(address, lambda: self._stopping))

    def _report_lost(self, iid: str) -> None:
        self.orch.spawn(self._tell_controller_lost(iid))

    async def _tell_controller_lost(self, iid: str) -> None:
        try:
            await self.controller.report_lost.remote(iid)
        except (RayActorError, RayError):
            pass

    # ----------------------------------------------------------------- requests
    # One pipeline for every API: gRPC's Generate and the HTTP handlers (http_api.py) call
    # validate -> admit -> stream; each maps ``Refused`` onto its own status codes.
    def validate(self, request: inference_pb2.GenerateRequest) -> GenerateSpec:
        try:
            return validate_generate(request, self.cfg.limits, self.model_limits, self.tokenizer.encode,
                                     self.cfg.efforts())
        except InvalidField as e:
            self.orch.counters.rejected += 1
            raise Refused("invalid_argument", str(e), e.field) from None

    def admit(self, spec: GenerateSpec, deadline: float | None) -> RequestState:
        """Take the request in (or refuse it) and start driving it; ``stream`` must follow."""
        orch, limit = self.orch, self.cfg.limits.max_queued_requests
        if self._stopping:
            raise Refused("unavailable", "the server is shutting down")
        if len(orch.requests) >= limit:
            orch.counters.rejected += 1
            raise Refused("resource_exhausted", f"{len(orch.requests)} requests in flight, the limit "
                                                f"(limits.max_queued_requests) is {limit}; retry later")
        rid = spec.request_id or uuid.uuid4().hex
        if rid in orch.requests:
            raise Refused("already_exists", f"request_id: {rid!r} is already running", "request_id")
        req = RequestState(rid, spec.prompt_token_ids, spec.params, spec.priority, self.tokenizer,
                           slo_class=spec.slo_class, consensus=self.consensus_for(spec),
                           extractor=get_extractor(self.cfg.router.answer_extractor))
        orch.admit(req, deadline)
        return req

    async def stream(self, req: RequestState) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The request's responses: deltas as they come, then the final aggregate. Closing it
        early (client gone, deadline) aborts the request on every instance and frees its KV."""
        ok = False
        interval = self.cfg.frontend.stream_interval_ms / 1e3
        sent_at = None
        try:
            while True:
                req.changed.clear()
                msg = req.take_response()
                if req.finished:
                    # The last deltas travel with the final aggregate: nothing can slip in between.
                    final = req.final_response()
                    if msg is not None:
                        final.deltas.extend(msg.deltas)
                    ok = True          # handed over: an HTTP caller stops reading at the final
                    self.metrics.request_finished(req, final)
                    yield final
                    break
                if msg is not None:
                    yield msg
                    sent_at = time.monotonic()
                if req.error is not None:
                    break
                await req.changed.wait()
                if interval and sent_at is not None and req.error is None:
                    # Coalesce: what the engines produce until the interval is over goes out as one
                    # message (frontend and client cost per message, a decode step per token).
                    wait = sent_at + interval - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
        finally:
            self.close(req, ok)
        if req.error is not None and not ok:
            raise Refused(_REFUSAL_CODES[req.error.kind], req.error.message)

    def close(self, req: RequestState, delivered: bool) -> None:
        """Forget an admitted request; unless its final response went out, abort it on every
        instance (frees its KV). Idempotent: ``stream`` calls it, and so does an API whose
        client left before the stream ever started."""
        orch = self.orch
        if orch.requests.get(req.request_id) is not req:
            return
        if not delivered and not req.finished:
            # Cancelled, past its deadline, or failed: free its KV on every instance.
            orch.spawn(orch.abort(req))
        orch.forget(req.request_id)
        c = orch.counters
        if delivered and req.aborted:
            c.aborted += 1
        elif delivered:
            c.completed += 1
        elif req.error is not None:
            c.failed += 1
        else:
            c.aborted += 1

    def consensus_for(self, spec) -> Consensus | None:
        """The Best-of-N early-stop controller for a request: its own rule, else the config's."""
        rule_name = spec.early_stop or self.cfg.router.early_stop
        if spec.params.n < 2 or rule_name == "none":
            return None
        rule = make_rule(rule_name)
        return Consensus(spec.params.n, rule, WavePlan.for_rule(spec.params.n, rule, self.cfg.router.consensus_wave))

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
                    node_id=m.info.node_id if m is not None and m.info else "",
                    cpus=list(m.info.cpus) if m is not None and m.info else []))
            total = sum(i.num_total_blocks for i in ps.instances)
            used = sum(i.num_total_blocks - i.num_free_blocks for i in ps.instances)
            pools.append(admin_pb2.PoolStatus(
                name=name, role=POOL_ROLES[name], target_replicas=self._targets.get(name, 0),
                serving_replicas=sum(1 for i in ps.instances if i.state == SERVING), instances=insts,
                queue_depth=sum(i.num_waiting for i in ps.instances), kv_usage=used / total if total else 0.0,
                rebalanced=self.orch.counters.rebalanced.get(name, 0),
                promotions_out=self.orch.counters.promotions_out.get(name, 0),
                promotions_in=self.orch.counters.promotions_in.get(name, 0),
                local_prefills=self.orch.counters.local_prefills.get(name, 0)))
        c = self.orch.counters
        lag = self.loop_lag.summary()
        fe = admin_pb2.FrontendStatus(
            address=self.address, active_requests=len(self.orch.requests),
            max_active_requests=self.cfg.limits.max_queued_requests, completed_requests=c.completed,
            failed_requests=c.failed, aborted_requests=c.aborted, rejected_requests=c.rejected,
            resumed_requests=c.resumed, migrated_requests=c.migrated, admission_refused=c.admission_refused,
            promoted_requests=c.promoted, cancelled_branches=c.cancelled_branches,
            http_address=self.http_address, admin_address=self.admin_address,
            loop_lag_max_ms=lag.max_ms, loop_lag_mean_ms=lag.mean_ms, loop_stalls=lag.stalls)
        stores = [admin_pb2.StoreStatus(node_id=view.stores[a].node_id, address=a, **s.to_dict())  # same field names
                  for a, s in sorted(self.store_stats.items()) if a in view.stores]
        return admin_pb2.ClusterStatus(model=self.cfg.model, pools=pools, frontend=fe, stores=stores)

    async def debug_state(self, request: admin_pb2.GetDebugStateRequest) -> admin_pb2.DebugState:
        """What the router holds right now (``Admin.GetDebugState``, ``thinkserve debug``)."""
        o = self.orch
        v = o.view
        # DebugCounters names each field as Counters does: a counter missing from the proto fails
        # here (ParseDict refuses unknown fields), which the cluster tests read.
        counters = json_format.ParseDict(dataclasses.asdict(o.counters), admin_pb2.DebugCounters())
        state = admin_pb2.DebugState(
            requests=sorted(o.requests), parts={pid: p.instance_id for pid, (_, p) in o.table.parts.items()},
            draining=sorted(v.draining), lost=sorted(v.lost), counters=counters, kv_transport=v.kv_transport,
            stores={s.node_id: s.address for s in v.stores.values()},
            parked={rid: len(r.parked) for rid, r in o.requests.items() if r.parked},
            # the prefix index: blocks each instance reported holding, prompts not yet confirmed
            prefix_blocks={iid: len(held) for iid in v.members if (held := o.prefixes.reported(iid)) is not None},
            prefix_in_flight=o.prefixes.num_in_flight,
            loop_stalls=[admin_pb2.LoopStall(woke_at_s=at, lag_s=lag)
                         for at, lag in self.loop_lag.stalls_since(request.stalls_since_s)])
        if request.prefix_of:
            bs = next((m.info.block_size for m in v.members.values() if m.info is not None), 16)
            hashes = tuple(hash_blocks(list(request.prefix_of), bs))
            instances, stores = o.prefixes.index().hits(hashes)
            state.prefix.CopyFrom(admin_pb2.PrefixLocation(blocks=len(hashes), instances=instances, stores=stores))
        if request.step_traces:
            serving = [iid for iid, m in v.members.items() if m.handle is not None and v.state(iid) == SERVING]
            traces = await asyncio.gather(*(v.handle(iid).step_trace() for iid in serving), return_exceptions=True)
            for trace in traces:
                if isinstance(trace, InstanceGone):    # died meanwhile: its trace went with it
                    continue
                if isinstance(trace, BaseException):
                    raise trace
                state.step_traces.append(admin_pb2.StepTrace(
                    instance_id=trace.instance_id,
                    steps=[admin_pb2.StepSample(start=x.start, duration=x.duration, prefill_tokens=x.prefill_tokens,
                                                prefill_ctx=x.prefill_ctx, num_decode=x.num_decode,
                                                decode_ctx=x.decode_ctx) for x in trace.steps],
                    parts=[admin_pb2.PartTiming(part_id=x.part_id, added=x.added, first_token=x.first_token,
                                                finished=x.finished) for x in trace.parts]))
        return state

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

    async def refresh_stores(self, timeout_s: float = 2.0) -> None:
        """Fetch each node's CPU KV store counters (``GetStatus`` and a /metrics scrape wait for
        them, at most ``timeout_s``; a store that does not answer keeps its last values)."""
        view = self.orch.view
        addresses = list(view.stores)

        async def one(address):
            store = view.store(address)
            return None if store is None else await store.stats()
        try:
            got = await asyncio.wait_for(asyncio.gather(*map(one, addresses), return_exceptions=True), timeout_s)
        except asyncio.TimeoutError:
            return
        for address, st in zip(addresses, got):
            if isinstance(st, InstanceGone) or st is None:
                continue
            if isinstance(st, BaseException):
                log.warning("KV store stats of %s failed: %r", address, st)
                continue
            self.store_stats[address] = st
        for gone in set(self.store_stats) - set(view.stores):
            del self.store_stats[gone]

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
        core = self.core
        try:
            spec = core.validate(request)
            remaining = context.time_remaining()
            req = core.admit(spec, time.monotonic() + remaining if remaining is not None else None)
            async with contextlib.aclosing(core.stream(req)) as stream:
                async for msg in stream:
                    yield msg
        except Refused as e:
            await context.abort(grpc.StatusCode[e.code.upper()], e.message)

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
        await asyncio.gather(self.core.refresh_targets(), self.core.refresh_stores())
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

    async def GetDebugState(self, request, context):
        limit = self.core.cfg.limits.max_prompt_tokens
        if len(request.prefix_of) > limit:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"prefix_of: {len(request.prefix_of)} token ids, more than limits.max_prompt_tokens {limit}")
        return await self.core.debug_state(request)


_ADMIN_CODES = {ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND, ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
                ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE, ErrorKind.FAILED: grpc.StatusCode.INTERNAL}
# A request's failure as a refusal code of ``errors.Refused`` (each API maps those onto its statuses).
_REFUSAL_CODES = {ErrorKind.NOT_FOUND: "not_found", ErrorKind.INVALID: "invalid_argument",
                  ErrorKind.UNAVAILABLE: "unavailable", ErrorKind.FAILED: "unavailable",
                  ErrorKind.EXHAUSTED: "resource_exhausted"}


@ray.remote(max_restarts=0)
class Frontend:
    def __init__(self, config: dict, controller):
        self.core = FrontendCore(parse_config(config), controller)

    async def start(self) -> str:
        return await self.core.start()

    async def stop(self) -> None:
        await self.core.stop()

    async def addresses(self) -> dict[str, str]:
        """Where it listens: ``grpc``, ``admin`` ("" = on grpc) and ``http`` ("" = off), host:port."""
        c = self.core
        return {"grpc": c.address, "admin": c.admin_address, "http": c.http_address}

    async def evacuate(self, instance_id: str) -> int:
        return await self.core.orch.evacuate(instance_id)
