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
#   docker run --rm ghcr.io/grstack/grstack:0.1.0-cpu train --config /opt/grstack/configs/synthetic-tiny-hstu.yaml \
#       --set train.max_steps=20 --out /tmp/run
#   docker run --rm ghcr.io/grstack/grstack:0.1.0-cpu operator --help
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

# --- the grstack wheel (pure Python; built once, installed into every target) ---------------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
RUN pip wheel --no-deps --wheel-dir /dist .

# --- CPU: torch from the CPU index (a bare `torch` would pull the multi-GB CUDA build) --------------------
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[serve,operator]" && rm -rf /dist
COPY configs /opt/grstack/configs
ENV GRSTACK_CONFIG_DIR=/opt/grstack/configs HOME=/tmp PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack
USER 1000:1000
ENTRYPOINT ["grstack"]

# --- CUDA: torch's CUDA wheels bundle the CUDA runtime; the node's driver comes in via the NVIDIA runtime --
FROM ${PYTHON_IMAGE} AS cuda
ARG TORCH_VERSION
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" triton
COPY --from=wheel /dist /dist
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[serve,operator,gpu]" && rm -rf /dist
COPY configs /opt/grstack/configs
ENV GRSTACK_CONFIG_DIR=/opt/grstack/configs HOME=/tmp PYTHONUNBUFFERED=1
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
RUN pip install --no-cache-dir "$(ls /dist/grstack-*.whl)[serve,operator]" && rm -rf /dist
COPY configs /opt/grstack/configs
ENV GRSTACK_CONFIG_DIR=/opt/grstack/configs HOME=/tmp PYTHONUNBUFFERED=1
RUN (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack)
USER 1000:1000
ENTRYPOINT ["grstack"]

# --- operator: the kopf operator only, no torch (the operator never imports it; see the import contracts) --
FROM ${PYTHON_IMAGE} AS operator
COPY --from=wheel /dist /dist
# --no-deps: the wheel's own dependencies include torch; the operator needs only these.
RUN pip install --no-cache-dir --no-deps "$(ls /dist/grstack-*.whl)" && rm -rf /dist \
    && pip install --no-cache-dir "kopf>=1.37" "kubernetes>=29" "aiohttp>=3.9" "pydantic>=2.6" "pyyaml>=6" \
       "prometheus-client>=0.20"
COPY configs /opt/grstack/configs
ENV GRSTACK_CONFIG_DIR=/opt/grstack/configs HOME=/tmp PYTHONUNBUFFERED=1
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp grstack
USER 1000:1000
ENTRYPOINT ["grstack"]
