"""`hearth bench`: transformers generate() vs the distributed pipeline on one machine — decode tokens/s and
their ratio, time to first token, pipeline construction, per-hop transport overhead, concurrent sessions.

One invocation, one model, one prompt:

1. starts nats-server, N shard hosts (layers split evenly, each with ``--metrics-port``) and an
   orchestrator as real `hearth` processes (services.cluster.LocalCluster), and loads the whole model
   with ``AutoModelForCausalLM.from_pretrained`` in a worker process (``python -m services.bench``)
   that gets the shard processes' OpenMP environment and thread count, and in a second one with this
   shell's environment and torch's own thread count ("library defaults"; --no-library-defaults skips it);
2. warms all up, then runs ``--repeats`` rounds of [generate(), generate() with library defaults,
   pipeline request] with the same prompt ids and greedy decoding, rotating which goes first so
   drifting machine load hits all alike. Time is measured where a user sees it: for generate() by a
   streamer that timestamps every token, for the pipeline by the client timestamping every
   `token_delta` frame. Decode tokens/s
   is (tokens - 1) / (last token time - first token time); time to first token runs from the call
   (generate() / publishing the request) to the first token;
3. reads pipeline construction ms from each `done` frame (timing.construct_ms, as in the
   pipeline.constructed event);
4. per-hop transport overhead: each shard host observes, for every step, the step's inbound wire time
   (upstream publish -> last chunk here), its deserialisation and the serialisation of its output
   (services/shard/metrics.py, `hearth_shard_step_transport_seconds`); the bench scrapes the
   histograms before and after the measured rounds and reports p50/p95 of decode steps per hop and
   pooled (linear interpolation inside buckets 0.1 ms wide up to 1 ms, plus the exact share <= 1 ms);
5. sends K requests at once (different prompts of the same length) and reports the aggregate
   tokens/s (all tokens / wall time from the first request to the last `done`) and each session's
   time to first token and finish, and whether any session produced its first token only after
   another one had finished.

``--model`` is a checkpoint folder, a name under models/, a hub id in the local cache, or
``random:<shape>`` (RANDOM_SHAPES): a randomly initialised Llama written once with save_pretrained to
``$HEARTH_CACHE_DIR`` (default ~/.cache/hearth)/random-models/<shape>, with a word-level tokenizer
(token i is the word ``t<i>``) so prompts have exactly the requested length; no end-of-sequence token,
so every run generates exactly ``--new-tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel

from services.common.lifecycle import run_event_loop
from services.cluster import LocalCluster, even_layer_ranges, quiet_torch_environment
from services.common.nats_server import free_tcp_port
from services.shard.metrics import COMPUTE_METRIC, DESERIALIZE_METRIC, SERIALIZE_METRIC, TRANSPORT_METRIC, WIRE_METRIC

RANDOM_SHAPES: dict[str, dict[str, int]] = {
    # ~271M parameters (205M in the layers); the shape of scripts/bench_inference_memory.py.
    "llama-250m": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                       intermediate_size=2816, vocab_size=32000),
    # TinyLlama-1.1B's shape (1.1B parameters).
    "tinyllama-1.1b": dict(hidden_size=2048, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=5632, vocab_size=32000),
    # For tests of the bench itself: seconds to write and run.
    "tiny": dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512),
}
RANDOM_PREFIX = "random:"
RANDOM_MARKER_FILE = "hearth-random-shape.json"
random_max_positions = 4096
random_init_seed = 0
CACHE_DIR_ENV = "HEARTH_CACHE_DIR"

default_prompt_tokens = 64
default_new_tokens = 32
default_sessions = 4
default_repeats = 3
warmup_new_tokens = 4
# Generous: this measures speed, not failover; a 1.1B prefill queued behind three others on two busy
# cores can hold a hop for longer than the production default of 10 s.
bench_step_timeout_s = 120.0
cluster_ready_timeout_s = 600.0
metrics_scrape_timeout_s = 5.0
transport_target_p95_ms = 1.0
ratio_target = 0.90
construct_target_ms = 20.0
PROMPT_WORDS = (
    "hearth runs one language model across the machines of a community mesh so that nobody needs a large "
    "computer each machine holds a few layers and passes activations to the next one over the network "
    "while an orchestrator embeds the prompt samples every token and streams the answer back"
).split()


class BenchError(RuntimeError):
    """The benchmark could not run (a process failed, a request ended in an error)."""


# ---------------------------------------------------------------------------------------------- model


def cache_root(cache_dir: Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    return Path(os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "hearth")


def random_checkpoint(spec: str, cache_dir: Path | None = None) -> Path:
    """The folder of `random:<shape>`, writing it (random fp32 weights + word-level tokenizer) on first use."""
    shape = spec.removeprefix(RANDOM_PREFIX)
    if shape not in RANDOM_SHAPES:
        raise BenchError(f"unknown random shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}")
    folder = cache_root(cache_dir) / "random-models" / shape
    if (folder / RANDOM_MARKER_FILE).is_file():
        return folder
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dims = RANDOM_SHAPES[shape]
    config = LlamaConfig(**dims, max_position_embeddings=random_max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    staging = folder.with_name(folder.name + f".writing-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    print(f"writing random checkpoint {spec} to {folder} (once) ...", file=sys.stderr, flush=True)
    torch.manual_seed(random_init_seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(staging)
    del model
    vocab = {f"t{index}": index for index in range(dims["vocab_size"])}
    word_tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    word_tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=word_tokenizer, unk_token="t0").save_pretrained(staging)
    (staging / RANDOM_MARKER_FILE).write_text(json.dumps({"shape": shape, **dims, "seed": random_init_seed}))
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def build_prompt(tokenizer, model_path: Path, prompt_tokens: int, variant: int = 0) -> tuple[str, list[int]]:
    """Raw prompt text of (at most, and for random checkpoints exactly) `prompt_tokens` tokens, and its ids
    exactly as the orchestrator tokenizes a raw prompt; `variant` gives a different text of the same length."""
    if (model_path / RANDOM_MARKER_FILE).is_file():
        vocab_size = json.loads((model_path / RANDOM_MARKER_FILE).read_text())["vocab_size"]
        words = [f"t{(7919 * (index + 1000 * variant) + 13) % (vocab_size - 1) + 1}" for index in range(prompt_tokens)]
    else:
        start = (7 * variant) % len(PROMPT_WORDS)
        rotated = PROMPT_WORDS[start:] + PROMPT_WORDS[:start]
        words = (rotated * (prompt_tokens // len(rotated) + 2))[: prompt_tokens + 1]

    def ids_of(count: int) -> list[int]:
        return list(tokenizer(" ".join(words[:count]))["input_ids"])

    low, high = 1, len(words)
    while low < high:  # the most words whose tokens still fit
        middle = (low + high + 1) // 2
        if len(ids_of(middle)) <= prompt_tokens:
            low = middle
        else:
            high = middle - 1
    text = " ".join(words[:low])
    return text, ids_of(low)


# ---------------------------------------------------------------------------------------------- timing


@dataclass
class GenerationTiming:
    """One generation as its caller saw it: seconds from the call to each token."""

    token_times_s: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    construct_ms: float | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_ms(self) -> float:
        return self.token_times_s[0] * 1000.0

    @property
    def decode_tokens_per_s(self) -> float:
        if self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / (self.token_times_s[-1] - self.token_times_s[0])

    @property
    def end_s(self) -> float:
        return self.token_times_s[-1]


class MonolithicJob(BaseModel):
    """One request to the monolithic worker (a JSON line on its stdin)."""

    kind: Literal["prompt", "generate"]
    prompt_tokens: int = 0
    variant: int = 0
    prompt: str = ""
    new_tokens: int = 0


class MonolithicReply(BaseModel):
    """The worker's answer (a JSON line on its stdout)."""

    ok: bool = True
    error: str | None = None
    prompt: str | None = None
    prompt_ids: list[int] = []
    token_times_s: list[float] = []
    token_ids: list[int] = []


