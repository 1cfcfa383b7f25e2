# One image for all three SplitSpec services. TORCH_INDEX_URL picks the torch build:
# CUDA by default (docker-compose.yml), the CPU build for docker-compose.cpu.yml.
# PIP_EXTRAS adds optional dependencies: "[gpu]" (flashinfer) for the GPU stack.
FROM python:3.11-slim
WORKDIR /app
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_EXTRAS=""
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY pyproject.toml README.md ./
COPY protos protos
COPY splitspec splitspec
COPY gateway gateway
COPY target_service target_service
COPY draft_service draft_service
RUN pip install --no-cache-dir ".${PIP_EXTRAS}"
ENV PYTHONUNBUFFERED=1
