"""Helpers for the cluster tests: a tiny random Llama checkpoint, a gRPC client, KV checks."""
from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import uuid

import grpc

from thinkserve.protos.thinkserve.v1 import admin_pb2, admin_pb2_grpc, common_pb2, inference_pb2, inference_pb2_grpc

def generate_request(prompt, *, max_tokens=16, temperature=0.0, n=1, seed=None, request_id="", ignore_eos=False, **kw):
    sp = inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)
    if seed is not None:
        sp.seed = seed
    req = inference_pb2.GenerateRequest(request_id=request_id, sampling=sp, n=n, **kw)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.CopyFrom(common_pb2.TokenIds(ids=list(prompt)))
    return req


def collect(stream):
    """Consume a Generate stream: (per-branch tokens concatenated from deltas, final message)."""
    tokens: dict[int, list[int]] = {}
    final = None
    for msg in stream:
        for d in msg.deltas:
            got = tokens.setdefault(d.index, [])
            assert d.num_tokens == len(got) + len(d.token_ids), "delta does not continue its branch"
            got.extend(d.token_ids)
        if msg.HasField("final"):
            final = msg
    return tokens, final


class Client:
    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminStub(self.channel)

    def generate(self, prompt, timeout=120, **kw):
        return collect(self.inference.Generate(generate_request(prompt, **kw), timeout=timeout))

    def status(self) -> admin_pb2.ClusterStatus:
        return self.admin.GetStatus(admin_pb2.GetStatusRequest(), timeout=30)

    def debug_state(self, **kw) -> admin_pb2.DebugState:
        return self.admin.GetDebugState(admin_pb2.GetDebugStateRequest(**kw), timeout=30)

    def close(self):
        self.channel.close()


def wait_kv_free(client: Client, timeout_s: float = 30.0) -> admin_pb2.ClusterStatus:
    """Wait until every serving instance reports every KV block free; returns the last status."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = client.status()
        insts = [i for p in st.pools for i in p.instances]
        if all(i.num_free_blocks == i.num_total_blocks and i.num_running == 0 and i.num_waiting == 0 for i in insts):
            return st
        if time.monotonic() > deadline:
            raise AssertionError("KV blocks still in use: " + ", ".join(
                f"{i.instance_id}: {i.num_total_blocks - i.num_free_blocks} used, {i.num_running} running"
                for i in insts))
        time.sleep(0.2)


def cluster_config(model: str, **overrides):
    from thinkserve.cluster.config import parse_config

    base = {
        "model": model,
        "namespace": f"thinkserve-test-{uuid.uuid4().hex[:8]}",
        "engine": {"num_device_blocks": 96, "max_num_seqs": 32, "block_size": 16},
        "pools": {"prefill": {"replicas": 1, "num_cpus": 0.5}, "short_decode": {"replicas": 1, "num_cpus": 0.5},
                  "long_decode": {"replicas": 1, "num_cpus": 0.5}, "mixed": {"replicas": 0}},
        "frontend": {"port": 0, "http_port": 0},
        # Tests that assert which pool serves a request use the threshold policy; test_cluster_api
        # runs the Conductor (the default for three pools).
        "router": {"long_threshold": 256, "policy": "least_loaded"},
        "health": {"interval_s": 0.5, "timeout_s": 10},
        "store": {"capacity_bytes": 32 * 2**20},
        # THINKSERVE_TEST_KV_TRANSPORT=tcp runs the suite with TCP between every pair.
        "kv_transport": os.environ.get("THINKSERVE_TEST_KV_TRANSPORT", "auto"),
    }
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return parse_config(base)


class Deployment:
    def __init__(self, cfg, controller, address):
        self.cfg, self.controller, self.address = cfg, controller, address
        self.client = Client(address)

    def members(self):
        import ray
        return ray.get(self.controller.membership.remote()).members

    def check_integrity(self):
        import ray
        for m in self.members():
            ray.get(m.handle.check_integrity.remote())

    def store_stats(self) -> dict[str, admin_pb2.StoreStatus]:
        """Each node's CPU KV store, by node id, as ``thinkserve status`` reports it (GetStatus)."""
        return {s.node_id: s for s in self.client.status().stores}

    def frontend_state(self, **kw) -> admin_pb2.DebugState:
        """What the router holds (``thinkserve debug``, Admin.GetDebugState)."""
        return self.client.debug_state(**kw)


def start_deployment(cfg):
    from thinkserve.cluster.deploy import deploy
    controller, address = deploy(cfg)
    return Deployment(cfg, controller, address)


def stop_deployment(dep):
    from thinkserve.cluster.deploy import teardown
    dep.client.close()
    teardown(dep.cfg.namespace)


class Load:
    """Requests in flight on background threads; ``results[i]`` = (tokens, final) or the error."""

    def __init__(self, dep, jobs):
        self.dep, self.jobs = dep, jobs
        self.results: dict[int, object] = {}
        self.progress = {i: 0 for i in range(len(jobs))}
        self.threads = [threading.Thread(target=self._one, args=(i,), daemon=True) for i in range(len(jobs))]

    def _one(self, i):
        prompt, kw = self.jobs[i]
        try:
            stream = self.dep.client.inference.Generate(generate_request(prompt, **kw), timeout=300)

            def counted():
                for msg in stream:
                    self.progress[i] += sum(len(d.token_ids) for d in msg.deltas)
                    yield msg
            self.results[i] = collect(counted())
        except grpc.RpcError as e:
            self.results[i] = e

    def start(self):
        for t in self.threads:
            t.start()
        return self

    def wait_progress(self, min_tokens, count, timeout=120):
        deadline = time.monotonic() + timeout
        while sum(1 for v in self.progress.values() if v >= min_tokens) < count:
            assert time.monotonic() < deadline, f"no progress: {self.progress}"
            time.sleep(0.05)

    def join(self, timeout=300):
        for t in self.threads:
            t.join(timeout)
        errors = {i: r for i, r in self.results.items() if isinstance(r, Exception)}
        assert not errors, {i: (e.code(), e.details()) for i, e in errors.items()}
        assert len(self.results) == len(self.jobs), "requests lost"
        return dict(sorted(self.results.items()))


# ----------------------------------------------------------------------------- sockets via /proc
def _listening_tcp() -> dict[str, tuple[str, int]]:
    """socket inode -> (address, port) of every listening TCP socket on this machine."""
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            if cols[3] != "0A":     # TCP_LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out[cols[9]] = (socket.inet_ntop(family, raw), int(hexport, 16))
    return out


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    tree, todo = [root], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            tree.append(c)
            todo.append(c)
    return tree


def listening_sockets(pids) -> list[tuple[str, str, int]]:
    """(process name, address, port) of the listening TCP sockets that ``pids`` hold."""
    listening = _listening_tcp()
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listening:
                found.append((name, *listening[target[8:-1]]))
    return sorted(set(found))


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback
