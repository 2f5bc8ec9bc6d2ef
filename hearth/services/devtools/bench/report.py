"""The `hearth bench` report: its figures as pydantic models (the --json output) and their text rendering."""

from __future__ import annotations

import statistics

from pydantic import BaseModel

from hearth.services.devtools.bench.burst import BurstFigures, burst_lines
from hearth.services.devtools.bench.timing import GenerationTiming


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
    # Tokens after every session had its first one / time from then to the last token: the rate while all decode
    # (the aggregate also counts the prefills and the tail where fewer are left).
    all_decoding_tokens_per_s: float | None = None
    # Per shard id: session rows per batched decode step during the run (continuous batching; 1.0: none).
    mean_batch_rows: dict[str, float] = {}
    # The same for batched prefills (short prompts of several sessions prefilled together).
    mean_prefill_batch_rows: dict[str, float] = {}
    # Per shard id: KV-cache evictions and CUDA graph captures during the run (shards with neither left out): many
    # of either mean the sessions did not fit the KV budget, or kept changing their batches' members on a GPU.
    cache_events: dict[str, dict[str, int]] = {}
    # Whether every session's tokens equal generate()'s for its prompt alone (batched steps round differently from
    # solo ones; greedy tokens must not change). None in reports from before the check.
    outputs_match_solo: bool | None = None
    # Leading tokens every session shares with its prompt alone through generate() (all when they match).
    solo_tokens_agreeing: int | None = None


class TokenBudget(BaseModel):
    """Means per decode token, in ms: the token's time (1000 / the median decode tokens/s), the hops' compute and
    transport summed over the hops, the orchestrator's turn and the head step inside it, and the rest (the legs'
    hand-offs between event loops and threads that no histogram times, and the last leg back to the orchestrator).
    None where a figure was not measured (metrics off)."""

    token_ms: float
    hops_compute_ms: float | None
    hops_transport_ms: float | None
    orchestrator_turn_ms: float | None
    head_step_ms: float | None
    other_ms: float | None


class TargetCheck(BaseModel):
    target: str
    measured: str
    met: bool


class ShardMemory(BaseModel):
    """What one shard advertised it holds on its device (measured weights plus its KV reserve), and its process's
    resident memory in MiB (hearth/services/devtools/bench/process_stats.py) after the run and at its peak (loading
    included), the former split into anonymous memory and mapped files' pages; None where the process could not be
    read."""

    shard_id: str
    device: str
    memory_required_mb: float
    rss_mb: float | None = None
    peak_rss_mb: float | None = None
    rss_anonymous_mb: float | None = None
    rss_file_mb: float | None = None


class ImportsMemory(BaseModel):
    """The resident memory (MiB) of a Python that imported what a shard imports and loaded no weight: the part of
    each shard's RSS that is not its layers."""

    rss_mb: float
    rss_anonymous_mb: float
    rss_file_mb: float


def with_resident_memory(figures: list[ShardMemory], pid_of: dict[str, int]) -> list[ShardMemory]:
    """`figures` with each shard's process's resident memory read now (`pid_of`: shard id -> process id)."""
    from hearth.services.devtools.bench.process_stats import resident_memory

    measured = []
    for each in figures:
        pid = pid_of.get(each.shard_id)
        try:
            memory = resident_memory(pid) if pid is not None else None
        except OSError:  # the process has gone
            memory = None
        measured.append(each if memory is None else each.model_copy(update={
            "rss_mb": memory.rss_mb, "peak_rss_mb": memory.peak_rss_mb, "rss_anonymous_mb": memory.anonymous_mb,
            "rss_file_mb": memory.file_mb}))
    return measured


async def shard_memory_figures(nc) -> list[ShardMemory]:
    """Every shard's newest advertisement in the event log, as memory figures."""
    import contextlib

    from hearth.events.consume import read_stream
    from hearth.events.models import ShardAdvertised
    from hearth.events.streams import SHARDS_STREAM

    newest: dict[str, ShardMemory] = {}
    async with contextlib.aclosing(read_stream(nc.jetstream(), SHARDS_STREAM)) as messages:
        async for message in messages:
            event = getattr(message, "event", None)
            if isinstance(event, ShardAdvertised):
                device = f"{event.device_kind or 'cpu'} {event.device_name or ''}".strip()
                newest[event.shard_id] = ShardMemory(shard_id=event.shard_id, device=device,
                                                     memory_required_mb=event.memory_required_mb)
    return sorted(newest.values(), key=lambda figures: figures.shard_id)


