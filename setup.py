"""Maps the project's top-level folders onto the ``thinkserve`` namespace.

The repository keeps one folder per layer at the top (``workers/``, ``kvtransfer/``, ``router/``,
``cluster/``, ``protos/``); installed, they are ``thinkserve.workers`` and so on, so nothing
generic like ``router`` lands in site-packages.
"""
from setuptools import find_packages, setup

LAYERS = ["workers", "kvtransfer", "router", "cluster", "protos"]

packages = []
package_dir = {}
for layer in LAYERS:
    package_dir[f"thinkserve.{layer}"] = layer
    packages.append(f"thinkserve.{layer}")
    packages += [f"thinkserve.{layer}.{sub}" for sub in find_packages(layer)]

setup(
    packages=packages,
    package_dir=package_dir,
    package_data={
        "thinkserve.workers": ["models/tiny_reasoner/*", "csrc/*.cpp"],
        "thinkserve.protos": ["thinkserve/v1/*.proto"],
        "thinkserve.cluster.sim": ["cpu_fit.json"],
    },
    include_package_data=True,
)
