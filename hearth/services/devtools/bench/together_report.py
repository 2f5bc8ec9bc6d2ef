"""The `hearth bench --pin-cores N` report: its figures as pydantic models (the --json output), the arithmetic that
turns timed sessions into aggregate tokens/s, the target verdicts, and the text rendering."""

from __future__ import annotations

import statistics

from pydantic import BaseModel

from hearth.services.devtools.bench.report import TargetCheck
from hearth.services.devtools.bench.timing import GenerationTiming

together_target_ratio = 0.8


class PinnedProcess(BaseModel):
    """One process of the run, the cores the kernel lets it use (read while it ran), and what it was pinned to."""

    name: str
    pid: int
    cpus_allowed: str
    pinned_to: list[int] | None


class BaselineFigures(BaseModel):
    """One way of running the whole model in one process on one core, decoding one session."""

    path: str
    decode_tokens_per_s: list[float]
    end_to_end_tokens_per_s: list[float]
    decode_tokens_per_s_median: float
    end_to_end_tokens_per_s_median: float
    # The fastest run: a shared machine's neighbours only ever slow a run down, so this is the core's own speed.
    decode_tokens_per_s_best: float
    end_to_end_tokens_per_s_best: float
    # CPU time the process used per generated token (median over the runs): what a token costs whatever the load.
    cpu_ms_per_token: float


class SessionsRun(BaseModel):
    """M sessions sent at once to the pinned mesh, once."""

    sessions: int
    repeat: int
    load_average_1m: float | None
    wall_s: float
    tokens: int
    # All sessions' tokens / wall time from sending the first request to the last `done`.
    aggregate_tokens_per_s: float
    # Tokens after every session had its first token (all prefills done) / time from then to the last token.
    decode_aggregate_tokens_per_s: float | None
    ratio: float
    decode_ratio: float | None
    outputs_match_solo: bool
    # CPU seconds each process (or group) used during the run, and the same per generated token in ms.
    cpu_s: dict[str, float]
    cpu_ms_per_token: dict[str, float]
    # Baseline CPU per token / the mesh's (shards, orchestrator, nats-server): the ratio if the N cores did
    # nothing else and stayed busy; the measured ratio falls short of it by neighbours' load and idle cores.
    cpu_time_ratio: float
    # CPU seconds of the mesh's processes / wall seconds: how many of the cores the mesh got (at most N + the
    # orchestrator's and nats-server's share of them).
    mesh_cores_used: float = 0.0
    # End-to-end tokens/s of the baseline runs just before and just after this run, and the ratio against
    # their mean: the like-for-like figure when the machine's load drifts.
    baseline_around: list[float] = []
    paired_ratio: float | None = None


class TogetherReport(BaseModel):
    started_at: str
    machine: dict
    model: dict
    settings: dict
    pinned: list[PinnedProcess]
    baselines: list[BaselineFigures]
    baseline_used: str
    baseline_end_to_end_tokens_per_s: float
    baseline_decode_tokens_per_s: float
    # transformers generate() and hearth's one-process path give the same greedy tokens for the first prompt.
    baseline_paths_agree: bool
    # End-to-end tokens/s of the baseline runs between the mesh runs (one before the first, one after each).
    baseline_between: list[float] = []
    runs: list[SessionsRun]
    targets: list[TargetCheck] = []


def baseline_figures(path: str, runs: list[GenerationTiming], cpu_s: list[float]) -> BaselineFigures:
    """The figures of one baseline path from its timed runs and the CPU seconds each run used."""
    decode = [run.decode_tokens_per_s for run in runs]
    end_to_end = [run.tokens / run.end_s for run in runs]
    return BaselineFigures(path=path, decode_tokens_per_s=decode, end_to_end_tokens_per_s=end_to_end,
                           cpu_ms_per_token=statistics.median(1000 * s / run.tokens for s, run in zip(cpu_s, runs)),
                           decode_tokens_per_s_median=statistics.median(decode),
                           end_to_end_tokens_per_s_median=statistics.median(end_to_end),
                           decode_tokens_per_s_best=max(decode), end_to_end_tokens_per_s_best=max(end_to_end))


def aggregate_rates(results: list[tuple[float, GenerationTiming]], wall_s: float) -> tuple[float, float | None]:
    """(end-to-end, decode-only) aggregate tokens/s of sessions given as (seconds from the first request to this
    session's request, its timing)."""
    stamps = [sent + at for sent, timing in results for at in timing.token_times_s]
    end_to_end = len(stamps) / wall_s
    all_decoding_from = max(sent + timing.token_times_s[0] for sent, timing in results if timing.token_times_s)
    decoded = [at for at in stamps if at > all_decoding_from]
    if not decoded or max(decoded) <= all_decoding_from:
        return end_to_end, None
    return end_to_end, len(decoded) / (max(decoded) - all_decoding_from)


