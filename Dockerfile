# syntax=docker/dockerfile:1.7
# fxport images, one Dockerfile, three targets:
#   api         gRPC API server: the [server] extra, no torch (the API never loads a model)
#   worker-cpu  Celery worker for queue "cpu": the [worker] extra with the CPU build of torch
#   worker-gpu  Celery worker for queue "gpu": on NVIDIA's TensorRT image (TensorRT comes from there)
#
#   docker build --target api        -t REGISTRY/fxport-api:0.1.0 .
#   docker build --target worker-cpu -t REGISTRY/fxport-worker-cpu:0.1.0 .
#   docker build --target worker-gpu -t REGISTRY/fxport-worker-gpu:0.1.0 .
#
# Builder stages make a virtualenv under /opt/venv; final stages copy that venv and nothing
# else, so pip caches, the source tree and build-only wheels stay behind.
#
# Base images are pinned by tag below. A release build also pins the digest, resolved once
# and recorded next to the release:
#   docker buildx imagetools inspect python:3.11-slim-bookworm --format '{{json .Manifest.Digest}}'
#   docker build --build-arg PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:<digest> ...
# (same for TENSORRT_IMAGE). The digest is not written here because it cannot be checked
# from the machine this file is maintained on (no registry access); a wrong digest would
# fail every build.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# TensorRT container 25.12: Ubuntu 24.04, Python 3.12, CUDA 13.0. When changing the tag,
# keep TORCH_CUDA_INDEX on the same CUDA major version.
ARG TENSORRT_IMAGE=nvcr.io/nvidia/tensorrt:25.12-py3
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu130
# Numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
ARG FXPORT_UID=10001
# Graphviz for the report's graph drawings: 2.42 in Debian 12 (CPU image) and Ubuntu 24.04 (TensorRT image).
ARG GRAPHVIZ_VERSION=2.42.*


# ---------------------------------------------------------------- builders (CPU base)
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Only what the distribution is built from; .dockerignore keeps the rest out of the context.
COPY pyproject.toml README.md ./
COPY fxport ./fxport
COPY service ./service
COPY workers ./workers
COPY client ./client
COPY cli ./cli
COPY proto ./proto

FROM build-base AS build-api
RUN pip install "./[server,tracing]"

FROM build-base AS build-worker-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
# torch first, from the CPU index: the [worker] extra pins torch==2.13.0, which the
# 2.13.0+cpu wheel satisfies, so the second install keeps it instead of pulling CUDA.
RUN pip install --index-url "${TORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install "./[worker,tracing]"


# ---------------------------------------------------------------- runtime (CPU base)
FROM ${PYTHON_IMAGE} AS runtime-cpu
ARG FXPORT_UID
RUN groupadd --system --gid "${FXPORT_UID}" fxport \
 && useradd --system --uid "${FXPORT_UID}" --gid fxport --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin fxport
# HOME and caches point at /tmp: the pods run with a read-only root filesystem and an
# emptyDir on /tmp.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache
WORKDIR /tmp
ENTRYPOINT ["fxport"]


FROM runtime-cpu AS api
COPY --from=build-api /opt/venv /opt/venv
USER ${FXPORT_UID}:${FXPORT_UID}
# 50051 gRPC (+ grpc.health.v1), 9100 Prometheus metrics
EXPOSE 50051 9100
CMD ["serve", "--listen", "0.0.0.0:50051"]


# Graphviz's `dot` lays out the FX graph drawings of every job's report.html (the worker draws
# the report; the sandboxed engine may not start processes).
FROM runtime-cpu AS runtime-worker-cpu
ARG GRAPHVIZ_VERSION
RUN apt-get update \
 && apt-get install -y --no-install-recommends "graphviz=${GRAPHVIZ_VERSION}" \
 && rm -rf /var/lib/apt/lists/*


FROM runtime-worker-cpu AS worker-cpu
COPY --from=build-worker-cpu /opt/venv /opt/venv
USER ${FXPORT_UID}:${FXPORT_UID}
EXPOSE 9100
CMD ["worker", "--queues", "cpu"]


# ---------------------------------------------------------------- GPU worker
# Built on the TensorRT image itself so the venv's Python is the image's Python and the
# venv sees the image's TensorRT bindings (--system-site-packages). --without-pip: the image
# has no ensurepip; the image's own pip installs into the venv with --python.
FROM ${TENSORRT_IMAGE} AS build-worker-gpu
ARG TORCH_VERSION
ARG TORCH_CUDA_INDEX
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fxport ./fxport
COPY service ./service
COPY workers ./workers
COPY client ./client
COPY cli ./cli
COPY proto ./proto
RUN python3 -m venv --without-pip --system-site-packages /opt/venv \
 && python3 -m pip --python /opt/venv/bin/python install --index-url "${TORCH_CUDA_INDEX}" "torch==${TORCH_VERSION}" \
 && python3 -m pip --python /opt/venv/bin/python install "./[worker,tracing]" \
 && /opt/venv/bin/python -c "import tensorrt, torch; print('tensorrt', tensorrt.__version__, 'torch', torch.__version__)"

# NVIDIA's image is a development image (it ships compilers we cannot strip without
# breaking it); what we add is only the venv and an unprivileged user.
FROM ${TENSORRT_IMAGE} AS runtime-worker-gpu
ARG FXPORT_UID
ARG GRAPHVIZ_VERSION
RUN groupadd --system --gid "${FXPORT_UID}" fxport \
 && useradd --system --uid "${FXPORT_UID}" --gid fxport --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin fxport \
 && apt-get update \
 && apt-get install -y --no-install-recommends "graphviz=${GRAPHVIZ_VERSION}" \
 && rm -rf /var/lib/apt/lists/*

FROM runtime-worker-gpu AS worker-gpu
COPY --from=build-worker-gpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache
WORKDIR /tmp
USER ${FXPORT_UID}:${FXPORT_UID}
EXPOSE 9100
ENTRYPOINT ["fxport"]
CMD ["worker", "--queues", "gpu"]
