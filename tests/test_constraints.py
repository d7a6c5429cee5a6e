"""``constraints.txt``: the versions ``python3 dev.py setup`` installs the dependencies at (the last
green CI run's). Every pin must satisfy pyproject.toml, and every direct requirement but torch
(dev.py installs it) must be pinned, or a release upstream can still change what CI runs."""
from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line.strip())
            assert m, f"constraints.txt: {line!r} is not a name==version pin"
            out[canonicalize_name(m[1])] = m[2]
    return out


def test_every_direct_requirement_is_pinned_within_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = [Requirement(r) for r in (*project["dependencies"], *extras["test"], *extras["bench"])]
    pinned = pins()
    assert "torch" not in pinned
    for req in reqs:
        name = canonicalize_name(req.name)
        if name == "torch":
            continue
        assert name in pinned, f"{req.name} is required (pyproject.toml) but not pinned in constraints.txt"
        assert req.specifier.contains(pinned[name], prereleases=True), (
            f"constraints.txt pins {req.name}=={pinned[name]}, outside pyproject.toml's {req}")


def test_dev_py_uses_them_unless_told_not_to(monkeypatch):
    spec = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    dev = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dev)
    if not dev.PY.exists():
        pytest.skip("no .venv (dev.py setup makes it)")
    here = "%d.%d" % sys.version_info[:2]
    monkeypatch.setenv("THINKSERVE_CONSTRAINTS", "none")
    assert dev.constraints_args() == []
    monkeypatch.delenv("THINKSERVE_CONSTRAINTS")
    expected = ["-c", str(ROOT / "constraints.txt")] if here == dev.CONSTRAINTS_PYTHON else []
    assert dev.constraints_args() == expected
