# The gpuq image. Targets: `cuda` (default; torch with CUDA, for GPU nodes) and `cpu` (simulated GPUs).
#   docker build -t gpuq .              docker build --target cpu -t gpuq:cpu .
FROM python:3.11-slim AS source
WORKDIR /opt/gpuq
COPY pyproject.toml README.md alembic.ini ./
COPY gpuq ./gpuq
COPY service ./service
COPY workers ./workers
COPY cli ./cli
COPY migrations ./migrations

FROM source AS cpu
# Point PIP_INDEX_URL / PIP_EXTRA_INDEX_URL at an index with CPU builds of torch to keep the image small.
ARG PIP_EXTRA_INDEX_URL=""
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir ".[flower]" && useradd -m gpuq
ENV GPUQ_FAKE_GPUS=2
USER gpuq

FROM source AS cuda
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir ".[flower]" && useradd -m gpuq
USER gpuq
