"""TextStream: turns generated token ids into correct text deltas and applies stop tokens and stop strings.

Decoding token by token is wrong for byte-level and SentencePiece tokenizers: one character may span
several tokens (a partial UTF-8 sequence decodes to U+FFFD until it completes) and a token's leading
space depends on what precedes it. The stream therefore re-decodes a short window of recent tokens and
emits only the new, complete suffix (the approach of text-generation-inference and vLLM). Text that
could still become the start of a stop string is held back until it is clear, so a client never sees
a stop string or a piece of one. A stream cut inside a character (max_tokens) ends with the characters before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE_CHARACTER = "\ufffd"


@dataclass(frozen=True)
class TextDelta:
    """What one generated token adds to the visible text, and whether generation is over."""

    token_id: int
    text: str
    finished: bool = False
    finish_reason: str | None = None


class TextStream:
    """Incremental detokenizer plus stop checker for one generation; not thread-safe (one per request)."""

    def __init__(
        self,
        tokenizer,
        *,
        stop_strings: Iterable[str] = (),
        stop_token_ids: Iterable[int] = (),
        prompt_ids: Sequence[int] = (),
    ):
        self._tokenizer = tokenizer
        self._stop_strings = tuple(s for s in stop_strings if s)
        self._stop_token_ids = frozenset(stop_token_ids)
        # A few prompt tokens give the first generated token the right leading space / merge context.
        self._token_ids = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._held_back = ""
        self.text = ""
        self.generated_ids: list[int] = []
        self.finished = False
        self.finish_reason: str | None = None

    def push(self, token_id: int) -> TextDelta:
        """Add one generated token; returns the text it makes visible (possibly "") and whether to stop."""
        if self.finished:
            raise RuntimeError("push() after the stream finished")
        token_id = int(token_id)
        self.generated_ids.append(token_id)
        if token_id in self._stop_token_ids:
            return self._finish(token_id, self._held_back, FINISH_STOP)
        self._token_ids.append(token_id)
        self._held_back += self._decode_new_text()
        return self._release(token_id)

    def finish(self, finish_reason: str = FINISH_LENGTH) -> TextDelta:
        """End the stream (e.g. at max_tokens): returns whatever text was still held back or undecoded, less a
        character whose bytes did not all come (the stream was cut inside it): dropped, never sent as U+FFFD."""
        if self.finished:
            return TextDelta(token_id=-1, text="", finished=True, finish_reason=self.finish_reason)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        tail = self._decode(self._token_ids[self._prefix_offset :])[len(prefix_text) :]
        # Text left undecoded ends in U+FFFD (_decode_new_text waits while it does): bytes of an unfinished character.
        return self._finish(-1, self._held_back + tail.rstrip(_INCOMPLETE_CHARACTER), finish_reason)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def _decode_new_text(self) -> str:
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_INCOMPLETE_CHARACTER):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._token_ids)
            return new_text[len(prefix_text) :]
        return ""

    def _release(self, token_id: int) -> TextDelta:
        pending = self._held_back
        match_at = min((pending.find(s) for s in self._stop_strings if s in pending), default=-1)
        if match_at >= 0:
            return self._finish(token_id, pending[:match_at], FINISH_STOP)
        keep = self._longest_stop_prefix_suffix(pending)
        self._held_back = pending[len(pending) - keep :] if keep else ""
        visible = pending[: len(pending) - keep]
        self.text += visible
        return TextDelta(token_id=token_id, text=visible)

    def _longest_stop_prefix_suffix(self, pending: str) -> int:
        longest = 0
        for stop in self._stop_strings:
            for length in range(min(len(stop) - 1, len(pending)), longest, -1):
                if pending.endswith(stop[:length]):
                    longest = length
                    break
        return longest

    def _finish(self, token_id: int, text: str, finish_reason: str) -> TextDelta:
        self._held_back = ""
        self.text += text
        self.finished = True
        self.finish_reason = finish_reason
        return TextDelta(token_id=token_id, text=text, finished=True, finish_reason=finish_reason)
