"""The typed errors of the activation transport: bad frames, timeouts, use after close."""

from __future__ import annotations


class TransportError(RuntimeError):
    """Base class of every activation-transport failure."""


class FrameError(TransportError, ValueError):
    """A frame (or ack) whose headers or payload do not follow docs/protocol.md; the message names the header."""


class TransportTimeout(TransportError, TimeoutError):
    """A transport wait ran out of time; names the pipeline, hop and (when known) the session and step."""

    def __init__(
        self,
        message: str,
        *,
        pipeline_id: str,
        hop: int,
        session: str | None = None,
        step: int | None = None,
        waited_s: float,
        in_flight_chunks: int | None = None,
    ) -> None:
        super().__init__(message)
        self.pipeline_id = pipeline_id
        self.hop = hop
        self.session = session
        self.step = step
        self.waited_s = waited_s
        self.in_flight_chunks = in_flight_chunks


class WaitInterrupted(TransportError):
    """A wait for the next step was cut short by `interrupt_waiters()`: something else needs attention."""


class TransportClosed(TransportError):
    """The sender, receiver or observer was closed while (or before) it was used."""
