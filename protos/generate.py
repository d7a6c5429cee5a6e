"""Regenerate the Python stubs of ``protos/thinkserve/v1/*.proto``.

    python protos/generate.py        # needs grpcio-tools (the ``test`` extra)

protoc names generated imports after the proto path (``from thinkserve.v1 import common_pb2``);
installed, these modules live at ``thinkserve.protos.thinkserve.v1``, so the imports are rewritten.
The generated files are committed: serving needs only grpcio and protobuf, not grpcio-tools.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent          # contains thinkserve/v1/*.proto
OUT_DIR = PROTO_ROOT / "thinkserve" / "v1"
IMPORT_RE = re.compile(r"^from thinkserve\.v1 import (\w+) as (\w+)$", re.MULTILINE)
PYI_IMPORT_RE = re.compile(r"^from thinkserve\.v1 import (\w+)", re.MULTILINE)


def _rewrite(path: Path) -> None:
    text = path.read_text()
    text = IMPORT_RE.sub(r"from thinkserve.protos.thinkserve.v1 import \1 as \2", text)
    text = PYI_IMPORT_RE.sub(r"from thinkserve.protos.thinkserve.v1 import \1", text)
    path.write_text(text)


def generate(out_root: Path = PROTO_ROOT) -> list[Path]:
    """Write the stubs under ``out_root/thinkserve/v1`` (the repository by default)."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(OUT_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"   # google/protobuf/*.proto
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{include}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *(str(p.relative_to(PROTO_ROOT)) for p in protos)]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out_dir = Path(out_root) / "thinkserve" / "v1"
    written = sorted(out_dir.glob("*_pb2*.py")) + sorted(out_dir.glob("*_pb2.pyi"))
    for path in written:
        _rewrite(path)
    return written


if __name__ == "__main__":
    for p in generate():
        print(p.relative_to(PROTO_ROOT.parent))
    sys.exit(0)
