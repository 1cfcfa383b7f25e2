# One image for all three SplitSpec services (CPU build of torch; the GPU image comes with the GPU issue).
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY protos protos
COPY splitspec splitspec
COPY gateway gateway
COPY target_service target_service
COPY draft_service draft_service
RUN pip install --no-cache-dir .
ENV PYTHONUNBUFFERED=1
