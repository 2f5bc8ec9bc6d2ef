"""The households sweep of scripts/bench_links.py: decode tokens/s and time to first token of a mesh whose shard hosts
sit in households behind links of a set RTT (the latency relay) and bandwidth (tc tbf), one session and several.

The broker, the orchestrator and the client live in the hub; each of `households` shard hosts serves an even share of
the model's layers from a household of its own and reaches the broker through its link's relay. A decode step goes
orchestrator -> hop 0 -> hop 1 -> ... -> orchestrator through the broker in the hub, so every hop's input and output
crosses its household's link once each way: a token crosses 2 x households relay legs of RTT/2, households x RTT in
all (LEGS_PER_HOUSEHOLD). The physical limit of a point is the compute time per token measured at 0 ms on the same
bandwidth plus that latency (links_report.py). Results belong in BENCHMARKS.md, "Households over real links".
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hearth.services.devtools.bench.errors import BenchError  # noqa: E402
from hearth.services.devtools.bench.mesh import bench_cluster_env  # noqa: E402
from hearth.services.devtools.bench.pipeline import pipeline_generation  # noqa: E402
from hearth.services.devtools.bench.prompts import build_prompt  # noqa: E402
from hearth.services.devtools.bench.timing import GenerationTiming  # noqa: E402
from hearth.services.devtools.local_cluster import LocalCluster, even_layer_ranges  # noqa: E402
from hearth.services.devtools.netbed import NetBed  # noqa: E402
from hearth.services.devtools.random_models import RANDOM_PREFIX, random_checkpoint  # noqa: E402

# A hop's input comes down its household's link and its output goes up it: two relay legs of RTT/2 per household.
LEGS_PER_HOUSEHOLD = 2
NODE_PREFIX = "household"
# The first call after the mesh is ready may still find a host unadvertised: retried this long.
warm_up_timeout_s = 120.0
warm_up_retry_s = 2.0
# A slow prefill through a 20 Mbit/s link on a busy 2-core machine takes tens of seconds before its first frame.
first_frame_timeout_s = 300.0
frame_gap_timeout_s = 120.0


@dataclass
class SweepOptions:
    model: str
    households: int
    rtts_ms: list[float]
    rates_mbit: list[float]
    prompt_tokens: int
    new_tokens: int
    sessions: int
    repeats: int
    long_prompt_tokens: int
    long_prompt_rates_mbit: list[float]
    long_prompt_rtts_ms: list[float]
    torch_threads: int
    paired: bool = True


@dataclass
class PointResult:
    """One (bandwidth, RTT, sessions) point as the client saw it."""

    rate_mbit: float
    rtt_ms: float
    sessions: int
    # 1 session: the median run's decode tokens/s; several: all sessions' tokens while every one was decoding.
    decode_tokens_per_s: float
    ttft_ms: float
    # Several sessions: every token over the wall time from the first request to the last token.
    end_to_end_tokens_per_s: float
    runs_decode_tokens_per_s: list[float] = field(default_factory=list)
    # 1 session above 0 ms: runs at 0 ms taken in turn with this point's, so that the compute time per token its
    # limit is made of saw the same machine load (the machine is shared); None: not paired.
    paired_zero_decode_tokens_per_s: float | None = None


@dataclass
class LongPromptResult:
    rate_mbit: float
    rtt_ms: float
    prompt_tokens: int
    ttft_ms: float
    # Bytes each household's link carried out of it during the call (tc's counter on the household end).
    bytes_up_per_household: list[int] = field(default_factory=list)


@dataclass
class SweepResult:
    model: str
    households: int
    layer_ranges: list[tuple[int, int]]
    prompt_tokens: int
    new_tokens: int
    legs_per_token: int
    started_at: str
    load_average_before: list[float]
    load_average_after: list[float] = field(default_factory=list)
    points: list[PointResult] = field(default_factory=list)
    long_prompts: list[LongPromptResult] = field(default_factory=list)


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def all_decoding_tokens_per_s(timings: list[GenerationTiming]) -> float:
    """Tokens/s of every session together while all of them were decoding (from the last first token to the
    first last token)."""
    window_start = max(timing.token_times_s[0] for timing in timings)
    window_end = min(timing.token_times_s[-1] for timing in timings)
    if window_end <= window_start:
        spans = ", ".join(f"{timing.token_times_s[0]:.1f}-{timing.token_times_s[-1]:.1f} s" for timing in timings)
        raise BenchError(f"the sessions never decoded all at once (first to last token: {spans})")
    inside = sum(1 for timing in timings for at in timing.token_times_s if window_start < at <= window_end)
    return inside / (window_end - window_start)


class LinksSweep:
    """Builds the bed and the mesh once, then measures every point; `run()` returns the SweepResult."""

    def __init__(self, options: SweepOptions) -> None:
        self.options = options
        self.model_path = Path(random_checkpoint(options.model)) if options.model.startswith(RANDOM_PREFIX) \
            else Path(options.model)

    @property
    def max_streams(self) -> int:
        """Calls at once per shard host and orchestrator: the sessions, and room for the call before them whose
        hops are still closing when they start."""
        return max(4, self.options.sessions + 1)

    def run(self) -> SweepResult:
        options = self.options
        config = json.loads((self.model_path / "config.json").read_text())
        ranges = even_layer_ranges(config["num_hidden_layers"], options.households)
        result = SweepResult(options.model, options.households, ranges, options.prompt_tokens, options.new_tokens,
                             LEGS_PER_HOUSEHOLD * options.households,
                             time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), _load_average())
        env = bench_cluster_env(self.max_streams, secure=True, child_env={})
        with tempfile.TemporaryDirectory(prefix="hearth-links-") as work_dir, \
                NetBed(households=options.households) as bed, bed.entered(bed.hub), \
                LocalCluster(work_dir=Path(work_dir), torch_threads=options.torch_threads, extra_env=env, tls=True,
                             tls_host_names=(bed.hub.address,), prefork=False, metrics=False,
                             log_level="WARNING") as cluster:
            cluster.start_nats(host=bed.hub.address)
            relay = bed.start_relay(cluster.nats.port)
            _progress(f"starting {len(ranges)} shard hosts ({ranges}), one per household, and an orchestrator ...")
            for index, (lo, hi) in enumerate(ranges):
                cluster.start_shard(str(self.model_path), lo, hi, node_id=f"{NODE_PREFIX}-{index}", wait_ready=False,
                                    command_prefix=bed.households[index].exec_prefix(),
                                    nats_url=bed.relay_url(index),
                                    extra_args=["--max-streams", str(self.max_streams)])
            cluster.start_orchestrator(wait_ready=False, command_prefix=bed.hub.exec_prefix(),
                                       extra_args=["--preload", str(self.model_path)])
            cluster.wait_all_ready()
            try:
                asyncio.run(self._measure(cluster, bed, relay, result))
            finally:
                for index in range(options.households):
                    bed.unshape(index)
        result.load_average_after = _load_average()
        return result

    def _set_links(self, bed: NetBed, relay, rate_mbit: float, rtt_ms: float) -> None:
        for index in range(len(bed.households)):
            bed.shape(index, rate_mbit)
        self._set_rtts(bed, relay, rtt_ms)

    @staticmethod
    def _set_rtts(bed: NetBed, relay, rtt_ms: float) -> None:
        for index in range(len(bed.households)):
            relay.set_rtt(bed.relay_port(index), rtt_ms)

    async def _measure(self, cluster: LocalCluster, bed: NetBed, relay, result: SweepResult) -> None:
        from hearth.services.broker.connection import connect_nats
        from transformers import AutoTokenizer

        options = self.options
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        prompts = [build_prompt(tokenizer, self.model_path, options.prompt_tokens, variant)[0]
                   for variant in range(options.sessions + 1)]
        nc = await connect_nats(cluster.nats_url, name="bench-links", settings=cluster.nats_settings())
        try:
            await self._warm_up(nc, prompts[0])
            for rate_mbit in options.rates_mbit:
                for rtt_ms in options.rtts_ms:
                    await asyncio.to_thread(self._set_links, bed, relay, rate_mbit, rtt_ms)
                    result.points.append(await self._one_session(nc, prompts[0], rate_mbit, rtt_ms,
                                                                 lambda ms: self._set_rtts(bed, relay, ms)))
                    if options.sessions > 1:
                        result.points.append(await self._concurrent(nc, prompts[1:], rate_mbit, rtt_ms))
            if options.long_prompt_tokens:
                long_prompt = build_prompt(tokenizer, self.model_path, options.long_prompt_tokens, 99)[0]
                for rate_mbit in options.long_prompt_rates_mbit:
                    for rtt_ms in options.long_prompt_rtts_ms:
                        await asyncio.to_thread(self._set_links, bed, relay, rate_mbit, rtt_ms)
                        result.long_prompts.append(await self._long_prompt(nc, bed, long_prompt, rate_mbit, rtt_ms))
        finally:
            await asyncio.wait_for(nc.close(), timeout=10)

    async def _generate(self, nc, prompt: str, new_tokens: int) -> GenerationTiming:
        return await pipeline_generation(nc, str(self.model_path), prompt, new_tokens,
                                         first_frame_timeout=first_frame_timeout_s,
                                         frame_gap_timeout=frame_gap_timeout_s)

    async def _warm_up(self, nc, prompt: str) -> None:
        deadline = time.monotonic() + warm_up_timeout_s
        while True:
            try:
                await self._generate(nc, prompt, self.options.new_tokens)
                return
            except BenchError as refused:
                if time.monotonic() > deadline:
                    raise
                _progress(f"warm-up call refused, retrying: {refused}")
                await asyncio.sleep(warm_up_retry_s)

    async def _one_session(self, nc, prompt: str, rate_mbit: float, rtt_ms: float, set_rtts) -> PointResult:
        """`repeats` runs at `rtt_ms`; above 0 ms (and with `paired`), each after one at 0 ms."""
        runs, zero_runs = [], []
        for _ in range(self.options.repeats):
            if rtt_ms and self.options.paired:
                await asyncio.to_thread(set_rtts, 0.0)
                zero_runs.append(await self._generate(nc, prompt, self.options.new_tokens))
                await asyncio.to_thread(set_rtts, rtt_ms)
            runs.append(await self._generate(nc, prompt, self.options.new_tokens))
        median = sorted(runs, key=lambda run: run.decode_tokens_per_s)[len(runs) // 2]
        paired = statistics.median(run.decode_tokens_per_s for run in zero_runs) if zero_runs else None
        point = PointResult(rate_mbit, rtt_ms, 1, median.decode_tokens_per_s, median.ttft_ms,
                            median.tokens / median.end_s, [run.decode_tokens_per_s for run in runs], paired)
        _progress(f"{rate_mbit:6g} Mbit/s {rtt_ms:4g} ms  1 session : {point.decode_tokens_per_s:7.2f} tokens/s, "
                  f"ttft {point.ttft_ms:7.1f} ms" + ("" if paired is None else f" (0 ms in turn: {paired:.2f})"))
        return point

    async def _concurrent(self, nc, prompts: list[str], rate_mbit: float, rtt_ms: float) -> PointResult:
        started = time.perf_counter()

        async def one(prompt: str) -> tuple[float, GenerationTiming]:
            sent_at = time.perf_counter() - started
            return sent_at, await self._generate(nc, prompt, self.options.new_tokens)

        results = await asyncio.gather(*(one(prompt) for prompt in prompts))
        wall_s = time.perf_counter() - started
        # On one clock: each session's token times from the sweep's start.
        shifted = [GenerationTiming(token_times_s=[sent_at + at for at in timing.token_times_s])
                   for sent_at, timing in results]
        point = PointResult(rate_mbit, rtt_ms, len(prompts), all_decoding_tokens_per_s(shifted),
                            statistics.median(timing.ttft_ms for _, timing in results),
                            sum(timing.tokens for _, timing in results) / wall_s)
        _progress(f"{rate_mbit:6g} Mbit/s {rtt_ms:4g} ms {len(prompts)} sessions: "
                  f"{point.decode_tokens_per_s:7.2f} tokens/s while all decode, "
                  f"{point.end_to_end_tokens_per_s:7.2f} end to end, median ttft {point.ttft_ms:7.1f} ms")
        return point

    async def _long_prompt(self, nc, bed: NetBed, prompt: str, rate_mbit: float, rtt_ms: float) -> LongPromptResult:
        households = range(len(bed.households))
        before = [bed.shaped_counters(index)["sent"] for index in households]
        timing = await self._generate(nc, prompt, 2)
        after = [bed.shaped_counters(index)["sent"] for index in households]
        long_result = LongPromptResult(rate_mbit, rtt_ms, self.options.long_prompt_tokens, timing.ttft_ms,
                                       [a - b for a, b in zip(after, before, strict=True)])
        _progress(f"{rate_mbit:6g} Mbit/s {rtt_ms:4g} ms {self.options.long_prompt_tokens}-token prompt: ttft "
                  f"{timing.ttft_ms:8.1f} ms, bytes up per household {long_result.bytes_up_per_household}")
        return long_result


def run_sweep(options: SweepOptions, json_path: Path | None) -> SweepResult:
    result = LinksSweep(options).run()
    if json_path is not None:
        json_path.write_text(json.dumps(asdict(result), indent=1))
        _progress(f"wrote {json_path}")
    return result
