"""Decode attention backends, chosen once per model runner by name.

``padded``   the plain-torch reference: gather every sequence's K/V through a block table padded
             to the batch's longest context, one SDPA. Cost follows the longest context.
``grouped``  the same ops per context-length bucket (block counts within 2x of each other), so a
             long chain pads only its peers. Pure torch: the fallback when ``native`` cannot build.
``native``   ``csrc/paged_decode.cpp``: reads K/V in place through the block table, each sequence
             costing its own context, work split over threads in key partitions (CPU).

The native kernel is compiled on first use with ``torch.utils.cpp_extension`` (g++ and ninja),
cached under ``workers/csrc/.build`` (git-ignored; ``THINKSERVE_KERNEL_CACHE`` overrides), and a
failed build logs a warning naming the fallback rather than failing or degrading silently.
``THINKSERVE_DECODE_ATTENTION=padded|grouped|native`` forces a backend.
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

log = logging.getLogger(__name__)

BACKENDS = ("padded", "grouped", "native")
ENV_BACKEND = "THINKSERVE_DECODE_ATTENTION"
ENV_CACHE = "THINKSERVE_KERNEL_CACHE"
_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.cpp"
_lock = threading.Lock()
_native: dict[str, object] = {}  # "module" or "error" once tried


def select_decode_backend(device: torch.device, requested: str | None = None) -> str:
    """The backend a runner on ``device`` uses: ``requested``, else the environment's, else the
    fastest available. CUDA keeps ``padded`` (its SDPA kernels are the measured path there)."""
    name = requested or os.environ.get(ENV_BACKEND) or ("native" if device.type == "cpu" else "padded")
    if name not in BACKENDS:
        raise ValueError(f"decode attention backend must be one of {BACKENDS}, got {name!r} (from {ENV_BACKEND}?)")
    if name == "native" and device.type != "cpu":
        raise ValueError(f"the native decode kernel is CPU-only; device is {device}")
    if name == "native" and native_module() is None:
        log.warning("decode attention: native kernel unavailable (%s); using the grouped pure-torch path",
                    _native["error"])
        return "grouped"
    return name


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
    flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
    # The name carries the source, flags, CPU and torch version: a cache copied to another machine,
    # or left from an older source, is never loaded by mistake (-march=native is CPU-specific).
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode() + _cpu_id().encode()
                         + torch.__version__.encode()).hexdigest()[:12]
    name = f"thinkserve_paged_decode_{key}"
    directory = _cache_dir() / name
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / f"{name}.so").exists():
        log.warning("decode attention: compiling the native paged-decode kernel into %s (once, ~1 min)", directory)
    # -fopenmp at link time resolves to the libgomp.so.1 torch has already loaded (same soname),
    # so at::parallel_for shares torch's thread pool rather than starting a second runtime.
    return cpp_extension.load(name=name, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=str(directory), verbose=False)


def _cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE])
    local = _SOURCE.parent / ".build"
    if os.access(_SOURCE.parent, os.W_OK):
        return local
    return Path.home() / ".cache" / "thinkserve" / "kernels"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() or platform.machine()
