#!/usr/bin/env python3
"""Set up thinkserve in ./.venv and run something with it. Needs only python3 (>= 3.10).

    python3 dev.py demo     # set up, then run the local cluster demo on the shipped tiny-reasoner
    python3 dev.py test     # set up, then run the test suite
    python3 dev.py setup    # set up only

Setup is idempotent: it creates .venv once, installs PyTorch (the CPU build where there is no GPU),
then installs thinkserve in editable mode with its test and bench extras, its dependencies at the
versions in constraints.txt (the last green CI run's; THINKSERVE_CONSTRAINTS=none: the newest
that pyproject.toml allows). Set THINKSERVE_TORCH
to override the torch requirement (e.g. "torch==2.5.1"), or THINKSERVE_TORCH_INDEX to point pip
at another wheel index for torch (e.g. https://download.pytorch.org/whl/cpu).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PY = VENV / "bin" / "python"
# The CPU build that this project's machines keep on disk; an unpinned "torch" from PyPI is the
# ~5 GB CUDA build, which a machine without a GPU has no use for.
CPU_TORCH = "torch==2.13.0"
CONSTRAINTS = ROOT / "constraints.txt"
CONSTRAINTS_PYTHON = "3.11"     # the Python its pins were resolved on (its header says so)


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def has_gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


def pip(*args: str) -> None:
    run([str(PY), "-m", "pip", "--disable-pip-version-check", "-q", *args])


def setup() -> None:
    if not PY.exists():
        log(f"creating virtual environment in {VENV}")
        venv.create(VENV, with_pip=True)
    if subprocess.run([str(PY), "-c", "import torch"], capture_output=True).returncode != 0:
        spec = os.environ.get("THINKSERVE_TORCH") or ("torch" if has_gpu() else CPU_TORCH)
        index = os.environ.get("THINKSERVE_TORCH_INDEX")
        log(f"installing {spec} ({'GPU found' if has_gpu() else 'no GPU: CPU build'})")
        pip("install", spec, *(["--index-url", index] if index else []))
    marker = VENV / ".thinkserve-installed"
    constraints = constraints_args()
    stamp = " ".join(str(p.stat().st_mtime) for p in (ROOT / "pyproject.toml", ROOT / "setup.py", CONSTRAINTS)
                     if p.exists()) + (" constrained" if constraints else "")
    if not marker.exists() or marker.read_text() != stamp:
        log("installing thinkserve (editable) with test and bench extras"
            + (f" at the versions in {CONSTRAINTS.name}" if constraints else ""))
        pip("install", "-e", f"{ROOT}[test,bench]", *constraints)
        marker.write_text(stamp)


def constraints_args() -> list[str]:
    """pip's ``-c constraints.txt`` where it applies: not with THINKSERVE_CONSTRAINTS=none, nor on a
    Python other than the one its pins were resolved on (they may lack its wheels)."""
    if os.environ.get("THINKSERVE_CONSTRAINTS", "").lower() == "none" or not CONSTRAINTS.exists():
        return []
    here = subprocess.run([str(PY), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    if here != CONSTRAINTS_PYTHON:
        log(f"python {here}: not using {CONSTRAINTS.name} (resolved on {CONSTRAINTS_PYTHON}); installing the newest "
            "versions pyproject.toml allows")
        return []
    return ["-c", str(CONSTRAINTS)]


def prebuild_native_ops(env: dict) -> None:
    """Compile the engine's native CPU ops here, once, rather than inside the first test or demo
    engine that needs them (where a slow machine's compile would count against that test's time
    limit). A failed build is not fatal: the engine then runs its plain-torch ops, and says so."""
    probe = ("import sys; from thinkserve.workers.decode_kernels import native_module, _native; "
             "m = native_module(); print(_native.get('error', '')) if m is None else None; sys.exit(m is None)")
    log("native CPU ops: building if their sources changed (a few minutes the first time)")
    if subprocess.run([str(PY), "-c", probe], cwd=ROOT, env=env).returncode != 0:
        log("native CPU ops did not build: the engine will use its plain-torch ops")


def main(argv: list[str]) -> int:
    what = argv[0] if argv else "demo"
    if what not in ("demo", "test", "setup"):
        print(__doc__, file=sys.stderr)
        return 2
    setup()
    if what == "setup":
        return 0
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    prebuild_native_ops(env)
    if what == "demo":
        return subprocess.run([str(PY), "-m", "thinkserve.cluster.demo", *argv[1:]], cwd=ROOT, env=env).returncode
    rc = subprocess.run([str(PY), "-m", "pytest", "-q", "-rs", *argv[1:]], cwd=ROOT, env=env).returncode
    return 0 if rc == 5 else rc  # 5: no tests collected (a filtered run), not a failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