class BenchReport(BaseModel):
    started_at: str
    machine: dict[str, object]
    model: dict[str, object]
    settings: dict[str, object]
    monolithic: Side
    pipeline: Side
    greedy_outputs_match: bool
    # Leading tokens every round shares with generate()'s first (all of them when greedy_outputs_match).
    greedy_tokens_agreeing: int | None = None
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
    # Where a decode token's time went in the pipeline runs (hearth/services/devtools/bench/token_budget.py); None in
    # reports from before.
    token_budget: TokenBudget | None = None
    concurrent: ConcurrentFigures | None
    targets: list[TargetCheck]
    # `--burst N`: N requests sent at once (hearth/services/devtools/bench/burst.py).
    burst: BurstFigures | None = None
    shard_memory: list[ShardMemory] = []
    shard_imports_memory: ImportsMemory | None = None
    # The orchestrator's verification checks during the measured pipeline rounds, per outcome
    # (hearth/services/devtools/bench/verification_metrics.py); None with metrics off or in reports from before.
    verification_checks: dict[str, int] | None = None


def side_figures(runs: list[GenerationTiming]) -> Side:
    figures = [RunFigures(decode_tokens_per_s=r.decode_tokens_per_s, ttft_ms=r.ttft_ms, tokens=r.tokens,
                          construct_ms=r.construct_ms) for r in runs]
    return Side(runs=figures, decode_tokens_per_s_median=statistics.median(r.decode_tokens_per_s for r in runs),
                ttft_ms_median=statistics.median(r.ttft_ms for r in runs))


def baseline_name(settings: dict) -> str:
    """What the pipeline is compared with: transformers' generate(), or for a GGUF hearth's own one-process path
    (bench/monolithic.py)."""
    return "one process" if settings.get("monolithic_baseline") == "hearth_local" else "generate()"


def format_report(report: BenchReport) -> str:
    lines = []
    model, settings = report.model, report.settings
    lines.append(f"hearth bench  {report.started_at}  ({report.machine['cpus']} CPUs, torch {report.machine['torch']}, "
                 f"load average {report.machine.get('load_average_before')} -> "
                 f"{report.machine.get('load_average_after')})")
    lines.append(f"model {model['spec']}: {model['layers']} layers, {model['parameters'] / 1e6:.1f}M parameters, "
                 f"{model['dtype']}, weights {settings.get('quantization', 'none')}; {settings['shards']} shards "
                 f"{settings['layer_ranges']}; prompt "
                 f"{settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens, "
                 f"{settings['repeats']} rounds")
    lines.append(verification_line(report))
    lines.append("")
    lines.append(f"{'':34s}{'decode tokens/s':>16s}{'ttft ms':>10s}")
    baseline = baseline_name(settings)
    lines.append(f"{baseline + ', same thread settings':34s}{report.monolithic.decode_tokens_per_s_median:16.2f}"
                 f"{report.monolithic.ttft_ms_median:10.1f}   ({settings.get('monolithic_torch_threads')} threads, "
                 f"{_env_text(settings.get('process_env') or {})})")
    if report.monolithic_library_defaults is not None:
        lines.append(f"{baseline + ', library defaults':34s}"
                     f"{report.monolithic_library_defaults.decode_tokens_per_s_median:16.2f}"
                     f"{report.monolithic_library_defaults.ttft_ms_median:10.1f}"
                     f"   ({settings.get('library_defaults_torch_threads')} threads, no OMP settings)")
    lines.append(f"{'pipeline (' + str(settings['shards']) + ' shard processes)':34s}"
                 f"{report.pipeline.decode_tokens_per_s_median:16.2f}{report.pipeline.ttft_ms_median:10.1f}")
    lines.append("greedy outputs: " + ("identical in every run" if report.greedy_outputs_match
                                       else "DIFFER between runs (see --json)"
                                       + (f"; the first {report.greedy_tokens_agreeing} tokens agree in every run"
                                          if report.greedy_tokens_agreeing is not None else "")))
    lines.append(f"ratio pipeline / monolithic: {report.ratio_median:.3f} (median of rounds; ratio of medians "
                 f"{report.ratio_of_medians:.3f}); pipeline overhead "
                 f"{report.pipeline_overhead_ms_per_token:.2f} ms/token")
    if report.ratio_vs_library_defaults is not None:
        lines.append(f"ratio pipeline / {baseline} with library defaults: {report.ratio_vs_library_defaults:.3f}")
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
    if report.token_budget is not None:
        lines.append("")
        lines.append(budget_line(report.token_budget))
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
        if c.outputs_match_solo is not None:
            lines.append("  answers: " + (f"each equals {baseline} of its prompt alone" if c.outputs_match_solo
                                          else f"SOME DIFFER from {baseline} of their prompt alone"))
        if c.all_decoding_tokens_per_s is not None:
            lines.append(f"  while all {len(c.sessions)} decode: {c.all_decoding_tokens_per_s:.2f} tokens/s")
        if c.mean_batch_rows:
            lines.append("  mean decode batch (session rows per batched step): " + ", ".join(
                f"{shard_id} {rows:.2f}" for shard_id, rows in c.mean_batch_rows.items()))
        if c.mean_prefill_batch_rows:
            lines.append("  mean prefill batch (session rows per batched step): " + ", ".join(
                f"{shard_id} {rows:.2f}" for shard_id, rows in c.mean_prefill_batch_rows.items()))
        if c.cache_events:
            lines.append("  KV evictions / CUDA graph captures: " + ", ".join(
                f"{shard_id} {counts['kv_evictions']} / {counts['graph_captures']}"
                for shard_id, counts in c.cache_events.items()))
        pooled = next((row for row in c.transport if row.shard_id == "all"), None)
        if pooled is not None:
            lines.append(f"  transport overhead under load (decode, all hops): p50 {_ms(pooled.p50_ms)} ms, "
                         f"p95 {_ms(pooled.p95_ms)} ms")
    if report.burst is not None:
        lines.append("")
        lines.extend(burst_lines(report.burst))
    if report.shard_memory:
        lines.append("")
        lines.extend(shard_memory_lines(report))
    lines.append("")
    lines.append("targets:")
    for check in report.targets:
        lines.append(f"  [{'met' if check.met else 'MISSED'}] {check.target}: {check.measured}")
    return "\n".join(lines)


