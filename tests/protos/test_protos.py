import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_the_protos(tmp_path):
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("generate", ROOT / "protos" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = gen.generate(tmp_path)
    assert written
    for path in written:
        committed = ROOT / "protos" / path.relative_to(tmp_path)
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run python protos/generate.py"


def test_package_imports_and_services():
    from thinkserve.protos.thinkserve.v1 import admin_pb2, inference_pb2

    assert inference_pb2.DESCRIPTOR.package == "thinkserve.v1"
    assert set(inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name) == {"Generate", "Abort"}
    assert set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name) == {
        "GetStatus", "ScalePool", "DrainInstance", "GetDebugState"}
    assert inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"].server_streaming
