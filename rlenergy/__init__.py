"""rl-energy-operator shared library: API models, GPU protocol, control algorithms, simulator.

Nothing in this package imports kopf, pynvml, prometheus_client or the Kubernetes client;
import-linter contracts in pyproject.toml enforce it.
"""

__version__ = "0.1.0"
