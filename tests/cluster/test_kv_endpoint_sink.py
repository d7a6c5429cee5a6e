"""The cluster's receiving sink exposes the engine's host cache through the engine lock wrapper,
so instance-to-instance transfers land straight in the blocks (a missing method once made every
cluster transfer fail and wait out its timeout)."""
from __future__ import annotations

import threading

from thinkserve.cluster.kv_endpoint import InstanceSink, LockedEngine
from thinkserve.workers.engine import LLMEngine


class _Host:  # the attributes LockedEngine and InstanceSink read
    def __init__(self, engine):
        self.engine = engine
        self.lock = threading.RLock()
        self.admitting = True
        self.parts = set()
        self.instance_id = "test-0"


def test_instance_sink_exposes_the_cpu_engine_cache(tiny_model):
    engine = LLMEngine.from_pretrained(tiny_model, num_device_blocks=32, block_size=4)
    host = _Host(engine)
    cache = InstanceSink(host).host_cache()
    assert cache is not None and cache.data_ptr() == engine.runner.kv_cache.data_ptr()
    for name in LockedEngine._METHODS:  # every allowed method exists on the engine
        assert callable(getattr(engine, name)), name
