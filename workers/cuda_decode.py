"""CUDA decode attention through FlashInfer's paged decode kernel (``flashinfer`` backend).

FlashInfer reads K/V in place through a CSR page list, any page size, and our cache needs no
copy or re-layout: a layer's ``kv_cache[layer, 0]`` is FlashInfer's "NHD" K pages
``[num_pages, page_size, num_kv_heads, head_dim]`` and ``kv_cache[layer, 1]`` the V pages, passed
as a ``(k, v)`` tuple. (flash-attn's ``flash_attn_with_kvcache`` reads the same layout through a
block table, but wants pages of a multiple of 256 tokens; our blocks are 16.)

The page list of a decode batch, built from its block tables on the host (plain torch)::

    block tables  [[7, 2, 9], [4], [5, 6]]     block_size 4, context lens [10, 3, 8]
    indptr        [0, 3, 4, 6]                 seq b owns indices[indptr[b]:indptr[b+1]]
    indices       [7, 2, 9, 4, 5, 6]           its pages, in order
    last_page_len [2, 3, 4]                    valid slots of its last page (1..block_size)

The kernel is planned once per step (``plan``: host-side split of the work, copies the page list
into its buffers) and run once per layer. FlashInfer is imported lazily: never on CPU, never
unless this backend is selected. Its kernels take fp16/bf16 K/V; fp32 stays on the plain-torch
reference (``attention.py``), as does every prefill chunk.

Tested in its metadata on CPU (``tests/workers/test_cuda_decode.py``) and run on an H200
(``tests/workers/test_cuda_decode_gpu.py`` through ``bench/gpu_check.sh``, 2026-12-04): fp16 tokens
equal the padded reference's up to near ties; head sizes outside ``SUPPORTED_HEAD_DIMS`` fail
inside FlashInfer (head_dim 32: its split-KV merge), so a forced backend is refused for them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# FlashInfer's decode kernels: half-precision K/V and these head sizes (what its wheels prebuild
# and vLLM / SGLang run); anything else stays on the reference unless the backend is forced.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended split-k workspace

_flashinfer: dict[str, object] = {}  # "module" or "error" once tried


def flashinfer_module():
    """``flashinfer``, imported on first call; None (reason kept, see ``flashinfer_error``) when it
    is not installed or does not import."""
    if "module" in _flashinfer:
        return _flashinfer["module"]
    if "error" in _flashinfer:
        return None
    try:
        import flashinfer  # noqa: PLC0415 — lazy: a CUDA-only dependency (the ``gpu`` extra)

        _flashinfer["module"] = flashinfer
        return flashinfer
    except Exception as e:  # noqa: BLE001 — any import failure means: the reference path
        _flashinfer["error"] = f"{type(e).__name__}: {e}"
        return None


def flashinfer_error() -> str | None:
    return _flashinfer.get("error")  # type: ignore[return-value]


def flashinfer_fits(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether FlashInfer is the default decode backend for a CUDA model of this dtype and head size."""
    return dtype in SUPPORTED_DTYPES and head_dim in SUPPORTED_HEAD_DIMS


@dataclass
class PagedKVIndex:
    """A decode batch's pages in FlashInfer's CSR form (all int32; see the module docstring)."""

    indptr: torch.Tensor  # [B + 1]
    indices: torch.Tensor  # [indptr[-1]]
    last_page_len: torch.Tensor  # [B], in 1..block_size

    def to(self, device: torch.device) -> "PagedKVIndex":
        return PagedKVIndex(self.indptr.to(device), self.indices.to(device), self.last_page_len.to(device))


def paged_kv_index(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> PagedKVIndex:
    """The CSR page list of a decode batch from its padded block tables ``[B, W]`` (int64; columns
    past a sequence's pages are padding) and its context lengths ``[B]`` (this step's token
    included, so every one is >= 1). Plain torch on the tables' device (the host, per step)."""
    if context_lens.ndim != 1 or block_tables.ndim != 2 or block_tables.shape[0] != context_lens.shape[0]:
        raise ValueError(f"block_tables [B, W] and context_lens [B] disagree: {tuple(block_tables.shape)}, "
                         f"{tuple(context_lens.shape)}")
    if context_lens.numel() and int(context_lens.min()) < 1:
        raise ValueError("every decoding sequence has at least its own token in context")
    pages = (context_lens + block_size - 1) // block_size  # [B] pages each sequence reads
    if pages.numel() and int(pages.max()) > block_tables.shape[1]:
        raise ValueError(f"a context needs {int(pages.max())} pages, the tables hold {block_tables.shape[1]}")
    indptr = torch.zeros(context_lens.shape[0] + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    #  row-major keep-mask over the table: column j of row b is a page of b iff j < pages[b]
    owned = torch.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = block_tables[owned].to(torch.int32)
    last_page_len = (context_lens - (pages - 1) * block_size).to(torch.int32)
    return PagedKVIndex(indptr, indices, last_page_len)


class FlashInferDecode:
    """One FlashInfer decode wrapper: ``plan`` once per step, then ``run`` per layer.

    Eager mode plans any batch size. Graph mode (``graph_batch_size``) keeps the page list in
    buffers of fixed addresses, as a captured CUDA graph needs, for batches of exactly that size
    and up to ``max_pages`` pages in all (``cuda_graphs.py`` pads the batch)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, scale: float, *, workspace: torch.Tensor | None = None,
                 graph_batch_size: int | None = None, max_pages: int = 0):
        flashinfer = flashinfer_module()
        if flashinfer is None:
            raise RuntimeError(f"flashinfer decode backend: the package does not import ({flashinfer_error()}); "
                               "install the gpu extra, or set THINKSERVE_DECODE_ATTENTION=padded")
        self.dtype, self.num_heads, self.num_kv_heads, self.head_dim = dtype, num_heads, num_kv_heads, head_dim
        self.block_size, self.scale = block_size, scale
        self.workspace = workspace if workspace is not None else torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8,
                                                                             device=device)
        kwargs = {}
        if graph_batch_size is not None:
            kwargs = dict(use_cuda_graph=True,
                          paged_kv_indptr_buffer=torch.zeros(graph_batch_size + 1, dtype=torch.int32, device=device),
                          paged_kv_indices_buffer=torch.zeros(max_pages, dtype=torch.int32, device=device),
                          paged_kv_last_page_len_buffer=torch.zeros(graph_batch_size, dtype=torch.int32, device=device))
        # Tensor cores pay off once several query heads share a KV head (vLLM's rule of thumb: > 4).
        # backend "fa2": the CSR page-list kernels, on every architecture from sm75; "auto" may pick
        # cuDNN or TRT-LLM kernels on Blackwell, which under graphs want a fixed block table instead.
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=num_heads // num_kv_heads > 4, backend="fa2", **kwargs)

    def plan(self, index: PagedKVIndex) -> "FlashInferDecode":
        """Plans this step's batch (host work, no kernel runs); returns self for ``DecodeGroup.kernel``."""
        self.wrapper.plan(index.indptr, index.indices, index.last_page_len, self.num_heads, self.num_kv_heads,
                          self.head_dim, self.block_size, q_data_type=self.dtype, kv_data_type=self.dtype,
                          sm_scale=self.scale)
        return self

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D], one layer's K and V pages [num_blocks, block_size, Hkv, D] -> [B, Hq * D]."""
        # q is a slice of the fused qkv projection (rows strided by the k/v heads): made dense,
        # a few KiB, rather than relying on the kernel's stride support.
        return self.wrapper.run(q.contiguous(), (k_cache, v_cache)).reshape(q.shape[0], -1)