def together_checks(report: TogetherReport) -> list[TargetCheck]:
    """Per session count: the median paired ratio over its repeats (the ratio to the fastest baseline run where
    there is none) against the 0.8 x N x one-core target; the outputs must equal the solo runs'."""
    cores = len(report.machine["cores_used"])
    checks = []
    for count in sorted({run.sessions for run in report.runs}):
        runs = [run for run in report.runs if run.sessions == count]
        ratio = statistics.median(run.ratio for run in runs)
        paired = statistics.median(run.ratio if run.paired_ratio is None else run.paired_ratio for run in runs)
        decode = [run.decode_ratio for run in runs if run.decode_ratio is not None]
        checks.append(TargetCheck(
            target=f"{cores} pinned shards, {count} sessions: aggregate tokens/s >= {together_target_ratio} x "
                   f"{cores} x one process on one core",
            measured=f"{paired:.3f} paired with the baseline runs around each (median of {len(runs)}); "
                     f"{ratio:.3f} vs the fastest baseline run"
                     + (f" ({statistics.median(decode):.3f} decode-only)" if decode else "")
                     + ("" if all(run.outputs_match_solo for run in runs) else "; OUTPUTS DIFFER from solo runs"),
            met=paired >= together_target_ratio and all(run.outputs_match_solo for run in runs)))
    return checks


def format_together_report(report: TogetherReport) -> str:
    machine, settings = report.machine, report.settings
    lines = [
        f"hearth bench --pin-cores {len(machine['cores_used'])}  {report.started_at}",
        f"machine: {machine['cpus_available']} cores available to this process (of {machine['cpu_count']}); "
        f"shards pinned to {machine['cores_used']}; orchestrator, nats-server and this client unpinned; "
        f"load average before {machine['load_average_before']}, after {machine['load_average_after']}",
        f"model: {report.model['spec']} ({report.model['layers']} layers), layer ranges {settings['layer_ranges']}, "
        f"prompt {settings['prompt_tokens']} tokens, {settings['new_tokens']} new tokens, greedy, torch threads 1",
        "", "processes (Cpus_allowed_list read from /proc while they ran):",
        *(f"  {p.name:32s} pid {p.pid:7d}  cpus {p.cpus_allowed:6s}  pinned to {p.pinned_to}" for p in report.pinned),
        "", "baseline: one process, the whole model, core "
            f"{machine['cores_used'][0]}, one session (tokens/s end to end | decode only; median, best run):",
    ]
    for side in report.baselines:
        lines.append(f"  {side.path:24s} median {side.end_to_end_tokens_per_s_median:7.2f} | "
                     f"{side.decode_tokens_per_s_median:7.2f}   best {side.end_to_end_tokens_per_s_best:7.2f} | "
                     f"{side.decode_tokens_per_s_best:7.2f}   CPU {side.cpu_ms_per_token:.0f} ms/token")
    lines += [f"  used: the best run of either path, {report.baseline_end_to_end_tokens_per_s:.2f} | "
              f"{report.baseline_decode_tokens_per_s:.2f} ({report.baseline_used} end to end); "
              f"greedy tokens of both paths agree: {report.baseline_paths_agree}", "",
              "mesh runs (aggregate tokens/s end to end | decode only; ratio = aggregate / (N x baseline)):"]
    for run in report.runs:
        decode = f"{run.decode_aggregate_tokens_per_s:7.2f}" if run.decode_aggregate_tokens_per_s else "     -"
        cpu = ", ".join(f"{name} {ms:.0f}" for name, ms in run.cpu_ms_per_token.items())
        lines.append(f"  M={run.sessions:2d} #{run.repeat + 1} load {run.load_average_1m}: {run.tokens} tokens in "
                     f"{run.wall_s:6.2f} s = {run.aggregate_tokens_per_s:7.2f} | {decode} tok/s, ratio "
                     f"{run.ratio:.3f}" + (f" | {run.decode_ratio:.3f}" if run.decode_ratio else "")
                     + (f", paired {run.paired_ratio:.3f}" if run.paired_ratio is not None else "")
                     + f", same as solo: {run.outputs_match_solo}")
        lines.append(f"        CPU ms per token: {cpu}; CPU-time ratio {run.cpu_time_ratio:.3f}; "
                     f"cores used {run.mesh_cores_used:.2f}")
    lines += ["", "targets:"]
    lines += [f"  [{'met' if check.met else 'MISSED'}] {check.target}: {check.measured}" for check in report.targets]
    return "\n".join(lines)
