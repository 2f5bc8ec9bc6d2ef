"""`hearth demo`: the whole mesh on one machine (embedded NATS, projector, N shard hosts, an orchestrator)
streaming one answer and showing which shard hosts ran its steps.

Every part is a real `hearth ...` process started through services.devtools.local_cluster.LocalCluster, exactly as on
separate machines, only all on loopback; their logs go to files in the demo's work directory. The
layers are split evenly (services.devtools.local_cluster.even_layer_ranges): shard host i serves range i.

Output: progress lines while starting go to stderr; the hop chain, the streamed answer (with an inline
mark wherever the chain of shard hosts changes, e.g. after a failover), and a summary go to stdout.
Exit code 0 after a complete answer and after a requested stop (Ctrl-C, SIGTERM, a closed terminal) at
any point, 2 when the model or --shards is refused before anything starts (a model it cannot find, a GGUF no shard
could serve, more shards than layers), 1 when something failed to start or the answer ended in an error. A stop
ends every process the demo started, each within services.common.lifecycle.stop_deadline_s (a shard that a call
still goes through, once the stopping orchestrator has closed its hops, or the shard dropped them as orphans:
shard.main.drain_for_stop).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sqlite3
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from hearth.protocol.subjects import parse_shard_id
from hearth.services.broker.server import NatsServerError
from hearth.services.cli_options import EXIT_BAD_INPUT
from hearth.services.common.lifecycle import STOP_EXIT_CODE, Interrupted, run_cancelling_on_signal
from hearth.services.common.logging import default_log_level
from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.devtools.local_cluster import (
    ClusterError,
    LocalCluster,
    ManagedProcess,
    even_layer_ranges,
    prefork_from_environment,
)
from hearth.services.devtools.prefork import LauncherError
from hearth.services.devtools.random_models import UnknownRandomShape
from hearth.services.devtools.demo_model import (
    DemoError,
    DemoModel,
    default_prompt,
    real_demo_model_hint,
    resolve_demo_model,
)

default_max_tokens = 48
default_shards = 3
demo_ready_timeout_s = 300.0
progress_poll_interval_s = 0.1
read_model_wait_s = 3.0
ORCHESTRATOR_NODE_ID = "demo-orchestrator"
# The member the demo asks as, and whose key it prints for `hearth chat --creds`.
DEMO_CLIENT = "you"


class _Stop(Exception):
    """SIGTERM reached the demo: stop everything as for Ctrl-C."""


def shard_label(shard_id: str) -> str:
    """`model:0-1@demo-host-0` -> `demo-host-0 [layers 0-1]`; `model:0-1+int8@demo-host-0` -> `demo-host-0 [layers
    0-1, int8]`."""
    parts = parse_shard_id(shard_id)
    if parts is None:
        return shard_id
    scheme = "" if parts.quantization == "none" else f", {parts.quantization}"
    return f"{parts.node_id} [layers {parts.layer_lo}-{parts.layer_hi}{scheme}]"


def chain_text(hops: list[str]) -> str:
    return " -> ".join(["orchestrator", *(shard_label(hop) for hop in hops), "orchestrator"])


def _say(text: str = "") -> None:
    print(text, file=sys.stderr, flush=True)


@dataclass
class DemoRun:
    """One invocation of `hearth demo`; `run()` returns the process exit code."""

    model: str | None = None
    shards: int = default_shards
    # None: the model's own default question (services.devtools.demo_model.default_prompt).
    prompt: str | None = None
    max_tokens: int = default_max_tokens
    serve: bool = False
    raw: bool = False
    torch_threads: int | None = None
    work_dir: Path | None = None
    log_level: str = default_log_level
    # --device/--dtype of every shard host and the orchestrator (None: their defaults).
    device: str | None = None
    dtype: str | None = None
    # --quantize of every shard host and the orchestrator (None: their default).
    quantize: str | None = None
    # What the started processes' environment adds: the configuration file the command was given.
    configuration_env: dict[str, str] = field(default_factory=dict)
    # True once run() ended on a requested stop (Ctrl-C, SIGTERM, SIGHUP), everything it started stopped.
    stopped: bool = False

    def run(self) -> int:
        # This process only supervises and prints; its own INFO lines would bury the answer (the
        # processes it starts log to files in the work directory at the chosen level).
        logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
        # Ctrl-C works even when started from a script that ignores SIGINT; SIGTERM and a closed
        # terminal (SIGHUP) stop everything the same way.
        previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
        previous_term = signal.signal(signal.SIGTERM, _raise_stop)
        previous_hup = signal.signal(signal.SIGHUP, _raise_stop)
        cluster: LocalCluster | None = None
        try:
            demo_model = resolve_demo_model(self.model, prefer_real=True)
            if self.model is None and not demo_model.is_gguf:
                _say(f"hearth demo: running the bundled toy model; {real_demo_model_hint()}")
            self.prompt = self.prompt or default_prompt(demo_model)
            if not 1 <= self.shards <= demo_model.num_layers:
                raise DemoError(f"--shards must be between 1 and the model's {demo_model.num_layers} layers")
            # Forked from one process that imported torch once, so no process imports it again (how much sooner
            # the demo is ready: BENCHMARKS.md, "`hearth demo`"); HEARTH_PREFORK=0 starts each process fresh.
            cluster = LocalCluster(work_dir=self.work_dir, torch_threads=self.torch_threads,
                                   extra_env=self.configuration_env, log_level=self.log_level, start_new_session=True,
                                   prefork=prefork_from_environment(default=True))
            self._start(cluster, demo_model)
            # Signals cancel the answer's loop (not raise inside it); _Stop after, as everywhere else.
            try:
                answered = run_cancelling_on_signal(self._ask(cluster, demo_model))
            except Interrupted:
                raise _Stop() from None
            if self.serve:
                self._serve_until_stopped(cluster, demo_model)
            return 0 if answered else 1
        except DemoError as error:  # refused before anything started
            _say(f"hearth demo: {error}")
            return error.exit_code
        except UnknownRandomShape as error:
            _say(f"hearth demo: {error}")
            return EXIT_BAD_INPUT
        except (ClusterError, NatsServerError, LauncherError) as error:  # a part of the mesh did not start
            _say(f"hearth demo: {error}")
            return 1
        except (KeyboardInterrupt, _Stop):
            _say("\ninterrupted")
            self.stopped = True
            return STOP_EXIT_CODE
        finally:
            # A second Ctrl-C must not cut the shutdown short and leave processes behind.
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(signum, signal.SIG_IGN)
            try:
                if cluster is not None:
                    _say("stopping every process the demo started ...")
                    stopped_at = time.monotonic()
                    # SIGTERM to all first so they shut down side by side, then wait for each (newest first).
                    for process in cluster.processes:
                        process.signal(signal.SIGTERM)
                    cluster.close()
                    _say(f"stopped in {time.monotonic() - stopped_at:.1f} s")
            finally:
                signal.signal(signal.SIGINT, previous_int)
                signal.signal(signal.SIGTERM, previous_term)
                signal.signal(signal.SIGHUP, previous_hup)

    # ------------------------------------------------------------------ start-up

    def _start(self, cluster: LocalCluster, model: DemoModel) -> None:
        ranges = even_layer_ranges(model.num_layers, self.shards)
        total = 3 + len(ranges)
        kept = "" if self.work_dir is not None else " (removed when the demo ends; --work-dir keeps them)"
        _say(f"hearth demo: {model.name} ({model.num_layers} layers) over {len(ranges)} shard "
             f"host{'' if len(ranges) == 1 else 's'} on this machine; logs in {cluster.work_dir}{kept}")
        started = time.monotonic()
        url = cluster.start_nats()
        _say(f"  [1/{total}] nats-server (JetStream) listening on {url}")
        db_path = cluster.work_dir / "readmodel.sqlite"
        self.read_model_path = db_path
        projector = cluster.start_projector(db_path, wait_ready=False)
        # Waited for with the others: the summary's read-model line needs it following the streams.
        waiting: dict[str, tuple[ManagedProcess, str]] = {
            projector.name: (projector, f"projector: following the event streams into {db_path.name}")}
        for index, (lo, hi) in enumerate(ranges):
            node_id = f"demo-host-{index}"
            process = cluster.start_shard(model.argument, lo, hi, node_id=node_id, wait_ready=False,
                                          extra_args=self._placement_args())
            waiting[process.name] = (process, f"shard host {node_id}: layers {lo}-{hi}")
        orchestrator = cluster.start_orchestrator(
            node_id=ORCHESTRATOR_NODE_ID, extra_args=["--preload", model.argument, *self._placement_args()],
            wait_ready=False)
        waiting[orchestrator.name] = (orchestrator, "orchestrator: embedding, lm_head and sampling")
        _say(f"  starting {len(waiting)} processes (each loads torch and its part of the model) ...")
        done = 1
        deadline = time.monotonic() + demo_ready_timeout_s
        # On a terminal, one line that keeps counting seconds shows the start-up is alive.
        ticker = sys.stderr.isatty()
        while waiting:
            for name, (process, what) in list(waiting.items()):
                if process.ready_file is not None and process.ready_file.exists():
                    done += 1
                    if ticker:
                        sys.stderr.write("\r\033[K")
                    _say(f"  [{done}/{total}] {what} ready after {time.monotonic() - started:.1f} s")
                    del waiting[name]
                elif not process.alive:
                    raise ClusterError(f"{process.name} exited with {process.popen.returncode}:\n"
                                       f"{process.log_tail()}")
            if waiting and time.monotonic() > deadline:
                names = ", ".join(waiting)
                raise ClusterError(f"not ready within {demo_ready_timeout_s:.0f} s: {names}")
            if ticker and waiting:
                sys.stderr.write(f"\r\033[K  ... {time.monotonic() - started:4.0f} s, waiting for {len(waiting)}")
                sys.stderr.flush()
            time.sleep(progress_poll_interval_s)
        _say("  Prometheus /metrics (every metric: `hearth docs metrics`):")
        for name, url in cluster.metrics_urls().items():
            _say(f"    {name:28s} {url}")

    def _placement_args(self) -> list[str]:
        return [*(["--device", self.device] if self.device else []), *(["--dtype", self.dtype] if self.dtype else []),
                *(["--quantize", self.quantize] if self.quantize else [])]

    # ------------------------------------------------------------------ the answer

    def _request(self, model: DemoModel):
        from hearth.protocol.chat import ChatMessage, ChatRequest

        if self.raw or not model.has_chat_template:
            return ChatRequest(model=model.argument, prompt=self.prompt, max_tokens=self.max_tokens)
        return ChatRequest(model=model.argument, messages=[ChatMessage(role="user", content=self.prompt)],
                           max_tokens=self.max_tokens)

    async def _ask(self, cluster: LocalCluster, model: DemoModel) -> bool:
        """Stream one answer to stdout; True when it ended with `done`."""
        from hearth.services.client.answer_bound import within_bound
        from hearth.services.client.chat import stream_chat_raw
        from hearth.services.broker.connection import close_quietly, connect_nats

        request = self._request(model)
        nc = await connect_nats(cluster.nats_url, name="hearth-demo",
                                settings=cluster.nats_settings(cluster.member_key(DEMO_CLIENT, "client")))
        view = _AnswerView(self)
        try:
            print(f"\n> {self.prompt}" + ("" if request.messages else "   (raw prompt: no chat template)"))
            # stream_chat_raw directly: closing it here unsubscribes before the connection closes. Within the
            # request's bound: a frame past it ends the call as an internal_error (answer_bound.py).
            frames = within_bound(stream_chat_raw(nc, request.model_dump_json(exclude_none=True).encode()), request)
            async with contextlib.aclosing(frames):
                async for frame in frames:
                    outcome = view.show(frame)
                    if outcome is not None:
                        return outcome
            return False
        finally:
            await close_quietly(nc)

    def _summarise(self, done, steps_per_host: Counter[str], pipeline_id: str | None) -> None:
        timing = done.timing
        construct_ms = getattr(timing, "construct_ms", None)
        print(f"\n\n[{done.finish_reason}: {done.usage.completion_tokens} tokens, "
              f"{timing.tokens_per_second or 0:.1f} tokens/s, first token after {timing.ttft_ms or 0:.0f} ms"
              + (f", pipeline built in {construct_ms:.1f} ms" if construct_ms is not None else "") + "]")
        if steps_per_host:
            print("steps run per shard host: " + ", ".join(f"{host} {count}" for host, count in
                                                         sorted(steps_per_host.items())))
        recorded = self._read_model_row(pipeline_id) if pipeline_id else None
        if recorded is not None:
            print(f"read model (hearth projector): pipeline {pipeline_id} {recorded}")
        sys.stdout.flush()

    def _read_model_row(self, pipeline_id: str) -> str | None:
        """The projector's row for this pipeline, once the events reached it (None if not in time)."""
        deadline = time.monotonic() + read_model_wait_s
        while time.monotonic() < deadline:
            try:
                with contextlib.closing(open_read_only(self.read_model_path, busy_wait=1.0)) as db:
                    row = db.execute("SELECT status, completion_tokens FROM pipelines WHERE pipeline_id = ?",
                                     (pipeline_id,)).fetchone()
            except sqlite3.Error:
                row = None
            if row is not None and row[0] != "running" and row[1] is not None:
                return f"{row[0]}, {row[1]} tokens"
            time.sleep(0.1)
        return None

    # ------------------------------------------------------------------ --serve

    def _serve_until_stopped(self, cluster: LocalCluster, model: DemoModel) -> None:
        model_option = "" if model.is_default else f" --model {model.argument}"
        raw_option = "" if model.has_chat_template else " --raw"
        creds = cluster.member_key(DEMO_CLIENT, "client")
        print(f"\nThe mesh keeps running. NATS: {cluster.nats_url}; client credentials: {creds}")
        print(f"Try:  hearth chat --nats {cluster.nats_url} --creds {creds}{model_option}{raw_option} "
              "\"Tell me a joke.\"")
        from hearth.services.gateway.command import start_demo_gateway

        for line in start_demo_gateway(cluster, DEMO_CLIENT, model.name, chat=model.has_chat_template):
            print(line)
        print("Ctrl-C stops everything.", flush=True)
        while True:
            if cluster.nats is not None and not cluster.nats.is_running():
                raise ClusterError("nats-server exited")
            for process in cluster.processes:
                if not process.alive:
                    raise ClusterError(f"{process.name} exited with {process.popen.returncode}:\n"
                                       f"{process.log_tail()}")
            time.sleep(0.5)


