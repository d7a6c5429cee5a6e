"""Native CPU ops (decode attention and the fused per-layer ops), and the decode attention
backend chosen once per model runner by name.

``padded``   the plain-torch reference: gather every sequence's K/V through a block table padded
             to the batch's longest context, one SDPA. Cost follows the longest context.
``grouped``  the same ops per context-length bucket (block counts within 2x of each other), so a
             long chain pads only its peers. Pure torch: the fallback when ``native`` cannot build.
``native``   ``csrc/paged_decode.cpp``: reads K/V in place through the block table, each sequence
             costing its own context, work split over threads in key partitions (CPU).
``flashinfer`` FlashInfer's paged decode kernel (CUDA, ``cuda_decode.py``): the same in-place
             read on the GPU; the default on CUDA when ``flashinfer`` imports and the model's
             dtype and head size suit it (fp16/bf16; head_dim 64/128/256), else ``padded``.

``csrc/fused_ops.cpp`` holds the small per-layer ops the model fuses on CPU (``model.py``). All of
``csrc`` is one extension, compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja),
cached under ``workers/csrc/.build`` (git-ignored; ``THINKSERVE_KERNEL_CACHE`` overrides), and a
failed build logs a warning naming the fallback rather than failing or degrading silently.
``THINKSERVE_DECODE_ATTENTION=padded|grouped|native|flashinfer`` forces a backend; ``THINKSERVE_FUSED_OPS=0``
keeps the model on its plain-torch ops (the reference the fused ones are tested against).
With 2+ threads the native ops run on helper threads of their own (``csrc/team.h``), which spin
``THINKSERVE_TEAM_SPIN_US`` (default 1000) after each op or decode step before they sleep.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path

import torch

from . import cuda_decode

log = logging.getLogger(__name__)

BACKENDS = ("padded", "grouped", "native", "flashinfer")
ENV_BACKEND = "THINKSERVE_DECODE_ATTENTION"
ENV_CACHE = "THINKSERVE_KERNEL_CACHE"
ENV_FUSED = "THINKSERVE_FUSED_OPS"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(_CSRC / name for name in ("bindings.cpp", "paged_decode.cpp", "fused_ops.cpp", "gemm.cpp", "layer_blocks.cpp"))
_HEADERS = (_CSRC / "team.h",)  # compiled into the sources above; part of the cache key
_lock = threading.Lock()
_native: dict[str, object] = {}  # "module" or "error" once tried


def select_decode_backend(device: torch.device, requested: str | None = None, dtype: torch.dtype | None = None,
                          head_dim: int | None = None) -> str:
    """The backend a runner on ``device`` uses: ``requested``, else the environment's, else the
    fastest available: ``native`` on CPU; on CUDA ``flashinfer`` where it imports and suits the
    model's ``dtype`` and ``head_dim`` (``cuda_decode.flashinfer_fits``), else ``padded``."""
    name = requested or os.environ.get(ENV_BACKEND) or _default_backend(device, dtype, head_dim)
    if name not in BACKENDS:
        raise ValueError(f"decode attention backend must be one of {BACKENDS}, got {name!r} (from {ENV_BACKEND}?)")
    if name == "native" and device.type != "cpu":
        raise ValueError(f"the native decode kernel is CPU-only; device is {device}")
    if name == "flashinfer" and device.type != "cuda":
        raise ValueError(f"the flashinfer decode kernel is CUDA-only; device is {device}")
    if name == "flashinfer" and dtype is not None and head_dim is not None \
            and not cuda_decode.flashinfer_fits(dtype, head_dim):
        # Its kernels fail mid-step otherwise (on an H200, head_dim 32: "VariableLengthMergeStates:
        # Unsupported head_dim: 32" in the split-KV merge), after the engine has taken requests.
        raise ValueError(f"decode attention backend flashinfer was asked for ({ENV_BACKEND}?), but FlashInfer's "
                         f"decode kernels take dtype in {[str(d) for d in cuda_decode.SUPPORTED_DTYPES]} and head_dim "
                         f"in {list(cuda_decode.SUPPORTED_HEAD_DIMS)}; this model has dtype {dtype}, head_dim "
                         f"{head_dim}: use the padded backend")
    if name == "flashinfer" and cuda_decode.flashinfer_module() is None:
        raise ValueError(f"decode attention backend flashinfer was asked for, but flashinfer does not import "
                         f"({cuda_decode.flashinfer_error()}); install the gpu extra")
    if name == "native" and native_module() is None:
        log.warning("decode attention: native kernel unavailable (%s); using the grouped pure-torch path",
                    _native["error"])
        return "grouped"
    return name


def _default_backend(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    if device.type == "cpu":
        return "native"
    if device.type == "cuda" and dtype is not None and head_dim is not None \
            and cuda_decode.flashinfer_fits(dtype, head_dim):
        if cuda_decode.flashinfer_module() is not None:
            return "flashinfer"
        log.info("decode attention: flashinfer does not import (%s); CUDA decode uses the padded torch path",
                 cuda_decode.flashinfer_error())
    return "padded"


def select_fused_ops(device: torch.device, requested: bool | None = None):
    """The native module whose fused per-layer ops a model on ``device`` uses, or None for the
    plain-torch reference: on request (``requested`` or ``THINKSERVE_FUSED_OPS=0``), off CPU, or
    (with a warning) when the extension does not build."""
    use = requested if requested is not None else os.environ.get(ENV_FUSED, "1") not in ("0", "false", "no")
    if not use or device.type != "cpu":
        return None
    module = native_module()
    if module is None:
        log.warning("fused CPU ops unavailable (%s); the model runs its plain-torch ops", _native["error"])
    elif torch.get_num_threads() > 1 and os.environ.get("OMP_WAIT_POLICY", "").lower() != "passive":
        # The native ops' helper threads are their own (csrc/team.h), not torch's OpenMP workers,
        # which by default spin ~ms after each of torch's parallel ops (prefill attention,
        # sampling) on the core a helper needs: 21% fewer tokens per CPU-second on the peers'
        # reasoner mix at 2 threads. libgomp reads the policy once, when torch is imported.
        log.warning("%d threads and OMP_WAIT_POLICY is not passive: torch's OpenMP workers will spin beside the "
                    "native ops' own threads; set OMP_WAIT_POLICY=passive before torch is imported",
                    torch.get_num_threads())
    return module


def native_module():
    """The compiled extension, building it on first call; None (with the reason kept) on failure."""
    with _lock:
        if "module" in _native:
            return _native["module"]
        if "error" in _native:
            return None
        try:
            _native["module"] = _build()
            return _native["module"]
        except Exception as e:  # noqa: BLE001 — any build or load failure means: use the fallback
            _native["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            return None


def _build():
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip-installed ninja sits beside this interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    flags = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]
    # The name carries the source, flags, CPU and torch version: a cache copied to another machine,
    # or left from an older source, is never loaded by mistake (-march=native is CPU-specific).
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + " ".join(flags).encode() + _cpu_id().encode()
                         + torch.__version__.encode()).hexdigest()[:12]
    name = f"thinkserve_cpu_ops_{key}"
    directory = _cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        log.warning("native CPU ops: compiling the paged-decode kernel and fused ops into %s (once, ~2 min)",
                    directory)
    # -fopenmp at link time resolves to the libgomp.so.1 torch has already loaded (same soname),
    # so at::parallel_for shares torch's thread pool rather than starting a second runtime.
    return cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(directory), verbose=False)


def _cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    local = _CSRC / ".build"
    if os.access(_CSRC, os.W_OK):
        return local
    return Path.home() / ".cache" / "thinkserve" / "kernels"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()