class MonolithicInfo(BaseModel):
    """The first line the worker prints, once the model is loaded."""

    parameters: int
    dtype: str
    torch_threads: int
    torch_version: str


class MonolithicModel:
    """The whole model via transformers' from_pretrained; generate() greedy, timed by a streamer."""

    def __init__(self, path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._torch = torch
        self.path = path
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.info = MonolithicInfo(parameters=sum(p.numel() for p in self.model.parameters()),
                                   dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
                                   torch_threads=torch.get_num_threads(), torch_version=torch.__version__)

    def handle(self, job: MonolithicJob) -> MonolithicReply:
        if job.kind == "prompt":
            text, ids = build_prompt(self.tokenizer, self.path, job.prompt_tokens, job.variant)
            return MonolithicReply(prompt=text, prompt_ids=ids)
        ids = list(self.tokenizer(job.prompt)["input_ids"])  # exactly as the orchestrator encodes a raw prompt
        timing = self.generate(ids, job.new_tokens)
        return MonolithicReply(prompt_ids=ids, token_times_s=timing.token_times_s, token_ids=timing.token_ids)

    def generate(self, prompt_ids: Sequence[int], new_tokens: int) -> GenerationTiming:
        from transformers.generation.streamers import BaseStreamer

        torch = self._torch
        timing = GenerationTiming()
        started = time.perf_counter()

        class _Stamps(BaseStreamer):
            prompt_seen = False

            def put(self, value) -> None:
                if not self.prompt_seen:  # generate() first pushes the prompt itself
                    self.prompt_seen = True
                    return
                timing.token_times_s.append(time.perf_counter() - started)
                timing.token_ids.extend(int(token) for token in value.reshape(-1).tolist())

            def end(self) -> None:
                pass

        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        with torch.inference_mode():
            self.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=new_tokens, do_sample=False, streamer=_Stamps())
        return timing


def monolithic_worker_main(model_path: str, torch_threads: int | None) -> None:
    """`python -m services.bench PATH [THREADS]`: load the model, answer MonolithicJob lines until stdin closes.

    Runs in its own process so that it gets the same OpenMP environment as the shard processes (libgomp
    reads it once, when torch loads) and so that the bench process itself stays free of torch.
    """
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # anything a library prints must not corrupt the reply stream
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    model = MonolithicModel(Path(model_path))
    replies.write(model.info.model_dump_json() + "\n")
    for line in sys.stdin:
        try:
            reply = model.handle(MonolithicJob.model_validate_json(line))
        except Exception as error:  # reported to the bench, which stops with the message
            reply = MonolithicReply(ok=False, error=f"{type(error).__name__}: {error}")
        replies.write(reply.model_dump_json() + "\n")


