import importlib.util
from importlib.metadata import version
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
        assert committed.read_text() == path.read_text(), (
            f"{committed} differs from the stubs grpcio-tools {version('grpcio-tools')} writes: run "
            "python protos/generate.py with the grpcio-tools pinned in pyproject.toml's test extra")


def test_package_imports_and_services():
    from thinkserve.protos.thinkserve.v1 import admin_pb2, inference_pb2

    assert inference_pb2.DESCRIPTOR.package == "thinkserve.v1"
    assert set(inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name) == {"Generate", "Abort"}
    assert set(admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name) == {
        "GetStatus", "ScalePool", "DrainInstance", "GetDebugState"}
    assert inference_pb2.DESCRIPTOR.services_by_name["Inference"].methods_by_name["Generate"].server_streaming


def test_the_generator_pin_is_the_stubs_grpcio_floor():
    """The stubs refuse a grpcio older than the generator that wrote them: pyproject's grpcio floor,
    the pinned grpcio-tools and the version stamped in the committed stubs must be one version."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    floor = next(d for d in project["dependencies"] if d.startswith("grpcio>="))
    pin = next(d for d in project["optional-dependencies"]["test"] if d.startswith("grpcio-tools"))
    assert pin.startswith("grpcio-tools=="), f"grpcio-tools must be pinned, not {pin!r}"
    stamped = {re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", p.read_text()).group(1)
               for p in (ROOT / "protos" / "thinkserve" / "v1").glob("*_pb2_grpc.py")}
    assert stamped == {pin.split("==")[1]} == {floor.split(">=")[1]}
