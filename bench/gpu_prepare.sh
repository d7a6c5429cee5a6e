#!/usr/bin/env bash
# Run HERE (the CPU machine, with registry access) before the device call: packs what the GPU
# machine lacks for bench/gpu_check.sh into .gpu/ (git-ignored), to be named in the run's carry.
#
# The GPU machine has python3 3.12 with torch (CUDA 13), transformers, pytest, nvcc, and no
# registry. It lacks flashinfer and its import-time need apache-tvm-ffi. flashinfer-python's wheel
# (62 MB) does not fit the 64 MiB a call carries beside the repo, so this keeps what the decode
# path imports and JIT-compiles: every .py file, the templates and headers, and of the CUDA
# sources only batch_decode*; one xz tarball of python3.12 site-packages, ~20-30 MB.
#
#     bash bench/gpu_prepare.sh            # then: run(command="bash bench/gpu_check.sh", carry=[".gpu"])
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHINFER=${FLASHINFER:-0.7.2.post1}   # keep equal to the pin in pyproject.toml's gpu extra
TVM_FFI=${TVM_FFI:-"apache-tvm-ffi<0.2,>=0.1.11"}
PY=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p .gpu "$work/whl" "$work/site"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/whl" \
    "flashinfer-python==$FLASHINFER" "$TVM_FFI"
for w in "$work"/whl/*.whl; do unzip -q -o "$w" -d "$work/site"; done
fi="$work/site/flashinfer"
# Of the CUDA sources only the batch decode kernel's; the prebuilt kernels of other features
# (cubins, .so) are dropped. Headers, templates and every .py stay.
find "$fi/data/csrc" -type f \( -name '*.cu' -o -name '*.cpp' \) ! -name 'batch_decode*' -delete
find "$fi" -path "$fi/data" -prune -o -type f \( -name '*.cubin' -o -name '*.so' -o -name '*.fatbin' \) -print0 \
    | xargs -0 -r rm -f
find "$work/site" -type d -name __pycache__ -prune -exec rm -rf {} +
tar -C "$work/site" -cJf .gpu/site.tar.xz .
ls -la .gpu/site.tar.xz
