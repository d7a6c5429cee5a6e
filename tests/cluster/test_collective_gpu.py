"""``kv_transport: collective`` between GPU instances: page sets move over NCCL pair groups
(each instance's engine on its own GPU; NCCL refuses two ranks on one device, hence two GPUs).
Outputs must equal the offline engine's and KV must have moved over the collective transport."""
from __future__ import annotations

import pytest
import torch
from cluster_helpers import cluster_config, start_deployment, stop_deployment, wait_kv_free

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                                  reason="needs two CUDA GPUs")]


def test_nccl_pair_groups_carry_the_handoff(ray_session, tiny_model, reference):
    cfg = cluster_config(tiny_model, kv_transport="collective", engine={"device": "cuda", "num_device_blocks": 96},
                         pools={"prefill": {"replicas": 1, "num_cpus": 0.5, "num_gpus": 1},
                                "short_decode": {"replicas": 1, "num_cpus": 0.5, "num_gpus": 1},
                                "long_decode": {"replicas": 0}, "mixed": {"replicas": 0}})
    dep = start_deployment(cfg)
    try:
        for prompt in ("hello world", "12+34="):
            tokens, final = dep.client.generate(prompt, max_tokens=24, ignore_eos=True)
            assert tokens[0] == reference(prompt, 24, ignore_eos=True)[0]
        counters = dep.frontend_state().counters
        assert counters.kv_collective.sends >= 2 and counters.kv_tcp.sends == 0
        wait_kv_free(dep.client)
        dep.check_integrity()
    finally:
        stop_deployment(dep)