class MonolithicWorker:
    """The bench's handle on the worker process (services.bench as a module)."""

    def __init__(self, model_path: Path, env: dict[str, str], torch_threads: int | None, log_path: Path) -> None:
        self._log = open(log_path, "ab")
        command = [sys.executable, "-m", "services.bench", str(model_path)]
        if torch_threads:
            command.append(str(torch_threads))
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        env={**os.environ, **env}, text=True, bufsize=1,
                                        cwd=str(Path(__file__).resolve().parents[1]))
        self.log_path = log_path
        self.info: MonolithicInfo | None = None

    def wait_ready(self) -> MonolithicInfo:
        self.info = MonolithicInfo.model_validate_json(self._read_line())
        return self.info

    def _read_line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise BenchError(f"the monolithic worker exited with {self.process.poll()}:\n{tail}")
        return line

    def ask(self, job: MonolithicJob) -> MonolithicReply:
        self.process.stdin.write(job.model_dump_json() + "\n")
        self.process.stdin.flush()
        reply = MonolithicReply.model_validate_json(self._read_line())
        if not reply.ok:
            raise BenchError(f"monolithic worker: {reply.error}")
        return reply

    def prompt(self, prompt_tokens: int, variant: int = 0) -> tuple[str, list[int]]:
        reply = self.ask(MonolithicJob(kind="prompt", prompt_tokens=prompt_tokens, variant=variant))
        return reply.prompt or "", reply.prompt_ids

    def generate(self, prompt: str, new_tokens: int) -> GenerationTiming:
        reply = self.ask(MonolithicJob(kind="generate", prompt=prompt, new_tokens=new_tokens))
        return GenerationTiming(token_times_s=reply.token_times_s, token_ids=reply.token_ids)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


async def pipeline_generation(nc, model_ref: str, prompt: str, new_tokens: int) -> GenerationTiming:
    """One raw-prompt greedy request through the orchestrator, timed at the client."""
    from services.common.chat_client import stream_chat_raw
    from services.common.chat_protocol import ChatRequest, DoneFrame, ErrorFrame, PipelineAbortedFrame, TokenDeltaFrame

    request = ChatRequest(model=model_ref, prompt=prompt, max_tokens=new_tokens, temperature=0.0,
                          params={"fallback_to_local": False})
    timing = GenerationTiming()
    started = time.perf_counter()
    frames = stream_chat_raw(nc, request.model_dump_json(exclude_none=True).encode())
    async with contextlib.aclosing(frames):
        async for frame in frames:
            if isinstance(frame, TokenDeltaFrame):
                timing.token_times_s.append(time.perf_counter() - started)
                timing.token_ids.append(frame.token_id)
            elif isinstance(frame, DoneFrame):
                timing.construct_ms = getattr(frame.timing, "construct_ms", None)
                return timing
            elif isinstance(frame, (ErrorFrame, PipelineAbortedFrame)):
                raise BenchError(f"pipeline request failed: {frame.model_dump_json()}")
    raise BenchError("the frame stream ended without `done`")


# ---------------------------------------------------------------------------------------------- metrics


@dataclass
class Histogram:
    """Cumulative bucket counts of one labelled histogram (upper bounds ascending, +Inf last)."""

    bounds_s: list[float]
    cumulative: list[float]
    sum_s: float = 0.0

    def minus(self, earlier: "Histogram | None") -> "Histogram":
        if earlier is None:
            return self
        return Histogram(self.bounds_s, [a - b for a, b in zip(self.cumulative, earlier.cumulative)],
                         self.sum_s - earlier.sum_s)

    def plus(self, other: "Histogram") -> "Histogram":
        return Histogram(self.bounds_s, [a + b for a, b in zip(self.cumulative, other.cumulative)],
                         self.sum_s + other.sum_s)

    @property
    def mean_ms(self) -> float | None:
        return self.sum_s / self.count * 1000.0 if self.count else None

    @property
    def count(self) -> int:
        return int(self.cumulative[-1]) if self.cumulative else 0

    def quantile_ms(self, fraction: float) -> float | None:
        """Like PromQL histogram_quantile: linear inside the bucket holding the rank."""
        total = self.count
        if total == 0:
            return None
        rank = fraction * total
        previous_bound, previous_count = 0.0, 0.0
        for bound, count in zip(self.bounds_s, self.cumulative):
            if count >= rank:
                if math.isinf(bound):
                    return previous_bound * 1000.0
                width = count - previous_count
                inside = (rank - previous_count) / width if width else 1.0
                return (previous_bound + (bound - previous_bound) * inside) * 1000.0
            previous_bound, previous_count = bound, count
        return previous_bound * 1000.0

    def share_at_most(self, bound_s: float) -> float | None:
        """Exact share of observations <= bound_s (bound_s must be a bucket bound)."""
        if self.count == 0:
            return None
        for bound, count in zip(self.bounds_s, self.cumulative):
            if math.isclose(bound, bound_s):
                return count / self.count
        raise ValueError(f"{bound_s} is not a bucket bound")


