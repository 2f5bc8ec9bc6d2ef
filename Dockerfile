# One image for every hearth process (untested here: no Docker engine on the project's machines).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY events events
COPY readmodels readmodels
COPY migrations migrations
COPY inference inference
COPY services services
COPY trust trust
COPY models models
# Point pip at a CPU-only torch index where you have one; the default index's build is much larger.
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir .
ENV OMP_WAIT_POLICY=PASSIVE HEARTH_NATS_URL=nats://nats:4222
ENTRYPOINT ["hearth"]
