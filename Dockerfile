# syntax=docker/dockerfile:1
# The RelayGR service image: one entry point, `relaygr`, whose subcommand (ranker, router,
# trigger) comes from the container args, as the Helm chart passes them.
#
#   make image                                  # CPU (torch CPU wheel): relaygr:<version>
#   NVIDIA: docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#           (a CUDA torch 2.13.0 wheel; the NVIDIA device plugin exposes the driver to the pod)
#   Ascend: docker build --build-arg PYTHON_IMAGE=<a CANN image with Python 3.11 that matches
#           the nodes' driver> --build-arg EXTRAS=ascend .   (adds torch-npu, pinned in
#           pyproject.toml; torch_npu needs the CANN toolkit of that base image at run time)
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""
ARG GRPCIO_TOOLS=grpcio-tools==1.85.1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# The stub generator lives in its own venv and never reaches the final stage.
RUN python -m venv /opt/protoc && /opt/protoc/bin/pip install "${GRPCIO_TOOLS}"
# torch first, from the index that matches the accelerator (the PyPI default wheel carries
# gigabytes of CUDA libraries); `pip install .` then keeps it (torch==2.13.0 matches +cpu).
RUN python -m venv /opt/relaygr \
 && /opt/relaygr/bin/pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY relaygr/ relaygr/
COPY services/ services/
COPY tooling/ tooling/
COPY bench/ bench/
# relaygr/v1 is generated, never committed: the same protoc call as `make proto`.
RUN mkdir -p relaygr/v1 \
 && /opt/protoc/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. \
      --grpc_python_out=. protos/relaygr/v1/*.proto \
 && printf '"""Generated relaygr.v1 stubs (make proto)."""\n' > relaygr/v1/__init__.py \
 && touch relaygr/v1/py.typed
# The pinned dependencies of pyproject.toml (not the dev extra); then no installer is left.
RUN /opt/relaygr/bin/pip install "/src${EXTRAS:+[${EXTRAS}]}" \
 && /opt/relaygr/bin/python -m pip uninstall --yes setuptools wheel pip \
 && /opt/relaygr/bin/relaygr ranker --help > /dev/null

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="relaygr" \
      org.opencontainers.image.description="RelayGR ranker, router and trigger services"
# HOME is /tmp: the chart mounts an emptyDir there under a read-only root filesystem.
ENV PATH=/opt/relaygr/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp
RUN groupadd --system --gid 10001 relaygr \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin relaygr
COPY --from=builder /opt/relaygr /opt/relaygr
USER 10001:10001
WORKDIR /tmp
# trigger, router, ranker gRPC; Prometheus /metrics
EXPOSE 50041 50051 50061 9090
ENTRYPOINT ["relaygr"]
CMD ["--help"]