def verification_line(report: BenchReport) -> str:
    """The requests' verification level, the replicas per layer range and what the checks found."""
    settings = report.settings
    line = (f"verification {settings.get('verify', 'not recorded')}, {settings.get('replicas', 1)} replica(s) per "
            "layer range")
    if report.verification_checks is not None:
        line += "; checks in the measured rounds: " + ", ".join(
            f"{outcome} {count}" for outcome, count in report.verification_checks.items())
    return line


def shard_memory_lines(report: BenchReport) -> list[str]:
    """The per-shard memory table: the advertised need beside the process's resident memory."""
    settings = report.settings
    lines = [f"memory per shard, MiB ({settings.get('device')}, {settings.get('dtype')}, weights "
             f"{settings.get('quantization', 'none')}; advertised: weights measured on the device after loading plus "
             "the KV reserve; RSS: the process after the run, anonymous + mapped files, and its peak):",
             f"  {'shard':48s}{'device':>12s}{'advertised':>12s}{'RSS':>9s}{'anon':>9s}{'files':>9s}{'peak RSS':>10s}"]
    for figures in report.shard_memory:
        lines.append(f"  {figures.shard_id[:48]:48s}{figures.device[:12]:>12s}{figures.memory_required_mb:12.1f}"
                     f"{_mb(figures.rss_mb):>9s}{_mb(figures.rss_anonymous_mb):>9s}{_mb(figures.rss_file_mb):>9s}"
                     f"{_mb(figures.peak_rss_mb):>10s}")
    imports = report.shard_imports_memory
    if imports is not None:
        lines.append(f"  a shard's imports alone (no weights): RSS {imports.rss_mb:.1f} (anon "
                     f"{imports.rss_anonymous_mb:.1f}, files {imports.rss_file_mb:.1f}); RSS minus this is the "
                     "layers' part")
    return lines


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _env_text(env: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in env.items() if key.startswith(("OMP_", "GOMP_", "KMP_")))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def budget_line(budget: TokenBudget) -> str:
    """The split as one line of the text report."""
    def ms(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    return (f"a decode token: {budget.token_ms:.2f} ms = hops' compute {ms(budget.hops_compute_ms)} + hops' "
            f"transport {ms(budget.hops_transport_ms)} + the orchestrator's turn {ms(budget.orchestrator_turn_ms)} "
            f"(head step {ms(budget.head_step_ms)}) + other {ms(budget.other_ms)} (ms, means)")
