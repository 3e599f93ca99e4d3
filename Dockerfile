# syntax=docker/dockerfile:1
# flashtier: the serving daemon on a CUDA base image (docs/operations.md, "Container").
# This image is not built or run by the project's CI (no Docker engine there): tests/deploy/test_container_files.py
# parses this file with BuildKit's parser and checks its settings against the CLI, nothing more.
#
#   docker build -t flashtier:0.1.0 .
#   docker run --gpus all -p 127.0.0.1:8000:8000 -v /models/DeepSeek-V4.1-Flash:/models:ro \
#       -v flashtier-kv:/var/lib/flashtier/kv -e FLASHTIER_API_KEY=... flashtier:0.1.0
#
# Settings come from FLASHTIER_* variables (every `flashtier serve` flag has one: docs/settings.md) or from
# flags after the image name. The model directory is the volume at /models; without one, set
# FLASHTIER_MODEL_DIR= (empty) to serve the demo model.
FROM nvidia/cuda:13.0.0-base-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
# Python 3.12 and a C compiler: Triton compiles its small launcher modules with the system compiler at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/flashtier \
    PATH=/opt/flashtier/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python3 -m venv /opt/flashtier

# The install is the lock, exactly (docs/install.md), as `make serve` does it: torch 2.13.0 from PyPI is its CUDA
# 13.0 build (which names triton 3.7.1; the project's kernels are tested with 3.8.0, the pin both take), installed
# by version without its dependencies; uv from the lock's own entry, hash-checked; then every other package from
# requirements-cuda.lock (it holds the CUDA libraries torch names) with hashes and no resolution; the package last,
# without dependencies or build isolation (setuptools from the lock).
WORKDIR /src
COPY pyproject.toml README.md requirements-cuda.lock ./
COPY flashtier ./flashtier
COPY server ./server
COPY engine ./engine
COPY kvstore ./kvstore
COPY kernels ./kernels
RUN pip install --no-cache-dir --no-deps torch==2.13.0 triton==3.8.0 \
    && sed -n '/^uv==/,/^[^ ]/{/^uv==/p;/^ /p;}' requirements-cuda.lock > /tmp/uv.txt \
    && pip install --no-cache-dir --no-deps --require-hashes -r /tmp/uv.txt \
    && uv pip install --no-cache --python /opt/flashtier/bin/python --require-hashes --no-deps -r requirements-cuda.lock \
    && uv pip install --no-cache --python /opt/flashtier/bin/python --no-deps --no-build-isolation /src \
    && uv pip check --python /opt/flashtier/bin/python \
    && cd / && rm -rf /src /tmp/uv.txt

# A non-root user owns the SSD tier and the cache directory (demo checkpoint); the model is mounted read-only.
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/flashtier flashtier \
    && mkdir -p /var/lib/flashtier/kv /var/cache/flashtier /models \
    && chown -R flashtier:flashtier /var/lib/flashtier /var/cache/flashtier \
    && chmod 0700 /var/lib/flashtier/kv

# FLASHTIER_DRAIN_TIMEOUT: seconds SIGTERM waits for in-flight requests; docker-compose.yml's stop_grace_period
# (and `docker stop -t`) must exceed it, or the runtime kills the server mid-drain.
ENV FLASHTIER_HOST=0.0.0.0 \
    FLASHTIER_PORT=8000 \
    FLASHTIER_MODEL_DIR=/models \
    FLASHTIER_KV_DIR=/var/lib/flashtier/kv \
    FLASHTIER_CACHE_DIR=/var/cache/flashtier \
    FLASHTIER_DRAIN_TIMEOUT=30

USER flashtier
WORKDIR /home/flashtier
VOLUME ["/var/lib/flashtier/kv"]
EXPOSE 8000
STOPSIGNAL SIGTERM
# /health is 200 once the engine accepts requests (503 while the model loads: a real checkpoint takes minutes).
HEALTHCHECK --interval=30s --timeout=5s --start-period=15m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('FLASHTIER_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["flashtier", "serve"]
CMD []
