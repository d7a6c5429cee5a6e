"""Named hardware and model shapes the simulator's cost model is built from.

Every figure is a named constant with its source. Datasheet peaks are not what kernels reach, so
the roofline scales them by the efficiency constants at the bottom (assumptions, stated as such:
no GPU is available to this project to profile them the way Vidur does).
"""
from __future__ import annotations

from dataclasses import dataclass

GB = 1e9


@dataclass(frozen=True)
class GpuKind:
    name: str
    hbm_bytes: float          # device memory
    hbm_bw: float             # bytes/s
    bf16_flops: float         # dense bf16 FLOP/s (no sparsity)
    nvlink_bw: float          # bytes/s, one direction, GPU to GPU inside a node
    network_bw: float         # bytes/s, one InfiniBand port per GPU, between nodes
    pcie_bw: float            # bytes/s, one direction, host <-> GPU
    gpus_per_node: int = 8


# NVIDIA H200 SXM datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s dense bf16, NVLink 900 GB/s
# (450 each way); InfiniBand NDR 400 Gb/s = 50 GB/s per port; PCIe Gen5 x16 ~64 GB/s each way.
H200 = GpuKind("h200", 141 * GB, 4.8e12, 989e12, 450 * GB, 50 * GB, 64 * GB)
# NVIDIA H100 SXM5 datasheet: 80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense bf16, NVLink 900 GB/s.
H100 = GpuKind("h100", 80 * GB, 3.35e12, 989e12, 450 * GB, 50 * GB, 64 * GB)
# NVIDIA A100 SXM4 80GB datasheet: 2.039 TB/s, 312 TFLOP/s bf16, NVLink 600 GB/s (300 each way);
# InfiniBand HDR 200 Gb/s = 25 GB/s; PCIe Gen4 x16 ~32 GB/s each way.
A100 = GpuKind("a100", 80 * GB, 2.039e12, 312e12, 300 * GB, 25 * GB, 32 * GB)

GPU_KINDS = {g.name: g for g in (H200, H100, A100)}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: float         # all weights, embeddings included
    dtype_bytes: int = 2      # bf16
    tensor_parallel: int = 1  # GPUs one engine instance spans
    max_model_len: int = 32768

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, whole model (an instance's TP shards split it)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def attn_flops_per_ctx_token(self) -> float:
        """FLOPs one new token spends attending to one cached token (QK^T and PV, all layers)."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim


# Shapes from the models' config.json files (Hugging Face): Qwen/Qwen2.5-7B-Instruct (and
# DeepSeek-R1-Distill-Qwen-7B, the same shape), meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B.
QWEN25_7B = ModelShape("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, 7.62e9)
LLAMA3_8B = ModelShape("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8.03e9, max_model_len=8192)
LLAMA3_70B = ModelShape("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 70.6e9, tensor_parallel=4,
                        max_model_len=8192)
# The project's own model (workers/models/tiny_reasoner/config.json), float32 on CPU.
TINY_REASONER = ModelShape("tiny-reasoner", 4, 192, 6, 6, 32, 768, 64, 2.38e6, dtype_bytes=4,
                           max_model_len=1536)

MODELS = {m.name: m for m in (QWEN25_7B, LLAMA3_8B, LLAMA3_70B, TINY_REASONER)}

# ---- assumptions (not datasheet figures) ---------------------------------------------------
# Fraction of peak HBM bandwidth decode kernels reach (paged attention + GEMV): ~80% is what
# vLLM/FlashInfer report on H100 for large batches.
HBM_EFFICIENCY = 0.80
# Model FLOP utilisation of prefill GEMMs: 60% is typical of well-tuned bf16 prefill.
FLOPS_EFFICIENCY = 0.60
# Per-step fixed cost of an engine step on a GPU (scheduler, sampler, launch; CUDA graphs on).
GPU_STEP_OVERHEAD_S = 0.002
# Fixed cost of one KV page-set transfer (handshake, registration) on top of bytes / bandwidth.
GPU_TRANSFER_LATENCY_S = 0.0005
# Fraction of device memory the engine may use (vLLM's gpu_memory_utilization default).
GPU_MEMORY_UTILIZATION = 0.90