MetricKey = tuple[str, str, str]  # (metric, shard_id, kind)


def scrape_histograms(url: str) -> dict[MetricKey, Histogram]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=metrics_scrape_timeout_s) as response:
        text = response.read().decode()
    rows: dict[MetricKey, list[tuple[float, float]]] = {}
    sums: dict[MetricKey, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("hearth_shard_step_"):
                continue
            if sample.name.endswith("_bucket"):
                key = (sample.name.removesuffix("_bucket"), sample.labels["shard_id"], sample.labels["kind"])
                rows.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                key = (sample.name.removesuffix("_sum"), sample.labels["shard_id"], sample.labels["kind"])
                sums[key] = sample.value
    histograms = {}
    for key, buckets in rows.items():
        buckets.sort()
        histograms[key] = Histogram([b for b, _ in buckets], [c for _, c in buckets], sums.get(key, 0.0))
    return histograms


# ---------------------------------------------------------------------------------------------- report


class RunFigures(BaseModel):
    decode_tokens_per_s: float
    ttft_ms: float
    tokens: int
    construct_ms: float | None = None


class Side(BaseModel):
    runs: list[RunFigures]
    decode_tokens_per_s_median: float
    ttft_ms_median: float


class TransportFigures(BaseModel):
    hop: int | None
    shard_id: str
    steps: int
    p50_ms: float | None
    p95_ms: float | None
    share_at_most_1ms: float | None
    wire_p50_ms: float | None
    wire_p95_ms: float | None
    deserialize_p95_ms: float | None
    serialize_p95_ms: float | None
    mean_ms: float | None = None
    compute_mean_ms: float | None = None


class SessionFigures(BaseModel):
    session: int
    tokens: int
    ttft_ms: float
    finished_ms: float
    first_token_after_another_finished: bool


class ConcurrentFigures(BaseModel):
    sessions: list[SessionFigures]
    wall_s: float
    aggregate_tokens_per_s: float
    single_session_decode_tokens_per_s: float
    single_session_end_to_end_tokens_per_s: float
    transport: list[TransportFigures]


class TargetCheck(BaseModel):
    target: str
    measured: str
    met: bool


class BenchReport(BaseModel):
    started_at: str
    machine: dict[str, object]
    model: dict[str, object]
    settings: dict[str, object]
    monolithic: Side
    pipeline: Side
    greedy_outputs_match: bool
    # generate() with this shell's environment and torch's default threads (no hearth thread settings).
    monolithic_library_defaults: Side | None = None
    ratio_vs_library_defaults: float | None = None
    ratio_median: float
    ratio_of_medians: float
    pipeline_overhead_ms_per_token: float
    construct_ms_p50: float | None
    construct_ms_max: float | None
    transport_decode: list[TransportFigures]
    transport_prefill: list[TransportFigures]
    concurrent: ConcurrentFigures | None
    targets: list[TargetCheck]


def _side(runs: list[GenerationTiming]) -> Side:
    figures = [RunFigures(decode_tokens_per_s=r.decode_tokens_per_s, ttft_ms=r.ttft_ms, tokens=r.tokens,
                          construct_ms=r.construct_ms) for r in runs]
    return Side(runs=figures, decode_tokens_per_s_median=statistics.median(r.decode_tokens_per_s for r in runs),
                ttft_ms_median=statistics.median(r.ttft_ms for r in runs))


def transport_figures(delta: dict[MetricKey, Histogram], kind: str, hop_of: dict[str, int]) -> list[TransportFigures]:
    """Per shard, then pooled over all hops (shard_id "all")."""
    def pick(metric: str, shard_id: str | None) -> Histogram | None:
        chosen = [h for (m, s, k), h in delta.items() if m == metric and k == kind and shard_id in (None, s)]
        if not chosen:
            return None
        total = chosen[0]
        for histogram in chosen[1:]:
            total = total.plus(histogram)
        return total

    def _mean(histogram: Histogram | None) -> float | None:
        return histogram.mean_ms if histogram is not None else None

    def q(histogram: Histogram | None, fraction: float) -> float | None:
        return histogram.quantile_ms(fraction) if histogram is not None else None

    rows = []
    for shard_id in [*sorted(hop_of, key=hop_of.get), None]:
        overall = pick(TRANSPORT_METRIC, shard_id)
        if overall is None or overall.count == 0:
            continue
        wire = pick(WIRE_METRIC, shard_id)
        rows.append(TransportFigures(
            hop=hop_of.get(shard_id) if shard_id else None, shard_id=shard_id or "all", steps=overall.count,
            p50_ms=q(overall, 0.5), p95_ms=q(overall, 0.95), share_at_most_1ms=overall.share_at_most(0.001),
            wire_p50_ms=q(wire, 0.5), wire_p95_ms=q(wire, 0.95),
            deserialize_p95_ms=q(pick(DESERIALIZE_METRIC, shard_id), 0.95),
            serialize_p95_ms=q(pick(SERIALIZE_METRIC, shard_id), 0.95),
            mean_ms=overall.mean_ms, compute_mean_ms=_mean(pick(COMPUTE_METRIC, shard_id)),
        ))
    return rows


# ---------------------------------------------------------------------------------------------- the bench


@dataclass
class BenchOptions:
    model: str | None = None
    shards: int = 3
    prompt_tokens: int = default_prompt_tokens
    new_tokens: int = default_new_tokens
    sessions: int = default_sessions
    repeats: int = default_repeats
    torch_threads: int | None = None
    # None: the same as torch_threads (the baseline gets the shard processes' thread settings).
    monolithic_threads: int | None = None
    # Also time generate() as a plain transformers user runs it (no OMP settings, torch's thread count).
    library_defaults_baseline: bool = True
    child_env: dict[str, str] = field(default_factory=dict)
    cache_dir: Path | None = None
    step_timeout_s: float = bench_step_timeout_s


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


class Bench:
    def __init__(self, options: BenchOptions) -> None:
        self.options = options

    def run(self) -> BenchReport:
        from services.demo import resolve_demo_model

        options = self.options
        spec = options.model
        if spec is not None and spec.startswith(RANDOM_PREFIX):
            spec = str(random_checkpoint(spec, options.cache_dir))
        resolved = resolve_demo_model(spec)
        if not 1 <= options.shards <= resolved.num_layers:
            raise BenchError(f"--shards must be between 1 and the model's {resolved.num_layers} layers")
        started_at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        load_before = _load_average()
        max_streams = max(4, options.sessions)
        process_env = {**quiet_torch_environment(options.torch_threads), **options.child_env}
        env = {"HEARTH_RESEARCH__DISTRIBUTED_INFERENCE__MAX_CONCURRENT_PIPELINES": str(max_streams),
               **options.child_env}
        with LocalCluster(torch_threads=options.torch_threads, extra_env=env, log_level="WARNING") as cluster:
            metrics_urls, hop_of = self._start(cluster, resolved, max_streams)
            monolithic_threads = options.monolithic_threads or options.torch_threads
            _progress(f"loading the whole model for generate() in a worker process ({resolved.path}) ...")
            worker = MonolithicWorker(resolved.path, process_env, monolithic_threads,
                                      cluster.work_dir / "monolithic.log")
            # What a plain transformers user gets: this shell's environment, torch's own thread count.
            defaults_worker = MonolithicWorker(resolved.path, {}, None, cluster.work_dir / "monolithic-defaults.log") \
                if options.library_defaults_baseline else None
            workers = [w for w in (worker, defaults_worker) if w is not None]

            def interrupt(signum, frame) -> None:
                # A generate() in a worker would keep asyncio.run's shutdown waiting for its thread.
                for each in workers:
                    each.kill()
                raise KeyboardInterrupt

            previous_handlers = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
            try:
                for each in workers:
                    each.wait_ready()
                self._wait_ready(cluster)
                report = run_event_loop(self._measure(cluster, resolved, worker, defaults_worker, metrics_urls, hop_of))
            finally:
                for signum, handler in previous_handlers.items():
                    signal.signal(signum, handler)
                for each in workers:
                    each.close()
        report.started_at = started_at
        report.settings["process_env"] = process_env
        report.settings["monolithic_torch_threads"] = worker.info.torch_threads if worker.info else None
        if defaults_worker is not None and defaults_worker.info is not None:
            report.settings["library_defaults_torch_threads"] = defaults_worker.info.torch_threads
            report.settings["library_defaults_env"] = {key: value for key, value in os.environ.items()
                                                       if key.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))}
        report.machine["load_average_before"] = load_before
        report.machine["load_average_after"] = _load_average()
        report.targets = self._targets(report)
        return report

    # -------------------------------------------------------------- set-up

    def _start(self, cluster: LocalCluster, model, max_streams: int) -> tuple[dict[str, str], dict[str, int]]:
        options = self.options
        ranges = even_layer_ranges(model.num_layers, options.shards)
        _progress(f"starting nats-server, {len(ranges)} shard hosts ({ranges}) and an orchestrator ...")
        cluster.start_nats()
        metrics_urls, hop_of = {}, {}
        for index, (lo, hi) in enumerate(ranges):
            port = free_tcp_port()
            node_id = f"bench-host-{index}"
            cluster.start_shard(str(model.path), lo, hi, node_id=node_id, wait_ready=False,
                                extra_args=["--metrics-port", str(port), "--max-streams", str(max_streams)])
            shard_id = f"{model.name}:{lo}-{hi}@{node_id}"
            metrics_urls[shard_id] = f"http://127.0.0.1:{port}/metrics"
            hop_of[shard_id] = index
        cluster.start_orchestrator(node_id="bench-orchestrator", wait_ready=False, extra_args=[
            "--preload", str(model.path), "--step-timeout-s", str(options.step_timeout_s)])
        return metrics_urls, hop_of

    def _wait_ready(self, cluster: LocalCluster) -> None:
        for process in cluster.processes:
            cluster.wait_ready(process, timeout_s=cluster_ready_timeout_s)
        _progress("all processes ready")

    # -------------------------------------------------------------- measuring

    async def _measure(self, cluster, model, worker: MonolithicWorker, defaults_worker: MonolithicWorker | None,
                       metrics_urls, hop_of) -> BenchReport:
        from services.common.nats_connection import connect_nats

        options = self.options
        model_ref = str(model.path)
        prompt, prompt_ids = await asyncio.to_thread(worker.prompt, options.prompt_tokens)
        nc = await connect_nats(cluster.nats_url, name="hearth-bench")
        try:
            _progress("warming up both ...")
            await asyncio.to_thread(worker.generate, prompt, warmup_new_tokens)
            if defaults_worker is not None:
                await asyncio.to_thread(defaults_worker.generate, prompt, warmup_new_tokens)
            await pipeline_generation(nc, model_ref, prompt, warmup_new_tokens)
            before = await self._scrape(metrics_urls)
            mono_runs, pipe_runs, defaults_runs = [], [], []
            sides = ["monolithic", "pipeline"] + (["library defaults"] if defaults_worker is not None else [])
            for round_index in range(options.repeats):
                # Rotate which side goes first, so drifting machine load hits all alike.
                order = sides[round_index % len(sides):] + sides[:round_index % len(sides)]
                for which in order:
                    if which == "monolithic":
                        run = await asyncio.to_thread(worker.generate, prompt, options.new_tokens)
                        mono_runs.append(run)
                    elif which == "library defaults":
                        run = await asyncio.to_thread(defaults_worker.generate, prompt, options.new_tokens)
                        defaults_runs.append(run)
                    else:
                        run = await pipeline_generation(nc, model_ref, prompt, options.new_tokens)
                        pipe_runs.append(run)
                    _progress(f"  round {round_index + 1}/{options.repeats} {which:16s}: "
                              f"{run.decode_tokens_per_s:7.2f} tokens/s, ttft {run.ttft_ms:7.1f} ms"
                              + (f", construct {run.construct_ms:.1f} ms" if run.construct_ms is not None else ""))
            after = await self._scrape(metrics_urls)
            delta = {key: histogram.minus(before.get(key)) for key, histogram in after.items()}
            concurrent = None
            if options.sessions > 1:
                concurrent = await self._concurrent(nc, model_ref, worker, metrics_urls, hop_of,
                                                    statistics.median(r.decode_tokens_per_s for r in pipe_runs),
                                                    statistics.median(r.end_s for r in pipe_runs))
        finally:
            await asyncio.wait_for(nc.close(), timeout=5)
        mono, pipe = _side(mono_runs), _side(pipe_runs)
        ratios = [p.decode_tokens_per_s / m.decode_tokens_per_s for p, m in zip(pipe_runs, mono_runs)]
        constructs = sorted(r.construct_ms for r in pipe_runs if r.construct_ms is not None)
        info = worker.info
        return BenchReport(
            started_at="",
            machine={"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                     "torch": info.torch_version},
            model={"spec": options.model or "bundled", "path": str(model.path), "layers": model.num_layers,
                   "parameters": info.parameters, "dtype": info.dtype},
            settings={"shards": options.shards, "layer_ranges": even_layer_ranges(model.num_layers, options.shards),
                      "prompt_tokens": len(prompt_ids), "new_tokens": options.new_tokens, "repeats": options.repeats,
                      "sessions": options.sessions, "process_torch_threads": options.torch_threads,
                      "step_timeout_s": options.step_timeout_s},
            monolithic=mono,
            pipeline=pipe,
            greedy_outputs_match=all(r.token_ids == mono_runs[0].token_ids
                                     for r in [*mono_runs, *pipe_runs, *defaults_runs]),
            monolithic_library_defaults=_side(defaults_runs) if defaults_runs else None,
            ratio_vs_library_defaults=statistics.median(
                p.decode_tokens_per_s / d.decode_tokens_per_s for p, d in zip(pipe_runs, defaults_runs))
            if defaults_runs else None,
            ratio_median=statistics.median(ratios),
            ratio_of_medians=pipe.decode_tokens_per_s_median / mono.decode_tokens_per_s_median,
            pipeline_overhead_ms_per_token=1000.0 / pipe.decode_tokens_per_s_median
            - 1000.0 / mono.decode_tokens_per_s_median,
            construct_ms_p50=statistics.median(constructs) if constructs else None,
            construct_ms_max=constructs[-1] if constructs else None,
            transport_decode=transport_figures(delta, "decode", hop_of),
            transport_prefill=transport_figures(delta, "prefill", hop_of),
            concurrent=concurrent,
            targets=[],
        )

    async def _scrape(self, metrics_urls: dict[str, str]) -> dict[MetricKey, Histogram]:
        merged: dict[MetricKey, Histogram] = {}
        for url in metrics_urls.values():
            merged.update(await asyncio.to_thread(scrape_histograms, url))
        return merged

    async def _concurrent(self, nc, model_ref, worker: MonolithicWorker, metrics_urls, hop_of,
                          single_decode_tps: float, single_end_s: float) -> ConcurrentFigures:
        options = self.options
        prompts = [(await asyncio.to_thread(worker.prompt, options.prompt_tokens, i + 1))[0]
                   for i in range(options.sessions)]
        _progress(f"{options.sessions} concurrent sessions ...")
        before = await self._scrape(metrics_urls)
        started = time.perf_counter()

        async def one(prompt: str) -> tuple[float, GenerationTiming]:
            sent = time.perf_counter() - started
            return sent, await pipeline_generation(nc, model_ref, prompt, options.new_tokens)

        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        wall_s = time.perf_counter() - started
        after = await self._scrape(metrics_urls)
        delta = {key: histogram.minus(before.get(key)) for key, histogram in after.items()}
        first_at = [sent + timing.token_times_s[0] for sent, timing in results]
        done_at = [sent + timing.end_s for sent, timing in results]
        sessions = []
        for index, (sent, timing) in enumerate(results):
            others_done = [done_at[j] for j in range(len(results)) if j != index]
            sessions.append(SessionFigures(
                session=index, tokens=timing.tokens, ttft_ms=timing.ttft_ms, finished_ms=timing.end_s * 1000.0,
                first_token_after_another_finished=any(done <= first_at[index] for done in others_done)))
            _progress(f"  session {index}: ttft {timing.ttft_ms:8.1f} ms, finished after {timing.end_s:6.2f} s, "
                      f"{timing.tokens} tokens")
        total_tokens = sum(timing.tokens for _, timing in results)
        return ConcurrentFigures(
            sessions=sessions, wall_s=wall_s, aggregate_tokens_per_s=total_tokens / wall_s,
            single_session_decode_tokens_per_s=single_decode_tps,
            single_session_end_to_end_tokens_per_s=options.new_tokens / single_end_s,
            transport=transport_figures(delta, "decode", hop_of),
        )

    # -------------------------------------------------------------- verdicts

    def _targets(self, report: BenchReport) -> list[TargetCheck]:
        measured = f"{report.ratio_median:.3f} x generate() with the same thread settings (median of rounds)"
        if report.ratio_vs_library_defaults is not None:
            measured += f"; {report.ratio_vs_library_defaults:.3f} x generate() with library defaults"
        checks = [TargetCheck(target=f"decode tokens/s >= {ratio_target:.2f} x monolithic generate()",
                              measured=measured, met=report.ratio_median >= ratio_target)]
        pooled = next((row for row in report.transport_decode if row.shard_id == "all"), None)
        if pooled is not None and pooled.p95_ms is not None:
            checks.append(TargetCheck(target=f"per-hop transport overhead p95 <= {transport_target_p95_ms} ms (decode)",
                                      measured=f"p95 {pooled.p95_ms:.3f} ms, "
                                               f"{100 * (pooled.share_at_most_1ms or 0):.1f}% "
                                               f"of {pooled.steps} hop-steps <= 1 ms",
                                      met=pooled.p95_ms <= transport_target_p95_ms))
        if report.construct_ms_max is not None:
            checks.append(TargetCheck(target=f"pipeline construction <= {construct_target_ms:.0f} ms",
                                      measured=f"p50 {report.construct_ms_p50:.1f} ms, "
                                               f"max {report.construct_ms_max:.1f} ms",
                                      met=report.construct_ms_max <= construct_target_ms))
        if report.concurrent is not None:
            c = report.concurrent
            # Like for like: the aggregate counts every session's tokens over the wall time from the first
            # request to the last `done` (prefills included), so the single session is counted the same way.
            checks.append(TargetCheck(
                target=f"{len(c.sessions)} sessions: aggregate tokens/s >= single-session tokens/s "
                       "(both: tokens / time from request to done)",
                measured=f"{c.aggregate_tokens_per_s:.2f} vs {c.single_session_end_to_end_tokens_per_s:.2f} "
                         f"(single-session decode-only rate: {c.single_session_decode_tokens_per_s:.2f})",
                met=c.aggregate_tokens_per_s >= c.single_session_end_to_end_tokens_per_s))
            waited = [s.session for s in c.sessions if s.first_token_after_another_finished]
            checks.append(TargetCheck(
                target="no session waits for another to finish before its first token",
                measured=f"latest first token {max(s.ttft_ms for s in c.sessions):.0f} ms, earliest finish "
                         f"{min(s.finished_ms for s in c.sessions):.0f} ms" + (f"; waited: {waited}" if waited else ""),
                met=not waited))
        return checks


# ---------------------------------------------------------------------------------------------- output


def format_report(report: BenchReport) -> str:
    lines = []
    model, settings = report.model, report.settings
    lines.append(f"hearth bench  {report.started_at}  ({report.machine['cpus']} CPUs, torch {report.machine['torch']}, "
                 f"load average {report.machine.get('load_average_before')} -> "
                 f"{report.machine.get('load_average_after')})")
    lines.append(f"model {model['spec']}: {model['layers']} layers, {model['parameters'] / 1e6:.1f}M parameters, "
                 f"{model['dtype']}; {settings['shards']} shards {settings['layer_ranges']}; prompt "
                 f"{settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens, "
                 f"{settings['repeats']} rounds")
    lines.append("")
    lines.append(f"{'':34s}{'decode tokens/s':>16s}{'ttft ms':>10s}")
    lines.append(f"{'generate(), same thread settings':34s}{report.monolithic.decode_tokens_per_s_median:16.2f}"
                 f"{report.monolithic.ttft_ms_median:10.1f}   ({settings.get('monolithic_torch_threads')} threads, "
                 f"{_env_text(settings.get('process_env') or {})})")
    if report.monolithic_library_defaults is not None:
        lines.append(f"{'generate(), library defaults':34s}"
                     f"{report.monolithic_library_defaults.decode_tokens_per_s_median:16.2f}"
                     f"{report.monolithic_library_defaults.ttft_ms_median:10.1f}"
                     f"   ({settings.get('library_defaults_torch_threads')} threads, no OMP settings)")
    lines.append(f"{'pipeline (' + str(settings['shards']) + ' shard processes)':34s}"
                 f"{report.pipeline.decode_tokens_per_s_median:16.2f}{report.pipeline.ttft_ms_median:10.1f}")
    lines.append("greedy outputs: " + ("identical in every run" if report.greedy_outputs_match
                                       else "DIFFER between runs (see --json)"))
    lines.append(f"ratio pipeline / monolithic: {report.ratio_median:.3f} (median of rounds; ratio of medians "
                 f"{report.ratio_of_medians:.3f}); pipeline overhead "
                 f"{report.pipeline_overhead_ms_per_token:.2f} ms/token")
    if report.ratio_vs_library_defaults is not None:
        lines.append(f"ratio pipeline / generate() with library defaults: {report.ratio_vs_library_defaults:.3f}")
    if report.construct_ms_p50 is not None:
        lines.append(f"pipeline construction: p50 {report.construct_ms_p50:.1f} ms, "
                     f"max {report.construct_ms_max:.1f} ms")
    for title, rows in (("per-hop transport overhead, decode steps", report.transport_decode),
                        ("per-hop transport overhead, prefill steps", report.transport_prefill)):
        if not rows:
            continue
        lines.append("")
        lines.append(f"{title} (wire + deserialise + serialise; ms):")
        lines.append(f"  {'hop':34s}{'steps':>7s}{'p50':>8s}{'p95':>8s}{'<=1ms':>8s}{'wire p50':>10s}{'wire p95':>10s}"
                     f"{'deser p95':>10s}{'ser p95':>9s}{'mean':>8s}{'compute mean':>14s}")
        for row in rows:
            label = f"{row.hop}: {row.shard_id}" if row.hop is not None else "all hops"
            lines.append(f"  {label[:34]:34s}{row.steps:7d}{_ms(row.p50_ms):>8s}{_ms(row.p95_ms):>8s}"
                         f"{_pct(row.share_at_most_1ms):>8s}{_ms(row.wire_p50_ms):>10s}{_ms(row.wire_p95_ms):>10s}"
                         f"{_ms(row.deserialize_p95_ms):>10s}{_ms(row.serialize_p95_ms):>9s}{_ms(row.mean_ms):>8s}"
                         f"{_ms(row.compute_mean_ms):>14s}")
    if report.concurrent is not None:
        c = report.concurrent
        lines.append("")
        lines.append(f"{len(c.sessions)} concurrent sessions: aggregate {c.aggregate_tokens_per_s:.2f} tokens/s over "
                     f"{c.wall_s:.2f} s (single session: {c.single_session_decode_tokens_per_s:.2f} decode, "
                     f"{c.single_session_end_to_end_tokens_per_s:.2f} end to end)")
        for s in c.sessions:
            lines.append(f"  session {s.session}: first token after {s.ttft_ms:8.1f} ms, finished after "
                         f"{s.finished_ms:9.1f} ms, {s.tokens} tokens"
                         + ("  <- first token only after another session finished"
                            if s.first_token_after_another_finished else ""))
        pooled = next((row for row in c.transport if row.shard_id == "all"), None)
        if pooled is not None:
            lines.append(f"  transport overhead under load (decode, all hops): p50 {_ms(pooled.p50_ms)} ms, "
                         f"p95 {_ms(pooled.p95_ms)} ms")
    lines.append("")
    lines.append("targets:")
    for check in report.targets:
        lines.append(f"  [{'met' if check.met else 'MISSED'}] {check.target}: {check.measured}")
    return "\n".join(lines)


def _env_text(env: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in env.items() if key.startswith(("OMP_", "GOMP_", "KMP_")))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def run_bench_command(options: BenchOptions, *, as_json: bool) -> int:
    """`hearth bench`: progress on stderr, the report (text or JSON) on stdout; 0 even when a target is missed."""
    from services.cluster import ClusterError
    from services.demo import DemoError

    import logging

    # Progress and the report are this process's output; its library log lines (a NATS disconnect on
    # close) would only clutter them. The processes it starts log to files in their work directory.
    logging.getLogger().setLevel(max(logging.getLogger().level, logging.ERROR))
    try:
        report = Bench(options).run()
    except (BenchError, ClusterError, DemoError) as error:
        print(f"hearth bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hearth bench: interrupted", file=sys.stderr)
        return 130
    print(report.model_dump_json(indent=2) if as_json else format_report(report))
    return 0


if __name__ == "__main__":
    monolithic_worker_main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
