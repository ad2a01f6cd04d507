# The gpuq image. Targets: `cuda` (default; PyPI's torch, built with CUDA, for GPU nodes) and `cpu`
# (torch's CPU build, much smaller, for simulated GPUs: set GPUQ_FAKE_GPUS).
#   docker build -t gpuq .              docker build --target cpu -t gpuq:cpu .
# The NVIDIA driver comes from the host (NVIDIA Container Toolkit); the image needs no CUDA toolkit.
# Its services run as the user `gpuq`, except `gpuq server`, which docker-compose.yml runs as root
# (it reads its callers' uids from its socket, SO_PEERCRED).
FROM python:3.11-slim AS source
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/gpuq
COPY pyproject.toml README.md alembic.ini ./
COPY gpuq ./gpuq
COPY service ./service
COPY workers ./workers
COPY cli ./cli
COPY server ./server
COPY web ./web
COPY migrations ./migrations

FROM source AS cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" torch==2.13.0 && pip install ".[flower]" && useradd -m gpuq
ENV GPUQ_FAKE_GPUS=2
USER gpuq

FROM source AS cuda
RUN pip install torch==2.13.0 && pip install ".[flower]" && useradd -m gpuq
# What the NVIDIA runtime mounts into the container: the driver's compute and NVML libraries.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER gpuq
