"""Tables and the plot of a households sweep (scripts/bench_links_sweep.py): each point against its physical limit.

The physical limit of a point on a given bandwidth: one session's time per token is at least the compute time per
token (the 0 ms point's, same bandwidth, so a decode activation's time on the wire is in it) plus the latency every
token crosses (legs_per_token relay legs of RTT/2); several sessions together get at most the 0 ms aggregate (the
mesh's compute) and at most sessions / (that time per token) (each session's own tokens are sequential).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

from bench_links_sweep import LongPromptResult, PointResult, SweepResult

# The physical limit is a curve in RTT: drawn through this many steps between 0 and the largest RTT measured.
plot_grid_steps = 80


def load_sweep(path: Path) -> SweepResult:
    data = json.loads(path.read_text())
    data["points"] = [PointResult(**point) for point in data["points"]]
    data["long_prompts"] = [LongPromptResult(**long) for long in data["long_prompts"]]
    data["layer_ranges"] = [tuple(pair) for pair in data["layer_ranges"]]
    known = {item.name for item in fields(SweepResult)}
    return SweepResult(**{key: value for key, value in data.items() if key in known})


def _point(result: SweepResult, rate_mbit: float, rtt_ms: float, sessions: int) -> PointResult | None:
    for point in result.points:
        if (point.rate_mbit, point.rtt_ms, point.sessions) == (rate_mbit, rtt_ms, sessions):
            return point
    return None


def latency_per_token_s(result: SweepResult, rtt_ms: float) -> float:
    """The link latency one decode step crosses: legs_per_token legs of RTT/2."""
    return result.legs_per_token * rtt_ms / 2 / 1000


def limit_at(result: SweepResult, rate_mbit: float, rtt_ms: float, sessions: int) -> float | None:
    """The physical limit in tokens/s at this bandwidth, RTT and session count (None without the 0 ms points it is
    computed from)."""
    single_at_zero = _point(result, rate_mbit, 0.0, 1)
    if single_at_zero is None:
        return None
    return _limit(result, rate_mbit, rtt_ms, sessions, single_at_zero.decode_tokens_per_s)


def _limit(result: SweepResult, rate_mbit: float, rtt_ms: float, sessions: int,
           zero_tokens_per_s: float) -> float | None:
    seconds_per_token = 1 / zero_tokens_per_s + latency_per_token_s(result, rtt_ms)
    if sessions == 1:
        return 1 / seconds_per_token
    same_at_zero = _point(result, rate_mbit, 0.0, sessions)
    if same_at_zero is None:
        return None
    return min(same_at_zero.decode_tokens_per_s, sessions / seconds_per_token)


def limit_tokens_per_s(result: SweepResult, point: PointResult) -> float | None:
    """`point`'s physical limit, from the 0 ms runs taken in turn with it where there are some."""
    if point.paired_zero_decode_tokens_per_s is not None:
        return _limit(result, point.rate_mbit, point.rtt_ms, point.sessions, point.paired_zero_decode_tokens_per_s)
    return limit_at(result, point.rate_mbit, point.rtt_ms, point.sessions)


def _ratio(measured: float, limit: float | None) -> str:
    return "-" if limit is None else f"{measured / limit:.2f}"


def decode_table(result: SweepResult) -> list[str]:
    lines = ["| link | RTT | sessions | decode tokens/s | physical limit | measured / limit | "
             "/ same at 0 ms (in turn, 1 session) | TTFT (median) | TTFT - TTFT at 0 ms, in RTTs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for point in result.points:
        limit = limit_tokens_per_s(result, point)
        at_zero = _point(result, point.rate_mbit, 0.0, point.sessions)
        zero_tokens_per_s = point.paired_zero_decode_tokens_per_s or (at_zero and at_zero.decode_tokens_per_s)
        extra_rtts = "-" if at_zero is None or point.rtt_ms == 0 else \
            f"{(point.ttft_ms - at_zero.ttft_ms) / point.rtt_ms:.1f}"
        lines.append(
            f"| {point.rate_mbit:g} Mbit/s | {point.rtt_ms:g} ms | {point.sessions} | "
            f"{point.decode_tokens_per_s:.2f} | {'-' if limit is None else f'{limit:.2f}'} | "
            f"{_ratio(point.decode_tokens_per_s, limit)} | "
            f"{'-' if not zero_tokens_per_s else f'{point.decode_tokens_per_s / zero_tokens_per_s:.2f}'} | "
            f"{point.ttft_ms:.0f} ms | {extra_rtts} |")
    return lines


def long_prompt_table(result: SweepResult) -> list[str]:
    lines = ["| link | RTT | prompt tokens | TTFT | bytes up per household | one household's bytes at the link rate |",
             "|---|---|---|---|---|---|"]
    for long in result.long_prompts:
        most = max(long.bytes_up_per_household)
        wire_s = most * 8 / (long.rate_mbit * 1e6)
        lines.append(f"| {long.rate_mbit:g} Mbit/s | {long.rtt_ms:g} ms | {long.prompt_tokens} | "
                     f"{long.ttft_ms / 1000:.2f} s | {', '.join(f'{b / 1e6:.1f} MB' for b in long.bytes_up_per_household)}"
                     f" | {wire_s:.2f} s |")
    return lines


def plot_sweep(result: SweepResult, path: Path) -> None:
    """Tokens/s against RTT, one panel per bandwidth: measured and physical limit, one session and several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({point.rate_mbit for point in result.points}, reverse=True)
    session_counts = sorted({point.sessions for point in result.points})
    figure, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4.2), sharey=True, squeeze=False)
    for axis, rate in zip(axes[0], rates, strict=True):
        for sessions, colour in zip(session_counts, ("tab:blue", "tab:orange", "tab:green"), strict=False):
            points = sorted((p for p in result.points if p.rate_mbit == rate and p.sessions == sessions),
                            key=lambda p: p.rtt_ms)
            rtts = [p.rtt_ms for p in points]
            label = "1 session" if sessions == 1 else f"{sessions} sessions (aggregate)"
            axis.plot(rtts, [p.decode_tokens_per_s for p in points], "o-", color=colour, label=f"{label}, measured")
            grid = [max(rtts) * step / plot_grid_steps for step in range(plot_grid_steps + 1)]
            limits = [limit_at(result, rate, rtt, sessions) for rtt in grid]
            if all(limit is not None for limit in limits):
                axis.plot(grid, limits, "--", color=colour, label=f"{label}, physical limit")
            paired = [p for p in points if p.paired_zero_decode_tokens_per_s is not None]
            if paired:
                axis.plot([p.rtt_ms for p in paired], [limit_tokens_per_s(result, p) for p in paired], "x",
                          color=colour, label=f"{label}, limit from 0 ms runs in turn")
        axis.set_title(f"{rate:g} Mbit/s per household link")
        axis.set_xlabel("RTT per household link (ms)")
        axis.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("decode tokens/s")
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{result.model}, {result.households} shard hosts in {result.households} households, broker and "
                    f"orchestrator in the hub ({result.started_at[:10]})", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report_sweep(result: SweepResult, plot_path: Path | None) -> None:
    print(f"{result.model}, layers {result.layer_ranges}, one shard host per household; prompt {result.prompt_tokens} "
          f"tokens, {result.new_tokens} new; {result.legs_per_token} relay legs of RTT/2 per token; "
          f"{result.started_at}, load average {result.load_average_before} -> {result.load_average_after}")
    print("\n".join(decode_table(result)))
    if result.long_prompts:
        print()
        print("\n".join(long_prompt_table(result)))
    if plot_path is not None:
        plot_sweep(result, plot_path)
        print(f"plot: {plot_path}")
