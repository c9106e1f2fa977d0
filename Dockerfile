# One image for the whole stack: control plane (`covey`), sandbox daemon (`coveyd`) and
# Postgres. BASE is a build argument: an offline base made by scripts/build-image where no
# registry is reachable, or a public Python image where one is.
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}
ARG PG_MAJOR=15
RUN [ -x /usr/lib/postgresql/${PG_MAJOR}/bin/postgres ] || ( \
        apt-get update && apt-get install -y --no-install-recommends postgresql-${PG_MAJOR} \
        && rm -rf /var/lib/apt/lists/* )
RUN (id agent >/dev/null 2>&1 || useradd --create-home --uid 1000 agent) \
    && python3 -m venv /opt/covey
# Wheels are built on the host (scripts/build-image): the build itself needs no network.
# With the harness extra: the game days run the puppet model and the fault proxy from this
# image too.
COPY build/wheels /tmp/wheels
RUN /opt/covey/bin/pip install --no-cache-dir --no-index --find-links /tmp/wheels \
        'covey-gameday[harness]' && rm -rf /tmp/wheels
ENV PATH=/opt/covey/bin:/usr/lib/postgresql/${PG_MAJOR}/bin:$PATH \
    PYTHONUNBUFFERED=1
LABEL org.opencontainers.image.title="covey-gameday"
CMD ["covey", "serve", "--host", "0.0.0.0", "--port", "8080"]
