"""Fixtures for the cluster tests: one local Ray cluster per session, small deployments per module.

The machine running CI is small (two cores shared with everything else), so deployments are a
handful of single-threaded engine actors on a random two-layer Llama, and every module shuts its
deployment down.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from tiny_llama import build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_cluster")
    build_tiny_llama(path)
    return str(path)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address="local", num_cpus=16, include_dashboard=False, log_to_driver=False, namespace="thinkserve-tests")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Offline greedy outputs of the in-process engine: ``reference(prompt_ids, max_tokens)``."""
    import torch

    from thinkserve.workers.engine import LLMEngine
    from thinkserve.workers.sampling_params import SamplingParams

    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(tiny_model, num_device_blocks=256)
    cache = {}

    def run(prompt, max_tokens, n=1, temperature=0.0, seed=None, ignore_eos=False):
        key = (tuple(prompt) if not isinstance(prompt, str) else prompt, max_tokens, n, temperature, seed, ignore_eos)
        if key not in cache:
            out = engine.generate(prompt, SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature,
                                                         seed=seed, ignore_eos=ignore_eos))[0]
            cache[key] = {o.index: list(o.token_ids) for o in out.outputs}
        return cache[key]
    return run
