"""The grstack runtime: data, model, training, evaluation, serving and benchmarks.

``__version__`` is the project's one version: pyproject.toml reads it (``dynamic = ["version"]``) and
``grstack --version`` prints it. To release, bump it here and ``appVersion`` in charts/grstack/Chart.yaml
(the Makefile's IMAGE_VERSION and the release workflow read the chart; the examples name that image tag);
tests/runtime/test_packaging.py fails while they differ.
"""

__version__ = "0.1.0"
