"""Which checks a call's `verify` level makes: how many other replicas check each hop, when a `sampled` call checks a
hop (hearth/services/orchestrator/verification.py carries them out), and what a check can come to (the outcomes of the
checks counter, which a bench reads back; this module imports nothing heavy)."""

from __future__ import annotations

# The outcomes of hearth_verification_checks_total (hearth/services/orchestrator/metrics.py).
CHECK_OUTCOMES = ("confirmed", "mismatch", "disputed", "no_replica", "canary_confirmed", "canary_mismatch",
                  "history_forgotten")
VERIFICATION_CHECKS_METRIC = "hearth_verification_checks_total"
# Other replicas that check each hop at a level: `vote` asks two (three replicas, majority).
MIRRORS_PER_LEVEL = {"none": 0, "sampled": 1, "all": 1, "vote": 2}


def sampled_check_due(*, first_step: bool, learned: bool, suspect: bool, draw: float,
                      sample_rate: float, record_filling: bool = False) -> str | None:
    """Why a hop of a `sampled` call is checked after a step (None: it is not): the chain's first step while its
    range's guard has not learned, an output the guard finds suspect, the chain's record past half its budget (it
    forgets only what checks read: else it would stop, and a host that sees a session's length would lie past it),
    or a draw in [0, 1) under the sample rate."""
    if first_step and not learned:
        return "first step"
    if suspect:
        return "guard"
    if record_filling:
        return "record filling"
    return "sampled" if draw < sample_rate else None
