# One image for every hearth process (compose.yaml; untested here: no Docker engine on the project's machines).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY hearth hearth
# Beside the sources: the bundled model (`orchestrator --preload hearth-tiny-llama`, `shard --model
# models/hearth-tiny-llama`), the NATS cluster configuration (`hearth nats --node`), and grafana/, prometheus/ and
# docs/ (`hearth docs`), which pyproject.toml maps into the data package too: without them `pip install -e .` stops at
# "package directory 'grafana' does not exist".
COPY models models
COPY nats nats
COPY grafana grafana
COPY prometheus prometheus
COPY docs docs
# Point pip at a CPU-only torch index where you have one; the default index's build is much larger.
# Editable: hearth then runs from /app and finds its data folders beside its sources as in a checkout
# (hearth/services/common/hearth_files.py).
RUN pip install --no-cache-dir torch==2.13.0 && pip install --no-cache-dir -e .
ENV OMP_WAIT_POLICY=PASSIVE HEARTH_NATS_URL=nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222
ENTRYPOINT ["hearth"]