class _AnswerView:
    """Prints the frames of one answer: the hop chain once, the text, marks where the chain changes."""

    def __init__(self, demo: DemoRun) -> None:
        self.demo = demo
        self.current_hops: list[str] | None = None
        self.steps_per_host: Counter[str] = Counter()
        self.pipeline_id: str | None = None
        from hearth.services.client.chat import AnswerTokens

        self.answer = AnswerTokens()

    def show(self, frame) -> bool | None:
        """Print one frame; True/False once the answer is complete/failed, None while it streams."""
        from hearth.protocol.chat_frames import (
            DoneFrame,
            ErrorFrame,
            PipelineAbortedFrame,
            PipelineFrame,
            ShardFailoverFrame,
            ShardStatusFrame,
            TokenDeltaFrame,
            TokensWithdrawnFrame,
        )

        out = sys.stdout
        withdrawn = self.answer.take(frame)
        if isinstance(frame, PipelineFrame):
            self.pipeline_id, self.current_hops = frame.pipeline_id, list(frame.hops)
            print(f"pipeline {frame.pipeline_id}: {chain_text(frame.hops)}")
            print("(each generated token runs through this chain; a change is marked [[via ...]])\n")
        elif isinstance(frame, TokenDeltaFrame):
            hops = list(frame.hops or [])
            if hops and self.current_hops is not None and hops != self.current_hops:
                out.write(f" [[via {' -> '.join(shard_label(h) for h in hops)}]] ")
            if hops:
                self.current_hops = hops
            self.steps_per_host.update(shard_label(h) for h in hops)
            out.write(frame.text)
            out.flush()
        elif isinstance(frame, ShardStatusFrame):
            out.write(f" [[{shard_label(frame.shard_id)} {frame.status}: {frame.reason}]] ")
        elif isinstance(frame, ShardFailoverFrame):
            out.write(f" [[failover after token {frame.resumed_at_token}: {chain_text(frame.replacement_hops)}]] ")
        elif isinstance(frame, TokensWithdrawnFrame):
            # Printed text cannot be taken back: say so, then print the kept text again for the answer to go on.
            out.write(f"\n[[{len(withdrawn)} tokens after token {frame.kept_tokens} withdrawn: "
                      f"{shard_label(frame.shard_id)} refuted ({frame.reason}); the answer so far:]]\n")
            out.write(self.answer.text)
            out.flush()
        elif isinstance(frame, DoneFrame):
            self.demo._summarise(frame, self.steps_per_host, self.pipeline_id)
            return True
        elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
            message = frame.message if isinstance(frame, ErrorFrame) else frame.reason
            print(f"\nerror {frame.code}: {message}")
            return False
        return None


def _raise_stop(signum, frame) -> None:
    raise _Stop()
