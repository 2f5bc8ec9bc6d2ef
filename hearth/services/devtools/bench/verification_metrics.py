"""The orchestrator's verification checks as a bench reads them: its `hearth_verification_checks_total` counter
scraped from /metrics, the difference of two scrapes per outcome, and how many checks came to a verdict in it."""

from __future__ import annotations

from hearth.services.devtools.bench.transport_metrics import fetch_metrics_text

from hearth.services.orchestrator.check_policy import CHECK_OUTCOMES, VERIFICATION_CHECKS_METRIC
from hearth.services.orchestrator.check_policy import MIRRORS_PER_LEVEL as MIRRORS_PER_CHECK  # noqa: F401 (re-exported)

# The counter's samples as /metrics names them.
CHECKS_SAMPLE = VERIFICATION_CHECKS_METRIC
CONFIRMED, MISMATCH, DISPUTED, NO_REPLICA = CHECK_OUTCOMES[:4]


def parse_verification_checks(text: str) -> dict[str, float]:
    """Per outcome, the counter's value in one /metrics exposition (outcomes it does not show left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == CHECKS_SAMPLE:
                counts[sample.labels["outcome"]] = sample.value
    return counts


def scrape_verification_checks(url: str) -> dict[str, float]:
    """The orchestrator's verification counter now, per outcome (blocking: call it off the event loop)."""
    return parse_verification_checks(fetch_metrics_text(url))


def checks_between(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    """Per outcome, the checks counted between two scrapes (every outcome named, 0 where none)."""
    outcomes = {*CHECK_OUTCOMES, *after}
    return {outcome: int(after.get(outcome, 0.0) - before.get(outcome, 0.0)) for outcome in sorted(outcomes)}


def checks_with_verdict(delta: dict[str, int], level: str) -> int:
    """Checks that came to a verdict, from a difference of scrapes of calls at one level (at `all` and `vote` one per
    hop-step, at `sampled` one per hop covering every step it ran since its last): a check that found nothing wrong
    counts `confirmed` once per party it confirmed (the hop and each mirror), one that found a mismatch counts
    `mismatch` or `disputed` once."""
    mirrors = MIRRORS_PER_CHECK[level]
    if mirrors == 0:
        return 0
    return delta.get(CONFIRMED, 0) // (1 + mirrors) + delta.get(MISMATCH, 0) + delta.get(DISPUTED, 0)
