"""The benchmark's targets (decode ratio, transport p95, construction time, concurrency, batching) checked against a
report."""

from __future__ import annotations

from hearth.services.devtools.bench.report import BenchReport, TargetCheck, baseline_name

transport_target_p95_ms = 1.0
ratio_target = 0.90
construct_target_ms = 20.0
# Issue 13: with this many concurrent sessions, the aggregate should reach `batching_target_factor` x one session.
batching_target_sessions = 8
batching_target_factor = 4.0


def target_checks(report: BenchReport) -> list[TargetCheck]:
    """Each target of the benchmark, what was measured against it, and whether it was met."""
    baseline = baseline_name(report.settings)
    measured = f"{report.ratio_median:.3f} x {baseline} with the same thread settings (median of rounds)"
    if report.ratio_vs_library_defaults is not None:
        measured += f"; {report.ratio_vs_library_defaults:.3f} x {baseline} with library defaults"
    checks = [TargetCheck(target=f"decode tokens/s >= {ratio_target:.2f} x monolithic {baseline}",
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
        if len(c.sessions) >= batching_target_sessions:
            checks.append(TargetCheck(
                target=f"{len(c.sessions)} sessions: aggregate tokens/s >= {batching_target_factor:.0f} x "
                       "single-session decode tokens/s (continuous batching)",
                measured=f"{c.aggregate_tokens_per_s:.2f} vs {c.single_session_decode_tokens_per_s:.2f}: "
                         f"{c.aggregate_tokens_per_s / c.single_session_decode_tokens_per_s:.2f} x"
                         + (f" ({c.all_decoding_tokens_per_s / c.single_session_decode_tokens_per_s:.2f} x while all "
                            "decode)" if c.all_decoding_tokens_per_s else ""),
                met=c.aggregate_tokens_per_s >= batching_target_factor * c.single_session_decode_tokens_per_s))
        if c.outputs_match_solo is not None:
            checks.append(TargetCheck(target=f"{len(c.sessions)} sessions: each one's tokens equal {baseline}'s for "
                                             "its prompt alone",
                                      measured="equal" if c.outputs_match_solo else "some differ" + (
                                          f" (the first {c.solo_tokens_agreeing} tokens agree in every session)"
                                          if c.solo_tokens_agreeing is not None else ""),
                                      met=c.outputs_match_solo))
        waited = [s.session for s in c.sessions if s.first_token_after_another_finished]
        checks.append(TargetCheck(
            target="no session waits for another to finish before its first token",
            measured=f"latest first token {max(s.ttft_ms for s in c.sessions):.0f} ms, earliest finish "
                     f"{min(s.finished_ms for s in c.sessions):.0f} ms" + (f"; waited: {waited}" if waited else ""),
            met=not waited))
    if report.burst is not None:
        burst = report.burst
        checks.append(TargetCheck(
            target=f"burst: {burst.requests} requests sent at once all complete (none refused)",
            measured=f"{burst.completed} completed, {sum(burst.refused.values())} refused; queue wait p50 "
                     f"{burst.queue_wait_ms_p50 or 0:.0f} ms, p95 {burst.queue_wait_ms_p95 or 0:.0f} ms",
            met=burst.completed == burst.requests and burst.outputs_match_solo))
    return checks
