# syntax=docker/dockerfile:1
# One image per accelerator; the same `grstack` entry point runs the trainer, the ranker, the router and the
# operator (the pods the operator creates run `grstack train ...` / `grstack serve ...`):
#
#   docker build --target cpu    -t ghcr.io/grstack/grstack:0.1.0-cpu .
#   docker build --target cuda   -t ghcr.io/grstack/grstack:0.1.0-cuda .
#   docker build --target ascend -t ghcr.io/grstack/grstack:0.1.0-ascend .
#   docker build --target operator -t ghcr.io/grstack/grstack:0.1.0-operator .   # slim: no torch
#
# `make image` builds them all with whatever builder exists (docker, podman, buildah); the repository and the
# version come from one place: charts/grstack/values.yaml (image.repository) and Chart.yaml (appVersion).
#
# Check an image with the commands the tests run (tests/operator runs them as local processes):
#   docker run --rm ghcr.io/grstack/grstack:0.1.0-cpu --version
#   docker run --rm ghcr.io/grstack/grstack:0.1.0-cpu demo --quick --out /tmp/run
#   docker run --rm ghcr.io/grstack/grstack:0.1.0-operator operator --help
#
# The ready configs (configs/) are package data inside the wheel (grstack/configs in site-packages), found by
# name (`grstack demo`, `bench quality`, the operator's default training config); GRSTACK_CONFIG_DIR
# points elsewhere.
#
# The images run as uid 1000 with a read-only root filesystem in Kubernetes: everything writable (HOME,
# caches, run directories) is a mounted volume. Pick the torch version matching your driver/CANN with
# --build-arg; the defaults are the versions the project is tested with.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
# The CANN base image must match the NPU driver on the nodes; torch_npu pins the torch version it supports.
ARG CANN_IMAGE=ascendai/cann:8.1.rc1-910b-ubuntu22.04-py3.11
ARG ASCEND_TORCH_VERSION=2.5.1
ARG TORCH_NPU_VERSION=2.5.1

# --- the grstack wheel (pure Python, configs included; built once, installed into every target) ----------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY configs ./configs
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
RUN pip wheel --no-deps --wheel-dir /dist .

# --- CPU: torch from the CPU index (a bare `torch` would pull the multi-GB CUDA build) --------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[train,serve,operator]" && rm -rf /dist
ENV HOME=/tmp PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack
USER 1000:1000
ENTRYPOINT ["grstack"]

# --- CUDA: torch's CUDA wheels bundle the CUDA runtime; the node's driver comes in via the NVIDIA runtime --
FROM ${PYTHON_IMAGE} AS cuda
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" triton
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[train,serve,operator,gpu]" && rm -rf /dist
ENV HOME=/tmp PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack
USER 1000:1000
ENTRYPOINT ["grstack"]

# --- Ascend: CANN base image + torch_npu (hccl backend); the device plugin exposes huawei.com/Ascend910 ---
FROM ${CANN_IMAGE} AS ascend
ARG ASCEND_TORCH_VERSION
ARG TORCH_NPU_VERSION
USER root
RUN pip install --no-cache-dir "torch==${ASCEND_TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir "torch_npu==${TORCH_NPU_VERSION}"
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[train,serve,operator]" && rm -rf /dist
ENV HOME=/tmp PYTHONUNBUFFERED=1
RUN (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack)
USER 1000:1000
ENTRYPOINT ["grstack"]

# --- operator: the kopf operator only, no torch (the operator never imports it; see the import contracts) --
FROM ${PYTHON_IMAGE} AS operator
COPY --from=wheel /dist /dist
# The core dependencies and the operator extra only: no torch.
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[operator]" && rm -rf /dist
ENV HOME=/tmp PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack
USER 1000:1000
ENTRYPOINT ["grstack"]
