# The reconciler's image: `gitops-sless serve`, by default with the Kubernetes backend
# (deploy/deployment.yaml passes the full arguments). Build with BuildKit:
#   docker build -t ghcr.io/gitops-sless/gitops-sless:0.1.0 .
# Both stages use the same base, pinned by its exact version (pin a digest too where the
# registry can be reached: python:3.11.10-slim-bookworm@sha256:...).

# --- builder: wheels of the project and of every dependency --------------------------------
FROM python:3.11.10-slim-bookworm AS builder
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gitops_sless ./gitops_sless
RUN pip wheel . --wheel-dir /wheels

# --- runtime -------------------------------------------------------------------------------
FROM python:3.11.10-slim-bookworm
# schemas/, templates/ and runtimes/ are not in the wheel: SLESS_HOME says where they are
# (gitops_sless/paths.py)
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    SLESS_HOME=/opt/gitops-sless
RUN apt-get update \
    && apt-get install -y --no-install-recommends git \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 sless \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/sless --create-home \
        --shell /usr/sbin/nologin sless \
    && install -d -o 10001 -g 10001 /var/cache/gitops-sless
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels gitops-sless
COPY runtimes /opt/gitops-sless/runtimes
COPY templates /opt/gitops-sless/templates
COPY schemas /opt/gitops-sless/schemas
WORKDIR /var/cache/gitops-sless
USER 10001
EXPOSE 8080
ENTRYPOINT ["gitops-sless"]
CMD ["serve", "--backend", "kubernetes"]
