"""Per-hop transport timing (serialise, wire, deserialise, ack round trip) and counters, with p50/p95."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hearth.services.common.percentiles import nearest_rank

default_latency_samples = 4096


@dataclass(frozen=True)
class LatencySummary:
    count: int
    p50_ms: float | None
    p95_ms: float | None
    max_ms: float | None


class LatencySamples:
    """The most recent `max_samples` durations (seconds in, milliseconds out), for percentiles."""

    def __init__(self, max_samples: int = default_latency_samples) -> None:
        self._samples: deque[float] = deque(maxlen=max_samples)
        self.count = 0

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.count += 1

    def clear(self) -> None:
        self._samples.clear()

    def percentile_ms(self, fraction: float) -> float | None:
        """Nearest-rank percentile over the kept samples, in milliseconds; None when there are none."""
        value = nearest_rank(sorted(self._samples), fraction)
        return None if value is None else value * 1000.0

    def summary(self) -> LatencySummary:
        if not self._samples:
            return LatencySummary(self.count, None, None, None)
        return LatencySummary(
            count=self.count,
            p50_ms=self.percentile_ms(0.50),
            p95_ms=self.percentile_ms(0.95),
            max_ms=max(self._samples) * 1000.0,
        )


@dataclass
class SenderStats:
    """What one AckWindowSender did: `encode` is tensor -> wire bytes, `ack_rtt` publish -> ack received."""

    steps_sent: int = 0
    chunks_sent: int = 0
    bytes_sent: int = 0
    window_waits: int = 0
    timeouts: int = 0
    bad_acks: int = 0
    # Chunks settled by a later ack of their session because their own ack never came (lost in a reconnect).
    acks_lost: int = 0
    encode: LatencySamples = field(default_factory=LatencySamples)
    window_wait: LatencySamples = field(default_factory=LatencySamples)
    ack_rtt: LatencySamples = field(default_factory=LatencySamples)


@dataclass
class ReceiverStats:
    """What one ActivationReceiver saw: `wire` is first chunk published -> last chunk in hand (same clock
    on both ends, time.time_ns), `decode` is header parsing + reassembly + dtype restore of a step."""

    steps_received: int = 0
    chunks_received: int = 0
    bytes_received: int = 0
    duplicate_chunks: int = 0
    stale_chunks: int = 0
    bad_frames: int = 0
    # Frames whose declared step does not fit the pipeline (StepLimits): dropped before anything was allocated.
    refused_frames: int = 0
    # Frames without the link's MAC (forged or injected): dropped before their headers were read.
    unauthenticated_frames: int = 0
    # Of those, frames on a sealed link that were not sealed at all (sent in clear, or MACed only).
    unsealed_frames: int = 0
    dropped_steps: int = 0
    wire: LatencySamples = field(default_factory=LatencySamples)
    decode: LatencySamples = field(default_factory=LatencySamples)
