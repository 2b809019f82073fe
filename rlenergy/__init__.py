"""rl-energy-operator shared library: API models, GPU protocol, control algorithms, simulator.

Nothing in this package imports kopf, pynvml, prometheus_client or the Kubernetes client;
import-linter contracts in pyproject.toml enforce it.
"""

from importlib import metadata as _metadata


def _installed_version() -> str:
    """The version of the installed distribution: ``project.version`` of ``pyproject.toml``."""
    try:
        return _metadata.version("rl-energy-operator")
    except _metadata.PackageNotFoundError:
        return "0+unknown"  # a source tree on the path without an install


__version__ = _installed_version()
