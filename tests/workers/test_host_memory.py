"""The CPU KV cache on transparent huge pages (workers/host_memory.py): zeroed, aligned, writable,
alive as long as any view of it, and resident only where written."""
from __future__ import annotations

import gc
import resource

import torch

from thinkserve.workers import host_memory
from thinkserve.workers.kv_cache import KVLayout, allocate_kv_cache


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_zeros_are_zero_aligned_to_huge_pages_and_writable():
    t = host_memory.zeros((3, 1000, 1000), torch.float32)
    assert t.shape == (3, 1000, 1000) and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % host_memory.HUGE_PAGE == 0
    assert int(torch.count_nonzero(t)) == 0
    t[1].fill_(2.5)
    assert float(t.sum()) == 2.5 * 1e6


def test_small_tensors_are_plain_torch_allocations():
    t = host_memory.zeros((4, 8), torch.bfloat16)
    assert t.shape == (4, 8) and t.dtype == torch.bfloat16 and int(torch.count_nonzero(t)) == 0


def test_a_view_keeps_the_mapping_alive():
    view = host_memory.zeros((1024, 1024), torch.float32)[7]
    gc.collect()
    view.fill_(1.0)  # would fault if the mapping had been unmapped with its first tensor
    assert float(view.sum()) == 1024.0


def test_cpu_kv_cache_is_resident_only_where_written():
    layout = KVLayout(num_layers=4, num_kv_heads=6, head_dim=32, block_size=16, dtype="float32")
    before = _rss_mib()
    cache = allocate_kv_cache(layout, 10_000, "cpu", huge_pages=True)  # 10,000 blocks: 938 MiB
    assert cache.data_ptr() % host_memory.HUGE_PAGE == 0 and cache.shape == layout.shape(10_000)
    # torch.zeros would have written (and so made resident) all of it
    assert _rss_mib() - before < 64
    cache[:, :, 5].fill_(1.0)
    assert float(cache[:, :, 5].sum()) == cache[:, :, 5].numel() and float(cache[:, :, 6].abs().sum()) == 0.0


def test_the_runner_cache_is_on_huge_pages(tiny_llama_dir):
    from thinkserve.workers.engine import LLMEngine

    eng = LLMEngine.from_pretrained(str(tiny_llama_dir), num_device_blocks=4096, block_size=16)
    assert eng.runner.kv_cache.data_ptr() % host_memory.HUGE_PAGE == 0


def test_prefault_makes_every_page_resident_and_keeps_the_contents():
    layout = KVLayout(num_layers=4, num_kv_heads=6, head_dim=32, block_size=16, dtype="float32")
    cache = allocate_kv_cache(layout, 1_000, "cpu", huge_pages=True)  # 1,000 blocks: 94 MiB
    cache[:, :, 5].fill_(1.5)
    before = _rss_mib()
    host_memory.prefault(cache)
    # all of it but the pages block 5 made resident (a huge page in each of 4 layers x K, V)
    assert _rss_mib() - before > cache.numel() * 4 / 2**20 - 8 * 2 - 4
    assert float(cache[:, :, 5].sum()) == 1.5 * cache[:, :, 5].numel()
    assert float(cache.abs().sum()) == 1.5 * cache[:, :, 5].numel()
    odd = torch.arange(10_000, dtype=torch.float32)[3:]     # not page-aligned
    host_memory.prefault(odd)
    assert torch.equal(odd, torch.arange(3, 10_000, dtype=torch.float32))

