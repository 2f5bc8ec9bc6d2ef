"""Values read within their bounds: a value past them is read as the nearest one within them (text and lists cut,
numbers clamped) rather than refused, for messages whose reader must keep them: an event's reason, and a frame's
counts, timings, log-probabilities, texts and hops (docs/protocol.md, "Frames": "Reading a frame")."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Annotated

from pydantic import BeforeValidator, Field

from hearth.protocol.bounds import (
    lowest_logprob, max_frame_number, max_id_chars, max_label_chars, max_pipeline_hops, max_reason_chars,
    max_shard_id_chars,
)


def cut_text(limit: int) -> Callable[[object], object]:
    """A reading of a text that cuts it to `limit` characters (anything else is left to the field's own check)."""

    def cut(value: object) -> object:
        if not isinstance(value, str):
            return value
        # A lone surrogate (a JSON escape such as \ud800) is text no database, log or terminal can encode: "?".
        return value[:limit].encode("utf-8", "replace").decode("utf-8")

    return cut


def cut_list(limit: int) -> Callable[[object], object]:
    """A reading of a list that keeps its first `limit` items."""
    return lambda value: value[:limit] if isinstance(value, list) else value


def absent_unless_fits(limit: int) -> Callable[[object], object]:
    """A reading of an optional name that no reader can use unless whole: absent when empty or past `limit`
    characters."""
    return lambda value: None if isinstance(value, str) and not 0 < len(value) <= limit else value


def clamped(low: float, high: float, not_a_number: object = None) -> Callable[[object], object]:
    """A reading of a number that clamps it into [low, high] (infinities included); NaN reads as `not_a_number`
    (None: absent, where the field may be). Anything else is left to the field's own check."""

    def clamp(value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return value
        if math.isnan(value):
            return not_a_number
        return min(max(value, low), high)

    return clamp


def _measured(high: float) -> Callable[[object], object]:
    """A reading of a timing: negative reads as 0, past `high` as `high`, one that is no finite number as absent."""
    clamp = clamped(0, high)

    def read(value: object) -> object:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isfinite(value):
            return None
        return clamp(value)

    return read


read_measure = _measured(max_frame_number)
# Each type below is its bounded type (what the schemas publish) read through its reading first.
# A reason is for people to read: cut rather than refused, so a long error text never loses its message.
Reason = Annotated[Annotated[str, Field(max_length=max_reason_chars)], BeforeValidator(cut_text(max_reason_chars))]
# A name such as a finish reason: cut to its length.
CutLabel = Annotated[Annotated[str, Field(max_length=max_label_chars)], BeforeValidator(cut_text(max_label_chars))]
CutId = Annotated[Annotated[str, Field(max_length=max_id_chars)], BeforeValidator(cut_text(max_id_chars))]
CutShardId = Annotated[Annotated[str, Field(max_length=max_shard_id_chars)],
                       BeforeValidator(cut_text(max_shard_id_chars))]
# A pipeline's hops (shard ids in order), at most max_pipeline_hops of them.
CutHops = Annotated[Annotated[list[CutShardId], Field(max_length=max_pipeline_hops)],
                    BeforeValidator(cut_list(max_pipeline_hops))]
# How many of something (tokens, calls): negative reads as 0, a larger one as max_frame_number.
Count = Annotated[Annotated[int, Field(ge=0, le=max_frame_number)], BeforeValidator(clamped(0, max_frame_number))]
# A place in a queue, 1 the first.
Place = Annotated[Annotated[int, Field(ge=1, le=max_frame_number)], BeforeValidator(clamped(1, max_frame_number))]
# A duration or a rate: one that is no finite number reads as absent.
Measure = Annotated[Annotated[float, Field(ge=0, le=max_frame_number)] | None, BeforeValidator(read_measure)]
# A natural log-probability: never above 0; -infinity, NaN and anything lower read as lowest_logprob.
Logprob = Annotated[Annotated[float, Field(ge=lowest_logprob, le=0.0)],
                    BeforeValidator(clamped(lowest_logprob, 0.0, not_a_number=lowest_logprob))]
